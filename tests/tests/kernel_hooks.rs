//! Hooks with more than one way in (fentry/fexit, else kprobe/kretprobe): which one attached,
//! or plainly why none did, and what they see. The nf_tables commit hook: an `nft` batch sent
//! by an agent shows as a hold of the second lock, "nf_tables commit (netns N)".
//!
//! On a kernel with neither usable fentry nor kprobes (the host these tests were written on:
//! 6.18 without CONFIG_KPROBES, fentry refused with EPERM) the tests assert the plain
//! "not attached: fentry: ...; kprobe: kernel built without kprobes" report instead of
//! skipping. In the VM (`cargo xtask vm-test`, Debian's 6.1) they assert the real behaviour.

use std::{path::Path, process::Command, time::Duration};

use serde_json::Value;
use xtlock_tests::{
    conntrack_stat, hook_status, hook_statuses, in_ci, in_vm, kernel_has_kprobes, require_bpf,
    send_udp, serial, skip_on_this_kernel, xtlock_bin, Agent, NetnsPair, Scratch, Sysctl, Tracer,
};

const T: Duration = Duration::from_secs(30);

/// `xtlock probes --json`'s entry for the nf_tables commit hook.
fn nft_status(args: &[&str]) -> Value {
    hook_status("nft_commit", args)
}

