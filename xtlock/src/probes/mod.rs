//! Loading and attaching the BPF programs: discover the kernel's tracepoint layouts, write
//! them into the programs, attach every hook this kernel offers, and say plainly which
//! ones did not attach and why.

pub mod btf;
pub mod conntrack;
mod discover;
pub mod dropreason;
mod hooks;
pub mod ipvs;
pub mod kfunc;
pub mod nft_commit;
pub mod nft_mutex;
pub mod preflight;
pub mod tracefs;
pub mod xt_replace;

use std::path::PathBuf;

use aya::{
    maps::{
        Array as BpfArray, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf,
    },
    programs::{BtfTracePoint, TracePoint},
    Ebpf, EbpfLoader,
};
use xtlock_common::{
    DropKey, IpvsKey, LockKey, ProbeConfig, RefusalKey, SYS_ENTER_ARG1, SYS_ENTER_ARG2,
};

use crate::lockfiles::LockFile;
pub use discover::{discover, Discovery};
use dropreason::{ReasonError, ReasonSelection, ReasonTable};
pub use hooks::{
    counts_packets, hook_names, Feature, Hook, HookStatus, EXECVEAT_SYSCALL, EXECVE_SYSCALL,
    EXIT_GROUP_SYSCALL, GETSOCKOPT_FN, HOOKS, KFUNC_HOOKS, REFUSAL_PROGRAMS, SETSOCKOPT_FN,
};
use kfunc::{AttachFilter, AttachKind, KfuncHook};

/// Program name of the packet-drop hook.
pub const DROP_PROGRAM: &str = "kfree_skb";

/// The BPF object built by `build.rs` (empty when the BPF toolchain was missing).
static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xtlock"));

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "this xtlock binary was built without its BPF programs (the BPF toolchain was missing \
         at build time); rebuild with `./xtask/run setup` done first, e.g. `./xtask/run trace`"
    )]
    NotBuilt,
    #[error("{0}")]
    Permission(String),
    #[error(
        "tracefs is not available ({why}); mount it with \
         `mount -t tracefs tracefs /sys/kernel/tracing` (needs root) and try again"
    )]
    NoTracefs { why: String },
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    #[error("loading the BPF programs failed: {0}")]
    Load(String),
    /// A kernel older than what xtlock needs at the least (see docs/kernels.md).
    #[error(
        "this kernel ({release}) has no BPF ring buffer (BPF_MAP_TYPE_RINGBUF, Linux >= 5.8, \
         or a distribution kernel that backports it), which carries every xtlock event; \
         xtlock does not run on it. See docs/kernels.md for the kernels it supports."
    )]
    NoRingBuffer { release: String },
    #[error(
        "the lock hook could not be attached ({why}); xtlock cannot see the xtables lock on \
         this kernel. Run `xtlock probes` for details."
    )]
    Required { why: String },
    /// A benchmark's floor program (`--bench-floor*`) could not take its hook's place.
    #[error("{0} (a benchmark's option: run `xtlock probes` for what attaches here)")]
    BenchFloor(String),
    #[error("--drop-reasons: {0}")]
    DropReasons(ReasonError),
}

// By hand, not `#[from]`: the message already says the cause, which a `source` would
// repeat in an error chain.
impl From<ReasonError> for ProbeError {
    fn from(e: ReasonError) -> Self {
        ProbeError::DropReasons(e)
    }
}

/// Options for loading.
pub struct LoadOptions {
    pub locks: Vec<LockFile>,
    /// Ring buffer size in bytes (a power of two, multiple of the page size).
    pub ring_bytes: u32,
    /// Attach types ruled out (`--no-attach`).
    pub no_attach: AttachFilter,
    /// Benchmarks only (`--bench-floor`, `--bench-floor-record`, `--bench-floor-drops`,
    /// `--bench-floor-syscalls`): the lock hook, the drop hook or the nf_tables
    /// transaction's syscall tracepoints run one of the floor programs instead.
    pub floor: Option<Floor>,
    /// Full barriers around the kept takes' copies on this CPU too (they are on wherever
    /// the CPU is not x86): tests, which run on x86, exercise that path this way.
    pub memory_barriers: bool,
}

/// The floors the lock path and the drop hook are measured against (`cargo xtask bench
/// --only lock`, `--only drops`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// An empty program on the lock hook: the attach point and type alone.
    Empty,
    /// The pre-filter and one `Hold`-sized ring record a release: streaming a hold, at least.
    Record,
    /// An empty program on the drop hook (`kfree_skb` on tp_btf); the lock hook as shipped.
    Drops,
    /// One empty program on the `sendmsg()` and `getsockopt()` tracepoints (where their
    /// tracepoint programs attach): the floor of an nf_tables transaction's hooks.
    Syscalls,
}

impl Floor {
    /// The floor's program in place of `hook`'s tp_btf program, when it replaces that hook's.
    fn program_for(self, hook: &Hook) -> Option<&'static str> {
        match self {
            Floor::Empty if hook.required => Some("flock_lock_inode_btf_floor"),
            Floor::Record if hook.required => Some("flock_lock_inode_btf_floor_record"),
            Floor::Drops if hook.program == DROP_PROGRAM => Some("kfree_skb_btf_floor"),
            _ => None,
        }
    }

    /// The floor's program in place of `hook`'s perf tracepoint program.
    fn tracepoint_program_for(self, hook: &Hook) -> Option<&'static str> {
        let syscalls = [
            nft_mutex::SEND_ENTER,
            nft_mutex::SEND_EXIT,
            "sys_enter_getsockopt",
            "sys_exit_getsockopt",
        ];
        (self == Floor::Syscalls && syscalls.contains(&hook.program)).then_some("syscall_floor")
    }
}

