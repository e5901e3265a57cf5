//! One file per subcommand, each wiring a source to sinks.
pub mod daemon;
pub mod docs;
pub mod export;
pub mod live;
pub mod probes;
pub mod record;
pub mod report;
pub mod rules;
pub mod session;
pub mod trace;
use crate::{
    cli::LockArgs,
    lockfiles::{self, LockFile},
    probes::Probes,
};

/// The lock files named on the command line, by `$XTABLES_LOCKFILE`, or iptables' default:
/// the host's, also from a container that shares the host's PID namespace.
pub fn resolve_locks(args: &LockArgs) -> anyhow::Result<Vec<LockFile>> {
    let host = lockfiles::host_root();
    let host_path = host.as_ref().map(|h| h.path.as_path());
    let env = std::env::var_os("XTABLES_LOCKFILE");
    if env.as_ref().is_some_and(|e| e.is_empty()) && args.lock_files.is_empty() {
        // iptables would try to open "" and fail: none of its commands takes a lock then.
        tracing::warn!(
            "XTABLES_LOCKFILE is set but empty: iptables run with it cannot open a lock file \
             and fails; watching the default lock file (unset it, or name the file)"
        );
    }
    let paths = lockfiles::requested_paths(&args.lock_files, env.as_deref(), host_path);
    let default = lockfiles::default_lock_file(host_path);
    let locks = lockfiles::resolve_all(&paths, &default)?;
    if let (Some(h), Some(l)) = (&host, locks.iter().find(|l| l.path == default)) {
        tracing::info!(
            "watching {} (inode {}), the host's {}: {}",
            l.path.display(),
            l.ino,
            lockfiles::DEFAULT_LOCK_FILE,
            h.why
        );
    }
    Ok(locks)
}

/// Where the node's root filesystem is: `--host-root`, else the host's root as a container
/// with the host's PID namespace sees it, else `/`.
pub fn host_root(args: &LockArgs) -> std::path::PathBuf {
    args.host_root
        .clone()
        .or_else(|| lockfiles::host_root().map(|h| h.path))
        .unwrap_or_else(|| "/".into())
}

/// A lock file deleted and recreated is a new inode: start watching it too, so iptables
/// runs that lock the new file are not missed.
pub fn watch_replaced_locks(locks: &mut Vec<LockFile>, probes: &mut Probes) {
    let paths: Vec<_> = locks.iter().map(|l| l.path.clone()).collect();
    for path in paths {
        let Ok(now) = lockfiles::resolve(&path, false) else {
            continue;
        };
        if locks.iter().any(|l| l.dev == now.dev && l.ino == now.ino) {
            continue;
        }
        let index = locks.len() as u32;
        match probes.watch(&now, index) {
            Ok(()) => {
                tracing::warn!(
                    path = %path.display(),
                    ino = now.ino,
                    "the lock file was replaced (new inode); watching the new one too"
                );
                locks.push(now);
            }
            Err(e) => tracing::warn!(error = %e, "cannot watch the replaced lock file"),
        }
    }
}
