//! Capture files: what `xtlock record` writes and `xtlock report`/`export` read back.
//!
//! A capture stores the raw kernel event bytes exactly as the ring buffer delivered them (plus
//! process snapshots and lost-event counts), so a later xtlock can re-analyse an old capture
//! with its newer analysis. Records go into checksummed, LZ4-compressed blocks of ~64 KiB;
//! each block is written with one `write` and flushed, so a killed recorder loses at most the
//! block it had not written yet (the recorder seals one at least every second).
//!
//! The byte layout is specified in `docs/capture-format.md`; [`format`] implements it.

pub mod damage;
pub mod format;
pub mod reader;
pub mod writer;

use std::{fmt, io};

pub use damage::{DamageSummary, DamagedRegion, Shortfall};
pub use format::{CaptureHeader, CaptureLock, CaptureProbe, Trailer, FORMAT_VERSION};
pub use reader::{CaptureReader, Events, OwnedRecord, ReadStats, Record};
pub use writer::{CaptureStats, CaptureWriter};

use crate::decode::DecodeError;

/// What went wrong reading or writing a capture. Reader errors name the byte offset in the
/// file where the problem starts.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("offset {offset}: I/O error: {error}")]
    Io { offset: u64, error: io::Error },
    #[error("not an xtlock capture (no XTLKCAP magic at offset 0)")]
    NotACapture,
    #[error(
        "capture format version {found} is newer than this xtlock supports ({supported}): \
         upgrade xtlock"
    )]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error(
        "offset {offset}: {what} is unknown to this xtlock (the capture was written by a newer \
         one): upgrade xtlock; {} before it were read",
        Count(*events)
    )]
    Unsupported {
        offset: u64,
        what: String,
        events: u64,
    },
    #[error(
        "the capture header is cut short ({have} of {want} bytes): the recorder stopped before \
         writing anything"
    )]
    HeaderCutShort { have: u64, want: u64 },
    /// The file ends without an end-of-capture trailer: the recorder did not finish (killed,
    /// crashed, machine lost). Not fatal: everything before `offset` was read.
    #[error(
        "offset {offset}: the capture ends without its end-of-capture record{}: it was cut short \
         (the recorder did not finish, e.g. it was killed); {} before it were read",
        Partial(*partial),
        Count(*events)
    )]
    CutShort {
        offset: u64,
        /// `(have, want)` bytes of a block that was being written, if any.
        partial: Option<(u64, u64)>,
        events: u64,
    },
    /// The bytes at `offset` are not what the format says, and reading cannot go on past them
    /// (the file header, or an end record that disagrees with an undamaged file).
    #[error(
        "offset {offset}: {problem}: the file is damaged after this point; {} before it \
         were read",
        Count(*events)
    )]
    Damaged {
        offset: u64,
        problem: Damage,
        events: u64,
    },
    /// A damaged stretch of blocks the reader skipped: not fatal, reading went on at the next
    /// intact block (or the file ended; the error that says so comes next).
    #[error("{0}")]
    Skipped(Box<DamagedRegion>),
    /// A kernel record that `decode` rejects (often an event kind from a newer xtlock). Not
    /// fatal: the next record can still be read.
    #[error("offset {offset} (block record {record}): kernel event not decoded: {error}")]
    Decode {
        offset: u64,
        record: u32,
        error: DecodeError,
    },
    #[error("capture header: {0}")]
    HeaderJson(serde_json::Error),
    #[error("record of {len} bytes is larger than the {max} bytes a capture record may hold")]
    RecordTooLarge { len: usize, max: usize },
    #[error("an earlier write to the capture failed; the writer stopped")]
    WriterFailed,
}

impl CaptureError {
    /// The file offset the error is about, when it has one.
    pub fn offset(&self) -> Option<u64> {
        match self {
            CaptureError::Io { offset, .. }
            | CaptureError::Unsupported { offset, .. }
            | CaptureError::CutShort { offset, .. }
            | CaptureError::Damaged { offset, .. }
            | CaptureError::Decode { offset, .. } => Some(*offset),
            CaptureError::Skipped(r) => Some(r.offset),
            CaptureError::NotACapture => Some(0),
            _ => None,
        }
    }

    /// Why reading stopped before the end, for "FILE {why}; ... covers the part before it":
    /// a newer writer's record is not damage, and is not called so.
    pub fn stopped_because(&self) -> &'static str {
        match self {
            CaptureError::Unsupported { .. } | CaptureError::UnsupportedVersion { .. } => {
                "holds records a newer xtlock wrote"
            }
            _ => "is damaged",
        }
    }

    /// The capture simply stops (no trailer): report what was read and say so.
    pub fn is_cut_short(&self) -> bool {
        matches!(
            self,
            CaptureError::CutShort { .. } | CaptureError::HeaderCutShort { .. }
        )
    }

    /// Reading can go on after this error (a single undecodable kernel event, or damage that
    /// was skipped).
    pub fn is_recoverable(&self) -> bool {
        matches!(self, CaptureError::Decode { .. } | CaptureError::Skipped(_))
    }
}

/// What was wrong at the offset of a [`CaptureError::Damaged`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Damage {
    #[error("capture format version 0 does not exist")]
    VersionZero,
    #[error("header length {len} is impossible (at most {max})")]
    HeaderTooLarge { len: u64, max: u64 },
    #[error("header checksum mismatch (expected {expected:#010x}, found {found:#010x})")]
    HeaderChecksum { expected: u32, found: u32 },
    #[error("header is not valid JSON: {0}")]
    HeaderJson(String),
    #[error("no block magic (expected \"XTLB\", found {found:02x?})")]
    BlockMagic { found: Vec<u8> },
    #[error("block header checksum mismatch (expected {expected:#010x}, found {found:#010x})")]
    BlockHeaderChecksum { expected: u32, found: u32 },
    #[error("payload checksum mismatch (expected {expected:#010x}, found {found:#010x})")]
    BlockChecksum { expected: u32, found: u32 },
    #[error("block sequence number {found}, expected {expected}")]
    Sequence { expected: u32, found: u32 },
    #[error("block length {len} is impossible (at most {max})")]
    BlockTooLarge { len: u64, max: u64 },
    #[error("uncompressed block of {raw} bytes stored in {stored}")]
    StoredLength { raw: u64, stored: u64 },
    #[error("block does not decompress: {0}")]
    Decompress(String),
    #[error("block record {record}: {reason}")]
    Record { record: u32, reason: String },
    #[error("block holds {found} records, its header says {expected}")]
    RecordCount { expected: u32, found: u32 },
    #[error("end-of-capture record says {what} {expected}, the file holds {found}")]
    TrailerMismatch {
        what: &'static str,
        expected: u64,
        found: u64,
    },
}

/// "no events" / "1 event" / "1,234 events".
struct Count(u64);

impl fmt::Display for Count {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => f.write_str("no events"),
            1 => f.write_str("1 event"),
            n => write!(f, "{} events", thousands(n)),
        }
    }
}

struct Partial(Option<(u64, u64)>);

impl fmt::Display for Partial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => Ok(()),
            Some((have, want)) => {
                write!(f, " (a last block is incomplete: {have} of {want} bytes)")
            }
        }
    }
}

/// `1234567` as `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && i % 3 == digits.len() % 3 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests;
