//! Reads the rules back from the kernel after each write to them, so the analysis can say
//! what the write changed: a legacy iptables table the way `iptables-save` does
//! (`IPT_SO_GET_INFO`, then `IPT_SO_GET_ENTRIES`), and every nf_tables table of a network
//! namespace the way `nft list ruleset` does (netlink dumps of its tables, chains and rules,
//! `decode/nft_table.rs`), each in the writer's network namespace. It never takes
//! `/run/xtables.lock`: the kernel serialises a legacy read against a replace with the
//! table's own mutex, and an nf_tables dump against a commit with the ruleset's generation
//! (a dump a commit interrupted is read again).
//!
//! An nf_tables read follows an `nft_commit` (kernel hook, where fexit or kprobes attach) and
//! the exit of a process that writes through nf_tables (`iptables-nft*`, `iptables*` whose
//! binary says `(nf_tables)`, `nft`), whose network namespace is opened at its exec.
//!
//! Bounded: one worker thread; requests queued while it reads are coalesced per table (per
//! network namespace for nf_tables: a burst of writes is read once, after the last); a legacy
//! table over [`MAX_ENTRIES`] entries, or a namespace's nf_tables over [`MAX_NFT_RULES`]
//! rules, is not parsed, and says so; chains whose rules did not change since the previous
//! read of the table are sent as digests only. Every skip says why, once per table. A
//! namespace's reads take at most a share of the reader (`budget.rs`): past it, its next read
//! waits (its writes coalesced into it) and the others go first, said once per namespace.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::netlink::{NlError, NlSocket};
use super::worker::{Out, Worker as Thread};
use crate::decode::nft_table::{self, NftTable};
use crate::decode::xt_table::{
    self, Counter, Family, TableInfo, IPT_GETINFO_LEN, IPT_GET_ENTRIES_HEAD,
};
use crate::event::{
    digest_rules, ChainState, Event, Rule, RuleCount, RuleCounters, RuleTable, TableReplaceEvent,
};
use crate::shared::SharedStr;

mod budget;

/// Tables with more entries than this are not parsed (kube-proxy's largest run to ~100k
/// entries; a 30,000-rule table is ~56k entries, its read and diff measured by `cargo xtask
/// bench --only rules`; the analysis keeps each table's rules, ~10 MB for that one).
pub const MAX_ENTRIES: u32 = 150_000;
/// A burst of writes is over after this long without one (see `Worker::run`).
const QUIET: Duration = Duration::from_millis(50);
/// A burst is read this long after its first write at the latest.
const MAX_WAIT: Duration = Duration::from_secs(1);
/// A network namespace whose nf_tables tables hold more rules than this, all together, is
/// not diffed. kube-proxy's nftables mode writes 2 rules per service and 2 per endpoint: a
/// node of a 10,000-service, 50,000-endpoint cluster has ~120,000, its read's CPU and memory
/// measured by `cargo xtask bench --only nft-rules` (docs/performance.md).
pub const MAX_NFT_RULES: usize = 300_000;
/// Tables whose chain digests are remembered (legacy and nf_tables, every netns).
const MAX_TABLES_REMEMBERED: usize = 16_384;
/// Writers through nf_tables still running, remembered with their network namespace.
const MAX_NFT_WRITERS: usize = 1024;
/// How long one nf_tables dump may wait for the kernel's next answer.
const NFT_RECV_TIMEOUT: Duration = Duration::from_secs(2);
/// The family and table under which an nf_tables read of a whole namespace is coalesced and
/// said skipped (`family` `nft`, table `*`).
pub const NFT_ALL: (&str, &str) = ("nft", "*");
/// `IPT_SO_GET_INFO`, `IPT_SO_GET_ENTRIES` (`SOL_IP`).
const IPT_SO_GET_INFO: libc::c_int = 64;
const IPT_SO_GET_ENTRIES: libc::c_int = 65;

/// (netns, family, table)
type Key = (u32, String, String);

struct Request {
    netns: u32,
    pid: u32,
    what: What,
    /// Only if this table was never read: a read to name the rules behind refusals, not
    /// after a write.
    if_unread: bool,
    /// Told once the request was read (or dropped: the sender goes with it).
    done: Option<mpsc::Sender<()>>,
}

enum What {
    /// A legacy iptables (IPv4) or ip6tables (IPv6) table, by name.
    Legacy(Family, String),
    /// The counters of every table of the namespace that can drop (legacy: those loaded but
    /// `nat`; nf_tables: all, where nf_tables is loaded): netfilter dropped packets there.
    /// The tables are not sent, only what their dropping rules counted.
    Counters,
    /// Every nf_tables table of the namespace; with a handle on it when the writer's was
    /// opened at its exec (the writer is gone by the time it is read).
    Nft(Option<Arc<File>>),
}

impl Request {
    fn key(&self) -> Key {
        match &self.what {
            What::Legacy(f, t) => (self.netns, f.name().into(), t.clone()),
            What::Nft(_) => (self.netns, NFT_ALL.0.into(), NFT_ALL.1.into()),
            What::Counters => (self.netns, "counters".into(), "*".into()),
        }
    }
}

