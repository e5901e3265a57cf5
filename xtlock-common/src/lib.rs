//! Event types and configuration shared by the BPF programs (`xtlock-ebpf`) and the
//! userspace collector (`xtlock`). This crate is the only definition of each event: both
//! sides import it, nothing else is shared.
//!
//! Every event is `#[repr(C)]`, `Copy`, and starts with an [`EventHeader`] (kind tag and
//! kernel `CLOCK_MONOTONIC` timestamp), so the decoder can dispatch on the first four bytes.
#![no_std]

/// Length of a task's `comm` in the kernel (`TASK_COMM_LEN`).
pub const COMM_LEN: usize = 16;
/// Bytes of the exec'd filename kept by the exec probe.
pub const FILENAME_LEN: usize = 128;
/// How many argv entries the exec probe reads in the kernel.
pub const ARGV_SLOTS: usize = 8;
/// Bytes kept of each argv entry.
pub const ARG_LEN: usize = 64;
/// Most lock files one tracer can watch at once (a power of two: the programs mask indexes
/// with it).
pub const MAX_WATCHED_LOCKS: u32 = 16;
/// Slots of the inode pre-filter: slot `ino % WATCHED_INO_SLOTS` is set for each watched
/// inode (a power of two).
pub const WATCHED_INO_SLOTS: u32 = 4096;
/// Slots of the drop-reason filter: reason `r` uses slot `min(r, DROP_REASON_SLOTS - 1)`, so
/// the last slot stands for every larger reason (other subsystems' reasons carry high bits).
pub const DROP_REASON_SLOTS: u32 = 1024;
/// Words of `ProbeConfig::drop_watch`: reasons below [`DROP_WATCH_BITS`] are filtered by
/// its bits, the others by the `DROP_REASONS` map.
pub const DROP_WATCH_WORDS: usize = 8;
pub const DROP_WATCH_BITS: u32 = DROP_WATCH_WORDS as u32 * 32;
/// Distinct (reason, location, netns) keys the in-kernel drop counters hold; drops of keys
/// beyond it are still counted, in one overflow counter.
pub const MAX_DROP_KEYS: u32 = 16384;
/// Slots of the per-CPU drop counters of holds (`HOLD_DROPS`): hold number `seq` counts in
/// slot `seq % HOLD_DROP_SLOTS`, which is reused that many holds later, long after userspace
/// (reading every second) took its count.
pub const HOLD_DROP_SLOTS: u32 = 1024;

/// `fl_type` values of the `filelock` tracepoints.
pub const F_RDLCK: u8 = 0;
pub const F_WRLCK: u8 = 1;
pub const F_UNLCK: u8 = 2;
/// `fl_flags` bit set by `flock()` unless `LOCK_NB` was given.
pub const FL_SLEEP: u32 = 128;
/// Return value of `flock_lock_inode` when the caller must sleep and retry.
pub const FILE_LOCK_DEFERRED: i32 = 1;
/// `flock()` operation bits.
pub const LOCK_SH: u32 = 1;
pub const LOCK_EX: u32 = 2;
pub const LOCK_NB: u32 = 4;
pub const LOCK_UN: u32 = 8;

/// Socket levels and option names that replace or update a legacy xtables table.
pub const SOL_IP: u32 = 0;
pub const SOL_IPV6: u32 = 41;
/// Netfilter's protocol families (`nf_getsockopt`'s and `nf_setsockopt`'s `pf`): the
/// socket level the same call has at the syscall is `SOL_IP` for all but IPv6.
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_ARP: u8 = 3;
pub const NFPROTO_BRIDGE: u8 = 7;
pub const NFPROTO_IPV6: u8 = 10;
/// `IPT_SO_SET_REPLACE` / `IP6T_SO_SET_REPLACE` / `ARPT_SO_SET_REPLACE` (all 64).
pub const XT_SO_SET_REPLACE: u32 = 64;
/// `IPT_SO_SET_ADD_COUNTERS` and its ip6t/arpt twins (all 65).
pub const XT_SO_SET_ADD_COUNTERS: u32 = 65;
/// `EBT_SO_SET_ENTRIES` / `EBT_SO_SET_COUNTERS` (ebtables, also at `SOL_IP`).
pub const EBT_SO_SET_ENTRIES: u32 = 128;
/// `IPT_SO_GET_INFO` / `IPT_SO_GET_ENTRIES` (and ip6t's): a table read, at `getsockopt`.
/// Same numbers as the set options: the syscall tells them apart.
pub const XT_SO_GET_INFO: u32 = 64;
pub const XT_SO_GET_ENTRIES: u32 = 65;
/// Offsets in `struct ipt_getinfo` (and `ip6t_getinfo`: both have 5 hooks) of
/// `num_entries` and `size`, which the kernel fills in.
pub const XT_GETINFO_NUM_ENTRIES: u64 = 76;
pub const EBT_SO_SET_COUNTERS: u32 = 129;

/// Kind tag at the start of every event.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// `filelock:flock_lock_inode` on a watched lock file.
    Lock = 1,
    /// A blocking `flock()` on a watched lock file has stopped waiting.
    FlockCall = 2,
    /// `sched:sched_process_exec`, with argv read at `execve` entry.
    Exec = 3,
    /// `sched:sched_process_fork` (processes and threads alike).
    Fork = 4,
    /// `sched:sched_process_exit`, with the `exit_group` status when there was one.
    Exit = 5,
    /// A legacy xtables table replace / counter update through `setsockopt`.
    TableReplace = 6,
    /// `skb:kfree_skb`: one sampled packet drop (rate limited; counts are kept apart).
    Drop = 7,
    /// An nf_tables commit (`nfnetlink_rcv_batch` or `nf_tables_commit`), seen at its return:
    /// the serialisation point of nft, iptables-nft, kube-proxy's nftables mode, firewalld.
    NftCommit = 8,
    /// Conntrack refused a new connection, seen in the kernel function that refused it:
    /// `__nf_conntrack_confirm` returned `NF_DROP` (its `insert_failed` path), or
    /// `__nf_conntrack_alloc` failed (table full).
    ConntrackFail = 9,
    /// `xt_replace_table` returned: a legacy table swapped in, and every CPU waited out of
    /// the old one (the kernel's part of a table replace).
    XtReplace = 10,
    /// IPVS: a connection scheduled, a packet on a stale connection, a stale connection's
    /// entry expired, or a real-server table change (`IpvsEvent::op`).
    Ipvs = 11,
    /// One sampled refusal with the refused connection's addresses (rate limited; the
    /// exact counts travel separately, per `RefusalKey`).
    Refusal = 12,
    /// A whole exclusive hold in one record: the take, kept in the kernel (`HoldNow::take`)
    /// until its release, and the release ([`HoldEvent`]). A take that something else needed
    /// first (a waiter, the holder's own table write, a sampled drop) went out as a plain
    /// `Lock` record then, and its release goes out as one too.
    Hold = 13,
    /// A `sendmsg()` on a `NETLINK_NETFILTER` socket returned: an nf_tables batch (nft and
    /// iptables-nft send each batch so, their reads with `sendto()`), which held the commit
    /// mutex for its processing ([`NftSendEvent`]).
    NftSend = 15,
    /// A wait on an nf_tables mutex (`lock:contention_begin` to `contention_end`): a
    /// network namespace's `commit_mutex`, or nfnetlink's nf_tables subsystem mutex that a
    /// batch holds while it waits for the commit mutex ([`NftMutexWaitEvent`]).
    NftMutexWait = 14,
}

impl EventKind {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::Lock,
            2 => Self::FlockCall,
            3 => Self::Exec,
            4 => Self::Fork,
            5 => Self::Exit,
            6 => Self::TableReplace,
            7 => Self::Drop,
            8 => Self::NftCommit,
            9 => Self::ConntrackFail,
            10 => Self::XtReplace,
            11 => Self::Ipvs,
            12 => Self::Refusal,
            13 => Self::Hold,
            14 => Self::NftMutexWait,
            15 => Self::NftSend,
            _ => return None,
        })
    }
}