/// What the drop hook counts and samples.
#[derive(Clone, Debug)]
pub struct DropOptions {
    pub reasons: ReasonSelection,
    /// Samples per second per CPU sent to userspace (0: counts only).
    pub samples_per_sec: u32,
}

impl Default for DropOptions {
    fn default() -> Self {
        DropOptions {
            reasons: ReasonSelection::Default,
            samples_per_sec: DEFAULT_DROP_SAMPLES,
        }
    }
}

/// Default `--drop-samples`, per CPU.
pub const DEFAULT_DROP_SAMPLES: u32 = 100;

/// Per-CPU drop counters summed over CPUs: (key, total since load).
pub type DropTotals = Vec<(DropKey, u64)>;

/// Per-CPU refusal counters summed over CPUs: (key, total since load).
pub type RefusalTotals = Vec<(RefusalKey, u64)>;

/// Loaded and attached programs. Dropping it detaches everything.
pub struct Probes {
    ebpf: Ebpf,
    pub status: Vec<HookStatus>,
    /// Kernel-function hooks whose functions were not there at start (module not loaded):
    /// tried again by [`Probes::attach_pending`].
    pending: Vec<&'static KfuncHook>,
    kfunc: kfunc::KernelFacts,
    pub tracefs: PathBuf,
    /// Kernel features the hooks depend on, and whether this kernel has them.
    pub features: Vec<Feature>,
    /// This kernel's drop reasons (empty when it reports none).
    pub reasons: ReasonTable,
    /// `skb:kfree_skb` has a `reason` field (Linux >= 5.17).
    pub has_drop_reasons: bool,
    /// This kernel's TCP reset reasons (empty when `tcp_send_reset` reports none).
    pub rst_reasons: ReasonTable,
    /// The nf_tables mutex hook has its configuration (else tried again when nf_tables
    /// loads), and its tracepoints' field offsets for that.
    nft_mutex_ready: bool,
    nft_mutex_tp: nft_mutex::TpOffsets,
    /// Tries left once nf_tables is there (each parses vmlinux BTF and kallsyms).
    nft_mutex_tries: u32,
}

impl Probes {
    /// Preflight checks, discovery, load and attach. Fails only when the lock hook itself
    /// cannot be attached; other hooks degrade with a reason in `status`.
    pub fn load(opts: &LoadOptions) -> Result<Self, ProbeError> {
        Self::load_with_drops(opts, None)
    }

    /// [`load`](Self::load), with the packet-drop hook when `drops` is given.
    pub fn load_with_drops(
        opts: &LoadOptions,
        drops: Option<&DropOptions>,
    ) -> Result<Self, ProbeError> {
        if BPF_OBJECT.is_empty() {
            return Err(ProbeError::NotBuilt);
        }
        preflight::check()?;
        let tracefs = tracefs::locate()?;
        let mut disc = discover(&tracefs, opts.no_attach.clone())?;
        let drop_slots = configure(&mut disc, opts, drops)?;
        let mut ebpf = EbpfLoader::new()
            .override_global("CONFIG", &disc.config, true)
            .map_max_entries("EVENTS", opts.ring_bytes)
            .load(BPF_OBJECT)
            .map_err(|e| preflight::explain_load_error(&e))?;
        fill_maps(
            &mut ebpf,
            opts,
            drop_slots.as_deref(),
            drops.map(|_| disc.refusal),
        )?;
        let nft_mutex_ready = configure_nft_mutex_at_load(&mut ebpf, &mut disc)?;

        // nft_commit before the syscall hooks: where it attaches, it times and counts the
        // batches, and their sendmsg() hooks would only run a program on every sendmsg() of
        // the node (the analysis drops their holds then).
        let nft_commit_first =
            kfunc::setup_and_attach(&mut ebpf, &nft_commit::HOOK, &disc.kfunc, disc.btf.as_ref());
        let commit_hooked = nft_commit_first.is_ok();
        let mut status: Vec<HookStatus> = Vec::new();
        for hook in HOOKS {
            let s = if commit_hooked && nft_mutex::SEND_PROGRAMS.contains(&hook.program) {
                not_needed(hook)
            } else {
                attach_hook(&mut ebpf, hook, &status, &disc, opts, drops)?
            };
            status.push(s);
        }
        let pending = attach_kfunc_hooks(&mut ebpf, &disc, nft_commit_first, &mut status);
        kfunc::forget_btf();
        say_missing(&status, &disc.features, drops.is_some());
        Ok(Self {
            ebpf,
            status,
            pending,
            kfunc: disc.kfunc,
            tracefs,
            features: disc.features,
            reasons: disc.reasons,
            has_drop_reasons: disc.config.kd_has_reason != 0,
            rst_reasons: disc.rst_reasons,
            nft_mutex_ready,
            nft_mutex_tp: disc.nft_mutex_tp,
            nft_mutex_tries: 3,
        })
    }

    /// Configures the nf_tables mutex hook once nf_tables is there (a module loaded after
    /// start). Cheap while it is not: a stat.
    fn configure_nft_mutex(&mut self) {
        if self.nft_mutex_ready
            || self.nft_mutex_tries == 0
            || !std::path::Path::new("/sys/module/nf_tables").exists()
        {
            return;
        }
        self.nft_mutex_tries -= 1;
        let setup = btf::Btf::vmlinux()
            .map_err(|e| format!("no kernel BTF: {e}"))
            .and_then(|b| {
                let k = std::fs::read_to_string("/proc/kallsyms")
                    .map_err(|e| format!("reading /proc/kallsyms: {e}"))?;
                nft_mutex::config(&b, self.nft_mutex_tp, &nft_mutex::symbols(&k))
            });
        // A module still initialising has no BTF or symbols yet: tried again next time, a
        // few times.
        let setup = match setup {
            Ok(s) => s,
            Err(why) => {
                if self.nft_mutex_tries == 0 {
                    tracing::warn!(%why, "nf_tables loaded, but its mutex waits cannot be recognised");
                }
                return;
            }
        };
        match kfunc::set_config(&mut self.ebpf, "NFT_MUTEX_CONFIG", setup.config) {
            Ok(()) => {
                tracing::info!(detail = %setup.detail, "nf_tables loaded: its mutex waits are seen");
                self.nft_mutex_ready = true;
                let f = nft_mutex_feature(&Ok(setup), None);
                match self.features.iter_mut().find(|x| x.name == f.name) {
                    Some(x) => *x = f,
                    None => self.features.push(f),
                }
            }
            Err(why) => tracing::warn!(%why, "nf_tables mutex hook not configured"),
        }
    }

