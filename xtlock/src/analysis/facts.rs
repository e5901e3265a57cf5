//! Every fact the analysis emits, in one place: what a sink may show and what JSON Lines
//! carry (`{"type": ...}`). The state machines that make them (`lock`, `drops`, `ipvs`) and
//! the sinks that show them both import this module; it imports neither.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Serialize, Serializer};

use super::attribution::{Attribution, ChainLink};
use super::iptables_run::IptablesRun;
use crate::decode::{Argv, ConntrackCounters, StaleAction};
use crate::kube::PodName;
use crate::shared::SharedStr;

// ---- from analysis/mod.rs

/// One fact, serialised as one JSON Lines object tagged by `"type"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Output {
    Hold(HoldFact),
    Wait(WaitFact),
    FailedTry(FailedTryFact),
    Timeout(TimeoutFact),
    Exec(ExecFact),
    Exit(ExitFact),
    Lost(LostFact),
    /// A sampled packet drop.
    Drop(DropFact),
    /// Exact drops of one kind in one interval.
    DropCount(DropCountFact),
    /// Conntrack counter deltas of one netns.
    Conntrack(ConntrackFact),
    /// The drops that happened while one hold lasted.
    HoldDrops(HoldDropsFact),
    /// IPVS: a connection scheduled, a real-server change, stale forwarding.
    Ipvs(IpvsFact),
    /// IPVS: exact packets per (service, backend, state) in one interval.
    IpvsCount(IpvsCountFact),
    /// A connection conntrack refused, seen in its own function.
    ConntrackRefused(ConntrackRefusedFact),
    /// An agent's restores stopped completing (or completed again).
    Stall(StallFact),
    /// Rules written: a legacy table replace or an nf_tables batch, by whom and where.
    RuleWrite(RuleWriteFact),
    /// What a write changed in a legacy or nf_tables table, and whose rules those were.
    RuleChange(RuleChangeFact),
    /// Both iptables backends hold rules written in one network namespace.
    MixedBackends(MixedBackendsFact),
    /// Writers of one namespace's legacy tables not serialized by one lock, and the writes
    /// that cost.
    Unserialized(UnserializedFact),
    /// Exact refusals of one kind to one destination in one interval.
    RefusalCount(RefusalCountFact),
    /// The refusals that happened while one hold lasted.
    HoldRefusals(HoldRefusalsFact),
    /// One refusal sampled in the kernel, with the refused connection.
    Refusal(RefusalFact),
    /// A Service routes to an endpoint already gone from the node: said as the window opens.
    StaleEndpointOpen(StaleEndpointOpenFact),
    /// A Service kept routing to an endpoint after it was gone from the node.
    StaleEndpoint(StaleEndpointFact),
    /// A Service first routed to an endpoint whose address came up on the node meanwhile.
    EndpointProgrammed(EndpointProgrammedFact),
    /// An IPVS real server's time at weight 0, from the read that found it there to its
    /// removal (or the end of tracing).
    IpvsDrained(IpvsDrainedFact),
    /// What one dropping rule dropped in one interval, whose rule it is and which write put
    /// it there.
    RuleDrops(RuleDropsFact),
    /// Dropping rules that keep no counter in a namespace where netfilter drops packets:
    /// what they drop cannot be named (said once per table).
    UncountedDrops(UncountedDropsFact),
}

impl Output {
    /// When it happened (the start, for holds and waits).
    pub fn ts_ns(&self) -> u64 {
        match self {
            Output::Hold(h) => h.start_ns,
            Output::Wait(w) => w.start_ns,
            Output::FailedTry(f) => f.ts_ns,
            Output::Timeout(t) => t.ts_ns,
            Output::Exec(e) => e.ts_ns,
            Output::Exit(e) => e.ts_ns,
            Output::Lost(l) => l.ts_ns,
            Output::Drop(d) => d.ts_ns,
            Output::ConntrackRefused(c) => c.ts_ns,
            Output::Stall(s) => s.ts_ns,
            Output::MixedBackends(m) => m.ts_ns,
            Output::Unserialized(u) => u.ts_ns,
            Output::RuleWrite(w) => w.ts_ns,
            Output::RuleChange(c) => c.ts_ns,
            Output::DropCount(d) => d.ts_ns,
            Output::Conntrack(c) => c.ts_ns,
            Output::HoldDrops(h) => h.start_ns,
            Output::Ipvs(i) => i.ts_ns,
            Output::IpvsCount(c) => c.ts_ns,
            Output::RefusalCount(r) => r.ts_ns,
            Output::HoldRefusals(h) => h.start_ns,
            Output::Refusal(r) => r.ts_ns,
            Output::StaleEndpointOpen(s) => s.ts_ns,
            Output::StaleEndpoint(s) => s.ts_ns,
            Output::EndpointProgrammed(p) => p.ts_ns,
            Output::IpvsDrained(d) => d.ts_ns,
            // The interval's start: its drops happened after it.
            Output::RuleDrops(r) => r.since_ns,
            Output::UncountedDrops(u) => u.ts_ns,
        }
    }
}

