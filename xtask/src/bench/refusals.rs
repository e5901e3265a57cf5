//! Bench 8 `refusals`: a refusal storm. TCP connects from one network namespace to another,
//! one after another from each core, into a `REJECT` rule (ICMP port unreachable): refused
//! connections per second with no tracer, with bpftrace running the one-liners for the same
//! jobs (`count()` per type and code on `icmp:icmp_send`, per reason and location on
//! `skb:kfree_skb`), and with `xtlock trace`; each count against the clients' own
//! ECONNREFUSED count and the rule's packet counter. With `--bpf-stats`, the BPF time each
//! tracer's programs spent per refused connection (every program it loaded), per program.

use std::path::Path;

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

use super::{
    drops::{Net, DST},
    run::{self, rotation, BpfStats, ProgStats, Session, Tracer},
    stats::{add_bpf_runs, bpf_programs_table, num, table, Dist, ProgDists},
    Env,
};

/// The refused port: a `REJECT` rule's, as kube-proxy's for a Service with no endpoints.
const PORT: &str = "10";

/// The one-liners for the jobs xtlock's programs do on a refused connection: ICMP errors
/// sent, by type and code, and packets freed, by reason and location.
const SCRIPT: &str = r#"BEGIN { printf("READY\n"); }
tracepoint:icmp:icmp_send { @icmp[args->type, args->code] = count(); }
tracepoint:skb:kfree_skb { @drops[args->reason, args->location] = count(); }
"#;

/// bpftrace's count of port unreachables (type 3, code 3).
const BPFTRACE_KEY: &str = "@icmp[3, 3]";

#[derive(Default)]
struct Col {
    /// Refused connects per second, all clients.
    rate: Dist,
    /// Clients' CPU per refused connect.
    cpu_per: Dist,
    tracer_cpu_per: Dist,
    /// Per run: (the tracer's count, the clients' refusals, the rule's counter).
    counts: Vec<(Option<u64>, u64, u64)>,
    /// `--bpf-stats`: BPF ns per refused connection, all the tracer's programs.
    bpf_ns_per: Dist,
    /// `--bpf-stats`, per program: (ns per run, runs per refused connection).
    progs: ProgDists,
}

impl Net {
    /// Packets counted by the REJECT rule.
    fn reject_counter(&self) -> Result<u64> {
        let s = self.iptables(&["-L", "INPUT", "-v", "-x", "-n"])?;
        s.lines()
            .find(|l| l.contains("REJECT") && l.contains(&format!("dpt:{PORT}")))
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .context("no REJECT rule counter")
    }
}

/// xtlock's ICMP-unreachable refusals in namespace `inum`, from its `refusal_count` lines.
fn xtlock_count(out: &std::path::Path, inum: u64) -> Option<u64> {
    let text = std::fs::read_to_string(out).ok()?;
    Some(
        text.lines()
            .filter(|l| l.contains("\"type\":\"refusal_count\""))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["netns"].as_u64() == Some(inum) && v["kind"] == "icmp_unreachable")
            .filter_map(|v| v["count"].as_u64())
            .sum(),
    )
}

pub fn run(env: &Env) -> Result<Value> {
    let clients = env.cores.max(1);
    let net = Net::new()?;
    reject(&net)?;
    let mut tracers = vec![Tracer::None, Tracer::Bpftrace, Tracer::Xtlock];
    if env.baseline.is_some() {
        tracers.push(Tracer::Baseline);
    }
    let mut cols: Vec<Col> = tracers.iter().map(|_| Col::default()).collect();
    let secs = format!("{}", env.secs * 2.0);
    let args: Vec<Vec<String>> = (0..clients)
        .map(|_| {
            ["connect", DST, PORT, "--secs", &secs]
                .iter()
                .map(|s| s.to_string())
                .collect()
        })
        .collect();
    let lock = env.scratch.join("refusals.lock");
    std::fs::write(&lock, b"")?;
    let _stats = env.bpf_stats.then(BpfStats::enable).transpose()?;
    for (rep, ti, t) in rotation(env.reps, &tracers) {
        storm(env, &net, &args, &lock, rep, t, &mut cols[ti])?;
    }
    eprint!("{:40}\r", "");
    let out_cols = report(env, clients, &tracers, &cols);
    Ok(json!({
        "clients": clients,
        "secs_per_run": env.secs * 2.0,
        "reps": env.reps,
        "columns": out_cols,
        "bpftrace_script": SCRIPT,
    }))
}

/// The REJECT rule in the receiving namespace, and its ICMP limits lifted.
fn reject(net: &Net) -> Result<()> {
    net.iptables(&[
        "-A",
        "INPUT",
        "-p",
        "tcp",
        "--dport",
        PORT,
        "-j",
        "REJECT",
        "--reject-with",
        "icmp-port-unreachable",
    ])?;
    // Every SYN answered: the ICMP limits (per namespace on this kernel) lifted, else the
    // clients would wait for retransmissions and the counts would differ by design.
    for kv in [
        "net.ipv4.icmp_ratelimit=0",
        "net.ipv4.icmp_msgs_per_sec=10000000",
        "net.ipv4.icmp_msgs_burst=10000000",
    ] {
        if let Err(e) = net.exec_b(&["sysctl", "-qw", kv]) {
            println!("  (could not set {kv} in the namespace: {e:#})");
        }
    }
    Ok(())
}

