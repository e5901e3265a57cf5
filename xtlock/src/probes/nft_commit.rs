//! The nf_tables commit hook: the second lock. nft, iptables-nft, kube-proxy's nftables mode
//! and firewalld take no file lock; the kernel serialises their netlink batches. The hook
//! times `nfnetlink_rcv_batch` (else `nf_tables_commit`) per thread.
//!
//! No tracepoint exists for it, so the candidates are, in order: fentry/fexit, then
//! kprobe/kretprobe. What this kernel offers is discovered at start (kallsyms for the
//! function and its module, BTF for fentry, the kprobe PMU or `kprobe_events` for kprobes);
//! the first candidate that loads and attaches wins, and every failure is kept so
//! `xtlock probes` can say why each one did not.

use std::{fmt, path::Path};

use aya::{
    programs::{FEntry, FExit, KProbe},
    Ebpf,
};

use super::preflight::error_chain;

/// The hook's name in `xtlock probes`.
pub const HOOK: &str = "nft_commit";
/// Functions to time, best first: the whole batch (it holds the commit mutex from its
/// generation check to the commit or abort), else the commit alone.
pub const FUNCTIONS: &[&str] = &["nfnetlink_rcv_batch", "nf_tables_commit"];
/// What the user gets from it.
pub const PURPOSE: &str = "nf_tables commits (nft, iptables-nft, kube-proxy nftables mode, \
                           firewalld): holds of the second lock, \"nf_tables commit (netns N)\"";
/// Set to 1 to skip fentry/fexit and use the kprobe fallback.
pub const DISABLE_FENTRY_ENV: &str = "XTLOCK_DISABLE_FENTRY";

const FENTRY_PROG: &str = "nft_commit_fentry";
const FEXIT_PROG: &str = "nft_commit_fexit";
const KPROBE_PROG: &str = "nft_commit_kprobe";
const KRETPROBE_PROG: &str = "nft_commit_kretprobe";

/// An attach type, in the order they are tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachKind {
    FEntry,
    KProbe,
}

impl fmt::Display for AttachKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachKind::FEntry => "fentry",
            AttachKind::KProbe => "kprobe",
        })
    }
}

/// What the running kernel offers, discovered at start.
#[derive(Clone, Debug, Default)]
pub struct KernelFacts {
    /// `(function, module)` of each of [`FUNCTIONS`] found in /proc/kallsyms (`None`:
    /// built into vmlinux). A function absent there is inlined, or its module not loaded.
    pub symbols: Vec<(String, Option<String>)>,
    /// The function is in vmlinux BTF (what aya's fentry can attach to).
    pub in_vmlinux_btf: bool,
    /// Why BTF could not be read, if so.
    pub btf_error: Option<String>,
    /// The kernel has kprobes (a kprobe PMU or tracefs `kprobe_events`).
    pub kprobes: bool,
    /// `XTLOCK_DISABLE_FENTRY=1`.
    pub fentry_disabled: bool,
}

/// The function to hook and, per candidate, either `None` (try it) or why it is skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub function: String,
    pub candidates: Vec<(AttachKind, Option<String>)>,
}

/// Errors that stop the hook before any candidate is tried.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("none of {0} is in /proc/kallsyms (nf_tables not loaded, or the functions inlined)")]
    NoFunction(String),
}

/// Picks the function and what to try, from the kernel's facts alone.
pub fn plan(facts: &KernelFacts) -> Result<Plan, PlanError> {
    let (function, module) = FUNCTIONS
        .iter()
        .find_map(|f| facts.symbols.iter().find(|(n, _)| n == f))
        .cloned()
        .ok_or_else(|| PlanError::NoFunction(FUNCTIONS.join(", ")))?;
    let fentry = if facts.fentry_disabled {
        Some(format!("disabled by {DISABLE_FENTRY_ENV}=1"))
    } else if let Some(e) = &facts.btf_error {
        Some(format!("no kernel BTF ({e})"))
    } else if !facts.in_vmlinux_btf {
        Some(match &module {
            Some(m) => format!(
                "{function} is in module {m}, and aya 0.14 attaches fentry only to vmlinux \
                 functions (no module BTF)"
            ),
            None => format!("{function} is not in the kernel's BTF"),
        })
    } else {
        None
    };
    let kprobe = (!facts.kprobes).then(|| "kernel built without kprobes".to_string());
    Ok(Plan {
        function,
        candidates: vec![(AttachKind::FEntry, fentry), (AttachKind::KProbe, kprobe)],
    })
}

