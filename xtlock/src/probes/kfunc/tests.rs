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
    kprobe_first: None,
    setup: None,
    reads: None,
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

/// What `__nf_conntrack_alloc`'s hooks read: `(struct net *, _, struct
/// nf_conntrack_tuple *)`, six parameters for the fexit, a `struct nf_conn *` back.
const ALLOC: Reads = Reads {
    args: &[Want::Ptr("net"), Want::Any, Want::Ptr("nf_conntrack_tuple")],
    fexit_params: Some(6),
    ret: Want::Ptr("nf_conn"),
};

fn proto(params: &[ArgType], ret: ArgType) -> FuncProto {
    let c = |t: &ArgType| match t {
        ArgType::Ptr(n) | ArgType::FwdPtr(n) => format!("struct {n} *"),
        ArgType::Int(_) => "int".to_string(),
        _ => "void".to_string(),
    };
    FuncProto {
        params: params.iter().map(|t| (t.clone(), c(t))).collect(),
        ret: (ret.clone(), c(&ret)),
    }
}

fn alloc_hook() -> KfuncHook {
    KfuncHook {
        functions: &["__nf_conntrack_alloc"],
        reads: Some(ALLOC),
        ..HOOK
    }
}

/// `__nf_conntrack_alloc`'s parameters as the kernel declares them: `(struct net *, const
/// struct nf_conntrack_zone *, const struct nf_conntrack_tuple *orig, *repl, gfp_t, u32)`.
fn alloc_params() -> Vec<ArgType> {
    let ptr = |n: &str| ArgType::Ptr(n.into());
    vec![
        ptr("net"),
        ptr("nf_conntrack_zone"),
        ptr("nf_conntrack_tuple"),
        ptr("nf_conntrack_tuple"),
        ArgType::Int(4),
        ArgType::Int(4),
    ]
}

fn alloc_facts(p: Result<FuncProto, String>) -> KernelFacts {
    let mut f = facts(&[("__nf_conntrack_alloc", None)]);
    f.protos.insert("__nf_conntrack_alloc".into(), p);
    f
}

#[test]
fn a_matching_prototype_attaches_as_usual() {
    let good = proto(&alloc_params(), ArgType::Ptr("nf_conn".into()));
    let p = plan(&alloc_hook(), &alloc_facts(Ok(good))).unwrap();
    assert_eq!(
        p.candidates,
        vec![(AttachKind::FEntry, None), (AttachKind::KProbe, None)]
    );
    assert_eq!(p.unchecked, None);
}

/// A kernel whose function takes other arguments: neither attach type reads them
/// (a kprobe would read the wrong register as well), and the reason names both sides.
#[test]
fn a_mismatching_prototype_is_refused_with_its_reason() {
    let ptr = |n: &str| ArgType::Ptr(n.into());
    // The tuple moved to the second parameter.
    let moved = proto(
        &[
            ptr("net"),
            ptr("nf_conntrack_tuple"),
            ptr("nf_conntrack_zone"),
        ],
        ptr("nf_conn"),
    );
    let p = plan(&alloc_hook(), &alloc_facts(Ok(moved))).unwrap();
    for (kind, skip) in &p.candidates {
        let why = skip
            .as_deref()
            .unwrap_or_else(|| panic!("{kind} not refused"));
        assert!(
            why.contains("parameter 3 is not the struct nf_conntrack_tuple *"),
            "{why}"
        );
        assert!(why.contains("__nf_conntrack_alloc(struct net *"), "{why}");
    }
    // Too few parameters.
    let short = proto(&[ptr("net")], ptr("nf_conn"));
    let p = plan(&alloc_hook(), &alloc_facts(Ok(short))).unwrap();
    assert!(p.candidates.iter().all(|(_, s)| s
        .as_deref()
        .is_some_and(|s| s.contains("has 1 parameters, the hook reads 3"))));
    // Another return type.
    let ret = proto(
        &[ptr("net"), ptr("x"), ptr("nf_conntrack_tuple")],
        ArgType::Int(4),
    );
    let p = plan(&alloc_hook(), &alloc_facts(Ok(ret))).unwrap();
    assert!(p.candidates.iter().all(|(_, s)| s
        .as_deref()
        .is_some_and(|s| s.contains("does not return the struct nf_conn *"))));
}

