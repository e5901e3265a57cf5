//! Helpers shared by the probes: configuration reads, event headers, lost-event counting.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    maps::{ring_buf::RingBufEntry, PerCpuArray, PerCpuHashMap},
    programs::TracePointContext,
    EbpfContext as _,
};
use xtlock_common::{EventHeader, EventKind, ProbeConfig};

use crate::{CONFIG, EVENTS, INFLIGHT, INFLIGHT_SLOTS, LOST};

/// Reads a `T` at `base + offset` of kernel memory: struct members at offsets userspace
/// found in BTF (every offset in the configs is a `u32`).
#[inline(always)]
pub fn kread<T>(base: u64, offset: u32) -> Option<T> {
    // SAFETY: bpf_probe_read_kernel checks the address; a bad one is an error, not a fault.
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel((base + u64::from(offset)) as *const T) }.ok()
}

/// Reads a `T` at `base + offset` of a BTF-typed kernel pointer (a `tp_btf` argument, or a
/// pointer read through one) with a plain load, no helper call. `offset` must be a value of
/// the frozen read-only `CONFIG`: the verifier then knows it and checks the load against the
/// kernel's BTF (member and size). The JIT turns a fault into a read of 0.
#[inline(always)]
pub fn btf_read<T: Copy>(base: *const u8, offset: usize) -> T {
    // SAFETY: see above; the kernel guards the load, it never faults.
    unsafe { core::ptr::read_volatile(base.wrapping_add(offset) as *const T) }
}

/// Argument `n` (0-4) of a syscall whose user registers are at `regs` (the one argument of
/// `__x64_sys_*` and its arch twins); `None` when it cannot be read.
#[inline(always)]
pub fn syscall_arg(regs: u64, n: usize) -> Option<u64> {
    // SAFETY: CONFIG is a static that lives for the program's lifetime; volatile as in
    // `cfg`.
    let off = unsafe { core::ptr::read_volatile(CONFIG.regs_args.get(n)?) };
    if regs == 0 || (off == 0 && n > 0) {
        return None;
    }
    kread(regs, off)
}

/// Reads a field offset from `CONFIG`. Volatile, because the value is patched in after
/// compile; one load of that field (a volatile read of the whole struct is a load per field,
/// some 50 instructions per call).
#[inline(always)]
pub fn cfg<F: Fn(&ProbeConfig) -> &u32>(f: F) -> usize {
    // SAFETY: CONFIG is a static that lives for the program's lifetime.
    unsafe { core::ptr::read_volatile(f(&CONFIG)) as usize }
}

/// `bpf_ringbuf_submit`/`discard` flags and the `bpf_ringbuf_query` of waiting bytes.
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;

