//! Discovery, before load: the kernel's tracepoint layouts (tracefs), BTF and kallsyms
//! facts written into the programs' configuration, and per hook why it cannot be used.

use xtlock_common::{ProbeConfig, RefusalConfig, TpAddr, NO_FIELD};

use super::{
    btf, dropreason::ReasonTable, kfunc, kfunc::AttachFilter, kfunc::KfuncHook, nft_mutex,
    tracefs::Format, Feature, ProbeError, DROP_PROGRAM, HOOKS, KFUNC_HOOKS,
};

/// Field offsets for every hook, and per hook the reason it cannot be used, if any.
pub struct Discovery {
    pub config: ProbeConfig,
    pub unusable: Vec<(&'static str, String)>,
    /// Drop reasons of this kernel (empty when it reports none).
    pub reasons: ReasonTable,
    pub features: Vec<Feature>,
    /// What the kernel-function hooks can attach to.
    pub kfunc: kfunc::KernelFacts,
    /// vmlinux BTF, for the hooks' setup (dropped after load).
    pub btf: Option<btf::Btf>,
    /// Whether the lock hook's raw tracepoint can be used, and if not, why.
    pub raw_lock: Result<(), String>,
    /// Whether the drop hook's raw tracepoint can be used, and if not, why.
    pub raw_drop: Result<(), String>,
    /// Whether the ICMP refusal hook's raw tracepoint can be used, and if not, why.
    pub raw_icmp: Result<(), String>,
    /// Field offsets of the refusal tracepoints.
    pub refusal: RefusalConfig,
    /// TCP reset reasons of this kernel (`enum sk_rst_reason`, empty before Linux 6.10).
    pub rst_reasons: ReasonTable,
    /// The nf_tables mutex hook's configuration, or why it has none (yet).
    pub nft_mutex: Result<nft_mutex::Setup, String>,
    /// Its perf tracepoints' field offsets (kept for a later try when nf_tables loads).
    pub nft_mutex_tp: nft_mutex::TpOffsets,
    /// Whether its raw tracepoints can be used, and if not, why.
    pub raw_nft_mutex: Result<(), String>,
    /// Where `nft_mutex` has no configuration: the part that times and counts batches from
    /// their `sendmsg()` (vmlinux's BTF only), and what it does; `None` without BTF.
    pub nft_batches: Option<(xtlock_common::NftMutexConfig, String)>,
}

impl Discovery {
    /// Why the hook's tracepoint cannot be used (its format file lacks what it reads).
    pub(super) fn unusable_why(&self, program: &str) -> Option<String> {
        self.unusable
            .iter()
            .find(|(p, _)| *p == program)
            .map(|(_, why)| why.clone())
    }
}

/// Reads the format files of every hook and fills the probe configuration.
pub fn discover(tracefs: &std::path::Path, filter: AttachFilter) -> Result<Discovery, ProbeError> {
    let mut config = ProbeConfig::default();
    let mut unusable = Vec::new();
    let mut reasons = ReasonTable::default();
    let mut refusal = RefusalConfig::default();
    let mut rst_reasons = ReasonTable::default();
    let mut nft_mutex_tp = nft_mutex::TpOffsets::default();
    for hook in HOOKS {
        let fmt = match Format::read(tracefs, hook.category, hook.tracepoint)? {
            Some(f) => f,
            None => {
                let mut why = format!(
                    "tracepoint {}:{} does not exist on this kernel",
                    hook.category, hook.tracepoint
                );
                if let Some(m) = hook.missing {
                    why.push_str(&format!(" ({m})"));
                }
                unusable.push((hook.program, why));
                continue;
            }
        };
        let filled = match hook.program {
            p if super::REFUSAL_PROGRAMS.contains(&p) => fill_refusal(&mut refusal, p, &fmt),
            nft_mutex::BEGIN => off(&fmt, &["lock_addr"], 8)
                .and_then(|l| Ok((l, off(&fmt, &["flags"], 4)?)))
                .map(|(l, f)| {
                    nft_mutex_tp.lock = l;
                    nft_mutex_tp.flags = f;
                }),
            nft_mutex::SEND_ENTER => off(&fmt, &["fd"], 8).map(|fd| {
                nft_mutex_tp.send_fd = Some(fd);
                // Without it the batches are timed, not counted.
                nft_mutex_tp.send_msg = off(&fmt, &["msg"], 8).ok();
            }),
            nft_mutex::SEND_EXIT => off(&fmt, &["ret"], 8).map(|r| nft_mutex_tp.exit_ret = Some(r)),
            nft_mutex::END => off(&fmt, &["lock_addr"], 8)
                .and_then(|l| Ok((l, off(&fmt, &["ret"], 4)?)))
                .and_then(|(l, r)| {
                    if nft_mutex_tp.lock != 0 && nft_mutex_tp.lock != l {
                        return Err("lock_addr is at different offsets in contention_begin \
                                    and contention_end"
                            .into());
                    }
                    nft_mutex_tp.lock = l;
                    nft_mutex_tp.ret = r;
                    Ok(())
                }),
            p => fill(&mut config, p, &fmt),
        };
        if let Err(why) = filled {
            unusable.push((hook.program, why));
        }
        if hook.program == "tcp_send_reset" && refusal.rst_reason != NO_FIELD {
            if let Some(t) = fmt.print_fmt.as_deref().and_then(ReasonTable::from_format) {
                rst_reasons = t;
            }
        }
        if hook.program == DROP_PROGRAM {
            if let Some(t) = fmt.print_fmt.as_deref().and_then(ReasonTable::from_format) {
                reasons = t;
            }
        }
    }
    let mut features = Vec::new();
    // Parsed once: under emulation each parse of vmlinux BTF takes seconds.
    let btf = btf::Btf::vmlinux();
    discover_task_netns(&mut config, &btf);
    if !unusable.iter().any(|(p, _)| *p == DROP_PROGRAM) {
        discover_drops(&mut config, &mut reasons, &mut features, &btf);
    }
    discover_syscall_regs(&mut config, &btf);
    let raw_lock = discover_raw_lock(&mut config, &btf);
    let raw_drop = discover_raw_drop(&mut config, &btf);
    let raw_icmp = discover_raw_icmp(&config, &btf);
    // Read once: the kernel formats all of it for each read (5 MB, seconds under emulation).
    let kallsyms = std::fs::read_to_string("/proc/kallsyms")
        .map_err(|e| format!("reading /proc/kallsyms: {e}"));
    let (nft_mutex, raw_nft_mutex) = discover_nft_mutex(&btf, nft_mutex_tp, &kallsyms);
    let nft_batches = btf
        .as_ref()
        .ok()
        .map(|b| nft_mutex::batches(b, nft_mutex_tp));
    let mut wanted: Vec<&KfuncHook> = KFUNC_HOOKS.to_vec();
    wanted.extend(super::hooks::tracepoint_fallbacks());
    let kfunc = kfunc::discover(
        tracefs,
        btf.as_ref().map_err(|e| e.to_string()),
        kallsyms.as_deref().unwrap_or_default(),
        &wanted,
        filter,
    );
    Ok(Discovery {
        config,
        unusable,
        reasons,
        features,
        kfunc,
        btf: btf.ok(),
        raw_lock,
        raw_drop,
        raw_icmp,
        refusal,
        rst_reasons,
        nft_mutex,
        nft_mutex_tp,
        raw_nft_mutex,
        nft_batches,
    })
}

/// The nf_tables mutex hook's configuration (BTF, kallsyms) and whether its raw
/// tracepoints' prototypes are those it reads.
fn discover_nft_mutex(
    btf: &Result<btf::Btf, btf::BtfError>,
    tp: nft_mutex::TpOffsets,
    kallsyms: &Result<String, String>,
) -> (Result<nft_mutex::Setup, String>, Result<(), String>) {
    let b = match btf {
        Ok(b) => b,
        Err(e) => {
            let why = format!("no kernel BTF: {e}");
            return (Err(why.clone()), Err(why));
        }
    };
    let raw = nft_mutex::check_raw(
        nft_mutex::BEGIN,
        b.fn_typedef_params("btf_trace_contention_begin"),
    )
    .and_then(|()| {
        nft_mutex::check_raw(
            nft_mutex::END,
            b.fn_typedef_params("btf_trace_contention_end"),
        )
    });
    let setup = kallsyms
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|k| nft_mutex::config(b, tp, &nft_mutex::symbols(k)));
    (setup, raw)
}