/// An iptables-family binary was started.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExecFact {
    pub ts_ns: u64,
    pub pid: u32,
    pub ppid: u32,
    pub comm: SharedStr,
    /// Restore, save or command; family; backend when the name says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<IptablesRun>,
    pub filename: SharedStr,
    pub argv: Argv,
    pub argv_truncated: bool,
    /// argv joined by spaces (`" ..."` appended when truncated).
    pub cmdline: SharedStr,
    /// The caller.
    pub agent: SharedStr,
    pub role: &'static str,
    pub agent_pid: u32,
    /// From the new process up to the oldest known ancestor.
    pub chain: Arc<[ChainLink]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<SharedStr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<SharedStr>,
    /// Namespace, pod and container, when the kubelet named them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<Arc<PodName>>,
}

/// An iptables-family process ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExitFact {
    pub ts_ns: u64,
    pub pid: u32,
    pub comm: SharedStr,
    /// What the process was, from its exec (absent when neither its exec nor its argv at
    /// start was seen, or it is no iptables-family program).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<IptablesRun>,
    /// Exit status; `None` (JSON null) when killed by a signal.
    pub code: Option<i32>,
    pub agent: SharedStr,
    pub role: &'static str,
    /// Since its exec, when that was seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_ns: Option<u64>,
    /// Status 4 after lock trouble: a [`TimeoutFact`] was emitted just before.
    pub lock_timeout: bool,
}

/// The kernel dropped events (ring buffer full), or the analysis reached one of its bounds
/// (`bound`, e.g. `open_waits`): what went past it is not tracked. A bound is reported at
/// its first hit; the summary counts every hit (`over_bounds`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LostFact {
    pub ts_ns: u64,
    pub count: u64,
    /// Lost since tracing began.
    pub total: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound: Option<&'static str>,
}

// ---- from xtables_lock.rs and nf_tables_lock.rs

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitOutcome {
    Acquired,
    /// Gave up: `-EINTR`/`-ERESTARTSYS`, another failure after a deferral, an iptables that
    /// exited with status 4 while waiting, or a poller that stopped trying.
    TimedOut,
    /// The process exited while waiting.
    Abandoned,
    /// Still waiting when tracing ended.
    Open,
}

impl WaitOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitOutcome::Acquired => "acquired",
            WaitOutcome::TimedOut => "timed_out",
            WaitOutcome::Abandoned => "abandoned",
            WaitOutcome::Open => "open",
        }
    }
}

/// How a waiter waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitMode {
    /// Slept in the kernel (`flock(LOCK_EX)`).
    Blocking,
    /// Retried `LOCK_NB` from userspace.
    Poll,
}

fn hex<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    // Kernel pointers do not fit a JSON double: a string keeps them exact.
    s.collect_str(&format_args!("{v:#x}"))
}

/// A process that held the lock while someone waited.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HolderRef {
    pub pid: u32,
    pub agent: SharedStr,
    pub role: &'static str,
    pub comm: SharedStr,
    pub cmdline: SharedStr,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<Arc<PodName>>,
    /// In a wait: how long it waited behind this holder, from when this holder took the
    /// lock (or the wait began) to when the next one did (or the wait ended).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub behind_ns: Option<u64>,
    /// In a wait: when this holder first held the lock during it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_ns: Option<u64>,
    /// In a wait: this holder was itself waiting for another lock while it held this one
    /// (a batch holds nfnetlink's nf_tables mutex while it waits for its netns's commit
    /// mutex): the root of the wait is there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Arc<Waiting>>,
}

/// What a holder was itself waiting for, during the time another wait was behind it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Waiting {
    /// The lock it waited for.
    pub lock: SharedStr,
    /// How much of the time behind the holder it was itself waiting.
    pub wait_ns: u64,
    /// Whom it waited behind, with `behind_ns` clipped to that time.
    pub holders: Vec<HolderRef>,
}

impl From<&Attribution> for HolderRef {
    fn from(a: &Attribution) -> Self {
        HolderRef {
            pid: a.pid,
            agent: a.agent.clone(),
            role: a.role,
            comm: a.comm.clone(),
            cmdline: a.cmdline.clone(),
            pod: a.pod.clone(),
            behind_ns: None,
            from_ns: None,
            waiting: None,
        }
    }
}

/// Who a hold, wait or timeout is about: the process and what it belongs to, one shape made
/// from its [`Attribution`], its fields flattened into the fact's JSON.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Who {
    pub comm: SharedStr,
    pub agent: SharedStr,
    pub role: &'static str,
    pub cmdline: SharedStr,
    pub agent_pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<SharedStr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<SharedStr>,
    /// Namespace, pod and container, when the kubelet named them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<Arc<PodName>>,
}

