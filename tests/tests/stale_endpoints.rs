//! A Service that keeps routing to a pod that is gone, against the real kernel: a node
//! (network namespace) with a bridge like the bridge CNI plugin makes, two pods (namespaces
//! with a veth on it, listening on 8080), a client in a namespace of its own, and a
//! kube-proxy-shaped table written by the real `iptables-legacy-restore`, `iptables-nft-restore`
//! or `nft -f` (kube-proxy's nftables mode: table `kube-proxy`, `endpoint-*` chains). The client
//! connects to the Service's cluster IP every 100 ms; the first pod's veth is deleted (as
//! the bridge plugin's CNI DEL does); with the legacy backend while calico-node holds the lock,
//! so kube-proxy's restore that removes the endpoint waits behind it, through nf_tables a second
//! later (no xtables lock there: the fix is late by kube-proxy's own delay). The client's own results and the script's
//! clock are the truth: the stale window within 10 % (or 100 ms), the connections refused to
//! the dead endpoint exactly the client's EHOSTUNREACH count and the node's own
//! `Icmp: OutDestUnreachs`, the fix by kube-proxy (after waiting behind calico-node, for
//! the legacy lock); and `record` + `report` say the same.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use xtlock_tests::cluster::{
    client_results, exit_time, helper_in, kube_proxy_nat, nat_table, out_dest_unreachs, stop, Node,
    Svc, DEAD, DNS, LIVE, SVC, T,
};
use xtlock_tests::{require_bpf, serial, sh, xtlock_bin, Agent, Scratch};

fn u(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not an unsigned number: {v}"))
}

/// kube-proxy's nftables mode: `endpoint-*` chain of `ip` (its name carries the service port
/// and the endpoint, as kube-proxy's do).
fn nft_endpoint_chain(ip: &str) -> String {
    format!(
        "endpoint-{:0>8}-default/web/tcp/http__{ip}/8080",
        ip.rsplit('.').next().unwrap_or("0")
    )
}

const NFT_SVC_CHAIN: &str = "service-WEB00000-default/web/tcp/http";

/// Table `kube-proxy` as kube-proxy's nftables mode writes it for `default/web:http`
/// (10.96.0.10:80): the `service-ips` map, a service chain that picks an endpoint chain with
/// `numgen`, endpoint chains that mark their own pod's traffic and `dnat to` it.
fn kube_proxy_nft(endpoints: &[&str]) -> String {
    let mut s = String::from(xtlock_tests::KUBE_PROXY_NFT_HEAD);
    for ip in endpoints {
        s.push_str(&format!(
            "chain {} {{ ip saddr {ip} jump mark-for-masquerade ; meta l4proto tcp dnat to {ip}:8080 ; }}\n",
            nft_endpoint_chain(ip)
        ));
    }
    s.push_str(&format!(
        "chain {NFT_SVC_CHAIN} {{ {} ; }}\n",
        nft_pick(endpoints)
    ));
    s.push_str("}\n");
    s.push_str(&format!(
        "add element ip kube-proxy service-ips {{ 10.96.0.10 . tcp . 80 : goto {NFT_SVC_CHAIN} }}\n"
    ));
    s
}

fn nft_pick(endpoints: &[&str]) -> String {
    let arms: Vec<String> = endpoints
        .iter()
        .enumerate()
        .map(|(i, ip)| format!("{i} : goto {}", nft_endpoint_chain(ip)))
        .collect();
    format!(
        "numgen random mod {} vmap {{ {} }}",
        endpoints.len(),
        arms.join(", ")
    )
}

/// kube-proxy's sync that drops `gone` from the Service: the service chain rewritten without
/// it, and its endpoint chain flushed (deleted by a later sync, as kube-proxy does).
fn kube_proxy_nft_without(gone: &str, left: &[&str]) -> String {
    format!(
        "flush chain ip kube-proxy {NFT_SVC_CHAIN}\n\
         add rule ip kube-proxy {NFT_SVC_CHAIN} {}\n\
         flush chain ip kube-proxy {}\n",
        nft_pick(left),
        nft_endpoint_chain(gone)
    )
}

/// How kube-proxy writes its rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    /// `iptables-legacy-restore -w`: takes the xtables lock.
    Legacy,
    /// `iptables-nft-restore`: the same text, through nf_tables.
    IptablesNft,
    /// kube-proxy's nftables mode: `nft -f -`.
    Nft,
}

/// kube-proxy (a helper named so) writes `rules` in the node's namespace.
/// The facts of type `kind` about namespace `netns`.
fn of_netns(events: &[Value], kind: &str, netns: u64) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["type"] == kind && u(&e["netns"]) == netns)
        .cloned()
        .collect()
}

/// The write a fact (`f`) names is kube-proxy's restore through `b`, timed in the kernel,
/// and through the legacy lock it waited behind calico-node.
fn assert_kube_proxys_write(w: &Value, b: Backend, f: &Value) {
    assert_eq!(w["agent"], "kube-proxy", "{f}");
    assert_eq!(w["exact"], true, "{f}");
    let program = match b {
        Backend::Legacy => "iptables-legacy-restore",
        Backend::IptablesNft => "iptables-nft-restore",
        Backend::Nft => "nft",
    };
    assert_eq!(w["program"], program, "{f}");
    if b == Backend::Legacy {
        assert!(
            w["behind"]
                .as_array()
                .is_some_and(|b| b.iter().any(|h| h[0] == "calico-node")),
            "the write's wait behind calico-node: {f}"
        );
    }
}