/// Leading part of every event.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    /// An [`EventKind`] as `u32`.
    pub kind: u32,
    /// Process id (thread-group id) of the task that produced the event.
    pub tgid: u32,
    /// Thread id of that task.
    pub tid: u32,
    pub _pad: u32,
    /// `bpf_ktime_get_ns()`: `CLOCK_MONOTONIC`, nanoseconds.
    pub ts_ns: u64,
}

/// One call of `flock_lock_inode` on a watched lock: a take, a failed try, a deferral
/// (the caller will sleep) or a release (`F_UNLCK`, also on `close()` and exit).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockEvent {
    pub hdr: EventHeader,
    /// `fl_owner`: the open file description that owns the lock. Forked children share it.
    pub owner: u64,
    pub ino: u64,
    /// Device in the kernel's encoding (`major << 20 | minor`).
    pub dev: u32,
    /// 0, `FILE_LOCK_DEFERRED` or a negative errno.
    pub ret: i32,
    pub fl_flags: u32,
    /// `F_RDLCK`, `F_WRLCK` or `F_UNLCK`.
    pub fl_type: u8,
    pub _pad: [u8; 3],
    pub comm: [u8; COMM_LEN],
}

/// An exclusive hold of a watched lock, taken and released, in one record: half the ring
/// traffic of a `Lock` record each. The release's owner, inode and device are the take's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldEvent {
    /// The release: kind `Hold`, the releasing task, the release's time.
    pub hdr: EventHeader,
    /// The take, exactly as it would have gone out as a `Lock` record.
    pub take: LockEvent,
    /// The release's `ret` and `fl_flags` (its `fl_type` is `F_UNLCK`).
    pub ret: i32,
    pub fl_flags: u32,
    /// The releasing task's comm.
    pub comm: [u8; COMM_LEN],
}

/// How a blocking `flock()` on a watched lock that was deferred (had to wait) ended: the
/// retry that took the lock (or failed), or the signal that interrupted it (`-EINTR`).
/// Calls that did not wait send no such event: their [`LockEvent`] says it all.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlockCallEvent {
    /// `ts_ns`: the end of the wait (the syscall exit in captures of earlier builds).
    pub hdr: EventHeader,
    /// The first deferral: when the wait began (captures of earlier builds hold the
    /// syscall entry here, under a microsecond earlier).
    pub enter_ns: u64,
    pub owner: u64,
    pub ino: u64,
    /// What `flock()` returns: 0, or a negative errno (`-EINTR` when a signal ended it).
    pub ret: i64,
    /// The `flock()` operation (`LOCK_EX | LOCK_NB`, ...), from the lock request's type and
    /// `FL_SLEEP`; `u32::MAX` when unknown.
    pub cmd: u32,
    pub dev: u32,
}

/// A successful `execve`/`execveat`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecEvent {
    pub hdr: EventHeader,
    /// NUL-terminated, truncated to `FILENAME_LEN`.
    pub filename: [u8; FILENAME_LEN],
    /// The first `ARGV_SLOTS` argv entries, each NUL-terminated and truncated to `ARG_LEN`.
    pub args: [[u8; ARG_LEN]; ARGV_SLOTS],
    /// argv entries read (at most `ARGV_SLOTS`).
    pub argc: u32,
    /// Non-zero when argv had more entries than `ARGV_SLOTS`.
    pub args_truncated: u32,
    pub comm: [u8; COMM_LEN],
    /// Appended: the inode of the network namespace the new program runs in (0 unknown).
    /// Records of older versions end before it (`EXEC_V1_LEN` bytes).
    pub netns: u32,
    pub _pad: u32,
}

/// An `ExecEvent` of versions before `netns` was appended.
pub const EXEC_V1_LEN: usize = 688;

/// A new task. `hdr.tgid`/`hdr.tid` are the parent's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkEvent {
    pub hdr: EventHeader,
    /// The new task's id (a process, or a thread of the parent).
    pub child_tid: u32,
    pub _pad: u32,
    pub comm: [u8; COMM_LEN],
}

/// A task ends. Emitted for threads too; `hdr.tid == hdr.tgid` for the leader.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitEvent {
    pub hdr: EventHeader,
    /// The `exit_group()`/`exit()` argument when `has_code != 0`.
    pub exit_code: i32,
    /// 0 when the task ended without calling exit (killed by a signal, usually).
    pub has_code: u32,
    pub comm: [u8; COMM_LEN],
}

/// A `setsockopt()` that replaced an xtables table or its counters, seen at its return.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableReplaceEvent {
    /// `ts_ns` is the syscall exit.
    pub hdr: EventHeader,
    pub enter_ns: u64,
    pub ret: i64,
    pub level: u32,
    pub optname: u32,
    pub optlen: u32,
    pub _pad: u32,
    // Appended: records of older versions end here (`TABLE_REPLACE_V1_LEN` bytes).
    /// The head of the caller's argument, read at entry: the table name, and for a replace
    /// its entry count and size in bytes (`ipt_replace`, `ip6t_replace`, `arpt_replace` and
    /// `ebt_replace` start alike); for `*_SO_SET_ADD_COUNTERS`, the counter count in
    /// `num_entries`. All zero with `head_ok == 0` when the read failed (bad pointer,
    /// paged-out memory) or the option has no such head.
    pub table: [u8; XT_TABLE_MAXNAMELEN],
    pub num_entries: u32,
    pub size: u32,
    pub head_ok: u32,
    /// 0: a `setsockopt` (replace, counters); [`SOCKOPT_GET`]: a `getsockopt` table read
    /// (`num_entries` and `size` of `*_SO_GET_INFO` as the kernel answered, `size` of
    /// `*_SO_GET_ENTRIES` as asked). Records of versions before the reads have 0 here.
    pub dir: u32,
    // Appended: records of older versions end here (`TABLE_REPLACE_V2_LEN` bytes).
    /// Inode of the calling task's network namespace (whose tables it wrote); 0 when unknown.
    pub netns: u32,
    pub _pad2: u32,
}

pub const SOCKOPT_GET: u32 = 1;

/// Length of a [`TableReplaceEvent`] as versions before the table head wrote it.
pub const TABLE_REPLACE_V1_LEN: usize = 56;
/// ...and as versions before the netns wrote it.
pub const TABLE_REPLACE_V2_LEN: usize = 104;
/// `XT_TABLE_MAXNAMELEN` (and `EBT_TABLE_MAXNAMELEN`).
pub const XT_TABLE_MAXNAMELEN: usize = 32;

/// One nf_tables commit (a netlink batch), seen at its return. `hdr` is the sending task.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NftCommitEvent {
    /// `ts_ns` is the function's return.
    pub hdr: EventHeader,
    pub enter_ns: u64,
    /// Inode of the sending task's network namespace; 0 when unknown.
    pub netns: u32,
    /// How the batch's messages were counted: `NFT_BATCH_*` (always 0, "not counted", in
    /// the padding it replaces).
    pub batch: u32,
    pub comm: [u8; COMM_LEN],
    // Appended: records of older versions end here (`NFT_COMMIT_V1_LEN` bytes).
    /// The batch's messages per object kind (`NFT_KIND_*`): additions (`NFT_MSG_NEW*`) and
    /// deletions (`NFT_MSG_DEL*`, `NFT_MSG_DESTROY*`).
    pub added: [u32; NFT_KINDS],
    pub deleted: [u32; NFT_KINDS],
}

/// Length of an [`NftCommitEvent`] as versions before the batch counts wrote it.
pub const NFT_COMMIT_V1_LEN: usize = 56;

/// [`NftCommitEvent::batch`]: not counted (offsets unknown, or an older version).
pub const NFT_BATCH_NONE: u32 = 0;
/// Every message of the batch counted.
pub const NFT_BATCH_COMPLETE: u32 = 1;
/// Only the first [`NFT_BATCH_MAX_MSGS`] (or [`NFT_BATCH_LOOP_MSGS`]) messages counted.
pub const NFT_BATCH_PARTIAL: u32 = 2;
/// The batch could not be read (a read failed, or a malformed message header).
pub const NFT_BATCH_UNREADABLE: u32 = 3;
/// Messages of one batch the commit hook walks at most with a bounded loop (every verifier
/// follows each iteration: the bound is what 5.10 accepts).
pub const NFT_BATCH_MAX_MSGS: u32 = 1024;
/// Messages of one batch the commit hook walks at most with `bpf_loop` (Linux >= 5.17),
/// which verifies the loop's body once.
pub const NFT_BATCH_LOOP_MSGS: u32 = 1 << 20;

