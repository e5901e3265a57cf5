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
use aya_ebpf::{
    macros::{btf_tracepoint, tracepoint},
    programs::{BtfTracePointContext, TracePointContext},
};
use xtlock_common::{
    EventKind, FlockCallEvent, HoldEvent, HoldNow, LockEvent, LockKey, WatchedSlot,
    FILE_LOCK_DEFERRED, FL_SLEEP, F_RDLCK, F_UNLCK, F_WRLCK, LOCK_EX, LOCK_NB, LOCK_SH, LOCK_UN,
    SLOT_EMPTY, SLOT_INDEX_SHIFT, SLOT_KIND, SLOT_ONE, WATCHED_INO_SLOTS,
};

use crate::{
    emit::{
        btf_read, cfg, field, field_fast, header, header_of, ids, now, output, reserve, wake_flags,
    },
    pending, FLOCK_INFLIGHT, HOLD_NOW, WAITING, WAITING_SLOTS, WATCHED, WATCHED_INO,
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

/// The pre-filter: the slot of `ino` (one array entry at `ino % slots`), when a watched lock's
/// inode falls there.
#[inline(always)]
fn maybe_watched(ino: u64) -> Option<&'static WatchedSlot> {
    // The mask keeps the index in bounds for the verifier.
    WATCHED_INO
        .get((ino as u32) & (WATCHED_INO_SLOTS - 1))
        .filter(|s| s.state != SLOT_EMPTY)
}

/// The lock's index, when `(ino, dev)` is a watched lock.
#[inline(always)]
fn watched(slot: &WatchedSlot, ino: u64, dev: u32) -> Option<u32> {
    if slot.state & SLOT_KIND == SLOT_ONE {
        return (slot.ino == ino && slot.dev == dev).then_some(slot.state >> SLOT_INDEX_SHIFT);
    }
    let key = LockKey { ino, dev, _pad: 0 };
    // SAFETY: read-only lookup; userspace only adds keys.
    unsafe { WATCHED.get(&key) }.copied()
}

/// The lock request as the hooks see it.
struct Request {
    /// The lock's index (`WATCHED`).
    index: u32,
    ino: u64,
    dev: u32,
    owner: u64,
    ret: i32,
    fl_flags: u32,
    fl_type: u8,
}

/// The perf tracepoint: the kernel copies the request into a record before the program
/// runs. Used where the raw tracepoint below cannot be (no BTF for the struct offsets).
#[tracepoint]
pub fn flock_lock_inode(ctx: TracePointContext) -> u32 {
    let _ = try_flock_lock_inode(&ctx);
    0
}

fn try_flock_lock_inode(ctx: &TracePointContext) -> Result<(), i32> {
    let ino: u64 = field_fast::<u64, 16>(ctx, cfg(|c| &c.fl_ino))?;
    let Some(slot) = maybe_watched(ino) else {
        return Ok(());
    };
    let dev: u32 = field_fast::<u32, 24>(ctx, cfg(|c| &c.fl_dev))?;
    let Some(index) = watched(slot, ino, dev) else {
        return Ok(());
    };
    on_request(&Request {
        index,
        ino,
        dev,
        owner: field(ctx, cfg(|c| &c.fl_owner))?,
        ret: field(ctx, cfg(|c| &c.fl_ret))?,
        fl_flags: field(ctx, cfg(|c| &c.fl_flags))?,
        fl_type: field(ctx, cfg(|c| &c.fl_type))?,
    });
    Ok(())
}

/// The same tracepoint as a BTF raw tracepoint (`tp_btf`): the program gets the
/// tracepoint's arguments `(struct inode *, struct file_lock *, int ret)` and no record is
/// built, so a `flock()` on an unwatched file costs one load of `inode->i_ino` and the
/// pre-filter. The loads are plain loads at offsets userspace found in BTF (`CONFIG.rfl_*`):
/// constants to the verifier, which checks each against the kernel's types.
#[btf_tracepoint(function = "flock_lock_inode")]
pub fn flock_lock_inode_btf(ctx: BtfTracePointContext) -> u32 {
    let inode: *const u8 = ctx.arg(0);
    let ino: u64 = btf_read(inode, cfg(|c| &c.rfl_inode_ino));
    let Some(slot) = maybe_watched(ino) else {
        return 0;
    };
    let sb: *const u8 = btf_read(inode, cfg(|c| &c.rfl_inode_sb));
    let dev: u32 = btf_read(sb, cfg(|c| &c.rfl_sb_dev));
    let Some(index) = watched(slot, ino, dev) else {
        return 0;
    };
    let fl: *const u8 = ctx.arg(1);
    // The verifier wants it checked (tracepoint arguments may be NULL), never NULL here.
    if fl.is_null() {
        return 0;
    }
    let ret: u64 = ctx.arg(2);
    on_request(&Request {
        index,
        ino,
        dev,
        owner: btf_read(fl, cfg(|c| &c.rfl_owner)),
        ret: ret as i32,
        fl_flags: btf_read(fl, cfg(|c| &c.rfl_flags)),
        fl_type: btf_read(fl, cfg(|c| &c.rfl_type)),
    });
    0
}