impl From<&Attribution> for Who {
    fn from(a: &Attribution) -> Self {
        Who {
            comm: a.comm.clone(),
            agent: a.agent.clone(),
            role: a.role,
            cmdline: a.cmdline.clone(),
            agent_pid: a.agent_pid,
            pod_uid: a.pod_uid.clone(),
            container_id: a.container_id.clone(),
            pod: a.pod.clone(),
        }
    }
}

/// The lock was held from `start_ns` for `hold_ns`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HoldFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub tid: u32,
    /// Who held it.
    #[serde(flatten)]
    pub who: Who,
    pub start_ns: u64,
    pub hold_ns: u64,
    #[serde(serialize_with = "hex")]
    pub owner: u64,
    pub exclusive: bool,
    /// Time the holder spent in the kernel in xtables table calls during the hold: reads
    /// (`getsockopt`) and replaces (`setsockopt`).
    pub kernel_ns: u64,
    /// Number of replaces (and counter updates).
    pub replaces: u32,
    /// Of `kernel_ns`, the time reading tables out (`*_SO_GET_INFO`, `*_SO_GET_ENTRIES`),
    /// and the number of those reads.
    #[serde(skip_serializing_if = "is_zero")]
    pub read_ns: u64,
    #[serde(skip_serializing_if = "is_zero_u32")]
    pub reads: u32,
    /// Of `kernel_ns`, the time in `xt_replace_table`: swapping the new table in and waiting
    /// for every CPU to leave the old one. Present when that hook attached and saw a swap.
    #[serde(skip_serializing_if = "is_zero")]
    pub swap_ns: u64,
    /// The tables it replaced (or updated the counters of), in order: the head of each
    /// call's argument and its time in the kernel. At most [`MAX_TABLES_PER_HOLD`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<TableTouch>,
    /// For an nf_tables commit: what its batch changed, per object kind, when counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nft: Option<crate::event::NftBatch>,
    /// Held already when tracing began (seen in /proc/locks): `start_ns` is when tracing
    /// began, so `hold_ns` is a lower bound.
    #[serde(skip_serializing_if = "is_false")]
    pub before_start: bool,
    /// Pid whose close released it, when that was seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released_by: Option<u32>,
    /// Still held when tracing ended: `hold_ns` is a lower bound.
    pub open: bool,
    /// The end was inferred (release lost or late): `hold_ns` is approximate.
    pub incomplete: bool,
}

/// An agent's syncs stalled, or resumed: `{"type":"stall",...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StallFact {
    pub ts_ns: u64,
    pub agent: SharedStr,
    pub agent_pid: u32,
    /// True when the stall begins, false when a completed restore ends it.
    pub stalled: bool,
    /// `no_sync` (no completed restore for over twice the usual period, the agent alive),
    /// `restores_time_out` (restores in a row gave up on the lock), `restore_hung` (one runs
    /// far longer than usual); ends: `synced`, or `restore_ended` (the hung one exited
    /// without completing).
    pub reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_last_sync_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usual_period_ns: Option<u64>,
    pub timeouts_in_row: u32,
    /// `restore_hung` and its end `restore_ended`: the restore that hangs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restore: Option<HungRestore>,
}

/// What the writes since the previous read of a legacy table changed (the table read back
/// after them), and whose chains and rules they were.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleChangeFact {
    /// When the table was read.
    pub ts_ns: u64,
    pub netns: u32,
    pub family: String,
    pub table: String,
    /// The writer; several, comma-separated, when `ambiguous`.
    pub agent: String,
    /// Writes by more than one agent between two reads: the change is theirs together.
    pub ambiguous: bool,
    /// The last writer's pid.
    pub pid: u32,
    #[serde(flatten)]
    pub diff: TableDiff,
    /// Changes to chains and rules of other agents than the writer, per owner.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub foreign: Vec<ForeignChange>,
    /// Chains put back by their owner after another agent removed them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub restored: Vec<Restored>,
    /// DROP or REJECT rules that match every packet reaching them, in a chain reachable
    /// from a built-in chain: `CHAIN: RULE`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bare_drops: Vec<String>,
    /// The table could not be read (and is not diffed until it can): why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// A rule that kept its place, target and comment but not its matches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StrippedRule {
    pub chain: String,
    /// Matches it had and no longer has, and the reverse.
    pub lost: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gained: Vec<String>,
    /// The rule as it is now.
    pub now: String,
}

/// The changes between two reads of a table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TableDiff {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub created: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deleted: Vec<String>,
    /// Chains that had rules and now have none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub flushed: Vec<String>,
    /// (chain, rule) added and removed, stripped rules apart.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub added: Vec<(String, String)>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<(String, String)>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stripped: Vec<StrippedRule>,
    /// Built-in chains whose policy changed: (chain, old, new).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<(String, String, String)>,
}

