//! Aggregates of the facts: duration histograms per agent, the contention matrix (who
//! waited behind whom), counts per agent, and the [`Summary`] they produce.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::facts::Output;
use super::xtables_lock::WatchedLock;

/// Histogram range: 1 µs resolution up to 1 hour, 3 significant figures.
const HIST_LOW_NS: u64 = 1_000;
const HIST_HIGH_NS: u64 = 3_600_000_000_000;
const HIST_SIGFIG: u8 = 3;
/// Agents tracked by name per table; later ones are pooled (a histogram is ~200 KiB).
const MAX_AGENTS: usize = 256;
/// Name of that pool, and of the holder of a wait whose holder is unknown.
pub const OTHER_AGENTS: &str = "(other)";
pub const UNKNOWN_HOLDER: &str = "(unknown)";

/// Count, percentiles and max of a set of durations.
#[derive(Clone, Debug)]
pub struct DurationHist {
    hist: Histogram<u64>,
    count: u64,
    max_ns: u64,
    total_ns: u64,
}

impl Default for DurationHist {
    fn default() -> Self {
        Self::new()
    }
}

impl DurationHist {
    pub fn new() -> Self {
        DurationHist {
            // The bounds are constants that satisfy every creation check (low >= 1,
            // high >= 2 * low, sigfig <= 5), so this cannot fail.
            hist: Histogram::new_with_bounds(HIST_LOW_NS, HIST_HIGH_NS, HIST_SIGFIG)
                .expect("constant histogram bounds are valid"),
            count: 0,
            max_ns: 0,
            total_ns: 0,
        }
    }

    /// Records one duration; outliers are clamped into the histogram, never rejected.
    pub fn record(&mut self, ns: u64) {
        self.hist.saturating_record(ns.min(HIST_HIGH_NS));
        self.count += 1;
        self.max_ns = self.max_ns.max(ns);
        self.total_ns = self.total_ns.saturating_add(ns);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Percentile (0..=100), never above the exact max.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        self.hist.value_at_quantile(p / 100.0).min(self.max_ns)
    }

    pub fn summary(&self) -> DurationSummary {
        DurationSummary {
            count: self.count,
            p50_ns: self.percentile(50.0),
            p99_ns: self.percentile(99.0),
            max_ns: self.max_ns,
            total_ns: self.total_ns,
        }
    }
}

/// `{"count","p50_ns","p99_ns","max_ns"}` plus `total_ns`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DurationSummary {
    pub count: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    pub total_ns: u64,
}

/// One cell of the contention matrix.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ContentionSummary {
    pub waiter: String,
    pub holder: String,
    /// Waits that were behind this holder agent at some point.
    pub count: u64,
    /// Time those waits spent behind it (not their whole length).
    pub total_wait_ns: u64,
    /// The longest time one wait spent behind it.
    pub max_wait_ns: u64,
}

/// Per lock file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LockSummary {
    pub path: String,
    pub dev: u32,
    pub ino: u64,
    pub holds: u64,
    pub waits: u64,
    pub held_ns: u64,
    pub max_hold_ns: u64,
}

