//! Which iptables binary a process runs, as resolved on disk, and the version it carries:
//! `iptables-restore` is a link to `xtables-legacy-multi` or `xtables-nft-multi` depending on
//! the image and Debian's alternatives; the binary itself says which, in a string like
//! `1.8.9 (legacy)` or `1.8.9 (nf_tables)` (what `iptables -V` prints). Each binary is read
//! once (bounded: [`MAX_BINARIES`] remembered, files up to [`MAX_BYTES`]).

use std::collections::HashMap;
use std::path::Path;

const MAX_BINARIES: usize = 64;
const MAX_BYTES: u64 = 32 << 20;

/// Program names whose exec is resolved: the iptables family and nft.
pub fn is_rule_tool(filename: &str) -> bool {
    let base = filename.rsplit('/').next().unwrap_or(filename);
    [
        "iptables",
        "ip6tables",
        "arptables",
        "ebtables",
        "xtables",
        "nft",
    ]
    .iter()
    .any(|p| base.starts_with(p))
}

/// Versions by resolved path (and the file's inode, so an upgrade is read again), and the
/// parents of recent forks (an iptables has often exited before its exec is read: its
/// parent's root then finds the same file).
#[derive(Default)]
pub struct Binaries {
    versions: HashMap<(String, u64), Option<String>>,
    parents: HashMap<u32, u32>,
}

impl Binaries {
    /// A fork: `child`'s parent, remembered for a while (bounded).
    pub fn forked(&mut self, parent: u32, child: u32) {
        if self.parents.len() >= 4096 {
            self.parents.clear();
        }
        self.parents.insert(child, parent);
    }

    /// The nearest ancestor of `pid` still running (a script's shell may be gone too; an
    /// agent that runs iptables lives on), at most three up.
    pub fn alive_ancestor(&self, pid: u32) -> Option<u32> {
        let mut a = pid;
        (0..3).find_map(|_| {
            a = *self.parents.get(&a)?;
            Path::new(&format!("/proc/{a}/root")).exists().then_some(a)
        })
    }

    /// The program `pid` exec'd (`filename`, as given to execve) as resolved on disk, and its
    /// version: through `/proc/PID/exe` while it runs, else through the root of its nearest
    /// running ancestor (symlinks followed inside that root, as the process saw them);
    /// `None` when none is there.
    pub fn resolve(&mut self, pid: u32, filename: &str) -> Option<(String, Option<String>)> {
        use std::os::unix::fs::MetadataExt;
        let exe_link = format!("/proc/{pid}/exe");
        let (path, file) = match std::fs::read_link(&exe_link) {
            Ok(exe) => (exe.to_string_lossy().into_owned(), exe_link),
            Err(_) => {
                let alive = self.alive_ancestor(pid)?;
                let root = format!("/proc/{alive}/root");
                let path = resolve_in_root(Path::new(&root), filename)?;
                let file = format!("{root}{path}");
                (path, file)
            }
        };
        let ino = std::fs::metadata(&file).map_or(0, |m| m.ino());
        if let Some(v) = self.versions.get(&(path.clone(), ino)) {
            return Some((path, v.clone()));
        }
        let v = read_version(Path::new(&file));
        if self.versions.len() >= MAX_BINARIES {
            self.versions.clear();
        }
        self.versions.insert((path.clone(), ino), v.clone());
        Some((path, v))
    }
}

/// `path` with its symlinks followed as a process whose root is `root` would (an absolute
/// link target is inside that root, not ours); at most 16 links.
fn resolve_in_root(root: &Path, path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return None;
    }
    let mut path = path.to_string();
    for _ in 0..16 {
        let full = format!("{}{path}", root.display());
        match std::fs::read_link(&full) {
            Ok(target) => {
                let t = target.to_string_lossy();
                path = if t.starts_with('/') {
                    t.into_owned()
                } else {
                    let dir = path.rsplit_once('/').map_or("", |(d, _)| d);
                    format!("{dir}/{t}")
                };
            }
            // Not a link (or gone): this is the file.
            Err(_) => return std::fs::metadata(&full).is_ok().then_some(path),
        }
    }
    None
}

fn read_version(file: &Path) -> Option<String> {
    use std::io::Read;
    let f = std::fs::File::open(file).ok()?;
    let mut b = Vec::new();
    f.take(MAX_BYTES).read_to_end(&mut b).ok()?;
    find_version(&b)
}

/// `N.N.N (legacy)` or `N.N.N (nf_tables)`, as iptables' `-V` prints it, in a binary.
pub fn find_version(b: &[u8]) -> Option<String> {
    for tag in [&b" (legacy)\0"[..], &b" (nf_tables)\0"[..]] {
        let Some(at) = b.windows(tag.len()).position(|w| w == tag) else {
            continue;
        };
        let start = b[..at]
            .iter()
            .rposition(|c| !(c.is_ascii_digit() || *c == b'.'))
            .map_or(0, |i| i + 1);
        let version = &b[start..at];
        if version.iter().filter(|&&c| c == b'.').count() == 2 && version[0].is_ascii_digit() {
            let tag = &tag[..tag.len() - 1];
            return Some(format!(
                "{}{}",
                String::from_utf8_lossy(version),
                String::from_utf8_lossy(tag)
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_as_iptables_carries_them() {
        assert_eq!(
            find_version(b"\0abc\x001.8.9 (legacy)\0more").as_deref(),
            Some("1.8.9 (legacy)")
        );
        assert_eq!(
            find_version(b"x\x001.8.10 (nf_tables)\0").as_deref(),
            Some("1.8.10 (nf_tables)")
        );
        assert_eq!(find_version(b"nothing here"), None);
        assert!(is_rule_tool("/usr/sbin/iptables-legacy-restore"));
        // Debian's links, followed inside our own root.
        if Path::new("/usr/sbin/iptables-legacy").exists() {
            assert_eq!(
                resolve_in_root(Path::new("/proc/self/root"), "/usr/sbin/iptables-legacy")
                    .as_deref(),
                Some("/usr/sbin/xtables-legacy-multi")
            );
        }
        assert!(is_rule_tool("nft"));
        assert!(!is_rule_tool("/bin/sh"));
    }

    /// The real binaries of this machine, when installed.
    #[test]
    fn debian_binaries() {
        for (f, tag) in [
            ("/usr/sbin/xtables-legacy-multi", "(legacy)"),
            ("/usr/sbin/xtables-nft-multi", "(nf_tables)"),
        ] {
            if let Some(v) = read_version(Path::new(f)) {
                assert!(v.ends_with(tag), "{f}: {v}");
            }
        }
    }
}

#[cfg(test)]
mod live_tests {
    use super::*;

    /// A running process, then the same once it has exited (through its parent's root).
    #[test]
    fn resolves_running_and_exited_processes() {
        let Ok(mut child) = std::process::Command::new("/usr/sbin/iptables-legacy")
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .spawn()
        else {
            return;
        };
        let pid = child.id();
        let mut b = Binaries::default();
        b.forked(std::process::id(), pid);
        let _ = child.wait();
        let (path, v) = b
            .resolve(pid, "/usr/sbin/iptables-legacy")
            .expect("resolved through the parent's root");
        assert_eq!(path, "/usr/sbin/xtables-legacy-multi");
        assert!(
            v.as_deref().is_some_and(|v| v.ends_with("(legacy)")),
            "{v:?}"
        );
    }
}
