//! nf_tables tables as the kernel dumps them over netlink (`NFT_MSG_GETTABLE`, `GETCHAIN`,
//! `GETRULE` with `NLM_F_DUMP`, as `nft list ruleset` and `iptables-nft-save` ask), parsed
//! into chains and rules the diff compares. The attribute numbers are the kernel's userspace
//! ABI (`linux/netfilter/nf_tables.h`), the same on every kernel.
//!
//! The netlink and attribute headers are read with `netlink-packet-core`. The nf_tables
//! attributes are parsed here: `netlink-packet-netfilter` types only six expression kinds
//! (not `match`, `target`, `ct`, `counter`, `reject`, `nat`, which iptables-nft and
//! kube-proxy write) and fails a whole message on an attribute it reads strictly;
//! `rustables` is GPL-3.0; the `nftables` crate runs the `nft` binary.
//!
//! A rule is rendered as parts, one per match or statement, the verdict last, so the diff
//! says which part a rule lost: `meta l4proto tcp`, `ip daddr 10.96.0.10`, `tcp dport 53`,
//! `meta mark & 0x8000 == 0x8000`, `ct state invalid`; the xt extensions iptables-nft keeps
//! as they are (`match`, `target`) as iptables-save writes them (`-m mark --mark
//! 0x8000/0x8000`, `-j REJECT --reject-with ...`), or by name and a digest of their bytes;
//! the comment (an xt `comment` match, or the rule's userdata) as `-m comment --comment
//! "..."`; the verdict as `-j DROP`, `-j KUBE-SERVICES` (jump), `-g X` (goto). Counters are
//! left out: they change with every packet.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{NetlinkBuffer, NlaBuffer, NlasIterator};

use super::ipset::SetNames;
use super::xt_ext::{match_text, target_text};
use super::xt_table::{digest, Chain, Family, Rule};

/// `NFNL_SUBSYS_NFTABLES`, in the high byte of a message type.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFT_MSG_GETTABLE: u8 = 1;
pub const NFT_MSG_GETCHAIN: u8 = 4;
pub const NFT_MSG_GETRULE: u8 = 7;
pub const NFT_MSG_NEWTABLE: u8 = 0;
pub const NFT_MSG_NEWCHAIN: u8 = 3;
pub const NFT_MSG_NEWRULE: u8 = 6;
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
pub(super) const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP_INTR: u16 = 16;
pub(super) const NLM_F_DUMP: u16 = 0x300;
/// `struct nlmsghdr` and `struct nfgenmsg`.
pub(super) const NLMSG_HDR: usize = 16;
pub(super) const NFGENMSG: usize = 4;

/// The error code of an `NLMSG_ERROR` message's payload (0: an acknowledgement; else
/// `-errno`); `None` when too short to hold one.
pub(super) fn nlmsg_errno(payload: &[u8]) -> Option<i32> {
    payload
        .get(0..4)
        .and_then(|b| b.try_into().ok())
        .map(i32::from_ne_bytes)
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NftError {
    #[error("a netlink message is malformed: {0}")]
    Message(String),
    #[error("a {what} attribute is malformed")]
    Attr { what: &'static str },
    #[error("a {0} message lacks its name")]
    Unnamed(&'static str),
    #[error("the kernel refused the dump: {0}")]
    Kernel(std::io::ErrorKind, i32),
}

/// The request for one dump of every family's objects of a kind (`NFT_MSG_GET*`).
pub fn dump_request(msg: u8, seq: u32) -> [u8; NLMSG_HDR + NFGENMSG] {
    let mut b = [0u8; NLMSG_HDR + NFGENMSG];
    b[0..4].copy_from_slice(&((NLMSG_HDR + NFGENMSG) as u32).to_ne_bytes());
    b[4..6].copy_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | u16::from(msg)).to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    // nfgenmsg: NFPROTO_UNSPEC (every family), NFNETLINK_V0, res_id 0.
    b
}

/// The request for one dump of the rules of one chain (`NFTA_RULE_TABLE`,
/// `NFTA_RULE_CHAIN`, in the chain's family): the kernel walks that chain alone, where a dump
/// of every rule walks again past all it sent for each answer (quadratic in the ruleset).
pub fn chain_rules_request(family: u8, table: &str, chain: &str, seq: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(NLMSG_HDR + NFGENMSG + 8 + table.len() + chain.len() + 8);
    b.extend_from_slice(&[0u8; NLMSG_HDR]);
    b[4..6]
        .copy_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | u16::from(NFT_MSG_GETRULE)).to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    // nfgenmsg: the family, NFNETLINK_V0, res_id 0.
    b.extend_from_slice(&[family, 0, 0, 0]);
    for (ty, v) in [(1u16, table), (2u16, chain)] {
        // A NUL-terminated string attribute, padded to 4 bytes.
        let len = 4 + v.len() + 1;
        b.extend_from_slice(&(len as u16).to_ne_bytes());
        b.extend_from_slice(&ty.to_ne_bytes());
        b.extend_from_slice(v.as_bytes());
        b.push(0);
        b.resize(b.len().next_multiple_of(4), 0);
    }
    let total = b.len() as u32;
    b[0..4].copy_from_slice(&total.to_ne_bytes());
    b
}

/// One netlink message of a dump's answer.
#[derive(Debug, PartialEq, Eq)]
pub enum Msg<'a> {
    /// The dump is complete.
    Done,
    /// An nf_tables object: its message type (`NFT_MSG_NEW*`), family, the ruleset
    /// generation it was dumped at (low 16 bits), whether the dump was interrupted by a
    /// change, and its attributes.
    Object {
        msg: u8,
        family: u8,
        generation: u16,
        interrupted: bool,
        attrs: &'a [u8],
    },
    /// Anything else (another subsystem's message, an ack).
    Other,
}

