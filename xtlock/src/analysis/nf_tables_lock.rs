//! nf_tables locking, analysed apart from the xtables file lock (`xtables_lock.rs`): each
//! batch's commit as a hold of its netns's commit lock (from the nft_commit hook, else from
//! the batch's `sendmsg()`), and the waits on the nf_tables mutexes as waits on that lock.
//!
//! The kernel reports each wait whole, at its end (`lock:contention_end`), with the mutex's
//! owner when it began. A wait on a netns's `commit_mutex` is a wait on the lock its
//! commits hold, "nf_tables commit (netns N)"; a wait on nfnetlink's nf_tables mutex (one
//! for the node; a batch holds it while it waits for its netns's commit mutex) is a wait on
//! "nfnetlink nf_tables mutex".
//!
//! A contention that began on a free mutex (its owner letting go: the owner field is clear)
//! and saw nobody else take it is a spin, behind no one: not reported as a wait.
//!
//! Split between holders as waits on the xtables lock are: the owner at the start holds
//! until the next hand-over seen, and a hand-over is another waiter's wait ending with the
//! mutex taken (while anyone waits, every taker goes through the mutex's slow path, so each
//! one is a contention of its own). Waits reach us at their end, in ring order; a wait's
//! hand-overs end before it does, so they are here by then.
//!
//! A wait on nfnetlink's mutex is behind a batch that holds it while it waits for its
//! netns's commit mutex: each holder of such a wait carries, as [`Waiting`], its own commit
//! wait over the same time and whom that was behind (the root of the queue). That commit
//! wait ends before the holder lets nfnetlink's mutex go, so before the later wait ends:
//! it is here by then too.

use std::collections::VecDeque;
use std::sync::Arc;

use super::attribution::{Attribution, Ctx};
use super::facts::{HoldFact, HolderRef, Output, WaitFact, WaitMode, WaitOutcome, Waiting, Who};
use super::procs::FastMap;
use crate::decode::{
    Comm, Event, NftBatch, NftCommitEvent, NftMutex, NftMutexWaitEvent, NftSendEvent,
};
use crate::shared::SharedStr;

/// Hand-overs kept per mutex.
const MAX_CHANGES: usize = 1024;
/// Mutexes followed (one per netns that waited, and nfnetlink's).
const MAX_MUTEXES: usize = 1024;

/// Name of nfnetlink's nf_tables mutex as a lock.
pub const NFNL_LOCK: &str = "nfnetlink nf_tables mutex";

/// Name of the second lock: nf_tables serialises commits per network namespace.
pub fn nft_commit_lock(netns: u32) -> SharedStr {
    if netns == 0 {
        SharedStr::from("nf_tables commit (netns unknown)")
    } else {
        SharedStr::from(format!("nf_tables commit (netns {netns})"))
    }
}

/// A hold of an nf_tables lock from `start_ns` to `end_ns`, all of it in the kernel (a
/// batch: no legacy table replace in it), attributed like a file-lock hold; with what the
/// batch changed where the nft_commit hook counted it. One shape for the commit hook's holds
/// and the `sendmsg()` ones.
#[allow(clippy::too_many_arguments)]
fn nf_tables_hold(
    lock: SharedStr,
    tgid: u32,
    tid: u32,
    comm: &Comm,
    start_ns: u64,
    end_ns: u64,
    nft: Option<NftBatch>,
    cx: &mut Ctx<'_>,
) -> HoldFact {
    let who = cx.who(tgid, comm);
    let hold_ns = end_ns.saturating_sub(start_ns);
    HoldFact {
        lock,
        pid: tgid,
        tid,
        who: Who::from(who.as_ref()),
        start_ns,
        hold_ns,
        owner: 0,
        exclusive: true,
        kernel_ns: hold_ns,
        replaces: 0,
        read_ns: 0,
        reads: 0,
        tables: Vec::new(),
        nft,
        swap_ns: 0,
        before_start: false,
        released_by: None,
        open: false,
        incomplete: false,
    }
}

