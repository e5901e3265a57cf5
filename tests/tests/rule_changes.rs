//! Who changed whose rules, against real `iptables-legacy` and `iptables-legacy-save` in a
//! private network namespace: kube-proxy creates its chains; calico-node runs a save →
//! modify → restore that strips the mark match from kube-proxy's KUBE-FIREWALL DROP rule
//! (kubernetes#112477: the node then drops everything); firewalld flushes and deletes
//! kube-proxy's chains; kube-proxy puts one back. `iptables-legacy-save` after each step is
//! the truth; `trace` says each step, and `report` on its capture says the same.
//!
//! The same story through nf_tables: `iptables-nft-restore`, `iptables-nft-save | sed |
//! iptables-nft-restore`, and firewalld's `nft flush chain` / `nft delete chain`;
//! `iptables-nft-save` and `nft list ruleset` are the truth.

use std::{path::Path, process::Command, time::Duration};

use serde_json::Value;
use xtlock_tests::{require_bpf, serial, xtlock_bin, NetnsPair, Scratch, Tracer};

const T: Duration = Duration::from_secs(20);

const KUBE_PROXY_RULES: &str = "*filter
:KUBE-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABC - [0:0]
-A INPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL -m comment --comment \"kubernetes firewall for dropping marked packets\" -m mark --mark 0x8000/0x8000 -j DROP
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 53 -j KUBE-SVC-ABC
-A KUBE-SVC-ABC -j ACCEPT
COMMIT
";

/// `agent` runs `sh -c script` in `ns`; the read of the table it wrote has time to come.
fn step(s: &Scratch, agent: &str, ns: &str, lock: &Path, script: &str) {
    xtlock_tests::agent_step(s, agent, ns, lock, script, T);
}

fn changes(events: &[&Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["type"] == "rule_change")
        .map(|e| (*e).clone())
        .collect()
}

