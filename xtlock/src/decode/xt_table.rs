//! A legacy iptables table as the kernel returns it (`IPT_SO_GET_ENTRIES`, or
//! `IP6T_SO_GET_ENTRIES` for ip6tables), parsed into chains and rules the way `iptables-save`
//! shows them. The layouts read here are the kernel's userspace ABI
//! (`linux/netfilter_ipv4/ip_tables.h`, `netfilter_ipv6/ip6_tables.h`, `x_tables.h`), frozen
//! for iptables itself, not kernel-internal structs: they are the same on every kernel and
//! architecture, so they are not looked up in BTF.
//!
//! A rule is kept as its parts (`-s 10.0.0.0/8`, `-p tcp`, `-m mark --mark 0x8000/0x8000`,
//! `-j DROP`): the diff compares parts, so a rule that lost a match says which. Matches and
//! targets xtlock does not decode are shown by name with a digest of their bytes, which is
//! enough to tell them apart.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

pub use crate::event::{ChainState, Rule};

/// `sizeof(struct ipt_entry)`: `ipt_ip` (84), nfcache, offsets, comefrom, counters.
pub const IPT_ENTRY_LEN: usize = 112;
/// `sizeof(struct ip6t_entry)`: `ip6t_ip6` (136), nfcache, offsets, comefrom, counters.
pub const IP6T_ENTRY_LEN: usize = 168;

