//! Legacy xtables table reads: `getsockopt(IPT_SO_GET_INFO / IPT_SO_GET_ENTRIES)` and the
//! ip6t twins, the part of a hold spent copying the tables out (iptables-restore --noflush,
//! every `iptables -A`). Entry and exit share `setsockopt`'s bookkeeping: a thread is in one
//! call at a time. The answer of a GET_INFO (entries, bytes) is read from the caller's
//! buffer at exit.
use aya_ebpf::{
    macros::{fentry, fexit, kprobe, kretprobe, tracepoint},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext, TracePointContext},
};
use xtlock_common::SOCKOPT_GET;

use super::setsockopt::{enter, exit, nf_enter, ARG1, ARG2, EXIT_RET};
use crate::emit::{cfg, field, field_at, field_fast};

#[tracepoint]
pub fn sys_enter_getsockopt(ctx: TracePointContext) -> u32 {
    let level: u64 = field_fast::<u64, ARG1>(&ctx, cfg(|c| &c.gso_level)).unwrap_or(u64::MAX);
    let optname: u64 = field_fast::<u64, ARG2>(&ctx, cfg(|c| &c.gso_optname)).unwrap_or(u64::MAX);
    get_enter(&ctx, level, optname);
    0
}

/// A `getsockopt(fd, level, optname, optval, ...)` begins (its buffer read from the record
/// only for a table read).
#[inline(always)]
fn get_enter(ctx: &TracePointContext, level: u64, optname: u64) {
    enter(
        SOCKOPT_GET,
        level,
        optname,
        || 0,
        || field(ctx, cfg(|c| &c.gso_optval)).unwrap_or(0),
    );
}

/// [`sys_enter_getsockopt`] where the format file has `level` and `optname` at [`ARG1`] and
/// [`ARG2`] (userspace attaches it only there): the filter reads no configuration, so a
/// call that reads no table (the `SO_ERROR` read after every non-blocking connect, nft's
/// `SO_SNDBUF` before each batch) touches no map at all.
#[tracepoint]
pub fn sys_enter_getsockopt_std(ctx: TracePointContext) -> u32 {
    // SAFETY: userspace checked that the format file has both there.
    let (level, optname) = unsafe { (field_at::<u64, ARG1>(&ctx), field_at::<u64, ARG2>(&ctx)) };
    get_enter(&ctx, level, optname);
    0
}

#[tracepoint]
pub fn sys_exit_getsockopt(ctx: TracePointContext) -> u32 {
    exit(|| field_fast::<i64, EXIT_RET>(&ctx, cfg(|c| &c.sys_exit_ret)).unwrap_or(0));
    0
}

// Netfilter's own options only, where fentry or kprobes attach: `nf_getsockopt(struct sock
// *sk, u_int8_t pf, int val, char __user *opt, int *len)` is called for the option numbers
// IP and IPv6 do not know themselves, so the `SO_ERROR` read after every non-blocking
// connect, and every other getsockopt of the node, runs no program at all.

#[fentry(function = "nf_getsockopt")]
pub fn nf_getsockopt_fentry(ctx: FEntryContext) -> u32 {
    nf_enter(SOCKOPT_GET, ctx.arg(1), ctx.arg(2), ctx.arg(3), 0);
    0
}

#[fexit(function = "nf_getsockopt")]
pub fn nf_getsockopt_fexit(ctx: FExitContext) -> u32 {
    // An `int`: the register's upper half is not part of it.
    exit(|| i64::from(ctx.arg::<i32>(5)));
    0
}

#[kprobe]
pub fn nf_getsockopt_kprobe(ctx: ProbeContext) -> u32 {
    nf_enter(
        SOCKOPT_GET,
        ctx.arg(1).unwrap_or(u8::MAX),
        ctx.arg(2).unwrap_or(-1),
        ctx.arg(3).unwrap_or(0),
        0,
    );
    0
}

#[kretprobe]
pub fn nf_getsockopt_kretprobe(ctx: RetProbeContext) -> u32 {
    exit(|| i64::from(ctx.ret::<i32>()));
    0
}