/// Reads the facts of the running kernel (`btf`: its parsed vmlinux BTF, or why not).
pub fn discover(tracefs: &Path, btf: Result<&super::btf::Btf, String>) -> KernelFacts {
    let mut symbols = Vec::new();
    if let Ok(text) = std::fs::read_to_string("/proc/kallsyms") {
        symbols = kallsyms_functions(&text, FUNCTIONS);
    }
    let mut facts = KernelFacts {
        symbols,
        kprobes: Path::new("/sys/bus/event_source/devices/kprobe").exists()
            || tracefs.join("kprobe_events").exists(),
        fentry_disabled: std::env::var(DISABLE_FENTRY_ENV).is_ok_and(|v| v == "1"),
        ..Default::default()
    };
    if let Ok(p) = plan(&facts) {
        match btf {
            Ok(b) => facts.in_vmlinux_btf = b.has_func(&p.function),
            Err(e) => facts.btf_error = Some(e),
        }
    }
    facts
}

/// `(name, module)` of the text symbols of `wanted` in a /proc/kallsyms listing.
pub fn kallsyms_functions(text: &str, wanted: &[&str]) -> Vec<(String, Option<String>)> {
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(_addr), Some(ty), Some(name)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if !matches!(ty, "t" | "T") || !wanted.contains(&name) {
            continue;
        }
        if out.iter().any(|(n, _)| n == name) {
            continue;
        }
        let module = it
            .next()
            .map(|m| m.trim_start_matches('[').trim_end_matches(']').to_string());
        out.push((name.to_string(), module));
    }
    out
}

/// The attached hook: `"fentry/fexit FUNCTION"` or `"kprobe/kretprobe FUNCTION"`.
pub struct Attached {
    pub kind: AttachKind,
    pub describe: String,
}

/// Tries the candidates in order. `Err` lists why each one failed, in plain words.
pub fn attach(ebpf: &mut Ebpf, facts: &KernelFacts) -> Result<Attached, String> {
    let plan = plan(facts).map_err(|e| e.to_string())?;
    let mut why = Vec::new();
    for (kind, skip) in &plan.candidates {
        let res = match skip {
            Some(s) => Err(s.clone()),
            None => match kind {
                AttachKind::FEntry => attach_fentry(ebpf, &plan.function),
                AttachKind::KProbe => attach_kprobe(ebpf, &plan.function),
            },
        };
        match res {
            Ok(()) => {
                let pair = match kind {
                    AttachKind::FEntry => "fentry/fexit",
                    AttachKind::KProbe => "kprobe/kretprobe",
                };
                let mut describe = format!("{pair} {}", plan.function);
                if !why.is_empty() {
                    describe.push_str(&format!(" (fallback; {})", why.join("; ")));
                }
                return Ok(Attached {
                    kind: *kind,
                    describe,
                });
            }
            Err(e) => why.push(format!("{kind}: {e}")),
        }
    }
    Err(why.join("; "))
}

/// Plain words for a load/attach error: EPERM named as such.
fn explain(e: &dyn std::error::Error) -> String {
    let s = error_chain(e);
    // aya appends the verifier log, empty for a refused load.
    let s = match s.find("Verifier output:") {
        Some(i)
            if s[i + 16..]
                .trim_matches(|c: char| c.is_whitespace() || c == '\0')
                .is_empty() =>
        {
            s[..i].trim_end().trim_end_matches('.').to_string()
        }
        _ => s,
    };
    if s.contains("Operation not permitted") || s.contains("os error 1)") {
        format!("EPERM ({s})")
    } else {
        s
    }
}

