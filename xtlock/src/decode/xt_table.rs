//! A legacy iptables table as the kernel returns it (`IPT_SO_GET_ENTRIES`, or
//! `IP6T_SO_GET_ENTRIES` for ip6tables), parsed into chains and rules the way `iptables-save`
//! shows them. The layouts read here are the kernel's userspace ABI
//! (`linux/netfilter_ipv4/ip_tables.h`, `netfilter_ipv6/ip6_tables.h`, `x_tables.h`), frozen
//! for iptables itself, not kernel-internal structs: they are the same on every kernel and
//! architecture, so they are not looked up in BTF.
//!
//! A rule is kept as its parts (`-s 10.0.0.0/8`, `-p tcp`, `-m mark --mark 0x8000/0x8000`,
//! `-j DROP`), each worded as `iptables-save` words it (the head here, matches and targets
//! in `xt_ext.rs`): the diff compares parts, so a rule that lost a match says which. Matches
//! and targets xtlock does not decode are shown by name with a digest of their bytes, which
//! is enough to tell them apart.

use std::net::{Ipv4Addr, Ipv6Addr};

pub(crate) use super::xt_bytes::digest;
pub use super::xt_bytes::Family;
use super::xt_bytes::{name_at, u16_at, u32_at};
use super::xt_ext::{match_text, prefix_len, target_text};

pub use crate::event::{ChainState, Rule};

/// `sizeof(struct ipt_entry)`: `ipt_ip` (84), nfcache, offsets, comefrom, counters.
pub const IPT_ENTRY_LEN: usize = 112;
/// `sizeof(struct ip6t_entry)`: `ip6t_ip6` (136), nfcache, offsets, comefrom, counters.
pub const IP6T_ENTRY_LEN: usize = 168;

impl Family {
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
    /// Each rule's counter, in `rules`' order (`None`: the rule has none, an nf_tables
    /// rule without `counter`); empty when not read. Kept apart from the rules: counts change
    /// with every packet, what a rule is does not.
    pub counters: Vec<Option<Counter>>,
    /// A built-in chain's policy counter (what it let through or dropped), where kept.
    pub policy_counter: Option<Counter>,
}

/// A rule's counter as the kernel keeps it: packets and bytes that matched it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
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

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn i32_at(b: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
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
    /// `struct xt_counters`, the entry head's last 16 bytes.
    counter: Counter,
}

/// The chains of an IPv4 table from its entries (`entries`: the bytes after the
/// `ipt_get_entries` head), its `-m set` matches' sets unnamed (shown by index).
pub fn parse_table(info: &TableInfo, entries: &[u8]) -> Result<Vec<Chain>, TableError> {
    parse_table_with(Family::Ipv4, info, entries, &mut |_| None)
}

/// The chains of a table of either family's layout, the sets of its `-m set` matches named by
/// `set_name` (by index; the source asks the kernel, as iptables-save does: decoding does no
/// I/O).
pub fn parse_table_with(
    family: Family,
    info: &TableInfo,
    entries: &[u8],
    set_name: &mut dyn FnMut(u16) -> Option<String>,
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
        raw.push(parse_entry(family, off, e, target_off, set_name).ok_or(bad("match or target"))?);
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
            counters: Vec::new(),
            policy_counter: None,
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
                chain.policy_counter = Some(e.counter);
                continue;
            }
            if underflow.is_none() && last && rule.0.len() == 1 && rule.target() == "-j RETURN" {
                // A user chain's tail.
                continue;
            }
            chain.rules.push(rule);
            chain.counters.push(Some(e.counter));
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

