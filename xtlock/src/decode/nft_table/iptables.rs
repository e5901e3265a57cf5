//! An nf_tables rule of a table iptables-nft writes, in `iptables-nft-save`'s words: the
//! reading back iptables-nft itself does (`nft-ruleparse.c`, `nft-ruleparse-ipv4.c`,
//! `-ipv6.c`), then the save (`nft_ipv4_save_rule`, `save_matches_and_target`).
//!
//! iptables-nft writes the head of a rule (`-s`, `-d`, `-i`, `-o`, `-p`, `-f`) and a few
//! matches and targets as native expressions: payload and meta loads, masked by a bitwise,
//! compared by a cmp or a range; limit, log, meta set. They are read back into the structs
//! iptables keeps: the head into an [`IpHead`], worded as legacy entries are;
//! `--sport`/`--dport`/`--tcp-flags` into an `xt_tcp` or `xt_udp`, `-m mark` into an
//! `xt_mark_mtinfo1`, `-m limit` into an `xt_rateinfo`, `-m pkttype`, `-m icmp`, `-j MARK`,
//! `-j NFLOG`, `-j TRACE` likewise, each worded by its legacy decoder (`xt_ext.rs`).
//! Matches and targets iptables-nft keeps as xt extensions (`match`, `target`) go to those
//! decoders as they are. The save's order: the head, the matches in the order their first
//! expression came, the comment of the rule's userdata, the target.
//!
//! A rule holding anything iptables-nft would not read back so (a `ct`, `lookup` or `nat`
//! expression, a `log` to the kernel's log, a load of a field iptables has no option for)
//! has no iptables words: it keeps nft's. `iptables-nft-save` then calls the whole table
//! incompatible; the diff keeps the table's other rules in iptables' words.

use std::collections::HashMap;

use super::nfta::*;
use super::{verdict, Expr, NftError};
use crate::decode::netlink::{be_u16, be_u64, ne_u32};
use crate::decode::xt_ext::{match_text, target_text, SetNames};
use crate::decode::xt_table::{
    Family, IpHead, INV_DSTIP, INV_FRAG, INV_PROTO, INV_SRCIP, INV_VIA_IN, INV_VIA_OUT,
};
use crate::event::Rule;

/// The tables iptables-nft writes, in the order `iptables-nft-save` prints them, each with
/// its built-in chains in hook order (iptables' own table definitions). The save prints
/// every built-in chain of a table, one the kernel lacks with policy `ACCEPT`.
pub const IPTABLES_TABLES: [(&str, &[&str]); 5] = [
    (
        "mangle",
        &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
    ),
    ("security", &["INPUT", "FORWARD", "OUTPUT"]),
    ("raw", &["PREROUTING", "OUTPUT"]),
    ("filter", &["INPUT", "FORWARD", "OUTPUT"]),
    ("nat", &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]),
];

/// Whether a table of nf_tables `family` named `table` is one iptables-nft (IPv4) or
/// ip6tables-nft (IPv6) writes.
pub fn is_iptables_table(family: u8, table: &str) -> bool {
    matches!(family, NFPROTO_IPV4 | NFPROTO_IPV6) && IPTABLES_TABLES.iter().any(|t| t.0 == table)
}

/// Whether a rule read from such a table is in iptables' words: every part an option
/// (`-s ...`, `! -i ...`, `-m ...`, `-j ...`), as [`rule`] makes them. nft's words for a
/// rule iptables-nft cannot express have a part that is not (`ct state established`,
/// `tcp dport @set`), or a verdict iptables has none for.
pub fn iptables_words(rule: &Rule) -> bool {
    rule.0.iter().all(|p| {
        (p.starts_with('-') || p.starts_with("! "))
            && !matches!(p.as_str(), "-j CONTINUE" | "-j BREAK")
            && !p.starts_with("-j vmap ")
    })
}

/// `xt_tcp`'s and `xt_udp`'s inversion flags.
const PORT_INV_SRC: u8 = 0x01;
const PORT_INV_DST: u8 = 0x02;
const TCP_INV_FLAGS: u8 = 0x04;

