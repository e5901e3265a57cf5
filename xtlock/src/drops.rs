//! Packet drops: classification and correlation with lock holds. Pure, like the rest of the
//! analysis: events in, facts out.
//!
//! What comes in (see `decode`): sampled drops (`Drop`, rate limited in the kernel), the
//! exact per-second counts (`DropCounts`), conntrack counter deltas per netns
//! (`Conntrack`), the recording kernel's reason names (`DropSetup`) and the names of drop
//! locations (`KernelSymbol`). Each second the source sends the conntrack deltas first, then
//! the symbols, then the counts, all with the same timestamp, so a tick is complete when its
//! counts arrive.
//!
//! Classification: `skb_drop_reason` NETFILTER_DROP at `nf_hook_slow` does not tell a rule's
//! DROP from conntrack refusing the packet, so the conntrack counters of the same netns in
//! the same interval decide: drops up to conntrack's `drop` delta are "conntrack table full",
//! the next ones up to `insert_failed` "conntrack insert failed (race)", the rest "netfilter
//! rule drop". Without conntrack counters for that netns, it stays "netfilter drop".
//!
//! Correlation: counts cover one interval (about a second); an interval that overlaps a hold
//! of a watched lock is reported with that hold, and its drops add up on the hold, reported
//! once the counts covering the hold's end have arrived ([`HoldDropsFact`]). Samples carry
//! the hold open at their own time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;

use serde::Serialize;

use crate::analysis::Output;
use crate::decode::{
    ConntrackCounters, ConntrackFail, ConntrackStats, CtFailKind, DropCounts, DropSample,
};
use crate::lock::HoldFact;
use crate::procs::FastMap;
use crate::shared::SharedStr;

/// Default `--conntrack-warn`: warn when the table is this full (percent).
pub const DEFAULT_CONNTRACK_WARN_PCT: u32 = 75;
/// Samples waiting for their tick; more are classified without waiting.
const MAX_PENDING_SAMPLES: usize = 10_000;
/// Ended holds remembered for counts that arrive after them.
const MAX_ENDED_HOLDS: usize = 1024;
/// Hold tallies kept at once (holds with drops not reported yet).
const MAX_TALLIES: usize = 1024;
/// Keys of the summary's tables; later ones are pooled.
const MAX_KEYS: usize = 256;
const OTHER: &str = "(other)";

/// What a drop was, as far as xtlock can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DropClass {
    /// NETFILTER_DROP while conntrack's `drop` counter rose: a new connection found the
    /// table full.
    ConntrackTableFull,
    /// NETFILTER_DROP while conntrack's `insert_failed` rose: lost an insert race.
    ConntrackInsertFailed,
    /// NETFILTER_DROP that conntrack does not explain: a rule's DROP/REJECT, a policy.
    NetfilterRuleDrop,
    /// NETFILTER_DROP in a netns whose conntrack counters are not read: rule or conntrack.
    NetfilterDrop,
    /// Any other reason (its name says what).
    Other,
}

impl DropClass {
    pub fn as_str(self) -> &'static str {
        match self {
            DropClass::ConntrackTableFull => "conntrack_table_full",
            DropClass::ConntrackInsertFailed => "conntrack_insert_failed",
            DropClass::NetfilterRuleDrop => "netfilter_rule_drop",
            DropClass::NetfilterDrop => "netfilter_drop",
            DropClass::Other => "other",
        }
    }

    /// For people.
    pub fn describe(self) -> &'static str {
        match self {
            DropClass::ConntrackTableFull => "conntrack table full",
            DropClass::ConntrackInsertFailed => "conntrack insert failed (race)",
            DropClass::NetfilterRuleDrop => "netfilter rule drop",
            DropClass::NetfilterDrop => "netfilter drop, rule or conntrack",
            DropClass::Other => "other",
        }
    }
}

/// A lock hold a drop happened in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HoldRef {
    pub lock: SharedStr,
    pub pid: u32,
    pub agent: SharedStr,
    pub comm: SharedStr,
    pub start_ns: u64,
    /// `None` while the hold is still open.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_ns: Option<u64>,
}

/// Addresses of a sampled packet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PacketInfo {
    /// `tcp`, `udp`, `icmp`, `icmpv6`, or the protocol number.
    pub proto: String,
    pub saddr: String,
    pub daddr: String,
    /// Ports for TCP/UDP; `None` for others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sport: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dport: Option<u16>,
    /// ICMP type and code.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icmp_type: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icmp_code: Option<u8>,
}

/// One sampled drop: `{"type":"drop",...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DropFact {
    pub ts_ns: u64,
    pub netns: u32,
    pub ifindex: u32,
    /// The kernel's name (`NETFILTER_DROP`), or `reason N` when unnamed, or `unknown` when
    /// the kernel reports none.
    pub reason: String,
    pub reason_code: u32,
    /// `function+0xoff`, or the address when it could not be named.
    pub location: String,
    pub class: DropClass,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packet: Option<PacketInfo>,
    /// The task that was running (often unrelated: softirq).
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldRef>,
}

/// A connection conntrack refused, seen in the kernel function that refused it:
/// `{"type":"conntrack_refused",...}`. Exact: one per refusal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConntrackRefusedFact {
    pub ts_ns: u64,
    pub netns: u32,
    /// `conntrack_insert_failed` or `conntrack_table_full`.
    pub class: DropClass,
    /// The kernel function that refused it.
    pub function: &'static str,
    /// The connection's original direction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packet: Option<PacketInfo>,
    /// The task that was running (the sender for locally sent packets; else unrelated).
    pub pid: u32,
    pub comm: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldRef>,
}