fn parse_entry(
    family: Family,
    offset: usize,
    e: &[u8],
    target_off: usize,
    sets: &mut dyn FnMut(u16) -> Option<String>,
) -> Option<Entry> {
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
        parts.push(match_text(
            family,
            &name,
            rev,
            &e[at + XT_HEAD_LEN..at + size],
            sets,
        ));
        at += size;
    }
    let tsize = usize::from(u16_at(e, target_off)?);
    let tdata = e.get(target_off + XT_HEAD_LEN..target_off + tsize)?;
    let tname = name_at(e, target_off + 2, 29);
    let (mut error, mut verdict) = (None, None);
    let goto = family.goto(e);
    match tname.as_str() {
        "" => {
            let v = i32_at(tdata, 0)?;
            // A rule without a target: libiptc jumps to the next entry (a fall-through,
            // which iptables-save leaves out), not to the chain that holds it.
            if usize::try_from(v).ok() != Some(offset + e.len()) {
                verdict = Some(v);
                // Worded once chains are known; `-g` marks a goto for now.
                parts.push(if goto { "-g" } else { "-j" }.to_string());
            }
        }
        "ERROR" => {
            error = Some(name_at(tdata, 0, 30));
            parts.push("-j ERROR".to_string());
        }
        t => parts.push(target_text(family, t, e[target_off + 31], tdata)),
    }
    // `pcnt`, `bcnt`: the head is `entry_len` long (checked by the caller), they end it.
    let c = family.entry_len() - 16;
    let counter = Counter {
        packets: u64_at(e, c)?,
        bytes: u64_at(e, c + 8)?,
    };
    Some(Entry {
        offset,
        rule: Rule(parts),
        error,
        verdict,
        counter,
    })
}

/// `IPT_INV_*` (the same bits as `IP6T_INV_*`) in [`IpHead::inv`].
pub(crate) const INV_VIA_IN: u8 = 0x01;
pub(crate) const INV_VIA_OUT: u8 = 0x02;
pub(crate) const INV_SRCIP: u8 = 0x08;
pub(crate) const INV_DSTIP: u8 = 0x10;
pub(crate) const INV_FRAG: u8 = 0x20;
pub(crate) const INV_PROTO: u8 = 0x40;
const IFNAMSIZ: usize = 16;

/// What iptables keeps of a rule outside its matches (`struct ipt_ip`, `struct ip6t_ip6`),
/// saved as `-s`, `-d`, `-i`, `-o`, `-p`, `-f`. A legacy entry holds it as is; iptables-nft
/// spells it as payload and meta matches, read back into this same form (as
/// `nft-ruleparse-ipv4.c` fills `cs->fw.ip`), so both backends' rules are worded by one
/// [`IpHead::parts`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct IpHead {
    /// Addresses and masks in network order; IPv4's in the first 4 bytes.
    pub src: [u8; 16],
    pub smsk: [u8; 16],
    pub dst: [u8; 16],
    pub dmsk: [u8; 16],
    /// Interface names and the masks of the bytes compared (`cali+`: a mask over `cali`).
    pub iniface: [u8; IFNAMSIZ],
    pub iniface_mask: [u8; IFNAMSIZ],
    pub outiface: [u8; IFNAMSIZ],
    pub outiface_mask: [u8; IFNAMSIZ],
    pub proto: u16,
    /// `-f` (IPv4 only).
    pub frag: bool,
    /// `INV_*` bits.
    pub inv: u8,
}

fn array<const N: usize>(e: &[u8], at: usize) -> [u8; N] {
    e.get(at..at + N)
        .and_then(|b| b.try_into().ok())
        .unwrap_or([0; N])
}

