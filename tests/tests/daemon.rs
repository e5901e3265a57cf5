//! `xtlock daemon` against the real kernel and a real Prometheus: contention between a
//! kube-proxy-named holder and calico-node's `iptables-legacy -w`, scraped over loopback and
//! queried through Prometheus' HTTP API; `promtool check metrics` on the exposition; `/readyz`
//! when a probe dies behind the daemon's back; rolling capture files; the DaemonSet YAML.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use xtlock_tests::{close_fd_in, require_bpf, serial, xtlock_bin, Agent, Scratch, Tracer};

const T: Duration = Duration::from_secs(20);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// `GET path` on 127.0.0.1:port with HTTP/1.0: (status, body).
fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Polls `f` every 200 ms until it returns Some, or panics with `what` after `timeout`.
fn until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `xtlock daemon --listen 127.0.0.1:port --lock-file lock extra...`, started and tracing.
fn daemon(port: u16, lock: &Path, extra: &[&str]) -> Tracer {
    let mut c = Command::new(xtlock_bin());
    c.arg("daemon")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--lock-file")
        .arg(lock)
        .args(extra);
    Tracer::spawn(c)
}

fn wait_ready(port: u16) {
    until(T, "/readyz to answer 200", || {
        // Something must exec for the first kernel event on a quiet machine.
        let _ = Command::new("true").status();
        matches!(get(port, "/readyz"), Ok((200, _))).then_some(())
    });
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// A Prometheus server (the Debian package's binary, run directly) scraping 127.0.0.1:target
/// every second; killed on drop.
struct Prometheus {
    child: std::process::Child,
    port: u16,
    _dir: Scratch,
}

impl Prometheus {
    fn start(target: u16) -> Self {
        let dir = Scratch::new("prometheus");
        let cfg = dir.dir.join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: xtlock\n    scrape_interval: 1s\n    \
                 static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
            ),
        )
        .expect("prometheus config");
        let port = free_port();
        let child = Command::new("/usr/bin/prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("/usr/bin/prometheus (apt-get install prometheus; ./xtask/run setup does)");
        let p = Prometheus {
            child,
            port,
            _dir: dir,
        };
        until(Duration::from_secs(60), "Prometheus to be ready", || {
            matches!(get(port, "/-/ready"), Ok((200, _))).then_some(())
        });
        p
    }

    /// The instant vector of `q`: (labels, value) per series.
    fn query(&self, q: &str) -> Vec<(Value, f64)> {
        let (status, body) = get(self.port, &format!("/api/v1/query?query={}", urlencode(q)))
            .expect("query Prometheus");
        assert_eq!(status, 200, "query {q}: {body}");
        let v: Value = serde_json::from_str(&body).expect("Prometheus answers JSON");
        v["data"]["result"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|r| {
                        let val = r["value"][1]
                            .as_str()
                            .and_then(|s| s.parse().ok())
                            .unwrap_or(f64::NAN);
                        (r["metric"].clone(), val)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until `q` has a series with a value at least `min`.
    fn wait_for(&self, q: &str, min: f64) -> Vec<(Value, f64)> {
        until(
            Duration::from_secs(30),
            &format!("Prometheus: {q} >= {min}"),
            || {
                let r = self.query(q);
                r.iter().any(|(_, v)| *v >= min).then_some(r)
            },
        )
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sigterm(pid: u32) {
    // SAFETY: plain syscall on a child we started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
}

/// kube-proxy holds the lock 1.5 s while calico-node's `iptables-legacy -w` waits behind it.
fn contention(s: &Scratch, lock: &Path) {
    let lock_s = lock.to_str().expect("utf-8 path");
    let mut kp = Agent::spawn(&s.agent("kube-proxy"), &["hold", lock_s, "1500"], &[], None);
    kp.ts("acquired", T);
    std::thread::sleep(Duration::from_millis(100));
    let mut cn = Agent::spawn(
        &s.agent("calico-node"),
        &[
            "run",
            "--netns",
            "iptables-legacy",
            "-w",
            "-L",
            "INPUT",
            "-n",
        ],
        &[("XTABLES_LOCKFILE", lock_s)],
        None,
    );
    kp.ts("released", T);
    assert_eq!(
        cn.wait(),
        0,
        "iptables -w should succeed once the lock is free"
    );
    kp.wait();
}

#[test]
fn prometheus_scrapes_the_contention() {
    if !require_bpf("prometheus_scrapes_the_contention") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("daemon-prom");
    let lock = s.lock_file("xtables.lock");
    let port = free_port();
    let d = daemon(port, &lock, &[]);
    let (code, body) = get(port, "/healthz").expect("healthz");
    assert_eq!((code, body.trim()), (200, "ok"));
    wait_ready(port);
    let prom = Prometheus::start(port);
    contention(&s, &lock);

    let lock_s = lock.to_str().unwrap_or_default();
    let holds = prom.wait_for(
        &format!("xtlock_lock_hold_seconds_count{{agent=\"kube-proxy\",lock=\"{lock_s}\"}}"),
        1.0,
    );
    assert_eq!(holds[0].0["role"], "proxy", "{holds:?}");
    // The 1.5 s hold lands in the 2.5 s bucket, not below 1 s.
    let le1 = prom.query(&format!(
        "xtlock_lock_hold_seconds_bucket{{agent=\"kube-proxy\",le=\"1.0\",lock=\"{lock_s}\"}}"
    ));
    assert!(le1.iter().all(|(_, v)| *v == 0.0), "{le1:?}");
    let waits = prom.wait_for(
        "xtlock_lock_wait_seconds_count{agent=\"calico-node\",holder_agent=\"kube-proxy\"}",
        1.0,
    );
    assert_eq!(waits[0].0["lock"], lock_s, "{waits:?}");
    prom.wait_for("xtlock_iptables_exec_total{agent=\"calico-node\"}", 1.0);
    prom.wait_for("up{job=\"xtlock\"}", 1.0);
    prom.wait_for("xtlock_build_info", 1.0);
    prom.wait_for(&format!("xtlock_lock_held{{lock=\"{lock_s}\"}} == 0"), 0.0);

    // The exposition passes promtool's parser and linter.
    let (code, text) = get(port, "/metrics").expect("metrics");
    assert_eq!(code, 200);
    eprintln!(
        "/metrics: {} bytes, {} series",
        text.len(),
        text.lines().filter(|l| !l.starts_with('#')).count()
    );
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (from the prometheus package)");
    promtool
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("feed promtool");
    let out = promtool.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let rss = rss_kib(d.pid());
    eprintln!("daemon RSS after the test: {rss} KiB");
    assert!(rss < 64 * 1024, "RSS {rss} KiB is over 64 MiB");

    // SIGTERM: detach and exit 0 within 2 s.
    let t0 = Instant::now();
    sigterm(d.pid());
    let pid = d.pid();
    let _ = d.finish();
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "exit took {:?} after SIGTERM",
        t0.elapsed()
    );
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the daemon is still running"
    );
}

/// The fd of the daemon's perf link on `tp` (from its /proc/PID/fdinfo).
fn link_fd(pid: u32, tp: &str) -> Option<u32> {
    std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .ok()?
        .filter_map(Result::ok)
        .find_map(|e| {
            let text = std::fs::read_to_string(e.path()).ok()?;
            let perf = text.lines().any(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                w == ["link_type:", "perf"] || w == ["link_type:", "raw_tracepoint"]
            });
            let named = text
                .lines()
                .any(|l| l.split_whitespace().eq(["tp_name:", tp]));
            (perf && named)
                .then(|| e.file_name().to_string_lossy().parse().ok())
                .flatten()
        })
}

/// `bpftool link detach` cannot detach a tracepoint's perf link ("Operation not supported" on
/// 6.x kernels), so the test kills the link the other way: it makes the daemon close its link
/// fd itself, through ptrace (`close_fd_in`: general registers only, unlike gdb's inferior
/// call, which fails on AMX CPUs), which releases the link and detaches the program.
#[test]
fn readyz_fails_when_a_probe_is_detached() {
    if !require_bpf("readyz_fails_when_a_probe_is_detached") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("daemon-ready");
    let lock = s.lock_file("xtables.lock");
    let port = free_port();
    let d = daemon(port, &lock, &["--no-drops"]);
    wait_ready(port);
    let fd = link_fd(d.pid(), "flock_lock_inode").expect("the daemon's flock_lock_inode link");
    let closed = close_fd_in(d.pid(), fd).expect("closing the link fd inside the daemon");
    assert_eq!(closed, 0, "close({fd}) in the daemon returned {closed}");
    assert!(
        link_fd(d.pid(), "flock_lock_inode").is_none(),
        "the link fd is still open"
    );
    let body = until(
        Duration::from_secs(10),
        "/readyz to answer 503",
        || match get(port, "/readyz") {
            Ok((503, b)) => Some(b),
            _ => None,
        },
    );
    assert!(body.contains("flock_lock_inode"), "{body}");
    let (code, _) = get(port, "/healthz").expect("healthz");
    assert_eq!(code, 200, "still alive, only not ready");
    let (_, m) = get(port, "/metrics").expect("metrics");
    assert!(
        m.contains("xtlock_probe_attached{program=\"flock_lock_inode\"} 0"),
        "{m}"
    );
    // Killed, not stopped: its own close of that fd at exit would find it already closed
    // (Rust aborts on that IO-safety violation in debug builds).
    drop(d);
}

fn capture_files(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut v: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".xtlock"))
                .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn record_dir_keeps_n_files_under_b_bytes() {
    if !require_bpf("record_dir_keeps_n_files_under_b_bytes") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("daemon-roll");
    let lock = s.lock_file("xtables.lock");
    let dir = s.dir.join("captures");
    let dir_s = dir.to_str().unwrap_or_default().to_owned();
    let port = free_port();
    const KEEP: usize = 3;
    const MAX: u64 = 600_000;
    let keep = KEEP.to_string();
    let max = MAX.to_string();
    let d = daemon(
        port,
        &lock,
        &[
            "--no-drops",
            "--record-dir",
            &dir_s,
            "--record-keep",
            &keep,
            "--record-max-bytes",
            &max,
        ],
    );
    wait_ready(port);
    // Load: short processes (each an exec and an exit in the capture) and lock holds.
    let lock_s = lock.to_str().unwrap_or_default();
    let started = Instant::now();
    let mut max_seen = (0usize, 0u64);
    let mut names = std::collections::BTreeSet::new();
    while started.elapsed() < Duration::from_secs(40) && names.len() < KEEP + 3 {
        for _ in 0..50 {
            let _ = Command::new("true").arg("x".repeat(200)).status();
        }
        let mut kp = Agent::spawn(&s.agent("kube-proxy"), &["hold", lock_s, "1"], &[], None);
        kp.wait();
        let files = capture_files(&dir);
        let total: u64 = files.iter().map(|f| f.1).sum();
        max_seen = (max_seen.0.max(files.len()), max_seen.1.max(total));
        names.extend(files.into_iter().map(|f| f.0));
        assert!(
            max_seen.0 <= KEEP,
            "{max_seen:?} files/bytes: more than {KEEP} files"
        );
        assert!(
            max_seen.1 <= MAX,
            "{max_seen:?} files/bytes: more than {MAX} bytes"
        );
    }
    assert!(
        names.len() > KEEP,
        "expected rotation past {KEEP} files in 40 s, saw {names:?}"
    );
    sigterm(d.pid());
    let _ = d.finish();
    let files = capture_files(&dir);
    eprintln!("capture files at the end: {files:?}");
    assert!(files.len() <= KEEP && files.iter().map(|f| f.1).sum::<u64>() <= MAX);
    // The oldest kept one (rotated) and the last one (flushed at SIGTERM) both replay.
    for (f, _) in [files.first(), files.last()].into_iter().flatten() {
        let out = Command::new(xtlock_bin())
            .args(["report", "--json"])
            .arg(f)
            .output()
            .expect("xtlock report");
        assert!(
            out.status.success(),
            "report {}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let last = String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .map(str::to_owned)
            .unwrap_or_default();
        let v: Value = serde_json::from_str(&last).expect("summary JSON");
        assert_eq!(v["type"], "summary");
        assert!(v["events"].as_u64().unwrap_or(0) > 0, "{last}");
    }
}

/// The value of an unlabelled metric in an exposition.
fn metric(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The disk under --record-dir fills up, then frees: recording stops without stopping the
/// daemon, says so (/readyz 503 with the reason, `xtlock_recording_up` 0, an error count),
/// leaves no empty file, and resumes by itself; the files before and after replay.
#[test]
fn recording_survives_a_full_disk() {
    if !require_bpf("recording_survives_a_full_disk") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("daemon-full");
    let lock = s.lock_file("xtables.lock");
    let fs = xtlock_tests::SmallFs::mount(&s.dir.join("small"), 1024);
    let dir = fs.dir.join("captures");
    let dir_s = dir.to_str().unwrap_or_default().to_owned();
    let port = free_port();
    let d = daemon(port, &lock, &["--no-drops", "--record-dir", &dir_s]);
    wait_ready(port);
    let scrape = || get(port, "/metrics").map(|r| r.1).unwrap_or_default();
    assert_eq!(metric(&scrape(), "xtlock_recording_up"), Some(1.0));
    let filler = fs.fill();
    // Events to write, so the next flush meets the full disk.
    let why = until(T, "/readyz to say recording failed", || {
        for _ in 0..20 {
            let _ = Command::new("true").status();
        }
        match get(port, "/readyz") {
            Ok((503, body)) if body.contains("recording") => Some(body),
            _ => None,
        }
    });
    eprintln!("/readyz while the disk is full: {why}");
    assert!(why.contains("No space left on device"), "{why}");
    let m = scrape();
    assert_eq!(metric(&m, "xtlock_recording_up"), Some(0.0), "{m}");
    assert!(
        metric(&m, "xtlock_recording_errors_total").unwrap_or(0.0) >= 1.0,
        "{m}"
    );
    // The daemon still serves and still traces.
    contention(&s, &lock);
    std::fs::remove_file(&filler).expect("remove filler");
    until(Duration::from_secs(45), "recording to resume", || {
        let _ = Command::new("true").status();
        (metric(&scrape(), "xtlock_recording_up") == Some(1.0)).then_some(())
    });
    wait_ready(port);
    contention(&s, &lock);
    sigterm(d.pid());
    let _ = d.finish();
    let files = capture_files(&dir);
    eprintln!("capture files: {files:?}");
    assert!(
        files.len() >= 2,
        "a file before the failure and one after: {files:?}"
    );
    for (f, size) in &files {
        assert!(*size > 0, "an empty capture file was left: {}", f.display());
        let out = Command::new(xtlock_bin())
            .args(["report", "--json"])
            .arg(f)
            .output()
            .expect("xtlock report");
        assert!(
            out.status.success(),
            "report {}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The file written after the recovery saw the second contention.
    let (last, _) = files.last().expect("a file");
    let out = Command::new(xtlock_bin())
        .args(["report", "--json"])
        .arg(last)
        .output()
        .expect("xtlock report");
    let text = String::from_utf8_lossy(&out.stdout);
    let summary: Value = text
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_default();
    assert_eq!(
        summary["holds"]["kube-proxy"]["count"], 1,
        "the resumed file has the hold made after recovery: {summary}"
    );
}

/// deploy/daemonset.yaml parses and has what a node needs (no cluster here: the shape only).
#[test]
fn daemonset_yaml_has_the_required_fields() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/daemonset.yaml");
    let docs: Vec<Value> = text
        .split("\n---\n")
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.starts_with('#'))
        })
        .map(|d| serde_norway::from_str(d).unwrap_or_else(|e| panic!("YAML: {e}\n{d}")))
        .collect();
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("no {k} in daemonset.yaml"))
    };
    let ns = kind("Namespace")["metadata"]["name"].clone();
    assert_eq!(kind("ServiceAccount")["metadata"]["namespace"], ns);
    let ds = kind("DaemonSet");
    assert_eq!(ds["metadata"]["namespace"], ns);
    let pod = &ds["spec"]["template"];
    let spec = &pod["spec"];
    assert_eq!(spec["hostPID"], true);
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(
        spec["serviceAccountName"],
        kind("ServiceAccount")["metadata"]["name"]
    );
    assert!(
        spec["tolerations"].as_array().is_some_and(|t| t
            .iter()
            .any(|t| t["operator"] == "Exists" && t.get("key").is_none())),
        "must tolerate every taint: {}",
        spec["tolerations"]
    );
    let ann = &pod["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], "9655");
    let c = &spec["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(args.first(), Some(&"daemon"), "{args:?}");
    assert!(args.iter().any(|a| a.contains(":9655")), "{args:?}");
    let sc = &c["securityContext"];
    let caps: Vec<&str> = sc["capabilities"]["add"]
        .as_array()
        .expect("capabilities.add")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    // What each one gives: deploy/README.md (`cargo xtask deploy-test` runs without each).
    for cap in ["SYS_ADMIN", "SYSLOG", "SYS_PTRACE"] {
        assert!(caps.contains(&cap), "capability {cap} missing: {caps:?}");
    }
    assert_eq!(sc["capabilities"]["drop"][0], "ALL");
    assert_ne!(sc["privileged"], true, "capabilities, not privileged");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(c[probe]["httpGet"]["port"], 9655, "{probe}");
    }
    let host_paths: Vec<&str> = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    // BTF comes with the container's /sys; pods are named from the kubelet's log directories.
    for p in [
        "/run",
        "/sys/kernel/tracing",
        "/var/log/pods",
        "/var/log/containers",
        "/var/lib/xtlock",
    ] {
        assert!(
            host_paths.contains(&p),
            "hostPath {p} missing: {host_paths:?}"
        );
    }
    assert!(
        c["resources"]["limits"]["memory"].is_string(),
        "a memory limit"
    );
}

