//! Benches 1 and 2: what tracing costs on the paths it hooks. Tight loops of
//! `flock(LOCK_EX)`+`flock(LOCK_UN)` on the watched lock file and on an unwatched file,
//! `getppid()` (a syscall nobody traces), and spawning `/bin/true` — untraced, under
//! `xtlock trace`, and under a bpftrace script doing the same job. The three tracer columns
//! take turns within each repetition, so a busy machine slows them alike.
use std::{collections::BTreeMap, fs, path::Path, time::Duration};

use anyhow::Result;
use serde_json::{json, Value};

use super::{
    run::{self, rotation, BpfStats, ProgStats, Session, Tracer},
    stats::{num, table, Dist},
    Env,
};

/// The bpftrace an SRE would write for the same job as `xtlock trace`: the lock tracepoint
/// with per-thread maps tying it to the `flock()` call, and the process lifecycle for
/// attribution, printing one line per event.
pub fn bpftrace_script(lock: &Path) -> Result<String> {
    use std::os::unix::fs::MetadataExt as _;
    let m = fs::metadata(lock)?;
    let dev = kernel_dev(m.dev());
    let f = flock_fields();
    Ok(format!(
        r#"BEGIN {{ printf("READY\n"); }}
tracepoint:syscalls:sys_enter_flock {{ @enter[tid] = nsecs; @cmd[tid] = args->cmd; }}
tracepoint:filelock:flock_lock_inode /args->i_ino == {ino} && args->s_dev == {dev}/ {{
  @watched[tid] = 1;
  printf("lock %llu %d %d %s %llx %d %d %d\n", nsecs, pid, tid, comm, args->{owner},
         args->{ty}, args->{flags}, args->ret);
}}
tracepoint:syscalls:sys_exit_flock /@watched[tid]/ {{
  printf("flock %llu %d %d %llu %d %d\n", nsecs, pid, tid, @enter[tid], @cmd[tid], args->ret);
  delete(@watched[tid]);
}}
tracepoint:syscalls:sys_exit_flock {{ delete(@enter[tid]); delete(@cmd[tid]); }}
tracepoint:syscalls:sys_enter_execve {{ printf("argv %d ", tid); join(args->argv); }}
tracepoint:sched:sched_process_exec {{
  printf("exec %llu %d %s %s\n", nsecs, pid, comm, str(args->filename));
}}
tracepoint:sched:sched_process_fork {{
  printf("fork %llu %d %d %s\n", nsecs, args->parent_pid, args->child_pid, comm);
}}
tracepoint:syscalls:sys_enter_exit_group {{ @code[pid] = args->error_code; }}
tracepoint:sched:sched_process_exit {{
  printf("exit %llu %d %d %s %d\n", nsecs, pid, tid, comm, @code[pid]);
  delete(@code[pid]);
}}
END {{ clear(@enter); clear(@cmd); clear(@watched); clear(@code); }}
"#,
        ino = m.ino(),
        dev = dev,
        owner = f.0,
        ty = f.1,
        flags = f.2,
    ))
}

/// A bpftrace script that keeps only a histogram of hold times per holding command in the
/// kernel, printed at exit: the least a lock tracer can do in bpftrace (issue 33 compares
/// xtlock's lock path with it).
pub fn bpftrace_hist_script(lock: &Path) -> Result<String> {
    use std::os::unix::fs::MetadataExt as _;
    let m = fs::metadata(lock)?;
    let f = flock_fields();
    Ok(format!(
        r#"BEGIN {{ printf("READY\n"); }}
tracepoint:filelock:flock_lock_inode /args->i_ino == {ino} && args->s_dev == {dev}/ {{
  if (args->{ty} == 2) {{
    if (@start[args->{owner}]) {{
      @hold[comm] = hist(nsecs - @start[args->{owner}]);
      delete(@start[args->{owner}]);
    }}
  }} else if (args->ret == 0) {{
    @start[args->{owner}] = nsecs;
  }}
}}
END {{ clear(@start); }}
"#,
        ino = m.ino(),
        dev = kernel_dev(m.dev()),
        owner = f.0,
        ty = f.1,
    ))
}

