//! The kernel's exact IPVS packet counters (per virtual service, real server and state),
//! read every second and turned into a synthetic [`Event::IpvsCounts`] of the deltas, the
//! way the drop counters are.

use std::collections::HashMap;

use xtlock_common::IpvsKey;

use crate::decode::{ipvs_count, Event, IpvsCounts};
use crate::probes::Probes;

/// Reads the counters and keeps the previous totals.
#[derive(Debug)]
pub struct IpvsPoller {
    prev: HashMap<IpvsKey, u64>,
    prev_overflow: u64,
    last_ts: u64,
}

impl IpvsPoller {
    pub fn new(now_ns: u64) -> Self {
        IpvsPoller {
            prev: HashMap::new(),
            prev_overflow: 0,
            last_ts: now_ns,
        }
    }

    /// The deltas since the previous call; `None` when nothing changed or the hook is not
    /// attached.
    pub fn poll(&mut self, probes: &Probes, now_ns: u64) -> Option<Event> {
        if !probes.ipvs_attached() {
            return None;
        }
        let (totals, overflow) = match probes.ipvs_totals() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the IPVS counters");
                return None;
            }
        };
        let interval_ns = now_ns.saturating_sub(self.last_ts);
        self.last_ts = now_ns;
        let ev = deltas(&mut self.prev, totals, now_ns, interval_ns);
        let overflow_delta = overflow.saturating_sub(self.prev_overflow);
        self.prev_overflow = overflow;
        let mut c = ev;
        c.overflow = overflow_delta;
        if c.counts.is_empty() && c.overflow == 0 {
            return None;
        }
        Some(Event::IpvsCounts(c))
    }
}

/// Deltas of `totals` against `prev` (updated), non-zero ones only, in key order.
fn deltas(
    prev: &mut HashMap<IpvsKey, u64>,
    mut totals: Vec<(IpvsKey, u64)>,
    ts_ns: u64,
    interval_ns: u64,
) -> IpvsCounts {
    totals.sort_unstable_by_key(|(k, _)| *k);
    let mut counts = Vec::new();
    for (k, total) in totals {
        let before = prev.insert(k, total).unwrap_or(0);
        let d = total.saturating_sub(before);
        if d > 0 {
            counts.push(ipvs_count(&k, d));
        }
    }
    IpvsCounts {
        ts_ns,
        interval_ns,
        counts,
        overflow: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nonzero_deltas() {
        let k = |d: u8| IpvsKey {
            vaddr: [10, 96, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            daddr: [10, 0, 1, d, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vport: 53,
            dport: 53,
            af: 2,
            protocol: 17,
            state: 0,
        };
        let mut prev = HashMap::new();
        let c = deltas(&mut prev, vec![(k(5), 3), (k(6), 0)], 10, 1);
        assert_eq!(c.counts.len(), 1);
        assert_eq!(c.counts[0].count, 3);
        assert_eq!(c.counts[0].backend.to_string(), "10.0.1.5:53");
        let c = deltas(&mut prev, vec![(k(5), 3), (k(6), 2)], 20, 1);
        assert_eq!(c.counts.len(), 1);
        assert_eq!(c.counts[0].backend.to_string(), "10.0.1.6:53");
    }
}
