//! Loading and attaching the BPF programs: discover the kernel's tracepoint layouts, write
//! them into the programs, attach every hook this kernel offers, and say plainly which
//! ones did not attach and why.

pub mod preflight;
pub mod tracefs;

use std::path::PathBuf;

use aya::{
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf},
    programs::TracePoint,
    Ebpf, EbpfLoader,
};
use xtlock_common::{LockKey, ProbeConfig};

use crate::lockfiles::LockFile;
use tracefs::Format;

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
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("loading the BPF programs failed: {0}")]
    Load(String),
    #[error(
        "the lock hook could not be attached ({why}); xtlock cannot see the xtables lock on \
         this kernel. Run `xtlock probes` for details."
    )]
    Required { why: String },
}

/// One kernel hook and what it gives the user, in plain words.
#[derive(Clone, Copy, Debug)]
pub struct Hook {
    /// Program name in the BPF object (the function name in `xtlock-ebpf`).
    pub program: &'static str,
    pub category: &'static str,
    pub tracepoint: &'static str,
    /// Without it xtlock cannot do its job at all.
    pub required: bool,
    pub purpose: &'static str,
}

pub const HOOKS: &[Hook] = &[
    Hook {
        program: "flock_lock_inode",
        category: "filelock",
        tracepoint: "flock_lock_inode",
        required: true,
        purpose: "takes, failed tries, waits and releases of the watched lock files",
    },
    Hook {
        program: "sys_enter_flock",
        category: "syscalls",
        tracepoint: "sys_enter_flock",
        required: false,
        purpose: "when each flock() call started, and its flags (LOCK_NB)",
    },
    Hook {
        program: "sys_exit_flock",
        category: "syscalls",
        tracepoint: "sys_exit_flock",
        required: false,
        purpose: "how each flock() call ended (granted, EAGAIN, EINTR when `iptables -w` gave up)",
    },
    Hook {
        program: "sys_enter_execve",
        category: "syscalls",
        tracepoint: "sys_enter_execve",
        required: false,
        purpose: "command lines of new programs (execve)",
    },
    Hook {
        program: "sys_enter_execveat",
        category: "syscalls",
        tracepoint: "sys_enter_execveat",
        required: false,
        purpose: "command lines of new programs (execveat)",
    },
    Hook {
        program: "sched_process_exec",
        category: "sched",
        tracepoint: "sched_process_exec",
        required: false,
        purpose: "iptables and iptables-restore runs, and the programs that started them",
    },
    Hook {
        program: "sched_process_fork",
        category: "sched",
        tracepoint: "sched_process_fork",
        required: false,
        purpose: "the parent of each new process (who called iptables)",
    },
    Hook {
        program: "sys_enter_exit_group",
        category: "syscalls",
        tracepoint: "sys_enter_exit_group",
        required: false,
        purpose: "exit status (iptables exits 4 when it gave up waiting for the lock)",
    },
    Hook {
        program: "sched_process_exit",
        category: "sched",
        tracepoint: "sched_process_exit",
        required: false,
        purpose: "process exits",
    },
    Hook {
        program: "sys_enter_setsockopt",
        category: "syscalls",
        tracepoint: "sys_enter_setsockopt",
        required: false,
        purpose: "start of a legacy table replace (IPT_SO_SET_REPLACE) inside a hold",
    },
    Hook {
        program: "sys_exit_setsockopt",
        category: "syscalls",
        tracepoint: "sys_exit_setsockopt",
        required: false,
        purpose: "end of a legacy table replace: the kernel's share of a hold",
    },
];

/// Whether a hook is attached, and if not, why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct HookStatus {
    pub program: &'static str,
    pub attach: String,
    pub required: bool,
    pub purpose: &'static str,
    /// `None` when attached.
    pub error: Option<String>,
}

impl HookStatus {
    pub fn attached(&self) -> bool {
        self.error.is_none()
    }
}

