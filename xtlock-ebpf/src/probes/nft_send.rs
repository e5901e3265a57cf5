//! nf_tables batches timed from their `sendmsg()`: nft and iptables-nft send each batch
//! with one `sendmsg()` on a `NETLINK_NETFILTER` socket (their reads go with `sendto()`),
//! and the kernel processes it in that call (`netlink_unicast` -> `nfnetlink_rcv_batch`),
//! holding the netns's commit mutex from the batch's start to its commit. Where no hook on
//! `nfnetlink_rcv_batch` attaches (`nft_commit`: fentry or kprobes), this is the hold's
//! time, less what the call waited for the mutexes (the analysis takes that off).
//!
//! The socket is recognised from the descriptor: `current->files->fdt->fd[fd]`, its
//! `private_data` a `struct socket` that points back to the file, whose `sock` is
//! `AF_NETLINK` with protocol `NETLINK_NETFILTER`; its netns is the socket's own, where the
//! batch applies. Offsets from BTF. The exit tracepoint is attached first, so every entry the
//! enter program keeps gets its exit (the function hooks attach as a pair, microseconds
//! apart).
//!
//! A kept call waits for its exit in the thread's slot of an array (`NFT_SEND_SLOTS`),
//! claimed with a compare-and-swap, where the `bpf_loop` program runs (Linux >= 5.17, so the
//! compare-and-swap of 5.12 is there); elsewhere, or when another thread owns the slot, in a
//! hash (`NFT_SEND_INFLIGHT`). Each end of the call touches the few cache lines it must: in
//! a transaction that runs every few hundred microseconds they are cold, and each costs
//! more than the instructions around it (docs/performance.md).
//!
//! What the batch does is counted at entry, as `nft_commit` counts it in the kernel's copy:
//! the same messages are still in the caller's buffers, the `msghdr`'s iovecs (libnftnl's
//! batch pages, whole messages each), walked with `bpf_loop` (Linux >= 5.17) by
//! `sys_enter_sendmsg_loop`; `sys_enter_sendmsg` is the same without counts, for older
//! kernels. Only the tracepoint programs count: where the syscall's function can be hooked,
//! so can `nfnetlink_rcv_batch`, and `nft_commit` counts there.
//!
//! As the other syscall hooks, on the syscall's function (fentry, else kprobe) where it
//! attaches: an enabled syscall tracepoint puts every syscall of the node on the
//! syscall-tracing path; the tracepoints are the fallback.
use core::ptr::{copy_nonoverlapping, read_volatile, write_volatile};

use aya_ebpf::{
    cty::{c_long, c_void},
    helpers::{bpf_get_current_comm, bpf_get_current_task, bpf_loop, bpf_probe_read_user},
    macros::{fentry, fexit, kprobe, kretprobe, tracepoint},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext, TracePointContext},
};
use xtlock_common::{
    EventKind, NftMutexConfig, NftSendEvent, AF_NETLINK, COMM_LEN, NETLINK_NETFILTER,
    NFT_BATCH_COMPLETE, NFT_BATCH_LOOP_MSGS, NFT_BATCH_NONE, NFT_BATCH_PARTIAL,
    NFT_BATCH_UNREADABLE, NFT_KINDS,
};

use super::nft_commit::{step, NLMSG_HDRLEN};
use crate::{
    emit::{
        field, header_of, ids, inflight_add, inflight_any, inflight_in_slot, kread, now, reserve,
        syscall_arg, wake_flags,
    },
    NFT_MUTEX_CONFIG, NFT_SEND_INFLIGHT, NFT_SEND_SLOTS, SEND_SLOTS,
};

#[repr(C)]
#[derive(Clone, Copy)]
pub struct SendEnter {
    pub enter_ns: u64,
    pub netns: u32,
    /// `NFT_BATCH_*`: how `counts` were made.
    pub batch: u32,
    /// As `NftEnter::counts` (additions, deletions, the sink; 32 for a 5-bit mask).
    pub counts: [u32; 32],
}

/// Whether `fd` of the current task is a `NETLINK_NETFILTER` socket; the task's netns inode.
#[inline(always)]
fn netfilter_socket(c: &NftMutexConfig, fd: u64) -> Option<u32> {
    // SAFETY: plain helper call.
    let task = unsafe { bpf_get_current_task() };
    let files: u64 = kread(task, c.task_files)?;
    let fdt: u64 = kread(files, c.files_fdt)?;
    let max: u32 = kread(fdt, c.fdt_max_fds)?;
    if fd >= u64::from(max) {
        return None;
    }
    let fds: u64 = kread(fdt, c.fdt_fd)?;
    let file: u64 = kread(fds + fd * 8, 0)?;
    if file == 0 {
        return None;
    }
    let sock: u64 = kread(file, c.file_private)?;
    if sock == 0 || kread::<u64>(sock, c.socket_file)? != file {
        return None;
    }
    let sk: u64 = kread(sock, c.socket_sk)?;
    if sk == 0
        || kread::<u16>(sk, c.sk_family)? != AF_NETLINK
        || kread::<u16>(sk, c.sk_protocol)? != NETLINK_NETFILTER
    {
        return None;
    }
    // The socket's own netns, where its batch applies (its owner may have left it since).
    let net: u64 = if c.sk_net != 0 {
        kread(sk, c.sk_net)?
    } else {
        let nsproxy: u64 = kread(task, c.task_nsproxy)?;
        kread(nsproxy, c.nsproxy_net_ns)?
    };
    kread(net, c.net_inum)
}

