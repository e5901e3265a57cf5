//! The hook table: every kernel hook xtlock can use, its attach candidates and what it
//! gives the user; and what `xtlock probes` reports per hook and per kernel feature.

use super::{
    conntrack, ipvs,
    kfunc::{KfuncHook, Reads, Want},
    nft_commit, nft_mutex, xt_replace, DROP_PROGRAM,
};

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
    /// What `xtlock probes` adds when the tracepoint does not exist on this kernel: since
    /// when it does, and what is lost without it.
    pub missing: Option<&'static str>,
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
        kprobe_first: None,
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
/// Legacy table replaces at `nf_setsockopt`, not the syscall's function: as
/// [`GETSOCKOPT_FN`], no other setsockopt of the node (`TCP_NODELAY` and keepalives at
/// every connect) runs a program.
pub const SETSOCKOPT_FN: KfuncHook = KfuncHook {
    name: "nf_setsockopt",
    purpose: "legacy table replaces (netfilter's setsockopt options only)",
    functions: &["nf_setsockopt"],
    module: None,
    fentry: Some("nf_setsockopt_fentry"),
    fexit: Some("nf_setsockopt_fexit"),
    kprobe: Some("nf_setsockopt_kprobe"),
    kretprobe: Some("nf_setsockopt_kretprobe"),
    kprobe_first: None,
    setup: None,
    // `int nf_setsockopt(struct sock *sk, u_int8_t pf, int val, sockptr_t opt, unsigned int
    // len)` (Linux >= 5.9; a `char __user *` before, refused here). `sockptr_t` is passed in
    // two registers, so `len` is the sixth and the fexit program's return the seventh word.
    reads: Some(Reads {
        args: &[
            Want::Any,
            Want::Int,
            Want::Int,
            Want::Other("sockptr_t"),
            Want::Int,
        ],
        fexit_params: Some(5),
        ret: Want::Int,
    }),
};
pub const SENDMSG_SYSCALL: KfuncHook = syscall_fn(
    "sendmsg_syscall",
    "nf_tables batches timed from their sendmsg()",
    &["__x64_sys_sendmsg", "__arm64_sys_sendmsg"],
    ("sendmsg_syscall_fentry", "sendmsg_syscall_kprobe"),
    Some(("sendmsg_syscall_fexit", "sendmsg_syscall_kretprobe")),
);
/// Legacy table reads at `nf_getsockopt`, not the syscall's function: netfilter's own
/// option numbers come there (after IP and IPv6 found them unknown), so no other
/// getsockopt of the node (the `SO_ERROR` read after every non-blocking connect of Go and
/// Java clients) runs a program. Built into vmlinux wherever netfilter is.
pub const GETSOCKOPT_FN: KfuncHook = KfuncHook {
    name: "nf_getsockopt",
    purpose: "legacy table reads (netfilter's getsockopt options only)",
    functions: &["nf_getsockopt"],
    module: None,
    fentry: Some("nf_getsockopt_fentry"),
    fexit: Some("nf_getsockopt_fexit"),
    kprobe: Some("nf_getsockopt_kprobe"),
    kretprobe: Some("nf_getsockopt_kretprobe"),
    kprobe_first: None,
    setup: None,
    // `int nf_getsockopt(struct sock *sk, u_int8_t pf, int val, char __user *opt, int *len)`
    // (the same since Linux 2.6): `pf`, `val` and `opt` are read as registers.
    reads: Some(Reads {
        args: &[Want::Any, Want::Int, Want::Int, Want::Any],
        fexit_params: Some(5),
        ret: Want::Int,
    }),
};

/// `__icmp_send` at its entry: counts ICMP refusals where `icmp:icmp_send` does not exist.
pub const ICMP_SEND_FN: KfuncHook = KfuncHook {
    name: "icmp_send_fn",
    purpose: "ICMP destination unreachable sent (icmp_send's fallback), seen at the entry of \
              the function behind the tracepoint: messages the ICMP rate limits then hold \
              back are counted too",
    // `icmp_send` itself before __icmp_send took an options argument (Linux 5.6).
    functions: &["__icmp_send", "icmp_send"],
    module: None,
    fentry: None,
    fexit: None,
    kprobe: Some("icmp_send_kprobe"),
    kretprobe: None,
    kprobe_first: None,
    setup: None,
    // `void __icmp_send(struct sk_buff *skb_in, int type, int code, __be32 info, ...)`.
    reads: Some(Reads {
        args: &[Want::Ptr("sk_buff"), Want::Int, Want::Int],
        fexit_params: None,
        ret: Want::Any,
    }),
};

