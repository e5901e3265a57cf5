//! IPVS (kube-proxy's ipvs mode): which real server each connection was scheduled to, exact
//! packet counts per (virtual service, real server), packets on connections whose real server
//! was removed or set to weight 0, and the real-server table changes with the process that
//! made them. All kprobes/kretprobes on functions of the `ip_vs` module (aya 0.14 attaches
//! fentry only to vmlinux functions); userspace picks what to attach from kallsyms.
//!
//! - `ip_vs_conn_new` (return): a new connection, bound to its real server.
//! - `ip_vs_nat_xmit`/`ip_vs_nat_xmit_v6` (entry, `cp` is the second argument; NAT, the
//!   forwarding kube-proxy uses): a packet forwarded on a connection; counted per CPU; a real
//!   server of weight 0 makes it a stale packet (still forwarded).
//! - `ip_vs_conn_in_get_proto` (return): the connection lookup of an incoming packet. When
//!   the connection's real server is no longer available (removed), `ip_vs_in_hook` drops the
//!   packet without restarting the entry's timer, or with `expire_nodest_conn=1` expires the
//!   entry at once: a stale packet with that action.
//! - `ip_vs_conn_expire` (entry, the timer callback): the end of a connection reported stale.
//! - `ip_vs_add_dest`/`ip_vs_del_dest`/`ip_vs_edit_dest` (entry and return), and
//!   `ip_vs_add_service`/`ip_vs_edit_service` (entry and return), `ip_vs_unlink_service`.
//!
//! Struct member offsets come from the module's BTF at run time (`IpvsConfig::conn_*` etc.).
use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_jiffies64},
    macros::{kprobe, kretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use xtlock_common::{
    EventKind, IpvsConfig, IpvsEvent, IpvsKey, COMM_LEN, IPVS_ACTION_DROPPED, IPVS_ACTION_EXPIRED,
    IPVS_ACTION_FORWARDED, IPVS_ACTION_NONE, IPVS_DEST_GONE, IPVS_DEST_OK, IPVS_DEST_QUIESCENT,
    IPVS_OP_DEST_ADD, IPVS_OP_DEST_DEL, IPVS_OP_DEST_EDIT, IPVS_OP_EXPIRED, IPVS_OP_SCHEDULED,
    IPVS_OP_STALE, IPVS_OP_SVC_ADD, IPVS_OP_SVC_DEL, IPVS_OP_SVC_EDIT,
};

use crate::{
    emit::{count_in, header, ids, kread, now, output},
    IPVS_CONFIG, IPVS_COUNTS, IPVS_OVERFLOW, IPVS_STALE, IPVS_TABLE_OPS,
};

/// `IP_VS_DEST_F_AVAILABLE` in `flags`, or `IP_VS_DEST_CF_AVAILABLE` in `cflags` (the
/// same value): the real server is in its service's list.
const DEST_F_AVAILABLE: u32 = 0x0001;
/// `IP_VS_CONN_F_TEMPLATE`: a persistence template, not a connection.
const CONN_F_TEMPLATE: u32 = 0x1000;

/// A connection seen with a stale real server.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StaleConn {
    /// When its last event went out.
    pub last_ns: u64,
    /// When its last stale packet came.
    pub last_pkt_ns: u64,
    /// Stale packets since that event.
    pub pending: u64,
}

/// The offsets, once userspace filled them.
#[inline(always)]
fn config() -> Option<IpvsConfig> {
    let c = *IPVS_CONFIG.get(0)?;
    (c.ok != 0).then_some(c)
}

fn be16(base: u64, offset: u32) -> u16 {
    u16::from_be(kread::<u16>(base, offset).unwrap_or(0))
}

fn blank(op: u8) -> IpvsEvent {
    IpvsEvent {
        hdr: header(EventKind::Ipvs, now()),
        conn: 0,
        timer_left_ns: 0,
        packets: 0,
        last_packet_ns: 0,
        vaddr: [0; 16],
        caddr: [0; 16],
        daddr: [0; 16],
        vport: 0,
        cport: 0,
        dport: 0,
        af: 0,
        protocol: 0,
        op,
        dest_state: IPVS_DEST_OK,
        action: IPVS_ACTION_NONE,
        weight: 0,
        ret: 0,
        comm: [0; COMM_LEN],
        _pad: 0,
    }
}