/// Object kinds of nf_tables batch messages, in [`NftCommitEvent::added`] order.
pub const NFT_KINDS: usize = 8;
pub const NFT_KIND_NAMES: [&str; NFT_KINDS] = [
    "tables",
    "chains",
    "rules",
    "sets",
    "elements",
    "objects",
    "flowtables",
    "other",
];
/// `NFNL_SUBSYS_NFTABLES`: the high byte of an nf_tables message's `nlmsg_type`.
pub const NFNL_SUBSYS_NFTABLES: u32 = 10;
/// `NFNL_MSG_BATCH_END`: the last message of a batch.
pub const NFNL_MSG_BATCH_END: u32 = 0x11;

/// An nf_tables message type (`nlmsg_type & 0xff`, `enum nf_tables_msg_types`) as
/// (kind index, deletion), `None` for one that changes nothing (a get). Evaluated at compile
/// time into [`nft_msg_slots`], the table the BPF walk reads.
pub const fn nft_msg_kind(msg: u32) -> Option<(usize, bool)> {
    Some(match msg {
        0 => (0, false),                                                  // NEWTABLE
        2 | 26 => (0, true),                                              // DELTABLE, DESTROYTABLE
        3 => (1, false),                                                  // NEWCHAIN
        5 | 27 => (1, true),                                              // DELCHAIN, DESTROYCHAIN
        6 => (2, false),                                                  // NEWRULE
        8 | 28 => (2, true),                                              // DELRULE, DESTROYRULE
        9 => (3, false),                                                  // NEWSET
        11 | 29 => (3, true),                                             // DELSET, DESTROYSET
        12 => (4, false),                                                 // NEWSETELEM
        14 | 30 => (4, true), // DELSETELEM, DESTROYSETELEM
        18 => (5, false),     // NEWOBJ
        20 | 31 => (5, true), // DELOBJ, DESTROYOBJ
        22 => (6, false),     // NEWFLOWTABLE
        24 | 32 => (6, true), // DELFLOWTABLE, DESTROYFLOWTABLE
        1 | 4 | 7 | 10 | 13 | 16 | 19 | 21 | 23 | 25 | 33 => return None, // gets
        _ => (7, false),
    })
}

/// Counter slot of each message type, indexed by `nlmsg_type & 0xfff` (the subsystem's low
/// nibble, then the message): for an nf_tables message (subsystem 10), the kind for an
/// addition, `NFT_KINDS` + the kind for a deletion; [`NFT_SLOT_NONE`] for a get and for
/// any other subsystem's message. The BPF walk looks a type up here instead of branching on
/// it: a loop of a thousand messages must stay within what every verifier follows.
pub const fn nft_msg_slots() -> [u8; 4096] {
    let mut t = [NFT_SLOT_NONE; 4096];
    let mut m = 0;
    while m < 256 {
        t[(NFNL_SUBSYS_NFTABLES as usize) << 8 | m] = match nft_msg_kind(m as u32) {
            Some((k, false)) => k as u8,
            Some((k, true)) => (NFT_KINDS + k) as u8,
            None => NFT_SLOT_NONE,
        };
        m += 1;
    }
    t
}
/// The slot of a message that changes nothing: counted nowhere.
pub const NFT_SLOT_NONE: u8 = 2 * NFT_KINDS as u8;

/// Where the nf_tables commit hook finds the batch, written by userspace when the hook
/// attaches (nf_tables may load after start, and the argument depends on the function
/// chosen). Offsets in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NftConfig {
    /// Non-zero when the batch can be walked: the fields below were found.
    pub ok: u32,
    /// Which argument of the hooked function is the batch's `struct sk_buff *`.
    pub skb_arg: u32,
    /// `sk_buff.data`, `sk_buff.len`.
    pub skb_data: u32,
    pub skb_len: u32,
}

/// [`NftMutexWaitEvent::mutex`]: a network namespace's nf_tables `commit_mutex`.
pub const NFT_MUTEX_COMMIT: u32 = 1;
/// [`NftMutexWaitEvent::mutex`]: nfnetlink's mutex of the nf_tables subsystem
/// (`nfnl_lock(NFNL_SUBSYS_NFTABLES)`), one for the whole node: `nfnetlink_rcv_batch` holds
/// it until the batch has the commit mutex, so batches of every netns queue on it.
pub const NFT_MUTEX_NFNL: u32 = 2;

/// One `sendmsg()` on a `NETLINK_NETFILTER` socket, seen at its return (`hdr.ts_ns`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NftSendEvent {
    pub hdr: EventHeader,
    pub enter_ns: u64,
    /// Inode of the sender's network namespace; 0 when unknown.
    pub netns: u32,
    /// The syscall's return, truncated to 32 bits (bytes sent, or `-errno`).
    pub ret: i32,
    pub comm: [u8; COMM_LEN],
    // Appended: records of older versions end here (`NFT_SEND_V1_LEN` bytes).
    /// How the batch's messages were counted from the caller's buffers: `NFT_BATCH_*`
    /// (`NFT_BATCH_NONE` where the kernel has no `bpf_loop`, or the offsets are unknown).
    pub batch: u32,
    pub _pad: u32,
    /// The batch's messages per object kind, as [`NftCommitEvent::added`] and `deleted`.
    pub added: [u32; NFT_KINDS],
    pub deleted: [u32; NFT_KINDS],
}

/// Length of an [`NftSendEvent`] as versions before the batch counts wrote it.
pub const NFT_SEND_V1_LEN: usize = 56;

/// `AF_NETLINK`, `NETLINK_NETFILTER`.
pub const AF_NETLINK: u16 = 16;
pub const NETLINK_NETFILTER: u16 = 12;

/// Where a syscall's first and second arguments sit in its `sys_enter_*` record on every
/// kernel so far (the common fields, `__syscall_nr` and its padding, then 8 bytes an
/// argument). The socket-option entry programs whose names end in `_std` read them there
/// and no configuration, attached only where the format file says so.
pub const SYS_ENTER_ARG1: u32 = 24;
pub const SYS_ENTER_ARG2: u32 = 32;

/// `lock:contention_begin` flags (`LCB_F_*`, include/trace/events/lock.h).
pub const LCB_F_SPIN: u32 = 1 << 0;
pub const LCB_F_MUTEX: u32 = 1 << 5;

/// One wait on an nf_tables mutex, sent at its `contention_end`. `hdr` is the waiter and
/// the end; the holder is the mutex's owner at the wait's first `contention_begin`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NftMutexWaitEvent {
    pub hdr: EventHeader,
    /// The first `contention_begin` of the wait (a mutex waiter may begin twice: spinning,
    /// then sleeping).
    pub start_ns: u64,
    /// The mutex's address.
    pub lock: u64,
    /// Inode of the waiter's network namespace; 0 when unknown.
    pub netns: u32,
    /// [`NFT_MUTEX_COMMIT`] or [`NFT_MUTEX_NFNL`].
    pub mutex: u32,
    /// `contention_end`'s `ret` (0: acquired).
    pub ret: i32,
    /// Flags of the first `contention_begin` (`LCB_F_*`).
    pub flags: u32,
    /// The owner at the start: thread id and process id (0: free, or unreadable).
    pub holder_tid: u32,
    pub holder_tgid: u32,
    pub comm: [u8; COMM_LEN],
    pub holder_comm: [u8; COMM_LEN],
}

