//! The typed events every source yields and the analysis consumes: kernel records decoded
//! (`decode`), and the synthetic ones sources make themselves (process snapshots, counters,
//! pod names). No bytes here: `decode` reads the kernel's layouts.
//!
//! One file for every event kind (docs/architecture.md): a new kind is added in one place.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use xtlock_common as common;

use crate::shared::SharedStr;

/// A task's `comm`: 16 bytes, NUL-padded. Kept inline so lock events do not allocate.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Comm(pub [u8; common::COMM_LEN]);

impl Comm {
    pub fn new(s: &str) -> Self {
        let mut b = [0u8; common::COMM_LEN];
        // The kernel keeps at most 15 bytes and a NUL.
        let n = s.len().min(common::COMM_LEN - 1);
        b[..n].copy_from_slice(&s.as_bytes()[..n]);
        Comm(b)
    }

    pub fn as_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(cstr(&self.0))
    }

    pub fn is_empty(&self) -> bool {
        self.0[0] == 0
    }
}

impl fmt::Display for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.as_str())
    }
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

/// Bytes up to the first NUL.
pub(crate) fn cstr(b: &[u8]) -> &[u8] {
    &b[..nul_pos(b)]
}

/// Index of the first NUL in `b`, or its length. Eight bytes at a time: the fields are
/// 16 to 128 bytes, and a byte-by-byte search showed in profiles.
#[inline]
pub(crate) fn nul_pos(b: &[u8]) -> usize {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let mut chunks = b.chunks_exact(8);
    let mut at = 0;
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        let w = u64::from_le_bytes(w);
        // High bit set in each zero byte's place (and maybe above one): the lowest set bit
        // is the first zero byte.
        let zero = w.wrapping_sub(LO) & !w & HI;
        if zero != 0 {
            return at + (zero.trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    let rest = chunks.remainder();
    at + rest.iter().position(|&c| c == 0).unwrap_or(rest.len())
}

pub(crate) fn string(b: &[u8]) -> String {
    String::from_utf8_lossy(cstr(b)).into_owned()
}

/// Like [`string`], straight into a [`SharedStr`] (one allocation when the text is UTF-8).
pub(crate) fn shared(b: &[u8]) -> SharedStr {
    let b = cstr(b);
    // `from_utf8` first: faster than the lossy scan for the usual, valid text.
    match std::str::from_utf8(b) {
        Ok(s) => SharedStr::from(s),
        Err(_) => SharedStr::from(String::from_utf8_lossy(b).into_owned()),
    }
}

/// The arguments of an exec, NUL-separated in one shared allocation: one allocation to
/// decode, none to hand to the process table, forked children and facts. Arguments are C
/// strings: they contain no NUL. Serialises as a JSON array of strings.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Argv {
    text: SharedStr,
    argc: u32,
}

impl Argv {
    /// See [`SharedStr::prefetch`].
    pub(crate) fn prefetch(&self) {
        self.text.prefetch();
    }

    pub fn new<S: AsRef<str>>(args: impl IntoIterator<Item = S>) -> Self {
        let mut text = String::new();
        let mut argc = 0u32;
        for a in args {
            if argc > 0 {
                text.push('\0');
            }
            text.push_str(a.as_ref());
            argc += 1;
        }
        Argv {
            text: SharedStr::from(text),
            argc,
        }
    }

    /// From the first `argc` argument slots of an exec event (`args`: the slots' bytes).
    pub(crate) fn from_slots(args: &[u8], argc: usize) -> Self {
        const MAX: usize = common::ARGV_SLOTS * common::ARG_LEN;
        let slots = || args.chunks_exact(common::ARG_LEN).take(argc);
        let mut buf = [0u8; MAX];
        let mut n = 0;
        let mut argc = 0u32;
        for a in slots().map(cstr) {
            if n + a.len() + 1 > MAX {
                return Argv::new(slots().map(string));
            }
            if argc > 0 {
                buf[n] = 0;
                n += 1;
            }
            buf[n..n + a.len()].copy_from_slice(a);
            n += a.len();
            argc += 1;
        }
        // One check for all: NUL separators are ASCII, so the text is UTF-8 exactly when
        // every argument is.
        match std::str::from_utf8(&buf[..n]) {
            Ok(text) => Argv {
                text: SharedStr::from(text),
                argc,
            },
            // Rare: the lossy conversion may grow the text.
            Err(_) => Argv::new(slots().map(string)),
        }
    }

    pub fn len(&self) -> usize {
        self.argc as usize
    }

    pub fn is_empty(&self) -> bool {
        self.argc == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.text.split('\0').take(self.argc as usize)
    }

    /// The arguments joined by spaces.
    pub fn join(&self) -> String {
        self.text.replace('\0', " ")
    }

    /// [`Argv::join`], then `suffix` unless that is empty, as a [`SharedStr`]: one
    /// allocation for the argv of an exec event.
    pub fn join_shared(&self, suffix: &str) -> SharedStr {
        const MAX: usize = common::ARGV_SLOTS * common::ARG_LEN + 16;
        let text = self.text.as_bytes();
        let suffix = if text.is_empty() { "" } else { suffix };
        let n = text.len() + suffix.len();
        if n > MAX {
            let mut s = self.join();
            s.push_str(suffix);
            return SharedStr::from(s);
        }
        let mut buf = [0u8; MAX];
        for (d, &c) in buf.iter_mut().zip(text) {
            *d = if c == 0 { b' ' } else { c };
        }
        buf[text.len()..n].copy_from_slice(suffix.as_bytes());
        // NULs (ASCII) became spaces (ASCII) in UTF-8 text: still UTF-8.
        std::str::from_utf8(&buf[..n])
            .map_or_else(|_| SharedStr::from(self.join()), SharedStr::from)
    }
}

impl fmt::Debug for Argv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl serde::Serialize for Argv {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

/// What a `flock_lock_inode` call on a watched lock did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockOp {
    /// Lock granted (`F_WRLCK`/`F_RDLCK`, ret 0).
    Acquired { exclusive: bool },
    /// Conflict; the caller sleeps and retries (`FILE_LOCK_DEFERRED`).
    Deferred,
    /// Conflict and the caller does not sleep (`LOCK_NB`: ret `-EAGAIN`), or another error.
    Failed { errno: i32 },
    /// `F_UNLCK`: `LOCK_UN`, `close()` of the owning file, or exit.
    Released,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockEvent {
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub comm: Comm,
    /// The open file description owning the lock.
    pub owner: u64,
    pub dev: u32,
    pub ino: u64,
    pub op: LockOp,
    /// `LOCK_NB` was given (the kernel's `FL_SLEEP` was not set).
    pub nonblocking: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlockCallEvent {
    /// Syscall return.
    pub ts_ns: u64,
    pub enter_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub owner: u64,
    pub dev: u32,
    pub ino: u64,
    /// Raw return: 0, or a negative errno (`-EINTR` when an `alarm()` ended the wait).
    pub ret: i64,
    /// `flock()` operation, `None` when the entry was not seen.
    pub cmd: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecEvent {
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub comm: Comm,
    pub filename: SharedStr,
    /// Shared with the process table and the exec fact.
    pub argv: Argv,
    pub argv_truncated: bool,
    /// Inode of the network namespace the program runs in, read at exec (0 unknown: no BTF
    /// offsets, or a capture from before it was recorded).
    pub netns: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkEvent {
    pub ts_ns: u64,
    pub parent_tgid: u32,
    pub parent_tid: u32,
    pub child_tid: u32,
    pub comm: Comm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitEvent {
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub comm: Comm,
    /// Process exit status (the low byte of the `exit_group()` argument), `None` when the
    /// task did not call exit (killed by a signal).
    pub exit_code: Option<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableReplaceEvent {
    pub ts_ns: u64,
    pub enter_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub level: u32,
    pub optname: u32,
    pub optlen: u32,
    pub ret: i64,
    /// The head of the caller's argument; `None` when it could not be read, or in captures
    /// from before it was recorded. Boxed: rare, it would make every `Event` bigger.
    pub head: Option<Box<TableHead>>,
    /// Whether the record had room for a head: false in captures from before it existed.
    pub head_recorded: bool,
    /// A `getsockopt` table read (`*_SO_GET_INFO`, `*_SO_GET_ENTRIES`), not a set.
    pub read: bool,
    /// Inode of the caller's network namespace; 0 when unknown (older captures).
    pub netns: u32,
}

/// Which table a replace (or counter update) was for, and how big the new table was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableHead {
    /// NUL-padded, as in the kernel's struct.
    pub name: [u8; xtlock_common::XT_TABLE_MAXNAMELEN],
    /// Entries of the new table (counters, for a counter update).
    pub entries: u32,
    /// Bytes of the new table's entries (0 for a counter update).
    pub bytes: u32,
}

impl TableHead {
    pub fn name(&self) -> String {
        string(&self.name)
    }
}

/// One `xt_replace_table` call: a legacy table swapped in, every CPU waited out of the old.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XtReplaceEvent {
    pub ts_ns: u64,
    pub enter_ns: u64,
    pub tgid: u32,
    pub tid: u32,
}

/// One nf_tables commit (netlink batch): the second lock, held for `ts_ns - enter_ns`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftCommitEvent {
    /// The commit function's return.
    pub ts_ns: u64,
    pub enter_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// Inode of the sender's network namespace; 0 when unknown.
    pub netns: u32,
    pub comm: Comm,
    /// What the batch changed; `None` when not counted (no offsets, or an older capture).
    /// Boxed: commits are rare, and every event moves at the size of the largest.
    pub batch: Option<Box<NftBatch>>,
}

/// Which nf_tables mutex a wait was on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NftMutex {
    /// A network namespace's `commit_mutex`: one nf_tables transaction at a time per netns.
    Commit,
    /// nfnetlink's nf_tables subsystem mutex, one for the node: a batch holds it while it
    /// waits for its netns's commit mutex, so later batches of every netns queue on it.
    Nfnl,
}

/// One wait on an nf_tables mutex (`lock:contention_begin` to `contention_end`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftMutexWaitEvent {
    /// The wait's end (`contention_end`).
    pub ts_ns: u64,
    /// Its first `contention_begin`.
    pub start_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub comm: Comm,
    /// Inode of the waiter's network namespace; 0 when unknown.
    pub netns: u32,
    pub mutex: NftMutex,
    /// The mutex's kernel address.
    pub lock: u64,
    /// `contention_end`'s return: 0 when the mutex was taken.
    pub ret: i32,
    /// The owner when the wait began: thread and process id (`None`: the mutex was free,
    /// its owner about to hand it over, or unreadable), and its comm.
    pub holder: Option<(u32, u32)>,
    pub holder_comm: Comm,
}

/// One nf_tables batch timed from its `sendmsg()` on a `NETLINK_NETFILTER` socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftSendEvent {
    /// The syscall's return.
    pub ts_ns: u64,
    pub enter_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub comm: Comm,
    /// Inode of the sender's network namespace; 0 when unknown.
    pub netns: u32,
    pub ret: i32,
    /// What the batch changed, counted from the caller's buffers; `None` when not counted
    /// (no `bpf_loop`, the function hooks, or an older capture).
    pub batch: Option<Box<NftBatch>>,
}

/// The changes an nf_tables batch carried: its netlink messages per object kind
/// (`common::NFT_KIND_NAMES`). A message is one change, except a rule deletion without a
/// handle, which flushes a whole chain, and a set-element message, which carries any number
/// of elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NftBatch {
    /// `complete`, `partial` (only the first messages counted: `common::NFT_BATCH_MAX_MSGS`,
    /// or `common::NFT_BATCH_LOOP_MSGS` where the kernel has `bpf_loop`) or `unreadable`
    /// (the batch could not be read: no counts).
    pub status: &'static str,
    pub added: [u32; common::NFT_KINDS],
    pub deleted: [u32; common::NFT_KINDS],
}

