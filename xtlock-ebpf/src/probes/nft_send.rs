//! nf_tables batches timed from their `sendmsg()`: nft and iptables-nft send each batch
//! with one `sendmsg()` on a `NETLINK_NETFILTER` socket (their reads go with `sendto()`),
//! and the kernel processes it in that call (`netlink_unicast` -> `nfnetlink_rcv_batch`),
//! holding the netns's commit mutex from the batch's start to its commit. Where no hook on
//! `nfnetlink_rcv_batch` attaches (`nft_commit`: fentry or kprobes), this is the hold's
//! time, less what the call waited for the mutexes (the analysis takes that off).
//!
//! The socket is recognised from the descriptor: `current->files->fdt->fd[fd]`, its
//! `private_data` a `struct socket` that points back to the file, whose `sock` is
//! `AF_NETLINK` with protocol `NETLINK_NETFILTER`. Offsets from BTF. The exit tracepoint is
//! attached first, so every entry the enter program keeps gets its exit (the function
//! hooks attach as a pair, microseconds apart).
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
        field, header, ids, inflight_add, inflight_any, inflight_in_slot, kread, now, output,
        syscall_arg,
    },
    NFT_MUTEX_CONFIG, NFT_SEND_INFLIGHT,
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
    let nsproxy: u64 = kread(task, c.task_nsproxy)?;
    let net: u64 = kread(nsproxy, c.nsproxy_net_ns)?;
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
    iov_base: u32,
    iov_len: u32,
    iov_size: u32,
    status: u32,
}

/// Reads a `T` of the caller's memory.
#[inline(always)]
fn uread<T>(at: u64) -> Option<T> {
    // SAFETY: bpf_probe_read_user checks the address; a bad one is an error, not a fault.
    unsafe { bpf_probe_read_user(at as *const T) }.ok()
}

/// The iovec at `at` in the caller's array: its base and length.
#[inline(always)]
fn iovec(at: u64, base_off: u32, len_off: u32) -> Option<(u64, u64)> {
    Some((
        uread::<u64>(at + u64::from(base_off))?,
        uread::<u64>(at + u64::from(len_off))?,
    ))
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
        let Some((base, len)) = iovec(at, w.iov_base, w.iov_len) else {
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
    let (Some(iov), Some(iovlen)) = (
        uread::<u64>(msg + u64::from(c.msghdr_iov)),
        uread::<u64>(msg + u64::from(c.msghdr_iovlen)),
    ) else {
        return NFT_BATCH_UNREADABLE;
    };
    if iovlen == 0 {
        return NFT_BATCH_COMPLETE;
    }
    // The first iovec is read here, not by the loop: verifiers before Linux 6.8 (Debian's
    // 6.1) follow a `bpf_loop` callback once, from the context as it is at the call, and
    // drop the branches that context rules out. Started from a constant length of 0, the
    // step that reads a message looked dead, and was removed.
    let Some((base, len)) = iovec(iov, c.iovec_base, c.iovec_len) else {
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
        iov_base: c.iovec_base,
        iov_len: c.iovec_len,
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

/// A `sendmsg(fd, msg, ...)` begins: kept when `fd` is a `NETLINK_NETFILTER` socket, its
/// batch counted first when `msg` is given (the `bpf_loop` program).
#[inline(always)]
fn enter(fd: Option<u64>, msg: Option<u64>) {
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
    let zero = SendEnter {
        enter_ns: now(),
        netns,
        batch: NFT_BATCH_NONE,
        counts: [0; 32],
    };
    if NFT_SEND_INFLIGHT.insert(&tid, &zero, 0).is_err() {
        return;
    }
    inflight_add(tid, 1);
    if let Some(msg) = msg.filter(|&m| m != 0) {
        let Some(e) = NFT_SEND_INFLIGHT.get_ptr_mut(&tid) else {
            return;
        };
        // SAFETY: our own thread's entry, just inserted; nothing else writes it.
        let e = unsafe { &mut *e };
        e.batch = walk(c, msg, e);
        // After the walk: the call proper starts now.
        e.enter_ns = now();
    }
}

/// The thread's `sendmsg()` returned `ret`: its batch, if its entry was kept. Every
/// `sendmsg()` of the node returns here: its thread's slot of `INFLIGHT` says first whether
/// a kept call may be its own.
#[inline(always)]
fn exit(ret: impl FnOnce() -> i64) {
    if !inflight_any() {
        return;
    }
    let (_, tid) = ids();
    if !inflight_in_slot(tid) {
        return;
    }
    // SAFETY: read of our own thread's entry; removed right after.
    let Some(e) = (unsafe { NFT_SEND_INFLIGHT.get(&tid) }) else {
        return;
    };
    let mut added = [0u32; NFT_KINDS];
    let mut deleted = [0u32; NFT_KINDS];
    added.copy_from_slice(&e.counts[..NFT_KINDS]);
    deleted.copy_from_slice(&e.counts[NFT_KINDS..2 * NFT_KINDS]);
    let ev = NftSendEvent {
        hdr: header(EventKind::NftSend, now()),
        enter_ns: e.enter_ns,
        netns: e.netns,
        ret: ret() as i32,
        comm: bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]),
        batch: e.batch,
        _pad: 0,
        added,
        deleted,
    };
    let _ = NFT_SEND_INFLIGHT.remove(&tid);
    inflight_add(tid, -1);
    output(&ev);
}

#[tracepoint]
pub fn sys_enter_sendmsg(ctx: TracePointContext) -> u32 {
    let off = NFT_MUTEX_CONFIG.get(0).map_or(0, |c| c.send_fd as usize);
    enter(field::<u64>(&ctx, off).ok(), None);
    0
}

/// [`sys_enter_sendmsg`] with the batch counted (`bpf_loop`, Linux >= 5.17): tried first.
#[tracepoint]
pub fn sys_enter_sendmsg_loop(ctx: TracePointContext) -> u32 {
    let (fd, msg) = NFT_MUTEX_CONFIG
        .get(0)
        .map_or((0, 0), |c| (c.send_fd as usize, c.send_msg as usize));
    enter(
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
    enter(syscall_arg(ctx.arg(0), 0), None);
    0
}

#[fexit(function = "__x64_sys_sendmsg")]
pub fn sendmsg_syscall_fexit(ctx: FExitContext) -> u32 {
    exit(|| ctx.arg(1));
    0
}

#[kprobe]
pub fn sendmsg_syscall_kprobe(ctx: ProbeContext) -> u32 {
    enter(syscall_arg(ctx.arg(0).unwrap_or(0), 0), None);
    0
}

#[kretprobe]
pub fn sendmsg_syscall_kretprobe(ctx: RetProbeContext) -> u32 {
    exit(|| ctx.ret());
    0
}