/// The messages of one datagram; a kernel error is an [`NftError::Kernel`].
pub fn messages(datagram: &[u8]) -> Result<Vec<Msg<'_>>, NftError> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < datagram.len() {
        let rest = &datagram[at..];
        let nl = NetlinkBuffer::new_checked(rest).map_err(|e| NftError::Message(e.to_string()))?;
        let len = nl.length() as usize;
        let payload = &rest[NLMSG_HDR..len];
        let ty = nl.message_type();
        match ty {
            NLMSG_DONE => {
                out.push(Msg::Done);
                return Ok(out);
            }
            NLMSG_ERROR => {
                let errno = nlmsg_errno(payload)
                    .ok_or_else(|| NftError::Message("short error message".into()))?;
                if errno != 0 {
                    let e = std::io::Error::from_raw_os_error(-errno);
                    return Err(NftError::Kernel(e.kind(), -errno));
                }
                out.push(Msg::Other);
            }
            _ if ty >> 8 == NFNL_SUBSYS_NFTABLES => {
                if payload.len() < NFGENMSG {
                    return Err(NftError::Message("short nfgenmsg".into()));
                }
                out.push(Msg::Object {
                    msg: (ty & 0xff) as u8,
                    family: payload[0],
                    generation: u16::from_be_bytes([payload[2], payload[3]]),
                    interrupted: nl.flags() & NLM_F_DUMP_INTR != 0,
                    attrs: &payload[NFGENMSG..],
                });
            }
            _ => out.push(Msg::Other),
        }
        // Messages are 4-aligned in a datagram.
        at += len.div_ceil(4) * 4;
    }
    Ok(out)
}

/// `nft`'s name of a family: `ip`, `ip6`, `inet`, `arp`, `bridge`, `netdev`.
pub fn family_name(f: u8) -> String {
    match f {
        1 => "inet".into(),
        2 => "ip".into(),
        3 => "arp".into(),
        5 => "netdev".into(),
        7 => "bridge".into(),
        10 => "ip6".into(),
        n => format!("family{n}"),
    }
}

/// The attributes of `b`, by type (flags masked off); a malformed one is an error.
fn attrs<'a>(
    b: &'a [u8],
    what: &'static str,
) -> impl Iterator<Item = Result<(u16, &'a [u8]), NftError>> + 'a {
    NlasIterator::new(b).map(move |a| {
        let a: NlaBuffer<&[u8]> = a.map_err(|_| NftError::Attr { what })?;
        let (kind, len) = (a.kind(), usize::from(a.length()));
        // `new_checked` proved 4 <= len <= the buffer's length; `value()` borrows the
        // NlaBuffer, the slice of the buffer outlives it.
        let v = a.into_inner().get(4..len).ok_or(NftError::Attr { what })?;
        Ok((kind, v))
    })
}

fn string(v: &[u8]) -> String {
    let end = v.iter().position(|&c| c == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

fn be32(v: &[u8], what: &'static str) -> Result<u32, NftError> {
    v.get(0..4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_be_bytes)
        .ok_or(NftError::Attr { what })
}

/// A table message's name.
pub fn parse_table(a: &[u8]) -> Result<String, NftError> {
    for at in attrs(a, "table") {
        let (k, v) = at?;
        if k == 1 {
            return Ok(string(v));
        }
    }
    Err(NftError::Unnamed("table"))
}

/// One chain as dumped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftChain {
    pub table: String,
    pub name: String,
    /// A base chain's policy (`ACCEPT`, `DROP`); `None` for a regular chain.
    pub policy: Option<String>,
}

pub fn parse_chain(a: &[u8]) -> Result<NftChain, NftError> {
    let (mut table, mut name, mut policy, mut base) = (None, None, None, false);
    for at in attrs(a, "chain") {
        let (k, v) = at?;
        match k {
            1 => table = Some(string(v)),
            3 => name = Some(string(v)),
            4 => base = true,
            5 => policy = Some(verdict_name(be32(v, "chain policy")? as i32)),
            _ => {}
        }
    }
    Ok(NftChain {
        table: table.ok_or(NftError::Unnamed("chain"))?,
        name: name.ok_or(NftError::Unnamed("chain"))?,
        // A base chain without a policy attribute (none such today) still is one.
        policy: base.then(|| policy.unwrap_or_else(|| "ACCEPT".into())),
    })
}

/// One rule as dumped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftRule {
    pub table: String,
    pub chain: String,
    pub rule: Rule,
}

/// A rule message, its expressions rendered for a table of `family`.
pub fn parse_rule(family: u8, a: &[u8]) -> Result<NftRule, NftError> {
    let (mut table, mut chain, mut comment) = (None, None, None);
    let mut r = Render::new(family);
    for at in attrs(a, "rule") {
        let (k, v) = at?;
        match k {
            1 => table = Some(string(v)),
            2 => chain = Some(string(v)),
            4 => {
                for e in attrs(v, "expression list") {
                    let (_, e) = e?;
                    r.expr(e)?;
                }
            }
            7 => comment = udata_comment(v),
            _ => {}
        }
    }
    let mut parts = Vec::new();
    if let Some(c) = comment {
        parts.push(format!("-m comment --comment \"{c}\""));
    }
    parts.extend(r.parts);
    parts.push(r.target.unwrap_or_else(|| "-j CONTINUE".into()));
    Ok(NftRule {
        table: table.ok_or(NftError::Unnamed("rule"))?,
        chain: chain.ok_or(NftError::Unnamed("rule"))?,
        rule: Rule(parts),
    })
}

/// The comment in a rule's userdata (libnftnl's TLVs: type, length, value;
/// `NFTNL_UDATA_RULE_COMMENT` is type 0).
fn udata_comment(mut u: &[u8]) -> Option<String> {
    while u.len() >= 2 {
        let (t, len) = (u[0], usize::from(u[1]));
        let v = u.get(2..2 + len)?;
        if t == 0 {
            return Some(string(v));
        }
        u = &u[2 + len..];
    }
    None
}

fn verdict_name(v: i32) -> String {
    match v {
        0 => "DROP".into(),
        1 => "ACCEPT".into(),
        2 => "STOLEN".into(),
        3 => "QUEUE".into(),
        4 => "REPEAT".into(),
        -1 => "CONTINUE".into(),
        -2 => "BREAK".into(),
        -5 => "RETURN".into(),
        v => format!("verdict {v}"),
    }
}

/// How a register's value is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fmt {
    Ipv4,
    Ipv6,
    /// A big-endian number (ports, lengths).
    Be,
    /// A host-endian number in hex (marks).
    Ne,
    /// An IP protocol number (`tcp`, `udp`).
    Proto,
    /// An interface name: a string, a prefix when shorter than the name.
    Ifname,
    /// `meta nfproto`: `ipv4`, `ipv6`.
    Nfproto,
    CtState,
    Hex,
}

