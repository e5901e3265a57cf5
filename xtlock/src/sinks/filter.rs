//! What a person asked to see: `--agent`, `--pod`, `--namespace` (`trace`, `report`),
//! `--lock-file`, `--since` and `--until` (`report`). One sink wrapper in front of the
//! terminal or JSON sink: the analysis, the summary's tables, metrics and captures see
//! everything; only the facts shown are chosen, and the summary says so.
//!
//! A fact names its parties: the holder of a hold, the waiter of a wait *and every holder it
//! waited behind*, the caller of an exec, the holds a drop happened in. It is shown when
//! one party matches every who-filter given (`--agent` and `--pod`/`--namespace` together
//! mean the same party); values of one flag are alternatives. Facts that name nobody
//! (drops outside any hold, conntrack counters, IPVS traffic) are not shown under a
//! who-filter; lost events always are, since they make every count a lower bound.

use std::collections::{HashSet, VecDeque};
use std::io;
use std::time::Duration;

use serde::Serialize;
use smallvec::SmallVec;

use super::Sink;
use crate::analysis::facts::StaleFix;
use crate::analysis::{HoldRef, HolderRef, Output, Summary};
use crate::kube::PodName;

/// Which facts to show; empty lists and `None` let everything through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FactFilter {
    /// Agent names as facts carry them (`kube-proxy`, `calico-node`).
    pub agents: Vec<String>,
    /// A pod's name (`kube-proxy-x7k2p`), or its workload's (`kube-proxy`).
    pub pods: Vec<String>,
    pub namespaces: Vec<String>,
    /// Lock paths as facts carry them; facts about no lock pass.
    pub locks: Vec<String>,
    /// Services as kube-proxy names them, `ns/name` or `ns/name:port` (its port's name, or
    /// number where it has none): facts that name one (see [`services_of`]).
    pub services: Vec<String>,
    /// Facts overlapping `[since, until)`, in event time (`CLOCK_MONOTONIC` ns), each with
    /// how the summary says it.
    pub since: Option<(u64, String)>,
    pub until: Option<(u64, String)>,
}

impl FactFilter {
    pub fn is_empty(&self) -> bool {
        *self == FactFilter::default()
    }

    fn wants_who(&self) -> bool {
        !self.agents.is_empty() || self.wants_pod()
    }

    fn wants_pod(&self) -> bool {
        !self.pods.is_empty() || !self.namespaces.is_empty()
    }

    /// Whether `o` is shown. `pids` remembers the processes of matching pods, so that facts
    /// naming only a pid (drops in a hold, exits) follow their pod.
    fn keeps(&self, o: &Output, pids: &mut PidMemory) -> bool {
        // Who first: it remembers pids even from facts outside the window.
        let lost = matches!(o, Output::Lost(_));
        let who = lost || self.who_matches(o, pids);
        who && (lost || self.service_matches(o)) && self.in_window(o) && self.lock_matches(o)
    }

    fn service_matches(&self, o: &Output) -> bool {
        if self.services.is_empty() {
            return true;
        }
        let (names, texts) = services_of(o);
        self.services.iter().any(|want| {
            names.iter().any(|n| names_service(n, want))
                || texts.iter().any(|t| mentions_service(t, want))
        })
    }

    fn who_matches(&self, o: &Output, pids: &mut PidMemory) -> bool {
        if !self.wants_who() {
            return true;
        }
        let mut any = false;
        for p in parties(o) {
            if !self.agents.is_empty() && !self.agents.iter().any(|a| a == p.agent) {
                continue;
            }
            let ok = match p.pod {
                _ if !self.wants_pod() => true,
                Some(pod) => self.pod_matches(pod),
                // The process itself: an agent's pid in a pod says nothing of a child
                // whose pod is unknown.
                None => pids.contains(p.pids[0]),
            };
            if ok && p.pod.is_some() {
                p.pids.iter().for_each(|&pid| pids.remember(pid));
            }
            any |= ok;
        }
        any
    }

    fn pod_matches(&self, pod: &PodName) -> bool {
        (self.pods.is_empty()
            || self
                .pods
                .iter()
                .any(|n| n == pod.pod.as_str() || n == pod.workload()))
            && (self.namespaces.is_empty()
                || self.namespaces.iter().any(|n| n == pod.namespace.as_str()))
    }

    fn in_window(&self, o: &Output) -> bool {
        let (start, end) = span(o);
        self.since.as_ref().is_none_or(|(s, _)| end >= *s)
            && self.until.as_ref().is_none_or(|(u, _)| start < *u)
    }

