//! What continuous mode sees only through rule reads, made in the main run with exactly the
//! manifest's privileges: every feature on (`xtlock_feature_enabled`); a foreign rule
//! change, firewalld removing kube-proxy's chains, counted with its agent and owner, against
//! `iptables -S`'s own reading of the node's table before and after; and a Service routed to
//! a pod that is gone while kube-proxy's restore waits behind calico-node (the node of
//! `xtlock_tests::cluster` on the container's node namespace), against the client's own
//! results and the script's clock.
use std::{
    io::Write as _,
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _, Result};

use xtlock_tests::{
    cluster::{self, client_results, exit_time, kube_proxy_nat, DEAD, LIVE, T},
    monotonic_ns, Agent, Scratch,
};

use super::{engine::in_netns, manifest::PodRun, node_iptables, Node, Scrape, LOCK, NODE_NS};

/// kube-proxy's chains, as its restore writes them (`--noflush`: the node's other rules stay).
const KUBE_PROXY_RULES: &str = "*filter
:KUBE-SERVICES - [0:0]
:KUBE-SVC-XTLOCKDT - [0:0]
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-XTLOCKDT
-A KUBE-SVC-XTLOCKDT -m mark --mark 0x8000/0x8000 -j DROP
COMMIT
";

/// Every feature the daemon reports is on, or off for a kernel reason only.
pub fn features(m: &Scrape) -> Vec<(bool, String)> {
    let all = m.series("xtlock_feature_enabled");
    let mut on = Vec::new();
    let mut off = Vec::new();
    for l in &all {
        let name = l.get("feature").cloned().unwrap_or_default();
        match l.get("cause").map(String::as_str) {
            Some("") | None => on.push(name),
            Some(cause) => off.push(format!("{name} ({cause})")),
        }
    }
    let by_privilege: Vec<&String> = off.iter().filter(|o| o.ends_with("(privilege)")).collect();
    vec![
        (
            !all.is_empty() && by_privilege.is_empty(),
            format!(
                "features on with the manifest's privileges: {} (off: {})",
                on.join(", "),
                if off.is_empty() {
                    "none".to_owned()
                } else {
                    off.join(", ")
                }
            ),
        ),
        (
            [
                "rule_reads_legacy",
                "rule_reads_nft",
                "netns_entry",
                "conntrack_entries",
            ]
            .iter()
            .all(|f| on.iter().any(|o| o == f)),
            "rule reads (legacy and nf_tables), setns and conntrack entries on".to_owned(),
        ),
    ]
}