/// What a register holds: a field loaded, maybe masked.
#[derive(Clone, Debug)]
struct Reg {
    name: String,
    fmt: Fmt,
    /// Bytes loaded (a payload load shorter than the field: a prefix).
    len: usize,
    /// `& mask ^ xor`, from a bitwise.
    mask: Option<(Vec<u8>, Vec<u8>)>,
}

/// Renders a rule's expressions in order, as a small register machine: loads name what a
/// register holds, comparisons say what it must be.
struct Render {
    regs: std::collections::HashMap<u32, Reg>,
    /// The layer-4 protocol a previous match required (names `th` fields).
    l4: Option<u8>,
    /// The layer-3 protocol, for tables of several (inet, bridge, netdev).
    l3: Option<u8>,
    parts: Vec<String>,
    target: Option<String>,
}

/// Expression attribute numbers (`NFTA_*`), by expression.
mod a {
    pub const EXPR_NAME: u16 = 1;
    pub const EXPR_DATA: u16 = 2;
    pub const DATA_VALUE: u16 = 1;
    pub const DATA_VERDICT: u16 = 2;
    pub const VERDICT_CODE: u16 = 1;
    pub const VERDICT_CHAIN: u16 = 2;
}

impl Render {
    fn new(family: u8) -> Self {
        Self {
            regs: Default::default(),
            l4: None,
            l3: match family {
                2 => Some(2),
                10 => Some(10),
                _ => None,
            },
            parts: Vec::new(),
            target: None,
        }
    }

    /// The layout an xt match or target of this table has (`ip6` tables hold IPv6's).
    fn xt_family(&self) -> Family {
        if self.l3 == Some(10) {
            Family::Ipv6
        } else {
            Family::Ipv4
        }
    }

