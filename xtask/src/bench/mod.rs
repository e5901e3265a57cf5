//! `cargo xtask bench`: xtlock's cost and limits, measured side by side with bpftrace doing
//! the same job, in the same run. Not a test: it prints tables and writes
//! `target/bench/<name>.json` (each with the machine it ran on); `docs/performance.md` quotes
//! them.
//!
//! 1-2 `lock`: CPU per operation of tight `flock` cycles (watched and unwatched file),
//!     `getppid()` and spawning `/bin/true`, untraced / `xtlock trace` / bpftrace.
//! 3 `drops`: UDP drop storm between two namespaces: packets/s and counts vs the rule counter.
//! 4 `collector`: decode + analysis of a generated 10M-event capture: events/s per core, RSS.
//! 5 `ring`: lock storm with a 1 MiB ring buffer: delivered rate before loss, loss reporting.
//! 6 `capture`: bytes per event on disk (reported with `collector`).
//! 7 `rules`: reading a ~30,000-rule table back after each write: the writer's time and
//!     xtlock's CPU per write, with and without the reads, beside `iptables-save`.
//! 8 `refusals`: TCP connects into a REJECT rule: refused/s and exact counts against the
//!     clients' and the rule's (`--bpf-stats`: BPF ns per refused connection, per program).
//! 10 `idle`: the DaemonSet's daemon, with the manifest's arguments, on a quiet node (40
//!     pods, kube-proxy's ~1,600 nat rules synced every 10 s, 40 connections/s), then with
//!     100,000 conntrack entries: % of a core by thread (source) and peak RSS.
//! 9 `nft-rules`: reading a 10,000-service kube-proxy nftables ruleset (~120,000 rules) back
//!     after each small transaction: the writer's time, xtlock's CPU per read, its peak RSS.
//!
//! Every figure is the median of `--reps` runs with its spread ((max - min) / median), because
//! the machines this runs on are often shared and noisy; the load average is recorded before
//! and after each bench.
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use crate::{setup, sh};

mod collector;
mod drops;
mod figures;
mod idle;
mod lockpath;
mod nft_mutex;
mod nft_rules;
mod refusals;
mod ring;
mod rules;
mod run;
mod stats;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Benches to run, comma-separated: lock, drops, collector, ring, rules, nft-rules,
    /// refusals, nft-mutex, idle (default: all). The capture-size figures come with
    /// `collector`.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Repetitions of every measurement (medians and spreads are over these).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Seconds per load run (the drop storm and ring runs take twice this).
    #[arg(long, default_value_t = 1.0)]
    pub secs: f64,
    /// Events in the generated capture of the collector bench.
    #[arg(long, default_value_t = 10_000_000)]
    pub events: u64,
    /// Fewer, shorter runs (2 reps, 0.5 s, 1M events): to check the harness, not to quote.
    #[arg(long)]
    pub quick: bool,
    /// Use the release binaries already built instead of running `cargo build --release`.
    #[arg(long)]
    pub no_build: bool,
    /// Lock, drop and refusal benches: also turn on `kernel.bpf_stats_enabled` and report the BPF
    /// programs' runs per operation (per dropped packet) and ns per run (costs some ns per
    /// run itself; restored after).
    #[arg(long)]
    pub bpf_stats: bool,
    /// Lock, drop and refusal benches: also run this xtlock binary (an older build), as a column of
    /// its own interleaved with the others: A/B in one run on the same machine state.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
}

/// What every bench needs: binaries, scratch space, settings, the machine.
pub struct Env {
    pub xtlock: PathBuf,
    pub load: PathBuf,
    pub collector: PathBuf,
    pub scratch: PathBuf,
    pub out_dir: PathBuf,
    pub reps: usize,
    pub secs: f64,
    pub events: u64,
    pub cores: usize,
    pub bpf_stats: bool,
    pub baseline: Option<PathBuf>,
    pub machine: Value,
}

