//! The matches and targets of a legacy iptables rule (`-m conntrack ...`, `-j DNAT ...`),
//! worded token for token as `iptables-save` (legacy, iptables 1.8.9) words them: the rule
//! diff compares these words, and people compare them with what `iptables-save` shows.
//!
//! Each decoder reads one extension's data, a struct of the kernel's frozen userspace ABI
//! (`linux/netfilter/xt_*.h`, named above each decoder), by (name, revision), and follows
//! that extension's `save` function in iptables' `extensions/libxt_*.c`. The data is read
//! in native byte order, as the kernel and iptables on the same machine wrote it; fields
//! the headers declare `__be16`/`__be32` are read as network order. An extension or
//! revision not decoded here, or data shorter than its struct, keeps `-m NAME [rev R
//! digest]`: equal bytes, equal text, so a diff still sees a change.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use super::xt_bytes::{digest, name_at, u16_at, u32_at, Family};

/// Names an ipset by its index (a `-m set` rule holds only the index; see `ipset.rs`).
pub(crate) type SetNames<'a> = dyn FnMut(u16) -> Option<String> + 'a;

/// Options as iptables-save prints them, one token or group at a time, space separated.
#[derive(Default)]
struct Out(String);

impl Out {
    fn push(&mut self, s: impl AsRef<str>) {
        if !self.0.is_empty() {
            self.0.push(' ');
        }
        self.0.push_str(s.as_ref());
    }

    /// `!` before an inverted option (iptables-save prints ` !` then the option).
    fn not(&mut self, inverted: bool) {
        if inverted {
            self.push("!");
        }
    }
}

fn u8_at(b: &[u8], at: usize) -> Option<u8> {
    b.get(at).copied()
}

/// A `__be16` port.
fn be16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn v4_at(b: &[u8], at: usize) -> Option<Ipv4Addr> {
    Some(Ipv4Addr::from(
        <[u8; 4]>::try_from(b.get(at..at + 4)?).ok()?,
    ))
}

fn v6_at(b: &[u8], at: usize) -> Option<Ipv6Addr> {
    Some(Ipv6Addr::from(
        <[u8; 16]>::try_from(b.get(at..at + 16)?).ok()?,
    ))
}

/// A `union nf_inet_addr` as the family's address (numeric, as iptables-save prints it).
fn addr_at(f: Family, b: &[u8], at: usize) -> Option<String> {
    Some(match f {
        Family::Ipv4 => v4_at(b, at)?.to_string(),
        Family::Ipv6 => v6_at(b, at)?.to_string(),
    })
}

/// The prefix length of a mask held in the top bits of `m`, `None` when not contiguous.
pub(crate) fn prefix_len(m: u128) -> Option<u32> {
    let n = m.leading_ones();
    (n == 128 || m << n == 0).then_some(n)
}

/// `xtables_ipmask_to_numeric` / `xtables_ip6mask_to_numeric`: nothing for a host mask,
/// `/N`, or `/MASK` when it is not contiguous.
fn mask_suffix(f: Family, b: &[u8], at: usize) -> Option<String> {
    let (bits, m) = match f {
        Family::Ipv4 => (
            32,
            u128::from(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?)) << 96,
        ),
        Family::Ipv6 => (
            128,
            u128::from_be_bytes(b.get(at..at + 16)?.try_into().ok()?),
        ),
    };
    Some(match prefix_len(m) {
        Some(n) if n == bits => String::new(),
        Some(n) => format!("/{n}"),
        None => format!("/{}", addr_at(f, b, at)?),
    })
}

/// `xtables_save_string`: bare when only `[A-Za-z0-9_-]`, else double-quoted with `"`, `\`
/// and `'` escaped by a backslash.
pub(crate) fn save_string(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !s.is_empty() && s.chars().all(plain) {
        return s.to_string();
    }
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        if matches!(c, '"' | '\\' | '\'') {
            q.push('\\');
        }
        q.push(c);
    }
    q.push('"');
    q
}

/// `xtables_print_mark_mask`: `0xM` for a full mask, else `0xM/0xK`.
fn mark_mask(mark: u32, mask: u32) -> String {
    if mask == u32::MAX {
        format!("{mark:#x}")
    } else {
        format!("{mark:#x}/{mask:#x}")
    }
}

