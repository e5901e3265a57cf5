//! `cargo xtask deploy-test`: the DaemonSet proven on this machine.
//!
//! 1. Lint: `deploy/daemonset.yaml` against the Kubernetes schema (kubernetes-validate, the
//!    oldest and newest version it ships) and a policy linter (checkov: no failed check; each
//!    skipped one is explained in deploy/README.md); `deploy/alerts.yaml` through `promtool
//!    check rules` and `promtool test rules deploy/alerts.test.yaml`, and the PrometheusRule
//!    variant holding the same groups.
//! 2. The image of `cargo xtask image`, loaded into a real container engine (podman, runc) run in a network
//!    namespace of its own (the "node"), started with exactly what the manifest grants
//!    (`manifest.rs` derives the flags from the YAML).
//! 3. On the node: a kube-proxy-named `iptables-legacy-restore` holds `/run/xtables.lock`
//!    while calico-node's `iptables-legacy -w` waits and kubelet's `-w 1` gives up (exit 4);
//!    calico-node's rule then drops UDP datagrams sent over a veth pair. `/metrics`, scraped
//!    from the container, must show the hold, the waits with their holder, the timeout, the
//!    execs and the drops, bracketed or counted exactly against what was done; `/readyz` 200.
//!    The PromQL of deploy/'s rule files and dashboards parsed and its series checked against
//!    that `/metrics` (`promql.rs`); a real Prometheus scraping the container with a node's
//!    labels evaluates the rules, and after a second round of contention its recording rules
//!    and a firing alert must say what the round made (`prom.rs`).
//! 4. `podman stop` (SIGTERM, the manifest's grace period): exit 0 in time, and the capture
//!    file on the node's record dir complete and replayable.
//! 5. `kubectl debug node --profile=sysadmin` emulated (`debug_node.rs`): the image run
//!    privileged with the host's namespaces and root at /host, with no xtlock flag, finds
//!    the host's lock by itself and names the holder and waiters.
//! 6. Least privilege (`privileges.rs`): one run without each capability, host namespace,
//!    mount and root; each must fail with a message or lose a named feature.
//! 7. With `--measure`: CPU and memory of the container idle, under a lock storm and under a
//!    drop storm (`measure.rs`).
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};
use clap::Args;
use serde_json::Value;

use crate::{image, setup, sh};

mod continuous;
mod debug_node;
mod engine;
mod lint;
pub mod manifest;
mod measure;
mod node_fs;
mod privileges;
mod prom;
mod promql;

use engine::{in_netns, Engine, Netns};
use manifest::{PodRun, Without};

/// The node's and the peer's network namespaces and addresses (private to this test).
pub const NODE_NS: &str = "xtlock-node";
pub const PEER_NS: &str = "xtlock-peer";
pub const NODE_IP: &str = "10.231.7.1";
pub const PEER_IP: &str = "10.231.7.2";
/// The lock the DaemonSet watches (its default), through the manifest's hostPath /run.
pub const LOCK: &str = "/run/xtables.lock";
/// The UDP port calico-node's rule drops.
const DROP_PORT: u16 = 9999;
/// Datagrams sent to it.
const DROPPED: u64 = 200;

#[derive(Args, Debug, Default)]
pub struct DeployArgs {
    /// Leave out the least-privilege runs (one container per privilege the manifest grants).
    #[arg(long)]
    pub no_privileges: bool,
    /// Also measure CPU and memory of the container: idle, lock storm, drop storm (~2 min).
    #[arg(long)]
    pub measure: bool,
    /// Use target/image as it is (no `cargo xtask image` first).
    #[arg(long)]
    pub no_build: bool,
    /// Leave out the manifest and alert checks.
    #[arg(long)]
    pub no_lint: bool,
    /// Skip `xtask setup`.
    #[arg(long)]
    pub no_setup: bool,
}

pub fn run(args: &DeployArgs) -> Result<()> {
    if !args.no_setup {
        setup::run()?;
    }
    let summary = run_steps(args)?;
    println!("deploy-test: ok ({summary})");
    Ok(())
}

