//! Reads a legacy iptables table from the kernel after each write to it, the way
//! `iptables-save` does (`IPT_SO_GET_INFO`, then `IPT_SO_GET_ENTRIES`, in the writer's network
//! namespace), so the analysis can say what the write changed. It never takes
//! `/run/xtables.lock`: the kernel serialises a read against a replace with the table's own
//! mutex, held for one copy of the table, as for `iptables-save`.
//!
//! Bounded: one worker thread; requests queued while it reads are coalesced per table (a
//! burst of writes is read once, after the last); a table over [`MAX_ENTRIES`] entries is
//! not parsed, and says so; chains whose rules did not change since the previous read of the
//! table are sent as digests only. Every skip says why, once per table.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::decode::xt_table::{self, TableInfo, IPT_GETINFO_LEN, IPT_GET_ENTRIES_HEAD};
use crate::event::{digest_rules, ChainState, Event, RuleTable, TableReplaceEvent};

/// Tables with more entries than this are not parsed (kube-proxy's largest run to ~100k
/// entries; a 30,000-rule table is ~56k entries, its read and diff measured by `cargo xtask
/// bench --only rules`; the analysis keeps each table's rules, ~10 MB for that one).
pub const MAX_ENTRIES: u32 = 150_000;
/// A burst of writes is over after this long without one (see `Worker::run`).
const QUIET: Duration = Duration::from_millis(50);
/// A burst is read this long after its first write at the latest.
const MAX_WAIT: Duration = Duration::from_secs(1);
/// `IPT_SO_GET_INFO`, `IPT_SO_GET_ENTRIES` (`SOL_IP`).
const IPT_SO_GET_INFO: libc::c_int = 64;
const IPT_SO_GET_ENTRIES: libc::c_int = 65;

/// (netns, table)
type Key = (u32, String);

struct Request {
    netns: u32,
    table: String,
    pid: u32,
    /// Only if this table was never read: a read to name the rules behind refusals, not
    /// after a write.
    if_unread: bool,
}

/// The worker's handle: requests in, tables out.
pub struct RuleReader {
    tx: Option<mpsc::Sender<Request>>,
    /// Namespaces whose filter table was asked for because of refusals.
    asked: HashSet<u32>,
    rx: mpsc::Receiver<Event>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl RuleReader {
    pub fn start() -> std::io::Result<Self> {
        let (tx, req_rx) = mpsc::channel::<Request>();
        let (ev_tx, rx) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("xtlock-rules".into())
            .spawn(move || Worker::default().run(&req_rx, &ev_tx))?;
        Ok(Self {
            tx: Some(tx),
            asked: HashSet::new(),
            rx,
            worker: Some(worker),
        })
    }

    /// A kernel event: a successful IPv4 table replace asks for that table to be read.
    pub fn on_event(&mut self, ev: &Event) {
        let Event::TableReplace(t) = ev else { return };
        if !is_ipv4_replace(t) {
            return;
        }
        let Some(table) = t.head.as_ref().map(|h| h.name()) else {
            return;
        };
        if let Some(tx) = &self.tx {
            // A worker gone (it panicked) only means no more diffs.
            let _ = tx.send(Request {
                netns: t.netns,
                table,
                pid: t.tgid,
                if_unread: false,
            });
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
                table: "filter".into(),
                pid: 0,
                if_unread: true,
            });
        }
    }

    /// The tables read since the last call.
    pub fn poll(&mut self, out: &mut Vec<Event>) {
        while let Ok(ev) = self.rx.try_recv() {
            out.push(ev);
        }
    }

    /// At the end: waits up to `timeout` for the reads asked for, then returns what came.
    pub fn finish(&mut self, out: &mut Vec<Event>, timeout: Duration) {
        // Closing the channel ends the worker once it has read what is queued.
        self.tx = None;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(ev) => out.push(ev),
                Err(_) => break,
            }
        }
        if let Some(w) = self.worker.take() {
            if w.is_finished() {
                let _ = w.join();
            }
        }
    }
}

fn is_ipv4_replace(t: &TableReplaceEvent) -> bool {
    !t.read
        && t.ret == 0
        && t.level == xtlock_common::SOL_IP
        && t.optname == xtlock_common::XT_SO_SET_REPLACE
}

#[derive(Default)]
struct Worker {
    /// Each table's chain digests at its last read.
    last: HashMap<Key, HashMap<String, u64>>,
    /// Tables whose skip was said already.
    said: HashSet<Key>,
    /// Open network namespaces by inode.
    netns: HashMap<u32, File>,
}

