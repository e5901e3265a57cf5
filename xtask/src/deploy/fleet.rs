//! The second contention round and what Prometheus made of it: the scrape config's labels,
//! the recording rules and a firing alert against what the round did.
use std::time::{Duration, Instant};

use anyhow::Result;

use super::{agent_iptables, manifest::PodRun, node_fs, prom, round::contention_round, secs, Node};

/// A second round of the contention (the first made the series: a counter's first step is
/// invisible to rate()), then what Prometheus made of it through the recording rules and the
/// alerts: (passed, what) per check, and /metrics as it was during the hold.
pub(super) fn fleet_run(
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
