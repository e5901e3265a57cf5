//! The nftables-era lock against the real kernel: a kube-proxy-shaped `nft -f` transaction
//! (table `kube-proxy`, tens of thousands of rules) holds a private netns's nf_tables commit
//! mutex while other agents' small transactions (the real `nft` and `iptables-nft-restore`)
//! queue behind it; `xtlock trace --json --record` and `xtlock report` of its capture against
//! bpftrace on the same tracepoints (`lock:contention_begin`/`contention_end`).
//!
//! bpftrace knows a mutex from the kernel stack of its first wait, by function name: the
//! commit mutex is the one `nf_tables_valid_genid` waits on, nfnetlink's nf_tables mutex
//! the one `nfnetlink_rcv_batch` waits on itself. xtlock knows them otherwise (the netns's
//! pernet data and BTF; a stack read against kallsyms ranges only to learn what the
//! kernel does not list), so the two agree only if both are right.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use xtlock_tests::{
    in_ci, in_vm, report_events, require_bpf, serial, sh, skip_on_this_kernel, write_file, Agent,
    Scratch, Trace, Tracer,
};

const T: Duration = Duration::from_secs(120);
const NETNS: &str = "x42mtx";
/// Rules in the kube-proxy transaction: long enough to hold the mutex for a few hundred ms
/// on a host; a quarter in the QEMU/TCG guests, where a rule costs ~100 times more (40,000 took
/// over 2 minutes there, 4,000 about 1 s under the tracers).
fn rules() -> usize {
    if in_vm() {
        10_000
    } else {
        40_000
    }
}

/// A private network namespace, deleted on drop (with its tables).
struct Netns(&'static str);

impl Netns {
    fn new(name: &'static str) -> Self {
        let _ = Command::new("ip")
            .args(["netns", "del", name])
            .stderr(Stdio::null())
            .status();
        sh("ip", &["netns", "add", name]);
        Netns(name)
    }

    fn inode(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(format!("/run/netns/{}", self.0))
            .expect("netns file")
            .ino()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", self.0]).status();
    }
}

/// One wait as bpftrace saw it.
#[derive(Clone, Debug)]
struct TruthWait {
    tid: u32,
    lock: u64,
    start: u64,
    end: u64,
    /// The mutex's owner at the first `contention_begin`: its process id; 0 when free.
    owner_tgid: u32,
    comm: String,
}

/// One `sendmsg()` (an nf_tables batch) as bpftrace saw it.
#[derive(Clone, Debug)]
struct TruthSend {
    tid: u32,
    enter: u64,
    exit: u64,
    comm: String,
}

/// bpftrace: every mutex wait of a task in netns `ino` (and of every kernel worker: nf_tables'
/// set garbage collection takes the netns's commit mutex from one), from its first `contention_begin`
/// to its `contention_end` on the same lock, with the owner at the start; and per lock the
/// stack of its waits (the caller of `mutex_lock` names the mutex).
struct Truth {
    child: Child,
    reader: std::thread::JoinHandle<String>,
}

impl Truth {
    fn start(ino: u64) -> Self {
        let script = format!(
            r#"tracepoint:lock:contention_begin /(args->flags & 32) &&
                 (@start[tid] == 0 || @addr[tid] != (uint64)args->lock_addr) &&
                 (curtask->nsproxy->net_ns->ns.inum == {ino} ||
                  strncmp(comm, "kworker/", 8) == 0)/ {{
               @start[tid] = nsecs; @addr[tid] = (uint64)args->lock_addr;
               @own[tid] = ((struct task_struct *)(((struct mutex *)args->lock_addr)->owner.counter & ~7))->tgid;
               @callers[args->lock_addr, kstack(6)] = count();
             }}
             tracepoint:lock:contention_end /@start[tid] != 0 && @addr[tid] == (uint64)args->lock_addr/ {{
               printf("W %u %llx %llu %llu %u %s\n", tid, args->lock_addr, @start[tid], nsecs, @own[tid], comm);
               delete(@start[tid]); delete(@addr[tid]); delete(@own[tid]);
             }}
             tracepoint:syscalls:sys_enter_sendmsg /curtask->nsproxy->net_ns->ns.inum == {ino}/ {{
               @send[tid] = nsecs;
             }}
             tracepoint:syscalls:sys_exit_sendmsg /@send[tid] != 0/ {{
               printf("S %u %llu %llu %s\n", tid, @send[tid], nsecs, comm);
               delete(@send[tid]);
             }}
             interval:ms:500 {{ print(@callers); }}
             BEGIN {{ printf("ready\n"); }}"#
        );
        // Line-buffered: killed at the end, it would lose what a pipe's buffer holds.
        // BEGIN runs once every probe is attached.
        let (child, reader) =
            xtlock_tests::spawn_bpftrace(&["-B", "line", "-e", &script], |l| l == "ready");
        Truth { child, reader }
    }

    /// The waits, and which lock address is which mutex (from the last print of the
    /// callers, after the workload).
    fn finish(mut self) -> (Vec<TruthWait>, Vec<TruthSend>, HashMap<u64, &'static str>) {
        std::thread::sleep(Duration::from_millis(1200));
        let _ = self.child.kill();
        let _ = self.child.wait();
        let reader = std::mem::replace(&mut self.reader, std::thread::spawn(String::new));
        let text = reader.join().unwrap_or_default();
        let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
        let waits = text
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.strip_prefix("W ")?.split_whitespace().collect();
                Some(TruthWait {
                    tid: w.first()?.parse().ok()?,
                    lock: hex(w.get(1)?)?,
                    start: w.get(2)?.parse().ok()?,
                    end: w.get(3)?.parse().ok()?,
                    owner_tgid: w.get(4)?.parse().ok()?,
                    comm: w.get(5)?.to_string(),
                })
            })
            .collect();
        // `@callers[0xADDR, \n frame\n frame\n...]: N`: the caller is the frame after the
        // mutex's own functions (tracing's own frames may come before them).
        let mut kinds = HashMap::new();
        let mut block: Option<(u64, Vec<&str>)> = None;
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("@callers[") {
                block = rest
                    .split(',')
                    .next()
                    .and_then(hex)
                    .map(|a| (a, Vec::new()));
                continue;
            }
            let f = l.trim();
            let Some((addr, frames)) = block.as_mut() else {
                continue;
            };
            if !f.starts_with(']') && !f.is_empty() {
                frames.push(f);
                continue;
            }
            let is_mutex = |f: &&str| f.starts_with("__mutex_lock") || f.starts_with("mutex_lock");
            let caller = frames
                .iter()
                .rposition(is_mutex)
                .and_then(|i| frames.get(i + 1));
            match caller {
                Some(c) if c.starts_with("nf_tables_valid_genid+") => {
                    kinds.insert(*addr, "commit");
                }
                Some(c) if c.starts_with("nfnetlink_rcv_batch+") => {
                    kinds.insert(*addr, "nfnl");
                }
                _ => {}
            }
            block = None;
        }
        let sends = text
            .lines()
            .filter_map(|l| {
                let w: Vec<&str> = l.strip_prefix("S ")?.split_whitespace().collect();
                Some(TruthSend {
                    tid: w.first()?.parse().ok()?,
                    enter: w.get(1)?.parse().ok()?,
                    exit: w.get(2)?.parse().ok()?,
                    comm: w.get(3)?.to_string(),
                })
            })
            .collect();
        (waits, sends, kinds)
    }
}

