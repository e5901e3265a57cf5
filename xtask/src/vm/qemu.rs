//! Running QEMU: choosing KVM or TCG, the command line, live guest output with a prefix, the
//! time limit, and the markers `/init` prints (`xtlock-vm: ready`, `xtlock-vm: exit-status N`).
use std::{
    fs,
    io::{BufRead as _, BufReader, Read, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::{arch::Arch, sh};

pub const QEMU: &str = "qemu-system-x86_64";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "KVM",
            Accel::Tcg => "TCG",
        }
    }
}

/// Set once a guest's kernel hit a KVM internal error: every later guest of this process
/// boots under TCG.
static KVM_FAILED_IN_A_GUEST: AtomicBool = AtomicBool::new(false);

/// KVM when `/dev/kvm` opens and a probe VM actually runs on it, else TCG. Nested setups can
/// have a `/dev/kvm` that fails at once ("failed to set MSR 0x10a") or hangs silently; the
/// probe boots a 512-byte boot sector that writes one byte to the serial port and leaves
/// through `isa-debug-exit`, and gets a few seconds. A probe that runs does not prove a
/// kernel will: see [`kvm_failed`].
pub fn detect_accel(work: &Path) -> (Accel, String) {
    if KVM_FAILED_IN_A_GUEST.load(Ordering::Relaxed) {
        return (
            Accel::Tcg,
            "KVM failed in an earlier guest of this run (an internal error)".into(),
        );
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return (Accel::Tcg, "no usable /dev/kvm".into());
    }
    match probe(work, Accel::Kvm, Duration::from_secs(4)) {
        Ok(()) => (Accel::Kvm, "KVM probe VM ran".into()),
        Err(e) => (Accel::Tcg, format!("KVM does not work here: {e:#}")),
    }
}

/// Boots the probe boot sector with `accel`; Ok when it printed its byte and exited.
pub fn probe(work: &Path, accel: Accel, limit: Duration) -> Result<()> {
    let img = work.join("probe.img");
    fs::write(&img, boot_sector())?;
    let mut cmd = Command::new(QEMU);
    cmd.args([
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-m",
        "64",
    ])
    .args(accel_args(accel))
    .args(["-serial", "stdio"])
    .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
    .arg("-drive")
    .arg(format!("file={},format=raw,if=ide", img.display()))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting {QEMU}"))?;
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the probe VM hung for {} s", limit.as_secs());
        }
        thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    // isa-debug-exit: QEMU exits with (value << 1) | 1 = 3.
    if status.code() == Some(3) && out.contains('K') {
        return Ok(());
    }
    let first = err.lines().find(|l| !l.contains("warning")).unwrap_or("");
    bail!("the probe VM exited {status} {}", first.trim())
}

/// mov dx,0x3f8; mov al,'K'; out dx,al; mov dx,0xf4; mov al,1; out dx,al; hlt; jmp $-1.
fn boot_sector() -> Vec<u8> {
    let code = [
        0xBA, 0xF8, 0x03, 0xB0, b'K', 0xEE, 0xBA, 0xF4, 0x00, 0xB0, 0x01, 0xEE, 0xF4, 0xEB, 0xFD,
    ];
    let mut s = vec![0u8; 512];
    s[..code.len()].copy_from_slice(&code);
    s[510] = 0x55;
    s[511] = 0xAA;
    s
}

fn accel_args(accel: Accel) -> [&'static str; 4] {
    match accel {
        Accel::Kvm => ["-accel", "kvm", "-cpu", "host"],
        Accel::Tcg => ["-accel", "tcg", "-cpu", "max"],
    }
}

/// Remembers that KVM failed inside a guest (see [`Ended::kvm_internal_error`]), so later
/// guests of this process skip it.
pub fn kvm_failed() {
    KVM_FAILED_IN_A_GUEST.store(true, Ordering::Relaxed);
}

