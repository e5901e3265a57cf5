//! One line per interesting fact, and a summary table, for people.

use std::fmt::{self, Write as _};
use std::io::{self, Write};
use std::time::Duration;

use super::{human_ns, Sink};
use crate::analysis::drops::packet_text;
use crate::analysis::{
    ConntrackFact, ConntrackRefusedFact, DropClass, DropCountFact, DropFact, ExecFact, ExitFact,
    FailedTryFact, HoldDropsFact, HoldFact, HolderRef, IpvsFact, LostFact, Output, Summary,
    TimeoutFact, WaitFact, WaitMode, WaitOutcome,
};
use crate::capture::thousands;

/// The lock almost everyone watches; other paths are named in each line.
const DEFAULT_LOCK: &str = "/run/xtables.lock";

/// How lines are prefixed with their time.
pub enum TimeFormat {
    None,
    /// Seconds since `origin_ns`, or since the first fact shown when `None`.
    Relative {
        origin_ns: Option<u64>,
    },
    /// Any mapping of event time (`CLOCK_MONOTONIC` ns) to a label, e.g. wall-clock time.
    Custom(Box<dyn Fn(u64) -> String + Send>),
}

impl TimeFormat {
    /// Wall clock `HH:MM:SS.mmm`: `realtime_offset_ns` is `CLOCK_REALTIME - CLOCK_MONOTONIC`
    /// and `utc_offset_s` the local time zone's offset (0 for UTC).
    pub fn wall_clock(realtime_offset_ns: i64, utc_offset_s: i32) -> Self {
        TimeFormat::Custom(Box::new(move |ts| {
            wall_clock_label(ts, realtime_offset_ns, utc_offset_s)
        }))
    }
}

impl TimeFormat {
    /// Wall clock in the machine's local time zone.
    pub fn local_wall_clock(realtime_offset_ns: i64) -> Self {
        Self::wall_clock(realtime_offset_ns, local_utc_offset_s())
    }
}

impl Default for TimeFormat {
    fn default() -> Self {
        TimeFormat::Relative { origin_ns: None }
    }
}

impl fmt::Debug for TimeFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TimeFormat::None => f.write_str("None"),
            TimeFormat::Relative { origin_ns } => f
                .debug_struct("Relative")
                .field("origin_ns", origin_ns)
                .finish(),
            TimeFormat::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// `HH:MM:SS.mmm` of a monotonic timestamp.
pub fn wall_clock_label(ts_ns: u64, realtime_offset_ns: i64, utc_offset_s: i32) -> String {
    let unix_ns = i128::from(ts_ns)
        + i128::from(realtime_offset_ns)
        + i128::from(utc_offset_s) * 1_000_000_000;
    let day_ns = unix_ns.rem_euclid(86_400 * 1_000_000_000);
    let ms = day_ns / 1_000_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

/// `YYYY-MM-DD HH:MM:SS UTC` of Unix-epoch nanoseconds.
pub fn wall_clock_date(unix_ns: u64) -> String {
    let secs = (unix_ns / 1_000_000_000) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The local time zone's offset from UTC in seconds (0 when unknown).
pub fn local_utc_offset_s() -> i32 {
    // SAFETY: localtime_r writes into our own `tm`; `now` is a valid time_t.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return 0;
        }
        i32::try_from(tm.tm_gmtoff).unwrap_or(0)
    }
}

/// What the terminal shows.
#[derive(Debug)]
pub struct TerminalOptions {
    /// Holds shorter than this are not printed (they still count in the summary).
    pub min_hold: Duration,
    pub show_execs: bool,
    /// Exits of iptables-family processes with a non-zero status.
    pub show_exits: bool,
    pub show_failed_tries: bool,
    /// Each sampled drop on its own line (counts are always shown, with an example).
    pub show_drop_samples: bool,
    pub time: TimeFormat,
}

