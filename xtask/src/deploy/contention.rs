//! Step 3's main run and step 4: the daemon started as the manifest says, a contention round
//! (kube-proxy's restore holding the lock, calico-node waiting, kubelet giving up), drops, and
//! `/metrics` checked against what was done; then the second round (`fleet.rs`), what only rule
//! reads give (`continuous.rs`), the PromQL, SIGTERM and the capture file replayed.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};
use serde_json::Value;

use super::round::{contention_round, Round};
use super::{
    calico_adds_drop_rule, continuous, fleet::fleet_run, lock_inode, manifest::PodRun,
    node_drop_rule, node_fs, prom, promql, record_dir, rule_packets, secs, send_udp, CaptureGuard,
    Node, Scrape, DROPPED, DROP_PORT, LOCK,
};

/// The main run: contention, a timeout, drops, metrics against what was done, readiness,
/// SIGTERM and the capture file.
pub(super) fn contention_run(node: &Node, pod: &PodRun, root: &Path) -> Result<String> {
    let name = "xtlock";
    let record = record_dir(pod)?;
    let guard = CaptureGuard::new(&record);
    let (prom, ready) = start(node, pod, root, name)?;

    // Counters not tied to the lock file count every process of that name on the machine
    // (hostPID): they are checked as increases over the scenario.
    let before = node.scrape(pod)?;
    let ino = lock_inode()?;
    let round = contention_round(node, pod, ino, || calico_adds_drop_rule(node))?;
    let rule = drops(node)?;
    let m = scrape_until_seen(node, pod, &before, rule)?;

    let mut checks = Checks::default();
    lock_checks(&mut checks, &m, &before, &round);
    drop_checks(&mut checks, &m, &before, rule);
    let (rc, rb) = node.get(pod, &pod.readiness_path)?;
    checks.check(
        rc == 200,
        format!("{} {rc} {}", pod.readiness_path, rb.trim()),
    );
    later_checks(&mut checks, node, pod, root, &prom, ino)?;

    let (took, code) = node.stop(name, pod)?;
    checks.check(
        code == 0 && took < pod.grace,
        format!(
            "SIGTERM: exit {code} after {:.2} s (grace {} s)",
            secs(took),
            pod.grace.as_secs()
        ),
    );
    let files = guard.new_files();
    let capture_ok = capture_replays(node, &files)?;
    checks.check(
        capture_ok,
        format!(
            "capture complete on the record dir {} ({} new file(s)), replayed by xtlock report",
            record.display(),
            files.len()
        ),
    );
    let logs = node.logs(name);
    checks.check(
        logs.lines().any(|l| l.contains("\"stopped\"")),
        "the last log line says stopped".into(),
    );
    let _ = node.engine.output(&["rm", "-f", name]);
    node_drop_rule("-D")?;
    if !checks.failed.is_empty() {
        bail!(
            "deploy-test: {} check(s) failed: {}\ncontainer logs:\n{logs}",
            checks.failed.len(),
            checks.failed.join("; ")
        );
    }
    Ok(format!(
        "{} checks on the contention run, ready in {:.1} s, stopped in {:.2} s",
        checks.passed.len(),
        secs(ready),
        secs(took)
    ))
}

/// The checks of the run so far: each printed as it is made, its text kept.
#[derive(Default)]
struct Checks {
    passed: Vec<String>,
    failed: Vec<String>,
}

impl Checks {
    fn check(&mut self, ok: bool, what: String) {
        println!("  {} {what}", if ok { "ok  " } else { "FAIL" });
        if ok {
            self.passed.push(what);
        } else {
            self.failed.push(what);
        }
    }
}

/// Prometheus started, then the container `name`, ready and live, and scraped by Prometheus:
/// (Prometheus, how long the container took to be ready).
fn start(
    node: &Node,
    pod: &PodRun,
    root: &Path,
    name: &str,
) -> Result<(prom::Prometheus, Duration)> {
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
    Ok((prom, ready))
}

/// [`DROPPED`] datagrams from the peer to calico-node's rule: the rule's packet count, which
/// must be that many.
fn drops(node: &Node) -> Result<u64> {
    let sent = send_udp(node, DROPPED)?;
    let rule = rule_packets(&format!("dpt:{DROP_PORT}"))?;
    ensure!(
        sent == DROPPED && rule == DROPPED,
        "sent {sent}, the rule counted {rule}: expected {DROPPED} both"
    );
    Ok(rule)
}

