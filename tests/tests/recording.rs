//! Recording when things go wrong: a start that fails keeps the old capture, a capture
//! that cannot be written ends `record` with the error, `export` refuses to write over its
//! own input, and an OS error is said once.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use xtlock_tests::{require_bpf, serial, xtlock_bin, Scratch, SmallFs};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name)
}

fn xtlock(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(xtlock_bin())
        .args(args)
        .output()
        .expect("run xtlock");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn temp_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".tmp"))
                .collect()
        })
        .unwrap_or_default()
}

/// `export F -o F` (or through a hard link) would destroy the capture: refused, F intact.
#[test]
fn export_refuses_to_write_over_its_input() {
    let s = Scratch::new("export-same");
    let cap = s.dir.join("c.xtlock");
    std::fs::copy(data("contention.xtlock"), &cap).expect("copy capture");
    let before = std::fs::read(&cap).expect("read capture");
    let link = s.dir.join("timeline.json");
    std::fs::hard_link(&cap, &link).expect("hard link");
    for out in [&cap, &link] {
        let (code, _, err) = xtlock(&[
            "export",
            cap.to_str().unwrap_or_default(),
            "-o",
            out.to_str().unwrap_or_default(),
        ]);
        assert_ne!(code, 0, "export over its own input succeeded: {err}");
        assert!(err.contains("is the capture being read"), "{err}");
        assert_eq!(std::fs::read(&cap).expect("read capture"), before);
    }
    let (code, _, err) = xtlock(&["report", cap.to_str().unwrap_or_default()]);
    assert_eq!(code, 0, "{err}");
}

/// A start that fails after the output file was named (a wrong `--netns`) leaves the file
/// that was there untouched, for `record -o` and `trace --record`, and no temporary file.
#[test]
fn failed_start_keeps_the_old_capture() {
    if !require_bpf("failed_start_keeps_the_old_capture") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("record-keep");
    let lock = s.lock_file("xtables.lock");
    let cap = s.dir.join("old.xtlock");
    std::fs::copy(data("contention.xtlock"), &cap).expect("copy capture");
    let before = std::fs::read(&cap).expect("read capture");
    let (lock_s, cap_s) = (lock.to_str().unwrap(), cap.to_str().unwrap());
    let bad_netns = s.dir.join("no-such-netns");
    let netns_s = bad_netns.to_str().unwrap();
    for args in [
        vec![
            "record",
            "-o",
            cap_s,
            "--lock-file",
            lock_s,
            "--netns",
            netns_s,
            "--duration",
            "2s",
        ],
        vec![
            "trace",
            "--record",
            cap_s,
            "--lock-file",
            lock_s,
            "--netns",
            netns_s,
            "--duration",
            "2s",
        ],
    ] {
        let (code, _, err) = xtlock(&args);
        assert_ne!(code, 0, "{args:?} started with a missing --netns: {err}");
        assert!(err.contains("no-such-netns"), "{err}");
        assert_eq!(
            std::fs::read(&cap).expect("read capture"),
            before,
            "{args:?} changed the old capture"
        );
        assert!(temp_files(&s.dir).is_empty(), "{:?}", temp_files(&s.dir));
    }
    // A start that works replaces it.
    let (code, _, err) = xtlock(&[
        "record",
        "-o",
        cap_s,
        "--lock-file",
        lock_s,
        "--duration",
        "1s",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_ne!(std::fs::read(&cap).expect("read capture"), before);
    assert!(temp_files(&s.dir).is_empty(), "{:?}", temp_files(&s.dir));
}

/// The disk fills up under `record`: it stops within seconds with the error (said once),
/// and what was written before is readable.
#[test]
fn record_stops_when_its_file_breaks() {
    if !require_bpf("record_stops_when_its_file_breaks") {
        return;
    }
    let _g = serial();
    let s = Scratch::new("record-full");
    let lock = s.lock_file("xtables.lock");
    let fs = SmallFs::mount(&s.dir.join("small"), 512);
    let cap = fs.dir.join("c.xtlock");
    let mut child = Command::new(xtlock_bin())
        .args(["record", "--duration", "120s", "--lock-file"])
        .arg(&lock)
        .arg("-o")
        .arg(&cap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn record");
    // Started: the capture has its name.
    let t = Instant::now();
    while !cap.exists() && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    if !cap.exists() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("record did not start");
    }
    let filler = fs.fill();
    let filled = Instant::now();
    // Events to write: short processes.
    let mut ended = None;
    while filled.elapsed() < Duration::from_secs(30) {
        for _ in 0..20 {
            let _ = Command::new("true").status();
        }
        if let Ok(Some(st)) = child.try_wait() {
            ended = Some(st);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = filled.elapsed();
    let _ = std::fs::remove_file(&filler);
    let Some(st) = ended else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("record ran on for 30 s after its disk filled up");
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    eprintln!("record ended {took:?} after the disk filled: {err}");
    assert!(
        !st.success(),
        "record exited 0 with a broken capture: {err}"
    );
    assert!(err.contains("stopped early"), "{err}");
    let os = "No space left on device (os error 28)";
    let error_lines: Vec<&str> = err.lines().filter(|l| l.contains("error:")).collect();
    assert!(!error_lines.is_empty(), "{err}");
    for l in &error_lines {
        assert!(l.matches(os).count() <= 1, "the OS error twice: {l}");
    }
    assert!(err.contains(os), "{err}");
    let (code, _, rerr) = xtlock(&["report", cap.to_str().unwrap_or_default()]);
    assert_eq!(
        code, 0,
        "what was written before the error is readable: {rerr}"
    );
}
