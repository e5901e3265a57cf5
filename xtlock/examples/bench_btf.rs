//! The kernel-BTF lookups xtlock makes at start-up, answered by three readers, for issue 32
//! (keep `probes/btf.rs` or use a maintained crate). Build with `--release`:
//!
//!   bench_btf xtlock|btf-rs|btf-rs-mmap|aya-obj [--repeat N] [--file PATH] [--print]
//!   bench_btf check [--file PATH]
//!
//! Each reader reads the file (default `/sys/kernel/btf/vmlinux`), parses it and answers the
//! lookups of [`lookups`]: every struct member xtlock's callers ask for (discover.rs,
//! conntrack.rs, nft_commit.rs, ipvs.rs), the two raw tracepoint prototypes, the drop-reason
//! enum, and for every kernel function of the hooks whether BTF has it and its prototype.
//! `--repeat N` does it N times in one process; the time of the parse and of the lookups is
//! printed on stderr (the whole process is timed from outside: hyperfine, /usr/bin/time -v).
//! `--print` prints every answer on stdout; `check` compares xtlock's and btf-rs's answers
//! and exits 1 when they differ.
//!
//! `aya-obj` (aya 0.14's parser, `aya::Btf`) has no public way to read a type by id or a
//! struct's members (`type_by_id`, `types` are `pub(crate)` in 0.3.0) and no split BTF: it
//! only parses, and answers `has_func` through `id_by_type_name_kind`.
//!
//! The btf-rs reader below is what `probes/btf.rs` would keep if it were replaced by the
//! crate: btf-rs parses and resolves ids and names, but member paths through anonymous
//! members, sizes, C spellings and prototype checks stay xtlock's code.
//!
//! Binary size: build it with one reader only (`--cfg bench_btf_xtlock`, `bench_btf_btf_rs`,
//! `bench_btf_aya_obj`) or none, and compare the sizes (cargo does not rebuild for new
//! `--cfg`s alone: touch this file first):
//!
//!   cargo rustc -p xtlock --release --example bench_btf -- --cfg bench_btf_one --cfg bench_btf_btf_rs
#![allow(unexpected_cfgs)]
#![cfg_attr(
    bench_btf_one,
    allow(
        dead_code,
        unused_imports,
        unused_variables,
        unused_assignments,
        unreachable_code
    )
)]
use std::{path::PathBuf, time::Instant};

use xtlock::probes::{btf::VMLINUX, HOOKS, KFUNC_HOOKS};

