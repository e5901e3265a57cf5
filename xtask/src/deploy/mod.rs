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
//!
//! This file keeps the flow (the steps above, in order) and the image checks; the rest, one job
//! a file:
//! - `node.rs`: the node (network namespaces, podman, the agents' binaries) and the containers
//!   run on it as the kubelet would.
//! - `agents.rs`: what the agents do there (iptables, kube-proxy's restore, calico-node's drop
//!   rule, kubelet's timeout, the peer's datagrams) and /proc/locks' view of the lock.
//! - `contention.rs`: step 3's main run and its checks, then step 4 (SIGTERM, the capture).
//! - `fleet.rs`: the second round and what Prometheus made of it (`prom.rs` runs Prometheus,
//!   `promql.rs` checks the rules' and dashboards' PromQL).
//! - `continuous.rs`: what only the rule reads give (a foreign rule change, a dead endpoint).
//! - `scrape.rs`: `/metrics` parsed; `captures.rs`: the record dir's capture files.
//! - `lint.rs`, `manifest.rs` (the manifest read and turned into engine flags), `engine.rs`
//!   (the node's network namespaces and podman in them), `node_fs.rs` (the kubelet's files and calico-node's pod),
//!   `debug_node.rs`, `privileges.rs`, `measure.rs`: as the steps above say.
use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _, Result};
use clap::Args;

use crate::{image, setup, sh};

mod agents;
mod captures;
mod contention;
mod continuous;
mod debug_node;
mod engine;
mod fleet;
mod lint;
pub mod manifest;
mod measure;
mod node;
mod node_fs;
mod privileges;
mod prom;
mod promql;
mod round;
mod scrape;

// The steps' files reach these through `super::`.
use agents::{
    agent_iptables, calico_adds_drop_rule, kubelet_gives_up, lock_inode, node_drop_rule,
    node_iptables, rule_packets, send_udp, until, until_lock, Restore,
};
use captures::{record_dir, CaptureGuard};
use node::Node;
use scrape::Scrape;

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

    let main = contention::contention_run(&node, &pod, &root)?;
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

/// Seconds of `d`, for the checks' texts.
fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
