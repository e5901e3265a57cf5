//! Builds the BPF programs (`xtlock-ebpf`) with aya-build and leaves the object in OUT_DIR,
//! where `src/probes/` embeds it.
//!
//! The BPF crate needs the Debian toolchain (`rustup toolchain link debian /usr`, which ships
//! a prebuilt libcore for bpfel-unknown-none) and bpf-linker. Without them the userspace
//! crate still builds, with an empty object, so pure tests run anywhere; `xtlock` then says
//! what is missing when it starts. `XTLOCK_REQUIRE_EBPF=1` (set by `cargo xtask test`) turns
//! that fallback into a build failure.
use std::{env, fs, path::PathBuf, process::Command};

use anyhow::{anyhow, Context as _};

const TOOLCHAIN: &str = "debian";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=XTLOCK_REQUIRE_EBPF");
    println!("cargo:rerun-if-env-changed=PATH");
    // aya-build watches xtlock-ebpf only; the programs are built from xtlock-common too (the
    // event layouts): a change there must rebuild them, or the two sides disagree.
    println!("cargo:rerun-if-changed=../xtlock-common/src");
    println!("cargo:rerun-if-changed=../xtlock-common/Cargo.toml");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let obj = out_dir.join("xtlock");
    let required = env::var("XTLOCK_REQUIRE_EBPF").is_ok_and(|v| v == "1" || v == "true");

    let result = toolchain_ready().and_then(|()| build());
    match result {
        Ok(()) => {
            println!("cargo:rustc-cfg=xtlock_ebpf_built");
            Ok(())
        }
        Err(e) if !required => {
            println!(
                "cargo:warning=BPF programs not built ({e:#}); xtlock will refuse to trace. \
                 Run `./xtask/run setup` to install the BPF toolchain."
            );
            fs::write(&obj, []).context("writing empty BPF object")?;
            Ok(())
        }
        Err(e) => Err(e.context("building the BPF programs (XTLOCK_REQUIRE_EBPF=1)")),
    }
}

fn toolchain_ready() -> anyhow::Result<()> {
    let ok = |mut c: Command| c.output().map(|o| o.status.success()).unwrap_or(false);
    let mut linker = Command::new("bpf-linker");
    linker.arg("--version");
    if !ok(linker) {
        return Err(anyhow!("bpf-linker not on PATH"));
    }
    // Without rustup, aya-build uses the current toolchain (Debian's /usr/bin/rustc).
    let have_rustup = {
        let mut r = Command::new("rustup");
        r.arg("--version");
        ok(r)
    };
    let mut rustc = if have_rustup {
        let mut c = Command::new("rustup");
        c.args(["run", TOOLCHAIN, "rustc"]);
        c
    } else {
        Command::new("rustc")
    };
    rustc.args(["--print", "sysroot"]);
    let sysroot = rustc
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .ok_or_else(|| {
            if have_rustup {
                anyhow!("rustup toolchain `{TOOLCHAIN}` missing")
            } else {
                anyhow!("no rustc on PATH")
            }
        })?;
    let core = PathBuf::from(sysroot).join("lib/rustlib/bpfel-unknown-none/lib");
    if !core.is_dir() {
        return Err(anyhow!(
            "no libcore for bpfel-unknown-none in toolchain `{TOOLCHAIN}` ({})",
            core.display()
        ));
    }
    Ok(())
}

fn build() -> anyhow::Result<()> {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let ebpf_dir = manifest_dir
        .parent()
        .context("workspace root")?
        .join("xtlock-ebpf");
    let root_dir = ebpf_dir.to_str().context("non-UTF-8 path")?;
    // aya-ebpf uses a few unstable features, and the programs (crate `xtlock`) one: the
    // atomic add intrinsic, the only way to BPF's atomic add (the target has no
    // `AtomicU64::fetch_add`). Allowed for those two crates only, on the Debian stable
    // compiler; aya-build passes this through to the BPF build only.
    // SAFETY: build scripts are single-threaded; nothing else reads the environment now.
    unsafe { env::set_var("RUSTC_BOOTSTRAP", "aya_ebpf,xtlock") };
    let package = aya_build::Package {
        name: "xtlock-ebpf",
        root_dir,
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Custom(TOOLCHAIN))
}