/// kube-proxy's restore writes its chains; firewalld (`iptables -F`, `-X`, as its reload
/// does) removes one. The daemon must count firewalld's change of kube-proxy's rules.
pub fn foreign_change(node: &Node, pod: &PodRun) -> Result<Vec<(bool, String)>> {
    let before = node.scrape(pod)?;
    let counted = |m: &Scrape| {
        m.sum(
            "xtlock_foreign_rule_changes_total",
            &[("agent", "firewalld"), ("owner", "kube-proxy")],
        )
    };
    let mut kp = in_netns(NODE_NS, node.agent("kube-proxy"))
        .arg("run")
        .arg(node.agent("iptables-restore"))
        .args(["-w", "5", "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("starting kube-proxy's restore")?;
    kp.stdin
        .take()
        .context("stdin")?
        .write_all(KUBE_PROXY_RULES.as_bytes())?;
    let st = kp.wait()?;
    ensure!(st.success(), "kube-proxy's restore failed: {st}");
    let saved = node_iptables(&["-S"])?;
    ensure!(
        saved.contains("-N KUBE-SVC-XTLOCKDT"),
        "iptables -S shows no kube-proxy chain after its restore:\n{saved}"
    );
    // The read after kube-proxy's write comes first: its rules are then kube-proxy's. The
    // write is counted when the kernel replaces the table, its read a few ms later, after
    // the writer's exit; writes of two agents between two reads are ambiguous and not
    // counted, so firewalld waits a second more.
    until(&|| {
        Ok(node
            .scrape(pod)?
            .sum("xtlock_rule_writes_total", &[("agent", "kube-proxy")])
            > before.sum("xtlock_rule_writes_total", &[("agent", "kube-proxy")]))
    })?;
    std::thread::sleep(Duration::from_secs(1));
    for args in [["-F", "KUBE-SVC-XTLOCKDT"], ["-X", "KUBE-SVC-XTLOCKDT"]] {
        // KUBE-SERVICES' jump to it goes first, as a reload flushes every chain.
        if args[0] == "-X" {
            firewalld(node, &["-w", "-F", "KUBE-SERVICES"])?;
        }
        firewalld(node, &[&["-w"][..], &args[..]].concat())?;
    }
    let after = node_iptables(&["-S"])?;
    let gone = !after.contains("KUBE-SVC-XTLOCKDT");
    let seen = until(&|| Ok(counted(&node.scrape(pod)?) > counted(&before)));
    let m = node.scrape(pod)?;
    let n = counted(&m) - counted(&before);
    Ok(vec![
        (
            gone,
            "iptables -S: firewalld removed kube-proxy's KUBE-SVC-XTLOCKDT".to_owned(),
        ),
        (
            seen.is_ok() && n >= 1.0,
            format!(
                "foreign rule changes of kube-proxy's rules by firewalld: {n} (at least 1: \
                 with the manifest's privileges the daemon reads the table after each write)"
            ),
        ),
    ])
}

fn firewalld(node: &Node, args: &[&str]) -> Result<()> {
    let st = in_netns(NODE_NS, node.agent("firewalld"))
        .arg("run")
        .arg(node.agent("iptables"))
        .args(args)
        .stdout(Stdio::null())
        .status()
        .context("running firewalld's iptables")?;
    ensure!(st.success(), "firewalld's iptables {args:?}: {st}");
    Ok(())
}

/// Polls `f` every 250 ms for up to 10 s (the daemon reads rules after each writer's exit).
fn until(f: &dyn Fn() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if f()? {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "not within 10 s");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The node gets a bridge, two pods serving on 8080 and a client; kube-proxy routes the web
/// Service to both; the client connects 40 times, 100 ms apart; calico-node holds the lock
/// 1.5 s while the first pod's veth is deleted and kube-proxy's restore that removes it
/// waits behind. The daemon must count the window (between calico-node's release and the
/// restore's exit, within 10 % or 100 ms), every connection the client saw refused, and the
/// pods' programming latency.
pub fn dead_endpoint(
    node: &Node,
    pod: &PodRun,
    helper: &std::path::Path,
) -> Result<Vec<(bool, String)>> {
    // The helper the scenario's agents are copies of (Scratch::agent).
    std::env::set_var("XTLOCK_TEST_HELPER", helper);
    let s = Scratch::new("deploy-dead-endpoint");
    let before = node.scrape(pod)?;
    let n = cluster::Node::on(NODE_NS, "xtdt", true);
    let pods = n.serve(&s, &[&["tcplisten", "8080"]]);
    // The node talks to both pods (their neighbour entries come up), then kube-proxy routes
    // the Service to them: their programming latency.
    n.probe_pods(&s);
    let both = s.dir.join("both.rules");
    let one = s.dir.join("one.rules");
    std::fs::write(&both, kube_proxy_nat(&[DEAD, LIVE]))?;
    std::fs::write(&one, kube_proxy_nat(&[LIVE]))?;
    let mut first = restore(node, &both);
    ensure!(
        first.wait_within(T) == 0,
        "kube-proxy's first restore: {:?}",
        first.seen
    );
    std::thread::sleep(Duration::from_millis(500));
    let mut client = n.connects(&s, "40", "100", "5000");
    std::thread::sleep(Duration::from_millis(600));
    let mut calico = Agent::spawn(
        &node.agent("calico-node"),
        &["hold", LOCK, "1500"],
        &[],
        None,
    );
    calico.expect("acquired", T);
    let del_start = monotonic_ns();
    xtlock_tests::sh("ip", &["-n", &n.pods[0], "link", "del", "eth0"]);
    let del_end = monotonic_ns();
    std::thread::sleep(Duration::from_millis(100));
    let mut fix = restore(node, &one);
    ensure!(
        fix.wait_within(T) == 0,
        "kube-proxy's restore: {:?}",
        fix.seen
    );
    let earliest = calico.ts("released", T);
    let exited = exit_time(&mut fix);
    client.expect("done", T);
    ensure!(calico.wait() == 0, "calico-node's hold failed");
    cluster::stop(pods);
    let results = client_results(&client);
    let refused = results.iter().filter(|r| **r == "EHOSTUNREACH").count() as f64;
    let ok = results.iter().filter(|r| **r == "ok").count();
    ensure!(
        results.len() == 40 && refused > 0.0 && ok + refused as usize == 40,
        "the client's 40 connections: {ok} ok, {refused} refused, {:?}",
        client.seen
    );
    // The window is reported 5 s after the fix (late refusals of connections DNATed before).
    let grew =
        |m: &Scrape, name: &str, want: &[(&str, &str)]| m.sum(name, want) - before.sum(name, want);
    let windows = |m: &Scrape| {
        grew(
            m,
            "xtlock_stale_endpoint_seconds_count",
            &[("agent", "kube-proxy")],
        )
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let m = loop {
        let m = node.scrape(pod)?;
        if windows(&m) >= 1.0 || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let stale = grew(
        &m,
        "xtlock_stale_endpoint_seconds_sum",
        &[("agent", "kube-proxy")],
    );
    let (lo, hi) = (
        earliest.saturating_sub(del_end) as f64 / 1e9,
        exited.saturating_sub(del_start) as f64 / 1e9,
    );
    let slack = (hi / 10.0).max(0.1);
    let counted = grew(&m, "xtlock_stale_endpoint_connections_total", &[]);
    let refused_counted = grew(
        &m,
        "xtlock_stale_endpoint_connections_total",
        &[("outcome", "icmp_unreachable: host unreachable")],
    );
    let programmed = grew(
        &m,
        "xtlock_endpoint_programming_seconds_count",
        &[("agent", "kube-proxy")],
    );
    Ok(vec![
        (
            windows(&m) == 1.0,
            format!(
                "dead endpoint: 1 window of routing to the gone pod fixed by kube-proxy: {}",
                windows(&m)
            ),
        ),
        (
            stale + slack >= lo && stale <= hi + slack,
            format!(
                "dead endpoint window {stale:.3} s within [{lo:.3}, {hi:.3}] (+-{slack:.3}: \
                 veth deleted .. calico-node's release, .. the restore's exit)"
            ),
        ),
        (
            refused_counted == refused && counted >= refused,
            format!(
                "connections refused by the gone pod: {refused_counted} (the client's \
                 EHOSTUNREACH: {refused}; all outcomes {counted})"
            ),
        ),
        (
            programmed >= 2.0,
            format!("programming latency of the two pods by kube-proxy: {programmed} (2)"),
        ),
    ])
}

/// kube-proxy's `iptables-restore -w` of `rules` in the node's namespace, on the node's lock.
fn restore(node: &Node, rules: &std::path::Path) -> Agent {
    Agent::spawn(
        std::path::Path::new("ip"),
        &[
            "netns",
            "exec",
            NODE_NS,
            &node.agent("kube-proxy").display().to_string(),
            "run",
            &node.agent("iptables-restore").display().to_string(),
            "-w",
        ],
        &[],
        Some(rules),
    )
}
