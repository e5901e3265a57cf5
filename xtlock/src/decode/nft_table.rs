//! nf_tables tables as the kernel dumps them over netlink (`NFT_MSG_GETTABLE`, `GETCHAIN`,
//! `GETRULE` with `NLM_F_DUMP`, as `nft list ruleset` and `iptables-nft-save` ask): the
//! requests, the messages and their attributes, parsed into tables, chains and rules the
//! diff compares. The attribute numbers are the kernel's userspace ABI
//! (`linux/netfilter/nf_tables.h`), the same on every kernel.
//!
//! The netlink and attribute headers are read with `netlink-packet-core`. The nf_tables
//! attributes are parsed here: `netlink-packet-netfilter` types only six expression kinds
//! (not `match`, `target`, `ct`, `counter`, `reject`, `nat`, which iptables-nft and
//! kube-proxy write) and fails a whole message on an attribute it reads strictly;
//! `rustables` is GPL-3.0; the `nftables` crate runs the `nft` binary.
//!
//! A rule's expressions are worded by one of two renderers, as parts (one per match or
//! statement, the verdict last) so the diff says which part a rule lost:
//! - `iptables.rs`: a rule of a table iptables-nft writes (`ip`/`ip6` `filter`, `nat`,
//!   `mangle`, `raw`, `security`) exactly as `iptables-nft-save` writes it (`-s 10.0.0.0/8
//!   -p tcp -m tcp --dport 80 -j DNAT --to-destination 10.244.1.5:8080`), when iptables-nft
//!   can express all of it;
//! - `render.rs`: any other rule in nft's words (`meta l4proto tcp`, `ip daddr 10.96.0.10`,
//!   `tcp dport 53`, `meta mark & 0x8000 == 0x8000`, `ct state invalid`), the xt extensions
//!   iptables-nft keeps as they are (`match`, `target`) as iptables-save writes them.
//!
//! Counters are left out by both: they change with every packet.

use super::netlink::{self, string, Message, NFNL_SUBSYS_NFTABLES};
use super::xt_table::{Chain, Counter, Rule};
#[cfg(test)]
use netlink::Control;
#[cfg(test)]
use netlink::{NFGENMSG, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDR};

mod iptables;
pub(crate) mod nfta;
mod render;
#[cfg(test)]
pub(crate) mod tests;

pub use iptables::{iptables_words, is_iptables_table, IPTABLES_TABLES};
use nfta::*;

pub const NFT_MSG_GETTABLE: u8 = 1;
pub const NFT_MSG_GETCHAIN: u8 = 4;
pub const NFT_MSG_GETRULE: u8 = 7;
pub const NFT_MSG_NEWTABLE: u8 = 0;
pub const NFT_MSG_NEWCHAIN: u8 = 3;
pub const NFT_MSG_NEWRULE: u8 = 6;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NftError {
    #[error(transparent)]
    Message(#[from] netlink::FrameError),
    #[error("a {what} attribute is malformed")]
    Attr { what: &'static str },
    #[error("a {0} message lacks its name")]
    Unnamed(&'static str),
    #[error("the kernel refused the dump: {0}")]
    Kernel(std::io::ErrorKind, i32),
}

fn nft_type(msg: u8) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | u16::from(msg)
}

/// The request for one dump of every family's objects of a kind (`NFT_MSG_GET*`).
pub fn dump_request(msg: u8, seq: u32) -> Vec<u8> {
    // nfgenmsg: NFPROTO_UNSPEC (every family), NFNETLINK_V0, res_id 0.
    netlink::dump(nft_type(msg), seq, &[0; netlink::NFGENMSG])
}

/// The request for one dump of the rules of one chain (`NFTA_RULE_TABLE`,
/// `NFTA_RULE_CHAIN`, in the chain's family): the kernel walks that chain alone, where a dump
/// of every rule walks again past all it sent for each answer (quadratic in the ruleset).
pub fn chain_rules_request(family: u8, table: &str, chain: &str, seq: u32) -> Vec<u8> {
    // nfgenmsg: the family, NFNETLINK_V0, res_id 0.
    let mut body = vec![family, 0, 0, 0];
    netlink::put_str(&mut body, NFTA_RULE_TABLE, table);
    netlink::put_str(&mut body, NFTA_RULE_CHAIN, chain);
    netlink::dump(nft_type(NFT_MSG_GETRULE), seq, &body)
}

/// One nf_tables object of a dump's answer: its message type (`NFT_MSG_NEW*`), family, the
/// ruleset generation it was dumped at (low 16 bits), whether the dump was interrupted by a
/// change, and its attributes.
#[derive(Debug, PartialEq, Eq)]
pub struct Object<'a> {
    pub msg: u8,
    pub family: u8,
    pub generation: u16,
    pub interrupted: bool,
    pub attrs: &'a [u8],
}

/// The object a message carries; `None` for another subsystem's message.
pub fn object<'a>(m: &Message<'a>) -> Result<Option<Object<'a>>, NftError> {
    if m.ty >> 8 != NFNL_SUBSYS_NFTABLES {
        return Ok(None);
    }
    let (Some(h), Some(attrs)) = (
        netlink::bytes::<{ netlink::NFGENMSG }>(m.payload),
        m.payload.get(netlink::NFGENMSG..),
    ) else {
        return Err(netlink::FrameError::Message("short nfgenmsg".into()).into());
    };
    Ok(Some(Object {
        msg: (m.ty & 0xff) as u8,
        family: h[0],
        generation: u16::from_be_bytes([h[2], h[3]]),
        interrupted: m.interrupted(),
        attrs,
    }))
}

