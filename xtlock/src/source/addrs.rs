//! Where this node's addresses live, and the moment they go: rtnetlink in the namespace
//! xtlock runs in (the node's). A pod's IP is known from its neighbour entry on the bridge
//! (bridge CNIs: the pod's veth is the bridge port its MAC was learned on), from a host route
//! through its veth (calico, cilium) or as a local address (hostNetwork endpoints). Each is
//! said present once, and gone when its link, route or address is deleted or its neighbour
//! entry fails, as [`AddrPresence`] events stamped when the notification is read.
//!
//! Pure part: [`AddrState::apply`] turns parsed messages ([`Msg`]) into events. Socket part
//! ([`AddrWatcher`]): one thread that dumps, then follows the notifications, and hands the
//! events over a bounded channel that the live loop polls: it never blocks the ring buffer.
//!
//! Bounded: every table of the state holds at most [`MAX_ENTRIES`] entries and the channel
//! [`CHANNEL`] events; what a bound drops is counted and said once. A socket overrun (ENOBUFS)
//! dumps everything again and diffs it against what was said.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use crate::event::{AddrPresence, AddrWhy};

mod netlink;
pub use netlink::{own_netns, to_msg, AddrWatcher};

/// Entries per table (links, neighbours, FDB, routes, addresses, addresses said present): a
/// node has a few hundred pods; beyond this, new entries are dropped and counted.
pub const MAX_ENTRIES: usize = 65_536;
/// Events waiting for the live loop (polled every 50 ms); beyond, dropped and counted.
pub const CHANNEL: usize = 16_384;

pub type Mac = [u8; 6];

/// How long a deleted neighbour waits for its link's deletion (both come from one kernel
/// call, read together).
const FLUSH_WINDOW_NS: u64 = 1_000_000_000;
/// `NUD_*` states whose neighbour answered (or is configured): the address is there.
const NUD_USABLE: u16 =
    libc::NUD_REACHABLE | libc::NUD_STALE | libc::NUD_DELAY | libc::NUD_PROBE | libc::NUD_PERMANENT;
const NUD_FAILED: u16 = libc::NUD_FAILED;

/// One rtnetlink message, as much of it as the state needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    Link {
        index: u32,
        name: String,
    },
    LinkDeleted {
        index: u32,
        name: String,
    },
    /// An IPv4 or IPv6 neighbour (`state`: its `NUD_*` bits; `mac` absent in some states).
    Neigh {
        link: u32,
        addr: IpAddr,
        mac: Option<Mac>,
        state: u16,
    },
    NeighDeleted {
        link: u32,
        addr: IpAddr,
    },
    /// A bridge FDB entry: `mac` was learned on `port` of `bridge`.
    Fdb {
        bridge: u32,
        mac: Mac,
        port: u32,
    },
    FdbDeleted {
        bridge: u32,
        mac: Mac,
        port: u32,
    },
    /// A host route (`/32`, `/128`) of the main table through `oif`.
    Route {
        dst: IpAddr,
        oif: u32,
    },
    RouteDeleted {
        dst: IpAddr,
        oif: u32,
    },
    Addr {
        link: u32,
        addr: IpAddr,
    },
    AddrDeleted {
        link: u32,
        addr: IpAddr,
    },
}

struct Link {
    name: String,
    /// False between its deletion and the end of handling it.
    alive: bool,
}

#[derive(Clone, Copy)]
struct Neigh {
    mac: Option<Mac>,
    state: u16,
}

/// What rtnetlink said so far, and which presences were said.
pub struct AddrState {
    netns: u32,
    links: HashMap<u32, Link>,
    /// Link names from before a re-dump: a link deleted meanwhile is named in its gone.
    old_names: HashMap<u32, String>,
    /// (bridge, MAC) → the port it was last learned on. Kept after the entry is deleted (the
    /// kernel flushes a port's entries before its DELLINK) and after the port is gone (its
    /// neighbours then live behind a dead link, not on the bridge).
    fdb: HashMap<(u32, Mac), u32>,
    neighs: BTreeMap<(IpAddr, u32), Neigh>,
    routes: HashMap<IpAddr, u32>,
    locals: BTreeSet<(IpAddr, u32)>,
    /// Presences said and not gone: (addr, why, link index).
    shown: BTreeSet<(IpAddr, AddrWhy, u32)>,
    /// Neighbours whose entry was deleted while their link was up, and when: garbage
    /// collection, unless the link's deletion follows (the kernel flushes a deleted link's
    /// neighbours before its DELLINK), which makes them gone at that time.
    flushed: Vec<(IpAddr, u32, u64)>,
    /// During a dump: the state is incomplete, nothing is said until its end.
    dumping: bool,
    /// Saying what a dump found: not live (see [`AddrPresence::live`]).
    from_dump: bool,
    /// Entries a bound dropped.
    pub dropped: u64,
}

