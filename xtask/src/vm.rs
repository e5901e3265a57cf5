//! `cargo xtask vm-test`: runs test binaries as root inside a QEMU VM that boots a stock
//! Debian kernel, for the kernel code paths this machine's kernel lacks (another kernel's
//! tracepoint layouts, kprobes, fentry, IPVS...).
//!
//! - The kernel: `linux-image-<V>-amd64` ([`kernel::PINNED`], `--kernel-version`,
//!   `XTLOCK_VM_KERNEL`, or `--kernel-deb`), fetched with `apt-get download` and unpacked into
//!   a cache (`kernel::cache_dir`) once.
//! - The guest: a busybox initramfs built per run (busybox-static, `vm/init.sh` as `/init`,
//!   the 9p and overlay modules, `/etc/xtlock-vm/{conf,run.sh}`). The host's root is shared
//!   read-only over 9p under a throwaway overlay, with tmpfs on /tmp and /run; the results
//!   folder is shared read-write. Tests find `target/` at the same path as on the host.
//! - The run: each command runs as root with `CI=true` and `XTLOCK_VM=1`; all of them run, the
//!   guest's exit status is the first failing one's (in `results/exit-status`, per command in
//!   `results/commands`, the serial console in `results/console.log`). QEMU is killed after
//!   `--timeout`.
//!
//! [`run_spec`] is the general entry point for other tasks: any commands, environment,
//! modules and kernel.
use std::{
    env, fs,
    io::Read as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context as _, Result};
use clap::Args;

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
};

use crate::{arch::Arch, setup, sh};

mod cpio;
pub mod kernel;
pub mod qemu;
pub mod userland;

use qemu::Accel;

/// The integration tests (targets of the `xtlock-tests` package) that run in the VM by
/// default. Later parts add theirs here.
/// `refusals` took 40.7 s (5.10, ICMP by the kprobe fallback), 42.8 s (6.1) and 40.8 s (6.12)
/// under TCG with the host's load average at 4.5 on 2 CPUs.
/// `rule_changes` took 85.2 s (6.12) and 95.1 s (5.10) under TCG, two guests at a time.
/// `rule_drops` took 99.8 s (5.10: no drop reasons, every drop asks for the counters) under
/// TCG, one guest.
pub const DEFAULT_TESTS: &[&str] = &[
    "lock_trace",
    "kernel_hooks",
    "ipvs",
    "refusals",
    "rule_changes",
    "rule_drops",
];

/// Default tests of which the default suite runs only some (libtest filters): the kept takes'
/// barriers are on only where the CPU is not x86, and the 5.10 and 6.1 verifiers once
/// refused that path (arm64 nodes on Debian 11 and 12 run those kernels), so every x86-64
/// guest loads and runs it too.
pub const DEFAULT_FILTERED: &[TestRun] = &[(
    "handoffs",
    &["kept_takes_are_never_torn_with_memory_barriers"],
)];

/// Default tests run a second time with other xtlock arguments (`XTLOCK_TEST_TRACER_ARGS`):
/// the first run puts the syscall hooks on fentry and the lock hook on tp_btf (the defaults
/// where they work); this one runs the lock tests on the fallbacks of a node where fentry
/// is refused, kprobes and the perf tracepoint, the same assertions holding.
pub const DEFAULT_VARIANTS: &[(&str, &str)] =
    &[("lock_trace", "--no-attach fentry --no-attach tp_btf")];

/// Modules every run loads (with their dependencies, in order) before the commands start;
/// others load on demand through busybox modprobe, as kmod would on a node. crc32c_generic
/// comes first: libcrc32c (nf_conntrack, nf_tables, ip_vs) needs a crc32c at load time. The
/// xt_* matches are those kube-proxy-style rules use: on a node they are loaded long before,
/// and loading one on demand under TCG takes a good part of a second inside a timed test.
pub const DEFAULT_MODULES: &[&str] = &[
    "crc32c_generic",
    "x_tables",
    "ip_tables",
    "iptable_filter",
    "iptable_nat",
    "ip6_tables",
    "ip6table_filter",
    "nf_conntrack",
    "nf_nat",
    "nf_tables",
    "ip_vs",
    "ip_vs_rr",
    "veth",
    "dummy",
    "xt_tcpudp",
    "xt_conntrack",
    "xt_mark",
    "xt_comment",
    "xt_statistic",
    "xt_nat",
    "xt_MASQUERADE",
    "xt_addrtype",
    "xt_multiport",
];

