//! nf_tables commits: the serialisation point of nft, iptables-nft, kube-proxy's nftables
//! mode and firewalld, which take no file lock. Entry and return of the commit function
//! (`nfnetlink_rcv_batch`, else `nf_tables_commit`; userspace picks it from kallsyms) give
//! its duration and the task that sent the batch. Two attach types carry the same logic:
//! fentry/fexit where the kernel allows them, kprobe/kretprobe otherwise. The function name
//! in the fentry/fexit sections is a default; userspace loads them against the chosen one.
//!
//! The netns is the sending task's: `current->nsproxy->net_ns->ns.inum`, with offsets from
//! the kernel's BTF (read by userspace).
use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_task},
    macros::{fentry, fexit, kprobe, kretprobe},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext},
};
use xtlock_common::{EventKind, NftCommitEvent, COMM_LEN};

use crate::{
    emit::{cfg, header, ids, kread, now, output},
    NFT_INFLIGHT,
};

#[repr(C)]
#[derive(Clone, Copy)]
pub struct NftEnter {
    pub enter_ns: u64,
    pub netns: u32,
    pub _pad: u32,
}

/// Inode of the current task's network namespace; 0 when the offsets are unknown.
#[inline(always)]
fn current_netns() -> u32 {
    if cfg(|c| &c.task_ok) == 0 {
        return 0;
    }
    // SAFETY: plain helper call.
    let task = unsafe { bpf_get_current_task() };
    let nsproxy: u64 = kread(task, cfg(|c| &c.task_nsproxy) as u32).unwrap_or(0);
    if nsproxy == 0 {
        return 0;
    }
    let net: u64 = kread(nsproxy, cfg(|c| &c.nsproxy_net_ns) as u32).unwrap_or(0);
    if net == 0 {
        return 0;
    }
    kread(net, cfg(|c| &c.net_ns_inum) as u32).unwrap_or(0)
}

#[inline(always)]
fn enter() {
    let (_, tid) = ids();
    let e = NftEnter {
        enter_ns: now(),
        netns: current_netns(),
        _pad: 0,
    };
    let _ = NFT_INFLIGHT.insert(&tid, &e, 0);
}

#[inline(always)]
fn exit() {
    let (_, tid) = ids();
    // SAFETY: read of our own entry; removed right after.
    let Some(e) = (unsafe { NFT_INFLIGHT.get(&tid) }).copied() else {
        return;
    };
    let _ = NFT_INFLIGHT.remove(&tid);
    let comm = bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]);
    let ev = NftCommitEvent {
        hdr: header(EventKind::NftCommit, now()),
        enter_ns: e.enter_ns,
        netns: e.netns,
        _pad: 0,
        comm,
    };
    output(&ev);
}

#[fentry(function = "nfnetlink_rcv_batch")]
pub fn nft_commit_fentry(_ctx: FEntryContext) -> u32 {
    enter();
    0
}

#[fexit(function = "nfnetlink_rcv_batch")]
pub fn nft_commit_fexit(_ctx: FExitContext) -> u32 {
    exit();
    0
}

#[kprobe]
pub fn nft_commit_kprobe(_ctx: ProbeContext) -> u32 {
    enter();
    0
}

#[kretprobe]
pub fn nft_commit_kretprobe(_ctx: RetProbeContext) -> u32 {
    exit();
    0
}
