//! Process table: who is who, who started whom, in which cgroup.
//!
//! Built only from events (`Proc` seeds and lookups, `Exec`, `Fork`, `Exit`): the table never
//! reads /proc itself. Entries of exited processes are kept for a while, because lock
//! releases (the kernel closes files after the exit tracepoint) and attribution of a
//! just-exited `iptables` still need them; they are pruned by age and by count.
//!
//! Hot path (every fork, exec and exit of the node): names are interned, argv, filename and
//! cgroup are shared with the parent until an exec, so a fork allocates nothing.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use crate::decode::{Argv, Comm, Event, ExecEvent, ExitEvent, ForkEvent, PodInfo, ProcInfo};
use crate::kube::{parse_cgroup, CgroupIdentity, PodName};
use crate::shared::{prefetch, SharedStr};

/// A `HashMap` with a fast, seeded hash: keys are pids and comms, hashed on every event.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Dead entries older than this (event time) are pruned.
pub const DEFAULT_DEAD_TTL_NS: u64 = 60_000_000_000;
/// At most this many dead entries are kept.
pub const DEFAULT_MAX_DEAD: usize = 8192;
/// Longest ancestor chain walked; real chains are a handful of levels deep.
pub const MAX_CHAIN: usize = 64;
/// How many exits ahead of its pruning a dead entry is prefetched (see [`ProcTable::prune`]).
const PREFETCH_AHEAD: usize = 1;
/// Interned names kept; beyond, the interner starts over (names are shared, not lost).
const MAX_NAMES: usize = 4096;

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitInfo {
    pub ts_ns: u64,
    /// Exit status, `None` when killed by a signal.
    pub code: Option<i32>,
}

/// A cgroup path and the pod/container it names, parsed once per path.
#[derive(Debug, PartialEq, Eq)]
pub struct Cgroup {
    pub path: String,
    pub identity: CgroupIdentity,
}

/// One process (thread group), or a thread mistaken for one (see [`ProcTable::apply`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proc {
    pub pid: u32,
    /// 0 when unknown.
    pub ppid: u32,
    pub comm: Comm,
    /// `comm` as a shared string (interned).
    pub name: SharedStr,
    /// Shared with forked children until they exec: forks are frequent, argv rarely needed.
    pub argv: Argv,
    pub argv_truncated: bool,
    /// [`Proc::cmdline`], built on first use and shared like `argv`.
    cmdline: OnceLock<SharedStr>,
    /// Path given to `execve`, empty when no exec was seen.
    pub filename: SharedStr,
    /// Where its last component starts (see [`Proc::exe_name`]), found once per exec.
    exe_start: u16,
    pub cgroup: Option<Arc<Cgroup>>,
    /// When this entry started (fork or exec time; 0 for seeds: before tracing).
    pub start_ns: u64,
    /// Time of the last exec, when seen.
    pub exec_ns: Option<u64>,
    pub exited: Option<ExitInfo>,
    /// Distinguishes successive processes that had the same pid.
    pub generation: u64,
    /// Changes (table-wide unique) whenever something an attribution reads changes: name,
    /// argv, filename, cgroup, parent. Lets cached attributions check their chain.
    pub stamp: u64,
}

impl Proc {
    fn new(
        pid: u32,
        ppid: u32,
        comm: Comm,
        name: SharedStr,
        start_ns: u64,
        generation: u64,
    ) -> Self {
        Proc {
            pid,
            ppid,
            comm,
            name,
            argv: Argv::default(),
            argv_truncated: false,
            cmdline: OnceLock::new(),
            filename: SharedStr::empty(),
            exe_start: 0,
            cgroup: None,
            start_ns,
            exec_ns: None,
            exited: None,
            generation,
            stamp: generation,
        }
    }

    pub fn is_alive(&self) -> bool {
        self.exited.is_none()
    }

