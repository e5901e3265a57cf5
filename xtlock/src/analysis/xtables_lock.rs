//! The xtables lock state machine: `flock` events in, holds, waits, failed tries and timeouts
//! out. (nf_tables locking is `nf_tables_lock.rs`, fed by the `Analyzer` apart.)
//!
//! Pure: no clock (event time only), no I/O. What the kernel tells us (`filelock:
//! flock_lock_inode`, and how a blocking `flock()` ended: `FlockCall`, sent by the BPF side
//! when the retry after a wait takes the lock or a signal interrupts it), and how it is read
//! here:
//!
//! * Holds are keyed by **owner** (`fl_owner`, the open file description), not by pid:
//!   forked children share it, and the release comes from whoever drops the last
//!   reference (`close()`, exit, even a kworker running a delayed `fput`). A release for an
//!   owner with no hold is ignored: closing *any* descriptor of the file emits `F_UNLCK`
//!   while someone holds a flock on it.
//! * A blocking `flock(LOCK_EX)` behind a holder: `Deferred`, later `Acquired` from the
//!   same thread, then its `FlockCall`. A timeout (`alarm()`, iptables `-w N`): `Deferred`
//!   then a `FlockCall` with a negative return (`-EINTR`; `-ERESTARTSYS` in captures of
//!   builds that hooked the syscall exit) and no `Acquired`.
//! * `LOCK_NB`: `Failed { errno: EAGAIN }`. A run of failures by one pid ended by a success
//!   is a *poll* wait (Go daemons retry every 200 ms; old iptables polled every `-W` µs).
//!
//! Two rules make the holder exact (docs/lock-analysis.md):
//!
//! * **The release window.** A plain `iptables` never unlocks: the kernel releases the lock
//!   when it closes the exiting process's files, 50 µs to tens of ms *after* the exit event
//!   (tearing down a large address space comes first). A hold whose users all exited is
//!   still held until its release: waits, failed tries and metrics name it as the holder.
//! * **Ring order is not time order.** The tracepoint fires after the kernel drops its
//!   spinlock, and CPUs write to the ring in turn: the next taker's acquire can reach us
//!   before the old holder's release, even with an earlier time. A conflicting acquire
//!   proves the old hold ended by then: its end is its real release, bounded above by that
//!   acquire; it is inferred only if the release never comes within a grace period.
//!
//! Every structure is bounded: open holds and waits per lock ([`MAX_OPEN_HOLDS`],
//! [`MAX_OPEN_WAITS`], excess counted and reported as a [`Bound`]), holders named per wait
//! ([`MAX_HOLDERS`], more counted), users per hold, and lookups go through indexes (owner,
//! tid, pid) instead of scans.

use std::collections::VecDeque;
use std::sync::Arc;

use indexmap::IndexMap;
use smallvec::SmallVec;

pub use super::attribution::Ctx;
use super::attribution::{is_locking_comm, Attribution};
use super::facts::{
    FailedTryFact, HoldFact, HolderRef, LostFact, Output, TableTouch, TimeoutFact, WaitFact,
    WaitMode, WaitOutcome, Who, MAX_TABLES_PER_HOLD,
};
use super::procs::{FastMap, ProcTable};
use crate::decode::{
    Comm, Event, ExitEvent, FlockCallEvent, ForkEvent, LockEvent, LockOp, LockSeed,
    TableReplaceEvent, XtReplaceEvent,
};
pub use crate::lockfiles::WatchedLock;
use crate::shared::SharedStr;

/// How long a hold whose end we inferred waits for its real release (event time).
pub const GRACE_NS: u64 = 1_000_000_000;
/// Failed tries further apart than this are separate attempts, not one poll wait.
pub const POLL_GAP_NS: u64 = 10_000_000_000;
/// Locks seen in events but not configured are tracked too, up to this many in all.
const MAX_LOCKS: usize = 64;
/// Processes sharing one hold's owner that we follow; beyond, the hold is never inferred
/// to be over by exits.
const MAX_USERS: usize = 64;
/// Bound on the per-pid memory of lock trouble (against lost exits).
const MAX_TROUBLE: usize = 4096;
/// Threads with an `xt_replace_table` waiting for the end of their table replace.
const MAX_PENDING_SWAPS: usize = 4096;
/// Holds of one lock open at once. Exclusive holds come one at a time; shared ones (a
/// `LOCK_SH` per reader) are the only way past a few.
pub const MAX_OPEN_HOLDS: usize = 1024;
/// Waits, and poll runs, on one lock open at once.
pub const MAX_OPEN_WAITS: usize = 1024;
/// Holders named per wait; more are counted (`other_holders`).
pub const MAX_HOLDERS: usize = 64;
/// Holder changes kept for the waits open on one lock.
const MAX_TIMELINE: usize = 4096;
/// How much later than a wait's start its first holder's acquire may be stamped and still
/// count from the start: two CPUs' programs read the clock a few µs apart.
const CLOCK_SKEW_NS: u64 = 100_000;
/// Ended holds kept for events that reach us late.
const RECENT_HOLDS: usize = 8;

/// An insertion-ordered map: facts still open at the end come out in the order they began,
/// whatever the hasher, so a replay is byte-identical.
type OrderedMap<K, V> = IndexMap<K, V, foldhash::fast::RandomState>;

/// A take this soon after a seed of the same process's hold is the take the seed saw (see
/// the acquire path): a flock() syscall under emulation can last this long.
const SEED_RACE_NS: u64 = 1_000_000_000;

/// A hold's key: its owner (the open file description), or for a hold seen in /proc/locks
/// at start, whose owner is unknown, the pid that held it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum HoldKey {
    Owner(u64),
    Seed(u32),
}

/// What is known of the end of a hold whose release has not been seen.
#[derive(Clone, Copy, Debug)]
struct Ending {
    /// Every process using it had exited by then. The kernel releases the lock when it
    /// closes their files, shortly *after* the exit event: until then it is still held.
    exited_ns: Option<u64>,
    /// Another owner took the lock in a conflicting mode then, so it was released by then
    /// (its release event is late or lost).
    superseded_ns: Option<u64>,
    /// When to stop waiting for the release and report the end as inferred.
    deadline_ns: u64,
}

#[derive(Debug)]
struct OpenHold {
    owner: u64,
    pid: u32,
    tid: u32,
    start_ns: u64,
    exclusive: bool,
    who: Arc<Attribution>,
    /// Pids/tids that share the owner, and whether they exited.
    users: Users,
    users_overflow: bool,
    kernel_ns: u64,
    replaces: u32,
    read_ns: u64,
    reads: u32,
    tables: Vec<TableTouch>,
    swap_ns: u64,
    incomplete: bool,
    /// Held when tracing began (from /proc/locks): start and owner unknown.
    before_start: bool,
    ending: Option<Ending>,
    /// [`LockMachine::losses`] when it began.
    losses: u64,
}

impl OpenHold {
    /// Still held as far as the kernel is concerned. A holder that exited holds the lock
    /// until its files are closed; only a conflicting acquire proves it released.
    fn holding(&self) -> bool {
        self.ending.is_none_or(|e| e.superseded_ns.is_none())
    }

    /// End of a hold released at `ts`: the real release, bounded above by the next
    /// conflicting acquire (whose event may come first, with an earlier time). Never the
    /// exit time when a release follows.
    fn release_end(&self, ts: u64) -> u64 {
        match self.ending.and_then(|e| e.superseded_ns) {
            Some(s) => ts.min(s),
            None => ts,
        }
    }

