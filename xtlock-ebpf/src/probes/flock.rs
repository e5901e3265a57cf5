//! The xtables lock: `filelock:flock_lock_inode` (takes, failed tries, deferrals and
//! releases on the watched inodes) and `syscalls:sys_exit_flock` (how a blocking wait
//! ended: granted, or `-EINTR` from iptables' `alarm()`).
//!
//! Where the exit tracepoint cannot be used, the same step hangs off the syscall's function
//! (`__x64_sys_flock` or its arch's name, picked by userspace): fexit, else kretprobe.
//!
//! Cost on unwatched files, which every `flock()` on the node pays: one hash miss in the
//! lock tracepoint and one at syscall exit, nothing else (the exit reads its record only
//! for a thread that waited). There is no syscall-entry hook: the lock request itself says
//! everything the entry did (`LOCK_NB` is `FL_SLEEP`, the type is the operation), and a
//! wait starts at its first deferral, within a microsecond of the entry.
use aya_ebpf::helpers::bpf_get_current_comm;
use aya_ebpf::{
    macros::{fexit, kretprobe, tracepoint},
    programs::{FExitContext, RetProbeContext, TracePointContext},
};
use xtlock_common::{
    EventKind, FlockCallEvent, LockEvent, LockKey, FILE_LOCK_DEFERRED, FL_SLEEP, F_RDLCK, F_WRLCK,
    LOCK_EX, LOCK_NB, LOCK_SH, LOCK_UN,
};

use crate::{
    emit::{cfg, field, field_fast, header, ids, now, output},
    FLOCK_INFLIGHT, WATCHED,
};

/// A blocking `flock()` on a watched lock that was deferred and has not returned yet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FlockInflight {
    pub enter_ns: u64,
    pub owner: u64,
    pub ino: u64,
    pub dev: u32,
    pub cmd: u32,
}

/// The `flock()` operation that made a lock request of this type and these flags.
#[inline(always)]
fn flock_cmd(fl_type: u8, fl_flags: u32) -> u32 {
    let op = match fl_type {
        F_RDLCK => LOCK_SH,
        F_WRLCK => LOCK_EX,
        _ => LOCK_UN,
    };
    if fl_flags & FL_SLEEP == 0 {
        op | LOCK_NB
    } else {
        op
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

    // Only a deferred call waits, and only its return is news (granted after the wait, or
    // interrupted); every other call's outcome is in this event already.
    if ret == FILE_LOCK_DEFERRED {
        let inflight = FlockInflight {
            enter_ns: ts,
            owner,
            ino,
            dev,
            cmd: flock_cmd(fl_type, fl_flags),
        };
        // BPF_NOEXIST: a thread woken and beaten to the lock again keeps its first deferral.
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
    // The record is read only for a thread that waited: this runs at the end of every
    // flock() on the node.
    flock_exit(|| field(&ctx, cfg(|c| c.sys_exit_ret)).unwrap_or(0));
    0
}

#[fexit(function = "__x64_sys_flock")]
pub fn flock_syscall_fexit(ctx: FExitContext) -> u32 {
    // The return value follows the one argument (no bpf_get_func_ret before 5.17).
    flock_exit(|| ctx.arg(1));
    0
}

#[kretprobe]
pub fn flock_syscall_kretprobe(ctx: RetProbeContext) -> u32 {
    flock_exit(|| ctx.ret());
    0
}

#[inline(always)]
fn flock_exit(ret: impl FnOnce() -> i64) {
    let (_, tid) = ids();
    // SAFETY: read of our own entry; removed right after.
    let Some(inflight) = (unsafe { FLOCK_INFLIGHT.get(&tid) }).copied() else {
        return;
    };
    let _ = FLOCK_INFLIGHT.remove(&tid);
    let ret = ret();
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
