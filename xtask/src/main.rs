//! `cargo xtask`: the project's own commands. `./xtask/run` is the entry point that also works
//! on a machine without cargo (it installs Debian's first).
//!
//! - `setup`: installs every prerequisite this machine lacks (apt packages, the `debian` rustup
//!   toolchain, bpf-linker against LLVM 22, tracefs); quick when all is there.
//! - `trace [ARGS...]`: setup, release build with the real BPF programs, exec `xtlock trace`.
//! - `test [ARGS...]`: setup, then build, test, clippy and fmt; extra args go to `cargo test`.
use std::{ffi::OsString, process::ExitCode};

use clap::{Parser, Subcommand};

mod setup;
mod sh;
mod test;
mod trace;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "xtlock's build, setup and test tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install every missing prerequisite (as root): apt packages, the `debian` toolchain,
    /// bpf-linker 0.13.0 for LLVM 22, tracefs.
    Setup,
    /// Setup, build xtlock in release mode with the BPF programs, and run `xtlock trace ARGS`.
    Trace {
        /// Passed to `xtlock trace`, e.g. `cargo xtask trace -- --json`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Setup, then build, test (with the BPF programs), clippy and rustfmt; all must pass.
    Test {
        /// Passed to `cargo test`, e.g. `cargo xtask test -- lock -- --nocapture`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sh::prepare_env();
    let result = match cli.cmd {
        Cmd::Setup => setup::run().map(|_| ()),
        Cmd::Trace { args } => trace::run(&args),
        Cmd::Test { args } => test::run(&args),
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
            Cmd::Trace { args } | Cmd::Test { args } => args,
            Cmd::Setup => Vec::new(),
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
    }
}
