//! The socket side of [`super`]: rtnetlink messages parsed into [`Msg`]s, the dumps, and the
//! worker thread that follows the notifications.

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use netlink_packet_core::{
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkMessage},
    neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType},
    AddressFamily, RouteNetlinkMessage,
};

use super::{AddrState, Mac, Msg, CHANNEL, MAX_ENTRIES};
use crate::event::{AddrPresence, Event};

/// How often the worker looks whether it should stop, while no notification comes.
const RECV_TIMEOUT: Duration = Duration::from_millis(500);
/// Dumps tried in a row when overruns keep interrupting them.
const DUMP_TRIES: usize = 5;
/// The socket's receive buffer: a burst of pod deletions is a few hundred messages.
const RCVBUF: libc::c_int = 4 << 20;
const RT_TABLE_MAIN: u32 = RouteHeader::RT_TABLE_MAIN as u32;

/// The parts of a route message the state needs; `None` for anything but a host route of
/// the main table with an output interface.
pub(super) fn host_route(r: &RouteMessage) -> Option<(IpAddr, u32)> {
    let h = &r.header;
    let mut table = u32::from(h.table);
    let (mut dst, mut oif) = (None, None);
    for a in &r.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(RouteAddress::Inet(v)) => dst = Some(IpAddr::V4(*v)),
            RouteAttribute::Destination(RouteAddress::Inet6(v)) => dst = Some(IpAddr::V6(*v)),
            RouteAttribute::Oif(o) => oif = Some(*o),
            _ => {}
        }
    }
    let dst = dst?;
    let host = if dst.is_ipv4() { 32 } else { 128 };
    (table == RT_TABLE_MAIN && h.kind == RouteType::Unicast && h.destination_prefix_length == host)
        .then_some((dst, oif?))
}

pub(super) fn mac_of(b: &[u8]) -> Option<Mac> {
    b.try_into().ok()
}

/// The [`Msg`] of a parsed rtnetlink message, if it is one the state follows.
pub fn to_msg(m: RouteNetlinkMessage) -> Option<Msg> {
    use RouteNetlinkMessage as R;
    Some(match m {
        R::NewLink(l) => {
            let (index, name) = link_parts(&l);
            Msg::Link { index, name }
        }
        R::DelLink(l) => {
            let (index, name) = link_parts(&l);
            Msg::LinkDeleted { index, name }
        }
        R::NewNeighbour(n) => neigh(&n, false)?,
        R::DelNeighbour(n) => neigh(&n, true)?,
        R::NewRoute(r) => {
            let (dst, oif) = host_route(&r)?;
            Msg::Route { dst, oif }
        }
        R::DelRoute(r) => {
            let (dst, oif) = host_route(&r)?;
            Msg::RouteDeleted { dst, oif }
        }
        R::NewAddress(a) => {
            let (link, addr) = local_addr(&a)?;
            Msg::Addr { link, addr }
        }
        R::DelAddress(a) => {
            let (link, addr) = local_addr(&a)?;
            Msg::AddrDeleted { link, addr }
        }
        _ => return None,
    })
}

pub(super) fn link_parts(l: &LinkMessage) -> (u32, String) {
    let name = l.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    });
    (l.header.index, name.unwrap_or_default())
}

pub(super) fn neigh(n: &NeighbourMessage, deleted: bool) -> Option<Msg> {
    let h = &n.header;
    let mac = n.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::LinkLayerAddress(b) => mac_of(b),
        _ => None,
    });
    if h.family == AddressFamily::Bridge {
        // An FDB entry of a bridge port (NDA_MASTER: the bridge); others (vxlan's) are not
        // where a pod lives.
        let bridge = n.attributes.iter().find_map(|a| match a {
            NeighbourAttribute::Controller(b) => Some(*b),
            _ => None,
        })?;
        let (mac, port) = (mac?, h.ifindex);
        return Some(match deleted {
            false => Msg::Fdb { bridge, mac, port },
            true => Msg::FdbDeleted { bridge, mac, port },
        });
    }
    let addr = n.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(v)) => Some(IpAddr::V4(*v)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(v)) => Some(IpAddr::V6(*v)),
        _ => None,
    })?;
    let link = h.ifindex;
    Some(match deleted {
        false => Msg::Neigh {
            link,
            addr,
            mac,
            state: u16::from(h.state),
        },
        true => Msg::NeighDeleted { link, addr },
    })
}