/// What `/init` needs before the host's root is there: virtio-pci, 9p and overlay (modules in
/// Debian's kernel; skipped where built in).
const EARLY_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Args, Debug, Default)]
pub struct VmArgs {
    /// The guest's architecture: amd64 (default) or arm64. arm64 boots Debian's
    /// `linux-image-*-arm64` in qemu-system-aarch64 (TCG: this machine cannot run it on KVM),
    /// on a root of Debian 12's arm64 packages (`vm/userland.rs`), with the test binaries
    /// cross-built for aarch64. Its results go to `<results>/arm64/<series>/`.
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,
    /// Kernel series to boot, each in its own VM: 5.10, 6.1, 6.12 (comma-separated or
    /// repeated; `all` for every one). Each is the newest `linux-image-<series>.*-amd64`
    /// Debian has, fetched and cached on first use. Results go to `<results>/<series>/`.
    #[arg(long = "kernel", value_name = "SERIES", value_delimiter = ',',
          conflicts_with_all = ["kernel_version", "kernel_deb"])]
    pub kernels: Vec<String>,
    /// The CI matrix: every series, with the suites [`MATRIX`] gives each; with `--arch arm64`,
    /// CI's arm64 part ([`ARM64_MATRIX`]).
    #[arg(long, conflicts_with_all = ["kernels", "kernel_version", "kernel_deb", "tests", "exec"])]
    pub matrix: bool,
    /// What `cargo xtask test` runs: the x86-64 matrix and the arm64 part from one queue,
    /// `XTLOCK_VM_JOBS` (default 2) guests at a time.
    #[arg(long, conflicts_with_all = ["matrix", "arch", "kernels", "kernel_version", "kernel_deb", "tests", "exec"])]
    pub ci: bool,
    /// VMs run at once when several kernels are booted (default 1: TCG is CPU-bound).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub jobs: usize,
    /// Guest kernel, as in `linux-image-<V>-amd64` (default: the pinned one, or
    /// XTLOCK_VM_KERNEL).
    #[arg(long, value_name = "V")]
    pub kernel_version: Option<String>,
    /// Boot the kernel of this linux-image .deb instead.
    #[arg(long, value_name = "PATH", conflicts_with = "kernel_version")]
    pub kernel_deb: Option<PathBuf>,
    /// An integration test of the xtlock-tests package to run (repeatable; default: the
    /// default suite, [`DEFAULT_TESTS`] with [`DEFAULT_FILTERED`] and [`DEFAULT_VARIANTS`],
    /// listed in docs/development.md; none when --exec is given).
    #[arg(long = "test", value_name = "NAME")]
    pub tests: Vec<String>,
    /// A shell command to run in the guest after the tests (repeatable), from the workspace.
    #[arg(long, value_name = "CMD")]
    pub exec: Vec<String>,
    /// KEY=VALUE for the guest commands (repeatable; CI=true and XTLOCK_VM=1 are set already).
    #[arg(long, value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Comma-separated modules to load instead of the default set.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub modules: Option<Vec<String>>,
    /// Comma-separated modules to load besides the default set.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub add_modules: Vec<String>,
    /// Kill the VM after this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub timeout: u64,
    /// kvm, tcg or auto (default; or XTLOCK_VM_ACCEL): KVM only when a probe VM runs on it.
    #[arg(long, value_name = "ACCEL")]
    pub accel: Option<String>,
    #[arg(long, default_value_t = 2)]
    pub cpus: u32,
    #[arg(long, value_name = "MB", default_value_t = 2048)]
    pub memory: u32,
    /// Where the binaries are built and found (default: CARGO_TARGET_DIR, else target).
    #[arg(long, value_name = "DIR")]
    pub target_dir: Option<PathBuf>,
    /// Results folder, shared read-write (default: <target-dir>/vm/results).
    #[arg(long, value_name = "DIR")]
    pub results: Option<PathBuf>,
    /// Use the binaries as they are: no cargo build.
    #[arg(long)]
    pub no_build: bool,
    /// Test-name filters per test binary (`ARM64_MATRIX`), after `test_args`.
    #[arg(skip)]
    pub test_filters: Vec<(String, Vec<String>)>,
    /// Builds say only warnings and errors (`cargo --quiet`).
    #[arg(skip)]
    pub quiet_build: bool,
    /// Passed to every test binary, e.g. `-- calico --nocapture`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub test_args: Vec<String>,
}

/// One command in the guest.
#[derive(Clone, Debug)]
pub struct GuestCommand {
    pub label: String,
    /// Working directory (a host path, seen at the same path in the guest).
    pub cwd: PathBuf,
    /// Program and arguments; run through `sh -c` when `shell` is set.
    pub argv: Vec<String>,
}

impl GuestCommand {
    pub fn shell(label: &str, cwd: &Path, script: &str) -> Self {
        Self {
            label: label.to_owned(),
            cwd: cwd.to_owned(),
            argv: vec!["sh".into(), "-c".into(), script.into()],
        }
    }
}

/// Everything one VM run needs.
#[derive(Clone, Debug)]
pub struct Spec {
    pub arch: Arch,
    pub kernel: kernel::Choice,
    pub commands: Vec<GuestCommand>,
    /// Added to (and overriding) the defaults: PATH, HOME, CI=true, XTLOCK_VM=1,
    /// XTLOCK_VM_KERNEL, XTLOCK_VM_RESULTS, RUST_BACKTRACE=1.
    pub env: Vec<(String, String)>,
    /// Loaded with their dependencies before the commands.
    pub modules: Vec<String>,
    /// Host folders that must stay visible although under a guest tmpfs (/tmp, /run).
    pub keep: Vec<PathBuf>,
    /// Shared read-write; cleared of the previous run's status files.
    pub results: PathBuf,
    /// Scratch for the initramfs and the KVM probe.
    pub work: PathBuf,
    pub timeout: Duration,
    /// None: detect.
    pub accel: Option<Accel>,
    pub cpus: u32,
    pub memory_mb: u32,
}

