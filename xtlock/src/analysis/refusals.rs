//! Refusals: connections the node turned away (ICMP destination unreachable or a TCP reset
//! sent) and resets its sockets received, from the kernel's exact counters
//! ([`RefusalCounts`]). Pure, like the rest of the analysis.
//!
//! Each count carries the hold that was in progress when the kernel counted it (its
//! acquire time, `0` for none), so the tie to a hold is exact: no overlap of intervals is
//! guessed. A hold's refusals are reported ([`HoldRefusalsFact`]) once counts read after its
//! end have arrived.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;

use serde::Serialize;
use xtlock_common::{
    REFUSAL_ICMP_UNREACH, REFUSAL_NO_DETAIL, REFUSAL_RST_RECEIVED, REFUSAL_RST_SENT,
};

use super::drops::add;
use super::facts::{
    HoldFact, HoldRef, HoldRefusalsFact, Output, PacketInfo, RefusalCountFact, RefusalFact,
    RefusalGroup, RefusalKind,
};
use crate::decode::{RefusalCount, RefusalCounts, RefusalSample};

/// Ended holds remembered for counts that arrive after them.
const MAX_ENDED_HOLDS: usize = 1024;
/// Holds with refusals not reported yet.
const MAX_TALLIES: usize = 1024;

/// The `refusals` block of the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RefusalSummary {
    /// Exact count of refusals (and resets received).
    pub total: u64,
    /// By kind and detail, e.g. `icmp_unreachable: port unreachable`.
    pub by_kind: BTreeMap<String, u64>,
    /// By destination (`ip:port`).
    pub by_dest: BTreeMap<String, u64>,
    /// While a watched lock was held, counted in the kernel per hold.
    pub during_holds: u64,
    /// Counted without a key (the kernel's key map was full).
    pub overflow: u64,
    /// Holds with the most refusals, most first (at most 5).
    pub worst_holds: Vec<HoldRefusalsFact>,
}

impl RefusalSummary {
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

type GroupKey = (RefusalKind, String, String, u32);

#[derive(Debug)]
struct Tally {
    hold: HoldRef,
    groups: BTreeMap<GroupKey, u64>,
    /// A count of each group, to name the rule behind it when the hold is reported (the
    /// first counts of a namespace may come before its table was read).
    first: BTreeMap<GroupKey, RefusalCount>,
    /// The first sampled packet of each group.
    examples: BTreeMap<GroupKey, PacketInfo>,
}

/// A count tagged with a hold the analysis did not know when it arrived, with its read's
/// interval and the reads since.
#[derive(Debug)]
struct Unplaced {
    rc: RefusalCount,
    start: u64,
    interval_ns: u64,
    reads: u32,
}

/// Reads a count waits for its hold before it is said without one.
const UNPLACED_READS: u32 = 3;

#[derive(Debug, Default)]
pub struct RefusalTracker {
    reset_reasons: HashMap<u32, String>,
    ended: VecDeque<HoldRef>,
    /// By hold start, in the order they were opened.
    tallies: Vec<Tally>,
    /// Counts whose hold's take was not read yet when their counters were: the CPU that
    /// sent the take may still have its ring record reserved, uncommitted, when userspace
    /// reads the ring (hundreds of ms under emulation: the 5.10 guest's `refusals`), while
    /// the counters are a map, read at once. They wait for the hold a few reads.
    unplaced: Vec<Unplaced>,
    stats: RefusalSummary,
}

fn kind_of(k: u8) -> Option<RefusalKind> {
    match k {
        REFUSAL_ICMP_UNREACH => Some(RefusalKind::IcmpUnreachable),
        REFUSAL_RST_SENT => Some(RefusalKind::ResetSent),
        REFUSAL_RST_RECEIVED => Some(RefusalKind::ResetReceived),
        _ => None,
    }
}

/// Names of ICMP destination-unreachable codes (RFC 792, RFC 1812).
fn icmp_code_name(code: u32) -> String {
    match code {
        0 => "net unreachable".into(),
        1 => "host unreachable".into(),
        2 => "protocol unreachable".into(),
        3 => "port unreachable".into(),
        4 => "fragmentation needed".into(),
        9 => "net prohibited".into(),
        10 => "host prohibited".into(),
        13 => "administratively prohibited".into(),
        c => format!("code {c}"),
    }
}

fn dest_text(addr: Option<IpAddr>, port: u16) -> String {
    match addr {
        Some(IpAddr::V6(a)) => format!("[{a}]:{port}"),
        Some(a) => format!("{a}:{port}"),
        None => String::new(),
    }
}

/// The REJECT rule behind a count, from the tables the rule reads know: in the refusing
/// namespace for what the node sent; for a reset a client received, wherever one rule alone
/// matches (the rejecting namespace is the peer's, not the client's).
pub fn rule_for(rules: &super::rules::RuleTracker, rc: &RefusalCount) -> Option<String> {
    use super::rules::rejects::Answer;
    let (netns, answer) = match rc.kind {
        REFUSAL_ICMP_UNREACH => (Some(rc.netns), Answer::Icmp),
        REFUSAL_RST_SENT => (Some(rc.netns), Answer::Reset),
        REFUSAL_RST_RECEIVED => (None, Answer::Reset),
        _ => return None,
    };
    rules.rejecting_rule(netns, rc.addr?, rc.port, answer)
}

impl RefusalTracker {
    fn detail(&self, kind: RefusalKind, code: u32) -> String {
        if code == REFUSAL_NO_DETAIL {
            return String::new();
        }
        match kind {
            RefusalKind::IcmpUnreachable => icmp_code_name(code),
            RefusalKind::ResetSent => self
                .reset_reasons
                .get(&code)
                .cloned()
                .unwrap_or_else(|| format!("reason {code}")),
            RefusalKind::ResetReceived => String::new(),
        }
    }

