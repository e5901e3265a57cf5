//! bpftrace as the independent count of a lock's holds.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

/// bpftrace counting the holds of one file (device and inode): successful exclusive takes,
/// and the time from each to its owner's release.
pub struct Bpftrace {
    child: Child,
    reader: std::thread::JoinHandle<String>,
}

impl Drop for Bpftrace {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// bpftrace run with `args`, its stdout gathered by a thread (joined for all it printed);
/// returns once a line passes `ready` (its probes are attached), or panics after 60 s.
pub fn spawn_bpftrace(
    args: &[&str],
    ready: fn(&str) -> bool,
) -> (Child, std::thread::JoinHandle<String>) {
    let mut child = Command::new("bpftrace")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn bpftrace");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if ready(&line) {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(60)).is_ok(),
        "bpftrace did not start within 60 s"
    );
    (child, reader)
}

impl Bpftrace {
    pub fn start(file: &std::path::Path) -> Self {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(file).expect("the lock file to count");
        let ino = meta.ino();
        // The tracepoint's `s_dev` is the kernel's encoding: major << 20 | minor. A tmpfs
        // file's inode number alone is small and shared with other filesystems' files.
        let dev = (u64::from(libc::major(meta.dev())) << 20) | u64::from(libc::minor(meta.dev()));
        let script = format!(
            "tracepoint:filelock:flock_lock_inode /args->i_ino == {ino} && args->s_dev == {dev}/ {{
               if (args->ret == 0 && args->type == 1) {{ @start[args->owner] = nsecs; @holds = count(); }}
               if (args->ret == 0 && args->type == 2 && @start[args->owner] != 0) {{
                 @total_ns = sum(nsecs - @start[args->owner]); @ended = count();
                 delete(@start[args->owner]);
               }}
             }}
             interval:ms:200 {{ print(@holds); print(@ended); print(@total_ns); }}
             END {{ clear(@start); }}"
        );
        // "Attaching 2 probes..." once the probes are in.
        let (child, reader) = spawn_bpftrace(&["-e", &script], |l| l.contains("Attaching"));
        Self { child, reader }
    }

    /// Ends bpftrace; returns its maps: (holds taken, holds ended, total ns). The maps are
    /// printed every 200 ms: the last print, after the workload has ended, is the count;
    /// no reliance on bpftrace's SIGINT handling (seen to hang now and then).
    pub fn finish(mut self) -> (u64, u64, u64) {
        std::thread::sleep(Duration::from_millis(700));
        let _ = self.child.kill();
        let _ = self.child.wait();
        let reader = std::mem::replace(&mut self.reader, std::thread::spawn(String::new));
        let text = reader.join().unwrap_or_default();
        let get = |name: &str| {
            text.lines()
                .rev()
                .find_map(|l| l.strip_prefix(&format!("@{name}: ")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        (get("holds"), get("ended"), get("total_ns"))
    }
}