/// `XT_LIMIT_SCALE`.
const LIMIT_SCALE: u64 = 10_000;

/// What a register holds, as iptables-nft's parser tracks it (`struct nft_xt_ctx_reg`).
#[derive(Clone, Debug)]
enum Load {
    Payload { base: u32, off: u32, len: u32 },
    Meta(u32),
    Imm(Vec<u8>),
}

#[derive(Clone, Debug)]
struct Reg {
    load: Load,
    /// A bitwise's mask (its xor is 0: iptables-nft writes none other).
    mask: Option<Vec<u8>>,
}

/// Why a rule has no iptables words.
enum Stop {
    /// It holds what iptables-nft does not read back: nft's words instead.
    Foreign,
    /// Its attributes are malformed: an error, whichever words.
    Bad(NftError),
}

impl From<NftError> for Stop {
    fn from(e: NftError) -> Self {
        Stop::Bad(e)
    }
}

type Step = Result<(), Stop>;

/// `xt_tcp` / `xt_udp` as iptables-nft builds them from payload matches: every port until
/// a match says otherwise (as `tcp_init`, `udp_init` start them).
#[derive(Clone, Copy, Debug)]
struct Ports {
    spts: [u16; 2],
    dpts: [u16; 2],
    flg_mask: u8,
    flg_cmp: u8,
    inv: u8,
}

impl Ports {
    fn new() -> Self {
        Ports {
            spts: [0, u16::MAX],
            dpts: [0, u16::MAX],
            flg_mask: 0,
            flg_cmp: 0,
            inv: 0,
        }
    }

    /// `xt_tcp` { u16 spts[2], dpts[2]; u8 option, flg_mask, flg_cmp, invflags }, or
    /// `xt_udp` { u16 spts[2], dpts[2]; u8 invflags } (its pad included).
    fn bytes(&self, tcp: bool) -> Vec<u8> {
        let mut b: Vec<u8> = [self.spts, self.dpts]
            .iter()
            .flatten()
            .flat_map(|p| p.to_ne_bytes())
            .collect();
        if tcp {
            b.extend([0, self.flg_mask, self.flg_cmp, self.inv]);
        } else {
            b.extend([self.inv, 0]);
        }
        b
    }
}

/// One match of the rule, in the order iptables-nft adds it.
enum Part {
    Text(String),
    /// A native port or flags match: later expressions may add to it (`--sport` and
    /// `--dport` are two loads), so it is worded at the end.
    Ports {
        tcp: bool,
        ports: Ports,
    },
}

struct Xt {
    family: Family,
    head: IpHead,
    parts: Vec<Part>,
    target: Option<String>,
    regs: HashMap<u32, Reg>,
    /// A `tcp` or `udp` match kept as an xt extension: native port matches after it would
    /// have been read into it, which is not done here.
    compat_ports: bool,
}

/// The parts of a rule of an iptables-nft table of `family` (`NFPROTO_IPV4`, `IPV6`) as
/// `iptables-nft-save` writes them, with `comment` from the rule's userdata; `None` when
/// iptables-nft cannot express the rule.
pub(super) fn rule(
    family: u8,
    exprs: &[Expr],
    comment: Option<&str>,
    sets: &mut SetNames<'_>,
) -> Result<Option<Vec<String>>, NftError> {
    let mut x = Xt {
        family: if family == NFPROTO_IPV6 {
            Family::Ipv6
        } else {
            Family::Ipv4
        },
        head: IpHead::default(),
        parts: Vec::new(),
        target: None,
        regs: HashMap::new(),
        compat_ports: false,
    };
    for e in exprs {
        match x.expr(e, sets) {
            Ok(()) => {}
            Err(Stop::Foreign) => return Ok(None),
            Err(Stop::Bad(err)) => return Err(err),
        }
    }
    Ok(Some(x.finish(comment)))
}

