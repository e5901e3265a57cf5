//! The VMs of one run, planned from its arguments: the binaries built, the kernels chosen,
//! each kernel's commands (`xtlock probes`, the variants, the tests with their filters, the
//! `--exec` commands) and folders; the pool whose workers boot them, `--jobs` at a time; and
//! each VM's verdict in one summary line.
use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};

use super::{
    args::{single_kernel, spec, verdict},
    cargo_build::{arch_target, build, target_dir, test_binaries},
    guest::run_spec,
    kernel, qemu, GuestCommand, Report, Spec, VmArgs, DEFAULT_FILTERED, DEFAULT_TESTS,
    DEFAULT_VARIANTS, MATRIX, MATRIX_LEAVES_OUT,
};
use crate::{arch::Arch, sh};

/// One VM of a run: its label (`5.10`; empty for a single unnamed kernel) and its spec.
pub(super) struct Planned {
    label: String,
    spec: Spec,
}

/// The VMs of one run, planned (binaries built) and not yet started.
pub struct Plan {
    arch: Arch,
    root: PathBuf,
    base_results: PathBuf,
    /// The whole CI matrix of this architecture, without extra test arguments: its
    /// results make docs/kernels.md.
    whole_matrix: bool,
    pub(super) planned: Vec<Planned>,
}

pub(super) fn run_args(args: &VmArgs) -> Result<String> {
    let plan = Arc::new(plan_args(args)?);
    let start = Instant::now();
    let jobs = args.jobs.max(1);
    let pool = Pool::default();
    pool.push(&plan, 0, false);
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| pool.work());
        }
    });
    if plan.planned.len() > 1 {
        println!(
            "vm-test: {} kernels in {:.1}s ({} at a time)",
            plan.planned.len(),
            start.elapsed().as_secs_f64(),
            jobs
        );
    }
    finish(&plan, pool.reports_of(0))
}

/// VMs waiting for a worker, and the reports of those that ran: each worker takes the next
/// VM when its own ends.
#[derive(Default)]
pub(super) struct Pool {
    /// (plan id, plan, VM index)
    queue: Mutex<VecDeque<(usize, Arc<Plan>, usize)>>,
    /// (plan id, VM index, report)
    reports: Mutex<Vec<(usize, usize, Result<Report>)>>,
}

impl Pool {
    /// Queues every VM of `plan` under the id `id`, before the others when `first`.
    pub(super) fn push(&self, plan: &Arc<Plan>, id: usize, first: bool) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let jobs = (0..plan.planned.len()).map(|i| (id, plan.clone(), i));
        if first {
            for j in jobs.rev() {
                q.push_front(j);
            }
        } else {
            q.extend(jobs);
        }
    }

    /// Runs queued VMs until none is left.
    pub(super) fn work(&self) {
        loop {
            let next = self
                .queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            let Some((id, plan, i)) = next else {
                return;
            };
            let p = &plan.planned[i];
            let r = run_spec_labelled(&p.spec, &p.label);
            self.reports
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((id, i, r));
        }
    }

    /// The reports of plan `id`: (VM index, report).
    pub(super) fn reports_of(&self, id: usize) -> Vec<(usize, Result<Report>)> {
        let mut all = self.reports.lock().unwrap_or_else(|e| e.into_inner());
        let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(p, _, _)| *p == id);
        *all = rest;
        mine.into_iter().map(|(_, i, r)| (i, r)).collect()
    }
}

/// Plans the VMs of `args`: the binaries built, then one VM per kernel with its commands.
pub(super) fn plan_args(args: &VmArgs) -> Result<Plan> {
    let root = sh::workspace_root();
    let target = target_dir(&root, args.target_dir.as_deref());
    let arch = match &args.arch {
        Some(a) => a.parse::<Arch>().with_context(|| format!("--arch {a}"))?,
        None => Arch::Amd64,
    };
    if arch != Arch::Amd64 && args.matrix {
        bail!("--matrix on {arch}: only arm64 has a matrix besides x86-64's");
    }
    let suite = Suite::of(args);
    let bins = binaries(args, &root, &target, arch, &suite.tests)?;
    let kernels = kernels(args)?;
    let xtlock = arch_target(&target, arch).join("debug/xtlock");
    let base_results = args
        .results
        .clone()
        .unwrap_or_else(|| target.join("vm/results"));
    let mut planned = Vec::new();
    for (label, kernel, variants) in kernels {
        let commands = commands(args, &suite, &bins, &root, &xtlock, &label, variants);
        let (results, work) = folders(&label, arch, &base_results, &target);
        let label = match arch {
            Arch::Amd64 => label,
            _ => format!("{arch} {label}").trim().to_owned(),
        };
        planned.push(Planned {
            label,
            spec: spec(args, arch, kernel, commands, &root, &target, results, work)?,
        });
    }

    let whole_matrix = args.matrix && args.test_args.is_empty();
    Ok(Plan {
        arch,
        root,
        base_results,
        whole_matrix,
        planned,
    })
}