/// Exact drops of one (netns, reason, location, class) in one interval:
/// `{"type":"drop_count",...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DropCountFact {
    /// Start of the interval.
    pub ts_ns: u64,
    pub interval_ns: u64,
    pub netns: u32,
    pub reason: String,
    pub reason_code: u32,
    pub location: String,
    pub class: DropClass,
    pub count: u64,
    /// Holds that overlapped the interval.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub holds: Vec<HoldRef>,
    /// One sampled packet of this kind in the interval, when there was one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub example: Option<PacketInfo>,
}

/// Conntrack counter deltas of one netns in one interval: `{"type":"conntrack",...}`.
/// Emitted when a counter moved or the table crossed the warning threshold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConntrackFact {
    /// Start of the interval.
    pub ts_ns: u64,
    pub interval_ns: u64,
    pub netns: u32,
    #[serde(flatten)]
    pub deltas: ConntrackCounters,
    /// Entries in the table now, and its size.
    pub entries: u64,
    pub max: u64,
    /// `entries * 100 / max` (0 when the size is unknown).
    pub fill_pct: u32,
    /// Set when the fill crossed the warning threshold, either way.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub holds: Vec<HoldRef>,
}

/// The drops that happened while one hold lasted: `{"type":"hold_drops",...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HoldDropsFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub agent: SharedStr,
    pub comm: SharedStr,
    pub start_ns: u64,
    pub hold_ns: u64,
    /// Watched drops while the hold went on, counted in the kernel: exact.
    pub dropped: u64,
    /// Sampled drops inside the hold, by class and by reason name: what the drops were.
    pub by_class: BTreeMap<DropClass, u64>,
    pub by_reason: BTreeMap<String, u64>,
    pub samples: u64,
}

/// The `drops` block of the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DropSummary {
    /// Exact count of watched drops.
    pub total: u64,
    pub by_class: BTreeMap<DropClass, u64>,
    pub by_reason: BTreeMap<String, u64>,
    /// By function (`nf_hook_slow`), not by offset.
    pub by_location: BTreeMap<String, u64>,
    pub by_netns: BTreeMap<u32, u64>,
    pub samples: u64,
    /// Drops while a watched lock was held, counted in the kernel per hold.
    pub during_holds: u64,
    /// Drops the kernel counted without a key (its key map was full).
    pub overflow: u64,
    /// Sum of the conntrack deltas, all namespaces.
    pub conntrack: ConntrackCounters,
    /// Fullest the conntrack table was seen, percent.
    pub conntrack_max_fill_pct: u32,
    pub conntrack_warnings: u64,
    /// Holds with the most drops, most first (at most 5).
    pub worst_holds: Vec<HoldDropsFact>,
    /// Connections refused, as seen in conntrack's own functions (exact, where those hooks
    /// attached; the counter deltas above are the cross-check). Absent when none were seen.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub conntrack_refused: BTreeMap<DropClass, u64>,
}

/// One hold's running tally.
#[derive(Clone, Debug)]
struct Tally {
    hold: HoldRef,
    /// End, once the hold fact arrived.
    end_ns: Option<u64>,
    dropped: u64,
    by_class: BTreeMap<DropClass, u64>,
    by_reason: BTreeMap<String, u64>,
    samples: u64,
}

#[derive(Debug, Default)]
pub struct DropTracker {
    reasons: HashMap<u32, String>,
    has_reason: bool,
    host_netns: u32,
    symbols: HashMap<u64, (String, u64)>,
    warn_pct: u32,
    /// Conntrack deltas per netns for the tick in progress, and what is left of them to
    /// explain drop counts with.
    ct_tick: HashMap<u32, ConntrackCounters>,
    ct_budget: HashMap<u32, ConntrackCounters>,
    /// What the previous tick's deltas did not explain: the source reads the drop counters
    /// before conntrack's, so a packet conntrack refused just after the first read shows in
    /// this tick's conntrack deltas and in the next tick's drop counts.
    ct_carry: HashMap<u32, ConntrackCounters>,
    /// Previous tick's deltas (samples may arrive one tick late).
    ct_prev: HashMap<u32, ConntrackCounters>,
    /// Netns whose conntrack counters are read.
    ct_watched: std::collections::HashSet<u32>,
    ct_above: HashMap<u32, bool>,
    pending: Vec<(DropSample, Option<HoldRef>)>,
    ended: VecDeque<HoldRef>,
    /// In the order they were opened (the order they are reported in).
    tallies: Vec<Tally>,
    /// Position in `tallies` by (hold start, lock). Every ended hold looks its tally up, and
    /// in a lock storm the list is full: holds that end after the tick's counts were read
    /// wait a tick (a linear search there took 40 % of the collector's CPU).
    tally_at: FastMap<(u64, SharedStr), usize>,
    stats: DropSummary,
    worst: Vec<HoldDropsFact>,
}

fn proto_name(p: u8) -> String {
    match p {
        0 => "hopopt".into(),
        1 => "icmp".into(),
        6 => "tcp".into(),
        17 => "udp".into(),
        58 => "icmpv6".into(),
        n => n.to_string(),
    }
}