/// The value of the sample `name{labels}` in a Prometheus exposition (0 when absent).
fn sample(metrics: &str, name_and_labels: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A restore is a restore whatever its binary is called: the real Debian binaries under every
/// name agents run them by (`iptables-restore`, `ip6tables-restore`, `iptables-legacy-restore`,
/// `ip6tables-legacy-restore`, `iptables-nft-restore`, `ip6tables-nft-restore`), and
/// `xtables-legacy-multi` / `xtables-nft-multi` through a link of each name. Each agent's
/// runs count as syncs in `trace`'s summary and in the daemon's `xtlock_syncs_total`, each run
/// in the restore-duration histogram; those that take the xtables lock (the legacy backend),
/// timing out three times in a row behind a holder, stall their agent, and the next completed
/// restore ends the stall. The comm of most of them is cut (`iptables-legacy`,
/// `iptables-nft-re`): before issue 35 none of those counted.
#[test]
fn restores_by_every_name_are_syncs() {
    if !require_bpf("restores_by_every_name_are_syncs") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("restore-names");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap();
    let rules = xtlock_tests::write_file(
        &s.dir,
        "rules",
        "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p tcp --dport 9 -j ACCEPT\nCOMMIT\n",
    );
    let links = s.dir.join("links");
    std::fs::create_dir_all(&links).unwrap();
    let backend_of = |p: &Path| {
        let real = std::fs::canonicalize(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        real.to_string_lossy().contains("legacy")
    };
    // (program, takes the xtables lock)
    let mut programs: Vec<(PathBuf, bool)> = Vec::new();
    for name in [
        "iptables-restore",
        "ip6tables-restore",
        "iptables-legacy-restore",
        "ip6tables-legacy-restore",
        "iptables-nft-restore",
        "ip6tables-nft-restore",
    ] {
        let real = PathBuf::from("/usr/sbin").join(name);
        let legacy = backend_of(&real);
        programs.push((real, legacy));
        // The multi-call binary through a link of this name; plain names to the legacy one.
        let multi = if name.contains("-nft-") {
            "/usr/sbin/xtables-nft-multi"
        } else {
            "/usr/sbin/xtables-legacy-multi"
        };
        let link = links.join(name);
        std::os::unix::fs::symlink(multi, &link).unwrap();
        programs.push((link, !name.contains("-nft-")));
    }
    let port = free_port();
    let d = daemon(port, &lock, &[]);
    wait_ready(port);
    let tracer = Tracer::start(&[&lock], Duration::from_secs(40), &["--no-drops"]);
    let agent = |i: usize| format!("sync{i}");
    let restore = |i: usize, prog: &Path| {
        let mut a = Agent::spawn(
            &s.agent(&agent(i)),
            &["run", "--netns", prog.to_str().unwrap(), "-w", "1"],
            &[("XTABLES_LOCKFILE", lock_s)],
            Some(&rules),
        );
        a.wait_within(T)
    };
    for _ in 0..3 {
        for (i, (prog, _)) in programs.iter().enumerate() {
            assert_eq!(restore(i, prog), 0, "{}", prog.display());
        }
    }
    // A holder for 4.5 s: every lock-taking restore gives up three times in a row.
    let mut holder = Agent::spawn(&s.agent("holder"), &["hold", lock_s, "4500"], &[], None);
    holder.ts("acquired", T);
    std::thread::scope(|sc| {
        for (i, (prog, legacy)) in programs.iter().enumerate() {
            if *legacy {
                let restore = &restore;
                sc.spawn(move || {
                    for _ in 0..3 {
                        assert_eq!(restore(i, prog), 4, "{} did not time out", prog.display());
                    }
                });
            }
        }
    });
    holder.wait();
    for (i, (prog, legacy)) in programs.iter().enumerate() {
        if *legacy {
            assert_eq!(restore(i, prog), 0, "{}", prog.display());
        }
    }
    // Let the daemon publish, then read both.
    std::thread::sleep(Duration::from_millis(1500));
    let (status, metrics) = get(port, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200);
    tracer.interrupt();
    let trace = tracer.finish();
    d.interrupt();
    let dump = trace.dump();
    let syncs = &trace.summary()["syncs"];
    let stalls = trace.of_type("stall");
    for (i, (prog, legacy)) in programs.iter().enumerate() {
        let a = agent(i);
        let want = if *legacy { 4 } else { 3 };
        let runs = if *legacy { 7 } else { 3 };
        let what = format!("{} (agent {a})", prog.display());
        assert_eq!(syncs[&a]["syncs"], want, "{what}: summary\n{dump}");
        assert_eq!(
            sample(&metrics, &format!("xtlock_syncs_total{{agent=\"{a}\"}}")),
            f64::from(want),
            "{what}: xtlock_syncs_total\n{metrics}"
        );
        assert_eq!(
            sample(
                &metrics,
                &format!("xtlock_iptables_restore_duration_seconds_count{{agent=\"{a}\"}}")
            ),
            f64::from(runs),
            "{what}: restore durations\n{metrics}"
        );
        let mine: Vec<(bool, &str)> = stalls
            .iter()
            .filter(|st| st["agent"] == a.as_str())
            .map(|st| {
                (
                    st["stalled"].as_bool().unwrap(),
                    st["reason"].as_str().unwrap(),
                )
            })
            .collect();
        let want: &[(bool, &str)] = if *legacy {
            &[(true, "restores_time_out"), (false, "synced")]
        } else {
            &[]
        };
        assert_eq!(mine, want, "{what}: stalls\n{dump}");
    }
}

/// At its fd limit, with 150 clients holding connections open, the daemon still answers
/// `/readyz` and `/metrics` at once (a new connection closes the oldest when the fds left run
/// short), and its hooks are not called detached for want of an fd to check them with.
#[test]
fn health_answers_at_the_fd_limit() {
    if !require_bpf("health_answers_at_the_fd_limit") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("fd-limit");
    let lock = s.lock_file("xtables.lock");
    let port = free_port();
    let mut c = Command::new("prlimit");
    c.arg("--nofile=128:128")
        .arg(xtlock_bin())
        .arg("daemon")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--lock-file")
        .arg(&lock);
    let d = Tracer::spawn(c);
    wait_ready(port);
    let clients: Vec<TcpStream> = (0..150)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(clients.len() > 100, "{} connections", clients.len());
    std::thread::sleep(Duration::from_secs(2));
    let start = Instant::now();
    let (status, body) = get(port, "/readyz").expect("GET /readyz at the fd limit");
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    let (status, metrics) = get(port, "/metrics").expect("GET /metrics at the fd limit");
    assert_eq!(status, 200);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let attached: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("xtlock_probe_attached{"))
        .collect();
    assert!(!attached.is_empty(), "{metrics}");
    assert!(attached.iter().all(|l| l.ends_with(" 1")), "{attached:?}");
    drop(clients);
    d.interrupt();
}

/// The daemon, as the DaemonSet runs it, counts what each dropping rule dropped: a DROP rule
/// in a pod-like namespace drops a UDP flood from its peer, and
/// `xtlock_rule_drop_packets_total` for that rule (its text as iptables-save prints it)
/// equals the rule's own counter delta (`iptables -L -v -x`) and what the sender sent.
#[test]
fn the_daemon_counts_drops_by_rule() {
    if !require_bpf("the_daemon_counts_drops_by_rule") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("daemon-rule-drops");
    let lock = s.lock_file("xtables.lock");
    let port = free_port();
    let d = daemon(port, &lock, &[]);
    wait_ready(port);
    let ns = xtlock_tests::NetnsPair::new("xtlock-drd", 214);
    let rule = "-p udp -m udp --dport 9314 -j DROP";
    xtlock_tests::NetnsPair::exec(
        &ns.a,
        "iptables-legacy",
        &[
            "-w", "-A", "INPUT", "-p", "udp", "--dport", "9314", "-j", "DROP",
        ],
    );
    // The read after that write is the table's baseline.
    std::thread::sleep(Duration::from_millis(1500));
    let before = xtlock_tests::iptables_packets(&ns.a, "INPUT", "dpt:9314");
    let sent = xtlock_tests::send_udp(&s, &ns.b, &ns.addr_a, 9314, 700, 4);
    let after = xtlock_tests::iptables_packets(&ns.a, "INPUT", "dpt:9314");
    assert_eq!(
        after - before,
        sent,
        "the rule's counter against the sender"
    );
    let label = format!("rule=\"{rule}\"");
    let counted = |body: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with("xtlock_rule_drop_packets_total{") && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let body = until(T, "the rule's drops in /metrics", || {
        let (_, body) = get(port, "/metrics").ok()?;
        (counted(&body) >= sent as f64).then_some(body)
    });
    // Settled: one more read must not add to it.
    std::thread::sleep(Duration::from_millis(2500));
    let (_, again) = get(port, "/metrics").unwrap();
    assert_eq!(counted(&body), sent as f64, "{body}");
    assert_eq!(counted(&again), sent as f64, "{again}");
    assert!(
        again
            .lines()
            .any(|l| l.starts_with("xtlock_rule_drop_packets_total{")
                && l.contains(&label)
                && l.contains("table=\"filter\"")
                && l.contains("chain=\"INPUT\"")
                && l.contains("netns=\"other\"")),
        "{again}"
    );
    sigterm(d.pid());
    drop(d);
}