impl Xt {
    fn expr(&mut self, e: &Expr, sets: &mut SetNames<'_>) -> Step {
        match e.name.as_str() {
            // Counts change with every packet: not part of what a rule is.
            "counter" => Ok(()),
            "payload" => {
                if e.get(NFTA_PAYLOAD_DREG).is_none() {
                    // A payload write: no iptables option.
                    return Err(Stop::Foreign);
                }
                let load = Load::Payload {
                    base: e.u32(NFTA_PAYLOAD_BASE, "payload")?,
                    off: e.u32(NFTA_PAYLOAD_OFFSET, "payload")?,
                    len: e.u32(NFTA_PAYLOAD_LEN, "payload")?,
                };
                self.load(e.u32(NFTA_PAYLOAD_DREG, "payload")?, load);
                Ok(())
            }
            "meta" => match e.get(NFTA_META_DREG) {
                Some(_) => {
                    let dreg = e.u32(NFTA_META_DREG, "meta")?;
                    self.load(dreg, Load::Meta(e.u32(NFTA_META_KEY, "meta")?));
                    Ok(())
                }
                None => self.meta_set(
                    e.u32(NFTA_META_KEY, "meta")?,
                    e.u32(NFTA_META_SREG, "meta")?,
                ),
            },
            "bitwise" => {
                // Only `& mask ^ 0`, as iptables-nft writes.
                if e.u32(NFTA_BITWISE_OP, "bitwise")? != NFT_BITWISE_MASK_XOR
                    || e.value(NFTA_BITWISE_XOR)?.iter().any(|&b| b != 0)
                {
                    return Err(Stop::Foreign);
                }
                let mut r = self.reg(e.u32(NFTA_BITWISE_SREG, "bitwise")?)?;
                r.mask = Some(e.value(NFTA_BITWISE_MASK)?);
                self.regs.insert(e.u32(NFTA_BITWISE_DREG, "bitwise")?, r);
                Ok(())
            }
            "cmp" => {
                let r = self.reg(e.u32(NFTA_CMP_SREG, "cmp")?)?;
                self.cmp(&r, e.u32(NFTA_CMP_OP, "cmp")?, &e.value(NFTA_CMP_DATA)?)
            }
            "range" => {
                let r = self.reg(e.u32(NFTA_RANGE_SREG, "range")?)?;
                let op = e.u32(NFTA_RANGE_OP, "range")?;
                let (from, to) = (e.value(NFTA_RANGE_FROM_DATA)?, e.value(NFTA_RANGE_TO_DATA)?);
                self.range(&r, op, &from, &to)
            }
            "immediate" => self.immediate(e),
            "match" => {
                let name = e
                    .get(NFTA_MATCH_NAME)
                    .map(super::string)
                    .unwrap_or_default();
                let rev = e.u32(NFTA_MATCH_REV, "match")? as u8;
                self.compat_ports |= matches!(name.as_str(), "tcp" | "udp");
                let info = e.get(NFTA_MATCH_INFO).unwrap_or_default();
                let text = match_text(self.family, &name, rev, info, sets);
                self.parts.push(Part::Text(text));
                Ok(())
            }
            "target" => {
                let name = e
                    .get(NFTA_TARGET_NAME)
                    .map(super::string)
                    .unwrap_or_default();
                let rev = e.u32(NFTA_TARGET_REV, "target")? as u8;
                let info = e.get(NFTA_TARGET_INFO).unwrap_or_default();
                let text = target_text(self.family, &name, rev, info);
                self.set_target(text)
            }
            "limit" => self.limit(e),
            "log" => self.nflog(e),
            _ => Err(Stop::Foreign),
        }
    }

    fn load(&mut self, dreg: u32, load: Load) {
        self.regs.insert(dreg, Reg { load, mask: None });
    }

    fn reg(&self, r: u32) -> Result<Reg, Stop> {
        self.regs.get(&r).cloned().ok_or(Stop::Foreign)
    }

    fn set_target(&mut self, t: String) -> Step {
        if self.target.is_some() {
            return Err(Stop::Foreign);
        }
        self.target = Some(t);
        Ok(())
    }

    fn cmp(&mut self, r: &Reg, op: u32, v: &[u8]) -> Step {
        match r.load {
            Load::Meta(key) => self.meta_cmp(key, r, op, v),
            Load::Payload {
                base: NFT_PAYLOAD_NETWORK_HEADER,
                off,
                len,
            } => self.network(off, len, r, op, v),
            Load::Payload {
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                off,
                ..
            } => self.transport(off, r, op, v),
            _ => Err(Stop::Foreign),
        }
    }

