//! The node: its network namespaces (the node's and a peer's), its container engine, the
//! agents' binaries (the test helper copied under kube-proxy's, calico-node's and kubelet's
//! names), and the containers run on it as the kubelet would.
use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};

use super::{
    engine::{self, Engine, Netns},
    manifest::{PodRun, Without},
    node_fs, node_iptables, Scrape, NODE_IP, NODE_NS, PEER_IP, PEER_NS,
};
use crate::{image, sh};

/// The node: its network namespaces, its container engine, and the agents' binaries.
pub struct Node {
    pub engine: Engine,
    /// calico-node's pod (cgroup, kubelet log files); dropped after the engine.
    pub(super) pod: node_fs::Pod,
    _netns: Netns,
    bin: PathBuf,
    /// target/deploy-test
    pub work: PathBuf,
    /// The static xtlock of the image, for `xtlock report` on the host.
    pub xtlock: PathBuf,
}

impl Node {
    pub(super) fn start(root: &Path, helper: &Path) -> Result<Self> {
        let work = sh::target_dir(root).join("deploy-test");
        let bin = work.join("bin");
        fs::create_dir_all(&bin)?;
        for agent in [
            "kube-proxy",
            "calico-node",
            "kubelet",
            "udp-sender",
            "netns-holder",
            "firewalld",
        ] {
            let dst = bin.join(agent);
            // Copied, not linked: the kernel's comm is the file's name.
            fs::copy(helper, &dst)
                .with_context(|| format!("copying {} to {}", helper.display(), dst.display()))?;
        }
        // `iptables` and `iptables-restore` as on a node whose alternatives point at the
        // legacy backend: xtables-legacy-multi picks the command from its argv[0], and the
        // kernel's comm is `iptables-restor`, as for kube-proxy's runs.
        let multi = sh::which("xtables-legacy-multi")
            .or_else(|| {
                Some(PathBuf::from("/usr/sbin/xtables-legacy-multi")).filter(|p| p.exists())
            })
            .context("no xtables-legacy-multi (apt-get install iptables)")?;
        for cmd in ["iptables", "iptables-restore"] {
            let link = bin.join(cmd);
            let _ = fs::remove_file(&link);
            std::os::unix::fs::symlink(&multi, &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
        let netns = Netns::pair(NODE_NS, PEER_NS, NODE_IP, PEER_IP)?;
        // Conntrack on in the node's namespace (any conntrack match does); this also makes
        // /run/xtables.lock, as iptables does on a real node.
        node_iptables(&[
            "-A",
            "INPUT",
            "-m",
            "conntrack",
            "--ctstate",
            "INVALID",
            "-j",
            "DROP",
        ])?;
        let engine = Engine::new(NODE_NS, &work.join("engine"))?;
        Ok(Node {
            engine,
            pod: node_fs::Pod::new()?,
            _netns: netns,
            bin,
            work,
            xtlock: image::image_dir(root).join("xtlock"),
        })
    }

    pub fn agent(&self, name: &str) -> PathBuf {
        self.bin.join(name)
    }

    /// Starts the container `name` for `pod` without `without`; returns its id.
    pub fn run_container(&self, name: &str, pod: &PodRun, without: Option<&Without>) -> Result<()> {
        let _ = self.engine.output(&["rm", "-f", name]);
        prepare_host_paths(pod, without)?;
        let mut a: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), name.into()];
        a.extend(pod.engine_flags(NODE_IP, without)?);
        a.extend(Engine::rlimit_flags());
        a.push(pod.image.clone());
        a.extend(pod.engine_args(NODE_IP)?);
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        println!("+ podman {}", refs.join(" "));
        self.engine.output(&refs)?;
        Ok(())
    }

    pub fn running(&self, name: &str) -> bool {
        self.engine
            .inspect(name, "{{.State.Running}}")
            .is_ok_and(|s| s == "true")
    }

    pub fn logs(&self, name: &str) -> String {
        self.engine
            .cmd()
            .args(["logs", name])
            .output()
            .map(|o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .unwrap_or_default()
    }

    /// Polls `/readyz` until 200 (Ok(true)), the container exits (Ok(false)), or `timeout`.
    pub fn wait_ready(&self, name: &str, pod: &PodRun, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.running(name) {
                return Ok(false);
            }
            // Something must exec for the first kernel event on a quiet node.
            let _ = Command::new("true").status();
            if let Ok((200, _)) = self.get(pod, &pod.readiness_path) {
                return Ok(true);
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not answer 200 within {timeout:?}: {:?}; logs:\n{}",
                    pod.readiness_path,
                    self.get(pod, &pod.readiness_path),
                    self.logs(name)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `GET path` on the container's port at the node IP, from the node's namespace.
    pub fn get(&self, pod: &PodRun, path: &str) -> Result<(u16, String)> {
        let addr: SocketAddr = format!("{NODE_IP}:{}", pod.port).parse()?;
        engine::http_get(NODE_NS, addr, path)
    }

    /// `/metrics`, parsed; the text is kept in target/deploy-test/metrics.txt.
    pub fn scrape(&self, pod: &PodRun) -> Result<Scrape> {
        let (code, body) = self.get(pod, "/metrics")?;
        ensure!(code == 200, "/metrics answered {code}: {body}");
        let _ = fs::write(self.work.join("metrics.txt"), &body);
        Ok(Scrape::parse(&body))
    }

    /// `podman stop -t GRACE` (SIGTERM, SIGKILL after GRACE): (time it took, exit code).
    pub fn stop(&self, name: &str, pod: &PodRun) -> Result<(Duration, i64)> {
        let t = Instant::now();
        self.engine
            .output(&["stop", "-t", &pod.grace.as_secs().to_string(), name])?;
        let took = t.elapsed();
        let code: i64 = self
            .engine
            .inspect(name, "{{.State.ExitCode}}")?
            .parse()
            .context("exit code")?;
        Ok((took, code))
    }

    /// The container's main process, as the host sees it.
    pub fn pid(&self, name: &str) -> Result<u32> {
        self.engine
            .inspect(name, "{{.State.Pid}}")?
            .parse()
            .context("container pid")
    }
}

/// What the kubelet does for hostPath types before starting the pod.
fn prepare_host_paths(pod: &PodRun, without: Option<&Without>) -> Result<()> {
    for m in &pod.mounts {
        if without.is_some_and(|w| w.removes_mount(&m.name)) {
            continue;
        }
        let p = Path::new(&m.host_path);
        match m.host_type.as_str() {
            "DirectoryOrCreate" => {
                fs::create_dir_all(p).with_context(|| format!("hostPath {}", m.host_path))?
            }
            "Directory" => ensure!(p.is_dir(), "hostPath {} is not a directory", m.host_path),
            "File" => ensure!(p.is_file(), "hostPath {} is not a file", m.host_path),
            "" => {}
            other => bail!("hostPath type {other} is not translated"),
        }
    }
    Ok(())
}
