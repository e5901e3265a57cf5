//! One pattern for every background reader (rule tables, addresses, conntrack entries, the
//! IPVS table): a named thread, a bounded channel of what it reads, and a [`Stop`] that
//! dropping the handle sets and then joins the thread. A worker waits only through its
//! `Stop` (its sleeps, its socket reads), so a stop is seen at once, not after a timeout.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

/// Asked to stop: a flag, and an eventfd that wakes a `poll` waiting on it.
#[derive(Clone, Debug)]
pub struct Stop(Arc<StopInner>);

#[derive(Debug)]
struct StopInner {
    set: AtomicBool,
    fd: OwnedFd,
}

/// What a wait for a file descriptor ended with.
#[derive(Debug, PartialEq, Eq)]
pub enum Woke {
    Ready,
    TimedOut,
    Stopped,
}

impl Stop {
    pub fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd takes no pointers; the fd returned is ours alone.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Stop(Arc::new(StopInner {
            set: AtomicBool::new(false),
            fd,
        })))
    }

    pub fn set(&self) {
        self.0.set.store(true, Ordering::Release);
        let one = 1u64;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd. A full counter (EAGAIN)
        // is already readable, which is all the write is for.
        let _ = unsafe { libc::write(self.0.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub fn stopped(&self) -> bool {
        self.0.set.load(Ordering::Acquire)
    }

    /// Sleeps `d`; false when stopped (at once, or during it).
    pub fn sleep(&self, d: Duration) -> bool {
        self.wait(None::<&OwnedFd>, d) != Woke::Stopped
    }

    /// Waits up to `timeout` for `fd` to be readable, unless stopped first.
    pub fn wait(&self, fd: Option<&impl AsFd>, timeout: Duration) -> Woke {
        if self.stopped() {
            return Woke::Stopped;
        }
        let mut fds = [
            libc::pollfd {
                fd: self.0.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: fd.map_or(-1, |f| f.as_fd().as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
            // SAFETY: fds is a valid array of 2 pollfds for the call's duration; a negative
            // fd is ignored by poll.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
            if self.stopped() {
                return Woke::Stopped;
            }
            if n > 0 && fds[1].revents != 0 {
                return Woke::Ready;
            }
            // A signal (EINTR) waits again for what is left; anything else is the timeout.
            let interrupted =
                n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted;
            if !interrupted || left.is_zero() {
                return Woke::TimedOut;
            }
        }
    }
}

/// The worker's side: where its results go, and its stop.
pub struct Out<T> {
    tx: mpsc::SyncSender<T>,
    pub stop: Stop,
}

impl<T> Out<T> {
    /// Hands `v` over, waiting for room; false once the handle is gone (the worker ends).
    pub fn send(&self, v: T) -> bool {
        self.tx.send(v).is_ok()
    }

    /// Hands `v` over if there is room.
    pub fn try_send(&self, v: T) -> Result<(), mpsc::TrySendError<T>> {
        self.tx.try_send(v)
    }
}

/// The handle: results in; dropping it stops and joins the thread.
pub struct Worker<T> {
    rx: Option<mpsc::Receiver<T>>,
    stop: Stop,
    thread: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> Worker<T> {
    /// Runs `body` in a thread named `name`, its results through a channel of `capacity`.
    pub fn spawn(
        name: &str,
        capacity: usize,
        body: impl FnOnce(Out<T>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Stop::new()?;
        let (tx, rx) = mpsc::sync_channel(capacity);
        let out = Out {
            tx,
            stop: stop.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(out))?;
        Ok(Worker {
            rx: Some(rx),
            stop,
            thread: Some(thread),
        })
    }
}

impl<T> Worker<T> {
    /// What came since the last call, without waiting.
    pub fn poll(&mut self, out: &mut Vec<T>) {
        if let Some(rx) = &self.rx {
            out.extend(rx.try_iter());
        }
    }

    /// The next result, waiting up to `d`; `None` when none came or the worker ended.
    pub fn recv_timeout(&self, d: Duration) -> Option<T> {
        self.rx.as_ref()?.recv_timeout(d).ok()
    }

    /// Whether the thread has ended.
    pub fn ended(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

impl<T> Drop for Worker<T> {
    fn drop(&mut self) {
        self.stop.set();
        // A worker blocked handing over a result sees the channel closed.
        self.rx = None;
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::warn!("a background reader panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn dropping_the_handle_stops_a_sleeping_worker_at_once() {
        let w = Worker::<u32>::spawn("xtlock-test", 1, |out| {
            while out.stop.sleep(Duration::from_secs(60)) {}
        })
        .unwrap();
        let t = Instant::now();
        drop(w);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn a_worker_blocked_on_a_full_channel_ends_with_its_handle() {
        let mut w = Worker::spawn("xtlock-test", 1, |out| {
            let mut n = 0u32;
            while out.send(n) {
                n += 1;
            }
        })
        .unwrap();
        let first = w.recv_timeout(Duration::from_secs(5));
        assert_eq!(first, Some(0));
        let mut got = Vec::new();
        w.poll(&mut got);
        drop(w);
    }
}
