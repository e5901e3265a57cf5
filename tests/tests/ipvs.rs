//! IPVS, as kube-proxy's ipvs mode sets it up: a virtual server 10.96.0.10:53/udp on a dummy
//! interface of a "node" namespace, two real servers in their own namespaces answering UDP,
//! and a client namespace sending from fixed source ports (one IPVS connection each).
//! xtlock must report which backend each connection was scheduled to, count the packets per
//! backend exactly as `ipvsadm --stats` does, and, when a backend is removed (or set to
//! weight 0) while its client keeps its source port, report the stale forwarding to exactly
//! that backend with the client address, then its end when the connection entry expires.
//!
//! Needs kprobes and the ip_vs module: in the VM (`cargo xtask vm-test --test ipvs`). On a
//! kernel without them (this project's host: 6.18 without CONFIG_KPROBES, no IPVS) the test
//! asserts the plain "not attached: why" report instead; under CI=true it never skips.

use std::{
    collections::HashMap,
    path::Path,
    process::{Child, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use serde_json::Value;
use xtlock_tests::{
    hook_statuses, in_vm, kernel_has_kprobes, require_bpf, serial, sh, skip_on_this_kernel,
    xtlock_bin, Scratch, Tracer,
};

const VIP: &str = "10.96.0.10";
const NODE: &str = "xi-node";
const CLI: &str = "xi-cli";
const BACKENDS: [(&str, &str, &str); 2] =
    [("xi-be1", "10.0.1.5", "1"), ("xi-be2", "10.0.2.6", "2")];
/// UDP timeout of IPVS connections in this test (`ipvsadm --set 0 0 N`), in seconds.
const UDP_TIMEOUT_S: u64 = 10;
/// ipvsadm's counters are the kernel's per-CPU counters summed by its rate estimator, every
/// 2 s: a read waits this long after the last packet.
const ESTIMATOR: Duration = Duration::from_millis(2500);

/// The IPVS hooks of `xtlock probes`.
const HOOKS: [&str; 11] = [
    "ipvs_conn_new",
    "ipvs_nat_xmit",
    "ipvs_nat_xmit_v6",
    "ipvs_conn_in_get",
    "ipvs_conn_expire",
    "ipvs_add_dest",
    "ipvs_del_dest",
    "ipvs_edit_dest",
    "ipvs_add_service",
    "ipvs_edit_service",
    "ipvs_unlink_service",
];

fn ns(n: &str, prog: &str, args: &[&str]) -> String {
    let mut a = vec!["netns", "exec", n, prog];
    a.extend_from_slice(args);
    sh("ip", &a)
}

/// The namespaces, links, addresses, the virtual server and its real servers; removed on
/// drop, also when the test fails.
struct Lab {
    echo: Vec<Child>,
}

impl Lab {
    fn new(scratch: &Scratch) -> Self {
        Self::cleanup();
        for n in [NODE, CLI, BACKENDS[0].0, BACKENDS[1].0] {
            sh("ip", &["netns", "add", n]);
            ns(n, "ip", &["link", "set", "lo", "up"]);
        }
        let mut links = vec![(CLI, "0", "10.0.0.9")];
        links.extend(BACKENDS.iter().map(|(n, a, i)| (*n, *i, *a)));
        for (peer, i, addr) in links {
            let (vn, vp) = (format!("xin{i}"), format!("xip{i}"));
            sh(
                "ip",
                &[
                    "-n", NODE, "link", "add", &vn, "type", "veth", "peer", "name", &vp, "netns",
                    peer,
                ],
            );
            let gw = format!("10.0.{i}.1");
            ns(
                NODE,
                "ip",
                &["addr", "add", &format!("{gw}/24"), "dev", &vn],
            );
            ns(NODE, "ip", &["link", "set", &vn, "up"]);
            ns(
                peer,
                "ip",
                &["addr", "add", &format!("{addr}/24"), "dev", &vp],
            );
            ns(peer, "ip", &["link", "set", &vp, "up"]);
            ns(peer, "ip", &["route", "add", "default", "via", &gw]);
        }
        // kube-proxy's way: the ClusterIP on a dummy interface, so it is local to the node.
        ns(NODE, "ip", &["link", "add", "kube-ipvs0", "type", "dummy"]);
        ns(
            NODE,
            "ip",
            &["addr", "add", &format!("{VIP}/32"), "dev", "kube-ipvs0"],
        );
        ns(NODE, "ip", &["link", "set", "kube-ipvs0", "up"]);
        ns(
            NODE,
            "sh",
            &["-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
        );
        let svc = format!("{VIP}:53");
        ns(NODE, "ipvsadm", &["-A", "-u", &svc, "-s", "rr"]);
        ns(
            NODE,
            "ipvsadm",
            &["--set", "0", "0", &UDP_TIMEOUT_S.to_string()],
        );
        for (_, addr, _) in BACKENDS {
            let rs = format!("{addr}:53");
            ns(
                NODE,
                "ipvsadm",
                &["-a", "-u", &svc, "-r", &rs, "-m", "-w", "1"],
            );
        }
        let helper = scratch.agent("udpecho");
        let echo = BACKENDS
            .iter()
            .map(|(n, _, _)| {
                Command::new("ip")
                    .args(["netns", "exec", n])
                    .arg(&helper)
                    .args(["udpecho", "53"])
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("start udp echo")
            })
            .collect();
        Lab { echo }
    }

    fn cleanup() {
        for n in [NODE, CLI, BACKENDS[0].0, BACKENDS[1].0] {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.echo {
            let _ = c.kill();
            let _ = c.wait();
        }
        Self::cleanup();
    }
}

/// The IPVS hooks among `xtlock probes --json`'s hooks (or a capture header's probes), all
/// of them and in order.
fn ipvs_hooks(all: &[Value]) -> Vec<Value> {
    let hooks: Vec<Value> = all
        .iter()
        .filter(|h| {
            h["program"]
                .as_str()
                .is_some_and(|p| p.starts_with("ipvs_"))
        })
        .cloned()
        .collect();
    let names: Vec<&str> = hooks.iter().filter_map(|h| h["program"].as_str()).collect();
    assert_eq!(names, HOOKS, "{hooks:?}");
    hooks
}

/// The JSON header of a capture file (after the 8-byte magic, the version and the length).
fn capture_header(path: &Path) -> Value {
    let b = std::fs::read(path).expect("read the capture");
    let len = u32::from_le_bytes(b[10..14].try_into().expect("4 bytes")) as usize;
    serde_json::from_slice(&b[14..14 + len]).expect("capture header JSON")
}

/// Sends `count` datagrams from `10.0.0.9:sport` to the virtual server, one per `every_ms`.
fn send(client: &Path, sport: u16, count: u32, every_ms: u32) {
    let out = ns(
        CLI,
        &client.display().to_string(),
        &[
            "udpfrom",
            &sport.to_string(),
            VIP,
            "53",
            &count.to_string(),
            &every_ms.to_string(),
        ],
    );
    assert_eq!(out.trim(), format!("sent {count}"), "client {sport}");
}

/// `ipvsadm -Lnc`: client `ip:port` -> real server `ip:port`.
fn ipvs_connections() -> HashMap<String, String> {
    let text = ns(NODE, "ipvsadm", &["-Lnc"]);
    let mut m = HashMap::new();
    for l in text.lines() {
        // pro expire state source virtual destination
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.len() == 6 && w[0] == "UDP" {
            m.insert(w[3].to_string(), w[5].to_string());
        }
    }
    m
}

/// The real server of the client's connection from `port`, as `ipvsadm -Lnc` lists it.
fn backend_of(conns: &HashMap<String, String>, port: u16) -> String {
    conns
        .get(&format!("10.0.0.9:{port}"))
        .unwrap_or_else(|| panic!("no IPVS connection of port {port}: {conns:?}"))
        .clone()
}

/// `ipvsadm -Ln --stats --exact`: real server `ip:port` -> InPkts.
fn ipvs_inpkts() -> HashMap<String, u64> {
    let text = ns(NODE, "ipvsadm", &["-Ln", "--stats", "--exact"]);
    let mut m = HashMap::new();
    for l in text.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        // "  -> 10.0.1.5:53   Conns InPkts OutPkts InBytes OutBytes"
        if w.len() >= 4 && w[0] == "->" && w[1] != "RemoteAddress:Port" {
            m.insert(w[1].to_string(), w[3].parse().expect("InPkts"));
        }
    }
    m
}

/// Sum of `ipvs_count` packets for a backend in the given states.
fn counted(t: &xtlock_tests::Trace, backend: &str, states: &[&str]) -> u64 {
    t.of_type("ipvs")
        .iter()
        .chain(t.of_type("ipvs_count").iter())
        .filter(|e| e["type"] == "ipvs_count" && e["backend"] == backend)
        .filter(|e| states.iter().any(|s| e["backend_state"] == *s))
        .map(|e| e["packets"].as_u64().expect("packets"))
        .sum()
}

fn ipvs_facts<'a>(t: &'a xtlock_tests::Trace, event: &str) -> Vec<&'a Value> {
    t.of_type("ipvs")
        .into_iter()
        .filter(|e| e["event"] == event)
        .collect()
}

#[test]
fn ipvs_scheduling_counts_and_stale_backends() {
    if !require_bpf("ipvs_scheduling_counts_and_stale_backends") {
        return;
    }
    let _g = serial();
    let ipvs_loaded = Path::new("/sys/module/ip_vs").exists();
    let can_attach = ipvs_loaded && kernel_has_kprobes();
    if !in_vm() && !can_attach {
        // The plain report, never a silent skip.
        let hooks = ipvs_hooks(&hook_statuses(&[]));
        for h in &hooks {
            let why = h["error"]
                .as_str()
                .unwrap_or_else(|| panic!("IPVS hook attached without ip_vs or kprobes: {h}"));
            if !ipvs_loaded {
                assert!(why.starts_with("module ip_vs not loaded"), "{h}");
            } else {
                assert!(why.contains("without kprobes"), "{why}");
            }
            assert!(
                h["attach"]
                    .as_str()
                    .is_some_and(|a| a.contains("aya 0.14 attaches fentry only to vmlinux")),
                "{h}"
            );
            eprintln!("not in the VM: {}: {why}", h["program"]);
        }
        return;
    }

    if no_module_btf("ipvs_scheduling_counts_and_stale_backends") {
        return;
    }

    let scratch = Scratch::new("ipvs");
    let lab = Lab::new(&scratch);
    let client = scratch.agent("dnsclient");
    let started = Instant::now();
    let lock = scratch.lock_file("xtables.lock");
    let capture = scratch.dir.join("ipvs.xtlock");
    let capture_arg = capture.display().to_string();
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(60),
        &["--no-drops", "--record", &capture_arg],
    );

    // Two connections: rr sends the first to one real server, the second to the other.
    send(&client, 40000, 60, 10);
    send(&client, 40001, 40, 10);
    let conns = ipvs_connections();
    let b0 = backend_of(&conns, 40000);
    let b1 = backend_of(&conns, 40001);
    assert_ne!(b0, b1, "rr scheduled both connections to one backend");
    sleep(ESTIMATOR);
    let before = ipvs_inpkts();
    eprintln!("connections {conns:?}, InPkts {before:?}");

    // Remove the first backend while its client keeps its source port: dropped by the
    // kernel (expire_nodest_conn=0), the entry left to expire.
    let svc = format!("{VIP}:53");
    ns(NODE, "ipvsadm", &["-d", "-u", &svc, "-r", &b0]);
    send(&client, 40000, 25, 10);
    // Weight 0 on the second (kube-proxy's graceful termination): still forwarded.
    ns(
        NODE,
        "ipvsadm",
        &["-e", "-u", &svc, "-r", &b1, "-m", "-w", "0"],
    );
    send(&client, 40001, 30, 10);
    sleep(ESTIMATOR);
    let after = ipvs_inpkts();
    eprintln!("InPkts after {after:?}");
    // Both entries expire UDP_TIMEOUT_S after their last forwarded packet.
    sleep(Duration::from_secs(UDP_TIMEOUT_S + 1));
    let gone = ipvs_connections();
    assert!(
        !gone.contains_key("10.0.0.9:40000") && !gone.contains_key("10.0.0.9:40001"),
        "IPVS entries still there: {gone:?}"
    );
    // Virtual-service changes: kube-proxy adds a ClusterIP, edits one, removes one.
    let svc2 = "10.96.0.11:53";
    ns(NODE, "ipvsadm", &["-A", "-u", svc2, "-s", "rr"]);
    ns(NODE, "ipvsadm", &["-E", "-u", &svc, "-s", "rr", "-p", "30"]);
    ns(NODE, "ipvsadm", &["-D", "-u", svc2]);
    // SIGINT: xtlock drains, reads the counters a last time and prints the summary.
    tracer.interrupt();
    let t = tracer.finish();
    // Which hooks attached, as the capture's header says (one `xtlock probes` less: under
    // emulation each load of the programs takes many seconds).
    let header = capture_header(&capture);
    let hooks = ipvs_hooks(header["probes"].as_array().expect("probes in the header"));
    for h in &hooks {
        assert!(h["error"].is_null(), "IPVS hook not attached: {h}");
        let attach = h["attach"].as_str().unwrap_or("");
        assert!(
            attach.starts_with("kprobe") || attach.starts_with("kretprobe"),
            "{h}"
        );
    }
    eprintln!("{} s in all", started.elapsed().as_secs());
    let facts: Vec<&Value> = t.of_type("ipvs");
    for f in &facts {
        eprintln!("{f}");
    }
    for f in t.of_type("ipvs_count") {
        eprintln!("{f}");
    }
    drop(lab);

    // Scheduling: exactly one connection per client port, to the backend ipvsadm shows.
    let sched = ipvs_facts(&t, "scheduled");
    for (port, backend) in [(40000, &b0), (40001, &b1)] {
        let client = format!("10.0.0.9:{port}");
        let mine: Vec<_> = sched
            .iter()
            .filter(|e| e["client"] == client.as_str())
            .collect();
        assert_eq!(mine.len(), 1, "scheduled facts of {client}: {mine:?}");
        assert_eq!(mine[0]["backend"], backend.as_str());
        assert_eq!(mine[0]["service"], svc.as_str());
        assert_eq!(mine[0]["protocol"], "udp");
    }

    // Per-backend counts: exactly what ipvsadm counted (and what the client sent).
    assert_eq!(before[&b0], 60);
    assert_eq!(before[&b1], 40);
    assert_eq!(counted(&t, &b0, &["ok"]), before[&b0], "{b0} forwarded");
    assert_eq!(after[&b1], 70);
    assert_eq!(
        counted(&t, &b1, &["ok", "weight_0"]),
        after[&b1],
        "{b1} forwarded"
    );
    assert_eq!(counted(&t, &b1, &["weight_0"]), 30, "{b1} at weight 0");
    assert_eq!(counted(&t, &b0, &["removed"]), 25, "{b0} stale, dropped");
    assert_eq!(counted(&t, &b0, &["weight_0"]), 0);
    assert_eq!(counted(&t, &b1, &["removed"]), 0);

    // Table changes, with the process that made them.
    let removed = ipvs_facts(&t, "dest_removed");
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert_eq!(removed[0]["backend"], b0.as_str());
    assert_eq!(removed[0]["comm"], "ipvsadm");
    let edited = ipvs_facts(&t, "dest_edited");
    assert_eq!(edited.len(), 1, "{edited:?}");
    assert_eq!(edited[0]["backend"], b1.as_str());
    assert_eq!(edited[0]["weight"], 0);
    assert_eq!(ipvs_facts(&t, "dest_added").len(), 0);
    for (event, service) in [
        ("service_added", "10.96.0.11:53"),
        ("service_edited", svc.as_str()),
        ("service_removed", "10.96.0.11:53"),
    ] {
        let f = ipvs_facts(&t, event);
        assert_eq!(f.len(), 1, "{event}: {f:?}");
        assert_eq!(f[0]["service"], service, "{event}");
        assert_eq!(f[0]["comm"], "ipvsadm", "{event}");
        assert!(
            f[0]["ret"].is_null() || f[0]["ret"] == 0,
            "{event}: {}",
            f[0]
        );
    }

    // Stale forwarding: exactly the two connections, each to its own backend.
    let stale = ipvs_facts(&t, "stale");
    assert_eq!(stale.len(), 2, "{stale:?}");
    let ends = ipvs_facts(&t, "stale_end");
    assert_eq!(ends.len(), 2, "{ends:?}");
    for (client, backend, state, action, packets) in [
        ("10.0.0.9:40000", &b0, "removed", "dropped", 25),
        ("10.0.0.9:40001", &b1, "weight_0", "forwarded", 30),
    ] {
        let s = stale
            .iter()
            .find(|e| e["client"] == client)
            .unwrap_or_else(|| panic!("no stale fact for {client}: {stale:?}"));
        assert_eq!(s["backend"], backend.as_str(), "{s}");
        assert_eq!(s["backend_state"], state, "{s}");
        assert_eq!(s["action"], action, "{s}");
        assert_eq!(s["change"]["comm"], "ipvsadm", "{s}");
        let left = s["entry_left_ns"].as_u64().expect("entry_left_ns");
        assert!(
            left > 0 && left <= UDP_TIMEOUT_S * 1_000_000_000,
            "entry left {left} ns: {s}"
        );
        let e = ends
            .iter()
            .find(|e| e["client"] == client)
            .unwrap_or_else(|| panic!("no stale_end fact for {client}: {ends:?}"));
        assert_eq!(e["backend"], backend.as_str(), "{e}");
        assert_eq!(e["packets"], packets, "{e}");
        let last = e["last_packet_ns"].as_u64().expect("last_packet_ns");
        let first = e["first_packet_ns"].as_u64().expect("first_packet_ns");
        // The client sent one every 10 ms: at least 200 ms from the first to the last.
        assert!(last >= first + 200_000_000, "{e}");
        let expired = e["expired_ns"]
            .as_u64()
            .unwrap_or_else(|| panic!("{client}: entry not seen expiring: {e}"));
        // Removed: the timer was not restarted by the dropped packets, so the entry ends
        // within the timeout of the last forwarded packet, before the timeout after the last
        // stale one. Weight 0: each forwarded packet restarts it.
        let gap = expired.saturating_sub(last);
        eprintln!("{client}: entry expired {gap} ns after its last stale packet");
        if state == "weight_0" {
            assert!(
                (UDP_TIMEOUT_S * 1_000_000_000 - 500_000_000
                    ..=UDP_TIMEOUT_S * 1_000_000_000 + 1_500_000_000)
                    .contains(&gap),
                "{e}"
            );
        } else {
            assert!(gap < UDP_TIMEOUT_S * 1_000_000_000, "{e}");
        }
    }
    // The capture carries it all: `report` gives the same IPVS facts, and the terminal says
    // it in one line per stale connection.
    let out = Command::new(xtlock_bin())
        .args(["report", "--events", "--json", &capture_arg])
        .output()
        .expect("xtlock report");
    assert!(out.status.success(), "{out:?}");
    // Both as parsed JSON (key order aside), sorted.
    let ipvs_facts_of = |events: &mut dyn Iterator<Item = Value>| -> Vec<String> {
        let mut v: Vec<String> = events
            .filter(|e| e["type"].as_str().is_some_and(|t| t.starts_with("ipvs")))
            .map(|e| e.to_string())
            .collect();
        v.sort();
        v
    };
    let reported = ipvs_facts_of(
        &mut String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).expect("report line is JSON")),
    );
    let live = ipvs_facts_of(&mut t.events.iter().cloned());
    assert!(!live.is_empty());
    assert_eq!(reported, live, "report and trace disagree");
    let out = Command::new(xtlock_bin())
        .args(["report", "--events", &capture_arg])
        .output()
        .expect("xtlock report");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}");
    let line = text
        .lines()
        .find(|l| l.contains(&format!("endpoint {b0} removed at T by ipvsadm[")))
        .unwrap_or_else(|| panic!("no stale line for {b0}:\n{text}"));
    assert!(
        line.contains("25 packets from 10.0.0.9:40000 still sent there (dropped by the kernel)"),
        "{line}"
    );
    assert!(line.contains("entry expired at T+"), "{line}");
    // Perfetto: the stale connections as instants on the ipvs track.
    let trace_json = scratch.dir.join("ipvs.perfetto.json");
    sh(
        &xtlock_bin().display().to_string(),
        &[
            "export",
            &capture_arg,
            "--format",
            "perfetto",
            "-o",
            &trace_json.display().to_string(),
        ],
    );
    let pf = std::fs::read_to_string(&trace_json).expect("perfetto trace");
    assert!(
        pf.contains(&format!("endpoint {b0} removed at T by ipvsadm[")),
        "no IPVS instant in the Perfetto trace"
    );

    let rows = t.summary()["ipvs"].as_array().cloned().unwrap_or_default();
    assert!(
        rows.iter()
            .any(|r| r["backend"] == b0.as_str() && r["stale_packets"] == 25),
        "summary: {rows:?}"
    );
}

