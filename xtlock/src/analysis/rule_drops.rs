//! The rule behind each netfilter drop. Pure, like the rest of the analysis.
//!
//! What comes in: the source's reads of the dropping rules' counters (`RuleCounters`: the
//! kernel's own per-rule counts, read after each write and once a second at most while
//! netfilter drops packets in a namespace), and the sampled drops (`Drop`) of the same
//! namespace. Each rule that moved is a [`RuleDropsFact`]: how much it dropped (exact: its
//! counter), over which interval, whose rule it is and which write added it (from the rule
//! tracker), where its packets went and during which hold (from the samples).
//!
//! Samples are matched to rules only where that is sure: with one rule moving in the
//! interval, its samples are all of the namespace's netfilter drops; with several, a sample
//! goes to the one rule whose stated addresses, protocol and ports it fits, and to none when
//! it fits several (said, not guessed: `others` tells how many rules shared the interval).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::IpAddr;

use serde::Serialize;

use super::drops::packet_info;
use super::facts::{DropDest, HoldRef, Output, RuleDropsFact, UncountedDropsFact};
use super::rules::RuleTracker;
use crate::event::{DropSample, RuleCounters};

/// Netfilter drop samples kept for the counter reads that follow them.
const MAX_SAMPLES: usize = 8192;
/// Samples older than this behind the newest counters are of no read to come.
const SAMPLE_KEEP_NS: u64 = 30_000_000_000;
/// Rules the summary ranks; the rest are counted together.
const MAX_RULES: usize = 4096;
/// Rules the summary lists.
pub const TOP_RULES: usize = 10;

/// One rule's drops, all intervals together, in the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RuleDropRow {
    pub netns: u32,
    pub family: String,
    pub table: String,
    pub chain: String,
    pub rule: String,
    pub packets: u64,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain_owner: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub added: Option<super::facts::RuleAdded>,
    pub first_ns: u64,
    pub last_ns: u64,
}

/// The `rule_drops` block of the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RuleDropSummary {
    /// Packets all dropping rules dropped, counted by their counters.
    pub packets: u64,
    /// Rules that dropped.
    pub rules: u64,
    /// The rules that dropped most, most first (at most [`TOP_RULES`]).
    pub top: Vec<RuleDropRow>,
    /// Packets of rules past the summary's bound, counted together.
    #[serde(skip_serializing_if = "is_zero")]
    pub other_packets: u64,
    /// Dropping rules without a counter, where netfilter dropped packets: `family table CHAIN:
    /// rule`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub uncounted: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl RuleDropSummary {
    pub fn is_empty(&self) -> bool {
        self.packets == 0 && self.uncounted.is_empty()
    }
}

type RowKey = (u32, String, String, String, String);

#[derive(Debug, Default)]
pub struct RuleDropTracker {
    /// The reason code of netfilter's drops (`None`: the kernel has none, any may be).
    nf_reason: Option<Option<u32>>,
    /// Recent netfilter drop samples, with the hold open at their time, oldest first.
    samples: VecDeque<(DropSample, Option<HoldRef>)>,
    rows: HashMap<RowKey, RuleDropRow>,
    other_packets: u64,
    uncounted_said: HashSet<(u32, String, String)>,
    uncounted: Vec<String>,
    /// Drop locations in `nf_hook_slow` (kernels without drop reasons).
    nf_locations: HashSet<u64>,
}

impl RuleDropTracker {
    /// The recording kernel's drop-reason names.
    pub fn on_setup(&mut self, has_reason: bool, names: &[(u32, String)]) {
        let nf = names
            .iter()
            .find(|(_, n)| n == "NETFILTER_DROP")
            .map(|(c, _)| *c);
        self.nf_reason = Some(if has_reason {
            nf.or(Some(u32::MAX))
        } else {
            None
        });
    }