fn kube_proxy(s: &Scratch, node: &str, lock: &Path, rules: &Path, b: Backend) -> Agent {
    let net = format!("--net={}", Node::path(node));
    let kp = s.agent("kube-proxy");
    let mut args = vec![net.as_str(), kp.to_str().unwrap(), "run"];
    args.extend_from_slice(match b {
        Backend::Legacy => &["iptables-legacy-restore", "-w"][..],
        Backend::IptablesNft => &["iptables-nft-restore"][..],
        Backend::Nft => &["nft", "-f", "-"][..],
    });
    Agent::spawn(
        Path::new("nsenter"),
        &args,
        &[("XTABLES_LOCKFILE", lock.to_str().unwrap())],
        Some(rules),
    )
}

#[test]
fn a_service_routed_to_a_gone_pod_is_said_with_its_clients_and_why_the_fix_was_late() {
    if !require_bpf("a_service_routed_to_a_gone_pod_is_said") {
        return;
    }
    let _g = serial();
    scenario(Backend::Legacy, "xtse", false);
}

/// The same with the node in a network namespace of its own and xtlock in the host's, as a
/// kind or k3d node container is beside `sudo xtlock trace` on the host: the node's rules
/// route Services, so its addresses and conntrack are followed too (sockets made inside it),
/// and its dead endpoint is said with the same window, connections and late fix.
#[test]
fn a_node_in_its_own_network_namespace_gets_its_dead_endpoints_said() {
    if !require_bpf("a_node_in_its_own_network_namespace_gets_its_dead_endpoints_said") {
        return;
    }
    let _g = serial();
    scenario(Backend::Legacy, "xtsh", true);
}

/// The same through `iptables-nft-restore`: the read-back of nf_tables models the Service,
/// and the write that fixed it is kube-proxy's, also where the nft_commit hook does not attach.
#[test]
fn a_service_written_by_iptables_nft_routed_to_a_gone_pod_is_said() {
    if !require_bpf("a_service_written_by_iptables_nft_routed_to_a_gone_pod_is_said") {
        return;
    }
    let _g = serial();
    scenario(Backend::IptablesNft, "xtsn", false);
}

/// The same in kube-proxy's nftables mode (`nft -f`, table `kube-proxy`).
#[test]
fn a_service_in_kube_proxy_nftables_mode_routed_to_a_gone_pod_is_said() {
    if !require_bpf("a_service_in_kube_proxy_nftables_mode_routed_to_a_gone_pod_is_said") {
        return;
    }
    let _g = serial();
    scenario(Backend::Nft, "xtsk", false);
}

