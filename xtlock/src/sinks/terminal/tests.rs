use super::*;
use crate::analysis::Who;
use crate::analysis::{
    DropClass, HoldDropsFact, HoldFact, HolderRef, TimeoutFact, WaitFact, WaitMode, WaitOutcome,
};

fn holder(agent: &str, cmdline: &str) -> HolderRef {
    HolderRef {
        pid: 1234,
        agent: agent.into(),
        role: "proxy",
        comm: "iptables-restor".into(),
        cmdline: cmdline.into(),
        pod: None,
        behind_ns: None,
        from_ns: None,
        waiting: None,
    }
}

fn hold(ns: u64) -> HoldFact {
    HoldFact {
        lock: DEFAULT_LOCK.into(),
        pid: 1234,
        tid: 1234,
        who: Who {
            comm: "iptables-restor".into(),
            agent: "kube-proxy".into(),
            role: "proxy",
            cmdline: "iptables-restore -w 5 --noflush".into(),
            agent_pid: 100,
            pod_uid: None,
            container_id: None,
            pod: None,
        },
        start_ns: 2_000_000_000,
        hold_ns: ns,
        owner: 1,
        exclusive: true,
        kernel_ns: 0,
        replaces: 0,
        read_ns: 0,
        reads: 0,
        tables: Vec::new(),
        swap_ns: 0,
        before_start: false,
        released_by: Some(1234),
        open: false,
        incomplete: false,
        nft: None,
    }
}

fn render(outputs: &[Output], opts: TerminalOptions) -> String {
    let mut sink = TerminalSink::with_options(Vec::new(), opts);
    for o in outputs {
        sink.output(o).unwrap();
    }
    sink.flush().unwrap();
    String::from_utf8(sink.into_inner()).unwrap()
}

/// A blocking wait on `lock` by pid 77 (`iptables`), acquired, behind `holders`.
fn wait_on(lock: &str, agent: &str, wait_ns: u64, holders: Vec<HolderRef>) -> WaitFact {
    WaitFact {
        lock: lock.into(),
        pid: 77,
        tid: 77,
        who: Who {
            comm: "iptables".into(),
            agent: agent.into(),
            role: "cni",
            cmdline: "".into(),
            agent_pid: 40,
            pod_uid: None,
            container_id: None,
            pod: None,
        },
        start_ns: 0,
        wait_ns,
        holders,
        unknown_ns: 0,
        free_ns: 0,
        other_holders: 0,
        other_holders_ns: 0,
        outcome: WaitOutcome::Acquired,
        mode: WaitMode::Blocking,
        tries: 0,
        ret: None,
        incomplete: false,
    }
}

#[test]
fn lines() {
    let mut wait = WaitFact {
        start_ns: 1_000_000_000,
        ..wait_on(
            DEFAULT_LOCK,
            "calico-node",
            1_420_000_000,
            vec![HolderRef {
                behind_ns: Some(1_420_000_000),
                from_ns: Some(1_000_000_000),
                ..holder(
                    "kube-proxy",
                    "iptables-legacy-restore -w 5 -W 100000 --noflush --counters",
                )
            }],
        )
    };
    wait.who.cmdline = "iptables -w 5 -A X".into();
    let opts = TerminalOptions {
        time: TimeFormat::Relative { origin_ns: Some(0) },
        ..Default::default()
    };
    let text = render(&[Output::Hold(hold(312_400_000)), Output::Wait(wait)], opts);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        "   2.000 kube-proxy held /run/xtables.lock 312 ms \
         (pid 1234 iptables-restore -w 5 --noflush)"
    );
    assert_eq!(
        lines[1],
        "   1.000 calico-node waited 1.42 s behind kube-proxy \
         (iptables-legacy-restore -w 5 -W 100000 --noflush --counters) [pid 77 iptables]"
    );
}

