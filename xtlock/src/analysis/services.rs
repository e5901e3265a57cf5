//! Services that still route to endpoints that are gone. Pure, like the rest of the
//! analysis: what it knows arrives as events (rule reads, addresses) and as the facts the
//! other subsystems settle (rule writes, holds, waits, refusal counts).
//!
//! **Where each Service routes**, from every rule read (`Event::RuleTable`): kube-proxy's
//! iptables layout (`KUBE-SVC-*`/`KUBE-SVL-*` jump to `KUBE-SEP-*`, which DNAT to the
//! endpoint; the service port named by the `ns/svc:port` comments, or by the chain when
//! comments are absent) and its nftables layout (table `kube-proxy`: an `endpoint-*` chain
//! that DNATs routes to it; kube-proxy flushes a stale one before deleting it, so an empty one
//! routes nowhere). One model, service port → endpoints, per network namespace.
//!
//! **Dead endpoints**: an address that vanished from this node (`Event::Addr`: the pod's
//! veth deleted, its host route or address gone, its neighbour failed), or an endpoint
//! anywhere whose DNATed connections go unanswered (conntrack, `AddrWhy::Unanswered`: how
//! pods on other nodes are seen dead), while a Service still routes to it opens a window;
//! the first read that no longer routes to it closes it, with the write that did it (the
//! last rule write of that netns by the reading's writer) and why the fix came late (the
//! writer's wait for the lock, behind whom, and its own hold). The
//! connections the node refused meanwhile (exact counts of ICMP unreachable and resets to that
//! endpoint, from the refusal counters) are added until [`GRACE_NS`] after the fix: a
//! neighbour's resolution fails seconds after the SYN that started it.
//!
//! **New endpoints**: an address that came up on this node while xtlock watched (said live,
//! not found by a dump) and that no Service routed to yet; the first read of an already
//! modelled table that routes a Service to it says how long that took, with the write that
//! did it and why it was late (an upper bound of the node's part: it includes the pod's
//! readiness and the control plane).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};

use serde::Serialize;

use super::facts::{
    EndpointProgrammedFact, IpvsDrainedFact, Output, StaleConntrack, StaleEndpointFact,
    StaleEndpointOpenFact, StaleFix,
};
use super::procs::FastMap;
use crate::event::{
    AddrPresence, AddrWhy, ChainState, CtEntries, IpvsService, IpvsTable, Rule, RuleTable,
};
use crate::shared::SharedStr;

/// Refusals to a dead endpoint are counted until this long after the rules stopped routing
/// to it: the last connections DNATed to it are refused only when the node's neighbour
/// resolution fails (3 s on Linux's defaults), and counters are read every second.
pub const GRACE_NS: u64 = 5_000_000_000;
/// Tables modelled (every netns); past it, new ones are not.
const MAX_TABLES: usize = 1024;
/// Chains kept per table (kube-proxy's 10,000-service node has ~60,000).
const MAX_CHAINS: usize = 250_000;
/// Open windows; past it, new ones are counted in `over_bound`.
const MAX_WINDOWS: usize = 4096;
/// Addresses remembered as gone (a read that routes to one later opens its window).
const MAX_GONE: usize = 65_536;
/// Recent rule writes, waits and holds remembered to explain a fix.
const MAX_RECENT: usize = 1024;
/// Addresses that came up, waiting for a Service to route to them.
const MAX_UP: usize = 65_536;
/// How long an address that came up is waited for: a pod that is never an endpoint of a
/// Service (or whose Service is on another node's rules only) is forgotten then.
const UP_WAIT_NS: u64 = 600_000_000_000;

/// What one chain tells about routing.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct ChainInfo {
    /// Where its DNAT rule sends packets.
    dnat: Option<SocketAddr>,
    /// The chains it jumps or goes to.
    jumps: Vec<String>,
    /// Its first comment, kube-proxy's `ns/svc:port` (before any ` -> ep` or ` cluster IP`).
    comment: Option<String>,
    /// The last read that named the chain (`TableRoutes::read`).
    seen: u64,
}

/// An IPVS real server at weight 0.
#[derive(Debug, Clone, Copy)]
struct Drain {
    since_ns: u64,
    active: u32,
    inactive: u32,
}

/// An IPVS change the hooks saw (the writer of a real server's removal or weight).
#[derive(Debug, Clone)]
struct IpvsChange {
    ts_ns: u64,
    pid: u32,
    agent: SharedStr,
    program: String,
}

