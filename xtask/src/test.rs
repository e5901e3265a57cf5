//! `cargo xtask test [--no-vm] [ARGS...]`: setup, then every check CI runs, each as its own
//! step: build, test (both with the real BPF programs), vm-test (the integration tests again,
//! inside a QEMU VM on a stock Debian kernel: see vm.rs), vm-arm64 (some of them on an
//! arm64 kernel in an emulated aarch64 VM, cross-built), deploy-test (the image under a real
//! container engine with the DaemonSet's privileges, the manifest and alert checks: see
//! deploy/), deb (the Debian package installed into a clean Debian root: see deb.rs), clippy,
//! rustfmt. All steps run (the
//! tests only when the build passed); the command fails when any step fails.
use std::{
    ffi::OsString,
    path::Path,
    process::Command,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};

use crate::{setup, sh, vm};

/// The BPF crate only builds for the BPF target (xtlock/build.rs builds it); every cargo step
/// here covers the rest of the workspace.
const EXCLUDE: [&str; 3] = ["--workspace", "--exclude", "xtlock-ebpf"];

struct Step {
    name: &'static str,
    outcome: Outcome,
    took: Duration,
    /// Shown after the outcome in the summary.
    note: String,
}

enum Outcome {
    Ok,
    Failed(String),
    Skipped(&'static str),
}

pub fn run(test_args: &[OsString], no_vm: bool) -> Result<()> {
    setup::run()?;
    let root = sh::workspace_root();
    let cargo = |args: &[&str]| cargo_in(&root, args);

    let mut steps = Vec::new();
    let build = step(
        "build",
        &mut cargo(&[&["build"], &EXCLUDE[..], &["--bins"]].concat()),
    );
    let built = matches!(build.outcome, Outcome::Ok);
    steps.push(build);
    // The arm64 guests' cross-build (7-8 min from a fresh clone), kernel and initramfs, made
    // while the host's tests run: those mostly wait on real time (~10 % of the 2 cores), and
    // the build runs at the lowest CPU priority, so the tests' processes always come first.
    // Never beside a guest: that failed timed tests (see vm::run_ci).
    let arm64 = (built && !no_vm).then(|| {
        std::thread::spawn(|| {
            lowest_priority();
            let t = Instant::now();
            let plans = vm::plan_arm64_ci(true);
            (plans, t.elapsed())
        })
    });
    if built {
        host_tests(&root, test_args, &mut steps)?;
    } else {
        steps.push(skipped("test", "the build failed"));
    }
    // The same integration tests on other kernels, in VMs (the binaries of the steps above),
    // and some on arm64 (vm.rs's ARM64_MATRIX says which and why: cross-built for aarch64, a
    // Debian arm64 kernel in qemu-system-aarch64): one queue of guests, two at a time.
    if no_vm {
        steps.push(skipped("vm-test", "--no-vm"));
        steps.push(skipped("vm-arm64", "--no-vm"));
    } else if built {
        vm_steps(arm64, &mut steps);
    } else {
        steps.push(skipped("vm-test", "the build failed"));
        steps.push(skipped("vm-arm64", "the build failed"));
    }
    // The image and the DaemonSet, in a process of its own (it enters a mount namespace of
    // its own); it makes its own release build of the image. Through cargo, not this
    // process's own path: the build step above may have relinked this binary (its
    // dependencies see XTLOCK_REQUIRE_EBPF), and a replaced executable cannot be run by the
    // path it had.
    let mut deploy = cargo(&["run", "--quiet", "--package", "xtask", "--"]);
    deploy.args(["deploy-test", "--no-setup"]);
    steps.push(step("deploy-test", &mut deploy));
    // After deploy-test, whose release build of the static binary it reuses.
    let mut deb = cargo(&["run", "--quiet", "--package", "xtask", "--"]);
    deb.args(["deb", "--test", "--no-setup"]);
    steps.push(step("deb", &mut deb));
    steps.push(step(
        "clippy",
        &mut cargo(
            &[
                &["clippy"],
                &EXCLUDE[..],
                &["--all-targets", "--", "-D", "warnings"],
            ]
            .concat(),
        ),
    ));
    steps.push(step("fmt", &mut cargo(&["fmt", "--all", "--", "--check"])));
    summary(&steps)
}

/// cargo in the workspace with `args`.
fn cargo_in(root: &Path, args: &[&str]) -> Command {
    let mut c = sh::cargo();
    c.current_dir(root)
        .args(args)
        // The same environment for every step, so no step invalidates another's build.
        .env("XTLOCK_REQUIRE_EBPF", "1")
        .env("RUST_BACKTRACE", "1");
    c
}

/// The test step, then the privilege suites under each deployment's capabilities.
fn host_tests(root: &Path, test_args: &[OsString], steps: &mut Vec<Step>) -> Result<()> {
    // Every test binary runs even after one fails, so one failure hides no other.
    let mut test = cargo_in(root, &[&["test", "--no-fail-fast"], &EXCLUDE[..]].concat());
    test.args(test_args);
    steps.push(step("test", &mut test));
    // The scenarios of rule changes and dead endpoints again, xtlock holding exactly
    // the capabilities each shipped deployment grants: continuous mode must see what
    // `sudo xtlock trace` sees.
    for (name, caps) in deployment_caps()? {
        let mut t = cargo_in(
            root,
            &[
                &["test", "--no-fail-fast", "--package", "xtlock-tests"],
                &PRIVILEGE_SUITES[..],
                &["--", "--exact"],
                &PRIVILEGE_TESTS[..],
            ]
            .concat(),
        );
        t.env("XTLOCK_TEST_CAPS", caps.join(","));
        println!("\n== {name}: {}", caps.join(" "));
        steps.push(step(name, &mut t));
    }
    Ok(())
}

/// The vm-test and vm-arm64 steps from one queue of guests, the arm64 ones planned by
/// `arm64` beside the host's tests (here if that thread failed).
fn vm_steps(arm64: Option<JoinHandle<(vm::Arm64Plans, Duration)>>, steps: &mut Vec<Step>) {
    println!("\n== vm-test and vm-arm64");
    let start = Instant::now();
    let jobs = vm::ci_jobs();
    let arm64_plans = match arm64.map(|h| h.join()) {
        Some(Ok((plans, took))) => {
            println!(
                "vm-test: arm64 guests prepared beside the host's tests in {:.1}s",
                took.as_secs_f64()
            );
            Some(plans)
        }
        // The thread panicked: plan them here instead.
        Some(Err(_)) | None => None,
    };
    let (amd64, arm64) = vm::run_ci(jobs, arm64_plans);
    let took = start.elapsed();
    for (name, r) in [("vm-test", amd64), ("vm-arm64", arm64)] {
        let (outcome, note) = match r {
            Ok(summary) => (Outcome::Ok, summary),
            Err(e) => (Outcome::Failed(format!("{e:#}")), String::new()),
        };
        steps.push(Step {
            name,
            outcome,
            took,
            note: if jobs > 1 {
                format!("{note} (both steps' guests {jobs} at a time: one time for both)")
                    .trim_start()
                    .to_owned()
            } else {
                note
            },
        });
    }
}

/// Every step's outcome, and the command's: Err when any step failed.
fn summary(steps: &[Step]) -> Result<()> {
    println!("\n== xtask test summary");
    for s in steps {
        let (word, why) = match &s.outcome {
            Outcome::Ok if s.note.is_empty() => ("ok", String::new()),
            Outcome::Ok => ("ok", format!(": {}", s.note)),
            Outcome::Failed(e) => ("FAILED", format!(": {e}")),
            Outcome::Skipped(why) => ("skipped", format!(": {why}")),
        };
        println!(
            "  {:<11} {:<8} {:>6.1}s{why}",
            s.name,
            word,
            s.took.as_secs_f64()
        );
    }
    let names = |f: fn(&Outcome) -> bool| -> Vec<&str> {
        steps
            .iter()
            .filter(|s| f(&s.outcome))
            .map(|s| s.name)
            .collect()
    };
    // A step is skipped either after a failed build (a failure already) or by --no-vm.
    let bad = names(|o| matches!(o, Outcome::Failed(_)));
    if bad.is_empty() {
        let skipped = names(|o| matches!(o, Outcome::Skipped(_)));
        println!(
            "xtask test: every step ok ({}){}",
            names(|o| matches!(o, Outcome::Ok)).join(", "),
            if skipped.is_empty() {
                String::new()
            } else {
                format!("; skipped: {}", skipped.join(", "))
            }
        );
        Ok(())
    } else {
        bail!("xtask test: not ok: {}", bad.join(", "))
    }
}

/// The test binaries [`PRIVILEGE_TESTS`] are in.
const PRIVILEGE_SUITES: [&str; 8] = [
    "--test",
    "stale_endpoints",
    "--test",
    "rule_changes",
    "--test",
    "rule_drops",
    "--test",
    "daemon",
];
/// A foreign rule change (firewalld removing kube-proxy's chains) through both backends (the
/// legacy reads and nfnetlink), and a Service routed to a gone pod (its window, connections,
/// why the fix was late) read back through nf_tables. One dead-endpoint scenario per set:
/// the legacy one runs in the test step, and its connection count flaked once in six runs
/// here (2 of 8 refusals counted as unanswered), whatever the privileges.
const PRIVILEGE_TESTS: [&str; 5] = [
    "who_changed_whose_rules",
    "who_changed_whose_nf_tables_rules",
    "a_service_written_by_iptables_nft_routed_to_a_gone_pod_is_said",
    // The rules behind drops (legacy reads; the daemon's metric).
    "legacy_drops_are_named_with_their_rule_owner_and_write",
    "the_daemon_counts_drops_by_rule",
];

/// Each shipped deployment's capabilities, read from its file: the DaemonSet's
/// `capabilities.add` (it drops ALL), the unit's `AmbientCapabilities=`.
fn deployment_caps() -> Result<Vec<(&'static str, Vec<String>)>> {
    let root = sh::workspace_root();
    let pod = crate::deploy::manifest::read(&root.join("deploy/daemonset.yaml"))?;
    let unit_path = root.join("deploy/debian/xtlock.service");
    let unit = std::fs::read_to_string(&unit_path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", unit_path.display()))?;
    let ambient: Vec<String> = unit
        .lines()
        .filter_map(|l| l.trim().strip_prefix("AmbientCapabilities="))
        .flat_map(|v| v.split_whitespace().map(str::to_owned))
        .collect();
    if ambient.is_empty() {
        bail!("{}: no AmbientCapabilities=", unit_path.display());
    }
    Ok(vec![
        ("caps-daemonset", pod.caps_add.clone()),
        ("caps-debian-unit", ambient),
    ])
}

/// This thread, and what it starts, at nice 19 (Linux: per thread, inherited by children).
fn lowest_priority() {
    // SAFETY: a plain syscall on the calling thread.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
    if r != 0 {
        eprintln!(
            "xtask test: cannot lower the arm64 build's priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn step(name: &'static str, cmd: &mut Command) -> Step {
    println!("\n== {name}");
    let start = Instant::now();
    let outcome = match sh::run(cmd) {
        Ok(()) => Outcome::Ok,
        Err(e) => Outcome::Failed(format!("{e:#}")),
    };
    Step {
        name,
        outcome,
        took: start.elapsed(),
        note: String::new(),
    }
}

fn skipped(name: &'static str, why: &'static str) -> Step {
    Step {
        name,
        outcome: Outcome::Skipped(why),
        took: Duration::ZERO,
        note: String::new(),
    }
}
