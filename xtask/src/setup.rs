//! `cargo xtask setup`: installs every prerequisite this machine lacks, one line per step.
//! Idempotent, and a second or so when everything is there (nothing is fetched then).
use std::{collections::HashSet, env, fs, path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::sh;

/// Debian 12 packages that building xtlock with its BPF programs needs (all the
/// Containerfile's build stage installs).
const APT_BUILD_PACKAGES: &[&str] = &[
    // Debian's Rust (1.96) with a prebuilt libcore for bpfel-unknown-none: the `debian` toolchain.
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    // LLVM 22, which bpf-linker links against.
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    // `cargo xtask image` strips the static binary.
    "binutils",
];
/// Debian 12 packages the rest needs.
const APT_PACKAGES: &[&str] = &[
    // What the tests drive and look at.
    "iptables",
    // `tables.rs` makes the sets a `-m set` rule names (and reads their names back).
    "ipset",
    "iproute2",
    "conntrack",
    "bpftool",
    "bpftrace",
    "procps",
    "util-linux",
    "strace",
    // `tests/tests/daemon.rs`: a real Prometheus (and promtool) scrapes the daemon.
    "prometheus",
    // `tests/tests/html_report.rs`: `report --html`'s page, rendered by a real browser
    // (headless).
    "chromium",
];
/// `cargo xtask deploy-test`: a real container engine, podman with runc (daemonless: each
/// command runs in the test node's network namespace, nothing to start or stop), without
/// recommendations. Debian 12's dockerd (20.10) would refuse `--cap-add CAP_BPF`, which a
/// DaemonSet variant without SYS_ADMIN grants.
const APT_DEPLOY_PACKAGES: &[&str] = &["podman", "runc"];
/// PyPI tools of `deploy-test`, in a venv of their own: the Kubernetes schema validator and
/// the policy linter. Pinned, so a new release cannot change the findings under CI.
const PIP_DEPLOY_TOOLS: &[(&str, &str)] =
    &[("kubernetes-validate", "1.37.0"), ("checkov", "3.3.30")];
/// `cargo xtask vm-test`: QEMU, the guest's busybox, and xz to unpack the guest kernel's
/// image. Installed without their recommendations (qemu-system-x86's would bring a GUI).
/// nftables: `nft`, run by the nf_tables commit tests (on the host and, through its root, in the VM).
/// ipvsadm: the IPVS tests build kube-proxy-style virtual services with it, in the VM (the
/// guest runs the host's binaries), where the kernel has IPVS.
///
/// For the arm64 VM: qemu-system-arm (qemu-system-aarch64, the `virt` machine and its UEFI-less
/// direct kernel boot) and mmdebstrap, which unpacks the arm64 guest's userland from Debian's
/// packages without running any of it (`vm::userland`).
const APT_VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "qemu-system-arm",
    "mmdebstrap",
    "busybox-static",
    "xz-utils",
    "nftables",
    "ipvsadm",
];
/// `tests/tests/real_agents.rs`: a real dockerd (with its containerd and runc) and a real
/// firewalld (with a private system bus: dbus-daemon), in private namespaces (util-linux's
/// `unshare` and `nsenter`). Installing them would start
/// them on the host, where firewalld takes over the firewall and dockerd adds its chains:
/// they are installed with service starts denied and their units disabled when setup
/// installed them (see [`apt_daemon_packages`]). Package, the program the tests run (when
/// it is there already, from another package such as docker-ce, nothing is installed: apt
/// would replace that package), the units to keep stopped.
const APT_DAEMON_PACKAGES: &[(&str, &str, &[&str])] = &[
    ("docker.io", "dockerd", &["docker.service", "docker.socket"]),
    ("firewalld", "firewalld", &["firewalld.service"]),
    ("dbus-daemon", "dbus-daemon", &[]),
];
/// `cargo xtask deb --test`: debootstrap makes the clean Debian root the package is installed
/// into, systemd-analyze verifies its unit; man-db renders the page (`man -l`, also in the
/// tests of `xtlock man`).
const APT_DEB_PACKAGES: &[&str] = &["debootstrap", "systemd", "man-db"];
/// `cargo xtask image --arch arm64` and the arm64 VM's test binaries: Debian's cross gcc (the
/// linker; no foreign dpkg architecture needed) and glibc for aarch64 to link statically.
const APT_CROSS_PACKAGES: &[&str] = &[
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "binutils-aarch64-linux-gnu",
];
/// The Rust standard library of the cross targets, from rustup.
const CROSS_TARGETS: &[&str] = &["aarch64-unknown-linux-gnu"];
/// Without rustup, Debian's cargo runs everything, clippy and rustfmt included.
const APT_WITHOUT_RUSTUP: &[&str] = &["rust-web-clippy", "rustfmt-web"];