    /// A hold ended: remembered for counts that arrive after it, and its tally completed.
    pub fn on_hold(&mut self, h: &HoldFact) {
        self.on_hold_ref(HoldRef {
            lock: h.lock.clone(),
            pid: h.pid,
            agent: h.who.agent.clone(),
            comm: h.who.comm.clone(),
            start_ns: h.start_ns,
            hold_ns: Some(h.hold_ns),
        });
    }

    fn on_hold_ref(&mut self, r: HoldRef) {
        if let Some(t) = self
            .tallies
            .iter_mut()
            .find(|t| t.hold.start_ns == r.start_ns && t.hold.lock == r.lock)
        {
            t.hold = r.clone();
        }
        if self.ended.len() >= MAX_ENDED_HOLDS {
            self.ended.pop_front();
        }
        self.ended.push_back(r);
    }

    /// The hold that started at `start_ns`: an open one of `open`, else an ended one.
    fn hold(&self, start_ns: u64, open: &[HoldRef]) -> Option<HoldRef> {
        if start_ns == 0 {
            return None;
        }
        open.iter()
            .chain(self.ended.iter().rev())
            .find(|h| h.start_ns == start_ns)
            .cloned()
    }

    /// The counts of one read: a fact per count, tallies per hold, and the holds whose end
    /// these counts cover. `open` are the holds that overlapped the interval.
    /// `rule_of` names the rule behind a count, when the rule reads know it.
    pub fn on_counts(
        &mut self,
        c: &RefusalCounts,
        open: &[HoldRef],
        rule_of: &dyn Fn(&RefusalCount) -> Option<String>,
        out: &mut impl FnMut(Output),
    ) {
        self.reset_reasons.extend(c.reset_reasons.iter().cloned());
        for u in std::mem::take(&mut self.unplaced) {
            if self.hold(u.rc.hold_start_ns, open).is_some() || u.reads + 1 >= UNPLACED_READS {
                self.count(&u.rc, u.start, u.interval_ns, open, rule_of, out);
            } else {
                self.unplaced.push(Unplaced {
                    reads: u.reads + 1,
                    ..u
                });
            }
        }
        let start = c.ts_ns.saturating_sub(c.interval_ns);
        for rc in &c.counts {
            let unknown = rc.hold_start_ns != 0 && self.hold(rc.hold_start_ns, open).is_none();
            if unknown && self.unplaced.len() < MAX_TALLIES {
                self.unplaced.push(Unplaced {
                    rc: *rc,
                    start,
                    interval_ns: c.interval_ns,
                    reads: 0,
                });
                continue;
            }
            self.count(rc, start, c.interval_ns, open, rule_of, out);
        }
        if c.overflow > 0 {
            self.stats.overflow += c.overflow;
            self.stats.total += c.overflow;
        }
        let (done, keep): (Vec<Tally>, Vec<Tally>) = std::mem::take(&mut self.tallies)
            .into_iter()
            .partition(|t| {
                t.hold
                    .hold_ns
                    .is_some_and(|d| t.hold.start_ns.saturating_add(d) <= c.ts_ns)
            });
        self.tallies = keep;
        for t in done {
            self.report(t, rule_of, out);
        }
    }