impl Drop for Truth {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn u(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not an unsigned number: {v}"))
}

/// A kube-proxy-nftables-shaped ruleset: one table `kube-proxy`, a services chain with
/// `rules` service rules.
fn kube_proxy_nft(rules: usize) -> String {
    let mut s = String::from("table ip kube-proxy {\n chain services {\n");
    for i in 0..rules {
        s.push_str(&format!(
            "  ip daddr 10.{}.{}.{} tcp dport {} counter accept\n",
            96 + (i >> 16),
            (i >> 8) & 255,
            i & 255,
            1000 + i % 50_000
        ));
    }
    s.push_str(" }\n}\n");
    s
}

/// Each process named one of `comms`: its pid, state and kernel stack (for a hang).
fn kernel_stacks(comms: &[&str]) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let p = e.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !comms.contains(&comm.trim()) {
            continue;
        }
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        let stack = std::fs::read_to_string(p.join("stack")).unwrap_or_default();
        out.push_str(&format!("{stat}\n{stack}\n"));
    }
    out
}

/// Whether `prog` runs (`prog --version`); a missing tool fails under CI.
fn have(prog: &str, test: &str) -> bool {
    let ok = Command::new(prog)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let why = format!("{test}: {prog} is not installed");
        assert!(!in_ci(), "{why}; CI=true, so this is a failure, not a skip");
        eprintln!("skipped: {why}");
    }
    ok
}

/// How far apart the two tools' clocks of one event may read: 2 ms on a host. In the TCG
/// guests 20 ms: CI runs two guests of 2 vCPUs on 2 cores, so a vCPU's host thread is often
/// not running for milliseconds between xtlock's program and bpftrace's (seen: 3-9 ms).
fn slack() -> u64 {
    if in_vm() {
        20_000_000
    } else {
        2_000_000
    }
}

/// Within 5 % or [`slack`].
fn close(got: u64, want: u64) -> bool {
    got.abs_diff(want) <= slack() || got.abs_diff(want) as f64 <= want as f64 * 0.05
}

/// kube-proxy's big transaction holds the commit mutex; calico-node's `nft` and firewalld's
/// `iptables-nft-restore` wait. Every wait xtlock reports on the commit mutex and on
/// nfnetlink's mutex is one bpftrace saw, with the same holder at its start; the counts and
/// the longest waits agree; the capture replays to the same waits.
#[test]
fn small_transactions_wait_behind_kube_proxys_commit() {
    const TEST: &str = "small_transactions_wait_behind_kube_proxys_commit";
    if !can_run(TEST) {
        return;
    }
    let _g = serial();
    let setup = Setup::new();
    // xtlock before bpftrace: see `start_xtlock`.
    let tracer = start_xtlock(&setup.cap);
    let truth = Truth::start(setup.ino);
    let gc_pid = expire_set_elements(&setup);
    let small_transactions = run_transactions(&setup);
    show_recursion_misses();
    let (waits, sends, kinds) = truth.finish();
    tracer.interrupt();
    let trace = tracer.finish();
    let dump = trace.dump();

    let truth = Seen::new(waits, sends, kinds);
    let xt = XtWaits::new(&trace, setup.ino);
    require_a_commit_wait(&xt, &truth, small_transactions);
    check_waits(&xt, &truth, &dump);
    check_nfnl_links(&xt, &truth, &trace, &dump);
    let xt_kworker = check_kernel_worker_waits(&xt, &truth, &trace);
    let holds = check_holds(&xt, &truth, &trace, gc_pid);
    check_batches(&holds, &dump);
    check_behind_kube_proxy(&xt, &dump);
    check_replay(&setup.cap, &xt, &xt_kworker, &holds);
}

/// The agents, as xtlock names them.
const AGENTS: [&str; 3] = ["kube-proxy", "calico-node", "firewalld"];
/// The comms of the agents' transactions (`iptables-nft-restore`, cut to 15 bytes).
const TRANSACTION_COMMS: [&str; 2] = ["nft", "iptables-nft-re"];
/// nfnetlink's nf_tables mutex, as xtlock names it.
const NFNL_LOCK: &str = "nfnetlink nf_tables mutex";

/// Whether this machine can run the test; under CI a missing tool or capability fails.
fn can_run(test: &str) -> bool {
    if !require_bpf(test) || !have("nft", test) || !have("iptables-nft-restore", test) {
        return false;
    }
    if !Path::new("/sys/kernel/tracing/events/lock/contention_begin").exists() {
        skip_on_this_kernel(test, "lock:contention_begin (Linux >= 5.19)");
        return false;
    }
    have("bpftrace", test)
}