fn attach_fentry(ebpf: &mut Ebpf, function: &str) -> Result<(), String> {
    let btf = aya::Btf::from_sys_fs().map_err(|e| format!("kernel BTF: {e}"))?;
    let res = (|| {
        let p: &mut FEntry = program(ebpf, FENTRY_PROG)?;
        p.load(function, &btf).map_err(|e| explain(&e))?;
        p.attach().map_err(|e| explain(&e))?;
        let p: &mut FExit = program(ebpf, FEXIT_PROG)?;
        p.load(function, &btf).map_err(|e| explain(&e))?;
        p.attach().map_err(|e| explain(&e))?;
        Ok(())
    })();
    if res.is_err() {
        // Half attached is worse than not: an entry without its exit fills the map.
        if let Ok(p) = program::<FEntry>(ebpf, FENTRY_PROG) {
            let _ = p.unload();
        }
    }
    res
}

fn attach_kprobe(ebpf: &mut Ebpf, function: &str) -> Result<(), String> {
    let res = (|| {
        for name in [KPROBE_PROG, KRETPROBE_PROG] {
            let p: &mut KProbe = program(ebpf, name)?;
            p.load().map_err(|e| explain(&e))?;
            p.attach(function, 0).map_err(|e| explain(&e))?;
        }
        Ok(())
    })();
    if res.is_err() {
        if let Ok(p) = program::<KProbe>(ebpf, KPROBE_PROG) {
            let _ = p.unload();
        }
    }
    res
}

fn program<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, String>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| format!("program {name} missing from the BPF object"))?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(symbols: &[(&str, Option<&str>)]) -> KernelFacts {
        KernelFacts {
            symbols: symbols
                .iter()
                .map(|(n, m)| (n.to_string(), m.map(str::to_string)))
                .collect(),
            in_vmlinux_btf: true,
            kprobes: true,
            ..Default::default()
        }
    }

    #[test]
    fn prefers_the_batch_and_fentry() {
        let f = facts(&[("nf_tables_commit", None), ("nfnetlink_rcv_batch", None)]);
        let p = plan(&f).unwrap();
        assert_eq!(p.function, "nfnetlink_rcv_batch");
        assert_eq!(
            p.candidates,
            vec![(AttachKind::FEntry, None), (AttachKind::KProbe, None)]
        );
    }

    #[test]
    fn falls_back_to_the_commit_when_the_batch_is_inlined() {
        let p = plan(&facts(&[("nf_tables_commit", Some("nf_tables"))])).unwrap();
        assert_eq!(p.function, "nf_tables_commit");
    }

    #[test]
    fn no_function_is_a_plain_error() {
        let e = plan(&facts(&[])).unwrap_err();
        assert!(e.to_string().contains("nf_tables not loaded"), "{e}");
    }

    #[test]
    fn skips_say_why() {
        let mut f = facts(&[("nfnetlink_rcv_batch", Some("nfnetlink"))]);
        f.in_vmlinux_btf = false;
        f.kprobes = false;
        let p = plan(&f).unwrap();
        let fe = p.candidates[0].1.as_deref().unwrap();
        assert!(fe.contains("in module nfnetlink"), "{fe}");
        assert_eq!(
            p.candidates[1].1.as_deref(),
            Some("kernel built without kprobes")
        );
        f.fentry_disabled = true;
        let p = plan(&f).unwrap();
        assert_eq!(
            p.candidates[0].1.as_deref(),
            Some("disabled by XTLOCK_DISABLE_FENTRY=1")
        );
        f.fentry_disabled = false;
        f.btf_error = Some("gone".into());
        let p = plan(&f).unwrap();
        assert!(p.candidates[0]
            .1
            .as_deref()
            .unwrap()
            .contains("no kernel BTF"));
    }

    #[test]
    fn kallsyms_text_symbols_with_modules() {
        let text = "ffffffff81f2ce40 t nfnetlink_rcv_batch\n\
                    ffffffff81241e0d t nf_tables_commit.cold\n\
                    ffffffffc0a01000 t nf_tables_commit\t[nf_tables]\n\
                    ffffffffc0a01000 d nfnetlink_rcv_batch\n";
        assert_eq!(
            kallsyms_functions(text, FUNCTIONS),
            vec![
                ("nfnetlink_rcv_batch".to_string(), None),
                (
                    "nf_tables_commit".to_string(),
                    Some("nf_tables".to_string())
                ),
            ]
        );
    }
}