/// The worker's handle: requests in, tables out.
pub struct RuleReader {
    tx: Option<mpsc::Sender<Request>>,
    /// Namespaces whose filter table was asked for because of refusals.
    asked: HashSet<u32>,
    /// Processes writing through nf_tables: their network namespace (inode, handle).
    nft_writers: HashMap<u32, (u32, Arc<File>)>,
    /// The kernel's number for `NETFILTER_DROP` (`None`: it reports no reasons, any drop
    /// may be netfilter's), once the drop setup came.
    nf_drop: Option<Option<u32>>,
    /// Last: dropped after `tx`, so the worker sees its requests end, then is stopped and
    /// joined.
    thread: Thread<Event>,
}

/// Tables (in parts) and counters waiting to be taken: the worker waits past this.
const CHANNEL: usize = 1024;

impl RuleReader {
    pub fn start() -> std::io::Result<Self> {
        let (tx, req_rx) = mpsc::channel::<Request>();
        let thread = Thread::spawn("xtlock-rules", CHANNEL, move |out: Out<Event>| {
            Worker::default().run(&req_rx, &out)
        })?;
        Ok(Self {
            tx: Some(tx),
            asked: HashSet::new(),
            nft_writers: HashMap::new(),
            nf_drop: None,
            thread,
        })
    }

    /// The counters of the dropping rules of each of `netns` as they are now: the baseline
    /// later drops there are counted from (the tracer's own namespace, and those it was asked
    /// to watch, at the start). Waits up to `wait` for the reads: drops right after the start
    /// are then counted by rule too.
    pub fn baseline(&mut self, netns: &[u32], wait: Duration) {
        let Some(tx) = &self.tx else { return };
        let (done_tx, done) = mpsc::channel();
        for &n in netns {
            let _ = tx.send(Request {
                netns: n,
                pid: std::process::id(),
                what: What::Counters,
                if_unread: false,
                done: Some(done_tx.clone()),
            });
        }
        drop(done_tx);
        let deadline = Instant::now() + wait;
        for _ in netns {
            let left = deadline.saturating_duration_since(Instant::now());
            if done.recv_timeout(left).is_err() {
                tracing::debug!("rule counters of some namespaces not baselined in time");
                break;
            }
        }
    }

    /// Drop counts: each namespace where netfilter dropped packets in the last second has
    /// its rules' counters read, to name the rules that dropped them. At most one read per
    /// namespace a second (the counts come once a second), coalesced with reads queued and
    /// rationed like every rule read: a storm of drops is not a storm of reads.
    pub fn on_drops(&mut self, ev: &Event) {
        match ev {
            Event::DropSetup {
                has_reason, names, ..
            } => {
                let nf = names
                    .iter()
                    .find(|(_, n)| n == "NETFILTER_DROP")
                    .map(|(c, _)| *c);
                self.nf_drop = Some(if *has_reason {
                    nf.or(Some(u32::MAX))
                } else {
                    None
                });
            }
            Event::DropCounts(c) => {
                let Some(nf) = self.nf_drop else { return };
                let Some(tx) = &self.tx else { return };
                let mut asked: Vec<u32> = Vec::new();
                for d in &c.counts {
                    let netfilter = nf.is_none_or(|code| d.reason == code);
                    if netfilter && d.netns != 0 && !asked.contains(&d.netns) && asked.len() < 64 {
                        asked.push(d.netns);
                    }
                }
                for netns in asked {
                    let _ = tx.send(Request {
                        netns,
                        pid: 0,
                        what: What::Counters,
                        if_unread: false,
                        done: None,
                    });
                }
            }
            _ => {}
        }
    }

    /// A kernel event: a successful IPv4 or IPv6 table replace asks for that table to be read; an
    /// nf_tables commit that changed something, or the exit of an nf_tables writer, for
    /// the namespace's nf_tables tables.
    pub fn on_event(&mut self, ev: &Event) {
        let r = match ev {
            Event::TableReplace(t) if legacy_replace(t).is_some() => {
                let (Some(family), Some(table)) =
                    (legacy_replace(t), t.head.as_ref().map(|h| h.name()))
                else {
                    return;
                };
                Request {
                    netns: t.netns,
                    pid: t.tgid,
                    what: What::Legacy(family, table),
                    if_unread: false,
                    done: None,
                }
            }
            Event::NftCommit(n) if n.batch.as_ref().is_none_or(|b| b.changes() > 0) => Request {
                netns: n.netns,
                pid: n.tgid,
                what: What::Nft(None),
                if_unread: false,
                done: None,
            },
            Event::Exit(e) if e.tid == e.tgid => {
                let Some((netns, ns)) = self.nft_writers.remove(&e.tgid) else {
                    return;
                };
                Request {
                    netns,
                    pid: e.tgid,
                    what: What::Nft(Some(ns)),
                    if_unread: false,
                    done: None,
                }
            }
            _ => return,
        };
        if let Some(tx) = &self.tx {
            // A worker gone (it panicked) only means no more diffs.
            let _ = tx.send(r);
        }
    }

