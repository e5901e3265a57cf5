//! Node containers under a real container runtime (podman with runc), as kind and k3d run
//! Kubernetes nodes: each with a mount namespace and a `/run` of its own (so its own
//! `/run/xtables.lock`), a network namespace of its own and a host name. Nothing can be pulled
//! here, so each container's root is the host's, as an overlay (`--rootfs /:O`): the real
//! iptables binaries, its writes kept in the container. `xtlock trace` runs on the host,
//! watching only its own lock file. Truth: each holder's own clocks around its flock() and
//! close(), and `iptables-legacy-save` inside the node.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use xtlock_tests::{in_ci, require_bpf, serial, Scratch, Tracer};

fn u(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not an unsigned number: {v}"))
}

/// podman is there (`./xtask/run test` installs it); under CI its absence is a failure.
fn require_podman(test: &str) -> bool {
    let ok = Command::new("podman")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = format!("{test}: needs podman (apt-get install podman runc)");
        assert!(!in_ci(), "{why}; CI=true, so this is a failure");
        eprintln!("skipped: {why}");
    }
    ok
}

/// A running container, removed on drop.
struct Container(String);

impl Container {
    /// `network`: `none` (a namespace of its own) or `container:NAME` (another's).
    fn start(name: &str, hostname: &str, network: &str, shared: &Path) -> Container {
        let _ = Command::new("podman")
            .args(["rm", "-f", "-t", "0", name])
            .stderr(Stdio::null())
            .output();
        let limit = |r| {
            let mut l = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: valid out-pointer.
            unsafe { libc::getrlimit(r, &mut l) };
            l.rlim_max
        };
        // runc sets the container's limits: never above this process's own.
        let nofile = limit(libc::RLIMIT_NOFILE).min(1 << 20);
        let nproc = limit(libc::RLIMIT_NPROC).min(32768);
        let mut c = Command::new("podman");
        c.args(["run", "-d", "--name", name, "--hostname", hostname])
            .arg(format!("--network={network}"))
            .args(["--cap-add", "NET_ADMIN,NET_RAW"])
            .arg(format!("--ulimit=nofile={nofile}:{nofile}"))
            .arg(format!("--ulimit=nproc={nproc}:{nproc}"))
            .arg("-v")
            .arg(format!("{0}:{0}", shared.display()))
            .args(["--rootfs", "/:O", "sleep", "600"]);
        let out = c.output().expect("podman run");
        assert!(out.status.success(), "podman run {name}: {out:?}");
        Container(name.to_owned())
    }

    fn exec(&self, args: &[&str]) -> Output {
        Command::new("podman")
            .args(["exec", &self.0])
            .args(args)
            .output()
            .expect("podman exec")
    }

    /// `dev M:m ino I`: how xtlock names a lock file it found, from inside the container.
    fn lock_name(&self) -> String {
        let out = self.exec(&["stat", "-c", "dev %Hd:%Ld ino %i", "/run/xtables.lock"]);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rm", "-f", "-t", "0", &self.0])
            .output();
    }
}

/// The helper's `KEY TS` lines, in order.
fn times(text: &str, key: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(&format!("{key} ")))
        .filter_map(|t| t.split_whitespace().next()?.parse().ok())
        .collect()
}