/// QEMU's words when KVM cannot run an instruction of the guest (nested setups whose KVM
/// passes the probe but cannot emulate, e.g., a `lock cmpxchg16b` of a booting kernel:
/// "KVM internal error. Suberror: 1 ... emulation failure"). QEMU then stops the guest and
/// waits, so the boot would only end at its time limit.
fn is_kvm_internal_error(stderr_line: &str) -> bool {
    stderr_line.contains("KVM internal error")
}

/// One guest boot.
pub struct Boot<'a> {
    /// The guest's architecture: x86-64 boots the PC machine, arm64 QEMU's `virt` machine.
    pub arch: Arch,
    pub accel: Accel,
    pub cpus: u32,
    pub memory_mb: u32,
    pub image: &'a Path,
    pub initramfs: &'a Path,
    pub cmdline: String,
    /// 9p shares: (tag, host path, read-only).
    pub shares: Vec<(&'static str, PathBuf, bool)>,
    pub timeout: Duration,
    /// The guest's serial console is copied here as well.
    pub console_log: &'a Path,
    /// Before each console line shown ([`PREFIX`], or one naming the kernel).
    pub prefix: &'a str,
}

/// What a boot ended with.
pub struct Ended {
    /// `xtlock-vm: exit-status N`, when the guest got that far.
    pub exit_status: Option<i32>,
    /// From starting QEMU to `xtlock-vm: ready` (the commands start).
    pub boot: Option<Duration>,
    /// The guest's uptime when it was ready, as it said.
    pub guest_uptime: Option<f64>,
    pub elapsed: Duration,
    pub timed_out: bool,
    /// QEMU's own exit status.
    pub qemu: Option<std::process::ExitStatus>,
    /// The last lines, for a failure message.
    pub tail: Vec<String>,
    /// KVM could not run the guest (QEMU said so on stderr); QEMU was ended at once.
    pub kvm_internal_error: bool,
}

pub const PREFIX: &str = "vm| ";

enum Line {
    Out(String),
    Err(String),
}

pub fn boot(b: &Boot) -> Result<Ended> {
    let qemu = b.arch.qemu();
    let mut cmd = Command::new(qemu);
    cmd.args(["-nodefaults", "-no-user-config", "-display", "none"])
        .arg("-no-reboot");
    match b.arch {
        Arch::Amd64 => {
            cmd.args(accel_args(b.accel));
        }
        // The `virt` machine (PL011 serial, PCIe for virtio, PSCI to power off). `max` has
        // every feature QEMU emulates (LSE atomics for the BPF JIT...); pointer
        // authentication with QEMU's own cheap algorithm, as the architected one (QARMA)
        // costs TCG a good part of its speed. KVM cannot run it on another host.
        Arch::Arm64 => {
            cmd.args(["-machine", "virt", "-accel", "tcg"])
                .args(["-cpu", "max,pauth-impdef=on"]);
        }
    }
    cmd.args(["-m", &b.memory_mb.to_string()])
        .args(["-smp", &b.cpus.to_string()])
        .args(["-rtc", "base=utc"])
        .args(["-serial", "stdio"])
        .arg("-kernel")
        .arg(b.image)
        .arg("-initrd")
        .arg(b.initramfs)
        .args(["-append", &b.cmdline]);
    for (tag, path, ro) in &b.shares {
        cmd.arg("-virtfs").arg(format!(
            "local,path={},mount_tag={tag},security_model=none,multidevs=remap{}",
            path.display(),
            if *ro { ",readonly=on" } else { "" }
        ));
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    println!("+ {}", sh::show(&cmd));
    let start = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("starting {qemu}"))?;
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().context("qemu stdout")?;
    let err = child.stderr.take().context("qemu stderr")?;
    let tx2 = tx.clone();
    thread::spawn(move || {
        for l in BufReader::new(out).split(b'\n').map_while(Result::ok) {
            let l = String::from_utf8_lossy(&l)
                .trim_end_matches('\r')
                .to_owned();
            if tx.send(Line::Out(l)).is_err() {
                break;
            }
        }
    });
    thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if tx2.send(Line::Err(l)).is_err() {
                break;
            }
        }
    });
    let mut log = fs::File::create(b.console_log)
        .with_context(|| format!("creating {}", b.console_log.display()))?;
    let deadline = start + b.timeout;
    let mut ended = Ended {
        exit_status: None,
        boot: None,
        guest_uptime: None,
        elapsed: Duration::ZERO,
        timed_out: false,
        qemu: None,
        tail: Vec::new(),
        kvm_internal_error: false,
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left.min(Duration::from_millis(500))) {
            Ok(Line::Out(l)) => {
                println!("{}{l}", b.prefix);
                let _ = writeln!(log, "{l}");
                see(&l, start, &mut ended);
            }
            Ok(Line::Err(l)) => {
                println!("{}qemu: {l}", b.prefix);
                let _ = writeln!(log, "qemu: {l}");
                if b.accel == Accel::Kvm && is_kvm_internal_error(&l) {
                    ended.kvm_internal_error = true;
                }
                remember(&mut ended.tail, format!("qemu: {l}"));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if Instant::now() >= deadline {
            ended.timed_out = true;
            kill(&mut child);
            break;
        }
        if ended.kvm_internal_error {
            // Let QEMU's register dump that follows reach the log first.
            while let Ok(Line::Err(l)) = rx.recv_timeout(Duration::from_millis(200)) {
                let _ = writeln!(log, "qemu: {l}");
            }
            kill(&mut child);
            break;
        }
    }
    ended.qemu = child.wait().ok();
    ended.elapsed = start.elapsed();
    Ok(ended)
}

