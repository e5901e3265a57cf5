//! Packet drops against the real kernel: real UDP traffic between two network namespaces
//! joined by a veth pair, real iptables-legacy rules and a real conntrack table, and the real
//! `xtlock trace --json`. Every namespace, rule and sysctl a test makes is removed or
//! restored by a guard, also when the test fails.

use std::time::Duration;

use serde_json::Value;
use xtlock_tests::{
    conntrack_stat, hook_status, iptables_packets, require_bpf, send_udp, serial, Agent, NetnsPair,
    Scratch, Sysctl, Tracer,
};

const T: Duration = Duration::from_secs(30);

fn u(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not an unsigned number: {v}"))
}

/// Sum of `count` over `drop_count` objects of `netns` matching `pred`.
fn counted(trace: &xtlock_tests::Trace, netns: u64, pred: impl Fn(&Value) -> bool) -> u64 {
    trace
        .of_type("drop_count")
        .into_iter()
        .filter(|d| u(&d["netns"]) == netns && pred(d))
        .map(|d| u(&d["count"]))
        .sum()
}

fn samples(trace: &xtlock_tests::Trace, netns: u64) -> Vec<&Value> {
    trace
        .of_type("drop")
        .into_iter()
        .filter(|d| u(&d["netns"]) == netns)
        .collect()
}

/// A `-j DROP` rule for UDP to `port` in namespace `ns`, put in under `lock` (not the
/// watched one, which a test may hold).
fn drop_rule(ns: &str, port: u16, lock: &std::path::Path) {
    let ok = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "iptables-legacy", "-w", "-A", "INPUT"])
        .args(["-p", "udp", "--dport", &port.to_string(), "-j", "DROP"])
        .env("XTABLES_LOCKFILE", lock)
        .status()
        .unwrap();
    assert!(ok.success());
}

/// A DROP rule for one port: xtlock's count equals the rule's packet counter, and packets to
/// another port (no listener: NO_SOCKET, not a watched reason here) are not counted.
/// The drop hook on `tp_btf` (its first choice where the kernel has BTF) and on the perf
/// tracepoint (its fallback): the same exact counts, netns and samples either way.
#[test]
fn rule_drop_counts_match_the_rule_counter() {
    if !require_bpf("rule_drop_counts_match_the_rule_counter") {
        return;
    }
    let raw = hook_status("kfree_skb", &[]);
    if std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        assert!(
            raw["attach"]
                .as_str()
                .is_some_and(|a| a.starts_with("tp_btf")),
            "with kernel BTF the drop hook is a tp_btf program: {raw}"
        );
    }
    let tp = hook_status("kfree_skb", &["--no-attach", "tp_btf"]);
    assert!(
        tp["attach"]
            .as_str()
            .is_some_and(|a| a.starts_with("tracepoint")),
        "{tp}"
    );
    rule_drops_counted(&[]);
    rule_drops_counted(&["--no-attach", "tp_btf"]);
}

