//! Who is behind a process: the *agent* (the daemon that ran the `iptables` that holds the
//! lock), its role, and its pod/container identity.
//!
//! The process touching the lock is usually a short-lived `iptables`/`iptables-restore`,
//! often run through a shell or inside a container by a runtime shim; the culprit is the
//! nearest ancestor that is none of those.

use std::sync::Arc;

use serde::Serialize;

use crate::analysis::procs::{FastMap, ProcTable};
use crate::decode::Comm;
use crate::kube::PodName;
use crate::shared::SharedStr;

/// Binaries of the xtables/nftables family (comm prefixes; comm is cut to 15 bytes).
const XTABLES_PREFIXES: &[&[u8]] = &[
    b"iptables",
    b"ip6tables",
    b"xtables",
    b"nft",
    b"arptables",
    b"ebtables",
];
/// The ones that take the xtables file lock (nft does not).
const LOCKING_PREFIXES: &[&[u8]] = &[
    b"iptables",
    b"ip6tables",
    b"xtables",
    b"arptables",
    b"ebtables",
];
const SHELLS: &[&str] = &["sh", "bash", "dash", "busybox", "ash", "zsh"];

/// Comm or binary name of an iptables/ip6tables/xtables/nft/arptables/ebtables tool.
pub fn is_xtables_tool(name: &str) -> bool {
    has_prefix(name.as_bytes(), XTABLES_PREFIXES)
}

/// Like [`is_xtables_tool`], without `nft`: the tools that lock `/run/xtables.lock`.
pub fn is_locking_tool(name: &str) -> bool {
    has_prefix(name.as_bytes(), LOCKING_PREFIXES)
}

/// [`is_xtables_tool`] on a raw comm, without converting it (hot path).
pub fn is_xtables_comm(comm: &Comm) -> bool {
    has_prefix(&comm.0, XTABLES_PREFIXES)
}

/// [`is_locking_tool`] on a raw comm, without allocating (hot path).
pub fn is_locking_comm(comm: &Comm) -> bool {
    has_prefix(&comm.0, LOCKING_PREFIXES)
}

fn has_prefix(name: &[u8], prefixes: &[&[u8]]) -> bool {
    prefixes.iter().any(|p| name.starts_with(p))
}

fn is_shell(name: &str) -> bool {
    SHELLS.contains(&name)
}

fn is_shim(name: &str) -> bool {
    name == "runc"
        || name.starts_with("runc:") // runc's init stages: "runc:[2:INIT]"
        || name.starts_with("containerd-shim")
        || name == "conmon"
        || name == "crun"
}

/// Processes that are never the agent: the tools themselves, shells and runtime shims.
pub fn is_skipped(comm: &str) -> bool {
    is_xtables_tool(comm) || is_shell(comm) || is_shim(comm)
}

/// Role of a known agent, by its comm.
pub fn role_of(agent: &str) -> &'static str {
    match agent {
        "kube-proxy" => "proxy",
        "calico-node" | "calico-felix" | "felix" | "flanneld" | "cilium-agent" | "aws-node"
        | "aws-k8s-agent" | "weave" | "weaver" | "portmap" | "firewall" | "bandwidth"
        | "kube-router" | "antrea-agent" => "cni",
        "firewalld" => "firewall",
        "dockerd" | "containerd" => "runtime",
        "kubelet" => "kubelet",
        _ => "other",
    }
}

/// One link of an ancestor chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChainLink {
    pub pid: u32,
    pub comm: SharedStr,
}

/// Who is behind a pid. Its strings are shared with every fact that names the process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Attribution {
    pub pid: u32,
    /// The process's own comm.
    pub comm: SharedStr,
    /// Its argv joined by spaces, empty when unknown.
    pub cmdline: SharedStr,
    /// Comm of the nearest ancestor (itself included) that is not a tool, shell or shim.
    pub agent: SharedStr,
    pub role: &'static str,
    pub agent_pid: u32,
    /// From the process up.
    pub chain: Arc<[ChainLink]>,
    pub pod_uid: Option<SharedStr>,
    pub container_id: Option<SharedStr>,
    /// Namespace, pod and container, when the kubelet named them.
    pub pod: Option<Arc<PodName>>,
}

impl Attribution {
    /// The agent, or the process's own comm when no agent is known.
    pub fn agent_or_comm(&self) -> &SharedStr {
        if self.agent.is_empty() {
            &self.comm
        } else {
            &self.agent
        }
    }
}

/// kthreadd: every kernel thread is its child.
const KTHREADD_PID: u32 = 2;

