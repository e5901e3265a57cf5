//! `xtlock trace`: live ring buffer -> analysis -> terminal or JSON Lines on stdout.

use std::io;

use crate::{
    cli::TraceArgs,
    commands::{
        live, record,
        session::{self, Recording, Session},
    },
    pipeline::Pipeline,
    sinks::{FilteredSink, JsonSink, Sink, TerminalOptions, TerminalSink, TimeFormat},
    source,
};

pub async fn run(args: &TraceArgs) -> anyhow::Result<()> {
    let recording = match &args.record {
        Some(path) => Recording::File(path, Default::default()),
        None => Recording::None,
    };
    let Session {
        mut locks,
        mut src,
        start,
        ..
    } = session::open(&args.locks, args.ring_buffer_mib, &args.drops, recording)?;

    let stdout = io::BufWriter::new(io::stdout());
    let sink: Box<dyn Sink> = if args.json {
        Box::new(JsonSink::new(stdout))
    } else {
        let offset = i64::try_from(source::wall_offset_ns()).unwrap_or(0);
        Box::new(TerminalSink::with_options(
            stdout,
            TerminalOptions {
                min_hold: args.min_hold,
                time: TimeFormat::local_wall_clock(offset),
                ..Default::default()
            },
        ))
    };
    // Only what is shown is filtered: the recording (made by the source) keeps everything.
    let filter = args.filter.filter();
    let sink: Box<dyn Sink> = if filter.is_empty() {
        sink
    } else {
        Box::new(FilteredSink::new(sink, filter))
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