/// A local address (`IFA_LOCAL`, else `IFA_ADDRESS`: the peer's on a point-to-point link).
pub(super) fn local_addr(a: &AddressMessage) -> Option<(u32, IpAddr)> {
    let local = a.attributes.iter().find_map(|x| match x {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let addr = local.or_else(|| {
        a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })?;
    Some((a.header.index, addr))
}

pub(super) const RTM_NEWLINK: u16 = libc::RTM_NEWLINK;
pub(super) const RTM_DELLINK: u16 = libc::RTM_DELLINK;
/// `sizeof(struct ifinfomsg)`.
pub(super) const IFINFOMSG_LEN: usize = 16;
pub(super) const IFLA_IFNAME: u16 = 3;

/// What one message read says.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Read {
    Msg(Msg),
    /// The dump with this sequence number is over (`error`: the kernel refused it).
    DumpEnd {
        seq: u32,
        error: Option<i32>,
    },
}

/// The messages of one datagram; `undecodable` counts those that could not be parsed.
pub(super) fn parse_datagram(buf: &[u8], undecodable: &mut u64) -> Vec<Read> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let Ok(nb) = NetlinkBuffer::new_checked(&buf[at..]) else {
            *undecodable += 1;
            break;
        };
        let len = nb.length() as usize;
        let (kind, seq) = (nb.message_type(), nb.sequence_number());
        let bytes = &buf[at..at + len];
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(bytes) {
            Ok(m) => match m.payload {
                NetlinkPayload::Done(_) => out.push(Read::DumpEnd { seq, error: None }),
                NetlinkPayload::Error(e) => out.push(Read::DumpEnd {
                    seq,
                    error: e.code.map(|c| c.get()),
                }),
                NetlinkPayload::InnerMessage(i) => out.extend(to_msg(i).map(Read::Msg)),
                _ => {}
            },
            // A link is needed whatever its other attributes say: its index and name by hand.
            Err(_) => match link_by_hand(kind, nb.payload()) {
                Some(m) => out.push(Read::Msg(m)),
                None => *undecodable += 1,
            },
        }
        // NLMSG_ALIGN; a zero length would not advance.
        at += (len.max(1) + 3) & !3;
    }
    out
}

pub(super) fn link_by_hand(kind: u16, payload: &[u8]) -> Option<Msg> {
    if kind != RTM_NEWLINK && kind != RTM_DELLINK {
        return None;
    }
    let index = u32::from_ne_bytes(payload.get(4..8)?.try_into().ok()?);
    let name = netlink_packet_core::NlasIterator::new(payload.get(IFINFOMSG_LEN..)?)
        .filter_map(Result::ok)
        .find(|a| a.kind() == IFLA_IFNAME)
        .map(|a| {
            let v = a.value();
            let v = v.split(|&b| b == 0).next().unwrap_or(v);
            String::from_utf8_lossy(v).into_owned()
        })
        .unwrap_or_default();
    Some(match kind {
        RTM_NEWLINK => Msg::Link { index, name },
        _ => Msg::LinkDeleted { index, name },
    })
}

/// The dump requests, in the order the state needs them: links first (names, liveness), then
/// the FDB (ports of MACs), then neighbours, routes and addresses.
pub(super) fn dump_requests() -> Vec<RouteNetlinkMessage> {
    let neigh = |family| {
        let mut n = NeighbourMessage::default();
        n.header.family = family;
        RouteNetlinkMessage::GetNeighbour(n)
    };
    let route = |family| {
        let mut r = RouteMessage::default();
        r.header.address_family = family;
        RouteNetlinkMessage::GetRoute(r)
    };
    let addr = |family| {
        let mut a = AddressMessage::default();
        a.header.family = family;
        RouteNetlinkMessage::GetAddress(a)
    };
    vec![
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        neigh(AddressFamily::Bridge),
        neigh(AddressFamily::Inet),
        neigh(AddressFamily::Inet6),
        route(AddressFamily::Inet),
        route(AddressFamily::Inet6),
        addr(AddressFamily::Inet),
        addr(AddressFamily::Inet6),
    ]
}

