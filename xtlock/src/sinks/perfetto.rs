//! A timeline in the Chrome JSON trace format, which ui.perfetto.dev and chrome://tracing
//! open: one track per process grouped under its agent, each hold a slice, each wait an
//! async slice with a flow arrow from the holder it waited on, execs, failed tries and drop
//! samples as instants, and counter tracks of waiters, drops and conntrack.
//!
//! Track layout: the trace's `pid` is the agent (one group per agent), `tid` the process.
//! Waits are also drawn as slices on a second track of the waiting process (`tid` with the
//! top bit set), so they never overlap its holds and flow arrows have a slice to bind to.

use std::{
    collections::BTreeMap,
    io::{self, Write},
};

use serde_json::{json, Value};

use super::Sink;
use crate::analysis::{HoldFact, Output, Summary, WaitFact};

/// `tid` bit for a process's wait track.
const WAIT_TRACK: u64 = 1 << 31;
/// `pid` of the pseudo process that carries counters.
const COUNTERS_PID: u64 = 0;

/// Collects facts; writes the whole timeline at the final summary.
pub struct PerfettoSink<W: Write> {
    out: Option<W>,
    holds: Vec<HoldFact>,
    waits: Vec<WaitFact>,
    instants: Vec<(u64, u32, String, String, Value)>,
    /// (time, counter track name, value)
    counters: Vec<(u64, String, f64)>,
}

/// The group that carries drop samples (not an agent).
/// Track group of the IPVS instants.
const IPVS_GROUP: &str = "ipvs";
const DROPS_GROUP: &str = "(packet drops)";

impl<W: Write> PerfettoSink<W> {
    pub fn new(out: W) -> Self {
        Self {
            out: Some(out),
            holds: Vec::new(),
            waits: Vec::new(),
            instants: Vec::new(),
            counters: Vec::new(),
        }
    }
}

fn label<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "?".into(),
    }
}

impl<W: Write> Sink for PerfettoSink<W> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        match o {
            Output::Hold(h) => self.holds.push(h.clone()),
            Output::Wait(w) => self.waits.push(w.clone()),
            Output::Exec(e) => self.instants.push((
                e.ts_ns,
                e.pid,
                e.agent.to_string(),
                format!("exec {}", e.cmdline),
                json!({ "filename": e.filename, "caller": e.agent, "ppid": e.ppid }),
            )),
            Output::FailedTry(f) => self.instants.push((
                f.ts_ns,
                f.pid,
                f.agent.to_string(),
                format!("failed try on {}", f.lock),
                json!({ "errno": f.errno, "holder": f.holder.as_ref().map(|h| &h.agent) }),
            )),
            Output::Timeout(t) => self.instants.push((
                t.ts_ns,
                t.pid,
                t.agent.to_string(),
                format!("lock timeout on {} (exit {})", t.lock, t.exit_code),
                json!({ "waited_ns": t.waited_ns, "cmdline": t.cmdline }),
            )),
            Output::Drop(d) => self.instants.push((
                d.ts_ns,
                0,
                DROPS_GROUP.to_owned(),
                format!("drop {} ({})", label(&d.class), d.reason),
                serde_json::to_value(d).unwrap_or(Value::Null),
            )),
            Output::ConntrackRefused(c) => self.instants.push((
                c.ts_ns,
                0,
                DROPS_GROUP.to_owned(),
                format!("{} ({})", c.class.describe(), c.function),
                serde_json::to_value(c).unwrap_or(Value::Null),
            )),
            Output::DropCount(c) => self.counters.push((
                c.ts_ns,
                format!("drops: {} (netns {})", label(&c.class), c.netns),
                c.count as f64,
            )),
            Output::Conntrack(c) => self.counters.push((
                c.ts_ns,
                format!("conntrack entries (netns {})", c.netns),
                c.entries as f64,
            )),
            Output::HoldDrops(h) => self.instants.push((
                h.start_ns + h.hold_ns,
                h.pid,
                h.agent.to_string(),
                format!(
                    "{} packets dropped during this hold of {}",
                    h.dropped, h.lock
                ),
                json!({ "by_class": h.by_class, "by_reason": h.by_reason }),
            )),
            Output::Ipvs(i) => self.instants.push((
                i.ts_ns,
                i.pid.unwrap_or(0),
                IPVS_GROUP.to_owned(),
                super::terminal::ipvs_text(i),
                serde_json::to_value(i).unwrap_or(Value::Null),
            )),
            Output::IpvsCount(c) => self.counters.push((
                c.ts_ns,
                format!(
                    "ipvs {} {} -> {} ({})",
                    c.protocol, c.service, c.backend, c.backend_state
                ),
                c.packets as f64,
            )),
            _ => {}
        }
        Ok(())
    }

    fn summary(&mut self, _s: &Summary, final_: bool) -> io::Result<()> {
        if !final_ {
            return Ok(());
        }
        let Some(mut out) = self.out.take() else {
            return Ok(());
        };
        let trace = build(&self.holds, &self.waits, &self.instants, &self.counters);
        serde_json::to_writer(&mut out, &trace)?;
        out.write_all(b"\n")?;
        out.flush()
    }
}

