//! No byte of a traced process's names or arguments reaches the terminal raw. Any local user
//! can start a process whose argv[0], file name (its comm) and arguments hold escape
//! sequences and newlines, and name a pod's log file likewise; `trace` and `report --events`
//! print them as visible escapes (`\e`, `\n`, `\x07`), so nothing can retitle or clear the
//! SRE's terminal or print a line that looks like xtlock's own.

use std::{process::Command, time::Duration};

use xtlock_tests::{
    kubelet_logs, require_bpf, serial, xtlock_bin, Agent, PodCgroup, Scratch, Tracer,
};

const T: Duration = Duration::from_secs(20);
/// What a forged line would look like: xtlock's own wording, at the start of a line.
const FORGED: &str = "06:00:00.000 kube-proxy held /run/xtables.lock 42.0 s (FAKE)";

/// Every output checked the same way: nothing a terminal obeys but the line breaks, the
/// forged text only ever after an escaped newline, and the hostile names shown (escaped).
fn assert_safe(what: &str, out: &str, must_show: &[&str]) {
    if let Some(c) = out.chars().find(|c| c.is_control() && *c != '\n') {
        panic!("{what}: a raw control character {c:?} in:\n{out:?}");
    }
    for l in out.lines() {
        if l.contains("FAKE") {
            assert!(
                !l.starts_with("06:00:00.000") && l.contains("\\nFAKE")
                    || l.contains(&format!("\\n{FORGED}")),
                "{what}: a line of the traced process's own:\n{l}\n\n{out}"
            );
        }
    }
    for s in must_show {
        assert!(out.contains(s), "{what}: `{s}` not shown in:\n{out}");
    }
}

#[test]
fn hostile_names_and_arguments_are_escaped_live_and_in_captures() {
    if !require_bpf("hostile_names_and_arguments_are_escaped_live_and_in_captures") {
        return;
    }
    let _g = serial();
    const UID: &str = "7a1c2e3f-8b7d-4c6e-9a1f-0d2b3c4e5f6a";
    let cid = format!("{:064x}", 0xbad1u32 + std::process::id());
    let s = Scratch::new("hostile");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap();
    let root = s.dir.join("host");
    // A pod name from the kubelet's file names: OSC (set the title), BEL, a newline.
    kubelet_logs(
        &root,
        "kube-system",
        "evil\x1b]0;owned\x07\nFAKE",
        UID,
        "c\x1b[2J",
        &cid,
    );
    let cg = PodCgroup::new(UID, &cid);
    // The helper under a hostile file name: its comm and argv[0] carry the escapes.
    let agent = s.agent("kube-proxy\x1b]0;pwn\x07\nFAKE");
    let capture = s.dir.join("hostile.xtlock");
    let mut c = Command::new(xtlock_bin());
    c.args([
        "trace",
        "--duration",
        "6s",
        "--no-drops",
        "--summary-interval",
        "0s",
    ])
    .arg("--lock-file")
    .arg(&lock)
    .arg("--host-root")
    .arg(&root)
    .arg("--record")
    .arg(&capture)
    .args(xtlock_tests::tracer_extra_args());
    let tracer = Tracer::spawn(c);
    let (sh, args) = cg.command(&agent, &["hold", lock_s, "300"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut a = Agent::spawn(&sh, &args, &[], None);
    a.ts("acquired", T);
    assert_eq!(a.wait(), 0);
    // A real iptables with a hostile argument, started by the hostile agent.
    let (sh, args) = cg.command(
        &agent,
        &[
            "run",
            "--netns",
            "iptables-legacy",
            "-w",
            "-L",
            &format!("x\n{FORGED}"),
        ],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut ipt = Agent::spawn(&sh, &args, &[("XTABLES_LOCKFILE", lock_s)], None);
    assert_ne!(
        ipt.wait(),
        0,
        "iptables -L of a chain that does not exist fails"
    );
    let (out, err) = tracer.finish_text();
    let shown = [
        "kube-proxy\\e]0;p",
        &format!("x\\n{FORGED}"),
        "in pod kube-system/evil\\e]0;owned\\x07\\nFAKE/c\\e[2J",
    ];
    assert_safe("trace", &out, &shown);
    assert_safe("trace's log", &err, &[]);

    // The same from the capture.
    let rep = Command::new(xtlock_bin())
        .arg("report")
        .arg("--events")
        .arg(&capture)
        .output()
        .expect("xtlock report");
    let rep_out = String::from_utf8(rep.stdout).expect("report prints UTF-8");
    let rep_err = String::from_utf8_lossy(&rep.stderr).into_owned();
    assert!(rep.status.success(), "{rep_err}");
    assert_safe("report --events", &rep_out, &shown);
    assert_safe("report's log", &rep_err, &[]);
}