/// `tcp/10.96.0.10:80` (`fwmark/5`): an IPVS virtual server, as a Service port's name.
fn ipvs_service_name(svc: &IpvsService) -> String {
    match svc.addr {
        Some(a) => format!("{}/{a}", super::ipvs::proto_name(svc.proto)),
        None => format!("fwmark/{}", svc.fwmark),
    }
}

/// One table as last read: its chains. A read updates it in place: a chain sent as its
/// digest only keeps what it told.
#[derive(Debug, Default)]
struct TableRoutes {
    chains: FastMap<SharedStr, ChainInfo>,
    /// The number of the last read applied.
    read: u64,
    /// The chain names of the last read applied, in its order; empty when it named a chain
    /// twice. A read naming the same chains in the same order (the capture reader hands it
    /// the same names: a pointer compare each) keeps every chain sent as its digest as the
    /// last read left it, with no look-up.
    order: Vec<SharedStr>,
    /// Reads whose chain list was the previous one's.
    #[cfg(test)]
    same_order: u64,
}

/// A service port and one of its endpoints.
type Route = (String, SocketAddr);

/// A window of routing to a gone endpoint.
#[derive(Debug)]
struct Window {
    netns: u32,
    service: String,
    endpoint: SocketAddr,
    since_ns: u64,
    why: AddrWhy,
    link: String,
    fix: Option<StaleFix>,
    outcomes: BTreeMap<String, u64>,
    /// Conntrack entries DNATed to it, by the kernel's id (see [`ServiceTracker::on_ct`]).
    ct: BTreeMap<u32, CtSeen>,
    /// The ids of the last read after the fix: what conntrack still steers there.
    ct_after_fix: Option<Vec<u32>>,
}

/// One conntrack entry DNATed to a window's endpoint, as last read.
#[derive(Debug, Clone, Copy)]
struct CtSeen {
    proto: u8,
    /// It saw a reply in some read.
    replied: bool,
    packets: u64,
    timeout_s: u32,
    /// TCP's conntrack state at the last read.
    tcp_state: u8,
}

/// `TCP_CONNTRACK_ESTABLISHED`.
const TCP_CONNTRACK_ESTABLISHED: u8 = 3;

/// Conntrack entries followed per window.
const MAX_CT_PER_WINDOW: usize = 4096;

#[derive(Debug, Clone)]
struct Write {
    ts_ns: u64,
    netns: u32,
    pid: u32,
    agent: SharedStr,
    program: String,
}

#[derive(Debug, Clone)]
struct WaitRef {
    wait_ns: u64,
    behind: Vec<(String, u64)>,
}

/// The `services` block of the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ServiceSummary {
    /// Service ports and endpoints routed at the end, over every namespace read.
    pub services: u64,
    pub endpoints: u64,
    /// Windows of routing to a gone endpoint, reported.
    pub stale_windows: u64,
    /// Of them, still routed when tracing ended.
    pub still_stale: u64,
    /// Their time in all (closed ones; open ones up to the end).
    pub stale_ns: u64,
    /// Connections refused to them meanwhile, exact.
    pub connections: u64,
    /// Windows not tracked (past the bound).
    #[serde(skip_serializing_if = "is_zero")]
    pub over_bound: u64,
    /// New endpoints whose first routing was seen, and the longest time it took.
    #[serde(skip_serializing_if = "is_zero")]
    pub programmed: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub programming_ns_max: u64,
}

impl ServiceSummary {
    pub fn is_empty(&self) -> bool {
        self.endpoints == 0 && self.stale_windows == 0
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Default)]
pub struct ServiceTracker {
    tables: HashMap<(u32, String, String), TableRoutes>,
    /// Routed (service, endpoint) per netns, after the last read.
    routed: FastMap<u32, BTreeSet<Route>>,
    /// IPVS's routes per netns (real servers of weight above 0), as last read.
    ipvs: FastMap<u32, BTreeSet<Route>>,
    /// The last IPVS read's time, and the IPVS changes the hooks saw.
    ipvs_read_ns: u64,
    ipvs_changes: VecDeque<IpvsChange>,
    /// IPVS real servers at weight 0: since which read, and their connections at the last.
    draining: HashMap<(u32, String, SocketAddr), Drain>,
    /// Addresses gone from this node, and how.
    gone: HashMap<IpAddr, (u64, AddrWhy, String)>,
    /// Addresses that came up live and are not yet routed to: when, how, behind which link.
    up: HashMap<IpAddr, (u64, AddrWhy, String)>,
    up_swept_ns: u64,
    windows: Vec<Window>,
    writes: VecDeque<Write>,
    waits: VecDeque<(u32, WaitRef)>,
    holds: VecDeque<(u32, u64)>,
    summary: ServiceSummary,
}