    /// Best guess of the end when the release never came: the conflicting acquire, else
    /// the exit of its last user, else `fallback`.
    fn inferred_end(&self, fallback: u64) -> u64 {
        self.ending
            .and_then(|e| e.superseded_ns.or(e.exited_ns))
            .unwrap_or(fallback)
    }

    fn ending_mut(&mut self) -> &mut Ending {
        self.ending.get_or_insert(Ending {
            exited_ns: None,
            superseded_ns: None,
            deadline_ns: u64::MAX,
        })
    }
}

/// Pids/tids sharing a hold's owner, and whether each exited. Nearly always just the one
/// that took it: that one is kept inline, so a hold allocates nothing.
#[derive(Debug)]
struct Users {
    first: (u32, bool),
    rest: Vec<(u32, bool)>,
}

impl Users {
    fn new(pid: u32) -> Self {
        Users {
            first: (pid, false),
            rest: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        1 + self.rest.len()
    }

    fn push(&mut self, u: (u32, bool)) {
        self.rest.push(u);
    }

    fn contains(&self, pid: u32) -> bool {
        self.iter().any(|u| u.0 == pid)
    }

    fn iter(&self) -> impl Iterator<Item = &(u32, bool)> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut (u32, bool)> {
        std::iter::once(&mut self.first).chain(self.rest.iter_mut())
    }
}

/// A holder when a wait began: its owner, who, and when its hold ended if it had by the
/// time the wait's event reached us (see [`LockState::current_holders`]).
#[derive(Clone, Debug)]
struct Holding {
    owner: u64,
    who: Arc<Attribution>,
    ended_ns: Option<u64>,
}

/// The holders when a wait began; nearly always one.
type Current = SmallVec<[Holding; 1]>;

#[derive(Debug)]
struct OpenWait {
    tid: u32,
    pid: u32,
    owner: u64,
    comm: Comm,
    start_ns: u64,
    /// Who held the lock when it began.
    initial: Current,
    /// Holder changes of the lock from this one on happened during the wait (see
    /// [`Timeline`]).
    from_seq: u64,
    /// Got the lock then; reported at the syscall return (for its entry time).
    acquired_ns: Option<u64>,
    /// Holder changes up to this one (exclusive) happened during the wait.
    to_seq: u64,
    incomplete: bool,
}

#[derive(Debug)]
struct PollStreak {
    pid: u32,
    tid: u32,
    comm: Comm,
    first_ns: u64,
    last_ns: u64,
    tries: u32,
    initial: Current,
    from_seq: u64,
}

/// A change of holder: `who` took the lock at `ts_ns` through `owner`, or (`who` None) the
/// hold of `owner` was released then.
#[derive(Debug)]
struct Change {
    ts_ns: u64,
    owner: u64,
    who: Option<Arc<Attribution>>,
}

/// The lock's holder changes while anyone waits, numbered. A wait keeps only the number of
/// the first change after it began, and builds its holders when it ends: an acquire costs
/// one push, however many wait. Bounded: the oldest changes go first, and a wait that
/// outlived them counts them as holders not named.
#[derive(Debug, Default)]
struct Timeline {
    /// Number of `changes[0]`.
    base: u64,
    changes: VecDeque<Change>,
}

impl Timeline {
    /// Number the next change will get.
    fn end_seq(&self) -> u64 {
        self.base + self.changes.len() as u64
    }

    fn push(&mut self, c: Change) {
        if self.changes.len() >= MAX_TIMELINE {
            self.changes.pop_front();
            self.base += 1;
        }
        self.changes.push_back(c);
    }

    /// Forgets every change (nobody waits).
    fn clear(&mut self) {
        self.base = self.end_seq();
        self.changes.clear();
    }

    /// Changes numbered `from..to`, and how many of those were forgotten.
    fn range(&self, from: u64, to: u64) -> (u64, impl Iterator<Item = &Change>) {
        let to = to.min(self.end_seq());
        let lost = self.base.saturating_sub(from).min(to.saturating_sub(from));
        let start = from.saturating_sub(self.base) as usize;
        let end = to.saturating_sub(self.base) as usize;
        let n = end.saturating_sub(start);
        (lost, self.changes.iter().skip(start).take(n))
    }
}

/// A hold that ended lately, kept for events that reach us after its release although
/// they happened before it (ring order is not time order).
#[derive(Debug)]
struct Ended {
    owner: u64,
    start_ns: u64,
    end_ns: u64,
    who: Arc<Attribution>,
}

/// Open waits by tid, with the tids of each pid (a process exit ends its threads' waits).
#[derive(Debug, Default)]
struct Waits {
    by_tid: OrderedMap<u32, OpenWait>,
    tids_of: FastMap<u32, SmallVec<[u32; 1]>>,
}

impl Waits {
    fn len(&self) -> usize {
        self.by_tid.len()
    }

    fn is_empty(&self) -> bool {
        self.by_tid.is_empty()
    }

    fn get(&self, tid: u32) -> Option<&OpenWait> {
        self.by_tid.get(&tid)
    }

    fn get_mut(&mut self, tid: u32) -> Option<&mut OpenWait> {
        self.by_tid.get_mut(&tid)
    }

    fn insert(&mut self, w: OpenWait) {
        self.tids_of.entry(w.pid).or_default().push(w.tid);
        self.by_tid.insert(w.tid, w);
    }

    fn remove(&mut self, tid: u32) -> Option<OpenWait> {
        let w = self.by_tid.swap_remove(&tid)?;
        if let Some(tids) = self.tids_of.get_mut(&w.pid) {
            tids.retain(|t| *t != tid);
            if tids.is_empty() {
                self.tids_of.remove(&w.pid);
            }
        }
        Some(w)
    }

    /// Removes every wait of process `pid`.
    fn remove_pid(&mut self, pid: u32) -> SmallVec<[OpenWait; 1]> {
        let tids = self.tids_of.remove(&pid).unwrap_or_default();
        tids.into_iter()
            .filter_map(|t| self.by_tid.swap_remove(&t))
            .collect()
    }

    fn take_all(&mut self) -> Vec<OpenWait> {
        self.tids_of.clear();
        self.by_tid.drain(..).map(|(_, w)| w).collect()
    }
}

#[derive(Debug)]
struct LockState {
    lock: WatchedLock,
    /// `lock.path`, shared by the facts.
    name: SharedStr,
    holds: OrderedMap<HoldKey, OpenHold>,
    /// pid/tid → the holds it uses (forks, exits and table replaces find them by pid).
    users: FastMap<u32, SmallVec<[HoldKey; 1]>>,
    waits: Waits,
    /// Poll runs by pid.
    polls: OrderedMap<u32, PollStreak>,
    timeline: Timeline,
    recent: VecDeque<Ended>,
}

impl LockState {
    fn new(lock: WatchedLock) -> Self {
        LockState {
            name: SharedStr::from(lock.path.as_str()),
            lock,
            holds: OrderedMap::default(),
            users: FastMap::default(),
            waits: Waits::default(),
            polls: OrderedMap::default(),
            timeline: Timeline::default(),
            recent: VecDeque::new(),
        }
    }

    /// Adds a hold; false (and nothing added) past [`MAX_OPEN_HOLDS`].
    fn insert_hold(&mut self, key: HoldKey, h: OpenHold) -> bool {
        if self.holds.len() >= MAX_OPEN_HOLDS && !self.holds.contains_key(&key) {
            return false;
        }
        for &(u, _) in h.users.iter() {
            index_user(&mut self.users, u, key);
        }
        self.holds.insert(key, h);
        true
    }