    /// Refusal counts: the IPv4 filter table of each namespace that refused connections is
    /// read once, if no write to it was read yet, so the refusals can name the REJECT rule
    /// behind them (kube-proxy's "has no endpoints" rules are older than most traces).
    pub fn on_refusals(&mut self, ev: &Event) {
        let Event::RefusalCounts(c) = ev else { return };
        let Some(tx) = &self.tx else { return };
        for rc in &c.counts {
            // Bounded: a node has as many namespaces as pods.
            if rc.netns == 0 || self.asked.len() >= 4096 || !self.asked.insert(rc.netns) {
                continue;
            }
            let _ = tx.send(Request {
                netns: rc.netns,
                pid: 0,
                what: What::Legacy(Family::Ipv4, "filter".into()),
                if_unread: true,
                done: None,
            });
        }
    }

    /// An exec of a rule tool (`argv`, `filename` as given to execve, `version` as its
    /// binary carries it, `netns` the inode of its network namespace as the kernel saw it at
    /// exec, 0 unknown): when it writes through nf_tables, that namespace is opened now, for
    /// the read after its exit: through the writer, else (it is gone already) through
    /// `ancestor` if that one lives in the same namespace, else through a pin of it
    /// (`ip netns`, containerd's `cni-*`) or any process in it ([`super::netns::open`]).
    pub fn on_exec(
        &mut self,
        pid: u32,
        argv: &[&str],
        filename: &str,
        version: Option<&str>,
        ancestor: Option<u32>,
        netns: u32,
    ) {
        if !writes_nft(argv, filename, version) {
            return;
        }
        use std::os::unix::fs::MetadataExt;
        let open = |p: u32| -> Option<(u32, File)> {
            let f = File::open(format!("/proc/{p}/ns/net")).ok()?;
            let ino = u32::try_from(f.metadata().ok()?.ino()).ok()?;
            (netns == 0 || ino == netns).then_some((ino, f))
        };
        let found = open(pid).or_else(|| ancestor.and_then(open)).or_else(|| {
            (netns != 0).then(|| super::netns::open(netns, pid).map(|f| (netns, f)))?
        });
        let Some((ino, f)) = found else {
            tracing::debug!(
                pid,
                netns,
                "nf_tables writer gone before its namespace was opened, and no pin or process of that namespace found"
            );
            return;
        };
        tracing::debug!(pid, ?ancestor, netns = ino, "nf_tables writer");
        if self.nft_writers.len() >= MAX_NFT_WRITERS {
            // Writers whose exit was missed (lost events): forget them all.
            self.nft_writers.clear();
        }
        self.nft_writers.insert(pid, (ino, Arc::new(f)));
    }

    /// The tables read since the last call.
    pub fn poll(&mut self, out: &mut Vec<Event>) {
        self.thread.poll(out);
    }

    /// At the end: waits up to `timeout` for the reads asked for, then returns what came.
    pub fn finish(&mut self, out: &mut Vec<Event>, timeout: Duration) {
        // Closing the channel ends the worker once it has read what is queued.
        self.tx = None;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.thread.recv_timeout(left) {
                Some(ev) => out.push(ev),
                None => break,
            }
        }
        if !self.thread.ended() {
            tracing::debug!("rule reads still going at the end: not waited for");
        }
    }
}

/// Whether a program run writes nf_tables rules, from its names as exec'd: `nft` (not
/// `nft list`), an `*tables-nft*` (not `-save`), or an `*tables*` whose binary says
/// `(nf_tables)`; not the listing commands (`-L`, `-S`, `-C`). Reading after a run that wrote
/// nothing costs one read, and says nothing.
pub fn writes_nft(argv: &[&str], filename: &str, version: Option<&str>) -> bool {
    let base = |p: &str| p.rsplit('/').next().unwrap_or(p).to_string();
    let mut name = argv
        .first()
        .map(|a| base(a))
        .unwrap_or_else(|| base(filename));
    let mut args = argv.get(1..).unwrap_or_default();
    let multi = name == "xtables-nft-multi";
    if multi {
        name = args.first().map(|a| base(a)).unwrap_or_default();
        args = args.get(1..).unwrap_or_default();
    } else if !(name.contains("tables") || name == "nft") {
        // argv[0] chosen by the caller: the file is what runs.
        name = base(filename);
    }
    if name == "nft" {
        return !args
            .iter()
            .any(|a| matches!(*a, "list" | "monitor" | "describe" | "-v" | "--version"));
    }
    let nft = multi || name.contains("-nft") || version.is_some_and(|v| v.contains("nf_tables"));
    let listing = args.iter().any(|a| {
        matches!(
            *a,
            "-L" | "--list" | "-S" | "--list-rules" | "-C" | "--check" | "-V" | "--version"
        )
    });
    nft && name.contains("tables") && !name.ends_with("-save") && !listing
}