/// The walk's state, on the entry program's stack, for [`walk_step`]: the iovec being read
/// (`next - 1`) and the offset in it.
#[repr(C)]
struct SendWalk {
    iov: u64,
    iovlen: u64,
    next: u64,
    base: u64,
    len: u64,
    off: u64,
    e: *mut SendEnter,
    iov_size: u32,
    status: u32,
}

/// Reads a `T` of the caller's memory.
#[inline(always)]
fn uread<T>(at: u64) -> Option<T> {
    // SAFETY: bpf_probe_read_user checks the address; a bad one is an error, not a fault.
    unsafe { bpf_probe_read_user(at as *const T) }.ok()
}

/// The iovec at `at` in the caller's array: its base and length (`struct iovec` is
/// `{ ptr; u64 }`, userspace checked: one read).
#[inline(always)]
fn iovec(at: u64) -> Option<(u64, u64)> {
    let [base, len] = uread::<[u64; 2]>(at)?;
    Some((base, len))
}

/// The msghdr's `msg_iov` and `msg_iovlen`: one read where they are next to each other, as
/// on every 64-bit ABI.
#[inline(always)]
fn iovecs(c: &NftMutexConfig, msg: u64) -> Option<(u64, u64)> {
    let iov = msg + u64::from(c.msghdr_iov);
    if c.msghdr_iovlen == c.msghdr_iov + 8 {
        let [iov, iovlen] = uread::<[u64; 2]>(iov)?;
        return Some((iov, iovlen));
    }
    Some((uread(iov)?, uread(msg + u64::from(c.msghdr_iovlen))?))
}

/// One message of the walk, or a move to the next iovec, called by `bpf_loop`: 0 goes on,
/// 1 stops (`status` says why).
extern "C" fn walk_step(_i: u32, ctx: *mut c_void) -> c_long {
    // SAFETY: `ctx` is the `SendWalk` that `walk` passed to bpf_loop, and `e` the map value
    // `enter` got for this thread, alive for the whole call.
    let w = unsafe { &mut *(ctx as *mut SendWalk) };
    if w.off + u64::from(NLMSG_HDRLEN) > w.len {
        // This iovec is done; a message that ran past its end goes on in the next.
        if w.off < w.len {
            // A header split between two iovecs: libnftnl never does that.
            w.status = NFT_BATCH_UNREADABLE;
            return 1;
        }
        if w.next >= w.iovlen {
            w.status = NFT_BATCH_COMPLETE;
            return 1;
        }
        let at = w.iov + w.next * u64::from(w.iov_size);
        let Some((base, len)) = iovec(at) else {
            w.status = NFT_BATCH_UNREADABLE;
            return 1;
        };
        w.off -= w.len;
        w.base = base;
        w.len = len;
        w.next += 1;
        return 0;
    }
    // SAFETY: as above.
    let counts = unsafe { &mut (*w.e).counts };
    match step::<true>(w.base, w.len, &mut w.off, counts) {
        Some(status) => {
            w.status = status;
            1
        }
        None => 0,
    }
}

/// Counts the batch in the caller's buffers (`msg`, a `struct user_msghdr *`) into `e`;
/// the status.
#[inline(always)]
fn walk(c: &NftMutexConfig, msg: u64, e: &mut SendEnter) -> u32 {
    if c.count_ok == 0 {
        return NFT_BATCH_NONE;
    }
    let Some((iov, iovlen)) = iovecs(c, msg) else {
        return NFT_BATCH_UNREADABLE;
    };
    if iovlen == 0 {
        return NFT_BATCH_COMPLETE;
    }
    // The first iovec is read here, not by the loop: verifiers before Linux 6.8 (Debian's
    // 6.1) follow a `bpf_loop` callback once, from the context as it is at the call, and
    // drop the branches that context rules out. Started from a constant length of 0, the
    // step that reads a message looked dead, and was removed.
    let Some((base, len)) = iovec(iov) else {
        return NFT_BATCH_UNREADABLE;
    };
    let mut w = SendWalk {
        iov,
        iovlen,
        next: 1,
        base,
        len,
        off: 0,
        e: e as *mut SendEnter,
        iov_size: c.iovec_size,
        status: 0,
    };
    // SAFETY: a helper call; the callback and its context live for the call.
    let n = unsafe {
        bpf_loop(
            NFT_BATCH_LOOP_MSGS,
            walk_step as *mut c_void,
            &mut w as *mut SendWalk as *mut c_void,
            0,
        )
    };
    if n < 0 {
        return NFT_BATCH_UNREADABLE;
    }
    match w.status {
        0 if w.off + u64::from(NLMSG_HDRLEN) > w.len && w.next >= w.iovlen => NFT_BATCH_COMPLETE,
        0 => NFT_BATCH_PARTIAL,
        s => s,
    }
}