impl Default for TerminalOptions {
    fn default() -> Self {
        TerminalOptions {
            min_hold: Duration::ZERO,
            show_execs: true,
            show_exits: true,
            show_failed_tries: true,
            show_drop_samples: false,
            time: TimeFormat::default(),
        }
    }
}

/// A run of failed tries by one pid, shown as its first line and a count.
#[derive(Debug)]
struct FailedRun {
    pid: u32,
    lock: String,
    agent: String,
    more: u64,
    first_ns: u64,
    last_ns: u64,
}

/// Human-readable lines on a writer.
pub struct TerminalSink<W: Write> {
    w: W,
    opts: TerminalOptions,
    origin: Option<u64>,
    run: Option<FailedRun>,
}

impl<W: Write> TerminalSink<W> {
    pub fn new(w: W) -> Self {
        Self::with_options(w, TerminalOptions::default())
    }

    pub fn with_options(w: W, opts: TerminalOptions) -> Self {
        let origin = match opts.time {
            TimeFormat::Relative { origin_ns } => origin_ns,
            _ => None,
        };
        TerminalSink {
            w,
            opts,
            origin,
            run: None,
        }
    }

    /// Relative times count from here (e.g. the analysis' first event).
    pub fn set_origin(&mut self, ts_ns: u64) {
        self.origin = Some(ts_ns);
    }

    pub fn into_inner(self) -> W {
        self.w
    }

    fn prefix(&mut self, ts: u64) -> String {
        match &self.opts.time {
            TimeFormat::None => String::new(),
            TimeFormat::Relative { .. } => {
                let origin = *self.origin.get_or_insert(ts);
                let d = ts.saturating_sub(origin);
                format!("{:>4}.{:03} ", d / 1_000_000_000, d / 1_000_000 % 1000)
            }
            TimeFormat::Custom(f) => format!("{} ", f(ts)),
        }
    }

    fn line(&mut self, ts: u64, text: &str) -> io::Result<()> {
        let p = self.prefix(ts);
        writeln!(self.w, "{p}{text}")
    }

    fn flush_run(&mut self) -> io::Result<()> {
        if let Some(r) = self.run.take() {
            if r.more > 0 {
                let text = format!(
                    "{}: {} more failed tries by pid {} in {}{}",
                    r.agent,
                    r.more,
                    r.pid,
                    human_ns(r.last_ns.saturating_sub(r.first_ns)),
                    on_lock(&r.lock)
                );
                self.line(r.last_ns, &text)?;
            }
        }
        Ok(())
    }

    fn failed_try(&mut self, f: &FailedTryFact) -> io::Result<()> {
        if let Some(r) = &mut self.run {
            if r.pid == f.pid && r.lock == f.lock {
                r.more += 1;
                r.last_ns = f.ts_ns;
                return Ok(());
            }
        }
        self.flush_run()?;
        let held = match &f.holder {
            Some(h) => format!(", held by {}", holder_text(h)),
            None => String::new(),
        };
        let text = format!(
            "{} failed to take {} (pid {} {}{}, errno {}){}",
            f.agent,
            f.lock,
            f.pid,
            f.comm,
            in_pod(&f.pod),
            f.errno,
            held
        );
        self.line(f.ts_ns, &text)?;
        self.run = Some(FailedRun {
            pid: f.pid,
            lock: f.lock.to_string(),
            agent: f.agent.to_string(),
            more: 0,
            first_ns: f.ts_ns,
            last_ns: f.ts_ns,
        });
        Ok(())
    }
}

fn on_lock(lock: &str) -> String {
    if lock == DEFAULT_LOCK {
        String::new()
    } else {
        format!(" on {lock}")
    }
}

fn holder_text(h: &HolderRef) -> String {
    let what = if h.cmdline.is_empty() {
        &h.comm
    } else {
        &h.cmdline
    };
    if what.is_empty() || *what == h.agent {
        format!("{} (pid {}{})", h.agent, h.pid, in_pod(&h.pod))
    } else {
        format!("{} ({}{})", h.agent, what, in_pod(&h.pod))
    }
}