/// Member paths, as the callers ask for them (alternatives both asked: a kernel has one).
const MEMBERS: &[(&str, &str)] = &[
    // discover.rs
    ("task_struct", "nsproxy"),
    ("nsproxy", "net_ns"),
    ("net", "ns.inum"),
    ("sk_buff", "head"),
    ("sk_buff", "network_header"),
    ("sk_buff", "transport_header"),
    ("sk_buff", "dev"),
    ("sk_buff", "sk"),
    ("sk_buff", "protocol"),
    ("net_device", "ifindex"),
    ("net_device", "nd_net.net"),
    ("sock", "__sk_common.skc_net.net"),
    ("pt_regs", "di"),
    ("pt_regs", "si"),
    ("pt_regs", "dx"),
    ("pt_regs", "r10"),
    ("pt_regs", "r8"),
    ("pt_regs", "regs"),
    ("inode", "i_ino"),
    ("inode", "i_sb"),
    ("super_block", "s_dev"),
    ("file_lock", "c.flc_owner"),
    ("file_lock", "fl_owner"),
    ("file_lock", "c.flc_flags"),
    ("file_lock", "fl_flags"),
    ("file_lock", "c.flc_type"),
    ("file_lock", "fl_type"),
    // nft_commit.rs
    ("sk_buff", "data"),
    ("sk_buff", "len"),
    // conntrack.rs
    ("sk_buff", "_nfct"),
    ("nf_conn", "tuplehash"),
    ("nf_conntrack_tuple_hash", "tuple"),
    ("nf_conn", "ct_net.net"),
    ("nf_conntrack_tuple", "src.u3"),
    ("nf_conntrack_tuple", "src.u.all"),
    ("nf_conntrack_tuple", "src.l3num"),
    ("nf_conntrack_tuple", "dst.u3"),
    ("nf_conntrack_tuple", "dst.u.all"),
    ("nf_conntrack_tuple", "dst.protonum"),
    // ipvs.rs (from the ip_vs module's BTF when it has one)
    ("ip_vs_conn", "af"),
    ("ip_vs_conn", "protocol"),
    ("ip_vs_conn", "caddr"),
    ("ip_vs_conn", "vaddr"),
    ("ip_vs_conn", "daddr"),
    ("ip_vs_conn", "cport"),
    ("ip_vs_conn", "vport"),
    ("ip_vs_conn", "dport"),
    ("ip_vs_conn", "flags"),
    ("ip_vs_conn", "dest"),
    ("ip_vs_conn", "timer"),
    ("ip_vs_conn", "timer.expires"),
    ("ip_vs_conn", "ipvs"),
    ("netns_ipvs", "sysctl_expire_nodest_conn"),
    ("ip_vs_dest", "cflags"),
    ("ip_vs_dest", "flags"),
    ("ip_vs_dest", "weight"),
    ("ip_vs_service", "af"),
    ("ip_vs_service", "protocol"),
    ("ip_vs_service", "addr"),
    ("ip_vs_service", "port"),
    ("ip_vs_dest_user_kern", "addr"),
    ("ip_vs_dest_user_kern", "port"),
    ("ip_vs_dest_user_kern", "weight"),
    ("ip_vs_service_user_kern", "af"),
    ("ip_vs_service_user_kern", "protocol"),
    ("ip_vs_service_user_kern", "addr"),
    ("ip_vs_service_user_kern", "port"),
];

const TYPEDEFS: &[&str] = &["btf_trace_kfree_skb", "btf_trace_flock_lock_inode"];
const ENUMS: &[&str] = &["skb_drop_reason"];

/// Every kernel function of the hooks (what `kfunc::discover` asks `has_func` and, for the
/// hooks that read arguments, `func_proto` of).
fn functions() -> Vec<&'static str> {
    let mut f: Vec<&str> = KFUNC_HOOKS
        .iter()
        .copied()
        .chain(HOOKS.iter().filter_map(|h| h.fallback))
        .flat_map(|h| h.functions.iter().copied())
        .collect();
    f.sort_unstable();
    f.dedup();
    f
}

/// The answers, one line each, spelled the same way by every reader.
type Answers = Vec<String>;

/// A reader: parse, then answer.
trait Reader: Sized {
    fn parse(path: &std::path::Path) -> Result<Self, String>;
    fn answer(&self, functions: &[&str]) -> Answers;
}

fn show<T: std::fmt::Debug>(v: Option<T>) -> String {
    match v {
        Some(v) => format!("{v:?}"),
        None => "-".into(),
    }
}

mod ours {
    use xtlock::probes::btf::Btf;

    use super::*;

    impl Reader for Btf {
        fn parse(path: &std::path::Path) -> Result<Self, String> {
            Btf::from_file(path).map_err(|e| e.to_string())
        }
        fn answer(&self, functions: &[&str]) -> Answers {
            let mut out = Vec::new();
            for (s, m) in MEMBERS {
                out.push(format!("member {s}.{m} {}", show(self.member(s, m).ok())));
            }
            for t in TYPEDEFS {
                out.push(format!("typedef {t} {}", show(self.fn_typedef_params(t))));
            }
            for e in ENUMS {
                let n = self.enum_values(e).map(|v| (v.len(), v.last().cloned()));
                out.push(format!("enum {e} {}", show(n)));
            }
            for f in functions {
                let p = self.func_proto(f).map(|p| {
                    let mut v: Vec<String> =
                        p.params.iter().map(|(a, c)| format!("{a:?}/{c}")).collect();
                    v.push(format!("-> {:?}/{}", p.ret.0, p.ret.1));
                    v
                });
                out.push(format!("func {f} {} {}", self.has_func(f), show(p)));
            }
            out
        }
    }
}

