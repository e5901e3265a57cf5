//! What the test's node has on disk besides the lock: the kubelet's log directories and a
//! pod's cgroup, so the DaemonSet's `/var/log/pods` and `/var/log/containers` mounts have
//! something to name. All of it private to this process: `/var/log` is a tmpfs in a mount
//! namespace of its own (the host's logs are neither read nor written), and the cgroup is
//! removed on drop.
use std::{
    ffi::CString,
    fs,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};

/// The pod calico-node's `iptables -w` runs in (names as the kubelet lays them out).
pub const POD_NAMESPACE: &str = "kube-system";
pub const POD_NAME: &str = "calico-node-x7k2p";
/// What the metrics' `pod` label holds: the pod's name without its controller's suffix.
pub const POD_WORKLOAD: &str = "calico-node";
const POD_UID: &str = "5f3c1e2a-8b7d-4c6e-9a1f-0d2b3c4e5f6a";
const CONTAINER: &str = "calico-node";
const CONTAINER_ID: &str = "3f6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f";

fn mount(src: &str, target: &str, fstype: Option<&str>, flags: libc::c_ulong) -> Result<()> {
    let c = |s: &str| CString::new(s).context("NUL in a mount argument");
    let (src_c, target_c) = (c(src)?, c(target)?);
    let fstype_c = fstype.map(c).transpose()?;
    // SAFETY: valid NUL-terminated strings that outlive the call; no data argument.
    let r = unsafe {
        libc::mount(
            src_c.as_ptr(),
            target_c.as_ptr(),
            fstype_c.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mount {src} on {target}"));
    }
    Ok(())
}

/// A mount namespace of this process's own, receiving the host's mounts but sending none
/// back, with a tmpfs on `/var/log` holding the kubelet's (empty) log directories. Must run
/// before any thread is started (unshare(CLONE_NEWNS) refuses a shared fs context).
pub fn private_mounts() -> Result<()> {
    // SAFETY: plain syscall; this process has one thread here.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(std::io::Error::last_os_error()).context("unshare(CLONE_NEWNS)");
    }
    mount("none", "/", None, libc::MS_REC | libc::MS_SLAVE)?;
    mount("tmpfs", "/var/log", Some("tmpfs"), 0)?;
    for d in ["/var/log/pods", "/var/log/containers"] {
        fs::create_dir_all(d).with_context(|| format!("creating {d}"))?;
    }
    Ok(())
}

/// Where the cgroup v2 hierarchy is (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a
/// hybrid node).
fn cgroup2_root() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").context("/proc/self/mounts")?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "cgroup2")
        .map(|f| PathBuf::from(f[1]))
        .context("no cgroup2 hierarchy mounted")
}

/// calico-node's pod: its cgroup (the kubelet's systemd driver with containerd) and its log
/// directory and link, as the kubelet makes them.
pub struct Pod {
    cgroup: PathBuf,
    made: Vec<PathBuf>,
}

impl Pod {
    pub fn new() -> Result<Self> {
        let pod_dir = Path::new("/var/log/pods")
            .join(format!("{POD_NAMESPACE}_{POD_NAME}_{POD_UID}"))
            .join(CONTAINER);
        fs::create_dir_all(&pod_dir).with_context(|| format!("creating {}", pod_dir.display()))?;
        let log = pod_dir.join("0.log");
        fs::write(&log, "")?;
        let link = Path::new("/var/log/containers").join(format!(
            "{POD_NAME}_{POD_NAMESPACE}_{CONTAINER}-{CONTAINER_ID}.log"
        ));
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&log, &link)
            .with_context(|| format!("linking {}", link.display()))?;

        let mut dir = cgroup2_root()?;
        let mut made = Vec::new();
        let uid_ = POD_UID.replace('-', "_");
        for part in [
            "kubepods.slice".to_owned(),
            "kubepods-besteffort.slice".to_owned(),
            format!("kubepods-besteffort-pod{uid_}.slice"),
            format!("cri-containerd-{CONTAINER_ID}.scope"),
        ] {
            dir = dir.join(part);
            if !dir.exists() {
                fs::create_dir(&dir)
                    .with_context(|| format!("creating cgroup {}", dir.display()))?;
                made.push(dir.clone());
            }
        }
        Ok(Pod { cgroup: dir, made })
    }

    /// `cmd` run inside the pod's cgroup: a shell moves itself in, then execs it, so the
    /// program's first event already shows its pod.
    pub fn wrap(&self, cmd: &Command) -> Result<Command> {
        let mut c = Command::new("/bin/sh");
        c.arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"",
                self.cgroup.display()
            ))
            .arg(cmd.get_program());
        c.args(cmd.get_args());
        if cmd.get_envs().next().is_some() || cmd.get_current_dir().is_some() {
            bail!("Pod::wrap keeps only the program and its arguments");
        }
        Ok(c)
    }
}

impl Drop for Pod {
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
