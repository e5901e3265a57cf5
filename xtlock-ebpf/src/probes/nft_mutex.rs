//! Waits on the nf_tables mutexes: `lock:contention_begin` / `lock:contention_end` (Linux
//! 5.19+), kept only for mutexes that are a network namespace's nf_tables `commit_mutex`
//! or nfnetlink's nf_tables subsystem mutex.
//!
//! Which mutex it is comes from kernel facts, never from a guess:
//!
//! * **The commit mutex** of the waiter's netns is `&nft_pernet(net)->commit_mutex`:
//!   `net->gen->ptr[nf_tables_net_id]` plus the member's offset (BTF). The id is read from
//!   `nf_tables_net_id` where kallsyms has its address; else it is learned once, from the
//!   first wait whose kernel stack shows `mutex_lock` called by `nf_tables_valid_genid` or
//!   `nft_rcv_nl_event` (whose only mutex is the commit mutex): the id whose pernet pointer
//!   gives that address. Until then, waits on other paths to it are not recognised.
//! * **The nfnetlink subsystem mutex** (`nfnl_lock(NFNL_SUBSYS_NFTABLES)`), one for the
//!   node, which `nfnetlink_rcv_batch` holds while it waits for the commit mutex: learned
//!   once, from the first wait whose stack shows `mutex_lock` called by
//!   `nfnetlink_rcv_batch` itself (the only mutex it takes).
//!
//! The caller of `mutex_lock` is the first stack frame past the scheduler's text (where
//! `mutex_lock` and `__mutex_lock` live, `__sched`). The stack is read only while something
//! is still to learn, and only for mutex waits.
//!
//! A kernel worker (nf_tables' set garbage collection, `nft_trans_gc_work`) takes the commit
//! mutex of the set's netns from the initial netns: for a kernel thread whose own netns's
//! mutex it is not, the commit mutexes seen so far (`NFT_COMMIT_MUTEXES`, filled by every
//! wait recognised) are looked up, then the mutex's owner's netns is tried the same way (the
//! owner is then a batch of that netns). User tasks are not: each wait on another mutex of
//! the node would pay for it.
//!
//! A waiter may begin twice (spinning, then sleeping) and ends once: the first begin starts
//! the wait, and the holder is the mutex's owner then (`owner & ~7`, a `task_struct *`).
//! The wait goes out at its end, as one [`NftMutexWaitEvent`].
use aya_ebpf::{
    cty::c_void,
    helpers::{bpf_get_current_comm, bpf_get_current_task, bpf_get_stack, bpf_probe_read_kernel},
    macros::{btf_tracepoint, tracepoint},
    programs::{BtfTracePointContext, TracePointContext},
    EbpfContext as _,
};
use xtlock_common::{
    EventKind, NftMutexConfig, NftMutexWaitEvent, COMM_LEN, LCB_F_MUTEX, NFT_MUTEX_COMMIT,
    NFT_MUTEX_MAX_NET_IDS, NFT_MUTEX_NFNL, NFT_MUTEX_STACK,
};

use crate::{
    emit::{
        field, header_of, ids, inflight_add, inflight_any, inflight_in_slot, kread, now, output,
    },
    NFT_COMMIT_MUTEXES, NFT_MUTEX_CONFIG, NFT_MUTEX_LEARNED, NFT_MUTEX_WAITS,
};

/// Slots of `NFT_MUTEX_LEARNED`: the learned pernet id plus one, and the nfnetlink mutex's
/// address.
const LEARNED_NET_ID: u32 = 0;
const LEARNED_NFNL: u32 = 1;

#[inline(always)]
fn learned(slot: u32) -> u64 {
    NFT_MUTEX_LEARNED.get(slot).copied().unwrap_or(0)
}

#[inline(always)]
fn learn(slot: u32, v: u64) {
    if let Some(p) = NFT_MUTEX_LEARNED.get_ptr_mut(slot) {
        // SAFETY: an array slot; a racing writer writes the same value.
        unsafe { *p = v };
    }
}

/// `PF_KTHREAD` (`include/linux/sched.h`, the same value since 2.6).
const PF_KTHREAD: u32 = 0x0020_0000;

/// The pernet id of nf_tables plus one (kallsyms or learned), 0 while unknown.
#[inline(always)]
fn net_id(c: &NftMutexConfig) -> u64 {
    if c.net_id_addr != 0 {
        // SAFETY: bpf_probe_read_kernel checks the address.
        match unsafe { bpf_probe_read_kernel(c.net_id_addr as *const u32) } {
            Ok(id) => u64::from(id) + 1,
            Err(_) => 0,
        }
    } else {
        learned(LEARNED_NET_ID)
    }
}

/// Whether `lock` is `net`'s commit mutex.
#[inline(always)]
fn is_commit(c: &NftMutexConfig, net: u64, id: u64, lock: u64) -> bool {
    if id == 0 {
        return false;
    }
    let p = pernet(c, net, (id - 1) as u32);
    p != 0 && p + u64::from(c.commit_mutex) == lock
}