/// One message of a dump's answer, for the tests: the end, an object, anything else.
#[cfg(test)]
#[derive(Debug, PartialEq, Eq)]
pub enum Msg<'a> {
    Done,
    Object(Object<'a>),
    Other,
}

/// The messages of one datagram, up to its end; a refusal is an [`NftError::Kernel`].
#[cfg(test)]
pub fn messages(datagram: &[u8]) -> Result<Vec<Msg<'_>>, NftError> {
    let mut out = Vec::new();
    for m in netlink::framed(datagram) {
        let m = m?;
        match m.control()? {
            Some(Control::Done) => {
                out.push(Msg::Done);
                return Ok(out);
            }
            Some(Control::Refused(errno)) => {
                let e = std::io::Error::from_raw_os_error(errno);
                return Err(NftError::Kernel(e.kind(), errno));
            }
            Some(Control::Ack) => out.push(Msg::Other),
            None => out.push(object(&m)?.map_or(Msg::Other, Msg::Object)),
        }
    }
    Ok(out)
}

/// `nft`'s name of a family: `ip`, `ip6`, `inet`, `arp`, `bridge`, `netdev`.
pub fn family_name(f: u8) -> String {
    match f {
        NFPROTO_INET => "inet".into(),
        NFPROTO_IPV4 => "ip".into(),
        NFPROTO_ARP => "arp".into(),
        NFPROTO_NETDEV => "netdev".into(),
        NFPROTO_BRIDGE => "bridge".into(),
        NFPROTO_IPV6 => "ip6".into(),
        n => format!("family{n}"),
    }
}