fn rule_drops_counted(extra: &[&str]) {
    let _g = serial();
    let s = Scratch::new("drops-rule");
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new("xtd-rule", 201);
    NetnsPair::exec(
        &ns.b,
        "iptables-legacy",
        &[
            "-w", "-A", "INPUT", "-p", "udp", "--dport", "9999", "-j", "DROP",
        ],
    );
    let b_path = NetnsPair::path(&ns.b);
    let mut args = vec![
        "--netns",
        b_path.as_str(),
        "--drop-reasons",
        "NETFILTER_DROP",
    ];
    args.extend_from_slice(extra);
    let tracer = Tracer::start(&[&lock], Duration::from_secs(5), &args);
    let sent = send_udp(&s, &ns.a, &ns.addr_b, 9999, 500, 1);
    send_udp(&s, &ns.a, &ns.addr_b, 9998, 300, 1);
    let trace = tracer.finish();
    let inode = NetnsPair::inode(&ns.b);
    let rule = iptables_packets(&ns.b, "INPUT", "dpt:9999");
    assert_eq!(sent, 500);
    assert_eq!(rule, 500, "the rule should have seen every datagram");
    let nf = counted(&trace, inode, |d| d["reason"] == "NETFILTER_DROP");
    assert_eq!(
        nf,
        rule,
        "xtlock's count vs the rule's counter\n{}",
        trace.dump()
    );
    let rule_class = counted(&trace, inode, |d| d["class"] == "netfilter_rule_drop");
    assert_eq!(rule_class, rule, "all of them are rule drops");
    // The other port's packets were freed as NO_SOCKET, which was not asked for.
    assert_eq!(
        counted(&trace, inode, |d| d["reason"] != "NETFILTER_DROP"),
        0
    );
    // Samples carry the packet.
    let smp = samples(&trace, inode);
    assert!(!smp.is_empty(), "no samples\n{}", trace.dump());
    for d in &smp {
        let p = &d["packet"];
        assert_eq!(p["proto"], "udp", "{d}");
        assert_eq!(p["saddr"], ns.addr_a.as_str(), "{d}");
        assert_eq!(p["daddr"], ns.addr_b.as_str(), "{d}");
        assert_eq!(u(&p["dport"]), 9999, "{d}");
        assert!(
            d["location"].as_str().unwrap().starts_with("nf_hook_slow"),
            "{d}"
        );
    }
    let summary = trace.summary();
    assert_eq!(u(&summary["drops"]["by_netns"][inode.to_string()]), rule);
    assert_eq!(
        u(&summary["drops"]["by_class"]["netfilter_rule_drop"]),
        rule
    );
}

/// `nf_conntrack_max` lowered, a few hundred UDP flows: xtlock's "conntrack table full"
/// count equals the delta of `conntrack -S` drop, and its samples carry the flows' addresses.
#[test]
fn conntrack_table_full_matches_conntrack_stats() {
    if !require_bpf("conntrack_table_full_matches_conntrack_stats") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("drops-ct");
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new("xtd-ct", 202);
    NetnsPair::conntrack_on(&ns.b);
    let b_path = NetnsPair::path(&ns.b);
    let before = conntrack_stat(&ns.b, "drop");
    // The kernel log's newest time: the ring holds a fixed number of bytes, so on a node up
    // for long its line count stops growing, and the lines after the start are told by time.
    let dmesg_before = dmesg_time(xtlock_tests::sh("dmesg", &[]).lines().last().unwrap_or(""));
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(5),
        &["--netns", &b_path, "--drop-reasons", "NETFILTER_DROP"],
    );
    {
        // Restored before the namespace goes, whatever happens.
        let _max = Sysctl::set("/proc/sys/net/netfilter/nf_conntrack_max", "64");
        send_udp(&s, &ns.a, &ns.addr_b, 7777, 400, 400);
        // Long enough for a once-a-second read to see the full table.
        std::thread::sleep(Duration::from_millis(1500));
    }
    let trace = tracer.finish();
    let after = conntrack_stat(&ns.b, "drop");
    let inode = NetnsPair::inode(&ns.b);
    let ct_drops = after - before;
    assert!(
        ct_drops >= 100,
        "conntrack dropped only {ct_drops} of 400 flows"
    );
    let full = counted(&trace, inode, |d| d["class"] == "conntrack_table_full");
    assert_eq!(
        full,
        ct_drops,
        "xtlock vs conntrack -S drop\n{}",
        trace.dump()
    );
    // Conntrack's own view, per interval.
    let ct_seen: u64 = trace
        .of_type("conntrack")
        .into_iter()
        .filter(|c| u(&c["netns"]) == inode)
        .map(|c| u(&c["drop"]))
        .sum();
    assert_eq!(ct_seen, ct_drops);
    assert!(trace
        .of_type("conntrack")
        .iter()
        .any(|c| c["warning"].as_str().is_some_and(|w| w.contains("full"))));
    let smp: Vec<&Value> = samples(&trace, inode)
        .into_iter()
        .filter(|d| d["class"] == "conntrack_table_full")
        .collect();
    assert!(!smp.is_empty(), "no table-full samples\n{}", trace.dump());
    for d in &smp {
        assert_eq!(d["packet"]["saddr"], ns.addr_a.as_str(), "{d}");
        assert_eq!(d["packet"]["daddr"], ns.addr_b.as_str(), "{d}");
        assert_eq!(u(&d["packet"]["dport"]), 7777, "{d}");
    }
    // The kernel said so too (rate limited, so at least once).
    let dmesg = xtlock_tests::sh("dmesg", &[]);
    assert!(
        dmesg
            .lines()
            .filter(|l| dmesg_time(l) > dmesg_before)
            .any(|l| l.contains("nf_conntrack: table full")),
        "no `table full` message from the kernel"
    );
    assert_eq!(
        u(&trace.summary()["drops"]["by_class"]["conntrack_table_full"]),
        ct_drops
    );
}

