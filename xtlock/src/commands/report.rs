//! `xtlock report FILE`: capture file -> the same analysis and sinks as `trace`. Needs no
//! root and no BPF: it runs on any machine.

use std::io::{self, Write};

use anyhow::Context as _;

use crate::{
    analysis::{Output, Summary},
    capture::CaptureHeader,
    cli::ReportArgs,
    pipeline::Pipeline,
    sinks::{
        filter::{CaptureClock, When},
        html::HtmlSink,
        terminal::{escaped, local_utc_offset_s, wall_clock_date, wall_clock_label},
        FactFilter, FilterNote, FilteredSink, JsonSink, Sink, TerminalOptions, TerminalSink,
        TimeFormat,
    },
    source::file::FileSource,
};

pub fn run(args: &ReportArgs) -> anyhow::Result<()> {
    let mut src = FileSource::open(&args.file)
        .with_context(|| format!("cannot read the capture {}", args.file.display()))?;
    let h = &src.header;
    let filter = filter_of(args, h)?;
    if let Some(page) = &args.html {
        return html(args, src, filter, page);
    }
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
    // A filter chooses facts to show: asking for one means asking to see them.
    let sink = if args.events || !filter.is_empty() {
        sink
    } else {
        Box::new(SummaryOnly(sink))
    };
    let sink: Box<dyn Sink> = if filter.is_empty() {
        sink
    } else {
        Box::new(FilteredSink::new(sink, filter))
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
    end.warn_damage("report");
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

/// `--html FILE`: the same analysis into one page.
fn html(
    args: &ReportArgs,
    src: FileSource,
    filter: FactFilter,
    page: &std::path::Path,
) -> anyhow::Result<()> {
    super::export::refuse_same_file(&args.file, page, "--html")?;
    let h = &src.header;
    let title = format!(
        "{} (kernel {}), captured {}",
        if h.hostname.is_empty() {
            "?"
        } else {
            h.hostname.as_str()
        },
        h.kernel_release,
        wall_clock_date(h.started_wall_ns)
    );
    let out =
        std::fs::File::create(page).with_context(|| format!("cannot create {}", page.display()))?;
    let sink = HtmlSink::new(
        io::BufWriter::new(out),
        title,
        h.boot_to_wall_offset_ns,
        local_utc_offset_s(),
    );
    let written = super::export::Written {
        capture: &args.file,
        output: page,
        what: "page",
        open: "open it in a browser (it needs no network)",
    };
    written.write(src, Box::new(sink), filter)
}

/// The report's filter: who from the flags, lock files checked against the capture's, and
/// times placed on its clock.
fn filter_of(args: &ReportArgs, h: &CaptureHeader) -> anyhow::Result<FactFilter> {
    let mut f = args.filter.filter();
    for want in &args.lock_files {
        let want = want.display().to_string();
        if !h.locks.iter().any(|l| l.path == want) {
            let known: Vec<String> = h.locks.iter().map(|l| escaped(&l.path)).collect();
            anyhow::bail!(
                "--lock-file {}: the capture watched no such lock file; it watched {}",
                escaped(&want),
                known.join(", ")
            );
        }
        f.locks.push(want);
    }
    let clock = CaptureClock {
        started_wall_ns: h.started_wall_ns,
        boot_to_wall_offset_ns: h.boot_to_wall_offset_ns,
        utc_offset_s: local_utc_offset_s(),
    };
    // Said back as the report's lines show times, so the reader sees where it cut.
    let place = |w: &When| {
        let ts = w.to_ts_ns(&clock);
        let label = wall_clock_label(ts, clock.boot_to_wall_offset_ns, clock.utc_offset_s);
        (ts, label)
    };
    f.since = args.since.as_ref().map(place);
    f.until = args.until.as_ref().map(place);
    if let (Some((s, sl)), Some((u, ul))) = (&f.since, &f.until) {
        if u <= s {
            anyhow::bail!("--until {ul} is not after --since {sl}: nothing could be shown");
        }
    }
    Ok(f)
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

    fn summary_filtered(&mut self, s: &Summary, final_: bool, note: &FilterNote) -> io::Result<()> {
        self.0.summary_filtered(s, final_, note)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}