/// What the drop hook's raw tracepoint reads: its arguments (`struct sk_buff *`, the
/// location, and since Linux 5.17 `enum skb_drop_reason`; 6.12 added the receiving socket,
/// unused), checked against the tracepoint's prototype in BTF, and the `sk_buff` members of
/// [`discover_drops`] plus `protocol` (the perf tracepoint's record has it as a field).
fn discover_raw_drop(
    c: &mut ProbeConfig,
    btf: &Result<btf::Btf, btf::BtfError>,
) -> Result<(), String> {
    let b = btf.as_ref().map_err(|e| format!("no kernel BTF: {e}"))?;
    let params = b
        .fn_typedef_params("btf_trace_kfree_skb")
        .ok_or("no btf_trace_kfree_skb prototype in BTF")?;
    let p: Vec<&str> = params.iter().map(String::as_str).collect();
    let has_reason = match p.as_slice() {
        ["void *", "struct sk_buff *", "void *"] => false,
        ["void *", "struct sk_buff *", "void *", "enum skb_drop_reason", ..] => true,
        _ => {
            return Err(format!(
                "its arguments are ({}), expected (struct sk_buff *, void *[, enum \
                 skb_drop_reason])",
                p[1.min(p.len())..].join(", ")
            ))
        }
    };
    if (c.kd_has_reason != 0) != has_reason {
        return Err("the tracepoint's format and its BTF prototype disagree on the reason".into());
    }
    if c.skb_ok == 0 {
        return Err("the sk_buff members it reads were not found in BTF".into());
    }
    match b.member("sk_buff", "protocol") {
        Ok((off, 2)) => c.skb_protocol = off,
        Ok((_, size)) => return Err(format!("sk_buff.protocol is {size} bytes, expected 2")),
        Err(e) => return Err(e.to_string()),
    }
    c.rkd_has_reason = u32::from(has_reason);
    Ok(())
}

