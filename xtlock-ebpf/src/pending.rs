//! The exclusive take of a watched lock, kept in the kernel (`HOLD_NOW`'s `take`) until its
//! release: one ring record a hold (`Hold`) instead of two `Lock` records, and no record at
//! all at the take.
//!
//! Whatever userspace must read after the take sends it first, as the `Lock` record it
//! would have been: a waiter's or a failed try's request on a lock, the holder's table
//! write, fork, exec or exit, a drop or refusal sampled during the hold. Userspace reads a
//! take still waiting from the map on its 50 ms tick and before it reads the per-hold
//! counts. So waits name their holders live and nothing is lost when a hold never ends.
//!
//! `take_seq` is a sequence lock (odd while a take is written) and `sent_seq` the last take
//! sent: readers copy the take and keep it only if `take_seq` did not move. Two CPUs may
//! both send the same take (a release racing a waiter, say): the decoder drops the second,
//! a take being known by its owner and time.
use core::{
    ptr::{read_volatile, write_volatile},
    sync::atomic::{compiler_fence, Ordering},
};

use xtlock_common::{HoldNow, LockEvent};

use crate::{emit::output, HOLD_NOW};

/// `HOLD_NOW`'s one entry.
#[inline(always)]
pub fn hold_now() -> Option<*mut HoldNow> {
    HOLD_NOW.get_ptr_mut(0)
}

/// The take waiting to be sent, with its `take_seq`, when there is one and it was read
/// whole.
#[inline(always)]
fn waiting(h: *mut HoldNow) -> Option<(u64, LockEvent)> {
    // SAFETY: the map's one entry; torn reads are detected by the sequence numbers.
    unsafe {
        let s = read_volatile(&(*h).take_seq);
        if s & 1 != 0 || s <= read_volatile(&(*h).sent_seq) {
            return None;
        }
        // The copy stays between the two reads of the sequence (x86 keeps loads in order;
        // the compiler must too).
        compiler_fence(Ordering::SeqCst);
        let take = (*h).take;
        compiler_fence(Ordering::SeqCst);
        if read_volatile(&(*h).take_seq) != s {
            return None;
        }
        Some((s, take))
    }
}

#[inline(always)]
fn mark_sent(h: *mut HoldNow, s: u64) {
    // SAFETY: as above. Not atomic: a late writer can only lower it, and the take is then
    // sent twice, which the decoder absorbs.
    unsafe {
        if read_volatile(&(*h).sent_seq) < s {
            write_volatile(&mut (*h).sent_seq, s);
        }
    }
}

/// Sends the waiting take, if any.
#[inline(always)]
pub fn send(h: *mut HoldNow) {
    if let Some((s, take)) = waiting(h) {
        output(&take);
        mark_sent(h, s);
    }
}

/// Sends the waiting take if process `tgid` made it: the caller is about to send an event
/// of that process (a table write, fork, exec, exit) that userspace reads inside the hold.
#[inline(always)]
pub fn send_if_by(tgid: u32) {
    let Some(h) = hold_now() else {
        return;
    };
    // SAFETY: a plain read of the entry; `waiting` checks it again.
    let by = unsafe { read_volatile(&(*h).take.hdr.tgid) };
    if by == tgid {
        send(h);
    }
}

/// Sends the waiting take, if any: a sampled drop or refusal of the hold follows.
#[inline(always)]
pub fn send_any() {
    if let Some(h) = hold_now() {
        send(h);
    }
}

/// Keeps `take` (an exclusive take, not the end of a wait) until its release. Returns false
/// when another take is being written right now (a second lock, on another CPU): the
/// caller sends it itself.
#[inline(always)]
pub fn keep(h: *mut HoldNow, take: &LockEvent) -> bool {
    // A take still waiting: a shared hold's or one whose release was lost.
    send(h);
    // SAFETY: the map's one entry; see the module's text for the protocol.
    unsafe {
        let s = read_volatile(&(*h).take_seq);
        if s & 1 != 0 {
            return false;
        }
        write_volatile(&mut (*h).take_seq, s + 1);
        compiler_fence(Ordering::SeqCst);
        (*h).take = *take;
        compiler_fence(Ordering::SeqCst);
        write_volatile(&mut (*h).take_seq, s + 2);
    }
    true
}

/// The waiting take, claimed, if it is `owner`'s on this lock: its release goes out with it.
#[inline(always)]
pub fn claim_for_release(h: *mut HoldNow, owner: u64, ino: u64, dev: u32) -> Option<LockEvent> {
    let (s, take) = waiting(h)?;
    if take.owner != owner || take.ino != ino || take.dev != dev {
        // Somebody else's (another lock's, or a close by a process that does not hold
        // it): it goes first.
        output(&take);
        mark_sent(h, s);
        return None;
    }
    mark_sent(h, s);
    Some(take)
}
