//! A stand-in for the agents that take the xtables lock. Tests copy this binary under the
//! name of the agent they play (`kube-proxy`, `calico-node`, ...), so the kernel's comm for
//! the process is that name, exactly as for the real daemon.
//!
//! Every line it prints on stdout is `KEY VALUE...` with CLOCK_MONOTONIC timestamps in ns,
//! the clock of xtlock's events, so tests compare durations they measured themselves.
//!
//!   hold LOCK MS          flock(LOCK_EX), print `acquired T`, sleep MS, close, `released T`
//!                         (taken before the close) and `closed T` (after it); `locking T` is
//!                         taken before the flock(), so a test can bracket the kernel's times
//!   holduntil LOCK PATH   as hold, until PATH exists (a test's own work decides how long)
//!   poll LOCK INTERVAL_MS HOLD_MS
//!                         LOCK_EX|LOCK_NB every INTERVAL_MS until granted (Go daemons'
//!                         style), print `tries N` and `acquired T`, hold HOLD_MS, `released T`,
//!                         `closed T`
//!   run [--netns] CMD ARGS...
//!                         run CMD as a child (in a new network namespace with --netns),
//!                         print `start T`, `exit CODE T`; exit with CMD's status
//!   forkhold LOCK MS      take the lock, fork; the child keeps the inherited fd and closes
//!                         it after MS; the parent closes its copy at once and waits (the
//!                         same `locking`, `acquired`, `released`, `closed` lines as hold)
//!   udp ADDR PORT COUNT FLOWS
//!                         send COUNT one-byte UDP datagrams to ADDR:PORT, round-robin from
//!                         FLOWS sockets (so FLOWS distinct source ports, i.e. conntrack
//!                         entries); print `sent N T`
//!   udpfrom SPORT ADDR PORT COUNT INTERVAL_MS
//!                         send COUNT one-byte UDP datagrams to ADDR:PORT from the fixed
//!                         source port SPORT, one every INTERVAL_MS (the same IPVS
//!                         connection throughout); print `sent N`
//!   udpecho PORT          answer every UDP datagram on PORT with the same bytes, until killed
//!   tcplisten PORT        accept TCP connections on PORT and close them, until killed
//!   connects ADDR PORT COUNT INTERVAL_MS TIMEOUT_MS
//!                         start COUNT TCP connects to ADDR:PORT, one every INTERVAL_MS, each
//!                         given TIMEOUT_MS; print `conn I START_T END_T RESULT` for each (RESULT
//!                         `ok` or the errno's name: EHOSTUNREACH, ECONNREFUSED, ETIMEDOUT),
//!                         then `done T`: what the client itself got
//!   sockopts COUNT        on one TCP socket, COUNT `getsockopt(SO_ERROR)` (the read after
//!                         every non-blocking connect) and COUNT `setsockopt(TCP_NODELAY)`;
//!                         print `done T`: socket options that are not netfilter's
use std::{
    fs::OpenOptions,
    os::{fd::AsRawFd, unix::process::CommandExt},
    process::{Command, ExitCode},
    thread::sleep,
    time::Duration,
};

fn now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn say(line: String) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn open(lock: &str) -> anyhow::Result<std::fs::File> {
    Ok(OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(lock)?)
}

fn flock(f: &std::fs::File, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: valid fd for the lifetime of `f`.
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `hold` and `holduntil`: takes the lock (`locking T`, `acquired T`), holds it while `wait`
/// runs, closes it (`released T` taken before the close, `closed T` after).
fn hold_while(lock: &str, wait: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<u8> {
    let f = open(lock)?;
    say(format!("locking {}", now()));
    flock(&f, libc::LOCK_EX)?;
    say(format!("acquired {}", now()));
    wait()?;
    close_saying(f)
}

/// Lets the lock go by closing `f`, then says when: `released T` (before the close),
/// `closed T` (after).
fn close_saying(f: std::fs::File) -> anyhow::Result<u8> {
    let t = now();
    drop(f);
    let closed = now();
    say(format!("released {t}"));
    say(format!("closed {closed}"));
    Ok(0)
}

fn ms(s: &str) -> anyhow::Result<Duration> {
    Ok(Duration::from_millis(s.parse()?))
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("xtlock-test-helper: {e:#}");
            ExitCode::from(100)
        }
    }
}

