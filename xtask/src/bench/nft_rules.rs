//! Bench 9 `nft-rules`: what reading nf_tables back after each write costs at the scale of a
//! 10,000-service, 50,000-endpoint cluster in kube-proxy's nftables mode (issue 41, part 7):
//! table `ip kube-proxy` of ~120,000 rules in a network namespace of its own; small `nft`
//! transactions (a chain added, then deleted), each followed by xtlock's read of every
//! nf_tables table of the namespace (at the writer's exit), waited for before the next. Untraced, under
//! `xtlock trace --no-rule-reads` and under `xtlock trace` (reads on), interleaved: the
//! writer's time per write, xtlock's CPU per write and per read, its peak memory, beside
//! `nft list ruleset` of the same namespace (the same netlink dumps, printed as text).
use std::{
    fs,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Result;
use serde_json::{json, Value};

use super::{
    rules::{generated, output, settle, traced, Netns, RuleFacts},
    stats::{num, table, Dist},
    Env,
};

/// The cluster: services, and endpoints per service (kube-proxy's nftables mode writes 2
/// rules for each of both).
const SERVICES: usize = 10_000;
const ENDPOINTS: usize = 5;
/// Writes per run.
const WRITES: usize = 6;

/// Peak resident memory of a process (`VmHWM`), MiB.
fn peak_rss_mib(pid: u32) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// What xtlock says (once per namespace, on stderr) when a namespace's rule reads are held
/// back past its share of the reader (`source/rules.rs`).
const RATIONED: &str = "rationed: they took";

#[derive(Default)]
struct Column {
    write_ms: Dist,
    cpu_ms: Dist,
    reads: Dist,
    rss_mib: Dist,
    /// (service ports, endpoints) the final summary's Service model held, per run.
    modelled: Vec<(u64, u64)>,
    skipped: u64,
    why: Vec<String>,
    /// Runs whose reads xtlock held back past the namespace's share of the reader (it says
    /// so once on stderr): their writes were read together, later.
    rationed: usize,
}

/// The tracer configurations, untraced first: (name, xtlock's extra arguments).
type Config = (&'static str, Option<&'static [&'static str]>);

pub fn run(env: &Env) -> Result<Value> {
    let ns = Netns::new("nft")?;
    let lock = env.scratch.join("nft-rules.lock");
    fs::write(&lock, b"")?;
    let (rules, chains) = load_ruleset(env, &ns)?;
    let mut list_ms = Dist::default();
    let configs: [Config; 3] = [
        ("untraced", None),
        ("xtlock --no-rule-reads", Some(&["--no-rule-reads"])),
        ("xtlock (reads on)", Some(&[])),
    ];
    let mut cols: Vec<Column> = configs.iter().map(|_| Column::default()).collect();
    for rep in 0..env.reps {
        let t = Instant::now();
        output(ns.cmd("nft").args(["list", "ruleset"]))?;
        list_ms.push(t.elapsed().as_secs_f64() * 1e3);
        for (config, col) in configs.iter().zip(cols.iter_mut()) {
            writes(env, &ns, &lock, rep, *config, col)?;
        }
    }
    let (per_read_cpu, rss_added, writer_delay) = report(&configs, &cols, &list_ms);
    Ok(json!({
        "services": SERVICES,
        "endpoints_per_service": ENDPOINTS,
        "rules": rules,
        "chains": chains,
        "writes_per_run": WRITES,
        "nft_list_ms": list_ms.json(),
        "columns": configs.iter().zip(&cols).map(|((name, _), c)| json!({
            "tracer": name,
            "writer_ms_per_write": c.write_ms.json(),
            "cpu_ms_per_write": c.cpu_ms.json(),
            "reads_per_write": c.reads.json(),
            "peak_rss_mib": c.rss_mib.json(),
            "modelled": c.modelled,
            "skipped": c.skipped,
            "skipped_why": c.why,
            "rationed_runs": c.rationed,
        })).collect::<Vec<_>>(),
        "read_parse_diff_cpu_ms": per_read_cpu,
        "peak_rss_added_mib": rss_added,
        "writer_delay_ms": writer_delay,
    }))
}

/// The generated ruleset loaded into `ns` and listed once, both timed and said in the
/// heading: (rules, chains).
fn load_ruleset(env: &Env, ns: &Netns) -> Result<(usize, usize)> {
    let rules_file = generated(env, "nft-ruleset", SERVICES, ENDPOINTS)?;
    let t = Instant::now();
    output(ns.cmd("nft").arg("-f").arg(&rules_file))?;
    let load_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let listed = output(ns.cmd("nft").args(["-a", "list", "ruleset"]))?;
    let list_first_ms = t.elapsed().as_secs_f64() * 1e3;
    let rules = listed
        .lines()
        .filter(|l| {
            l.contains("# handle")
                && !l.trim_start().starts_with("chain")
                && !l.trim_start().starts_with("table")
                && !l.trim_start().starts_with("map")
        })
        .count();
    let chains = listed
        .lines()
        .filter(|l| l.trim_start().starts_with("chain "))
        .count();
    println!(
        "\n== nft-rules: reading a {rules}-rule, {chains}-chain nf_tables ruleset (kube-proxy's \
         nftables mode, {SERVICES} services x {ENDPOINTS} endpoints) back after each write \
         ({WRITES} small transactions a run, each read waited for; loaded in {load_s:.1} s; `nft list \
         ruleset` {list_first_ms:.0} ms)"
    );
    Ok((rules, chains))
}

/// One run of [`WRITES`] transactions under `config`, each read waited for when traced: the
/// writer's time, and xtlock's CPU, memory, reads and Service model into `col`.
fn writes(
    env: &Env,
    ns: &Netns,
    lock: &Path,
    rep: usize,
    (name, extra): Config,
    col: &mut Column,
) -> Result<()> {
    let session = traced(env, &format!("nft-rules-{rep}-{name}"), lock, extra)?;
    let cpu0 = session.cpu_ns();
    let mut took = Dist::default();
    for w in 0..WRITES {
        let op = if w % 2 == 0 { "add" } else { "delete" };
        let t = Instant::now();
        output(
            ns.cmd("nft")
                .args([op, "chain", "ip", "kube-proxy", "xtlbench"]),
        )?;
        took.push(t.elapsed().as_secs_f64() * 1e3);
        // Its read finishes before the next write (xtlock's CPU stops growing): one
        // read a write, the first one the namespace's baseline.
        if extra.is_some() {
            settle(
                &session,
                Duration::from_millis(400),
                4_000_000,
                Duration::from_secs(60),
            );
        }
    }
    let cpu = session.cpu_ns().saturating_sub(cpu0);
    let rss = session.pid().and_then(peak_rss_mib);
    let out = session.out.clone();
    let err = session.err.clone();
    let stopped = session.stop()?;
    if fs::read_to_string(&err).is_ok_and(|e| e.contains(RATIONED)) {
        col.rationed += 1;
    }
    col.write_ms.push(took.median());
    if extra.is_none() {
        return Ok(());
    }
    col.cpu_ms.push(cpu as f64 / 1e6 / WRITES as f64);
    if let Some(r) = rss {
        col.rss_mib.push(r);
    }
    let f = RuleFacts::read(&out);
    col.skipped += f.skipped;
    for w in f.why {
        if !col.why.contains(&w) {
            col.why.push(w);
        }
    }
    // Every read after the baseline sees its write's change; the baseline's says
    // nothing (and without reads there is none).
    let reads = if f.facts > 0 { f.facts + 1 } else { 0 };
    col.reads.push(reads as f64 / WRITES as f64);
    if stopped.lost_events > 0 {
        println!("  ({name}: {} events lost)", stopped.lost_events);
    }
    if let Some(sum) = &stopped.summary {
        let n = |k: &str| sum["services"][k].as_u64().unwrap_or(0);
        col.modelled.push((n("services"), n("endpoints")));
    }
    Ok(())
}

/// The table, then what reads add (reads off against on) and the Service model: (xtlock's
/// CPU a read, if any, its added peak memory, the writer's delay).
fn report(configs: &[Config], cols: &[Column], list_ms: &Dist) -> (Option<f64>, f64, f64) {
    let mut rows = vec![vec![
        "".to_string(),
        "writer ms/write".to_string(),
        "xtlock CPU ms/write".to_string(),
        "reads/write".to_string(),
        "xtlock peak RSS MiB".to_string(),
    ]];
    for ((name, extra), c) in configs.iter().zip(cols) {
        let traced = extra.is_some();
        rows.push(vec![
            name.to_string(),
            c.write_ms.show(),
            if traced { c.cpu_ms.show() } else { "-".into() },
            if traced {
                num(c.reads.median())
            } else {
                "-".into()
            },
            if traced { c.rss_mib.show() } else { "-".into() },
        ]);
    }
    table(&rows);
    let (off, on) = (&cols[1], &cols[2]);
    // No read a write (all held back): no cost a read to say.
    let per_read_cpu = (on.reads.median() > 0.0)
        .then(|| (on.cpu_ms.median() - off.cpu_ms.median()) / on.reads.median());
    let writer_delay = on.write_ms.median() - off.write_ms.median();
    let rss_added = on.rss_mib.median() - off.rss_mib.median();
    println!(
        "  nft list ruleset: {} ms  |  a read + parse + model + diff: {} of xtlock CPU; \
         memory: {rss_added:+.0} MiB peak with reads on; the writer: {writer_delay:+.1} ms a \
         write ({})",
        list_ms.show(),
        per_read_cpu.map_or_else(
            || "none to say (no read a write)".to_owned(),
            |ms| format!("{} ms", num(ms))
        ),
        RuleFacts::skipped_text(on.skipped, &on.why),
    );
    if on.rationed > 0 {
        println!(
            "  reads held back by the namespace's share of the reader (10 % of a core over 10 s) \
             in {} of {} runs: those writes were read together, later",
            on.rationed,
            on.write_ms.samples.len()
        );
    }
    println!(
        "  the Service model at the end of each run with reads on (service ports, endpoints): {:?}",
        on.modelled
    );
    (per_read_cpu, rss_added, writer_delay)
}