    fn add_user(&mut self, key: HoldKey, pid: u32) {
        let Some(h) = self.holds.get_mut(&key) else {
            return;
        };
        if h.users.contains(pid) {
            return;
        }
        if h.users.len() < MAX_USERS {
            h.users.push((pid, false));
            index_user(&mut self.users, pid, key);
        } else {
            h.users_overflow = true;
        }
    }

    /// Removes a hold, in place (the others keep their order).
    fn remove_hold(&mut self, key: HoldKey) -> Option<OpenHold> {
        let h = self.holds.shift_remove(&key)?;
        for &(u, _) in h.users.iter() {
            if let Some(keys) = self.users.get_mut(&u) {
                keys.retain(|k| *k != key);
                if keys.is_empty() {
                    self.users.remove(&u);
                }
            }
        }
        Some(h)
    }

    /// Reports a hold that ended at `end_ns`.
    fn emit_hold(
        &mut self,
        h: OpenHold,
        end_ns: u64,
        open: bool,
        incomplete: bool,
        released_by: Option<u32>,
        out: &mut dyn FnMut(Output),
    ) {
        if !open {
            if self.recent.len() >= RECENT_HOLDS {
                self.recent.pop_front();
            }
            self.recent.push_back(Ended {
                owner: h.owner,
                start_ns: h.start_ns,
                end_ns,
                who: h.who.clone(),
            });
        }
        out(Output::Hold(hold_fact(
            &self.name,
            &h,
            end_ns,
            open,
            incomplete,
            released_by,
        )));
    }

    /// Who holds the lock at `ts` for a requester through `owner`: every open hold still
    /// held (an exited holder until its release), and a hold whose release we have seen
    /// but that was still held at `ts` (the requester's event came late).
    fn current_holders(&self, ts: u64, owner: u64) -> Current {
        let mut v: Current = self
            .holds
            .values()
            .filter(|h| h.holding() && h.owner != owner)
            .take(MAX_HOLDERS)
            .map(|h| Holding {
                owner: h.owner,
                who: h.who.clone(),
                ended_ns: None,
            })
            .collect();
        for r in &self.recent {
            if r.owner != owner
                && r.start_ns <= ts
                && ts < r.end_ns
                && !v.iter().any(|w| w.who.pid == r.who.pid)
            {
                v.push(Holding {
                    owner: r.owner,
                    who: r.who.clone(),
                    ended_ns: Some(r.end_ns),
                });
            }
        }
        v
    }

    /// The holders of a wait that began at `start_ns` with `initial` holders, whose holder
    /// changes are numbered `from..to`, ending at `end_ns`; `pid` is the waiter.
    fn holders_of(&self, span: HolderSpan<'_>) -> Holders {
        let mut hs = Holders::starting(span.start_ns);
        for h in span.initial {
            hs.push(h.owner, &h.who, span.start_ns);
        }
        for h in span.initial {
            if let Some(end) = h.ended_ns {
                hs.release(h.owner, end);
            }
        }
        let (lost, changes) = self.timeline.range(span.from_seq, span.to_seq);
        hs.others = hs.others.saturating_add(lost as u32);
        for c in changes {
            match &c.who {
                Some(who) if c.owner != span.owner && who.pid != span.pid => {
                    hs.push(c.owner, who, c.ts_ns)
                }
                Some(_) => {}
                None => hs.release(c.owner, c.ts_ns),
            }
        }
        hs.end(span.end_ns);
        hs
    }

    /// Nobody waits any more: the holder changes kept for waits can go.
    fn settle_timeline(&mut self) {
        if self.waits.is_empty() && self.polls.is_empty() {
            self.timeline.clear();
        }
    }
}

fn index_user(users: &mut FastMap<u32, SmallVec<[HoldKey; 1]>>, pid: u32, key: HoldKey) {
    let keys = users.entry(pid).or_default();
    if !keys.contains(&key) {
        keys.push(key);
    }
}

/// What [`LockState::holders_of`] needs of a wait or a poll run.
struct HolderSpan<'a> {
    pid: u32,
    owner: u64,
    start_ns: u64,
    end_ns: u64,
    initial: &'a [Holding],
    from_seq: u64,
    to_seq: u64,
}

/// Lock trouble of an iptables-family pid, kept until it exits (for [`TimeoutFact`]).
#[derive(Debug)]
struct Trouble {
    lock: usize,
    first_ns: u64,
    waited_ns: u64,
    tries: u32,
    holders: Holders,
}

/// Everything the wait emitter needs, whatever kind of wait it was.
struct WaitEnd<'a> {
    pid: u32,
    tid: u32,
    comm: &'a Comm,
    start_ns: u64,
    end_ns: u64,
    holders: &'a Holders,
    outcome: WaitOutcome,
    mode: WaitMode,
    tries: u32,
    ret: Option<i64>,
    incomplete: bool,
}

/// [`Holders::current`] before any holder is known.
const NO_HOLDER: usize = usize::MAX;
/// [`Holders::current`] for a holder past [`MAX_HOLDERS`].
const OTHER_HOLDER: usize = usize::MAX - 1;
/// [`Holders::current`] once the holder released and before the next took the lock.
const FREE: usize = usize::MAX - 2;

/// Everyone who held the lock during a wait, first to last, one entry per pid (at most
/// [`MAX_HOLDERS`]; more are counted), and how long the wait lasted behind each: a holder's
/// stretch runs from when it took the lock (or the wait began) to its release (or to when
/// the next one took the lock, if the release comes later, or the wait's end). The time the
/// lock was free while the waiter still waited (a poller's interval, a wake-up) is apart:
/// the stretches, that and the unknown add up to the wait. The pids are kept apart, so the
/// duplicate check scans a dense array.
#[derive(Debug)]
struct Holders {
    pids: Vec<u32>,
    /// The highest of `pids`: a holder above it (a new process, the usual case while pids
    /// grow) is new without a scan.
    max_pid: u32,
    who: Vec<Arc<Attribution>>,
    /// Time behind each, and when each first held the lock during the wait.
    behind_ns: Vec<u64>,
    from_ns: Vec<u64>,
    /// Index of the holder now, or [`NO_HOLDER`] / [`OTHER_HOLDER`] / [`FREE`].
    current: usize,
    /// The owner of the current holder's hold (whose release ends its stretch).
    current_owner: u64,
    /// Time the lock was free while the wait went on.
    free_ns: u64,
    /// Start of the current stretch.
    mark_ns: u64,
    /// Time before any holder was known.
    unknown_ns: u64,
    /// Holders past the cap (counted per hand-over) and the time behind them.
    others: u32,
    others_ns: u64,
    /// Where the last stretch closed went (a holder's index, or one of the markers), and
    /// its length: a wait that ends before it gives the overrun back (see [`Holders::end`]).
    last_bucket: usize,
    last_ns: u64,
}

impl Default for Holders {
    fn default() -> Self {
        Holders::starting(0)
    }
}

impl Holders {
    fn starting(ts: u64) -> Self {
        Holders {
            pids: Vec::new(),
            max_pid: 0,
            who: Vec::new(),
            behind_ns: Vec::new(),
            from_ns: Vec::new(),
            current: NO_HOLDER,
            current_owner: 0,
            free_ns: 0,
            mark_ns: ts,
            unknown_ns: 0,
            others: 0,
            others_ns: 0,
            last_bucket: NO_HOLDER,
            last_ns: 0,
        }
    }

    fn index_of(&self, pid: u32) -> Option<usize> {
        if pid > self.max_pid {
            return None;
        }
        self.pids.iter().position(|&p| p == pid)
    }