/// The tests a run asks for, with their libtest filters.
struct Suite {
    tests: Vec<String>,
    filters: Vec<(String, Vec<String>)>,
    /// No `--test` nor `--exec`: the default suite, its variants included.
    default: bool,
}

impl Suite {
    fn of(args: &VmArgs) -> Self {
        let mut tests = args.tests.clone();
        let mut filters = args.test_filters.clone();
        let default = tests.is_empty() && args.exec.is_empty();
        if default {
            tests = DEFAULT_TESTS.iter().map(|s| s.to_string()).collect();
            for (t, f) in DEFAULT_FILTERED {
                tests.push(t.to_string());
                filters.push((t.to_string(), f.iter().map(|s| s.to_string()).collect()));
            }
        }
        Suite {
            tests,
            filters,
            default,
        }
    }
}

/// Builds the binaries (unless `--no-build`) and finds the executables of `tests`.
fn binaries(
    args: &VmArgs,
    root: &Path,
    target: &Path,
    arch: Arch,
    tests: &[String],
) -> Result<Vec<(String, PathBuf)>> {
    if !args.no_build {
        let t = Instant::now();
        build(root, target, arch, args.quiet_build)?;
        if arch != Arch::host() {
            println!(
                "vm-test: binaries cross-built for {arch} in {:.1}s",
                t.elapsed().as_secs_f64()
            );
        }
    }
    if tests.is_empty() {
        return Ok(Vec::new());
    }
    let t = Instant::now();
    let b = test_binaries(root, target, tests, arch, args.quiet_build)?;
    if arch != Arch::host() && !args.no_build {
        println!(
            "vm-test: test binaries cross-built for {arch} in {:.1}s",
            t.elapsed().as_secs_f64()
        );
    }
    Ok(b)
}

