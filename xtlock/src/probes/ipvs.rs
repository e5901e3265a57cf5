//! The IPVS hooks (kube-proxy's ipvs mode): kprobes/kretprobes on functions of the `ip_vs`
//! module. What they see is described in `xtlock-ebpf/src/probes/ipvs.rs` and docs/ipvs.md.
//!
//! Discovery: the functions from /proc/kallsyms (the module must be loaded), the struct
//! member offsets from the module's split BTF (`/sys/kernel/btf/ip_vs`), never hard-coded,
//! and the kernel's HZ (to turn the connection timer's jiffies into time) from
//! /proc/timer_list. fentry is not a candidate: aya 0.14 attaches it only to vmlinux
//! functions, and these are all in the module.

use std::path::Path;

use aya::{programs::KProbe, Ebpf};
use xtlock_common::ProbeConfig;

use super::btf::Btf;
use super::nft_commit::kallsyms_functions;

/// The hook's name in `xtlock probes`.
pub const HOOK: &str = "ipvs";
pub const PURPOSE: &str = "IPVS (kube-proxy ipvs mode): connections scheduled to real servers, \
                           packets per service and real server, packets still sent to removed \
                           or weight-0 real servers, real-server changes and who made them";
/// Minimum spacing of stale-packet events per connection.
pub const STALE_INTERVAL_NS: u64 = 1_000_000_000;

/// One program and the functions it goes on.
struct Attachment {
    program: &'static str,
    functions: &'static [&'static str],
    /// Without it the hook is not attached at all.
    required: bool,
}

/// Every IPVS program, in attach order. The table changes go first so their return probe
/// finds its entries.
const ATTACHMENTS: &[Attachment] = &[
    Attachment {
        program: "ipvs_conn_new",
        functions: &["ip_vs_conn_new"],
        required: true,
    },
    Attachment {
        program: "ipvs_xmit",
        functions: &[
            "ip_vs_nat_xmit",
            "ip_vs_dr_xmit",
            "ip_vs_tunnel_xmit",
            "ip_vs_nat_xmit_v6",
            "ip_vs_dr_xmit_v6",
            "ip_vs_tunnel_xmit_v6",
        ],
        required: true,
    },
    Attachment {
        program: "ipvs_conn_in_get",
        functions: &["ip_vs_conn_in_get_proto"],
        required: false,
    },
    Attachment {
        program: "ipvs_conn_expire",
        functions: &["ip_vs_conn_expire"],
        required: false,
    },
    Attachment {
        program: "ipvs_dest_op_ret",
        functions: &["ip_vs_add_dest", "ip_vs_del_dest", "ip_vs_edit_dest"],
        required: false,
    },
    Attachment {
        program: "ipvs_add_dest",
        functions: &["ip_vs_add_dest"],
        required: false,
    },
    Attachment {
        program: "ipvs_del_dest",
        functions: &["ip_vs_del_dest"],
        required: false,
    },
    Attachment {
        program: "ipvs_edit_dest",
        functions: &["ip_vs_edit_dest"],
        required: false,
    },
];

/// What the running kernel offers for the IPVS hooks.
#[derive(Clone, Debug, Default)]
pub struct IpvsFacts {
    /// Functions of [`ATTACHMENTS`] found in /proc/kallsyms.
    pub symbols: Vec<String>,
    /// Why the hooks cannot be used at all (module not loaded, no BTF, no kprobes).
    pub unusable: Option<String>,
}

/// Why nothing can be attached, in plain words.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IpvsError {
    #[error("module ip_vs not loaded")]
    NotLoaded,
    #[error("kernel built without kprobes (fentry: aya 0.14 cannot attach to module functions)")]
    NoKprobes,
    #[error("no BTF for module ip_vs ({0}): struct offsets unknown")]
    NoBtf(String),
    #[error("HZ of this kernel unknown ({0})")]
    NoHz(String),
}

