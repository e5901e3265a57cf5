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

use super::setsockopt::{enter, exit, ARG1, ARG2, EXIT_RET};
use crate::emit::{cfg, field, field_fast, syscall_arg};

#[tracepoint]
pub fn sys_enter_getsockopt(ctx: TracePointContext) -> u32 {
    let level: u64 = field_fast::<u64, ARG1>(&ctx, cfg(|c| &c.gso_level)).unwrap_or(u64::MAX);
    let optname: u64 = field_fast::<u64, ARG2>(&ctx, cfg(|c| &c.gso_optname)).unwrap_or(u64::MAX);
    enter(
        SOCKOPT_GET,
        level,
        optname,
        || 0,
        || field(&ctx, cfg(|c| &c.gso_optval)).unwrap_or(0),
    );
    0
}

#[tracepoint]
pub fn sys_exit_getsockopt(ctx: TracePointContext) -> u32 {
    exit(|| field_fast::<i64, EXIT_RET>(&ctx, cfg(|c| &c.sys_exit_ret)).unwrap_or(0));
    0
}

// The same on the syscall's function: `getsockopt(fd, level, optname, optval, optlen)`.

#[inline(always)]
fn enter_regs(regs: u64) {
    let level = syscall_arg(regs, 1).unwrap_or(u64::MAX);
    let optname = syscall_arg(regs, 2).unwrap_or(u64::MAX);
    enter(
        SOCKOPT_GET,
        level,
        optname,
        || 0,
        || syscall_arg(regs, 3).unwrap_or(0),
    );
}

#[fentry(function = "__x64_sys_getsockopt")]
pub fn getsockopt_syscall_fentry(ctx: FEntryContext) -> u32 {
    enter_regs(ctx.arg(0));
    0
}

#[fexit(function = "__x64_sys_getsockopt")]
pub fn getsockopt_syscall_fexit(ctx: FExitContext) -> u32 {
    exit(|| ctx.arg(1));
    0
}

#[kprobe]
pub fn getsockopt_syscall_kprobe(ctx: ProbeContext) -> u32 {
    enter_regs(ctx.arg(0).unwrap_or(0));
    0
}

#[kretprobe]
pub fn getsockopt_syscall_kretprobe(ctx: RetProbeContext) -> u32 {
    exit(|| ctx.ret());
    0
}