/// The kernels of a run: (label, kernel, with the variants).
fn kernels(args: &VmArgs) -> Result<Vec<(String, kernel::Choice, bool)>> {
    if args.matrix {
        return Ok(MATRIX
            .iter()
            .map(|(s, v)| (s.to_string(), kernel::Choice::Series(s.to_string()), *v))
            .collect());
    }
    if args.kernels.is_empty() {
        return Ok(vec![(String::new(), single_kernel(args), true)]);
    }
    let mut v: Vec<String> = Vec::new();
    for k in &args.kernels {
        let k = k.trim();
        let all: Vec<String> = if k == "all" {
            kernel::SERIES.iter().map(|(s, _)| s.to_string()).collect()
        } else if kernel::SERIES.iter().any(|(s, _)| *s == k) {
            vec![k.to_owned()]
        } else {
            bail!(
                "--kernel {k}: expected one of {} or all (--kernel-version takes an exact \
                 version)",
                kernel::SERIES
                    .iter()
                    .map(|(s, _)| *s)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        for s in all {
            if !v.contains(&s) {
                v.push(s);
            }
        }
    }
    Ok(v.into_iter()
        .map(|s| (s.clone(), kernel::Choice::Series(s), true))
        .collect())
}

/// The commands of the VM of kernel `label`, in order: `xtlock probes`, the default suite's
/// variants, the tests, the `--exec` commands.
fn commands(
    args: &VmArgs,
    suite: &Suite,
    bins: &[(String, PathBuf)],
    root: &Path,
    xtlock: &Path,
    label: &str,
    variants: bool,
) -> Vec<GuestCommand> {
    let mut commands = Vec::new();
    if !bins.is_empty() {
        // What attached where, for docs/kernels.md (`cargo xtask kernels-doc`); first, so
        // it is there even when a test fails.
        commands.push(GuestCommand::shell(
            "xtlock probes --json",
            root,
            &format!(
                "{} probes --json >\"$XTLOCK_VM_RESULTS/probes.json\"",
                xtlock.display()
            ),
        ));
    }
    if suite.default && variants {
        for (test, extra) in DEFAULT_VARIANTS {
            if let Some((_, exe)) = bins.iter().find(|(n, _)| n == test) {
                let mut cmd = GuestCommand::shell(
                    &format!("{test} ({extra})"),
                    &root.join("tests"),
                    &format!("XTLOCK_TEST_TRACER_ARGS='{extra}' exec {}", exe.display()),
                );
                cmd.argv[2].push_str(&format!(" {}", args.test_args.join(" ")));
                commands.push(cmd);
            }
        }
    }
    for (name, exe) in bins {
        if let Some((_, _, why)) = MATRIX_LEAVES_OUT
            .iter()
            .find(|(s, t, _)| args.matrix && *s == label && t == name)
        {
            println!("vm-test {label}: {name} left out of the matrix: {why}");
            continue;
        }
        commands.push(test_command(args, &suite.filters, root, name, exe));
    }
    for (i, e) in args.exec.iter().enumerate() {
        let short: String = e.chars().take(60).collect();
        let more = if short.len() < e.len() { "..." } else { "" };
        commands.push(GuestCommand::shell(
            &format!("exec {}: {short}{more}", i + 1),
            root,
            e,
        ));
    }
    commands
}

/// The integration test `name` run by its executable, with the test arguments and then its
/// filters; labelled with the filters.
fn test_command(
    args: &VmArgs,
    test_filters: &[(String, Vec<String>)],
    root: &Path,
    name: &str,
    exe: &Path,
) -> GuestCommand {
    let filters: Vec<&str> = test_filters
        .iter()
        .filter(|(t, _)| t == name)
        .flat_map(|(_, f)| f.iter().map(String::as_str))
        .collect();
    GuestCommand {
        label: if filters.is_empty() {
            name.to_owned()
        } else {
            format!("{name} ({})", filters.join(", "))
        },
        // cargo runs integration tests from their package folder.
        cwd: root.join("tests"),
        argv: std::iter::once(exe.display().to_string())
            .chain(args.test_args.iter().cloned())
            .chain(
                test_filters
                    .iter()
                    .filter(|(t, _)| t == name)
                    .flat_map(|(_, f)| f.iter().cloned()),
            )
            .collect(),
    }
}

/// The results folder and the scratch folder of the VM of kernel `label` on `arch`.
fn folders(label: &str, arch: Arch, base_results: &Path, target: &Path) -> (PathBuf, PathBuf) {
    match (label.is_empty(), arch) {
        (true, Arch::Amd64) => (base_results.to_path_buf(), target.join("vm")),
        (false, Arch::Amd64) => (base_results.join(label), target.join("vm").join(label)),
        (true, _) => (
            base_results.join(arch.name()),
            target.join("vm").join(arch.name()),
        ),
        (false, _) => (
            base_results.join(arch.name()).join(label),
            target.join("vm").join(arch.name()).join(label),
        ),
    }
}

/// The verdict of each VM of `plan`, from `reports` ((VM, report), in any order), and
/// docs/kernels.md after a whole x86-64 matrix; one summary line.
pub(super) fn finish(plan: &Plan, mut reports: Vec<(usize, Result<Report>)>) -> Result<String> {
    let Plan {
        arch,
        root,
        base_results,
        planned,
        ..
    } = plan;
    let arch = *arch;
    reports.sort_by_key(|(i, _)| *i);
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    for (i, r) in reports {
        let p = &planned[i];
        let name = if p.label.is_empty() {
            "vm-test".to_owned()
        } else {
            format!("vm-test {}", p.label)
        };
        match r.and_then(|report| {
            report.print(&p.spec);
            verdict(&report, &p.spec).map(|()| report)
        }) {
            Ok(report) => lines.push(report.short()),
            Err(e) => failures.push(format!("{name}: {e:#}")),
        }
    }
    // Every series ran the whole matrix: docs/kernels.md from what attached where (even
    // after a failed test: `xtlock probes` ran first). Not after a partial run: its skip
    // lists would say "no test skipped" of the tests it left out.
    let ran: Vec<&str> = planned.iter().map(|p| p.label.as_str()).collect();
    if arch == Arch::Amd64
        && plan.whole_matrix
        && kernel::SERIES.iter().all(|(s, _)| ran.contains(s))
    {
        let written = kernels_doc_path(root, base_results)
            .and_then(|doc| crate::kernels_doc::write(base_results, &doc));
        if let Err(e) = written {
            failures.push(format!("kernels-doc: {e:#}"));
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    let summary = lines.join("; ");
    println!("vm-test: ok ({summary})");
    Ok(summary)
}

/// [`run_spec`] with the console prefixed by the kernel's label (`vm 5.10| `).
fn run_spec_labelled(spec: &Spec, label: &str) -> Result<Report> {
    let prefix = if label.is_empty() {
        qemu::PREFIX.to_owned()
    } else {
        format!("vm {label}| ")
    };
    run_spec(spec, &prefix)
}

/// Written from the results of a run of every series.
pub(super) const KERNELS_DOC: &str = "docs/kernels.md";

/// Where a run's regenerated docs/kernels.md goes: the tracked file, except under CI, which
/// leaves the clone's tracked files as they were: there a copy beside the results (to copy
/// in by hand, `cargo xtask kernels-doc`, when it says something new).
pub(super) fn kernels_doc_path(root: &Path, results: &Path) -> Result<PathBuf> {
    let tracked = root.join(KERNELS_DOC);
    if !in_ci() {
        return Ok(tracked);
    }
    let copy = results.join("kernels.md");
    std::fs::copy(&tracked, &copy)
        .with_context(|| format!("copying {} to {}", tracked.display(), copy.display()))?;
    Ok(copy)
}

/// `CI=true` (or `1`): a CI run, which leaves tracked files alone.
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}
