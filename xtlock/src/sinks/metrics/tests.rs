use super::*;
use crate::analysis::Who;
use crate::analysis::{HoldFact, HolderRef, WaitFact, WaitMode, WaitOutcome};
use crate::shared::SharedStr;

fn hold(agent: &str, ns: u64) -> Output {
    Output::Hold(HoldFact {
        lock: "/run/xtables.lock".into(),
        pid: 10,
        tid: 10,
        who: Who {
            comm: agent.into(),
            agent: agent.into(),
            role: "proxy",
            cmdline: SharedStr::empty(),
            agent_pid: 10,
            pod_uid: None,
            container_id: None,
            pod: None,
        },
        start_ns: 1,
        hold_ns: ns,
        owner: 0,
        exclusive: true,
        kernel_ns: 0,
        replaces: 0,
        read_ns: 0,
        reads: 0,
        tables: Vec::new(),
        swap_ns: 0,
        before_start: false,
        released_by: None,
        open: false,
        incomplete: false,
        nft: None,
    })
}

/// A holder in a pod gets its namespace and workload as labels; past the cap, `(other)`.
#[test]
fn pod_labels_are_the_workload_and_capped() {
    let m = Arc::new(Metrics::new("k"));
    let mut s = MetricsSink::new(m.clone(), None);
    let in_pod = |pod: &str| {
        let Output::Hold(mut h) = hold("kube-proxy", 1_000) else {
            unreachable!()
        };
        h.who.pod = Some(Arc::new(crate::kube::PodName {
            namespace: "kube-system".into(),
            pod: pod.into(),
            container: "kube-proxy".into(),
        }));
        Output::Hold(h)
    };
    s.output(&in_pod("kube-proxy-x7k2p")).unwrap();
    s.output(&in_pod("kube-proxy-q8w4z")).unwrap();
    let text = m.encode().unwrap();
    assert!(
        text.contains("xtlock_lock_hold_seconds_count{lock=\"/run/xtables.lock\",agent=\"kube-proxy\",role=\"proxy\",namespace=\"kube-system\",pod=\"kube-proxy\"} 2"),
        "{text}"
    );
    // Outside a pod: no pod labels at all.
    s.output(&hold("kube-proxy", 1_000)).unwrap();
    let text = m.encode().unwrap();
    assert!(
        text.contains("xtlock_lock_hold_seconds_count{lock=\"/run/xtables.lock\",agent=\"kube-proxy\",role=\"proxy\"} 1"),
        "{text}"
    );
    for i in 0..MAX_PODS + 5 {
        s.output(&in_pod(&format!("w{i}-bbbbb"))).unwrap();
    }
    let text = m.encode().unwrap();
    assert!(
        text.contains("namespace=\"(other)\",pod=\"(other)\"} 6"),
        "{text}"
    );
}

/// nf_tables commits add their batches' changes per agent, kind and direction.
#[test]
fn nft_changes_per_agent_and_kind() {
    let m = Arc::new(Metrics::new("k"));
    let mut s = MetricsSink::new(m.clone(), None);
    for _ in 0..2 {
        let Output::Hold(mut h) = hold("firewalld", 1_000) else {
            unreachable!()
        };
        h.lock = "nf_tables commit (netns 1)".into();
        h.nft = Some(crate::event::NftBatch {
            status: "complete",
            added: [0, 0, 300, 0, 0, 0, 0, 0],
            deleted: [0, 0, 2, 0, 0, 0, 0, 0],
        });
        s.output(&Output::Hold(h)).unwrap();
    }
    let text = m.encode().unwrap();
    for want in [
        "xtlock_nft_changes_total{agent=\"firewalld\",kind=\"rules\",change=\"added\"} 600",
        "xtlock_nft_changes_total{agent=\"firewalld\",kind=\"rules\",change=\"deleted\"} 4",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
    assert!(!text.contains("kind=\"chains\""), "{text}");
}

#[test]
fn ipvs_counts_and_changes() {
    let m = Arc::new(Metrics::new("6.1.0"));
    let mut s = MetricsSink::new(m.clone(), None);
    let count = |state: &'static str, n: u64| {
        Output::IpvsCount(crate::analysis::IpvsCountFact {
            ts_ns: 1,
            interval_ns: 1,
            protocol: "udp",
            service: "10.96.0.10:53".into(),
            backend: "10.0.1.5:53".into(),
            backend_state: state,
            packets: n,
        })
    };
    s.output(&count("ok", 60)).unwrap();
    s.output(&count("weight_0", 30)).unwrap();
    s.output(&count("removed", 25)).unwrap();
    let text = m.encode().unwrap();
    let l = "protocol=\"udp\",service=\"10.96.0.10:53\",backend=\"10.0.1.5:53\"";
    assert!(
        text.contains(&format!("xtlock_ipvs_packets_total{{{l}}} 90")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "xtlock_ipvs_stale_packets_total{{{l},backend_state=\"removed\"}} 25"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "xtlock_ipvs_stale_packets_total{{{l},backend_state=\"weight_0\"}} 30"
        )),
        "{text}"
    );
}

