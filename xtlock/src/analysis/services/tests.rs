use super::*;
use crate::analysis::facts::{RefusalCountFact, RefusalKind, RuleWriteFact};
use crate::analysis::iptables_run::Backend;
use crate::event::CtEntry;

const NS: u32 = 4026531840;
const S: u64 = 1_000_000_000;

fn rule(parts: &[&str]) -> Rule {
    Rule(parts.iter().map(|p| p.to_string()).collect())
}

fn chain(name: &str, rules: Vec<Rule>) -> ChainState {
    ChainState {
        name: name.into(),
        policy: None,
        digest: crate::event::digest_rules(&rules),
        rules: Some(rules),
    }
}

fn sep(name: &str, svc: &str, ep: &str) -> ChainState {
    let ip = ep.split(':').next().unwrap_or(ep);
    chain(
        name,
        vec![
            rule(&[
                &format!("-s {ip}/32"),
                &format!("-m comment --comment \"{svc}\""),
                "-j KUBE-MARK-MASQ",
            ]),
            rule(&[
                "-p tcp",
                &format!("-m comment --comment \"{svc}\""),
                "-m tcp",
                &format!("-j DNAT --to-destination {ep}"),
            ]),
        ],
    )
}

/// kube-proxy's nat table for `default/web:http` with the endpoints given (a SEP chain each).
fn nat(ts_ns: u64, pid: u32, eps: &[(&str, &str)]) -> RuleTable {
    let mut svc_rules = Vec::new();
    let mut chains = vec![chain(
        "KUBE-SERVICES",
        vec![rule(&[
            "-d 10.96.0.10/32",
            "-p tcp",
            "-m comment --comment \"default/web:http cluster IP\"",
            "-m tcp --dport 80",
            "-j KUBE-SVC-WEB",
        ])],
    )];
    for (i, (name, ep)) in eps.iter().enumerate() {
        let mut r = vec![format!("-m comment --comment \"default/web:http -> {ep}\"")];
        if i + 1 < eps.len() {
            r.push(format!(
                "-m statistic --mode random --probability {:.11}",
                1.0 / (eps.len() - i) as f64
            ));
        }
        r.push(format!("-j {name}"));
        svc_rules.push(Rule(r));
        chains.push(sep(name, "default/web:http", ep));
    }
    chains.push(chain("KUBE-SVC-WEB", svc_rules));
    RuleTable {
        ts_ns,
        netns: NS,
        family: "ip".into(),
        table: "nat".into(),
        after_pid: pid,
        skipped: String::new(),
        chains,
        more: false,
    }
}

fn gone(ts_ns: u64, addr: &str) -> AddrPresence {
    AddrPresence {
        ts_ns,
        netns: NS,
        addr: addr.parse().expect("addr"),
        why: AddrWhy::LinkDeleted,
        link: "veth1".into(),
        live: true,
    }
}

fn write(ts_ns: u64, pid: u32, agent: &str) -> Output {
    Output::RuleWrite(RuleWriteFact {
        ts_ns,
        pid,
        agent: agent.into(),
        backend: Backend::Legacy,
        program: "iptables-legacy-restore".into(),
        binary: None,
        netns: NS,
        table: Some("ip:nat".into()),
    })
}

fn refused(ts_ns: u64, dest: &str, count: u64) -> Output {
    Output::RefusalCount(RefusalCountFact {
        ts_ns,
        interval_ns: S,
        netns: NS,
        kind: RefusalKind::IcmpUnreachable,
        detail: "host unreachable".into(),
        dest: dest.into(),
        count,
        hold: None,
        rule: None,
    })
}

fn facts(
    t: &mut ServiceTracker,
    f: impl FnOnce(&mut ServiceTracker, &mut Vec<Output>),
) -> Vec<StaleEndpointFact> {
    let mut v = Vec::new();
    f(t, &mut v);
    v.into_iter()
        .filter_map(|o| match o {
            Output::StaleEndpoint(s) => Some(s),
            _ => None,
        })
        .collect()
}