/// A match as `-m NAME options` (the name iptables-save shows: `state` for a conntrack
/// match made by `-m state`).
pub(crate) fn match_text(
    family: Family,
    name: &str,
    rev: u8,
    d: &[u8],
    sets: &mut SetNames,
) -> String {
    let decoded = match (name, rev) {
        ("comment", 0) => Some(format!("--comment {}", save_string(&name_at(d, 0, 256)))),
        ("mark" | "connmark", 1) => mark_match(d),
        ("tcp", 0) => tcp(d),
        ("udp", 0) => udp(d),
        ("icmp", 0) if family == Family::Ipv4 => icmp(d, "--icmp-type", true),
        ("icmp6", 0) if family == Family::Ipv6 => icmp(d, "--icmpv6-type", false),
        ("conntrack", 1..=3) => conntrack(family, rev, d),
        ("state", 0) => u32_at(d, 0).map(|m| format!("--state {}", ct_states(m))),
        ("statistic", 0) => statistic(d),
        ("addrtype", 0 | 1) => addrtype(rev, d),
        ("multiport", 0 | 1) => multiport(rev, d),
        ("limit", 0) => limit(d),
        ("iprange", 0) if family == Family::Ipv4 => iprange_v0(d),
        ("iprange", 1) => iprange(family, d),
        ("set", 1..=4) => set(rev, d, sets),
        ("physdev", 0) => physdev(d),
        ("recent", 0 | 1) => recent(family, rev, d),
        ("pkttype", 0) => pkttype(d),
        _ if d.is_empty() => Some(String::new()),
        _ => None,
    };
    // `-m state` is a conntrack match flagged `XT_CONNTRACK_STATE_ALIAS`.
    let shown = if name == "conntrack"
        && (1..=3).contains(&rev)
        && u16_at(d, CT_MATCH_FLAGS).is_some_and(|f| f & CT_STATE_ALIAS != 0)
    {
        "state"
    } else {
        name
    };
    match decoded {
        Some(s) if s.is_empty() => format!("-m {shown}"),
        Some(s) => format!("-m {shown} {s}"),
        None => format!("-m {name} [rev {rev} {}]", digest(d)),
    }
}

/// `xt_mark_mtinfo1` / `xt_connmark_mtinfo1` { u32 mark, mask; u8 invert }.
fn mark_match(d: &[u8]) -> Option<String> {
    let (mark, mask, inv) = (u32_at(d, 0)?, u32_at(d, 4)?, u8_at(d, 8)?);
    let mut o = Out::default();
    o.not(inv != 0);
    o.push(format!("--mark {}", mark_mask(mark, mask)));
    Some(o.0)
}

/// One port range of `xt_tcp`/`xt_udp` (host order), unless it is every port.
fn port_range(o: &mut Out, d: &[u8], at: usize, inv: bool, opt: &str) -> Option<()> {
    let (lo, hi) = (u16_at(d, at)?, u16_at(d, at + 2)?);
    if (lo, hi) != (0, u16::MAX) {
        o.not(inv);
        if lo == hi {
            o.push(format!("{opt} {lo}"));
        } else {
            o.push(format!("{opt} {lo}:{hi}"));
        }
    }
    Some(())
}

/// `print_tcpf`: flag names in bit order, `NONE` for none. Bits past URG (ECE, CWR) have
/// no name in iptables: `None`, a digest.
fn tcp_flags(f: u8) -> Option<String> {
    if f & 0xc0 != 0 {
        return None;
    }
    if f == 0 {
        return Some("NONE".into());
    }
    let names = ["FIN", "SYN", "RST", "PSH", "ACK", "URG"];
    let set: Vec<&str> = (0..6)
        .filter(|i| f & (1 << i) != 0)
        .map(|i| names[i])
        .collect();
    Some(set.join(","))
}

/// `xt_tcp` { u16 spts[2], dpts[2]; u8 option, flg_mask, flg_cmp, invflags }. `--syn` is
/// stored (and saved) as `--tcp-flags FIN,SYN,RST,ACK SYN`.
fn tcp(d: &[u8]) -> Option<String> {
    let (option, mask, cmp, inv) = (u8_at(d, 8)?, u8_at(d, 9)?, u8_at(d, 10)?, u8_at(d, 11)?);
    let mut o = Out::default();
    port_range(&mut o, d, 0, inv & 0x01 != 0, "--sport")?;
    port_range(&mut o, d, 4, inv & 0x02 != 0, "--dport")?;
    if option != 0 || inv & 0x08 != 0 {
        o.not(inv & 0x08 != 0);
        o.push(format!("--tcp-option {option}"));
    }
    if mask != 0 || inv & 0x04 != 0 {
        o.not(inv & 0x04 != 0);
        o.push(format!(
            "--tcp-flags {} {}",
            tcp_flags(mask)?,
            tcp_flags(cmp)?
        ));
    }
    Some(o.0)
}

/// `xt_udp` { u16 spts[2], dpts[2]; u8 invflags }.
fn udp(d: &[u8]) -> Option<String> {
    let inv = u8_at(d, 8)?;
    let mut o = Out::default();
    port_range(&mut o, d, 0, inv & 0x01 != 0, "--sport")?;
    port_range(&mut o, d, 4, inv & 0x02 != 0, "--dport")?;
    Some(o.0)
}

/// `ipt_icmp` / `ip6t_icmp` { u8 type, code[2], invflags }: `TYPE` or `TYPE/CODE`, as
/// numbers (iptables-save does not name them); IPv4's type 255 is `any`.
fn icmp(d: &[u8], opt: &str, any: bool) -> Option<String> {
    let (ty, lo, hi, inv) = (u8_at(d, 0)?, u8_at(d, 1)?, u8_at(d, 2)?, u8_at(d, 3)?);
    let mut o = Out::default();
    o.not(inv & 0x01 != 0);
    if any && ty == 0xff {
        o.push(format!("{opt} any"));
    } else if lo != 0 || hi != 0xff {
        o.push(format!("{opt} {ty}/{lo}"));
    } else {
        o.push(format!("{opt} {ty}"));
    }
    Some(o.0)
}