const TOOLCHAIN: &str = "debian";
const BPF_TARGET: &str = "bpfel-unknown-none";
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_BIN: &str = "/usr/lib/llvm-22/bin";
const TRACEFS: &str = "/sys/kernel/tracing";

const BY_HAND: &str = "\
xtask setup only knows Debian 12 (apt). Install these by hand:
  - Rust (cargo, rustc >= 1.85, clippy, rustfmt)
  - a rustc whose sysroot has libcore for bpfel-unknown-none, as the rustup toolchain `debian`
    (on Debian 12: rustc-web cargo-web libstd-rust-web-dev-bpf, then `rustup toolchain link debian /usr`)
  - LLVM 22 development files (llvm-config, libLLVM, Polly) and the zlib and zstd -dev files
  - bpf-linker 0.13.0 built against LLVM 22, with LLVM 22's llvm-config first on PATH:
      cargo install bpf-linker@0.13.0 --locked --no-default-features --features llvm-22
  - iptables (with iptables-legacy), iproute2, conntrack, bpftool, bpftrace, procps,
    util-linux (flock), strace (optional)
  - docker.io, firewalld and dbus-daemon, kept from starting on the host (the tests run them
    in private namespaces)
  - tracefs mounted: mount -t tracefs tracefs /sys/kernel/tracing
  - for `cargo xtask vm-test`: qemu-system-x86_64, a static busybox, xz, nftables, ipvsadm;
    for --arch arm64 also qemu-system-aarch64 and mmdebstrap
  - for arm64 builds: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and
    `rustup target add aarch64-unknown-linux-gnu`
  - for `cargo xtask deb --test`: debootstrap, systemd (systemd-analyze) and man-db
  - for `cargo xtask deploy-test`: podman and runc, and from PyPI kubernetes-validate
    and checkov in ~/.cache/xtlock/deploy-tools (a venv)
and a kernel with BTF (5.8 or newer).";

/// What a setup is for: using xtlock (trace, record, daemon, build, image, deb) needs only
/// the build toolchain and tracefs; testing it needs the tools the tests drive as well.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Build and run xtlock on the node it traces: never a daemon, a firewall manager, an
    /// emulator or a test tool.
    Use,
    /// Everything `./xtask/run test` and the test drivers need.
    Test,
}

/// The apt packages a setup for `purpose` installs (when missing), in the order it
/// installs them. `Use` is exactly [`APT_BUILD_PACKAGES`]: `deb --test` checks in a clean
/// Debian root that apt resolves it to no daemon, emulator or test tool.
pub fn apt_plan(purpose: Purpose) -> Vec<&'static str> {
    match purpose {
        Purpose::Use => APT_BUILD_PACKAGES.to_vec(),
        Purpose::Test => {
            let mut v: Vec<&str> = [
                APT_BUILD_PACKAGES,
                APT_PACKAGES,
                APT_WITHOUT_RUSTUP,
                APT_VM_PACKAGES,
                APT_DEPLOY_PACKAGES,
                APT_DEB_PACKAGES,
                APT_CROSS_PACKAGES,
            ]
            .concat();
            v.extend(APT_DAEMON_PACKAGES.iter().map(|(p, _, _)| *p));
            v
        }
    }
}

/// Packages that have no place on a node being debugged: a setup for [`Purpose::Use`] that
/// would install one of them (itself or as a dependency) is a bug. Names, or prefixes
/// ending in `*`.
pub const NEVER_FOR_USE: &[&str] = &[
    "docker.io",
    "containerd",
    "runc",
    "podman",
    "firewalld",
    "dbus-daemon",
    "qemu*",
    "mmdebstrap",
    "debootstrap",
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "binutils-aarch64-linux-gnu",
    "prometheus",
    "bpftrace",
    "chromium",
    "gdb",
    "man-db",
    "python3-venv",
];

