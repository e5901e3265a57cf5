//! One VM ([`run_spec`]): the kernel and (for another architecture) the root prepared, the
//! busybox initramfs with `/init` (`vm/init.sh`), its configuration and the run script of the
//! commands, QEMU booted (again under TCG when KVM fails the guest), and the results the guest
//! left read back into a [`Report`].
use std::{
    env, fs,
    path::{Path, PathBuf},
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context as _, Result};

use super::{cpio, kernel, qemu, qemu::Accel, userland, Report, Spec};
use crate::{arch::Arch, sh};

/// What `/init` needs before the host's root is there: virtio-pci, 9p and overlay (modules in
/// Debian's kernel; skipped where built in).
const EARLY_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Boots the VM of `spec` and runs its commands, its console shown with `prefix` before each
/// line; Err only when the VM could not be started.
pub fn run_spec(spec: &Spec, prefix: &str) -> Result<Report> {
    let start = Instant::now();
    let guest = prepare(spec)?;
    let (accel, accel_why) = match spec.accel {
        _ if !spec.arch.is_host() => (
            Accel::Tcg,
            format!("an {} guest on an {} host", spec.arch, Arch::host()),
        ),
        Some(a) => (a, "chosen".to_owned()),
        None => qemu::detect_accel(&spec.work),
    };
    let prepare = start.elapsed();
    let (ended, accel, accel_why) = boot(spec, &guest, prefix, accel, accel_why)?;
    let Prepared {
        kernel, results, ..
    } = guest;
    // Boot time, for docs/kernels.md's figures of emulated guests.
    let _ = fs::write(
        results.join("timing"),
        match ended.boot {
            Some(b) => format!("boot={:.1}\n", b.as_secs_f64()),
            None => String::new(),
        },
    );
    // Which kernel these results are of (`cargo xtask kernels-doc` names it).
    fs::write(
        results.join("kernel"),
        format!(
            "release={}\npackage={}\narch={}\n",
            kernel.release, kernel.package, spec.arch
        ),
    )?;
    Ok(Report {
        exit_status: exit_status(&results).or(ended.exit_status),
        kernel,
        accel,
        accel_why,
        prepare,
        ended,
        commands: commands(&results),
        skips: fs::read_to_string(results.join("skips"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect(),
    })
}

/// A VM ready to boot: its kernel, its root (another architecture's), its results folder
/// (cleared) and its initramfs.
struct Prepared {
    kernel: kernel::Kernel,
    userland: Option<PathBuf>,
    results: PathBuf,
    initramfs: PathBuf,
}

/// The kernel fetched (or found cached), the root of another architecture prepared, the
/// results folder cleared and the initramfs built.
fn prepare(spec: &Spec) -> Result<Prepared> {
    for t in [spec.arch.qemu(), "busybox", "dpkg", "apt-get", "xz"] {
        if sh::which(t).is_none() {
            bail!("{t} is missing: run `cargo xtask setup` (qemu-system-x86, qemu-system-arm, busybox-static, xz-utils)");
        }
    }
    fs::create_dir_all(&spec.work)?;
    let kernel = kernel::prepare(&spec.kernel, &kernel::cache_dir(), spec.arch)?;
    // The guest's root: the host's, or, for another architecture, Debian's packages of it.
    let userland = if spec.arch.is_host() {
        None
    } else {
        Some(userland::prepare(&kernel::cache_dir(), spec.arch)?)
    };
    let modules = kernel::Modules::load(&kernel.modules)?;
    let early: Vec<String> = EARLY_MODULES.iter().map(|s| s.to_string()).collect();
    let early = modules.closure(&early)?;
    let preload = modules.closure(&spec.modules)?;

    let results = absolute(&spec.results)?;
    fs::create_dir_all(&results)?;
    clear_results(&results);
    let conf = conf(
        spec,
        &kernel,
        &early,
        &preload,
        &results,
        userland.is_some(),
    )?;
    let initramfs = spec.work.join("initramfs.cpio");
    let busybox = match &userland {
        Some(u) => u.join("bin/busybox"),
        None => sh::which("busybox").context("busybox is missing")?,
    };
    build_initramfs(
        &initramfs,
        &busybox,
        &kernel,
        &early,
        &conf,
        &run_script(spec, &kernel, &results),
    )?;
    Ok(Prepared {
        kernel,
        userland,
        results,
        initramfs,
    })
}

/// Boots the guest under `accel` until it ends; again under TCG when KVM stops it with an
/// internal error (unless KVM was asked for by name). The accelerator it ended on, and why.
fn boot(
    spec: &Spec,
    guest: &Prepared,
    prefix: &str,
    mut accel: Accel,
    mut accel_why: String,
) -> Result<(qemu::Ended, Accel, String)> {
    let Prepared {
        kernel,
        userland,
        results,
        initramfs,
    } = guest;
    let mut shares = vec![
        (
            "hostroot",
            userland.clone().unwrap_or_else(|| "/".into()),
            true,
        ),
        ("results", results.clone(), false),
    ];
    if userland.is_some() {
        shares.push(("hostfs", "/".into(), true));
    }
    let ended = loop {
        println!(
            "vm: {} ({}), QEMU/{accel_name} ({accel_why}); {} command(s), time limit {} s",
            kernel.release,
            kernel.package,
            spec.commands.len(),
            spec.timeout.as_secs(),
            accel_name = accel.name(),
        );
        let ended = qemu::boot(&qemu::Boot {
            arch: spec.arch,
            accel,
            cpus: spec.cpus,
            memory_mb: spec.memory_mb,
            image: &kernel.image,
            initramfs,
            cmdline: cmdline(spec.arch, accel),
            shares: shares.clone(),
            timeout: spec.timeout,
            console_log: &results.join("console.log"),
            prefix,
        })?;
        // KVM passed the probe but cannot run this kernel: the same guest again under TCG,
        // unless KVM was asked for by name.
        if ended.kvm_internal_error && spec.accel.is_none() {
            qemu::kvm_failed();
            println!(
                "vm: KVM stopped the guest with an internal error ({:.1} s in): booting it again \
                 under TCG, and every later guest of this run",
                ended.elapsed.as_secs_f64()
            );
            clear_results(results);
            accel = Accel::Tcg;
            accel_why = "KVM stopped this guest with an internal error".to_owned();
            continue;
        }
        break ended;
    };
    Ok((ended, accel, accel_why))
}

/// The guest's exit status from `results/exit-status`.
fn exit_status(results: &Path) -> Option<i32> {
    fs::read_to_string(results.join("exit-status"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Per command: exit status, milliseconds, label (the lines of `results/commands`).
fn commands(results: &Path) -> Vec<(i32, u64, String)> {
    fs::read_to_string(results.join("commands"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, '\t');
            Some((
                f.next()?.parse().ok()?,
                f.next()?.parse().ok()?,
                f.next()?.to_owned(),
            ))
        })
        .collect()
}

/// Removes what a guest's earlier run left in `results` (a run's files are all its own).
fn clear_results(results: &Path) {
    for f in [
        "exit-status",
        "commands",
        "console.log",
        "probes.json",
        "kernel",
        "skips",
        "timing",
    ] {
        let _ = fs::remove_file(results.join(f));
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    Ok(if p.is_absolute() {
        p.to_path_buf()
    } else {
        env::current_dir()?.join(p)
    })
}

/// quiet: the kernel says only warnings and worse. tsc=reliable: TCG's TSC is steady, and
/// the fallback (HPET) makes every clock read an emulated MMIO access. mitigations=off: the
/// page-table switches of KPTI are slow under TCG and prove nothing here.
/// arm64's `virt` machine has its console on the PL011 (ttyAMA0).
fn cmdline(arch: Arch, accel: Accel) -> String {
    let console = match arch {
        Arch::Amd64 => "ttyS0",
        Arch::Arm64 => "ttyAMA0",
    };
    let mut c = format!("console={console} panic=-1 quiet loglevel=4 mitigations=off");
    if accel == Accel::Tcg && arch == Arch::Amd64 {
        c.push_str(" tsc=reliable no_timer_check");
    }
    c
}

/// Single-quoted for sh.
fn sq(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn words(v: &[String]) -> String {
    v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" ")
}

fn conf(
    spec: &Spec,
    kernel: &kernel::Kernel,
    early: &[String],
    preload: &[String],
    results: &Path,
    own_root: bool,
) -> Result<String> {
    let keep: Vec<String> = spec
        .keep
        .iter()
        .map(|p| absolute(p).map(|p| p.display().to_string()))
        .collect::<Result<_>>()?;
    for p in keep.iter().chain([&results.display().to_string()]) {
        if p.contains(char::is_whitespace) {
            bail!("vm: paths with blanks are not supported: {p}");
        }
    }
    let epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(format!(
        "RELEASE={}\nMSIZE=512000\nEARLY_MODULES={}\nMODULES={}\nMODULES_DIR={}\nRESULTS={}\nKEEP={}\nHOST_EPOCH={epoch}\nHOSTFS={}\n",
        sq(&kernel.release),
        sq(&words(early)),
        sq(&words(preload)),
        sq(&absolute(&kernel.modules)?.display().to_string()),
        sq(&results.display().to_string()),
        sq(&keep.join(" ")),
        if own_root { "1" } else { "" },
    ))
}

/// The script the guest runs as root: every command, each one's status in
/// `results/commands`, and the first failure's status as its own.
fn run_script(spec: &Spec, kernel: &kernel::Kernel, results: &Path) -> String {
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), GUEST_PATH.into()),
        ("HOME".into(), "/root".into()),
        ("LANG".into(), "C.UTF-8".into()),
        ("CI".into(), "true".into()),
        ("RUST_BACKTRACE".into(), "1".into()),
        ("XTLOCK_VM".into(), "1".into()),
        ("XTLOCK_VM_KERNEL".into(), kernel.release.clone()),
        ("XTLOCK_VM_RESULTS".into(), results.display().to_string()),
    ];
    for (k, v) in &spec.env {
        env.retain(|(k2, _)| k2 != k);
        env.push((k.clone(), v.clone()));
    }
    let mut s =
        String::from("#!/bin/sh\n# Written by cargo xtask vm-test (xtask/src/vm/guest.rs).\n");
    for (k, v) in &env {
        s.push_str(&format!("export {k}={}\n", sq(v)));
    }
    s.push_str(
        r#"failed=0
step() {
    label=$1
    dir=$2
    shift 2
    printf 'xtlock-vm: run: %s\n' "$label"
    t0=$(date +%s%N)
    (cd "$dir" && exec "$@")
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    printf 'xtlock-vm: done: %s: exit status %s after %s ms\n' "$label" "$rc" "$ms"
    printf '%s\t%s\t%s\n' "$rc" "$ms" "$label" >>"$XTLOCK_VM_RESULTS/commands"
    if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=$rc; fi
}
"#,
    );
    for c in &spec.commands {
        s.push_str(&format!(
            "step {} {} {}\n",
            sq(&c.label.replace(['\t', '\n'], " ")),
            sq(&c.cwd.display().to_string()),
            c.argv.iter().map(|a| sq(a)).collect::<Vec<_>>().join(" ")
        ));
    }
    s.push_str("exit \"$failed\"\n");
    s
}

fn build_initramfs(
    out: &Path,
    busybox_path: &Path,
    kernel: &kernel::Kernel,
    early: &[String],
    conf: &str,
    run: &str,
) -> Result<()> {
    let busybox =
        fs::read(busybox_path).with_context(|| format!("reading {}", busybox_path.display()))?;
    if !is_static_elf(&busybox) {
        bail!(
            "{} is not statically linked: install busybox-static",
            busybox_path.display()
        );
    }
    let file = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut c = cpio::Cpio::new(std::io::BufWriter::new(file));
    for d in [
        "/bin",
        "/sbin",
        "/usr",
        "/usr/bin",
        "/usr/sbin",
        "/etc",
        "/etc/xtlock-vm",
        "/proc",
        "/sys",
        "/dev",
        "/tmp",
        "/lib",
        "/lib/modules",
        "/host",
        "/overlay",
        "/newroot",
    ] {
        c.dir(d, 0o755)?;
    }
    c.char_dev("/dev/console", 0o600, 5, 1)?;
    c.file("/bin/busybox", 0o755, &busybox)?;
    c.file("/init", 0o755, include_str!("init.sh").as_bytes())?;
    c.file("/etc/xtlock-vm/conf", 0o644, conf.as_bytes())?;
    c.file("/etc/xtlock-vm/run.sh", 0o755, run.as_bytes())?;
    let base = format!("/lib/modules/{}", kernel.release);
    let mut dirs = vec![base.clone()];
    for m in early {
        let mut d = String::from(&base);
        for part in m
            .split('/')
            .collect::<Vec<_>>()
            .split_last()
            .map_or(&[][..], |x| x.1)
        {
            d = format!("{d}/{part}");
            if !dirs.contains(&d) {
                dirs.push(d.clone());
            }
        }
    }
    for d in &dirs {
        c.dir(d, 0o755)?;
    }
    for m in early {
        let data =
            fs::read(kernel.modules.join(m)).with_context(|| format!("reading module {m}"))?;
        c.file(&format!("{base}/{m}"), 0o644, &data)?;
    }
    c.finish()?;
    Ok(())
}

/// An ELF without a PT_INTERP program header.
fn is_static_elf(b: &[u8]) -> bool {
    let u16_at = |o: usize| {
        b.get(o..o + 2)
            .map(|s| u16::from_le_bytes([s[0], s[1]]) as usize)
    };
    let u64_at = |o: usize| {
        b.get(o..o + 8)
            .and_then(|s| s.try_into().ok())
            .map(|s: [u8; 8]| u64::from_le_bytes(s) as usize)
    };
    if !b.starts_with(b"\x7fELF\x02\x01") {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        b.get(o..o + 4) != Some(&3u32.to_le_bytes()[..])
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::vm::GuestCommand;

    #[test]
    fn run_script_quotes_and_orders() {
        let spec = Spec {
            arch: Arch::Amd64,
            kernel: kernel::Choice::Apt {
                version: "6.1.0-1".into(),
                pinned: true,
            },
            commands: vec![
                GuestCommand {
                    label: "lock_trace".into(),
                    cwd: "/w/tests".into(),
                    argv: vec!["/t/lock_trace".into(), "it's".into()],
                },
                GuestCommand::shell("exec 1", Path::new("/w"), "lsmod | grep ip_vs"),
            ],
            env: vec![("CI".into(), "false".into()), ("X".into(), "a b".into())],
            modules: vec![],
            keep: vec![],
            results: "/r".into(),
            work: "/w/target/vm".into(),
            timeout: Duration::from_secs(1),
            accel: None,
            cpus: 1,
            memory_mb: 256,
        };
        let k = kernel::Kernel {
            release: "6.1.0-1-amd64".into(),
            package: "p".into(),
            image: "/k".into(),
            pvh: true,
            modules: "/m".into(),
            cached: true,
        };
        let s = run_script(&spec, &k, Path::new("/r"));
        assert!(s.contains("export CI='false'\n"));
        assert!(!s.contains("export CI='true'"));
        assert!(s.contains("export X='a b'\n"));
        assert!(s.contains("export XTLOCK_VM='1'\n"));
        assert!(s.contains("step 'lock_trace' '/w/tests' '/t/lock_trace' 'it'\\''s'\n"));
        assert!(s.contains("step 'exec 1' '/w' 'sh' '-c' 'lsmod | grep ip_vs'\n"));
        assert!(s.ends_with("exit \"$failed\"\n"));
    }

    #[test]
    fn static_busybox_is_recognised() {
        if let Ok(b) = fs::read("/bin/busybox") {
            // Debian's busybox-static; the dynamic busybox package would fail this.
            let _ = is_static_elf(&b);
        }
        assert!(!is_static_elf(b"not an elf"));
    }
}