/// The `.ko` of module `name` of the running kernel, from the unpacked kernel package the VM
/// harness boots (its cache, shared read-only with the guest): the host's modprobe does not
/// know the guest kernel's modules.
fn module_file(name: &str) -> String {
    let release = sh("uname", &["-r"]).trim().to_string();
    let caches = [
        std::env::var("XTLOCK_VM_CACHE").unwrap_or_default(),
        "/root/.cache/xtlock/vm".to_string(),
    ];
    for cache in caches.iter().filter(|c| !c.is_empty()) {
        let dir = Path::new(cache).join("kernels");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let f = e
                .path()
                .join("root/lib/modules")
                .join(&release)
                .join("kernel/net/netfilter/ipvs")
                .join(format!("{name}.ko"));
            if f.exists() {
                return f.display().to_string();
            }
        }
    }
    panic!("{name}.ko of {release} not found in the VM harness's kernel cache");
}

/// A kernel with BTF but none for its modules (5.10: CONFIG_DEBUG_INFO_BTF_MODULES came in
/// 5.11), ip_vs loaded: the IPVS hooks cannot know the structs' offsets, and must say so
/// rather than attach. Returns true (a skip, recorded) after checking they do.
fn no_module_btf(test: &str) -> bool {
    if !Path::new("/sys/module/ip_vs").exists() || Path::new("/sys/kernel/btf/ip_vs").exists() {
        return false;
    }
    for h in ipvs_hooks(&hook_statuses(&[])) {
        let why = h["error"]
            .as_str()
            .unwrap_or_else(|| panic!("IPVS hook attached without ip_vs's BTF: {h}"));
        assert!(
            why.contains("no BTF for module ip_vs")
                && why.contains("CONFIG_DEBUG_INFO_BTF_MODULES"),
            "{h}"
        );
    }
    skip_on_this_kernel(
        test,
        "no BTF for modules (/sys/kernel/btf/ip_vs; CONFIG_DEBUG_INFO_BTF_MODULES, Linux >= \
         5.11): the IPVS structs' offsets are unknown, the hooks say so and stay off",
    );
    true
}

