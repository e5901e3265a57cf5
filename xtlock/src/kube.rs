//! Kubernetes identity of a process, from what the node itself holds (no API server): the
//! pod UID and container ID in its cgroup path, and the names the kubelet gives its log
//! files, which map a container ID to its namespace, pod and container names:
//!
//! * `/var/log/containers/<pod>_<namespace>_<container>-<container id>.log`, a symlink the
//!   kubelet makes for each container, whatever the runtime (containerd, CRI-O, Docker
//!   through cri-dockerd);
//! * `/var/log/pods/<namespace>_<pod>_<pod uid>/<container>/`, which maps a pod UID to its
//!   namespace and name (for processes of a pod whose container has no symlink).
//!
//! Pure: names in, identities out. The directory reading is the source's
//! (`source/pods.rs`); the names reach the analysis as [`PodInfo`] events, recorded in
//! captures like the kernel's events.
//!
//! [`PodInfo`]: crate::decode::PodInfo

use serde::Serialize;

use crate::shared::SharedStr;

/// Pod and container named by a cgroup path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupIdentity {
    pub pod_uid: Option<SharedStr>,
    pub container_id: Option<SharedStr>,
}

/// Reads pod UID and container ID out of a cgroup path (or a `/proc/PID/cgroup` line).
///
/// Handles the systemd driver (`kubepods-burstable-pod<uid_with_underscores>.slice`,
/// `cri-containerd-<id>.scope`, `docker-<id>.scope`, `crio-<id>.scope`), the cgroupfs driver
/// (`/kubepods/burstable/pod<uid>/<id>`) and plain docker (`/docker/<id>`).
pub fn parse_cgroup(line: &str) -> CgroupIdentity {
    // "0::/kubepods..." or "4:pids:/kubepods...": the path starts at the first '/'.
    let path = line.find('/').map_or(line, |i| &line[i..]);
    let mut id = CgroupIdentity::default();
    for comp in path.split('/').filter(|c| !c.is_empty()) {
        if let Some(uid) = pod_uid_of(comp) {
            id.pod_uid = Some(SharedStr::from(uid));
        } else if let Some(cid) = container_id_of(comp) {
            id.container_id = Some(SharedStr::from(cid));
        }
    }
    id
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn looks_like_uid(s: &str) -> bool {
    s.len() >= 32 && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

fn pod_uid_of(comp: &str) -> Option<String> {
    if let Some(slice) = comp.strip_suffix(".slice") {
        // kubepods-pod<uid>.slice, kubepods-burstable-pod<uid>.slice
        if !slice.starts_with("kubepods") {
            return None;
        }
        let uid = slice.rsplit_once("-pod")?.1.replace('_', "-");
        return looks_like_uid(&uid).then_some(uid);
    }
    let uid = comp.strip_prefix("pod")?;
    looks_like_uid(uid).then(|| uid.to_string())
}

fn container_id_of(comp: &str) -> Option<&str> {
    if let Some(scope) = comp.strip_suffix(".scope") {
        for prefix in [
            "cri-containerd-",
            "docker-",
            "crio-conmon-",
            "crio-",
            "libpod-",
        ] {
            if let Some(cid) = scope.strip_prefix(prefix) {
                if cid.len() >= 12 && is_hex(cid) {
                    return Some(cid);
                }
            }
        }
        return None;
    }
    (comp.len() == 64 && is_hex(comp)).then_some(comp)
}

/// Namespace, pod and container of a process that runs in a pod; `container` is empty when
/// only the pod is known.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct PodName {
    pub namespace: SharedStr,
    #[serde(rename = "name")]
    pub pod: SharedStr,
    #[serde(skip_serializing_if = "is_empty")]
    pub container: SharedStr,
}

impl PodName {
    /// The pod's name without the suffix its controller added (`kube-proxy-x7k2p` ->
    /// `kube-proxy`, `coredns-5d78c9869d-h9xzq` -> `coredns`, `web-0` -> `web`): one value
    /// per workload, whatever pods come and go (metrics labels).
    pub fn workload(&self) -> &str {
        workload_of(&self.pod)
    }
}

impl std::fmt::Display for PodName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.pod)?;
        if !self.container.is_empty() {
            write!(f, "/{}", self.container)?;
        }
        Ok(())
    }
}