    /// Attaches the kernel-function hooks whose module has loaded since start (nf_tables,
    /// ip_vs load on demand, often after xtlock started). Cheap when nothing changed: a
    /// stat per pending hook's module; kallsyms is read only when one appeared. Returns the
    /// statuses that changed.
    pub fn attach_pending(&mut self) -> Vec<HookStatus> {
        self.configure_nft_mutex();
        let ready: Vec<&'static KfuncHook> = self
            .pending
            .iter()
            .copied()
            .filter(|h| {
                h.module
                    .is_some_and(|m| std::path::Path::new("/sys/module").join(m).exists())
            })
            .collect();
        if ready.is_empty() {
            return Vec::new();
        }
        let mut wanted: Vec<&KfuncHook> = ready.clone();
        wanted.extend(hooks::tracepoint_fallbacks());
        // Parsed only for hooks that need it (seconds on a slow machine): their setup, or
        // the prototypes of what they read (in the module's BTF, split on vmlinux's).
        let btf = ready
            .iter()
            .any(|h| h.setup.is_some() || h.reads.is_some())
            .then(|| btf::Btf::vmlinux().ok())
            .flatten();
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let fresh = kfunc::discover(
            &self.tracefs,
            btf.as_ref()
                .ok_or_else(|| "not read again after start".to_string()),
            &kallsyms,
            &wanted,
            self.kfunc.filter.clone(),
        );
        // Other BTF facts stay those of start: a module's functions are never in vmlinux BTF.
        self.kfunc.symbols = fresh.symbols;
        self.kfunc.protos.extend(fresh.protos);
        let mut changed = Vec::new();
        for hook in ready {
            // Not yet in kallsyms (module still initialising): try again next time.
            if kfunc::plan(hook, &self.kfunc).is_err() {
                continue;
            }
            self.pending.retain(|h| h.name != hook.name);
            let (attach, error) =
                match kfunc::setup_and_attach(&mut self.ebpf, hook, &self.kfunc, btf.as_ref()) {
                    Ok(a) => (module_note(hook, a.describe), None),
                    Err(why) => (module_note(hook, kfunc::candidates_text(hook)), Some(why)),
                };
            if let Some(s) = self.status.iter_mut().find(|s| s.program == hook.name) {
                s.attach = attach;
                s.error = error;
                changed.push(s.clone());
            }
        }
        kfunc::forget_btf();
        changed
    }

    /// Whether the drop hook is attached.
    pub fn drops_attached(&self) -> bool {
        self.status
            .iter()
            .any(|s| s.program == DROP_PROGRAM && s.attached())
    }

    /// In-kernel drop counts since load, summed over CPUs, and the drops counted in the
    /// overflow slot because the key map was full.
    pub fn drop_totals(&self) -> Result<(DropTotals, u64), ProbeError> {
        let (counted, overflow) = self.counter_totals::<DropKey>("DROP_COUNTS", "DROP_OVERFLOW")?;
        // The CPUs' caches in front of the map: a key may be in both, and on several CPUs.
        let cache = self.per_cpu_array::<xtlock_common::DropCache>("DROP_CACHE")?;
        let per_cpu = cache
            .get(&0, 0)
            .map_err(|e| ProbeError::Load(format!("reading DROP_CACHE: {e}")))?;
        Ok((merge_drop_counts(counted, per_cpu.iter()), overflow))
    }

    /// Whether any refusal hook is attached.
    pub fn refusals_attached(&self) -> bool {
        self.status
            .iter()
            .any(|s| REFUSAL_PROGRAMS.contains(&s.program) && s.attached())
    }

    /// In-kernel refusal counts since load, summed over CPUs, and the refusals counted in
    /// the overflow slot because the key map was full.
    pub fn refusal_totals(&self) -> Result<(RefusalTotals, u64), ProbeError> {
        self.counter_totals("REFUSAL_COUNTS", "REFUSAL_OVERFLOW")
    }

    /// The acquire time of the hold the kernel counts refusals and drops for now (`HOLD_NOW`);
    /// 0 when none is going on.
    pub fn current_hold_start(&self) -> Result<u64, ProbeError> {
        let map = self
            .ebpf
            .map("HOLD_NOW")
            .ok_or_else(|| ProbeError::Load("map HOLD_NOW missing".into()))?;
        let arr: BpfArray<&MapData, xtlock_common::HoldNow> =
            BpfArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let h = arr
            .get(&0, 0)
            .map_err(|e| ProbeError::Load(format!("reading HOLD_NOW: {e}")))?;
        Ok(h.start_ns)
    }

