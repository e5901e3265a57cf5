use super::netlink::*;
use super::*;
use crate::event::Event;
use netlink_packet_core::{
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{LinkAttribute, LinkMessage},
    neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage},
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteType},
    AddressFamily, RouteNetlinkMessage,
};
use std::time::Duration;

const BR: u32 = 2;
const VETH1: u32 = 5;
const VETH2: u32 = 6;
const MAC1: Mac = [0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x05];
const MAC2: Mac = [0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x06];
const REACHABLE: u16 = 0x02;
const STALE: u16 = 0x04;
const DELAY: u16 = 0x08;
const INCOMPLETE: u16 = 0x01;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn link(index: u32, name: &str) -> Msg {
    Msg::Link {
        index,
        name: name.into(),
    }
}

fn neigh(link: u32, addr: &str, mac: Option<Mac>, state: u16) -> Msg {
    Msg::Neigh {
        link,
        addr: ip(addr),
        mac,
        state,
    }
}

/// (addr, why, link) of each event.
fn said(out: &[AddrPresence]) -> Vec<(String, AddrWhy, String)> {
    out.iter()
        .map(|a| (a.addr.to_string(), a.why, a.link.clone()))
        .collect()
}

fn one(addr: &str, why: AddrWhy, link: &str) -> (String, AddrWhy, String) {
    (addr.into(), why, link.into())
}

/// A bridge CNI's node after its first dump: two pods on veths of cni0.
fn bridge_node() -> (AddrState, Vec<AddrPresence>) {
    let mut st = AddrState::new(4026531840);
    let mut out = Vec::new();
    st.begin_dump();
    for m in [
        link(1, "lo"),
        link(BR, "cni0"),
        link(3, "eth0"),
        link(VETH1, "veth1a2b"),
        link(VETH2, "veth3c4d"),
        Msg::Fdb {
            bridge: BR,
            mac: MAC1,
            port: VETH1,
        },
        Msg::Fdb {
            bridge: BR,
            mac: MAC2,
            port: VETH2,
        },
        neigh(BR, "10.244.1.5", Some(MAC1), REACHABLE),
        neigh(BR, "10.244.1.6", Some(MAC2), STALE),
        // Not present: never answered.
        neigh(BR, "10.244.1.9", None, INCOMPLETE),
        neigh(3, "192.168.1.1", Some([2; 6]), REACHABLE),
        Msg::Addr {
            link: 1,
            addr: ip("127.0.0.1"),
        },
        Msg::Addr {
            link: 3,
            addr: ip("192.168.1.20"),
        },
        Msg::Addr {
            link: 3,
            addr: ip("fe80::1"),
        },
    ] {
        st.apply(m, 1, &mut out);
    }
    assert!(out.is_empty(), "nothing said during the dump: {out:?}");
    st.end_dump(10, &mut out);
    (st, out)
}

#[test]
fn dump_says_where_each_address_lives() {
    let (_, out) = bridge_node();
    let mut got = said(&out);
    got.sort();
    assert_eq!(
        got,
        [
            one("10.244.1.5", AddrWhy::Neighbour, "veth1a2b"),
            one("10.244.1.6", AddrWhy::Neighbour, "veth3c4d"),
            one("192.168.1.1", AddrWhy::Neighbour, "eth0"),
            one("192.168.1.20", AddrWhy::Local, "eth0"),
        ]
    );
    assert!(out.iter().all(|a| a.ts_ns == 10 && a.netns == 4026531840));
}

