//! The lock state machine: `flock` events in, holds, waits, failed tries and timeouts out.
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
//! * The tracepoint fires after the kernel drops its spinlock, so a waiter's `Acquired` can
//!   reach us just before the old holder's release. A conflicting acquire therefore marks
//!   the old hold as ending, and its release is awaited for a grace period.

use std::sync::Arc;

use serde::{Serialize, Serializer};

use crate::analysis::Output;
use crate::attribution::{is_locking_comm, Attribution, Attributor};
use crate::decode::{
    Comm, Event, ExitEvent, FlockCallEvent, ForkEvent, LockEvent, LockOp, LockSeed, NftCommitEvent,
    TableReplaceEvent, XtReplaceEvent,
};
use crate::procs::{FastMap, ProcTable};
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

/// A lock file to watch. `dev` is in the kernel's encoding (`major << 20 | minor`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct WatchedLock {
    pub path: String,
    pub dev: u32,
    pub ino: u64,
}

impl WatchedLock {
    pub fn new(path: impl Into<String>, dev: u32, ino: u64) -> Self {
        WatchedLock {
            path: path.into(),
            dev,
            ino,
        }
    }
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitOutcome {
    Acquired,
    /// Gave up: `-EINTR`/`-ERESTARTSYS`, another failure after a deferral, an iptables that
    /// exited with status 4 while waiting, or a poller that stopped trying.
    TimedOut,
    /// The process exited while waiting.
    Abandoned,
    /// Still waiting when tracing ended.
    Open,
}

impl WaitOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitOutcome::Acquired => "acquired",
            WaitOutcome::TimedOut => "timed_out",
            WaitOutcome::Abandoned => "abandoned",
            WaitOutcome::Open => "open",
        }
    }
}

/// How a waiter waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitMode {
    /// Slept in the kernel (`flock(LOCK_EX)`).
    Blocking,
    /// Retried `LOCK_NB` from userspace.
    Poll,
}

fn hex<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    // Kernel pointers do not fit a JSON double: a string keeps them exact.
    s.collect_str(&format_args!("{v:#x}"))
}

/// A process that held the lock while someone waited.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HolderRef {
    pub pid: u32,
    pub agent: SharedStr,
    pub role: &'static str,
    pub comm: SharedStr,
    pub cmdline: SharedStr,
}

impl From<&Attribution> for HolderRef {
    fn from(a: &Attribution) -> Self {
        HolderRef {
            pid: a.pid,
            agent: a.agent.clone(),
            role: a.role,
            comm: a.comm.clone(),
            cmdline: a.cmdline.clone(),
        }
    }
}

/// The lock was held from `start_ns` for `hold_ns`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HoldFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub tid: u32,
    pub comm: SharedStr,
    pub agent: SharedStr,
    pub role: &'static str,
    pub cmdline: SharedStr,
    pub start_ns: u64,
    pub hold_ns: u64,
    #[serde(serialize_with = "hex")]
    pub owner: u64,
    pub exclusive: bool,
    /// Time the holder spent in xtables table replaces (`setsockopt`) during the hold.
    pub kernel_ns: u64,
    /// Number of those replaces.
    pub replaces: u32,
    /// Of `kernel_ns`, the time in `xt_replace_table`: swapping the new table in and waiting
    /// for every CPU to leave the old one. Present when that hook attached and saw a swap.
    #[serde(skip_serializing_if = "is_zero")]
    pub swap_ns: u64,
    /// Held already when tracing began (seen in /proc/locks): `start_ns` is when tracing
    /// began, so `hold_ns` is a lower bound.
    #[serde(skip_serializing_if = "is_false")]
    pub before_start: bool,
    pub agent_pid: u32,
    /// Pid whose close released it, when that was seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released_by: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<SharedStr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<SharedStr>,
    /// Still held when tracing ended: `hold_ns` is a lower bound.
    pub open: bool,
    /// The end was inferred (release lost or late): `hold_ns` is approximate.
    pub incomplete: bool,
}

