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

/// The host's root filesystem as this process reaches it, when it is not `/`: a container
/// that shares the host's PID namespace (`kubectl debug node`, a DaemonSet with `hostPID`)
/// sees the host's files under `/proc/1/root` (PID 1 is then the host's init, in another
/// mount namespace), or under `/host` when that is the same directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRoot {
    pub path: PathBuf,
    /// Why, for the first line of output.
    pub why: &'static str,
}

/// Where the host's root is ([`HostRoot`]); `None` when it is `/` or cannot be reached.
pub fn host_root() -> Option<HostRoot> {
    host_root_in(Path::new("/proc"), Path::new("/host"), Path::new("/"))
}

/// `own`: this process's root, whose lock file (if any) rules out the `/host` fallback.
fn host_root_in(proc: &Path, host: &Path, own: &Path) -> Option<HostRoot> {
    let ns = |pid: &str, kind: &str| fs::read_link(proc.join(pid).join("ns").join(kind)).ok();
    let (Some(my_mnt), Some(init_mnt), Some(my_pid), Some(init_pid)) = (
        ns("self", "mnt"),
        ns("1", "mnt"),
        ns("self", "pid"),
        ns("1", "pid"),
    ) else {
        return host_mount(host, own);
    };
    // Same mount namespace as PID 1: `/` is its root already. Another PID namespace: PID 1
    // is a container's own init, not the host's.
    if my_mnt == init_mnt || my_pid != init_pid {
        return None;
    }
    let root = proc.join("1").join("root");
    let Ok(root_meta) = fs::metadata(&root) else {
        return host_mount(host, own);
    };
    let same =
        fs::metadata(host).is_ok_and(|h| h.dev() == root_meta.dev() && h.ino() == root_meta.ino());
    Some(HostRoot {
        path: if same { host.to_owned() } else { root },
        why: "this process runs in a container that shares the host's PID namespace: the \
              host's files are under its init's root",
    })
}

/// PID 1 is closed to this process (a sandboxed init, another user namespace): the node's
/// root where `kubectl debug node` mounts it, `/host`, when it has a /run and this process's
/// own root has no lock file (a container image has none; a host that happens to have a
/// /host directory does).
fn host_mount(host: &Path, own: &Path) -> Option<HostRoot> {
    if own.join(DEFAULT_LOCK_FILE.trim_start_matches('/')).exists()
        || !host.join("run").is_dir()
        || !host.join("proc").is_dir()
    {
        return None;
    }
    Some(HostRoot {
        path: host.to_owned(),
        why: "PID 1's root is closed to this process, and the node's root is mounted at /host \
              (as `kubectl debug node` does)",
    })
}

