//! Real agents against an independent count, each while a kube-proxy-style
//! `iptables-restore` loop takes the same lock:
//! * a real `dockerd` (Debian's docker.io, legacy iptables first on its PATH), in a network
//!   namespace of its own, creates and removes bridge networks (each a few dozen `iptables`
//!   runs, which never unlock: the kernel releases their lock when it closes their files);
//! * a real `firewalld` (Debian's, iptables backend, on a system bus of its own) reloads.
//!
//! bpftrace on the lock tracepoint, filtered by the lock's device and inode, counts the
//! holds and their time; xtlock must agree exactly on the count and within 1 % on the time,
//! and no wait, failed try or contention row may lack its holder. Every rule goes into
//! private network namespaces and the locks are private files: the host's firewall is
//! untouched.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::Value;
use xtlock_tests::{
    kube_proxy_ruleset, require_bpf, serial, write_file, Agent, Bpftrace, Scratch, Tracer,
};

/// Under CI a missing agent is a failure; elsewhere the test says so and passes.
fn require_tool(test: &str, tool: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("CI").is_err(),
            "{test}: {tool} is not installed (./xtask/run setup installs it)"
        );
        eprintln!("skipped {test}: {tool} is not installed");
    }
    found
}

/// A real dockerd in its own network namespace, data root and socket, with legacy
/// iptables first on its PATH and `XTABLES_LOCKFILE` set to the test's lock.
struct Dockerd {
    child: Child,
    netns: String,
    sock: PathBuf,
}