/// Field names of `filelock:flock_lock_inode` (`owner`/`type`/`flags` since 6.9, `fl_*`
/// before).
fn flock_fields() -> (&'static str, &'static str, &'static str) {
    let fmt = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .find_map(|t| {
            fs::read_to_string(format!("{t}/events/filelock/flock_lock_inode/format")).ok()
        })
        .unwrap_or_default();
    if fmt.contains(" fl_owner;") {
        ("fl_owner", "fl_type", "fl_flags")
    } else {
        ("owner", "type", "flags")
    }
}

/// The kernel's `MKDEV(major, minor)` for a userspace `st_dev`, as the tracepoint reports it.
pub fn kernel_dev(d: u64) -> u64 {
    let major = ((d >> 8) & 0xfff) | ((d >> 32) & !0xfff);
    let minor = (d & 0xff) | ((d >> 12) & !0xff);
    (major << 20) | minor
}

struct LoadDef {
    key: &'static str,
    label: &'static str,
    args: Vec<String>,
}

#[derive(Default)]
struct Cell {
    /// CPU ns per operation of the looping process (and its children, for exec).
    cpu: Dist,
    wall: Dist,
    /// Tracer CPU ns per operation.
    tracer: Dist,
    ops_per_s: Dist,
}

pub fn run(env: &Env) -> Result<Value> {
    let watched = env.scratch.join("watched.lock");
    let unwatched = env.scratch.join("unwatched.lock");
    for f in [&watched, &unwatched] {
        fs::write(f, b"")?;
    }
    let script = bpftrace_script(&watched)?;
    let loads = loads(&watched, &unwatched);
    let hist_script = bpftrace_hist_script(&watched)?;
    let tracers = tracers(env);
    let _stats = env.bpf_stats.then(BpfStats::enable).transpose()?;
    let m = measure(env, &tracers, &loads, &watched, &script, &hist_script)?;
    eprint!("{:40}\r", "");

    let out_loads = cpu_tables(env, &tracers, &loads, &m);
    let (prog_json, floor_json) = bpf_programs(&tracers, &loads, &m);
    losses(&m);
    Ok(json!({
        "what": "CPU ns per operation of a tight loop (the caller's CPU time, which includes the BPF programs run in its syscalls); tracer_cpu is the tracer process's own CPU per operation",
        "secs_per_run": env.secs,
        "reps": env.reps,
        "loads": Value::Object(out_loads),
        "lost_events": {"xtlock": m.lost[1], "bpftrace": m.lost[2]},
        "xtlock_holds_reported": m.holds[1],
        "watched_cycles": {"xtlock": m.cycles_watched[1], "bpftrace": m.cycles_watched[2]},
        "bpftrace_lines": m.lines[2],
        "canary_missed": m.canary_missed,
        "tracer_background_cpu_ns_per_s": {"xtlock": m.background[1].json(), "bpftrace": m.background[2].json()},
        "bpf_programs": prog_json,
        "watched_cycle_floor": floor_json,
        "bpftrace_script": script,
        "bpftrace_hist_script": hist_script,
    }))
}

/// The looping loads, each run under every tracer.
fn loads(watched: &Path, unwatched: &Path) -> [LoadDef; 4] {
    let p = |p: &Path| p.display().to_string();
    [
        LoadDef {
            key: "flock_watched",
            label: "flock cycle, watched lock",
            args: vec!["flock".into(), p(watched)],
        },
        LoadDef {
            key: "flock_unwatched",
            label: "flock cycle, unwatched file",
            args: vec!["flock".into(), p(unwatched)],
        },
        LoadDef {
            key: "getppid",
            label: "getppid() (not traced)",
            args: vec!["getppid".into()],
        },
        LoadDef {
            key: "exec",
            label: "spawn+exec /bin/true",
            args: vec!["exec".into(), "/bin/true".into()],
        },
    ]
}

/// The columns: untraced, xtlock, bpftrace (and the baseline build), and with bpf_stats the
/// floors and the histogram script.
fn tracers(env: &Env) -> Vec<Tracer> {
    let mut tracers = Tracer::all(env);
    // The floor's and the histogram script's BPF costs are read from bpf_stats: only then
    // are they columns.
    if env.bpf_stats {
        tracers.extend([Tracer::Floor, Tracer::FloorRecord, Tracer::BpftraceHist]);
    }
    tracers
}

