//! Legacy xtables table swaps: `setsockopt(IPT_SO_SET_REPLACE / IPT_SO_SET_ADD_COUNTERS)`
//! and their ip6t, arpt and ebt twins. Their duration is the kernel's part of a hold.
use aya_ebpf::{
    helpers::bpf_probe_read_user,
    macros::{fentry, fexit, kprobe, kretprobe, tracepoint},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext, TracePointContext},
};
use xtlock_common::{
    EventKind, TableReplaceEvent, EBT_SO_SET_COUNTERS, EBT_SO_SET_ENTRIES, NFPROTO_ARP,
    NFPROTO_BRIDGE, NFPROTO_IPV4, NFPROTO_IPV6, SOCKOPT_GET, SOL_IP, SOL_IPV6, SYS_ENTER_ARG1,
    SYS_ENTER_ARG2, XT_GETINFO_NUM_ENTRIES, XT_SO_GET_ENTRIES, XT_SO_GET_INFO,
    XT_SO_SET_ADD_COUNTERS, XT_SO_SET_REPLACE, XT_TABLE_MAXNAMELEN,
};

use crate::{
    emit::{
        cfg, current_netns, field, field_at, field_fast, header, ids, inflight_add, inflight_any,
        inflight_in_slot, now, output,
    },
    SOCKOPT_INFLIGHT,
};

#[repr(C)]
#[derive(Clone, Copy)]
pub struct SockoptEnter {
    pub enter_ns: u64,
    /// The caller's buffer: a table read's answer is read from it at exit.
    pub optval: u64,
    pub level: u32,
    pub optname: u32,
    pub optlen: u32,
    pub head_ok: u32,
    /// 0: `setsockopt`; `SOCKOPT_GET`: `getsockopt`.
    pub dir: u32,
    pub head: ReplaceHead,
}

/// The common head of `ipt_replace`, `ip6t_replace`, `arpt_replace` and `ebt_replace`
/// (`nentries`, `entries_size` in ebtables'); `xt_counters_info` has `num_counters` where
/// `valid_hooks` is.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ReplaceHead {
    pub name: [u8; XT_TABLE_MAXNAMELEN],
    pub valid_hooks: u32,
    pub num_entries: u32,
    pub size: u32,
}

#[inline(always)]
fn is_xtables(level: u32, optname: u32, dir: u32) -> bool {
    if dir == SOCKOPT_GET {
        // iptables and ip6tables reads (ebtables and arptables reads are not followed).
        let xt = optname == XT_SO_GET_INFO || optname == XT_SO_GET_ENTRIES;
        return (level == SOL_IP || level == SOL_IPV6) && xt;
    }
    let xt = optname == XT_SO_SET_REPLACE || optname == XT_SO_SET_ADD_COUNTERS;
    let ebt = optname == EBT_SO_SET_ENTRIES || optname == EBT_SO_SET_COUNTERS;
    (level == SOL_IP && (xt || ebt)) || (level == SOL_IPV6 && xt)
}

/// Where a syscall's arguments sit in every kernel's `sys_enter_*` record (after the common
/// fields and `__syscall_nr`, 8 bytes each): read with direct loads there, the helper only
/// for another layout.
pub(crate) const ARG1: usize = SYS_ENTER_ARG1 as usize;
pub(crate) const ARG2: usize = SYS_ENTER_ARG2 as usize;
/// `ret` of every `sys_exit_*` record.
pub(crate) const EXIT_RET: usize = 16;

#[tracepoint]
pub fn sys_enter_setsockopt(ctx: TracePointContext) -> u32 {
    let level: u64 = field_fast::<u64, ARG1>(&ctx, cfg(|c| &c.sso_level)).unwrap_or(u64::MAX);
    let optname: u64 = field_fast::<u64, ARG2>(&ctx, cfg(|c| &c.sso_optname)).unwrap_or(u64::MAX);
    set_enter(&ctx, level, optname);
    0
}

