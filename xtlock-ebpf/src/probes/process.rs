//! Process lifecycle, for attribution: exec (filename and the first argv entries, read in
//! the kernel because short-lived `iptables` processes are gone before /proc can be read),
//! fork (parent), exit (with the `exit_group()` status: iptables exits 4 when the lock
//! wait timed out).
use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_probe_read_kernel_buf, bpf_probe_read_kernel_str_bytes,
        bpf_probe_read_user, bpf_probe_read_user_str_bytes,
    },
    macros::{fentry, kprobe, tracepoint},
    programs::{FEntryContext, ProbeContext, TracePointContext},
    EbpfContext,
};
use xtlock_common::{
    EventKind, ExecEvent, ExitEvent, ForkEvent, ARGV_SLOTS, ARG_LEN, FILENAME_LEN,
};

use crate::{
    emit::{cfg, current_netns, field, header, ids, now, output, reserve, syscall_arg},
    EXEC_ARGS, EXEC_SCRATCH, EXIT_CODES,
};

/// Writes `words` zero u64s at `p`: a plain loop, since the BPF target has no memset.
#[inline(always)]
fn zero(p: *mut u64, words: usize) {
    for i in 0..words {
        // SAFETY: callers pass a buffer of at least `words` u64s.
        unsafe { p.add(i).write_volatile(0) };
    }
}

/// argv as read at `execve` entry.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ExecArgs {
    pub args: [[u8; ARG_LEN]; ARGV_SLOTS],
    pub argc: u32,
    pub truncated: u32,
}

#[tracepoint]
pub fn sys_enter_execve(ctx: TracePointContext) -> u32 {
    if let Ok(argv) = field(&ctx, cfg(|c| &c.execve_argv)) {
        let _ = save_argv(argv);
    }
    0
}

#[tracepoint]
pub fn sys_enter_execveat(ctx: TracePointContext) -> u32 {
    if let Ok(argv) = field(&ctx, cfg(|c| &c.execveat_argv)) {
        let _ = save_argv(argv);
    }
    0
}

// The same on the syscall functions (`__x64_sys_execve(const struct pt_regs *regs)`): argv is
// the second argument of execve, the third of execveat.

#[fentry(function = "__x64_sys_execve")]
pub fn execve_syscall_fentry(ctx: FEntryContext) -> u32 {
    save_argv_of(ctx.arg(0), 1)
}

#[kprobe]
pub fn execve_syscall_kprobe(ctx: ProbeContext) -> u32 {
    save_argv_of(ctx.arg(0).unwrap_or(0), 1)
}

#[fentry(function = "__x64_sys_execveat")]
pub fn execveat_syscall_fentry(ctx: FEntryContext) -> u32 {
    save_argv_of(ctx.arg(0), 2)
}

#[kprobe]
pub fn execveat_syscall_kprobe(ctx: ProbeContext) -> u32 {
    save_argv_of(ctx.arg(0).unwrap_or(0), 2)
}

/// Saves argv, syscall argument `n` of the user registers at `regs`.
#[inline(always)]
fn save_argv_of(regs: u64, n: usize) -> u32 {
    if let Some(argv) = syscall_arg(regs, n) {
        let _ = save_argv(argv);
    }
    0
}

fn save_argv(argv: u64) -> Result<(), i32> {
    let argv = argv as *const *const u8;
    let scratch = EXEC_SCRATCH.get_ptr_mut(0).ok_or(0)?;
    // SAFETY: per-CPU scratch slot; user pointers are only read through the helpers.
    let s = unsafe { &mut *scratch };
    // Cleared first: the slot keeps the previous exec's argv, and the bytes after each NUL
    // would otherwise carry another process's command line into events and capture files.
    zero(s.args.as_mut_ptr().cast::<u64>(), ARG_LEN * ARGV_SLOTS / 8);
    s.argc = 0;
    s.truncated = 0;
    for i in 0..ARGV_SLOTS {
        let p: *const u8 = unsafe { bpf_probe_read_user(argv.add(i)) }.unwrap_or(core::ptr::null());
        if p.is_null() {
            break;
        }
        if unsafe { bpf_probe_read_user_str_bytes(p, &mut s.args[i]) }.is_err() {
            s.args[i][0] = 0;
        }
        s.argc = i as u32 + 1;
    }
    if s.argc as usize == ARGV_SLOTS {
        let more: *const u8 =
            unsafe { bpf_probe_read_user(argv.add(ARGV_SLOTS)) }.unwrap_or(core::ptr::null());
        s.truncated = u32::from(!more.is_null());
    }
    let (_, tid) = ids();
    EXEC_ARGS.insert(&tid, s, 0).map_err(|e| e as i32)
}