    /// `who` holds the lock from `ts` on. A time before the current stretch began counts
    /// from its start: the acquire's event can reach us after the wait's, with an earlier
    /// time.
    fn push(&mut self, owner: u64, who: &Arc<Attribution>, ts: u64) {
        // The wait itself proves the lock was held when it began: a first holder whose
        // acquire is stamped a little after that (its CPU read the clock later) held it
        // from the start.
        let first = self.current == NO_HOLDER && self.pids.is_empty();
        let ts = if first && ts.saturating_sub(self.mark_ns) <= CLOCK_SKEW_NS {
            self.mark_ns
        } else {
            ts.max(self.mark_ns)
        };
        let i = match self.index_of(who.pid) {
            Some(i) => i,
            None if self.pids.len() < MAX_HOLDERS => {
                self.max_pid = self.max_pid.max(who.pid);
                self.pids.push(who.pid);
                self.who.push(who.clone());
                self.behind_ns.push(0);
                self.from_ns.push(ts);
                self.pids.len() - 1
            }
            None => {
                if self.current != OTHER_HOLDER {
                    self.others = self.others.saturating_add(1);
                }
                OTHER_HOLDER
            }
        };
        if i != self.current {
            self.close_stretch(ts);
            self.current = i;
        }
        self.current_owner = owner;
    }

    /// The hold of `owner` was released at `ts`: if it is the current holder's, the lock is
    /// free from then (a release that reaches us after the next acquire changes nothing).
    fn release(&mut self, owner: u64, ts: u64) {
        if self.current_owner == owner && self.current < FREE {
            self.close_stretch(ts.max(self.mark_ns));
            self.current = FREE;
        }
    }

    /// The time counted in `bucket`: a holder's, or the unknown, other or free time.
    fn bucket(&mut self, bucket: usize) -> &mut u64 {
        match bucket {
            NO_HOLDER => &mut self.unknown_ns,
            OTHER_HOLDER => &mut self.others_ns,
            FREE => &mut self.free_ns,
            i => &mut self.behind_ns[i],
        }
    }

    fn close_stretch(&mut self, ts: u64) {
        let d = ts.saturating_sub(self.mark_ns);
        *self.bucket(self.current) += d;
        (self.last_bucket, self.last_ns) = (self.current, d);
        self.mark_ns = self.mark_ns.max(ts);
    }

    /// The wait ended at `ts`. A stretch can have closed after that: the holder's release,
    /// stamped by its CPU's clock a few µs after the waiter's acquire, reached us first.
    /// Its overrun is given back, so that the stretches still add up to the wait.
    fn end(&mut self, ts: u64) {
        if ts < self.mark_ns {
            let over = (self.mark_ns - ts).min(self.last_ns);
            let b = self.bucket(self.last_bucket);
            *b = b.saturating_sub(over);
            self.mark_ns = ts;
            return;
        }
        self.close_stretch(ts);
    }

    /// Adds every holder of `other` (no times: for the holders of a pid's lock trouble).
    fn extend(&mut self, other: &Holders) {
        for w in &other.who {
            self.push(0, w, self.mark_ns);
        }
        self.others = self.others.saturating_add(other.others);
    }

    fn refs(&self, timed: bool) -> Vec<HolderRef> {
        self.who
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let mut r = HolderRef::from(&**w);
                if timed {
                    r.behind_ns = Some(self.behind_ns[i]);
                    r.from_ns = Some(self.from_ns[i]);
                }
                r
            })
            .collect()
    }
}

impl std::ops::Deref for Holders {
    type Target = [Arc<Attribution>];

    fn deref(&self) -> &[Arc<Attribution>] {
        &self.who
    }
}

/// A bound of the analysis was hit: what went past it is not tracked, and said so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bound {
    /// More than [`MAX_OPEN_HOLDS`] holds of one lock open at once.
    OpenHolds,
    /// More than [`MAX_OPEN_WAITS`] waits (or poll runs) on one lock open at once.
    OpenWaits,
}

impl Bound {
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::OpenHolds => "open_holds",
            Bound::OpenWaits => "open_waits",
        }
    }
}

/// The state machine. See the module docs.
#[derive(Debug)]
pub struct LockMachine {
    locks: Vec<LockState>,
    trouble: FastMap<u32, Trouble>,
    /// Earliest event time at which something pending must be settled.
    next_deadline: u64,
    /// Number of `Lost` reports so far.
    losses: u64,
    /// How often each bound was hit; the first hit of each is reported as a fact.
    over_bounds: std::collections::BTreeMap<Bound, u64>,
    /// Each thread's last `xt_replace_table` (enter, return), kept until the table replace
    /// around it ends: the kernel also swaps tables in when it first builds one in a netns
    /// (`xt_register_table`, under a get or a later syscall), which is no part of a replace.
    swaps: FastMap<u32, (u64, u64)>,
}

impl LockMachine {
    pub fn new(locks: Vec<WatchedLock>) -> Self {
        LockMachine {
            locks: locks.into_iter().map(LockState::new).collect(),
            trouble: FastMap::default(),
            next_deadline: u64::MAX,
            losses: 0,
            over_bounds: Default::default(),
            swaps: FastMap::default(),
        }
    }

    /// Watched locks, configured ones first, then those first seen in events.
    pub fn locks(&self) -> impl Iterator<Item = &WatchedLock> {
        self.locks.iter().map(|l| &l.lock)
    }

    /// How often each bound was hit (see [`Bound`]).
    pub fn over_bounds(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.over_bounds.iter().map(|(b, n)| (b.as_str(), *n))
    }

    /// Holds that still hold the lock right now, as (lock path, holder pid, start).
    pub fn open_holds(&self) -> impl Iterator<Item = (&str, u32, u64)> {
        self.locks.iter().flat_map(|l| {
            l.holds
                .values()
                .filter(|h| h.holding())
                .map(move |h| (l.lock.path.as_str(), h.pid, h.start_ns))
        })
    }

    /// Holds that still hold the lock right now, as (lock path, start, holder).
    pub fn open_holders(&self) -> impl Iterator<Item = (&SharedStr, u64, &Attribution)> {
        self.locks.iter().flat_map(|l| {
            l.holds
                .values()
                .filter(|h| h.holding())
                .map(move |h| (&l.name, h.start_ns, &*h.who))
        })
    }

    fn lock_index(&mut self, dev: u32, ino: u64) -> Option<usize> {
        if let Some(i) = self
            .locks
            .iter()
            .position(|l| l.lock.dev == dev && l.lock.ino == ino)
        {
            return Some(i);
        }
        if self.locks.len() >= MAX_LOCKS {
            return None;
        }
        // The probes only report watched inodes; one we were not told about still deserves
        // to be tracked and named.
        let path = format!("dev {}:{} ino {}", dev >> 20, dev & 0xf_ffff, ino);
        tracing::info!(%path, "lock events for an inode that was not configured");
        self.locks
            .push(LockState::new(WatchedLock { path, dev, ino }));
        Some(self.locks.len() - 1)
    }

    fn deadline(&mut self, at: u64) {
        self.next_deadline = self.next_deadline.min(at);
    }

    /// Counts a hit of `bound`; the first one is reported.
    fn over_bound(&mut self, li: usize, bound: Bound, ts: u64, out: &mut dyn FnMut(Output)) {
        let n = self.over_bounds.entry(bound).or_default();
        *n += 1;
        if *n == 1 {
            tracing::warn!(
                lock = %self.locks[li].lock.path,
                bound = bound.as_str(),
                "analysis bound reached: what goes past it is not tracked (counted in the summary)"
            );
            out(Output::Lost(LostFact {
                ts_ns: ts,
                count: 1,
                total: 1,
                bound: Some(bound.as_str()),
            }));
        }
    }

