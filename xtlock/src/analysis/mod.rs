//! The analysis facade: decoded events in, [`Output`] facts out, plus the running
//! [`Summary`]. Pure (no I/O, no clock): live tracing and replay of a capture go through
//! the very same code.
//!
//! Hot path: lock events arrive at more than a million per second under load, so an event
//! that produces no fact allocates nothing; strings are built only for emitted facts.

pub mod attribution;
pub mod cadence;
pub mod drops;
pub mod facts;
pub mod iptables_run;
pub mod ipvs;
pub mod nf_tables_lock;
pub mod procs;
pub mod refusals;
pub mod rule_drops;
pub mod rules;
pub mod services;
pub mod stats;
pub mod unserialized;
pub mod xtables_lock;

use attribution::{is_xtables_comm, is_xtables_tool, Attributor};
use cadence::Cadence;
pub use drops::DropSummary;
use drops::DropTracker;
pub use facts::{
    ConntrackFact, ConntrackRefusedFact, DestChange, DropClass, DropCountFact, DropFact,
    EndpointProgrammedFact, ExecFact, ExitFact, FailedTryFact, ForeignChange, HoldDropsFact,
    HoldFact, HoldRef, HoldRefusalsFact, HolderRef, HungRestore, IpvsCountFact, IpvsFact, LostFact,
    MixedBackendsFact, Output, PacketInfo, RefusalCountFact, RefusalFact, RefusalGroup,
    RefusalKind, Restored, RuleChangeFact, RuleWriteFact, StaleEndpointFact, StaleEndpointOpenFact,
    StallFact, TableTouch, TimeoutFact, WaitFact, WaitMode, WaitOutcome, Waiting, Who,
};
use iptables_run::IptablesRun;
use ipvs::IpvsTracker;
use procs::{basename, ProcTable};
pub use refusals::RefusalSummary;
use refusals::RefusalTracker;
use stats::Stats;
pub use stats::Summary;
pub use xtables_lock::WatchedLock;
use xtables_lock::{is_locking_proc, Ctx, LockMachine};

use crate::decode::{Event, ExecEvent, ExitEvent};

/// `out`, with every fact counted in the statistics on its way.
fn counted<'a>(stats: &'a mut Stats, out: &'a mut impl FnMut(Output)) -> impl FnMut(Output) + 'a {
    move |o: Output| {
        stats.record(&o);
        out(o);
    }
}

/// Process table, attribution, lock state machine and statistics behind one call.
#[derive(Debug)]
pub struct Analyzer {
    procs: ProcTable,
    attr: Attributor,
    /// The xtables file lock (flock).
    locks: LockMachine,
    /// The nf_tables commit locks and mutexes.
    nf_tables: nf_tables_lock::NfTablesLock,
    stats: Stats,
    cadence: Cadence,
    rules: rules::RuleTracker,
    drops: DropTracker,
    refusals: RefusalTracker,
    /// The rules behind netfilter's drops.
    rule_drops: rule_drops::RuleDropTracker,
    ipvs: IpvsTracker,
    /// Writers of one namespace's legacy tables under different locks.
    unserialized: unserialized::Unserialized,
    /// Boxed and taken out while an event is processed, so it can watch the facts the other
    /// subsystems emit (moving a pointer per event, never the tracker).
    services: Option<Box<services::ServiceTracker>>,
}

impl Analyzer {
    pub fn new(locks: Vec<WatchedLock>) -> Self {
        Analyzer {
            procs: ProcTable::new(),
            attr: Attributor::new(),
            locks: LockMachine::new(locks),
            nf_tables: Default::default(),
            stats: Stats::new(),
            cadence: Cadence::default(),
            rules: rules::RuleTracker::default(),
            drops: DropTracker::new(crate::analysis::drops::DEFAULT_CONNTRACK_WARN_PCT),
            refusals: RefusalTracker::default(),
            rule_drops: rule_drops::RuleDropTracker::default(),
            ipvs: IpvsTracker::new(),
            unserialized: unserialized::Unserialized::default(),
            services: Some(Box::default()),
        }
    }

