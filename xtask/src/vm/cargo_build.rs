//! The cargo builds a run needs, as `cargo xtask test` builds them (the same environment and
//! package selection, so nothing rebuilds): the binaries, for the host's architecture or
//! cross-built, and the integration tests' executables found in cargo's JSON messages.
use std::{
    env,
    io::Read as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::{arch::Arch, sh};

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

pub(super) fn build(root: &Path, target: &Path, arch: Arch, quiet: bool) -> Result<()> {
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
pub(super) fn test_binaries(
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
}
