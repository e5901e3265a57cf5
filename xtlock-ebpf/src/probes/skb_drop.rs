//! Packet drops: `skb:kfree_skb` (drop reason and the kernel address that freed the packet).
//!
//! `kfree_skb` can fire millions of times a second during a flood, so the order of work is:
//! whether a refusal answered this packet (one per-CPU array lookup: its slot must be cleared
//! at the packet's free whatever the reason, or a recycled `sk_buff` at the same address
//! would be taken for it), the reason filter (one array lookup) and nothing else for unwatched reasons; then an
//! exact count in a per-CPU hash keyed by (location, reason, netns); and only when this CPU's
//! rate limiter has a token, a sample with the packet's addresses through the ring buffer.
//! No ring-buffer traffic without a token, so a flood cannot turn into a lost-event storm.
//!
//! Two entry points, one body. `tp_btf/kfree_skb` (tried first) gets the tracepoint's
//! arguments with no perf record built before it runs, and reads `sk_buff`, `net_device`,
//! `net` and `sock` members with plain loads the verifier checks against BTF; the perf
//! tracepoint `skb:kfree_skb` (the fallback) reads its record at format-file offsets and the
//! members with `bpf_probe_read_kernel`. Member offsets come from the kernel's BTF, read by
//! userspace. Packet bytes (samples only) are always read with the helper.
use aya_ebpf::{
    macros::{btf_tracepoint, tracepoint},
    programs::{BtfTracePointContext, TracePointContext},
};
use xtlock_common::{
    drop_cache_slot, DropEvent, DropKey, EventKind, HoldDropSlot, ProbeConfig, DROP_FAMILY_INET,
    DROP_FAMILY_INET6, DROP_FAMILY_NONE, DROP_REASON_SLOTS, DROP_WATCH_BITS, DROP_WATCH_WORDS,
    HOLD_DROP_REASONS, HOLD_DROP_SLOTS,
};

use crate::{
    emit::{
        btf_read, cfg, count_in, field, field_fast, header, kread, netns_of, now, reserve,
        take_token,
    },
    probes::refusal::was_answered,
    CONFIG, DROP_CACHE, DROP_COUNTS, DROP_OVERFLOW, DROP_RATE, DROP_REASONS, HOLD_DROPS, HOLD_NOW,
};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMPV6: u8 = 58;
/// `skb->network_header` when unset (`(u16)~0U`).
const HEADER_UNSET: u16 = 0xffff;

#[tracepoint]
pub fn kfree_skb(ctx: TracePointContext) -> u32 {
    let _ = try_kfree_skb(&ctx);
    0
}

/// The floor the drop hook is measured against (`xtlock trace --bench-floor-drops`, for
/// `cargo xtask bench --only drops`): the attach point and type of [`kfree_skb_btf`], and no
/// work at all.
#[btf_tracepoint(function = "kfree_skb")]
pub fn kfree_skb_btf_floor(_ctx: BtfTracePointContext) -> u32 {
    0
}

#[btf_tracepoint(function = "kfree_skb")]
pub fn kfree_skb_btf(ctx: BtfTracePointContext) -> u32 {
    let reason: u32 = if cfg(|c| &c.rkd_has_reason) != 0 {
        ctx.arg(2)
    } else {
        0
    };
    let skb: *const u8 = ctx.arg(0);
    // Before the filter: an answered packet's slot is cleared whatever its drop reason (see
    // `refusal::was_answered`).
    if was_answered(skb as u64) || !watched(reason) {
        return 0;
    }
    let location: u64 = ctx.arg(1);
    let (dev, netns) = if cfg(|c| &c.skb_ok) != 0 && !skb.is_null() {
        let dev: *const u8 = btf_read(skb, cfg(|c| &c.skb_dev));
        let net: *const u8 = if !dev.is_null() {
            btf_read(dev, cfg(|c| &c.dev_nd_net))
        } else {
            let sk: *const u8 = btf_read(skb, cfg(|c| &c.skb_sk));
            if sk.is_null() {
                core::ptr::null()
            } else {
                btf_read(sk, cfg(|c| &c.sk_net))
            }
        };
        let netns: u32 = if net.is_null() {
            0
        } else {
            btf_read(net, cfg(|c| &c.net_ns_inum))
        };
        (dev as u64, netns)
    } else {
        (0, 0)
    };
    on_drop(location, reason, netns, skb as u64, dev, || {
        if skb.is_null() {
            0
        } else {
            u16::from_be(btf_read::<u16>(skb, cfg(|c| &c.skb_protocol)))
        }
    });
    0
}

