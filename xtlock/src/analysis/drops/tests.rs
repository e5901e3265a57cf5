use super::*;
use crate::analysis::{Analyzer, WatchedLock};
use crate::decode::{Comm, DropCount, Event, LockEvent, LockOp};

const S: u64 = 1_000_000_000;
const NS_B: u32 = 4026532246;
const NF: u64 = 0xffff_ffff_81a0_007d;
const UDP: u64 = 0xffff_ffff_81b0_04bc;

fn setup() -> Analyzer {
    let mut a = Analyzer::new(vec![WatchedLock::new("/run/xtables.lock", 25, 42)]);
    for ev in [
        Event::DropSetup {
            ts_ns: 0,
            has_reason: true,
            host_netns: 4026531833,
            names: vec![(3, "NO_SOCKET".into()), (12, "NETFILTER_DROP".into())],
        },
        Event::KernelSymbol {
            ts_ns: 0,
            addr: NF,
            name: "nf_hook_slow".into(),
            offset: 0x7d,
        },
        Event::KernelSymbol {
            ts_ns: 0,
            addr: UDP,
            name: "__udp4_lib_rcv".into(),
            offset: 0x4bc,
        },
    ] {
        assert!(a.process_collect(&ev).is_empty());
    }
    a
}

fn ct(ts: u64, drop: u64, insert_failed: u64, count: u64) -> Event {
    Event::Conntrack(Box::new(ConntrackStats {
        ts_ns: ts,
        interval_ns: S,
        netns: NS_B,
        deltas: ConntrackCounters {
            drop,
            insert_failed,
            ..Default::default()
        },
        count,
        max: 100,
    }))
}

fn counts(ts: u64, c: &[(u64, u32, u64)]) -> Event {
    counts_in_holds(ts, c, &[])
}

/// A hold's count as the kernel gives it: (hold start, drops so far, by reason).
type HoldCount = (u64, u64, Vec<(u32, u64)>);

/// Drop counts with the kernel's per-hold counts: (hold start, drops so far).
fn counts_in_holds(ts: u64, c: &[(u64, u32, u64)], holds: &[(u64, u64)]) -> Event {
    let holds: Vec<HoldCount> = holds.iter().map(|&(s, n)| (s, n, Vec::new())).collect();
    counts_with_reasons(ts, c, &holds)
}

/// Drop counts with the kernel's per-hold counts and their reasons.
fn counts_with_reasons(ts: u64, c: &[(u64, u32, u64)], holds: &[HoldCount]) -> Event {
    Event::DropCounts(DropCounts {
        ts_ns: ts,
        interval_ns: S,
        counts: c
            .iter()
            .map(|&(location, reason, count)| DropCount {
                location,
                reason,
                netns: NS_B,
                count,
            })
            .collect(),
        overflow: 0,
        holds: holds
            .iter()
            .map(
                |(start_ns, count, by_reason)| crate::decode::HoldDropCount {
                    start_ns: *start_ns,
                    count: *count,
                    by_reason: by_reason.clone(),
                },
            )
            .collect(),
    })
}

fn lock(ts: u64, op: LockOp) -> Event {
    Event::Lock(LockEvent {
        ts_ns: ts,
        tgid: 100,
        tid: 100,
        comm: Comm::new("kube-proxy"),
        owner: 0xA,
        dev: 25,
        ino: 42,
        op,
        nonblocking: false,
    })
}

fn hold_drops(out: &[Output]) -> Vec<&HoldDropsFact> {
    out.iter()
        .filter_map(|o| match o {
            Output::HoldDrops(h) => Some(h),
            _ => None,
        })
        .collect()
}

fn sample(ts: u64, location: u64, reason: u32) -> Event {
    Event::Drop(DropSample {
        ts_ns: ts,
        tgid: 0,
        tid: 0,
        location,
        netns: NS_B,
        ifindex: 5,
        reason,
        ethertype: 0x0800,
        l4proto: 17,
        saddr: Some("10.99.0.1".parse().unwrap()),
        daddr: Some("10.99.0.2".parse().unwrap()),
        sport: 40000,
        dport: 9999,
    })
}

fn count_facts(out: &[Output]) -> Vec<(DropClass, u64)> {
    out.iter()
        .filter_map(|o| match o {
            Output::DropCount(d) => Some((d.class, d.count)),
            _ => None,
        })
        .collect()
}