    /// Equal or not; any other operator has no iptables option here.
    fn inverted(op: u32) -> Result<bool, Stop> {
        match op {
            NFT_CMP_EQ => Ok(false),
            NFT_CMP_NEQ => Ok(true),
            _ => Err(Stop::Foreign),
        }
    }

    fn meta_cmp(&mut self, key: u32, r: &Reg, op: u32, v: &[u8]) -> Step {
        let inv = Self::inverted(op)?;
        match key {
            NFT_META_L4PROTO if r.mask.is_none() => {
                self.head.proto = u16::from(*v.first().ok_or(Stop::Foreign)?);
                self.head.inv |= if inv { INV_PROTO } else { 0 };
            }
            NFT_META_IIFNAME | NFT_META_OIFNAME if r.mask.is_none() => {
                if v.len() > 16 {
                    return Err(Stop::Foreign);
                }
                // nf_tables cannot say "no interface": iptables-nft writes `! -i +` as equal
                // to this impossible name, and reads it back so.
                let (v, inv) = if !inv && super::string(v) == "INVAL/D" {
                    (&b"+\0"[..], true)
                } else {
                    (v, inv)
                };
                let (name, mask, flag) = if key == NFT_META_IIFNAME {
                    (
                        &mut self.head.iniface,
                        &mut self.head.iniface_mask,
                        INV_VIA_IN,
                    )
                } else {
                    (
                        &mut self.head.outiface,
                        &mut self.head.outiface_mask,
                        INV_VIA_OUT,
                    )
                };
                match v.iter().position(|&c| c == 0) {
                    // The whole name: compared with its NUL.
                    Some(n) => {
                        name[..n].copy_from_slice(&v[..n]);
                        mask[..=n].fill(0xff);
                    }
                    // A prefix (`cali+`): the kernel's legacy form, a mask over `cali`.
                    None if v.len() < 16 => {
                        name[..v.len()].copy_from_slice(v);
                        name[v.len()] = b'+';
                        mask[..v.len()].fill(0xff);
                    }
                    None => return Err(Stop::Foreign),
                }
                self.head.inv |= if inv { flag } else { 0 };
            }
            NFT_META_MARK => {
                let mark = ne_u32(v).ok_or(Stop::Foreign)?;
                let mask = match &r.mask {
                    Some(m) => ne_u32(m).ok_or(Stop::Foreign)?,
                    None => u32::MAX,
                };
                // `xt_mark_mtinfo1` { u32 mark, mask; u8 invert }.
                let mut b = Vec::with_capacity(12);
                b.extend(mark.to_ne_bytes());
                b.extend(mask.to_ne_bytes());
                b.extend([u8::from(inv), 0, 0, 0]);
                self.text_match("mark", 1, &b);
            }
            NFT_META_PKTTYPE if r.mask.is_none() => {
                // `xt_pkttype_info` { int pkttype, invert }.
                let ty = i32::from(*v.first().ok_or(Stop::Foreign)?);
                let mut b = ty.to_ne_bytes().to_vec();
                b.extend(i32::from(inv).to_ne_bytes());
                self.text_match("pkttype", 0, &b);
            }
            _ => return Err(Stop::Foreign),
        }
        Ok(())
    }

    /// A match xtlock words from native expressions (mark, pkttype, icmp, limit): none names a
    /// set.
    fn text_match(&mut self, name: &str, rev: u8, data: &[u8]) {
        let text = match_text(self.family, name, rev, data, &mut |_| None);
        self.parts.push(Part::Text(text));
    }