/// The connection's addresses, ports and protocol into `ev`.
#[inline(always)]
fn read_conn(c: &IpvsConfig, cp: u64, ev: &mut IpvsEvent) {
    ev.conn = cp;
    ev.af = kread::<u16>(cp, c.conn_af).unwrap_or(0);
    ev.protocol = kread::<u16>(cp, c.conn_protocol).unwrap_or(0) as u8;
    ev.caddr = kread(cp, c.conn_caddr).unwrap_or([0; 16]);
    ev.vaddr = kread(cp, c.conn_vaddr).unwrap_or([0; 16]);
    ev.daddr = kread(cp, c.conn_daddr).unwrap_or([0; 16]);
    ev.cport = be16(cp, c.conn_cport);
    ev.vport = be16(cp, c.conn_vport);
    ev.dport = be16(cp, c.conn_dport);
}

/// Nanoseconds left on the connection's timer (0 when it is due or unknown).
#[inline(always)]
fn timer_left(c: &IpvsConfig, cp: u64) -> u64 {
    let expires: u64 = kread(cp, c.conn_timer_expires).unwrap_or(0);
    // SAFETY: plain helper call.
    let now = unsafe { bpf_jiffies64() };
    if expires > now {
        (expires - now).wrapping_mul(c.ns_per_jiffy)
    } else {
        0
    }
}

/// (state, weight) of a real server.
#[inline(always)]
fn dest_state(c: &IpvsConfig, dest: u64) -> (u8, i32) {
    // `cflags` (unsigned long) where the kernel has it, else `flags` (unsigned int).
    let flags: u32 = if c.dest_avail_wide != 0 {
        kread::<u64>(dest, c.dest_flags).map_or(DEST_F_AVAILABLE, |v| v as u32)
    } else {
        kread(dest, c.dest_flags).unwrap_or(DEST_F_AVAILABLE)
    };
    let weight: i32 = kread(dest, c.dest_weight).unwrap_or(1);
    if flags & DEST_F_AVAILABLE == 0 {
        (IPVS_DEST_GONE, weight)
    } else if weight == 0 {
        (IPVS_DEST_QUIESCENT, weight)
    } else {
        (IPVS_DEST_OK, weight)
    }
}

/// Adds one to this CPU's counter for the connection's (service, real server, state).
#[inline(always)]
fn count(c: &IpvsConfig, cp: u64, state: u8) {
    let key = IpvsKey {
        vaddr: kread(cp, c.conn_vaddr).unwrap_or([0; 16]),
        daddr: kread(cp, c.conn_daddr).unwrap_or([0; 16]),
        vport: be16(cp, c.conn_vport),
        dport: be16(cp, c.conn_dport),
        af: kread::<u16>(cp, c.conn_af).unwrap_or(0),
        protocol: kread::<u16>(cp, c.conn_protocol).unwrap_or(0) as u8,
        state,
    };
    count_in(&IPVS_COUNTS, &IPVS_OVERFLOW, &key);
}

/// A stale packet: an event for the first one of a connection, then at most one per
/// interval carrying the packets since the previous one.
#[inline(always)]
fn stale(c: &IpvsConfig, cp: u64, state: u8, weight: i32, action: u8) {
    let t = now();
    let packets = match IPVS_STALE.get_ptr_mut(&cp) {
        Some(s) => {
            // SAFETY: map value; concurrent updates from other CPUs only blur `pending`
            // (the exact count is in IPVS_COUNTS).
            let s = unsafe { &mut *s };
            s.pending += 1;
            s.last_pkt_ns = t;
            if t.saturating_sub(s.last_ns) < c.stale_interval_ns {
                return;
            }
            let p = s.pending;
            s.pending = 0;
            s.last_ns = t;
            p
        }
        None => {
            let _ = IPVS_STALE.insert(
                &cp,
                &StaleConn {
                    last_ns: t,
                    last_pkt_ns: t,
                    pending: 0,
                },
                0,
            );
            1
        }
    };
    let mut ev = blank(IPVS_OP_STALE);
    read_conn(c, cp, &mut ev);
    ev.packets = packets;
    ev.last_packet_ns = t;
    ev.dest_state = state;
    ev.weight = weight;
    ev.action = action;
    ev.timer_left_ns = timer_left(c, cp);
    output(&ev);
}

/// The configuration and the connection a probed function returned, when the offsets are
/// known and it returned one.
#[inline(always)]
fn returned_conn(ctx: &RetProbeContext) -> Option<(IpvsConfig, u64)> {
    let c = config()?;
    let cp: u64 = ctx.ret();
    (cp != 0).then_some((c, cp))
}

