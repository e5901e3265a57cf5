//! Bench 10 `idle`: what the DaemonSet's daemon costs always, on a quiet node (issue 55).
//! A node (network namespace) with a bridge and 40 pods on it (namespaces with a veth, each
//! serving TCP on 8080), kube-proxy's sync of its nat table (100 Services of 5 endpoints:
//! ~1,600 rules, the real `iptables-legacy-restore`) every 10 s, and a client opening 40
//! connections a second through a Service. The daemon runs in the node's namespace with the
//! manifest's own arguments (`deploy/daemonset.yaml`: `--all-netns`, the rolling capture),
//! listening on loopback. Measured over a window after a warm-up: CPU from
//! `/proc/PID/task/*/stat` (utime + stime), per thread, so each source has its share (rule
//! reads `xtlock-rules`, conntrack scans `xtlock-ct`, rtnetlink `xtlock-addrs`, the
//! namespaces' counters `xtlock-netns`, the ring, analysis, /proc rescans and recording on
//! the rest), and the peak RSS (VmHWM). Then the same with 100,000 entries in the node's
//! conntrack table (unreplied UDP flows, their timeout raised for the run).
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use xtlock_tests::cluster::{nat_table, Svc};

use super::{
    rules::{output, Netns},
    stats::{table, Dist},
    Env,
};

const PODS: usize = 40;
const SERVICES: usize = 100;
const ENDPOINTS: usize = 5;
const SYNC: Duration = Duration::from_secs(10);
const CONNECTS_PER_S: u64 = 40;
const WARMUP: Duration = Duration::from_secs(15);
const WINDOW: Duration = Duration::from_secs(60);
const CONNTRACK: u32 = 100_000;

pub fn run(env: &Env) -> Result<Value> {
    let helper = env
        .load
        .parent()
        .map(|d| d.join("xtlock-test-helper"))
        .context("the release directory")?;
    let node = QuietNode::new(env, &helper)?;
    println!(
        "\n== idle: the daemon with the manifest's arguments on a quiet node ({PODS} pods, \
         {} nat rules synced every {} s, {CONNECTS_PER_S} connections/s); {} s windows",
        node.rules,
        SYNC.as_secs(),
        WINDOW.as_secs()
    );
    let mut out = serde_json::Map::new();
    for (name, conntrack) in [("quiet", 0), ("conntrack_100k", CONNTRACK)] {
        if conntrack > 0 {
            node.fill_conntrack(conntrack)?;
        }
        let mut cpu = Vec::new();
        let mut rss = Vec::new();
        let mut by_thread: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for rep in 0..env.reps {
            let m = node.measure(env, rep)?;
            println!(
                "  {name} rep {rep}: {:.2} % of a core, peak RSS {:.1} MiB, conntrack entries {}",
                m.cpu_pct, m.hwm_mib, m.conntrack
            );
            cpu.push(m.cpu_pct);
            rss.push(m.hwm_mib);
            for (t, v) in m.threads {
                by_thread.entry(t).or_default().push(v);
            }
        }
        let cpu_d = dist(&cpu);
        let rss_d = dist(&rss);
        let mut rows = vec![
            vec![format!("idle: {name}"), "median".into(), "spread".into()],
            vec![
                "whole daemon, % of one core".to_owned(),
                format!("{:.2}", cpu_d.median()),
                format!("{:.0} %", cpu_d.spread_pct()),
            ],
            vec![
                "peak RSS, MiB".to_owned(),
                format!("{:.1}", rss_d.median()),
                format!("{:.0} %", rss_d.spread_pct()),
            ],
        ];
        let mut threads = serde_json::Map::new();
        for (t, v) in &by_thread {
            let d = dist(v);
            rows.push(vec![
                format!("  thread {t}, % of one core"),
                format!("{:.2}", d.median()),
                format!("{:.0} %", d.spread_pct()),
            ]);
            threads.insert(t.clone(), json!({ "median_pct": d.median(), "runs": v }));
        }
        table(&rows);
        out.insert(
            name.to_owned(),
            json!({
                "conntrack_entries": conntrack,
                "cpu_pct_of_one_core": { "median": cpu_d.median(), "runs": cpu },
                "peak_rss_mib": { "median": rss_d.median(), "runs": rss },
                "threads": threads,
            }),
        );
    }
    out.insert(
        "setup".into(),
        json!({
            "pods": PODS, "services": SERVICES, "endpoints_per_service": ENDPOINTS,
            "nat_rules": node.rules, "sync_s": SYNC.as_secs(),
            "connects_per_s": CONNECTS_PER_S, "warmup_s": WARMUP.as_secs(),
            "window_s": WINDOW.as_secs(), "daemon_args": node.args,
        }),
    );
    Ok(Value::Object(out))
}

