//! A timeline in the Chrome JSON trace format, which ui.perfetto.dev and chrome://tracing
//! open: one track per process grouped under its agent, each hold a slice, each wait a slice
//! (and an async slice) split into one nested slice per holder it was behind, with a flow
//! arrow from each holder; execs, failed tries and drop samples as instants, and counter
//! tracks of waiters, drops and conntrack.
//!
//! Written as the facts arrive, not collected first: the format allows events in any order
//! (the viewer sorts them), so memory stays flat whatever the capture's size. What is kept
//! is bounded: the agent groups and named tracks, and the waiter counter's changes (written
//! sorted at the end).
//!
//! Track layout: the trace's `pid` is the agent (one group per agent, numbered in order of
//! appearance), `tid` the process. Waits are drawn on a second track of the waiting process
//! (`tid` with the top bit set), so they never overlap its holds and flow arrows have a
//! slice to bind to. Timestamps are the kernel's monotonic clock, in µs.

use std::{
    collections::HashSet,
    io::{self, Write},
};

use serde_json::{json, Value};

use super::Sink;
use crate::analysis::procs::FastMap;
use crate::analysis::{
    HoldFact, Output, StaleEndpointFact, StaleEndpointOpenFact, Summary, WaitFact,
};

/// `tid` bit for a process's wait track.
const WAIT_TRACK: u64 = 1 << 31;
/// `pid` of the pseudo process that carries counters.
const COUNTERS_PID: u64 = 0;
/// `tid` of its waiter counter, written at the end (apart from the counters written as they
/// come, so each track's times only go forward).
const WAITERS_TID: u64 = 1;
/// Agent groups kept by name; later agents share one group.
const MAX_GROUPS: usize = 4096;
/// Tracks named; later ones show by number.
const MAX_NAMED: usize = 1 << 16;
/// Waiter-count changes kept for the counter (16 bytes each): 16 MiB.
const MAX_WAITER_CHANGES: usize = 1 << 20;
/// The group that carries drop samples (not an agent).
const DROPS_GROUP: &str = "(packet drops)";
/// Track group of the IPVS instants.
const IPVS_GROUP: &str = "ipvs";
/// The group of the agents past [`MAX_GROUPS`].
const OTHER_GROUP: &str = "(other agents)";

/// Writes facts as trace events as they come; the final summary closes the file.
pub struct PerfettoSink<W: Write> {
    out: W,
    /// Events written so far (for the separators).
    written: u64,
    closed: bool,
    groups: FastMap<String, u64>,
    named: HashSet<(u64, u64)>,
    async_id: u64,
    flow_id: u64,
    /// (time, +1 or -1): a wait's start and end.
    waiter_changes: Vec<(u64, i8)>,
    waiters_cut: bool,
}

