//! What the live source adds for packet drops, besides the sampled drops of the ring buffer:
//! the kernel's exact per-CPU drop counters and conntrack's statistics, read every second
//! and turned into synthetic events (deltas), the drop-reason names once at the start, and the
//! kernel function of each drop location (from /proc/kallsyms) the first time it shows up.
//!
//! Conntrack counters are per network namespace: the host's is read from this process's
//! /proc; others (`--netns PATH`, `--all-netns`) through files opened from a short-lived
//! thread that joined the namespace with `setns`: a /proc/net or /proc/sys file opened there
//! keeps reading that namespace from any thread.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::{Read, Seek, SeekFrom},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use crate::decode::{
    ConntrackCounters, ConntrackStats, DropCount, DropCounts, Event, HoldDropCount,
};
use crate::probes::{DropTotals, Probes};

/// Most network namespaces whose conntrack counters are read.
pub const MAX_NETNS: usize = 512;
/// `--all-netns`: how often new namespaces are looked for (in polls, i.e. seconds).
const RESCAN_POLLS: u64 = 10;

#[derive(Debug, thiserror::Error)]
pub enum DropSourceError {
    #[error(
        "cannot use network namespace {path}: {why}; give a namespace file such as \
         /run/netns/NAME or /proc/PID/ns/net (needs root)"
    )]
    Netns { path: String, why: String },
}

/// Which namespaces' conntrack counters to read.
#[derive(Clone, Debug, Default)]
pub struct NetnsOptions {
    /// Namespace files (`/run/netns/NAME`, `/proc/PID/ns/net`), besides the host's.
    pub paths: Vec<PathBuf>,
    /// Every namespace found under /run/netns and /proc/*/ns/net, rescanned every 10 s.
    pub all: bool,
}

// ---------------------------------------------------------------------------------------
// /proc/kallsyms

/// Kernel text symbols, sorted by address, for naming drop locations.
#[derive(Debug, Default)]
pub struct Kallsyms {
    /// (address, start in `names`, length)
    syms: Vec<(u64, u32, u32)>,
    names: String,
}

impl Kallsyms {
    pub fn read() -> std::io::Result<Self> {
        Ok(Self::parse(&std::fs::read_to_string("/proc/kallsyms")?))
    }

    /// Parses `ADDR TYPE NAME [MODULE]` lines, keeping text symbols. All-zero addresses
    /// (`kptr_restrict`, not root) leave it empty.
    pub fn parse(text: &str) -> Self {
        let mut k = Kallsyms::default();
        for line in text.lines() {
            let mut w = line.split_ascii_whitespace();
            let (Some(a), Some(t), Some(name)) = (w.next(), w.next(), w.next()) else {
                continue;
            };
            if !matches!(t, "t" | "T" | "w" | "W") {
                continue;
            }
            let Ok(addr) = u64::from_str_radix(a, 16) else {
                continue;
            };
            if addr == 0 {
                continue;
            }
            let start = k.names.len() as u32;
            k.names.push_str(name);
            k.syms.push((addr, start, name.len() as u32));
        }
        k.syms.sort_unstable_by_key(|s| s.0);
        k
    }

    pub fn is_empty(&self) -> bool {
        self.syms.is_empty()
    }

    /// The function containing `addr`, and the offset into it.
    pub fn lookup(&self, addr: u64) -> Option<(&str, u64)> {
        let i = self.syms.partition_point(|s| s.0 <= addr).checked_sub(1)?;
        let (a, start, len) = self.syms[i];
        let name = self.names.get(start as usize..(start + len) as usize)?;
        Some((name, addr - a))
    }
}

// ---------------------------------------------------------------------------------------
// /proc/net/stat/nf_conntrack