pub(super) fn request_bytes(m: RouteNetlinkMessage, seq: u32) -> Vec<u8> {
    let mut h = NetlinkHeader::default();
    h.flags = NLM_F_REQUEST | NLM_F_DUMP;
    h.sequence_number = seq;
    let mut req = NetlinkMessage::new(h, NetlinkPayload::from(m));
    req.finalize();
    let mut buf = vec![0; req.buffer_len()];
    req.serialize(&mut buf);
    buf
}

/// The namespace watched: this process's.
pub fn own_netns() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/net")
        .ok()
        .and_then(|m| u32::try_from(m.ino()).ok())
        .unwrap_or(0)
}

/// The live handle: a worker thread following rtnetlink, its events polled from here.
pub struct AddrWatcher {
    rx: mpsc::Receiver<AddrPresence>,
    stop: Arc<AtomicBool>,
}

impl AddrWatcher {
    /// Opens and subscribes the socket here (so a failure is said at once), then dumps and
    /// follows in a thread of its own.
    pub fn start() -> std::io::Result<Self> {
        Self::start_in(None)
    }

    /// The same for the namespace `ns` (its inode and a handle), its socket made inside it;
    /// `None`: this process's.
    pub fn start_in(ns: Option<(u32, std::sync::Arc<std::fs::File>)>) -> std::io::Result<Self> {
        let (sock, netns) = match ns {
            None => (open_socket()?, own_netns()),
            Some((ino, f)) => (crate::source::netns::inside(&f, open_socket)?, ino),
        };
        let (tx, rx) = mpsc::sync_channel(CHANNEL);
        let stop = Arc::new(AtomicBool::new(false));
        let worker = Worker {
            sock,
            state: AddrState::new(netns),
            tx,
            stop: stop.clone(),
            seq: 0,
            channel_full: 0,
            undecodable: 0,
            dropped_said: false,
            buf: Vec::with_capacity(1 << 17),
        };
        std::thread::Builder::new()
            .name("xtlock-addrs".into())
            .spawn(move || worker.run())?;
        Ok(Self { rx, stop })
    }

    /// The events read since the last call.
    pub fn poll(&mut self, out: &mut Vec<Event>) {
        out.extend(self.rx.try_iter().map(|a| Event::Addr(Box::new(a))));
    }
}

impl Drop for AddrWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

pub(super) fn open_socket() -> std::io::Result<netlink_sys::Socket> {
    use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    // Room for a burst (a node deleting many pods at once); an overrun costs a re-dump.
    // Best effort: the default is only smaller. FORCE: past rmem_max, as root.
    if setsockopt_int(&sock, libc::SO_RCVBUFFORCE, RCVBUF).is_err() {
        let _ = setsockopt_int(&sock, libc::SO_RCVBUF, RCVBUF);
    }
    // Subscribed before the dump: a change made during it is not missed.
    for g in [
        libc::RTNLGRP_LINK,
        libc::RTNLGRP_NEIGH,
        libc::RTNLGRP_IPV4_ROUTE,
        libc::RTNLGRP_IPV6_ROUTE,
        libc::RTNLGRP_IPV4_IFADDR,
        libc::RTNLGRP_IPV6_IFADDR,
    ] {
        sock.add_membership(g)?;
    }
    set_recv_timeout(&sock, RECV_TIMEOUT)?;
    Ok(sock)
}

pub(super) fn setsockopt_int(
    sock: &impl AsRawFd,
    opt: libc::c_int,
    v: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: v is a valid int for the call's duration.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `SO_RCVTIMEO`: how long a read of `sock` may wait (shared by every netlink reader).
pub fn set_recv_timeout(sock: &impl AsRawFd, t: Duration) -> std::io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros() as i32),
    };
    // SAFETY: tv is a valid timeval for the call's duration.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Why the worker stops reading.
pub(super) enum Stop {
    /// Asked to (the handle dropped).
    Asked,
    Overrun,
    Failed(std::io::Error),
}

