//! `cargo xtask trace|record|daemon [ARGS...]`: a setup for using xtlock (the build
//! toolchain and tracefs, nothing the tests need), release build with the real BPF
//! programs, then `xtlock trace|record|daemon ARGS...` in place of this process.
//! `cargo xtask build`: the same setup and build, and where the binary is.
use std::{ffi::OsString, os::unix::process::CommandExt as _, path::PathBuf, process::Command};

use anyhow::{Context as _, Result};

use crate::{setup, sh};

/// Sets up for use, builds, and runs `xtlock SUBCOMMAND ARGS`.
pub fn run(subcommand: &str, args: &[OsString]) -> Result<()> {
    setup::run_use(subcommand)?;
    let bin = build_release()?;
    let mut cmd = Command::new(&bin);
    cmd.arg(subcommand).args(args);
    println!("+ {}", sh::show(&cmd));
    let err = cmd.exec();
    Err(err).with_context(|| format!("could not run {}", bin.display()))
}

/// Sets up for use and builds: the binary to copy or run.
pub fn build() -> Result<()> {
    setup::run_use("build")?;
    let bin = build_release()?;
    println!(
        "built {} (it needs the kernel's BTF and tracefs where it runs; for a binary \
         that runs on any node, `./xtask/run image --binary-only` makes a static one)",
        bin.display()
    );
    Ok(())
}

fn build_release() -> Result<PathBuf> {
    let root = sh::workspace_root();
    sh::run(
        sh::cargo()
            .current_dir(&root)
            .args(["build", "--release", "--package", "xtlock"])
            .env("XTLOCK_REQUIRE_EBPF", "1"),
    )?;
    Ok(sh::target_dir(&root).join("release/xtlock"))
}
