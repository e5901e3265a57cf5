//! An nf_tables rule in nft's words, as parts the diff compares, the verdict last: `meta
//! l4proto tcp`, `ip daddr 10.96.0.10`, `tcp dport 53`, `meta mark & 0x8000 == 0x8000`, `ct
//! state invalid`; the xt extensions iptables-nft keeps as they are (`match`, `target`) as
//! iptables-save writes them (`-m mark --mark 0x8000/0x8000`, `-j REJECT --reject-with
//! ...`), or by name and a digest of their bytes; the comment (an xt `comment` match, or
//! the rule's userdata) as `-m comment --comment "..."`; the verdict as `-j DROP`, `-j
//! KUBE-SERVICES` (jump), `-g X` (goto). The rules of native tables (kube-proxy's `ip
//! kube-proxy`, firewalld's `inet firewalld`) are worded so, and those of iptables-nft's
//! tables that iptables-nft cannot express.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use super::nfta::*;
use super::{attrs, be32, string, verdict, verdict_name, Expr, NftError};
use crate::decode::xt_ext::{self, match_text, target_text, SetNames};
use crate::decode::xt_table::{digest, Family};

/// The parts of a rule of a table of `family`: its expressions, the userdata `comment`
/// first, the verdict last (`-j CONTINUE` when none).
pub(super) fn rule(
    family: u8,
    exprs: &[Expr],
    comment: Option<&str>,
    sets: &mut SetNames<'_>,
) -> Result<Vec<String>, NftError> {
    let mut r = Render::new(family);
    for e in exprs {
        r.expr(e, sets)?;
    }
    let mut parts = Vec::new();
    if let Some(c) = comment {
        parts.push(format!("-m comment --comment \"{c}\""));
    }
    parts.extend(r.parts);
    parts.push(r.target.unwrap_or_else(|| "-j CONTINUE".into()));
    Ok(parts)
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

impl Render {
    fn new(family: u8) -> Self {
        Self {
            regs: Default::default(),
            l4: None,
            l3: match family {
                NFPROTO_IPV4 | NFPROTO_IPV6 => Some(family),
                _ => None,
            },
            parts: Vec::new(),
            target: None,
        }
    }

    /// The layout an xt match or target of this table has (`ip6` tables hold IPv6's).
    fn xt_family(&self) -> Family {
        if self.l3 == Some(NFPROTO_IPV6) {
            Family::Ipv6
        } else {
            Family::Ipv4
        }
    }

    /// One `NFTA_LIST_ELEM` of the rule's expressions.
    /// One expression of the rule, in order.
    fn expr(&mut self, e: &Expr, sets: &mut SetNames<'_>) -> Result<(), NftError> {
        match e.name.as_str() {
            // Counts change with every packet: not part of what a rule is.
            "counter" | "last" => {}
            "payload" => self.payload_expr(e)?,
            "meta" => self.meta_expr(e)?,
            "ct" => self.ct_expr(e)?,
            "bitwise" => self.bitwise_expr(e)?,
            "cmp" => self.cmp_expr(e)?,
            "range" => self.range_expr(e)?,
            "lookup" => self.lookup_expr(e)?,
            "immediate" => self.immediate_expr(e)?,
            "match" => self.match_expr(e, sets)?,
            "target" => self.target_expr(e)?,
            "reject" => self.reject_expr(e)?,
            "masq" => self.target = Some("-j MASQUERADE".into()),
            "nat" => self.nat_expr(e)?,
            "redir" => self.target = Some("-j REDIRECT".into()),
            "queue" => self.target = Some("-j QUEUE".into()),
            "log" => {
                let prefix = e.get(NFTA_LOG_PREFIX).map(string);
                self.parts.push(match prefix {
                    Some(p) => format!("log prefix \"{p}\""),
                    None => "log".into(),
                });
            }
            // Its consumption changes with traffic; the quota itself does not.
            "quota" => self.parts.push(format!(
                "quota {}",
                e.get(NFTA_QUOTA_BYTES).map(hex).unwrap_or_default()
            )),
            other => self.parts.push(format!("{other} [{}]", digest(e.data))),
        }
        Ok(())
    }

    /// Loads a packet field into a register, or writes a register into the packet.
    fn payload_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let (base, off, len) = (
            e.u32(NFTA_PAYLOAD_BASE, "payload")?,
            e.u32(NFTA_PAYLOAD_OFFSET, "payload")?,
            e.u32(NFTA_PAYLOAD_LEN, "payload")? as usize,
        );
        let field = self.payload_field(base, off, len);
        match e.get(NFTA_PAYLOAD_DREG) {
            Some(d) => {
                self.regs.insert(be32(d, "payload")?, field);
            }
            // A payload write.
            None => {
                let src = self.reg_name(e.u32(NFTA_PAYLOAD_SREG, "payload")?);
                self.parts.push(format!("{} set {src}", field.name));
            }
        }
        Ok(())
    }

    /// Loads packet metadata into a register, or sets it from one.
    fn meta_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let key = e.u32(NFTA_META_KEY, "meta")?;
        let (kname, fmt) = meta_key(key);
        let field = Reg {
            name: format!("meta {kname}"),
            fmt,
            len: 4,
            mask: None,
        };
        match e.get(NFTA_META_DREG) {
            Some(d) => {
                self.regs.insert(be32(d, "meta")?, field);
            }
            None => {
                let src = self.reg_name(e.u32(NFTA_META_SREG, "meta")?);
                self.parts.push(format!("meta {kname} set {src}"));
            }
        }
        Ok(())
    }

    /// Loads conntrack state into a register, or sets it from one.
    fn ct_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let key = e.u32(NFTA_CT_KEY, "ct")?;
        let kname = ct_key(key);
        let dir = match e.get(NFTA_CT_DIRECTION).and_then(|v| v.first()) {
            Some(&IP_CT_DIR_ORIGINAL) => " original",
            Some(&IP_CT_DIR_REPLY) => " reply",
            _ => "",
        };
        let fmt = match key {
            NFT_CT_STATE => Fmt::CtState,
            NFT_CT_MARK => Fmt::Ne,
            _ => Fmt::Hex,
        };
        match e.get(NFTA_CT_DREG) {
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
                let src = self.reg_name(e.u32(NFTA_CT_SREG, "ct")?);
                self.parts.push(format!("ct {kname} set {src}"));
            }
        }
        Ok(())
    }

    /// Masks or shifts a register: the result names the field it came from.
    fn bitwise_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let (sreg, dreg) = (
            e.u32(NFTA_BITWISE_SREG, "bitwise")?,
            e.u32(NFTA_BITWISE_DREG, "bitwise")?,
        );
        let op = e.u32(NFTA_BITWISE_OP, "bitwise")?;
        let mut r = self
            .regs
            .get(&sreg)
            .cloned()
            .unwrap_or_else(|| unknown_reg(sreg));
        if op == NFT_BITWISE_MASK_XOR {
            let mask = e.value(NFTA_BITWISE_MASK)?;
            let xor = e.value(NFTA_BITWISE_XOR)?;
            r.mask = Some((mask, xor));
        } else {
            let n = e.value(NFTA_BITWISE_DATA)?;
            let n = n.first().copied().unwrap_or(0);
            let sym = if op == NFT_BITWISE_LSHIFT { "<<" } else { ">>" };
            r.name = format!("{} {sym} {n}", r.name);
            r.fmt = Fmt::Hex;
        }
        self.regs.insert(dreg, r);
        Ok(())
    }

    /// Compares a register with a constant: one match of the rule.
    fn cmp_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let sreg = e.u32(NFTA_CMP_SREG, "cmp")?;
        let op = e.u32(NFTA_CMP_OP, "cmp")?;
        let value = e.value(NFTA_CMP_DATA)?;
        let r = self
            .regs
            .get(&sreg)
            .cloned()
            .unwrap_or_else(|| unknown_reg(sreg));
        self.note_protocol(&r, op, &value);
        self.parts.push(cmp_text(&r, op, &value));
        Ok(())
    }

    /// Matches a register within (or outside) a range.
    fn range_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let sreg = e.u32(NFTA_RANGE_SREG, "range")?;
        let op = e.u32(NFTA_RANGE_OP, "range")?;
        let r = self
            .regs
            .get(&sreg)
            .cloned()
            .unwrap_or_else(|| unknown_reg(sreg));
        let (lo, hi) = (e.value(NFTA_RANGE_FROM_DATA)?, e.value(NFTA_RANGE_TO_DATA)?);
        let not = if op == NFT_RANGE_NEQ { "!= " } else { "" };
        self.parts.push(format!(
            "{} {not}{}-{}",
            r.name,
            value_text(r.fmt, &lo),
            value_text(r.fmt, &hi)
        ));
        Ok(())
    }

    /// Looks a register up in a set or map (a verdict map gives the rule its verdict).
    fn lookup_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let set = e.get(NFTA_LOOKUP_SET).map(string).unwrap_or_default();
        let r = self.reg_name(e.u32(NFTA_LOOKUP_SREG, "lookup")?);
        let inv = e.u32(NFTA_LOOKUP_FLAGS, "lookup")? & NFT_LOOKUP_F_INV != 0;
        match e.get(NFTA_LOOKUP_DREG) {
            // A verdict map: the rule's verdict comes from it.
            Some(d) if be32(d, "lookup")? == NFT_REG_VERDICT => {
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
        Ok(())
    }

    /// Loads a constant or a verdict.
    fn immediate_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let dreg = e.u32(NFTA_IMMEDIATE_DREG, "immediate")?;
        let d = e
            .get(NFTA_IMMEDIATE_DATA)
            .ok_or(NftError::Attr { what: "immediate" })?;
        for at in attrs(d, "immediate data") {
            let (k, v) = at?;
            match k {
                NFTA_DATA_VERDICT => self.target = Some(verdict_text(v)?),
                NFTA_DATA_VALUE => {
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
        Ok(())
    }

    /// An xtables match (iptables-nft's compat expression), in iptables' words.
    fn match_expr(&mut self, e: &Expr, sets: &mut SetNames<'_>) -> Result<(), NftError> {
        let n = e.get(NFTA_MATCH_NAME).map(string).unwrap_or_default();
        let rev = e.get(NFTA_MATCH_REV).map_or(Ok(0), |v| be32(v, "match"))? as u8;
        self.parts.push(match_text(
            self.xt_family(),
            &n,
            rev,
            e.get(NFTA_MATCH_INFO).unwrap_or_default(),
            sets,
        ));
        Ok(())
    }

    /// An xtables target (iptables-nft's compat expression), in iptables' words.
    fn target_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let n = e.get(NFTA_TARGET_NAME).map(string).unwrap_or_default();
        let rev = e
            .get(NFTA_TARGET_REV)
            .map_or(Ok(0), |v| be32(v, "target"))? as u8;
        self.target = Some(target_text(
            self.xt_family(),
            &n,
            rev,
            e.get(NFTA_TARGET_INFO).unwrap_or_default(),
        ));
        Ok(())
    }

    /// A REJECT verdict, with what it answers.
    fn reject_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let ty = e.u32(NFTA_REJECT_TYPE, "reject")?;
        let code = e
            .get(NFTA_REJECT_ICMP_CODE)
            .and_then(|v| v.first())
            .copied()
            .unwrap_or(0);
        self.target = Some(match ty {
            NFT_REJECT_TCP_RST => "-j REJECT --reject-with tcp-reset".into(),
            // `enum nft_reject_types` by number.
            _ => format!(
                "-j REJECT --reject-with {} {code}",
                ["icmp", "tcp", "icmpx"].get(ty as usize).unwrap_or(&"?")
            ),
        });
        Ok(())
    }

    /// An SNAT or DNAT verdict, with its address and port as iptables-nft-save writes them.
    fn nat_expr(&mut self, e: &Expr) -> Result<(), NftError> {
        let ty = if e.u32(NFTA_NAT_TYPE, "nat")? == NFT_NAT_SNAT {
            "SNAT"
        } else {
            "DNAT"
        };
        // As iptables-nft-save writes it (`--to-destination 10.244.1.5:8080`) when
        // the address and port are constants, as kube-proxy's and iptables-nft's are.
        let imm = |k: u16| -> Option<Vec<u8>> {
            let r = be32(e.get(k)?, "nat").ok()?;
            let name = &self.regs.get(&r)?.name;
            unhex(name.strip_prefix("0x")?)
        };
        let ip = imm(NFTA_NAT_REG_ADDR_MIN).and_then(|b| match b.len() {
            4 => <[u8; 4]>::try_from(b.as_slice())
                .ok()
                .map(|a| Ipv4Addr::from(a).to_string()),
            16 => <[u8; 16]>::try_from(b.as_slice())
                .ok()
                .map(|a| format!("[{}]", Ipv6Addr::from(a))),
            _ => None,
        });
        let port = imm(NFTA_NAT_REG_PROTO_MIN).and_then(|b| <[u8; 2]>::try_from(b.as_slice()).ok());
        let mut t = format!("-j {ty}");
        // A range only when its maximum differs from its minimum (`nft` loads both
        // registers, with the same value, for a single address and port).
        let complex = [
            (NFTA_NAT_REG_ADDR_MAX, NFTA_NAT_REG_ADDR_MIN),
            (NFTA_NAT_REG_PROTO_MAX, NFTA_NAT_REG_PROTO_MIN),
        ]
        .iter()
        .any(|&(max, min)| e.get(max).is_some() && (imm(max).is_none() || imm(max) != imm(min)));
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
                for (k, what) in [
                    (NFTA_NAT_REG_ADDR_MIN, "addr"),
                    (NFTA_NAT_REG_ADDR_MAX, "addr max"),
                    (NFTA_NAT_REG_PROTO_MIN, "port"),
                    (NFTA_NAT_REG_PROTO_MAX, "port max"),
                ] {
                    if let Some(v) = e.get(k) {
                        let _ = write!(t, " {what} {}", self.reg_name(be32(v, "nat")?));
                    }
                }
            }
        }
        self.target = Some(t);
        Ok(())
    }

    fn reg_name(&self, r: u32) -> String {
        self.regs
            .get(&r)
            .map_or_else(|| format!("reg {r}"), |r| r.name.clone())
    }

    /// A `meta l4proto` / `ip protocol` / `meta nfproto` match names what follows.
    fn note_protocol(&mut self, r: &Reg, op: u32, value: &[u8]) {
        if op != NFT_CMP_EQ || r.mask.is_some() {
            return;
        }
        match r.fmt {
            Fmt::Proto => self.l4 = value.first().copied(),
            Fmt::Nfproto => self.l3 = value.first().copied(),
            _ if r.name == "meta protocol" && value.len() >= 2 => {
                // Ethertypes: `ETH_P_IP`, `ETH_P_IPV6`.
                self.l3 = match u16::from_be_bytes([value[0], value[1]]) {
                    0x0800 => Some(NFPROTO_IPV4),
                    0x86dd => Some(NFPROTO_IPV6),
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
            (NFT_PAYLOAD_NETWORK_HEADER, Some(NFPROTO_IPV4)) => ip4(off, len),
            (NFT_PAYLOAD_NETWORK_HEADER, Some(NFPROTO_IPV6)) => ip6(off, len),
            (NFT_PAYLOAD_TRANSPORT_HEADER, _) => match (off, len) {
                (0, 2) => Some(("sport", Fmt::Be)),
                (2, 2) => Some(("dport", Fmt::Be)),
                _ => None,
            },
            _ => None,
        };
        match (base, known) {
            (NFT_PAYLOAD_TRANSPORT_HEADER, Some((f, fmt))) => {
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
                // `enum nft_payload_bases` by number.
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

/// An `NFTA_DATA_VERDICT`: `-j DROP`, `-j CHAIN`, `-g CHAIN`.
fn verdict_text(v: &[u8]) -> Result<String, NftError> {
    Ok(match verdict(v)? {
        (Some(NFT_JUMP), Some(c)) => format!("-j {c}"),
        (Some(NFT_GOTO), Some(c)) => format!("-g {c}"),
        (Some(c), _) => format!("-j {}", verdict_name(c)),
        (None, _) => "-j verdict ?".into(),
    })
}

fn meta_key(k: u32) -> (&'static str, Fmt) {
    match k {
        NFT_META_LEN => ("length", Fmt::Ne),
        NFT_META_PROTOCOL => ("protocol", Fmt::Hex),
        NFT_META_PRIORITY => ("priority", Fmt::Ne),
        NFT_META_MARK => ("mark", Fmt::Ne),
        NFT_META_IIF => ("iif", Fmt::Ne),
        NFT_META_OIF => ("oif", Fmt::Ne),
        NFT_META_IIFNAME => ("iifname", Fmt::Ifname),
        NFT_META_OIFNAME => ("oifname", Fmt::Ifname),
        NFT_META_IIFTYPE => ("iiftype", Fmt::Ne),
        NFT_META_OIFTYPE => ("oiftype", Fmt::Ne),
        NFT_META_SKUID => ("skuid", Fmt::Ne),
        NFT_META_SKGID => ("skgid", Fmt::Ne),
        NFT_META_NFTRACE => ("nftrace", Fmt::Ne),
        NFT_META_NFPROTO => ("nfproto", Fmt::Nfproto),
        NFT_META_L4PROTO => ("l4proto", Fmt::Proto),
        NFT_META_PKTTYPE => ("pkttype", Fmt::Ne),
        NFT_META_CPU => ("cpu", Fmt::Ne),
        NFT_META_CGROUP => ("cgroup", Fmt::Ne),
        NFT_META_PRANDOM => ("random", Fmt::Ne),
        _ => ("?", Fmt::Hex),
    }
}

fn ct_key(k: u32) -> String {
    // `enum nft_ct_keys` by number.
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
    // `enum nft_cmp_ops` by number.
    let sym = ["==", "!=", "<", "<=", ">", ">="]
        .get(op as usize)
        .unwrap_or(&"?");
    // Equality is implicit, as in nft's listing; other operators are written.
    let op_text = |v: String| {
        if op == NFT_CMP_EQ {
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
    if full > 0 && matches!(op, NFT_CMP_EQ | NFT_CMP_NEQ) {
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
        Some((m, _))
            if r.fmt == Fmt::CtState && op == NFT_CMP_NEQ && value.iter().all(|&b| b == 0) =>
        {
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

/// The prefix length of a contiguous network mask (at most 16 bytes).
fn prefix_len(m: &[u8]) -> Option<usize> {
    let mut top = [0u8; 16];
    top.get_mut(..m.len())?.copy_from_slice(m);
    xt_ext::prefix_len(u128::from_be_bytes(top)).map(|n| n as usize)
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
            NFPROTO_IPV4 => "ipv4".into(),
            NFPROTO_IPV6 => "ipv6".into(),
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
