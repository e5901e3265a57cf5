//! Refusals: what a client sees when the node turns its connection away. ICMP destination
//! unreachable sent (`icmp:icmp_send`: netfilter's REJECT and the stack's own), TCP resets
//! sent by the stack (`tcp:tcp_send_reset`, with the kernel's reset reason since 6.10) and
//! resets received by the node's sockets (`tcp:tcp_receive_reset`: a pod refused by a
//! `REJECT --reject-with tcp-reset`, whose reset no tracepoint sees being sent).
//!
//! Each is counted exactly in a per-CPU hash keyed by hold, netns, kind, destination and
//! detail, like drops; the hold is the one `HOLD_NOW` has when it happens, so a count is
//! tied to a hold with no guess about intervals. Refusals are rare next to drops (one per
//! refused connection), so no cache sits in front of the map. Offsets come from the
//! tracepoints' format files (`REFUSAL_CONFIG`) and BTF (`CONFIG`).
use aya_ebpf::{
    macros::{btf_tracepoint, kprobe, tracepoint},
    programs::{BtfTracePointContext, ProbeContext, TracePointContext},
};
use xtlock_common::{
    EventKind, RefusalEvent, RefusalKey, TpAddr, DROP_FAMILY_INET, DROP_FAMILY_INET6, NO_FIELD,
    REFUSAL_ICMP_UNREACH, REFUSAL_NO_DETAIL, REFUSAL_RST_RECEIVED, REFUSAL_RST_SENT,
};

use crate::{
    emit::{btf_read, cfg, count_in, field, header, kread, netns_of, now, reserve, take_token},
    ANSWERED, HOLD_NOW, REFUSAL_CONFIG, REFUSAL_COUNTS, REFUSAL_OVERFLOW, REFUSAL_RATE,
};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
const ICMP_DEST_UNREACH: i32 = 3;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
/// `skb->network_header` when unset (`(u16)~0U`).
const HEADER_UNSET: u16 = 0xffff;

#[tracepoint]
pub fn tcp_send_reset(ctx: TracePointContext) -> u32 {
    let Some(c) = REFUSAL_CONFIG.get(0) else {
        return 0;
    };
    let mut key = blank(REFUSAL_RST_SENT);
    read_end(&ctx, &c.rst_local, &mut key);
    if let Some(r) = opt_field::<u32>(&ctx, c.rst_reason) {
        key.detail = r;
    }
    let skb: u64 = opt_field(&ctx, c.rst_skb).unwrap_or(0);
    let sk: u64 = opt_field(&ctx, c.rst_sk).unwrap_or(0);
    key.netns = netns(skb, sk);
    if skb != 0 {
        answered(skb);
    }
    count(&mut key);
    sample(&key, skb);
    0
}

#[tracepoint]
pub fn tcp_receive_reset(ctx: TracePointContext) -> u32 {
    let Some(c) = REFUSAL_CONFIG.get(0) else {
        return 0;
    };
    let mut key = blank(REFUSAL_RST_RECEIVED);
    read_end(&ctx, &c.rrst_remote, &mut key);
    let sk: u64 = opt_field(&ctx, c.rrst_sk).unwrap_or(0);
    key.netns = netns(0, sk);
    count(&mut key);
    sample(&key, 0);
    0
}

#[tracepoint]
pub fn icmp_send(ctx: TracePointContext) -> u32 {
    let Some(c) = REFUSAL_CONFIG.get(0) else {
        return 0;
    };
    if opt_field::<i32>(&ctx, c.icmp_type) != Some(ICMP_DEST_UNREACH) {
        return 0;
    }
    let code = opt_field::<i32>(&ctx, c.icmp_code);
    let skb: u64 = opt_field(&ctx, c.icmp_skb).unwrap_or(0);
    icmp_unreach(skb, code, |key| {
        // The tracepoint's own fields: ports only for UDP.
        if let Some(a) = opt_field::<[u8; 4]>(&ctx, c.icmp_daddr) {
            key.addr[..4].copy_from_slice(&a);
            key.family = DROP_FAMILY_INET;
        }
        key.port = opt_field(&ctx, c.icmp_dport).unwrap_or(0);
    });
    0
}