/// The configuration and the probed function's argument `n` (a kernel pointer), when the
/// offsets are known.
#[inline(always)]
fn config_and_arg(ctx: &ProbeContext, n: usize) -> Option<(IpvsConfig, u64)> {
    let c = config()?;
    let p = ctx.arg::<u64>(n)?;
    (p != 0).then_some((c, p))
}

#[kretprobe]
pub fn ipvs_conn_new(ctx: RetProbeContext) -> u32 {
    let Some((c, cp)) = returned_conn(&ctx) else {
        return 0;
    };
    let flags: u32 = kread(cp, c.conn_flags).unwrap_or(0);
    if flags & CONN_F_TEMPLATE != 0 {
        return 0;
    }
    let mut ev = blank(IPVS_OP_SCHEDULED);
    read_conn(&c, cp, &mut ev);
    let dest: u64 = kread(cp, c.conn_dest).unwrap_or(0);
    if dest != 0 {
        let (state, weight) = dest_state(&c, dest);
        ev.dest_state = state;
        ev.weight = weight;
    }
    ev.comm = bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]);
    output(&ev);
    0
}

#[kprobe]
pub fn ipvs_nat_xmit(ctx: ProbeContext) -> u32 {
    xmit(&ctx);
    0
}

#[kprobe]
pub fn ipvs_nat_xmit_v6(ctx: ProbeContext) -> u32 {
    xmit(&ctx);
    0
}

/// A packet forwarded on connection `cp` (the xmit function's second argument).
#[inline(always)]
fn xmit(ctx: &ProbeContext) {
    let Some((c, cp)) = config_and_arg(ctx, 1) else {
        return;
    };
    let dest: u64 = kread(cp, c.conn_dest).unwrap_or(0);
    let (state, weight) = if dest != 0 {
        dest_state(&c, dest)
    } else {
        (IPVS_DEST_OK, 0)
    };
    count(&c, cp, state);
    if state == IPVS_DEST_QUIESCENT {
        stale(&c, cp, state, weight, IPVS_ACTION_FORWARDED);
    }
}

#[kretprobe]
pub fn ipvs_conn_in_get(ctx: RetProbeContext) -> u32 {
    let Some((c, cp)) = returned_conn(&ctx) else {
        return 0;
    };
    let dest: u64 = kread(cp, c.conn_dest).unwrap_or(0);
    if dest == 0 {
        return 0;
    }
    let (state, weight) = dest_state(&c, dest);
    if state != IPVS_DEST_GONE {
        return 0;
    }
    let ipvs: u64 = kread(cp, c.conn_ipvs).unwrap_or(0);
    let expire_nodest: i32 = if ipvs != 0 {
        kread(ipvs, c.ipvs_expire_nodest).unwrap_or(0)
    } else {
        0
    };
    let action = if expire_nodest != 0 {
        IPVS_ACTION_EXPIRED
    } else {
        IPVS_ACTION_DROPPED
    };
    count(&c, cp, state);
    stale(&c, cp, state, weight, action);
    0
}

#[kprobe]
pub fn ipvs_conn_expire(ctx: ProbeContext) -> u32 {
    let Some((c, timer)) = config_and_arg(&ctx, 0) else {
        return 0;
    };
    let cp = timer.wrapping_sub(u64::from(c.conn_timer));
    // SAFETY: read of a map value, removed right after.
    let Some(s) = (unsafe { IPVS_STALE.get(&cp) }).copied() else {
        return 0;
    };
    let _ = IPVS_STALE.remove(&cp);
    let mut ev = blank(IPVS_OP_EXPIRED);
    read_conn(&c, cp, &mut ev);
    ev.packets = s.pending;
    ev.last_packet_ns = s.last_pkt_ns;
    let dest: u64 = kread(cp, c.conn_dest).unwrap_or(0);
    if dest != 0 {
        let (state, weight) = dest_state(&c, dest);
        ev.dest_state = state;
        ev.weight = weight;
    }
    output(&ev);
    0
}

/// Entry of a real-server table change: what was asked, kept until the return.
#[inline(always)]
fn dest_op(ctx: &ProbeContext, op: u8) {
    let (Some((c, svc)), Some(udest)) = (config_and_arg(ctx, 0), ctx.arg::<u64>(1)) else {
        return;
    };
    let mut ev = service_event(&c, op, svc);
    ev.daddr = kread(udest, c.udest_addr).unwrap_or([0; 16]);
    ev.dport = be16(udest, c.udest_port);
    ev.weight = kread(udest, c.udest_weight).unwrap_or(0);
    stash(&ev);
}

