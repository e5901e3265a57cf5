//! The capture file side of a live source: what `record`, `trace --record` and the daemon's
//! rolling files write, record by record, as the source yields them. A capture is written
//! under a temporary name and renamed once tracing has started ([`PendingCapture`]).

use std::{
    fs::File,
    io,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use anyhow::Context as _;

use crate::{
    capture::{CaptureHeader, CaptureLock, CaptureProbe, CaptureWriter},
    decode::Event,
    lockfiles::LockFile,
    probes::HookStatus,
    source::{self, live::Recorder},
};

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
        let tmp = match &name {
            Some(n) if !special => {
                remove_stale_tmps(path, n);
                path.with_file_name(format!(".{n}.{}.tmp", std::process::id()))
            }
            _ => path.to_owned(),
        };
        // Named after `path`, which is what the user gave; the temporary name would puzzle.
        let file = File::create(&tmp)
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

/// Removes `.NAME.PID.tmp` files beside `path` whose PID is not running: what a `record` killed
/// by SIGKILL before tracing started left behind (Drop never ran).
fn remove_stale_tmps(path: &Path, name: &str) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".{name}.");
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(pid) = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|f| f.strip_suffix(".tmp"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let ours = e.file_type().is_ok_and(|t| t.is_file());
        if ours && !Path::new(&format!("/proc/{pid}")).exists() {
            match std::fs::remove_file(e.path()) {
                Ok(()) => {
                    tracing::info!(file = %e.path().display(), "removed a temporary capture file left by an xtlock that was killed")
                }
                Err(err) => {
                    tracing::debug!(file = %e.path().display(), error = %err, "cannot remove a stale temporary capture")
                }
            }
        }
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
    pub events: AtomicU64,
    pub bytes: AtomicU64,
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