fn packet_info(s: &DropSample) -> Option<PacketInfo> {
    packet(s.l4proto, s.saddr, s.daddr, s.sport, s.dport)
}

fn packet(
    l4proto: u8,
    saddr: Option<IpAddr>,
    daddr: Option<IpAddr>,
    sport: u16,
    dport: u16,
) -> Option<PacketInfo> {
    let (saddr, daddr) = (saddr?, daddr?);
    let ports = matches!(l4proto, 6 | 17);
    let icmp = matches!(l4proto, 1 | 58);
    Some(PacketInfo {
        proto: proto_name(l4proto),
        saddr: saddr.to_string(),
        daddr: daddr.to_string(),
        sport: ports.then_some(sport),
        dport: ports.then_some(dport),
        icmp_type: icmp.then_some(sport as u8),
        icmp_code: icmp.then_some(dport as u8),
    })
}

/// `udp 10.0.0.1:5353 -> 10.0.0.2:53` for people.
pub fn packet_text(p: &PacketInfo) -> String {
    let addr = |a: &str, port: Option<u16>| match (port, a.parse::<IpAddr>()) {
        (Some(port), Ok(IpAddr::V6(_))) => format!("[{a}]:{port}"),
        (Some(port), _) => format!("{a}:{port}"),
        (None, _) => a.to_string(),
    };
    let mut s = format!(
        "{} {} -> {}",
        p.proto,
        addr(&p.saddr, p.sport),
        addr(&p.daddr, p.dport)
    );
    if let (Some(t), Some(c)) = (p.icmp_type, p.icmp_code) {
        s.push_str(&format!(" type {t} code {c}"));
    }
    s
}

fn add(m: &mut BTreeMap<String, u64>, k: &str, n: u64) {
    if let Some(v) = m.get_mut(k) {
        *v += n;
    } else if m.len() >= MAX_KEYS {
        *m.entry(OTHER.to_string()).or_default() += n;
    } else {
        m.insert(k.to_string(), n);
    }
}

impl DropTracker {
    pub fn new(warn_pct: u32) -> Self {
        DropTracker {
            warn_pct,
            has_reason: true,
            ..Default::default()
        }
    }

    pub fn set_warn_pct(&mut self, pct: u32) {
        self.warn_pct = pct;
    }

    pub fn on_setup(&mut self, has_reason: bool, names: &[(u32, String)], host_netns: u32) {
        self.has_reason = has_reason;
        self.host_netns = host_netns;
        self.reasons = names.iter().cloned().collect();
    }

    pub fn on_symbol(&mut self, addr: u64, name: &str, offset: u64) {
        self.symbols.insert(addr, (name.to_string(), offset));
    }

    /// The recording's host netns inode (0 when unknown).
    pub fn host_netns(&self) -> u32 {
        self.host_netns
    }

    fn reason_name(&self, r: u32) -> String {
        if !self.has_reason {
            return "unknown".into();
        }
        match self.reasons.get(&r) {
            Some(n) => n.clone(),
            None => format!("reason {r}"),
        }
    }

    fn location(&self, addr: u64) -> (String, Option<&str>) {
        match self.symbols.get(&addr) {
            Some((f, off)) => (format!("{f}+{off:#x}"), Some(f.as_str())),
            None => (format!("{addr:#x}"), None),
        }
    }

    /// `None`: not a netfilter drop. `Some(true)`: NETFILTER_DROP at `nf_hook_slow` (or at a
    /// location that could not be named), where conntrack's drops show up too;
    /// `Some(false)`: NETFILTER_DROP elsewhere, a rule's.
    fn netfilter(&self, reason: u32, location: u64) -> Option<bool> {
        if self.reasons.get(&reason).map(String::as_str) != Some("NETFILTER_DROP") {
            return None;
        }
        Some(
            self.location(location)
                .1
                .is_none_or(|f| f == "nf_hook_slow"),
        )
    }

    /// A sample arrives; `hold` is the hold open at its time. Classified at the next tick.
    pub fn on_sample(
        &mut self,
        s: &DropSample,
        hold: Option<HoldRef>,
        out: &mut impl FnMut(Output),
    ) {
        self.stats.samples += 1;
        if let Some(h) = &hold {
            if let Some(t) = self.tally(h) {
                t.samples += 1;
            }
        }
        if self.pending.len() >= MAX_PENDING_SAMPLES {
            self.emit_sample(s, hold, out);
            return;
        }
        self.pending.push((*s, hold));
    }

    fn sample_class(&self, s: &DropSample) -> DropClass {
        match self.netfilter(s.reason, s.location) {
            None => return DropClass::Other,
            Some(false) => return DropClass::NetfilterRuleDrop,
            Some(true) => {}
        }
        let now = self.ct_tick.get(&s.netns).copied().unwrap_or_default();
        let prev = self.ct_prev.get(&s.netns).copied().unwrap_or_default();
        let ct = now.saturating_add(&prev);
        if !self.ct_watched.contains(&s.netns) {
            DropClass::NetfilterDrop
        } else if ct.drop > 0 {
            DropClass::ConntrackTableFull
        } else if ct.insert_failed > 0 {
            DropClass::ConntrackInsertFailed
        } else {
            DropClass::NetfilterRuleDrop
        }
    }

