//! Running the pieces of a benchmark: tracers (`xtlock trace`, bpftrace) in the background
//! with their CPU time, and the load generators (`xtlock-bench-load`).
use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use super::Env;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tracer {
    None,
    Xtlock,
    /// An older xtlock build (`--baseline`), for A/B in the same run.
    Baseline,
    Bpftrace,
    /// This tree's xtlock with `--bench-floor`: empty programs on the lock hook, the floor
    /// its lock path is measured against.
    Floor,
    /// `--bench-floor-record`: the floor plus one hold-sized ring record a release, what
    /// streaming a record per hold costs at least.
    FloorRecord,
    /// A bpftrace script that only keeps a hold histogram per holder in the kernel (streams
    /// nothing): what issue 33 holds the lock path to.
    BpftraceHist,
    /// The nf_tables bench's one-liners with xtlock's filter: only a `sendmsg()` on a
    /// `NETLINK_NETFILTER` socket is timed (the socket found from the descriptor).
    BpftraceNetfilter,
    /// `--bench-floor-drops`: an empty program on the drop hook (tp_btf `kfree_skb`), the
    /// floor the drop hook is measured against; counts nothing.
    DropFloor,
    /// `--bench-floor-syscalls`: one empty program on the `sendmsg()` and `getsockopt()`
    /// tracepoints, the floor of an nf_tables transaction's hooks; times nothing.
    SyscallFloor,
}

impl Tracer {
    pub fn name(self) -> &'static str {
        match self {
            Tracer::None => "untraced",
            Tracer::Xtlock => "xtlock",
            Tracer::Baseline => "xtlock-baseline",
            Tracer::Bpftrace => "bpftrace",
            Tracer::Floor => "floor",
            Tracer::FloorRecord => "floor+record",
            Tracer::BpftraceHist => "bpftrace-hist",
            Tracer::BpftraceNetfilter => "bpftrace-netfilter",
            Tracer::DropFloor => "drop-floor",
            Tracer::SyscallFloor => "syscall-floor",
        }
    }

    /// This tree's xtlock or the baseline build.
    pub fn is_xtlock(self) -> bool {
        matches!(
            self,
            Tracer::Xtlock
                | Tracer::Baseline
                | Tracer::Floor
                | Tracer::FloorRecord
                | Tracer::DropFloor
                | Tracer::SyscallFloor
        )
    }

    /// The tracers of a bench: untraced, xtlock, bpftrace, and the baseline last when given.
    pub fn all(env: &Env) -> Vec<Tracer> {
        let mut v = vec![Tracer::None, Tracer::Xtlock, Tracer::Bpftrace];
        if env.baseline.is_some() {
            v.push(Tracer::Baseline);
        }
        v
    }
}

/// A tracer running in the background, its stdout and stderr going to files.
pub struct Session {
    pub tracer: Tracer,
    child: Option<Child>,
    pub out: PathBuf,
    pub err: PathBuf,
}

/// `kernel.bpf_stats_enabled=1` while alive, the previous value restored on drop.
pub struct BpfStats(String);

impl BpfStats {
    pub fn enable() -> Result<Self> {
        if Command::new("bpftool").arg("version").output().is_err() {
            anyhow::bail!("--bpf-stats needs bpftool (apt-get install bpftool)");
        }
        let path = "/proc/sys/kernel/bpf_stats_enabled";
        let old = fs::read_to_string(path)?.trim().to_owned();
        fs::write(path, "1")?;
        Ok(BpfStats(old))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = fs::write("/proc/sys/kernel/bpf_stats_enabled", &self.0);
    }
}

/// Run counts and run time of BPF programs (kernel.bpf_stats_enabled), by program id.
#[derive(Clone, Debug, Default)]
pub struct ProgStats(pub std::collections::BTreeMap<u64, (String, u64, u64)>);