impl<W: Write> PerfettoSink<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            closed: false,
            groups: FastMap::default(),
            named: HashSet::new(),
            async_id: 0,
            flow_id: 0,
            waiter_changes: Vec::new(),
            waiters_cut: false,
        }
    }

    fn write(&mut self, v: &Value) -> io::Result<()> {
        if self.written == 0 {
            self.out
                .write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")?;
        } else {
            self.out.write_all(b",\n")?;
        }
        serde_json::to_writer(&mut self.out, v)?;
        self.written += 1;
        Ok(())
    }

    /// The group (trace `pid`) of an agent; named when first seen.
    fn group(&mut self, agent: &str) -> io::Result<u64> {
        if let Some(g) = self.groups.get(agent) {
            return Ok(*g);
        }
        let name = if self.groups.len() >= MAX_GROUPS {
            OTHER_GROUP
        } else {
            agent
        };
        if let Some(g) = self.groups.get(name) {
            return Ok(*g);
        }
        let g = self.groups.len() as u64 + 1;
        self.groups.insert(name.to_owned(), g);
        self.write(
            &json!({"ph": "M", "name": "process_name", "pid": g, "tid": 0,
                           "args": {"name": name}}),
        )?;
        Ok(g)
    }

    /// Names a track the first time it is used.
    fn name_track(&mut self, pid: u64, tid: u64, name: impl FnOnce() -> String) -> io::Result<()> {
        if self.named.len() >= MAX_NAMED || !self.named.insert((pid, tid)) {
            return Ok(());
        }
        self.write(
            &json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": name()}}),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn slice(
        &mut self,
        pid: u64,
        tid: u64,
        start: u64,
        end: u64,
        name: &str,
        cat: &str,
        args: Value,
    ) -> io::Result<()> {
        self.write(
            &json!({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                           "ts": us(start), "dur": us(end.saturating_sub(start)),
                           "args": args}),
        )
    }

    fn instant(
        &mut self,
        ts: u64,
        pid: u32,
        group: &str,
        name: String,
        args: Value,
    ) -> io::Result<()> {
        let g = self.group(group)?;
        let tid = u64::from(pid);
        self.name_track(g, tid, || format!("pid {pid}"))?;
        self.write(
            &json!({"ph": "i", "s": "t", "name": name, "pid": g, "tid": tid,
                           "ts": us(ts), "args": args}),
        )
    }

    fn counter(&mut self, ts: u64, name: String, value: f64) -> io::Result<()> {
        self.write(
            &json!({"ph": "C", "name": name, "pid": COUNTERS_PID, "tid": 0,
                           "ts": us(ts), "args": {"value": value}}),
        )
    }

    fn hold(&mut self, h: &HoldFact) -> io::Result<()> {
        let (pid, tid) = (self.group(&h.who.agent)?, u64::from(h.pid));
        self.name_track(pid, tid, || format!("{} ({})", h.who.comm, h.pid))?;
        let mut args = json!({
            "cmdline": h.who.cmdline, "hold_ns": h.hold_ns, "kernel_ns": h.kernel_ns,
            "role": h.who.role, "open": h.open, "incomplete": h.incomplete,
        });
        // An nf_tables commit: what its batch changed.
        if let Some(b) = &h.nft {
            args["nft"] = json!(b);
        }
        let name = format!("hold {}", h.lock);
        let end = h.start_ns + h.hold_ns;
        self.slice(pid, tid, h.start_ns, end, &name, "hold", args)?;
        // Where the time went: each table replace, nested in the hold; the rest is the
        // holder's own userspace work.
        for t in &h.tables {
            let from = t.start_ns.clamp(h.start_ns, end);
            let to = (t.start_ns + t.kernel_ns).clamp(from, end);
            let table = if t.table.is_empty() { "?" } else { &t.table };
            let name = format!("{} {} {}", t.op, t.family, table);
            let args = json!({ "entries": t.entries, "bytes": t.bytes, "ret": t.ret });
            self.slice(pid, tid, from, to, &name, "kernel", args)?;
        }
        Ok(())
    }

    fn wait(&mut self, w: &WaitFact) -> io::Result<()> {
        let (pid, tid) = (self.group(&w.who.agent)?, u64::from(w.pid));
        let wtid = tid | WAIT_TRACK;
        self.name_track(pid, wtid, || format!("{} ({}) waiting", w.who.comm, w.pid))?;
        let end = w.start_ns + w.wait_ns;
        let name = format!("wait for {}", w.lock);
        let holders: Vec<&str> = w.holders.iter().map(|h| h.agent.as_str()).collect();
        let args = json!({
            "wait_ns": w.wait_ns, "outcome": w.outcome, "mode": w.mode, "tries": w.tries,
            "holders": holders, "cmdline": w.who.cmdline,
        });
        self.slice(pid, wtid, w.start_ns, end, &name, "wait", args.clone())?;
        // Where the time went: one nested slice per holder, from when it first held the
        // lock during the wait, as long as the wait was behind it (exact when it held the
        // lock in one stretch, as a hand-over chain does); gaps are time the lock was free.
        let mut at = w.start_ns;
        if w.unknown_ns > 0 {
            let to = (at + w.unknown_ns).min(end);
            let name = "behind an unknown holder";
            self.slice(pid, wtid, at, to, name, "wait", json!({}))?;
            at = to;
        }
        for h in &w.holders {
            let ns = h.behind_ns.unwrap_or(0);
            let from = h.from_ns.unwrap_or(at).clamp(at, end);
            let to = (from + ns).min(end);
            let name = format!("behind {}", h.agent);
            let mut args = json!({"pid": h.pid, "cmdline": h.cmdline, "behind_ns": ns});
            // The holder was itself queued for another lock: name the root of the queue.
            if let Some(w) = &h.waiting {
                let roots: Vec<&str> = w.holders.iter().map(|r| r.agent.as_str()).collect();
                args["itself_waiting"] = json!({
                    "lock": w.lock, "wait_ns": w.wait_ns, "behind": roots,
                });
            }
            self.slice(pid, wtid, from, to, &name, "wait", args)?;
            at = to;
        }
        if w.other_holders > 0 {
            let name = format!("behind {} more", w.other_holders);
            let to = (at + w.other_holders_ns).min(end);
            self.slice(pid, wtid, at, to, &name, "wait", json!({}))?;
        }
        // The async slice, as the spec asks: a wait is not a thread's activity but a span.
        self.async_id += 1;
        let id = self.async_id;
        for (ph, ts) in [("b", w.start_ns), ("e", end)] {
            self.write(
                &json!({"ph": ph, "cat": "lock_wait", "name": name, "id": id,
                               "pid": pid, "tid": tid, "ts": us(ts), "args": args}),
            )?;
        }
        // A flow from each holder's hold (it held the lock from `from_ns`) to the wait.
        for h in &w.holders {
            let Some(from) = h.from_ns else { continue };
            self.flow_id += 1;
            let id = self.flow_id;
            let hpid = self.group(&h.agent)?;
            // Inside both slices: a flow binds to the slice enclosing its time.
            let s_ts = from + 1;
            let f_ts = (from.max(w.start_ns) + 1).min(end);
            self.write(
                &json!({"ph": "s", "cat": "lock_wait", "name": "waited on", "id": id,
                               "pid": hpid, "tid": h.pid, "ts": us(s_ts)}),
            )?;
            self.write(
                &json!({"ph": "f", "bp": "e", "cat": "lock_wait", "name": "waited on",
                               "id": id, "pid": pid, "tid": wtid, "ts": us(f_ts)}),
            )?;
        }
        if self.waiter_changes.len() + 2 <= MAX_WAITER_CHANGES {
            self.waiter_changes.push((w.start_ns, 1));
            self.waiter_changes.push((end, -1));
        } else {
            self.waiters_cut = true;
        }
        Ok(())
    }

    /// A Service routed to a gone endpoint: a slice from when it was gone to the fix (or the
    /// end), on a track per (Service, endpoint) in the `stale endpoints` group.
    /// The track of a (service, endpoint) window: a stable id from its key (FNV-1a), clear
    /// of the pid-numbered tracks, in the "stale endpoints" group.
    fn stale_track(&mut self, service: &str, endpoint: &str) -> io::Result<(u64, u64)> {
        let pid = self.group("stale endpoints")?;
        let key = format!("{service} -> {endpoint}");
        let tid = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        }) | (1 << 62);
        self.name_track(pid, tid, || key.clone())?;
        Ok((pid, tid))
    }

    fn stale_endpoint_open(&mut self, f: &StaleEndpointOpenFact) -> io::Result<()> {
        let (pid, tid) = self.stale_track(&f.service, &f.endpoint)?;
        let args = serde_json::to_value(f).unwrap_or(Value::Null);
        self.write(&json!({"ph": "i", "s": "t", "cat": "stale_endpoint_open",
                           "name": super::terminal::stale_endpoint_open_text(f),
                           "pid": pid, "tid": tid, "ts": us(f.ts_ns), "args": args}))
    }

    fn stale_endpoint(&mut self, f: &StaleEndpointFact) -> io::Result<()> {
        let (pid, tid) = self.stale_track(&f.service, &f.endpoint)?;
        let name = format!(
            "{} routed to {} after it was gone ({})",
            f.service, f.endpoint, f.gone
        );
        let args = serde_json::to_value(f).unwrap_or(Value::Null);
        self.slice(
            pid,
            tid,
            f.ts_ns,
            f.ts_ns + f.stale_ns,
            &name,
            "stale_endpoint",
            args,
        )
    }

    /// The waiter counter, then the end of the file.
    fn close(&mut self) -> io::Result<()> {
        self.closed = true;
        self.waiter_changes.sort_unstable();
        let mut n = 0i64;
        for (ts, d) in std::mem::take(&mut self.waiter_changes) {
            n += i64::from(d);
            self.write(&json!({"ph": "C", "name": "waiters", "pid": COUNTERS_PID,
                               "tid": WAITERS_TID, "ts": us(ts), "args": {"waiters": n}}))?;
        }
        let note = if self.waiters_cut {
            format!("waiters counter stops after {MAX_WAITER_CHANGES} changes")
        } else {
            "complete".to_owned()
        };
        self.write(
            &json!({"ph": "M", "name": "process_name", "pid": COUNTERS_PID, "tid": 0,
                           "args": {"name": "xtlock", "waiters": note}}),
        )?;
        self.out.write_all(b"\n]}\n")?;
        self.out.flush()
    }
}

