//! The netlink socket every reader uses (nf_tables rules, conntrack entries, IPVS, rtnetlink)
//! and its one request/answer loop: the answer is read to its end (`DONE`, or the one
//! message of a plain request), messages of another sequence number are not the answer (a
//! late answer to a request that timed out; rtnetlink's notifications, which a subscribed
//! socket keeps), and after a failure whatever is left is drained so the next request starts
//! clean. The framing and the attributes are `decode::netlink`'s.

use std::fs::File;
use std::sync::Arc;
use std::time::Duration;

use crate::decode::netlink::{self as nl, Control, FrameError, Message};
use crate::source::worker::{Stop, Woke};

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum NlError<E: std::fmt::Display + std::fmt::Debug> {
    #[error("cannot send the request: {}{}", .0, super::needs(.0, "CAP_NET_ADMIN"))]
    Send(std::io::Error),
    #[error("cannot read the answer: {}{}", .0, super::needs(.0, "CAP_NET_ADMIN"))]
    Recv(std::io::Error),
    #[error("no answer in {0:?}")]
    TimedOut(Duration),
    #[error(transparent)]
    Frame(FrameError),
    /// The kernel refused the request: its errno.
    #[error("the kernel refused: {}{}", std::io::Error::from_raw_os_error(*.0), refused_needs(*.0))]
    Refused(i32),
    /// The reader's own verdict on a message.
    #[error("{0}")]
    Reader(E),
    #[error("stopped")]
    Stopped,
}

fn refused_needs(errno: i32) -> String {
    super::needs(&std::io::Error::from_raw_os_error(errno), "CAP_NET_ADMIN")
}

/// A netlink socket of one protocol, in the namespace it was opened in.
pub struct NlSocket {
    sock: netlink_sys::Socket,
    buf: Vec<u8>,
    seq: u32,
    timeout: Duration,
    /// Messages of other sequence numbers go to the reader too (notifications).
    strays: bool,
    stop: Option<Stop>,
}

impl NlSocket {
    /// Opens a socket of `protocol` (`netlink_sys::protocols::NETLINK_*`) in this thread's
    /// namespace; an answer is waited for up to `timeout`.
    pub fn open(protocol: isize, timeout: Duration) -> std::io::Result<Self> {
        let mut sock = netlink_sys::Socket::new(protocol)?;
        sock.bind_auto()?;
        sock.connect(&netlink_sys::SocketAddr::new(0, 0))?;
        set_recv_timeout(&sock, timeout)?;
        Ok(NlSocket {
            sock,
            // A datagram longer than the room left is cut: room for the largest a dump sends.
            buf: Vec::with_capacity(1 << 17),
            seq: 0,
            timeout,
            strays: false,
            stop: None,
        })
    }

    /// The same in namespace `ns` (`None`: this thread's).
    pub fn open_in(
        protocol: isize,
        timeout: Duration,
        ns: Option<&Arc<File>>,
    ) -> std::io::Result<Self> {
        match ns {
            None => Self::open(protocol, timeout),
            Some(f) => super::netns::inside(f, move || Self::open(protocol, timeout)),
        }
    }

    /// Reads end when `stop` is set.
    pub fn stop_with(mut self, stop: Stop) -> Self {
        self.stop = Some(stop);
        self
    }

    /// Joins multicast `groups` (rtnetlink's notifications): they reach the reader too,
    /// during an exchange as well.
    pub fn subscribe(&mut self, groups: &[u32]) -> std::io::Result<()> {
        for &g in groups {
            self.sock.add_membership(g)?;
        }
        self.strays = true;
        Ok(())
    }

    /// A receive buffer of `bytes`, best effort (the default is only smaller): past
    /// `rmem_max` with `SO_RCVBUFFORCE` where allowed (root), else up to it.
    pub fn set_rcvbuf(&self, bytes: libc::c_int) {
        if setsockopt(&self.sock, libc::SO_RCVBUFFORCE, &bytes).is_err() {
            let _ = setsockopt(&self.sock, libc::SO_RCVBUF, &bytes);
        }
    }

