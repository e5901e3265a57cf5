//! The release window and ring order, on the real kernel, against bpftrace:
//! - a holder with a large address space exits without unlocking while a blocking waiter and
//!   a `LOCK_NB` poller are at the lock: the kernel releases it only once the holder's
//!   memory is torn down, tens of ms after the exit, and both must name the holder all along;
//! - 10,000 hand-offs between two processes pinned to different CPUs (the next taker's
//!   acquire often reaches the ring before the previous release): every hold counted, the
//!   total hold time within 1 % of bpftrace's, no wait without its holder;
//! - the same hand-offs with a non-blocking tryer beside each side: the kernel's kept takes,
//!   copied while they are written, are never torn (with and without the weakly ordered
//!   CPUs' barriers).

use std::time::Duration;

use serde_json::Value;
use xtlock_tests::{require_bpf, serial, Agent, Bpftrace, Scratch, Tracer};

const T: Duration = Duration::from_secs(30);

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

#[test]
fn exited_big_holder_is_named_until_the_kernel_releases() {
    if !require_bpf("exited_big_holder_is_named_until_the_kernel_releases") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("bighold");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap();
    let tracer = Tracer::start(&[&lock], Duration::from_secs(60), &["--no-drops"]);
    let mut big = Agent::spawn(
        &s.agent("kube-proxy"),
        &["bighold", lock_s, "1536", "300"],
        &[],
        None,
    );
    big.ts("acquired", T);
    let mut waiter = Agent::spawn(&s.agent("calico-node"), &["hold", lock_s, "10"], &[], None);
    let mut poller = Agent::spawn(&s.agent("portmap"), &["poll", lock_s, "1", "10"], &[], None);
    let exiting = big.ts("exiting", T);
    big.wait();
    let acquired = waiter.ts("acquired", T);
    waiter.wait();
    poller.wait();
    std::thread::sleep(Duration::from_millis(300));
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    let hold = trace
        .of_type("hold")
        .into_iter()
        .find(|h| h["agent"] == "kube-proxy")
        .unwrap_or_else(|| panic!("no kube-proxy hold\n{dump}"))
        .clone();
    let end = u(&hold["start_ns"]) + u(&hold["hold_ns"]);
    eprintln!(
        "release {} µs after the exit; the waiter took the lock {} µs after the release",
        (end as i64 - exiting as i64) / 1000,
        (acquired as i64 - end as i64) / 1000
    );
    // The window this test is about: the release came well after the exit.
    assert!(
        end > exiting + 1_000_000,
        "release {end} vs exit {exiting}: no window\n{dump}"
    );
    assert!(end <= acquired, "{dump}");
    let w = trace
        .of_type("wait")
        .into_iter()
        .find(|w| w["agent"] == "calico-node")
        .unwrap_or_else(|| panic!("no calico-node wait\n{dump}"))
        .clone();
    assert_eq!(w["holders"][0]["agent"], "kube-proxy", "{w}");
    assert_eq!(u(&w["unknown_ns"]), 0, "{w}");
    let behind = u(&w["holders"][0]["behind_ns"]);
    assert!(
        behind >= end - u(&w["start_ns"]) - 1_000,
        "the waiter was behind the exited holder until its release: {w}"
    );
    let tries: Vec<&Value> = trace
        .of_type("failed_try")
        .into_iter()
        .filter(|f| f["agent"] == "portmap")
        .collect();
    let in_window = tries
        .iter()
        .filter(|f| (exiting..end).contains(&u(&f["ts_ns"])))
        .count();
    eprintln!(
        "{} failed tries, {in_window} in the release window",
        tries.len()
    );
    assert!(in_window > 0, "no try landed in the window\n{dump}");
    for f in &tries {
        assert!(
            f["holder"].is_object(),
            "a failed try without its holder: {f}"
        );
    }
    for c in trace.summary()["contention"]
        .as_array()
        .into_iter()
        .flatten()
    {
        assert_ne!(c["holder"], "(unknown)", "{c}");
    }
}

#[test]
fn ten_thousand_handoffs_across_cpus_match_bpftrace() {
    if !require_bpf("ten_thousand_handoffs_across_cpus_match_bpftrace") {
        return;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _g = serial();
    let s = Scratch::new("handoffs");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap().to_owned();
    let bpf = Bpftrace::start(&lock);
    let tracer = Tracer::start(&[&lock], Duration::from_secs(120), &["--no-drops"]);
    const N: u64 = 5_000;
    let n = N.to_string();
    let mut sides = Vec::new();
    for (agent, cpu) in [("kube-proxy", 0), ("calico-node", 1 % cpus)] {
        sides.push(pinned(&s, agent, cpu, &["pingpong", &lock_s, &n]));
    }
    // Seconds on a quiet machine; the bound only turns a hang into a failure that says so.
    for a in &mut sides {
        assert_eq!(
            a.wait_within(Duration::from_secs(120)),
            0,
            "pingpong failed"
        );
    }
    std::thread::sleep(Duration::from_millis(500));
    tracer.interrupt();
    let trace = tracer.finish();
    let (b_holds, b_ended, b_total) = bpf.finish();
    let holds: Vec<&Value> = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["lock"] == lock_s.as_str())
        .collect();
    let total: u64 = holds.iter().map(|h| u(&h["hold_ns"])).sum();
    let waits = trace.of_type("wait");
    let lost = u(&trace.summary()["lost_events"]);
    eprintln!(
        "{} holds (bpftrace {b_holds}, {b_ended} ended), {} waits, {lost} events lost; hold \
         time {total} ns (bpftrace {b_total} ns)",
        holds.len(),
        waits.len()
    );
    assert_eq!(lost, 0);
    assert_eq!(holds.len() as u64, 2 * N);
    assert_eq!(b_holds, 2 * N);
    let diff = total.abs_diff(b_total) as f64 / b_total.max(1) as f64;
    assert!(
        diff <= 0.01,
        "hold time {total} vs {b_total} ({:.2} %)",
        diff * 100.0
    );
    assert!(
        !waits.is_empty(),
        "the two sides never waited for each other"
    );
    for w in &waits {
        assert!(
            w["holders"].as_array().is_some_and(|h| !h.is_empty()) && u(&w["unknown_ns"]) == 0,
            "a wait without its holder: {w}"
        );
    }
    assert!(holds.iter().all(|h| h["incomplete"] == false));
}

