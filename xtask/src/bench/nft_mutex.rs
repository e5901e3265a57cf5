//! Bench 9 `nft-mutex`: nf_tables transactions queueing on the nftables-era lock. One `nft -i`
//! per core in a network namespace of its own, each line its own transaction (a table added,
//! then deleted), so the batches queue on the netns's commit mutex and nfnetlink's nf_tables
//! mutex: transactions per second with no tracer, with bpftrace's one-liners for the same
//! jobs (mutex waits timed from `lock:contention_begin` to `contention_end`, batches timed
//! from `sys_enter_sendmsg` to `sys_exit_sendmsg`, each into a `hist()`), the same with
//! xtlock's filter (only a `sendmsg()` on a `NETLINK_NETFILTER` socket, per netns:
//! `bpftrace-netfilter`), and with `xtlock trace --no-rule-reads` (its nf_tables mutex and
//! sendmsg hooks; the table reads after each write are `nft-rules`' bench). With
//! `--bpf-stats`: each tracer's BPF time per transaction (every program it loaded) and per
//! program, so per contention event for the two contention programs (which run for every
//! contended lock of the node), and the floor (`--bench-floor-syscalls`: empty programs on
//! the syscall tracepoints xtlock attaches here).
use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};

use super::{
    run::{rotation, BpfStats, ProgStats, Session, Tracer},
    stats::{add_bpf_runs, bpf_programs_table, num, table, Dist, ProgDists},
    Env,
};

/// The one-liners for the jobs xtlock's programs do on an nf_tables transaction: every mutex
/// wait timed (waits on the two nf_tables mutexes among them), every `sendmsg()` timed.
const SCRIPT: &str = r#"BEGIN { printf("READY\n"); }
tracepoint:lock:contention_begin /args->flags & 32/ { @start[tid] = nsecs; }
tracepoint:lock:contention_end /@start[tid]/ { @wait = hist(nsecs - @start[tid]); delete(@start[tid]); }
tracepoint:syscalls:sys_enter_sendmsg { @send[tid] = nsecs; }
tracepoint:syscalls:sys_exit_sendmsg /@send[tid]/ { @batch = hist(nsecs - @send[tid]); delete(@send[tid]); }
"#;

/// [`SCRIPT`] with the filter xtlock's `sendmsg()` programs apply, so the same job: only a
/// call on a `NETLINK_NETFILTER` socket is timed (an nf_tables batch; not a DNS query's
/// `sendmsg()`), its socket found from the descriptor as xtlock finds it (files, fdtable,
/// file, socket and back, sock), its histogram per network namespace.
const SCRIPT_NETFILTER: &str = r#"BEGIN { printf("READY\n"); }
tracepoint:lock:contention_begin /args->flags & 32/ { @start[tid] = nsecs; }
tracepoint:lock:contention_end /@start[tid]/ { @wait = hist(nsecs - @start[tid]); delete(@start[tid]); }
tracepoint:syscalls:sys_enter_sendmsg {
  $fdt = curtask->files->fdt;
  $fd = (uint64)args->fd;
  if ($fd < (uint64)$fdt->max_fds) {
    $file = *($fdt->fd + $fd);
    $sock = (struct socket *)$file->private_data;
    $sk = $sock->sk;
    if ($sock->file == $file && $sk->__sk_common.skc_family == 16 && $sk->sk_protocol == 12) {
      @send[tid] = nsecs;
      @net[tid] = $sk->__sk_common.skc_net.net->ns.inum;
    }
  }
}
tracepoint:syscalls:sys_exit_sendmsg /@send[tid]/ { @batch[@net[tid]] = hist(nsecs - @send[tid]); delete(@send[tid]); delete(@net[tid]); }
"#;

/// Transactions per client and run: a table added and deleted, this many times.
const PAIRS: usize = 2_000;

#[derive(Default)]
struct Col {
    /// Transactions per second, all clients.
    rate: Dist,
    /// `--bpf-stats`: BPF ns per transaction, all the tracer's programs.
    bpf_ns_per: Dist,
    /// `--bpf-stats`, per program: (ns per run, runs per transaction).
    progs: ProgDists,
    /// xtlock: waits on an nf_tables mutex it reported, per run.
    waits: Vec<u64>,
}

/// A network namespace of its own, deleted on drop.
struct Netns(String);