/// Every step; a one-line summary of what was shown.
pub fn run_steps(args: &DeployArgs) -> Result<String> {
    ensure!(
        sh::is_root(),
        "deploy-test starts containers and loads BPF programs: run it as root"
    );
    // Before any thread starts: /var/log of this process only (the kubelet's directories).
    node_fs::private_mounts()?;
    let root = sh::workspace_root();
    let manifest_path = root.join("deploy/daemonset.yaml");
    let pod = manifest::read(&manifest_path)?;
    let mut notes = Vec::new();
    if !args.no_lint {
        let t = Instant::now();
        notes.push(lint::run(&root)?);
        println!("lint took {:.1} s", t.elapsed().as_secs_f64());
    }

    let t = Instant::now();
    let built = if args.no_build {
        let archive =
            image::image_dir(&root).join(format!("xtlock-{}.tar", env!("CARGO_PKG_VERSION")));
        ensure!(
            archive.exists(),
            "{} missing: run `cargo xtask image`",
            archive.display()
        );
        image::Built::existing(archive, format!("xtlock:{}", env!("CARGO_PKG_VERSION")))
    } else {
        image::build(&root)?
    };
    println!("image step took {:.1} s", t.elapsed().as_secs_f64());
    ensure!(
        pod.image == built.tag,
        "deploy/daemonset.yaml runs image {}, but this tree builds {}: update the manifest",
        pod.image,
        built.tag
    );
    let helper = build_helper(&root)?;

    let t = Instant::now();
    let node = Node::start(&root, &helper)?;
    node.engine
        .output(&["load", "-i", &built.archive.display().to_string()])?;
    let size = node
        .engine
        .output(&["image", "inspect", "-f", "{{.Size}}", &built.tag])?;
    println!("loaded {} into the node's podman: {size} bytes", built.tag);
    notes.push(format!("image {} bytes", size));
    notes.push(containerfile_parity(&node, &root, &built)?);

    let main = contention_run(&node, &pod, &root)?;
    notes.push(main);
    notes.push(debug_node::run(&node, &pod)?);
    if !args.no_privileges {
        notes.push(privileges::run(&node, &pod)?);
    }
    if args.measure {
        notes.push(measure::run(&node, &pod)?);
    }
    println!("container steps took {:.1} s", t.elapsed().as_secs_f64());
    Ok(notes.join("; "))
}

/// The Containerfile's final stage built by the engine itself (`podman build`, buildah) from
/// the same binary, standing in for the build stage (which needs a registry), must start the
/// same way as the image `cargo xtask image` wrote: the two paths share one definition.
fn containerfile_parity(node: &Node, root: &Path, built: &image::Built) -> Result<String> {
    let cf = fs::read_to_string(root.join("Containerfile")).context("Containerfile")?;
    let lines: Vec<&str> = cf.lines().collect();
    let last_from = lines
        .iter()
        .rposition(|l| l.trim_start().to_ascii_uppercase().starts_with("FROM "))
        .context("Containerfile: no FROM")?;
    let final_stage = &lines[last_from..];
    let ctx = node.work.join("containerfile-context");
    let _ = fs::remove_dir_all(&ctx);
    fs::create_dir_all(&ctx)?;
    fs::copy(&node.xtlock, ctx.join("xtlock")).context("copying the binary")?;
    let text = format!(
        "FROM scratch AS build\nCOPY xtlock /xtlock\n{}\n",
        final_stage.join("\n")
    );
    fs::write(ctx.join("Containerfile"), text)?;
    let tag = "localhost/xtlock-containerfile:test";
    let ctx_s = ctx.display().to_string();
    node.engine.output(&[
        "build",
        "-q",
        "-t",
        tag,
        "-f",
        &format!("{ctx_s}/Containerfile"),
        &ctx_s,
    ])?;
    // buildah adds a default PATH and its version label; neither is in the Containerfile.
    let fmt = "{{json .Config.Entrypoint}} {{json .Config.Cmd}} {{json .Config.ExposedPorts}} {{json .Config.User}} {{json .Config.WorkingDir}}";
    let theirs = node.engine.output(&["image", "inspect", "-f", fmt, tag])?;
    let ours = node
        .engine
        .output(&["image", "inspect", "-f", fmt, &built.tag])?;
    let _ = node.engine.output(&["rmi", "-f", tag]);
    ensure!(
        theirs == ours,
        "the Containerfile built by podman starts as {theirs}, cargo xtask image's as {ours}"
    );
    println!("  ok   podman build of the Containerfile's final stage: same start ({ours})");
    Ok("the Containerfile's final stage built by podman matches".into())
}

/// `cargo build` of the test helper that plays kube-proxy, calico-node and kubelet.
fn build_helper(root: &Path) -> Result<PathBuf> {
    sh::run(
        sh::cargo()
            .current_dir(root)
            .args(["build", "-p", "xtlock-tests", "--bin", "xtlock-test-helper"])
            // The environment of every `xtask test` step, so nothing is rebuilt for it.
            .env("XTLOCK_REQUIRE_EBPF", "1")
            .env("RUST_BACKTRACE", "1"),
    )?;
    Ok(sh::target_dir(root).join("debug/xtlock-test-helper"))
}

/// The node: its network namespaces, its container engine, and the agents' binaries.
pub struct Node {
    pub engine: Engine,
    /// calico-node's pod (cgroup, kubelet log files); dropped after the engine.
    pod: node_fs::Pod,
    _netns: Netns,
    bin: PathBuf,
    /// target/deploy-test
    pub work: PathBuf,
    /// The static xtlock of the image, for `xtlock report` on the host.
    pub xtlock: PathBuf,
}