mod with_btf_rs {
    use btf_rs::{Btf, BtfType, Type};
    use xtlock::probes::btf::ArgType;

    use super::*;

    /// btf-rs with its default (cache) backend, or its mmap one.
    pub struct Cached(pub Btf);
    pub struct Mapped(pub Btf);

    impl Reader for Cached {
        fn parse(path: &std::path::Path) -> Result<Self, String> {
            Btf::from_file(path).map(Cached).map_err(|e| e.to_string())
        }
        fn answer(&self, functions: &[&str]) -> Answers {
            answer(&self.0, functions)
        }
    }
    impl Reader for Mapped {
        fn parse(path: &std::path::Path) -> Result<Self, String> {
            Btf::from_file_with_backend(path, btf_rs::Backend::Mmap)
                .map(Mapped)
                .map_err(|e| e.to_string())
        }
        fn answer(&self, functions: &[&str]) -> Answers {
            answer(&self.0, functions)
        }
    }

    /// Through typedefs and qualifiers.
    fn resolve(b: &Btf, mut t: Type) -> Type {
        for _ in 0..32 {
            match &t {
                Type::Typedef(_)
                | Type::Const(_)
                | Type::Volatile(_)
                | Type::Restrict(_)
                | Type::TypeTag(_) => {
                    match t.as_btf_type().and_then(|x| b.resolve_chained_type(x).ok()) {
                        Some(n) => t = n,
                        None => break,
                    }
                }
                _ => break,
            }
        }
        t
    }

    fn name(b: &Btf, t: &dyn BtfType) -> String {
        b.resolve_name(t).unwrap_or_default()
    }

    /// `(bit offset, member type, bitfield size)` of `member` in `t`, through anonymous
    /// members.
    fn find_member(b: &Btf, t: &Type, member: &str, depth: u32) -> Option<(u32, Type, u32)> {
        if depth > 8 {
            return None;
        }
        let (Type::Struct(s) | Type::Union(s)) = resolve(b, t.clone()) else {
            return None;
        };
        for m in &s.members {
            let n = name(b, m);
            if n == member {
                let ty = b.resolve_chained_type(m).ok()?;
                return Some((m.bit_offset(), ty, m.bitfield_size().unwrap_or(0)));
            }
            if n.is_empty() {
                let ty = b.resolve_chained_type(m).ok()?;
                if let Some((off, ity, bf)) = find_member(b, &ty, member, depth + 1) {
                    return Some((m.bit_offset() + off, ity, bf));
                }
            }
        }
        None
    }

    fn size_of(b: &Btf, t: Type) -> u32 {
        match resolve(b, t) {
            Type::Ptr(_) => 8,
            Type::Int(i) => i.size() as u32,
            Type::Struct(s) | Type::Union(s) => s.size() as u32,
            Type::Enum(e) => e.size() as u32,
            Type::Enum64(e) => e.size() as u32,
            Type::Float(f) => f.size() as u32,
            _ => 0,
        }
    }

    pub fn member(b: &Btf, strukt: &str, path: &str) -> Option<(u32, u32)> {
        let mut t = b
            .resolve_types_by_name(strukt)
            .ok()?
            .into_iter()
            .find(|t| matches!(t, Type::Struct(s) if !s.members.is_empty()))?;
        let mut bits = 0;
        for seg in path.split('.') {
            let (off, ty, bf) = find_member(b, &t, seg, 0)?;
            if bf != 0 {
                return None;
            }
            bits += off;
            t = ty;
        }
        bits.is_multiple_of(8).then(|| (bits / 8, size_of(b, t)))
    }