    /// The exclusive takes the lock hook keeps until their release (`KEPT`, one entry per
    /// watched lock) that are waiting now: each read twice, kept only when both reads agree
    /// (the hook may be writing it).
    pub fn kept_takes(&self) -> Result<Vec<xtlock_common::LockEvent>, ProbeError> {
        let map = self
            .ebpf
            .map("KEPT")
            .ok_or_else(|| ProbeError::Load("map KEPT missing".into()))?;
        let arr: BpfArray<&MapData, xtlock_common::KeptTake> =
            BpfArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let read = |i: u32| {
            arr.get(&i, 0)
                .map_err(|e| ProbeError::Load(format!("reading KEPT: {e}")))
        };
        let mut takes = Vec::new();
        for i in 0..arr.len() {
            let a = read(i)?;
            if a.take_seq & 1 != 0 || a.take_seq <= a.sent_seq {
                continue;
            }
            if read(i)? == a {
                takes.push(a.take);
            }
        }
        Ok(takes)
    }

    /// Removes refusal counters of holds that ended (read already): the kernel never counts
    /// under them again, and without this every hold with refusals would keep its keys, and
    /// a long-running daemon would fill the map.
    pub fn forget_refusals(&mut self, keys: &[RefusalKey]) -> Result<(), ProbeError> {
        let map = self
            .ebpf
            .map_mut("REFUSAL_COUNTS")
            .ok_or_else(|| ProbeError::Load("map REFUSAL_COUNTS missing".into()))?;
        let mut counts: PerCpuHashMap<&mut MapData, RefusalKey, u64> =
            PerCpuHashMap::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        for k in keys {
            counts
                .remove(k)
                .map_err(|e| ProbeError::Load(format!("removing a refusal counter: {e}")))?;
        }
        Ok(())
    }

    /// Drops counted during holds (`HOLD_DROPS`): per hold start, summed over CPUs, with the
    /// reasons each CPU counted apart. A slot of a CPU that still holds an older hold's
    /// count adds to that hold.
    pub fn hold_drop_counts(&self) -> Result<Vec<HoldDrops>, ProbeError> {
        let arr = self.per_cpu_array::<xtlock_common::HoldDropSlot>("HOLD_DROPS")?;
        let mut by_hold: std::collections::BTreeMap<u64, HoldDrops> = Default::default();
        for i in 0..xtlock_common::HOLD_DROP_SLOTS {
            let per_cpu = arr
                .get(&i, 0)
                .map_err(|e| ProbeError::Load(format!("reading HOLD_DROPS: {e}")))?;
            for slot in per_cpu.iter().filter(|s| s.start_ns != 0) {
                by_hold
                    .entry(slot.start_ns)
                    .or_insert_with(|| HoldDrops {
                        start_ns: slot.start_ns,
                        ..Default::default()
                    })
                    .add(slot);
            }
        }
        Ok(by_hold.into_values().collect())
    }

    /// The per-CPU array map `name` of the object.
    fn per_cpu_array<T: aya::Pod>(
        &self,
        name: &str,
    ) -> Result<PerCpuArray<&MapData, T>, ProbeError> {
        let map = self
            .ebpf
            .map(name)
            .ok_or_else(|| ProbeError::Load(format!("map {name} missing")))?;
        PerCpuArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))
    }

    /// A per-CPU counter map summed over CPUs, and its per-CPU overflow counter summed.
    fn counter_totals<K: aya::Pod>(
        &self,
        counts: &str,
        overflow: &str,
    ) -> Result<(Vec<(K, u64)>, u64), ProbeError> {
        let map = self
            .ebpf
            .map(counts)
            .ok_or_else(|| ProbeError::Load(format!("map {counts} missing")))?;
        let per_cpu: PerCpuHashMap<&MapData, K, u64> =
            PerCpuHashMap::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let mut out = Vec::new();
        for item in per_cpu.iter() {
            // A key can vanish between listing and lookup only if deleted; we never delete.
            let (k, v) = item.map_err(|e| ProbeError::Load(format!("reading {counts}: {e}")))?;
            out.push((k, v.iter().sum()));
        }
        let overflow = self
            .per_cpu_array::<u64>(overflow)?
            .get(&0, 0)
            .map_err(|e| ProbeError::Load(format!("reading {overflow}: {e}")))?
            .iter()
            .sum();
        Ok((out, overflow))
    }

    /// Whether the IPVS hooks are attached.
    pub fn ipvs_attached(&self) -> bool {
        self.status
            .iter()
            .any(|s| ipvs::COUNTING_HOOKS.contains(&s.program) && s.attached())
    }

    /// In-kernel IPVS packet counts since load, summed over CPUs, and the packets counted in
    /// the overflow slot because the key map was full.
    pub fn ipvs_totals(&self) -> Result<(Vec<(IpvsKey, u64)>, u64), ProbeError> {
        self.counter_totals("IPVS_COUNTS", "IPVS_OVERFLOW")
    }

    /// The event ring buffer; call once.
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .ok_or_else(|| ProbeError::Load("map EVENTS missing (already taken?)".into()))?;
        RingBuf::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))
    }

    /// Events the kernel could not queue because the ring buffer was full, summed over CPUs.
    pub fn lost_events(&self) -> Result<u64, ProbeError> {
        let map = self
            .ebpf
            .map("LOST")
            .ok_or_else(|| ProbeError::Load("map LOST missing".into()))?;
        let lost: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        let values = lost
            .get(&0, 0)
            .map_err(|e| ProbeError::Load(format!("reading LOST: {e}")))?;
        Ok(values.iter().sum())
    }

    /// Starts reporting another lock file (e.g. the watched path was replaced by a new inode).
    pub fn watch(&mut self, lock: &LockFile, index: u32) -> Result<(), ProbeError> {
        let map = self
            .ebpf
            .map_mut("WATCHED")
            .ok_or_else(|| ProbeError::Load("map WATCHED missing".into()))?;
        let mut watched: BpfHashMap<&mut MapData, LockKey, u32> =
            BpfHashMap::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        watched
            .insert(lock.key(), index, 0)
            .map_err(|e| ProbeError::Load(format!("watching {}: {e}", lock.path.display())))?;
        // After the key: the probe checks this slot first.
        mark_watched_ino(&mut self.ebpf, lock, index)
    }
}