    /// A network header field: the rule's head.
    fn network(&mut self, off: u32, len: u32, r: &Reg, op: u32, v: &[u8]) -> Step {
        let inv = Self::inverted(op)?;
        let (v4, flag) = match (self.family, off) {
            (Family::Ipv4, 12) => (true, INV_SRCIP),
            (Family::Ipv4, 16) => (true, INV_DSTIP),
            (Family::Ipv6, 8) => (false, INV_SRCIP),
            (Family::Ipv6, 24) => (false, INV_DSTIP),
            // `ip protocol`, `ip6 nexthdr`: `-p`.
            (Family::Ipv4, 9) | (Family::Ipv6, 6) if r.mask.is_none() => {
                self.head.proto = u16::from(*v.first().ok_or(Stop::Foreign)?);
                self.head.inv |= if inv { INV_PROTO } else { 0 };
                return Ok(());
            }
            // `-f`: the fragment offset (`& 0x1fff`) is not 0; `! -f`: it is.
            (Family::Ipv4, 6)
                if len == 2 && r.mask.as_deref() == Some(&[0x1f, 0xff]) && v == [0, 0] =>
            {
                self.head.frag = true;
                self.head.inv |= if inv { 0 } else { INV_FRAG };
                return Ok(());
            }
            _ => return Err(Stop::Foreign),
        };
        let size = if v4 { 4 } else { 16 };
        if v.len() > size || len as usize > size {
            return Err(Stop::Foreign);
        }
        let mut addr = [0u8; 16];
        addr[..v.len()].copy_from_slice(v);
        // A shorter load is a prefix; a mask, any mask.
        let mut mask = [0u8; 16];
        match &r.mask {
            Some(m) if m.len() <= size => mask[..m.len()].copy_from_slice(m),
            Some(_) => return Err(Stop::Foreign),
            None => mask[..len as usize].fill(0xff),
        }
        if flag == INV_SRCIP {
            (self.head.src, self.head.smsk) = (addr, mask);
        } else {
            (self.head.dst, self.head.dmsk) = (addr, mask);
        }
        self.head.inv |= if inv { flag } else { 0 };
        Ok(())
    }

    /// The rule's `tcp` or `udp` match, made at its first port or flags load.
    fn ports(&mut self) -> Result<&mut Ports, Stop> {
        let tcp = match self.head.proto {
            6 => true,
            17 => false,
            _ => return Err(Stop::Foreign),
        };
        if self.compat_ports {
            return Err(Stop::Foreign);
        }
        let at = match self
            .parts
            .iter()
            .position(|p| matches!(p, Part::Ports { .. }))
        {
            Some(i) => i,
            None => {
                self.parts.push(Part::Ports {
                    tcp,
                    ports: Ports::new(),
                });
                self.parts.len() - 1
            }
        };
        match &mut self.parts[at] {
            Part::Ports { ports, .. } => Ok(ports),
            Part::Text(_) => Err(Stop::Foreign),
        }
    }

    /// A transport header field, for the protocol of the rule's `-p`.
    fn transport(&mut self, off: u32, r: &Reg, op: u32, v: &[u8]) -> Step {
        if matches!(
            (self.family, self.head.proto),
            (Family::Ipv4, 1) | (Family::Ipv6, 58)
        ) {
            return self.icmp(off, op, v);
        }
        // One port: `port_match_single_to_range`, an operator each bound.
        let one = |range: &mut [u16; 2], inv: &mut u8, flag: u8, port: u16| -> Step {
            match op {
                NFT_CMP_NEQ => {
                    *inv |= flag;
                    *range = [port, port];
                }
                NFT_CMP_EQ => *range = [port, port],
                NFT_CMP_LT => range[1] = port.saturating_sub(1).max(1),
                NFT_CMP_LTE => range[1] = port,
                NFT_CMP_GT => range[0] = port.saturating_add(1),
                NFT_CMP_GTE => range[0] = port,
                _ => return Err(Stop::Foreign),
            }
            Ok(())
        };
        match (off, v.len()) {
            (0, 2) | (0, 4) | (2, 2) if r.mask.is_none() => {
                let p = self.ports()?;
                let first = be_u16(v).ok_or(Stop::Foreign)?;
                if off == 2 {
                    one(&mut p.dpts, &mut p.inv, PORT_INV_DST, first)?;
                } else {
                    one(&mut p.spts, &mut p.inv, PORT_INV_SRC, first)?;
                    if let Some(d) = v.get(2..).and_then(be_u16) {
                        one(&mut p.dpts, &mut p.inv, PORT_INV_DST, d)?;
                    }
                }
            }
            (13, 1) if self.head.proto == 6 => {
                let inv = Self::inverted(op)?;
                let mask = r.mask.as_ref().map_or(Some(0xff), |m| m.first().copied());
                let p = self.ports()?;
                p.flg_mask = mask.ok_or(Stop::Foreign)?;
                p.flg_cmp = v[0];
                p.inv |= if inv { TCP_INV_FLAGS } else { 0 };
            }
            _ => return Err(Stop::Foreign),
        }
        Ok(())
    }