/// Sums the per-CPU lines of `/proc/net/stat/nf_conntrack` (hex, columns named by the
/// header line, which changes between kernels). Returns the counters and `entries`.
pub fn parse_conntrack_stat(text: &str) -> Option<(ConntrackCounters, u64)> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next()?.split_ascii_whitespace().collect();
    let col = |name: &str| header.iter().position(|h| *h == name);
    let cols = [
        col("drop"),
        col("early_drop"),
        col("insert_failed"),
        col("invalid"),
        col("search_restart"),
        col("clash_resolve").or(col("clashres")),
        col("chaintoolong").or(col("chainlength")),
    ];
    let entries_col = col("entries");
    let mut sums = [0u64; 7];
    let mut entries = 0;
    let mut rows = 0;
    for line in lines {
        let vals: Vec<u64> = line
            .split_ascii_whitespace()
            .map(|v| u64::from_str_radix(v, 16))
            .collect::<Result<_, _>>()
            .ok()?;
        if vals.is_empty() {
            continue;
        }
        rows += 1;
        for (sum, c) in sums.iter_mut().zip(cols) {
            if let Some(v) = c.and_then(|c| vals.get(c)) {
                *sum = sum.saturating_add(*v);
            }
        }
        // Global, repeated on every line.
        if let Some(v) = entries_col.and_then(|c| vals.get(c)) {
            entries = *v;
        }
    }
    (rows > 0).then_some((
        ConntrackCounters {
            drop: sums[0],
            early_drop: sums[1],
            insert_failed: sums[2],
            invalid: sums[3],
            search_restart: sums[4],
            clash_resolve: sums[5],
            chaintoolong: sums[6],
        },
        entries,
    ))
}

fn reread(f: &mut File, buf: &mut String) -> std::io::Result<()> {
    buf.clear();
    f.seek(SeekFrom::Start(0))?;
    f.read_to_string(buf)?;
    Ok(())
}

/// Open files of one namespace's conntrack statistics.
struct ConntrackFiles {
    stat: File,
    count: Option<File>,
    max: Option<File>,
}

/// One watched namespace.
struct NetnsWatch {
    inode: u32,
    label: String,
    /// Where to join it (`None`: our own, the host's).
    path: Option<PathBuf>,
    files: Option<ConntrackFiles>,
    prev: Option<ConntrackCounters>,
    /// Reads failed (namespace gone): dropped at the next rescan.
    dead: bool,
}

fn open_conntrack_files(proc_net: &Path) -> std::io::Result<ConntrackFiles> {
    let stat = File::open(proc_net.join("stat/nf_conntrack"))?;
    let sys = Path::new("/proc/sys/net/netfilter");
    Ok(ConntrackFiles {
        stat,
        count: File::open(sys.join("nf_conntrack_count")).ok(),
        max: File::open(sys.join("nf_conntrack_max")).ok(),
    })
}

/// Joins the namespace at `path` in a new thread and opens the conntrack files there.
/// `Ok(None)`: the namespace has no conntrack (module not loaded).
fn open_in_netns(path: &Path) -> Result<Option<ConntrackFiles>, String> {
    let ns = std::sync::Arc::new(File::open(path).map_err(|e| e.to_string())?);
    super::netns::inside(&ns, || {
        match open_conntrack_files(Path::new("/proc/thread-self/net")) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    })
    .map_err(|e| e.to_string())
}

fn netns_inode(path: &Path) -> Result<u32, String> {
    let md = std::fs::metadata(path).map_err(|e| e.to_string())?;
    // nsfs inodes are 32-bit (the kernel's `ns.inum`).
    u32::try_from(md.ino()).map_err(|_| format!("inode {} is not a namespace inode", md.ino()))
}

