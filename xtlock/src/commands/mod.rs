//! One file per subcommand, each wiring a source to sinks.
pub mod daemon;
pub mod export;
pub mod live;
pub mod probes;
pub mod record;
pub mod report;
pub mod session;
pub mod trace;
use crate::{
    cli::LockArgs,
    lockfiles::{self, LockFile},
    probes::Probes,
};

/// The lock files named on the command line, by `$XTABLES_LOCKFILE`, or iptables' default.
pub fn resolve_locks(args: &LockArgs) -> anyhow::Result<Vec<LockFile>> {
    let paths = lockfiles::requested_paths(
        &args.lock_files,
        std::env::var("XTABLES_LOCKFILE").ok().as_deref(),
    );
    Ok(lockfiles::resolve_all(&paths)?)
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