impl IpHead {
    /// From `struct ipt_ip` (src, dst, smsk, dmsk, iniface[16], outiface[16],
    /// iniface_mask[16], outiface_mask[16], u16 proto, u8 flags, invflags).
    fn of_ipt(e: &[u8]) -> Self {
        let v4 = |at| {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&array::<4>(e, at));
            a
        };
        IpHead {
            src: v4(0),
            dst: v4(4),
            smsk: v4(8),
            dmsk: v4(12),
            iniface: array(e, 16),
            outiface: array(e, 32),
            iniface_mask: array(e, 48),
            outiface_mask: array(e, 64),
            proto: u16_at(e, 80).unwrap_or(0),
            frag: e.get(82).is_some_and(|f| f & 0x01 != 0),
            inv: e.get(83).copied().unwrap_or(0),
        }
    }

    /// From `struct ip6t_ip6` (src, dst, smsk, dmsk, iniface[16], outiface[16],
    /// iniface_mask[16], outiface_mask[16], u16 proto, u8 tos, flags, invflags).
    fn of_ip6t(e: &[u8]) -> Self {
        IpHead {
            src: array(e, 0),
            dst: array(e, 16),
            smsk: array(e, 32),
            dmsk: array(e, 48),
            iniface: array(e, 64),
            outiface: array(e, 80),
            iniface_mask: array(e, 96),
            outiface_mask: array(e, 112),
            proto: u16_at(e, 128).unwrap_or(0),
            frag: false,
            inv: e.get(132).copied().unwrap_or(0),
        }
    }

    /// The parts as `print_rule4` / `print_rule6` save them: `-s`, `-d`, `-i`, `-o`, `-p`,
    /// `-f`, each with its `! ` when inverted.
    pub(crate) fn parts(&self, family: Family) -> Vec<String> {
        let mut p = Vec::new();
        let not = |flag: u8| if self.inv & flag != 0 { "! " } else { "" };
        for (a, m, flag, opt) in [
            (&self.src, &self.smsk, INV_SRCIP, "-s"),
            (&self.dst, &self.dmsk, INV_DSTIP, "-d"),
        ] {
            match family {
                Family::Ipv4 => {
                    let a = array::<4>(a, 0);
                    let m = array::<4>(m, 0);
                    // `save_ipv4_addr`: shown unless all of address, mask and inversion are
                    // zero; the mask as a prefix length (`/32` too), or dotted when it is not
                    // contiguous.
                    if a != [0; 4] || m != [0; 4] || self.inv & flag != 0 {
                        let mask = match prefix_len(u128::from(u32::from_be_bytes(m)) << 96) {
                            Some(n) => n.min(32).to_string(),
                            None => Ipv4Addr::from(m).to_string(),
                        };
                        p.push(format!("{}{opt} {}/{mask}", not(flag), Ipv4Addr::from(a)));
                    }
                }
                Family::Ipv6 => {
                    // `save_ipv6_addr`: shown when inverted or the mask is not `/0`.
                    let len = prefix_len(u128::from_be_bytes(*m));
                    if self.inv & flag != 0 || len != Some(0) {
                        let mask = match len {
                            Some(n) => n.to_string(),
                            None => Ipv6Addr::from(*m).to_string(),
                        };
                        p.push(format!("{}{opt} {}/{mask}", not(flag), Ipv6Addr::from(*a)));
                    }
                }
            }
        }
        for (name, mask, flag, opt) in [
            (&self.iniface, &self.iniface_mask, INV_VIA_IN, "-i"),
            (&self.outiface, &self.outiface_mask, INV_VIA_OUT, "-o"),
        ] {
            if let Some(s) = iface_text(name, mask) {
                p.push(format!("{}{opt} {s}", not(flag)));
            }
        }
        // `save_rule_details`: the protocol when not 0.
        if self.proto != 0 {
            p.push(format!("{}-p {}", not(INV_PROTO), proto_name(self.proto)));
        }
        if family == Family::Ipv4 && self.frag {
            p.push(format!("{}-f", not(INV_FRAG)));
        }
        p
    }
}

/// `ipt_ip`'s parts, as `print_rule4`.
fn ip_parts(e: &[u8]) -> Vec<String> {
    IpHead::of_ipt(e).parts(Family::Ipv4)
}

/// An interface as iptables' `save_iface` writes it: the name's bytes under the mask, then
/// `+` when the mask ends before the name does. The kernel keeps the name as typed (`cali+`,
/// its mask covering `cali`), so the `+` is the name's own; `-i +` has an empty mask and, as
/// in the save, no part: it matches every interface.
fn iface_text(n: &[u8; IFNAMSIZ], m: &[u8; IFNAMSIZ]) -> Option<String> {
    if m[0] == 0 {
        return None;
    }
    let mut s = Vec::with_capacity(IFNAMSIZ + 1);
    let mut prev = 0u8;
    for (&c, &k) in n.iter().zip(m) {
        if k == 0 {
            if prev != 0 {
                s.push(b'+');
            }
            break;
        }
        if c != 0 {
            s.push(c);
        }
        prev = c;
    }
    Some(String::from_utf8_lossy(&s).into_owned())
}

