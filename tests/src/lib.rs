//! Shared helpers for xtlock's integration tests: privilege gating, named helper processes,
//! a wrapper around a running `xtlock trace --json`, and kube-proxy-shaped rule generators.
//!
//! Tests that need root and BPF skip with a message outside CI; under `CI=true` a missing
//! capability fails the test instead.

use std::{
    collections::HashMap,
    fs,
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{mpsc, Mutex, MutexGuard, OnceLock},
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;

mod bpftrace;
pub mod cluster;
mod inject;
mod pods;
mod smallfs;
pub use bpftrace::{spawn_bpftrace, Bpftrace};
pub use inject::close_fd_in;
pub use pods::{cgroup2_root, kubelet_logs, PodCgroup};
pub use smallfs::SmallFs;

/// BPF tests share CPU time and the kernel's tracepoints: run them one at a time so
/// timings stay honest.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Extra `xtlock` arguments for every traced run, from `XTLOCK_TEST_TRACER_ARGS`: how the
/// VM suite runs the lock tests a second time with other attach types (e.g.
/// `--no-attach fentry --no-attach tp_btf`).
pub fn tracer_extra_args() -> Vec<String> {
    std::env::var("XTLOCK_TEST_TRACER_ARGS")
        .map(|v| v.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// `XTLOCK_TEST_CAPS` (e.g. `sys_admin,syslog,sys_ptrace,net_admin,net_raw`): xtlock runs
/// as root holding these capabilities only, bounding and inheritable sets cut to them with
/// setpriv (root's exec then permits exactly those): how `cargo xtask test` proves a shipped
/// deployment's set gives every feature, running the same scenarios under it.
pub fn test_caps() -> Option<String> {
    std::env::var("XTLOCK_TEST_CAPS")
        .ok()
        .filter(|v| !v.trim().is_empty())
}

/// `c` with `setpriv` put in front of the xtlock binary it runs (directly, or through
/// `nsenter`/`ip netns exec`), when `XTLOCK_TEST_CAPS` says so; else `c` as it is.
pub fn with_test_caps(c: Command) -> Command {
    let Some(caps) = test_caps() else {
        return c;
    };
    let set: String = caps
        .split(',')
        .map(|c| {
            format!(
                ",+{}",
                c.trim().to_ascii_lowercase().trim_start_matches("cap_")
            )
        })
        .collect();
    let bin = xtlock_bin();
    let mut argv: Vec<std::ffi::OsString> = vec![c.get_program().to_owned()];
    argv.extend(c.get_args().map(ToOwned::to_owned));
    let at = argv
        .iter()
        .position(|a| Path::new(a) == bin)
        .expect("the command runs the xtlock binary");
    let wrap = [
        "setpriv".to_string(),
        format!("--bounding-set=-all{set}"),
        format!("--inh-caps=-all{set}"),
        "--".to_string(),
    ];
    argv.splice(at..at, wrap.into_iter().map(Into::into));
    let mut w = Command::new(&argv[0]);
    w.args(&argv[1..]);
    for (k, v) in c.get_envs() {
        match v {
            Some(v) => w.env(k, v),
            None => w.env_remove(k),
        };
    }
    if let Some(d) = c.get_current_dir() {
        w.current_dir(d);
    }
    w
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// True when this process can load BPF programs. Outside CI, prints why a test is skipped;
/// under CI a missing capability is a failure.
pub fn require_bpf(test: &str) -> bool {
    // SAFETY: plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        return true;
    }
    let why = format!("{test}: needs root to load BPF programs (run the suite as root)");
    if in_ci() {
        panic!("{why}; CI=true, so this is a failure, not a skip");
    }
    eprintln!("skipped: {why}");
    false
}

/// A test, or part of one, that this kernel cannot run for lack of `feature` (named so the
/// skip says what a kernel needs): said on stderr and, in the VM, added to
/// `$XTLOCK_VM_RESULTS/skips`, which `cargo xtask vm-test` prints per kernel and
/// docs/kernels.md lists.
pub fn skip_on_this_kernel(test: &str, feature: &str) {
    eprintln!("skipped on this kernel: {test}: {feature}");
    if let Some(dir) = std::env::var_os("XTLOCK_VM_RESULTS") {
        let line = format!("{test}: {feature}\n");
        let written = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(Path::new(&dir).join("skips"))
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            panic!("recording the skip in {}: {e}", dir.to_string_lossy());
        }
    }
}

/// Running inside the VM of `cargo xtask vm-test`.
pub fn in_vm() -> bool {
    std::env::var("XTLOCK_VM").is_ok_and(|v| v == "1")
}

/// The kernel offers kprobes (a kprobe PMU, or tracefs `kprobe_events`).
pub fn kernel_has_kprobes() -> bool {
    Path::new("/sys/bus/event_source/devices/kprobe").exists()
        || Path::new("/sys/kernel/tracing/kprobe_events").exists()
        || Path::new("/sys/kernel/debug/tracing/kprobe_events").exists()
}

/// `xtlock probes --json ARGS`' hook entries. One run per (ARGS, modules loaded) in a test
/// binary: what attaches where changes only with the modules (nf_tables, conntrack, IPVS
/// loading or unloading), and each run loads and attaches every program, which takes 10-17 s
/// in the emulated VMs (kernel_hooks asked it 14 times per kernel).
pub fn hook_statuses(args: &[&str]) -> Vec<Value> {
    type Seen = Vec<((Vec<String>, String), Vec<Value>)>;
    static SEEN: Mutex<Seen> = Mutex::new(Vec::new());
    let key = (
        args.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        loaded_modules(),
    );
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, hooks)) = seen.iter().find(|(k, _)| *k == key) {
        return hooks.clone();
    }
    let out = Command::new(xtlock_bin())
        .args(["probes", "--json"])
        .args(args)
        .output()
        .expect("run xtlock probes");
    assert!(out.status.success(), "xtlock probes failed: {out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("probes --json is JSON");
    let hooks = v["hooks"].as_array().expect("hooks array").clone();
    seen.push((key, hooks.clone()));
    hooks
}

/// The names of the loaded modules, sorted (empty where the kernel has no modules).
fn loaded_modules() -> String {
    let text = fs::read_to_string("/proc/modules").unwrap_or_default();
    let mut names: Vec<&str> = text.lines().filter_map(|l| l.split(' ').next()).collect();
    names.sort_unstable();
    names.join(" ")
}

/// `xtlock probes --json ARGS`' entry for `hook`.
pub fn hook_status(hook: &str, args: &[&str]) -> Value {
    let hooks = hook_statuses(args);
    hooks
        .iter()
        .find(|h| h["program"] == hook)
        .cloned()
        .unwrap_or_else(|| panic!("no {hook} hook in {hooks:?}"))
}

/// The xtlock binary built beside this test (`cargo build --workspace --bins` first;
/// `./xtask/run test` does). `XTLOCK_BIN` overrides.
pub fn xtlock_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("XTLOCK_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/xtlock
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("xtlock"))
        .expect("target dir");
    assert!(
        bin.exists(),
        "{} not found: build it first with `cargo build --workspace --bins` (./xtask/run test does)",
        bin.display()
    );
    bin
}

