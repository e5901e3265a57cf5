//! Hooks on kernel functions, for what no tracepoint shows (nf_tables commits, conntrack
//! insert failures, legacy table replaces, IPVS), and as the fallback of tracepoint hooks.
//!
//! Each hook lists its kernel functions (best first) and its BPF programs per attach type.
//! The candidates are tried in order: fentry/fexit, then kprobe/kretprobe. What this kernel
//! offers is discovered once at start (kallsyms for each function and its module, BTF for
//! fentry, the kprobe PMU or `kprobe_events` for kprobes); the first candidate that loads and
//! attaches wins, and every failure is kept so `xtlock probes` can say why each one did not.
//! `--no-attach` (or `XTLOCK_NO_ATTACH`) rules out attach types, per hook or everywhere:
//! how the fallbacks are exercised on a kernel where the first choice works.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::Path,
};

use aya::{
    programs::{FEntry, FExit, KProbe},
    Ebpf,
};

use super::{
    btf::{ArgType, Btf, FuncProto},
    preflight::error_chain,
};

/// Environment variable with `--no-attach` rules, added to the flag's (for DaemonSets).
pub const NO_ATTACH_ENV: &str = "XTLOCK_NO_ATTACH";
/// Older spelling of `--no-attach fentry`.
pub const DISABLE_FENTRY_ENV: &str = "XTLOCK_DISABLE_FENTRY";

/// An attach type, in the order they are tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AttachKind {
    Tracepoint,
    /// The same tracepoint as a BTF raw tracepoint: its arguments, no record built. The lock
    /// hook prefers it where the kernel's BTF gives the struct offsets.
    BtfTracepoint,
    FEntry,
    KProbe,
}

impl fmt::Display for AttachKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachKind::Tracepoint => "tracepoint",
            AttachKind::BtfTracepoint => "tp_btf",
            AttachKind::FEntry => "fentry",
            AttachKind::KProbe => "kprobe",
        })
    }
}

impl AttachKind {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "tracepoint" | "tp" => Some(AttachKind::Tracepoint),
            "tp_btf" | "raw_tracepoint" => Some(AttachKind::BtfTracepoint),
            "fentry" | "fexit" => Some(AttachKind::FEntry),
            "kprobe" | "kretprobe" => Some(AttachKind::KProbe),
            _ => None,
        }
    }
}

/// Attach types ruled out: everywhere (`fentry`) or for one hook (`sys_enter_execve:tracepoint`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttachFilter {
    rules: BTreeSet<(Option<String>, AttachKind)>,
}

impl AttachFilter {
    /// Parses a comma-separated list of `KIND` or `HOOK:KIND`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut f = AttachFilter::default();
        f.add(spec)?;
        Ok(f)
    }

    fn add(&mut self, spec: &str) -> Result<(), String> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (hook, kind) = match item.rsplit_once(':') {
                Some((h, k)) => (Some(h.to_string()), k),
                None => (None, item),
            };
            let kind = AttachKind::parse(kind).ok_or_else(|| {
                format!(
                    "`{item}`: the attach type must be tracepoint, tp_btf, fentry or kprobe, \
                     optionally after a hook name from `xtlock probes` (e.g. \
                     sys_enter_execve:tracepoint)"
                )
            })?;
            self.rules.insert((hook, kind));
        }
        Ok(())
    }

    /// Merges several filters (the flag's values).
    pub fn merge(filters: &[AttachFilter]) -> Self {
        let mut out = AttachFilter::default();
        for f in filters {
            out.rules.extend(f.rules.iter().cloned());
        }
        out
    }

    /// Adds the rules of `XTLOCK_NO_ATTACH` and `XTLOCK_DISABLE_FENTRY=1`; a bad variable is
    /// the user's to fix.
    pub fn with_env(mut self) -> Result<Self, String> {
        if let Ok(v) = std::env::var(NO_ATTACH_ENV) {
            self.add(&v).map_err(|e| format!("{NO_ATTACH_ENV}: {e}"))?;
        }
        if std::env::var(DISABLE_FENTRY_ENV).is_ok_and(|v| v == "1") {
            self.rules.insert((None, AttachKind::FEntry));
        }
        Ok(self)
    }

    /// Why `kind` may not be used for `hook`, if it may not.
    pub fn blocks(&self, hook: &str, kind: AttachKind) -> Option<String> {
        self.rules
            .iter()
            .find(|(h, k)| *k == kind && h.as_deref().is_none_or(|h| h == hook))
            .map(|(h, k)| match h {
                Some(h) => format!("ruled out by --no-attach {h}:{k}"),
                None => format!("ruled out by --no-attach {k}"),
            })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The hook names the rules give that are not in `known` (a typo would otherwise rule
    /// out nothing, silently).
    pub fn unknown_hooks(&self, known: &[&str]) -> Vec<&str> {
        let mut out: Vec<&str> = self
            .rules
            .iter()
            .filter_map(|(h, _)| h.as_deref())
            .filter(|h| !known.contains(h))
            .collect();
        out.dedup();
        out
    }
}

impl std::str::FromStr for AttachFilter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s)
    }
}