/// `on_host`: xtlock runs in the host's namespace rather than the node's.
fn scenario(b: Backend, prefix: &str, on_host: bool) {
    let s = Scratch::new(&format!("stale-endpoints-{prefix}"));
    let lock = s.lock_file("xtables.lock");
    let n = Node::new(prefix, true);
    let capture = s.dir.join("stale.xtlock");
    let tracer = if on_host {
        let mut c = Command::new(xtlock_bin());
        c.args(["trace", "--json", "--duration", "300s", "--lock-file"])
            .arg(&lock)
            .arg("--record")
            .arg(&capture)
            .args(xtlock_tests::tracer_extra_args());
        xtlock_tests::Tracer::spawn(c)
    } else {
        n.tracer(&lock, Some(&capture))
    };
    let pods = n.serve(&s, &[&["tcplisten", "8080"]]);
    let both = s.dir.join("both.rules");
    let one = s.dir.join("one.rules");
    if b == Backend::Nft {
        std::fs::write(&both, kube_proxy_nft(&[DEAD, LIVE])).unwrap();
        std::fs::write(&one, kube_proxy_nft_without(DEAD, &[LIVE])).unwrap();
    } else {
        std::fs::write(&both, kube_proxy_nat(&[DEAD, LIVE])).unwrap();
        std::fs::write(&one, kube_proxy_nat(&[LIVE])).unwrap();
    }
    let mut first = kube_proxy(&s, &n.node, &lock, &both, b);
    assert_eq!(first.wait_within(T), 0, "{:?}", first.seen);
    // The node has talked to both pods (its neighbour entries exist), and the table's read
    // has come.
    n.probe_pods(&s);
    std::thread::sleep(Duration::from_millis(500));
    let icmp_before = out_dest_unreachs(&n.node);

    // 40 connects, one every 100 ms, each given 5 s.
    let mut client = n.connects(&s, "40", "100", "5000");
    std::thread::sleep(Duration::from_millis(600));
    // Legacy: calico-node holds the xtables lock, and kube-proxy's restore waits behind it.
    let mut calico = (b == Backend::Legacy).then(|| {
        let mut c = Agent::spawn(
            &s.agent("calico-node"),
            &["hold", lock.to_str().unwrap(), "1500"],
            &[],
            None,
        );
        c.expect("acquired", T);
        c
    });
    // The bridge plugin's CNI DEL: the pod's end of the veth deleted in its namespace.
    let del_start = xtlock_tests::monotonic_ns();
    sh("ip", &["-n", &n.pods[0], "link", "del", "eth0"]);
    let del_end = xtlock_tests::monotonic_ns();
    // Through nf_tables, kube-proxy's sync comes 1.4 s later (its own delay).
    std::thread::sleep(Duration::from_millis(if b == Backend::Legacy {
        100
    } else {
        1400
    }));
    let spawned = xtlock_tests::monotonic_ns();
    let mut restore = kube_proxy(&s, &n.node, &lock, &one, b);
    assert_eq!(restore.wait_within(T), 0, "{:?}", restore.seen);
    // The fix could not come before this: calico's release, or kube-proxy's start.
    let earliest = match calico.as_mut() {
        Some(c) => c.ts("released", T),
        None => spawned,
    };
    let exited = exit_time(&mut restore);
    client.expect("done", T);
    if let Some(c) = calico.as_mut() {
        assert_eq!(c.wait(), 0);
    }
    stop(pods);
    // The last refused connections are answered up to a neighbour timeout after the fix.
    std::thread::sleep(Duration::from_millis(1500));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    // What the client got.
    let results = client_results(&client);
    assert_eq!(results.len(), 40, "{:?}", client.seen);
    let unreachable = results.iter().filter(|r| **r == "EHOSTUNREACH").count() as u64;
    let ok = results.iter().filter(|r| **r == "ok").count();
    eprintln!(
        "client: {ok} ok, {unreachable} EHOSTUNREACH, others {:?}",
        results
            .iter()
            .filter(|r| !matches!(**r, "ok" | "EHOSTUNREACH"))
            .collect::<Vec<_>>()
    );
    assert!(
        unreachable > 0,
        "no connection was DNATed to the dead pod: {:?}",
        client.seen
    );
    assert_eq!(
        ok + unreachable as usize,
        40,
        "connections neither answered nor refused: {:?}",
        client.seen
    );
    let icmp = out_dest_unreachs(&n.node) - icmp_before;

    let netns = Node::inode(&n.node);
    let mine = |events: &[Value]| of_netns(events, "stale_endpoint", netns);
    for w in trace.of_type("rule_write") {
        eprintln!("{w}");
    }
    let live = mine(&trace.events);
    assert_eq!(
        live.len(),
        1,
        "one stale window expected:\n{dump}\nstderr:\n{}",
        trace.stderr
    );
    let f = &live[0];
    eprintln!("{b:?} fact: {f}\ntruth: veth deleted at {del_start}..{del_end}, fix not before {earliest}, restore exited {exited}; client {unreachable} EHOSTUNREACH; OutDestUnreachs +{icmp}");
    assert_eq!(f["service"], SVC, "{f}");
    assert_eq!(f["endpoint"], format!("{DEAD}:8080"), "{f}");
    assert_eq!(f["gone"], "link deleted", "{f}");
    assert_eq!(f["still_routed"], false, "{f}");
    let fix = &f["fix"];
    assert_kube_proxys_write(fix, b, f);
    if b == Backend::Legacy {
        assert!(u(&fix["wait_ns"]) > 1_000_000_000, "{f}");
    }
    // Stale from the veth's deletion to the restore's write: between calico's release (or
    // kube-proxy's start) and the restore's exit.
    let stale = u(&f["stale_ns"]);
    let (lo, hi) = (
        earliest.saturating_sub(del_end),
        exited.saturating_sub(del_start),
    );
    let slack = (hi / 10).max(100_000_000);
    assert!(
        stale + slack >= lo && stale <= hi + slack,
        "stale {stale} ns, truth between {lo} and {hi} ns: {f}"
    );
    // Every refused connection, exactly: the client's count, the kernel's own.
    assert_eq!(u(&f["connections"]), unreachable, "{f}");
    assert_eq!(u(&f["connections"]), icmp, "kernel's OutDestUnreachs: {f}");
    assert_eq!(
        u(&f["outcomes"]["icmp_unreachable: host unreachable"]),
        unreachable,
        "{f}"
    );
    // Said live as the window opened, at the veth's deletion, long before it closed.
    let opens = of_netns(&trace.events, "stale_endpoint_open", netns);
    assert_eq!(opens.len(), 1, "one opening:\n{dump}");
    let o = &opens[0];
    assert_eq!(
        (&o["service"], &o["endpoint"], &o["gone"]),
        (&f["service"], &f["endpoint"], &f["gone"]),
        "{o}"
    );
    let at = u(&o["ts_ns"]);
    assert!(
        at + 100_000_000 >= del_start && at <= del_end + 100_000_000,
        "opened at {at}, the veth deleted at {del_start}..{del_end}: {o}"
    );
    let pos = |e: &Value| trace.events.iter().position(|x| x == e);
    assert!(pos(o) < pos(f), "the opening comes before the close");
    // The summary has it.
    let sum = &trace.summary()["services"];
    assert!(u(&sum["stale_windows"]) >= 1, "{sum}");

    // `record` + `report` say the same.
    let report = xtlock_tests::report_events(&capture);
    assert_eq!(mine(&report), live, "report differs from trace");
    assert_eq!(
        of_netns(&report, "stale_endpoint_open", netns),
        opens,
        "report's opening differs from trace's"
    );
    let text = Command::new(xtlock_bin())
        .args(["report", "--events"])
        .arg(&capture)
        .output()
        .expect("xtlock report");
    let text = String::from_utf8_lossy(&text.stdout);
    let line = format!("!! {SVC} routed to {DEAD}:8080 for ");
    assert!(text.contains(&line), "{text}");
    if let Some(l) = text.lines().find(|l| l.contains(&line)) {
        eprintln!("report: {l}");
    }
    assert!(
        text.contains(&format!("{unreachable} connection")) && text.contains("fixed by kube-proxy"),
        "{text}"
    );
    // `--service` shows that Service's window and nothing that does not name it; another
    // Service's name shows none of it.
    let only = |svc: &str| -> Vec<Value> {
        let out = Command::new(xtlock_bin())
            .args(["report", "--json", "--service", svc])
            .arg(&capture)
            .output()
            .expect("xtlock report --service");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["type"] != "summary" && v["type"] != "lost")
            .collect()
    };
    let svc_name = SVC.split(':').next().unwrap_or(SVC);
    let shown = only(svc_name);
    assert!(
        shown
            .iter()
            .any(|v| v["type"] == "stale_endpoint" && v["service"] == SVC),
        "--service {svc_name}: {shown:?}"
    );
    assert!(
        shown.iter().all(|v| v.to_string().contains(svc_name)),
        "--service {svc_name} showed a fact not naming it: {shown:?}"
    );
    assert!(
        only("other-ns/other-svc").is_empty(),
        "--service of another Service"
    );
    // And `export` draws the window as a slice of its length.
    let timeline = s.dir.join("timeline.json");
    let out = Command::new(xtlock_bin())
        .arg("export")
        .arg(&capture)
        .args(["--format", "perfetto", "-o"])
        .arg(&timeline)
        .output()
        .expect("xtlock export");
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&std::fs::read(&timeline).unwrap()).unwrap();
    let slices: Vec<&Value> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "stale_endpoint" && e["args"]["netns"].as_u64() == Some(netns))
        .collect();
    assert_eq!(slices.len(), 1, "{slices:?}");
    let dur_us = slices[0]["dur"].as_f64().unwrap_or(0.0);
    assert!(
        (dur_us * 1000.0 - stale as f64).abs() < 2_000.0,
        "slice {dur_us} us, window {stale} ns"
    );
}