/// Where the nf_tables mutex hook finds what it reads, from BTF (vmlinux, or the
/// `nf_tables` module's) and kallsyms. Kept in a map, not in [`ProbeConfig`]: nf_tables may
/// load after xtlock started. Offsets in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NftMutexConfig {
    /// Non-zero once filled.
    pub ok: u32,
    /// `task_struct.nsproxy`, `nsproxy.net_ns`, `net.ns.inum`.
    pub task_nsproxy: u32,
    pub nsproxy_net_ns: u32,
    pub net_inum: u32,
    /// `net.gen`, then `net_generic.ptr` (the pernet data, by id) and `net_generic.s.len`.
    pub net_gen: u32,
    pub gen_ptr: u32,
    pub gen_len: u32,
    /// `nftables_pernet.commit_mutex`.
    pub commit_mutex: u32,
    /// `mutex.owner`: a `task_struct *` with flags in its low 3 bits.
    pub mutex_owner: u32,
    /// `task_struct.pid`, `.tgid`, `.comm`.
    pub task_pid: u32,
    pub task_tgid: u32,
    pub task_comm: u32,
    /// `task_struct.flags` (`PF_KTHREAD`: a kernel worker waits on a netns's commit mutex
    /// from the initial netns; its owner's netns says whose it is).
    pub task_flags: u32,
    /// Explicit: the struct is copied into the programs as bytes.
    pub _pad: u32,
    /// Offsets of `lock_addr`, `flags` (contention_begin) and `ret` (contention_end) in the
    /// perf tracepoints' records, from their format files (the `tp_btf` programs get them
    /// as arguments).
    pub tp_lock: u32,
    pub tp_flags: u32,
    pub tp_ret: u32,
    /// Non-zero when the offsets below were found: `sendmsg()` batches are timed.
    pub send_ok: u32,
    /// `sys_enter_sendmsg`'s `fd` and `sys_exit_sendmsg`'s `ret` (format files).
    pub send_fd: u32,
    pub exit_ret: u32,
    /// `task_struct.files`, `files_struct.fdt`, `fdtable.fd`, `fdtable.max_fds`,
    /// `file.private_data`, `socket.file`, `socket.sk`, `sock.__sk_common.skc_family`,
    /// `sock.sk_protocol` (2 bytes each, since Linux 5.6).
    pub task_files: u32,
    pub files_fdt: u32,
    pub fdt_fd: u32,
    pub fdt_max_fds: u32,
    pub file_private: u32,
    pub socket_file: u32,
    pub socket_sk: u32,
    pub sk_family: u32,
    pub sk_protocol: u32,
    /// Non-zero when the offsets below were found: the batch is counted from the caller's
    /// buffers at `sys_enter_sendmsg` (with `bpf_loop`).
    pub count_ok: u32,
    /// `sys_enter_sendmsg`'s `msg` (format file); `user_msghdr.msg_iov`, `.msg_iovlen`;
    /// `iovec.iov_base`, `.iov_len`, and the size of a `struct iovec` (BTF).
    pub send_msg: u32,
    pub msghdr_iov: u32,
    pub msghdr_iovlen: u32,
    pub iovec_base: u32,
    pub iovec_len: u32,
    pub iovec_size: u32,
    /// `sock.__sk_common.skc_net.net`: the socket's netns (0 without `CONFIG_NET_NS`: then
    /// the sender's, by `task_nsproxy`).
    pub sk_net: u32,
    /// Address of `nf_tables_net_id` (kallsyms, `CONFIG_KALLSYMS_ALL`); 0 when unknown:
    /// then the id is learned from the first wait whose stack proves it (below).
    pub net_id_addr: u64,
    /// `nf_tables_valid_genid` and `nft_rcv_nl_event` (start, end): the only mutex each
    /// takes itself is the commit mutex (a batch's start; a netlink socket's release). A wait
    /// called from one tells which pernet id points to the mutex.
    pub genid_fn: [u64; 2],
    pub release_fn: [u64; 2],
    /// `nft_trans_gc_work` (start, end): a kernel worker's only mutex there is the commit
    /// mutex of the set's netns, whose batch owns it when the worker waits (0: not in this
    /// kernel: before 6.5 and its stable backports).
    pub gc_fn: [u64; 2],
    /// `nfnetlink_rcv_batch` (start, end): the only mutex it takes itself is the nfnetlink
    /// subsystem mutex. A wait called from it tells that mutex's address.
    pub batch_fn: [u64; 2],
    /// `__sched_text_start`, `__sched_text_end`: the mutex's own functions (`mutex_lock`,
    /// `__mutex_lock`) are there; the first frame past them is the caller.
    pub sched_text: [u64; 2],
}

/// Frames of the kernel stack the mutex hook looks at to learn a mutex: the tracepoint's
/// own frames, `__mutex_lock`, then its caller.
pub const NFT_MUTEX_STACK: usize = 8;
/// Pernet ids the learning walk tries at most.
pub const NFT_MUTEX_MAX_NET_IDS: u32 = 256;

/// One `xt_replace_table` call, seen at its return (`hdr.ts_ns`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XtReplaceEvent {
    pub hdr: EventHeader,
    pub enter_ns: u64,
}

/// What a [`ConntrackFailEvent`] saw.
pub const CT_FAIL_INSERT: u8 = 1;
pub const CT_FAIL_TABLE_FULL: u8 = 2;

/// A connection conntrack refused, with the original direction's tuple.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackFailEvent {
    /// `tgid`/`tid`: the task that was running (the sender, or softirq context).
    pub hdr: EventHeader,
    /// Inode of the connection's network namespace; 0 when unknown.
    pub netns: u32,
    /// `CT_FAIL_*`.
    pub what: u8,
    pub l4proto: u8,
    /// `DROP_FAMILY_*`.
    pub family: u8,
    pub _pad0: u8,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Ports (host order) for TCP/UDP; ICMP id and type/code otherwise.
    pub sport: u16,
    pub dport: u16,
    pub _pad: u32,
    pub comm: [u8; COMM_LEN],
}

/// One refusal, sampled under a per-CPU rate limit (the drop samples' budget, kept apart),
/// with the refused packet's addresses: the client's SYN or datagram for ICMP unreachable and
/// resets sent, the reset's ends (local `saddr`, peer `daddr`) for resets received.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusalEvent {
    pub hdr: EventHeader,
    /// `RefusalKey::hold_start_ns`: the hold in progress, 0 for none.
    pub hold_start_ns: u64,
    pub netns: u32,
    /// ICMP code or reset reason; [`REFUSAL_NO_DETAIL`] when the kernel gives none.
    pub detail: u32,
    /// `REFUSAL_*`.
    pub kind: u8,
    /// `DROP_FAMILY_*` of the addresses; `DROP_FAMILY_NONE` when none could be read.
    pub family: u8,
    pub l4proto: u8,
    pub _pad: u8,
    pub sport: u16,
    pub dport: u16,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
}

/// Where the conntrack hooks find what they read, from the BTF of the module that has
/// `struct nf_conn` (or vmlinux). Kept in a map, not in [`ProbeConfig`], because nf_conntrack
/// may load after xtlock started. Offsets in bytes; the tuple's are from the tuple's start.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtConfig {
    /// Non-zero once filled.
    pub ok: u32,
    /// `sk_buff._nfct` (the conntrack pointer, low 3 bits the ctinfo).
    pub skb_nfct: u32,
    /// `nf_conn.tuplehash[IP_CT_DIR_ORIGINAL].tuple`.
    pub ct_tuple: u32,
    /// `nf_conn.ct_net.net`, then `net.ns.inum`.
    pub ct_net: u32,
    pub net_inum: u32,
    pub src_u3: u32,
    pub src_port: u32,
    pub src_l3num: u32,
    pub dst_u3: u32,
    pub dst_port: u32,
    pub dst_protonum: u32,
    pub _pad: u32,
}

