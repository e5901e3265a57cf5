//! Running commands, finding tools, and the environment every task shares.
use std::{
    env,
    ffi::{OsStr, OsString},
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

/// The workspace root (this crate's parent folder).
pub fn workspace_root() -> PathBuf {
    let manifest = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` (relative to `root`), else `root/target`.
pub fn target_dir(root: &Path) -> PathBuf {
    env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_absolute() { t } else { root.join(t) })
        .unwrap_or_else(|| root.join("target"))
}

/// `$CARGO_HOME/bin` (default `~/.cargo/bin`): where `cargo install` puts bpf-linker.
pub fn cargo_bin_dir() -> PathBuf {
    if let Some(home) = env::var_os("CARGO_HOME") {
        return PathBuf::from(home).join("bin");
    }
    let home = env::var_os("HOME").unwrap_or_else(|| OsString::from("/root"));
    PathBuf::from(home).join(".cargo/bin")
}

/// Puts `~/.cargo/bin` on PATH (first) when it exists and is not there yet, so bpf-linker and
/// rustup are found by us, by `xtlock/build.rs` and by aya-build. PATH is left alone when it
/// already has it: `xtlock/build.rs` reruns whenever PATH changes.
pub fn prepare_env() {
    let bin = cargo_bin_dir();
    if !bin.is_dir() {
        return;
    }
    let path = env::var_os("PATH").unwrap_or_default();
    if env::split_paths(&path).any(|p| p == bin) {
        return;
    }
    let joined = env::join_paths(std::iter::once(bin).chain(env::split_paths(&path)));
    if let Ok(joined) = joined {
        // Single-threaded at this point; nothing else reads the environment concurrently.
        env::set_var("PATH", joined);
    }
}

/// The first executable `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether this process runs with effective uid 0.
pub fn is_root() -> bool {
    // /proc/self/status: "Uid:\treal\teffective\tsaved\tfs".
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// The cargo to run builds with. With rustup: the one running us (`$CARGO`), so the toolchain
/// stays the same. Without rustup: Debian's `/usr/bin/cargo`, whose rustc has the BPF libcore
/// (aya-build then builds the BPF crate with the current toolchain).
pub fn cargo() -> Command {
    if which("rustup").is_none() && is_executable(Path::new("/usr/bin/cargo")) {
        return Command::new("/usr/bin/cargo");
    }
    Command::new(env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo")))
}

/// The rustc that [`cargo`] builds with (for its sysroot).
pub fn rustc() -> Command {
    if which("rustup").is_none() && is_executable(Path::new("/usr/bin/rustc")) {
        return Command::new("/usr/bin/rustc");
    }
    Command::new(env::var_os("RUSTC").unwrap_or_else(|| OsString::from("rustc")))
}

/// A command line for display.
pub fn show(cmd: &Command) -> String {
    let mut parts = vec![cmd.get_program().to_string_lossy().into_owned()];
    parts.extend(cmd.get_args().map(quote));
    parts.join(" ")
}

fn quote(a: &OsStr) -> String {
    let s = a.to_string_lossy();
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:@+,".contains(c))
    {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` with inherited stdio; fails on a non-zero exit.
pub fn run(cmd: &mut Command) -> Result<()> {
    let line = show(cmd);
    println!("+ {line}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` quietly and returns its stdout when it exits 0.
pub fn capture(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
