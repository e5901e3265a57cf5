//! What a hold did with the tables, against the truth the tables themselves give: real
//! `iptables-legacy-restore` runs of 100, 10,000 and 100,000 generated rules, an
//! `ip6tables-legacy-restore`, a plain `iptables-legacy -A`, each in a private network
//! namespace; the entry counts xtlock reads from the replaces' arguments equal what
//! `iptables-legacy-save` shows afterwards, counted the way the kernel counts entries.

use std::{path::Path, time::Duration};

use serde_json::Value;
use xtlock_tests::{require_bpf, serial, write_file, Agent, Scratch, Tracer};

fn u(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not an unsigned number: {v}"))
}

/// A table of `n` rules in one user chain, plus a rule in a built-in chain.
fn ruleset(table: &str, n: usize) -> String {
    let mut s = format!("*{table}\n:XTLOCK-TEST - [0:0]\n-A INPUT -j XTLOCK-TEST\n");
    for i in 0..n {
        let (a, b) = (i / 250 % 250, i % 250);
        s.push_str(&format!(
            "-A XTLOCK-TEST -s 10.{}.{a}.{b}/32 -p tcp --dport {} -j ACCEPT\n",
            i / 62_500,
            1 + i % 60_000
        ));
    }
    s.push_str("COMMIT\n");
    s
}

fn ruleset6(n: usize) -> String {
    let mut s = "*filter\n:XTLOCK-TEST6 - [0:0]\n-A INPUT -j XTLOCK-TEST6\n".to_string();
    for i in 0..n {
        s.push_str(&format!(
            "-A XTLOCK-TEST6 -s fd00::{:x}/128 -j ACCEPT\n",
            i + 1
        ));
    }
    s.push_str("COMMIT\n");
    s
}

/// Entries of a table as the kernel counts them, from `iptables-save -t T`: every rule, one
/// policy per built-in chain, a head and a return per user chain, and the end.
fn kernel_entries(save: &str) -> u64 {
    let mut n = 1;
    for l in save.lines() {
        if l.starts_with("-A ") {
            n += 1;
        } else if let Some(chain) = l.strip_prefix(':') {
            let policy = chain.split_whitespace().nth(1).unwrap_or("-");
            n += if policy == "-" { 2 } else { 1 };
        }
    }
    n
}

/// The holds of `agent` that replaced tables, in order.
fn replacing_holds<'a>(trace: &'a xtlock_tests::Trace, agent: &str) -> Vec<&'a Value> {
    trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["agent"] == agent && h["tables"].is_array())
        .collect()
}

fn replaces(hold: &Value) -> Vec<&Value> {
    hold["tables"]
        .as_array()
        .map(|t| t.iter().filter(|t| t["op"] == "replace").collect())
        .unwrap_or_default()
}