/// Where the IPVS hooks find what they read, from the `ip_vs` module's BTF. Kept in a map,
/// not in [`ProbeConfig`], because ip_vs may load after xtlock started. Offsets in bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IpvsConfig {
    /// Non-zero once filled.
    pub ok: u32,
    // struct ip_vs_conn
    pub conn_af: u32,
    pub conn_protocol: u32,
    pub conn_caddr: u32,
    pub conn_vaddr: u32,
    pub conn_daddr: u32,
    pub conn_cport: u32,
    pub conn_vport: u32,
    pub conn_dport: u32,
    pub conn_flags: u32,
    pub conn_dest: u32,
    /// `timer` (a `timer_list`) and `timer.expires`.
    pub conn_timer: u32,
    pub conn_timer_expires: u32,
    pub conn_ipvs: u32,
    /// `netns_ipvs.sysctl_expire_nodest_conn`.
    pub ipvs_expire_nodest: u32,
    // struct ip_vs_dest
    /// `cflags` (an `unsigned long`: kernels with the 2026 IPVS flags split, backported to
    /// stable ones such as Debian's 6.1.192) when `dest_avail_wide` is set, else `flags`
    /// (an `unsigned int`): where the "available" bit (0x1) is.
    pub dest_flags: u32,
    pub dest_avail_wide: u32,
    pub dest_weight: u32,
    // struct ip_vs_service
    pub svc_af: u32,
    pub svc_protocol: u32,
    pub svc_addr: u32,
    pub svc_port: u32,
    // struct ip_vs_dest_user_kern
    pub udest_addr: u32,
    pub udest_port: u32,
    pub udest_weight: u32,
    // struct ip_vs_service_user_kern
    pub usvc_af: u32,
    pub usvc_protocol: u32,
    pub usvc_addr: u32,
    pub usvc_port: u32,
    pub _pad: u32,
    /// Nanoseconds per jiffy of the running kernel (1e9 / HZ).
    pub ns_per_jiffy: u64,
    /// Minimum spacing of stale-packet events per connection, in ns.
    pub stale_interval_ns: u64,
}

/// Address family of a [`DropEvent`]'s addresses.
pub const DROP_FAMILY_NONE: u8 = 0;
pub const DROP_FAMILY_INET: u8 = 4;
pub const DROP_FAMILY_INET6: u8 = 6;

/// One packet drop seen at `skb:kfree_skb`, sampled under a per-CPU rate limit. Exact
/// counts travel separately (per-CPU counters keyed by [`DropKey`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropEvent {
    /// `tgid`/`tid`: the task that was running (often unrelated: softirq context).
    pub hdr: EventHeader,
    /// Kernel text address that freed the packet (`location`), e.g. inside `nf_hook_slow`.
    pub location: u64,
    /// Inode of the packet's network namespace (of its device, else of its socket); 0 when
    /// unknown.
    pub netns: u32,
    /// Index of the packet's device; 0 when it has none.
    pub ifindex: u32,
    /// `enum skb_drop_reason` value of the running kernel (0 when the kernel has none).
    pub reason: u32,
    /// The tracepoint's `protocol` (ethertype, host order: 0x0800 IPv4, 0x86dd IPv6).
    pub ethertype: u16,
    /// IP protocol (6 TCP, 17 UDP, 1 ICMP, 58 ICMPv6); 0 when not read.
    pub l4proto: u8,
    /// `DROP_FAMILY_*`: which addresses were read.
    pub family: u8,
    /// Source and destination address: 4 bytes for IPv4 (rest zero), 16 for IPv6.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Ports (host order) for TCP/UDP; ICMP type and code for ICMP.
    pub sport: u16,
    pub dport: u16,
    pub _pad: u32,
}

/// Key of the in-kernel drop counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DropKey {
    pub location: u64,
    pub reason: u32,
    pub netns: u32,
}

/// Slots of a CPU's drop-count cache (a power of two), see [`DropCache`].
pub const DROP_CACHE_SLOTS: usize = 64;

/// One key's drops on one CPU: claimed by the first key that maps to it, then never changed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropCacheSlot {
    pub key: DropKey,
    /// Drops since load; 0: the slot is free.
    pub count: u64,
}

/// A CPU's direct-mapped cache of drop counts, in front of the per-CPU hash map: a storm's
/// few keys are counted in an array slot (no hash computed, no bucket walked); a key whose
/// slot another key holds goes to the hash map. Counts only grow and a slot keeps its key,
/// so userspace adds slots and map without a race.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DropCache {
    pub slots: [DropCacheSlot; DROP_CACHE_SLOTS],
}

/// The slot of `k` in a [`DropCache`].
#[inline(always)]
pub fn drop_cache_slot(k: &DropKey) -> usize {
    let h = k.location ^ (k.location >> 12) ^ (u64::from(k.reason) << 5) ^ u64::from(k.netns);
    (h ^ (h >> 6)) as usize & (DROP_CACHE_SLOTS - 1)
}

/// The exclusive hold of a watched lock in progress (`HOLD_NOW`), written by the lock hook
/// and read by the drop hook: drops are counted for the hold while `start_ns` is non-zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HoldNow {
    /// The acquire's timestamp (its `LockEvent`'s): userspace finds the hold by it.
    pub start_ns: u64,
    /// `fl_owner` of the hold: only its release ends it.
    pub owner: u64,
    /// Holds counted so far; picks the hold's counter slot.
    pub seq: u64,
}

/// The exclusive take of one watched lock not sent yet (`KEPT`, at the lock's index): it
/// goes out with its release (a `Hold` record), or alone when something needs it sooner (a
/// waiter, the holder's table write, fork, exec or exit, a sampled drop or refusal in the
/// hold; userspace within 50 ms). One per lock: takes of one lock follow each other (the
/// lock is exclusive), so only one program writes an entry at a time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeptTake {
    /// Sequence lock of `take`: odd while a take is being written, +2 a take.
    pub take_seq: u64,
    /// `take_seq` of the last take sent to the ring: `take` waits in the kernel while
    /// `take_seq` is above it (and even).
    pub sent_seq: u64,
    pub take: LockEvent,
}

impl Default for LockEvent {
    fn default() -> Self {
        LockEvent {
            hdr: EventHeader::default(),
            owner: 0,
            ino: 0,
            dev: 0,
            ret: 0,
            fl_flags: 0,
            fl_type: 0,
            _pad: [0; 3],
            comm: [0; COMM_LEN],
        }
    }
}

/// Drop reasons a [`HoldDropSlot`] counts apart: the first this many distinct reasons a CPU
/// sees during a hold claim an entry each; drops of further reasons are in `count` only.
/// Holds rarely see more than two or three reasons; 6 keeps the slot in one cache line.
pub const HOLD_DROP_REASONS: usize = 6;

/// Drops counted during one hold on one CPU (`HOLD_DROPS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HoldDropSlot {
    /// The hold's `HoldNow::start_ns`; a different value means the slot holds another hold.
    pub start_ns: u64,
    /// Every drop of the hold on this CPU, whatever its reason.
    pub count: u64,
    /// Per reason: `reasons[i]` (the kernel's `skb_drop_reason`) was dropped `counts[i]`
    /// times; an entry with count 0 is free.
    pub reasons: [u32; HOLD_DROP_REASONS],
    pub counts: [u32; HOLD_DROP_REASONS],
}

/// `RefusalKey::kind`: an ICMP destination unreachable the node sent (`icmp:icmp_send`,
/// type 3; `detail` is the ICMP code: 3 port, 1 host, 13 administratively prohibited).
pub const REFUSAL_ICMP_UNREACH: u8 = 1;
/// A TCP reset the node's stack sent (`tcp:tcp_send_reset`; `detail` is the kernel's
/// `enum sk_rst_reason` where the tracepoint has it).
pub const REFUSAL_RST_SENT: u8 = 2;
/// A TCP reset a socket of the node received (`tcp:tcp_receive_reset`).
pub const REFUSAL_RST_RECEIVED: u8 = 3;
/// `RefusalKey::detail` when the kernel gives none.
pub const REFUSAL_NO_DETAIL: u32 = u32::MAX;
/// Distinct keys of the in-kernel refusal counters; refusals of keys past it are counted
/// in an overflow slot.
pub const MAX_REFUSAL_KEYS: u32 = 16384;
/// An offset in [`RefusalConfig`] of a field this kernel's tracepoint does not have.
pub const NO_FIELD: u32 = u32::MAX;
/// Within how many packets freed on its CPU after a refusal the drop hook takes the freed
/// packet for the refused one (the REJECT target answers, then its packet is the next one
/// freed on that CPU; an interrupt may free a few in between). Counted in frees, not time:
/// no clock read on the drop hook's path, and an emulated CPU that takes milliseconds
/// between the two (over 1 ms once in the 6.1 VM) still pairs them.
pub const ANSWERED_WINDOW_FREES: u64 = 16;

