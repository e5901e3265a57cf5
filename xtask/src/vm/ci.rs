//! CI's order: the x86-64 matrix ([`MATRIX`]) and the arm64 part ([`ARM64_MATRIX`]) from one
//! queue, the arm64 guests first; and docs/kernels.md written from their results
//! (`cargo xtask kernels-doc` too).
use std::{env, path::Path, sync::Arc, time::Instant};

use anyhow::{bail, Result};

use super::{
    cargo_build::target_dir,
    kernel,
    plan::{finish, kernels_doc_path, plan_args, run_args, Plan, Pool, KERNELS_DOC},
    TestRun, VmArgs, ARM64_MATRIX,
};
use crate::{arch::Arch, sh};

/// The x86-64 CI matrix as `cargo xtask test` runs it: every kernel of [`MATRIX`], the
/// binaries of `target_dir` (already built by its build and test steps).
fn matrix_args() -> VmArgs {
    VmArgs {
        matrix: true,
        // Under TCG one kernel's suite takes 4-8 min, more on a loaded machine.
        timeout: 1500,
        cpus: 2,
        memory: 2048,
        ..VmArgs::default()
    }
}

/// The arm64 part of CI for one series of [`ARM64_MATRIX`].
fn arm64_args(series: &str, tests: &[TestRun]) -> VmArgs {
    VmArgs {
        arch: Some(Arch::Arm64.name().to_owned()),
        kernels: vec![series.to_string()],
        tests: tests.iter().map(|(t, _)| t.to_string()).collect(),
        test_filters: tests
            .iter()
            .map(|(t, f)| (t.to_string(), f.iter().map(|s| s.to_string()).collect()))
            .collect(),
        // Under TCG the two tests take ~10 min on arm64, more on a loaded machine.
        timeout: 1500,
        cpus: 2,
        memory: 2048,
        ..VmArgs::default()
    }
}

/// VMs CI runs at once: `XTLOCK_VM_JOBS`, else 2. A TCG guest of these tests keeps ~0.9 of
/// this machine's 2 cores busy (43 % of both, sampled every 5 s over lock_trace on 6.12:
/// they mostly wait on real time), so two at a time nearly halve the wall time.
pub fn ci_jobs() -> usize {
    env::var("XTLOCK_VM_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or(2)
        .max(1)
}

/// CI's VMs: the x86-64 matrix ([`MATRIX`]) and the arm64 part ([`ARM64_MATRIX`]), `jobs`
/// at a time from one queue, the arm64 guests first, after the aarch64 binaries are
/// cross-built (a fresh clone builds them from nothing: timed). docs/kernels.md is written from every
/// result when the x86-64 matrix left all of its results. Returns the x86-64 and arm64
/// summaries.
pub fn run_ci(jobs: usize, arm64: Option<Arm64Plans>) -> (Result<String>, Result<String>) {
    let start = Instant::now();
    let x86 = match plan_args(&matrix_args()) {
        Ok(p) => Arc::new(p),
        Err(e) => {
            return (
                Err(e),
                Err(anyhow::anyhow!("not run: the x86-64 plan failed")),
            )
        }
    };
    let pool = Pool::default();
    pool.push(&x86, 0, false);
    // Before any guest: a cross-build alongside a guest slowed it enough to fail 3 timed
    // tests of lock_trace on 5.10 (guests are fine two at a time, a compiler is not).
    // `cargo xtask test` builds them earlier, beside the host's tests (see plan_arm64_ci).
    let arm64 = arm64.unwrap_or_else(|| plan_arm64_ci(false));
    for (id, plan) in &arm64 {
        if let Ok(p) = plan {
            pool.push(p, *id, true);
        }
    }
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| pool.work());
        }
    });
    println!(
        "vm-test: {} x86-64 and {} arm64 guest(s) in {:.1}s ({jobs} at a time)",
        x86.planned.len(),
        ARM64_MATRIX.len(),
        start.elapsed().as_secs_f64()
    );
    let amd64 = finish(&x86, pool.reports_of(0));
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    for (id, plan) in arm64 {
        match plan.and_then(|p| finish(&p, pool.reports_of(id))) {
            Ok(l) => lines.push(l),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    // docs/kernels.md again, now with the arm64 columns and figures.
    if let Err(e) = kernels_doc_with_arm64() {
        failures.push(format!("kernels-doc: {e:#}"));
    }
    let arm = if failures.is_empty() {
        Ok(lines.join("; "))
    } else {
        Err(anyhow::anyhow!("{}", failures.join("\n")))
    };
    (amd64, arm)
}

/// The planned arm64 guests of CI, by queue id (1, 2, ...), or why one could not be planned.
pub type Arm64Plans = Vec<(usize, Result<Arc<Plan>>)>;

/// Plans CI's arm64 guests: cross-builds their binaries, fetches their kernels, makes their
/// initramfs. `quiet`: cargo says only warnings and errors (built beside the host's tests,
/// whose output it would interleave).
pub fn plan_arm64_ci(quiet: bool) -> Arm64Plans {
    ARM64_MATRIX
        .iter()
        .enumerate()
        .map(|(n, (series, tests))| {
            let mut args = arm64_args(series, tests);
            args.quiet_build = quiet;
            (n + 1, plan_args(&args).map(Arc::new))
        })
        .collect()
}

/// docs/kernels.md from every result there is, the arm64 columns included, when the x86-64
/// matrix left all of its results (else nothing).
fn kernels_doc_with_arm64() -> Result<()> {
    let root = sh::workspace_root();
    let results = target_dir(&root, None).join("vm/results");
    let amd64_all = kernel::SERIES
        .iter()
        .all(|(s, _)| results.join(s).join("probes.json").exists());
    if amd64_all {
        let doc = kernels_doc_path(&root, &results)?;
        crate::kernels_doc::write(&results, &doc)?;
    }
    Ok(())
}

/// `cargo xtask vm-test --matrix --arch arm64`: [`ARM64_MATRIX`] alone, one VM at a time.
pub fn run_arm64_default() -> Result<String> {
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    for (series, tests) in ARM64_MATRIX {
        match run_args(&arm64_args(series, tests)) {
            Ok(l) => lines.push(l),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    if let Err(e) = kernels_doc_with_arm64() {
        failures.push(format!("kernels-doc: {e:#}"));
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(lines.join("; "))
}

/// `cargo xtask kernels-doc`.
pub fn kernels_doc(results: Option<&Path>) -> Result<()> {
    let root = sh::workspace_root();
    let results = results
        .map(Path::to_path_buf)
        .unwrap_or_else(|| target_dir(&root, None).join("vm/results"));
    if !crate::kernels_doc::write(&results, &root.join(KERNELS_DOC))? {
        bail!(
            "no results in {} (run `cargo xtask vm-test --kernel all` first)",
            results.display()
        );
    }
    Ok(())
}