/// The attributes of `b`, by type (flags masked off); a malformed one is an error.
fn attrs<'a>(
    b: &'a [u8],
    what: &'static str,
) -> impl Iterator<Item = Result<(u16, &'a [u8]), NftError>> + 'a {
    netlink::attrs_checked(b).map(move |a| a.map_err(|_| NftError::Attr { what }))
}

fn be32(v: &[u8], what: &'static str) -> Result<u32, NftError> {
    netlink::be_u32(v).ok_or(NftError::Attr { what })
}

/// A table message's name.
pub fn parse_table(a: &[u8]) -> Result<String, NftError> {
    for at in attrs(a, "table") {
        let (k, v) = at?;
        if k == NFTA_TABLE_NAME {
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
    /// A base chain's counter (`NFTA_CHAIN_COUNTERS`: iptables-nft's built-in chains).
    pub counter: Option<Counter>,
}

pub fn parse_chain(a: &[u8]) -> Result<NftChain, NftError> {
    let (mut table, mut name, mut policy, mut base) = (None, None, None, false);
    let mut counter = None;
    for at in attrs(a, "chain") {
        let (k, v) = at?;
        match k {
            NFTA_CHAIN_TABLE => table = Some(string(v)),
            NFTA_CHAIN_NAME => name = Some(string(v)),
            NFTA_CHAIN_HOOK => base = true,
            NFTA_CHAIN_POLICY => policy = Some(verdict_name(be32(v, "chain policy")? as i32)),
            NFTA_CHAIN_COUNTERS => counter = Some(counter_of(v, "chain counters")?),
            _ => {}
        }
    }
    Ok(NftChain {
        table: table.ok_or(NftError::Unnamed("chain"))?,
        name: name.ok_or(NftError::Unnamed("chain"))?,
        // A base chain without a policy attribute (none such today) still is one.
        policy: base.then(|| policy.unwrap_or_else(|| "ACCEPT".into())),
        counter: counter.filter(|_| base),
    })
}

/// One rule as dumped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftRule {
    pub table: String,
    pub chain: String,
    pub rule: Rule,
    /// Its `counter` expression's count; `None` when it has none.
    pub counter: Option<Counter>,
}

/// A rule message, its expressions rendered for a table of `family`: in iptables-nft-save's
/// words when the table is one iptables-nft writes and iptables-nft can express the rule,
/// else in nft's.
///
/// `sets` names the sets of `-m set` matches by index (the source asks the kernel, decoding
/// does no I/O).
pub fn parse_rule(
    family: u8,
    a: &[u8],
    sets: &mut super::xt_ext::SetNames<'_>,
) -> Result<NftRule, NftError> {
    let (mut table, mut chain, mut comment) = (None, None, None);
    let mut exprs = Vec::new();
    for at in attrs(a, "rule") {
        let (k, v) = at?;
        match k {
            NFTA_RULE_TABLE => table = Some(string(v)),
            NFTA_RULE_CHAIN => chain = Some(string(v)),
            NFTA_RULE_EXPRESSIONS => {
                for e in attrs(v, "expression list") {
                    exprs.push(Expr::parse(e?.1)?);
                }
            }
            NFTA_RULE_USERDATA => comment = udata_comment(v),
            _ => {}
        }
    }
    let table = table.ok_or(NftError::Unnamed("rule"))?;
    let chain = chain.ok_or(NftError::Unnamed("rule"))?;
    let mut counter = None;
    for e in exprs.iter().filter(|e| e.name == "counter") {
        counter = Some(counter_of(e.data, "counter")?);
    }
    let iptables = if is_iptables_table(family, &table) {
        iptables::rule(family, &exprs, comment.as_deref(), sets)?
    } else {
        None
    };
    let parts = match iptables {
        Some(parts) => parts,
        None => render::rule(family, &exprs, comment.as_deref(), sets)?,
    };
    Ok(NftRule {
        table,
        chain,
        rule: Rule(parts),
        counter,
    })
}

/// libnftnl's type of a rule's comment in its userdata (`enum nftnl_udata_rule_types`): not
/// the kernel's, which keeps userdata as it is, but what `nft` and iptables-nft both write.
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;

/// The comment in a rule's userdata (libnftnl's TLVs: type, length, value).
fn udata_comment(mut u: &[u8]) -> Option<String> {
    while u.len() >= 2 {
        let (t, len) = (u[0], usize::from(u[1]));
        let v = u.get(2..2 + len)?;
        if t == NFTNL_UDATA_RULE_COMMENT {
            return Some(string(v));
        }
        u = &u[2 + len..];
    }
    None
}

fn verdict_name(v: i32) -> String {
    match v {
        NF_DROP => "DROP".into(),
        NF_ACCEPT => "ACCEPT".into(),
        NF_STOLEN => "STOLEN".into(),
        NF_QUEUE => "QUEUE".into(),
        NF_REPEAT => "REPEAT".into(),
        NFT_CONTINUE => "CONTINUE".into(),
        NFT_BREAK => "BREAK".into(),
        NFT_RETURN => "RETURN".into(),
        v => format!("verdict {v}"),
    }
}

/// A counter's attributes (`NFTA_COUNTER_BYTES`, `NFTA_COUNTER_PACKETS`, big-endian u64),
/// in a `counter` expression or a chain's `NFTA_CHAIN_COUNTERS`; an absent one counts 0.
fn counter_of(v: &[u8], what: &'static str) -> Result<Counter, NftError> {
    let mut c = Counter::default();
    for at in attrs(v, what) {
        let (k, d) = at?;
        let n = netlink::be_u64(d);
        match k {
            NFTA_COUNTER_BYTES => c.bytes = n.ok_or(NftError::Attr { what })?,
            NFTA_COUNTER_PACKETS => c.packets = n.ok_or(NftError::Attr { what })?,
            _ => {}
        }
    }
    Ok(c)
}

/// One expression of a rule as dumped (an `NFTA_LIST_ELEM`): its name and its attributes
/// (`NFTA_<NAME>_*`) by number, for the renderers.
struct Expr<'a> {
    pub name: String,
    /// `NFTA_EXPR_DATA` whole: what a digest of an expression not rendered is taken of.
    pub data: &'a [u8],
    attrs: Vec<(u16, &'a [u8])>,
}

impl<'a> Expr<'a> {
    fn parse(e: &'a [u8]) -> Result<Self, NftError> {
        let (mut name, mut data) = (None, &[][..]);
        for at in attrs(e, "expression") {
            let (k, v) = at?;
            match k {
                NFTA_EXPR_NAME => name = Some(string(v)),
                NFTA_EXPR_DATA => data = v,
                _ => {}
            }
        }
        let name = name.ok_or(NftError::Unnamed("expression"))?;
        let attrs = attrs(data, "expression data").collect::<Result<_, _>>()?;
        Ok(Expr { name, data, attrs })
    }

    /// An attribute's bytes.
    pub fn get(&self, k: u16) -> Option<&'a [u8]> {
        self.attrs.iter().find(|(t, _)| *t == k).map(|(_, v)| *v)
    }

    /// A big-endian `u32` attribute (registers, operators, keys); 0 when absent.
    pub fn u32(&self, k: u16, what: &'static str) -> Result<u32, NftError> {
        self.get(k).map_or(Ok(0), |v| be32(v, what))
    }

    /// The `NFTA_DATA_VALUE` nested in attribute `k` (empty when absent).
    pub fn value(&self, k: u16) -> Result<Vec<u8>, NftError> {
        data_value(self.get(k))
    }
}

/// An `NFTA_DATA_VERDICT`: its code (`NF_DROP` 0, `NF_ACCEPT` 1, `NFT_JUMP` -3, `NFT_GOTO`
/// -4, `NFT_RETURN` -5, ...) and the chain of a jump or goto.
fn verdict(v: &[u8]) -> Result<(Option<i32>, Option<String>), NftError> {
    let (mut code, mut chain) = (None, None);
    for at in attrs(v, "verdict") {
        let (k, d) = at?;
        match k {
            NFTA_VERDICT_CODE => code = Some(be32(d, "verdict")? as i32),
            NFTA_VERDICT_CHAIN => chain = Some(string(d)),
            _ => {}
        }
    }
    Ok((code, chain))
}

/// The value of an `NFTA_DATA_VALUE` nested in `v` (empty when absent).
fn data_value(v: Option<&[u8]>) -> Result<Vec<u8>, NftError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    for at in attrs(v, "data") {
        let (k, d) = at?;
        if k == NFTA_DATA_VALUE {
            return Ok(d.to_vec());
        }
    }
    Ok(Vec::new())
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
                counters: Vec::new(),
                policy_counter: c.counter,
            });
        }
    }
    for (f, r) in rules {
        if let Some(&(t, c)) = chain_at.get(&(f, r.table, r.chain)) {
            out[t].chains[c].rules.push(r.rule);
            out[t].chains[c].counters.push(r.counter);
        }
    }
    out
}