/// What the runs measured, per tracer (the first index) and load (the second).
struct Measured {
    cells: Vec<Vec<Cell>>,
    lost: Vec<u64>,
    lines: Vec<u64>,
    holds: Vec<u64>,
    cycles_watched: Vec<u64>,
    canary_missed: Vec<u32>,
    /// Tracer CPU while the machine does nothing for us: ns per second (other processes'
    /// fork/exec/exit are traced too).
    background: Vec<Dist>,
    /// (tracer, load, program) -> (ns per run, runs per operation).
    progs: BTreeMap<(usize, usize, String), (Dist, Dist)>,
}

impl Measured {
    fn new(tracers: usize, loads: usize) -> Self {
        Measured {
            cells: (0..tracers)
                .map(|_| (0..loads).map(|_| Cell::default()).collect())
                .collect(),
            lost: vec![0; tracers],
            lines: vec![0; tracers],
            holds: vec![0; tracers],
            cycles_watched: vec![0; tracers],
            canary_missed: vec![0; tracers],
            background: (0..tracers).map(|_| Dist::default()).collect(),
            progs: BTreeMap::new(),
        }
    }
}

/// Every repetition: each tracer in turn started, checked to be reading, its background
/// measured, then every load run under it.
fn measure(
    env: &Env,
    tracers: &[Tracer],
    loads: &[LoadDef],
    watched: &Path,
    script: &str,
    hist_script: &str,
) -> Result<Measured> {
    let mut m = Measured::new(tracers.len(), loads.len());
    for (rep, ti, t) in rotation(env.reps, tracers) {
        let tag = format!("lock-{}-{rep}", t.name());
        let bt = if t == Tracer::BpftraceHist {
            hist_script
        } else {
            script
        };
        let s = Session::of(env, t, &tag, bt, &[watched], &[])?;
        if !canary(env, &s, t, watched)? {
            m.canary_missed[ti] += 1;
        }
        let bg = if t == Tracer::None {
            0.0
        } else {
            let b0 = s.cpu_ns();
            let t0 = std::time::Instant::now();
            std::thread::sleep(Duration::from_secs_f64(env.secs));
            let v = s.cpu_ns().saturating_sub(b0) as f64 / t0.elapsed().as_secs_f64();
            m.background[ti].push(v);
            v
        };
        let ids = if env.bpf_stats {
            s.prog_ids()
        } else {
            Vec::new()
        };
        for (li, l) in loads.iter().enumerate() {
            measure_load(env, &s, t, (ti, li), l, bg, &ids, &mut m)?;
        }
        let st = s.stop()?;
        m.lost[ti] += st.lost_events;
        m.lines[ti] += st.lines;
        m.holds[ti] += st.holds;
    }
    Ok(m)
}

/// One lock cycle, and whether the tracer printed it within 10 s: attached and reading.
fn canary(env: &Env, s: &Session, t: Tracer, watched: &Path) -> Result<bool> {
    let before = s.out_len();
    run::load(
        env,
        &[
            "flock".into(),
            watched.display().to_string(),
            "--cycles".into(),
            "1".into(),
        ],
    )?;
    // The floor and the histogram print nothing per event: nothing to wait for.
    Ok(matches!(
        t,
        Tracer::Floor | Tracer::FloorRecord | Tracer::BpftraceHist
    ) || s.wait_output_past(before, Duration::from_secs(10)))
}