/// `"default/web:http -> 10.244.1.5:8080"`, `"default/web:http cluster IP"` → `default/web:http`.
fn service_of_comment(c: &str) -> String {
    let c = c.trim_matches('"');
    let c = c.split(" -> ").next().unwrap_or(c);
    c.split(' ').next().unwrap_or(c).to_owned()
}

/// `--to-destination 10.244.1.5:8080` (iptables-save's words, also for nf_tables' `nat`).
fn dnat_of(rule: &Rule) -> Option<SocketAddr> {
    let t = rule.target();
    if !t.starts_with("-j DNAT") {
        return None;
    }
    let to = t.split("--to-destination ").nth(1)?.split(' ').next()?;
    // A range or a port range: its first address, its first port.
    let to = to.split('-').next().unwrap_or(to);
    if let Ok(sa) = to.parse::<SocketAddr>() {
        return Some(sa);
    }
    to.parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, 0))
}

fn chain_info(rules: &[Rule]) -> ChainInfo {
    let mut info = ChainInfo::default();
    for r in rules {
        if info.dnat.is_none() {
            info.dnat = dnat_of(r);
        }
        if let Some(j) = r.jump() {
            info.jumps.push(j.to_owned());
        }
        if info.comment.is_none() {
            info.comment = r.comment().map(service_of_comment);
        }
    }
    info
}

/// `endpoint-XXXXXXXX-ns/svc/tcp/port__10.180.0.1/80` → `ns/svc:port`; likewise for a
/// `service-…` chain. kube-proxy's nftables chain names carry the service port.
fn nft_service_of_chain(name: &str) -> Option<String> {
    let rest = name
        .strip_prefix("endpoint-")
        .or_else(|| name.strip_prefix("service-"))?;
    let (_, rest) = rest.split_once('-')?;
    let svc = rest.split("__").next()?;
    let parts: Vec<&str> = svc.split('/').collect();
    match parts.as_slice() {
        [ns, name, _proto, port] => Some(format!("{ns}/{name}:{port}")),
        _ => None,
    }
}

impl TableRoutes {
    fn apply(&mut self, chains: &[ChainState]) {
        self.read += 1;
        let read = self.read;
        let chains = &chains[..chains.len().min(MAX_CHAINS)];
        // After the last read, every chain it named is kept or dropped for good, and no
        // other is kept: with the same names, only the chains with rules can change.
        let same_order = !self.order.is_empty()
            && self.order.len() == chains.len()
            && self.order.iter().zip(chains).all(|(o, c)| *o == c.name);
        #[cfg(test)]
        {
            self.same_order += u64::from(same_order);
        }
        // Chains kept that this read names.
        let mut named = 0;
        // Backwards: a chain named twice is as its last mention says, the first one met.
        for c in chains.iter().rev() {
            if same_order && c.rules.is_none() {
                continue;
            }
            match (&c.rules, self.chains.get_mut(&c.name)) {
                (_, Some(info)) if info.seen == read => {}
                // Unchanged since the previous read: kept as it was.
                (None, Some(info)) => {
                    info.seen = read;
                    named += 1;
                }
                (None, None) => {
                    if is_service_chain(&c.name) {
                        let info = ChainInfo {
                            seen: read,
                            ..ChainInfo::default()
                        };
                        self.chains.insert(c.name.clone(), info);
                        named += 1;
                    }
                }
                (Some(rules), old) => {
                    let info = ChainInfo {
                        seen: read,
                        ..chain_info(rules)
                    };
                    // Only chains that tell about routing are kept.
                    let keep = info.dnat.is_some() || is_service_chain(&c.name);
                    match old {
                        Some(old) if keep => *old = info,
                        None if keep => {
                            self.chains.insert(c.name.clone(), info);
                        }
                        _ => {
                            self.chains.remove(&c.name);
                            continue;
                        }
                    }
                    named += 1;
                }
            }
        }
        if same_order {
            return;
        }
        // Those it did not name are gone.
        if named < self.chains.len() {
            self.chains.retain(|_, info| info.seen == read);
        }
        self.order.clear();
        // Kept only if no chain is named twice (a rare read pays for the check).
        let mut names: FastMap<&str, ()> = FastMap::default();
        names.reserve(chains.len());
        if chains.iter().all(|c| names.insert(&c.name, ()).is_none()) {
            self.order.extend(chains.iter().map(|c| c.name.clone()));
        }
    }

