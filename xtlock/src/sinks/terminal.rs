//! One line per interesting fact, and a summary table, for people.

use std::fmt;
use std::io::{self, Write};
use std::time::Duration;

mod lines;
mod safe;
mod summary;

use super::{human_bytes, human_ns, Sink};
use crate::analysis::{FailedTryFact, LostFact, Output, Summary};
use lines::*;
pub(crate) use lines::{
    endpoint_programmed_text, hold_drops_text, hold_refusals_text, ipvs_drained_text, ipvs_text,
    mixed_backends_text, refusal_text, rule_change_lines, rule_drops_text,
    stale_endpoint_open_text, table_name, uncounted_drops_text, unserialized_text,
};
#[cfg(test)]
pub(crate) use lines::{hold_text as hold_text_for_test, stall_text as stall_text_for_test};
pub use safe::{escaped, SafeLogWriter};
use safe::{say, SafeLines};
use summary::write_summary;

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
    /// Every line goes out escaped (see safe.rs); the raw writer is not reachable.
    w: SafeLines<W>,
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
            w: SafeLines::new(w),
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
        self.w.into_inner()
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
        say!(self.w, "{p}{text}")
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

/// A fact in words, one line, as `trace` prints it (a rule change's lines joined by `; `);
/// `None` for the facts no line says: failed tries (said by the wait they belong to, or on
/// request), per-backend IPVS counts and rule writes (the summary has their totals).
pub(crate) fn fact_text(o: &Output) -> Option<String> {
    Some(match o {
        Output::Hold(h) => hold_text(h),
        Output::Wait(w) => wait_text(w),
        Output::Timeout(t) => timeout_text(t),
        Output::Exec(e) => exec_text(e),
        Output::Exit(e) => exit_text(e),
        Output::Lost(LostFact {
            bound: Some(b), ..
        }) => format!(
            "!! analysis bound reached ({b}): what goes past it is not tracked; the summary counts every hit"
        ),
        Output::Lost(l) => format!(
            "!! {} events lost (ring buffer full); counts are lower bounds",
            l.count
        ),
        Output::FailedTry(_) | Output::IpvsCount(_) | Output::RuleWrite(_) => return None,
        Output::Drop(d) => drop_text(d),
        Output::DropCount(d) => drop_count_text(d),
        Output::Conntrack(c) => conntrack_text(c),
        Output::HoldDrops(h) => hold_drops_text(h),
        Output::ConntrackRefused(c) => conntrack_refused_text(c),
        Output::Stall(s) => stall_text(s),
        Output::Ipvs(i) => ipvs_text(i),
        // The host's netns is named in the summary; here its number.
        Output::MixedBackends(m) => mixed_backends_text(m, 0),
        Output::Unserialized(u) => unserialized_text(u),
        Output::RuleChange(c) => {
            let lines = rule_change_lines(c);
            if lines.is_empty() {
                return None;
            }
            lines.join("; ")
        }
        Output::RefusalCount(r) => refusal_count_text(r),
        Output::Refusal(r) => refusal_text(r),
        // Said whatever the hold's length: a refused client is never noise.
        Output::HoldRefusals(h) => hold_refusals_text(h),
        Output::StaleEndpointOpen(f) => stale_endpoint_open_text(f),
        Output::StaleEndpoint(f) => stale_endpoint_text(f),
        Output::EndpointProgrammed(f) => endpoint_programmed_text(f),
        Output::IpvsDrained(f) => ipvs_drained_text(f),
        Output::RuleDrops(f) => rule_drops_text(f),
        Output::UncountedDrops(f) => uncounted_drops_text(f),
    })
}

impl<W: Write> Sink for TerminalSink<W> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        if let Output::FailedTry(f) = o {
            if self.opts.show_failed_tries {
                return self.failed_try(f);
            }
            return Ok(());
        }
        // What the options hide; the rest is said as every sink that shows text says it.
        let min_hold = self.opts.min_hold.as_nanos() as u64;
        let shown = match o {
            Output::Hold(h) => h.hold_ns >= min_hold || h.open,
            Output::Exec(_) => self.opts.show_execs,
            // A lock timeout was already told by its own line.
            Output::Exit(e) => self.opts.show_exits && e.code != Some(0) && !e.lock_timeout,
            Output::Drop(_) | Output::Refusal(_) => self.opts.show_drop_samples,
            // Like holds: a hold too short to be shown does not get its drops line either
            // (its interval's drop count line has them); in a lock storm with drops that is
            // a line per hold.
            Output::HoldDrops(h) => h.hold_ns >= min_hold,
            _ => true,
        };
        let text = match o {
            _ if !shown => None,
            Output::RuleChange(c) => {
                let lines = rule_change_lines(c);
                if lines.is_empty() {
                    None
                } else {
                    self.flush_run()?;
                    for l in &lines[..lines.len() - 1] {
                        self.line(c.ts_ns, l)?;
                    }
                    lines.last().cloned()
                }
            }
            _ => fact_text(o),
        };
        if let Some(text) = text {
            self.flush_run()?;
            self.line(o.ts_ns(), &text)?;
        }
        Ok(())
    }

    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()> {
        self.flush_run()?;
        write_summary(&mut self.w, s, final_, None)?;
        self.w.flush()
    }

    fn summary_filtered(
        &mut self,
        s: &Summary,
        final_: bool,
        note: &super::FilterNote,
    ) -> io::Result<()> {
        self.flush_run()?;
        write_summary(&mut self.w, s, final_, Some(note))?;
        self.w.flush()
    }

    fn flush(&mut self) -> io::Result<()> {
        self.flush_run()?;
        self.w.flush()
    }
}

#[cfg(test)]
mod tests;