/// `, in pod NAMESPACE/POD/CONTAINER` for a process in a pod the kubelet named.
fn in_pod(pod: &Option<std::sync::Arc<crate::kube::PodName>>) -> String {
    pod.as_ref()
        .map_or_else(String::new, |p| format!(", in pod {p}"))
}

fn hold_text(h: &HoldFact) -> String {
    let what = if h.cmdline.is_empty() {
        &h.comm
    } else {
        &h.cmdline
    };
    let mut s = format!(
        "{} held {} {}{} (pid {} {}{})",
        h.agent,
        h.lock,
        if h.before_start { "at least " } else { "" },
        human_ns(h.hold_ns),
        h.pid,
        what,
        in_pod(&h.pod)
    );
    if h.before_start {
        s.push_str(", held already when tracing began");
    }
    if h.replaces > 0 {
        let _ = write!(
            s,
            ", {} in {} table replace{}",
            human_ns(h.kernel_ns),
            h.replaces,
            if h.replaces == 1 { "" } else { "s" }
        );
        if h.swap_ns > 0 {
            let _ = write!(
                s,
                " ({} swapping tables, waiting for every CPU)",
                human_ns(h.swap_ns)
            );
        }
    }
    if h.open {
        s.push_str(" [still held when tracing ended]");
    } else if h.incomplete {
        s.push_str(" [release not seen; end inferred]");
    }
    s
}

/// Whom a wait was behind, and for how long: ` behind X (...)` when one holder accounts
/// for all of it, else `: 1.00 s behind X (...), 70 ms behind Y (...)`, holders grouped by
/// agent in the order they held the lock.
fn behind_text(w: &WaitFact) -> String {
    // (agent, time behind it, its first holder, processes)
    let mut groups: Vec<(&str, u64, &HolderRef, usize)> = Vec::new();
    for h in &w.holders {
        let ns = h.behind_ns.unwrap_or(0);
        match groups.iter_mut().find(|g| g.0 == h.agent.as_str()) {
            Some(g) => {
                g.1 += ns;
                g.3 += 1;
            }
            None => groups.push((&h.agent, ns, h, 1)),
        }
    }
    let mut parts: Vec<String> = Vec::new();
    if w.unknown_ns > 0 || groups.is_empty() {
        parts.push(format!(
            "{} behind an unknown holder",
            human_ns(w.unknown_ns)
        ));
    }
    for (agent, ns, first, n) in &groups {
        let who = if *n == 1 {
            holder_text(first)
        } else {
            format!("{agent} ({n} processes)")
        };
        parts.push(format!("{} behind {who}", human_ns(*ns)));
    }
    if w.other_holders > 0 {
        parts.push(format!(
            "{} behind {} more",
            human_ns(w.other_holders_ns),
            w.other_holders
        ));
    }
    // A poller's interval after a release; a woken waiter's few µs are not worth a word.
    if w.free_ns >= 1_000_000 || w.free_ns * 20 > w.wait_ns {
        parts.push(format!("{} with the lock free", human_ns(w.free_ns)));
    }
    match (parts.len(), groups.first()) {
        // One holder for the whole wait: its time is the wait's.
        (1, Some((_, _, first, 1))) => format!(" behind {}", holder_text(first)),
        (1, Some((agent, _, _, n))) => format!(" behind {agent} ({n} processes)"),
        (1, None) => " behind an unknown holder".to_string(),
        _ => format!(": {}", parts.join(", ")),
    }
}

fn wait_text(w: &WaitFact) -> String {
    let behind = behind_text(w);
    let d = human_ns(w.wait_ns);
    let mut s = match w.outcome {
        WaitOutcome::Acquired => format!("{} waited {d}{behind}", w.agent),
        WaitOutcome::TimedOut => format!("{} gave up after {d} waiting{behind}", w.agent),
        WaitOutcome::Abandoned => format!("{} exited after waiting {d}{behind}", w.agent),
        WaitOutcome::Open => format!("{} still waiting after {d}{behind}", w.agent),
    };
    s.push_str(&on_lock(&w.lock));
    let _ = write!(s, " [pid {} {}{}", w.pid, w.comm, in_pod(&w.pod));
    if w.mode == WaitMode::Poll {
        let _ = write!(s, ", polled: {} failed tries", w.tries);
    }
    s.push(']');
    s
}