/// Kept takes copied while they are written: two sides hand the lock to each other, one on
/// each CPU, and beside each a process tries it without blocking, back to back. The first
/// try after a take copies that take out of the kernel's entry (`xtlock-ebpf/src/pending.rs`),
/// often while the other CPU is still writing it, the sequence lock's race. A copy torn
/// between two takes mixes one process's header (pid, time) with the other's lock and name:
/// every hold and every holder a failed try names must be whole, and each side's holds
/// exactly the ones it made. (Caught: with the take's header written after the sequence
/// closed, dozens of holds went to the wrong process a run.)
#[test]
fn kept_takes_are_never_torn() {
    torn_takes("kept_takes_are_never_torn", &[]);
}

/// The same with the full barriers a weakly ordered CPU (arm64) puts around the kept takes,
/// on by default there: here that path runs, and its programs load, on x86 too.
#[test]
fn kept_takes_are_never_torn_with_memory_barriers() {
    torn_takes(
        "kept_takes_are_never_torn_with_memory_barriers",
        &["--memory-barriers"],
    );
}

fn torn_takes(test: &str, args: &[&str]) {
    if !require_bpf(test) {
        return;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _g = serial();
    let s = Scratch::new("torn");
    let lock = s.lock_file("xtables.lock");
    let lock_s = lock.to_str().unwrap().to_owned();
    // 40,000 failed tries in seconds, besides the holds (and, with barriers, their ring
    // reservations): room enough that no event is lost, which this test is not about.
    let mut tracer_args = vec!["--no-drops", "--ring-buffer-mib", "16"];
    tracer_args.extend(args);
    let tracer = Tracer::start(&[&lock], Duration::from_secs(120), &tracer_args);
    const N: u64 = 5_000;
    let n = N.to_string();
    let names = ["kube-proxy", "calico-node", "firewalld", "dockerd"];
    let mut sides = Vec::new();
    for (agent, cpu, job, count) in [
        (names[0], 0, "pingpong", n.as_str()),
        (names[1], 1 % cpus, "pingpong", n.as_str()),
        (names[2], 0, "tries", "20000"),
        (names[3], 1 % cpus, "tries", "20000"),
    ] {
        sides.push(pinned(&s, agent, cpu, &[job, &lock_s, count]));
    }
    for a in &mut sides {
        assert_eq!(a.wait_within(Duration::from_secs(300)), 0, "a side failed");
    }
    // Holds each side made: N a pingpong, the tries that got the lock.
    let mut made = vec![N, N];
    for a in &mut sides[2..] {
        let got = a.expect("got", Duration::from_secs(5));
        made.push(got.last().and_then(|g| g.parse().ok()).expect("got N"));
    }
    std::thread::sleep(Duration::from_millis(500));
    tracer.interrupt();
    let trace = tracer.finish();
    let holds: Vec<&Value> = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["lock"] == lock_s.as_str())
        .collect();
    let pids: Vec<u64> = sides.iter().map(|a| u64::from(a.child.id())).collect();
    let seen: Vec<u64> = pids
        .iter()
        .map(|p| holds.iter().filter(|h| u(&h["pid"]) == *p).count() as u64)
        .collect();
    let lost = u(&trace.summary()["lost_events"]);
    eprintln!(
        "holds of {names:?}: made {made:?}, seen {seen:?} ({} in all); \
         {lost} events lost",
        holds.len()
    );
    assert_eq!(lost, 0);
    // The processes' own counts are the truth (no bpftrace needed, so this runs in the VMs).
    assert_eq!(holds.len() as u64, made.iter().sum::<u64>(), "holds in all");
    assert_eq!(seen, made, "holds of {names:?}: seen, made");
    let name_of = |pid: u64| pids.iter().position(|p| *p == pid).map(|i| names[i]);
    for h in &holds {
        let name = name_of(u(&h["pid"]));
        assert!(name.is_some(), "a hold by none of the sides: {h}");
        assert_eq!(
            (h["comm"].as_str(), h["agent"].as_str()),
            (name, name),
            "{h}"
        );
    }
    // The holder each failed try names, from the copy its own request made.
    let tries = trace.of_type("failed_try");
    let named: Vec<&Value> = tries.iter().filter_map(|f| f.get("holder")).collect();
    eprintln!(
        "{} failed tries, {} naming their holder",
        tries.len(),
        named.len()
    );
    assert!(named.len() * 2 > tries.len(), "few tries name a holder");
    for h in named {
        let name = name_of(u(&h["pid"]));
        assert!(name.is_some(), "a holder that is none of the sides: {h}");
        assert_eq!(h["comm"].as_str(), name, "{h}");
    }
}

/// The helper as `agent`, running `args` on CPU `cpu` only.
fn pinned(s: &Scratch, agent: &str, cpu: usize, args: &[&str]) -> Agent {
    let bin = s.agent(agent);
    let cpu = cpu.to_string();
    let mut all = vec!["-c", cpu.as_str(), bin.to_str().unwrap()];
    all.extend(args);
    Agent::spawn(std::path::Path::new("/usr/bin/taskset"), &all, &[], None)
}
