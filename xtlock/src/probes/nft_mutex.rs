//! The nf_tables mutex hook: waits on a network namespace's nf_tables `commit_mutex` and on
//! nfnetlink's nf_tables subsystem mutex, from `lock:contention_begin`/`contention_end`
//! (Linux 5.19+). How the programs recognise the two mutexes is in
//! `xtlock-ebpf/src/probes/nft_mutex.rs`; what they need is found here: struct offsets from
//! BTF (the `nf_tables` module's, else vmlinux's, where nf_tables is built in), and
//! addresses from kallsyms (`nf_tables_net_id` where the kernel lists data symbols, the
//! functions whose mutex waits teach the programs the rest).

use xtlock_common::NftMutexConfig;

use super::btf::Btf;

/// Programs of the hook (perf tracepoints; their `tp_btf` twins are tried first).
pub const BEGIN: &str = "contention_begin";
pub const END: &str = "contention_end";
/// Programs timing nf_tables batches from their `sendmsg()` (perf tracepoints).
pub const SEND_ENTER: &str = "sys_enter_sendmsg";
pub const SEND_EXIT: &str = "sys_exit_sendmsg";
/// Both, as the hook table names them.
pub const SEND_PROGRAMS: [&str; 2] = [SEND_ENTER, SEND_EXIT];
/// `SEND_ENTER` counting the batch (`bpf_loop`): tried first.
pub const SEND_ENTER_LOOP: &str = "sys_enter_sendmsg_loop";

/// Offsets of the perf tracepoints' fields (from their format files).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TpOffsets {
    pub lock: u32,
    pub flags: u32,
    pub ret: u32,
    /// `sys_enter_sendmsg`'s `fd`, `sys_exit_sendmsg`'s `ret`; `None` when their format
    /// files lack them.
    pub send_fd: Option<u32>,
    pub exit_ret: Option<u32>,
    /// `sys_enter_sendmsg`'s `msg`: the batch's buffers.
    pub send_msg: Option<u32>,
}

/// The kallsyms addresses the hook uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Symbols {
    /// `nf_tables_net_id` (a data symbol: listed only with `CONFIG_KALLSYMS_ALL`).
    pub net_id: u64,
    /// Start and end of `nf_tables_valid_genid`, `nft_rcv_nl_event`,
    /// `nfnetlink_rcv_batch`, and the scheduler's text.
    pub genid_fn: [u64; 2],
    pub release_fn: [u64; 2],
    pub gc_fn: [u64; 2],
    pub batch_fn: [u64; 2],
    pub sched_text: [u64; 2],
}

/// The addresses of [`Symbols`] in a /proc/kallsyms listing; a function ends where the
/// next symbol begins.
pub fn symbols(kallsyms: &str) -> Symbols {
    let mut all: Vec<(u64, &str)> = Vec::new();
    let mut s = Symbols::default();
    for line in kallsyms.lines() {
        let mut f = line.split_whitespace();
        let (Some(addr), Some(_ty), Some(name)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let Ok(addr) = u64::from_str_radix(addr, 16) else {
            continue;
        };
        if addr == 0 {
            continue;
        }
        match name {
            "nf_tables_net_id" => s.net_id = addr,
            "__sched_text_start" => s.sched_text[0] = addr,
            "__sched_text_end" => s.sched_text[1] = addr,
            _ => {}
        }
        all.push((addr, name));
    }
    all.sort_unstable();
    let range = |name: &str| -> [u64; 2] {
        let Some(i) = all.iter().position(|(_, n)| *n == name) else {
            return [0, 0];
        };
        let start = all[i].0;
        let end = all[i + 1..]
            .iter()
            .map(|(a, _)| *a)
            .find(|&a| a > start)
            .unwrap_or(0);
        [start, end]
    };
    s.genid_fn = range("nf_tables_valid_genid");
    s.release_fn = range("nft_rcv_nl_event");
    s.gc_fn = range("nft_trans_gc_work");
    s.batch_fn = range("nfnetlink_rcv_batch");
    s
}

/// What the hook knows, and how: for `xtlock probes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    pub config: NftMutexConfig,
    pub detail: String,
}

/// Reads a struct member's offset from `btf`, checking its size (0: any).
fn member(btf: &Btf, s: &str, p: &str, size: u32) -> Result<u32, String> {
    match btf.member(s, p) {
        Ok((off, sz)) if sz == size || size == 0 => Ok(off),
        Ok((_, sz)) => Err(format!("{s}.{p} is {sz} bytes, expected {size}")),
        Err(e) => Err(e.to_string()),
    }
}

