use super::*;

const HOOK: KfuncHook = KfuncHook {
    name: "nft_commit",
    purpose: "",
    functions: &["nfnetlink_rcv_batch", "nf_tables_commit"],
    module: Some("xtlock_no_such_module"),
    fentry: Some("a"),
    fexit: Some("b"),
    kprobe: Some("c"),
    kretprobe: Some("d"),
    setup: None,
};

fn facts(symbols: &[(&str, Option<&str>)]) -> KernelFacts {
    KernelFacts {
        symbols: symbols
            .iter()
            .map(|(n, m)| (n.to_string(), m.map(str::to_string)))
            .collect(),
        btf_funcs: symbols
            .iter()
            .filter(|(_, m)| m.is_none())
            .map(|(n, _)| n.to_string())
            .collect(),
        kprobes: true,
        ..Default::default()
    }
}

#[test]
fn prefers_the_first_function_and_fentry() {
    let f = facts(&[("nf_tables_commit", None), ("nfnetlink_rcv_batch", None)]);
    let p = plan(&HOOK, &f).unwrap();
    assert_eq!(p.function, "nfnetlink_rcv_batch");
    assert_eq!(
        p.candidates,
        vec![(AttachKind::FEntry, None), (AttachKind::KProbe, None)]
    );
}

#[test]
fn falls_back_to_the_next_function_when_the_first_is_inlined() {
    let p = plan(&HOOK, &facts(&[("nf_tables_commit", Some("nf_tables"))])).unwrap();
    assert_eq!(p.function, "nf_tables_commit");
}

#[test]
fn missing_module_is_named() {
    let e = plan(&HOOK, &facts(&[])).unwrap_err();
    assert!(
        e.to_string()
            .contains("module xtlock_no_such_module not loaded"),
        "{e}"
    );
    let h = KfuncHook {
        module: None,
        ..HOOK
    };
    let e = plan(&h, &facts(&[])).unwrap_err();
    assert!(e.to_string().contains("inlined"), "{e}");
}

#[test]
fn hooks_without_a_kind_do_not_list_it() {
    let h = KfuncHook {
        fentry: None,
        fexit: None,
        kprobe: None,
        ..HOOK
    };
    let p = plan(&h, &facts(&[("nf_tables_commit", None)])).unwrap();
    assert_eq!(p.candidates, vec![(AttachKind::KProbe, None)]);
    assert_eq!(candidates_text(&h), "kretprobe");
    assert_eq!(
        candidates_text(&HOOK),
        "fentry/fexit, else kprobe/kretprobe"
    );
}

#[test]
fn skips_say_why() {
    let mut f = facts(&[("nfnetlink_rcv_batch", Some("nfnetlink"))]);
    f.kprobes = false;
    let p = plan(&HOOK, &f).unwrap();
    let fe = p.candidates[0].1.as_deref().unwrap();
    assert!(fe.contains("in module nfnetlink"), "{fe}");
    assert_eq!(
        p.candidates[1].1.as_deref(),
        Some("kernel built without kprobes")
    );
    f.btf_error = Some("gone".into());
    let p = plan(&HOOK, &f).unwrap();
    assert!(p.candidates[0]
        .1
        .as_deref()
        .unwrap()
        .contains("no kernel BTF"));
}

#[test]
fn filter_rules_per_hook_and_everywhere() {
    let f = AttachFilter::parse("fentry, sys_exit_setsockopt:tracepoint").unwrap();
    assert_eq!(
        f.blocks("nft_commit", AttachKind::FEntry).as_deref(),
        Some("ruled out by --no-attach fentry")
    );
    assert_eq!(f.blocks("nft_commit", AttachKind::KProbe), None);
    assert_eq!(f.blocks("flock_lock_inode", AttachKind::Tracepoint), None);
    assert_eq!(
        f.blocks("sys_exit_setsockopt", AttachKind::Tracepoint)
            .as_deref(),
        Some("ruled out by --no-attach sys_exit_setsockopt:tracepoint")
    );
    assert!(f.unknown_hooks(&["sys_exit_setsockopt"]).is_empty());
    let typo = AttachFilter::parse("sys_exit_setsockop:tracepoint,kprobe").unwrap();
    assert_eq!(
        typo.unknown_hooks(&["sys_exit_setsockopt"]),
        vec!["sys_exit_setsockop"]
    );
    let e = AttachFilter::parse("uprobe").unwrap_err();
    assert!(e.contains("tracepoint, tp_btf, fentry or kprobe"), "{e}");
    let b = AttachFilter::parse("flock_lock_inode:tp_btf").unwrap();
    assert_eq!(
        b.blocks("flock_lock_inode", AttachKind::BtfTracepoint)
            .as_deref(),
        Some("ruled out by --no-attach flock_lock_inode:tp_btf")
    );
    assert_eq!(b.blocks("flock_lock_inode", AttachKind::Tracepoint), None);
    let mut fa = facts(&[("nfnetlink_rcv_batch", None)]);
    fa.filter = f;
    let p = plan(&HOOK, &fa).unwrap();
    assert_eq!(
        p.candidates[0].1.as_deref(),
        Some("ruled out by --no-attach fentry")
    );
    assert_eq!(p.candidates[1].1, None);
    let m = AttachFilter::merge(&[
        AttachFilter::parse("kprobe").unwrap(),
        AttachFilter::parse("x:fentry").unwrap(),
    ]);
    assert!(m.blocks("x", AttachKind::FEntry).is_some());
    assert!(m.blocks("y", AttachKind::KProbe).is_some());
    assert!(m.blocks("y", AttachKind::FEntry).is_none());
}

#[test]
fn kallsyms_text_symbols_with_modules() {
    let text = "ffffffff81f2ce40 t nfnetlink_rcv_batch\n\
                ffffffff81241e0d t nf_tables_commit.cold\n\
                ffffffffc0a01000 t nf_tables_commit\t[nf_tables]\n\
                ffffffffc0a01000 d nfnetlink_rcv_batch\n";
    assert_eq!(
        kallsyms_functions(text, HOOK.functions),
        vec![
            ("nfnetlink_rcv_batch".to_string(), None),
            (
                "nf_tables_commit".to_string(),
                Some("nf_tables".to_string())
            ),
        ]
    );
}