    fn lock_matches(&self, o: &Output) -> bool {
        if self.locks.is_empty() {
            return true;
        }
        let named = locks_of(o);
        named.is_empty() || named.iter().any(|l| self.locks.iter().any(|w| w == l))
    }
}

/// One process a fact is about.
struct Party<'a> {
    agent: &'a str,
    pod: Option<&'a PodName>,
    /// The process, and its agent's (0: none): both are remembered when the pod matches,
    /// only the first is looked up (a stall names its agent's pid there).
    pids: [u32; 2],
}

fn holder(h: &HolderRef) -> Party<'_> {
    Party {
        agent: &h.agent,
        pod: h.pod.as_deref(),
        pids: [h.pid, 0],
    }
}

fn hold_ref(h: &HoldRef) -> Party<'_> {
    Party {
        agent: &h.agent,
        pod: None,
        pids: [h.pid, 0],
    }
}

/// The agent of a rule write a service fact names (none when no write was seen).
fn writer(w: &StaleFix) -> Option<Party<'_>> {
    (!w.agent.is_empty()).then_some(Party {
        agent: &w.agent,
        pod: None,
        pids: [w.pid, 0],
    })
}

fn parties(o: &Output) -> SmallVec<[Party<'_>; 4]> {
    let mut v = SmallVec::new();
    match o {
        Output::Hold(h) => v.push(Party {
            agent: &h.who.agent,
            pod: h.who.pod.as_deref(),
            pids: [h.pid, h.who.agent_pid],
        }),
        Output::Wait(w) => {
            v.push(Party {
                agent: &w.who.agent,
                pod: w.who.pod.as_deref(),
                pids: [w.pid, w.who.agent_pid],
            });
            v.extend(w.holders.iter().map(holder));
        }
        Output::FailedTry(f) => {
            v.push(Party {
                agent: &f.agent,
                pod: f.pod.as_deref(),
                pids: [f.pid, 0],
            });
            v.extend(f.holder.iter().map(holder));
        }
        Output::Timeout(t) => {
            v.push(Party {
                agent: &t.who.agent,
                pod: t.who.pod.as_deref(),
                pids: [t.pid, t.who.agent_pid],
            });
            v.extend(t.holders.iter().map(holder));
        }
        Output::Exec(e) => v.push(Party {
            agent: &e.agent,
            pod: e.pod.as_deref(),
            pids: [e.pid, e.agent_pid],
        }),
        Output::Exit(e) => v.push(Party {
            agent: &e.agent,
            pod: None,
            pids: [e.pid, 0],
        }),
        Output::Stall(s) => v.push(Party {
            agent: &s.agent,
            pod: None,
            pids: [s.agent_pid, 0],
        }),
        Output::RuleWrite(w) => v.push(Party {
            agent: &w.agent,
            pod: None,
            pids: [w.pid, 0],
        }),
        Output::MixedBackends(m) => v.push(Party {
            agent: &m.agent,
            pod: None,
            pids: [m.pid, 0],
        }),
        Output::Unserialized(u) => {
            v.push(Party {
                agent: &u.writer.agent,
                pod: None,
                pids: [u.writer.pid, 0],
            });
            v.push(Party {
                agent: &u.other.agent,
                pod: None,
                pids: [u.other.pid, 0],
            });
        }
        // The writer (each of them, when ambiguous) and whose rules it changed.
        Output::RuleChange(c) => {
            v.extend(c.agent.split(", ").map(|a| Party {
                agent: a,
                pod: None,
                pids: [c.pid, 0],
            }));
            v.extend(c.foreign.iter().map(|f| Party {
                agent: &f.owner,
                pod: None,
                pids: [0, 0],
            }));
        }
        Output::HoldDrops(h) => v.push(Party {
            agent: &h.agent,
            pod: None,
            pids: [h.pid, 0],
        }),
        // Refusals, like drops, through the hold they happened in.
        Output::HoldRefusals(h) => v.push(Party {
            agent: &h.agent,
            pod: None,
            pids: [h.pid, 0],
        }),
        Output::RefusalCount(r) => v.extend(r.hold.iter().map(hold_ref)),
        Output::Refusal(r) => v.extend(r.hold.iter().map(hold_ref)),
        // No write yet: nobody's.
        Output::StaleEndpointOpen(_) => {}
        // Through the agent whose write fixed it (or nobody: still routed).
        Output::StaleEndpoint(f) => v.extend(f.fix.as_ref().and_then(writer)),
        // Through the agent whose write first routed to it.
        Output::EndpointProgrammed(f) => v.extend(writer(&f.write)),
        // The netlink read does not say who set the weight.
        Output::IpvsDrained(_) => {}
        Output::Drop(d) => v.extend(d.hold.iter().map(hold_ref)),
        Output::ConntrackRefused(c) => v.extend(c.hold.iter().map(hold_ref)),
        Output::DropCount(d) => v.extend(d.holds.iter().map(hold_ref)),
        Output::Conntrack(c) => v.extend(c.holds.iter().map(hold_ref)),
        // A table change is made by the agent itself (kube-proxy in IPVS mode), which has
        // no agent attribution here but its command name; traffic names nobody.
        Output::Ipvs(i) if i.event.starts_with("dest_") || i.event.starts_with("service_") => {
            if let (Some(comm), Some(pid)) = (&i.comm, i.pid) {
                v.push(Party {
                    agent: comm,
                    pod: None,
                    pids: [pid, 0],
                });
            }
        }
        // Whose rule it is, whose chain, who added it, and the hold its drops fell in.
        Output::RuleDrops(r) => {
            let names = [&r.owner, &r.chain_owner]
                .into_iter()
                .flatten()
                .map(String::as_str)
                .chain(r.added.as_ref().map(|a| a.agent.as_str()));
            for a in names {
                if !v.iter().any(|p: &Party<'_>| p.agent == a) {
                    v.push(Party {
                        agent: a,
                        pod: None,
                        pids: [r.added.as_ref().map_or(0, |a| a.pid), 0],
                    });
                }
            }
            v.extend(r.hold.iter().map(hold_ref));
        }
        Output::UncountedDrops(_) => {}
        Output::Ipvs(_) | Output::IpvsCount(_) | Output::Lost(_) => {}
    }
    v
}

