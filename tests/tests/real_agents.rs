//! Real agents against an independent count. A real `dockerd` (Debian's docker.io, legacy
//! iptables first on its PATH), in a network namespace of its own, creates and removes
//! bridge networks (each a few dozen `iptables` runs, which never unlock: the kernel
//! releases their lock when it closes their files) while a kube-proxy-style
//! `iptables-restore` loop takes the same lock. bpftrace on the lock tracepoint, filtered by
//! the lock's inode, counts the holds and their time; xtlock must agree exactly on the count
//! and within 1 % on the time, and no wait, failed try or contention row may lack its
//! holder. The lock is a private file (`XTABLES_LOCKFILE`), every rule goes into private
//! network namespaces: the host's firewall is untouched.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
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
    let ino = std::fs::metadata(&lock).expect("lock").ino();
    let rules = write_file(&s.dir, "rules", &kube_proxy_ruleset(50, 2));
    let bpf = Bpftrace::start(ino);
    let tracer = Tracer::start(&[&lock], Duration::from_secs(300), &["--no-drops"]);
    let dockerd = Dockerd::start(&s, &lock);

    // kube-proxy: restores in private network namespaces, taking the same lock.
    let kp_bin = s.agent("kube-proxy");
    let kp_lock = lock_s.clone();
    let loop_thread = std::thread::spawn(move || {
        for _ in 0..12 {
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
                &[("XTABLES_LOCKFILE", kp_lock.as_str())],
                Some(&rules),
            );
            assert_eq!(kp.wait(), 0, "iptables-legacy-restore failed");
            std::thread::sleep(Duration::from_millis(150));
        }
    });
    for i in 0..5 {
        let name = format!("xtn{i}");
        let (ok, err) = dockerd.docker(&["network", "create", "--driver", "bridge", &name]);
        assert!(ok, "docker network create: {err}");
        let (ok, err) = dockerd.docker(&["network", "rm", &name]);
        assert!(ok, "docker network rm: {err}");
    }
    loop_thread.join().expect("restore loop");
    dockerd.stop();
    std::thread::sleep(Duration::from_millis(500));
    tracer.interrupt();
    let trace = tracer.finish();
    let (b_holds, b_ended, b_total) = bpf.finish();
    let dump = trace.dump();

    let holds: Vec<&Value> = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["lock"] == lock_s.as_str() && h["exclusive"] == true)
        .collect();
    let total: u64 = holds.iter().map(|h| u(&h["hold_ns"])).sum();
    let by_agent = |a: &str| holds.iter().filter(|h| h["agent"] == a).count();
    eprintln!(
        "holds: xtlock {} ({} dockerd, {} kube-proxy), bpftrace {b_holds} ({b_ended} ended); \
         hold time: xtlock {total} ns, bpftrace {b_total} ns; {} waits, {} failed tries",
        holds.len(),
        by_agent("dockerd"),
        by_agent("kube-proxy"),
        trace.of_type("wait").len(),
        trace.of_type("failed_try").len(),
    );
    assert_eq!(b_holds, b_ended, "bpftrace saw every hold end");
    assert_eq!(
        holds.len() as u64,
        b_holds,
        "hold count vs bpftrace\n{dump}"
    );
    assert!(by_agent("dockerd") >= 10, "dockerd's iptables runs\n{dump}");
    assert!(by_agent("kube-proxy") >= 12, "the restore loop\n{dump}");
    let diff = total.abs_diff(b_total) as f64 / b_total.max(1) as f64;
    assert!(
        diff <= 0.01,
        "total hold time {total} ns vs bpftrace {b_total} ns ({:.2} %)\n{dump}",
        diff * 100.0
    );
    assert!(holds.iter().all(|h| h["incomplete"] == false), "{dump}");
    assert_every_wait_has_its_holder(&trace, &dump);
}
