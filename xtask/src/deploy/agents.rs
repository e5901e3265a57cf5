//! What the agents do on the node: `iptables` in the node's namespace, kube-proxy's slow
//! restore holding the lock, calico-node's drop rule, kubelet's `-w 1` giving up, the peer's
//! datagrams; and the lock's holders and waiters as /proc/locks shows them.
use std::{
    fs,
    io::Write as _,
    process::{Child, ChildStdin, Stdio},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _, Result};

use super::{engine::in_netns, node_fs, Node, DROP_PORT, LOCK, NODE_IP, NODE_NS, PEER_NS};

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
