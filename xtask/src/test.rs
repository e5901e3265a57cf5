//! `cargo xtask test [ARGS...]`: setup, then every check CI runs, each as its own step:
//! build, test (both with the real BPF programs), clippy, rustfmt. All steps run (the tests
//! only when the build passed); the command fails when any step fails.
use std::{
    ffi::OsString,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};

use crate::{setup, sh};

/// The BPF crate only builds for the BPF target (xtlock/build.rs builds it); every cargo step
/// here covers the rest of the workspace.
const EXCLUDE: [&str; 3] = ["--workspace", "--exclude", "xtlock-ebpf"];

struct Step {
    name: &'static str,
    outcome: Outcome,
    took: Duration,
}

enum Outcome {
    Ok,
    Failed(String),
    Skipped(&'static str),
}

pub fn run(test_args: &[OsString]) -> Result<()> {
    setup::run()?;
    let root = sh::workspace_root();
    let cargo = |args: &[&str]| {
        let mut c = sh::cargo();
        c.current_dir(&root)
            .args(args)
            // The same environment for every step, so no step invalidates another's build.
            .env("XTLOCK_REQUIRE_EBPF", "1")
            .env("RUST_BACKTRACE", "1");
        c
    };

    let mut steps = Vec::new();
    let build = step(
        "build",
        &mut cargo(&[&["build"], &EXCLUDE[..], &["--bins"]].concat()),
    );
    let built = matches!(build.outcome, Outcome::Ok);
    steps.push(build);
    if built {
        let mut test = cargo(&[&["test"], &EXCLUDE[..]].concat());
        test.args(test_args);
        steps.push(step("test", &mut test));
    } else {
        steps.push(Step {
            name: "test",
            outcome: Outcome::Skipped("the build failed"),
            took: Duration::ZERO,
        });
    }
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

    println!("\n== xtask test summary");
    for s in &steps {
        let (word, why) = match &s.outcome {
            Outcome::Ok => ("ok", String::new()),
            Outcome::Failed(e) => ("FAILED", format!(": {e}")),
            Outcome::Skipped(why) => ("skipped", format!(": {why}")),
        };
        println!(
            "  {:<7} {:<8} {:>6.1}s{why}",
            s.name,
            word,
            s.took.as_secs_f64()
        );
    }
    let bad: Vec<&str> = steps
        .iter()
        .filter(|s| !matches!(s.outcome, Outcome::Ok))
        .map(|s| s.name)
        .collect();
    if bad.is_empty() {
        println!("xtask test: every step ok (build, test, clippy, fmt)");
        Ok(())
    } else {
        bail!("xtask test: not ok: {}", bad.join(", "))
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
    }
}