    fn routes(&self, into: &mut BTreeSet<Route>) {
        for (name, info) in &self.chains {
            if name.starts_with("KUBE-SVC-") || name.starts_with("KUBE-SVL-") {
                for j in info.jumps.iter().filter(|j| j.starts_with("KUBE-SEP-")) {
                    let Some(sep) = self.chains.get(j.as_str()) else {
                        continue;
                    };
                    let Some(ep) = sep.dnat else { continue };
                    let service = sep
                        .comment
                        .clone()
                        .or_else(|| info.comment.clone())
                        .unwrap_or_else(|| name.to_string());
                    into.insert((service, ep));
                }
            } else if name.starts_with("endpoint-") {
                if let (Some(ep), Some(service)) = (info.dnat, nft_service_of_chain(name)) {
                    into.insert((service, ep));
                }
            }
        }
    }
}

fn is_service_chain(name: &str) -> bool {
    name.starts_with("KUBE-SVC-") || name.starts_with("KUBE-SVL-")
}

impl ServiceTracker {
    /// A whole rule read (the rule tracker assembles its parts): the model of its table,
    /// then what stopped (or started) routing.
    pub fn on_table(&mut self, t: &RuleTable, out: &mut impl FnMut(Output)) {
        if !t.skipped.is_empty() {
            return;
        }
        let key = (t.netns, t.family.clone(), t.table.clone());
        if !self.tables.contains_key(&key) && self.tables.len() >= MAX_TABLES {
            return;
        }
        self.tables.entry(key).or_default().apply(&t.chains);
        let fix = self.fix_for(t);
        self.routes_read(t.netns, t.ts_ns, fix, false, out);
    }

    /// An IPVS table read (kube-proxy's ipvs mode): its real servers of weight above 0 are
    /// where its virtual servers route new connections, as the rules' DNATs are.
    pub fn on_ipvs(&mut self, t: &IpvsTable, out: &mut impl FnMut(Output)) {
        if !self.ipvs.contains_key(&t.netns) && self.ipvs.len() >= MAX_TABLES {
            return;
        }
        let mut routes = BTreeSet::new();
        let mut listed = HashMap::new();
        for svc in &t.services {
            let name = ipvs_service_name(svc);
            for d in &svc.dests {
                if d.weight > 0 {
                    routes.insert((name.clone(), d.addr));
                } else if self.draining.len() < MAX_WINDOWS {
                    let e = self
                        .draining
                        .entry((t.netns, name.clone(), d.addr))
                        .or_insert(Drain {
                            since_ns: t.ts_ns,
                            active: 0,
                            inactive: 0,
                        });
                    (e.active, e.inactive) = (d.active, d.inactive);
                }
                listed.insert((name.clone(), d.addr), d.weight);
            }
        }
        // Real servers no longer at weight 0: removed (drained), or weighted again.
        let done: Vec<(u32, String, SocketAddr)> = self
            .draining
            .keys()
            .filter(|k| k.0 == t.netns && listed.get(&(k.1.clone(), k.2)) != Some(&0))
            .cloned()
            .collect();
        for k in done {
            let Some(d) = self.draining.remove(&k) else {
                continue;
            };
            if !listed.contains_key(&(k.1.clone(), k.2)) {
                self.drained(k, d, t.ts_ns, true, out);
            }
        }
        // The netns's first IPVS read finds what was there before.
        let first = self.ipvs.insert(t.netns, routes).is_none();
        let fix = self.ipvs_fix(t.ts_ns);
        self.ipvs_read_ns = t.ts_ns;
        self.routes_read(t.netns, t.ts_ns, fix, first, out);
    }