impl NftBatch {
    /// Messages counted, additions and deletions.
    pub fn changes(&self) -> u64 {
        self.added
            .iter()
            .chain(&self.deleted)
            .map(|&n| u64::from(n))
            .sum()
    }

    /// `(kind, added, deleted)` for the kinds it changed, in kind order.
    pub fn kinds(&self) -> impl Iterator<Item = (&'static str, u32, u32)> + '_ {
        common::NFT_KIND_NAMES
            .iter()
            .zip(self.added.iter().zip(&self.deleted))
            .filter(|(_, (a, d))| **a > 0 || **d > 0)
            .map(|(k, (a, d))| (*k, *a, *d))
    }
}

/// `{"status":"complete","changes":305,"added":{"rules":300,"chains":5},"deleted":{}}`:
/// the kinds it did not change are left out.
impl serde::Serialize for NftBatch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let side = |v: &[u32; common::NFT_KINDS]| -> std::collections::BTreeMap<&str, u32> {
            common::NFT_KIND_NAMES
                .iter()
                .zip(v)
                .filter(|(_, n)| **n > 0)
                .map(|(k, n)| (*k, *n))
                .collect()
        };
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("status", self.status)?;
        m.serialize_entry("changes", &self.changes())?;
        m.serialize_entry("added", &side(&self.added))?;
        m.serialize_entry("deleted", &side(&self.deleted))?;
        m.end()
    }
}