/// The pod's netns deleted: the kernel flushes the port's FDB entries, then deletes the
/// veth. Its address is gone at the DELLINK, once, with the veth's name; the other pod's is not.
#[test]
fn deleted_veth_takes_its_pods_address() {
    let (mut st, _) = bridge_node();
    let mut out = Vec::new();
    st.apply(
        Msg::FdbDeleted {
            bridge: BR,
            mac: MAC1,
            port: VETH1,
        },
        20,
        &mut out,
    );
    assert!(out.is_empty());
    st.apply(
        Msg::LinkDeleted {
            index: VETH1,
            name: "veth1a2b".into(),
        },
        21,
        &mut out,
    );
    assert_eq!(
        said(&out),
        [one("10.244.1.5", AddrWhy::LinkDeleted, "veth1a2b")]
    );
    assert_eq!(out[0].ts_ns, 21);
    // The neighbour on the bridge lives on; what it does next says nothing more.
    out.clear();
    for s in [DELAY, 0x10, 0x20, STALE] {
        st.apply(neigh(BR, "10.244.1.5", None, s), 22, &mut out);
    }
    assert!(out.is_empty(), "{out:?}");
    // The address given to a new pod (another MAC, learned on another veth): present again.
    let mac3 = [0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x07];
    st.apply(link(7, "veth5e6f"), 30, &mut out);
    st.apply(
        Msg::Fdb {
            bridge: BR,
            mac: mac3,
            port: 7,
        },
        30,
        &mut out,
    );
    st.apply(neigh(BR, "10.244.1.5", Some(mac3), REACHABLE), 31, &mut out);
    assert_eq!(
        said(&out),
        [one("10.244.1.5", AddrWhy::Neighbour, "veth5e6f")]
    );
}

#[test]
fn failed_neighbour_is_gone_once_until_it_answers() {
    let (mut st, _) = bridge_node();
    let mut out = Vec::new();
    st.apply(neigh(BR, "10.244.1.6", None, DELAY), 20, &mut out);
    assert!(out.is_empty());
    st.apply(neigh(BR, "10.244.1.6", None, 0x20), 21, &mut out);
    assert_eq!(
        said(&out),
        [one("10.244.1.6", AddrWhy::NeighbourFailed, "veth3c4d")]
    );
    out.clear();
    st.apply(neigh(BR, "10.244.1.6", None, 0x20), 22, &mut out);
    st.apply(neigh(BR, "10.244.1.6", None, INCOMPLETE), 23, &mut out);
    assert!(out.is_empty());
    st.apply(neigh(BR, "10.244.1.6", Some(MAC2), REACHABLE), 24, &mut out);
    assert_eq!(
        said(&out),
        [one("10.244.1.6", AddrWhy::Neighbour, "veth3c4d")]
    );
    // Updates of a present neighbour say nothing.
    out.clear();
    for s in [STALE, DELAY, REACHABLE] {
        st.apply(neigh(BR, "10.244.1.6", Some(MAC2), s), 25, &mut out);
    }
    assert!(out.is_empty());
}

/// Garbage collection is not a gone: the pod may still be there. Nothing is said later
/// either, when its link goes (the address was forgotten).
#[test]
fn collected_neighbour_is_only_forgotten() {
    let (mut st, _) = bridge_node();
    let mut out = Vec::new();
    st.apply(
        Msg::NeighDeleted {
            link: BR,
            addr: ip("10.244.1.6"),
        },
        20,
        &mut out,
    );
    st.apply(
        Msg::LinkDeleted {
            index: VETH2,
            name: "veth3c4d".into(),
        },
        21,
        &mut out,
    );
    assert!(out.is_empty(), "{out:?}");
}

/// A neighbour known before the bridge learned its MAC is on the bridge, then moves to the
/// port without being said gone.
#[test]
fn neighbour_moves_to_its_port_when_learned() {
    let (mut st, _) = bridge_node();
    let mut out = Vec::new();
    let mac = [0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x08];
    st.apply(link(8, "veth7a8b"), 20, &mut out);
    st.apply(neigh(BR, "10.244.1.8", Some(mac), REACHABLE), 21, &mut out);
    st.apply(
        Msg::Fdb {
            bridge: BR,
            mac,
            port: 8,
        },
        22,
        &mut out,
    );
    assert_eq!(
        said(&out),
        [
            one("10.244.1.8", AddrWhy::Neighbour, "cni0"),
            one("10.244.1.8", AddrWhy::Neighbour, "veth7a8b"),
        ]
    );
}