/// One run of the clients (`args`) under tracer `t`: rate, CPU, BPF programs and the three
/// counts into `col`.
fn storm(
    env: &Env,
    net: &Net,
    args: &[Vec<String>],
    lock: &Path,
    rep: usize,
    t: Tracer,
    col: &mut Col,
) -> Result<()> {
    net.iptables(&["-Z", "INPUT"])?;
    let tag = format!("refusals-{}-{rep}", t.name());
    let s = Session::of(env, t, &tag, SCRIPT, &[lock], &[])?;
    let ids = if env.bpf_stats {
        s.prog_ids()
    } else {
        Vec::new()
    };
    let p0 = ProgStats::read(&ids);
    let c0 = s.cpu_ns();
    let r = run::loads(env, &["ip", "netns", "exec", &net.a], args)?;
    let c1 = s.cpu_ns();
    let p1 = ProgStats::read(&ids);
    let out = s.out.clone();
    let st = s.stop()?;
    let rule = net.reject_counter()?;
    let refused: u64 = r.iter().map(|l| l.cycles).sum();
    let wall = r.iter().map(|l| l.wall_ns).max().unwrap_or(1) as f64 / 1e9;
    if env.bpf_stats && t != Tracer::None {
        add_bpf_runs(&mut col.bpf_ns_per, &mut col.progs, p1.since(&p0), refused);
    }
    col.rate.push(refused as f64 / wall);
    let cpu: u64 = r.iter().map(|l| l.cpu_ns).sum();
    col.cpu_per.push(cpu as f64 / refused.max(1) as f64);
    let counted = match t {
        Tracer::None => None,
        Tracer::Bpftrace => Some(
            st.maps
                .iter()
                .find(|(k, _)| k == BPFTRACE_KEY)
                .map_or(0, |(_, v)| *v),
        ),
        _ => xtlock_count(&out, net.b_inum),
    };
    if t != Tracer::None {
        col.tracer_cpu_per
            .push(c1.saturating_sub(c0) as f64 / refused.max(1) as f64);
    }
    col.counts.push((counted, refused, rule));
    Ok(())
}

/// The table of refusals a second, CPU and counts (and with bpf_stats the programs'); each
/// column's JSON.
fn report(env: &Env, clients: usize, tracers: &[Tracer], cols: &[Col]) -> Vec<Value> {
    println!(
        "\n== 8. Refusal storm: TCP connects into an ICMP REJECT rule, {clients} clients, \
         {} s runs (median ±spread of {})",
        env.secs * 2.0,
        env.reps
    );
    let base = cols[0].rate.median();
    let mut rows = vec![vec![
        "tracer".to_string(),
        "refused/s".into(),
        "vs untraced".into(),
        "client CPU ns/refusal".into(),
        "tracer CPU ns/refusal".into(),
        "counted = clients' = rule's, every run".into(),
    ]];
    let mut out_cols = Vec::new();
    for (t, c) in tracers.iter().zip(cols) {
        let exact = c
            .counts
            .iter()
            .all(|(n, refused, rule)| n.is_none_or(|n| n == *refused) && refused == rule);
        let shown: Vec<String> = c
            .counts
            .iter()
            .map(|(n, refused, rule)| match n {
                Some(n) => format!("{n}/{refused}/{rule}"),
                None => format!("-/{refused}/{rule}"),
            })
            .collect();
        rows.push(vec![
            t.name().to_string(),
            c.rate.show(),
            format!("{:+.1}%", (c.rate.median() / base - 1.0) * 100.0),
            c.cpu_per.show(),
            if *t == Tracer::None {
                "-".into()
            } else {
                c.tracer_cpu_per.show()
            },
            format!(
                "{} ({})",
                if exact { "yes" } else { "NO" },
                shown.join(", ")
            ),
        ]);
        out_cols.push(json!({
            "tracer": t.name(),
            "refused_per_s": c.rate.json(),
            "client_cpu_ns_per_refusal": c.cpu_per.json(),
            "tracer_cpu_ns_per_refusal": c.tracer_cpu_per.json(),
            "counts": c.counts.iter().map(|(n, r, k)| json!({"counted": n, "clients": r, "rule": k})).collect::<Vec<_>>(),
            "exact": exact,
            "bpf_ns_per_refusal": c.bpf_ns_per.json(),
            "programs": c.progs.iter().map(|(name, (ns, runs))| json!({
                "program": name, "ns_per_run": ns.json(), "runs_per_refusal": runs.json(),
            })).collect::<Vec<_>>(),
        }));
    }
    table(&rows);
    println!("  ({} refusals/s at most untraced)", num(base));
    if env.bpf_stats {
        println!(
            "\n  BPF programs (kernel.bpf_stats_enabled), per refused connection: ns per run x \
             runs per refusal; programs that ran fewer than 0.01 times a refusal left out"
        );
        let per: Vec<_> = tracers
            .iter()
            .zip(cols)
            .skip(1)
            .map(|(t, c)| (t.name(), &c.bpf_ns_per, &c.progs))
            .collect();
        bpf_programs_table("refusal", &per);
    }
    out_cols
}