/// Sets the inode pre-filter slot of `lock` (`WATCHED_INO`): its key and `index` when the
/// slot was empty (or had it), else shared (the probe then looks the key up in `WATCHED`).
fn mark_watched_ino(ebpf: &mut Ebpf, lock: &LockFile, index: u32) -> Result<(), ProbeError> {
    use xtlock_common::{
        WatchedSlot, SLOT_EMPTY, SLOT_INDEX_SHIFT, SLOT_KIND, SLOT_ONE, SLOT_SHARED,
    };
    let map = ebpf
        .map_mut("WATCHED_INO")
        .ok_or_else(|| ProbeError::Load("map WATCHED_INO missing".into()))?;
    let mut slots: BpfArray<&mut MapData, WatchedSlot> =
        BpfArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
    let key = lock.key();
    let slot = (key.ino % u64::from(xtlock_common::WATCHED_INO_SLOTS)) as u32;
    let err =
        |e: aya::maps::MapError| ProbeError::Load(format!("watching {}: {e}", lock.path.display()));
    let now = slots.get(&slot, 0).map_err(err)?;
    let mine = WatchedSlot {
        ino: key.ino,
        dev: key.dev,
        state: SLOT_ONE | (index << SLOT_INDEX_SHIFT),
    };
    let new = match now.state & SLOT_KIND {
        SLOT_EMPTY => mine,
        SLOT_ONE if now == mine => return Ok(()),
        _ => WatchedSlot {
            state: SLOT_SHARED,
            ..now
        },
    };
    slots.set(slot, new, 0).map_err(err)
}

/// What `xtlock probes` says of the nf_tables mutex waits (and, when they are not seen, of
/// the batches, `batches`).
fn nft_mutex_feature(setup: &Result<nft_mutex::Setup, String>, batches: Option<&str>) -> Feature {
    Feature {
        name: "nf_tables mutex waits",
        available: setup.is_ok(),
        detail: match setup {
            Ok(s) => s.detail.clone(),
            Err(why) => format!(
                "{why}; tried again every 5 s while tracing (nf_tables may load later){}",
                batches
                    .map(|b| format!("; meanwhile {b}"))
                    .unwrap_or_default()
            ),
        },
    }
}

/// A module's hook without fentry programs says why: aya 0.14 cannot attach fentry there.
fn module_note(hook: &KfuncHook, attach: String) -> String {
    match hook.module {
        Some(m) if hook.fentry.is_none() && hook.fexit.is_none() => format!(
            "{attach} (no fentry: aya 0.14 attaches fentry only to vmlinux functions, and \
             this one is in module {m})"
        ),
        _ => attach,
    }
}

/// Loads `program` and attaches it to the hook's tracepoint.
fn attach_tracepoint_program(ebpf: &mut Ebpf, hook: &Hook, program: &str) -> Result<(), String> {
    let prog: &mut TracePoint = ebpf
        .program_mut(program)
        .ok_or_else(|| format!("program {program} missing from the BPF object"))?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    // A floor program is attached to several tracepoints, loaded once.
    match prog.load() {
        Ok(()) | Err(aya::programs::ProgramError::AlreadyLoaded) => {}
        Err(e) => return Err(format!("load: {}", kfunc::explain(&e))),
    }
    prog.attach(hook.category, hook.tracepoint)
        .map_err(|e| format!("attach: {}", preflight::error_chain(&e)))?;
    Ok(())
}

/// The hook's tracepoint program, its twin first where it has one (`hooks::first_of`):
/// `Some(note)` says which of them attached, for `xtlock probes`.
fn attach_tracepoint(ebpf: &mut Ebpf, hook: &Hook) -> Result<Option<String>, String> {
    let Some((first, needs)) = hooks::first_of(hook.program) else {
        return attach_tracepoint_program(ebpf, hook, hook.program).map(|()| None);
    };
    match attach_tracepoint_program(ebpf, hook, first) {
        Ok(()) => Ok(Some(format!("program {first}"))),
        Err(why) => {
            tracing::debug!(program = first, %why, "not loaded: the plain program is tried");
            attach_tracepoint_program(ebpf, hook, hook.program).map(|()| {
                Some(format!(
                    "not {first}, which needs {needs}: {}",
                    first_line(&why)
                ))
            })
        }
    }
}

/// The hook's tracepoint, unless its format file was unusable or `--no-attach` rules it out.
fn tracepoint_unless_ruled_out(
    ebpf: &mut Ebpf,
    hook: &Hook,
    disc: &Discovery,
    floor: Option<Floor>,
) -> Result<Option<String>, String> {
    if let Some(why) = disc.unusable_why(hook.program) {
        return Err(why);
    }
    if let Some(why) = ruled_out(hook, AttachKind::Tracepoint, disc) {
        return Err(why);
    }
    // A bench's floor program in its place, else the twin for this kernel's layout.
    let chosen = match floor {
        Some(f) => f.tracepoint_program_for(hook),
        None => std_layout_twin(hook.program, &disc.config),
    };
    if let Some(program) = chosen {
        return attach_tracepoint_program(ebpf, hook, program)
            .map(|()| Some(format!("program {program}")));
    }
    attach_tracepoint(ebpf, hook)
}

/// The twin of a socket-option entry program that finds `level` and `optname` at the usual
/// offsets without reading its configuration, where this kernel's format file has them
/// there: its filter then touches no map for the calls it lets go (most of the node's).
fn std_layout_twin(program: &str, c: &ProbeConfig) -> Option<&'static str> {
    let usual = |level: u32, optname: u32| level == SYS_ENTER_ARG1 && optname == SYS_ENTER_ARG2;
    match program {
        "sys_enter_getsockopt" if usual(c.gso_level, c.gso_optname) => {
            Some("sys_enter_getsockopt_std")
        }
        "sys_enter_setsockopt" if usual(c.sso_level, c.sso_optname) => {
            Some("sys_enter_setsockopt_std")
        }
        _ => None,
    }
}