/// Ring buffer flags for a record of type `T` (`reserved`: reserved already, so counted in
/// the ring's data): a wakeup only for a record that takes the waiting data past a quarter
/// of the ring, and past each further sixteenth (another CPU's record may cross the quarter
/// unseen, between this one's query and its write). Userspace reads the rest on its 50 ms
/// tick, and once woken reads until the ring is empty. So no wakeup per event while it is
/// idle (an IPI, a VM exit), nor one per event while it lags by more than the quarter: that
/// storm of wakeups cost a busy consumer's producers up to a microsecond a record. The
/// quarter is in `CONFIG`.
#[inline(always)]
pub fn wake_flags<T>(reserved: bool) -> u64 {
    // A record's room: its 8-byte header, rounded up to 8 bytes.
    const HDR: u64 = 8;
    let len = (core::mem::size_of::<T>() as u64 + HDR + 7) & !7;
    let avail = EVENTS.query(BPF_RB_AVAIL_DATA);
    let before = if reserved {
        avail.saturating_sub(len)
    } else {
        avail
    };
    let quarter = cfg(|c| &c.ring_wake_bytes) as u64;
    let step = (quarter / 4).max(1);
    let after = before + len;
    if after > quarter && after / step != before / step {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

/// Reads a `T` at `offset` of the tracepoint record.
#[inline(always)]
pub fn field<T>(ctx: &TracePointContext, offset: usize) -> Result<T, i32> {
    // SAFETY: offsets come from the kernel's own format file for this tracepoint.
    unsafe { ctx.read_at::<T>(offset) }
}

/// [`field`] with a fast path: when the running kernel's offset is `OFF` (the usual layout),
/// a direct load from the record at a constant offset (what the verifier allows on a
/// tracepoint context) instead of a `bpf_probe_read_kernel` call. The offset is a constant
/// of the frozen read-only `CONFIG`, so the verifier drops the branch not taken.
#[inline(always)]
pub fn field_fast<T: Copy, const OFF: usize>(
    ctx: &TracePointContext,
    offset: usize,
) -> Result<T, i32> {
    if offset == OFF {
        // SAFETY: OFF is inside the record (the kernel's format says so for this kernel)
        // and aligned for T.
        Ok(unsafe { field_at::<T, OFF>(ctx) })
    } else {
        field(ctx, offset)
    }
}

/// A `T` at the constant offset `OFF` of the tracepoint record: a direct load, no helper,
/// no configuration read.
///
/// # Safety
/// `OFF` must be inside the record for this kernel, and aligned for `T`.
#[inline(always)]
pub unsafe fn field_at<T: Copy, const OFF: usize>(ctx: &TracePointContext) -> T {
    // SAFETY: as the caller promised.
    unsafe { core::ptr::read((ctx.as_ptr() as *const u8).add(OFF) as *const T) }
}

/// Counts a kept call in (`1`) or out (`-1`) of `tid`'s slot of `INFLIGHT` and its total.
#[inline(always)]
pub fn inflight_add(tid: u32, delta: i64) {
    for i in [tid & (INFLIGHT_SLOTS - 1), INFLIGHT_SLOTS] {
        let Some(p) = INFLIGHT.get_ptr_mut(i) else {
            return;
        };
        // SAFETY: an entry of the array, valid for the program's run; the add is atomic, as
        // two CPUs may count in one slot at once. Its result unused: a plain atomic add,
        // which every kernel's verifier takes (fetching needs Linux 5.12).
        #[cfg(target_arch = "bpf")]
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                p,
                delta as u64,
            )
        };
        // A host build (type checks only; never loaded): the same add, atomically.
        #[cfg(not(target_arch = "bpf"))]
        // SAFETY: as above.
        unsafe { core::sync::atomic::AtomicU64::from_ptr(p) }
            .fetch_add(delta as u64, core::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether any kept call is in flight: one array load, no helper call.
#[inline(always)]
pub fn inflight_any() -> bool {
    INFLIGHT.get(INFLIGHT_SLOTS).is_some_and(|n| *n != 0)
}

/// Whether `tid`'s slot of `INFLIGHT` counts a kept call (its own, or a colliding thread's).
#[inline(always)]
pub fn inflight_in_slot(tid: u32) -> bool {
    INFLIGHT
        .get(tid & (INFLIGHT_SLOTS - 1))
        .is_some_and(|n| *n != 0)
}

/// (tgid, tid) of the current task.
#[inline(always)]
pub fn ids() -> (u32, u32) {
    let v = bpf_get_current_pid_tgid();
    ((v >> 32) as u32, v as u32)
}

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: plain helper call.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub fn header(kind: EventKind, ts_ns: u64) -> EventHeader {
    let (tgid, tid) = ids();
    header_of(kind, ts_ns, tgid, tid)
}

/// [`header`] for a program that has the ids already (one helper call fewer).
#[inline(always)]
pub fn header_of(kind: EventKind, ts_ns: u64, tgid: u32, tid: u32) -> EventHeader {
    EventHeader {
        kind: kind as u32,
        tgid,
        tid,
        _pad: 0,
        ts_ns,
    }
}

/// Reserves room for a `T` in the ring buffer, counting a lost event when it is full.
#[inline(always)]
pub fn reserve<T: 'static>() -> Option<RingBufEntry<T>> {
    let entry = EVENTS.reserve::<T>(0);
    if entry.is_none() {
        if let Some(n) = LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, this program is the only writer on this CPU.
            unsafe { *n += 1 };
        }
    }
    entry
}

/// A full memory barrier where the CPU may reorder stores with stores and loads with loads
/// (`CONFIG.weak_order`: arm64; not x86, which keeps both in order, all a sequence lock
/// asks). False when the ring had no room for it (then there was none).
///
/// BPF has no barrier instruction, and its fully ordered atomics (`BPF_FETCH`) need Linux
/// 5.12. The ring buffer's commit is an `xchg` on every kernel that has the ring (5.8), and
/// Linux's `xchg` is fully ordered on every architecture: a reservation discarded at once is
/// a full barrier. Reserved and discarded in place: the 5.10 and 6.1 verifiers lose a
/// reservation kept across other code ("Unreleased reference").
#[inline(always)]
pub fn fence() -> bool {
    if cfg(|c| &c.weak_order) == 0 {
        return true;
    }
    match EVENTS.reserve::<u64>(0) {
        Some(e) => {
            // Nobody is woken for it.
            e.discard(BPF_RB_NO_WAKEUP);
            true
        }
        None => false,
    }
}

/// Copies a small event into the ring buffer, counting a lost event when it is full.
#[inline(always)]
pub fn output<T: 'static>(ev: &T) {
    if EVENTS.output::<T>(ev, wake_flags::<T>(false)).is_err() {
        if let Some(n) = LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, this program is the only writer on this CPU.
            unsafe { *n += 1 };
        }
    }
}

