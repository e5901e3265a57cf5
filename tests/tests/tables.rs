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

/// kube-proxy's nat and filter tables (services, endpoints by probability, masquerading),
/// dockerd's (`! -i docker0`, `-o docker0 -m conntrack`), and a firewall's (LOG, NFLOG,
/// REJECT, limit, iprange, icmp, tcp flags, recent, ...): what `iptables-legacy-restore`
/// and `iptables-nft-restore` load.
const KUBE_DOCKER_FIREWALL: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:DOCKER - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SEP-CCCCCCCCCCCCCCCC - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-WEBWEBWEBWEBWEBW - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A PREROUTING -p udp -m udp --dport 53 -j DNAT --to-destination 10.96.0.10 --random
-A PREROUTING -p tcp -m tcp --dport 8000:8100 -j DNAT --to-destination 10.244.9.1-10.244.9.3:9000-9100 --persistent
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER
-A OUTPUT -d 169.254.169.254/32 -p tcp -m tcp --dport 80 -j REDIRECT --to-ports 8181
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE
-A POSTROUTING -s 192.168.100.0/24 -o eth0 -p tcp -j SNAT --to-source 192.0.2.10-192.0.2.20:1024-65535 --persistent
-A POSTROUTING -s 192.168.101.0/24 -o eth0 -p udp -j MASQUERADE --to-ports 20000-30000 --random
-A DOCKER -i docker0 -j RETURN
-A DOCKER ! -i docker0 -p tcp -m tcp --dport 8080 -j DNAT --to-destination 172.17.0.2:80
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-NODEPORTS -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j KUBE-SVC-WEBWEBWEBWEBWEBW
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-AAAAAAAAAAAAAAAA -s 10.244.1.5/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-AAAAAAAAAAAAAAAA -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.1.5:8080
-A KUBE-SEP-BBBBBBBBBBBBBBBB -s 10.244.2.7/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-BBBBBBBBBBBBBBBB -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.2.7:8080
-A KUBE-SEP-CCCCCCCCCCCCCCCC -s 10.244.3.9/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-CCCCCCCCCCCCCCCC -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.3.9:8080
-A KUBE-SERVICES -d 10.96.0.20/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-WEBWEBWEBWEBWEBW
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-WEBWEBWEBWEBWEBW ! -s 10.244.0.0/16 -d 10.96.0.20/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http -> 10.244.1.5:8080" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-AAAAAAAAAAAAAAAA
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http -> 10.244.2.7:8080" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-SVC-WEBWEBWEBWEBWEBW -m comment --comment "default/web:http -> 10.244.3.9:8080" -j KUBE-SEP-CCCCCCCCCCCCCCCC
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:DOCKER - [0:0]
:DOCKER-ISOLATION-STAGE-1 - [0:0]
:DOCKER-USER - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
:LOGDROP - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -i lo -j ACCEPT
-A INPUT -m state --state RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p icmp -m icmp --icmp-type 8 -m limit --limit 5/sec --limit-burst 10 -j ACCEPT
-A INPUT -p icmp -m icmp --icmp-type 3/4 -j ACCEPT
-A INPUT -p icmp -m icmp ! --icmp-type any -j DROP
-A INPUT -p tcp --syn -m conntrack --ctstate NEW -m limit --limit 60/minute -j ACCEPT
-A INPUT -p tcp ! --syn -m conntrack --ctstate NEW -j DROP
-A INPUT -p tcp -m tcp --tcp-flags ALL NONE -j DROP
-A INPUT -p tcp -m tcp --sport 1024:65535 --dport 22 --tcp-option 2 -j ACCEPT
-A INPUT -p tcp -m multiport --dports 22,80,443,8000:8100 -j ACCEPT
-A INPUT -p udp -m multiport ! --sports 53,123 -j LOGDROP
-A INPUT -p tcp -m multiport --ports 5000,6000 -j ACCEPT
-A INPUT -m iprange --src-range 10.1.0.1-10.1.0.50 -j ACCEPT
-A INPUT -m iprange ! --dst-range 192.168.0.1-192.168.0.9 -j RETURN
-A INPUT -p tcp -m tcp --dport 22 -m recent --update --seconds 60 --hitcount 4 --name SSH --rsource -j DROP
-A INPUT -p tcp -m tcp --dport 22 -m recent --set --name SSH --rsource
-A INPUT -m pkttype --pkt-type broadcast -j DROP
-A INPUT -s 10.0.0.0/255.0.255.0 -j DROP
-A INPUT -s 10.9.0.0/16 -d 10.8.0.1/32 -j ACCEPT
-A INPUT -f -j DROP
-A INPUT -p gre -j ACCEPT
-A INPUT -p 200 -j ACCEPT
-A INPUT -m conntrack --ctstatus ASSURED,CONFIRMED --ctproto 6 --ctorigdst 10.96.0.0/12 --ctorigdstport 80 --ctdir ORIGINAL -j ACCEPT
-A INPUT -m conntrack ! --ctorigsrc 10.0.0.1 --ctreplsrcport 1000:2000 --ctexpire 10:100 -j ACCEPT
-A INPUT -m mark --mark 0x1 -j ACCEPT
-A INPUT -m connmark --mark 0x2/0xff -j ACCEPT
-A INPUT -m statistic --mode nth --every 3 --packet 1 -j ACCEPT
-A INPUT -m addrtype --src-type LOCAL --dst-type UNICAST,BROADCAST --limit-iface-in -j ACCEPT
-A INPUT -p tcp -g LOGDROP
-A INPUT -p tcp -j REJECT --reject-with tcp-reset
-A INPUT -p udp -j REJECT --reject-with icmp-port-unreachable
-A INPUT -j REJECT --reject-with icmp-admin-prohibited
-A INPUT -p udp --sport 53:60 ! --dport 5 -j NFLOG --nflog-prefix "a b" --nflog-group 5 --nflog-size 100 --nflog-threshold 3
-A INPUT -p tcp --dport :1000 -m pkttype ! --pkt-type multicast -j NFLOG
-A INPUT -m mark ! --mark 5 -m limit --limit 3/hour --limit-burst 7 -j ACCEPT
-A INPUT ! -i + -j DROP
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -j DOCKER-USER
-A FORWARD -j DOCKER-ISOLATION-STAGE-1
-A FORWARD -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A FORWARD -o docker0 -j DOCKER
-A FORWARD -i docker0 ! -o docker0 -j ACCEPT
-A FORWARD -i docker0 -o docker0 -j ACCEPT
-A FORWARD -m physdev --physdev-is-bridged -j ACCEPT
-A FORWARD -m physdev --physdev-in veth+ ! --physdev-out eth0 -j ACCEPT
-A FORWARD -i br+ -o + -j ACCEPT
-A FORWARD -i + ! -o eth1 -j ACCEPT
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A DOCKER -d 172.17.0.2/32 ! -i docker0 -o docker0 -p tcp -m tcp --dport 80 -j ACCEPT
-A DOCKER-ISOLATION-STAGE-1 -j RETURN
-A DOCKER-USER -j RETURN
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FIREWALL -m comment --comment "kubernetes firewall for dropping marked packets" -m mark --mark 0x8000/0x8000 -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-SERVICES -d 10.96.0.11/32 -p tcp -m comment --comment "default/nope:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
-A LOGDROP -m limit --limit 2/min -j LOG --log-prefix "IPTables-Dropped: " --log-level 4
-A LOGDROP -m comment --comment plain_word -j LOG --log-prefix dropped --log-level 6 --log-tcp-options --log-uid
-A LOGDROP -j LOG --log-prefix "it's \"quoted\""
-A LOGDROP -j DROP
COMMIT
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A PREROUTING -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A PREROUTING -m connmark --mark 0x1 -j MARK --set-mark 0x1
-A OUTPUT -j CONNMARK --set-xmark 0x1/0xff
-A OUTPUT -j CONNMARK --save-mark --mask 0xff
-A FORWARD -o eth0 -p tcp -m tcp --tcp-flags SYN,RST SYN -j TCPMSS --clamp-mss-to-pmtu
-A FORWARD -o eth1 -p tcp -m tcp --tcp-flags SYN,RST SYN -j TCPMSS --set-mss 1400
-A POSTROUTING -j MARK --and-mark 0xff
COMMIT
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A PREROUTING -p udp -m udp --dport 4789 -j NOTRACK
-A PREROUTING -p udp -m udp --dport 4790 -j CT --notrack
-A OUTPUT -p tcp -m tcp --dport 21 -j CT --zone 5
COMMIT
"#;

