//! Loading and attaching the BPF programs: discover the kernel's tracepoint layouts, write
//! them into the programs, attach every hook this kernel offers, and say plainly which
//! ones did not attach and why.

pub mod btf;
pub mod conntrack;
pub mod dropreason;
pub mod ipvs;
pub mod kfunc;
pub mod nft_commit;
pub mod preflight;
pub mod tracefs;
pub mod xt_replace;

use std::path::PathBuf;

use aya::{
    maps::{
        Array as BpfArray, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf,
    },
    programs::{BtfTracePoint, TracePoint},
    Ebpf, EbpfLoader,
};
use xtlock_common::{DropKey, IpvsKey, LockKey, ProbeConfig};

use crate::lockfiles::LockFile;
use dropreason::{ReasonError, ReasonSelection, ReasonTable};
use kfunc::{AttachFilter, AttachKind, KfuncHook, Reads, Want};
use tracefs::Format;

/// Program name of the packet-drop hook.
pub const DROP_PROGRAM: &str = "kfree_skb";

/// The BPF object built by `build.rs` (empty when the BPF toolchain was missing).
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xtlock"));

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "this xtlock binary was built without its BPF programs (the BPF toolchain was missing \
         at build time); rebuild with `./xtask/run setup` done first, e.g. `./xtask/run trace`"
    )]
    NotBuilt,
    #[error("{0}")]
    Permission(String),
    #[error(
        "tracefs is not available ({why}); mount it with \
         `mount -t tracefs tracefs /sys/kernel/tracing` (needs root) and try again"
    )]
    NoTracefs { why: String },
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    #[error("loading the BPF programs failed: {0}")]
    Load(String),
    /// A kernel older than what xtlock needs at the least (see docs/kernels.md).
    #[error(
        "this kernel ({release}) has no BPF ring buffer (BPF_MAP_TYPE_RINGBUF, Linux >= 5.8, \
         or a distribution kernel that backports it), which carries every xtlock event; \
         xtlock does not run on it. See docs/kernels.md for the kernels it supports."
    )]
    NoRingBuffer { release: String },
    #[error(
        "the lock hook could not be attached ({why}); xtlock cannot see the xtables lock on \
         this kernel. Run `xtlock probes` for details."
    )]
    Required { why: String },
    #[error("--drop-reasons: {0}")]
    DropReasons(ReasonError),
}

// By hand, not `#[from]`: the message already says the cause, which a `source` would
// repeat in an error chain.
impl From<ReasonError> for ProbeError {
    fn from(e: ReasonError) -> Self {
        ProbeError::DropReasons(e)
    }
}

/// One kernel hook and what it gives the user, in plain words.
#[derive(Clone, Copy, Debug)]
pub struct Hook {
    /// Program name in the BPF object (the function name in `xtlock-ebpf`).
    pub program: &'static str,
    pub category: &'static str,
    pub tracepoint: &'static str,
    /// Without it xtlock cannot do its job at all.
    pub required: bool,
    pub purpose: &'static str,
    /// The syscall's function, hooked (fentry, else kprobe) in preference to the
    /// tracepoint: an enabled syscall tracepoint puts every syscall on the node on the
    /// syscall-tracing path (~50 ns each, *Findings* 3), a hooked function costs only its
    /// own calls. The tracepoint is then the fallback.
    pub fallback: Option<&'static KfuncHook>,
    /// Attached together with this hook (its fallback covers both).
    pub paired_with: Option<&'static str>,
    /// A `tp_btf` program on the same tracepoint, tried first: it gets the tracepoint's
    /// arguments and no record is built before it runs (see [`discover_raw_lock`]).
    pub raw_program: Option<&'static str>,
}

