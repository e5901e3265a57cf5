//! The exclusive take of a watched lock, kept in the kernel (`KEPT`, at the lock's index)
//! until its release: one ring record a hold (`Hold`) instead of two `Lock` records, and no
//! record at all at the take.
//!
//! Whatever userspace must read after the take sends it first, as the `Lock` record it
//! would have been: a waiter's or a failed try's request on the lock, the holder's table
//! write, fork, exec or exit, a drop or refusal sampled during a hold. Userspace reads a
//! take still kept from the map on its 50 ms tick and before it reads the per-hold counts.
//! So waits name their holders live and nothing is lost when a hold never ends.
//!
//! One entry per lock: the lock is exclusive, so its takes, and the programs that write
//! them, follow each other. `take_seq` is a sequence lock (odd while a take is written) for
//! the readers: they copy the take and keep it only if `take_seq` did not move; `sent_seq`
//! is the last take sent. Two CPUs may both send the same take (a release racing a waiter,
//! say): the decoder drops the second, a take being known by its owner and time.
use core::{
    ptr::{read_volatile, write_volatile},
    sync::atomic::{compiler_fence, Ordering},
};

use xtlock_common::{KeptTake, LockEvent, MAX_WATCHED_LOCKS};

use crate::{emit::output, KEPT};

/// The entry of the lock at `index`.
#[inline(always)]
pub fn kept(index: u32) -> Option<*mut KeptTake> {
    // The mask keeps the index in bounds for the verifier.
    KEPT.get_ptr_mut(index & (MAX_WATCHED_LOCKS - 1))
}

/// The take waiting to be sent, with its `take_seq`, when there is one and it was read
/// whole.
#[inline(always)]
fn waiting(k: *mut KeptTake) -> Option<(u64, LockEvent)> {
    // SAFETY: a map entry; torn reads are detected by the sequence numbers.
    unsafe {
        let s = read_volatile(&(*k).take_seq);
        if s & 1 != 0 || s <= read_volatile(&(*k).sent_seq) {
            return None;
        }
        // The copy stays between the two reads of the sequence (x86 keeps loads in order;
        // the compiler must too).
        compiler_fence(Ordering::SeqCst);
        let take = (*k).take;
        compiler_fence(Ordering::SeqCst);
        if read_volatile(&(*k).take_seq) != s {
            return None;
        }
        Some((s, take))
    }
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

/// Sends the lock's waiting take, if any.
#[inline(always)]
pub fn send(k: *mut KeptTake) {
    if let Some((s, take)) = waiting(k) {
        output(&take);
        mark_sent(k, s);
    }
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
        // SAFETY: plain reads of the entry; `waiting` checks it again.
        let (s, sent, by) = unsafe {
            (
                read_volatile(&(*k).take_seq),
                read_volatile(&(*k).sent_seq),
                read_volatile(&(*k).take.hdr.tgid),
            )
        };
        if s > sent && tgid.is_none_or(|t| t == by) {
            send(k);
        }
    }
}

/// Keeps `take` (an exclusive take, not the end of a wait) until its release. Returns false
/// when the entry is being written right now (a second inode at the same index: a replaced
/// lock file still held through its old one): the caller sends the take itself.
#[inline(always)]
pub fn keep(k: *mut KeptTake, take: &LockEvent) -> bool {
    // A take still waiting: a lost release's, or a shared hold's.
    send(k);
    // SAFETY: a map entry; see the module's text for the protocol.
    unsafe {
        let s = read_volatile(&(*k).take_seq);
        if s & 1 != 0 {
            return false;
        }
        write_volatile(&mut (*k).take_seq, s + 1);
        compiler_fence(Ordering::SeqCst);
        (*k).take = *take;
        compiler_fence(Ordering::SeqCst);
        write_volatile(&mut (*k).take_seq, s + 2);
    }
    true
}

/// The waiting take, claimed, if it is `owner`'s: its release goes out with it.
#[inline(always)]
pub fn claim_for_release(k: *mut KeptTake, owner: u64, ino: u64, dev: u32) -> Option<LockEvent> {
    let (s, take) = waiting(k)?;
    if take.owner != owner || take.ino != ino || take.dev != dev {
        // Somebody else's (a close by a process that does not hold the lock, or the other
        // inode at this index): it goes first.
        output(&take);
        mark_sent(k, s);
        return None;
    }
    mark_sent(k, s);
    Some(take)
}