/// calico's and cilium's pods: a host route through the pod's veth.
#[test]
fn host_routes() {
    let mut st = AddrState::new(1);
    let mut out = Vec::new();
    st.begin_dump();
    st.end_dump(0, &mut out);
    let r = |dst: &str| Msg::Route {
        dst: ip(dst),
        oif: 9,
    };
    let del = |dst: &str| Msg::RouteDeleted {
        dst: ip(dst),
        oif: 9,
    };
    st.apply(link(9, "cali12ab"), 1, &mut out);
    st.apply(r("10.244.2.7"), 2, &mut out);
    st.apply(r("fd00:10:244::7"), 2, &mut out);
    st.apply(del("10.244.2.7"), 3, &mut out);
    // Deleted through another link: not this route.
    st.apply(
        Msg::RouteDeleted {
            dst: ip("fd00:10:244::7"),
            oif: 4,
        },
        3,
        &mut out,
    );
    assert_eq!(
        said(&out),
        [
            one("10.244.2.7", AddrWhy::Route, "cali12ab"),
            one("fd00:10:244::7", AddrWhy::Route, "cali12ab"),
            one("10.244.2.7", AddrWhy::RouteDeleted, "cali12ab"),
        ]
    );
    out.clear();
    st.apply(
        Msg::LinkDeleted {
            index: 9,
            name: "cali12ab".into(),
        },
        4,
        &mut out,
    );
    // The kernel's own DELROUTE after the link went says nothing more.
    st.apply(del("fd00:10:244::7"), 5, &mut out);
    assert_eq!(
        said(&out),
        [one("fd00:10:244::7", AddrWhy::LinkDeleted, "cali12ab")]
    );
}

#[test]
fn local_addresses() {
    let (mut st, _) = bridge_node();
    let mut out = Vec::new();
    for a in ["::1", "127.0.0.53", "fe80::a8c1:abff:fe00:1"] {
        st.apply(
            Msg::Addr {
                link: 1,
                addr: ip(a),
            },
            20,
            &mut out,
        );
    }
    assert!(out.is_empty());
    st.apply(
        Msg::AddrDeleted {
            link: 3,
            addr: ip("192.168.1.20"),
        },
        21,
        &mut out,
    );
    assert_eq!(
        said(&out),
        [one("192.168.1.20", AddrWhy::AddressDeleted, "eth0")]
    );
}

/// After an overrun: what went meanwhile is said gone (by the link's old name), what came is
/// said present, what stayed says nothing.
#[test]
fn redump_diffs_against_what_was_said() {
    let (mut st, _) = bridge_node();
    let mut out = Vec::new();
    st.apply(link(9, "cali12ab"), 1, &mut out);
    st.apply(
        Msg::Route {
            dst: ip("10.244.2.7"),
            oif: 9,
        },
        2,
        &mut out,
    );
    out.clear();
    st.begin_dump();
    for m in [
        link(1, "lo"),
        link(BR, "cni0"),
        link(3, "eth0"),
        link(VETH2, "veth3c4d"),
        link(9, "cali12ab"),
        // veth1a2b went; the FDB lost its entries, the neighbour stays on the bridge.
        Msg::Fdb {
            bridge: BR,
            mac: MAC2,
            port: VETH2,
        },
        neigh(BR, "10.244.1.5", Some(MAC1), STALE),
        neigh(BR, "10.244.1.6", Some(MAC2), STALE),
        neigh(3, "192.168.1.1", Some([2; 6]), REACHABLE),
        Msg::Addr {
            link: 3,
            addr: ip("192.168.1.20"),
        },
        Msg::Addr {
            link: 3,
            addr: ip("192.168.1.21"),
        },
    ] {
        st.apply(m, 50, &mut out);
    }
    st.end_dump(60, &mut out);
    let mut got = said(&out);
    got.sort();
    assert_eq!(
        got,
        [
            one("10.244.1.5", AddrWhy::LinkDeleted, "veth1a2b"),
            one("10.244.2.7", AddrWhy::RouteDeleted, "cali12ab"),
            one("192.168.1.21", AddrWhy::Local, "eth0"),
        ]
    );
}

