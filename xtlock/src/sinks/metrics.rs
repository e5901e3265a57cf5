//! Prometheus metrics: facts in, metric updates out. `xtlock daemon` feeds it through the
//! same [`Pipeline`](crate::pipeline::Pipeline) as `trace`, and serves [`Metrics::encode`]
//! on `/metrics`. Names, labels and help text are documented in `docs/metrics.md`. The registry
//! and the sink sit in one file so a new series is added to both at once.
//!
//! Label values are bounded: agents (comm of the caller, not pids) are capped at
//! [`MAX_AGENTS`], drop locations at [`MAX_DROP_KINDS`]; past the cap a value is `(other)`.

use std::{
    collections::HashSet,
    io,
    sync::{Arc, Mutex},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};

use super::Sink;
use crate::analysis::facts::{
    ConntrackFact, DropCountFact, EndpointProgrammedFact, ExitFact, HoldFact, HoldRefusalsFact,
    IpvsCountFact, IpvsFact, RuleDropsFact, StaleEndpointFact, StaleFix, WaitFact,
};
use crate::analysis::{Output, Summary};

/// Distinct agents kept as label values; more are `(other)`.
pub const MAX_AGENTS: usize = 64;
/// Distinct (reason, location, class) drop series; more go to one `(other)` series.
pub const MAX_DROP_KINDS: usize = 256;
/// Distinct refusal details (ICMP codes, the kernel's reset reasons: a few dozen at most).
pub const MAX_REFUSAL_DETAILS: usize = 64;
/// Distinct (protocol, service, backend) IPVS series; more go to one `(other)` series.
pub const MAX_IPVS_SERIES: usize = 4096;
/// The label value of everything past a cap.
pub const OTHER: &str = "(other)";

/// Hold, wait and iptables-restore durations: 100 µs (an uncontended `iptables -C`) to
/// 60 s (a restore of a huge ruleset behind a stuck holder).
pub const DURATION_BUCKETS: [f64; 18] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HoldLabels {
    pub lock: String,
    pub agent: String,
    pub role: String,
    /// The holder's pod namespace and workload (see [`PodLabels`]); none outside pods.
    #[prometheus(flatten)]
    pub pod: PodLabels,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WaitLabels {
    pub lock: String,
    pub agent: String,
    pub holder_agent: String,
    /// The waiter's pod namespace and workload; none outside pods.
    #[prometheus(flatten)]
    pub pod: PodLabels,
}

/// Pod labels of a process: `namespace` and `pod`, its pod's name without the suffix its
/// controller added (the workload: `kube-proxy`, not `kube-proxy-x7k2p`), so a replaced pod
/// keeps its series. At most [`MAX_PODS`] (namespace, workload) pairs, the rest `(other)`;
/// no labels at all for a process outside pods (or not named by the kubelet).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct PodLabels {
    pub namespace: String,
    pub pod: String,
}

/// Distinct table names in `table_entries` (the kernel has five per family).
pub const MAX_TABLES: usize = 16;
/// Distinct `lock` label values: the watched lock files, and an nf_tables commit lock per
/// network namespace written through nf_tables (one per pod on a node whose pods run nft).
pub const MAX_LOCKS: usize = 32;
/// Distinct (namespace, workload) pairs kept as label values.
pub const MAX_PODS: usize = 64;
/// Distinct dropping rules given series of their own; the rest share `chain` and `rule`
/// `(other)` (per table and owner).
pub const MAX_DROP_RULES: usize = 64;
/// A rule's text is cut to this many characters in its label.
const RULE_LABEL_CHARS: usize = 120;

impl PodLabels {
    pub fn of(cap: &mut Capped, pod: Option<&crate::kube::PodName>) -> Self {
        let Some(p) = pod else {
            return Self::default();
        };
        let (ns, w) = (p.namespace.as_str(), p.workload());
        if cap.label(&format!("{ns}/{w}")) == OTHER {
            return PodLabels {
                namespace: OTHER.to_owned(),
                pod: OTHER.to_owned(),
            };
        }
        PodLabels {
            namespace: ns.to_owned(),
            pod: w.to_owned(),
        }
    }
}