    /// The kernel function a drop location is in: netfilter's verdicts are freed in
    /// `nf_hook_slow`, which names them on a kernel without drop reasons.
    pub fn on_symbol(&mut self, addr: u64, name: &str) {
        if name == "nf_hook_slow" && self.nf_locations.len() < 64 {
            self.nf_locations.insert(addr);
        }
    }

    /// A sampled drop, with the hold open at its time: kept when netfilter dropped it.
    pub fn on_sample(&mut self, s: &DropSample, hold: Option<HoldRef>) {
        let netfilter = match self.nf_reason {
            Some(Some(code)) => s.reason == code,
            // No reasons from this kernel: where it was freed tells (see `on_counters`: a
            // location's name comes with the counts, after its first samples); no setup
            // (an older capture): every sample may be a rule's.
            _ => true,
        };
        if !netfilter || s.daddr.is_none() {
            return;
        }
        if self.samples.len() >= MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((*s, hold));
    }

    /// A read of a table's counters: a fact per rule that dropped.
    pub fn on_counters(
        &mut self,
        c: &RuleCounters,
        rules: &RuleTracker,
        out: &mut impl FnMut(Output),
    ) {
        let cutoff = c.ts_ns.saturating_sub(SAMPLE_KEEP_NS);
        while self.samples.front().is_some_and(|(s, _)| s.ts_ns < cutoff) {
            self.samples.pop_front();
        }
        if !c.uncounted.is_empty()
            && self.uncounted_said.len() < 4096
            && self
                .uncounted_said
                .insert((c.netns, c.family.clone(), c.table.clone()))
        {
            for u in &c.uncounted {
                if self.uncounted.len() < 16 {
                    self.uncounted.push(format!("{} {} {u}", c.family, c.table));
                }
            }
            out(Output::UncountedDrops(UncountedDropsFact {
                ts_ns: c.ts_ns,
                netns: c.netns,
                family: c.family.clone(),
                table: c.table.clone(),
                rules: c.uncounted.clone(),
            }));
        }
        if c.rules.is_empty() {
            return;
        }
        // The interval's samples of this namespace, each given to the one rule it fits.
        let mut mine: Vec<Vec<usize>> = vec![Vec::new(); c.rules.len()];
        // Without drop reasons, a sample is netfilter's when freed in `nf_hook_slow` (an IPv6
        // stack's own drop is not a rule's).
        let no_reasons = self.nf_reason == Some(None);
        let in_interval = |s: &DropSample| {
            s.ts_ns > c.since_ns
                && s.ts_ns <= c.ts_ns
                && (s.netns == c.netns || s.netns == 0)
                && (!no_reasons || self.nf_locations.contains(&s.location))
        };
        for (i, (s, _)) in self.samples.iter().enumerate() {
            if !in_interval(s) {
                continue;
            }
            let mut fits = c
                .rules
                .iter()
                .enumerate()
                .filter(|(_, r)| may_match(&r.rule, s));
            if let (Some((j, _)), None) = (fits.next(), fits.next()) {
                mine[j].push(i);
            }
        }
        let others = c.rules.len() as u32 - 1;
        for (r, picked) in c.rules.iter().zip(mine) {
            let (owner, chain_owner, added) =
                rules.rule_origin(c.netns, &c.family, &c.table, &r.chain, &r.rule);
            let mut dests: BTreeMap<(String, String), u64> = BTreeMap::new();
            let mut holds: Vec<(HoldRef, u64)> = Vec::new();
            for &i in &picked {
                let (s, hold) = &self.samples[i];
                if let Some(p) = packet_info(s) {
                    let dest = match (p.dport, s.daddr) {
                        (Some(port), Some(IpAddr::V6(a))) => format!("[{a}]:{port}"),
                        (Some(port), _) => format!("{}:{port}", p.daddr),
                        (None, _) => p.daddr.clone(),
                    };
                    *dests.entry((p.proto, dest)).or_default() += 1;
                }
                if let Some(h) = hold {
                    match holds
                        .iter_mut()
                        .find(|(o, _)| o.start_ns == h.start_ns && o.lock == h.lock)
                    {
                        Some((_, n)) => *n += 1,
                        None => holds.push((h.clone(), 1)),
                    }
                }
            }
            let mut dests: Vec<DropDest> = dests
                .into_iter()
                .map(|((proto, dest), samples)| DropDest {
                    proto,
                    dest,
                    samples,
                })
                .collect();
            dests.sort_by(|a, b| b.samples.cmp(&a.samples).then(a.dest.cmp(&b.dest)));
            dests.truncate(5);
            // The hold most of its samples fell in.
            holds.sort_by_key(|h| std::cmp::Reverse(h.1));
            let hold = holds
                .into_iter()
                .next()
                .filter(|(_, n)| 2 * n > picked.len() as u64)
                .map(|(h, _)| h);
            self.count(c, r, &owner, &chain_owner, &added);
            out(Output::RuleDrops(RuleDropsFact {
                ts_ns: c.ts_ns,
                since_ns: c.since_ns,
                netns: c.netns,
                family: c.family.clone(),
                table: c.table.clone(),
                chain: r.chain.clone(),
                rule: r.rule.clone(),
                packets: r.packets,
                bytes: r.bytes,
                reset: r.reset,
                owner,
                chain_owner,
                added,
                dests,
                hold,
                others,
            }));
        }
    }