#[inline(always)]
fn config() -> ProbeConfig {
    // SAFETY: CONFIG is a static that lives for the program's lifetime; volatile because the
    // value is patched in after compile.
    unsafe { core::ptr::read_volatile(&CONFIG) }
}

/// The reason filter, before any other work: a bit of `CONFIG` for the kernel's own
/// reasons, one array lookup for the others.
#[inline(always)]
fn watched(reason: u32) -> bool {
    // Read back through memory: the compiler then tests and indexes with one 32-bit value,
    // where it would index with the argument's untruncated register, whose bound the
    // verifier does not know.
    // SAFETY: a read of a local.
    let reason = unsafe { core::ptr::read_volatile(&reason) };
    if reason < DROP_WATCH_BITS {
        let word = cfg(|c| &c.drop_watch[(reason / 32) as usize & (DROP_WATCH_WORDS - 1)]);
        return (word >> (reason % 32)) & 1 != 0;
    }
    let slot = if reason < DROP_REASON_SLOTS - 1 {
        reason
    } else {
        DROP_REASON_SLOTS - 1
    };
    matches!(DROP_REASONS.get(slot), Some(v) if *v != 0)
}

fn try_kfree_skb(ctx: &TracePointContext) -> Result<(), i32> {
    let reason: u32 = if cfg(|c| &c.kd_has_reason) != 0 {
        field(ctx, cfg(|c| &c.kd_reason))?
    } else {
        0
    };
    // `skbaddr` is at 8 in every kernel's format: a direct load, no helper call.
    let skb: u64 = field_fast::<u64, 8>(ctx, cfg(|c| &c.kd_skbaddr))?;
    if was_answered(skb) || !watched(reason) {
        return Ok(());
    }
    let location: u64 = field(ctx, cfg(|c| &c.kd_location))?;
    let (dev, netns) = if cfg(|c| &c.skb_ok) != 0 {
        let dev: u64 = kread(skb, cfg(|c| &c.skb_dev) as u32).unwrap_or(0);
        (dev, netns_of(skb, dev))
    } else {
        (0, 0)
    };
    on_drop(location, reason, netns, skb, dev, || {
        field(ctx, cfg(|c| &c.kd_protocol)).unwrap_or(0)
    });
    Ok(())
}

/// The exact count, the hold's count, and a sample when this CPU has a token.
#[inline(always)]
fn on_drop(location: u64, reason: u32, netns: u32, skb: u64, dev: u64, protocol: impl Fn() -> u16) {
    count_drop(&DropKey {
        location,
        reason,
        netns,
    });
    count_for_hold(reason);
    if !take_token(&DROP_RATE) {
        return;
    }
    let protocol = protocol();
    // The sample names its hold: the hold's take goes first.
    crate::pending::send_by(None);
    let Some(mut entry) = reserve::<DropEvent>() else {
        return;
    };
    let mut ev = DropEvent {
        hdr: header(EventKind::Drop, now()),
        location,
        netns,
        ifindex: 0,
        reason,
        ethertype: protocol,
        l4proto: 0,
        family: DROP_FAMILY_NONE,
        saddr: [0; 16],
        daddr: [0; 16],
        sport: 0,
        dport: 0,
        _pad: 0,
    };
    // Samples are rare (rate-limited): the whole configuration is read once here.
    let c = config();
    if c.skb_ok != 0 {
        if dev != 0 {
            ev.ifindex = kread::<i32>(dev, c.dev_ifindex).unwrap_or(0) as u32;
        }
        let _ = read_packet(&c, skb, &mut ev);
    }
    entry.write(ev);
    entry.submit(crate::emit::wake_flags::<DropEvent>(true));
}