/// `icmp_send` as a BTF raw tracepoint, `(const struct sk_buff *skb, int type, int code)`:
/// no record is built before it runs, and the `sk_buff` (its head, device, netns) is read
/// with plain loads instead of helper calls; only the packet's bytes need one.
#[btf_tracepoint(function = "icmp_send")]
pub fn icmp_send_btf(ctx: BtfTracePointContext) -> u32 {
    if ctx.arg::<i32>(1) != ICMP_DEST_UNREACH {
        return 0;
    }
    let skb: *const u8 = ctx.arg(0);
    let mut key = blank(REFUSAL_ICMP_UNREACH);
    key.detail = ctx.arg::<i32>(2) as u32;
    if cfg(|c| &c.skb_ok) != 0 && !skb.is_null() {
        let head: u64 = btf_read(skb, cfg(|c| &c.skb_head));
        let nh: u16 = btf_read(skb, cfg(|c| &c.skb_network_header));
        if head != 0 && nh != HEADER_UNSET {
            let _ = dest_at(head + u64::from(nh), &mut key);
        }
        let dev: *const u8 = btf_read(skb, cfg(|c| &c.skb_dev));
        let net: *const u8 = if dev.is_null() {
            core::ptr::null()
        } else {
            btf_read(dev, cfg(|c| &c.dev_nd_net))
        };
        if !net.is_null() {
            key.netns = btf_read(net, cfg(|c| &c.net_ns_inum));
        }
    }
    if !skb.is_null() {
        answered(skb as u64);
    }
    count(&mut key);
    sample(&key, skb as u64);
    0
}

/// The fallback of `icmp_send` where the tracepoint does not exist (5.10, for one; Debian's
/// 6.1 has it): `__icmp_send(struct sk_buff *skb_in, int type, int code, ...)` at
/// its entry, the prototype checked against BTF by userspace. At the entry, so a message
/// the ICMP rate limits then hold back is counted too (the tracepoint fires after them).
#[kprobe]
pub fn icmp_send_kprobe(ctx: ProbeContext) -> u32 {
    if ctx.arg::<i32>(1) != Some(ICMP_DEST_UNREACH) {
        return 0;
    }
    let skb: u64 = ctx.arg(0).unwrap_or(0);
    icmp_unreach(skb, ctx.arg::<i32>(2), |_| {});
    0
}

/// Counts an ICMP destination unreachable answering `skb`: the destination from the
/// refused packet's own headers, else from `fallback`.
#[inline(always)]
fn icmp_unreach(skb: u64, code: Option<i32>, fallback: impl FnOnce(&mut RefusalKey)) {
    let mut key = blank(REFUSAL_ICMP_UNREACH);
    if let Some(code) = code {
        key.detail = code as u32;
    }
    if skb == 0 || cfg(|c| &c.skb_ok) == 0 || read_dest(skb, &mut key).is_none() {
        fallback(&mut key);
    }
    key.netns = netns(skb, 0);
    if skb != 0 {
        answered(skb);
    }
    count(&mut key);
    sample(&key, skb);
}

#[inline(always)]
fn blank(kind: u8) -> RefusalKey {
    RefusalKey {
        hold_start_ns: 0,
        addr: [0; 16],
        netns: 0,
        detail: REFUSAL_NO_DETAIL,
        port: 0,
        family: 0,
        kind,
        _pad: 0,
    }
}

/// A field of the record, when this kernel's tracepoint has it.
#[inline(always)]
fn opt_field<T>(ctx: &TracePointContext, off: u32) -> Option<T> {
    if off == NO_FIELD {
        return None;
    }
    field(ctx, off as usize).ok()
}

