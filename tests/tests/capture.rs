//! Capture files end to end: `xtlock record` during a real contention scenario, `xtlock
//! report` and `xtlock export` on the file, `kill -9` of the recorder, and a capture from a
//! real run committed under tests/data so format changes that break old files fail CI.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use xtlock_tests::{require_bpf, serial, xtlock_bin, Agent, Scratch, Tracer};

const T: Duration = Duration::from_secs(20);

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
}

/// Runs `xtlock ARGS`, returns (exit code, stdout, stderr).
fn xtlock(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(xtlock_bin())
        .args(args)
        .output()
        .expect("run xtlock");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn json_lines(s: &str) -> Vec<Value> {
    s.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The lock facts of a summary: what must not depend on when tracing started or stopped.
fn lock_facts(summary: &Value) -> Value {
    serde_json::json!({
        "holds": summary["holds"],
        "waits": summary["waits"],
        "contention": summary["contention"],
        "failed_tries": summary["failed_tries"],
        "timeouts": summary["timeouts"],
    })
}

/// Contention (kube-proxy holds, calico-node waits with iptables -w, portmap polls, and an
/// iptables -w 1 that times out) with `trace --json` and `record` running side by side.
fn contention_scenario(s: &Scratch, lock: &Path) {
    let lock_s = lock.to_str().unwrap();
    let kube_proxy = s.agent("kube-proxy");
    let calico = s.agent("calico-node");
    let portmap = s.agent("portmap");
    let mut kp = Agent::spawn(&kube_proxy, &["hold", lock_s, "1500"], &[], None);
    kp.ts("acquired", T);
    let mut cn = Agent::spawn(
        &calico,
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
    let mut pm = Agent::spawn(&portmap, &["poll", lock_s, "200", "20"], &[], None);
    let mut to = Agent::spawn(
        &calico,
        &[
            "run",
            "--netns",
            "iptables-legacy",
            "-w",
            "1",
            "-A",
            "INPUT",
            "-j",
            "ACCEPT",
        ],
        &[("XTABLES_LOCKFILE", lock_s)],
        None,
    );
    assert_eq!(to.wait(), 4);
    assert_eq!(cn.wait(), 0);
    assert_eq!(pm.wait(), 0);
    kp.wait();
}

#[test]
fn record_then_report_matches_trace() {
    if !require_bpf("record_then_report_matches_trace") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("roundtrip");
    let lock = s.lock_file("xtables.lock");
    // One process traces and records (`trace --record`): its capture must replay to exactly
    // what it printed. A second, separate `record` runs beside it: its BPF programs take
    // their own timestamps of the same kernel events, a few µs apart.
    let cap = s.dir.join("traced.xtlock");
    let cap2 = s.dir.join("incident.xtlock");
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(6),
        &["--record", cap.to_str().unwrap()],
    );
    let mut rec = Command::new(xtlock_bin());
    rec.args(["record", "--duration", "6s", "-o"])
        .arg(&cap2)
        .arg("--lock-file")
        .arg(&lock);
    let recorder = Tracer::spawn(rec);
    contention_scenario(&s, &lock);
    let trace = tracer.finish();
    let rec_out = recorder.finish();
    assert!(
        rec_out.stderr.contains("capture written to"),
        "{}",
        rec_out.stderr
    );
    assert!(
        trace.stderr.contains("capture written to"),
        "{}",
        trace.stderr
    );

    // report --events --json of trace's own capture: the facts it printed, exactly.
    let (code, out, err) = xtlock(&["report", "--events", "--json", cap.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let replay = json_lines(&out);
    let facts = |v: &[Value]| -> Vec<Value> {
        v.iter()
            .filter(|e| {
                ["hold", "wait", "failed_try", "timeout", "exec", "exit"]
                    .contains(&e["type"].as_str().unwrap_or(""))
            })
            .cloned()
            .collect()
    };
    assert!(!facts(&trace.events).is_empty());
    assert_eq!(
        facts(&replay),
        facts(&trace.events),
        "report --events differs from trace"
    );
    assert_eq!(
        lock_facts(replay.last().unwrap()),
        lock_facts(trace.summary()),
        "report and trace summaries disagree on the same events"
    );

    // report --json (summary only) of the separate recorder's capture: the same holds,
    // waits, pairs and counts; durations within 0.1% (the programs' own timestamps).
    let (code, out, err) = xtlock(&["report", "--json", cap2.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let lines = json_lines(&out);
    assert_eq!(
        lines.len(),
        1,
        "report without --events prints only the summary:\n{out}"
    );
    let summary = &lines[0];
    assert_eq!(summary["type"], "summary");
    same_within(&lock_facts(summary), &lock_facts(trace.summary()), "");
    assert_eq!(summary["holds"]["kube-proxy"]["count"], 1, "{summary}");
    assert_eq!(summary["timeouts"]["calico-node"], 1, "{summary}");
    let cap = cap2;

    // The terminal report says the same in words.
    let (code, out, err) = xtlock(&["report", cap.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("calico-node <- kube-proxy"), "{out}");

    // Perfetto export: valid, balanced, flows bound to slices.
    let timeline = s.dir.join("trace.json");
    let (code, _, err) = xtlock(&[
        "export",
        cap.to_str().unwrap(),
        "--format",
        "perfetto",
        "-o",
        timeline.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_slice(&std::fs::read(&timeline).unwrap()).unwrap();
    check_perfetto(&v);
    let names: Vec<&str> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    for agent in ["kube-proxy", "calico-node", "portmap"] {
        assert!(
            names.contains(&agent),
            "no track group for {agent}: {names:?}"
        );
    }
}

/// Equal, except that numbers ending in `_ns` may differ by 0.1% or 50 µs: two tracers'
/// programs on one tracepoint each take their own timestamp, microseconds apart.
fn same_within(a: &Value, b: &Value, path: &str) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut kx: Vec<_> = x.keys().collect();
            let mut ky: Vec<_> = y.keys().collect();
            kx.sort();
            ky.sort();
            assert_eq!(kx, ky, "keys differ at {path}");
            for k in kx {
                same_within(&x[k], &y[k], &format!("{path}.{k}"));
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "lengths differ at {path}");
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                same_within(p, q, &format!("{path}[{i}]"));
            }
        }
        (Value::Number(p), Value::Number(q)) if path.ends_with("_ns") => {
            let (p, q) = (p.as_f64().unwrap(), q.as_f64().unwrap());
            // Two tracers' programs read the clock apart around the same event: a few µs
            // on a quiet machine, 71 µs seen once on this 2-core one under a full test run.
            assert!(
                (p - q).abs() <= (q.abs() * 0.001).max(250_000.0),
                "{path}: {p} vs {q}"
            );
        }
        _ => assert_eq!(a, b, "differ at {path}"),
    }
}

/// Structural checks of a Chrome JSON trace (events in any order, as the format allows):
/// complete slices on one track nest (no partial overlap), every flow start and end lies
/// inside a slice of its track, async slices are balanced, every track is named.
fn check_perfetto(v: &Value) {
    let evs = v["traceEvents"].as_array().expect("traceEvents");
    let mut slices: HashMap<(u64, u64), Vec<(f64, f64)>> = HashMap::new();
    let mut asyncs: HashMap<u64, i32> = HashMap::new();
    let mut flows: Vec<(&str, u64, (u64, u64), f64)> = Vec::new();
    let mut named: std::collections::HashSet<(u64, u64)> = Default::default();
    for e in evs {
        let ph = e["ph"].as_str().expect("ph");
        let track = (
            e["pid"].as_u64().expect("pid"),
            e["tid"].as_u64().expect("tid"),
        );
        if ph == "M" {
            named.insert(track);
            continue;
        }
        let ts = e["ts"].as_f64().expect("ts");
        match ph {
            "X" => {
                let dur = e["dur"].as_f64().expect("dur");
                assert!(dur >= 0.0, "negative duration: {e}");
                slices.entry(track).or_default().push((ts, ts + dur));
            }
            "b" => *asyncs.entry(e["id"].as_u64().unwrap()).or_default() += 1,
            "e" => *asyncs.entry(e["id"].as_u64().unwrap()).or_default() -= 1,
            "s" | "f" => flows.push((
                if ph == "s" { "s" } else { "f" },
                e["id"].as_u64().unwrap(),
                track,
                ts,
            )),
            "i" | "C" => {}
            other => panic!("unexpected phase {other}"),
        }
    }
    for (track, v) in &mut slices {
        assert!(named.contains(track), "track {track:?} has no name");
        // Sorted by start, longest first: each slice must end within the one enclosing it.
        v.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut stack: Vec<(f64, f64)> = Vec::new();
        for &(a, b) in v.iter() {
            while stack.last().is_some_and(|&(_, e)| e <= a) {
                stack.pop();
            }
            if let Some(&(pa, pb)) = stack.last() {
                assert!(
                    b <= pb + 1e-3,
                    "slice [{a}, {b}] overlaps [{pa}, {pb}] on {track:?} without nesting"
                );
            }
            stack.push((a, b));
        }
    }
    assert!(
        asyncs.values().all(|&n| n == 0),
        "unbalanced async slices: {asyncs:?}"
    );
    assert!(!flows.is_empty(), "no flow arrows from holders to waiters");
    for (kind, id, track, ts) in &flows {
        let inside = slices
            .get(track)
            .is_some_and(|v| v.iter().any(|&(a, b)| a <= *ts && *ts <= b));
        assert!(
            inside,
            "flow {kind} {id} at {ts} on {track:?} is not inside a slice"
        );
    }
    for id in flows.iter().map(|f| f.1) {
        let n = flows.iter().filter(|f| f.1 == id).count();
        assert_eq!(n, 2, "flow {id} must have one start and one end");
    }
}

/// `kill -9` of the recorder: the file reads back up to the last complete block (at most
/// about a second lost) and `report` says it was cut short.
#[test]
fn killed_recorder_leaves_a_readable_capture() {
    if !require_bpf("killed_recorder_leaves_a_readable_capture") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("kill9");
    let lock = s.lock_file("xtables.lock");
    let cap = s.dir.join("cut.xtlock");
    let lock_s = lock.to_str().unwrap();
    let mut rec = Command::new(xtlock_bin());
    rec.args(["record", "-o"])
        .arg(&cap)
        .arg("--lock-file")
        .arg(&lock);
    let recorder = Tracer::spawn(rec);
    let kube_proxy = s.agent("kube-proxy");
    for _ in 0..3 {
        let mut kp = Agent::spawn(&kube_proxy, &["hold", lock_s, "50"], &[], None);
        kp.wait();
    }
    // More than the 1 s flush interval, so the holds are on disk.
    std::thread::sleep(Duration::from_millis(2500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(recorder.pid() as i32, libc::SIGKILL) };
    drop(recorder);
    let (code, out, err) = xtlock(&["report", "--json", cap.to_str().unwrap()]);
    assert_eq!(code, 0, "a cut-short capture still reports: {err}");
    assert!(
        err.contains("cut short"),
        "report must say the capture was cut short: {err}"
    );
    let summary = &json_lines(&out)[0];
    assert_eq!(summary["holds"]["kube-proxy"]["count"], 3, "{summary}");
}

/// A capture from a real run (kube-proxy holding, calico-node waiting and timing out,
/// portmap polling), committed with its expected report: format or analysis changes that
/// break old files fail here. Regenerate both with `XTLOCK_REGEN_FIXTURE=1` (as root) only
/// for a deliberate change, and say why in the commit.
#[test]
fn committed_capture_still_reports_the_same() {
    let cap = data("contention.xtlock");
    let expected = data("contention.report.json");
    if std::env::var("XTLOCK_REGEN_FIXTURE").is_ok_and(|v| v == "1") && require_bpf("regen") {
        let _g = serial();
        let s = Scratch::new("fixture");
        let lock = s.lock_file("xtables.lock");
        let mut rec = Command::new(xtlock_bin());
        rec.args(["record", "--duration", "5s", "-o"])
            .arg(&cap)
            .arg("--lock-file")
            .arg(&lock);
        let recorder = Tracer::spawn(rec);
        contention_scenario(&s, &lock);
        recorder.finish();
        let (code, out, err) = xtlock(&["report", "--json", cap.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        std::fs::write(&expected, out).unwrap();
    }
    let (code, out, err) = xtlock(&["report", "--json", cap.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let want = std::fs::read_to_string(&expected).expect("expected report");
    assert_eq!(
        json_lines(&out),
        json_lines(&want),
        "the committed capture reports differently now"
    );
    // The terminal report of the same file works without root, too.
    let (code, out, _) = xtlock(&["report", "--events", cap.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("kube-proxy"), "{out}");
}

#[test]
fn bad_captures_get_clear_errors() {
    let s = Scratch::new("badcap");
    let not = s.dir.join("not-a-capture");
    std::fs::write(&not, b"hello, this is not a capture").unwrap();
    let (code, _, err) = xtlock(&["report", not.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("not an xtlock capture"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let (code, _, err) = xtlock(&["report", s.dir.join("missing").to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("cannot read the capture"), "{err}");

    // A flipped byte in the middle of the committed capture: an error naming the offset,
    // the good part still reported, no panic.
    let good = std::fs::read(data("contention.xtlock")).expect("fixture");
    let mut bad = good.clone();
    let at = good.len() * 2 / 3;
    bad[at] ^= 0xff;
    let damaged = s.dir.join("damaged.xtlock");
    std::fs::write(&damaged, &bad).unwrap();
    let o = Command::new(xtlock_bin())
        .args(["report", "--json"])
        .arg(&damaged)
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("offset"),
        "the error must name the offset: {err}"
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("\"type\":\"summary\""),
        "the good part is still reported: {out}"
    );
}

/// `HH:MM:SS.mmm` (UTC) of now: a time as the report prints it under `TZ=UTC`, typed back.
fn utc_time_of_day_now() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let (s, ms) = (d.as_secs() % 86_400, d.subsec_millis());
    format!("{:02}:{:02}:{:02}.{ms:03}", s / 3600, s / 60 % 60, s % 60)
}

/// Is `fact` about `agent`: its own, or a wait or failed try behind it.
fn about(fact: &Value, agent: &str) -> bool {
    fact["agent"] == agent
        || fact["holders"]
            .as_array()
            .is_some_and(|hs| hs.iter().any(|h| h["agent"] == agent))
        || fact["holder"]["agent"] == agent
}

/// kube-proxy holds while calico-node waits behind it, then calico-node holds alone:
/// `trace --agent kube-proxy` shows kube-proxy's facts and the wait behind it, not
/// calico-node's own hold, while its `--record` keeps everything; `report` with the same
/// filter shows the same facts, and `--since`/`--until` (a time of day as the report prints
/// it) cut between the two phases.
#[test]
fn filters_on_trace_and_report_agree() {
    if !require_bpf("filters_on_trace_and_report_agree") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("filters");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap();
    let cap = s.dir.join("filtered.xtlock");
    let tracer = Tracer::start(
        &[&lock],
        Duration::from_secs(5),
        &["--agent", "kube-proxy", "--record", cap.to_str().unwrap()],
    );
    let kube_proxy = s.agent("kube-proxy");
    let calico = s.agent("calico-node");
    let mut kp = Agent::spawn(&kube_proxy, &["hold", lock_s, "800"], &[], None);
    kp.ts("acquired", T);
    let mut cn = Agent::spawn(&calico, &["hold", lock_s, "100"], &[], None);
    assert_eq!(kp.wait(), 0);
    assert_eq!(cn.wait(), 0);
    std::thread::sleep(Duration::from_millis(300));
    let between = utc_time_of_day_now();
    std::thread::sleep(Duration::from_millis(300));
    let mut alone = Agent::spawn(&calico, &["hold", lock_s, "200"], &[], None);
    assert_eq!(alone.wait(), 0);
    let trace = tracer.finish();

    let holds = trace.of_type("hold");
    let waits = trace.of_type("wait");
    assert!(
        holds.iter().any(|h| h["agent"] == "kube-proxy"),
        "{}",
        trace.dump()
    );
    assert!(
        holds.iter().all(|h| h["agent"] == "kube-proxy"),
        "calico-node's holds are not about kube-proxy:\n{}",
        trace.dump()
    );
    assert!(
        waits
            .iter()
            .any(|w| w["agent"] == "calico-node" && about(w, "kube-proxy")),
        "calico-node's wait behind kube-proxy is about kube-proxy:\n{}",
        trace.dump()
    );
    for f in trace.events.iter().filter(|e| e["type"] != "summary") {
        if ["hold", "wait", "failed_try", "timeout", "exec", "exit"]
            .contains(&f["type"].as_str().unwrap_or(""))
        {
            assert!(about(f, "kube-proxy"), "not about kube-proxy: {f}");
        }
    }
    let summary = trace.summary();
    assert_eq!(summary["filter"]["agents"][0], "kube-proxy", "{summary}");
    let (shown, all) = (
        summary["filter"]["shown"].as_u64().unwrap(),
        summary["filter"]["facts"].as_u64().unwrap(),
    );
    assert!(0 < shown && shown < all, "{summary}");
    // The summary's tables stay whole.
    assert_eq!(summary["holds"]["calico-node"]["count"], 2, "{summary}");

    // The capture has everything, the filter notwithstanding.
    let c = cap.to_str().unwrap();
    let (code, out, err) = xtlock(&["report", "--json", "--events", c]);
    assert_eq!(code, 0, "{err}");
    let everything = json_lines(&out);
    let calico_holds = everything
        .iter()
        .filter(|e| e["type"] == "hold" && e["agent"] == "calico-node")
        .count();
    assert_eq!(calico_holds, 2, "{out}");
    assert!(everything.last().unwrap().get("filter").is_none(), "{out}");

    // The same filter on the capture: the same facts, and a filter implies --events.
    let (code, out, err) = xtlock(&["report", "--json", "--agent", "kube-proxy", c]);
    assert_eq!(code, 0, "{err}");
    let replay = json_lines(&out);
    let body = |v: &[Value]| -> Vec<Value> {
        v.iter()
            .filter(|e| e["type"] != "summary")
            .cloned()
            .collect()
    };
    assert_eq!(
        body(&replay),
        body(&trace.events),
        "report --agent differs from trace --agent"
    );
    assert_eq!(replay.last().unwrap()["filter"], summary["filter"]);

    // Time windows, typed as the report prints times (TZ=UTC here).
    let report_tz = |args: &[&str]| {
        let o = Command::new(xtlock_bin())
            .args(args)
            .env("TZ", "UTC")
            .output()
            .expect("run xtlock");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let out = report_tz(&["report", "--json", "--since", &between, c]);
    let after: Vec<Value> = json_lines(&out);
    let after_holds: Vec<&Value> = after.iter().filter(|e| e["type"] == "hold").collect();
    assert_eq!(
        after_holds.len(),
        1,
        "only the lone hold is after {between}:\n{out}"
    );
    assert_eq!(after_holds[0]["agent"], "calico-node");
    let out = report_tz(&[
        "report",
        "--json",
        "--agent",
        "kube-proxy",
        "--since",
        &between,
        c,
    ]);
    assert!(
        json_lines(&out)
            .iter()
            .all(|e| e["type"] != "hold" && e["type"] != "wait"),
        "kube-proxy did nothing after {between}:\n{out}"
    );
    let out = report_tz(&["report", "--agent", "calico-node", "--until", &between, c]);
    assert!(out.contains("calico-node waited"), "{out}");
    assert_eq!(out.matches("calico-node held").count(), 1, "{out}");
    assert!(
        out.contains(&format!("filtered: agent calico-node; until {between}")),
        "{out}"
    );
}