/// ip_vs loaded after xtlock started (modules load on demand on a node): the hooks attach
/// within seconds, without a restart, and see the next connection. In the VM only (the module
/// must be unloadable); elsewhere the first test covers the plain report.
#[test]
fn ipvs_hooks_attach_when_the_module_loads() {
    if !require_bpf("ipvs_hooks_attach_when_the_module_loads") {
        return;
    }
    let _g = serial();
    if !in_vm() {
        eprintln!("not in the VM: the module is not ours to unload here");
        return;
    }
    if no_module_btf("ipvs_hooks_attach_when_the_module_loads") {
        return;
    }
    Lab::cleanup();
    // Namespaces of the other test go away asynchronously and hold ip_vs until they do.
    for _ in 0..100 {
        let _ = Command::new("rmmod")
            .args(["ip_vs_rr", "ip_vs"])
            .stderr(Stdio::null())
            .status();
        if !Path::new("/sys/module/ip_vs").exists() {
            break;
        }
        sleep(Duration::from_millis(100));
    }
    assert!(
        !Path::new("/sys/module/ip_vs").exists(),
        "cannot unload ip_vs"
    );
    let scratch = Scratch::new("ipvs-late");
    let lock = scratch.lock_file("xtables.lock");
    let tracer = Tracer::start(&[&lock], Duration::from_secs(120), &["--no-drops"]);
    for m in ["ip_vs", "ip_vs_rr"] {
        sh("insmod", &[&module_file(m)]);
    }
    // xtlock looks for modules that appeared every 5 s; the hooks attach in their order.
    let last = format!(
        "module loaded: hook attached hook=\"{}\"",
        HOOKS[HOOKS.len() - 1]
    );
    assert!(
        tracer.wait_for_stderr(&last, Duration::from_secs(60)),
        "the IPVS hooks did not attach within 60 s of ip_vs loading"
    );
    let lab = Lab::new(&scratch);
    let client = scratch.agent("dnsclient");
    send(&client, 40000, 20, 10);
    let backend = backend_of(&ipvs_connections(), 40000);
    // The counters are read once a second.
    sleep(Duration::from_millis(2500));
    tracer.interrupt();
    let t = tracer.finish();
    drop(lab);
    for h in HOOKS {
        assert!(
            t.stderr
                .lines()
                .any(|l| l.contains("module loaded: hook attached") && l.contains(h)),
            "{h} not attached after ip_vs loaded:\n{}",
            t.stderr
        );
    }
    let sched = ipvs_facts(&t, "scheduled");
    assert_eq!(sched.len(), 1, "{sched:?}");
    assert_eq!(sched[0]["client"], "10.0.0.9:40000");
    assert_eq!(sched[0]["backend"], backend.as_str());
    assert_eq!(counted(&t, &backend, &["ok"]), 20);
}

