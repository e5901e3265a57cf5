//! Network namespaces other than xtlock's own: a handle on one by its inode, and sockets
//! made inside one (a netlink socket belongs to the namespace of the thread that made it, and
//! stays there), from a short-lived thread so no worker of xtlock changes namespace.

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::sync::Arc;

/// An open handle on the network namespace with inode `ino`: the writer's (usually gone by
/// now: an iptables lives milliseconds), ours, one pinned by `ip netns` or containerd
/// (`/run/netns`, `/var/run/netns`), or any process's in it (a pod's pause container).
pub fn open(ino: u32, pid: u32) -> Option<File> {
    use std::os::unix::fs::MetadataExt;
    let try_path = |p: &std::path::Path| -> Option<File> {
        let f = File::open(p).ok()?;
        (f.metadata().ok()?.ino() == u64::from(ino)).then_some(f)
    };
    let proc_ns = |p: &str| std::path::PathBuf::from(format!("/proc/{p}/ns/net"));
    if let Some(f) = try_path(&proc_ns(&pid.to_string())).or_else(|| try_path(&proc_ns("self"))) {
        return Some(f);
    }
    // `ip netns` pins, containerd's `cni-*` ones (where /var/run is not /run's link).
    let pinned = ["/run/netns", "/var/run/netns"]
        .into_iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .flatten()
        .find_map(|e| try_path(&e.path()));
    if pinned.is_some() {
        return pinned;
    }
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        .find_map(|p| try_path(&proc_ns(&p)))
}

/// Runs `make` in a thread of its own moved into the namespace `ns`: the sockets it opens
/// belong to that namespace.
pub fn inside<T: Send + 'static>(
    ns: &Arc<File>,
    make: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let ns = ns.clone();
    std::thread::Builder::new()
        .name("xtlock-nsenter".into())
        .spawn(move || {
            // SAFETY: setns on an fd we hold; it moves this short-lived thread only.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                // Said as setns's: joining needs CAP_SYS_ADMIN, which callers tell apart.
                let e = std::io::Error::last_os_error();
                return Err(std::io::Error::new(e.kind(), format!("setns: {e}")));
            }
            make()
        })?
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the namespace's thread failed")))
}