impl TableDiff {
    pub fn is_empty(&self) -> bool {
        self.created.is_empty()
            && self.deleted.is_empty()
            && self.flushed.is_empty()
            && self.added.is_empty()
            && self.removed.is_empty()
            && self.stripped.is_empty()
            && self.policies.is_empty()
    }
}

/// One owner's chains and rules changed by another agent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ForeignChange {
    pub owner: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chains_deleted: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chains_flushed: Vec<String>,
    pub rules_removed: u64,
    pub rules_added: u64,
    /// Its rules that kept their place but lost or gained matches.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rules_changed: Vec<StrippedRule>,
}

impl ForeignChange {
    /// Chains and rules touched.
    pub fn count(&self) -> u64 {
        (self.chains_deleted.len() + self.chains_flushed.len() + self.rules_changed.len()) as u64
            + self.rules_removed
            + self.rules_added
    }

    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }
}

/// A chain its owner created again after another agent deleted or flushed it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Restored {
    pub chain: String,
    /// How long it was gone.
    pub gone_ns: u64,
    pub removed_by: String,
}

/// One rule write.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleWriteFact {
    pub ts_ns: u64,
    pub pid: u32,
    pub agent: SharedStr,
    pub backend: super::iptables_run::Backend,
    /// The writing program as exec'd (`iptables-legacy-restore`, `nft`, ...).
    pub program: String,
    /// The binary as resolved on disk and the version it carries
    /// (`xtables-nft-multi 1.8.9 (nf_tables)`), when the source could read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub binary: Option<String>,
    /// Inode of the netns written; 0 when unknown.
    pub netns: u32,
    /// Legacy: `family:table` replaced (e.g. `ip:filter`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
}

/// Rules written through both iptables backends in one network namespace: legacy
/// (`setsockopt` table replaces) and nf_tables (netlink batches). Each backend's
/// `iptables-save` shows only its own; both sets of rules are in force.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MixedBackendsFact {
    /// The write that made it so (or, in the summary, the last one seen).
    pub ts_ns: u64,
    /// Inode of the network namespace.
    pub netns: u32,
    /// Who writes through each: `agent (program)`.
    pub legacy: Vec<String>,
    pub nft: Vec<String>,
    /// The writer of that write.
    pub agent: String,
    pub pid: u32,
    pub backend: super::iptables_run::Backend,
}

/// A restore that runs far longer than its agent's restores do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HungRestore {
    pub pid: u32,
    /// Running for this long (at the stall), or ran (at its end).
    pub running_ns: u64,
    /// The agent's usual restore (median of its last ones), once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usual_ns: Option<u64>,
    /// At the end: its exit status (`None`: killed, or still running).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

/// Tables listed per hold; `replaces` and `kernel_ns` count every one.
pub const MAX_TABLES_PER_HOLD: usize = 16;

/// One table a holder replaced, or updated the counters of, while it held the lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TableTouch {
    /// `filter`, `nat`, `mangle`, `raw`, `security`, `broute`...; empty when the head of the
    /// call's argument could not be read.
    pub table: String,
    /// `ip`, `ip6` or `eb`.
    pub family: &'static str,
    /// `replace` or `counters` (a `setsockopt`), `info` or `entries` (a read).
    pub op: &'static str,
    /// Entries of the new table, as the kernel counts them (rules, one policy per built-in
    /// chain, a head and a return per user chain, one end); counters, for `counters`; the
    /// table's entries before the hold changed it, for `info`. `None` when the head could
    /// not be read, and for `entries` (which asks by size).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entries: Option<u32>,
    /// Bytes of the new table's entries (`replace`); of the table read (`info`, `entries`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u32>,
    /// When the call entered the kernel, and its time there.
    pub start_ns: u64,
    pub kernel_ns: u64,
    /// 0, or the negative errno the call failed with.
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub ret: i64,
}

impl TableTouch {
    /// What one table call was (read or set, family, table, size), from its event.
    pub fn of(t: &crate::decode::TableReplaceEvent, kernel_ns: u64) -> TableTouch {
        use xtlock_common::{
            EBT_SO_SET_COUNTERS, EBT_SO_SET_ENTRIES, SOL_IPV6, XT_SO_GET_INFO, XT_SO_SET_REPLACE,
        };
        if t.read {
            let info = t.optname == XT_SO_GET_INFO;
            return TableTouch {
                table: t.head.as_ref().map(|h| h.name()).unwrap_or_default(),
                family: if t.level == SOL_IPV6 { "ip6" } else { "ip" },
                op: if info { "info" } else { "entries" },
                entries: t.head.as_ref().filter(|_| info).map(|h| h.entries),
                bytes: t.head.as_ref().map(|h| h.bytes),
                start_ns: t.enter_ns,
                kernel_ns,
                ret: t.ret,
            };
        }
        let ebt = t.optname == EBT_SO_SET_ENTRIES || t.optname == EBT_SO_SET_COUNTERS;
        let replace = t.optname == XT_SO_SET_REPLACE || t.optname == EBT_SO_SET_ENTRIES;
        TableTouch {
            table: t.head.as_ref().map(|h| h.name()).unwrap_or_default(),
            family: if ebt {
                "eb"
            } else if t.level == SOL_IPV6 {
                "ip6"
            } else {
                "ip"
            },
            op: if replace { "replace" } else { "counters" },
            entries: t.head.as_ref().map(|h| h.entries),
            bytes: t.head.as_ref().filter(|_| replace).map(|h| h.bytes),
            start_ns: t.enter_ns,
            kernel_ns,
            ret: t.ret,
        }
    }
}

fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}

/// Someone waited for the lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WaitFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub tid: u32,
    /// Who waited.
    #[serde(flatten)]
    pub who: Who,
    pub start_ns: u64,
    pub wait_ns: u64,
    /// Everyone who held the lock during the wait, first to last, one entry per pid (at
    /// most 64), each with the time the wait spent behind it (`behind_ns`).
    pub holders: Vec<HolderRef>,
    /// Time at the start of the wait before any holder was known (its acquire was lost,
    /// or came before tracing began and was not in /proc/locks).
    #[serde(skip_serializing_if = "is_zero")]
    pub unknown_ns: u64,
    /// Time the lock was free while the wait went on: a poller's interval after a release,
    /// a woken waiter's way back to the lock.
    #[serde(skip_serializing_if = "is_zero")]
    pub free_ns: u64,
    /// Holders past the 64 named, counted per hand-over, and the time behind them.
    #[serde(skip_serializing_if = "is_zero_u32")]
    pub other_holders: u32,
    #[serde(skip_serializing_if = "is_zero")]
    pub other_holders_ns: u64,
    pub outcome: WaitOutcome,
    pub mode: WaitMode,
    /// Failed tries of a poll wait (0 for a blocking wait).
    pub tries: u32,
    /// Syscall return that ended a timed-out blocking wait.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ret: Option<i64>,
    /// Part of it was inferred (an event was lost).
    pub incomplete: bool,
}

impl WaitFact {
    /// Time behind each holder agent, in the order they held the lock; time with no known
    /// holder under `unknown` (first), holders past the cap under `others` (last). With
    /// `free_ns`, the times add up to the wait.
    pub fn behind_by_agent<'a>(&'a self, unknown: &'a str, others: &'a str) -> Vec<(&'a str, u64)> {
        let mut v: Vec<(&str, u64)> = Vec::new();
        if self.unknown_ns > 0 || self.holders.is_empty() {
            v.push((unknown, self.unknown_ns));
        }
        for h in &self.holders {
            let ns = h.behind_ns.unwrap_or(0);
            match v.iter_mut().find(|b| b.0 == h.agent.as_str()) {
                Some(b) => b.1 += ns,
                None => v.push((&h.agent, ns)),
            }
        }
        if self.other_holders > 0 {
            v.push((others, self.other_holders_ns));
        }
        v
    }
}

/// One failed non-blocking try.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailedTryFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub tid: u32,
    pub comm: SharedStr,
    pub agent: SharedStr,
    pub role: &'static str,
    pub ts_ns: u64,
    pub errno: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<Arc<PodName>>,
    /// Who held the lock then, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder: Option<HolderRef>,
}

/// An iptables-family process gave up on the lock: exit status 4 after failed tries or a
/// timed-out wait on a watched lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TimeoutFact {
    pub lock: SharedStr,
    pub pid: u32,
    /// Who gave up; its agent is the caller (the iptables' nearest non-tool ancestor).
    #[serde(flatten)]
    pub who: Who,
    pub ts_ns: u64,
    pub exit_code: i32,
    /// How long it tried.
    pub waited_ns: u64,
    /// Failed non-blocking tries.
    pub tries: u32,
    /// Who held the lock while it tried.
    pub holders: Vec<HolderRef>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

// ---- from drops.rs

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
    /// What the drops were, by class and by reason name: exact when `exact_reasons` (the
    /// kernel counted each reason during the hold; drops of reasons it had no room for are
    /// under `(other reasons)`), else from the samples inside the hold.
    pub by_class: BTreeMap<DropClass, u64>,
    pub by_reason: BTreeMap<String, u64>,
    pub samples: u64,
    /// Whether `by_reason` and `by_class` are the kernel's exact counts (captures made before
    /// it counted reasons per hold have samples only).
    pub exact_reasons: bool,
}

/// How the node turned a connection away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    /// An ICMP destination unreachable sent (netfilter's REJECT, or the stack's own).
    IcmpUnreachable,
    /// A TCP reset sent by the stack (no listener, an aborted connection).
    ResetSent,
    /// A TCP reset received by a socket of the node.
    ResetReceived,
}