const ALL: [&str; 9] = [
    "lock",
    "drops",
    "collector",
    "ring",
    "rules",
    "nft-rules",
    "refusals",
    "nft-mutex",
    "idle",
];

pub fn run(args: &BenchArgs) -> Result<()> {
    let (selected, needs_root) = selection(args)?;
    let root = sh::workspace_root();
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_absolute() { t } else { root.join(t) })
        .unwrap_or_else(|| root.join("target"));
    if !args.no_build {
        build(&root, needs_root)?;
    }
    let (env, _cleanup) = prepare(args, &target)?;
    for b in [&env.xtlock, &env.load, &env.collector] {
        if !b.exists() {
            bail!("{} is missing: build it (drop --no-build)", b.display());
        }
    }
    println!("\n== machine");
    for (k, v) in env.machine.as_object().into_iter().flatten() {
        println!(
            "  {k}: {}",
            v.as_str().map_or_else(|| v.to_string(), str::to_owned)
        );
    }

    let mut written = Vec::new();
    let mut figures: Vec<(String, Value, String, String)> = Vec::new();
    for name in &selected {
        let load_before = loadavg();
        let t = Instant::now();
        let (main, extra) = bench(name, &env)?;
        let took = t.elapsed().as_secs_f64();
        let load_after = loadavg();
        println!("  (took {took:.0} s; load average {load_before} -> {load_after})");
        let file = match name.as_str() {
            "lock" => "lock_path",
            "capture" => "collector",
            n => n,
        };
        figures.push((
            file.to_string(),
            main.clone(),
            load_before.clone(),
            load_after.clone(),
        ));
        let mut docs = vec![(file, main)];
        if let Some((f, v)) = extra {
            docs.push((f, v));
        }
        let loads = (load_before.as_str(), load_after.as_str());
        for (f, v) in docs {
            written.push(write_result(&env, f, v, loads, took)?);
        }
    }
    if !figures.is_empty() {
        let path = sh::workspace_root().join(figures::FILE);
        figures::record(&path, &env.machine, &figures)?;
        written.push(path);
    }
    println!();
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// The benches asked for (all by default), checked, and whether any needs root.
fn selection(args: &BenchArgs) -> Result<(Vec<String>, bool)> {
    let selected: Vec<String> = if args.only.is_empty() {
        ALL.iter().map(|s| s.to_string()).collect()
    } else {
        args.only.clone()
    };
    for s in &selected {
        if !ALL.contains(&s.as_str()) && s != "capture" {
            bail!(
                "unknown bench `{s}` (lock, drops, collector, ring, rules, nft-rules, refusals, \
                 nft-mutex, idle)"
            );
        }
    }
    let needs_root = selected.iter().any(|s| {
        matches!(
            s.as_str(),
            "lock" | "drops" | "ring" | "rules" | "nft-rules" | "refusals" | "nft-mutex" | "idle"
        )
    });
    if needs_root && !sh::is_root() {
        bail!(
            "the lock, drops, ring, rules, nft-rules, refusals and nft-mutex benches load BPF programs: run as root (or --only collector)"
        );
    }
    Ok((selected, needs_root))
}

/// The release build of xtlock and the benches' tools.
fn build(root: &Path, needs_root: bool) -> Result<()> {
    // The release build needs the BPF toolchain, the benches bpftrace and bpftool:
    // setup installs what is missing (as root; the collector alone needs none of it).
    if needs_root {
        setup::run()?;
    }
    let mut build = sh::cargo();
    if needs_root {
        build.env("XTLOCK_REQUIRE_EBPF", "1");
    }
    sh::run(build.current_dir(root).args([
        "build",
        "--release",
        "--package",
        "xtlock",
        "--package",
        "xtlock-tests",
        "--bin",
        "xtlock",
        "--bin",
        "xtlock-bench-load",
        "--bin",
        "xtlock-test-helper",
        "--example",
        "bench_collector",
    ]))
}