/// The family of a successful iptables or ip6tables table replace (arptables and ebtables
/// are counted as writes, not read back).
fn legacy_replace(t: &TableReplaceEvent) -> Option<Family> {
    if t.read || t.ret != 0 || t.optname != xtlock_common::XT_SO_SET_REPLACE {
        return None;
    }
    match t.level {
        xtlock_common::SOL_IP => Some(Family::Ipv4),
        xtlock_common::SOL_IPV6 => Some(Family::Ipv6),
        _ => None,
    }
}

#[derive(Default)]
struct Worker {
    /// Each table's chain digests at its last read.
    last: HashMap<Key, HashMap<String, u64>>,
    /// Tables whose skip was said already.
    said: HashSet<Key>,
    /// Open network namespaces by inode.
    netns: HashMap<u32, Arc<File>>,
    /// Each namespace's nf_tables tables at their last read: (family, table).
    nft_tables: HashMap<u32, Vec<(String, String)>>,
    /// Each namespace's share of the reader.
    budget: budget::Budget,
    /// Reads held back past their namespace's share: when each may go.
    deferred: Vec<(Instant, Request)>,
    /// Namespaces whose rationing was said.
    said_rationed: HashSet<u32>,
    /// Each table's dropping rules' counters at its last read, and when.
    counts: HashMap<Key, (u64, HashMap<CountKey, Counter>)>,
}

/// A dropping rule within its table: chain, text (empty: the chain's policy), and its
/// place among the chain's rules of the same text.
type CountKey = (String, String, u32);

/// Tables whose counters are remembered (legacy and nf_tables, every netns).
const MAX_COUNTED_TABLES: usize = 4096;

impl Worker {
    fn run(mut self, rx: &mpsc::Receiver<Request>, tx: &Out<Event>) {
        let mut open = true;
        while (open || !self.deferred.is_empty()) && !tx.stop.stopped() {
            // A request, or a held-back read come due.
            let due = self.deferred.iter().map(|(t, _)| *t).min();
            let first = match (open, due) {
                (true, None) => match rx.recv() {
                    Ok(r) => Some(r),
                    Err(_) => {
                        open = false;
                        None
                    }
                },
                (true, Some(due)) => {
                    match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                        Ok(r) => Some(r),
                        Err(mpsc::RecvTimeoutError::Timeout) => None,
                        Err(mpsc::RecvTimeoutError::Disconnected) => {
                            open = false;
                            None
                        }
                    }
                }
                (false, _) => None,
            };
            // A burst of writes (a restore per table, firewalld's dozens in a row) is read
            // once it is over: after QUIET without a write, or MAX_WAIT after its first, so
            // the reads do not queue on the table's mutex between the writes of a burst.
            let mut batch: Vec<Request> = Vec::new();
            if let Some(first) = first {
                // Counter reads are asked once a second, not in bursts: read at once.
                let burst = !matches!(first.what, What::Counters);
                batch.push(first);
                let since = Instant::now();
                while burst && since.elapsed() < MAX_WAIT {
                    match rx.recv_timeout(QUIET) {
                        Ok(r) => batch.push(r),
                        Err(mpsc::RecvTimeoutError::Timeout) => break,
                        Err(mpsc::RecvTimeoutError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                }
                batch.extend(rx.try_iter());
            }
            // Held-back reads come due (all of them once the reader is closing: the last
            // state of every table is read), before the new requests: a newer request for
            // the same table replaces them.
            let now = Instant::now();
            let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred)
                .into_iter()
                .partition(|(t, _)| !open || *t <= now);
            self.deferred = wait;
            let mut all: Vec<Request> = ready.into_iter().map(|(_, r)| r).collect();
            all.extend(batch);
            let mut seen = HashSet::new();
            let mut todo: Vec<Request> = Vec::new();
            for r in all.into_iter().rev() {
                if seen.insert(r.key()) {
                    todo.push(r);
                }
            }
            todo.reverse();
            // Namespaces under their share first.
            let now = Instant::now();
            todo.sort_by_key(|r| self.budget.allow(r.netns, now).is_err());
            for r in todo {
                let now = Instant::now();
                if open {
                    if let Err(at) = self.budget.allow(r.netns, now) {
                        self.hold_back(at, r, now);
                        continue;
                    }
                }
                let cpu = budget::thread_cpu();
                let (parts, counted) = self.read(&r);
                if let Some(d) = &r.done {
                    let _ = d.send(());
                }
                self.budget
                    .charge(r.netns, now, budget::thread_cpu().saturating_sub(cpu));
                // In parts that fit the capture's records (a large table's first read).
                for part in parts.into_iter().flat_map(RuleTable::into_parts) {
                    if !tx.send(Event::RuleTable(Box::new(part))) {
                        return;
                    }
                }
                for c in counted {
                    if !tx.send(Event::RuleCounters(Box::new(c))) {
                        return;
                    }
                }
            }
        }
    }