/// Why `--no-attach` rules out `kind` for this hook, by its name or its category.
fn ruled_out(hook: &Hook, kind: AttachKind, disc: &Discovery) -> Option<String> {
    let filter = &disc.kfunc.filter;
    filter
        .blocks(hook.program, kind)
        .or_else(|| filter.blocks(hook.category, kind))
}

/// The first line of a load error: its verifier log follows, thousands of lines.
fn first_line(s: &str) -> &str {
    match s.find(" Verifier output:") {
        Some(i) => &s[..i],
        None => s.lines().next().unwrap_or(s),
    }
}

/// The hook's `tp_btf` program, unless `--no-attach` rules it out or BTF lacks what it
/// reads.
fn attach_raw(ebpf: &mut Ebpf, hook: &Hook, program: &str, disc: &Discovery) -> Result<(), String> {
    if let Some(why) = ruled_out(hook, AttachKind::BtfTracepoint, disc) {
        return Err(why);
    }
    if hook.program == DROP_PROGRAM {
        disc.raw_drop.clone()?;
    } else if hook.program == hooks::REFUSAL_PROGRAMS[0] {
        disc.raw_icmp.clone()?;
    } else if hook.program == nft_mutex::BEGIN || hook.program == nft_mutex::END {
        disc.raw_nft_mutex.clone()?;
    } else {
        disc.raw_lock.clone()?;
    }
    let btf = kfunc::aya_btf()?;
    let prog: &mut BtfTracePoint = ebpf
        .program_mut(program)
        .ok_or_else(|| format!("program {program} missing from the BPF object"))?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    prog.load(hook.tracepoint, &btf)
        .map_err(|e| format!("load: {}", kfunc::explain(&e)))?;
    prog.attach()
        .map_err(|e| format!("attach: {}", preflight::error_chain(&e)))?;
    Ok(())
}

/// Drop totals per key from the hash map's and the caches' counts, each key once.
fn merge_drop_counts<'a>(
    counted: Vec<(DropKey, u64)>,
    caches: impl Iterator<Item = &'a xtlock_common::DropCache>,
) -> Vec<(DropKey, u64)> {
    let mut by_key: std::collections::BTreeMap<DropKey, u64> = counted.into_iter().collect();
    for c in caches {
        for s in c.slots.iter().filter(|s| s.count != 0) {
            *by_key.entry(s.key).or_default() += s.count;
        }
    }
    by_key.into_iter().collect()
}

/// The drops the kernel counted during one hold, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HoldDrops {
    pub start_ns: u64,
    pub count: u64,
    /// Per reason, sorted; drops of reasons a CPU had no entry left for are in `count` only.
    pub by_reason: Vec<(u32, u64)>,
}

impl HoldDrops {
    /// Adds one CPU's slot.
    fn add(&mut self, slot: &xtlock_common::HoldDropSlot) {
        self.count += slot.count;
        for (&r, &n) in slot.reasons.iter().zip(&slot.counts) {
            if n == 0 {
                // Entries are claimed in order: the first free one ends them.
                break;
            }
            match self.by_reason.binary_search_by_key(&r, |&(k, _)| k) {
                Ok(i) => self.by_reason[i].1 += u64::from(n),
                Err(i) => self.by_reason.insert(i, (r, u64::from(n))),
            }
        }
    }
}

/// The programs' configuration from the options: the drop reasons watched (their slots, a
/// bad `--drop-reasons` refused before anything is loaded), the sample rate, the ring's
/// wake-up and the memory order.
fn configure(
    disc: &mut Discovery,
    opts: &LoadOptions,
    drops: Option<&DropOptions>,
) -> Result<Option<Vec<u32>>, ProbeError> {
    // Bad --drop-reasons is the user's to fix: refuse before loading anything.
    let drop_slots = match drops {
        Some(d) => Some(
            disc.reasons
                .slots(&d.reasons, disc.config.kd_has_reason != 0)?,
        ),
        None => None,
    };
    // The reasons the drop hook filters by a bit of its configuration.
    for &slot in drop_slots.iter().flatten() {
        if slot < xtlock_common::DROP_WATCH_BITS {
            disc.config.drop_watch[(slot / 32) as usize] |= 1 << (slot % 32);
        }
    }
    if let Some(d) = drops {
        if d.samples_per_sec > 0 {
            disc.config.drop_sample_interval_ns =
                (1_000_000_000 / u64::from(d.samples_per_sec)).max(1);
            disc.config.drop_sample_burst = d.samples_per_sec;
        }
    }
    // A record wakes us only past a quarter of the ring (the poll tick reads the rest).
    disc.config.ring_wake_bytes = opts.ring_bytes / 4;
    // x86 keeps stores in order and loads in order: the kept takes' sequence lock needs
    // no barrier there (`xtlock-ebpf/src/pending.rs`).
    disc.config.weak_order =
        u32::from(opts.memory_barriers || !cfg!(any(target_arch = "x86_64", target_arch = "x86")));
    Ok(drop_slots)
}