/// One end of the connection from the record: a sockaddr field, else separate fields.
#[inline(always)]
fn read_end(ctx: &TracePointContext, a: &TpAddr, key: &mut RefusalKey) {
    if a.sockaddr != NO_FIELD {
        let Some(sa) = opt_field::<[u8; 24]>(ctx, a.sockaddr) else {
            return;
        };
        let family = u16::from_ne_bytes([sa[0], sa[1]]);
        key.port = u16::from_be_bytes([sa[2], sa[3]]);
        if family == AF_INET {
            key.family = DROP_FAMILY_INET;
            key.addr[..4].copy_from_slice(&sa[4..8]);
        } else if family == AF_INET6 {
            key.family = DROP_FAMILY_INET6;
            key.addr.copy_from_slice(&sa[8..24]);
        }
        return;
    }
    key.port = opt_field(ctx, a.port).unwrap_or(0);
    let family: u16 = opt_field(ctx, a.family).unwrap_or(AF_INET);
    if family == AF_INET6 {
        if let Some(v6) = opt_field::<[u8; 16]>(ctx, a.addr6) {
            key.family = DROP_FAMILY_INET6;
            key.addr = v6;
        }
    } else if let Some(v4) = opt_field::<[u8; 4]>(ctx, a.addr4) {
        key.family = DROP_FAMILY_INET;
        key.addr[..4].copy_from_slice(&v4);
    }
}

/// Destination address and port of the IPv4 packet `skb` (what the client asked for).
#[inline(always)]
fn read_dest(skb: u64, key: &mut RefusalKey) -> Option<()> {
    set_dest(key, ipv4(skb)?);
    Some(())
}

/// [`read_dest`] of the IPv4 header at `ip`.
#[inline(always)]
fn dest_at(ip: u64, key: &mut RefusalKey) -> Option<()> {
    set_dest(key, ipv4_at(ip)?);
    Some(())
}

#[inline(always)]
fn set_dest(key: &mut RefusalKey, (hdr, ports): ([u8; 20], Option<(u16, u16)>)) {
    key.family = DROP_FAMILY_INET;
    key.addr[..4].copy_from_slice(&hdr[16..20]);
    if let Some((_, dport)) = ports {
        key.port = dport;
    }
}

/// The IPv4 header of the packet `skb`, and its TCP/UDP ports (first fragment only); `None`
/// when it is not IPv4 or cannot be read.
#[inline(always)]
fn ipv4(skb: u64) -> Option<([u8; 20], Option<(u16, u16)>)> {
    let head: u64 = kread(skb, cfg(|c| &c.skb_head) as u32)?;
    let nh: u16 = kread(skb, cfg(|c| &c.skb_network_header) as u32)?;
    if head == 0 || nh == HEADER_UNSET {
        return None;
    }
    ipv4_at(head + u64::from(nh))
}

/// [`ipv4`] of the header at `ip`: one read of the header and the ports when the header has
/// no options (a SYN's), else a second one for the ports.
#[inline(always)]
fn ipv4_at(ip: u64) -> Option<([u8; 20], Option<(u16, u16)>)> {
    let b: [u8; 24] = kread(ip, 0)?;
    if b[0] >> 4 != 4 {
        return None;
    }
    let mut hdr = [0u8; 20];
    hdr.copy_from_slice(&b[..20]);
    let frag_off = u16::from_be_bytes([b[6], b[7]]) & 0x1fff;
    let ports = if frag_off == 0 && (b[9] == IPPROTO_TCP || b[9] == IPPROTO_UDP) {
        let ihl = u64::from(b[0] & 0x0f) * 4;
        let p = if ihl == 20 {
            Some([b[20], b[21], b[22], b[23]])
        } else {
            kread::<[u8; 4]>(ip + ihl, 0)
        };
        p.map(|p| {
            (
                u16::from_be_bytes([p[0], p[1]]),
                u16::from_be_bytes([p[2], p[3]]),
            )
        })
    } else {
        None
    };
    Some((hdr, ports))
}