/// `/metrics` once it shows the `rule` drops and calico-node's wait, or after 15 s.
fn scrape_until_seen(node: &Node, pod: &PodRun, before: &Scrape, rule: u64) -> Result<Scrape> {
    // Drops are read from the kernel every second: poll until they are all there.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let m = node.scrape(pod)?;
        let dropped = m.sum("xtlock_drops_total", &[("class", "netfilter_rule_drop")])
            - before.sum("xtlock_drops_total", &[("class", "netfilter_rule_drop")]);
        let waited = m.sum(
            "xtlock_lock_wait_seconds_count",
            &[("agent", "calico-node")],
        );
        if (dropped >= rule as f64 && waited >= 1.0) || Instant::now() > deadline {
            return Ok(m);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The round's hold, waits, timeout, execs and restore in `m` (`before` the round for the
/// counters of every process of a name), against when each step happened.
fn lock_checks(checks: &mut Checks, m: &Scrape, before: &Scrape, round: &Round) {
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
    } = *round;
    let lock_l = ("lock", LOCK);
    let kp = [lock_l, ("agent", "kube-proxy"), ("role", "proxy")];
    let holds = m.sum("xtlock_lock_hold_seconds_count", &kp);
    let held = m.sum("xtlock_lock_hold_seconds_sum", &kp);
    let (lo, hi) = (secs(commit_at - kp_seen), secs(kp_exit - first_write));
    checks.check(
        holds == 1.0,
        format!("kube-proxy holds: {holds} (1: the restore's *filter)"),
    );
    checks.check(
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
    checks.check(
        waits == 1.0,
        format!("calico-node waits behind kube-proxy: {waits} (1)"),
    );
    checks.check(
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
    checks.check(
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
    checks.check(
        kw == 1.0,
        format!("kubelet waits behind kube-proxy: {kw} (1, timed out)"),
    );
    let grew = |name: &str, want: &[(&str, &str)]| m.sum(name, want) - before.sum(name, want);
    let to = grew("xtlock_lock_timeouts_total", &[("agent", "kubelet")]);
    checks.check(
        to == 1.0,
        format!("kubelet lock timeouts (exit 4): {to} (1)"),
    );
    for (agent, want) in [("kube-proxy", 1.0), ("calico-node", 1.0), ("kubelet", 1.0)] {
        let n = grew("xtlock_iptables_exec_total", &[("agent", agent)]);
        checks.check(
            n == want,
            format!("iptables execs by {agent}: {n} ({want})"),
        );
    }
    let rd = grew(
        "xtlock_iptables_restore_duration_seconds_count",
        &[("agent", "kube-proxy")],
    );
    checks.check(rd == 1.0, format!("kube-proxy restore runs: {rd} (1)"));
    let rs = grew(
        "xtlock_iptables_restore_duration_seconds_sum",
        &[("agent", "kube-proxy")],
    );
    let (rlo, rhi) = (secs(commit_at - kp_seen), secs(kp_exit - kp_spawned));
    checks.check(
        rs >= rlo && rs <= rhi,
        format!("kube-proxy restore ran {rs:.3} s within [{rlo:.3}, {rhi:.3}] (seen held .. COMMIT, spawn .. exit)"),
    );
}

/// The `rule` drops with their location, no event lost, the lock free, every probe attached.
fn drop_checks(checks: &mut Checks, m: &Scrape, before: &Scrape, rule: u64) {
    let grew = |name: &str, want: &[(&str, &str)]| m.sum(name, want) - before.sum(name, want);
    let dropped = grew(
        "xtlock_drops_total",
        &[
            ("class", "netfilter_rule_drop"),
            ("reason", "NETFILTER_DROP"),
        ],
    );
    checks.check(
        dropped == rule as f64,
        format!("rule drops: {dropped} (the DROP rule's counter: {rule})"),
    );
    let located = m.series("xtlock_drops_total").iter().any(|l| {
        l.get("class").map(String::as_str) == Some("netfilter_rule_drop")
            && l.get("location").is_some_and(|loc| loc == "nf_hook_slow")
    });
    checks.check(located, "drop location named (nf_hook_slow)".into());
    let lost = m.sum("xtlock_events_lost_total", &[]);
    checks.check(lost == 0.0, format!("events lost: {lost} (0)"));
    let held_now = m.sum("xtlock_lock_held", &[("lock", LOCK)]);
    checks.check(held_now == 0.0, format!("lock held now: {held_now} (0)"));
    let attached = m.values("xtlock_probe_attached", &[]);
    checks.check(
        !attached.is_empty() && attached.iter().all(|v| *v == 1.0),
        format!("{} probes attached, none detached", attached.len()),
    );
}

/// The second round through Prometheus (`fleet.rs`), what only rule reads give
/// (`continuous.rs`), and the PromQL of deploy/ against this daemon's exposition.
fn later_checks(
    checks: &mut Checks,
    node: &Node,
    pod: &PodRun,
    root: &Path,
    prom: &prom::Prometheus,
    ino: u64,
) -> Result<()> {
    let (_, exposition) = node.get(pod, "/metrics")?;
    let t = Instant::now();
    let (fleet, during_hold) = fleet_run(node, pod, prom, ino)?;
    for (ok, what) in fleet {
        checks.check(ok, what);
    }
    println!("the Prometheus round took {:.1} s", secs(t.elapsed()));
    // What only rule reads give, with the manifest's privileges.
    for (ok, what) in continuous::features(&node.scrape(pod)?) {
        checks.check(ok, what);
    }
    match continuous::foreign_change(node, pod) {
        Ok(v) => v.into_iter().for_each(|(ok, what)| checks.check(ok, what)),
        Err(e) => checks.check(false, format!("the foreign rule change: {e:#}")),
    }
    match continuous::dead_endpoint(node, pod, &node.agent("kube-proxy")) {
        Ok(v) => v.into_iter().for_each(|(ok, what)| checks.check(ok, what)),
        Err(e) => checks.check(false, format!("the dead endpoint: {e:#}")),
    }
    let (_, after_rules) = node.get(pod, "/metrics")?;
    // The rules' and dashboards' PromQL against this daemon's own exposition, after the
    // scenario and during a hold (the holder's series exists only then).
    match promql::check(root, &[exposition, during_hold, after_rules]) {
        Ok(note) => checks.check(true, note),
        Err(e) => checks.check(false, format!("{e:#}")),
    }
    Ok(())
}

/// Whether the newest of the run's capture `files` replays in `xtlock report --json` with every
/// hold, firewalld's change and a stale window, and no warning.
fn capture_replays(node: &Node, files: &BTreeMap<PathBuf, u64>) -> Result<bool> {
    let Some((f, size)) = files.iter().next_back() else {
        return Ok(false);
    };
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
    Ok(ok)
}
