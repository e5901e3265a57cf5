//! The daemon's rolling capture: the last N files of bounded size in one directory, kept
//! going through failures. A file that cannot be opened or written (disk full, fd limit)
//! stops recording, not the daemon: recording is retried with a growing pause (1 s to 30 s)
//! and resumes by itself once the cause is gone. [`Rolling::trouble`] and
//! [`Rolling::errors`] say how it goes (the daemon shows them on `/readyz` and as metrics).

use std::{
    fs::File,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::{
    decode::Event,
    lockfiles::LockFile,
    probes::HookStatus,
    shared::Throttle,
    source::{self, live::LiveSource, live::Recorder, recorder},
};

/// Capture files the daemon writes: `xtlock-<unix ms>-<seq>.xtlock`, so names sort by age.
const ROLL_PREFIX: &str = "xtlock-";
const ROLL_SUFFIX: &str = ".xtlock";
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(30);

pub struct Rolling {
    dir: PathBuf,
    keep: usize,
    max_bytes: u64,
    period: Option<Duration>,
    /// The file being written (or the last one written).
    pub current: PathBuf,
    opened: Instant,
    seq: u64,
    /// Size of the current file at the previous check.
    last_size: u64,
    broken: Option<Broken>,
    /// Failures to open or write a file, since start.
    errors: u64,
    /// A directory that stays unreadable is said once a minute, not every second.
    list_warned: std::cell::RefCell<Throttle>,
}

/// Recording has stopped on an error and is being retried.
struct Broken {
    error: String,
    retry_at: Instant,
    pause: Duration,
}

impl Rolling {
    pub fn new(
        dir: &Path,
        keep: usize,
        max_bytes: u64,
        period: Option<Duration>,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the record directory {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_owned(),
            keep: keep.max(1),
            max_bytes,
            period,
            current: PathBuf::new(),
            opened: Instant::now(),
            seq: 0,
            last_size: 0,
            broken: None,
            errors: 0,
            list_warned: std::cell::RefCell::new(Throttle::new(Duration::from_secs(60))),
        })
    }

    /// Starts recording into the first file (seeded by the caller, as `live::begin` does);
    /// a failure is not fatal: it is retried like any other.
    pub fn start(&mut self, src: &mut LiveSource, locks: &[LockFile]) {
        match self.open(locks, &src.probes.status) {
            Ok(r) => src.set_recorder(r),
            Err(e) => self.failed(e),
        }
    }

    /// Whether a file is being written now.
    pub fn up(&self) -> bool {
        self.broken.is_none()
    }

    /// Failures to open or write a file, since start.
    pub fn errors(&self) -> u64 {
        self.errors
    }

    /// Why recording is not going on, for `/readyz`; `None` while it is.
    pub fn trouble(&self) -> Option<String> {
        self.broken.as_ref().map(|b| {
            format!(
                "recording into {} failed ({}); retrying",
                self.dir.display(),
                b.error
            )
        })
    }

    /// Rotate when the current file is past its share of the budget.
    fn file_limit(&self) -> u64 {
        self.max_bytes / self.keep as u64
    }

    /// Creates the next file with its header. A file that could not be completed is removed:
    /// an empty or headless file would only make `report` fail.
    fn open(
        &mut self,
        locks: &[LockFile],
        hooks: &[HookStatus],
    ) -> anyhow::Result<Box<dyn Recorder>> {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        self.seq += 1;
        let path = self.dir.join(format!(
            "{ROLL_PREFIX}{ms:013}-{:06}{ROLL_SUFFIX}",
            self.seq
        ));
        let file: File = recorder::create_capture_file(&path)?;
        let r = recorder::start_capture(file, &path, locks, hooks, Default::default())
            .and_then(|mut r| r.flush().map(|()| r));
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        self.current = path;
        self.opened = Instant::now();
        self.last_size = 0;
        self.prune();
        Ok(r)
    }

    /// A file that replays on its own: it starts with the processes alive now and the
    /// drop-reason names, as the first one did.
    fn open_seeded(
        &mut self,
        locks: &[LockFile],
        hooks: &[HookStatus],
        drop_setup: &[Event],
    ) -> anyhow::Result<Box<dyn Recorder>> {
        let mut next = self.open(locks, hooks)?;
        let now = source::monotonic_ns();
        let seed = source::procfs::snapshot(Path::new("/proc"), now)
            .into_iter()
            .map(Event::Proc);
        let setup = drop_setup.iter().cloned().map(|mut ev| {
            if let Event::DropSetup { ts_ns, .. } = &mut ev {
                *ts_ns = now;
            }
            ev
        });
        let written = seed
            .chain(setup)
            .try_for_each(|ev| next.synthetic(&ev))
            .and_then(|()| next.flush());
        if let Err(e) = written {
            drop(next);
            let _ = std::fs::remove_file(&self.current);
            return Err(e);
        }
        Ok(next)
    }

    fn failed(&mut self, e: anyhow::Error) {
        self.errors += 1;
        let error = format!("{e:#}");
        match &mut self.broken {
            Some(b) => {
                // Logged once when it breaks and once when it resumes, not at every retry.
                tracing::debug!(%error, "recording still failing");
                b.pause = (b.pause * 2).min(MAX_RETRY);
                b.retry_at = Instant::now() + b.pause;
                b.error = error;
            }
            None => {
                tracing::error!(
                    dir = %self.dir.display(),
                    %error,
                    "recording stopped; retrying every {} s at most",
                    MAX_RETRY.as_secs()
                );
                self.broken = Some(Broken {
                    error,
                    retry_at: Instant::now() + FIRST_RETRY,
                    pause: FIRST_RETRY,
                });
            }
        }
    }

    /// Once a second: notices a recording that broke, retries a broken one, and rotates.
    pub fn tick(&mut self, src: &mut LiveSource, locks: &[LockFile], drop_setup: &[Event]) {
        if !src.recording() {
            if let (_, Some(e)) = src.take_recorder() {
                // A write failed: the file keeps what was written before, unless nothing was.
                if std::fs::metadata(&self.current).is_ok_and(|m| m.len() == 0) {
                    let _ = std::fs::remove_file(&self.current);
                }
                self.failed(e);
            }
            if self
                .broken
                .as_ref()
                .is_some_and(|b| Instant::now() >= b.retry_at)
            {
                self.prune();
                match self.open_seeded(locks, &src.probes.status, drop_setup) {
                    Ok(r) => {
                        src.set_recorder(r);
                        self.broken = None;
                        tracing::info!(file = %self.current.display(), "recording resumed");
                    }
                    Err(e) => self.failed(e),
                }
            }
            return;
        }
        let size = std::fs::metadata(&self.current).map_or(0, |m| m.len());
        // Checked once a second: rotate while two more seconds at the last rate still fit,
        // so no file outgrows its share and all of them stay under --record-max-bytes.
        let growth = size.saturating_sub(self.last_size);
        self.last_size = size;
        let due = size.saturating_add(2 * growth) >= self.file_limit()
            || self.period.is_some_and(|p| self.opened.elapsed() >= p);
        if !due {
            self.prune();
            return;
        }
        if let (Some(old), _) = src.take_recorder() {
            match old.finish() {
                Ok(what) => {
                    tracing::debug!(file = %self.current.display(), what, "capture file rotated")
                }
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "finishing a capture file"),
            }
        }
        match self.open_seeded(locks, &src.probes.status, drop_setup) {
            Ok(r) => src.set_recorder(r),
            Err(e) => self.failed(e),
        }
    }

    /// Deletes the oldest files beyond `keep`, and while all of them exceed `max_bytes`.
    /// The current file is never deleted.
    fn prune(&self) {
        let mut files = match rolled_files(&self.dir) {
            Ok(f) => f,
            Err(e) => {
                if let Some(failures) = self.list_warned.borrow_mut().hit() {
                    tracing::warn!(
                        dir = %self.dir.display(),
                        error = %e,
                        failures,
                        "cannot list the record directory: old captures are not deleted \
                         (at most one warning a minute)"
                    );
                }
                return;
            }
        };
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        let mut count = files.len();
        files.retain(|f| f.0 != self.current);
        for (path, size) in files {
            if count <= self.keep && total <= self.max_bytes {
                break;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    count -= 1;
                    total -= size;
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "cannot delete an old capture file")
                }
            }
        }
    }
}

