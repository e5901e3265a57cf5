//! The xtables lock: `filelock:flock_lock_inode` (takes, failed tries, deferrals and
//! releases on the watched inodes, and the end of a blocking wait when the kernel's retry
//! grants the lock) and `signal:signal_deliver` (a blocking wait cut short by a signal:
//! iptables' `alarm()` behind `-w N`).
//!
//! No syscall hook: a `syscalls:` tracepoint on `flock()` costs every `flock()` on the node
//! ~400 ns even with an empty program (the syscall record is built before any program
//! runs), and everything it told is in the lock request itself (`LOCK_NB` is `FL_SLEEP`,
//! the type is the operation) or in how a deferred call ends: the retry that takes the lock,
//! or the signal that interrupts the sleep. So an unwatched file costs one array read in the
//! lock tracepoint (a hash lookup when its inode shares a pre-filter slot with a lock's); a
//! delivered signal (rare) one LRU miss.
use aya_ebpf::helpers::bpf_get_current_comm;
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use xtlock_common::{
    EventKind, FlockCallEvent, LockEvent, LockKey, FILE_LOCK_DEFERRED, FL_SLEEP, F_RDLCK, F_UNLCK,
    F_WRLCK, LOCK_EX, LOCK_NB, LOCK_SH, LOCK_UN, WATCHED_INO_SLOTS,
};

use crate::{
    emit::{cfg, field, field_fast, header, ids, now, output},
    FLOCK_INFLIGHT, WATCHED, WATCHED_INO,
};

/// `sa_flags` bit: the interrupted syscall restarts instead of failing with `EINTR`.
const SA_RESTART: u64 = 0x1000_0000;
const EINTR: i64 = 4;

/// A blocking `flock()` on a watched lock that was deferred and has not ended yet.
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
    // The mask keeps the index in bounds for the verifier.
    if WATCHED_INO
        .get((ino as u32) & (WATCHED_INO_SLOTS - 1))
        .is_none_or(|&b| b == 0)
    {
        return Ok(());
    }
    let key = LockKey { ino, dev, _pad: 0 };
    // SAFETY: read-only lookup; userspace only adds keys.
    if unsafe { WATCHED.get(&key) }.is_none() {
        return Ok(());
    }
    let ts = now();
    let owner: u64 = field(ctx, cfg(|c| c.fl_owner))?;
    let ret: i32 = field(ctx, cfg(|c| c.fl_ret))?;
    let fl_flags: u32 = field(ctx, cfg(|c| c.fl_flags))?;
    let fl_type: u8 = field(ctx, cfg(|c| c.fl_type))?;
    let (_, tid) = ids();

    // This thread's deferred call on this lock, if it is one (an entry left by a thread
    // that died waiting, whose tid was reused, is another owner).
    // SAFETY: read of our own entry.
    let waiting = unsafe { FLOCK_INFLIGHT.get(&tid) }
        .copied()
        .filter(|w| w.owner == owner && w.ino == ino && w.dev == dev);
    if ret == FILE_LOCK_DEFERRED && waiting.is_none() {
        let inflight = FlockInflight {
            enter_ns: ts,
            owner,
            ino,
            dev,
            cmd: flock_cmd(fl_type, fl_flags),
        };
        let _ = FLOCK_INFLIGHT.insert(&tid, &inflight, 0);
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

    // A retry after the wait that did not defer again ends the call: granted, or an error.
    if let Some(w) = waiting {
        if ret != FILE_LOCK_DEFERRED {
            let _ = FLOCK_INFLIGHT.remove(&tid);
            // A release by this owner means the waiter died and its files are closing.
            if fl_type != F_UNLCK {
                flock_return(&w, ts, i64::from(ret));
            }
        }
    }
    Ok(())
}

#[tracepoint]
pub fn signal_deliver(ctx: TracePointContext) -> u32 {
    let (_, tid) = ids();
    // SAFETY: read of our own entry; removed below.
    let Some(w) = (unsafe { FLOCK_INFLIGHT.get(&tid) }).copied() else {
        return 0;
    };
    let handler: u64 = field(&ctx, cfg(|c| c.sig_handler)).unwrap_or(0);
    let flags: u64 = field(&ctx, cfg(|c| c.sig_flags)).unwrap_or(0);
    // SIG_DFL (0) and SIG_IGN (1): a stop or an ignored signal restarts the call, a fatal
    // one ends the process (its exit ends the wait). A handler with SA_RESTART restarts it
    // too. Any other handler runs with flock() failed: -EINTR.
    if handler <= 1 || flags & SA_RESTART != 0 {
        return 0;
    }
    let _ = FLOCK_INFLIGHT.remove(&tid);
    flock_return(&w, now(), -EINTR);
    0
}

/// How a deferred `flock()` ended, as its return value.
#[inline(always)]
fn flock_return(w: &FlockInflight, ts: u64, ret: i64) {
    let ev = FlockCallEvent {
        hdr: header(EventKind::FlockCall, ts),
        enter_ns: w.enter_ns,
        owner: w.owner,
        ino: w.ino,
        ret,
        cmd: w.cmd,
        dev: w.dev,
    };
    output(&ev);
}