    /// Classifies a sample, adds it to its hold's kinds of drops, and emits it; returns its
    /// packet.
    fn emit_sample(
        &mut self,
        s: &DropSample,
        hold: Option<HoldRef>,
        out: &mut impl FnMut(Output),
    ) -> Option<PacketInfo> {
        let f = self.sample_fact(s, hold);
        if let Some(h) = &f.hold {
            let (class, reason) = (f.class, f.reason.clone());
            if let Some(t) = self.tally(h) {
                *t.by_class.entry(class).or_default() += 1;
                *t.by_reason.entry(reason).or_default() += 1;
            }
        }
        let packet = f.packet.clone();
        out(Output::Drop(f));
        packet
    }

    fn sample_fact(&self, s: &DropSample, hold: Option<HoldRef>) -> DropFact {
        DropFact {
            ts_ns: s.ts_ns,
            netns: s.netns,
            ifindex: s.ifindex,
            reason: self.reason_name(s.reason),
            reason_code: s.reason,
            location: self.location(s.location).0,
            class: self.sample_class(s),
            packet: packet_info(s),
            pid: s.tgid,
            hold,
        }
    }

    /// A refusal seen in conntrack's own function; `hold` is the hold open at its time.
    pub fn on_conntrack_fail(
        &mut self,
        c: &ConntrackFail,
        hold: Option<HoldRef>,
        out: &mut impl FnMut(Output),
    ) {
        let (class, function) = match c.what {
            CtFailKind::InsertFailed => {
                (DropClass::ConntrackInsertFailed, "__nf_conntrack_confirm")
            }
            CtFailKind::TableFull => (DropClass::ConntrackTableFull, "__nf_conntrack_alloc"),
        };
        *self.stats.conntrack_refused.entry(class).or_default() += 1;
        out(Output::ConntrackRefused(ConntrackRefusedFact {
            ts_ns: c.ts_ns,
            netns: c.netns,
            class,
            function,
            packet: packet(c.l4proto, c.saddr, c.daddr, c.sport, c.dport),
            pid: c.tgid,
            comm: c.comm.as_str().into_owned(),
            hold,
        }));
    }

    /// Conntrack deltas of one netns for the tick in progress.
    pub fn on_conntrack(
        &mut self,
        c: &ConntrackStats,
        holds: Vec<HoldRef>,
        out: &mut impl FnMut(Output),
    ) {
        self.ct_watched.insert(c.netns);
        self.ct_tick.insert(c.netns, c.deltas);
        let carry = self.ct_carry.remove(&c.netns).unwrap_or_default();
        self.ct_budget
            .insert(c.netns, c.deltas.saturating_add(&carry));
        let fill_pct = c
            .count
            .saturating_mul(100)
            .checked_div(c.max)
            .map_or(0, |p| u32::try_from(p).unwrap_or(u32::MAX));
        self.stats.conntrack = self.stats.conntrack.saturating_add(&c.deltas);
        self.stats.conntrack_max_fill_pct = self.stats.conntrack_max_fill_pct.max(fill_pct);
        let above = self.warn_pct > 0 && c.max > 0 && fill_pct >= self.warn_pct;
        let was = self.ct_above.insert(c.netns, above).unwrap_or(false);
        let warning = match (was, above) {
            (false, true) => {
                self.stats.conntrack_warnings += 1;
                Some(format!(
                    "conntrack table {fill_pct}% full ({} of {}), above {}%",
                    c.count, c.max, self.warn_pct
                ))
            }
            (true, false) => Some(format!(
                "conntrack table back to {fill_pct}% ({} of {})",
                c.count, c.max
            )),
            _ => None,
        };
        let start = c.ts_ns.saturating_sub(c.interval_ns);
        if c.deltas.is_zero() && warning.is_none() {
            return;
        }
        out(Output::Conntrack(ConntrackFact {
            ts_ns: start,
            interval_ns: c.interval_ns,
            netns: c.netns,
            deltas: c.deltas,
            entries: c.count,
            max: c.max,
            fill_pct,
            warning,
            holds,
        }));
    }

    /// The tally of `h`, opened if there is room.
    fn tally(&mut self, h: &HoldRef) -> Option<&mut Tally> {
        let key = (h.start_ns, h.lock.clone());
        let i = match self.tally_at.get(&key) {
            Some(&i) => i,
            None if self.tallies.len() < MAX_TALLIES => {
                self.tallies.push(Tally::new(h.clone()));
                self.tally_at.insert(key, self.tallies.len() - 1);
                self.tallies.len() - 1
            }
            None => return None,
        };
        Some(&mut self.tallies[i])
    }

    /// Replaces the tallies (after some were reported) and their index.
    fn set_tallies(&mut self, tallies: Vec<Tally>) {
        self.tally_at.clear();
        for (i, t) in tallies.iter().enumerate() {
            self.tally_at
                .insert((t.hold.start_ns, t.hold.lock.clone()), i);
        }
        self.tallies = tallies;
    }

    /// A hold ended: remembered for counts that cover its end.
    pub fn on_hold(&mut self, h: &HoldFact) {
        let r = HoldRef {
            lock: h.lock.clone(),
            pid: h.pid,
            agent: h.agent.clone(),
            comm: h.comm.clone(),
            start_ns: h.start_ns,
            hold_ns: Some(h.hold_ns),
        };
        if let Some(t) = self
            .tally_at
            .get(&(r.start_ns, r.lock.clone()))
            .and_then(|&i| self.tallies.get_mut(i))
        {
            t.hold = r.clone();
            t.end_ns = Some(h.start_ns.saturating_add(h.hold_ns));
        }
        if self.ended.len() >= MAX_ENDED_HOLDS {
            self.ended.pop_front();
        }
        self.ended.push_back(r);
    }