/// What conntrack refused, seen in the refusing kernel function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CtFailKind {
    /// `__nf_conntrack_confirm` returned `NF_DROP`: the kernel's `insert_failed` path.
    InsertFailed,
    /// `__nf_conntrack_alloc` failed: the table was full.
    TableFull,
}

/// A connection conntrack refused (kernel event).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackFail {
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub comm: Comm,
    pub what: CtFailKind,
    pub netns: u32,
    pub l4proto: u8,
    pub saddr: Option<IpAddr>,
    pub daddr: Option<IpAddr>,
    pub sport: u16,
    pub dport: u16,
}

/// Synthetic, at the start: a flock already held on a watched lock when tracing began, from
/// `/proc/locks` (the hold's start and owner are unknown; its holder's pid is not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockSeed {
    pub ts_ns: u64,
    pub pid: u32,
    pub dev: u32,
    pub ino: u64,
    pub exclusive: bool,
}

/// A process that existed when tracing started (from /proc), or that userspace looked up
/// later. Not a kernel event: the source produces it so the analysis never reads /proc.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ProcInfo {
    pub ts_ns: u64,
    pub pid: u32,
    pub ppid: u32,
    pub comm: Comm,
    pub argv: Vec<String>,
    /// First line of `/proc/PID/cgroup` that names a path (cgroup v2 `0::/...`, or v1).
    pub cgroup: Option<String>,
    /// An iptables-family program's file as resolved on disk. Boxed: rare, and every
    /// event moves at the size of the largest.
    pub exe: Option<Box<ExeInfo>>,
}

/// The file a process runs as resolved on disk (`/usr/sbin/xtables-nft-multi`), and the
/// version it carries (`1.8.9 (nf_tables)`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExeInfo {
    pub path: String,
    pub version: Option<String>,
}

/// Synthetic: the kubelet's names of a container (or, `container_id` empty, of a pod), read
/// by the source from the node's `/var/log/containers` and `/var/log/pods` (see
/// [`crate::kube`]). Sent before the first fact that could name a process of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodInfo {
    pub ts_ns: u64,
    /// Empty for a pod known by UID only.
    pub container_id: String,
    pub pod_uid: String,
    pub namespace: String,
    pub pod: String,
    /// Empty when only the pod is known.
    pub container: String,
}

/// One packet drop sampled in the kernel at `skb:kfree_skb` (rate limited: exact numbers
/// come from [`DropCounts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropSample {
    pub ts_ns: u64,
    /// The task that was running; often unrelated to the packet (softirq).
    pub tgid: u32,
    pub tid: u32,
    /// Kernel text address that freed the packet; see [`Event::KernelSymbol`].
    pub location: u64,
    /// Network namespace inode; 0 when unknown.
    pub netns: u32,
    pub ifindex: u32,
    /// `enum skb_drop_reason` of the recording kernel; see [`Event::DropReasons`].
    pub reason: u32,
    pub ethertype: u16,
    /// IP protocol; 0 when the packet was not IP or its header was not readable.
    pub l4proto: u8,
    pub saddr: Option<IpAddr>,
    pub daddr: Option<IpAddr>,
    /// Ports for TCP/UDP, ICMP type/code for ICMP.
    pub sport: u16,
    pub dport: u16,
}

/// One refusal sampled in the kernel (rate limited: exact numbers come from
/// [`RefusalCounts`]), with the refused packet's addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusalSample {
    pub ts_ns: u64,
    pub tgid: u32,
    /// The hold in progress when it happened (its acquire time); 0: none.
    pub hold_start_ns: u64,
    pub netns: u32,
    /// `xtlock_common::REFUSAL_*`.
    pub kind: u8,
    /// ICMP code or reset reason; `xtlock_common::REFUSAL_NO_DETAIL` when none.
    pub detail: u32,
    /// IP protocol; 0 when the packet's header was not read (only the destination known).
    pub l4proto: u8,
    pub saddr: Option<IpAddr>,
    pub daddr: Option<IpAddr>,
    pub sport: u16,
    pub dport: u16,
}