/// Two node containers, each running iptables and then kube-proxy holding its own lock three
/// times for 300 ms: every hold of each node's lock file, on that file, within the holder's
/// own flock() and close(); each lock file said with its node's host name. Then an agent
/// container without the node's `/run` (its own lock file) in the first node's network
/// namespace races kube-proxy's restore there: the lost write said, naming both lock files.
#[test]
fn node_containers_lock_files_and_an_agent_without_the_lock_mount() {
    if !require_bpf("node_containers_lock_files_and_an_agent_without_the_lock_mount")
        || !require_podman("node_containers_lock_files_and_an_agent_without_the_lock_mount")
    {
        return;
    }
    let _g = serial();
    let s = Scratch::new("podman-nodes");
    let host_lock = s.lock_file("xtables.lock");
    let capture = s.dir.join("nodes.xtlock");
    let kube_proxy = s.agent("kube-proxy");
    let kp = kube_proxy.to_str().unwrap();
    let pid = std::process::id();
    let tracer = Tracer::start(
        &[&host_lock],
        Duration::from_secs(120),
        &["--no-drops", "--record", capture.to_str().unwrap()],
    );
    let nodes: Vec<(Container, &str)> = ["kind-worker", "kind-worker2"]
        .into_iter()
        .enumerate()
        .map(|(i, host)| {
            let c = Container::start(&format!("xtl-node{i}-{pid}"), host, "none", &s.dir);
            (c, host)
        })
        .collect();
    let mut clocks = Vec::new();
    for (c, host) in &nodes {
        // The first run makes the node's lock file; the second's exec is how xtlock finds it,
        // through its parent when it is already gone: a shell in the node that lives on a
        // moment, as an agent does (`podman exec`'s own parent is outside the container).
        let out = c.exec(&[
            "sh",
            "-c",
            "iptables-legacy -w -A OUTPUT -j ACCEPT && iptables-legacy -w -A OUTPUT -j ACCEPT \
             && sleep 1",
        ]);
        assert!(out.status.success(), "{host}: {out:?}");
        std::thread::sleep(Duration::from_secs(1));
        let mut said = String::new();
        for _ in 0..3 {
            let out = c.exec(&[kp, "hold", "/run/xtables.lock", "300"]);
            assert!(out.status.success(), "{host}: {out:?}");
            said.push_str(&String::from_utf8_lossy(&out.stdout));
        }
        clocks.push((c.lock_name(), said));
    }
    assert_ne!(
        clocks[0].0, clocks[1].0,
        "each node has a lock file of its own"
    );

    // An agent container with its own /run, in node 0's network namespace: its lock file is
    // not kube-proxy's. kube-proxy's restore reads at `*filter`, the agent replaces rule 1 of
    // FORWARD (the entry count stays), kube-proxy commits what it computed from its read.
    let node0 = &nodes[0].0;
    let agent = Container::start(
        &format!("xtl-agent-{pid}"),
        "agent",
        &format!("container:{}", node0.0),
        &s.dir,
    );
    let out = node0.exec(&[
        "iptables-legacy",
        "-w",
        "-A",
        "FORWARD",
        "-s",
        "10.1.0.0/16",
        "-j",
        "ACCEPT",
    ]);
    assert!(out.status.success(), "{out:?}");
    // The agent's lock file made, then found.
    let out = agent.exec(&[
        "sh",
        "-c",
        "iptables-legacy -w -L INPUT -n && iptables-legacy -w -L INPUT -n && sleep 1",
    ]);
    assert!(out.status.success(), "{out:?}");
    std::thread::sleep(Duration::from_secs(1));
    let mut restore = Command::new("podman")
        .args([
            "exec",
            "-i",
            &node0.0,
            kp,
            "run",
            "iptables-legacy-restore",
            "-w",
            "--noflush",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("podman exec");
    {
        use std::io::Write as _;
        let mut stdin = restore.stdin.take().unwrap();
        stdin.write_all(b"*filter\n").unwrap();
        stdin.flush().unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        let out = agent.exec(&[
            "iptables-legacy",
            "-w",
            "-R",
            "FORWARD",
            "1",
            "-s",
            "10.9.0.0/16",
            "-j",
            "ACCEPT",
        ]);
        assert!(out.status.success(), "{out:?}");
        writeln!(stdin, "-A INPUT -s 10.2.0.0/16 -j ACCEPT\nCOMMIT").unwrap();
    }
    let done = restore.wait_with_output().unwrap();
    assert!(done.status.success(), "{done:?}");
    let save =
        String::from_utf8_lossy(&node0.exec(&["iptables-legacy-save", "-t", "filter"]).stdout)
            .into_owned();
    assert!(
        !save.contains("10.9.0.0/16") && save.contains("10.2.0.0/16"),
        "{save}"
    );
    let agent_lock = agent.lock_name();
    std::thread::sleep(Duration::from_millis(300));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    for (_, host) in &nodes {
        assert!(
            trace.stderr.contains(&format!(
                "watching /run/xtables.lock of {host} (mount namespace"
            )),
            "{host}'s lock file is said:\n{}",
            trace.stderr
        );
    }
    let holds = trace.of_type("hold");
    for (lock, said) in &clocks {
        let mine: Vec<&&Value> = holds
            .iter()
            // The helper's own holds (kube-proxy's restore in node 0 holds it too, later).
            .filter(|h| h["lock"] == lock.as_str() && h["comm"] == "kube-proxy")
            .collect();
        assert_eq!(mine.len(), 3, "three holds on {lock}:\n{dump}");
        let (locking, acquired, released, closed) = (
            times(said, "locking"),
            times(said, "acquired"),
            times(said, "released"),
            times(said, "closed"),
        );
        for (i, h) in mine.iter().enumerate() {
            let start = u(&h["start_ns"]);
            let end = start + u(&h["hold_ns"]);
            assert!(
                (locking[i]..=acquired[i]).contains(&start)
                    && (released[i]..=closed[i]).contains(&end),
                "hold {i} on {lock} [{start}, {end}] outside the holder's flock() [{}, {}] and \
                 close() [{}, {}]:\n{dump}",
                locking[i],
                acquired[i],
                released[i],
                closed[i]
            );
        }
    }
    let lost: Vec<Value> = trace
        .of_type("unserialized")
        .into_iter()
        .filter(|f| f["kind"] == "lost_write")
        .cloned()
        .collect();
    assert_eq!(lost.len(), 1, "one lost write:\n{dump}");
    let f = &lost[0];
    assert_eq!(f["writer"]["agent"], "kube-proxy", "{f}");
    assert_eq!(f["writer"]["lock"], clocks[0].0.as_str(), "{f}");
    assert_eq!(f["other"]["lock"], agent_lock.as_str(), "{f}");
    let replayed = xtlock_tests::report_events(&capture);
    let replayed_lost: Vec<&Value> = replayed
        .iter()
        .filter(|e| e["type"] == "unserialized" && e["kind"] == "lost_write")
        .collect();
    assert_eq!(replayed_lost, [f], "report differs from trace");
    let replayed_holds = replayed.iter().filter(|e| e["type"] == "hold").count();
    assert_eq!(
        replayed_holds,
        holds.len(),
        "report's holds differ from trace's"
    );
}