    /// One `NFTA_LIST_ELEM` of the rule's expressions.
    fn expr(&mut self, e: &[u8]) -> Result<(), NftError> {
        let (mut name, mut data) = (None, &[][..]);
        for at in attrs(e, "expression") {
            let (k, v) = at?;
            match k {
                a::EXPR_NAME => name = Some(string(v)),
                a::EXPR_DATA => data = v,
                _ => {}
            }
        }
        let name = name.ok_or(NftError::Unnamed("expression"))?;
        // The expression's attributes by number; values are short.
        let mut f: Vec<(u16, &[u8])> = Vec::new();
        for at in attrs(data, "expression data") {
            f.push(at?);
        }
        let get = |k: u16| f.iter().find(|(t, _)| *t == k).map(|(_, v)| *v);
        let u32_of = |k: u16, what| get(k).map_or(Ok(0), |v| be32(v, what));
        match name.as_str() {
            // Counts change with every packet: not part of what a rule is.
            "counter" | "last" => {}
            "payload" => {
                let (base, off, len) = (
                    u32_of(2, "payload")?,
                    u32_of(3, "payload")?,
                    u32_of(4, "payload")? as usize,
                );
                let field = self.payload_field(base, off, len);
                match get(1) {
                    Some(d) => {
                        self.regs.insert(be32(d, "payload")?, field);
                    }
                    // A payload write (`NFTA_PAYLOAD_SREG`).
                    None => {
                        let src = self.reg_name(u32_of(5, "payload")?);
                        self.parts.push(format!("{} set {src}", field.name));
                    }
                }
            }
            "meta" => {
                let key = u32_of(2, "meta")?;
                let (kname, fmt) = meta_key(key);
                let field = Reg {
                    name: format!("meta {kname}"),
                    fmt,
                    len: 4,
                    mask: None,
                };
                match get(1) {
                    Some(d) => {
                        self.regs.insert(be32(d, "meta")?, field);
                    }
                    None => {
                        let src = self.reg_name(u32_of(3, "meta")?);
                        self.parts.push(format!("meta {kname} set {src}"));
                    }
                }
            }
            "ct" => {
                let key = u32_of(2, "ct")?;
                let kname = ct_key(key);
                let dir = match get(3).and_then(|v| v.first()) {
                    Some(0) => " original",
                    Some(1) => " reply",
                    _ => "",
                };
                let fmt = match key {
                    0 => Fmt::CtState,
                    3 => Fmt::Ne,
                    _ => Fmt::Hex,
                };
                match get(1) {
                    Some(d) => {
                        self.regs.insert(
                            be32(d, "ct")?,
                            Reg {
                                name: format!("ct{dir} {kname}"),
                                fmt,
                                len: 4,
                                mask: None,
                            },
                        );
                    }
                    None => {
                        let src = self.reg_name(u32_of(4, "ct")?);
                        self.parts.push(format!("ct {kname} set {src}"));
                    }
                }
            }
            "bitwise" => {
                let (sreg, dreg) = (u32_of(1, "bitwise")?, u32_of(2, "bitwise")?);
                let op = u32_of(6, "bitwise")?;
                let mut r = self
                    .regs
                    .get(&sreg)
                    .cloned()
                    .unwrap_or_else(|| unknown_reg(sreg));
                if op == 0 {
                    let mask = data_value(get(4))?;
                    let xor = data_value(get(5))?;
                    r.mask = Some((mask, xor));
                } else {
                    let n = data_value(get(7))?;
                    let n = n.first().copied().unwrap_or(0);
                    let sym = if op == 1 { "<<" } else { ">>" };
                    r.name = format!("{} {sym} {n}", r.name);
                    r.fmt = Fmt::Hex;
                }
                self.regs.insert(dreg, r);
            }
            "cmp" => {
                let sreg = u32_of(1, "cmp")?;
                let op = u32_of(2, "cmp")?;
                let value = data_value(get(3))?;
                let r = self
                    .regs
                    .get(&sreg)
                    .cloned()
                    .unwrap_or_else(|| unknown_reg(sreg));
                self.note_protocol(&r, op, &value);
                self.parts.push(cmp_text(&r, op, &value));
            }
            "range" => {
                let sreg = u32_of(1, "range")?;
                let op = u32_of(2, "range")?;
                let r = self
                    .regs
                    .get(&sreg)
                    .cloned()
                    .unwrap_or_else(|| unknown_reg(sreg));
                let (lo, hi) = (data_value(get(3))?, data_value(get(4))?);
                let not = if op == 1 { "!= " } else { "" };
                self.parts.push(format!(
                    "{} {not}{}-{}",
                    r.name,
                    value_text(r.fmt, &lo),
                    value_text(r.fmt, &hi)
                ));
            }
            "lookup" => {
                let set = get(1).map(string).unwrap_or_default();
                let r = self.reg_name(u32_of(2, "lookup")?);
                let inv = u32_of(5, "lookup")? & 1 != 0;
                match get(3) {
                    // A verdict map: the rule's verdict comes from it.
                    Some(d) if be32(d, "lookup")? == 0 => {
                        self.target = Some(format!("-j vmap {r} @{set}"));
                    }
                    Some(d) => {
                        let dreg = be32(d, "lookup")?;
                        self.regs.insert(
                            dreg,
                            Reg {
                                name: format!("{r} map @{set}"),
                                fmt: Fmt::Hex,
                                len: 4,
                                mask: None,
                            },
                        );
                    }
                    None => self
                        .parts
                        .push(format!("{r} {}@{set}", if inv { "!= " } else { "" })),
                }
            }
            "immediate" => {
                let dreg = u32_of(1, "immediate")?;
                let d = get(2).ok_or(NftError::Attr { what: "immediate" })?;
                for at in attrs(d, "immediate data") {
                    let (k, v) = at?;
                    match k {
                        a::DATA_VERDICT => self.target = Some(verdict_text(v)?),
                        a::DATA_VALUE => {
                            self.regs.insert(
                                dreg,
                                Reg {
                                    name: format!("0x{}", hex(v)),
                                    fmt: Fmt::Hex,
                                    len: v.len(),
                                    mask: None,
                                },
                            );
                        }
                        _ => {}
                    }
                }
            }
            "match" => {
                let n = get(1).map(string).unwrap_or_default();
                let rev = get(2).map_or(Ok(0), |v| be32(v, "match"))? as u8;
                let mut sets = SetNames::default();
                self.parts.push(match_text(
                    self.xt_family(),
                    &n,
                    rev,
                    get(3).unwrap_or_default(),
                    &mut |i| sets.name(i),
                ));
            }
            "target" => {
                let n = get(1).map(string).unwrap_or_default();
                let rev = get(2).map_or(Ok(0), |v| be32(v, "target"))? as u8;
                self.target = Some(target_text(
                    self.xt_family(),
                    &n,
                    rev,
                    get(3).unwrap_or_default(),
                ));
            }
            "reject" => {
                let ty = u32_of(1, "reject")?;
                let code = get(2).and_then(|v| v.first()).copied().unwrap_or(0);
                self.target = Some(match ty {
                    1 => "-j REJECT --reject-with tcp-reset".into(),
                    _ => format!(
                        "-j REJECT --reject-with {} {code}",
                        ["icmp", "tcp", "icmpx"].get(ty as usize).unwrap_or(&"?")
                    ),
                });
            }
            "masq" => self.target = Some("-j MASQUERADE".into()),
            "nat" => {
                let ty = if u32_of(1, "nat")? == 0 {
                    "SNAT"
                } else {
                    "DNAT"
                };
                // As iptables-nft-save writes it (`--to-destination 10.244.1.5:8080`) when
                // the address and port are constants, as kube-proxy's and iptables-nft's are.
                let imm = |k: u16| -> Option<Vec<u8>> {
                    let r = be32(get(k)?, "nat").ok()?;
                    let name = &self.regs.get(&r)?.name;
                    unhex(name.strip_prefix("0x")?)
                };
                let ip = imm(3).and_then(|b| match b.len() {
                    4 => <[u8; 4]>::try_from(b.as_slice())
                        .ok()
                        .map(|a| Ipv4Addr::from(a).to_string()),
                    16 => <[u8; 16]>::try_from(b.as_slice())
                        .ok()
                        .map(|a| format!("[{}]", Ipv6Addr::from(a))),
                    _ => None,
                });
                let port = imm(5).and_then(|b| <[u8; 2]>::try_from(b.as_slice()).ok());
                let mut t = format!("-j {ty}");
                // A range only when its maximum differs from its minimum (`nft` loads both
                // registers, with the same value, for a single address and port).
                let complex = [(4u16, 3u16), (6, 5)].iter().any(|&(max, min)| {
                    get(max).is_some() && (imm(max).is_none() || imm(max) != imm(min))
                });
                match ip {
                    Some(ip) if !complex => {
                        let ip = match port {
                            Some(_) => ip,
                            // Without a port, iptables-save writes the bare IPv6 address.
                            None => ip.trim_matches(['[', ']']).to_owned(),
                        };
                        let to = if ty == "DNAT" {
                            "destination"
                        } else {
                            "source"
                        };
                        let _ = write!(t, " --to-{to} {ip}");
                        if let Some(p) = port {
                            let _ = write!(t, ":{}", u16::from_be_bytes(p));
                        }
                    }
                    _ => {
                        for (k, what) in
                            [(3, "addr"), (4, "addr max"), (5, "port"), (6, "port max")]
                        {
                            if let Some(v) = get(k) {
                                let _ = write!(t, " {what} {}", self.reg_name(be32(v, "nat")?));
                            }
                        }
                    }
                }
                self.target = Some(t);
            }
            "redir" => self.target = Some("-j REDIRECT".into()),
            "queue" => self.target = Some("-j QUEUE".into()),
            "log" => {
                let prefix = get(2).map(string);
                self.parts.push(match prefix {
                    Some(p) => format!("log prefix \"{p}\""),
                    None => "log".into(),
                });
            }
            // Its consumption changes with traffic; the quota itself does not.
            "quota" => self
                .parts
                .push(format!("quota {}", get(1).map(hex).unwrap_or_default())),
            other => self.parts.push(format!("{other} [{}]", digest(data))),
        }
        Ok(())
    }