fn label<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "?".into(),
    }
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// The facts of each subsystem, [`Sink::output`] dispatching to them.
impl<W: Write> PerfettoSink<W> {
    /// Instants on an agent's track: execs, lock trouble, stalled syncs, rule changes
    /// and writers in each other's way.
    fn agent_activity(&mut self, o: &Output) -> io::Result<()> {
        match o {
            Output::Exec(e) => self.instant(
                e.ts_ns,
                e.pid,
                &e.agent,
                format!("exec {}", e.cmdline),
                json!({ "filename": e.filename, "caller": e.agent, "ppid": e.ppid }),
            ),
            Output::FailedTry(f) => self.instant(
                f.ts_ns,
                f.pid,
                &f.agent,
                format!("failed try on {}", f.lock),
                json!({ "errno": f.errno, "holder": f.holder.as_ref().map(|h| &h.agent) }),
            ),
            Output::Timeout(t) => self.instant(
                t.ts_ns,
                t.pid,
                &t.who.agent,
                format!("lock timeout on {} (exit {})", t.lock, t.exit_code),
                json!({ "waited_ns": t.waited_ns, "cmdline": t.who.cmdline }),
            ),
            Output::Stall(st) => self.instant(
                st.ts_ns,
                st.agent_pid,
                &st.agent,
                if st.stalled {
                    format!("{} stalled ({})", st.agent, st.reason)
                } else {
                    format!("{} syncs again", st.agent)
                },
                serde_json::to_value(st).unwrap_or(Value::Null),
            ),
            Output::RuleChange(c) if !super::terminal::rule_change_lines(c).is_empty() => self
                .instant(
                    c.ts_ns,
                    c.pid,
                    &c.agent,
                    super::terminal::rule_change_lines(c).join("; "),
                    serde_json::to_value(c).unwrap_or(Value::Null),
                ),
            Output::Unserialized(u) => self.instant(
                u.ts_ns,
                u.writer.pid,
                &u.writer.agent,
                super::terminal::unserialized_text(u),
                serde_json::to_value(u).unwrap_or(Value::Null),
            ),
            Output::MixedBackends(m) => self.instant(
                m.ts_ns,
                m.pid,
                &m.agent,
                super::terminal::mixed_backends_text(m, 0),
                serde_json::to_value(m).unwrap_or(Value::Null),
            ),
            _ => Ok(()),
        }
    }