/// Every table of the state is bounded: one entry past [`MAX_ENTRIES`] of links,
/// neighbours, bridge FDB entries (of a live port: a dead port's go first), routes and local
/// addresses is dropped and counted, not kept.
#[test]
fn bounded() {
    let v4 = |i: u32| IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i));
    let n = MAX_ENTRIES as u32 + 1;
    let fill = |make: &dyn Fn(u32) -> Msg| {
        let mut st = AddrState::new(1);
        let mut out = Vec::new();
        // A live port: a full FDB first lets go of the MACs of dead ports.
        st.apply(link(2, "port"), 0, &mut out);
        for i in 0..n {
            st.apply(make(i), 0, &mut out);
        }
        st
    };
    let st = fill(&|i| link(i + 1, "x"));
    assert_eq!((st.links.len(), st.dropped), (MAX_ENTRIES, 1), "links");
    let st = fill(&|i| Msg::Neigh {
        link: 1,
        addr: v4(i),
        mac: None,
        state: libc::NUD_REACHABLE,
    });
    assert_eq!(
        (st.neighs.len(), st.dropped),
        (MAX_ENTRIES, 1),
        "neighbours"
    );
    let st = fill(&|i| Msg::Fdb {
        bridge: 1,
        mac: [
            2,
            0,
            (i >> 24) as u8,
            (i >> 16) as u8,
            (i >> 8) as u8,
            i as u8,
        ],
        port: 2,
    });
    assert_eq!((st.fdb.len(), st.dropped), (MAX_ENTRIES, 1), "fdb");
    let st = fill(&|i| Msg::Route { dst: v4(i), oif: 2 });
    assert_eq!((st.routes.len(), st.dropped), (MAX_ENTRIES, 1), "routes");
    let st = fill(&|i| Msg::Addr {
        link: 2,
        addr: v4(i),
    });
    assert_eq!(
        (st.locals.len(), st.dropped),
        (MAX_ENTRIES, 1),
        "local addresses"
    );
}

fn nl(m: RouteNetlinkMessage, seq: u32) -> Vec<u8> {
    let mut h = NetlinkHeader::default();
    h.sequence_number = seq;
    let mut msg = NetlinkMessage::new(h, NetlinkPayload::from(m));
    msg.finalize();
    let mut b = vec![0; msg.buffer_len()];
    msg.serialize(&mut b);
    b
}