/// The private netns, the rulesets and the agents' binaries.
struct Setup {
    // Fields drop in order: the netns (and its tables) before the scratch directory.
    _ns: Netns,
    s: Scratch,
    ino: u64,
    /// kube-proxy's `nft -f` file.
    big: PathBuf,
    /// firewalld's `iptables-nft-restore` input.
    small: PathBuf,
    kube_proxy: PathBuf,
    calico: PathBuf,
    firewalld: PathBuf,
    /// xtlock's capture.
    cap: PathBuf,
}

impl Setup {
    fn new() -> Self {
        let s = Scratch::new("nft-mutex");
        let ns = Netns::new(NETNS);
        let ino = ns.inode();
        let big = write_file(&s.dir, "kube-proxy.nft", &kube_proxy_nft(rules()));
        let small = write_file(
            &s.dir,
            "firewalld.rules",
            "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p tcp --dport 22 -j ACCEPT\nCOMMIT\n",
        );
        let kube_proxy = s.agent("kube-proxy");
        let calico = s.agent("calico-node");
        let firewalld = s.agent("firewalld");
        let cap = s.dir.join("nft.xtlock");
        Setup {
            _ns: ns,
            ino,
            big,
            small,
            kube_proxy,
            calico,
            firewalld,
            cap,
            s,
        }
    }
}

/// `xtlock trace --json --record cap`, started before bpftrace: its programs then run before
/// bpftrace's on the tracepoints, and the two reads of a mutex's owner are as close as can be
/// (bpftrace's program is the slower).
fn start_xtlock(cap: &Path) -> Tracer {
    Tracer::start(
        &[],
        Duration::from_secs(if in_vm() { 300 } else { 30 }),
        // No reads of the tables after writes: xtlock would enter the netns and take its
        // commit mutex itself (closing its netlink socket does), one more agent in line.
        // In the VMs, no function hooks: the holds are then timed from each batch's
        // sendmsg(), as the truth times them (as on this test's host); where nft_commit
        // attaches it times the kernel's batch function instead, milliseconds later under
        // TCG (kernel_hooks checks those holds).
        &[
            &[
                "--no-drops",
                "--no-rule-reads",
                "--record",
                cap.to_str().unwrap(),
            ][..],
            if in_vm() {
                &["--no-attach", "fentry,kprobe"][..]
            } else {
                &[]
            },
        ]
        .concat(),
    )
}

/// nf_tables' set garbage collection: elements expiring all through kube-proxy's
/// transaction (one every ms from 0.3 s to 8 s; every 4 ms, to 31 s, in the TCG guests,
/// where nft takes seconds to parse kube-proxy's file before it sends it), collected every
/// 100 ms by a kernel worker that takes the netns's commit mutex to remove them, from the
/// initial netns. The pid of the `nft` that added them.
fn expire_set_elements(setup: &Setup) -> u32 {
    let every_ms = if in_vm() { 4 } else { 1 };
    let elements: Vec<String> = (0..7_700)
        .map(|i| {
            format!(
                "10.1.{}.{} timeout {}ms",
                i / 250,
                i % 250,
                300 + i * every_ms
            )
        })
        .collect();
    let gc = write_file(
        &setup.s.dir,
        "gc.nft",
        &format!(
            "table ip gc {{\n set s {{ type ipv4_addr; flags timeout; gc-interval 100ms; }}\n}}\n\
             add element ip gc s {{ {} }}\n",
            elements.join(", ")
        ),
    );
    // No agent's: its batch is left out of the truth's holds by its pid (`ip netns exec`
    // execs nft in place).
    let mut add = Command::new("ip")
        .args(["netns", "exec", NETNS, "nft", "-f", gc.to_str().unwrap()])
        .spawn()
        .expect("nft -f gc.nft");
    let pid = add.id();
    assert!(
        add.wait().expect("nft -f gc.nft").success(),
        "nft -f gc.nft"
    );
    pid
}