/// The count of conntrack entries in namespace `ns` whose reply comes from `ip` (the
/// `conntrack` tool's own reading).
fn conntrack_to(ns: &str, proto: &str, ip: &str) -> usize {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "conntrack",
            "-L",
            "-p",
            proto,
            "--reply-src",
            ip,
        ])
        .output()
        .expect("conntrack -L");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with(proto))
        .count()
}

/// As on a real node: the node's neighbour entries keep Linux's default timers, so after the
/// pod's veth is deleted its neighbour stays reachable and connections DNATed to it go out to
/// nobody: unanswered, not refused. xtlock reads them from conntrack (TCP entries DNATed to
/// the gone pod that never saw a reply): exactly the client's own ETIMEDOUTs. A UDP flow to a
/// second Service (`kube-system/dns:dns`, its one endpoint on the same pod) keeps its
/// conntrack entry, so conntrack steers it to the dead pod after kube-proxy removed the
/// endpoint (kubernetes#125467): said with its packets, the `conntrack` tool's count the
/// truth.
#[test]
fn unanswered_connections_and_udp_flows_conntrack_keeps_are_said() {
    if !require_bpf("unanswered_connections_and_udp_flows_conntrack_keeps_are_said") {
        return;
    }
    let _g = serial();
    let prefix = "xtsu";
    let s = Scratch::new("stale-endpoints-unanswered");
    let lock = s.lock_file("xtables.lock");
    let n = Node::new(prefix, false);
    sh(
        "ip",
        &[
            "netns",
            "exec",
            &n.node,
            "sysctl",
            "-qw",
            "net.netfilter.nf_conntrack_acct=1",
        ],
    );
    let tracer = n.tracer(&lock, None);
    let pods = n.serve(&s, &[&["tcplisten", "8080"], &["udpecho", "5353"]]);
    let both = s.dir.join("both.rules");
    std::fs::write(
        &both,
        nat_table(&[Svc::web(&[DEAD, LIVE]), Svc::dns(&[DEAD])]),
    )
    .unwrap();
    let one = s.dir.join("one.rules");
    std::fs::write(&one, nat_table(&[Svc::web(&[LIVE]), Svc::dns(&[])])).unwrap();
    let mut first = kube_proxy(&s, &n.node, &lock, &both, Backend::Legacy);
    assert_eq!(first.wait_within(T), 0, "{:?}", first.seen);
    // The node talks to both pods: its neighbour entries are fresh (reachable for 15-45 s).
    n.probe_pods(&s);
    // One UDP flow to the DNS Service, answered by the pod, every 100 ms for 9 s.
    let mut udp = helper_in(
        &s,
        &n.client,
        "resolver",
        &["udpfrom", "40053", "10.96.0.53", "53", "90", "100"],
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        conntrack_to(&n.node, "udp", DEAD),
        1,
        "the DNS flow is DNATed to the pod"
    );
    // 30 connects, one every 100 ms, each given 1 s.
    let mut client = n.connects(&s, "30", "100", "1000");
    std::thread::sleep(Duration::from_millis(600));
    let del_start = xtlock_tests::monotonic_ns();
    sh("ip", &["-n", &n.pods[0], "link", "del", "eth0"]);
    let del_end = xtlock_tests::monotonic_ns();
    std::thread::sleep(Duration::from_millis(1200));
    let spawned = xtlock_tests::monotonic_ns();
    let mut restore = kube_proxy(&s, &n.node, &lock, &one, Backend::Legacy);
    assert_eq!(restore.wait_within(T), 0, "{:?}", restore.seen);
    let exited = exit_time(&mut restore);
    client.expect("done", T);
    // Past the report (5 s after the fix) while the UDP flow still sends.
    std::thread::sleep(Duration::from_millis(5600));
    let udp_entries = conntrack_to(&n.node, "udp", DEAD);
    udp.expect("sent", T);
    stop(pods);
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    let results = client_results(&client);
    assert_eq!(results.len(), 30, "{:?}", client.seen);
    let timed_out = results.iter().filter(|r| **r == "ETIMEDOUT").count() as u64;
    let ok = results.iter().filter(|r| **r == "ok").count() as u64;
    eprintln!("client: {ok} ok, {timed_out} ETIMEDOUT; UDP entries to the dead pod at the report: {udp_entries}");
    assert!(
        timed_out > 0,
        "no connection was DNATed to the dead pod: {:?}",
        client.seen
    );
    assert_eq!(ok + timed_out, 30, "{:?}", client.seen);

    let netns = Node::inode(&n.node);
    let facts: Vec<&Value> = trace
        .of_type("stale_endpoint")
        .into_iter()
        .filter(|e| u(&e["netns"]) == netns)
        .collect();
    for f in &facts {
        eprintln!("fact: {f}");
    }
    let web = facts
        .iter()
        .find(|f| f["service"] == SVC)
        .unwrap_or_else(|| panic!("no window of {SVC}:\n{dump}"));
    let dns = facts
        .iter()
        .find(|f| f["service"] == DNS)
        .unwrap_or_else(|| panic!("no window of {DNS}:\n{dump}"));
    // The TCP Service: every connection DNATed to the dead pod, exactly the client's
    // timeouts: unanswered (a TCP conntrack entry that never saw a reply), or, when the
    // neighbour failed before the client gave up on a retransmitted SYN, refused too.
    assert_eq!(u(&web["connections"]), timed_out, "{web}");
    assert!(u(&web["outcomes"]["unanswered"]) >= 1, "{web}");
    assert!(
        web["conntrack"].is_null(),
        "failed and closed connections are not flows: {web}"
    );
    assert_eq!(web["fix"]["agent"], "kube-proxy", "{web}");
    let stale = u(&web["stale_ns"]);
    let (lo, hi) = (spawned - del_end, exited - del_start);
    assert!(
        stale + 100_000_000 >= lo && stale <= hi + 100_000_000,
        "stale {stale} ns, truth between {lo} and {hi}: {web}"
    );
    // The UDP Service: conntrack still steers its flow to the dead pod after the fix, as
    // the conntrack tool says.
    assert_eq!(udp_entries, 1, "the conntrack tool's count");
    let ct = &dns["conntrack"];
    assert_eq!((u(&ct["entries"]), u(&ct["udp"])), (1, 1), "{dns}");
    assert!(u(&ct["packets"]) > 10, "packets kept following it: {dns}");
}