/// The floor the lock hook is measured against (`xtlock trace --bench-floor`, for `cargo xtask
/// bench`): the same attach point and type as [`flock_lock_inode_btf`], and no work at all.
#[btf_tracepoint(function = "flock_lock_inode")]
pub fn flock_lock_inode_btf_floor(_ctx: BtfTracePointContext) -> u32 {
    0
}

/// The floor of streaming holds (`xtlock trace --bench-floor-record`): the attach point of
/// [`flock_lock_inode_btf`], its inode pre-filter, and one `Hold`-sized ring record at each
/// release on a watched slot, and nothing else: what sending one record a hold costs at
/// least (its kind is 0, which userspace counts as undecodable and drops).
#[btf_tracepoint(function = "flock_lock_inode")]
pub fn flock_lock_inode_btf_floor_record(ctx: BtfTracePointContext) -> u32 {
    let inode: *const u8 = ctx.arg(0);
    if maybe_watched(btf_read(inode, cfg(|c| &c.rfl_inode_ino))).is_none() {
        return 0;
    }
    let fl: *const u8 = ctx.arg(1);
    if fl.is_null() || btf_read::<u8>(fl, cfg(|c| &c.rfl_type)) != F_UNLCK {
        return 0;
    }
    if let Some(mut e) = reserve::<HoldEvent>() {
        // SAFETY: a reserved entry of the right size; only the kind is written, so old ring
        // contents never read as an event.
        unsafe { (*e.as_mut_ptr()).hdr.kind = 0 };
        e.submit(wake_flags::<HoldEvent>(true));
    }
    0
}

/// A lock request on a watched lock: its event, and the start or end of a blocking wait.
#[inline(always)]
fn on_request(r: &Request) {
    let &Request {
        index,
        ino,
        dev,
        owner,
        ret,
        fl_flags,
        fl_type,
    } = r;
    let ts = now();
    let (tgid, tid) = ids();
    let (Some(k), Some(h)) = (pending::kept(index), HOLD_NOW.get_ptr_mut(0)) else {
        return;
    };

    // This thread's deferred call on this lock, if it is one (an entry left by a thread
    // that died waiting, whose tid was reused, is another owner). A zeroed copy and a flag
    // rather than an Option: LLVM loads an Option's payload before testing it, and the
    // verifiers before 5.12 refuse that read of stack the None path never wrote. Looked up
    // only while some call waits: an uncontended lock costs no hash lookup.
    let mut w = FlockInflight {
        enter_ns: 0,
        owner: 0,
        ino: 0,
        dev: 0,
        cmd: 0,
    };
    let mut waiting = false;
    if waits_in_slot(tid) {
        // SAFETY: read of our own entry.
        if let Some(e) = unsafe { FLOCK_INFLIGHT.get(&tid) } {
            if e.owner == owner && e.ino == ino && e.dev == dev {
                w = *e;
                waiting = true;
            }
        }
    }
    if ret == FILE_LOCK_DEFERRED && !waiting {
        let inflight = FlockInflight {
            enter_ns: ts,
            owner,
            ino,
            dev,
            cmd: flock_cmd(fl_type, fl_flags),
        };
        if FLOCK_INFLIGHT.insert(&tid, &inflight, 0).is_ok() {
            add_wait(tid, true);
        }
    }

    let hdr = header_of(EventKind::Lock, ts, tgid, tid);
    if ret == 0 && fl_type == F_UNLCK {
        let hold = header_of(EventKind::Hold, ts, tgid, tid);
        if pending::release(k, hold, owner, ino, dev, ret, fl_flags) {
            note_hold(h, owner, fl_type, ret, ts);
            return;
        }
    } else {
        // A waiter's request, a failed try, another lock's take: after the kept take.
        pending::send(k);
    }
    note_hold(h, owner, fl_type, ret, ts);
    // An exclusive take that did not end a wait is kept until its release; the end of a
    // wait goes out now, ahead of the call's end below.
    let kept = ret == 0
        && fl_type == F_WRLCK
        && !waiting
        && pending::keep(k, hdr, owner, ino, dev, fl_flags);
    if !kept {
        // Written in place in the ring: the hook's stack stays small (see `pending::send`).
        if let Some(mut e) = reserve::<LockEvent>() {
            let p = e.as_mut_ptr();
            // SAFETY: a reserved entry of the right size; every field written.
            unsafe {
                (*p).hdr = hdr;
                (*p).owner = owner;
                (*p).ino = ino;
                (*p).dev = dev;
                (*p).ret = ret;
                (*p).fl_flags = fl_flags;
                (*p).fl_type = fl_type;
                (*p)._pad = [0; 3];
                (*p).comm = bpf_get_current_comm().unwrap_or([0; 16]);
            }
            e.submit(wake_flags::<LockEvent>(true));
        }
    }

    // A retry after the wait that did not defer again ends the call: granted, or an error.
    if waiting && ret != FILE_LOCK_DEFERRED {
        if FLOCK_INFLIGHT.remove(&tid).is_ok() {
            add_wait(tid, false);
        }
        // A release by this owner means the waiter died and its files are closing.
        if fl_type != F_UNLCK {
            flock_return(&w, ts, i64::from(ret));
        }
    }
}