#[test]
fn holds_and_waits_become_histograms() {
    let m = Arc::new(Metrics::new("6.1.0"));
    let mut s = MetricsSink::new(m.clone(), None);
    s.output(&hold("kube-proxy", 2_000_000_000)).unwrap();
    s.output(&hold("kube-proxy", 50_000)).unwrap();
    s.output(&Output::Wait(WaitFact {
        lock: "/run/xtables.lock".into(),
        pid: 11,
        tid: 11,
        who: Who {
            comm: "iptables".into(),
            agent: "calico-node".into(),
            role: "cni",
            cmdline: SharedStr::empty(),
            agent_pid: 11,
            pod_uid: None,
            container_id: None,
            pod: None,
        },
        start_ns: 1,
        wait_ns: 1_500_000_000,
        holders: vec![
            HolderRef {
                pid: 10,
                agent: "kube-proxy".into(),
                role: "proxy",
                comm: "kube-proxy".into(),
                cmdline: SharedStr::empty(),
                pod: None,
                behind_ns: Some(1_000_000_000),
                from_ns: Some(1),
                waiting: None,
            },
            HolderRef {
                pid: 12,
                agent: "firewalld".into(),
                role: "firewall",
                comm: "iptables".into(),
                cmdline: SharedStr::empty(),
                pod: None,
                behind_ns: Some(500_000_000),
                from_ns: Some(1_000_000_001),
                waiting: None,
            },
        ],
        unknown_ns: 0,
        free_ns: 0,
        other_holders: 0,
        other_holders_ns: 0,
        outcome: WaitOutcome::Acquired,
        mode: WaitMode::Blocking,
        tries: 0,
        ret: None,
        incomplete: false,
    }))
    .unwrap();
    let text = m.encode().unwrap();
    assert!(
        text.contains(
            "xtlock_lock_hold_seconds_count{lock=\"/run/xtables.lock\",agent=\"kube-proxy\",role=\"proxy\"} 2"
        ),
        "{text}"
    );
    assert!(
        text.contains("xtlock_lock_hold_seconds_bucket{le=\"0.0001\",lock=\"/run/xtables.lock\",agent=\"kube-proxy\",role=\"proxy\"} 1")
            || text.contains("le=\"0.0001\""),
        "{text}"
    );
    // The wait's seconds go to each holder agent by the time spent behind it.
    for (holder, secs) in [("kube-proxy", "1.0"), ("firewalld", "0.5")] {
        let l = format!(
            "{{lock=\"/run/xtables.lock\",agent=\"calico-node\",holder_agent=\"{holder}\"}}"
        );
        assert!(
            text.contains(&format!("xtlock_lock_wait_seconds_count{l} 1")),
            "{text}"
        );
        assert!(
            text.contains(&format!("xtlock_lock_wait_seconds_sum{l} {secs}")),
            "{text}"
        );
    }
    assert!(text.contains("xtlock_build_info{version=\""), "{text}");
}

/// The series of `xtlock_lock_hold_seconds` in an exposition.
fn hold_series(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("xtlock_lock_hold_seconds_count{"))
        .count()
}

#[test]
fn agents_are_capped() {
    let m = Arc::new(Metrics::new("k"));
    let mut s = MetricsSink::new(m.clone(), None);
    for i in 0..(MAX_AGENTS + 10) {
        s.output(&hold(&format!("agent{i}"), 1000)).unwrap();
    }
    let text = m.encode().unwrap();
    let series = hold_series(&text);
    assert_eq!(series, MAX_AGENTS + 1, "{text}");
    assert!(text.contains("agent=\"(other)\""), "{text}");
}

/// One nf_tables commit lock per network namespace: the `lock` label is capped too.
#[test]
fn locks_are_capped() {
    let m = Arc::new(Metrics::new("k"));
    let mut s = MetricsSink::new(m.clone(), None);
    for i in 0..(MAX_LOCKS + 10) {
        let mut h = hold("kube-proxy", 1000);
        if let Output::Hold(f) = &mut h {
            f.lock = crate::analysis::nf_tables_lock::nft_commit_lock(4026532000 + i as u32);
        }
        s.output(&h).unwrap();
    }
    let text = m.encode().unwrap();
    let series = hold_series(&text);
    assert_eq!(series, MAX_LOCKS + 1, "{text}");
    assert!(text.contains("lock=\"(other)\""), "{text}");
}