/// Calico's shape: workload interfaces by wildcard, marks, ipsets, negations, multiport.
const CALICO: &str = r#"*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:cali-FORWARD - [0:0]
:cali-from-wl-dispatch - [0:0]
:cali-fw-cali1234abcd - [0:0]
:cali-to-wl-dispatch - [0:0]
-A FORWARD -m comment --comment "cali:wUHhoiAYhphO9Mso" -j cali-FORWARD
-A cali-FORWARD -m comment --comment "cali:vjrMJCRpqwy5oRoX" -j MARK --set-xmark 0x0/0xe0000
-A cali-FORWARD -i cali+ -m comment --comment "cali:8ZoYfO5HKXWbB3pk" -j cali-from-wl-dispatch
-A cali-FORWARD -o cali+ -m comment --comment "cali:jdEuaPBe14V2hutn" -j cali-to-wl-dispatch
-A cali-FORWARD ! -i cali+ ! -o tunl0 -m mark ! --mark 0x10000/0x10000 -j ACCEPT
-A cali-from-wl-dispatch -i cali1234abcd -m comment --comment "cali:RLo4dwWw0gPYkbvW" -g cali-fw-cali1234abcd
-A cali-from-wl-dispatch -m comment --comment "cali:Vr4lhzGSRVHtH8U8" -j DROP
-A cali-fw-cali1234abcd -m comment --comment "cali:Ge2SgwZDzNfpYBCk" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A cali-fw-cali1234abcd -m comment --comment "cali:GV7OhhzHVP5nEnnT" -m conntrack --ctstate INVALID -j DROP
-A cali-fw-cali1234abcd -m comment --comment "cali:_FCxgUkvfbWUCQyA" -j MARK --set-xmark 0x0/0x10000
-A cali-fw-cali1234abcd -p udp -m comment --comment "cali:6bFZGsHqqr2dj6QR" -m udp --dport 4789 -j DROP
-A cali-fw-cali1234abcd -p tcp -m comment --comment "cali:Xn2xPqKbaBFCyNE8" -m multiport --dports 179,5473 -m set --match-set cali40this-host dst -j ACCEPT
-A cali-fw-cali1234abcd -m comment --comment "cali:ejPlbl3ZNX7jTy47" -m set ! --match-set cali40all-ipam-pools src -j DROP
-A cali-fw-cali1234abcd -m set --match-set cali40s:port-set dst,dst --return-nomatch -j ACCEPT
-A cali-fw-cali1234abcd -m set --match-set cali40this-host src ! --update-counters --packets-gt 10 -j ACCEPT
-A cali-fw-cali1234abcd -m comment --comment "cali:kvHYMw_Ar6j9eR-f" -m mark --mark 0x10000/0x10000 -j RETURN
-A cali-to-wl-dispatch -o cali1234abcd -g cali-fw-cali1234abcd
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:cali-nat-outgoing - [0:0]
-A POSTROUTING -m comment --comment "cali:O3lYWMrLQYEMJtB5" -j cali-nat-outgoing
-A cali-nat-outgoing -m comment --comment "cali:flqWnvo8yq4ULQLa" -m set --match-set cali40masq-ipam-pools src -m set ! --match-set cali40all-ipam-pools dst -j MASQUERADE --random-fully
COMMIT
"#;