/// The facts this scenario must produce, from `trace` or from `report`, through either
/// backend: `table` is how facts name the table (`ip filter`, `nft ip filter`), `lost` the
/// mark match as the backend's rules show it.
fn assert_story(changes: &[Value], dump: &str, table: &str, lost: &str) {
    let by = |agent: &str| -> Vec<&Value> {
        changes
            .iter()
            .filter(|c| c["agent"] == agent && c["ambiguous"] == false)
            .collect()
    };
    assert!(
        changes.iter().all(|c| format!(
            "{} {}",
            c["family"].as_str().unwrap_or(""),
            c["table"].as_str().unwrap_or("")
        ) == table),
        "only {table} changed:\n{dump}"
    );
    // kube-proxy's own chains: created, nothing foreign.
    let kp = by("kube-proxy");
    assert!(
        kp.iter().any(|c| c["created"]
            .as_array()
            .is_some_and(|a| a.iter().any(|n| n == "KUBE-FIREWALL"))
            && c["foreign"].is_null()),
        "kube-proxy creating its chains:\n{dump}"
    );
    // calico-node stripped the mark match from kube-proxy's rule: a foreign change, and a
    // DROP that now matches every packet reaching it from INPUT; the comment stayed.
    let cn = by("calico-node");
    let stripped: Vec<&Value> = cn
        .iter()
        .flat_map(|c| c["foreign"].as_array().into_iter().flatten())
        .filter(|f| f["owner"] == "kube-proxy")
        .flat_map(|f| f["rules_changed"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(stripped.len(), 1, "calico-node's strip:\n{dump}");
    assert_eq!(stripped[0]["chain"], "KUBE-FIREWALL");
    assert_eq!(stripped[0]["lost"], serde_json::json!([lost]), "{dump}");
    assert_eq!(
        stripped[0]["now"],
        "-m comment --comment \"kubernetes firewall for dropping marked packets\" -j DROP",
        "{dump}"
    );
    assert!(
        cn.iter()
            .any(|c| c["bare_drops"].as_array().is_some_and(|b| !b.is_empty())),
        "the bare DROP:\n{dump}"
    );
    // firewalld flushed KUBE-SERVICES and deleted KUBE-SVC-ABC, both kube-proxy's.
    let fw: Vec<&Value> = by("firewalld")
        .into_iter()
        .flat_map(|c| c["foreign"].as_array().into_iter().flatten())
        .filter(|f| f["owner"] == "kube-proxy")
        .collect();
    let names = |k: &str| -> Vec<String> {
        fw.iter()
            .flat_map(|f| f[k].as_array().into_iter().flatten())
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect()
    };
    // Read after each command or once after all three: KUBE-SVC-ABC may be seen flushed first.
    assert!(
        names("chains_flushed").contains(&"KUBE-SERVICES".to_string()),
        "{dump}"
    );
    assert_eq!(names("chains_deleted"), ["KUBE-SVC-ABC"], "{dump}");
    // kube-proxy put KUBE-SVC-ABC back.
    let restored: Vec<&Value> = kp
        .iter()
        .flat_map(|c| c["restored"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(restored.len(), 1, "{dump}");
    assert_eq!(restored[0]["chain"], "KUBE-SVC-ABC");
    assert_eq!(restored[0]["removed_by"], "firewalld");
    assert!(restored[0]["gone_ns"].as_u64().unwrap_or(0) >= 300_000_000);
}

/// A writer (agent), its script, and the truth to check after it (given the namespace).
type Step<'a> = (&'a str, &'a str, &'a dyn Fn(&str));

/// One backend's story: each writer's script (`{rules}`: kube-proxy's rules file), and the
/// truth to check after it in the namespace.
struct Story<'a> {
    name: &'a str,
    subnet: u8,
    /// How the facts name the table, and the mark match as the backend shows it.
    table: &'a str,
    lost: &'a str,
    /// Appended to each script (see [`who_changed_whose_nf_tables_rules`]).
    linger: &'a str,
    steps: Vec<Step<'a>>,
}

/// Runs `story` under `trace --record`, checks its facts live and replayed from the
/// capture, and the terminal's words.
fn run_story(story: Story) {
    let _g = serial();
    let s = Scratch::new(story.name);
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new(story.name, story.subnet);
    let capture = s.dir.join("rules.xtlock");
    let tracer = xtlock_tests::trace_recording(&lock, &capture, &["--no-drops"]);
    let rules = s.dir.join("kube-proxy.rules");
    std::fs::write(&rules, KUBE_PROXY_RULES).unwrap();
    for (agent, script, truth) in &story.steps {
        let script = script.replace("{rules}", &rules.display().to_string());
        step(
            &s,
            agent,
            &ns.a,
            &lock,
            &format!("{script}{}", story.linger),
        );
        truth(&ns.a);
    }
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    // This namespace's: other tests may write rules elsewhere meanwhile.
    let netns = NetnsPair::inode(&ns.a);
    let mine = |events: &[Value]| -> Vec<Value> {
        changes(&events.iter().collect::<Vec<_>>())
            .into_iter()
            .filter(|c| c["netns"].as_u64() == Some(netns))
            .collect()
    };
    let live = mine(&trace.events);
    assert_story(&live, &dump, story.table, story.lost);
    trace.assert_foreign_change("firewalld", "kube-proxy");

    // The capture says the same.
    let replayed = mine(&xtlock_tests::report_events(&capture));
    assert_eq!(replayed, live, "report differs from trace");

    // And the terminal says it in words.
    let text = Command::new(xtlock_bin())
        .args(["report", "--events"])
        .arg(&capture)
        .output()
        .expect("xtlock report");
    let text = String::from_utf8_lossy(&text.stdout);
    let lost = format!(
        "!! calico-node changed kube-proxy's rule in KUBE-FIREWALL: lost `{}`",
        story.lost
    );
    assert!(text.contains(&lost), "{text}");
    let foreign = format!("!! firewalld changed kube-proxy's rules in {}", story.table);
    assert!(text.contains(&foreign), "{text}");
    assert!(text.contains("kube-proxy put back KUBE-SVC-ABC"), "{text}");
}

fn contains(
    prog: impl Into<String>,
    args: &'static [&'static str],
    want: &'static str,
    yes: bool,
) -> impl Fn(&str) {
    let prog = prog.into();
    move |ns: &str| {
        let out = NetnsPair::exec(ns, &prog, args);
        assert_eq!(out.contains(want), yes, "{prog} {args:?}: {want}:\n{out}");
    }
}

const STRIPPED: &str = "-A KUBE-FIREWALL -m comment --comment \"kubernetes firewall for dropping marked packets\" -j DROP";

/// The legacy story through `tool` (`iptables`, `ip6tables`): `{rules}` becomes
/// `restore_input` for kube-proxy's restore.
fn legacy_story(name: &'static str, subnet: u8, tool: &'static str, restore_input: &str) {
    let save = |want, yes| contains(format!("{tool}-legacy-save"), &["-t", "filter"], want, yes);
    let nothing = |_: &str| {};
    let (marked, stripped, svc_gone, svc_back) = (
        save("-m mark --mark 0x8000/0x8000 -j DROP", true),
        save(STRIPPED, true),
        save("KUBE-SVC-ABC", false),
        save(":KUBE-SVC-ABC", true),
    );
    let t = format!("{tool}-legacy");
    let scripts = [
        format!("{t} -w -A OUTPUT -o lo -j ACCEPT"),
        format!("{restore_input} | {t}-restore -w --noflush"),
        format!("{t}-save -t filter | sed 's/ -m mark --mark 0x8000\\/0x8000//' | {t}-restore -w"),
        format!("{t} -w -F KUBE-SERVICES && {t} -w -F KUBE-SVC-ABC && {t} -w -X KUBE-SVC-ABC"),
        format!("{t} -w -N KUBE-SVC-ABC"),
    ];
    run_story(Story {
        name,
        subnet,
        table: if tool == "ip6tables" {
            "ip6 filter"
        } else {
            "ip filter"
        },
        lost: "-m mark --mark 0x8000/0x8000",
        linger: "",
        steps: vec![
            // A first write: the table as it was is the baseline.
            ("setup", &scripts[0], &nothing),
            ("kube-proxy", &scripts[1], &marked),
            ("calico-node", &scripts[2], &stripped),
            ("firewalld", &scripts[3], &svc_gone),
            ("kube-proxy", &scripts[4], &svc_back),
        ],
    });
}

#[test]
fn who_changed_whose_rules() {
    if !require_bpf("who_changed_whose_rules") {
        return;
    }
    legacy_story("xtlock-rc", 48, "iptables", "cat {rules}");
}

/// The same story through ip6tables (legacy): kube-proxy on a dual-stack node writes both
/// families, and a firewalld reload clobbers both.
#[test]
fn who_changed_whose_ip6tables_rules() {
    if !require_bpf("who_changed_whose_ip6tables_rules") {
        return;
    }
    legacy_story(
        "xtlock-rc6",
        50,
        "ip6tables",
        "sed 's#10.96.0.10/32#fd00::10/128#' {rules}",
    );
}

/// Through nf_tables, read after each writer's exit (on this host the nft_commit hook does
/// not attach). Each script's shell lives on a moment after, as an agent does: xtlock reads
/// kernel events up to 50 ms late, when an `iptables-nft` that ran for 2 ms is gone, and
/// finds its network namespace through its nearest running ancestor.
#[test]
fn who_changed_whose_nf_tables_rules() {
    if !require_bpf("who_changed_whose_nf_tables_rules") {
        return;
    }
    let save = |want, yes| contains("iptables-nft-save", &["-t", "filter"], want, yes);
    let list = |want, yes| contains("nft", &["list", "ruleset"], want, yes);
    let nothing = |_: &str| {};
    let (marked, marked_nft) = (
        save("-m mark --mark 0x8000/0x8000 -j DROP", true),
        list("meta mark & 0x00008000 == 0x00008000", true),
    );
    let marked = |ns: &str| {
        marked(ns);
        marked_nft(ns);
    };
    let (stripped, stripped_nft) = (save(STRIPPED, true), list("meta mark", false));
    let stripped = |ns: &str| {
        stripped(ns);
        stripped_nft(ns);
    };
    let (svc_gone, svc_gone_nft) = (save("KUBE-SVC-ABC", false), list("KUBE-SVC-ABC", false));
    let svc_gone = |ns: &str| {
        svc_gone(ns);
        svc_gone_nft(ns);
    };
    let svc_back = save(":KUBE-SVC-ABC", true);
    run_story(Story {
        name: "xtlock-nrc",
        subnet: 49,
        table: "nft ip filter",
        // iptables-nft's table: its rules in iptables-nft-save's words, the mark match
        // (native `meta mark` expressions) as the legacy story's.
        lost: "-m mark --mark 0x8000/0x8000",
        linger: " && sleep 0.3",
        steps: vec![
            // The first write makes the table: what is there after it is the baseline.
            ("setup", "iptables-nft -A OUTPUT -o lo -j ACCEPT", &nothing),
            ("kube-proxy", "iptables-nft-restore --noflush < {rules}", &marked),
            (
                "calico-node",
                "iptables-nft-save -t filter | sed 's/ -m mark --mark 0x8000\\/0x8000//' | iptables-nft-restore",
                &stripped,
            ),
            // firewalld's nftables backend speaks nft.
            (
                "firewalld",
                "nft flush chain ip filter KUBE-SERVICES && nft flush chain ip filter KUBE-SVC-ABC && nft delete chain ip filter KUBE-SVC-ABC",
                &svc_gone,
            ),
            ("kube-proxy", "iptables-nft -N KUBE-SVC-ABC", &svc_back),
        ],
    });
}

/// Every nf_tables write counts where the nft_commit hook does not attach (this host), also
/// from a process gone before its exec is read, in a namespace no process lives in: `ip netns
/// exec NS nft ...` run from this test (whose namespace is the host's). The kernel's record of
/// the exec names the namespace; the pin in `/run/netns` opens it. Each write is a
/// `rule_write` with backend nft in NS, its change is read there, and with a legacy write in
/// the same namespace NS is said mixed. `nft list ruleset` in NS is the truth that the writes
/// happened; the number of runs is the truth of the count.
#[test]
fn nf_tables_writes_of_gone_processes_count_in_their_namespace() {
    if !require_bpf("nf_tables_writes_of_gone_processes_count_in_their_namespace") {
        return;
    }
    let _g = serial();
    let ns = NetnsPair::new("xtlock-nw", 53);
    let mut c = Command::new(xtlock_bin());
    c.args(["trace", "--json", "--duration", "300s", "--no-drops"])
        .args(xtlock_tests::tracer_extra_args());
    let tracer = Tracer::spawn(c);
    let run = |prog: &str, args: &[&str]| {
        let mut all = vec!["netns", "exec", ns.a.as_str(), prog];
        all.extend_from_slice(args);
        xtlock_tests::sh("ip", &all);
        // Its read comes before the next write (writes 50 ms apart coalesce into one read).
        std::thread::sleep(Duration::from_millis(400));
    };
    run("nft", &["add", "table", "ip", "xtnw"]);
    run("nft", &["add", "chain", "ip", "xtnw", "c1"]);
    run(
        "nft",
        &["add", "rule", "ip", "xtnw", "c1", "counter", "accept"],
    );
    run("iptables-legacy", &["-w", "-A", "INPUT", "-j", "ACCEPT"]);
    let truth = NetnsPair::exec(&ns.a, "nft", &["list", "ruleset"]);
    assert!(
        truth.contains("chain c1") && truth.contains("accept"),
        "{truth}"
    );
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    let netns = NetnsPair::inode(&ns.a);
    let in_ns = |t: &str| -> Vec<&Value> {
        trace
            .of_type(t)
            .into_iter()
            .filter(|e| e["netns"].as_u64() == Some(netns))
            .collect()
    };
    let nft_writes: Vec<&Value> = in_ns("rule_write")
        .into_iter()
        .filter(|w| w["backend"] == "nft")
        .collect();
    assert_eq!(nft_writes.len(), 3, "one per nft run, in NS:\n{dump}");
    for w in &nft_writes {
        assert_eq!(w["program"], "nft", "{w}");
    }
    let changes = in_ns("rule_change");
    assert!(
        changes.iter().any(|c| c["table"] == "xtnw"
            && c["added"]
                .as_array()
                .is_some_and(|a| a.iter().any(|r| r[0] == "c1"))),
        "the rule added to c1 is read in NS:\n{dump}"
    );
    let mixed = in_ns("mixed_backends");
    assert_eq!(mixed.len(), 1, "NS holds both backends:\n{dump}");
}

/// A namespace of more than 1,000 nf_tables chains is read chain by chain (a dump of every
/// rule costs the kernel the square of the ruleset): kube-proxy's nftables table for 200
/// services of 5 endpoints (1,204 chains, 2,400 rules), then kube-proxy's kind of change, one
/// endpoint chain flushed and refilled in one transaction. The change read is exactly that
/// chain's, and the Service model holds every service port and endpoint: `nft list chain` is
/// the truth of the change, the generator's counts of the model.
#[test]
fn a_namespace_of_over_1000_chains_is_read_chain_by_chain() {
    if !require_bpf("a_namespace_of_over_1000_chains_is_read_chain_by_chain") {
        return;
    }
    let _g = serial();
    let ns = NetnsPair::new("xtlock-nbig", 57);
    let s = Scratch::new("nbig");
    let load = xtlock_tests::write_file(
        &s.dir,
        "kube-proxy.nft",
        &xtlock_tests::kube_proxy_nft_ruleset(200, 5),
    );
    let nft_f = |file: &Path| {
        xtlock_tests::sh(
            "ip",
            &[
                "netns",
                "exec",
                ns.a.as_str(),
                "nft",
                "-f",
                file.to_str().unwrap(),
            ],
        );
    };
    nft_f(&load);
    // Endpoint 7: service 1's third, at 10.128.0.7.
    let chain = "endpoint-00000007-ns/svc-1/tcp/http__10.128.0.7/8080";
    let change = xtlock_tests::write_file(
        &s.dir,
        "change.nft",
        &format!(
            "flush chain ip kube-proxy {chain}\n\
             add rule ip kube-proxy {chain} meta l4proto tcp dnat to 10.128.0.7:9090\n"
        ),
    );
    let mut c = Command::new(xtlock_bin());
    c.args(["trace", "--json", "--duration", "300s", "--no-drops"])
        .args(xtlock_tests::tracer_extra_args());
    let tracer = Tracer::spawn(c);
    // The namespace's first read after a write is its baseline.
    xtlock_tests::sh(
        "ip",
        &[
            "netns",
            "exec",
            ns.a.as_str(),
            "nft",
            "add",
            "table",
            "ip",
            "xtnbig",
        ],
    );
    std::thread::sleep(Duration::from_secs(3));
    nft_f(&change);
    std::thread::sleep(Duration::from_secs(3));
    let truth = NetnsPair::exec(&ns.a, "nft", &["list", "chain", "ip", "kube-proxy", chain]);
    assert!(
        truth.contains("dnat to 10.128.0.7:9090") && !truth.contains("ip saddr"),
        "{truth}"
    );
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    let netns = NetnsPair::inode(&ns.a);
    let changes: Vec<&Value> = trace
        .of_type("rule_change")
        .into_iter()
        .filter(|e| e["netns"].as_u64() == Some(netns) && e["table"] == "kube-proxy")
        .collect();
    assert_eq!(changes.len(), 1, "one change of table kube-proxy:\n{dump}");
    let chains_of = |k: &str| -> Vec<String> {
        changes[0][k]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|r| r[0].as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        chains_of("added"),
        vec![chain.to_string()],
        "{}",
        changes[0]
    );
    assert_eq!(
        chains_of("removed"),
        vec![chain.to_string(), chain.to_string()],
        "both of its rules removed: {}",
        changes[0]
    );
    assert!(
        changes[0]["skipped"].is_null(),
        "read, not skipped: {}",
        changes[0]
    );
    let summary = trace.of_type("summary").into_iter().last().cloned();
    let services = summary.as_ref().map(|s| s["services"].clone());
    assert_eq!(
        services
            .as_ref()
            .map(|s| (s["services"].as_u64(), s["endpoints"].as_u64())),
        Some((Some(200), Some(1000))),
        "the model holds every service port and endpoint: {services:?}"
    );
}