/// kube-proxy's big transaction, and small ones of calico-node (`nft add table`) and
/// firewalld (`iptables-nft-restore`) until it is done; all must succeed. How many small
/// ones ran.
fn run_transactions(setup: &Setup) -> usize {
    let mut kp = Agent::spawn(
        &setup.kube_proxy,
        &[
            "run",
            "ip",
            "netns",
            "exec",
            NETNS,
            "nft",
            "-f",
            setup.big.to_str().unwrap(),
        ],
        &[],
        None,
    );
    kp.ts("start", T);
    // Small transactions, one every 25 ms (250 in the VMs) until kube-proxy's is done: those that reach the
    // kernel while it holds the mutex wait.
    let mut others = Vec::new();
    let deadline = Instant::now() + T;
    let mut i = 0;
    while kp.child.try_wait().expect("kube-proxy").is_none() {
        // In the TCG guests a process costs ~100 times more (its binaries come over 9p):
        // four small transactions at most at a time, or they take the CPUs from kube-proxy's
        // (enough for some to queue on nfnetlink's mutex behind one waiting for the commit
        // mutex).
        let running = others
            .iter_mut()
            .map(|o: &mut Agent| o.child.try_wait().ok().flatten().is_none())
            .filter(|&r| r)
            .count();
        if in_vm() && running >= 4 {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        assert!(
            Instant::now() < deadline,
            "kube-proxy's transaction hangs; where each nft is:\n{}",
            kernel_stacks(&TRANSACTION_COMMS)
        );
        let table = format!("calico{i}");
        others.push(if i % 2 == 0 {
            Agent::spawn(
                &setup.calico,
                &[
                    "run", "ip", "netns", "exec", NETNS, "nft", "add", "table", "ip", &table,
                ],
                &[],
                None,
            )
        } else {
            Agent::spawn(
                &setup.firewalld,
                &[
                    "run",
                    "ip",
                    "netns",
                    "exec",
                    NETNS,
                    "iptables-nft-restore",
                    "--noflush",
                    setup.small.to_str().unwrap(),
                ],
                &[],
                None,
            )
        });
        i += 1;
        // In the TCG guests a process costs ~100 times more: one every 25 ms would take
        // both CPUs from kube-proxy's nft.
        std::thread::sleep(Duration::from_millis(if in_vm() { 250 } else { 25 }));
    }
    assert_eq!(kp.wait(), 0, "nft -f of kube-proxy's ruleset failed");
    for o in &mut others {
        assert_eq!(
            o.wait_within(T),
            0,
            "a small transaction failed: {:?}",
            o.seen
        );
    }
    i
}

/// In the VMs: a perf-tracepoint program (bpftrace's) is skipped when another BPF program
/// runs on its CPU; the kernel counts those misses.
fn show_recursion_misses() {
    if !in_vm() {
        return;
    }
    if let Ok(o) = Command::new("bpftool").args(["prog", "show"]).output() {
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        for l in text.lines().filter(|l| l.contains("recursion_misses")) {
            eprintln!("bpf program with recursion misses: {l}");
        }
    }
}

/// One of the agents'.
fn ours(w: &Value) -> bool {
    AGENTS.contains(&w["agent"].as_str().unwrap_or(""))
}

fn is_kworker(w: &Value) -> bool {
    w["comm"]
        .as_str()
        .is_some_and(|c| c.starts_with("kworker/"))
}

/// xtlock's waits of the agents on the two mutexes.
struct XtWaits {
    /// The netns's commit mutex, as xtlock names it.
    commit_lock: String,
    commit: Vec<Value>,
    nfnl: Vec<Value>,
}

impl XtWaits {
    fn new(trace: &Trace, ino: u64) -> Self {
        let commit_lock = format!("nf_tables commit (netns {ino})");
        let waits = |lock: &str| -> Vec<Value> {
            trace
                .of_type("wait")
                .into_iter()
                .filter(|w| w["lock"] == lock)
                .filter(|w| ours(w))
                .cloned()
                .collect()
        };
        XtWaits {
            commit: waits(&commit_lock),
            nfnl: waits(NFNL_LOCK),
            commit_lock,
        }
    }
}

/// What bpftrace saw: the truth xtlock is held to.
struct Seen {
    /// Every contention it saw, spins included.
    waits: Vec<TruthWait>,
    sends: Vec<TruthSend>,
    /// Which lock address is which mutex.
    kinds: HashMap<u64, &'static str>,
    /// The agents' transactions' contentions on each mutex, spins included.
    all_commit: Vec<TruthWait>,
    all_nfnl: Vec<TruthWait>,
    /// Of those, the waits: what xtlock reports.
    commit: Vec<TruthWait>,
    nfnl: Vec<TruthWait>,
    /// Every thread's contentions on the commit mutex, kernel workers' included.
    any_commit: Vec<TruthWait>,
}

impl Seen {
    fn new(
        waits: Vec<TruthWait>,
        sends: Vec<TruthSend>,
        kinds: HashMap<u64, &'static str>,
    ) -> Self {
        // The agents' transactions, not another tracer's table reads in the netns (an
        // xtlock of another test run reads tables after writes in every netns).
        let truth_of = |kind: &str| -> Vec<TruthWait> {
            waits
                .iter()
                .filter(|w| kinds.get(&w.lock) == Some(&kind))
                .filter(|w| TRANSACTION_COMMS.contains(&w.comm.as_str()))
                .cloned()
                .collect()
        };
        let (all_commit, all_nfnl) = (truth_of("commit"), truth_of("nfnl"));
        let any_commit = waits
            .iter()
            .filter(|w| kinds.get(&w.lock) == Some(&"commit"))
            .cloned()
            .collect();
        let commit = waits_only(&all_commit, &waits);
        let nfnl = waits_only(&all_nfnl, &waits);
        Seen {
            waits,
            sends,
            kinds,
            all_commit,
            all_nfnl,
            commit,
            nfnl,
            any_commit,
        }
    }
}

/// The waits of `all`, against `every` contention seen. A contention that began on a free
/// mutex and saw no one else take it is a spin, not a wait behind anyone: xtlock does not
/// report it, so neither does the truth. One that lasted 1 ms or more is a wait all the same
/// (behind a task that took the mutex on its fast path, unseen).
fn waits_only(all: &[TruthWait], every: &[TruthWait]) -> Vec<TruthWait> {
    all.iter()
        .filter(|t| {
            t.owner_tgid != 0
                || t.end - t.start >= 1_000_000
                || every
                    .iter()
                    .any(|o| o.lock == t.lock && o.end > t.start && o.end < t.end)
        })
        .cloned()
        .collect()
}

/// The two tools' counts; without a wait on the commit mutex the test proves nothing.
fn require_a_commit_wait(xt: &XtWaits, truth: &Seen, small_transactions: usize) {
    eprintln!(
        "commit mutex: xtlock {} waits, bpftrace {}; nfnetlink mutex: xtlock {}, bpftrace {}",
        xt.commit.len(),
        truth.commit.len(),
        xt.nfnl.len(),
        truth.nfnl.len()
    );
    assert!(
        !truth.commit.is_empty(),
        "no wait on the commit mutex happened ({small_transactions} small transactions): the \
         test proves nothing; bpftrace saw {} mutex waits, on mutexes it named {:?}",
        truth.waits.len(),
        truth.kinds
    );
}

/// How far apart the two tools may clock the start of one wait: within 1 ms, xtlock's
/// program runs first, bpftrace's reads the clock after it, some µs later on a host; in the
/// TCG guests, where everything costs ~100 times more and vCPUs stall, [`slack`].
fn same_start() -> u64 {
    if in_vm() {
        slack()
    } else {
        1_000_000
    }
}

/// xtlock's wait `w` is bpftrace's `t`: the same thread's, begun at the same time.
fn same_wait(w: &Value, t: &TruthWait) -> bool {
    u(&w["tid"]) == u64::from(t.tid) && u(&w["start_ns"]).abs_diff(t.start) < same_start()
}

/// A wait too long to be one that a tracer took for a spin: a wait that began on a mutex
/// changing hands between the two programs' reads of its owner is under 1 ms (in the TCG
/// guests the two clocks of one wait differ by up to [`slack`]).
fn long_wait(ns: u64) -> bool {
    ns >= if in_vm() { slack() } else { 1_000_000 }
}

/// On each mutex, xtlock's waits are bpftrace's: the count, the longest, and each wait's
/// waiter, start, length and holder at its start.
fn check_waits(xtlock: &XtWaits, truth: &Seen, dump: &str) {
    let mut raced: Vec<String> = Vec::new();
    let mut unmatched = 0;
    for (name, xt, tr) in [
        ("commit mutex", &xtlock.commit, &truth.commit),
        ("nfnetlink mutex", &xtlock.nfnl, &truth.nfnl),
    ] {
        let missed: Vec<&TruthWait> = tr
            .iter()
            .filter(|t| !xt.iter().any(|w| same_wait(w, t)))
            .collect();
        let extra: Vec<&Value> = xt
            .iter()
            .filter(|w| !tr.iter().any(|t| same_wait(w, t)))
            .collect();
        // The count within 5 % (2 waits on a small count); a difference only in waits
        // under 1 ms, which can begin on a mutex changing hands between the two programs'
        // reads of its owner (below), so that one of them sees a spin on a free mutex. All
        // such races together stay under 5 % of the waits (below).
        // In the TCG guests the two clocks of one wait differ by up to [`slack`]: a wait of a
        // few ms on one side can be a spin under 1 ms on the other (`long_wait`).
        unmatched += missed.len() + extra.len();
        assert!(
            xt.len().abs_diff(tr.len()) <= (tr.len() / 20).max(2)
                && missed.iter().all(|t| !long_wait(t.end - t.start))
                && extra.iter().all(|w| !long_wait(u(&w["wait_ns"]))),
            "{name}: xtlock saw {} waits, bpftrace {}; bpftrace's not in xtlock's: {missed:?}; \
             xtlock's not in bpftrace's: {extra:?}",
            xt.len(),
            tr.len()
        );
        let longest_xt = xt.iter().map(|w| u(&w["wait_ns"])).max().unwrap_or(0);
        let longest_tr = tr.iter().map(|w| w.end - w.start).max().unwrap_or(0);
        eprintln!(
            "{name}: longest wait xtlock {:.3} ms, bpftrace {:.3} ms",
            longest_xt as f64 / 1e6,
            longest_tr as f64 / 1e6
        );
        assert!(
            close(longest_xt, longest_tr),
            "{name}: longest wait {longest_xt} ns, bpftrace {longest_tr} ns"
        );
        // Each wait: the same waiter, start, length and holder at its start.
        for t in tr
            .iter()
            .filter(|t| !missed.iter().any(|m| m.tid == t.tid && m.start == t.start))
        {
            // The same thread's wait that began closest (the two programs read the clock
            // microseconds apart; one thread's waits may follow each other as closely).
            let w = xt
                .iter()
                .filter(|w| same_wait(w, t))
                .min_by_key(|w| u(&w["start_ns"]).abs_diff(t.start))
                .unwrap_or_else(|| {
                    panic!("{name}: bpftrace's wait {t:?} is not in xtlock's:\n{dump}")
                });
            assert!(
                close(u(&w["wait_ns"]), t.end - t.start),
                "{name}: wait {t:?} lasted {} ns in xtlock",
                w["wait_ns"]
            );
            let first = w["holders"].as_array().and_then(|h| h.first());
            let held_at_start = first.filter(|h| u(&h["from_ns"]) == u(&w["start_ns"]));
            let xt_holder = held_at_start.map_or(0, |h| u(&h["pid"]));
            if xt_holder == u64::from(t.owner_tgid) {
                continue;
            }
            // Both read the owner when the wait began, each in its own program on the same
            // tracepoint, microseconds apart: a mutex changing hands right then (released,
            // taken) is free in one read and held in the other. Two different holders would
            // be a wrong one.
            let gap = u(&w["start_ns"]).abs_diff(t.start);
            assert!(
                xt_holder == 0 || t.owner_tgid == 0,
                "{name}: the holder at the start of {t:?} (pid {}, 0: free) is pid {xt_holder} \
                 in xtlock: {w}",
                t.owner_tgid
            );
            raced.push(format!(
                "{name} wait of {} ns by {}: bpftrace read owner {}, xtlock {xt_holder}, {gap} \
                 ns apart",
                t.end - t.start,
                t.tid,
                t.owner_tgid
            ));
        }
    }
    eprintln!(
        "holders at the start: {} waits saw the mutex change hands between the two programs' \
         reads of its owner: {raced:?}; waits under 1 ms one side saw as a spin: {unmatched}",
        raced.len()
    );
    let all = truth.commit.len() + truth.nfnl.len();
    assert!(
        raced.len() + unmatched <= all.div_ceil(20),
        "{} of {all} waits differ in their holder at the start or in being a wait at all: \
         more than 5 %",
        raced.len() + unmatched
    );
}

/// What one stretch of an nfnetlink wait, behind one holder, showed.
enum Stretch {
    /// The holder held more than once in the wait: its time is a sum, the stretch not known
    /// from here.
    Split,
    /// The holder waited for the commit mutex past the nfnetlink wait.
    Unnested,
    /// The holder waited for the commit mutex for nothing, or under 1 ms, meanwhile.
    Unlinked,
    /// Linked to the holder's commit wait; whether that mutex changed hands inside.
    Linked { handed_over: bool },
}

/// An nfnetlink wait's holder that was itself waiting for the commit mutex meanwhile
/// (bpftrace: a commit wait of that thread overlapping the stretch behind it) carries that
/// wait: the commit lock, its time over the stretch, and who held the commit mutex.
fn check_nfnl_links(xt: &XtWaits, truth: &Seen, trace: &Trace, dump: &str) {
    let (mut linked, mut handed_over) = (0, 0);
    let (mut split, mut unnested) = (0, 0);
    for w in &xt.nfnl {
        let holders: Vec<&Value> = w["holders"].as_array().into_iter().flatten().collect();
        for (i, h) in holders.iter().enumerate() {
            match holder_stretch(w, h, holders.get(i + 1).copied(), xt, truth, trace) {
                Stretch::Split => split += 1,
                Stretch::Unnested => unnested += 1,
                Stretch::Unlinked => {}
                Stretch::Linked {
                    handed_over: inside,
                } => {
                    if inside {
                        handed_over += 1;
                    }
                    linked += 1;
                }
            }
        }
    }
    eprintln!(
        "nfnetlink waits behind a batch waiting for the commit mutex: {linked} holders linked \
         ({handed_over} with a hand-over of the commit mutex inside); not checked: {split} \
         held more than once in one wait, {unnested} waited for the commit mutex past the \
         nfnetlink wait"
    );
    // In the TCG guests a run has a handful of nfnetlink waits: all of them may be of the
    // kinds not checked (a commit wait past the nfnetlink wait). The host's run has tens.
    let linkable = !(in_vm() && linked == 0 && split + unnested > 0);
    assert!(
        linked > 0 || truth.nfnl.is_empty() || !linkable,
        "no nfnetlink wait was behind a batch waiting for the commit mutex:\n{dump}"
    );
    assert!(
        truth.nfnl.is_empty()
            || !linkable
            || xt.nfnl.iter().any(|w| w["holders"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|h| h["waiting"]["holders"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r["agent"] == "kube-proxy")))),
        "no nfnetlink wait traced back to kube-proxy's commit:\n{dump}"
    );
}

