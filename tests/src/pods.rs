//! Kubernetes-shaped fixtures: a pod's cgroup and the kubelet's log files.

use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup` on a v2 node,
/// `/sys/fs/cgroup/unified` on a hybrid one).
pub fn cgroup2_root() -> Option<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "cgroup2")
        .map(|f| PathBuf::from(f[1]))
}

/// A container's cgroup laid out as the kubelet's systemd driver with containerd does
/// (`kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid>.slice/
/// cri-containerd-<id>.scope`), on the v2 hierarchy; removed (with its parents) on drop.
pub struct PodCgroup {
    pub dir: PathBuf,
    made: Vec<PathBuf>,
}

impl PodCgroup {
    pub fn new(pod_uid: &str, container_id: &str) -> Self {
        let root = cgroup2_root().expect("a cgroup2 hierarchy is mounted");
        let uid_ = pod_uid.replace('-', "_");
        let mut dir = root.clone();
        let mut made = Vec::new();
        for part in [
            "kubepods.slice".to_string(),
            "kubepods-besteffort.slice".to_string(),
            format!("kubepods-besteffort-pod{uid_}.slice"),
            format!("cri-containerd-{container_id}.scope"),
        ] {
            dir = dir.join(part);
            if !dir.exists() {
                fs::create_dir(&dir)
                    .unwrap_or_else(|e| panic!("create cgroup {}: {e}", dir.display()));
                made.push(dir.clone());
            }
        }
        Self { dir, made }
    }

    /// `program args` run inside this cgroup: a shell moves itself in, then execs it (so the
    /// program's exec already sees its cgroup, as in a container).
    pub fn command(&self, program: &Path, args: &[&str]) -> (PathBuf, Vec<String>) {
        let mut v = vec![
            "-c".to_string(),
            format!(
                "echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"",
                self.dir.display()
            ),
            program.display().to_string(),
        ];
        v.extend(args.iter().map(|s| s.to_string()));
        (PathBuf::from("/bin/sh"), v)
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        // Children first; a cgroup goes once its processes have exited.
        for d in self.made.iter().rev() {
            for _ in 0..50 {
                if fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The kubelet's log files of one container under `root`: the pod's directory
/// (`var/log/pods/<ns>_<pod>_<uid>/<container>/0.log`) and the container's link
/// (`var/log/containers/<pod>_<ns>_<container>-<id>.log`).
pub fn kubelet_logs(root: &Path, ns: &str, pod: &str, uid: &str, container: &str, cid: &str) {
    let dir = root.join(format!("var/log/pods/{ns}_{pod}_{uid}/{container}"));
    fs::create_dir_all(&dir).expect("pod log dir");
    let log = dir.join("0.log");
    fs::write(&log, "").expect("log file");
    let links = root.join("var/log/containers");
    fs::create_dir_all(&links).expect("containers dir");
    std::os::unix::fs::symlink(
        &log,
        links.join(format!("{pod}_{ns}_{container}-{cid}.log")),
    )
    .expect("log link");
}