impl ProgStats {
    /// Programs `ids` now: (name, run_cnt, run_time_ns), from `bpftool prog show -j`.
    pub fn read(ids: &[u64]) -> Self {
        let mut m = std::collections::BTreeMap::new();
        let out = Command::new("bpftool")
            .args(["prog", "show", "-j"])
            .output();
        let Ok(out) = out else { return ProgStats(m) };
        let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) else {
            return ProgStats(m);
        };
        for p in v.as_array().into_iter().flatten() {
            let Some(id) = p["id"].as_u64() else { continue };
            if ids.contains(&id) {
                m.insert(
                    id,
                    (
                        p["name"].as_str().unwrap_or("?").to_owned(),
                        p["run_cnt"].as_u64().unwrap_or(0),
                        p["run_time_ns"].as_u64().unwrap_or(0),
                    ),
                );
            }
        }
        ProgStats(m)
    }

    /// (name, runs, ns) per program between `before` and `self`, programs that ran only.
    pub fn since(&self, before: &ProgStats) -> Vec<(String, u64, u64)> {
        let mut v = Vec::new();
        for (id, (name, cnt, ns)) in &self.0 {
            let (c0, n0) = before.0.get(id).map_or((0, 0), |(_, c, n)| (*c, *n));
            let runs = cnt.saturating_sub(c0);
            if runs > 0 {
                v.push((name.clone(), runs, ns.saturating_sub(n0)));
            }
        }
        v
    }
}

/// What a tracer said, once stopped.
#[derive(Debug, Default)]
pub struct Stopped {
    /// xtlock: `lost_events` of the final summary; bpftrace: sum of its "Lost N events".
    pub lost_events: u64,
    /// xtlock: the `lost` objects printed while tracing.
    pub lost_objects: u64,
    /// xtlock: sum of the `count`s of those objects.
    pub lost_object_sum: u64,
    /// xtlock: `hold` objects; bpftrace: output lines.
    pub holds: u64,
    pub lines: u64,
    /// xtlock: the final summary.
    pub summary: Option<Value>,
    /// xtlock: exact drops by (netns, reason name), summed over its `drop_count` objects.
    pub drop_counts: std::collections::BTreeMap<(u64, String), u64>,
    /// bpftrace: the map lines printed at exit (`@name[key]: value`).
    pub maps: Vec<(String, u64)>,
    /// The tracer's CPU time over its whole life, ns.
    pub cpu_ns: u64,
}

impl Session {
    pub fn none() -> Self {
        Session {
            tracer: Tracer::None,
            child: None,
            out: PathBuf::new(),
            err: PathBuf::new(),
        }
    }

    /// Tracer `t`'s session, ready: none, bpftrace running `script`, or xtlock (this tree's,
    /// the baseline, or the floor's empty programs) watching `locks` with `extra`.
    pub fn of(
        env: &Env,
        t: Tracer,
        tag: &str,
        script: &str,
        locks: &[&Path],
        extra: &[String],
    ) -> Result<Self> {
        match t {
            Tracer::None => Ok(Session::none()),
            Tracer::Bpftrace | Tracer::BpftraceHist | Tracer::BpftraceNetfilter => {
                Session::bpftrace(env, tag, script)
            }
            Tracer::Floor | Tracer::FloorRecord | Tracer::DropFloor | Tracer::SyscallFloor => {
                let mut args = extra.to_vec();
                args.push(
                    match t {
                        Tracer::Floor => "--bench-floor",
                        Tracer::FloorRecord => "--bench-floor-record",
                        Tracer::SyscallFloor => "--bench-floor-syscalls",
                        _ => "--bench-floor-drops",
                    }
                    .into(),
                );
                Session::xtlock_as(env, t, tag, locks, &args)
            }
            Tracer::Xtlock | Tracer::Baseline => Session::xtlock_as(env, t, tag, locks, extra),
        }
    }

    /// `xtlock trace --json` watching `locks`, ready once it logged that it is tracing.
    pub fn xtlock(env: &Env, tag: &str, locks: &[&Path], extra: &[String]) -> Result<Self> {
        Self::xtlock_as(env, Tracer::Xtlock, tag, locks, extra)
    }