/// Function hooks tried when a tracepoint hook cannot attach (the tracepoint is missing on
/// older kernels): unlike [`Hook::fallback`], the tracepoint stays the first choice, since
/// it fires where the kernel means it (after rate limits) at no kprobe's cost.
pub const TRACEPOINT_BACKUPS: &[(&str, &KfuncHook)] = &[(REFUSAL_PROGRAMS[0], &ICMP_SEND_FN)];

/// The function hook tried when `program`'s tracepoint cannot attach, if it has one.
pub fn backup_of(program: &str) -> Option<&'static KfuncHook> {
    TRACEPOINT_BACKUPS
        .iter()
        .find(|(p, _)| *p == program)
        .map(|(_, k)| *k)
}

/// Tracepoint programs with a twin that does more, tried first on the same tracepoint,
/// and what the twin needs: the plain program is the fallback where it does not load.
pub const TRACEPOINT_FIRST: &[(&str, &str, &str)] = &[(
    nft_mutex::SEND_ENTER,
    nft_mutex::SEND_ENTER_LOOP,
    "bpf_loop (Linux >= 5.17): the batches are not counted by object kind",
)];

/// The twin tried before `program` on its tracepoint, and what it needs.
pub fn first_of(program: &str) -> Option<(&'static str, &'static str)> {
    TRACEPOINT_FIRST
        .iter()
        .find(|(p, _, _)| *p == program)
        .map(|&(_, first, needs)| (first, needs))
}

/// Every function hook the tracepoint hooks may fall back on (for discovery).
pub fn tracepoint_fallbacks() -> impl Iterator<Item = &'static KfuncHook> {
    HOOKS
        .iter()
        .filter_map(|h| h.fallback)
        .chain(TRACEPOINT_BACKUPS.iter().map(|(_, k)| *k))
}

