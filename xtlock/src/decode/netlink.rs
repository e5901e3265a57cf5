//! Netlink as every reader speaks it, in one place: the message framing of a datagram, the
//! attributes (type, length, value, 4-aligned) and their numbers, the requests, and the
//! constants of `linux/netlink.h`, `netfilter/nfnetlink.h` and `genetlink.h`. The families
//! (`nft_table`, `ct_entry`, `ipvs_nl`, rtnetlink in `source/addrs`) only read and write
//! their own attributes on top of it; the socket and its dump loop are `source/netlink.rs`.
//!
//! The headers are checked with `netlink-packet-core` (a length that overruns the datagram
//! is an error, never a read past it).

use netlink_packet_core::{NetlinkBuffer, NlaBuffer, NlasIterator};

/// `sizeof(struct nlmsghdr)`.
pub const NLMSG_HDR: usize = 16;
/// `struct nfgenmsg`: family, version, resource id (big-endian).
pub const NFGENMSG: usize = 4;
/// `struct genlmsghdr`: cmd, version, reserved.
pub const GENLMSG: usize = 4;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 1;
/// Asks for an acknowledgement (an `NLMSG_ERROR` with code 0) when the request succeeds.
pub const NLM_F_ACK: u16 = 4;
/// Set on a message of a dump a change interrupted: the dump is not consistent.
pub const NLM_F_DUMP_INTR: u16 = 16;
/// `NLM_F_ROOT | NLM_F_MATCH`.
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLA_F_NESTED: u16 = 0x8000;
const NLA_F_NET_BYTEORDER: u16 = 0x4000;

/// nfnetlink subsystems, in the high byte of a message type.
pub const NFNL_SUBSYS_CTNETLINK: u16 = 1;
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;

/// A message that is not one, or an attribute that overruns its message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("a netlink message is malformed: {0}")]
    Message(String),
    #[error("a netlink error message is too short")]
    ShortError,
}

/// One netlink message of a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    /// After the header.
    pub payload: &'a [u8],
    /// The whole message, header included.
    pub bytes: &'a [u8],
}

/// What a message says of the exchange it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// The dump is complete.
    Done,
    /// An `NLMSG_ERROR` with code 0: an acknowledgement.
    Ack,
    /// The kernel refused the request: `errno` (positive).
    Refused(i32),
}

impl Message<'_> {
    /// `Done`, an acknowledgement or a refusal; `None` for a message that carries data.
    pub fn control(&self) -> Result<Option<Control>, FrameError> {
        Ok(match self.ty {
            NLMSG_DONE => Some(Control::Done),
            NLMSG_ERROR => match errno(self.payload).ok_or(FrameError::ShortError)? {
                0 => Some(Control::Ack),
                e => Some(Control::Refused(-e)),
            },
            _ => None,
        })
    }

    /// The family-specific header's first byte (nfnetlink's family, genetlink's command).
    pub fn first(&self) -> Option<u8> {
        self.payload.first().copied()
    }

    pub fn interrupted(&self) -> bool {
        self.flags & NLM_F_DUMP_INTR != 0
    }
}

/// The code of an `NLMSG_ERROR` message's payload (0: an acknowledgement; else `-errno`);
/// `None` when too short to hold one.
pub fn errno(payload: &[u8]) -> Option<i32> {
    bytes::<4>(payload).map(i32::from_ne_bytes)
}

/// The messages of one datagram, in order. A message that does not frame is an error and
/// ends the datagram: what follows it cannot be found.
pub fn framed(datagram: &[u8]) -> impl Iterator<Item = Result<Message<'_>, FrameError>> {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        let rest = datagram.get(at..).filter(|r| !r.is_empty())?;
        let one = NetlinkBuffer::new_checked(rest)
            .map_err(|e| FrameError::Message(e.to_string()))
            .and_then(|nl| {
                let len = nl.length() as usize;
                let bytes = rest
                    .get(..len)
                    .ok_or_else(|| FrameError::Message("short netlink message".into()))?;
                Ok(Message {
                    ty: nl.message_type(),
                    flags: nl.flags(),
                    seq: nl.sequence_number(),
                    payload: bytes.get(NLMSG_HDR..).unwrap_or_default(),
                    bytes,
                })
            });
        match &one {
            // NLMSG_ALIGN; `new_checked` proved len >= the header, so this advances.
            Ok(m) => at += m.bytes.len().next_multiple_of(4),
            Err(_) => at = datagram.len(),
        }
        Some(one)
    })
}

/// An attribute that overruns what holds it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a netlink attribute is malformed")]
pub struct AttrError;

/// The attributes of `b`: each one's type (the nested and byte-order flags masked off) and
/// value. A malformed one is an error, and the last item.
pub fn attrs_checked(b: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), AttrError>> {
    let mut failed = false;
    NlasIterator::new(b).map_while(move |a| {
        if failed {
            return None;
        }
        let one = a.map_err(|_| AttrError).and_then(|a: NlaBuffer<&[u8]>| {
            let kind = a.kind() & !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);
            let len = usize::from(a.length());
            // `new_checked` proved 4 <= len <= the buffer's length; the slice of the buffer
            // outlives the NlaBuffer that `value()` would borrow.
            let v = a.into_inner().get(4..len).ok_or(AttrError)?;
            Ok((kind, v))
        });
        failed = one.is_err();
        Some(one)
    })
}