fn run() -> anyhow::Result<u8> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    match a.as_slice() {
        ["sockopts", count] => {
            let sock = std::net::TcpListener::bind("127.0.0.1:0")?;
            let fd = sock.as_raw_fd();
            for _ in 0..count.parse::<u64>()? {
                let mut v: libc::c_int = 0;
                let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: valid fd, out-pointers to locals of the sizes given.
                let r = unsafe {
                    libc::getsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        (&mut v as *mut libc::c_int).cast(),
                        &mut len,
                    )
                };
                anyhow::ensure!(r == 0, "getsockopt: {}", std::io::Error::last_os_error());
                let one: libc::c_int = 1;
                // SAFETY: as above, an in-pointer.
                let r = unsafe {
                    libc::setsockopt(
                        fd,
                        libc::IPPROTO_TCP,
                        libc::TCP_NODELAY,
                        (&one as *const libc::c_int).cast(),
                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                    )
                };
                anyhow::ensure!(r == 0, "setsockopt: {}", std::io::Error::last_os_error());
            }
            say(format!("done {}", now()));
            Ok(0)
        }
        ["hold", lock, hold] => {
            let hold = ms(hold)?;
            hold_while(lock, || {
                sleep(hold);
                Ok(())
            })
        }
        ["holduntil", lock, path] => hold_while(lock, || {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while !std::path::Path::new(path).exists() {
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "{path} did not appear within 120 s"
                );
                sleep(Duration::from_millis(5));
            }
            Ok(())
        }),
        // Holds the lock and hands the kernel a table replace whose argument points at
        // unmapped memory (in a new network namespace): it fails with EFAULT.
        ["badreplace", lock] => {
            let f = open(lock)?;
            flock(&f, libc::LOCK_EX)?;
            say(format!("acquired {}", now()));
            // SAFETY: plain syscalls; the bad pointer is only handed to the kernel, which
            // checks it.
            let ret = unsafe {
                if libc::unshare(libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error().into());
                }
                let fd = libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error().into());
                }
                // IPT_SO_SET_REPLACE
                libc::setsockopt(fd, libc::SOL_IP, 64, 8 as *const libc::c_void, 4096)
            };
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            say(format!("setsockopt {ret} {errno}"));
            drop(f);
            say(format!("released {}", now()));
            Ok(0)
        }
        // A holder with a large address space that exits without unlocking: the kernel
        // tears its memory down before it closes its files, so the lock is released well
        // after the exit.
        ["bighold", lock, mib, hold] => {
            let mib: usize = mib.parse()?;
            // Written, so every page is really there.
            let mut mem = vec![0u8; mib << 20];
            for b in mem.iter_mut().step_by(4096) {
                *b = 1;
            }
            let f = open(lock)?;
            flock(&f, libc::LOCK_EX)?;
            say(format!("acquired {}", now()));
            sleep(ms(hold)?);
            say(format!("exiting {}", now()));
            std::hint::black_box(&mem);
            std::mem::forget(f);
            std::process::exit(0);
        }
        // `n` lock/unlock cycles on one open file, as fast as they come: two of these on
        // different CPUs hand the lock back and forth.
        ["pingpong", lock, n] => {
            let n: u64 = n.parse()?;
            let f = open(lock)?;
            say(format!("start {}", now()));
            for _ in 0..n {
                flock(&f, libc::LOCK_EX)?;
                // 20 µs inside, so the other side is waiting when this one lets go.
                let t = now();
                while now() - t < 20_000 {
                    std::hint::spin_loop();
                }
                flock(&f, libc::LOCK_UN)?;
            }
            say(format!("done {}", now()));
            Ok(0)
        }
        ["tries", lock, n] => {
            // Non-blocking tries back to back (each one the kernel's copy of the holder's take
            // when it is the first request since that take); a try that gets the lock lets go
            // at once. Says how many got it.
            let f = open(lock)?;
            let mut got = 0u64;
            for _ in 0..n.parse::<u64>()? {
                match flock(&f, libc::LOCK_EX | libc::LOCK_NB) {
                    Ok(()) => {
                        got += 1;
                        flock(&f, libc::LOCK_UN)?;
                    }
                    Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            say(format!("got {got}"));
            Ok(0)
        }
        ["poll", lock, interval, hold] => {
            let f = open(lock)?;
            let mut tries = 0u32;
            loop {
                match flock(&f, libc::LOCK_EX | libc::LOCK_NB) {
                    Ok(()) => break,
                    Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                        tries += 1;
                        sleep(ms(interval)?);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            say(format!("tries {tries}"));
            say(format!("acquired {}", now()));
            sleep(ms(hold)?);
            close_saying(f)
        }
        ["forkhold", lock, hold] => {
            let f = open(lock)?;
            say(format!("locking {}", now()));
            flock(&f, libc::LOCK_EX)?;
            say(format!("acquired {}", now()));
            // SAFETY: single-threaded program; the child only sleeps, prints and exits.
            let pid = unsafe { libc::fork() };
            if pid < 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            if pid == 0 {
                say(format!("child {}", std::process::id()));
                sleep(ms(hold)?);
                close_saying(f)?;
                // SAFETY: leave without running the parent's atexit handlers twice.
                unsafe { libc::_exit(0) };
            }
            drop(f);
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            Ok(0)
        }
        ["run", rest @ ..] => {
            let (netns, cmd) = match rest {
                ["--netns", cmd @ ..] => (true, cmd),
                cmd => (false, cmd),
            };
            let [prog, cargs @ ..] = cmd else {
                anyhow::bail!("run needs a command");
            };
            let mut c = Command::new(prog);
            c.args(cargs);
            if netns {
                // SAFETY: unshare is async-signal-safe; runs in the child before exec.
                unsafe {
                    c.pre_exec(|| {
                        if libc::unshare(libc::CLONE_NEWNET) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            }
            say(format!("start {}", now()));
            let status = c.status()?;
            let code = status.code().unwrap_or(128);
            say(format!("exit {code} {}", now()));
            Ok(code as u8)
        }
        ["udp", addr, port, count, flows] => {
            let dst: std::net::SocketAddr = format!("{addr}:{port}").parse()?;
            let count: u64 = count.parse()?;
            let flows: usize = flows.parse::<usize>()?.max(1);
            let bind = if dst.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
            let socks = (0..flows)
                .map(|_| std::net::UdpSocket::bind(bind))
                .collect::<std::io::Result<Vec<_>>>()?;
            let mut sent = 0u64;
            for i in 0..count {
                send_one(&socks[(i % flows as u64) as usize], dst)?;
                sent += 1;
            }
            say(format!("sent {sent} {}", now()));
            Ok(0)
        }
        // One datagram to each of NPORTS ports from one socket: many flows, cheaply.
        ["udp-ports", addr, first, nports] => {
            let first: u16 = first.parse()?;
            let nports: u16 = nports.parse()?;
            let ip: std::net::IpAddr = addr.parse()?;
            let bind = if ip.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
            let sock = std::net::UdpSocket::bind(bind)?;
            for p in 0..nports {
                send_one(&sock, std::net::SocketAddr::new(ip, first.wrapping_add(p)))?;
            }
            say(format!("sent {nports} {}", now()));
            Ok(0)
        }
        ["udpfrom", sport, addr, port, count, interval_ms] => {
            let dst: std::net::SocketAddr = format!("{addr}:{port}").parse()?;
            let sock = std::net::UdpSocket::bind(format!("0.0.0.0:{sport}"))?;
            let count: u64 = count.parse()?;
            let interval = Duration::from_millis(interval_ms.parse()?);
            let mut sent = 0u64;
            for _ in 0..count {
                send_one(&sock, dst)?;
                sent += 1;
                sleep(interval);
            }
            say(format!("sent {sent}"));
            Ok(0)
        }
        ["udpecho", port] => {
            let sock = std::net::UdpSocket::bind(format!("0.0.0.0:{port}"))?;
            say("listening".into());
            let mut buf = [0u8; 2048];
            loop {
                let (n, from) = sock.recv_from(&mut buf)?;
                let _ = sock.send_to(&buf[..n], from);
            }
        }
        ["tcplisten", port] => {
            let l = std::net::TcpListener::bind(format!("0.0.0.0:{port}"))?;
            say("listening".into());
            loop {
                let _ = l.accept()?;
            }
        }
        ["connects", addr, port, count, interval, timeout] => {
            let dst: std::net::SocketAddr = format!("{addr}:{port}").parse()?;
            let (count, interval, timeout): (u32, u64, u64) =
                (count.parse()?, interval.parse()?, timeout.parse()?);
            let mut threads = Vec::new();
            for i in 0..count {
                threads.push(std::thread::spawn(move || {
                    let start = now();
                    let r = std::net::TcpStream::connect_timeout(
                        &dst,
                        Duration::from_millis(timeout),
                    );
                    let result = match r {
                        Ok(_) => "ok".to_string(),
                        Err(e) => match e.raw_os_error() {
                            Some(libc::EHOSTUNREACH) => "EHOSTUNREACH".into(),
                            Some(libc::ECONNREFUSED) => "ECONNREFUSED".into(),
                            Some(libc::ENETUNREACH) => "ENETUNREACH".into(),
                            Some(libc::ETIMEDOUT) => "ETIMEDOUT".into(),
                            _ if e.kind() == std::io::ErrorKind::TimedOut => "ETIMEDOUT".into(),
                            _ => format!("error:{e}"),
                        },
                    };
                    say(format!("conn {i} {start} {} {result}", now()));
                }));
                sleep(Duration::from_millis(interval));
            }
            for t in threads {
                let _ = t.join();
            }
            say(format!("done {}", now()));
            Ok(0)
        }
        _ => anyhow::bail!("usage: hold LOCK MS | holduntil LOCK PATH | poll LOCK INTERVAL_MS HOLD_MS | forkhold LOCK MS | run [--netns] CMD ARGS... | udp ADDR PORT COUNT FLOWS | udp-ports ADDR FIRST_PORT NPORTS | udpfrom SPORT ADDR PORT COUNT INTERVAL_MS | udpecho PORT | tcplisten PORT | connects ADDR PORT COUNT INTERVAL_MS TIMEOUT_MS"),
    }
}

/// Sends one datagram, retrying while the kernel is out of buffers. Sends to a dropped port
/// may report ECONNREFUSED from an earlier ICMP error; only the datagrams the kernel took
/// count.
fn send_one(s: &std::net::UdpSocket, dst: std::net::SocketAddr) -> anyhow::Result<()> {
    loop {
        match s.send_to(b"x", dst) {
            Ok(_) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => sleep(Duration::from_micros(50)),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            Err(e) => return Err(e.into()),
        }
    }
}
