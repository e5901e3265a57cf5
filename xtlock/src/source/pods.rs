//! Names of the pods and containers whose processes the source sees, from the kubelet's log
//! directories on this node (no API server): `/var/log/containers` maps a container ID to
//! its namespace, pod and container, `/var/log/pods` a pod UID to its namespace and pod
//! (see [`crate::kube`]). Each container or pod seen in a process's cgroup is named once, as
//! a [`PodInfo`] event, which captures record like any other.
//!
//! The kubelet makes a container's log link once the runtime reports it started, which can
//! be after its first processes exec'd: an id not named yet is looked up again, at most once
//! a second, for a minute, and only when a directory changed since it was last read (its
//! mtime): a node with 100k entries and an id that never gets a name costs a `stat` a second.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use crate::decode::PodInfo;
use crate::kube::{parse_container_log, parse_pod_log_dir, CgroupIdentity, PodName};

/// Rescans the directories at most this often while ids wait for names.
const RESCAN_NS: u64 = 1_000_000_000;
/// An id unnamed for this long is given up on (a container not run by the kubelet).
const PENDING_NS: u64 = 60_000_000_000;
/// Ids kept waiting for names, and ids remembered as named; beyond, the oldest go.
const MAX_PENDING: usize = 4096;
const MAX_SENT: usize = 65536;
/// Entries read from each directory; a node runs a few hundred containers.
const MAX_ENTRIES: usize = 65536;

/// The kubelet's directories under `root` (`/` on the node; the host's root elsewhere).
pub struct PodDirectory {
    containers_dir: PathBuf,
    pods_dir: PathBuf,
    by_container: HashMap<String, PodName>,
    by_uid: HashMap<String, PodName>,
    /// Ids (container ids, `pod:` + uid) already sent.
    sent: HashSet<String>,
    /// Identities seen but not named yet, with when first seen.
    pending: HashMap<String, (CgroupIdentity, u64)>,
    last_scan_ns: Option<u64>,
    /// Both directories' mtimes when last read.
    scanned: Option<Stamp>,
}

/// The directories' mtimes (None: cannot be read).
type Stamp = [Option<SystemTime>; 2];

/// An mtime this close to now may hide a change made in the same clock tick after the read
/// (file systems stamp with a coarse clock): such a directory is read again.
const SETTLE: Duration = Duration::from_secs(2);

impl PodDirectory {
    /// `None` when `root` has no kubelet log directory: not a Kubernetes node (or the
    /// directory is not mounted), and there is nothing to name.
    pub fn new(root: &Path) -> Option<Self> {
        let containers_dir = root.join("var/log/containers");
        let pods_dir = root.join("var/log/pods");
        if !containers_dir.is_dir() && !pods_dir.is_dir() {
            return None;
        }
        Some(PodDirectory {
            containers_dir,
            pods_dir,
            by_container: HashMap::new(),
            by_uid: HashMap::new(),
            sent: HashSet::new(),
            pending: HashMap::new(),
            last_scan_ns: None,
            scanned: None,
        })
    }

    /// Reads both directories again.
    fn scan(&mut self, now_ns: u64) {
        self.last_scan_ns = Some(now_ns);
        self.scanned = Some(self.stamp());
        self.by_container.clear();
        self.by_uid.clear();
        for name in dir_names(&self.containers_dir) {
            if let Some((cid, pod)) = parse_container_log(&name) {
                self.by_container.insert(cid.to_owned(), pod);
            }
        }
        for name in dir_names(&self.pods_dir) {
            if let Some((uid, pod)) = parse_pod_log_dir(&name) {
                self.by_uid.insert(uid.to_owned(), pod);
            }
        }
    }

    fn stamp(&self) -> Stamp {
        let mtime = |d: &Path| std::fs::metadata(d).and_then(|m| m.modified()).ok();
        [mtime(&self.containers_dir), mtime(&self.pods_dir)]
    }

    /// A second since the last read, and a directory changed (or too recently to tell).
    fn rescan_due(&self, now_ns: u64) -> bool {
        if self
            .last_scan_ns
            .is_some_and(|t| now_ns.saturating_sub(t) < RESCAN_NS)
        {
            return false;
        }
        let Some(scanned) = self.scanned else {
            return true;
        };
        let now = self.stamp();
        let settled = |m: &Option<SystemTime>| {
            m.is_none_or(|m| {
                SystemTime::now()
                    .duration_since(m)
                    .is_ok_and(|d| d >= SETTLE)
            })
        };
        now != scanned || !now.iter().all(settled)
    }

