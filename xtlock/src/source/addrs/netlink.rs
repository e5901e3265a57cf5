//! The socket side of [`super`]: rtnetlink messages parsed into [`Msg`]s, the dumps, and the
//! worker thread that follows the notifications.

use std::net::IpAddr;
use std::sync::mpsc;
use std::time::Duration;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkMessage},
    neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType},
    AddressFamily, RouteNetlinkMessage,
};

use super::{AddrState, Mac, Msg, CHANNEL, MAX_ENTRIES};
use crate::decode::netlink::{self as nl, Message};
use crate::event::{AddrPresence, Event};
use crate::source::netlink::{NlError, NlSocket};
use crate::source::worker::{Out, Worker as Thread};

/// How long a dump's next answer is waited for (a stop is seen at once, whatever this is).
const RECV_TIMEOUT: Duration = Duration::from_secs(5);
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

/// The messages of one datagram of notifications (a dump's end or refusal, which the
/// dump's own exchange reads, carries nothing to apply); `undecodable` counts those that
/// could not be parsed.
pub(super) fn parse_datagram(buf: &[u8], undecodable: &mut u64) -> Vec<Msg> {
    let mut out = Vec::new();
    for m in nl::framed(buf) {
        let Ok(m) = m else {
            *undecodable += 1;
            break;
        };
        match m.control() {
            Ok(Some(_)) => {}
            Ok(None) => out.extend(parse_message(&m, undecodable)),
            Err(_) => *undecodable += 1,
        }
    }
    out
}

/// What one message says, `None` for one the state does not need; `undecodable` counts
/// those that could not be parsed.
pub(super) fn parse_message(m: &Message<'_>, undecodable: &mut u64) -> Option<Msg> {
    match NetlinkMessage::<RouteNetlinkMessage>::deserialize(m.bytes) {
        Ok(msg) => match msg.payload {
            NetlinkPayload::InnerMessage(i) => to_msg(i),
            _ => None,
        },
        // A link is needed whatever its other attributes say: its index and name by hand.
        Err(_) => {
            let by_hand = link_by_hand(m.ty, m.payload);
            if by_hand.is_none() {
                *undecodable += 1;
            }
            by_hand
        }
    }
}

pub(super) fn link_by_hand(kind: u16, payload: &[u8]) -> Option<Msg> {
    if kind != RTM_NEWLINK && kind != RTM_DELLINK {
        return None;
    }
    let index = u32::from_ne_bytes(payload.get(4..8)?.try_into().ok()?);
    let name = nl::attrs(payload.get(IFINFOMSG_LEN..)?)
        .find(|(kind, _)| *kind == IFLA_IFNAME)
        .map(|(_, v)| nl::string(v))
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

/// The live handle: a worker thread following rtnetlink, its events polled from here;
/// dropping it stops and joins the worker.
pub struct AddrWatcher {
    thread: Thread<AddrPresence>,
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
        let netns = ns.as_ref().map_or_else(own_netns, |(ino, _)| *ino);
        let sock = open_socket(ns.as_ref().map(|(_, f)| f))?;
        let thread = Thread::spawn("xtlock-addrs", CHANNEL, move |tx: Out<AddrPresence>| {
            Worker {
                sock: sock.stop_with(tx.stop.clone()),
                state: AddrState::new(netns),
                tx,
                channel_full: 0,
                undecodable: 0,
                dropped_said: false,
            }
            .run()
        })?;
        Ok(Self { thread })
    }

    /// The events read since the last call.
    pub fn poll(&mut self, out: &mut Vec<Event>) {
        let mut got = Vec::new();
        self.thread.poll(&mut got);
        out.extend(got.into_iter().map(|a| Event::Addr(Box::new(a))));
    }
}

pub(super) fn open_socket(ns: Option<&std::sync::Arc<std::fs::File>>) -> std::io::Result<NlSocket> {
    use netlink_sys::protocols::NETLINK_ROUTE;
    let mut sock = NlSocket::open_in(NETLINK_ROUTE, RECV_TIMEOUT, ns)?;
    // Room for a burst (a node deleting many pods at once); an overrun costs a re-dump.
    sock.set_rcvbuf(RCVBUF);
    // Subscribed before the dump: a change made during it is not missed.
    sock.subscribe(&[
        libc::RTNLGRP_LINK,
        libc::RTNLGRP_NEIGH,
        libc::RTNLGRP_IPV4_ROUTE,
        libc::RTNLGRP_IPV6_ROUTE,
        libc::RTNLGRP_IPV4_IFADDR,
        libc::RTNLGRP_IPV6_IFADDR,
    ])?;
    Ok(sock)
}

/// Why the worker stops reading.
pub(super) enum Stop {
    /// Asked to (the handle dropped).
    Asked,
    Overrun,
    Failed(String),
}

impl From<NlError<std::convert::Infallible>> for Stop {
    fn from(e: NlError<std::convert::Infallible>) -> Self {
        match e {
            NlError::Stopped => Stop::Asked,
            NlError::Recv(e) if e.raw_os_error() == Some(libc::ENOBUFS) => Stop::Overrun,
            // A dump that stalled is read again, as an overrun one is.
            NlError::TimedOut(_) => Stop::Overrun,
            e => Stop::Failed(e.to_string()),
        }
    }
}

pub(super) struct Worker {
    sock: NlSocket,
    state: AddrState,
    tx: Out<AddrPresence>,
    channel_full: u64,
    undecodable: u64,
    dropped_said: bool,
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

    /// Reads every table anew (and the notifications that come in between: they are part of
    /// the new state too), then says what changed since the last time.
    fn dump(&mut self) -> Result<(), Stop> {
        self.state.begin_dump();
        for req in dump_requests() {
            let seq = self.sock.next_seq();
            let before = self.undecodable;
            let (state, undecodable) = (&mut self.state, &mut self.undecodable);
            let mut out = Vec::new();
            let r = self.sock.exchange(&request_bytes(req, seq), |m| {
                if let Some(msg) = parse_message(&m, undecodable) {
                    state.apply(msg, crate::source::monotonic_ns(), &mut out);
                }
                Ok(())
            });
            self.said_undecodable(before);
            self.send(out);
            match r {
                Ok(()) => {}
                Err(NlError::Refused(errno)) => {
                    tracing::debug!(error = %std::io::Error::from_raw_os_error(errno), "an rtnetlink dump was refused");
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mut out = Vec::new();
        self.state.end_dump(crate::source::monotonic_ns(), &mut out);
        self.send(out);
        Ok(())
    }

    /// Applies notifications as they come, until stopped or overrun.
    fn follow(&mut self) -> Stop {
        loop {
            let datagram = match self.sock.read_one() {
                Ok(Some(d)) => d,
                Ok(None) => continue,
                Err(e) => return e.into(),
            };
            let ts_ns = crate::source::monotonic_ns();
            let before = self.undecodable;
            let mut out = Vec::new();
            for m in parse_datagram(datagram, &mut self.undecodable) {
                self.state.apply(m, ts_ns, &mut out);
            }
            self.said_undecodable(before);
            self.send(out);
            if self.tx.stop.stopped() {
                return Stop::Asked;
            }
        }
    }

    fn said_undecodable(&self, before: u64) {
        if before == 0 && self.undecodable > 0 {
            tracing::warn!("undecodable rtnetlink message (further ones counted silently)");
        }
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
                // The handle is gone: it stops this worker.
                Err(mpsc::TrySendError::Disconnected(_)) => return,
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