/// A new pod, calico-style: a namespace with a veth whose node end has no address, and the
/// node's host route to the pod's IP through it, added at a time the script notes. kube-proxy
/// routes the web Service to it 1.2 s later, its restore waiting behind calico-node's hold
/// of the xtables lock (legacy) or on its own delay (nf_tables). xtlock says how long from
/// the route to the write that first routed to it, and who was late: the script's clock is
/// the truth, within 10 % (or 100 ms).
#[test]
fn a_new_pods_programming_latency_is_measured() {
    if !require_bpf("a_new_pods_programming_latency_is_measured") {
        return;
    }
    let _g = serial();
    for (b, prefix) in [(Backend::Legacy, "xtpl"), (Backend::Nft, "xtpk")] {
        programming_latency(b, prefix);
    }
}

/// kube-proxy's restore of `rules` in `node`; with the legacy backend while calico-node
/// holds the xtables lock for `hold_ms`. Returns the earliest its write could come
/// (calico's release, else the restore's start) and the restore's exit time.
fn restore_behind_calico(
    s: &Scratch,
    node: &str,
    lock: &Path,
    rules: &Path,
    b: Backend,
    hold_ms: &str,
) -> (u64, u64) {
    let mut calico = (b == Backend::Legacy).then(|| {
        let mut c = Agent::spawn(
            &s.agent("calico-node"),
            &["hold", lock.to_str().unwrap(), hold_ms],
            &[],
            None,
        );
        c.expect("acquired", T);
        c
    });
    let spawned = xtlock_tests::monotonic_ns();
    let mut restore = kube_proxy(s, node, lock, rules, b);
    assert_eq!(restore.wait_within(T), 0, "{:?}", restore.seen);
    let earliest = match calico.as_mut() {
        Some(c) => c.ts("released", T),
        None => spawned,
    };
    let exited = exit_time(&mut restore);
    if let Some(c) = calico.as_mut() {
        assert_eq!(c.wait(), 0);
    }
    (earliest, exited)
}