impl Netns {
    fn new() -> Result<Self> {
        let name = format!("xtlbench-{}-nft", std::process::id());
        let st = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .context("ip netns add")?;
        if !st.success() {
            bail!("ip netns add {name} failed");
        }
        Ok(Netns(name))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// `clients` × `nft -i` in `ns`, each fed its transactions; the transactions and the wall
/// time until the last one exited.
fn transactions(ns: &str, clients: usize, rep: usize) -> Result<(u64, f64)> {
    let t = Instant::now();
    let mut children = Vec::new();
    for c in 0..clients {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, "nft", "-i"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("nft -i (is nftables installed?)")?;
        let mut lines = String::new();
        for i in 0..PAIRS {
            let name = format!("b{rep}c{c}t{i}");
            lines.push_str(&format!("add table ip {name}\ndelete table ip {name}\n"));
        }
        let mut stdin = child.stdin.take().context("nft's stdin")?;
        // Written from a thread: a pipe's buffer holds less than the lines.
        let writer = std::thread::spawn(move || stdin.write_all(lines.as_bytes()));
        children.push((child, writer));
    }
    for (child, writer) in children {
        writer
            .join()
            .map_err(|_| anyhow::anyhow!("the writer thread panicked"))?
            .context("writing to nft -i")?;
        let out = child.wait_with_output().context("nft -i")?;
        if !out.status.success() || !out.stderr.is_empty() {
            bail!(
                "nft -i failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    Ok(((clients * PAIRS * 2) as u64, t.elapsed().as_secs_f64()))
}

/// Waits on an nf_tables mutex in xtlock's JSON lines.
fn xtlock_waits(out: &std::path::Path) -> u64 {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"type\":\"wait\""))
        .filter(|l| l.contains("\"lock\":\"nf_tables commit") || l.contains("nfnetlink nf_tables"))
        .count() as u64
}

pub fn run(env: &Env) -> Result<Value> {
    let clients = env.cores.max(2);
    let ns = Netns::new()?;
    let mut tracers = vec![
        Tracer::None,
        Tracer::Bpftrace,
        Tracer::BpftraceNetfilter,
        Tracer::Xtlock,
    ];
    if env.baseline.is_some() {
        tracers.push(Tracer::Baseline);
    }
    // The floor of xtlock's hooks on this path: their attach points and type, empty.
    if env.bpf_stats {
        tracers.push(Tracer::SyscallFloor);
    }
    let mut cols: Vec<Col> = tracers.iter().map(|_| Col::default()).collect();
    let lock = env.scratch.join("nft-mutex.lock");
    std::fs::write(&lock, b"")?;
    let extra = vec!["--no-rule-reads".to_string(), "--no-drops".to_string()];
    let _stats = env.bpf_stats.then(BpfStats::enable).transpose()?;
    for (rep, ti, t) in rotation(env.reps, &tracers) {
        let tag = format!("nft-mutex-{}-{rep}", t.name());
        let script = if t == Tracer::BpftraceNetfilter {
            SCRIPT_NETFILTER
        } else {
            SCRIPT
        };
        let s = Session::of(env, t, &tag, script, &[&lock], &extra)?;
        let ids = if env.bpf_stats {
            s.prog_ids()
        } else {
            Vec::new()
        };
        let p0 = ProgStats::read(&ids);
        let (n, wall) = transactions(&ns.0, clients, rep)?;
        let p1 = ProgStats::read(&ids);
        let out = s.out.clone();
        s.stop()?;
        let col = &mut cols[ti];
        col.rate.push(n as f64 / wall);
        if t.is_xtlock() && t != Tracer::SyscallFloor {
            col.waits.push(xtlock_waits(&out));
        }
        if env.bpf_stats && t != Tracer::None {
            add_bpf_runs(&mut col.bpf_ns_per, &mut col.progs, p1.since(&p0), n);
        }
    }
    eprint!("{:40}\r", "");
    println!(
        "\n== 9. nf_tables transactions: {clients} x `nft -i`, {} one-line transactions each \
         a run, queueing on one netns's commit mutex (median ±spread of {})",
        PAIRS * 2,
        env.reps
    );
    let base = cols[0].rate.median();
    let mut rows = vec![vec![
        "tracer".to_string(),
        "transactions/s".into(),
        "vs untraced".into(),
        "BPF ns/transaction".into(),
        "nf_tables mutex waits reported".into(),
    ]];
    let mut out_cols = Vec::new();
    for (t, c) in tracers.iter().zip(&cols) {
        rows.push(vec![
            t.name().to_string(),
            c.rate.show(),
            format!("{:+.1}%", (c.rate.median() / base - 1.0) * 100.0),
            if env.bpf_stats && *t != Tracer::None {
                c.bpf_ns_per.show()
            } else {
                "-".into()
            },
            if c.waits.is_empty() {
                "-".into()
            } else {
                format!("{:?}", c.waits)
            },
        ]);
        out_cols.push(json!({
            "tracer": t.name(),
            "transactions_per_s": c.rate.json(),
            "bpf_ns_per_transaction": c.bpf_ns_per.json(),
            "waits_reported": c.waits,
            "programs": c.progs.iter().map(|(name, (ns, runs))| json!({
                "program": name, "ns_per_run": ns.json(), "runs_per_transaction": runs.json(),
            })).collect::<Vec<_>>(),
        }));
    }
    table(&rows);
    println!("  ({} transactions/s at most untraced)", num(base));
    if env.bpf_stats {
        println!(
            "\n  BPF programs (kernel.bpf_stats_enabled), per transaction: ns per run x runs \
             per transaction; the contention programs' ns per run is their cost per contention \
             event (every contended lock of the node)"
        );
        let per: Vec<_> = tracers
            .iter()
            .zip(&cols)
            .skip(1)
            .map(|(t, c)| (t.name(), &c.bpf_ns_per, &c.progs))
            .collect();
        bpf_programs_table("transaction", &per);
    }
    Ok(json!({
        "clients": clients,
        "transactions_per_client": PAIRS * 2,
        "reps": env.reps,
        "columns": out_cols,
        "bpftrace_script": SCRIPT,
        "bpftrace_netfilter_script": SCRIPT_NETFILTER,
    }))
}