const IP6: &str = r#"*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -s fd00::/8 -p ipv6-icmp -m icmp6 --icmpv6-type 128 -j ACCEPT
-A INPUT -p ipv6-icmp -m icmp6 --icmpv6-type 1/3 -j ACCEPT
-A INPUT -i cali+ -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT ! -s 2001:db8::1/128 -p tcp -m tcp --dport 22 -j REJECT --reject-with tcp-reset
-A INPUT -j REJECT --reject-with icmp6-adm-prohibited
-A INPUT -m iprange --src-range fd00::1-fd00::ff -j DROP
-A FORWARD -d fd00:10::/64 -m conntrack --ctorigdst fd00:10::/64 -j ACCEPT
-A FORWARD -s fd00::/ffff:0:ffff:: -j DROP
-A OUTPUT -o + -m limit --limit 1/hour -j LOG --log-prefix "v6 " --log-level 7
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A PREROUTING -d fd00::10/128 -p tcp -m tcp --dport 80 -j DNAT --to-destination [fd00::5]:8080
-A PREROUTING -d fd00::11/128 -p udp -j DNAT --to-destination fd00::6
-A POSTROUTING -s fd00::/64 ! -o eth0 -j MASQUERADE --random-fully
-A POSTROUTING -o eth1 -j SNAT --to-source 2001:db8::1
-A OUTPUT -p tcp -m tcp --dport 80 -j REDIRECT --to-ports 8080
COMMIT
"#;