    fn reg_name(&self, r: u32) -> String {
        self.regs
            .get(&r)
            .map_or_else(|| format!("reg {r}"), |r| r.name.clone())
    }

    /// A `meta l4proto` / `ip protocol` / `meta nfproto` match names what follows.
    fn note_protocol(&mut self, r: &Reg, op: u32, value: &[u8]) {
        if op != 0 || r.mask.is_some() {
            return;
        }
        match r.fmt {
            Fmt::Proto => self.l4 = value.first().copied(),
            Fmt::Nfproto => self.l3 = value.first().copied(),
            _ if r.name == "meta protocol" && value.len() >= 2 => {
                self.l3 = match u16::from_be_bytes([value[0], value[1]]) {
                    0x0800 => Some(2),
                    0x86dd => Some(10),
                    _ => None,
                }
            }
            _ => {}
        }
    }

    fn payload_field(&self, base: u32, off: u32, len: usize) -> Reg {
        let reg = |name: String, fmt| Reg {
            name,
            fmt,
            len,
            mask: None,
        };
        let ip4 = |off, len| match (off, len) {
            (12, 1..=4) => Some(("ip saddr", Fmt::Ipv4)),
            (16, 1..=4) => Some(("ip daddr", Fmt::Ipv4)),
            (9, 1) => Some(("ip protocol", Fmt::Proto)),
            _ => None,
        };
        let ip6 = |off, len| match (off, len) {
            (8, 1..=16) => Some(("ip6 saddr", Fmt::Ipv6)),
            (24, 1..=16) => Some(("ip6 daddr", Fmt::Ipv6)),
            (6, 1) => Some(("ip6 nexthdr", Fmt::Proto)),
            _ => None,
        };
        let known = match (base, self.l3) {
            (1, Some(2)) => ip4(off, len),
            (1, Some(10)) => ip6(off, len),
            (2, _) => match (off, len) {
                (0, 2) => Some(("sport", Fmt::Be)),
                (2, 2) => Some(("dport", Fmt::Be)),
                _ => None,
            },
            _ => None,
        };
        match (base, known) {
            (2, Some((f, fmt))) => {
                let l4 = match self.l4 {
                    Some(6) => "tcp",
                    Some(17) => "udp",
                    Some(132) => "sctp",
                    Some(136) => "udplite",
                    _ => "th",
                };
                reg(format!("{l4} {f}"), fmt)
            }
            (_, Some((f, fmt))) => reg(f.to_string(), fmt),
            _ => {
                let b = ["ll", "nh", "th", "ih"].get(base as usize).unwrap_or(&"?");
                reg(format!("@{b},{},{}", off * 8, len * 8), Fmt::Hex)
            }
        }
    }
}

/// A register never loaded in this rule (or a load xtlock does not know).
fn unknown_reg(r: u32) -> Reg {
    Reg {
        name: format!("reg {r}"),
        fmt: Fmt::Hex,
        len: 0,
        mask: None,
    }
}

/// The value of an `NFTA_DATA_VALUE` nested in `v` (empty when absent).
fn data_value(v: Option<&[u8]>) -> Result<Vec<u8>, NftError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    for at in attrs(v, "data") {
        let (k, d) = at?;
        if k == a::DATA_VALUE {
            return Ok(d.to_vec());
        }
    }
    Ok(Vec::new())
}

/// An `NFTA_DATA_VERDICT`: `-j DROP`, `-j CHAIN`, `-g CHAIN`.
fn verdict_text(v: &[u8]) -> Result<String, NftError> {
    let (mut code, mut chain) = (None, None);
    for at in attrs(v, "verdict") {
        let (k, d) = at?;
        match k {
            a::VERDICT_CODE => code = Some(be32(d, "verdict")? as i32),
            a::VERDICT_CHAIN => chain = Some(string(d)),
            _ => {}
        }
    }
    Ok(match (code, chain) {
        (Some(-3), Some(c)) => format!("-j {c}"),
        (Some(-4), Some(c)) => format!("-g {c}"),
        (Some(c), _) => format!("-j {}", verdict_name(c)),
        (None, _) => "-j verdict ?".into(),
    })
}

