//! IPVS's virtual and real servers as its generic netlink family answers them (`ipvsadm
//! -Ln`): the request for the family's id, the dumps of services and of one service's
//! destinations, and the parse of the answers. Wire format: `include/uapi/linux/ip_vs.h` and
//! `genetlink.h`; ports are big-endian, the other numbers host order.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::netlink::{self, attrs, bytes, nested, put_attr, Message, GENLMSG, NLM_F_REQUEST};
#[cfg(test)]
use super::netlink::{Control, NLMSG_DONE, NLMSG_HDR};
use crate::event::{IpvsDest, IpvsService};

/// `GENL_ID_CTRL` and its commands and attributes.
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const IPVS_GENL_VERSION: u8 = 1;
const IPVS_CMD_GET_SERVICE: u8 = 4;
const IPVS_CMD_GET_DEST: u8 = 8;
const IPVS_CMD_ATTR_SERVICE: u16 = 1;
const IPVS_CMD_ATTR_DEST: u16 = 2;
const IPVS_SVC_ATTR_AF: u16 = 1;
const IPVS_SVC_ATTR_PROTOCOL: u16 = 2;
const IPVS_SVC_ATTR_ADDR: u16 = 3;
const IPVS_SVC_ATTR_PORT: u16 = 4;
const IPVS_SVC_ATTR_FWMARK: u16 = 5;
const IPVS_DEST_ATTR_ADDR: u16 = 1;
const IPVS_DEST_ATTR_PORT: u16 = 2;
const IPVS_DEST_ATTR_WEIGHT: u16 = 4;
const IPVS_DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const IPVS_DEST_ATTR_INACT_CONNS: u16 = 8;
const IPVS_DEST_ATTR_ADDR_FAMILY: u16 = 11;

/// One message of an answer.
#[derive(Debug, PartialEq, Eq)]
pub enum IpvsMsg {
    /// The family's id (an answer to [`family_request`]).
    Family(u16),
    Service(IpvsService),
    Dest(IpvsDest),
    #[cfg(test)]
    Done,
    /// The kernel refused (`errno`): `ENOENT` when no family of that name is registered.
    #[cfg(test)]
    Error(i32),
    Other,
}

fn message(ty: u16, flags: u16, seq: u32, cmd: u8, version: u8, attrs: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(GENLMSG + attrs.len());
    body.extend_from_slice(&[cmd, version, 0, 0]);
    body.extend_from_slice(attrs);
    netlink::request(ty, flags, seq, &body)
}

/// Asks the generic netlink controller for the id of the `IPVS` family.
pub fn family_request(seq: u32) -> Vec<u8> {
    let mut a = Vec::new();
    put_attr(&mut a, CTRL_ATTR_FAMILY_NAME, b"IPVS\0");
    message(GENL_ID_CTRL, NLM_F_REQUEST, seq, CTRL_CMD_GETFAMILY, 1, &a)
}

/// A dump of every virtual server.
pub fn services_request(family: u16, seq: u32) -> Vec<u8> {
    message(
        family,
        NLM_F_REQUEST | netlink::NLM_F_DUMP,
        seq,
        IPVS_CMD_GET_SERVICE,
        IPVS_GENL_VERSION,
        &[],
    )
}

/// A dump of the real servers of `svc` (named as the kernel named it: family, protocol and
/// address and port, or the firewall mark).
pub fn dests_request(family: u16, seq: u32, svc: &IpvsService) -> Vec<u8> {
    let mut s = Vec::new();
    put_attr(&mut s, IPVS_SVC_ATTR_AF, &service_af(svc).to_ne_bytes());
    match svc.addr {
        Some(a) => {
            put_attr(
                &mut s,
                IPVS_SVC_ATTR_PROTOCOL,
                &u16::from(svc.proto).to_ne_bytes(),
            );
            put_attr(&mut s, IPVS_SVC_ATTR_ADDR, &addr_bytes(a.ip()));
            put_attr(&mut s, IPVS_SVC_ATTR_PORT, &a.port().to_be_bytes());
        }
        None => put_attr(&mut s, IPVS_SVC_ATTR_FWMARK, &svc.fwmark.to_ne_bytes()),
    }
    message(
        family,
        NLM_F_REQUEST | netlink::NLM_F_DUMP,
        seq,
        IPVS_CMD_GET_DEST,
        IPVS_GENL_VERSION,
        &nested(IPVS_CMD_ATTR_SERVICE, &s),
    )
}