    /// Conntrack table fill (percent) above which a warning is emitted; 0: never.
    pub fn set_conntrack_warn_pct(&mut self, pct: u32) {
        self.drops.set_warn_pct(pct);
    }

    /// Holds of watched locks overlapping `(t0, t1]`: open ones, and ones that ended in it.
    fn holds_overlapping(&self, t0: u64, t1: u64) -> Vec<HoldRef> {
        let mut v: Vec<HoldRef> = self
            .locks
            .open_holders()
            .filter(|(_, start, _)| *start < t1)
            .map(|(lock, start, who)| HoldRef {
                lock: lock.clone(),
                pid: who.pid,
                agent: who.agent.clone(),
                comm: who.comm.clone(),
                start_ns: start,
                hold_ns: None,
            })
            .collect();
        for h in self.drops.ended_since(t0) {
            if h.start_ns < t1
                && !v
                    .iter()
                    .any(|o| o.start_ns == h.start_ns && o.lock == h.lock)
            {
                v.push(h.clone());
            }
        }
        v
    }

    /// The hold open at `ts`, if any (the first one, when several locks are held).
    fn hold_at(&self, ts: u64) -> Option<HoldRef> {
        let mut v = self.holds_overlapping(ts.saturating_sub(1), ts.saturating_add(1));
        v.retain(|h| h.start_ns <= ts && h.hold_ns.is_none_or(|d| h.start_ns + d >= ts));
        v.into_iter().next()
    }

    /// Feeds one event; facts it settles go to `out`, in order.
    pub fn process(&mut self, ev: &Event, out: &mut impl FnMut(Output)) {
        let Some(mut services) = self.services.take() else {
            // Only while a call unwound; nothing to watch with.
            self.process_event(ev, out);
            return;
        };
        self.process_event(ev, &mut |o: Output| {
            services.observe(&o);
            out(o);
        });
        let mut out = counted(&mut self.stats, out);
        match ev {
            Event::Addr(a) => services.on_addr(a, &mut out),
            Event::CtEntries(c) => services.on_ct(c),
            Event::IpvsTable(t) => services.on_ipvs(t, &mut out),
            // Assembled once, then diffed and modelled.
            Event::RuleTable(t) => {
                if let Some(whole) = self.rules.whole_table(t) {
                    // The writes a read counts (nf_tables without the commit hook) explain
                    // the fixes the same read makes.
                    let unserialized = &mut self.unserialized;
                    self.rules
                        .on_table(&whole, &self.procs, &mut self.attr, &mut |o: Output| {
                            // A lost write's read: what the replace removed.
                            let lost = match &o {
                                Output::RuleChange(c) => unserialized.on_rule_change(c),
                                _ => None,
                            };
                            services.observe(&o);
                            out(o);
                            if let Some(f) = lost {
                                out(Output::Unserialized(f));
                            }
                        });
                    services.on_table(&whole, &mut out);
                }
            }
            _ => {}
        }
        services.tick(ev.ts_ns(), &mut out);
        self.services = Some(services);
    }

    fn process_event(&mut self, ev: &Event, out: &mut impl FnMut(Output)) {
        self.stats.observe(ev.ts_ns());
        self.cadence
            .check(ev.ts_ns(), &self.procs, &mut counted(&mut self.stats, out));
        if self.side_event(ev, out) {
            return;
        }
        self.lock_event(ev, out);
    }