/// The summary object: `{"type":"summary","holds":{..},"waits":{..},"contention":[..],
/// "lost_events":N, ...}`. Field names are a stable interface: add, never rename.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// Always `"summary"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Per agent of the holder.
    pub holds: BTreeMap<String, DurationSummary>,
    /// Per agent of the waiter.
    pub waits: BTreeMap<String, DurationSummary>,
    /// Waiter agent x holder agent; a wait behind several holder agents counts once for
    /// each, with the time it spent behind that agent's holds.
    pub contention: Vec<ContentionSummary>,
    pub lost_events: u64,
    /// Failed non-blocking tries per agent.
    pub failed_tries: BTreeMap<String, u64>,
    /// iptables lock timeouts (exit 4 after lock trouble) per agent.
    pub timeouts: BTreeMap<String, u64>,
    /// Exit status 4 of iptables-family processes with no lock trouble seen (not counted
    /// as lock timeouts), per agent.
    pub exit4_without_lock: BTreeMap<String, u64>,
    /// Execs of iptables-family binaries per calling agent.
    pub execs: BTreeMap<String, u64>,
    /// Waits by outcome (`acquired`, `timed_out`, `abandoned`, `open`).
    pub wait_outcomes: BTreeMap<String, u64>,
    pub locks: Vec<LockSummary>,
    /// Events analysed.
    pub events: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_ts_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_ts_ns: Option<u64>,
    pub duration_ns: u64,
    /// Packet drops and conntrack (empty when drops were not traced).
    pub drops: crate::analysis::drops::DropSummary,
    /// Connections the node refused (ICMP unreachable, TCP resets) and resets received.
    /// Absent when none were counted (and from captures made before refusals were).
    #[serde(skip_serializing_if = "crate::analysis::refusals::RefusalSummary::is_empty")]
    pub refusals: crate::analysis::refusals::RefusalSummary,
    /// The rules that dropped packets, by their own counters. Absent when none did.
    #[serde(skip_serializing_if = "crate::analysis::rule_drops::RuleDropSummary::is_empty")]
    pub rule_drops: crate::analysis::rule_drops::RuleDropSummary,
    /// Inode of the tracer's own network namespace (0 when unknown): netns numbers in
    /// `drops` equal to it are the host's.
    pub host_netns: u32,
    /// How often each bound of the analysis was hit (`open_holds`, `open_waits`): what went
    /// past it was not tracked. Absent when none was.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub over_bounds: BTreeMap<String, u64>,
    /// Where Services route (from the rule reads) and the windows they routed to gone
    /// endpoints. Absent when no Service was seen.
    #[serde(skip_serializing_if = "crate::analysis::services::ServiceSummary::is_empty")]
    pub services: crate::analysis::services::ServiceSummary,
    /// IPVS per (protocol, service, backend): connections, packets, stale packets.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ipvs: Vec<IpvsBackendRow>,
    /// Per agent whose holds replaced tables: where their time went, and the largest
    /// table it replaced. Absent when no hold replaced a table whose head was read.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tables: BTreeMap<String, AgentTables>,
    /// Per agent that committed nf_tables batches whose changes were counted: how many,
    /// and the largest. Absent when none was.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub nft: BTreeMap<String, AgentNft>,
    /// Per agent that ran iptables-restore: its sync cadence. Absent when none did.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub syncs: BTreeMap<String, super::cadence::SyncSummary>,
    /// Rule writes per agent and backend (`legacy`, `nft`). Absent when none was seen.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rule_writes: Vec<RuleWriteRow>,
    /// Network namespaces whose rules were written through both backends.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mixed_backends: Vec<super::facts::MixedBackendsFact>,
    /// Writers not serialized by one lock: pairs said, writes undone, replaces refused.
    #[serde(skip_serializing_if = "is_zero_unserialized")]
    pub unserialized: super::unserialized::UnserializedCounts,
    /// Chains and rules of one agent changed by another: (writer, owner, count).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub foreign_changes: Vec<(String, String, u64)>,
}

/// One agent's rule writes through one backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleWriteRow {
    pub agent: String,
    pub backend: super::iptables_run::Backend,
    #[serde(flatten)]
    pub writes: super::rules::RuleWrites,
}

/// What one agent's table replaces came to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AgentTables {
    /// Holds with a replace, and their time in the kernel and in the holder's userspace.
    pub holds: u64,
    pub kernel_ns: u64,
    pub userspace_ns: u64,
    /// The largest table it replaced (most entries).
    pub largest: Option<TableSize>,
}

/// What one agent's nf_tables commits changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AgentNft {
    /// Commits whose batch was counted, their time, and their changes (batch messages).
    pub commits: u64,
    pub held_ns: u64,
    pub changes: u64,
    /// The most changes in one batch, and whether that batch was counted only in part (it
    /// had more).
    pub largest: u64,
    pub largest_partial: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TableSize {
    pub family: &'static str,
    pub table: String,
    pub entries: u32,
    pub bytes: u32,
}