// `xt_conntrack_mtinfo{1,2,3}`: eight `union nf_inet_addr` (origsrc addr, mask, origdst,
// replsrc, repldst: 128 bytes), u32 expires_min, expires_max; u16 l4proto; four ports
// (`__be16` in rev 1/2, host order in rev 3); u16 match_flags, invert_flags; then the state
// and status masks (u8 in rev 1, u16 after), and in rev 3 the ports' upper ends.
const CT_EXPIRES: usize = 128;
const CT_L4PROTO: usize = 136;
const CT_PORTS: usize = 138;
const CT_MATCH_FLAGS: usize = 146;
const CT_STATE_ALIAS: u16 = 1 << 13;

/// `print_state`: `XT_CONNTRACK_STATE_BIT(ctinfo)` = 1 << (ctinfo + 1) for ESTABLISHED (0),
/// RELATED (1), NEW (2); INVALID bit 0; SNAT, DNAT, UNTRACKED 1 << (IP_CT_NUMBER + 1..3).
fn ct_states(m: u32) -> String {
    let names = [
        (1, "INVALID"),
        (1 << 3, "NEW"),
        (1 << 2, "RELATED"),
        (1 << 1, "ESTABLISHED"),
        (1 << 8, "UNTRACKED"),
        (1 << 6, "SNAT"),
        (1 << 7, "DNAT"),
    ];
    let s: Vec<&str> = names
        .iter()
        .filter(|(b, _)| m & b != 0)
        .map(|(_, n)| *n)
        .collect();
    s.join(",")
}

/// `print_status` (`IPS_*` bits of `nf_conntrack_common.h`).
fn ct_status(m: u32) -> String {
    let names = [
        (1, "EXPECTED"),
        (2, "SEEN_REPLY"),
        (4, "ASSURED"),
        (8, "CONFIRMED"),
    ];
    let s: Vec<&str> = names
        .iter()
        .filter(|(b, _)| m & b != 0)
        .map(|(_, n)| *n)
        .collect();
    if m == 0 {
        "NONE".into()
    } else {
        s.join(",")
    }
}

/// `conntrack_dump` with the `--` prefix, numeric.
fn conntrack(f: Family, rev: u8, d: &[u8]) -> Option<String> {
    let need = match rev {
        1 => 152,
        2 => 154,
        _ => 162,
    };
    if d.len() < need {
        return None;
    }
    let (flags, inv) = (u16_at(d, CT_MATCH_FLAGS)?, u16_at(d, 148)?);
    let (state, status) = if rev == 1 {
        (u32::from(u8_at(d, 150)?), u32::from(u8_at(d, 151)?))
    } else {
        (u32::from(u16_at(d, 150)?), u32::from(u16_at(d, 152)?))
    };
    let on = |bit: u16| flags & bit != 0;
    let not = |bit: u16| inv & bit != 0;
    let mut o = Out::default();
    if on(1) {
        o.not(not(1));
        let opt = if on(CT_STATE_ALIAS) {
            "--state"
        } else {
            "--ctstate"
        };
        o.push(format!("{opt} {}", ct_states(state)));
    }
    if on(1 << 1) {
        o.not(not(1 << 1));
        o.push(format!("--ctproto {}", u16_at(d, CT_L4PROTO)?));
    }
    for (i, opt) in ["--ctorigsrc", "--ctorigdst", "--ctreplsrc", "--ctrepldst"]
        .iter()
        .enumerate()
    {
        let bit = 1 << (2 + i);
        if on(bit) {
            o.not(not(bit));
            let at = 32 * i;
            o.push(format!(
                "{opt} {}{}",
                addr_at(f, d, at)?,
                mask_suffix(f, d, at + 16)?
            ));
        }
    }
    for (i, opt) in [
        "--ctorigsrcport",
        "--ctorigdstport",
        "--ctreplsrcport",
        "--ctrepldstport",
    ]
    .iter()
    .enumerate()
    {
        let bit = 1 << (8 + i);
        if on(bit) {
            o.not(not(bit));
            let at = CT_PORTS + 2 * i;
            let (lo, hi) = if rev == 3 {
                (u16_at(d, at)?, u16_at(d, 154 + 2 * i)?)
            } else {
                (be16_at(d, at)?, 0)
            };
            if hi == 0 || lo == hi {
                o.push(format!("{opt} {lo}"));
            } else {
                o.push(format!("{opt} {lo}:{hi}"));
            }
        }
    }
    if on(1 << 6) {
        o.not(not(1 << 6));
        o.push(format!("--ctstatus {}", ct_status(status)));
    }
    if on(1 << 7) {
        o.not(not(1 << 7));
        let (lo, hi) = (u32_at(d, CT_EXPIRES)?, u32_at(d, CT_EXPIRES + 4)?);
        if lo == hi {
            o.push(format!("--ctexpire {lo}"));
        } else {
            o.push(format!("--ctexpire {lo}:{hi}"));
        }
    }
    if on(1 << 12) {
        let dir = if not(1 << 12) { "REPLY" } else { "ORIGINAL" };
        o.push(format!("--ctdir {dir}"));
    }
    Some(o.0)
}