/// The maps the programs read from the start: the watched locks, the drop reasons' filter,
/// the refusal hooks' offsets (`refusal`, when drops are traced).
fn fill_maps(
    ebpf: &mut Ebpf,
    opts: &LoadOptions,
    drop_slots: Option<&[u32]>,
    refusal: Option<xtlock_common::RefusalConfig>,
) -> Result<(), ProbeError> {
    {
        let map = ebpf
            .map_mut("WATCHED")
            .ok_or_else(|| ProbeError::Load("map WATCHED missing from the object".into()))?;
        let mut watched: BpfHashMap<&mut MapData, LockKey, u32> =
            BpfHashMap::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        for (i, l) in opts.locks.iter().enumerate() {
            watched
                .insert(l.key(), i as u32, 0)
                .map_err(|e| ProbeError::Load(format!("watching {}: {e}", l.path.display())))?;
        }
    }
    for (i, l) in opts.locks.iter().enumerate() {
        mark_watched_ino(ebpf, l, i as u32)?;
    }

    if let Some(slots) = drop_slots {
        let map = ebpf
            .map_mut("DROP_REASONS")
            .ok_or_else(|| ProbeError::Load("map DROP_REASONS missing".into()))?;
        let mut arr: BpfArray<&mut MapData, u8> =
            BpfArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        for &s in slots {
            arr.set(s, 1u8, 0)
                .map_err(|e| ProbeError::Load(format!("drop reason filter: {e}")))?;
        }
    }

    if let Some(refusal) = refusal {
        let map = ebpf
            .map_mut("REFUSAL_CONFIG")
            .ok_or_else(|| ProbeError::Load("map REFUSAL_CONFIG missing".into()))?;
        let mut arr: BpfArray<&mut MapData, xtlock_common::RefusalConfig> =
            BpfArray::try_from(map).map_err(|e| ProbeError::Load(e.to_string()))?;
        arr.set(0, refusal, 0)
            .map_err(|e| ProbeError::Load(format!("refusal hooks' offsets: {e}")))?;
    }
    Ok(())
}

/// The nf_tables mutex hook's configuration, before the hook attaches; without it
/// (nf_tables not there yet) the programs do nothing until `attach_pending` finds it.
fn configure_nft_mutex_at_load(ebpf: &mut Ebpf, disc: &mut Discovery) -> Result<bool, ProbeError> {
    let nft_mutex_ready = match &disc.nft_mutex {
        Ok(setup) => {
            kfunc::set_config(ebpf, "NFT_MUTEX_CONFIG", setup.config).map_err(ProbeError::Load)?;
            true
        }
        // The batches are still timed and counted from their sendmsg() (vmlinux's BTF
        // suffices), until nf_tables' own BTF and symbols give the rest.
        Err(_) => {
            if let Some((batches, _)) = &disc.nft_batches {
                kfunc::set_config(ebpf, "NFT_MUTEX_CONFIG", *batches).map_err(ProbeError::Load)?;
            }
            false
        }
    };
    disc.features.push(nft_mutex_feature(
        &disc.nft_mutex,
        disc.nft_batches.as_ref().map(|(_, d)| d.as_str()),
    ));
    Ok(nft_mutex_ready)
}

/// A batch's `sendmsg()` hook where nft_commit times and counts the batches.
fn not_needed(hook: &Hook) -> HookStatus {
    HookStatus {
        program: hook.program,
        attach: format!(
            "not needed: {} times and counts the batches (tracepoint {}:{} otherwise)",
            nft_commit::HOOK.name,
            hook.category,
            hook.tracepoint
        ),
        required: false,
        purpose: hook.purpose,
        error: None,
        needless: true,
    }
}

/// One tracepoint hook attached by its first candidate that works (`status`: the hooks
/// attached so far, for a pair's partner); a required one that cannot attach is an error.
fn attach_hook(
    ebpf: &mut Ebpf,
    hook: &Hook,
    status: &[HookStatus],
    disc: &Discovery,
    opts: &LoadOptions,
    drops: Option<&DropOptions>,
) -> Result<HookStatus, ProbeError> {
    let mut attach = format!("tracepoint {}:{}", hook.category, hook.tracepoint);
    let partner = hook
        .paired_with
        .and_then(|p| status.iter().find(|s| s.program == p));
    let error = match (partner, hook.fallback) {
        // The partner's function hooks cover both of them.
        (Some(p), _) if !p.attach.starts_with("tracepoint") => {
            attach = p.attach.clone();
            p.error.clone()
        }
        // The syscall's function first, its tracepoint only when that fails.
        (_, Some(fb)) => attach_syscall(ebpf, hook, fb, disc, opts, &mut attach),
        _ => attach_tracepoint_hook(ebpf, hook, disc, opts, drops, &mut attach)?,
    };
    if hook.required {
        if let Some(why) = &error {
            return Err(ProbeError::Required { why: why.clone() });
        }
    }
    Ok(HookStatus {
        program: hook.program,
        attach,
        required: hook.required,
        purpose: hook.purpose,
        error,
        needless: false,
    })
}

/// A syscall hook: its function first, its tracepoint when that fails; why neither, if so.
fn attach_syscall(
    ebpf: &mut Ebpf,
    hook: &Hook,
    fb: &'static kfunc::KfuncHook,
    disc: &Discovery,
    opts: &LoadOptions,
    attach: &mut String,
) -> Option<String> {
    match kfunc::attach_after(ebpf, fb, &disc.kfunc, Vec::new()) {
        Ok(a) => {
            *attach = a.describe;
            None
        }
        Err(fn_why) => {
            tracing::debug!(hook = hook.program, why = %fn_why, "syscall function not hooked: its tracepoint is tried");
            match tracepoint_unless_ruled_out(ebpf, hook, disc, opts.floor) {
                Ok(note) => {
                    if let Some(n) = note {
                        attach.push_str(&format!(" ({n})"));
                    }
                    None
                }
                Err(why) => {
                    attach.push_str(&format!(", else {}", kfunc::candidates_text(fb)));
                    Some(format!("tracepoint: {why}; {fn_why}"))
                }
            }
        }
    }
}

