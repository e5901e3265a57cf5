//! Collector benchmark for `cargo xtask bench` (build it with `--release`):
//!
//!   bench_collector gen PATH --events N [--mix node|iptables|lock|holds] [--seed S]
//!       [--no-rule-reads]
//!       writes a capture of N synthetic raw kernel events (the `xtlock_common` structs, byte
//!       for byte as the ring buffer delivers them) with `CaptureWriter`; prints its size.
//!       `--no-rule-reads`: the same stream without its rule table reads (what they cost).
//!   bench_collector run PATH --stage read|decode|analyse|json
//!       reads the capture back and times one stage of the pipeline: `read` (blocks, checksums,
//!       LZ4, records), `decode` (+ `decode::decode`), `analyse` (+ `Analyzer::process`),
//!       `json` (+ the JSON Lines sink writing every fact to a null writer); `kinds` prints,
//!       on stderr, the analysis' allocations and time per event kind.
//!
//! Both print one JSON object on stdout. `run` reports CPU time (the process is single
//! threaded: events per CPU second = events/s per core), wall time, peak RSS (`VmHWM` of this
//! process: run each stage in a fresh process), and heap allocations per event (a counting
//! global allocator).
//!
//! Streams (`--mix`):
//! - `node`: a busy node. Daemon threads come and go, unrelated programs (runc, shells,
//!   health checks) fork/exec/exit, Go daemons poll the lock with `LOCK_NB`, and one episode
//!   in ten is a short-lived `iptables`/`iptables-restore` forked by kube-proxy, calico-node,
//!   kubelet or firewalld: exec, lock (sometimes after waiting behind another one), table
//!   replaces, release, exit.
//! - `iptables`: the worst case for the analysis: every episode is an iptables run as above,
//!   so a third of the events yield a fact (exec, hold, exit, wait) with its strings.
//! - `lock`: lock events alone (take, flock return, release, flock return) from a few
//!   long-lived processes, as builds that hooked the `flock()` syscall sent them.
//! - `holds`: the same cycles as this build's kernel side sends them: one `Hold` record
//!   (take and release) a cycle.
//!
//! `node` and `iptables` also carry what the rule diffs and refusals add: each kube-proxy
//! restore is followed by the read of its nat table (a `RuleTable`: 100 services, one or
//! two chains changed a read, the rest as digests), and about once a second of event time
//! refusal samples and the kernel's refusal counts (`RefusalCounts`) arrive, during a hold
//! when one is going on.
use std::{
    alloc::{GlobalAlloc, Layout, System},
    io,
    path::Path,
    sync::atomic::{AtomicU64, Ordering},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};
use xtlock::{
    analysis::{Analyzer, WatchedLock},
    capture::{CaptureHeader, CaptureLock, CaptureReader, CaptureWriter, Record},
    decode::{
        digest_rules, ChainState, Comm, Event, LockOp, ProcInfo, RefusalCount, RefusalCounts, Rule,
        RuleTable,
    },
    sinks::{JsonSink, Sink},
};
use xtlock_common as c;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const LOCK_PATH: &str = "/run/xtables.lock";
const LOCK_DEV: u32 = 25;
const LOCK_INO: u64 = 1234;
const MS: u64 = 1_000_000;

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: every event struct is repr(C), made of integers and byte arrays with explicit
    // padding fields, so all of its bytes are initialised.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

fn comm(s: &str) -> [u8; c::COMM_LEN] {
    Comm::new(s).0
}

fn hdr(kind: c::EventKind, tgid: u32, tid: u32, ts_ns: u64) -> c::EventHeader {
    c::EventHeader {
        kind: kind as u32,
        tgid,
        tid,
        _pad: 0,
        ts_ns,
    }
}