/// The stretch of nfnetlink wait `w` behind its holder `h` (`next` the one after it),
/// checked against the holder's commit waits in the truth.
fn holder_stretch(
    w: &Value,
    h: &Value,
    next: Option<&Value>,
    xt: &XtWaits,
    truth: &Seen,
    trace: &Trace,
) -> Stretch {
    let from = u(&h["from_ns"]);
    let to = from + u(&h["behind_ns"]);
    // One stretch behind this holder (it held once during the wait), else its time
    // is a sum and the stretch not known from here.
    let next = next.map_or(u(&w["start_ns"]) + u(&w["wait_ns"]), |n| u(&n["from_ns"]));
    if to != next {
        return Stretch::Split;
    }
    let own: Vec<&TruthWait> = truth
        .commit
        .iter()
        .filter(|t| u64::from(t.tid) == u(&h["pid"]) && t.start < to && t.end > from)
        .collect();
    // A commit wait that outlasts the nfnetlink wait was not one the holder waited
    // holding nfnetlink's mutex (it could not have let it go while blocked): the
    // stretch behind it is the split's guess there, and xtlock links only waits
    // ended by then.
    if own
        .iter()
        .any(|t| t.end > u(&w["start_ns"]) + u(&w["wait_ns"]))
    {
        return Stretch::Unnested;
    }
    let want: u64 = own.iter().map(|t| t.end.min(to) - t.start.max(from)).sum();
    let got = &h["waiting"];
    if want == 0 {
        assert!(
            got.is_null() || u(&got["wait_ns"]) < 1_000_000,
            "{w}: its holder {h} waited for nothing"
        );
        return Stretch::Unlinked;
    }
    // Under 1 ms: the stretch's ends are hand-overs the two tracers clock apart.
    if want < 1_000_000 {
        return Stretch::Unlinked;
    }
    assert_eq!(
        got["lock"],
        xt.commit_lock.as_str(),
        "{h} in {w}: bpftrace's commit waits of the holder {own:?}; xtlock's: {:?}",
        trace
            .of_type("wait")
            .into_iter()
            .filter(|x| x["tid"] == h["pid"])
            .map(|x| (
                x["lock"].as_str().unwrap_or(""),
                u(&x["start_ns"]),
                u(&x["wait_ns"])
            ))
            .collect::<Vec<_>>()
    );
    assert!(
        close(u(&got["wait_ns"]), want),
        "{w}: its holder {h} waited {want} ns for the commit mutex meanwhile \
         (bpftrace: {own:?})"
    );
    // Whom: who held the commit mutex when the stretch began (the owner at the start
    // of the holder's commit wait, or the last waiter to take it over since), when
    // it changed hands nowhere inside the stretch (else the split is the analysis'
    // own, tested above).
    let (a, b) = (from.max(own[0].start), to.min(own[0].end));
    let roots: Vec<u64> = got["holders"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| u(&r["pid"]))
        .collect();
    let took_over = truth
        .any_commit
        .iter()
        .filter(|t| t.end > own[0].start && t.end <= a)
        .max_by_key(|t| t.end);
    let root = took_over.map_or(own[0].owner_tgid, |t| t.tid);
    let handed_over =
        own.len() > 1 || truth.any_commit.iter().any(|t| t.end > a && t.end < b) || root == 0;
    if !handed_over {
        assert_eq!(
            roots,
            vec![u64::from(root)],
            "{w}: its holder {h}'s commit wait {:?} was behind pid {root} then \
             ({took_over:?} took it over before the stretch [{a}, {b}); commit waits \
             of any thread around: {:?})",
            own[0],
            truth
                .any_commit
                .iter()
                .filter(|t| t.end + 50_000_000 > a && t.start < b)
                .map(|t| (t.tid, t.start, t.end, t.owner_tgid, &t.comm))
                .collect::<Vec<_>>()
        );
    }
    Stretch::Linked { handed_over }
}

