//! What this process may read, found at start by trying each reader's first kernel call
//! (never from a capability list alone: a systemd unit's address-family and namespace
//! filters, or a container's seccomp profile, refuse calls the capabilities allow).
//!
//! Each userspace source is one [`FeatureState`]: on, or off with its [`Cause`] and the
//! reason in the kernel's words plus what to grant. Said at start by every live command,
//! listed by `xtlock probes`, exported by the daemon (`xtlock_feature_enabled`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use serde::Serialize;

use super::netlink::{NlError, NlSocket};
use crate::decode::netlink as nl;

/// Why a feature is off: bounded, a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// A capability, an address family or a namespace the deployment did not grant.
    Privilege,
    /// The kernel has not got it (a module not built, a file missing).
    Kernel,
}

impl Cause {
    pub fn label(self) -> &'static str {
        match self {
            Cause::Privilege => "privilege",
            Cause::Kernel => "kernel",
        }
    }
}

/// One userspace feature and whether this process can have it.
#[derive(Clone, Debug, Serialize)]
pub struct FeatureState {
    /// Metric label value: snake case, fixed.
    pub feature: &'static str,
    /// What it gives, for people.
    pub gives: &'static str,
    /// What the kernel checks for it (the price of removing it is `gives`).
    pub needs: &'static str,
    /// None: on.
    pub off: Option<(Cause, String)>,
}

impl FeatureState {
    pub fn on(&self) -> bool {
        self.off.is_none()
    }
}

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYSLOG: u32 = 34;

/// Every feature's state, by trying (about a millisecond; one short-lived thread).
pub fn check() -> Vec<FeatureState> {
    let caps = effective_caps();
    vec![
        FeatureState {
            feature: "rule_reads_legacy",
            gives: "iptables-legacy rule diffs: what each write changed, whose rules it \
                    removed, stripped matches, the REJECT rule behind refusals",
            needs: "CAP_NET_RAW (a raw socket), CAP_NET_ADMIN (IPT_SO_GET_ENTRIES)",
            off: legacy_tables().err(),
        },
        FeatureState {
            feature: "rule_reads_nft",
            gives: "nf_tables rule diffs (iptables-nft, nft, kube-proxy's nftables mode), \
                    the Service model and dead endpoints from them",
            needs: "AF_NETLINK, CAP_NET_ADMIN (nfnetlink)",
            off: nfnetlink(NfProbe::Nftables, caps).err(),
        },
        FeatureState {
            feature: "netns_entry",
            gives: "rules and conntrack read in the writer's network namespace (pods, node \
                    containers) rather than only xtlock's own",
            needs: "CAP_SYS_ADMIN (setns); under systemd RestrictNamespaces= must allow net",
            off: setns_own().err(),
        },
        FeatureState {
            feature: "conntrack_entries",
            gives: "connections to dead or unanswered endpoints (ctnetlink dumps)",
            needs: "AF_NETLINK, CAP_NET_ADMIN (ctnetlink)",
            off: nfnetlink(NfProbe::Conntrack, caps).err(),
        },
        FeatureState {
            feature: "addresses",
            gives: "when pod addresses go (rtnetlink): dead-endpoint windows",
            needs: "AF_NETLINK",
            off: rtnetlink().err(),
        },
        FeatureState {
            feature: "other_processes_netns",
            gives: "network namespaces of processes with more privileges or another user \
                    (pods, kube-proxy): their conntrack counters and rule reads",
            needs: "CAP_SYS_PTRACE (ptrace read access to /proc/PID/ns)",
            off: need_cap(caps, CAP_SYS_PTRACE, "CAP_SYS_PTRACE").err(),
        },
        FeatureState {
            feature: "drop_locations",
            gives: "drop locations named (nf_hook_slow+0x9c) instead of addresses",
            needs: "CAP_SYSLOG (/proc/kallsyms addresses)",
            off: kallsyms(caps).err(),
        },
        FeatureState {
            feature: "ipvs_reads",
            gives: "IPVS virtual services and real servers (kube-proxy's ipvs mode)",
            needs: "CAP_NET_ADMIN (generic netlink IPVS)",
            off: if !std::path::Path::new("/proc/net/ip_vs").exists() {
                Some((
                    Cause::Kernel,
                    "no IPVS here (/proc/net/ip_vs missing: ip_vs not loaded); read once it \
                     loads"
                        .into(),
                ))
            } else {
                need_cap(caps, CAP_NET_ADMIN, "CAP_NET_ADMIN").err()
            },
        },
    ]
}