/// The running kernel's (major, minor).
fn kernel_version() -> (u32, u32) {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut it = r.trim().split(['.', '-']).map(|p| p.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// How many messages of a batch the attached hook counts: all of them with its `bpf_loop`
/// entry program (Linux >= 5.17, where it must be the one attached), else 1,024.
fn nft_walk_limit(args: &[&str]) -> usize {
    let h = nft_status(args);
    let attach = h["attach"].as_str().unwrap_or_default().to_string();
    let looped =
        attach.starts_with("kprobe") && !attach.contains("nft_commit_kprobe_loop, which needs");
    if attach.starts_with("kprobe") && kernel_version() >= (5, 17) {
        assert!(
            looped,
            "bpf_loop is there (>= 5.17) but the bounded walk attached: {h}"
        );
    }
    if looped {
        usize::MAX
    } else {
        1024
    }
}

fn host_netns() -> u64 {
    std::fs::metadata("/proc/self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .expect("own netns")
}

/// Where neither attach type works, the report says why for each, and names what is lost.
fn assert_plain_not_attached(h: &Value) {
    let why = h["error"].as_str().unwrap_or_else(|| {
        panic!("nft_commit attached on a kernel without kprobes: {h}");
    });
    assert!(why.contains("fentry: "), "{why}");
    assert!(
        why.contains("kprobe: kernel built without kprobes"),
        "{why}"
    );
    assert!(
        h["purpose"]
            .as_str()
            .is_some_and(|p| p.contains("nf_tables commit")),
        "{h}"
    );
}

/// The hook's status: attached (in the VM, and wherever kprobes exist), else the plain report.
#[test]
fn nft_commit_hook_reports_its_attach_type() {
    if !require_bpf("nft_commit_hook_reports_its_attach_type") {
        return;
    }
    let _g = serial();
    let h = nft_status(&[]);
    eprintln!("nft_commit: {h}");
    if !in_vm() && !kernel_has_kprobes() && !h["error"].is_string() {
        // fentry worked here: fine too.
        return;
    }
    if !in_vm() && !kernel_has_kprobes() {
        assert_plain_not_attached(&h);
        return;
    }
    assert!(h["error"].is_null(), "nft_commit should attach here: {h}");
    let attach = h["attach"].as_str().unwrap_or_default();
    assert!(
        attach.starts_with("fentry/fexit ") || attach.starts_with("kprobe/kretprobe "),
        "{attach}"
    );
    if attach.starts_with("kprobe/") {
        // Chosen as the fallback: the reason fentry was not used is kept.
        assert!(attach.contains("(fallback; fentry: "), "{attach}");
    }
    // Forcing the fallback.
    let h = nft_status(&["--no-attach", "fentry"]);
    eprintln!("nft_commit with --no-attach fentry: {h}");
    assert!(h["error"].is_null(), "{h}");
    let attach = h["attach"].as_str().unwrap_or_default();
    assert!(attach.starts_with("kprobe/kretprobe "), "{attach}");
    assert!(
        attach.contains("fentry: ruled out by --no-attach fentry"),
        "{attach}"
    );
    // The old variable still works.
    let mut c = Command::new(xtlock_bin());
    c.args(["probes", "--json"])
        .env("XTLOCK_DISABLE_FENTRY", "1");
    let out = c.output().expect("run xtlock probes");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ruled out by --no-attach fentry"),
        "{out:?}"
    );
}

/// Runs `nft add table; nft add chain` in a new netns, started by an agent named
/// firewalld, under `xtlock trace` (with `env`); returns the nf_tables commit holds.
fn nft_commits_under_trace(args: &[&str], table: &str) -> (Vec<Value>, String) {
    let s = Scratch::new(&format!("nft-{table}"));
    let lock = s.lock_file("xtables.lock");
    let firewalld = s.agent("firewalld");
    let mut c = Command::new(xtlock_bin());
    c.args(["trace", "--json", "--duration", "12000ms", "--no-drops"])
        .arg("--lock-file")
        .arg(&lock);
    c.args(args);
    let tracer = Tracer::spawn(c);
    // Four batches: a table, a chain, 300 rules, then 1,500 (more than the hook walks);
    // then the kernel's own count of the rules.
    let dir = lock.parent().unwrap();
    let rules = |n: usize| -> String {
        let f = dir.join(format!("rules{n}.nft"));
        let text: String = (0..n)
            .map(|i| format!("add rule inet {table} c tcp dport {} counter\n", 1000 + i))
            .collect();
        std::fs::write(&f, text).unwrap();
        f.to_str().unwrap().to_string()
    };
    let count = dir.join("rules.count");
    let script = format!(
        "nft add table inet {table} && nft add chain inet {table} c && nft -f {} && nft -f {} \
         && nft list chain inet {table} c | grep -c counter > {}",
        rules(NFT_RULES[0]),
        rules(NFT_RULES[1]),
        count.display()
    );
    let mut fw = Agent::spawn(
        &firewalld,
        &["run", "--netns", "sh", "-c", &script],
        &[],
        None,
    );
    fw.ts("start", T);
    assert_eq!(fw.wait(), 0, "nft failed");
    let trace = tracer.finish();
    let holds = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| {
            h["lock"]
                .as_str()
                .is_some_and(|l| l.starts_with("nf_tables commit"))
        })
        .cloned()
        .collect::<Vec<_>>();
    for h in &holds {
        eprintln!("nf_tables commit hold: {h}");
    }
    let in_kernel: usize = std::fs::read_to_string(&count)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(in_kernel, NFT_RULES[0] + NFT_RULES[1], "the kernel's rules");
    (holds, trace.dump())
}

/// Rules of the third and fourth batches.
const NFT_RULES: [usize; 2] = [300, 1500];

/// What batch `i` changed, counted from its messages: (status, changes, added).
fn nft_batch(holds: &[Value], i: usize) -> (String, Option<u64>, Value) {
    let b = &holds[i]["nft"];
    (
        b["status"].as_str().unwrap_or("none").to_string(),
        b["changes"].as_u64(),
        b["added"].clone(),
    )
}

fn nft_added(kind: &str, n: usize) -> Value {
    serde_json::json!({ kind: n })
}

/// The four batches of [`nft_commits_under_trace`]: a table, a chain, 300 rules, and 1,500,
/// of which the hook counts the first `limit`.
fn assert_nft_batches(holds: &[Value], limit: usize, dump: &str) {
    assert_nft_holds(holds, 4, dump);
    let complete =
        |kind: &str, n: usize| ("complete".to_string(), Some(n as u64), nft_added(kind, n));
    assert_eq!(nft_batch(holds, 0), complete("tables", 1), "{dump}");
    assert_eq!(nft_batch(holds, 1), complete("chains", 1), "{dump}");
    assert_eq!(
        nft_batch(holds, 2),
        complete("rules", NFT_RULES[0]),
        "{dump}"
    );
    let big = NFT_RULES[1];
    let want = if big > limit {
        (
            "partial".to_string(),
            Some(limit as u64),
            nft_added("rules", limit),
        )
    } else {
        complete("rules", big)
    };
    assert_eq!(nft_batch(holds, 3), want, "{dump}");
}

/// `n` commits by firewalld's nft, in one netns that is not the host's.
fn assert_nft_holds(holds: &[Value], n: usize, dump: &str) {
    assert_eq!(holds.len(), n, "{n} nft batches, {n} commits:\n{dump}");
    let host = host_netns();
    for h in holds {
        assert_eq!(h["comm"], "nft", "{h}");
        assert_eq!(h["agent"], "firewalld", "{h}");
        let lock = h["lock"].as_str().unwrap_or_default();
        let netns: u64 = lock
            .trim_start_matches("nf_tables commit (netns ")
            .trim_end_matches(')')
            .parse()
            .unwrap_or_else(|_| panic!("no netns in {lock:?}"));
        assert_ne!(netns, host, "nft ran in its own netns: {h}");
        assert!(h["hold_ns"].as_u64().is_some_and(|n| n > 0), "{h}");
    }
    assert!(
        holds.iter().all(|h| h["lock"] == holds[0]["lock"]),
        "same netns for all"
    );
}

/// An nft batch is a hold of the second lock, with the right process and netns and what the
/// batch changed (against the kernel's own rule count); the same through the kprobe fallback.
#[test]
fn nft_batch_is_an_nf_tables_commit_hold() {
    if !require_bpf("nft_batch_is_an_nf_tables_commit_hold") {
        return;
    }
    let _g = serial();
    if Command::new("nft").arg("--version").output().is_err() {
        assert!(!in_vm() && !in_ci(), "nft missing (the nftables package)");
        eprintln!("skipped: nft not installed (apt-get install nftables)");
        return;
    }
    let h = nft_status(&[]);
    if h["error"].is_string() {
        if in_vm() || kernel_has_kprobes() {
            panic!("nft_commit did not attach: {h}");
        }
        assert_plain_not_attached(&h);
        // The batches are timed from their sendmsg() instead, and counted there.
        let (holds, dump) = nft_commits_under_trace(&[], "xtlock_a");
        assert_send_batches(&holds, &[], &dump);
        return;
    }
    let (holds, dump) = nft_commits_under_trace(&[], "xtlock_a");
    assert_nft_batches(&holds, nft_walk_limit(&[]), &dump);
    // nft_commit times the batches, so their sendmsg() hooks stay off: they would run a
    // program on every sendmsg() of the node for holds the analysis drops.
    for p in ["sys_enter_sendmsg", "sys_exit_sendmsg"] {
        let s = hook_status(p, &[]);
        assert!(
            s["needless"] == true
                && s["error"].is_null()
                && s["attach"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("not needed: nft_commit")),
            "{s}"
        );
    }
    if kernel_has_kprobes() {
        let no_fentry = ["--no-attach", "fentry"];
        let (holds, dump) = nft_commits_under_trace(&no_fentry, "xtlock_b");
        assert_nft_batches(&holds, nft_walk_limit(&no_fentry), &dump);
        // No function hook at all, as on this test's host: the sendmsg() tracepoints.
        let tracepoints = ["--no-attach", "fentry,kprobe"];
        let (holds, dump) = nft_commits_under_trace(&tracepoints, "xtlock_c");
        assert_send_batches(&holds, &tracepoints, &dump);
    }
}

/// Where `nft_commit` does not attach: the batches' holds come from their `sendmsg()` on
/// its tracepoints, counted there by `sys_enter_sendmsg_loop` (which must be the program
/// attached where the kernel has `bpf_loop`, 5.17+), else not counted.
fn assert_send_batches(holds: &[Value], args: &[&str], dump: &str) {
    let h = hook_status("sys_enter_sendmsg", args);
    eprintln!("sys_enter_sendmsg: {h}");
    let attach = h["attach"].as_str().unwrap_or_default();
    assert!(
        attach.starts_with("tracepoint syscalls:sys_enter_sendmsg"),
        "the function hooks are ruled out: {h}"
    );
    let looped = attach.contains("(program sys_enter_sendmsg_loop)");
    if kernel_version() >= (5, 17) {
        assert!(looped, "bpf_loop is there (>= 5.17): {h}");
    } else {
        assert!(
            attach.contains("not sys_enter_sendmsg_loop, which needs"),
            "{h}"
        );
    }
    if looped {
        assert_nft_batches(holds, usize::MAX, dump);
    } else {
        assert_nft_holds(holds, 4, dump);
        for i in 0..4 {
            assert_eq!(nft_batch(holds, i).0, "none", "not counted: {dump}");
        }
    }
}

/// What one run of the flock scenario showed, per agent.
#[derive(Debug, PartialEq, Eq)]
struct FlockSeen {
    failed_tries: u64,
    poll_waits: Vec<(String, u64)>,
    blocking_waits: usize,
    holds: usize,
}

/// firewalld holds the lock 1.5 s; portmap polls it Go-style (LOCK_NB every 50 ms) and
/// calico-node blocks in flock().
fn flock_scenario(extra: &[&str], name: &str) -> (FlockSeen, u64, String) {
    let s = Scratch::new(name);
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap();
    let firewalld = s.agent("firewalld");
    let portmap = s.agent("portmap");
    let calico = s.agent("calico-node");
    let tracer = Tracer::start(&[&lock], Duration::from_secs(6), extra);
    let mut fw = Agent::spawn(&firewalld, &["hold", lock_s, "1500"], &[], None);
    fw.ts("acquired", T);
    let mut pm = Agent::spawn(&portmap, &["poll", lock_s, "200", "50"], &[], None);
    let mut cn = Agent::spawn(&calico, &["hold", lock_s, "10"], &[], None);
    let tries: u64 = pm.expect("tries", T)[0].parse().unwrap();
    assert_eq!(pm.wait(), 0);
    cn.ts("acquired", T);
    fw.wait();
    cn.wait();
    let trace = tracer.finish();
    let dump = trace.dump();
    let failed_tries = trace
        .of_type("failed_try")
        .into_iter()
        .filter(|f| f["agent"] == "portmap")
        .count() as u64;
    let waits = trace.of_type("wait");
    let poll_waits = waits
        .iter()
        .filter(|w| w["mode"] == "poll")
        .map(|w| {
            (
                w["agent"].as_str().unwrap_or("").to_string(),
                w["tries"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    let blocking_waits = waits
        .iter()
        .filter(|w| w["agent"] == "calico-node" && w["mode"] != "poll")
        .count();
    let holds = trace.of_type("hold").len();
    (
        FlockSeen {
            failed_tries,
            poll_waits,
            blocking_waits,
            holds,
        },
        tries,
        dump,
    )
}

/// The lock needs no syscall hook: the scenario gives the same analysis with every
/// `syscalls:` tracepoint ruled out (on this host the other syscall hooks then attach
/// nowhere; in the VM they are on their functions anyway). How a blocking wait ends comes
/// from the lock tracepoint (the retry that takes the lock) and `signal:signal_deliver`. The
/// same again with the lock tracepoint as a plain tracepoint instead of tp_btf.
#[test]
fn flock_is_traced_without_any_syscall_hook() {
    if !require_bpf("flock_is_traced_without_any_syscall_hook") {
        return;
    }
    let _g = serial();
    let hooks = hook_statuses(&[]);
    let on_flock: Vec<&str> = hooks
        .iter()
        .filter_map(|h| h["program"].as_str())
        .filter(|p| p.contains("flock"))
        .collect();
    assert_eq!(on_flock, ["flock_lock_inode"], "{hooks:?}");
    let h = hook_status("signal_deliver", &[]);
    assert!(h["error"].is_null(), "{h}");
    assert_eq!(h["attach"], "tracepoint signal:signal_deliver", "{h}");

    // The lock hook is the tracepoint as tp_btf where the kernel has BTF, and the plain
    // tracepoint when that is ruled out: the scenario runs on both.
    let lock_hook = hook_status("flock_lock_inode", &[]);
    if std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        assert_eq!(
            lock_hook["attach"], "tp_btf filelock:flock_lock_inode",
            "{lock_hook}"
        );
    }
    // So is the drop hook, on every kernel the VM runs (5.10 without the reason argument,
    // 6.12 with the receiving socket after it): the verifier takes its BTF reads there too.
    let drop_hook = hook_status("kfree_skb", &[]);
    if std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        assert_eq!(drop_hook["attach"], "tp_btf skb:kfree_skb", "{drop_hook}");
    }
    let no_btf: &[&str] = &["--no-attach", "tp_btf"];
    let h = hook_status("flock_lock_inode", no_btf);
    assert_eq!(
        h["attach"],
        "tracepoint filelock:flock_lock_inode (fallback; tp_btf: ruled out by --no-attach \
         tp_btf)",
        "{h}"
    );
    // Syscall hooks take their function first where the kernel lets them (in the VM):
    // a syscall tracepoint taxes every syscall on the node.
    let h = hook_status("sys_enter_execve", &[]);
    if in_vm() || kernel_has_kprobes() {
        let a = h["attach"].as_str().unwrap_or("");
        assert!(a.starts_with("fentry") || a.starts_with("kprobe"), "{h}");
    }

    let no_syscalls: &[&str] = &["--no-attach", "syscalls:tracepoint"];
    for (name, extra) in [
        ("default", &[][..]),
        ("no-syscalls", no_syscalls),
        ("plain-tracepoint", no_btf),
    ] {
        let (seen, tries, dump) = flock_scenario(extra, &format!("flock-{name}"));
        eprintln!("{name}: {seen:?} (portmap counted {tries} failed tries)");
        // Exact against the poller's own count.
        assert_eq!(seen.failed_tries, tries, "{name}:\n{dump}");
        assert_eq!(
            seen.poll_waits,
            vec![("portmap".to_string(), tries)],
            "{name}:\n{dump}"
        );
        assert_eq!(seen.blocking_waits, 1, "{name}:\n{dump}");
        assert_eq!(seen.holds, 3, "{name}:\n{dump}");
    }
}

/// Runs UDP flows from a to b under the sysctls, traced: `send` sends them; returns the
/// `conntrack_refused` facts of b's netns, the delta of b's conntrack counter `stat`, and the
/// trace's dump.
fn refusals(
    name: &str,
    sysctls: &[(&str, &str)],
    stat: &str,
    send: impl FnOnce(&Scratch, &NetnsPair),
) -> (Vec<Value>, u64, NetnsPair, String) {
    let s = Scratch::new(name);
    let lock = s.lock_file("xtables.lock");
    let ns = NetnsPair::new(name, 203);
    NetnsPair::conntrack_on(&ns.b);
    let before = conntrack_stat(&ns.b, stat);
    let tracer = Tracer::start(&[&lock], Duration::from_secs(300), &["--no-drops"]);
    {
        // Restored before the namespace goes, whatever happens.
        let _guards: Vec<Sysctl> = sysctls.iter().map(|(p, v)| Sysctl::set(p, v)).collect();
        send(&s, &ns);
        std::thread::sleep(Duration::from_millis(500));
    }
    tracer.interrupt();
    let trace = tracer.finish();
    let delta = conntrack_stat(&ns.b, stat) - before;
    let inode = NetnsPair::inode(&ns.b);
    let facts = trace
        .of_type("conntrack_refused")
        .into_iter()
        .filter(|f| f["netns"].as_u64() == Some(inode))
        .cloned()
        .collect();
    (facts, delta, ns, trace.dump())
}

/// Every refusal carries the flow that was refused: a's address to b's `dport` (or any port
/// when `None`), no two refusals for the same flow.
fn assert_flows(facts: &[Value], ns: &NetnsPair, dport: Option<u64>, dump: &str) {
    let mut flows = std::collections::BTreeSet::new();
    for f in facts {
        let p = &f["packet"];
        assert_eq!(p["proto"], "udp", "{f}");
        assert_eq!(p["saddr"], ns.addr_a.as_str(), "{f}");
        assert_eq!(p["daddr"], ns.addr_b.as_str(), "{f}");
        if let Some(d) = dport {
            assert_eq!(p["dport"], d, "{f}");
        }
        flows.insert((
            p["sport"].as_u64().unwrap_or(0),
            p["dport"].as_u64().unwrap_or(0),
        ));
    }
    assert_eq!(flows.len(), facts.len(), "one refusal per flow:\n{dump}");
}

/// The conntrack hooks: a full table and a hash chain too long (nf_conntrack_buckets=1, so
/// every entry shares one chain and confirm refuses once it passes the kernel's limit) each
/// give one `conntrack_refused` per refused flow, with its addresses, exactly as many as the
/// kernel's own counters (`drop`, `insert_failed`) rose.
#[test]
fn conntrack_refusals_come_with_their_flows() {
    if !require_bpf("conntrack_refusals_come_with_their_flows") {
        return;
    }
    let _g = serial();
    let full = hook_status("conntrack_table_full", &[]);
    let insert = hook_status("conntrack_insert_failed", &[]);
    eprintln!("conntrack hooks: {full}\n{insert}");
    if !in_vm() && !kernel_has_kprobes() && full["error"].is_string() {
        for h in [&full, &insert] {
            let why = h["error"].as_str().unwrap_or("");
            assert!(
                why.contains("kprobe: kernel built without kprobes"),
                "{why}"
            );
        }
        eprintln!("conntrack refusals are not visible on this kernel: counters only");
        return;
    }
    for h in [&full, &insert] {
        assert!(h["error"].is_null(), "{h}");
    }

    let (facts, drop_delta, ns, dump) = refusals(
        "xtk-ctfull",
        &[("/proc/sys/net/netfilter/nf_conntrack_max", "64")],
        "drop",
        |s, ns| {
            send_udp(s, &ns.a, &ns.addr_b, 7777, 400, 400);
        },
    );
    assert!(
        drop_delta >= 100,
        "conntrack dropped only {drop_delta} of 400 flows"
    );
    assert!(
        facts.iter().all(
            |f| f["class"] == "conntrack_table_full" && f["function"] == "__nf_conntrack_alloc"
        ),
        "{dump}"
    );
    assert_eq!(
        facts.len() as u64,
        drop_delta,
        "refusals vs conntrack -S drop:\n{dump}"
    );
    assert_flows(&facts, &ns, Some(7777), &dump);
    drop(ns);

    // Confirm refuses over-long hash chains since Linux 5.16, which added the chaintoolong
    // counter with it: without the counter, nothing to provoke.
    let stats = std::process::Command::new("conntrack")
        .arg("-S")
        .output()
        .expect("run conntrack -S");
    assert!(stats.status.success(), "conntrack -S: {stats:?}");
    if !String::from_utf8_lossy(&stats.stdout).contains("chaintoolong=") {
        skip_on_this_kernel(
            "conntrack_refusals_come_with_their_flows (chain too long)",
            "conntrack never refuses an entry for an over-long hash chain (no chaintoolong \
             counter in `conntrack -S`: Linux < 5.16)",
        );
        return;
    }

    // Hash chains too long for confirm: the fewest buckets the kernel allows (it rounds up
    // to a page of them), and 40 flows per bucket, so the chains pass confirm's limit (50 to
    // 80 entries, drawn per insert) about halfway through.
    let buckets = "/proc/sys/net/netfilter/nf_conntrack_buckets";
    let (facts, failed_delta, ns, dump) = refusals(
        "xtk-ctchain",
        &[
            ("/proc/sys/net/netfilter/nf_conntrack_max", "262144"),
            (buckets, "1"),
        ],
        "insert_failed",
        |s, ns| {
            let n: u64 = std::fs::read_to_string(buckets)
                .expect("read nf_conntrack_buckets")
                .trim()
                .parse()
                .expect("a number of buckets");
            let flows = (n * 40).min(60_000).to_string();
            eprintln!("{n} conntrack buckets, sending {flows} flows");
            let helper = s.agent("udp-sender");
            let mut a = Agent::spawn(
                Path::new("ip"),
                &[
                    "netns",
                    "exec",
                    &ns.a,
                    helper.to_str().unwrap(),
                    "udp-ports",
                    &ns.addr_b,
                    "1024",
                    &flows,
                ],
                &[],
                None,
            );
            a.expect("sent", Duration::from_secs(120));
            assert_eq!(a.wait(), 0, "udp sender failed: {:?}", a.seen);
        },
    );
    eprintln!(
        "insert_failed rose by {failed_delta}; {} refusals reported",
        facts.len()
    );
    assert!(
        failed_delta >= 100,
        "insert_failed rose by only {failed_delta}"
    );
    assert!(
        facts.iter().all(|f| f["class"] == "conntrack_insert_failed"
            && f["function"] == "__nf_conntrack_confirm"),
        "{dump}"
    );
    assert_eq!(
        facts.len() as u64,
        failed_delta,
        "refusals vs conntrack -S insert_failed:\n{dump}"
    );
    assert_flows(&facts, &ns, None, &dump);
}

/// Unloads `module` and first the modules that use it (`/sys/module/M/holders`: e.g.
/// nf_conntrack_netlink, which `conntrack -S` loads, holds nfnetlink), waiting out references
/// that are going away (namespaces of earlier tests); true when it is gone.
fn unload(module: &str) -> bool {
    let dir = Path::new("/sys/module").join(module);
    for _ in 0..50 {
        if !dir.exists() {
            return true;
        }
        if let Ok(holders) = std::fs::read_dir(dir.join("holders")) {
            for h in holders.flatten() {
                if let Some(name) = h.file_name().to_str() {
                    unload(name);
                }
            }
        }
        let _ = Command::new("rmmod").arg(module).status();
        std::thread::sleep(Duration::from_millis(100));
    }
    !dir.exists()
}

/// nf_tables loads after xtlock started (as it does on demand, at the first nft command): the
/// nf_tables commit hook is reported as waiting for the module, attaches within seconds of the
/// module appearing, without a restart, and later batches are holds. Needs nf_tables as a
/// module: it runs in the VM (`cargo xtask vm-test`, part of the README's test command).
#[test]
fn nf_tables_loaded_after_start_is_hooked() {
    if !require_bpf("nf_tables_loaded_after_start_is_hooked") {
        return;
    }
    if !in_vm() {
        eprintln!(
            "nf_tables_loaded_after_start_is_hooked: runs in the VM only (this kernel has no \
             loadable nf_tables); `cargo xtask vm-test` runs it"
        );
        return;
    }
    let _g = serial();
    assert!(
        unload("nf_tables") && unload("nfnetlink"),
        "cannot unload nf_tables/nfnetlink"
    );
    let h = nft_status(&[]);
    let why = h["error"].as_str().unwrap_or_default();
    assert!(why.contains("module nf_tables not loaded"), "{h}");

    let s = Scratch::new("nft-late");
    let lock = s.lock_file("xtables.lock");
    let firewalld = s.agent("firewalld");
    let tracer = Tracer::start(&[&lock], Duration::from_secs(120), &["--no-drops"]);
    // The first nft loads the modules (request_module), as on a node.
    xtlock_tests::sh("nft", &["add", "table", "inet", "xtlock_late_load"]);
    assert!(Path::new("/sys/module/nf_tables").exists());
    // Pending hooks are retried every 5 s.
    assert!(
        tracer.wait_for_stderr("module loaded: hook attached", Duration::from_secs(30)),
        "the nf_tables commit hook did not attach within 30 s of nf_tables loading"
    );
    let script = "nft add table inet xtlock_late && nft add chain inet xtlock_late c";
    let mut fw = Agent::spawn(
        &firewalld,
        &["run", "--netns", "sh", "-c", script],
        &[],
        None,
    );
    fw.ts("start", T);
    assert_eq!(fw.wait(), 0, "nft failed");
    tracer.interrupt();
    let trace = tracer.finish();
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", "xtlock_late_load"])
        .status();
    let holds: Vec<&Value> = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["agent"] == "firewalld")
        .collect();
    let holds: Vec<Value> = holds.into_iter().cloned().collect();
    let dump = trace.dump();
    assert_nft_holds(&holds, 2, &dump);
    // The batch walk's config was written when the hook attached after the module loaded.
    assert_eq!(
        (nft_batch(&holds, 0).2, nft_batch(&holds, 1).2),
        (nft_added("tables", 1), nft_added("chains", 1)),
        "{dump}"
    );
}

/// calico-node writes its rules through legacy xtables (`iptables-legacy`) and kube-proxy
/// through nf_tables (`iptables-nft`) in one network namespace; in a second one kube-proxy
/// alone. Each write is a `rule_write` of its agent, backend and netns; the first namespace
/// is said once as holding both backends' rules, naming who writes through which, and the
/// second is not. The independent truth: each backend's own `iptables-save` in that
/// namespace shows only its own rule. Where nf_tables commits cannot be hooked (the host),
/// the legacy writes and their netns are still checked, and no mixed netns can be said.
#[test]
fn both_backends_in_one_netns_are_named() {
    if !require_bpf("both_backends_in_one_netns_are_named") {
        return;
    }
    let _g = serial();
    let nft_seen = nft_status(&[])["error"].is_null();
    if !nft_seen && (in_vm() || kernel_has_kprobes()) {
        panic!("nft_commit did not attach: {}", nft_status(&[]));
    }
    let s = Scratch::new("mixed-backends");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap();
    let ns = NetnsPair::new("xtlock-mixed", 47);
    let (mixed_ino, nft_only_ino) = (NetnsPair::inode(&ns.a), NetnsPair::inode(&ns.b));
    // Stopped once the writes are done: under emulation four of them take seconds.
    let tracer = Tracer::start(&[&lock], Duration::from_secs(300), &["--no-drops"]);
    let calico = s.agent("calico-node");
    let kube_proxy = s.agent("kube-proxy");
    let write = |agent: &Path, netns: &str, prog: &str, port: &str| {
        let mut a = Agent::spawn(
            Path::new("ip"),
            &[
                "netns",
                "exec",
                netns,
                agent.to_str().unwrap(),
                "run",
                prog,
                "-w",
                "-A",
                "INPUT",
                "-p",
                "tcp",
                "--dport",
                port,
                "-j",
                "ACCEPT",
            ],
            &[("XTABLES_LOCKFILE", lock_s)],
            None,
        );
        assert_eq!(a.wait_within(T), 0, "{prog} in {netns}");
    };
    write(&calico, &ns.a, "iptables-legacy", "9");
    write(&kube_proxy, &ns.a, "iptables-nft", "10");
    write(&kube_proxy, &ns.b, "iptables-nft", "11");
    write(&calico, &ns.a, "iptables-legacy", "12");
    std::thread::sleep(Duration::from_millis(500));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    // The truth: each backend's save in the mixed netns shows only its own rules.
    let legacy_save = NetnsPair::exec(&ns.a, "iptables-legacy-save", &[]);
    let nft_save = NetnsPair::exec(&ns.a, "iptables-nft-save", &[]);
    assert!(legacy_save.contains("--dport 9 ") && !legacy_save.contains("--dport 10 "));
    assert!(nft_save.contains("--dport 10 ") && !nft_save.contains("--dport 9 "));

    let writes: Vec<(String, String, u64)> = trace
        .of_type("rule_write")
        .iter()
        .map(|w| {
            (
                w["agent"].as_str().unwrap_or("?").to_string(),
                w["backend"].as_str().unwrap_or("?").to_string(),
                w["netns"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    let legacy = ("calico-node".to_string(), "legacy".to_string(), mixed_ino);
    assert_eq!(
        writes.iter().filter(|w| **w == legacy).count(),
        2,
        "two legacy writes (one table replace each) by calico-node in {mixed_ino}:\n{dump}"
    );
    // The binary as resolved on disk, and the version it carries: `iptables -V`'s.
    let binaries = |backend: &str| -> Vec<String> {
        trace
            .of_type("rule_write")
            .iter()
            .filter(|w| w["backend"] == backend)
            .map(|w| w["binary"].as_str().unwrap_or("?").to_string())
            .collect()
    };
    let version = |prog: &str| -> String {
        let out = Command::new(prog).arg("-V").output().expect("iptables -V");
        let v = String::from_utf8_lossy(&out.stdout);
        // `iptables v1.8.9 (legacy)`
        v.trim()
            .split_once(" v")
            .map(|(_, v)| v.to_string())
            .unwrap_or_default()
    };
    let want = format!("xtables-legacy-multi {}", version("iptables-legacy"));
    assert!(
        binaries("legacy").iter().all(|b| *b == want),
        "{want}: {:?}",
        binaries("legacy")
    );
    let mixed = trace.of_type("mixed_backends");
    // Without the nft_commit hook, each nf_tables write is counted from the read that
    // follows its writer's exit: the same facts on every kernel.
    if !nft_seen {
        assert_plain_not_attached(&nft_status(&[]));
    }
    for ino in [mixed_ino, nft_only_ino] {
        let kp = ("kube-proxy".to_string(), "nft".to_string(), ino);
        assert!(
            writes.contains(&kp),
            "kube-proxy's nft write in {ino}:\n{dump}"
        );
    }
    let want = format!("xtables-nft-multi {}", version("iptables-nft"));
    assert!(
        binaries("nft").iter().all(|b| *b == want),
        "{want}: {:?}",
        binaries("nft")
    );
    assert_eq!(mixed.len(), 1, "{dump}");
    let m = mixed[0];
    assert_eq!(m["netns"], mixed_ino, "{dump}");
    assert_eq!(
        m["legacy"],
        serde_json::json!(["calico-node (iptables-legacy)"])
    );
    assert_eq!(m["nft"], serde_json::json!(["kube-proxy (iptables-nft)"]));
    let rows = &trace.summary()["rule_writes"];
    assert!(
        rows.as_array()
            .is_some_and(|r| r.iter().any(|r| r["agent"] == "kube-proxy"
                && r["backend"] == "nft"
                && r["writes"].as_u64() >= Some(2))),
        "{rows}"
    );
}

/// Runs of every BPF program loaded, summed (`kernel.bpf_stats_enabled` on), from bpftool.
fn bpf_runs() -> u64 {
    let out = Command::new("bpftool")
        .args(["prog", "show", "--json"])
        .output()
        .expect("run bpftool");
    assert!(out.status.success(), "bpftool prog show: {out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool's JSON");
    v.as_array()
        .expect("a list of programs")
        .iter()
        .filter_map(|p| p["run_cnt"].as_u64())
        .sum()
}

/// Legacy table reads and replaces are hooked at netfilter's own socket-option functions
/// where fentry or kprobes attach (`nf_getsockopt`, `nf_setsockopt`): a client's own socket
/// options (the `SO_ERROR` read after every non-blocking connect, `TCP_NODELAY`) run no
/// program, while iptables' reads and replaces are still seen. Where only the syscall
/// tracepoints attach (this host), each such call runs two programs, and the same count
/// says so: the test tells the two apart by the runs alone.
#[test]
fn socket_options_not_netfilters_run_no_program() {
    if !require_bpf("socket_options_not_netfilters_run_no_program") {
        return;
    }
    let _g = serial();
    let narrow = in_vm() || kernel_has_kprobes();
    for (hook, function) in [
        ("sys_enter_getsockopt", "nf_getsockopt"),
        ("sys_exit_getsockopt", "nf_getsockopt"),
        ("sys_enter_setsockopt", "nf_setsockopt"),
        ("sys_exit_setsockopt", "nf_setsockopt"),
    ] {
        let h = hook_status(hook, &[]);
        let a = h["attach"].as_str().unwrap_or_default();
        assert!(h["error"].is_null(), "{h}");
        if narrow {
            assert!(
                (a.starts_with("fentry") || a.starts_with("kprobe")) && a.contains(function),
                "{h}"
            );
        } else {
            assert!(a.starts_with("tracepoint syscalls:"), "{h}");
        }
    }

    let s = Scratch::new("sockopts");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().expect("utf-8 path");
    let tracer = Tracer::start(&[&lock], Duration::from_secs(300), &["--no-drops"]);
    let _stats = Sysctl::set("/proc/sys/kernel/bpf_stats_enabled", "1");
    const CALLS: u64 = 20_000;
    let before = bpf_runs();
    let mut client = Agent::spawn(
        &s.agent("client"),
        &["sockopts", &CALLS.to_string()],
        &[],
        None,
    );
    assert_eq!(client.wait(), 0, "the socket-option loop failed");
    let runs = bpf_runs().saturating_sub(before);
    // Then iptables itself: its reads and its replace must still be seen.
    let mut kp = Agent::spawn(
        &s.agent("kube-proxy"),
        &[
            "run",
            "--netns",
            "iptables-legacy",
            "-w",
            "-A",
            "INPUT",
            "-j",
            "ACCEPT",
        ],
        &[("XTABLES_LOCKFILE", lock_s)],
        None,
    );
    assert_eq!(kp.wait(), 0, "iptables-legacy -A failed");
    std::thread::sleep(Duration::from_millis(500));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();
    eprintln!(
        "{} socket-option calls ({CALLS} get, {CALLS} set): {runs} BPF program runs",
        2 * CALLS
    );
    if narrow {
        // The loop's calls run nothing; what else ran meanwhile (the client's exec and
        // exit, other hooks of the node) is far below one run a call.
        assert!(runs < CALLS / 4, "{runs} runs for {} calls", 2 * CALLS);
    } else {
        // Enter and exit, for each of the 2 x CALLS calls.
        assert!(runs >= 4 * CALLS, "{runs} runs for {} calls", 2 * CALLS);
    }
    let holds: Vec<&Value> = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["agent"] == "kube-proxy")
        .collect();
    assert_eq!(holds.len(), 1, "{dump}");
    let n = |k: &str| holds[0][k].as_u64().unwrap_or(0);
    // libiptc's init reads the table (GET_INFO, GET_ENTRIES), then replaces it.
    assert!(n("reads") >= 2, "no table reads: {}", holds[0]);
    assert!(n("replaces") >= 1, "no replace: {}", holds[0]);
}