/// The part of the configuration that times batches from their `sendmsg()` and counts
/// them: vmlinux's BTF and the syscall tracepoints only, so it works where nf_tables' own
/// BTF or symbols are missing (Linux 5.10's modules have no BTF) and the waits cannot be
/// recognised. `ok` stays 0: the contention programs do nothing with it alone.
pub fn batches(vmlinux: &Btf, tp: TpOffsets) -> (NftMutexConfig, String) {
    let m = |s: &str, p: &str, size: u32| member(vmlinux, s, p, size);
    // Timed: the descriptor's socket, from BTF.
    let send = tp
        .send_fd
        .zip(tp.exit_ret)
        .ok_or_else(|| "no sendmsg tracepoints".to_string())
        .and_then(|(fd, ret)| {
            Ok([
                fd,
                ret,
                m("task_struct", "files", 8)?,
                m("files_struct", "fdt", 8)?,
                m("fdtable", "fd", 8)?,
                m("fdtable", "max_fds", 4)?,
                m("file", "private_data", 8)?,
                m("socket", "file", 8)?,
                m("socket", "sk", 8)?,
                m("sock", "__sk_common.skc_family", 2)?,
                m("sock", "sk_protocol", 2)?,
                m("task_struct", "nsproxy", 8)?,
                m("nsproxy", "net_ns", 8)?,
                m("net", "ns.inum", 4)?,
            ])
        });
    // Counted, from the caller's buffers: the msghdr's iovecs, from BTF.
    let count = tp
        .send_msg
        .ok_or_else(|| "sys_enter_sendmsg has no msg field".to_string())
        .and_then(|msg| {
            let (len_off, len_size) = vmlinux
                .member("iovec", "iov_len")
                .map_err(|e| e.to_string())?;
            Ok([
                msg,
                m("user_msghdr", "msg_iov", 8)?,
                m("user_msghdr", "msg_iovlen", 8)?,
                m("iovec", "iov_base", 8)?,
                len_off,
                // iov_base and iov_len, the whole struct on every 64-bit ABI.
                len_off + len_size,
            ])
        })
        .and_then(|c| match c[4..6] {
            [8, 16] => Ok(c),
            _ => Err(format!("struct iovec is not {{ ptr; u64 }}: {c:?}")),
        });
    let detail = match (&send, &count) {
        (Ok(_), Ok(_)) => "batches timed from their sendmsg() on a NETLINK_NETFILTER socket \
                           (syscall tracepoints), less the time they waited for the mutexes, \
                           and counted per object kind from the caller's buffers where \
                           sys_enter_sendmsg_loop loads (bpf_loop, Linux >= 5.17), where \
                           nft_commit does not attach"
            .to_string(),
        (Ok(_), Err(why)) => format!(
            "batches timed from their sendmsg() on a NETLINK_NETFILTER socket (syscall \
             tracepoints), less the time they waited for the mutexes, where nft_commit does \
             not attach; not counted: {why}"
        ),
        (Err(why), _) => format!("batches not timed from sendmsg(): {why}"),
    };
    let s = send.unwrap_or([0; 14]);
    let n = count.unwrap_or([0; 6]);
    let config = NftMutexConfig {
        send_ok: u32::from(s != [0; 14]),
        send_fd: s[0],
        exit_ret: s[1],
        task_files: s[2],
        files_fdt: s[3],
        fdt_fd: s[4],
        fdt_max_fds: s[5],
        file_private: s[6],
        socket_file: s[7],
        socket_sk: s[8],
        sk_family: s[9],
        sk_protocol: s[10],
        task_nsproxy: s[11],
        nsproxy_net_ns: s[12],
        net_inum: s[13],
        count_ok: u32::from(s != [0; 14] && n != [0; 6]),
        send_msg: n[0],
        msghdr_iov: n[1],
        msghdr_iovlen: n[2],
        iovec_base: n[3],
        iovec_len: n[4],
        iovec_size: n[5],
        // The socket's netns, where its batch applies; without `CONFIG_NET_NS` (no
        // `skc_net.net`) the sender's, which is then the only one.
        sk_net: if s == [0; 14] {
            0
        } else {
            m("sock", "__sk_common.skc_net.net", 8).unwrap_or(0)
        },
        ..NftMutexConfig::default()
    };
    (config, detail)
}

