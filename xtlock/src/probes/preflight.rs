//! Checks made before loading anything, so a missing privilege or kernel feature gives one
//! clear sentence instead of a verifier log.

use std::{error::Error, fs, path::Path};

use super::ProbeError;

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Effective capability mask of this process.
fn effective_caps() -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

fn has(caps: u64, cap: u32) -> bool {
    caps & (1u64 << cap) != 0
}

/// Fails with a plain explanation when this process cannot load tracing programs.
pub fn check() -> Result<(), ProbeError> {
    let caps = effective_caps().unwrap_or(0);
    let admin = has(caps, CAP_SYS_ADMIN);
    if !(admin || (has(caps, CAP_BPF) && has(caps, CAP_PERFMON))) {
        return Err(ProbeError::Permission(
            "xtlock needs root to load its BPF programs (or the capability CAP_SYS_ADMIN, or \
             CAP_BPF and CAP_PERFMON on Linux >= 5.8): run it with sudo, e.g. `sudo xtlock \
             trace`; in a container, add CAP_SYS_ADMIN (what runtimes' default seccomp \
             profiles allow bpf() with)"
                .into(),
        ));
    }
    // Every event goes through the ring buffer: on a kernel without it (4.19, 5.4...) the
    // object's load would fail with a bare EINVAL from map creation.
    match aya::sys::is_map_supported(aya::maps::MapType::RingBuf) {
        Ok(true) => {}
        Ok(false) => {
            return Err(ProbeError::NoRingBuffer {
                release: fs::read_to_string("/proc/sys/kernel/osrelease")
                    .map(|r| r.trim().to_string())
                    .unwrap_or_else(|_| "unknown release".into()),
            })
        }
        // An unexpected probe error: let the load say what it is.
        Err(e) => tracing::debug!(error = %e, "probing for BPF ring buffers"),
    }
    if let Ok(v) = fs::read_to_string("/proc/sys/kernel/unprivileged_bpf_disabled") {
        tracing::debug!(unprivileged_bpf_disabled = v.trim(), "sysctl");
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        // Tracepoint programs do not need BTF; later hooks (fentry, tp_btf) will.
        tracing::info!("kernel has no BTF (/sys/kernel/btf/vmlinux): BTF-based hooks unavailable");
    }
    Ok(())
}

/// The whole `source()` chain of an error on one line.
pub fn error_chain(e: &dyn Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// `Seccomp:` of /proc/self/status: 2 when a seccomp filter (a container runtime's
/// profile) is applied.
fn seccomp_filtered() -> bool {
    fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.split_whitespace().eq(["Seccomp:", "2"]))
    })
}

/// Turns an object-load failure into advice.
pub fn explain_load_error(e: &aya::EbpfError) -> ProbeError {
    let chain = error_chain(e);
    if chain.contains("Operation not permitted") || chain.contains("EPERM") {
        let caps = effective_caps().unwrap_or(0);
        // Container runtimes' default seccomp profiles allow bpf() only with CAP_SYS_ADMIN
        // (newer ones also with CAP_BPF): the likeliest cause in a container.
        if seccomp_filtered() && !has(caps, CAP_SYS_ADMIN) {
            return ProbeError::Permission(format!(
                "the kernel refused to create BPF maps or programs ({chain}): this process runs \
                 under a seccomp filter (a container runtime's default profile) and without \
                 CAP_SYS_ADMIN, and such profiles allow bpf() only with CAP_SYS_ADMIN; add \
                 CAP_SYS_ADMIN, or run with a seccomp profile that allows bpf()"
            ));
        }
        ProbeError::Permission(format!(
            "the kernel refused to create BPF maps or programs ({chain}); run xtlock as root, \
             and check that no security policy (lockdown, seccomp, a container profile) blocks bpf()"
        ))
    } else {
        ProbeError::Load(chain)
    }
}