    fn drained(
        &mut self,
        (netns, service, endpoint): (u32, String, SocketAddr),
        d: Drain,
        end_ns: u64,
        removed: bool,
        out: &mut impl FnMut(Output),
    ) {
        out(Output::IpvsDrained(IpvsDrainedFact {
            ts_ns: d.since_ns,
            netns,
            service,
            endpoint: endpoint.to_string(),
            drained_ns: end_ns.saturating_sub(d.since_ns),
            removed,
            active: d.active,
            inactive: d.inactive,
            gone: self.gone.get(&endpoint.ip()).map(|g| g.1.as_str()),
        }));
    }

    /// The last IPVS change the hooks saw since the previous IPVS read (who removed the real
    /// server or set its weight to 0); else the read's time, not exact.
    fn ipvs_fix(&self, ts_ns: u64) -> StaleFix {
        let change = self
            .ipvs_changes
            .iter()
            .rev()
            .find(|c| c.ts_ns <= ts_ns && c.ts_ns >= self.ipvs_read_ns);
        match change {
            Some(c) => StaleFix {
                exact: true,
                agent: c.agent.clone(),
                program: c.program.clone(),
                ..StaleFix::unseen(c.ts_ns, c.pid)
            },
            None => StaleFix::unseen(ts_ns, 0),
        }
    }

    /// What a read of `netns`'s rules or IPVS table changed: the routes of both, then the
    /// windows opened (routes to addresses already gone), the new endpoints programmed, and
    /// the windows fixed (by `fix`). `first`: the source's first read of that netns.
    fn routes_read(
        &mut self,
        netns: u32,
        ts_ns: u64,
        fix: StaleFix,
        first: bool,
        out: &mut impl FnMut(Output),
    ) {
        let mut now = BTreeSet::new();
        for ((n, _, _), table) in &self.tables {
            if *n == netns {
                table.routes(&mut now);
            }
        }
        if let Some(ipvs) = self.ipvs.get(&netns) {
            now.extend(ipvs.iter().cloned());
        }
        // Routes to addresses already gone open windows (a write that re-added one).
        let before = self.routed.get(&netns);
        let added: Vec<Route> = now
            .iter()
            .filter(|r| before.is_none_or(|b| !b.contains(*r)))
            .cloned()
            .collect();
        // A netns's first read finds routes that were there before: not programmed now.
        let modelled = before.is_some() && !first;
        let mut programmed: Vec<IpAddr> = Vec::new();
        for (service, ep) in added {
            if let Some((since, why, link)) = self.gone.get(&ep.ip()).cloned() {
                self.open(ts_ns, netns, service, ep, since, why, link, out);
                continue;
            }
            let Some((up_ns, how, link)) = self.up.get(&ep.ip()).cloned() else {
                continue;
            };
            if up_ns > ts_ns {
                continue;
            }
            programmed.push(ep.ip());
            if !modelled {
                continue;
            }
            // The write that first routed to it; one before the address came up (a
            // restore that waited for the lock) is the read's time, an upper bound.
            let at = if fix.exact && fix.ts_ns >= up_ns {
                fix.ts_ns
            } else {
                ts_ns
            };
            let mut write = fix.clone();
            if at != fix.ts_ns {
                write.ts_ns = at;
                write.exact = false;
            }
            let f = EndpointProgrammedFact {
                ts_ns: up_ns,
                netns,
                service,
                endpoint: ep.to_string(),
                up: how.as_str(),
                link,
                latency_ns: at.saturating_sub(up_ns),
                write,
            };
            self.summary.programmed += 1;
            self.summary.programming_ns_max = self.summary.programming_ns_max.max(f.latency_ns);
            out(Output::EndpointProgrammed(f));
        }
        // Each address once (and not at all when a netns's first read already routes to it):
        // its other service ports came with the same write, or are another Service's later
        // choice, not the node's latency.
        for ip in programmed {
            self.up.remove(&ip);
        }
        // Windows whose route this read no longer has: fixed by the reading's writer.
        self.windows.retain_mut(|w| {
            if w.netns != netns || w.fix.is_some() || now.contains(&(w.service.clone(), w.endpoint))
            {
                return true;
            }
            // A write before the address vanished, read after: the rules were right.
            if fix.exact && fix.ts_ns <= w.since_ns {
                return false;
            }
            w.fix = Some(fix.clone());
            true
        });
        self.routed.insert(netns, now);
    }