/// One trace event before serialisation, sortable per track.
struct Ev {
    pid: u64,
    tid: u64,
    ts_ns: u64,
    /// Ends sort before begins at the same time, so adjacent slices do not overlap.
    order: u8,
    v: Value,
}

fn us(ns: u64, origin: u64) -> f64 {
    ns.saturating_sub(origin) as f64 / 1000.0
}

fn build(
    holds: &[HoldFact],
    waits: &[WaitFact],
    instants: &[(u64, u32, String, String, Value)],
    counters: &[(u64, String, f64)],
) -> Value {
    let origin = holds
        .iter()
        .map(|h| h.start_ns)
        .chain(waits.iter().map(|w| w.start_ns))
        .chain(instants.iter().map(|i| i.0))
        .chain(counters.iter().map(|c| c.0))
        .min()
        .unwrap_or(0);
    // Agent groups, numbered from 1 in name order for stable output.
    let mut agents: BTreeMap<&str, u64> = BTreeMap::new();
    for a in holds
        .iter()
        .map(|h| h.agent.as_str())
        .chain(waits.iter().map(|w| w.agent.as_str()))
        .chain(instants.iter().map(|i| i.2.as_str()))
    {
        agents.insert(a, 0);
    }
    for (i, v) in agents.values_mut().enumerate() {
        *v = i as u64 + 1;
    }
    let group = |a: &str| agents.get(a).copied().unwrap_or(0);
    let mut evs: Vec<Ev> = Vec::new();
    let mut threads: BTreeMap<(u64, u64), String> = BTreeMap::new();

    for h in holds {
        let (pid, tid) = (group(&h.agent), u64::from(h.pid));
        threads.insert((pid, tid), format!("{} ({})", h.comm, h.pid));
        let name = format!("hold {}", h.lock);
        let args = json!({
            "cmdline": h.cmdline, "hold_ns": h.hold_ns, "kernel_ns": h.kernel_ns,
            "role": h.role, "open": h.open, "incomplete": h.incomplete,
        });
        slice(
            &mut evs,
            pid,
            tid,
            h.start_ns,
            h.start_ns + h.hold_ns,
            &name,
            "hold",
            args,
            origin,
        );
    }

    let mut flow_id = 0u64;
    for (i, w) in waits.iter().enumerate() {
        let (pid, tid) = (group(&w.agent), u64::from(w.pid));
        let wtid = tid | WAIT_TRACK;
        threads.insert((pid, wtid), format!("{} ({}) waiting", w.comm, w.pid));
        let end = w.start_ns + w.wait_ns;
        let name = format!("wait for {}", w.lock);
        let holders: Vec<&str> = w.holders.iter().map(|h| h.agent.as_str()).collect();
        let args = json!({
            "wait_ns": w.wait_ns, "outcome": w.outcome, "mode": w.mode, "tries": w.tries,
            "holders": holders, "cmdline": w.cmdline,
        });
        slice(
            &mut evs,
            pid,
            wtid,
            w.start_ns,
            end,
            &name,
            "wait",
            args.clone(),
            origin,
        );
        // The async slice, as the spec asks: a wait is not a thread's activity but a span.
        for (ph, ts, order) in [("b", w.start_ns, 1), ("e", end, 0)] {
            evs.push(Ev {
                pid,
                tid,
                ts_ns: ts,
                order,
                v: json!({"ph": ph, "cat": "lock_wait", "name": name, "id": i + 1,
                          "pid": pid, "tid": tid, "ts": us(ts, origin), "args": args}),
            });
        }
        // A flow from each holder's hold to this wait.
        for hr in &w.holders {
            let Some(h) = holds.iter().find(|h| {
                h.pid == hr.pid && h.start_ns < end && h.start_ns + h.hold_ns > w.start_ns
            }) else {
                continue;
            };
            flow_id += 1;
            let hpid = group(&h.agent);
            // Inside both slices: the flow binds to the slice enclosing its timestamp.
            let s_ts = w.start_ns.max(h.start_ns) + 1;
            let f_ts = end.saturating_sub(1).max(w.start_ns);
            evs.push(Ev {
                pid: hpid,
                tid: u64::from(h.pid),
                ts_ns: s_ts,
                order: 2,
                v: json!({"ph": "s", "cat": "lock_wait", "name": "waited on", "id": flow_id,
                          "pid": hpid, "tid": h.pid, "ts": us(s_ts, origin)}),
            });
            evs.push(Ev {
                pid,
                tid: wtid,
                ts_ns: f_ts,
                order: 2,
                v: json!({"ph": "f", "bp": "e", "cat": "lock_wait", "name": "waited on",
                          "id": flow_id, "pid": pid, "tid": wtid, "ts": us(f_ts, origin)}),
            });
        }
    }

    for (ts, p, agent, name, args) in instants {
        let (pid, tid) = (group(agent), u64::from(*p));
        threads
            .entry((pid, tid))
            .or_insert_with(|| format!("pid {p}"));
        evs.push(Ev {
            pid,
            tid,
            ts_ns: *ts,
            order: 2,
            v: json!({"ph": "i", "s": "t", "name": name, "pid": pid, "tid": tid,
                      "ts": us(*ts, origin), "args": args}),
        });
    }

    // Waiters at each moment: +1 at a wait's start, -1 at its end.
    let mut changes: Vec<(u64, i64)> = waits
        .iter()
        .flat_map(|w| [(w.start_ns, 1), (w.start_ns + w.wait_ns, -1)])
        .collect();
    changes.sort_by_key(|&(ts, d)| (ts, d));
    let mut n = 0i64;
    for (ts, d) in changes {
        n += d;
        evs.push(Ev {
            pid: COUNTERS_PID,
            tid: 0,
            ts_ns: ts,
            order: 2,
            v: json!({"ph": "C", "name": "waiters", "pid": COUNTERS_PID, "tid": 0,
                      "ts": us(ts, origin), "args": {"waiters": n}}),
        });
    }

    for (ts, name, value) in counters {
        evs.push(Ev {
            pid: COUNTERS_PID,
            tid: 0,
            ts_ns: *ts,
            order: 2,
            v: json!({"ph": "C", "name": name, "pid": COUNTERS_PID, "tid": 0,
                      "ts": us(*ts, origin), "args": {"value": value}}),
        });
    }

    evs.sort_by_key(|e| (e.pid, e.tid, e.ts_ns, e.order));
    let mut out: Vec<Value> = Vec::with_capacity(evs.len() + agents.len() + threads.len());
    out.push(
        json!({"ph": "M", "name": "process_name", "pid": COUNTERS_PID, "tid": 0,
                    "args": {"name": "xtlock"}}),
    );
    for (agent, pid) in &agents {
        out.push(
            json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": agent}}),
        );
    }
    for ((pid, tid), name) in &threads {
        out.push(
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": name}}),
        );
    }
    out.extend(evs.into_iter().map(|e| e.v));
    json!({ "traceEvents": out, "displayTimeUnit": "ns" })
}

#[allow(clippy::too_many_arguments)]
fn slice(
    evs: &mut Vec<Ev>,
    pid: u64,
    tid: u64,
    start: u64,
    end: u64,
    name: &str,
    cat: &str,
    args: Value,
    origin: u64,
) {
    // A zero-length slice would sort its end before its begin.
    let end = end.max(start + 1);
    evs.push(Ev {
        pid,
        tid,
        ts_ns: start,
        order: 1,
        v: json!({"ph": "B", "cat": cat, "name": name, "pid": pid, "tid": tid,
                  "ts": us(start, origin), "args": args}),
    });
    evs.push(Ev {
        pid,
        tid,
        ts_ns: end,
        order: 0,
        v: json!({"ph": "E", "pid": pid, "tid": tid, "ts": us(end, origin)}),
    });
}
