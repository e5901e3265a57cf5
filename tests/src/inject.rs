//! Make another process close one of its file descriptors, behind its back, with ptrace.
//!
//! gdb's `call close(fd)` does the same but saves and restores the thread's whole extended
//! FPU state, which fails on AMX-capable CPUs ("Couldn't write extended state status: Bad
//! address"). This touches only the general registers: stop one thread, point it at a
//! `syscall` instruction already in its executable memory, single-step it through
//! `close(fd)`, then put every register back, so whatever syscall it was blocked in restarts
//! as after any signal.

use std::{fs, io, os::unix::fs::FileExt};

use anyhow::{bail, Context as _, Result};

/// Closes `fd` in process `pid`; returns what `close()` returned there (0, or -errno).
#[cfg(target_arch = "x86_64")]
pub fn close_fd_in(pid: u32, fd: u32) -> Result<i64> {
    let syscall_at = find_syscall_instruction(pid)?;
    let tid = pid as libc::pid_t;
    let _attached = Attached::seize(tid)?;
    // SAFETY: a zeroed user_regs_struct is valid (plain integers).
    let mut saved: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    ptrace(libc::PTRACE_GETREGS, tid, 0, &mut saved as *mut _ as usize).context("GETREGS")?;
    let mut regs = saved;
    regs.rip = syscall_at;
    regs.rax = libc::SYS_close as u64;
    regs.rdi = u64::from(fd);
    // -1: not in a syscall, so the kernel's restart logic leaves this one alone.
    regs.orig_rax = u64::MAX;
    ptrace(libc::PTRACE_SETREGS, tid, 0, &regs as *const _ as usize).context("SETREGS")?;
    ptrace(libc::PTRACE_SINGLESTEP, tid, 0, 0).context("SINGLESTEP")?;
    wait_stopped(tid)?;
    let mut after: libc::user_regs_struct = regs;
    ptrace(libc::PTRACE_GETREGS, tid, 0, &mut after as *mut _ as usize).context("GETREGS")?;
    ptrace(libc::PTRACE_SETREGS, tid, 0, &saved as *const _ as usize).context("restore")?;
    if after.rip != syscall_at + 2 {
        bail!(
            "the thread did not step over the syscall (rip {:#x}, expected {:#x})",
            after.rip,
            syscall_at + 2
        );
    }
    Ok(after.rax as i64)
}

#[cfg(not(target_arch = "x86_64"))]
pub fn close_fd_in(_pid: u32, _fd: u32) -> Result<i64> {
    bail!("closing another process's fd is implemented for x86-64 only")
}

/// Any `0f 05` (x86-64 `syscall`) byte pair in the process's executable mappings: executed
/// from there it is a syscall, whatever instruction it is part of otherwise.
#[cfg(target_arch = "x86_64")]
fn find_syscall_instruction(pid: u32) -> Result<u64> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).context("reading its maps")?;
    let mem = fs::File::open(format!("/proc/{pid}/mem")).context("opening its memory")?;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        if !perms.contains('x') || line.contains("[vsyscall]") {
            continue;
        }
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (lo, hi) = (u64::from_str_radix(lo, 16)?, u64::from_str_radix(hi, 16)?);
        let mut buf = vec![0u8; (hi - lo).min(1 << 20) as usize];
        let n = match mem.read_at(&mut buf, lo) {
            Ok(n) => n,
            Err(_) => continue,
        };
        if let Some(i) = buf[..n].windows(2).position(|w| w == [0x0f, 0x05]) {
            return Ok(lo + i as u64);
        }
    }
    bail!("no syscall instruction in process {pid}'s executable memory")
}

fn ptrace(req: libc::c_uint, tid: libc::pid_t, addr: usize, data: usize) -> io::Result<()> {
    // SAFETY: the requests used here read or write only the struct `data` points to.
    let r = unsafe { libc::ptrace(req, tid, addr, data) };
    if r == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn wait_stopped(tid: libc::pid_t) -> Result<()> {
    let mut status = 0;
    // SAFETY: plain syscall with a valid out pointer.
    let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
    if r == -1 {
        return Err(io::Error::last_os_error()).context("waitpid");
    }
    if !libc::WIFSTOPPED(status) {
        bail!("thread {tid} did not stop (status {status:#x})");
    }
    Ok(())
}

/// A seized, stopped thread, detached (and so resumed) on drop.
struct Attached(libc::pid_t);

impl Attached {
    fn seize(tid: libc::pid_t) -> Result<Attached> {
        ptrace(libc::PTRACE_SEIZE, tid, 0, 0).with_context(|| format!("PTRACE_SEIZE {tid}"))?;
        let a = Attached(tid);
        ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0).context("PTRACE_INTERRUPT")?;
        wait_stopped(tid)?;
        Ok(a)
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let _ = ptrace(libc::PTRACE_DETACH, self.0, 0, 0);
    }
}