struct Agent {
    pid: u32,
    comm: &'static str,
    /// Its iptables commands (argv).
    cmds: &'static [&'static [&'static str]],
}

const AGENTS: &[Agent] = &[
    Agent {
        pid: 1100,
        comm: "kube-proxy",
        cmds: &[
            &[
                "iptables-restore",
                "-w",
                "5",
                "-W",
                "100000",
                "--noflush",
                "--counters",
            ],
            &[
                "iptables",
                "-w",
                "5",
                "-W",
                "100000",
                "-N",
                "KUBE-KUBELET-CANARY",
                "-t",
                "mangle",
            ],
            &["iptables-save", "-t", "nat"],
        ],
    },
    Agent {
        pid: 1200,
        comm: "calico-node",
        cmds: &[
            &[
                "iptables-legacy-restore",
                "--noflush",
                "--verbose",
                "--wait",
                "10",
                "--wait-interval",
                "50000",
            ],
            &["iptables-legacy-save", "-t", "filter"],
        ],
    },
    Agent {
        pid: 1300,
        comm: "kubelet",
        cmds: &[&[
            "iptables",
            "-w",
            "5",
            "-W",
            "100000",
            "-N",
            "KUBE-FIREWALL",
            "-t",
            "filter",
            "-m",
            "comment",
        ]],
    },
    Agent {
        pid: 1400,
        comm: "firewalld",
        cmds: &[&["/usr/sbin/iptables-restore", "-w", "-n"]],
    },
];

const OTHERS: &[(&str, &str)] = &[
    ("/usr/bin/runc", "runc"),
    ("/bin/sh", "sh"),
    ("/usr/sbin/conntrack", "conntrack"),
    ("/usr/bin/cat", "cat"),
    ("/usr/local/bin/healthcheck", "healthcheck"),
];

struct Gen<W: io::Write> {
    w: CaptureWriter<W>,
    rng: Rng,
    ts: u64,
    next_pid: u32,
    n: u64,
    /// kube-proxy's nat table as last read: chains and rules.
    nat: Vec<(String, Vec<Rule>)>,
    /// Write the table reads (`--no-rule-reads`: not, the stream otherwise the same).
    rule_reads: bool,
    /// Event time of the last refusal counts, and the hold going on (its acquire time).
    last_refusals: u64,
    hold_now: u64,
}

/// Services in the generated nat table.
const SERVICES: usize = 100;

/// A kube-proxy nat table of `SERVICES` services, one endpoint each.
fn nat_table() -> Vec<(String, Vec<Rule>)> {
    let rule = |parts: &[&str]| Rule(parts.iter().map(|s| s.to_string()).collect());
    let mut services = Vec::new();
    let mut chains = Vec::new();
    for i in 0..SERVICES {
        let svc = format!("KUBE-SVC-{i:016X}");
        let sep = format!("KUBE-SEP-{i:016X}");
        let ip = format!("10.96.{}.{}/32", i / 200, i % 200 + 1);
        let comment = format!("\"default/svc-{i}:http cluster IP\"");
        services.push(rule(&[
            "-d",
            &ip,
            "-p",
            "tcp",
            "-m",
            "comment",
            "--comment",
            &comment,
            "-m",
            "tcp",
            "--dport",
            "80",
            "-j",
            &svc,
        ]));
        chains.push((
            svc,
            vec![rule(&["-m", "comment", "--comment", &comment, "-j", &sep])],
        ));
        let pod = format!("10.244.{}.{}:8080", i / 200, i % 200 + 2);
        chains.push((
            sep,
            vec![
                rule(&["-s", "10.244.0.0/32", "-j", "KUBE-MARK-MASQ"]),
                rule(&[
                    "-p",
                    "tcp",
                    "-m",
                    "tcp",
                    "-j",
                    "DNAT",
                    "--to-destination",
                    &pod,
                ]),
            ],
        ));
    }
    chains.insert(0, ("KUBE-SERVICES".into(), services));
    chains
}

impl<W: io::Write> Gen<W> {
    fn kernel<T: Copy>(&mut self, ev: &T) -> Result<()> {
        self.w.write_kernel(bytes(ev))?;
        self.n += 1;
        Ok(())
    }

    fn tick(&mut self, max_ns: u64) -> u64 {
        self.ts += 1 + self.rng.below(max_ns);
        self.ts
    }