fn see(l: &str, start: Instant, e: &mut Ended) {
    remember(&mut e.tail, l.to_owned());
    let Some(at) = l.find("xtlock-vm: ") else {
        return;
    };
    let msg = &l[at + "xtlock-vm: ".len()..];
    if let Some(rest) = msg.strip_prefix("ready: up ") {
        e.boot = Some(start.elapsed());
        e.guest_uptime = rest.split_whitespace().next().and_then(|s| s.parse().ok());
    } else if let Some(code) = msg.strip_prefix("exit-status ") {
        e.exit_status = code.trim().parse().ok();
    }
}

fn remember(tail: &mut Vec<String>, l: String) {
    tail.push(l);
    if tail.len() > 30 {
        tail.remove(0);
    }
}

/// Ends QEMU (our own child, by its pid).
fn kill(child: &mut Child) {
    let _ = child.kill();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_found_behind_kernel_noise() {
        let mut e = Ended {
            exit_status: None,
            boot: None,
            guest_uptime: None,
            elapsed: Duration::ZERO,
            timed_out: false,
            qemu: None,
            tail: Vec::new(),
            kvm_internal_error: false,
        };
        let t = Instant::now();
        see(
            "xtlock-vm: ready: up 5.43 s, 2 CPUs, 2026-01-01T00:00:00Z",
            t,
            &mut e,
        );
        see(
            "[   80.1] random: noisextlock-vm: exit-status 101",
            t,
            &mut e,
        );
        assert_eq!(e.guest_uptime, Some(5.43));
        assert!(e.boot.is_some());
        assert_eq!(e.exit_status, Some(101));
    }

    /// The probe itself works: under TCG (always possible) it must pass.
    #[test]
    fn probe_passes_under_tcg() {
        if sh::which(QEMU).is_none() {
            eprintln!("skipped: no {QEMU}");
            return;
        }
        let dir = std::env::temp_dir().join(format!("xtask-probe-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let r = probe(&dir, Accel::Tcg, Duration::from_secs(20));
        let _ = fs::remove_dir_all(&dir);
        r.unwrap();
    }

    #[test]
    fn a_kvm_internal_error_is_recognised() {
        assert!(is_kvm_internal_error("KVM internal error. Suberror: 1"));
        assert!(!is_kvm_internal_error(
            "qemu-system-x86_64: warning: host doesn't support requested feature"
        ));
    }

    #[test]
    fn boot_sector_is_bootable() {
        let s = boot_sector();
        assert_eq!(s.len(), 512);
        assert_eq!(&s[510..], &[0x55, 0xAA]);
    }
}