fn timeout_text(t: &TimeoutFact) -> String {
    let held = if t.holders.is_empty() {
        "holder unknown".to_string()
    } else {
        format!(
            "held by {}",
            t.holders
                .iter()
                .map(|h| h.agent.as_str())
                .collect::<Vec<_>>()
                .join(", then ")
        )
    };
    let how = if t.tries <= 1 && t.waited_ns < 1_000_000 {
        // One LOCK_NB try: iptables without -w.
        "found the lock taken and gave up".to_string()
    } else {
        format!(
            "gave up waiting for the lock after {}",
            human_ns(t.waited_ns)
        )
    };
    format!(
        "{}: {} (pid {}{}) {how} (exit {}){}, {held}",
        t.agent,
        t.comm,
        t.pid,
        in_pod(&t.pod),
        t.exit_code,
        on_lock(&t.lock)
    )
}

fn exec_text(e: &ExecFact) -> String {
    let what = if e.cmdline.is_empty() {
        &e.filename
    } else {
        &e.cmdline
    };
    format!(
        "exec {what} (pid {}) by {} (pid {})",
        e.pid, e.agent, e.agent_pid
    )
}

fn exit_text(e: &ExitFact) -> String {
    let status = match e.code {
        Some(c) => format!("status {c}"),
        None => "killed by a signal".to_string(),
    };
    let after = match e.runtime_ns {
        Some(r) => format!(" after {}", human_ns(r)),
        None => String::new(),
    };
    format!(
        "exit {} (pid {}) {status}{after}, run by {}",
        e.comm, e.pid, e.agent
    )
}

fn class_text(class: DropClass, reason: &str) -> String {
    match class {
        DropClass::Other => reason.to_string(),
        c => c.describe().to_string(),
    }
}

fn during(holds: &[crate::analysis::HoldRef]) -> String {
    match holds.first() {
        None => String::new(),
        Some(h) => {
            let more = if holds.len() > 1 {
                format!(" (and {} more)", holds.len() - 1)
            } else {
                String::new()
            };
            format!(", while {} held {}{more}", h.agent, h.lock)
        }
    }
}

fn drop_count_text(d: &DropCountFact) -> String {
    let what = match d.class {
        DropClass::Other => format!("{} at {}", d.reason, d.location),
        c => format!("{} ({} at {})", c.describe(), d.reason, d.location),
    };
    let mut s = format!(
        "{} packet{} dropped in {}: {what}, netns {}",
        thousands(d.count),
        if d.count == 1 { "" } else { "s" },
        human_ns(d.interval_ns),
        d.netns
    );
    if let Some(p) = &d.example {
        let _ = write!(s, ", e.g. {}", packet_text(p));
    }
    s.push_str(&during(&d.holds));
    s
}

fn drop_text(d: &DropFact) -> String {
    let mut s = format!(
        "drop {} at {} ({}), netns {}",
        d.reason,
        d.location,
        class_text(d.class, &d.reason),
        d.netns
    );
    if let Some(p) = &d.packet {
        let _ = write!(s, ": {}", packet_text(p));
    }
    if let Some(h) = &d.hold {
        let _ = write!(s, ", while {} held {}", h.agent, h.lock);
    }
    s
}

fn conntrack_refused_text(c: &ConntrackRefusedFact) -> String {
    let mut s = format!(
        "{} in {}, netns {}",
        c.class.describe(),
        c.function,
        c.netns
    );
    if let Some(p) = &c.packet {
        let _ = write!(s, ": {}", packet_text(p));
    }
    if !c.comm.is_empty() {
        let _ = write!(s, " (running: {}[{}])", c.comm, c.pid);
    }
    if let Some(h) = &c.hold {
        let _ = write!(s, ", while {} held {}", h.agent, h.lock);
    }
    s
}

