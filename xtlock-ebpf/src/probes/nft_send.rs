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
//! As the other syscall hooks, on the syscall's function (fentry, else kprobe) where it
//! attaches: an enabled syscall tracepoint puts every syscall of the node on the
//! syscall-tracing path; the tracepoints are the fallback.
use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_task},
    macros::{fentry, fexit, kprobe, kretprobe, tracepoint},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext, TracePointContext},
};
use xtlock_common::{EventKind, NftSendEvent, AF_NETLINK, COMM_LEN, NETLINK_NETFILTER};

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
    pub _pad: u32,
}

/// Whether `fd` of the current task is a `NETLINK_NETFILTER` socket; the task's netns inode.
#[inline(always)]
fn netfilter_socket(c: &xtlock_common::NftMutexConfig, fd: u64) -> Option<u32> {
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

/// A `sendmsg(fd, ...)` begins: kept when `fd` is a `NETLINK_NETFILTER` socket.
#[inline(always)]
fn enter(fd: Option<u64>) {
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
    let e = SendEnter {
        enter_ns: now(),
        netns,
        _pad: 0,
    };
    if NFT_SEND_INFLIGHT.insert(&tid, &e, 0).is_ok() {
        inflight_add(tid, 1);
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
    let Some(e) = (unsafe { NFT_SEND_INFLIGHT.get(&tid) }).copied() else {
        return;
    };
    let _ = NFT_SEND_INFLIGHT.remove(&tid);
    inflight_add(tid, -1);
    let ret = ret();
    let ev = NftSendEvent {
        hdr: header(EventKind::NftSend, now()),
        enter_ns: e.enter_ns,
        netns: e.netns,
        ret: ret as i32,
        comm: bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]),
    };
    output(&ev);
}

#[tracepoint]
pub fn sys_enter_sendmsg(ctx: TracePointContext) -> u32 {
    let off = NFT_MUTEX_CONFIG.get(0).map_or(0, |c| c.send_fd as usize);
    enter(field::<u64>(&ctx, off).ok());
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
    enter(syscall_arg(ctx.arg(0), 0));
    0
}

#[fexit(function = "__x64_sys_sendmsg")]
pub fn sendmsg_syscall_fexit(ctx: FExitContext) -> u32 {
    exit(|| ctx.arg(1));
    0
}

#[kprobe]
pub fn sendmsg_syscall_kprobe(ctx: ProbeContext) -> u32 {
    enter(syscall_arg(ctx.arg(0).unwrap_or(0), 0));
    0
}

#[kretprobe]
pub fn sendmsg_syscall_kretprobe(ctx: RetProbeContext) -> u32 {
    exit(|| ctx.ret());
    0
}
