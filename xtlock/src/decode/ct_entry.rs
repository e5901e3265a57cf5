//! Conntrack entries as ctnetlink dumps them (`conntrack -L`): the request for the entries
//! whose reply comes from one address (the endpoint a Service DNATs to), and the parse of
//! what the kernel answers into [`CtEntry`]. Wire format: `include/uapi/linux/netfilter/
//! nfnetlink_conntrack.h`; every number in an attribute is big-endian.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::netlink::{
    self, attrs, be_u16, be_u32, be_u64, bytes, nested, put_attr, Message, NFGENMSG,
    NFNL_SUBSYS_CTNETLINK,
};
#[cfg(test)]
use super::netlink::{Control, NLMSG_DONE, NLMSG_HDR};
use crate::event::CtEntry;

const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;

// enum ctattr_type
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_TIMEOUT: u16 = 7;
const CTA_COUNTERS_ORIG: u16 = 9;
const CTA_ID: u16 = 12;
const CTA_FILTER: u16 = 25;
const CTA_STATUS_MASK: u16 = 26;
// enum ctattr_tuple, ctattr_ip, ctattr_l4proto
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
// ctattr_protoinfo, ctattr_protoinfo_tcp, ctattr_counters
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_COUNTERS_PACKETS: u16 = 1;
// ctattr_filter and its flags (5.9+): match only the reply tuple's source address.
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_REPLY_FLAGS: u16 = 2;
const CTA_FILTER_FLAG_CTA_IP_SRC: u32 = 1 << 0;

/// `IPS_SEEN_REPLY`: the entry saw a packet of the other direction.
pub const IPS_SEEN_REPLY: u32 = 1 << 1;
/// `IPS_DST_NAT`: its destination was rewritten (a Service's DNAT).
pub const IPS_DST_NAT: u32 = 1 << 5;

/// `TCP_CONNTRACK_SYN_SENT`: a connection's SYN went out, nothing came back yet.
pub const TCP_CONNTRACK_SYN_SENT: u8 = 1;

/// One message of the answer, for the tests.
#[cfg(test)]
#[derive(Debug, PartialEq, Eq)]
pub enum CtMsg {
    Entry(CtEntry),
    Done,
    /// The kernel refused the dump (`errno`), e.g. `EINVAL` for a filter it does not know.
    Error(i32),
    Other,
}

/// A dump of the conntrack entries of `addr`'s family; with `filter`, only those whose
/// reply comes from `addr` (the kernel filters, 5.9+; older kernels answer `EINVAL` and the
/// caller dumps unfiltered).
pub fn dump_request(seq: u32, addr: IpAddr, filter: bool) -> Vec<u8> {
    let (family, ip_attr, ip): (u8, u16, Vec<u8>) = match addr {
        IpAddr::V4(v) => (libc::AF_INET as u8, CTA_IP_V4_SRC, v.octets().to_vec()),
        IpAddr::V6(v) => (libc::AF_INET6 as u8, CTA_IP_V6_SRC, v.octets().to_vec()),
    };
    let mut body = vec![family, 0, 0, 0];
    if filter {
        let mut ipb = Vec::new();
        put_attr(&mut ipb, ip_attr, &ip);
        let tuple_ip = nested(CTA_TUPLE_IP, &ipb);
        body.extend_from_slice(&nested(CTA_TUPLE_REPLY, &tuple_ip));
        let mut f = Vec::new();
        put_attr(&mut f, CTA_FILTER_ORIG_FLAGS, &0u32.to_ne_bytes());
        put_attr(
            &mut f,
            CTA_FILTER_REPLY_FLAGS,
            &CTA_FILTER_FLAG_CTA_IP_SRC.to_ne_bytes(),
        );
        body.extend_from_slice(&nested(CTA_FILTER, &f));
    }
    request(seq, &body)
}

/// A dump of the entries of every family that were DNATed and never saw a reply: the
/// connections sent to a Service's endpoint that nothing answered. The kernel filters by
/// status (`CTA_STATUS` under `CTA_STATUS_MASK`, 5.19+); an older one ignores the filter and
/// answers every entry, which the caller notices (an entry that does not match) and says.
pub fn unanswered_request(seq: u32) -> Vec<u8> {
    let mut body = vec![libc::AF_UNSPEC as u8, 0, 0, 0];
    put_attr(&mut body, CTA_STATUS, &IPS_DST_NAT.to_be_bytes());
    put_attr(
        &mut body,
        CTA_STATUS_MASK,
        &(IPS_DST_NAT | IPS_SEEN_REPLY).to_be_bytes(),
    );
    request(seq, &body)
}