/// Every network namespace with a file to join it by: /run/netns/* first, then one process
/// per namespace from /proc; and how many processes' namespaces could not be looked at
/// (another user's process, without CAP_SYS_PTRACE).
fn scan_namespaces() -> (Vec<(u32, PathBuf, String)>, Vec<u32>) {
    let mut denied = Vec::new();
    let mut out: Vec<(u32, PathBuf, String)> = Vec::new();
    let mut seen = HashSet::new();
    // The host's /run/netns, also from a container that shares the host's PID namespace
    // (through its init's root: no hostPath mount of /run needed); named as the host names it.
    let run_netns = crate::lockfiles::host_root()
        .map_or_else(|| PathBuf::from("/run/netns"), |h| h.path.join("run/netns"));
    if let Ok(rd) = std::fs::read_dir(&run_netns) {
        for e in rd.flatten() {
            let p = e.path();
            if let Ok(ino) = netns_inode(&p) {
                if seen.insert(ino) {
                    let label = Path::new("/run/netns")
                        .join(e.file_name())
                        .display()
                        .to_string();
                    out.push((ino, p, label));
                }
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            let p = PathBuf::from(format!("/proc/{pid}/ns/net"));
            match std::fs::metadata(&p) {
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                    denied.extend(pid.parse::<u32>().ok())
                }
                _ => {}
            }
            if let Ok(ino) = netns_inode(&p) {
                if seen.insert(ino) {
                    let label = format!("netns of pid {pid}");
                    out.push((ino, p, label));
                }
            }
        }
    }
    (out, denied)
}

// ---------------------------------------------------------------------------------------
// The poller

/// Reads counters every second and turns them into synthetic events.
pub struct DropPoller {
    prev_totals: HashMap<xtlock_common::DropKey, u64>,
    prev_overflow: u64,
    /// Per-hold drop counts at the last read, by hold start.
    prev_holds: HashMap<u64, u64>,
    last_ts: u64,
    symbols_sent: HashSet<u64>,
    kallsyms: Option<Kallsyms>,
    /// Reading and parsing /proc/kallsyms takes ~100 ms: done on a thread from the start, so
    /// the first drop of a storm does not stall the event loop while the ring buffer fills.
    kallsyms_loader: Option<std::thread::JoinHandle<std::io::Result<Kallsyms>>>,
    netns: Vec<NetnsWatch>,
    opts: NetnsOptions,
    polls: u64,
    buf: String,
    /// Conntrack is loaded somewhere: warn once when it is not.
    warned_no_conntrack: bool,
    /// `--all-netns` without CAP_SYS_ADMIN or CAP_SYS_PTRACE: said once.
    warned_setns: bool,
    warned_netns_denied: bool,
    counts_enabled: bool,
}

impl DropPoller {
    /// Opens the conntrack files of the host's namespace and of `opts`. An explicit
    /// namespace that cannot be joined is an error; a kernel without conntrack is not.
    pub fn new(
        opts: NetnsOptions,
        counts_enabled: bool,
        now_ns: u64,
    ) -> Result<Self, DropSourceError> {
        let mut p = DropPoller {
            prev_totals: HashMap::new(),
            prev_overflow: 0,
            prev_holds: HashMap::new(),
            last_ts: now_ns,
            symbols_sent: HashSet::new(),
            kallsyms: None,
            kallsyms_loader: std::thread::Builder::new()
                .name("xtlock-kallsyms".into())
                .spawn(Kallsyms::read)
                .map_err(|e| tracing::warn!(error = %e, "cannot start the kallsyms reader"))
                .ok(),
            netns: Vec::new(),
            opts: opts.clone(),
            polls: 0,
            buf: String::new(),
            warned_no_conntrack: false,
            warned_setns: false,
            warned_netns_denied: false,
            counts_enabled,
        };
        let host = netns_inode(Path::new("/proc/self/ns/net")).unwrap_or(0);
        p.netns.push(NetnsWatch {
            inode: host,
            label: "host".into(),
            path: None,
            files: open_conntrack_files(Path::new("/proc/self/net")).ok(),
            prev: None,
            dead: false,
        });
        for path in &opts.paths {
            let err = |why: String| DropSourceError::Netns {
                path: path.display().to_string(),
                why,
            };
            let inode = netns_inode(path).map_err(err)?;
            if p.netns.iter().any(|n| n.inode == inode) {
                continue;
            }
            let files = open_in_netns(path).map_err(err)?;
            p.netns.push(NetnsWatch {
                inode,
                label: path.display().to_string(),
                path: Some(path.clone()),
                files,
                prev: None,
                dead: false,
            });
        }
        if opts.all {
            p.rescan();
        }
        if p.netns.iter().all(|n| n.files.is_none()) {
            p.warned_no_conntrack = true;
            tracing::warn!(
                "conntrack statistics unavailable: /proc/net/stat/nf_conntrack does not exist \
                 (the nf_conntrack module is not loaded); drops are still counted, but \
                 \"conntrack table full\" cannot be told from a rule drop until it loads"
            );
        }
        // Baselines, so the first deltas cover only the time traced.
        let mut buf = std::mem::take(&mut p.buf);
        for n in &mut p.netns {
            n.prev = read_counters(n, &mut buf).map(|(c, _, _)| c);
        }
        p.buf = buf;
        Ok(p)
    }

