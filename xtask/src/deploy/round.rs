//! One contention round, shared by the main run (`contention.rs`) and the second round
//! (`fleet.rs`): kube-proxy's restore holding the lock, calico-node waiting, kubelet giving up.
use std::{
    process::Child,
    time::{Duration, Instant},
};

use anyhow::{ensure, Result};

use super::{kubelet_gives_up, manifest::PodRun, until_lock, Node, Restore};

/// When each step of a contention round happened, and /metrics during its hold.
pub(super) struct Round {
    pub(super) kp_spawned: Instant,
    pub(super) first_write: Instant,
    pub(super) kp_seen: Instant,
    pub(super) commit_at: Instant,
    pub(super) kp_exit: Instant,
    pub(super) cn_spawned: Instant,
    pub(super) cn_seen: Instant,
    pub(super) cn_exit: Instant,
    pub(super) during_hold: String,
}

/// kube-proxy's restore holds the lock while calico-node's `iptables -w` (started by
/// `calico`) waits and kubelet's `-w 1` gives up; then the restore commits and calico-node
/// goes on. Both must succeed.
pub(super) fn contention_round(
    node: &Node,
    pod: &PodRun,
    ino: u64,
    calico: impl FnOnce() -> Result<Child>,
) -> Result<Round> {
    let restore = Restore::start(node)?;
    let kp_seen = until_lock(ino, false, "kube-proxy's restore to hold the lock")?;
    let cn_spawned = Instant::now();
    let mut calico = calico()?;
    let cn_seen = until_lock(ino, true, "calico-node to wait for the lock")?;
    kubelet_gives_up(node)?;
    std::thread::sleep(Duration::from_millis(300));
    let (_, during_hold) = node.get(pod, "/metrics")?;
    let (first_write, kp_spawned) = (restore.first_write, restore.spawned);
    let (commit_at, kp_status, kp_exit) = restore.commit()?;
    ensure!(kp_status == 0, "the restore failed ({kp_status})");
    let cn_status = calico.wait()?.code().unwrap_or(-1);
    let cn_exit = Instant::now();
    ensure!(
        cn_status == 0,
        "calico-node's iptables -w failed ({cn_status})"
    );
    Ok(Round {
        kp_spawned,
        first_write,
        kp_seen,
        commit_at,
        kp_exit,
        cn_spawned,
        cn_seen,
        cn_exit,
        during_hold,
    })
}