/// A kernel thread forked while tracing: its fork carried kthreadd's comm, and the kernel
/// named it afterwards (`kworker/1:2`), without an exec to tell. The event's comm, read
/// from the thread itself, is its name then. (A kworker's pid is often one a short-lived
/// process had a moment before.)
fn renamed_kthread(p: &crate::analysis::procs::Proc, comm: &Comm) -> bool {
    p.ppid == KTHREADD_PID && p.exec_ns.is_none() && !comm.is_empty() && p.comm != *comm
}

/// Attributes `pid`. `comm` names the process when the table does not know it, and a kernel
/// thread the table knows only by its fork.
pub fn attribute(procs: &ProcTable, pid: u32, comm: &Comm) -> Attribution {
    attribute_into(procs, pid, comm, &mut Vec::new(), &mut Vec::new()).0
}

/// [`attribute`] with the caller's buffers: `chain` (left empty) for the links, `stamps`
/// (cleared, then filled) for the stamps of the entries the chain was built from. Also
/// whether `comm` named a process the table knows ([`renamed_kthread`]).
fn attribute_into(
    procs: &ProcTable,
    pid: u32,
    comm: &Comm,
    chain: &mut Vec<ChainLink>,
    stamps: &mut Vec<u64>,
) -> (Attribution, bool) {
    chain.clear();
    stamps.clear();
    let mut by_comm = false;
    let mut agent: Option<(u32, SharedStr)> = None;
    let mut cgroup = None;
    let mut cmdline = SharedStr::empty();
    for p in procs.ancestors(pid) {
        let name = if chain.is_empty() {
            cmdline = p.cmdline_shared();
            by_comm = renamed_kthread(p, comm);
            if by_comm {
                SharedStr::from(comm.as_str().as_ref())
            } else {
                p.name.clone()
            }
        } else {
            p.name.clone()
        };
        if cgroup.is_none() {
            cgroup = p.cgroup.as_ref();
        }
        if agent.is_none() && !is_skipped(&name) && !is_skipped(p.exe_name()) {
            agent = Some((p.pid, name.clone()));
        }
        chain.push(ChainLink {
            pid: p.pid,
            comm: name,
        });
        stamps.push(p.stamp);
    }
    let own_comm = match chain.first() {
        Some(l) => l.comm.clone(),
        None => {
            let own = SharedStr::from(comm.as_str().as_ref());
            chain.push(ChainLink {
                pid,
                comm: own.clone(),
            });
            own
        }
    };
    let (agent_pid, agent) = agent.unwrap_or_else(|| (pid, own_comm.clone()));
    let (pod_uid, container_id, pod) = cgroup.map_or((None, None, None), |c| {
        (
            c.identity.pod_uid.clone(),
            c.identity.container_id.clone(),
            procs.pod_of(&c.identity),
        )
    });
    let attr = Attribution {
        pid,
        comm: own_comm,
        cmdline,
        role: role_of(&agent),
        agent,
        agent_pid,
        // Moved out of the buffer in one allocation.
        chain: chain.drain(..).collect(),
        pod_uid,
        container_id,
        pod,
    };
    (attr, by_comm)
}

/// Remembers attributions per pid, so a daemon locking a million times does not walk and
/// allocate its chain a million times. An entry stays valid while the chain it was built
/// from is unchanged: the same table entries (by their [`Proc::stamp`]) in the same order,
/// so forks, execs and exits elsewhere on the node do not invalidate it. Bounded: cleared
/// when it grows too big.
///
/// [`Proc::stamp`]: crate::analysis::procs::Proc::stamp
#[derive(Debug, Default)]
pub struct Attributor {
    cache: FastMap<u32, Cached>,
    /// Reused for the links of each chain built.
    chain: Vec<ChainLink>,
}

#[derive(Debug)]
struct Cached {
    /// Stamps of the chain's entries, from the process up; empty for an unknown pid.
    stamps: Vec<u64>,
    /// The event's comm, which names an unknown pid.
    comm: Comm,
    /// Named by the event's comm although the table knows it ([`renamed_kthread`]).
    by_comm: bool,
    attr: Arc<Attribution>,
}

impl Cached {
    fn is_current(&self, procs: &ProcTable, pid: u32, comm: &Comm) -> bool {
        let mut n = 0;
        for p in procs.ancestors(pid) {
            if self.stamps.get(n) != Some(&p.stamp) {
                return false;
            }
            n += 1;
        }
        n == self.stamps.len() && ((n > 0 && !self.by_comm) || self.comm == *comm)
    }
}