    /// A process in the cgroup `id` was seen at `now_ns`: appends the events that name its
    /// container and pod, the first time they can be named.
    pub fn see(&mut self, id: &CgroupIdentity, now_ns: u64, out: &mut Vec<PodInfo>) {
        if id.container_id.is_none() && id.pod_uid.is_none() {
            return;
        }
        if self.resolve(id, now_ns, out) {
            return;
        }
        if self.rescan_due(now_ns) {
            self.scan(now_ns);
            if self.resolve(id, now_ns, out) {
                return;
            }
        }
        let key = key_of(id);
        if !self.pending.contains_key(&key) {
            if self.pending.len() >= MAX_PENDING {
                self.pending.clear();
            }
            self.pending.insert(key, (id.clone(), now_ns));
        }
    }

    /// Names what was seen but not named yet (once a second at most); forgets ids waiting
    /// for over a minute.
    pub fn tick(&mut self, now_ns: u64, out: &mut Vec<PodInfo>) {
        if self.pending.is_empty() || !self.rescan_due(now_ns) {
            return;
        }
        self.scan(now_ns);
        let pending = std::mem::take(&mut self.pending);
        for (key, (id, first_ns)) in pending {
            if !self.resolve(&id, now_ns, out) && now_ns.saturating_sub(first_ns) < PENDING_NS {
                self.pending.insert(key, (id, first_ns));
            }
        }
    }

    /// Sends what is known of `id` and not sent yet; true when nothing is left to learn.
    fn resolve(&mut self, id: &CgroupIdentity, now_ns: u64, out: &mut Vec<PodInfo>) -> bool {
        let uid = id.pod_uid.as_deref().unwrap_or("");
        if let Some(cid) = id.container_id.as_deref() {
            if self.sent.contains(cid) {
                return true;
            }
            if let Some(p) = self.by_container.get(cid) {
                out.push(info(now_ns, cid, uid, p));
                self.remember(cid.to_owned());
                return true;
            }
        }
        if !uid.is_empty() {
            let key = format!("pod:{uid}");
            if !self.sent.contains(&key) {
                if let Some(p) = self.by_uid.get(uid) {
                    out.push(info(now_ns, "", uid, p));
                    self.remember(key);
                }
            }
            // The pod is named; its container may still get its own name.
            return id.container_id.is_none() && self.sent.contains(&format!("pod:{uid}"));
        }
        false
    }

    fn remember(&mut self, key: String) {
        if self.sent.len() >= MAX_SENT {
            self.sent.clear();
        }
        self.sent.insert(key);
    }
}

fn key_of(id: &CgroupIdentity) -> String {
    match (&id.container_id, &id.pod_uid) {
        (Some(c), _) => c.to_string(),
        (None, Some(u)) => format!("pod:{u}"),
        (None, None) => String::new(),
    }
}

fn info(ts_ns: u64, cid: &str, uid: &str, p: &PodName) -> PodInfo {
    PodInfo {
        ts_ns,
        container_id: cid.to_owned(),
        pod_uid: uid.to_owned(),
        namespace: p.namespace.to_string(),
        pod: p.pod.to_string(),
        container: p.container.to_string(),
    }
}