/// A wait behind kube-proxy then calico-node says how long it was behind each, grouped
/// by agent; a stretch with no known holder comes first.
#[test]
fn wait_split_by_holder() {
    let behind = |agent: &str, pid: u32, ns: u64| HolderRef {
        pid,
        behind_ns: Some(ns),
        from_ns: Some(0),
        ..holder(agent, "")
    };
    let mut wait = wait_on(
        DEFAULT_LOCK,
        "portmap",
        1_070_000_000,
        vec![
            behind("kube-proxy", 10, 600_000_000),
            behind("calico-node", 11, 70_000_000),
            behind("kube-proxy", 12, 400_000_000),
        ],
    );
    let opts = || TerminalOptions {
        time: TimeFormat::None,
        ..Default::default()
    };
    let text = render(&[Output::Wait(wait.clone())], opts());
    assert_eq!(
        text.trim_end(),
        "portmap waited 1.07 s: 1.00 s behind kube-proxy (2 processes), \
         70.0 ms behind calico-node (iptables-restor) [pid 77 iptables]"
    );
    wait.holders.truncate(1);
    wait.holders[0].behind_ns = Some(1_000_000_000);
    wait.unknown_ns = 70_000_000;
    wait.other_holders = 3;
    wait.other_holders_ns = 0;
    let text = render(&[Output::Wait(wait)], opts());
    assert_eq!(
        text.trim_end(),
        "portmap waited 1.07 s: 70.0 ms behind an unknown holder, \
         1.00 s behind kube-proxy (iptables-restor), 0 ns behind 3 more [pid 77 iptables]"
    );
}

/// A wait behind a holder that was itself queued for another lock names that lock and the
/// root of the queue: an nfnetlink wait behind a batch waiting for its commit mutex.
#[test]
fn a_holder_itself_waiting_is_said() {
    let root = HolderRef {
        pid: 5,
        behind_ns: Some(450_000_000),
        from_ns: Some(150_000_000),
        ..holder("kube-proxy", "nft -f -")
    };
    let wait = wait_on(
        "nfnetlink nf_tables mutex",
        "nft",
        470_000_000,
        vec![HolderRef {
            pid: 10,
            behind_ns: Some(470_000_000),
            from_ns: Some(0),
            waiting: Some(std::sync::Arc::new(crate::analysis::Waiting {
                lock: "nf_tables commit (netns 4026532500)".into(),
                wait_ns: 450_000_000,
                holders: vec![root],
            })),
            ..holder("firewalld", "")
        }],
    );
    let opts = TerminalOptions {
        time: TimeFormat::None,
        ..Default::default()
    };
    let text = render(&[Output::Wait(wait)], opts);
    assert_eq!(
        text.trim_end(),
        "nft waited 470 ms behind firewalld (iptables-restor) (itself waiting 450 ms for \
         nf_tables commit (netns 4026532500) behind kube-proxy (nft -f -)) on nfnetlink \
         nf_tables mutex [pid 77 iptables]"
    );
}

#[test]
fn min_hold_filters_short_holds() {
    let opts = TerminalOptions {
        min_hold: Duration::from_millis(10),
        time: TimeFormat::None,
        ..Default::default()
    };
    let drops = |hold_ns| {
        Output::HoldDrops(HoldDropsFact {
            lock: DEFAULT_LOCK.into(),
            pid: 1234,
            agent: "kube-proxy".into(),
            comm: "iptables-restor".into(),
            start_ns: 2_000_000_000,
            hold_ns,
            dropped: 3,
            by_class: [(DropClass::NetfilterRuleDrop, 3)].into(),
            by_reason: [("NETFILTER_DROP".to_string(), 3)].into(),
            samples: 3,
            exact_reasons: true,
        })
    };
    let text = render(
        &[
            Output::Hold(hold(5_000_000)),
            drops(5_000_000),
            Output::Hold(hold(50_000_000)),
            drops(50_000_000),
        ],
        opts,
    );
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(text.starts_with("kube-proxy held /run/xtables.lock 50.0 ms"));
    assert!(text.contains("during kube-proxy's 50.0 ms hold"), "{text}");
}