fn dist(v: &[f64]) -> Dist {
    let mut d = Dist::default();
    for x in v {
        d.push(*x);
    }
    d
}

struct Measured {
    cpu_pct: f64,
    hwm_mib: f64,
    conntrack: u64,
    threads: Vec<(String, f64)>,
}

/// The node, its pods and client, the pods' servers; all removed on drop.
struct QuietNode {
    node: Netns,
    _pods: Vec<Netns>,
    client: Netns,
    servers: Vec<Child>,
    helper: PathBuf,
    table: PathBuf,
    rules: usize,
    args: Vec<String>,
    xtlock: PathBuf,
    scratch: PathBuf,
}

impl QuietNode {
    fn new(env: &Env, helper: &Path) -> Result<Self> {
        let node = Netns::new("idle")?;
        let client = Netns::new("idlecl")?;
        let n = node.name();
        let ip = |args: &[&str]| output(Command::new("ip").args(args));
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", n, "addr", "add", "10.244.0.1/16", "dev", "br0"])?;
        ip(&["-n", n, "link", "set", "br0", "up"])?;
        output(node.cmd("sysctl").args(["-qw", "net.ipv4.ip_forward=1"]))?;
        let bin = env.scratch.join("idle-bin");
        fs::create_dir_all(&bin)?;
        let agent = |name: &str| -> Result<PathBuf> {
            let p = bin.join(name);
            // A copy: the kernel's comm is the file's name.
            fs::copy(helper, &p).with_context(|| format!("copying {}", helper.display()))?;
            Ok(p)
        };
        let web = agent("web")?;
        let mut pods = Vec::new();
        let mut servers = Vec::new();
        let mut pod_ips = Vec::new();
        for i in 0..PODS {
            let p = Netns::new(&format!("idlep{i}"))?;
            let addr = format!("10.244.1.{}", i + 10);
            let veth = format!("vp{i}");
            veth_to(n, &veth, p.name(), &format!("{addr}/16"), "10.244.0.1")?;
            ip(&["-n", n, "link", "set", &veth, "master", "br0", "up"])?;
            servers.push(
                p.cmd(web.to_str().context("path")?)
                    .args(["tcplisten", "8080"])
                    .stdout(Stdio::null())
                    .spawn()
                    .context("a pod's server")?,
            );
            pods.push(p);
            pod_ips.push(addr);
        }
        veth_to(n, "vcl", client.name(), "10.199.0.2/24", "10.199.0.1")?;
        ip(&["-n", n, "addr", "add", "10.199.0.1/24", "dev", "vcl"])?;
        ip(&["-n", n, "link", "set", "vcl", "up"])?;
        // 100 Services of 5 endpoints each, spread over the 40 pods.
        let names: Vec<String> = (0..SERVICES)
            .map(|i| format!("default/svc{i}:http"))
            .collect();
        let chains: Vec<String> = (0..SERVICES)
            .map(|i| format!("KUBE-SVC-{i:03}IDLE0000000000"))
            .collect();
        let vips: Vec<String> = (0..SERVICES)
            .map(|i| format!("10.96.{}.{}", i / 250, i % 250 + 1))
            .collect();
        let eps: Vec<Vec<&str>> = (0..SERVICES)
            .map(|i| {
                (0..ENDPOINTS)
                    .map(|e| pod_ips[(i * ENDPOINTS + e) % PODS].as_str())
                    .collect()
            })
            .collect();
        let svcs: Vec<Svc> = (0..SERVICES)
            .map(|i| Svc {
                name: &names[i],
                chain: &chains[i],
                vip: &vips[i],
                proto: "tcp",
                port: 80,
                target: 8080,
                endpoints: &eps[i],
            })
            .collect();
        let text = nat_table(&svcs);
        let rules = text.lines().filter(|l| l.starts_with("-A ")).count();
        let table = env.scratch.join("idle-nat.rules");
        fs::write(&table, text)?;
        agent("kube-proxy")?;
        agent("client")?;
        let pod = crate::deploy::manifest::read(
            &crate::sh::workspace_root().join("deploy/daemonset.yaml"),
        )?;
        let env_vars = pod.resolved_env("127.0.0.1")?;
        let args = pod.expanded_args(&env_vars);
        Ok(QuietNode {
            node,
            _pods: pods,
            client,
            servers,
            helper: bin,
            table,
            rules,
            args,
            xtlock: env.xtlock.clone(),
            scratch: env.scratch.clone(),
        })
    }