    /// Feeds one event. `Exit` is handled by [`LockMachine::on_exit`], which the caller
    /// needs the result of.
    pub fn handle(&mut self, ev: &Event, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        let ts = ev.ts_ns();
        if ts >= self.next_deadline {
            self.sweep(ts, cx, out);
        }
        match ev {
            Event::Lock(e) => self.on_lock(e, cx, out),
            Event::FlockCall(e) => self.on_flock_call(e, cx, out),
            Event::Fork(f) => self.on_fork(f),
            Event::TableReplace(t) => self.on_table_replace(t),
            Event::XtReplace(x) => self.on_xt_replace(x),
            Event::LockSeed(l) => self.on_seed(l, cx, out),
            Event::Exit(e) => {
                self.on_exit(e, false, cx, out);
            }
            Event::Lost { .. } => self.losses += 1,
            Event::Exec(_)
            | Event::Proc(_)
            | Event::Drop(_)
            | Event::Refusal(_)
            | Event::ConntrackFail(_)
            | Event::DropCounts(_)
            | Event::Conntrack(_)
            | Event::DropSetup { .. }
            | Event::KernelSymbol { .. }
            | Event::Ipvs(_)
            | Event::IpvsCounts(_)
            | Event::RefusalCounts(_)
            | Event::Pod(_)
            | Event::RuleTable(_)
            | Event::RuleCounters(_)
            | Event::Addr(_)
            | Event::CtEntries(_)
            | Event::IpvsTable(_)
            // nf_tables locking: `nf_tables_lock.rs`.
            | Event::NftCommit(_)
            | Event::NftMutexWait(_)
            | Event::NftSend(_) => {}
        }
    }

    /// Event time passes without an event of this machine: what is due is settled first.
    pub fn tick(&mut self, ts: u64, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        if ts >= self.next_deadline {
            self.sweep(ts, cx, out);
        }
    }

    fn on_lock(&mut self, e: &LockEvent, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        // Any lock event from a thread means its previous flock() returned: settle a wait
        // still expecting that return (lost or not traced).
        self.flush_acquired_of(e.tid, cx, out);
        let Some(li) = self.lock_index(e.dev, e.ino) else {
            return;
        };
        match e.op {
            LockOp::Acquired { exclusive } => self.on_acquired(li, e, exclusive, cx, out),
            LockOp::Deferred => self.on_deferred(li, e, out),
            LockOp::Failed { errno } => self.on_failed(li, e, errno, cx, out),
            LockOp::Released => self.on_released(li, e, out),
        }
    }

    fn on_acquired(
        &mut self,
        li: usize,
        e: &LockEvent,
        exclusive: bool,
        cx: &mut Ctx<'_>,
        out: &mut dyn FnMut(Output),
    ) {
        let losses = self.losses;
        let st = &mut self.locks[li];
        let key = HoldKey::Owner(e.owner);
        let mut new_deadline = None;
        let mut overflow = false;
        // The take a /proc/locks seed already saw while its flock() was still in the kernel
        // (where the take is stamped at the syscall's exit, it comes after the seed read):
        // one hold, from the take, not the seed and then the take.
        let seed = HoldKey::Seed(e.tgid);
        if st
            .holds
            .get(&seed)
            .is_some_and(|h| h.holding() && e.ts_ns.saturating_sub(h.start_ns) <= SEED_RACE_NS)
        {
            st.remove_hold(seed);
        }
        // Same owner, still held: a repeated flock() or a conversion, not a new hold.
        // Unless events were lost since it began: then its release was likely lost.
        if st
            .holds
            .get(&key)
            .is_some_and(|h| h.holding() && h.losses != losses)
        {
            if let Some(h) = st.remove_hold(key) {
                st.emit_hold(h, e.ts_ns, false, true, None, out);
            }
        }
        if let Some(h) = st.holds.get_mut(&key).filter(|h| h.holding()) {
            h.exclusive = exclusive;
            // Someone still uses the description: its users did not all exit after all.
            h.ending = None;
            st.add_user(key, e.tgid);
        } else {
            // Same owner whose end we inferred: that end was real after all.
            if let Some(h) = st.remove_hold(key) {
                let at = h.inferred_end(e.ts_ns);
                st.emit_hold(h, at, false, true, None, out);
            }
            // A conflicting holder has released by now: its release is late or lost.
            for h in st.holds.values_mut() {
                if (exclusive || h.exclusive) && h.holding() {
                    let end = h.ending_mut();
                    end.superseded_ns = Some(e.ts_ns);
                    end.deadline_ns = e.ts_ns.saturating_add(GRACE_NS);
                    new_deadline = Some(end.deadline_ns);
                }
            }
            let who = cx.who(e.tgid, &e.comm);
            // Whoever waits now waits behind this holder too.
            if !st.waits.is_empty() || !st.polls.is_empty() {
                st.timeline.push(Change {
                    ts_ns: e.ts_ns,
                    owner: e.owner,
                    who: Some(who.clone()),
                });
            }
            overflow = !st.insert_hold(
                key,
                OpenHold {
                    owner: e.owner,
                    pid: e.tgid,
                    tid: e.tid,
                    start_ns: e.ts_ns,
                    exclusive,
                    who,
                    users: Users::new(e.tgid),
                    users_overflow: false,
                    kernel_ns: 0,
                    replaces: 0,
                    read_ns: 0,
                    reads: 0,
                    tables: Vec::new(),
                    swap_ns: 0,
                    incomplete: false,
                    before_start: false,
                    ending: None,
                    losses,
                },
            );
        }
        // The thread's own blocking wait is over; reported at the syscall return.
        let to_seq = st.timeline.end_seq();
        if let Some(w) = st.waits.get_mut(e.tid).filter(|w| w.acquired_ns.is_none()) {
            w.acquired_ns = Some(e.ts_ns);
            w.to_seq = to_seq;
            new_deadline = Some(e.ts_ns.saturating_add(GRACE_NS));
        }
        // A poller got it.
        if let Some(p) = st.polls.swap_remove(&e.tgid) {
            let holders = st.holders_of(HolderSpan {
                pid: p.pid,
                owner: e.owner,
                start_ns: p.first_ns,
                end_ns: e.ts_ns,
                initial: &p.initial,
                from_seq: p.from_seq,
                to_seq,
            });
            st.settle_timeline();
            emit_wait(
                &st.name,
                WaitEnd {
                    pid: p.pid,
                    tid: p.tid,
                    comm: &p.comm,
                    start_ns: p.first_ns,
                    end_ns: e.ts_ns,
                    holders: &holders,
                    outcome: WaitOutcome::Acquired,
                    mode: WaitMode::Poll,
                    tries: p.tries,
                    ret: None,
                    incomplete: false,
                },
                cx,
                out,
            );
        }
        if let Some(d) = new_deadline {
            self.deadline(d);
        }
        if overflow {
            self.over_bound(li, Bound::OpenHolds, e.ts_ns, out);
        }
    }

    fn on_deferred(&mut self, li: usize, e: &LockEvent, out: &mut dyn FnMut(Output)) {
        let st = &mut self.locks[li];
        // Woken up and beaten to it again: same wait.
        if st.waits.get(e.tid).is_some() {
            return;
        }
        if st.waits.len() >= MAX_OPEN_WAITS {
            self.over_bound(li, Bound::OpenWaits, e.ts_ns, out);
            return;
        }
        let initial = st.current_holders(e.ts_ns, e.owner);
        let from_seq = st.timeline.end_seq();
        st.waits.insert(OpenWait {
            tid: e.tid,
            pid: e.tgid,
            owner: e.owner,
            comm: e.comm,
            start_ns: e.ts_ns,
            initial,
            from_seq,
            acquired_ns: None,
            to_seq: u64::MAX,
            incomplete: false,
        });
    }