#[test]
fn failed_tries_collapse() {
    let f = |ts| {
        Output::FailedTry(FailedTryFact {
            lock: DEFAULT_LOCK.into(),
            pid: 9,
            tid: 9,
            comm: "portmap".into(),
            agent: "portmap".into(),
            role: "cni",
            ts_ns: ts,
            pod: None,
            errno: 11,
            holder: Some(holder("kube-proxy", "")),
        })
    };
    let outs: Vec<Output> = (0..5).map(|i| f(i * 200_000_000)).collect();
    let opts = TerminalOptions {
        time: TimeFormat::None,
        ..Default::default()
    };
    let text = render(&outs, opts);
    assert_eq!(
        text,
        "portmap failed to take /run/xtables.lock (pid 9 portmap, errno 11), \
         held by kube-proxy (iptables-restor)\n\
         portmap: 4 more failed tries by pid 9 in 800 ms\n"
    );
}

#[test]
fn timeout_line() {
    let t = TimeoutFact {
        lock: DEFAULT_LOCK.into(),
        pid: 4242,
        who: Who {
            comm: "iptables".into(),
            cmdline: "iptables -w 5 -A FOO".into(),
            agent: "calico-node".into(),
            role: "cni",
            agent_pid: 40,
            pod_uid: None,
            container_id: None,
            pod: None,
        },
        ts_ns: 0,
        exit_code: 4,
        waited_ns: 5_000_000_000,
        tries: 0,
        holders: vec![holder("kube-proxy", "")],
    };
    let opts = TerminalOptions {
        time: TimeFormat::wall_clock(0, 0),
        ..Default::default()
    };
    let text = render(&[Output::Timeout(t)], opts);
    assert_eq!(
        text,
        "00:00:00.000 calico-node: iptables (pid 4242) gave up waiting for the lock \
         after 5.00 s (exit 4), held by kube-proxy\n"
    );
}

#[test]
fn wall_clock() {
    // 1 h 2 min 3.456 s after midnight, plus a day, from a monotonic clock offset.
    let ts = 1_000_000_000;
    let off = (86_400 + 3_723) * 1_000_000_000 + 456_000_000 - 1_000_000_000;
    assert_eq!(wall_clock_label(ts, off, 0), "01:02:03.456");
    assert_eq!(wall_clock_label(ts, off, 3600), "02:02:03.456");
    assert_eq!(wall_clock_label(ts, off, -7200), "23:02:03.456");
}

#[test]
fn summary_mentions_lost_events() {
    let mut a = crate::analysis::Analyzer::new(vec![]);
    a.process_collect(&crate::decode::Event::Lost {
        ts_ns: 5,
        count: 12,
    });
    let mut sink = TerminalSink::new(Vec::new());
    sink.summary(&a.summary(), true).unwrap();
    let text = String::from_utf8(sink.into_inner()).unwrap();
    assert!(
        text.contains("12 events lost: the ring buffer was full; counts are lower bounds"),
        "{text}"
    );
}