pub(super) struct Worker {
    sock: netlink_sys::Socket,
    state: AddrState,
    tx: mpsc::SyncSender<AddrPresence>,
    stop: Arc<AtomicBool>,
    seq: u32,
    channel_full: u64,
    undecodable: u64,
    dropped_said: bool,
    buf: Vec<u8>,
}

impl Worker {
    fn run(mut self) {
        let mut tries = 0;
        loop {
            let stopped = match self.dump() {
                Ok(()) => {
                    tries = 0;
                    self.follow()
                }
                Err(s) => s,
            };
            match stopped {
                Stop::Asked => return,
                Stop::Overrun => {
                    tries += 1;
                    if tries > DUMP_TRIES {
                        tracing::warn!("rtnetlink keeps overrunning: addresses of this node are no longer followed");
                        return;
                    }
                    tracing::warn!("rtnetlink overrun (notifications lost): reading links, neighbours, routes and addresses again");
                }
                Stop::Failed(e) => {
                    tracing::warn!(error = %e, "rtnetlink read failed: addresses of this node are no longer followed");
                    return;
                }
            }
        }
    }

    /// Reads every table anew, then says what changed since the last time.
    fn dump(&mut self) -> Result<(), Stop> {
        self.state.begin_dump();
        for req in dump_requests() {
            self.seq = self.seq.wrapping_add(1);
            let seq = self.seq;
            self.sock
                .send(&request_bytes(req, seq), 0)
                .map_err(Stop::Failed)?;
            // Notifications come in between: they are part of the new state too.
            while !self.read(Some(seq))? {}
        }
        let mut out = Vec::new();
        self.state.end_dump(crate::source::monotonic_ns(), &mut out);
        self.send(out);
        Ok(())
    }

    fn follow(&mut self) -> Stop {
        loop {
            if let Err(s) = self.read(None) {
                return s;
            }
        }
    }

    /// Reads one datagram and applies it; true when it ended the dump `dump`.
    fn read(&mut self, dump: Option<u32>) -> Result<bool, Stop> {
        if self.stop.load(Ordering::Relaxed) {
            return Err(Stop::Asked);
        }
        self.buf.clear();
        if let Err(e) = self.sock.recv(&mut self.buf, 0) {
            return match e.raw_os_error() {
                Some(libc::ENOBUFS) => Err(Stop::Overrun),
                Some(libc::EAGAIN | libc::EINTR) => Ok(false),
                _ => Err(Stop::Failed(e)),
            };
        }
        let ts_ns = crate::source::monotonic_ns();
        let before = self.undecodable;
        let mut out = Vec::new();
        let mut ended = false;
        for r in parse_datagram(&self.buf, &mut self.undecodable) {
            match r {
                Read::Msg(m) => self.state.apply(m, ts_ns, &mut out),
                Read::DumpEnd { seq, error } if Some(seq) == dump => {
                    if let Some(e) = error {
                        tracing::debug!(error = %std::io::Error::from_raw_os_error(-e), "an rtnetlink dump was refused");
                    }
                    ended = true;
                }
                Read::DumpEnd { .. } => {}
            }
        }
        if before == 0 && self.undecodable > 0 {
            tracing::warn!("undecodable rtnetlink message (further ones counted silently)");
        }
        self.send(out);
        Ok(ended)
    }

    fn send(&mut self, out: Vec<AddrPresence>) {
        for a in out {
            tracing::debug!(addr = %a.addr, why = a.why.as_str(), link = %a.link, ts_ns = a.ts_ns, "address");
            match self.tx.try_send(a) {
                Ok(()) => {}
                Err(mpsc::TrySendError::Full(_)) => {
                    self.channel_full += 1;
                    if self.channel_full == 1 {
                        tracing::warn!(
                            bound = CHANNEL,
                            "address events not taken fast enough: dropped (further ones counted silently)"
                        );
                    }
                }
                Err(mpsc::TrySendError::Disconnected(_)) => {
                    self.stop.store(true, Ordering::Relaxed);
                    return;
                }
            }
        }
        if self.state.dropped > 0 && !self.dropped_said {
            self.dropped_said = true;
            tracing::warn!(
                bound = MAX_ENTRIES,
                "too many links, neighbours, routes or addresses: the newest are not followed"
            );
        }
    }
}