#[test]
fn the_model_follows_kube_proxys_iptables_layout() {
    let mut t = ServiceTracker::default();
    let two = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    t.on_table(&nat(S, 10, &two), &mut |_| {});
    let ep: SocketAddr = "10.244.1.5:8080".parse().expect("ep");
    assert_eq!(t.services_of(NS, ep), ["default/web:http"]);
    let s = t.summary();
    assert_eq!((s.services, s.endpoints), (1, 2));
    // Unchanged chains come as digests only: the model keeps them.
    let mut again = nat(2 * S, 11, &two);
    for c in &mut again.chains {
        c.rules = None;
    }
    t.on_table(&again, &mut |_| {});
    assert_eq!(t.summary().endpoints, 2);
    // A chain the next read does not name is gone, with its endpoint.
    let mut one = nat(2 * S + 1, 11, &two);
    one.chains.retain(|c| c.name != "KUBE-SEP-B");
    for c in &mut one.chains {
        c.rules = None;
    }
    t.on_table(&one, &mut |_| {});
    assert_eq!(t.summary().endpoints, 1);
    // Without comments (over 1,000 endpoints), the service chain names the service.
    let mut bare = nat(3 * S, 12, &two);
    for c in &mut bare.chains {
        for r in c.rules.iter_mut().flatten() {
            r.0.retain(|p| !p.starts_with("-m comment"));
        }
    }
    t.on_table(&bare, &mut |_| {});
    assert_eq!(t.services_of(NS, ep), ["KUBE-SVC-WEB"]);
}

#[test]
fn a_gone_endpoint_is_stale_until_the_write_that_removes_it() {
    let mut t = ServiceTracker::default();
    let two = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    t.on_table(&nat(S, 10, &two), &mut |_| {});
    let got = facts(&mut t, |t, v| {
        t.on_addr(&gone(10 * S, "10.244.1.5"), &mut |o| v.push(o));
        // kube-proxy's restore waited behind calico-node, then wrote.
        t.observe(&refused(10 * S, "10.244.1.5:8080", 3));
        t.observe(&refused(11 * S, "10.244.1.6:8080", 5));
        t.observe(&write(11 * S + 600_000_000, 77, "kube-proxy"));
        t.on_table(&nat(11 * S + 700_000_000, 77, &two[1..]), &mut |_| {});
        // Refused after the fix: connections DNATed before it, failing late.
        t.observe(&refused(13 * S, "10.244.1.5:8080", 2));
        t.tick(15 * S, &mut |o| v.push(o));
        // Said open at once; closed only after the grace.
        assert!(
            v.iter().all(|o| matches!(o, Output::StaleEndpointOpen(_))),
            "reported before the grace: {v:?}"
        );
        t.tick(17 * S, &mut |o| v.push(o));
    });
    assert_eq!(got.len(), 1, "{got:?}");
    let f = &got[0];
    assert_eq!(f.service, "default/web:http");
    assert_eq!(f.endpoint, "10.244.1.5:8080");
    assert_eq!(f.stale_ns, 1_600_000_000);
    assert!(!f.still_routed);
    assert_eq!(f.connections, 5);
    assert_eq!(f.outcomes["icmp_unreachable: host unreachable"], 5);
    let fix = f.fix.as_ref().expect("fix");
    assert_eq!((fix.pid, fix.agent.as_ref()), (77, "kube-proxy"));
    assert!(fix.exact);
    assert_eq!(t.summary().stale_windows, 1);
}

#[test]
fn still_routed_at_the_end_and_writes_before_the_death_are_not_stale() {
    let mut t = ServiceTracker::default();
    let two = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    t.on_table(&nat(S, 10, &two), &mut |_| {});
    let got = facts(&mut t, |t, v| {
        // B: removed by a write before its pod went, read after: not stale.
        t.observe(&write(2 * S, 20, "kube-proxy"));
        t.on_addr(&gone(2 * S + 10_000_000, "10.244.1.6"), &mut |o| v.push(o));
        t.on_table(&nat(2 * S + 60_000_000, 20, &two[..1]), &mut |_| {});
        // A: gone, never fixed.
        t.on_addr(&gone(3 * S, "10.244.1.5"), &mut |o| v.push(o));
        t.tick(20 * S, &mut |o| v.push(o));
        t.finish(30 * S, &mut |o| v.push(o));
    });
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].endpoint, "10.244.1.5:8080");
    assert!(got[0].still_routed);
    assert_eq!(got[0].stale_ns, 27 * S);
}

