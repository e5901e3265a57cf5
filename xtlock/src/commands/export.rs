//! `xtlock export FILE --format perfetto -o trace.json`: capture file -> timeline.

use std::{fs::File, io::BufWriter, path::Path};

use anyhow::Context as _;

use crate::{
    cli::{ExportArgs, ExportFormat},
    pipeline::Pipeline,
    sinks::PerfettoSink,
    source::file::FileSource,
};

pub fn run(args: &ExportArgs) -> anyhow::Result<()> {
    let mut src = FileSource::open(&args.file)
        .with_context(|| format!("cannot read the capture {}", args.file.display()))?;
    refuse_same_file(&args.file, &args.output)?;
    let out = File::create(&args.output)
        .with_context(|| format!("cannot create {}", args.output.display()))?;
    let sink = match args.format {
        ExportFormat::Perfetto => PerfettoSink::new(BufWriter::new(out)),
    };
    let mut pipe = Pipeline::new(src.locks(), vec![Box::new(sink)]);
    let end = src.for_each(|ev| pipe.feed(ev))?;
    pipe.finish(end.last_ts_ns)
        .with_context(|| format!("writing {}", args.output.display()))?;
    end.warn_damage("timeline");
    if let Some(e) = &end.cut_short {
        tracing::warn!("{e}; the timeline covers what was recorded until then");
    }
    tracing::info!(
        "timeline of {} events written to {}: open it in https://ui.perfetto.dev",
        pipe.events(),
        args.output.display()
    );
    if let Some(e) = end.damaged {
        let why = e.stopped_because();
        return Err(anyhow::Error::new(e).context(format!(
            "{} {why}; the timeline covers the part before it",
            args.file.display()
        )));
    }
    Ok(())
}

/// Writing the timeline over the capture it is read from would destroy the capture: the
/// same file under another name (a link, `./x`, a bind mount) is caught by device and inode.
fn refuse_same_file(input: &Path, output: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let (Ok(i), Ok(o)) = (std::fs::metadata(input), std::fs::metadata(output)) else {
        return Ok(());
    };
    if i.dev() == o.dev() && i.ino() == o.ino() {
        anyhow::bail!(
            "{} is the capture being exported: write the timeline to another file (-o)",
            output.display()
        );
    }
    Ok(())
}