/// Someone waited for the lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WaitFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub tid: u32,
    pub comm: SharedStr,
    pub agent: SharedStr,
    pub role: &'static str,
    pub cmdline: SharedStr,
    pub start_ns: u64,
    pub wait_ns: u64,
    /// Everyone who held the lock during the wait, first to last, one entry per pid.
    pub holders: Vec<HolderRef>,
    pub outcome: WaitOutcome,
    pub mode: WaitMode,
    /// Failed tries of a poll wait (0 for a blocking wait).
    pub tries: u32,
    /// Syscall return that ended a timed-out blocking wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ret: Option<i64>,
    pub agent_pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<SharedStr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<SharedStr>,
    /// Part of it was inferred (an event was lost).
    pub incomplete: bool,
}

/// One failed non-blocking try.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailedTryFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub tid: u32,
    pub comm: SharedStr,
    pub agent: SharedStr,
    pub role: &'static str,
    pub ts_ns: u64,
    pub errno: i32,
    /// Who held the lock then, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder: Option<HolderRef>,
}

/// An iptables-family process gave up on the lock: exit status 4 after failed tries or a
/// timed-out wait on a watched lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TimeoutFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub comm: SharedStr,
    pub cmdline: SharedStr,
    /// The caller (the iptables' nearest non-tool ancestor).
    pub agent: SharedStr,
    pub role: &'static str,
    pub agent_pid: u32,
    pub ts_ns: u64,
    pub exit_code: i32,
    /// How long it tried.
    pub waited_ns: u64,
    /// Failed non-blocking tries.
    pub tries: u32,
    /// Who held the lock while it tried.
    pub holders: Vec<HolderRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<SharedStr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<SharedStr>,
}

/// Where the machine looks things up. Borrowed per event.
pub struct Ctx<'a> {
    pub procs: &'a ProcTable,
    pub attr: &'a mut Attributor,
}

impl Ctx<'_> {
    fn who(&mut self, pid: u32, comm: &Comm) -> Arc<Attribution> {
        self.attr.get(self.procs, pid, comm)
    }
}

/// An inferred end of a hold, waiting for the real release.
#[derive(Clone, Copy, Debug)]
struct PendingEnd {
    at_ns: u64,
    deadline_ns: u64,
    /// The end is certain to be no later than `at_ns` (another owner got the lock then):
    /// a late release is clamped to it.
    clamp: bool,
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
    swap_ns: u64,
    incomplete: bool,
    /// Held when tracing began (from /proc/locks): start and owner unknown.
    before_start: bool,
    end: Option<PendingEnd>,
    /// [`LockMachine::losses`] when it began.
    losses: u64,
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

    fn iter(&self) -> impl Iterator<Item = &(u32, bool)> {
        std::iter::once(&self.first).chain(self.rest.iter())
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut (u32, bool)> {
        std::iter::once(&mut self.first).chain(self.rest.iter_mut())
    }
}

#[derive(Debug)]
struct OpenWait {
    tid: u32,
    pid: u32,
    owner: u64,
    comm: Comm,
    start_ns: u64,
    holders: Holders,
    /// Got the lock then; reported at the syscall return (for its entry time).
    acquired_ns: Option<u64>,
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
    holders: Holders,
}

#[derive(Debug)]
struct LockState {
    lock: WatchedLock,
    /// `lock.path`, shared by the facts.
    name: SharedStr,
    holds: Vec<OpenHold>,
    waits: Vec<OpenWait>,
    polls: Vec<PollStreak>,
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
    holders: &'a [Arc<Attribution>],
    outcome: WaitOutcome,
    mode: WaitMode,
    tries: u32,
    ret: Option<i64>,
    incomplete: bool,
}

/// Everyone who held the lock during a wait, first to last, one entry per pid. A Go
/// daemon's poll run can last thousands of holds: the pids are kept apart, so the duplicate
/// check on every acquire scans a dense array instead of dereferencing each holder.
#[derive(Debug, Default)]
struct Holders {
    pids: Vec<u32>,
    /// The highest of `pids`: a holder above it (a new process, the usual case while pids
    /// grow) is new without a scan.
    max_pid: u32,
    who: Vec<Arc<Attribution>>,
}

impl Holders {
    fn push(&mut self, who: &Arc<Attribution>) {
        let pid = who.pid;
        // In chunks without an early exit: the compiler vectorises the inner test.
        let seen = || {
            self.pids
                .chunks(16)
                .any(|c| c.iter().fold(false, |found, &p| found | (p == pid)))
        };
        if (self.pids.is_empty() || pid > self.max_pid) || !seen() {
            self.max_pid = self.max_pid.max(pid);
            self.pids.push(pid);
            self.who.push(who.clone());
        }
    }
}

impl std::ops::Deref for Holders {
    type Target = [Arc<Attribution>];

