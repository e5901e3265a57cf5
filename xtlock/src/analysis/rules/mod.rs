//! Rule writes: which backend each agent writes its rules through, and network namespaces
//! where both hold rules. A legacy write is a table replace through `setsockopt`
//! (`IPT_SO_SET_REPLACE` and the ip6/eb twins, as `iptables-legacy*` send them); an
//! nf_tables write is a netlink batch commit (`iptables-nft*`, `nft`, firewalld's nftables
//! backend, kube-proxy's nftables mode). Each backend's `iptables-save` shows only its own
//! rules, and the kernel runs both: two agents on two backends in one netns do not see each
//! other's rules (kubernetes-sigs/iptables-wrappers, cilium#28260). The first write that
//! puts a netns in that state is a fact ([`MixedBackendsFact`]), naming who writes where.
//!
//! After a legacy write the source reads the table back (`source/rules.rs`); [`diff`] says
//! what changed since the previous read, and whose the changed chains and rules were
//! ([`owners`]): a change to another agent's rules is a foreign change, said with who did
//! it. Writes by two agents between two reads make the change ambiguous: said, not guessed.

mod diff;
pub mod owners;
pub mod rejects;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use super::attribution::Attributor;
use super::facts::{
    ForeignChange, MixedBackendsFact, Output, RuleAdded, RuleChangeFact, RuleWriteFact,
};
pub use super::facts::{StrippedRule, TableDiff};
use super::iptables_run::Backend;
use super::procs::{FastMap, ProcTable};
use crate::decode::{Event, RuleTable, TableReplaceEvent};
use crate::event::Comm;
use diff::TableModel;

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
    /// The binaries as resolved on disk, with the version they carry
    /// (`xtables-legacy-multi 1.8.9 (legacy)`).
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub binaries: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct NetnsWriters {
    legacy: BTreeSet<String>,
    nft: BTreeSet<String>,
    said: bool,
}

/// (netns, family, table)
type TableKey = (u32, String, String);

/// A chain as it was when another agent deleted or flushed it.
#[derive(Debug, Clone)]
struct Removed {
    ts_ns: u64,
    by: String,
    owner: String,
}

#[derive(Debug, Default)]
pub struct RuleTracker {
    by_agent: BTreeMap<(String, Backend), RuleWrites>,
    netns: FastMap<u32, NetnsWriters>,
    mixed: BTreeMap<u32, MixedBackendsFact>,
    /// Each table as last read.
    tables: HashMap<TableKey, TableModel>,
    /// Reads whose last part has not come yet (see `RuleTable::more`).
    partial: HashMap<TableKey, RuleTable>,
    /// Legacy writes not yet covered by a read: (time, agent).
    pending: HashMap<TableKey, Vec<(u64, String)>>,
    /// Chains created while watched: their creator.
    creators: HashMap<(TableKey, String), String>,
    /// Chains another agent removed, until their owner puts them back.
    removed: HashMap<(TableKey, String), Removed>,
    /// Foreign changes per (writer, owner), for the summary.
    foreign: BTreeMap<(String, String), u64>,
    /// The binary each recent iptables process runs (from the source's `Proc` info).
    binaries: FastMap<u32, String>,
    /// Per netns, the time of the current nf_tables read (all its tables are read at once,
    /// so the writes before it are dropped only when the next read comes), and whether one
    /// came before it (then a table it does not know is new).
    nft_reads: FastMap<u32, (u64, bool)>,
    /// An nf_tables commit was seen: the nft_commit hook counts every write, and a read
    /// with no write pending (the one a writer's exit asks for, after the commit's own) is
    /// not one more.
    nft_commits_seen: bool,
    /// Each agent's last write per netns, for the rules its next read finds added.
    last_write: HashMap<(u32, String), RuleAdded>,
    /// The write that added each rule seen added: (table, chain, rule text).
    added: HashMap<(TableKey, String, String), RuleAdded>,
}

