//! `deploy-test --measure`: CPU and memory of the container, started as the manifest says,
//! idle, under a lock storm and under a drop storm, next to the manifest's requests and
//! limits, with the machine's load during each window (the figures are only as good as the
//! machine was quiet).
use std::{
    fmt::Write as _,
    fs,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _, Result};

use super::{
    engine::in_netns, manifest::PodRun, node_drop_rule, record_dir, CaptureGuard, Node, DROP_PORT,
    LOCK, NODE_IP, NODE_NS, PEER_NS,
};

/// Length of each measured window.
const WINDOW: Duration = Duration::from_secs(20);

/// CPU time of a process (all its threads), in seconds.
fn cpu_secs(pid: u32) -> Result<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised comm: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').context("stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 =
        f.get(11).context("utime")?.parse::<f64>()? + f.get(12).context("stime")?.parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

/// VmRSS and VmHWM of a process, in bytes.
fn rss(pid: u32) -> Result<(u64, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = |k: &str| -> Option<u64> {
        s.lines()
            .find(|l| l.starts_with(k))?
            .split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
            .map(|v| v * 1024)
    };
    Ok((
        kb("VmRSS:").context("VmRSS")?,
        kb("VmHWM:").context("VmHWM")?,
    ))
}

/// The container's memory cgroup usage and its peak (what the limit is checked against:
/// includes the BPF maps the kernel charges to it, and page cache).
fn cgroup_memory(pid: u32) -> Option<(u64, u64)> {
    let cg = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    for l in cg.lines() {
        let mut parts = l.splitn(3, ':');
        let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
        let read = |f: &str| -> Option<u64> { fs::read_to_string(f).ok()?.trim().parse().ok() };
        if ctrl.split(',').any(|c| c == "memory") {
            let d = format!("/sys/fs/cgroup/memory{path}");
            return Some((
                read(&format!("{d}/memory.usage_in_bytes"))?,
                read(&format!("{d}/memory.max_usage_in_bytes"))?,
            ));
        }
        if ctrl.is_empty() {
            let d = format!("/sys/fs/cgroup{path}");
            if let (Some(u), Some(p)) = (
                read(&format!("{d}/memory.current")),
                read(&format!("{d}/memory.peak")),
            ) {
                return Some((u, p));
            }
        }
    }
    None
}

/// Busy and total jiffies of the machine (/proc/stat).
fn machine_cpu() -> (u64, u64) {
    let s = fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    // idle + iowait
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}

fn ncpu() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get())
}

struct Figure {
    what: &'static str,
    /// Millicores of the container over the window.
    cpu_milli: f64,
    rss: u64,
    hwm: u64,
    cgroup: Option<(u64, u64)>,
    /// The machine's CPU busy (%) during the window, and its 1-minute load average after.
    machine_busy: f64,
    load1: String,
    /// What the load was (holds/s, drops/s).
    rate: String,
}

fn window(
    node: &Node,
    pod: &PodRun,
    pid: u32,
    what: &'static str,
    load: impl FnOnce(&Arc<AtomicBool>) -> Vec<thread::JoinHandle<u64>>,
    unit: &str,
) -> Result<Figure> {
    let stop = Arc::new(AtomicBool::new(false));
    let (m0, c0, t0) = (machine_cpu(), cpu_secs(pid)?, Instant::now());
    let before = node.scrape(pod)?;
    let workers = load(&stop);
    thread::sleep(WINDOW);
    stop.store(true, Ordering::Relaxed);
    let mut done = 0;
    for w in workers {
        done += w
            .join()
            .map_err(|_| anyhow::anyhow!("a load thread panicked"))?;
    }
    let (c1, m1, el) = (cpu_secs(pid)?, machine_cpu(), t0.elapsed().as_secs_f64());
    let after = node.scrape(pod)?;
    let (r, h) = rss(pid)?;
    let counted = match unit {
        "holds" => {
            after.sum("xtlock_lock_hold_seconds_count", &[])
                - before.sum("xtlock_lock_hold_seconds_count", &[])
        }
        "drops" => after.sum("xtlock_drops_total", &[]) - before.sum("xtlock_drops_total", &[]),
        _ => 0.0,
    };
    let busy = (m1.0 - m0.0) as f64 / ((m1.1 - m0.1).max(1)) as f64 * 100.0;
    let f = Figure {
        what,
        cpu_milli: (c1 - c0) / el * 1000.0,
        rss: r,
        hwm: h,
        cgroup: cgroup_memory(pid),
        machine_busy: busy,
        load1: loadavg(),
        rate: if unit.is_empty() {
            "-".into()
        } else {
            format!(
                "{:.0} {unit}/s seen by xtlock ({done} runs by the load)",
                counted / el
            )
        },
    };
    println!(
        "  {what}: {:.1} mCPU, RSS {:.1} MiB (peak {:.1}), cgroup {:?}, machine {:.0}% busy of {} CPUs, load {}; {}",
        f.cpu_milli,
        mib(f.rss),
        mib(f.hwm),
        f.cgroup.map(|(u, p)| format!("{:.1} MiB (peak {:.1})", mib(u), mib(p))),
        f.machine_busy,
        ncpu(),
        f.load1,
        f.rate
    );
    Ok(f)
}