/// One row of the IPVS summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IpvsBackendRow {
    pub protocol: String,
    pub service: String,
    pub backend: String,
    #[serde(flatten)]
    pub counts: crate::analysis::ipvs::IpvsBackendSummary,
}

#[derive(Clone, Debug, Default)]
struct Cell {
    count: u64,
    total_ns: u64,
    max_ns: u64,
}

#[derive(Clone, Debug, Default)]
struct LockCounters {
    holds: u64,
    waits: u64,
    held_ns: u64,
    max_hold_ns: u64,
}

/// Everything counted so far.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    holds: BTreeMap<String, DurationHist>,
    waits: BTreeMap<String, DurationHist>,
    contention: BTreeMap<String, BTreeMap<String, Cell>>,
    failed_tries: BTreeMap<String, u64>,
    timeouts: BTreeMap<String, u64>,
    exit4_without_lock: BTreeMap<String, u64>,
    execs: BTreeMap<String, u64>,
    wait_outcomes: BTreeMap<&'static str, u64>,
    per_lock: BTreeMap<String, LockCounters>,
    tables: BTreeMap<String, AgentTables>,
    nft: BTreeMap<String, AgentNft>,
    lost: u64,
    events: u64,
    first_ts: Option<u64>,
    last_ts: Option<u64>,
}

/// The entry for `key`, allocating the key only when it is new; pooled beyond
/// [`MAX_AGENTS`].
fn slot<'m, V: Default>(m: &'m mut BTreeMap<String, V>, key: &str) -> &'m mut V {
    if !m.contains_key(key) {
        let k = if m.len() >= MAX_AGENTS {
            OTHER_AGENTS
        } else {
            key
        };
        return m.entry(k.to_string()).or_default();
    }
    // Checked just above.
    m.get_mut(key).unwrap_or_else(|| unreachable!())
}

impl Stats {
    pub fn new() -> Self {
        Self::default()
    }

    /// Notes one event (its time, for the trace duration).
    pub fn observe(&mut self, ts_ns: u64) {
        self.events += 1;
        self.first_ts = Some(self.first_ts.map_or(ts_ns, |f| f.min(ts_ns)));
        self.last_ts = Some(self.last_ts.map_or(ts_ns, |l| l.max(ts_ns)));
    }

    /// Tracing ran until `ts_ns` (its end): the traced time reaches it even when the last
    /// kernel event came earlier (a quiet node sends few). Not an event.
    pub fn extend_to(&mut self, ts_ns: u64) {
        if let Some(f) = self.first_ts {
            self.last_ts = Some(self.last_ts.map_or(ts_ns, |l| l.max(ts_ns)).max(f));
        }
    }

    pub fn first_ts_ns(&self) -> Option<u64> {
        self.first_ts
    }

    pub fn lost_events(&self) -> u64 {
        self.lost
    }

