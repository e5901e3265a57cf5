//! Which lock files to watch: `--lock-file PATH` (repeatable), else `$XTABLES_LOCKFILE`, else
//! `/run/xtables.lock`. The probes filter on (device, inode), so each path is resolved to
//! the inode it names now, and re-checked while tracing in case it is replaced.

use std::{
    fs, io,
    os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use xtlock_common::LockKey;

/// iptables' default lock file (`XT_LOCK_NAME`).
pub const DEFAULT_LOCK_FILE: &str = "/run/xtables.lock";

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LockFile {
    pub path: PathBuf,
    /// Kernel encoding, as the filelock tracepoint reports it.
    pub dev: u32,
    pub ino: u64,
}

impl LockFile {
    pub fn key(&self) -> LockKey {
        LockKey {
            ino: self.ino,
            dev: self.dev,
            _pad: 0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockFileError {
    #[error(
        "lock file {path} does not exist. xtlock watches the file's inode, so it must exist: \
         iptables creates it on first use; create it now with `touch {path}`, or pass the \
         right path with --lock-file"
    )]
    Missing { path: String },
    #[error(
        "{path} is a directory, not a lock file: iptables cannot lock it either (a known CNI \
         bug creates it as a directory); remove it with `rmdir {path}` so iptables can recreate it"
    )]
    Directory { path: String },
    #[error("{path} is not a regular file")]
    NotRegular { path: String },
    #[error("cannot inspect lock file {path}: {error}")]
    Io { path: String, error: io::Error },
    #[error("at most {max} lock files can be watched, got {got}")]
    TooMany { max: u32, got: usize },
}

/// The kernel's `MKDEV(major, minor)` for a userspace `st_dev`.
pub fn kernel_dev(st_dev: u64) -> u32 {
    let major = libc::major(st_dev);
    let minor = libc::minor(st_dev);
    (major << 20) | (minor & 0xfffff)
}

/// The lock paths the user asked for, in order, without duplicates.
pub fn requested_paths(cli: &[PathBuf], env_lockfile: Option<&str>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let from_env = env_lockfile.filter(|s| !s.is_empty()).map(PathBuf::from);
    let chosen: Vec<PathBuf> = if !cli.is_empty() {
        cli.to_vec()
    } else if let Some(p) = from_env {
        vec![p]
    } else {
        vec![PathBuf::from(DEFAULT_LOCK_FILE)]
    };
    for p in chosen {
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// Resolves one path to the inode it names now. `create_default`: create iptables' default
/// lock file (mode 0600, as iptables itself would) when it is missing.
pub fn resolve(path: &Path, create_default: bool) -> Result<LockFile, LockFileError> {
    let shown = path.display().to_string();
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound && create_default => {
            fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)
                .map_err(|source| LockFileError::Io {
                    path: shown.clone(),
                    error: source,
                })?;
            tracing::info!(path = %shown, "created the lock file (mode 0600), as iptables does on first use");
            fs::metadata(path).map_err(|source| LockFileError::Io {
                path: shown.clone(),
                error: source,
            })?
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(LockFileError::Missing { path: shown })
        }
        Err(source) => {
            return Err(LockFileError::Io {
                path: shown,
                error: source,
            })
        }
    };
    if meta.is_dir() {
        return Err(LockFileError::Directory { path: shown });
    }
    if !meta.is_file() {
        return Err(LockFileError::NotRegular { path: shown });
    }
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::debug!(path = %shown, mode = format!("{:o}", meta.permissions().mode()), "lock file is group/world accessible");
    }
    Ok(LockFile {
        path: path.to_path_buf(),
        dev: kernel_dev(meta.dev()),
        ino: meta.ino(),
    })
}

/// Resolves every requested path; only iptables' default path is created when missing.
pub fn resolve_all(paths: &[PathBuf]) -> Result<Vec<LockFile>, LockFileError> {
    let max = xtlock_common::MAX_WATCHED_LOCKS;
    if paths.len() > max as usize {
        return Err(LockFileError::TooMany {
            max,
            got: paths.len(),
        });
    }
    paths
        .iter()
        .map(|p| resolve(p, p == Path::new(DEFAULT_LOCK_FILE)))
        .collect()
}

/// A lock file to watch. `dev` is in the kernel's encoding (`major << 20 | minor`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct WatchedLock {
    pub path: String,
    pub dev: u32,
    pub ino: u64,
}

impl WatchedLock {
    pub fn new(path: impl Into<String>, dev: u32, ino: u64) -> Self {
        WatchedLock {
            path: path.into(),
            dev,
            ino,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_cli_env_default() {
        let cli = vec![
            PathBuf::from("/a"),
            PathBuf::from("/b"),
            PathBuf::from("/a"),
        ];
        assert_eq!(
            requested_paths(&cli, Some("/env")),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(
            requested_paths(&[], Some("/env")),
            vec![PathBuf::from("/env")]
        );
        assert_eq!(
            requested_paths(&[], Some("")),
            vec![PathBuf::from(DEFAULT_LOCK_FILE)]
        );
        assert_eq!(
            requested_paths(&[], None),
            vec![PathBuf::from(DEFAULT_LOCK_FILE)]
        );
    }

    #[test]
    fn kernel_dev_encoding() {
        // glibc's makedev(8, 1) -> kernel MKDEV(8, 1) = 8 << 20 | 1.
        assert_eq!(kernel_dev(libc::makedev(8, 1)), (8 << 20) | 1);
        assert_eq!(kernel_dev(libc::makedev(0, 25)), 25);
        assert_eq!(kernel_dev(libc::makedev(259, 70000)), (259 << 20) | 70000);
    }

    #[test]
    fn missing_directory_and_regular() {
        let dir = std::env::temp_dir().join(format!("xtlock-lockfiles-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("nope.lock");
        let e = resolve(&missing, false).unwrap_err().to_string();
        assert!(e.contains("does not exist") && e.contains("touch"), "{e}");
        let e = resolve(&dir, false).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let created = resolve(&missing, true).unwrap();
        assert_eq!(created.ino, fs::metadata(&missing).unwrap().ino());
        let mode = fs::metadata(&missing).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        fs::remove_dir_all(&dir).unwrap();
    }
}
