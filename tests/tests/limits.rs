//! Bounds that hostile input must not get past: valid captures built to make the analysis
//! keep as much as it can (thousands of waits and shared holds open at once, takes never
//! released), replayed by `xtlock report` and `xtlock export` under a 256 MiB peak-RSS bound.
//! No root needed: the captures are written with xtlock's own writer.

use std::{
    fs::File,
    io::BufWriter,
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use serde_json::Value;
use xtlock::capture::{CaptureHeader, CaptureLock, CaptureWriter};
use xtlock_common as common;
use xtlock_tests::{xtlock_bin, Scratch};

/// The bound the issue sets for any input.
const MAX_RSS_KIB: u64 = 256 * 1024;
const DEV: u32 = 25;
const INO: u64 = 1_048_621;

fn as_bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: used on xtlock-common's `#[repr(C)]` event structs: integers and byte arrays
    // with explicit padding fields, so every byte is initialised.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

fn lock_event(ts_ns: u64, pid: u32, owner: u64, fl_type: u8, ret: i32) -> Vec<u8> {
    let mut comm = [0u8; common::COMM_LEN];
    comm[..8].copy_from_slice(b"iptables");
    as_bytes(&common::LockEvent {
        hdr: common::EventHeader {
            kind: common::EventKind::Lock as u32,
            tgid: pid,
            tid: pid,
            _pad: 0,
            ts_ns,
        },
        owner,
        ino: INO,
        dev: DEV,
        ret,
        fl_flags: common::FL_SLEEP | 2,
        fl_type,
        _pad: [0; 3],
        comm,
    })
}

/// Writes a capture of `n` lock events from `make(i)`.
fn write_capture(path: &Path, n: u32, make: impl Fn(u32) -> Vec<u8>) {
    let header = CaptureHeader {
        xtlock_version: "0.1.0".into(),
        hostname: "hostile".into(),
        kernel_release: "6.1.0-test".into(),
        boot_to_wall_offset_ns: 1_700_000_000_000_000_000,
        started_wall_ns: 1_700_000_000_000_000_000,
        locks: vec![CaptureLock {
            path: "/run/xtables.lock".into(),
            dev: DEV,
            ino: INO,
        }],
        probes: vec![],
        extra: Value::Null,
    };
    let f = BufWriter::new(File::create(path).expect("create capture"));
    let mut w = CaptureWriter::new(f, &header).expect("capture header");
    for i in 0..n {
        w.write_kernel(&make(i)).expect("write event");
    }
    w.finish().expect("finish capture");
}

/// Runs `cmd` to its end: (exit code, peak RSS in KiB, stdout, stderr).
// The child is reaped by wait4, which std does not know of.
#[allow(clippy::zombie_processes)]
fn peak_rss(cmd: &mut Command) -> (i32, u64, String, String) {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn xtlock");
    let pid = child.id() as libc::pid_t;
    let mut out = child.stdout.expect("stdout");
    let mut err = child.stderr.expect("stderr");
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid value for wait4 to fill.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child; both pointers are valid for the call.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    assert_eq!(rc, pid, "wait4: {}", std::io::Error::last_os_error());
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    (
        code,
        ru.ru_maxrss as u64,
        t_out.join().unwrap_or_default(),
        t_err.join().unwrap_or_default(),
    )
}

fn check_report_and_export(s: &Scratch, cap: &Path, what: &str) -> Value {
    let size = std::fs::metadata(cap).map(|m| m.len()).unwrap_or(0);
    let t = Instant::now();
    let (code, rss, out, err) = peak_rss(
        Command::new(xtlock_bin())
            .arg("report")
            .arg("--json")
            .arg(cap),
    );
    let report_s = t.elapsed().as_secs_f64();
    assert_eq!(code, 0, "{what}: report failed: {err}");
    assert!(
        rss <= MAX_RSS_KIB,
        "{what}: report peaked at {rss} KiB, over {MAX_RSS_KIB} KiB"
    );
    let summary: Value = out
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .expect("a summary line");
    assert_eq!(summary["type"], "summary", "{what}");
    let timeline = s.dir.join("timeline.json");
    let t = Instant::now();
    let (code, rss_x, _, err) = peak_rss(
        Command::new(xtlock_bin())
            .arg("export")
            .arg(cap)
            .arg("-o")
            .arg(&timeline),
    );
    let export_s = t.elapsed().as_secs_f64();
    assert_eq!(code, 0, "{what}: export failed: {err}");
    assert!(
        rss_x <= MAX_RSS_KIB,
        "{what}: export peaked at {rss_x} KiB, over {MAX_RSS_KIB} KiB"
    );
    let tl = std::fs::metadata(&timeline).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "{what}: capture {size} B; report {rss} KiB peak, {report_s:.2} s; export {rss_x} KiB \
         peak, {export_s:.2} s, timeline {tl} B; bounds hit: {}",
        summary["over_bounds"]
    );
    summary
}

/// Deferred waits and shared takes alternating, every one from a new process and never
/// ended: each take used to join the holder list of every open wait (quadratic memory).
#[test]
fn alternating_waits_and_shared_takes_stay_bounded() {
    let s = Scratch::new("hostile-alt");
    let cap = s.dir.join("alt.xtlock");
    const N: u32 = 64_000;
    write_capture(&cap, N, |i| {
        let pid = 10_000 + i;
        let owner = 0xffff_8880_0000_0000 + u64::from(i) * 64;
        if i % 2 == 0 {
            lock_event(
                1_000 + u64::from(i) * 1_000,
                pid,
                owner,
                common::F_WRLCK,
                common::FILE_LOCK_DEFERRED,
            )
        } else {
            lock_event(1_000 + u64::from(i) * 1_000, pid, owner, common::F_RDLCK, 0)
        }
    });
    let summary = check_report_and_export(&s, &cap, "64,000 alternating waits and shared takes");
    // What did not fit is said, not dropped silently.
    assert!(
        summary["over_bounds"]["open_waits"].as_u64().unwrap_or(0) > 0,
        "{}",
        summary["over_bounds"]
    );
}

/// Shared takes never released, every one by a new owner.
#[test]
fn takes_never_released_stay_bounded() {
    let s = Scratch::new("hostile-takes");
    let cap = s.dir.join("takes.xtlock");
    const N: u32 = 200_000;
    write_capture(&cap, N, |i| {
        let owner = 0xffff_8880_0000_0000 + u64::from(i) * 64;
        lock_event(
            1_000 + u64::from(i) * 500,
            10_000 + i,
            owner,
            common::F_RDLCK,
            0,
        )
    });
    let summary = check_report_and_export(&s, &cap, "200,000 shared takes never released");
    assert!(
        summary["over_bounds"]["open_holds"].as_u64().unwrap_or(0) > 0,
        "{}",
        summary["over_bounds"]
    );
}
