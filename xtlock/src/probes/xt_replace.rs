//! The legacy table swap: `xt_replace_table` timed per call (see `xtlock-ebpf`'s
//! `probes/xt_replace.rs`). Holds report it as `swap_ns`, the part of `kernel_ns` spent
//! swapping the table in and waiting for every CPU to leave the old one.

use super::kfunc::KfuncHook;

pub const HOOK: KfuncHook = KfuncHook {
    name: "xt_replace_table",
    purpose: "legacy table swaps: the kernel's wait for every CPU to leave the old table, \
              inside the hold (swap_ns)",
    functions: &["xt_replace_table"],
    module: Some("x_tables"),
    fentry: Some("xt_replace_fentry"),
    fexit: Some("xt_replace_fexit"),
    kprobe: Some("xt_replace_kprobe"),
    kretprobe: Some("xt_replace_kretprobe"),
    kprobe_first: None,
    setup: None,
    // Timed only: no argument or return value read.
    reads: None,
};