/// Field offsets for every hook, and per hook the reason it cannot be used, if any.
pub struct Discovery {
    pub config: ProbeConfig,
    pub unusable: Vec<(&'static str, String)>,
}

/// Reads the format files of every hook and fills the probe configuration.
pub fn discover(tracefs: &std::path::Path) -> Result<Discovery, ProbeError> {
    let mut config = ProbeConfig::default();
    let mut unusable = Vec::new();
    for hook in HOOKS {
        let fmt = match Format::read(tracefs, hook.category, hook.tracepoint)? {
            Some(f) => f,
            None => {
                unusable.push((
                    hook.program,
                    format!(
                        "tracepoint {}:{} does not exist on this kernel",
                        hook.category, hook.tracepoint
                    ),
                ));
                continue;
            }
        };
        if let Err(why) = fill(&mut config, hook.program, &fmt) {
            unusable.push((hook.program, why));
        }
    }
    Ok(Discovery { config, unusable })
}

/// Offset of the first field named in `names`, checking its size.
fn off(fmt: &Format, names: &[&str], size: u32) -> Result<u32, String> {
    let f = fmt
        .field(names)
        .ok_or_else(|| format!("no field {} in its format file", names.join("/")))?;
    if f.size != size {
        return Err(format!(
            "field {} is {} bytes, expected {size}: layout not supported",
            f.name, f.size
        ));
    }
    Ok(f.offset)
}

fn fill(c: &mut ProbeConfig, program: &str, fmt: &Format) -> Result<(), String> {
    match program {
        "flock_lock_inode" => {
            c.fl_ino = off(fmt, &["i_ino"], 8)?;
            c.fl_dev = off(fmt, &["s_dev"], 4)?;
            c.fl_owner = off(fmt, &["owner", "fl_owner"], 8)?;
            c.fl_flags = off(fmt, &["flags", "fl_flags"], 4)?;
            c.fl_type = off(fmt, &["type", "fl_type"], 1)?;
            c.fl_ret = off(fmt, &["ret"], 4)?;
        }
        "sys_enter_flock" => c.flock_cmd = off(fmt, &["cmd"], 8)?,
        "sys_exit_flock" | "sys_exit_setsockopt" => {
            let ret = off(fmt, &["ret"], 8)?;
            // One offset serves every sys_exit tracepoint (they share a layout).
            if c.sys_exit_ret != 0 && c.sys_exit_ret != ret {
                return Err("sys_exit `ret` offsets differ between syscalls".into());
            }
            c.sys_exit_ret = ret;
        }
        "sys_enter_setsockopt" => {
            c.sso_level = off(fmt, &["level"], 8)?;
            c.sso_optname = off(fmt, &["optname"], 8)?;
            c.sso_optlen = off(fmt, &["optlen"], 8)?;
        }
        "sys_enter_execve" => c.execve_argv = off(fmt, &["argv"], 8)?,
        "sys_enter_execveat" => c.execveat_argv = off(fmt, &["argv"], 8)?,
        "sched_process_exec" => {
            let f = fmt
                .field(&["filename"])
                .ok_or("no field filename in its format file")?;
            if !f.ctype.starts_with("__data_loc") || f.size != 4 {
                return Err(format!(
                    "field filename is `{}`: layout not supported",
                    f.ctype
                ));
            }
            c.exec_filename = f.offset;
            c.exec_old_pid = off(fmt, &["old_pid"], 4)?;
        }
        "sched_process_fork" => c.fork_child_pid = off(fmt, &["child_pid"], 4)?,
        "sys_enter_exit_group" => c.exit_code = off(fmt, &["error_code"], 8)?,
        _ => {}
    }
    Ok(())
}

/// Options for loading.
pub struct LoadOptions {
    pub locks: Vec<LockFile>,
    /// Ring buffer size in bytes (a power of two, multiple of the page size).
    pub ring_bytes: u32,
}

/// Loaded and attached programs. Dropping it detaches everything.
pub struct Probes {
    ebpf: Ebpf,
    pub status: Vec<HookStatus>,
    pub tracefs: PathBuf,
}

impl Probes {
    /// Preflight checks, discovery, load and attach. Fails only when the lock hook itself
    /// cannot be attached; other hooks degrade with a reason in `status`.
    pub fn load(opts: &LoadOptions) -> Result<Self, ProbeError> {
        if BPF_OBJECT.is_empty() {
            return Err(ProbeError::NotBuilt);
        }
        preflight::check()?;
        let tracefs = tracefs::locate()?;
        let disc = discover(&tracefs)?;
        let mut ebpf = EbpfLoader::new()
            .override_global("CONFIG", &disc.config, true)
            .map_max_entries("EVENTS", opts.ring_bytes)
            .load(BPF_OBJECT)
            .map_err(|e| preflight::explain_load_error(&e))?;

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

        let mut status = Vec::new();
        for hook in HOOKS {
            let attach = format!("tracepoint {}:{}", hook.category, hook.tracepoint);
            let error = match disc.unusable.iter().find(|(p, _)| *p == hook.program) {
                Some((_, why)) => Some(why.clone()),
                None => attach_tracepoint(&mut ebpf, hook).err(),
            };
            if hook.required {
                if let Some(why) = &error {
                    return Err(ProbeError::Required { why: why.clone() });
                }
            }
            status.push(HookStatus {
                program: hook.program,
                attach,
                required: hook.required,
                purpose: hook.purpose,
                error,
            });
        }
        for s in status.iter().filter(|s| !s.attached()) {
            tracing::warn!(
                hook = s.program,
                why = s.error.as_deref().unwrap_or(""),
                "hook not attached"
            );
        }
        Ok(Self {
            ebpf,
            status,
            tracefs,
        })
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
            .map_err(|e| ProbeError::Load(format!("watching {}: {e}", lock.path.display())))
    }
}

fn attach_tracepoint(ebpf: &mut Ebpf, hook: &Hook) -> Result<(), String> {
    let prog: &mut TracePoint = ebpf
        .program_mut(hook.program)
        .ok_or_else(|| format!("program {} missing from the BPF object", hook.program))?
        .try_into()
        .map_err(|e| format!("{e}"))?;
    prog.load()
        .map_err(|e| format!("load: {}", preflight::error_chain(&e)))?;
    prog.attach(hook.category, hook.tracepoint)
        .map_err(|e| format!("attach: {}", preflight::error_chain(&e)))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_rejects_wrong_sizes_and_missing_fields() {
        let mut c = ProbeConfig::default();
        let fmt = Format::parse("\tfield:int cmd;\toffset:16;\tsize:4;\tsigned:0;\n");
        let err = fill(&mut c, "sys_enter_flock", &fmt).unwrap_err();
        assert!(err.contains("4 bytes"), "{err}");
        let fmt = Format::parse("\tfield:long x;\toffset:16;\tsize:8;\tsigned:0;\n");
        assert!(fill(&mut c, "sys_enter_flock", &fmt)
            .unwrap_err()
            .contains("no field cmd"));
        let fmt = Format::parse("\tfield:unsigned int cmd;\toffset:24;\tsize:8;\tsigned:0;\n");
        fill(&mut c, "sys_enter_flock", &fmt).unwrap();
        assert_eq!(c.flock_cmd, 24);
    }

    #[test]
    fn exec_filename_must_be_data_loc() {
        let mut c = ProbeConfig::default();
        let fmt = Format::parse(
            "\tfield:char filename[16];\toffset:8;\tsize:16;\tsigned:0;\n\
             \tfield:pid_t old_pid;\toffset:16;\tsize:4;\tsigned:1;\n",
        );
        assert!(fill(&mut c, "sched_process_exec", &fmt).is_err());
    }

    /// Every hook's format file on the running kernel parses (when tracefs is readable).
    #[test]
    fn discovers_this_kernel() {
        let Ok(tracefs) = tracefs::locate() else {
            eprintln!("skipped: tracefs not available to this user");
            return;
        };
        let d = discover(&tracefs).unwrap();
        assert!(
            !d.unusable.iter().any(|(p, _)| *p == "flock_lock_inode"),
            "{:?}",
            d.unusable
        );
        assert_ne!(d.config.fl_ino, d.config.fl_owner);
    }
}
