//! The live source: decoded events from the kernel ring buffer, with the kernel's count of
//! lost events and /proc details for new programs.

use std::path::Path;

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;

use crate::{
    decode::{self, Event},
    probes::{ProbeError, Probes},
};

/// Most records read per wake-up, so timers and signals are served during a storm.
pub const BATCH: usize = 4096;

/// Gets every record the source yields, in the order the pipeline sees them: raw kernel
/// records as the ring buffer delivered them, and the events the source makes itself
/// (process snapshot, cgroups of new programs, lost-event counts). `xtlock record` writes
/// them to a capture file, so a replay sees exactly what the live pipeline saw.
pub trait Recorder {
    fn kernel(&mut self, raw: &[u8]) -> anyhow::Result<()>;
    fn synthetic(&mut self, ev: &Event) -> anyhow::Result<()>;
    /// Makes everything recorded so far durable against a crash of this process.
    fn flush(&mut self) -> anyhow::Result<()>;
    /// Completes the recording; returns a one-line description of what was written.
    fn finish(self: Box<Self>) -> anyhow::Result<String>;
}

pub struct LiveSource {
    pub probes: Probes,
    ring: AsyncFd<RingBuf<MapData>>,
    lost_reported: u64,
    /// The last takes read from the map (owner, time): each sent once, not every tick.
    sent_takes: Vec<(u64, u64)>,
    lost_warned: crate::shared::Throttle,
    tap: Tap,
    /// Drop counters and conntrack statistics, once [`LiveSource::start_drops`] ran.
    drops: Option<super::drops::DropPoller>,
    /// IPVS packet counters.
    ipvs: super::ipvs::IpvsPoller,
    /// Refusal counters.
    refusals: super::refusals::RefusalPoller,
}

/// What happens to each record besides the pipeline: recording and error counts. Apart from
/// `ring` so both can be borrowed at once.
#[derive(Default)]
struct Tap {
    decoder: decode::Decoder,
    decode_errors: u64,
    /// The kubelet's names of pods and containers, on a Kubernetes node.
    pods: Option<super::pods::PodDirectory>,
    recorder: Option<Box<dyn Recorder>>,
    /// The first recording error; recording stops there, tracing goes on.
    recorder_error: Option<anyhow::Error>,
    /// Reads each table written, for the rule diffs.
    rules: Option<super::rules::RuleReader>,
    /// iptables binaries as resolved on disk, and their versions.
    binaries: super::binaries::Binaries,
    /// Where this node's addresses live, and when they go (rtnetlink, its own thread).
    addrs: Option<super::addrs::AddrWatcher>,
    /// Conntrack entries DNATed to addresses gone (see `source/ct_entries.rs`).
    ct: Option<super::ct_entries::CtWatch>,
    ipvs_table: Option<super::ipvs_table::IpvsReader>,
    /// Lock files of other mount namespaces, found from the iptables runs in them.
    locks: Option<super::lockfinder::LockFinder>,
    /// Other network namespaces whose rules route Services (node containers): their
    /// addresses and conntrack followed like this one's.
    nodes: Vec<NodeWatch>,
    /// Namespaces looked at for it (a read of their nat table came).
    node_checked: std::collections::HashSet<u32>,
}

/// Another node's namespace followed: rtnetlink and ctnetlink made inside it.
struct NodeWatch {
    addrs: super::addrs::AddrWatcher,
    ct: Option<super::ct_entries::CtWatch>,
}

/// Nodes followed besides this one's namespace; past it, said and left out.
const MAX_NODES: usize = 16;

/// A read of kube-proxy's tables: the legacy (or iptables-nft) nat table with its
/// `KUBE-SERVICES` chain, or nftables mode's `kube-proxy` table.
fn routes_services(t: &decode::RuleTable) -> bool {
    t.table == "kube-proxy"
        || (t.table == "nat" && t.chains.iter().any(|c| &*c.name == "KUBE-SERVICES"))
}

