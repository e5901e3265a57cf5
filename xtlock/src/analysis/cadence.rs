//! Sync cadence: how often each agent completes an `iptables-restore`, and when it stops
//! doing so while it still runs. kube-proxy's healthz stays 200 while its rules drift
//! further behind each sync cycle; what gives it away is the cadence: restores that stop
//! completing, or keep timing out on the lock.
//!
//! A stall is a fact of its own ([`StallFact`]): no completed restore for more than twice the
//! agent's usual period (the median of its last intervals, once it has a few; restores less
//! than [`MIN_PERIOD_NS`] apart are one burst, so a reload or a one-off writer has none) while its
//! process lives, or [`TIMEOUTS_IN_A_ROW`] restores in a row that gave up on the lock. The
//! next completed restore ends it (a fact with `stalled: false`). A third shape is a restore
//! that hangs: one still running after far longer than the agent's usual restore
//! ([`HUNG_RUNTIME_FACTOR`] times it) or than twice its usual period is a stall
//! (`restore_hung`) while it runs, ended when it exits. Checked as events arrive (at most once
//! a second of event time), so a replay finds the same stalls as the live run.
//!
//! A restore is known by the program exec'd ([`super::iptables_run`]), whatever its name.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;

use super::facts::{ExecFact, ExitFact, HungRestore, Output, StallFact};
use super::procs::{FastMap, ProcTable};
use crate::shared::SharedStr;

/// Intervals kept per agent for its usual period.
const KEEP: usize = 8;
/// Intervals needed before a period is usual.
pub const MIN_INTERVALS: usize = 3;
/// Restores completed closer together than this are one burst, not a cadence (firewalld's
/// `--reload` runs several a few ms apart; kube-proxy's `minSyncPeriod` is 1 s): a burst adds
/// no interval, so a period is measured only between syncs at least this far apart.
pub const MIN_PERIOD_NS: u64 = 1_000_000_000;
/// Restores in a row that gave up on the lock (exit 4): a stall.
pub const TIMEOUTS_IN_A_ROW: u32 = 3;
/// Agents followed; more are not.
const MAX_AGENTS: usize = 64;
const CHECK_EVERY_NS: u64 = 1_000_000_000;
/// A restore running this many times the agent's usual restore (median) hangs.
pub const HUNG_RUNTIME_FACTOR: u64 = 20;
/// ...but never before this: a restore queued behind a hold of a second or two is not hung.
pub const HUNG_MIN_NS: u64 = 5_000_000_000;
/// Restores followed while they run, per agent.
const MAX_RUNNING: usize = 16;

#[derive(Debug, Default)]
pub struct Cadence {
    agents: FastMap<SharedStr, AgentCadence>,
    next_check_ns: u64,
}

#[derive(Debug, Default)]
struct AgentCadence {
    agent_pid: u32,
    syncs: u64,
    last_ok_ns: Option<u64>,
    intervals: VecDeque<u64>,
    timeouts_in_row: u32,
    stalled: bool,
    /// Run times of its last completed restores.
    runtimes: VecDeque<u64>,
    /// Its restores running now: (pid, exec time).
    running: Vec<(u32, u64)>,
    /// The restore whose hanging stalled the agent.
    hung_pid: Option<u32>,
}

fn median(v: &VecDeque<u64>) -> Option<u64> {
    if v.len() < MIN_INTERVALS {
        return None;
    }
    let mut v: Vec<u64> = v.iter().copied().collect();
    v.sort_unstable();
    Some(v[v.len() / 2])
}

impl AgentCadence {
    /// How long a restore may run before it hangs, once the agent's habits are known.
    fn hung_after_ns(&self) -> Option<u64> {
        let by_runtime = median(&self.runtimes).map(|r| r.saturating_mul(HUNG_RUNTIME_FACTOR));
        let by_period = self.usual_ns().map(|p| p.saturating_mul(2));
        let limit = match (by_runtime, by_period) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(limit.max(HUNG_MIN_NS))
    }

    fn usual_ns(&self) -> Option<u64> {
        median(&self.intervals)
    }

    fn stall(
        &self,
        ts_ns: u64,
        agent: &SharedStr,
        stalled: bool,
        reason: &'static str,
    ) -> StallFact {
        StallFact {
            ts_ns,
            agent: agent.clone(),
            agent_pid: self.agent_pid,
            stalled,
            reason,
            since_last_sync_ns: self.last_ok_ns.map(|l| ts_ns.saturating_sub(l)),
            usual_period_ns: self.usual_ns(),
            timeouts_in_row: self.timeouts_in_row,
            restore: None,
        }
    }
}

/// One agent's cadence, in the summary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SyncSummary {
    /// Completed restores seen.
    pub syncs: u64,
    /// The usual period between them (median of the last few), once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usual_period_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_sync_ns: Option<u64>,
    pub stalled: bool,
}

