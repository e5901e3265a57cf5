//! `xtlock trace`: live ring buffer -> analysis -> terminal or JSON Lines on stdout.

use std::{io, time::Duration};

use anyhow::Context as _;
use tokio::{
    signal::unix::{signal, SignalKind},
    time::{interval, MissedTickBehavior},
};

use crate::{
    analysis::WatchedLock,
    cli::TraceArgs,
    commands::{record, resolve_locks, watch_replaced_locks},
    pipeline::Pipeline,
    probes::{self, preflight, LoadOptions},
    sinks::{JsonSink, Sink, TerminalOptions, TerminalSink, TimeFormat},
    source::{self, live::LiveSource},
};

pub async fn run(args: &TraceArgs) -> anyhow::Result<()> {
    preflight::check()?;
    let locks = resolve_locks(&args.locks)?;
    let capture = match &args.record {
        Some(path) => Some(record::create_capture_file(path)?),
        None => None,
    };
    let probes = probes::Probes::load_with_drops(
        &LoadOptions {
            locks: locks.clone(),
            ring_bytes: args.ring_buffer_mib << 20,
        },
        args.drops.probe_options().as_ref(),
    )?;
    let recorder = match (capture, &args.record) {
        (Some(file), Some(path)) => Some(record::start_capture(
            file,
            path,
            &locks,
            &probes.status,
            Default::default(),
        )?),
        _ => None,
    };
    let mut src = LiveSource::new(probes)?;
    if let Some(r) = recorder {
        src.set_recorder(r);
    }
    // The process snapshot first, then the drop setup: the order the pipeline is fed, so a
    // capture replays in the same order.
    let mut start = src.seed();
    if !args.drops.no_drops {
        start.extend(src.start_drops(args.drops.netns_options())?);
    }

    let stdout = io::BufWriter::new(io::stdout());
    let sink: Box<dyn Sink> = if args.json {
        Box::new(JsonSink::new(stdout))
    } else {
        let offset = i64::try_from(source::wall_offset_ns()).unwrap_or(0);
        Box::new(TerminalSink::with_options(
            stdout,
            TerminalOptions {
                min_hold: args.min_hold,
                time: TimeFormat::wall_clock(offset, local_utc_offset_s()),
                ..Default::default()
            },
        ))
    };
    let watched: Vec<WatchedLock> = locks
        .iter()
        .map(|l| WatchedLock::new(l.path.display().to_string(), l.dev, l.ino))
        .collect();
    let mut pipe = Pipeline::new(watched, vec![sink]);
    pipe.analyzer_mut()
        .set_conntrack_warn_pct(args.drops.conntrack_warn);
    for ev in &start {
        pipe.feed(ev)?;
    }

    let names: Vec<String> = locks.iter().map(|l| l.path.display().to_string()).collect();
    let attached = src.probes.status.iter().filter(|s| s.attached()).count();
    tracing::info!(
        "tracing {} ({attached}/{} hooks attached){}",
        names.join(", "),
        src.probes.status.len(),
        if args.duration.is_some() {
            ""
        } else {
            "; Ctrl-C to stop"
        }
    );

    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let deadline = tokio::time::sleep(args.duration.unwrap_or(Duration::MAX / 4));
    tokio::pin!(deadline);
    let mut each_second = interval(Duration::from_secs(1));
    each_second.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let summary_every = if args.summary_interval.is_zero() || args.json {
        Duration::MAX / 4
    } else {
        args.summary_interval
    };
    let mut summaries = interval(summary_every);
    summaries.set_missed_tick_behavior(MissedTickBehavior::Delay);
    summaries.tick().await;
    let mut ticks = 0u64;
    let mut locks = locks;
    let mut batch = Vec::with_capacity(4096);

    loop {
        tokio::select! {
            r = src.next_batch(&mut batch) => {
                r.context("reading the ring buffer")?;
                for ev in batch.drain(..) {
                    pipe.feed(&ev)?;
                }
                pipe.flush()?;
            }
            _ = each_second.tick() => {
                if let Some(lost) = src.poll_lost() {
                    pipe.feed(&lost)?;
                }
                for ev in src.poll_drops() {
                    pipe.feed(&ev)?;
                }
                src.flush_recorder();
                ticks += 1;
                if ticks.is_multiple_of(5) {
                    watch_replaced_locks(&mut locks, &mut src.probes);
                }
            }
            _ = summaries.tick() => pipe.periodic_summary()?,
            _ = &mut deadline => break,
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
        }
    }

    src.drain(&mut batch);
    for ev in batch.drain(..) {
        pipe.feed(&ev)?;
    }
    if let Some(lost) = src.poll_lost() {
        pipe.feed(&lost)?;
    }
    for ev in src.poll_drops() {
        pipe.feed(&ev)?;
    }
    let summary = pipe.finish(source::monotonic_ns())?;
    if src.decode_errors() > 0 {
        tracing::warn!(
            count = src.decode_errors(),
            "events from the kernel could not be decoded"
        );
    }
    match &args.record {
        Some(path) => record::finish_capture(src, path, &summary),
        // Dropping `src` detaches every program.
        None => Ok(()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(wall_clock_date(0), "1970-01-01 00:00:00 UTC");
        // 2026-11-22 00:30:05 UTC
        assert_eq!(
            wall_clock_date(1_795_307_405 * 1_000_000_000),
            "2026-11-22 00:30:05 UTC"
        );
        assert_eq!(
            wall_clock_date(951_782_400 * 1_000_000_000),
            "2000-02-29 00:00:00 UTC"
        );
    }
}