impl LiveSource {
    pub fn new(mut probes: Probes) -> Result<Self, ProbeError> {
        let ring = probes.take_ring()?;
        // SAFETY: the RingBuf owns its map fd and keeps it open, unchanged, until dropped,
        // and it is only dropped with this AsyncFd.
        let ring = unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) }
            .map_err(|e| ProbeError::Io {
                what: "registering the ring buffer with the event loop".into(),
                error: std::io::Error::other(e.to_string()),
            })?;
        Ok(Self {
            probes,
            ring,
            lost_reported: 0,
            sent_takes: Vec::new(),
            lost_warned: crate::shared::Throttle::new(std::time::Duration::from_secs(60)),
            tap: Tap::default(),
            drops: None,
            ipvs: super::ipvs::IpvsPoller::new(super::monotonic_ns()),
            refusals: super::refusals::RefusalPoller::new(super::monotonic_ns()),
        })
    }

    /// Starts reading the kernel's drop counters (when the drop hook is attached) and the
    /// conntrack statistics of the host and of `netns`; returns the events to begin with.
    pub fn start_drops(
        &mut self,
        netns: super::drops::NetnsOptions,
    ) -> Result<Vec<Event>, super::drops::DropSourceError> {
        let now = super::monotonic_ns();
        let poller = super::drops::DropPoller::new(netns, self.probes.drops_attached(), now)?;
        let events = poller.start_events(&self.probes, now);
        // The namespaces asked for (`--netns`, `--all-netns`): drops there are counted by
        // rule from now on, not from their first drop's read.
        if let Some(r) = self.tap.rules.as_mut() {
            let own = super::addrs::own_netns();
            let others: Vec<u32> = poller
                .namespaces()
                .into_iter()
                .map(|(ino, _, _)| ino)
                .filter(|&ino| ino != own && ino != 0)
                .collect();
            r.baseline(&others, std::time::Duration::from_secs(2));
        }
        self.drops = Some(poller);
        for ev in &events {
            self.tap.synthetic(ev);
            if let Some(r) = self.tap.rules.as_mut() {
                r.on_drops(ev);
            }
        }
        Ok(events)
    }

    /// Once a second: conntrack deltas, names of new drop locations, drop counts.
    pub fn poll_drops(&mut self) -> Vec<Event> {
        // The counts below may name a hold whose take is still in the ring (sent ahead of a
        // sampled refusal, say: records wake the reader only in bulk) or still kept in the
        // map. Read before it, the hold was unknown, and a whole interval of refusals came
        // out as outside any hold (the 5.10 guest's `refusals` failures). An empty ring costs
        // a load.
        let mut events = Vec::new();
        self.read_ring(&mut events);
        self.kept_takes(&mut events);
        // Those went through the recorder as the kernel records they are (with the process
        // and pod facts their decoding made): only what this poll makes is recorded below.
        let made = events.len();
        // After the ring: the counts read below are of this time or later.
        let now = super::monotonic_ns();
        events.extend(match self.drops.as_mut() {
            Some(poller) => poller.poll(&self.probes, now),
            None => Vec::new(),
        });
        events.extend(self.ipvs.poll(&self.probes, now));
        events.extend(self.refusals.poll(&mut self.probes));
        if let Some(r) = self.tap.rules.as_mut() {
            for ev in &events {
                r.on_refusals(ev);
                r.on_drops(ev);
            }
        }
        if let Some(pods) = self.tap.pods.as_mut() {
            let mut named = Vec::new();
            pods.tick(now, &mut named);
            events.extend(named.into_iter().map(|p| Event::Pod(Box::new(p))));
        }
        for ev in &events[made..] {
            self.tap.synthetic(ev);
        }
        events
    }

    /// The exclusive takes the kernel keeps until their release, read from the map when
    /// they are still there (a hold of more than one 50 ms tick, or at the end): recorded
    /// and decoded as the kernel records they would have been. Records the kernel wrote
    /// before it kept a take may still be in the ring: the ring is read to its end first,
    /// and a take only sent if it is still kept then (else its own record said it). Its
    /// `Hold` record later repeats it, which the decoder drops.
    fn kept_takes(&mut self, out: &mut Vec<Event>) {
        let first = self.read_kept();
        if first
            .iter()
            .all(|t| self.sent_takes.contains(&(t.owner, t.hdr.ts_ns)))
        {
            return;
        }
        if !self.read_ring(out) {
            return;
        }
        let again = self.read_kept();
        for take in first.iter().filter(|t| again.contains(t)) {
            let key = (take.owner, take.hdr.ts_ns);
            if self.sent_takes.contains(&key) {
                continue;
            }
            if self.sent_takes.len() >= xtlock_common::MAX_WATCHED_LOCKS as usize {
                self.sent_takes.remove(0);
            }
            self.sent_takes.push(key);
            // SAFETY: `LockEvent` is plain old data (`#[repr(C)]`, no padding, aya::Pod).
            let raw = unsafe {
                std::slice::from_raw_parts(
                    (take as *const xtlock_common::LockEvent).cast::<u8>(),
                    std::mem::size_of::<xtlock_common::LockEvent>(),
                )
            };
            self.tap.kernel(raw, out);
        }
    }

    /// Reads the ring to its end; false when a storm kept it from the end (the next tick
    /// tries again).
    fn read_ring(&mut self, out: &mut Vec<Event>) -> bool {
        let ring = self.ring.get_mut();
        for _ in 0..=BATCH {
            let Some(item) = ring.next() else {
                return true;
            };
            self.tap.kernel(&item, out);
        }
        false
    }

    fn read_kept(&self) -> Vec<xtlock_common::LockEvent> {
        self.probes.kept_takes().unwrap_or_else(|e| {
            tracing::debug!(error = %e, "cannot read the kept lock takes");
            Vec::new()
        })
    }

    /// Names the pods and containers of the processes seen, from the kubelet's log
    /// directories under `host_root` (`/` on the node); nothing when there are none.
    pub fn name_pods(&mut self, host_root: &Path) {
        self.tap.pods = super::pods::PodDirectory::new(host_root);
        match &self.tap.pods {
            Some(_) => {
                tracing::debug!(root = %host_root.display(), "naming pods from the kubelet's log directories")
            }
            None => {
                tracing::debug!(root = %host_root.display(), "no kubelet log directory: processes in pods are named by container id only")
            }
        }
    }

    /// Reads every legacy table written, for the analysis to say what the write changed.
    pub fn read_rules(&mut self) {
        match super::rules::RuleReader::start() {
            Ok(mut r) => {
                // Drops here are counted from now on, by rule.
                r.baseline(
                    &[super::addrs::own_netns()],
                    std::time::Duration::from_secs(1),
                );
                self.tap.rules = Some(r)
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the rule reader: rule changes are not diffed")
            }
        }
    }

    /// Follows where this node's addresses live (rtnetlink in this process's namespace), for
    /// the dead endpoints. Never fatal: without it, only those are not known.
    pub fn watch_addrs(&mut self) {
        match super::addrs::AddrWatcher::start() {
            Ok(w) => self.tap.addrs = Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot open an rtnetlink socket: addresses that vanish from this node are not followed");
                return;
            }
        }
        match super::ipvs_table::IpvsReader::start(super::addrs::own_netns()) {
            Ok(r) => self.tap.ipvs_table = Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a generic netlink socket: IPVS real servers are not checked for dead endpoints")
            }
        }
        match super::ct_entries::CtWatch::start(super::addrs::own_netns()) {
            Ok(c) => self.tap.ct = Some(c),
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a netfilter netlink socket: connections to dead endpoints that nothing answers are not counted")
            }
        }
    }

    /// At the end: the tables still being read (waits up to `timeout`).
    pub fn finish_rules(&mut self, out: &mut Vec<Event>, timeout: std::time::Duration) {
        let mut tables = Vec::new();
        if let Some(r) = self.tap.rules.as_mut() {
            r.finish(&mut tables, timeout);
        }
        self.tap.add_tables(tables, out);
    }

    pub fn set_recorder(&mut self, r: Box<dyn Recorder>) {
        self.tap.recorder = Some(r);
    }

    /// The recorder back (to finish it), and the error that stopped it, if any.
    pub fn take_recorder(&mut self) -> (Option<Box<dyn Recorder>>, Option<anyhow::Error>) {
        (self.tap.recorder.take(), self.tap.recorder_error.take())
    }

    pub fn recording(&self) -> bool {
        self.tap.recorder.is_some()
    }

    /// Flushes the recorder (at least every second while recording).
    pub fn flush_recorder(&mut self) {
        if let Some(r) = self.tap.recorder.as_mut() {
            let res = r.flush();
            self.tap.check(res);
        }
    }

    /// Starts looking for the lock files of other mount namespaces (`watched`: the ones
    /// watched already).
    pub fn find_locks(&mut self, watched: &[crate::lockfiles::LockFile]) {
        self.tap.locks = Some(super::lockfinder::LockFinder::new(watched));
    }

    /// Lock files of other mount namespaces found since the last call, to be watched.
    pub fn found_locks(&mut self) -> Vec<super::lockfinder::FoundLock> {
        self.tap
            .locks
            .as_mut()
            .map(super::lockfinder::LockFinder::take)
            .unwrap_or_default()
    }

    /// Flocks on `lock` held right now (from /proc/locks), as events, recorded: a lock
    /// watched from now on may be held already by the run it was found through.
    pub fn seed_lock(&mut self, lock: &crate::lockfiles::LockFile) -> Vec<Event> {
        let Ok(text) = std::fs::read_to_string("/proc/locks") else {
            return Vec::new();
        };
        let now = super::monotonic_ns();
        let events: Vec<Event> = super::procfs::held_flocks(&text, &[(lock.dev, lock.ino)], now)
            .into_iter()
            .map(Event::LockSeed)
            .collect();
        for ev in &events {
            self.tap.synthetic(ev);
        }
        events
    }

    /// The processes that exist now, as events: the analysis starts from them.
    pub fn seed(&mut self, locks: &[(u32, u64)]) -> Vec<Event> {
        let now = super::monotonic_ns();
        let procs = super::procfs::snapshot(Path::new("/proc"), now);
        let mut events: Vec<Event> = Vec::with_capacity(procs.len() + 16);
        if let Some(pods) = self.tap.pods.as_mut() {
            let mut named = Vec::new();
            for p in &procs {
                if let Some(cg) = &p.cgroup {
                    pods.see(&crate::kube::parse_cgroup(cg), now, &mut named);
                }
            }
            events.extend(named.into_iter().map(|p| Event::Pod(Box::new(p))));
        }
        events.extend(procs.into_iter().map(Event::Proc));
        // Holds already in place: during an incident, the lock is likely held right now.
        if let Ok(text) = std::fs::read_to_string("/proc/locks") {
            events.extend(
                super::procfs::held_flocks(&text, locks, now)
                    .into_iter()
                    .map(Event::LockSeed),
            );
        }
        for ev in &events {
            self.tap.synthetic(ev);
        }
        events
    }

    /// Waits for events and appends up to one batch of them to `out`.
    pub async fn next_batch(&mut self, out: &mut Vec<Event>) -> std::io::Result<()> {
        let mut guard = self.ring.readable_mut().await?;
        let mut n = 0;
        while n < BATCH {
            let Some(item) = guard.get_inner_mut().next() else {
                break;
            };
            n += 1;
            self.tap.kernel(&item, out);
        }
        if n < BATCH {
            guard.clear_ready();
        }
        self.tap.poll_rules(out);
        Ok(())
    }

    /// Reads up to `limit` queued records without waiting (on the poll tick, and at exit).
    /// Bounded, so a storm that fills the ring as fast as it is read cannot starve the
    /// timers and signals, nor hold up an exit.
    pub fn drain(&mut self, out: &mut Vec<Event>, limit: usize) {
        let ring = self.ring.get_mut();
        for _ in 0..limit {
            let Some(item) = ring.next() else { break };
            self.tap.kernel(&item, out);
        }
        self.kept_takes(out);
        self.tap.poll_rules(out);
    }

    /// A `Lost` event when the kernel dropped events since the last call.
    pub fn poll_lost(&mut self) -> Option<Event> {
        let total = match self.probes.lost_events() {
            Ok(t) => t,
            Err(e) => {
                if let Some(failures) = self.lost_warned.hit() {
                    tracing::warn!(
                        error = %e,
                        failures,
                        "cannot read the lost-event counter (at most one warning a minute)"
                    );
                }
                return None;
            }
        };
        let delta = total.saturating_sub(self.lost_reported);
        self.lost_reported = total;
        if delta == 0 {
            return None;
        }
        let ev = Event::Lost {
            ts_ns: super::monotonic_ns(),
            count: delta,
        };
        self.tap.synthetic(&ev);
        Some(ev)
    }

    pub fn decode_errors(&self) -> u64 {
        self.tap.decode_errors
    }
}

