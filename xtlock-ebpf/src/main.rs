//! xtlock's BPF programs. This file holds the maps and nothing else; each hook lives in
//! `probes/<hook>.rs`. Event layouts come from `xtlock-common`.
#![no_std]
#![no_main]
// BPF's atomic add (see `emit::inflight_add`); a host build of this crate (`cargo test
// --workspace` on stable) has no use for it.
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
};
use xtlock_common::{
    AnsweredSkb, DropKey, HoldDropSlot, HoldNow, IpvsEvent, IpvsKey, KeptTake, LockKey,
    ProbeConfig, RefusalConfig, RefusalKey, WatchedSlot, DROP_REASON_SLOTS, HOLD_DROP_SLOTS,
    MAX_DROP_KEYS, MAX_IPVS_KEYS, MAX_REFUSAL_KEYS, MAX_WATCHED_LOCKS, WATCHED_INO_SLOTS,
};

/// Slots of `WAITING`.
const WAITING_SLOTS: u32 = 4096;
/// Slots of `INFLIGHT`.
const INFLIGHT_SLOTS: u32 = 4096;

mod emit;
mod pending;
mod probes;

/// Tracepoint field offsets of the running kernel, written by userspace before load.
#[unsafe(no_mangle)]
static CONFIG: ProbeConfig = ProbeConfig {
    fl_ino: 0,
    fl_dev: 0,
    fl_owner: 0,
    fl_flags: 0,
    fl_type: 0,
    fl_ret: 0,
    sys_exit_ret: 0,
    sig_handler: 0,
    sig_flags: 0,
    sso_level: 0,
    sso_optname: 0,
    sso_optlen: 0,
    execve_argv: 0,
    execveat_argv: 0,
    exec_filename: 0,
    exec_old_pid: 0,
    fork_child_pid: 0,
    exit_code: 0,
    kd_skbaddr: 0,
    kd_location: 0,
    kd_protocol: 0,
    kd_reason: 0,
    kd_has_reason: 0,
    skb_ok: 0,
    skb_head: 0,
    skb_network_header: 0,
    skb_transport_header: 0,
    skb_dev: 0,
    skb_sk: 0,
    dev_ifindex: 0,
    dev_nd_net: 0,
    net_ns_inum: 0,
    sk_net: 0,
    drop_sample_burst: 0,
    drop_sample_interval_ns: 0,
    ring_wake_bytes: 0,
    weak_order: 0,
    task_ok: 0,
    task_nsproxy: 0,
    nsproxy_net_ns: 0,
    regs_args: [0; 5],
    rfl_inode_ino: 0,
    rfl_inode_sb: 0,
    rfl_sb_dev: 0,
    rfl_owner: 0,
    rfl_flags: 0,
    rfl_type: 0,
    sso_optval: 0,
    rkd_has_reason: 0,
    skb_protocol: 0,
    drop_watch: [0; xtlock_common::DROP_WATCH_WORDS],
    gso_level: 0,
    gso_optname: 0,
    gso_optval: 0,
};

/// Every event, in order per CPU. Userspace may resize it before load.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 22, 0);

/// Events dropped because `EVENTS` was full, per CPU.
#[map]
static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The lock files to report, filled by userspace: (dev, inode) -> index.
#[map]
static WATCHED: HashMap<LockKey, u32> = HashMap::with_max_entries(MAX_WATCHED_LOCKS, 0);

/// The slot at `ino % WATCHED_INO_SLOTS` of each key of `WATCHED` (set after the key, never
/// cleared): every `flock()` on the node checks it first, an array read the verifier inlines;
/// a slot with one lock holds its key, compared in place; a shared one sends the lookup to
/// `WATCHED`.
#[map]
static WATCHED_INO: Array<WatchedSlot> = Array::with_max_entries(WATCHED_INO_SLOTS, 0);

/// Blocking `flock()` calls deferred on a watched lock that have not ended yet, by thread
/// id.
#[map]
static FLOCK_INFLIGHT: LruHashMap<u32, probes::flock::FlockInflight> =
    LruHashMap::with_max_entries(4096, 0);

/// Deferred calls in `FLOCK_INFLIGHT` by slot `tid % WAITING_SLOTS`: the lock hook looks up
/// a thread's entry only when its slot counts one. Not atomic (BPF has no atomic add that
/// every kernel's Rust target offers): a count lost to two colliding threads deferring on
/// two CPUs at once only ends that wait at the analysis's deadline instead of its call's
/// return; a count left high (an entry the LRU evicted) only costs lookups.
#[map]
static WAITING: Array<u32> = Array::with_max_entries(WAITING_SLOTS, 0);