fn request(seq: u32, body: &[u8]) -> Vec<u8> {
    netlink::dump((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET, seq, body)
}

/// The entry a message of a dump carries; `None` for any other message, or an entry that
/// does not parse (skipped).
pub fn entry(m: &Message<'_>) -> Option<CtEntry> {
    if m.ty != (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW {
        return None;
    }
    m.payload.get(NFGENMSG..).and_then(parse_entry)
}

/// The messages of one datagram of a dump, up to its end.
#[cfg(test)]
pub fn messages(datagram: &[u8]) -> Result<Vec<CtMsg>, netlink::FrameError> {
    let mut out = Vec::new();
    for m in netlink::framed(datagram) {
        let m = m?;
        out.push(match m.control()? {
            Some(Control::Done) => {
                out.push(CtMsg::Done);
                return Ok(out);
            }
            Some(Control::Refused(errno)) => CtMsg::Error(errno),
            Some(Control::Ack) => CtMsg::Other,
            None => entry(&m).map_or(CtMsg::Other, CtMsg::Entry),
        });
    }
    Ok(out)
}

/// (source, destination, protocol) of a tuple.
fn tuple(b: &[u8]) -> Option<(SocketAddr, SocketAddr, u8)> {
    let (mut src, mut dst, mut sport, mut dport, mut proto) = (None, None, 0, 0, 0);
    for (k, v) in attrs(b) {
        match k {
            CTA_TUPLE_IP => {
                for (k, v) in attrs(v) {
                    match k {
                        CTA_IP_V4_SRC => src = bytes::<4>(v).map(|a| IpAddr::V4(Ipv4Addr::from(a))),
                        CTA_IP_V4_DST => dst = bytes::<4>(v).map(|a| IpAddr::V4(Ipv4Addr::from(a))),
                        CTA_IP_V6_SRC => {
                            src = bytes::<16>(v).map(|a| IpAddr::V6(Ipv6Addr::from(a)))
                        }
                        CTA_IP_V6_DST => {
                            dst = bytes::<16>(v).map(|a| IpAddr::V6(Ipv6Addr::from(a)))
                        }
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (k, v) in attrs(v) {
                    match k {
                        CTA_PROTO_NUM => proto = v.first().copied().unwrap_or(0),
                        CTA_PROTO_SRC_PORT => sport = be_u16(v).unwrap_or(0),
                        CTA_PROTO_DST_PORT => dport = be_u16(v).unwrap_or(0),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((
        SocketAddr::new(src?, sport),
        SocketAddr::new(dst?, dport),
        proto,
    ))
}

/// One entry of a dump; `None` without both tuples.
pub fn parse_entry(b: &[u8]) -> Option<CtEntry> {
    let (mut orig, mut reply) = (None, None);
    let mut e = CtEntry::default();
    for (k, v) in attrs(b) {
        match k {
            CTA_TUPLE_ORIG => orig = tuple(v),
            CTA_TUPLE_REPLY => reply = tuple(v),
            CTA_STATUS => e.status = be_u32(v).unwrap_or(0),
            CTA_TIMEOUT => e.timeout_s = be_u32(v).unwrap_or(0),
            CTA_ID => e.id = be_u32(v).unwrap_or(0),
            CTA_PROTOINFO => {
                for (k, v) in attrs(v) {
                    if k == CTA_PROTOINFO_TCP {
                        for (k, v) in attrs(v) {
                            if k == CTA_PROTOINFO_TCP_STATE {
                                e.tcp_state = v.first().copied().unwrap_or(0);
                            }
                        }
                    }
                }
            }
            CTA_COUNTERS_ORIG => {
                for (k, v) in attrs(v) {
                    if k == CTA_COUNTERS_PACKETS {
                        e.packets = be_u64(v).unwrap_or(0);
                    }
                }
            }
            _ => {}
        }
    }
    let (src, dst, proto) = orig?;
    let (reply_src, _, _) = reply?;
    e.proto = proto;
    e.orig_src = src;
    e.orig_dst = dst;
    e.reply_src = reply_src;
    Some(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dump answer as the kernel writes it: one UDP entry DNATed from 10.96.0.10:53 to
    /// 10.244.1.5:5353, then the end of the dump.
    fn answer() -> Vec<u8> {
        let tuple = |src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16| {
            let mut ip = Vec::new();
            put_attr(&mut ip, CTA_IP_V4_SRC, &src);
            put_attr(&mut ip, CTA_IP_V4_DST, &dst);
            let mut pr = Vec::new();
            put_attr(&mut pr, CTA_PROTO_NUM, &[17]);
            put_attr(&mut pr, CTA_PROTO_SRC_PORT, &sp.to_be_bytes());
            put_attr(&mut pr, CTA_PROTO_DST_PORT, &dp.to_be_bytes());
            let mut t = nested(CTA_TUPLE_IP, &ip);
            t.extend_from_slice(&nested(CTA_TUPLE_PROTO, &pr));
            t
        };
        let mut body = vec![2, 0, 0, 0];
        body.extend_from_slice(&nested(
            CTA_TUPLE_ORIG,
            &tuple([10, 199, 0, 2], [10, 96, 0, 10], 40000, 53),
        ));
        body.extend_from_slice(&nested(
            CTA_TUPLE_REPLY,
            &tuple([10, 244, 1, 5], [10, 199, 0, 2], 5353, 40000),
        ));
        put_attr(
            &mut body,
            CTA_STATUS,
            &(IPS_SEEN_REPLY | IPS_DST_NAT).to_be_bytes(),
        );
        put_attr(&mut body, CTA_TIMEOUT, &117u32.to_be_bytes());
        put_attr(&mut body, CTA_ID, &77u32.to_be_bytes());
        let mut c = Vec::new();
        put_attr(&mut c, CTA_COUNTERS_PACKETS, &9u64.to_be_bytes());
        body.extend_from_slice(&nested(CTA_COUNTERS_ORIG, &c));
        let mut d = Vec::new();
        let len = (NLMSG_HDR + body.len()) as u32;
        d.extend_from_slice(&len.to_ne_bytes());
        d.extend_from_slice(&(NFNL_SUBSYS_CTNETLINK << 8).to_ne_bytes());
        d.extend_from_slice(&[0; 10]);
        d.extend_from_slice(&body);
        d.extend_from_slice(&16u32.to_ne_bytes());
        d.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        d.extend_from_slice(&[0; 10]);
        d
    }

    #[test]
    fn an_entry_and_the_end() {
        let m = messages(&answer()).unwrap();
        assert_eq!(m.len(), 2, "{m:?}");
        let CtMsg::Entry(e) = &m[0] else {
            panic!("{m:?}")
        };
        assert_eq!(e.orig_src.to_string(), "10.199.0.2:40000");
        assert_eq!(e.orig_dst.to_string(), "10.96.0.10:53");
        assert_eq!(e.reply_src.to_string(), "10.244.1.5:5353");
        assert_eq!((e.proto, e.id, e.timeout_s, e.packets), (17, 77, 117, 9));
        assert!(e.replied());
        assert_eq!(m[1], CtMsg::Done);
    }

    #[test]
    fn damaged_answers_are_errors_or_skipped() {
        let a = answer();
        // Cut inside the entry: the netlink header says more than there is.
        assert!(messages(&a[..40]).is_err());
        // An entry without its tuples is not one.
        assert_eq!(parse_entry(&[]), None);
        for cut in 0..a.len() {
            let _ = messages(&a[..cut]);
        }
    }

    #[test]
    fn the_request_filters_on_the_reply_source() {
        let r = dump_request(7, "10.244.1.5".parse().unwrap(), true);
        assert_eq!(
            u32::from_ne_bytes(r[0..4].try_into().unwrap()) as usize,
            r.len()
        );
        assert_eq!(r[16], libc::AF_INET as u8);
        // The address is in the request, and so is the filter. The kernel's numbers, written
        // out: CTA_FILTER (25) nested, 20 bytes, holding CTA_FILTER_ORIG_FLAGS (1) = 0 and
        // CTA_FILTER_REPLY_FLAGS (2) = CTA_FILTER_FLAG_CTA_IP_SRC (1).
        assert!(r.windows(4).any(|w| w == [10, 244, 1, 5]));
        let mut filter: Vec<u8> = Vec::new();
        for v in [20u16, 25 | 0x8000, 8, 1] {
            filter.extend_from_slice(&v.to_ne_bytes());
        }
        filter.extend_from_slice(&0u32.to_ne_bytes());
        for v in [8u16, 2] {
            filter.extend_from_slice(&v.to_ne_bytes());
        }
        filter.extend_from_slice(&1u32.to_ne_bytes());
        assert!(r.ends_with(&filter), "no reply-source filter in {r:?}");
        let unfiltered = dump_request(7, "10.244.1.5".parse().unwrap(), false);
        assert!(!unfiltered.windows(filter.len()).any(|w| w == filter));
        let plain = dump_request(7, "fd00::5".parse().unwrap(), false);
        assert_eq!(plain.len(), NLMSG_HDR + NFGENMSG);
        assert_eq!(plain[16], libc::AF_INET6 as u8);
    }
}