/// Rules whose adding write is remembered; past it, newer ones are not.
const MAX_ADDED: usize = 65_536;

/// nf_tables writes are pending per network namespace (a commit does not say which
/// table), under this family and table.
const NFT_ALL: (&str, &str) = ("nft", "*");

/// Tables followed; chains remembered as created or removed.
const MAX_TABLES: usize = 1024;
const MAX_CHAINS_REMEMBERED: usize = 65_536;

impl RuleTracker {
    /// The whole read `t` completes: `t` itself when it came in one part, the parts joined
    /// when it is the last of them; `None` while more are to come. A read too large for one
    /// capture record comes in parts (see `RuleTable::more`); it is diffed once whole.
    pub fn whole_table<'a>(&mut self, t: &'a RuleTable) -> Option<Cow<'a, RuleTable>> {
        // The usual read, whole in one part: no key to build.
        if !t.more && self.partial.is_empty() {
            return Some(Cow::Borrowed(t));
        }
        let key: TableKey = (t.netns, t.family.clone(), t.table.clone());
        if !t.more && !self.partial.contains_key(&key) {
            return Some(Cow::Borrowed(t));
        }
        let whole = match self.partial.remove(&key) {
            Some(mut p) if p.ts_ns == t.ts_ns => {
                p.append(t.clone());
                p
            }
            // A new read while an older one was incomplete (a capture cut short): the older
            // one is dropped.
            _ => t.clone(),
        };
        if whole.more {
            if self.partial.len() < MAX_TABLES {
                self.partial.insert(key, whole);
            }
            return None;
        }
        Some(Cow::Owned(whole))
    }

    /// A kernel event: a rule write is counted for its agent and its netns.
    pub fn on_event(
        &mut self,
        ev: &Event,
        procs: &ProcTable,
        attr: &mut Attributor,
        out: &mut impl FnMut(Output),
    ) {
        // Tables come whole through `whole_table` and `on_table` (the Analyzer's, which
        // hands the same whole read to the service model).
        if let Event::RuleTable(_) = ev {
            return;
        }
        if let Event::Proc(p) = ev {
            if let Some(exe) = &p.exe {
                let base = exe.path.rsplit('/').next().unwrap_or(&exe.path);
                let b = match &exe.version {
                    Some(v) => format!("{base} {v}"),
                    None => base.to_string(),
                };
                if self.binaries.len() >= 4096 {
                    self.binaries.clear();
                }
                self.binaries.insert(p.pid, b);
            }
            return;
        }
        let (ts_ns, pid, netns, backend, comm, table) = match ev {
            Event::TableReplace(t) if is_legacy_write(t) => {
                let touch = super::facts::TableTouch::of(t, 0);
                let comm = procs.get(t.tgid).map(|p| p.comm).unwrap_or_default();
                // Unnamed when the head could not be read (or in older captures).
                let table =
                    (!touch.table.is_empty()).then(|| format!("{}:{}", touch.family, touch.table));
                (t.ts_ns, t.tgid, t.netns, Backend::Legacy, comm, table)
            }
            Event::NftCommit(n) if n.batch.as_ref().is_none_or(|b| b.changes() > 0) => {
                self.nft_commits_seen = true;
                (n.ts_ns, n.tgid, n.netns, Backend::Nft, n.comm, None)
            }
            _ => return,
        };
        self.write(ts_ns, pid, netns, backend, &comm, table, procs, attr, out);
    }

    /// One write counted for its agent and netns; returns the agent's name.
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
    ) -> String {
        let who = attr.get(procs, pid, comm);
        let agent = who.agent_or_comm().to_string();
        let program = procs
            .get(pid)
            .map(|p| p.exe_name())
            .filter(|e| !e.is_empty())
            .map_or_else(|| who.comm.to_string(), str::to_owned);
        let pending_key = match (backend, &table) {
            (Backend::Legacy, Some(t)) => match t.split_once(':') {
                Some(("ip", name)) => Some((netns, "ip".to_string(), name.to_string())),
                _ => None,
            },
            (Backend::Nft, _) if netns != 0 => {
                Some((netns, NFT_ALL.0.to_string(), NFT_ALL.1.to_string()))
            }
            _ => None,
        };
        if let Some(key) = pending_key {
            if self.pending.len() < MAX_TABLES || self.pending.contains_key(&key) {
                let p = self.pending.entry(key).or_default();
                if p.len() < 4096 {
                    p.push((ts_ns, agent.clone()));
                }
            }
        }
        let binary = self.binaries.get(&pid).cloned();
        // Looked up before the key is built: an agent's writes after its first allocate no
        // key, and a program, table or binary already listed is not copied again.
        let key = (agent, backend);
        let w = match self.by_agent.get_mut(&key) {
            Some(w) => w,
            None => self.by_agent.entry(key.clone()).or_default(),
        };
        let (agent, _) = key;
        w.writes += 1;
        let note = |set: &mut BTreeSet<String>, v: &str| {
            if set.len() < MAX_AGENTS_LISTED && !set.contains(v) {
                set.insert(v.to_owned());
            }
        };
        if let Some(b) = &binary {
            note(&mut w.binaries, b);
        }
        note(&mut w.programs, &program);
        if let Some(t) = &table {
            note(&mut w.tables, t);
        }
        if self.last_write.len() >= MAX_TABLES
            && !self.last_write.contains_key(&(netns, agent.clone()))
        {
            self.last_write.clear();
        }
        self.last_write.insert(
            (netns, agent.clone()),
            RuleAdded {
                ts_ns,
                agent: agent.clone(),
                program: program.clone(),
                pid,
            },
        );
        out(Output::RuleWrite(RuleWriteFact {
            ts_ns,
            pid,
            agent: who.agent.clone(),
            backend,
            program: program.clone(),
            binary,
            netns,
            table,
        }));
        // Which netns: unknown (0, an older capture or no BTF) cannot be compared.
        if netns == 0 || (!self.netns.contains_key(&netns) && self.netns.len() >= MAX_NETNS) {
            return agent;
        }
        let n = self.netns.entry(netns).or_default();
        let side = match backend {
            Backend::Legacy => &mut n.legacy,
            Backend::Nft => &mut n.nft,
        };
        // `agent (program)`, built only when not listed yet.
        let listed = side.iter().any(|l| {
            l.strip_prefix(agent.as_str())
                .and_then(|r| r.strip_prefix(" ("))
                .and_then(|r| r.strip_suffix(')'))
                == Some(program.as_str())
        });
        if !listed && side.len() < MAX_AGENTS_LISTED {
            side.insert(format!("{agent} ({program})"));
        }
        if n.legacy.is_empty() || n.nft.is_empty() {
            return agent;
        }
        // Already said, with the same agents: only the latest write changes.
        if let Some(m) = self.mixed.get_mut(&netns).filter(|_| listed && n.said) {
            m.ts_ns = ts_ns;
            m.pid = pid;
            m.backend = backend;
            if m.agent != agent {
                m.agent.clone_from(&agent);
            }
            return agent;
        }
        let fact = MixedBackendsFact {
            ts_ns,
            netns,
            legacy: n.legacy.iter().cloned().collect(),
            nft: n.nft.iter().cloned().collect(),
            agent: agent.clone(),
            pid,
            backend,
        };
        // Said once per netns, when it first holds both; the summary has the final picture.
        self.mixed.insert(netns, fact.clone());
        if !n.said {
            n.said = true;
            out(Output::MixedBackends(fact));
        }
        agent
    }

    /// The nf_tables write a read follows when no commit was seen for it: made by the
    /// writer whose exit asked for the read, at its exit (the write came before it). Reads
    /// of a burst of writers are coalesced, so a burst counts once (the hook, where it
    /// attaches, counts each commit).
    fn nft_write_from_read(
        &mut self,
        t: &RuleTable,
        procs: &ProcTable,
        attr: &mut Attributor,
        out: &mut impl FnMut(Output),
    ) -> Option<String> {
        let p = procs.get(t.after_pid);
        let comm = p.map(|p| p.comm).unwrap_or_default();
        let ts = p
            .and_then(|p| p.exited.as_ref())
            .map(|e| e.ts_ns)
            .filter(|&e| e <= t.ts_ns)
            .unwrap_or(t.ts_ns);
        Some(self.write(
            ts,
            t.after_pid,
            t.netns,
            Backend::Nft,
            &comm,
            None,
            procs,
            attr,
            out,
        ))
    }

    /// A table read after a write, whole (see [`Self::whole_table`]): what changed since the
    /// previous read, and whose it was.
    pub fn on_table(
        &mut self,
        t: &RuleTable,
        procs: &ProcTable,
        attr: &mut Attributor,
        out: &mut impl FnMut(Output),
    ) {
        let key: TableKey = (t.netns, t.family.clone(), t.table.clone());
        let (writers, read_before) = self.writers_of(t, &key, procs, attr, out);
        let fact = |diff: TableDiff| RuleChangeFact {
            ts_ns: t.ts_ns,
            netns: t.netns,
            family: t.family.clone(),
            table: t.table.clone(),
            agent: writers.join(", "),
            ambiguous: writers.len() > 1,
            pid: t.after_pid,
            diff,
            foreign: Vec::new(),
            restored: Vec::new(),
            bare_drops: Vec::new(),
            skipped: None,
        };
        if !t.skipped.is_empty() {
            // Unknown from here until a read works again (for nf_tables: every table of
            // the namespace, read together).
            self.tables.remove(&key);
            if t.family == NFT_ALL.0 {
                self.tables
                    .retain(|(n, f, _), _| *n != t.netns || !f.starts_with("nft "));
                self.nft_reads.remove(&t.netns);
            }
            let mut f = fact(TableDiff::default());
            f.skipped = Some(t.skipped.clone());
            out(Output::RuleChange(f));
            return;
        }
        // The model is updated in place: a read costs what changed, not the table's size.
        let d = match self.tables.get_mut(&key) {
            Some(model) => match model.apply(t) {
                Some(d) => d,
                None => return,
            },
            None if read_before => {
                // An nf_tables table new since the namespace's last read: this write made it.
                let mut model = TableModel::default();
                let Some(d) = model.apply(t) else {
                    return;
                };
                self.tables.insert(key.clone(), model);
                d
            }
            None => {
                // The first read: what is there already is the baseline.
                if let Some(model) = TableModel::from_read(t) {
                    if self.tables.len() < MAX_TABLES {
                        self.tables.insert(key, model);
                    }
                }
                return;
            }
        };
        let mut f = fact(d.clone());
        let writer = (!f.ambiguous).then(|| writers[0].clone());
        f.foreign = self.foreign_of(&key, &d, writer.as_deref());
        f.restored = self.restored(&key, t, &d, writer.as_deref());
        if let Some(w) = &writer {
            self.remember(&key, t, &d, w, &f.foreign, procs);
        }
        f.bare_drops = self.bare_drops(&key, &d);
        if !d.is_empty() {
            out(Output::RuleChange(f));
        }
    }

    /// The agents whose writes a read covers (those before it; for nf_tables, per namespace),
    /// and whether the namespace's nf_tables were read before (then a table the model does
    /// not know is new). No write pending: the process the read follows is named.
    fn writers_of(
        &mut self,
        t: &RuleTable,
        key: &TableKey,
        procs: &ProcTable,
        attr: &mut Attributor,
        out: &mut impl FnMut(Output),
    ) -> (Vec<String>, bool) {
        let nft = t.family == NFT_ALL.0 || t.family.starts_with("nft ");
        let mut writers: Vec<String> = Vec::new();
        let mut read_before = false;
        if nft {
            let pkey = (t.netns, NFT_ALL.0.to_string(), NFT_ALL.1.to_string());
            let last = self.nft_reads.get(&t.netns).copied();
            let now = match last {
                None => (t.ts_ns, false),
                Some((cur, before)) if cur == t.ts_ns => (cur, before),
                Some(_) => (t.ts_ns, true),
            };
            read_before = now.1;
            self.nft_reads.insert(t.netns, now);
            if let Some(p) = self.pending.get_mut(&pkey) {
                // A new read: the writes the previous one covered are done with.
                if let Some((last, _)) = last.filter(|&(l, _)| l != t.ts_ns) {
                    p.retain(|(ts, _)| *ts > last);
                }
                for (ts, a) in p.iter() {
                    if *ts <= t.ts_ns && !writers.contains(a) {
                        writers.push(a.clone());
                    }
                }
            }
            if self.nft_reads.len() > MAX_NETNS {
                self.nft_reads.clear();
            }
            // No commit covered this read (the nft_commit hook does not attach on this
            // kernel): the write is the one of the nf_tables writer whose exit asked for the
            // read, counted once per read (see `nft_write_from_read`).
            let new_read = last.is_none_or(|(l, _)| l != t.ts_ns);
            if writers.is_empty() && new_read && t.after_pid != 0 && !self.nft_commits_seen {
                if let Some(agent) = self.nft_write_from_read(t, procs, attr, out) {
                    writers.push(agent);
                }
            }
        } else if let Some(p) = self.pending.get_mut(key) {
            p.retain(|(ts, a)| {
                if *ts <= t.ts_ns {
                    if !writers.contains(a) {
                        writers.push(a.clone());
                    }
                    false
                } else {
                    true
                }
            });
        }
        if writers.is_empty() {
            let comm = procs.get(t.after_pid).map(|p| p.comm).unwrap_or_default();
            let who = attr.get(procs, t.after_pid, &comm);
            writers.push(who.agent.to_string());
        }
        (writers, read_before)
    }

    /// Whose `chain` of table `key` is: its creator seen while watched, else by the agents'
    /// naming conventions.
    fn owner_of(&self, key: &TableKey, chain: &str) -> Option<String> {
        // No chain created while watched (the usual case): no key to build.
        let created = || {
            self.creators
                .get(&(key.clone(), chain.to_string()))
                .cloned()
        };
        (!self.creators.is_empty())
            .then(created)
            .flatten()
            .or_else(|| owners::conventional_owner(chain).map(str::to_string))
    }

    /// A rule is its chain's; in a built-in chain, the owner's of the chain it jumps to.
    fn rule_owner(&self, key: &TableKey, chain: &str, rule: &str) -> Option<String> {
        self.owner_of(key, chain).or_else(|| {
            let target = rule.rsplit_once(' ').map_or(rule, |(_, j)| j);
            self.owner_of(key, target)
        })
    }

    /// Whose chains and rules a change deleted, flushed, removed, changed or added to, but
    /// the writer's own.
    fn foreign_of(
        &self,
        key: &TableKey,
        d: &TableDiff,
        writer: Option<&str>,
    ) -> Vec<ForeignChange> {
        let mut by_owner: BTreeMap<String, ForeignChange> = BTreeMap::new();
        fn entry(m: &mut BTreeMap<String, ForeignChange>, owner: String) -> &mut ForeignChange {
            m.entry(owner.clone()).or_insert_with(|| ForeignChange {
                owner,
                ..Default::default()
            })
        }
        for c in &d.deleted {
            if let Some(o) = self.owner_of(key, c) {
                entry(&mut by_owner, o).chains_deleted.push(c.clone());
            }
        }
        for c in &d.flushed {
            if let Some(o) = self.owner_of(key, c) {
                entry(&mut by_owner, o).chains_flushed.push(c.clone());
            }
        }
        for (c, r) in &d.removed {
            if let Some(o) = self.rule_owner(key, c, r) {
                entry(&mut by_owner, o).rules_removed += 1;
            }
        }
        for s in &d.stripped {
            if let Some(o) = self.rule_owner(key, &s.chain, &s.now) {
                entry(&mut by_owner, o).rules_changed.push(s.clone());
            }
        }
        for (c, r) in &d.added {
            if let Some(o) = self.rule_owner(key, c, r) {
                entry(&mut by_owner, o).rules_added += 1;
            }
        }
        by_owner
            .into_values()
            .filter(|fc| writer != Some(fc.owner.as_str()) && !fc.is_empty())
            .collect()
    }

    /// The owner putting back what another removed: how long it was gone.
    fn restored(
        &mut self,
        key: &TableKey,
        t: &RuleTable,
        d: &TableDiff,
        writer: Option<&str>,
    ) -> Vec<super::facts::Restored> {
        let mut v = Vec::new();
        for c in &d.created {
            let k = (key.clone(), c.clone());
            if let Some(r) = self.removed.get(&k) {
                if writer == Some(r.owner.as_str()) {
                    v.push(super::facts::Restored {
                        chain: c.clone(),
                        gone_ns: t.ts_ns.saturating_sub(r.ts_ns),
                        removed_by: r.by.clone(),
                    });
                    self.removed.remove(&k);
                }
            }
        }
        v
    }

    /// What a change by one writer `w` leaves to remember: the foreign changes it counts, the
    /// chains it removed (until their owner puts them back) and created, and the write behind
    /// each rule it added or changed (for the drops the rule may make).
    fn remember(
        &mut self,
        key: &TableKey,
        t: &RuleTable,
        d: &TableDiff,
        w: &str,
        foreign: &[ForeignChange],
        procs: &ProcTable,
    ) {
        for fc in foreign {
            *self
                .foreign
                .entry((w.to_string(), fc.owner.clone()))
                .or_default() += fc.count();
            for c in fc.chains_deleted.iter().chain(&fc.chains_flushed) {
                if self.removed.len() < MAX_CHAINS_REMEMBERED {
                    self.removed.insert(
                        (key.clone(), c.clone()),
                        Removed {
                            ts_ns: t.ts_ns,
                            by: w.to_string(),
                            owner: fc.owner.clone(),
                        },
                    );
                }
            }
        }
        for c in &d.created {
            if self.creators.len() < MAX_CHAINS_REMEMBERED {
                self.creators
                    .insert((key.clone(), c.clone()), w.to_string());
            }
        }
        let by = self
            .last_write
            .get(&(t.netns, w.to_string()))
            .cloned()
            .unwrap_or_else(|| RuleAdded {
                ts_ns: t.ts_ns,
                agent: w.to_string(),
                program: procs
                    .get(t.after_pid)
                    .map(|p| p.exe_name().to_string())
                    .unwrap_or_default(),
                pid: t.after_pid,
            });
        let rules = d
            .added
            .iter()
            .map(|(c, r)| (c, r))
            .chain(d.stripped.iter().map(|s| (&s.chain, &s.now)));
        for (c, r) in rules {
            if self.added.len() < MAX_ADDED {
                self.added
                    .insert((key.clone(), c.clone(), r.clone()), by.clone());
            }
        }
    }

    /// A DROP or REJECT that matches everything, where packets reach it (the table's reach is
    /// walked only when the change has one): `CHAIN: rule`.
    fn bare_drops(&self, key: &TableKey, d: &TableDiff) -> Vec<String> {
        let bare =
            d.added.iter().any(|(_, r)| is_bare(r)) || d.stripped.iter().any(|s| is_bare(&s.now));
        let Some(model) = self.tables.get(key).filter(|_| bare) else {
            return Vec::new();
        };
        let reachable = model.reachable();
        let mut v = Vec::new();
        for (c, r) in &d.added {
            if reachable.contains(c.as_str()) && is_bare(r) {
                v.push(format!("{c}: {r}"));
            }
        }
        for s in &d.stripped {
            if reachable.contains(s.chain.as_str()) && is_bare(&s.now) {
                v.push(format!("{}: {}", s.chain, s.now));
            }
        }
        v
    }

    /// The REJECT rule that turns away TCP connections to `addr:port`, named by its comment
    /// (kube-proxy's "ns/svc:port has no endpoints") else by its text: in `netns`'s IPv4
    /// filter table as last read, or, for a reset a client received (`netns` `None`: the
    /// rejecting node's namespace is not the client's), in any read filter table where one
    /// rule alone matches.
    pub fn rejecting_rule(
        &self,
        netns: Option<u32>,
        addr: std::net::IpAddr,
        port: u16,
        answer: rejects::Answer,
    ) -> Option<String> {
        let std::net::IpAddr::V4(addr) = addr else {
            return None;
        };
        let filter = |ns: u32| {
            self.tables
                .get(&(ns, "ip".to_string(), "filter".to_string()))
        };
        let models: Vec<&TableModel> = match netns {
            Some(ns) => filter(ns).into_iter().collect(),
            None => self
                .tables
                .iter()
                .filter(|((_, f, t), _)| f == "ip" && t == "filter")
                .map(|(_, m)| m)
                .collect(),
        };
        let mut found: Vec<String> = Vec::new();
        for (chain, r) in models.iter().flat_map(|m| &m.rejects) {
            if rejects::rejects(r, addr, port, answer) {
                let n = rejects::name(chain, r);
                if !found.contains(&n) {
                    found.push(n);
                }
            }
        }
        // Several candidates: not said, rather than guessed.
        (found.len() == 1).then(|| found.remove(0))
    }

    /// Whose a rule of a read table is: (the rule's owner, its chain's owner, the write that
    /// added it). The rule's owner is the agent whose write added it, else the chain's; the
    /// chain's is its creator, else the agents' naming conventions. `rule` empty: the
    /// chain's policy (whoever owns the chain).
    pub fn rule_origin(
        &self,
        netns: u32,
        family: &str,
        table: &str,
        chain: &str,
        rule: &str,
    ) -> (Option<String>, Option<String>, Option<RuleAdded>) {
        let key: TableKey = (netns, family.to_string(), table.to_string());
        let chain_owner = self.owner_of(&key, chain);
        let added = (!rule.is_empty() && !self.added.is_empty())
            .then(|| {
                self.added
                    .get(&(key, chain.to_string(), rule.to_string()))
                    .cloned()
            })
            .flatten();
        let owner = added
            .as_ref()
            .map(|a| a.agent.clone())
            .or_else(|| chain_owner.clone());
        (owner, chain_owner, added)
    }

    /// Foreign changes per (writer, owner): how many chains and rules.
    pub fn foreign(&self) -> impl Iterator<Item = (&str, &str, u64)> {
        self.foreign
            .iter()
            .map(|((w, o), n)| (w.as_str(), o.as_str(), *n))
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

/// A rule that drops or rejects everything that reaches it: its only part besides a
/// comment is a DROP or REJECT target.
fn is_bare(rule: &str) -> bool {
    let mut rest = rule;
    if let Some(after) = rest.strip_prefix("-m comment --comment \"") {
        rest = after.split_once("\" ").map_or("", |(_, r)| r);
    } else if let Some(after) = rest.strip_prefix("-m comment --comment ") {
        // iptables-save leaves a comment of letters, digits, `_` and `-` unquoted.
        rest = after.split_once(' ').map_or("", |(_, r)| r);
    }
    rest == "-j DROP" || rest.starts_with("-j REJECT")
}

/// A legacy table replaced (not a read, not a counter update, and it succeeded).
fn is_legacy_write(t: &TableReplaceEvent) -> bool {
    use xtlock_common::{EBT_SO_SET_ENTRIES, XT_SO_SET_REPLACE};
    !t.read && t.ret == 0 && (t.optname == XT_SO_SET_REPLACE || t.optname == EBT_SO_SET_ENTRIES)
}
