//! `xtlock record -o FILE`: live ring buffer -> capture file, with a status line on stderr.
//! The analysis runs too (for the status counts), through the same pipeline as `trace`.

use std::{
    fs::File,
    io::{self, IsTerminal, Write},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Instant,
};

use anyhow::Context as _;

use crate::{
    analysis::{Output, Summary},
    capture::{CaptureHeader, CaptureLock, CaptureProbe, CaptureWriter},
    cli::RecordArgs,
    commands::{live, resolve_locks},
    decode::Event,
    lockfiles::LockFile,
    pipeline::Pipeline,
    probes::{preflight, HookStatus},
    sinks::Sink,
    source::{self, live::LiveSource, live::Recorder},
};

pub async fn run(args: &RecordArgs) -> anyhow::Result<()> {
    preflight::check()?;
    let mut locks = resolve_locks(&args.locks)?;
    // Fail on an unwritable path before loading anything; an existing file is replaced
    // only once the probes are attached.
    let (file, pending) = PendingCapture::create(&args.output)?;
    let probes = live::load(&locks, args.ring_buffer_mib, &args.drops, &args.locks)?;
    let progress = Arc::new(Progress::default());
    let recorder = start_capture(file, &args.output, &locks, &probes.status, progress.clone())?;
    let mut src = LiveSource::new(probes)?;
    src.set_recorder(recorder);
    let (start, _) = live::begin(&mut src, &locks, &args.drops, &args.locks)?;
    pending.commit()?;

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

/// Creates (or truncates) the capture file, with a clear error.
pub fn create_capture_file(path: &Path) -> anyhow::Result<File> {
    File::create(path).with_context(|| format!("cannot create the capture file {}", path.display()))
}

/// A capture written under a temporary name beside its own and renamed once tracing has
/// started: a start that fails (a hook that cannot attach, a wrong `--netns`) leaves an
/// existing file at that path as it was. Dropped without [`PendingCapture::commit`], the
/// temporary file is removed.
pub struct PendingCapture {
    tmp: PathBuf,
    path: PathBuf,
    committed: bool,
}

impl PendingCapture {
    pub fn create(path: &Path) -> anyhow::Result<(File, Self)> {
        // A FIFO or a device (`-o /dev/stdout`) is written in place: it cannot be renamed onto.
        let special = std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir());
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let tmp = match name {
            Some(n) if !special => path.with_file_name(format!(".{n}.{}.tmp", std::process::id())),
            _ => path.to_owned(),
        };
        let file = create_capture_file(&tmp)
            .with_context(|| format!("cannot create the capture file {}", path.display()))?;
        Ok((
            file,
            Self {
                committed: tmp == path,
                tmp,
                path: path.to_owned(),
            },
        ))
    }

    /// Gives the capture its name (replacing a file of that name).
    pub fn commit(mut self) -> anyhow::Result<()> {
        if !self.committed {
            std::fs::rename(&self.tmp, &self.path).with_context(|| {
                format!(
                    "cannot rename {} to {}",
                    self.tmp.display(),
                    self.path.display()
                )
            })?;
            self.committed = true;
        }
        Ok(())
    }
}

impl Drop for PendingCapture {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A recorder writing to `file`, its header describing this run.
pub fn start_capture(
    file: File,
    path: &Path,
    locks: &[LockFile],
    hooks: &[HookStatus],
    progress: Arc<Progress>,
) -> anyhow::Result<Box<dyn Recorder>> {
    let header = capture_header(locks, hooks);
    let writer = CaptureWriter::new(io::BufWriter::new(file), &header)
        .with_context(|| format!("writing the capture header to {}", path.display()))?;
    Ok(Box::new(CaptureRecorder {
        writer: Some(writer),
        progress,
    }))
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

/// The capture header: where and what was recorded.
pub fn capture_header(locks: &[LockFile], hooks: &[HookStatus]) -> CaptureHeader {
    let uname = uname();
    let started_wall_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    CaptureHeader {
        xtlock_version: env!("CARGO_PKG_VERSION").to_owned(),
        hostname: uname.0,
        kernel_release: uname.1,
        boot_to_wall_offset_ns: i64::try_from(source::wall_offset_ns()).unwrap_or(0),
        started_wall_ns,
        locks: locks
            .iter()
            .map(|l| CaptureLock {
                path: l.path.display().to_string(),
                dev: l.dev,
                ino: l.ino,
            })
            .collect(),
        probes: hooks
            .iter()
            .map(|h| CaptureProbe {
                program: h.program.to_owned(),
                attach: h.attach.clone(),
                error: h.error.clone(),
            })
            .collect(),
        extra: serde_json::Value::Null,
    }
}

/// `uname -r` of the running kernel.
pub fn kernel_release() -> String {
    uname().1
}

/// (nodename, release) from uname(2).
fn uname() -> (String, String) {
    // SAFETY: uname fills our zeroed struct; the fields are NUL-terminated C strings.
    unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return (String::new(), String::new());
        }
        let s = |f: &[libc::c_char]| {
            std::ffi::CStr::from_ptr(f.as_ptr())
                .to_string_lossy()
                .into_owned()
        };
        (s(&u.nodename), s(&u.release))
    }
}

/// Bytes and events written, shared with the status line.
#[derive(Default)]
pub struct Progress {
    events: AtomicU64,
    bytes: AtomicU64,
}

struct CaptureRecorder {
    writer: Option<CaptureWriter<io::BufWriter<File>>>,
    progress: Arc<Progress>,
}

impl CaptureRecorder {
    fn writer(&mut self) -> anyhow::Result<&mut CaptureWriter<io::BufWriter<File>>> {
        self.writer
            .as_mut()
            .context("the capture file was already closed")
    }

    fn note(&mut self) {
        if let Some(w) = &self.writer {
            let st = w.stats();
            self.progress
                .events
                .store(st.kernel_events, Ordering::Relaxed);
            self.progress
                .bytes
                .store(st.bytes_on_disk, Ordering::Relaxed);
        }
    }
}

impl Recorder for CaptureRecorder {
    fn kernel(&mut self, raw: &[u8]) -> anyhow::Result<()> {
        self.writer()?.write_kernel(raw)?;
        Ok(())
    }

    fn synthetic(&mut self, ev: &Event) -> anyhow::Result<()> {
        // Kernel events reach the capture as raw bytes through `kernel`; this writes the
        // ones the source makes (processes, lost counts, drop counters, conntrack).
        self.writer()?.write_synthetic(ev)?;
        Ok(())
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        self.writer()?.flush_block()?;
        self.note();
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> anyhow::Result<String> {
        let w = self
            .writer
            .take()
            .context("the capture file was already closed")?;
        let st = w.finish()?;
        let per = st
            .bytes_per_kernel_event()
            .map(|b| format!(", {b:.1} bytes per event"))
            .unwrap_or_default();
        Ok(format!(
            "{} events, {} bytes{per}",
            st.kernel_events, st.bytes_on_disk
        ))
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

fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_for_people() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(2048), "2.0 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }
}