    /// The events of the side subsystems (drops, refusals, rule counters, IPVS, drop reason
    /// names, kernel symbols, pods): theirs alone, the lock machine never sees them. `false`
    /// for any other event.
    fn side_event(&mut self, ev: &Event, out: &mut impl FnMut(Output)) -> bool {
        match ev {
            Event::Drop(s) => {
                let hold = self.hold_at(s.ts_ns);
                self.rule_drops.on_sample(s, hold.clone());
                self.drops
                    .on_sample(s, hold, &mut counted(&mut self.stats, out));
            }
            Event::RuleCounters(c) => {
                self.rule_drops
                    .on_counters(c, &self.rules, &mut counted(&mut self.stats, out));
            }
            Event::Refusal(s) => {
                let open = self.holds_overlapping(s.ts_ns, s.ts_ns);
                self.refusals
                    .on_sample(s, &open, &mut counted(&mut self.stats, out));
            }
            Event::ConntrackFail(c) => {
                let hold = self.hold_at(c.ts_ns);
                self.drops
                    .on_conntrack_fail(c, hold, &mut counted(&mut self.stats, out));
            }
            Event::DropCounts(c) => {
                let holds = self.holds_overlapping(c.ts_ns.saturating_sub(c.interval_ns), c.ts_ns);
                self.drops
                    .on_counts(c, holds, &mut counted(&mut self.stats, out));
            }
            Event::Conntrack(c) => {
                let holds = self.holds_overlapping(c.ts_ns.saturating_sub(c.interval_ns), c.ts_ns);
                self.drops
                    .on_conntrack(c, holds, &mut counted(&mut self.stats, out));
            }
            Event::Ipvs(e) => {
                let mut out = counted(&mut self.stats, out);
                self.ipvs.on_event(e, &mut |f| out(Output::Ipvs(f)));
            }
            Event::IpvsCounts(c) => {
                let mut out = counted(&mut self.stats, out);
                self.ipvs.on_counts(c, &mut |f| out(Output::IpvsCount(f)));
            }
            Event::RefusalCounts(c) => {
                // Every count names its hold by the kernel's tag, so any hold open now may be
                // one: a capture whose read was timed before the counters were read (older
                // builds) has counts of a hold that started after that time.
                let holds = self.holds_overlapping(c.ts_ns.saturating_sub(c.interval_ns), u64::MAX);
                let rules = &self.rules;
                self.refusals.on_counts(
                    c,
                    &holds,
                    &|rc| refusals::rule_for(rules, rc),
                    &mut counted(&mut self.stats, out),
                );
            }
            Event::DropSetup {
                has_reason,
                host_netns,
                names,
                ..
            } => {
                self.drops.on_setup(*has_reason, names, *host_netns);
                self.rule_drops.on_setup(*has_reason, names);
            }
            Event::KernelSymbol {
                addr, name, offset, ..
            } => {
                self.drops.on_symbol(*addr, name, *offset);
                self.rule_drops.on_symbol(*addr, name);
            }
            Event::Pod(_) => {
                // Names for processes already attributed, perhaps: attribute them again.
                self.procs.apply(ev);
                self.attr.clear();
            }
            _ => return false,
        }
        true
    }