/// One run of load `l` under tracer `t` (`at`: their indexes): the caller's CPU and wall time
/// and rate, the tracer's own CPU net of its background `bg` (ns per second), and each BPF
/// program of `ids`.
#[allow(clippy::too_many_arguments)]
fn measure_load(
    env: &Env,
    s: &Session,
    t: Tracer,
    (ti, li): (usize, usize),
    l: &LoadDef,
    bg: f64,
    ids: &[u64],
    m: &mut Measured,
) -> Result<()> {
    let mut args = l.args.clone();
    args.extend(["--secs".into(), format!("{}", env.secs)]);
    let p0 = ProgStats::read(ids);
    let c0 = s.cpu_ns();
    let r = run::load(env, &args)?;
    let c1 = s.cpu_ns();
    let p1 = ProgStats::read(ids);
    let c = &mut m.cells[ti][li];
    c.cpu.push(r.cpu_per_cycle());
    c.wall.push(r.wall_per_cycle());
    c.ops_per_s.push(r.cycles as f64 / (r.wall_ns as f64 / 1e9));
    if t != Tracer::None {
        // Minus what it spends anyway on the rest of the machine.
        let own = c1.saturating_sub(c0) as f64 - bg * r.wall_ns as f64 / 1e9;
        c.tracer.push(own / r.cycles.max(1) as f64);
    }
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for (name, runs, ns) in p1.since(&p0) {
        let n = seen.entry(name.clone()).or_default();
        *n += 1;
        let key = if *n > 1 { format!("{name}#{n}") } else { name };
        let e = m.progs.entry((ti, li, key)).or_default();
        e.0.push(ns as f64 / runs as f64);
        e.1.push(runs as f64 / r.cycles.max(1) as f64);
    }
    if li == 0 {
        m.cycles_watched[ti] += r.cycles;
    }
    Ok(())
}

/// The tables of the caller's CPU per operation (and the baseline build's), the tracers' own
/// CPU, and both as a share of a core; each load's figures for the JSON.
fn cpu_tables(
    env: &Env,
    tracers: &[Tracer],
    loads: &[LoadDef],
    m: &Measured,
) -> serde_json::Map<String, Value> {
    let cells = &m.cells;
    println!(
        "\n== 1-2. Hooked paths: CPU ns per operation of the looping process (median ±spread of {} runs of {} s)",
        env.reps, env.secs
    );
    let mut rows = vec![vec![
        "operation".to_string(),
        "untraced".into(),
        "xtlock".into(),
        "bpftrace".into(),
        "xtlock adds".into(),
        "bpftrace adds".into(),
        "adds, fastest runs: xtlock".into(),
        "bpftrace".into(),
    ]];
    let mut out_loads = serde_json::Map::new();
    for (li, l) in loads.iter().enumerate() {
        let base = cells[0][li].cpu.median();
        rows.push(vec![
            l.label.into(),
            cells[0][li].cpu.show(),
            cells[1][li].cpu.show(),
            cells[2][li].cpu.show(),
            signed(
                cells[1][li].cpu.median() - base,
                cells[1][li].cpu.median() / base,
            ),
            signed(
                cells[2][li].cpu.median() - base,
                cells[2][li].cpu.median() / base,
            ),
            signed(
                cells[1][li].cpu.min() - cells[0][li].cpu.min(),
                cells[1][li].cpu.min() / cells[0][li].cpu.min(),
            ),
            signed(
                cells[2][li].cpu.min() - cells[0][li].cpu.min(),
                cells[2][li].cpu.min() / cells[0][li].cpu.min(),
            ),
        ]);
        let mut per = serde_json::Map::new();
        for (ti, t) in tracers.iter().enumerate() {
            let c = &cells[ti][li];
            per.insert(
                t.name().into(),
                json!({
                    "cpu_ns_per_op": c.cpu.json(),
                    "wall_ns_per_op": c.wall.json(),
                    "tracer_cpu_ns_per_op": c.tracer.json(),
                    "ops_per_s": c.ops_per_s.json(),
                }),
            );
        }
        per.insert("label".into(), json!(l.label));
        out_loads.insert(l.key.into(), Value::Object(per));
    }
    table(&rows);
    if tracers.get(3) == Some(&Tracer::Baseline) {
        baseline_table(loads, cells);
    }
    tracer_tables(loads, m);
    out_loads
}

/// The baseline build beside this one, for A/B: same runs, interleaved.
fn baseline_table(loads: &[LoadDef], cells: &[Vec<Cell>]) {
    let mut rows = vec![vec![
        "operation".to_string(),
        "xtlock-baseline".into(),
        "baseline adds".into(),
        "xtlock adds".into(),
    ]];
    for (li, l) in loads.iter().enumerate() {
        let base = cells[0][li].cpu.median();
        let (x, b) = (cells[1][li].cpu.median(), cells[3][li].cpu.median());
        rows.push(vec![
            l.label.into(),
            cells[3][li].cpu.show(),
            signed(b - base, b / base),
            signed(x - base, x / base),
        ]);
    }
    table(&rows);
}