fn conntrack_text(c: &ConntrackFact) -> String {
    let d = &c.deltas;
    let mut parts = Vec::new();
    for (n, what) in [
        (d.drop, "dropped (table full)"),
        (d.insert_failed, "insert failed (race)"),
        (d.early_drop, "early drops"),
        (d.invalid, "invalid"),
        (d.search_restart, "search restarts"),
        (d.clash_resolve, "clashes resolved"),
        (d.chaintoolong, "chains too long"),
    ] {
        if n > 0 {
            parts.push(format!("{} {what}", thousands(n)));
        }
    }
    let mut s = match &c.warning {
        Some(w) => format!("!! {w} in netns {}", c.netns),
        None => format!("conntrack in netns {}", c.netns),
    };
    if !parts.is_empty() {
        let _ = write!(s, ": {} in {}", parts.join(", "), human_ns(c.interval_ns));
    }
    if c.max > 0 && c.warning.is_none() {
        let _ = write!(
            s,
            "; table {}% full ({} of {})",
            c.fill_pct, c.entries, c.max
        );
    }
    s.push_str(&during(&c.holds));
    s
}

pub(crate) fn hold_drops_text(h: &HoldDropsFact) -> String {
    // What the drops were, from the samples inside the hold: one kind is named, several are
    // counted as sampled.
    let classes: Vec<String> = h
        .by_class
        .iter()
        .map(|(c, n)| {
            let what = if *c == DropClass::Other {
                let reasons: Vec<&str> = h
                    .by_reason
                    .keys()
                    .filter(|r| *r != "NETFILTER_DROP")
                    .map(String::as_str)
                    .collect();
                format!("other: {}", reasons.join(", "))
            } else {
                c.describe().to_string()
            };
            if h.by_class.len() == 1 {
                what
            } else {
                format!("{} {what}", thousands(*n))
            }
        })
        .collect();
    let kinds = match classes.len() {
        0 => String::new(),
        1 => format!(" ({})", classes[0]),
        _ => format!(" (sampled: {})", classes.join(", ")),
    };
    format!(
        "!! {} packet{} dropped{kinds} during {}'s {} hold of {} (pid {})",
        thousands(h.dropped),
        if h.dropped == 1 { "" } else { "s" },
        h.agent,
        human_ns(h.hold_ns),
        h.lock,
        h.pid
    )
}

impl<W: Write> Sink for TerminalSink<W> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        if let Output::FailedTry(f) = o {
            if self.opts.show_failed_tries {
                return self.failed_try(f);
            }
            return Ok(());
        }
        let text =
            match o {
                Output::Hold(h) => (h.hold_ns >= self.opts.min_hold.as_nanos() as u64 || h.open)
                    .then(|| hold_text(h)),
                Output::Wait(w) => Some(wait_text(w)),
                Output::Timeout(t) => Some(timeout_text(t)),
                Output::Exec(e) => self.opts.show_execs.then(|| exec_text(e)),
                // A lock timeout was already told by its own line.
                Output::Exit(e) => (self.opts.show_exits && e.code != Some(0) && !e.lock_timeout)
                    .then(|| exit_text(e)),
                Output::Lost(LostFact {
                    bound: Some(b), ..
                }) => Some(format!(
                    "!! analysis bound reached ({b}): what goes past it is not tracked; the summary counts every hit"
                )),
                Output::Lost(l) => Some(format!(
                    "!! {} events lost (ring buffer full); counts are lower bounds",
                    l.count
                )),
                Output::FailedTry(_) => None,
                Output::Drop(d) => self.opts.show_drop_samples.then(|| drop_text(d)),
                Output::DropCount(d) => Some(drop_count_text(d)),
                Output::Conntrack(c) => Some(conntrack_text(c)),
                // Like holds: a hold too short to be shown does not get its drops line
                // either (its interval's drop count line has them); in a lock storm with
                // drops that is a line per hold.
                Output::HoldDrops(h) => {
                    (h.hold_ns >= self.opts.min_hold.as_nanos() as u64).then(|| hold_drops_text(h))
                }
                Output::ConntrackRefused(c) => Some(conntrack_refused_text(c)),
                Output::Ipvs(i) => Some(ipvs_text(i)),
                // Per second and per backend: too many lines; the summary has the totals.
                Output::IpvsCount(_) => None,
            };
        if let Some(text) = text {
            self.flush_run()?;
            self.line(o.ts_ns(), &text)?;
        }
        Ok(())
    }

    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()> {
        self.flush_run()?;
        write_summary(&mut self.w, s, final_)?;
        self.w.flush()
    }

    fn flush(&mut self) -> io::Result<()> {
        self.flush_run()?;
        self.w.flush()
    }
}

