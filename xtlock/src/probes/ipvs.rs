//! The IPVS hooks (kube-proxy's ipvs mode): kprobes/kretprobes on functions of the `ip_vs`
//! module. What they see is described in `xtlock-ebpf/src/probes/ipvs.rs` and docs/ipvs.md.
//!
//! Each is a [`KfuncHook`] of the kernel-function layer (kallsyms, attach, status, and a late
//! attach when ip_vs loads after start). Their setup writes `IPVS_CONFIG`: the struct member
//! offsets from the module's split BTF (`/sys/kernel/btf/ip_vs`), never hard-coded, and the
//! kernel's HZ (to turn the connection timer's jiffies into time) from /proc/timer_list.
//! fentry is not a candidate: aya 0.14 attaches it only to vmlinux functions, and these are
//! all in the module.

use aya::Ebpf;
use xtlock_common::IpvsConfig;

use super::btf::Btf;
use super::kfunc::{fill_config_once, Chosen, KfuncHook, Reads, Want};

/// Minimum spacing of stale-packet events per connection.
pub const STALE_INTERVAL_NS: u64 = 1_000_000_000;

/// One hook per function: aya loads a program once, and the kernel-function layer attaches
/// each hook's programs to its one function.
const fn hook(
    name: &'static str,
    purpose: &'static str,
    functions: &'static [&'static str],
    kprobe: Option<&'static str>,
    kretprobe: Option<&'static str>,
    reads: Reads,
) -> KfuncHook {
    KfuncHook {
        name,
        purpose,
        functions,
        module: Some("ip_vs"),
        fentry: None,
        fexit: None,
        kprobe,
        kretprobe,
        kprobe_first: None,
        setup: Some(setup),
        reads: Some(reads),
    }
}

/// What a kprobe reads: the parameters up to the last one read, and the return value.
const fn reads(args: &'static [Want], ret: Want) -> Reads {
    Reads {
        args,
        fexit_params: None,
        ret,
    }
}

/// `int ip_vs_add_dest(struct ip_vs_service *svc, struct ip_vs_dest_user_kern *udest)`, and
/// del/edit alike.
const DEST_OP: Reads = reads(
    &[
        Want::Ptr("ip_vs_service"),
        Want::Ptr("ip_vs_dest_user_kern"),
    ],
    Want::Int,
);
/// `int ip_vs_nat_xmit(struct sk_buff *skb, struct ip_vs_conn *cp, ...)`.
const XMIT: Reads = reads(&[Want::Any, Want::Ptr("ip_vs_conn")], Want::Any);

pub const CONN_NEW: KfuncHook = hook(
    "ipvs_conn_new",
    "IPVS connections scheduled: virtual service, client, real server",
    &["ip_vs_conn_new"],
    None,
    Some("ipvs_conn_new"),
    reads(&[], Want::Ptr("ip_vs_conn")),
);
pub const NAT_XMIT: KfuncHook = hook(
    "ipvs_nat_xmit",
    "IPVS packets forwarded (NAT, kube-proxy's mode), counted per service and real server; \
     packets still sent to weight-0 real servers",
    &["ip_vs_nat_xmit"],
    Some("ipvs_nat_xmit"),
    None,
    XMIT,
);
pub const NAT_XMIT_V6: KfuncHook = hook(
    "ipvs_nat_xmit_v6",
    "the same for IPv6 services",
    &["ip_vs_nat_xmit_v6"],
    Some("ipvs_nat_xmit_v6"),
    None,
    XMIT,
);
pub const CONN_IN_GET: KfuncHook = hook(
    "ipvs_conn_in_get",
    "IPVS packets of connections whose real server was removed (dropped or expired)",
    &["ip_vs_conn_in_get_proto"],
    None,
    Some("ipvs_conn_in_get"),
    reads(&[], Want::Ptr("ip_vs_conn")),
);
pub const CONN_EXPIRE: KfuncHook = hook(
    "ipvs_conn_expire",
    "the end of IPVS connections still sent to a removed or weight-0 real server",
    &["ip_vs_conn_expire"],
    Some("ipvs_conn_expire"),
    None,
    reads(&[Want::Ptr("timer_list")], Want::Any),
);
pub const ADD_DEST: KfuncHook = hook(
    "ipvs_add_dest",
    "IPVS real servers added, and by whom",
    &["ip_vs_add_dest"],
    Some("ipvs_add_dest"),
    Some("ipvs_add_dest_ret"),
    DEST_OP,
);
pub const DEL_DEST: KfuncHook = hook(
    "ipvs_del_dest",
    "IPVS real servers removed, and by whom",
    &["ip_vs_del_dest"],
    Some("ipvs_del_dest"),
    Some("ipvs_del_dest_ret"),
    DEST_OP,
);
pub const EDIT_DEST: KfuncHook = hook(
    "ipvs_edit_dest",
    "IPVS real-server weight changes (0: graceful termination), and by whom",
    &["ip_vs_edit_dest"],
    Some("ipvs_edit_dest"),
    Some("ipvs_edit_dest_ret"),
    DEST_OP,
);