/// Whether `tid`'s slot of `WAITING` counts a deferred call (its own, or a colliding
/// thread's).
#[inline(always)]
fn waits_in_slot(tid: u32) -> bool {
    WAITING
        .get(tid & (WAITING_SLOTS - 1))
        .is_some_and(|n| *n != 0)
}

/// Counts a deferred call in (`add`) or out of `tid`'s slot of `WAITING`.
#[inline(always)]
fn add_wait(tid: u32, add: bool) {
    let Some(n) = WAITING.get_ptr_mut(tid & (WAITING_SLOTS - 1)) else {
        return;
    };
    // SAFETY: an entry of the array; see `WAITING` for the race this accepts.
    unsafe {
        if add {
            *n = (*n).saturating_add(1);
        } else {
            *n = (*n).saturating_sub(1);
        }
    }
}

/// Keeps `HOLD_NOW` for the drop hook: an exclusive take starts a hold (with this event's
/// time, which userspace knows it by), the holder's release ends it. Others' releases (a
/// close of the lock file by a process that did not hold it) leave it alone.
#[inline(always)]
fn note_hold(h: *mut HoldNow, owner: u64, fl_type: u8, ret: i32, ts: u64) {
    if ret != 0 {
        return;
    }
    // SAFETY: the map's one entry; a racing take on another watched lock can only make the
    // drop hook credit the newer hold, never read out of bounds.
    unsafe {
        if fl_type == F_WRLCK {
            (*h).seq += 1;
            (*h).owner = owner;
            (*h).start_ns = ts;
        } else if fl_type == F_UNLCK && (*h).owner == owner {
            (*h).start_ns = 0;
        }
    }
}

#[tracepoint]
pub fn signal_deliver(ctx: TracePointContext) -> u32 {
    let (_, tid) = ids();
    // As in `on_request`: no call waits, no lookup.
    if !waits_in_slot(tid) {
        return 0;
    }
    // SAFETY: read of our own entry; removed below.
    let Some(w) = (unsafe { FLOCK_INFLIGHT.get(&tid) }).copied() else {
        return 0;
    };
    let handler: u64 = field(&ctx, cfg(|c| &c.sig_handler)).unwrap_or(0);
    let flags: u64 = field(&ctx, cfg(|c| &c.sig_flags)).unwrap_or(0);
    // SIG_DFL (0) and SIG_IGN (1): a stop or an ignored signal restarts the call, a fatal
    // one ends the process (its exit ends the wait). A handler with SA_RESTART restarts it
    // too. Any other handler runs with flock() failed: -EINTR.
    if handler <= 1 || flags & SA_RESTART != 0 {
        return 0;
    }
    if FLOCK_INFLIGHT.remove(&tid).is_ok() {
        add_wait(tid, false);
    }
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