impl Node {
    fn start(root: &Path, helper: &Path) -> Result<Self> {
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

/// `iptables-legacy -w ARGS` in the node's namespace.
pub fn node_iptables(args: &[&str]) -> Result<String> {
    let out = in_netns(NODE_NS, "iptables-legacy")
        .arg("-w")
        .args(args)
        .output()
        .context("running iptables-legacy")?;
    ensure!(
        out.status.success(),
        "iptables-legacy {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Packets counted by the first INPUT rule of the node whose line has `needle`.
pub fn rule_packets(needle: &str) -> Result<u64> {
    let out = node_iptables(&["-L", "INPUT", "-v", "-n", "-x"])?;
    out.lines()
        .find(|l| l.contains(needle))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no INPUT rule with `{needle}`:\n{out}"))
}

/// Sends `count` datagrams from the peer to the node's DROP_PORT; returns how many were sent.
pub fn send_udp(node: &Node, count: u64) -> Result<u64> {
    let out = in_netns(PEER_NS, node.agent("udp-sender"))
        .args([
            "udp",
            NODE_IP,
            &DROP_PORT.to_string(),
            &count.to_string(),
            "1",
        ])
        .output()
        .context("udp sender")?;
    ensure!(out.status.success(), "udp sender: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .context("udp sender printed no count")
}

/// (holders, waiters) of the lock file's inode in /proc/locks.
pub fn lock_state(ino: u64) -> (Vec<u32>, Vec<u32>) {
    let text = fs::read_to_string("/proc/locks").unwrap_or_default();
    let mut held = Vec::new();
    let mut waiting = Vec::new();
    for l in text.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        let (blocked, rest) = match w.get(1) {
            Some(&"->") => (true, &w[2..]),
            _ => (false, &w[1..]),
        };
        // FLOCK ADVISORY WRITE PID MAJ:MIN:INO START END
        let (Some(pid), Some(dev_ino)) = (rest.get(3), rest.get(4)) else {
            continue;
        };
        if dev_ino.rsplit(':').next() != Some(&ino.to_string()) {
            continue;
        }
        if let Ok(pid) = pid.parse() {
            if blocked {
                waiting.push(pid);
            } else {
                held.push(pid);
            }
        }
    }
    (held, waiting)
}

pub fn lock_inode() -> Result<u64> {
    use std::os::unix::fs::MetadataExt as _;
    Ok(fs::metadata(LOCK)
        .with_context(|| format!("{LOCK} (iptables makes it)"))?
        .ino())
}

/// Until `/proc/locks` shows a holder of the lock (`waiter` false) or a blocked waiter.
pub fn until_lock(ino: u64, waiter: bool, what: &str) -> Result<Instant> {
    until(what, Duration::from_secs(10), || {
        let (held, waiting) = lock_state(ino);
        !(if waiter { waiting } else { held }).is_empty()
    })
}

/// kubelet's `iptables -w 1` behind a holder: it must give up with exit status 4.
pub fn kubelet_gives_up(node: &Node) -> Result<()> {
    let mut kubelet = agent_iptables(node, "kubelet", &["-w", "1", "-C", "INPUT", "-j", "ACCEPT"])?;
    let code = kubelet.wait()?.code().unwrap_or(-1);
    ensure!(
        code == 4,
        "kubelet's iptables -w 1 behind the restore should exit 4, not {code}"
    );
    Ok(())
}

/// Polls `f` every 20 ms until true; the instant it was first seen true.
pub fn until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Result<Instant> {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return Ok(Instant::now());
        }
        ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A kube-proxy-style `iptables-restore -w 5 -W 100000 --noflush --counters` reading its
/// input slowly: it takes the lock at `*filter` and keeps it until it reads `COMMIT`.
pub struct Restore {
    child: Child,
    stdin: Option<ChildStdin>,
    pub spawned: Instant,
    pub first_write: Instant,
}

impl Restore {
    pub fn start(node: &Node) -> Result<Self> {
        let spawned = Instant::now();
        let mut child = in_netns(NODE_NS, node.agent("kube-proxy"))
            .arg("run")
            .arg(node.agent("iptables-restore"))
            .args(["-w", "5", "-W", "100000", "--noflush", "--counters"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .context("starting the restore")?;
        let mut stdin = child.stdin.take().context("stdin")?;
        let first_write = Instant::now();
        stdin.write_all(b"*filter\n")?;
        stdin.flush()?;
        Ok(Restore {
            child,
            stdin: Some(stdin),
            spawned,
            first_write,
        })
    }

    /// Writes COMMIT: (when, exit code, when it exited).
    pub fn commit(mut self) -> Result<(Instant, i32, Instant)> {
        let mut stdin = self.stdin.take().context("committed twice")?;
        let at = Instant::now();
        stdin.write_all(b"COMMIT\n")?;
        drop(stdin);
        let st = self.child.wait()?;
        Ok((at, st.code().unwrap_or(-1), Instant::now()))
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if self.stdin.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `AGENT run iptables ARGS` in the node's namespace (legacy backend).
pub fn agent_iptables(node: &Node, agent: &str, args: &[&str]) -> Result<Child> {
    let mut cmd = in_netns(NODE_NS, node.agent(agent));
    cmd.arg("run").arg(node.agent("iptables")).args(args);
    // calico-node runs in its pod, as on a node: the metrics name the pod.
    let mut cmd = if agent == node_fs::POD_WORKLOAD {
        node.pod.wrap(&cmd)?
    } else {
        cmd
    };
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {agent}"))
}

/// calico-node's rule, to add (`-A`) or delete (`-D`): UDP to DROP_PORT dropped in INPUT.
fn drop_rule(op: &str) -> Vec<String> {
    let port = DROP_PORT.to_string();
    [op, "INPUT", "-p", "udp", "--dport", &port, "-j", "DROP"]
        .map(String::from)
        .to_vec()
}

/// Adds (`-A`) or deletes (`-D`) calico-node's rule in the node's namespace, directly.
pub fn node_drop_rule(op: &str) -> Result<()> {
    let args = drop_rule(op);
    node_iptables(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
    Ok(())
}

/// calico-node's `iptables -w -A` of its rule, as a process of its pod (it waits while the
/// lock is held).
pub fn calico_adds_drop_rule(node: &Node) -> Result<Child> {
    let mut args = vec!["-w".to_string()];
    args.extend(drop_rule("-A"));
    agent_iptables(
        node,
        "calico-node",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    )
}

/// The capture files of the record dir (host side), name -> size.
pub fn captures(dir: &Path) -> BTreeMap<PathBuf, u64> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".xtlock"))
                .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default()
}

/// The host path of the manifest's `--record-dir`.
pub fn record_dir(pod: &PodRun) -> Result<PathBuf> {
    let i = pod
        .args
        .iter()
        .position(|a| a == "--record-dir")
        .context("the manifest passes no --record-dir")?;
    let dir = pod
        .args
        .get(i + 1)
        .context("--record-dir without a value")?;
    let m = pod
        .mounts
        .iter()
        .find(|m| &m.container_path == dir)
        .with_context(|| format!("--record-dir {dir} is not a mounted hostPath"))?;
    Ok(PathBuf::from(&m.host_path))
}

/// Removes the capture files a run made (the node's own are left alone).
pub struct CaptureGuard {
    dir: PathBuf,
    before: BTreeSet<PathBuf>,
    made_dir: bool,
}

impl CaptureGuard {
    pub fn new(dir: &Path) -> Self {
        CaptureGuard {
            dir: dir.to_owned(),
            before: captures(dir).into_keys().collect(),
            made_dir: !dir.exists(),
        }
    }

    pub fn new_files(&self) -> BTreeMap<PathBuf, u64> {
        captures(&self.dir)
            .into_iter()
            .filter(|(p, _)| !self.before.contains(p))
            .collect()
    }
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        for p in self.new_files().into_keys() {
            let _ = fs::remove_file(p);
        }
        if self.made_dir {
            let _ = fs::remove_dir(&self.dir);
        }
    }
}

/// A scrape of `/metrics`: (name, labels, value) per sample.
pub struct Scrape(pub Vec<(String, BTreeMap<String, String>, f64)>);

impl Scrape {
    pub fn parse(text: &str) -> Self {
        let mut v = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (series, value) = match line.rsplit_once(' ') {
                Some(x) => x,
                None => continue,
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, parse_labels(rest.trim_end_matches('}'))),
                None => (series, BTreeMap::new()),
            };
            v.push((name.to_owned(), labels, value));
        }
        Scrape(v)
    }

    /// Values of `name` whose labels include all of `want`.
    pub fn values(&self, name: &str, want: &[(&str, &str)]) -> Vec<f64> {
        self.0
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && want
                        .iter()
                        .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.2)
            .collect()
    }

    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.values(name, want).iter().sum()
    }

    pub fn series(&self, name: &str) -> Vec<&BTreeMap<String, String>> {
        self.0
            .iter()
            .filter(|s| s.0 == name)
            .map(|s| &s.1)
            .collect()
    }
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some((k, r)) = rest.split_once("=\"") {
        let mut val = String::new();
        let mut chars = r.char_indices();
        let mut end = r.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        val.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => val.push(c),
            }
        }
        out.insert(k.trim_start_matches(',').trim().to_owned(), val);
        rest = r[end..].trim_start_matches(',');
    }
    out
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The main run: contention, a timeout, drops, metrics against what was done, readiness,
/// SIGTERM and the capture file.
fn contention_run(node: &Node, pod: &PodRun, root: &Path) -> Result<String> {
    let name = "xtlock";
    let record = record_dir(pod)?;
    let guard = CaptureGuard::new(&record);
    let t = Instant::now();
    let prom = prom::Prometheus::start(&node.work, &root.join("deploy"), pod.port)?;
    println!("Prometheus ready in {:.1} s", secs(t.elapsed()));
    let started = Instant::now();
    node.run_container(name, pod, None)?;
    let ready = node.wait_ready(name, pod, Duration::from_secs(60));
    let ready = match ready {
        Ok(true) => started.elapsed(),
        Ok(false) => bail!(
            "the container exited before it was ready; logs:\n{}",
            node.logs(name)
        ),
        Err(e) => return Err(e),
    };
    println!("ready {:.2} s after podman run", secs(ready));
    let (code, body) = node.get(pod, &pod.liveness_path)?;
    ensure!(code == 200, "{} answered {code}: {body}", pod.liveness_path);
    // Prometheus' first scrape comes up to 5 s after it starts (its target updates are
    // batched): before it, the scenario's series would be born unseen.
    let t = Instant::now();
    let (up, _) = prom.until("up{job=\"xtlock\"} == 1", Duration::from_secs(20), |r| {
        !r.is_empty()
    })?;
    ensure!(
        up,
        "Prometheus did not scrape the daemon in 20 s: {}",
        prom.log()
    );
    println!(
        "Prometheus scraped the daemon {:.1} s later",
        secs(t.elapsed())
    );

    // Counters not tied to the lock file count every process of that name on the machine
    // (hostPID): they are checked as increases over the scenario.
    let before = node.scrape(pod)?;
    let ino = lock_inode()?;
    let Round {
        kp_spawned,
        first_write,
        kp_seen,
        commit_at,
        kp_exit,
        cn_spawned,
        cn_seen,
        cn_exit,
        ..
    } = contention_round(node, pod, ino, || calico_adds_drop_rule(node))?;

    let sent = send_udp(node, DROPPED)?;
    let rule = rule_packets(&format!("dpt:{DROP_PORT}"))?;
    ensure!(
        sent == DROPPED && rule == DROPPED,
        "sent {sent}, the rule counted {rule}: expected {DROPPED} both"
    );

    // Drops are read from the kernel every second: poll until they are all there.
    let lock_l = ("lock", LOCK);
    let deadline = Instant::now() + Duration::from_secs(15);
    let m = loop {
        let m = node.scrape(pod)?;
        let dropped = m.sum("xtlock_drops_total", &[("class", "netfilter_rule_drop")])
            - before.sum("xtlock_drops_total", &[("class", "netfilter_rule_drop")]);
        let waited = m.sum(
            "xtlock_lock_wait_seconds_count",
            &[("agent", "calico-node")],
        );
        if (dropped >= rule as f64 && waited >= 1.0) || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(300));
    };

    let mut checks: Vec<String> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    let mut check = |ok: bool, what: String| {
        println!("  {} {what}", if ok { "ok  " } else { "FAIL" });
        if ok {
            checks.push(what);
        } else {
            failed.push(what);
        }
    };
    let kp = [lock_l, ("agent", "kube-proxy"), ("role", "proxy")];
    let holds = m.sum("xtlock_lock_hold_seconds_count", &kp);
    let held = m.sum("xtlock_lock_hold_seconds_sum", &kp);
    let (lo, hi) = (secs(commit_at - kp_seen), secs(kp_exit - first_write));
    check(
        holds == 1.0,
        format!("kube-proxy holds: {holds} (1: the restore's *filter)"),
    );
    check(
        held >= lo && held <= hi,
        format!(
            "kube-proxy hold {held:.3} s within [{lo:.3}, {hi:.3}] (seen held .. COMMIT \
             written, first write .. exit)"
        ),
    );
    let cw = [
        lock_l,
        ("agent", "calico-node"),
        ("holder_agent", "kube-proxy"),
    ];
    let waits = m.sum("xtlock_lock_wait_seconds_count", &cw);
    let waited = m.sum("xtlock_lock_wait_seconds_sum", &cw);
    let (wlo, whi) = (secs(commit_at - cn_seen), secs(cn_exit - cn_spawned));
    check(
        waits == 1.0,
        format!("calico-node waits behind kube-proxy: {waits} (1)"),
    );
    check(
        waited >= wlo && waited <= whi,
        format!("calico-node wait {waited:.3} s within [{wlo:.3}, {whi:.3}] (seen waiting .. COMMIT, spawn .. exit)"),
    );
    let in_pod = m.sum(
        "xtlock_lock_wait_seconds_count",
        &[
            ("agent", "calico-node"),
            ("namespace", node_fs::POD_NAMESPACE),
            ("pod", node_fs::POD_WORKLOAD),
        ],
    );
    check(
        in_pod == 1.0,
        format!(
            "calico-node's wait names its pod {}/{} (from /var/log/pods, /var/log/containers): {in_pod} (1)",
            node_fs::POD_NAMESPACE,
            node_fs::POD_WORKLOAD
        ),
    );
    let kw = m.sum(
        "xtlock_lock_wait_seconds_count",
        &[lock_l, ("agent", "kubelet"), ("holder_agent", "kube-proxy")],
    );
    check(
        kw == 1.0,
        format!("kubelet waits behind kube-proxy: {kw} (1, timed out)"),
    );
    let grew = |name: &str, want: &[(&str, &str)]| m.sum(name, want) - before.sum(name, want);
    let to = grew("xtlock_lock_timeouts_total", &[("agent", "kubelet")]);
    check(
        to == 1.0,
        format!("kubelet lock timeouts (exit 4): {to} (1)"),
    );
    for (agent, want) in [("kube-proxy", 1.0), ("calico-node", 1.0), ("kubelet", 1.0)] {
        let n = grew("xtlock_iptables_exec_total", &[("agent", agent)]);
        check(
            n == want,
            format!("iptables execs by {agent}: {n} ({want})"),
        );
    }
    let rd = grew(
        "xtlock_iptables_restore_duration_seconds_count",
        &[("agent", "kube-proxy")],
    );
    check(rd == 1.0, format!("kube-proxy restore runs: {rd} (1)"));
    let rs = grew(
        "xtlock_iptables_restore_duration_seconds_sum",
        &[("agent", "kube-proxy")],
    );
    let (rlo, rhi) = (secs(commit_at - kp_seen), secs(kp_exit - kp_spawned));
    check(
        rs >= rlo && rs <= rhi,
        format!("kube-proxy restore ran {rs:.3} s within [{rlo:.3}, {rhi:.3}] (seen held .. COMMIT, spawn .. exit)"),
    );
    let dropped = grew(
        "xtlock_drops_total",
        &[
            ("class", "netfilter_rule_drop"),
            ("reason", "NETFILTER_DROP"),
        ],
    );
    check(
        dropped == rule as f64,
        format!("rule drops: {dropped} (the DROP rule's counter: {rule})"),
    );
    let located = m.series("xtlock_drops_total").iter().any(|l| {
        l.get("class").map(String::as_str) == Some("netfilter_rule_drop")
            && l.get("location").is_some_and(|loc| loc == "nf_hook_slow")
    });
    check(located, "drop location named (nf_hook_slow)".into());
    let lost = m.sum("xtlock_events_lost_total", &[]);
    check(lost == 0.0, format!("events lost: {lost} (0)"));
    let held_now = m.sum("xtlock_lock_held", &[lock_l]);
    check(held_now == 0.0, format!("lock held now: {held_now} (0)"));
    let attached = m.values("xtlock_probe_attached", &[]);
    check(
        !attached.is_empty() && attached.iter().all(|v| *v == 1.0),
        format!("{} probes attached, none detached", attached.len()),
    );
    let (rc, rb) = node.get(pod, &pod.readiness_path)?;
    check(
        rc == 200,
        format!("{} {rc} {}", pod.readiness_path, rb.trim()),
    );

    let (_, exposition) = node.get(pod, "/metrics")?;
    let t = Instant::now();
    let (fleet, during_hold) = fleet_run(node, pod, &prom, ino)?;
    for (ok, what) in fleet {
        check(ok, what);
    }
    println!("the Prometheus round took {:.1} s", secs(t.elapsed()));
    // What only rule reads give, with the manifest's privileges.
    for (ok, what) in continuous::features(&node.scrape(pod)?) {
        check(ok, what);
    }
    match continuous::foreign_change(node, pod) {
        Ok(v) => v.into_iter().for_each(|(ok, what)| check(ok, what)),
        Err(e) => check(false, format!("the foreign rule change: {e:#}")),
    }
    match continuous::dead_endpoint(node, pod, &node.agent("kube-proxy")) {
        Ok(v) => v.into_iter().for_each(|(ok, what)| check(ok, what)),
        Err(e) => check(false, format!("the dead endpoint: {e:#}")),
    }
    let (_, after_rules) = node.get(pod, "/metrics")?;
    // The rules' and dashboards' PromQL against this daemon's own exposition, after the
    // scenario and during a hold (the holder's series exists only then).
    match promql::check(root, &[exposition, during_hold, after_rules]) {
        Ok(note) => check(true, note),
        Err(e) => check(false, format!("{e:#}")),
    }

    let (took, code) = node.stop(name, pod)?;
    check(
        code == 0 && took < pod.grace,
        format!(
            "SIGTERM: exit {code} after {:.2} s (grace {} s)",
            secs(took),
            pod.grace.as_secs()
        ),
    );
    let files = guard.new_files();
    let capture_ok = match files.iter().next_back() {
        Some((f, size)) => {
            let out = Command::new(&node.xtlock)
                .args(["report", "--json"])
                .arg(f)
                .output()
                .context("xtlock report")?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = String::from_utf8_lossy(&out.stdout)
                .lines()
                .last()
                .unwrap_or_default()
                .to_owned();
            let v: Value = serde_json::from_str(&last).unwrap_or(Value::Null);
            let kp_holds = v["holds"]["kube-proxy"]["count"].as_u64();
            let foreign = v["foreign_changes"].as_array().is_some_and(|f| {
                f.iter()
                    .any(|r| r[0] == "firewalld" && r[1] == "kube-proxy")
            });
            let stale = v["services"]["stale_windows"].as_u64();
            // The restore's hold, the second round's (fleet_run), the chains' restore
            // (continuous::foreign_change), whose removal by firewalld the capture has too,
            // and the two of continuous::dead_endpoint, whose window it has (and maybe a
            // second, unfixed: the scenario's end deletes the live pod the rules still route to).
            let ok = out.status.success()
                && !stderr.contains("WARN")
                && v["type"] == "summary"
                && kp_holds == Some(5)
                && foreign
                && stale.is_some_and(|n| n >= 1);
            println!(
                "  capture {} ({size} bytes): report exit {}, kube-proxy holds {kp_holds:?}, \
                 firewalld's change of kube-proxy's rules {foreign}, stale windows {stale:?}{}",
                f.display(),
                out.status,
                if stderr.trim().is_empty() {
                    String::new()
                } else {
                    format!(", stderr: {}", stderr.trim())
                }
            );
            ok
        }
        None => false,
    };
    check(
        capture_ok,
        format!(
            "capture complete on the record dir {} ({} new file(s)), replayed by xtlock report",
            record.display(),
            files.len()
        ),
    );
    let logs = node.logs(name);
    check(
        logs.lines().any(|l| l.contains("\"stopped\"")),
        "the last log line says stopped".into(),
    );
    let _ = node.engine.output(&["rm", "-f", name]);
    node_drop_rule("-D")?;
    if !failed.is_empty() {
        bail!(
            "deploy-test: {} check(s) failed: {}\ncontainer logs:\n{logs}",
            failed.len(),
            failed.join("; ")
        );
    }
    Ok(format!(
        "{} checks on the contention run, ready in {:.1} s, stopped in {:.2} s",
        checks.len(),
        secs(ready),
        secs(took)
    ))
}

