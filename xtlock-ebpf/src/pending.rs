//! The exclusive take of a watched lock, kept in the kernel (`KEPT`, at the lock's index)
//! until its release: one ring record a hold (`Hold`) instead of two `Lock` records, and no
//! record at all at the take.
//!
//! Whatever userspace must read after the take sends it first, as the `Lock` record it
//! would have been: a waiter's or a failed try's request on the lock, the holder's table
//! write, fork, exec or exit, a drop or refusal sampled during a hold. Userspace reads a
//! take still kept from the map on its 50 ms tick and before it reads the per-hold counts,
//! after reading the ring to its end (a take sent there may not be read yet).
//! So waits name their holders live and nothing is lost when a hold never ends.
//!
//! One entry per lock: the lock is exclusive, so its takes, and the programs that write
//! them, follow each other. `take_seq` is a sequence lock (odd while a take is written) for
//! the readers: they copy the take and keep it only if `take_seq` did not move; `sent_seq`
//! is the last take sent. Two CPUs may both send the same take (a release racing a waiter,
//! say): the decoder drops the second, a take being known by its owner and time.
//!
//! Memory order: x86 keeps stores in order and loads in order, so compiler fences are all the
//! lock needs there. A weakly ordered CPU (arm64) may make the take's stores visible before
//! the odd sequence, or a reader's copy may load fields before the sequence it checks: the
//! writer and the readers then put a full barrier ([`fence`]) on each side of the take's
//! stores and of the copy, as a kernel `seqcount` has `smp_wmb` and `smp_rmb`.
use core::{
    ptr::{copy_nonoverlapping, read_volatile, write_volatile},
    sync::atomic::{compiler_fence, Ordering},
};

use aya_ebpf::helpers::bpf_get_current_comm;
use xtlock_common::{
    EventHeader, HoldEvent, KeptTake, LockEvent, COMM_LEN, F_WRLCK, MAX_WATCHED_LOCKS,
};

use crate::{
    emit::{fence, reserve, wake_flags},
    KEPT,
};

/// The entry of the lock at `index`.
#[inline(always)]
pub fn kept(index: u32) -> Option<*mut KeptTake> {
    // The mask keeps the index in bounds for the verifier.
    KEPT.get_ptr_mut(index & (MAX_WATCHED_LOCKS - 1))
}

/// The waiting take's `take_seq`, when one is waiting and not being written.
#[inline(always)]
fn waiting(k: *mut KeptTake) -> Option<u64> {
    // SAFETY: a map entry; the copy that follows is checked against the sequence again.
    unsafe {
        let s = read_volatile(&(*k).take_seq);
        (s & 1 == 0 && s > read_volatile(&(*k).sent_seq)).then_some(s)
    }
}

/// Whether the take copied out after reading `take_seq` `s` is whole: the sequence did not
/// move meanwhile.
#[inline(always)]
fn still(k: *mut KeptTake, s: u64) -> bool {
    // The copy stays before this read: x86 keeps loads in order, the caller's fence does
    // elsewhere, and the compiler must too.
    compiler_fence(Ordering::SeqCst);
    // SAFETY: a map entry.
    unsafe { read_volatile(&(*k).take_seq) == s }
}

#[inline(always)]
fn mark_sent(k: *mut KeptTake, s: u64) {
    // SAFETY: as above. Not atomic: a late writer can only lower it, and the take is then
    // sent twice, which the decoder absorbs.
    unsafe {
        if read_volatile(&(*k).sent_seq) < s {
            write_volatile(&mut (*k).sent_seq, s);
        }
    }
}

/// Sends the lock's waiting take, if any: copied from the map straight into a ring record
/// (no stack copy: the lock hook's stack is near the verifier's limit on 5.10 and 6.1).
#[inline(always)]
pub fn send(k: *mut KeptTake) {
    let Some(s) = waiting(k) else {
        return;
    };
    // No barrier (a full ring): no copy, as there would be no room for it either.
    if !fence() {
        return;
    }
    let Some(mut e) = reserve::<LockEvent>() else {
        return;
    };
    // SAFETY: a reserved entry of the right size, and a map entry; torn copies are
    // discarded below.
    unsafe { copy_nonoverlapping(&raw const (*k).take, e.as_mut_ptr(), 1) };
    if !fence() || !still(k, s) {
        e.discard(0);
        return;
    }
    e.submit(wake_flags::<LockEvent>(true));
    mark_sent(k, s);
}