    /// The write a read follows: the last rule write of its netns by its writer (else the
    /// last of its netns), with the writer's wait and hold.
    fn fix_for(&self, t: &RuleTable) -> StaleFix {
        let write = self
            .writes
            .iter()
            .rev()
            .find(|w| w.netns == t.netns && w.pid == t.after_pid && w.ts_ns <= t.ts_ns)
            .or_else(|| {
                self.writes
                    .iter()
                    .rev()
                    .find(|w| w.netns == t.netns && w.ts_ns <= t.ts_ns)
            });
        let Some(w) = write else {
            return StaleFix::unseen(t.ts_ns, t.after_pid);
        };
        let wait = self
            .waits
            .iter()
            .rev()
            .find(|(pid, _)| *pid == w.pid)
            .map(|(_, r)| r.clone());
        let hold_ns = self
            .holds
            .iter()
            .rev()
            .find(|(pid, _)| *pid == w.pid)
            .map(|(_, h)| *h);
        StaleFix {
            ts_ns: w.ts_ns,
            exact: true,
            pid: w.pid,
            agent: w.agent.clone(),
            program: w.program.clone(),
            wait_ns: wait.as_ref().map_or(0, |r| r.wait_ns),
            behind: wait.map(|r| r.behind).unwrap_or_default(),
            hold_ns,
        }
    }

    /// Opens the window of `service` routing to `endpoint`, gone since `since_ns`, and says
    /// so (at `ts_ns`, when this was learned).
    #[allow(clippy::too_many_arguments)]
    fn open(
        &mut self,
        ts_ns: u64,
        netns: u32,
        service: String,
        endpoint: SocketAddr,
        since_ns: u64,
        why: AddrWhy,
        link: String,
        out: &mut impl FnMut(Output),
    ) {
        if self
            .windows
            .iter()
            .any(|w| w.netns == netns && w.service == service && w.endpoint == endpoint)
        {
            return;
        }
        if self.windows.len() >= MAX_WINDOWS {
            self.summary.over_bound += 1;
            return;
        }
        out(Output::StaleEndpointOpen(StaleEndpointOpenFact {
            ts_ns: ts_ns.max(since_ns),
            gone_ns: since_ns,
            netns,
            service: service.clone(),
            endpoint: endpoint.to_string(),
            gone: why.as_str(),
            link: link.clone(),
        }));
        self.windows.push(Window {
            netns,
            service,
            endpoint,
            since_ns,
            why,
            link,
            fix: None,
            outcomes: BTreeMap::new(),
            ct: BTreeMap::new(),
            ct_after_fix: None,
        });
    }

    /// An address appeared or vanished on this node.
    pub fn on_addr(&mut self, a: &AddrPresence, out: &mut impl FnMut(Output)) {
        if a.why.present() {
            // Only a live one can be new; the routes are scanned only then.
            let routed = || {
                self.routed
                    .values()
                    .any(|r| r.iter().any(|(_, ep)| ep.ip() == a.addr))
            };
            // An endpoint answering again is not a new one.
            if a.live && a.why != AddrWhy::Answering && self.up.len() < MAX_UP && !routed() {
                self.up
                    .entry(a.addr)
                    .or_insert((a.ts_ns, a.why, a.link.clone()));
            }
            if self.gone.remove(&a.addr).is_some() {
                // The address is back (a pod's IP reused, a neighbour answering again):
                // windows of it that the rules had not fixed end here.
                let ts = a.ts_ns;
                let mut i = 0;
                while i < self.windows.len() {
                    let w = &self.windows[i];
                    if w.endpoint.ip() == a.addr && w.fix.is_none() {
                        let w = self.windows.swap_remove(i);
                        self.report(w, Some(ts), out);
                    } else {
                        i += 1;
                    }
                }
            }
            return;
        }
        self.up.remove(&a.addr);
        if self.gone.contains_key(&a.addr) {
            return;
        }
        if self.gone.len() < MAX_GONE {
            self.gone.insert(a.addr, (a.ts_ns, a.why, a.link.clone()));
        }
        // Gone from this node: dead for every namespace that routes there. Unanswered: as
        // that namespace's conntrack saw it.
        let scope = (a.why == AddrWhy::Unanswered).then_some(a.netns);
        let hits: Vec<(u32, Route)> = self
            .routed
            .iter()
            .filter(|(netns, _)| scope.is_none_or(|s| s == **netns))
            .flat_map(|(netns, routes)| {
                routes
                    .iter()
                    .filter(|(_, ep)| ep.ip() == a.addr)
                    .map(move |r| (*netns, r.clone()))
            })
            .collect();
        for (netns, (service, ep)) in hits {
            self.open(
                a.ts_ns,
                netns,
                service,
                ep,
                a.ts_ns,
                a.why,
                a.link.clone(),
                out,
            );
        }
    }