/// `union nf_inet_addr`: 16 bytes, an IPv4 address in the first 4.
fn addr_bytes(ip: IpAddr) -> [u8; 16] {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(v) => b[..4].copy_from_slice(&v.octets()),
        IpAddr::V6(v) => b = v.octets(),
    }
    b
}

fn addr_of(af: u16, v: &[u8]) -> Option<IpAddr> {
    if af == libc::AF_INET6 as u16 {
        bytes::<16>(v).map(|a| IpAddr::V6(Ipv6Addr::from(a)))
    } else {
        bytes::<4>(v).map(|a| IpAddr::V4(Ipv4Addr::from(a)))
    }
}

fn ne_u32(v: &[u8]) -> u32 {
    netlink::ne_u32(v).unwrap_or(0)
}

fn ne_u16(v: &[u8]) -> u16 {
    netlink::ne_u16(v).unwrap_or(0)
}

fn service(b: &[u8]) -> Option<IpvsService> {
    let (mut af, mut proto, mut addr, mut port, mut fwmark) = (0u16, 0u16, None, 0u16, 0u32);
    for (k, v) in attrs(b) {
        match k {
            IPVS_SVC_ATTR_AF => af = ne_u16(v),
            IPVS_SVC_ATTR_PROTOCOL => proto = ne_u16(v),
            IPVS_SVC_ATTR_ADDR => addr = Some(v),
            IPVS_SVC_ATTR_PORT => port = netlink::be_u16(v).unwrap_or(0),
            IPVS_SVC_ATTR_FWMARK => fwmark = ne_u32(v),
            _ => {}
        }
    }
    let addr = if fwmark != 0 {
        None
    } else {
        Some(SocketAddr::new(addr_of(af, addr?)?, port))
    };
    Some(IpvsService {
        proto: u8::try_from(proto).ok()?,
        addr,
        fwmark,
        dests: Vec::new(),
    })
}

fn dest(b: &[u8], svc_af: Option<u16>) -> Option<IpvsDest> {
    let (mut af, mut addr, mut port) = (svc_af, None, 0u16);
    let (mut weight, mut active, mut inactive) = (0, 0, 0);
    for (k, v) in attrs(b) {
        match k {
            IPVS_DEST_ATTR_ADDR => addr = Some(v),
            IPVS_DEST_ATTR_PORT => port = netlink::be_u16(v).unwrap_or(0),
            IPVS_DEST_ATTR_WEIGHT => weight = ne_u32(v),
            IPVS_DEST_ATTR_ACTIVE_CONNS => active = ne_u32(v),
            IPVS_DEST_ATTR_INACT_CONNS => inactive = ne_u32(v),
            IPVS_DEST_ATTR_ADDR_FAMILY => af = Some(ne_u16(v)),
            _ => {}
        }
    }
    // Before 4.15 a real server has no family of its own: the service's.
    let af = af.unwrap_or(libc::AF_INET as u16);
    Some(IpvsDest {
        addr: SocketAddr::new(addr_of(af, addr?)?, port),
        weight,
        active,
        inactive,
    })
}

/// What one message of an answer says (not its end or a refusal: the dump loop's); a message
/// that does not parse is `Other`. `svc_af` is the family of the service whose real servers
/// are asked for.
pub fn answer(m: &Message<'_>, svc_af: Option<u16>) -> IpvsMsg {
    let body = m.payload.get(GENLMSG..).unwrap_or_default();
    if m.ty == GENL_ID_CTRL {
        return attrs(body)
            .find(|(k, _)| *k == CTRL_ATTR_FAMILY_ID)
            .map_or(IpvsMsg::Other, |(_, v)| IpvsMsg::Family(ne_u16(v)));
    }
    let mut msg = IpvsMsg::Other;
    for (k, v) in attrs(body) {
        match k {
            IPVS_CMD_ATTR_SERVICE => msg = service(v).map_or(IpvsMsg::Other, IpvsMsg::Service),
            IPVS_CMD_ATTR_DEST => msg = dest(v, svc_af).map_or(IpvsMsg::Other, IpvsMsg::Dest),
            _ => {}
        }
    }
    msg
}