/// Messages as the kernel sends them, parsed into what the state follows.
#[test]
fn parses_rtnetlink() {
    use netlink_packet_route::neighbour::NeighbourState;
    let mut l = LinkMessage::default();
    l.header.index = 5;
    l.attributes.push(LinkAttribute::IfName("veth1a2b".into()));
    let mut fdb = NeighbourMessage::default();
    fdb.header.family = AddressFamily::Bridge;
    fdb.header.ifindex = 5;
    fdb.attributes
        .push(NeighbourAttribute::LinkLayerAddress(MAC1.to_vec()));
    fdb.attributes.push(NeighbourAttribute::Controller(BR));
    let mut n = NeighbourMessage::default();
    n.header.family = AddressFamily::Inet;
    n.header.ifindex = BR;
    n.header.state = NeighbourState::Reachable;
    n.attributes
        .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
            "10.244.1.5".parse().unwrap(),
        )));
    n.attributes
        .push(NeighbourAttribute::LinkLayerAddress(MAC1.to_vec()));
    let route = |table: u8, len: u8, kind: RouteType| {
        let mut r = RouteMessage::default();
        r.header.address_family = AddressFamily::Inet;
        r.header.table = table;
        r.header.destination_prefix_length = len;
        r.header.kind = kind;
        r.attributes
            .push(RouteAttribute::Destination(RouteAddress::Inet(
                "10.244.2.7".parse().unwrap(),
            )));
        r.attributes.push(RouteAttribute::Oif(9));
        r
    };
    let mut a = AddressMessage::default();
    a.header.family = AddressFamily::Inet6;
    a.header.index = 3;
    a.attributes
        .push(AddressAttribute::Address("fd00::4".parse().unwrap()));
    let mut buf = Vec::new();
    for m in [
        RouteNetlinkMessage::NewLink(l.clone()),
        RouteNetlinkMessage::DelLink(l),
        RouteNetlinkMessage::NewNeighbour(fdb),
        RouteNetlinkMessage::NewNeighbour(n.clone()),
        RouteNetlinkMessage::DelNeighbour(n),
        RouteNetlinkMessage::NewRoute(route(254, 32, RouteType::Unicast)),
        // Not host routes of the main table: skipped.
        RouteNetlinkMessage::NewRoute(route(255, 32, RouteType::Local)),
        RouteNetlinkMessage::NewRoute(route(254, 24, RouteType::Unicast)),
        RouteNetlinkMessage::DelRoute(route(254, 32, RouteType::Unicast)),
        RouteNetlinkMessage::NewAddress(a),
    ] {
        buf.extend(nl(m, 0));
    }
    let mut done = NetlinkMessage::<RouteNetlinkMessage>::new(
        NetlinkHeader::default(),
        NetlinkPayload::Done(Default::default()),
    );
    done.header.sequence_number = 7;
    done.finalize();
    let mut b = vec![0; done.buffer_len()];
    done.serialize(&mut b);
    buf.extend(b);
    let mut bad = 0;
    let got = parse_datagram(&buf, &mut bad);
    assert_eq!(bad, 0);
    assert_eq!(
        got,
        [
            link(5, "veth1a2b"),
            Msg::LinkDeleted {
                index: 5,
                name: "veth1a2b".into()
            },
            Msg::Fdb {
                bridge: BR,
                mac: MAC1,
                port: 5
            },
            neigh(BR, "10.244.1.5", Some(MAC1), REACHABLE),
            Msg::NeighDeleted {
                link: BR,
                addr: ip("10.244.1.5")
            },
            Msg::Route {
                dst: ip("10.244.2.7"),
                oif: 9
            },
            Msg::RouteDeleted {
                dst: ip("10.244.2.7"),
                oif: 9
            },
            Msg::Addr {
                link: 3,
                addr: ip("fd00::4")
            },
        ]
    );
    // The dump's end, for the exchange that asked for it: the last message, its sequence
    // number kept.
    let last = crate::decode::netlink::framed(&buf)
        .last()
        .unwrap()
        .unwrap();
    assert_eq!(
        (last.control(), last.seq),
        (Ok(Some(crate::decode::netlink::Control::Done)), 7)
    );
    // Damage: counted, never a panic.
    let mut bad = 0;
    assert!(parse_datagram(&buf[..10], &mut bad).is_empty());
    assert_eq!(bad, 1);
}

/// A link message the crate cannot parse is still read by hand (index and name).
#[test]
fn link_read_by_hand() {
    let mut p = vec![0u8; IFINFOMSG_LEN];
    p[4..8].copy_from_slice(&5u32.to_ne_bytes());
    // IFLA_IFNAME "veth1a2b\0", padded.
    p.extend_from_slice(&13u16.to_ne_bytes());
    p.extend_from_slice(&IFLA_IFNAME.to_ne_bytes());
    p.extend_from_slice(b"veth1a2b\0\0\0\0");
    assert_eq!(
        link_by_hand(RTM_DELLINK, &p),
        Some(Msg::LinkDeleted {
            index: 5,
            name: "veth1a2b".into()
        })
    );
    assert_eq!(link_by_hand(RTM_DELLINK, &p[..3]), None);
    assert_eq!(link_by_hand(libc::RTM_NEWROUTE, &p), None);
}

/// The requests serialize as rtnetlink dumps.
#[test]
fn dump_request_layout() {
    for (i, r) in dump_requests().into_iter().enumerate() {
        let b = request_bytes(r, i as u32 + 1);
        let h = NetlinkBuffer::new_checked(&b[..]).unwrap();
        assert_eq!(h.length() as usize, b.len());
        assert_eq!(h.flags(), NLM_F_REQUEST | NLM_F_DUMP);
        assert_eq!(h.sequence_number(), i as u32 + 1);
    }
}