/// One hook on kernel functions and its BPF programs per attach type.
#[derive(Clone, Copy, Debug)]
pub struct KfuncHook {
    /// Its name in `xtlock probes` and in `--no-attach` rules.
    pub name: &'static str,
    pub purpose: &'static str,
    /// Kernel functions to hook, best first: the first found in kallsyms is used.
    pub functions: &'static [&'static str],
    /// The module that has the functions on distribution kernels, for "not loaded".
    pub module: Option<&'static str>,
    pub fentry: Option<&'static str>,
    pub fexit: Option<&'static str>,
    pub kprobe: Option<&'static str>,
    pub kretprobe: Option<&'static str>,
    /// An entry program preferred to `kprobe` where the kernel loads it, and what it needs
    /// that older kernels lack (a newer helper); `kprobe` where it does not load, said in the
    /// attach's description.
    pub kprobe_first: Option<(&'static str, &'static str)>,
    /// Writes what the programs need (struct offsets from the module's BTF, into a map)
    /// before they attach; given vmlinux BTF when it could be read, and the function chosen.
    /// Runs again when the module loads after start.
    pub setup: Option<SetupFn>,
    /// What the programs read of the function's arguments and return value, checked
    /// against its prototype in the running kernel's BTF before anything attaches (`None`:
    /// they read nothing).
    pub reads: Option<Reads>,
}

/// What a hook's programs read of its function's arguments, and how they find its return.
#[derive(Clone, Copy, Debug)]
pub struct Reads {
    /// The parameters up to the last one read, each as the programs read it.
    pub args: &'static [Want],
    /// The exact parameter count the fexit program assumes: it finds the return value
    /// after the arguments (`ctx.arg(N)`), so one parameter more or less reads garbage.
    pub fexit_params: Option<usize>,
    pub ret: Want,
}

