//! What a run is asked and what it reports: `cargo xtask vm-test`'s arguments ([`VmArgs`]),
//! one VM's [`Spec`] made from them (its kernel, commands, environment, modules), and the
//! [`Report`] of how it went, with its verdict.
use std::{
    env,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use clap::Args;

use super::{kernel, qemu, qemu::Accel, DEFAULT_MODULES};
use crate::arch::Arch;

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

/// The kernel of a run without `--kernel`: `--kernel-deb`, `--kernel-version`,
/// `XTLOCK_VM_KERNEL`, else the pin.
pub(super) fn single_kernel(args: &VmArgs) -> kernel::Choice {
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
pub(super) fn spec(
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

/// Ok when every guest command passed.
pub(super) fn verdict(report: &Report, spec: &Spec) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_normalize() {
        assert_eq!(normalize_version("linux-image-6.1.0-56-amd64"), "6.1.0-56");
        assert_eq!(normalize_version("6.1.0-56-amd64"), "6.1.0-56");
        assert_eq!(normalize_version("6.1.0-56"), "6.1.0-56");
        assert_eq!(normalize_version("6.12.57+deb13-arm64"), "6.12.57+deb13");
    }
}