fn write_summary(w: &mut impl Write, s: &Summary, final_: bool) -> io::Result<()> {
    writeln!(w)?;
    writeln!(
        w,
        "== {} ({} traced, {} events) ==",
        if final_ { "summary" } else { "summary so far" },
        human_ns(s.duration_ns),
        s.events
    )?;
    for l in &s.locks {
        // A lock file has a device and inode; the nf_tables commit lock has neither.
        let file = if l.dev == 0 && l.ino == 0 {
            String::new()
        } else {
            format!(" (dev {}:{} ino {})", l.dev >> 20, l.dev & 0xf_ffff, l.ino)
        };
        writeln!(
            w,
            "lock {}{file}: {} holds, {} held in all, longest {}; {} waits",
            l.path,
            l.holds,
            human_ns(l.held_ns),
            human_ns(l.max_hold_ns),
            l.waits
        )?;
    }
    for (title, table) in [("holds by agent", &s.holds), ("waits by agent", &s.waits)] {
        if table.is_empty() {
            continue;
        }
        writeln!(w, "\n{title}:")?;
        let width = table
            .keys()
            .map(|k| k.chars().count())
            .max()
            .unwrap_or(0)
            .max(5);
        writeln!(
            w,
            "  {:<width$} {:>7} {:>9} {:>9} {:>9} {:>9}",
            "agent", "count", "p50", "p99", "max", "total"
        )?;
        for (agent, d) in table {
            writeln!(
                w,
                "  {:<width$} {:>7} {:>9} {:>9} {:>9} {:>9}",
                agent,
                d.count,
                human_ns(d.p50_ns),
                human_ns(d.p99_ns),
                human_ns(d.max_ns),
                human_ns(d.total_ns)
            )?;
        }
    }
    if !s.contention.is_empty() {
        writeln!(w, "\nwho waited behind whom:")?;
        let pairs: Vec<String> = s
            .contention
            .iter()
            .map(|c| format!("{} <- {}", c.waiter, c.holder))
            .collect();
        let width = pairs
            .iter()
            .map(|p| p.chars().count())
            .max()
            .unwrap_or(0)
            .max(15);
        writeln!(
            w,
            "  {:<width$} {:>7} {:>9} {:>9}",
            "waiter <- holder", "waits", "total", "max"
        )?;
        for (c, pair) in s.contention.iter().zip(&pairs) {
            writeln!(
                w,
                "  {:<width$} {:>7} {:>9} {:>9}",
                pair,
                c.count,
                human_ns(c.total_wait_ns),
                human_ns(c.max_wait_ns)
            )?;
        }
    }
    for (title, m) in [
        ("failed tries", &s.failed_tries),
        ("lock timeouts (exit 4)", &s.timeouts),
        ("exit 4 without lock trouble", &s.exit4_without_lock),
        ("iptables execs", &s.execs),
    ] {
        if m.is_empty() {
            continue;
        }
        let list: Vec<String> = m.iter().map(|(a, n)| format!("{a} {n}")).collect();
        writeln!(w, "{title}: {}", list.join(", "))?;
    }
    if s.holds.is_empty() && s.waits.is_empty() {
        writeln!(w, "no lock activity seen")?;
    }
    if s.lost_events > 0 {
        writeln!(
            w,
            "!! {} events lost: the ring buffer was full; counts are lower bounds",
            s.lost_events
        )?;
    }
    write_drops(w, s)?;
    write_ipvs(w, s)
}