/// Drops of one (location, reason, netns) in one interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropCount {
    pub location: u64,
    pub reason: u32,
    pub netns: u32,
    pub count: u64,
}

/// Synthetic: the kernel's exact per-CPU drop counters, read by the source every second,
/// as deltas since the previous read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropCounts {
    /// When the counters were read (end of the interval).
    pub ts_ns: u64,
    /// Length of the interval (since the previous read).
    pub interval_ns: u64,
    /// Non-zero deltas only.
    pub counts: Vec<DropCount>,
    /// Drops the kernel could not file under their key (its key map was full).
    pub overflow: u64,
    /// Drops counted in the kernel during each hold of a watched lock seen by this read, so
    /// far (a hold still going on is counted again at the next read). Only those whose
    /// count changed. Empty in captures made before xtlock counted per hold.
    pub holds: Vec<HoldDropCount>,
}

/// Refusals of one (hold, netns, kind, destination, detail) in one interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusalCount {
    /// The hold in progress when they happened (its acquire time); 0: none.
    pub hold_start_ns: u64,
    pub netns: u32,
    /// `xtlock_common::REFUSAL_*`.
    pub kind: u8,
    /// ICMP code or reset reason; `xtlock_common::REFUSAL_NO_DETAIL` when none.
    pub detail: u32,
    /// The refused destination (the peer, for resets received); `None` when unknown.
    pub addr: Option<IpAddr>,
    pub port: u16,
    pub count: u64,
}

/// Synthetic: the kernel's exact per-CPU refusal counters, read by the source every second,
/// as deltas since the previous read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusalCounts {
    /// When the counters were read (end of the interval).
    pub ts_ns: u64,
    pub interval_ns: u64,
    /// Non-zero deltas only.
    pub counts: Vec<RefusalCount>,
    /// Refusals the kernel could not file under their key (its key map was full).
    pub overflow: u64,
    /// Names of the recording kernel's reset reasons, each sent with the first counts that
    /// carry it (reason numbers change between kernels).
    pub reset_reasons: Vec<(u32, String)>,
}

/// Drops during one hold, counted in the kernel while it went on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HoldDropCount {
    /// The hold's acquire time (its lock event's).
    pub start_ns: u64,
    pub count: u64,
    /// Per drop reason (`skb_drop_reason`), sorted: exact, counted in the kernel. Their sum
    /// falls short of `count` by drops of reasons the kernel had no room to count apart
    /// (more than `xtlock_common::HOLD_DROP_REASONS` on one CPU in one hold). Empty in
    /// captures made before xtlock counted them.
    pub by_reason: Vec<(u32, u64)>,
}

/// Conntrack statistics counters (`/proc/net/stat/nf_conntrack`, summed over CPUs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConntrackCounters {
    /// Packets dropped because a new connection could not be tracked (table full).
    pub drop: u64,
    pub early_drop: u64,
    /// Entries that lost an insert race (the DNS 5-second-timeout race); packet dropped.
    pub insert_failed: u64,
    pub invalid: u64,
    pub search_restart: u64,
    pub clash_resolve: u64,
    pub chaintoolong: u64,
}

impl ConntrackCounters {
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }

    pub fn saturating_sub(&self, o: &Self) -> Self {
        ConntrackCounters {
            drop: self.drop.saturating_sub(o.drop),
            early_drop: self.early_drop.saturating_sub(o.early_drop),
            insert_failed: self.insert_failed.saturating_sub(o.insert_failed),
            invalid: self.invalid.saturating_sub(o.invalid),
            search_restart: self.search_restart.saturating_sub(o.search_restart),
            clash_resolve: self.clash_resolve.saturating_sub(o.clash_resolve),
            chaintoolong: self.chaintoolong.saturating_sub(o.chaintoolong),
        }
    }

    pub fn saturating_add(&self, o: &Self) -> Self {
        ConntrackCounters {
            drop: self.drop.saturating_add(o.drop),
            early_drop: self.early_drop.saturating_add(o.early_drop),
            insert_failed: self.insert_failed.saturating_add(o.insert_failed),
            invalid: self.invalid.saturating_add(o.invalid),
            search_restart: self.search_restart.saturating_add(o.search_restart),
            clash_resolve: self.clash_resolve.saturating_add(o.clash_resolve),
            chaintoolong: self.chaintoolong.saturating_add(o.chaintoolong),
        }
    }
}

/// Synthetic: conntrack counters of one network namespace, read by the source every
/// second (deltas since the previous read) with the table's fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackStats {
    pub ts_ns: u64,
    pub interval_ns: u64,
    pub netns: u32,
    pub deltas: ConntrackCounters,
    /// `nf_conntrack_count` and `nf_conntrack_max` now.
    pub count: u64,
    pub max: u64,
}

/// What an IPVS event reports (`xtlock_common::IPVS_OP_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IpvsOp {
    /// A new connection scheduled to a real server.
    Scheduled,
    /// Packets on a connection whose real server was removed or set to weight 0.
    Stale,
    /// The entry of a connection reported stale expired.
    Expired,
    /// Real server added to a virtual service.
    DestAdded,
    /// Real server removed from a virtual service.
    DestRemoved,
    /// Real server edited (weight).
    DestEdited,
    /// Virtual service added, edited, removed (deleted or flushed).
    ServiceAdded,
    ServiceEdited,
    ServiceRemoved,
}

/// State of a connection's real server (`xtlock_common::IPVS_DEST_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DestState {
    /// In its service with a weight above 0.
    Ok,
    /// Weight 0 (graceful termination): existing connections are still forwarded to it.
    Quiescent,
    /// Removed from its service: packets of its connections are dropped or the entries
    /// expired.
    Removed,
}