/// Kernel workers' waits on the netns's commit mutex (set garbage collection), each one
/// bpftrace saw, with the same length and holder. xtlock's.
fn check_kernel_worker_waits<'a>(xt: &XtWaits, truth: &Seen, trace: &'a Trace) -> Vec<&'a Value> {
    let tr_kworker: Vec<TruthWait> = waits_only(&truth.any_commit, &truth.waits)
        .into_iter()
        .filter(|t| t.comm.starts_with("kworker/"))
        .collect();
    let xt_kworker: Vec<&Value> = trace
        .of_type("wait")
        .into_iter()
        .filter(|w| w["lock"] == xt.commit_lock.as_str())
        .filter(|w| is_kworker(w))
        .collect();
    eprintln!(
        "kernel workers' waits on the commit mutex: xtlock {}, bpftrace {}; longest xtlock \
         {:.3} ms, bpftrace {:.3} ms",
        xt_kworker.len(),
        tr_kworker.len(),
        xt_kworker
            .iter()
            .map(|w| u(&w["wait_ns"]))
            .max()
            .unwrap_or(0) as f64
            / 1e6,
        tr_kworker
            .iter()
            .map(|t| t.end - t.start)
            .max()
            .unwrap_or(0) as f64
            / 1e6
    );
    assert!(
        !tr_kworker.is_empty(),
        "no kernel worker waited for the commit mutex: the garbage collection part proves \
         nothing"
    );
    let missed: Vec<&TruthWait> = tr_kworker
        .iter()
        .filter(|t| !xt_kworker.iter().any(|w| same_wait(w, t)))
        .collect();
    let extra: Vec<&&Value> = xt_kworker
        .iter()
        .filter(|w| !tr_kworker.iter().any(|t| same_wait(w, t)))
        .collect();
    // As for the agents' waits (`check_waits`): a wait that began on a mutex changing hands
    // between the two programs' reads of its owner is a spin on a free mutex to one of them,
    // so the counts may differ by such short waits (1 of a handful here), never by a long one.
    assert!(
        xt_kworker.len().abs_diff(tr_kworker.len()) <= (tr_kworker.len() / 20).max(1)
            && missed.iter().all(|t| !long_wait(t.end - t.start))
            && extra.iter().all(|w| !long_wait(u(&w["wait_ns"]))),
        "kernel workers' waits: xtlock {:?}, bpftrace {tr_kworker:?}; bpftrace's not in \
         xtlock's: {missed:?}; xtlock's not in bpftrace's: {extra:?}; every kernel worker's \
         mutex wait bpftrace saw: {:?}",
        xt_kworker
            .iter()
            .map(|w| (u(&w["tid"]), u(&w["start_ns"]), u(&w["wait_ns"])))
            .collect::<Vec<_>>(),
        truth
            .waits
            .iter()
            .filter(|t| t.comm.starts_with("kworker/"))
            .map(|t| (
                t.tid,
                t.lock,
                t.start,
                t.end - t.start,
                truth.kinds.get(&t.lock)
            ))
            .collect::<Vec<_>>()
    );
    for t in tr_kworker
        .iter()
        .filter(|t| !missed.iter().any(|m| m.tid == t.tid && m.start == t.start))
    {
        let w = xt_kworker
            .iter()
            .filter(|w| same_wait(w, t))
            .min_by_key(|w| u(&w["start_ns"]).abs_diff(t.start))
            .unwrap_or_else(|| panic!("bpftrace's kernel worker wait {t:?} not in xtlock's"));
        assert!(close(u(&w["wait_ns"]), t.end - t.start), "{w} vs {t:?}");
        // The holder when the wait began, as bpftrace read it: the first holder only if it
        // held from the wait's start (a later one took the mutex during the wait). None in
        // xtlock's: its read of the owner found the mutex free, bpftrace's (µs later on a
        // host, ms under TCG) found its next owner, who took it on its fast path. The same
        // race as the waits' above; two different holders would be a wrong one.
        let first = w["holders"].as_array().and_then(|h| h.first());
        let held_at_start = first.filter(|h| u(&h["from_ns"]) == u(&w["start_ns"]));
        let holder = held_at_start.map_or(0, |h| u(&h["pid"]));
        assert!(
            holder == u64::from(t.owner_tgid) || t.owner_tgid == 0 || holder == 0,
            "{w}: bpftrace's owner at the start {t:?}"
        );
        if holder == 0 && t.owner_tgid != 0 {
            eprintln!("kernel worker's wait behind an unknown holder, bpftrace's {t:?}");
        }
    }
    xt_kworker
}