/// argv read at `execve` entry, by thread id, until the exec succeeds.
#[map]
static EXEC_ARGS: LruHashMap<u32, probes::process::ExecArgs> =
    LruHashMap::with_max_entries(1024, 0);

/// Scratch space to build `ExecArgs` (too large for the BPF stack).
#[map]
static EXEC_SCRATCH: PerCpuArray<probes::process::ExecArgs> = PerCpuArray::with_max_entries(1, 0);

/// `exit_group()` status by process id, until the leader thread exits.
#[map]
static EXIT_CODES: LruHashMap<u32, i32> = LruHashMap::with_max_entries(8192, 0);

/// Calls kept in `SOCKOPT_INFLIGHT` and `NFT_SEND_INFLIGHT`, by slot `tid % INFLIGHT_SLOTS`,
/// and all of them in the last entry: the exit hooks of getsockopt, setsockopt and sendmsg
/// run for every such call on the node (an `SO_ERROR` read after each non-blocking connect),
/// and look their thread up in a hash only when a kept call is in flight and their slot
/// counts one. Atomic adds, so no call is missed; a count left high (an entry the LRU
/// evicted, an exit never seen) only costs lookups.
#[map]
static INFLIGHT: Array<u64> = Array::with_max_entries(INFLIGHT_SLOTS + 1, 0);

/// xtables `setsockopt()` and `getsockopt()` calls in progress, by thread id.
#[map]
static SOCKOPT_INFLIGHT: LruHashMap<u32, probes::setsockopt::SockoptEnter> =
    LruHashMap::with_max_entries(1024, 0);

/// nf_tables commits in progress, by thread id.
#[map]
static NFT_INFLIGHT: LruHashMap<u32, probes::nft_commit::NftEnter> =
    LruHashMap::with_max_entries(1024, 0);

/// Where the nf_tables commit hook finds its batch (one entry), written by userspace when
/// the hook attaches (nf_tables may load after start; the argument depends on the function).
#[map]
static NFT_CONFIG: Array<xtlock_common::NftConfig> = Array::with_max_entries(1, 0);

/// Where the nf_tables mutex hook finds what it reads (one entry), written by userspace
/// when nf_tables is there (it may load after start).
#[map]
static NFT_MUTEX_CONFIG: Array<xtlock_common::NftMutexConfig> = Array::with_max_entries(1, 0);

/// What the nf_tables mutex hook learned from a stack: the pernet id of nf_tables plus one,
/// and the address of nfnetlink's nf_tables mutex (0: not yet).
#[map]
static NFT_MUTEX_LEARNED: Array<u64> = Array::with_max_entries(2, 0);

/// Commit mutexes seen, by address: the `struct net` whose mutex it was (checked again at
/// each use: a netns freed, its memory may hold another). For kernel workers, which wait
/// from the initial netns on other netns's mutexes, even when no owner names the netns.
#[map]
static NFT_COMMIT_MUTEXES: LruHashMap<u64, u64> = LruHashMap::with_max_entries(1024, 0);

/// Waits on an nf_tables mutex in progress, by thread id: the record sent at their end.
#[map]
static NFT_MUTEX_WAITS: LruHashMap<u32, xtlock_common::NftMutexWaitEvent> =
    LruHashMap::with_max_entries(4096, 0);

/// Slots of `NFT_SEND_SLOTS`.
const SEND_SLOTS: u32 = 1024;

/// `sendmsg()` calls on a `NETLINK_NETFILTER` socket in progress, by slot `tid %
/// SEND_SLOTS`, each owned by the thread whose call it holds (claimed with a
/// compare-and-swap from 0, Linux >= 5.12, so only the `bpf_loop` entry program claims). An
/// array, not a hash: at each end of the call a load at a known index instead of a hash
/// insert, look-up and delete, and the exit of every other `sendmsg()` of the node one
/// load. A thread whose slot is owned by another goes to `NFT_SEND_INFLIGHT`.
#[map]
static NFT_SEND_SLOTS: Array<probes::nft_send::SendSlot> = Array::with_max_entries(SEND_SLOTS, 0);

/// `sendmsg()` calls on a `NETLINK_NETFILTER` socket in progress, by thread id: where
/// `NFT_SEND_SLOTS` is not claimed (kernels without `bpf_loop`, a thread whose slot is
/// owned).
#[map]
static NFT_SEND_INFLIGHT: LruHashMap<u32, probes::nft_send::SendEnter> =
    LruHashMap::with_max_entries(1024, 0);

/// `xt_replace_table` calls in progress: entry time by thread id.
#[map]
static XT_INFLIGHT: LruHashMap<u32, u64> = LruHashMap::with_max_entries(1024, 0);

