//! Conntrack refusing a new connection, in the kernel functions that refuse it:
//! - `__nf_conntrack_confirm` returning `NF_DROP`: the `insert_failed` path (a clash it could
//!   not resolve, a hash chain too long, an entry dying under it). The connection is the
//!   packet's: `skb->_nfct`, its original tuple.
//! - `__nf_conntrack_alloc` returning an error pointer: the table is full and nothing could be
//!   evicted early (the kernel's "table full, dropping packet"). The tuple is its `orig`
//!   argument.
//!
//! fexit sees arguments and return value at once; kprobe/kretprobe keep the arguments per
//! thread from entry to return. Offsets come from `CT_CONFIG` (userspace, from BTF).
use aya_ebpf::{
    helpers::bpf_get_current_comm,
    macros::{fexit, kprobe, kretprobe},
    programs::{FExitContext, ProbeContext, RetProbeContext},
};
use xtlock_common::{
    ConntrackFailEvent, CtConfig, EventKind, CT_FAIL_INSERT, CT_FAIL_TABLE_FULL, DROP_FAMILY_INET,
    DROP_FAMILY_INET6, DROP_FAMILY_NONE,
};

use crate::{
    emit::{header, ids, kread, now, output},
    CT_CONFIG, CT_INFLIGHT,
};

const NF_DROP: i32 = 0;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
/// `NFCT_PTRMASK`: the low bits of `skb->_nfct` are the ctinfo.
const NFCT_PTRMASK: u64 = !7;
/// `IS_ERR_VALUE`: the last page of the address space holds the error codes.
const MAX_ERRNO: u64 = 4095;

/// An argument kept from entry to return: the skb (confirm) or the orig tuple and net (alloc).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CtEnter {
    pub arg: u64,
    pub net: u64,
}

#[inline(always)]
fn config() -> Option<CtConfig> {
    CT_CONFIG.get(0).copied().filter(|c| c.ok != 0)
}

#[inline(always)]
fn emit(what: u8, tuple: u64, net: u64, c: &CtConfig) {
    let l3num: u16 = kread(tuple, c.src_l3num).unwrap_or(0);
    let mut saddr: [u8; 16] = kread(tuple, c.src_u3).unwrap_or([0; 16]);
    let mut daddr: [u8; 16] = kread(tuple, c.dst_u3).unwrap_or([0; 16]);
    let family = match l3num {
        AF_INET => {
            saddr[4..].fill(0);
            daddr[4..].fill(0);
            DROP_FAMILY_INET
        }
        AF_INET6 => DROP_FAMILY_INET6,
        _ => DROP_FAMILY_NONE,
    };
    let sport: u16 = kread(tuple, c.src_port).unwrap_or(0);
    let dport: u16 = kread(tuple, c.dst_port).unwrap_or(0);
    let netns = if net == 0 {
        0
    } else {
        kread(net, c.net_inum).unwrap_or(0)
    };
    let ev = ConntrackFailEvent {
        hdr: header(EventKind::ConntrackFail, now()),
        netns,
        what,
        l4proto: kread(tuple, c.dst_protonum).unwrap_or(0),
        family,
        _pad0: 0,
        saddr,
        daddr,
        sport: u16::from_be(sport),
        dport: u16::from_be(dport),
        _pad: 0,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    };
    output(&ev);
}

#[inline(always)]
fn confirm_returned(skb: u64, ret: i32) {
    if ret != NF_DROP {
        return;
    }
    let Some(c) = config() else { return };
    let nfct: u64 = kread(skb, c.skb_nfct).unwrap_or(0);
    let ct = nfct & NFCT_PTRMASK;
    if ct == 0 {
        return;
    }
    let net: u64 = kread(ct, c.ct_net).unwrap_or(0);
    emit(CT_FAIL_INSERT, ct + u64::from(c.ct_tuple), net, &c);
}

#[inline(always)]
fn alloc_returned(net: u64, orig: u64, ret: u64) {
    if ret < MAX_ERRNO.wrapping_neg() {
        return;
    }
    let Some(c) = config() else { return };
    emit(CT_FAIL_TABLE_FULL, orig, net, &c);
}

#[inline(always)]
fn keep(arg: u64, net: u64) {
    let (_, tid) = ids();
    let _ = CT_INFLIGHT.insert(&tid, &CtEnter { arg, net }, 0);
}

#[inline(always)]
fn take() -> Option<CtEnter> {
    let (_, tid) = ids();
    // SAFETY: read of our own entry; removed right after.
    let e = unsafe { CT_INFLIGHT.get(&tid) }.copied();
    let _ = CT_INFLIGHT.remove(&tid);
    e
}

/// `int __nf_conntrack_confirm(struct sk_buff *skb)`.
#[fexit(function = "__nf_conntrack_confirm")]
pub fn ct_confirm_fexit(ctx: FExitContext) -> u32 {
    confirm_returned(ctx.arg(0), ctx.arg(1));
    0
}

#[kprobe]
pub fn ct_confirm_kprobe(ctx: ProbeContext) -> u32 {
    keep(ctx.arg(0).unwrap_or(0), 0);
    0
}

#[kretprobe]
pub fn ct_confirm_kretprobe(ctx: RetProbeContext) -> u32 {
    if let Some(e) = take() {
        confirm_returned(e.arg, ctx.ret());
    }
    0
}

/// `struct nf_conn *__nf_conntrack_alloc(struct net *net, const struct nf_conntrack_zone
/// *zone, const struct nf_conntrack_tuple *orig, const struct nf_conntrack_tuple *repl,
/// gfp_t gfp, u32 hash)`.
#[fexit(function = "__nf_conntrack_alloc")]
pub fn ct_alloc_fexit(ctx: FExitContext) -> u32 {
    alloc_returned(ctx.arg(0), ctx.arg(2), ctx.arg(6));
    0
}

#[kprobe]
pub fn ct_alloc_kprobe(ctx: ProbeContext) -> u32 {
    keep(ctx.arg(2).unwrap_or(0), ctx.arg(0).unwrap_or(0));
    0
}

#[kretprobe]
pub fn ct_alloc_kretprobe(ctx: RetProbeContext) -> u32 {
    if let Some(e) = take() {
        alloc_returned(e.net, e.arg, ctx.ret());
    }
    0
}