const CACHE_MAX: usize = 4096;

impl Attributor {
    pub fn new() -> Self {
        Self::default()
    }

    /// The attribution of `pid` now; `comm` is the event's comm for unknown pids.
    pub fn get(&mut self, procs: &ProcTable, pid: u32, comm: &Comm) -> Arc<Attribution> {
        let stale = match self.cache.get_mut(&pid) {
            Some(c) if c.is_current(procs, pid, comm) => return c.attr.clone(),
            Some(c) => Some(std::mem::take(&mut c.stamps)),
            None => None,
        };
        // The replaced entry's buffer is reused.
        let mut stamps = stale.unwrap_or_default();
        let (attr, by_comm) = attribute_into(procs, pid, comm, &mut self.chain, &mut stamps);
        let attr = Arc::new(attr);
        if self.cache.len() >= CACHE_MAX && !self.cache.contains_key(&pid) {
            self.cache.clear();
        }
        self.cache.insert(
            pid,
            Cached {
                stamps,
                comm: *comm,
                by_comm,
                attr: attr.clone(),
            },
        );
        attr
    }

    /// Forgets every cached attribution (pod names arrived: they may name cached ones).
    pub fn clear(&mut self) {
        self.cache.clear();
    }

    /// Drops what is cached for `pid` (its process exited: nothing asks for it again, and
    /// the cache then holds live processes only).
    pub fn forget(&mut self, pid: u32) {
        self.cache.remove(&pid);
    }
}

/// Where the state machines look processes up. Borrowed per event.
pub struct Ctx<'a> {
    pub procs: &'a ProcTable,
    pub attr: &'a mut Attributor,
}

