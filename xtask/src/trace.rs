//! `cargo xtask trace [ARGS...]`: setup, release build with the real BPF programs, then
//! `xtlock trace ARGS...` in place of this process.
use std::{
    env, ffi::OsString, os::unix::process::CommandExt as _, path::PathBuf, process::Command,
};

use anyhow::{Context as _, Result};

use crate::{setup, sh};

pub fn run(args: &[OsString]) -> Result<()> {
    setup::run()?;
    let root = sh::workspace_root();
    sh::run(
        sh::cargo()
            .current_dir(&root)
            .args(["build", "--release", "--package", "xtlock"])
            .env("XTLOCK_REQUIRE_EBPF", "1"),
    )?;
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_absolute() { t } else { root.join(t) })
        .unwrap_or_else(|| root.join("target"));
    let bin = target.join("release/xtlock");
    let mut cmd = Command::new(&bin);
    cmd.arg("trace").args(args);
    println!("+ {}", sh::show(&cmd));
    let err = cmd.exec();
    Err(err).with_context(|| format!("could not run {}", bin.display()))
}