fn effective_caps() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

fn need_cap(caps: u64, cap: u32, name: &str) -> Result<(), (Cause, String)> {
    if caps & (1 << cap) != 0 {
        Ok(())
    } else {
        Err((Cause::Privilege, format!("no {name}")))
    }
}

fn denied(what: &str, e: &std::io::Error, grant: &str) -> (Cause, String) {
    let cause = match e.raw_os_error() {
        Some(libc::EPERM | libc::EACCES | libc::EAFNOSUPPORT) => Cause::Privilege,
        _ => Cause::Kernel,
    };
    (cause, format!("{what}: {e} (grant {grant})"))
}

/// Whether /proc/kallsyms shows this process addresses: the kernel decides from
/// kptr_restrict, perf_event_paranoid and CAP_SYSLOG together, so its first line is asked.
fn kallsyms(caps: u64) -> Result<(), (Cause, String)> {
    use std::io::BufRead as _;
    let first = std::fs::File::open("/proc/kallsyms")
        .ok()
        .and_then(|f| std::io::BufReader::new(f).lines().next()?.ok())
        .unwrap_or_default();
    let shown = first
        .split_whitespace()
        .next()
        .and_then(|a| u64::from_str_radix(a, 16).ok())
        .is_some_and(|a| a != 0);
    if shown {
        return Ok(());
    }
    if caps & (1 << CAP_SYSLOG) == 0 {
        return Err((
            Cause::Privilege,
            "/proc/kallsyms shows no addresses: no CAP_SYSLOG".into(),
        ));
    }
    Err((
        Cause::Kernel,
        "/proc/kallsyms shows no addresses even with CAP_SYSLOG (kernel.kptr_restrict = 2)".into(),
    ))
}

/// A raw socket and `IPT_SO_GET_INFO` on `filter`: the two checks of every table read.
fn legacy_tables() -> Result<(), (Cause, String)> {
    // SAFETY: a plain socket call; the fd is owned right after.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(denied("cannot open a raw socket", &e, "CAP_NET_RAW"));
    }
    // SAFETY: fd is fresh and owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // struct ipt_getinfo: name[32], then sizes; 84 bytes.
    let mut info = [0u8; 84];
    info[..6].copy_from_slice(b"filter");
    let mut len = info.len() as libc::socklen_t;
    // IPT_SO_GET_INFO = IPT_BASE_CTL (64).
    // SAFETY: info is valid for len bytes.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_IP,
            64,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        // No filter table yet, or ip_tables not loaded yet: allowed, read once written.
        Some(libc::ENOENT | libc::ENOPROTOOPT) => Ok(()),
        _ => Err(denied("cannot read a table", &e, "CAP_NET_ADMIN")),
    }
}

#[derive(Clone, Copy)]
enum NfProbe {
    Nftables,
    Conntrack,
}

/// nfnetlink's own permission check, which every nf_tables and ctnetlink request meets first
/// (CAP_NET_ADMIN), without reaching a subsystem: a bare header (no `nfgenmsg`) is dropped
/// by nfnetlink before it looks the subsystem up, so no module is loaded (nf_tables,
/// nf_conntrack_netlink: a tracer must not change the node), and acked 0, or EPERM.
fn nfnetlink(which: NfProbe, caps: u64) -> Result<(), (Cause, String)> {
    // Opening a netfilter netlink socket loads nfnetlink where it is a module not loaded
    // yet: there, the capability is all that is checked (the rtnetlink check covers the
    // address family).
    let modular = std::path::Path::new("/proc/modules").exists();
    if modular && !std::path::Path::new("/sys/module/nfnetlink").exists() {
        return need_cap(caps, CAP_NET_ADMIN, "CAP_NET_ADMIN");
    }
    let subsys: u16 = match which {
        NfProbe::Nftables => nl::NFNL_SUBSYS_NFTABLES,
        NfProbe::Conntrack => nl::NFNL_SUBSYS_CTNETLINK,
    };
    // NFT_MSG_GETTABLE / IPCTNL_MSG_CT_GET: never read, the header being too short.
    let req = nl::request(subsys << 8, nl::NLM_F_REQUEST | nl::NLM_F_ACK, 1, &[]);
    ask(
        netlink_sys::protocols::NETLINK_NETFILTER,
        &req,
        "CAP_NET_ADMIN",
    )
}