/// xtlock's holds of the commit mutex by the agents, and the longest.
struct Holds<'a> {
    all: Vec<&'a Value>,
    longest: &'a Value,
}

/// Holds: each batch's sendmsg(), from the end of its last wait on an nf_tables mutex
/// (else the call's start) to its return. bpftrace's sendmsg() times and waits give the
/// same, independently. The longest is kube-proxy's.
fn check_holds<'a>(xt: &XtWaits, truth: &Seen, trace: &'a Trace, gc_pid: u32) -> Holds<'a> {
    let xt_holds: Vec<&Value> = trace
        .of_type("hold")
        .into_iter()
        .filter(|h| h["lock"] == xt.commit_lock.as_str())
        .filter(|h| ours(h))
        .collect();
    let tr_holds: Vec<(u32, u64, u64)> = truth
        .sends
        .iter()
        .filter(|t| TRANSACTION_COMMS.contains(&t.comm.as_str()) && t.tid != gc_pid)
        .map(|t| {
            let start = truth
                .all_commit
                .iter()
                .chain(&truth.all_nfnl)
                .filter(|w| w.tid == t.tid && w.end >= t.enter && w.end <= t.exit)
                .map(|w| w.end)
                .max()
                .unwrap_or(t.enter);
            (t.tid, start, t.exit - start)
        })
        .collect();
    let extra_holds: Vec<&&Value> = xt_holds
        .iter()
        .filter(|h| {
            !tr_holds.iter().any(|t| {
                u64::from(t.0) == u(&h["tid"]) && t.1.abs_diff(u(&h["start_ns"])) < slack()
            })
        })
        .collect();
    assert_eq!(
        xt_holds.len(),
        tr_holds.len(),
        "holds: xtlock {}, bpftrace {}; xtlock's not in bpftrace's: {extra_holds:?}",
        xt_holds.len(),
        tr_holds.len()
    );
    for (tid, start, ns) in &tr_holds {
        let h = xt_holds
            .iter()
            .filter(|h| u(&h["tid"]) == u64::from(*tid))
            .min_by_key(|h| u(&h["start_ns"]).abs_diff(*start))
            .unwrap_or_else(|| panic!("bpftrace's hold by {tid} at {start} is not in xtlock's"));
        assert!(
            close(u(&h["hold_ns"]), *ns) && u(&h["start_ns"]).abs_diff(*start) < slack(),
            "hold by {tid}: xtlock {h}, bpftrace {ns} ns from {start}; bpftrace's waits of \
             that thread: {:?} (kinds {:?}); xtlock's: {:?}",
            truth
                .waits
                .iter()
                .filter(|w| w.tid == *tid)
                .collect::<Vec<_>>(),
            truth.kinds,
            trace
                .of_type("wait")
                .into_iter()
                .filter(|w| u(&w["tid"]) == u64::from(*tid))
                .collect::<Vec<_>>()
        );
    }
    let longest = xt_holds
        .iter()
        .max_by_key(|h| u(&h["hold_ns"]))
        .expect("holds");
    let longest_tr = tr_holds.iter().map(|h| h.2).max().unwrap_or(0);
    eprintln!(
        "holds: xtlock {}, bpftrace {}; longest xtlock {:.3} ms by {}, bpftrace {:.3} ms",
        xt_holds.len(),
        tr_holds.len(),
        u(&longest["hold_ns"]) as f64 / 1e6,
        longest["agent"],
        longest_tr as f64 / 1e6
    );
    assert_eq!(
        longest["agent"], "kube-proxy",
        "the longest hold: {longest}"
    );
    Holds {
        longest,
        all: xt_holds,
    }
}