/// A syscall's function (`__x64_sys_NAME`, `__arm64_sys_NAME`) as the fallback of its
/// tracepoints.
const fn syscall_fn(
    name: &'static str,
    purpose: &'static str,
    functions: &'static [&'static str],
    entry: (&'static str, &'static str),
    exit: Option<(&'static str, &'static str)>,
) -> KfuncHook {
    KfuncHook {
        name,
        purpose,
        functions,
        module: None,
        fentry: Some(entry.0),
        fexit: match exit {
            Some(e) => Some(e.0),
            None => None,
        },
        kprobe: Some(entry.1),
        kretprobe: match exit {
            Some(e) => Some(e.1),
            None => None,
        },
        setup: None,
        // `long __x64_sys_NAME(const struct pt_regs *regs)`: the user registers, read at
        // offsets from BTF; the exit program finds the return after that one argument.
        reads: Some(match exit {
            Some(_) => Reads {
                args: &[Want::Ptr("pt_regs")],
                fexit_params: Some(1),
                ret: Want::Int,
            },
            None => Reads {
                args: &[Want::Ptr("pt_regs")],
                fexit_params: None,
                ret: Want::Any,
            },
        }),
    }
}

pub const EXECVE_SYSCALL: KfuncHook = syscall_fn(
    "execve_syscall",
    "command lines of new programs (execve)",
    &["__x64_sys_execve", "__arm64_sys_execve"],
    ("execve_syscall_fentry", "execve_syscall_kprobe"),
    None,
);
pub const EXECVEAT_SYSCALL: KfuncHook = syscall_fn(
    "execveat_syscall",
    "command lines of new programs (execveat)",
    &["__x64_sys_execveat", "__arm64_sys_execveat"],
    ("execveat_syscall_fentry", "execveat_syscall_kprobe"),
    None,
);
pub const EXIT_GROUP_SYSCALL: KfuncHook = syscall_fn(
    "exit_group_syscall",
    "exit status",
    &["__x64_sys_exit_group", "__arm64_sys_exit_group"],
    ("exit_group_syscall_fentry", "exit_group_syscall_kprobe"),
    None,
);
pub const SETSOCKOPT_SYSCALL: KfuncHook = syscall_fn(
    "setsockopt_syscall",
    "legacy table replaces",
    &["__x64_sys_setsockopt", "__arm64_sys_setsockopt"],
    ("setsockopt_syscall_fentry", "setsockopt_syscall_kprobe"),
    Some(("setsockopt_syscall_fexit", "setsockopt_syscall_kretprobe")),
);

/// Every name `--no-attach HOOK:KIND` accepts: tracepoint hooks and their categories,
/// kernel-function hooks and fallbacks.
pub fn hook_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for h in HOOKS {
        names.extend([h.program, h.category]);
        names.extend(h.fallback.map(|f| f.name));
    }
    names.extend(KFUNC_HOOKS.iter().map(|k| k.name));
    names.sort_unstable();
    names.dedup();
    names
}

/// Hooks that exist only on kernel functions, attached after the tracepoints.
pub const KFUNC_HOOKS: &[&KfuncHook] = &[
    &nft_commit::HOOK,
    &conntrack::INSERT_FAILED,
    &conntrack::TABLE_FULL,
    &xt_replace::HOOK,
    &ipvs::CONN_NEW,
    &ipvs::NAT_XMIT,
    &ipvs::NAT_XMIT_V6,
    &ipvs::CONN_IN_GET,
    &ipvs::CONN_EXPIRE,
    &ipvs::ADD_DEST,
    &ipvs::DEL_DEST,
    &ipvs::EDIT_DEST,
    &ipvs::ADD_SERVICE,
    &ipvs::EDIT_SERVICE,
    &ipvs::UNLINK_SERVICE,
];