/// When each step of a contention round happened, and /metrics during its hold.
struct Round {
    kp_spawned: Instant,
    first_write: Instant,
    kp_seen: Instant,
    commit_at: Instant,
    kp_exit: Instant,
    cn_spawned: Instant,
    cn_seen: Instant,
    cn_exit: Instant,
    during_hold: String,
}

/// kube-proxy's restore holds the lock while calico-node's `iptables -w` (started by
/// `calico`) waits and kubelet's `-w 1` gives up; then the restore commits and calico-node
/// goes on. Both must succeed.
fn contention_round(
    node: &Node,
    pod: &PodRun,
    ino: u64,
    calico: impl FnOnce() -> Result<Child>,
) -> Result<Round> {
    let restore = Restore::start(node)?;
    let kp_seen = until_lock(ino, false, "kube-proxy's restore to hold the lock")?;
    let cn_spawned = Instant::now();
    let mut calico = calico()?;
    let cn_seen = until_lock(ino, true, "calico-node to wait for the lock")?;
    kubelet_gives_up(node)?;
    std::thread::sleep(Duration::from_millis(300));
    let (_, during_hold) = node.get(pod, "/metrics")?;
    let (first_write, kp_spawned) = (restore.first_write, restore.spawned);
    let (commit_at, kp_status, kp_exit) = restore.commit()?;
    ensure!(kp_status == 0, "the restore failed ({kp_status})");
    let cn_status = calico.wait()?.code().unwrap_or(-1);
    let cn_exit = Instant::now();
    ensure!(
        cn_status == 0,
        "calico-node's iptables -w failed ({cn_status})"
    );
    Ok(Round {
        kp_spawned,
        first_write,
        kp_seen,
        commit_at,
        kp_exit,
        cn_spawned,
        cn_seen,
        cn_exit,
        during_hold,
    })
}