impl DestState {
    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            common::IPVS_DEST_QUIESCENT => DestState::Quiescent,
            common::IPVS_DEST_GONE => DestState::Removed,
            _ => DestState::Ok,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DestState::Ok => "ok",
            DestState::Quiescent => "weight_0",
            DestState::Removed => "removed",
        }
    }
}

/// What the kernel did with a packet on a stale connection (`xtlock_common::IPVS_ACTION_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StaleAction {
    None,
    /// Forwarded to the stale real server (weight 0).
    Forwarded,
    /// Dropped; the entry's timer not restarted (`expire_nodest_conn=0`).
    Dropped,
    /// Entry expired at once (`expire_nodest_conn=1`); the packet rescheduled or dropped.
    Expired,
}

impl StaleAction {
    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            common::IPVS_ACTION_FORWARDED => StaleAction::Forwarded,
            common::IPVS_ACTION_DROPPED => StaleAction::Dropped,
            common::IPVS_ACTION_EXPIRED => StaleAction::Expired,
            _ => StaleAction::None,
        }
    }
}

/// One IPVS kernel event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpvsEvent {
    pub ts_ns: u64,
    /// The running task: the process that made a table change; often unrelated otherwise
    /// (softirq).
    pub tgid: u32,
    pub tid: u32,
    pub comm: Comm,
    pub op: IpvsOp,
    /// Kernel address of the connection; 0 for table changes.
    pub conn: u64,
    /// IP protocol (17 UDP, 6 TCP, 132 SCTP).
    pub protocol: u8,
    /// Virtual service.
    pub service: SocketAddr,
    /// Client; `None` for table changes.
    pub client: Option<SocketAddr>,
    /// Real server.
    pub backend: SocketAddr,
    pub dest_state: DestState,
    pub action: StaleAction,
    /// The real server's weight (table changes: the requested one).
    pub weight: i32,
    /// Table changes: 0 or a negative errno.
    pub ret: i32,
    /// Stale packets since this connection's previous event.
    pub packets: u64,
    /// When the connection's last stale packet came; 0 when none.
    pub last_packet_ns: u64,
    /// Time left on the connection entry's timer.
    pub timer_left_ns: u64,
}

/// Packets of one (virtual service, real server, state) in one interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpvsCount {
    pub protocol: u8,
    pub service: SocketAddr,
    pub backend: SocketAddr,
    pub state: DestState,
    pub count: u64,
}

/// Synthetic: the kernel's exact per-CPU IPVS packet counters, read by the source every
/// second, as deltas since the previous read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsCounts {
    pub ts_ns: u64,
    pub interval_ns: u64,
    /// Non-zero deltas only.
    pub counts: Vec<IpvsCount>,
    /// Packets the kernel could not file under their key (its key map was full).
    pub overflow: u64,
}

/// One rule: its parts in `iptables-save` order, the target last.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rule(pub Vec<String>);

impl Rule {
    /// The target part (`-j DROP`, `-j KUBE-SERVICES`, `-g X`).
    pub fn target(&self) -> &str {
        self.0.last().map_or("", String::as_str)
    }

    /// Everything that selects packets: the parts but the target and the comment.
    pub fn matches(&self) -> impl Iterator<Item = &str> {
        let n = self.0.len().saturating_sub(1);
        self.0[..n]
            .iter()
            .map(String::as_str)
            .filter(|p| !p.starts_with("-m comment "))
    }

    pub fn comment(&self) -> Option<&str> {
        self.0
            .iter()
            .find_map(|p| p.strip_prefix("-m comment --comment "))
    }

    /// The chain a rule jumps or goes to, if it is not a verdict or an extension target.
    pub fn jump(&self) -> Option<&str> {
        let t = self.target();
        let name = t.strip_prefix("-j ").or_else(|| t.strip_prefix("-g "))?;
        (!name.contains(' ')
            && !matches!(name, "ACCEPT" | "DROP" | "RETURN" | "QUEUE")
            && name.chars().next().is_some_and(|c| !c.is_ascii_digit()))
        .then_some(name)
    }

    pub fn text(&self) -> String {
        self.0.join(" ")
    }
}

