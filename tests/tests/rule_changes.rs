//! Who changed whose rules, against real `iptables-legacy` and `iptables-legacy-save` in a
//! private network namespace: kube-proxy creates its chains; calico-node runs a save →
//! modify → restore that strips the mark match from kube-proxy's KUBE-FIREWALL DROP rule
//! (kubernetes#112477: the node then drops everything); firewalld flushes and deletes
//! kube-proxy's chains; kube-proxy puts one back. `iptables-legacy-save` after each step is
//! the truth; `trace` says each step, and `report` on its capture says the same.

use std::{path::Path, process::Command, time::Duration};

use serde_json::Value;
use xtlock_tests::{require_bpf, serial, xtlock_bin, Agent, NetnsPair, Scratch, Tracer};

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
    let mut a = Agent::spawn(
        Path::new("ip"),
        &[
            "netns",
            "exec",
            ns,
            s.agent(agent).to_str().unwrap(),
            "run",
            "sh",
            "-c",
            script,
        ],
        &[("XTABLES_LOCKFILE", lock.to_str().unwrap())],
        None,
    );
    assert_eq!(a.wait_within(T), 0, "{agent}: {script}");
    std::thread::sleep(Duration::from_millis(400));
}

fn changes(events: &[&Value]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["type"] == "rule_change")
        .map(|e| (*e).clone())
        .collect()
}

/// The facts this scenario must produce, from `trace` or from `report`.
fn assert_story(changes: &[Value], dump: &str) {
    let by = |agent: &str| -> Vec<&Value> {
        changes
            .iter()
            .filter(|c| c["agent"] == agent && c["ambiguous"] == false)
            .collect()
    };
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
    // DROP that now matches every packet reaching it from INPUT.
    let cn = by("calico-node");
    let stripped: Vec<&Value> = cn
        .iter()
        .flat_map(|c| c["foreign"].as_array().into_iter().flatten())
        .filter(|f| f["owner"] == "kube-proxy")
        .flat_map(|f| f["rules_changed"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(stripped.len(), 1, "calico-node's strip:\n{dump}");
    assert_eq!(stripped[0]["chain"], "KUBE-FIREWALL");
    assert_eq!(
        stripped[0]["lost"],
        serde_json::json!(["-m mark --mark 0x8000/0x8000"])
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

#[test]
fn who_changed_whose_rules() {
    if !require_bpf("who_changed_whose_rules") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("rule-changes");
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new("xtlock-rc", 48);
    let capture = s.dir.join("rules.xtlock");
    let mut c = Command::new(xtlock_bin());
    c.args(["trace", "--json", "--duration", "9s", "--no-drops"])
        .arg("--lock-file")
        .arg(&lock)
        .arg("--record")
        .arg(&capture)
        .args(xtlock_tests::tracer_extra_args());
    let tracer = Tracer::spawn(c);
    let rules = s.dir.join("kube-proxy.rules");
    std::fs::write(&rules, KUBE_PROXY_RULES).unwrap();
    let save = || NetnsPair::exec(&ns.a, "iptables-legacy-save", &["-t", "filter"]);
    // A first write: the table as it was is the baseline.
    step(
        &s,
        "setup",
        &ns.a,
        &lock,
        "iptables-legacy -w -A OUTPUT -o lo -j ACCEPT",
    );
    step(
        &s,
        "kube-proxy",
        &ns.a,
        &lock,
        &format!("iptables-legacy-restore -w --noflush < {}", rules.display()),
    );
    assert!(save().contains("-m mark --mark 0x8000/0x8000 -j DROP"));
    step(
        &s,
        "calico-node",
        &ns.a,
        &lock,
        "iptables-legacy-save -t filter | sed 's/ -m mark --mark 0x8000\\/0x8000//' | iptables-legacy-restore -w",
    );
    let after_strip = save();
    assert!(
        after_strip.contains("-A KUBE-FIREWALL -m comment --comment \"kubernetes firewall for dropping marked packets\" -j DROP"),
        "{after_strip}"
    );
    step(
        &s,
        "firewalld",
        &ns.a,
        &lock,
        "iptables-legacy -w -F KUBE-SERVICES && iptables-legacy -w -F KUBE-SVC-ABC && iptables-legacy -w -X KUBE-SVC-ABC",
    );
    assert!(!save().contains("KUBE-SVC-ABC"));
    step(
        &s,
        "kube-proxy",
        &ns.a,
        &lock,
        "iptables-legacy -w -N KUBE-SVC-ABC",
    );
    assert!(save().contains(":KUBE-SVC-ABC"));
    let trace = tracer.finish();
    let dump = trace.dump();
    let live = changes(&trace.events.iter().collect::<Vec<_>>());
    assert_story(&live, &dump);
    assert!(
        trace.summary()["foreign_changes"]
            .as_array()
            .is_some_and(|f| f
                .iter()
                .any(|r| r[0] == "firewalld" && r[1] == "kube-proxy")),
        "{}",
        trace.summary()
    );

    // The capture says the same.
    let replayed = xtlock_tests::report_events(&capture);
    let replayed = changes(&replayed.iter().collect::<Vec<_>>());
    assert_eq!(replayed, live, "report differs from trace");

    // And the terminal says it in words.
    let text = Command::new(xtlock_bin())
        .args(["report", "--events"])
        .arg(&capture)
        .output()
        .expect("xtlock report");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("!! calico-node changed kube-proxy's rule in KUBE-FIREWALL: lost `-m mark --mark 0x8000/0x8000`"),
        "{text}"
    );
    assert!(
        text.contains("!! firewalld changed kube-proxy's rules in ip filter"),
        "{text}"
    );
    assert!(text.contains("kube-proxy put back KUBE-SVC-ABC"), "{text}");
}
