//! Where events come from. `live`: the kernel's ring buffer (plus /proc for processes that
//! existed before tracing started, the kubelet's files for pod names, rtnetlink for where the
//! node's addresses live: `addrs`); `file`: a capture.
//! Every source yields decoded [`crate::decode::Event`]s, so the analysis and sinks never
//! know which one they are fed by. The file side of a live source is here too: `recorder`
//! writes a capture as the source yields it, `rolling` keeps the daemon's set of them.
pub mod access;
pub mod addrs;
pub mod binaries;
pub mod ct_entries;
pub mod drops;
pub mod file;
pub mod ipset;
pub mod ipvs;
pub mod ipvs_table;
pub mod live;
pub mod lockfinder;
pub mod netlink;
pub mod netns;
pub mod pods;
pub mod procfs;
pub mod recorder;
pub mod refusals;
pub mod rolling;
pub mod rules;
pub mod worker;

/// `CLOCK_MONOTONIC` now, in ns: the clock of `bpf_ktime_get_ns()` and so of every event.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `CLOCK_REALTIME` minus `CLOCK_MONOTONIC`, in ns: add to an event timestamp for wall time.
pub fn wall_offset_ns() -> i128 {
    i128::from(clock_ns(libc::CLOCK_REALTIME)) - i128::from(monotonic_ns())
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; both clocks always exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// ` (needs CAP_NET_ADMIN)` after an error the capability would have avoided (EPERM,
/// EACCES), nothing after any other (a timeout, a closed socket): a hint that is never wrong.
pub(crate) fn needs(e: &std::io::Error, cap: &str) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => format!(" (needs {cap})"),
        _ => String::new(),
    }
}
