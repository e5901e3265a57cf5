//! The capture files of the manifest's record dir: where it is on the host, and the files a
//! run made, removed after it.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

use super::manifest::PodRun;

/// The capture files of the record dir (host side), name -> size.
pub fn captures(dir: &Path) -> BTreeMap<PathBuf, u64> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".xtlock"))
                .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default()
}

/// The host path of the manifest's `--record-dir`.
pub fn record_dir(pod: &PodRun) -> Result<PathBuf> {
    let i = pod
        .args
        .iter()
        .position(|a| a == "--record-dir")
        .context("the manifest passes no --record-dir")?;
    let dir = pod
        .args
        .get(i + 1)
        .context("--record-dir without a value")?;
    let m = pod
        .mounts
        .iter()
        .find(|m| &m.container_path == dir)
        .with_context(|| format!("--record-dir {dir} is not a mounted hostPath"))?;
    Ok(PathBuf::from(&m.host_path))
}

/// Removes the capture files a run made (the node's own are left alone).
pub struct CaptureGuard {
    dir: PathBuf,
    before: BTreeSet<PathBuf>,
    made_dir: bool,
}

impl CaptureGuard {
    pub fn new(dir: &Path) -> Self {
        CaptureGuard {
            dir: dir.to_owned(),
            before: captures(dir).into_keys().collect(),
            made_dir: !dir.exists(),
        }
    }

    pub fn new_files(&self) -> BTreeMap<PathBuf, u64> {
        captures(&self.dir)
            .into_iter()
            .filter(|(p, _)| !self.before.contains(p))
            .collect()
    }
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        for p in self.new_files().into_keys() {
            let _ = fs::remove_file(p);
        }
        if self.made_dir {
            let _ = fs::remove_dir(&self.dir);
        }
    }
}