/// One hand-over: `tgid` took the mutex at `ts_ns`.
#[derive(Clone, Debug)]
struct Change {
    ts_ns: u64,
    tid: u32,
    tgid: u32,
    comm: Comm,
}

/// A thread's recent wait on a commit mutex, for the nfnetlink waits behind that thread.
#[derive(Clone, Debug)]
struct CommitWait {
    start_ns: u64,
    end_ns: u64,
    lock: SharedStr,
    /// One per holder (its stretches summed).
    holders: Vec<HolderRef>,
    /// Each stretch behind one holder: its pid, from, until (a holder may hold twice).
    spans: Vec<(u32, u64, u64)>,
}

#[derive(Debug, Default)]
struct MutexState {
    name: Option<SharedStr>,
    changes: VecDeque<Change>,
}

/// The nf_tables locks' state: per mutex, its recent hand-overs.
#[derive(Debug, Default)]
pub struct NfTablesLock {
    /// The last commit lock named, by netns: commits come in runs from one netns.
    commit_name: Option<(u32, SharedStr)>,
    mutexes: FastMap<u64, MutexState>,
    /// Per thread, when its last wait on an nf_tables mutex ended with the mutex taken: a
    /// batch's hold starts there, not at its `sendmsg()`.
    acquired: FastMap<u32, u64>,
    /// The nft_commit hook reports the batches: their `sendmsg()` is not a hold then.
    commit_hook: bool,
    /// Per thread, its last waits on a commit mutex (while it held nfnetlink's mutex).
    commit_waits: FastMap<u32, VecDeque<CommitWait>>,
}

/// Commit waits kept per thread (a batch waits once; a few cover retries).
const COMMIT_WAITS_PER_THREAD: usize = 4;

/// A contention that began on a free mutex and saw no hand-over is a spin when shorter than
/// this: a spin on a mutex being let go takes microseconds.
const SPIN_MAX_NS: u64 = 1_000_000;

/// Threads whose last acquisition is kept (a batch's comes right before its hold).
const MAX_ACQUIRED: usize = 4096;

impl NfTablesLock {
    /// Feeds one event; any but the three nf_tables ones is ignored.
    pub fn handle(&mut self, ev: &Event, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        match ev {
            Event::NftCommit(c) => {
                let h = self.on_commit(c, cx);
                out(Output::Hold(h))
            }
            Event::NftMutexWait(w) => self.on_wait(w, cx, out),
            Event::NftSend(b) => {
                if let Some(h) = self.on_send(b, cx) {
                    out(Output::Hold(h));
                }
            }
            _ => {}
        }
    }

    /// One batch as the nft_commit hook timed it (its batch function's entry and return):
    /// a hold of its netns's commit lock. Holds come from the hook from then on.
    fn on_commit(&mut self, c: &NftCommitEvent, cx: &mut Ctx<'_>) -> HoldFact {
        self.commit_hook = true;
        let lock = match &self.commit_name {
            Some((netns, name)) if *netns == c.netns => name.clone(),
            _ => {
                let name = nft_commit_lock(c.netns);
                self.commit_name = Some((c.netns, name.clone()));
                name
            }
        };
        let batch = c.batch.as_deref().copied();
        nf_tables_hold(lock, c.tgid, c.tid, &c.comm, c.enter_ns, c.ts_ns, batch, cx)
    }

    /// An nf_tables batch's `sendmsg()`: a hold of its netns's commit lock, from the call's
    /// start or, when it waited for an nf_tables mutex, from the end of its last wait, to
    /// its return, with what the batch changed where it was counted. `None` where the
    /// nft_commit hook times the batches.
    fn on_send(&mut self, e: &NftSendEvent, cx: &mut Ctx<'_>) -> Option<HoldFact> {
        let acquired = self.acquired.remove(&e.tid);
        if self.commit_hook {
            return None;
        }
        let end = e.ts_ns.max(e.enter_ns);
        let start = acquired
            .filter(|&a| a >= e.enter_ns && a <= end)
            .unwrap_or(e.enter_ns);
        Some(nf_tables_hold(
            nft_commit_lock(e.netns),
            e.tgid,
            e.tid,
            &e.comm,
            start,
            end,
            e.batch.as_deref().copied(),
            cx,
        ))
    }

