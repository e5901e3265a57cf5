//! Bench 6 `rules`: what reading iptables tables back after each write costs (issue 29).
//! A kube-proxy-shaped nat table of about 30,000 rules in a network namespace of its own;
//! writes of one rule each (`iptables-legacy -A` then `-D`: every one replaces the whole
//! table, as kube-proxy's syncs do), back to back, so the next write meets xtlock's read of
//! the previous one on the table's mutex. Untraced, under `xtlock trace --no-rule-reads`
//! and under `xtlock trace` (reads on), interleaved: the writer's time per write (what a
//! read costs the writer) and xtlock's CPU per write (what a read, its parse and its diff
//! cost), beside `iptables-legacy-save` of the same table (the cost the reads are bounded
//! by: the same two kernel calls).
use std::{
    fs,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use super::{
    run::Session,
    stats::{num, table, Dist},
    Env,
};

/// Services and endpoints per service: 1 + 3 x ENDPOINTS nat rules each, ~30,000 in all.
const SERVICES: usize = 4286;
const ENDPOINTS: usize = 2;
/// Writes per run.
const WRITES: usize = 10;

/// A network namespace removed on drop.
pub(super) struct Netns(String);

impl Netns {
    pub(super) fn new(what: &str) -> Result<Self> {
        let name = format!("xtlbench-{what}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        output(Command::new("ip").args(["netns", "add", &name]))?;
        Ok(Netns(name))
    }

    pub(super) fn name(&self) -> &str {
        &self.0
    }

    pub(super) fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, prog]);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

pub(super) fn output(c: &mut Command) -> Result<String> {
    let out = c.output().with_context(|| format!("{c:?}"))?;
    if !out.status.success() {
        bail!("{c:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// No tracer (`extra` None), or `xtlock trace --no-drops` with `extra` watching `lock`.
pub(super) fn traced(
    env: &Env,
    tag: &str,
    lock: &std::path::Path,
    extra: Option<&[&str]>,
) -> Result<Session> {
    let Some(extra) = extra else {
        return Ok(Session::none());
    };
    let mut args: Vec<String> = vec!["--no-drops".into()];
    args.extend(extra.iter().map(|s| s.to_string()));
    Session::xtlock(env, tag, &[lock], &args)
}

/// kube-proxy's rules for `services` of `endpoints` each, from the load generator's `what`
/// (`ruleset`: iptables-restore's input; `nft-ruleset`: nft's), in a scratch file.
pub(super) fn generated(
    env: &Env,
    what: &str,
    services: usize,
    endpoints: usize,
) -> Result<std::path::PathBuf> {
    let file = env.scratch.join(format!("{what}.txt"));
    let text = output(
        Command::new(&env.load)
            .arg(what)
            .arg(services.to_string())
            .arg(endpoints.to_string()),
    )?;
    fs::write(&file, text)?;
    Ok(file)
}

/// Waits until the tracer's CPU grows by less than `quiet_ns` in `every` (its reads are
/// over), at most `max`.
pub(super) fn settle(session: &Session, every: Duration, quiet_ns: u64, max: Duration) {
    let mut cpu = session.cpu_ns();
    let t = Instant::now();
    while t.elapsed() < max {
        std::thread::sleep(every);
        let now = session.cpu_ns();
        if now.saturating_sub(cpu) < quiet_ns {
            return;
        }
        cpu = now;
    }
}

/// The `rule_change` facts xtlock printed (`--json`) to `out`: how many, and the reads it
/// skipped (counted, each reason once).
#[derive(Default)]
pub(super) struct RuleFacts {
    pub facts: usize,
    pub skipped: u64,
    pub why: Vec<String>,
}

impl RuleFacts {
    pub(super) fn read(out: &std::path::Path) -> Self {
        let text = fs::read_to_string(out).unwrap_or_default();
        let mut r = RuleFacts::default();
        for v in text
            .lines()
            .filter(|l| l.contains("\"type\":\"rule_change\""))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["type"] == "rule_change")
        {
            r.facts += 1;
            if let Some(why) = v["skipped"].as_str() {
                r.skipped += 1;
                if !r.why.iter().any(|w| w == why) {
                    r.why.push(why.to_string());
                }
            }
        }
        r
    }

    /// `(N reads skipped: why; why)`.
    pub(super) fn skipped_text(skipped: u64, why: &[String]) -> String {
        if why.is_empty() {
            format!("{skipped} reads skipped")
        } else {
            format!("{skipped} reads skipped: {}", why.join("; "))
        }
    }
}

#[derive(Default)]
struct Column {
    /// Writer's wall time per write, ms.
    write_ms: Dist,
    /// The tracer's CPU per write, ms (from its start to its last read).
    cpu_ms: Dist,
    /// Tables read back (rule_change facts) per write.
    reads: Dist,
    skipped: u64,
    /// Why reads were skipped, each reason once.
    why: Vec<String>,
}

pub fn run(env: &Env) -> Result<Value> {
    let ns = Netns::new("rules")?;
    let lock = env.scratch.join("rules.lock");
    fs::write(&lock, b"")?;
    // kube-proxy's tables, as the tests make them (filter and nat; the writes go to nat).
    let rules_file = generated(env, "ruleset", SERVICES, ENDPOINTS)?;
    let t = Instant::now();
    output(
        ns.cmd("iptables-legacy-restore")
            .stdin(fs::File::open(&rules_file)?),
    )?;
    let load_s = t.elapsed().as_secs_f64();
    let save = |c: &mut Command| output(c.args(["-t", "nat"]));
    let saved = save(&mut ns.cmd("iptables-legacy-save"))?;
    let rules = saved.lines().filter(|l| l.starts_with("-A ")).count();
    let chains = saved.lines().filter(|l| l.starts_with(':')).count();
    println!(
        "\n== rules: reading a {rules}-rule, {chains}-chain nat table back after each write \
         ({WRITES} one-rule writes a run, back to back; loaded in {load_s:.1} s)"
    );
    let mut save_ms = Dist::default();
    let configs: [(&str, Option<&[&str]>); 3] = [
        ("untraced", None),
        ("xtlock --no-rule-reads", Some(&["--no-rule-reads"])),
        ("xtlock (reads on)", Some(&[])),
    ];
    let mut cols: Vec<Column> = configs.iter().map(|_| Column::default()).collect();
    let lock_s = lock.to_string_lossy().into_owned();
    for rep in 0..env.reps {
        let t = Instant::now();
        save(&mut ns.cmd("iptables-legacy-save"))?;
        save_ms.push(t.elapsed().as_secs_f64() * 1e3);
        for ((name, extra), col) in configs.iter().zip(cols.iter_mut()) {
            let session = traced(env, &format!("rules-{rep}-{name}"), &lock, *extra)?;
            let cpu0 = session.cpu_ns();
            let mut took = Dist::default();
            for w in 0..WRITES {
                let op = if w % 2 == 0 { "-A" } else { "-D" };
                let t = Instant::now();
                output(
                    ns.cmd("iptables-legacy")
                        .env("XTABLES_LOCKFILE", &lock_s)
                        .args(["-w", "-t", "nat", op, "KUBE-SERVICES", "-d", "10.97.0.1/32"])
                        .args([
                            "-p",
                            "tcp",
                            "-m",
                            "tcp",
                            "--dport",
                            "80",
                            "-j",
                            "KUBE-MARK-MASQ",
                        ]),
                )?;
                took.push(t.elapsed().as_secs_f64() * 1e3);
            }
            // The last reads finish: xtlock's CPU stops growing.
            settle(
                &session,
                Duration::from_millis(300),
                3_000_000,
                Duration::from_secs(20),
            );
            let cpu = session.cpu_ns().saturating_sub(cpu0);
            let out = session.out.clone();
            let stopped = session.stop()?;
            col.write_ms.push(took.median());
            if extra.is_some() {
                col.cpu_ms.push(cpu as f64 / 1e6 / WRITES as f64);
                let f = RuleFacts::read(&out);
                col.skipped += f.skipped;
                for w in f.why {
                    if !col.why.contains(&w) {
                        col.why.push(w);
                    }
                }
                col.reads.push(f.facts as f64 / WRITES as f64);
                if stopped.lost_events > 0 {
                    println!("  ({name}: {} events lost)", stopped.lost_events);
                }
            }
        }
    }
    let mut rows = vec![vec![
        "".to_string(),
        "writer ms/write".to_string(),
        "xtlock CPU ms/write".to_string(),
        "tables diffed/write".to_string(),
    ]];
    for ((name, extra), c) in configs.iter().zip(&cols) {
        rows.push(vec![
            name.to_string(),
            c.write_ms.show(),
            if extra.is_some() {
                c.cpu_ms.show()
            } else {
                "-".into()
            },
            if extra.is_some() {
                num(c.reads.median())
            } else {
                "-".into()
            },
        ]);
    }
    table(&rows);
    let (off, on) = (&cols[1], &cols[2]);
    let per_read_cpu = (on.cpu_ms.median() - off.cpu_ms.median()) / on.reads.median().max(1e-9);
    let writer_delay = on.write_ms.median() - off.write_ms.median();
    println!(
        "  iptables-legacy-save -t nat: {}  |  a read + parse + diff: {} ms of xtlock CPU; \
         the writer: {:+.1} ms a write with reads on ({})",
        save_ms.show(),
        num(per_read_cpu),
        writer_delay,
        RuleFacts::skipped_text(on.skipped, &on.why),
    );
    Ok(json!({
        "rules": rules,
        "chains": chains,
        "writes_per_run": WRITES,
        "iptables_save_ms": save_ms.json(),
        "columns": configs.iter().zip(&cols).map(|((name, _), c)| json!({
            "tracer": name,
            "writer_ms_per_write": c.write_ms.json(),
            "cpu_ms_per_write": c.cpu_ms.json(),
            "tables_diffed_per_write": c.reads.json(),
            "skipped": c.skipped,
            "skipped_why": c.why,
        })).collect::<Vec<_>>(),
        "read_parse_diff_cpu_ms": per_read_cpu,
        "writer_delay_ms": writer_delay,
    }))
}