/// The benches' [`Env`], with a scratch folder removed when the guard is dropped.
fn prepare(args: &BenchArgs, target: &Path) -> Result<(Env, RemoveOnDrop)> {
    let release = target.join("release");
    let scratch = env::temp_dir().join(format!("xtlock-bench-{}", std::process::id()));
    fs::create_dir_all(&scratch)?;
    let cleanup = RemoveOnDrop(scratch.clone());
    let out_dir = target.join("bench");
    fs::create_dir_all(&out_dir)?;
    let (reps, secs, events) = if args.quick {
        (2, 0.5, 1_000_000)
    } else {
        (args.reps.max(1), args.secs, args.events)
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let env = Env {
        xtlock: release.join("xtlock"),
        load: release.join("xtlock-bench-load"),
        collector: release.join("examples/bench_collector"),
        scratch,
        out_dir,
        reps,
        secs,
        events,
        cores,
        bpf_stats: args.bpf_stats,
        baseline: args.baseline.clone(),
        machine: machine(cores),
    };
    Ok((env, cleanup))
}

/// Runs the bench `name`: its results, and another file's (name, results) it gives too.
fn bench(name: &str, env: &Env) -> Result<(Value, Option<(&'static str, Value)>)> {
    Ok(match name {
        "lock" => (lockpath::run(env)?, None),
        "drops" => (drops::run(env)?, None),
        "collector" | "capture" => {
            let (c, size) = collector::run(&env.with_reps(env.reps.min(3)))?;
            (c, Some(("capture_size", size)))
        }
        "ring" => (ring::run(env)?, None),
        "rules" => (rules::run(env)?, None),
        "nft-rules" => (nft_rules::run(env)?, None),
        "refusals" => (refusals::run(env)?, None),
        "nft-mutex" => (nft_mutex::run(env)?, None),
        "idle" => (idle::run(env)?, None),
        _ => unreachable!("checked above"),
    })
}

/// `target/bench/<file>.json`: the results `v` with the machine, the load averages (before,
/// after) and the time the bench took.
fn write_result(
    env: &Env,
    file: &str,
    v: Value,
    (load_before, load_after): (&str, &str),
    took: f64,
) -> Result<PathBuf> {
    let path = env.out_dir.join(format!("{file}.json"));
    let doc = json!({
        "bench": file,
        "machine": env.machine,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "took_s": took,
        "results": v,
    });
    fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

impl Env {
    fn with_reps(&self, reps: usize) -> Env {
        Env {
            xtlock: self.xtlock.clone(),
            load: self.load.clone(),
            collector: self.collector.clone(),
            scratch: self.scratch.clone(),
            out_dir: self.out_dir.clone(),
            reps,
            secs: self.secs,
            events: self.events,
            cores: self.cores,
            bpf_stats: self.bpf_stats,
            baseline: self.baseline.clone(),
            machine: self.machine.clone(),
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn first_line(cmd: &mut Command) -> String {
    sh::capture(cmd)
        .and_then(|s| s.lines().next().map(str::to_owned))
        .unwrap_or_default()
}

fn machine(cores: usize) -> Value {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let root = sh::workspace_root();
    let commit =
        first_line(
            Command::new("git")
                .current_dir(&root)
                .args(["rev-parse", "--short", "HEAD"]),
        );
    let dirty = !first_line(Command::new("git").current_dir(&root).args([
        "status",
        "--porcelain",
        "--untracked-files=no",
    ]))
    .is_empty();
    json!({
        "cores": cores,
        "cpu": cpu,
        "kernel": kernel,
        "memory_mib": mem_mib(),
        "bpftrace": first_line(Command::new("bpftrace").arg("--version")),
        "xtlock_commit": if dirty { format!("{commit}+local changes") } else { commit },
        "date_utc": first_line(Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])),
        "loadavg_at_start": loadavg(),
    })
}

fn mem_mib() -> u64 {
    fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024)
}