/// The same, stopping quietly at a malformed one (what the kernel wrote is trusted to be
/// whole; a damaged rest is not read).
pub fn attrs(b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    attrs_checked(b).map_while(Result::ok)
}

/// The first `N` bytes of `v`, when it has them.
pub fn bytes<const N: usize>(v: &[u8]) -> Option<[u8; N]> {
    v.get(..N)?.try_into().ok()
}

pub fn be_u16(v: &[u8]) -> Option<u16> {
    bytes(v).map(u16::from_be_bytes)
}

pub fn be_u32(v: &[u8]) -> Option<u32> {
    bytes(v).map(u32::from_be_bytes)
}

pub fn be_u64(v: &[u8]) -> Option<u64> {
    bytes(v).map(u64::from_be_bytes)
}

pub fn ne_u16(v: &[u8]) -> Option<u16> {
    bytes(v).map(u16::from_ne_bytes)
}

pub fn ne_u32(v: &[u8]) -> Option<u32> {
    bytes(v).map(u32::from_ne_bytes)
}

/// A string attribute's text, up to its NUL.
pub fn string(v: &[u8]) -> String {
    let end = v.iter().position(|&c| c == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

/// Appends one attribute, padded to 4 bytes.
pub fn put_attr(b: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    b.extend_from_slice(&(len as u16).to_ne_bytes());
    b.extend_from_slice(&kind.to_ne_bytes());
    b.extend_from_slice(value);
    b.resize(b.len().next_multiple_of(4), 0);
}

/// Appends a NUL-terminated string attribute.
pub fn put_str(b: &mut Vec<u8>, kind: u16, s: &str) {
    let mut v = Vec::with_capacity(s.len() + 1);
    v.extend_from_slice(s.as_bytes());
    v.push(0);
    put_attr(b, kind, &v);
}

/// One attribute holding `inner`'s attributes.
pub fn nested(kind: u16, inner: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    put_attr(&mut b, kind | NLA_F_NESTED, inner);
    b
}

/// A request: the netlink header (its length filled in), then `body` (the family's header
/// and attributes).
pub fn request(ty: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDR + body.len();
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&(len as u32).to_ne_bytes());
    b.extend_from_slice(&ty.to_ne_bytes());
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    // The port id: 0, the kernel's to fill.
    b.extend_from_slice(&0u32.to_ne_bytes());
    b.extend_from_slice(body);
    b
}

/// A dump request's header and body: `request` with `NLM_F_REQUEST | NLM_F_DUMP`.
pub fn dump(ty: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    request(ty, NLM_F_REQUEST | NLM_F_DUMP, seq, body)
}

/// The sequence number of a request (or message).
pub fn seq_of(request: &[u8]) -> Option<u32> {
    request.get(8..12).and_then(ne_u32)
}

/// Whether `request` asks for a dump (answered until `DONE`), not one message.
pub fn is_dump(request: &[u8]) -> bool {
    request
        .get(6..8)
        .and_then(ne_u16)
        .is_some_and(|f| f & NLM_F_DUMP == NLM_F_DUMP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_frame_and_say_their_end() {
        let mut d = dump(0x100, 7, &[1, 2, 3, 4, 5]);
        // Padded to 4 as the kernel pads.
        d.resize(d.len().next_multiple_of(4), 0);
        d.extend(request(NLMSG_ERROR, 0, 7, &0i32.to_ne_bytes()));
        d.extend(request(NLMSG_ERROR, 0, 7, &(-libc::EPERM).to_ne_bytes()));
        d.extend(request(NLMSG_DONE, 0, 7, &0i32.to_ne_bytes()));
        let m: Vec<Message> = framed(&d).collect::<Result<_, _>>().unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(
            (m[0].ty, m[0].seq, m[0].payload),
            (0x100, 7, &[1, 2, 3, 4, 5][..])
        );
        assert!(is_dump(m[0].bytes) && seq_of(m[0].bytes) == Some(7));
        let c: Vec<_> = m.iter().map(|m| m.control().unwrap()).collect();
        assert_eq!(
            c,
            [
                None,
                Some(Control::Ack),
                Some(Control::Refused(libc::EPERM)),
                Some(Control::Done)
            ]
        );
        // Cut anywhere: an error or fewer messages, never a read past the end.
        for cut in 0..d.len() {
            let n = framed(&d[..cut]).filter(Result::is_ok).count();
            assert!(n <= 4);
        }
        // A zero length does not loop.
        assert!(framed(&[0u8; 16]).all(|m| m.is_err()));
    }

    #[test]
    fn attributes_nest_and_stop_at_damage() {
        let mut inner = Vec::new();
        put_attr(&mut inner, 1, &5u32.to_be_bytes());
        put_str(&mut inner, 2, "kube");
        let outer = nested(3, &inner);
        let (k, v) = attrs(&outer).next().unwrap();
        assert_eq!(k, 3, "the nested flag is masked off");
        let a: Vec<_> = attrs(v).collect();
        assert_eq!(be_u32(a[0].1), Some(5));
        assert_eq!((a[1].0, string(a[1].1)), (2, "kube".to_string()));
        // An attribute longer than what holds it.
        let mut bad = outer.clone();
        bad[0] = 200;
        assert_eq!(attrs_checked(&bad).collect::<Vec<_>>(), [Err(AttrError)]);
        assert_eq!(attrs(&bad).count(), 0);
        assert_eq!(be_u64(&[1, 2]), None);
    }
}