/// A call of `NFT_SEND_SLOTS`: its owner (0: free) and the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SendSlot {
    pub tid: u64,
    pub enter: SendEnter,
}

/// The slot of `tid`, claimed for it: free (or its own, an exit it never saw) when the
/// compare-and-swap looked. `None` when another thread owns it.
#[inline(always)]
fn claim(tid: u32) -> Option<*mut SendSlot> {
    let s = NFT_SEND_SLOTS.get_ptr_mut(tid & (SEND_SLOTS - 1))?;
    // SAFETY: an entry of the array, valid for the program's run; the compare-and-swap is
    // atomic, as two CPUs' threads may share a slot. Fully ordered: no store of this call
    // is seen before the claim, nor the previous owner's release after it.
    #[cfg(target_arch = "bpf")]
    let prev = unsafe {
        core::intrinsics::atomic_cxchg::<
            u64,
            { core::intrinsics::AtomicOrdering::SeqCst },
            { core::intrinsics::AtomicOrdering::SeqCst },
        >(&raw mut (*s).tid, 0, u64::from(tid))
        .0
    };
    // A host build (type checks only; never loaded): the same, atomically.
    #[cfg(not(target_arch = "bpf"))]
    // SAFETY: as above.
    let prev = unsafe { core::sync::atomic::AtomicU64::from_ptr(&raw mut (*s).tid) }
        .compare_exchange(
            0,
            u64::from(tid),
            core::sync::atomic::Ordering::SeqCst,
            core::sync::atomic::Ordering::SeqCst,
        )
        .unwrap_or_else(|v| v);
    (prev == 0 || prev == u64::from(tid)).then_some(s)
}

/// A `sendmsg(fd, msg, ...)` begins: kept when `fd` is a `NETLINK_NETFILTER` socket, its
/// batch counted first when `msg` is given (the `bpf_loop` program). `SLOTS`: kept in the
/// thread's slot of `NFT_SEND_SLOTS` when it can claim it (the compare-and-swap needs
/// Linux 5.12: the `bpf_loop` program only), else in `NFT_SEND_INFLIGHT`.
#[inline(always)]
fn enter<const SLOTS: bool>(fd: Option<u64>, msg: Option<u64>) {
    let Some(c) = NFT_MUTEX_CONFIG.get(0) else {
        return;
    };
    if c.send_ok == 0 {
        return;
    }
    let Some(fd) = fd else {
        return;
    };
    let Some(netns) = netfilter_socket(c, fd) else {
        return;
    };
    let (_, tid) = ids();
    let e: *mut SendEnter = match SLOTS.then(|| claim(tid)).flatten() {
        // SAFETY: our own slot, just claimed: no other thread writes it until we give it
        // back at exit.
        Some(s) => unsafe { &raw mut (*s).enter },
        None => {
            let zero = SendEnter {
                // Set again after the walk; a call kept here is never sent without it.
                enter_ns: now(),
                netns: 0,
                batch: NFT_BATCH_NONE,
                counts: [0; 32],
            };
            if NFT_SEND_INFLIGHT.insert(&tid, &zero, 0).is_err() {
                return;
            }
            inflight_add(tid, 1);
            match NFT_SEND_INFLIGHT.get_ptr_mut(&tid) {
                Some(e) => e,
                None => return,
            }
        }
    };
    // SAFETY: our own thread's entry (slot or hash), just claimed or inserted; nothing else
    // writes it.
    let e = unsafe { &mut *e };
    e.netns = netns;
    e.counts = [0; 32];
    e.batch = match msg.filter(|&m| m != 0) {
        Some(msg) => walk(c, msg, e),
        None => NFT_BATCH_NONE,
    };
    // After the walk: the call proper starts now.
    e.enter_ns = now();
}