/// `printf("%.11f", p / 2^31)` exactly: glibc rounds the exact binary value half to even.
fn probability(p: u32) -> String {
    const SCALE: u128 = 100_000_000_000; // 10^11
    let whole = u128::from(p >> 31);
    let frac = u128::from(p & 0x7fff_ffff) * SCALE;
    let (mut q, r) = (frac >> 31, frac & 0x7fff_ffff);
    let half = 1u128 << 30;
    if r > half || (r == half && q & 1 == 1) {
        q += 1;
    }
    let (whole, q) = if q == SCALE {
        (whole + 1, 0)
    } else {
        (whole, q)
    };
    format!("{whole}.{q:011}")
}

/// `xt_statistic_info` { u16 mode, flags; union { u32 probability } or { u32 every,
/// packet, count } }.
fn statistic(d: &[u8]) -> Option<String> {
    let (mode, flags) = (u16_at(d, 0)?, u16_at(d, 2)?);
    let inv = if flags & 0x01 != 0 { " !" } else { "" };
    match mode {
        0 => Some(format!(
            "--mode random{inv} --probability {}",
            probability(u32_at(d, 4)?)
        )),
        1 => Some(format!(
            "--mode nth{inv} --every {} --packet {}",
            u32_at(d, 4)?.wrapping_add(1),
            u32_at(d, 8)?
        )),
        _ => None,
    }
}

/// `print_types`: the `rtn_names` of the bits set, in bit order.
fn addr_types(m: u16) -> String {
    const RTN: [&str; 12] = [
        "UNSPEC",
        "UNICAST",
        "LOCAL",
        "BROADCAST",
        "ANYCAST",
        "MULTICAST",
        "BLACKHOLE",
        "UNREACHABLE",
        "PROHIBIT",
        "THROW",
        "NAT",
        "XRESOLVE",
    ];
    let s: Vec<&str> = (0..RTN.len())
        .filter(|i| m & (1 << i) != 0)
        .map(|i| RTN[i])
        .collect();
    s.join(",")
}

/// `xt_addrtype_info` (rev 0: u16 source, dest; u32 invert_source, invert_dest) and
/// `xt_addrtype_info_v1` (u16 source, dest; u32 flags).
fn addrtype(rev: u8, d: &[u8]) -> Option<String> {
    let (src, dst) = (u16_at(d, 0)?, u16_at(d, 2)?);
    let (inv_src, inv_dst, flags) = if rev == 0 {
        (u32_at(d, 4)? != 0, u32_at(d, 8)? != 0, 0)
    } else {
        let f = u32_at(d, 4)?;
        (f & 0x1 != 0, f & 0x2 != 0, f)
    };
    let mut o = Out::default();
    if src != 0 {
        o.not(inv_src);
        o.push(format!("--src-type {}", addr_types(src)));
    }
    if dst != 0 {
        o.not(inv_dst);
        o.push(format!("--dst-type {}", addr_types(dst)));
    }
    if flags & 0x4 != 0 {
        o.push("--limit-iface-in");
    }
    if flags & 0x8 != 0 {
        o.push("--limit-iface-out");
    }
    Some(o.0)
}

/// `xt_multiport` { u8 flags, count; u16 ports[15] } and `xt_multiport_v1` (then u8
/// pflags[15], a port that starts a range; u8 invert). Ports are numbers (save is numeric).
fn multiport(rev: u8, d: &[u8]) -> Option<String> {
    let (flags, count) = (u8_at(d, 0)?, usize::from(u8_at(d, 1)?));
    if count > 15 {
        return None;
    }
    let opt = match flags {
        0 => "--sports",
        1 => "--dports",
        2 => "--ports",
        _ => return None,
    };
    let mut list = String::new();
    let mut i = 0;
    while i < count {
        if i > 0 {
            list.push(',');
        }
        let _ = write!(list, "{}", u16_at(d, 2 + 2 * i)?);
        if rev == 1 && u8_at(d, 32 + i)? != 0 {
            i += 1;
            let _ = write!(list, ":{}", u16_at(d, 2 + 2 * i)?);
        }
        i += 1;
    }
    let mut o = Out::default();
    o.not(rev == 1 && u8_at(d, 47)? != 0);
    o.push(format!("{opt} {list}"));
    Some(o.0)
}