/// One argument or return value as the programs read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Not read.
    Any,
    /// A pointer to `struct NAME`, read through at offsets from BTF.
    Ptr(&'static str),
    /// An integer (any size: read as a register).
    Int,
    /// A value of this type name (a typedef'd struct passed by value, e.g. `sockptr_t`).
    Other(&'static str),
}

impl Want {
    fn matches(self, t: &ArgType) -> bool {
        match (self, t) {
            (Want::Any, _) => true,
            (Want::Ptr(n), ArgType::Ptr(m) | ArgType::FwdPtr(m)) => n == m,
            (Want::Int, ArgType::Int(_)) => true,
            (Want::Other(n), ArgType::Other(m)) => n == m,
            _ => false,
        }
    }

    fn text(self) -> String {
        match self {
            Want::Any => "_".into(),
            Want::Ptr(n) => format!("struct {n} *"),
            Want::Int => "an integer".into(),
            Want::Other(n) => format!("`{n}`"),
        }
    }
}

/// Why `function`'s prototype in BTF does not fit what the hook reads: `Err((all, fentry))`
/// with the reason every attach type is ruled out for (a wrong read either way), or the
/// reason only fentry/fexit is (kprobes read registers, unaffected).
pub fn check_proto(
    function: &str,
    reads: &Reads,
    proto: &FuncProto,
) -> Result<(), (Option<String>, Option<String>)> {
    let shown = || {
        let p: Vec<&str> = proto.params.iter().map(|(_, c)| c.as_str()).collect();
        format!("{} {function}({})", proto.ret.1, p.join(", "))
    };
    if proto.params.len() < reads.args.len() {
        return Err((
            Some(format!(
                "this kernel's {} has {} parameters, the hook reads {}",
                shown(),
                proto.params.len(),
                reads.args.len()
            )),
            None,
        ));
    }
    for (i, (want, (got, _))) in reads.args.iter().zip(&proto.params).enumerate() {
        if !want.matches(got) {
            return Err((
                Some(format!(
                    "this kernel's {}: parameter {} is not the {} the hook reads",
                    shown(),
                    i + 1,
                    want.text()
                )),
                None,
            ));
        }
    }
    if !reads.ret.matches(&proto.ret.0) {
        return Err((
            Some(format!(
                "this kernel's {} does not return the {} the hook reads",
                shown(),
                reads.ret.text()
            )),
            None,
        ));
    }
    if let Some(n) = reads.fexit_params {
        if proto.params.len() != n {
            return Err((
                None,
                Some(format!(
                    "this kernel's {} has {} parameters, the fexit program expects {n}",
                    shown(),
                    proto.params.len()
                )),
            ));
        }
    }
    // The 5.10 verifier refuses fentry reads of a pointer to a declared-only struct.
    for (i, (want, (got, c))) in reads.args.iter().zip(&proto.params).enumerate() {
        if *want != Want::Any {
            if let ArgType::FwdPtr(n) = got {
                return Err((
                    None,
                    Some(format!(
                        "parameter {} of {function} is a `{c}` whose struct {n} this kernel's \
                         BTF only declares: fentry cannot read it",
                        i + 1
                    )),
                ));
            }
        }
    }
    Ok(())
}

/// See [`KfuncHook::setup`].
pub type SetupFn = fn(&mut Ebpf, Option<&super::btf::Btf>, &Chosen<'_>) -> Result<(), String>;

/// The function a hook attaches to, for its setup (what it reads may depend on it).
#[derive(Clone, Copy, Debug)]
pub struct Chosen<'a> {
    pub function: &'a str,
    /// Its module, `None` when built into vmlinux.
    pub module: Option<&'a str>,
}

/// For setups: fills entry 0 of the one-entry config map `name` unless `filled` says it
/// already is (several hooks share one config); `make` runs only then.
pub fn fill_config_once<T: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &str,
    filled: fn(&T) -> bool,
    make: impl FnOnce() -> Result<T, String>,
) -> Result<(), String> {
    let mut arr = config_map::<T>(ebpf, name)?;
    if arr.get(&0, 0).is_ok_and(|c| filled(&c)) {
        return Ok(());
    }
    arr.set(0, make()?, 0)
        .map_err(|e| format!("writing {name}: {e}"))
}

/// Writes entry 0 of the one-entry config map `name`, whatever it held.
pub fn set_config<T: aya::Pod>(ebpf: &mut Ebpf, name: &str, value: T) -> Result<(), String> {
    config_map::<T>(ebpf, name)?
        .set(0, value, 0)
        .map_err(|e| format!("writing {name}: {e}"))
}

fn config_map<'a, T: aya::Pod>(
    ebpf: &'a mut Ebpf,
    name: &str,
) -> Result<aya::maps::Array<&'a mut aya::maps::MapData, T>, String> {
    let map = ebpf
        .map_mut(name)
        .ok_or_else(|| format!("map {name} missing from the BPF object"))?;
    aya::maps::Array::try_from(map).map_err(|e| e.to_string())
}