/// Whether `name` (a fact's `ns/svc:port`) is the Service `want` (`ns/svc`: any of its ports;
/// `ns/svc:port`: that one).
fn names_service(name: &str, want: &str) -> bool {
    name == want
        || (!want.contains(':')
            && name
                .strip_prefix(want)
                .is_some_and(|rest| rest.starts_with(':')))
}

/// Whether a rule's text names the Service `want` in kube-proxy's comments (`"ns/svc:port
/// has no endpoints"`, `"ns/svc:port cluster IP"`): the name, followed by its port's `:`
/// (when no port is asked for) or by the end of the name.
fn mentions_service(text: &str, want: &str) -> bool {
    text.match_indices(want).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + want.len()..].chars().next();
        let starts = before.is_none_or(|c| c == '"' || c == ' ');
        let ends = match after {
            None => true,
            Some(':') => !want.contains(':'),
            Some(c) => c == '"' || c == ' ',
        };
        starts && ends
    })
}

/// The Services a fact names: their names as facts carry them (dead-endpoint windows, first
/// routings), and rule texts whose kube-proxy comments may name one (the REJECT rule behind a
/// refusal, the rule behind drops, the rules a write changed). Facts naming none are not shown
/// under `--service`.
fn services_of(o: &Output) -> (SmallVec<[&str; 2]>, SmallVec<[&str; 4]>) {
    let (mut names, mut texts) = (SmallVec::new(), SmallVec::new());
    match o {
        Output::StaleEndpointOpen(f) => names.push(f.service.as_str()),
        Output::StaleEndpoint(f) => names.push(f.service.as_str()),
        Output::EndpointProgrammed(f) => names.push(f.service.as_str()),
        Output::RefusalCount(r) => texts.extend(r.rule.as_deref()),
        Output::HoldRefusals(h) => texts.extend(h.groups.iter().filter_map(|g| g.rule.as_deref())),
        Output::RuleDrops(r) => texts.push(r.rule.as_str()),
        Output::RuleChange(c) => {
            let d = &c.diff;
            texts.extend(d.added.iter().chain(&d.removed).map(|(_, r)| r.as_str()));
            texts.extend(d.stripped.iter().map(|s| s.now.as_str()));
        }
        _ => {}
    }
    (names, texts)
}