fn programming_latency(b: Backend, prefix: &str) {
    const NEW: &str = "10.244.3.7";
    let s = Scratch::new(&format!("stale-endpoints-{prefix}"));
    let lock = s.lock_file("xtables.lock");
    let n = Node::new(prefix, true);
    let pod = format!("{prefix}-p3");
    let _ = Command::new("ip")
        .args(["netns", "del", &pod])
        .stderr(std::process::Stdio::null())
        .status();
    sh("ip", &["netns", "add", &pod]);
    struct Del(String);
    impl Drop for Del {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let _del = Del(pod.clone());
    let capture = s.dir.join("new.xtlock");
    let tracer = n.tracer(&lock, Some(&capture));
    let before = s.dir.join("before.rules");
    let after = s.dir.join("after.rules");
    if b == Backend::Nft {
        std::fs::write(&before, kube_proxy_nft(&[LIVE])).unwrap();
        std::fs::write(&after, kube_proxy_nft(&[LIVE, NEW])).unwrap();
    } else {
        std::fs::write(&before, kube_proxy_nat(&[LIVE])).unwrap();
        std::fs::write(&after, kube_proxy_nat(&[LIVE, NEW])).unwrap();
    }
    let mut first = kube_proxy(&s, &n.node, &lock, &before, b);
    assert_eq!(first.wait_within(T), 0, "{:?}", first.seen);
    std::thread::sleep(Duration::from_millis(500));

    // The CNI ADD: the veth, the pod's address, the node's host route to it.
    sh(
        "ip",
        &[
            "-n", &n.node, "link", "add", "calinew", "type", "veth", "peer", "name", "eth0",
            "netns", &pod,
        ],
    );
    sh("ip", &["-n", &n.node, "link", "set", "calinew", "up"]);
    sh(
        "ip",
        &[
            "-n",
            &pod,
            "addr",
            "add",
            &format!("{NEW}/32"),
            "dev",
            "eth0",
        ],
    );
    sh("ip", &["-n", &pod, "link", "set", "eth0", "up"]);
    let up_start = xtlock_tests::monotonic_ns();
    sh(
        "ip",
        &[
            "-n",
            &n.node,
            "route",
            "add",
            &format!("{NEW}/32"),
            "dev",
            "calinew",
        ],
    );
    let up_end = xtlock_tests::monotonic_ns();
    std::thread::sleep(Duration::from_millis(if b == Backend::Legacy {
        100
    } else {
        1200
    }));
    let (earliest, exited) = restore_behind_calico(&s, &n.node, &lock, &after, b, "1100");
    std::thread::sleep(Duration::from_millis(700));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    let netns = Node::inode(&n.node);
    let mine = |events: &[Value]| of_netns(events, "endpoint_programmed", netns);
    let live = mine(&trace.events);
    assert_eq!(
        live.len(),
        1,
        "one new endpoint expected:\n{dump}\nstderr:\n{}",
        trace.stderr
    );
    let f = &live[0];
    eprintln!("{b:?} fact: {f}\ntruth: route added {up_start}..{up_end}, write not before {earliest}, restore exited {exited}");
    assert_eq!(f["service"], SVC, "{f}");
    assert_eq!(f["endpoint"], format!("{NEW}:8080"), "{f}");
    assert_eq!(
        (f["up"].as_str(), f["link"].as_str()),
        (Some("route"), Some("calinew")),
        "{f}"
    );
    assert_kube_proxys_write(&f["write"], b, f);
    let latency = u(&f["latency_ns"]);
    let (lo, hi) = (
        earliest.saturating_sub(up_end),
        exited.saturating_sub(up_start),
    );
    let slack = (hi / 10).max(100_000_000);
    assert!(
        latency + slack >= lo && latency <= hi + slack,
        "latency {latency} ns, truth between {lo} and {hi} ns: {f}"
    );
    // The old endpoint is not new, and the summary counts one.
    let sum = &trace.summary()["services"];
    assert_eq!(u(&sum["programmed"]), 1, "{sum}");
    // `record` + `report` say the same, in words too.
    let replayed = mine(&xtlock_tests::report_events(&capture));
    assert_eq!(replayed, live, "report differs from trace");
    let text = xtlock_tests::report_text(&capture);
    let line = format!("{SVC} first routed to new endpoint {NEW}:8080 ");
    let l = text.lines().find(|l| l.contains(&line));
    assert!(
        l.is_some_and(|l| l.contains("by kube-proxy")),
        "{line}... not in:\n{text}"
    );
    eprintln!("report: {}", l.unwrap_or_default());
}

/// A second node (a namespace routed from the first through a veth) and a pod on it behind
/// its own bridge, as another node of the cluster with its bridge CNI: deleted on drop.
struct OtherNode {
    node: String,
    pod: String,
}

const REMOTE: &str = "10.244.2.5";

impl OtherNode {
    fn new(prefix: &str, first: &Node) -> Self {
        let o = OtherNode {
            node: format!("{prefix}-n2"),
            pod: format!("{prefix}-rp"),
        };
        o.delete();
        let (n2, pod, n1) = (o.node.as_str(), o.pod.as_str(), first.node.as_str());
        for ns in [n2, pod] {
            sh("ip", &["netns", "add", ns]);
            sh("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        sh(
            "ip",
            &[
                "-n", n1, "link", "add", "vn2", "type", "veth", "peer", "name", "eth0", "netns", n2,
            ],
        );
        sh(
            "ip",
            &["-n", n1, "addr", "add", "10.198.0.1/24", "dev", "vn2"],
        );
        sh("ip", &["-n", n1, "link", "set", "vn2", "up"]);
        sh(
            "ip",
            &[
                "-n",
                n1,
                "route",
                "add",
                "10.244.2.0/24",
                "via",
                "10.198.0.2",
            ],
        );
        sh(
            "ip",
            &["-n", n2, "addr", "add", "10.198.0.2/24", "dev", "eth0"],
        );
        sh("ip", &["-n", n2, "link", "set", "eth0", "up"]);
        sh(
            "ip",
            &["-n", n2, "route", "add", "default", "via", "10.198.0.1"],
        );
        sh("ip", &["-n", n2, "link", "add", "br0", "type", "bridge"]);
        sh(
            "ip",
            &["-n", n2, "addr", "add", "10.244.2.1/24", "dev", "br0"],
        );
        sh("ip", &["-n", n2, "link", "set", "br0", "up"]);
        sh(
            "ip",
            &[
                "-n", n2, "link", "add", "vethr", "type", "veth", "peer", "name", "eth0", "netns",
                pod,
            ],
        );
        sh(
            "ip",
            &["-n", n2, "link", "set", "vethr", "master", "br0", "up"],
        );
        sh(
            "ip",
            &[
                "-n",
                pod,
                "addr",
                "add",
                &format!("{REMOTE}/24"),
                "dev",
                "eth0",
            ],
        );
        sh("ip", &["-n", pod, "link", "set", "eth0", "up"]);
        sh(
            "ip",
            &["-n", pod, "route", "add", "default", "via", "10.244.2.1"],
        );
        sh(
            "ip",
            &[
                "netns",
                "exec",
                n2,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ],
        );
        o
    }

    fn delete(&self) {
        for ns in [&self.node, &self.pod] {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

impl Drop for OtherNode {
    fn drop(&mut self) {
        self.delete();
    }
}

/// A pod on another node dies (its CNI DEL there): nothing vanishes from this node, whose
/// kube-proxy keeps routing the web Service to it until its restore a few seconds later. The
/// connections DNATed to it go unanswered, which conntrack shows: the endpoint is said dead
/// as it goes quiet, and its window says exactly the client's timed-out connections and
/// kube-proxy's fix. The client's own results and the script's clock are the truth; the
/// window's start is when a conntrack scan (every second) first saw its first unanswered
/// connection, so it is late by up to a second after that connection began.
#[test]
fn an_endpoint_on_another_node_that_stops_answering_is_said() {
    if !require_bpf("an_endpoint_on_another_node_that_stops_answering_is_said") {
        return;
    }
    let _g = serial();
    let prefix = "xtsr";
    let s = Scratch::new("stale-endpoints-remote");
    let lock = s.lock_file("xtables.lock");
    let n = Node::new(prefix, false);
    let other = OtherNode::new(prefix, &n);
    let capture = s.dir.join("remote.xtlock");
    let tracer = n.tracer(&lock, Some(&capture));
    let mut pods = n.serve(&s, &[&["tcplisten", "8080"]]);
    let mut remote = helper_in(&s, &other.pod, "web", &["tcplisten", "8080"]);
    remote.expect("listening", T);
    pods.push(remote);
    let both = s.dir.join("both.rules");
    std::fs::write(&both, kube_proxy_nat(&[REMOTE, LIVE])).unwrap();
    let one = s.dir.join("one.rules");
    std::fs::write(&one, kube_proxy_nat(&[LIVE])).unwrap();
    let mut first = kube_proxy(&s, &n.node, &lock, &both, Backend::Legacy);
    assert_eq!(first.wait_within(T), 0, "{:?}", first.seen);
    // 80 connects, one every 100 ms, each given 1 s.
    let mut client = n.connects(&s, "80", "100", "1000");
    std::thread::sleep(Duration::from_millis(800));
    let del_start = xtlock_tests::monotonic_ns();
    sh("ip", &["-n", &other.pod, "link", "del", "eth0"]);
    // Said dead after two connections went 2 s unanswered and the next scan saw no answer;
    // kube-proxy learns it later.
    std::thread::sleep(Duration::from_millis(6000));
    let spawned = xtlock_tests::monotonic_ns();
    let mut restore = kube_proxy(&s, &n.node, &lock, &one, Backend::Legacy);
    assert_eq!(restore.wait_within(T), 0, "{:?}", restore.seen);
    let exited = exit_time(&mut restore);
    client.expect("done", T);
    // Past the report (5 s after the fix).
    std::thread::sleep(Duration::from_millis(5600));
    stop(pods);
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    let results = client_results(&client);
    assert_eq!(results.len(), 80, "{:?}", client.seen);
    let failed = results.iter().filter(|r| **r != "ok").count() as u64;
    eprintln!("client: {failed} of 80 failed: {results:?}");
    assert!(
        failed >= 2,
        "too few connections DNATed to the dead pod: {:?}",
        client.seen
    );

    let netns = Node::inode(&n.node);
    let facts = of_netns(&trace.events, "stale_endpoint", netns);
    let f = facts
        .iter()
        .find(|f| f["endpoint"] == format!("{REMOTE}:8080"))
        .unwrap_or_else(|| panic!("no window of the remote pod:\n{dump}"));
    eprintln!("fact: {f}");
    assert_eq!(
        (&f["service"], &f["gone"]),
        (&SVC.into(), &"unanswered".into()),
        "{f}"
    );
    // Exactly the client's failed connections, each unanswered.
    assert_eq!(u(&f["connections"]), failed, "{f}");
    assert_eq!(u(&f["outcomes"]["unanswered"]), failed, "{f}");
    assert_eq!(f["fix"]["agent"], "kube-proxy", "{f}");
    assert_eq!(f["still_routed"], false, "{f}");
    // Dead since the first connection that failed, as a scan saw it.
    let first_failed: u64 = client
        .seen
        .iter()
        .filter(|l| l.starts_with("conn ") && !l.ends_with(" ok"))
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .min()
        .expect("a failed connection's start");
    assert!(
        first_failed + 100_000_000 >= del_start,
        "failed before the pod went"
    );
    let since = u(&f["ts_ns"]);
    let late = 100_000_000 + CT_SCAN_NS;
    assert!(
        since + 100_000_000 >= first_failed && since <= first_failed + late,
        "dead since {since}, the first failed connection at {first_failed}: {f}"
    );
    let stale = u(&f["stale_ns"]);
    let (lo, hi) = (
        spawned.saturating_sub(first_failed + late),
        exited - first_failed,
    );
    assert!(
        stale + 100_000_000 >= lo && stale <= hi + 100_000_000,
        "stale {stale} ns, truth between {lo} and {hi}: {f}"
    );
    // Said as it went quiet, before the fix and the close.
    let opens = of_netns(&trace.events, "stale_endpoint_open", netns);
    assert_eq!(opens.len(), 1, "one opening:\n{dump}");
    assert_eq!(opens[0]["gone"], "unanswered", "{}", opens[0]);
    assert_eq!(u(&opens[0]["gone_ns"]), since, "{}", opens[0]);
    let pos = |e: &Value| trace.events.iter().position(|x| x == e);
    assert!(
        pos(&opens[0]) < pos(f),
        "the opening comes before the close"
    );
    // `record` + `report` say the same (the unanswered endpoint is its own record kind).
    let report = xtlock_tests::report_events(&capture);
    assert_eq!(
        of_netns(&report, "stale_endpoint", netns),
        facts,
        "report differs"
    );
    assert_eq!(of_netns(&report, "stale_endpoint_open", netns), opens);
    let text = Command::new(xtlock_bin())
        .args(["report", "--events"])
        .arg(&capture)
        .output()
        .expect("xtlock report");
    let text = String::from_utf8_lossy(&text.stdout);
    for l in text.lines().filter(|l| l.contains(REMOTE)) {
        eprintln!("report: {l}");
    }
    let head = format!("!! {SVC} routed to {REMOTE}:8080 for ");
    let counted = format!(": {failed} connections unanswered");
    assert!(
        text.lines().any(|l| l.contains(&head)
            && l.contains("after it stopped answering")
            && l.contains(&counted)),
        "{text}"
    );
    // The live pod was never said dead.
    assert!(
        facts
            .iter()
            .all(|f| f["endpoint"] != format!("{LIVE}:8080")),
        "{dump}"
    );
}

/// How often xtlock scans conntrack for unanswered connections (its source's PERIOD).
const CT_SCAN_NS: u64 = 1_000_000_000;

/// An endpoint that answers some clients is not dead: a policy on the other node drops one
/// client's connections to it (as a NetworkPolicy would) while the node's own connections to
/// the same Service are answered. The dropped client's connections go unanswered, but no
/// window opens: an alarm here would teach users to ignore the real ones.
#[test]
fn an_endpoint_that_answers_other_clients_is_not_said_dead() {
    if !require_bpf("an_endpoint_that_answers_other_clients_is_not_said_dead") {
        return;
    }
    let _g = serial();
    let prefix = "xtsp";
    let s = Scratch::new("stale-endpoints-policy");
    let lock = s.lock_file("xtables.lock");
    let n = Node::new(prefix, false);
    let other = OtherNode::new(prefix, &n);
    let tracer = n.tracer(&lock, None);
    let mut remote = helper_in(&s, &other.pod, "web", &["tcplisten", "8080"]);
    remote.expect("listening", T);
    let rules = s.dir.join("remote.rules");
    std::fs::write(&rules, kube_proxy_nat(&[REMOTE])).unwrap();
    let mut kp = kube_proxy(&s, &n.node, &lock, &rules, Backend::Legacy);
    assert_eq!(kp.wait_within(T), 0, "{:?}", kp.seen);
    // The node's own connections to the cluster IP need a route out before their DNAT.
    sh(
        "ip",
        &[
            "-n",
            &n.node,
            "route",
            "add",
            "default",
            "via",
            "10.198.0.2",
        ],
    );
    // The other node drops the client's packets to the pod; the node's own get through.
    sh(
        "ip",
        &[
            "netns",
            "exec",
            &other.node,
            "iptables-legacy",
            "-A",
            "FORWARD",
            "-s",
            "10.199.0.2",
            "-d",
            REMOTE,
            "-j",
            "DROP",
        ],
    );
    // 40 connects each, 200 ms apart, each given 1 s: the client's all go unanswered.
    let mut client = n.connects(&s, "40", "200", "1000");
    let args = ["connects", "10.96.0.10", "80", "40", "200", "1000"];
    let mut local = helper_in(&s, &n.node, "probe", &args);
    client.expect("done", T);
    local.expect("done", T);
    remote.child.kill().ok();
    remote.child.wait().ok();
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    let failed = client_results(&client)
        .iter()
        .filter(|r| **r != "ok")
        .count();
    let answered = client_results(&local)
        .iter()
        .filter(|r| **r == "ok")
        .count();
    eprintln!("client: {failed} of 40 unanswered; node: {answered} of 40 answered");
    assert_eq!(
        failed, 40,
        "the policy drops every client connection: {:?}",
        client.seen
    );
    assert_eq!(
        answered, 40,
        "the node's own are answered: {:?}",
        local.seen
    );
    let netns = Node::inode(&n.node);
    for kind in ["stale_endpoint_open", "stale_endpoint"] {
        assert!(
            of_netns(&trace.events, kind, netns).is_empty(),
            "an endpoint answering others is said dead ({kind}):\n{dump}"
        );
    }
}