/// One IPVS fact, e.g. "ipvs udp 10.96.0.10:53: endpoint 10.0.1.5:53 removed at T by
/// ipvsadm[812]; 37 packets from 10.0.0.9:40000 still sent there (dropped by the kernel)
/// until T+4.20 s; entry expired at T+9.31 s".
pub(crate) fn ipvs_text(f: &IpvsFact) -> String {
    let head = format!("ipvs {} {}", f.protocol, f.service);
    let who = |pid: Option<u32>, comm: &Option<String>| match (pid, comm) {
        (Some(p), Some(c)) => format!("{c}[{p}]"),
        _ => "?".into(),
    };
    let failed = match f.ret {
        Some(r) if r != 0 => format!(" (failed: errno {})", -r),
        _ => String::new(),
    };
    let client = f.client.as_deref().unwrap_or("?");
    match f.event {
        "scheduled" => format!(
            "{head}: {client} scheduled to {} (weight {})",
            f.backend, f.weight
        ),
        "dest_added" => format!(
            "{head}: endpoint {} added (weight {}) by {}{failed}",
            f.backend,
            f.weight,
            who(f.pid, &f.comm)
        ),
        "dest_removed" => format!(
            "{head}: endpoint {} removed by {}{failed}",
            f.backend,
            who(f.pid, &f.comm)
        ),
        "dest_edited" => format!(
            "{head}: endpoint {} weight set to {} by {}{failed}",
            f.backend,
            f.weight,
            who(f.pid, &f.comm)
        ),
        "service_added" | "service_edited" | "service_removed" => format!(
            "{head}: virtual service {} by {}{failed}",
            &f.event[8..],
            who(f.pid, &f.comm)
        ),
        "stale" => {
            let what = match f.backend_state {
                Some("removed") => "removed",
                _ => "set to weight 0",
            };
            let mut s = format!(
                "!! {head}: packets from {client} still go to endpoint {} ({what}{}), {}",
                f.backend,
                f.change
                    .as_ref()
                    .map(|c| format!(
                        " {} ago by {}[{}]",
                        human_ns(f.ts_ns.saturating_sub(c.ts_ns)),
                        c.comm,
                        c.pid
                    ))
                    .unwrap_or_default(),
                action_text(f.action)
            );
            if let Some(left) = f.entry_left_ns {
                let _ = write!(s, "; connection entry expires in {}", human_ns(left));
            }
            s
        }
        _ => {
            // stale_end: told from the change (T) when it was seen.
            let t0 = f.change.as_ref().map_or(f.ts_ns, |c| c.ts_ns);
            let what = match f.backend_state {
                Some("removed") => "removed",
                _ => "set to weight 0",
            };
            let mut s = match &f.change {
                Some(c) => format!(
                    "{head}: endpoint {} {what} at T by {}[{}]; ",
                    f.backend, c.comm, c.pid
                ),
                None => format!("{head}: endpoint {} {what}; ", f.backend),
            };
            let packets = f.packets.unwrap_or(0);
            let _ = write!(
                s,
                "{} packet{} from {client} still sent there ({}) until T+{}",
                thousands(packets),
                if packets == 1 { "" } else { "s" },
                action_text(f.action),
                human_ns(f.last_packet_ns.unwrap_or(t0).saturating_sub(t0))
            );
            match f.expired_ns {
                Some(x) => {
                    let _ = write!(s, "; entry expired at T+{}", human_ns(x.saturating_sub(t0)));
                }
                None => s.push_str("; entry still there when tracing stopped"),
            }
            s
        }
    }
}

