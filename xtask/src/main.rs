//! `cargo xtask`: the project's own commands. `./xtask/run` is the entry point that also works
//! on a machine without cargo (it installs Debian's first).
//!
//! - `setup`: installs every prerequisite this machine lacks (apt packages, the `debian` rustup
//!   toolchain, bpf-linker against LLVM 22, tracefs); quick when all is there.
//! - `trace|record|daemon [ARGS...]`: setup for use (the build toolchain and tracefs only),
//!   release build with the real BPF programs, exec `xtlock trace|record|daemon`; `build`:
//!   the same setup and build.
//! - `test [--no-vm] [ARGS...]`: setup, then build, test, the tests again under each
//!   deployment's capabilities, vm-test and vm-arm64, deploy-test, deb, clippy and fmt (see
//!   `test.rs`); extra args go to `cargo test`.
//! - `vm-test [OPTIONS] [-- TEST ARGS]`: integration tests as root inside a QEMU VM that boots a
//!   stock Debian kernel (see `vm.rs`).
//! - `kernels-doc [--results DIR]`: rewrites the generated part of docs/kernels.md from the
//!   VM runs' `xtlock probes --json` (vm-test does it after running every kernel series).
//! - `image [--binary-only]`: the statically linked xtlock and a `scratch` image of it
//!   (`target/image/xtlock-VERSION.tar`, docker-archive), with no registry pull (`image.rs`).
//! - `deb [--test]`: the Debian package (`target/deb/xtlock_VERSION_ARCH.deb`): the static
//!   binary, its man page and completions, a hardened systemd unit; `--test` installs it into
//!   a clean Debian root (`deb.rs`).
//! - `deploy-test [--no-privileges] [--measure]`: the image run by a real container engine (podman) with exactly
//!   what `deploy/daemonset.yaml` grants, checked against a real lock contention and real
//!   drops; the manifest validated and linted; the alert rules tested (`deploy/`).
//! - `bench [--only ...]`: overhead, throughput and loss, side by side with bpftrace; prints
//!   tables and writes `target/bench/*.json` (see `bench/mod.rs` and `docs/performance.md`).
use std::{ffi::OsString, process::ExitCode};

use clap::{Parser, Subcommand};