impl KfuncHook {
    fn has(&self, kind: AttachKind) -> bool {
        match kind {
            AttachKind::Tracepoint | AttachKind::BtfTracepoint => false,
            AttachKind::FEntry => self.fentry.is_some() || self.fexit.is_some(),
            AttachKind::KProbe => self.kprobe.is_some() || self.kretprobe.is_some(),
        }
    }

    /// `"fentry/fexit"`, `"kretprobe"`, ...: the programs this hook has of `kind`.
    fn describe(&self, kind: AttachKind) -> String {
        let (a, b) = match kind {
            AttachKind::Tracepoint | AttachKind::BtfTracepoint => (None, None),
            AttachKind::FEntry => (self.fentry.map(|_| "fentry"), self.fexit.map(|_| "fexit")),
            AttachKind::KProbe => (
                self.kprobe.map(|_| "kprobe"),
                self.kretprobe.map(|_| "kretprobe"),
            ),
        };
        [a, b].into_iter().flatten().collect::<Vec<_>>().join("/")
    }
}

/// What the running kernel offers, discovered once at start.
#[derive(Clone, Debug, Default)]
pub struct KernelFacts {
    /// `(function, module)` of the wanted functions found in /proc/kallsyms (`None`: built
    /// into vmlinux). A function absent there is inlined, or its module not loaded.
    pub symbols: Vec<(String, Option<String>)>,
    /// Wanted functions that are in vmlinux BTF (what aya's fentry can attach to).
    pub btf_funcs: BTreeSet<String>,
    /// Why BTF could not be read, if so.
    pub btf_error: Option<String>,
    /// The kernel has kprobes (a kprobe PMU or tracefs `kprobe_events`).
    pub kprobes: bool,
    pub filter: AttachFilter,
    /// Prototypes of the wanted functions whose hooks read arguments, from vmlinux BTF or
    /// their module's; `Err`: why there is none to check against.
    pub protos: BTreeMap<String, Result<FuncProto, String>>,
}

/// The function to hook and, per candidate, either `None` (try it) or why it is skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub function: String,
    pub candidates: Vec<(AttachKind, Option<String>)>,
    /// Why the function's prototype could not be checked, when it could not (kprobes then
    /// read as built; fentry needs the BTF anyway).
    pub unchecked: Option<String>,
}

/// Errors that stop the hook before any candidate is tried.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("module {module} not loaded (none of {functions} is in /proc/kallsyms)")]
    ModuleNotLoaded { module: String, functions: String },
    #[error("none of {0} is in /proc/kallsyms (inlined or renamed on this kernel)")]
    NoFunction(String),
}

/// Picks the function and what to try, from the kernel's facts alone.
pub fn plan(hook: &KfuncHook, facts: &KernelFacts) -> Result<Plan, PlanError> {
    let Some((function, module)) = hook
        .functions
        .iter()
        .find_map(|f| facts.symbols.iter().find(|(n, _)| n == f))
        .cloned()
    else {
        let functions = hook.functions.join(", ");
        return Err(match hook.module {
            Some(m) if !module_present(m) => PlanError::ModuleNotLoaded {
                module: m.to_string(),
                functions,
            },
            _ => PlanError::NoFunction(functions),
        });
    };
    let (proto_all, proto_fentry) = match (&hook.reads, facts.protos.get(&function)) {
        (Some(r), Some(Ok(p))) => check_proto(&function, r, p).err().unwrap_or_default(),
        _ => (None, None),
    };
    let mut candidates = Vec::new();
    for kind in [AttachKind::FEntry, AttachKind::KProbe] {
        if !hook.has(kind) {
            continue;
        }
        let skip = if let Some(why) = facts.filter.blocks(hook.name, kind) {
            Some(why)
        } else if let Some(why) = &proto_all {
            Some(why.clone())
        } else if kind == AttachKind::FEntry && proto_fentry.is_some() {
            proto_fentry.clone()
        } else if kind == AttachKind::FEntry {
            if let Some(e) = &facts.btf_error {
                Some(format!("no kernel BTF ({e})"))
            } else if !facts.btf_funcs.contains(&function) {
                Some(match &module {
                    Some(m) => format!(
                        "{function} is in module {m}, and aya 0.14 attaches fentry only to \
                         vmlinux functions (no module BTF)"
                    ),
                    None => format!("{function} is not in the kernel's BTF"),
                })
            } else {
                None
            }
        } else {
            (!facts.kprobes).then(|| "kernel built without kprobes".to_string())
        };
        candidates.push((kind, skip));
    }
    let unchecked = match (&hook.reads, facts.protos.get(&function)) {
        (Some(_), Some(Err(why))) => Some(why.clone()),
        (Some(_), None) => Some("no prototype read".to_string()),
        _ => None,
    };
    Ok(Plan {
        function,
        candidates,
        unchecked,
    })
}