    /// [`Session::xtlock`] with this tree's build or the baseline's.
    pub fn xtlock_as(
        env: &Env,
        which: Tracer,
        tag: &str,
        locks: &[&Path],
        extra: &[String],
    ) -> Result<Self> {
        let bin = match (which, &env.baseline) {
            (Tracer::Baseline, Some(b)) => b,
            _ => &env.xtlock,
        };
        let mut cmd = Command::new(bin);
        cmd.args(["trace", "--json"]);
        for l in locks {
            cmd.arg("--lock-file").arg(l);
        }
        cmd.args(extra);
        let s = Self::spawn(env, which, tag, cmd)?;
        s.wait_for(&s.err, "hooks attached", Duration::from_secs(60))?;
        Ok(s)
    }

    /// `bpftrace SCRIPT`; the script must `printf("READY\n")` in `BEGIN`.
    pub fn bpftrace(env: &Env, tag: &str, script: &str) -> Result<Self> {
        let path = env.scratch.join(format!("{tag}.bt"));
        fs::write(&path, script)?;
        let mut cmd = Command::new("bpftrace");
        cmd.arg(&path);
        let s = Self::spawn(env, Tracer::Bpftrace, tag, cmd)?;
        s.wait_for(&s.out, "READY", Duration::from_secs(60))?;
        Ok(s)
    }

    fn spawn(env: &Env, tracer: Tracer, tag: &str, mut cmd: Command) -> Result<Self> {
        let out = env.scratch.join(format!("{tag}.out"));
        let err = env.scratch.join(format!("{tag}.err"));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(fs::File::create(&out)?)
            .stderr(fs::File::create(&err)?)
            .spawn()
            .with_context(|| format!("starting {:?}", cmd.get_program()))?;
        Ok(Session {
            tracer,
            child: Some(child),
            out,
            err,
        })
    }

    fn wait_for(&self, file: &Path, needle: &str, timeout: Duration) -> Result<()> {
        let t = Instant::now();
        loop {
            if fs::read_to_string(file).is_ok_and(|s| s.contains(needle)) {
                return Ok(());
            }
            if let Some(pid) = self.pid() {
                if !Path::new(&format!("/proc/{pid}")).exists() || self.exited() {
                    bail!(
                        "{} exited before it was ready: {}",
                        self.tracer.name(),
                        tail(&self.err)
                    );
                }
            }
            if t.elapsed() > timeout {
                bail!(
                    "{} not ready after {timeout:?}: {}",
                    self.tracer.name(),
                    tail(&self.err)
                );
            }
            sleep(Duration::from_millis(50));
        }
    }

    fn exited(&self) -> bool {
        // Zombie: it ended and we have not reaped it.
        self.pid()
            .and_then(|p| fs::read_to_string(format!("/proc/{p}/stat")).ok())
            .is_some_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
    }