impl RefusalKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalKind::IcmpUnreachable => "icmp_unreachable",
            RefusalKind::ResetSent => "reset_sent",
            RefusalKind::ResetReceived => "reset_received",
        }
    }
}

/// Exact refusals of one (netns, kind, detail, destination) in one interval:
/// `{"type":"refusal_count",...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RefusalCountFact {
    /// Start of the interval.
    pub ts_ns: u64,
    pub interval_ns: u64,
    pub netns: u32,
    pub kind: RefusalKind,
    /// `port unreachable` (ICMP), the kernel's reset reason (`NO_SOCKET`), or empty.
    pub detail: String,
    /// The refused destination, `ip:port` (the peer, for resets received); empty when
    /// unknown.
    pub dest: String,
    pub count: u64,
    /// The hold in progress when they happened, counted in the kernel: exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldRef>,
    /// The REJECT rule that refused them, from the rule reads: its comment (kube-proxy's
    /// `default/web:http has no endpoints`) or `CHAIN: rule`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

/// One refusal sampled in the kernel (rate limited, like drop samples; the counts are
/// exact apart): `{"type":"refusal",...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RefusalFact {
    pub ts_ns: u64,
    pub netns: u32,
    pub kind: RefusalKind,
    pub detail: String,
    /// As in [`RefusalCountFact`]: the refused destination, the peer for resets received.
    pub dest: String,
    /// The refused packet's addresses, protocol and ports, when its header was read (ICMP
    /// unreachable and resets sent, IPv4); resets received have `dest` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packet: Option<PacketInfo>,
    /// The task that was running (often softirq context: unrelated).
    pub pid: u32,
    /// The hold in progress, as the kernel tagged it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldRef>,
}

/// Refusals of one kind to one destination inside a hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RefusalGroup {
    pub kind: RefusalKind,
    pub detail: String,
    pub dest: String,
    pub netns: u32,
    pub count: u64,
    /// The REJECT rule behind them, when the rule reads know it (see [`RefusalCountFact`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// One refused packet of the group, from the samples (absent when none was sampled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub example: Option<PacketInfo>,
}

/// The refusals that happened while one hold lasted: `{"type":"hold_refusals",...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HoldRefusalsFact {
    pub lock: SharedStr,
    pub pid: u32,
    pub agent: SharedStr,
    pub comm: SharedStr,
    pub start_ns: u64,
    pub hold_ns: u64,
    /// Every refusal while the hold went on, counted in the kernel: exact.
    pub refused: u64,
    /// By kind and destination, most first.
    pub groups: Vec<RefusalGroup>,
}

// ---- from ipvs.rs

/// A real-server table change that made a backend stale, as remembered for later facts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DestChange {
    pub ts_ns: u64,
    /// `removed` or `weight_0`.
    pub what: &'static str,
    pub pid: u32,
    pub comm: String,
}

/// One IPVS fact, `{"type":"ipvs","event":...}` in JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IpvsFact {
    /// When it happened; for `stale_end`, when the backend went stale (the change, else the
    /// first stale packet), so the line reads "removed at T ... until T+x".
    pub ts_ns: u64,
    /// `scheduled`, `dest_added`, `dest_removed`, `dest_edited`, `service_added`,
    /// `service_edited`, `service_removed`, `stale` (the first stale packets of a
    /// connection), `stale_end` (its entry expired).
    pub event: &'static str,
    pub protocol: &'static str,
    /// Virtual service, `ip:port`.
    pub service: String,
    /// Real server, `ip:port` (empty for service changes).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub backend: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    pub weight: i32,
    /// The process that made a table change, or that was running (scheduled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm: Option<String>,
    /// Table changes: 0 or a negative errno.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ret: Option<i32>,
    /// Stale facts: `weight_0` or `removed`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_state: Option<&'static str>,
    /// Stale facts: what the kernel did with the packets (`forwarded`, `dropped`, `expired`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<StaleAction>,
    /// Stale facts: stale packets of this connection so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packets: Option<u64>,
    /// Stale facts: first and last stale packet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_packet_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_packet_ns: Option<u64>,
    /// `stale`: time left on the connection entry when its stale packet came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry_left_ns: Option<u64>,
    /// `stale_end`: when the entry expired.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expired_ns: Option<u64>,
    /// Stale facts: the change that made the backend stale, when it was seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub change: Option<DestChange>,
}

/// Exact packets of one (service, backend, state) in one interval,
/// `{"type":"ipvs_count",...}` in JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IpvsCountFact {
    pub ts_ns: u64,
    pub interval_ns: u64,
    pub protocol: &'static str,
    pub service: String,
    pub backend: String,
    /// `ok`, `weight_0` (forwarded to a weight-0 backend) or `removed` (dropped or expired).
    pub backend_state: &'static str,
    pub packets: u64,
}