    /// Counts one fact.
    pub fn record(&mut self, o: &Output) {
        match o {
            Output::Hold(h) => {
                slot(&mut self.holds, &h.who.agent).record(h.hold_ns);
                if h.tables.iter().any(|t| t.entries.is_some()) {
                    let a = slot(&mut self.tables, &h.who.agent);
                    a.holds += 1;
                    a.kernel_ns = a.kernel_ns.saturating_add(h.kernel_ns);
                    a.userspace_ns = a
                        .userspace_ns
                        .saturating_add(h.hold_ns.saturating_sub(h.kernel_ns));
                    for t in h.tables.iter().filter(|t| t.op == "replace" && t.ret == 0) {
                        let (Some(entries), Some(bytes)) = (t.entries, t.bytes) else {
                            continue;
                        };
                        if a.largest.as_ref().is_none_or(|l| entries > l.entries) {
                            a.largest = Some(TableSize {
                                family: t.family,
                                table: t.table.clone(),
                                entries,
                                bytes,
                            });
                        }
                    }
                }
                if let Some(b) = h.nft.as_ref().filter(|b| b.status != "unreadable") {
                    let a = slot(&mut self.nft, &h.who.agent);
                    let n = b.changes();
                    a.commits += 1;
                    a.held_ns = a.held_ns.saturating_add(h.hold_ns);
                    a.changes = a.changes.saturating_add(n);
                    if n > a.largest {
                        a.largest = n;
                        a.largest_partial = b.status == "partial";
                    }
                }
                let l = slot(&mut self.per_lock, &h.lock);
                l.holds += 1;
                l.held_ns = l.held_ns.saturating_add(h.hold_ns);
                l.max_hold_ns = l.max_hold_ns.max(h.hold_ns);
            }
            Output::Wait(w) => {
                slot(&mut self.waits, &w.who.agent).record(w.wait_ns);
                slot(&mut self.per_lock, &w.lock).waits += 1;
                *self.wait_outcomes.entry(w.outcome.as_str()).or_default() += 1;
                // Once per distinct holder agent, with the time the wait spent behind
                // that agent's holds (the holders' stretches add up to the wait).
                let behind = w.behind_by_agent(UNKNOWN_HOLDER, OTHER_AGENTS);
                let row = slot(&mut self.contention, &w.who.agent);
                for (holder, ns) in behind {
                    let c = slot(row, holder);
                    c.count += 1;
                    c.total_ns = c.total_ns.saturating_add(ns);
                    c.max_ns = c.max_ns.max(ns);
                }
            }
            Output::FailedTry(f) => *slot(&mut self.failed_tries, &f.agent) += 1,
            Output::Timeout(t) => *slot(&mut self.timeouts, &t.who.agent) += 1,
            Output::Exec(e) => *slot(&mut self.execs, &e.agent) += 1,
            Output::Exit(e) => {
                if e.code == Some(4) && !e.lock_timeout {
                    *slot(&mut self.exit4_without_lock, &e.agent) += 1;
                }
            }
            // A bound of the analysis is counted by the lock machine (`over_bounds`).
            Output::Lost(l) if l.bound.is_some() => {}
            Output::Lost(l) => self.lost = self.lost.saturating_add(l.count),
            // Counted by the drop tracker (`drops`), which sees them first.
            Output::Drop(_)
            | Output::ConntrackRefused(_)
            | Output::DropCount(_)
            | Output::Conntrack(_)
            | Output::HoldDrops(_)
            | Output::Stall(_) => {}
            // Counted by the rule tracker.
            Output::MixedBackends(_) | Output::RuleWrite(_) | Output::RuleChange(_) => {}
            // Counted by its tracker.
            Output::Unserialized(_) => {}
            // Counted by the IPVS tracker.
            Output::Ipvs(_) | Output::IpvsCount(_) => {}
            // Counted by the refusal tracker.
            Output::RefusalCount(_) | Output::HoldRefusals(_) | Output::Refusal(_) => {}
            // Counted by the rule-drop tracker.
            Output::RuleDrops(_) | Output::UncountedDrops(_) => {}
            // Counted by the service tracker.
            Output::StaleEndpointOpen(_)
            | Output::StaleEndpoint(_)
            | Output::EndpointProgrammed(_)
            | Output::IpvsDrained(_) => {}
        }
    }

