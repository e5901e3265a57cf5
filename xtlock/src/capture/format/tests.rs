use super::*;
use crate::shared::SharedStr;

#[test]
fn varints() {
    for v in [
        0,
        1,
        127,
        128,
        300,
        u64::from(u32::MAX),
        u64::MAX - 1,
        u64::MAX,
    ] {
        let mut b = Vec::new();
        put_varint(&mut b, v);
        let mut pos = 0;
        assert_eq!(get_varint(&b, &mut pos), Some(v));
        assert_eq!(pos, b.len());
        // Every strict prefix is incomplete.
        for n in 0..b.len() {
            let mut pos = 0;
            assert_eq!(get_varint(&b[..n], &mut pos), None);
        }
    }
    // Past 64 bits.
    let mut pos = 0;
    assert_eq!(get_varint(&[0xff; 10], &mut pos), None);
    let mut pos = 0;
    assert_eq!(
        get_varint(
            &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02],
            &mut pos
        ),
        None
    );
}

#[test]
fn block_header_layout() {
    let h = BlockHeader {
        seq: 7,
        records: 3,
        raw_len: 100,
        stored_len: 60,
        compression: COMPRESSION_LZ4,
        payload_crc: 0xdead_beef,
    };
    let b = h.encode();
    assert_eq!(&b[..4], b"XTLB");
    assert_eq!(&b[4..8], &7u32.to_le_bytes());
    assert_eq!(b[20], 1);
    assert_eq!(&b[21..24], &[0, 0, 0]);
    let (stored, computed) = BlockHeader::checksums(&b);
    assert_eq!(stored, computed);
    assert_eq!(BlockHeader::decode(&b), h);
}

#[test]
fn proc_encoding() {
    let p = ProcInfo {
        ts_ns: 123_456_789,
        pid: 4242,
        ppid: 1,
        comm: Comm::new("iptables"),
        argv: vec!["iptables".into(), "-w".into(), "".into()],
        cgroup: Some("/kubepods.slice/x".into()),
        exe: None,
    };
    let mut b = Vec::new();
    encode_proc(&p, &mut b);
    assert_eq!(decode_proc(&b), Ok(p.clone()));
    // Trailing fields from a newer writer are ignored.
    b.extend_from_slice(&[1, 2, 3]);
    assert_eq!(decode_proc(&b), Ok(p.clone()));
    // With the resolved program and its version.
    let p = ProcInfo {
        exe: Some(Box::new(crate::event::ExeInfo {
            path: "/usr/sbin/xtables-nft-multi".into(),
            version: Some("1.8.9 (nf_tables)".into()),
        })),
        ..p
    };
    let mut b = Vec::new();
    encode_proc(&p, &mut b);
    assert_eq!(decode_proc(&b), Ok(p.clone()));
    // A huge argc does not allocate.
    let mut b = Vec::new();
    for v in [1, 2, 3, 0, u64::MAX] {
        put_varint(&mut b, v);
    }
    assert!(decode_proc(&b).is_err());
}

