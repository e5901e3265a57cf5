//! The "node" of the deploy test: a network namespace of its own, joined by a veth pair to a
//! second one (a peer sending packets), and a real container engine (podman, with runc)
//! run inside the first, with storage of its own and no network set-up of its own. The host's
//! firewall and the host's containers (if any) are never touched. Everything is removed on drop,
//! also when the test fails.
use std::{
    fs,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context as _, Result};

use crate::sh;

/// Named network namespaces (`/run/netns/NAME`), deleted on drop.
pub struct Netns {
    pub names: Vec<String>,
}

impl Netns {
    /// The node (`node`, address `node_ip`/24) and a peer (`peer`, `peer_ip`) over veth.
    pub fn pair(node: &str, peer: &str, node_ip: &str, peer_ip: &str) -> Result<Self> {
        for n in [node, peer] {
            // Left over by a killed run.
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
        }
        let me = Netns {
            names: vec![node.to_owned(), peer.to_owned()],
        };
        for n in [node, peer] {
            sh::run(Command::new("ip").args(["netns", "add", n]))?;
        }
        let (vn, vp) = ("xtl-node0", "xtl-peer0");
        sh::run(Command::new("ip").args([
            "-n", node, "link", "add", vn, "type", "veth", "peer", "name", vp, "netns", peer,
        ]))?;
        for (ns, dev, ip) in [(node, vn, node_ip), (peer, vp, peer_ip)] {
            sh::run(Command::new("ip").args([
                "-n",
                ns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                dev,
            ]))?;
            sh::run(Command::new("ip").args(["-n", ns, "link", "set", dev, "up"]))?;
            sh::run(Command::new("ip").args(["-n", ns, "link", "set", "lo", "up"]))?;
        }
        Ok(me)
    }

    pub fn path(name: &str) -> PathBuf {
        Path::new("/run/netns").join(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// `nsenter --net=/run/netns/NS PROG ARGS` (unlike `ip netns exec`, it leaves /sys alone, so
/// tracefs stays mounted for the engine and its containers).
pub fn in_netns(ns: &str, prog: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net={}", Netns::path(ns).display()))
        .arg("--")
        .arg(prog);
    c
}

/// Podman, run inside the node's network namespace (so `--network host` is the node's),
/// with storage and runtime state of its own: the machine's containers and images, if any,
/// are never touched. Podman has no daemon: each command is a process; each container's
/// conmon stays in the node's namespace. Every container and the storage are removed on
/// drop.
///
/// Why podman and not Debian 12's docker (20.10): dockerd refuses `--cap-add CAP_BPF`
/// ("unknown capability"), so it cannot grant what the manifest grants.
pub struct Engine {
    netns: String,
    podman: PathBuf,
    pub dir: PathBuf,
    runroot: PathBuf,
}

impl Engine {
    /// Storage under `dir` (wiped first), runtime state under `/run/xtlock-deploy-test`.
    pub fn new(netns: &str, dir: &Path) -> Result<Self> {
        let podman = sh::which("podman")
            .context("no podman on PATH (apt-get install podman; ./xtask/run setup does)")?;
        let runroot = PathBuf::from("/run/xtlock-deploy-test");
        // Left by a run that was killed before it could clean up.
        unmount_under(&runroot);
        unmount_under(dir);
        let _ = fs::remove_dir_all(&runroot);
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::create_dir_all(&runroot)?;
        let e = Engine {
            netns: netns.to_owned(),
            podman,
            dir: dir.to_owned(),
            runroot,
        };
        let v = e.output(&["version", "--format", "{{.Client.Version}}"])?;
        println!(
            "podman {v} in network namespace {netns}, storage in {}",
            dir.display()
        );
        Ok(e)
    }

    pub fn cmd(&self) -> Command {
        let mut c = in_netns(&self.netns, &self.podman);
        c.arg(format!("--root={}", self.dir.join("storage").display()))
            .arg(format!("--runroot={}", self.runroot.join("run").display()))
            .arg(format!("--tmpdir={}", self.runroot.join("tmp").display()))
            .args([
                "--storage-driver=vfs",
                "--cgroup-manager=cgroupfs",
                "--events-backend=file",
                // What most Kubernetes nodes run under containerd.
                "--runtime=runc",
                "--log-level=error",
            ]);
        c
    }

    /// Runs `podman ARGS`, fails with its stderr; returns stdout.
    pub fn output(&self, args: &[&str]) -> Result<String> {
        let out = self
            .cmd()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .context("running podman")?;
        if !out.status.success() {
            bail!(
                "podman {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// `podman inspect -f FORMAT NAME`.
    pub fn inspect(&self, name: &str, format: &str) -> Result<String> {
        self.output(&["inspect", "-f", format, name])
    }

    /// Podman sets rlimits on every container (docker and Kubernetes' CRI leave the
    /// runtime's), and cannot raise them without CAP_SYS_RESOURCE: pass the ones podman
    /// itself runs with (it lowers its NPROC to 32768 and raises NOFILE to its hard limit),
    /// i.e. what the container would inherit.
    pub fn rlimit_flags() -> Vec<String> {
        let get = |r| {
            let mut l = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: valid out-pointer.
            unsafe { libc::getrlimit(r, &mut l) };
            l.rlim_max
        };
        let nofile = get(libc::RLIMIT_NOFILE).min(1 << 20);
        let nproc = get(libc::RLIMIT_NPROC).min(32768);
        vec![
            "--ulimit".into(),
            format!("nofile={nofile}:{nofile}"),
            "--ulimit".into(),
            format!("nproc={nproc}:{nproc}"),
        ]
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.output(&["rm", "-a", "-f", "-t", "0"]);
        unmount_under(&self.runroot);
        unmount_under(&self.dir);
        let _ = fs::remove_dir_all(&self.runroot);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Lazily unmounts whatever is still mounted under `dir` (deepest first).
fn unmount_under(dir: &Path) {
    let Ok(mounts) = fs::read_to_string("/proc/self/mounts") else {
        return;
    };
    let prefix = dir.display().to_string();
    let mut points: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = Command::new("umount").args(["-l", p]).status();
    }
}

/// `GET path` over HTTP/1.0 from inside network namespace `ns` (a thread joins it; the socket
/// stays there): (status, body).
pub fn http_get(ns: &str, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let ns_file = fs::File::open(Netns::path(ns))
        .with_context(|| format!("opening {}", Netns::path(ns).display()))?;
    let path = path.to_owned();
    let t = std::thread::spawn(move || -> Result<(u16, String)> {
        // SAFETY: plain syscall on a valid fd; only this short-lived thread changes namespace.
        if unsafe { libc::setns(ns_file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error()).context("setns");
        }
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf)?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    });
    t.join()
        .map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?
}