/// A scratch directory for one test, removed on drop.
pub struct Scratch {
    pub dir: PathBuf,
}

impl Scratch {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("xtlock-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("bin")).expect("scratch dir");
        Self { dir }
    }

    /// A fresh lock file in the scratch dir (mode 0600, like iptables creates it).
    pub fn lock_file(&self, name: &str) -> PathBuf {
        use std::os::unix::fs::OpenOptionsExt;
        let p = self.dir.join(name);
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&p)
            .expect("create lock file");
        p
    }

    /// The helper binary copied under `name`, so its processes' comm is `name`.
    pub fn agent(&self, name: &str) -> PathBuf {
        let helper = PathBuf::from(env_helper());
        let dst = self.dir.join("bin").join(name);
        if !dst.exists() {
            fs::copy(&helper, &dst).expect("copy helper");
        }
        dst
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn env_helper() -> String {
    static HELPER: OnceLock<String> = OnceLock::new();
    HELPER
        .get_or_init(|| {
            std::env::var("XTLOCK_TEST_HELPER").unwrap_or_else(|_| {
                let exe = std::env::current_exe().expect("current_exe");
                exe.parent()
                    .and_then(Path::parent)
                    .map(|d| d.join("xtlock-test-helper"))
                    .expect("target dir")
                    .display()
                    .to_string()
            })
        })
        .clone()
}

/// A helper process and the `KEY VALUE...` lines it printed.
pub struct Agent {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Agent {
    /// Starts `program args...` with `env` added; stdin from `stdin` when given.
    pub fn spawn(
        program: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        stdin: Option<&Path>,
    ) -> Self {
        let mut c = Command::new(program);
        c.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in env {
            c.env(k, v);
        }
        match stdin {
            Some(p) => c.stdin(fs::File::open(p).expect("stdin file")),
            None => c.stdin(Stdio::null()),
        };
        let mut child = c
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line starting with `key `, returns its words after the key.
    pub fn expect(&mut self, key: &str, timeout: Duration) -> Vec<String> {
        if let Some(words) = find(&self.seen, key) {
            return words;
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l);
                    if let Some(words) = find(&self.seen[self.seen.len() - 1..], key) {
                        return words;
                    }
                }
                Err(_) => panic!(
                    "helper did not print `{key}` within {timeout:?}; saw {:?}",
                    self.seen
                ),
            }
        }
    }

    /// A `KEY T` line's timestamp.
    pub fn ts(&mut self, key: &str, timeout: Duration) -> u64 {
        self.expect(key, timeout)
            .last()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("`{key}` line without a timestamp: {:?}", self.seen))
    }

    /// [`wait`](Self::wait), killing the process and failing after `timeout`.
    pub fn wait_within(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return self.wait();
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        panic!(
            "still running after {timeout:?}; its output: {:?}",
            self.seen
        );
    }

    pub fn wait(&mut self) -> i32 {
        let st = self.child.wait().expect("wait");
        while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.seen.push(l);
        }
        st.code().unwrap_or(-1)
    }
}

