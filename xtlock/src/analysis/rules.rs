//! Rule writes: which backend each agent writes its rules through, and network namespaces
//! where both hold rules. A legacy write is a table replace through `setsockopt`
//! (`IPT_SO_SET_REPLACE` and the ip6/eb twins, as `iptables-legacy*` send them); an
//! nf_tables write is a netlink batch commit (`iptables-nft*`, `nft`, firewalld's nftables
//! backend, kube-proxy's nftables mode). Each backend's `iptables-save` shows only its own
//! rules, and the kernel runs both: two agents on two backends in one netns do not see each
//! other's rules (kubernetes-sigs/iptables-wrappers, cilium#28260). The first write that
//! puts a netns in that state is a fact ([`MixedBackendsFact`]), naming who writes where.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::attribution::Attributor;
use super::facts::{MixedBackendsFact, Output, RuleWriteFact};
use super::iptables_run::Backend;
use super::procs::{FastMap, ProcTable};
use crate::decode::{Event, TableReplaceEvent};
use crate::event::Comm;

/// Network namespaces followed; past it, new ones are not.
const MAX_NETNS: usize = 4096;
/// Agents listed per netns and backend.
const MAX_AGENTS_LISTED: usize = 16;

/// One agent's writes through one backend, in the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RuleWrites {
    pub writes: u64,
    /// The programs that wrote (as exec'd), e.g. `iptables-legacy-restore`, `nft`.
    pub programs: BTreeSet<String>,
    /// Legacy: the tables replaced, `family:table` (e.g. `ip:filter`).
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub tables: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct NetnsWriters {
    legacy: BTreeSet<String>,
    nft: BTreeSet<String>,
    said: bool,
}

#[derive(Debug, Default)]
pub struct RuleTracker {
    by_agent: BTreeMap<(String, Backend), RuleWrites>,
    netns: FastMap<u32, NetnsWriters>,
    mixed: BTreeMap<u32, MixedBackendsFact>,
}

impl RuleTracker {
    /// A kernel event: a rule write is counted for its agent and its netns.
    pub fn on_event(
        &mut self,
        ev: &Event,
        procs: &ProcTable,
        attr: &mut Attributor,
        out: &mut impl FnMut(Output),
    ) {
        let (ts_ns, pid, netns, backend, comm, table) = match ev {
            Event::TableReplace(t) if is_legacy_write(t) => {
                let touch = super::lock::table_touch(t, 0);
                let comm = procs.get(t.tgid).map(|p| p.comm).unwrap_or_default();
                let table = format!("{}:{}", touch.family, touch.table);
                (t.ts_ns, t.tgid, t.netns, Backend::Legacy, comm, Some(table))
            }
            Event::NftCommit(n) if n.batch.as_ref().is_none_or(|b| b.changes() > 0) => {
                (n.ts_ns, n.tgid, n.netns, Backend::Nft, n.comm, None)
            }
            _ => return,
        };
        self.write(ts_ns, pid, netns, backend, &comm, table, procs, attr, out);
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        ts_ns: u64,
        pid: u32,
        netns: u32,
        backend: Backend,
        comm: &Comm,
        table: Option<String>,
        procs: &ProcTable,
        attr: &mut Attributor,
        out: &mut impl FnMut(Output),
    ) {
        let who = attr.get(procs, pid, comm);
        let agent = if who.agent.is_empty() {
            who.comm.to_string()
        } else {
            who.agent.to_string()
        };
        let program = procs
            .get(pid)
            .map(|p| p.exe_name())
            .filter(|e| !e.is_empty())
            .map_or_else(|| who.comm.to_string(), str::to_owned);
        let w = self.by_agent.entry((agent.clone(), backend)).or_default();
        w.writes += 1;
        if w.programs.len() < MAX_AGENTS_LISTED {
            w.programs.insert(program.clone());
        }
        if let Some(t) = &table {
            if w.tables.len() < MAX_AGENTS_LISTED {
                w.tables.insert(t.clone());
            }
        }
        out(Output::RuleWrite(RuleWriteFact {
            ts_ns,
            pid,
            agent: who.agent.clone(),
            backend,
            program: program.clone(),
            netns,
            table,
        }));
        // Which netns: unknown (0, an older capture or no BTF) cannot be compared.
        if netns == 0 || (!self.netns.contains_key(&netns) && self.netns.len() >= MAX_NETNS) {
            return;
        }
        let n = self.netns.entry(netns).or_default();
        let side = match backend {
            Backend::Legacy => &mut n.legacy,
            Backend::Nft => &mut n.nft,
        };
        let label = format!("{agent} ({program})");
        if side.len() < MAX_AGENTS_LISTED {
            side.insert(label);
        }
        if n.legacy.is_empty() || n.nft.is_empty() {
            return;
        }
        let fact = MixedBackendsFact {
            ts_ns,
            netns,
            legacy: n.legacy.iter().cloned().collect(),
            nft: n.nft.iter().cloned().collect(),
            agent,
            pid,
            backend,
        };
        // Said once per netns, when it first holds both; the summary has the final picture.
        self.mixed.insert(netns, fact.clone());
        if !n.said {
            n.said = true;
            out(Output::MixedBackends(fact));
        }
    }

    /// (agent, backend) → its writes.
    pub fn by_agent(&self) -> impl Iterator<Item = (&str, Backend, &RuleWrites)> {
        self.by_agent.iter().map(|((a, b), w)| (a.as_str(), *b, w))
    }

    /// Network namespaces where both backends were written, as last seen.
    pub fn mixed(&self) -> impl Iterator<Item = &MixedBackendsFact> {
        self.mixed.values()
    }
}

/// A legacy table replaced (not a read, not a counter update, and it succeeded).
fn is_legacy_write(t: &TableReplaceEvent) -> bool {
    use xtlock_common::{EBT_SO_SET_ENTRIES, XT_SO_SET_REPLACE};
    !t.read && t.ret == 0 && (t.optname == XT_SO_SET_REPLACE || t.optname == EBT_SO_SET_ENTRIES)
}