/// A flood 100 times over the sample budget: counts stay exact, samples stay under the
/// limit, and no events are lost.
#[test]
fn drop_storm_counts_stay_exact_samples_capped() {
    if !require_bpf("drop_storm_counts_stay_exact_samples_capped") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("drops-storm");
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new("xtd-storm", 203);
    NetnsPair::exec(
        &ns.b,
        "iptables-legacy",
        &[
            "-w", "-A", "INPUT", "-p", "udp", "--dport", "9999", "-j", "DROP",
        ],
    );
    let b_path = NetnsPair::path(&ns.b);
    let secs = 5u64;
    let rate = 10u64;
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(secs),
        &[
            "--netns",
            &b_path,
            "--drop-reasons",
            "NETFILTER_DROP",
            "--drop-samples",
            "10/s",
        ],
    );
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    // Burst plus steady rate, per CPU, for the whole trace.
    let cap = rate * (secs + 2) * cpus;
    let n = 200_000u64;
    assert!(
        n >= 100 * cap,
        "the flood must exceed the sample budget 100 times"
    );
    let t0 = std::time::Instant::now();
    send_udp(&s, &ns.a, &ns.addr_b, 9999, n, 4);
    let took = t0.elapsed();
    let trace = tracer.finish();
    let inode = NetnsPair::inode(&ns.b);
    let rule = iptables_packets(&ns.b, "INPUT", "dpt:9999");
    let nf = counted(&trace, inode, |d| d["reason"] == "NETFILTER_DROP");
    eprintln!(
        "storm: {rule} drops in {took:?} ({:.0}/s), counted {nf}, {} samples (cap {cap})",
        rule as f64 / took.as_secs_f64(),
        samples(&trace, inode).len()
    );
    assert_eq!(nf, rule, "counts must stay exact");
    let smp = samples(&trace, inode).len() as u64;
    assert!(smp > 0 && smp <= cap, "{smp} samples, cap {cap}");
    assert_eq!(u(&trace.summary()["lost_events"]), 0, "no lost-event storm");
    assert!(trace.of_type("lost").is_empty());
}