/// Whether the raw tracepoint `tp`'s arguments in BTF (after the context's `void *`) are
/// `args`, as the program reads them.
fn check_raw_proto(b: &btf::Btf, tp: &str, args: &[&str]) -> Result<(), String> {
    match b.fn_typedef_params(&format!("btf_trace_{tp}")) {
        Some(p) if p.first().map(String::as_str) == Some("void *") && p[1..] == *args => Ok(()),
        Some(p) => Err(format!(
            "its arguments are ({}), expected ({})",
            p[1.min(p.len())..].join(", "),
            args.join(", ")
        )),
        None => Err(format!("no btf_trace_{tp} prototype in BTF")),
    }
}

/// Whether the ICMP refusal hook's raw tracepoint reads what it expects: `icmp_send`'s
/// prototype (`const struct sk_buff *`, `int type`, `int code`) and the `sk_buff` members
/// the drop hook found (head, network header, device, its netns).
fn discover_raw_icmp(c: &ProbeConfig, btf: &Result<btf::Btf, btf::BtfError>) -> Result<(), String> {
    let b = btf.as_ref().map_err(|e| format!("no kernel BTF: {e}"))?;
    check_raw_proto(b, "icmp_send", &["struct sk_buff *", "int", "int"])?;
    if c.skb_ok == 0 {
        return Err("the sk_buff members it reads were not found in BTF".into());
    }
    Ok(())
}

/// What the lock hook's raw tracepoint reads, from BTF: its arguments (`struct inode *`,
/// `struct file_lock *`, `int ret`, checked against the tracepoint's prototype) and the
/// members it reads through them. The lock request's fields moved into `file_lock.c` (a
/// `struct file_lock_core`) in Linux 6.9. Without BTF the perf tracepoint is used: its
/// record has the same fields, at offsets from its format file.
fn discover_raw_lock(
    c: &mut ProbeConfig,
    btf: &Result<btf::Btf, btf::BtfError>,
) -> Result<(), String> {
    let b = btf.as_ref().map_err(|e| format!("no kernel BTF: {e}"))?;
    check_raw_proto(
        b,
        "flock_lock_inode",
        &["struct inode *", "struct file_lock *", "int"],
    )?;
    let m = |strukt: &str, paths: &[&str], size: u32| -> Result<u32, String> {
        let mut why = String::new();
        for p in paths {
            match b.member(strukt, p) {
                Ok((off, sz)) if sz == size => return Ok(off),
                Ok((_, sz)) => {
                    return Err(format!("{strukt}.{p} is {sz} bytes, expected {size}"));
                }
                Err(e) => why = e.to_string(),
            }
        }
        Err(why)
    };
    let [ino, sb, dev, owner, flags, ty] = [
        m("inode", &["i_ino"], 8)?,
        m("inode", &["i_sb"], 8)?,
        m("super_block", &["s_dev"], 4)?,
        m("file_lock", &["c.flc_owner", "fl_owner"], 8)?,
        m("file_lock", &["c.flc_flags", "fl_flags"], 4)?,
        m("file_lock", &["c.flc_type", "fl_type"], 1)?,
    ];
    c.rfl_inode_ino = ino;
    c.rfl_inode_sb = sb;
    c.rfl_sb_dev = dev;
    c.rfl_owner = owner;
    c.rfl_flags = flags;
    c.rfl_type = ty;
    Ok(())
}