    /// kube-proxy's sync: the whole nat table, as `iptables-restore -w` replaces it.
    fn sync(&self) -> Result<()> {
        let st = self
            .node
            .cmd(self.helper.join("kube-proxy").to_str().context("path")?)
            .args(["run", "iptables-legacy-restore", "-w"])
            .stdin(fs::File::open(&self.table)?)
            .stdout(Stdio::null())
            .status()?;
        if !st.success() {
            bail!("kube-proxy's restore failed: {st}");
        }
        Ok(())
    }

    fn fill_conntrack(&self, entries: u32) -> Result<()> {
        output(
            self.node
                .cmd("sysctl")
                .args(["-qw", "net.netfilter.nf_conntrack_udp_timeout=600"]),
        )?;
        let helper = self.helper.join("client");
        // Unreplied UDP flows to the node: one entry per destination port, two addresses.
        for dst in ["10.199.0.1", "10.244.0.1"] {
            let st = self
                .client
                .cmd(helper.to_str().context("path")?)
                .args(["udp-ports", dst, "10000", &(entries / 2).to_string()])
                .stdout(Stdio::null())
                .status()?;
            if !st.success() {
                bail!("filling conntrack: {st}");
            }
        }
        Ok(())
    }

    fn conntrack_count(&self) -> u64 {
        self.node
            .cmd("cat")
            .arg("/proc/sys/net/netfilter/nf_conntrack_count")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(0)
    }