    fn count(
        &mut self,
        c: &RuleCounters,
        r: &crate::event::RuleCount,
        owner: &Option<String>,
        chain_owner: &Option<String>,
        added: &Option<super::facts::RuleAdded>,
    ) {
        let key: RowKey = (
            c.netns,
            c.family.clone(),
            c.table.clone(),
            r.chain.clone(),
            r.rule.clone(),
        );
        if !self.rows.contains_key(&key) && self.rows.len() >= MAX_RULES {
            self.other_packets += r.packets;
            return;
        }
        let row = self.rows.entry(key).or_insert_with(|| RuleDropRow {
            netns: c.netns,
            family: c.family.clone(),
            table: c.table.clone(),
            chain: r.chain.clone(),
            rule: r.rule.clone(),
            first_ns: c.since_ns,
            ..Default::default()
        });
        row.packets += r.packets;
        row.bytes += r.bytes;
        row.last_ns = c.ts_ns;
        row.owner.clone_from(owner);
        row.chain_owner.clone_from(chain_owner);
        row.added.clone_from(added);
    }

    pub fn summary(&self) -> RuleDropSummary {
        let mut top: Vec<RuleDropRow> = self.rows.values().cloned().collect();
        top.sort_by(|a, b| {
            b.packets
                .cmp(&a.packets)
                .then_with(|| (&a.table, &a.chain, &a.rule).cmp(&(&b.table, &b.chain, &b.rule)))
        });
        let packets = top.iter().map(|r| r.packets).sum::<u64>() + self.other_packets;
        let rules = top.len() as u64;
        top.truncate(TOP_RULES);
        RuleDropSummary {
            packets,
            rules,
            top,
            other_packets: self.other_packets,
            uncounted: self.uncounted.clone(),
        }
    }
}

/// Whether sample `s` may have been dropped by `rule`: false only when the rule states an
/// address, protocol or port the packet does not have (negations and matches xtlock does not
/// check never rule a packet out).
pub fn may_match(rule: &str, s: &DropSample) -> bool {
    let words: Vec<&str> = rule.split(' ').collect();
    let mut i = 0;
    while i < words.len() {
        let negated = i > 0 && words[i - 1] == "!";
        let prev = i.checked_sub(1).map_or("", |p| words[p]);
        let next = words.get(i + 1).copied().unwrap_or("");
        let ok = match words[i] {
            // iptables' words, and nft's (`ip daddr 10.0.0.1`, `udp dport 53`,
            // `meta l4proto udp`, `ip protocol tcp`, `ip6 nexthdr udp`).
            "-d" | "daddr" => in_net(next, s.daddr),
            "-s" | "saddr" => in_net(next, s.saddr),
            "-p" | "l4proto" | "protocol" | "nexthdr" => proto_is(next, s.l4proto),
            // nft names the protocol a port belongs to: `udp dport 53` is UDP's.
            "dport" | "sport" if !proto_is(prev, s.l4proto) => false,
            "--dport" | "--dports" | "dport" => in_ports(next, s.dport, s.l4proto),
            "--sport" | "--sports" | "sport" => in_ports(next, s.sport, s.l4proto),
            _ => true,
        };
        if !ok && !negated {
            return false;
        }
        i += 1;
    }
    true
}