fn meta_key(k: u32) -> (&'static str, Fmt) {
    match k {
        0 => ("length", Fmt::Ne),
        1 => ("protocol", Fmt::Hex),
        2 => ("priority", Fmt::Ne),
        3 => ("mark", Fmt::Ne),
        4 => ("iif", Fmt::Ne),
        5 => ("oif", Fmt::Ne),
        6 => ("iifname", Fmt::Ifname),
        7 => ("oifname", Fmt::Ifname),
        8 => ("iiftype", Fmt::Ne),
        9 => ("oiftype", Fmt::Ne),
        10 => ("skuid", Fmt::Ne),
        11 => ("skgid", Fmt::Ne),
        12 => ("nftrace", Fmt::Ne),
        15 => ("nfproto", Fmt::Nfproto),
        16 => ("l4proto", Fmt::Proto),
        19 => ("pkttype", Fmt::Ne),
        20 => ("cpu", Fmt::Ne),
        23 => ("cgroup", Fmt::Ne),
        24 => ("random", Fmt::Ne),
        _ => ("?", Fmt::Hex),
    }
}

fn ct_key(k: u32) -> String {
    let names = [
        "state",
        "direction",
        "status",
        "mark",
        "secmark",
        "expiration",
        "helper",
        "l3protocol",
        "saddr",
        "daddr",
        "protocol",
        "proto-src",
        "proto-dst",
        "label",
    ];
    names
        .get(k as usize)
        .map_or_else(|| format!("key{k}"), |s| (*s).to_string())
}

/// The bytes of `hex`'s text.
fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn hex(v: &[u8]) -> String {
    v.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `reg OP value`, as nft lists it: `ip daddr 10.96.0.10`, `tcp dport != 53`,
/// `ip saddr 10.0.0.0/8`, `meta mark & 0x8000 == 0x8000`, `ct state invalid,new`.
fn cmp_text(r: &Reg, op: u32, value: &[u8]) -> String {
    let sym = ["==", "!=", "<", "<=", ">", ">="]
        .get(op as usize)
        .unwrap_or(&"?");
    // Equality is implicit, as in nft's listing; other operators are written.
    let op_text = |v: String| {
        if op == 0 {
            format!("{} {v}", r.name)
        } else {
            format!("{} {sym} {v}", r.name)
        }
    };
    let full = match r.fmt {
        Fmt::Ipv4 => 4,
        Fmt::Ipv6 => 16,
        _ => 0,
    };
    if full > 0 && op <= 1 {
        // A prefix: a shorter load, or a contiguous mask.
        let prefix = match &r.mask {
            None if r.len < full => Some(r.len * 8),
            Some((m, x)) if x.iter().all(|&b| b == 0) => prefix_len(m),
            _ => None,
        };
        if let Some(p) = prefix {
            let mut a = value.to_vec();
            a.resize(full, 0);
            return op_text(format!("{}/{p}", value_text(r.fmt, &a)));
        }
    }
    match &r.mask {
        None => op_text(value_text(r.fmt, value)),
        // `ct state invalid` is `state & invalid != 0`.
        Some((m, _)) if r.fmt == Fmt::CtState && op == 1 && value.iter().all(|&b| b == 0) => {
            format!("{} {}", r.name, value_text(Fmt::CtState, m))
        }
        Some((m, x)) => {
            let fmt = if r.fmt == Fmt::Ipv4 || r.fmt == Fmt::Ipv6 {
                Fmt::Hex
            } else {
                r.fmt
            };
            let mut s = format!("{} & {}", r.name, value_text(fmt, m));
            if x.iter().any(|&b| b != 0) {
                let _ = write!(s, " ^ {}", value_text(fmt, x));
            }
            format!("{s} {sym} {}", value_text(fmt, value))
        }
    }
}

/// The prefix length of a contiguous network mask.
fn prefix_len(m: &[u8]) -> Option<usize> {
    let ones: usize = m.iter().map(|b| b.count_ones() as usize).sum();
    let contiguous = m
        .iter()
        .enumerate()
        .all(|(i, &b)| b == mask_byte(ones.saturating_sub(i * 8)));
    contiguous.then_some(ones)
}

fn mask_byte(bits: usize) -> u8 {
    match bits {
        0 => 0,
        b if b >= 8 => 0xff,
        b => 0xffu8 << (8 - b),
    }
}

fn value_text(fmt: Fmt, v: &[u8]) -> String {
    let ne = |v: &[u8]| -> Option<u64> {
        Some(match v.len() {
            1 => u64::from(v[0]),
            2 => u64::from(u16::from_ne_bytes(v.try_into().ok()?)),
            4 => u64::from(u32::from_ne_bytes(v.try_into().ok()?)),
            8 => u64::from_ne_bytes(v.try_into().ok()?),
            _ => return None,
        })
    };
    let be = |v: &[u8]| -> Option<u64> {
        (v.len() <= 8).then(|| v.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b)))
    };
    let text = match fmt {
        Fmt::Ipv4 => <[u8; 4]>::try_from(v)
            .ok()
            .map(|a| Ipv4Addr::from(a).to_string()),
        Fmt::Ipv6 => <[u8; 16]>::try_from(v)
            .ok()
            .map(|a| Ipv6Addr::from(a).to_string()),
        Fmt::Be => be(v).map(|n| n.to_string()),
        Fmt::Ne => ne(v).map(|n| format!("{n:#x}")),
        Fmt::Proto => v.first().map(|&p| match p {
            1 => "icmp".into(),
            6 => "tcp".into(),
            17 => "udp".into(),
            58 => "icmpv6".into(),
            132 => "sctp".into(),
            n => n.to_string(),
        }),
        Fmt::Nfproto => v.first().map(|&p| match p {
            2 => "ipv4".into(),
            10 => "ipv6".into(),
            n => n.to_string(),
        }),
        Fmt::Ifname => {
            // Shorter than the name with its NUL: a prefix (`eth+`).
            let whole = v.contains(&0);
            Some(format!("\"{}{}\"", string(v), if whole { "" } else { "*" }))
        }
        Fmt::CtState => ne(v).map(|n| {
            let names = [
                (1, "invalid"),
                (2, "established"),
                (4, "related"),
                (8, "new"),
                (64, "untracked"),
            ];
            let s: Vec<&str> = names
                .iter()
                .filter(|(b, _)| n & b != 0)
                .map(|(_, s)| *s)
                .collect();
            if s.is_empty() {
                format!("{n:#x}")
            } else {
                s.join(",")
            }
        }),
        Fmt::Hex => None,
    };
    text.unwrap_or_else(|| format!("0x{}", hex(v)))
}