/// Sends every lock's waiting take that process `tgid` made (all of them for `None`): the
/// caller is about to send an event userspace reads inside that hold (the holder's table
/// write, fork, exec or exit; a sampled drop or refusal). Not on a hot path: a look at each
/// lock's entry.
#[inline(always)]
pub fn send_by(tgid: Option<u32>) {
    for i in 0..MAX_WATCHED_LOCKS {
        let Some(k) = kept(i) else {
            continue;
        };
        // SAFETY: a plain read of the entry; `send` checks it again.
        let by = unsafe { read_volatile(&(*k).take.hdr.tgid) };
        if waiting(k).is_some() && tgid.is_none_or(|t| t == by) {
            send(k);
        }
    }
}

/// An exclusive take (not the end of a wait), written in place into the lock's entry to be
/// kept until its release. The caller sent the entry's waiting take first (a lost
/// release's, or a shared hold's): the lock hook [`send`]s before every request but a
/// release. Returns false when the entry is being written right now (a second inode at the
/// same index: a replaced lock file still held through its old one): the caller sends the
/// take itself.
#[inline(always)]
pub fn keep(
    k: *mut KeptTake,
    hdr: EventHeader,
    owner: u64,
    ino: u64,
    dev: u32,
    fl_flags: u32,
) -> bool {
    // SAFETY: a map entry; see the module's text for the protocol.
    unsafe {
        let s = read_volatile(&(*k).take_seq);
        if s & 1 != 0 {
            return false;
        }
        write_volatile(&mut (*k).take_seq, s + 1);
        compiler_fence(Ordering::SeqCst);
        if !fence() {
            // Nothing written yet: the entry is as it was, and the caller sends the take.
            write_volatile(&mut (*k).take_seq, s);
            return false;
        }
        let t = &raw mut (*k).take;
        (*t).hdr = hdr;
        (*t).owner = owner;
        (*t).ino = ino;
        (*t).dev = dev;
        (*t).ret = 0;
        (*t).fl_flags = fl_flags;
        (*t).fl_type = F_WRLCK;
        (*t)._pad = [0; 3];
        (*t).comm = bpf_get_current_comm().unwrap_or([0; COMM_LEN]);
        compiler_fence(Ordering::SeqCst);
        // Without room for this one (a full ring, events lost already), the take is
        // published all the same: a reader's copy could not go into the ring either.
        let _ = fence();
        write_volatile(&mut (*k).take_seq, s + 2);
    }
    true
}

/// The release of `owner`'s kept take: both go out as one `Hold` record (`hdr` its header),
/// the take copied from the map straight into it. False when the waiting take is not this
/// owner's (it is sent first) or none waits: the caller sends the release alone.
#[inline(always)]
pub fn release(
    k: *mut KeptTake,
    hdr: EventHeader,
    owner: u64,
    ino: u64,
    dev: u32,
    ret: i32,
    fl_flags: u32,
) -> bool {
    let Some(s) = waiting(k) else {
        return false;
    };
    // SAFETY: plain reads of the entry; the copy below is checked again.
    let mine = unsafe {
        read_volatile(&(*k).take.owner) == owner
            && read_volatile(&(*k).take.ino) == ino
            && read_volatile(&(*k).take.dev) == dev
    };
    if !mine {
        // Somebody else's (a close by a process that does not hold the lock, or the other
        // inode at this index): it goes first.
        send(k);
        return false;
    }
    if !fence() {
        return false;
    }
    let Some(mut e) = reserve::<HoldEvent>() else {
        return false;
    };
    let p = e.as_mut_ptr();
    // SAFETY: a reserved entry of the right size, every field written before submit; a
    // torn copy is discarded.
    unsafe {
        copy_nonoverlapping(&raw const (*k).take, &raw mut (*p).take, 1);
        if !fence() || !still(k, s) || (*p).take.owner != owner {
            e.discard(0);
            return false;
        }
        (*p).hdr = hdr;
        (*p).ret = ret;
        (*p).fl_flags = fl_flags;
        // The same task's comm is the take's (a rename in between is not worth a call).
        (*p).comm = if (*p).take.hdr.tid == hdr.tid {
            (*p).take.comm
        } else {
            bpf_get_current_comm().unwrap_or([0; COMM_LEN])
        };
    }
    e.submit(wake_flags::<HoldEvent>(true));
    mark_sent(k, s);
    true
}