/// Key of the in-kernel refusal counters (`REFUSAL_COUNTS`): refusals of one kind to one
/// destination, in one netns, during one hold (or none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RefusalKey {
    /// `HoldNow::start_ns` of the hold in progress when it happened; 0: no hold.
    pub hold_start_ns: u64,
    /// The refused destination (the node's side for resets sent and ICMP, the peer for
    /// resets received): 4 bytes for IPv4 (rest zero), 16 for IPv6.
    pub addr: [u8; 16],
    pub netns: u32,
    /// ICMP code, or reset reason; [`REFUSAL_NO_DETAIL`] when the kernel gives none.
    pub detail: u32,
    /// Host order; 0 when unknown.
    pub port: u16,
    /// `DROP_FAMILY_*`.
    pub family: u8,
    /// `REFUSAL_*`.
    pub kind: u8,
    pub _pad: u32,
}

/// Where a tracepoint keeps one end of a connection: a `struct sockaddr_in6`-sized field
/// (`sockaddr`, Linux >= 6.10 for `tcp_send_reset`), or separate family, port and address
/// fields. Offsets from the format file; [`NO_FIELD`] for what it lacks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpAddr {
    pub sockaddr: u32,
    pub family: u32,
    /// Host order in the record.
    pub port: u32,
    pub addr4: u32,
    pub addr6: u32,
}

impl TpAddr {
    pub const NONE: TpAddr = TpAddr {
        sockaddr: NO_FIELD,
        family: NO_FIELD,
        port: NO_FIELD,
        addr4: NO_FIELD,
        addr6: NO_FIELD,
    };
}

/// Field offsets of the refusal tracepoints (`REFUSAL_CONFIG`, one entry), from their format
/// files, written by userspace before they attach.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusalConfig {
    // tcp:tcp_send_reset
    pub rst_skb: u32,
    pub rst_sk: u32,
    pub rst_reason: u32,
    /// The node's end (the tracepoint's source: it reverses the packet's addresses).
    pub rst_local: TpAddr,
    // tcp:tcp_receive_reset
    pub rrst_sk: u32,
    /// The peer that sent the reset.
    pub rrst_remote: TpAddr,
    // icmp:icmp_send
    pub icmp_skb: u32,
    pub icmp_type: u32,
    pub icmp_code: u32,
    /// The refused packet's destination and port (the port only for UDP before the packet
    /// itself is read).
    pub icmp_daddr: u32,
    pub icmp_dport: u32,
    pub _pad: u32,
}

impl Default for RefusalConfig {
    fn default() -> Self {
        RefusalConfig {
            rst_skb: NO_FIELD,
            rst_sk: NO_FIELD,
            rst_reason: NO_FIELD,
            rst_local: TpAddr::NONE,
            rrst_sk: NO_FIELD,
            rrst_remote: TpAddr::NONE,
            icmp_skb: NO_FIELD,
            icmp_type: NO_FIELD,
            icmp_code: NO_FIELD,
            icmp_daddr: NO_FIELD,
            icmp_dport: NO_FIELD,
            _pad: 0,
        }
    }
}

/// The packet a refusal answered on this CPU (`ANSWERED`): the drop hook does not count its
/// drop, so a REJECT is one refusal, not a refusal and a drop.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnsweredSkb {
    /// The answered packet; 0: none waiting.
    pub skb: u64,
    /// Packets the drop hook saw freed on this CPU (every drop reason).
    pub frees: u64,
    /// `frees` when `skb` was answered.
    pub at_frees: u64,
}

/// `IpvsEvent::op`: a new connection scheduled to a real server (`ip_vs_conn_new`).
pub const IPVS_OP_SCHEDULED: u8 = 1;
/// A packet on a connection whose real server is no longer usable (removed, or weight 0);
/// rate limited per connection, `packets` counts the packets since the previous one.
pub const IPVS_OP_STALE: u8 = 2;
/// The entry of a connection reported stale expired (`ip_vs_conn_expire`).
pub const IPVS_OP_EXPIRED: u8 = 3;
/// Real-server table changes (`ip_vs_add_dest`, `ip_vs_del_dest`, `ip_vs_edit_dest`), seen at
/// their return, by the process that made them.
pub const IPVS_OP_DEST_ADD: u8 = 4;
pub const IPVS_OP_DEST_DEL: u8 = 5;
pub const IPVS_OP_DEST_EDIT: u8 = 6;
/// Virtual-service changes: `ip_vs_add_service`, `ip_vs_edit_service` (both seen at their
/// return), `ip_vs_unlink_service` (removed, or flushed).
pub const IPVS_OP_SVC_ADD: u8 = 7;
pub const IPVS_OP_SVC_EDIT: u8 = 8;
pub const IPVS_OP_SVC_DEL: u8 = 9;

/// State of a connection's real server when a packet came (`IpvsEvent::dest_state`,
/// `IpvsKey::state`): usable, weight 0 (quiescent: still forwarded), or no longer
/// available (removed from its service: the kernel drops or expires).
pub const IPVS_DEST_OK: u8 = 0;
pub const IPVS_DEST_QUIESCENT: u8 = 1;
pub const IPVS_DEST_GONE: u8 = 2;

/// What the kernel did with a packet on a stale connection (`IpvsEvent::action`).
pub const IPVS_ACTION_NONE: u8 = 0;
/// Forwarded to the stale real server (weight 0).
pub const IPVS_ACTION_FORWARDED: u8 = 1;
/// Dropped, the entry left to expire without its timer restarted (`expire_nodest_conn=0`).
pub const IPVS_ACTION_DROPPED: u8 = 2;
/// The entry expired at once (`expire_nodest_conn=1`); the packet is scheduled anew, or
/// dropped when its conntrack entry was already confirmed.
pub const IPVS_ACTION_EXPIRED: u8 = 3;

/// Distinct (service, real server, state) keys of the in-kernel IPVS packet counters.
pub const MAX_IPVS_KEYS: u32 = 8192;

/// One IPVS event. Addresses are `union nf_inet_addr` (4 bytes used for IPv4), ports in
/// host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpvsEvent {
    pub hdr: EventHeader,
    /// Kernel address of the `struct ip_vs_conn` (a connection's identity while it lives);
    /// 0 for table changes.
    pub conn: u64,
    /// Time left on the connection entry's timer, in ns (0 when unknown or not running).
    pub timer_left_ns: u64,
    /// `IPVS_OP_STALE`/`IPVS_OP_EXPIRED`: stale packets of this connection since its
    /// previous event.
    pub packets: u64,
    /// `IPVS_OP_STALE`/`IPVS_OP_EXPIRED`: when the connection's last stale packet came
    /// (`CLOCK_MONOTONIC` ns); 0 when none.
    pub last_packet_ns: u64,
    /// Virtual service, client, real server.
    pub vaddr: [u8; 16],
    pub caddr: [u8; 16],
    pub daddr: [u8; 16],
    pub vport: u16,
    pub cport: u16,
    pub dport: u16,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub af: u16,
    pub protocol: u8,
    /// `IPVS_OP_*`.
    pub op: u8,
    /// `IPVS_DEST_*`.
    pub dest_state: u8,
    /// `IPVS_ACTION_*`.
    pub action: u8,
    /// The real server's weight (for table changes: the requested weight).
    pub weight: i32,
    /// Table changes: the function's return (0 or a negative errno).
    pub ret: i32,
    pub comm: [u8; COMM_LEN],
    pub _pad: u32,
}