/// Reads the facts and fills the IPVS part of `config`. `vmlinux`: the parsed vmlinux BTF.
pub fn discover(
    config: &mut ProbeConfig,
    tracefs: &Path,
    vmlinux: Result<&Btf, String>,
) -> IpvsFacts {
    let mut facts = IpvsFacts::default();
    let wanted: Vec<&str> = ATTACHMENTS
        .iter()
        .flat_map(|a| a.functions.iter().copied())
        .collect();
    if let Ok(text) = std::fs::read_to_string("/proc/kallsyms") {
        facts.symbols = kallsyms_functions(&text, &wanted)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
    }
    let res = (|| {
        if !Path::new("/sys/module/ip_vs").exists() && facts.symbols.is_empty() {
            return Err(IpvsError::NotLoaded);
        }
        let kprobes = Path::new("/sys/bus/event_source/devices/kprobe").exists()
            || tracefs.join("kprobe_events").exists();
        if !kprobes {
            return Err(IpvsError::NoKprobes);
        }
        let base = vmlinux.map_err(IpvsError::NoBtf)?;
        let btf = Btf::module(base, "ip_vs").map_err(|e| IpvsError::NoBtf(e.to_string()))?;
        fill_offsets(config, &btf).map_err(IpvsError::NoBtf)?;
        let hz = kernel_hz().map_err(IpvsError::NoHz)?;
        config.ns_per_jiffy = 1_000_000_000 / hz;
        config.ipvs_stale_interval_ns = STALE_INTERVAL_NS;
        config.ipvs_ok = 1;
        Ok(())
    })();
    if let Err(e) = res {
        facts.unusable = Some(e.to_string());
    }
    facts
}

/// Struct member offsets from the module's BTF.
fn fill_offsets(c: &mut ProbeConfig, btf: &Btf) -> Result<(), String> {
    let m = |s: &str, p: &str| btf.member_offset(s, p).map_err(|e| e.to_string());
    c.conn_af = m("ip_vs_conn", "af")?;
    c.conn_protocol = m("ip_vs_conn", "protocol")?;
    c.conn_caddr = m("ip_vs_conn", "caddr")?;
    c.conn_vaddr = m("ip_vs_conn", "vaddr")?;
    c.conn_daddr = m("ip_vs_conn", "daddr")?;
    c.conn_cport = m("ip_vs_conn", "cport")?;
    c.conn_vport = m("ip_vs_conn", "vport")?;
    c.conn_dport = m("ip_vs_conn", "dport")?;
    c.conn_flags = m("ip_vs_conn", "flags")?;
    c.conn_dest = m("ip_vs_conn", "dest")?;
    c.conn_timer = m("ip_vs_conn", "timer")?;
    c.conn_timer_expires = m("ip_vs_conn", "timer.expires")?;
    c.conn_ipvs = m("ip_vs_conn", "ipvs")?;
    c.ipvs_expire_nodest = m("netns_ipvs", "sysctl_expire_nodest_conn")?;
    // Where the "available" bit lives: `cflags` since the 2026 split of the IPVS flags
    // (backported to stable kernels: Debian's 6.1.192 has it), `flags` before.
    match btf.member_offset("ip_vs_dest", "cflags") {
        Ok(off) => {
            c.dest_flags = off;
            c.dest_avail_wide = 1;
        }
        Err(_) => {
            c.dest_flags = m("ip_vs_dest", "flags")?;
            c.dest_avail_wide = 0;
        }
    }
    c.dest_weight = m("ip_vs_dest", "weight")?;
    c.svc_af = m("ip_vs_service", "af")?;
    c.svc_protocol = m("ip_vs_service", "protocol")?;
    c.svc_addr = m("ip_vs_service", "addr")?;
    c.svc_port = m("ip_vs_service", "port")?;
    c.udest_addr = m("ip_vs_dest_user_kern", "addr")?;
    c.udest_port = m("ip_vs_dest_user_kern", "port")?;
    c.udest_weight = m("ip_vs_dest_user_kern", "weight")?;
    tracing::debug!(
        conn_dest = c.conn_dest,
        conn_timer = c.conn_timer,
        dest_flags = c.dest_flags,
        dest_avail_wide = c.dest_avail_wide,
        dest_weight = c.dest_weight,
        svc_addr = c.svc_addr,
        "IPVS offsets from BTF"
    );
    Ok(())
}

/// HZ, from two readings of /proc/timer_list (`now at N nsecs`, `jiffies: J`) 100 ms apart,
/// rounded to the nearest value a kernel can be built with.
fn kernel_hz() -> Result<u64, String> {
    let read = || -> Result<(u64, u64), String> {
        let text = std::fs::read_to_string("/proc/timer_list")
            .map_err(|e| format!("/proc/timer_list: {e}"))?;
        parse_timer_list(&text).ok_or_else(|| "/proc/timer_list: no `now at` or `jiffies:`".into())
    };
    let (n1, j1) = read()?;
    std::thread::sleep(std::time::Duration::from_millis(100));
    let (n2, j2) = read()?;
    hz_from(n2.saturating_sub(n1), j2.saturating_sub(j1))
        .ok_or_else(|| "jiffies did not advance".into())
}