/// A `setsockopt(fd, level, optname, optval, optlen)` begins (its length and buffer read
/// from the record only for a table write).
#[inline(always)]
fn set_enter(ctx: &TracePointContext, level: u64, optname: u64) {
    enter(
        0,
        level,
        optname,
        || field(ctx, cfg(|c| &c.sso_optlen)).unwrap_or(0),
        || field(ctx, cfg(|c| &c.sso_optval)).unwrap_or(0),
    );
}

/// [`sys_enter_setsockopt`] where the format file has `level` and `optname` at [`ARG1`] and
/// [`ARG2`] (userspace attaches it only there): the filter reads no configuration, so a
/// call that writes no table (`TCP_NODELAY` at every connect) touches no map at all, where
/// two transactions apart its configuration's cache line is cold (docs/performance.md).
#[tracepoint]
pub fn sys_enter_setsockopt_std(ctx: TracePointContext) -> u32 {
    // SAFETY: userspace checked that the format file has both there.
    let (level, optname) = unsafe { (field_at::<u64, ARG1>(&ctx), field_at::<u64, ARG2>(&ctx)) };
    set_enter(&ctx, level, optname);
    0
}

#[tracepoint]
pub fn sys_exit_setsockopt(ctx: TracePointContext) -> u32 {
    exit(|| field_fast::<i64, EXIT_RET>(&ctx, cfg(|c| &c.sys_exit_ret)).unwrap_or(0));
    0
}

// Netfilter's own options only, where fentry or kprobes attach: `nf_setsockopt(struct sock
// *sk, u_int8_t pf, int val, sockptr_t opt, unsigned int len)` (Linux >= 5.9) is called for
// the option numbers IP and IPv6 do not know themselves, so no other setsockopt of the node
// (`TCP_NODELAY` and keepalives at every connect) runs a program. `sockptr_t` is two words
// (the pointer, then whether it is a kernel one): `len` is the sixth, the return the
// seventh.

/// `pf` as the socket level the tracepoint programs see: ip6tables' is `SOL_IPV6`, iptables',
/// arptables' and ebtables' `SOL_IP`.
#[inline(always)]
fn nf_level(pf: u8) -> Option<u32> {
    match pf {
        NFPROTO_IPV4 | NFPROTO_ARP | NFPROTO_BRIDGE => Some(SOL_IP),
        NFPROTO_IPV6 => Some(SOL_IPV6),
        _ => None,
    }
}

/// A call of `nf_setsockopt` (`dir` 0) or `nf_getsockopt` (`SOCKOPT_GET`) begins: [`enter`]
/// with the socket level its `pf` stands for.
#[inline(always)]
pub(crate) fn nf_enter(dir: u32, pf: u8, val: i32, opt: u64, len: u32) {
    let Some(level) = nf_level(pf) else {
        return;
    };
    enter(
        dir,
        u64::from(level),
        val as u32 as u64,
        || u64::from(len),
        || opt,
    );
}

#[fentry(function = "nf_setsockopt")]
pub fn nf_setsockopt_fentry(ctx: FEntryContext) -> u32 {
    nf_enter(0, ctx.arg(1), ctx.arg(2), ctx.arg(3), ctx.arg(5));
    0
}

#[fexit(function = "nf_setsockopt")]
pub fn nf_setsockopt_fexit(ctx: FExitContext) -> u32 {
    // An `int`: the register's upper half is not part of it.
    exit(|| i64::from(ctx.arg::<i32>(6)));
    0
}

#[kprobe]
pub fn nf_setsockopt_kprobe(ctx: ProbeContext) -> u32 {
    nf_enter(
        0,
        ctx.arg(1).unwrap_or(u8::MAX),
        ctx.arg(2).unwrap_or(-1),
        ctx.arg(3).unwrap_or(0),
        ctx.arg(5).unwrap_or(0),
    );
    0
}

#[kretprobe]
pub fn nf_setsockopt_kretprobe(ctx: RetProbeContext) -> u32 {
    exit(|| i64::from(ctx.ret::<i32>()));
    0
}

