use crate::analysis::Who;
use std::sync::Arc;

use super::*;
use crate::analysis::{
    Analyzer, DropClass, DropCountFact, ExecFact, ExitFact, HoldFact, LostFact, WaitFact, WaitMode,
    WaitOutcome,
};
use crate::sinks::{JsonSink, TerminalSink};

const LOCK: &str = "/run/xtables.lock";

fn pod(ns: &str, name: &str) -> Option<Arc<PodName>> {
    Some(Arc::new(PodName {
        namespace: ns.into(),
        pod: name.into(),
        container: "c".into(),
    }))
}

fn hold(agent: &str, pid: u32, start_ns: u64, hold_ns: u64) -> HoldFact {
    HoldFact {
        lock: LOCK.into(),
        pid,
        tid: pid,
        who: Who {
            comm: "iptables-restor".into(),
            agent: agent.into(),
            role: "proxy",
            cmdline: "iptables-restore -w 5".into(),
            agent_pid: 1,
            pod_uid: None,
            container_id: None,
            pod: None,
        },
        start_ns,
        hold_ns,
        owner: 1,
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
    }
}

fn holder_of(h: &HoldFact) -> HolderRef {
    HolderRef {
        pid: h.pid,
        agent: h.who.agent.clone(),
        role: h.who.role,
        comm: h.who.comm.clone(),
        cmdline: h.who.cmdline.clone(),
        pod: h.who.pod.clone(),
        behind_ns: Some(1),
        from_ns: None,
        waiting: None,
    }
}

