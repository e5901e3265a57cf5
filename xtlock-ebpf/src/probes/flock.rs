//! The xtables lock: `filelock:flock_lock_inode` (takes, failed tries, deferrals and
//! releases on the watched inodes) and `syscalls:sys_{enter,exit}_flock` (when a `flock()`
//! call started, its flags, and how it ended: granted, `-EAGAIN`, or `-EINTR` from
//! iptables' `alarm()`).
//!
//! Where the syscall tracepoints cannot be used, the same two steps hang off the syscall's
//! function (`__x64_sys_flock` or its arch's name, picked by userspace): fentry/fexit, else
//! kprobe/kretprobe. Its one argument is the user `pt_regs`; the command is the second
//! syscall argument, at an offset userspace found in BTF.
//!
//! Cost on unwatched files: a per-CPU write at syscall entry, one hash miss in the
//! tracepoint, one LRU miss at syscall exit.
use aya_ebpf::helpers::bpf_get_current_comm;
use aya_ebpf::{
    macros::{fentry, fexit, kprobe, kretprobe, tracepoint},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext, TracePointContext},
};
use xtlock_common::{EventKind, FlockCallEvent, LockEvent, LockKey, F_UNLCK};

use crate::{
    emit::{cfg, field, field_fast, header, ids, now, output, syscall_arg},
    FLOCK_ENTER, FLOCK_INFLIGHT, WATCHED,
};

/// What `sys_enter_flock` saw, kept per CPU until the lock tracepoint of the same call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FlockEnter {
    pub tid: u32,
    pub cmd: u32,
    pub enter_ns: u64,
}

/// A `flock()` call on a watched lock that has not returned yet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FlockInflight {
    pub enter_ns: u64,
    pub owner: u64,
    pub ino: u64,
    pub dev: u32,
    pub cmd: u32,
}

#[tracepoint]
pub fn sys_enter_flock(ctx: TracePointContext) -> u32 {
    let cmd: u64 = field_fast::<u64, 24>(&ctx, cfg(|c| c.flock_cmd)).unwrap_or(u64::from(u32::MAX));
    flock_enter(cmd);
    0
}

/// The command of a `flock()` whose user registers are at `regs`.
#[inline(always)]
fn regs_cmd(regs: u64) -> u64 {
    syscall_arg(regs, 1).unwrap_or(u64::from(u32::MAX))
}

#[fentry(function = "__x64_sys_flock")]
pub fn flock_syscall_fentry(ctx: FEntryContext) -> u32 {
    flock_enter(regs_cmd(ctx.arg(0)));
    0
}

#[fexit(function = "__x64_sys_flock")]
pub fn flock_syscall_fexit(ctx: FExitContext) -> u32 {
    // The return value follows the one argument (no bpf_get_func_ret before 5.17).
    flock_exit(ctx.arg(1));
    0
}

#[kprobe]
pub fn flock_syscall_kprobe(ctx: ProbeContext) -> u32 {
    flock_enter(regs_cmd(ctx.arg(0).unwrap_or(0)));
    0
}

#[kretprobe]
pub fn flock_syscall_kretprobe(ctx: RetProbeContext) -> u32 {
    flock_exit(ctx.ret());
    0
}

#[inline(always)]
fn flock_enter(cmd: u64) {
    let (_, tid) = ids();
    if let Some(slot) = FLOCK_ENTER.get_ptr_mut(0) {
        // SAFETY: per-CPU slot.
        unsafe {
            *slot = FlockEnter {
                tid,
                cmd: cmd as u32,
                enter_ns: now(),
            }
        };
    }
}

#[tracepoint]
pub fn flock_lock_inode(ctx: TracePointContext) -> u32 {
    let _ = try_flock_lock_inode(&ctx);
    0
}

fn try_flock_lock_inode(ctx: &TracePointContext) -> Result<(), i32> {
    let ino: u64 = field_fast::<u64, 16>(ctx, cfg(|c| c.fl_ino))?;
    let dev: u32 = field_fast::<u32, 24>(ctx, cfg(|c| c.fl_dev))?;
    let key = LockKey { ino, dev, _pad: 0 };
    // SAFETY: read-only lookup; userspace only writes this map before attaching.
    if unsafe { WATCHED.get(&key) }.is_none() {
        return Ok(());
    }
    let ts = now();
    let owner: u64 = field(ctx, cfg(|c| c.fl_owner))?;
    let ret: i32 = field(ctx, cfg(|c| c.fl_ret))?;
    let fl_flags: u32 = field(ctx, cfg(|c| c.fl_flags))?;
    let fl_type: u8 = field(ctx, cfg(|c| c.fl_type))?;
    let (_, tid) = ids();

    // Tie this call to the flock() syscall it belongs to. The per-CPU entry slot is
    // consumed here (no sleep since sys_enter, so same CPU) so a later close() cannot
    // pick it up. A lock request is always inside flock(); a release only with LOCK_UN.
    let mut entered = None;
    if let Some(slot) = FLOCK_ENTER.get_ptr_mut(0) {
        // SAFETY: per-CPU slot.
        unsafe {
            if (*slot).tid == tid {
                entered = Some(*slot);
                (*slot).tid = 0;
            }
        }
    }
    if entered.is_some() || fl_type != F_UNLCK {
        let (enter_ns, cmd) = match entered {
            Some(e) => (e.enter_ns, e.cmd),
            None => (ts, u32::MAX),
        };
        let inflight = FlockInflight {
            enter_ns,
            owner,
            ino,
            dev,
            cmd,
        };
        // BPF_NOEXIST: after a deferral the retry must not overwrite the first attempt.
        let _ = FLOCK_INFLIGHT.insert(&tid, &inflight, 1);
    }

    let ev = LockEvent {
        hdr: header(EventKind::Lock, ts),
        owner,
        ino,
        dev,
        ret,
        fl_flags,
        fl_type,
        _pad: [0; 3],
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    };
    output(&ev);
    Ok(())
}

#[tracepoint]
pub fn sys_exit_flock(ctx: TracePointContext) -> u32 {
    let ret: i64 = field(&ctx, cfg(|c| c.sys_exit_ret)).unwrap_or(0);
    flock_exit(ret);
    0
}

#[inline(always)]
fn flock_exit(ret: i64) {
    let (_, tid) = ids();
    // SAFETY: read of our own entry; removed right after.
    let Some(inflight) = (unsafe { FLOCK_INFLIGHT.get(&tid) }).copied() else {
        return;
    };
    let _ = FLOCK_INFLIGHT.remove(&tid);
    let ev = FlockCallEvent {
        hdr: header(EventKind::FlockCall, now()),
        enter_ns: inflight.enter_ns,
        owner: inflight.owner,
        ino: inflight.ino,
        ret,
        cmd: inflight.cmd,
        dev: inflight.dev,
    };
    output(&ev);
}