/// A protocol number as `iptables-save` names it: `xtables_chain_protos` first, then
/// `/etc/protocols` (`getprotobynumber`; Debian's netbase names, for the common ones).
fn proto_name(proto: u16) -> String {
    match proto {
        1 => "icmp",
        2 => "igmp",
        4 => "ipencap",
        6 => "tcp",
        17 => "udp",
        33 => "dccp",
        41 => "ipv6",
        47 => "gre",
        50 => "esp",
        51 => "ah",
        58 => "ipv6-icmp",
        89 => "ospf",
        94 => "ipip",
        103 => "pim",
        112 => "vrrp",
        132 => "sctp",
        135 => "mobility-header",
        136 => "udplite",
        n => return n.to_string(),
    }
    .to_string()
}

/// `ip6t_ip6`'s parts, as `print_rule6`.
fn ip6_parts(e: &[u8]) -> Vec<String> {
    IpHead::of_ip6t(e).parts(Family::Ipv6)
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
    fn interfaces_and_addresses_as_iptables_save_prints_them() {
        // `! -s 10.0.0.0/255.0.255.0 -d 10.8.0.1/32 -i cali+ -o +`: the kernel keeps `cali+`
        // with a mask over `cali`, and `+` with no mask at all.
        let mut e = vec![0u8; IPT_ENTRY_LEN];
        e[0..4].copy_from_slice(&[10, 0, 0, 0]);
        e[8..12].copy_from_slice(&[255, 0, 255, 0]);
        e[4..8].copy_from_slice(&[10, 8, 0, 1]);
        e[12..16].copy_from_slice(&[255; 4]);
        e[16..21].copy_from_slice(b"cali+");
        e[48..52].fill(0xff);
        e[32] = b'+';
        e[83] = 0x08;
        assert_eq!(
            ip_parts(&e),
            ["! -s 10.0.0.0/255.0.255.0", "-d 10.8.0.1/32", "-i cali+"]
        );
        // `! -o eth0` (mask over the name and its NUL), `-p gre`.
        let mut e = vec![0u8; IPT_ENTRY_LEN];
        e[32..36].copy_from_slice(b"eth0");
        e[64..69].fill(0xff);
        e[80..82].copy_from_slice(&47u16.to_ne_bytes());
        e[83] = 0x02;
        assert_eq!(ip_parts(&e), ["! -o eth0", "-p gre"]);
        // ip6tables: `-s fd00::/8 -d 2001:db8::1/128 -i br+ -p ipv6-icmp`.
        let mut e = vec![0u8; IP6T_ENTRY_LEN];
        e[0] = 0xfd;
        e[32] = 0xff;
        e[16..32].copy_from_slice(&"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        e[48..64].fill(0xff);
        e[64..67].copy_from_slice(b"br+");
        e[96..98].fill(0xff);
        e[128..130].copy_from_slice(&58u16.to_ne_bytes());
        e[131] = 0x01;
        assert_eq!(
            ip6_parts(&e),
            [
                "-s fd00::/8",
                "-d 2001:db8::1/128",
                "-i br+",
                "-p ipv6-icmp"
            ]
        );
    }

    #[test]
    fn a_rule_without_a_target_falls_through() {
        // INPUT: `-A INPUT -m comment --comment x1` (its verdict: the next entry), policy.
        let mut comment = vec![0u8; 256];
        comment[..2].copy_from_slice(b"x1");
        let len = entry(0, &[("comment", 0, comment.clone())], verdict(0)).len();
        let mut b = entry(0, &[("comment", 0, comment)], verdict(len as i32));
        let mut info = TableInfo {
            valid_hooks: 0b10,
            hook_entry: [0; 5],
            underflow: [0; 5],
            num_entries: 3,
            size: 0,
        };
        info.underflow[1] = b.len() as u32;
        b.extend(entry(0, &[], verdict(-2)));
        b.extend(entry(0, &[], error("ERROR")));
        let chains = parse_table(&info, &b).unwrap();
        assert_eq!(chains[0].policy.as_deref(), Some("ACCEPT"));
        assert_eq!(chains[0].rules[0].text(), "-m comment --comment x1");
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