    fn measure(&self, env: &Env, rep: usize) -> Result<Measured> {
        let records = self.scratch.join(format!("idle-records-{rep}"));
        let _ = fs::remove_dir_all(&records);
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut args = self.args.clone();
        rewrite(&mut args, "--listen", &format!("127.0.0.1:{port}"));
        rewrite(&mut args, "--record-dir", records.to_str().context("path")?);
        let mut daemon = self
            .node
            .cmd(self.xtlock.to_str().context("path")?)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(fs::File::create(
                env.scratch.join(format!("idle-daemon-{rep}.log")),
            )?)
            .spawn()
            .context("starting the daemon")?;
        let pid = daemon.id();
        let total = WARMUP + WINDOW + Duration::from_secs(2);
        let count = (total.as_secs() * CONNECTS_PER_S).to_string();
        let mut client = self
            .client
            .cmd(self.helper.join("client").to_str().context("path")?)
            .args([
                "connects",
                "10.96.0.1",
                "80",
                &count,
                &(1000 / CONNECTS_PER_S).to_string(),
                "1000",
            ])
            .stdout(Stdio::null())
            .spawn()?;
        let start = Instant::now();
        let mut next_sync = start;
        let mut before = None;
        let result = loop {
            let now = Instant::now();
            if now >= next_sync {
                self.sync()?;
                next_sync += SYNC;
            }
            if before.is_none() && now.duration_since(start) >= WARMUP {
                before = Some((Instant::now(), threads(pid)?, process_ticks(pid)?));
            }
            if let Some((t0, b, p0)) = &before {
                if now.duration_since(*t0) >= WINDOW {
                    let after = threads(pid)?;
                    let secs = t0.elapsed().as_secs_f64();
                    break Measured {
                        // The process's own count: threads that ended in the window too.
                        cpu_pct: process_ticks(pid)?.saturating_sub(*p0) as f64 / hz() / secs
                            * 100.0,
                        hwm_mib: hwm_kib(pid)? as f64 / 1024.0,
                        conntrack: self.conntrack_count(),
                        threads: names(&after)
                            .into_iter()
                            .map(|n| {
                                let v = share(b, &after, &n, secs);
                                (n, v)
                            })
                            .collect(),
                    };
                }
            }
            std::thread::sleep(
                Duration::from_millis(100).min(next_sync.saturating_duration_since(Instant::now())),
            );
        };
        let _ = client.kill();
        let _ = client.wait();
        let _ = daemon.kill();
        let _ = daemon.wait();
        let _ = fs::remove_dir_all(&records);
        Ok(result)
    }
}

impl Drop for QuietNode {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
    }
}

/// A veth from `node` (its end named `dev`) into `ns` (named `eth0` there), and that end set
/// up: its address, up, its default route via `gw`. The node's end is the caller's to set.
fn veth_to(node: &str, dev: &str, ns: &str, cidr: &str, gw: &str) -> Result<()> {
    output(Command::new("ip").args([
        "-n", node, "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ]))?;
    for args in [
        &["addr", "add", cidr, "dev", "eth0"][..],
        &["link", "set", "eth0", "up"],
        &["link", "set", "lo", "up"],
        &["route", "add", "default", "via", gw],
    ] {
        output(Command::new("ip").args(["-n", ns]).args(args))?;
    }
    Ok(())
}

/// `--flag VALUE` set to `value` (added when missing).
fn rewrite(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.to_owned(),
        _ => args.extend([flag.to_owned(), value.to_owned()]),
    }
}

/// (thread name, utime + stime in ticks) of every thread of `pid`.
fn threads(pid: u32) -> Result<Vec<(String, u64)>> {
    let mut v = Vec::new();
    for e in fs::read_dir(format!("/proc/{pid}/task")).context("the daemon exited")? {
        let Ok(stat) = fs::read_to_string(e?.path().join("stat")) else {
            continue;
        };
        // comm is in parentheses and may hold spaces: the fields after the last ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_owned();
        let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        // utime and stime: fields 14 and 15, the 12th and 13th after the comm.
        let t = f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
            + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        v.push((comm, t));
    }
    Ok(v)
}

fn names(t: &[(String, u64)]) -> Vec<String> {
    let mut n: Vec<String> = t.iter().map(|(c, _)| c.clone()).collect();
    n.sort();
    n.dedup();
    n
}

/// % of one core over `secs` of the threads named `name` that are alive at the end.
fn share(before: &[(String, u64)], after: &[(String, u64)], name: &str, secs: f64) -> f64 {
    let sum =
        |v: &[(String, u64)]| -> u64 { v.iter().filter(|(c, _)| c == name).map(|(_, t)| t).sum() };
    sum(after).saturating_sub(sum(before)) as f64 / hz() / secs * 100.0
}

fn hz() -> f64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64
}

/// utime + stime of the whole process (its ended threads included), in ticks.
fn process_ticks(pid: u32) -> Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).context("the daemon exited")?;
    let close = stat.rfind(')').context("/proc/PID/stat")?;
    let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    Ok(n(11) + n(12))
}

fn hwm_kib(pid: u32) -> Result<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0))
}