fn is_empty(s: &SharedStr) -> bool {
    s.is_empty()
}

/// See [`PodName::workload`].
pub fn workload_of(pod: &str) -> &str {
    let mut name = pod;
    // A Deployment's pod: <name>-<template hash>-<5 random>; a DaemonSet's or a Job's:
    // <name>-<5 random>; a StatefulSet's: <name>-<ordinal>.
    if let Some((rest, tail)) = name.rsplit_once('-') {
        if (tail.len() == 5 && tail.bytes().all(is_random_char))
            || (!tail.is_empty() && tail.bytes().all(|b| b.is_ascii_digit()))
        {
            name = rest;
            if let Some((rest, tail)) = name.rsplit_once('-') {
                if (6..=10).contains(&tail.len()) && tail.bytes().all(is_random_char) {
                    name = rest;
                }
            }
        }
    }
    if name.is_empty() {
        pod
    } else {
        name
    }
}

/// Characters of the random suffixes Kubernetes makes (lower-case consonants and digits,
/// `k8s.io/apimachinery/pkg/util/rand`).
fn is_random_char(b: u8) -> bool {
    matches!(b, b'b'..=b'd' | b'f'..=b'h' | b'j'..=b'n' | b'p'..=b't' | b'v'..=b'x' | b'z' | b'2'..=b'9')
}

/// A file name in `/var/log/containers`: `<pod>_<namespace>_<container>-<id>.log` ->
/// (container id, its names). Names cannot hold `_`, and the id is the last `-` part.
pub fn parse_container_log(file: &str) -> Option<(&str, PodName)> {
    let stem = file.strip_suffix(".log")?;
    let (names, cid) = stem.rsplit_once('-')?;
    if cid.len() < 12 || !is_hex(cid) {
        return None;
    }
    let mut it = names.splitn(3, '_');
    let (pod, namespace, container) = (it.next()?, it.next()?, it.next()?);
    if pod.is_empty() || namespace.is_empty() || container.is_empty() || container.contains('_') {
        return None;
    }
    Some((
        cid,
        PodName {
            namespace: namespace.into(),
            pod: pod.into(),
            container: container.into(),
        },
    ))
}