    /// An ICMP type and code match (`nft_parse_icmp`): `ipt_icmp` / `ip6t_icmp` { u8 type,
    /// code[2], invflags }.
    fn icmp(&mut self, off: u32, op: u32, v: &[u8]) -> Step {
        if op != NFT_CMP_EQ {
            return Err(Stop::Foreign);
        }
        let (ty, code) = match (off, v) {
            (0, [t]) => (*t, [0, u8::MAX]),
            (0, [t, c]) => (*t, [*c, *c]),
            (1, [c]) if self.family == Family::Ipv4 => (u8::MAX, [*c, *c]),
            _ => return Err(Stop::Foreign),
        };
        let name = match self.family {
            Family::Ipv4 => "icmp",
            Family::Ipv6 => "icmp6",
        };
        self.text_match(name, 0, &[ty, code[0], code[1], 0]);
        Ok(())
    }

    /// A port range (`--dport 8000:8100`).
    fn range(&mut self, r: &Reg, op: u32, from: &[u8], to: &[u8]) -> Step {
        let Load::Payload {
            base: NFT_PAYLOAD_TRANSPORT_HEADER,
            off,
            ..
        } = r.load
        else {
            return Err(Stop::Foreign);
        };
        let inv = match op {
            NFT_RANGE_EQ => false,
            NFT_RANGE_NEQ => true,
            _ => return Err(Stop::Foreign),
        };
        let (from, to) = match (from.len(), to.len()) {
            (2, 2) => (be_u16(from), be_u16(to)),
            _ => return Err(Stop::Foreign),
        };
        let span = [from.ok_or(Stop::Foreign)?, to.ok_or(Stop::Foreign)?];
        if r.mask.is_some() {
            return Err(Stop::Foreign);
        }
        let p = self.ports()?;
        let (range, flag) = match off {
            0 => (&mut p.spts, PORT_INV_SRC),
            2 => (&mut p.dpts, PORT_INV_DST),
            _ => return Err(Stop::Foreign),
        };
        *range = span;
        p.inv |= if inv { flag } else { 0 };
        Ok(())
    }