impl Cadence {
    /// An iptables-family process started: a restore is followed until it exits.
    pub fn on_exec(&mut self, f: &ExecFact) {
        if !f.run.is_some_and(|r| r.is_restore()) || f.agent.is_empty() {
            return;
        }
        if !self.agents.contains_key(&f.agent) && self.agents.len() >= MAX_AGENTS {
            return;
        }
        let a = self.agents.entry(f.agent.clone()).or_default();
        a.agent_pid = f.agent_pid;
        a.running.retain(|r| r.0 != f.pid);
        if a.running.len() >= MAX_RUNNING {
            a.running.remove(0);
        }
        a.running.push((f.pid, f.ts_ns));
    }

    /// An iptables-family process ended; restores count.
    pub fn on_exit(&mut self, f: &ExitFact, agent_pid: u32, out: &mut impl FnMut(Output)) {
        let restore = f.run.is_some_and(|r| r.is_restore());
        if !restore || f.agent.is_empty() {
            return;
        }
        if !self.agents.contains_key(&f.agent) && self.agents.len() >= MAX_AGENTS {
            return;
        }
        let a = self.agents.entry(f.agent.clone()).or_default();
        a.agent_pid = agent_pid;
        a.running.retain(|r| r.0 != f.pid);
        let was_hung = a.hung_pid == Some(f.pid);
        if was_hung {
            a.hung_pid = None;
        }
        match f.code {
            Some(0) => {
                if let Some(ns) = f.runtime_ns {
                    if a.runtimes.len() == KEEP {
                        a.runtimes.pop_front();
                    }
                    a.runtimes.push_back(ns);
                }
                if let Some(last) = a.last_ok_ns {
                    let gap = f.ts_ns.saturating_sub(last);
                    if gap >= MIN_PERIOD_NS {
                        if a.intervals.len() == KEEP {
                            a.intervals.pop_front();
                        }
                        a.intervals.push_back(gap);
                    }
                }
                if a.stalled {
                    a.stalled = false;
                    out(Output::Stall(a.stall(f.ts_ns, &f.agent, false, "synced")));
                }
                a.syncs += 1;
                a.last_ok_ns = Some(f.ts_ns);
                a.timeouts_in_row = 0;
            }
            Some(4) => {
                a.timeouts_in_row += 1;
                if a.timeouts_in_row >= TIMEOUTS_IN_A_ROW && !a.stalled {
                    a.stalled = true;
                    out(Output::Stall(a.stall(
                        f.ts_ns,
                        &f.agent,
                        true,
                        "restores_time_out",
                    )));
                }
            }
            _ => {}
        }
        if was_hung && a.stalled && f.code != Some(0) {
            // It ended without syncing: the hang is over, the rules are not written.
            a.stalled = false;
            let mut st = a.stall(f.ts_ns, &f.agent, false, "restore_ended");
            st.restore = Some(HungRestore {
                pid: f.pid,
                running_ns: f.runtime_ns.unwrap_or(0),
                usual_ns: median(&a.runtimes),
                exit_code: f.code,
            });
            out(Output::Stall(st));
        }
    }

    /// Time passes (an event at `now`): agents alive whose restores stopped completing.
    pub fn check(&mut self, now: u64, procs: &ProcTable, out: &mut impl FnMut(Output)) {
        if now < self.next_check_ns {
            return;
        }
        self.next_check_ns = now + CHECK_EVERY_NS;
        for (agent, a) in self.agents.iter_mut() {
            if !a.stalled {
                if let (Some(limit), Some(&(pid, start))) =
                    (a.hung_after_ns(), a.running.iter().min_by_key(|r| r.1))
                {
                    let running = now.saturating_sub(start);
                    let alive = procs.get(pid).is_some_and(|p| p.is_alive());
                    if running > limit && alive {
                        a.stalled = true;
                        a.hung_pid = Some(pid);
                        let mut st = a.stall(now, agent, true, "restore_hung");
                        st.restore = Some(HungRestore {
                            pid,
                            running_ns: running,
                            usual_ns: median(&a.runtimes),
                            exit_code: None,
                        });
                        out(Output::Stall(st));
                        continue;
                    }
                }
            }
            let (Some(last), Some(usual)) = (a.last_ok_ns, a.usual_ns()) else {
                continue;
            };
            let since = now.saturating_sub(last);
            let alive = procs.get(a.agent_pid).is_some_and(|p| p.is_alive());
            if a.stalled || !alive || since <= usual.saturating_mul(2) {
                continue;
            }
            a.stalled = true;
            out(Output::Stall(a.stall(now, agent, true, "no_sync")));
        }
    }

    pub fn summary(&self) -> BTreeMap<String, SyncSummary> {
        self.agents
            .iter()
            .map(|(agent, a)| {
                (
                    agent.to_string(),
                    SyncSummary {
                        syncs: a.syncs,
                        usual_period_ns: a.usual_ns(),
                        last_sync_ns: a.last_ok_ns,
                        stalled: a.stalled,
                    },
                )
            })
            .collect()
    }
}