    /// One count of a read: its fact, and its hold's tally.
    fn count(
        &mut self,
        rc: &RefusalCount,
        start: u64,
        interval_ns: u64,
        open: &[HoldRef],
        rule_of: &dyn Fn(&RefusalCount) -> Option<String>,
        out: &mut impl FnMut(Output),
    ) {
        let Some(mut f) = self.fact(rc, start, interval_ns, open) else {
            return;
        };
        f.rule = rule_of(rc);
        self.stats.total += f.count;
        let kind = if f.detail.is_empty() {
            f.kind.as_str().to_string()
        } else {
            format!("{}: {}", f.kind.as_str(), f.detail)
        };
        add(&mut self.stats.by_kind, &kind, f.count);
        if !f.dest.is_empty() {
            add(&mut self.stats.by_dest, &f.dest, f.count);
        }
        if let Some(h) = &f.hold {
            self.tally(
                h,
                (f.kind, f.detail.clone(), f.dest.clone(), f.netns),
                f.count,
                Some(rc),
            );
        }
        out(Output::RefusalCount(f));
    }

    /// A sampled refusal: a fact of its own, with the refused packet where it was read.
    pub fn on_sample(&mut self, s: &RefusalSample, open: &[HoldRef], out: &mut impl FnMut(Output)) {
        let Some(kind) = kind_of(s.kind) else {
            return;
        };
        let packet = (s.l4proto != 0)
            .then(|| super::drops::packet(s.l4proto, s.saddr, s.daddr, s.sport, s.dport))
            .flatten();
        let f = RefusalFact {
            ts_ns: s.ts_ns,
            netns: s.netns,
            kind,
            detail: self.detail(kind, s.detail),
            dest: dest_text(s.daddr, s.dport),
            packet,
            pid: s.tgid,
            hold: self.hold(s.hold_start_ns, open),
        };
        // The hold's group gets it as its example (the counts add the number).
        if let (Some(h), Some(p)) = (&f.hold, &f.packet) {
            let key = (f.kind, f.detail.clone(), f.dest.clone(), f.netns);
            self.tally(h, key.clone(), 0, None);
            if let Some(t) = self
                .tallies
                .iter_mut()
                .find(|t| t.hold.start_ns == h.start_ns && t.hold.lock == h.lock)
            {
                t.examples.entry(key).or_insert_with(|| p.clone());
            }
        }
        out(Output::Refusal(f));
    }

    fn fact(
        &self,
        rc: &RefusalCount,
        start: u64,
        interval_ns: u64,
        open: &[HoldRef],
    ) -> Option<RefusalCountFact> {
        let kind = kind_of(rc.kind)?;
        Some(RefusalCountFact {
            ts_ns: start,
            interval_ns,
            netns: rc.netns,
            kind,
            detail: self.detail(kind, rc.detail),
            dest: dest_text(rc.addr, rc.port),
            count: rc.count,
            hold: self.hold(rc.hold_start_ns, open),
            rule: None,
        })
    }