impl Worker {
    fn run(mut self, rx: &mpsc::Receiver<Request>, tx: &mpsc::Sender<Event>) {
        while let Ok(first) = rx.recv() {
            // A burst of writes (a restore per table, firewalld's dozens in a row) is read
            // once it is over: after QUIET without a write, or MAX_WAIT after its first, so
            // the reads do not queue on the table's mutex between the writes of a burst.
            let mut batch: Vec<Request> = vec![first];
            let since = Instant::now();
            while since.elapsed() < MAX_WAIT {
                match rx.recv_timeout(QUIET) {
                    Ok(r) => batch.push(r),
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            batch.extend(rx.try_iter());
            let mut seen = HashSet::new();
            let mut todo: Vec<Request> = Vec::new();
            for r in batch.into_iter().rev() {
                if seen.insert((r.netns, r.table.clone())) {
                    todo.push(r);
                }
            }
            for r in todo.into_iter().rev() {
                // In parts that fit the capture's records (a large table's first read).
                for part in self.read(&r).map(RuleTable::into_parts).unwrap_or_default() {
                    if tx.send(Event::RuleTable(Box::new(part))).is_err() {
                        return;
                    }
                }
            }
        }
    }

    fn read(&mut self, r: &Request) -> Option<RuleTable> {
        let key = (r.netns, r.table.clone());
        if r.if_unread && (self.last.contains_key(&key) || self.said.contains(&key)) {
            return None;
        }
        let mut t = RuleTable {
            ts_ns: 0,
            netns: r.netns,
            family: "ip".into(),
            table: r.table.clone(),
            after_pid: r.pid,
            skipped: String::new(),
            chains: Vec::new(),
            more: false,
        };
        let chains = self.enter(r).and_then(|()| read_table(&r.table));
        t.ts_ns = super::monotonic_ns();
        match chains {
            Ok(chains) => {
                let prev = self.last.remove(&key).unwrap_or_default();
                let mut now = HashMap::new();
                for c in chains {
                    let digest = digest_rules(&c.rules);
                    now.insert(c.name.clone(), digest);
                    let changed = prev.get(&c.name) != Some(&digest);
                    t.chains.push(ChainState {
                        name: c.name,
                        policy: c.policy,
                        digest,
                        rules: changed.then_some(c.rules),
                    });
                }
                self.last.insert(key.clone(), now);
                self.said.remove(&key);
                Some(t)
            }
            Err(why) => {
                // Said once per table until a read works again; the analysis forgets the
                // table's state (what changes meanwhile is not known).
                self.last.remove(&key);
                if !self.said.insert(key) {
                    return None;
                }
                tracing::debug!(netns = r.netns, table = %r.table, %why, "table not read");
                t.skipped = why;
                Some(t)
            }
        }
    }

    /// Moves this thread into the writer's network namespace.
    fn enter(&mut self, r: &Request) -> Result<(), String> {
        if r.netns == 0 {
            return Err("its network namespace is unknown (no kernel BTF)".into());
        }
        if !self.netns.contains_key(&r.netns) {
            let f = open_netns(r.netns, r.pid)
                .ok_or("no process left in its network namespace to enter it by")?;
            if self.netns.len() >= 256 {
                self.netns.clear();
            }
            self.netns.insert(r.netns, f);
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

/// An open handle on the network namespace with inode `ino`: the writer's (usually gone by
/// now: an iptables lives milliseconds), ours, one pinned by `ip netns` (`/run/netns`), or
/// any process's in it (a pod's pause container).
fn open_netns(ino: u32, pid: u32) -> Option<File> {
    use std::os::unix::fs::MetadataExt;
    let try_path = |p: &std::path::Path| -> Option<File> {
        let f = File::open(p).ok()?;
        (f.metadata().ok()?.ino() == u64::from(ino)).then_some(f)
    };
    let proc_ns = |p: &str| std::path::PathBuf::from(format!("/proc/{p}/ns/net"));
    if let Some(f) = try_path(&proc_ns(&pid.to_string())).or_else(|| try_path(&proc_ns("self"))) {
        return Some(f);
    }
    let pinned = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .find_map(|e| try_path(&e.path()));
    if pinned.is_some() {
        return pinned;
    }
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        .find_map(|p| try_path(&proc_ns(&p)))
}

/// One table of the current network namespace, parsed.
fn read_table(table: &str) -> Result<Vec<xt_table::Chain>, String> {
    // SAFETY: a plain socket call; the fd is owned by `sock` right after.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
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
        getsockopt(&sock, IPT_SO_GET_INFO, &mut info)
            .map_err(|e| format!("cannot read the table's size: {e} (needs CAP_NET_ADMIN)"))?;
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
        match getsockopt(&sock, IPT_SO_GET_ENTRIES, &mut buf) {
            Ok(()) => {
                return xt_table::parse_table(&info, &buf[IPT_GET_ENTRIES_HEAD..])
                    .map_err(|e| e.to_string())
            }
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
            Err(e) => return Err(format!("cannot read the table: {e}")),
        }
    }
    Err("the table kept changing while it was read".into())
}

fn getsockopt(sock: &impl AsRawFd, opt: libc::c_int, buf: &mut [u8]) -> std::io::Result<()> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf is valid for len bytes; the kernel writes at most that many.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_IP,
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
