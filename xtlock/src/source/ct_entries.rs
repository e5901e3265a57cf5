//! The conntrack entries still DNATed to an address gone from this node: while an address
//! the rtnetlink watcher said gone (`source/addrs.rs`) stays gone, a worker dumps, every
//! [`PERIOD`], the entries whose reply comes from it (ctnetlink, filtered by the kernel on
//! 5.9+, else here), and hands them over as [`CtEntries`] events. The analysis tells from
//! them the connections sent to a dead endpoint that nothing answered, and the UDP flows that
//! conntrack keeps steering to it after the rules stopped (kubernetes#125467). Observed only,
//! never deleted: the SRE decides.
//!
//! Bounded: at most [`MAX_WATCHED`] addresses, each for at most [`WATCH`] after it went, at
//! most [`MAX_LISTED`] entries listed per read (the rest counted in `more`). Costs nothing
//! while no address is gone.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::decode::ct_entry::{self, CtMsg, IPS_DST_NAT};
use crate::event::{CtEntries, Event};

/// How often the entries of a gone address are read.
pub const PERIOD: Duration = Duration::from_secs(1);
/// How long after it went an address is followed (UDP entries live 30 s unanswered, 120 s
/// once they saw a reply, and are renewed by every packet: long enough to say they stay).
pub const WATCH: Duration = Duration::from_secs(300);
/// Addresses followed at once; past it, the oldest is dropped.
pub const MAX_WATCHED: usize = 64;
/// Entries listed per address and read.
pub const MAX_LISTED: usize = 1024;
/// How long one dump may wait for the kernel's next answer.
const RECV_TIMEOUT: Duration = Duration::from_secs(2);

enum Cmd {
    Gone(IpAddr),
    Back(IpAddr),
}

/// The live handle: commands in, entries out.
pub struct CtWatch {
    tx: mpsc::SyncSender<Cmd>,
    rx: mpsc::Receiver<Event>,
}

impl CtWatch {
    /// Opens a netfilter netlink socket here (so a failure is said at once), then reads in a
    /// thread of its own.
    pub fn start(netns: u32) -> std::io::Result<Self> {
        let sock = open_socket()?;
        let (tx, cmds) = mpsc::sync_channel(4096);
        let (events, rx) = mpsc::sync_channel(1024);
        let mut w = Worker {
            sock,
            netns,
            cmds,
            events,
            watched: HashMap::new(),
            seq: 0,
            filter: true,
            buf: Vec::with_capacity(1 << 16),
        };
        std::thread::Builder::new()
            .name("xtlock-ct".into())
            .spawn(move || w.run())?;
        Ok(CtWatch { tx, rx })
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
        out.extend(self.rx.try_iter());
    }
}

struct Watched {
    since: Instant,
    /// The last read listed entries (then an empty read is said once, as their end).
    listed: bool,
}

struct Worker {
    sock: netlink_sys::Socket,
    netns: u32,
    cmds: mpsc::Receiver<Cmd>,
    events: mpsc::SyncSender<Event>,
    watched: HashMap<IpAddr, Watched>,
    seq: u32,
    /// The kernel filters by the reply's source (5.9+); off once it refused.
    filter: bool,
    buf: Vec<u8>,
}

impl Worker {
    fn run(&mut self) {
        let mut next = Instant::now() + PERIOD;
        loop {
            let wait = next.saturating_duration_since(Instant::now());
            match self.cmds.recv_timeout(wait) {
                Ok(Cmd::Gone(a)) => {
                    if !self.watched.contains_key(&a) && self.watched.len() >= MAX_WATCHED {
                        if let Some(oldest) = self
                            .watched
                            .iter()
                            .min_by_key(|(_, w)| w.since)
                            .map(|(a, _)| *a)
                        {
                            self.watched.remove(&oldest);
                        }
                    }
                    self.watched.entry(a).or_insert(Watched {
                        since: Instant::now(),
                        listed: false,
                    });
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
            next = Instant::now() + PERIOD;
            self.watched.retain(|_, w| w.since.elapsed() < WATCH);
            let addrs: Vec<IpAddr> = self.watched.keys().copied().collect();
            for addr in addrs {
                match self.read(addr) {
                    Ok((entries, more)) => {
                        let Some(w) = self.watched.get_mut(&addr) else {
                            continue;
                        };
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
        }
    }

    /// The entries DNATed to `addr` (their reply comes from it), at most [`MAX_LISTED`], and
    /// how many more.
    fn read(&mut self, addr: IpAddr) -> Result<(Vec<crate::event::CtEntry>, u32), String> {
        loop {
            self.seq = self.seq.wrapping_add(1);
            self.sock
                .send(&ct_entry::dump_request(self.seq, addr, self.filter), 0)
                .map_err(|e| format!("cannot ask for the conntrack entries: {e}"))?;
            let (mut entries, mut more) = (Vec::new(), 0u32);
            let mut refused = None;
            'dump: loop {
                self.buf.clear();
                self.sock.recv(&mut self.buf, 0).map_err(|e| {
                    format!("cannot read the conntrack dump: {e} (needs CAP_NET_ADMIN)")
                })?;
                for m in ct_entry::messages(&self.buf)? {
                    match m {
                        CtMsg::Entry(e) => {
                            if e.reply_src.ip() != addr || e.status & IPS_DST_NAT == 0 {
                                continue;
                            }
                            if entries.len() < MAX_LISTED {
                                entries.push(e);
                            } else {
                                more = more.saturating_add(1);
                            }
                        }
                        CtMsg::Done => break 'dump,
                        CtMsg::Error(errno) => {
                            refused = Some(errno);
                            break 'dump;
                        }
                        CtMsg::Other => {}
                    }
                }
            }
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

fn open_socket() -> std::io::Result<netlink_sys::Socket> {
    use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    super::addrs::set_recv_timeout(&sock, RECV_TIMEOUT)?;
    Ok(sock)
}
