//! Bench 5: the ring buffer under a lock storm. Several processes cycle
//! `flock(LOCK_EX)`/`flock(LOCK_UN)` (each on a watched lock file of its own, so they do not
//! queue behind each other) at stepped offered rates, then as fast as they can, under
//! `xtlock trace --json --ring-buffer-mib 1`: the rate delivered before loss starts, and how
//! the loss is reported (`lost` objects, summary `lost_events`) against what was generated.
use std::{fs, path::PathBuf};

use anyhow::Result;
use serde_json::{json, Value};

use super::{
    run::{self, Session},
    stats::{num, table, Dist},
    Env,
};

/// Kernel events per uncontended lock cycle: the take and the release (a `flock()` return
/// is an event only after a wait).
const EVENTS_PER_CYCLE: u64 = 2;

#[derive(Default)]
struct Step {
    offered: Option<f64>,
    ring_mib: u32,
    /// Kernel lock events generated per second.
    generated: Dist,
    /// Delivered (generated minus lost) per second.
    delivered: Dist,
    lost_pct: Dist,
    lost_total: u64,
    lost_objects: u64,
    lost_object_sum: u64,
    generated_total: u64,
    holds: u64,
    tracer_cpu_pct: Dist,
    runs: u32,
}

pub fn run(env: &Env) -> Result<Value> {
    let procs = env.cores.clamp(2, 4);
    let locks: Vec<PathBuf> = (0..procs)
        .map(|i| env.scratch.join(format!("ring{i}.lock")))
        .collect();
    for l in &locks {
        fs::write(l, b"")?;
    }
    let lock_refs: Vec<&std::path::Path> = locks.iter().map(PathBuf::as_path).collect();
    // Offered lock cycles/s in total (x2 kernel events), then unlimited.
    let mut steps: Vec<Step> = [25_000.0, 50_000.0, 100_000.0, 200_000.0, 400_000.0]
        .iter()
        .map(|&r| Step {
            offered: Some(r),
            ring_mib: 1,
            ..Default::default()
        })
        .collect();
    steps.push(Step {
        offered: None,
        ring_mib: 1,
        ..Default::default()
    });
    steps.push(Step {
        offered: None,
        ring_mib: 4,
        ..Default::default()
    });
    let reps = env.reps.min(3);
    let secs = env.secs * 2.0;
    for rep in 0..reps {
        for (si, step) in steps.iter_mut().enumerate() {
            eprint!("  rep {}/{reps}: step {}/{}   \r", rep + 1, si + 1, 7);
            let tag = format!("ring-{si}-{rep}");
            let s = Session::xtlock(
                env,
                &tag,
                &lock_refs,
                &["--ring-buffer-mib".into(), step.ring_mib.to_string()],
            )?;
            let args: Vec<Vec<String>> = locks
                .iter()
                .map(|l| {
                    let mut a = vec![
                        "flock".to_string(),
                        l.display().to_string(),
                        "--secs".into(),
                        format!("{secs}"),
                    ];
                    if let Some(r) = step.offered {
                        a.extend(["--rate".into(), format!("{}", r / procs as f64)]);
                    }
                    a
                })
                .collect();
            let c0 = s.cpu_ns();
            let r = run::loads(env, &[], &args)?;
            let c1 = s.cpu_ns();
            let st = s.stop()?;
            let wall = r.iter().map(|l| l.wall_ns).max().unwrap_or(1) as f64 / 1e9;
            let cycles: u64 = r.iter().map(|l| l.cycles).sum();
            let generated = cycles * EVENTS_PER_CYCLE;
            // Lost events of other kinds (the generators' own fork/exec/exit, other processes)
            // count too; on a quiet machine they are few.
            let lost = st.lost_events.min(generated);
            step.generated.push(generated as f64 / wall);
            step.delivered.push((generated - lost) as f64 / wall);
            step.lost_pct
                .push(lost as f64 / generated.max(1) as f64 * 100.0);
            step.tracer_cpu_pct
                .push(c1.saturating_sub(c0) as f64 / (wall * 1e9) * 100.0);
            step.lost_total += st.lost_events;
            step.lost_objects += st.lost_objects;
            step.lost_object_sum += st.lost_object_sum;
            step.generated_total += generated;
            step.holds += st.holds;
            step.runs += 1;
        }
    }
    eprint!("{:40}\r", "");

    println!(
        "\n== 5. Ring buffer: {procs} processes cycling flock on {procs} watched files, xtlock trace --json (median ±spread of {reps} runs of {secs} s)"
    );
    let mut rows = vec![vec![
        "offered cycles/s".to_string(),
        "ring".into(),
        "generated events/s".into(),
        "delivered events/s".into(),
        "lost %".into(),
        "xtlock CPU %".into(),
        "holds / cycles".into(),
        "lost: summary / lost objects".into(),
    ]];
    let mut out = Vec::new();
    for s in &steps {
        rows.push(vec![
            s.offered.map_or("max".into(), num),
            format!("{} MiB", s.ring_mib),
            s.generated.show(),
            s.delivered.show(),
            format!("{:.2}", s.lost_pct.median()),
            format!("{:.0}", s.tracer_cpu_pct.median()),
            format!(
                "{:.4}",
                s.holds as f64 / (s.generated_total / EVENTS_PER_CYCLE).max(1) as f64
            ),
            format!(
                "{} / {} in {} objects",
                num(s.lost_total as f64),
                num(s.lost_object_sum as f64),
                s.lost_objects
            ),
        ]);
        out.push(json!({
            "offered_cycles_per_s": s.offered,
            "ring_mib": s.ring_mib,
            "generated_events_per_s": s.generated.json(),
            "delivered_events_per_s": s.delivered.json(),
            "lost_pct": s.lost_pct.json(),
            "xtlock_cpu_pct": s.tracer_cpu_pct.json(),
            "generated_events": s.generated_total,
            "holds_reported": s.holds,
            "summary_lost_events": s.lost_total,
            "lost_objects": s.lost_objects,
            "lost_objects_count_sum": s.lost_object_sum,
            "runs": s.runs,
        }));
    }
    table(&rows);
    let knee = steps
        .iter()
        .filter(|s| s.lost_total == 0)
        .map(|s| s.delivered.median())
        .fold(f64::NAN, f64::max);
    println!(
        "  highest delivered rate with no loss in any run: {} events/s",
        num(knee)
    );
    Ok(json!({
        "what": "kernel lock events (2 per flock cycle) generated vs delivered to xtlock trace --json with a small ring buffer; lost from the summary's lost_events",
        "processes": procs,
        "secs_per_run": secs,
        "reps": reps,
        "steps": out,
        "max_lossless_events_per_s": if knee.is_finite() { json!(knee) } else { Value::Null },
    }))
}
