//! `xtlock trace`: live ring buffer -> analysis -> terminal or JSON Lines on stdout.

use std::io;

use crate::{
    cli::TraceArgs,
    commands::{live, record, resolve_locks},
    pipeline::Pipeline,
    probes::preflight,
    sinks::{JsonSink, Sink, TerminalOptions, TerminalSink, TimeFormat},
    source::{self, live::LiveSource},
};

pub async fn run(args: &TraceArgs) -> anyhow::Result<()> {
    preflight::check()?;
    let mut locks = resolve_locks(&args.locks)?;
    // An unwritable capture path fails before anything is loaded.
    let capture = match &args.record {
        Some(path) => Some(record::create_capture_file(path)?),
        None => None,
    };
    let probes = live::load(&locks, args.ring_buffer_mib, &args.drops)?;
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
    let (start, _) = live::begin(&mut src, &args.drops)?;

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
    let mut pipe = Pipeline::new(live::watched(&locks), vec![sink]);
    pipe.analyzer_mut()
        .set_conntrack_warn_pct(args.drops.conntrack_warn);
    for ev in &start {
        pipe.feed(ev)?;
    }
    let how = if args.duration.is_some() {
        ""
    } else {
        "; Ctrl-C to stop"
    };
    live::announce(&locks, &src, how);

    // JSON carries one summary, last; the terminal gets one every `--summary-interval` too.
    let summary_every =
        (!args.json && !args.summary_interval.is_zero()).then_some(args.summary_interval);
    let summary = live::run(
        &mut src,
        &mut pipe,
        &mut locks,
        args.duration,
        summary_every,
        &mut live::NoHooks,
    )
    .await?;
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