#[test]
fn a_read_that_routes_to_an_address_already_gone_opens_its_window() {
    let mut t = ServiceTracker::default();
    let got = facts(&mut t, |t, v| {
        t.on_addr(&gone(S, "10.244.1.5"), &mut |o| v.push(o));
        t.on_table(
            &nat(2 * S, 10, &[("KUBE-SEP-A", "10.244.1.5:8080")]),
            &mut |_| {},
        );
        // The address is back (the IP reused): the window ends there.
        let mut back = gone(4 * S, "10.244.1.5");
        back.why = AddrWhy::Neighbour;
        t.on_addr(&back, &mut |o| v.push(o));
    });
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].stale_ns, 3 * S);
    assert!(got[0].still_routed);
}

#[test]
fn nftables_mode_endpoint_chains_route_while_they_dnat() {
    let mut t = ServiceTracker::default();
    let name = "endpoint-5OJB2KTY-default/web/tcp/http__10.244.1.5/8080";
    let table = |ts: u64, rules: Vec<Rule>| RuleTable {
        ts_ns: ts,
        netns: NS,
        family: "nft ip".into(),
        table: "kube-proxy".into(),
        after_pid: 9,
        skipped: String::new(),
        chains: vec![chain(name, rules)],
        more: false,
    };
    t.on_table(
        &table(
            S,
            vec![rule(&[
                "meta l4proto tcp",
                "-j DNAT --to-destination 10.244.1.5:8080",
            ])],
        ),
        &mut |_| {},
    );
    let ep: SocketAddr = "10.244.1.5:8080".parse().expect("ep");
    assert_eq!(t.services_of(NS, ep), ["default/web:http"]);
    // Flushed (deleted a second later): routes nowhere.
    t.on_table(&table(2 * S, vec![]), &mut |_| {});
    assert!(t.services_of(NS, ep).is_empty());
}

#[test]
fn dnat_targets_parse_as_iptables_save_writes_them() {
    let d = |t: &str| dnat_of(&rule(&[t]));
    assert_eq!(
        d("-j DNAT --to-destination 10.244.1.5:8080"),
        Some("10.244.1.5:8080".parse().expect("sa"))
    );
    assert_eq!(
        d("-j DNAT --to-destination [fd00::5]:80"),
        Some("[fd00::5]:80".parse().expect("sa"))
    );
    assert_eq!(
        d("-j DNAT --to-destination 10.0.0.1-10.0.0.9:80-90"),
        Some(SocketAddr::new("10.0.0.1".parse().expect("ip"), 0))
    );
    assert_eq!(d("-j DNAT [rev 2 0123456789ab]"), None);
    assert_eq!(d("-j MASQUERADE"), None);
}

fn ct(id: u32, proto: u8, state: u8, replied: bool, reply_src: &str, packets: u64) -> CtEntry {
    CtEntry {
        id,
        proto,
        tcp_state: state,
        status: if replied { 0x22 } else { 0x20 },
        orig_src: "10.199.0.2:40000".parse().expect("addr"),
        orig_dst: "10.96.0.10:80".parse().expect("addr"),
        reply_src: reply_src.parse().expect("addr"),
        packets,
        timeout_s: 100,
    }
}

fn ct_read(ts_ns: u64, entries: Vec<CtEntry>) -> CtEntries {
    CtEntries {
        ts_ns,
        netns: NS,
        addr: "10.244.1.5".parse().expect("addr"),
        entries,
        more: 0,
    }
}

