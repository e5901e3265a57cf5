//! Raw event bytes (from the ring buffer or a capture file) to typed [`Event`]s.
//!
//! The byte layouts are the `#[repr(C)]` structs of `xtlock-common`; this is the only place
//! that reads them. Decoding never panics: short or unknown records are [`DecodeError`]s.
//! The event types themselves live in `event`; they are re-exported here, where the
//! sources and the capture format have always found them.

use std::{
    mem::offset_of,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use xtlock_common as common;

use crate::event::shared;

pub mod ct_entry;
pub mod ipvs_nl;
pub mod netlink;
pub mod nft_table;
pub mod xt_bytes;
pub(crate) mod xt_ext;
pub mod xt_table;
pub use crate::event::*;

/// An `AF_INET`/`AF_INET6` address from a `union nf_inet_addr` and a port.
pub fn inet_addr(af: u16, a: &[u8; 16], port: u16) -> SocketAddr {
    const AF_INET6: u16 = 10;
    let ip = if af == AF_INET6 {
        IpAddr::V6(Ipv6Addr::from(*a))
    } else {
        IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
    };
    SocketAddr::new(ip, port)
}

/// The key of the kernel's IPVS counters as a count.
pub fn ipvs_count(k: &common::IpvsKey, count: u64) -> IpvsCount {
    IpvsCount {
        protocol: k.protocol,
        service: inet_addr(k.af, &k.vaddr, k.vport),
        backend: inet_addr(k.af, &k.daddr, k.dport),
        state: DestState::from_u8(k.state),
        count,
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {len} bytes is shorter than an event header")]
    TooShort { len: usize },
    #[error("unknown event kind {kind}")]
    UnknownKind { kind: u32 },
    #[error("a Hold record holds two events: read it with a Decoder")]
    TwoEvents,
    #[error("{kind:?} record of {len} bytes, expected at least {want}")]
    Truncated {
        kind: common::EventKind,
        len: usize,
        want: usize,
    },
}

/// Reads a `T` from the front of `b`. The caller checked the length (`need`); were it short
/// anyway, the bytes past `b`'s end read as zeros: never past the slice, in any build. Only
/// plain-old-data types (`aya::Pod`: integers, byte arrays, `#[repr(C)]` structs of them) are
/// accepted, so no byte pattern a hostile capture holds can make an invalid value.
fn read<T: aya::Pod>(b: &[u8]) -> T {
    debug_assert!(b.len() >= std::mem::size_of::<T>());
    let n = b.len().min(std::mem::size_of::<T>());
    let mut v = std::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: `n` bytes are in `b` and fit in `v`; zeroed then overwritten bytes are a valid
    // `T` because `T: Pod` means any bits are.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr().cast::<u8>(), n);
        v.assume_init()
    }
}

/// A batch's counts as the nf_tables hooks send them; `None` when not counted.
fn nft_batch(
    status: u32,
    added: [u32; common::NFT_KINDS],
    deleted: [u32; common::NFT_KINDS],
) -> Option<Box<NftBatch>> {
    let status = match status {
        common::NFT_BATCH_COMPLETE => "complete",
        common::NFT_BATCH_PARTIAL => "partial",
        common::NFT_BATCH_UNREADABLE => "unreadable",
        _ => return None,
    };
    Some(Box::new(NftBatch {
        status,
        added,
        deleted,
    }))
}

fn need(kind: common::EventKind, b: &[u8], want: usize) -> Result<(), DecodeError> {
    if b.len() < want {
        Err(DecodeError::Truncated {
            kind,
            len: b.len(),
            want,
        })
    } else {
        Ok(())
    }
}

/// A `LockEvent` record as an event.
fn lock_event(e: &common::LockEvent) -> Event {
    let op = if e.fl_type == common::F_UNLCK {
        LockOp::Released
    } else if e.ret == 0 {
        LockOp::Acquired {
            exclusive: e.fl_type == common::F_WRLCK,
        }
    } else if e.ret == common::FILE_LOCK_DEFERRED {
        LockOp::Deferred
    } else {
        LockOp::Failed { errno: -e.ret }
    };
    Event::Lock(LockEvent {
        ts_ns: e.hdr.ts_ns,
        tgid: e.hdr.tgid,
        tid: e.hdr.tid,
        comm: Comm(e.comm),
        owner: e.owner,
        dev: e.dev,
        ino: e.ino,
        op,
        nonblocking: e.fl_flags & common::FL_SLEEP == 0,
    })
}

/// Owners whose last take the decoder remembers; past this many it starts over (a take
/// then passes, as it would have from a build that sent every take).
const MAX_OWNERS: usize = 4096;

/// Decodes a stream of records, live or from a capture, the same way: a `Hold` record
/// becomes its take and its release, and an exclusive take no later than the last one of
/// its owner is dropped. The kernel's kept take can go out twice (two CPUs racing to send
/// it, userspace reading it from the map) or, after a rare race on who sent it, again
/// later; one owner's takes follow each other in time.
#[derive(Debug, Default)]
pub struct Decoder {
    // foldhash: SipHash here cost every take ~100 ns (owners are kernel addresses, not
    // attacker-chosen keys worth a keyed hash).
    last_take: std::collections::HashMap<u64, u64, foldhash::fast::RandomState>,
    /// A `Hold` record's release, after its take was returned.
    release: Option<Event>,
}

impl Decoder {
    /// The record's first event (none for a take had already); a `Hold` record's release
    /// then comes from [`Decoder::pending`]. One event a call, moved once: this is every
    /// event's path.
    pub fn decode(&mut self, b: &[u8]) -> Result<Option<Event>, DecodeError> {
        use common::{sizes, EventKind as K};
        if b.len() >= std::mem::size_of::<common::EventHeader>()
            && read::<common::EventHeader>(b).kind == K::Hold as u32
        {
            need(K::Hold, b, sizes::HOLD)?;
            let h: common::HoldEvent = read(b);
            let release = lock_event(&common::LockEvent {
                hdr: common::EventHeader {
                    kind: K::Lock as u32,
                    ..h.hdr
                },
                ret: h.ret,
                fl_flags: h.fl_flags,
                fl_type: common::F_UNLCK,
                comm: h.comm,
                ..h.take
            });
            return Ok(match self.fresh(lock_event(&h.take)) {
                Some(take) => {
                    self.release = Some(release);
                    Some(take)
                }
                None => Some(release),
            });
        }
        Ok(self.fresh(decode(b)?))
    }

    /// The second event of the last record, if it had one.
    pub fn pending(&mut self) -> Option<Event> {
        self.release.take()
    }

    /// `ev`, unless it is an exclusive take had already.
    #[inline]
    fn fresh(&mut self, ev: Event) -> Option<Event> {
        let Event::Lock(l) = &ev else {
            return Some(ev);
        };
        if !matches!(l.op, LockOp::Acquired { exclusive: true }) {
            return Some(ev);
        }
        if self.last_take.get(&l.owner).is_some_and(|&t| l.ts_ns <= t) {
            return None;
        }
        if self.last_take.len() >= MAX_OWNERS {
            self.last_take.clear();
        }
        self.last_take.insert(l.owner, l.ts_ns);
        Some(ev)
    }
}

/// Decodes one raw event record of a kind that holds one event (all but `Hold`: a
/// [`Decoder`] reads those).
// Inline: lets the caller's instance build the event in its own return slot instead of
// copying it out of this function's.
#[inline]
pub fn decode(b: &[u8]) -> Result<Event, DecodeError> {
    use common::{sizes, EventKind as K};
    if b.len() < std::mem::size_of::<common::EventHeader>() {
        return Err(DecodeError::TooShort { len: b.len() });
    }
    let hdr: common::EventHeader = read(b);
    let kind = K::from_u32(hdr.kind).ok_or(DecodeError::UnknownKind { kind: hdr.kind })?;
    Ok(match kind {
        K::Lock => {
            need(kind, b, sizes::LOCK)?;
            lock_event(&read(b))
        }
        K::Hold => return Err(DecodeError::TwoEvents),
        K::FlockCall => {
            need(kind, b, sizes::FLOCK_CALL)?;
            flock_call_event(&hdr, &read(b))
        }
        K::Exec => {
            // Records of older versions end before `netns`.
            need(kind, b, common::EXEC_V1_LEN)?;
            exec_event(&hdr, b)
        }
        K::Fork => {
            need(kind, b, sizes::FORK)?;
            fork_event(&hdr, &read(b))
        }
        K::Exit => {
            need(kind, b, sizes::EXIT)?;
            exit_event(&hdr, &read(b))
        }
        K::TableReplace => {
            // Records of older versions end before the table head.
            need(kind, b, common::TABLE_REPLACE_V1_LEN)?;
            table_replace_event(&hdr, b)
        }
        K::NftCommit => {
            // Records of older versions end before the batch counts (and say "not counted").
            need(kind, b, common::NFT_COMMIT_V1_LEN)?;
            nft_commit_event(&hdr, b)
        }
        K::NftMutexWait => {
            need(kind, b, sizes::NFT_MUTEX_WAIT)?;
            nft_mutex_wait_event(&hdr, &read(b))
        }
        K::NftSend => {
            // Records of older versions end before the batch counts (and say "not counted").
            need(kind, b, common::NFT_SEND_V1_LEN)?;
            nft_send_event(&hdr, b)
        }
        K::XtReplace => {
            need(kind, b, sizes::XT_REPLACE)?;
            xt_replace_event(&hdr, &read(b))
        }
        K::ConntrackFail => {
            need(kind, b, sizes::CONNTRACK_FAIL)?;
            conntrack_fail_event(&hdr, &read(b))
        }
        K::Refusal => {
            need(kind, b, sizes::REFUSAL)?;
            refusal_event(&hdr, &read(b))
        }
        K::Drop => {
            need(kind, b, sizes::DROP)?;
            drop_event(&hdr, &read(b))
        }
        K::Ipvs => {
            need(kind, b, sizes::IPVS)?;
            ipvs_event(&hdr, &read(b))?
        }
    })
}

/// A `flock(2)` call on a watched lock file.
#[inline]
fn flock_call_event(hdr: &common::EventHeader, e: &common::FlockCallEvent) -> Event {
    Event::FlockCall(FlockCallEvent {
        ts_ns: hdr.ts_ns,
        enter_ns: e.enter_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
        owner: e.owner,
        dev: e.dev,
        ino: e.ino,
        ret: e.ret,
        cmd: (e.cmd != u32::MAX).then_some(e.cmd),
    })
}

/// A program started, with its argv.
#[inline]
fn exec_event(hdr: &common::EventHeader, b: &[u8]) -> Event {
    // Field by field from the input: the struct is ~700 bytes, mostly unused slots.
    type E = common::ExecEvent;
    let field = |off: usize, len: usize| &b[off..off + len];
    let argc: u32 = read(&b[offset_of!(E, argc)..]);
    let truncated: u32 = read(&b[offset_of!(E, args_truncated)..]);
    let args = field(offset_of!(E, args), common::ARGV_SLOTS * common::ARG_LEN);
    Event::Exec(ExecEvent {
        ts_ns: hdr.ts_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
        comm: Comm(read(&b[offset_of!(E, comm)..])),
        filename: shared(field(offset_of!(E, filename), common::FILENAME_LEN)),
        argv: Argv::from_slots(args, (argc as usize).min(common::ARGV_SLOTS)),
        argv_truncated: truncated != 0,
        netns: if b.len() >= common::sizes::EXEC {
            read(&b[offset_of!(E, netns)..])
        } else {
            0
        },
    })
}

/// A thread or process created.
#[inline]
fn fork_event(hdr: &common::EventHeader, e: &common::ForkEvent) -> Event {
    Event::Fork(ForkEvent {
        ts_ns: hdr.ts_ns,
        parent_tgid: hdr.tgid,
        parent_tid: hdr.tid,
        child_tid: e.child_tid,
        comm: Comm(e.comm),
    })
}

/// A process that exited, with its exit status when it had one.
#[inline]
fn exit_event(hdr: &common::EventHeader, e: &common::ExitEvent) -> Event {
    Event::Exit(ExitEvent {
        ts_ns: hdr.ts_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
        comm: Comm(e.comm),
        exit_code: (e.has_code != 0).then_some(e.exit_code & 0xff),
    })
}

/// An xtables get or set sockopt, with the table head when it was read.
#[inline]
fn table_replace_event(hdr: &common::EventHeader, b: &[u8]) -> Event {
    type E = common::TableReplaceEvent;
    let head_recorded = b.len() >= common::TABLE_REPLACE_V2_LEN;
    let head = if head_recorded && read::<u32>(&b[offset_of!(E, head_ok)..]) != 0 {
        Some(Box::new(TableHead {
            name: read(&b[offset_of!(E, table)..]),
            entries: read(&b[offset_of!(E, num_entries)..]),
            bytes: read(&b[offset_of!(E, size)..]),
        }))
    } else {
        None
    };
    // Records of versions before it: unknown.
    let netns = if b.len() >= common::sizes::TABLE_REPLACE {
        read(&b[offset_of!(E, netns)..])
    } else {
        0
    };
    Event::TableReplace(TableReplaceEvent {
        ts_ns: hdr.ts_ns,
        enter_ns: read(&b[offset_of!(E, enter_ns)..]),
        tgid: hdr.tgid,
        tid: hdr.tid,
        level: read(&b[offset_of!(E, level)..]),
        optname: read(&b[offset_of!(E, optname)..]),
        optlen: read(&b[offset_of!(E, optlen)..]),
        ret: read(&b[offset_of!(E, ret)..]),
        head,
        head_recorded,
        read: head_recorded && read::<u32>(&b[offset_of!(E, dir)..]) == common::SOCKOPT_GET,
        netns,
    })
}

/// An nf_tables batch committed, with its counts when the record has them.
#[inline]
fn nft_commit_event(hdr: &common::EventHeader, b: &[u8]) -> Event {
    type E = common::NftCommitEvent;
    let batch = if b.len() >= common::sizes::NFT_COMMIT {
        let e: E = read(b);
        nft_batch(e.batch, e.added, e.deleted)
    } else {
        None
    };
    Event::NftCommit(NftCommitEvent {
        ts_ns: hdr.ts_ns,
        enter_ns: read(&b[offset_of!(E, enter_ns)..]),
        tgid: hdr.tgid,
        tid: hdr.tid,
        netns: read(&b[offset_of!(E, netns)..]),
        comm: Comm(read(&b[offset_of!(E, comm)..])),
        batch,
    })
}

/// A wait for one of nf_tables' mutexes, with the holder when known.
#[inline]
fn nft_mutex_wait_event(hdr: &common::EventHeader, e: &common::NftMutexWaitEvent) -> Event {
    Event::NftMutexWait(Box::new(NftMutexWaitEvent {
        ts_ns: hdr.ts_ns,
        start_ns: e.start_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
        comm: Comm(e.comm),
        netns: e.netns,
        mutex: if e.mutex == common::NFT_MUTEX_NFNL {
            NftMutex::Nfnl
        } else {
            NftMutex::Commit
        },
        lock: e.lock,
        ret: e.ret,
        holder: (e.holder_tid != 0).then_some((e.holder_tid, e.holder_tgid)),
        holder_comm: Comm(e.holder_comm),
    }))
}

/// An nf_tables netlink send, with its batch counts when the record has them.
#[inline]
fn nft_send_event(hdr: &common::EventHeader, b: &[u8]) -> Event {
    type E = common::NftSendEvent;
    let batch = if b.len() >= common::sizes::NFT_SEND {
        let e: E = read(b);
        nft_batch(e.batch, e.added, e.deleted)
    } else {
        None
    };
    Event::NftSend(Box::new(NftSendEvent {
        ts_ns: hdr.ts_ns,
        enter_ns: read(&b[offset_of!(E, enter_ns)..]),
        tgid: hdr.tgid,
        tid: hdr.tid,
        comm: Comm(read(&b[offset_of!(E, comm)..])),
        netns: read(&b[offset_of!(E, netns)..]),
        ret: read(&b[offset_of!(E, ret)..]),
        batch,
    }))
}

/// The kernel part of an xtables table replace.
#[inline]
fn xt_replace_event(hdr: &common::EventHeader, e: &common::XtReplaceEvent) -> Event {
    Event::XtReplace(XtReplaceEvent {
        ts_ns: hdr.ts_ns,
        enter_ns: e.enter_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
    })
}

/// A connection conntrack refused (table full or insert failed).
#[inline]
fn conntrack_fail_event(hdr: &common::EventHeader, e: &common::ConntrackFailEvent) -> Event {
    Event::ConntrackFail(ConntrackFail {
        ts_ns: hdr.ts_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
        comm: Comm(e.comm),
        what: match e.what {
            common::CT_FAIL_TABLE_FULL => CtFailKind::TableFull,
            _ => CtFailKind::InsertFailed,
        },
        netns: e.netns,
        l4proto: e.l4proto,
        saddr: ip_addr(e.family, &e.saddr),
        daddr: ip_addr(e.family, &e.daddr),
        sport: e.sport,
        dport: e.dport,
    })
}

/// A connection the node refused, sampled.
#[inline]
fn refusal_event(hdr: &common::EventHeader, e: &common::RefusalEvent) -> Event {
    let addr = |a: &[u8; 16]| ip_addr(e.family, a);
    Event::Refusal(RefusalSample {
        ts_ns: hdr.ts_ns,
        tgid: hdr.tgid,
        hold_start_ns: e.hold_start_ns,
        netns: e.netns,
        kind: e.kind,
        detail: e.detail,
        l4proto: e.l4proto,
        // Without the packet's header only the destination is known.
        saddr: (e.l4proto != 0).then(|| addr(&e.saddr)).flatten(),
        daddr: addr(&e.daddr),
        sport: e.sport,
        dport: e.dport,
    })
}

/// A packet the kernel dropped, sampled.
#[inline]
fn drop_event(hdr: &common::EventHeader, e: &common::DropEvent) -> Event {
    let addr = |a: &[u8; 16]| ip_addr(e.family, a);
    Event::Drop(DropSample {
        ts_ns: hdr.ts_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
        location: e.location,
        netns: e.netns,
        ifindex: e.ifindex,
        reason: e.reason,
        ethertype: e.ethertype,
        l4proto: e.l4proto,
        saddr: addr(&e.saddr),
        daddr: addr(&e.daddr),
        sport: e.sport,
        dport: e.dport,
    })
}

/// An IPVS connection or table change; an unknown operation is an error.
#[inline]
fn ipvs_event(hdr: &common::EventHeader, e: &common::IpvsEvent) -> Result<Event, DecodeError> {
    let op = match e.op {
        common::IPVS_OP_SCHEDULED => IpvsOp::Scheduled,
        common::IPVS_OP_STALE => IpvsOp::Stale,
        common::IPVS_OP_EXPIRED => IpvsOp::Expired,
        common::IPVS_OP_DEST_ADD => IpvsOp::DestAdded,
        common::IPVS_OP_DEST_DEL => IpvsOp::DestRemoved,
        common::IPVS_OP_DEST_EDIT => IpvsOp::DestEdited,
        common::IPVS_OP_SVC_ADD => IpvsOp::ServiceAdded,
        common::IPVS_OP_SVC_EDIT => IpvsOp::ServiceEdited,
        common::IPVS_OP_SVC_DEL => IpvsOp::ServiceRemoved,
        _ => return Err(DecodeError::UnknownKind { kind: hdr.kind }),
    };
    let is_conn = e.conn != 0;
    Ok(Event::Ipvs(Box::new(IpvsEvent {
        ts_ns: hdr.ts_ns,
        tgid: hdr.tgid,
        tid: hdr.tid,
        comm: Comm(e.comm),
        op,
        conn: e.conn,
        protocol: e.protocol,
        service: inet_addr(e.af, &e.vaddr, e.vport),
        client: is_conn.then(|| inet_addr(e.af, &e.caddr, e.cport)),
        backend: inet_addr(e.af, &e.daddr, e.dport),
        dest_state: DestState::from_u8(e.dest_state),
        action: StaleAction::from_u8(e.action),
        weight: e.weight,
        ret: e.ret,
        packets: e.packets,
        last_packet_ns: e.last_packet_ns,
        timer_left_ns: e.timer_left_ns,
    })))
}

/// An address of a kernel event: 4 bytes for IPv4 (`DROP_FAMILY_INET`), 16 for IPv6.
pub fn ip_addr(family: u8, a: &[u8; 16]) -> Option<IpAddr> {
    match family {
        common::DROP_FAMILY_INET => Some(IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))),
        common::DROP_FAMILY_INET6 => Some(IpAddr::V6(Ipv6Addr::from(*a))),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