#[test]
fn conntrack_explains_netfilter_drops_first_then_rules() {
    let mut a = setup();
    let mut out = a.process_collect(&ct(2 * S, 30, 5, 100));
    assert!(
        matches!(&out[0], Output::Conntrack(c) if c.deltas.drop == 30 && c.fill_pct == 100
        && c.warning.is_some())
    );
    out = a.process_collect(&counts(2 * S, &[(NF, 12, 50), (UDP, 3, 7)]));
    assert_eq!(
        count_facts(&out),
        [
            (DropClass::ConntrackTableFull, 30),
            (DropClass::ConntrackInsertFailed, 5),
            (DropClass::NetfilterRuleDrop, 15),
            (DropClass::Other, 7)
        ]
    );
    // Next second: conntrack quiet, all rule drops.
    a.process_collect(&ct(3 * S, 0, 0, 10));
    let out = a.process_collect(&counts(3 * S, &[(NF, 12, 4)]));
    assert_eq!(count_facts(&out), [(DropClass::NetfilterRuleDrop, 4)]);
    let s = a.summary().drops;
    assert_eq!(s.total, 61);
    assert_eq!(s.by_class[&DropClass::ConntrackTableFull], 30);
    assert_eq!(s.by_class[&DropClass::NetfilterRuleDrop], 19);
    assert_eq!(s.by_location["nf_hook_slow"], 54);
    assert_eq!(s.by_reason["NO_SOCKET"], 7);
    assert_eq!(s.conntrack.drop, 30);
    assert_eq!(s.conntrack_warnings, 1);
}

#[test]
fn unwatched_netns_cannot_tell_rules_from_conntrack() {
    let mut a = setup();
    let out = a.process_collect(&counts(2 * S, &[(NF, 12, 9)]));
    assert_eq!(count_facts(&out), [(DropClass::NetfilterDrop, 9)]);
}

#[test]
fn drops_during_a_hold_are_reported_with_it() {
    let mut a = setup();
    a.process_collect(&lock(S + S / 2, LockOp::Acquired { exclusive: true }));
    a.process_collect(&ct(2 * S, 0, 0, 1));
    let out = a.process_collect(&sample(2 * S + 1, NF, 12));
    assert!(out.is_empty(), "samples wait for their tick");
    // 1,204 drops in the second, 1,200 of them while the hold went on.
    let out = a.process_collect(&counts_in_holds(
        3 * S,
        &[(NF, 12, 1204)],
        &[(S + S / 2, 1200)],
    ));
    let Some(Output::Drop(d)) = out.first() else {
        panic!("{out:?}")
    };
    assert_eq!(d.class, DropClass::NetfilterRuleDrop);
    assert_eq!(d.hold.as_ref().unwrap().agent, "kube-proxy");
    assert_eq!(d.location, "nf_hook_slow+0x7d");
    let p = d.packet.as_ref().unwrap();
    assert_eq!(
        (p.proto.as_str(), p.dport, p.daddr.as_str()),
        ("udp", Some(9999), "10.99.0.2")
    );
    let Some(Output::DropCount(c)) = out.get(1) else {
        panic!("{out:?}")
    };
    assert_eq!(c.holds.len(), 1);
    assert_eq!(c.example.as_ref().unwrap().sport, Some(40000));
    // The hold ends at 3.8 s; the counts up to 4 s complete it.
    let out = a.process_collect(&lock(3 * S + 800_000_000, LockOp::Released));
    assert!(out.iter().any(|o| matches!(o, Output::Hold(_))));
    assert!(!out.iter().any(|o| matches!(o, Output::HoldDrops(_))));
    let out = a.process_collect(&counts_in_holds(
        4 * S,
        &[(NF, 12, 6)],
        &[(S + S / 2, 1206)],
    ));
    let hd = hold_drops(&out);
    assert_eq!(hd.len(), 1);
    // The kernel's count, not the 1,210 of the seconds the hold overlapped.
    assert_eq!(hd[0].dropped, 1206);
    assert_eq!(hd[0].samples, 1);
    assert_eq!(hd[0].hold_ns, 2_300_000_000);
    assert_eq!(hd[0].agent, "kube-proxy");
    // Drops after the hold are not its.
    let out = a.process_collect(&counts(5 * S, &[(NF, 12, 99)]));
    assert!(matches!(&out[0], Output::DropCount(c) if c.holds.is_empty()));
    let s = a.summary().drops;
    assert_eq!(s.during_holds, 1206);
    assert_eq!(s.worst_holds[0].dropped, 1206);
    // For people: the kind of drop comes from the sample inside the hold.
    let text = crate::sinks::terminal::hold_drops_text(hd[0]);
    assert_eq!(
        text,
        "!! 1,206 packets dropped (netfilter rule drop) during kube-proxy's \
         2.30 s hold of /run/xtables.lock (pid 100)"
    );
}