    /// Waits (up to `timeout`) until stdout has grown past `len`: the probes fire.
    pub fn wait_output_past(&self, len: u64, timeout: Duration) -> bool {
        if self.child.is_none() {
            return true;
        }
        let t = Instant::now();
        while t.elapsed() < timeout {
            if fs::metadata(&self.out).is_ok_and(|m| m.len() > len) {
                return true;
            }
            sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn out_len(&self) -> u64 {
        fs::metadata(&self.out).map_or(0, |m| m.len())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Ids of the BPF programs this tracer has loaded (its open program fds).
    pub fn prog_ids(&self) -> Vec<u64> {
        let Some(pid) = self.pid() else {
            return Vec::new();
        };
        let mut ids = Vec::new();
        for e in fs::read_dir(format!("/proc/{pid}/fdinfo"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(s) = fs::read_to_string(e.path()) {
                if !s.contains("prog_type:") {
                    continue;
                }
                if let Some(id) = s
                    .lines()
                    .find_map(|l| l.strip_prefix("prog_id:"))
                    .and_then(|v| v.trim().parse().ok())
                {
                    ids.push(id);
                }
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// CPU time the tracer has used so far (all its threads), ns.
    pub fn cpu_ns(&self) -> u64 {
        self.pid().map_or(0, proc_cpu_ns)
    }

    /// SIGINT, wait for the exit (SIGKILL after 30 s), and read what it printed.
    pub fn stop(mut self) -> Result<Stopped> {
        let Some(mut child) = self.child.take() else {
            return Ok(Stopped::default());
        };
        let pid = child.id();
        let cpu = proc_cpu_ns(pid);
        // SAFETY: signalling our own child, which we have not reaped yet.
        unsafe { libc::kill(pid as i32, libc::SIGINT) };
        let t = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if t.elapsed() > Duration::from_secs(30) {
                let _ = child.kill();
                break child.wait()?;
            }
            sleep(Duration::from_millis(20));
        };
        let mut s = match self.tracer {
            Tracer::Xtlock
            | Tracer::Baseline
            | Tracer::Floor
            | Tracer::FloorRecord
            | Tracer::DropFloor
            | Tracer::SyscallFloor => read_xtlock(&self.out)?,
            Tracer::Bpftrace | Tracer::BpftraceHist | Tracer::BpftraceNetfilter => {
                read_bpftrace(&self.out, &self.err)?
            }
            Tracer::None => Stopped::default(),
        };
        s.cpu_ns = cpu;
        if !status.success() && self.tracer.is_xtlock() {
            bail!("xtlock trace failed ({status}): {}", tail(&self.err));
        }
        Ok(s)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn tail(p: &Path) -> String {
    let s = fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// CPU time of a process, all threads, ns: the sum of `/proc/PID/task/*/schedstat`
/// (ns resolution), else utime + stime of `/proc/PID/stat` (clock ticks).
pub fn proc_cpu_ns(pid: u32) -> u64 {
    let tasks = format!("/proc/{pid}/task");
    if let Ok(dir) = fs::read_dir(&tasks) {
        let mut sum = 0u64;
        let mut any = false;
        for e in dir.flatten() {
            if let Ok(s) = fs::read_to_string(e.path().join("schedstat")) {
                if let Some(v) = s
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                {
                    sum += v;
                    any = true;
                }
            }
        }
        if any {
            return sum;
        }
    }
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit(')').next()?.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            // Fields after the comm: state is 3rd overall, utime 14th, stime 15th.
            let ut: u64 = f.get(11)?.parse().ok()?;
            let st: u64 = f.get(12)?.parse().ok()?;
            Some((ut + st) * 10_000_000)
        })
        .unwrap_or(0)
}

fn read_xtlock(out: &Path) -> Result<Stopped> {
    let mut s = Stopped::default();
    let f = fs::File::open(out)?;
    for line in BufReader::new(f).lines() {
        let line = line?;
        s.lines += 1;
        if line.starts_with("{\"type\":\"hold\"") {
            s.holds += 1;
        } else if line.starts_with("{\"type\":\"lost\"") {
            let v: Value = serde_json::from_str(&line)?;
            s.lost_objects += 1;
            s.lost_object_sum += v["count"].as_u64().unwrap_or(0);
        } else if line.starts_with("{\"type\":\"drop_count\"") {
            let v: Value = serde_json::from_str(&line)?;
            if let (Some(netns), Some(reason)) = (v["netns"].as_u64(), v["reason"].as_str()) {
                *s.drop_counts
                    .entry((netns, reason.to_string()))
                    .or_default() += v["count"].as_u64().unwrap_or(0);
            }
        } else if line.starts_with("{\"type\":\"summary\"") {
            let v: Value = serde_json::from_str(&line)?;
            s.lost_events = v["lost_events"].as_u64().unwrap_or(0);
            s.summary = Some(v);
        }
    }
    Ok(s)
}

fn read_bpftrace(out: &Path, err: &Path) -> Result<Stopped> {
    let mut s = Stopped::default();
    for p in [out, err] {
        let Ok(f) = fs::File::open(p) else { continue };
        for line in BufReader::new(f).lines() {
            let line = line?;
            if p == out {
                s.lines += 1;
            }
            // "Lost 1234 events"
            if let Some(rest) = line.strip_prefix("Lost ") {
                if let Some(n) = rest
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    s.lost_events += n;
                }
            } else if line.starts_with('@') {
                if let Some((k, v)) = line.rsplit_once(": ") {
                    if let Ok(v) = v.trim().parse() {
                        s.maps.push((k.to_owned(), v));
                    }
                }
            }
        }
    }
    Ok(s)
}

/// What one load generator run reported.
#[derive(Clone, Copy, Debug, Default)]
pub struct Load {
    pub cycles: u64,
    pub wall_ns: u64,
    pub cpu_ns: u64,
    pub children_cpu_ns: u64,
}

impl Load {
    fn parse(line: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(line.trim())
            .with_context(|| format!("load generator said {line:?}"))?;
        let g = |k: &str| v[k].as_u64().unwrap_or(0);
        Ok(Load {
            cycles: g("cycles"),
            wall_ns: g("wall_ns"),
            cpu_ns: g("cpu_ns"),
            children_cpu_ns: g("children_cpu_ns"),
        })
    }

    /// CPU ns per cycle, the children's included.
    pub fn cpu_per_cycle(&self) -> f64 {
        (self.cpu_ns + self.children_cpu_ns) as f64 / self.cycles.max(1) as f64
    }

    pub fn wall_per_cycle(&self) -> f64 {
        self.wall_ns as f64 / self.cycles.max(1) as f64
    }
}

/// The load generator command (`prefix` runs it elsewhere, e.g. `ip netns exec NS`).
fn load_cmd(env: &Env, prefix: &[&str], args: &[String]) -> Command {
    let mut cmd = match prefix.split_first() {
        Some((p, rest)) => {
            let mut c = Command::new(p);
            c.args(rest).arg(&env.load);
            c
        }
        None => Command::new(&env.load),
    };
    cmd.args(args);
    cmd
}

/// Runs one load generator to the end.
pub fn load(env: &Env, args: &[String]) -> Result<Load> {
    let out = load_cmd(env, &[], args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("running xtlock-bench-load")?;
    if !out.status.success() {
        bail!("xtlock-bench-load {args:?} failed ({})", out.status);
    }
    Load::parse(&String::from_utf8_lossy(&out.stdout))
}

/// Runs `n` load generators at once: all are started, and released together once each
/// said it is ready.
pub fn loads(env: &Env, prefix: &[&str], args: &[Vec<String>]) -> Result<Vec<Load>> {
    let mut kids: Vec<(Child, ChildStdin, BufReader<std::process::ChildStdout>)> = Vec::new();
    for a in args {
        let mut a = a.clone();
        a.push("--ready".into());
        let mut c = load_cmd(env, prefix, &a)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting xtlock-bench-load")?;
        let stdin = c.stdin.take().context("stdin")?;
        let mut stdout = BufReader::new(c.stdout.take().context("stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        if line.trim() != "ready" {
            bail!("xtlock-bench-load did not start: {line:?}");
        }
        kids.push((c, stdin, stdout));
    }
    for (_, stdin, _) in &mut kids {
        stdin.write_all(b"go\n")?;
        stdin.flush()?;
    }
    let mut res = Vec::new();
    for (mut c, stdin, mut stdout) in kids {
        drop(stdin);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let st = c.wait()?;
        if !st.success() {
            bail!("xtlock-bench-load failed ({st})");
        }
        res.push(Load::parse(&line)?);
    }
    Ok(res)
}

/// Each rep's runs, `(rep, index of the tracer, tracer)`, who goes first rotating so no
/// tracer always runs on the coolest or hottest part; says which run is on as it comes.
pub fn rotation(
    reps: usize,
    tracers: &[Tracer],
) -> impl Iterator<Item = (usize, usize, Tracer)> + '_ {
    (0..reps).flat_map(move |rep| {
        (0..tracers.len()).map(move |i| {
            let ti = (i + rep) % tracers.len();
            let t = tracers[ti];
            eprint!("  rep {}/{}: {:<8}\r", rep + 1, reps, t.name());
            (rep, ti, t)
        })
    })
}