/// (`now at` ns, first `jiffies:`) of a /proc/timer_list text.
fn parse_timer_list(text: &str) -> Option<(u64, u64)> {
    let mut now = None;
    let mut jiffies = None;
    for line in text.lines() {
        if now.is_none() {
            if let Some(rest) = line.strip_prefix("now at ") {
                now = rest.split_whitespace().next()?.parse().ok();
            }
        }
        if jiffies.is_none() {
            if let Some(rest) = line.trim_start().strip_prefix("jiffies:") {
                jiffies = rest.trim().parse().ok();
            }
        }
        if now.is_some() && jiffies.is_some() {
            break;
        }
    }
    Some((now?, jiffies?))
}

fn hz_from(dt_ns: u64, djiffies: u64) -> Option<u64> {
    if dt_ns == 0 || djiffies == 0 {
        return None;
    }
    let measured = djiffies as f64 * 1e9 / dt_ns as f64;
    [100u64, 250, 300, 1000].into_iter().min_by(|a, b| {
        (*a as f64 - measured)
            .abs()
            .total_cmp(&(*b as f64 - measured).abs())
    })
}

/// Attaches every program to the functions of it that this kernel has. `Ok`: what attached
/// (for `xtlock probes`); `Err`: why the hook is not attached.
pub fn attach(ebpf: &mut Ebpf, facts: &IpvsFacts) -> Result<String, String> {
    if let Some(why) = &facts.unusable {
        return Err(why.clone());
    }
    let mut attached = Vec::new();
    let mut missing = Vec::new();
    for a in ATTACHMENTS {
        let present: Vec<&str> = a
            .functions
            .iter()
            .copied()
            .filter(|f| facts.symbols.iter().any(|s| s == f))
            .collect();
        if present.is_empty() {
            if a.required {
                return Err(format!(
                    "none of {} in /proc/kallsyms",
                    a.functions.join(", ")
                ));
            }
            missing.push(a.program);
            continue;
        }
        let res = (|| -> Result<(), String> {
            let p: &mut KProbe = ebpf
                .program_mut(a.program)
                .ok_or_else(|| format!("program {} missing from the BPF object", a.program))?
                .try_into()
                .map_err(|e: aya::programs::ProgramError| e.to_string())?;
            p.load()
                .map_err(|e| format!("{}: {}", a.program, super::preflight::error_chain(&e)))?;
            for f in &present {
                p.attach(*f, 0)
                    .map_err(|e| format!("{f}: {}", super::preflight::error_chain(&e)))?;
            }
            Ok(())
        })();
        match res {
            Ok(()) => {
                for f in present {
                    if !attached.contains(&f) {
                        attached.push(f);
                    }
                }
            }
            Err(e) if a.required => return Err(e),
            Err(e) => {
                tracing::warn!(program = a.program, error = %e, "IPVS probe not attached");
                missing.push(a.program);
            }
        }
    }
    let mut describe = format!(
        "kprobe/kretprobe on {} (fentry: aya 0.14 cannot attach to module functions)",
        attached.join(", ")
    );
    if !missing.is_empty() {
        describe.push_str(&format!("; without {}", missing.join(", ")));
    }
    Ok(describe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hz_rounds_to_a_kernel_value() {
        assert_eq!(hz_from(100_000_000, 25), Some(250));
        assert_eq!(hz_from(100_000_000, 26), Some(250));
        assert_eq!(hz_from(100_000_000, 10), Some(100));
        assert_eq!(hz_from(101_000_000, 101), Some(1000));
        assert_eq!(hz_from(100_000_000, 0), None);
    }

    #[test]
    fn timer_list_fields() {
        let text = "Timer List Version: v0.9\nHRTIMER_MAX_CLOCK_BASES: 8\nnow at 10513374955881 \
                    nsecs\n\ncpu: 0\n jiffies: 4297520562\n";
        assert_eq!(
            parse_timer_list(text),
            Some((10_513_374_955_881, 4_297_520_562))
        );
        assert_eq!(parse_timer_list("nothing"), None);
    }
}