/// Key of the in-kernel IPVS packet counters: packets sent to (or, state `GONE`, refused
/// for) one real server of one virtual service.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpvsKey {
    pub vaddr: [u8; 16],
    pub daddr: [u8; 16],
    pub vport: u16,
    pub dport: u16,
    pub af: u16,
    pub protocol: u8,
    /// `IPVS_DEST_*`.
    pub state: u8,
}

/// Key of the watched-locks map: which lock files the probes report.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LockKey {
    pub ino: u64,
    /// Kernel encoding (`major << 20 | minor`), as the tracepoint reports `s_dev`.
    pub dev: u32,
    pub _pad: u32,
}

/// One slot of the inode pre-filter (`WATCHED_INO`, at `ino % WATCHED_INO_SLOTS`): empty,
/// the one watched lock whose inode falls here (its key, compared in place: no hash on the
/// watched path), or several (then looked up in `WATCHED`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchedSlot {
    pub ino: u64,
    pub dev: u32,
    /// [`SLOT_EMPTY`], [`SLOT_ONE`] or [`SLOT_SHARED`] in its low byte; for `SLOT_ONE`, the
    /// lock's index (its `WATCHED` value) in the next one.
    pub state: u32,
}

/// [`WatchedSlot::state`]'s kind.
pub const SLOT_KIND: u32 = 0xff;
/// [`WatchedSlot::state`]'s lock index: `(state >> SLOT_INDEX_SHIFT) % MAX_WATCHED_LOCKS`.
pub const SLOT_INDEX_SHIFT: u32 = 8;

pub const SLOT_EMPTY: u32 = 0;
pub const SLOT_ONE: u32 = 1;
pub const SLOT_SHARED: u32 = 2;

/// Where each tracepoint field the programs read lives, discovered by userspace from
/// the tracefs `format` files of the running kernel and written into the programs'
/// read-only data before load. Offsets are in bytes from the start of the record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeConfig {
    // filelock:flock_lock_inode
    pub fl_ino: u32,
    pub fl_dev: u32,
    pub fl_owner: u32,
    pub fl_flags: u32,
    pub fl_type: u32,
    pub fl_ret: u32,
    // syscalls:sys_exit_* (the `ret` field: same place for every syscall)
    pub sys_exit_ret: u32,
    // signal:signal_deliver: `unsigned long sa_handler`, `unsigned long sa_flags`
    pub sig_handler: u32,
    pub sig_flags: u32,
    // syscalls:sys_enter_setsockopt
    pub sso_level: u32,
    pub sso_optname: u32,
    pub sso_optlen: u32,
    // syscalls:sys_enter_execve
    pub execve_argv: u32,
    // syscalls:sys_enter_execveat
    pub execveat_argv: u32,
    // sched:sched_process_exec: `__data_loc char[] filename`
    pub exec_filename: u32,
    // sched:sched_process_exec: `pid_t old_pid` (the tid that called execve)
    pub exec_old_pid: u32,
    // sched:sched_process_fork: `pid_t child_pid`
    pub fork_child_pid: u32,
    // syscalls:sys_enter_exit_group / sys_enter_exit: `int error_code`
    pub exit_code: u32,
    // skb:kfree_skb
    pub kd_skbaddr: u32,
    pub kd_location: u32,
    pub kd_protocol: u32,
    pub kd_reason: u32,
    /// Non-zero when the tracepoint has a `reason` field (kernels >= 5.17).
    pub kd_has_reason: u32,
    /// Non-zero when the struct member offsets below were found in the kernel's BTF;
    /// without them drops are still counted, but by netns 0 and without addresses.
    pub skb_ok: u32,
    // struct sk_buff, net_device, net, sock members (byte offsets, from BTF)
    pub skb_head: u32,
    pub skb_network_header: u32,
    pub skb_transport_header: u32,
    pub skb_dev: u32,
    pub skb_sk: u32,
    pub dev_ifindex: u32,
    pub dev_nd_net: u32,
    pub net_ns_inum: u32,
    pub sk_net: u32,
    /// Samples a CPU may send in a burst.
    pub drop_sample_burst: u32,
    /// Minimum spacing of drop samples per CPU, in ns; 0: no samples at all.
    pub drop_sample_interval_ns: u64,
    /// A quarter of the ring's bytes: a record wakes userspace only past this much waiting.
    pub ring_wake_bytes: u32,
    /// Non-zero on a CPU that may reorder stores with stores and loads with loads (arm64;
    /// not x86): the kept takes' sequence lock then puts full barriers around its copies
    /// (`pending.rs`).
    pub weak_order: u32,
    /// Non-zero when the offsets below and `net_ns_inum` were found in BTF (nf_tables commit netns).
    pub task_ok: u32,
    /// `task_struct.nsproxy`, `nsproxy.net_ns` (then `net_ns_inum` above: the commit's netns).
    pub task_nsproxy: u32,
    pub nsproxy_net_ns: u32,
    /// Offsets of a syscall's first five arguments in the user `pt_regs` (`di`, `si`, `dx`,
    /// `r10`, `r8` on x86-64; `regs[0..5]` on arm64), for hooks on a syscall's function
    /// (`__x64_sys_flock`, ...) instead of its tracepoint.
    pub regs_args: [u32; 5],
    /// For the lock hook's raw tracepoint (its arguments `struct inode *`, `struct
    /// file_lock *`, `int ret`), from BTF; userspace attaches it only when all were found.
    /// `inode.i_ino`, `inode.i_sb`, `super_block.s_dev`.
    pub rfl_inode_ino: u32,
    pub rfl_inode_sb: u32,
    pub rfl_sb_dev: u32,
    /// `file_lock.fl_owner`, `.fl_flags`, `.fl_type` (`file_lock.c.flc_*` since Linux 6.9).
    pub rfl_owner: u32,
    pub rfl_flags: u32,
    pub rfl_type: u32,
    /// `syscalls:sys_enter_setsockopt`'s `optval` (here to keep the layout free of
    /// implicit padding).
    pub sso_optval: u32,
    /// For the drop hook's raw tracepoint (`tp_btf/kfree_skb`: `struct sk_buff *`, the
    /// location, and since 5.17 the reason): non-zero when it has the reason argument.
    pub rkd_has_reason: u32,
    /// `sk_buff.protocol` (big-endian), the raw hook's ethertype.
    pub skb_protocol: u32,
    /// The drop-reason filter for reasons below [`DROP_WATCH_BITS`], a bit each: beside the
    /// drop hook's other fields (one cache line), where the `DROP_REASONS` map, for the rest,
    /// is a line of its own that a packet storm evicts between two drops.
    pub drop_watch: [u32; DROP_WATCH_WORDS],
    // syscalls:sys_enter_getsockopt: `level`, `optname`, `optval`
    pub gso_level: u32,
    pub gso_optname: u32,
    pub gso_optval: u32,
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are `#[repr(C)]`, `Copy`, made only of integers and byte arrays,
    // and have explicit padding fields, so any byte pattern is a valid value.
    unsafe impl aya::Pod for LockKey {}
    unsafe impl aya::Pod for WatchedSlot {}
    unsafe impl aya::Pod for ProbeConfig {}
    unsafe impl aya::Pod for DropKey {}
    unsafe impl aya::Pod for DropCacheSlot {}
    unsafe impl aya::Pod for DropCache {}
    unsafe impl aya::Pod for HoldDropSlot {}
    unsafe impl aya::Pod for RefusalKey {}
    unsafe impl aya::Pod for RefusalConfig {}
    unsafe impl aya::Pod for AnsweredSkb {}
    unsafe impl aya::Pod for HoldNow {}
    unsafe impl aya::Pod for KeptTake {}
    unsafe impl aya::Pod for IpvsKey {}
    unsafe impl aya::Pod for IpvsConfig {}
    unsafe impl aya::Pod for CtConfig {}
    unsafe impl aya::Pod for NftConfig {}
    unsafe impl aya::Pod for NftMutexConfig {}
    unsafe impl aya::Pod for NftMutexWaitEvent {}
    unsafe impl aya::Pod for NftSendEvent {}
    // The event records the decoder reads from the ring buffer and from captures.
    unsafe impl aya::Pod for EventHeader {}
    unsafe impl aya::Pod for LockEvent {}
    unsafe impl aya::Pod for HoldEvent {}
    unsafe impl aya::Pod for FlockCallEvent {}
    unsafe impl aya::Pod for ForkEvent {}
    unsafe impl aya::Pod for ExitEvent {}
    unsafe impl aya::Pod for TableReplaceEvent {}
    unsafe impl aya::Pod for NftCommitEvent {}
    unsafe impl aya::Pod for XtReplaceEvent {}
    unsafe impl aya::Pod for ConntrackFailEvent {}
    unsafe impl aya::Pod for DropEvent {}
    unsafe impl aya::Pod for RefusalEvent {}
    unsafe impl aya::Pod for IpvsEvent {}
}