    /// Holds that ended within `(t0, t1]` or later (for the counts of that interval).
    pub fn ended_since(&self, t0: u64) -> impl Iterator<Item = &HoldRef> {
        self.ended
            .iter()
            .filter(move |h| h.start_ns.saturating_add(h.hold_ns.unwrap_or(0)) > t0)
    }

    /// The counts of the tick: classifies them, emits them and the samples of the tick,
    /// adds them to the holds they overlap, and reports holds whose end they cover.
    /// `holds` are the holds that overlapped the interval.
    pub fn on_counts(&mut self, c: &DropCounts, holds: Vec<HoldRef>, out: &mut impl FnMut(Output)) {
        let start = c.ts_ns.saturating_sub(c.interval_ns);
        // Samples of the tick first: they are classified with this tick's conntrack deltas.
        let pending = std::mem::take(&mut self.pending);
        let mut examples: HashMap<(u32, u32, u64), PacketInfo> = HashMap::new();
        for (s, hold) in pending {
            if let Some(p) = self.emit_sample(&s, hold, out) {
                examples.entry((s.netns, s.reason, s.location)).or_insert(p);
            }
        }
        let mut facts = Vec::new();
        for dc in &c.counts {
            let reason = self.reason_name(dc.reason);
            let (location, func) = self.location(dc.location);
            let func = func.unwrap_or(&location).to_string();
            let mut split: Vec<(DropClass, u64)> = Vec::new();
            let nf = self.netfilter(dc.reason, dc.location);
            if nf == Some(false) {
                split.push((DropClass::NetfilterRuleDrop, dc.count));
            } else if nf == Some(true) {
                if self.ct_watched.contains(&dc.netns) {
                    let b = self.ct_budget.entry(dc.netns).or_default();
                    let full = dc.count.min(b.drop);
                    b.drop -= full;
                    let race = (dc.count - full).min(b.insert_failed);
                    b.insert_failed -= race;
                    let rule = dc.count - full - race;
                    split.extend(
                        [
                            (DropClass::ConntrackTableFull, full),
                            (DropClass::ConntrackInsertFailed, race),
                            (DropClass::NetfilterRuleDrop, rule),
                        ]
                        .into_iter()
                        .filter(|(_, n)| *n > 0),
                    );
                } else {
                    split.push((DropClass::NetfilterDrop, dc.count));
                }
            } else {
                split.push((DropClass::Other, dc.count));
            }
            let example = examples.get(&(dc.netns, dc.reason, dc.location)).cloned();
            for (class, n) in split {
                self.stats.total += n;
                *self.stats.by_class.entry(class).or_default() += n;
                add(&mut self.stats.by_reason, &reason, n);
                add(&mut self.stats.by_location, &func, n);
                if let Some(v) = self.stats.by_netns.get_mut(&dc.netns) {
                    *v += n;
                } else if self.stats.by_netns.len() < MAX_KEYS {
                    self.stats.by_netns.insert(dc.netns, n);
                }
                facts.push(DropCountFact {
                    ts_ns: start,
                    interval_ns: c.interval_ns,
                    netns: dc.netns,
                    reason: reason.clone(),
                    reason_code: dc.reason,
                    location: location.clone(),
                    class,
                    count: n,
                    holds: holds.clone(),
                    example: example.clone(),
                });
            }
        }
        if c.overflow > 0 {
            self.stats.overflow += c.overflow;
            self.stats.total += c.overflow;
            *self.stats.by_class.entry(DropClass::Other).or_default() += c.overflow;
            add(
                &mut self.stats.by_reason,
                "unknown (counter map full)",
                c.overflow,
            );
        }
        for f in facts {
            out(Output::DropCount(f));
        }
        // The kernel's count for each hold so far; a count of a hold still going on grows at
        // later reads, and a read can miss a CPU's share only by coming later, so the
        // largest is the truest.
        if !c.holds.is_empty() {
            let by_start: FastMap<u64, &HoldRef> = holds.iter().map(|h| (h.start_ns, h)).collect();
            for hc in &c.holds {
                if let Some(h) = by_start.get(&hc.start_ns) {
                    if let Some(t) = self.tally(h) {
                        t.dropped = t.dropped.max(hc.count);
                    }
                }
            }
        }
        self.end_tick();
        // Holds whose end these counts cover are complete.
        let (done, keep): (Vec<Tally>, Vec<Tally>) = std::mem::take(&mut self.tallies)
            .into_iter()
            .partition(|t| t.end_ns.is_some_and(|e| e <= c.ts_ns));
        self.set_tallies(keep);
        for t in done {
            self.report(t, out);
        }
    }

    /// Conntrack deltas of a tick without drop counts still end the tick.
    pub fn end_tick(&mut self) {
        self.ct_prev = std::mem::take(&mut self.ct_tick);
        // Only the drop and insert_failed budgets matter; carried one tick, not longer.
        self.ct_carry = std::mem::take(&mut self.ct_budget)
            .into_iter()
            .map(|(ns, b)| {
                let tick = self.ct_prev.get(&ns).copied().unwrap_or_default();
                let keep = ConntrackCounters {
                    drop: b.drop.min(tick.drop),
                    insert_failed: b.insert_failed.min(tick.insert_failed),
                    ..Default::default()
                };
                (ns, keep)
            })
            .filter(|(_, k)| !k.is_zero())
            .collect();
    }

