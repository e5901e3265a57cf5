//! Bench 3: a drop storm. UDP datagrams from one network namespace to another over a veth
//! pair, into an iptables DROP rule, as fast as this machine sends them: packets/s with no
//! tracer, with a bpftrace `kfree_skb` counting script, and with `xtlock trace` counting
//! drops (once it can: `--drop-samples`); and each tracer's count against the rule counter.
use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use super::{
    run::{self, rotation, BpfStats, ProgStats, Session, Tracer},
    stats::{num, table, Dist},
    Env,
};
use crate::sh;

/// `SKB_DROP_REASON_NETFILTER_DROP` on this kernel (from the tracepoint's format), else 0.
fn netfilter_drop_reason() -> u64 {
    let fmt = std::fs::read_to_string("/sys/kernel/tracing/events/skb/kfree_skb/format")
        .unwrap_or_default();
    // ... { 12, "NETFILTER_DROP" } ...
    fmt.split('{')
        .find_map(|part| {
            let (n, name) = part.split_once(',')?;
            name.trim()
                .starts_with("\"NETFILTER_DROP\"")
                .then(|| n.trim().parse().ok())?
        })
        .unwrap_or(0)
}

/// Counts drops by reason, and by network namespace and reason: other drops on the machine
/// (other tests, other namespaces) must not spoil the comparison with the rule counter.
const SCRIPT: &str = r#"BEGIN { printf("READY\n"); }
tracepoint:skb:kfree_skb {
  @drops[args->reason] = count();
  $skb = (struct sk_buff *)args->skbaddr;
  @netns[$skb->dev->nd_net.net->ns.inum, args->reason] = count();
}
"#;

/// Two namespaces joined by a veth pair, a DROP rule in the receiving one; removed on drop.
pub(super) struct Net {
    pub(super) a: String,
    b: String,
    /// Inode number of the receiving namespace, as xtlock and bpftrace name it.
    pub(super) b_inum: u64,
}

const SRC: &str = "10.231.77.1";
pub(super) const DST: &str = "10.231.77.2";
const PORT: &str = "9";