    fn on_failed(
        &mut self,
        li: usize,
        e: &LockEvent,
        errno: i32,
        cx: &mut Ctx<'_>,
        out: &mut dyn FnMut(Output),
    ) {
        // A failure after a deferral ends that wait.
        if self.locks[li]
            .waits
            .get(e.tid)
            .is_some_and(|w| w.acquired_ns.is_none())
        {
            if let Some(w) = self.locks[li].waits.remove(e.tid) {
                self.end_wait(
                    li,
                    w,
                    e.ts_ns,
                    WaitOutcome::TimedOut,
                    Some(-i64::from(errno)),
                    cx,
                    out,
                );
            }
        }
        let st = &mut self.locks[li];
        let who = cx.who(e.tgid, &e.comm);
        let current = st.current_holders(e.ts_ns, e.owner);
        out(Output::FailedTry(FailedTryFact {
            lock: st.name.clone(),
            pid: e.tgid,
            tid: e.tid,
            comm: who.comm.clone(),
            agent: who.agent.clone(),
            role: who.role,
            ts_ns: e.ts_ns,
            errno,
            pod: who.pod.clone(),
            holder: current.first().map(|h| HolderRef::from(&*h.who)),
        }));
        // Extend the pid's poll run, or start one.
        let mut ended = None;
        let mut overflow = false;
        match st.polls.get_mut(&e.tgid) {
            Some(p) if e.ts_ns.saturating_sub(p.last_ns) <= POLL_GAP_NS => {
                p.tries += 1;
                p.last_ns = e.ts_ns;
            }
            found => {
                if found.is_some() {
                    ended = st.polls.swap_remove(&e.tgid);
                }
                if st.polls.len() >= MAX_OPEN_WAITS {
                    overflow = true;
                } else {
                    let from_seq = st.timeline.end_seq();
                    st.polls.insert(
                        e.tgid,
                        PollStreak {
                            pid: e.tgid,
                            tid: e.tid,
                            comm: e.comm,
                            first_ns: e.ts_ns,
                            last_ns: e.ts_ns,
                            tries: 1,
                            initial: current.clone(),
                            from_seq,
                        },
                    );
                }
            }
        }
        if let Some(p) = ended {
            self.end_poll(li, p, WaitOutcome::TimedOut, cx, out);
        }
        if is_locking_comm(&e.comm) {
            let t = self.trouble_of(e.tgid, li, e.ts_ns);
            t.tries += 1;
            t.waited_ns = t.waited_ns.max(e.ts_ns.saturating_sub(t.first_ns));
            for h in &current {
                t.holders.push(h.owner, &h.who, e.ts_ns);
            }
        }
        if overflow {
            self.over_bound(li, Bound::OpenWaits, e.ts_ns, out);
        }
        self.deadline(e.ts_ns.saturating_add(POLL_GAP_NS));
    }

    /// A hold in place when tracing began: its holder's pid is known, not its owner; its
    /// release is the first one from that process.
    fn on_seed(&mut self, s: &LockSeed, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        let Some(li) = self.lock_index(s.dev, s.ino) else {
            return;
        };
        let who = cx.who(s.pid, &Comm::default());
        let losses = self.losses;
        let added = self.locks[li].insert_hold(
            HoldKey::Seed(s.pid),
            OpenHold {
                owner: 0,
                pid: s.pid,
                tid: s.pid,
                start_ns: s.ts_ns,
                exclusive: s.exclusive,
                who,
                users: Users::new(s.pid),
                users_overflow: false,
                kernel_ns: 0,
                replaces: 0,
                read_ns: 0,
                reads: 0,
                tables: Vec::new(),
                swap_ns: 0,
                incomplete: false,
                before_start: true,
                ending: None,
                losses,
            },
        );
        if !added {
            self.over_bound(li, Bound::OpenHolds, s.ts_ns, out);
        }
    }

    fn on_released(&mut self, li: usize, e: &LockEvent, out: &mut dyn FnMut(Output)) {
        let st = &mut self.locks[li];
        let key = HoldKey::Owner(e.owner);
        let found = if st.holds.contains_key(&key) {
            Some(key)
        } else {
            // A hold from before tracing: released by its process (or a child).
            st.users.get(&e.tgid).and_then(|keys| {
                keys.iter()
                    .copied()
                    .find(|k| st.holds.get(k).is_some_and(|h| h.before_start))
            })
        };
        let Some(h) = found.and_then(|k| st.remove_hold(k)) else {
            // close() of any descriptor of the file while someone holds it, or the hold
            // began before tracing, or its acquire was lost.
            tracing::trace!(pid = e.tgid, owner = e.owner, "release without a hold");
            return;
        };
        let end = h.release_end(e.ts_ns);
        let incomplete = h.incomplete;
        if !st.waits.is_empty() || !st.polls.is_empty() {
            st.timeline.push(Change {
                ts_ns: end,
                owner: h.owner,
                who: None,
            });
        }
        st.emit_hold(h, end, false, incomplete, Some(e.tgid), out);
    }