/// Where a syscall's first five arguments live in the user `pt_regs`, for hooks on syscall
/// functions: `di si dx r10 r8` on x86-64, `regs[0..5]` on arm64. Left at 0 when BTF has
/// neither: the programs then read no arguments rather than wrong ones.
fn discover_syscall_regs(c: &mut ProbeConfig, btf: &Result<btf::Btf, btf::BtfError>) {
    let Ok(b) = btf else { return };
    let x86: Result<Vec<u32>, _> = ["di", "si", "dx", "r10", "r8"]
        .iter()
        .map(|r| b.member_offset("pt_regs", r))
        .collect();
    if let Ok(v) = x86 {
        c.regs_args.copy_from_slice(&v);
    } else if let Ok(off) = b.member_offset("pt_regs", "regs") {
        for (i, slot) in c.regs_args.iter_mut().enumerate() {
            *slot = off + 8 * i as u32;
        }
    }
}

/// Offsets to the current task's netns inode (nf_tables commits), from BTF; without them
/// commits are reported with netns unknown.
fn discover_task_netns(c: &mut ProbeConfig, btf: &Result<btf::Btf, btf::BtfError>) {
    let offsets = btf.as_ref().map_err(|e| e.to_string()).and_then(|b| {
        let m = |s: &str, p: &str| b.member_offset(s, p).map_err(|e| e.to_string());
        Ok([
            m("task_struct", "nsproxy")?,
            m("nsproxy", "net_ns")?,
            m("net", "ns.inum")?,
        ])
    });
    match offsets {
        Ok([nsproxy, net_ns, inum]) => {
            c.task_nsproxy = nsproxy;
            c.nsproxy_net_ns = net_ns;
            c.net_ns_inum = inum;
            c.task_ok = 1;
        }
        Err(why) => tracing::warn!(%why, "nf_tables commits will show netns unknown"),
    }
}

/// Struct offsets for drop samples (from BTF) and the drop-reason table; what is missing
/// is reported as an unavailable feature, and drops are still counted without it.
fn discover_drops(
    c: &mut ProbeConfig,
    reasons: &mut ReasonTable,
    features: &mut Vec<Feature>,
    btf: &Result<btf::Btf, btf::BtfError>,
) {
    if c.kd_has_reason == 0 {
        *reasons = ReasonTable::default();
        features.push(Feature {
            name: "drop reasons",
            available: false,
            detail: "skb:kfree_skb has no `reason` field (Linux < 5.17): drops are counted \
                     per location (the kernel function that freed the packet, `by_location`), \
                     each with reason `unknown`"
                .into(),
        });
    } else {
        if reasons.names.is_empty() {
            if let Some(t) = btf
                .as_ref()
                .ok()
                .and_then(|b| b.enum_values("skb_drop_reason"))
                .and_then(|v| ReasonTable::from_enum(&v))
            {
                *reasons = t;
            }
        }
        features.push(Feature {
            name: "drop reasons",
            available: !reasons.names.is_empty(),
            detail: if reasons.names.is_empty() {
                "the kernel reports reason numbers but their names were not found (neither \
                 in the format file nor in BTF): reasons are shown as numbers"
                    .into()
            } else {
                // The whole list is long (over 100 on recent kernels): a few, and where the
                // rest is.
                let few: Vec<&str> = reasons.names.values().map(String::as_str).take(4).collect();
                format!(
                    "{} reasons named by this kernel ({}, ...; `xtlock probes --json` lists \
                     them all), usable in --drop-reasons",
                    reasons.names.len(),
                    few.join(", ")
                )
            },
        });
    }
    let offsets = btf.as_ref().map_err(|e| e.to_string()).and_then(|b| {
        let m = |s: &str, p: &str| b.member_offset(s, p).map_err(|e| e.to_string());
        Ok([
            m("sk_buff", "head")?,
            m("sk_buff", "network_header")?,
            m("sk_buff", "transport_header")?,
            m("sk_buff", "dev")?,
            m("sk_buff", "sk")?,
            m("net_device", "ifindex")?,
            m("net_device", "nd_net.net")?,
            m("net", "ns.inum")?,
            m("sock", "__sk_common.skc_net.net")?,
        ])
    });
    match offsets {
        Ok([head, nh, th, dev, sk, ifindex, nd_net, inum, sk_net]) => {
            c.skb_head = head;
            c.skb_network_header = nh;
            c.skb_transport_header = th;
            c.skb_dev = dev;
            c.skb_sk = sk;
            c.dev_ifindex = ifindex;
            c.dev_nd_net = nd_net;
            c.net_ns_inum = inum;
            c.sk_net = sk_net;
            c.skb_ok = 1;
            features.push(Feature {
                name: "drop addresses",
                available: true,
                detail: "sk_buff/net_device/net offsets from BTF: samples carry netns, \
                         interface and 5-tuple"
                    .into(),
            });
        }
        Err(why) => features.push(Feature {
            name: "drop addresses",
            available: false,
            detail: format!(
                "no usable kernel BTF ({why}): drops are counted, but without netns, \
                 interface or addresses"
            ),
        }),
    }
}