/// FNV-1a over the rules' parts: stable across runs, so digests in captures compare.
pub fn digest_rules(rules: &[Rule]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for r in rules {
        for p in &r.0 {
            for &c in p.as_bytes().iter().chain(b"\0") {
                h = (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// One chain of a legacy table as read after a write: its rules when they changed since
/// the previous read of that table (or at its first read), else only their digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainState {
    /// Shared: a capture's reader hands every read of a table the same names (see
    /// `capture::reader`), so a read of unchanged chains allocates no name.
    pub name: SharedStr,
    /// A built-in chain's policy; `None` for a user chain.
    pub policy: Option<SharedStr>,
    /// FNV-1a of its rules' text: equal digests, equal rules.
    pub digest: u64,
    /// `None`: unchanged since the previous read (same digest).
    pub rules: Option<Vec<Rule>>,
}

/// Synthetic: a legacy or nf_tables table read from the kernel after a write to it
/// (`source/rules.rs`), bounded: chains whose rules did not change are sent as digests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleTable {
    pub ts_ns: u64,
    pub netns: u32,
    /// `ip` (a legacy IPv4 table), `nft ip`, `nft ip6`, `nft inet`, ... (an nf_tables
    /// table), `nft` (with table `*`: a namespace's nf_tables, said skipped).
    pub family: String,
    pub table: String,
    /// The writer whose write this read follows.
    pub after_pid: u32,
    /// Empty when read whole; else why it was not (`too large`, an error), with no chains.
    pub skipped: String,
    pub chains: Vec<ChainState>,
    /// More parts of this read follow: a read too large for one capture record is sent in
    /// parts of at most [`RULE_TABLE_PART_BYTES`], in chain order (a long chain's rules
    /// continue in the next part under the same name). The last part has `more` false.
    pub more: bool,
}

/// Synthetic: what the dropping rules of one table (its `DROP` and `REJECT` rules, and the
/// `DROP` policies of its built-in chains) counted since the previous read of their counters
/// (`source/rules.rs`): the kernel's own per-rule counters, read after a write and, while
/// netfilter drops packets in that namespace, once a second at most.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleCounters {
    /// When the counters were read (the interval's end).
    pub ts_ns: u64,
    /// The previous read of this table's counters (the interval's start).
    pub since_ns: u64,
    pub netns: u32,
    /// As in [`RuleTable`]: `ip`, `ip6` (legacy), `nft ip`, `nft inet`, ...
    pub family: String,
    pub table: String,
    /// Rules whose counter moved, in table order.
    pub rules: Vec<RuleCount>,
    /// Dropping rules that keep no counter (an nf_tables rule without `counter`), as
    /// `CHAIN: rule`: what they drop cannot be named. Only on reads that drops asked for;
    /// at most [`MAX_UNCOUNTED`].
    pub uncounted: Vec<String>,
}

/// Dropping rules without a counter listed per [`RuleCounters`].
pub const MAX_UNCOUNTED: usize = 16;
/// Moved rules listed per [`RuleCounters`] (a read's record stays far below 1 MiB).
pub const MAX_RULE_COUNTS: usize = 4096;

/// One dropping rule's counts over a [`RuleCounters`] interval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleCount {
    pub chain: String,
    /// As [`Rule::text`] words it; empty for the chain's policy.
    pub rule: String,
    /// Its place among the chain's rules of the same text (0 for the first).
    pub nth: u32,
    pub packets: u64,
    pub bytes: u64,
    /// Its counter went back since the previous read (a write replaced the rule, counters
    /// and all): counted from that write, what it dropped before it since the previous read
    /// is not known.
    pub reset: bool,
}

/// Rule text per part of a [`RuleTable`] (the capture's records are at most 1 MiB).
pub const RULE_TABLE_PART_BYTES: usize = 512 * 1024;

impl RuleTable {
    /// Splits this read into parts of about [`RULE_TABLE_PART_BYTES`] of rule text each.
    pub fn into_parts(mut self) -> Vec<RuleTable> {
        let size = |r: &Rule| r.0.iter().map(|p| p.len() + 2).sum::<usize>() + 2;
        let total: usize = self
            .chains
            .iter()
            .map(|c| c.name.len() + 32 + c.rules.iter().flatten().map(size).sum::<usize>())
            .sum();
        if total <= RULE_TABLE_PART_BYTES {
            return vec![self];
        }
        let chains = std::mem::take(&mut self.chains);
        let mut parts = vec![RuleTable {
            more: true,
            ..self.clone()
        }];
        let mut used = 0;
        for mut c in chains {
            used += c.name.len() + 32;
            let Some(rules) = c.rules.take() else {
                if let Some(p) = parts.last_mut() {
                    p.chains.push(c);
                }
                continue;
            };
            // `c` is the chain's head (name, policy, digest); its rules go in pieces.
            let fresh = || ChainState {
                rules: Some(Vec::new()),
                ..c.clone()
            };
            let mut piece = fresh();
            for r in rules {
                if used >= RULE_TABLE_PART_BYTES {
                    if let Some(p) = parts.last_mut() {
                        p.chains.push(std::mem::replace(&mut piece, fresh()));
                    }
                    parts.push(RuleTable {
                        more: true,
                        ..self.clone()
                    });
                    used = 0;
                }
                used += size(&r);
                if let Some(v) = piece.rules.as_mut() {
                    v.push(r);
                }
            }
            if let Some(p) = parts.last_mut() {
                p.chains.push(piece);
            }
        }
        if let Some(p) = parts.last_mut() {
            p.more = false;
        }
        parts
    }

    /// Appends the next part of the same read (see [`RuleTable::more`]).
    pub fn append(&mut self, next: RuleTable) {
        for c in next.chains {
            match self.chains.last_mut() {
                Some(last) if last.name == c.name => {
                    if let (Some(a), Some(b)) = (last.rules.as_mut(), c.rules) {
                        a.extend(b);
                    }
                }
                _ => self.chains.push(c),
            }
        }
        self.more = next.more;
    }
}

/// Why an address is known to live on this node, or why it is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AddrWhy {
    /// Known: a neighbour entry (ARP/NDP) on a bridge or link (the bridge CNI's pods).
    Neighbour,
    /// Known: a host route (`/32`, `/128`) through a link (calico's and cilium's pods).
    Route,
    /// Known: an address of this namespace's own links (a hostNetwork endpoint).
    Local,
    /// Gone: the link it lived behind was deleted (the pod's veth, with its netns).
    LinkDeleted,
    /// Gone: its host route was deleted.
    RouteDeleted,
    /// Gone: the local address was deleted.
    AddressDeleted,
    /// Gone: the neighbour entry failed (the address stopped answering ARP/NDP).
    NeighbourFailed,
    /// Dead wherever it lives (this node or another): TCP connections DNATed to it went
    /// unanswered (conntrack: SYN sent, no reply), as `source/ct_entries.rs` scans for.
    Unanswered,
    /// Answering again: a connection DNATed to it after it was said unanswered got a reply.
    Answering,
}