#[test]
fn drop_records_round_trip() {
    let evs = [
        Event::DropSetup {
            ts_ns: 5,
            has_reason: true,
            host_netns: 4026531840,
            names: vec![(2, "NOT_SPECIFIED".into()), (12, "NETFILTER_DROP".into())],
        },
        Event::KernelSymbol {
            ts_ns: 6,
            addr: 0xffff_ffff_81a0_009c,
            name: "nf_hook_slow".into(),
            offset: 0x9c,
        },
        Event::DropCounts(DropCounts {
            ts_ns: 7,
            interval_ns: 1_000_000_000,
            counts: vec![DropCount {
                location: 0xffff_ffff_81a0_009c,
                reason: 12,
                netns: 4026532000,
                count: 1_000_000,
            }],
            overflow: 3,
            holds: vec![
                HoldDropCount {
                    start_ns: 6,
                    count: 88,
                    by_reason: vec![(3, 7), (12, 80)],
                },
                HoldDropCount {
                    start_ns: 1 << 40,
                    count: 1,
                    by_reason: vec![],
                },
            ],
        }),
        Event::IpvsCounts(IpvsCounts {
            ts_ns: 9,
            interval_ns: 1_000_000_000,
            counts: vec![
                crate::decode::IpvsCount {
                    protocol: 17,
                    service: "10.96.0.10:53".parse().unwrap(),
                    backend: "10.0.1.5:53".parse().unwrap(),
                    state: crate::decode::DestState::Removed,
                    count: 25,
                },
                crate::decode::IpvsCount {
                    protocol: 6,
                    service: "[fd00::a]:443".parse().unwrap(),
                    backend: "[fd00::1:5]:8443".parse().unwrap(),
                    state: crate::decode::DestState::Ok,
                    count: 1 << 40,
                },
            ],
            overflow: 2,
        }),
        Event::RefusalCounts(crate::decode::RefusalCounts {
            ts_ns: 10,
            interval_ns: 1_000_000_000,
            counts: vec![
                crate::decode::RefusalCount {
                    hold_start_ns: 1 << 40,
                    netns: 4026532000,
                    kind: xtlock_common::REFUSAL_ICMP_UNREACH,
                    detail: 3,
                    addr: Some("10.96.0.15".parse().unwrap()),
                    port: 80,
                    count: 37,
                },
                crate::decode::RefusalCount {
                    hold_start_ns: 0,
                    netns: 1,
                    kind: xtlock_common::REFUSAL_RST_SENT,
                    detail: xtlock_common::REFUSAL_NO_DETAIL,
                    addr: Some("fd00::a".parse().unwrap()),
                    port: 443,
                    count: 1,
                },
                crate::decode::RefusalCount {
                    hold_start_ns: 0,
                    netns: 1,
                    kind: xtlock_common::REFUSAL_RST_RECEIVED,
                    detail: xtlock_common::REFUSAL_NO_DETAIL,
                    addr: None,
                    port: 0,
                    count: 2,
                },
            ],
            overflow: 4,
            reset_reasons: vec![(1, "NO_SOCKET".into())],
        }),
        Event::Pod(Box::new(crate::decode::PodInfo {
            ts_ns: 9,
            container_id: "3f6e4b0c2a1d".into(),
            pod_uid: "0d2b3c4e-5f6a-4c6e-9a1f-5f3c1e2a8b7d".into(),
            namespace: "kube-system".into(),
            pod: "kube-proxy-x7k2p".into(),
            container: "kube-proxy".into(),
        })),
        Event::Conntrack(Box::new(ConntrackStats {
            ts_ns: 8,
            interval_ns: 999,
            netns: 1,
            deltas: ConntrackCounters {
                drop: 1,
                early_drop: 2,
                insert_failed: 3,
                invalid: 4,
                search_restart: 5,
                clash_resolve: 6,
                chaintoolong: 7,
            },
            count: 100,
            max: 128,
        })),
        Event::RuleTable(Box::new(crate::event::RuleTable {
            ts_ns: 77,
            netns: 4026531840,
            family: "ip".into(),
            table: "filter".into(),
            after_pid: 12,
            skipped: String::new(),
            more: true,
            chains: vec![
                crate::event::ChainState {
                    name: "INPUT".into(),
                    policy: Some("ACCEPT".into()),
                    digest: 99,
                    rules: None,
                },
                crate::event::ChainState {
                    name: "KUBE-FIREWALL".into(),
                    policy: None,
                    digest: 7,
                    rules: Some(vec![crate::event::Rule(vec![
                        "-m mark --mark 0x8000/0x8000".into(),
                        "-j DROP".into(),
                    ])]),
                },
            ],
        })),
        // An nf_tables table: the same record, its family says which.
        Event::RuleTable(Box::new(crate::event::RuleTable {
            ts_ns: 78,
            netns: 4026531840,
            family: "nft inet".into(),
            table: "firewalld".into(),
            after_pid: 13,
            skipped: String::new(),
            chains: vec![crate::event::ChainState {
                name: "filter_INPUT".into(),
                policy: Some("DROP".into()),
                digest: 5,
                rules: Some(vec![crate::event::Rule(vec![
                    "-m comment --comment \"x\"".into(),
                    "meta mark & 0x8000 == 0x8000".into(),
                    "-j filter_IN_public".into(),
                ])]),
            }],
            more: false,
        })),
        Event::Addr(Box::new(crate::event::AddrPresence {
            ts_ns: 79,
            netns: 4026531840,
            addr: "10.244.1.5".parse().unwrap(),
            why: crate::event::AddrWhy::Neighbour,
            link: "veth1a2b".into(),
            live: false,
        })),
        Event::Addr(Box::new(crate::event::AddrPresence {
            ts_ns: 1 << 40,
            netns: 4026531840,
            addr: "fd00:10:244::7".parse().unwrap(),
            why: crate::event::AddrWhy::LinkDeleted,
            link: "cali12ab".into(),
            live: true,
        })),
        Event::CtEntries(Box::new(crate::event::CtEntries {
            ts_ns: 80,
            netns: 4026531840,
            addr: "10.244.1.5".parse().unwrap(),
            entries: vec![
                crate::event::CtEntry {
                    id: 7,
                    proto: 6,
                    tcp_state: 1,
                    status: 0x20,
                    orig_src: "10.199.0.2:40000".parse().unwrap(),
                    orig_dst: "10.96.0.10:80".parse().unwrap(),
                    reply_src: "10.244.1.5:8080".parse().unwrap(),
                    packets: 3,
                    timeout_s: 117,
                },
                crate::event::CtEntry {
                    id: u32::MAX,
                    proto: 17,
                    reply_src: "[fd00::5]:53".parse().unwrap(),
                    ..Default::default()
                },
            ],
            more: 2,
        })),
    ];
    for ev in &evs {
        let mut b = Vec::new();
        let kind = encode_synthetic(ev, &mut b).unwrap();
        assert_eq!(decode_synthetic(kind, &b).as_ref(), Ok(ev));
        // Fields appended by a newer writer are ignored.
        b.extend_from_slice(&[1, 2, 3]);
        assert_eq!(decode_synthetic(kind, &b).as_ref(), Ok(ev));
        for n in 0..b.len() - 3 {
            match (decode_synthetic(kind, &b[..n]), ev) {
                (Err(_), _) => {}
                // Cut just before the per-hold counts: a record from before they
                // existed, read with none; cut just before their reasons: one from
                // before those, read with the counts alone.
                (Ok(Event::DropCounts(c)), Event::DropCounts(full)) => {
                    assert_eq!(c.counts, full.counts);
                    let bare: Vec<_> = full
                        .holds
                        .iter()
                        .map(|h| HoldDropCount {
                            by_reason: vec![],
                            ..h.clone()
                        })
                        .collect();
                    assert!(c.holds.is_empty() || c.holds == bare, "{c:?}");
                }
                // Cut just before `more`: a record from before reads were split, a whole
                // read.
                (Ok(Event::RuleTable(t)), Event::RuleTable(full)) => {
                    assert!(!t.more);
                    assert_eq!(t.chains, full.chains);
                }
                // Cut just before the flags: a record from before them, not known live.
                (Ok(Event::Addr(a)), Event::Addr(full)) => {
                    assert!(!a.live);
                    assert_eq!(
                        *a,
                        crate::event::AddrPresence {
                            live: false,
                            ..(**full).clone()
                        }
                    );
                }
                (Ok(other), _) => panic!("{other:?} decoded from {n} bytes of {ev:?}"),
            }
        }
    }
    assert!(encode_synthetic(&Event::Lost { ts_ns: 1, count: 1 }, &mut Vec::new()).is_none());
    // A huge count does not allocate.
    let mut b = Vec::new();
    for v in [1, 1, 0, u64::MAX] {
        put_varint(&mut b, v);
    }
    assert!(decode_synthetic(KIND_DROP_COUNTS, &b).is_err());
}