    /// argv joined by spaces; `" ..."` is appended when the probe truncated it.
    pub fn cmdline(&self) -> String {
        let mut s = self.argv.join();
        if self.argv_truncated && !s.is_empty() {
            s.push_str(" ...");
        }
        s
    }

    /// [`Proc::cmdline`], built once.
    pub fn cmdline_shared(&self) -> SharedStr {
        self.cmdline
            .get_or_init(|| {
                self.argv
                    .join_shared(if self.argv_truncated { " ..." } else { "" })
            })
            .clone()
    }

    fn set_argv(&mut self, argv: Argv, truncated: bool) {
        self.argv = argv;
        self.argv_truncated = truncated;
        self.cmdline = OnceLock::new();
    }

    /// Last path component of the exec'd file.
    pub fn exe_name(&self) -> &str {
        match self.exe_start {
            u16::MAX => basename(&self.filename),
            i => self
                .filename
                .get(usize::from(i)..)
                .unwrap_or_else(|| basename(&self.filename)),
        }
    }

    /// Brings in what dropping this entry will touch that it does not hold inline: the
    /// counts of the exec image's strings (the interned name and the cgroup stay warm).
    fn prefetch_shared(&self) {
        self.argv.prefetch();
        self.filename.prefetch();
        if let Some(c) = self.cmdline.get() {
            c.prefetch();
        }
    }

    fn set_filename(&mut self, filename: SharedStr) {
        let start = filename.len() - basename(&filename).len();
        // u16::MAX: too long to remember, found again on each call.
        self.exe_start = u16::try_from(start).unwrap_or(u16::MAX);
        self.filename = filename;
    }
}

pub(crate) fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// pid → slot, open addressing with linear probing. A pid and its slot share one 8-byte
/// cell, so a lookup touches one cache line (a `HashMap` touches two: control bytes, then
/// the bucket), and the cell of a pid can be prefetched: the dead entry pruned on an exit
/// was last used thousands of events ago (see [`ProcTable::prune`]).
#[derive(Debug, Default)]
struct PidIndex {
    /// (pid, slot + 1); slot + 1 == 0 marks an empty cell. Length 0 or a power of two.
    cells: Vec<(u32, u32)>,
    len: usize,
    hasher: foldhash::fast::RandomState,
}

impl PidIndex {
    fn home(&self, pid: u32) -> usize {
        use std::hash::BuildHasher;
        (self.hasher.hash_one(pid) as usize) & (self.cells.len().wrapping_sub(1))
    }