pub const HOOKS: &[Hook] = &[
    Hook {
        program: "flock_lock_inode",
        category: "filelock",
        tracepoint: "flock_lock_inode",
        required: true,
        purpose: "takes, failed tries, waits and releases of the watched lock files",
        fallback: None,
        paired_with: None,
        raw_program: Some("flock_lock_inode_btf"),
    },
    Hook {
        program: "signal_deliver",
        category: "signal",
        tracepoint: "signal_deliver",
        required: false,
        purpose: "blocking flock() waits on the lock cut short by a signal (`iptables -w N` \
                  giving up through alarm())",
        fallback: None,
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sys_enter_execve",
        category: "syscalls",
        tracepoint: "sys_enter_execve",
        required: false,
        purpose: "command lines of new programs (execve)",
        fallback: Some(&EXECVE_SYSCALL),
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sys_enter_execveat",
        category: "syscalls",
        tracepoint: "sys_enter_execveat",
        required: false,
        purpose: "command lines of new programs (execveat)",
        fallback: Some(&EXECVEAT_SYSCALL),
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sched_process_exec",
        category: "sched",
        tracepoint: "sched_process_exec",
        required: false,
        purpose: "iptables and iptables-restore runs, and the programs that started them",
        fallback: None,
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sched_process_fork",
        category: "sched",
        tracepoint: "sched_process_fork",
        required: false,
        purpose: "the parent of each new process (who called iptables)",
        fallback: None,
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sys_enter_exit_group",
        category: "syscalls",
        tracepoint: "sys_enter_exit_group",
        required: false,
        purpose: "exit status (iptables exits 4 when it gave up waiting for the lock)",
        fallback: Some(&EXIT_GROUP_SYSCALL),
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sched_process_exit",
        category: "sched",
        tracepoint: "sched_process_exit",
        required: false,
        purpose: "process exits",
        fallback: None,
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sys_enter_setsockopt",
        category: "syscalls",
        tracepoint: "sys_enter_setsockopt",
        required: false,
        purpose: "start of a legacy table replace (IPT_SO_SET_REPLACE) inside a hold",
        fallback: Some(&SETSOCKOPT_SYSCALL),
        paired_with: None,
        raw_program: None,
    },
    Hook {
        program: "sys_exit_setsockopt",
        category: "syscalls",
        tracepoint: "sys_exit_setsockopt",
        required: false,
        purpose: "end of a legacy table replace: the kernel's share of a hold",
        fallback: None,
        paired_with: Some("sys_enter_setsockopt"),
        raw_program: None,
    },
    Hook {
        program: DROP_PROGRAM,
        category: "skb",
        tracepoint: "kfree_skb",
        required: false,
        purpose: "packet drops (reason, where, which netns, samples with addresses)",
        fallback: None,
        paired_with: None,
        raw_program: None,
    },
];

/// Whether a hook is attached, and if not, why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct HookStatus {
    pub program: &'static str,
    pub attach: String,
    pub required: bool,
    pub purpose: &'static str,
    /// `None` when attached.
    pub error: Option<String>,
}

impl HookStatus {
    pub fn attached(&self) -> bool {
        self.error.is_none()
    }
}

/// A feature that depends on the kernel rather than on one hook: available or not, and why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Feature {
    pub name: &'static str,
    pub available: bool,
    pub detail: String,
}

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
}