    /// The events of the locks, processes and rules: the lock machines, execs and exits,
    /// rule reads and unserialized writers.
    fn lock_event(&mut self, ev: &Event, out: &mut impl FnMut(Output)) {
        let lost_before = self.stats.lost_events();
        let stats = &mut self.stats;
        let drops = &mut self.drops;
        let refusals = &mut self.refusals;
        let mut emit = |o: Output| {
            if let Output::Hold(h) = &o {
                drops.on_hold(h);
                refusals.on_hold(h);
            }
            stats.record(&o);
            out(o);
        };
        match ev {
            Event::Exit(e) => {
                // Waits and timeouts first, while the process still looks alive. Whether it
                // is an iptables matters only to an exit with status 4 (giving up).
                let is_tool =
                    e.exit_code == Some(4) && is_locking_proc(&self.procs, e.tgid, &e.comm);
                let mut cx = Ctx {
                    procs: &self.procs,
                    attr: &mut self.attr,
                };
                let timeout = self.locks.on_exit(e, is_tool, &mut cx, &mut emit);
                if e.tid == e.tgid {
                    if let Some((f, agent_pid)) = exit_fact(&self.procs, &mut self.attr, e, timeout)
                    {
                        self.cadence.on_exit(&f, agent_pid, &mut emit);
                        emit(Output::Exit(f));
                    }
                    self.attr.forget(e.tgid);
                }
                self.procs.apply(ev);
            }
            Event::Exec(e) => {
                self.procs.apply(ev);
                if let Some(f) = exec_fact(&self.procs, &mut self.attr, e) {
                    self.cadence.on_exec(&f);
                    emit(Output::Exec(f));
                }
            }
            Event::Lost { ts_ns, count } => {
                tracing::debug!(count, "kernel lost events: ring buffer full");
                let total = lost_before.saturating_add(*count);
                emit(Output::Lost(LostFact {
                    ts_ns: *ts_ns,
                    count: *count,
                    total,
                    bound: None,
                }));
                let mut cx = Ctx {
                    procs: &self.procs,
                    attr: &mut self.attr,
                };
                self.locks.handle(ev, &mut cx, &mut emit);
            }
            _ => {
                self.procs.apply(ev);
                let mut cx = Ctx {
                    procs: &self.procs,
                    attr: &mut self.attr,
                };
                match ev {
                    Event::NftCommit(_) | Event::NftMutexWait(_) | Event::NftSend(_) => {
                        // What the flock machine has due by this time is settled first, as
                        // for any event.
                        self.locks.tick(ev.ts_ns(), &mut cx, &mut emit);
                        self.nf_tables.handle(ev, &mut cx, &mut emit);
                    }
                    _ => self.locks.handle(ev, &mut cx, &mut emit),
                }
                self.rules
                    .on_event(ev, &self.procs, &mut self.attr, &mut emit);
                if let Some(t) = match ev {
                    Event::TableReplace(t) if unserialized::concerns(t) => Some(t),
                    _ => None,
                } {
                    // After the lock machine: the replace's own hold is known by then.
                    let comm = self.procs.get(t.tgid).map(|p| p.comm).unwrap_or_default();
                    let who = self.attr.get(&self.procs, t.tgid, &comm);
                    let writer = unserialized::Writer {
                        agent: who.agent_or_comm().clone(),
                        pid: t.tgid,
                        lock: self.locks.lock_held_by(t.tgid, t.ts_ns),
                    };
                    self.unserialized.on_table(t, writer, &mut emit);
                }
            }
        }
    }

    /// Convenience for tests and small tools: the facts of one event.
    pub fn process_collect(&mut self, ev: &Event) -> Vec<Output> {
        let mut v = Vec::new();
        self.process(ev, &mut |o| v.push(o));
        v
    }

    /// End of tracing at `ts_ns`: reports what is still open (holds still held, waits
    /// still waiting) instead of dropping it.
    pub fn finish(&mut self, ts_ns: u64, out: &mut impl FnMut(Output)) {
        self.stats.extend_to(ts_ns);
        let stats = &mut self.stats;
        let drops = &mut self.drops;
        let refusals = &mut self.refusals;
        let mut emit = |o: Output| {
            if let Output::Hold(h) = &o {
                drops.on_hold(h);
                refusals.on_hold(h);
            }
            stats.record(&o);
            out(o);
        };
        let mut cx = Ctx {
            procs: &self.procs,
            attr: &mut self.attr,
        };
        self.locks.finish(ts_ns, &mut cx, &mut emit);
        self.drops.finish(ts_ns, &mut counted(&mut self.stats, out));
        let rules = &self.rules;
        self.refusals.finish(
            ts_ns,
            &|rc| refusals::rule_for(rules, rc),
            &mut counted(&mut self.stats, out),
        );
        let mut out = counted(&mut self.stats, out);
        self.ipvs.finish(&mut |f| out(Output::Ipvs(f)));
        if let Some(s) = self.services.as_mut() {
            s.finish(ts_ns, &mut out);
        }
    }