/// The daemon's capture files in `dir`, oldest first, with their sizes.
fn rolled_files(dir: &Path) -> std::io::Result<Vec<(PathBuf, u64)>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(ROLL_PREFIX) && name.ends_with(ROLL_SUFFIX) {
            let size = e.metadata().map_or(0, |m| m.len());
            v.push((e.path(), size));
        }
    }
    v.sort();
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rolling_prunes_oldest_by_count_and_bytes() {
        let dir = std::env::temp_dir().join(format!("xtlock-roll-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut r = Rolling::new(&dir, 3, 1000, None).unwrap();
        for i in 0..5 {
            std::fs::write(
                dir.join(format!("xtlock-{i:013}-000001.xtlock")),
                [0u8; 300],
            )
            .unwrap();
        }
        std::fs::write(dir.join("unrelated.txt"), b"x").unwrap();
        r.current = dir.join("xtlock-0000000000004-000001.xtlock");
        r.prune();
        let left = rolled_files(&dir).unwrap();
        // 3 files of 300 bytes: within both the count and the byte budget.
        assert_eq!(left.len(), 3, "{left:?}");
        assert!(left.iter().any(|f| f.0 == r.current));
        r.max_bytes = 650;
        r.prune();
        let left = rolled_files(&dir).unwrap();
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(dir.join("unrelated.txt").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
