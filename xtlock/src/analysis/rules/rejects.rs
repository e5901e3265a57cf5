//! Which rule refused a connection: the REJECT rule of a read table that matches a refused
//! TCP connection's destination, so a refusal is said with the rule behind it
//! ("default/web:http has no endpoints", kube-proxy's comment on its REJECT rules).

use std::net::Ipv4Addr;

use crate::event::Rule;

/// How the rule answers: with an ICMP error, or with a TCP reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Icmp,
    Reset,
}

/// Whether `rule` REJECTs TCP connections to `addr:port` with `answer`. Only what a rule
/// states positively is matched (negated addresses or ports never match), so a named rule
/// is one that surely applies to this destination, not one that merely might.
pub fn rejects(rule: &Rule, addr: Ipv4Addr, port: u16, answer: Answer) -> bool {
    let target = rule.target();
    let Some(with) = target.strip_prefix("-j REJECT") else {
        return false;
    };
    let reset = with.contains("tcp-reset");
    if reset != (answer == Answer::Reset) {
        return false;
    }
    let mut proto_ok = true;
    let mut port_ok = false;
    for part in rule.matches() {
        if part.starts_with("! ") || part.contains(" ! ") {
            return false;
        }
        if let Some(net) = part.strip_prefix("-d ") {
            if !in_net(net, addr) {
                return false;
            }
        } else if let Some(p) = part.strip_prefix("-p ") {
            proto_ok = p == "tcp";
        } else if let Some(m) = part.strip_prefix("-m tcp") {
            for w in m.split(" --").filter(|w| !w.is_empty()) {
                let w = w.trim_start_matches('-');
                if let Some(p) = w.strip_prefix("dport ") {
                    if !in_ports(p, port) {
                        return false;
                    }
                    port_ok = true;
                }
            }
        } else if part.starts_with("-s ") || part.starts_with("-i ") {
            // Any source or input device: the rule still names this destination's refusal.
        } else {
            // A match xtlock does not check (conntrack state, a set, a mark): not sure.
            return false;
        }
    }
    proto_ok && port_ok
}

fn in_net(net: &str, addr: Ipv4Addr) -> bool {
    let (a, len) = net.split_once('/').unwrap_or((net, "32"));
    let (Ok(a), Ok(len)) = (a.parse::<Ipv4Addr>(), len.parse::<u32>()) else {
        return false;
    };
    let mask = u32::MAX.checked_shl(32 - len.min(32)).unwrap_or(0);
    u32::from(a) & mask == u32::from(addr) & mask
}

fn in_ports(p: &str, port: u16) -> bool {
    match p.split_once(':') {
        Some((lo, hi)) => lo
            .parse::<u16>()
            .ok()
            .zip(hi.parse::<u16>().ok())
            .is_some_and(|(lo, hi)| (lo..=hi).contains(&port)),
        None => p.parse::<u16>().ok() == Some(port),
    }
}

/// How a rule is named in a refusal: its comment, else `CHAIN: rule`.
pub fn name(chain: &str, rule: &Rule) -> String {
    match rule.comment() {
        Some(c) => c.trim_matches('"').to_string(),
        None => format!("{chain}: {}", rule.text()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(parts: &[&str]) -> Rule {
        Rule(parts.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn kube_proxys_no_endpoints_rule() {
        let r = rule(&[
            "-d 10.96.0.15/32",
            "-p tcp",
            "-m comment --comment \"default/web:http has no endpoints\"",
            "-m tcp --dport 80",
            "-j REJECT --reject-with icmp-port-unreachable",
        ]);
        let a: Ipv4Addr = "10.96.0.15".parse().unwrap();
        assert!(rejects(&r, a, 80, Answer::Icmp));
        assert!(!rejects(&r, a, 80, Answer::Reset));
        assert!(!rejects(&r, a, 81, Answer::Icmp));
        assert!(!rejects(
            &r,
            "10.96.0.16".parse().unwrap(),
            80,
            Answer::Icmp
        ));
        assert_eq!(
            name("KUBE-SERVICES", &r),
            "default/web:http has no endpoints"
        );
    }

    #[test]
    fn ranges_nets_resets_and_what_is_not_sure() {
        let r = rule(&[
            "-d 10.0.0.0/8",
            "-p tcp",
            "-m tcp --sport 1:65535 --dport 8000:8100",
            "-j REJECT --reject-with tcp-reset",
        ]);
        assert!(rejects(
            &r,
            "10.1.2.3".parse().unwrap(),
            8081,
            Answer::Reset
        ));
        assert!(!rejects(
            &r,
            "11.1.2.3".parse().unwrap(),
            8081,
            Answer::Reset
        ));
        assert_eq!(
            name("INPUT", &r),
            "INPUT: -d 10.0.0.0/8 -p tcp -m tcp --sport 1:65535 --dport 8000:8100 -j REJECT --reject-with tcp-reset"
        );
        // No port stated: it rejects everything, not this service in particular.
        let any = rule(&["-p tcp", "-j REJECT --reject-with icmp-port-unreachable"]);
        assert!(!rejects(
            &any,
            "10.1.2.3".parse().unwrap(),
            80,
            Answer::Icmp
        ));
        // Negations and unchecked matches are not named.
        let neg = rule(&[
            "! -d 10.0.0.1/32",
            "-p tcp",
            "-m tcp --dport 80",
            "-j REJECT",
        ]);
        assert!(!rejects(
            &neg,
            "10.1.2.3".parse().unwrap(),
            80,
            Answer::Icmp
        ));
        let neg = rule(&["-p tcp", "-m tcp ! --dport 81", "-j REJECT"]);
        assert!(!rejects(
            &neg,
            "10.1.2.3".parse().unwrap(),
            80,
            Answer::Icmp
        ));
        let state = rule(&[
            "-p tcp",
            "-m tcp --dport 80",
            "-m conntrack [rev 3 25bb30f0c452]",
            "-j REJECT",
        ]);
        assert!(!rejects(
            &state,
            "10.1.2.3".parse().unwrap(),
            80,
            Answer::Icmp
        ));
        // A plain REJECT answers with ICMP port unreachable.
        let plain = rule(&["-p tcp", "-m tcp --dport 80", "-j REJECT"]);
        assert!(rejects(
            &plain,
            "10.1.2.3".parse().unwrap(),
            80,
            Answer::Icmp
        ));
    }
}