/// `xt_rateinfo` { u32 avg (1/10000 s between packets), burst; ... }; `print_rate`.
fn limit(d: &[u8]) -> Option<String> {
    const SCALE: u32 = 10_000;
    const RATES: [(&str, u32); 4] = [
        ("day", SCALE * 24 * 60 * 60),
        ("hour", SCALE * 60 * 60),
        ("min", SCALE * 60),
        ("sec", SCALE),
    ];
    let (avg, burst) = (u32_at(d, 0)?, u32_at(d, 4)?);
    let rate = if avg == 0 {
        "inf".to_string()
    } else {
        let mut i = 1;
        while i < RATES.len() {
            let m = RATES[i].1;
            if avg > m || m / avg < m % avg {
                break;
            }
            i += 1;
        }
        format!("{}/{}", RATES[i - 1].1 / avg, RATES[i - 1].0)
    };
    let mut o = Out::default();
    o.push(format!("--limit {rate}"));
    if burst != 5 {
        o.push(format!("--limit-burst {burst}"));
    }
    Some(o.0)
}

/// `ipt_iprange_info` (rev 0, IPv4): { be32 src min, max; be32 dst min, max; u8 flags }.
fn iprange_v0(d: &[u8]) -> Option<String> {
    let flags = u8_at(d, 16)?;
    let mut o = Out::default();
    for (at, bit, inv, opt) in [(0, 1, 0x10, "--src-range"), (8, 2, 0x20, "--dst-range")] {
        if flags & bit != 0 {
            o.not(flags & inv != 0);
            o.push(format!("{opt} {}-{}", v4_at(d, at)?, v4_at(d, at + 4)?));
        }
    }
    Some(o.0)
}

/// `xt_iprange_mtinfo` { nf_inet_addr src_min, src_max, dst_min, dst_max; u8 flags }.
fn iprange(f: Family, d: &[u8]) -> Option<String> {
    let flags = u8_at(d, 64)?;
    let mut o = Out::default();
    for (at, bit, inv, opt) in [(0, 1, 0x10, "--src-range"), (32, 2, 0x20, "--dst-range")] {
        if flags & bit != 0 {
            o.not(flags & inv != 0);
            o.push(format!(
                "{opt} {}-{}",
                addr_at(f, d, at)?,
                addr_at(f, d, at + 16)?
            ));
        }
    }
    Some(o.0)
}