/// Whether a module is loaded (or built in with parameters): `/sys/module/NAME`.
fn module_present(name: &str) -> bool {
    Path::new("/sys/module").join(name).exists()
}

/// Reads the facts of the running kernel for `hooks` (`btf`: its parsed vmlinux BTF, or why
/// not; `kallsyms`: /proc/kallsyms, read by the caller, empty if it could not be).
pub fn discover(
    tracefs: &Path,
    btf: Result<&super::btf::Btf, String>,
    kallsyms: &str,
    hooks: &[&KfuncHook],
    filter: AttachFilter,
) -> KernelFacts {
    let wanted: Vec<&str> = hooks
        .iter()
        .flat_map(|h| h.functions.iter().copied())
        .collect();
    let symbols = kallsyms_functions(kallsyms, &wanted);
    let mut facts = KernelFacts {
        symbols,
        kprobes: Path::new("/sys/bus/event_source/devices/kprobe").exists()
            || tracefs.join("kprobe_events").exists(),
        filter,
        ..Default::default()
    };
    // Only hooks that read arguments need a prototype (and only theirs a module's BTF).
    let checked: Vec<&str> = hooks
        .iter()
        .filter(|h| h.reads.is_some())
        .flat_map(|h| h.functions.iter().copied())
        .collect();
    match btf {
        Ok(b) => {
            facts.btf_funcs = wanted
                .iter()
                .filter(|f| b.has_func(f))
                .map(|f| f.to_string())
                .collect();
            facts.protos = prototypes(b, &facts.symbols, &checked);
        }
        Err(e) => {
            for f in checked {
                facts
                    .protos
                    .insert(f.to_string(), Err(format!("no kernel BTF ({e})")));
            }
            facts.btf_error = Some(e)
        }
    }
    facts
}

