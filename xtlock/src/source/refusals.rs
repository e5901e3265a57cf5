//! The kernel's exact refusal counters (ICMP unreachable and TCP resets sent, resets
//! received; per hold, netns, kind, destination and detail), read every second and turned
//! into a synthetic [`Event::RefusalCounts`] of the deltas, the way the drop counters are.

use std::collections::{HashMap, HashSet};

use xtlock_common::{RefusalKey, REFUSAL_NO_DETAIL, REFUSAL_RST_SENT};

use crate::decode::{ip_addr, Event, RefusalCount, RefusalCounts};
use crate::probes::{dropreason::ReasonTable, Probes};

/// Reads the counters and keeps the previous totals.
#[derive(Debug)]
pub struct RefusalPoller {
    prev: HashMap<RefusalKey, u64>,
    prev_overflow: u64,
    last_ts: u64,
    /// Reset reasons whose names went out already.
    named: HashSet<u32>,
    /// Keys of holds seen ended at the last read: removed at the next (see `retire`).
    retiring: HashSet<RefusalKey>,
}

impl RefusalPoller {
    pub fn new(now_ns: u64) -> Self {
        RefusalPoller {
            prev: HashMap::new(),
            prev_overflow: 0,
            last_ts: now_ns,
            named: HashSet::new(),
            retiring: HashSet::new(),
        }
    }

    /// The deltas since the previous call; `None` when nothing changed or no refusal hook is
    /// attached. The interval ends when the counters were read, not when the caller's tick
    /// began: what went before them (a ring read, the drop counters) can take hundreds of
    /// milliseconds on a slow machine, and a hold that started meanwhile has refusals in
    /// these counts, so the read's time must not come before its start.
    pub fn poll(&mut self, probes: &mut Probes) -> Option<Event> {
        if !probes.refusals_attached() {
            return None;
        }
        let before = probes.current_hold_start();
        let (totals, overflow) = match probes.refusal_totals() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the refusal counters");
                return None;
            }
        };
        let now_ns = super::monotonic_ns();
        let interval_ns = now_ns.saturating_sub(self.last_ts);
        self.last_ts = now_ns;
        let ended = match (before, probes.current_hold_start()) {
            (Ok(b), Ok(a)) => self.retire(&totals, [b, a]),
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!(error = %e, "cannot read the hold in progress");
                Vec::new()
            }
        };
        let mut c = self.deltas(totals, &probes.rst_reasons, now_ns, interval_ns);
        // Their totals are in these deltas; the kernel counts under them no more.
        if !ended.is_empty() {
            match probes.forget_refusals(&ended) {
                Ok(()) => {
                    for k in &ended {
                        self.prev.remove(k);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot remove ended holds' refusal counters"),
            }
        }
        c.overflow = overflow.saturating_sub(self.prev_overflow);
        self.prev_overflow = overflow;
        if c.counts.is_empty() && c.overflow == 0 {
            return None;
        }
        Some(Event::RefusalCounts(c))
    }

    /// Keys of holds that had ended at the previous read already (not the hold in progress
    /// before or after either read): their totals are final, and no increment can still be
    /// on its way. Holds that ended since wait one read more.
    fn retire(&mut self, totals: &[(RefusalKey, u64)], current: [u64; 2]) -> Vec<RefusalKey> {
        let ended: HashSet<RefusalKey> = totals
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| k.hold_start_ns != 0 && !current.contains(&k.hold_start_ns))
            .collect();
        let (done, wait): (Vec<RefusalKey>, Vec<RefusalKey>) =
            ended.into_iter().partition(|k| self.retiring.contains(k));
        self.retiring = wait.into_iter().collect();
        done
    }

    /// Deltas of `totals` against the previous ones, non-zero ones only, in key order, with
    /// the names of reset reasons not named before.
    fn deltas(
        &mut self,
        mut totals: Vec<(RefusalKey, u64)>,
        reasons: &ReasonTable,
        ts_ns: u64,
        interval_ns: u64,
    ) -> RefusalCounts {
        totals.sort_unstable_by_key(|(k, _)| *k);
        let mut counts = Vec::new();
        let mut reset_reasons = Vec::new();
        for (k, total) in totals {
            let before = self.prev.insert(k, total).unwrap_or(0);
            let d = total.saturating_sub(before);
            if d == 0 {
                continue;
            }
            if k.kind == REFUSAL_RST_SENT && k.detail != REFUSAL_NO_DETAIL {
                if let Some(name) = reasons.name(k.detail) {
                    if self.named.insert(k.detail) {
                        reset_reasons.push((k.detail, name.to_string()));
                    }
                }
            }
            counts.push(RefusalCount {
                hold_start_ns: k.hold_start_ns,
                netns: k.netns,
                kind: k.kind,
                detail: k.detail,
                addr: ip_addr(k.family, &k.addr),
                port: k.port,
                count: d,
            });
        }
        RefusalCounts {
            ts_ns,
            interval_ns,
            counts,
            overflow: 0,
            reset_reasons,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xtlock_common::{DROP_FAMILY_INET, REFUSAL_ICMP_UNREACH};

    #[test]
    fn only_nonzero_deltas_and_each_reason_named_once() {
        let k = |kind, detail, port| RefusalKey {
            addr: [10, 96, 0, 15, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            family: DROP_FAMILY_INET,
            kind,
            detail,
            port,
            ..Default::default()
        };
        let reasons = ReasonTable {
            names: [(1, "NO_SOCKET".to_string())].into_iter().collect(),
        };
        let mut p = RefusalPoller::new(0);
        let c = p.deltas(
            vec![
                (k(REFUSAL_RST_SENT, 1, 80), 3),
                (k(REFUSAL_ICMP_UNREACH, 3, 81), 0),
            ],
            &reasons,
            10,
            10,
        );
        assert_eq!(c.counts.len(), 1);
        assert_eq!(c.counts[0].count, 3);
        assert_eq!(
            c.counts[0].addr.map(|a| a.to_string()).as_deref(),
            Some("10.96.0.15")
        );
        assert_eq!(c.reset_reasons, vec![(1, "NO_SOCKET".to_string())]);
        let c = p.deltas(
            vec![
                (k(REFUSAL_RST_SENT, 1, 80), 5),
                (k(REFUSAL_ICMP_UNREACH, 3, 81), 2),
            ],
            &reasons,
            20,
            10,
        );
        assert_eq!(
            c.counts.iter().map(|c| c.count).collect::<Vec<_>>(),
            vec![2, 2]
        );
        assert!(c.reset_reasons.is_empty());
    }

    /// A key of an ended hold is removed one read after it was first seen ended, never while
    /// its hold is in progress at either read.
    #[test]
    fn ended_holds_retire_one_read_later() {
        let k = |hold_start_ns| RefusalKey {
            hold_start_ns,
            kind: REFUSAL_ICMP_UNREACH,
            ..Default::default()
        };
        let mut p = RefusalPoller::new(0);
        let totals = vec![(k(0), 1), (k(5), 1), (k(9), 1)];
        assert!(p.retire(&totals, [9, 9]).is_empty());
        // Hold 9 in progress at the second read: only hold 5 goes; no hold is never removed.
        assert_eq!(p.retire(&totals, [0, 9]), vec![k(5)]);
        let totals = vec![(k(0), 1), (k(9), 1)];
        assert!(p.retire(&totals, [0, 0]).is_empty());
        assert_eq!(p.retire(&totals, [0, 0]), vec![k(9)]);
    }
}