impl AddrState {
    pub fn new(netns: u32) -> Self {
        Self {
            netns,
            links: HashMap::new(),
            old_names: HashMap::new(),
            fdb: HashMap::new(),
            neighs: BTreeMap::new(),
            routes: HashMap::new(),
            locals: BTreeSet::new(),
            shown: BTreeSet::new(),
            flushed: Vec::new(),
            dumping: false,
            from_dump: false,
            dropped: 0,
        }
    }

    /// A (re-)dump begins: the kernel's tables are read anew. What was said, and where MACs
    /// were learned, is kept to diff against.
    pub fn begin_dump(&mut self) {
        let links = std::mem::take(&mut self.links);
        self.old_names = links.into_iter().map(|(i, l)| (i, l.name)).collect();
        self.neighs.clear();
        self.routes.clear();
        self.locals.clear();
        self.dumping = true;
    }

    /// The dump is complete: says what is new since the last one, and what went meanwhile.
    pub fn end_dump(&mut self, ts_ns: u64, out: &mut Vec<AddrPresence>) {
        self.dumping = false;
        let mut addrs: BTreeSet<IpAddr> = self.shown.iter().map(|k| k.0).collect();
        addrs.extend(self.neighs.keys().map(|k| k.0));
        addrs.extend(self.routes.keys().copied());
        addrs.extend(self.locals.iter().map(|k| k.0));
        self.from_dump = true;
        for a in addrs {
            self.sync(a, ts_ns, out);
        }
        self.from_dump = false;
        self.old_names.clear();
    }