#[test]
fn table_sizes_match_what_the_tables_hold() {
    if !require_bpf("table_sizes_match_what_the_tables_hold") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("tables");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap();
    let dir = s.dir.to_str().unwrap().to_owned();
    let sizes = [100usize, 10_000, 100_000];
    for n in sizes {
        write_file(&s.dir, &format!("filter.{n}"), &ruleset("filter", n));
    }
    write_file(&s.dir, "filter6", &ruleset6(500));
    // One network namespace for the whole script, so each save sees what the restore put.
    let mut script = String::from("set -e\n");
    for n in sizes {
        script.push_str(&format!(
            "iptables-legacy-restore -w 5 < {dir}/filter.{n}\n\
             iptables-legacy-save -t filter > {dir}/save.{n}\n"
        ));
    }
    script.push_str(&format!(
        "ip6tables-legacy-restore -w 5 < {dir}/filter6\n\
         ip6tables-legacy-save -t filter > {dir}/save6\n\
         iptables-legacy -w -A OUTPUT -j ACCEPT\n\
         iptables-legacy-save -t filter > {dir}/save.append\n"
    ));
    let tracer = Tracer::start(&[&lock], Duration::from_secs(15), &["--no-drops"]);
    let mut kp = Agent::spawn(
        &s.agent("kube-proxy"),
        &["run", "--netns", "sh", "-c", &script],
        &[("XTABLES_LOCKFILE", lock_s)],
        None,
    );
    assert_eq!(kp.wait(), 0, "the iptables script failed");
    let mut bad = Agent::spawn(&s.agent("calico-node"), &["badreplace", lock_s], &[], None);
    assert_eq!(bad.wait(), 0);
    let trace = tracer.finish();
    let dump = trace.dump();
    let save =
        |name: &str| std::fs::read_to_string(Path::new(&dir).join(name)).expect("a save file");

    let holds = replacing_holds(&trace, "kube-proxy");
    assert_eq!(
        holds.len(),
        5,
        "3 restores, 1 ip6 restore, 1 append:\n{dump}"
    );
    let mut bytes_per_entry = Vec::new();
    for (i, n) in sizes.iter().enumerate() {
        let r = replaces(holds[i]);
        assert_eq!(r.len(), 1, "{}", holds[i]);
        let t = r[0];
        assert_eq!(
            (t["table"].as_str(), t["family"].as_str()),
            (Some("filter"), Some("ip"))
        );
        let want = kernel_entries(&save(&format!("save.{n}")));
        assert_eq!(u(&t["entries"]), want, "{n} rules: {t}");
        let bytes = u(&t["bytes"]);
        bytes_per_entry.push(bytes / want);
        // The kernel's time is part of the hold; the rest is the holder's own.
        let (start, end) = (
            u(&holds[i]["start_ns"]),
            u(&holds[i]["start_ns"]) + u(&holds[i]["hold_ns"]),
        );
        assert!((start..end).contains(&u(&t["start_ns"])), "{t}");
        assert!(u(&t["kernel_ns"]) <= u(&holds[i]["kernel_ns"]));
        assert!(u(&holds[i]["kernel_ns"]) <= u(&holds[i]["hold_ns"]));
        eprintln!(
            "{n} rules: {want} entries, {bytes} bytes, kernel {} ns of a {} ns hold",
            t["kernel_ns"], holds[i]["hold_ns"]
        );
    }
    // Before each replace the holder read the table out (libiptc's init): GET_INFO says
    // the old table's entries and bytes, GET_ENTRIES copies those bytes. The old count is
    // what the previous save showed (a fresh namespace's filter table: 3 policies + end).
    let mut old_entries = 4;
    for (i, n) in sizes.iter().enumerate() {
        let h = holds[i];
        let tables = h["tables"].as_array().unwrap();
        let info: Vec<&Value> = tables.iter().filter(|t| t["op"] == "info").collect();
        let entries: Vec<&Value> = tables.iter().filter(|t| t["op"] == "entries").collect();
        assert!(
            !info.is_empty() && !entries.is_empty(),
            "no table read: {h}"
        );
        assert_eq!(
            u(&info[0]["entries"]),
            old_entries,
            "old entries, {n} rules: {h}"
        );
        assert_eq!(info[0]["table"], "filter", "{h}");
        assert_eq!(u(&entries[0]["bytes"]), u(&info[0]["bytes"]), "{h}");
        assert!(entries[0].get("entries").is_none(), "{h}");
        // Reads come before the replace, and their time is the hold's read_ns.
        let replace_at = u(&replaces(h)[0]["start_ns"]);
        assert!(u(&info[0]["start_ns"]) < replace_at, "{h}");
        let read_ns: u64 = info
            .iter()
            .chain(&entries)
            .map(|t| u(&t["kernel_ns"]))
            .sum();
        assert_eq!(u(&h["read_ns"]), read_ns, "{h}");
        assert_eq!(u(&h["reads"]), (info.len() + entries.len()) as u64, "{h}");
        let all: u64 = tables.iter().map(|t| u(&t["kernel_ns"])).sum();
        assert_eq!(
            u(&h["kernel_ns"]),
            all,
            "kernel_ns is reads + replaces: {h}"
        );
        old_entries = kernel_entries(&save(&format!("save.{n}")));
    }

    // The same rule shape makes the same entry size, whatever the count.
    assert!(
        bytes_per_entry.iter().all(|b| (100..400).contains(b)),
        "{bytes_per_entry:?}"
    );
    let r6 = replaces(holds[3]);
    assert_eq!(
        (r6[0]["family"].as_str(), r6[0]["table"].as_str()),
        (Some("ip6"), Some("filter"))
    );
    assert_eq!(
        u(&r6[0]["entries"]),
        kernel_entries(&save("save6")),
        "{}",
        r6[0]
    );
    // A plain append replaces the whole table, one entry bigger.
    let ra = replaces(holds[4]);
    assert_eq!(
        u(&ra[0]["entries"]),
        kernel_entries(&save("save.append")),
        "{}",
        ra[0]
    );
    assert_eq!(
        u(&ra[0]["entries"]),
        kernel_entries(&save("save.100000")) + 1
    );
    // ... and read it first: the old count, one less.
    let info_a: Vec<&Value> = holds[4]["tables"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["op"] == "info")
        .collect();
    assert_eq!(
        u(&info_a[0]["entries"]),
        kernel_entries(&save("save.100000")),
        "{}",
        holds[4]
    );

    // An argument the kernel cannot read: the hold is there, its table unknown, the error
    // said.
    let bad: Vec<&Value> = replacing_holds(&trace, "calico-node");
    assert_eq!(bad.len(), 1, "{dump}");
    let t = &bad[0]["tables"][0];
    assert_eq!(t["table"], "", "{t}");
    assert!(t.get("entries").is_none(), "{t}");
    assert_eq!(t["ret"].as_i64(), Some(-14), "EFAULT: {t}");
    assert_eq!(u(&bad[0]["replaces"]), 1);
}