    /// The summary so far. `locks` lists the watched locks (all of them, even idle ones).
    pub fn summary<'a>(&self, locks: impl IntoIterator<Item = &'a WatchedLock>) -> Summary {
        let contention = self
            .contention
            .iter()
            .flat_map(|(waiter, row)| {
                row.iter().map(move |(holder, c)| ContentionSummary {
                    waiter: waiter.clone(),
                    holder: holder.clone(),
                    count: c.count,
                    total_wait_ns: c.total_ns,
                    max_wait_ns: c.max_ns,
                })
            })
            .collect();
        let mut lock_list: Vec<LockSummary> = locks
            .into_iter()
            .map(|l| {
                let c = self.per_lock.get(&l.path).cloned().unwrap_or_default();
                LockSummary {
                    path: l.path.clone(),
                    dev: l.dev,
                    ino: l.ino,
                    holds: c.holds,
                    waits: c.waits,
                    held_ns: c.held_ns,
                    max_hold_ns: c.max_hold_ns,
                }
            })
            .collect();
        // Facts about a lock the caller did not list still show up.
        for (path, c) in &self.per_lock {
            if !lock_list.iter().any(|l| &l.path == path) {
                lock_list.push(LockSummary {
                    path: path.clone(),
                    holds: c.holds,
                    waits: c.waits,
                    held_ns: c.held_ns,
                    max_hold_ns: c.max_hold_ns,
                    ..Default::default()
                });
            }
        }
        Summary {
            kind: "summary",
            rule_drops: Default::default(),
            holds: self
                .holds
                .iter()
                .map(|(k, h)| (k.clone(), h.summary()))
                .collect(),
            waits: self
                .waits
                .iter()
                .map(|(k, h)| (k.clone(), h.summary()))
                .collect(),
            contention,
            lost_events: self.lost,
            failed_tries: self.failed_tries.clone(),
            timeouts: self.timeouts.clone(),
            exit4_without_lock: self.exit4_without_lock.clone(),
            execs: self.execs.clone(),
            wait_outcomes: self
                .wait_outcomes
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            locks: lock_list,
            events: self.events,
            first_ts_ns: self.first_ts,
            last_ts_ns: self.last_ts,
            duration_ns: match (self.first_ts, self.last_ts) {
                (Some(f), Some(l)) => l.saturating_sub(f),
                _ => 0,
            },
            drops: Default::default(),
            refusals: Default::default(),
            host_netns: 0,
            over_bounds: BTreeMap::new(),
            ipvs: Vec::new(),
            services: Default::default(),
            tables: self.tables.clone(),
            nft: self.nft.clone(),
            syncs: BTreeMap::new(),
            rule_writes: Vec::new(),
            mixed_backends: Vec::new(),
            unserialized: Default::default(),
            foreign_changes: Vec::new(),
        }
    }
}

fn is_zero_unserialized(c: &super::unserialized::UnserializedCounts) -> bool {
    *c == super::unserialized::UnserializedCounts::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_clamping() {
        let mut h = DurationHist::new();
        for i in 1..=100u64 {
            h.record(i * 1_000_000); // 1..100 ms
        }
        let s = h.summary();
        assert_eq!(s.count, 100);
        // 3 significant figures.
        assert!(
            (49_900_000..=50_100_000).contains(&s.p50_ns),
            "{}",
            s.p50_ns
        );
        assert!(
            (98_900_000..=99_100_000).contains(&s.p99_ns),
            "{}",
            s.p99_ns
        );
        assert_eq!(s.max_ns, 100_000_000);
        assert_eq!(s.total_ns, 5_050_000_000);
        // Out of range both ways: no panic, exact max kept.
        h.record(0);
        h.record(u64::MAX);
        assert_eq!(h.summary().max_ns, u64::MAX);
        assert_eq!(h.count(), 102);
        // Sub-resolution values do not report a percentile above the max.
        let mut small = DurationHist::new();
        small.record(300);
        assert_eq!(small.summary().p50_ns, 300);
        assert_eq!(DurationHist::new().summary(), DurationSummary::default());
    }

    #[test]
    fn agents_beyond_the_limit_are_pooled() {
        let mut m: BTreeMap<String, u64> = BTreeMap::new();
        for i in 0..MAX_AGENTS + 10 {
            *slot(&mut m, &format!("a{i}")) += 1;
        }
        assert_eq!(m.len(), MAX_AGENTS + 1);
        assert_eq!(m[OTHER_AGENTS], 10);
    }
}