/// A second round of the contention (the first made the series: a counter's first step is
/// invisible to rate()), then what Prometheus made of it through the recording rules and the
/// alerts: (passed, what) per check, and /metrics as it was during the hold.
fn fleet_run(
    node: &Node,
    pod: &PodRun,
    prom: &prom::Prometheus,
    ino: u64,
) -> Result<(Vec<(bool, String)>, String)> {
    let before = node.scrape(pod)?;
    let r = contention_round(node, pod, ino, || {
        agent_iptables(node, "calico-node", &["-w", "-L", "INPUT", "-n"])
    })?;
    let (hlo, hhi) = (
        secs(r.commit_at - r.kp_seen),
        secs(r.kp_exit - r.first_write),
    );
    let (wlo, whi) = (
        secs(r.commit_at - r.cn_seen),
        secs(r.cn_exit - r.cn_spawned),
    );
    let during_hold = r.during_hold;

    let mut out = Vec::new();
    let node_l = format!("node=\"{}\"", prom::NODE_NAME);
    let t = Duration::from_secs(20);
    // The daemon's own count, straight from /metrics: the rule must agree with it.
    let after = {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = node.scrape(pod)?;
            let grown = m.sum("xtlock_lock_timeouts_total", &[("agent", "kubelet")])
                > before.sum("xtlock_lock_timeouts_total", &[("agent", "kubelet")]);
            if grown || Instant::now() > deadline {
                break m;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let timeouts = after.sum("xtlock_lock_timeouts_total", &[("agent", "kubelet")]);
    let grew = timeouts - before.sum("xtlock_lock_timeouts_total", &[("agent", "kubelet")]);
    out.push((
        grew == 1.0,
        format!("round 2: kubelet lock timeouts grew by {grew} (1)"),
    ));
    // The scrape config's labels: `node` set, the xtlock pod's own pod label kept and the
    // daemon's (calico-node's workload) kept as exported_pod.
    let q = format!(
        "xtlock_lock_wait_seconds_count{{{node_l},agent=\"calico-node\",pod=\"{}\",exported_pod=\"{}\"}}",
        prom::POD_NAME,
        node_fs::POD_WORKLOAD
    );
    let (ok, _) = prom.until(&q, t, |r| r.iter().any(|(_, v)| *v >= 2.0))?;
    out.push((
        ok,
        format!("Prometheus has calico-node's 2 waits with node, pod and exported_pod: {q}"),
    ));
    let q = format!("node_agent:xtlock_lock_timeouts:increase10m{{{node_l},agent=\"kubelet\"}}");
    let (ok, r) = prom.until(&q, t, |r| r.iter().any(|(_, v)| *v == timeouts))?;
    out.push((
        ok,
        format!(
            "{q} = {:?} (the daemon's count: {timeouts}, a series newer than 10 minutes)",
            r.first().map(|x| x.1)
        ),
    ));
    let q = "ALERTS{alertname=\"XtablesLockTimeouts\",alertstate=\"firing\"}";
    let (ok, r) = prom.until(q, t, |r| !r.is_empty())?;
    let agents: Vec<&str> = r.iter().filter_map(|(l, _)| l["agent"].as_str()).collect();
    out.push((
        ok && agents == ["kubelet"],
        format!("alert XtablesLockTimeouts firing for {agents:?} ([\"kubelet\"])"),
    ));
    // Waits: calico-node's second wait behind kube-proxy, per second over 5 minutes. rate()
    // extrapolates past the first and last samples by up to one and a half scrape intervals,
    // a share that shrinks as samples accumulate: polled until within 25 % of the wait.
    let q = format!(
        "node_agent_holder:xtlock_lock_wait_seconds:rate5m{{{node_l},agent=\"calico-node\",holder_agent=\"kube-proxy\"}}"
    );
    let (ok, r) = prom.until(&q, t, |r| {
        r.iter()
            .any(|(_, v)| *v * 300.0 >= wlo && *v * 300.0 <= whi * 1.25)
    })?;
    let waited = r.first().map_or(0.0, |x| x.1 * 300.0);
    out.push((
        ok,
        format!(
            "{q} x 300 s = {waited:.3} s, the second wait (measured in [{wlo:.3}, {whi:.3}] s)"
        ),
    ));
    let q = "fleet_holder:xtlock_lock_wait_seconds:top10_rate5m{holder_agent=\"kube-proxy\"}";
    let (ok, r) = prom.until(q, t, |r| !r.is_empty())?;
    let nodes: Vec<&str> = r.iter().filter_map(|(l, _)| l["node"].as_str()).collect();
    out.push((
        ok && nodes == [prom::NODE_NAME],
        format!("top nodes by time waited behind kube-proxy: {nodes:?}"),
    ));
    // Holds: the p99 of kube-proxy's holds lies in the bucket of the measured hold.
    let q = format!("node_agent:xtlock_lock_hold_seconds:p99_5m{{{node_l},agent=\"kube-proxy\"}}");
    let (ok, r) = prom.until(&q, t, |r| r.iter().any(|(_, v)| v.is_finite()))?;
    let p99 = r.first().map_or(f64::NAN, |x| x.1);
    let bucket = prom::bucket_of(hlo, hhi);
    out.push((
        ok && bucket.is_some_and(|(lo, hi)| p99 > lo && p99 <= hi),
        format!("{q} = {p99:.3} s, in the bucket {bucket:?} of the hold (measured in [{hlo:.3}, {hhi:.3}] s)"),
    ));
    let q = format!("node_agent:xtlock_lock_hold_seconds:rate5m{{{node_l},agent=\"kube-proxy\"}}");
    let (ok, r) = prom.until(&q, t, |r| {
        r.iter()
            .any(|(_, v)| *v * 300.0 >= hlo && *v * 300.0 <= hhi * 1.25)
    })?;
    let held = r.first().map_or(0.0, |x| x.1 * 300.0);
    out.push((
        ok,
        format!("{q} x 300 s = {held:.3} s, the second hold (measured in [{hlo:.3}, {hhi:.3}] s)"),
    ));
    let q = format!("node_agent:xtlock_syncs:rate5m{{{node_l},agent=\"kube-proxy\"}}");
    let (ok, _) = prom.until(&q, t, |r| r.iter().any(|(_, v)| *v > 0.0))?;
    out.push((ok, format!("{q} > 0 (kube-proxy's restores completed)")));
    Ok((out, during_hold))
}