/// The prototypes of `functions` found in kallsyms: from vmlinux BTF, or from their
/// module's split BTF (`/sys/kernel/btf/<module>`, Linux >= 5.11 with
/// CONFIG_DEBUG_INFO_BTF_MODULES), each module read once.
fn prototypes(
    vmlinux: &Btf,
    symbols: &[(String, Option<String>)],
    functions: &[&str],
) -> BTreeMap<String, Result<FuncProto, String>> {
    let mut modules: BTreeMap<&str, Result<Btf, String>> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (name, module) in symbols
        .iter()
        .filter(|(n, _)| functions.contains(&n.as_str()))
    {
        let proto = match module.as_deref() {
            None => vmlinux
                .func_proto(name)
                .ok_or_else(|| format!("{name} is not in the kernel's BTF")),
            Some(m) => match modules
                .entry(m)
                .or_insert_with(|| Btf::module(vmlinux, m).map_err(|e| e.to_string()))
            {
                Ok(b) => b
                    .func_proto(name)
                    .ok_or_else(|| format!("{name} is not in module {m}'s BTF")),
                Err(e) => Err(format!(
                    "no BTF for module {m} (Linux >= 5.11 with CONFIG_DEBUG_INFO_BTF_MODULES \
                     has it): {e}"
                )),
            },
        };
        out.insert(name.clone(), proto);
    }
    out
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

/// The attached hook, e.g. `"kprobe/kretprobe nf_tables_commit (fallback; fentry: ...)"`.
#[derive(Clone, Debug)]
pub struct Attached {
    pub kind: AttachKind,
    pub function: String,
    pub describe: String,
}

/// Tries the candidates in order. `Err` lists why each one failed, in plain words.
pub fn attach(ebpf: &mut Ebpf, hook: &KfuncHook, facts: &KernelFacts) -> Result<Attached, String> {
    attach_after(ebpf, hook, facts, Vec::new())
}

/// [`attach`], running the hook's setup first (once the function is known to be there).
pub fn setup_and_attach(
    ebpf: &mut Ebpf,
    hook: &KfuncHook,
    facts: &KernelFacts,
    btf: Option<&super::btf::Btf>,
) -> Result<Attached, String> {
    let plan = plan(hook, facts).map_err(|e| e.to_string())?;
    if let Some(setup) = hook.setup {
        let module = facts
            .symbols
            .iter()
            .find(|(n, _)| *n == plan.function)
            .and_then(|(_, m)| m.as_deref());
        let chosen = Chosen {
            function: &plan.function,
            module,
        };
        setup(ebpf, btf, &chosen).map_err(|e| format!("setup: {e}"))?;
    }
    attach(ebpf, hook, facts)
}

/// [`attach`], for the fallback of a hook whose first choice failed for the reasons in
/// `earlier` (e.g. `"tracepoint: ..."`): they head the fallback note and the error.
pub fn attach_after(
    ebpf: &mut Ebpf,
    hook: &KfuncHook,
    facts: &KernelFacts,
    mut why: Vec<String>,
) -> Result<Attached, String> {
    let plan = match plan(hook, facts) {
        Ok(p) => p,
        Err(e) => {
            why.push(e.to_string());
            return Err(why.join("; "));
        }
    };
    for (kind, skip) in &plan.candidates {
        let res = match skip {
            Some(s) => Err(s.clone()),
            None => match kind {
                AttachKind::FEntry => attach_fentry(ebpf, hook, &plan.function).map(|()| None),
                _ => attach_kprobe(ebpf, hook, &plan.function),
            },
        };
        match res {
            Ok(note) => {
                let mut describe = format!("{} {}", hook.describe(*kind), plan.function);
                if let Some(n) = note {
                    describe.push_str(&format!(" ({n})"));
                }
                if !why.is_empty() {
                    describe.push_str(&format!(" (fallback; {})", why.join("; ")));
                }
                if let Some(u) = &plan.unchecked {
                    describe.push_str(&format!(" (prototype not checked: {u})"));
                }
                return Ok(Attached {
                    kind: *kind,
                    function: plan.function,
                    describe,
                });
            }
            Err(e) => why.push(format!("{kind}: {e}")),
        }
    }
    Err(why.join("; "))
}

/// What the hook would use, for the status line when nothing attached.
pub fn candidates_text(hook: &KfuncHook) -> String {
    [AttachKind::FEntry, AttachKind::KProbe]
        .into_iter()
        .filter(|k| hook.has(*k))
        .map(|k| hook.describe(k))
        .collect::<Vec<_>>()
        .join(", else ")
}

/// Plain words for a load/attach error: EPERM named as such.
pub(super) fn explain(e: &dyn std::error::Error) -> String {
    let s = error_chain(e);
    // aya appends the verifier log (empty for a refused load): its last line before the
    // statistics says why, on one line (`xtlock probes` and docs/kernels.md are tables).
    let s = match s.find("Verifier output:") {
        Some(i) => {
            let head = s[..i].trim_end().trim_end_matches('.');
            let why = s[i + 16..]
                .lines()
                .map(|l| l.trim_matches(|c: char| c.is_whitespace() || c == '\0'))
                .rfind(|l| {
                    !l.is_empty()
                        && !l.starts_with("verification time")
                        && !l.starts_with("stack depth")
                        && !l.starts_with("processed ")
                });
            match why {
                Some(w) => format!("{head}: verifier: {w}"),
                None => head.to_string(),
            }
        }
        None => s,
    };
    if s.contains("Operation not permitted") || s.contains("os error 1)") {
        format!("EPERM ({s})")
    } else {
        s
    }
}

/// aya's parse of vmlinux BTF, shared by the fentry attaches of one load: each parse takes
/// 0.1 s on a fast machine and seconds on a slow one. [`forget_btf`] frees it after load.
static AYA_BTF: std::sync::Mutex<Option<std::sync::Arc<aya::Btf>>> = std::sync::Mutex::new(None);

/// aya's parse of the kernel's BTF (what fentry and tp_btf programs load against), kept
/// until [`forget_btf`].
pub fn aya_btf() -> Result<std::sync::Arc<aya::Btf>, String> {
    let mut cached = AYA_BTF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = cached.as_ref() {
        return Ok(b.clone());
    }
    let b = std::sync::Arc::new(aya::Btf::from_sys_fs().map_err(|e| format!("kernel BTF: {e}"))?);
    *cached = Some(b.clone());
    Ok(b)
}

/// Frees the parsed BTF kept for fentry attaches (tens of MB).
pub fn forget_btf() {
    *AYA_BTF.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

fn attach_fentry(ebpf: &mut Ebpf, hook: &KfuncHook, function: &str) -> Result<(), String> {
    let btf = aya_btf()?;
    let res = (|| {
        if let Some(name) = hook.fentry {
            let p: &mut FEntry = program(ebpf, name)?;
            p.load(function, btf.as_ref()).map_err(|e| explain(&e))?;
            p.attach().map_err(|e| explain(&e))?;
        }
        if let Some(name) = hook.fexit {
            let p: &mut FExit = program(ebpf, name)?;
            p.load(function, btf.as_ref()).map_err(|e| explain(&e))?;
            p.attach().map_err(|e| explain(&e))?;
        }
        Ok(())
    })();
    if res.is_err() {
        // Half attached is worse than not: an entry without its exit fills the maps.
        if let Some(name) = hook.fentry {
            if let Ok(p) = program::<FEntry>(ebpf, name) {
                let _ = p.unload();
            }
        }
    }
    res
}

/// Loads and attaches the kprobe/kretprobe pair; `Ok(Some(why))` when `kprobe_first` was
/// refused and `kprobe` took its place.
fn attach_kprobe(
    ebpf: &mut Ebpf,
    hook: &KfuncHook,
    function: &str,
) -> Result<Option<String>, String> {
    let one = |ebpf: &mut Ebpf, name: &str| -> Result<(), String> {
        let p: &mut KProbe = program(ebpf, name)?;
        p.load().map_err(|e| explain(&e))?;
        p.attach(function, 0).map_err(|e| explain(&e))?;
        Ok(())
    };
    let res = (|| {
        let mut note = None;
        let mut entry = hook.kprobe;
        if let Some((first, needs)) = hook.kprobe_first {
            match one(ebpf, first) {
                Ok(()) => entry = None,
                Err(e) => {
                    if let Ok(p) = program::<KProbe>(ebpf, first) {
                        let _ = p.unload();
                    }
                    note = Some(format!(
                        "{first}, which needs {needs}, not used: {}",
                        short_refusal(&e)
                    ));
                }
            }
        }
        for name in [entry, hook.kretprobe].into_iter().flatten() {
            one(ebpf, name)?;
        }
        Ok(note)
    })();
    if res.is_err() {
        // Half attached is worse than not: an entry without its exit fills the maps.
        for name in [hook.kprobe_first.map(|(p, _)| p), hook.kprobe]
            .into_iter()
            .flatten()
        {
            if let Ok(p) = program::<KProbe>(ebpf, name) {
                let _ = p.unload();
            }
        }
    }
    res
}

/// A refused load in a line: the error's first line, without the verifier's log.
fn short_refusal(e: &str) -> String {
    let line = e.lines().next().unwrap_or_default();
    let line = line.split(" Verifier output:").next().unwrap_or(line);
    line.trim_end_matches('.').chars().take(200).collect()
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
mod tests;
