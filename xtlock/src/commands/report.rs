//! `xtlock report FILE`: capture file -> the same analysis and sinks as `trace`. Needs no
//! root and no BPF: it runs on any machine.

use std::io::{self, Write};

use anyhow::Context as _;

use crate::{
    analysis::{Output, Summary},
    cli::ReportArgs,
    pipeline::Pipeline,
    sinks::{
        terminal::{escaped, wall_clock_date},
        JsonSink, Sink, TerminalOptions, TerminalSink, TimeFormat,
    },
    source::file::FileSource,
};

pub fn run(args: &ReportArgs) -> anyhow::Result<()> {
    let mut src = FileSource::open(&args.file)
        .with_context(|| format!("cannot read the capture {}", args.file.display()))?;
    let h = &src.header;
    let stdout = io::BufWriter::new(io::stdout());
    let sink: Box<dyn Sink> = if args.json {
        Box::new(JsonSink::new(stdout))
    } else {
        let mut out = stdout;
        writeln!(
            out,
            "capture of {} (kernel {}, xtlock {}), started {}",
            // A capture may come from anywhere: its strings are escaped like the trace's.
            if h.hostname.is_empty() {
                "?".to_string()
            } else {
                escaped(&h.hostname)
            },
            escaped(&h.kernel_release),
            escaped(&h.xtlock_version),
            wall_clock_date(h.started_wall_ns),
        )?;
        Box::new(TerminalSink::with_options(
            out,
            TerminalOptions {
                min_hold: args.min_hold,
                time: TimeFormat::local_wall_clock(h.boot_to_wall_offset_ns),
                ..Default::default()
            },
        ))
    };
    let sink = if args.events {
        sink
    } else {
        Box::new(SummaryOnly(sink))
    };
    let mut pipe = Pipeline::new(src.locks(), vec![sink]);
    let end = src.for_each(|ev| pipe.feed(ev))?;
    pipe.finish(end.last_ts_ns)?;
    if end.undecoded > 0 {
        tracing::warn!(
            count = end.undecoded,
            "kernel events in the capture could not be decoded and were skipped"
        );
    }
    if let Some(e) = end.cut_short {
        tracing::warn!("{e}; the report covers what was recorded until then");
    }
    if let Some(e) = end.damaged {
        let why = e.stopped_because();
        return Err(anyhow::Error::new(e).context(format!(
            "{} {why}; the report above covers the part before it",
            args.file.display()
        )));
    }
    Ok(())
}

/// Shows only the summary (`report` without `--events`).
struct SummaryOnly(Box<dyn Sink>);

impl Sink for SummaryOnly {
    fn output(&mut self, _o: &Output) -> io::Result<()> {
        Ok(())
    }

    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()> {
        self.0.summary(s, final_)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}
