//! The conntrack entries still DNATed to an address gone from this node: while an address
//! the rtnetlink watcher said gone (`source/addrs.rs`) stays gone, a worker dumps, every
//! [`PERIOD`], the entries whose reply comes from it (ctnetlink, filtered by the kernel on
//! 5.9+, else here), and hands them over as [`CtEntries`] events. The analysis tells from
//! them the connections sent to a dead endpoint that nothing answered, and the UDP flows that
//! conntrack keeps steering to it after the rules stopped (kubernetes#125467). Observed only,
//! never deleted: the SRE decides.
//!
//! Endpoints anywhere (on other nodes too) that stop answering: every [`PERIOD`] the worker
//! also dumps the DNATed entries that never saw a reply (the kernel filters by status,
//! 5.19+), and an endpoint with [`UNANSWERED_MIN`] TCP connections whose SYN went
//! [`UNANSWERED_AFTER`] without a reply, and that answered no new connection by the next
//! scan, is said unanswered (`AddrWhy::Unanswered`, stamped when a scan first saw the oldest
//! of them), then followed as a gone address is, until a connection sent to it later is
//! answered (`AddrWhy::Answering`). One that answers others (a NetworkPolicy dropping one
//! client) is not: its unanswered connections are then not counted again.
//!
//! Bounded: at most [`MAX_WATCHED`] addresses, each for at most [`WATCH`] after it went, at
//! most [`MAX_LISTED`] entries listed per read (the rest counted in `more`), at most
//! [`MAX_PENDING`] unanswered connections remembered. While no address is gone, one filtered
//! dump a second, of the connections nothing answered yet. Every dump walks the whole table
//! in the kernel: on a big one (100,000 entries: ~43 ms) the rounds space out so that they
//! take at most 2 % of a CPU.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::netlink::{NlError, NlSocket};
use super::worker::{Out, Worker as Thread};
use crate::decode::ct_entry::{self, IPS_DST_NAT, IPS_SEEN_REPLY, TCP_CONNTRACK_SYN_SENT};
use crate::event::{AddrPresence, AddrWhy, CtEntries, CtEntry, Event};

/// How often the entries of a gone address are read.
pub const PERIOD: Duration = Duration::from_secs(1);
/// How long after it went an address is followed (UDP entries live 30 s unanswered, 120 s
/// once they saw a reply, and are renewed by every packet: long enough to say they stay).
pub const WATCH: Duration = Duration::from_secs(300);
/// Addresses followed at once; past it, the oldest is dropped.
pub const MAX_WATCHED: usize = 64;
/// Entries listed per address and read.
pub const MAX_LISTED: usize = 1024;
/// A DNATed TCP connection whose SYN went this long without a reply is unanswered: the
/// client's first retransmission (1 s) went unanswered too.
pub const UNANSWERED_AFTER: Duration = Duration::from_secs(2);
/// Unanswered connections that make an endpoint unanswered (one lost SYN is not a dead pod).
pub const UNANSWERED_MIN: usize = 2;
/// Unanswered connections remembered between scans.
pub const MAX_PENDING: usize = 65_536;
/// A round of dumps takes at most 1 / BUDGET of the time between rounds.
const BUDGET: u32 = 50;
/// How long one dump may wait for the kernel's next answer.
const RECV_TIMEOUT: Duration = Duration::from_secs(2);

enum Cmd {
    Gone(IpAddr),
    Back(IpAddr),
}

/// The live handle: commands in, entries out. Dropping it closes the commands first, then
/// stops and joins the worker.
pub struct CtWatch {
    tx: mpsc::SyncSender<Cmd>,
    thread: Thread<Event>,
}

impl CtWatch {
    /// Opens a netfilter netlink socket here (so a failure is said at once), then reads in a
    /// thread of its own.
    pub fn start(netns: u32) -> std::io::Result<Self> {
        Self::start_in(netns, None)
    }