#[test]
fn holder_info_follows_open_holds() {
    let m = Metrics::new("k");
    let kp = HoldLabels {
        lock: "/l".into(),
        agent: "kube-proxy".into(),
        role: "proxy".into(),
        pod: PodLabels::default(),
    };
    m.set_open_holds(["/l"], [kp.clone()]);
    let t = m.encode().unwrap();
    assert!(t.contains("xtlock_lock_held{lock=\"/l\"} 1"), "{t}");
    assert!(
        t.contains("xtlock_lock_holder_info{lock=\"/l\",agent=\"kube-proxy\""),
        "{t}"
    );
    m.set_open_holds(["/l"], []);
    let t = m.encode().unwrap();
    assert!(t.contains("xtlock_lock_held{lock=\"/l\"} 0"), "{t}");
    assert!(!t.contains("xtlock_lock_holder_info{"), "{t}");
}

#[test]
fn counters_are_described_by_their_sample_names() {
    let om = "# HELP x_drops Drops.\n# TYPE x_drops counter\nx_drops_total{a=\"1\"} 2\n\
              # HELP x_hold_seconds Hold.\n# TYPE x_hold_seconds histogram\n\
              # UNIT x_hold_seconds seconds\nx_hold_seconds_count 1\n# EOF\n";
    assert_eq!(
        to_prometheus_text(om),
        "# HELP x_drops_total Drops.\n# TYPE x_drops_total counter\nx_drops_total{a=\"1\"} 2\n\
         # HELP x_hold_seconds Hold.\n# TYPE x_hold_seconds histogram\nx_hold_seconds_count 1\n"
    );
}

#[test]
fn drop_locations_lose_their_offsets() {
    assert_eq!(location_function("nf_hook_slow+0x9c/0x120"), "nf_hook_slow");
    assert_eq!(
        location_function("0xffffffff81000000"),
        "0xffffffff81000000"
    );
}

/// Refusals by kind and detail (bounded labels, no destination), and during holds by kind and
/// the holding agent.
#[test]
fn refusals_are_counted_by_kind_and_holding_agent() {
    use crate::analysis::{HoldRefusalsFact, RefusalCountFact, RefusalGroup, RefusalKind};
    let m = Arc::new(Metrics::new("k"));
    let mut s = MetricsSink::new(m.clone(), Some(7));
    let count = |kind, detail: &str, dest: &str, n| {
        Output::RefusalCount(RefusalCountFact {
            ts_ns: 1,
            interval_ns: 1_000_000_000,
            netns: 7,
            kind,
            detail: detail.into(),
            dest: dest.into(),
            count: n,
            hold: None,
            rule: None,
        })
    };
    for o in [
        count(
            RefusalKind::IcmpUnreachable,
            "port unreachable",
            "10.96.0.15:80",
            30,
        ),
        count(
            RefusalKind::IcmpUnreachable,
            "port unreachable",
            "10.96.0.16:80",
            7,
        ),
        count(RefusalKind::ResetSent, "NO_SOCKET", "10.0.0.2:9", 2),
        Output::HoldRefusals(HoldRefusalsFact {
            lock: "/run/xtables.lock".into(),
            pid: 10,
            agent: "kube-proxy".into(),
            comm: "iptables-restor".into(),
            start_ns: 1,
            hold_ns: 2,
            refused: 37,
            groups: vec![RefusalGroup {
                kind: RefusalKind::IcmpUnreachable,
                detail: "port unreachable".into(),
                dest: "10.96.0.15:80".into(),
                netns: 7,
                count: 37,
                rule: None,
                example: None,
            }],
        }),
    ] {
        s.output(&o).unwrap();
    }
    let text = m.encode().unwrap();
    assert!(
        text.contains(
            "xtlock_refusals_total{kind=\"icmp_unreachable\",detail=\"port unreachable\",netns=\"host\"} 37"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "xtlock_refusals_total{kind=\"reset_sent\",detail=\"NO_SOCKET\",netns=\"host\"} 2"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "xtlock_refusals_during_holds_total{kind=\"icmp_unreachable\",agent=\"kube-proxy\"} 37"
        ),
        "{text}"
    );
    assert!(
        !text.contains("10.96.0.15"),
        "destinations are no labels: {text}"
    );
}