/// The record of a call kept in `e`, returned `ret`, into the ring.
#[inline(always)]
fn send(e: &SendEnter, ret: i64, tgid: u32, tid: u32) {
    let Some(mut r) = reserve::<NftSendEvent>() else {
        return;
    };
    let p = r.as_mut_ptr();
    // SAFETY: the reservation is ours and as big as the record; every field is written
    // before it is submitted.
    unsafe {
        (*p).hdr = header_of(EventKind::NftSend, now(), tgid, tid);
        (*p).enter_ns = e.enter_ns;
        (*p).netns = e.netns;
        (*p).ret = ret as i32;
        (*p).comm = bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]);
        (*p).batch = e.batch;
        (*p)._pad = 0;
        copy_nonoverlapping(e.counts.as_ptr(), (*p).added.as_mut_ptr(), NFT_KINDS);
        copy_nonoverlapping(
            e.counts.as_ptr().add(NFT_KINDS),
            (*p).deleted.as_mut_ptr(),
            NFT_KINDS,
        );
    }
    r.submit(wake_flags::<NftSendEvent>(true));
}

/// The thread's `sendmsg()` returned `ret`: its batch, if its entry was kept. Every
/// `sendmsg()` of the node returns here: its thread's slot says first whether the call is
/// kept there, then `INFLIGHT` whether a kept call may be in the hash.
#[inline(always)]
fn exit(ret: impl FnOnce() -> i64) {
    let (tgid, tid) = ids();
    if let Some(s) = NFT_SEND_SLOTS.get_ptr_mut(tid & (SEND_SLOTS - 1)) {
        // SAFETY: an entry of the array; its owner is read once, and only the owner (this
        // thread, when it matches) writes the call.
        if unsafe { read_volatile(&raw const (*s).tid) } == u64::from(tid) {
            // SAFETY: as above.
            send(unsafe { &(*s).enter }, ret(), tgid, tid);
            // Given back after the record is submitted: the submit is a fully ordered
            // exchange, so the copy is done on every CPU before another thread's claim.
            // SAFETY: as above.
            unsafe { write_volatile(&raw mut (*s).tid, 0) };
            return;
        }
    }
    if !inflight_any() || !inflight_in_slot(tid) {
        return;
    }
    // SAFETY: read of our own thread's entry; removed right after.
    let Some(e) = (unsafe { NFT_SEND_INFLIGHT.get(&tid) }) else {
        return;
    };
    send(e, ret(), tgid, tid);
    let _ = NFT_SEND_INFLIGHT.remove(&tid);
    inflight_add(tid, -1);
}

#[tracepoint]
pub fn sys_enter_sendmsg(ctx: TracePointContext) -> u32 {
    let off = NFT_MUTEX_CONFIG.get(0).map_or(0, |c| c.send_fd as usize);
    enter::<false>(field::<u64>(&ctx, off).ok(), None);
    0
}

/// [`sys_enter_sendmsg`] with the batch counted (`bpf_loop`, Linux >= 5.17): tried first.
#[tracepoint]
pub fn sys_enter_sendmsg_loop(ctx: TracePointContext) -> u32 {
    let (fd, msg) = NFT_MUTEX_CONFIG
        .get(0)
        .map_or((0, 0), |c| (c.send_fd as usize, c.send_msg as usize));
    enter::<true>(
        field::<u64>(&ctx, fd).ok(),
        field::<u64>(&ctx, msg).ok().filter(|_| msg != 0),
    );
    0
}

#[tracepoint]
pub fn sys_exit_sendmsg(ctx: TracePointContext) -> u32 {
    exit(|| {
        NFT_MUTEX_CONFIG
            .get(0)
            .and_then(|c| field::<i64>(&ctx, c.exit_ret as usize).ok())
            .unwrap_or(0)
    });
    0
}

// The same on the syscall's function: `sendmsg(fd, msg, flags)`.

#[fentry(function = "__x64_sys_sendmsg")]
pub fn sendmsg_syscall_fentry(ctx: FEntryContext) -> u32 {
    enter::<false>(syscall_arg(ctx.arg(0), 0), None);
    0
}

#[fexit(function = "__x64_sys_sendmsg")]
pub fn sendmsg_syscall_fexit(ctx: FExitContext) -> u32 {
    exit(|| ctx.arg(1));
    0
}

#[kprobe]
pub fn sendmsg_syscall_kprobe(ctx: ProbeContext) -> u32 {
    enter::<false>(syscall_arg(ctx.arg(0).unwrap_or(0), 0), None);
    0
}

#[kretprobe]
pub fn sendmsg_syscall_kretprobe(ctx: RetProbeContext) -> u32 {
    exit(|| ctx.ret());
    0
}

/// Benchmarks only (`--bench-floor-syscalls`): an empty program in place of the `sendmsg()`
/// and `getsockopt()` tracepoint programs, the floor of what an nf_tables transaction runs
/// on a node where neither the syscalls' functions nor `nft_commit` can be hooked.
#[tracepoint]
pub fn syscall_floor(_ctx: TracePointContext) -> u32 {
    0
}