    /// The same for namespace `netns` through its handle `ns`, the socket made inside it.
    pub fn start_in(
        netns: u32,
        ns: Option<std::sync::Arc<std::fs::File>>,
    ) -> std::io::Result<Self> {
        use netlink_sys::protocols::NETLINK_NETFILTER;
        let sock = NlSocket::open_in(NETLINK_NETFILTER, RECV_TIMEOUT, ns.as_ref())?;
        let (tx, cmds) = mpsc::sync_channel(4096);
        let thread = Thread::spawn("xtlock-ct", 1024, move |events: Out<Event>| {
            Worker {
                sock: sock.stop_with(events.stop.clone()),
                netns,
                cmds,
                events,
                watched: HashMap::new(),
                filter: true,
                scan: true,
                pending: HashMap::new(),
                probation: HashMap::new(),
                excused: HashSet::new(),
            }
            .run()
        })?;
        Ok(CtWatch { tx, thread })
    }

    /// An address event: gone starts following it, back stops.
    pub fn on_event(&mut self, ev: &Event) {
        let Event::Addr(a) = ev else { return };
        let cmd = if a.why.present() {
            Cmd::Back(a.addr)
        } else {
            Cmd::Gone(a.addr)
        };
        // A full queue only loses following that address.
        let _ = self.tx.try_send(cmd);
    }

    /// The reads made since the last call.
    pub fn poll(&mut self, out: &mut Vec<Event>) {
        self.thread.poll(out);
    }
}

struct Watched {
    since: Instant,
    /// The last read listed entries (then an empty read is said once, as their end).
    listed: bool,
    why: Follow,
}

/// Why an address is followed.
enum Follow {
    /// rtnetlink said it gone.
    Gone,
    /// Its connections went unanswered: the entries to it when it was said so, so that a
    /// later connection's reply says it answers again.
    Unanswered(HashSet<u32>),
}

struct Worker {
    sock: NlSocket,
    netns: u32,
    cmds: mpsc::Receiver<Cmd>,
    events: Out<Event>,
    watched: HashMap<IpAddr, Watched>,
    /// The kernel filters by the reply's source (5.9+); off once it refused.
    filter: bool,
    /// The unanswered scan; off once the kernel showed it does not filter by status.
    scan: bool,
    /// Unanswered DNATed TCP connections by the kernel's id: their endpoint and when a scan
    /// first saw them (event time).
    pending: HashMap<u32, (IpAddr, u64)>,
    /// Endpoints with enough unanswered connections at the last scan, and the answered
    /// entries to them then. One is said unanswered only if no new connection to it was
    /// answered by the next scan: an endpoint that answers others is not dead (a
    /// NetworkPolicy that drops one client, a full accept queue).
    probation: HashMap<IpAddr, HashSet<u32>>,
    /// Unanswered connections to an endpoint seen answering others: not counted again.
    excused: HashSet<u32>,
}