/// A directory name in `/var/log/pods`: `<namespace>_<pod>_<uid>` -> (pod uid, its names).
pub fn parse_pod_log_dir(dir: &str) -> Option<(&str, PodName)> {
    let mut it = dir.splitn(3, '_');
    let (namespace, pod, uid) = (it.next()?, it.next()?, it.next()?);
    if namespace.is_empty() || pod.is_empty() || !looks_like_uid(uid) {
        return None;
    }
    Some((
        uid,
        PodName {
            namespace: namespace.into(),
            pod: pod.into(),
            container: SharedStr::empty(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CID: &str = "3f6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f";

    #[test]
    fn cgroup_systemd_driver_containerd() {
        let p = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/\
             kubepods-burstable-pod5f3c1e2a_8b7d_4c6e_9a1f_0d2b3c4e5f6a.slice/\
             cri-containerd-{CID}.scope"
        );
        let id = parse_cgroup(&p);
        assert_eq!(
            id.pod_uid.as_deref(),
            Some("5f3c1e2a-8b7d-4c6e-9a1f-0d2b3c4e5f6a")
        );
        assert_eq!(id.container_id.as_deref(), Some(CID));
        // Guaranteed QoS pods sit right under kubepods.slice.
        let p = format!(
            "/kubepods.slice/kubepods-pod5f3c1e2a_8b7d_4c6e_9a1f_0d2b3c4e5f6a.slice/crio-{CID}.scope"
        );
        let id = parse_cgroup(&p);
        assert_eq!(
            id.pod_uid.as_deref(),
            Some("5f3c1e2a-8b7d-4c6e-9a1f-0d2b3c4e5f6a")
        );
        assert_eq!(id.container_id.as_deref(), Some(CID));
    }

    #[test]
    fn cgroup_cgroupfs_driver_and_docker() {
        let p =
            format!("11:pids:/kubepods/burstable/pod5f3c1e2a-8b7d-4c6e-9a1f-0d2b3c4e5f6a/{CID}");
        let id = parse_cgroup(&p);
        assert_eq!(
            id.pod_uid.as_deref(),
            Some("5f3c1e2a-8b7d-4c6e-9a1f-0d2b3c4e5f6a")
        );
        assert_eq!(id.container_id.as_deref(), Some(CID));
        let id = parse_cgroup(&format!("0::/system.slice/docker-{CID}.scope"));
        assert_eq!(id.pod_uid, None);
        assert_eq!(id.container_id.as_deref(), Some(CID));
        let id = parse_cgroup(&format!("/docker/{CID}"));
        assert_eq!(id.container_id.as_deref(), Some(CID));
        // Host processes have neither.
        assert_eq!(
            parse_cgroup("0::/system.slice/kubelet.service"),
            CgroupIdentity::default()
        );
        assert_eq!(parse_cgroup("0::/"), CgroupIdentity::default());
        assert_eq!(parse_cgroup(""), CgroupIdentity::default());
    }

    #[test]
    fn kubelet_log_names() {
        let name = format!("kube-proxy-x7k2p_kube-system_kube-proxy-{CID}.log");
        let (cid, p) = parse_container_log(&name).unwrap();
        assert_eq!(cid, CID);
        assert_eq!(p.to_string(), "kube-system/kube-proxy-x7k2p/kube-proxy");
        assert_eq!(p.workload(), "kube-proxy");
        // Dashes in every name; the id is the last part.
        let name = format!("calico-node-4hk8z_calico-system_install-cni-{CID}.log");
        let (cid, p) = parse_container_log(&name).unwrap();
        assert_eq!(cid, CID);
        assert_eq!(
            (p.namespace.as_str(), p.pod.as_str(), p.container.as_str()),
            ("calico-system", "calico-node-4hk8z", "install-cni")
        );
        for bad in [
            "kube-proxy.log",
            "a_b_c-xyz.log",
            &format!("_ns_c-{CID}.log"),
            &format!("pod_ns_c-{CID}.txt"),
            &format!("pod_ns-{CID}.log"),
        ] {
            assert!(parse_container_log(bad).is_none(), "{bad}");
        }
        let (uid, p) = parse_pod_log_dir(
            "kube-system_coredns-5d78c9869d-h9xzq_0d2b3c4e-5f6a-4c6e-9a1f-5f3c1e2a8b7d",
        )
        .unwrap();
        assert_eq!(uid, "0d2b3c4e-5f6a-4c6e-9a1f-5f3c1e2a8b7d");
        assert_eq!(p.to_string(), "kube-system/coredns-5d78c9869d-h9xzq");
        assert_eq!(p.workload(), "coredns");
        assert!(parse_pod_log_dir("kube-system_coredns").is_none());
        assert!(parse_pod_log_dir("kube-system_coredns_notauid").is_none());
    }

    #[test]
    fn workloads() {
        for (pod, w) in [
            ("kube-proxy-x7k2p", "kube-proxy"),
            ("coredns-5d78c9869d-h9xzq", "coredns"),
            ("web-0", "web"),
            ("etcd-node-1", "etcd-node"),
            ("kube-apiserver-master", "kube-apiserver-master"),
            ("aws-node", "aws-node"),
            ("x-bbbbb", "x"),
            ("-bbbbb", "-bbbbb"),
        ] {
            assert_eq!(workload_of(pod), w, "{pod}");
        }
    }
}