/// Conntrack reads of a gone endpoint: each TCP entry that never saw a reply is a connection
/// sent there (those beyond the refused ones unanswered, each counted once across reads);
/// after the fix, what conntrack still steers there is said: a UDP flow and an established
/// connection, not the failed or closed ones, nor entries to another port.
#[test]
fn conntrack_reads_count_unanswered_connections_and_flows_kept() {
    let mut t = ServiceTracker::default();
    let two = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    t.on_table(&nat(S, 10, &two), &mut |_| {});
    let ep = "10.244.1.5:8080";
    let got = facts(&mut t, |t, v| {
        t.on_addr(&gone(10 * S, "10.244.1.5"), &mut |o| v.push(o));
        // Three connections unanswered, seen over two reads; one closed before; one to
        // another port of the pod.
        t.on_ct(&ct_read(
            11 * S,
            vec![
                ct(1, 6, 1, false, ep, 2),
                ct(2, 6, 1, false, ep, 1),
                ct(3, 6, 7, true, ep, 9),
                ct(4, 6, 1, false, "10.244.1.5:9090", 1),
            ],
        ));
        t.observe(&refused(11 * S, ep, 1));
        t.on_ct(&ct_read(
            12 * S,
            vec![ct(1, 6, 1, false, ep, 3), ct(5, 6, 1, false, ep, 1)],
        ));
        t.observe(&write(12 * S + 500_000_000, 77, "kube-proxy"));
        t.on_table(&nat(12 * S + 600_000_000, 77, &two[1..]), &mut |_| {});
        // After the fix: conntrack still steers a UDP flow and an established connection.
        t.on_ct(&ct_read(
            13 * S,
            vec![
                ct(1, 6, 1, false, ep, 3),
                ct(6, 17, 0, true, ep, 40),
                ct(7, 6, 3, true, ep, 12),
                ct(3, 6, 7, true, ep, 9),
            ],
        ));
        t.tick(18 * S, &mut |o| v.push(o));
    });
    assert_eq!(got.len(), 1, "{got:?}");
    let f = &got[0];
    // Unreplied TCP entries 1, 2, 5: one of them refused, two unanswered.
    assert_eq!(f.connections, 3, "{f:?}");
    assert_eq!(f.outcomes["unanswered"], 2, "{f:?}");
    assert_eq!(f.outcomes["icmp_unreachable: host unreachable"], 1);
    let c = f.conntrack.as_ref().expect("flows kept");
    assert_eq!((c.entries, c.udp, c.tcp, c.packets), (2, 1, 1, 52), "{c:?}");
}

fn up(ts_ns: u64, addr: &str, live: bool) -> AddrPresence {
    AddrPresence {
        ts_ns,
        netns: NS,
        addr: addr.parse().expect("addr"),
        why: AddrWhy::Route,
        link: "cali2".into(),
        live,
    }
}

fn programmed(v: Vec<Output>) -> Vec<EndpointProgrammedFact> {
    v.into_iter()
        .filter_map(|o| match o {
            Output::EndpointProgrammed(p) => Some(p),
            _ => None,
        })
        .collect()
}

#[test]
fn a_new_endpoint_is_timed_from_its_address_to_the_write_that_routes_to_it() {
    let mut t = ServiceTracker::default();
    let a = [("KUBE-SEP-A", "10.244.1.5:8080")];
    let ab = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    let mut v = Vec::new();
    // Found by the dump at start: there before, never timed.
    t.on_addr(&up(S / 2, "10.244.1.7", false), &mut |o| v.push(o));
    t.on_table(&nat(S, 10, &a), &mut |o| v.push(o));
    // The new pod's route comes up; an unrelated write (A only) is read meanwhile.
    t.on_addr(&up(5 * S, "10.244.1.6", true), &mut |o| v.push(o));
    t.observe(&write(5 * S + 200_000_000, 11, "kube-proxy"));
    t.on_table(&nat(5 * S + 210_000_000, 11, &a), &mut |o| v.push(o));
    // kube-proxy routes to B.
    t.observe(&write(6 * S + 500_000_000, 12, "kube-proxy"));
    t.on_table(&nat(6 * S + 520_000_000, 12, &ab), &mut |o| v.push(o));
    // Read again: said once.
    t.observe(&write(7 * S, 13, "kube-proxy"));
    t.on_table(&nat(7 * S + 10_000_000, 13, &ab), &mut |o| v.push(o));
    let got = programmed(v);
    assert_eq!(got.len(), 1, "{got:?}");
    let p = &got[0];
    assert_eq!(
        (p.service.as_str(), p.endpoint.as_str()),
        ("default/web:http", "10.244.1.6:8080")
    );
    assert_eq!(p.latency_ns, 1_500_000_000);
    assert_eq!((p.up, p.link.as_str()), ("route", "cali2"));
    assert!(p.write.exact);
    assert_eq!((p.write.pid, p.write.agent.as_ref()), (12, "kube-proxy"));
    let s = t.summary();
    assert_eq!((s.programmed, s.programming_ns_max), (1, 1_500_000_000));
}