impl Worker {
    fn run(&mut self) {
        let mut next = Instant::now() + PERIOD;
        loop {
            let wait = next.saturating_duration_since(Instant::now());
            match self.cmds.recv_timeout(wait) {
                Ok(Cmd::Gone(a)) => {
                    self.watch(a, Follow::Gone);
                    continue;
                }
                Ok(Cmd::Back(a)) => {
                    self.watched.remove(&a);
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                // The live source is gone: so is this.
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            let round = Instant::now();
            self.watched.retain(|_, w| w.since.elapsed() < WATCH);
            if self.scan {
                self.scan_unanswered();
            }
            let addrs: Vec<IpAddr> = self.watched.keys().copied().collect();
            for addr in addrs {
                match self.read(addr) {
                    Ok((entries, more)) => {
                        let Some(w) = self.watched.get_mut(&addr) else {
                            continue;
                        };
                        if let Follow::Unanswered(known) = &w.why {
                            if answered_again(known, &entries) {
                                self.watched.remove(&addr);
                                self.excuse(addr);
                                self.say(addr, AddrWhy::Answering, super::monotonic_ns());
                                continue;
                            }
                        }
                        let listed = !entries.is_empty() || more > 0;
                        if !listed && !w.listed {
                            continue;
                        }
                        w.listed = listed;
                        let ev = Event::CtEntries(Box::new(CtEntries {
                            ts_ns: super::monotonic_ns(),
                            netns: self.netns,
                            addr,
                            entries,
                            more,
                        }));
                        if self.events.try_send(ev).is_err() {
                            tracing::debug!(%addr, "conntrack entries not handed over: queue full");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "cannot read conntrack entries: connections to dead endpoints are not counted");
                        self.watched.clear();
                    }
                }
            }
            // Each dump walks the whole table in the kernel (~0.4 ms per 1,000 entries
            // here): on a big table the rounds space out to keep them under 2 % of a CPU.
            next = Instant::now() + PERIOD.max(round.elapsed() * BUDGET);
        }
    }

    /// Follows `addr` (dropping the oldest past [`MAX_WATCHED`]).
    fn watch(&mut self, addr: IpAddr, why: Follow) {
        if !self.watched.contains_key(&addr) && self.watched.len() >= MAX_WATCHED {
            if let Some(oldest) = self
                .watched
                .iter()
                .min_by_key(|(_, w)| w.since)
                .map(|(a, _)| *a)
            {
                self.watched.remove(&oldest);
            }
        }
        self.watched.entry(addr).or_insert(Watched {
            since: Instant::now(),
            listed: false,
            why,
        });
    }

    /// An address said unanswered or answering again, as the rtnetlink watcher says gone
    /// and back.
    fn say(&mut self, addr: IpAddr, why: AddrWhy, ts_ns: u64) {
        let ev = Event::Addr(Box::new(AddrPresence {
            ts_ns,
            netns: self.netns,
            addr,
            why,
            link: String::new(),
            live: true,
        }));
        if self.events.try_send(ev).is_err() {
            tracing::debug!(%addr, "unanswered endpoint not handed over: queue full");
        }
    }

    /// One dump of the DNATed connections nothing answered yet; endpoints with enough of
    /// them unanswered long enough are said so and followed.
    fn scan_unanswered(&mut self) {
        // Asking a node without conntrack would load its modules (nfnetlink asks for the
        // subsystem): nothing to scan there anyway.
        if !std::path::Path::new("/sys/module/nf_conntrack").exists() {
            return;
        }
        let now = super::monotonic_ns();
        let request = ct_entry::unanswered_request(self.sock.next_seq());
        let mut unfiltered = false;
        let mut seen = HashSet::new();
        let (pending, excused) = (&mut self.pending, &self.excused);
        let done = dump(&mut self.sock, &request, |e| {
            if e.status & (IPS_DST_NAT | IPS_SEEN_REPLY) != IPS_DST_NAT {
                unfiltered = true;
                return;
            }
            if e.proto != 6 || e.tcp_state != TCP_CONNTRACK_SYN_SENT {
                return;
            }
            seen.insert(e.id);
            if !excused.contains(&e.id) && pending.len() < MAX_PENDING {
                pending.entry(e.id).or_insert((e.reply_src.ip(), now));
            }
        });
        match done {
            Ok(None) | Ok(Some(libc::ENOENT)) => {}
            Ok(Some(errno)) => {
                return self.stop_scan(&format!(
                    "the kernel refused the dump: {}",
                    std::io::Error::from_raw_os_error(errno)
                ))
            }
            Err(e) => return self.stop_scan(&e),
        }
        if unfiltered {
            return self.stop_scan(
                "this kernel does not filter conntrack dumps by status (Linux 5.19+), and reading \
                 every entry each second costs too much",
            );
        }
        self.pending.retain(|id, _| seen.contains(id));
        self.excused.retain(|id| seen.contains(id));
        let after = UNANSWERED_AFTER.as_nanos() as u64;
        let mut by_endpoint: HashMap<IpAddr, (usize, u64)> = HashMap::new();
        for (ip, first) in self.pending.values() {
            if now.saturating_sub(*first) >= after {
                let e = by_endpoint.entry(*ip).or_insert((0, u64::MAX));
                e.0 += 1;
                e.1 = e.1.min(*first);
            }
        }
        let candidates: Vec<(IpAddr, u64)> = by_endpoint
            .into_iter()
            .filter(|(ip, (n, _))| *n >= UNANSWERED_MIN && !self.watched.contains_key(ip))
            .map(|(ip, (_, since))| (ip, since))
            .collect();
        self.probation
            .retain(|ip, _| candidates.iter().any(|(c, _)| c == ip));
        for (ip, since) in candidates {
            let entries = match self.read(ip) {
                Ok((entries, _)) => entries,
                Err(e) => {
                    tracing::debug!(%ip, error = %e, "cannot read an unanswered endpoint's entries");
                    continue;
                }
            };
            let answered: HashSet<u32> = entries
                .iter()
                .filter(|e| e.replied())
                .map(|e| e.id)
                .collect();
            match self.probation.remove(&ip) {
                None => {
                    self.probation.insert(ip, answered);
                }
                // It answered another connection meanwhile: not dead.
                Some(before) if answered.iter().any(|id| !before.contains(id)) => {
                    self.excuse(ip);
                }
                Some(_) => {
                    self.watch(
                        ip,
                        Follow::Unanswered(entries.iter().map(|e| e.id).collect()),
                    );
                    self.say(ip, AddrWhy::Unanswered, since);
                }
            }
        }
    }

    /// `ip` answers: its unanswered connections so far are not counted again.
    fn excuse(&mut self, ip: IpAddr) {
        for (id, (to, _)) in &self.pending {
            if *to == ip && self.excused.len() < MAX_PENDING {
                self.excused.insert(*id);
            }
        }
        self.pending.retain(|_, (to, _)| *to != ip);
    }

    fn stop_scan(&mut self, why: &str) {
        tracing::warn!(
            why,
            "endpoints that stop answering (on other nodes too) are not followed; those gone \
             from this node still are"
        );
        self.scan = false;
        self.pending.clear();
    }

    /// The entries DNATed to `addr` (their reply comes from it), at most [`MAX_LISTED`], and
    /// how many more.
    fn read(&mut self, addr: IpAddr) -> Result<(Vec<CtEntry>, u32), String> {
        loop {
            let request = ct_entry::dump_request(self.sock.next_seq(), addr, self.filter);
            let (mut entries, mut more) = (Vec::new(), 0u32);
            let refused = dump(&mut self.sock, &request, |e| {
                if e.reply_src.ip() != addr || e.status & IPS_DST_NAT == 0 {
                    return;
                }
                if entries.len() < MAX_LISTED {
                    entries.push(e);
                } else {
                    more = more.saturating_add(1);
                }
            })?;
            match refused {
                None => return Ok((entries, more)),
                // No conntrack in this namespace (the module not loaded): nothing to list.
                Some(libc::ENOENT) => return Ok((Vec::new(), 0)),
                // A kernel before dump filters: every entry, filtered here.
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) if self.filter => {
                    tracing::debug!("conntrack dump filters unsupported: filtering in xtlock");
                    self.filter = false;
                }
                Some(errno) => {
                    return Err(format!(
                        "the kernel refused the conntrack dump: {}",
                        std::io::Error::from_raw_os_error(errno)
                    ))
                }
            }
        }
    }
}

/// Sends `request` and hands every entry of the answer to `each`; the kernel's refusal as
/// its errno.
fn dump(
    sock: &mut NlSocket,
    request: &[u8],
    mut each: impl FnMut(CtEntry),
) -> Result<Option<i32>, String> {
    let r = sock.exchange(request, |m| {
        if let Some(e) = ct_entry::entry(&m) {
            each(e);
        }
        Ok::<(), std::convert::Infallible>(())
    });
    match r {
        Ok(()) => Ok(None),
        Err(NlError::Refused(errno)) => Ok(Some(errno)),
        Err(e) => Err(format!("the conntrack dump: {e}")),
    }
}

/// A connection sent to an unanswered endpoint after it was said so was answered (`known`:
/// the entries to it then).
fn answered_again(known: &HashSet<u32>, entries: &[CtEntry]) -> bool {
    entries
        .iter()
        .any(|e| e.replied() && !known.contains(&e.id))
}
