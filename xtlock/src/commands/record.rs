//! `xtlock record -o FILE`: live ring buffer -> capture file, with a status line on stderr.
//! The analysis runs too (for the status counts), through the same pipeline as `trace`.

use std::{
    io::{self, IsTerminal, Write},
    path::Path,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Instant,
};

use crate::{
    analysis::{Output, Summary},
    cli::RecordArgs,
    commands::{
        live,
        session::{self, Recording, Session},
    },
    lockfiles::LockFile,
    pipeline::Pipeline,
    sinks::{human_bytes, Sink},
    source::{live::LiveSource, recorder::Progress},
};

pub async fn run(args: &RecordArgs) -> anyhow::Result<()> {
    let progress = Arc::new(Progress::default());
    let Session {
        mut locks,
        mut src,
        start,
        ..
    } = session::open(
        &args.locks,
        args.ring_buffer_mib,
        &args.drops,
        Recording::File(&args.output, progress.clone()),
    )?;

    let counts = Arc::new(Counts::default());
    let mut pipe = Pipeline::new(
        live::watched(&locks),
        vec![Box::new(CountingSink(counts.clone()))],
    );
    pipe.analyzer_mut()
        .set_conntrack_warn_pct(args.drops.conntrack_warn);
    for ev in &start {
        pipe.feed(ev)?;
    }
    let how = format!(
        " into {}{}",
        args.output.display(),
        if args.duration.is_some() {
            ""
        } else {
            "; Ctrl-C to stop"
        }
    );
    live::announce(&locks, &src, &how);

    let mut status = StatusLine {
        tty: io::stderr().is_terminal(),
        shown: 0,
        started: Instant::now(),
        counts,
        progress,
    };
    let summary = live::run(
        &mut src,
        &mut pipe,
        &mut locks,
        args.duration,
        None,
        &mut status,
    )
    .await?;
    status.show(src.recording());
    status.end();
    finish_capture(src, &args.output, &summary)
}

/// Detaches the probes, completes the capture, and says what was written.
pub fn finish_capture(mut src: LiveSource, path: &Path, summary: &Summary) -> anyhow::Result<()> {
    let (recorder, error) = src.take_recorder();
    drop(src); // detach the programs before the (possibly slow) final write
    let stats = match recorder {
        Some(r) => Some(r.finish()?),
        None => None,
    };
    let holds: u64 = summary.holds.values().map(|h| h.count).sum();
    tracing::info!(
        holds,
        lost = summary.lost_events,
        "capture written to {}{}",
        path.display(),
        stats.map(|s| format!(" ({s})")).unwrap_or_default()
    );
    match error {
        Some(e) => Err(e.context(format!(
            "recording into {} stopped early; what was written before the error is readable \
             with `xtlock report`",
            path.display()
        ))),
        None => Ok(()),
    }
}

/// Counts facts for the status line.
#[derive(Default)]
struct Counts {
    holds: AtomicU64,
    waits: AtomicU64,
    timeouts: AtomicU64,
    lost: AtomicU64,
}

struct CountingSink(Arc<Counts>);

impl Sink for CountingSink {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        let c = match o {
            Output::Hold(_) => &self.0.holds,
            Output::Wait(_) => &self.0.waits,
            Output::Timeout(_) => &self.0.timeouts,
            Output::Lost(l) if l.bound.is_none() => {
                self.0.lost.fetch_add(l.count, Ordering::Relaxed);
                return Ok(());
            }
            _ => return Ok(()),
        };
        c.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn summary(&mut self, _s: &Summary, _final: bool) -> io::Result<()> {
        Ok(())
    }
}

/// One line refreshed in place on a terminal; a plain line every 10 s otherwise.
struct StatusLine {
    tty: bool,
    shown: u64,
    started: Instant,
    counts: Arc<Counts>,
    progress: Arc<Progress>,
}

impl live::LiveHooks for StatusLine {
    fn each_second(
        &mut self,
        src: &mut LiveSource,
        _pipe: &mut Pipeline,
        _locks: &[LockFile],
    ) -> anyhow::Result<()> {
        self.show(src.recording());
        Ok(())
    }

    /// A capture that can no longer be written ends the run: `finish_capture` reports the
    /// error (recording on with nothing saved would only look like it works).
    fn should_stop(&self, src: &LiveSource) -> bool {
        !src.recording()
    }
}

impl StatusLine {
    fn show(&mut self, recording: bool) {
        self.shown += 1;
        if !self.tty && self.shown % 10 != 1 {
            return;
        }
        let (c, p) = (&self.counts, &self.progress);
        let secs = self.started.elapsed().as_secs();
        let line =
            format!(
            "{:02}:{:02}:{:02} elapsed, {} events, {} holds, {} waits, {} timeouts, {} lost, {}{}",
            secs / 3600,
            secs / 60 % 60,
            secs % 60,
            p.events.load(Ordering::Relaxed),
            c.holds.load(Ordering::Relaxed),
            c.waits.load(Ordering::Relaxed),
            c.timeouts.load(Ordering::Relaxed),
            c.lost.load(Ordering::Relaxed),
            human_bytes(p.bytes.load(Ordering::Relaxed)),
            if recording { "" } else { " (recording stopped)" },
        );
        let mut err = io::stderr().lock();
        let _ = if self.tty {
            write!(err, "\r\x1b[2K{line}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }

    fn end(&mut self) {
        if self.tty {
            let _ = writeln!(io::stderr());
        }
    }
}