/// Size in bytes of each event type, for the decoder's bounds checks.
pub mod sizes {
    use super::*;
    use core::mem::size_of;
    pub const LOCK: usize = size_of::<LockEvent>();
    pub const HOLD: usize = size_of::<HoldEvent>();
    pub const FLOCK_CALL: usize = size_of::<FlockCallEvent>();
    pub const EXEC: usize = size_of::<ExecEvent>();
    pub const FORK: usize = size_of::<ForkEvent>();
    pub const EXIT: usize = size_of::<ExitEvent>();
    pub const TABLE_REPLACE: usize = size_of::<TableReplaceEvent>();
    pub const DROP: usize = size_of::<DropEvent>();
    pub const NFT_COMMIT: usize = size_of::<NftCommitEvent>();
    pub const IPVS: usize = size_of::<IpvsEvent>();
    pub const CONNTRACK_FAIL: usize = size_of::<ConntrackFailEvent>();
    pub const XT_REPLACE: usize = size_of::<XtReplaceEvent>();
    pub const REFUSAL: usize = size_of::<RefusalEvent>();
    pub const NFT_MUTEX_WAIT: usize = size_of::<NftMutexWaitEvent>();
    pub const NFT_SEND: usize = size_of::<NftSendEvent>();
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// `enum nf_tables_msg_types` (include/uapi/linux/netfilter/nf_tables.h): every change
    /// filed under its kind, gets under none.
    #[test]
    fn nft_message_kinds() {
        let kind = |m| nft_msg_kind(m).map(|(k, d)| (NFT_KIND_NAMES[k], d));
        assert_eq!(kind(0), Some(("tables", false)));
        assert_eq!(kind(26), Some(("tables", true)));
        assert_eq!(kind(6), Some(("rules", false)));
        assert_eq!(kind(8), Some(("rules", true)));
        assert_eq!(kind(28), Some(("rules", true)));
        assert_eq!(kind(12), Some(("elements", false)));
        assert_eq!(kind(14), Some(("elements", true)));
        assert_eq!(kind(22), Some(("flowtables", false)));
        assert_eq!(kind(32), Some(("flowtables", true)));
        assert_eq!(kind(15), Some(("other", false)));
        for get in [1, 4, 7, 10, 13, 16, 19, 21, 23, 25, 33] {
            assert_eq!(kind(get), None, "{get}");
        }
        let slots = nft_msg_slots();
        assert_eq!((slots[0xa06], slots[0xa08], slots[0xa1c]), (2, 10, 10));
        assert_eq!((slots[0xa07], slots[0xac8]), (NFT_SLOT_NONE, 7));
        // Another subsystem's message (ipset's 0x0601), and the batch's end, count nowhere.
        assert_eq!((slots[0x601], slots[0x011]), (NFT_SLOT_NONE, NFT_SLOT_NONE));
    }

    // The layouts are part of the capture format: a change here must be deliberate.
    #[test]
    fn layouts_are_stable() {
        assert_eq!(size_of::<EventHeader>(), 24);
        assert_eq!(size_of::<LockEvent>(), 72);
        assert_eq!(size_of::<HoldEvent>(), 24 + 72 + 8 + 16);
        assert_eq!(size_of::<HoldNow>(), 24);
        assert_eq!(size_of::<KeptTake>(), 16 + 72);
        assert_eq!(size_of::<FlockCallEvent>(), 64);
        // Grown only at its end (`netns`): `EXEC_V1_LEN` before.
        assert_eq!(size_of::<ExecEvent>(), 24 + 128 + 512 + 8 + 16 + 8);
        assert_eq!(core::mem::offset_of!(ExecEvent, netns), EXEC_V1_LEN);
        assert_eq!(size_of::<ForkEvent>(), 48);
        assert_eq!(size_of::<ExitEvent>(), 48);
        // Grown only at its end (the table head): a reader of either version reads the
        // other's records (`TABLE_REPLACE_V1_LEN`).
        assert_eq!(size_of::<TableReplaceEvent>(), 112);
        assert_eq!(
            core::mem::offset_of!(TableReplaceEvent, table),
            TABLE_REPLACE_V1_LEN
        );
        assert_eq!(
            core::mem::offset_of!(TableReplaceEvent, netns),
            TABLE_REPLACE_V2_LEN
        );
        assert_eq!(size_of::<LockKey>(), 16);
        assert_eq!(size_of::<WatchedSlot>(), 16);
        assert_eq!(size_of::<DropEvent>(), 88);
        assert_eq!(size_of::<DropKey>(), 16);
        assert_eq!(size_of::<RefusalKey>(), 40);
        assert_eq!(size_of::<RefusalConfig>(), 20 * 4);
        assert_eq!(size_of::<DropCache>(), 24 * DROP_CACHE_SLOTS);
        assert_eq!(size_of::<HoldDropSlot>(), 64);
        assert_eq!(size_of::<RefusalEvent>(), 80);
        // 64 u32 and one u64: no implicit padding (the whole struct is copied into the
        // programs as bytes).
        assert_eq!(size_of::<ProbeConfig>(), 64 * 4 + 8);
        // The drop hook's filter bits share a cache line with its other fields.
        let watch_end = core::mem::offset_of!(ProbeConfig, drop_watch) + 4 * DROP_WATCH_WORDS - 1;
        assert_eq!(
            core::mem::offset_of!(ProbeConfig, rkd_has_reason) / 64,
            watch_end / 64
        );
        assert_eq!(size_of::<IpvsConfig>(), 136);
        assert_eq!(size_of::<IpvsEvent>(), 144);
        assert_eq!(size_of::<IpvsKey>(), 40);
        // Grown only at its end (the batch counts), like TableReplaceEvent.
        assert_eq!(size_of::<NftCommitEvent>(), 120);
        assert_eq!(
            core::mem::offset_of!(NftCommitEvent, added),
            NFT_COMMIT_V1_LEN
        );
        assert_eq!(size_of::<NftConfig>(), 16);
        assert_eq!(size_of::<ConntrackFailEvent>(), 88);
        assert_eq!(size_of::<CtConfig>(), 48);
        assert_eq!(size_of::<XtReplaceEvent>(), 32);
        assert_eq!(size_of::<NftMutexWaitEvent>(), 24 + 16 + 24 + 32);
        assert_eq!(size_of::<NftMutexConfig>(), 38 * 4 + 8 + 80);
        // Grown only at its end (the batch counts).
        assert_eq!(size_of::<NftSendEvent>(), 24 + 16 + 16 + 8 + 64);
        assert_eq!(core::mem::offset_of!(NftSendEvent, batch), NFT_SEND_V1_LEN);
    }

    #[test]
    fn kinds_round_trip() {
        for k in [
            EventKind::Lock,
            EventKind::FlockCall,
            EventKind::Exec,
            EventKind::Fork,
            EventKind::Exit,
            EventKind::TableReplace,
            EventKind::Drop,
            EventKind::NftCommit,
            EventKind::ConntrackFail,
            EventKind::XtReplace,
            EventKind::Ipvs,
            EventKind::Refusal,
            EventKind::Hold,
            EventKind::NftMutexWait,
            EventKind::NftSend,
        ] {
            assert_eq!(EventKind::from_u32(k as u32), Some(k));
        }
        assert_eq!(EventKind::from_u32(0), None);
        assert_eq!(EventKind::from_u32(99), None);
    }
}
