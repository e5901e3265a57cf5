//! The nf_tables commit hook: the second lock. nft, iptables-nft, kube-proxy's nftables mode
//! and firewalld take no file lock; the kernel serialises their netlink batches. The hook
//! times `nfnetlink_rcv_batch` (else `nf_tables_commit`) per thread. No tracepoint exists
//! for it: fentry/fexit, else kprobe/kretprobe (see [`super::kfunc`]).

use super::kfunc::KfuncHook;

pub const HOOK: KfuncHook = KfuncHook {
    name: "nft_commit",
    purpose: "nf_tables commits (nft, iptables-nft, kube-proxy nftables mode, firewalld): \
              holds of the second lock, \"nf_tables commit (netns N)\"",
    // The whole batch (it holds the commit mutex from its generation check to the commit or
    // abort), else the commit alone.
    functions: &["nfnetlink_rcv_batch", "nf_tables_commit"],
    module: Some("nf_tables"),
    fentry: Some("nft_commit_fentry"),
    fexit: Some("nft_commit_fexit"),
    kprobe: Some("nft_commit_kprobe"),
    kretprobe: Some("nft_commit_kretprobe"),
    setup: None,
    // Timed only: no argument or return value read.
    reads: None,
};