/// The lock paths the user asked for, in order, without duplicates. `host`: where the
/// host's root is, when not `/` (the default lock file is then the host's).
pub fn requested_paths(
    cli: &[PathBuf],
    env_lockfile: Option<&std::ffi::OsStr>,
    host: Option<&Path>,
) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    // Any bytes but none: iptables opens what the variable holds, UTF-8 or not.
    let from_env = env_lockfile.filter(|s| !s.is_empty()).map(PathBuf::from);
    let chosen: Vec<PathBuf> = if !cli.is_empty() {
        cli.to_vec()
    } else if let Some(p) = from_env {
        vec![p]
    } else {
        vec![default_lock_file(host)]
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

/// iptables' default lock file, under the host's root when given.
pub fn default_lock_file(host: Option<&Path>) -> PathBuf {
    match host {
        Some(h) => h.join(DEFAULT_LOCK_FILE.trim_start_matches('/')),
        None => PathBuf::from(DEFAULT_LOCK_FILE),
    }
}

/// Resolves every requested path; only iptables' default lock file (`default`) is created
/// when missing.
pub fn resolve_all(paths: &[PathBuf], default: &Path) -> Result<Vec<LockFile>, LockFileError> {
    let max = xtlock_common::MAX_WATCHED_LOCKS;
    if paths.len() > max as usize {
        return Err(LockFileError::TooMany {
            max,
            got: paths.len(),
        });
    }
    paths.iter().map(|p| resolve(p, p == default)).collect()
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
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn precedence_cli_env_default() {
        let cli = vec![
            PathBuf::from("/a"),
            PathBuf::from("/b"),
            PathBuf::from("/a"),
        ];
        assert_eq!(
            requested_paths(&cli, Some(OsStr::new("/env")), None),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(
            requested_paths(&[], Some(OsStr::new("/env")), None),
            vec![PathBuf::from("/env")]
        );
        // Not UTF-8: iptables opens those bytes, so do we.
        let raw = OsStr::from_bytes(b"/run/x\xfftables.lock");
        assert_eq!(
            requested_paths(&[], Some(raw), None),
            vec![PathBuf::from(raw)]
        );
        assert_eq!(
            requested_paths(&[], Some(OsStr::new("")), None),
            vec![PathBuf::from(DEFAULT_LOCK_FILE)]
        );
        assert_eq!(
            requested_paths(&[], None, None),
            vec![PathBuf::from(DEFAULT_LOCK_FILE)]
        );
    }

    /// A /proc as a container with the host's PID namespace sees it, and as the host does.
    #[test]
    fn host_root_through_init() {
        let dir = std::env::temp_dir().join(format!("xtlock-hostroot-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let proc = dir.join("proc");
        let link = |pid: &str, kind: &str, to: &str| {
            let d = proc.join(pid).join("ns");
            fs::create_dir_all(&d).unwrap();
            std::os::unix::fs::symlink(to, d.join(kind)).unwrap();
        };
        link("self", "mnt", "mnt:[4026532500]");
        link("self", "pid", "pid:[4026531836]");
        link("1", "mnt", "mnt:[4026531841]");
        link("1", "pid", "pid:[4026531836]");
        fs::create_dir_all(proc.join("1").join("root").join("run")).unwrap();
        let host = dir.join("host");
        let own = dir.join("own");
        fs::create_dir_all(own.join("run")).unwrap();
        fs::write(own.join("run/xtables.lock"), b"").unwrap();
        let h = host_root_in(&proc, &host, &own).unwrap();
        assert_eq!(h.path, proc.join("1").join("root"));
        assert_eq!(
            default_lock_file(Some(&h.path)),
            proc.join("1/root/run/xtables.lock")
        );
        // `/host` bind-mounted from the same root: the friendlier path.
        std::os::unix::fs::symlink(proc.join("1").join("root"), &host).unwrap();
        assert_eq!(host_root_in(&proc, &host, &own).unwrap().path, host);
        assert_eq!(
            requested_paths(&[], None, Some(&host)),
            vec![host.join("run/xtables.lock")]
        );
        // --lock-file and $XTABLES_LOCKFILE still win.
        assert_eq!(
            requested_paths(&[PathBuf::from("/x")], None, Some(&host)),
            vec![PathBuf::from("/x")]
        );
        // Its own PID namespace: PID 1 is the container's init, not the host's.
        fs::remove_file(proc.join("self/ns/pid")).unwrap();
        std::os::unix::fs::symlink("pid:[4026532600]", proc.join("self/ns/pid")).unwrap();
        assert_eq!(host_root_in(&proc, &host, &own), None);
        // On the host: the same mount namespace as init.
        fs::remove_file(proc.join("self/ns/pid")).unwrap();
        std::os::unix::fs::symlink("pid:[4026531836]", proc.join("self/ns/pid")).unwrap();
        fs::remove_file(proc.join("self/ns/mnt")).unwrap();
        std::os::unix::fs::symlink("mnt:[4026531841]", proc.join("self/ns/mnt")).unwrap();
        assert_eq!(host_root_in(&proc, &host, &own), None);

        // PID 1 closed to us (its ns links unreadable): /host when our root has no lock
        // file and /host looks like a node's root; never when our own root has the lock.
        let closed = dir.join("proc-closed");
        fs::create_dir_all(closed.join("self/ns")).unwrap();
        std::os::unix::fs::symlink("mnt:[4026532500]", closed.join("self/ns/mnt")).unwrap();
        let node = dir.join("node");
        fs::create_dir_all(node.join("run")).unwrap();
        fs::create_dir_all(node.join("proc")).unwrap();
        assert_eq!(host_root_in(&closed, &node, &own), None);
        let image = dir.join("image");
        fs::create_dir_all(&image).unwrap();
        assert_eq!(host_root_in(&closed, &node, &image).unwrap().path, node);
        assert_eq!(host_root_in(&closed, &dir.join("nothing"), &image), None);
        fs::remove_dir_all(&dir).unwrap();
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