impl AddrWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            AddrWhy::Neighbour => "neighbour",
            AddrWhy::Route => "route",
            AddrWhy::Local => "local",
            AddrWhy::LinkDeleted => "link deleted",
            AddrWhy::RouteDeleted => "route deleted",
            AddrWhy::AddressDeleted => "address deleted",
            AddrWhy::NeighbourFailed => "neighbour failed",
            AddrWhy::Unanswered => "unanswered",
            AddrWhy::Answering => "answering",
        }
    }

    /// The capture's code of it.
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => AddrWhy::Neighbour,
            1 => AddrWhy::Route,
            2 => AddrWhy::Local,
            3 => AddrWhy::LinkDeleted,
            4 => AddrWhy::RouteDeleted,
            5 => AddrWhy::AddressDeleted,
            6 => AddrWhy::NeighbourFailed,
            7 => AddrWhy::Unanswered,
            8 => AddrWhy::Answering,
            _ => return None,
        })
    }

    /// Whether this says the address is there (else: gone).
    pub fn present(self) -> bool {
        matches!(
            self,
            AddrWhy::Neighbour | AddrWhy::Route | AddrWhy::Local | AddrWhy::Answering
        )
    }
}

/// Synthetic: an address became known to live on this node, or went away, as rtnetlink
/// told the source (`source/addrs.rs`) in the namespace it watches: where a pod's endpoint
/// lives, and the time its link, route or address vanished (stamped on receipt of the
/// kernel's notification, in event time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddrPresence {
    pub ts_ns: u64,
    /// The network namespace whose links these are (inode).
    pub netns: u32,
    pub addr: IpAddr,
    pub why: AddrWhy,
    /// The link it lives (lived) behind, as the kernel names it (`veth1a2b`, `cali12ab`).
    pub link: String,
    /// Said on the kernel's notification, so `ts_ns` is when it happened (within a read);
    /// false for what a dump found (at start, after an overrun): it was there before.
    pub live: bool,
}

/// One conntrack entry as ctnetlink dumps it (`decode/ct_entry.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CtEntry {
    /// The kernel's id of the entry (`CTA_ID`): the same connection in successive dumps.
    pub id: u32,
    /// IP protocol (6 TCP, 17 UDP, ...).
    pub proto: u8,
    /// TCP's conntrack state (`TCP_CONNTRACK_*`: 1 SYN_SENT, 3 ESTABLISHED, ...), 0 for others.
    pub tcp_state: u8,
    /// `IPS_*` bits.
    pub status: u32,
    /// The original direction: the client and the address it asked for (a Service's).
    pub orig_src: SocketAddr,
    pub orig_dst: SocketAddr,
    /// Where the reply comes from: the endpoint the entry was DNATed to.
    pub reply_src: SocketAddr,
    /// Packets of the original direction (0 unless `nf_conntrack_acct` is on).
    pub packets: u64,
    /// Seconds left before it expires.
    pub timeout_s: u32,
}

impl Default for CtEntry {
    fn default() -> Self {
        let any = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);
        CtEntry {
            id: 0,
            proto: 0,
            tcp_state: 0,
            status: 0,
            orig_src: any,
            orig_dst: any,
            reply_src: any,
            packets: 0,
            timeout_s: 0,
        }
    }
}

impl CtEntry {
    /// It saw a packet of the reply direction (`IPS_SEEN_REPLY`).
    pub fn replied(&self) -> bool {
        self.status & (1 << 1) != 0
    }
}

/// Synthetic: the conntrack entries whose replies come from an address gone from this node
/// (read by `source/ct_entries.rs` every second while it stays gone): the connections still
/// DNATed to a dead endpoint, answered or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CtEntries {
    pub ts_ns: u64,
    /// The network namespace whose conntrack table this is (inode).
    pub netns: u32,
    pub addr: IpAddr,
    pub entries: Vec<CtEntry>,
    /// Entries past the bound of one read, not listed.
    pub more: u32,
}

/// One real server of an IPVS virtual server, as `ipvsadm -Ln` lists it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct IpvsDest {
    pub addr: SocketAddr,
    /// 0: no new connections go there (kube-proxy's graceful termination).
    pub weight: u32,
    pub active: u32,
    pub inactive: u32,
}

/// One IPVS virtual server: protocol and address, or a firewall mark.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct IpvsService {
    /// IP protocol (6 TCP, 17 UDP, 132 SCTP); 0 for a firewall-mark service.
    pub proto: u8,
    /// `None` for a firewall-mark service.
    pub addr: Option<SocketAddr>,
    pub fwmark: u32,
    pub dests: Vec<IpvsDest>,
}

/// Synthetic: the IPVS table of a network namespace, read over generic netlink
/// (`source/ipvs_table.rs`) when it changed: where kube-proxy's ipvs mode routes each Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsTable {
    pub ts_ns: u64,
    pub netns: u32,
    /// Sorted.
    pub services: Vec<IpvsService>,
}