/// The tracers' own CPU per operation, then with what they add in the caller as a share of
/// a core at 1,000 operations a second, and their background.
fn tracer_tables(loads: &[LoadDef], m: &Measured) {
    let cells = &m.cells;
    println!("\n  tracer CPU (its own process, ns per operation of the loop):");
    let mut rows = vec![vec![
        "operation".to_string(),
        "xtlock".into(),
        "bpftrace".into(),
    ]];
    for (li, l) in loads.iter().enumerate() {
        rows.push(vec![
            l.label.into(),
            cells[1][li].tracer.show(),
            cells[2][li].tracer.show(),
        ]);
    }
    table(&rows);
    println!(
        "\n  per 1,000 operations/s, % of one core (added in the caller + the tracer's own CPU):"
    );
    let mut rows = vec![vec![
        "operation".to_string(),
        "xtlock".into(),
        "bpftrace".into(),
    ]];
    for (li, l) in loads.iter().enumerate() {
        let base = &cells[0][li].cpu;
        // Half the untraced runs' range: an added cost smaller than that is not a number.
        let noise = (base.max() - base.min()) / 2.0;
        let pct = |ns: f64| ns * 1000.0 / 1e9 * 100.0;
        let cell = |ti: usize| {
            let c = &cells[ti][li];
            let t = if c.tracer.is_empty() {
                0.0
            } else {
                c.tracer.median()
            };
            let added = c.cpu.median() - base.median();
            if added.abs() < noise {
                format!("{:.3}% + caller in the noise (±{:.3}%)", pct(t), pct(noise))
            } else {
                format!("{:.3}%", pct(added + t))
            }
        };
        rows.push(vec![l.label.into(), cell(1), cell(2)]);
    }
    table(&rows);
    println!(
        "  (tracer CPU net of its background: xtlock {} ns/s, bpftrace {} ns/s while idle)",
        m.background[1].show(),
        m.background[2].show()
    );
}

/// With bpf_stats: each tracer's BPF programs per operation of each load, then the watched
/// cycle against the floors and bpftrace's scripts. (The programs for the JSON, the
/// comparison for the JSON or null.)
fn bpf_programs(tracers: &[Tracer], loads: &[LoadDef], m: &Measured) -> (Vec<Value>, Value) {
    let mut prog_json = Vec::new();
    if m.progs.is_empty() {
        return (prog_json, Value::Null);
    }
    let floor_ti = tracers.iter().position(|t| *t == Tracer::Floor);
    let record_ti = tracers.iter().position(|t| *t == Tracer::FloorRecord);
    let hist_ti = tracers.iter().position(|t| *t == Tracer::BpftraceHist);
    println!("\n  BPF programs (kernel.bpf_stats_enabled): ns per run x runs per operation = ns per operation");
    let mut rows = vec![vec![
        "operation / tracer / program".to_string(),
        "ns/run".into(),
        "runs/op".into(),
        "ns/op".into(),
    ]];
    // (tracer, load) -> ns of BPF per operation, all programs.
    let mut totals: BTreeMap<(usize, usize), f64> = BTreeMap::new();
    for (li, l) in loads.iter().enumerate() {
        for ti in [1, 2]
            .into_iter()
            .chain(floor_ti)
            .chain(record_ti)
            .chain(hist_ti)
        {
            let mut total = 0.0;
            for ((t, lj, name), (ns, runs)) in &m.progs {
                if *t != ti || *lj != li || runs.median() < 0.01 {
                    continue;
                }
                let per_op = ns.median() * runs.median();
                total += per_op;
                rows.push(vec![
                    format!("{} / {} / {name}", l.key, tracers[ti].name()),
                    ns.show(),
                    format!("{:.2}", runs.median()),
                    num(per_op),
                ]);
                prog_json.push(json!({
                    "load": l.key, "tracer": tracers[ti].name(), "program": name,
                    "ns_per_run": ns.json(), "runs_per_op": runs.json(),
                }));
            }
            rows.push(vec![
                format!("{} / {} / all programs", l.key, tracers[ti].name()),
                String::new(),
                String::new(),
                num(total),
            ]);
            totals.insert((ti, li), total);
        }
    }
    table(&rows);
    // The watched cycle (load 0) as a multiple of the floor, beside bpftrace's script.
    let floor_json = match (floor_ti, record_ti, hist_ti) {
        (Some(fi), Some(ri), Some(hi)) => floor_comparison(&totals, fi, ri, hi),
        _ => Value::Null,
    };
    (prog_json, floor_json)
}