/// The kernel's per-reason counts of a hold make its reasons exact, whatever was sampled:
/// 1,206 drops with one sample say NETFILTER_DROP 1,200 and NO_SOCKET 5, one drop of a
/// reason the kernel had no room for, and classes that add up to the whole.
#[test]
fn the_kernels_reasons_of_a_hold_are_exact() {
    let mut a = setup();
    a.process_collect(&lock(S + S / 2, LockOp::Acquired { exclusive: true }));
    a.process_collect(&ct(2 * S, 0, 0, 1));
    a.process_collect(&sample(2 * S + 1, NF, 12));
    a.process_collect(&counts_with_reasons(
        3 * S,
        &[(NF, 12, 1200), (UDP, 3, 6)],
        &[(S + S / 2, 1100, vec![(3, 5), (12, 1095)])],
    ));
    a.process_collect(&lock(3 * S + 800_000_000, LockOp::Released));
    let out = a.process_collect(&counts_with_reasons(
        4 * S,
        &[(NF, 12, 6)],
        &[(S + S / 2, 1206, vec![(3, 5), (12, 1200)])],
    ));
    let hd = hold_drops(&out);
    assert_eq!(hd.len(), 1, "{out:?}");
    let h = hd[0];
    assert!(h.exact_reasons);
    assert_eq!(h.dropped, 1206);
    assert_eq!(h.samples, 1);
    assert_eq!(h.by_reason["NETFILTER_DROP"], 1200);
    assert_eq!(h.by_reason["NO_SOCKET"], 5);
    assert_eq!(h.by_reason["(other reasons)"], 1);
    // NETFILTER_DROP as sampled (a rule's: conntrack refused none); the rest `other`.
    assert_eq!(h.by_class[&DropClass::NetfilterRuleDrop], 1200);
    assert_eq!(h.by_class[&DropClass::Other], 6);
    assert_eq!(h.by_class.values().sum::<u64>(), 1206);
    let text = crate::sinks::terminal::hold_drops_text(h);
    assert!(
        text.starts_with("!! 1,206 packets dropped (1,200 netfilter rule drop, 6 other:"),
        "{text}"
    );
}

#[test]
fn netfilter_drops_split_like_the_samples() {
    let sampled = [
        (DropClass::ConntrackTableFull, 1),
        (DropClass::NetfilterRuleDrop, 2),
        (DropClass::Other, 9),
    ]
    .into();
    let got = split_like(100, &sampled);
    assert_eq!(got.iter().map(|p| p.1).sum::<u64>(), 100);
    assert!(got.contains(&(DropClass::NetfilterRuleDrop, 67)), "{got:?}");
    assert!(
        got.contains(&(DropClass::ConntrackTableFull, 33)),
        "{got:?}"
    );
    assert_eq!(
        split_like(7, &Default::default()),
        [(DropClass::NetfilterDrop, 7)]
    );
    assert!(split_like(0, &sampled).is_empty());
}

#[test]
fn short_holds_are_reported_at_the_tick_that_covers_them() {
    let mut a = setup();
    // Holds that begin and end between two ticks (the usual iptables run), many of them.
    for i in 0..50 {
        let t = S + S / 2 + i * 1_000_000;
        a.process_collect(&lock(t, LockOp::Acquired { exclusive: true }));
        a.process_collect(&lock(t + 500_000, LockOp::Released));
    }
    // 7 drops in the second: the kernel saw them during the first 7 holds, one each.
    let in_holds: Vec<(u64, u64)> = (0..7).map(|i| (S + S / 2 + i * 1_000_000, 1)).collect();
    let out = a.process_collect(&counts_in_holds(2 * S, &[(NF, 12, 7)], &in_holds));
    let hd = hold_drops(&out);
    // Complete: reported now, not at the end; holds without a drop are not reported,
    // although the second they are in had drops.
    assert_eq!(hd.len(), 7, "{out:?}");
    assert!(hd.iter().all(|h| h.dropped == 1 && h.hold_ns == 500_000));
    assert_eq!(a.summary().drops.during_holds, 7);
    // Nothing left over for the end of tracing.
    let mut rest = Vec::new();
    a.finish(3 * S, &mut |o| rest.push(o));
    assert!(!rest.iter().any(|o| matches!(o, Output::HoldDrops(_))));
}