/// The netns of task `task` (0 when unreadable).
#[inline(always)]
fn task_net(c: &NftMutexConfig, task: u64) -> u64 {
    let nsproxy: u64 = kread(task, c.task_nsproxy).unwrap_or(0);
    if nsproxy == 0 {
        0
    } else {
        kread(nsproxy, c.nsproxy_net_ns).unwrap_or(0)
    }
}

/// The netns whose commit mutex `lock` is, for a kernel thread in `own` (not its own): one
/// seen before whose mutex it still is, else the owner's.
#[inline(always)]
fn kthread_net(c: &NftMutexConfig, lock: u64, own: u64) -> Option<u64> {
    let id = net_id(c);
    // SAFETY: a copy out of the map's value.
    if let Some(&seen) = unsafe { NFT_COMMIT_MUTEXES.get(&lock) } {
        if is_commit(c, seen, id, lock) {
            return Some(seen);
        }
    }
    let owner: u64 = kread::<u64>(lock, c.mutex_owner).unwrap_or(0) & !7u64;
    if owner == 0 {
        return None;
    }
    let net = task_net(c, owner);
    (net != 0 && net != own && is_commit(c, net, id, lock)).then_some(net)
}

/// The pernet pointer of id `id` in `net`.
#[inline(always)]
fn pernet(c: &NftMutexConfig, net: u64, id: u32) -> u64 {
    if id >= NFT_MUTEX_MAX_NET_IDS {
        return 0;
    }
    let gen: u64 = kread(net, c.net_gen).unwrap_or(0);
    if gen == 0 {
        return 0;
    }
    kread(gen, c.gen_ptr + id * 8).unwrap_or(0)
}

/// The caller of `mutex_lock` on this stack: the first frame past the scheduler's text.
#[inline(always)]
fn lock_caller(ctx: *mut c_void, c: &NftMutexConfig) -> u64 {
    let mut frames = [0u64; NFT_MUTEX_STACK];
    // SAFETY: a helper call writing at most the buffer's size.
    let n = unsafe {
        bpf_get_stack(
            ctx,
            frames.as_mut_ptr() as *mut c_void,
            (NFT_MUTEX_STACK * 8) as u32,
            0,
        )
    };
    if n <= 0 {
        return 0;
    }
    let mut in_sched = false;
    let mut i = 0;
    while i < NFT_MUTEX_STACK {
        let f = frames[i];
        if f == 0 {
            return 0;
        }
        let sched = f >= c.sched_text[0] && f < c.sched_text[1];
        if sched {
            in_sched = true;
        } else if in_sched {
            return f;
        }
        i += 1;
    }
    0
}

/// Which nf_tables mutex `lock` is, for a waiter in `net`, and the netns it belongs to;
/// learns what the stack proves.
#[inline(always)]
fn which(ctx: *mut c_void, c: &NftMutexConfig, net: u64, lock: u64) -> Option<(u32, u64)> {
    let nfnl = learned(LEARNED_NFNL);
    if nfnl != 0 && lock == nfnl {
        return Some((NFT_MUTEX_NFNL, net));
    }
    let id = net_id(c);
    if is_commit(c, net, id, lock) {
        return Some((NFT_MUTEX_COMMIT, net));
    }
    if id != 0 && nfnl != 0 {
        return None;
    }
    // Something is still to learn: who called mutex_lock?
    let caller = lock_caller(ctx, c);
    if caller == 0 {
        return None;
    }
    let commit_caller = (caller >= c.genid_fn[0] && caller < c.genid_fn[1])
        || (caller >= c.release_fn[0] && caller < c.release_fn[1]);
    // A set's garbage collection, in a kernel worker: the mutex is its owner's netns's.
    let gc_caller = caller >= c.gc_fn[0] && caller < c.gc_fn[1];
    let learn_net = if commit_caller {
        net
    } else if gc_caller {
        let owner: u64 = kread::<u64>(lock, c.mutex_owner).unwrap_or(0) & !7u64;
        if owner == 0 {
            0
        } else {
            task_net(c, owner)
        }
    } else {
        0
    };
    if id == 0 && learn_net != 0 {
        let gen: u64 = kread(learn_net, c.net_gen).unwrap_or(0);
        if gen == 0 {
            return None;
        }
        let len: u32 = kread(gen, c.gen_len).unwrap_or(0);
        let mut i: u32 = 0;
        while i < NFT_MUTEX_MAX_NET_IDS && i < len {
            let p: u64 = kread(gen, c.gen_ptr + i * 8).unwrap_or(0);
            if p != 0 && p + u64::from(c.commit_mutex) == lock {
                learn(LEARNED_NET_ID, u64::from(i) + 1);
                return Some((NFT_MUTEX_COMMIT, learn_net));
            }
            i += 1;
        }
        return None;
    }
    if nfnl == 0 && caller >= c.batch_fn[0] && caller < c.batch_fn[1] {
        learn(LEARNED_NFNL, lock);
        return Some((NFT_MUTEX_NFNL, net));
    }
    None
}