/// Everything the analysis consumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Lock(LockEvent),
    FlockCall(FlockCallEvent),
    Exec(ExecEvent),
    Fork(ForkEvent),
    Exit(ExitEvent),
    TableReplace(TableReplaceEvent),
    NftCommit(NftCommitEvent),
    /// A wait on an nf_tables mutex. Boxed: rare, and bigger than most events.
    NftMutexWait(Box<NftMutexWaitEvent>),
    /// An nf_tables batch's `sendmsg()`. Boxed, like the waits.
    NftSend(Box<NftSendEvent>),
    Proc(ProcInfo),
    /// The kernel dropped `count` events because the ring buffer was full (since the last
    /// such report).
    Lost {
        ts_ns: u64,
        count: u64,
    },
    /// A sampled packet drop (kernel event).
    Drop(DropSample),
    /// A connection conntrack refused (kernel event).
    ConntrackFail(ConntrackFail),
    /// A sampled refusal (kernel event).
    Refusal(RefusalSample),
    XtReplace(XtReplaceEvent),
    /// Synthetic: a hold that began before tracing did.
    LockSeed(LockSeed),
    /// Synthetic: exact drop counts of the last interval.
    DropCounts(DropCounts),
    /// Synthetic: conntrack counter deltas of one netns. Boxed, like [`Event::Ipvs`]: rare
    /// and big, it would make every event it (see `event_is_small`).
    Conntrack(Box<ConntrackStats>),
    /// An IPVS kernel event. Boxed: rare, and at 176 bytes it made every `Event` that big,
    /// moved a few times per event on the hot path.
    Ipvs(Box<IpvsEvent>),
    /// Synthetic: exact IPVS packet counts of the last interval.
    IpvsCounts(IpvsCounts),
    /// Synthetic: exact refusal counts of the last interval.
    RefusalCounts(RefusalCounts),
    /// Synthetic, once at the start: the recording kernel's drop-reason names
    /// (`has_reason` false: the kernel reports no reasons, every drop has reason 0) and the
    /// inode of the tracer's own (host) network namespace.
    DropSetup {
        ts_ns: u64,
        has_reason: bool,
        host_netns: u32,
        names: Vec<(u32, String)>,
    },
    /// Synthetic: the names of a container or pod (see [`PodInfo`]).
    Pod(Box<PodInfo>),
    /// Synthetic: a legacy or nf_tables table as read after a write (see [`RuleTable`]).
    RuleTable(Box<RuleTable>),
    /// Synthetic: what each dropping rule of a table counted (see [`RuleCounters`]).
    RuleCounters(Box<RuleCounters>),
    /// Synthetic: an address appeared on or vanished from this node (see [`AddrPresence`]).
    Addr(Box<AddrPresence>),
    /// Synthetic: conntrack entries DNATed to an address gone from this node.
    CtEntries(Box<CtEntries>),
    /// Synthetic: the IPVS virtual servers and their real servers, read over netlink.
    IpvsTable(Box<IpvsTable>),
    /// Synthetic, before the first event that carries `addr`: the kernel function it is in
    /// (from /proc/kallsyms), so a capture is readable where the kernel is not.
    KernelSymbol {
        ts_ns: u64,
        addr: u64,
        name: String,
        offset: u64,
    },
}

impl Event {
    pub fn ts_ns(&self) -> u64 {
        match self {
            Event::Lock(e) => e.ts_ns,
            Event::FlockCall(e) => e.ts_ns,
            Event::Exec(e) => e.ts_ns,
            Event::Fork(e) => e.ts_ns,
            Event::Exit(e) => e.ts_ns,
            Event::TableReplace(e) => e.ts_ns,
            Event::NftCommit(e) => e.ts_ns,
            Event::NftMutexWait(e) => e.ts_ns,
            Event::NftSend(e) => e.ts_ns,
            Event::Proc(e) => e.ts_ns,
            Event::Lost { ts_ns, .. } => *ts_ns,
            Event::Drop(e) => e.ts_ns,
            Event::ConntrackFail(e) => e.ts_ns,
            Event::Refusal(e) => e.ts_ns,
            Event::XtReplace(e) => e.ts_ns,
            Event::LockSeed(e) => e.ts_ns,
            Event::DropCounts(e) => e.ts_ns,
            Event::Conntrack(e) => e.ts_ns,
            Event::Ipvs(e) => e.ts_ns,
            Event::IpvsCounts(e) => e.ts_ns,
            Event::RefusalCounts(e) => e.ts_ns,
            Event::Pod(e) => e.ts_ns,
            Event::RuleTable(t) => t.ts_ns,
            Event::RuleCounters(c) => c.ts_ns,
            Event::Addr(a) => a.ts_ns,
            Event::CtEntries(c) => c.ts_ns,
            Event::IpvsTable(t) => t.ts_ns,
            Event::DropSetup { ts_ns, .. } | Event::KernelSymbol { ts_ns, .. } => *ts_ns,
        }
    }
}

#[cfg(test)]
mod rule_table_parts {
    use super::*;

    fn table(chains: usize, rules: usize, width: usize) -> RuleTable {
        RuleTable {
            ts_ns: 5,
            netns: 1,
            family: "ip".into(),
            table: "nat".into(),
            after_pid: 2,
            skipped: String::new(),
            chains: (0..chains)
                .map(|c| {
                    let rules: Vec<Rule> = (0..rules)
                        .map(|r| {
                            Rule(vec![
                                format!("-d {c}.{r} {}", "x".repeat(width)),
                                "-j ACCEPT".into(),
                            ])
                        })
                        .collect();
                    ChainState {
                        name: format!("C{c}").into(),
                        policy: None,
                        digest: digest_rules(&rules),
                        rules: (c % 3 != 0).then_some(rules),
                    }
                })
                .collect(),
            more: false,
        }
    }

    #[test]
    fn a_large_read_splits_into_parts_that_add_up_to_it() {
        // A small read stays whole.
        let small = table(3, 10, 10);
        assert_eq!(small.clone().into_parts(), vec![small]);
        // 40 chains of 2,000 rules of ~120 bytes, one chain longer than a part.
        let mut big = table(40, 2_000, 100);
        big.chains[1]
            .rules
            .as_mut()
            .unwrap()
            .extend((0..6_000).map(|r| {
                Rule(vec![
                    format!("-s {r} {}", "y".repeat(100)),
                    "-j DROP".into(),
                ])
            }));
        let parts = big.clone().into_parts();
        assert!(parts.len() > 10, "{} parts", parts.len());
        for (i, p) in parts.iter().enumerate() {
            assert_eq!(p.more, i + 1 < parts.len());
            let bytes: usize = p
                .chains
                .iter()
                .flat_map(|c| c.rules.iter().flatten())
                .map(|r| r.0.iter().map(String::len).sum::<usize>())
                .sum();
            assert!(
                bytes <= RULE_TABLE_PART_BYTES + 300,
                "part {i}: {bytes} bytes"
            );
        }
        let mut whole = parts[0].clone();
        for p in parts.into_iter().skip(1) {
            whole.append(p);
        }
        assert_eq!(whole, big);
    }
}