mod arch;
mod bench;
mod deb;
mod deploy;
mod image;
mod kernels_doc;
mod setup;
mod sh;
mod test;
mod trace;
mod vm;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "xtlock's build, setup and test tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install every missing prerequisite of the tests (as root): apt packages, the `debian`
    /// toolchain, bpf-linker 0.13.0 for LLVM 22, tracefs; `--use` only what building and
    /// running xtlock needs.
    Setup {
        /// Only what building and running xtlock needs, as `trace` installs: no test tools.
        #[arg(long = "use")]
        for_use: bool,
        /// Print the Debian packages this setup would install (when missing), one a line,
        /// and install nothing.
        #[arg(long)]
        plan: bool,
    },
    /// Install only what building and running xtlock needs (the build toolchain, bpf-linker,
    /// tracefs: no test tools), build xtlock in release mode with the BPF programs, and run
    /// `xtlock trace ARGS`.
    Trace {
        /// Passed to `xtlock trace`, e.g. `cargo xtask trace -- --json`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// As `trace`, for `xtlock record ARGS` (a capture file to analyse later).
    Record {
        /// Passed to `xtlock record`, e.g. `cargo xtask record -- -o incident.xtlock`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// As `trace`, for `xtlock daemon ARGS` (metrics on :9655).
    Daemon {
        /// Passed to `xtlock daemon`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Install only what building xtlock needs and build it in release mode with the BPF
    /// programs (target/release/xtlock).
    Build,
    /// Setup, then build, test (with the BPF programs), the tests again under each deployment's
    /// capabilities, the VM tests (x86-64 and arm64), deploy-test, deb --test, clippy and
    /// rustfmt; all must pass.
    Test {
        /// Leave out the VM tests (`vm-test`), for a quicker local round.
        #[arg(long)]
        no_vm: bool,
        /// Passed to `cargo test`, e.g. `cargo xtask test -- lock -- --nocapture`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Setup, build, and run integration tests (default: the default suite, `DEFAULT_TESTS` and
    /// the rest in vm.rs, listed in docs/development.md) or commands as root in a QEMU VM
    /// booting a stock Debian kernel; `-- ARGS` go to each test binary.
    VmTest(Box<vm::VmArgs>),
    /// Rewrite the generated part of docs/kernels.md from the VM runs' results (per series:
    /// `xtlock probes --json`, the kernel, the tests skipped there).
    KernelsDoc {
        /// The VM results folder holding one folder per series (default:
        /// <target-dir>/vm/results).
        #[arg(long, value_name = "DIR")]
        results: Option<std::path::PathBuf>,
    },
    /// Build the statically linked xtlock and a `scratch` image of it as a docker-archive
    /// (target/image/xtlock-VERSION.tar), from the final stage of Containerfile, with no
    /// registry pull.
    Image(image::ImageArgs),
    /// Build the Debian package (target/deb/xtlock_VERSION_ARCH.deb): the static binary, the
    /// xtlock(8) page, bash/zsh/fish completions and a systemd unit for the daemon; --test
    /// installs it into a clean Debian root made by debootstrap and checks it (as root).
    Deb(deb::DebArgs),
    /// Run the image with a real container engine (podman) and exactly the privileges of deploy/daemonset.yaml
    /// against real lock contention and drops; validate and lint the manifest; test the
    /// alert rules (as root).
    DeployTest(deploy::DeployArgs),
    /// Overhead, throughput and loss of xtlock next to bpftrace (as root): prints tables and
    /// writes target/bench/*.json. Not a test.
    Bench(bench::BenchArgs),
}

fn setup_cmd(for_use: bool, plan: bool) -> anyhow::Result<()> {
    let purpose = if for_use {
        setup::Purpose::Use
    } else {
        setup::Purpose::Test
    };
    if plan {
        for p in setup::apt_plan(purpose) {
            println!("{p}");
        }
        return Ok(());
    }
    match purpose {
        setup::Purpose::Use => setup::run_use("setup --use"),
        setup::Purpose::Test => setup::run(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sh::prepare_env();
    let result = match cli.cmd {
        Cmd::Setup { for_use, plan } => setup_cmd(for_use, plan),
        Cmd::Trace { args } => trace::run("trace", &args),
        Cmd::Record { args } => trace::run("record", &args),
        Cmd::Daemon { args } => trace::run("daemon", &args),
        Cmd::Build => trace::build(),
        Cmd::Test { no_vm, args } => test::run(&args, no_vm),
        Cmd::VmTest(args) => vm::run(&args),
        Cmd::KernelsDoc { results } => vm::kernels_doc(results.as_deref()),
        Cmd::Bench(args) => bench::run(&args),
        Cmd::Image(args) => image::run(&args),
        Cmd::Deb(args) => deb::run(&args),
        Cmd::DeployTest(args) => deploy::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passed(argv: &[&str]) -> Vec<String> {
        let cli = Cli::try_parse_from(argv).expect("parses");
        let args = match cli.cmd {
            Cmd::Trace { args }
            | Cmd::Record { args }
            | Cmd::Daemon { args }
            | Cmd::Test { args, .. } => args,
            Cmd::Setup { .. }
            | Cmd::Build
            | Cmd::Bench(_)
            | Cmd::VmTest(_)
            | Cmd::KernelsDoc { .. }
            | Cmd::Image(_)
            | Cmd::Deb(_)
            | Cmd::DeployTest(_) => Vec::new(),
        };
        args.into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn args_after_the_subcommand_pass_through() {
        assert_eq!(passed(&["xtask", "trace", "--", "--json"]), ["--json"]);
        assert_eq!(
            passed(&["xtask", "trace", "--json", "--duration", "5s"]),
            ["--json", "--duration", "5s"]
        );
        assert_eq!(
            passed(&["xtask", "test", "--", "lock", "--", "--nocapture"]),
            ["lock", "--", "--nocapture"]
        );
        assert_eq!(passed(&["xtask", "test", "lock"]), ["lock"]);
        assert_eq!(passed(&["xtask", "test"]), Vec::<String>::new());
        assert_eq!(passed(&["xtask", "test", "--no-vm", "lock"]), ["lock"]);
    }

    #[test]
    fn vm_test_options_and_test_args() {
        let cli = Cli::try_parse_from([
            "xtask",
            "vm-test",
            "--kernel-version",
            "6.1.0-56",
            "--modules",
            "ip_vs,ip_vs_rr",
            "--exec",
            "lsmod",
            "--",
            "calico",
            "--nocapture",
        ])
        .expect("parses");
        let Cmd::VmTest(a) = cli.cmd else {
            panic!("not vm-test")
        };
        assert_eq!(a.kernel_version.as_deref(), Some("6.1.0-56"));
        assert_eq!(
            a.modules,
            Some(vec!["ip_vs".to_owned(), "ip_vs_rr".to_owned()])
        );
        assert_eq!(a.exec, ["lsmod"]);
        assert_eq!(a.test_args, ["calico", "--nocapture"]);
        assert_eq!(a.timeout, 600);
        let Cmd::Test { no_vm, .. } = Cli::try_parse_from(["xtask", "test", "--no-vm"])
            .expect("parses")
            .cmd
        else {
            panic!("not test")
        };
        assert!(no_vm);
    }

    #[test]
    fn vm_test_kernel_series() {
        let cli = Cli::try_parse_from(["xtask", "vm-test", "--kernel", "5.10,6.12", "--jobs", "2"])
            .expect("parses");
        let Cmd::VmTest(a) = cli.cmd else {
            panic!("not vm-test")
        };
        assert_eq!(a.kernels, ["5.10", "6.12"]);
        assert_eq!(a.jobs, 2);
        // A series and an exact version contradict each other; the matrix is its own plan.
        assert!(Cli::try_parse_from([
            "xtask",
            "vm-test",
            "--kernel",
            "6.1",
            "--kernel-version",
            "6.1.0-56"
        ])
        .is_err());
        assert!(Cli::try_parse_from(["xtask", "vm-test", "--matrix", "--test", "ipvs"]).is_err());
    }

    /// Every `./xtask/run ...` and `cargo xtask ...` line of the docs' code blocks parses with
    /// this command line (`./xtask/run X -- ARGS` passes ARGS to xtlock: only X and what comes
    /// before `--` are xtask's).
    #[test]
    fn every_documented_task_line_parses() {
        let root = sh::workspace_root();
        let mut files = vec![root.join("README.md"), root.join("deploy/README.md")];
        let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        docs.retain(|p: &std::path::PathBuf| p.extension().is_some_and(|e| e == "md"));
        files.extend(docs);
        let (mut found, mut bad) = (0, Vec::new());
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            let mut in_code = false;
            for (n, line) in text.lines().enumerate() {
                if line.trim_start().starts_with("```") {
                    in_code = !in_code;
                    continue;
                }
                let l = line
                    .trim()
                    .trim_start_matches("$ ")
                    .trim_start_matches("sudo ");
                let rest = ["./xtask/run ", "cargo xtask "]
                    .iter()
                    .find_map(|p| l.strip_prefix(p));
                let (true, Some(rest)) = (in_code, rest) else {
                    continue;
                };
                let cut = rest
                    .find(['|', '>', '<', '#', '&', ';'])
                    .unwrap_or(rest.len());
                let mut words: Vec<String> = rest[..cut]
                    .split_whitespace()
                    .take_while(|w| *w != "--")
                    .filter(|w| *w != "...")
                    .map(str::to_string)
                    .collect();
                words.insert(0, "xtask".into());
                found += 1;
                if let Err(e) = Cli::try_parse_from(&words) {
                    use clap::error::ErrorKind;
                    if !matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                        bad.push(format!(
                            "{}:{}: {}: {}",
                            f.display(),
                            n + 1,
                            words.join(" "),
                            e.kind()
                        ));
                    }
                }
            }
        }
        assert!(found >= 5, "found only {found} task lines");
        assert!(
            bad.is_empty(),
            "task lines that do not parse:\n{}",
            bad.join("\n")
        );
    }

    /// docs/development.md lists the default VM suites once, as `vm.rs` has them.
    #[test]
    fn the_documented_vm_suites_are_the_codes() {
        let doc = std::fs::read_to_string(sh::workspace_root().join("docs/development.md"))
            .expect("docs/development.md");
        let section = doc
            .split("### The default VM suites")
            .nth(1)
            .and_then(|s| s.split("\n#").next())
            .expect("docs/development.md has a section on the default VM suites");
        let listed = |name: &str| -> Vec<String> {
            let item = section
                .split("\n- ")
                .find(|i| i.starts_with(&format!("`{name}`")))
                .unwrap_or_else(|| panic!("no `{name}` item"));
            let item = item.split(';').next().unwrap_or(item);
            item.split('`')
                .skip(3)
                .step_by(2)
                .map(str::to_string)
                .collect()
        };
        let tests: Vec<String> = vm::DEFAULT_TESTS.iter().map(|s| s.to_string()).collect();
        assert_eq!(listed("DEFAULT_TESTS"), tests, "{section}");
        let filtered: Vec<String> = vm::DEFAULT_FILTERED
            .iter()
            .map(|(t, _)| t.to_string())
            .collect();
        assert_eq!(listed("DEFAULT_FILTERED")[..1], filtered[..], "{section}");
    }
}