    /// Namespaces whose conntrack counters are read: (inode, label, conntrack available).
    pub fn namespaces(&self) -> Vec<(u32, String, bool)> {
        self.netns
            .iter()
            .map(|n| (n.inode, n.label.clone(), n.files.is_some()))
            .collect()
    }

    /// The events to start with: the kernel's drop-reason names.
    pub fn start_events(&self, probes: &Probes, now_ns: u64) -> Vec<Event> {
        vec![Event::DropSetup {
            ts_ns: now_ns,
            has_reason: probes.has_drop_reasons,
            host_netns: self.netns.first().map_or(0, |n| n.inode),
            names: probes.reasons.to_pairs(),
        }]
    }

    fn rescan(&mut self) {
        self.netns.retain(|n| !n.dead);
        let (found, denied) = scan_namespaces();
        // Once each: what a missing capability costs, in the daemon's logs.
        if !denied.is_empty() && !self.warned_netns_denied {
            self.warned_netns_denied = true;
            let first = denied[0];
            let comm = std::fs::read_to_string(format!("/proc/{first}/comm")).unwrap_or_default();
            tracing::warn!(
                processes = denied.len(),
                first_pid = first,
                first_comm = comm.trim(),
                "cannot open the network namespaces of {} processes of other users \
                 (permission denied: opening them needs CAP_SYS_PTRACE): conntrack counters of \
                 namespaces only they are in are not read",
                denied.len()
            );
        }
        for (inode, path, label) in found {
            if self.netns.len() >= MAX_NETNS {
                tracing::warn!(
                    max = MAX_NETNS,
                    "too many network namespaces: conntrack counters of the rest are not read"
                );
                break;
            }
            if self.netns.iter().any(|n| n.inode == inode) {
                continue;
            }
            match open_in_netns(&path) {
                Ok(files) => self.netns.push(NetnsWatch {
                    inode,
                    label,
                    path: Some(path),
                    files,
                    prev: None,
                    dead: false,
                }),
                Err(e) if e.contains("setns") && !self.warned_setns => {
                    self.warned_setns = true;
                    tracing::warn!(
                        path = %path.display(),
                        error = %e,
                        "cannot join other network namespaces (joining one needs \
                         CAP_SYS_ADMIN): conntrack counters of pods' namespaces are not read"
                    );
                }
                // Raced with the namespace going away: nothing to read.
                Err(e) => tracing::debug!(path = %path.display(), error = %e, "netns not joined"),
            }
        }
    }