/// The exact count: in this CPU's cache slot for the key when the slot is the key's or free,
/// else in the per-CPU hash map (see `DropCache`).
#[inline(always)]
fn count_drop(key: &DropKey) {
    if let Some(c) = DROP_CACHE.get_ptr_mut(0) {
        // SAFETY: per-CPU value; this CPU is the only writer. The index is masked below the
        // slot count.
        let s = unsafe { &mut (*c).slots[drop_cache_slot(key)] };
        if s.count == 0 {
            s.key = *key;
            s.count = 1;
            return;
        }
        if s.key == *key {
            s.count += 1;
            return;
        }
    }
    count_in(&DROP_COUNTS, &DROP_OVERFLOW, key);
}

/// Adds the drop to the hold of a watched lock in progress, if one is, and to its reason's
/// entry in the hold's slot: no map lookup beyond the slot's, entries claimed in order so
/// the first free one ends the search (at most `HOLD_DROP_REASONS` compares, unrolled).
#[inline(always)]
fn count_for_hold(reason: u32) {
    let Some(h) = HOLD_NOW.get(0) else {
        return;
    };
    let start_ns = h.start_ns;
    if start_ns == 0 {
        return;
    }
    let Some(slot) = HOLD_DROPS.get_ptr_mut((h.seq % u64::from(HOLD_DROP_SLOTS)) as u32) else {
        return;
    };
    // SAFETY: per-CPU slot; this CPU is the only writer.
    let s = unsafe { &mut *slot };
    if s.start_ns != start_ns {
        *s = HoldDropSlot {
            start_ns,
            ..HoldDropSlot::default()
        };
    }
    s.count += 1;
    for i in 0..HOLD_DROP_REASONS {
        if s.counts[i] == 0 {
            s.reasons[i] = reason;
            s.counts[i] = 1;
            return;
        }
        if s.reasons[i] == reason {
            s.counts[i] = s.counts[i].wrapping_add(1);
            return;
        }
    }
}

/// Addresses, protocol and ports of an IPv4/IPv6 packet, from its network header.
#[inline(always)]
fn read_packet(c: &ProbeConfig, skb: u64, ev: &mut DropEvent) -> Option<()> {
    let head: u64 = kread(skb, c.skb_head)?;
    let nh: u16 = kread(skb, c.skb_network_header)?;
    if head == 0 || nh == HEADER_UNSET {
        return Some(());
    }
    let ip = head + u64::from(nh);
    let first: u8 = kread(ip, 0)?;
    let version = first >> 4;
    let transport;
    if (ev.ethertype == ETH_P_IP || ev.ethertype == 0) && version == 4 {
        let hdr: [u8; 20] = kread(ip, 0)?;
        ev.family = DROP_FAMILY_INET;
        ev.l4proto = hdr[9];
        ev.saddr[..4].copy_from_slice(&hdr[12..16]);
        ev.daddr[..4].copy_from_slice(&hdr[16..20]);
        // Only the first fragment carries the ports.
        let frag_off = u16::from_be_bytes([hdr[6], hdr[7]]) & 0x1fff;
        if frag_off != 0 {
            return Some(());
        }
        transport = ip + u64::from(first & 0x0f) * 4;
    } else if (ev.ethertype == ETH_P_IPV6 || ev.ethertype == 0) && version == 6 {
        let hdr: [u8; 40] = kread(ip, 0)?;
        ev.family = DROP_FAMILY_INET6;
        ev.l4proto = hdr[6];
        ev.saddr.copy_from_slice(&hdr[8..24]);
        ev.daddr.copy_from_slice(&hdr[24..40]);
        // Extension headers are not walked: past them the transport header is unknown.
        transport = ip + 40;
    } else {
        return Some(());
    }
    match ev.l4proto {
        IPPROTO_TCP | IPPROTO_UDP => {
            let ports: [u8; 4] = kread(transport, 0)?;
            ev.sport = u16::from_be_bytes([ports[0], ports[1]]);
            ev.dport = u16::from_be_bytes([ports[2], ports[3]]);
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let tc: [u8; 2] = kread(transport, 0)?;
            ev.sport = u16::from(tc[0]);
            ev.dport = u16::from(tc[1]);
        }
        _ => {}
    }
    Some(())
}
