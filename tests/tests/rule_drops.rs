//! The rule behind each netfilter drop, against real rules and real traffic: two network
//! namespaces joined by a veth pair, kube-proxy's, calico-node's and firewalld's rules
//! written by the real `iptables-legacy` / `iptables-nft` / `nft` under those agents' names,
//! and UDP floods from the other namespace that those rules drop.
//!
//! The truth is the rules' own counters (`iptables-*-save -c`, `nft list chain`) read before
//! and after the floods, and the generator's own count of datagrams sent (UDP over a veth:
//! nothing is lost on the way). Every `rule_drops` fact of a rule summed gives what the rule
//! dropped during the trace, exactly; its owner, its chain's owner and the write that added
//! it are the agents that wrote them; the capture replayed says the same.
//!
//! kube-proxy's `KUBE-FORWARD ... --ctstate INVALID -j DROP` drops TCP segments conntrack
//! calls INVALID (SYN, FIN and RST together), sent from a raw socket by a short Python script.

use std::{
    collections::BTreeMap,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use xtlock_tests::{
    report_events, report_text, require_bpf, send_udp, serial, sh, NetnsPair, Scratch, Tracer,
};

const T: Duration = Duration::from_secs(20);

/// Between two floods: the drop counts come once a second, and with them a read of the
/// namespace's counters, so the second flood falls in another interval. Longer in the
/// emulated VMs of `cargo xtask vm-test`.
fn gap() -> Duration {
    Duration::from_millis(if xtlock_tests::in_vm() { 4000 } else { 1500 })
}

/// After the last flood, before the stop: its drop counts and the counter read they ask
/// for have come (the stop reads once more besides).
fn settle() -> Duration {
    Duration::from_millis(if xtlock_tests::in_vm() { 5000 } else { 2500 })
}

/// Samples of every drop: a flood of a few hundred datagrams stays within the budget, so
/// an interval in which a rule dropped has samples of its drops (the default, 100/s per
/// CPU, is spent by the first flood of a second).
const SAMPLES: &str = "1000/s";

fn u(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not an unsigned number: {v}"))
}

/// `agent` runs `sh -c script` in `ns` (under `lock` for the legacy tools); the read of the
/// table it wrote has time to come.
fn step(s: &Scratch, agent: &str, ns: &str, lock: &Path, script: &str) {
    xtlock_tests::agent_step(s, agent, ns, lock, script, T);
}

/// What a test runs in: its scratch directory, lock file, namespaces (ns.b knows ns.a's MAC
/// for good) and `xtlock trace --json --record` on them, stopped once the floods are counted.
struct Bench {
    s: Scratch,
    lock: std::path::PathBuf,
    ns: NetnsPair,
    capture: std::path::PathBuf,
    tracer: Tracer,
}

fn start(name: &str, subnet: u8) -> Bench {
    let s = Scratch::new(name);
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new(name, subnet);
    static_neighbour(&ns, subnet);
    let capture = s.dir.join("drops.xtlock");
    let tracer = xtlock_tests::trace_recording(&lock, &capture, &["--drop-samples", SAMPLES]);
    Bench {
        s,
        lock,
        ns,
        capture,
        tracer,
    }
}

/// `ns.b` knows `ns.a`'s MAC for good: no datagram of a flood waits for ARP (the queue of
/// packets waiting for a neighbour is small, and what overflows it never reaches the rules).
fn static_neighbour(ns: &NetnsPair, subnet: u8) {
    let (va, vb) = (format!("xv{subnet}a"), format!("xv{subnet}b"));
    let link: Value =
        serde_json::from_str(&NetnsPair::exec(&ns.a, "ip", &["-j", "link", "show", &va]))
            .expect("ip -j link is JSON");
    let mac = link[0]["address"].as_str().expect("a MAC").to_string();
    sh(
        "ip",
        &[
            "-n",
            &ns.b,
            "neigh",
            "replace",
            &ns.addr_a,
            "lladdr",
            &mac,
            "dev",
            &vb,
            "nud",
            "permanent",
        ],
    );
}

/// Floods from `ns.b` to `ns.a`, all at once: (port, datagrams). Returns what was sent to
/// each port.
fn flood(s: &Scratch, ns: &NetnsPair, floods: &[(u16, u64)]) -> Vec<(u16, u64)> {
    // Copied once, before the senders start: a copy under way cannot be exec'd.
    s.agent("udp-sender");
    thread::scope(|sc| {
        let senders: Vec<_> = floods
            .iter()
            .map(|&(port, n)| sc.spawn(move || (port, send_udp(s, &ns.b, &ns.addr_a, port, n, 4))))
            .collect();
        senders.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `save -c`'s rules: (chain, rule as printed after `-A CHAIN `) → (packets, bytes).
fn saved_counters(ns: &str, save: &str) -> BTreeMap<(String, String), (u64, u64)> {
    let out = NetnsPair::exec(ns, save, &["-c", "-t", "filter"]);
    let mut m = BTreeMap::new();
    for l in out.lines() {
        let Some(rest) = l.strip_prefix('[') else {
            continue;
        };
        let (counts, rule) = rest.split_once("] -A ").expect("[p:b] -A CHAIN rule");
        let (p, b) = counts.split_once(':').expect("p:b");
        let (chain, rule) = rule.split_once(' ').expect("CHAIN rule");
        m.insert(
            (chain.to_string(), rule.to_string()),
            (p.parse().unwrap(), b.parse().unwrap()),
        );
    }
    m
}

/// The one saved rule of `chain` containing `needle`: its text.
fn saved_rule(saved: &BTreeMap<(String, String), (u64, u64)>, chain: &str, needle: &str) -> String {
    let found: Vec<&String> = saved
        .keys()
        .filter(|(c, r)| c == chain && r.contains(needle))
        .map(|(_, r)| r)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one rule of {chain} with `{needle}`: {saved:?}"
    );
    found[0].clone()
}

/// This namespace's facts of `type`.
fn facts_of<'a>(events: &'a [Value], netns: u64, kind: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["type"] == kind && e["netns"].as_u64() == Some(netns))
        .collect()
}

/// A rule the floods meet, and what must be said of it.
struct Want {
    chain: &'static str,
    /// Picks its line out of the save.
    needle: String,
    /// The port of the datagrams it drops; its samples name this port.
    port: u16,
    owner: &'static str,
    chain_owner: &'static str,
    /// Who added it, with which program (`{t}`: the backend's tool).
    added: (&'static str, &'static str),
}

/// Per rule: the sum of its `rule_drops` facts' (packets, bytes).
fn sums(facts: &[&Value]) -> BTreeMap<(String, String), (u64, u64)> {
    let mut m: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for f in facts {
        let k = (
            f["chain"].as_str().unwrap().to_string(),
            f["rule"].as_str().unwrap().to_string(),
        );
        let e = m.entry(k).or_default();
        e.0 += u(&f["packets"]);
        e.1 += u(&f["bytes"]);
    }
    m
}

/// kube-proxy's filter table as `iptables-restore --noflush` takes it: the mark DROP of
/// KUBE-FIREWALL, jumped to from INPUT (the mark is set by the setup's rule before it).
const KUBE_PROXY: &str = "*filter
:KUBE-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL -m comment --comment \"kubernetes firewall for dropping marked packets\" -m mark --mark 0x8000/0x8000 -j DROP
COMMIT
";

/// calico-node's: a policy chain dropping UDP to port 9X02, jumped to from cali-INPUT.
const CALICO: &str = "*filter
:cali-INPUT - [0:0]
:cali-pi-_kNm2vX8qLfB3 - [0:0]
-A INPUT -m comment --comment \"cali:Cz_u1IQiXIMmKD4c\" -j cali-INPUT
-A cali-INPUT -m comment --comment \"cali:FewJpBykm9iJ-YNH\" -j cali-pi-_kNm2vX8qLfB3
-A cali-pi-_kNm2vX8qLfB3 -p udp -m comment --comment \"cali:4ELBfN2R8CJ8Ot5q\" -m udp --dport {p2} -j DROP
COMMIT
";

/// One backend's scenario. `t`: `iptables-legacy` or `iptables-nft`; `family`: how facts
/// name its tables; `linger`: appended to each writer's script (see rule_changes.rs: with
/// no nft_commit hook an nf_tables write is read at its writer's exit, found through the
/// writer's shell).
fn kube_proxy_calico_firewalld(name: &str, subnet: u8, t: &str, family: &str, linger: &str) {
    let _g = serial();
    let Bench {
        s,
        lock,
        ns,
        capture,
        tracer,
    } = start(name, subnet);
    let base = 9000 + u16::from(subnet) * 10 % 1000;
    let (p1, p2, p3) = (base + 1, base + 2, base + 3);
    let started = Instant::now();

    let kp = s.dir.join("kube-proxy.rules");
    std::fs::write(&kp, KUBE_PROXY).unwrap();
    let cali = s.dir.join("calico.rules");
    std::fs::write(&cali, CALICO.replace("{p2}", &p2.to_string())).unwrap();
    // The first write makes (or reads) the table: what is there after it is the baseline.
    // The mark kube-proxy's DROP drops by, on UDP to p1.
    step(
        &s,
        "setup",
        &ns.a,
        &lock,
        &format!("{t} -w -A INPUT -p udp --dport {p1} -j MARK --set-xmark 0x8000/0x8000{linger}"),
    );
    step(
        &s,
        "kube-proxy",
        &ns.a,
        &lock,
        &format!("{t}-restore -w --noflush < {}{linger}", kp.display()),
    );
    step(
        &s,
        "calico-node",
        &ns.a,
        &lock,
        &format!("{t}-restore -w --noflush < {}{linger}", cali.display()),
    );
    let save = format!("{t}-save");
    let before = saved_counters(&ns.a, &save);

    // Two rules drop in the same intervals, then calico-node's alone.
    let mut sent = flood(&s, &ns, &[(p1, 300), (p2, 200)]);
    thread::sleep(gap());
    sent.extend(flood(&s, &ns, &[(p2, 100)]));
    thread::sleep(gap());
    // firewalld puts a rule of its own first in kube-proxy's chain.
    step(
        &s,
        "firewalld",
        &ns.a,
        &lock,
        &format!("{t} -w -I KUBE-FIREWALL -p udp -m udp --dport {p3} -j DROP{linger}"),
    );
    sent.extend(flood(&s, &ns, &[(p3, 150), (p1, 100)]));
    thread::sleep(gap());
    sent.extend(flood(&s, &ns, &[(p3, 50)]));
    thread::sleep(settle());
    let after = saved_counters(&ns.a, &save);
    tracer.interrupt();
    let trace = tracer.finish();
    eprintln!("{name}: traced for {:?}", started.elapsed());
    let dump = trace.dump();
    let netns = NetnsPair::inode(&ns.a);
    let table = format!("{family} filter");

    let (tool_restore, tool) = (format!("{t}-restore"), t.to_string());
    let wants = [
        Want {
            chain: "KUBE-FIREWALL",
            needle: "0x8000/0x8000 -j DROP".into(),
            port: p1,
            owner: "kube-proxy",
            chain_owner: "kube-proxy",
            added: ("kube-proxy", "restore"),
        },
        Want {
            chain: "cali-pi-_kNm2vX8qLfB3",
            needle: format!("--dport {p2} -j DROP"),
            port: p2,
            owner: "calico-node",
            chain_owner: "calico-node",
            added: ("calico-node", "restore"),
        },
        Want {
            chain: "KUBE-FIREWALL",
            needle: format!("--dport {p3} -j DROP"),
            port: p3,
            owner: "firewalld",
            chain_owner: "kube-proxy",
            added: ("firewalld", "tool"),
        },
    ];

    let facts = facts_of(&trace.events, netns, "rule_drops");
    for f in &facts {
        eprintln!("{name}: {f}");
    }
    assert!(!facts.is_empty(), "no rule_drops in {netns}:\n{dump}");
    for f in &facts {
        assert_eq!(
            format!(
                "{} {}",
                f["family"].as_str().unwrap(),
                f["table"].as_str().unwrap()
            ),
            table,
            "only {table} dropped: {f}"
        );
        assert!(f["reset"].is_null(), "no counter went back: {f}");
        assert!(u(&f["ts_ns"]) > u(&f["since_ns"]), "{f}");
        // `others`: the other rules that dropped in the same read of the table.
        let same_read = facts
            .iter()
            .filter(|g| g["ts_ns"] == f["ts_ns"] && g["table"] == f["table"])
            .count() as u64;
        assert_eq!(u(&f["others"]), same_read - 1, "{f}\n{dump}");
    }
    let got = sums(&facts);
    assert_eq!(
        got.len(),
        wants.len(),
        "rules that dropped: {:?}\n{dump}",
        got.keys()
    );
    for w in &wants {
        let rule = saved_rule(&after, w.chain, &w.needle);
        let key = (w.chain.to_string(), rule.clone());
        let (p0, b0) = before.get(&key).copied().unwrap_or((0, 0));
        let (p1c, b1c) = after[&key];
        let (dp, db) = (p1c - p0, b1c - b0);
        let gen: u64 = sent
            .iter()
            .filter(|(p, _)| *p == w.port)
            .map(|(_, n)| n)
            .sum();
        assert_eq!(
            dp, gen,
            "{} `{rule}`: its counter vs datagrams sent",
            w.chain
        );
        assert_eq!(
            got.get(&key).copied(),
            Some((dp, db)),
            "{} `{rule}`: rule_drops summed vs its counter (+{dp} packets, +{db} bytes)\n{dump}",
            w.chain
        );
        let program = match w.added.1 {
            "restore" => &tool_restore,
            _ => &tool,
        };
        let mine: Vec<&&Value> = facts
            .iter()
            .filter(|f| f["chain"] == w.chain && f["rule"] == rule.as_str())
            .collect();
        for f in &mine {
            assert_eq!(f["owner"], w.owner, "{f}");
            assert_eq!(f["chain_owner"], w.chain_owner, "{f}");
            assert_eq!(f["added"]["agent"], w.added.0, "{f}");
            assert_eq!(f["added"]["program"], program.as_str(), "{f}");
            assert!(u(&f["added"]["pid"]) > 0, "{f}");
            assert!(
                u(&f["added"]["ts_ns"]) < u(&f["since_ns"]),
                "added before it dropped: {f}"
            );
            // A sample goes to a rule only when no other rule that dropped then fits it:
            // never to the wrong one.
            for d in f["dests"].as_array().into_iter().flatten() {
                assert_eq!(d["proto"], "udp", "{f}");
                assert_eq!(
                    d["dest"],
                    format!("{}:{}", ns.addr_a, w.port).as_str(),
                    "{f}"
                );
                assert!(u(&d["samples"]) > 0, "{f}");
            }
            if u(&f["others"]) == 0 {
                assert!(
                    f["dests"].as_array().is_some_and(|d| !d.is_empty()),
                    "alone in its interval, its samples are its own: {f}"
                );
            }
        }
        assert!(
            mine.iter()
                .any(|f| f["dests"].as_array().is_some_and(|d| !d.is_empty())),
            "{} `{rule}`: some interval names its port {}\n{dump}",
            w.chain,
            w.port
        );
        // The summary's ranking: the same total, the same origin.
        let top = &trace.summary()["rule_drops"]["top"];
        let row = top
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| {
                u(&r["netns"]) == netns && r["chain"] == w.chain && r["rule"] == rule.as_str()
            })
            .unwrap_or_else(|| panic!("{} `{rule}` not in the summary's top: {top}", w.chain));
        assert_eq!((u(&row["packets"]), u(&row["bytes"])), (dp, db), "{row}");
        assert_eq!(
            format!(
                "{} {}",
                row["family"].as_str().unwrap(),
                row["table"].as_str().unwrap()
            ),
            table
        );
        assert_eq!(row["owner"], w.owner, "{row}");
        assert_eq!(row["chain_owner"], w.chain_owner, "{row}");
        assert_eq!(row["added"], mine[0]["added"], "{row}");
        assert_eq!(row["first_ns"], mine[0]["since_ns"], "{row}");
        assert_eq!(row["last_ns"], mine[mine.len() - 1]["ts_ns"], "{row}");
    }
    let summary = &trace.summary()["rule_drops"];
    assert!(
        u(&summary["packets"]) >= got.values().map(|v| v.0).sum::<u64>(),
        "{summary}"
    );
    assert!(
        facts_of(&trace.events, netns, "uncounted_drops").is_empty(),
        "iptables rules all count:\n{dump}"
    );

    // The capture says the same.
    let replayed = report_events(&capture);
    let replayed: Vec<&Value> = facts_of(&replayed, netns, "rule_drops");
    assert_eq!(replayed, facts, "report differs from trace");

    // And the terminal says it in words.
    let text = report_text(&capture);
    let fw_rule = saved_rule(&after, "KUBE-FIREWALL", &wants[2].needle);
    let words = format!(
        "dropped by {} KUBE-FIREWALL `{fw_rule}`",
        if family == "ip" { "filter" } else { &table }
    );
    assert!(
        text.lines().any(|l| l.contains(&words)
            && l.contains("firewalld's rule in kube-proxy's chain")
            && l.contains(&format!("by {t} (pid "))),
        "`{words}` in:\n{text}"
    );
}

