//! The CPU architectures xtlock is built, shipped and tested for, and what differs between
//! them in the tasks: the Rust target, the names Debian and OCI give it, the cross linker
//! when it is not the host's, the kernel package and the QEMU that boots it.
use std::{fmt, process::Command, str::FromStr};

use anyhow::{bail, Context as _, Result};

use crate::sh;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Amd64, Arch::Arm64];

    /// The machine this runs on.
    pub fn host() -> Arch {
        match std::env::consts::ARCH {
            "aarch64" => Arch::Arm64,
            _ => Arch::Amd64,
        }
    }

    pub fn is_host(self) -> bool {
        self == Arch::host()
    }

    /// Debian's and OCI's name (`dpkg --print-architecture`, `GOARCH`).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }

    /// The Rust target built for it (glibc, linked statically where asked).
    pub fn triple(self) -> &'static str {
        match self {
            Arch::Amd64 => "x86_64-unknown-linux-gnu",
            Arch::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// The GNU toolchain prefix of Debian's cross compiler for it (`gcc-aarch64-linux-gnu`).
    pub fn gnu_prefix(self) -> &'static str {
        match self {
            Arch::Amd64 => "x86_64-linux-gnu",
            Arch::Arm64 => "aarch64-linux-gnu",
        }
    }

    /// `CARGO_TARGET_<TRIPLE>_<suffix>`.
    pub fn cargo_target_var(self, suffix: &str) -> String {
        format!(
            "CARGO_TARGET_{}_{suffix}",
            self.triple().to_uppercase().replace(['-', '.'], "_")
        )
    }

    /// The QEMU system emulator that boots it.
    pub fn qemu(self) -> &'static str {
        match self {
            Arch::Amd64 => "qemu-system-x86_64",
            Arch::Arm64 => "qemu-system-aarch64",
        }
    }

    /// Sets up `cmd` (a `cargo build` or `cargo test`) to build for this architecture: on
    /// another one than the host's, `--target`, Debian's cross gcc as linker and C compiler.
    /// `static_crt` links glibc statically (for the target only: build scripts and proc
    /// macros stay dynamic host programs). With neither, `cmd` is left as it is, so host
    /// builds share `target/debug` as before.
    pub fn cargo_args(self, cmd: &mut Command, static_crt: bool) {
        if self.is_host() && !static_crt {
            return;
        }
        cmd.arg("--target").arg(self.triple());
        if static_crt {
            cmd.env(
                self.cargo_target_var("RUSTFLAGS"),
                "-C target-feature=+crt-static",
            );
        }
        if !self.is_host() {
            let gcc = format!("{}-gcc", self.gnu_prefix());
            cmd.env(self.cargo_target_var("LINKER"), &gcc)
                .env(format!("CC_{}", self.triple().replace('-', "_")), &gcc)
                .env(
                    format!("AR_{}", self.triple().replace('-', "_")),
                    format!("{}-ar", self.gnu_prefix()),
                );
        }
    }

    /// What building for this architecture on this host lacks, as a sentence for the error.
    pub fn check_cross(self) -> Result<()> {
        if self.is_host() {
            return Ok(());
        }
        let gcc = format!("{}-gcc", self.gnu_prefix());
        if sh::which(&gcc).is_none() {
            bail!(
                "{gcc} is missing: run `./xtask/run setup` (gcc-{} and libc6-dev-{}-cross)",
                self.gnu_prefix(),
                self.name()
            );
        }
        let sysroot = sh::capture(sh::rustc().args(["--print", "sysroot"]))
            .context("rustc --print sysroot")?;
        let std = std::path::Path::new(sysroot.trim())
            .join("lib/rustlib")
            .join(self.triple())
            .join("lib");
        if !std.is_dir() {
            bail!(
                "the Rust standard library for {} is missing ({}): run `./xtask/run setup` \
                 (rustup target add {})",
                self.triple(),
                std.display(),
                self.triple()
            );
        }
        Ok(())
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Arch {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Arch> {
        match s.trim() {
            "amd64" | "x86_64" | "x86-64" => Ok(Arch::Amd64),
            "arm64" | "aarch64" => Ok(Arch::Arm64),
            other => bail!("architecture {other}: expected amd64 or arm64"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!("aarch64".parse::<Arch>().unwrap(), Arch::Arm64);
        assert_eq!(
            Arch::Arm64.cargo_target_var("LINKER"),
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER"
        );
        assert!("riscv64".parse::<Arch>().is_err());
    }
}
