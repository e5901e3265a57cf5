//! Helpers shared by the probes: configuration reads, event headers, lost-event counting.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    maps::ring_buf::RingBufEntry,
    programs::TracePointContext,
};
use xtlock_common::{EventHeader, EventKind, ProbeConfig};

use crate::{CONFIG, EVENTS, LOST};

/// Reads a field offset from `CONFIG`. Volatile: the value is patched in after compile.
#[inline(always)]
pub fn cfg<F: Fn(&ProbeConfig) -> u32>(f: F) -> usize {
    // SAFETY: CONFIG is a static that lives for the program's lifetime.
    let c = unsafe { core::ptr::read_volatile(&CONFIG) };
    f(&c) as usize
}

/// Reads a `T` at `offset` of the tracepoint record.
#[inline(always)]
pub fn field<T>(ctx: &TracePointContext, offset: usize) -> Result<T, i32> {
    // SAFETY: offsets come from the kernel's own format file for this tracepoint.
    unsafe { ctx.read_at::<T>(offset) }
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

/// Copies a small event into the ring buffer, counting a lost event when it is full.
#[inline(always)]
pub fn output<T: 'static>(ev: &T) {
    if EVENTS.output::<T>(ev, 0).is_err() {
        if let Some(n) = LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, this program is the only writer on this CPU.
            unsafe { *n += 1 };
        }
    }
}