    /// `r` waits until `at`, its namespace past its share: replaces a held-back read of the
    /// same table; said once per namespace.
    fn hold_back(&mut self, at: Instant, r: Request, now: Instant) {
        if self.said_rationed.len() < 4096 && self.said_rationed.insert(r.netns) {
            let spent = self.budget.spent(r.netns, now);
            tracing::warn!(
                netns = r.netns,
                "rule reads of network namespace {} rationed: they took {:.2} s of CPU in the \
                 last {} s, over its share ({:.0} % of a core); its writes are read when its \
                 reads fall back under it (writes meanwhile are read at once, then), other \
                 namespaces first",
                r.netns,
                spent.as_secs_f64(),
                budget::WINDOW.as_secs(),
                budget::SHARE * 100.0
            );
        }
        let key = r.key();
        self.deferred.retain(|(_, d)| d.key() != key);
        self.deferred.push((at, r));
    }

    /// The tables a request asks for, as read (or said skipped), and what their dropping
    /// rules counted since their previous read.
    fn read(&mut self, r: &Request) -> (Vec<RuleTable>, Vec<RuleCounters>) {
        let key = r.key();
        if r.if_unread && (self.last.contains_key(&key) || self.said.contains(&key)) {
            return (Vec::new(), Vec::new());
        }
        if let What::Counters = r.what {
            return (Vec::new(), self.read_counters(r));
        }
        let tables = self.enter(r).and_then(|()| match &r.what {
            What::Counters => Ok(Vec::new()),
            What::Legacy(family, table) => read_table(*family, table).map(|chains| {
                vec![NftTable {
                    family: family.name().into(),
                    name: table.clone(),
                    chains,
                }]
            }),
            What::Nft(_) => {
                let started = Instant::now();
                let t = read_nft();
                if let Ok(t) = &t {
                    tracing::debug!(
                        netns = r.netns,
                        tables = t.len(),
                        rules = t
                            .iter()
                            .flat_map(|t| &t.chains)
                            .map(|c| c.rules.len())
                            .sum::<usize>(),
                        took_us = started.elapsed().as_micros() as u64,
                        "nf_tables read"
                    );
                }
                t
            }
        });
        let ts_ns = super::monotonic_ns();
        let table = |family: &str, name: &str| RuleTable {
            ts_ns,
            netns: r.netns,
            family: family.to_string(),
            table: name.to_string(),
            after_pid: r.pid,
            skipped: String::new(),
            chains: Vec::new(),
            more: false,
        };
        match tables {
            Ok(tables) => {
                self.said.remove(&key);
                let mut out = Vec::new();
                let mut names = Vec::new();
                let mut counted = Vec::new();
                for nt in tables {
                    counted.extend(self.count(r.netns, ts_ns, &nt, false));
                    let mut t = table(&nt.family, &nt.name);
                    let k = (r.netns, nt.family.clone(), nt.name.clone());
                    names.push((nt.family, nt.name));
                    let prev = self.last.remove(&k).unwrap_or_default();
                    let mut now = HashMap::new();
                    for c in nt.chains {
                        let digest = digest_rules(&c.rules);
                        now.insert(c.name.clone(), digest);
                        let changed = prev.get(&c.name) != Some(&digest);
                        t.chains.push(ChainState {
                            name: c.name.into(),
                            policy: c.policy.map(SharedStr::from),
                            digest,
                            rules: changed.then_some(c.rules),
                        });
                    }
                    if self.last.len() >= MAX_TABLES_REMEMBERED {
                        // Only costs whole chains instead of digests in the next reads.
                        self.last.clear();
                    }
                    self.last.insert(k, now);
                    out.push(t);
                }
                if matches!(r.what, What::Nft(_)) {
                    // Tables deleted since the last read: read as empty, every chain gone.
                    let before = self
                        .nft_tables
                        .insert(r.netns, names.clone())
                        .unwrap_or_default();
                    for (f, n) in before.into_iter().filter(|t| !names.contains(t)) {
                        self.last.remove(&(r.netns, f.clone(), n.clone()));
                        out.push(table(&f, &n));
                    }
                    if self.nft_tables.len() > 256 {
                        self.nft_tables.clear();
                    }
                }
                (out, counted)
            }
            Err(why) => {
                // Said once per table until a read works again; the analysis forgets the
                // table's state (what changes meanwhile is not known).
                if let What::Nft(_) = r.what {
                    for (f, n) in self.nft_tables.remove(&r.netns).unwrap_or_default() {
                        self.last.remove(&(r.netns, f, n));
                    }
                }
                self.last.remove(&key);
                let (_, family, name) = key.clone();
                if !self.said.insert(key) {
                    return (Vec::new(), Vec::new());
                }
                tracing::debug!(netns = r.netns, %family, table = %name, %why, "table not read");
                let mut t = table(&family, &name);
                t.skipped = why;
                (vec![t], Vec::new())
            }
        }
    }