    fn report(&mut self, t: Tally, out: &mut impl FnMut(Output)) {
        if t.dropped == 0 && t.samples == 0 {
            return;
        }
        let f = HoldDropsFact {
            lock: t.hold.lock,
            pid: t.hold.pid,
            agent: t.hold.agent,
            comm: t.hold.comm,
            start_ns: t.hold.start_ns,
            hold_ns: t.hold.hold_ns.unwrap_or(0),
            dropped: t.dropped,
            by_class: t.by_class,
            by_reason: t.by_reason,
            samples: t.samples,
        };
        self.stats.during_holds += f.dropped;
        self.worst.push(f.clone());
        self.worst.sort_by_key(|h| std::cmp::Reverse(h.dropped));
        self.worst.truncate(5);
        out(Output::HoldDrops(f));
    }

    /// End of the stream: samples still waiting and holds not reported yet.
    pub fn finish(&mut self, ts_ns: u64, out: &mut impl FnMut(Output)) {
        for (s, hold) in std::mem::take(&mut self.pending) {
            self.emit_sample(&s, hold, out);
        }
        self.tally_at.clear();
        for mut t in std::mem::take(&mut self.tallies) {
            if t.hold.hold_ns.is_none() {
                t.hold.hold_ns = Some(ts_ns.saturating_sub(t.hold.start_ns));
            }
            self.report(t, out);
        }
    }

    pub fn summary(&self) -> DropSummary {
        let mut s = self.stats.clone();
        s.worst_holds = self.worst.clone();
        s
    }
}