/// kube-proxy's mark DROP, calico-node's policy DROP and a DROP firewalld put in
/// kube-proxy's chain, through iptables-legacy; the capture replayed says the same.
#[test]
fn legacy_drops_are_named_with_their_rule_owner_and_write() {
    if !require_bpf("legacy_drops_are_named_with_their_rule_owner_and_write") {
        return;
    }
    kube_proxy_calico_firewalld("xtlock-rdl", 211, "iptables-legacy", "ip", "");
}

/// The same through iptables-nft: table `nft ip filter`, its rules in iptables-nft-save's
/// words.
#[test]
fn iptables_nft_drops_are_named_with_their_rule_owner_and_write() {
    if !require_bpf("iptables_nft_drops_are_named_with_their_rule_owner_and_write") {
        return;
    }
    kube_proxy_calico_firewalld("xtlock-rdn", 212, "iptables-nft", "nft ip", " && sleep 0.3");
}

/// `counter` and `packets N bytes M` of the rule of `chain` (in `nft list chain`'s words)
/// containing `needle`.
fn nft_counter(ns: &str, table: &str, chain: &str, needle: &str) -> (u64, u64) {
    let out = NetnsPair::exec(ns, "nft", &["list", "chain", "inet", table, chain]);
    let line = out
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no rule with `{needle}`:\n{out}"));
    let w: Vec<&str> = line.split_whitespace().collect();
    let after = |k: &str| -> u64 {
        w.iter()
            .position(|x| *x == k)
            .and_then(|i| w.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no `{k} N` in `{line}`"))
    };
    (after("packets"), after("bytes"))
}

/// A native nf_tables table: a base input chain with `udp dport P1 counter drop` and `udp
/// dport P2 drop`. The first rule's drops are named with their exact count (`nft list`'s
/// counter); the second, which keeps no counter, is said uncounted, once.
#[test]
fn native_nft_drops_with_and_without_counter() {
    if !require_bpf("native_nft_drops_with_and_without_counter") {
        return;
    }
    let _g = serial();
    let name = "xtlock-rdf";
    let subnet = 213;
    let Bench {
        s,
        lock,
        ns,
        capture,
        tracer,
    } = start(name, subnet);
    let (p1, p2) = (9131u16, 9132u16);
    let rules = s.dir.join("fw.nft");
    std::fs::write(
        &rules,
        format!(
            "table inet xtrd {{\n\
             chain input {{\n\
             type filter hook input priority 0; policy accept;\n\
             udp dport {p1} counter drop\n\
             udp dport {p2} drop\n\
             }}\n\
             }}\n"
        ),
    )
    .unwrap();
    // The first write: the namespace's tables as they are after it are the baseline.
    step(
        &s,
        "setup",
        &ns.a,
        &lock,
        "nft add table inet xtrd && sleep 0.3",
    );
    // firewalld's nftables backend speaks nft.
    step(
        &s,
        "firewalld",
        &ns.a,
        &lock,
        &format!("nft -f {} && sleep 0.3", rules.display()),
    );
    let before = nft_counter(&ns.a, "xtrd", "input", &format!("dport {p1}"));
    let sent = flood(&s, &ns, &[(p1, 250), (p2, 150)]);
    thread::sleep(gap());
    let sent2 = flood(&s, &ns, &[(p1, 70)]);
    thread::sleep(settle());
    let after = nft_counter(&ns.a, "xtrd", "input", &format!("dport {p1}"));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    let netns = NetnsPair::inode(&ns.a);
    assert_eq!(sent, [(p1, 250), (p2, 150)]);
    assert_eq!(sent2, [(p1, 70)]);
    let (dp, db) = (after.0 - before.0, after.1 - before.1);
    assert_eq!(dp, 320, "the counter saw every datagram to {p1}");

    let facts = facts_of(&trace.events, netns, "rule_drops");
    for f in facts_of(&trace.events, netns, "uncounted_drops")
        .iter()
        .chain(&facts)
    {
        eprintln!("{name}: {f}");
    }
    for f in &facts {
        assert_eq!(f["family"], "nft inet", "{f}");
        assert_eq!(f["table"], "xtrd", "{f}");
        assert_eq!(f["chain"], "input", "{f}");
        assert!(f["reset"].is_null(), "{f}");
        assert_eq!(u(&f["others"]), 0, "one counted rule drops: {f}");
    }
    let got = sums(&facts);
    assert_eq!(got.len(), 1, "one rule counted its drops:\n{dump}");
    let ((_, rule), totals) = got.iter().next().unwrap();
    assert!(
        rule.contains(&format!("dport {p1}")) && rule.to_lowercase().contains("drop"),
        "{rule}"
    );
    assert_eq!(
        *totals,
        (dp, db),
        "rule_drops summed vs `nft list`'s counter\n{dump}"
    );
    for f in &facts {
        // The chain has no conventional name: its owner is who xtlock saw create it.
        assert_eq!(f["owner"], "firewalld", "{f}");
        assert_eq!(f["chain_owner"], "firewalld", "{f}");
        assert_eq!(f["added"]["agent"], "firewalld", "{f}");
        assert_eq!(f["added"]["program"], "nft", "{f}");
    }
    // Alone in the second interval: its samples are its own. In the first, the uncounted
    // rule dropped too, but it states another port: the samples to p1 are still this one's.
    for f in &facts {
        let dests = f["dests"].as_array().cloned().unwrap_or_default();
        assert!(!dests.is_empty(), "{f}");
        for d in dests {
            assert_eq!(d["dest"], format!("{}:{p1}", ns.addr_a).as_str(), "{f}");
        }
    }

    let unc = facts_of(&trace.events, netns, "uncounted_drops");
    assert_eq!(unc.len(), 1, "said once for the table:\n{dump}");
    assert_eq!(unc[0]["family"], "nft inet", "{}", unc[0]);
    assert_eq!(unc[0]["table"], "xtrd", "{}", unc[0]);
    let listed: Vec<&str> = unc[0]["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(listed.len(), 1, "{}", unc[0]);
    assert!(
        listed[0].starts_with("input: ")
            && listed[0].contains(&format!("dport {p2}"))
            && listed[0].to_lowercase().ends_with("drop"),
        "{}",
        unc[0]
    );
    let summary = &trace.summary()["rule_drops"];
    assert!(
        summary["uncounted"].as_array().is_some_and(|u| u
            .iter()
            .any(|r| r == format!("nft inet xtrd {}", listed[0]).as_str())),
        "{summary}"
    );
    let row = summary["top"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| u(&r["netns"]) == netns)
        .unwrap_or_else(|| panic!("not in the summary's top: {summary}"));
    assert_eq!((u(&row["packets"]), u(&row["bytes"])), (dp, db), "{row}");
    assert_eq!(row["rule"], rule.as_str(), "{row}");

    let replayed = report_events(&capture);
    assert_eq!(
        facts_of(&replayed, netns, "rule_drops"),
        facts,
        "report differs from trace"
    );
    assert_eq!(
        facts_of(&replayed, netns, "uncounted_drops"),
        unc,
        "report differs from trace"
    );
    let text = report_text(&capture);
    let words = format!(
        "!! 1 rule of nft inet xtrd drops without a counter (what they drop cannot be named; add `counter` to name it): {}",
        listed[0]
    );
    assert!(text.contains(&words), "`{words}` in:\n{text}");
}

/// Sends `count` TCP segments with SYN, FIN and RST all set (a combination conntrack calls
/// INVALID whatever the state) from a raw socket, each from its own source port; prints
/// `sent N`.
const INVALID_SENDER: &str = r#"
import socket, struct, sys
dst, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
s.connect((dst, 0))
src = s.getsockname()[0]
def csum(b):
    if len(b) % 2:
        b += b"\0"
    n = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while n >> 16:
        n = (n & 0xFFFF) + (n >> 16)
    return ~n & 0xFFFF
sent = 0
for i in range(count):
    head = struct.pack("!HHIIBBHHH", 40000 + i, port, 1, 0, 5 << 4, 0x07, 1024, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(head))
    seg = head[:16] + struct.pack("!H", csum(pseudo + head)) + head[18:]
    sent += s.send(seg) > 0
print("sent", sent, flush=True)
"#;

/// kube-proxy's conntrack-state DROP (`KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP`,
/// here jumped to from INPUT): TCP segments conntrack calls INVALID, from a raw socket in the
/// other namespace, are named with that rule, kube-proxy's, and the restore that added it;
/// the counts are the rule's own counter's and the sender's.
#[test]
fn conntrack_invalid_drops_are_named_with_their_rule() {
    if !require_bpf("conntrack_invalid_drops_are_named_with_their_rule") {
        return;
    }
    let _g = serial();
    let name = "xtlock-rdi";
    let subnet = 215;
    let Bench {
        s,
        lock,
        ns,
        tracer,
        ..
    } = start(name, subnet);
    let sender = xtlock_tests::write_file(&s.dir, "invalid.py", INVALID_SENDER);
    step(
        &s,
        "setup",
        &ns.a,
        &lock,
        "iptables-legacy -w -A OUTPUT -o lo -j ACCEPT",
    );
    let rules = xtlock_tests::write_file(
        &s.dir,
        "kube-proxy.rules",
        "*filter\n:KUBE-FORWARD - [0:0]\n-A INPUT -j KUBE-FORWARD\n\
         -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\nCOMMIT\n",
    );
    step(
        &s,
        "kube-proxy",
        &ns.a,
        &lock,
        &format!("iptables-legacy-restore -w --noflush < {}", rules.display()),
    );
    let counter = || xtlock_tests::iptables_packets(&ns.a, "KUBE-FORWARD", "ctstate INVALID");
    let before = counter();
    let out = NetnsPair::exec(
        &ns.b,
        "python3",
        &[sender.to_str().unwrap(), &ns.addr_a, "8080", "180"],
    );
    let sent: u64 = out
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the sender said: {out}"));
    thread::sleep(settle());
    let after = counter();
    assert_eq!(
        after - before,
        sent,
        "the INVALID rule's counter against the sender"
    );
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    let netns = NetnsPair::inode(&ns.a);
    let facts = facts_of(&trace.events, netns, "rule_drops");
    let rule = "-m conntrack --ctstate INVALID -j DROP";
    let mine: Vec<&&Value> = facts
        .iter()
        .filter(|f| f["chain"] == "KUBE-FORWARD" && f["rule"] == rule)
        .collect();
    assert_eq!(
        mine.iter().map(|f| u(&f["packets"])).sum::<u64>(),
        sent,
        "{dump}"
    );
    assert_eq!(mine.len(), facts.len(), "only that rule dropped:\n{dump}");
    for f in &mine {
        assert_eq!(f["owner"], "kube-proxy", "{f}");
        assert_eq!(f["chain_owner"], "kube-proxy", "{f}");
        assert_eq!(f["added"]["agent"], "kube-proxy", "{f}");
        assert_eq!(f["added"]["program"], "iptables-legacy-restore", "{f}");
    }
    // The samples were TCP to port 8080: the rule's destination.
    assert!(
        mine.iter().any(|f| f["dests"]
            .as_array()
            .is_some_and(|d| d.iter().any(|d| d["dest"] == format!("{}:8080", ns.addr_a)))),
        "{dump}"
    );
}