/// What the JSON summary has, the text summary says: a dead-endpoint window, the rules that
/// dropped packets, the agents' syncs and the bounds hit.
#[test]
fn summary_says_every_class_of_fact() {
    let mut a = crate::analysis::Analyzer::new(vec![]);
    a.process_collect(&crate::decode::Event::Lost { ts_ns: 5, count: 1 });
    let mut s = a.summary();
    s.services.services = 3;
    s.services.endpoints = 4;
    s.services.stale_windows = 1;
    s.services.stale_ns = 1_500_000_000;
    s.services.connections = 6;
    s.rule_drops.packets = 250;
    s.rule_drops.rules = 1;
    s.rule_drops
        .top
        .push(crate::analysis::rule_drops::RuleDropRow {
            family: "ip".into(),
            table: "filter".into(),
            chain: "KUBE-FIREWALL".into(),
            rule: "-m mark --mark 0x8000/0x8000 -j DROP".into(),
            packets: 250,
            bytes: 7_500,
            owner: Some("firewalld".into()),
            chain_owner: Some("kube-proxy".into()),
            ..Default::default()
        });
    s.syncs.insert(
        "kube-proxy".into(),
        crate::analysis::cadence::SyncSummary {
            syncs: 42,
            usual_period_ns: Some(10_000_000_000),
            last_sync_ns: None,
            stalled: false,
        },
    );
    s.over_bounds.insert("open_holds".into(), 2);
    let mut sink = TerminalSink::new(Vec::new());
    sink.summary(&s, true).unwrap();
    let text = String::from_utf8(sink.into_inner()).unwrap();
    for want in [
        "Services: 3 service ports routed to 4 endpoints",
        "!! 1 window of routing to a gone endpoint, 1.50 s in all, 6 connections",
        "rules that dropped packets: 250 packets by 1 rule",
        "250 packets (7.3 KiB) filter KUBE-FIREWALL `-m mark --mark 0x8000/0x8000 -j DROP` \
         (firewalld's rule in kube-proxy's chain)",
        "syncs (completed restores): kube-proxy 42 (every 10.0 s)",
        "analysis bounds hit (what went past them was not tracked): open_holds 2",
    ] {
        assert!(text.contains(want), "`{want}` in:\n{text}");
    }
}

#[test]
fn dates() {
    assert_eq!(wall_clock_date(0), "1970-01-01 00:00:00 UTC");
    // 2026-11-22 00:30:05 UTC
    assert_eq!(
        wall_clock_date(1_795_307_405 * 1_000_000_000),
        "2026-11-22 00:30:05 UTC"
    );
    assert_eq!(
        wall_clock_date(951_782_400 * 1_000_000_000),
        "2000-02-29 00:00:00 UTC"
    );
}

/// A hold that read tables before replacing one: the kernel time, split.
#[test]
fn hold_with_table_reads() {
    let mut h = hold(60_000_000);
    h.kernel_ns = 27_000_000;
    h.read_ns = 7_000_000;
    h.reads = 2;
    h.replaces = 1;
    let line = super::lines::hold_text(&h);
    assert!(
        line.contains(
            "kernel 27.0 ms: 7.00 ms in 2 table reads, 20.0 ms in 1 table replace; \
             userspace 33.0 ms"
        ),
        "{line}"
    );
    // Reads only (`iptables -C`): no replace part.
    h.replaces = 0;
    h.kernel_ns = 7_000_000;
    let line = super::lines::hold_text(&h);
    assert!(
        line.contains("kernel 7.00 ms: 7.00 ms in 2 table reads; userspace 53.0 ms"),
        "{line}"
    );
}

/// An nf_tables commit says what its batch changed; `at least` when only its first messages
/// were counted, and nothing made up when the batch could not be read.
#[test]
fn nft_commit_changes() {
    let mut h = hold(3_000_000);
    h.lock = "nf_tables commit (netns 4026531840)".into();
    h.nft = Some(crate::event::NftBatch {
        status: "complete",
        added: [0, 5, 1_300, 0, 0, 0, 0, 0],
        deleted: [0, 0, 2, 0, 0, 0, 0, 0],
    });
    let line = super::lines::hold_text(&h);
    assert!(
        line.contains(", 1,307 changes (chains +5, rules +1,300 -2)"),
        "{line}"
    );
    h.nft = Some(crate::event::NftBatch {
        status: "partial",
        added: [0, 0, 1_024, 0, 0, 0, 0, 0],
        deleted: [0; 8],
    });
    let line = super::lines::hold_text(&h);
    assert!(
        line.contains(", at least 1,024 changes (rules +1,024)"),
        "{line}"
    );
    h.nft = Some(crate::event::NftBatch {
        status: "unreadable",
        added: [0; 8],
        deleted: [0; 8],
    });
    let line = super::lines::hold_text(&h);
    assert!(line.ends_with(", batch not readable"), "{line}");
}