    fn pid(&mut self) -> u32 {
        // Other processes take pids in between; pid_max wraps as on a real node.
        self.next_pid += 1 + self.rng.below(40) as u32;
        if self.next_pid > 4_194_000 {
            self.next_pid = 2000;
        }
        self.next_pid
    }

    /// A kernel address for a `struct file`, as `fl_owner` is.
    fn owner(&mut self) -> u64 {
        0xffff_8880_0000_0000 | (self.rng.below(1 << 30) << 6)
    }

    fn fork(&mut self, parent: u32, parent_tid: u32, child: u32, pcomm: &str) -> Result<()> {
        let ts = self.tick(200_000);
        self.kernel(&c::ForkEvent {
            hdr: hdr(c::EventKind::Fork, parent, parent_tid, ts),
            child_tid: child,
            _pad: 0,
            comm: comm(pcomm),
        })
    }

    fn exec(&mut self, pid: u32, filename: &str, argv: &[&str], comm_: &str) -> Result<()> {
        let ts = self.tick(1_500_000);
        let mut e = c::ExecEvent {
            hdr: hdr(c::EventKind::Exec, pid, pid, ts),
            filename: [0; c::FILENAME_LEN],
            args: [[0; c::ARG_LEN]; c::ARGV_SLOTS],
            argc: argv.len().min(c::ARGV_SLOTS) as u32,
            args_truncated: u32::from(argv.len() > c::ARGV_SLOTS),
            comm: comm(comm_),
            netns: 0,
            _pad: 0,
        };
        let n = filename.len().min(c::FILENAME_LEN - 1);
        e.filename[..n].copy_from_slice(&filename.as_bytes()[..n]);
        for (slot, a) in e.args.iter_mut().zip(argv) {
            let n = a.len().min(c::ARG_LEN - 1);
            slot[..n].copy_from_slice(&a.as_bytes()[..n]);
        }
        self.kernel(&e)
    }