    /// One second's worth: conntrack deltas per namespace, names of new drop locations,
    /// then the drop count deltas, all stamped `now_ns`.
    pub fn poll(&mut self, probes: &Probes, now_ns: u64) -> Vec<Event> {
        self.polls += 1;
        if self.opts.all && self.polls.is_multiple_of(RESCAN_POLLS) {
            self.rescan();
        }
        let interval_ns = now_ns.saturating_sub(self.last_ts);
        self.last_ts = now_ns;
        // The drop counters first, conntrack's second: a packet conntrack refused is
        // counted by conntrack before it is freed, so every drop in these counts has its
        // conntrack increment in this read or an earlier one.
        let totals = if self.counts_enabled {
            match probes.drop_totals() {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the drop counters");
                    None
                }
            }
        } else {
            None
        };
        let mut out = Vec::new();
        let mut buf = std::mem::take(&mut self.buf);
        let reopen = self.polls.is_multiple_of(RESCAN_POLLS);
        for n in &mut self.netns {
            if n.files.is_none() && reopen && !n.dead {
                // The module may have been loaded since.
                n.files = match &n.path {
                    None => open_conntrack_files(Path::new("/proc/self/net")).ok(),
                    Some(p) => open_in_netns(p).ok().flatten(),
                };
                if n.files.is_some() {
                    tracing::info!(netns = %n.label, "conntrack statistics now available");
                }
            }
            let Some((now, count, max)) = read_counters(n, &mut buf) else {
                continue;
            };
            let Some(prev) = n.prev.replace(now) else {
                continue;
            };
            let deltas = now.saturating_sub(&prev);
            out.push(Event::Conntrack(Box::new(ConntrackStats {
                ts_ns: now_ns,
                interval_ns,
                netns: n.inode,
                deltas,
                count,
                max,
            })));
        }
        self.buf = buf;
        if let Some((totals, overflow)) = totals {
            // Per-hold counts change only when drops were counted.
            let any = totals
                .iter()
                .any(|(k, t)| self.prev_totals.get(k).is_none_or(|p| p != t));
            let holds = if any {
                probes.hold_drop_counts().unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "cannot read the per-hold drop counters");
                    Vec::new()
                })
            } else {
                Vec::new()
            };
            self.count_events(totals, overflow, holds, now_ns, interval_ns, &mut out);
        }
        out
    }

    fn count_events(
        &mut self,
        totals: DropTotals,
        overflow: u64,
        hold_totals: Vec<crate::probes::HoldDrops>,
        now_ns: u64,
        interval_ns: u64,
        out: &mut Vec<Event>,
    ) {
        let mut counts = Vec::new();
        for (k, total) in totals {
            let prev = self.prev_totals.insert(k, total).unwrap_or(0);
            let delta = total.saturating_sub(prev);
            if delta == 0 {
                continue;
            }
            if self.symbols_sent.insert(k.location) {
                if let Some(ev) = self.symbol(k.location, now_ns) {
                    out.push(ev);
                }
            }
            counts.push(DropCount {
                location: k.location,
                reason: k.reason,
                netns: k.netns,
                count: delta,
            });
        }
        let ovf = overflow.saturating_sub(self.prev_overflow);
        self.prev_overflow = overflow;
        // Only the holds whose count moved; the map of the last counts keeps just the holds
        // the kernel still has, so it stays as small as the kernel's.
        let mut holds = Vec::new();
        let mut seen = HashMap::with_capacity(hold_totals.len());
        for h in hold_totals {
            let (start_ns, count) = (h.start_ns, h.count);
            // The reasons' counts move only with the total.
            if self.prev_holds.get(&start_ns) != Some(&count) {
                holds.push(HoldDropCount {
                    start_ns,
                    count,
                    by_reason: h.by_reason,
                });
            }
            seen.insert(start_ns, count);
        }
        if !seen.is_empty() {
            self.prev_holds = seen;
        }
        if counts.is_empty() && ovf == 0 && holds.is_empty() {
            return;
        }
        counts.sort_unstable_by_key(|c| (c.netns, c.reason, c.location));
        out.push(Event::DropCounts(DropCounts {
            ts_ns: now_ns,
            interval_ns,
            counts,
            overflow: ovf,
            holds,
        }));
    }

    fn symbol(&mut self, addr: u64, now_ns: u64) -> Option<Event> {
        if let Some(loader) = self.kallsyms_loader.take() {
            // Usually done long before the first drop; else waits for the rest of it, once.
            let read = loader.join().unwrap_or_else(|_| {
                Err(std::io::Error::other("the kallsyms reader thread panicked"))
            });
            match read {
                Ok(k) if !k.is_empty() => self.kallsyms = Some(k),
                Ok(_) => tracing::warn!(
                    "/proc/kallsyms shows no addresses (kptr_restrict): drop locations are \
                     shown as addresses"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read /proc/kallsyms: drop locations are shown as addresses")
                }
            }
        }
        let (name, offset) = self.kallsyms.as_ref()?.lookup(addr)?;
        Some(Event::KernelSymbol {
            ts_ns: now_ns,
            addr,
            name: name.to_string(),
            offset,
        })
    }
}