impl Dockerd {
    fn start(s: &Scratch, lock: &Path) -> Self {
        let netns = format!("xtd-dock-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &netns]).status();
        let ok = Command::new("ip").args(["netns", "add", &netns]).status();
        assert!(ok.is_ok_and(|s| s.success()), "ip netns add");
        let _ = Command::new("ip")
            .args(["netns", "exec", &netns, "ip", "link", "set", "lo", "up"])
            .status();
        // iptables -> iptables-legacy, first on dockerd's PATH.
        let legacy = s.dir.join("legacy-bin");
        std::fs::create_dir_all(&legacy).expect("legacy dir");
        for (name, target) in [
            ("iptables", "iptables-legacy"),
            ("iptables-save", "iptables-legacy-save"),
            ("iptables-restore", "iptables-legacy-restore"),
            ("ip6tables", "ip6tables-legacy"),
            ("ip6tables-save", "ip6tables-legacy-save"),
            ("ip6tables-restore", "ip6tables-legacy-restore"),
        ] {
            let _ =
                std::os::unix::fs::symlink(Path::new("/usr/sbin").join(target), legacy.join(name));
        }
        let root = s.dir.join("docker");
        std::fs::create_dir_all(&root).expect("docker dir");
        let config = write_file(&root, "daemon.json", "{}\n");
        let sock = root.join("docker.sock");
        let path = format!(
            "{}:{}",
            legacy.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let log = std::fs::File::create(root.join("dockerd.log")).expect("dockerd log");
        // nsenter, not `ip netns exec`: that one mounts a fresh /sys, hiding the cgroup
        // hierarchies dockerd needs.
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .arg("dockerd")
            .arg("--config-file")
            .arg(&config)
            .arg("--data-root")
            .arg(root.join("data"))
            .arg("--exec-root")
            .arg(root.join("exec"))
            .arg("--pidfile")
            .arg(root.join("dockerd.pid"))
            .arg("-H")
            .arg(format!("unix://{}", sock.display()))
            .args([
                "--storage-driver",
                "vfs",
                "--iptables=true",
                "--ip6tables=false",
            ])
            .env("PATH", path)
            .env("XTABLES_LOCKFILE", lock)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn dockerd");
        let d = Self { child, netns, sock };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !d.docker(&["version"]).0 {
            assert!(
                Instant::now() < deadline,
                "dockerd did not answer within 60 s; see {}",
                root.join("dockerd.log").display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        d
    }

    fn docker(&self, args: &[&str]) -> (bool, String) {
        let o = Command::new("docker")
            .arg("-H")
            .arg(format!("unix://{}", self.sock.display()))
            .args(args)
            .output();
        match o {
            Ok(o) => (
                o.status.success(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            ),
            Err(e) => (false, e.to_string()),
        }
    }

    fn stop(mut self) {
        // SAFETY: plain syscall; nsenter execs dockerd itself.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
    }
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Every wait, failed try and contention row names a holder.
fn assert_every_wait_has_its_holder(trace: &xtlock_tests::Trace, dump: &str) {
    for w in trace.of_type("wait") {
        let holders = w["holders"].as_array().map_or(0, Vec::len);
        assert!(holders > 0, "a wait without its holder: {w}\n{dump}");
        assert!(
            w["holders"].as_array().is_some_and(|h| h
                .iter()
                .all(|h| h["agent"] != "(unknown)" && h["agent"] != "")),
            "{w}"
        );
    }
    for f in trace.of_type("failed_try") {
        assert!(
            f["holder"].is_object(),
            "a failed try without its holder: {f}\n{dump}"
        );
    }
    for c in trace.summary()["contention"]
        .as_array()
        .into_iter()
        .flatten()
    {
        assert_ne!(c["holder"], "(unknown)", "{c}\n{dump}");
    }
}

/// kube-proxy: `iptables-legacy-restore` runs of a 50-service ruleset (`*filter` and `*nat`,
/// a hold each) in private network namespaces on `lock`, `pause` apart, until `done` is set
/// and at least `min_runs` ran. Returns the number of runs.
fn restore_loop(
    s: &Scratch,
    lock: &str,
    min_runs: u64,
    pause: Duration,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    let rules = write_file(&s.dir, "rules", &kube_proxy_ruleset(50, 2));
    let kp_bin = s.agent("kube-proxy");
    let lock = lock.to_owned();
    std::thread::spawn(move || {
        let mut runs = 0u64;
        while !done.load(Ordering::Relaxed) || runs < min_runs {
            let mut kp = Agent::spawn(
                &kp_bin,
                &[
                    "run",
                    "--netns",
                    "iptables-legacy-restore",
                    "-w",
                    "5",
                    "-W",
                    "100000",
                    "--noflush",
                ],
                &[("XTABLES_LOCKFILE", lock.as_str())],
                Some(&rules),
            );
            assert_eq!(kp.wait(), 0, "iptables-legacy-restore failed");
            runs += 1;
            std::thread::sleep(pause);
        }
        runs
    })
}

/// xtlock's exclusive holds of `lock` against bpftrace's count `(holds, ended, total ns)`:
/// the same number, the total time within 1 %, none incomplete, and every wait, failed try
/// and contention row with its holder. Returns the holds per agent of `agents`, in order.
fn matches_bpftrace(
    trace: &xtlock_tests::Trace,
    lock: &str,
    (b_holds, b_ended, b_total): (u64, u64, u64),
    agents: &[&str],
) -> Vec<usize> {
    let dump = trace.dump();
    let holds: Vec<&Value> = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["lock"] == lock && h["exclusive"] == true)
        .collect();
    let total: u64 = holds.iter().map(|h| u(&h["hold_ns"])).sum();
    let by: Vec<usize> = agents
        .iter()
        .map(|a| holds.iter().filter(|h| h["agent"] == *a).count())
        .collect();
    eprintln!(
        "holds: xtlock {} ({agents:?}: {by:?}), bpftrace {b_holds} ({b_ended} ended); hold \
         time: xtlock {total} ns, bpftrace {b_total} ns; {} waits, {} failed tries",
        holds.len(),
        trace.of_type("wait").len(),
        trace.of_type("failed_try").len(),
    );
    assert_eq!(b_holds, b_ended, "bpftrace saw every hold end");
    assert_eq!(
        holds.len() as u64,
        b_holds,
        "hold count vs bpftrace\n{dump}"
    );
    let diff = total.abs_diff(b_total) as f64 / b_total.max(1) as f64;
    assert!(
        diff <= 0.01,
        "total hold time {total} ns vs bpftrace {b_total} ns ({:.2} %)\n{dump}",
        diff * 100.0
    );
    assert!(holds.iter().all(|h| h["incomplete"] == false), "{dump}");
    assert_every_wait_has_its_holder(trace, &dump);
    by
}

#[test]
fn dockerd_networks_and_a_restore_loop_match_bpftrace() {
    if !require_bpf("dockerd_networks_and_a_restore_loop_match_bpftrace")
        || !require_tool("dockerd_networks", "dockerd")
        || !require_tool("dockerd_networks", "bpftrace")
    {
        return;
    }
    let _g = serial();
    let s = Scratch::new("dockerd");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap().to_owned();
    let bpf = Bpftrace::start(&lock);
    let tracer = Tracer::start(&[&lock], Duration::from_secs(300), &["--no-drops"]);
    let dockerd = Dockerd::start(&s, &lock);

    // kube-proxy: 12 restores, 150 ms apart, taking the same lock.
    let loop_thread = restore_loop(
        &s,
        &lock_s,
        12,
        Duration::from_millis(150),
        Arc::new(AtomicBool::new(true)),
    );
    for i in 0..5 {
        let name = format!("xtn{i}");
        let (ok, err) = dockerd.docker(&["network", "create", "--driver", "bridge", &name]);
        assert!(ok, "docker network create: {err}");
        let (ok, err) = dockerd.docker(&["network", "rm", &name]);
        assert!(ok, "docker network rm: {err}");
    }
    loop_thread.join().expect("restore loop");
    // dockerd's real tables, a bridge network of its own in them, read as
    // iptables-legacy-save prints them, line for line.
    let (ok, err) = dockerd.docker(&["network", "create", "--driver", "bridge", "xtkeep"]);
    assert!(ok, "docker network create: {err}");
    let in_ns = |prog: &str, args: &[&str]| -> String {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", dockerd.netns))
            .arg(prog)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{prog}: {e}"));
        assert!(out.status.success(), "{prog}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let compared = xtlock_tests::assert_rules_as_saved(
        "dockerd's tables",
        &in_ns("iptables-legacy-save", &[]),
        &in_ns(xtlock_tests::xtlock_bin().to_str().unwrap(), &["rules"]),
    );
    assert!(compared >= 10, "dockerd's rules: {compared}");
    dockerd.stop();
    std::thread::sleep(Duration::from_millis(500));
    tracer.interrupt();
    let trace = tracer.finish();
    let by = matches_bpftrace(&trace, &lock_s, bpf.finish(), &["dockerd", "kube-proxy"]);
    let dump = trace.dump();
    assert!(by[0] >= 10, "dockerd's iptables runs\n{dump}");
    assert!(by[1] >= 12, "the restore loop\n{dump}");
}

/// The process (and what it execs) is killed when the test's thread ends, also when the
/// test is interrupted: no daemon or namespace outlives it.
fn dies_with_test(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; runs in the child before exec.
    unsafe {
        c.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// PATH for the daemons: the test may run without the sbin directories.
fn daemon_path() -> String {
    format!(
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:{}",
        std::env::var("PATH").unwrap_or_default()
    )
}

/// firewalld's sandbox: a private network and mount namespace, kept alive by a `sleep`
/// inside; processes join it with `nsenter`. firewalld runs iptables with an empty
/// environment from fixed paths, so neither `XTABLES_LOCKFILE` nor PATH reaches it: /run
/// is a tmpfs (its /run/xtables.lock is the sandbox's own), `/etc/alternatives` a copy
/// whose iptables links point at the legacy binaries, /etc/firewalld a copy set to the
/// iptables backend.
struct Sandbox {
    child: Child,
}

impl Sandbox {
    fn new(s: &Scratch, firewalld_etc: &Path) -> Self {
        let alt = s.dir.join("alternatives");
        run_ok(
            Command::new("cp")
                .args(["-a", "/etc/alternatives"])
                .arg(&alt),
            "copy /etc/alternatives",
        );
        for name in [
            "iptables",
            "iptables-restore",
            "iptables-save",
            "ip6tables",
            "ip6tables-restore",
            "ip6tables-save",
        ] {
            let link = alt.join(name);
            let _ = std::fs::remove_file(&link);
            let target = name.replacen("tables", "tables-legacy", 1);
            std::os::unix::fs::symlink(Path::new("/usr/sbin").join(target), &link)
                .expect("alternative link");
        }
        let script = format!(
            "set -e\n\
             mount -t tmpfs -o mode=0755 tmpfs /run\n\
             mkdir -p /run/dbus\n\
             mount --bind '{}' /etc/alternatives\n\
             mount --bind '{}' /etc/firewalld\n\
             : > /run/xtables.lock\n\
             ip link set lo up\n\
             echo ready\n\
             exec sleep infinity\n",
            alt.display(),
            firewalld_etc.display()
        );
        let mut child = dies_with_test(&mut Command::new("unshare"))
            .args(["--mount", "--net", "--propagation", "private", "sh", "-c"])
            .arg(&script)
            .env("PATH", daemon_path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn unshare");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read sandbox");
        assert_eq!(line.trim(), "ready", "the sandbox did not come up");
        Self { child }
    }

    /// `prog` inside the sandbox (nsenter execs it: same pid, same parent).
    fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new("nsenter");
        dies_with_test(&mut c);
        c.arg("-t")
            .arg(self.child.id().to_string())
            .args(["-m", "-n", "--", prog])
            .env("PATH", daemon_path());
        c
    }

    /// The sandbox's /run/xtables.lock, as the host reaches it.
    fn lock(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root/run/xtables.lock", self.child.id()))
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // The namespaces go with their last process; the daemons were stopped before.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends SIGTERM, waits up to `grace`, then kills.
fn stop(child: &mut Child, grace: Duration) {
    // SAFETY: plain syscall on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("pid {} ignored SIGTERM for {grace:?}: killed", child.id());
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `cmd`, panics with its output when it fails.
fn run_ok(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A system bus of the sandbox's own, at the usual path inside it.
const BUS_CONF: &str = r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path=/run/dbus/system_bus_socket</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow receive_sender="*"/>
    <allow eavesdrop="true"/>
  </policy>
</busconfig>
"#;

/// A real firewalld on the iptables backend in a [`Sandbox`], on a bus of its own; `watch`
/// gets the sandbox's lock before firewalld starts (to start the tracers on it).
struct Firewalld {
    sandbox: Sandbox,
    bus: Child,
    daemon: Child,
    lock: PathBuf,
}

impl Firewalld {
    fn start(s: &Scratch, watch: impl FnOnce(&Path)) -> Self {
        // firewalld's own configuration, on the iptables backend.
        let etc = s.dir.join("etc-firewalld");
        run_ok(
            Command::new("cp").args(["-a", "/etc/firewalld"]).arg(&etc),
            "copy /etc/firewalld",
        );
        let conf = etc.join("firewalld.conf");
        let text = std::fs::read_to_string(&conf).expect("firewalld.conf");
        let text: String = text
            .lines()
            .filter(|l| !l.starts_with("FirewallBackend="))
            .map(|l| format!("{l}\n"))
            .chain(std::iter::once("FirewallBackend=iptables\n".to_owned()))
            .collect();
        std::fs::write(&conf, text).expect("write firewalld.conf");
        let bus_conf = write_file(&s.dir, "bus.conf", BUS_CONF);

        let sandbox = Sandbox::new(s, &etc);
        let lock = sandbox.lock();
        watch(&lock);
        let bus = sandbox
            .cmd("dbus-daemon")
            .arg(format!("--config-file={}", bus_conf.display()))
            .args(["--nofork", "--nopidfile"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn dbus-daemon");
        let log = s.dir.join("firewalld.log");
        let daemon = sandbox
            .cmd("firewalld")
            .args(["--nofork", "--nopid"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("firewalld log"))
            .spawn()
            .expect("spawn firewalld");
        let mut fwd = Self {
            sandbox,
            bus,
            daemon,
            lock,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !fwd
            .firewall_cmd(&["--state"])
            .output()
            .is_ok_and(|o| o.status.success())
        {
            assert!(
                Instant::now() < deadline && fwd.daemon.try_wait().ok().flatten().is_none(),
                "firewalld did not come up within 60 s:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        fwd
    }

    fn firewall_cmd(&self, args: &[&str]) -> Command {
        let mut c = self.sandbox.cmd("firewall-cmd");
        c.args(args);
        c
    }

    /// firewalld cleans up on exit: its last iptables runs happen here.
    fn stop(mut self) {
        stop(&mut self.daemon, Duration::from_secs(30));
        stop(&mut self.bus, Duration::from_secs(5));
    }
}

const FIREWALLD_TOOLS: [&str; 5] = [
    "firewalld",
    "firewall-cmd",
    "dbus-daemon",
    "bpftrace",
    "nsenter",
];

#[test]
fn firewalld_reloads_and_a_restore_loop_match_bpftrace() {
    const TEST: &str = "firewalld_reloads_and_a_restore_loop_match_bpftrace";
    if !require_bpf(TEST) || !FIREWALLD_TOOLS.iter().all(|t| require_tool(TEST, t)) {
        return;
    }
    let _g = serial();
    let s = Scratch::new("firewalld");
    let mut watchers = None;
    let fwd = Firewalld::start(&s, |lock| {
        watchers = Some((
            Bpftrace::start(lock),
            Tracer::start(&[lock], Duration::from_secs(300), &["--no-drops"]),
        ))
    });
    let (bpf, tracer) = watchers.expect("watchers started");
    let lock_s = fwd.lock.to_str().unwrap().to_owned();

    // kube-proxy: restores back to back on the sandbox's lock until firewalld is done.
    let done = Arc::new(AtomicBool::new(false));
    let loop_thread = restore_loop(&s, &lock_s, 5, Duration::from_millis(5), done.clone());
    for _ in 0..3 {
        run_ok(
            &mut fwd.firewall_cmd(&["--reload"]),
            "firewall-cmd --reload",
        );
    }
    done.store(true, Ordering::Relaxed);
    let kp_runs = loop_thread.join().expect("restore loop");
    // It cleans up on exit: its last iptables runs are traced too.
    fwd.stop();
    std::thread::sleep(Duration::from_millis(500));
    tracer.interrupt();
    let trace = tracer.finish();
    let by = matches_bpftrace(&trace, &lock_s, bpf.finish(), &["firewalld", "kube-proxy"]);
    let dump = trace.dump();
    eprintln!("{kp_runs} restores");
    // Start, three reloads and the clean-up, each several iptables-restore runs.
    assert!(by[0] >= 4 * 2, "firewalld's iptables runs\n{dump}");
    assert_eq!(
        by[1] as u64,
        2 * kp_runs,
        "a hold per table (*filter, *nat) per restore\n{dump}"
    );
    // Of the lock file: firewalld's ebtables-nft batches are holds of the nf_tables commit
    // lock too (timed from their sendmsg() where nft_commit does not attach).
    assert_eq!(
        by[0] + by[1],
        trace
            .of_type("hold")
            .iter()
            .filter(|h| h["lock"] == lock_s.as_str())
            .count(),
        "every hold is firewalld's or kube-proxy's\n{dump}"
    );
    // The restores run back to back through the reloads: 5 to 13 waits per run here.
    assert!(
        !trace.of_type("wait").is_empty(),
        "no wait at all: the test proved nothing about waits\n{dump}"
    );
}

/// Chains (`table chain`) and rules (`table -A chain ...`) of an `iptables-save` text.
fn saved(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut chains, mut rules) = (BTreeSet::new(), BTreeSet::new());
    let mut table = "";
    for l in text.lines() {
        if let Some(t) = l.strip_prefix('*') {
            table = t;
        } else if let Some(c) = l.strip_prefix(':') {
            chains.insert(format!("{table} {}", c.split(' ').next().unwrap_or("")));
        } else if l.starts_with("-A ") {
            rules.insert(format!("{table} {l}"));
        }
    }
    (chains, rules)
}

/// kube-proxy's by its conventions: a KUBE-* chain, a rule in one or jumping to one.
fn kube_proxys(item: &str) -> bool {
    let mut w = item.split(' ').skip(1);
    match w.next() {
        Some("-A") => {
            w.next().is_some_and(|c| c.starts_with("KUBE-")) || item.contains(" -j KUBE-")
        }
        Some(c) => c.starts_with("KUBE-"),
        None => false,
    }
}

/// The real firewalld's `--reload` (iptables backend) deletes kube-proxy's chains
/// (moby#35043, firewalld#503, rke2#10469 are this with other victims): xtlock names
/// firewalld as the writer and kube-proxy as the owner, with exactly the chains and rules
/// `iptables-legacy-save` before and after shows gone, and says how long each was gone
/// when kube-proxy's next restore puts them back.
#[test]
fn firewalld_reload_removes_kube_proxys_chains() {
    const TEST: &str = "firewalld_reload_removes_kube_proxys_chains";
    if !require_bpf(TEST) || !FIREWALLD_TOOLS.iter().all(|t| require_tool(TEST, t)) {
        return;
    }
    let _g = serial();
    let s = Scratch::new("firewalld-clobber");
    let mut tracer = None;
    let fwd = Firewalld::start(&s, |lock| {
        tracer = Some(Tracer::start(
            &[lock],
            Duration::from_secs(300),
            &["--no-drops"],
        ))
    });
    let tracer = tracer.expect("tracer started");
    let lock_s = fwd.lock.to_str().unwrap().to_owned();
    let sandbox_netns = {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(format!("/proc/{}/ns/net", fwd.sandbox.child.id()))
            .expect("sandbox netns")
            .ino()
    };
    let save = || -> String {
        let out = fwd
            .sandbox
            .cmd("iptables-legacy-save")
            .output()
            .expect("iptables-legacy-save");
        assert!(out.status.success(), "iptables-legacy-save: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // kube-proxy (50 services, 2 endpoints each, filter and nat) in firewalld's namespace.
    let rules = write_file(&s.dir, "rules", &kube_proxy_ruleset(50, 2));
    let kube_proxy_restore = || {
        let mut kp = Agent::spawn(
            Path::new("nsenter"),
            &[
                "-t",
                &fwd.sandbox.child.id().to_string(),
                "-n",
                "--",
                s.agent("kube-proxy").to_str().unwrap(),
                "run",
                "iptables-legacy-restore",
                "-w",
                "5",
                "--noflush",
            ],
            &[("XTABLES_LOCKFILE", lock_s.as_str())],
            Some(&rules),
        );
        assert_eq!(
            kp.wait_within(Duration::from_secs(30)),
            0,
            "kube-proxy's restore"
        );
        // Its tables are read back after the write.
        std::thread::sleep(Duration::from_millis(500));
    };
    kube_proxy_restore();
    let before = saved(&save());
    let reload_at = Instant::now();
    run_ok(
        &mut fwd.firewall_cmd(&["--reload"]),
        "firewall-cmd --reload",
    );
    std::thread::sleep(Duration::from_millis(800));
    let after = saved(&save());
    let gone_for = reload_at.elapsed();
    kube_proxy_restore();
    let back = saved(&save());
    // firewalld's real tables (and kube-proxy's back in them) read as iptables-legacy-save
    // prints them, line for line.
    let ours = fwd
        .sandbox
        .cmd(xtlock_tests::xtlock_bin().to_str().unwrap())
        .arg("rules")
        .output()
        .expect("xtlock rules");
    assert!(ours.status.success(), "xtlock rules: {ours:?}");
    let compared = xtlock_tests::assert_rules_as_saved(
        "firewalld's tables",
        &save(),
        &String::from_utf8_lossy(&ours.stdout),
    );
    assert!(
        compared > 300,
        "firewalld's and kube-proxy's rules: {compared}"
    );
    // Before firewalld stops: its clean-up on exit removes kube-proxy's chains once more.
    tracer.interrupt();
    let trace = tracer.finish();
    fwd.stop();
    let dump = trace.dump();

    // The truth: what of kube-proxy's the reload removed.
    let chains_gone: BTreeSet<String> = before
        .0
        .difference(&after.0)
        .filter(|c| kube_proxys(c))
        .cloned()
        .collect();
    let rules_gone = before
        .1
        .difference(&after.1)
        .filter(|r| kube_proxys(r))
        .count() as u64;
    assert!(
        chains_gone.len() > 100 && rules_gone > 300,
        "the reload removed too little to prove anything: {} chains, {rules_gone} rules",
        chains_gone.len()
    );
    assert!(back.0.is_superset(&chains_gone), "kube-proxy put them back");
    eprintln!(
        "the reload removed {} chains and {rules_gone} rules of kube-proxy's",
        chains_gone.len()
    );

    // xtlock: firewalld's writes, kube-proxy's chains and rules, per table, in the sandbox's
    // network namespace (xtlock sees every namespace's writes).
    let changes: Vec<&Value> = trace
        .of_type("rule_change")
        .into_iter()
        .filter(|c| c["netns"].as_u64() == Some(sandbox_netns))
        .collect();
    assert!(
        changes.iter().all(|c| c["ambiguous"] == false),
        "the steps were apart: no read may mix two writers\n{dump}"
    );
    let mut said_chains = BTreeSet::new();
    let mut said_rules = 0;
    for c in changes.iter().filter(|c| c["agent"] == "firewalld") {
        for f in c["foreign"].as_array().into_iter().flatten() {
            if f["owner"] != "kube-proxy" {
                continue;
            }
            for n in f["chains_deleted"].as_array().into_iter().flatten() {
                let n = format!("{} {}", c["table"].as_str().unwrap(), n.as_str().unwrap());
                assert!(said_chains.insert(n.clone()), "{n} deleted twice\n{dump}");
            }
            said_rules += f["rules_removed"].as_u64().unwrap();
        }
    }
    assert_eq!(
        said_chains, chains_gone,
        "chains deleted vs iptables-legacy-save\n{dump}"
    );
    assert_eq!(
        said_rules, rules_gone,
        "rules removed vs iptables-legacy-save\n{dump}"
    );
    // Nobody else is said to have changed kube-proxy's rules.
    for c in &changes {
        for f in c["foreign"].as_array().into_iter().flatten() {
            if f["owner"] == "kube-proxy" {
                assert_eq!(c["agent"], "firewalld", "{c}");
            }
        }
    }
    // kube-proxy's next restore put every chain back: said once each, gone about as long
    // as the test saw it gone (the reads come within a second of each write).
    let (mut back_said, mut said) = (BTreeSet::new(), 0);
    for (c, r) in changes
        .iter()
        .filter(|c| c["agent"] == "kube-proxy")
        .flat_map(|c| {
            c["restored"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |r| (c, r))
        })
    {
        assert_eq!(r["removed_by"], "firewalld", "{r}");
        let gone = Duration::from_nanos(r["gone_ns"].as_u64().unwrap());
        assert!(
            gone >= gone_for.saturating_sub(Duration::from_millis(1500))
                && gone <= gone_for + Duration::from_secs(3),
            "{r}: the test saw them gone for {gone_for:?}"
        );
        back_said.insert(format!(
            "{} {}",
            c["table"].as_str().unwrap(),
            r["chain"].as_str().unwrap()
        ));
        said += 1;
    }
    assert_eq!(said, back_said.len(), "a chain put back said twice\n{dump}");
    assert_eq!(back_said, chains_gone, "chains put back\n{dump}");
    // The summary's ranking of foreign changes names the pair.
    trace.assert_foreign_change("firewalld", "kube-proxy");
}