#[test]
fn a_first_read_an_address_already_routed_or_gone_make_no_latency() {
    let mut t = ServiceTracker::default();
    let ab = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    let mut v = Vec::new();
    // Up live, but the first read of the netns finds it routed: it was before.
    t.on_addr(&up(S, "10.244.1.6", true), &mut |o| v.push(o));
    t.on_table(&nat(2 * S, 10, &ab), &mut |o| v.push(o));
    // Up again while routed (a moved route): not new.
    t.on_addr(&up(3 * S, "10.244.1.5", true), &mut |o| v.push(o));
    t.on_table(&nat(4 * S, 11, &ab[..1]), &mut |o| v.push(o));
    t.on_table(&nat(5 * S, 12, &ab), &mut |o| v.push(o));
    // Up, then gone before any Service took it.
    t.on_addr(&up(6 * S, "10.244.1.8", true), &mut |o| v.push(o));
    t.on_addr(&gone(7 * S, "10.244.1.8"), &mut |o| v.push(o));
    // Up and never routed: forgotten after the wait.
    t.on_addr(&up(8 * S, "10.244.1.9", true), &mut |o| v.push(o));
    t.tick(8 * S + UP_WAIT_NS + 2 * S, &mut |o| v.push(o));
    assert!(t.up.is_empty(), "{:?}", t.up);
    assert!(programmed(v).is_empty());
}

/// The opening facts of `v`, in order.
fn opened(v: &[Output]) -> Vec<&StaleEndpointOpenFact> {
    v.iter()
        .filter_map(|o| match o {
            Output::StaleEndpointOpen(f) => Some(f),
            _ => None,
        })
        .collect()
}

#[test]
fn a_window_is_said_when_it_opens_before_it_closes() {
    let mut t = ServiceTracker::default();
    let two = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    t.on_table(&nat(S, 10, &two), &mut |_| {});
    let mut v = Vec::new();
    // Gone while routed: said at once, at the disappearance.
    t.on_addr(&gone(10 * S, "10.244.1.5"), &mut |o| v.push(o));
    let o = opened(&v);
    assert_eq!(o.len(), 1, "{v:?}");
    assert_eq!(
        (
            o[0].ts_ns,
            o[0].gone_ns,
            o[0].service.as_str(),
            o[0].endpoint.as_str()
        ),
        (10 * S, 10 * S, "default/web:http", "10.244.1.5:8080")
    );
    assert_eq!(v.len(), 1, "nothing else yet: {v:?}");
    // A second disappearance of the same address opens nothing new.
    t.on_addr(&gone(10 * S + 1, "10.244.1.5"), &mut |o| v.push(o));
    assert_eq!(opened(&v).len(), 1, "{v:?}");
    // Fixed, then closed after the grace: the close comes after the opening.
    t.observe(&write(11 * S, 77, "kube-proxy"));
    t.on_table(&nat(11 * S + 1, 77, &two[1..]), &mut |o| v.push(o));
    t.tick(17 * S, &mut |o| v.push(o));
    let kinds: Vec<&str> = v
        .iter()
        .map(|o| match o {
            Output::StaleEndpointOpen(_) => "open",
            Output::StaleEndpoint(_) => "close",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["open", "close"]);
    // A read that routes to an address gone before: said at the read, with how long ago.
    let mut w = Vec::new();
    t.on_addr(&gone(20 * S, "10.244.1.9"), &mut |o| w.push(o));
    assert!(opened(&w).is_empty(), "routed by nothing yet: {w:?}");
    t.on_table(
        &nat(22 * S, 78, &[("KUBE-SEP-C", "10.244.1.9:8080")]),
        &mut |o| w.push(o),
    );
    let o = opened(&w);
    assert_eq!(o.len(), 1, "{w:?}");
    assert_eq!((o[0].ts_ns, o[0].gone_ns), (22 * S, 20 * S));
}

/// An endpoint on another node: no address of this node vanishes, but conntrack showed its
/// connections unanswered. Its window opens in the namespace whose conntrack saw it (not in
/// another that routes to the same address), and ends when it answers again, without making
/// it a new endpoint.
#[test]
fn an_unanswered_endpoint_is_dead_where_it_went_unanswered_until_it_answers() {
    let mut t = ServiceTracker::default();
    let remote = [("KUBE-SEP-R", "10.244.2.5:8080")];
    t.on_table(&nat(S, 10, &remote), &mut |_| {});
    let mut other = nat(S, 10, &remote);
    other.netns = NS + 1;
    t.on_table(&other, &mut |_| {});
    let mut opened = Vec::new();
    let got = facts(&mut t, |t, v| {
        let mut quiet = gone(3 * S, "10.244.2.5");
        quiet.why = AddrWhy::Unanswered;
        quiet.link = String::new();
        t.on_addr(&quiet, &mut |o| {
            if let Output::StaleEndpointOpen(f) = &o {
                opened.push((f.netns, f.gone));
            }
            v.push(o)
        });
        let mut back = quiet.clone();
        back.ts_ns = 9 * S;
        back.why = AddrWhy::Answering;
        t.on_addr(&back, &mut |o| v.push(o));
    });
    assert_eq!(opened, [(NS, "unanswered")]);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].netns, got[0].stale_ns), (NS, 6 * S));
    assert!(got[0].still_routed);
    assert!(t.up.is_empty(), "answering again is not a new endpoint");
}

