//! Each decoder on hand-made bytes, laid out as the kernel's userspace headers say; the
//! expected words are what iptables-save 1.8.9 prints for the rule that makes those bytes.

use super::*;

/// Bytes built field by field, native order unless `be`.
#[derive(Default)]
struct B(Vec<u8>);

impl B {
    fn at(mut self, at: usize, b: &[u8]) -> Self {
        if self.0.len() < at + b.len() {
            self.0.resize(at + b.len(), 0);
        }
        self.0[at..at + b.len()].copy_from_slice(b);
        self
    }
    fn u8(self, at: usize, v: u8) -> Self {
        self.at(at, &[v])
    }
    fn u16(self, at: usize, v: u16) -> Self {
        self.at(at, &v.to_ne_bytes())
    }
    fn be16(self, at: usize, v: u16) -> Self {
        self.at(at, &v.to_be_bytes())
    }
    fn u32(self, at: usize, v: u32) -> Self {
        self.at(at, &v.to_ne_bytes())
    }
    fn ip(self, at: usize, a: [u8; 4]) -> Self {
        self.at(at, &a)
    }
    fn len(mut self, n: usize) -> Self {
        self.0.resize(n, 0);
        self
    }
    fn str(self, at: usize, s: &str) -> Self {
        self.at(at, s.as_bytes())
    }
}

fn m(name: &str, rev: u8, d: B) -> String {
    m_in(Family::Ipv4, name, rev, d)
}

fn m_in(f: Family, name: &str, rev: u8, d: B) -> String {
    let mut sets = |i: u16| (i == 3).then(|| "cali40all-ipam-pools".to_string());
    match_text(f, name, rev, &d.0, &mut sets)
}

fn t(name: &str, rev: u8, d: B) -> String {
    target_text(Family::Ipv4, name, rev, &d.0)
}