/// One nf_tables table read whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftTable {
    /// `nft ip`, `nft ip6`, `nft inet`, ... (see [`family_name`]).
    pub family: String,
    pub name: String,
    pub chains: Vec<Chain>,
}

/// Puts a dump's objects together: each table with its chains in dump order, each chain
/// with its rules in order. Rules and chains of a table or chain not in the dump are
/// dropped (they cannot be: a consistent dump has them all).
pub fn assemble(
    tables: Vec<(u8, String)>,
    chains: Vec<(u8, NftChain)>,
    rules: Vec<(u8, NftRule)>,
) -> Vec<NftTable> {
    use std::collections::HashMap;
    let mut out: Vec<NftTable> = tables
        .iter()
        .map(|(f, n)| NftTable {
            family: format!("nft {}", family_name(*f)),
            name: n.clone(),
            chains: Vec::new(),
        })
        .collect();
    let table_at: HashMap<(u8, &str), usize> = tables
        .iter()
        .enumerate()
        .map(|(i, (f, n))| ((*f, n.as_str()), i))
        .collect();
    let mut chain_at: HashMap<(u8, String, String), (usize, usize)> = HashMap::new();
    for (f, c) in chains {
        if let Some(&t) = table_at.get(&(f, c.table.as_str())) {
            let i = out[t].chains.len();
            chain_at.insert((f, c.table.clone(), c.name.clone()), (t, i));
            out[t].chains.push(Chain {
                name: c.name,
                policy: c.policy,
                rules: Vec::new(),
            });
        }
    }
    for (f, r) in rules {
        if let Some(&(t, c)) = chain_at.get(&(f, r.table, r.chain)) {
            out[t].chains[c].rules.push(r.rule);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// One attribute: type, value, padded.
    pub(crate) fn nla(kind: u16, v: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(((4 + v.len()) as u16).to_ne_bytes());
        b.extend(kind.to_ne_bytes());
        b.extend(v);
        b.resize(b.len().div_ceil(4) * 4, 0);
        b
    }

    fn nested(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
        nla(kind | 0x8000, &parts.concat())
    }

    #[test]
    fn a_chains_rules_are_asked_for_by_table_and_chain() {
        let r = chain_rules_request(2, "kube-proxy", "service-X-ns/web/tcp/http", 7);
        let mut want = Vec::new();
        // nlmsghdr: length, NFT_MSG_GETRULE of nf_tables, REQUEST | DUMP, seq 7, port 0.
        let body = [
            vec![2, 0, 0, 0],
            nla(1, &s("kube-proxy")),
            nla(2, &s("service-X-ns/web/tcp/http")),
        ]
        .concat();
        want.extend(((16 + body.len()) as u32).to_ne_bytes());
        want.extend(((10u16 << 8) | 7).to_ne_bytes());
        want.extend(0x301u16.to_ne_bytes());
        want.extend(7u32.to_ne_bytes());
        want.extend(0u32.to_ne_bytes());
        want.extend(body);
        assert_eq!(r, want);
        assert_eq!(r.len() % 4, 0);
    }

    fn s(v: &str) -> Vec<u8> {
        let mut b = v.as_bytes().to_vec();
        b.push(0);
        b
    }

    fn be(v: u32) -> Vec<u8> {
        v.to_be_bytes().to_vec()
    }

    fn expr(name: &str, data: &[Vec<u8>]) -> Vec<u8> {
        nested(1, &[nla(1, &s(name)), nested(2, data)])
    }

    fn cmp(reg: u32, op: u32, v: &[u8]) -> Vec<u8> {
        expr(
            "cmp",
            &[nla(1, &be(reg)), nla(2, &be(op)), nested(3, &[nla(1, v)])],
        )
    }

    fn meta(key: u32) -> Vec<u8> {
        expr("meta", &[nla(1, &be(1)), nla(2, &be(key))])
    }

    fn payload(base: u32, off: u32, len: u32) -> Vec<u8> {
        expr(
            "payload",
            &[
                nla(1, &be(1)),
                nla(2, &be(base)),
                nla(3, &be(off)),
                nla(4, &be(len)),
            ],
        )
    }

    fn verdict(code: i32, chain: Option<&str>) -> Vec<u8> {
        let mut v = vec![nla(1, &code.to_be_bytes())];
        if let Some(c) = chain {
            v.push(nla(2, &s(c)));
        }
        expr("immediate", &[nla(1, &be(0)), nested(2, &[nested(2, &v)])])
    }

    /// iptables-nft's `-A KUBE-FIREWALL -m comment --comment "..." -m mark --mark
    /// 0x8000/0x8000 -j DROP` (the comment as a compat match, the mark native), as a
    /// rule message's attributes; without the mark when `stripped`.
    pub(crate) fn firewall_rule(stripped: bool) -> Vec<u8> {
        let mut comment = vec![0u8; 256];
        comment[..6].copy_from_slice(b"kp fw!");
        let mut exprs = vec![expr(
            "match",
            &[nla(1, &s("comment")), nla(2, &be(0)), nla(3, &comment)],
        )];
        if !stripped {
            exprs.push(meta(3));
            exprs.push(expr(
                "bitwise",
                &[
                    nla(1, &be(1)),
                    nla(2, &be(1)),
                    nla(3, &be(4)),
                    nested(4, &[nla(1, &0x8000u32.to_ne_bytes())]),
                    nested(5, &[nla(1, &0u32.to_ne_bytes())]),
                ],
            ));
            exprs.push(cmp(1, 0, &0x8000u32.to_ne_bytes()));
        }
        exprs.push(expr("counter", &[nla(1, &[0; 8]), nla(2, &[0; 8])]));
        exprs.push(verdict(0, None));
        [
            nla(1, &s("filter")),
            nla(2, &s("KUBE-FIREWALL")),
            nla(3, &7u64.to_be_bytes()),
            nested(4, &exprs),
        ]
        .concat()
    }

    fn service_rule() -> Vec<u8> {
        let exprs = vec![
            meta(16),
            cmp(1, 0, &[6]),
            payload(1, 16, 4),
            cmp(1, 0, &[10, 96, 0, 10]),
            payload(2, 2, 2),
            cmp(1, 0, &53u16.to_be_bytes()),
            payload(1, 12, 1),
            cmp(1, 1, &[10]),
            meta(6),
            cmp(1, 0, b"eth"),
            verdict(-3, Some("KUBE-SVC-ABC")),
        ];
        // A userdata comment (type 0, length, text with its NUL).
        let mut udata = vec![0u8, 4];
        udata.extend(b"svc\0");
        [
            nla(1, &s("filter")),
            nla(2, &s("KUBE-SERVICES")),
            nested(4, &exprs),
            nla(7, &udata),
        ]
        .concat()
    }

    #[test]
    fn rules_render_as_parts_verdict_last() {
        let r = parse_rule(2, &firewall_rule(false)).unwrap();
        assert_eq!(
            (r.table.as_str(), r.chain.as_str()),
            ("filter", "KUBE-FIREWALL")
        );
        assert_eq!(
            r.rule.0,
            [
                "-m comment --comment \"kp fw!\"",
                "meta mark & 0x8000 == 0x8000",
                "-j DROP"
            ]
        );
        assert_eq!(r.rule.comment(), Some("\"kp fw!\""));
        let stripped = parse_rule(2, &firewall_rule(true)).unwrap();
        assert_eq!(stripped.rule.matches().count(), 0);
        assert_eq!(stripped.rule.target(), "-j DROP");

        let r = parse_rule(2, &service_rule()).unwrap();
        assert_eq!(
            r.rule.0,
            [
                "-m comment --comment \"svc\"",
                "meta l4proto tcp",
                "ip daddr 10.96.0.10",
                "tcp dport 53",
                "ip saddr != 10.0.0.0/8",
                "meta iifname \"eth*\"",
                "-j KUBE-SVC-ABC"
            ]
        );
        assert_eq!(r.rule.jump(), Some("KUBE-SVC-ABC"));
        assert_eq!(r.rule.comment(), Some("\"svc\""));
    }

    #[test]
    fn chains_tables_and_a_dump() {
        let chain = [
            nla(1, &s("filter")),
            nla(3, &s("INPUT")),
            nested(4, &[nla(1, &be(1)), nla(2, &be(0))]),
            nla(5, &be(0)),
        ]
        .concat();
        let c = parse_chain(&chain).unwrap();
        assert_eq!(c.policy.as_deref(), Some("DROP"));
        let user = [nla(1, &s("filter")), nla(3, &s("KUBE-FIREWALL"))].concat();
        assert_eq!(parse_chain(&user).unwrap().policy, None);
        assert_eq!(parse_table(&nla(1, &s("filter"))).unwrap(), "filter");

        // A datagram: one rule message, then DONE.
        let mut d = Vec::new();
        let attrs = firewall_rule(false);
        let len = NLMSG_HDR + NFGENMSG + attrs.len();
        d.extend((len as u32).to_ne_bytes());
        d.extend(((10u16 << 8) | u16::from(NFT_MSG_NEWRULE)).to_ne_bytes());
        d.extend(2u16.to_ne_bytes());
        d.extend([0u8; 8]);
        d.extend([2, 0, 0, 9]);
        d.extend(&attrs);
        d.extend(16u32.to_ne_bytes());
        d.extend(NLMSG_DONE.to_ne_bytes());
        d.extend([0u8; 10]);
        let m = messages(&d).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            m[0],
            Msg::Object {
                msg: NFT_MSG_NEWRULE,
                family: 2,
                generation: 9,
                interrupted: false,
                attrs: &attrs
            }
        );
        assert_eq!(m[1], Msg::Done);
        let rule = parse_rule(2, &attrs).unwrap();
        let t = assemble(
            vec![(2, "filter".into())],
            vec![(2, parse_chain(&user).unwrap())],
            vec![(2, rule), (10, parse_rule(10, &attrs).unwrap())],
        );
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].family, "nft ip");
        assert_eq!(t[0].chains[0].rules.len(), 1);

        // A kernel error.
        let mut e = Vec::new();
        e.extend(36u32.to_ne_bytes());
        e.extend(NLMSG_ERROR.to_ne_bytes());
        e.extend([0u8; 10]);
        e.extend((-1i32).to_ne_bytes());
        e.extend([0u8; 16]);
        assert!(matches!(messages(&e), Err(NftError::Kernel(_, 1))));
    }

    #[test]
    fn damaged_input_is_an_error_not_a_panic() {
        let r = firewall_rule(false);
        for cut in 0..r.len() {
            let _ = parse_rule(2, &r[..cut]);
        }
        let mut bad = r.clone();
        bad[0] = 0xff; // the first attribute's length runs past the end
        assert!(parse_rule(2, &bad).is_err());
        assert!(
            parse_rule(2, &[]).is_err(),
            "a rule without its table and chain"
        );
        assert!(messages(&[1, 2, 3]).is_err());
        let mut short = vec![0u8; 20];
        short[0] = 200;
        assert!(messages(&short).is_err());
        for b in 0..=255u8 {
            let mut flipped = r.clone();
            flipped[b as usize % r.len()] ^= b;
            let _ = parse_rule(2, &flipped);
            let _ = parse_chain(&flipped);
        }
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = messages(&b);
            let _ = parse_rule(1, &b);
            let _ = parse_chain(&b);
            let _ = parse_table(&b);
        }
    }
}