    /// A sequence number for the next request.
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends `request` and hands each message of its answer to `each`, to the answer's end:
    /// a dump's `DONE`, or the single answer to a plain request.
    pub fn exchange<E: std::fmt::Display + std::fmt::Debug>(
        &mut self,
        request: &[u8],
        mut each: impl FnMut(Message<'_>) -> Result<(), E>,
    ) -> Result<(), NlError<E>> {
        let seq = nl::seq_of(request).unwrap_or(0);
        let dump = nl::is_dump(request);
        self.sock.send(request, 0).map_err(NlError::Send)?;
        let r = self.answer(seq, dump, &mut each);
        // A refusal ends its answer; anything else may leave part of it queued.
        if matches!(&r, Err(e) if !matches!(e, NlError::Refused(_))) {
            self.drain();
        }
        r
    }

    fn answer<E: std::fmt::Display + std::fmt::Debug>(
        &mut self,
        seq: u32,
        dump: bool,
        each: &mut impl FnMut(Message<'_>) -> Result<(), E>,
    ) -> Result<(), NlError<E>> {
        loop {
            self.recv()?;
            for m in nl::framed(&self.buf) {
                let m = m.map_err(NlError::Frame)?;
                let ours = m.seq == seq;
                match m.control().map_err(NlError::Frame)? {
                    Some(Control::Done) if ours => return Ok(()),
                    Some(Control::Refused(errno)) if ours => return Err(NlError::Refused(errno)),
                    Some(Control::Ack) if ours && !dump => return Ok(()),
                    Some(_) => {}
                    None if ours => {
                        each(m).map_err(NlError::Reader)?;
                        if !dump {
                            return Ok(());
                        }
                    }
                    None if self.strays => each(m).map_err(NlError::Reader)?,
                    // A late answer to an earlier request.
                    None => {}
                }
            }
        }
    }

    /// Waits for one datagram (up to the timeout, or the stop) into the buffer.
    fn recv<E: std::fmt::Display + std::fmt::Debug>(&mut self) -> Result<(), NlError<E>> {
        self.buf.clear();
        // Without a stop, SO_RCVTIMEO (set at open) bounds the read.
        if let Some(stop) = &self.stop {
            match stop.wait(Some(&self.sock), self.timeout) {
                Woke::Ready => {}
                Woke::TimedOut => return Err(NlError::TimedOut(self.timeout)),
                Woke::Stopped => return Err(NlError::Stopped),
            }
        }
        loop {
            match self.sock.recv(&mut self.buf, 0) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Err(NlError::TimedOut(self.timeout))
                }
                Err(e) => return Err(NlError::Recv(e)),
            }
        }
    }

    /// Reads one datagram (notifications of a subscribed socket); `None` when none came
    /// within the timeout.
    pub fn read_one(&mut self) -> Result<Option<&[u8]>, NlError<std::convert::Infallible>> {
        match self.recv() {
            Ok(()) => Ok(Some(&self.buf)),
            Err(NlError::TimedOut(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whatever is left of an answer that failed halfway.
    fn drain(&mut self) {
        loop {
            self.buf.clear();
            match self.sock.recv(&mut self.buf, libc::MSG_DONTWAIT) {
                Ok(_) if !self.buf.is_empty() => {}
                _ => return,
            }
        }
    }
}

/// `SO_RCVTIMEO`: how long a read of `sock` may wait.
fn set_recv_timeout(sock: &netlink_sys::Socket, t: Duration) -> std::io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros() as i32),
    };
    setsockopt(sock, libc::SO_RCVTIMEO, &tv)
}

/// Sets the `SOL_SOCKET` option `opt` of `sock` to `v` (the C type the option takes).
fn setsockopt<T>(sock: &netlink_sys::Socket, opt: libc::c_int, v: &T) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: v is a valid T, its size given, for the call's duration.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