/// Whether `package` is one of [`NEVER_FOR_USE`].
pub fn never_for_use(package: &str) -> bool {
    let name = package.split(':').next().unwrap_or(package);
    NEVER_FOR_USE.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == *p,
    })
}

/// Runs every step of a setup for testing; fails on the first one that cannot be done.
pub fn run() -> Result<()> {
    if !sh::is_root() {
        bail!(
            "setup installs packages and mounts tracefs, and xtlock loads BPF programs: \
             run it as root (sudo ./xtask/run ...)"
        );
    }
    check_debian()?;
    let rustup = sh::which("rustup").is_some();
    apt_packages(rustup)?;
    // bpf-linker's build (minutes of CPU on a new machine) beside the other installs, which
    // wait on the network and the disk. Only subprocesses run in the thread: the
    // environment is changed (PATH) on this one, after it.
    let linker = std::thread::spawn(move || -> Result<Option<String>> {
        toolchain(rustup)?;
        bpf_linker_build(true)
    });
    let others = (|| -> Result<()> {
        apt_vm_packages()?;
        apt_install(
            "apt packages for deploy-test",
            APT_DEPLOY_PACKAGES,
            &["--no-install-recommends"],
        )?;
        pip_tools()?;
        deb_packages()?;
        apt_daemon_packages()
    })();
    let built = linker
        .join()
        .map_err(|_| anyhow::anyhow!("the bpf-linker install panicked"))?;
    others?;
    bpf_linker_check(built?)?;
    clippy_fmt(rustup)?;
    cross()?;
    tracefs()?;
    kernel();
    Ok(())
}

/// What building xtlock and running it on this machine need, and nothing to test it: the
/// build toolchain, bpf-linker, tracefs. Says what it will install before it does.
pub fn run_use(what: &str) -> Result<()> {
    build_steps(what)?;
    tracefs()?;
    kernel();
    Ok(())
}

/// What building xtlock with its BPF programs needs, and nothing to run or test it: the
/// Containerfile's build stage (a container, where tracefs cannot be mounted) runs this.
pub fn run_build() -> Result<()> {
    build_steps("build")
}

fn build_steps(what: &str) -> Result<()> {
    if !sh::is_root() {
        bail!("setup installs packages: run it as root (sudo ./xtask/run ...)");
    }
    check_debian()?;
    let rustup = sh::which("rustup").is_some();
    let missing = missing_packages(APT_BUILD_PACKAGES)?;
    let linker = bpf_linker_version().as_deref() != Some(BPF_LINKER_VERSION);
    if !missing.is_empty() || linker {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!("Debian packages {}", missing.join(" ")));
        }
        if linker {
            parts.push(format!(
                "bpf-linker {BPF_LINKER_VERSION} (built by cargo install, a few minutes)"
            ));
        }
        println!(
            "setup for `{what}` installs only what building xtlock needs: {}. \
             Nothing else: no daemon, firewall manager, emulator or test tool \
             (`./xtask/run test` installs those).",
            parts.join("; ")
        );
    }
    // Without recommendations: they bring clang, fonts and X11 libraries a build never uses.
    apt_install(
        "apt packages to build xtlock",
        APT_BUILD_PACKAGES,
        &["--no-install-recommends"],
    )?;
    toolchain(rustup)?;
    bpf_linker()?;
    Ok(())
}

