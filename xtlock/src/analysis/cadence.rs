//! Sync cadence: how often each agent completes an `iptables-restore`, and when it stops
//! doing so while it still runs. kube-proxy's healthz stays 200 while its rules drift
//! further behind each sync cycle; what gives it away is the cadence: restores that stop
//! completing, or keep timing out on the lock.
//!
//! A stall is a fact of its own ([`StallFact`]): no completed restore for more than twice the
//! agent's usual period (the median of its last intervals, once it has a few) while its
//! process lives, or [`TIMEOUTS_IN_A_ROW`] restores in a row that gave up on the lock. The
//! next completed restore ends it (a fact with `stalled: false`). Checked as events arrive
//! (at most once a second of event time), so a replay finds the same stalls as the live run.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;

use super::facts::{ExitFact, Output, StallFact};
use super::procs::{FastMap, ProcTable};
use crate::shared::SharedStr;

/// Intervals kept per agent for its usual period.
const KEEP: usize = 8;
/// Intervals needed before a period is usual.
pub const MIN_INTERVALS: usize = 3;
/// Restores in a row that gave up on the lock (exit 4): a stall.
pub const TIMEOUTS_IN_A_ROW: u32 = 3;
/// Agents followed; more are not.
const MAX_AGENTS: usize = 64;
const CHECK_EVERY_NS: u64 = 1_000_000_000;

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
}

impl AgentCadence {
    fn usual_ns(&self) -> Option<u64> {
        if self.intervals.len() < MIN_INTERVALS {
            return None;
        }
        let mut v: Vec<u64> = self.intervals.iter().copied().collect();
        v.sort_unstable();
        Some(v[v.len() / 2])
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
    /// An iptables-family process ended; restores count.
    pub fn on_exit(&mut self, f: &ExitFact, agent_pid: u32, out: &mut impl FnMut(Output)) {
        // `iptables-restor`, `ip6tables-resto`, `iptables-nft-re`, `ip6tables-nft-r` (comm
        // is cut at 15 bytes).
        let restore = f.comm.contains("-resto") || f.comm.contains("-nft-r");
        if !restore || f.agent.is_empty() {
            return;
        }
        if !self.agents.contains_key(&f.agent) && self.agents.len() >= MAX_AGENTS {
            return;
        }
        let a = self.agents.entry(f.agent.clone()).or_default();
        a.agent_pid = agent_pid;
        match f.code {
            Some(0) => {
                if let Some(last) = a.last_ok_ns {
                    if a.intervals.len() == KEEP {
                        a.intervals.pop_front();
                    }
                    a.intervals.push_back(f.ts_ns.saturating_sub(last));
                }
                if a.stalled {
                    a.stalled = false;
                    out(Output::Stall(StallFact {
                        ts_ns: f.ts_ns,
                        agent: f.agent.clone(),
                        agent_pid,
                        stalled: false,
                        reason: "synced",
                        since_last_sync_ns: a.last_ok_ns.map(|l| f.ts_ns.saturating_sub(l)),
                        usual_period_ns: a.usual_ns(),
                        timeouts_in_row: a.timeouts_in_row,
                    }));
                }
                a.syncs += 1;
                a.last_ok_ns = Some(f.ts_ns);
                a.timeouts_in_row = 0;
            }
            Some(4) => {
                a.timeouts_in_row += 1;
                if a.timeouts_in_row >= TIMEOUTS_IN_A_ROW && !a.stalled {
                    a.stalled = true;
                    out(Output::Stall(StallFact {
                        ts_ns: f.ts_ns,
                        agent: f.agent.clone(),
                        agent_pid,
                        stalled: true,
                        reason: "restores_time_out",
                        since_last_sync_ns: a.last_ok_ns.map(|l| f.ts_ns.saturating_sub(l)),
                        usual_period_ns: a.usual_ns(),
                        timeouts_in_row: a.timeouts_in_row,
                    }));
                }
            }
            _ => {}
        }
    }

    /// Time passes (an event at `now`): agents alive whose restores stopped completing.
    pub fn check(&mut self, now: u64, procs: &ProcTable, out: &mut impl FnMut(Output)) {
        if now < self.next_check_ns {
            return;
        }
        self.next_check_ns = now + CHECK_EVERY_NS;
        for (agent, a) in self.agents.iter_mut() {
            let (Some(last), Some(usual)) = (a.last_ok_ns, a.usual_ns()) else {
                continue;
            };
            let since = now.saturating_sub(last);
            let alive = procs.get(a.agent_pid).is_some_and(|p| p.is_alive());
            if a.stalled || !alive || since <= usual.saturating_mul(2) {
                continue;
            }
            a.stalled = true;
            out(Output::Stall(StallFact {
                ts_ns: now,
                agent: agent.clone(),
                agent_pid: a.agent_pid,
                stalled: true,
                reason: "no_sync",
                since_last_sync_ns: Some(since),
                usual_period_ns: Some(usual),
                timeouts_in_row: a.timeouts_in_row,
            }));
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