/// A shared hold by process `pid` (its own open file).
fn shared(ts: u64, pid: u32, op: LockOp) -> Event {
    let Event::Lock(mut e) = lock(ts, op) else {
        unreachable!()
    };
    (e.tgid, e.tid, e.owner) = (pid, pid, 0x1000 + u64::from(pid));
    Event::Lock(e)
}

#[test]
fn many_open_holds_each_get_their_own_end() {
    let mut a = setup();
    // 300 shared holds open when the counts of 1.65 s arrive: 300 tallies, each found
    // again when its hold ends, in another order than they were opened.
    for i in 0..300u32 {
        let t = S + S / 2 + u64::from(i) * 1_000;
        a.process_collect(&shared(t, 1000 + i, LockOp::Acquired { exclusive: false }));
    }
    let start = |i: u32| S + S / 2 + u64::from(i) * 1_000;
    let so_far: Vec<(u64, u64)> = (0..300).map(|i| (start(i), 7)).collect();
    let out = a.process_collect(&counts_in_holds(S + 650_000_000, &[(NF, 12, 7)], &so_far));
    assert!(hold_drops(&out).is_empty(), "none has ended");
    for i in (0..300u32).rev() {
        let t = S + 700_000_000 + u64::from(i) * 2_000;
        a.process_collect(&shared(t, 1000 + i, LockOp::Released));
    }
    let at_end: Vec<(u64, u64)> = (0..300).map(|i| (start(i), 10)).collect();
    let out = a.process_collect(&counts_in_holds(
        2 * S + 650_000_000,
        &[(NF, 12, 3)],
        &at_end,
    ));
    let hd = hold_drops(&out);
    assert_eq!(hd.len(), 300);
    let mut pids: Vec<u32> = hd.iter().map(|h| h.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 300, "each hold once");
    for h in &hd {
        let i = u64::from(h.pid - 1000);
        assert_eq!(h.hold_ns, 200_000_000 + i * 1_000, "{h:?}");
        assert_eq!(h.dropped, 10, "{h:?}");
    }
    let mut rest = Vec::new();
    a.finish(3 * S, &mut |o| rest.push(o));
    assert!(!rest.iter().any(|o| matches!(o, Output::HoldDrops(_))));
}

#[test]
fn finish_reports_open_holds_and_waiting_samples() {
    let mut a = setup();
    a.process_collect(&lock(S, LockOp::Acquired { exclusive: true }));
    a.process_collect(&counts_in_holds(2 * S, &[(UDP, 3, 2)], &[(S, 2)]));
    a.process_collect(&sample(2 * S + 5, UDP, 3));
    let mut out = Vec::new();
    a.finish(3 * S, &mut |o| out.push(o));
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Drop(d) if d.reason == "NO_SOCKET")));
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::HoldDrops(h) if h.dropped == 2 && h.hold_ns == 2 * S)));
}

#[test]
fn json_shapes() {
    let mut a = setup();
    a.process_collect(&ct(2 * S, 3, 0, 90));
    let out = a.process_collect(&counts(2 * S, &[(NF, 12, 3)]));
    let v = serde_json::to_value(&out[0]).unwrap();
    assert_eq!(v["type"], "drop_count");
    assert_eq!(v["class"], "conntrack_table_full");
    assert_eq!(v["reason"], "NETFILTER_DROP");
    assert_eq!(v["count"], 3);
    let mut a = setup();
    let out = a.process_collect(&ct(2 * S, 3, 1, 90));
    let v = serde_json::to_value(&out[0]).unwrap();
    assert_eq!(v["type"], "conntrack");
    assert_eq!(
        (v["drop"].as_u64(), v["insert_failed"].as_u64()),
        (Some(3), Some(1))
    );
    assert_eq!(v["fill_pct"], 90);
    let s = serde_json::to_value(a.summary()).unwrap();
    assert_eq!(s["drops"]["conntrack"]["drop"], 3);
    assert!(s["drops"]["by_class"].is_object());
}