#[test]
fn comments_are_quoted_only_when_save_quotes_them() {
    let c = |s: &str| m("comment", 0, B::default().str(0, s).len(256));
    assert_eq!(c("plain-word_1"), "-m comment --comment plain-word_1");
    assert_eq!(
        c("default/web:http"),
        "-m comment --comment \"default/web:http\""
    );
    assert_eq!(
        c(r#"say "hi" it's \ok"#),
        r#"-m comment --comment "say \"hi\" it\'s \\ok""#
    );
}

#[test]
fn marks_print_the_mask_only_when_partial() {
    let d = |mark, mask, inv| B::default().u32(0, mark).u32(4, mask).u8(8, inv).len(12);
    assert_eq!(
        m("mark", 1, d(0x4000, 0x4000, 1)),
        "-m mark ! --mark 0x4000/0x4000"
    );
    assert_eq!(m("mark", 1, d(0x1, u32::MAX, 0)), "-m mark --mark 0x1");
    assert_eq!(
        m("connmark", 1, d(0, 0xff, 0)),
        "-m connmark --mark 0x0/0xff"
    );
}

#[test]
fn tcp_ports_flags_and_udp() {
    let tcp = |sp: (u16, u16), dp: (u16, u16), mask, cmp, inv| {
        B::default()
            .u16(0, sp.0)
            .u16(2, sp.1)
            .u16(4, dp.0)
            .u16(6, dp.1)
            .u8(9, mask)
            .u8(10, cmp)
            .u8(11, inv)
    };
    assert_eq!(
        m("tcp", 0, tcp((0, 65535), (80, 80), 0, 0, 0)),
        "-m tcp --dport 80"
    );
    // `--syn`.
    assert_eq!(
        m("tcp", 0, tcp((0, 65535), (0, 65535), 0x17, 0x02, 0)),
        "-m tcp --tcp-flags FIN,SYN,RST,ACK SYN"
    );
    assert_eq!(
        m("tcp", 0, tcp((1024, 65535), (0, 65535), 0x3f, 0, 0x05)),
        "-m tcp ! --sport 1024:65535 ! --tcp-flags FIN,SYN,RST,PSH,ACK,URG NONE"
    );
    assert_eq!(m("tcp", 0, tcp((0, 65535), (0, 65535), 0, 0, 0)), "-m tcp");
    let udp = B::default()
        .u16(0, 53)
        .u16(2, 53)
        .u16(4, 0)
        .u16(6, 65535)
        .u8(8, 0x01)
        .len(12);
    assert_eq!(m("udp", 0, udp), "-m udp ! --sport 53");
}

#[test]
fn icmp_types_as_save_prints_them() {
    let d = |ty, lo, hi, inv| B::default().at(0, &[ty, lo, hi, inv]);
    assert_eq!(m("icmp", 0, d(8, 0, 255, 0)), "-m icmp --icmp-type 8");
    assert_eq!(m("icmp", 0, d(3, 4, 4, 0)), "-m icmp --icmp-type 3/4");
    assert_eq!(m("icmp", 0, d(255, 0, 255, 1)), "-m icmp ! --icmp-type any");
    assert_eq!(
        m_in(Family::Ipv6, "icmp6", 0, d(128, 0, 255, 0)),
        "-m icmp6 --icmpv6-type 128"
    );
}

/// An `xt_conntrack_mtinfo3`.
fn ct3(flags: u16, inv: u16, state: u16, status: u16) -> B {
    B::default()
        .u16(146, flags)
        .u16(148, inv)
        .u16(150, state)
        .u16(152, status)
        .len(168)
}

#[test]
fn conntrack_states_statuses_addresses_and_the_state_alias() {
    assert_eq!(
        m("conntrack", 3, ct3(1, 0, 1, 0)),
        "-m conntrack --ctstate INVALID"
    );
    assert_eq!(
        m("conntrack", 3, ct3(1, 1, (1 << 2) | (1 << 1), 0)),
        "-m conntrack ! --ctstate RELATED,ESTABLISHED"
    );
    assert_eq!(
        m("conntrack", 3, ct3(1, 0, (1 << 3) | (1 << 7), 0)),
        "-m conntrack --ctstate NEW,DNAT"
    );
    // `-m state --state NEW` is a conntrack match with XT_CONNTRACK_STATE_ALIAS.
    assert_eq!(
        m("conntrack", 3, ct3(1 | (1 << 13), 0, 1 << 3, 0)),
        "-m state --state NEW"
    );
    assert_eq!(
        m("conntrack", 3, ct3(1 << 6, 1 << 6, 0, 4)),
        "-m conntrack ! --ctstatus ASSURED"
    );
    // --ctorigdst 10.96.0.0/12 --ctorigdstport 80:90 --ctdir REPLY (rev 3: host-order ports).
    let d = ct3((1 << 3) | (1 << 9) | (1 << 12), 1 << 12, 0, 0)
        .ip(32, [10, 96, 0, 0])
        .ip(48, [255, 240, 0, 0])
        .u16(140, 80)
        .u16(156, 90);
    assert_eq!(
        m("conntrack", 3, d),
        "-m conntrack --ctorigdst 10.96.0.0/12 --ctorigdstport 80:90 --ctdir REPLY"
    );
    // Rev 1: u8 masks, `__be16` ports; a host mask prints no suffix.
    let d = B::default()
        .u16(146, (1 << 2) | (1 << 8))
        .ip(0, [192, 168, 1, 1])
        .ip(16, [255, 255, 255, 255])
        .be16(138, 5353)
        .len(152);
    assert_eq!(
        m("conntrack", 1, d),
        "-m conntrack --ctorigsrc 192.168.1.1 --ctorigsrcport 5353"
    );
    // Rev 2, the protocol and expiry.
    let d = B::default()
        .u16(146, (1 << 1) | (1 << 7))
        .u16(136, 17)
        .u32(128, 10)
        .u32(132, 20)
        .len(160);
    assert_eq!(
        m("conntrack", 2, d),
        "-m conntrack --ctproto 17 --ctexpire 10:20"
    );
    // Cut short: a digest, not a guess.
    assert!(m("conntrack", 3, B::default().len(100)).starts_with("-m conntrack [rev 3 "));
    // The old state match (rev 0): `xt_state_info` { u32 statemask }.
    assert_eq!(
        m("state", 0, B::default().u32(0, (1 << 2) | (1 << 1))),
        "-m state --state RELATED,ESTABLISHED"
    );
}

#[test]
fn statistic_probability_exactly_as_printf_rounds_it() {
    let random = |p: u32| m("statistic", 0, B::default().u16(0, 0).u32(4, p).len(24));
    // kube-proxy's 1/3: iptables-restore stored lround(0.33333333349 * 2^31).
    let p = (0.333_333_333_49_f64 * 2_147_483_648.0).round() as u32;
    assert_eq!(
        random(p),
        "-m statistic --mode random --probability 0.33333333349"
    );
    assert_eq!(
        random(1 << 30),
        "-m statistic --mode random --probability 0.50000000000"
    );
    assert_eq!(
        random(u32::MAX),
        "-m statistic --mode random --probability 1.99999999953"
    );
    assert_eq!(probability(0x8000_0000), "1.00000000000");
    assert_eq!(probability(0x7fff_ffff), "0.99999999953");
    let nth = B::default().u16(0, 1).u16(2, 1).u32(4, 2).u32(8, 1).len(24);
    assert_eq!(
        m("statistic", 0, nth),
        "-m statistic --mode nth ! --every 3 --packet 1"
    );
}

#[test]
fn addrtype_both_revisions() {
    let v1 = B::default().u16(0, 0).u16(2, 1 << 2).u32(4, 0);
    assert_eq!(m("addrtype", 1, v1), "-m addrtype --dst-type LOCAL");
    let v1 = B::default()
        .u16(0, 1 << 2)
        .u16(2, (1 << 3) | (1 << 5))
        .u32(4, 0x2 | 0x4);
    assert_eq!(
        m("addrtype", 1, v1),
        "-m addrtype --src-type LOCAL ! --dst-type BROADCAST,MULTICAST --limit-iface-in"
    );
    let v0 = B::default().u16(0, 1 << 2).u16(2, 0).u32(4, 1).u32(8, 0);
    assert_eq!(m("addrtype", 0, v0), "-m addrtype ! --src-type LOCAL");
}

#[test]
fn multiport_lists_ranges_and_negation() {
    let v1 = B::default()
        .u8(0, 1)
        .u8(1, 4)
        .u16(2, 80)
        .u16(4, 443)
        .u16(6, 8000)
        .u16(8, 8080)
        .u8(32 + 2, 1)
        .u8(47, 1);
    assert_eq!(
        m("multiport", 1, v1),
        "-m multiport ! --dports 80,443,8000:8080"
    );
    let v0 = B::default()
        .u8(0, 0)
        .u8(1, 2)
        .u16(2, 22)
        .u16(4, 2222)
        .len(32);
    assert_eq!(m("multiport", 0, v0), "-m multiport --sports 22,2222");
}

#[test]
fn limit_rates_as_print_rate_words_them() {
    let l = |avg, burst| m("limit", 0, B::default().u32(0, avg).u32(4, burst).len(32));
    assert_eq!(l(10_000 / 5, 5), "-m limit --limit 5/sec");
    assert_eq!(
        l(10_000 * 60 / 3, 10),
        "-m limit --limit 3/min --limit-burst 10"
    );
    assert_eq!(l(10_000 * 3600 / 3, 5), "-m limit --limit 3/hour");
    assert_eq!(l(10_000 * 86_400 / 2, 5), "-m limit --limit 2/day");
    assert_eq!(l(0, 5), "-m limit --limit inf");
}

#[test]
fn iprange_both_revisions_and_families() {
    let v1 = B::default()
        .ip(0, [10, 0, 0, 1])
        .ip(16, [10, 0, 0, 9])
        .ip(32, [192, 168, 0, 1])
        .ip(48, [192, 168, 0, 2])
        .u8(64, 1 | 2 | 0x20)
        .len(68);
    assert_eq!(
        m("iprange", 1, v1),
        "-m iprange --src-range 10.0.0.1-10.0.0.9 ! --dst-range 192.168.0.1-192.168.0.2"
    );
    let v6 = B::default()
        .at(0, &"fd00::1".parse::<Ipv6Addr>().unwrap().octets())
        .at(16, &"fd00::ff".parse::<Ipv6Addr>().unwrap().octets())
        .u8(64, 1)
        .len(68);
    assert_eq!(
        m_in(Family::Ipv6, "iprange", 1, v6),
        "-m iprange --src-range fd00::1-fd00::ff"
    );
    let v0 = B::default()
        .ip(8, [1, 2, 3, 4])
        .ip(12, [1, 2, 3, 5])
        .u8(16, 2)
        .len(20);
    assert_eq!(
        m("iprange", 0, v0),
        "-m iprange --dst-range 1.2.3.4-1.2.3.5"
    );
}

#[test]
fn sets_are_named_by_the_kernel_or_digested() {
    // Rev 4: index 3, two dimensions (src,dst), inverted; flags 0 at 40.
    let d = B::default().u16(0, 3).u8(2, 2).u8(3, 0x01 | 0x02).len(48);
    assert_eq!(
        m("set", 4, d),
        "-m set ! --match-set cali40all-ipam-pools src,dst"
    );
    let d = B::default()
        .u16(0, 3)
        .u8(2, 1)
        .u8(3, 0)
        .u32(40, 0x80)
        .len(48);
    assert_eq!(
        m("set", 3, d),
        "-m set --match-set cali40all-ipam-pools dst --return-nomatch"
    );
    // A set the kernel does not name: a digest, as the save has no name to print either.
    let d = B::default().u16(0, 9).u8(2, 1).u8(3, 2).len(48);
    assert!(m("set", 4, d).starts_with("-m set [rev 4 "));
}

#[test]
fn physdev_recent_pkttype() {
    let d = B::default().str(0, "eth0").u8(64, 0x04).u8(65, 0x01 | 0x04);
    assert_eq!(
        m("physdev", 0, d.len(68)),
        "-m physdev --physdev-in eth0 ! --physdev-is-bridged"
    );
    let r = B::default()
        .u32(0, 60)
        .u32(4, 4)
        .u8(8, 0x04 | 0x10)
        .str(10, "SSH")
        .u8(210, 0)
        .ip(212, [255, 255, 255, 255])
        .len(228);
    assert_eq!(
        m("recent", 1, r),
        "-m recent --update --seconds 60 --hitcount 4 --rttl --name SSH --mask 255.255.255.255 --rsource"
    );
    let p = B::default().u32(0, 1).u32(4, 1);
    assert_eq!(m("pkttype", 0, p), "-m pkttype ! --pkt-type broadcast");
}

#[test]
fn unknown_matches_keep_a_digest() {
    let a = m("u32", 0, B::default().u32(0, 1));
    let b = m("u32", 0, B::default().u32(0, 2));
    assert!(a.starts_with("-m u32 [rev 0 ") && a != b, "{a} {b}");
    assert_eq!(
        m("conntrack", 9, B::default().len(8)).split(' ').nth(2),
        Some("[rev")
    );
}

/// An `nf_nat_ipv4_multi_range_compat`.
fn mrc(flags: u32, min: [u8; 4], max: [u8; 4], p: (u16, u16)) -> B {
    B::default()
        .u32(0, 1)
        .u32(4, flags)
        .ip(8, min)
        .ip(12, max)
        .be16(16, p.0)
        .be16(18, p.1)
        .len(24)
}

/// An `nf_nat_range2` for IPv4.
fn range2(flags: u32, min: [u8; 4], max: [u8; 4], p: (u16, u16, u16)) -> B {
    B::default()
        .u32(0, flags)
        .ip(4, min)
        .ip(20, max)
        .be16(36, p.0)
        .be16(38, p.1)
        .be16(40, p.2)
        .len(48)
}

#[test]
fn nat_targets() {
    let ip = [10, 244, 1, 5];
    assert_eq!(
        t("DNAT", 2, range2(0x3, ip, ip, (8080, 8080, 0))),
        "-j DNAT --to-destination 10.244.1.5:8080"
    );
    assert_eq!(
        t(
            "DNAT",
            2,
            range2(0x1 | 0x4 | 0x8, ip, [10, 244, 1, 9], (0, 0, 0))
        ),
        "-j DNAT --to-destination 10.244.1.5-10.244.1.9 --random --persistent"
    );
    assert_eq!(
        t(
            "DNAT",
            2,
            range2(0x2 | 0x20, [0; 4], [0; 4], (1000, 2000, 3000))
        ),
        "-j DNAT --to-destination :1000-2000/3000"
    );
    assert_eq!(
        t("DNAT", 0, mrc(0x3, ip, ip, (80, 80))),
        "-j DNAT --to-destination 10.244.1.5:80"
    );
    assert_eq!(
        t(
            "SNAT",
            0,
            mrc(0x1 | 0x10, [192, 0, 2, 1], [192, 0, 2, 1], (0, 0))
        ),
        "-j SNAT --to-source 192.0.2.1 --random-fully"
    );
    assert_eq!(
        t("MASQUERADE", 0, mrc(0x10, [0; 4], [0; 4], (0, 0))),
        "-j MASQUERADE --random-fully"
    );
    assert_eq!(
        t(
            "MASQUERADE",
            0,
            mrc(0x2 | 0x4, [0; 4], [0; 4], (1024, 2048))
        ),
        "-j MASQUERADE --to-ports 1024-2048 --random"
    );
    assert_eq!(
        t("MASQUERADE", 0, mrc(0, [0; 4], [0; 4], (0, 0))),
        "-j MASQUERADE"
    );
    assert_eq!(
        t("REDIRECT", 0, mrc(0x2, [0; 4], [0; 4], (15001, 15001))),
        "-j REDIRECT --to-ports 15001"
    );
    // IPv6 DNAT rev 1 (`nf_nat_range`): the address in brackets before a port.
    let a: Ipv6Addr = "fd00::5".parse().unwrap();
    let d = B::default()
        .u32(0, 0x3)
        .at(4, &a.octets())
        .at(20, &a.octets())
        .be16(36, 8080)
        .be16(38, 8080)
        .len(40);
    assert_eq!(
        target_text(Family::Ipv6, "DNAT", 1, &d.0),
        "-j DNAT --to-destination [fd00::5]:8080"
    );
}

#[test]
fn mark_connmark_log_reject_ct_tcpmss() {
    assert_eq!(
        t("MARK", 2, B::default().u32(0, 0x4000).u32(4, 0x4000)),
        "-j MARK --set-xmark 0x4000/0x4000"
    );
    assert_eq!(
        t("MARK", 2, B::default().u32(0, 0).u32(4, 0x4000)),
        "-j MARK --set-xmark 0x0/0x4000"
    );
    let cm = |mode| {
        B::default()
            .u32(0, 0x1)
            .u32(4, 0xff)
            .u32(8, 0xffff_ffff)
            .u8(12, mode)
            .len(16)
    };
    assert_eq!(t("CONNMARK", 1, cm(0)), "-j CONNMARK --set-xmark 0x1/0xff");
    assert_eq!(
        t("CONNMARK", 1, cm(1)),
        "-j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xff"
    );
    let cm2 = B::default()
        .u32(4, 0xff)
        .u32(8, 0xff)
        .u8(12, 0)
        .u8(13, 8)
        .u8(14, 2)
        .len(16);
    assert_eq!(
        t("CONNMARK", 2, cm2),
        "-j CONNMARK --restore-mark --nfmask 0xff --ctmask 0xff --left-shift-mark 8"
    );
    let log = |level, flags, prefix: &str| {
        B::default()
            .u8(0, level)
            .u8(1, flags)
            .str(2, prefix)
            .len(32)
    };
    assert_eq!(
        t("LOG", 0, log(4, 0, "DROP: ")),
        "-j LOG --log-prefix \"DROP: \""
    );
    assert_eq!(
        t("LOG", 0, log(6, 0x08 | 0x01, "fw")),
        "-j LOG --log-prefix fw --log-level 6 --log-tcp-sequence --log-uid"
    );
    assert_eq!(t("LOG", 0, log(4, 0, "")), "-j LOG");
    // NFLOG: `--nflog-group 5 --nflog-prefix hi`; `--nflog-prefix "a b" --nflog-size 100
    // --nflog-threshold 3`; `--nflog-range 50` (no flag); none at all.
    let nflog = |len, group, threshold, flags, prefix: &str| {
        B::default()
            .u32(0, len)
            .u16(4, group)
            .u16(6, threshold)
            .u16(8, flags)
            .str(12, prefix)
            .len(76)
    };
    assert_eq!(
        t("NFLOG", 0, nflog(0, 5, 0, 0, "hi")),
        "-j NFLOG --nflog-prefix hi --nflog-group 5"
    );
    assert_eq!(
        t("NFLOG", 0, nflog(100, 0, 3, 1, "a b")),
        "-j NFLOG --nflog-prefix \"a b\" --nflog-size 100 --nflog-threshold 3"
    );
    assert_eq!(
        t("NFLOG", 0, nflog(50, 0, 0, 0, "")),
        "-j NFLOG --nflog-range 50"
    );
    assert_eq!(t("NFLOG", 0, nflog(0, 0, 0, 0, "")), "-j NFLOG");
    assert_eq!(
        t("REJECT", 0, B::default().u32(0, 3)),
        "-j REJECT --reject-with icmp-port-unreachable"
    );
    assert_eq!(
        target_text(Family::Ipv6, "REJECT", 0, &B::default().u32(0, 6).0),
        "-j REJECT --reject-with tcp-reset"
    );
    // `-j CT --notrack` (rev 2), `-j NOTRACK` (rev 2, the alias), a helper and a zone.
    let ct = |flags, zone, helper: &str| {
        B::default()
            .u16(0, flags)
            .u16(2, zone)
            .str(12, helper)
            .len(64)
    };
    assert_eq!(t("CT", 2, ct(0x1, 0, "")), "-j CT --notrack");
    assert_eq!(t("CT", 2, ct(0x1 | 0x2, 0, "")), "-j NOTRACK");
    assert_eq!(
        t("CT", 2, ct(0x4, 5, "ftp")),
        "-j CT --helper ftp --zone-orig 5"
    );
    assert_eq!(
        t("TCPMSS", 0, B::default().u16(0, 0xffff).len(8)),
        "-j TCPMSS --clamp-mss-to-pmtu"
    );
    assert_eq!(
        t("TCPMSS", 0, B::default().u16(0, 1400).len(8)),
        "-j TCPMSS --set-mss 1400"
    );
    // No data: the name alone; data not decoded: a digest.
    assert_eq!(t("ACCEPT", 0, B::default()), "-j ACCEPT");
    assert!(t("NFQUEUE", 3, B::default().u32(0, 7)).starts_with("-j NFQUEUE [rev 3 "));
}

#[test]
fn masks_and_strings() {
    assert_eq!(prefix_len(0), Some(0));
    assert_eq!(prefix_len(u128::MAX), Some(128));
    assert_eq!(prefix_len(0xffff_ff00u128 << 96), Some(24));
    assert_eq!(prefix_len(0xff00_ff00u128 << 96), None);
    assert_eq!(save_string("a b"), "\"a b\"");
    assert_eq!(save_string(""), "\"\"");
}