    fn c_name(b: &Btf, t: Type) -> String {
        match resolve(b, t) {
            Type::Void => "void".into(),
            Type::Ptr(p) => match b.resolve_chained_type(&p) {
                Ok(to) => format!("{} *", c_name(b, to)),
                Err(_) => "void *".into(),
            },
            Type::Struct(s) => format!("struct {}", name(b, &s)),
            Type::Union(u) => format!("union {}", name(b, &u)),
            Type::Fwd(f) if f.is_union() => format!("union {}", name(b, &f)),
            Type::Fwd(f) => format!("struct {}", name(b, &f)),
            Type::Enum(e) => format!("enum {}", name(b, &e)),
            Type::Enum64(e) => format!("enum {}", name(b, &e)),
            t => t.as_btf_type().map(|x| name(b, x)).unwrap_or_default(),
        }
    }

    fn arg_type(b: &Btf, t: Type) -> ArgType {
        match resolve(b, t.clone()) {
            Type::Void => ArgType::Void,
            Type::Ptr(p) => match b.resolve_chained_type(&p).map(|to| resolve(b, to)) {
                Ok(Type::Struct(s) | Type::Union(s)) => ArgType::Ptr(name(b, &s)),
                Ok(Type::Fwd(f)) => ArgType::FwdPtr(name(b, &f)),
                _ => ArgType::Ptr(String::new()),
            },
            Type::Int(i) => ArgType::Int(i.size() as u32),
            Type::Enum(e) => ArgType::Int(e.size() as u32),
            Type::Enum64(e) => ArgType::Int(e.size() as u32),
            _ => ArgType::Other(c_name(b, t)),
        }
    }

    fn fn_typedef_params(b: &Btf, n: &str) -> Option<Vec<String>> {
        let td = b
            .resolve_types_by_name(n)
            .ok()?
            .into_iter()
            .find_map(|t| match t {
                Type::Typedef(td) => Some(td),
                _ => None,
            })?;
        let Type::Ptr(p) = b.resolve_chained_type(&td).ok()? else {
            return None;
        };
        let Type::FuncProto(proto) = resolve(b, b.resolve_chained_type(&p).ok()?) else {
            return None;
        };
        let mut out = Vec::new();
        for prm in &proto.parameters {
            out.push(c_name(b, b.resolve_chained_type(prm).ok()?));
        }
        Some(out)
    }

    fn func(b: &Btf, n: &str) -> Option<btf_rs::Func> {
        b.resolve_types_by_name(n)
            .ok()?
            .into_iter()
            .find_map(|t| match t {
                Type::Func(f) => Some(f),
                _ => None,
            })
    }

    pub fn answer(b: &Btf, functions: &[&str]) -> Answers {
        let mut out = Vec::new();
        for (s, m) in MEMBERS {
            out.push(format!("member {s}.{m} {}", show(member(b, s, m))));
        }
        for t in TYPEDEFS {
            out.push(format!("typedef {t} {}", show(fn_typedef_params(b, t))));
        }
        for e in ENUMS {
            let vals = b.resolve_types_by_name(e).ok().and_then(|ts| {
                ts.into_iter().find_map(|t| match t {
                    Type::Enum(en) => Some(
                        en.members
                            .iter()
                            .map(|m| (name(b, m), i64::from(m.val() as i32)))
                            .collect::<Vec<_>>(),
                    ),
                    Type::Enum64(en) => Some(
                        en.members
                            .iter()
                            .map(|m| (name(b, m), m.val() as i64))
                            .collect(),
                    ),
                    _ => None,
                })
            });
            let n = vals.map(|v| (v.len(), v.last().cloned()));
            out.push(format!("enum {e} {}", show(n)));
        }
        for f in functions {
            let fu = func(b, f);
            let p = fu.as_ref().and_then(|fu| {
                let Ok(Type::FuncProto(proto)) = b.resolve_chained_type(fu) else {
                    return None;
                };
                let mut v = Vec::new();
                for prm in &proto.parameters {
                    let t = b.resolve_chained_type(prm).ok()?;
                    v.push(format!("{:?}/{}", arg_type(b, t.clone()), c_name(b, t)));
                }
                let ret = b.resolve_type_by_id(proto.return_type_id()).ok()?;
                v.push(format!(
                    "-> {:?}/{}",
                    arg_type(b, ret.clone()),
                    c_name(b, ret)
                ));
                Some(v)
            });
            out.push(format!("func {f} {} {}", fu.is_some(), show(p)));
        }
        out
    }
}