    fn on_flock_call(&mut self, e: &FlockCallEvent, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        // Find the thread's wait: on the call's lock, or anywhere if the inode is unknown.
        let has = |st: &LockState| st.waits.get(e.tid).is_some();
        let li = self
            .locks
            .iter()
            .position(|st| st.lock.dev == e.dev && st.lock.ino == e.ino && has(st))
            .or_else(|| self.locks.iter().position(has));
        let Some(li) = li else {
            return;
        };
        let Some(mut w) = self.locks[li].waits.remove(e.tid) else {
            return;
        };
        // The syscall began before the first deferral: that is when the wait began.
        if e.enter_ns != 0 && e.enter_ns < w.start_ns {
            w.start_ns = e.enter_ns;
        }
        match w.acquired_ns {
            Some(at) => self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out),
            None if e.ret < 0 => {
                self.end_wait(li, w, e.ts_ns, WaitOutcome::TimedOut, Some(e.ret), cx, out)
            }
            None => {
                // Success without the `Acquired` event: it was lost. The thread holds the
                // lock now; start the hold here so its release is not ignored.
                w.incomplete = true;
                w.to_seq = self.locks[li].timeline.end_seq();
                let key = HoldKey::Owner(e.owner);
                let mut overflow = false;
                if !self.locks[li].holds.contains_key(&key) {
                    let who = cx.who(w.pid, &w.comm);
                    overflow = !self.locks[li].insert_hold(
                        key,
                        OpenHold {
                            owner: e.owner,
                            pid: w.pid,
                            tid: w.tid,
                            start_ns: e.ts_ns,
                            exclusive: true,
                            who,
                            users: Users::new(w.pid),
                            users_overflow: false,
                            kernel_ns: 0,
                            replaces: 0,
                            read_ns: 0,
                            reads: 0,
                            tables: Vec::new(),
                            swap_ns: 0,
                            incomplete: true,
                            before_start: false,
                            ending: None,
                            losses: self.losses,
                        },
                    );
                }
                self.end_wait(li, w, e.ts_ns, WaitOutcome::Acquired, None, cx, out);
                if overflow {
                    self.over_bound(li, Bound::OpenHolds, e.ts_ns, out);
                }
            }
        }
    }

    /// Reports a finished blocking wait (already out of the open waits); a timed-out one is
    /// remembered for the exit.
    #[allow(clippy::too_many_arguments)]
    fn end_wait(
        &mut self,
        li: usize,
        w: OpenWait,
        end_ns: u64,
        outcome: WaitOutcome,
        ret: Option<i64>,
        cx: &mut Ctx<'_>,
        out: &mut dyn FnMut(Output),
    ) {
        let st = &mut self.locks[li];
        let holders = st.holders_of(HolderSpan {
            pid: w.pid,
            owner: w.owner,
            start_ns: w.start_ns,
            end_ns,
            initial: &w.initial,
            from_seq: w.from_seq,
            to_seq: w.to_seq,
        });
        st.settle_timeline();
        if outcome == WaitOutcome::TimedOut && is_locking_comm(&w.comm) {
            let t = self.trouble_of(w.pid, li, w.start_ns);
            t.first_ns = t.first_ns.min(w.start_ns);
            t.waited_ns = t.waited_ns.max(end_ns.saturating_sub(w.start_ns));
            t.holders.extend(&holders);
        }
        emit_wait(
            &self.locks[li].name,
            WaitEnd {
                pid: w.pid,
                tid: w.tid,
                comm: &w.comm,
                start_ns: w.start_ns,
                end_ns,
                holders: &holders,
                outcome,
                mode: WaitMode::Blocking,
                tries: 0,
                ret,
                incomplete: w.incomplete,
            },
            cx,
            out,
        );
    }

    /// Reports a poll run (already out of the open ones) that did not end in success; a
    /// single try is not a wait.
    fn end_poll(
        &mut self,
        li: usize,
        p: PollStreak,
        outcome: WaitOutcome,
        cx: &mut Ctx<'_>,
        out: &mut dyn FnMut(Output),
    ) {
        let st = &mut self.locks[li];
        if p.tries >= 2 {
            let holders = st.holders_of(HolderSpan {
                pid: p.pid,
                owner: 0,
                start_ns: p.first_ns,
                end_ns: p.last_ns,
                initial: &p.initial,
                from_seq: p.from_seq,
                to_seq: u64::MAX,
            });
            emit_wait(
                &st.name,
                WaitEnd {
                    pid: p.pid,
                    tid: p.tid,
                    comm: &p.comm,
                    start_ns: p.first_ns,
                    end_ns: p.last_ns,
                    holders: &holders,
                    outcome,
                    mode: WaitMode::Poll,
                    tries: p.tries,
                    ret: None,
                    incomplete: false,
                },
                cx,
                out,
            );
        }
        st.settle_timeline();
    }

    fn trouble_of(&mut self, pid: u32, li: usize, ts: u64) -> &mut Trouble {
        if self.trouble.len() >= MAX_TROUBLE && !self.trouble.contains_key(&pid) {
            // Exits were lost; forget rather than grow.
            self.trouble.clear();
        }
        let t = self.trouble.entry(pid).or_insert_with(|| Trouble {
            lock: li,
            first_ns: ts,
            waited_ns: 0,
            tries: 0,
            holders: Holders::default(),
        });
        t.lock = li;
        t
    }

    /// Settles waits of `tid` that got the lock but whose syscall return never came.
    fn flush_acquired_of(&mut self, tid: u32, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        for li in 0..self.locks.len() {
            let Some(at) = self.locks[li].waits.get(tid).and_then(|w| w.acquired_ns) else {
                continue;
            };
            if let Some(w) = self.locks[li].waits.remove(tid) {
                self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out);
            }
        }
    }

    fn on_fork(&mut self, f: &ForkEvent) {
        // The child shares the parent's open files, hence the owners of its holds. The
        // index holds live users only (an exit removes its entry).
        for st in self.locks.iter_mut() {
            let Some(keys) = st.users.get(&f.parent_tgid) else {
                continue;
            };
            for key in keys.clone() {
                st.add_user(key, f.child_tid);
            }
        }
    }

    /// Holds of `tgid` that still hold the lock and began by `ts`.
    fn holds_of_pid(&mut self, tgid: u32, ts: u64) -> impl Iterator<Item = &mut OpenHold> {
        self.locks.iter_mut().flat_map(move |st| {
            let keys = st.users.get(&tgid).cloned().unwrap_or_default();
            let holds = &mut st.holds;
            holds
                .iter_mut()
                .filter(move |(k, h)| {
                    keys.contains(k) && h.pid == tgid && h.holding() && ts >= h.start_ns
                })
                .map(|(_, h)| h)
        })
    }

    /// The lock `tgid` holds at `ts` (the first, when it holds several), by its name.
    pub fn lock_held_by(&self, tgid: u32, ts: u64) -> Option<SharedStr> {
        self.locks.iter().find_map(|st| {
            let keys = st.users.get(&tgid)?;
            st.holds
                .iter()
                .any(|(k, h)| keys.contains(k) && h.pid == tgid && h.holding() && ts >= h.start_ns)
                .then(|| st.name.clone())
        })
    }

    fn on_xt_replace(&mut self, x: &XtReplaceEvent) {
        // One per thread in flight at most; a bound against threads that never replace.
        if self.swaps.len() >= MAX_PENDING_SWAPS {
            self.swaps.clear();
        }
        self.swaps.insert(x.tid, (x.enter_ns, x.ts_ns));
    }

    fn on_table_replace(&mut self, t: &TableReplaceEvent) {
        let kernel_ns = t.ts_ns.saturating_sub(t.enter_ns);
        // The swap inside this replace, if one was seen: the same thread, within its time.
        let swap_ns = match self.swaps.get(&t.tid) {
            Some(&(enter, ret)) if !t.read && enter >= t.enter_ns && ret <= t.ts_ns => {
                self.swaps.remove(&t.tid);
                ret - enter
            }
            _ => 0,
        };
        for h in self.holds_of_pid(t.tgid, t.ts_ns) {
            h.kernel_ns += kernel_ns;
            if t.read {
                h.read_ns += kernel_ns;
                h.reads += 1;
            } else {
                h.swap_ns += swap_ns;
                h.replaces += 1;
            }
            // Captures from before the head was recorded say nothing of the table.
            if t.head_recorded && h.tables.len() < MAX_TABLES_PER_HOLD {
                h.tables.push(TableTouch::of(t, kernel_ns));
            }
        }
    }

    /// Handles a task exit; returns true when it was an iptables lock timeout (a
    /// [`TimeoutFact`] was emitted). `is_tool`: the process is an iptables-family binary
    /// by something the event's comm does not show (its exec'd filename); read only when
    /// the exit status is 4.
    pub fn on_exit(
        &mut self,
        e: &ExitEvent,
        is_tool: bool,
        cx: &mut Ctx<'_>,
        out: &mut dyn FnMut(Output),
    ) -> bool {
        let ts = e.ts_ns;
        if ts >= self.next_deadline {
            self.sweep(ts, cx, out);
        }
        let leader = e.tid == e.tgid;
        let is_tool = is_tool || is_locking_comm(&e.comm);
        let gave_up = is_tool && e.exit_code == Some(4);
        let mut new_deadline = None;
        for li in 0..self.locks.len() {
            // Waits of the thread (or of the whole process) that exits.
            let mut ended: SmallVec<[OpenWait; 1]> = SmallVec::new();
            if leader {
                ended = self.locks[li].waits.remove_pid(e.tgid);
            }
            ended.extend(self.locks[li].waits.remove(e.tid));
            for w in ended {
                match w.acquired_ns {
                    Some(at) => self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out),
                    None => {
                        let outcome = if gave_up {
                            WaitOutcome::TimedOut
                        } else {
                            WaitOutcome::Abandoned
                        };
                        self.end_wait(li, w, ts, outcome, None, cx, out);
                    }
                }
            }
            if leader {
                if let Some(p) = self.locks[li].polls.swap_remove(&e.tgid) {
                    let outcome = if gave_up {
                        WaitOutcome::TimedOut
                    } else {
                        WaitOutcome::Abandoned
                    };
                    self.end_poll(li, p, outcome, cx, out);
                }
            }
            // A hold whose every user is gone is still held: the kernel releases it when
            // it closes their files, after this event. Its release should follow.
            let st = &mut self.locks[li];
            let Some(keys) = st.users.remove(&e.tid) else {
                continue;
            };
            for key in keys {
                let Some(h) = st.holds.get_mut(&key) else {
                    continue;
                };
                for u in h.users.iter_mut().filter(|u| u.0 == e.tid) {
                    u.1 = true;
                }
                if h.ending.is_none() && !h.users_overflow && h.users.iter().all(|u| u.1) {
                    let deadline_ns = ts.saturating_add(GRACE_NS);
                    let end = h.ending_mut();
                    end.exited_ns = Some(ts);
                    end.deadline_ns = deadline_ns;
                    new_deadline = Some(deadline_ns);
                }
            }
        }
        if let Some(d) = new_deadline {
            self.deadline(d);
        }
        if !leader {
            return false;
        }
        let trouble = self.trouble.remove(&e.tgid);
        let (Some(t), true) = (trouble, gave_up) else {
            return false;
        };
        let who = cx.who(e.tgid, &e.comm);
        let waited_ns = if t.waited_ns > 0 {
            t.waited_ns
        } else {
            ts.saturating_sub(t.first_ns)
        };
        out(Output::Timeout(TimeoutFact {
            lock: self
                .locks
                .get(t.lock)
                .map(|l| l.name.clone())
                .unwrap_or_default(),
            pid: e.tgid,
            who: Who::from(who.as_ref()),
            ts_ns: ts,
            exit_code: 4,
            waited_ns,
            tries: t.tries,
            holders: t.holders.refs(false),
        }));
        true
    }

    /// Settles what was waiting for a deadline: inferred hold ends whose release never
    /// came, acquired waits whose syscall return never came, poll runs that stopped.
    fn sweep(&mut self, now: u64, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        let mut next = u64::MAX;
        for li in 0..self.locks.len() {
            let st = &mut self.locks[li];
            let mut due = Vec::new();
            for (k, h) in &st.holds {
                match h.ending {
                    Some(end) if end.deadline_ns <= now => due.push(*k),
                    Some(end) => next = next.min(end.deadline_ns),
                    None => {}
                }
            }
            for k in due {
                if let Some(h) = st.remove_hold(k) {
                    tracing::debug!(lock = %st.lock.path, pid = h.pid, "release not seen; hold end inferred");
                    let at = h.inferred_end(now);
                    st.emit_hold(h, at, false, true, None, out);
                }
            }
            let mut due = Vec::new();
            for (pid, p) in &st.polls {
                let gap_end = p.last_ns.saturating_add(POLL_GAP_NS);
                if gap_end <= now {
                    due.push(*pid);
                } else {
                    next = next.min(gap_end);
                }
            }
            for pid in due {
                if let Some(p) = self.locks[li].polls.swap_remove(&pid) {
                    self.end_poll(li, p, WaitOutcome::TimedOut, cx, out);
                }
            }
            let mut due = Vec::new();
            for w in self.locks[li].waits.by_tid.values() {
                match w.acquired_ns {
                    Some(at) if at.saturating_add(GRACE_NS) <= now => due.push((w.tid, at)),
                    Some(at) => next = next.min(at.saturating_add(GRACE_NS)),
                    None => {}
                }
            }
            for (tid, at) in due {
                if let Some(w) = self.locks[li].waits.remove(tid) {
                    self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out);
                }
            }
        }
        self.next_deadline = next;
    }

    /// End of tracing: everything still open is reported as open (holds, waits) or
    /// settled (inferred ends).
    pub fn finish(&mut self, ts: u64, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        for li in 0..self.locks.len() {
            let st = &mut self.locks[li];
            st.users.clear();
            for (_, h) in std::mem::take(&mut st.holds) {
                match h.ending {
                    Some(_) => {
                        let at = h.inferred_end(ts);
                        st.emit_hold(h, at, false, true, None, out);
                    }
                    None => {
                        let incomplete = h.incomplete;
                        st.emit_hold(h, ts, true, incomplete, None, out);
                    }
                }
            }
            for (_, p) in std::mem::take(&mut st.polls) {
                // A single failed try just before the end is a wait in progress too.
                let holders = st.holders_of(HolderSpan {
                    pid: p.pid,
                    owner: 0,
                    start_ns: p.first_ns,
                    end_ns: ts,
                    initial: &p.initial,
                    from_seq: p.from_seq,
                    to_seq: u64::MAX,
                });
                emit_wait(
                    &st.name,
                    WaitEnd {
                        pid: p.pid,
                        tid: p.tid,
                        comm: &p.comm,
                        start_ns: p.first_ns,
                        end_ns: ts,
                        holders: &holders,
                        outcome: WaitOutcome::Open,
                        mode: WaitMode::Poll,
                        tries: p.tries,
                        ret: None,
                        incomplete: false,
                    },
                    cx,
                    out,
                );
            }
            for w in self.locks[li].waits.take_all() {
                match w.acquired_ns {
                    Some(at) => self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out),
                    None => self.end_wait(li, w, ts, WaitOutcome::Open, None, cx, out),
                }
            }
            self.locks[li].timeline.clear();
        }
        self.trouble.clear();
        self.next_deadline = u64::MAX;
    }
}