impl Net {
    pub(super) fn new() -> Result<Self> {
        let id = std::process::id();
        let mut net = Net {
            a: format!("xtlbench-{id}-a"),
            b: format!("xtlbench-{id}-b"),
            b_inum: 0,
        };
        let (va, vb) = (format!("xtb{id}a"), format!("xtb{id}b"));
        let ip = |args: &[&str]| quiet(Command::new("ip").args(args));
        ip(&["netns", "add", &net.a])?;
        ip(&["netns", "add", &net.b])?;
        {
            use std::os::unix::fs::MetadataExt as _;
            net.b_inum = std::fs::metadata(format!("/run/netns/{}", net.b))?.ino();
        }
        ip(&[
            "link", "add", &va, "netns", &net.a, "type", "veth", "peer", "name", &vb, "netns",
            &net.b,
        ])?;
        for (ns, dev, addr) in [(&net.a, &va, SRC), (&net.b, &vb, DST)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        // No ARP in the measurement.
        let mac = Command::new("ip")
            .args(["-n", &net.b, "-o", "link", "show", &vb])
            .output()?;
        let mac = String::from_utf8_lossy(&mac.stdout);
        if let Some(m) = mac
            .split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
        {
            ip(&[
                "-n", &net.a, "neigh", "replace", DST, "lladdr", m, "dev", &va,
            ])?;
        }
        net.iptables(&["-A", "INPUT", "-p", "udp", "--dport", PORT, "-j", "DROP"])?;
        Ok(net)
    }

    pub(super) fn iptables(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.b, "iptables-legacy", "-w", "10"])
            .args(args)
            .output()
            .context("running iptables-legacy")?;
        if !out.status.success() {
            bail!(
                "iptables-legacy {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs `cmd args` in the receiving namespace.
    pub(super) fn exec_b(&self, args: &[&str]) -> Result<()> {
        quiet(
            Command::new("ip")
                .args(["netns", "exec", &self.b])
                .args(args),
        )
    }

    /// Packets counted by the DROP rule.
    fn counter(&self) -> Result<u64> {
        let s = self.iptables(&["-L", "INPUT", "-v", "-x", "-n"])?;
        s.lines()
            .find(|l| l.contains("DROP") && l.contains(&format!("dpt:{PORT}")))
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .context("no DROP rule counter")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| sh::show(cmd))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            sh::show(cmd),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// xtlock's count of drops in network namespace `inum` (`drops.by_netns` of the summary).
fn xtlock_netns_count(summary: &Value, inum: u64) -> Option<u64> {
    summary
        .pointer(&format!("/drops/by_netns/{inum}"))
        .and_then(Value::as_u64)
}

/// What xtlock's summary says the rules of network namespace `inum` dropped, by their own
/// counters (`rule_drops.top`); `None` from an xtlock without it.
fn xtlock_rule_drops(summary: &Value, inum: u64) -> Option<u64> {
    let top = summary.pointer("/rule_drops/top")?.as_array()?;
    Some(
        top.iter()
            .filter(|r| r["netns"].as_u64() == Some(inum))
            .filter_map(|r| r["packets"].as_u64())
            .sum(),
    )
}

/// Whether this xtlock counts drops (`xtlock trace --drop-samples`).
fn xtlock_counts_drops(env: &Env) -> bool {
    Command::new(&env.xtlock)
        .args(["trace", "--help"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--drop-samples"))
}

/// xtlock's count of NETFILTER_DROP drops in its final summary: `drops.by_reason`, else
/// whatever it can recognise elsewhere (a `NETFILTER_DROP` key with a number or a `count`,
/// or an object whose `reason` is NETFILTER_DROP), in case the layout moves.
fn xtlock_drop_count(summary: &Value) -> Option<u64> {
    if let Some(n) = summary
        .pointer("/drops/by_reason/NETFILTER_DROP")
        .and_then(Value::as_u64)
    {
        return Some(n);
    }
    fn is_nf(s: &str) -> bool {
        s.eq_ignore_ascii_case("NETFILTER_DROP") || s.eq_ignore_ascii_case("netfilter-drop")
    }
    fn count(v: &Value) -> Option<u64> {
        v.as_u64()
            .or_else(|| v.get("count").and_then(Value::as_u64))
            .or_else(|| v.get("drops").and_then(Value::as_u64))
            .or_else(|| v.get("total").and_then(Value::as_u64))
    }
    match summary {
        Value::Object(m) => {
            if m.get("reason").and_then(Value::as_str).is_some_and(is_nf) {
                if let Some(n) = count(summary) {
                    return Some(n);
                }
            }
            for (k, v) in m {
                if is_nf(k) {
                    if let Some(n) = count(v) {
                        return Some(n);
                    }
                }
            }
            m.values().find_map(xtlock_drop_count)
        }
        Value::Array(a) => {
            let found: Vec<u64> = a.iter().filter_map(xtlock_drop_count).collect();
            (!found.is_empty()).then(|| found.iter().sum())
        }
        _ => None,
    }
}

#[derive(Default)]
struct Col {
    pps: Dist,
    /// Senders' CPU (user + system) per dropped packet: less sensitive to other load.
    cpu_per_drop: Dist,
    /// Tracer count minus rule counter, per run.
    diff: Vec<i64>,
    counted: u64,
    rule: u64,
    tracer_cpu_ns_per_pkt: Dist,
    unparsed: u32,
    /// Machine-wide NETFILTER_DROP count minus the rule counter, per run.
    machine_wide: Vec<i64>,
    /// xtlock: drops of other reasons in the receiving netns, all runs.
    other_in_netns: u64,
    /// With --bpf-stats: the program that ran most (the drop hook), its ns per run and
    /// runs per dropped packet, and all the tracer's programs' ns per dropped packet.
    hook: String,
    hook_ns_per_run: Dist,
    hook_runs_per_drop: Dist,
    bpf_ns_per_drop: Dist,
    /// xtlock: what its `rule_drops` say the DROP rule dropped, minus the rule counter, per
    /// run (the counters it reads while the storm lasts, once a second at most).
    rule_diff: Vec<i64>,
}

pub fn run(env: &Env) -> Result<Value> {
    let reason = netfilter_drop_reason();
    let senders = env.cores.max(1);
    let net = Net::new()?;
    let drops_built = xtlock_counts_drops(env);
    let tracers = tracers(env, drops_built);
    let mut cols: Vec<Col> = tracers.iter().map(|_| Col::default()).collect();
    let mut sent = Dist::default();
    let secs = format!("{}", env.secs * 2.0);
    let args: Vec<Vec<String>> = (0..senders)
        .map(|_| {
            [
                "udp", DST, PORT, "--secs", &secs, "--size", "64", "--batch", "64",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect()
        })
        .collect();
    let xtlock_lock = env.scratch.join("drops.lock");
    std::fs::write(&xtlock_lock, b"")?;
    let storm = Storm {
        env,
        net: &net,
        args: &args,
        lock: &xtlock_lock,
        reason,
    };
    let _stats = env.bpf_stats.then(BpfStats::enable).transpose()?;
    for (rep, ti, t) in rotation(env.reps, &tracers) {
        storm.run(rep, t, &mut cols[ti], &mut sent)?;
    }
    eprint!("{:40}\r", "");
    drop(net);

    storm_table(env, senders, &tracers, &cols, drops_built);
    if env.bpf_stats {
        bpf_table(&tracers, &cols);
    }
    notes(&tracers, &cols, &sent);
    Ok(result(
        env,
        senders,
        reason,
        &tracers,
        &cols,
        &sent,
        drops_built,
    ))
}

/// The columns: untraced, bpftrace, and once xtlock counts drops, xtlock (and the baseline
/// build) and the drop hook's floor.
fn tracers(env: &Env, drops_built: bool) -> Vec<Tracer> {
    let mut tracers = vec![Tracer::None, Tracer::Bpftrace];
    if drops_built {
        tracers.push(Tracer::Xtlock);
        if env.baseline.is_some() {
            tracers.push(Tracer::Baseline);
        }
        // The drop hook's floor: xtlock with an empty program there (counts nothing).
        tracers.push(Tracer::DropFloor);
    }
    tracers
}

/// What every run of the storm shares: the senders' arguments, the namespaces, xtlock's lock
/// file, and the NETFILTER_DROP reason's number.
struct Storm<'a> {
    env: &'a Env,
    net: &'a Net,
    args: &'a [Vec<String>],
    lock: &'a Path,
    reason: u64,
}

impl Storm<'_> {
    /// One run under tracer `t`: the senders' storm, then the rule counter, rates, CPU, BPF
    /// programs and counts into `col` (and the untraced send rate into `sent`).
    fn run(&self, rep: usize, t: Tracer, col: &mut Col, sent: &mut Dist) -> Result<()> {
        let (env, net) = (self.env, self.net);
        net.iptables(&["-Z", "INPUT"])?;
        let tag = format!("drops-{}-{rep}", t.name());
        // xtlock as shipped: default drop reasons and sample rate.
        // The receiving namespace named, as an SRE would: its rules' counters are read from
        // the start, so the storm's first second is named by rule too.
        let netns = ["--netns".to_string(), format!("/run/netns/{}", net.b)];
        let s = Session::of(env, t, &tag, SCRIPT, &[self.lock], &netns)?;
        let ids = if env.bpf_stats {
            s.prog_ids()
        } else {
            Vec::new()
        };
        let p0 = ProgStats::read(&ids);
        let c0 = s.cpu_ns();
        let r = run::loads(env, &["ip", "netns", "exec", &net.a], self.args)?;
        let c1 = s.cpu_ns();
        let p1 = ProgStats::read(&ids);
        let st = s.stop()?;
        let rule = net.counter()?;
        let wall = r.iter().map(|l| l.wall_ns).max().unwrap_or(1) as f64 / 1e9;
        let total_sent: u64 = r.iter().map(|l| l.cycles).sum();
        let ran = p1.since(&p0);
        if let Some((name, runs, ns)) = ran.iter().max_by_key(|(_, runs, _)| *runs) {
            col.hook = name.clone();
            col.hook_ns_per_run.push(*ns as f64 / (*runs).max(1) as f64);
            col.hook_runs_per_drop
                .push(*runs as f64 / rule.max(1) as f64);
            let all: u64 = ran.iter().map(|(_, _, ns)| ns).sum();
            col.bpf_ns_per_drop.push(all as f64 / rule.max(1) as f64);
        }
        col.pps.push(rule as f64 / wall);
        let sender_cpu: u64 = r.iter().map(|l| l.cpu_ns).sum();
        col.cpu_per_drop
            .push(sender_cpu as f64 / rule.max(1) as f64);
        if t == Tracer::None {
            sent.push(total_sent as f64 / wall);
        } else {
            col.tracer_cpu_ns_per_pkt
                .push(c1.saturating_sub(c0) as f64 / rule.max(1) as f64);
        }
        let (counted, machine_wide) = self.counts(t, &st, rule, col);
        if let Some(n) = machine_wide {
            col.machine_wide.push(n as i64 - rule as i64);
        }
        match counted {
            Some(n) => {
                col.diff.push(n as i64 - rule as i64);
                col.counted += n;
                col.rule += rule;
            }
            None if t.is_xtlock() && t != Tracer::DropFloor => col.unparsed += 1,
            None => {}
        }
        Ok(())
    }

    /// The tracer's count of drops in the receiving namespace (all of them hit the rule), and
    /// its machine-wide NETFILTER_DROP count, kept for the record; xtlock's other drops there
    /// and its rule drops against the counter `rule` go into `col`.
    fn counts(
        &self,
        t: Tracer,
        st: &run::Stopped,
        rule: u64,
        col: &mut Col,
    ) -> (Option<u64>, Option<u64>) {
        let (net, reason) = (self.net, self.reason);
        match t {
            Tracer::None
            | Tracer::BpftraceHist
            | Tracer::BpftraceNetfilter
            | Tracer::DropFloor
            | Tracer::SyscallFloor => (None, None),
            Tracer::Bpftrace => {
                let get = |key: String| st.maps.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
                (
                    Some(get(format!("@netns[{}, {reason}]", net.b_inum)).unwrap_or(0)),
                    get(format!("@drops[{reason}]")),
                )
            }
            Tracer::Xtlock | Tracer::Baseline | Tracer::Floor | Tracer::FloorRecord => {
                let s = st.summary.as_ref();
                // Same key as bpftrace's: the receiving netns and NETFILTER_DROP. The
                // namespace may drop other packets meanwhile (IPv6 neighbour discovery
                // on the fresh veth); those are kept on record, not compared.
                let nf = st
                    .drop_counts
                    .get(&(net.b_inum, "NETFILTER_DROP".to_string()))
                    .copied();
                let in_netns: u64 = st
                    .drop_counts
                    .iter()
                    .filter(|((ns, _), _)| *ns == net.b_inum)
                    .map(|(_, n)| n)
                    .sum();
                col.other_in_netns += in_netns.saturating_sub(nf.unwrap_or(0));
                if let Some(n) = s.and_then(|s| xtlock_rule_drops(s, net.b_inum)) {
                    col.rule_diff.push(n as i64 - rule as i64);
                }
                (
                    nf.or_else(|| s.and_then(|s| xtlock_netns_count(s, net.b_inum))),
                    s.and_then(xtlock_drop_count),
                )
            }
        }
    }
}

/// The table of drops a second, the senders' and the tracers' CPU per drop, and each
/// tracer's count against the rule counter.
fn storm_table(env: &Env, senders: usize, tracers: &[Tracer], cols: &[Col], drops_built: bool) {
    println!(
        "\n== 3. Drop storm: UDP into an iptables DROP rule across a veth pair, {senders} sender(s), \
         {} s per run, {} runs",
        env.secs * 2.0,
        env.reps
    );
    let base = cols[0].pps.median();
    let base_cpu = cols[0].cpu_per_drop.median();
    let mut rows = vec![vec![
        "tracer".to_string(),
        "drops/s (rule counter)".into(),
        "vs untraced".into(),
        "sender CPU ns/drop".into(),
        "vs untraced".into(),
        "tracer CPU ns/drop".into(),
        "NETFILTER_DROP count in its netns vs rule counter".into(),
    ]];
    for (ti, t) in tracers.iter().enumerate() {
        let c = &cols[ti];
        rows.push(vec![
            t.name().into(),
            c.pps.show(),
            if ti == 0 {
                "-".into()
            } else {
                format!("{:+.1}%", (c.pps.median() / base - 1.0) * 100.0)
            },
            c.cpu_per_drop.show(),
            if ti == 0 {
                "-".into()
            } else {
                format!(
                    "{:+.1}%",
                    (c.cpu_per_drop.median() / base_cpu - 1.0) * 100.0
                )
            },
            if ti == 0 {
                "-".into()
            } else {
                c.tracer_cpu_ns_per_pkt.show()
            },
            if ti == 0 {
                "-".into()
            } else if t.is_xtlock() && c.unparsed > 0 {
                "summary has no drop count it recognises".into()
            } else {
                exactness(c)
            },
        ]);
    }
    if !drops_built {
        rows.push(vec![
            "xtlock".into(),
            "n/a (drops not built yet)".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
    }
    table(&rows);
}

/// A tracer's counts against the rule counter: exact in every run, or by how much they were
/// off.
fn exactness(c: &Col) -> String {
    if c.diff.is_empty() {
        return "-".into();
    }
    if c.diff.iter().all(|&d| d == 0) {
        format!("exact in {}/{} runs", c.diff.len(), c.diff.len())
    } else {
        format!(
            "off by {:?} ({} of {} counted)",
            c.diff,
            num(c.counted as f64),
            num(c.rule as f64)
        )
    }
}

/// With bpf_stats: each tracer's drop hook and all its programs per dropped packet.
fn bpf_table(tracers: &[Tracer], cols: &[Col]) {
    println!(
        "\n  BPF programs (kernel.bpf_stats_enabled; the program that ran most is the \
         drop hook; every packet freed on the machine runs it, dropped or not):"
    );
    let mut rows = vec![vec![
        "tracer".to_string(),
        "drop hook".into(),
        "ns per run".into(),
        "runs per dropped packet".into(),
        "all its programs: ns per dropped packet".into(),
    ]];
    for (ti, t) in tracers.iter().enumerate().skip(1) {
        let c = &cols[ti];
        rows.push(vec![
            t.name().into(),
            c.hook.clone(),
            c.hook_ns_per_run.show(),
            c.hook_runs_per_drop.show(),
            c.bpf_ns_per_drop.show(),
        ]);
    }
    table(&rows);
}

/// The senders' own rate, and per tracer what its counts left out of the table: the rule
/// drops it read, other drops in the namespace, drops elsewhere on the machine.
fn notes(tracers: &[Tracer], cols: &[Col], sent: &Dist) {
    println!(
        "  sent by the generators (untraced): {} datagrams/s; the rule sees fewer when the \
         receive backlog overflows",
        sent.show()
    );
    for (ti, t) in tracers.iter().enumerate().skip(1) {
        let d = &cols[ti].rule_diff;
        if !d.is_empty() {
            println!(
                "  {}: the DROP rule's drops as its rule_drops say, minus its counter, per run: \
                 {d:?}",
                t.name()
            );
        }
        if cols[ti].other_in_netns > 0 {
            println!(
                "  {}: {} drops of other reasons in the receiving netns over all runs (not \
                 compared: the rule only sees NETFILTER_DROP)",
                t.name(),
                cols[ti].other_in_netns
            );
        }
        if cols[ti].machine_wide.iter().any(|&d| d != 0) {
            println!(
                "  {}: machine-wide NETFILTER_DROP count minus the rule counter, per run: {:?} \
                 (drops elsewhere on the machine while it traced)",
                t.name(),
                cols[ti].machine_wide
            );
        }
    }
}

/// The bench's JSON.
fn result(
    env: &Env,
    senders: usize,
    reason: u64,
    tracers: &[Tracer],
    cols: &[Col],
    sent: &Dist,
    drops_built: bool,
) -> Value {
    let col_json = |c: &Col| {
        json!({
            "drops_per_s": c.pps.json(),
            "sender_cpu_ns_per_drop": c.cpu_per_drop.json(),
            "tracer_cpu_ns_per_drop": c.tracer_cpu_ns_per_pkt.json(),
            "count_minus_rule_counter": c.diff,
            "machine_wide_netfilter_drops_minus_rule_counter": c.machine_wide,
            "other_reasons_in_netns": c.other_in_netns,
            "rule_drops_minus_rule_counter": c.rule_diff,
            "counted": c.counted,
            "rule_counter": c.rule,
        })
    };
    let mut by = serde_json::Map::new();
    for (ti, t) in tracers.iter().enumerate() {
        by.insert(t.name().into(), col_json(&cols[ti]));
    }
    if !drops_built {
        by.insert("xtlock".into(), json!("n/a (drops not built yet)"));
    }
    json!({
        "what": "UDP 64-byte datagrams (sendmmsg, 64 per call) from netns A to netns B over veth, dropped by `iptables-legacy -A INPUT -p udp --dport 9 -j DROP` in B; drops/s from the rule counter",
        "senders": senders,
        "secs_per_run": env.secs * 2.0,
        "reps": env.reps,
        "netfilter_drop_reason": reason,
        "sent_per_s_untraced": sent.json(),
        "tracers": Value::Object(by),
        "bpftrace_script": SCRIPT,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_drop_counts() {
        assert_eq!(
            xtlock_drop_count(&json!({"drops": {"NETFILTER_DROP": 12}})),
            Some(12)
        );
        assert_eq!(
            xtlock_drop_count(&json!({"drops": [{"reason": "NETFILTER_DROP", "count": 7}]})),
            Some(7)
        );
        assert_eq!(
            xtlock_drop_count(&json!({"drops": {"by_reason": {"NETFILTER_DROP": {"count": 3}}}})),
            Some(3)
        );
        assert_eq!(xtlock_drop_count(&json!({"holds": {}})), None);
        assert_eq!(
            xtlock_drop_count(
                &json!({"drops": {"by_class": {"rule": 9}, "by_reason": {"NO_SOCKET": 2, "NETFILTER_DROP": 9}}})
            ),
            Some(9)
        );
    }
}