/// File names in `dir` (none when it cannot be read: the names are a bonus, never needed).
fn dir_names(dir: &Path) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .take(MAX_ENTRIES)
            .filter_map(|e| e.file_name().into_string().ok())
            .collect(),
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "cannot read the kubelet's log directory");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::parse_cgroup;

    const UID: &str = "5f3c1e2a-8b7d-4c6e-9a1f-0d2b3c4e5f6a";
    const CID: &str = "3f6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f";
    const CID2: &str = "aa6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f";

    /// A node's /var/log as the kubelet lays it out: the pod's directory with a directory
    /// per container, and a link per container in /var/log/containers.
    fn kubelet_tree(root: &Path, ns: &str, pod: &str, uid: &str, containers: &[(&str, &str)]) {
        let pod_dir = root.join(format!("var/log/pods/{ns}_{pod}_{uid}"));
        for (c, cid) in containers {
            std::fs::create_dir_all(pod_dir.join(c)).unwrap();
            let log = pod_dir.join(c).join("0.log");
            std::fs::write(&log, "").unwrap();
            let link = root.join(format!("var/log/containers/{pod}_{ns}_{c}-{cid}.log"));
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(&log, link).unwrap();
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("xtlock-pods-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn no_kubelet_no_directory() {
        let d = scratch("none");
        assert!(PodDirectory::new(&d).is_none());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Every runtime's cgroup layout names the same container through the kubelet's links.
    #[test]
    fn names_containers_of_every_cgroup_layout() {
        let d = scratch("layouts");
        kubelet_tree(
            &d,
            "kube-system",
            "kube-proxy-x7k2p",
            UID,
            &[("kube-proxy", CID)],
        );
        let uid_ = UID.replace('-', "_");
        let layouts = [
            // containerd, systemd driver (cgroup v2)
            format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{CID}.scope"),
            // containerd or Docker, cgroupfs driver (cgroup v1)
            format!("4:pids:/kubepods/besteffort/pod{UID}/{CID}"),
            // CRI-O, systemd driver
            format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/crio-{CID}.scope"),
            // Docker through cri-dockerd, systemd driver
            format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/docker-{CID}.scope"),
        ];
        for layout in &layouts {
            let mut dir = PodDirectory::new(&d).unwrap();
            let mut out = Vec::new();
            dir.see(&parse_cgroup(layout), 1, &mut out);
            assert_eq!(out.len(), 1, "{layout}: {out:?}");
            let p = &out[0];
            assert_eq!(
                (
                    p.container_id.as_str(),
                    p.namespace.as_str(),
                    p.pod.as_str(),
                    p.container.as_str()
                ),
                (CID, "kube-system", "kube-proxy-x7k2p", "kube-proxy"),
                "{layout}"
            );
            assert_eq!(p.pod_uid, UID, "{layout}");
            // Named once.
            dir.see(&parse_cgroup(layout), 2, &mut out);
            assert_eq!(out.len(), 1);
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A container whose link the kubelet has not made yet: its pod is named at once, the
    /// container when the link appears (at the next tick after a second).
    #[test]
    fn container_named_when_its_link_appears() {
        let d = scratch("late");
        kubelet_tree(
            &d,
            "calico-system",
            "calico-node-4hk8z",
            UID,
            &[("calico-node", CID)],
        );
        let mut dir = PodDirectory::new(&d).unwrap();
        let id = parse_cgroup(&format!("4:pids:/kubepods/burstable/pod{UID}/{CID2}"));
        let mut out = Vec::new();
        dir.see(&id, 1, &mut out);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(
            (
                out[0].container_id.as_str(),
                out[0].pod.as_str(),
                out[0].container.as_str()
            ),
            ("", "calico-node-4hk8z", "")
        );
        kubelet_tree(
            &d,
            "calico-system",
            "calico-node-4hk8z",
            UID,
            &[("install-cni", CID2)],
        );
        dir.tick(1 + RESCAN_NS / 2, &mut out);
        assert_eq!(out.len(), 1, "not before a second has passed");
        dir.tick(2 + RESCAN_NS, &mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(
            (out[1].container_id.as_str(), out[1].container.as_str()),
            (CID2, "install-cni")
        );
        // Nothing left to look for.
        assert!(dir.pending.is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A container no kubelet runs (plain Docker) is given up on after a minute.
    #[test]
    fn unknown_containers_are_given_up() {
        let d = scratch("unknown");
        std::fs::create_dir_all(d.join("var/log/pods")).unwrap();
        let mut dir = PodDirectory::new(&d).unwrap();
        let mut out = Vec::new();
        dir.see(
            &parse_cgroup(&format!("0::/system.slice/docker-{CID}.scope")),
            0,
            &mut out,
        );
        assert!(out.is_empty());
        assert_eq!(dir.pending.len(), 1);
        dir.tick(PENDING_NS + RESCAN_NS, &mut out);
        assert!(out.is_empty() && dir.pending.is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