/// A drop rule inserted while a test process holds the lock: the drops are reported inside
/// that hold.
#[test]
fn drops_during_a_hold_are_reported_with_the_hold() {
    if !require_bpf("drops_during_a_hold_are_reported_with_the_hold") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("drops-hold");
    let lock = s.lock_file("xtables.lock");
    let other_lock = s.lock_file("other.lock");
    let lock_s = lock.to_str().unwrap();
    let ns = NetnsPair::new("xtd-hold", 204);
    let b_path = NetnsPair::path(&ns.b);
    // Only the rule's reason: other drops on the node (NOT_SPECIFIED, ...) while the hold
    // goes on would count for it too, rightly, but not exactly predictably.
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(9),
        &["--netns", &b_path, "--drop-reasons", "NETFILTER_DROP"],
    );
    // Quiet second before, so no interval overlaps both the hold and earlier traffic.
    std::thread::sleep(Duration::from_millis(1500));
    let kube_proxy = s.agent("kube-proxy");
    let mut kp = Agent::spawn(&kube_proxy, &["hold", lock_s, "3000"], &[], None);
    kp.ts("acquired", T);
    // The rule goes in through another lock file (the watched one is held).
    drop_rule(&ns.b, 5555, &other_lock);
    std::thread::sleep(Duration::from_millis(200));
    send_udp(&s, &ns.a, &ns.addr_b, 5555, 321, 1);
    kp.ts("released", T);
    assert_eq!(kp.wait(), 0);
    let trace = tracer.finish();
    let rule = iptables_packets(&ns.b, "INPUT", "dpt:5555");
    assert_eq!(rule, 321);
    let hd = trace.of_type("hold_drops");
    let mine: Vec<&&Value> = hd.iter().filter(|h| h["agent"] == "kube-proxy").collect();
    assert_eq!(mine.len(), 1, "one hold with drops\n{}", trace.dump());
    let h = mine[0];
    assert_eq!(h["lock"], lock_s);
    // Counted in the kernel while the hold went on: exact.
    assert_eq!(u(&h["dropped"]), rule, "{h}");
    assert!(u(&h["samples"]) > 0, "{h}");
    // What they were: counted by reason in the kernel, exact.
    assert_eq!(u(&h["by_class"]["netfilter_rule_drop"]), rule, "{h}");
    // Every drop count of that rule names the hold.
    let inode = NetnsPair::inode(&ns.b);
    for d in trace.of_type("drop_count") {
        if u(&d["netns"]) == inode && d["reason"] == "NETFILTER_DROP" {
            assert_eq!(d["holds"][0]["agent"], "kube-proxy", "{d}");
        }
    }
    for d in samples(&trace, inode) {
        if d["reason"] == "NETFILTER_DROP" {
            assert_eq!(d["hold"]["agent"], "kube-proxy", "{d}");
        }
    }
    assert_eq!(u(&trace.summary()["drops"]["during_holds"]), rule);
}

/// Drops sent between two holds belong to neither; drops sent inside a hold all belong to
/// it, exactly, although the three happen within the same couple of seconds (per-second
/// counts cannot tell them apart; the kernel's per-hold counter can).
#[test]
fn drops_between_holds_belong_to_neither() {
    if !require_bpf("drops_between_holds_belong_to_neither") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("drops-between");
    let lock = s.lock_file("xtables.lock");
    let other_lock = s.lock_file("other.lock");
    let lock_s = lock.to_str().unwrap();
    let ns = NetnsPair::new("xtd-betw", 205);
    drop_rule(&ns.b, 5556, &other_lock);
    let b_path = NetnsPair::path(&ns.b);
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(8),
        &["--netns", &b_path, "--drop-reasons", "NETFILTER_DROP"],
    );
    std::thread::sleep(Duration::from_millis(1000));
    let mut kp = Agent::spawn(&s.agent("kube-proxy"), &["hold", lock_s, "800"], &[], None);
    kp.ts("acquired", T);
    let inside = send_udp(&s, &ns.a, &ns.addr_b, 5556, 50, 1);
    kp.ts("released", T);
    assert_eq!(kp.wait(), 0);
    let between = send_udp(&s, &ns.a, &ns.addr_b, 5556, 70, 1);
    let mut cn = Agent::spawn(&s.agent("calico-node"), &["hold", lock_s, "800"], &[], None);
    cn.ts("acquired", T);
    cn.ts("released", T);
    assert_eq!(cn.wait(), 0);
    let trace = tracer.finish();
    assert_eq!((inside, between), (50, 70));
    let inode = NetnsPair::inode(&ns.b);
    assert_eq!(iptables_packets(&ns.b, "INPUT", "dpt:5556"), 120);
    assert_eq!(
        counted(&trace, inode, |d| d["reason"] == "NETFILTER_DROP"),
        120,
        "{}",
        trace.dump()
    );
    let hd = trace.of_type("hold_drops");
    let of = |agent: &str| -> Vec<u64> {
        hd.iter()
            .filter(|h| h["agent"] == agent)
            .map(|h| u(&h["dropped"]))
            .collect()
    };
    assert_eq!(of("kube-proxy"), [50], "{}", trace.dump());
    assert!(of("calico-node").is_empty(), "{}", trace.dump());
    assert_eq!(u(&trace.summary()["drops"]["during_holds"]), 50);
}