/// The lock files a fact is about (none: it passes a lock filter).
fn locks_of(o: &Output) -> SmallVec<[&str; 2]> {
    let mut v = SmallVec::new();
    match o {
        Output::Hold(h) => v.push(h.lock.as_str()),
        Output::Wait(w) => v.push(w.lock.as_str()),
        Output::FailedTry(f) => v.push(f.lock.as_str()),
        Output::Timeout(t) => v.push(t.lock.as_str()),
        Output::HoldDrops(h) => v.push(h.lock.as_str()),
        Output::Drop(d) => v.extend(d.hold.iter().map(|h| h.lock.as_str())),
        Output::ConntrackRefused(c) => v.extend(c.hold.iter().map(|h| h.lock.as_str())),
        Output::DropCount(d) => v.extend(d.holds.iter().map(|h| h.lock.as_str())),
        Output::Conntrack(c) => v.extend(c.holds.iter().map(|h| h.lock.as_str())),
        _ => {}
    }
    v
}

/// When a fact began and ended: a hold or wait overlapping the window is shown whole.
fn span(o: &Output) -> (u64, u64) {
    let start = o.ts_ns();
    let len = match o {
        Output::Hold(h) => h.hold_ns,
        Output::Wait(w) => w.wait_ns,
        Output::HoldDrops(h) => h.hold_ns,
        Output::DropCount(d) => d.interval_ns,
        Output::Conntrack(c) => c.interval_ns,
        Output::IpvsCount(c) => c.interval_ns,
        Output::RuleDrops(r) => r.ts_ns.saturating_sub(r.since_ns),
        _ => 0,
    };
    (start, start.saturating_add(len))
}

/// Pids of processes seen in a matching pod, the most recent [`REMEMBERED_PIDS`].
#[derive(Default)]
struct PidMemory {
    set: HashSet<u32>,
    order: VecDeque<u32>,
}

/// Enough for every iptables process of a sync storm; a reused pid is forgotten in time.
const REMEMBERED_PIDS: usize = 4096;

impl PidMemory {
    fn contains(&self, pid: u32) -> bool {
        pid != 0 && self.set.contains(&pid)
    }

    fn remember(&mut self, pid: u32) {
        if pid == 0 || !self.set.insert(pid) {
            return;
        }
        self.order.push_back(pid);
        if self.order.len() > REMEMBERED_PIDS {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }
}

/// What the summary says about a filter: `{"filter": {...}}` in JSON, a `filtered:` line
/// on the terminal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FilterNote {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub agents: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lock_files: Vec<String>,
    /// As the report's lines show times, and in event time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_ns: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until_ns: Option<u64>,
    /// Facts the analysis emitted, and those that passed the filter.
    pub facts: u64,
    pub shown: u64,
}

impl FilterNote {
    /// `agent kube-proxy; namespace kube-system; since 10:02:00.000; 12 of 40 facts shown`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        for (what, list) in [
            ("agent", &self.agents),
            ("pod", &self.pods),
            ("namespace", &self.namespaces),
            ("service", &self.services),
            ("lock", &self.lock_files),
        ] {
            if !list.is_empty() {
                parts.push(format!("{what} {}", list.join(", ")));
            }
        }
        if let Some(s) = &self.since {
            parts.push(format!("since {s}"));
        }
        if let Some(u) = &self.until {
            parts.push(format!("until {u}"));
        }
        parts.push(format!("{} of {} facts shown", self.shown, self.facts));
        parts.join("; ")
    }
}

/// Shows only the facts `filter` keeps; the summary goes through whole, with a note.
pub struct FilteredSink<S> {
    inner: S,
    filter: FactFilter,
    pids: PidMemory,
    facts: u64,
    shown: u64,
}

impl<S: Sink> FilteredSink<S> {
    pub fn new(inner: S, filter: FactFilter) -> Self {
        FilteredSink {
            inner,
            filter,
            pids: PidMemory::default(),
            facts: 0,
            shown: 0,
        }
    }

    pub fn note(&self) -> FilterNote {
        let f = &self.filter;
        FilterNote {
            agents: f.agents.clone(),
            pods: f.pods.clone(),
            namespaces: f.namespaces.clone(),
            services: f.services.clone(),
            lock_files: f.locks.clone(),
            since: f.since.as_ref().map(|s| s.1.clone()),
            since_ns: f.since.as_ref().map(|s| s.0),
            until: f.until.as_ref().map(|u| u.1.clone()),
            until_ns: f.until.as_ref().map(|u| u.0),
            facts: self.facts,
            shown: self.shown,
        }
    }