    /// One wait: its fact, then its end as a hand-over when it took the mutex.
    fn on_wait(&mut self, e: &NftMutexWaitEvent, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        if !self.mutexes.contains_key(&e.lock) && self.mutexes.len() >= MAX_MUTEXES {
            // A netns gone long ago is the likeliest to be idle: start over.
            self.mutexes.clear();
        }
        let st = self.mutexes.entry(e.lock).or_default();
        let name = st
            .name
            .get_or_insert_with(|| match e.mutex {
                NftMutex::Commit => nft_commit_lock(e.netns),
                NftMutex::Nfnl => SharedStr::from(NFNL_LOCK),
            })
            .clone();
        let mut holders = split(e, &st.changes, cx);
        let end = e.ts_ns.max(e.start_ns);
        match e.mutex {
            NftMutex::Nfnl => link(&mut holders, &self.commit_waits),
            NftMutex::Commit if !holders.refs.is_empty() => {
                if self.commit_waits.len() >= MAX_ACQUIRED
                    && !self.commit_waits.contains_key(&e.tid)
                {
                    self.commit_waits.clear();
                }
                let q = self.commit_waits.entry(e.tid).or_default();
                if q.len() >= COMMIT_WAITS_PER_THREAD {
                    q.pop_front();
                }
                q.push_back(CommitWait {
                    start_ns: e.start_ns,
                    end_ns: end,
                    lock: name.clone(),
                    holders: holders.refs.clone(),
                    spans: holders
                        .spans
                        .iter()
                        .map(|&(p, _, f, u)| (p, f, u))
                        .collect(),
                });
            }
            NftMutex::Commit => {}
        }
        // Began on a free mutex (its owner letting go) and nobody else took it meanwhile:
        // the waiter spun and took it, behind no one. Not a wait; still a hand-over. Unless
        // it lasted: then a task took the mutex on its fast path, without a contention to
        // see, and held it meanwhile: a wait behind an unknown holder.
        if !holders.refs.is_empty() || end - e.start_ns >= SPIN_MAX_NS {
            let who = cx.who(e.tgid, &e.comm);
            out(Output::Wait(WaitFact {
                lock: name,
                pid: e.tgid,
                tid: e.tid,
                who: Who::from(who.as_ref()),
                start_ns: e.start_ns,
                wait_ns: end - e.start_ns,
                holders: holders.refs,
                unknown_ns: holders.unknown_ns,
                free_ns: 0,
                other_holders: 0,
                other_holders_ns: 0,
                outcome: if e.ret == 0 {
                    WaitOutcome::Acquired
                } else {
                    WaitOutcome::TimedOut
                },
                mode: WaitMode::Blocking,
                tries: 0,
                ret: (e.ret != 0).then_some(i64::from(e.ret)),
                incomplete: false,
            }));
        }
        if e.ret == 0 {
            // Only a sendmsg() hold starts there; with the commit hook none comes to take it.
            if !self.commit_hook {
                if self.acquired.len() >= MAX_ACQUIRED {
                    self.acquired.clear();
                }
                self.acquired.insert(e.tid, end);
            }
            if st.changes.len() >= MAX_CHANGES {
                st.changes.pop_front();
            }
            // Kept in time order: a hand-over stamped before the last one goes in its place.
            let at = st.changes.partition_point(|c| c.ts_ns <= end);
            st.changes.insert(
                at,
                Change {
                    ts_ns: end,
                    tid: e.tid,
                    tgid: e.tgid,
                    comm: e.comm,
                },
            );
        }
    }
}