/// The rule write that stopped a Service routing to a gone endpoint, and why it came when it
/// did: the writer's wait for the lock (behind whom) and its own hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StaleFix {
    /// When the rules stopped routing to it: the write's time in the kernel (`exact`), else
    /// the read that first saw it (an upper bound: no write of that netns was seen).
    pub ts_ns: u64,
    pub exact: bool,
    pub pid: u32,
    /// The writer's agent (`kube-proxy`); empty when no write was seen.
    pub agent: SharedStr,
    /// The writing program (`iptables-legacy-restore`, `nft`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub program: String,
    /// How long the writer waited for the lock before it could write (0: no wait).
    pub wait_ns: u64,
    /// Who it waited behind: (agent, time behind it), first to last.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub behind: Vec<(String, u64)>,
    /// The writer's own hold of the lock, when it took one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_ns: Option<u64>,
}

impl StaleFix {
    /// No write was seen: the read at `ts_ns` (after `pid`'s exit, or 0) found the route gone.
    pub fn unseen(ts_ns: u64, pid: u32) -> Self {
        StaleFix {
            ts_ns,
            exact: false,
            pid,
            agent: SharedStr::from(""),
            program: String::new(),
            wait_ns: 0,
            behind: Vec::new(),
            hold_ns: None,
        }
    }
}

/// A Service kept routing to an endpoint after the endpoint was gone from this node:
/// `{"type":"stale_endpoint",...}`. From the rule reads (where each Service routes) and
/// rtnetlink (when the address vanished); the connections are the node's exact refusal
/// counts to that endpoint from when it vanished until shortly after the fix.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StaleEndpointFact {
    /// When the endpoint was gone.
    pub ts_ns: u64,
    /// The network namespace whose rules routed to it.
    pub netns: u32,
    /// kube-proxy's service port, `ns/svc:port` (or its chain's name without comments).
    pub service: String,
    /// `ip:port`.
    pub endpoint: String,
    /// Why it was gone: `link deleted`, `route deleted`, `address deleted`, `neighbour failed`;
    /// or `unanswered`: an endpoint anywhere (another node's pod) whose DNATed TCP connections
    /// got no reply.
    pub gone: &'static str,
    /// The link it lived behind (the pod's veth).
    pub link: String,
    /// How long the rules kept routing to it after it was gone (until the fix, or until
    /// tracing ended when still routed).
    pub stale_ns: u64,
    /// Still routed to when tracing ended (or when its address came back).
    pub still_routed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<StaleFix>,
    /// Connections sent to it meanwhile: those the node refused (ICMP unreachable, resets,
    /// exact from the refusal counters) and those nothing answered (TCP conntrack entries
    /// DNATed to it that never saw a reply, beyond the refused ones).
    pub connections: u64,
    /// Per kind and detail (`icmp_unreachable: host unreachable`, `unanswered`).
    pub outcomes: BTreeMap<String, u64>,
    /// Conntrack entries still DNATed to it when this was said (after the fix): flows that
    /// conntrack keeps steering to the dead endpoint whatever the rules say (UDP above all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<StaleConntrack>,
}

/// A Service routes to an endpoint already gone from this node, said as soon as xtlock knows
/// (the address gone while a Service routed to it, or a read that routes to an address gone
/// before): `{"type":"stale_endpoint_open",...}`. The `stale_endpoint` fact of the same
/// service and endpoint closes it, with how long it lasted and what clients got.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StaleEndpointOpenFact {
    /// When xtlock knew: the address's disappearance, or the read that routes to it.
    pub ts_ns: u64,
    /// When the endpoint was gone.
    pub gone_ns: u64,
    /// The network namespace whose rules route to it.
    pub netns: u32,
    pub service: String,
    /// `ip:port`.
    pub endpoint: String,
    /// Why it is gone, as in `stale_endpoint`.
    pub gone: &'static str,
    /// The link it lived behind.
    pub link: String,
}

/// A Service first routed to an endpoint whose address came up on this node while xtlock
/// watched: `{"type":"endpoint_programmed",...}`. The programming latency, from the address
/// (the pod's host route, its neighbour entry on the bridge, a local address) to the rule
/// write that first routed to it: an upper bound of what the node added, since it includes
/// the pod's readiness and the control plane's endpoint update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EndpointProgrammedFact {
    /// When the address came up.
    pub ts_ns: u64,
    /// The network namespace whose rules route to it.
    pub netns: u32,
    /// kube-proxy's service port, `ns/svc:port` (or its chain's name without comments).
    pub service: String,
    /// `ip:port`.
    pub endpoint: String,
    /// How the address came up: `route`, `neighbour`, `local`.
    pub up: &'static str,
    /// The link it lives behind (the pod's veth).
    pub link: String,
    /// From the address up to the write that first routed to it (to the read that first
    /// saw it when no write was seen: `write.exact` false).
    pub latency_ns: u64,
    /// That write: who, its wait for the lock and behind whom, its own hold.
    pub write: StaleFix,
}

