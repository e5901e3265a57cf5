//! nf_tables commits: the serialisation point of nft, iptables-nft, kube-proxy's nftables
//! mode and firewalld, which take no file lock. Entry and return of the commit function
//! (`nfnetlink_rcv_batch`, else `nf_tables_commit`; userspace picks it from kallsyms) give
//! its duration and the task that sent the batch. Two attach types carry the same logic:
//! fentry/fexit where the kernel allows them, kprobe/kretprobe otherwise. The function name
//! in the fentry/fexit sections is a default; userspace loads them against the chosen one.
//!
//! At entry the batch is still whole in its `sk_buff` (from after the batch-begin message):
//! its netlink messages are counted per object kind: with `bpf_loop` where the kernel has it
//! (5.17+, `NFT_BATCH_LOOP_MSGS`), else in a bounded loop of `NFT_BATCH_MAX_MSGS`,
//! before the commit mutex is taken, so the walk is not timed as part of the commit.
//!
//! The netns is the sending task's: `current->nsproxy->net_ns->ns.inum`, with offsets from
//! the kernel's BTF (read by userspace).
use aya_ebpf::{
    cty::{c_long, c_void},
    helpers::{bpf_get_current_comm, bpf_loop, bpf_probe_read_kernel, bpf_probe_read_user},
    macros::{fentry, fexit, kprobe, kretprobe},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext},
};
use xtlock_common::{
    nft_msg_slots, EventKind, NftCommitEvent, NftConfig, COMM_LEN, NFNL_MSG_BATCH_END,
    NFT_BATCH_COMPLETE, NFT_BATCH_LOOP_MSGS, NFT_BATCH_MAX_MSGS, NFT_BATCH_NONE, NFT_BATCH_PARTIAL,
    NFT_BATCH_UNREADABLE, NFT_KINDS,
};

use crate::{
    emit::{current_netns, header, ids, kread, now, output},
    NFT_CONFIG, NFT_INFLIGHT,
};

/// `NLMSG_HDRLEN`: a message's header, the least a message can be.
pub(crate) const NLMSG_HDRLEN: u32 = 16;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct NftEnter {
    pub enter_ns: u64,
    pub netns: u32,
    pub batch: u32,
    /// Additions per kind, then deletions per kind, then the sink of the messages that
    /// change nothing; 32 so that a slot masked to 5 bits needs no bounds check.
    pub counts: [u32; 32],
}

/// `nft_msg_slots()`, in read-only data: the walk indexes it by message type.
static NFT_MSG_SLOTS: [u8; 4096] = nft_msg_slots();

/// The batch's bytes: its `sk_buff`'s data and length.
#[inline(always)]
fn batch_bytes(skb: u64, c: &NftConfig) -> Option<(u64, u64)> {
    let data = kread::<u64>(skb, c.skb_data)?;
    let len = kread::<u32>(skb, c.skb_len)?;
    Some((data, u64::from(len)))
}

/// One message of the walk, at `*off`: counted, and `*off` moved past it; or why the walk
/// stops there. Three exits and no other branch (the kind comes from a table): the bounded
/// loop of [`walk`] is followed by the verifier message by message, and more branches than
/// that run past its limits. `USER`: the bytes are the caller's (a `sendmsg()`'s buffers),
/// else the kernel's (the batch's `sk_buff`).
#[inline(always)]
pub(crate) fn step<const USER: bool>(
    data: u64,
    len: u64,
    off: &mut u64,
    counts: &mut [u32; 32],
) -> Option<u32> {
    if *off + u64::from(NLMSG_HDRLEN) > len {
        return Some(NFT_BATCH_COMPLETE);
    }
    // `nlmsg_len`, then `nlmsg_type` and `nlmsg_flags`; a failed read is a length of 0.
    let at = (data + *off) as *const u64;
    // SAFETY: the helpers check the address.
    let h: u64 = if USER {
        unsafe { bpf_probe_read_user(at) }
    } else {
        unsafe { bpf_probe_read_kernel(at) }
    }
    .unwrap_or(0);
    let msg_len = h as u32;
    let ty = (h >> 32) as u32 & 0xffff;
    if msg_len < NLMSG_HDRLEN {
        return Some(NFT_BATCH_UNREADABLE);
    }
    if ty == NFNL_MSG_BATCH_END {
        return Some(NFT_BATCH_COMPLETE);
    }
    // SAFETY: the index is below 4096, the table's length.
    let slot =
        unsafe { core::ptr::read_volatile(NFT_MSG_SLOTS.as_ptr().add((ty & 0xfff) as usize)) };
    counts[(slot as usize) & 31] += 1;
    // NLMSG_ALIGN
    *off += u64::from((msg_len + 3) & !3);
    None
}

/// The status of a walk that ran out of steps at `off`: complete if no message is left.
#[inline(always)]
fn out_of_steps(off: u64, len: u64) -> u32 {
    if off + u64::from(NLMSG_HDRLEN) > len {
        NFT_BATCH_COMPLETE
    } else {
        NFT_BATCH_PARTIAL
    }
}

/// Counts the batch's messages into `e` (a map value: the counters are indexed there, which
/// every verifier accepts, unlike a variable stack offset), at most [`NFT_BATCH_MAX_MSGS`];
/// the status.
#[inline(always)]
fn walk(skb: u64, c: &NftConfig, e: &mut NftEnter) -> u32 {
    let Some((data, len)) = batch_bytes(skb, c) else {
        return NFT_BATCH_UNREADABLE;
    };
    let mut off: u64 = 0;
    let mut i: u32 = 0;
    while i < NFT_BATCH_MAX_MSGS {
        if let Some(status) = step::<false>(data, len, &mut off, &mut e.counts) {
            return status;
        }
        i += 1;
    }
    out_of_steps(off, len)
}

