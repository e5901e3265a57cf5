//! The nf_tables commit hook: the second lock. nft, iptables-nft, kube-proxy's nftables mode
//! and firewalld take no file lock; the kernel serialises their netlink batches. The hook
//! times `nfnetlink_rcv_batch` (else `nf_tables_commit`) per thread, and counts the batch's
//! messages per object kind at entry. No tracepoint exists for it: fentry/fexit, else
//! kprobe/kretprobe (see [`super::kfunc`]).

use aya::Ebpf;
use xtlock_common::NftConfig;

use super::{
    btf::{ArgType, Btf},
    kfunc::{set_config, Chosen, KfuncHook},
};

pub const HOOK: KfuncHook = KfuncHook {
    name: "nft_commit",
    purpose: "nf_tables commits (nft, iptables-nft, kube-proxy nftables mode, firewalld): \
              holds of the second lock, \"nf_tables commit (netns N)\", with the batch's \
              changes per object kind",
    // The whole batch (it holds the commit mutex from its generation check to the commit or
    // abort), else the commit alone.
    functions: &["nfnetlink_rcv_batch", "nf_tables_commit"],
    module: Some("nf_tables"),
    fentry: Some("nft_commit_fentry"),
    fexit: Some("nft_commit_fexit"),
    kprobe: Some("nft_commit_kprobe"),
    kretprobe: Some("nft_commit_kretprobe"),
    // Walks any batch with bpf_loop (Linux >= 5.17); else `kprobe`'s walk of 1,024 messages.
    kprobe_first: Some(("nft_commit_kprobe_loop", "bpf_loop (Linux >= 5.17)")),
    setup: Some(setup),
    // Timing needs no argument; the batch walk checks its own (see `setup`), and without it
    // commits are still timed.
    reads: None,
};

/// Which argument of `function` is the batch's `struct sk_buff *`:
/// `nfnetlink_rcv_batch(struct sk_buff *skb, struct nlmsghdr *nlh, u16 subsys_id, u32 genid)`
/// and `nf_tables_commit(struct net *net, struct sk_buff *skb)` (both since Linux 4.x).
pub fn skb_arg(function: &str) -> Option<u32> {
    match function {
        "nfnetlink_rcv_batch" => Some(0),
        "nf_tables_commit" => Some(1),
        _ => None,
    }
}

/// Where the programs find the batch for `chosen`, from BTF; `Err`: why batches will not be
/// counted. The argument is checked against the function's prototype where BTF has it (the
/// module's split BTF, Linux >= 5.11); before that, the prototypes above are trusted.
pub fn config(vmlinux: &Btf, chosen: &Chosen<'_>) -> Result<NftConfig, String> {
    let arg = skb_arg(chosen.function)
        .ok_or_else(|| format!("no known batch argument for {}", chosen.function))?;
    let module = chosen
        .module
        .filter(|m| std::path::Path::new("/sys/kernel/btf").join(m).exists())
        .map(|m| Btf::module(vmlinux, m));
    let proto = match &module {
        Some(Ok(b)) => b.func_proto(chosen.function),
        _ => vmlinux.func_proto(chosen.function),
    };
    if let Some(p) = proto {
        check_arg(chosen.function, arg, &p.params)?;
    }
    let m = |s: &str, f: &str| vmlinux.member_offset(s, f).map_err(|e| e.to_string());
    Ok(NftConfig {
        ok: 1,
        skb_arg: arg,
        skb_data: m("sk_buff", "data")?,
        skb_len: m("sk_buff", "len")?,
    })
}

/// Whether parameter `arg` of `function` is a `struct sk_buff *`.
pub fn check_arg(function: &str, arg: u32, params: &[(ArgType, String)]) -> Result<(), String> {
    match params.get(arg as usize) {
        Some((ArgType::Ptr(n) | ArgType::FwdPtr(n), _)) if n == "sk_buff" => Ok(()),
        Some((_, c)) => Err(format!(
            "parameter {} of this kernel's {function} is a `{c}`, not the batch's \
             `struct sk_buff *`",
            arg + 1
        )),
        None => Err(format!(
            "this kernel's {function} has {} parameters, the batch is parameter {}",
            params.len(),
            arg + 1
        )),
    }
}

/// Writes `NFT_CONFIG` for the chosen function (again at every attach: the function may
/// differ after the module reloads). A batch that cannot be walked (no kernel BTF: the
/// caller passes what it could read) leaves commits timed, with their changes unknown.
fn setup(ebpf: &mut Ebpf, vmlinux: Option<&Btf>, chosen: &Chosen<'_>) -> Result<(), String> {
    let config = vmlinux
        .ok_or_else(|| "no kernel BTF".to_string())
        .and_then(|b| config(b, chosen))
        .unwrap_or_else(|why| {
            tracing::warn!(%why, "nf_tables commits will be timed without their changes");
            NftConfig::default()
        });
    set_config(ebpf, "NFT_CONFIG", config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ptr(n: &str) -> (ArgType, String) {
        (ArgType::Ptr(n.into()), format!("struct {n} *"))
    }

    #[test]
    fn the_batch_argument_is_checked_against_the_prototype() {
        let batch = [
            ptr("sk_buff"),
            ptr("nlmsghdr"),
            (ArgType::Int(2), "u16".into()),
            (ArgType::Int(4), "u32".into()),
        ];
        let arg = skb_arg("nfnetlink_rcv_batch").unwrap();
        assert_eq!(check_arg("nfnetlink_rcv_batch", arg, &batch), Ok(()));
        let commit = [ptr("net"), ptr("sk_buff")];
        let arg = skb_arg("nf_tables_commit").unwrap();
        assert_eq!(check_arg("nf_tables_commit", arg, &commit), Ok(()));
        // A kernel whose commit lost its skb: commits are timed, not counted.
        let e = check_arg("nf_tables_commit", arg, &[ptr("net")]).unwrap_err();
        assert!(
            e.contains("has 1 parameters, the batch is parameter 2"),
            "{e}"
        );
        let e = check_arg("nf_tables_commit", 0, &commit).unwrap_err();
        assert!(
            e.contains("parameter 1 of this kernel's nf_tables_commit is a `struct net *`"),
            "{e}"
        );
        assert_eq!(skb_arg("nf_tables_abort"), None);
    }

    /// What the batch walks cost the verifier: loads the two kprobe entries (nothing attaches)
    /// and prints the instructions it went through (Linux >= 5.16). Root; run by hand when
    /// changing the walk: `cargo test -p xtlock --lib nft_walk_verifier_cost -- --ignored
    /// --nocapture` (the VM runs the real test on every kernel).
    #[test]
    #[ignore = "needs root and BPF"]
    fn nft_walk_verifier_cost() {
        let mut ebpf = aya::EbpfLoader::new()
            .load(super::super::BPF_OBJECT)
            .unwrap();
        for name in ["nft_commit_kprobe", "nft_commit_kprobe_loop"] {
            let p: &mut aya::programs::KProbe = ebpf.program_mut(name).unwrap().try_into().unwrap();
            p.load().unwrap();
            let n = p.info().unwrap().verified_instruction_count();
            eprintln!("{name}: {n:?} instructions verified");
        }
    }
}