/// How a run went.
pub struct Report {
    pub kernel: kernel::Kernel,
    pub accel: Accel,
    pub accel_why: String,
    /// Fetching/unpacking the kernel (or finding it cached) and building the initramfs.
    pub prepare: Duration,
    pub ended: qemu::Ended,
    /// Per command: exit status, milliseconds, label (from `results/commands`).
    pub commands: Vec<(i32, u64, String)>,
    /// The guest's exit status: `results/exit-status`, else the serial marker.
    pub exit_status: Option<i32>,
    /// Tests or parts skipped on this kernel, each with the feature it lacks
    /// (`results/skips`, written by the tests' `skip_on_this_kernel`).
    pub skips: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.exit_status == Some(0) && !self.ended.timed_out
    }

    /// One line for `cargo xtask test`'s summary.
    pub fn short(&self) -> String {
        let ran: Vec<&str> = self.commands.iter().map(|c| c.2.as_str()).collect();
        let skipped = match self.skips.len() {
            0 => String::new(),
            n => format!(" ({n} skipped for a missing kernel feature)"),
        };
        format!(
            "{}{skipped} on {} under QEMU/{}, boot {}",
            ran.join(", "),
            self.kernel.release,
            self.accel.name(),
            self.ended
                .boot
                .map_or("-".into(), |b| format!("{:.1}s", b.as_secs_f64()))
        )
    }

    pub fn print(&self, spec: &Spec) {
        let e = &self.ended;
        println!("\n== vm-test summary");
        println!(
            "  kernel    {} ({}; {}{})",
            self.kernel.release,
            self.kernel.package,
            if self.kernel.pvh {
                "vmlinux by PVH"
            } else {
                "bzImage"
            },
            if self.kernel.cached { ", cached" } else { "" }
        );
        println!(
            "  qemu      {}, {} CPUs, {} MB ({})",
            self.accel.name(),
            spec.cpus,
            spec.memory_mb,
            self.accel_why
        );
        println!(
            "  prepare   {:.1}s (kernel, initramfs)",
            self.prepare.as_secs_f64()
        );
        match (e.boot, e.guest_uptime) {
            (Some(b), Some(u)) => println!(
                "  boot      {:.1}s from starting QEMU to the first command (guest uptime {u:.1}s)",
                b.as_secs_f64()
            ),
            _ => println!("  boot      did not finish"),
        }
        for (rc, ms, label) in &self.commands {
            let word = if *rc == 0 { "ok" } else { "FAILED" };
            println!(
                "  {word:<9} {label} ({:.1}s, exit status {rc})",
                *ms as f64 / 1000.0
            );
        }
        let ran: Vec<&str> = self.commands.iter().map(|c| c.2.as_str()).collect();
        for c in &spec.commands {
            if !ran.contains(&c.label.as_str()) {
                println!("  unfinished {}", c.label);
            }
        }
        for s in &self.skips {
            println!("  skipped   {s}");
        }
        println!("  vm        {:.1}s in QEMU", e.elapsed.as_secs_f64());
        println!("  results   {}", spec.results.display());
    }
}