    /// A read of the conntrack entries DNATed to an address gone: the connections each of its
    /// windows sent there (a TCP entry that never saw a reply was not answered), and, once
    /// the rules were fixed, what conntrack still steers there.
    pub fn on_ct(&mut self, c: &CtEntries) {
        for w in self.windows.iter_mut() {
            if w.endpoint.ip() != c.addr || (c.netns != 0 && w.netns != c.netns) {
                continue;
            }
            let port = w.endpoint.port();
            let mine = c
                .entries
                .iter()
                .filter(|e| port == 0 || e.reply_src.port() == port);
            let mut ids = Vec::new();
            for e in mine {
                ids.push(e.id);
                if !w.ct.contains_key(&e.id) && w.ct.len() >= MAX_CT_PER_WINDOW {
                    continue;
                }
                let seen = w.ct.entry(e.id).or_insert(CtSeen {
                    proto: e.proto,
                    replied: false,
                    packets: 0,
                    timeout_s: 0,
                    tcp_state: 0,
                });
                seen.replied |= e.replied();
                seen.packets = seen.packets.max(e.packets);
                seen.timeout_s = e.timeout_s;
                seen.tcp_state = e.tcp_state;
            }
            if w.fix.as_ref().is_some_and(|f| c.ts_ns > f.ts_ns) {
                w.ct_after_fix = Some(ids);
            }
        }
    }

    /// Facts of the other subsystems this one explains fixes and counts connections with.
    pub fn observe(&mut self, o: &Output) {
        fn push<T>(q: &mut VecDeque<T>, v: T) {
            if q.len() >= MAX_RECENT {
                q.pop_front();
            }
            q.push_back(v);
        }
        match o {
            Output::RuleWrite(w) => push(
                &mut self.writes,
                Write {
                    ts_ns: w.ts_ns,
                    netns: w.netns,
                    pid: w.pid,
                    agent: w.agent.clone(),
                    program: w.program.clone(),
                },
            ),
            Output::Wait(w) => push(
                &mut self.waits,
                (
                    w.pid,
                    WaitRef {
                        wait_ns: w.wait_ns,
                        behind: w
                            .holders
                            .iter()
                            .map(|h| (h.agent.to_string(), h.behind_ns.unwrap_or(0)))
                            .collect(),
                    },
                ),
            ),
            Output::Hold(h) => push(&mut self.holds, (h.pid, h.hold_ns)),
            // Who stopped IPVS from routing to a real server (where the hooks attach).
            Output::Ipvs(f) if matches!(f.event, "dest_removed" | "dest_edited") => {
                if let (Some(pid), Some(comm)) = (f.pid, f.comm.as_ref()) {
                    push(
                        &mut self.ipvs_changes,
                        IpvsChange {
                            ts_ns: f.ts_ns,
                            pid,
                            agent: SharedStr::from(comm.as_str()),
                            program: comm.clone(),
                        },
                    );
                }
            }
            Output::RefusalCount(c) => {
                let Ok(dest) = c.dest.parse::<SocketAddr>() else {
                    return;
                };
                // Counts of an interval that ended before the window began are not its, nor
                // those of another namespace (another node's refusals of the same address).
                let end = c.ts_ns.saturating_add(c.interval_ns);
                for w in self.windows.iter_mut() {
                    if w.netns == c.netns
                        && w.endpoint.ip() == dest.ip()
                        && (w.endpoint.port() == 0 || w.endpoint.port() == dest.port())
                        && end > w.since_ns
                    {
                        let what = if c.detail.is_empty() {
                            c.kind.as_str().to_owned()
                        } else {
                            format!("{}: {}", c.kind.as_str(), c.detail)
                        };
                        *w.outcomes.entry(what).or_default() += c.count;
                    }
                }
            }
            _ => {}
        }
    }

