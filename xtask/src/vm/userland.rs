//! The root file system of a guest of another architecture than the host's (an arm64 guest
//! on this x86-64 machine): the x86-64 guest shares the host's root, whose programs an arm64
//! CPU cannot run. This one is Debian 12's own packages for that architecture, unpacked by
//! `mmdebstrap --variant=extract` (dependencies resolved by apt with a configuration of its
//! own, nothing of the packages run, the host's apt state untouched) into the VM cache once,
//! then shared read-only over 9p under the same throwaway overlay as the host's root. The
//! workspace and target folder are bound into it at their host paths by `/init`.
//!
//! Maintainer scripts do not run, so what they would do and the tests need is done here:
//! the `update-alternatives` links (`iptables` -> the nft variant, Debian 12's default).
use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};
use sha2::{Digest as _, Sha256};

use crate::{arch::Arch, sh};

/// What the tests the VM runs call (the same programs the host's root gives an x86-64
/// guest), and a static busybox for the initramfs (`insmod`, `mount` before the root is
/// there). Their dependencies come along.
pub const PACKAGES: &[&str] = &[
    "dash",
    "bash",
    "coreutils",
    "util-linux",
    "mount",
    "findutils",
    "grep",
    "sed",
    "diffutils",
    "procps",
    "kmod",
    "libc-bin",
    "iproute2",
    "iptables",
    "nftables",
    "conntrack",
    "ipvsadm",
    // The tests list the loaded BPF programs with it.
    "bpftool",
    "busybox-static",
];

const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";

/// `update-alternatives` links iptables' postinst would make: (link, target).
const ALTERNATIVES: &[(&str, &str)] = &[
    ("usr/sbin/iptables", "xtables-nft-multi"),
    ("usr/sbin/iptables-save", "xtables-nft-multi"),
    ("usr/sbin/iptables-restore", "xtables-nft-multi"),
    ("usr/sbin/ip6tables", "xtables-nft-multi"),
    ("usr/sbin/ip6tables-save", "xtables-nft-multi"),
    ("usr/sbin/ip6tables-restore", "xtables-nft-multi"),
];

/// The unpacked root for `arch` in `cache`, made now if it is missing (a few seconds to a
/// minute, depending on the mirror; ~190 MB). Its folder is named by a hash of the package
/// list, so a changed list makes a new one.
pub fn prepare(cache: &Path, arch: Arch) -> Result<PathBuf> {
    let mut h = Sha256::new();
    h.update(format!(
        "{SUITE} {MIRROR} {arch} {PACKAGES:?} {ALTERNATIVES:?}"
    ));
    let key: String = h.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let base = cache.join("userland");
    let dir = base.join(format!("{SUITE}-{arch}-{key}"));
    if dir.join(".complete").exists() {
        return Ok(dir);
    }
    if sh::which("mmdebstrap").is_none() {
        bail!(
            "mmdebstrap is missing: run `./xtask/run setup` (it unpacks the {arch} guest's root)"
        );
    }
    fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let tmp = base.join(format!(".new-{arch}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    println!(
        "vm: unpacking Debian {SUITE}'s {arch} packages for the guest's root into {} (mmdebstrap)",
        dir.display()
    );
    let made = sh::run(
        Command::new("mmdebstrap")
            .args(["--quiet", "--variant=extract"])
            .arg(format!("--arch={arch}"))
            .arg(format!("--include={}", PACKAGES.join(",")))
            .arg(SUITE)
            .arg(&tmp)
            .arg(format!("deb {MIRROR} {SUITE} main")),
    )
    .and_then(|()| finish(&tmp));
    if let Err(e) = made {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.context(format!("making the {arch} guest's root")));
    }
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&tmp, &dir).with_context(|| format!("renaming to {}", dir.display()))?;
    Ok(dir)
}

/// What maintainer scripts would have done, and the mount points `/init` uses.
fn finish(root: &Path) -> Result<()> {
    for (link, target) in ALTERNATIVES {
        let p = root.join(link);
        if !p.exists() && root.join("usr/sbin").join(target).exists() {
            symlink(target, &p).with_context(|| format!("linking {}", p.display()))?;
        }
    }
    for d in ["proc", "sys", "dev", "tmp", "run", "var/tmp", "root"] {
        let _ = fs::create_dir_all(root.join(d));
    }
    for f in ["bin/sh", "bin/busybox", "usr/sbin/iptables-legacy"] {
        if fs::symlink_metadata(root.join(f)).is_err() {
            bail!("the unpacked root has no /{f}");
        }
    }
    fs::write(root.join(".complete"), "")?;
    Ok(())
}