    /// The cell holding `pid`.
    fn find(&self, pid: u32) -> Option<usize> {
        if self.cells.is_empty() {
            return None;
        }
        let mask = self.cells.len() - 1;
        let mut i = self.home(pid);
        loop {
            let (p, s) = self.cells[i];
            if s == 0 {
                return None;
            }
            if p == pid {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    fn get(&self, pid: u32) -> Option<u32> {
        self.find(pid).map(|i| self.cells[i].1 - 1)
    }

    /// Maps `pid` to `slot` (`slot` < `u32::MAX`: slots are entries of a `Vec` of entries).
    fn insert(&mut self, pid: u32, slot: u32) {
        if let Some(i) = self.find(pid) {
            self.cells[i].1 = slot + 1;
            return;
        }
        // At most half full: probe runs stay short.
        if (self.len + 1) * 2 > self.cells.len() {
            self.grow();
        }
        let mask = self.cells.len() - 1;
        let mut i = self.home(pid);
        while self.cells[i].1 != 0 {
            i = (i + 1) & mask;
        }
        self.cells[i] = (pid, slot + 1);
        self.len += 1;
    }

    fn grow(&mut self) {
        let cap = (self.cells.len() * 2).max(64);
        let old = std::mem::replace(&mut self.cells, vec![(0, 0); cap]);
        let mask = cap - 1;
        for (pid, s) in old.into_iter().filter(|c| c.1 != 0) {
            let mut i = self.home(pid);
            while self.cells[i].1 != 0 {
                i = (i + 1) & mask;
            }
            self.cells[i] = (pid, s);
        }
    }

    fn remove(&mut self, pid: u32) -> Option<u32> {
        let mut i = self.find(pid)?;
        let slot = self.cells[i].1 - 1;
        self.len -= 1;
        // Backward shift: later cells of the run whose home is not in (i, j] move into the
        // hole, so lookups never meet a gap before their pid (no tombstones).
        let mask = self.cells.len() - 1;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let (p, s) = self.cells[j];
            if s == 0 {
                break;
            }
            let k = self.home(p);
            let stays = if i <= j {
                i < k && k <= j
            } else {
                i < k || k <= j
            };
            if !stays {
                self.cells[i] = self.cells[j];
                i = j;
            }
        }
        self.cells[i] = (0, 0);
        Some(slot)
    }

    /// Asks for the cell where a lookup of `pid` starts (see [`prefetch`]).
    fn prefetch(&self, pid: u32) {
        if !self.cells.is_empty() {
            prefetch(self.cells[self.home(pid)..].as_ptr().cast::<u8>());
        }
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// Entries by pid: a small map from pid to a slot of a slab. Thousands of entries churn
/// (every fork and every pruned exit): the map stays small enough for the cache, and slots
/// are reused instead of moved when the map grows or rehashes.
#[derive(Debug, Default)]
struct Entries {
    index: PidIndex,
    slots: Vec<Option<Proc>>,
    free: Vec<u32>,
}

impl Entries {
    fn get(&self, pid: &u32) -> Option<&Proc> {
        let i = self.index.get(*pid)?;
        self.slots.get(i as usize)?.as_ref()
    }

    fn get_mut(&mut self, pid: &u32) -> Option<&mut Proc> {
        let i = self.index.get(*pid)?;
        self.slots.get_mut(i as usize)?.as_mut()
    }

    /// Puts `p` at its pid, replacing any entry there.
    fn insert(&mut self, p: Proc) -> &mut Proc {
        let i = match self.index.get(p.pid) {
            Some(i) => i,
            None => {
                let i = self.free.pop().unwrap_or_else(|| {
                    self.slots.push(None);
                    (self.slots.len() - 1) as u32
                });
                self.index.insert(p.pid, i);
                i
            }
        };
        // Every index entry names a slot of `slots`, which never shrinks.
        let slot = &mut self.slots[i as usize];
        slot.insert(p)
    }

    fn remove(&mut self, pid: &u32) {
        if let Some(i) = self.index.remove(*pid) {
            if let Some(slot) = self.slots.get_mut(i as usize) {
                *slot = None;
                self.free.push(i);
            }
        }
    }

    /// Removes the entry in `slot` if it is still the dead one of `pid` and `generation`
    /// (generations are unique, and an entry keeps its slot until removed or replaced, so
    /// this is the entry `get(pid)` would find).
    fn remove_dead(&mut self, pid: u32, slot: u32, generation: u64) {
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return;
        };
        if s.as_ref()
            .is_some_and(|p| p.pid == pid && p.generation == generation && !p.is_alive())
        {
            self.index.remove(pid);
            *s = None;
            self.free.push(slot);
        }
    }

    /// Prefetches the cache lines of `slot` (an entry spans three).
    fn prefetch_slot(&self, slot: u32) {
        if let Some(s) = self.slots.get(slot as usize) {
            let p = (s as *const Option<Proc>).cast::<u8>();
            for off in (0..std::mem::size_of::<Option<Proc>>()).step_by(64) {
                prefetch(p.wrapping_add(off));
            }
        }
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn values(&self) -> impl Iterator<Item = &Proc> {
        self.slots.iter().flatten()
    }
}

/// Pods and containers by the ids their processes' cgroups carry, from [`Event::Pod`].
#[derive(Debug, Default)]
struct PodNames {
    by_container: FastMap<String, Arc<PodName>>,
    by_uid: FastMap<String, Arc<PodName>>,
}

/// Containers and pods named; beyond, the names start over (a node runs a few hundred).
const MAX_PODS: usize = 16384;

impl PodNames {
    fn learn(&mut self, p: &PodInfo) {
        if self.by_container.len() + self.by_uid.len() >= MAX_PODS {
            self.by_container.clear();
            self.by_uid.clear();
        }
        let name = Arc::new(PodName {
            namespace: p.namespace.as_str().into(),
            pod: p.pod.as_str().into(),
            container: p.container.as_str().into(),
        });
        if !p.container_id.is_empty() {
            self.by_container
                .insert(p.container_id.clone(), name.clone());
        }
        if !p.pod_uid.is_empty()
            && (p.container_id.is_empty() || !self.by_uid.contains_key(&p.pod_uid))
        {
            // The pod by UID, for its processes outside any named container.
            let pod = Arc::new(PodName {
                container: SharedStr::empty(),
                ..(*name).clone()
            });
            self.by_uid.insert(p.pod_uid.clone(), pod);
        }
    }

    fn get(&self, id: &CgroupIdentity) -> Option<Arc<PodName>> {
        id.container_id
            .as_ref()
            .and_then(|c| self.by_container.get(c.as_str()))
            .or_else(|| {
                id.pod_uid
                    .as_ref()
                    .and_then(|u| self.by_uid.get(u.as_str()))
            })
            .cloned()
    }
}

/// The process table. Keyed by pid (tgid).
#[derive(Debug)]
pub struct ProcTable {
    procs: Entries,
    /// (pid, slot, generation, exit time) in exit order, for pruning.
    dead: VecDeque<(u32, u32, u64, u64)>,
    /// Source of generations and stamps.
    next_generation: u64,
    /// Comms as shared strings.
    names: FastMap<Comm, SharedStr>,
    /// The last cgroup parsed (processes come in runs from the same cgroup).
    last_cgroup: Option<Arc<Cgroup>>,
    pods: PodNames,
    max_dead: usize,
    dead_ttl_ns: u64,
}

impl Default for ProcTable {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcTable {
    pub fn new() -> Self {
        Self::with_limits(DEFAULT_MAX_DEAD, DEFAULT_DEAD_TTL_NS)
    }

    pub fn with_limits(max_dead: usize, dead_ttl_ns: u64) -> Self {
        ProcTable {
            procs: Entries::default(),
            dead: VecDeque::new(),
            next_generation: 1,
            names: FastMap::default(),
            last_cgroup: None,
            pods: PodNames::default(),
            max_dead,
            dead_ttl_ns,
        }
    }

    pub fn get(&self, pid: u32) -> Option<&Proc> {
        self.procs.get(&pid)
    }

    /// Entries, alive and dead.
    pub fn len(&self) -> usize {
        self.procs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.procs.len() == 0
    }

    pub fn dead_count(&self) -> usize {
        self.procs.values().filter(|p| !p.is_alive()).count()
    }

    /// Updates the table from one event; events that are not about processes are ignored.
    pub fn apply(&mut self, ev: &Event) {
        match ev {
            Event::Proc(p) => self.on_proc(p),
            Event::Exec(e) => self.on_exec(e),
            Event::Fork(f) => self.on_fork(f),
            Event::Exit(e) => self.on_exit(e),
            Event::Pod(p) => self.pods.learn(p),
            _ => {}
        }
    }

    /// The pod and container a cgroup belongs to, when the kubelet named them.
    pub fn pod_of(&self, id: &CgroupIdentity) -> Option<Arc<PodName>> {
        self.pods.get(id)
    }

    fn next_stamp(&mut self) -> u64 {
        let g = self.next_generation;
        self.next_generation += 1;
        g
    }

    /// `comm` as a shared string, allocated once per distinct comm.
    fn name(&mut self, comm: Comm) -> SharedStr {
        if let Some(n) = self.names.get(&comm) {
            return n.clone();
        }
        if self.names.len() >= MAX_NAMES {
            self.names.clear();
        }
        let n = SharedStr::from(comm.as_str().as_ref());
        self.names.insert(comm, n.clone());
        n
    }

    fn cgroup(&mut self, path: &str) -> Arc<Cgroup> {
        if let Some(c) = self.last_cgroup.as_ref().filter(|c| c.path == path) {
            return c.clone();
        }
        let c = Arc::new(Cgroup {
            path: path.to_string(),
            identity: parse_cgroup(path),
        });
        self.last_cgroup = Some(c.clone());
        c
    }

    fn fresh(&mut self, pid: u32, ppid: u32, comm: Comm, name: SharedStr, ts: u64) -> &mut Proc {
        let generation = self.next_stamp();
        self.procs
            .insert(Proc::new(pid, ppid, comm, name, ts, generation))
    }

    fn on_proc(&mut self, info: &ProcInfo) {
        let stamp = self.next_stamp();
        let name = (!info.comm.is_empty()).then(|| self.name(info.comm));
        let cgroup = info.cgroup.as_deref().map(|cg| self.cgroup(cg));
        let p = match self.procs.get_mut(&info.pid) {
            Some(p) if p.is_alive() => p,
            // Dead or unknown: /proc shows a live process, so this is a new one. When it
            // started is unknown (0): seeds are read one by one, a parent may be read
            // after its child, and the reuse guard of `ancestors` must not cut it.
            _ => {
                let n = name.clone().unwrap_or_else(|| self.name(info.comm));
                self.fresh(info.pid, info.ppid, info.comm, n, 0)
            }
        };
        p.stamp = stamp;
        if info.ppid != 0 {
            p.ppid = info.ppid;
        }
        if let Some(n) = name {
            p.comm = info.comm;
            p.name = n;
        }
        if !info.argv.is_empty() {
            p.set_argv(Argv::new(&info.argv), false);
        }
        if let Some(cg) = cgroup {
            p.cgroup = Some(cg);
        }
    }

    fn on_exec(&mut self, e: &ExecEvent) {
        let stamp = self.next_stamp();
        let name = self.name(e.comm);
        let p = match self.procs.get_mut(&e.tgid) {
            Some(p) if p.is_alive() => p,
            // Fork not seen (before tracing, or lost): parent unknown.
            _ => self.fresh(e.tgid, 0, e.comm, name.clone(), e.ts_ns),
        };
        p.stamp = stamp;
        p.comm = e.comm;
        p.name = name;
        p.set_argv(e.argv.clone(), e.argv_truncated);
        p.set_filename(e.filename.clone());
        p.exec_ns = Some(e.ts_ns);
    }

    /// Fork events fire for threads too: a thread gets an entry of its own (parent = the
    /// process, same name), removed again when the thread exits. Harmless for attribution.
    fn on_fork(&mut self, f: &ForkEvent) {
        if f.child_tid == f.parent_tgid {
            return;
        }
        if let Some(p) = self.procs.get(&f.child_tid) {
            // A seed that raced the fork already describes this very process.
            if p.is_alive() && p.ppid == f.parent_tgid {
                return;
            }
        }
        let name = match self.procs.get(&f.parent_tgid) {
            Some(pp) if pp.comm == f.comm => pp.name.clone(),
            _ => self.name(f.comm),
        };
        let generation = self.next_stamp();
        let child = match self.procs.get(&f.parent_tgid) {
            // Built from the parent's fields directly: each shared one is cloned once.
            Some(pp) => Proc {
                pid: f.child_tid,
                ppid: f.parent_tgid,
                comm: f.comm,
                name,
                argv: pp.argv.clone(),
                argv_truncated: pp.argv_truncated,
                cmdline: pp.cmdline.clone(),
                filename: pp.filename.clone(),
                exe_start: pp.exe_start,
                cgroup: pp.cgroup.clone(),
                start_ns: f.ts_ns,
                exec_ns: None,
                exited: None,
                generation,
                stamp: generation,
            },
            None => Proc::new(
                f.child_tid,
                f.parent_tgid,
                f.comm,
                name,
                f.ts_ns,
                generation,
            ),
        };
        self.procs.insert(child);
        self.prune(f.ts_ns);
    }

    fn on_exit(&mut self, e: &ExitEvent) {
        if e.tid != e.tgid {
            // A thread ended; drop the entry its fork created, if that is what it is.
            if let Some(p) = self.procs.get(&e.tid) {
                if p.ppid == e.tgid && p.exec_ns.is_none() && p.is_alive() {
                    self.procs.remove(&e.tid);
                }
            }
            return;
        }
        if let Some(slot) = self.procs.index.get(e.tgid) {
            if let Some(Some(p)) = self.procs.slots.get_mut(slot as usize) {
                if p.is_alive() {
                    p.exited = Some(ExitInfo {
                        ts_ns: e.ts_ns,
                        code: e.exit_code,
                    });
                    self.dead.push_back((e.tgid, slot, p.generation, e.ts_ns));
                }
            }
        }
        self.prune(e.ts_ns);
    }

    /// Forgets dead entries older than the TTL, and the oldest ones beyond the count limit.
    ///
    /// On a busy node the entry pruned is thousands of exits old, out of the CPU caches, and
    /// so are the strings its drop releases: each prune also prefetches the next entries to
    /// go, in two steps (the slot [`PREFETCH_AHEAD`] exits ahead, then, once it is in, the
    /// strings it points to), so that their misses overlap other work.
    pub fn prune(&mut self, now_ns: u64) {
        let mut pruned = false;
        while let Some(&(pid, slot, generation, ts)) = self.dead.front() {
            let too_old = now_ns.saturating_sub(ts) > self.dead_ttl_ns;
            if !too_old && self.dead.len() <= self.max_dead {
                break;
            }
            self.dead.pop_front();
            pruned = true;
            // The pid may have been reused since: only remove the entry that died.
            self.procs.remove_dead(pid, slot, generation);
        }
        if pruned {
            if let Some(&(pid, slot, _, _)) = self.dead.get(PREFETCH_AHEAD) {
                self.procs.prefetch_slot(slot);
                self.procs.index.prefetch(pid);
            }
            if let Some(&(_, slot, _, _)) = self.dead.front() {
                if let Some(Some(p)) = self.procs.slots.get(slot as usize) {
                    p.prefetch_shared();
                }
            }
        }
    }

    /// The process itself, then its parent, and so on. Stops at an unknown parent, at a
    /// parent that started after its child (a reused pid), at a cycle, or after
    /// [`MAX_CHAIN`] entries.
    pub fn ancestors(&self, pid: u32) -> Ancestors<'_> {
        Ancestors {
            table: self,
            next: Some(pid),
            seen: [0; MAX_CHAIN],
            n: 0,
            child_start: u64::MAX,
        }
    }
}

/// Iterator over a process and its ancestors, see [`ProcTable::ancestors`].
pub struct Ancestors<'a> {
    table: &'a ProcTable,
    next: Option<u32>,
    seen: [u32; MAX_CHAIN],
    n: usize,
    child_start: u64,
}

impl<'a> Iterator for Ancestors<'a> {
    type Item = &'a Proc;

    fn next(&mut self) -> Option<&'a Proc> {
        let pid = self.next.take()?;
        if self.n >= MAX_CHAIN || self.seen[..self.n].contains(&pid) {
            return None;
        }
        let p = self.table.procs.get(&pid)?;
        if p.start_ns > self.child_start {
            return None;
        }
        self.seen[self.n] = pid;
        self.n += 1;
        self.child_start = p.start_ns;
        if p.ppid != 0 {
            self.next = Some(p.ppid);
        }
        Some(p)
    }
}

#[cfg(test)]
pub(crate) mod tests;