fn find(lines: &[String], key: &str) -> Option<Vec<String>> {
    lines.iter().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some(key)).then(|| w.map(str::to_owned).collect())
    })
}

/// A running `xtlock trace --json`.
pub struct Tracer {
    child: Child,
    stderr: std::sync::Arc<Mutex<String>>,
    stderr_reader: Option<thread::JoinHandle<()>>,
    /// Reads stdout as it comes: a pipe left unread fills at 64 KiB and blocks xtlock's
    /// writes, and with them its whole pipeline (events then arrive seconds late).
    stdout_reader: Option<thread::JoinHandle<String>>,
}

impl Tracer {
    /// Starts `xtlock trace --json --lock-file L... --duration D` and waits until it says it
    /// is tracing.
    pub fn start(locks: &[&Path], duration: Duration, extra: &[&str]) -> Self {
        let mut c = Command::new(xtlock_bin());
        c.arg("trace")
            .arg("--json")
            .arg("--duration")
            .arg(format!("{}ms", duration.as_millis()));
        for l in locks {
            c.arg("--lock-file").arg(l);
        }
        c.args(extra).args(tracer_extra_args());
        Self::spawn(c)
    }

    pub fn spawn(c: Command) -> Self {
        let mut c = with_test_caps(c);
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = c.spawn().expect("spawn xtlock");
        let mut out = child.stdout.take().expect("stdout");
        let stdout_reader = thread::spawn(move || {
            let mut text = String::new();
            out.read_to_string(&mut text).expect("read stdout");
            text
        });
        let err = child.stderr.take().expect("stderr");
        let stderr = std::sync::Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let buf = stderr.clone();
        let stderr_reader = thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[xtlock] {line}");
                let ready = line.contains("tracing ");
                buf.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_str(&(line + "\n"));
                if ready {
                    let _ = tx.send(());
                }
            }
        });
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = child.kill();
            let out = child.wait_with_output().ok();
            panic!(
                "xtlock did not start tracing within 60 s; stderr:\n{}\nstatus: {:?}",
                stderr.lock().unwrap_or_else(|e| e.into_inner()),
                out.map(|o| o.status)
            );
        }
        Self {
            child,
            stderr,
            stderr_reader: Some(stderr_reader),
            stdout_reader: Some(stdout_reader),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Ctrl-C: xtlock stops, drains and prints its summary; then call [`finish`](Self::finish).
    pub fn interrupt(&self) {
        // SAFETY: plain syscall on our own child.
        unsafe { libc::kill(self.pid() as i32, libc::SIGINT) };
    }

    /// Waits until xtlock wrote `needle` to stderr; false after `timeout`.
    pub fn wait_for_stderr(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self
                .stderr
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(needle)
            {
                return true;
            }
            thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Waits for xtlock to exit and returns its JSON Lines, checking each line parses.
    pub fn finish(self) -> Trace {
        let (out, stderr) = self.finish_text();
        let events = out
            .lines()
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {l}"))
            })
            .collect();
        Trace { events, stderr }
    }

    /// Waits for xtlock to exit successfully; its stdout and stderr as they were written.
    pub fn finish_text(mut self) -> (String, String) {
        let status = self.child.wait().expect("wait xtlock");
        let out = self
            .stdout_reader
            .take()
            .map(|r| r.join().expect("stdout reader"))
            .unwrap_or_default();
        // Every line xtlock wrote to stderr, up to its exit.
        if let Some(r) = self.stderr_reader.take() {
            let _ = r.join();
        }
        let stderr = self
            .stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        assert!(
            status.success(),
            "xtlock failed: {status:?}\nstderr:\n{stderr}"
        );
        (out, stderr)
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `xtlock report --events --json CAPTURE`'s objects, checking it succeeds and prints JSON.
pub fn report_events(capture: &Path) -> Vec<Value> {
    report(capture, &["--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// `xtlock report --events` of a capture: its lines, as the terminal says them.
pub fn report_text(capture: &Path) -> String {
    report(capture, &[])
}

/// `xtlock report --events ARGS CAPTURE`'s output; it must succeed.
fn report(capture: &Path, args: &[&str]) -> String {
    let out = Command::new(xtlock_bin())
        .args(["report", "--events"])
        .args(args)
        .arg(capture)
        .output()
        .expect("xtlock report");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What one `xtlock trace --json` run printed.
pub struct Trace {
    pub events: Vec<Value>,
    pub stderr: String,
}

impl Trace {
    pub fn of_type(&self, t: &str) -> Vec<&Value> {
        self.events.iter().filter(|e| e["type"] == t).collect()
    }

    /// The summary's ranking of foreign rule changes names `writer` changing `owner`'s.
    pub fn assert_foreign_change(&self, writer: &str, owner: &str) {
        let summary = self.summary();
        assert!(
            summary["foreign_changes"]
                .as_array()
                .is_some_and(|f| f.iter().any(|r| r[0] == writer && r[1] == owner)),
            "no foreign change of {owner}'s by {writer} in the summary: {summary}"
        );
    }

    pub fn summary(&self) -> &Value {
        let last = self.events.last().expect("no output at all");
        assert_eq!(last["type"], "summary", "the summary must be the last line");
        last
    }

    pub fn dump(&self) -> String {
        self.events
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// `|got - want| <= pct% of want`.
pub fn within_pct(got: u64, want: u64, pct: f64) -> bool {
    (got as f64 - want as f64).abs() <= want as f64 * pct / 100.0
}

/// A kube-proxy-shaped `iptables-restore` input: KUBE-SERVICES dispatching to one KUBE-SVC-*
/// chain per service, each balancing over KUBE-SEP-* chains per endpoint, in the nat table,
/// plus a small filter table: two `*table`..`COMMIT` sections, so two lock holds per run.
pub fn kube_proxy_ruleset(services: usize, endpoints: usize) -> String {
    let mut s = String::new();
    s.push_str("*filter\n:KUBE-SERVICES - [0:0]\n:KUBE-FORWARD - [0:0]\n");
    s.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
    s.push_str("-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT\nCOMMIT\n");
    s.push_str(
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\n",
    );
    for i in 0..services {
        s.push_str(&format!(":KUBE-SVC-{i:016X} - [0:0]\n"));
        for j in 0..endpoints {
            s.push_str(&format!(":KUBE-SEP-{i:010X}{j:06X} - [0:0]\n"));
        }
    }
    s.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
    s.push_str("-A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE\n");
    for i in 0..services {
        let (a, b) = (i / 250, i % 250);
        s.push_str(&format!(
            "-A KUBE-SERVICES -d 10.96.{a}.{b}/32 -p tcp -m comment --comment \"ns/svc-{i}:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-{i:016X}\n"
        ));
        for j in 0..endpoints {
            let left = endpoints - j;
            if left > 1 {
                s.push_str(&format!(
                    "-A KUBE-SVC-{i:016X} -m statistic --mode random --probability {:.5} -j KUBE-SEP-{i:010X}{j:06X}\n",
                    1.0 / left as f64
                ));
            } else {
                s.push_str(&format!(
                    "-A KUBE-SVC-{i:016X} -j KUBE-SEP-{i:010X}{j:06X}\n"
                ));
            }
            s.push_str(&format!(
                "-A KUBE-SEP-{i:010X}{j:06X} -s 10.244.{a}.{j}/32 -j KUBE-MARK-MASQ\n\
                 -A KUBE-SEP-{i:010X}{j:06X} -p tcp -m tcp -j DNAT --to-destination 10.244.{a}.{j}:8080\n"
            ));
        }
    }
    s.push_str("COMMIT\n");
    s
}

/// The start of table `ip kube-proxy` as kube-proxy's nftables mode writes it (the table
/// replaced whole): the `service-ips` verdict map, the hooks that jump to `services`, which
/// looks the packet up in the map, and `mark-for-masquerade`; the service and endpoint
/// chains follow, then the closing brace.
pub const KUBE_PROXY_NFT_HEAD: &str = "add table ip kube-proxy\n\
     delete table ip kube-proxy\n\
     table ip kube-proxy {\n\
     map service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }\n\
     chain nat-prerouting { type nat hook prerouting priority dstnat; policy accept; jump services ; }\n\
     chain nat-output { type nat hook output priority -100; policy accept; jump services ; }\n\
     chain services { ip daddr . meta l4proto . th dport vmap @service-ips ; }\n\
     chain mark-for-masquerade { meta mark set meta mark or 0x4000 ; }\n";

/// A kube-proxy-nftables-shaped `nft -f` input: table `ip kube-proxy` with the
/// `service-ips` verdict map, a `service-*` chain per service (masquerade for traffic from
/// outside the pod range, then `numgen` over its endpoints) and an `endpoint-*` chain per
/// endpoint (masquerade of its own pod's traffic, `dnat to` it), named as kube-proxy names
/// them: 2 rules per service and 2 per endpoint.
pub fn kube_proxy_nft_ruleset(services: usize, endpoints: usize) -> String {
    let mut s = String::from(KUBE_PROXY_NFT_HEAD);
    for i in 0..services {
        let (a, b) = (i / 250, i % 250);
        let svc = format!("service-{i:08X}-ns/svc-{i}/tcp/http");
        let mut arms = Vec::with_capacity(endpoints);
        for j in 0..endpoints {
            // Pods in 10.128.0.0/10: endpoint n of the node at its own address.
            let n = i * endpoints + j;
            let ip = format!("10.{}.{}.{}", 128 + n / 65_536, n / 256 % 256, n % 256);
            let chain = format!("endpoint-{n:08X}-ns/svc-{i}/tcp/http__{ip}/8080");
            s.push_str(&format!(
                "chain {chain} {{ ip saddr {ip} jump mark-for-masquerade ; meta l4proto tcp dnat to {ip}:8080 ; }}\n"
            ));
            arms.push(format!("{j} : goto {chain}"));
        }
        s.push_str(&format!(
            "chain {svc} {{ ip daddr 10.96.{a}.{b} tcp dport 80 ip saddr != 10.128.0.0/10 jump mark-for-masquerade ; numgen random mod {endpoints} vmap {{ {} }} ; }}\n",
            arms.join(", ")
        ));
    }
    s.push_str("}\n");
    for chunk in (0..services).collect::<Vec<_>>().chunks(1000) {
        let elems: Vec<String> = chunk
            .iter()
            .map(|i| {
                format!(
                    "10.96.{}.{} . tcp . 80 : goto service-{i:08X}-ns/svc-{i}/tcp/http",
                    i / 250,
                    i % 250
                )
            })
            .collect();
        s.push_str(&format!(
            "add element ip kube-proxy service-ips {{ {} }}\n",
            elems.join(", ")
        ));
    }
    s
}

/// Writes `text` to a file in `dir`.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    let mut f = fs::File::create(&p).expect("create");
    f.write_all(text.as_bytes()).expect("write");
    p
}

/// Ids and names of loaded BPF programs (via bpftool), to check nothing is left behind.
pub fn loaded_bpf_programs() -> Vec<(u64, String)> {
    let out = Command::new("bpftool")
        .args(["prog", "show", "--json"])
        .output();
    let Ok(out) = out else {
        return Vec::new();
    };
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| Some((p["id"].as_u64()?, p["name"].as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// Counts of each `type` in a trace, for failure messages.
pub fn type_counts(t: &Trace) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for e in &t.events {
        *m.entry(e["type"].as_str().unwrap_or("?").to_owned())
            .or_insert(0) += 1;
    }
    m
}

/// Runs a command and returns its stdout; panics with its stderr when it fails.
pub fn sh(prog: &str, args: &[&str]) -> String {
    let out = Command::new(prog)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{prog}: {e}"));
    assert!(
        out.status.success(),
        "{prog} {}: {}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two network namespaces, `<name>-a` (10.X.0.1) and `<name>-b` (10.X.0.2), joined by a veth
/// pair; both are deleted on drop, with everything in them (rules, conntrack entries), also
/// when the test fails.
pub struct NetnsPair {
    pub a: String,
    pub b: String,
    pub addr_a: String,
    pub addr_b: String,
}

impl NetnsPair {
    /// `subnet` picks 10.`subnet`.0.0/24: give each test its own.
    pub fn new(name: &str, subnet: u8) -> Self {
        let a = format!("{name}-a");
        let b = format!("{name}-b");
        // Left over from a killed run.
        for n in [&a, &b] {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
        }
        let pair = NetnsPair {
            addr_a: format!("10.{subnet}.0.1"),
            addr_b: format!("10.{subnet}.0.2"),
            a,
            b,
        };
        sh("ip", &["netns", "add", &pair.a]);
        sh("ip", &["netns", "add", &pair.b]);
        let (va, vb) = (format!("xv{subnet}a"), format!("xv{subnet}b"));
        sh(
            "ip",
            &[
                "-n", &pair.a, "link", "add", &va, "type", "veth", "peer", "name", &vb, "netns",
                &pair.b,
            ],
        );
        for (ns, dev, addr) in [(&pair.a, &va, &pair.addr_a), (&pair.b, &vb, &pair.addr_b)] {
            sh(
                "ip",
                &["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev],
            );
            sh("ip", &["-n", ns, "link", "set", dev, "up"]);
            sh("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        pair
    }

    /// Turns conntrack on in namespace `ns`: any conntrack match does.
    pub fn conntrack_on(ns: &str) {
        Self::exec(
            ns,
            "iptables-legacy",
            &[
                "-w",
                "-A",
                "INPUT",
                "-m",
                "conntrack",
                "--ctstate",
                "INVALID",
                "-j",
                "DROP",
            ],
        );
    }

    /// `/run/netns/<ns>`.
    pub fn path(ns: &str) -> String {
        format!("/run/netns/{ns}")
    }

    /// The namespace's inode: the `netns` number xtlock reports.
    pub fn inode(ns: &str) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(Self::path(ns)).expect("netns file").ino()
    }

    /// Runs `prog args` inside `ns`.
    pub fn exec(ns: &str, prog: &str, args: &[&str]) -> String {
        let mut a = vec!["netns", "exec", ns, prog];
        a.extend_from_slice(args);
        sh("ip", &a)
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        for n in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// A sysctl set for a test and restored on drop, also when the test fails.
pub struct Sysctl {
    path: PathBuf,
    old: String,
}

impl Sysctl {
    pub fn set(path: &str, value: &str) -> Self {
        let path = PathBuf::from(path);
        let old = fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .trim()
            .to_string();
        fs::write(&path, value).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Sysctl { path, old }
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        if let Err(e) = fs::write(&self.path, &self.old) {
            eprintln!(
                "could not restore {} to {}: {e}",
                self.path.display(),
                self.old
            );
        }
    }
}

/// Sum of one counter of `conntrack -S` (per CPU lines `cpu=N found=.. drop=..`).
pub fn conntrack_stat(ns: &str, counter: &str) -> u64 {
    let out = NetnsPair::exec(ns, "conntrack", &["-S"]);
    let key = format!("{counter}=");
    out.split_whitespace()
        .filter_map(|w| w.strip_prefix(&key))
        .filter_map(|v| v.parse::<u64>().ok())
        .sum()
}

/// Packet counter of the first rule of `chain` in `ns` whose line contains `needle`.
pub fn iptables_packets(ns: &str, chain: &str, needle: &str) -> u64 {
    let out = NetnsPair::exec(ns, "iptables-legacy", &["-L", chain, "-v", "-n", "-x"]);
    out.lines()
        .find(|l| l.contains(needle))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no rule with `{needle}` in {chain}:\n{out}"))
}

/// Sends `count` UDP datagrams from namespace `from` to `to:port` over `flows` sockets (each
/// its own source port); returns how many were sent.
pub fn send_udp(s: &Scratch, from: &str, to: &str, port: u16, count: u64, flows: u64) -> u64 {
    let helper = s.agent("udp-sender");
    let helper = helper.to_str().unwrap();
    let (port, count, flows) = (port.to_string(), count.to_string(), flows.to_string());
    let mut a = Agent::spawn(
        Path::new("ip"),
        &[
            "netns", "exec", from, helper, "udp", to, &port, &count, &flows,
        ],
        &[],
        None,
    );
    let sent = a.expect("sent", Duration::from_secs(30));
    assert_eq!(a.wait(), 0, "udp sender failed: {:?}", a.seen);
    sent[0].parse().unwrap()
}

/// `CLOCK_MONOTONIC` now, in ns: the clock of xtlock's events and of the helper's lines.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A save's tables as `xtlock rules` prints them: the `# ...` lines and counters dropped.
pub fn saved_form(save: &str) -> Vec<String> {
    save.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| match l.strip_prefix(':') {
            Some(c) => {
                let mut w = c.split_whitespace();
                format!(
                    ":{} {}",
                    w.next().unwrap_or_default(),
                    w.next().unwrap_or_default()
                )
            }
            None => l.to_string(),
        })
        .collect()
}

/// `xtlock rules`' text `ours` equals the save `save` line for line (as [`saved_form`]); the
/// number of rules compared. `what` names the pair in the failure.
pub fn assert_rules_as_saved(what: &str, save: &str, ours: &str) -> usize {
    let (want, got) = (saved_form(save), saved_form(ours));
    let rules = want.iter().filter(|l| l.starts_with("-A ")).count();
    let equal = want.iter().zip(&got).filter(|(w, g)| w == g).count();
    eprintln!("{what}: {rules} rules, {} lines, {equal} equal", want.len());
    let wrong: Vec<String> = want
        .iter()
        .zip(&got)
        .filter(|(w, g)| w != g)
        .map(|(w, g)| format!("  save:   {w}\n  xtlock: {g}"))
        .collect();
    assert!(
        wrong.is_empty() && want.len() == got.len(),
        "{what}: {} lines differ ({} vs {} lines):\n{}",
        wrong.len(),
        want.len(),
        got.len(),
        wrong.join("\n")
    );
    rules
}

/// `agent` (a program of that name, [`Scratch::agent`]) runs `sh -c script` in network
/// namespace `ns` with `XTABLES_LOCKFILE=lock`, and must exit 0 within `timeout`; then 400 ms
/// pass, for xtlock's read of the table it wrote.
pub fn agent_step(
    s: &Scratch,
    agent: &str,
    ns: &str,
    lock: &Path,
    script: &str,
    timeout: Duration,
) {
    let mut a = Agent::spawn(
        Path::new("ip"),
        &[
            "netns",
            "exec",
            ns,
            s.agent(agent).to_str().unwrap(),
            "run",
            "sh",
            "-c",
            script,
        ],
        &[("XTABLES_LOCKFILE", lock.to_str().unwrap())],
        None,
    );
    assert_eq!(a.wait_within(timeout), 0, "{agent}: {script}");
    thread::sleep(Duration::from_millis(400));
}

/// `xtlock trace --json` on `lock`, recording to `capture`, with `extra` arguments (and
/// `XTLOCK_TEST_TRACER_ARGS`): stopped by the test (`Tracer::interrupt`) once its story is
/// told, or after 300 s (under TCG a story takes far longer than here).
pub fn trace_recording(lock: &Path, capture: &Path, extra: &[&str]) -> Tracer {
    let mut c = Command::new(xtlock_bin());
    c.args(["trace", "--json", "--duration", "300s"])
        .args(extra)
        .arg("--lock-file")
        .arg(lock)
        .arg("--record")
        .arg(capture)
        .args(tracer_extra_args());
    Tracer::spawn(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ruleset_shape() {
        let r = kube_proxy_ruleset(3, 2);
        assert_eq!(r.matches("COMMIT").count(), 2);
        assert_eq!(r.matches(":KUBE-SVC-").count(), 3);
        assert_eq!(r.matches(":KUBE-SEP-").count(), 6);
        assert!(r.contains("--probability 0.50000"));
    }

    #[test]
    fn pct() {
        assert!(within_pct(105, 100, 5.0));
        assert!(!within_pct(106, 100, 5.0));
        assert!(within_pct(95, 100, 5.0));
    }
}