    fn exit(&mut self, pid: u32, tid: u32, code: Option<i32>, comm_: &str) -> Result<()> {
        let ts = self.tick(300_000);
        self.kernel(&c::ExitEvent {
            hdr: hdr(c::EventKind::Exit, pid, tid, ts),
            exit_code: code.unwrap_or(0),
            has_code: u32::from(code.is_some()),
            comm: comm(comm_),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn lock(
        &mut self,
        pid: u32,
        owner: u64,
        fl_type: u8,
        ret: i32,
        flags: u32,
        comm_: &str,
        gap: u64,
    ) -> Result<u64> {
        let ts = self.tick(gap);
        self.kernel(&c::LockEvent {
            hdr: hdr(c::EventKind::Lock, pid, pid, ts),
            owner,
            ino: LOCK_INO,
            dev: LOCK_DEV,
            ret,
            fl_flags: flags,
            fl_type,
            _pad: [0; 3],
            comm: comm(comm_),
        })?;
        Ok(ts)
    }

    fn call(&mut self, pid: u32, owner: u64, enter_ns: u64, ret: i64, cmd: u32) -> Result<()> {
        let ts = self.tick(20_000);
        self.kernel(&c::FlockCallEvent {
            hdr: hdr(c::EventKind::FlockCall, pid, pid, ts),
            enter_ns,
            owner,
            ino: LOCK_INO,
            ret,
            cmd,
            dev: LOCK_DEV,
        })
    }

    fn replace(&mut self, pid: u32) -> Result<()> {
        let enter = self.tick(500_000);
        let ts = self.tick(3 * MS);
        let optlen = 20_000 + self.rng.below(400_000) as u32;
        self.kernel(&c::TableReplaceEvent {
            hdr: hdr(c::EventKind::TableReplace, pid, pid, ts),
            enter_ns: enter,
            ret: 0,
            level: c::SOL_IP,
            optname: c::XT_SO_SET_REPLACE,
            optlen,
            _pad: 0,
            table: {
                let mut t = [0u8; c::XT_TABLE_MAXNAMELEN];
                t[..3].copy_from_slice(b"nat");
                t
            },
            num_entries: optlen / 150,
            size: optlen,
            head_ok: 1,
            dir: 0,
            netns: 4026531840,
            _pad2: 0,
        })
    }

    /// One short-lived iptables run; sometimes a second one waits behind it, or polls.
    fn iptables_run(&mut self) -> Result<()> {
        const BLOCKING: u32 = 128 | 2; // FL_SLEEP | FL_FLOCK
        let a = &AGENTS[self.rng.below(AGENTS.len() as u64) as usize];
        let argv = a.cmds[self.rng.below(a.cmds.len() as u64) as usize];
        let pid = self.pid();
        let thread = a.pid + 1 + self.rng.below(30) as u32;
        let file = format!("/usr/sbin/{}", argv[0].trim_start_matches("/usr/sbin/"));
        let tool: String = argv[0]
            .trim_start_matches("/usr/sbin/")
            .chars()
            .take(15)
            .collect();
        self.fork(a.pid, thread, pid, a.comm)?;
        self.exec(pid, &file, argv, &tool)?;
        let owner = self.owner();
        let enter = self.tick(300_000);
        self.lock(pid, owner, c::F_WRLCK, 0, BLOCKING, &tool, 2_000)?;
        self.call(pid, owner, enter, 0, c::LOCK_EX)?;

        // Contention: someone else arrives while the lock is held.
        let other = match self.rng.below(100) {
            0..=14 => Some(true),   // blocks (iptables -w)
            15..=19 => Some(false), // polls with LOCK_NB (Go daemons)
            _ => None,
        };
        let mut waiter = None;
        if let Some(blocking) = other {
            let b = &AGENTS[self.rng.below(AGENTS.len() as u64) as usize];
            let wpid = self.pid();
            let wtool = if blocking { "iptables" } else { b.comm };
            if blocking {
                self.fork(b.pid, b.pid + 1, wpid, b.comm)?;
                self.exec(
                    wpid,
                    "/usr/sbin/iptables",
                    &["iptables", "-w", "5", "-L"],
                    wtool,
                )?;
            }
            let lpid = if blocking { wpid } else { b.pid };
            let wowner = self.owner();
            let wenter = self.tick(100_000);
            if blocking {
                self.lock(
                    lpid,
                    wowner,
                    c::F_WRLCK,
                    c::FILE_LOCK_DEFERRED,
                    BLOCKING,
                    wtool,
                    1_000,
                )?;
            } else {
                for _ in 0..1 + self.rng.below(4) {
                    let e = self.tick(50_000);
                    self.lock(lpid, wowner, c::F_WRLCK, -11, 2, wtool, 1_000)?;
                    self.call(lpid, wowner, e, -11, c::LOCK_EX | c::LOCK_NB)?;
                }
            }
            waiter = Some((blocking, lpid, wowner, wenter, wtool, b.comm));
        }

        for _ in 0..1 + self.rng.below(2) {
            self.replace(pid)?;
        }
        self.hold_now = enter;
        self.refusals()?;
        // Released by the exit (close of the last fd).
        self.lock(pid, owner, c::F_UNLCK, 0, 2, &tool, 200_000)?;
        self.hold_now = 0;
        self.exit(pid, pid, Some(0), &tool)?;
        if a.comm == "kube-proxy" && argv[0] == "iptables-restore" {
            self.rule_table(pid)?;
        }

        if let Some((blocking, lpid, wowner, wenter, wtool, _)) = waiter {
            let e = if blocking { wenter } else { self.tick(50_000) };
            let flags = if blocking { BLOCKING } else { 2 };
            let cmd = if blocking {
                c::LOCK_EX
            } else {
                c::LOCK_EX | c::LOCK_NB
            };
            self.lock(lpid, wowner, c::F_WRLCK, 0, flags, wtool, 10_000)?;
            self.call(lpid, wowner, e, 0, cmd)?;
            if !blocking {
                self.replace(lpid)?;
            }
            self.lock(lpid, wowner, c::F_UNLCK, 0, 2, wtool, 2 * MS)?;
            if blocking {
                self.exit(lpid, lpid, Some(0), wtool)?;
            }
        }
        Ok(())
    }

    /// An unrelated program or thread coming and going.
    fn noise(&mut self) -> Result<()> {
        let a = &AGENTS[self.rng.below(AGENTS.len() as u64) as usize];
        if self.rng.chance(40) {
            // A thread of a daemon.
            let tid = self.pid();
            self.fork(a.pid, a.pid, tid, a.comm)?;
            let ts = self.tick(5 * MS);
            return self.kernel(&c::ExitEvent {
                hdr: hdr(c::EventKind::Exit, a.pid, tid, ts),
                exit_code: 0,
                has_code: 1,
                comm: comm(a.comm),
            });
        }
        let (file, name) = OTHERS[self.rng.below(OTHERS.len() as u64) as usize];
        let pid = self.pid();
        self.fork(a.pid, a.pid, pid, a.comm)?;
        let arg = format!("--id={:x}", self.rng.next());
        self.exec(pid, file, &[name, "-c", &arg], name)?;
        let code = (!self.rng.chance(3)).then_some(0);
        self.exit(pid, pid, code, name)
    }

    /// A Go daemon polling the lock with `LOCK_NB` while someone else holds it: failed tries.
    fn poll(&mut self, pids: &[(u32, u64)]) -> Result<()> {
        let (pid, owner) = pids[self.rng.below(pids.len() as u64) as usize];
        let comm = AGENTS
            .iter()
            .find(|a| a.pid == pid)
            .map_or("calico-node", |a| a.comm);
        for _ in 0..1 + self.rng.below(3) {
            let enter = self.tick(200_000);
            self.lock(pid, owner, c::F_WRLCK, -11, 2, comm, 2_000)?;
            self.call(pid, owner, enter, -11, c::LOCK_EX | c::LOCK_NB)?;
        }
        Ok(())
    }

    /// The read of kube-proxy's nat table after its restore: one or two services' endpoints
    /// moved, every other chain sent as its digest, as the source does.
    fn rule_table(&mut self, pid: u32) -> Result<()> {
        let first = self.nat.is_empty();
        if first {
            self.nat = nat_table();
        }
        let mut changed = vec![false; self.nat.len()];
        for _ in 0..1 + self.rng.below(2) {
            let i = 1 + 2 * self.rng.below(SERVICES as u64) as usize + 1;
            let port = 1024 + self.rng.below(60_000);
            if let Some(r) = self.nat[i].1.get_mut(1) {
                if let Some(to) = r.0.last_mut() {
                    *to = format!("10.244.{}.{}:{port}", i / 400, i % 200 + 2);
                }
                changed[i] = true;
            }
        }
        let ts = self.tick(5 * MS);
        if !self.rule_reads {
            return Ok(());
        }
        let chains = self
            .nat
            .iter()
            .zip(&changed)
            .map(|((name, rules), &ch)| ChainState {
                name: name.as_str().into(),
                policy: None,
                digest: digest_rules(rules),
                rules: (first || ch).then(|| rules.clone()),
            })
            .collect();
        self.synthetic(&Event::RuleTable(Box::new(RuleTable {
            ts_ns: ts,
            netns: 4026531840,
            family: "ip".into(),
            table: "nat".into(),
            after_pid: pid,
            skipped: String::new(),
            chains,
            more: false,
        })))
    }

    /// About once a second of event time: refusal samples, and the counts of the second
    /// (clients of a service with no endpoints, refused by its REJECT rule).
    fn refusals(&mut self) -> Result<()> {
        if self.ts < self.last_refusals + 1_000_000_000 {
            return Ok(());
        }
        let interval = self.ts - self.last_refusals;
        self.last_refusals = self.ts;
        let mut counts = Vec::new();
        for _ in 0..1 + self.rng.below(3) {
            let svc = self.rng.below(SERVICES as u64) as u8;
            let daddr = [10, 96, 0, svc + 1];
            for _ in 0..2 {
                let ts = self.tick(100_000);
                let mut d = [0u8; 16];
                d[..4].copy_from_slice(&daddr);
                let mut s = [0u8; 16];
                s[..4].copy_from_slice(&[10, 0, 0, 9]);
                let sport = 40_000 + self.rng.below(20_000) as u16;
                self.kernel(&c::RefusalEvent {
                    hdr: hdr(c::EventKind::Refusal, 0, 0, ts),
                    hold_start_ns: self.hold_now,
                    netns: 4026531840,
                    detail: 3,
                    kind: c::REFUSAL_ICMP_UNREACH,
                    family: c::DROP_FAMILY_INET,
                    l4proto: 6,
                    _pad: 0,
                    sport,
                    dport: 80,
                    saddr: s,
                    daddr: d,
                })?;
            }
            counts.push(RefusalCount {
                hold_start_ns: self.hold_now,
                netns: 4026531840,
                kind: c::REFUSAL_ICMP_UNREACH,
                detail: 3,
                addr: Some(std::net::IpAddr::from(daddr)),
                port: 80,
                count: 2 + self.rng.below(50),
            });
        }
        let ts = self.tick(1_000);
        self.synthetic(&Event::RefusalCounts(RefusalCounts {
            ts_ns: ts,
            interval_ns: interval,
            counts,
            overflow: 0,
            reset_reasons: Vec::new(),
        }))
    }

    fn synthetic(&mut self, ev: &Event) -> Result<()> {
        self.w.write_synthetic(ev)?;
        self.n += 1;
        Ok(())
    }

    /// The `holds` stream: a `Hold` record a cycle (take and release, no flock returns: the
    /// kernel side sends those only for calls that waited).
    fn hold_cycle(&mut self, pids: &[(u32, u64)]) -> Result<()> {
        let (pid, owner) = pids[self.rng.below(pids.len() as u64) as usize];
        let take_ts = self.tick(50_000);
        let ts = self.tick(2 * MS);
        self.kernel(&c::HoldEvent {
            hdr: hdr(c::EventKind::Hold, pid, pid, ts),
            take: c::LockEvent {
                hdr: hdr(c::EventKind::Lock, pid, pid, take_ts),
                owner,
                ino: LOCK_INO,
                dev: LOCK_DEV,
                ret: 0,
                fl_flags: 130,
                fl_type: c::F_WRLCK,
                _pad: [0; 3],
                comm: comm("kube-proxy"),
            },
            ret: 0,
            fl_flags: 130,
            comm: comm("kube-proxy"),
        })?;
        // A Hold record is two events.
        self.n += 1;
        Ok(())
    }

    /// The `lock` stream: take, flock return, release (LOCK_UN), flock return.
    fn lock_cycle(&mut self, pids: &[(u32, u64)]) -> Result<()> {
        let (pid, owner) = pids[self.rng.below(pids.len() as u64) as usize];
        let enter = self.tick(50_000);
        self.lock(pid, owner, c::F_WRLCK, 0, 130, "kube-proxy", 2_000)?;
        self.call(pid, owner, enter, 0, c::LOCK_EX)?;
        let enter = self.tick(2 * MS);
        self.lock(pid, owner, c::F_UNLCK, 0, 130, "kube-proxy", 2_000)?;
        self.call(pid, owner, enter, 0, c::LOCK_UN)
    }
}

fn seeds(ts: u64) -> Vec<ProcInfo> {
    let mut v = vec![ProcInfo {
        ts_ns: ts,
        pid: 1,
        ppid: 0,
        comm: Comm::new("systemd"),
        argv: vec!["/sbin/init".into()],
        cgroup: Some("/init.scope".into()),
        exe: None,
    }];
    for a in AGENTS {
        v.push(ProcInfo {
            ts_ns: ts,
            pid: a.pid,
            ppid: 1,
            comm: Comm::new(a.comm),
            argv: vec![format!("/usr/local/bin/{}", a.comm), "--v=2".into()],
            cgroup: Some(format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{:064x}.scope",
                a.pid, a.pid
            )),
            exe: None,
        });
    }
    v
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn gen(path: &Path, args: &[String]) -> Result<()> {
    let events: u64 = arg(args, "--events").unwrap_or("10000000").parse()?;
    let mix = arg(args, "--mix").unwrap_or("node");
    let seed: u64 = arg(args, "--seed").unwrap_or("42").parse()?;
    let header = CaptureHeader {
        xtlock_version: "bench".into(),
        hostname: "bench-node".into(),
        kernel_release: "synthetic".into(),
        locks: vec![CaptureLock {
            path: LOCK_PATH.into(),
            dev: LOCK_DEV,
            ino: LOCK_INO,
        }],
        ..Default::default()
    };
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let w = CaptureWriter::new(file, &header)?;
    let mut g = Gen {
        w,
        rng: Rng(seed.max(1)),
        ts: 1_000_000_000_000,
        next_pid: 5000,
        n: 0,
        nat: Vec::new(),
        rule_reads: !args.iter().any(|a| a == "--no-rule-reads"),
        last_refusals: 1_000_000_000_000,
        hold_now: 0,
    };
    for p in seeds(g.ts) {
        g.w.write_proc(&p)?;
    }
    let lockers: Vec<(u32, u64)> = (0..4).map(|i| (1100 + i * 100, g.owner())).collect();
    let t = Instant::now();
    while g.n < events {
        match mix {
            "node" => match g.rng.below(100) {
                0..=9 => g.iptables_run()?,
                10..=24 => g.poll(&lockers)?,
                _ => g.noise()?,
            },
            "iptables" => g.iptables_run()?,
            "lock" => g.lock_cycle(&lockers)?,
            "holds" => g.hold_cycle(&lockers)?,
            m => bail!("unknown --mix {m} (node, iptables, lock or holds)"),
        }
    }
    let stats = g.w.finish()?;
    println!(
        "{{\"mix\":\"{mix}\",\"events\":{},\"bytes\":{},\"raw_bytes\":{},\"header_bytes\":{},\"bytes_per_event\":{:.3},\"gen_s\":{:.3}}}",
        stats.kernel_events,
        stats.bytes_on_disk,
        stats.raw_bytes,
        stats.header_bytes,
        stats.bytes_per_kernel_event().unwrap_or(0.0),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `VmHWM` (peak resident set) of this process, in KiB.
fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn run(path: &Path, args: &[String]) -> Result<()> {
    let stage = arg(args, "--stage").unwrap_or("analyse");
    let (header, mut reader) = CaptureReader::open(path)?;
    let locks: Vec<WatchedLock> = header
        .locks
        .iter()
        .map(|l| WatchedLock::new(l.path.clone(), l.dev, l.ino))
        .collect();
    let mut analyzer = Analyzer::new(locks);
    let mut sink = JsonSink::new(io::sink());
    let mut events = 0u64;
    let mut facts = 0u64;
    let mut errors = 0u64;
    let mut checksum = 0u64;
    let mut last_ts = 0;
    let allocs0 = ALLOCS.load(Ordering::Relaxed);
    let cpu0 = cpu_ns();
    let t = Instant::now();
    match stage {
        "read" => {
            while let Some(r) = reader.next_record() {
                match r? {
                    Record::Kernel(b) => {
                        events += 1;
                        checksum = checksum.wrapping_add(b.len() as u64);
                    }
                    Record::End(_) => break,
                    _ => events += 1,
                }
            }
        }
        "decode" | "analyse" | "json" => {
            let analyse = stage != "decode";
            let json = stage == "json";
            let mut io_err = None;
            for ev in reader.events() {
                let ev = match ev {
                    Ok(ev) => ev,
                    Err(e) if e.is_recoverable() => {
                        errors += 1;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                events += 1;
                last_ts = ev.ts_ns();
                if !analyse {
                    checksum = checksum.wrapping_add(last_ts);
                    continue;
                }
                analyzer.process(&ev, &mut |o| {
                    facts += 1;
                    if json {
                        if let Err(e) = sink.output(&o) {
                            io_err = Some(e);
                        }
                    }
                });
            }
            if analyse {
                analyzer.finish(last_ts, &mut |o| {
                    facts += 1;
                    if json {
                        let _ = sink.output(&o);
                    }
                });
                let s = analyzer.summary();
                if json {
                    sink.summary(&s, true)?;
                    sink.flush()?;
                }
                checksum = s.events;
            }
            if let Some(e) = io_err {
                return Err(e.into());
            }
        }
        "kinds" => {
            // Where the analysis spends: allocations and time per event kind (Instant per
            // event: slower than `analyse`, for the breakdown only).
            let mut by: std::collections::BTreeMap<&str, (u64, u64, u64, u64)> = Default::default();
            for ev in reader.events() {
                let Ok(ev) = ev else { continue };
                events += 1;
                let kind = match &ev {
                    Event::Lock(l) => match l.op {
                        LockOp::Acquired { .. } => "lock acquired",
                        LockOp::Released => "lock released",
                        LockOp::Deferred => "lock deferred",
                        LockOp::Failed { .. } => "lock failed try",
                    },
                    Event::FlockCall(_) => "flock return",
                    Event::Exec(_) => "exec",
                    Event::Fork(f) if f.parent_tgid == f.child_tid => "fork",
                    Event::Fork(_) => "fork",
                    Event::Exit(e) if e.tid != e.tgid => "exit (thread)",
                    Event::Exit(_) => "exit",
                    Event::TableReplace(_) => "table replace",
                    Event::Proc(_) => "proc",
                    Event::RuleTable(_) => "rule table read",
                    Event::RefusalCounts(_) => "refusal counts",
                    Event::Refusal(_) => "refusal",
                    _ => "other",
                };
                let a0 = ALLOCS.load(Ordering::Relaxed);
                let t0 = Instant::now();
                let mut n = 0u64;
                analyzer.process(&ev, &mut |_| n += 1);
                let dt = t0.elapsed().as_nanos() as u64;
                let e = by.entry(kind).or_default();
                e.0 += 1;
                e.1 += ALLOCS.load(Ordering::Relaxed) - a0;
                e.2 += dt;
                e.3 += n;
                facts += n;
            }
            for (k, (n, a, ns, f)) in &by {
                eprintln!(
                    "{k:<16} {n:>10} events  {:>7.2} allocs/event  {:>7.0} ns/event  {:>5.2} facts/event  {:>5.1}% of the time",
                    *a as f64 / *n as f64,
                    *ns as f64 / *n as f64,
                    *f as f64 / *n as f64,
                    *ns as f64 * 100.0 / by.values().map(|v| v.2).sum::<u64>() as f64
                );
            }
        }
        s => bail!("unknown --stage {s} (read, decode, analyse, json, kinds)"),
    }
    let wall = t.elapsed().as_nanos() as u64;
    let cpu = cpu_ns() - cpu0;
    let allocs = ALLOCS.load(Ordering::Relaxed) - allocs0;
    println!(
        "{{\"stage\":\"{stage}\",\"events\":{events},\"facts\":{facts},\"decode_errors\":{errors},\
         \"cpu_ns\":{cpu},\"wall_ns\":{wall},\"vm_hwm_kib\":{},\"allocs\":{allocs},\
         \"allocs_per_event\":{:.4},\"check\":{checksum}}}",
        vm_hwm_kib(),
        allocs as f64 / events.max(1) as f64
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [cmd, path, rest @ ..] if cmd == "gen" => gen(Path::new(path), rest),
        [cmd, path, rest @ ..] if cmd == "run" => run(Path::new(path), rest),
        _ => bail!(
            "usage: bench_collector gen PATH --events N [--mix node|iptables|lock] | run PATH --stage read|decode|analyse|json"
        ),
    }
}