fn action_text(a: Option<crate::decode::StaleAction>) -> &'static str {
    use crate::decode::StaleAction;
    match a {
        Some(StaleAction::Forwarded) => "forwarded by the kernel",
        Some(StaleAction::Dropped) => "dropped by the kernel",
        Some(StaleAction::Expired) => "entry expired by the kernel, packet rescheduled",
        _ => "?",
    }
}

fn write_ipvs(w: &mut impl Write, s: &Summary) -> io::Result<()> {
    if s.ipvs.is_empty() {
        return Ok(());
    }
    writeln!(
        w,
        "
ipvs backends:"
    )?;
    writeln!(
        w,
        "  {:<5} {:<22} {:<22} {:>11} {:>11} {:>11}",
        "proto", "service", "backend", "connections", "packets", "stale"
    )?;
    for r in &s.ipvs {
        writeln!(
            w,
            "  {:<5} {:<22} {:<22} {:>11} {:>11} {:>11}",
            r.protocol,
            r.service,
            r.backend,
            thousands(r.counts.connections),
            thousands(r.counts.packets),
            thousands(r.counts.stale_packets)
        )?;
    }
    Ok(())
}

fn write_drops(w: &mut impl Write, s: &Summary) -> io::Result<()> {
    let d = &s.drops;
    let ct = &d.conntrack;
    if d.total == 0 && ct.is_zero() && d.conntrack_max_fill_pct == 0 {
        return Ok(());
    }
    writeln!(w, "\npacket drops: {} in all", thousands(d.total))?;
    let netns = |n: u32| {
        if n != 0 && n == s.host_netns {
            "host".to_string()
        } else {
            n.to_string()
        }
    };
    let list = |m: Vec<(String, u64)>| -> String {
        let mut m = m;
        m.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        m.iter()
            .take(8)
            .map(|(k, n)| format!("{k} {}", thousands(*n)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (title, items) in [
        (
            "by cause",
            d.by_class
                .iter()
                .map(|(c, n)| (c.describe().to_string(), *n))
                .collect::<Vec<_>>(),
        ),
        (
            "by reason",
            d.by_reason.iter().map(|(k, n)| (k.clone(), *n)).collect(),
        ),
        (
            "by location",
            d.by_location.iter().map(|(k, n)| (k.clone(), *n)).collect(),
        ),
        (
            "by netns",
            d.by_netns.iter().map(|(k, n)| (netns(*k), *n)).collect(),
        ),
    ] {
        if !items.is_empty() {
            writeln!(w, "  {title}: {}", list(items))?;
        }
    }
    writeln!(
        w,
        "  {} during lock holds; {} sampled",
        thousands(d.during_holds),
        thousands(d.samples)
    )?;
    for h in &d.worst_holds {
        writeln!(w, "  {}", hold_drops_text(h).trim_start_matches("!! "))?;
    }
    if d.overflow > 0 {
        writeln!(
            w,
            "  !! {} drops counted without reason or place (the kernel's key map was full)",
            thousands(d.overflow)
        )?;
    }
    if !ct.is_zero() || d.conntrack_max_fill_pct > 0 {
        writeln!(
            w,
            "conntrack: {} dropped (table full), {} insert failed, {} early drops, {} invalid; \
             fullest table {}%{}",
            thousands(ct.drop),
            thousands(ct.insert_failed),
            thousands(ct.early_drop),
            thousands(ct.invalid),
            d.conntrack_max_fill_pct,
            if d.conntrack_warnings > 0 {
                format!(" ({} warnings)", d.conntrack_warnings)
            } else {
                String::new()
            }
        )?;
    }
    if !d.conntrack_refused.is_empty() {
        let parts: Vec<String> = d
            .conntrack_refused
            .iter()
            .map(|(c, n)| format!("{} {}", thousands(*n), c.describe()))
            .collect();
        writeln!(
            w,
            "conntrack refused (seen in its own functions): {}",
            parts.join(", ")
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