/// Offset of the first field named in `names`, checking its size.
fn off(fmt: &Format, names: &[&str], size: u32) -> Result<u32, String> {
    let f = fmt
        .field(names)
        .ok_or_else(|| format!("no field {} in its format file", names.join("/")))?;
    if f.size != size {
        return Err(format!(
            "field {} is {} bytes, expected {size}: layout not supported",
            f.name, f.size
        ));
    }
    Ok(f.offset)
}

/// Offset of field `name` when the format has it, checking its size; [`NO_FIELD`] when not.
fn opt_off(fmt: &Format, name: &str, size: u32) -> Result<u32, String> {
    match fmt.field(&[name]) {
        Some(_) => off(fmt, &[name], size),
        None => Ok(NO_FIELD),
    }
}

/// One end of a connection in a TCP tracepoint: a `sockaddr_in6`-sized field (28 bytes,
/// the layout of `tcp_send_reset` since Linux 6.10), or separate port, IPv4 and IPv6 fields.
fn tp_addr(fmt: &Format, addr: &str, port: &str, addr6: &str) -> Result<TpAddr, String> {
    match fmt.field(&[addr]) {
        Some(f) if f.size == 28 => Ok(TpAddr {
            sockaddr: f.offset,
            ..TpAddr::NONE
        }),
        Some(_) => Ok(TpAddr {
            sockaddr: NO_FIELD,
            family: opt_off(fmt, "family", 2)?,
            port: off(fmt, &[port], 2)?,
            addr4: off(fmt, &[addr], 4)?,
            addr6: opt_off(fmt, addr6, 16)?,
        }),
        None => Err(format!("no field {addr} in its format file")),
    }
}

fn fill_refusal(c: &mut RefusalConfig, program: &str, fmt: &Format) -> Result<(), String> {
    match program {
        "tcp_send_reset" => {
            c.rst_skb = opt_off(fmt, "skbaddr", 8)?;
            c.rst_sk = opt_off(fmt, "skaddr", 8)?;
            c.rst_reason = opt_off(fmt, "reason", 4)?;
            // The tracepoint swaps a packet's addresses: its source is the node's end.
            c.rst_local = tp_addr(fmt, "saddr", "sport", "saddr_v6")?;
        }
        "tcp_receive_reset" => {
            c.rrst_sk = off(fmt, &["skaddr"], 8)?;
            c.rrst_remote = tp_addr(fmt, "daddr", "dport", "daddr_v6")?;
        }
        "icmp_send" => {
            c.icmp_skb = off(fmt, &["skbaddr"], 8)?;
            c.icmp_type = off(fmt, &["type"], 4)?;
            c.icmp_code = off(fmt, &["code"], 4)?;
            c.icmp_daddr = opt_off(fmt, "daddr", 4)?;
            c.icmp_dport = opt_off(fmt, "dport", 2)?;
        }
        _ => {}
    }
    Ok(())
}