/// More drops of one reason inside a hold than the sample budget lets through: the hold's
/// drops by reason are the kernel's exact count, equal to the DROP rule's own packet counter,
/// not the number of samples.
#[test]
fn a_holds_drops_by_reason_are_exact_past_the_sample_budget() {
    if !require_bpf("a_holds_drops_by_reason_are_exact_past_the_sample_budget") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("drops-reasons");
    let lock = s.lock_file("xtables.lock");
    let other_lock = s.lock_file("other.lock");
    let lock_s = lock.to_str().unwrap();
    let ns = NetnsPair::new("xtd-reas", 206);
    drop_rule(&ns.b, 5557, &other_lock);
    let b_path = NetnsPair::path(&ns.b);
    // 5 samples a second per CPU: far fewer than the 250 drops.
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(7),
        &[
            "--netns",
            &b_path,
            "--drop-reasons",
            "NETFILTER_DROP",
            "--drop-samples",
            "5/s",
        ],
    );
    std::thread::sleep(Duration::from_millis(1000));
    let mut kp = Agent::spawn(&s.agent("kube-proxy"), &["hold", lock_s, "1500"], &[], None);
    kp.ts("acquired", T);
    let sent = send_udp(&s, &ns.a, &ns.addr_b, 5557, 250, 5);
    kp.ts("released", T);
    assert_eq!(kp.wait(), 0);
    let trace = tracer.finish();
    assert_eq!(sent, 250);
    let truth = iptables_packets(&ns.b, "INPUT", "dpt:5557");
    assert_eq!(truth, 250, "the rule saw every datagram");
    let hd = trace.of_type("hold_drops");
    let mine: Vec<&&Value> = hd.iter().filter(|h| h["agent"] == "kube-proxy").collect();
    assert_eq!(mine.len(), 1, "{}", trace.dump());
    let h = mine[0];
    assert!(u(&h["samples"]) < truth / 2, "the budget must bind: {h}");
    assert_eq!(u(&h["dropped"]), truth, "{h}");
    assert_eq!(u(&h["by_reason"]["NETFILTER_DROP"]), truth, "{h}");
    assert_eq!(h["exact_reasons"], true, "{h}");
    let classes: u64 = h["by_class"].as_object().unwrap().values().map(u).sum();
    assert_eq!(classes, truth, "{h}");
}

/// A reason this kernel does not have is refused, saying what to do.
#[test]
fn unknown_reason_is_a_clear_error() {
    if !require_bpf("unknown_reason_is_a_clear_error") {
        return;
    }
    let _g = serial();
    let out = std::process::Command::new(xtlock_tests::xtlock_bin())
        .args([
            "trace",
            "--duration",
            "1s",
            "--drop-reasons",
            "NETFILTER_DROP,NOT_A_REASON",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("NOT_A_REASON") && err.contains("does not exist on this kernel"),
        "{err}"
    );
    let out = std::process::Command::new(xtlock_tests::xtlock_bin())
        .args([
            "trace",
            "--duration",
            "1s",
            "--netns",
            "/run/netns/xtlock-no-such-ns",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/run/netns/xtlock-no-such-ns") && err.contains("/run/netns/NAME"),
        "{err}"
    );
}

/// The time of a `dmesg` line (`[49533.732164] ...`), in microseconds; 0 when it has none.
fn dmesg_time(line: &str) -> u64 {
    line.trim_start()
        .strip_prefix('[')
        .and_then(|r| r.split_once(']'))
        .and_then(|(t, _)| {
            let (s, us) = t.trim().split_once('.')?;
            Some(s.parse::<u64>().ok()? * 1_000_000 + us.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}