fn ipvs(ts_ns: u64, dests: &[(&str, u32)]) -> crate::event::IpvsTable {
    crate::event::IpvsTable {
        ts_ns,
        netns: NS,
        services: vec![crate::event::IpvsService {
            proto: 17,
            addr: Some("10.96.0.10:53".parse().expect("vip")),
            fwmark: 0,
            dests: dests
                .iter()
                .map(|(a, w)| crate::event::IpvsDest {
                    addr: a.parse().expect("dest"),
                    weight: *w,
                    active: 0,
                    inactive: 0,
                })
                .collect(),
        }],
    }
}

/// kube-proxy's ipvs mode: a real server whose pod is gone, still of weight 1, is routed to
/// until ipvsadm sets it to weight 0 (graceful termination: no new connections), which the
/// hooks name; a real server already at weight 0 routes nothing.
#[test]
fn an_ipvs_real_server_whose_address_is_gone_is_stale_until_its_weight_is_0() {
    let mut t = ServiceTracker::default();
    let mut drained = Vec::new();
    t.on_ipvs(
        &ipvs(
            S,
            &[
                ("10.244.1.5:5353", 1),
                ("10.244.1.6:5353", 1),
                ("10.244.1.7:5353", 0),
            ],
        ),
        &mut |_| {},
    );
    assert_eq!(t.summary().endpoints, 2);
    let got = facts(&mut t, |t, v| {
        t.on_addr(&gone(2 * S, "10.244.1.5"), &mut |o| v.push(o));
        t.on_addr(&gone(2 * S, "10.244.1.7"), &mut |o| v.push(o));
        t.observe(&Output::Ipvs(crate::analysis::facts::IpvsFact {
            ts_ns: 3 * S,
            event: "dest_edited",
            protocol: "udp",
            service: "10.96.0.10:53".into(),
            backend: "10.244.1.5:5353".into(),
            client: None,
            weight: 0,
            pid: Some(42),
            comm: Some("ipvsadm".into()),
            ret: Some(0),
            backend_state: None,
            action: None,
            packets: None,
            first_packet_ns: None,
            last_packet_ns: None,
            entry_left_ns: None,
            expired_ns: None,
            change: None,
        }));
        t.on_ipvs(
            &ipvs(
                3 * S + 400_000_000,
                &[("10.244.1.5:5353", 0), ("10.244.1.6:5353", 1)],
            ),
            &mut |o| v.push(o),
        );
        t.tick(10 * S, &mut |o| v.push(o));
        // Drained and removed 2 s after its weight went to 0.
        t.on_ipvs(
            &ipvs(5 * S + 400_000_000, &[("10.244.1.6:5353", 1)]),
            &mut |o| v.push(o),
        );
        drained.extend(v.iter().filter_map(|o| match o {
            Output::IpvsDrained(d) => Some(d.clone()),
            _ => None,
        }));
    });
    // 10.244.1.7 was at weight 0 from the first read, and 10.244.1.5 from its second.
    assert_eq!(drained.len(), 2, "{drained:?}");
    let d = drained
        .iter()
        .find(|d| d.endpoint == "10.244.1.5:5353")
        .expect("drained");
    assert_eq!(
        (d.drained_ns, d.removed, d.gone),
        (2 * S, true, Some("link deleted"))
    );
    assert_eq!(got.len(), 1, "{got:?}");
    let f = &got[0];
    assert_eq!(
        (f.service.as_str(), f.endpoint.as_str()),
        ("udp/10.96.0.10:53", "10.244.1.5:5353")
    );
    assert_eq!(f.stale_ns, S);
    let fix = f.fix.as_ref().expect("fixed");
    assert_eq!(
        (fix.pid, fix.agent.as_ref(), fix.exact),
        (42, "ipvsadm", true)
    );
}