pub const ADD_SERVICE: KfuncHook = hook(
    "ipvs_add_service",
    "IPVS virtual services added, and by whom",
    &["ip_vs_add_service"],
    Some("ipvs_add_service"),
    Some("ipvs_add_service_ret"),
    reads(
        &[Want::Any, Want::Ptr("ip_vs_service_user_kern")],
        Want::Int,
    ),
);
pub const EDIT_SERVICE: KfuncHook = hook(
    "ipvs_edit_service",
    "IPVS virtual services edited (scheduler, persistence), and by whom",
    &["ip_vs_edit_service"],
    Some("ipvs_edit_service"),
    Some("ipvs_edit_service_ret"),
    reads(&[Want::Ptr("ip_vs_service")], Want::Int),
);
pub const UNLINK_SERVICE: KfuncHook = hook(
    "ipvs_unlink_service",
    "IPVS virtual services removed (deleted or flushed), and by whom",
    &["ip_vs_unlink_service"],
    Some("ipvs_unlink_service"),
    None,
    reads(&[Want::Ptr("ip_vs_service")], Want::Any),
);

/// The hooks whose maps hold the packet counters.
pub const COUNTING_HOOKS: &[&str] = &["ipvs_nat_xmit", "ipvs_nat_xmit_v6", "ipvs_conn_in_get"];

/// Writes `IPVS_CONFIG` (once: every IPVS hook calls it): offsets from the module's BTF and
/// the kernel's HZ.
fn setup(ebpf: &mut Ebpf, vmlinux: Option<&Btf>, _: &Chosen<'_>) -> Result<(), String> {
    fill_config_once(
        ebpf,
        "IPVS_CONFIG",
        |c: &IpvsConfig| c.ok != 0,
        || {
            // After start the vmlinux BTF was dropped; read it again (a module loaded later).
            let owned;
            let base = match vmlinux {
                Some(b) => b,
                None => {
                    owned = Btf::vmlinux().map_err(|e| format!("no kernel BTF ({e})"))?;
                    &owned
                }
            };
            let btf = Btf::module(base, "ip_vs").map_err(|e| {
                format!(
                    "no BTF for module ip_vs, where the IPVS structs' offsets come from \
                     (module BTF needs Linux >= 5.11 with CONFIG_DEBUG_INFO_BTF_MODULES): {e}"
                )
            })?;
            let mut c = IpvsConfig::default();
            fill_offsets(&mut c, &btf)?;
            let hz = kernel_hz().map_err(|e| format!("HZ of this kernel unknown ({e})"))?;
            c.ns_per_jiffy = 1_000_000_000 / hz;
            c.stale_interval_ns = STALE_INTERVAL_NS;
            c.ok = 1;
            Ok(c)
        },
    )
}

/// Struct member offsets from the module's BTF.
fn fill_offsets(c: &mut IpvsConfig, btf: &Btf) -> Result<(), String> {
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
    c.usvc_af = m("ip_vs_service_user_kern", "af")?;
    c.usvc_protocol = m("ip_vs_service_user_kern", "protocol")?;
    c.usvc_addr = m("ip_vs_service_user_kern", "addr")?;
    c.usvc_port = m("ip_vs_service_user_kern", "port")?;
    tracing::debug!(?c, "IPVS offsets from BTF");
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