impl prometheus_client::encoding::EncodeLabelSet for PodLabels {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::{EncodeLabelKey, EncodeLabelValue};
        if self.namespace.is_empty() && self.pod.is_empty() {
            return Ok(());
        }
        for (k, v) in [("namespace", &self.namespace), ("pod", &self.pod)] {
            let mut label = encoder.encode_label();
            let mut key = label.encode_label_key()?;
            EncodeLabelKey::encode(&k, &mut key)?;
            let mut value = key.encode_label_value()?;
            EncodeLabelValue::encode(v, &mut value)?;
            value.finish()?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LockAgentLabels {
    pub lock: String,
    pub agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentLabels {
    pub agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub agent: String,
    /// `kernel` (table reads and replaces) or `userspace` (the rest of the hold).
    pub phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabels {
    pub agent: String,
    pub family: &'static str,
    pub table: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub agent: String,
    /// `legacy` or `nft`.
    pub backend: &'static str,
}

/// Writers not serialized by one lock: `kind` is `writers`, `lost_write` or
/// `refused_replace`; `agent` wrote, `other_agent` is the other one.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UnserializedLabels {
    pub kind: &'static str,
    pub agent: String,
    pub other_agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleDropLabels {
    /// `ip`, `ip6` (legacy), `nft ip`, `nft inet`, ...
    pub family: String,
    pub table: String,
    pub chain: String,
    /// As iptables-save prints it (cut to 120 characters); `policy` for a chain's policy.
    pub rule: String,
    /// Whose rule it is (the agent that added it, else the chain's owner); `unknown`.
    pub owner: String,
    /// `host` or `other`.
    pub netns: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForeignLabels {
    /// The writer.
    pub agent: String,
    /// Whose chains and rules it changed.
    pub owner: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NftChangeLabels {
    pub agent: String,
    /// `tables`, `chains`, `rules`, `sets`, `elements`, `objects`, `flowtables`, `other`.
    pub kind: &'static str,
    /// `added` or `deleted`.
    pub change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LockLabels {
    pub lock: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabels {
    pub reason: String,
    pub location: String,
    pub class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IpvsLabels {
    pub protocol: String,
    /// Virtual service, `ip:port`.
    pub service: String,
    /// Real server, `ip:port`.
    pub backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IpvsStaleLabels {
    pub protocol: String,
    pub service: String,
    pub backend: String,
    /// `weight_0` (still forwarded) or `removed` (dropped or expired by the kernel).
    pub backend_state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IpvsChangeLabels {
    /// `dest_added`, `dest_removed`, `dest_edited`, `service_added`, `service_edited`,
    /// `service_removed`.
    pub change: String,
    /// comm of the process that made it (kube-proxy, ipvsadm).
    pub comm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// `host` or `other`, as for the conntrack counters.
    pub netns: String,
    /// `conntrack_insert_failed` or `conntrack_table_full`.
    pub class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// `icmp_unreachable`, `reset_sent` or `reset_received`.
    pub kind: String,
    /// `port unreachable`, the kernel's reset reason (`NO_SOCKET`), or empty.
    pub detail: String,
    /// `host` or `other`, as for the conntrack counters.
    pub netns: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HoldRefusalLabels {
    pub kind: String,
    /// The agent whose hold they happened in.
    pub agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProgrammedLabels {
    /// The agent whose write first routed to the endpoint; `(none)`: no write was seen.
    pub agent: String,
    /// How its address came up: `route`, `neighbour`, `local`.
    pub up: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DrainedLabels {
    /// `true`: removed; `false`: still at weight 0 when tracing ended.
    pub removed: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StaleLabels {
    /// The agent whose write stopped the routing; `(none)` while still routed.
    pub agent: String,
    /// Why the endpoint was gone: `link deleted`, `route deleted`, `address deleted`,
    /// `neighbour failed`, or `unanswered` (anywhere, on other nodes too: its connections got
    /// no reply).
    pub gone: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StaleConnectionLabels {
    /// `icmp_unreachable: host unreachable`, `reset_sent: ...`, `unanswered` (bounded like
    /// refusal details).
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StaleFlowLabels {
    /// `udp`, `tcp`, `other`.
    pub proto: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NetnsLabels {
    /// `host` (the daemon's own namespace) or `other` (pods': bounded, not per namespace).
    pub netns: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    pub program: String,
}

/// A userspace feature (`source::access`): its fixed name, and why it is off (`""` when on,
/// `privilege` or `kernel`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FeatureLabels {
    pub feature: String,
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
    pub kernel: String,
}

type Hist<L> = Family<L, Histogram, fn() -> Histogram>;

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

fn hist<L: Clone + std::hash::Hash + Eq>() -> Hist<L> {
    Family::new_with_constructor(duration_histogram as fn() -> Histogram)
}

/// Every metric, and the registry that encodes them. Shared (`Arc`) between the sink that
/// updates it and the HTTP server that reads it.
pub struct Metrics {
    registry: Registry,
    pub hold: Hist<HoldLabels>,
    pub wait: Hist<WaitLabels>,
    pub failed_attempts: Family<LockAgentLabels, Counter>,
    pub timeouts: Family<AgentLabels, Counter>,
    pub held: Family<LockLabels, Gauge>,
    pub holder_info: Family<HoldLabels, Gauge>,
    pub execs: Family<AgentLabels, Counter>,
    pub restore: Hist<AgentLabels>,
    pub hold_phase: Hist<PhaseLabels>,
    pub sync_stalled: Family<AgentLabels, Gauge>,
    pub syncs: Family<AgentLabels, Counter>,
    pub rule_writes: Family<BackendLabels, Counter>,
    pub foreign_changes: Family<ForeignLabels, Counter>,
    pub mixed_backend_netns: Gauge,
    pub unserialized: Family<UnserializedLabels, Counter>,
    pub rule_drop_packets: Family<RuleDropLabels, Counter>,
    pub rule_drop_bytes: Family<RuleDropLabels, Counter>,
    pub table_entries: Family<TableLabels, Gauge>,
    pub nft_changes: Family<NftChangeLabels, Counter>,
    pub drops: Family<DropLabels, Counter>,
    pub conntrack: [Family<NetnsLabels, Counter>; 7],
    pub conntrack_entries: Family<NetnsLabels, Gauge>,
    pub conntrack_max: Family<NetnsLabels, Gauge>,
    pub conntrack_refused: Family<RefusedLabels, Counter>,
    pub refusals: Family<RefusalLabels, Counter>,
    pub refusals_during_holds: Family<HoldRefusalLabels, Counter>,
    /// Windows of a Service routing to a gone endpoint: how long, by fixing agent.
    pub stale_endpoint: Hist<StaleLabels>,
    /// Connections the node refused to gone endpoints while a Service still routed there.
    pub stale_connections: Family<StaleConnectionLabels, Counter>,
    /// Endpoints still routed to while gone, at the last report (the end of tracing).
    pub stale_still_routed: Counter,
    /// (Service port, endpoint) pairs routed to an endpoint gone from the node, now.
    pub stale_routed_now: Gauge,
    pub stale_flows: Family<StaleFlowLabels, Counter>,
    /// New endpoints: from their address up to the first write routing to them.
    pub endpoint_programming: Hist<ProgrammedLabels>,
    /// IPVS real servers' time at weight 0 before removal (or the end).
    pub ipvs_drained: Hist<DrainedLabels>,
    pub lost: Counter,
    pub events: Counter,
    pub probe_attached: Family<ProbeLabels, Gauge>,
    pub feature_enabled: Family<FeatureLabels, Gauge>,
    /// 1 while the daemon's rolling capture is being written.
    pub recording_up: Gauge,
    pub recording_errors: Counter,
    /// The open holds last published, to clear their `holder_info` series when they end.
    published: Mutex<Vec<HoldLabels>>,
    ipvs_packets: Family<IpvsLabels, Counter>,
    ipvs_stale_packets: Family<IpvsStaleLabels, Counter>,
    ipvs_connections: Family<IpvsLabels, Counter>,
    ipvs_changes: Family<IpvsChangeLabels, Counter>,
}

/// The conntrack statistics counters, in [`Metrics::conntrack`] order.
pub const CONNTRACK_COUNTERS: [(&str, &str); 7] = [
    (
        "drop",
        "Packets dropped because a new connection could not be tracked (table full)",
    ),
    (
        "early_drop",
        "Conntrack entries evicted early to make room for new ones",
    ),
    (
        "insert_failed",
        "Conntrack inserts that lost a race (e.g. the DNS 5 s timeout race); packet dropped",
    ),
    (
        "invalid",
        "Packets conntrack could not track (invalid state)",
    ),
    (
        "search_restart",
        "Conntrack hash lookups restarted because of a concurrent resize",
    ),
    (
        "clash_resolve",
        "Conntrack insert clashes resolved without a drop",
    ),
    (
        "chaintoolong",
        "Conntrack inserts refused because a hash chain was too long",
    ),
];

impl Metrics {
    pub fn new(kernel: &str) -> Self {
        let mut m = Metrics::unregistered();
        let mut r = Registry::with_prefix("xtlock");
        // Registration order is the order of /metrics: keep it.
        m.register_lock_series(&mut r);
        m.register_iptables_run_series(&mut r);
        m.register_rule_series(&mut r);
        m.register_refusal_series(&mut r);
        m.register_service_series(&mut r);
        m.register_drop_series(&mut r);
        m.register_ipvs_series(&mut r);
        m.register_self_series(&mut r, kernel);
        m.registry = r;
        m
    }

    /// Every series, fresh and not yet registered; `registry` is filled by [`Metrics::new`].
    fn unregistered() -> Self {
        Metrics {
            registry: Registry::default(),
            hold: hist(),
            wait: hist(),
            failed_attempts: Family::default(),
            timeouts: Family::default(),
            held: Family::default(),
            holder_info: Family::default(),
            execs: Family::default(),
            restore: hist(),
            hold_phase: hist(),
            sync_stalled: Family::default(),
            syncs: Family::default(),
            rule_writes: Family::default(),
            foreign_changes: Family::default(),
            mixed_backend_netns: Gauge::default(),
            unserialized: Family::default(),
            rule_drop_packets: Family::default(),
            rule_drop_bytes: Family::default(),
            table_entries: Family::default(),
            nft_changes: Family::default(),
            drops: Family::default(),
            refusals: Family::default(),
            refusals_during_holds: Family::default(),
            stale_endpoint: hist(),
            stale_connections: Family::default(),
            stale_still_routed: Counter::default(),
            stale_routed_now: Gauge::default(),
            stale_flows: Family::default(),
            endpoint_programming: hist(),
            ipvs_drained: hist(),
            conntrack: Default::default(),
            conntrack_entries: Family::default(),
            conntrack_max: Family::default(),
            conntrack_refused: Family::default(),
            lost: Counter::default(),
            events: Counter::default(),
            probe_attached: Family::default(),
            feature_enabled: Family::default(),
            recording_up: Gauge::default(),
            recording_errors: Counter::default(),
            published: Mutex::new(Vec::new()),
            ipvs_packets: Family::default(),
            ipvs_stale_packets: Family::default(),
            ipvs_connections: Family::default(),
            ipvs_changes: Family::default(),
        }
    }

    /// The lock itself: holds, waits, failed tries, timeouts and who holds it now.
    fn register_lock_series(&self, r: &mut Registry) {
        r.register_with_unit(
            "lock_hold",
            "How long the xtables lock was held, per holding agent",
            Unit::Seconds,
            self.hold.clone(),
        );
        r.register_with_unit(
            "lock_wait",
            "How long an agent waited for the xtables lock behind each holding agent: one \
             observation per holder agent a wait was behind, of the time spent behind it",
            Unit::Seconds,
            self.wait.clone(),
        );
        r.register(
            "lock_failed_attempts",
            "Failed non-blocking tries to take the xtables lock (iptables -w polling)",
            self.failed_attempts.clone(),
        );
        r.register(
            "lock_timeouts",
            "iptables runs that gave up on the xtables lock (exit status 4 after lock trouble)",
            self.timeouts.clone(),
        );
        r.register(
            "lock_held",
            "1 while the lock is held, 0 otherwise",
            self.held.clone(),
        );
        r.register(
            "lock_holder_info",
            "1 for the agent holding the lock right now (no series while it is free)",
            self.holder_info.clone(),
        );
    }

    /// iptables runs: execs, restore durations and phases, stalled and completed syncs.
    fn register_iptables_run_series(&self, r: &mut Registry) {
        r.register(
            "iptables_exec",
            "iptables-family programs started, per calling agent",
            self.execs.clone(),
        );
        r.register_with_unit(
            "iptables_restore_duration",
            "Run time of iptables-restore processes (exec to exit), per calling agent",
            Unit::Seconds,
            self.restore.clone(),
        );
        r.register_with_unit(
            "lock_hold_phase",
            "Of holds that replaced tables, the time in the kernel (the replaces) and in the \
             holder's own userspace (the rest), per holding agent",
            Unit::Seconds,
            self.hold_phase.clone(),
        );
        r.register(
            "sync_stalled",
            "1 while an agent's iptables-restore runs have stopped completing (none for over \
             twice its usual period while it runs, or 3 in a row timed out on the lock), 0 once \
             one completes again",
            self.sync_stalled.clone(),
        );
        r.register(
            "syncs",
            "iptables-restore runs that completed (exit 0), per agent: its sync cadence",
            self.syncs.clone(),
        );
    }

    /// Rule writes: per backend, foreign changes, unserialized writers, DROP rule counters,
    /// table sizes and nf_tables batch contents.
    fn register_rule_series(&self, r: &mut Registry) {
        r.register(
            "rule_writes",
            "Rule writes per agent and backend: legacy (xtables table replaces) or nft \
             (nf_tables batch commits)",
            self.rule_writes.clone(),
        );
        r.register(
            "foreign_rule_changes",
            "Chains and rules of one agent (the owner: their creator while watched, else by \
             naming convention) deleted, flushed, removed, added to or stripped by another",
            self.foreign_changes.clone(),
        );
        r.register(
            "mixed_backend_netns",
            "Network namespaces whose rules were written through both iptables backends \
             (legacy and nf_tables) since start: each backend's iptables-save hides the other's",
            self.mixed_backend_netns.clone(),
        );
        r.register(
            "unserialized_writes",
            "Writers of one network namespace's legacy tables that do not share a lock: pairs \
             found (writers), replaces that undid the other's write made after their read \
             (lost_write), replaces the kernel refused for it (refused_replace)",
            self.unserialized.clone(),
        );
        r.register(
            "rule_drop_packets",
            "Packets a DROP or REJECT rule (or a built-in chain's DROP policy) dropped, by its \
             own counter, read while netfilter drops packets; the first 64 rules have series \
             of their own, the rest family, table, chain and rule (other)",
            self.rule_drop_packets.clone(),
        );
        r.register(
            "rule_drop_bytes",
            "Bytes of the packets counted by xtlock_rule_drop_packets_total",
            self.rule_drop_bytes.clone(),
        );
        r.register(
            "table_entries",
            "Entries of an xtables table at its last replace, per replacing agent",
            self.table_entries.clone(),
        );
        r.register(
            "nft_changes",
            "Changes in the nf_tables batches an agent committed: batch messages per object \
             kind, added or deleted",
            self.nft_changes.clone(),
        );
    }

    /// Connections refused: by conntrack, by the node, and while a lock was held.
    fn register_refusal_series(&self, r: &mut Registry) {
        r.register(
            "conntrack_refused",
            "Connections conntrack refused, counted in the refusing kernel function \
             (__nf_conntrack_confirm NF_DROP: insert failed; __nf_conntrack_alloc: table full)",
            self.conntrack_refused.clone(),
        );
        r.register(
            "refusals",
            "Connections the node refused (ICMP destination unreachable or TCP reset sent) and \
             TCP resets its sockets received, counted in the kernel, by kind and detail",
            self.refusals.clone(),
        );
        r.register(
            "refusals_during_holds",
            "Refusals (as in xtlock_refusals_total) while an agent held a watched lock, counted \
             in the kernel per hold, by kind and the holding agent",
            self.refusals_during_holds.clone(),
        );
    }

    /// Services: windows routing to gone endpoints, new endpoints' programming, IPVS drains
    /// and the conntrack flows left on gone endpoints.
    fn register_service_series(&self, r: &mut Registry) {
        r.register_with_unit(
            "stale_endpoint",
            "How long a Service kept routing to an endpoint after it was gone from the node \
             (its veth, host route or address deleted, its neighbour failed) or stopped answering \
             (anywhere: its DNATed connections got no reply) until a rule write \
             stopped it, by the writing agent (`(none)`: still routed when tracing ended)",
            Unit::Seconds,
            self.stale_endpoint.clone(),
        );
        r.register(
            "stale_endpoint_connections",
            "Connections sent to a gone endpoint while a Service still routed to it: refused \
             (exact kernel counts of ICMP unreachable and resets to that ip:port) or \
             `unanswered` (conntrack entries DNATed to it that never saw a reply)",
            self.stale_connections.clone(),
        );
        r.register(
            "stale_endpoint_unfixed",
            "Windows of routing to a gone endpoint that no write had ended when reported \
             (tracing ended, or the address came back)",
            self.stale_still_routed.clone(),
        );
        r.register(
            "stale_endpoints_routed",
            "Service ports routing to an endpoint gone from the node now, one per (Service \
             port, endpoint): up as xtlock sees the endpoint gone while routed, down when a \
             rule write stops routing to it",
            self.stale_routed_now.clone(),
        );
        r.register_with_unit(
            "endpoint_programming",
            "New endpoints: from the moment their address came up on the node (a pod's host \
             route, its neighbour entry on the bridge, a local address) to the rule write that \
             first routed a Service to them, by the writing agent and how the address came up. \
             An upper bound of the node's part: it includes the pod's readiness",
            Unit::Seconds,
            self.endpoint_programming.clone(),
        );
        r.register_with_unit(
            "ipvs_drained",
            "How long an IPVS real server stayed at weight 0 (kube-proxy's graceful termination: \
             no new connections, the old ones drain) from the netlink read that found it there \
             to the one that found it removed (`removed=\"false\"`: still there when tracing \
             ended). One that lingers keeps old connections on a pod that may be gone",
            Unit::Seconds,
            self.ipvs_drained.clone(),
        );
        r.register(
            "stale_endpoint_conntrack_flows",
            "Conntrack entries still DNATed to a gone endpoint after the rules stopped routing \
             to it, when its window was reported (flows conntrack keeps steering there, UDP \
             above all), by protocol",
            self.stale_flows.clone(),
        );
    }

    /// Packet drops and the conntrack statistics.
    fn register_drop_series(&self, r: &mut Registry) {
        r.register(
            "drops",
            "Packets dropped by the kernel, by drop reason, kernel function and xtlock's class",
            self.drops.clone(),
        );
        for ((name, help), fam) in CONNTRACK_COUNTERS.iter().zip(&self.conntrack) {
            r.register(format!("conntrack_{name}"), *help, fam.clone());
        }
        r.register(
            "conntrack_entries",
            "Entries in the conntrack table",
            self.conntrack_entries.clone(),
        );
        r.register(
            "conntrack_max",
            "Size of the conntrack table (nf_conntrack_max)",
            self.conntrack_max.clone(),
        );
    }

    /// IPVS traffic and table changes.
    fn register_ipvs_series(&self, r: &mut Registry) {
        r.register(
            "ipvs_packets",
            "Packets IPVS forwarded to a real server of a virtual service (exact, counted in \
             the kernel)",
            self.ipvs_packets.clone(),
        );
        r.register(
            "ipvs_stale_packets",
            "Packets on IPVS connections whose real server was set to weight 0 (forwarded) or \
             removed (dropped or expired)",
            self.ipvs_stale_packets.clone(),
        );
        r.register(
            "ipvs_connections",
            "New IPVS connections scheduled to a real server",
            self.ipvs_connections.clone(),
        );
        r.register(
            "ipvs_table_changes",
            "IPVS virtual-service and real-server changes, by kind and by the process that made \
             them",
            self.ipvs_changes.clone(),
        );
    }

    /// xtlock itself: events, probes, features, the rolling capture and the build.
    fn register_self_series(&self, r: &mut Registry, kernel: &str) {
        r.register(
            "events_lost",
            "Events the kernel dropped because the ring buffer was full",
            self.lost.clone(),
        );
        r.register(
            "events",
            "Events analysed (kernel events and /proc snapshots)",
            self.events.clone(),
        );
        r.register(
            "probe_attached",
            "1 when the kernel hook is attached and still linked, 0 otherwise",
            self.probe_attached.clone(),
        );
        r.register(
            "feature_enabled",
            "1 when the feature works with this process's privileges and kernel, 0 when it is \
             off; cause says why (privilege or kernel)",
            self.feature_enabled.clone(),
        );
        r.register(
            "recording_up",
            "1 while the daemon writes its rolling capture (--record-dir), 0 while it cannot \
             (it retries by itself)",
            self.recording_up.clone(),
        );
        r.register(
            "recording_errors",
            "Failures to open or write a capture file of the rolling capture",
            self.recording_errors.clone(),
        );
        // A gauge, not an OpenMetrics info: Prometheus' text format has no info type.
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
                kernel: kernel.to_owned(),
            })
            .set(1);
        r.register(
            "build_info",
            "xtlock's version and the kernel release",
            build,
        );
    }

    /// The exposition, in Prometheus' text format 0.0.4 (see [`to_prometheus_text`]).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut s = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut s, &self.registry)?;
        Ok(to_prometheus_text(&s))
    }

    /// Publishes who holds each lock right now: `lock_held` 1/0 per lock and one
    /// `lock_holder_info` series per open hold. `open` is (lock, agent, role).
    pub fn set_open_holds<'a>(
        &self,
        locks: impl IntoIterator<Item = &'a str>,
        open: impl IntoIterator<Item = HoldLabels>,
    ) {
        let open: Vec<HoldLabels> = open.into_iter().collect();
        for lock in locks {
            let n = open.iter().filter(|h| h.lock == lock).count();
            self.held
                .get_or_create(&LockLabels {
                    lock: lock.to_owned(),
                })
                .set(i64::from(n > 0));
        }
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        for old in published.iter().filter(|o| !open.contains(o)) {
            self.holder_info.remove(old);
        }
        for h in &open {
            self.holder_info.get_or_create(h).set(1);
        }
        *published = open;
    }
}

/// OpenMetrics text (what prometheus-client writes) as Prometheus text 0.0.4: a counter
/// family `x` with samples `x_total` is described as `x_total` (else the 0.0.4 parser, and
/// `promtool check metrics`, see samples without HELP/TYPE), and `# UNIT` / `# EOF` go.
pub fn to_prometheus_text(om: &str) -> String {
    let counters: HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len() + 16 * counters.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        if let Some((p, rest)) = meta {
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            if counters.contains(name) {
                out.push_str(p);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(tail);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Keeps at most `max` distinct values; the rest map to [`OTHER`].
#[derive(Debug)]
pub struct Capped {
    seen: HashSet<String>,
    max: usize,
}

impl Capped {
    pub fn new(max: usize) -> Self {
        Self {
            seen: HashSet::new(),
            max,
        }
    }

    pub fn label(&mut self, v: &str) -> String {
        if self.seen.contains(v) {
            return v.to_owned();
        }
        if self.seen.len() < self.max {
            self.seen.insert(v.to_owned());
            return v.to_owned();
        }
        OTHER.to_owned()
    }
}

/// The sink: turns facts into metric updates.
pub struct MetricsSink {
    m: Arc<Metrics>,
    agents: Capped,
    pods: Capped,
    drop_kinds: Capped,
    refusal_details: Capped,
    ipvs_series: Capped,
    drop_rules: Capped,
    /// Table names come from the replacing process's memory: capped like agents.
    tables: Capped,
    locks: Capped,
    /// The daemon's own network namespace (inode), labelled `host`.
    host_netns: Option<u32>,
}

impl MetricsSink {
    pub fn new(m: Arc<Metrics>, host_netns: Option<u32>) -> Self {
        Self {
            m,
            agents: Capped::new(MAX_AGENTS),
            pods: Capped::new(MAX_PODS),
            drop_kinds: Capped::new(MAX_DROP_KINDS),
            refusal_details: Capped::new(MAX_REFUSAL_DETAILS),
            ipvs_series: Capped::new(MAX_IPVS_SERIES),
            drop_rules: Capped::new(MAX_DROP_RULES),
            tables: Capped::new(MAX_TABLES),
            locks: Capped::new(MAX_LOCKS),
            host_netns,
        }
    }

    fn agent(&mut self, a: &str) -> String {
        let a = if a.is_empty() { "(unknown)" } else { a };
        self.agents.label(a)
    }

    /// The agent of the rule write a service fact names; `(none)` when no write was seen.
    fn writer(&mut self, w: Option<&StaleFix>) -> String {
        match w.filter(|w| !w.agent.is_empty()) {
            Some(w) => self.agent(&w.agent),
            None => "(none)".to_owned(),
        }
    }

    /// IPVS labels, `(other)` past the series cap.
    fn ipvs(&mut self, protocol: &str, service: &str, backend: &str) -> IpvsLabels {
        let key = format!("{protocol}\0{service}\0{backend}");
        if self.ipvs_series.label(&key) == OTHER {
            return IpvsLabels {
                protocol: OTHER.into(),
                service: OTHER.into(),
                backend: OTHER.into(),
            };
        }
        IpvsLabels {
            protocol: protocol.to_owned(),
            service: service.to_owned(),
            backend: backend.to_owned(),
        }
    }

    fn netns(&self, ns: u32) -> NetnsLabels {
        let host = self.host_netns.is_none_or(|h| h == ns);
        NetnsLabels {
            netns: if host { "host" } else { "other" }.to_owned(),
        }
    }
}

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// `function+0x1a/0x2b` -> `function`: the offset would multiply the series.
fn location_function(loc: &str) -> &str {
    loc.split('+').next().unwrap_or(loc)
}

/// One method per fact that updates more than a series or two; [`MetricsSink::output`] dispatches.
impl MetricsSink {
    /// A finished hold: its duration, kernel/userspace phases, nf_tables batch contents and
    /// the sizes of the tables it replaced.
    fn observe_hold(&mut self, h: &HoldFact) {
        let l = HoldLabels {
            lock: self.locks.label(&h.lock),
            agent: self.agent(&h.who.agent),
            role: h.who.role.to_owned(),
            pod: PodLabels::of(&mut self.pods, h.who.pod.as_deref()),
        };
        self.m.hold.get_or_create(&l).observe(secs(h.hold_ns));
        if h.replaces > 0 || h.reads > 0 {
            let user = h.hold_ns.saturating_sub(h.kernel_ns);
            for (phase, ns) in [("kernel", h.kernel_ns), ("userspace", user)] {
                self.m
                    .hold_phase
                    .get_or_create(&PhaseLabels {
                        agent: l.agent.clone(),
                        phase,
                    })
                    .observe(secs(ns));
            }
        }
        if let Some(b) = &h.nft {
            for (kind, added, deleted) in b.kinds() {
                for (change, n) in [("added", added), ("deleted", deleted)] {
                    if n > 0 {
                        self.m
                            .nft_changes
                            .get_or_create(&NftChangeLabels {
                                agent: l.agent.clone(),
                                kind,
                                change,
                            })
                            .inc_by(u64::from(n));
                    }
                }
            }
        }
        for t in h.tables.iter().filter(|t| t.op == "replace" && t.ret == 0) {
            if let (Some(entries), false) = (t.entries, t.table.is_empty()) {
                let table = self.tables.label(&t.table);
                self.m
                    .table_entries
                    .get_or_create(&TableLabels {
                        agent: l.agent.clone(),
                        family: t.family,
                        table,
                    })
                    .set(i64::from(entries));
            }
        }
    }

    /// A wait for the lock, split by the holder agents it was behind.
    fn observe_wait(&mut self, w: &WaitFact) {
        // One observation per holder agent the wait was behind, of the time it
        // spent behind that agent: `_sum` by holder_agent adds up to the wait time.
        let behind = w.behind_by_agent("(none)", OTHER);
        let agent = self.agent(&w.who.agent);
        let pod = PodLabels::of(&mut self.pods, w.who.pod.as_deref());
        let lock = self.locks.label(&w.lock);
        for (holder, ns) in behind {
            let l = WaitLabels {
                lock: lock.clone(),
                agent: agent.clone(),
                holder_agent: self.agent(holder),
                pod: pod.clone(),
            };
            self.m.wait.get_or_create(&l).observe(secs(ns));
        }
    }

    /// An iptables-restore that ended: its run time, and a completed sync when it succeeded.
    fn observe_restore_exit(&mut self, e: &ExitFact) {
        let l = AgentLabels {
            agent: self.agent(&e.agent),
        };
        if let Some(ns) = e.runtime_ns {
            self.m.restore.get_or_create(&l).observe(secs(ns));
        }
        if e.code == Some(0) {
            self.m.syncs.get_or_create(&l).inc();
        }
    }

    /// A DROP or REJECT rule's counters, past the series cap as `(other)`.
    fn count_rule_drops(&mut self, r: &RuleDropsFact) {
        let rule: String = if r.rule.is_empty() {
            "policy".into()
        } else {
            r.rule.chars().take(RULE_LABEL_CHARS).collect()
        };
        let key = format!(
            "{}\0{}\0{}\0{}\0{}",
            r.netns, r.family, r.table, r.chain, rule
        );
        let own = self.drop_rules.label(&key) != OTHER;
        let l = RuleDropLabels {
            family: if own { r.family.clone() } else { OTHER.into() },
            table: if own { r.table.clone() } else { OTHER.into() },
            chain: if own { r.chain.clone() } else { OTHER.into() },
            rule: if own { rule } else { OTHER.into() },
            owner: r
                .owner
                .as_deref()
                .map_or_else(|| "unknown".to_owned(), |o| self.agent(o)),
            netns: self.netns(r.netns).netns,
        };
        self.m.rule_drop_bytes.get_or_create(&l).inc_by(r.bytes);
        self.m.rule_drop_packets.get_or_create(&l).inc_by(r.packets);
    }

    /// Kernel packet drops, past the series cap as `(other)`.
    fn count_drops(&mut self, d: &DropCountFact) {
        let loc = location_function(&d.location);
        let key = format!("{}\0{}\0{}", d.reason, loc, d.class.as_str());
        let l = if self.drop_kinds.label(&key) == OTHER {
            DropLabels {
                reason: OTHER.into(),
                location: OTHER.into(),
                class: OTHER.into(),
            }
        } else {
            DropLabels {
                reason: d.reason.clone(),
                location: loc.to_owned(),
                class: d.class.as_str().to_owned(),
            }
        };
        self.m.drops.get_or_create(&l).inc_by(d.count);
    }

    /// Refusals during one hold, by kind.
    fn count_hold_refusals(&mut self, h: &HoldRefusalsFact) {
        let agent = self.agent(&h.agent);
        for g in &h.groups {
            let l = HoldRefusalLabels {
                kind: g.kind.as_str().to_owned(),
                agent: agent.clone(),
            };
            self.m
                .refusals_during_holds
                .get_or_create(&l)
                .inc_by(g.count);
        }
    }

    /// A new endpoint's time from its address coming up to the first write routing to it.
    fn observe_endpoint_programmed(&mut self, f: &EndpointProgrammedFact) {
        let agent = self.writer(Some(&f.write));
        self.m
            .endpoint_programming
            .get_or_create(&ProgrammedLabels {
                agent,
                up: f.up.to_owned(),
            })
            .observe(f.latency_ns as f64 / 1e9);
    }

    /// A closed window of routing to a gone endpoint: its length, whether still routed, the
    /// conntrack flows left on it and the connections sent there.
    fn observe_stale_endpoint(&mut self, f: &StaleEndpointFact) {
        // Every closed window was said open first.
        self.m.stale_routed_now.dec();
        let agent = self.writer(f.fix.as_ref());
        let l = StaleLabels {
            agent,
            gone: f.gone.to_owned(),
        };
        self.m
            .stale_endpoint
            .get_or_create(&l)
            .observe(f.stale_ns as f64 / 1e9);
        if f.still_routed {
            self.m.stale_still_routed.inc();
        }
        if let Some(c) = &f.conntrack {
            for (proto, n) in [
                ("udp", c.udp),
                ("tcp", c.tcp),
                ("other", c.entries - c.udp - c.tcp),
            ] {
                if n > 0 {
                    self.m
                        .stale_flows
                        .get_or_create(&StaleFlowLabels { proto })
                        .inc_by(n);
                }
            }
        }
        for (what, n) in &f.outcomes {
            let outcome = self.refusal_details.label(what);
            self.m
                .stale_connections
                .get_or_create(&StaleConnectionLabels { outcome })
                .inc_by(*n);
        }
    }

    /// Conntrack statistics deltas, and the host table's fill.
    fn count_conntrack(&mut self, c: &ConntrackFact) {
        let l = self.netns(c.netns);
        let d = &c.deltas;
        let deltas = [
            d.drop,
            d.early_drop,
            d.insert_failed,
            d.invalid,
            d.search_restart,
            d.clash_resolve,
            d.chaintoolong,
        ];
        for (fam, v) in self.m.conntrack.iter().zip(deltas) {
            if v > 0 {
                fam.get_or_create(&l).inc_by(v);
            }
        }
        // Table fill only for the host: pods' tables would each need a series.
        if l.netns == "host" {
            let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            self.m
                .conntrack_entries
                .get_or_create(&l)
                .set(clamp(c.entries));
            self.m.conntrack_max.get_or_create(&l).set(clamp(c.max));
        }
    }

    /// Packets IPVS forwarded to a real server, and those on stale ones.
    fn count_ipvs_packets(&mut self, c: &IpvsCountFact) {
        let l = self.ipvs(c.protocol, &c.service, &c.backend);
        if c.backend_state != "removed" {
            self.m.ipvs_packets.get_or_create(&l).inc_by(c.packets);
        }
        if c.backend_state != "ok" {
            let l = IpvsStaleLabels {
                protocol: l.protocol,
                service: l.service,
                backend: l.backend,
                backend_state: c.backend_state.to_owned(),
            };
            self.m
                .ipvs_stale_packets
                .get_or_create(&l)
                .inc_by(c.packets);
        }
    }

    /// A change of an IPVS virtual service or real server, by the process that made it.
    fn count_ipvs_change(&mut self, i: &IpvsFact) {
        let comm = self.agent(i.comm.as_deref().unwrap_or(""));
        self.m
            .ipvs_changes
            .get_or_create(&IpvsChangeLabels {
                change: i.event.to_owned(),
                comm,
            })
            .inc();
    }
}

impl Sink for MetricsSink {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        match o {
            // An open hold (still held when tracing ended) is not a finished duration.
            Output::Hold(h) if !h.open => self.observe_hold(h),
            Output::Wait(w) => self.observe_wait(w),
            Output::FailedTry(f) => {
                let l = LockAgentLabels {
                    lock: self.locks.label(&f.lock),
                    agent: self.agent(&f.agent),
                };
                self.m.failed_attempts.get_or_create(&l).inc();
            }
            Output::Timeout(t) => {
                let l = AgentLabels {
                    agent: self.agent(&t.who.agent),
                };
                self.m.timeouts.get_or_create(&l).inc();
            }
            Output::Exec(e) => {
                let l = AgentLabels {
                    agent: self.agent(&e.agent),
                };
                self.m.execs.get_or_create(&l).inc();
            }
            Output::Exit(e) if e.run.is_some_and(|r| r.is_restore()) => {
                self.observe_restore_exit(e)
            }
            Output::RuleWrite(w) => {
                let l = BackendLabels {
                    agent: self.agent(&w.agent),
                    backend: w.backend.as_str(),
                };
                self.m.rule_writes.get_or_create(&l).inc();
            }
            Output::RuleChange(c) if !c.ambiguous => {
                for f in &c.foreign {
                    let l = ForeignLabels {
                        agent: self.agent(&c.agent),
                        owner: self.agent(&f.owner),
                    };
                    self.m.foreign_changes.get_or_create(&l).inc_by(f.count());
                }
            }
            Output::MixedBackends(_) => {
                self.m.mixed_backend_netns.inc();
            }
            // `lost_rules` details a `lost_write` already counted.
            Output::Unserialized(u) if u.kind != "lost_rules" => {
                let l = UnserializedLabels {
                    kind: u.kind,
                    agent: self.agent(&u.writer.agent),
                    other_agent: self.agent(&u.other.agent),
                };
                self.m.unserialized.get_or_create(&l).inc();
            }
            Output::Stall(st) => {
                let l = AgentLabels {
                    agent: self.agent(&st.agent),
                };
                self.m
                    .sync_stalled
                    .get_or_create(&l)
                    .set(i64::from(st.stalled));
            }
            Output::Lost(l) if l.bound.is_none() => {
                self.m.lost.inc_by(l.count);
            }
            Output::RuleDrops(r) => self.count_rule_drops(r),
            Output::DropCount(d) => self.count_drops(d),
            Output::RefusalCount(r) => {
                let l = RefusalLabels {
                    kind: r.kind.as_str().to_owned(),
                    detail: self.refusal_details.label(&r.detail),
                    netns: self.netns(r.netns).netns,
                };
                self.m.refusals.get_or_create(&l).inc_by(r.count);
            }
            Output::HoldRefusals(h) => self.count_hold_refusals(h),
            Output::EndpointProgrammed(f) => self.observe_endpoint_programmed(f),
            Output::StaleEndpointOpen(_) => {
                self.m.stale_routed_now.inc();
            }
            Output::IpvsDrained(f) => {
                self.m
                    .ipvs_drained
                    .get_or_create(&DrainedLabels {
                        removed: f.removed.to_string(),
                    })
                    .observe(f.drained_ns as f64 / 1e9);
            }
            Output::StaleEndpoint(f) => self.observe_stale_endpoint(f),
            Output::ConntrackRefused(c) => {
                let l = RefusedLabels {
                    netns: self.netns(c.netns).netns,
                    class: c.class.as_str().to_owned(),
                };
                self.m.conntrack_refused.get_or_create(&l).inc();
            }
            Output::Conntrack(c) => self.count_conntrack(c),
            Output::IpvsCount(c) => self.count_ipvs_packets(c),
            Output::Ipvs(i) if i.event == "scheduled" => {
                let l = self.ipvs(i.protocol, &i.service, &i.backend);
                self.m.ipvs_connections.get_or_create(&l).inc();
            }
            Output::Ipvs(i) if i.event.starts_with("dest_") || i.event.starts_with("service_") => {
                self.count_ipvs_change(i)
            }
            _ => {}
        }
        Ok(())
    }

    fn summary(&mut self, _s: &Summary, _final: bool) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