/// Every name `--no-attach HOOK:KIND` accepts: tracepoint hooks and their categories,
/// kernel-function hooks and fallbacks.
pub fn hook_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for h in HOOKS {
        names.extend([h.program, h.category]);
        names.extend(h.fallback.map(|f| f.name));
    }
    names.extend(TRACEPOINT_BACKUPS.iter().map(|(_, k)| k.name));
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
        missing: None,
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
        missing: None,
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
        missing: None,
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
        missing: None,
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
        missing: None,
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
        missing: None,
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
        missing: None,
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
        missing: None,
    },
    Hook {
        program: "sys_enter_setsockopt",
        category: "syscalls",
        tracepoint: "sys_enter_setsockopt",
        required: false,
        purpose: "start of a legacy table replace (IPT_SO_SET_REPLACE) inside a hold",
        fallback: Some(&SETSOCKOPT_FN),
        paired_with: None,
        raw_program: None,
        missing: None,
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
        missing: None,
    },
    Hook {
        program: "sys_enter_getsockopt",
        category: "syscalls",
        tracepoint: "sys_enter_getsockopt",
        required: false,
        purpose: "start of a legacy table read (IPT_SO_GET_INFO, IPT_SO_GET_ENTRIES) inside a hold",
        fallback: Some(&GETSOCKOPT_FN),
        paired_with: None,
        raw_program: None,
        missing: None,
    },
    Hook {
        program: "sys_exit_getsockopt",
        category: "syscalls",
        tracepoint: "sys_exit_getsockopt",
        required: false,
        purpose: "end of a legacy table read: its entries, bytes and time in the kernel",
        fallback: None,
        paired_with: Some("sys_enter_getsockopt"),
        raw_program: None,
        missing: None,
    },
    Hook {
        program: DROP_PROGRAM,
        category: "skb",
        tracepoint: "kfree_skb",
        required: false,
        purpose: "packet drops (reason, where, which netns, samples with addresses)",
        fallback: None,
        paired_with: None,
        raw_program: Some("kfree_skb_btf"),
        missing: None,
    },
    Hook {
        program: nft_mutex::END,
        category: "lock",
        tracepoint: "contention_end",
        required: false,
        purpose: "end of a wait on an nf_tables mutex: its time",
        fallback: None,
        paired_with: None,
        raw_program: Some("contention_end_btf"),
        missing: Some(
            "kernel < 5.19: no contention tracepoints; waits on the nf_tables commit mutex \
             are not seen, its holds are still timed where nft_commit attaches",
        ),
    },
    Hook {
        program: nft_mutex::BEGIN,
        category: "lock",
        tracepoint: "contention_begin",
        required: false,
        purpose: "waits on the nf_tables mutexes (a netns's commit mutex; nfnetlink's \
                  nf_tables mutex, held by a batch while it waits for the commit mutex): \
                  the waiter, and the holder when the wait began",
        fallback: None,
        paired_with: None,
        raw_program: Some("contention_begin_btf"),
        missing: Some(
            "kernel < 5.19: no contention tracepoints; waits on the nf_tables commit mutex \
             are not seen, its holds are still timed where nft_commit attaches",
        ),
    },
    Hook {
        program: nft_mutex::SEND_EXIT,
        category: "syscalls",
        tracepoint: "sys_exit_sendmsg",
        required: false,
        purpose: "end of an nf_tables batch's sendmsg(): its hold of the commit mutex",
        // First, with the syscall's function: the exit tracepoint attaches before the
        // entry's when the function cannot be hooked (see nft_send.rs).
        fallback: Some(&SENDMSG_SYSCALL),
        paired_with: None,
        raw_program: None,
        missing: None,
    },
    Hook {
        program: nft_mutex::SEND_ENTER,
        category: "syscalls",
        tracepoint: "sys_enter_sendmsg",
        required: false,
        purpose: "start of a sendmsg() on a NETLINK_NETFILTER socket: an nf_tables batch \
                  (nft, iptables-nft), timed as a hold of the commit mutex where nft_commit \
                  does not attach",
        fallback: None,
        paired_with: Some(nft_mutex::SEND_EXIT),
        raw_program: None,
        missing: None,
    },
    Hook {
        program: REFUSAL_PROGRAMS[0],
        category: "icmp",
        tracepoint: "icmp_send",
        required: false,
        purpose: "connections refused with an ICMP destination unreachable (netfilter's REJECT, \
                  the stack's own), counted per destination and hold",
        fallback: None,
        paired_with: None,
        raw_program: Some("icmp_send_btf"),
        missing: Some(
            "recent kernels have icmp:icmp_send (Debian's 6.1 too, 5.10 not); without it \
             xtlock hooks the function behind it, __icmp_send, with a kprobe (icmp_send_fn); \
             without either, ICMP refusals are not counted (a REJECTed packet stays counted \
             as a netfilter drop)",
        ),
    },
    Hook {
        program: REFUSAL_PROGRAMS[1],
        category: "tcp",
        tracepoint: "tcp_send_reset",
        required: false,
        purpose: "TCP resets the stack sent (no listener, aborted connections), with the \
                  kernel's reset reason since Linux 6.10; netfilter's `tcp-reset` REJECT sends \
                  its reset without this tracepoint (seen as a reset received by a local client)",
        fallback: None,
        paired_with: None,
        raw_program: None,
        missing: Some(
            "tcp:tcp_send_reset is missing; resets sent are not counted (the function behind \
             it, tcp_v4_send_reset, needs a kprobe, which xtlock does not attach for this yet)",
        ),
    },
    Hook {
        program: REFUSAL_PROGRAMS[2],
        category: "tcp",
        tracepoint: "tcp_receive_reset",
        required: false,
        purpose: "TCP resets the node's sockets received (a pod's connection refused or reset), \
                  counted per peer and hold",
        fallback: None,
        paired_with: None,
        raw_program: None,
        missing: Some(
            "tcp:tcp_receive_reset is missing (it exists since Linux 4.16); resets received are \
             not counted",
        ),
    },
];

/// Programs of the refusal hooks: attached with the drop hook (not with `--no-drops`).
pub const REFUSAL_PROGRAMS: [&str; 3] = ["icmp_send", "tcp_send_reset", "tcp_receive_reset"];

/// Whether `program` counts packets (the drop and refusal hooks), attached only when drops
/// are asked for.
pub fn counts_packets(program: &str) -> bool {
    program == DROP_PROGRAM || REFUSAL_PROGRAMS.contains(&program)
}

/// Whether a hook is attached, and if not, why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct HookStatus {
    pub program: &'static str,
    pub attach: String,
    pub required: bool,
    pub purpose: &'static str,
    /// `None` when attached (or not needed).
    pub error: Option<String>,
    /// Not attached because another hook does its job on this kernel (`attach` says which):
    /// neither attached nor missing.
    pub needless: bool,
}

impl HookStatus {
    pub fn attached(&self) -> bool {
        self.error.is_none() && !self.needless
    }

    /// Not attached, and something is lost for it.
    pub fn missing(&self) -> bool {
        self.error.is_some()
    }
}

/// A feature that depends on the kernel rather than on one hook: available or not, and why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Feature {
    pub name: &'static str,
    pub available: bool,
    pub detail: String,
}