/// An rtnetlink dump of addresses: no capability, only the address family.
fn rtnetlink() -> Result<(), (Cause, String)> {
    // ifaddrmsg: AF_UNSPEC, the rest 0.
    let req = nl::dump(libc::RTM_GETADDR, 1, &[0; 8]);
    ask(netlink_sys::protocols::NETLINK_ROUTE, &req, "AF_NETLINK")
}

/// Sends `req` on a new netlink socket of `proto`; Ok when the kernel answers it to its end
/// without refusing.
fn ask(proto: isize, req: &[u8], grant: &str) -> Result<(), (Cause, String)> {
    let mut sock = NlSocket::open(proto, Duration::from_secs(2)).map_err(|e| {
        denied(
            "cannot open a netlink socket",
            &e,
            "AF_NETLINK: RestrictAddressFamilies=, seccomp",
        )
    })?;
    match sock.exchange(req, |_| Ok::<(), std::convert::Infallible>(())) {
        Ok(()) => Ok(()),
        Err(NlError::Send(e)) => Err(denied("cannot send a netlink request", &e, grant)),
        Err(NlError::Recv(e)) => Err(denied("cannot read the netlink answer", &e, grant)),
        Err(NlError::Refused(errno)) => {
            let e = std::io::Error::from_raw_os_error(errno);
            Err(denied("the kernel refused the request", &e, grant))
        }
        Err(e) => {
            let e = std::io::Error::other(e.to_string());
            Err(denied("cannot read the netlink answer", &e, grant))
        }
    }
}

/// setns() into our own network namespace, from a thread of its own: the same checks as
/// entering any other (CAP_SYS_ADMIN; a seccomp or systemd namespace filter).
fn setns_own() -> Result<(), (Cause, String)> {
    let t = std::thread::Builder::new()
        .name("xtlock-access".into())
        .spawn(|| -> Result<(), (Cause, String)> {
            let f = std::fs::File::open("/proc/thread-self/ns/net").map_err(|e| {
                denied("cannot open its own network namespace", &e, "CAP_SYS_ADMIN")
            })?;
            // SAFETY: setns on an fd we own, to the namespace this thread is already in.
            if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(denied(
                    "setns() refused",
                    &e,
                    "CAP_SYS_ADMIN; under systemd RestrictNamespaces=net",
                ));
            }
            Ok(())
        });
    match t {
        Ok(h) => h
            .join()
            .unwrap_or_else(|_| Err((Cause::Kernel, "the check's thread failed".into()))),
        Err(e) => Err((Cause::Kernel, format!("cannot start a thread: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_feature_has_a_fixed_snake_case_label() {
        let all = check();
        let mut names: Vec<_> = all.iter().map(|f| f.feature).collect();
        assert!(names
            .iter()
            .all(|n| n.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }

    #[test]
    fn a_refusal_is_a_privilege_other_errors_the_kernel() {
        let e = std::io::Error::from_raw_os_error(libc::EPERM);
        assert_eq!(denied("x", &e, "y").0, Cause::Privilege);
        let e = std::io::Error::from_raw_os_error(libc::EAFNOSUPPORT);
        assert_eq!(denied("x", &e, "y").0, Cause::Privilege);
        let e = std::io::Error::from_raw_os_error(libc::EOPNOTSUPP);
        assert_eq!(denied("x", &e, "y").0, Cause::Kernel);
    }
}