fn mib(b: u64) -> f64 {
    b as f64 / 1024.0 / 1024.0
}

/// `threads` loops of `make()` until `stop`; each returns how many runs it made.
fn loops(
    stop: &Arc<AtomicBool>,
    threads: usize,
    make: impl Fn() -> Command + Send + Sync + 'static,
) -> Vec<thread::JoinHandle<u64>> {
    let make = Arc::new(make);
    let count = Arc::new(AtomicU64::new(0));
    (0..threads)
        .map(|_| {
            let (stop, make, count) = (stop.clone(), make.clone(), count.clone());
            thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    if make()
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()
                        .is_ok()
                    {
                        n += 1;
                    }
                }
                count.fetch_add(n, Ordering::Relaxed);
                n
            })
        })
        .collect()
}

pub fn run(node: &Node, pod: &PodRun) -> Result<String> {
    let name = "xtlock-measure";
    let _guard = CaptureGuard::new(&record_dir(pod)?);
    node.run_container(name, pod, None)?;
    ensure!(
        node.wait_ready(name, pod, Duration::from_secs(30))?,
        "the container exited: {}",
        node.logs(name)
    );
    let pid = node.pid(name)?;
    // Past start-up (BTF parsing, the /proc snapshot).
    thread::sleep(Duration::from_secs(5));
    let mut figs = Vec::new();
    figs.push(window(node, pod, pid, "idle", |_| Vec::new(), "")?);

    // Lock storm: kube-proxy-named takers of the lock (flock, no iptables), and iptables -w
    // runs by calico-node, back to back.
    let (kp, cn, ipt) = (
        node.agent("kube-proxy"),
        node.agent("calico-node"),
        node.agent("iptables"),
    );
    figs.push(window(
        node,
        pod,
        pid,
        "lock storm",
        |stop| {
            let mut w = loops(stop, 2, move || {
                let mut c = Command::new(&kp);
                c.args(["hold", LOCK, "0"]);
                c
            });
            w.extend(loops(stop, 1, move || {
                let mut c = in_netns(NODE_NS, &cn);
                c.arg("run")
                    .arg(&ipt)
                    .args(["-w", "-C", "INPUT", "-j", "ACCEPT"]);
                c
            }));
            w
        },
        "holds",
    )?);

    // Drop storm: UDP from the peer to the port calico-node's rule drops.
    node_drop_rule("-A")?;
    let sender = node.agent("udp-sender");
    let drop = window(
        node,
        pod,
        pid,
        "drop storm",
        |stop| {
            loops(stop, 1, move || {
                let mut c = in_netns(PEER_NS, &sender);
                c.args(["udp", NODE_IP, &DROP_PORT.to_string(), "200000", "64"]);
                c
            })
        },
        "drops",
    );
    node_drop_rule("-D")?;
    figs.push(drop?);
    let (_, code) = node.stop(name, pod)?;
    let _ = node.engine.output(&["rm", "-f", name]);
    ensure!(code == 0, "the measured container exited {code}");

    let mut table = format!(
        "Measured by `cargo xtask deploy-test --measure` ({} s windows, {} CPUs):\n\n\
         | load | CPU (millicores) | RSS (peak) | memory cgroup (peak) | machine busy, load1 | rate |\n\
         | --- | --- | --- | --- | --- | --- |\n",
        WINDOW.as_secs(),
        ncpu()
    );
    let mut peak = 0u64;
    for f in &figs {
        let cg = f.cgroup.map_or("-".into(), |(u, p)| {
            peak = peak.max(p);
            format!("{:.1} MiB ({:.1})", mib(u), mib(p))
        });
        peak = peak.max(f.hwm);
        let _ = writeln!(
            table,
            "| {} | {:.1} | {:.1} MiB ({:.1}) | {cg} | {:.0}%, {} | {} |",
            f.what,
            f.cpu_milli,
            mib(f.rss),
            mib(f.hwm),
            f.machine_busy,
            f.load1,
            f.rate
        );
    }
    let _ = writeln!(
        table,
        "\nManifest: requests cpu {}m, memory {:.0} MiB; limits memory {:.0} MiB.",
        pod.cpu_request_milli.unwrap_or(0),
        mib(pod.memory_request.unwrap_or(0)),
        mib(pod.memory_limit.unwrap_or(0))
    );
    let out = node.work.join("resources.md");
    fs::write(&out, &table)?;
    println!("{table}(also in {})", out.display());
    if let Some(limit) = pod.memory_limit {
        ensure!(
            peak < limit,
            "memory peaked at {:.1} MiB, over the manifest's limit of {:.1} MiB",
            mib(peak),
            mib(limit)
        );
    }
    Ok(format!(
        "resources measured: idle {:.1} mCPU, peak memory {:.1} MiB",
        figs[0].cpu_milli,
        mib(peak)
    ))
}