/// The packet's netns (its device's, else its socket's), else the socket's.
#[inline(always)]
fn netns(skb: u64, sk: u64) -> u32 {
    if cfg(|c| &c.skb_ok) == 0 {
        return 0;
    }
    if skb != 0 {
        let dev: u64 = kread(skb, cfg(|c| &c.skb_dev) as u32).unwrap_or(0);
        let ns = netns_of(skb, dev);
        if ns != 0 {
            return ns;
        }
    }
    if sk == 0 {
        return 0;
    }
    let net: u64 = kread(sk, cfg(|c| &c.sk_net) as u32).unwrap_or(0);
    if net == 0 {
        return 0;
    }
    kread(net, cfg(|c| &c.net_ns_inum) as u32).unwrap_or(0)
}

/// A sample of the refusal when this CPU has a token: the refused packet's addresses and
/// ports from `skb` (IPv4), else the key's destination alone.
#[inline(always)]
fn sample(key: &RefusalKey, skb: u64) {
    if take_token(&REFUSAL_RATE) {
        send_sample(key, skb);
    }
}

/// The sample, its token taken.
#[inline(always)]
fn send_sample(key: &RefusalKey, skb: u64) {
    // The sample names its hold: the hold's take goes first.
    crate::pending::send_by(None);
    let Some(mut entry) = reserve::<RefusalEvent>() else {
        return;
    };
    let mut ev = RefusalEvent {
        hdr: header(EventKind::Refusal, now()),
        hold_start_ns: key.hold_start_ns,
        netns: key.netns,
        detail: key.detail,
        kind: key.kind,
        family: key.family,
        l4proto: 0,
        _pad: 0,
        sport: 0,
        dport: key.port,
        saddr: [0; 16],
        daddr: key.addr,
    };
    if skb != 0 && cfg(|c| &c.skb_ok) != 0 {
        let _ = read_tuple(skb, &mut ev);
    }
    entry.write(ev);
    entry.submit(crate::emit::wake_flags::<RefusalEvent>(true));
}

/// The IPv4 packet's addresses, protocol and ports (rare: samples only).
#[inline(always)]
fn read_tuple(skb: u64, ev: &mut RefusalEvent) -> Option<()> {
    let (hdr, ports) = ipv4(skb)?;
    ev.family = DROP_FAMILY_INET;
    ev.l4proto = hdr[9];
    ev.saddr = [0; 16];
    ev.daddr = [0; 16];
    ev.saddr[..4].copy_from_slice(&hdr[12..16]);
    ev.daddr[..4].copy_from_slice(&hdr[16..20]);
    if let Some((sport, dport)) = ports {
        ev.sport = sport;
        ev.dport = dport;
    }
    Some(())
}

/// Remembers the packet answered, for the drop hook (see `ANSWERED`): no clock read, the
/// drop hook counts the frees since.
#[inline(always)]
fn answered(skb: u64) {
    if let Some(a) = ANSWERED.get_ptr_mut(0) {
        // SAFETY: per-CPU slot; programs of this CPU are its only writers, and the drop
        // hook's `frees` is a field of its own.
        unsafe {
            (*a).at_frees = (*a).frees;
            (*a).skb = skb;
        }
    }
}

/// Counts the refusal under its key, in the hold in progress if there is one.
#[inline(always)]
fn count(key: &mut RefusalKey) {
    if let Some(h) = HOLD_NOW.get(0) {
        key.hold_start_ns = h.start_ns;
    }
    count_in(&REFUSAL_COUNTS, &REFUSAL_OVERFLOW, key);
}

/// Whether the drop of `skb` is that of a packet a refusal just answered on this CPU: then
/// the refusal says it, and the drop is not counted again. Called for every freed packet,
/// before the reason filter: the slot is cleared at the answered packet's own free (an
/// unwatched NO_SOCKET after a UDP port unreachable, say), else the next packet in a
/// recycled `sk_buff` at that address, dropped for a watched reason, would be skipped.
#[inline(always)]
pub fn was_answered(skb: u64) -> bool {
    let Some(a) = ANSWERED.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU slot; this CPU is the only writer.
    unsafe {
        let frees = (*a).frees.wrapping_add(1);
        (*a).frees = frees;
        if (*a).skb != skb || skb == 0 {
            return false;
        }
        (*a).skb = 0;
        frees.wrapping_sub((*a).at_frees) <= xtlock_common::ANSWERED_WINDOW_FREES
    }
}