    /// Drops, conntrack refusals and the node's refusals: instants on the drops track, or
    /// on the holder's, and counter tracks.
    fn drops_and_refusals(&mut self, o: &Output) -> io::Result<()> {
        match o {
            Output::Drop(d) => self.instant(
                d.ts_ns,
                0,
                DROPS_GROUP,
                format!("drop {} ({})", label(&d.class), d.reason),
                serde_json::to_value(d).unwrap_or(Value::Null),
            ),
            Output::ConntrackRefused(c) => self.instant(
                c.ts_ns,
                0,
                DROPS_GROUP,
                format!("{} ({})", c.class.describe(), c.function),
                serde_json::to_value(c).unwrap_or(Value::Null),
            ),
            Output::DropCount(c) => self.counter(
                c.ts_ns,
                format!("drops: {} (netns {})", label(&c.class), c.netns),
                c.count as f64,
            ),
            Output::Conntrack(c) => self.counter(
                c.ts_ns,
                format!("conntrack entries (netns {})", c.netns),
                c.entries as f64,
            ),
            Output::HoldDrops(h) => self.instant(
                h.start_ns + h.hold_ns,
                h.pid,
                &h.agent,
                format!(
                    "{} packets dropped during this hold of {}",
                    h.dropped, h.lock
                ),
                json!({ "by_class": h.by_class, "by_reason": h.by_reason }),
            ),
            // Counter tracks beside the holds: refusals per kind and destination per interval.
            Output::RefusalCount(r) => self.counter(
                r.ts_ns,
                if r.dest.is_empty() {
                    format!("refusals: {}", r.kind.as_str())
                } else {
                    format!("refusals: {} {}", r.kind.as_str(), r.dest)
                },
                r.count as f64,
            ),
            Output::HoldRefusals(h) => self.instant(
                h.start_ns + h.hold_ns,
                h.pid,
                &h.agent,
                super::terminal::hold_refusals_text(h)
                    .trim_start_matches("!! ")
                    .to_string(),
                json!({ "refused": h.refused, "groups": h.groups }),
            ),
            // A counter track per rule, and the line at the read that counted them.
            Output::RuleDrops(r) => {
                let table = super::terminal::table_name(&r.family, &r.table);
                let track = if r.rule.is_empty() {
                    format!("rule drops: {table} {} policy", r.chain)
                } else {
                    format!("rule drops: {table} {} `{}`", r.chain, r.rule)
                };
                self.counter(r.ts_ns, track, r.packets as f64)?;
                self.instant(
                    r.ts_ns,
                    0,
                    DROPS_GROUP,
                    super::terminal::rule_drops_text(r)
                        .trim_start_matches("!! ")
                        .to_string(),
                    serde_json::to_value(r).unwrap_or(Value::Null),
                )
            }
            Output::UncountedDrops(u) => self.instant(
                u.ts_ns,
                0,
                DROPS_GROUP,
                super::terminal::uncounted_drops_text(u)
                    .trim_start_matches("!! ")
                    .to_string(),
                serde_json::to_value(u).unwrap_or(Value::Null),
            ),
            _ => Ok(()),
        }
    }