/// The messages of one datagram of an answer, up to its end.
#[cfg(test)]
pub fn messages(datagram: &[u8], svc_af: Option<u16>) -> Result<Vec<IpvsMsg>, netlink::FrameError> {
    let mut out = Vec::new();
    for m in netlink::framed(datagram) {
        let m = m?;
        out.push(match m.control()? {
            Some(Control::Done) => {
                out.push(IpvsMsg::Done);
                return Ok(out);
            }
            Some(Control::Refused(errno)) => IpvsMsg::Error(errno),
            Some(Control::Ack) => IpvsMsg::Other,
            None => answer(&m, svc_af),
        });
    }
    Ok(out)
}

/// The family of a service's address, for [`messages`] of its real servers.
pub fn service_af(svc: &IpvsService) -> u16 {
    match svc.addr {
        Some(SocketAddr::V6(_)) => libc::AF_INET6 as u16,
        _ => libc::AF_INET as u16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(ty: u16, cmd: u8, attrs: &[u8]) -> Vec<u8> {
        message(ty, 0, 1, cmd, 1, attrs)
    }

    #[test]
    fn a_service_and_its_real_servers_parse() {
        let svc = IpvsService {
            proto: 6,
            addr: Some("10.96.0.10:80".parse().unwrap()),
            fwmark: 0,
            dests: Vec::new(),
        };
        // What the kernel answers for it: the request's own service attributes.
        let req = dests_request(0x20, 1, &svc);
        let svc_attrs = &req[NLMSG_HDR + GENLMSG..];
        let mut dgram = answer(0x20, 1, svc_attrs);
        let mut d = Vec::new();
        put_attr(
            &mut d,
            IPVS_DEST_ATTR_ADDR,
            &addr_bytes("10.244.1.5".parse().unwrap()),
        );
        put_attr(&mut d, IPVS_DEST_ATTR_PORT, &8080u16.to_be_bytes());
        put_attr(&mut d, IPVS_DEST_ATTR_WEIGHT, &0u32.to_ne_bytes());
        put_attr(&mut d, IPVS_DEST_ATTR_ACTIVE_CONNS, &3u32.to_ne_bytes());
        dgram.extend(answer(0x20, 5, &nested(IPVS_CMD_ATTR_DEST, &d)));
        let mut done = answer(NLMSG_DONE, 0, &[]);
        done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        dgram.extend(done);
        let msgs = messages(&dgram, Some(libc::AF_INET as u16)).unwrap();
        assert_eq!(
            msgs,
            [
                IpvsMsg::Service(svc),
                IpvsMsg::Dest(IpvsDest {
                    addr: "10.244.1.5:8080".parse().unwrap(),
                    weight: 0,
                    active: 3,
                    inactive: 0,
                }),
                IpvsMsg::Done,
            ]
        );
    }

    #[test]
    fn damaged_answers_are_errors_or_other() {
        let svc = IpvsService {
            proto: 17,
            addr: Some("10.96.0.10:53".parse().unwrap()),
            fwmark: 0,
            dests: Vec::new(),
        };
        let req = dests_request(0x20, 1, &svc);
        let good = answer(0x20, 1, &req[NLMSG_HDR + GENLMSG..]);
        for cut in 0..good.len() {
            let _ = messages(&good[..cut], None);
        }
        for at in 0..good.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut bad = good.clone();
                bad[at] = v;
                let _ = messages(&bad, None);
            }
        }
        assert!(messages(&[1, 2, 3], None).is_err());
    }
}