/// A `setsockopt` (`dir` 0) or `getsockopt` (`SOCKOPT_GET`) call begins; xtables options
/// only. `optlen` is the length for a set, unused for a get (a pointer there).
#[inline(always)]
pub(crate) fn enter(
    dir: u32,
    level: u64,
    optname: u64,
    optlen: impl Fn() -> u64,
    optval: impl Fn() -> u64,
) {
    if !is_xtables(level as u32, optname as u32, dir) {
        return;
    }
    let enter_ns = now();
    let optlen = if dir == SOCKOPT_GET { 0 } else { optlen() };
    // The head of what the caller hands the kernel (its table, entries and size), from
    // its memory at entry: the kernel copies the same bytes right after. A read asks by
    // name the same way (`ipt_getinfo`, `ipt_get_entries` start with it).
    let ptr = optval();
    // SAFETY: a user pointer read with the helper that checks it; a bad one fails.
    let head = if ptr != 0 {
        unsafe { bpf_probe_read_user(ptr as *const ReplaceHead) }.ok()
    } else {
        None
    };
    let (_, tid) = ids();
    let enter = SockoptEnter {
        enter_ns,
        optval: ptr,
        level: level as u32,
        optname: optname as u32,
        optlen: optlen as u32,
        head_ok: u32::from(head.is_some()),
        dir,
        head: head.unwrap_or(ReplaceHead {
            name: [0; XT_TABLE_MAXNAMELEN],
            valid_hooks: 0,
            num_entries: 0,
            size: 0,
        }),
    };
    if SOCKOPT_INFLIGHT.insert(&tid, &enter, 0).is_ok() {
        inflight_add(tid, 1);
    }
}

/// The call returns: one record with the table, its entries and bytes, and the time. Every
/// call of the node returns here: its thread's slot of `INFLIGHT` says first whether any
/// kept call may be its own, and its return value is read only then.
#[inline(always)]
pub(crate) fn exit(ret: impl FnOnce() -> i64) {
    if !inflight_any() {
        return;
    }
    let (tgid, tid) = ids();
    if !inflight_in_slot(tid) {
        return;
    }
    // SAFETY: read of our own entry; removed right after.
    let Some(enter) = (unsafe { SOCKOPT_INFLIGHT.get(&tid) }).copied() else {
        return;
    };
    let _ = SOCKOPT_INFLIGHT.remove(&tid);
    inflight_add(tid, -1);
    let ret = ret();
    crate::pending::send_by(Some(tgid));
    let (num_entries, size, head_ok) = if enter.dir == SOCKOPT_GET {
        if enter.optname == XT_SO_GET_INFO {
            // The kernel's answer: `num_entries` and `size` of the table now.
            // SAFETY: as at entry, a checked user read.
            let answer = if ret == 0 && enter.head_ok != 0 {
                unsafe {
                    bpf_probe_read_user((enter.optval + XT_GETINFO_NUM_ENTRIES) as *const [u32; 2])
                }
                .ok()
            } else {
                None
            };
            match answer {
                Some([n, sz]) => (n, sz, 1),
                None => (0, 0, 0),
            }
        } else {
            // `ipt_get_entries`: the size asked for follows the name.
            (0, enter.head.valid_hooks, enter.head_ok)
        }
    } else if enter.optname == XT_SO_SET_ADD_COUNTERS {
        // `xt_counters_info`: `num_counters` follows the name.
        (enter.head.valid_hooks, 0, enter.head_ok)
    } else {
        (enter.head.num_entries, enter.head.size, enter.head_ok)
    };
    let ev = TableReplaceEvent {
        hdr: header(EventKind::TableReplace, now()),
        enter_ns: enter.enter_ns,
        ret,
        level: enter.level,
        optname: enter.optname,
        optlen: enter.optlen,
        _pad: 0,
        table: enter.head.name,
        num_entries,
        size,
        head_ok,
        dir: enter.dir,
        netns: current_netns(),
        _pad2: 0,
    };
    output(&ev);
}
