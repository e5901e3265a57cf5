//! `xt_replace_table`: where a legacy table replace swaps the new table in and then waits
//! for every CPU to leave the old one. Its duration is the kernel's part of the replace that
//! grows with packet load and CPU count, inside the holder's lock. Entry and return per
//! thread: fentry/fexit where allowed, else kprobe/kretprobe.
use aya_ebpf::{
    macros::{fentry, fexit, kprobe, kretprobe},
    programs::{FEntryContext, FExitContext, ProbeContext, RetProbeContext},
};
use xtlock_common::{EventKind, XtReplaceEvent};

use crate::{
    emit::{header, ids, now, output},
    XT_INFLIGHT,
};

#[inline(always)]
fn enter() {
    let (_, tid) = ids();
    let _ = XT_INFLIGHT.insert(&tid, &now(), 0);
}

#[inline(always)]
fn exit() {
    let (tgid, tid) = ids();
    // SAFETY: read of our own entry; removed right after.
    let Some(enter_ns) = (unsafe { XT_INFLIGHT.get(&tid) }).copied() else {
        return;
    };
    let _ = XT_INFLIGHT.remove(&tid);
    crate::pending::send_by(Some(tgid));
    output(&XtReplaceEvent {
        hdr: header(EventKind::XtReplace, now()),
        enter_ns,
    });
}

#[fentry(function = "xt_replace_table")]
pub fn xt_replace_fentry(_ctx: FEntryContext) -> u32 {
    enter();
    0
}

#[fexit(function = "xt_replace_table")]
pub fn xt_replace_fexit(_ctx: FExitContext) -> u32 {
    exit();
    0
}

#[kprobe]
pub fn xt_replace_kprobe(_ctx: ProbeContext) -> u32 {
    enter();
    0
}

#[kretprobe]
pub fn xt_replace_kretprobe(_ctx: RetProbeContext) -> u32 {
    exit();
    0
}