fn emit_wait(lock: &SharedStr, w: WaitEnd<'_>, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
    let who = cx.who(w.pid, w.comm);
    out(Output::Wait(WaitFact {
        lock: lock.clone(),
        pid: w.pid,
        tid: w.tid,
        who: Who::from(who.as_ref()),
        start_ns: w.start_ns,
        wait_ns: w.end_ns.saturating_sub(w.start_ns),
        holders: w.holders.refs(true),
        unknown_ns: w.holders.unknown_ns,
        free_ns: w.holders.free_ns,
        other_holders: w.holders.others,
        other_holders_ns: w.holders.others_ns,
        outcome: w.outcome,
        mode: w.mode,
        tries: w.tries,
        ret: w.ret,
        incomplete: w.incomplete,
    }));
}

fn hold_fact(
    lock: &SharedStr,
    h: &OpenHold,
    end_ns: u64,
    open: bool,
    incomplete: bool,
    released_by: Option<u32>,
) -> HoldFact {
    let who = &h.who;
    HoldFact {
        lock: lock.clone(),
        pid: h.pid,
        tid: h.tid,
        who: Who::from(who.as_ref()),
        start_ns: h.start_ns,
        hold_ns: end_ns.saturating_sub(h.start_ns),
        owner: h.owner,
        exclusive: h.exclusive,
        kernel_ns: h.kernel_ns,
        replaces: h.replaces,
        read_ns: h.read_ns,
        reads: h.reads,
        tables: h.tables.clone(),
        nft: None,
        swap_ns: h.swap_ns,
        before_start: h.before_start,
        released_by,
        open,
        incomplete,
    }
}

/// An iptables-family process by its exec'd file or comm (for exit-4 timeouts).
pub fn is_locking_proc(procs: &ProcTable, pid: u32, comm: &Comm) -> bool {
    if is_locking_comm(comm) {
        return true;
    }
    procs.get(pid).is_some_and(|p| {
        is_locking_comm(&p.comm) || crate::analysis::attribution::is_locking_tool(p.exe_name())
    })
}