/// `xt_set_info_match_v1..v4`: `xt_set_info` { u16 index; u8 dim, flags } (flags: bit 0
/// inverts, bit N says the Nth dimension is `src`), then in rev 3/4 two counter matches
/// (`ip_set_counter_match0` { u8 op; u64 value } in rev 3, `ip_set_counter_match`
/// { u64 value; u8 op } in rev 4, 16 bytes each from offset 8) and u32 flags at 40.
/// The set is named by asking the kernel, as iptables-save does.
fn set(rev: u8, d: &[u8], sets: &mut SetNames) -> Option<String> {
    let (index, dim, flags) = (u16_at(d, 0)?, u8_at(d, 2)?, u8_at(d, 3)?);
    let name = sets(index)?;
    let mut o = Out::default();
    o.not(flags & 0x01 != 0);
    let dirs: Vec<&str> = (1..=dim.min(6))
        .map(|i| if flags & (1 << i) != 0 { "src" } else { "dst" })
        .collect();
    o.push(format!("--match-set {name} {}", dirs.join(",")));
    match rev {
        2 if flags & 0x80 != 0 => o.push("--return-nomatch"),
        3 | 4 => {
            let f = u32_at(d, 40)?;
            if f & 0x80 != 0 {
                o.push("--return-nomatch");
            }
            if f & 0x08 != 0 {
                o.push("! --update-counters");
            }
            if f & 0x10 != 0 {
                o.push("! --update-subcounters");
            }
            for (at, what) in [(8, "packets"), (24, "bytes")] {
                let (op, value) = if rev == 3 {
                    (u8_at(d, at)?, u64_at(d, at + 8)?)
                } else {
                    (u8_at(d, at + 8)?, u64_at(d, at)?)
                };
                match op {
                    1 => o.push(format!("--{what}-eq {value}")),
                    2 => o.push(format!("! --{what}-eq {value}")),
                    3 => o.push(format!("--{what}-lt {value}")),
                    4 => o.push(format!("--{what}-gt {value}")),
                    _ => {}
                }
            }
        }
        _ => {}
    }
    Some(o.0)
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// `xt_physdev_info` { char physindev[16], in_mask[16], physoutdev[16], out_mask[16];
/// u8 invert, bitmask } (IN 0x01, OUT 0x02, BRIDGED 0x04, ISIN 0x08, ISOUT 0x10).
fn physdev(d: &[u8]) -> Option<String> {
    let (inv, bits) = (u8_at(d, 64)?, u8_at(d, 65)?);
    let mut o = Out::default();
    let flag = |o: &mut Out, bit: u8, text: String| {
        if bits & bit != 0 {
            o.not(inv & bit != 0);
            o.push(text);
        }
    };
    flag(&mut o, 0x08, "--physdev-is-in".into());
    flag(&mut o, 0x01, format!("--physdev-in {}", name_at(d, 0, 16)));
    flag(&mut o, 0x10, "--physdev-is-out".into());
    flag(
        &mut o,
        0x02,
        format!("--physdev-out {}", name_at(d, 32, 16)),
    );
    flag(&mut o, 0x04, "--physdev-is-bridged".into());
    Some(o.0)
}

/// `xt_recent_mtinfo` { u32 seconds, hit_count; u8 check_set, invert; char name[200];
/// u8 side } and `_v1` (then `union nf_inet_addr mask` at 212, 4-aligned).
fn recent(f: Family, rev: u8, d: &[u8]) -> Option<String> {
    let (secs, hits, check, inv) = (u32_at(d, 0)?, u32_at(d, 4)?, u8_at(d, 8)?, u8_at(d, 9)?);
    let side = u8_at(d, 210)?;
    let mut o = Out::default();
    o.not(inv != 0);
    for (bit, opt) in [
        (0x02, "--set"),
        (0x01, "--rcheck"),
        (0x04, "--update"),
        (0x08, "--remove"),
    ] {
        if check & bit != 0 {
            o.push(opt);
        }
    }
    if secs != 0 {
        o.push(format!("--seconds {}", secs as i32));
    }
    if check & 0x20 != 0 {
        o.push("--reap");
    }
    if hits != 0 {
        o.push(format!("--hitcount {}", hits as i32));
    }
    if check & 0x10 != 0 {
        o.push("--rttl");
    }
    o.push(format!("--name {}", name_at(d, 10, 200)));
    if rev == 1 {
        o.push(format!("--mask {}", addr_at(f, d, 212)?));
    }
    match side {
        0 => o.push("--rsource"),
        1 => o.push("--rdest"),
        _ => {}
    }
    Some(o.0)
}

/// `xt_pkttype_info` { int pkttype, invert } (`PACKET_*` of `linux/if_packet.h`).
fn pkttype(d: &[u8]) -> Option<String> {
    let (ty, inv) = (u32_at(d, 0)?, u32_at(d, 4)?);
    let name = match ty {
        0 => "unicast".to_string(),
        1 => "broadcast".to_string(),
        2 => "multicast".to_string(),
        3 => "otherhost".to_string(),
        n => (n as i32).to_string(),
    };
    let mut o = Out::default();
    o.not(inv != 0);
    o.push(format!("--pkt-type {name}"));
    Some(o.0)
}

/// A target as `-j NAME options` (the name iptables-save shows: `NOTRACK` for a CT target
/// made by `-j NOTRACK`).
pub(crate) fn target_text(family: Family, name: &str, rev: u8, d: &[u8]) -> String {
    let decoded = match (name, rev) {
        ("REJECT", 0) => reject(family, d),
        ("MARK", 2) => mark_target(d),
        ("CONNMARK", 1 | 2) => connmark(rev, d),
        ("SNAT" | "DNAT" | "MASQUERADE" | "REDIRECT", _) => nat(family, name, rev, d),
        ("LOG", 0) => log(d),
        ("NFLOG", 0) => nflog(d),
        ("CT", 0..=2) => ct(rev, d),
        ("TCPMSS", 0) => u16_at(d, 0).map(|mss| match mss {
            u16::MAX => "--clamp-mss-to-pmtu".to_string(),
            n => format!("--set-mss {n}"),
        }),
        _ if d.is_empty() => Some(String::new()),
        _ => None,
    };
    // `-j NOTRACK` is CT rev 2 flagged `XT_CT_NOTRACK_ALIAS` (libxt_CT's alias).
    let shown = if name == "CT" && rev == 2 && u16_at(d, 0).is_some_and(|f| f & 0x02 != 0) {
        "NOTRACK"
    } else {
        name
    };
    match decoded {
        Some(s) if s.is_empty() => format!("-j {shown}"),
        Some(s) => format!("-j {shown} {s}"),
        None => format!("-j {name} [rev {rev} {}]", digest(d)),
    }
}

/// `xt_mark_tginfo2` { u32 mark, mask }: every MARK option (`--set-mark`, `--or-mark`, ...)
/// is stored, and saved, as the one `--set-xmark`.
fn mark_target(d: &[u8]) -> Option<String> {
    Some(format!(
        "--set-xmark {:#x}/{:#x}",
        u32_at(d, 0)?,
        u32_at(d, 4)?
    ))
}

/// `ipt_reject_info` / `ip6t_reject_info` { enum with } (their codes differ).
fn reject(f: Family, d: &[u8]) -> Option<String> {
    let with = match (f, u32_at(d, 0)?) {
        (Family::Ipv4, 0) => "icmp-net-unreachable",
        (Family::Ipv4, 1) => "icmp-host-unreachable",
        (Family::Ipv4, 2) => "icmp-proto-unreachable",
        (Family::Ipv4, 3) => "icmp-port-unreachable",
        (Family::Ipv4, 5) => "icmp-net-prohibited",
        (Family::Ipv4, 6) => "icmp-host-prohibited",
        (Family::Ipv4, 7) => "tcp-reset",
        (Family::Ipv4, 8) => "icmp-admin-prohibited",
        (Family::Ipv6, 0) => "icmp6-no-route",
        (Family::Ipv6, 1) => "icmp6-adm-prohibited",
        (Family::Ipv6, 2) => "icmp6-not-neighbour",
        (Family::Ipv6, 3) => "icmp6-addr-unreachable",
        (Family::Ipv6, 4) => "icmp6-port-unreachable",
        (Family::Ipv6, 6) => "tcp-reset",
        (Family::Ipv6, 7) => "icmp6-policy-fail",
        (Family::Ipv6, 8) => "icmp6-reject-route",
        _ => return None,
    };
    Some(format!("--reject-with {with}"))
}

/// `xt_connmark_tginfo1` { u32 ctmark, ctmask, nfmask; u8 mode } and `_tginfo2` (u8
/// shift_dir, shift_bits, mode).
fn connmark(rev: u8, d: &[u8]) -> Option<String> {
    let (ctmark, ctmask, nfmask) = (u32_at(d, 0)?, u32_at(d, 4)?, u32_at(d, 8)?);
    let (mode, shift_dir, shift_bits) = if rev == 1 {
        (u8_at(d, 12)?, 0, 0)
    } else {
        (u8_at(d, 14)?, u8_at(d, 12)?, u8_at(d, 13)?)
    };
    let mut o = Out::default();
    match mode {
        0 => o.push(format!("--set-xmark {ctmark:#x}/{ctmask:#x}")),
        1 => o.push(format!(
            "--save-mark --nfmask {nfmask:#x} --ctmask {ctmask:#x}"
        )),
        2 => o.push(format!(
            "--restore-mark --nfmask {nfmask:#x} --ctmask {ctmask:#x}"
        )),
        _ => return None,
    }
    if shift_bits != 0 {
        let op = match shift_dir {
            0 => "left-shift-mark",
            1 => "right-shift-mark",
            _ => return None,
        };
        o.push(format!("--{op} {shift_bits}"));
    }
    Some(o.0)
}

/// The NAT targets, as `libxt_NAT.c`'s `__NAT_print` saves them. Layouts
/// (`linux/netfilter/nf_nat.h`): IPv4 rev 0 `nf_nat_ipv4_multi_range_compat` { u32
/// rangesize; { u32 flags; be32 min_ip, max_ip; be16 min, max } }; IPv6 (SNAT/DNAT rev 1,
/// MASQUERADE/REDIRECT rev 0) `nf_nat_range` { u32 flags; nf_inet_addr min, max; be16
/// min_proto, max_proto }; DNAT rev 2 `nf_nat_range2` (then be16 base_proto).
fn nat(f: Family, name: &str, rev: u8, d: &[u8]) -> Option<String> {
    struct Range {
        flags: u32,
        min: String,
        max: String,
        ports: (u16, u16, u16),
    }
    let r = match (f, rev) {
        (Family::Ipv4, 0) => Range {
            flags: u32_at(d, 4)?,
            min: v4_at(d, 8)?.to_string(),
            max: v4_at(d, 12)?.to_string(),
            ports: (be16_at(d, 16)?, be16_at(d, 18)?, 0),
        },
        (Family::Ipv6, 0 | 1) | (_, 2) => {
            if rev == 0 && matches!(name, "SNAT" | "DNAT") {
                return None;
            }
            Range {
                flags: u32_at(d, 0)?,
                min: addr_at(f, d, 4)?,
                max: addr_at(f, d, 20)?,
                ports: (
                    be16_at(d, 36)?,
                    be16_at(d, 38)?,
                    if rev == 2 { be16_at(d, 40)? } else { 0 },
                ),
            }
        }
        _ => return None,
    };
    const MAP_IPS: u32 = 1;
    const PROTO_SPECIFIED: u32 = 1 << 1;
    const RANDOM: u32 = 1 << 2;
    const PERSISTENT: u32 = 1 << 3;
    const RANDOM_FULLY: u32 = 1 << 4;
    const OFFSET: u32 = 1 << 5;
    // `sprint_range`: [min[-max]][:port[-port][/base]], IPv6 in brackets before a port.
    let brackets = f == Family::Ipv6 && r.flags & PROTO_SPECIFIED != 0;
    let mut range = String::new();
    if r.flags & MAP_IPS != 0 {
        if brackets {
            range.push('[');
        }
        range.push_str(&r.min);
        if r.min != r.max {
            let _ = write!(range, "-{}", r.max);
        }
        if brackets {
            range.push(']');
        }
    }
    if r.flags & PROTO_SPECIFIED != 0 {
        let _ = write!(range, ":{}", r.ports.0);
        if r.ports.1 != r.ports.0 {
            let _ = write!(range, "-{}", r.ports.1);
        }
        if r.flags & OFFSET != 0 {
            let _ = write!(range, "/{}", r.ports.2);
        }
    }
    let (opt, skip_colon) = match name {
        "SNAT" => ("--to-source", false),
        "DNAT" => ("--to-destination", false),
        _ => ("--to-ports", true),
    };
    let mut o = Out::default();
    if !range.is_empty() {
        let shown = if skip_colon {
            range.strip_prefix(':').unwrap_or(&range)
        } else {
            &range
        };
        o.push(format!("{opt} {shown}"));
    }
    for (bit, flag) in [
        (RANDOM, "--random"),
        (RANDOM_FULLY, "--random-fully"),
        (PERSISTENT, "--persistent"),
    ] {
        if r.flags & bit != 0 {
            o.push(flag);
        }
    }
    Some(o.0)
}

/// `xt_log_info` { u8 level, logflags; char prefix[30] }: the level when not the default
/// (4, warning), the flags `XT_LOG_*` 0x01..0x08 and 0x20.
fn log(d: &[u8]) -> Option<String> {
    let (level, flags) = (u8_at(d, 0)?, u8_at(d, 1)?);
    let prefix = name_at(d, 2, 30);
    let mut o = Out::default();
    if !prefix.is_empty() {
        o.push(format!("--log-prefix {}", save_string(&prefix)));
    }
    if level != 4 {
        o.push(format!("--log-level {level}"));
    }
    for (bit, opt) in [
        (0x01, "--log-tcp-sequence"),
        (0x02, "--log-tcp-options"),
        (0x04, "--log-ip-options"),
        (0x08, "--log-uid"),
        (0x20, "--log-macdecode"),
    ] {
        if flags & bit != 0 {
            o.push(opt);
        }
    }
    Some(o.0)
}

/// `xt_nflog_info` { u32 len; u16 group, threshold, flags, pad; char prefix[64] } (the
/// prefix runs to the end: iptables-nft reads nf_tables' longer ones into a longer buffer).
/// `XT_NFLOG_F_COPY_LEN` (0x1) says `len` is `--nflog-size`; the default threshold is 0.
fn nflog(d: &[u8]) -> Option<String> {
    let len = u32_at(d, 0)?;
    let (group, threshold, flags) = (u16_at(d, 4)?, u16_at(d, 6)?, u16_at(d, 8)?);
    let prefix = name_at(d, 12, d.len().checked_sub(12)?);
    let mut o = Out::default();
    if !prefix.is_empty() {
        o.push(format!("--nflog-prefix {}", save_string(&prefix)));
    }
    if group != 0 {
        o.push(format!("--nflog-group {group}"));
    }
    if flags & 0x1 != 0 {
        o.push(format!("--nflog-size {len}"));
    } else if len != 0 {
        o.push(format!("--nflog-range {len}"));
    }
    if threshold != 0 {
        o.push(format!("--nflog-threshold {threshold}"));
    }
    Some(o.0)
}

/// `xt_ct_target_info` { u16 flags, zone; u32 ct_events, exp_events; char helper[16] }
/// and `_v1` (then char timeout[32]). A NOTRACK alias saves nothing more.
fn ct(rev: u8, d: &[u8]) -> Option<String> {
    let (flags, zone) = (u16_at(d, 0)?, u16_at(d, 2)?);
    let (ct_events, exp_events) = (u32_at(d, 4)?, u32_at(d, 8)?);
    let mut o = Out::default();
    if flags & 0x02 != 0 {
        return Some(String::new());
    }
    if flags & 0x01 != 0 {
        o.push("--notrack");
    }
    let helper = name_at(d, 12, 16);
    if !helper.is_empty() {
        o.push(format!("--helper {helper}"));
    }
    if rev >= 1 {
        let timeout = name_at(d, 28, 32);
        if !timeout.is_empty() {
            o.push(format!("--timeout {timeout}"));
        }
    }
    // `IPCT_*` / `IPEXP_*` event bits, in libxt_CT's table order.
    let events = |m: u32, names: &[(u32, &str)]| -> String {
        let s: Vec<&str> = names
            .iter()
            .filter(|(b, _)| m & (1 << b) != 0)
            .map(|(_, n)| *n)
            .collect();
        s.join(",")
    };
    if ct_events != 0 {
        let names = [
            (0, "new"),
            (1, "related"),
            (2, "destroy"),
            (3, "reply"),
            (4, "assured"),
            (5, "protoinfo"),
            (6, "helper"),
            (7, "mark"),
            (8, "natseqinfo"),
            (9, "secmark"),
        ];
        o.push(format!("--ctevents {}", events(ct_events, &names)));
    }
    if exp_events != 0 {
        o.push(format!("--expevents {}", events(exp_events, &[(0, "new")])));
    }
    if flags & 0x10 != 0 || zone != 0 {
        let dir = match flags & 0x0c {
            0x04 => "-orig",
            0x08 => "-reply",
            _ => "",
        };
        if flags & 0x10 != 0 {
            o.push(format!("--zone{dir} mark"));
        } else {
            o.push(format!("--zone{dir} {zone}"));
        }
    }
    Some(o.0)
}

#[cfg(test)]
mod tests;