/// The sentence: how many connections, to where, refused how, during whose hold;
/// an untrusted agent name still goes through the one escaping path.
#[test]
fn hold_refusals_say_who_was_refused_during_whose_hold() {
    use crate::analysis::{HoldRefusalsFact, RefusalGroup, RefusalKind};
    let group = |kind, detail: &str, dest: &str, count| RefusalGroup {
        kind,
        detail: detail.into(),
        dest: dest.into(),
        netns: 1,
        count,
        rule: None,
        example: None,
    };
    let f = |agent: &str| {
        Output::HoldRefusals(HoldRefusalsFact {
            lock: DEFAULT_LOCK.into(),
            pid: 1234,
            agent: agent.into(),
            comm: "iptables-restor".into(),
            start_ns: 2_000_000_000,
            hold_ns: 2_100_000_000,
            refused: 57,
            groups: vec![
                RefusalGroup {
                    rule: Some("default/web:http has no endpoints".into()),
                    ..group(
                        RefusalKind::IcmpUnreachable,
                        "port unreachable",
                        "10.96.0.15:80",
                        37,
                    )
                },
                group(RefusalKind::ResetSent, "NO_SOCKET", "10.0.0.2:9", 19),
                group(RefusalKind::ResetReceived, "", "10.0.0.3:443", 1),
            ],
        })
    };
    let opts = || TerminalOptions {
        time: TimeFormat::None,
        ..Default::default()
    };
    let text = render(&[f("kube-proxy")], opts());
    assert!(
        text.contains(
            "!! 37 connections to 10.96.0.15:80 refused (ICMP port unreachable) by rule \
             \"default/web:http has no endpoints\", 19 connections \
             to 10.0.0.2:9 refused (TCP reset, NO_SOCKET), 1 TCP reset received from \
             10.0.0.3:443 during kube-proxy's 2.10 s hold"
        ),
        "{text}"
    );
    let Output::HoldRefusals(mut with_example) = f("kube-proxy") else {
        unreachable!()
    };
    with_example.groups[0].example = Some(refused_syn());
    let text = render(&[Output::HoldRefusals(with_example)], opts());
    assert!(
        text.contains(
            "!! 37 connections to 10.96.0.15:80 refused (ICMP port unreachable) by rule \
             \"default/web:http has no endpoints\" (e.g. tcp 10.0.0.9:40312 -> 10.96.0.15:80), \
             19 connections"
        ),
        "{text}"
    );
    let text = render(&[f("evil\x1b[2Jagent")], opts());
    assert!(!text.contains('\x1b'), "{text:?}");
}

/// A sampled refusal names the refused connection, shown with the drop samples only.
#[test]
fn refusal_samples_name_the_refused_connection() {
    use crate::analysis::{RefusalFact, RefusalKind};
    let f = Output::Refusal(RefusalFact {
        ts_ns: 2_000_000_000,
        netns: 7,
        kind: RefusalKind::IcmpUnreachable,
        detail: "port unreachable".into(),
        dest: "10.96.0.15:80".into(),
        packet: Some(refused_syn()),
        pid: 0,
        hold: None,
    });
    let opts = |show| TerminalOptions {
        time: TimeFormat::None,
        show_drop_samples: show,
        ..Default::default()
    };
    assert!(!render(std::slice::from_ref(&f), opts(false)).contains("sample"));
    let text = render(&[f], opts(true));
    assert!(
        text.contains(
            "sample: 1 connection to 10.96.0.15:80 refused (ICMP port unreachable): tcp \
             10.0.0.9:40312 -> 10.96.0.15:80, netns 7"
        ),
        "{text}"
    );
}