impl Tap {
    /// Records and decodes one raw kernel record.
    fn kernel(&mut self, raw: &[u8], out: &mut Vec<Event>) {
        if let Some(r) = self.recorder.as_mut() {
            let res = r.kernel(raw);
            self.check(res);
        }
        match self.decoder.decode(raw) {
            Ok(ev) => {
                if let Some(ev) = ev {
                    self.event(ev, out);
                }
                if let Some(release) = self.decoder.pending() {
                    self.event(release, out);
                }
            }
            Err(e) => {
                self.decode_errors += 1;
                if self.decode_errors == 1 {
                    tracing::warn!(error = %e, "undecodable event from the kernel (further ones counted silently)");
                }
            }
        }
    }

    /// One decoded kernel event, and what it asks for at once: its binary's and cgroup's
    /// names, the pods they name.
    fn event(&mut self, ev: Event, out: &mut Vec<Event>) {
        if let Some(r) = self.rules.as_mut() {
            r.on_event(&ev);
        }
        let exec = match &ev {
            Event::Exec(x) => Some((x.tgid, x.ts_ns, x.filename.clone(), x.argv.clone(), x.netns)),
            Event::Fork(f) => {
                self.binaries.forked(f.parent_tgid, f.child_tid);
                None
            }
            _ => None,
        };
        out.push(ev);
        // Right behind its exec, before any exit of the same process: the cgroup of
        // a new program. A container's process is moved to its cgroup by the
        // runtime after fork, so the parent's would name the runtime.
        let info = exec.and_then(|(pid, ts, file, argv, netns)| {
            let mut info = exec_cgroup(pid, ts);
            // An iptables run: which binary, on disk, and its version.
            if super::binaries::is_rule_tool(&file) {
                if let Some(f) = self.locks.as_mut() {
                    f.on_exec(pid, self.binaries.alive_ancestor(pid));
                }
                let resolved = self.binaries.resolve(pid, &file);
                if let Some(r) = self.rules.as_mut() {
                    let args: Vec<&str> = argv.iter().collect();
                    let version = resolved.as_ref().and_then(|(_, v)| v.as_deref());
                    let ancestor = self.binaries.alive_ancestor(pid);
                    r.on_exec(pid, &args, &file, version, ancestor, netns);
                }
                if let Some((exe, version)) = resolved {
                    let i = info.get_or_insert_with(|| decode::ProcInfo {
                        ts_ns: ts,
                        pid,
                        ..Default::default()
                    });
                    i.exe = Some(Box::new(decode::ExeInfo { path: exe, version }));
                }
            }
            info
        });
        if let Some(info) = info {
            if let (Some(pods), Some(cg)) = (self.pods.as_mut(), &info.cgroup) {
                let mut named = Vec::new();
                pods.see(&crate::kube::parse_cgroup(cg), info.ts_ns, &mut named);
                for p in named {
                    let ev = Event::Pod(Box::new(p));
                    self.synthetic(&ev);
                    out.push(ev);
                }
            }
            let ev = Event::Proc(info);
            self.synthetic(&ev);
            out.push(ev);
        }
    }

