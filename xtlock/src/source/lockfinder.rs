//! Lock files in other mount namespaces: a node container (kind, k3d, minikube), or any
//! container that runs iptables without the host's `/run` mounted, has a `/run/xtables.lock`
//! of its own, invisible from the host's path. Each iptables run is looked at as its exec is
//! read: when its mount namespace is not xtlock's, the lock file it takes
//! (`$XTABLES_LOCKFILE` from its environment, else `/run/xtables.lock`) is found through
//! `/proc/PID/root` (or, when the run is already gone, a live ancestor's, which shares its
//! mount namespace in every runtime), and handed over to be watched.
//!
//! Bounded: at most [`MAX_FOUND`] lock files (the kernel side watches
//! `xtlock_common::MAX_WATCHED_LOCKS` in all); more are counted and said once.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt as _;
use std::path::PathBuf;

use crate::lockfiles::{LockFile, DEFAULT_LOCK_FILE};

/// Lock files found in other mount namespaces, at most.
pub const MAX_FOUND: usize = 12;

/// A lock file of another mount namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundLock {
    pub lock: LockFile,
    /// Its mount namespace's inode.
    pub mnt_ns: u64,
    /// The path inside that namespace.
    pub inner: String,
    /// The namespace's host name as its own `/etc/hostname` says (a node container's
    /// name), when it has one.
    pub host: Option<String>,
    /// The process it was found through.
    pub pid: u32,
}

impl FoundLock {
    /// How a person tells it apart: `/run/xtables.lock of kind-worker (mount namespace N)`.
    pub fn describe(&self) -> String {
        match &self.host {
            Some(h) => format!("{} of {h} (mount namespace {})", self.inner, self.mnt_ns),
            None => format!("{} of mount namespace {}", self.inner, self.mnt_ns),
        }
    }
}

#[derive(Default)]
pub struct LockFinder {
    own_mnt: Option<u64>,
    /// (dev, ino) already found or watched.
    known: HashSet<(u32, u64)>,
    /// Mount namespaces looked at whose default lock file was found (one look each).
    seen_ns: HashSet<(u64, String)>,
    found: Vec<FoundLock>,
    /// Lock files beyond the bound.
    pub over: u64,
}

impl LockFinder {
    pub fn new(watched: &[LockFile]) -> Self {
        LockFinder {
            own_mnt: mnt_ns("self"),
            known: watched.iter().map(|l| (l.dev, l.ino)).collect(),
            ..Default::default()
        }
    }

    /// An iptables-family exec by `pid` (`ancestor`: a live one, when `pid` is gone).
    pub fn on_exec(&mut self, pid: u32, ancestor: Option<u32>) {
        let Some(own) = self.own_mnt else { return };
        let through = [Some(pid), ancestor]
            .into_iter()
            .flatten()
            .find_map(|p| mnt_ns(&p.to_string()).map(|ns| (p, ns)));
        let Some((p, ns)) = through else { return };
        if ns == own {
            return;
        }
        let inner = lock_path_of(p).unwrap_or_else(|| DEFAULT_LOCK_FILE.to_owned());
        if self.seen_ns.len() >= 4096 {
            self.seen_ns.clear();
        }
        if !self.seen_ns.insert((ns, inner.clone())) {
            return;
        }
        let path = PathBuf::from(format!("/proc/{p}/root{inner}"));
        let Ok(meta) = std::fs::metadata(&path) else {
            // Not made yet (iptables creates it on first use): looked at again next run.
            self.seen_ns.remove(&(ns, inner));
            return;
        };
        let dev = crate::lockfiles::kernel_dev(meta.dev());
        let key = (dev, meta.ino());
        if self.known.contains(&key) {
            return;
        }
        if self.known.len() >= MAX_FOUND + 4 || self.found.len() >= MAX_FOUND {
            self.over += 1;
            if self.over == 1 {
                tracing::warn!(
                    max = MAX_FOUND,
                    "more lock files in other mount namespaces than xtlock watches: the \
                     later ones are not watched (counted)"
                );
            }
            return;
        }
        self.known.insert(key);
        let host = std::fs::read_to_string(format!("/proc/{p}/root/etc/hostname"))
            .ok()
            .map(|h| h.trim().chars().take(64).collect::<String>())
            .filter(|h| !h.is_empty());
        self.found.push(FoundLock {
            lock: LockFile {
                path,
                dev,
                ino: meta.ino(),
            },
            mnt_ns: ns,
            inner,
            host,
            pid: p,
        });
    }

    /// Lock files found since the last call.
    pub fn take(&mut self) -> Vec<FoundLock> {
        std::mem::take(&mut self.found)
    }
}

fn mnt_ns(pid: &str) -> Option<u64> {
    std::fs::metadata(format!("/proc/{pid}/ns/mnt"))
        .ok()
        .map(|m| m.ino())
}

/// `$XTABLES_LOCKFILE` of process `pid`, when set to an absolute path.
fn lock_path_of(pid: u32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"XTABLES_LOCKFILE="))
        .and_then(|v| std::str::from_utf8(v).ok())
        .filter(|v| v.starts_with('/') && !v.contains("/../") && v.len() < 4096)
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_in_our_own_mount_namespace_adds_nothing() {
        let mut f = LockFinder::new(&[]);
        f.on_exec(std::process::id(), None);
        assert!(f.take().is_empty());
    }

    #[test]
    fn a_gone_process_without_ancestor_adds_nothing() {
        let mut f = LockFinder::new(&[]);
        f.on_exec(u32::MAX - 1, None);
        assert!(f.take().is_empty());
    }
}