/// Conntrack confirms and allocations in progress, by thread id.
#[map]
static CT_INFLIGHT: LruHashMap<u32, probes::conntrack::CtEnter> =
    LruHashMap::with_max_entries(1024, 0);

/// Offsets of `nf_conn` and its tuple, written by userspace when the conntrack hooks attach
/// (nf_conntrack may load after start, so not in CONFIG).
#[map]
static CT_CONFIG: Array<xtlock_common::CtConfig> = Array::with_max_entries(1, 0);

/// Which drop reasons to count and sample: slot `min(reason, DROP_REASON_SLOTS - 1)` is
/// non-zero for a watched reason. Filled by userspace before attaching.
#[map]
static DROP_REASONS: Array<u8> = Array::with_max_entries(DROP_REASON_SLOTS, 0);

/// Exact drop counts per (location, reason, netns), per CPU. Userspace reads and sums them
/// every second and never deletes keys (a delete would race with increments).
#[map]
static DROP_COUNTS: PerCpuHashMap<DropKey, u64> = PerCpuHashMap::with_max_entries(MAX_DROP_KEYS, 0);

/// Each CPU's direct-mapped cache of drop counts, in front of `DROP_COUNTS` (one entry).
#[map]
static DROP_CACHE: PerCpuArray<xtlock_common::DropCache> = PerCpuArray::with_max_entries(1, 0);

/// Drops not counted under their key because `DROP_COUNTS` was full, per CPU.
#[map]
static DROP_OVERFLOW: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Each watched lock's exclusive take not sent yet, at the lock's index (`pending.rs`).
#[map]
static KEPT: Array<KeptTake> = Array::with_max_entries(MAX_WATCHED_LOCKS, 0);

/// The exclusive hold of a watched lock in progress (one entry): the lock hook sets it at an
/// acquire and clears it at the holder's release; the drop hook counts into its slot.
#[map]
static HOLD_NOW: Array<HoldNow> = Array::with_max_entries(1, 0);

/// Watched drops during holds, per CPU, in slot `seq % HOLD_DROP_SLOTS` of the hold. Exact per
/// hold: a drop counts for the hold in progress when it happens, not for a whole interval.
#[map]
static HOLD_DROPS: PerCpuArray<HoldDropSlot> = PerCpuArray::with_max_entries(HOLD_DROP_SLOTS, 0);

/// Drop-sample rate limiter per CPU: the theoretical arrival time of the next sample (GCRA).
#[map]
static DROP_RATE: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Refusal-sample rate limiter per CPU, like `DROP_RATE` and with its budget, kept apart so a
/// drop storm does not silence refusal samples.
#[map]
static REFUSAL_RATE: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Field offsets of the refusal tracepoints (one entry), written by userspace before they
/// attach.
#[map]
static REFUSAL_CONFIG: Array<RefusalConfig> = Array::with_max_entries(1, 0);

/// Exact refusal counts per (hold, netns, kind, destination, detail), per CPU. Userspace
/// reads and sums them every second and never deletes keys.
#[map]
static REFUSAL_COUNTS: PerCpuHashMap<RefusalKey, u64> =
    PerCpuHashMap::with_max_entries(MAX_REFUSAL_KEYS, 0);

/// Refusals not counted under their key because `REFUSAL_COUNTS` was full, per CPU.
#[map]
static REFUSAL_OVERFLOW: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The packet the last refusal on this CPU answered: its drop is not counted as a drop.
#[map]
static ANSWERED: PerCpuArray<AnsweredSkb> = PerCpuArray::with_max_entries(1, 0);

/// IPVS struct offsets (one entry), written by userspace when ip_vs is there (possibly after
/// start, when the module loads later).
#[map]
static IPVS_CONFIG: Array<xtlock_common::IpvsConfig> = Array::with_max_entries(1, 0);

/// Exact IPVS packet counts per (virtual service, real server, state), per CPU. Userspace
/// reads and sums them every second and never deletes keys.
#[map]
static IPVS_COUNTS: PerCpuHashMap<IpvsKey, u64> = PerCpuHashMap::with_max_entries(MAX_IPVS_KEYS, 0);

/// IPVS packets not counted under their key because `IPVS_COUNTS` was full, per CPU.
#[map]
static IPVS_OVERFLOW: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Connections seen with a stale real server, by `struct ip_vs_conn` address: when their
/// last event went out and the stale packets since.
#[map]
static IPVS_STALE: LruHashMap<u64, probes::ipvs::StaleConn> =
    LruHashMap::with_max_entries(16384, 0);

/// IPVS table changes in progress, by thread id (completed at the function's return).
#[map]
static IPVS_TABLE_OPS: LruHashMap<u32, IpvsEvent> = LruHashMap::with_max_entries(256, 0);

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