mod with_aya_obj {
    use aya_obj::btf::BtfKind;

    use super::*;

    pub struct Aya(aya::Btf);

    impl Reader for Aya {
        fn parse(path: &std::path::Path) -> Result<Self, String> {
            aya::Btf::parse_file(path, aya::Endianness::default())
                .map(Aya)
                .map_err(|e| e.to_string())
        }
        /// Only `has_func`: aya-obj 0.3.0 exposes no members, prototypes or enums.
        fn answer(&self, functions: &[&str]) -> Answers {
            functions
                .iter()
                .map(|f| {
                    let has = self.0.id_by_type_name_kind(f, BtfKind::Func).is_ok();
                    format!("func {f} {has}")
                })
                .collect()
        }
    }
}

fn run<R: Reader>(path: &std::path::Path, repeat: u32, print: bool) -> Result<Answers, String> {
    let functions = functions();
    let (mut parse, mut lookups) = (0.0, 0.0);
    let mut answers = Vec::new();
    for _ in 0..repeat {
        let t0 = Instant::now();
        let r = R::parse(path)?;
        let t1 = Instant::now();
        answers = std::hint::black_box(r.answer(&functions));
        lookups += t1.elapsed().as_secs_f64();
        parse += (t1 - t0).as_secs_f64();
    }
    let n = f64::from(repeat.max(1));
    eprintln!(
        "parse {:.1} ms, lookups {:.1} ms ({} answers; mean of {repeat})",
        parse / n * 1e3,
        lookups / n * 1e3,
        answers.len()
    );
    if print {
        for a in &answers {
            println!("{a}");
        }
    }
    Ok(answers)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let (mut repeat, mut file, mut print) = (1u32, PathBuf::from(VMLINUX), false);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--repeat" => repeat = args.next().and_then(|n| n.parse().ok()).unwrap_or(1),
            "--file" => file = args.next().map(PathBuf::from).unwrap_or(file),
            "--print" => print = true,
            _ => {
                eprintln!("unknown argument {a}");
                std::process::exit(2);
            }
        }
    }
    let res: Result<Answers, String> = match mode.as_str() {
        #[cfg(any(not(bench_btf_one), bench_btf_xtlock))]
        "xtlock" => run::<xtlock::probes::btf::Btf>(&file, repeat, print),
        #[cfg(any(not(bench_btf_one), bench_btf_btf_rs))]
        "btf-rs" => run::<with_btf_rs::Cached>(&file, repeat, print),
        #[cfg(any(not(bench_btf_one), bench_btf_btf_rs))]
        "btf-rs-mmap" => run::<with_btf_rs::Mapped>(&file, repeat, print),
        #[cfg(any(not(bench_btf_one), bench_btf_aya_obj))]
        "aya-obj" => run::<with_aya_obj::Aya>(&file, repeat, print),
        #[cfg(not(bench_btf_one))]
        "check" => (|| {
            let a = run::<xtlock::probes::btf::Btf>(&file, 1, false)?;
            let b = run::<with_btf_rs::Cached>(&file, 1, false)?;
            let differ: Vec<_> = a.iter().zip(&b).filter(|(x, y)| x != y).collect();
            for (x, y) in &differ {
                println!("xtlock: {x}\nbtf-rs: {y}");
            }
            let found = a
                .iter()
                .filter(|l| !l.ends_with(" -") && !l.contains(" false"))
                .count();
            println!(
                "{} answers, {found} found, {} differ",
                a.len(),
                differ.len()
            );
            if differ.is_empty() {
                Ok(a)
            } else {
                Err("the readers disagree".into())
            }
        })(),
        _ => {
            eprintln!(
                "usage: bench_btf xtlock|btf-rs|btf-rs-mmap|aya-obj|check [--repeat N] \
                 [--file PATH] [--print] ({} kernel functions asked about)",
                functions().len()
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = res {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