fn fill(c: &mut ProbeConfig, program: &str, fmt: &Format) -> Result<(), String> {
    match program {
        "flock_lock_inode" => {
            c.fl_ino = off(fmt, &["i_ino"], 8)?;
            c.fl_dev = off(fmt, &["s_dev"], 4)?;
            c.fl_owner = off(fmt, &["owner", "fl_owner"], 8)?;
            c.fl_flags = off(fmt, &["flags", "fl_flags"], 4)?;
            c.fl_type = off(fmt, &["type", "fl_type"], 1)?;
            c.fl_ret = off(fmt, &["ret"], 4)?;
        }
        "sys_exit_setsockopt" | "sys_exit_getsockopt" => {
            let ret = off(fmt, &["ret"], 8)?;
            // One offset serves every sys_exit tracepoint (they share a layout).
            if c.sys_exit_ret != 0 && c.sys_exit_ret != ret {
                return Err("sys_exit `ret` offsets differ between syscalls".into());
            }
            c.sys_exit_ret = ret;
        }
        "signal_deliver" => {
            c.sig_handler = off(fmt, &["sa_handler"], 8)?;
            c.sig_flags = off(fmt, &["sa_flags"], 8)?;
        }
        "sys_enter_setsockopt" => {
            c.sso_level = off(fmt, &["level"], 8)?;
            c.sso_optname = off(fmt, &["optname"], 8)?;
            c.sso_optlen = off(fmt, &["optlen"], 8)?;
            c.sso_optval = off(fmt, &["optval"], 8)?;
        }
        "sys_enter_getsockopt" => {
            c.gso_level = off(fmt, &["level"], 8)?;
            c.gso_optname = off(fmt, &["optname"], 8)?;
            c.gso_optval = off(fmt, &["optval"], 8)?;
        }
        "sys_enter_execve" => c.execve_argv = off(fmt, &["argv"], 8)?,
        "sys_enter_execveat" => c.execveat_argv = off(fmt, &["argv"], 8)?,
        "sched_process_exec" => {
            let f = fmt
                .field(&["filename"])
                .ok_or("no field filename in its format file")?;
            if !f.ctype.starts_with("__data_loc") || f.size != 4 {
                return Err(format!(
                    "field filename is `{}`: layout not supported",
                    f.ctype
                ));
            }
            c.exec_filename = f.offset;
            c.exec_old_pid = off(fmt, &["old_pid"], 4)?;
        }
        "sched_process_fork" => c.fork_child_pid = off(fmt, &["child_pid"], 4)?,
        "sys_enter_exit_group" => c.exit_code = off(fmt, &["error_code"], 8)?,
        DROP_PROGRAM => {
            c.kd_skbaddr = off(fmt, &["skbaddr"], 8)?;
            c.kd_location = off(fmt, &["location"], 8)?;
            c.kd_protocol = off(fmt, &["protocol"], 2)?;
            // Linux 5.17 added the reason; before it every drop is "unknown reason".
            match fmt.field(&["reason"]) {
                Some(_) => {
                    c.kd_reason = off(fmt, &["reason"], 4)?;
                    c.kd_has_reason = 1;
                }
                None => c.kd_has_reason = 0,
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::tracefs;

    #[test]
    fn fill_rejects_wrong_sizes_and_missing_fields() {
        let mut c = ProbeConfig::default();
        let fmt = Format::parse("\tfield:int ret;\toffset:16;\tsize:4;\tsigned:1;\n");
        let err = fill(&mut c, "sys_exit_setsockopt", &fmt).unwrap_err();
        assert!(err.contains("4 bytes"), "{err}");
        let fmt = Format::parse("\tfield:long x;\toffset:16;\tsize:8;\tsigned:0;\n");
        assert!(fill(&mut c, "sys_exit_setsockopt", &fmt)
            .unwrap_err()
            .contains("no field ret"));
        let fmt = Format::parse("\tfield:long ret;\toffset:16;\tsize:8;\tsigned:1;\n");
        fill(&mut c, "sys_exit_setsockopt", &fmt).unwrap();
        assert_eq!(c.sys_exit_ret, 16);
    }

    #[test]
    fn exec_filename_must_be_data_loc() {
        let mut c = ProbeConfig::default();
        let fmt = Format::parse(
            "\tfield:char filename[16];\toffset:8;\tsize:16;\tsigned:0;\n\
             \tfield:pid_t old_pid;\toffset:16;\tsize:4;\tsigned:1;\n",
        );
        assert!(fill(&mut c, "sched_process_exec", &fmt).is_err());
    }

    /// Every hook's format file on the running kernel parses (when tracefs is readable).
    #[test]
    fn discovers_this_kernel() {
        let Ok(tracefs) = tracefs::locate() else {
            eprintln!("skipped: tracefs not available to this user");
            return;
        };
        let d = discover(&tracefs, AttachFilter::default()).unwrap();
        assert!(
            !d.unusable.iter().any(|(p, _)| *p == "flock_lock_inode"),
            "{:?}",
            d.unusable
        );
        assert_ne!(d.config.fl_ino, d.config.fl_owner);
    }
}