    fn immediate(&mut self, e: &Expr) -> Step {
        let d = e
            .get(NFTA_IMMEDIATE_DATA)
            .ok_or(NftError::Attr { what: "immediate" })?;
        for at in super::attrs(d, "immediate data") {
            let (k, v) = at?;
            match k {
                NFTA_DATA_VALUE => {
                    let dreg = e.u32(NFTA_IMMEDIATE_DREG, "immediate")?;
                    self.load(dreg, Load::Imm(v.to_vec()));
                }
                NFTA_DATA_VERDICT => {
                    let t = match verdict(v)? {
                        (Some(NF_ACCEPT), _) => "-j ACCEPT".to_string(),
                        (Some(NF_DROP), _) => "-j DROP".to_string(),
                        (Some(NFT_RETURN), _) => "-j RETURN".to_string(),
                        (Some(NFT_JUMP), Some(c)) => format!("-j {c}"),
                        (Some(NFT_GOTO), Some(c)) => format!("-g {c}"),
                        _ => return Err(Stop::Foreign),
                    };
                    self.set_target(t)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// `meta mark set`: `-j MARK --set-xmark` (`xt_mark_tginfo2` { u32 mark, mask });
    /// `meta nftrace set 1`: `-j TRACE`.
    fn meta_set(&mut self, key: u32, sreg: u32) -> Step {
        let r = self.reg(sreg)?;
        let Load::Imm(v) = &r.load else {
            return Err(Stop::Foreign);
        };
        if key == NFT_META_NFTRACE && r.mask.is_none() && v.iter().any(|&b| b != 0) {
            let text = target_text(self.family, "TRACE", 0, &[]);
            return self.set_target(text);
        }
        if key != NFT_META_MARK {
            return Err(Stop::Foreign);
        }
        let mark = ne_u32(v).ok_or(Stop::Foreign)?;
        let mask = match &r.mask {
            Some(m) => ne_u32(m).ok_or(Stop::Foreign)?,
            None => u32::MAX,
        };
        let mut b = mark.to_ne_bytes().to_vec();
        b.extend(mask.to_ne_bytes());
        let text = target_text(self.family, "MARK", 2, &b);
        self.set_target(text)
    }

    /// A packet rate limit: `-m limit` (`xt_rateinfo` { u32 avg, burst }, the average in
    /// 1/10000 s between packets). A byte rate or an inverted one has no `-m limit`.
    fn limit(&mut self, e: &Expr) -> Step {
        if e.u32(NFTA_LIMIT_TYPE, "limit")? != NFT_LIMIT_PKTS
            || e.u32(NFTA_LIMIT_FLAGS, "limit")? != 0
        {
            return Err(Stop::Foreign);
        }
        let rate = e.get(NFTA_LIMIT_RATE).and_then(be_u64).filter(|&r| r > 0);
        let unit = e.get(NFTA_LIMIT_UNIT).and_then(be_u64);
        let (Some(rate), Some(unit)) = (rate, unit) else {
            return Err(Stop::Foreign);
        };
        let avg =
            u32::try_from(LIMIT_SCALE.saturating_mul(unit) / rate).map_err(|_| Stop::Foreign)?;
        let mut b = avg.to_ne_bytes().to_vec();
        b.extend(e.u32(NFTA_LIMIT_BURST, "limit")?.to_ne_bytes());
        self.text_match("limit", 0, &b);
        Ok(())
    }

    /// A `log` to a netlink group: `-j NFLOG` (`nft_parse_log`, into an `xt_nflog_info`
    /// with room for the prefix). A log to the kernel's log has no iptables-nft reading.
    fn nflog(&mut self, e: &Expr) -> Step {
        let Some(group) = e.get(NFTA_LOG_GROUP).and_then(be_u16) else {
            return Err(Stop::Foreign);
        };
        let threshold = e.get(NFTA_LOG_QTHRESHOLD).and_then(be_u16).unwrap_or(0);
        let (len, flags) = match e.get(NFTA_LOG_SNAPLEN) {
            Some(v) => (super::be32(v, "log")?, 1u16),
            None => (0, 0),
        };
        let prefix = e
            .get(NFTA_LOG_PREFIX)
            .map(super::string)
            .unwrap_or_default();
        let mut b = len.to_ne_bytes().to_vec();
        for n in [group, threshold, flags, 0] {
            b.extend(n.to_ne_bytes());
        }
        b.extend(prefix.as_bytes());
        b.resize(b.len().max(12 + 64), 0);
        b.push(0);
        let text = target_text(self.family, "NFLOG", 0, &b);
        self.set_target(text)
    }

    /// The save's order: the head, the matches, the userdata's comment, the target.
    fn finish(mut self, comment: Option<&str>) -> Vec<String> {
        let mut out = self.head.parts(self.family);
        for p in std::mem::take(&mut self.parts) {
            out.push(match p {
                Part::Text(t) => t,
                Part::Ports { tcp, ports } => {
                    let name = if tcp { "tcp" } else { "udp" };
                    match_text(self.family, name, 0, &ports.bytes(tcp), &mut |_| None)
                }
            });
        }
        if let Some(c) = comment {
            // A comment match's buffer: 256 bytes, NUL-terminated.
            let mut b = [0u8; 256];
            let n = c.len().min(255);
            b[..n].copy_from_slice(&c.as_bytes()[..n]);
            out.push(match_text(self.family, "comment", 0, &b, &mut |_| None));
        }
        out.extend(self.target);
        out
    }
}