/// An event for a change of virtual service `svc` (a `struct ip_vs_service`), by the current
/// task.
#[inline(always)]
fn service_event(c: &IpvsConfig, op: u8, svc: u64) -> IpvsEvent {
    service_event_at(op, svc, [c.svc_af, c.svc_protocol, c.svc_addr, c.svc_port])
}

/// An event for a service described at `base` by the offsets of its af, protocol, address and
/// port (a `struct ip_vs_service` or the request, `struct ip_vs_service_user_kern`).
#[inline(always)]
fn service_event_at(op: u8, base: u64, [af, protocol, addr, port]: [u32; 4]) -> IpvsEvent {
    let mut ev = blank(op);
    ev.af = kread::<u16>(base, af).unwrap_or(0);
    ev.protocol = kread::<u16>(base, protocol).unwrap_or(0) as u8;
    ev.vaddr = kread(base, addr).unwrap_or([0; 16]);
    ev.vport = be16(base, port);
    ev.comm = bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]);
    ev
}

/// Keeps a table change's event until its function returns.
#[inline(always)]
fn stash(ev: &IpvsEvent) {
    let (_, tid) = ids();
    let _ = IPVS_TABLE_OPS.insert(&tid, ev, 0);
}

#[kprobe]
pub fn ipvs_add_service(ctx: ProbeContext) -> u32 {
    // ip_vs_add_service(ipvs, u, svc_p): the request (no service yet).
    let Some((c, u)) = config_and_arg(&ctx, 1) else {
        return 0;
    };
    let usvc = [c.usvc_af, c.usvc_protocol, c.usvc_addr, c.usvc_port];
    stash(&service_event_at(IPVS_OP_SVC_ADD, u, usvc));
    0
}

#[kprobe]
pub fn ipvs_edit_service(ctx: ProbeContext) -> u32 {
    let Some((c, svc)) = config_and_arg(&ctx, 0) else {
        return 0;
    };
    stash(&service_event(&c, IPVS_OP_SVC_EDIT, svc));
    0
}

/// `ip_vs_unlink_service(svc, cleanup)`: the service leaves the table (delete or flush). It
/// cannot fail: reported at entry.
#[kprobe]
pub fn ipvs_unlink_service(ctx: ProbeContext) -> u32 {
    let Some((c, svc)) = config_and_arg(&ctx, 0) else {
        return 0;
    };
    output(&service_event(&c, IPVS_OP_SVC_DEL, svc));
    0
}

#[kretprobe]
pub fn ipvs_add_service_ret(ctx: RetProbeContext) -> u32 {
    table_op_ret(&ctx);
    0
}

#[kretprobe]
pub fn ipvs_edit_service_ret(ctx: RetProbeContext) -> u32 {
    table_op_ret(&ctx);
    0
}

#[kprobe]
pub fn ipvs_add_dest(ctx: ProbeContext) -> u32 {
    dest_op(&ctx, IPVS_OP_DEST_ADD);
    0
}

#[kprobe]
pub fn ipvs_del_dest(ctx: ProbeContext) -> u32 {
    dest_op(&ctx, IPVS_OP_DEST_DEL);
    0
}

#[kprobe]
pub fn ipvs_edit_dest(ctx: ProbeContext) -> u32 {
    dest_op(&ctx, IPVS_OP_DEST_EDIT);
    0
}

#[kretprobe]
pub fn ipvs_add_dest_ret(ctx: RetProbeContext) -> u32 {
    table_op_ret(&ctx);
    0
}

#[kretprobe]
pub fn ipvs_del_dest_ret(ctx: RetProbeContext) -> u32 {
    table_op_ret(&ctx);
    0
}

#[kretprobe]
pub fn ipvs_edit_dest_ret(ctx: RetProbeContext) -> u32 {
    table_op_ret(&ctx);
    0
}

/// Return of a table change: the entry's event, with the result.
#[inline(always)]
fn table_op_ret(ctx: &RetProbeContext) {
    let (_, tid) = ids();
    // SAFETY: read of our own entry; removed right after.
    let Some(mut ev) = (unsafe { IPVS_TABLE_OPS.get(&tid) }).copied() else {
        return;
    };
    let _ = IPVS_TABLE_OPS.remove(&tid);
    let ret: i64 = ctx.ret();
    ev.ret = ret as i32;
    ev.hdr.ts_ns = now();
    output(&ev);
}