/// Loads KUBE_DOCKER_FIREWALL, CALICO and IP6 in a private network namespace with the
/// real `{backend}` restores (`iptables-{backend}-restore`, `ip6tables-...`), saves them with
/// `iptables-{backend}-save` and `ip6tables-...`, and reads them with `xtlock rules
/// {flags}` (and `--ip6`). Holds xtlock's lines against the saves', line for line (the
/// same normalisation for both), and returns the save of the IPv4 tables and the number of
/// rules compared per family. `extra` runs last in the namespace.
fn read_back_as_saved(tag: &str, backend: &str, flags: &str, extra: &str) -> (String, [usize; 2]) {
    let s = Scratch::new(tag);
    let dir = s.dir.to_str().unwrap().to_owned();
    write_file(&s.dir, "v4", KUBE_DOCKER_FIREWALL);
    write_file(&s.dir, "calico", CALICO);
    write_file(&s.dir, "v6", IP6);
    let xtlock = xtlock_tests::xtlock_bin();
    let xtlock = xtlock.to_str().unwrap();
    let extra = extra.replace("{dir}", &dir);
    let script = format!(
        "set -e\n\
         ip link set lo up\n\
         for s in cali40all-ipam-pools cali40masq-ipam-pools; do ipset create $s hash:net; done\n\
         ipset create cali40this-host hash:ip\n\
         ipset create cali40s:port-set hash:ip,port\n\
         iptables-{backend}-restore -w 5 < {dir}/v4\n\
         iptables-{backend}-restore -w 5 --noflush < {dir}/calico\n\
         ip6tables-{backend}-restore -w 5 < {dir}/v6\n\
         iptables-{backend}-save > {dir}/save4\n\
         ip6tables-{backend}-save > {dir}/save6\n\
         {xtlock} rules {flags} > {dir}/ours4\n\
         {xtlock} rules {flags} --ip6 > {dir}/ours6\n\
         {extra}"
    );
    let out = std::process::Command::new("unshare")
        .args(["--net", "sh", "-c", &script])
        .output()
        .expect("run unshare");
    assert!(
        out.status.success(),
        "the script failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |name: &str| {
        std::fs::read_to_string(Path::new(&dir).join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let mut compared = [0; 2];
    for (i, (save, ours)) in [("save4", "ours4"), ("save6", "ours6")].iter().enumerate() {
        compared[i] = xtlock_tests::assert_rules_as_saved(
            &format!("{backend} {save}"),
            &read(save),
            &read(ours),
        );
    }
    (read("save4") + &read("extra"), compared)
}

/// xtlock's rendering of every legacy rule equals `iptables-legacy-save`'s, line for line:
/// realistic kube-proxy, dockerd, firewall and calico tables (and ip6tables'), loaded by
/// the real `iptables-legacy-restore` in a private network namespace, then read back by
/// both.
#[test]
fn rules_read_back_as_iptables_save_prints_them() {
    if !require_bpf("rules_read_back_as_iptables_save_prints_them") {
        return;
    }
    let (v4, [rules4, rules6]) =
        read_back_as_saved("rules-save", "legacy", "", ": > {dir}/extra\n");
    assert!(
        rules4 > 100 && rules6 > 10,
        "{rules4} and {rules6} rules: {v4}"
    );
    // The loaded rules are all there, the wildcards as written (`-o +` left out, as save).
    for needle in [
        "-A FORWARD -i br+ -j ACCEPT",
        "-A FORWARD ! -o eth1 -j ACCEPT",
        "-A cali-FORWARD -i cali+ -m comment",
        "--probability 0.33333333349 -j KUBE-SEP-AAAAAAAAAAAAAAAA",
        "-m set ! --match-set cali40all-ipam-pools src",
    ] {
        assert!(v4.contains(needle), "{needle} not in\n{v4}");
    }
}

/// The same through nf_tables: the tables loaded by the real `iptables-nft-restore` and
/// `ip6tables-nft-restore`, `iptables-nft-save`'s lines against `xtlock rules --nft`'s.
/// iptables-nft writes the head of each rule, the ports, tcp flags, marks and limits as
/// native expressions (checked in `nft list ruleset`), which xtlock reads back into
/// iptables' words; the rest stays xt extensions.
#[test]
fn nft_rules_read_back_as_iptables_nft_save_prints_them() {
    if !require_bpf("nft_rules_read_back_as_iptables_nft_save_prints_them") {
        return;
    }
    let (v4, [rules4, rules6]) = read_back_as_saved(
        "rules-nft-save",
        "nft",
        "--nft",
        "nft list ruleset > {dir}/extra\n",
    );
    assert!(
        rules4 > 100 && rules6 > 10,
        "{rules4} and {rules6} rules: {v4}"
    );
    for needle in [
        // Native: the head, ports, tcp flags, fragments, marks and limits.
        "ip saddr != 127.0.0.0/8 ip daddr 127.0.0.0/8",
        "oifname != \"docker0\"",
        "iifname \"cali*\"",
        "tcp dport 8000-8100",
        "tcp flags syn / fin,syn,rst,ack",
        "ip frag-off & 8191 != 0",
        "meta mark & 0x00004000 != 0x00004000",
        "limit rate 2/minute",
        "ip6 saddr & ffff:0:ffff:: == fd00::",
        // iptables-nft-save's own words for them.
        "-A FORWARD -i br+ -j ACCEPT",
        "-A INPUT -f -j DROP",
        "-A INPUT ! -i + -j DROP",
        "-j NFLOG --nflog-prefix \"a b\" --nflog-group 5 --nflog-size 100",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-m tcp --tcp-flags FIN,SYN,RST,ACK SYN -m conntrack --ctstate NEW -m limit --limit 1/sec",
    ] {
        assert!(v4.contains(needle), "{needle} not in\n{v4}");
    }
}