impl Tally {
    fn new(hold: HoldRef) -> Self {
        // A hold that already ended (from `ended`) is complete once counts cover its end;
        // without its end here its tally would wait for the end of tracing.
        let end_ns = hold.hold_ns.map(|d| hold.start_ns.saturating_add(d));
        Tally {
            hold,
            end_ns,
            dropped: 0,
            by_class: BTreeMap::new(),
            by_reason: BTreeMap::new(),
            samples: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{Analyzer, WatchedLock};
    use crate::decode::{Comm, DropCount, Event, LockEvent, LockOp};

    const S: u64 = 1_000_000_000;
    const NS_B: u32 = 4026532246;
    const NF: u64 = 0xffff_ffff_81a0_007d;
    const UDP: u64 = 0xffff_ffff_81b0_04bc;

    fn setup() -> Analyzer {
        let mut a = Analyzer::new(vec![WatchedLock::new("/run/xtables.lock", 25, 42)]);
        for ev in [
            Event::DropSetup {
                ts_ns: 0,
                has_reason: true,
                host_netns: 4026531833,
                names: vec![(3, "NO_SOCKET".into()), (12, "NETFILTER_DROP".into())],
            },
            Event::KernelSymbol {
                ts_ns: 0,
                addr: NF,
                name: "nf_hook_slow".into(),
                offset: 0x7d,
            },
            Event::KernelSymbol {
                ts_ns: 0,
                addr: UDP,
                name: "__udp4_lib_rcv".into(),
                offset: 0x4bc,
            },
        ] {
            assert!(a.process_collect(&ev).is_empty());
        }
        a
    }

    fn ct(ts: u64, drop: u64, insert_failed: u64, count: u64) -> Event {
        Event::Conntrack(Box::new(ConntrackStats {
            ts_ns: ts,
            interval_ns: S,
            netns: NS_B,
            deltas: ConntrackCounters {
                drop,
                insert_failed,
                ..Default::default()
            },
            count,
            max: 100,
        }))
    }

    fn counts(ts: u64, c: &[(u64, u32, u64)]) -> Event {
        counts_in_holds(ts, c, &[])
    }

    /// Drop counts with the kernel's per-hold counts: (hold start, drops so far).
    fn counts_in_holds(ts: u64, c: &[(u64, u32, u64)], holds: &[(u64, u64)]) -> Event {
        Event::DropCounts(DropCounts {
            ts_ns: ts,
            interval_ns: S,
            counts: c
                .iter()
                .map(|&(location, reason, count)| DropCount {
                    location,
                    reason,
                    netns: NS_B,
                    count,
                })
                .collect(),
            overflow: 0,
            holds: holds
                .iter()
                .map(|&(start_ns, count)| crate::decode::HoldDropCount { start_ns, count })
                .collect(),
        })
    }

    fn lock(ts: u64, op: LockOp) -> Event {
        Event::Lock(LockEvent {
            ts_ns: ts,
            tgid: 100,
            tid: 100,
            comm: Comm::new("kube-proxy"),
            owner: 0xA,
            dev: 25,
            ino: 42,
            op,
            nonblocking: false,
        })
    }

    fn hold_drops(out: &[Output]) -> Vec<&HoldDropsFact> {
        out.iter()
            .filter_map(|o| match o {
                Output::HoldDrops(h) => Some(h),
                _ => None,
            })
            .collect()
    }

    fn sample(ts: u64, location: u64, reason: u32) -> Event {
        Event::Drop(DropSample {
            ts_ns: ts,
            tgid: 0,
            tid: 0,
            location,
            netns: NS_B,
            ifindex: 5,
            reason,
            ethertype: 0x0800,
            l4proto: 17,
            saddr: Some("10.99.0.1".parse().unwrap()),
            daddr: Some("10.99.0.2".parse().unwrap()),
            sport: 40000,
            dport: 9999,
        })
    }

    fn count_facts(out: &[Output]) -> Vec<(DropClass, u64)> {
        out.iter()
            .filter_map(|o| match o {
                Output::DropCount(d) => Some((d.class, d.count)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn conntrack_explains_netfilter_drops_first_then_rules() {
        let mut a = setup();
        let mut out = a.process_collect(&ct(2 * S, 30, 5, 100));
        assert!(
            matches!(&out[0], Output::Conntrack(c) if c.deltas.drop == 30 && c.fill_pct == 100
            && c.warning.is_some())
        );
        out = a.process_collect(&counts(2 * S, &[(NF, 12, 50), (UDP, 3, 7)]));
        assert_eq!(
            count_facts(&out),
            [
                (DropClass::ConntrackTableFull, 30),
                (DropClass::ConntrackInsertFailed, 5),
                (DropClass::NetfilterRuleDrop, 15),
                (DropClass::Other, 7)
            ]
        );
        // Next second: conntrack quiet, all rule drops.
        a.process_collect(&ct(3 * S, 0, 0, 10));
        let out = a.process_collect(&counts(3 * S, &[(NF, 12, 4)]));
        assert_eq!(count_facts(&out), [(DropClass::NetfilterRuleDrop, 4)]);
        let s = a.summary().drops;
        assert_eq!(s.total, 61);
        assert_eq!(s.by_class[&DropClass::ConntrackTableFull], 30);
        assert_eq!(s.by_class[&DropClass::NetfilterRuleDrop], 19);
        assert_eq!(s.by_location["nf_hook_slow"], 54);
        assert_eq!(s.by_reason["NO_SOCKET"], 7);
        assert_eq!(s.conntrack.drop, 30);
        assert_eq!(s.conntrack_warnings, 1);
    }

    #[test]
    fn unwatched_netns_cannot_tell_rules_from_conntrack() {
        let mut a = setup();
        let out = a.process_collect(&counts(2 * S, &[(NF, 12, 9)]));
        assert_eq!(count_facts(&out), [(DropClass::NetfilterDrop, 9)]);
    }

    #[test]
    fn drops_during_a_hold_are_reported_with_it() {
        let mut a = setup();
        a.process_collect(&lock(S + S / 2, LockOp::Acquired { exclusive: true }));
        a.process_collect(&ct(2 * S, 0, 0, 1));
        let out = a.process_collect(&sample(2 * S + 1, NF, 12));
        assert!(out.is_empty(), "samples wait for their tick");
        // 1,204 drops in the second, 1,200 of them while the hold went on.
        let out = a.process_collect(&counts_in_holds(
            3 * S,
            &[(NF, 12, 1204)],
            &[(S + S / 2, 1200)],
        ));
        let Some(Output::Drop(d)) = out.first() else {
            panic!("{out:?}")
        };
        assert_eq!(d.class, DropClass::NetfilterRuleDrop);
        assert_eq!(d.hold.as_ref().unwrap().agent, "kube-proxy");
        assert_eq!(d.location, "nf_hook_slow+0x7d");
        let p = d.packet.as_ref().unwrap();
        assert_eq!(
            (p.proto.as_str(), p.dport, p.daddr.as_str()),
            ("udp", Some(9999), "10.99.0.2")
        );
        let Some(Output::DropCount(c)) = out.get(1) else {
            panic!("{out:?}")
        };
        assert_eq!(c.holds.len(), 1);
        assert_eq!(c.example.as_ref().unwrap().sport, Some(40000));
        // The hold ends at 3.8 s; the counts up to 4 s complete it.
        let out = a.process_collect(&lock(3 * S + 800_000_000, LockOp::Released));
        assert!(out.iter().any(|o| matches!(o, Output::Hold(_))));
        assert!(!out.iter().any(|o| matches!(o, Output::HoldDrops(_))));
        let out = a.process_collect(&counts_in_holds(
            4 * S,
            &[(NF, 12, 6)],
            &[(S + S / 2, 1206)],
        ));
        let hd = hold_drops(&out);
        assert_eq!(hd.len(), 1);
        // The kernel's count, not the 1,210 of the seconds the hold overlapped.
        assert_eq!(hd[0].dropped, 1206);
        assert_eq!(hd[0].samples, 1);
        assert_eq!(hd[0].hold_ns, 2_300_000_000);
        assert_eq!(hd[0].agent, "kube-proxy");
        // Drops after the hold are not its.
        let out = a.process_collect(&counts(5 * S, &[(NF, 12, 99)]));
        assert!(matches!(&out[0], Output::DropCount(c) if c.holds.is_empty()));
        let s = a.summary().drops;
        assert_eq!(s.during_holds, 1206);
        assert_eq!(s.worst_holds[0].dropped, 1206);
        // For people: the kind of drop comes from the sample inside the hold.
        let text = crate::sinks::terminal::hold_drops_text(hd[0]);
        assert_eq!(
            text,
            "!! 1,206 packets dropped (netfilter rule drop) during kube-proxy's \
             2.30 s hold of /run/xtables.lock (pid 100)"
        );
    }

    #[test]
    fn short_holds_are_reported_at_the_tick_that_covers_them() {
        let mut a = setup();
        // Holds that begin and end between two ticks (the usual iptables run), many of them.
        for i in 0..50 {
            let t = S + S / 2 + i * 1_000_000;
            a.process_collect(&lock(t, LockOp::Acquired { exclusive: true }));
            a.process_collect(&lock(t + 500_000, LockOp::Released));
        }
        // 7 drops in the second: the kernel saw them during the first 7 holds, one each.
        let in_holds: Vec<(u64, u64)> = (0..7).map(|i| (S + S / 2 + i * 1_000_000, 1)).collect();
        let out = a.process_collect(&counts_in_holds(2 * S, &[(NF, 12, 7)], &in_holds));
        let hd = hold_drops(&out);
        // Complete: reported now, not at the end; holds without a drop are not reported,
        // although the second they are in had drops.
        assert_eq!(hd.len(), 7, "{out:?}");
        assert!(hd.iter().all(|h| h.dropped == 1 && h.hold_ns == 500_000));
        assert_eq!(a.summary().drops.during_holds, 7);
        // Nothing left over for the end of tracing.
        let mut rest = Vec::new();
        a.finish(3 * S, &mut |o| rest.push(o));
        assert!(!rest.iter().any(|o| matches!(o, Output::HoldDrops(_))));
    }

    /// A shared hold by process `pid` (its own open file).
    fn shared(ts: u64, pid: u32, op: LockOp) -> Event {
        let Event::Lock(mut e) = lock(ts, op) else {
            unreachable!()
        };
        (e.tgid, e.tid, e.owner) = (pid, pid, 0x1000 + u64::from(pid));
        Event::Lock(e)
    }

    #[test]
    fn many_open_holds_each_get_their_own_end() {
        let mut a = setup();
        // 300 shared holds open when the counts of 1.65 s arrive: 300 tallies, each found
        // again when its hold ends, in another order than they were opened.
        for i in 0..300u32 {
            let t = S + S / 2 + u64::from(i) * 1_000;
            a.process_collect(&shared(t, 1000 + i, LockOp::Acquired { exclusive: false }));
        }
        let start = |i: u32| S + S / 2 + u64::from(i) * 1_000;
        let so_far: Vec<(u64, u64)> = (0..300).map(|i| (start(i), 7)).collect();
        let out = a.process_collect(&counts_in_holds(S + 650_000_000, &[(NF, 12, 7)], &so_far));
        assert!(hold_drops(&out).is_empty(), "none has ended");
        for i in (0..300u32).rev() {
            let t = S + 700_000_000 + u64::from(i) * 2_000;
            a.process_collect(&shared(t, 1000 + i, LockOp::Released));
        }
        let at_end: Vec<(u64, u64)> = (0..300).map(|i| (start(i), 10)).collect();
        let out = a.process_collect(&counts_in_holds(
            2 * S + 650_000_000,
            &[(NF, 12, 3)],
            &at_end,
        ));
        let hd = hold_drops(&out);
        assert_eq!(hd.len(), 300);
        let mut pids: Vec<u32> = hd.iter().map(|h| h.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        assert_eq!(pids.len(), 300, "each hold once");
        for h in &hd {
            let i = u64::from(h.pid - 1000);
            assert_eq!(h.hold_ns, 200_000_000 + i * 1_000, "{h:?}");
            assert_eq!(h.dropped, 10, "{h:?}");
        }
        let mut rest = Vec::new();
        a.finish(3 * S, &mut |o| rest.push(o));
        assert!(!rest.iter().any(|o| matches!(o, Output::HoldDrops(_))));
    }

    #[test]
    fn finish_reports_open_holds_and_waiting_samples() {
        let mut a = setup();
        a.process_collect(&lock(S, LockOp::Acquired { exclusive: true }));
        a.process_collect(&counts_in_holds(2 * S, &[(UDP, 3, 2)], &[(S, 2)]));
        a.process_collect(&sample(2 * S + 5, UDP, 3));
        let mut out = Vec::new();
        a.finish(3 * S, &mut |o| out.push(o));
        assert!(out
            .iter()
            .any(|o| matches!(o, Output::Drop(d) if d.reason == "NO_SOCKET")));
        assert!(out
            .iter()
            .any(|o| matches!(o, Output::HoldDrops(h) if h.dropped == 2 && h.hold_ns == 2 * S)));
    }

    #[test]
    fn json_shapes() {
        let mut a = setup();
        a.process_collect(&ct(2 * S, 3, 0, 90));
        let out = a.process_collect(&counts(2 * S, &[(NF, 12, 3)]));
        let v = serde_json::to_value(&out[0]).unwrap();
        assert_eq!(v["type"], "drop_count");
        assert_eq!(v["class"], "conntrack_table_full");
        assert_eq!(v["reason"], "NETFILTER_DROP");
        assert_eq!(v["count"], 3);
        let mut a = setup();
        let out = a.process_collect(&ct(2 * S, 3, 1, 90));
        let v = serde_json::to_value(&out[0]).unwrap();
        assert_eq!(v["type"], "conntrack");
        assert_eq!(
            (v["drop"].as_u64(), v["insert_failed"].as_u64()),
            (Some(3), Some(1))
        );
        assert_eq!(v["fill_pct"], 90);
        let s = serde_json::to_value(a.summary()).unwrap();
        assert_eq!(s["drops"]["conntrack"]["drop"], 3);
        assert!(s["drops"]["by_class"].is_object());
    }
}