#[test]
fn a_read_naming_the_last_reads_chains_keeps_them_and_still_sees_a_changed_one() {
    let mut t = ServiceTracker::default();
    let key = (NS, "ip".to_string(), "nat".to_string());
    let same = |t: &ServiceTracker| t.tables[&key].same_order;
    let ep = |s: &str| -> SocketAddr { s.parse().expect("ep") };
    let two = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    let first = nat(S, 10, &two);
    t.on_table(&first, &mut |_| {});
    assert_eq!(same(&t), 0);
    // The same names (shared, as a capture reader hands them), all as digests.
    let digests = |ts_ns: u64, from: &RuleTable| {
        let mut r = from.clone();
        r.ts_ns = ts_ns;
        for c in &mut r.chains {
            c.rules = None;
        }
        r
    };
    t.on_table(&digests(2 * S, &first), &mut |_| {});
    assert_eq!(same(&t), 1);
    assert_eq!(t.summary().endpoints, 2);
    // Same names, one chain sent with new rules: its endpoint moved.
    let moved = nat(3 * S, 11, &[two[0], ("KUBE-SEP-B", "10.244.1.9:8080")]);
    let mut r = digests(3 * S, &first);
    r.chains[2] = moved.chains[2].clone();
    assert_eq!(r.chains[2].name, "KUBE-SEP-B");
    t.on_table(&r, &mut |_| {});
    assert_eq!(same(&t), 2);
    assert_eq!(
        t.services_of(NS, ep("10.244.1.9:8080")),
        ["default/web:http"]
    );
    assert!(t.services_of(NS, ep("10.244.1.6:8080")).is_empty());
    assert_eq!(t.summary().endpoints, 2);
    // A chain renamed: another list, looked up chain by chain; the old one is gone.
    let renamed = nat(4 * S, 12, &[two[0], ("KUBE-SEP-C", "10.244.1.9:8080")]);
    t.on_table(&renamed, &mut |_| {});
    assert_eq!(same(&t), 2);
    assert!(!t.tables[&key].chains.contains_key("KUBE-SEP-B"));
    assert_eq!(t.summary().endpoints, 2);
}

#[test]
fn a_read_naming_a_chain_twice_is_never_taken_for_the_same_list() {
    let mut t = ServiceTracker::default();
    let key = (NS, "ip".to_string(), "nat".to_string());
    let ep = |s: &str| -> SocketAddr { s.parse().expect("ep") };
    let two = [
        ("KUBE-SEP-A", "10.244.1.5:8080"),
        ("KUBE-SEP-B", "10.244.1.6:8080"),
    ];
    t.on_table(&nat(S, 10, &two), &mut |_| {});
    // KUBE-SEP-B named twice: first with other rules, last as its digest; the last wins.
    let mut dup = nat(2 * S, 11, &two);
    for c in &mut dup.chains {
        c.rules = None;
    }
    let other = nat(2 * S, 11, &[two[0], ("KUBE-SEP-B", "10.244.1.9:8080")]);
    dup.chains[2] = other.chains[2].clone();
    let mut last = dup.chains[2].clone();
    last.rules = None;
    dup.chains.push(last);
    for _ in 0..2 {
        t.on_table(&dup, &mut |_| {});
        assert_eq!(t.tables[&key].same_order, 0);
        assert!(t.services_of(NS, ep("10.244.1.9:8080")).is_empty());
        assert_eq!(
            t.services_of(NS, ep("10.244.1.6:8080")),
            ["default/web:http"]
        );
    }
}