    /// Adds `n` to a hold's group; `rc`, a count of it, names its rule when reported.
    fn tally(&mut self, h: &HoldRef, key: GroupKey, n: u64, rc: Option<&RefusalCount>) {
        let i = match self
            .tallies
            .iter()
            .position(|t| t.hold.start_ns == h.start_ns && t.hold.lock == h.lock)
        {
            Some(i) => i,
            None if self.tallies.len() < MAX_TALLIES => {
                self.tallies.push(Tally {
                    hold: h.clone(),
                    groups: BTreeMap::new(),
                    first: BTreeMap::new(),
                    examples: BTreeMap::new(),
                });
                self.tallies.len() - 1
            }
            None => return,
        };
        let t = &mut self.tallies[i];
        if t.hold.hold_ns.is_none() {
            t.hold.hold_ns = h.hold_ns;
        }
        if let Some(rc) = rc {
            t.first.entry(key.clone()).or_insert(*rc);
        }
        *t.groups.entry(key).or_default() += n;
    }

    fn report(
        &mut self,
        t: Tally,
        rule_of: &dyn Fn(&RefusalCount) -> Option<String>,
        out: &mut impl FnMut(Output),
    ) {
        let mut examples = t.examples;
        let mut groups: Vec<RefusalGroup> = t
            .groups
            .into_iter()
            // A sample's group whose count did not come (cannot happen: each is counted).
            .filter(|(_, count)| *count > 0)
            .map(|(key, count)| {
                let rule = t.first.get(&key).and_then(rule_of);
                let example = examples.remove(&key);
                let (kind, detail, dest, netns) = key;
                RefusalGroup {
                    kind,
                    detail,
                    dest,
                    netns,
                    count,
                    rule,
                    example,
                }
            })
            .collect();
        groups.sort_by_key(|g| std::cmp::Reverse(g.count));
        let refused = groups.iter().map(|g| g.count).sum();
        let f = HoldRefusalsFact {
            lock: t.hold.lock,
            pid: t.hold.pid,
            agent: t.hold.agent,
            comm: t.hold.comm,
            start_ns: t.hold.start_ns,
            hold_ns: t.hold.hold_ns.unwrap_or(0),
            refused,
            groups,
        };
        self.stats.during_holds += refused;
        self.stats.worst_holds.push(f.clone());
        self.stats
            .worst_holds
            .sort_by_key(|h| std::cmp::Reverse(h.refused));
        self.stats.worst_holds.truncate(5);
        out(Output::HoldRefusals(f));
    }

    /// End of the stream: holds not reported yet.
    pub fn finish(
        &mut self,
        ts_ns: u64,
        rule_of: &dyn Fn(&RefusalCount) -> Option<String>,
        out: &mut impl FnMut(Output),
    ) {
        // Counts still waiting for their hold: under it if it came, else without it.
        for u in std::mem::take(&mut self.unplaced) {
            self.count(&u.rc, u.start, u.interval_ns, &[], rule_of, out);
        }
        for mut t in std::mem::take(&mut self.tallies) {
            if t.hold.hold_ns.is_none() {
                t.hold.hold_ns = Some(ts_ns.saturating_sub(t.hold.start_ns));
            }
            self.report(t, rule_of, out);
        }
    }