    /// One message, read at `ts_ns`: appends the presences it makes or ends.
    pub fn apply(&mut self, msg: Msg, ts_ns: u64, out: &mut Vec<AddrPresence>) {
        let mut touched: Vec<IpAddr> = Vec::new();
        match msg {
            Msg::Link { index, name } => {
                if self.links.len() < MAX_ENTRIES || self.links.contains_key(&index) {
                    self.links.insert(index, Link { name, alive: true });
                } else {
                    self.dropped += 1;
                }
            }
            Msg::LinkDeleted { index, name } => self.link_deleted(index, name, ts_ns, out),
            Msg::Neigh {
                link,
                addr,
                mac,
                state,
            } => self.neigh(link, addr, mac, state, &mut touched),
            Msg::NeighDeleted { link, addr } => {
                // Garbage collection: the pod may still be there, so only forgotten. Unless
                // it lived on that link itself (a routed veth, not a bridge port) and the
                // link's deletion follows: the kernel flushes a link's neighbours before its
                // DELLINK, so it is kept a second for that.
                if self.neighs.remove(&(addr, link)).is_some() {
                    if self.shown.contains(&(addr, AddrWhy::Neighbour, link)) {
                        self.flushed
                            .retain(|(_, _, at)| ts_ns.saturating_sub(*at) < FLUSH_WINDOW_NS);
                        if self.flushed.len() < MAX_ENTRIES {
                            self.flushed.push((addr, link, ts_ns));
                        }
                    }
                    touched.push(addr);
                }
            }
            Msg::Fdb { bridge, mac, port } => self.fdb_entry(bridge, mac, port, &mut touched),
            // The last port of a MAC is kept (see `fdb`).
            Msg::FdbDeleted { .. } => {}
            Msg::Route { dst, oif } => {
                if !interesting(dst) {
                    return;
                }
                if self.routes.len() >= MAX_ENTRIES && !self.routes.contains_key(&dst) {
                    self.dropped += 1;
                    return;
                }
                self.routes.insert(dst, oif);
                touched.push(dst);
            }
            Msg::RouteDeleted { dst, oif } => {
                // Another route to the same host may have replaced it.
                if self.routes.get(&dst) == Some(&oif) {
                    self.routes.remove(&dst);
                    touched.push(dst);
                }
            }
            Msg::Addr { link, addr } => {
                if !interesting(addr) {
                    return;
                }
                if self.locals.len() >= MAX_ENTRIES {
                    self.dropped += 1;
                    return;
                }
                self.locals.insert((addr, link));
                touched.push(addr);
            }
            Msg::AddrDeleted { link, addr } => {
                if self.locals.remove(&(addr, link)) {
                    touched.push(addr);
                }
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for a in touched {
            self.sync(a, ts_ns, out);
        }
    }

    /// A link gone: said gone while still named, then forgotten with all that was on it.
    fn link_deleted(&mut self, index: u32, name: String, ts_ns: u64, out: &mut Vec<AddrPresence>) {
        let mut touched: Vec<IpAddr> = Vec::new();
        let link = self.links.entry(index).or_insert(Link {
            name: name.clone(),
            alive: false,
        });
        link.alive = false;
        if !name.is_empty() {
            link.name = name;
        }
        touched.extend(self.shown.iter().filter(|k| k.2 == index).map(|k| k.0));
        touched.sort_unstable();
        touched.dedup();
        for &a in &touched {
            self.sync(a, ts_ns, out);
        }
        // Its neighbours, flushed just before: gone with it, when they were flushed
        // (unless said present elsewhere meanwhile).
        let flushed = std::mem::take(&mut self.flushed);
        for (addr, link, at) in flushed {
            let recent = ts_ns.saturating_sub(at) < FLUSH_WINDOW_NS;
            if link != index {
                self.flushed.push((addr, link, at));
            } else if recent && !self.said_present(addr) {
                out.push(self.presence(at, addr, AddrWhy::LinkDeleted, link));
            }
        }
        self.links.remove(&index);
        self.neighs.retain(|k, _| k.1 != index);
        self.routes.retain(|_, oif| *oif != index);
        self.locals.retain(|k| k.1 != index);
        self.fdb.retain(|k, _| k.0 != index);
    }

    /// A neighbour entry added or changed.
    fn neigh(
        &mut self,
        link: u32,
        addr: IpAddr,
        mac: Option<Mac>,
        state: u16,
        touched: &mut Vec<IpAddr>,
    ) {
        if !interesting(addr) {
            return;
        }
        let full = self.neighs.len() >= MAX_ENTRIES;
        match self.neighs.get_mut(&(addr, link)) {
            Some(n) => {
                n.state = state;
                // A failed entry may come without its MAC: it keeps the last one.
                if mac.is_some() {
                    n.mac = mac;
                }
            }
            None if full => self.dropped += 1,
            None => {
                self.neighs.insert((addr, link), Neigh { mac, state });
            }
        }
        touched.push(addr);
    }

    /// A MAC learned on a bridge port: the neighbours with that MAC may have moved.
    fn fdb_entry(&mut self, bridge: u32, mac: Mac, port: u32, touched: &mut Vec<IpAddr>) {
        if self.fdb.get(&(bridge, mac)) == Some(&port) {
            return;
        }
        if self.fdb.len() >= MAX_ENTRIES && !self.fdb.contains_key(&(bridge, mac)) {
            // MACs of dead ports go first: only their last port is lost.
            let links = &self.links;
            self.fdb
                .retain(|_, p| links.get(p).is_some_and(|l| l.alive));
            if self.fdb.len() >= MAX_ENTRIES {
                self.dropped += 1;
                return;
            }
        }
        self.fdb.insert((bridge, mac), port);
        touched.extend(
            self.neighs
                .iter()
                .filter(|(k, n)| k.1 == bridge && n.mac == Some(mac))
                .map(|(k, _)| k.0),
        );
    }

    /// Whether some presence of `addr` is said now.
    fn said_present(&self, addr: IpAddr) -> bool {
        self.shown
            .range((addr, AddrWhy::Neighbour, 0)..=(addr, AddrWhy::Local, u32::MAX))
            .next()
            .is_some()
    }

    fn alive(&self, link: u32) -> bool {
        self.links.get(&link).is_some_and(|l| l.alive)
    }

    fn name(&self, link: u32) -> String {
        match self.links.get(&link) {
            Some(l) => l.name.clone(),
            None => self
                .old_names
                .get(&link)
                .cloned()
                .unwrap_or_else(|| format!("if{link}")),
        }
    }

    /// The link a neighbour lives behind: the bridge port its MAC was last learned on, else
    /// its own link.
    fn behind(&self, link: u32, n: &Neigh) -> u32 {
        n.mac
            .and_then(|m| self.fdb.get(&(link, m)).copied())
            .unwrap_or(link)
    }

    fn neighs_of(&self, addr: IpAddr) -> impl Iterator<Item = (u32, &Neigh)> {
        self.neighs
            .range((addr, 0)..=(addr, u32::MAX))
            .map(|(k, n)| (k.1, n))
    }

    /// What the state says of `addr` now: (why, link) of each presence.
    fn desired(&self, addr: IpAddr) -> BTreeSet<(AddrWhy, u32)> {
        let mut want = BTreeSet::new();
        for (link, n) in self.neighs_of(addr) {
            let at = self.behind(link, n);
            if n.state & NUD_USABLE != 0 && self.alive(at) {
                want.insert((AddrWhy::Neighbour, at));
            }
        }
        if let Some(&oif) = self.routes.get(&addr) {
            if self.alive(oif) {
                want.insert((AddrWhy::Route, oif));
            }
        }
        for &(_, link) in self.locals.range((addr, 0)..=(addr, u32::MAX)) {
            if self.alive(link) {
                want.insert((AddrWhy::Local, link));
            }
        }
        want
    }

    /// Says what changed for `addr` between what was said and what the state says.
    fn sync(&mut self, addr: IpAddr, ts_ns: u64, out: &mut Vec<AddrPresence>) {
        if self.dumping {
            return;
        }
        let want = self.desired(addr);
        let had: Vec<(AddrWhy, u32)> = self
            .shown
            .range((addr, AddrWhy::Neighbour, 0)..=(addr, AddrWhy::Local, u32::MAX))
            .map(|k| (k.1, k.2))
            .collect();
        for &(why, link) in had.iter().filter(|k| !want.contains(k)) {
            self.shown.remove(&(addr, why, link));
            // Moved to another link (a replaced route, a MAC learned on another port): not gone.
            if want.iter().any(|k| k.0 == why) {
                continue;
            }
            if let Some(gone) = self.gone_why(addr, why, link) {
                out.push(self.presence(ts_ns, addr, gone, link));
            }
        }
        for &(why, link) in want.iter().filter(|k| !had.contains(k)) {
            if self.shown.len() >= MAX_ENTRIES {
                self.dropped += 1;
                continue;
            }
            self.shown.insert((addr, why, link));
            out.push(self.presence(ts_ns, addr, why, link));
        }
    }

    /// Why a presence said on `link` ended; `None`: it is only forgotten (a neighbour entry
    /// garbage-collected).
    fn gone_why(&self, addr: IpAddr, why: AddrWhy, link: u32) -> Option<AddrWhy> {
        if !self.alive(link) {
            return Some(AddrWhy::LinkDeleted);
        }
        match why {
            AddrWhy::Route => Some(AddrWhy::RouteDeleted),
            AddrWhy::Local => Some(AddrWhy::AddressDeleted),
            _ => self
                .neighs_of(addr)
                .any(|(l, n)| self.behind(l, n) == link && n.state & NUD_FAILED != 0)
                .then_some(AddrWhy::NeighbourFailed),
        }
    }

    fn presence(&self, ts_ns: u64, addr: IpAddr, why: AddrWhy, link: u32) -> AddrPresence {
        AddrPresence {
            ts_ns,
            netns: self.netns,
            addr,
            why,
            link: self.name(link),
            live: !self.from_dump,
        }
    }
}

/// Addresses that can be a pod's or a node's endpoint: not loopback, unspecified, multicast,
/// broadcast or IPv6 link-local. IPv4 link-local stays: NodeLocal DNSCache listens on
/// 169.254.20.10.
fn interesting(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v) => {
            !(v.is_loopback() || v.is_unspecified() || v.is_multicast() || v.is_broadcast())
        }
        IpAddr::V6(v) => {
            !(v.is_loopback()
                || v.is_unspecified()
                || v.is_multicast()
                || (v.segments()[0] & 0xffc0) == 0xfe80)
        }
    }
}

#[cfg(test)]
mod tests;