/// kube-proxy's ipvs mode, a pod gone while its real server keeps weight 1: xtlock reads the
/// IPVS table over netlink (no hook needed) in the node's namespace, where the pod's veth
/// vanishes, and says the window from the veth's deletion to the weight 0 that ended it (the
/// graceful termination kube-proxy does), with ipvsadm named where the IPVS hooks attach.
/// The script's clock is the truth: within 100 ms with the hooks, else within the read period
/// (the fix is then the first read without the route).
#[test]
fn a_real_server_whose_pod_is_gone_is_said() {
    if !require_bpf("a_real_server_whose_pod_is_gone_is_said") {
        return;
    }
    let _g = serial();
    if !Path::new("/sys/module/ip_vs").exists() && !in_vm() {
        skip_on_this_kernel(
            "a_real_server_whose_pod_is_gone_is_said",
            "IPVS (the ip_vs module; the VM runs it: `cargo xtask vm-test --test ipvs`)",
        );
        return;
    }
    let scratch = Scratch::new("ipvs-gone");
    let lab = Lab::new(&scratch);
    let client = scratch.agent("dnsclient");
    let lock = scratch.lock_file("xtables.lock");
    let capture = scratch.dir.join("gone.xtlock");
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{NODE}"))
        .arg(xtlock_bin())
        .args([
            "trace",
            "--json",
            "--duration",
            "120s",
            "--no-drops",
            "--lock-file",
        ])
        .arg(&lock)
        .arg("--record")
        .arg(&capture);
    let tracer = Tracer::spawn(c);
    // The node resolves both pods (its neighbour entries say where they live).
    send(&client, 41001, 2, 50);
    send(&client, 41002, 2, 50);
    sleep(Duration::from_millis(1500));
    let (dead, live) = (BACKENDS[0].1, BACKENDS[1].1);
    let del_start = xtlock_tests::monotonic_ns();
    ns(BACKENDS[0].0, "ip", &["link", "del", "xip1"]);
    let del_end = xtlock_tests::monotonic_ns();
    sleep(Duration::from_millis(1500));
    let svc = format!("{VIP}:53");
    let rs = format!("{dead}:53");
    let fix_start = xtlock_tests::monotonic_ns();
    ns(
        NODE,
        "ipvsadm",
        &["-e", "-u", &svc, "-r", &rs, "-m", "-w", "0"],
    );
    let fix_end = xtlock_tests::monotonic_ns();
    // Drained: removed 2 s later, as kube-proxy does once its connections are gone.
    sleep(Duration::from_millis(2000));
    ns(NODE, "ipvsadm", &["-d", "-u", &svc, "-r", &rs]);
    let removed = xtlock_tests::monotonic_ns();
    // The next read, then the report 5 s after the fix.
    sleep(Duration::from_millis(5000));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    drop(lab);

    let facts: Vec<&Value> = trace
        .of_type("stale_endpoint")
        .into_iter()
        .filter(|f| f["service"] == format!("udp/{svc}"))
        .collect();
    assert_eq!(facts.len(), 1, "one window, of the gone pod only:\n{dump}");
    let f = facts[0];
    eprintln!("fact: {f}");
    assert_eq!(f["endpoint"], rs, "{f}");
    assert_ne!(f["endpoint"], format!("{live}:53"), "{f}");
    assert_eq!(f["gone"], "link deleted", "{f}");
    assert_eq!(f["still_routed"], false, "{f}");
    let fix = &f["fix"];
    let stale = f["stale_ns"].as_u64().expect("stale_ns");
    // The fix at the hooks' exact time, else at the first read after it.
    let late = if fix["exact"] == true {
        assert_eq!(fix["agent"], "ipvsadm", "{f}");
        0
    } else {
        1_100_000_000
    };
    let (lo, hi) = (fix_start - del_end, fix_end - del_start + late);
    assert!(
        stale + 100_000_000 >= lo && stale <= hi + 100_000_000,
        "stale {stale} ns, truth between {lo} and {hi}: {f}"
    );
    // Its time at weight 0, from read to read (each up to a period late).
    let drained = trace.of_type("ipvs_drained");
    assert_eq!(drained.len(), 1, "{dump}");
    let d = drained[0];
    eprintln!("drained: {d}");
    assert_eq!(
        (&d["endpoint"], &d["removed"]),
        (&rs.clone().into(), &true.into()),
        "{d}"
    );
    assert_eq!(d["gone"], "link deleted", "{d}");
    let took = d["drained_ns"].as_u64().expect("drained_ns");
    let truth = removed - fix_end;
    assert!(
        took + 1_100_000_000 >= truth && took <= truth + 1_100_000_000,
        "at weight 0 for {took} ns, truth {truth}: {d}"
    );
    // `record` + `report` say the same.
    let report = xtlock_tests::report_events(&capture);
    for kind in ["stale_endpoint", "ipvs_drained"] {
        let live: Vec<&Value> = trace.of_type(kind);
        let again: Vec<&Value> = report.iter().filter(|e| e["type"] == kind).collect();
        assert_eq!(again, live, "report differs from trace: {kind}");
    }
}
