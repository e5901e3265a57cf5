//! Incident-time use: the image run the way `kubectl debug node/NODE -it --profile=sysadmin`
//! runs it (privileged, the host's PID, network and IPC namespaces, the host's root
//! bind-mounted at `/host`), with no xtlock flag but the output format. Inside, the
//! container's own `/run` is not the host's: xtlock must find the host's lock file by itself,
//! say which path and inode it watches in its first line, and report the hold and the waits
//! of a kube-proxy-style restore and a CNI-style `iptables -w` contending on the node.
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use serde_json::Value;

use super::{
    agent_iptables, kubelet_gives_up, lock_inode, node_fs, until, until_lock, Node, Restore, LOCK,
};
use crate::deploy::manifest::PodRun;

const NAME: &str = "xtlock-debug";

/// What `kubectl debug node --profile=sysadmin` asks of the runtime (kubectl's
/// `sysadmin` profile: privileged, hostPID, hostNetwork, hostIPC, the node's `/` at
/// `/host`).
const DEBUG_FLAGS: &[&str] = &[
    "--privileged",
    "--pid=host",
    "--network=host",
    "--ipc=host",
    "--volume=/:/host",
];

pub fn run(node: &Node, pod: &PodRun) -> Result<String> {
    let _ = node.engine.output(&["rm", "-f", NAME]);
    let ino = lock_inode()?;
    let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), NAME.into()];
    args.extend(DEBUG_FLAGS.iter().map(|s| s.to_string()));
    args.extend(super::engine::Engine::rlimit_flags());
    // The image's entrypoint is xtlock; `--duration` only bounds a run that lost its test.
    args.extend([pod.image.as_str(), "trace", "--json", "--duration", "120s"].map(String::from));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    println!("+ podman {}", refs.join(" "));
    node.engine.output(&refs)?;
    let result = scenario(node, ino);
    let _ = node.engine.output(&["rm", "-f", "-t", "0", NAME]);
    result
}

fn scenario(node: &Node, ino: u64) -> Result<String> {
    // Attached once it says so (the logs hold stdout and stderr).
    until(
        "the debug container to trace",
        Duration::from_secs(60),
        || node.logs(NAME).contains("hooks attached)") || !node.running(NAME),
    )?;
    ensure!(
        node.running(NAME),
        "the debug container exited before it traced:\n{}",
        node.logs(NAME)
    );

    let restore = Restore::start(node)?;
    let kp_seen = until_lock(ino, false, "kube-proxy's restore to hold the lock")?;
    let mut calico = agent_iptables(node, "calico-node", &["-w", "-C", "INPUT", "-j", "ACCEPT"])?;
    until_lock(ino, true, "calico-node to wait for the lock")?;
    kubelet_gives_up(node)?;
    std::thread::sleep(Duration::from_millis(200));
    let first_write = restore.first_write;
    let (commit_at, kp, kp_exit) = restore.commit()?;
    ensure!(kp == 0, "the restore failed ({kp})");
    // `-C` of a rule that is not there: 1, after it got the lock.
    let cn = calico.wait()?.code().unwrap_or(-1);
    ensure!(
        cn == 1,
        "calico-node's iptables -w -C: exit {cn}, expected 1"
    );
    std::thread::sleep(Duration::from_millis(300));

    // Ctrl-C, as the SRE would.
    node.engine.output(&["kill", "--signal", "INT", NAME])?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while node.running(NAME) {
        ensure!(
            Instant::now() < deadline,
            "the debug container did not stop within 20 s of SIGINT:\n{}",
            node.logs(NAME)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let code = node.engine.inspect(NAME, "{{.State.ExitCode}}")?;
    // stdout (the JSON facts) and stderr (the log, first line first), apart.
    let out = node
        .engine
        .cmd()
        .args(["logs", NAME])
        .output()
        .context("podman logs")?;
    let (facts_text, log_text) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    let logs = format!("{log_text}{facts_text}");
    let _ = std::fs::write(node.work.join("debug-node.log"), &logs);
    ensure!(code == "0", "xtlock exited {code}:\n{logs}");

    // The first line of output: the host's lock, by path and inode, and why.
    let first = log_text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    ensure!(
        first.contains(&format!("(inode {ino}), the host's {LOCK}")),
        "the first line should name the host's {LOCK} (inode {ino}):\n{first}"
    );
    let facts: Vec<Value> = facts_text
        .lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let of = |t: &'static str| facts.iter().filter(move |f| f["type"] == t);
    let holds: Vec<&Value> = of("hold").filter(|h| h["agent"] == "kube-proxy").collect();
    ensure!(
        holds.len() == 1,
        "kube-proxy holds: {} (1):\n{logs}",
        holds.len()
    );
    let held = holds[0]["hold_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
    let (lo, hi) = (
        (commit_at - kp_seen).as_secs_f64(),
        (kp_exit - first_write).as_secs_f64(),
    );
    ensure!(
        held >= lo && held <= hi,
        "kube-proxy hold {held:.3} s not within [{lo:.3}, {hi:.3}]"
    );
    let behind_kp = |agent: &str| {
        of("wait")
            .filter(|w| w["agent"] == agent && w["holders"][0]["agent"] == "kube-proxy")
            .count()
    };
    let (cw, kw) = (behind_kp("calico-node"), behind_kp("kubelet"));
    ensure!(
        cw == 1 && kw == 1,
        "waits behind kube-proxy: calico-node {cw}, kubelet {kw} (1 each):\n{logs}"
    );
    let timeouts = of("timeout").filter(|t| t["agent"] == "kubelet").count();
    ensure!(timeouts == 1, "kubelet lock timeouts: {timeouts} (1)");
    // The kubelet's files under /host name calico-node's pod.
    let in_pod = of("wait").any(|w| {
        w["agent"] == "calico-node"
            && w["pod"]["namespace"] == node_fs::POD_NAMESPACE
            && w["pod"]["name"] == node_fs::POD_NAME
    });
    ensure!(
        in_pod,
        "calico-node's wait should name its pod {}/{}:\n{logs}",
        node_fs::POD_NAMESPACE,
        node_fs::POD_NAME
    );
    let lost = of("summary")
        .next_back()
        .and_then(|s| s["lost_events"].as_u64())
        .context("no summary at exit")?;
    ensure!(lost == 0, "events lost: {lost}");
    println!(
        "  ok   debug node: {first}\n  ok   kube-proxy hold {held:.3} s, calico-node and kubelet \
         wait behind it (kubelet timed out), calico-node in its pod, nothing lost"
    );
    Ok(format!(
        "kubectl debug node emulation: the host's lock (inode {ino}) found with no flag, 1 hold, 2 waits named"
    ))
}