#[tracepoint]
pub fn sched_process_exec(ctx: TracePointContext) -> u32 {
    let _ = try_exec(&ctx);
    0
}

fn try_exec(ctx: &TracePointContext) -> Result<(), i32> {
    // The thread that called execve: a non-leader thread becomes the leader on exec.
    let old_pid: i32 = field(ctx, cfg(|c| &c.exec_old_pid))?;
    let old_pid = old_pid as u32;
    let loc: u32 = field(ctx, cfg(|c| &c.exec_filename))?;
    // A holder's own events come after its take.
    crate::pending::send_by(Some(ids().0));
    let mut entry = reserve::<ExecEvent>().ok_or(0)?;
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points at a reserved, writable ring buffer entry of the right size;
    // every field is written before submit.
    unsafe {
        // Ring buffer memory holds older records: clear what is not always written.
        zero((*ev).filename.as_mut_ptr().cast::<u64>(), FILENAME_LEN / 8);
        (*ev).hdr = header(EventKind::Exec, now());
        (*ev).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        // Known here even when the program is gone before userspace reads this.
        (*ev).netns = current_netns();
        (*ev)._pad = 0;
        // __data_loc: low 16 bits offset from the record start, high 16 bits length.
        let src = (ctx.as_ptr() as *const u8).add((loc & 0xffff) as usize);
        if bpf_probe_read_kernel_str_bytes(src, &mut (*ev).filename).is_err() {
            (*ev).filename[0] = 0;
        }
        (*ev).filename[FILENAME_LEN - 1] = 0;
        match EXEC_ARGS.get(&old_pid) {
            Some(a) => {
                let dst = core::slice::from_raw_parts_mut(
                    (*ev).args.as_mut_ptr().cast::<u8>(),
                    ARG_LEN * ARGV_SLOTS,
                );
                if bpf_probe_read_kernel_buf(a.args.as_ptr().cast::<u8>(), dst).is_err() {
                    (*ev).argc = 0;
                } else {
                    (*ev).argc = a.argc;
                }
                (*ev).args_truncated = a.truncated;
            }
            None => {
                zero(
                    (*ev).args.as_mut_ptr().cast::<u64>(),
                    ARG_LEN * ARGV_SLOTS / 8,
                );
                (*ev).argc = 0;
                (*ev).args_truncated = 0;
            }
        }
    }
    let _ = EXEC_ARGS.remove(&old_pid);
    entry.submit(crate::emit::wake_flags::<ExecEvent>(true));
    Ok(())
}

#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    let child: i32 = field(&ctx, cfg(|c| &c.fork_child_pid)).unwrap_or(0);
    crate::pending::send_by(Some(ids().0));
    let ev = ForkEvent {
        hdr: header(EventKind::Fork, now()),
        child_tid: child as u32,
        _pad: 0,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    };
    output(&ev);
    0
}

#[tracepoint]
pub fn sys_enter_exit_group(ctx: TracePointContext) -> u32 {
    save_exit_code(field(&ctx, cfg(|c| &c.exit_code)).unwrap_or(0));
    0
}

#[fentry(function = "__x64_sys_exit_group")]
pub fn exit_group_syscall_fentry(ctx: FEntryContext) -> u32 {
    save_exit_code(syscall_arg(ctx.arg(0), 0).unwrap_or(0));
    0
}

#[kprobe]
pub fn exit_group_syscall_kprobe(ctx: ProbeContext) -> u32 {
    save_exit_code(syscall_arg(ctx.arg(0).unwrap_or(0), 0).unwrap_or(0));
    0
}

#[inline(always)]
fn save_exit_code(code: u64) {
    let (tgid, _) = ids();
    let _ = EXIT_CODES.insert(&tgid, &(code as i32), 0);
}

#[tracepoint]
pub fn sched_process_exit(_ctx: TracePointContext) -> u32 {
    let (tgid, tid) = ids();
    let mut code = None;
    if tid == tgid {
        // SAFETY: read of our own entry; removed right after.
        code = unsafe { EXIT_CODES.get(&tgid) }.copied();
        let _ = EXIT_CODES.remove(&tgid);
    }
    crate::pending::send_by(Some(tgid));
    let ev = ExitEvent {
        hdr: header(EventKind::Exit, now()),
        exit_code: code.unwrap_or(0),
        has_code: u32::from(code.is_some()),
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    };
    output(&ev);
    0
}