/// A wait's holders, each with the time behind it.
struct Split {
    refs: Vec<HolderRef>,
    unknown_ns: u64,
    /// Each stretch behind one holder: its pid, thread, from, until.
    spans: Vec<(u32, u32, u64, u64)>,
}

/// The holder at the start holds until the first hand-over inside the wait, that one until
/// the next, the last one until the wait's end.
fn split(e: &NftMutexWaitEvent, changes: &VecDeque<Change>, cx: &mut Ctx<'_>) -> Split {
    let end = e.ts_ns.max(e.start_ns);
    let mut spans: Vec<(Arc<Attribution>, u32, u64)> = Vec::new();
    if let Some((tid, tgid)) = e.holder {
        spans.push((cx.who(tgid, &e.holder_comm), tid, e.start_ns));
    }
    let from = changes.partition_point(|c| c.ts_ns <= e.start_ns);
    for c in changes.range(from..).take_while(|c| c.ts_ns < end) {
        spans.push((cx.who(c.tgid, &c.comm), c.tid, c.ts_ns));
    }
    let unknown_ns = match spans.first() {
        Some((_, _, t)) => t - e.start_ns,
        None => end - e.start_ns,
    };
    let mut refs: Vec<HolderRef> = Vec::new();
    let mut stretches = Vec::with_capacity(spans.len());
    for (i, (who, tid, t)) in spans.iter().enumerate() {
        let until = spans.get(i + 1).map_or(end, |(_, _, n)| *n);
        stretches.push((who.pid, *tid, *t, until));
        let behind = until.saturating_sub(*t);
        match refs.iter_mut().find(|r| r.pid == who.pid) {
            Some(r) => r.behind_ns = Some(r.behind_ns.unwrap_or(0) + behind),
            None => {
                let mut r = HolderRef::from(&**who);
                r.behind_ns = Some(behind);
                r.from_ns = Some(*t);
                refs.push(r);
            }
        }
    }
    Split {
        refs,
        unknown_ns,
        spans: stretches,
    }
}

/// An nfnetlink wait's holders that were themselves waiting for a commit mutex meanwhile:
/// each gets that wait, clipped to the stretches the nfnetlink wait was behind it.
fn link(split: &mut Split, commit_waits: &FastMap<u32, VecDeque<CommitWait>>) {
    for r in &mut split.refs {
        let mut lock: Option<(SharedStr, u64)> = None;
        let mut wait_ns = 0;
        let mut holders: Vec<HolderRef> = Vec::new();
        for &(_, tid, from, until) in split.spans.iter().filter(|s| s.0 == r.pid) {
            let Some(q) = commit_waits.get(&tid) else {
                continue;
            };
            for w in q {
                let (a, b) = (from.max(w.start_ns), until.min(w.end_ns));
                if a >= b {
                    continue;
                }
                wait_ns += b - a;
                if lock.as_ref().is_none_or(|(_, n)| *n < b - a) {
                    lock = Some((w.lock.clone(), b - a));
                }
                // The commit wait's holders, each over its own stretches within [a, b).
                for &(pid, hf, ht) in &w.spans {
                    let (ca, cb) = (hf.max(a), ht.min(b));
                    if ca >= cb {
                        continue;
                    }
                    let Some(h) = w.holders.iter().find(|h| h.pid == pid) else {
                        continue;
                    };
                    match holders.iter_mut().find(|x| x.pid == h.pid) {
                        Some(x) => x.behind_ns = Some(x.behind_ns.unwrap_or(0) + (cb - ca)),
                        None => {
                            let mut x = h.clone();
                            x.behind_ns = Some(cb - ca);
                            x.from_ns = Some(ca);
                            x.waiting = None;
                            holders.push(x);
                        }
                    }
                }
            }
        }
        if let Some((lock, _)) = lock {
            r.waiting = Some(Arc::new(Waiting {
                lock,
                wait_ns,
                holders,
            }));
        }
    }
}

#[cfg(test)]
mod tests;