/// What building for arm64 on this machine needs: Debian's cross gcc and glibc, and the Rust
/// standard library for aarch64 (`rustup target add`; Debian 12 has no cross package of
/// it: without rustup it would take `dpkg --add-architecture arm64` and
/// `libstd-rust-web-dev:arm64`, which setup does not do to a machine).
pub fn cross() -> Result<()> {
    apt_install(
        "apt packages to cross-build for arm64",
        APT_CROSS_PACKAGES,
        &["--no-install-recommends"],
    )?;
    let sysroot =
        sh::capture(sh::rustc().args(["--print", "sysroot"])).context("rustc --print sysroot")?;
    let missing: Vec<&str> = CROSS_TARGETS
        .iter()
        .copied()
        .filter(|t| {
            !Path::new(sysroot.trim())
                .join("lib/rustlib")
                .join(t)
                .join("lib")
                .is_dir()
        })
        .collect();
    if missing.is_empty() {
        println!(
            "ok: Rust standard library for {} ({})",
            CROSS_TARGETS.join(" "),
            sysroot.trim()
        );
        return Ok(());
    }
    if sh::which("rustup").is_none() {
        bail!(
            "no Rust standard library for {} in {}, and no rustup to add it: install rustup \
             (or, by hand, `dpkg --add-architecture arm64` and libstd-rust-web-dev:arm64)",
            missing.join(" "),
            sysroot.trim()
        );
    }
    println!("installing: rustup target add {}", missing.join(" "));
    sh::run(
        Command::new("rustup")
            .args(["target", "add"])
            .args(&missing),
    )
    .context("rustup target add (needs the network)")?;
    println!("ok: Rust standard library for {}", missing.join(" "));
    Ok(())
}

/// What `cargo xtask deb --test` needs besides the build.
pub fn deb_packages() -> Result<()> {
    apt_install(
        "apt packages for the package test",
        APT_DEB_PACKAGES,
        &["--no-install-recommends"],
    )
}

/// The venv of the PyPI tools `deploy-test` runs (`~/.cache/xtlock/deploy-tools`).
pub fn deploy_tools_dir() -> std::path::PathBuf {
    let home = env::var_os("HOME").unwrap_or_else(|| "/root".into());
    Path::new(&home).join(".cache/xtlock/deploy-tools")
}

fn pip_tools() -> Result<()> {
    let venv = deploy_tools_dir();
    let pip = venv.join("bin/pip");
    let installed = |name: &str, version: &str| {
        sh::capture(Command::new(&pip).args(["show", name])).is_some_and(|out| {
            out.lines()
                .any(|l| l.trim() == format!("Version: {version}"))
        })
    };
    let wanted: Vec<String> = PIP_DEPLOY_TOOLS
        .iter()
        .map(|(n, v)| format!("{n}=={v}"))
        .collect();
    if PIP_DEPLOY_TOOLS.iter().all(|(n, v)| installed(n, v)) {
        println!("ok: pip tools for deploy-test: {}", wanted.join(" "));
        return Ok(());
    }
    println!(
        "installing: pip tools for deploy-test into {}: {} (a minute)",
        venv.display(),
        wanted.join(" ")
    );
    let python = sh::which("python3").context("no python3 on PATH")?;
    if !venv.join("bin/python").exists() {
        let made = Command::new(&python)
            .arg("-m")
            .arg("venv")
            .arg(&venv)
            .status()
            .is_ok_and(|s| s.success());
        if !made {
            // Debian's python3 makes venvs only with python3-venv.
            apt_install("python3-venv", &["python3-venv"], &[])?;
            sh::run(Command::new(&python).arg("-m").arg("venv").arg(&venv))?;
        }
    }
    sh::run(
        Command::new(&pip)
            .args(["install", "-q", "--disable-pip-version-check"])
            .args(&wanted),
    )?;
    println!("ok: pip tools for deploy-test: {}", wanted.join(" "));
    Ok(())
}

fn check_debian() -> Result<()> {
    if !Path::new("/etc/debian_version").exists()
        || sh::which("apt-get").is_none()
        || sh::which("dpkg-query").is_none()
    {
        bail!("{BY_HAND}");
    }
    let os_release = fs::read_to_string("/etc/os-release").unwrap_or_default();
    let codename = os_release
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim_matches('"'))
        .unwrap_or("unknown");
    if codename != "bookworm" {
        println!(
            "warning: this is Debian `{codename}`; setup is made for Debian 12 (bookworm), \
             which packages rustc-web 1.96 and LLVM 22. Trying anyway."
        );
    }
    Ok(())
}

fn apt_packages(rustup: bool) -> Result<()> {
    let mut wanted: Vec<&str> = [APT_BUILD_PACKAGES, APT_PACKAGES].concat();
    if !rustup {
        wanted.extend(APT_WITHOUT_RUSTUP);
    }
    apt_install("apt packages", &wanted, &[])
}