/// Which table layout: `ipt_entry` (iptables) or `ip6t_entry` (ip6tables). Everything after
/// the entry's head (matches, targets, verdicts) is the same `x_tables` format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    /// `family` of a [`crate::event::RuleTable`]: `ip`, `ip6`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }

    fn entry_len(self) -> usize {
        match self {
            Family::Ipv4 => IPT_ENTRY_LEN,
            Family::Ipv6 => IP6T_ENTRY_LEN,
        }
    }

    /// Where `target_offset` is; `next_offset` follows it.
    fn offsets_at(self) -> usize {
        match self {
            Family::Ipv4 => 88,
            Family::Ipv6 => 140,
        }
    }

    /// `IPT_F_GOTO` / `IP6T_F_GOTO` in the entry's flags.
    fn goto(self, e: &[u8]) -> bool {
        match self {
            Family::Ipv4 => e[82] & 0x02 != 0,
            Family::Ipv6 => e[131] & 0x04 != 0,
        }
    }
}
/// `sizeof(struct xt_entry_match)` / `xt_entry_target` headers.
const XT_HEAD_LEN: usize = 32;
/// `sizeof(struct ipt_getinfo)`.
pub const IPT_GETINFO_LEN: usize = 84;
/// Offset of the entries in `struct ipt_get_entries` (name, size, then 8-aligned entries).
pub const IPT_GET_ENTRIES_HEAD: usize = 40;
/// `NF_INET_NUMHOOKS`.
const HOOKS: usize = 5;
const HOOK_NAMES: [&str; HOOKS] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// One chain of a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    /// A built-in chain's policy (`ACCEPT`, `DROP`); `None` for a user chain.
    pub policy: Option<String>,
    pub rules: Vec<Rule>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TableError {
    #[error("the table's answer is cut short: {0}")]
    Short(&'static str),
    #[error("an entry at offset {offset} is malformed: {why}")]
    Entry { offset: usize, why: &'static str },
}

/// What `IPT_SO_GET_INFO` says of a table: its hooks' entry points and sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableInfo {
    pub valid_hooks: u32,
    pub hook_entry: [u32; HOOKS],
    pub underflow: [u32; HOOKS],
    pub num_entries: u32,
    pub size: u32,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn i32_at(b: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A NUL-terminated name of at most `len` bytes at `at`.
fn name_at(b: &[u8], at: usize, len: usize) -> String {
    let s = b.get(at..at + len).unwrap_or_default();
    let end = s.iter().position(|&c| c == 0).unwrap_or(s.len());
    String::from_utf8_lossy(&s[..end]).into_owned()
}

impl TableInfo {
    /// From the `ipt_getinfo` answer.
    pub fn parse(b: &[u8]) -> Result<Self, TableError> {
        let short = || TableError::Short("getinfo");
        let mut hook_entry = [0; HOOKS];
        let mut underflow = [0; HOOKS];
        for i in 0..HOOKS {
            hook_entry[i] = u32_at(b, 36 + 4 * i).ok_or_else(short)?;
            underflow[i] = u32_at(b, 56 + 4 * i).ok_or_else(short)?;
        }
        Ok(TableInfo {
            valid_hooks: u32_at(b, 32).ok_or_else(short)?,
            hook_entry,
            underflow,
            num_entries: u32_at(b, 76).ok_or_else(short)?,
            size: u32_at(b, 80).ok_or_else(short)?,
        })
    }
}

/// One entry as found in the blob.
struct Entry {
    offset: usize,
    rule: Rule,
    /// `ERROR` target: a user chain's head (its name), or the table's end (`ERROR`).
    error: Option<String>,
    /// A standard target's verdict.
    verdict: Option<i32>,
}

/// The chains of a table from its entries (`entries`: the bytes after the
/// `ipt_get_entries` head).
pub fn parse_table(info: &TableInfo, entries: &[u8]) -> Result<Vec<Chain>, TableError> {
    parse_table_of(Family::Ipv4, info, entries)
}

/// [`parse_table`] for either family's layout.
pub fn parse_table_of(
    family: Family,
    info: &TableInfo,
    entries: &[u8],
) -> Result<Vec<Chain>, TableError> {
    let mut raw = Vec::new();
    let mut off = 0usize;
    let head = family.entry_len();
    while off + head <= entries.len() {
        let bad = |why| TableError::Entry { offset: off, why };
        let at = off + family.offsets_at();
        let target_off = usize::from(u16_at(entries, at).ok_or(bad("head"))?);
        let next = usize::from(u16_at(entries, at + 2).ok_or(bad("head"))?);
        if next < head || target_off < head || target_off > next {
            return Err(bad("offsets"));
        }
        let e = entries
            .get(off..off + next)
            .ok_or(bad("runs past the end"))?;
        raw.push(parse_entry(family, off, e, target_off).ok_or(bad("match or target"))?);
        off += next;
    }
    if raw.is_empty() {
        return Err(TableError::Short("no entries"));
    }
    // Chain starts: the hooks' entry points, and each user chain's head.
    let mut starts: Vec<(usize, String, Option<usize>)> = Vec::new();
    for (h, name) in HOOK_NAMES.iter().enumerate() {
        if info.valid_hooks & (1 << h) != 0 {
            starts.push((
                info.hook_entry[h] as usize,
                name.to_string(),
                Some(info.underflow[h] as usize),
            ));
        }
    }
    for e in &raw {
        if let Some(name) = &e.error {
            if name != "ERROR" {
                starts.push((e.offset, name.clone(), None));
            }
        }
    }
    starts.sort_by_key(|s| s.0);
    // Jumps name the chain whose range holds their offset. Binary searches: a kube-proxy
    // table has ~10^4 chains and ~10^4 jumps (linear scans took 2.3 s of CPU a read).
    let chain_at = |offset: usize| -> Option<&str> {
        let n = starts.partition_point(|s| s.0 <= offset);
        n.checked_sub(1).map(|i| starts[i].1.as_str())
    };
    let mut chains: Vec<Chain> = Vec::new();
    for (i, (start, name, underflow)) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(usize::MAX, |s| s.0);
        let mut chain = Chain {
            name: name.clone(),
            policy: None,
            rules: Vec::new(),
        };
        // `raw` is in offset order, as the kernel laid it out.
        let (lo, hi) = (
            raw.partition_point(|e| e.offset < *start),
            raw.partition_point(|e| e.offset < end),
        );
        let members: Vec<&Entry> = raw[lo..hi].iter().filter(|e| e.error.is_none()).collect();
        for (j, e) in members.iter().enumerate() {
            let last = j + 1 == members.len();
            let mut rule = e.rule.clone();
            if let Some(v) = e.verdict {
                let t = verdict_text(v, |o| chain_at(o).map(str::to_owned));
                let goto = rule.0.last().is_some_and(|t| t == "-g");
                rule.0.pop();
                rule.0
                    .push(format!("{} {t}", if goto { "-g" } else { "-j" }));
            }
            if Some(e.offset) == *underflow {
                // The built-in chain's policy, not a rule.
                chain.policy = Some(rule.target().trim_start_matches("-j ").to_string());
                continue;
            }
            if underflow.is_none() && last && rule.0.len() == 1 && rule.target() == "-j RETURN" {
                // A user chain's tail.
                continue;
            }
            chain.rules.push(rule);
        }
        chains.push(chain);
    }
    Ok(chains)
}

fn verdict_text(v: i32, chain_at: impl Fn(usize) -> Option<String>) -> String {
    match v {
        -1 => "DROP".into(),
        -2 => "ACCEPT".into(),
        -4 => "QUEUE".into(),
        -5 => "RETURN".into(),
        v if v >= 0 => chain_at(v as usize).unwrap_or_else(|| format!("{v}")),
        v => format!("verdict {v}"),
    }
}

fn parse_entry(family: Family, offset: usize, e: &[u8], target_off: usize) -> Option<Entry> {
    let mut parts = match family {
        Family::Ipv4 => ip_parts(e),
        Family::Ipv6 => ip6_parts(e),
    };
    let mut at = family.entry_len();
    while at + XT_HEAD_LEN <= target_off {
        let size = usize::from(u16_at(e, at)?);
        if size < XT_HEAD_LEN || at + size > target_off {
            return None;
        }
        let name = name_at(e, at + 2, 29);
        let rev = e[at + 31];
        parts.push(match_text(&name, rev, &e[at + XT_HEAD_LEN..at + size]));
        at += size;
    }
    let tsize = usize::from(u16_at(e, target_off)?);
    let tdata = e.get(target_off + XT_HEAD_LEN..target_off + tsize)?;
    let tname = name_at(e, target_off + 2, 29);
    let (mut error, mut verdict) = (None, None);
    let goto = family.goto(e);
    match tname.as_str() {
        "" => {
            verdict = Some(i32_at(tdata, 0)?);
            // Worded once chains are known; `-g` marks a goto for now.
            parts.push(if goto { "-g" } else { "-j" }.to_string());
        }
        "ERROR" => {
            error = Some(name_at(tdata, 0, 30));
            parts.push("-j ERROR".to_string());
        }
        "REJECT" if family == Family::Ipv6 => parts.push(reject6_text(tdata)),
        t => parts.push(target_text(t, e[target_off + 31], tdata)),
    }
    Some(Entry {
        offset,
        rule: Rule(parts),
        error,
        verdict,
    })
}

/// `ipt_ip`'s parts: addresses, interfaces, protocol, fragments.
fn ip_parts(e: &[u8]) -> Vec<String> {
    let mut p = Vec::new();
    let inv = e[83];
    let not = |flag: u8| if inv & flag != 0 { "! " } else { "" };
    for (addr, mask, flag, opt) in [(0, 8, 0x08u8, "-s"), (4, 12, 0x10, "-d")] {
        let a = Ipv4Addr::from(<[u8; 4]>::try_from(&e[addr..addr + 4]).unwrap_or_default());
        let m = u32::from_be_bytes(<[u8; 4]>::try_from(&e[mask..mask + 4]).unwrap_or_default());
        if m != 0 {
            p.push(format!("{}{opt} {a}/{}", not(flag), m.count_ones()));
        }
    }
    iface_parts(e, [(16, 48), (32, 64)], not, &mut p);
    let proto = u16_at(e, 80).unwrap_or(0);
    if proto != 0 {
        p.push(format!("{}-p {}", not(0x40), proto_name(proto)));
    }
    if e[82] & 0x01 != 0 {
        p.push(format!("{}-f", not(0x20)));
    }
    p
}

/// `-i`/`-o` parts from the (name, mask) offsets of the input and output interfaces; the
/// same flags (`IPT_INV_VIA_IN`/`OUT` = `IP6T_INV_VIA_IN`/`OUT`) in both families.
fn iface_parts(
    e: &[u8],
    at: [(usize, usize); 2],
    not: impl Fn(u8) -> &'static str,
    p: &mut Vec<String>,
) {
    for ((name, mask), (flag, opt)) in at.into_iter().zip([(0x01u8, "-i"), (0x02, "-o")]) {
        let n = name_at(e, name, 16);
        if !n.is_empty() {
            // A mask shorter than the name plus its NUL is a wildcard (`eth+`).
            let plus = e[mask + n.len().min(15)] == 0;
            p.push(format!(
                "{}{opt} {n}{}",
                not(flag),
                if plus { "+" } else { "" }
            ));
        }
    }
}

/// A protocol number as `iptables-save` names it.
fn proto_name(proto: u16) -> String {
    match proto {
        1 => "icmp".to_string(),
        6 => "tcp".to_string(),
        17 => "udp".to_string(),
        58 => "ipv6-icmp".to_string(),
        132 => "sctp".to_string(),
        n => n.to_string(),
    }
}

/// `ip6t_ip6`'s parts: addresses, interfaces, protocol.
fn ip6_parts(e: &[u8]) -> Vec<String> {
    let mut p = Vec::new();
    let (flags, inv) = (e[131], e[132]);
    let not = |flag: u8| if inv & flag != 0 { "! " } else { "" };
    for (addr, mask, flag, opt) in [(0, 32, 0x08u8, "-s"), (16, 48, 0x10, "-d")] {
        let a = Ipv6Addr::from(<[u8; 16]>::try_from(&e[addr..addr + 16]).unwrap_or([0; 16]));
        let m = u128::from_be_bytes(<[u8; 16]>::try_from(&e[mask..mask + 16]).unwrap_or([0; 16]));
        if m != 0 {
            p.push(format!("{}{opt} {a}/{}", not(flag), m.count_ones()));
        }
    }
    iface_parts(e, [(64, 96), (80, 112)], not, &mut p);
    // `IP6T_F_PROTO`: the protocol is matched only when this flag says so.
    if flags & 0x01 != 0 {
        let proto = u16_at(e, 128).unwrap_or(0);
        p.push(format!("{}-p {}", not(0x40), proto_name(proto)));
    }
    p
}

/// `ip6t_REJECT`'s answer (its codes differ from IPv4's).
fn reject6_text(d: &[u8]) -> String {
    let with = match u32_at(d, 0) {
        Some(0) => "icmp6-no-route",
        Some(1) => "icmp6-adm-prohibited",
        Some(2) => "icmp6-not-neighbour",
        Some(3) => "icmp6-addr-unreachable",
        Some(4) => "icmp6-port-unreachable",
        Some(6) => "tcp-reset",
        Some(7) => "icmp6-policy-fail",
        Some(8) => "icmp6-reject-route",
        _ => "?",
    };
    format!("-j REJECT --reject-with {with}")
}

/// A short digest of bytes xtlock does not decode: equal bytes, equal text.
pub(crate) fn digest(b: &[u8]) -> String {
    // FNV-1a: stable across runs and versions, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in b {
        h = (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:012x}", h >> 16)
}

fn ports(b: &[u8], at: usize) -> Option<String> {
    let (lo, hi) = (u16_at(b, at)?, u16_at(b, at + 2)?);
    Some(match (lo, hi) {
        (0, 0xffff) => String::new(),
        (l, h) if l == h => l.to_string(),
        (l, h) => format!("{l}:{h}"),
    })
}

pub(crate) fn match_text(name: &str, rev: u8, d: &[u8]) -> String {
    let decoded = match (name, rev) {
        ("comment", _) => Some(format!("--comment \"{}\"", name_at(d, 0, 256))),
        ("mark", 1) => (|| {
            let (mark, mask, inv) = (u32_at(d, 0)?, u32_at(d, 4)?, *d.get(8)?);
            Some(format!(
                "{}--mark {mark:#x}/{mask:#x}",
                if inv != 0 { "! " } else { "" }
            ))
        })(),
        ("tcp" | "udp", 0) => (|| {
            let inv = if name == "tcp" {
                *d.get(11)?
            } else {
                *d.get(8)?
            };
            let mut s = String::new();
            for (at, opt, flag) in [(0, "--sport", 0x01u8), (4, "--dport", 0x02)] {
                let p = ports(d, at)?;
                if !p.is_empty() {
                    let not = if inv & flag != 0 { "! " } else { "" };
                    let _ = write!(s, "{}{not}{opt} {p}", if s.is_empty() { "" } else { " " });
                }
            }
            Some(s)
        })(),
        // Shown by name and digest: addrtype, conntrack, multiport, set, statistic, ...
        _ => None,
    };
    match decoded {
        Some(s) if s.is_empty() => format!("-m {name}"),
        Some(s) => format!("-m {name} {s}"),
        None => format!("-m {name} [rev {rev} {}]", digest(d)),
    }
}

pub(crate) fn target_text(name: &str, rev: u8, d: &[u8]) -> String {
    let decoded = match name {
        "REJECT" => u32_at(d, 0).map(|w| {
            let with = match w {
                0 => "icmp-net-unreachable",
                1 => "icmp-host-unreachable",
                2 => "icmp-proto-unreachable",
                3 => "icmp-port-unreachable",
                5 => "icmp-net-prohibited",
                6 => "icmp-host-prohibited",
                7 => "tcp-reset",
                8 => "icmp-admin-prohibited",
                _ => "?",
            };
            format!("--reject-with {with}")
        }),
        "MARK" if rev == 2 => (|| {
            let (mark, mask) = (u32_at(d, 0)?, u32_at(d, 4)?);
            Some(format!("--set-xmark {mark:#x}/{mask:#x}"))
        })(),
        "MASQUERADE" | "ACCEPT" | "DROP" | "RETURN" | "LOG" | "NOTRACK" => Some(String::new()),
        _ => None,
    };
    match decoded {
        Some(s) if s.is_empty() => format!("-j {name}"),
        Some(s) => format!("-j {name} {s}"),
        None => format!("-j {name} [rev {rev} {}]", digest(d)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// One `ipt_entry` with `matches` (name, revision, data) and a target.
    pub(crate) fn entry(
        proto: u16,
        matches: &[(&str, u8, Vec<u8>)],
        target: (&str, Vec<u8>),
    ) -> Vec<u8> {
        let mut e = vec![0u8; IPT_ENTRY_LEN];
        e[80..82].copy_from_slice(&proto.to_ne_bytes());
        let head = |name: &str, rev: u8, data: &[u8]| {
            let size = (XT_HEAD_LEN + data.len()).div_ceil(8) * 8;
            let mut m = vec![0u8; size];
            m[0..2].copy_from_slice(&(size as u16).to_ne_bytes());
            m[2..2 + name.len()].copy_from_slice(name.as_bytes());
            m[31] = rev;
            m[XT_HEAD_LEN..XT_HEAD_LEN + data.len()].copy_from_slice(data);
            m
        };
        for (n, r, d) in matches {
            e.extend(head(n, *r, d));
        }
        let target_off = e.len();
        e.extend(head(target.0, 0, &target.1));
        let next = e.len();
        e[88..90].copy_from_slice(&(target_off as u16).to_ne_bytes());
        e[90..92].copy_from_slice(&(next as u16).to_ne_bytes());
        e
    }

    pub(crate) fn verdict(v: i32) -> (&'static str, Vec<u8>) {
        ("", v.to_ne_bytes().to_vec())
    }

    pub(crate) fn error(name: &str) -> (&'static str, Vec<u8>) {
        let mut d = vec![0u8; 32];
        d[..name.len()].copy_from_slice(name.as_bytes());
        ("ERROR", d)
    }

    /// A filter table with INPUT/FORWARD/OUTPUT (policies ACCEPT) and a user chain
    /// KUBE-FIREWALL holding `-m mark --mark 0x8000/0x8000 -j DROP`; INPUT jumps to it.
    pub(crate) fn filter_table(stripped: bool) -> (TableInfo, Vec<u8>) {
        let mut b = Vec::new();
        let mut info = TableInfo {
            valid_hooks: 0b01110,
            hook_entry: [0; 5],
            underflow: [0; 5],
            num_entries: 0,
            size: 0,
        };
        let mut kfw_head = 0;
        let push = |b: &mut Vec<u8>, e: Vec<u8>| {
            let at = b.len();
            b.extend(e);
            at
        };
        // INPUT: a jump (fixed up below), then the policy.
        info.hook_entry[1] = push(&mut b, entry(0, &[], verdict(0))) as u32;
        info.underflow[1] = push(&mut b, entry(0, &[], verdict(-2))) as u32;
        info.hook_entry[2] = push(&mut b, entry(0, &[], verdict(-2))) as u32;
        info.underflow[2] = info.hook_entry[2];
        info.hook_entry[3] = push(&mut b, entry(0, &[], verdict(-2))) as u32;
        info.underflow[3] = info.hook_entry[3];
        kfw_head = push(&mut b, entry(0, &[], error("KUBE-FIREWALL"))).max(kfw_head);
        let mark = {
            let mut d = 0x8000u32.to_ne_bytes().to_vec();
            d.extend(0x8000u32.to_ne_bytes());
            d.extend([0u8; 4]);
            d
        };
        let mut comment = vec![0u8; 256];
        comment[..11].copy_from_slice(b"kube-proxy!");
        let mut ms = vec![("comment", 0u8, comment)];
        if !stripped {
            ms.push(("mark", 1, mark));
        }
        push(&mut b, entry(0, &ms, verdict(-1)));
        push(&mut b, entry(0, &[], verdict(-5)));
        push(&mut b, entry(0, &[], error("ERROR")));
        // INPUT's jump to KUBE-FIREWALL's head.
        let t = IPT_ENTRY_LEN + XT_HEAD_LEN;
        b[t..t + 4].copy_from_slice(&(kfw_head as i32).to_ne_bytes());
        info.size = b.len() as u32;
        (info, b)
    }

    #[test]
    fn chains_policies_rules_and_jumps() {
        let (info, b) = filter_table(false);
        let chains = parse_table(&info, &b).unwrap();
        let names: Vec<(&str, Option<&str>, usize)> = chains
            .iter()
            .map(|c| (c.name.as_str(), c.policy.as_deref(), c.rules.len()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("INPUT", Some("ACCEPT"), 1),
                ("FORWARD", Some("ACCEPT"), 0),
                ("OUTPUT", Some("ACCEPT"), 0),
                ("KUBE-FIREWALL", None, 1),
            ]
        );
        assert_eq!(chains[0].rules[0].text(), "-j KUBE-FIREWALL");
        assert_eq!(chains[0].rules[0].jump(), Some("KUBE-FIREWALL"));
        let r = &chains[3].rules[0];
        assert_eq!(
            r.text(),
            "-m comment --comment \"kube-proxy!\" -m mark --mark 0x8000/0x8000 -j DROP"
        );
        assert_eq!(r.comment(), Some("\"kube-proxy!\""));
        assert_eq!(
            r.matches().collect::<Vec<_>>(),
            ["-m mark --mark 0x8000/0x8000"]
        );
        let (info, b) = filter_table(true);
        let chains = parse_table(&info, &b).unwrap();
        assert_eq!(chains[3].rules[0].matches().count(), 0);
    }

    #[test]
    fn damaged_tables_are_errors_not_panics() {
        let (info, b) = filter_table(false);
        for cut in [0, 1, 50, IPT_ENTRY_LEN + 3, b.len() - 1] {
            let _ = parse_table(&info, &b[..cut]);
        }
        let mut bad = b.clone();
        bad[90] = 1; // next_offset 1
        assert!(parse_table(&info, &bad).is_err());
        assert!(TableInfo::parse(&[0; 10]).is_err());
    }
}