/// Kind 14 with a reason this build does not know, or an address of the wrong length: an
/// error, never a panic.
#[test]
fn addr_record_damage() {
    let ev = Event::Addr(Box::new(crate::event::AddrPresence {
        ts_ns: 1,
        netns: 2,
        addr: "10.244.1.5".parse().unwrap(),
        why: crate::event::AddrWhy::RouteDeleted,
        link: "cali12ab".into(),
        live: true,
    }));
    let mut b = Vec::new();
    assert_eq!(encode_synthetic(&ev, &mut b), Some(KIND_ADDR));
    // ts_ns, netns, family, addr (1 + 4 bytes), then the reason.
    let why_at = 1 + 1 + 1 + 5;
    assert_eq!(b[why_at], crate::event::AddrWhy::RouteDeleted.code());
    for code in [7u8, 0x7f] {
        let mut bad = b.clone();
        bad[why_at] = code;
        let e = decode_synthetic(KIND_ADDR, &bad).unwrap_err();
        assert!(e.contains("unknown address reason"), "{e}");
    }
    let mut bad = b.clone();
    bad[2] = 6;
    assert!(decode_synthetic(KIND_ADDR, &bad).is_err());
}

#[test]
fn file_header_layout() {
    let h = CaptureHeader {
        hostname: "node-1".into(),
        ..Default::default()
    };
    let b = encode_file_header(&h).unwrap();
    assert_eq!(&b[..8], b"XTLKCAP\0");
    assert_eq!(&b[8..10], &[1, 0]);
    let n = u32::from_le_bytes(b[10..14].try_into().unwrap()) as usize;
    assert_eq!(b.len(), FILE_PREFIX_LEN + n + 4);
    let crc = crc32fast::hash(&b[..FILE_PREFIX_LEN + n]);
    assert_eq!(&b[FILE_PREFIX_LEN + n..], &crc.to_le_bytes());
    let back: CaptureHeader = serde_json::from_slice(&b[14..14 + n]).unwrap();
    assert_eq!(back, h);
    // Unknown fields are ignored, missing ones defaulted.
    let back: CaptureHeader =
        serde_json::from_str(r#"{"hostname":"a","from_the_future":[1]}"#).unwrap();
    assert_eq!(back.hostname, "a");
}

/// Kind 16: an endpoint said unanswered, then answering, round-trips; its flag is 0 or 1.
#[test]
fn endpoint_answers_records_round_trip() {
    for why in [
        crate::event::AddrWhy::Unanswered,
        crate::event::AddrWhy::Answering,
    ] {
        let ev = Event::Addr(Box::new(crate::event::AddrPresence {
            ts_ns: 7,
            netns: 4026531840,
            addr: "10.244.2.5".parse().unwrap(),
            why,
            link: String::new(),
            live: true,
        }));
        let mut b = Vec::new();
        assert_eq!(encode_synthetic(&ev, &mut b), Some(KIND_ENDPOINT_ANSWERS));
        assert_eq!(decode_synthetic(KIND_ENDPOINT_ANSWERS, &b).unwrap(), ev);
        let mut bad = b.clone();
        *bad.last_mut().unwrap() = 2;
        assert!(decode_synthetic(KIND_ENDPOINT_ANSWERS, &bad).is_err());
    }
}

/// Kind 17: an IPVS table round-trips (an address service, a firewall-mark one); damage is an
/// error, never a panic or a huge allocation.
#[test]
fn ipvs_table_records_round_trip() {
    use crate::event::{IpvsDest, IpvsService, IpvsTable};
    let ev = Event::IpvsTable(Box::new(IpvsTable {
        ts_ns: 9,
        netns: 4026531840,
        services: vec![
            IpvsService {
                proto: 6,
                addr: Some("10.96.0.10:80".parse().unwrap()),
                fwmark: 0,
                dests: vec![
                    IpvsDest {
                        addr: "10.244.1.5:8080".parse().unwrap(),
                        weight: 1,
                        active: 2,
                        inactive: 3,
                    },
                    IpvsDest {
                        addr: "[fd00::5]:8080".parse().unwrap(),
                        weight: 0,
                        active: 0,
                        inactive: 0,
                    },
                ],
            },
            IpvsService {
                proto: 0,
                addr: None,
                fwmark: 5,
                dests: Vec::new(),
            },
        ],
    }));
    let mut b = Vec::new();
    assert_eq!(encode_synthetic(&ev, &mut b), Some(KIND_IPVS_TABLE));
    assert_eq!(decode_synthetic(KIND_IPVS_TABLE, &b).unwrap(), ev);
    for cut in 0..b.len() {
        assert!(decode_synthetic(KIND_IPVS_TABLE, &b[..cut]).is_err());
    }
    // A service count far past the bytes left.
    let mut huge = b[..b.len()].to_vec();
    huge[6] = 0xff;
    let _ = decode_synthetic(KIND_IPVS_TABLE, &huge);
}

/// Kind 18: a table's rule counts round-trip (a rule, a policy, an uncounted rule); a cut
/// body is an error, a count past the bounds is refused before any allocation.
#[test]
fn rule_counter_records_round_trip() {
    use crate::event::{RuleCount, RuleCounters};
    let ev = Event::RuleCounters(Box::new(RuleCounters {
        ts_ns: 2_000,
        since_ns: 1_000,
        netns: 4026531840,
        family: "nft ip".into(),
        table: "filter".into(),
        rules: vec![
            RuleCount {
                chain: "KUBE-FIREWALL".into(),
                rule: "-m mark --mark 0x8000/0x8000 -j DROP".into(),
                nth: 1,
                packets: 250,
                bytes: 13_000,
                reset: true,
            },
            RuleCount {
                chain: "FORWARD".into(),
                rule: String::new(),
                nth: 0,
                packets: 3,
                bytes: 180,
                reset: false,
            },
        ],
        uncounted: vec!["input: udp dport 53 drop".into()],
    }));
    let mut b = Vec::new();
    assert_eq!(encode_synthetic(&ev, &mut b), Some(KIND_RULE_COUNTERS));
    assert_eq!(decode_synthetic(KIND_RULE_COUNTERS, &b).unwrap(), ev);
    for cut in 0..b.len() {
        assert!(decode_synthetic(KIND_RULE_COUNTERS, &b[..cut]).is_err());
    }
    // A rule count past the bound: refused, not allocated.
    let mut huge = Vec::new();
    for v in [1u64, 0, 7] {
        put_varint(&mut huge, v);
    }
    put_bytes(&mut huge, b"ip");
    put_bytes(&mut huge, b"filter");
    put_varint(&mut huge, u64::MAX);
    assert!(decode_synthetic(KIND_RULE_COUNTERS, &huge).is_err());
}

/// A read of `table` naming `names` in order; `changed` names come with a rule.
fn read_of(table: &str, ts_ns: u64, names: &[&str], changed: &[&str], more: bool) -> Event {
    Event::RuleTable(Box::new(crate::event::RuleTable {
        ts_ns,
        netns: 4026531840,
        family: "ip".into(),
        table: table.into(),
        after_pid: 12,
        skipped: String::new(),
        chains: names
            .iter()
            .map(|n| crate::event::ChainState {
                name: (*n).into(),
                policy: n.starts_with("PRE").then(|| "ACCEPT".into()),
                digest: n.len() as u64,
                rules: changed
                    .contains(n)
                    .then(|| vec![crate::event::Rule(vec![format!("-j {n}-X")])]),
            })
            .collect(),
        more,
    }))
}

/// Decodes `ev` as a capture reader does, with its chain names so far.
fn decode_with(ev: &Event, names: &mut ChainNames) -> crate::event::RuleTable {
    let mut b = Vec::new();
    let kind = encode_synthetic(ev, &mut b).unwrap();
    match decode_synthetic_with(kind, &b, names).unwrap() {
        Event::RuleTable(t) => *t,
        other => panic!("not a rule table: {other:?}"),
    }
}

fn shared(a: &crate::event::RuleTable, b: &crate::event::RuleTable) -> Vec<bool> {
    b.chains
        .iter()
        .map(|c| a.chains.iter().any(|p| SharedStr::ptr_eq(&p.name, &c.name)))
        .collect()
}

#[test]
fn a_table_read_again_shares_its_chain_names() {
    let mut names = ChainNames::default();
    let chains = ["PREROUTING", "KUBE-SERVICES", "KUBE-SVC-A", "KUBE-SEP-A"];
    let first = read_of("nat", 1, &chains, &chains, false);
    let a = decode_with(&first, &mut names);
    assert_eq!(Event::RuleTable(Box::new(a.clone())), first);

    // The same chains, one changed: every name is the first read's, and so is the policy.
    let second = read_of("nat", 2, &chains, &["KUBE-SEP-A"], false);
    let b = decode_with(&second, &mut names);
    assert_eq!(Event::RuleTable(Box::new(b.clone())), second);
    assert_eq!(shared(&a, &b), [true; 4]);
    let policy = |t: &crate::event::RuleTable| t.chains[0].policy.clone().unwrap();
    assert!(SharedStr::ptr_eq(&policy(&a), &policy(&b)));

    // Without the reader's names (a fresh cache), nothing is shared: the test can fail.
    let alone = decode_with(&second, &mut ChainNames::default());
    assert_eq!(shared(&a, &alone), [false; 4]);

    // Another table with the same names has names of its own.
    let filter = decode_with(&read_of("filter", 3, &chains, &[], false), &mut names);
    assert_eq!(shared(&b, &filter), [false; 4]);
}

#[test]
fn a_changed_chain_name_is_read_as_it_is_now() {
    let mut names = ChainNames::default();
    let before = ["PREROUTING", "KUBE-SVC-A", "KUBE-SEP-A", "KUBE-SEP-B"];
    let a = decode_with(&read_of("nat", 1, &before, &before, false), &mut names);
    // A chain renamed, one added in front of the others, one gone.
    let after = [
        "PREROUTING",
        "KUBE-NEW",
        "KUBE-SVC-A",
        "KUBE-SEP-C",
        "KUBE-SEP-B",
    ];
    let ev = read_of("nat", 2, &after, &["KUBE-NEW"], false);
    let b = decode_with(&ev, &mut names);
    assert_eq!(Event::RuleTable(Box::new(b.clone())), ev);
    assert_eq!(shared(&a, &b), [true, false, true, false, true]);
    // The next read is compared with this one, not the first.
    let c = decode_with(&read_of("nat", 3, &after, &[], false), &mut names);
    assert_eq!(shared(&b, &c), [true; 5]);
}

#[test]
fn a_read_in_parts_is_one_read_for_the_names() {
    let mut names = ChainNames::default();
    let all = ["A", "B", "C", "D"];
    let a = decode_with(&read_of("nat", 1, &all, &all, false), &mut names);
    // The next read in two parts (same time): each part's names are the first read's.
    let p1 = decode_with(&read_of("nat", 2, &all[..2], &[], true), &mut names);
    let p2 = decode_with(&read_of("nat", 2, &all[2..], &[], false), &mut names);
    assert_eq!(shared(&a, &p1), [true; 2]);
    assert_eq!(shared(&a, &p2), [true; 2]);
    // A part of a read that never ended (a capture cut short) is not what the next read is
    // compared with: a new read starts over from the last whole one.
    let cut = decode_with(&read_of("nat", 3, &["X", "Y"], &[], true), &mut names);
    let d = decode_with(&read_of("nat", 4, &all, &[], false), &mut names);
    assert_eq!(shared(&a, &d), [true; 4]);
    assert_eq!(shared(&cut, &d), [false; 4]);
}

#[test]
fn a_read_of_fewer_chains_is_what_the_next_read_is_compared_with() {
    let mut names = ChainNames::default();
    let all = ["A", "B", "C"];
    let a = decode_with(&read_of("nat", 1, &all, &all, false), &mut names);
    // The last chain deleted: the names left are the first read's.
    let b = decode_with(&read_of("nat", 2, &all[..2], &[], false), &mut names);
    assert_eq!(shared(&a, &b), [true; 2]);
    // "C" created again: a new name, not the deleted chain's.
    let c = decode_with(&read_of("nat", 3, &all, &["C"], false), &mut names);
    assert_eq!(shared(&a, &c), [true, true, false]);
    assert_eq!(c.chains[2].name, "C");
}