/// One parameter more: the kprobe still reads its three right, the fexit would take
/// the last argument for the return value.
#[test]
fn another_parameter_count_rules_out_fexit_only() {
    let mut params = alloc_params();
    params.push(ArgType::Int(4));
    let seven = proto(&params, ArgType::Ptr("nf_conn".into()));
    let p = plan(&alloc_hook(), &alloc_facts(Ok(seven))).unwrap();
    let fe = p.candidates[0].1.as_deref().unwrap();
    assert!(fe.contains("the fexit program expects 6"), "{fe}");
    assert_eq!(p.candidates[1], (AttachKind::KProbe, None));
}

/// 5.10's `struct pt_regs *` parameters of syscall functions: kprobes fine, fentry not.
#[test]
fn a_declared_only_struct_rules_out_fentry() {
    let h = KfuncHook {
        functions: &["__x64_sys_execveat"],
        reads: Some(Reads {
            args: &[Want::Ptr("pt_regs")],
            fexit_params: None,
            ret: Want::Any,
        }),
        ..HOOK
    };
    let mut f = facts(&[("__x64_sys_execveat", None)]);
    f.protos.insert(
        "__x64_sys_execveat".into(),
        Ok(proto(&[ArgType::FwdPtr("pt_regs".into())], ArgType::Int(8))),
    );
    let p = plan(&h, &f).unwrap();
    let fe = p.candidates[0].1.as_deref().unwrap();
    assert!(fe.contains("only declares: fentry cannot read it"), "{fe}");
    assert_eq!(p.candidates[1], (AttachKind::KProbe, None));
    // No BTF for it: attached as built, and said so.
    f.protos.insert(
        "__x64_sys_execveat".into(),
        Err("no BTF for module x".into()),
    );
    let p = plan(&h, &f).unwrap();
    assert_eq!(p.unchecked.as_deref(), Some("no BTF for module x"));
}

/// What the hooks say they read matches this kernel, for the functions in its vmlinux
/// BTF (the module ones are checked in the VM runs).
#[test]
fn the_hooks_reads_fit_this_kernel() {
    let Ok(b) = Btf::vmlinux() else {
        eprintln!("skipped: no kernel BTF");
        return;
    };
    let hooks = super::super::KFUNC_HOOKS
        .iter()
        .copied()
        .chain(super::super::HOOKS.iter().filter_map(|h| h.fallback));
    let mut checked = 0;
    for h in hooks {
        let Some(r) = &h.reads else { continue };
        for f in h.functions {
            if let Some(p) = b.func_proto(f) {
                if let Err((all, _)) = check_proto(f, r, &p) {
                    assert!(all.is_none(), "{}: {all:?}", h.name);
                }
                checked += 1;
            }
        }
    }
    eprintln!("{checked} prototypes checked");
}

/// A refused preferred program is said in a line: the error's first line, without the
/// verifier's log.
#[test]
fn refusals_in_a_line() {
    assert_eq!(
        super::short_refusal(
            "the BPF_PROG_LOAD syscall returned Permission denied (os error 13). Verifier \
             output: 0: r1 = 0\nR1 !read_ok"
        ),
        "the BPF_PROG_LOAD syscall returned Permission denied (os error 13)"
    );
    assert_eq!(super::short_refusal("a\nb"), "a");
}

/// A refused load says the verifier's reason on one line, without its statistics; an
/// empty log adds nothing.
#[test]
fn a_refused_load_is_said_in_one_line() {
    let e = std::io::Error::other(
        "the BPF_PROG_LOAD syscall returned Invalid argument (os error 22). Verifier output: \
         The function nf_setsockopt arg3 type STRUCT is unsupported.\nverification time 237 \
         usec\nstack depth 0+0\nprocessed 0 insns (limit 1000000) max_states_per_insn 0\n",
    );
    assert_eq!(
        explain(&e),
        "the BPF_PROG_LOAD syscall returned Invalid argument (os error 22): verifier: The \
         function nf_setsockopt arg3 type STRUCT is unsupported."
    );
    let e = std::io::Error::other("load failed. Verifier output: \0\n");
    assert_eq!(explain(&e), "load failed");
}
