//! Conntrack refusals seen where the kernel makes them (see `xtlock-ebpf`'s
//! `probes/conntrack.rs`): `__nf_conntrack_confirm` returning `NF_DROP` (insert failed) and
//! `__nf_conntrack_alloc` failing (table full), each with the connection's tuple. Where they
//! attach, they replace the inference from `/proc/net/stat/nf_conntrack` deltas, which stay
//! as the fallback and a cross-check.

use aya::Ebpf;
use xtlock_common::CtConfig;

use super::{
    btf::Btf,
    kfunc::{fill_config_once, Chosen, KfuncHook, Reads, Want},
};

pub const INSERT_FAILED: KfuncHook = KfuncHook {
    name: "conntrack_insert_failed",
    purpose: "connections conntrack refused to confirm (insert_failed: clash, chain too \
              long), with their addresses",
    functions: &["__nf_conntrack_confirm"],
    module: Some("nf_conntrack"),
    fentry: None,
    fexit: Some("ct_confirm_fexit"),
    kprobe: Some("ct_confirm_kprobe"),
    kretprobe: Some("ct_confirm_kretprobe"),
    kprobe_first: None,
    setup: Some(setup),
    // `int __nf_conntrack_confirm(struct sk_buff *skb)`.
    reads: Some(Reads {
        args: &[Want::Ptr("sk_buff")],
        fexit_params: Some(1),
        ret: Want::Int,
    }),
};

pub const TABLE_FULL: KfuncHook = KfuncHook {
    name: "conntrack_table_full",
    purpose: "connections refused because the conntrack table was full, with their addresses",
    functions: &["__nf_conntrack_alloc"],
    module: Some("nf_conntrack"),
    fentry: None,
    fexit: Some("ct_alloc_fexit"),
    kprobe: Some("ct_alloc_kprobe"),
    kretprobe: Some("ct_alloc_kretprobe"),
    kprobe_first: None,
    setup: Some(setup),
    // `struct nf_conn *__nf_conntrack_alloc(struct net *net, const struct nf_conntrack_zone
    // *zone, const struct nf_conntrack_tuple *orig, const struct nf_conntrack_tuple *repl,
    // gfp_t gfp, u32 hash)`.
    reads: Some(Reads {
        args: &[Want::Ptr("net"), Want::Any, Want::Ptr("nf_conntrack_tuple")],
        fexit_params: Some(6),
        ret: Want::Ptr("nf_conn"),
    }),
};

/// The offsets of this kernel, from the module's BTF when nf_conntrack is a module, else
/// from vmlinux.
pub fn offsets(vmlinux: &Btf) -> Result<CtConfig, String> {
    let module;
    let btf = if std::path::Path::new("/sys/kernel/btf/nf_conntrack").exists() {
        module = Btf::module(vmlinux, "nf_conntrack").map_err(|e| e.to_string())?;
        &module
    } else {
        vmlinux
    };
    offsets_in(btf)
}

pub fn offsets_in(btf: &Btf) -> Result<CtConfig, String> {
    let m = |s: &str, p: &str| btf.member_offset(s, p).map_err(|e| e.to_string());
    Ok(CtConfig {
        ok: 1,
        skb_nfct: m("sk_buff", "_nfct")?,
        ct_tuple: m("nf_conn", "tuplehash")? + m("nf_conntrack_tuple_hash", "tuple")?,
        ct_net: m("nf_conn", "ct_net.net")?,
        net_inum: m("net", "ns.inum")?,
        src_u3: m("nf_conntrack_tuple", "src.u3")?,
        src_port: m("nf_conntrack_tuple", "src.u.all")?,
        src_l3num: m("nf_conntrack_tuple", "src.l3num")?,
        dst_u3: m("nf_conntrack_tuple", "dst.u3")?,
        dst_port: m("nf_conntrack_tuple", "dst.u.all")?,
        dst_protonum: m("nf_conntrack_tuple", "dst.protonum")?,
        _pad: 0,
    })
}

fn setup(ebpf: &mut Ebpf, vmlinux: Option<&Btf>, _: &Chosen<'_>) -> Result<(), String> {
    // Both conntrack hooks share it: the module's BTF is read once.
    fill_config_once(
        ebpf,
        "CT_CONFIG",
        |c: &CtConfig| c.ok != 0,
        || {
            let vmlinux =
                vmlinux.ok_or("no kernel BTF: the connection's addresses cannot be read")?;
            offsets(vmlinux)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a kernel with BTF, every offset is found (nf_conntrack built in or loaded).
    #[test]
    fn this_kernel() {
        let Ok(b) = Btf::vmlinux() else {
            eprintln!("skipped: no kernel BTF");
            return;
        };
        match offsets(&b) {
            Ok(c) => {
                assert!(c.ct_tuple > 0 && c.dst_u3 > c.src_u3, "{c:?}");
                assert_eq!(c.src_u3, 0, "the tuple starts with src.u3: {c:?}");
            }
            Err(e) => {
                assert!(
                    !std::path::Path::new("/proc/net/stat/nf_conntrack").exists(),
                    "nf_conntrack is there but its offsets were not found: {e}"
                );
            }
        }
    }
}
