//! Load generators for `cargo xtask bench`: tight loops on the paths xtlock traces. Each
//! runs for `--secs S` (or `--cycles N`) and prints one JSON object on stdout:
//! `{"op":..,"cycles":N,"wall_ns":W,"cpu_ns":C,"children_cpu_ns":K}` where `cpu_ns` is this
//! process's CPU time (user + system: in-kernel BPF programs run in the caller's syscall and
//! are charged here) and `children_cpu_ns` that of the children it waited for.
//!
//!   flock PATH [--rate R]     flock(LOCK_EX) + flock(LOCK_UN) on one open file, R cycles/s
//!                             at most (default: as fast as possible)
//!   getppid                   getppid(): a syscall xtlock does not trace (the cost every
//!                             syscall pays once any syscall tracepoint is enabled)
//!   exec [PROG]               spawn PROG (default /bin/true) and wait for it
//!   udp DST_IP PORT [--size B] [--batch N]
//!                             UDP datagrams of B bytes to DST_IP:PORT with sendmmsg(),
//!                             N per call; `cycles` counts datagrams the kernel accepted
//!   connect DST_IP PORT       TCP connects to DST_IP:PORT one after another; `cycles` counts
//!                             those refused (ECONNREFUSED: an ICMP unreachable or a reset)
//!   ruleset SERVICES ENDPOINTS
//!                             print kube-proxy's tables for that many Services (the tests'
//!                             `kube_proxy_ruleset`), for `iptables-restore`; no JSON
//!   nft-ruleset SERVICES ENDPOINTS
//!                             the same in kube-proxy's nftables mode (`kube_proxy_nft_ruleset`),
//!                             for `nft -f`; no JSON
//!
//! Options for all: `--secs S` (default 1) or `--cycles N`, `--ready`: print `ready` and
//! wait for a line on stdin before starting (so several generators start together).
use std::{
    fs::OpenOptions,
    io::{BufRead as _, Write as _},
    net::Ipv4Addr,
    os::fd::AsRawFd as _,
    process::{Command, ExitCode, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

struct Opts {
    secs: f64,
    cycles: Option<u64>,
    rate: Option<f64>,
    size: usize,
    batch: usize,
    ready: bool,
    pos: Vec<String>,
}

fn parse(args: &[String]) -> Result<Opts> {
    let mut o = Opts {
        secs: 1.0,
        cycles: None,
        rate: None,
        size: 64,
        batch: 64,
        ready: false,
        pos: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| {
            it.next()
                .with_context(|| format!("{name} needs a value"))
                .cloned()
        };
        match a.as_str() {
            "--secs" => o.secs = val("--secs")?.parse()?,
            "--cycles" => o.cycles = Some(val("--cycles")?.parse()?),
            "--rate" => o.rate = Some(val("--rate")?.parse()?),
            "--size" => o.size = val("--size")?.parse()?,
            "--batch" => o.batch = val("--batch")?.parse()?,
            "--ready" => o.ready = true,
            _ => o.pos.push(a.clone()),
        }
    }
    Ok(o)
}

fn ns(ts: libc::timespec) -> u64 {
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn clock(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ns(ts)
}

fn children_cpu_ns() -> u64 {
    // SAFETY: zeroed rusage is a valid out-value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Runs `step` (which does `n` operations per call and returns how many succeeded) until the
/// time or cycle budget is spent, pacing to `rate` operations/s when given.
fn drive(o: &Opts, op: &str, per_call: u64, mut step: impl FnMut() -> Result<u64>) -> Result<()> {
    if o.ready {
        println!("ready");
        std::io::stdout().flush()?;
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line)?;
    }
    let budget = Duration::from_secs_f64(o.secs);
    let max = o.cycles.unwrap_or(u64::MAX);
    // Check the clock every `chunk` calls (~50 µs of work), not every call.
    let chunk = (256 / per_call).max(1);
    let cpu0 = clock(libc::CLOCK_PROCESS_CPUTIME_ID);
    let kids0 = children_cpu_ns();
    let t0 = Instant::now();
    let mut done = 0u64;
    let mut attempted = 0u64;
    'outer: loop {
        for _ in 0..chunk {
            done += step()?;
            attempted += per_call;
            if attempted >= max {
                break 'outer;
            }
        }
        let el = t0.elapsed();
        if o.cycles.is_none() && el >= budget {
            break;
        }
        if let Some(rate) = o.rate {
            let due = Duration::from_secs_f64(attempted as f64 / rate);
            if due > el {
                std::thread::sleep(due - el);
            }
        }
    }
    let wall = t0.elapsed().as_nanos() as u64;
    let cpu = clock(libc::CLOCK_PROCESS_CPUTIME_ID) - cpu0;
    let kids = children_cpu_ns() - kids0;
    println!(
        "{{\"op\":\"{op}\",\"cycles\":{done},\"attempted\":{attempted},\"wall_ns\":{wall},\
         \"cpu_ns\":{cpu},\"children_cpu_ns\":{kids}}}"
    );
    Ok(())
}

fn flock(fd: i32, op: libc::c_int) -> Result<()> {
    // SAFETY: plain syscall on an fd we own.
    if unsafe { libc::flock(fd, op) } != 0 {
        return Err(std::io::Error::last_os_error()).context("flock");
    }
    Ok(())
}

fn udp(o: &Opts, dst: &str, port: &str) -> Result<()> {
    let dst: Ipv4Addr = dst.parse().context("destination address")?;
    let port: u16 = port.parse().context("port")?;
    let sock = std::net::UdpSocket::bind("0.0.0.0:0")?;
    sock.connect((dst, port))?;
    let fd = sock.as_raw_fd();
    let payload = vec![0x5au8; o.size];
    let n = o.batch.max(1);
    let mut iov: Vec<libc::iovec> = (0..n)
        .map(|_| libc::iovec {
            iov_base: payload.as_ptr() as *mut libc::c_void,
            iov_len: payload.len(),
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = iov
        .iter_mut()
        .map(|v| {
            // SAFETY: zeroed mmsghdr is valid; we set the iovec.
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect();
    drive(o, "udp", n as u64, || {
        // SAFETY: msgs/iov/payload outlive the call; the socket is connected.
        let r = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), n as u32, 0) };
        // Errors (ENOBUFS, ECONNREFUSED from a stray ICMP) just mean none were sent.
        Ok(r.max(0) as u64)
    })
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        bail!("usage: xtlock-bench-load flock PATH | getppid | exec [PROG] | udp DST PORT | connect DST PORT | ruleset SERVICES ENDPOINTS | nft-ruleset SERVICES ENDPOINTS  [--secs S | --cycles N] [--rate R] [--ready]");
    };
    let o = parse(rest)?;
    match (cmd.as_str(), o.pos.as_slice()) {
        ("flock", [path]) => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .with_context(|| format!("opening {path}"))?;
            let fd = f.as_raw_fd();
            drive(&o, "flock", 1, || {
                flock(fd, libc::LOCK_EX)?;
                flock(fd, libc::LOCK_UN)?;
                Ok(1)
            })
        }
        ("getppid", []) => drive(&o, "getppid", 1, || {
            // SAFETY: plain syscall (not cached by glibc).
            unsafe { libc::syscall(libc::SYS_getppid) };
            Ok(1)
        }),
        ("exec", prog) => {
            let prog = prog.first().map_or("/bin/true", String::as_str).to_owned();
            drive(&o, "exec", 1, || {
                let st = Command::new(&prog)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .with_context(|| format!("spawning {prog}"))?;
                Ok(u64::from(st.success()))
            })
        }
        ("udp", [dst, port]) => udp(&o, dst, port),
        ("connect", [dst, port]) => {
            let addr = std::net::SocketAddr::new(dst.parse()?, port.parse()?);
            drive(
                &o,
                "connect",
                1,
                || match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(1),
                    _ => Ok(0),
                },
            )
        }
        ("ruleset", [services, endpoints]) => {
            let text = xtlock_tests::kube_proxy_ruleset(services.parse()?, endpoints.parse()?);
            std::io::stdout().write_all(text.as_bytes())?;
            Ok(())
        }
        ("nft-ruleset", [services, endpoints]) => {
            let text = xtlock_tests::kube_proxy_nft_ruleset(services.parse()?, endpoints.parse()?);
            std::io::stdout().write_all(text.as_bytes())?;
            Ok(())
        }
        _ => bail!("unknown command or wrong arguments: {args:?}"),
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtlock-bench-load: {e:#}");
            ExitCode::FAILURE
        }
    }
}