    pub fn summary(&self) -> RefusalSummary {
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::SharedStr;

    fn count(hold: u64, kind: u8, detail: u32, port: u16, n: u64) -> RefusalCount {
        RefusalCount {
            hold_start_ns: hold,
            netns: 7,
            kind,
            detail,
            addr: Some("10.96.0.15".parse().unwrap()),
            port,
            count: n,
        }
    }

    fn hold(start_ns: u64, hold_ns: Option<u64>) -> HoldRef {
        HoldRef {
            lock: SharedStr::from("/run/xtables.lock"),
            pid: 42,
            agent: SharedStr::from("kube-proxy"),
            comm: SharedStr::from("iptables-restor"),
            start_ns,
            hold_ns,
        }
    }

    /// Counts tagged with a hold go to that hold, whatever the interval; the hold is
    /// reported once counts read after its end arrive, and counts outside it stay out.
    #[test]
    fn counts_tie_to_their_hold_exactly() {
        let mut t = RefusalTracker::default();
        let mut got = Vec::new();
        let open = [hold(1_000, None)];
        let c = RefusalCounts {
            ts_ns: 2_000,
            interval_ns: 1_000,
            counts: vec![
                count(1_000, REFUSAL_ICMP_UNREACH, 3, 80, 30),
                count(0, REFUSAL_ICMP_UNREACH, 3, 80, 5),
                count(1_000, REFUSAL_RST_SENT, 1, 9, 4),
            ],
            overflow: 0,
            reset_reasons: vec![(1, "NO_SOCKET".into())],
        };
        t.on_counts(&c, &open, &|_| None, &mut |o| got.push(o));
        assert_eq!(got.len(), 3);
        assert!(!got.iter().any(|o| matches!(o, Output::HoldRefusals(_))));
        let Output::RefusalCount(f) = &got[2] else {
            panic!("{:?}", got[2]);
        };
        assert_eq!(
            (f.detail.as_str(), f.dest.as_str()),
            ("NO_SOCKET", "10.96.0.15:9")
        );
        // The hold ends at 3 000; the next read (at 4 000) has 7 more inside it.
        t.on_hold_ref(hold(1_000, Some(2_000)));
        got.clear();
        let c = RefusalCounts {
            ts_ns: 4_000,
            interval_ns: 2_000,
            counts: vec![count(1_000, REFUSAL_ICMP_UNREACH, 3, 80, 7)],
            overflow: 0,
            reset_reasons: vec![],
        };
        t.on_counts(&c, &[], &|_| None, &mut |o| got.push(o));
        let Some(Output::HoldRefusals(r)) = got.last() else {
            panic!("{got:?}");
        };
        assert_eq!(r.refused, 41);
        assert_eq!(r.hold_ns, 2_000);
        assert_eq!(r.groups[0].count, 37);
        assert_eq!(r.groups[0].detail, "port unreachable");
        let s = t.summary();
        assert_eq!((s.total, s.during_holds), (46, 41));
    }

    /// A count of a hold whose take was not read yet (still in the ring when the counters
    /// were read) waits for it, and goes to it once it is known; a count whose hold never
    /// comes is said without it after a few reads.
    #[test]
    fn counts_wait_for_a_hold_not_read_yet() {
        let mut t = RefusalTracker::default();
        let mut got = Vec::new();
        let c = |ts_ns, counts| RefusalCounts {
            ts_ns,
            interval_ns: 1_000,
            counts,
            overflow: 0,
            reset_reasons: vec![],
        };
        // 40 under the hold of 1 500, unknown yet; 7 under none; 2 under a hold never seen.
        let first = c(
            2_000,
            vec![
                count(1_500, REFUSAL_ICMP_UNREACH, 3, 80, 40),
                count(0, REFUSAL_ICMP_UNREACH, 3, 80, 7),
                count(1_700, REFUSAL_ICMP_UNREACH, 3, 81, 2),
            ],
        );
        t.on_counts(&first, &[], &|_| None, &mut |o| got.push(o));
        assert_eq!(got.len(), 1, "only the untagged count is said: {got:?}");
        // The next read: the hold is known now (its take was read), and has ended.
        got.clear();
        t.on_hold_ref(hold(1_500, Some(500)));
        t.on_counts(&c(3_000, vec![]), &[], &|_| None, &mut |o| got.push(o));
        let Some(Output::HoldRefusals(r)) = got.last() else {
            panic!("{got:?}");
        };
        assert_eq!((r.refused, r.groups[0].count), (40, 40));
        let Output::RefusalCount(f) = &got[0] else {
            panic!("{got:?}");
        };
        assert_eq!((f.count, f.ts_ns), (40, 1_000), "its own read's interval");
        // The hold of 1 700 never comes: said without a hold after the reads it waits.
        got.clear();
        for ts in [4_000, 5_000] {
            t.on_counts(&c(ts, vec![]), &[], &|_| None, &mut |o| got.push(o));
        }
        let [Output::RefusalCount(f)] = got.as_slice() else {
            panic!("{got:?}");
        };
        assert_eq!((f.count, f.hold.is_none()), (2, true));
        let s = t.summary();
        assert_eq!((s.total, s.during_holds), (49, 40));
    }
}
