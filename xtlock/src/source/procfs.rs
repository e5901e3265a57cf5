//! Reading /proc: the process table at start, and details of a process seen later.

use std::{fs, path::Path};

use crate::decode::{Comm, ProcInfo};

/// One process from /proc, or `None` when it is gone or unreadable.
pub fn read_process(root: &Path, pid: u32, ts_ns: u64) -> Option<ProcInfo> {
    let dir = root.join(pid.to_string());
    let stat = fs::read_to_string(dir.join("stat")).ok()?;
    let (comm, ppid) = parse_stat(&stat)?;
    let argv = fs::read(dir.join("cmdline"))
        .map(|b| parse_cmdline(&b))
        .unwrap_or_default();
    let cgroup = fs::read_to_string(dir.join("cgroup"))
        .ok()
        .and_then(|c| parse_cgroup(&c));
    Some(ProcInfo {
        ts_ns,
        pid,
        ppid,
        comm: Comm::new(&comm),
        argv,
        cgroup,
        exe: None,
    })
}

/// Every process in /proc, parents before children where /proc lists them so.
pub fn snapshot(root: &Path, ts_ns: u64) -> Vec<ProcInfo> {
    let Ok(dir) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<ProcInfo> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| read_process(root, pid, ts_ns))
        .collect();
    out.sort_by_key(|p| p.pid);
    out
}

/// `comm` and `ppid` from /proc/PID/stat. comm may contain spaces and parentheses, so it
/// runs from the first '(' to the last ')'.
pub fn parse_stat(stat: &str) -> Option<(String, u32)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    let mut rest = stat.get(close + 1..)?.split_whitespace();
    let _state = rest.next()?;
    let ppid = rest.next()?.parse().ok()?;
    Some((comm, ppid))
}

pub fn parse_cmdline(b: &[u8]) -> Vec<String> {
    b.split(|&c| c == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// The cgroup path: the first entry that names a pod or a container (on a cgroup v1 or
/// hybrid node, the v2 entry is `0::/` and the v1 controllers hold the container's path),
/// else the v2 entry (`0::/path`) when it is not the root, else the first v1 entry with a
/// path.
pub fn parse_cgroup(text: &str) -> Option<String> {
    let mut v2 = None;
    let mut first = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(_ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let who = crate::kube::parse_cgroup(path);
        if who.pod_uid.is_some() || who.container_id.is_some() {
            return Some(path.to_owned());
        }
        if id == "0" {
            v2 = Some(path.to_owned());
        } else if first.is_none() && path != "/" {
            first = Some(path.to_owned());
        }
    }
    match v2 {
        Some(p) if p != "/" => Some(p),
        root => first.or(root),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_comm() {
        let s = "1234 (kube (proxy) x) S 77 1234 1234 0 -1 4194560 0";
        assert_eq!(parse_stat(s), Some(("kube (proxy) x".into(), 77)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn cgroups() {
        assert_eq!(
            parse_cgroup("0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope\n"),
            Some("/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope".into())
        );
        assert_eq!(
            parse_cgroup("12:pids:/kubepods/burstable/podX/abc\n11:cpu:/\n"),
            Some("/kubepods/burstable/podX/abc".into())
        );
        assert_eq!(parse_cgroup(""), None);
        // Hybrid: the unified hierarchy is the root, a v1 controller holds the container.
        assert_eq!(
            parse_cgroup("8:pids:/kubepods/besteffort/pod0d2b3c4e-5f6a-4c6e-9a1f-5f3c1e2a8b7d/3f6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f\n4:memory:/x\n0::/\n")
                .as_deref(),
            Some("/kubepods/besteffort/pod0d2b3c4e-5f6a-4c6e-9a1f-5f3c1e2a8b7d/3f6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f")
        );
        assert_eq!(
            parse_cgroup("4:memory:/process_api/774dc\n0::/\n").as_deref(),
            Some("/process_api/774dc")
        );
    }

    #[test]
    fn reads_self() {
        let me = std::process::id();
        let p = read_process(Path::new("/proc"), me, 1).unwrap();
        assert_eq!(p.pid, me);
        assert!(!p.argv.is_empty());
        assert!(snapshot(Path::new("/proc"), 1).iter().any(|p| p.pid == me));
    }
}

/// Flocks held (not waited for) on the given locks, from a `/proc/locks` listing: lines like
/// `1: FLOCK  ADVISORY  WRITE 1234 fd:01:1234567 0 EOF` (`->` lines are waiters). `dev` in
/// the kernel encoding (`major << 20 | minor`; /proc/locks prints them in hex).
pub fn held_flocks(text: &str, locks: &[(u32, u64)], ts_ns: u64) -> Vec<crate::decode::LockSeed> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut it = line.split_whitespace().skip(1);
        let (Some(class), Some(_mode), Some(rw), Some(pid), Some(id)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        if class != "FLOCK" {
            continue;
        }
        let mut parts = id.rsplitn(2, ':');
        let (Some(ino), Some(majmin)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Some((maj, min)) = majmin.split_once(':') else {
            continue;
        };
        let (Ok(maj), Ok(min), Ok(ino), Ok(pid)) = (
            u32::from_str_radix(maj, 16),
            u32::from_str_radix(min, 16),
            ino.parse::<u64>(),
            pid.parse::<u32>(),
        ) else {
            continue;
        };
        let dev = (maj << 20) | min;
        if locks.contains(&(dev, ino)) {
            out.push(crate::decode::LockSeed {
                ts_ns,
                pid,
                dev,
                ino,
                exclusive: rw == "WRITE",
            });
        }
    }
    out
}

#[cfg(test)]
mod lock_seed_tests {
    use super::*;

    #[test]
    fn held_flocks_of_watched_locks_only() {
        let text = "1: FLOCK  ADVISORY  WRITE 4626 fe:00:9805825 0 EOF\n\
                    1: -> FLOCK  ADVISORY  WRITE 4633 fe:00:9805825 0 EOF\n\
                    2: POSIX  ADVISORY  WRITE 700 fe:00:9805825 0 EOF\n\
                    3: FLOCK  ADVISORY  READ 800 fe:00:12 0 EOF\n\
                    4: FLOCK  ADVISORY  READ 801 00:1a:77 0 EOF\n\
                    garbage\n";
        let dev = 0xfe << 20;
        let got = held_flocks(text, &[(dev, 9805825), (0x1a, 77)], 5);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(
            (got[0].pid, got[0].dev, got[0].ino, got[0].exclusive),
            (4626, dev, 9805825, true)
        );
        assert_eq!((got[1].pid, got[1].exclusive), (801, false));
        assert!(got.iter().all(|s| s.ts_ns == 5));
    }
}