/// An IPVS real server kept at weight 0 (kube-proxy's graceful termination: no new
/// connections, the old ones drain) until it was removed, or still there when tracing ended:
/// `{"type":"ipvs_drained",...}`. One that lingers keeps its clients' old connections (UDP
/// flows above all) on a pod that may be gone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IpvsDrainedFact {
    /// The first read that found it at weight 0.
    pub ts_ns: u64,
    pub netns: u32,
    /// The virtual server, `udp/10.96.0.10:53`.
    pub service: String,
    pub endpoint: String,
    /// From `ts_ns` to the read that found it removed, or to the end of tracing.
    pub drained_ns: u64,
    /// Removed (else still at weight 0 when tracing ended).
    pub removed: bool,
    /// Its connections at the last read that listed it (`ipvsadm -Ln`'s ActiveConn, InActConn).
    pub active: u32,
    pub inactive: u32,
    /// Why its address is gone from the node, when it is (`link deleted`, `unanswered`...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gone: Option<&'static str>,
}

/// Conntrack entries still DNATed to a dead endpoint (see [`StaleEndpointFact::conntrack`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StaleConntrack {
    pub entries: u64,
    pub udp: u64,
    pub tcp: u64,
    /// Packets that followed them (of the original direction; 0 unless
    /// `nf_conntrack_acct` is on).
    pub packets: u64,
    /// The longest time left before one expires (each packet renews it).
    pub expires_in_s: u32,
}

/// What a writer is: its agent and the lock it held (`None`: none watched was held).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Writer {
    pub agent: SharedStr,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lock: Option<SharedStr>,
}

/// Writers of one namespace not serialized by one lock, and what it cost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UnserializedFact {
    pub ts_ns: u64,
    /// `writers`, `lost_write` or `refused_replace`.
    pub kind: &'static str,
    pub netns: u32,
    /// `family:table`, e.g. `ip:filter`.
    pub table: String,
    /// The writer whose write this is (for `writers`, the second one seen).
    pub writer: Writer,
    /// The other one (for `lost_write`, the one whose write was undone).
    pub other: Writer,
    /// `lost_write`, `refused_replace`: when the writer read the table, and when the other
    /// wrote it after that read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub other_write_ns: Option<u64>,
    /// `lost_rules`: the rules the replace removed (`-A CHAIN RULE`), from the read after it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lost_rules: Vec<String>,
}

// ---- from rule_drops.rs

/// The write that put a rule in place, as xtlock saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleAdded {
    pub ts_ns: u64,
    pub agent: String,
    /// As exec'd: `iptables-restore`, `iptables-nft`, `nft`.
    pub program: String,
    pub pid: u32,
}

/// Where one rule's dropped packets went, from the sampled drops: `udp 10.96.0.15:80`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DropDest {
    pub proto: String,
    /// `addr:port` (`[addr]:port` for IPv6), the address alone without ports.
    pub dest: String,
    /// Sampled drops to it (the kernel samples at a bounded rate: a share, not a count).
    pub samples: u64,
}

/// What one dropping rule (a `DROP` or `REJECT` rule, or a built-in chain's `DROP` policy)
/// dropped between two reads of its table's counters: `{"type":"rule_drops",...}`. Exact:
/// the kernel's own counter of that rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleDropsFact {
    /// The read that counted them (the interval's end).
    pub ts_ns: u64,
    /// The previous read (the interval's start).
    pub since_ns: u64,
    pub netns: u32,
    /// `ip`, `ip6` (legacy), `nft ip`, `nft inet`, ...
    pub family: String,
    pub table: String,
    pub chain: String,
    /// As `iptables-save` (or, for a native nf_tables rule, xtlock's nft words) prints it;
    /// empty for the chain's policy.
    pub rule: String,
    /// Packets and bytes its counter grew by.
    pub packets: u64,
    pub bytes: u64,
    /// Its counter went back: a write replaced it meanwhile, and what it dropped before that
    /// write (since the previous read) is not in `packets`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub reset: bool,
    /// Whose rule it is: the agent whose write added it, else its chain's owner.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Whose chain holds it (its creator, or by the agents' naming conventions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain_owner: Option<String>,
    /// The write that added it; `None` when it was there before xtlock read the table.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub added: Option<RuleAdded>,
    /// Where its drops went, most sampled first (at most 5): the samples of the interval
    /// that only this rule, of those that dropped then, can have dropped.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dests: Vec<DropDest>,
    /// The hold of a watched lock its sampled drops happened in, if most did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldRef>,
    /// Other rules of the namespace that dropped in the same interval.
    pub others: u32,
}

/// `{"type":"uncounted_drops",...}`: dropping rules of a table that keep no counter, in a
/// namespace where netfilter dropped packets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UncountedDropsFact {
    pub ts_ns: u64,
    pub netns: u32,
    pub family: String,
    pub table: String,
    /// `CHAIN: rule`, at most 16.
    pub rules: Vec<String>,
}