fn apt_vm_packages() -> Result<()> {
    apt_install(
        "apt packages for vm-test",
        APT_VM_PACKAGES,
        &["--no-install-recommends"],
    )
}

/// The daemons the real-agent tests run, installed so that the host's services stay as
/// they were: a `policy-rc.d` that denies starts during the install (unless one exists:
/// then it rules), and afterwards, under systemd, the units of what was installed now
/// disabled, so they do not start at the next boot either. Already installed packages are
/// left alone.
fn apt_daemon_packages() -> Result<()> {
    let names: Vec<&str> = APT_DAEMON_PACKAGES
        .iter()
        .filter(|(_, program, _)| sh::which(program).is_none())
        .map(|(p, _, _)| *p)
        .collect();
    let missing = missing_packages(&names)?;
    if missing.is_empty() {
        let programs: Vec<&str> = APT_DAEMON_PACKAGES.iter().map(|(_, p, _)| *p).collect();
        println!(
            "ok: programs for the real-agent tests: {} (all installed)",
            programs.join(" ")
        );
        return Ok(());
    }
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        use std::os::unix::fs::PermissionsExt;
        fs::write(
            policy,
            "#!/bin/sh\n# xtask setup: no service starts while installing\nexit 101\n",
        )
        .context("writing /usr/sbin/policy-rc.d")?;
        fs::set_permissions(policy, fs::Permissions::from_mode(0o755))?;
    }
    let installed = apt_install("apt packages for the real-agent tests", &names, &[]);
    if ours {
        let _ = fs::remove_file(policy);
    }
    installed?;
    if Path::new("/run/systemd/system").is_dir() {
        let units: Vec<&str> = APT_DAEMON_PACKAGES
            .iter()
            .filter(|(p, _, _)| missing.iter().any(|m| m == p))
            .flat_map(|(_, _, u)| u.iter().copied())
            .collect();
        if !units.is_empty() {
            // Best effort: a unit the package did not ship is no reason to fail.
            let _ = Command::new("systemctl")
                .args(["disable", "--now", "--quiet"])
                .args(&units)
                .status();
            println!(
                "ok: {} disabled: the tests run these daemons in private namespaces, never on the host",
                units.join(" ")
            );
        }
    }
    Ok(())
}

/// Installs the packages of `wanted` that are missing (apt-get update first).
fn apt_install(what: &str, wanted: &[&str], options: &[&str]) -> Result<()> {
    let missing = missing_packages(wanted)?;
    if missing.is_empty() {
        println!("ok: {what}: {} (all installed)", wanted.join(" "));
        return Ok(());
    }
    println!("installing: {what}: {}", missing.join(" "));
    let apt = |args: &[&str]| {
        let mut c = Command::new("apt-get");
        c.env("DEBIAN_FRONTEND", "noninteractive")
            .args(["-q", "-o", "DPkg::Lock::Timeout=600"])
            .args(args);
        c
    };
    sh::run(&mut apt(&["update"]))?;
    let mut install = apt(&["install", "-y"]);
    install.args(options).args(&missing);
    sh::run(&mut install)?;
    let still = missing_packages(wanted)?;
    if !still.is_empty() {
        bail!("apt-get did not install: {}", still.join(" "));
    }
    println!("ok: {what}: {} (installed now)", missing.join(" "));
    Ok(())
}

/// The packages of `wanted` that dpkg does not report as installed.
fn missing_packages(wanted: &[&str]) -> Result<Vec<String>> {
    // Exits 1 when a package is unknown to dpkg; what it prints is still right.
    let out = Command::new("dpkg-query")
        .arg("-W")
        .arg("-f=${Package}\t${Status}\n")
        .args(wanted)
        .stderr(std::process::Stdio::null())
        .output()
        .context("running dpkg-query")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let installed: HashSet<&str> = stdout
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .filter(|(_, status)| status.ends_with(" ok installed"))
        .map(|(pkg, _)| pkg.split(':').next().unwrap_or(pkg))
        .collect();
    Ok(wanted
        .iter()
        .filter(|p| !installed.contains(**p))
        .map(|p| p.to_string())
        .collect())
}