/// What the batches did (counted from their sendmsg() where nft_commit does not attach,
/// as on this test's host): kube-proxy's one table, one chain and its rules, as many as
/// the kernel holds; calico-node's one table each.
fn check_batches(holds: &Holds, dump: &str) {
    let listed = Command::new("ip")
        .args([
            "netns",
            "exec",
            NETNS,
            "nft",
            "list",
            "chain",
            "ip",
            "kube-proxy",
        ])
        .arg("services")
        .output()
        .expect("nft list chain");
    assert!(listed.status.success(), "nft list chain: {listed:?}");
    let in_kernel = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter(|l| l.contains(" counter "))
        .count();
    assert_eq!(
        in_kernel,
        rules(),
        "the kernel's rules in kube-proxy's chain"
    );
    let added = |h: &Value| (h["nft"]["status"].clone(), h["nft"]["added"].clone());
    let longest = holds.longest;
    assert_eq!(
        added(longest),
        (
            "complete".into(),
            serde_json::json!({"tables": 1, "chains": 1, "rules": in_kernel})
        ),
        "kube-proxy's batch: {longest}"
    );
    let calicos: Vec<&&Value> = holds
        .all
        .iter()
        .filter(|h| h["agent"] == "calico-node")
        .collect();
    assert!(!calicos.is_empty(), "no hold by calico-node:\n{dump}");
    for h in calicos {
        assert_eq!(
            added(h),
            ("complete".into(), serde_json::json!({"tables": 1})),
            "calico-node's batch: {h}"
        );
    }
}

/// Behind the big transaction is kube-proxy, named through the nft it ran.
fn check_behind_kube_proxy(xt: &XtWaits, dump: &str) {
    assert!(
        xt.commit.iter().any(|w| w["holders"]
            .as_array()
            .is_some_and(|h| h.iter().any(|h| h["agent"] == "kube-proxy"))),
        "no wait on the commit mutex behind kube-proxy:\n{dump}"
    );
}

/// The capture replays to the same waits, the kernel workers' and the links included, and
/// to the same holds, with what each batch did.
fn check_replay(cap: &Path, xt: &XtWaits, xt_kworker: &[&Value], holds: &Holds) {
    let commit_lock = xt.commit_lock.as_str();
    let replay: Vec<Value> = report_events(cap)
        .into_iter()
        .filter(|e| e["type"] == "wait" && (e["lock"] == commit_lock || e["lock"] == NFNL_LOCK))
        .filter(|w| ours(w) || is_kworker(w))
        .collect();
    let key = |w: &Value| {
        (
            w["lock"].to_string(),
            u(&w["tid"]),
            u(&w["start_ns"]),
            u(&w["wait_ns"]),
            w["holders"].to_string(),
        )
    };
    let live: BTreeMap<_, _> = xt
        .commit
        .iter()
        .chain(&xt.nfnl)
        .chain(xt_kworker.iter().copied())
        .map(|w| (key(w), ()))
        .collect();
    let again: BTreeMap<_, _> = replay.iter().map(|w| (key(w), ())).collect();
    assert_eq!(
        live, again,
        "report of the capture differs from the live trace"
    );
    let hold_key = |h: &Value| {
        (
            u(&h["tid"]),
            u(&h["start_ns"]),
            u(&h["hold_ns"]),
            h["nft"].to_string(),
        )
    };
    let replayed: Vec<_> = report_events(cap)
        .iter()
        .filter(|e| e["type"] == "hold" && e["lock"] == commit_lock)
        .filter(|h| ours(h))
        .map(hold_key)
        .collect();
    let live: Vec<_> = holds.all.iter().map(|h| hold_key(h)).collect();
    assert_eq!(live, replayed, "holds: report of the capture differs");
}
