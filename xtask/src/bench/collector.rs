//! Benches 4 and 6: the collector on a generated capture (events/s per core for each stage of
//! the pipeline, peak RSS, heap allocations per event), and the capture's bytes per event.
//! Both run `examples/bench_collector` (release build), each stage in a fresh process so its
//! peak RSS is its own.
use std::{fs, path::Path, process::Command};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use super::{
    stats::{num, table, Dist},
    Env,
};

fn collector(env: &Env, args: &[&str]) -> Result<Value> {
    let out = Command::new(&env.collector)
        .args(args)
        .output()
        .context("running bench_collector")?;
    if !out.status.success() {
        bail!(
            "bench_collector {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).with_context(|| format!("bench_collector said {text:?}"))
}

fn generate(env: &Env, path: &Path, mix: &str, events: u64) -> Result<Value> {
    let p = path.display().to_string();
    collector(
        env,
        &["gen", &p, "--events", &events.to_string(), "--mix", mix],
    )
}

#[derive(Default)]
struct Stage {
    per_core: Dist,
    wall_rate: Dist,
    hwm_mib: Dist,
    allocs: Dist,
    facts: u64,
    events: u64,
}

const STAGES: [(&str, &str); 4] = [
    ("read", "read: blocks, CRC32, LZ4, records"),
    ("decode", "+ decode"),
    ("analyse", "+ Analyzer::process"),
    ("json", "+ JSON Lines sink (to a null writer)"),
];

/// The streams: `node` (a busy node, the headline figure) at `--events`, the others at a
/// fifth of it (they only show where the cost goes). `lock` and `holds` are the same lock
/// cycles as the syscall-hooking builds and this one send them.
const STREAMS: [(&str, u64); 4] = [("node", 1), ("iptables", 5), ("lock", 5), ("holds", 5)];

pub fn run(env: &Env) -> Result<(Value, Value)> {
    let mut files = Vec::new();
    for (mix, div) in STREAMS {
        let path = env.scratch.join(format!("{mix}.xtlc"));
        let n = (env.events / div).max(1000);
        eprint!("  generating {} {mix} events ...      \r", num(n as f64));
        let g = generate(env, &path, mix, n)?;
        files.push((mix, path, g));
    }
    eprint!("{:60}\r", "");

    let mut results = Vec::new();
    for (mix, path, _) in &files {
        let mut stages: Vec<Stage> = STAGES.iter().map(|_| Stage::default()).collect();
        for rep in 0..env.reps {
            for (si, (stage, _)) in STAGES.iter().enumerate() {
                eprint!("  {mix} rep {}/{}: {stage:<8}   \r", rep + 1, env.reps);
                let p = path.display().to_string();
                let v = collector(env, &["run", &p, "--stage", stage])?;
                let g = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
                let s = &mut stages[si];
                s.events = v["events"].as_u64().unwrap_or(0);
                s.facts = v["facts"].as_u64().unwrap_or(0);
                s.per_core.push(g("events") / (g("cpu_ns") / 1e9));
                s.wall_rate.push(g("events") / (g("wall_ns") / 1e9));
                s.hwm_mib.push(g("vm_hwm_kib") / 1024.0);
                s.allocs.push(g("allocs_per_event"));
            }
        }
        results.push((*mix, stages));
    }
    eprint!("{:60}\r", "");

    println!(
        "\n== 4. Collector: generated captures (node: {} events, iptables and lock: {}), one process per stage (median ±spread of {} runs)",
        num(env.events as f64),
        num((env.events / 5) as f64),
        env.reps
    );
    let mut rows = vec![vec![
        "stream / stage".to_string(),
        "facts/event".into(),
        "events/s per core".into(),
        "events/s wall".into(),
        "peak RSS MiB".into(),
        "allocs/event".into(),
    ]];
    let mut out = serde_json::Map::new();
    for (mix, stages) in &results {
        let mut per = serde_json::Map::new();
        for (si, (stage, label)) in STAGES.iter().enumerate() {
            let s = &stages[si];
            rows.push(vec![
                format!("{mix:<8} {label}"),
                format!("{:.3}", s.facts as f64 / s.events.max(1) as f64),
                s.per_core.show(),
                s.wall_rate.show(),
                format!("{:.1}", s.hwm_mib.median()),
                format!("{:.3}", s.allocs.median()),
            ]);
            per.insert(
                (*stage).into(),
                json!({
                    "events": s.events,
                    "facts": s.facts,
                    "events_per_cpu_s": s.per_core.json(),
                    "events_per_wall_s": s.wall_rate.json(),
                    "peak_rss_mib": s.hwm_mib.json(),
                    "allocs_per_event": s.allocs.json(),
                }),
            );
        }
        out.insert((*mix).into(), Value::Object(per));
    }
    table(&rows);
    let goal = results[0].1[2].per_core.median();
    println!(
        "  goal: > 5,000,000 events/s per core for read + decode + analysis of the node stream: {} ({})",
        num(goal),
        if goal > 5e6 { "met" } else { "NOT met" }
    );

    // 6. Capture size.
    println!("\n== 6. Capture size (LZ4 blocks of ~64 KiB, generated events)");
    let mut rows = vec![vec![
        "stream".to_string(),
        "events".into(),
        "file bytes".into(),
        "bytes/event on disk".into(),
        "raw bytes/event".into(),
        "per 1M events".into(),
    ]];
    let mut size = serde_json::Map::new();
    for (mix, path, g) in &files {
        let ev = g["events"].as_f64().unwrap_or(0.0);
        let bytes = fs::metadata(path).map_or(0, |m| m.len()) as f64;
        let raw = g["raw_bytes"].as_f64().unwrap_or(0.0);
        let per = g["bytes_per_event"].as_f64().unwrap_or(0.0);
        rows.push(vec![
            mix.to_string(),
            num(ev),
            num(bytes),
            format!("{per:.2}"),
            format!("{:.1}", raw / ev.max(1.0)),
            format!("{:.1} MiB", per * 1e6 / 1048576.0),
        ]);
        size.insert(
            (*mix).into(),
            json!({
                "events": ev,
                "file_bytes": bytes,
                "bytes_per_event": per,
                "raw_bytes_per_event": raw / ev.max(1.0),
            }),
        );
    }
    table(&rows);
    let mut generated = serde_json::Map::new();
    for (mix, p, g) in &files {
        let _ = fs::remove_file(p);
        generated.insert((*mix).into(), g.clone());
    }
    Ok((
        json!({
            "what": "read + decode + Analyzer::process (+ JSON sink) of generated captures, single-threaded; events/s per core = events / process CPU seconds; peak RSS = VmHWM of the process running the stage",
            "events": {"node": env.events, "iptables": env.events / 5, "lock": env.events / 5,
                "holds": env.events / 5},
            "reps": env.reps,
            "streams": Value::Object(out),
            "generated": Value::Object(generated),
        }),
        json!({
            "what": "bytes on disk per kernel event in a capture (block headers and LZ4 included, file header excluded)",
            "streams": Value::Object(size),
        }),
    ))
}