/// `cargo xtask vm-test`.
pub fn run(args: &VmArgs) -> Result<()> {
    setup::run()?;
    let start = Instant::now();
    let arm64_matrix = args.matrix
        && args.arch.as_deref().and_then(|a| a.parse::<Arch>().ok()) == Some(Arch::Arm64);
    let result = if args.ci {
        let (amd64, arm64) = run_ci(ci_jobs(), None);
        match (amd64, arm64) {
            (Ok(a), Ok(b)) => Ok(format!("{a}; {b}")),
            (a, b) => Err(anyhow::anyhow!(
                "{}",
                [a.err(), b.err()]
                    .into_iter()
                    .flatten()
                    .map(|e| format!("{e:#}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            )),
        }
    } else if arm64_matrix {
        run_arm64_default()
    } else {
        run_args(args)
    };
    println!("vm-test: {:.1}s in all", start.elapsed().as_secs_f64());
    result.map(|_| ())
}

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

/// The CI matrix: each kernel series with whether it also runs [`DEFAULT_VARIANTS`]. Every
/// kernel runs the whole default suite once on the attach types it takes first; the
/// fallback run (kprobes for the syscall hooks, the perf tracepoint for the lock hook) runs
/// once, on 5.10: the oldest layouts (`fl_*` tracepoint fields, no module BTF, the 5.10
/// verifier), where a node is likeliest to be on the fallbacks anyway.
pub const MATRIX: &[(&str, bool)] = &[("5.10", true), ("6.1", false), ("6.12", false)];

/// Default tests the CI matrix leaves out on one series, and why (run them with `--kernel
/// SERIES --test NAME`).
/// None now: 5.10's `refusals` failures (1 run in 3) were the live source reading the refusal
/// counters before a hold's take that was still in the ring, fixed in `source/live.rs`.
pub const MATRIX_LEAVES_OUT: &[(&str, &str, &str)] = &[];

/// A test binary and the libtest filters its run takes (none: all its tests).
pub type TestRun = (&'static str, &'static [&'static str]);

/// The arm64 part of the CI matrix: (series, [(test, libtest filters: none for all)]). CI
/// has one hour for everything and took ~39 min before arm64 came, so this step gets ~12 min
/// on the 2-core CI machine, cross-build included: in a fresh clone the aarch64 build of
/// xtlock and the tests starts from nothing (7-8 min; figures in docs/kernels.md). The
/// emulated aarch64 guest is about as fast as the x86-64 ones (all are TCG here, and the
/// tests mostly wait on real time: lock_trace 95 s against 93 s, kernel_hooks 242 s against
/// 222 s), so the default suite (~10 min) cannot come along, nor all of kernel_hooks. One
/// kernel, 6.12 (the same attach types as the x86-64 guests: Debian's arm64 6.1 refuses
/// fentry on the syscall functions, error 524, and runs them on kprobes, which lock_trace
/// passes too), and what differs on arm64: all of `lock_trace` (the
/// syscall hooks on `__arm64_sys_*` reading the user `pt_regs` at offsets from BTF: command
/// lines, exit statuses, table replaces and reads; the lock path), and the two tests of
/// `kernel_hooks` whose hooks are kprobes on module functions, with arguments the BPF
/// programs read from arm64's `pt_regs` (conntrack refusals; nf_tables commits of both
/// backends). The rest of kernel_hooks, `ipvs` and `refusals` pass there too: `cargo xtask
/// vm-test --arch arm64 --kernel 6.12` runs them all.
pub const ARM64_MATRIX: &[(&str, &[TestRun])] = &[(
    "6.12",
    &[
        ("lock_trace", &[]),
        (
            "kernel_hooks",
            &[
                "conntrack_refusals_come_with_their_flows",
                "both_backends_in_one_netns_are_named",
                // With the function hooks ruled out, the sendmsg() slots' compare-and-swap
                // as arm64's JIT emits it.
                "nft_batch_is_an_nf_tables_commit_hold",
            ],
        ),
        // The kept takes' barriers are on by default on arm64, so the plain test runs them
        // (`--exact`: not its `_with_memory_barriers` twin, the same test there). TCG on
        // x86 gives the guest the host's memory order: this checks the path, not reordering.
        ("handoffs", &["kept_takes_are_never_torn", "--exact"]),
    ],
)];

/// One VM of a run: its label (`5.10`; empty for a single unnamed kernel) and its spec.
struct Planned {
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
    planned: Vec<Planned>,
}

fn run_args(args: &VmArgs) -> Result<String> {
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
struct Pool {
    /// (plan id, plan, VM index)
    queue: Mutex<VecDeque<(usize, Arc<Plan>, usize)>>,
    /// (plan id, VM index, report)
    reports: Mutex<Vec<(usize, usize, Result<Report>)>>,
}

impl Pool {
    /// Queues every VM of `plan` under the id `id`, before the others when `first`.
    fn push(&self, plan: &Arc<Plan>, id: usize, first: bool) {
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
    fn work(&self) {
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
    fn reports_of(&self, id: usize) -> Vec<(usize, Result<Report>)> {
        let mut all = self.reports.lock().unwrap_or_else(|e| e.into_inner());
        let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(p, _, _)| *p == id);
        *all = rest;
        mine.into_iter().map(|(_, i, r)| (i, r)).collect()
    }
}

fn plan_args(args: &VmArgs) -> Result<Plan> {
    let root = sh::workspace_root();
    let target = target_dir(&root, args.target_dir.as_deref());
    let arch = match &args.arch {
        Some(a) => a.parse::<Arch>().with_context(|| format!("--arch {a}"))?,
        None => Arch::Amd64,
    };
    if arch != Arch::Amd64 && args.matrix {
        bail!("--matrix on {arch}: only arm64 has a matrix besides x86-64's");
    }
    let mut tests = args.tests.clone();
    let mut test_filters = args.test_filters.clone();
    let default_suite = tests.is_empty() && args.exec.is_empty();
    if default_suite {
        tests = DEFAULT_TESTS.iter().map(|s| s.to_string()).collect();
        for (t, f) in DEFAULT_FILTERED {
            tests.push(t.to_string());
            test_filters.push((t.to_string(), f.iter().map(|s| s.to_string()).collect()));
        }
    }
    if !args.no_build {
        let t = Instant::now();
        build(&root, &target, arch, args.quiet_build)?;
        if arch != Arch::host() {
            println!(
                "vm-test: binaries cross-built for {arch} in {:.1}s",
                t.elapsed().as_secs_f64()
            );
        }
    }
    let bins = if tests.is_empty() {
        Vec::new()
    } else {
        let t = Instant::now();
        let b = test_binaries(&root, &target, &tests, arch, args.quiet_build)?;
        if arch != Arch::host() && !args.no_build {
            println!(
                "vm-test: test binaries cross-built for {arch} in {:.1}s",
                t.elapsed().as_secs_f64()
            );
        }
        b
    };
    // (label, kernel, with the variants)
    let kernels: Vec<(String, kernel::Choice, bool)> = if args.matrix {
        MATRIX
            .iter()
            .map(|(s, v)| (s.to_string(), kernel::Choice::Series(s.to_string()), *v))
            .collect()
    } else if !args.kernels.is_empty() {
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
        v.into_iter()
            .map(|s| (s.clone(), kernel::Choice::Series(s), true))
            .collect()
    } else {
        vec![(String::new(), single_kernel(args), true)]
    };
    let xtlock = arch_target(&target, arch).join("debug/xtlock");
    let base_results = args
        .results
        .clone()
        .unwrap_or_else(|| target.join("vm/results"));
    let mut planned = Vec::new();
    for (label, kernel, variants) in kernels {
        let mut commands = Vec::new();
        if !bins.is_empty() {
            // What attached where, for docs/kernels.md (`cargo xtask kernels-doc`); first, so
            // it is there even when a test fails.
            commands.push(GuestCommand::shell(
                "xtlock probes --json",
                &root,
                &format!(
                    "{} probes --json >\"$XTLOCK_VM_RESULTS/probes.json\"",
                    xtlock.display()
                ),
            ));
        }
        if default_suite && variants {
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
        for (name, exe) in &bins {
            if let Some((_, _, why)) = MATRIX_LEAVES_OUT
                .iter()
                .find(|(s, t, _)| args.matrix && *s == label && t == name)
            {
                println!("vm-test {label}: {name} left out of the matrix: {why}");
                continue;
            }
            let filters: Vec<&str> = test_filters
                .iter()
                .filter(|(t, _)| t == name)
                .flat_map(|(_, f)| f.iter().map(String::as_str))
                .collect();
            commands.push(GuestCommand {
                label: if filters.is_empty() {
                    name.clone()
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
            });
        }
        for (i, e) in args.exec.iter().enumerate() {
            let short: String = e.chars().take(60).collect();
            let more = if short.len() < e.len() { "..." } else { "" };
            commands.push(GuestCommand::shell(
                &format!("exec {}: {short}{more}", i + 1),
                &root,
                e,
            ));
        }
        let (results, work) = match (label.is_empty(), arch) {
            (true, Arch::Amd64) => (base_results.clone(), target.join("vm")),
            (false, Arch::Amd64) => (base_results.join(&label), target.join("vm").join(&label)),
            (true, _) => (
                base_results.join(arch.name()),
                target.join("vm").join(arch.name()),
            ),
            (false, _) => (
                base_results.join(arch.name()).join(&label),
                target.join("vm").join(arch.name()).join(&label),
            ),
        };
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

/// The verdict of each VM of `plan`, from `reports` ((VM, report), in any order), and
/// docs/kernels.md after a whole x86-64 matrix; one summary line.
fn finish(plan: &Plan, mut reports: Vec<(usize, Result<Report>)>) -> Result<String> {
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

/// Written from the results of a run of every series.
const KERNELS_DOC: &str = "docs/kernels.md";

/// Where a run's regenerated docs/kernels.md goes: the tracked file, except under CI, which
/// leaves the clone's tracked files as they were: there a copy beside the results (to copy
/// in by hand, `cargo xtask kernels-doc`, when it says something new).
fn kernels_doc_path(root: &Path, results: &Path) -> Result<PathBuf> {
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
    env::var("CI").is_ok_and(|v| v == "true" || v == "1")
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

/// The kernel of a run without `--kernel`: `--kernel-deb`, `--kernel-version`,
/// `XTLOCK_VM_KERNEL`, else the pin.
fn single_kernel(args: &VmArgs) -> kernel::Choice {
    match (&args.kernel_deb, &args.kernel_version) {
        (Some(deb), _) => kernel::Choice::Deb(deb.clone()),
        (None, Some(v)) => kernel::Choice::Apt {
            version: normalize_version(v),
            pinned: false,
        },
        (None, None) => match env::var("XTLOCK_VM_KERNEL") {
            Ok(v) if !v.is_empty() => kernel::Choice::Apt {
                version: normalize_version(&v),
                pinned: false,
            },
            _ => kernel::Choice::Apt {
                version: kernel::PINNED.to_owned(),
                pinned: true,
            },
        },
    }
}

#[allow(clippy::too_many_arguments)]
fn spec(
    args: &VmArgs,
    arch: Arch,
    kernel: kernel::Choice,
    commands: Vec<GuestCommand>,
    root: &Path,
    target: &Path,
    results: PathBuf,
    work: PathBuf,
) -> Result<Spec> {
    let mut env = Vec::new();
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--env {kv}: expected KEY=VALUE"))?;
        env.push((k.to_owned(), v.to_owned()));
    }
    let mut modules: Vec<String> = match &args.modules {
        Some(m) => m.clone(),
        None => DEFAULT_MODULES.iter().map(|s| s.to_string()).collect(),
    };
    modules.extend(args.add_modules.iter().cloned());
    modules.retain(|m| !m.is_empty());
    let accel = match args
        .accel
        .clone()
        .or_else(|| env::var("XTLOCK_VM_ACCEL").ok())
        .as_deref()
    {
        None | Some("") | Some("auto") => None,
        Some("kvm") => Some(Accel::Kvm),
        Some("tcg") => Some(Accel::Tcg),
        Some(other) => bail!("--accel {other}: expected kvm, tcg or auto"),
    };
    let mut keep = vec![target.to_path_buf(), root.to_path_buf()];
    if !arch.is_host() {
        // With a root of its own the guest sees no host folder unless bound: the unpacked
        // kernels, where tests find the running kernel's .ko files (ipvs loads ip_vs late).
        keep.push(kernel::cache_dir().join("kernels"));
    }
    Ok(Spec {
        arch,
        kernel,
        commands,
        env,
        modules,
        keep,
        results,
        work,
        timeout: Duration::from_secs(args.timeout),
        accel,
        cpus: args.cpus,
        memory_mb: args.memory,
    })
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

/// Ok when every guest command passed.
fn verdict(report: &Report, spec: &Spec) -> Result<()> {
    if report.ok() {
        return Ok(());
    }
    let e = &report.ended;
    if e.timed_out {
        bail!(
            "the VM did not finish within {} s and was killed ({}); see {}/console.log",
            spec.timeout.as_secs(),
            if e.boot.is_some() {
                "the commands were running"
            } else {
                "it had not even booted"
            },
            spec.results.display()
        );
    }
    match report.exit_status {
        Some(rc) => {
            let failed: Vec<&str> = report
                .commands
                .iter()
                .filter(|c| c.0 != 0)
                .map(|c| c.2.as_str())
                .collect();
            bail!(
                "the guest on {} exited {rc}; failed: {}",
                report.kernel.release,
                if failed.is_empty() {
                    "the VM setup (see above)".to_owned()
                } else {
                    failed.join(", ")
                }
            )
        }
        None => bail!(
            "the guest ended without an exit status (QEMU: {}); last lines:\n  {}",
            e.qemu.map_or("?".into(), |s| s.to_string()),
            e.tail.join("\n  ")
        ),
    }
}

/// "6.1.0-56", "6.1.0-56-amd64" and "linux-image-6.1.0-56-amd64" all mean 6.1.0-56 (and
/// so do the same with -arm64).
fn normalize_version(v: &str) -> String {
    let v = v.trim();
    let v = v.strip_prefix("linux-image-").unwrap_or(v);
    Arch::ALL
        .iter()
        .find_map(|a| v.strip_suffix(&format!("-{a}")))
        .unwrap_or(v)
        .to_owned()
}

/// Where cargo puts `arch`'s builds: `target` for the host's, `target/TRIPLE` for another.
pub fn arch_target(target: &Path, arch: Arch) -> PathBuf {
    if arch.is_host() {
        target.to_path_buf()
    } else {
        target.join(arch.triple())
    }
}

pub fn target_dir(root: &Path, given: Option<&Path>) -> PathBuf {
    let t = given
        .map(Path::to_path_buf)
        .or_else(|| env::var_os("CARGO_TARGET_DIR").map(PathBuf::from))
        .unwrap_or_else(|| root.join("target"));
    if t.is_absolute() {
        t
    } else {
        root.join(t)
    }
}

/// cargo with the environment of `cargo xtask test`'s steps (so nothing rebuilds).
fn cargo(root: &Path, target: &Path) -> Command {
    let mut c = sh::cargo();
    c.current_dir(root)
        .env("CARGO_TARGET_DIR", target)
        .env("XTLOCK_REQUIRE_EBPF", "1")
        .env("RUST_BACKTRACE", "1");
    c
}

const EXCLUDE: [&str; 3] = ["--workspace", "--exclude", "xtlock-ebpf"];

/// What is built for another architecture than the host's: xtlock and the tests' package
/// (its helper binaries and integration tests), not xtask and the benches' tools.
const CROSS_PACKAGES: [&str; 4] = ["-p", "xtlock", "-p", "xtlock-tests"];

/// The package selection of `arch`'s builds.
fn selection(arch: Arch) -> &'static [&'static str] {
    if arch.is_host() {
        &EXCLUDE
    } else {
        &CROSS_PACKAGES
    }
}

fn build(root: &Path, target: &Path, arch: Arch, quiet: bool) -> Result<()> {
    arch.check_cross()?;
    let mut cmd = cargo(root, target);
    cmd.arg("build").args(selection(arch)).arg("--bins");
    if quiet {
        cmd.arg("--quiet");
    }
    cross_args(&mut cmd, arch);
    sh::run(&mut cmd)
}

/// `--target` and the cross linker for another architecture; and there, debug info of line
/// tables only (backtraces keep their lines): a cross build is from nothing in a fresh
/// clone, and full debug info is a good part of its time on a 2-core machine. Build
/// scripts and proc macros, built for the host, are not affected.
fn cross_args(cmd: &mut Command, arch: Arch) {
    arch.cargo_args(cmd, false);
    if !arch.is_host() {
        cmd.env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only");
    }
}

/// The executables of the named integration tests of `xtlock-tests`, built as
/// `cargo xtask test` builds them (the same workspace selection, so the same features and
/// nothing rebuilt), but only those targets: a broken unit test elsewhere does not stop them.
fn test_binaries(
    root: &Path,
    target: &Path,
    names: &[String],
    arch: Arch,
    quiet: bool,
) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo(root, target);
    cmd.args(["test", "--no-run", "--message-format=json"])
        .args(selection(arch));
    if quiet {
        cmd.arg("--quiet");
    }
    cross_args(&mut cmd, arch);
    cmd.args(names.iter().flat_map(|n| ["--test", n.as_str()]))
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    println!("+ {}", sh::show(&cmd));
    let mut child = cmd.spawn().context("running cargo test --no-run")?;
    let mut out = String::new();
    child
        .stdout
        .take()
        .context("cargo stdout")?
        .read_to_string(&mut out)?;
    if !child.wait()?.success() {
        bail!("cargo test --no-run failed");
    }
    let found = integration_tests(&out);
    names
        .iter()
        .map(|n| {
            found
                .iter()
                .find(|(name, _)| name == n)
                .cloned()
                .with_context(|| {
                    format!(
                        "xtlock-tests has no integration test `{n}` (it has: {})",
                        found
                            .iter()
                            .map(|f| f.0.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })
        })
        .collect()
}

/// (target name, executable) of each `xtlock-tests` integration test in cargo's JSON messages
/// (one message a line; lines that are not JSON are left out).
fn integration_tests(json_lines: &str) -> Vec<(String, PathBuf)> {
    json_lines
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .filter(|m| m["target"]["kind"] == serde_json::json!(["test"]))
        .filter(|m| {
            m["package_id"]
                .as_str()
                .is_some_and(|p| p.contains("xtlock-tests"))
        })
        .filter_map(|m| {
            Some((
                m["target"]["name"].as_str()?.to_string(),
                PathBuf::from(m["executable"].as_str()?),
            ))
        })
        .collect()
}

/// Boots the VM of `spec` and runs its commands, its console shown with `prefix` before each
/// line; Err only when the VM could not be started.
pub fn run_spec(spec: &Spec, prefix: &str) -> Result<Report> {
    let start = Instant::now();
    for t in [spec.arch.qemu(), "busybox", "dpkg", "apt-get", "xz"] {
        if sh::which(t).is_none() {
            bail!("{t} is missing: run `cargo xtask setup` (qemu-system-x86, qemu-system-arm, busybox-static, xz-utils)");
        }
    }
    fs::create_dir_all(&spec.work)?;
    let kernel = kernel::prepare(&spec.kernel, &kernel::cache_dir(), spec.arch)?;
    // The guest's root: the host's, or, for another architecture, Debian's packages of it.
    let userland = if spec.arch.is_host() {
        None
    } else {
        Some(userland::prepare(&kernel::cache_dir(), spec.arch)?)
    };
    let modules = kernel::Modules::load(&kernel.modules)?;
    let early: Vec<String> = EARLY_MODULES.iter().map(|s| s.to_string()).collect();
    let early = modules.closure(&early)?;
    let preload = modules.closure(&spec.modules)?;

    let results = absolute(&spec.results)?;
    fs::create_dir_all(&results)?;
    clear_results(&results);
    let conf = conf(
        spec,
        &kernel,
        &early,
        &preload,
        &results,
        userland.is_some(),
    )?;
    let initramfs = spec.work.join("initramfs.cpio");
    let busybox = match &userland {
        Some(u) => u.join("bin/busybox"),
        None => sh::which("busybox").context("busybox is missing")?,
    };
    build_initramfs(
        &initramfs,
        &busybox,
        &kernel,
        &early,
        &conf,
        &run_script(spec, &kernel, &results),
    )?;

    let (mut accel, mut accel_why) = match spec.accel {
        _ if !spec.arch.is_host() => (
            Accel::Tcg,
            format!("an {} guest on an {} host", spec.arch, Arch::host()),
        ),
        Some(a) => (a, "chosen".to_owned()),
        None => qemu::detect_accel(&spec.work),
    };
    let prepare = start.elapsed();
    let mut shares = vec![
        (
            "hostroot",
            userland.clone().unwrap_or_else(|| "/".into()),
            true,
        ),
        ("results", results.clone(), false),
    ];
    if userland.is_some() {
        shares.push(("hostfs", "/".into(), true));
    }
    let ended = loop {
        println!(
            "vm: {} ({}), QEMU/{accel_name} ({accel_why}); {} command(s), time limit {} s",
            kernel.release,
            kernel.package,
            spec.commands.len(),
            spec.timeout.as_secs(),
            accel_name = accel.name(),
        );
        let ended = qemu::boot(&qemu::Boot {
            arch: spec.arch,
            accel,
            cpus: spec.cpus,
            memory_mb: spec.memory_mb,
            image: &kernel.image,
            initramfs: &initramfs,
            cmdline: cmdline(spec.arch, accel),
            shares: shares.clone(),
            timeout: spec.timeout,
            console_log: &results.join("console.log"),
            prefix,
        })?;
        // KVM passed the probe but cannot run this kernel: the same guest again under TCG,
        // unless KVM was asked for by name.
        if ended.kvm_internal_error && spec.accel.is_none() {
            qemu::kvm_failed();
            println!(
                "vm: KVM stopped the guest with an internal error ({:.1} s in): booting it again \
                 under TCG, and every later guest of this run",
                ended.elapsed.as_secs_f64()
            );
            clear_results(&results);
            accel = Accel::Tcg;
            accel_why = "KVM stopped this guest with an internal error".to_owned();
            continue;
        }
        break ended;
    };
    // Boot time, for docs/kernels.md's figures of emulated guests.
    let _ = fs::write(
        results.join("timing"),
        match ended.boot {
            Some(b) => format!("boot={:.1}\n", b.as_secs_f64()),
            None => String::new(),
        },
    );
    // Which kernel these results are of (`cargo xtask kernels-doc` names it).
    fs::write(
        results.join("kernel"),
        format!(
            "release={}\npackage={}\narch={}\n",
            kernel.release, kernel.package, spec.arch
        ),
    )?;
    let from_file = fs::read_to_string(results.join("exit-status"))
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let commands = fs::read_to_string(results.join("commands"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, '\t');
            Some((
                f.next()?.parse().ok()?,
                f.next()?.parse().ok()?,
                f.next()?.to_owned(),
            ))
        })
        .collect();
    Ok(Report {
        exit_status: from_file.or(ended.exit_status),
        kernel,
        accel,
        accel_why,
        prepare,
        ended,
        commands,
        skips: fs::read_to_string(results.join("skips"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect(),
    })
}

/// Removes what a guest's earlier run left in `results` (a run's files are all its own).
fn clear_results(results: &Path) {
    for f in [
        "exit-status",
        "commands",
        "console.log",
        "probes.json",
        "kernel",
        "skips",
        "timing",
    ] {
        let _ = fs::remove_file(results.join(f));
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    Ok(if p.is_absolute() {
        p.to_path_buf()
    } else {
        env::current_dir()?.join(p)
    })
}

/// quiet: the kernel says only warnings and worse. tsc=reliable: TCG's TSC is steady, and
/// the fallback (HPET) makes every clock read an emulated MMIO access. mitigations=off: the
/// page-table switches of KPTI are slow under TCG and prove nothing here.
/// arm64's `virt` machine has its console on the PL011 (ttyAMA0).
fn cmdline(arch: Arch, accel: Accel) -> String {
    let console = match arch {
        Arch::Amd64 => "ttyS0",
        Arch::Arm64 => "ttyAMA0",
    };
    let mut c = format!("console={console} panic=-1 quiet loglevel=4 mitigations=off");
    if accel == Accel::Tcg && arch == Arch::Amd64 {
        c.push_str(" tsc=reliable no_timer_check");
    }
    c
}

/// Single-quoted for sh.
fn sq(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn words(v: &[String]) -> String {
    v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" ")
}

fn conf(
    spec: &Spec,
    kernel: &kernel::Kernel,
    early: &[String],
    preload: &[String],
    results: &Path,
    own_root: bool,
) -> Result<String> {
    let keep: Vec<String> = spec
        .keep
        .iter()
        .map(|p| absolute(p).map(|p| p.display().to_string()))
        .collect::<Result<_>>()?;
    for p in keep.iter().chain([&results.display().to_string()]) {
        if p.contains(char::is_whitespace) {
            bail!("vm: paths with blanks are not supported: {p}");
        }
    }
    let epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(format!(
        "RELEASE={}\nMSIZE=512000\nEARLY_MODULES={}\nMODULES={}\nMODULES_DIR={}\nRESULTS={}\nKEEP={}\nHOST_EPOCH={epoch}\nHOSTFS={}\n",
        sq(&kernel.release),
        sq(&words(early)),
        sq(&words(preload)),
        sq(&absolute(&kernel.modules)?.display().to_string()),
        sq(&results.display().to_string()),
        sq(&keep.join(" ")),
        if own_root { "1" } else { "" },
    ))
}

/// The script the guest runs as root: every command, each one's status in
/// `results/commands`, and the first failure's status as its own.
fn run_script(spec: &Spec, kernel: &kernel::Kernel, results: &Path) -> String {
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), GUEST_PATH.into()),
        ("HOME".into(), "/root".into()),
        ("LANG".into(), "C.UTF-8".into()),
        ("CI".into(), "true".into()),
        ("RUST_BACKTRACE".into(), "1".into()),
        ("XTLOCK_VM".into(), "1".into()),
        ("XTLOCK_VM_KERNEL".into(), kernel.release.clone()),
        ("XTLOCK_VM_RESULTS".into(), results.display().to_string()),
    ];
    for (k, v) in &spec.env {
        env.retain(|(k2, _)| k2 != k);
        env.push((k.clone(), v.clone()));
    }
    let mut s = String::from("#!/bin/sh\n# Written by cargo xtask vm-test (xtask/src/vm.rs).\n");
    for (k, v) in &env {
        s.push_str(&format!("export {k}={}\n", sq(v)));
    }
    s.push_str(
        r#"failed=0
step() {
    label=$1
    dir=$2
    shift 2
    printf 'xtlock-vm: run: %s\n' "$label"
    t0=$(date +%s%N)
    (cd "$dir" && exec "$@")
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    printf 'xtlock-vm: done: %s: exit status %s after %s ms\n' "$label" "$rc" "$ms"
    printf '%s\t%s\t%s\n' "$rc" "$ms" "$label" >>"$XTLOCK_VM_RESULTS/commands"
    if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=$rc; fi
}
"#,
    );
    for c in &spec.commands {
        s.push_str(&format!(
            "step {} {} {}\n",
            sq(&c.label.replace(['\t', '\n'], " ")),
            sq(&c.cwd.display().to_string()),
            c.argv.iter().map(|a| sq(a)).collect::<Vec<_>>().join(" ")
        ));
    }
    s.push_str("exit \"$failed\"\n");
    s
}

fn build_initramfs(
    out: &Path,
    busybox_path: &Path,
    kernel: &kernel::Kernel,
    early: &[String],
    conf: &str,
    run: &str,
) -> Result<()> {
    let busybox =
        fs::read(busybox_path).with_context(|| format!("reading {}", busybox_path.display()))?;
    if !is_static_elf(&busybox) {
        bail!(
            "{} is not statically linked: install busybox-static",
            busybox_path.display()
        );
    }
    let file = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut c = cpio::Cpio::new(std::io::BufWriter::new(file));
    for d in [
        "/bin",
        "/sbin",
        "/usr",
        "/usr/bin",
        "/usr/sbin",
        "/etc",
        "/etc/xtlock-vm",
        "/proc",
        "/sys",
        "/dev",
        "/tmp",
        "/lib",
        "/lib/modules",
        "/host",
        "/overlay",
        "/newroot",
    ] {
        c.dir(d, 0o755)?;
    }
    c.char_dev("/dev/console", 0o600, 5, 1)?;
    c.file("/bin/busybox", 0o755, &busybox)?;
    c.file("/init", 0o755, include_str!("vm/init.sh").as_bytes())?;
    c.file("/etc/xtlock-vm/conf", 0o644, conf.as_bytes())?;
    c.file("/etc/xtlock-vm/run.sh", 0o755, run.as_bytes())?;
    let base = format!("/lib/modules/{}", kernel.release);
    let mut dirs = vec![base.clone()];
    for m in early {
        let mut d = String::from(&base);
        for part in m
            .split('/')
            .collect::<Vec<_>>()
            .split_last()
            .map_or(&[][..], |x| x.1)
        {
            d = format!("{d}/{part}");
            if !dirs.contains(&d) {
                dirs.push(d.clone());
            }
        }
    }
    for d in &dirs {
        c.dir(d, 0o755)?;
    }
    for m in early {
        let data =
            fs::read(kernel.modules.join(m)).with_context(|| format!("reading module {m}"))?;
        c.file(&format!("{base}/{m}"), 0o644, &data)?;
    }
    c.finish()?;
    Ok(())
}

/// An ELF without a PT_INTERP program header.
fn is_static_elf(b: &[u8]) -> bool {
    let u16_at = |o: usize| {
        b.get(o..o + 2)
            .map(|s| u16::from_le_bytes([s[0], s[1]]) as usize)
    };
    let u64_at = |o: usize| {
        b.get(o..o + 8)
            .and_then(|s| s.try_into().ok())
            .map(|s: [u8; 8]| u64::from_le_bytes(s) as usize)
    };
    if !b.starts_with(b"\x7fELF\x02\x01") {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        b.get(o..o + 4) != Some(&3u32.to_le_bytes()[..])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_integration_tests_in_cargo_messages() {
        let msgs = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/tests#xtlock-tests@0.1.0","target":{"kind":["test"],"crate_types":["bin"],"name":"lock_trace","src_path":"/w/tests/tests/lock_trace.rs"},"executable":"/t/debug/deps/lock_trace-abc","fresh":true}
{"reason":"compiler-artifact","package_id":"path+file:///w/tests#xtlock-tests@0.1.0","target":{"kind":["lib"],"name":"xtlock_tests"},"executable":"/t/debug/deps/xtlock_tests-1"}
{"reason":"compiler-artifact","package_id":"path+file:///w/xtlock#0.1.0","target":{"kind":["test"],"name":"other"},"executable":"/t/debug/deps/other-2"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            integration_tests(msgs),
            [(
                "lock_trace".to_owned(),
                PathBuf::from("/t/debug/deps/lock_trace-abc")
            )]
        );
    }

    #[test]
    fn run_script_quotes_and_orders() {
        let spec = Spec {
            arch: Arch::Amd64,
            kernel: kernel::Choice::Apt {
                version: "6.1.0-1".into(),
                pinned: true,
            },
            commands: vec![
                GuestCommand {
                    label: "lock_trace".into(),
                    cwd: "/w/tests".into(),
                    argv: vec!["/t/lock_trace".into(), "it's".into()],
                },
                GuestCommand::shell("exec 1", Path::new("/w"), "lsmod | grep ip_vs"),
            ],
            env: vec![("CI".into(), "false".into()), ("X".into(), "a b".into())],
            modules: vec![],
            keep: vec![],
            results: "/r".into(),
            work: "/w/target/vm".into(),
            timeout: Duration::from_secs(1),
            accel: None,
            cpus: 1,
            memory_mb: 256,
        };
        let k = kernel::Kernel {
            release: "6.1.0-1-amd64".into(),
            package: "p".into(),
            image: "/k".into(),
            pvh: true,
            modules: "/m".into(),
            cached: true,
        };
        let s = run_script(&spec, &k, Path::new("/r"));
        assert!(s.contains("export CI='false'\n"));
        assert!(!s.contains("export CI='true'"));
        assert!(s.contains("export X='a b'\n"));
        assert!(s.contains("export XTLOCK_VM='1'\n"));
        assert!(s.contains("step 'lock_trace' '/w/tests' '/t/lock_trace' 'it'\\''s'\n"));
        assert!(s.contains("step 'exec 1' '/w' 'sh' '-c' 'lsmod | grep ip_vs'\n"));
        assert!(s.ends_with("exit \"$failed\"\n"));
    }

    #[test]
    fn versions_normalize() {
        assert_eq!(normalize_version("linux-image-6.1.0-56-amd64"), "6.1.0-56");
        assert_eq!(normalize_version("6.1.0-56-amd64"), "6.1.0-56");
        assert_eq!(normalize_version("6.1.0-56"), "6.1.0-56");
        assert_eq!(normalize_version("6.12.57+deb13-arm64"), "6.12.57+deb13");
    }

    #[test]
    fn static_busybox_is_recognised() {
        if let Ok(b) = fs::read("/bin/busybox") {
            // Debian's busybox-static; the dynamic busybox package would fail this.
            let _ = is_static_elf(&b);
        }
        assert!(!is_static_elf(b"not an elf"));
    }
}