/// The programs' configuration from BTF and kallsyms; `Err`: why nf_tables mutex waits
/// cannot be recognised (yet: nf_tables may load later; [`batches`] still works then).
pub fn config(vmlinux: &Btf, tp: TpOffsets, syms: &Symbols) -> Result<Setup, String> {
    let nft_btf = std::path::Path::new("/sys/kernel/btf/nf_tables")
        .exists()
        .then(|| Btf::module(vmlinux, "nf_tables"));
    let (commit_mutex, from) = match &nft_btf {
        Some(Ok(b)) => (
            b.member("nftables_pernet", "commit_mutex"),
            "module nf_tables",
        ),
        Some(Err(e)) => return Err(format!("the nf_tables module's BTF: {e}")),
        None => (
            vmlinux.member("nftables_pernet", "commit_mutex"),
            "vmlinux (nf_tables built in)",
        ),
    };
    let (commit_mutex, _) = commit_mutex
        .map_err(|e| format!("nf_tables is not there (not loaded, or no BTF for it): {e}"))?;
    let m = |s: &str, p: &str, size: u32| member(vmlinux, s, p, size);
    if syms.sched_text.contains(&0) {
        return Err(
            "kallsyms has no __sched_text_start/__sched_text_end (or hides addresses: \
                    kptr_restrict)"
                .into(),
        );
    }
    if syms.net_id == 0 && syms.genid_fn.contains(&0) {
        return Err("kallsyms has neither nf_tables_net_id nor nf_tables_valid_genid".into());
    }
    let (send, send_detail) = batches(vmlinux, tp);
    let config = NftMutexConfig {
        ok: 1,
        task_nsproxy: m("task_struct", "nsproxy", 8)?,
        nsproxy_net_ns: m("nsproxy", "net_ns", 8)?,
        net_inum: m("net", "ns.inum", 4)?,
        net_gen: m("net", "gen", 8)?,
        gen_ptr: m("net_generic", "ptr", 0)?,
        gen_len: m("net_generic", "s.len", 4)?,
        commit_mutex,
        mutex_owner: m("mutex", "owner", 8)?,
        task_pid: m("task_struct", "pid", 4)?,
        task_tgid: m("task_struct", "tgid", 4)?,
        // An array: BTF gives it no size.
        task_comm: m("task_struct", "comm", 0)?,
        task_flags: m("task_struct", "flags", 4)?,
        _pad: 0,
        tp_lock: tp.lock,
        tp_flags: tp.flags,
        tp_ret: tp.ret,
        net_id_addr: syms.net_id,
        genid_fn: syms.genid_fn,
        release_fn: syms.release_fn,
        gc_fn: syms.gc_fn,
        batch_fn: syms.batch_fn,
        sched_text: syms.sched_text,
        ..send
    };
    let id = if syms.net_id != 0 {
        "the commit mutex from nf_tables_net_id (kallsyms)".to_string()
    } else {
        "the commit mutex's pernet id learned from the first wait called from \
         nf_tables_valid_genid or nft_rcv_nl_event (kallsyms lists no nf_tables_net_id: no \
         CONFIG_KALLSYMS_ALL; other waits on it before that one are missed), or from a \
         kernel worker's wait called from nft_trans_gc_work, in its owner's netns"
            .to_string()
    };
    let nfnl = if syms.batch_fn.contains(&0) {
        "nfnetlink's nf_tables mutex not recognised (no nfnetlink_rcv_batch in kallsyms)"
    } else {
        "nfnetlink's nf_tables mutex learned from the first wait called from \
         nfnetlink_rcv_batch"
    };
    Ok(Setup {
        config,
        detail: format!(
            "{id}; {nfnl}; nftables_pernet.commit_mutex at +{commit_mutex} from the BTF of \
             {from}; {send_detail}"
        ),
    })
}

/// Whether `params` (a `btf_trace_*` typedef's) are those the `tp_btf` program of
/// `program` reads: `(void *lock, unsigned int flags)` or `(void *lock, int ret)`.
pub fn check_raw(program: &str, params: Option<Vec<String>>) -> Result<(), String> {
    let want: [&str; 3] = match program {
        BEGIN => ["void *", "void *", "unsigned int"],
        END => ["void *", "void *", "int"],
        _ => return Err(format!("{program} has no raw tracepoint")),
    };
    match params {
        Some(p) if p == want => Ok(()),
        Some(p) => Err(format!(
            "its arguments are ({}), expected ({})",
            p[1.min(p.len())..].join(", "),
            want[1..].join(", ")
        )),
        None => Err(format!("no btf_trace_{program} prototype in BTF")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols_and_function_ends_from_kallsyms() {
        let text = "ffffffff81f85e10 t nfnetlink_rcv_batch\n\
                    ffffffff81f86980 t __pfx_nfnetlink_rcv\n\
                    ffffffff81fc0a50 t nf_tables_valid_genid\n\
                    ffffffff81fc0ae0 t __pfx_nf_tables_commit_audit_log\n\
                    ffffffff82265800 T __sched_text_start\n\
                    ffffffff8226e522 T __sched_text_end\n\
                    0000000000000000 t hidden\n";
        let s = symbols(text);
        assert_eq!(s.batch_fn, [0xffffffff81f85e10, 0xffffffff81f86980]);
        assert_eq!(s.genid_fn, [0xffffffff81fc0a50, 0xffffffff81fc0ae0]);
        assert_eq!(s.sched_text, [0xffffffff82265800, 0xffffffff8226e522]);
        assert_eq!(s.net_id, 0);
        let s = symbols("ffffffffc0a1b2c0 b nf_tables_net_id\t[nf_tables]\n");
        assert_eq!(s.net_id, 0xffffffffc0a1b2c0);
    }

    #[test]
    fn raw_prototypes_are_checked() {
        let p = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect());
        assert_eq!(
            check_raw(BEGIN, p(&["void *", "void *", "unsigned int"])),
            Ok(())
        );
        assert_eq!(check_raw(END, p(&["void *", "void *", "int"])), Ok(()));
        assert!(check_raw(END, p(&["void *", "void *"])).is_err());
        assert!(check_raw(END, None).is_err());
    }
}