    fn deref(&self) -> &[Arc<Attribution>] {
        &self.who
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
    /// The last nf_tables commit lock named, by netns: commits come in runs from one netns.
    nft_name: Option<(u32, SharedStr)>,
}

impl LockMachine {
    pub fn new(locks: Vec<WatchedLock>) -> Self {
        LockMachine {
            locks: locks
                .into_iter()
                .map(|lock| LockState {
                    name: SharedStr::from(lock.path.as_str()),
                    lock,
                    holds: Vec::new(),
                    waits: Vec::new(),
                    polls: Vec::new(),
                })
                .collect(),
            trouble: FastMap::default(),
            next_deadline: u64::MAX,
            losses: 0,
            nft_name: None,
        }
    }

    /// Watched locks, configured ones first, then those first seen in events.
    pub fn locks(&self) -> impl Iterator<Item = &WatchedLock> {
        self.locks.iter().map(|l| &l.lock)
    }

    /// Open holds right now, as (lock path, holder pid, start).
    pub fn open_holds(&self) -> impl Iterator<Item = (&str, u32, u64)> {
        self.locks.iter().flat_map(|l| {
            l.holds
                .iter()
                .map(move |h| (l.lock.path.as_str(), h.pid, h.start_ns))
        })
    }

    /// Open holds right now, as (lock path, start, holder).
    pub fn open_holders(&self) -> impl Iterator<Item = (&SharedStr, u64, &Attribution)> {
        self.locks
            .iter()
            .flat_map(|l| l.holds.iter().map(move |h| (&l.name, h.start_ns, &*h.who)))
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
        self.locks.push(LockState {
            name: SharedStr::from(path.as_str()),
            lock: WatchedLock { path, dev, ino },
            holds: Vec::new(),
            waits: Vec::new(),
            polls: Vec::new(),
        });
        Some(self.locks.len() - 1)
    }