fn in_net(net: &str, addr: Option<IpAddr>) -> bool {
    let Some(addr) = addr else { return true };
    let (a, len) = match net.split_once('/') {
        Some((a, l)) => (a, l.parse::<u32>().ok()),
        None => (net, None),
    };
    match (a.parse::<IpAddr>(), addr) {
        (Ok(IpAddr::V4(n)), IpAddr::V4(a)) => {
            let len = len.unwrap_or(32).min(32);
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        (Ok(IpAddr::V6(n)), IpAddr::V6(a)) => {
            let len = len.unwrap_or(128).min(128);
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            u128::from(n) & mask == u128::from(a) & mask
        }
        (Ok(_), _) => false,
        // Not an address (a set, a name): not checked.
        (Err(_), _) => true,
    }
}

fn proto_is(p: &str, l4: u8) -> bool {
    use super::drops::{ICMP, ICMPV6, TCP, UDP};
    let want = match p {
        "tcp" => TCP,
        "udp" => UDP,
        "icmp" => ICMP,
        "ipv6-icmp" | "icmpv6" => ICMPV6,
        "sctp" => SCTP,
        other => match other.parse::<u8>() {
            Ok(n) => n,
            Err(_) => return true,
        },
    };
    l4 == 0 || l4 == want
}

const SCTP: u8 = libc::IPPROTO_SCTP as u8;

fn in_ports(spec: &str, port: u16, l4: u8) -> bool {
    use super::drops::{TCP, UDP};
    if !matches!(l4, TCP | UDP | SCTP) {
        return true;
    }
    spec.split(',').any(|p| match p.split_once(':') {
        Some((lo, hi)) => match (lo.parse::<u16>(), hi.parse::<u16>()) {
            (Ok(lo), Ok(hi)) => (lo..=hi).contains(&port),
            _ => true,
        },
        None => p.parse::<u16>().map_or(true, |n| n == port),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn sample(daddr: [u8; 4], l4: u8, dport: u16) -> DropSample {
        DropSample {
            ts_ns: 10,
            tgid: 0,
            tid: 0,
            location: 0,
            netns: 7,
            ifindex: 0,
            reason: 12,
            ethertype: 0x0800,
            l4proto: l4,
            saddr: Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))),
            daddr: Some(IpAddr::V4(Ipv4Addr::from(daddr))),
            sport: 40000,
            dport,
        }
    }

    #[test]
    fn a_sample_fits_a_rule_by_what_the_rule_states() {
        let s = sample([10, 96, 0, 15], 17, 80);
        assert!(may_match("-m mark --mark 0x8000/0x8000 -j DROP", &s));
        assert!(may_match(
            "-d 10.96.0.0/16 -p udp -m udp --dport 80 -j DROP",
            &s
        ));
        assert!(!may_match("-d 10.97.0.0/16 -j DROP", &s));
        assert!(!may_match("-p tcp -m tcp --dport 80 -j DROP", &s));
        assert!(!may_match("-p udp -m udp --dport 81 -j DROP", &s));
        assert!(may_match(
            "-p udp -m multiport --dports 70:90,443 -j DROP",
            &s
        ));
        // A negation never rules a packet out.
        assert!(may_match("! -d 10.96.0.15/32 -j DROP", &s));
        // nft's words name the protocol: a UDP rule is not an ICMPv6 packet's.
        let nft = "meta l4proto udp udp dport 80 -j DROP";
        assert!(may_match(nft, &s));
        let mut icmp6 = s;
        icmp6.l4proto = 58;
        icmp6.daddr = Some("ff02::2".parse().unwrap());
        assert!(!may_match(nft, &icmp6));
        assert!(!may_match("udp dport 80 -j DROP", &icmp6));
        assert!(!may_match("-p udp -m udp --dport 80 -j DROP", &icmp6));
    }

    /// On a kernel without drop reasons, only samples freed in `nf_hook_slow` are a rule's:
    /// an IPv6 stack's own drop (elsewhere) is not, whatever rule it would fit.
    #[test]
    fn without_reasons_the_location_says_whose() {
        use crate::event::RuleCount;
        let mut t = RuleDropTracker::default();
        t.on_setup(false, &[]);
        let mut nf = sample([10, 0, 0, 2], 17, 9001);
        nf.location = 0x10;
        let mut other = sample([10, 0, 0, 2], 17, 9001);
        other.location = 0x20;
        t.on_sample(&nf, None);
        t.on_sample(&other, None);
        // The names come with the counts, after the samples.
        t.on_symbol(0x10, "nf_hook_slow");
        t.on_symbol(0x20, "ip6_mc_input");
        let c = RuleCounters {
            ts_ns: 20,
            since_ns: 5,
            netns: 7,
            family: "ip".into(),
            table: "filter".into(),
            rules: vec![RuleCount {
                chain: "INPUT".into(),
                rule: "-j DROP".into(),
                nth: 0,
                packets: 1,
                bytes: 60,
                reset: false,
            }],
            uncounted: vec![],
        };
        let mut facts = Vec::new();
        t.on_counters(&c, &RuleTracker::default(), &mut |o| facts.push(o));
        let Some(Output::RuleDrops(f)) = facts.first() else {
            panic!("{facts:?}")
        };
        assert_eq!(f.dests.len(), 1, "{f:?}");
        assert_eq!(f.dests[0].samples, 1, "{f:?}");
    }

    #[test]
    fn several_rules_share_samples_only_where_one_fits() {
        use crate::event::RuleCount;
        let mut t = RuleDropTracker::default();
        t.on_setup(true, &[(12, "NETFILTER_DROP".into())]);
        for _ in 0..3 {
            t.on_sample(&sample([10, 0, 0, 2], 17, 9001), None);
        }
        t.on_sample(&sample([10, 0, 0, 2], 17, 9002), None);
        let rc = |rule: &str, packets| RuleCount {
            chain: "INPUT".into(),
            rule: rule.into(),
            nth: 0,
            packets,
            bytes: packets * 100,
            reset: false,
        };
        let c = RuleCounters {
            ts_ns: 20,
            since_ns: 5,
            netns: 7,
            family: "ip".into(),
            table: "filter".into(),
            rules: vec![
                rc("-p udp -m udp --dport 9001 -j DROP", 300),
                rc("-p udp -m udp --dport 9002 -j DROP", 100),
            ],
            uncounted: vec![],
        };
        let mut facts = Vec::new();
        t.on_counters(&c, &RuleTracker::default(), &mut |o| facts.push(o));
        let f: Vec<_> = facts
            .iter()
            .filter_map(|o| match o {
                Output::RuleDrops(f) => Some(f),
                _ => None,
            })
            .collect();
        assert_eq!(f.len(), 2);
        assert_eq!((f[0].packets, f[0].others), (300, 1));
        assert_eq!(f[0].dests[0].dest, "10.0.0.2:9001");
        assert_eq!(f[0].dests[0].samples, 3);
        assert_eq!(f[1].dests[0].dest, "10.0.0.2:9002");
        let s = t.summary();
        assert_eq!((s.packets, s.rules), (400, 2));
        assert_eq!(s.top[0].rule, "-p udp -m udp --dport 9001 -j DROP");
    }
}