    #[cfg(test)]
    fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Sink> Sink for FilteredSink<S> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        self.facts += 1;
        if !self.filter.keeps(o, &mut self.pids) {
            return Ok(());
        }
        self.shown += 1;
        self.inner.output(o)
    }

    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()> {
        let note = self.note();
        self.inner.summary_filtered(s, final_, &note)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A `--since`/`--until` value, before it is placed on a capture's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum When {
    /// RFC 3339 with its offset: `2024-05-01T08:02:30Z`, `2024-05-01 10:02:30+02:00`.
    Instant { unix_ns: i128 },
    /// A date and time with no offset: local time, as the report's lines show it.
    LocalDateTime(chrono::NaiveDateTime),
    /// `HH:MM[:SS[.fff]]`, local: on the capture's day, the occurrence nearest its start.
    TimeOfDay(chrono::NaiveTime),
    /// `90s`, `+5m`: this long after the capture started.
    Offset(Duration),
}

/// The clocks of a capture, to place a [`When`] among its events.
#[derive(Clone, Copy, Debug)]
pub struct CaptureClock {
    /// Unix-epoch ns when recording started.
    pub started_wall_ns: u64,
    /// `CLOCK_REALTIME - CLOCK_MONOTONIC`: an event's `ts_ns` plus this is Unix-epoch ns.
    pub boot_to_wall_offset_ns: i64,
    /// The time zone the report shows (and `HH:MM:SS` is read in).
    pub utc_offset_s: i32,
}

const NS: i128 = 1_000_000_000;
const DAY_NS: i128 = 86_400 * NS;

impl When {
    /// For clap: every form an SRE is likely to type, or what to type instead.
    pub fn parse(s: &str) -> Result<When, String> {
        use chrono::{DateTime, NaiveDateTime, NaiveTime};
        let t = s.trim();
        if let Some(d) = t.strip_prefix('+') {
            return humantime::parse_duration(d.trim())
                .map(When::Offset)
                .map_err(|e| format!("`{s}` is not an offset ({e}); use e.g. +90s, +5m"));
        }
        if let Ok(dt) = DateTime::parse_from_rfc3339(t) {
            let unix_ns = i128::from(dt.timestamp()) * NS + i128::from(dt.timestamp_subsec_nanos());
            return Ok(When::Instant { unix_ns });
        }
        for f in [
            "%Y-%m-%d %H:%M:%S%.f",
            "%Y-%m-%dT%H:%M:%S%.f",
            "%Y-%m-%d %H:%M",
            "%Y-%m-%dT%H:%M",
        ] {
            if let Ok(dt) = NaiveDateTime::parse_from_str(t, f) {
                return Ok(When::LocalDateTime(dt));
            }
        }
        for f in ["%H:%M:%S%.f", "%H:%M"] {
            if let Ok(tod) = NaiveTime::parse_from_str(t, f) {
                return Ok(When::TimeOfDay(tod));
            }
        }
        if let Ok(d) = humantime::parse_duration(t) {
            return Ok(When::Offset(d));
        }
        Err(format!(
            "`{s}` is not a time; use a time of day as the report shows it (10:02:30, \
             10:02:30.250: the capture's day, local time), a date and time (2024-05-01 \
             10:02:30 local, or RFC 3339 such as 2024-05-01T08:02:30Z), or a duration after \
             the capture's start (90s, +5m)"
        ))
    }

    /// In event time (`CLOCK_MONOTONIC` ns) of the capture; 0 for anything before boot.
    pub fn to_ts_ns(&self, c: &CaptureClock) -> u64 {
        let started = i128::from(c.started_wall_ns);
        let zone = i128::from(c.utc_offset_s) * NS;
        let unix_ns = match self {
            When::Instant { unix_ns } => *unix_ns,
            When::LocalDateTime(dt) => {
                let u = dt.and_utc();
                i128::from(u.timestamp()) * NS + i128::from(u.timestamp_subsec_nanos()) - zone
            }
            When::TimeOfDay(t) => {
                use chrono::Timelike;
                let tod =
                    i128::from(t.num_seconds_from_midnight()) * NS + i128::from(t.nanosecond());
                let day = (started + zone).div_euclid(DAY_NS) * DAY_NS;
                // A capture over midnight: 00:10 is the next day's, 23:50 the day before's.
                (-1..=1)
                    .map(|k| day + k * DAY_NS + tod - zone)
                    .min_by_key(|u| (u - started).abs())
                    .unwrap_or(day + tod - zone)
            }
            When::Offset(d) => started + i128::try_from(d.as_nanos()).unwrap_or(i128::MAX / 2),
        };
        let ts = unix_ns - i128::from(c.boot_to_wall_offset_ns);
        u64::try_from(ts.max(0)).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests;