/// The walk's state, on the entry program's stack, for [`walk_step`].
#[repr(C)]
struct WalkCtx {
    data: u64,
    len: u64,
    off: u64,
    e: *mut NftEnter,
    status: u32,
    _pad: u32,
}

/// One message of the walk, called by `bpf_loop`: 0 goes on, 1 stops (`status` says why).
/// Verified once whatever the batch's length, unlike the bounded loop of [`walk`].
extern "C" fn walk_step(_i: u32, ctx: *mut c_void) -> c_long {
    // SAFETY: `ctx` is the `WalkCtx` that `walk_looped` passed to bpf_loop, and `e` the map
    // value `enter` got for this thread, alive for the whole call.
    let w = unsafe { &mut *(ctx as *mut WalkCtx) };
    let counts = unsafe { &mut (*w.e).counts };
    match step::<false>(w.data, w.len, &mut w.off, counts) {
        Some(status) => {
            w.status = status;
            1
        }
        None => 0,
    }
}

/// [`walk`] with `bpf_loop` (Linux >= 5.17): up to [`NFT_BATCH_LOOP_MSGS`] messages.
#[inline(always)]
fn walk_looped(skb: u64, c: &NftConfig, e: &mut NftEnter) -> u32 {
    let Some((data, len)) = batch_bytes(skb, c) else {
        return NFT_BATCH_UNREADABLE;
    };
    let mut w = WalkCtx {
        data,
        len,
        off: 0,
        e: e as *mut NftEnter,
        status: 0,
        _pad: 0,
    };
    // SAFETY: a helper call; the callback and its context live for the call.
    let n = unsafe {
        bpf_loop(
            NFT_BATCH_LOOP_MSGS,
            walk_step as *mut c_void,
            &mut w as *mut WalkCtx as *mut c_void,
            0,
        )
    };
    if n < 0 {
        return NFT_BATCH_UNREADABLE;
    }
    // A step that stopped the loop set the status; else the steps ran out.
    if w.status != 0 {
        w.status
    } else {
        out_of_steps(w.off, w.len)
    }
}

/// Records the commit's start for this thread, after counting its batch (`looped`: with
/// `bpf_loop`, else the bounded loop).
#[inline(always)]
fn enter(arg0: u64, arg1: u64, looped: bool) {
    let (_, tid) = ids();
    let zero = NftEnter {
        enter_ns: 0,
        netns: current_netns(),
        batch: NFT_BATCH_NONE,
        counts: [0; 32],
    };
    if NFT_INFLIGHT.insert(&tid, &zero, 0).is_err() {
        return;
    }
    let Some(e) = NFT_INFLIGHT.get_ptr_mut(&tid) else {
        return;
    };
    // SAFETY: our own thread's entry, just inserted; nothing else writes it.
    let e = unsafe { &mut *e };
    if let Some(c) = NFT_CONFIG.get(0).copied().filter(|c| c.ok != 0) {
        let skb = if c.skb_arg == 0 { arg0 } else { arg1 };
        e.batch = if looped {
            walk_looped(skb, &c, e)
        } else {
            walk(skb, &c, e)
        };
    }
    // After the walk: the commit proper starts now.
    e.enter_ns = now();
}

#[inline(always)]
fn exit() {
    let (_, tid) = ids();
    // SAFETY: read of our own entry; removed right after.
    let Some(e) = (unsafe { NFT_INFLIGHT.get(&tid) }).copied() else {
        return;
    };
    let _ = NFT_INFLIGHT.remove(&tid);
    if e.enter_ns == 0 {
        return;
    }
    let comm = bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]);
    let mut added = [0u32; NFT_KINDS];
    let mut deleted = [0u32; NFT_KINDS];
    added.copy_from_slice(&e.counts[..NFT_KINDS]);
    deleted.copy_from_slice(&e.counts[NFT_KINDS..2 * NFT_KINDS]);
    crate::pending::send_by(Some(crate::emit::ids().0));
    let ev = NftCommitEvent {
        hdr: header(EventKind::NftCommit, now()),
        enter_ns: e.enter_ns,
        netns: e.netns,
        batch: e.batch,
        comm,
        added,
        deleted,
    };
    output(&ev);
}

#[fentry(function = "nfnetlink_rcv_batch")]
pub fn nft_commit_fentry(ctx: FEntryContext) -> u32 {
    // Both functions hooked have at least two arguments.
    enter(ctx.arg(0), ctx.arg(1), false);
    0
}

#[fexit(function = "nfnetlink_rcv_batch")]
pub fn nft_commit_fexit(_ctx: FExitContext) -> u32 {
    exit();
    0
}

#[kprobe]
pub fn nft_commit_kprobe(ctx: ProbeContext) -> u32 {
    let a0: u64 = ctx.arg(0).unwrap_or(0);
    let a1: u64 = ctx.arg(1).unwrap_or(0);
    enter(a0, a1, false);
    0
}

/// The kprobe entry with the `bpf_loop` walk: tried first, `nft_commit_kprobe` where the
/// kernel has no `bpf_loop` (before 5.17).
#[kprobe]
pub fn nft_commit_kprobe_loop(ctx: ProbeContext) -> u32 {
    let a0: u64 = ctx.arg(0).unwrap_or(0);
    let a1: u64 = ctx.arg(1).unwrap_or(0);
    enter(a0, a1, true);
    0
}

#[kretprobe]
pub fn nft_commit_kretprobe(_ctx: RetProbeContext) -> u32 {
    exit();
    0
}