impl Ctx<'_> {
    pub fn who(&mut self, pid: u32, comm: &Comm) -> Arc<Attribution> {
        self.attr.get(self.procs, pid, comm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::procs::tests::{exec, fork, seed};

    #[test]
    fn agent_through_shell() {
        let mut t = ProcTable::new();
        t.apply(&seed(0, 1, 0, "systemd", None));
        t.apply(&seed(0, 100, 1, "kube-proxy", None));
        t.apply(&fork(1, 100, 200, "kube-proxy"));
        t.apply(&exec(2, 200, "/bin/sh", &["sh", "-c", "iptables-restore"]));
        t.apply(&fork(3, 200, 201, "sh"));
        t.apply(&exec(
            4,
            201,
            "/usr/sbin/iptables-restore",
            &["iptables-restore", "-w", "5", "--noflush"],
        ));
        let a = attribute(&t, 201, &Comm::new("iptables-restor"));
        assert_eq!(a.agent, "kube-proxy");
        assert_eq!(a.role, "proxy");
        assert_eq!(a.agent_pid, 100);
        assert_eq!(a.comm, "iptables-restor");
        assert_eq!(a.cmdline, "iptables-restore -w 5 --noflush");
        let pids: Vec<u32> = a.chain.iter().map(|l| l.pid).collect();
        assert_eq!(pids, [201, 200, 100, 1]);
    }

    /// A kworker forked while tracing (its pid just freed by an `nft` that exited) is named
    /// by the kernel after its fork: the wait it reports names it, not kthreadd nor `nft`.
    #[test]
    fn a_kernel_thread_forked_while_tracing_is_named_by_its_events() {
        let mut t = ProcTable::new();
        t.apply(&seed(0, 1, 0, "systemd", None));
        t.apply(&seed(0, 2, 0, "kthreadd", None));
        t.apply(&fork(1, 1, 331, "systemd"));
        t.apply(&exec(
            2,
            331,
            "/usr/sbin/nft",
            &["nft", "add", "table", "ip", "t"],
        ));
        t.apply(&fork(3, 2, 331, "kthreadd"));
        let mut cache = Attributor::new();
        let a = cache.get(&t, 331, &Comm::new("kworker/1:2"));
        assert_eq!(a.comm, "kworker/1:2");
        assert_eq!(a.agent, "kworker/1:2");
        assert_eq!(a.agent_pid, 331);
        // Cached, and still right when the kernel renames the worker again.
        let b = cache.get(&t, 331, &Comm::new("kworker/1:2"));
        assert!(Arc::ptr_eq(&a, &b));
        let c = cache.get(&t, 331, &Comm::new("kworker/1:3"));
        assert_eq!(c.comm, "kworker/1:3");
        // A user process keeps its table name whatever its threads call themselves.
        t.apply(&fork(4, 1, 400, "systemd"));
        t.apply(&exec(5, 400, "/usr/bin/java", &["java"]));
        assert_eq!(
            cache.get(&t, 400, &Comm::new("C2 CompilerThre")).comm,
            "java"
        );
    }

    #[test]
    fn agent_through_runc_and_shim() {
        let mut t = ProcTable::new();
        t.apply(&seed(0, 1, 0, "systemd", None));
        t.apply(&seed(0, 50, 1, "containerd-shim", None));
        t.apply(&seed(0, 60, 50, "runc:[2:INIT]", None));
        t.apply(&seed(0, 70, 60, "iptables-legacy", None));
        let a = attribute(&t, 70, &Comm::new("iptables-legacy"));
        assert_eq!(a.agent, "systemd");
        t.apply(&seed(0, 40, 1, "calico-node", None));
        t.apply(&seed(0, 41, 40, "runc", None));
        t.apply(&seed(0, 42, 41, "ip6tables-legacy", None));
        let a = attribute(&t, 42, &Comm::new("x"));
        assert_eq!(
            (a.agent.as_str(), a.role, a.agent_pid),
            ("calico-node", "cni", 40)
        );
    }

    #[test]
    fn all_skipped_or_unknown_falls_back_to_own_comm() {
        let mut t = ProcTable::new();
        t.apply(&seed(0, 10, 0, "bash", None));
        t.apply(&seed(0, 11, 10, "iptables", None));
        let a = attribute(&t, 11, &Comm::new("iptables"));
        assert_eq!(
            (a.agent.as_str(), a.agent_pid, a.role),
            ("iptables", 11, "other")
        );
        let a = attribute(&t, 999, &Comm::new("mystery"));
        assert_eq!(a.agent, "mystery");
        assert_eq!(a.comm, "mystery");
        assert_eq!(
            *a.chain,
            [ChainLink {
                pid: 999,
                comm: "mystery".into()
            }]
        );
        assert_eq!(a.cmdline, "");
    }

    #[test]
    fn roles() {
        assert_eq!(role_of("kube-proxy"), "proxy");
        assert_eq!(role_of("flanneld"), "cni");
        assert_eq!(role_of("portmap"), "cni");
        assert_eq!(role_of("firewalld"), "firewall");
        assert_eq!(role_of("dockerd"), "runtime");
        assert_eq!(role_of("kubelet"), "kubelet");
        assert_eq!(role_of("python3"), "other");
        assert!(is_skipped("iptables-restor"));
        assert!(is_skipped("nft"));
        assert!(is_skipped("containerd-shim"));
        assert!(!is_skipped("containerd"));
        assert!(is_locking_comm(&Comm::new("ip6tables-restore")));
        assert!(!is_locking_comm(&Comm::new("nft")));
    }

    const CID: &str = "3f6e4b0c2a1d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f";

    #[test]
    fn pod_identity_flows_into_attribution() {
        let mut t = ProcTable::new();
        let cg = format!("0::/kubepods/besteffort/pod0d2b3c4e-5f6a-4c6e-9a1f-5f3c1e2a8b7d/{CID}");
        t.apply(&seed(0, 40, 1, "calico-node", Some(&cg)));
        t.apply(&fork(1, 40, 41, "calico-node"));
        t.apply(&exec(
            2,
            41,
            "/usr/sbin/iptables-legacy",
            &["iptables-legacy"],
        ));
        let a = attribute(&t, 41, &Comm::new("iptables-legacy"));
        assert_eq!(a.container_id.as_deref(), Some(CID));
        assert_eq!(
            a.pod_uid.as_deref(),
            Some("0d2b3c4e-5f6a-4c6e-9a1f-5f3c1e2a8b7d")
        );
    }

    #[test]
    fn cache_follows_pid_reuse() {
        let mut t = ProcTable::new();
        t.apply(&seed(0, 100, 1, "kube-proxy", None));
        t.apply(&seed(0, 300, 1, "flanneld", None));
        t.apply(&fork(1, 100, 200, "kube-proxy"));
        let mut a = Attributor::new();
        let c = Comm::new("kube-proxy");
        assert_eq!(a.get(&t, 200, &c).agent, "kube-proxy");
        let first = a.get(&t, 200, &c);
        assert!(Arc::ptr_eq(&first, &a.get(&t, 200, &c)), "cached");
        t.apply(&crate::analysis::procs::tests::exit(
            5,
            200,
            "kube-proxy",
            Some(0),
        ));
        t.apply(&fork(6, 300, 200, "flanneld"));
        assert_eq!(a.get(&t, 200, &c).agent, "flanneld");
    }
}