/// Current counters, `nf_conntrack_count` and `nf_conntrack_max` of one namespace. A read
/// error marks the namespace dead (it went away).
fn read_counters(n: &mut NetnsWatch, buf: &mut String) -> Option<(ConntrackCounters, u64, u64)> {
    let files = n.files.as_mut()?;
    if let Err(e) = reread(&mut files.stat, buf) {
        tracing::debug!(netns = %n.label, error = %e, "conntrack statistics unreadable");
        n.dead = true;
        n.files = None;
        return None;
    }
    let (counters, entries) = parse_conntrack_stat(buf)?;
    let mut num = |f: &mut Option<File>| -> Option<u64> {
        reread(f.as_mut()?, buf).ok()?;
        buf.trim().parse().ok()
    };
    let count = num(&mut files.count).unwrap_or(entries);
    let max = num(&mut files.max).unwrap_or(0);
    Some((counters, count, max))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT_6_18: &str = "entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
00000005  00000001 00000000 00000000 00000010 00000000 00000000 00000000 00000000 00000002 0000000a 00000003 00000000  00000000 00000000 00000000 00000004
00000005  00000000 00000000 00000000 00000001 00000000 00000000 00000000 00000000 00000001 00000100 00000000 00000000  00000000 00000000 00000000 00000000
";

    #[test]
    fn conntrack_stat_sums_cpus_by_column_name() {
        let (c, entries) = parse_conntrack_stat(STAT_6_18).unwrap();
        assert_eq!(entries, 5);
        assert_eq!(c.drop, 0x10a);
        assert_eq!(c.insert_failed, 3);
        assert_eq!(c.early_drop, 3);
        assert_eq!(c.invalid, 0x11);
        assert_eq!(c.search_restart, 4);
        assert_eq!(c.clash_resolve, 1);
        assert!(parse_conntrack_stat("").is_none());
        assert!(parse_conntrack_stat("entries drop\nzz 1\n").is_none());
        // Another column order (older kernel): names decide.
        let (c, _) =
            parse_conntrack_stat("entries drop insert_failed\n00000001 00000002 00000003\n")
                .unwrap();
        assert_eq!((c.drop, c.insert_failed), (2, 3));
    }

    #[test]
    fn kallsyms_lookup() {
        let k = Kallsyms::parse(
            "ffffffff81000000 T _stext\n\
             ffffffff81a00000 T nf_hook_slow\n\
             ffffffff81a00200 t nf_hook_slow_list\n\
             ffffffff81b00000 D some_data\n\
             ffffffffc0000000 t veth_xmit\t[veth]\n\
             garbage\n",
        );
        assert_eq!(k.lookup(0xffffffff81a0009c), Some(("nf_hook_slow", 0x9c)));
        assert_eq!(k.lookup(0xffffffff81a00200), Some(("nf_hook_slow_list", 0)));
        assert_eq!(k.lookup(0xffffffffc0000010), Some(("veth_xmit", 0x10)));
        assert_eq!(k.lookup(0x1000), None);
        let hidden =
            Kallsyms::parse("0000000000000000 T _stext\n0000000000000000 T nf_hook_slow\n");
        assert!(hidden.is_empty());
    }
}