    /// Event time moved on: windows fixed more than [`GRACE_NS`] ago are reported.
    pub fn tick(&mut self, ts_ns: u64, out: &mut impl FnMut(Output)) {
        // Once a second of event time: addresses no Service took in time are forgotten.
        if !self.up.is_empty() && ts_ns > self.up_swept_ns.saturating_add(1_000_000_000) {
            self.up
                .retain(|_, (t, _, _)| ts_ns.saturating_sub(*t) < UP_WAIT_NS);
            self.up_swept_ns = ts_ns;
        }
        if self.windows.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.windows.len() {
            let due = self.windows[i]
                .fix
                .as_ref()
                .is_some_and(|f| ts_ns > f.ts_ns.saturating_add(GRACE_NS));
            if due {
                let w = self.windows.swap_remove(i);
                self.report(w, None, out);
            } else {
                i += 1;
            }
        }
    }

    /// End of tracing: every window is reported, those still routed as such.
    pub fn finish(&mut self, ts_ns: u64, out: &mut impl FnMut(Output)) {
        let mut draining: Vec<_> = self.draining.drain().collect();
        draining.sort_by_key(|(_, d)| d.since_ns);
        for (k, d) in draining {
            self.drained(k, d, ts_ns, false, out);
        }
        let mut windows = std::mem::take(&mut self.windows);
        windows.sort_by_key(|w| w.since_ns);
        for w in windows {
            let end = if w.fix.is_none() { Some(ts_ns) } else { None };
            self.report(w, end, out);
        }
    }

    fn report(&mut self, w: Window, ended_ns: Option<u64>, out: &mut impl FnMut(Output)) {
        let still_routed = w.fix.is_none();
        let end = w
            .fix
            .as_ref()
            .map(|f| f.ts_ns)
            .or(ended_ns)
            .unwrap_or(w.since_ns);
        let mut outcomes = w.outcomes;
        let refused: u64 = outcomes.values().sum();
        // A refused connection is also a TCP entry without a reply: only those beyond the
        // refused ones were not answered at all.
        let unreplied = w.ct.values().filter(|e| e.proto == 6 && !e.replied).count() as u64;
        let unanswered = unreplied.saturating_sub(refused);
        if unanswered > 0 {
            outcomes.insert("unanswered".into(), unanswered);
        }
        let connections = refused + unanswered;
        // What still carries traffic there: UDP (and other) flows, and established TCP
        // connections; a TCP entry that never saw a reply is a failed connection (counted
        // above), one closing or closed is done.
        let flows: Vec<&CtSeen> = w
            .ct_after_fix
            .iter()
            .flatten()
            .filter_map(|id| w.ct.get(id))
            .filter(|e| e.proto != 6 || e.tcp_state == TCP_CONNTRACK_ESTABLISHED)
            .collect();
        let conntrack = (!flows.is_empty()).then(|| {
            let mut s = StaleConntrack::default();
            for e in flows {
                s.entries += 1;
                s.udp += u64::from(e.proto == 17);
                s.tcp += u64::from(e.proto == 6);
                s.packets += e.packets;
                s.expires_in_s = s.expires_in_s.max(e.timeout_s);
            }
            s
        });
        let f = StaleEndpointFact {
            ts_ns: w.since_ns,
            netns: w.netns,
            service: w.service,
            endpoint: w.endpoint.to_string(),
            gone: w.why.as_str(),
            link: w.link,
            stale_ns: end.saturating_sub(w.since_ns),
            still_routed,
            fix: w.fix,
            connections,
            outcomes,
            conntrack,
        };
        self.summary.stale_windows += 1;
        self.summary.still_stale += u64::from(still_routed);
        self.summary.stale_ns += f.stale_ns;
        self.summary.connections += connections;
        out(Output::StaleEndpoint(f));
    }

    pub fn summary(&self) -> ServiceSummary {
        let mut s = self.summary.clone();
        let all: BTreeSet<&Route> = self.routed.values().flatten().collect();
        s.endpoints = all.len() as u64;
        s.services = all
            .iter()
            .map(|(svc, _)| svc)
            .collect::<BTreeSet<_>>()
            .len() as u64;
        s
    }

    /// Service ports routed to `ep` in `netns`, as last read (only tests ask it today).
    pub fn services_of(&self, netns: u32, ep: SocketAddr) -> Vec<&str> {
        self.routed
            .get(&netns)
            .into_iter()
            .flatten()
            .filter(|(_, e)| *e == ep)
            .map(|(s, _)| s.as_str())
            .collect()
    }
}

#[cfg(test)]
mod tests;