    /// What the background readers made since the last call: tables read, addresses seen.
    fn poll_rules(&mut self, out: &mut Vec<Event>) {
        let mut tables = Vec::new();
        if let Some(r) = self.rules.as_mut() {
            r.poll(&mut tables);
        }
        self.follow_nodes(&tables);
        for n in &mut self.nodes {
            let from = tables.len();
            n.addrs.poll(&mut tables);
            if let Some(c) = n.ct.as_mut() {
                for ev in &tables[from..] {
                    c.on_event(ev);
                }
                c.poll(&mut tables);
            }
        }
        if let Some(a) = self.addrs.as_mut() {
            let from = tables.len();
            a.poll(&mut tables);
            if let Some(c) = self.ct.as_mut() {
                for ev in &tables[from..] {
                    c.on_event(ev);
                }
            }
        }
        if let Some(c) = self.ct.as_mut() {
            c.poll(&mut tables);
        }
        if let Some(r) = self.ipvs_table.as_mut() {
            r.poll(&mut tables);
        }
        self.add_tables(tables, out);
    }

    /// Starts following the addresses and conntrack of each other namespace whose rules route
    /// Services, from the first read of them (only where this one's are followed).
    fn follow_nodes(&mut self, tables: &[Event]) {
        let Some(own) = self.addrs.as_ref().map(|_| super::addrs::own_netns()) else {
            return;
        };
        for ev in tables {
            let Event::RuleTable(t) = ev else { continue };
            if t.netns == 0 || t.netns == own || !routes_services(t) {
                continue;
            }
            if !self.node_checked.insert(t.netns) {
                continue;
            }
            if self.nodes.len() >= MAX_NODES {
                tracing::warn!(
                    netns = t.netns,
                    "more namespaces route Services than xtlock follows ({MAX_NODES}): this \
                     one's dead endpoints are not followed"
                );
                continue;
            }
            let Some(f) = super::netns::open(t.netns, t.after_pid) else {
                tracing::warn!(netns = t.netns, "its rules route Services, but no process is left in it to follow its addresses by");
                continue;
            };
            let f = std::sync::Arc::new(f);
            match super::addrs::AddrWatcher::start_in(Some((t.netns, f.clone()))) {
                Ok(addrs) => {
                    let ct = super::ct_entries::CtWatch::start_in(t.netns, Some(f))
                        .map_err(|e| tracing::warn!(netns = t.netns, error = %e, "cannot open a netfilter netlink socket there: its dead endpoints' connections are not counted"))
                        .ok();
                    tracing::info!(
                        netns = t.netns,
                        "netns {} routes Services (another node on this host?): its addresses \
                         and conntrack are followed too, for its dead endpoints",
                        t.netns
                    );
                    self.nodes.push(NodeWatch { addrs, ct });
                }
                Err(e) => {
                    tracing::warn!(netns = t.netns, error = %e, "cannot open an rtnetlink socket in a namespace that routes Services: its dead endpoints are not followed")
                }
            }
        }
    }

    fn add_tables(&mut self, tables: Vec<Event>, out: &mut Vec<Event>) {
        for ev in tables {
            self.synthetic(&ev);
            out.push(ev);
        }
    }

    /// Records an event the source made itself.
    fn synthetic(&mut self, ev: &Event) {
        if let Some(r) = self.recorder.as_mut() {
            let res = r.synthetic(ev);
            self.check(res);
        }
    }

    fn check(&mut self, res: anyhow::Result<()>) {
        if let Err(e) = res {
            tracing::error!(error = %format!("{e:#}"), "recording stopped");
            self.recorder = None;
            self.recorder_error = Some(e);
        }
    }
}

/// The cgroup of a process that just exec'd, as a partial `ProcInfo` (only `cgroup` set).
fn exec_cgroup(pid: u32, ts_ns: u64) -> Option<decode::ProcInfo> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    Some(decode::ProcInfo {
        ts_ns,
        pid,
        cgroup: Some(super::procfs::parse_cgroup(&text)?),
        ..Default::default()
    })
}