    pub fn summary(&self) -> Summary {
        let mut s = self.stats.summary(self.locks.locks());
        s.drops = self.drops.summary();
        s.refusals = self.refusals.summary();
        s.rule_drops = self.rule_drops.summary();
        s.host_netns = self.drops.host_netns();
        s.syncs = self.cadence.summary();
        s.rule_writes = self
            .rules
            .by_agent()
            .map(|(agent, backend, w)| stats::RuleWriteRow {
                agent: agent.to_owned(),
                backend,
                writes: w.clone(),
            })
            .collect();
        s.mixed_backends = self.rules.mixed().cloned().collect();
        s.unserialized = self.unserialized.counts;
        s.services = self
            .services
            .as_ref()
            .map(|t| t.summary())
            .unwrap_or_default();
        s.foreign_changes = self
            .rules
            .foreign()
            .map(|(w, o, n)| (w.to_owned(), o.to_owned(), n))
            .collect();
        s.over_bounds = self
            .locks
            .over_bounds()
            .map(|(b, n)| (b.to_owned(), n))
            .collect();
        s.ipvs = self
            .ipvs
            .summary()
            .into_iter()
            .map(
                |(protocol, service, backend, counts)| crate::analysis::stats::IpvsBackendRow {
                    protocol,
                    service,
                    backend,
                    counts,
                },
            )
            .collect();
        s
    }

    /// Watched locks, configured ones first, then any first seen in events.
    pub fn locks(&self) -> Vec<WatchedLock> {
        self.locks.locks().cloned().collect()
    }

    /// Open holds right now, as (lock path, start, holder).
    pub fn open_holders(
        &self,
    ) -> impl Iterator<Item = (&str, u64, &crate::analysis::attribution::Attribution)> {
        self.locks
            .open_holders()
            .map(|(lock, start, who)| (lock.as_str(), start, who))
    }

    pub fn procs(&self) -> &ProcTable {
        &self.procs
    }

    /// Time of the earliest event seen.
    pub fn first_ts_ns(&self) -> Option<u64> {
        self.stats.first_ts_ns()
    }
}

fn exec_fact(procs: &ProcTable, attr: &mut Attributor, e: &ExecEvent) -> Option<ExecFact> {
    // The table has just taken this exec: its entry knows where the file's name starts.
    let p = procs.get(e.tgid);
    let exe = p.map_or_else(|| basename(&e.filename), |p| p.exe_name());
    if !is_xtables_comm(&e.comm) && !is_xtables_tool(exe) {
        return None;
    }
    let who = attr.get(procs, e.tgid, &e.comm);
    Some(ExecFact {
        ts_ns: e.ts_ns,
        pid: e.tgid,
        ppid: p.map_or(0, |p| p.ppid),
        comm: who.comm.clone(),
        run: IptablesRun::classify(e.argv.iter(), &e.filename),
        filename: e.filename.clone(),
        argv: e.argv.clone(),
        argv_truncated: e.argv_truncated,
        cmdline: who.cmdline.clone(),
        agent: who.agent.clone(),
        role: who.role,
        agent_pid: who.agent_pid,
        chain: who.chain.clone(),
        pod_uid: who.pod_uid.clone(),
        container_id: who.container_id.clone(),
        pod: who.pod.clone(),
    })
}

fn exit_fact(
    procs: &ProcTable,
    attr: &mut Attributor,
    e: &ExitEvent,
    lock_timeout: bool,
) -> Option<(ExitFact, u32)> {
    let p = procs.get(e.tgid).filter(|p| p.is_alive());
    let tool = is_xtables_comm(&e.comm)
        || p.is_some_and(|p| is_xtables_comm(&p.comm) || is_xtables_tool(p.exe_name()));
    if !tool {
        return None;
    }
    let who = attr.get(procs, e.tgid, &e.comm);
    let f = ExitFact {
        ts_ns: e.ts_ns,
        pid: e.tgid,
        comm: who.comm.clone(),
        // From the exec'd program, not the comm the kernel cut (see iptables_run.rs).
        run: p.and_then(|p| IptablesRun::classify(p.argv.iter(), &p.filename)),
        code: e.exit_code,
        agent: who.agent.clone(),
        role: who.role,
        runtime_ns: p.and_then(|p| p.exec_ns).map(|x| e.ts_ns.saturating_sub(x)),
        lock_timeout,
    };
    Some((f, who.agent_pid))
}

#[cfg(test)]
mod tests;