/// The compiler that builds the BPF crate: the rustup toolchain `debian` linked to /usr, or,
/// without rustup, /usr itself.
fn toolchain(rustup: bool) -> Result<()> {
    let core = Path::new("/usr/lib/rustlib").join(BPF_TARGET).join("lib");
    if !core.is_dir() {
        bail!(
            "{} is missing although libstd-rust-web-dev-bpf is installed",
            core.display()
        );
    }
    if !rustup {
        let version = sh::capture(Command::new("/usr/bin/rustc").arg("--version"))
            .context("/usr/bin/rustc --version failed")?;
        println!(
            "ok: no rustup: Debian's /usr/bin/cargo and {} build everything, \
             with libcore for {BPF_TARGET}",
            short(&version)
        );
        return Ok(());
    }
    let listed = sh::capture(Command::new("rustup").args(["toolchain", "list"]))
        .context("`rustup toolchain list` failed")?;
    let linked = listed
        .lines()
        .any(|l| l.split_whitespace().next() == Some(TOOLCHAIN));
    if !linked {
        println!("installing: rustup toolchain {TOOLCHAIN} -> /usr");
        sh::run(Command::new("rustup").args(["toolchain", "link", TOOLCHAIN, "/usr"]))?;
    }
    let run = |args: &[&str]| {
        sh::capture(Command::new("rustup").args(["run", TOOLCHAIN]).args(args))
            .map(|s| s.trim().to_owned())
    };
    let sysroot = run(&["rustc", "--print", "sysroot"])
        .with_context(|| format!("`rustup run {TOOLCHAIN} rustc` does not work"))?;
    let has_core = Path::new(&sysroot)
        .join("lib/rustlib")
        .join(BPF_TARGET)
        .join("lib")
        .is_dir();
    if !has_core {
        bail!(
            "rustup toolchain `{TOOLCHAIN}` points at {sysroot}, which has no libcore for \
             {BPF_TARGET}; remove it (`rustup toolchain uninstall {TOOLCHAIN}`) and rerun setup"
        );
    }
    let version = run(&["rustc", "--version"]).unwrap_or_default();
    println!(
        "ok: rustup toolchain {TOOLCHAIN} -> {sysroot} ({}, libcore for {BPF_TARGET})",
        short(&version)
    );
    Ok(())
}

/// clippy and rustfmt for the cargo that `test` runs.
fn clippy_fmt(rustup: bool) -> Result<()> {
    let versions = || {
        let clippy = sh::capture(sh::cargo().args(["clippy", "--version"]))?;
        let fmt = sh::capture(sh::cargo().args(["fmt", "--version"]))?;
        Some(format!("{}, {}", clippy.trim(), fmt.trim()))
    };
    if let Some(v) = versions() {
        println!("ok: {v}");
        return Ok(());
    }
    if !rustup {
        // rust-web-clippy and rustfmt-web were installed with the apt packages.
        bail!("`/usr/bin/cargo clippy` or `cargo fmt` does not work although rust-web-clippy and rustfmt-web are installed");
    }
    println!("installing: clippy and rustfmt (rustup component add)");
    sh::run(Command::new("rustup").args(["component", "add", "clippy", "rustfmt"]))
        .context("install clippy and rustfmt for the toolchain that runs cargo")?;
    let v = versions().context("clippy or rustfmt still missing")?;
    println!("ok: {v}");
    Ok(())
}

fn bpf_linker_version() -> Option<String> {
    let path = sh::which("bpf-linker")?;
    let out = sh::capture(Command::new(&path).arg("--version"))?;
    out.split_whitespace().nth(1).map(str::to_owned)
}

fn bpf_linker() -> Result<()> {
    let installed = bpf_linker_build(false)?;
    bpf_linker_check(installed)
}