    /// Services and IPVS: connections and table changes, packet counters, windows routing
    /// to gone endpoints, new endpoints, drained real servers.
    fn services_and_ipvs(&mut self, o: &Output) -> io::Result<()> {
        match o {
            Output::Ipvs(i) => self.instant(
                i.ts_ns,
                i.pid.unwrap_or(0),
                IPVS_GROUP,
                super::terminal::ipvs_text(i),
                serde_json::to_value(i).unwrap_or(Value::Null),
            ),
            Output::IpvsCount(c) => self.counter(
                c.ts_ns,
                format!(
                    "ipvs {} {} -> {} ({})",
                    c.protocol, c.service, c.backend, c.backend_state
                ),
                c.packets as f64,
            ),
            Output::StaleEndpoint(f) => self.stale_endpoint(f),
            // The window's slice comes when it closes; its opening is an instant on the same
            // track.
            Output::StaleEndpointOpen(f) => self.stale_endpoint_open(f),
            // At the write that first routed to it, on its writer's track.
            Output::EndpointProgrammed(f) => self.instant(
                f.ts_ns.saturating_add(f.latency_ns),
                f.write.pid,
                if f.write.agent.is_empty() {
                    "(no write seen)"
                } else {
                    &f.write.agent
                },
                super::terminal::endpoint_programmed_text(f),
                serde_json::to_value(f).unwrap_or(Value::Null),
            ),
            Output::IpvsDrained(f) => self.instant(
                f.ts_ns,
                0,
                "IPVS",
                super::terminal::ipvs_drained_text(f),
                serde_json::to_value(f).unwrap_or(Value::Null),
            ),
            _ => Ok(()),
        }
    }
}

impl<W: Write> Sink for PerfettoSink<W> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        if self.closed {
            return Ok(());
        }
        match o {
            Output::Hold(h) => self.hold(h),
            Output::Wait(w) => self.wait(w),
            Output::Exec(_)
            | Output::FailedTry(_)
            | Output::Timeout(_)
            | Output::Stall(_)
            | Output::RuleChange(_)
            | Output::Unserialized(_)
            | Output::MixedBackends(_) => self.agent_activity(o),
            Output::Drop(_)
            | Output::ConntrackRefused(_)
            | Output::DropCount(_)
            | Output::Conntrack(_)
            | Output::HoldDrops(_)
            | Output::RefusalCount(_)
            | Output::HoldRefusals(_)
            | Output::RuleDrops(_)
            | Output::UncountedDrops(_) => self.drops_and_refusals(o),
            Output::Ipvs(_)
            | Output::IpvsCount(_)
            | Output::StaleEndpoint(_)
            | Output::StaleEndpointOpen(_)
            | Output::EndpointProgrammed(_)
            | Output::IpvsDrained(_) => self.services_and_ipvs(o),
            _ => Ok(()),
        }
    }

    fn summary(&mut self, _s: &Summary, final_: bool) -> io::Result<()> {
        if !final_ || self.closed {
            return Ok(());
        }
        self.close()
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}