    /// A [`What::Counters`] request: every table of the namespace that can drop, read for
    /// its counters alone (the rule diffs' digests are left as they were).
    fn read_counters(&mut self, r: &Request) -> Vec<RuleCounters> {
        if let Err(why) = self.enter(r) {
            tracing::debug!(netns = r.netns, %why, "rule counters not read");
            return Vec::new();
        }
        let mut tables = Vec::new();
        for family in [Family::Ipv4, Family::Ipv6] {
            for name in legacy_tables(family) {
                // `nat` cannot drop (iptables refuses DROP there), and is the large one.
                if name == "nat" {
                    continue;
                }
                match read_table(family, &name) {
                    Ok(chains) => tables.push(NftTable {
                        family: family.name().into(),
                        name,
                        chains,
                    }),
                    Err(why) => {
                        tracing::debug!(netns = r.netns, family = family.name(), table = %name, %why, "rule counters not read")
                    }
                }
            }
        }
        // Only where nf_tables is there already (built in, or a module loaded): asking a
        // modular kernel for its tables would load it.
        let modular = std::path::Path::new("/proc/modules").exists();
        if !modular || std::path::Path::new("/sys/module/nf_tables").exists() {
            match read_nft() {
                Ok(t) => tables.extend(t),
                Err(why) => tracing::debug!(netns = r.netns, %why, "nf_tables counters not read"),
            }
        }
        let ts_ns = super::monotonic_ns();
        let mut out = Vec::new();
        for t in &tables {
            out.extend(self.count(r.netns, ts_ns, t, true));
        }
        out
    }

    /// What `t`'s dropping rules counted since the table's previous read: `None` at its
    /// first read (the baseline), or when nothing moved and nothing is worth saying.
    /// `asked`: drops asked for this read (then rules that keep no counter are listed).
    fn count(&mut self, netns: u32, ts_ns: u64, t: &NftTable, asked: bool) -> Option<RuleCounters> {
        let key: Key = (netns, t.family.clone(), t.name.clone());
        // The dropping rules' counters, in table order.
        let mut now: Vec<(CountKey, Counter)> = Vec::new();
        let mut uncounted = Vec::new();
        for c in &t.chains {
            if c.policy.as_deref() == Some("DROP") {
                if let Some(pc) = c.policy_counter {
                    now.push(((c.name.clone(), String::new(), 0), pc));
                }
            }
            let mut seen: HashMap<String, u32> = HashMap::new();
            for (i, rule) in c.rules.iter().enumerate() {
                if !drops(rule) {
                    continue;
                }
                let text = rule.text();
                let nth = seen.entry(text.clone()).or_default();
                let k = (c.name.clone(), text, *nth);
                *nth += 1;
                match c.counters.get(i).copied().flatten() {
                    Some(counter) => now.push((k, counter)),
                    None if uncounted.len() < crate::event::MAX_UNCOUNTED => {
                        uncounted.push(format!("{}: {}", k.0, k.1));
                    }
                    None => {}
                }
            }
        }
        if self.counts.len() >= MAX_COUNTED_TABLES && !self.counts.contains_key(&key) {
            // Their next reads are baselines again.
            self.counts.clear();
        }
        // What each counter grew by since the previous read, measured before this read
        // replaces it; the first read is the baseline.
        let mut rules = Vec::new();
        let prev = self.counts.get(&key);
        let since_ns = prev.map(|(since, _)| *since);
        for (k, c) in now.iter().filter(|_| prev.is_some()) {
            // A rule new since the previous read started at 0; one whose counter went back
            // was replaced by a write since.
            let (packets, bytes, reset) = match prev.and_then(|(_, p)| p.get(k)) {
                Some(p) if c.packets >= p.packets => (
                    c.packets - p.packets,
                    c.bytes.saturating_sub(p.bytes),
                    false,
                ),
                Some(_) => (c.packets, c.bytes, true),
                None => (c.packets, c.bytes, false),
            };
            if packets > 0 && rules.len() < crate::event::MAX_RULE_COUNTS {
                rules.push(RuleCount {
                    chain: k.0.clone(),
                    rule: k.1.clone(),
                    nth: k.2,
                    packets,
                    bytes,
                    reset,
                });
            }
        }
        self.counts.insert(key, (ts_ns, now.into_iter().collect()));
        let since_ns = since_ns?;
        // Nothing moved: said only to list rules that cannot count, when drops asked.
        if rules.is_empty() && (!asked || uncounted.is_empty()) {
            return None;
        }
        Some(RuleCounters {
            ts_ns,
            since_ns,
            netns,
            family: t.family.clone(),
            table: t.name.clone(),
            rules,
            uncounted: if asked { uncounted } else { Vec::new() },
        })
    }

    /// Moves this thread into the writer's network namespace.
    fn enter(&mut self, r: &Request) -> Result<(), String> {
        if r.netns == 0 {
            return Err("its network namespace is unknown (no kernel BTF)".into());
        }
        if let What::Nft(Some(f)) = &r.what {
            // The writer's own, opened at its exec: the freshest handle on that inode.
            self.netns.insert(r.netns, f.clone());
        }
        if !self.netns.contains_key(&r.netns) {
            let f = super::netns::open(r.netns, r.pid)
                .ok_or("no process left in its network namespace to enter it by")?;
            if self.netns.len() >= 256 {
                self.netns.clear();
            }
            self.netns.insert(r.netns, Arc::new(f));
        }
        let f = &self.netns[&r.netns];
        // SAFETY: setns on an fd we own; it affects this worker thread only.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let e = std::io::Error::last_os_error();
            self.netns.remove(&r.netns);
            return Err(format!(
                "cannot enter its network namespace: {e} (needs CAP_SYS_ADMIN)"
            ));
        }
        Ok(())
    }
}