/// Against the kernel, as root, run by hand under `ip netns exec` in a throwaway namespace
/// with a bridge and pods on veths: `XTLOCK_ADDRS_NETNS` is a pod's namespace to delete,
/// `XTLOCK_ADDRS_ADDR` its address, a neighbour on the bridge. Prints the delay from the
/// deletion to the event.
#[test]
#[ignore = "needs root and a prepared network namespace"]
fn live_pod_deletion() {
    let (Ok(ns), Ok(addr)) = (
        std::env::var("XTLOCK_ADDRS_NETNS"),
        std::env::var("XTLOCK_ADDRS_ADDR"),
    ) else {
        eprintln!("XTLOCK_ADDRS_NETNS and XTLOCK_ADDRS_ADDR unset: skipped");
        return;
    };
    let addr = ip(&addr);
    let mut w = AddrWatcher::start().unwrap();
    let wait = |w: &mut AddrWatcher, what: &dyn Fn(&AddrPresence) -> bool| {
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < until {
            let mut evs = Vec::new();
            w.poll(&mut evs);
            for ev in evs {
                let Event::Addr(a) = ev else { continue };
                eprintln!("{} {} {} {}", a.ts_ns, a.addr, a.why.as_str(), a.link);
                if what(&a) {
                    return Some(*a);
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        None
    };
    let present = wait(&mut w, &|a| a.addr == addr && a.why.present()).expect("present");
    let t0 = crate::source::monotonic_ns();
    let st = std::process::Command::new("ip")
        .args(["netns", "del", &ns])
        .status()
        .unwrap();
    let t1 = crate::source::monotonic_ns();
    assert!(st.success());
    let gone = wait(&mut w, &|a| a.addr == addr && !a.why.present()).expect("gone");
    let seen = crate::source::monotonic_ns();
    assert_eq!(gone.why, AddrWhy::LinkDeleted);
    assert_eq!(gone.link, present.link);
    eprintln!(
        "ip netns del ran {:.3} ms; event stamped {:.3} ms after it began, polled {:.3} ms after",
        (t1 - t0) as f64 / 1e6,
        (gone.ts_ns - t0) as f64 / 1e6,
        (seen - t0) as f64 / 1e6,
    );
}

/// A pod on a routed veth (no bridge): deleting the veth flushes its neighbour first, then
/// deletes the link; the pod is gone with the link, at the flush. A neighbour collected on a
/// link that stays, or whose link goes much later, is only forgotten.
#[test]
fn neighbour_flushed_with_its_link_is_gone() {
    let mut st = AddrState::new(4026531840);
    let mut out = Vec::new();
    st.begin_dump();
    st.apply(link(7, "xin1"), 1, &mut out);
    st.apply(link(8, "xin2"), 1, &mut out);
    st.end_dump(2, &mut out);
    st.apply(neigh(7, "10.0.1.5", Some(MAC1), REACHABLE), 3, &mut out);
    st.apply(neigh(8, "10.0.2.6", Some(MAC2), REACHABLE), 3, &mut out);
    out.clear();
    let del = |link, addr: &str| Msg::NeighDeleted {
        link,
        addr: ip(addr),
    };
    st.apply(del(7, "10.0.1.5"), 100, &mut out);
    st.apply(del(8, "10.0.2.6"), 100, &mut out);
    assert!(out.is_empty(), "{out:?}");
    st.apply(
        Msg::LinkDeleted {
            index: 7,
            name: "xin1".into(),
        },
        150,
        &mut out,
    );
    assert_eq!(said(&out), [one("10.0.1.5", AddrWhy::LinkDeleted, "xin1")]);
    assert_eq!(out[0].ts_ns, 100);
    out.clear();
    // xin2's neighbour was collected; its link goes 2 s later.
    st.apply(
        Msg::LinkDeleted {
            index: 8,
            name: "xin2".into(),
        },
        2_000_000_200,
        &mut out,
    );
    assert!(out.is_empty(), "{out:?}");
}