#[inline(always)]
fn begin(ctx: *mut c_void, lock: u64, flags: u32) {
    if flags & LCB_F_MUTEX == 0 {
        return;
    }
    let Some(c) = NFT_MUTEX_CONFIG.get(0) else {
        return;
    };
    if c.ok == 0 {
        return;
    }
    let (tgid, tid) = ids();
    // Sleeping after spinning, or spinning again once woken as the first waiter: the same
    // wait. (contention_end is attached before this program, so every entry gets its end.)
    // SAFETY: read of our own thread's entry.
    if inflight_any()
        && inflight_in_slot(tid)
        && unsafe { NFT_MUTEX_WAITS.get(&tid) }.is_some_and(|w| w.lock == lock)
    {
        return;
    }
    // SAFETY: plain helper call.
    let task = unsafe { bpf_get_current_task() };
    let mut net = task_net(c, task);
    if net == 0 {
        return;
    }
    let mutex = match which(ctx, c, net, lock) {
        Some((m, n)) => {
            net = n;
            m
        }
        None => {
            // A kernel worker on another netns's commit mutex.
            let flags: u32 = kread(task, c.task_flags).unwrap_or(0);
            if flags & PF_KTHREAD == 0 {
                return;
            }
            let Some(n) = kthread_net(c, lock, net) else {
                return;
            };
            net = n;
            NFT_MUTEX_COMMIT
        }
    };
    let start = now();
    let owner: u64 = kread::<u64>(lock, c.mutex_owner).unwrap_or(0) & !7u64;
    if mutex == NFT_MUTEX_COMMIT {
        let _ = NFT_COMMIT_MUTEXES.insert(&lock, &net, 0);
    }
    let (holder_tid, holder_tgid, holder_comm) = if owner == 0 {
        (0, 0, [0u8; COMM_LEN])
    } else {
        (
            kread::<u32>(owner, c.task_pid).unwrap_or(0),
            kread::<u32>(owner, c.task_tgid).unwrap_or(0),
            kread::<[u8; COMM_LEN]>(owner, c.task_comm).unwrap_or([0u8; COMM_LEN]),
        )
    };
    let w = NftMutexWaitEvent {
        hdr: header_of(EventKind::NftMutexWait, 0, tgid, tid),
        start_ns: start,
        lock,
        netns: kread(net, c.net_inum).unwrap_or(0),
        mutex,
        ret: 0,
        flags,
        holder_tid,
        holder_tgid,
        comm: bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]),
        holder_comm,
    };
    if NFT_MUTEX_WAITS.insert(&tid, &w, 0).is_ok() {
        inflight_add(tid, 1);
    }
}

#[inline(always)]
fn end(lock: u64, ret: i32) {
    // Every contended lock of the node ends here: a hash lookup only while a kept wait may
    // be this thread's (see `INFLIGHT`).
    if !inflight_any() {
        return;
    }
    let (_, tid) = ids();
    if !inflight_in_slot(tid) {
        return;
    }
    // SAFETY: read of our own thread's entry; removed right after.
    let Some(w) = (unsafe { NFT_MUTEX_WAITS.get(&tid) }).copied() else {
        return;
    };
    // Another lock's contention inside the wait (the mutex's own spinlock).
    if w.lock != lock {
        return;
    }
    let _ = NFT_MUTEX_WAITS.remove(&tid);
    inflight_add(tid, -1);
    let mut ev = w;
    ev.hdr.ts_ns = now();
    ev.ret = ret;
    output(&ev);
}

#[btf_tracepoint(function = "contention_begin")]
pub fn contention_begin_btf(ctx: BtfTracePointContext) -> u32 {
    // `(void *lock, unsigned int flags)`
    let lock: u64 = ctx.arg(0);
    let flags: u32 = ctx.arg::<u64>(1) as u32;
    begin(ctx.as_ptr(), lock, flags);
    0
}

#[btf_tracepoint(function = "contention_end")]
pub fn contention_end_btf(ctx: BtfTracePointContext) -> u32 {
    // `(void *lock, int ret)`
    let lock: u64 = ctx.arg(0);
    let ret = ctx.arg::<u64>(1) as i32;
    end(lock, ret);
    0
}

/// The perf tracepoint, where `tp_btf` cannot be used: the record's fields at offsets from
/// its format file.
#[tracepoint]
pub fn contention_begin(ctx: TracePointContext) -> u32 {
    let Some(c) = NFT_MUTEX_CONFIG.get(0) else {
        return 0;
    };
    let (Ok(lock), Ok(flags)) = (
        field::<u64>(&ctx, c.tp_lock as usize),
        field::<u32>(&ctx, c.tp_flags as usize),
    ) else {
        return 0;
    };
    begin(ctx.as_ptr(), lock, flags);
    0
}

#[tracepoint]
pub fn contention_end(ctx: TracePointContext) -> u32 {
    let Some(c) = NFT_MUTEX_CONFIG.get(0) else {
        return 0;
    };
    let (Ok(lock), Ok(ret)) = (
        field::<u64>(&ctx, c.tp_lock as usize),
        field::<i32>(&ctx, c.tp_ret as usize),
    ) else {
        return 0;
    };
    end(lock, ret);
    0
}