impl Discovery {
    /// Why the hook's tracepoint cannot be used (its format file lacks what it reads).
    fn unusable_why(&self, program: &str) -> Option<String> {
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
    for hook in HOOKS {
        let fmt = match Format::read(tracefs, hook.category, hook.tracepoint)? {
            Some(f) => f,
            None => {
                unusable.push((
                    hook.program,
                    format!(
                        "tracepoint {}:{} does not exist on this kernel",
                        hook.category, hook.tracepoint
                    ),
                ));
                continue;
            }
        };
        if let Err(why) = fill(&mut config, hook.program, &fmt) {
            unusable.push((hook.program, why));
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
    let mut wanted: Vec<&KfuncHook> = KFUNC_HOOKS.to_vec();
    wanted.extend(HOOKS.iter().filter_map(|h| h.fallback));
    let kfunc = kfunc::discover(
        tracefs,
        btf.as_ref().map_err(|e| e.to_string()),
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
    })
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
    const PROTO: [&str; 4] = ["void *", "struct inode *", "struct file_lock *", "int"];
    match b.fn_typedef_params("btf_trace_flock_lock_inode") {
        Some(p) if p == PROTO => {}
        Some(p) => {
            return Err(format!(
                "its arguments are ({}), expected ({})",
                p[1.min(p.len())..].join(", "),
                PROTO[1..].join(", ")
            ))
        }
        None => return Err("no btf_trace_flock_lock_inode prototype in BTF".into()),
    }
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
        "sys_exit_setsockopt" => {
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

/// Options for loading.
pub struct LoadOptions {
    pub locks: Vec<LockFile>,
    /// Ring buffer size in bytes (a power of two, multiple of the page size).
    pub ring_bytes: u32,
    /// Attach types ruled out (`--no-attach`).
    pub no_attach: AttachFilter,
}

/// What the drop hook counts and samples.
#[derive(Clone, Debug)]
pub struct DropOptions {
    pub reasons: ReasonSelection,
    /// Samples per second per CPU sent to userspace (0: counts only).
    pub samples_per_sec: u32,
}

impl Default for DropOptions {
    fn default() -> Self {
        DropOptions {
            reasons: ReasonSelection::Default,
            samples_per_sec: DEFAULT_DROP_SAMPLES,
        }
    }
}

/// Default `--drop-samples`, per CPU.
pub const DEFAULT_DROP_SAMPLES: u32 = 100;

/// Per-CPU drop counters summed over CPUs: (key, total since load).
pub type DropTotals = Vec<(DropKey, u64)>;

/// Loaded and attached programs. Dropping it detaches everything.
pub struct Probes {
    ebpf: Ebpf,
    pub status: Vec<HookStatus>,
    /// Kernel-function hooks whose functions were not there at start (module not loaded):
    /// tried again by [`Probes::attach_pending`].
    pending: Vec<&'static KfuncHook>,
    kfunc: kfunc::KernelFacts,
    pub tracefs: PathBuf,
    /// Kernel features the hooks depend on, and whether this kernel has them.
    pub features: Vec<Feature>,
    /// This kernel's drop reasons (empty when it reports none).
    pub reasons: ReasonTable,
    /// `skb:kfree_skb` has a `reason` field (Linux >= 5.17).
    pub has_drop_reasons: bool,
}

impl Probes {
    /// Preflight checks, discovery, load and attach. Fails only when the lock hook itself
    /// cannot be attached; other hooks degrade with a reason in `status`.
    pub fn load(opts: &LoadOptions) -> Result<Self, ProbeError> {
        Self::load_with_drops(opts, None)
    }

    /// [`load`](Self::load), with the packet-drop hook when `drops` is given.
    pub fn load_with_drops(
        opts: &LoadOptions,
        drops: Option<&DropOptions>,
    ) -> Result<Self, ProbeError> {
        if BPF_OBJECT.is_empty() {
            return Err(ProbeError::NotBuilt);
        }
        preflight::check()?;
        let tracefs = tracefs::locate()?;
        let mut disc = discover(&tracefs, opts.no_attach.clone())?;
        // Bad --drop-reasons is the user's to fix: refuse before loading anything.
        let drop_slots = match drops {
            Some(d) => Some(
                disc.reasons
                    .slots(&d.reasons, disc.config.kd_has_reason != 0)?,
            ),
            None => None,
        };
        if let Some(d) = drops {
            if d.samples_per_sec > 0 {
                disc.config.drop_sample_interval_ns =
                    (1_000_000_000 / u64::from(d.samples_per_sec)).max(1);
                disc.config.drop_sample_burst = d.samples_per_sec;
            }
        }
        let mut ebpf = EbpfLoader::new()
            .override_global("CONFIG", &disc.config, true)
            .map_max_entries("EVENTS", opts.ring_bytes)
            .load(BPF_OBJECT)
            .map_err(|e| preflight::explain_load_error(&e))?;

        {
            let map = ebpf
                .map_mut("WATCHED")
                .ok_or_else(|| ProbeError::Load("map WATCHED missing from the object".into()))?;
            let mut watched: BpfHashMap<&mut MapData, LockKey, u32> =
                BpfHashMap::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
            for (i, l) in opts.locks.iter().enumerate() {
                watched
                    .insert(l.key(), i as u32, 0)
                    .map_err(|e| ProbeError::Load(format!("watching {}: {e}", l.path.display())))?;
            }
        }
        for l in &opts.locks {
            mark_watched_ino(&mut ebpf, l)?;
        }

        if let Some(slots) = &drop_slots {
            let map = ebpf
                .map_mut("DROP_REASONS")
                .ok_or_else(|| ProbeError::Load("map DROP_REASONS missing".into()))?;
            let mut arr: BpfArray<&mut MapData, u8> =
                BpfArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
            for &s in slots {
                arr.set(s, 1u8, 0)
                    .map_err(|e| ProbeError::Load(format!("drop reason filter: {e}")))?;
            }
        }

        let mut status: Vec<HookStatus> = Vec::new();
        for hook in HOOKS {
            let mut attach = format!("tracepoint {}:{}", hook.category, hook.tracepoint);
            let partner = hook
                .paired_with
                .and_then(|p| status.iter().find(|s| s.program == p));
            let error = match (partner, hook.fallback) {
                // The partner's function hooks cover both of them.
                (Some(p), _) if !p.attach.starts_with("tracepoint") => {
                    attach = p.attach.clone();
                    p.error.clone()
                }
                // The syscall's function first, its tracepoint only when that fails.
                (_, Some(fb)) => {
                    match kfunc::attach_after(&mut ebpf, fb, &disc.kfunc, Vec::new()) {
                        Ok(a) => {
                            attach = a.describe;
                            None
                        }
                        Err(fn_why) => {
                            tracing::debug!(hook = hook.program, why = %fn_why, "syscall function not hooked: its tracepoint is tried");
                            match tracepoint_unless_ruled_out(&mut ebpf, hook, &disc) {
                                Ok(()) => None,
                                Err(why) => {
                                    attach.push_str(&format!(
                                        ", else {}",
                                        kfunc::candidates_text(fb)
                                    ));
                                    Some(format!("tracepoint: {why}; {fn_why}"))
                                }
                            }
                        }
                    }
                }
                _ => {
                    let raw = hook
                        .raw_program
                        .map(|raw| attach_raw(&mut ebpf, hook, raw, &disc));
                    if let Some(Err(why)) = &raw {
                        tracing::debug!(
                            hook = hook.program,
                            %why,
                            "tp_btf not used: the perf tracepoint is tried"
                        );
                    }
                    let tp = if matches!(raw, Some(Ok(()))) {
                        attach = format!("tp_btf {}:{}", hook.category, hook.tracepoint);
                        Ok(())
                    } else if hook.program == DROP_PROGRAM
                        && drops.is_none()
                        // An unusable format file says why first.
                        && disc.unusable_why(hook.program).is_none()
                    {
                        Err("not asked for (--no-drops)".to_string())
                    } else {
                        tracepoint_unless_ruled_out(&mut ebpf, hook, &disc)
                    };
                    if let (Ok(()), Some(Err(r))) = (&tp, &raw) {
                        // Why not tp_btf, as the function hooks say why not fentry.
                        attach.push_str(&format!(" (fallback; tp_btf: {})", first_line(r)));
                    }
                    tp.err().map(|why| match raw {
                        Some(Err(r)) => format!("{why}; tp_btf: {r}"),
                        _ => why,
                    })
                }
            };
            if hook.required {
                if let Some(why) = &error {
                    return Err(ProbeError::Required { why: why.clone() });
                }
            }
            status.push(HookStatus {
                program: hook.program,
                attach,
                required: hook.required,
                purpose: hook.purpose,
                error,
            });
        }
        let mut pending = Vec::new();
        for hook in KFUNC_HOOKS {
            let (attach, error) =
                match kfunc::setup_and_attach(&mut ebpf, hook, &disc.kfunc, disc.btf.as_ref()) {
                    Ok(a) => (module_note(hook, a.describe), None),
                    Err(why) => {
                        if kfunc::plan(hook, &disc.kfunc).is_err() {
                            pending.push(*hook);
                        }
                        (module_note(hook, kfunc::candidates_text(hook)), Some(why))
                    }
                };
            status.push(HookStatus {
                program: hook.name,
                attach,
                required: false,
                purpose: hook.purpose,
                error,
            });
        }
        kfunc::forget_btf();
        // One line for the user (a kernel without kprobes misses a dozen hooks); each reason
        // at debug level and in `xtlock probes`.
        let missing: Vec<&HookStatus> = status
            .iter()
            .filter(|s| !(s.attached() || s.program == DROP_PROGRAM && drops.is_none()))
            .collect();
        for s in &missing {
            tracing::debug!(
                hook = s.program,
                why = s.error.as_deref().unwrap_or(""),
                "hook not attached"
            );
        }
        if !missing.is_empty() {
            let names: Vec<&str> = missing.iter().map(|s| s.program).collect();
            tracing::warn!(
                "{} of {} hooks not attached ({}); xtlock runs without them. `xtlock probes` \
                 says why for each and what it costs",
                missing.len(),
                status.len(),
                names.join(", ")
            );
        }
        for f in disc.features.iter().filter(|f| !f.available) {
            tracing::warn!(feature = f.name, why = %f.detail, "feature unavailable");
        }
        Ok(Self {
            ebpf,
            status,
            pending,
            kfunc: disc.kfunc,
            tracefs,
            features: disc.features,
            reasons: disc.reasons,
            has_drop_reasons: disc.config.kd_has_reason != 0,
        })
    }

    /// Attaches the kernel-function hooks whose module has loaded since start (nf_tables,
    /// ip_vs load on demand, often after xtlock started). Cheap when nothing changed: a
    /// stat per pending hook's module; kallsyms is read only when one appeared. Returns the
    /// statuses that changed.
    pub fn attach_pending(&mut self) -> Vec<HookStatus> {
        let ready: Vec<&'static KfuncHook> = self
            .pending
            .iter()
            .copied()
            .filter(|h| {
                h.module
                    .is_some_and(|m| std::path::Path::new("/sys/module").join(m).exists())
            })
            .collect();
        if ready.is_empty() {
            return Vec::new();
        }
        let mut wanted: Vec<&KfuncHook> = ready.clone();
        wanted.extend(HOOKS.iter().filter_map(|h| h.fallback));
        // Parsed only for hooks that need it (seconds on a slow machine): their setup, or
        // the prototypes of what they read (in the module's BTF, split on vmlinux's).
        let btf = ready
            .iter()
            .any(|h| h.setup.is_some() || h.reads.is_some())
            .then(|| btf::Btf::vmlinux().ok())
            .flatten();
        let fresh = kfunc::discover(
            &self.tracefs,
            btf.as_ref()
                .ok_or_else(|| "not read again after start".to_string()),
            &wanted,
            self.kfunc.filter.clone(),
        );
        // Other BTF facts stay those of start: a module's functions are never in vmlinux BTF.
        self.kfunc.symbols = fresh.symbols;
        self.kfunc.protos.extend(fresh.protos);
        let mut changed = Vec::new();
        for hook in ready {
            // Not yet in kallsyms (module still initialising): try again next time.
            if kfunc::plan(hook, &self.kfunc).is_err() {
                continue;
            }
            self.pending.retain(|h| h.name != hook.name);
            let (attach, error) =
                match kfunc::setup_and_attach(&mut self.ebpf, hook, &self.kfunc, btf.as_ref()) {
                    Ok(a) => (module_note(hook, a.describe), None),
                    Err(why) => (module_note(hook, kfunc::candidates_text(hook)), Some(why)),
                };
            if let Some(s) = self.status.iter_mut().find(|s| s.program == hook.name) {
                s.attach = attach;
                s.error = error;
                changed.push(s.clone());
            }
        }
        kfunc::forget_btf();
        changed
    }

    /// Whether the drop hook is attached.
    pub fn drops_attached(&self) -> bool {
        self.status
            .iter()
            .any(|s| s.program == DROP_PROGRAM && s.attached())
    }

    /// In-kernel drop counts since load, summed over CPUs, and the drops counted in the
    /// overflow slot because the key map was full.
    pub fn drop_totals(&self) -> Result<(DropTotals, u64), ProbeError> {
        self.counter_totals("DROP_COUNTS", "DROP_OVERFLOW")
    }

    /// Drops counted during holds (`HOLD_DROPS`): per hold start, summed over CPUs. A slot of
    /// a CPU that still holds an older hold's count adds to that hold.
    pub fn hold_drop_counts(&self) -> Result<Vec<(u64, u64)>, ProbeError> {
        let map = self
            .ebpf
            .map("HOLD_DROPS")
            .ok_or_else(|| ProbeError::Load("map HOLD_DROPS missing".into()))?;
        let arr: PerCpuArray<&MapData, xtlock_common::HoldDropSlot> =
            PerCpuArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let mut by_hold: std::collections::BTreeMap<u64, u64> = Default::default();
        for i in 0..xtlock_common::HOLD_DROP_SLOTS {
            let per_cpu = arr
                .get(&i, 0)
                .map_err(|e| ProbeError::Load(format!("reading HOLD_DROPS: {e}")))?;
            for slot in per_cpu.iter().filter(|s| s.start_ns != 0) {
                *by_hold.entry(slot.start_ns).or_default() += slot.count;
            }
        }
        Ok(by_hold.into_iter().collect())
    }

    /// A per-CPU counter map summed over CPUs, and its per-CPU overflow counter summed.
    fn counter_totals<K: aya::Pod>(
        &self,
        counts: &str,
        overflow: &str,
    ) -> Result<(Vec<(K, u64)>, u64), ProbeError> {
        let map = self
            .ebpf
            .map(counts)
            .ok_or_else(|| ProbeError::Load(format!("map {counts} missing")))?;
        let per_cpu: PerCpuHashMap<&MapData, K, u64> =
            PerCpuHashMap::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let mut out = Vec::new();
        for item in per_cpu.iter() {
            // A key can vanish between listing and lookup only if deleted; we never delete.
            let (k, v) = item.map_err(|e| ProbeError::Load(format!("reading {counts}: {e}")))?;
            out.push((k, v.iter().sum()));
        }
        let map = self
            .ebpf
            .map(overflow)
            .ok_or_else(|| ProbeError::Load(format!("map {overflow} missing")))?;
        let ovf: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let overflow = ovf
            .get(&0, 0)
            .map_err(|e| ProbeError::Load(format!("reading {overflow}: {e}")))?
            .iter()
            .sum();
        Ok((out, overflow))
    }

    /// Whether the IPVS hooks are attached.
    pub fn ipvs_attached(&self) -> bool {
        self.status
            .iter()
            .any(|s| ipvs::COUNTING_HOOKS.contains(&s.program) && s.attached())
    }

    /// In-kernel IPVS packet counts since load, summed over CPUs, and the packets counted in
    /// the overflow slot because the key map was full.
    pub fn ipvs_totals(&self) -> Result<(Vec<(IpvsKey, u64)>, u64), ProbeError> {
        self.counter_totals("IPVS_COUNTS", "IPVS_OVERFLOW")
    }

    /// The event ring buffer; call once.
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .ok_or_else(|| ProbeError::Load("map EVENTS missing (already taken?)".into()))?;
        RingBuf::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))
    }

    /// Events the kernel could not queue because the ring buffer was full, summed over CPUs.
    pub fn lost_events(&self) -> Result<u64, ProbeError> {
        let map = self
            .ebpf
            .map("LOST")
            .ok_or_else(|| ProbeError::Load("map LOST missing".into()))?;
        let lost: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let values = lost
            .get(&0, 0)
            .map_err(|e| ProbeError::Load(format!("reading LOST: {e}")))?;
        Ok(values.iter().sum())
    }

    /// Starts reporting another lock file (e.g. the watched path was replaced by a new inode).
    pub fn watch(&mut self, lock: &LockFile, index: u32) -> Result<(), ProbeError> {
        let map = self
            .ebpf
            .map_mut("WATCHED")
            .ok_or_else(|| ProbeError::Load("map WATCHED missing".into()))?;
        let mut watched: BpfHashMap<&mut MapData, LockKey, u32> =
            BpfHashMap::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        watched
            .insert(lock.key(), index, 0)
            .map_err(|e| ProbeError::Load(format!("watching {}: {e}", lock.path.display())))?;
        // After the key: the probe checks this slot first.
        mark_watched_ino(&mut self.ebpf, lock)
    }
}

/// Sets the inode pre-filter slot of `lock` (`WATCHED_INO`).
fn mark_watched_ino(ebpf: &mut Ebpf, lock: &LockFile) -> Result<(), ProbeError> {
    let map = ebpf
        .map_mut("WATCHED_INO")
        .ok_or_else(|| ProbeError::Load("map WATCHED_INO missing".into()))?;
    let mut slots: BpfArray<&mut MapData, u8> =
        BpfArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
    let slot = (lock.key().ino % u64::from(xtlock_common::WATCHED_INO_SLOTS)) as u32;
    slots
        .set(slot, 1u8, 0)
        .map_err(|e| ProbeError::Load(format!("watching {}: {e}", lock.path.display())))
}

/// A module's hook without fentry programs says why: aya 0.14 cannot attach fentry there.
fn module_note(hook: &KfuncHook, attach: String) -> String {
    match hook.module {
        Some(m) if hook.fentry.is_none() && hook.fexit.is_none() => format!(
            "{attach} (no fentry: aya 0.14 attaches fentry only to vmlinux functions, and \
             this one is in module {m})"
        ),
        _ => attach,
    }
}

fn attach_tracepoint(ebpf: &mut Ebpf, hook: &Hook) -> Result<(), String> {
    let prog: &mut TracePoint = ebpf
        .program_mut(hook.program)
        .ok_or_else(|| format!("program {} missing from the BPF object", hook.program))?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    prog.load()
        .map_err(|e| format!("load: {}", preflight::error_chain(&e)))?;
    prog.attach(hook.category, hook.tracepoint)
        .map_err(|e| format!("attach: {}", preflight::error_chain(&e)))?;
    Ok(())
}

/// The hook's tracepoint, unless its format file was unusable or `--no-attach` rules it out.
fn tracepoint_unless_ruled_out(
    ebpf: &mut Ebpf,
    hook: &Hook,
    disc: &Discovery,
) -> Result<(), String> {
    if let Some(why) = disc.unusable_why(hook.program) {
        return Err(why);
    }
    if let Some(why) = ruled_out(hook, AttachKind::Tracepoint, disc) {
        return Err(why);
    }
    attach_tracepoint(ebpf, hook)
}

/// Why `--no-attach` rules out `kind` for this hook, by its name or its category.
fn ruled_out(hook: &Hook, kind: AttachKind, disc: &Discovery) -> Option<String> {
    let filter = &disc.kfunc.filter;
    filter
        .blocks(hook.program, kind)
        .or_else(|| filter.blocks(hook.category, kind))
}

/// The first line of a load error: its verifier log follows, thousands of lines.
fn first_line(s: &str) -> &str {
    match s.find(" Verifier output:") {
        Some(i) => &s[..i],
        None => s.lines().next().unwrap_or(s),
    }
}

/// The hook's `tp_btf` program, unless `--no-attach` rules it out or BTF lacks what it
/// reads.
fn attach_raw(ebpf: &mut Ebpf, hook: &Hook, program: &str, disc: &Discovery) -> Result<(), String> {
    if let Some(why) = ruled_out(hook, AttachKind::BtfTracepoint, disc) {
        return Err(why);
    }
    disc.raw_lock.clone()?;
    let btf = kfunc::aya_btf()?;
    let prog: &mut BtfTracePoint = ebpf
        .program_mut(program)
        .ok_or_else(|| format!("program {program} missing from the BPF object"))?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    prog.load(hook.tracepoint, &btf)
        .map_err(|e| format!("load: {}", preflight::error_chain(&e)))?;
    prog.attach()
        .map_err(|e| format!("attach: {}", preflight::error_chain(&e)))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