/// A rule that drops what it matches: `-j DROP`, or `-j REJECT` (which answers, then drops).
/// Both renderers word nf_tables verdicts this way too.
fn drops(rule: &Rule) -> bool {
    let t = rule.target();
    t == "-j DROP" || t.starts_with("-j REJECT")
}

/// The legacy tables loaded in this thread's network namespace (`ip_tables_names`; none
/// when the module is not loaded: nothing is loaded by asking).
fn legacy_tables(family: Family) -> Vec<String> {
    let file = match family {
        Family::Ipv4 => "/proc/thread-self/net/ip_tables_names",
        Family::Ipv6 => "/proc/thread-self/net/ip6_tables_names",
    };
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// One table of the current network namespace, parsed.
fn read_table(family: Family, table: &str) -> Result<Vec<xt_table::Chain>, String> {
    // `IP6T_SO_GET_*` have the numbers of `IPT_SO_GET_*`, at level `SOL_IPV6`; `ip6t_getinfo`
    // and `ip6t_get_entries`' head have the IPv4 layouts.
    let (domain, level) = match family {
        Family::Ipv4 => (libc::AF_INET, libc::SOL_IP),
        Family::Ipv6 => (libc::AF_INET6, libc::SOL_IPV6),
    };
    // SAFETY: a plain socket call; the fd is owned by `sock` right after.
    let fd = unsafe { libc::socket(domain, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!("cannot open a raw socket: {e} (needs CAP_NET_RAW)"));
    }
    // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut name = [0u8; 32];
    let n = table.len().min(31);
    name[..n].copy_from_slice(&table.as_bytes()[..n]);
    // The table can change size between the two calls (the kernel then says EAGAIN).
    for _ in 0..3 {
        let mut info = [0u8; IPT_GETINFO_LEN];
        info[..32].copy_from_slice(&name);
        getsockopt(&sock, level, IPT_SO_GET_INFO, &mut info).map_err(|e| {
            format!(
                "cannot read the table's size: {e}{}",
                super::needs(&e, "CAP_NET_ADMIN")
            )
        })?;
        let info = TableInfo::parse(&info).map_err(|e| e.to_string())?;
        if info.num_entries > MAX_ENTRIES {
            return Err(format!(
                "too large to diff: {} entries (more than {MAX_ENTRIES})",
                info.num_entries
            ));
        }
        let mut buf = vec![0u8; IPT_GET_ENTRIES_HEAD + info.size as usize];
        buf[..32].copy_from_slice(&name);
        buf[32..36].copy_from_slice(&info.size.to_ne_bytes());
        match getsockopt(&sock, level, IPT_SO_GET_ENTRIES, &mut buf) {
            Ok(()) => {
                // `-m set` matches' sets named by the kernel, in this namespace.
                let mut sets = super::ipset::SetNames::default();
                return xt_table::parse_table_with(
                    family,
                    &info,
                    &buf[IPT_GET_ENTRIES_HEAD..],
                    &mut |i| sets.name(i),
                )
                .map_err(|e| e.to_string());
            }
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
            Err(e) => return Err(format!("cannot read the table: {e}")),
        }
    }
    Err("the table kept changing while it was read".into())
}

fn getsockopt(
    sock: &impl AsRawFd,
    level: libc::c_int,
    opt: libc::c_int,
    buf: &mut [u8],
) -> std::io::Result<()> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf is valid for len bytes; the kernel writes at most that many.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            level,
            opt,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Every nf_tables table of the current network namespace, read whole: dumps of its tables,
/// chains and rules at one ruleset generation, read again (at most three times) when a
/// commit came between them. The rules come in one dump while the namespace has at most
/// [`PER_CHAIN_FROM`] chains, else one dump per chain: the kernel's dump of every rule walks
/// again past all it has sent for each answer, so its time grows with the square of the
/// ruleset (63 % of xtlock's CPU, all of it in `__nf_tables_dump_rules`, reading 60,000
/// rules), where a chain's dump walks that chain alone.
fn read_nft() -> Result<Vec<NftTable>, String> {
    let mut sock = NlSocket::open(netlink_sys::protocols::NETLINK_NETFILTER, NFT_RECV_TIMEOUT)
        .map_err(|e| format!("cannot open a netfilter netlink socket: {e}"))?;
    for _ in 0..3 {
        let mut d = Dumped::default();
        for msg in [nft_table::NFT_MSG_GETTABLE, nft_table::NFT_MSG_GETCHAIN] {
            let req = nft_table::dump_request(msg, sock.next_seq());
            dump(&mut sock, &req, &mut d)?;
        }
        let mut whole = d.chains.len() <= PER_CHAIN_FROM;
        if !whole {
            // Rule dumps add no chains: the list is lent out while they fill `d`.
            let chains = std::mem::take(&mut d.chains);
            for (family, c) in &chains {
                let req =
                    nft_table::chain_rules_request(*family, &c.table, &c.name, sock.next_seq());
                let before = d.rules.len();
                dump(&mut sock, &req, &mut d)?;
                // A kernel that ignored the filter answered with other chains' rules too:
                // the whole dump instead.
                if d.rules[before..]
                    .iter()
                    .any(|(f, r)| f != family || r.table != c.table || r.chain != c.name)
                {
                    tracing::debug!("nf_tables dump by chain not filtered: one dump instead");
                    d.rules.clear();
                    whole = true;
                    break;
                }
                if d.again {
                    break;
                }
            }
            d.chains = chains;
        }
        if whole && !d.again {
            let req = nft_table::dump_request(nft_table::NFT_MSG_GETRULE, sock.next_seq());
            dump(&mut sock, &req, &mut d)?;
        }
        if !d.again {
            return Ok(nft_table::assemble(d.tables, d.chains, d.rules));
        }
    }
    Err("the ruleset kept changing while it was read".into())
}

/// Namespaces with more chains than this have their rules dumped chain by chain (see
/// [`read_nft`]): a round trip per chain costs more than one dump of a small ruleset.
const PER_CHAIN_FROM: usize = 1000;

/// What the dumps of one read gave.
#[derive(Default)]
struct Dumped {
    tables: Vec<(u8, String)>,
    chains: Vec<(u8, nft_table::NftChain)>,
    rules: Vec<(u8, nft_table::NftRule)>,
    generation: Option<u16>,
    /// A commit came between two messages: read again.
    again: bool,
    /// The names of the sets `-m set` matches use, asked of the kernel once each.
    sets: super::ipset::SetNames,
}

/// Sends one dump request and takes its answer into `d`.
fn dump(sock: &mut NlSocket, req: &[u8], d: &mut Dumped) -> Result<(), String> {
    sock.exchange(req, |m| {
        let Some(o) = nft_table::object(&m).map_err(|e| e.to_string())? else {
            return Ok(());
        };
        d.again |= o.interrupted || d.generation.is_some_and(|was| was != o.generation);
        d.generation = Some(o.generation);
        let e = |e: nft_table::NftError| e.to_string();
        match o.msg {
            nft_table::NFT_MSG_NEWTABLE => d
                .tables
                .push((o.family, nft_table::parse_table(o.attrs).map_err(e)?)),
            nft_table::NFT_MSG_NEWCHAIN => d
                .chains
                .push((o.family, nft_table::parse_chain(o.attrs).map_err(e)?)),
            nft_table::NFT_MSG_NEWRULE => {
                if d.rules.len() >= MAX_NFT_RULES {
                    return Err(format!(
                        "too large to diff: more than {MAX_NFT_RULES} rules"
                    ));
                }
                let rule =
                    nft_table::parse_rule(o.family, o.attrs, &mut |i| d.sets.name(i)).map_err(e)?;
                d.rules.push((o.family, rule));
            }
            _ => {}
        }
        Ok(())
    })
    .map_err(|e: NlError<String>| match e {
        NlError::Reader(e) => e,
        e => format!("the nf_tables dump: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::writes_nft;

    #[test]
    fn which_runs_write_nf_tables() {
        let w = |argv: &[&str], file: &str, v: Option<&str>| writes_nft(argv, file, v);
        assert!(w(
            &["iptables-nft-restore", "--noflush"],
            "/usr/sbin/iptables-nft-restore",
            None
        ));
        assert!(w(
            &["iptables-nft", "-A", "X"],
            "/usr/sbin/iptables-nft",
            None
        ));
        assert!(!w(
            &["iptables-nft-save"],
            "/usr/sbin/iptables-nft-save",
            None
        ));
        assert!(!w(&["iptables-nft", "-L"], "/usr/sbin/iptables-nft", None));
        assert!(w(
            &["iptables-restore"],
            "/usr/sbin/iptables-restore",
            Some("1.8.9 (nf_tables)")
        ));
        assert!(!w(
            &["iptables-restore"],
            "/usr/sbin/iptables-restore",
            Some("1.8.9 (legacy)")
        ));
        assert!(!w(
            &["iptables-legacy-restore"],
            "/usr/sbin/iptables-legacy-restore",
            None
        ));
        assert!(w(
            &["nft", "-f", "/etc/nftables.conf"],
            "/usr/sbin/nft",
            None
        ));
        assert!(!w(&["nft", "list", "ruleset"], "/usr/sbin/nft", None));
        assert!(w(
            &["xtables-nft-multi", "iptables-restore"],
            "/usr/sbin/xtables-nft-multi",
            None
        ));
        assert!(w(
            &["kube-proxy-helper"],
            "/usr/sbin/iptables-nft-restore",
            None
        ));
    }
}