/// `cargo install`s bpf-linker when the one on PATH is not [`BPF_LINKER_VERSION`]: what was
/// found before (`Some`), or `None` when nothing was to do. `quiet`: cargo says only warnings
/// and errors (it runs beside apt, whose output it would interleave).
fn bpf_linker_build(quiet: bool) -> Result<Option<String>> {
    let found = bpf_linker_version();
    if found.as_deref() == Some(BPF_LINKER_VERSION) {
        return Ok(None);
    }
    let llvm_config = Path::new(LLVM_BIN).join("llvm-config");
    if !llvm_config.exists() {
        bail!(
            "{} is missing although llvm-22-dev is installed",
            llvm_config.display()
        );
    }
    println!(
        "installing: bpf-linker {BPF_LINKER_VERSION} for LLVM 22 (was: {}; cargo install, a minute or two)",
        found.as_deref().unwrap_or("none")
    );
    let path = env::var_os("PATH").unwrap_or_default();
    let path = env::join_paths(
        std::iter::once(Path::new(LLVM_BIN).to_path_buf()).chain(env::split_paths(&path)),
    )
    .context("building PATH")?;
    let mut cargo = sh::cargo();
    cargo
        .args([
            "install",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--locked",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("PATH", path);
    if quiet {
        cargo.arg("--quiet");
    }
    sh::run(&mut cargo)?;
    Ok(Some(found.unwrap_or_else(|| "none".to_string())))
}

/// The bpf-linker on PATH is [`BPF_LINKER_VERSION`], after [`bpf_linker_build`] (`installed`:
/// it installed one).
fn bpf_linker_check(installed: Option<String>) -> Result<()> {
    if installed.is_none() {
        println!("ok: bpf-linker {BPF_LINKER_VERSION}");
        return Ok(());
    }
    // On a new machine ~/.cargo/bin may have just been made.
    sh::prepare_env();
    match bpf_linker_version() {
        Some(v) if v == BPF_LINKER_VERSION => {
            println!("ok: bpf-linker {BPF_LINKER_VERSION}");
            Ok(())
        }
        other => bail!(
            "installed bpf-linker {BPF_LINKER_VERSION} into {}, but the first bpf-linker on PATH ({}) says {}",
            sh::cargo_bin_dir().display(),
            sh::which("bpf-linker").map_or("none".into(), |p| p.display().to_string()),
            other.as_deref().unwrap_or("nothing")
        ),
    }
}

fn tracefs() -> Result<()> {
    let mounted = fs::read_to_string("/proc/self/mounts")
        .context("reading /proc/self/mounts")?
        .lines()
        .any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1) == Some(&TRACEFS) && f.get(2) == Some(&"tracefs")
        });
    if !mounted {
        println!("installing: mount tracefs on {TRACEFS}");
        sh::run(Command::new("mount").args(["-t", "tracefs", "tracefs", TRACEFS]))?;
    }
    println!("ok: tracefs on {TRACEFS}");
    Ok(())
}

/// Facts setup cannot change; a warning, since the tests say what they need themselves.
fn kernel() {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let release = release.trim();
    let mut nums = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let (major, minor) = (nums.next().unwrap_or(0), nums.next().unwrap_or(0));
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    if (major, minor) < (5, 8) || !btf {
        println!(
            "warning: kernel {release}{}: xtlock needs 5.8 or newer with BTF (CONFIG_DEBUG_INFO_BTF)",
            if btf { "" } else { " has no /sys/kernel/btf/vmlinux" }
        );
    } else {
        println!("ok: kernel {release} with BTF");
    }
}

/// "rustc 1.96.0 (ac68faa20 2026-05-25)" -> "rustc 1.96.0".
fn short(version: &str) -> String {
    version
        .split_whitespace()
        .take(2)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_use_plan_is_the_build_set_and_nothing_a_node_should_not_have() {
        assert_eq!(apt_plan(Purpose::Use), APT_BUILD_PACKAGES);
        for p in apt_plan(Purpose::Use) {
            assert!(!never_for_use(p), "{p} is in the use plan");
        }
        // The test plan keeps its daemons, emulators and test tools.
        let test = apt_plan(Purpose::Test);
        for p in [
            "docker.io",
            "firewalld",
            "qemu-system-x86",
            "podman",
            "debootstrap",
        ] {
            assert!(test.contains(&p), "{p} missing from the test plan");
            assert!(never_for_use(p), "{p} not flagged");
        }
        assert!(never_for_use("qemu-system-arm:amd64"));
        assert!(!never_for_use("llvm-22-dev"));
    }
}