/// Adds one to this CPU's counter for `key` in `map`; when the map is full, to `overflow`.
#[inline(always)]
pub fn count_in<K>(map: &PerCpuHashMap<K, u64>, overflow: &PerCpuArray<u64>, key: &K) {
    if let Some(n) = map.get_ptr_mut(key) {
        // SAFETY: per-CPU value; this CPU is the only writer.
        unsafe { *n += 1 };
        return;
    }
    // BPF_NOEXIST: another CPU may have inserted the key meanwhile; then add to ours.
    if map.insert(key, 1u64, 1).is_ok() {
        return;
    }
    if let Some(n) = map.get_ptr_mut(key) {
        // SAFETY: as above.
        unsafe { *n += 1 };
        return;
    }
    if let Some(n) = overflow.get_ptr_mut(0) {
        // SAFETY: per-CPU slot.
        unsafe { *n += 1 };
    }
}

/// Inode of the current task's network namespace; 0 when the offsets are unknown.
#[inline(always)]
pub fn current_netns() -> u32 {
    if cfg(|c| &c.task_ok) == 0 {
        return 0;
    }
    // SAFETY: plain helper call.
    let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() };
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

/// Inode of the packet's network namespace: its device's, else its socket's; 0 if neither.
#[inline(always)]
pub fn netns_of(skb: u64, dev: u64) -> u32 {
    let off = |f: fn(&ProbeConfig) -> &u32| cfg(f) as u32;
    let net: u64 = if dev != 0 {
        kread(dev, off(|c| &c.dev_nd_net)).unwrap_or(0)
    } else {
        let sk: u64 = kread(skb, off(|c| &c.skb_sk)).unwrap_or(0);
        if sk == 0 {
            0
        } else {
            kread(sk, off(|c| &c.sk_net)).unwrap_or(0)
        }
    };
    if net == 0 {
        return 0;
    }
    kread(net, off(|c| &c.net_ns_inum)).unwrap_or(0)
}

/// GCRA rate limiter per CPU (`rate`: its state): at most `burst` samples at once, then one
/// per interval.
/// The clock is read only when sampling is on.
#[inline(always)]
pub fn take_token(rate: &PerCpuArray<u64>) -> bool {
    // SAFETY: one field of the frozen CONFIG, read as `cfg` does for u32 fields.
    let interval = unsafe { core::ptr::read_volatile(&CONFIG.drop_sample_interval_ns) };
    if interval == 0 {
        return false;
    }
    let Some(tat) = rate.get_ptr_mut(0) else {
        return false;
    };
    let now = now();
    // SAFETY: per-CPU slot; this CPU is the only writer.
    let t = unsafe { *tat };
    let t = if t > now { t } else { now };
    // No overflow: userspace keeps interval * burst around one second.
    let burst = cfg(|c| &c.drop_sample_burst) as u32;
    let tolerance = interval.wrapping_mul(u64::from(burst.saturating_sub(1)));
    if t - now > tolerance {
        return false;
    }
    // SAFETY: as above.
    unsafe { *tat = t + interval };
    true
}
