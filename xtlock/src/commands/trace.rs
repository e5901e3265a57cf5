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
    commands::{resolve_locks, watch_replaced_locks},
    pipeline::Pipeline,
    probes::{self, preflight, LoadOptions},
    sinks::{JsonSink, Sink, TerminalOptions, TerminalSink, TimeFormat},
    source::{self, live::LiveSource},
};

pub async fn run(args: &TraceArgs) -> anyhow::Result<()> {
    preflight::check()?;
    let locks = resolve_locks(&args.locks)?;
    let probes = probes::Probes::load_with_drops(
        &LoadOptions {
            locks: locks.clone(),
            ring_bytes: args.ring_buffer_mib << 20,
        },
        args.drops.probe_options().as_ref(),
    )?;
    let mut src = LiveSource::new(probes)?;
    let drop_start = if args.drops.no_drops {
        Vec::new()
    } else {
        src.start_drops(args.drops.netns_options())?
    };

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
    for ev in src.seed().iter().chain(&drop_start) {
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
    pipe.finish(source::monotonic_ns())?;
    if src.decode_errors() > 0 {
        tracing::warn!(
            count = src.decode_errors(),
            "events from the kernel could not be decoded"
        );
    }
    // Dropping `src` detaches every program.
    Ok(())
}

/// The local time zone's offset from UTC in seconds (0 when unknown).
fn local_utc_offset_s() -> i32 {
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
