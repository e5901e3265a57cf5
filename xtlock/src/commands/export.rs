//! `xtlock export FILE --format perfetto -o trace.json`: capture file -> timeline.

use std::{fs::File, io::BufWriter, path::Path};

use anyhow::Context as _;

use crate::{
    cli::{ExportArgs, ExportFormat},
    pipeline::Pipeline,
    sinks::{FactFilter, FilteredSink, PerfettoSink, Sink},
    source::file::FileSource,
};

pub fn run(args: &ExportArgs) -> anyhow::Result<()> {
    let src = FileSource::open(&args.file)
        .with_context(|| format!("cannot read the capture {}", args.file.display()))?;
    refuse_same_file(&args.file, &args.output, "-o")?;
    let out = File::create(&args.output)
        .with_context(|| format!("cannot create {}", args.output.display()))?;
    let sink = match args.format {
        ExportFormat::Perfetto => PerfettoSink::new(BufWriter::new(out)),
    };
    let written = Written {
        capture: &args.file,
        output: &args.output,
        what: "timeline",
        open: "open it in https://ui.perfetto.dev",
    };
    written.write(src, Box::new(sink), args.filter.filter())
}

/// A capture made into one file (`export`'s timeline, `report --html`'s page).
pub(super) struct Written<'a> {
    pub capture: &'a Path,
    pub output: &'a Path,
    /// What the file is, in the messages: `timeline`, `page`.
    pub what: &'a str,
    /// How to look at it.
    pub open: &'a str,
}

impl Written<'_> {
    /// Runs the analysis of `src` into `sink`, behind `filter` (only the marks shown are
    /// filtered, as in `report`); says what was written, and what damage cut it short.
    pub fn write(
        &self,
        mut src: FileSource,
        sink: Box<dyn Sink>,
        filter: FactFilter,
    ) -> anyhow::Result<()> {
        let sink: Box<dyn Sink> = if filter.is_empty() {
            sink
        } else {
            Box::new(FilteredSink::new(sink, filter))
        };
        let what = self.what;
        let mut pipe = Pipeline::new(src.locks(), vec![sink]);
        let end = src.for_each(|ev| pipe.feed(ev))?;
        pipe.finish(end.last_ts_ns)
            .with_context(|| format!("writing {}", self.output.display()))?;
        end.warn_damage(what);
        if let Some(e) = &end.cut_short {
            tracing::warn!("{e}; the {what} covers what was recorded until then");
        }
        tracing::info!(
            "{what} of {} events written to {}: {}",
            pipe.events(),
            self.output.display(),
            self.open
        );
        if let Some(e) = end.damaged {
            let why = e.stopped_because();
            return Err(anyhow::Error::new(e).context(format!(
                "{} {why}; the {what} covers the part before it",
                self.capture.display()
            )));
        }
        Ok(())
    }
}

/// Writing the timeline over the capture it is read from would destroy the capture: the
/// same file under another name (a link, `./x`, a bind mount) is caught by device and inode.
pub(super) fn refuse_same_file(input: &Path, output: &Path, flag: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let (Ok(i), Ok(o)) = (std::fs::metadata(input), std::fs::metadata(output)) else {
        return Ok(());
    };
    if i.dev() == o.dev() && i.ino() == o.ino() {
        anyhow::bail!(
            "{} is the capture being read: write to another file ({flag})",
            output.display()
        );
    }
    Ok(())
}