/// The watched lock cycle's BPF ns of xtlock against the floor (empty programs on the same
/// hook, at `fi`), the floor of streaming a record (`ri`) and bpftrace's hold-histogram
/// script (`hi`), from `totals` ((tracer, load) -> ns per operation).
fn floor_comparison(
    totals: &BTreeMap<(usize, usize), f64>,
    fi: usize,
    ri: usize,
    hi: usize,
) -> Value {
    let at = |ti: usize| totals.get(&(ti, 0)).copied().unwrap_or(0.0);
    let (x, b, f, r, h) = (at(1), at(2), at(fi), at(ri), at(hi));
    println!(
        "  watched lock cycle, BPF ns: xtlock {} = {:.2}x the floor ({} ns: empty programs \
         on the same tp_btf hook) = {:.2}x bpftrace's hold-histogram script ({}); \
         bpftrace's same-job script {}\n  the floor of streaming a record a hold \
         (pre-filter + one Hold-sized ring record a release): {} ns = {:.2}x the floor; \
         xtlock = {:.2}x that",
        num(x),
        x / f.max(1e-9),
        num(f),
        x / h.max(1e-9),
        num(h),
        num(b),
        num(r),
        r / f.max(1e-9),
        x / r.max(1e-9),
    );
    json!({"xtlock_ns": x, "floor_ns": f, "bpftrace_ns": b,
        "bpftrace_hist_ns": h, "floor_record_ns": r,
        "xtlock_over_floor": x / f.max(1e-9),
        "xtlock_over_floor_record": x / r.max(1e-9),
        "xtlock_over_bpftrace_hist": x / h.max(1e-9)})
}

/// The events each tracer lost, and the sessions whose tracer missed the canary cycle.
fn losses(m: &Measured) {
    println!(
        "\n  events lost during these runs: xtlock {} (summary lost_events; {} holds reported for {} \
         watched cycles), bpftrace {} (its \"Lost N events\"; {} lines printed)",
        num(m.lost[1] as f64),
        num(m.holds[1] as f64),
        num(m.cycles_watched[1] as f64),
        num(m.lost[2] as f64),
        num(m.lines[2] as f64),
    );
    if m.canary_missed.iter().any(|&n| n > 0) {
        println!(
            "  warning: the tracer did not print the canary lock cycle within 10 s in {:?} sessions \
             (untraced, xtlock, bpftrace)",
            m.canary_missed
        );
    }
}

/// `+123 (1.23x)`.
fn signed(delta: f64, ratio: f64) -> String {
    let sign = if delta >= 0.0 { "+" } else { "" };
    format!("{sign}{} ({ratio:.2}x)", num(delta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_dev_encoding() {
        // makedev(8, 1) = 0x801 in userspace; MKDEV(8, 1) = 8 << 20 | 1 in the kernel.
        assert_eq!(kernel_dev(0x801), (8 << 20) | 1);
        // glibc's makedev(): major above 12 bits and minor above 8 bits are split.
        let makedev = |major: u64, minor: u64| {
            ((major & 0xfff) << 8)
                | ((major & !0xfff) << 32)
                | (minor & 0xff)
                | ((minor & !0xff) << 12)
        };
        let ud = makedev(259, 65536);
        assert_eq!(kernel_dev(ud), (259 << 20) | 65536);
    }

    #[test]
    fn signed_deltas() {
        assert_eq!(signed(1234.0, 2.5), "+1,234 (2.50x)");
        assert_eq!(signed(-12.0, 0.9), "-12.0 (0.90x)");
    }
}
