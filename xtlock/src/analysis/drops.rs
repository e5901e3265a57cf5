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

use super::facts::{
    ConntrackFact, ConntrackRefusedFact, DropClass, DropCountFact, DropFact, HoldDropsFact,
    HoldFact, HoldRef, Output, PacketInfo,
};
use super::procs::FastMap;
use crate::decode::{
    ConntrackCounters, ConntrackFail, ConntrackStats, CtFailKind, DropCounts, DropSample,
};
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
    /// The kernel's per-reason counts of the read that gave `dropped`, when it had them.
    kernel_reasons: Option<Vec<(u32, u64)>>,
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

/// IP protocol numbers (`IPPROTO_*`) a drop's packet is named by.
pub(super) const HOPOPT: u8 = libc::IPPROTO_HOPOPTS as u8;
pub(super) const ICMP: u8 = libc::IPPROTO_ICMP as u8;
pub(super) const TCP: u8 = libc::IPPROTO_TCP as u8;
pub(super) const UDP: u8 = libc::IPPROTO_UDP as u8;
pub(super) const ICMPV6: u8 = libc::IPPROTO_ICMPV6 as u8;

fn proto_name(p: u8) -> String {
    match p {
        HOPOPT => "hopopt".into(),
        ICMP => "icmp".into(),
        TCP => "tcp".into(),
        UDP => "udp".into(),
        ICMPV6 => "icmpv6".into(),
        n => n.to_string(),
    }
}

pub(super) fn packet_info(s: &DropSample) -> Option<PacketInfo> {
    packet(s.l4proto, s.saddr, s.daddr, s.sport, s.dport)
}

pub(super) fn packet(
    l4proto: u8,
    saddr: Option<IpAddr>,
    daddr: Option<IpAddr>,
    sport: u16,
    dport: u16,
) -> Option<PacketInfo> {
    let (saddr, daddr) = (saddr?, daddr?);
    let ports = matches!(l4proto, TCP | UDP);
    let icmp = matches!(l4proto, ICMP | ICMPV6);
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

/// Adds `n` under `k`, pooling keys past the table's bound under `(other)`.
pub(super) fn add(m: &mut BTreeMap<String, u64>, k: &str, n: u64) {
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
            agent: h.who.agent.clone(),
            comm: h.who.comm.clone(),
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
                        if hc.count >= t.dropped && !hc.by_reason.is_empty() {
                            t.kernel_reasons = Some(hc.by_reason.clone());
                        }
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

    /// A hold's drops by reason name and by class from the kernel's exact per-reason counts.
    /// A reason other than NETFILTER_DROP is class `other`; NETFILTER_DROP drops are split
    /// among the netfilter classes as the hold's samples were (conntrack's refusals and a
    /// rule's share that reason, and only the conntrack deltas tell them apart), all of
    /// them `netfilter_drop` without samples. Reasons the kernel had no room for are
    /// `(other reasons)`.
    fn exact_kinds(
        &self,
        t: &Tally,
        kernel: &[(u32, u64)],
    ) -> (BTreeMap<DropClass, u64>, BTreeMap<String, u64>) {
        let mut by_reason = BTreeMap::new();
        let mut by_class = BTreeMap::new();
        let mut netfilter = 0;
        for &(r, n) in kernel {
            let name = self.reason_name(r);
            if name == "NETFILTER_DROP" {
                netfilter += n;
            } else {
                *by_class.entry(DropClass::Other).or_default() += n;
            }
            add(&mut by_reason, &name, n);
        }
        let named: u64 = kernel.iter().map(|&(_, n)| n).sum();
        let rest = t.dropped.saturating_sub(named);
        if rest > 0 {
            add(&mut by_reason, "(other reasons)", rest);
            *by_class.entry(DropClass::Other).or_default() += rest;
        }
        for (class, n) in split_like(netfilter, &t.by_class) {
            *by_class.entry(class).or_default() += n;
        }
        (by_class, by_reason)
    }

    fn report(&mut self, t: Tally, out: &mut impl FnMut(Output)) {
        if t.dropped == 0 && t.samples == 0 {
            return;
        }
        let exact = t.kernel_reasons.as_deref().map(|k| self.exact_kinds(&t, k));
        let exact_reasons = exact.is_some();
        let (by_class, by_reason) = exact.unwrap_or((t.by_class, t.by_reason));
        let f = HoldDropsFact {
            lock: t.hold.lock,
            pid: t.hold.pid,
            agent: t.hold.agent,
            comm: t.hold.comm,
            start_ns: t.hold.start_ns,
            hold_ns: t.hold.hold_ns.unwrap_or(0),
            // Each sample is a packet dropped inside the hold: a floor for a kernel count
            // that missed the hold (not read yet, or a capture without per-hold counts).
            dropped: t.dropped.max(t.samples),
            by_class,
            by_reason,
            samples: t.samples,
            exact_reasons,
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
            kernel_reasons: None,
        }
    }
}

/// `n` NETFILTER_DROP drops split among the netfilter classes in the proportions of the
/// sampled ones (largest remainders, so the parts add up to `n`); all `netfilter_drop`
/// when no netfilter drop was sampled.
fn split_like(n: u64, sampled: &BTreeMap<DropClass, u64>) -> Vec<(DropClass, u64)> {
    if n == 0 {
        return Vec::new();
    }
    let nf: Vec<(DropClass, u64)> = sampled
        .iter()
        .filter(|(c, k)| **c != DropClass::Other && **k > 0)
        .map(|(c, k)| (*c, *k))
        .collect();
    let total: u64 = nf.iter().map(|(_, k)| k).sum();
    if total == 0 {
        return vec![(DropClass::NetfilterDrop, n)];
    }
    let wide = |x: u64| u128::from(x);
    let mut parts: Vec<(DropClass, u64, u128)> = nf
        .iter()
        .map(|&(c, k)| {
            let p = wide(n) * wide(k);
            // Below n: the quotient fits in u64.
            (c, (p / wide(total)) as u64, p % wide(total))
        })
        .collect();
    let mut left = n - parts.iter().map(|p| p.1).sum::<u64>();
    parts.sort_by_key(|p| std::cmp::Reverse(p.2));
    for p in &mut parts {
        if left == 0 {
            break;
        }
        p.1 += 1;
        left -= 1;
    }
    parts
        .into_iter()
        .filter(|p| p.1 > 0)
        .map(|(c, k, _)| (c, k))
        .collect()
}

#[cfg(test)]
mod tests;