/// A tracepoint hook: tp_btf, else the perf tracepoint, else (a missing tracepoint) its
/// kernel function; why none, if so.
fn attach_tracepoint_hook(
    ebpf: &mut Ebpf,
    hook: &Hook,
    disc: &Discovery,
    opts: &LoadOptions,
    drops: Option<&DropOptions>,
    attach: &mut String,
) -> Result<Option<String>, ProbeError> {
    let not_asked = counts_packets(hook.program) && drops.is_none();
    let floor = opts.floor.and_then(|f| f.program_for(hook));
    let raw = hook
        .raw_program
        .filter(|_| !not_asked)
        .map(|raw| floor.unwrap_or(raw))
        .map(|raw| attach_raw(ebpf, hook, raw, disc));
    if let (Some(_), Some(Err(why))) = (floor, &raw) {
        return Err(ProbeError::BenchFloor(format!(
            "--bench-floor* needs hook {} on tp_btf: {why}",
            hook.program
        )));
    }
    if let Some(Err(why)) = &raw {
        tracing::debug!(
            hook = hook.program,
            %why,
            "tp_btf not used: the perf tracepoint is tried"
        );
    }
    let tp = if matches!(raw, Some(Ok(()))) {
        *attach = format!("tp_btf {}:{}", hook.category, hook.tracepoint);
        Ok(None)
    } else if not_asked
        // An unusable format file says why first.
        && disc.unusable_why(hook.program).is_none()
    {
        Err("not asked for (--no-drops)".to_string())
    } else {
        tracepoint_unless_ruled_out(ebpf, hook, disc, opts.floor)
    };
    if let Ok(Some(note)) = &tp {
        attach.push_str(&format!(" ({note})"));
    }
    if let (Ok(_), Some(Err(r))) = (&tp, &raw) {
        // Why not tp_btf, as the function hooks say why not fentry.
        attach.push_str(&format!(" (fallback; tp_btf: {})", first_line(r)));
    }
    let err = tp.err().map(|why| match raw {
        Some(Err(r)) => format!("{why}; tp_btf: {r}"),
        _ => why,
    });
    // A missing tracepoint's function, hooked instead.
    Ok(match (err, hooks::backup_of(hook.program)) {
        (Some(why), Some(fb)) if !not_asked => {
            match kfunc::attach_after(ebpf, fb, &disc.kfunc, vec![format!("tracepoint: {why}")]) {
                Ok(a) => {
                    *attach = a.describe;
                    None
                }
                Err(fn_why) => {
                    attach.push_str(&format!(
                        ", else {} ({})",
                        kfunc::candidates_text(fb),
                        fb.name
                    ));
                    Some(fn_why)
                }
            }
        }
        (err, _) => err,
    })
}

/// The kernel-function hooks (nft_commit's result given, tried first); those whose module is
/// not loaded yet are returned, to be tried when it is.
fn attach_kfunc_hooks(
    ebpf: &mut Ebpf,
    disc: &Discovery,
    nft_commit_first: Result<kfunc::Attached, String>,
    status: &mut Vec<HookStatus>,
) -> Vec<&'static kfunc::KfuncHook> {
    let mut nft_commit_first = Some(nft_commit_first);
    let mut pending = Vec::new();
    for hook in KFUNC_HOOKS {
        let tried = match nft_commit_first.take_if(|_| hook.name == nft_commit::HOOK.name) {
            Some(r) => r,
            None => kfunc::setup_and_attach(ebpf, hook, &disc.kfunc, disc.btf.as_ref()),
        };
        let (attach, error) = match tried {
            Ok(a) => (module_note(hook, a.describe), None),
            Err(why) => {
                if kfunc::plan(hook, &disc.kfunc).is_err() {
                    pending.push(*hook);
                }
                (module_note(hook, kfunc::candidates_text(hook)), Some(why))
            }
        };
        status.push(HookStatus {
            program: hook.name,
            attach,
            required: false,
            purpose: hook.purpose,
            error,
            needless: false,
        });
    }
    pending
}

/// One line for the user (a kernel without kprobes misses a dozen hooks); each reason at
/// debug level and in `xtlock probes`.
fn say_missing(status: &[HookStatus], features: &[Feature], drops: bool) {
    let missing: Vec<&HookStatus> = status
        .iter()
        .filter(|s| s.missing() && (drops || !counts_packets(s.program)))
        .collect();
    for s in &missing {
        tracing::debug!(
            hook = s.program,
            why = s.error.as_deref().unwrap_or(""),
            "hook not attached"
        );
    }
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(|s| s.program).collect();
        tracing::warn!(
            "{} of {} hooks not attached ({}); xtlock runs without them. `xtlock probes` \
             says why for each and what it costs",
            missing.len(),
            status.len(),
            names.join(", ")
        );
    }
    for f in features.iter().filter(|f| !f.available) {
        tracing::warn!(feature = f.name, why = %f.detail, "feature unavailable");
    }
}

#[cfg(test)]
mod drop_cache_tests {
    use xtlock_common::{DropCache, DropCacheSlot, DropKey, DROP_CACHE_SLOTS};

    /// A key counted in two CPUs' caches and in the map is one total; free slots add nothing.
    #[test]
    fn cache_and_map_counts_add_up_per_key() {
        let k = |location| DropKey {
            location,
            reason: 2,
            netns: 9,
        };
        let mut a = DropCache {
            slots: [DropCacheSlot::default(); DROP_CACHE_SLOTS],
        };
        let mut b = a;
        a.slots[3] = DropCacheSlot {
            key: k(1),
            count: 5,
        };
        b.slots[3] = DropCacheSlot {
            key: k(1),
            count: 7,
        };
        b.slots[4] = DropCacheSlot {
            key: k(2),
            count: 1,
        };
        let got = super::merge_drop_counts(vec![(k(1), 100), (k(3), 4)], [a, b].iter());
        assert_eq!(got, vec![(k(1), 112), (k(2), 1), (k(3), 4)]);
    }
}