/// A client's SYN to a Service port, as a refusal sample reads it.
fn refused_syn() -> crate::analysis::PacketInfo {
    crate::analysis::PacketInfo {
        proto: "tcp".into(),
        saddr: "10.0.0.9".into(),
        daddr: "10.96.0.15".into(),
        sport: Some(40312),
        dport: Some(80),
        icmp_type: None,
        icmp_code: None,
    }
}

/// A dead endpoint's line: refused and unanswered connections, the fix, and the flows
/// conntrack still steers there.
#[test]
fn stale_endpoint_line_says_unanswered_and_conntrack_flows() {
    use crate::analysis::facts::{StaleConntrack, StaleEndpointFact, StaleFix};
    let mut f = StaleEndpointFact {
        ts_ns: 1,
        netns: 4026531840,
        service: "kube-system/dns:dns".into(),
        endpoint: "10.244.1.5:5353".into(),
        gone: "link deleted",
        link: "vethp0".into(),
        stale_ns: 1_220_000_000,
        still_routed: false,
        fix: Some(StaleFix {
            ts_ns: 2,
            exact: true,
            pid: 42,
            agent: "kube-proxy".into(),
            program: "iptables-legacy-restore".into(),
            wait_ns: 0,
            behind: Vec::new(),
            hold_ns: None,
        }),
        connections: 10,
        outcomes: [
            ("icmp_unreachable: host unreachable".to_string(), 3),
            ("unanswered".to_string(), 7),
        ]
        .into_iter()
        .collect(),
        conntrack: Some(StaleConntrack {
            entries: 1,
            udp: 1,
            tcp: 0,
            packets: 68,
            expires_in_s: 119,
        }),
    };
    let l = stale_endpoint_text(&f);
    assert_eq!(
        l,
        "!! kube-system/dns:dns routed to 10.244.1.5:5353 for 1.22 s after it was gone (link deleted: vethp0): \
         10 connections refused or unanswered (icmp_unreachable: host unreachable 3, unanswered 7); \
         fixed by kube-proxy's iptables-legacy-restore (pid 42); conntrack still sends 1 flow there \
         (1 UDP, 0 TCP, 68 packets; expires in 119 s unless packets keep it)"
    );
    f.outcomes = [("unanswered".to_string(), 10)].into_iter().collect();
    f.conntrack = None;
    assert!(stale_endpoint_text(&f).contains(": 10 connections unanswered (unanswered 10);"));
    f.gone = "unanswered";
    f.link = String::new();
    assert!(
        stale_endpoint_text(&f).contains(
            " after it stopped answering (its TCP connections got no reply): 10 connections"
        ),
        "{}",
        stale_endpoint_text(&f)
    );
}

#[test]
fn an_open_stale_window_says_what_clients_get_now() {
    let mut f = crate::analysis::StaleEndpointOpenFact {
        ts_ns: 5_000_000_000,
        gone_ns: 5_000_000_000,
        netns: 4026531840,
        service: "default/web:http".into(),
        endpoint: "10.244.1.7:8080".into(),
        gone: "link deleted",
        link: "veth1a2b".into(),
    };
    assert_eq!(
        stale_endpoint_open_text(&f),
        "!! default/web:http routes to 10.244.1.7:8080, gone from the node (link deleted: \
         veth1a2b): its clients fail until a rule write stops routing there"
    );
    // Found by a read after the endpoint was gone.
    f.ts_ns += 2_100_000_000;
    assert!(stale_endpoint_open_text(&f).contains("(link deleted: veth1a2b) for 2.10 s already:"));
    // An endpoint anywhere whose connections went unanswered.
    f.ts_ns = f.gone_ns;
    f.gone = "unanswered";
    f.link = String::new();
    assert_eq!(
        stale_endpoint_open_text(&f),
        "!! default/web:http routes to 10.244.1.7:8080, which stopped answering (its TCP \
         connections got no reply): its clients fail until a rule write stops routing there"
    );
}