fn wait(agent: &str, pid: u32, start_ns: u64, holders: &[&HoldFact]) -> WaitFact {
    WaitFact {
        lock: LOCK.into(),
        pid,
        tid: pid,
        who: Who {
            comm: "iptables".into(),
            agent: agent.into(),
            role: "cni",
            cmdline: "iptables -w".into(),
            agent_pid: 2,
            pod_uid: None,
            container_id: None,
            pod: None,
        },
        start_ns,
        wait_ns: 1_000,
        holders: holders.iter().map(|h| holder_of(h)).collect(),
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

fn exec(agent: &str, pid: u32, p: Option<Arc<PodName>>) -> Output {
    Output::Exec(ExecFact {
        ts_ns: 10,
        pid,
        ppid: 1,
        comm: "iptables".into(),
        run: None,
        filename: "/usr/sbin/iptables".into(),
        argv: Default::default(),
        argv_truncated: false,
        cmdline: "iptables".into(),
        agent: agent.into(),
        role: "proxy",
        agent_pid: 1,
        chain: Arc::from(Vec::new()),
        pod_uid: None,
        container_id: None,
        pod: p,
    })
}

fn exit(agent: &str, pid: u32) -> Output {
    Output::Exit(ExitFact {
        ts_ns: 20,
        pid,
        comm: "iptables".into(),
        run: None,
        code: Some(1),
        agent: agent.into(),
        role: "proxy",
        runtime_ns: None,
        lock_timeout: false,
    })
}

fn drop_count(holds: &[&HoldFact]) -> Output {
    Output::DropCount(DropCountFact {
        ts_ns: 0,
        interval_ns: 1_000_000_000,
        netns: 1,
        reason: "NETFILTER_DROP".into(),
        reason_code: 1,
        location: "nf_hook_slow".into(),
        class: DropClass::NetfilterDrop,
        count: 3,
        holds: holds
            .iter()
            .map(|h| HoldRef {
                lock: h.lock.clone(),
                pid: h.pid,
                agent: h.who.agent.clone(),
                comm: h.who.comm.clone(),
                start_ns: h.start_ns,
                hold_ns: Some(h.hold_ns),
            })
            .collect(),
        example: None,
    })
}

fn lost() -> Output {
    Output::Lost(LostFact {
        ts_ns: 5,
        count: 1,
        total: 1,
        bound: None,
    })
}

/// Records what reaches it, and the notes of the summaries.
#[derive(Default)]
struct Seen {
    facts: Vec<Output>,
    notes: Vec<FilterNote>,
}

impl Sink for Seen {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        self.facts.push(o.clone());
        Ok(())
    }
    fn summary(&mut self, _s: &Summary, _final: bool) -> io::Result<()> {
        Ok(())
    }
    fn summary_filtered(&mut self, _s: &Summary, _f: bool, note: &FilterNote) -> io::Result<()> {
        self.notes.push(note.clone());
        Ok(())
    }
}

fn run(filter: FactFilter, facts: &[Output]) -> Seen {
    let mut f = FilteredSink::new(Seen::default(), filter);
    for o in facts {
        f.output(o).unwrap();
    }
    f.summary(&Analyzer::new(vec![]).summary(), true).unwrap();
    f.into_inner()
}

fn agents(list: &[&str]) -> FactFilter {
    FactFilter {
        agents: list.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[test]
fn agent_filter_keeps_its_facts_and_waits_behind_it() {
    let kp = hold("kube-proxy", 10, 1_000, 500);
    let cn = hold("calico-node", 20, 2_000, 500);
    let facts = [
        Output::Hold(kp.clone()),
        Output::Hold(cn.clone()),
        // calico-node waited behind kube-proxy: about kube-proxy too.
        Output::Wait(wait("calico-node", 21, 1_100, &[&kp])),
        // calico-node waited behind calico-node: not about kube-proxy.
        Output::Wait(wait("calico-node", 22, 2_100, &[&cn])),
        exec("kube-proxy", 11, None),
        exit("calico-node", 20),
        // Drops in a kube-proxy hold are; drops in nobody's hold are not.
        drop_count(&[&kp]),
        drop_count(&[]),
        lost(),
    ];
    let seen = run(agents(&["kube-proxy"]), &facts);
    let kept: Vec<usize> = facts
        .iter()
        .enumerate()
        .filter(|(_, o)| seen.facts.contains(o))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(kept, [0, 2, 4, 6, 8]);
    let note = &seen.notes[0];
    assert_eq!((note.shown, note.facts), (5, 9));
    assert_eq!(
        note.describe(),
        "agent kube-proxy; 5 of 9 facts shown",
        "{note:?}"
    );
    // Repeated: either agent.
    let seen = run(agents(&["kube-proxy", "calico-node"]), &facts);
    assert_eq!(seen.facts.len(), 8, "all but the drops outside holds");
    // No filter: everything.
    assert_eq!(run(FactFilter::default(), &facts).facts.len(), facts.len());
}

#[test]
fn pod_filter_follows_the_pod_through_pids() {
    let mut kp = hold("kube-proxy", 10, 1_000, 500);
    kp.who.pod = pod("kube-system", "kube-proxy-x7k2p");
    let other = hold("kube-proxy", 30, 3_000, 500);
    let facts = [
        // The exec names the pod; the exit and the drops in its hold name only the pid.
        exec("kube-proxy", 10, pod("kube-system", "kube-proxy-x7k2p")),
        Output::Hold(kp.clone()),
        exit("kube-proxy", 10),
        drop_count(&[&kp]),
        // Same agent, no pod (a host process): not shown for a pod filter.
        Output::Hold(other.clone()),
        exit("kube-proxy", 30),
    ];
    let by_pod = FactFilter {
        pods: vec!["kube-proxy-x7k2p".into()],
        ..Default::default()
    };
    assert_eq!(run(by_pod, &facts).facts, facts[..4]);
    // The workload's name and the namespace select the same pod.
    let by_workload = FactFilter {
        pods: vec!["kube-proxy".into()],
        namespaces: vec!["kube-system".into()],
        ..Default::default()
    };
    assert_eq!(run(by_workload, &facts).facts, facts[..4]);
    let elsewhere = FactFilter {
        namespaces: vec!["default".into()],
        ..Default::default()
    };
    assert!(run(elsewhere, &facts).facts.is_empty());
    // Agent and pod together: the same party must match both.
    let both = FactFilter {
        agents: vec!["calico-node".into()],
        namespaces: vec!["kube-system".into()],
        ..Default::default()
    };
    assert!(run(both, &facts).facts.is_empty());
}

#[test]
fn window_keeps_what_overlaps_it() {
    let facts = [
        Output::Hold(hold("a", 1, 100, 50)),  // 100..150
        Output::Hold(hold("a", 2, 190, 20)),  // 190..210: overlaps since=200
        Output::Hold(hold("a", 3, 250, 10)),  // inside
        Output::Hold(hold("a", 4, 300, 100)), // starts at until: out
    ];
    let w = FactFilter {
        since: Some((200, "S".into())),
        until: Some((300, "U".into())),
        ..Default::default()
    };
    let seen = run(w, &facts);
    assert_eq!(seen.facts, facts[1..3]);
    assert_eq!(
        seen.notes[0].describe(),
        "since S; until U; 2 of 4 facts shown"
    );
    assert_eq!(seen.notes[0].since_ns, Some(200));
}

#[test]
fn lock_filter_hides_other_locks_only() {
    let mut other = hold("a", 2, 0, 1);
    other.lock = "/tmp/other.lock".into();
    let facts = [
        Output::Hold(hold("a", 1, 0, 1)),
        Output::Hold(other.clone()),
        drop_count(&[&other]),
        exec("a", 3, None),
    ];
    let f = FactFilter {
        locks: vec![LOCK.into()],
        ..Default::default()
    };
    let seen = run(f, &facts);
    // Facts about no lock (an exec) pass.
    assert_eq!(seen.facts, [facts[0].clone(), facts[3].clone()]);
}

#[test]
fn summary_says_what_was_filtered_terminal_and_json() {
    let facts = [
        Output::Hold(hold("kube-proxy", 1, 0, 1)),
        Output::Hold(hold("calico-node", 2, 0, 1)),
    ];
    let summary = Analyzer::new(vec![]).summary();
    let mut t = FilteredSink::new(TerminalSink::new(Vec::new()), agents(&["kube-proxy"]));
    for o in &facts {
        t.output(o).unwrap();
    }
    t.summary(&summary, true).unwrap();
    let text = String::from_utf8(t.into_inner().into_inner()).unwrap();
    assert!(text.contains("kube-proxy held"), "{text}");
    assert!(!text.contains("calico-node held"), "{text}");
    assert!(
        text.contains("filtered: agent kube-proxy; 1 of 2 facts shown"),
        "{text}"
    );

    let mut j = FilteredSink::new(JsonSink::new(Vec::new()), agents(&["kube-proxy"]));
    for o in &facts {
        j.output(o).unwrap();
    }
    j.summary(&summary, true).unwrap();
    let out = String::from_utf8(j.into_inner().into_inner()).unwrap();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0]["agent"], "kube-proxy");
    let s = &lines[1];
    assert_eq!(s["type"], "summary");
    assert_eq!(s["filter"]["agents"][0], "kube-proxy");
    assert_eq!(s["filter"]["shown"], 1);
    assert_eq!(s["filter"]["facts"], 2);
}

#[test]
fn a_hostile_filter_value_is_escaped_on_the_terminal() {
    let mut t = FilteredSink::new(TerminalSink::new(Vec::new()), agents(&["x\x1b[2J\ny"]));
    t.summary(&Analyzer::new(vec![]).summary(), true).unwrap();
    let text = String::from_utf8(t.into_inner().into_inner()).unwrap();
    assert!(text.contains("agent x\\e[2J\\ny;"), "{text}");
}

fn clock() -> CaptureClock {
    // Recording started 2024-05-01 23:50:00 UTC; the machine booted 1000 s before.
    let started = 1_714_607_400 * 1_000_000_000u64;
    CaptureClock {
        started_wall_ns: started,
        boot_to_wall_offset_ns: (started - 1_000_000_000_000) as i64,
        utc_offset_s: 0,
    }
}

#[test]
fn times_as_an_sre_types_them() {
    let c = clock();
    let at = |s: &str| When::parse(s).unwrap().to_ts_ns(&c);
    let start = 1_000_000_000_000;
    assert_eq!(at("0s"), start);
    assert_eq!(at("90s"), start + 90_000_000_000);
    assert_eq!(at("+5m"), start + 300_000_000_000);
    assert_eq!(at("23:50:30"), start + 30_000_000_000);
    assert_eq!(at("23:50:30.250"), start + 30_250_000_000);
    assert_eq!(at("23:51"), start + 60_000_000_000);
    // Past midnight: the next day's, the one nearest the capture.
    assert_eq!(at("00:10"), start + 1_200_000_000_000);
    // Before the start: that day's, not the next.
    assert_eq!(at("23:40"), start - 600_000_000_000);
    assert_eq!(at("2024-05-01T23:51:00Z"), start + 60_000_000_000);
    assert_eq!(at("2024-05-02T01:51:00+02:00"), start + 60_000_000_000);
    assert_eq!(at("2024-05-01 23:51:00"), start + 60_000_000_000);
    // Before boot: the beginning.
    assert_eq!(at("2000-01-01T00:00:00Z"), 0);
    // Times of day are read in the zone the report shows.
    let east = CaptureClock {
        utc_offset_s: 2 * 3600,
        ..c
    };
    assert_eq!(
        When::parse("01:51").unwrap().to_ts_ns(&east),
        start + 60_000_000_000
    );
    let e = When::parse("yesterday").unwrap_err();
    assert!(e.contains("is not a time") && e.contains("+5m"), "{e}");
    assert!(When::parse("+soon").is_err());
}

#[test]
fn a_service_is_named_by_its_name_or_by_kube_proxys_comments() {
    assert!(names_service("default/web:http", "default/web"));
    assert!(names_service("default/web:http", "default/web:http"));
    assert!(!names_service("default/web:https", "default/web:http"));
    assert!(!names_service("default/webapp:http", "default/web"));
    let reject = "-m comment --comment \"default/web:http has no endpoints\" -j REJECT";
    assert!(mentions_service(reject, "default/web"));
    assert!(mentions_service(reject, "default/web:http"));
    assert!(!mentions_service(reject, "default/we"));
    assert!(!mentions_service(reject, "fault/web"));
    assert!(!mentions_service(reject, "default/web:https"));
}

fn rule_drops(rule: &str) -> Output {
    Output::RuleDrops(crate::analysis::facts::RuleDropsFact {
        ts_ns: 2,
        since_ns: 1,
        netns: 7,
        family: "ip".into(),
        table: "filter".into(),
        chain: "KUBE-EXTERNAL-SERVICES".into(),
        rule: rule.into(),
        packets: 3,
        bytes: 180,
        reset: false,
        owner: Some("kube-proxy".into()),
        chain_owner: Some("kube-proxy".into()),
        added: None,
        dests: Vec::new(),
        hold: None,
        others: 0,
    })
}

/// `--service` shows the facts that name the Service (here the rule behind drops), not the
/// others, and lost events always; the summary says what was filtered.
#[test]
fn service_filter_keeps_the_facts_that_name_it() {
    let filter = FactFilter {
        services: vec!["default/web".into()],
        ..Default::default()
    };
    let mut sink = FilteredSink::new(JsonSink::new(Vec::new()), filter);
    let web = rule_drops("-m comment --comment \"default/web:http has no endpoints\" -j REJECT");
    let db = rule_drops("-m comment --comment \"default/db:pg has no endpoints\" -j REJECT");
    for o in [
        &web,
        &db,
        &Output::Lost(LostFact {
            ts_ns: 3,
            count: 1,
            total: 1,
            bound: None,
        }),
    ] {
        sink.output(o).unwrap();
    }
    assert_eq!(
        sink.note().describe(),
        "service default/web; 2 of 3 facts shown"
    );
    let out = String::from_utf8(sink.into_inner().into_inner()).unwrap();
    assert!(out.contains("default/web:http"), "{out}");
    assert!(!out.contains("default/db"), "{out}");
    assert!(out.contains("\"type\":\"lost\""), "{out}");
}