    fn deadline(&mut self, at: u64) {
        self.next_deadline = self.next_deadline.min(at);
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
            Event::LockSeed(l) => self.on_seed(l, cx),
            Event::NftCommit(c) => {
                let lock = match &self.nft_name {
                    Some((netns, name)) if *netns == c.netns => name.clone(),
                    _ => {
                        let name = nft_commit_lock(c.netns);
                        self.nft_name = Some((c.netns, name.clone()));
                        name
                    }
                };
                out(Output::Hold(nft_commit_hold(c, lock, cx)))
            }
            Event::Exit(e) => {
                self.on_exit(e, false, cx, out);
            }
            Event::Lost { .. } => self.losses += 1,
            Event::Exec(_)
            | Event::Proc(_)
            | Event::Drop(_)
            | Event::ConntrackFail(_)
            | Event::DropCounts(_)
            | Event::Conntrack(_)
            | Event::DropSetup { .. }
            | Event::KernelSymbol { .. }
            | Event::Ipvs(_)
            | Event::IpvsCounts(_) => {}
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
            LockOp::Deferred => self.on_deferred(li, e),
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
        let mut new_deadline = None;
        // Same owner, still held: a repeated flock() or a conversion, not a new hold.
        // Unless events were lost since it began: then its release was likely lost.
        if let Some(i) = st
            .holds
            .iter()
            .position(|h| h.owner == e.owner && h.end.is_none() && h.losses != losses)
        {
            let h = st.holds.remove(i);
            out(Output::Hold(hold_fact(
                &st.name, &h, e.ts_ns, false, true, None,
            )));
        }
        if let Some(h) = st
            .holds
            .iter_mut()
            .find(|h| h.owner == e.owner && h.end.is_none())
        {
            h.exclusive = exclusive;
            if !h.users.iter().any(|u| u.0 == e.tgid) && h.users.len() < MAX_USERS {
                h.users.push((e.tgid, false));
            }
        } else {
            // Same owner whose end we inferred: that end was real after all.
            let mut i = 0;
            while i < st.holds.len() {
                if st.holds[i].owner == e.owner {
                    let h = st.holds.remove(i);
                    let at = h.end.map_or(e.ts_ns, |p| p.at_ns);
                    out(Output::Hold(hold_fact(&st.name, &h, at, false, true, None)));
                } else {
                    i += 1;
                }
            }
            // A conflicting holder must be gone: its release is late or lost.
            for h in st.holds.iter_mut() {
                if exclusive || h.exclusive {
                    let at = h.end.map_or(e.ts_ns, |p| p.at_ns.min(e.ts_ns));
                    let deadline_ns = e.ts_ns.saturating_add(GRACE_NS);
                    h.end = Some(PendingEnd {
                        at_ns: at,
                        deadline_ns,
                        clamp: true,
                    });
                    new_deadline = Some(deadline_ns);
                }
            }
            let who = cx.who(e.tgid, &e.comm);
            // Whoever waits now waits behind this holder too.
            for w in st.waits.iter_mut() {
                if w.acquired_ns.is_none() && w.owner != e.owner && w.pid != e.tgid {
                    w.holders.push(&who);
                }
            }
            for p in st.polls.iter_mut() {
                if p.pid != e.tgid {
                    p.holders.push(&who);
                }
            }
            st.holds.push(OpenHold {
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
                swap_ns: 0,
                incomplete: false,
                before_start: false,
                end: None,
                losses,
            });
        }
        // The thread's own blocking wait is over; reported at the syscall return.
        if let Some(w) = st
            .waits
            .iter_mut()
            .find(|w| w.tid == e.tid && w.acquired_ns.is_none())
        {
            w.acquired_ns = Some(e.ts_ns);
            new_deadline = Some(e.ts_ns.saturating_add(GRACE_NS));
        }
        // A poller got it.
        if let Some(i) = st.polls.iter().position(|p| p.pid == e.tgid) {
            let p = st.polls.swap_remove(i);
            emit_wait(
                &st.name,
                WaitEnd {
                    pid: p.pid,
                    tid: p.tid,
                    comm: &p.comm,
                    start_ns: p.first_ns,
                    end_ns: e.ts_ns,
                    holders: &p.holders,
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
    }

    fn on_deferred(&mut self, li: usize, e: &LockEvent) {
        let st = &mut self.locks[li];
        // Woken up and beaten to it again: same wait.
        if st
            .waits
            .iter()
            .any(|w| w.tid == e.tid && w.acquired_ns.is_none())
        {
            return;
        }
        let mut holders = Holders::default();
        for h in st
            .holds
            .iter()
            .filter(|h| h.owner != e.owner && h.end.is_none())
        {
            holders.push(&h.who);
        }
        st.waits.push(OpenWait {
            tid: e.tid,
            pid: e.tgid,
            owner: e.owner,
            comm: e.comm,
            start_ns: e.ts_ns,
            holders,
            acquired_ns: None,
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
        if let Some(i) = self.locks[li]
            .waits
            .iter()
            .position(|w| w.tid == e.tid && w.acquired_ns.is_none())
        {
            let w = self.locks[li].waits.swap_remove(i);
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
        let st = &mut self.locks[li];
        let who = cx.who(e.tgid, &e.comm);
        let current: Vec<Arc<Attribution>> = st
            .holds
            .iter()
            .filter(|h| h.owner != e.owner && h.end.is_none())
            .map(|h| h.who.clone())
            .collect();
        out(Output::FailedTry(FailedTryFact {
            lock: st.name.clone(),
            pid: e.tgid,
            tid: e.tid,
            comm: who.comm.clone(),
            agent: who.agent.clone(),
            role: who.role,
            ts_ns: e.ts_ns,
            errno,
            holder: current.first().map(|h| HolderRef::from(&**h)),
        }));
        // Extend the pid's poll run, or start one.
        let mut ended = None;
        match st.polls.iter().position(|p| p.pid == e.tgid) {
            Some(i) if e.ts_ns.saturating_sub(st.polls[i].last_ns) <= POLL_GAP_NS => {
                let p = &mut st.polls[i];
                p.tries += 1;
                p.last_ns = e.ts_ns;
                for h in &current {
                    p.holders.push(h);
                }
            }
            found => {
                if let Some(i) = found {
                    ended = Some(st.polls.swap_remove(i));
                }
                let mut holders = Holders::default();
                for h in &current {
                    holders.push(h);
                }
                st.polls.push(PollStreak {
                    pid: e.tgid,
                    tid: e.tid,
                    comm: e.comm,
                    first_ns: e.ts_ns,
                    last_ns: e.ts_ns,
                    tries: 1,
                    holders,
                });
            }
        }
        if let Some(p) = ended {
            end_poll(&self.locks[li].name, p, WaitOutcome::TimedOut, cx, out);
        }
        if is_locking_comm(&e.comm) {
            let t = self.trouble_of(e.tgid, li, e.ts_ns);
            t.tries += 1;
            t.waited_ns = t.waited_ns.max(e.ts_ns.saturating_sub(t.first_ns));
            for h in &current {
                t.holders.push(h);
            }
        }
        self.deadline(e.ts_ns.saturating_add(POLL_GAP_NS));
    }

    /// A hold in place when tracing began: its holder's pid is known, not its owner; its
    /// release is the first one from that process.
    fn on_seed(&mut self, s: &LockSeed, cx: &mut Ctx<'_>) {
        let Some(li) = self.lock_index(s.dev, s.ino) else {
            return;
        };
        let who = cx.who(s.pid, &Comm::default());
        self.locks[li].holds.push(OpenHold {
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
            swap_ns: 0,
            incomplete: false,
            before_start: true,
            end: None,
            losses: self.losses,
        });
    }

    fn on_released(&mut self, li: usize, e: &LockEvent, out: &mut dyn FnMut(Output)) {
        let st = &mut self.locks[li];
        let found = st
            .holds
            .iter()
            .position(|h| h.owner == e.owner)
            .or_else(|| {
                st.holds
                    .iter()
                    .position(|h| h.before_start && h.users.iter().any(|u| u.0 == e.tgid))
            });
        let Some(i) = found else {
            // close() of any descriptor of the file while someone holds it, or the hold
            // began before tracing, or its acquire was lost.
            tracing::trace!(pid = e.tgid, owner = e.owner, "release without a hold");
            return;
        };
        let h = st.holds.remove(i);
        let end = match h.end {
            Some(p) if p.clamp => e.ts_ns.min(p.at_ns),
            _ => e.ts_ns,
        };
        out(Output::Hold(hold_fact(
            &st.name,
            &h,
            end,
            false,
            h.incomplete,
            Some(e.tgid),
        )));
    }

    fn on_flock_call(&mut self, e: &FlockCallEvent, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        // Find the thread's wait: on the call's lock, or anywhere if the inode is unknown.
        let found = self.locks.iter().enumerate().find_map(|(li, st)| {
            if st.lock.dev != e.dev || st.lock.ino != e.ino {
                return None;
            }
            st.waits
                .iter()
                .position(|w| w.tid == e.tid)
                .map(|wi| (li, wi))
        });
        let found = found.or_else(|| {
            self.locks.iter().enumerate().find_map(|(li, st)| {
                st.waits
                    .iter()
                    .position(|w| w.tid == e.tid)
                    .map(|wi| (li, wi))
            })
        });
        let Some((li, wi)) = found else {
            return;
        };
        let mut w = self.locks[li].waits.swap_remove(wi);
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
                let st = &mut self.locks[li];
                if !st.holds.iter().any(|h| h.owner == e.owner) {
                    let who = cx.who(w.pid, &w.comm);
                    st.holds.push(OpenHold {
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
                        swap_ns: 0,
                        incomplete: true,
                        before_start: false,
                        end: None,
                        losses: self.losses,
                    });
                }
                self.end_wait(li, w, e.ts_ns, WaitOutcome::Acquired, None, cx, out);
            }
        }
    }

    /// Reports a finished blocking wait; a timed-out one is remembered for the exit.
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
        if outcome == WaitOutcome::TimedOut && is_locking_comm(&w.comm) {
            let t = self.trouble_of(w.pid, li, w.start_ns);
            t.first_ns = t.first_ns.min(w.start_ns);
            t.waited_ns = t.waited_ns.max(end_ns.saturating_sub(w.start_ns));
            for h in w.holders.iter() {
                t.holders.push(h);
            }
        }
        emit_wait(
            &self.locks[li].name,
            WaitEnd {
                pid: w.pid,
                tid: w.tid,
                comm: &w.comm,
                start_ns: w.start_ns,
                end_ns,
                holders: &w.holders,
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
            while let Some(i) = self.locks[li]
                .waits
                .iter()
                .position(|w| w.tid == tid && w.acquired_ns.is_some())
            {
                let w = self.locks[li].waits.swap_remove(i);
                let at = w.acquired_ns.unwrap_or(w.start_ns);
                self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out);
            }
        }
    }

    fn on_fork(&mut self, f: &ForkEvent) {
        // The child shares the parent's open files, hence the owners of its holds.
        for st in self.locks.iter_mut() {
            for h in st.holds.iter_mut() {
                if h.users
                    .iter()
                    .any(|&(p, exited)| p == f.parent_tgid && !exited)
                    && !h.users.iter().any(|u| u.0 == f.child_tid)
                {
                    if h.users.len() < MAX_USERS {
                        h.users.push((f.child_tid, false));
                    } else {
                        h.users_overflow = true;
                    }
                }
            }
        }
    }

    fn on_xt_replace(&mut self, x: &XtReplaceEvent) {
        for st in self.locks.iter_mut() {
            for h in st.holds.iter_mut() {
                if h.pid == x.tgid && h.end.is_none() && x.ts_ns >= h.start_ns {
                    h.swap_ns += x.ts_ns.saturating_sub(x.enter_ns);
                }
            }
        }
    }

    fn on_table_replace(&mut self, t: &TableReplaceEvent) {
        for st in self.locks.iter_mut() {
            for h in st.holds.iter_mut() {
                if h.pid == t.tgid && h.end.is_none() && t.ts_ns >= h.start_ns {
                    h.kernel_ns += t.ts_ns.saturating_sub(t.enter_ns);
                    h.replaces += 1;
                }
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
            while let Some(i) = self.locks[li]
                .waits
                .iter()
                .position(|w| w.tid == e.tid || (leader && w.pid == e.tgid))
            {
                let w = self.locks[li].waits.swap_remove(i);
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
            let st = &mut self.locks[li];
            if leader {
                if let Some(i) = st.polls.iter().position(|p| p.pid == e.tgid) {
                    let p = st.polls.swap_remove(i);
                    let outcome = if gave_up {
                        WaitOutcome::TimedOut
                    } else {
                        WaitOutcome::Abandoned
                    };
                    end_poll(&st.name, p, outcome, cx, out);
                }
            }
            // A hold whose every user is gone ends at the latest when the last one exits;
            // the real release (the kernel closes files after this event) should follow.
            for h in st.holds.iter_mut() {
                let mut touched = false;
                for u in h.users.iter_mut().filter(|u| u.0 == e.tid) {
                    u.1 = true;
                    touched = true;
                }
                if touched && h.end.is_none() && !h.users_overflow && h.users.iter().all(|u| u.1) {
                    let deadline_ns = ts.saturating_add(GRACE_NS);
                    h.end = Some(PendingEnd {
                        at_ns: ts,
                        deadline_ns,
                        clamp: false,
                    });
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
            comm: who.comm.clone(),
            cmdline: who.cmdline.clone(),
            agent: who.agent.clone(),
            role: who.role,
            agent_pid: who.agent_pid,
            ts_ns: ts,
            exit_code: 4,
            waited_ns,
            tries: t.tries,
            holders: t.holders.iter().map(|h| HolderRef::from(&**h)).collect(),
            pod_uid: who.pod_uid.clone(),
            container_id: who.container_id.clone(),
        }));
        true
    }

    /// Settles what was waiting for a deadline: inferred hold ends whose release never
    /// came, acquired waits whose syscall return never came, poll runs that stopped.
    fn sweep(&mut self, now: u64, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
        let mut next = u64::MAX;
        for li in 0..self.locks.len() {
            let st = &mut self.locks[li];
            let mut i = 0;
            while i < st.holds.len() {
                match st.holds[i].end {
                    Some(p) if p.deadline_ns <= now => {
                        let h = st.holds.remove(i);
                        tracing::debug!(lock = %st.lock.path, pid = h.pid, "release not seen; hold end inferred");
                        out(Output::Hold(hold_fact(
                            &st.name, &h, p.at_ns, false, true, None,
                        )));
                    }
                    Some(p) => {
                        next = next.min(p.deadline_ns);
                        i += 1;
                    }
                    None => i += 1,
                }
            }
            let mut i = 0;
            while i < st.polls.len() {
                let gap_end = st.polls[i].last_ns.saturating_add(POLL_GAP_NS);
                if gap_end <= now {
                    let p = st.polls.swap_remove(i);
                    end_poll(&st.name, p, WaitOutcome::TimedOut, cx, out);
                } else {
                    next = next.min(gap_end);
                    i += 1;
                }
            }
            let mut i = 0;
            while i < self.locks[li].waits.len() {
                let w = &self.locks[li].waits[i];
                match w.acquired_ns {
                    Some(at) if at.saturating_add(GRACE_NS) <= now => {
                        let w = self.locks[li].waits.swap_remove(i);
                        self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out);
                    }
                    Some(at) => {
                        next = next.min(at.saturating_add(GRACE_NS));
                        i += 1;
                    }
                    None => i += 1,
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
            for h in std::mem::take(&mut st.holds) {
                let fact = match h.end {
                    Some(p) => hold_fact(&st.name, &h, p.at_ns, false, true, None),
                    None => hold_fact(&st.name, &h, ts, true, h.incomplete, None),
                };
                out(Output::Hold(fact));
            }
            for p in std::mem::take(&mut st.polls) {
                // A single failed try just before the end is a wait in progress too.
                emit_wait(
                    &st.name,
                    WaitEnd {
                        pid: p.pid,
                        tid: p.tid,
                        comm: &p.comm,
                        start_ns: p.first_ns,
                        end_ns: ts,
                        holders: &p.holders,
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
            for w in std::mem::take(&mut self.locks[li].waits) {
                match w.acquired_ns {
                    Some(at) => self.end_wait(li, w, at, WaitOutcome::Acquired, None, cx, out),
                    None => self.end_wait(li, w, ts, WaitOutcome::Open, None, cx, out),
                }
            }
        }
        self.trouble.clear();
        self.next_deadline = u64::MAX;
    }
}

/// Reports a poll run that did not end in success; a single try is not a wait.
fn end_poll(
    lock: &SharedStr,
    p: PollStreak,
    outcome: WaitOutcome,
    cx: &mut Ctx<'_>,
    out: &mut dyn FnMut(Output),
) {
    if p.tries < 2 {
        return;
    }
    emit_wait(
        lock,
        WaitEnd {
            pid: p.pid,
            tid: p.tid,
            comm: &p.comm,
            start_ns: p.first_ns,
            end_ns: p.last_ns,
            holders: &p.holders,
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

fn emit_wait(lock: &SharedStr, w: WaitEnd<'_>, cx: &mut Ctx<'_>, out: &mut dyn FnMut(Output)) {
    let who = cx.who(w.pid, w.comm);
    out(Output::Wait(WaitFact {
        lock: lock.clone(),
        pid: w.pid,
        tid: w.tid,
        comm: who.comm.clone(),
        agent: who.agent.clone(),
        role: who.role,
        cmdline: who.cmdline.clone(),
        start_ns: w.start_ns,
        wait_ns: w.end_ns.saturating_sub(w.start_ns),
        holders: w.holders.iter().map(|h| HolderRef::from(&**h)).collect(),
        outcome: w.outcome,
        mode: w.mode,
        tries: w.tries,
        ret: w.ret,
        agent_pid: who.agent_pid,
        pod_uid: who.pod_uid.clone(),
        container_id: who.container_id.clone(),
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
        comm: who.comm.clone(),
        agent: who.agent.clone(),
        role: who.role,
        cmdline: who.cmdline.clone(),
        start_ns: h.start_ns,
        hold_ns: end_ns.saturating_sub(h.start_ns),
        owner: h.owner,
        exclusive: h.exclusive,
        kernel_ns: h.kernel_ns,
        replaces: h.replaces,
        swap_ns: h.swap_ns,
        before_start: h.before_start,
        agent_pid: who.agent_pid,
        released_by,
        pod_uid: who.pod_uid.clone(),
        container_id: who.container_id.clone(),
        open,
        incomplete,
    }
}

/// Name of the second lock: nf_tables serialises commits per network namespace.
pub fn nft_commit_lock(netns: u32) -> SharedStr {
    if netns == 0 {
        SharedStr::from("nf_tables commit (netns unknown)")
    } else {
        SharedStr::from(format!("nf_tables commit (netns {netns})"))
    }
}

/// One nf_tables commit as a hold of the second lock, attributed like a file-lock hold.
fn nft_commit_hold(c: &NftCommitEvent, lock: SharedStr, cx: &mut Ctx<'_>) -> HoldFact {
    let who = cx.who(c.tgid, &c.comm);
    HoldFact {
        lock,
        pid: c.tgid,
        tid: c.tid,
        comm: who.comm.clone(),
        agent: who.agent.clone(),
        role: who.role,
        cmdline: who.cmdline.clone(),
        start_ns: c.enter_ns,
        hold_ns: c.ts_ns.saturating_sub(c.enter_ns),
        owner: 0,
        exclusive: true,
        // The whole hold is the kernel's; no legacy table replace in it.
        kernel_ns: c.ts_ns.saturating_sub(c.enter_ns),
        replaces: 0,
        swap_ns: 0,
        before_start: false,
        agent_pid: who.agent_pid,
        released_by: None,
        pod_uid: who.pod_uid.clone(),
        container_id: who.container_id.clone(),
        open: false,
        incomplete: false,
    }
}

/// An iptables-family process by its exec'd file or comm (for exit-4 timeouts).
pub fn is_locking_proc(procs: &ProcTable, pid: u32, comm: &Comm) -> bool {
    if is_locking_comm(comm) {
        return true;
    }
    procs.get(pid).is_some_and(|p| {
        is_locking_comm(&p.comm) || crate::attribution::is_locking_tool(p.exe_name())
    })
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}
