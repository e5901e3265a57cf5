//! Reads a capture back, block by block, checking every checksum before trusting a byte.
//!
//! Nothing here panics or allocates more than `MAX_BLOCK_LEN` (twice, plus
//! `MAX_SPARSE_KERNEL_LEN` for sparse kernel events) whatever the input: every length is
//! checked against its bound and against the bytes actually there.

use std::{
    fs::File,
    io::{self, Read},
    path::Path,
};

use super::{
    format::{self, BlockHeader, CaptureHeader, Trailer, BLOCK_HEADER_LEN, FILE_PREFIX_LEN},
    CaptureError, Damage,
};
use crate::decode::{self, Event, ProcInfo};

/// One record, borrowing the reader's block buffer (no allocation for kernel events).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record<'a> {
    /// Raw kernel event bytes, exactly as the ring buffer delivered them (a sparse record
    /// expanded back to them).
    Kernel(&'a [u8]),
    Proc(ProcInfo),
    Lost {
        ts_ns: u64,
        count: u64,
    },
    /// A synthetic record (kinds 5..=14): reason names, a kernel symbol, drop counts,
    /// conntrack counters, ..., an address presence, as the event the live source made.
    Synthetic(Event),
    /// The recorder finished cleanly; always the last record.
    End(Trailer),
}

/// A [`Record`] that owns its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnedRecord {
    Kernel(Vec<u8>),
    Proc(ProcInfo),
    Lost { ts_ns: u64, count: u64 },
    Synthetic(Event),
    End(Trailer),
}

impl Record<'_> {
    pub fn into_owned(self) -> OwnedRecord {
        match self {
            Record::Kernel(b) => OwnedRecord::Kernel(b.to_vec()),
            Record::Proc(p) => OwnedRecord::Proc(p),
            Record::Lost { ts_ns, count } => OwnedRecord::Lost { ts_ns, count },
            Record::Synthetic(e) => OwnedRecord::Synthetic(e),
            Record::End(t) => OwnedRecord::End(t),
        }
    }
}

/// What the reader has read so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes of the file consumed (header and whole blocks).
    pub bytes: u64,
    pub blocks: u64,
    pub kernel_events: u64,
    pub proc_records: u64,
    pub lost_records: u64,
    pub lost_events: u64,
    /// Drop records (reason names, symbols, drop counts, conntrack counters).
    pub synthetic_records: u64,
    /// Records of kinds this xtlock does not know, skipped (a newer writer's additions).
    pub unknown_records: u64,
}

pub struct CaptureReader<R> {
    inner: R,
    /// File offset of the current block.
    block_offset: u64,
    next_seq: u32,
    /// Stored payload of the current block; reused.
    stored: Vec<u8>,
    /// Uncompressed records of the current block; reused.
    raw: Vec<u8>,
    /// The last sparse kernel event, expanded; reused (at most `MAX_SPARSE_KERNEL_LEN`).
    sparse: Vec<u8>,
    cursor: usize,
    block_records: u32,
    /// Records of the current block consumed, skipped ones included.
    seen: u32,
    stats: ReadStats,
    trailer: Option<Trailer>,
    /// Set after the trailer or a fatal error: the reader yields nothing more.
    done: bool,
}

impl CaptureReader<File> {
    pub fn open(path: impl AsRef<Path>) -> Result<(CaptureHeader, Self), CaptureError> {
        let file = File::open(path.as_ref()).map_err(|source| CaptureError::Io {
            offset: 0,
            error: source,
        })?;
        Self::new(file)
    }
}

impl<R: Read> CaptureReader<R> {
    /// Reads and checks the file header. Blocks are read as records are asked for.
    pub fn new(mut inner: R) -> Result<(CaptureHeader, Self), CaptureError> {
        let (header, len) = read_file_header(&mut inner)?;
        let reader = CaptureReader {
            inner,
            block_offset: len,
            next_seq: 0,
            stored: Vec::new(),
            raw: Vec::new(),
            sparse: Vec::new(),
            cursor: 0,
            block_records: 0,
            seen: 0,
            stats: ReadStats {
                bytes: len,
                ..Default::default()
            },
            trailer: None,
            done: false,
        };
        Ok((header, reader))
    }

    /// The next record; `None` after the end-of-capture record or after an error.
    ///
    /// A capture that stops without its end record yields [`CaptureError::CutShort`] last:
    /// everything before it is good, the recorder just did not finish.
    pub fn next_record(&mut self) -> Option<Result<Record<'_>, CaptureError>> {
        loop {
            if self.done {
                return None;
            }
            if self.cursor >= self.raw.len() {
                if let Err(e) = self.check_block_done() {
                    return Some(Err(self.fail(e)));
                }
                match self.load_block() {
                    Ok(true) => continue,
                    Ok(false) => {
                        let e = CaptureError::CutShort {
                            offset: self.stats.bytes,
                            partial: None,
                            events: self.stats.kernel_events,
                        };
                        return Some(Err(self.fail(e)));
                    }
                    Err(e) => return Some(Err(self.fail(e))),
                }
            }
            let (kind, start, end) = match self.next_body() {
                Ok(r) => r,
                Err(reason) => {
                    let e = self.damaged(Damage::Record {
                        record: self.seen,
                        reason,
                    });
                    return Some(Err(self.fail(e)));
                }
            };
            self.seen += 1;
            // Positions only so far: the borrow of `raw` is taken at the return.
            match kind {
                format::KIND_KERNEL => {
                    self.stats.kernel_events += 1;
                    return Some(Ok(Record::Kernel(&self.raw[start..end])));
                }
                format::KIND_KERNEL_SPARSE => {
                    let body = &self.raw[start..end];
                    return Some(match format::expand_sparse_kernel(body, &mut self.sparse) {
                        Ok(n) => {
                            self.stats.kernel_events += 1;
                            Ok(Record::Kernel(&self.sparse[..n]))
                        }
                        Err(reason) => Err(self.record_error(reason)),
                    });
                }
                format::KIND_PROC => {
                    return Some(match format::decode_proc(&self.raw[start..end]) {
                        Ok(p) => {
                            self.stats.proc_records += 1;
                            Ok(Record::Proc(p))
                        }
                        Err(reason) => Err(self.record_error(reason)),
                    });
                }
                format::KIND_LOST => {
                    return Some(match format::decode_lost(&self.raw[start..end]) {
                        Ok((ts_ns, count)) => {
                            self.stats.lost_records += 1;
                            self.stats.lost_events = self.stats.lost_events.saturating_add(count);
                            Ok(Record::Lost { ts_ns, count })
                        }
                        Err(reason) => Err(self.record_error(reason)),
                    });
                }
                format::KIND_END => {
                    return Some(match format::decode_trailer(&self.raw[start..end]) {
                        Ok(t) => match self.check_trailer(&t) {
                            Ok(()) => {
                                self.trailer = Some(t);
                                // Readers stop at the trailer, whatever follows it.
                                self.done = true;
                                Ok(Record::End(t))
                            }
                            Err(e) => Err(self.fail(e)),
                        },
                        Err(reason) => Err(self.record_error(reason)),
                    });
                }
                format::KIND_DROP_SETUP
                | format::KIND_KERNEL_SYMBOL
                | format::KIND_DROP_COUNTS
                | format::KIND_CONNTRACK
                | format::KIND_LOCK_SEED
                | format::KIND_IPVS_COUNTS
                | format::KIND_POD
                | format::KIND_REFUSAL_COUNTS
                | format::KIND_RULE_TABLE
                | format::KIND_ADDR
                | format::KIND_CT_ENTRIES => {
                    return Some(
                        match format::decode_drop_event(kind, &self.raw[start..end]) {
                            Ok(ev) => {
                                self.stats.synthetic_records += 1;
                                Ok(Record::Synthetic(ev))
                            }
                            Err(reason) => Err(self.record_error(reason)),
                        },
                    );
                }
                k if k >= format::KIND_CRITICAL_MIN => {
                    let e = CaptureError::Unsupported {
                        offset: self.block_offset,
                        what: format!("record kind {k} (block record {})", self.seen - 1),
                        events: self.stats.kernel_events,
                    };
                    return Some(Err(self.fail(e)));
                }
                _ => self.stats.unknown_records += 1,
            }
        }
    }

    /// [`next_record`](Self::next_record), owned.
    pub fn next_owned(&mut self) -> Option<Result<OwnedRecord, CaptureError>> {
        self.next_record().map(|r| r.map(Record::into_owned))
    }

    /// All records, owned; the last item is `End` or an error.
    pub fn records(mut self) -> impl Iterator<Item = Result<OwnedRecord, CaptureError>> {
        std::iter::from_fn(move || self.next_owned())
    }

    /// Decoded events: kernel records through a [`decode::Decoder`], process and lost records
    /// as `Event::Proc`/`Event::Lost`. Ends after the end record or the first fatal error;
    /// [`CaptureError::Decode`] items are not fatal and iteration goes on after them.
    pub fn events(self) -> Events<R> {
        Events {
            reader: self,
            decoder: decode::Decoder::default(),
        }
    }

    pub fn stats(&self) -> ReadStats {
        self.stats
    }

    /// The end-of-capture record, once read.
    pub fn trailer(&self) -> Option<&Trailer> {
        self.trailer.as_ref()
    }

    /// File offset of the block the last record came from.
    pub fn block_offset(&self) -> u64 {
        self.block_offset
    }

    fn fail(&mut self, e: CaptureError) -> CaptureError {
        self.done = true;
        e
    }

    fn damaged(&self, problem: Damage) -> CaptureError {
        self.damaged_at(self.block_offset, problem)
    }

    fn damaged_at(&self, offset: u64, problem: Damage) -> CaptureError {
        CaptureError::Damaged {
            offset,
            problem,
            events: self.stats.kernel_events,
        }
    }

    fn record_error(&mut self, reason: String) -> CaptureError {
        let e = self.damaged(Damage::Record {
            record: self.seen - 1,
            reason,
        });
        self.fail(e)
    }

    /// Kind and body range of the record at the cursor; advances the cursor past it.
    #[inline]
    fn next_body(&mut self) -> Result<(u8, usize, usize), String> {
        let raw = &self.raw;
        let kind = *raw
            .get(self.cursor)
            .ok_or_else(|| "record past the end of the block".to_string())?;
        let mut pos = self.cursor + 1;
        let len = format::get_varint(raw, &mut pos)
            .ok_or_else(|| format!("kind {kind}: bad record length"))?;
        let left = raw.len() - pos;
        if len > left as u64 {
            return Err(format!(
                "kind {kind}: length {len} runs past the {left} bytes left in the block"
            ));
        }
        let end = pos + len as usize;
        self.cursor = end;
        Ok((kind, pos, end))
    }

    fn check_block_done(&self) -> Result<(), CaptureError> {
        if self.seen != self.block_records {
            return Err(self.damaged(Damage::RecordCount {
                expected: self.block_records,
                found: self.seen,
            }));
        }
        Ok(())
    }

    fn check_trailer(&self, t: &Trailer) -> Result<(), CaptureError> {
        let s = &self.stats;
        for (what, expected, found) in [
            ("kernel events", t.kernel_events, s.kernel_events),
            ("process records", t.proc_records, s.proc_records),
            ("lost records", t.lost_records, s.lost_records),
            ("lost events", t.lost_events, s.lost_events),
            ("blocks", t.blocks, s.blocks),
        ] {
            if expected != found {
                return Err(self.damaged(Damage::TrailerMismatch {
                    what,
                    expected,
                    found,
                }));
            }
        }
        Ok(())
    }

    /// Reads the next block into `raw`. `Ok(false)`: the file ends cleanly before it.
    fn load_block(&mut self) -> Result<bool, CaptureError> {
        let offset = self.stats.bytes;
        self.block_offset = offset;
        let io = |source| CaptureError::Io {
            offset,
            error: source,
        };
        let mut hb = [0u8; BLOCK_HEADER_LEN];
        let n = read_full(&mut self.inner, &mut hb).map_err(io)?;
        if n == 0 {
            return Ok(false);
        }
        let magic_len = n.min(format::BLOCK_MAGIC.len());
        if hb[..magic_len] != format::BLOCK_MAGIC[..magic_len] {
            return Err(self.damaged(Damage::BlockMagic {
                found: hb[..magic_len].to_vec(),
            }));
        }
        if n < BLOCK_HEADER_LEN {
            return Err(self.cut_short(n, BLOCK_HEADER_LEN));
        }
        let (expected, found) = BlockHeader::checksums(&hb);
        if expected != found {
            return Err(self.damaged(Damage::BlockHeaderChecksum { expected, found }));
        }
        let h = BlockHeader::decode(&hb);
        if h.seq != self.next_seq {
            return Err(self.damaged(Damage::Sequence {
                expected: self.next_seq,
                found: h.seq,
            }));
        }
        for len in [h.raw_len, h.stored_len] {
            if len as usize > format::MAX_BLOCK_LEN {
                return Err(self.damaged(Damage::BlockTooLarge {
                    len: u64::from(len),
                    max: format::MAX_BLOCK_LEN as u64,
                }));
            }
        }
        let (raw_len, stored_len) = (h.raw_len as usize, h.stored_len as usize);
        match h.compression {
            format::COMPRESSION_NONE if stored_len != raw_len => {
                return Err(self.damaged(Damage::StoredLength {
                    raw: raw_len as u64,
                    stored: stored_len as u64,
                }));
            }
            format::COMPRESSION_NONE | format::COMPRESSION_LZ4 => {}
            c => {
                return Err(CaptureError::Unsupported {
                    offset,
                    what: format!("block compression {c}"),
                    events: self.stats.kernel_events,
                })
            }
        }

        self.stored.clear();
        self.stored.resize(stored_len, 0);
        let n = read_full(&mut self.inner, &mut self.stored).map_err(io)?;
        if n < stored_len {
            return Err(self.cut_short(BLOCK_HEADER_LEN + n, BLOCK_HEADER_LEN + stored_len));
        }
        let found = crc32fast::hash(&self.stored);
        if found != h.payload_crc {
            return Err(self.damaged(Damage::BlockChecksum {
                expected: h.payload_crc,
                found,
            }));
        }
        if h.compression == format::COMPRESSION_LZ4 {
            // No clearing: every byte is overwritten, or the block is refused below.
            self.raw.resize(raw_len, 0);
            match lz4_flex::block::decompress_into(&self.stored, &mut self.raw) {
                Ok(n) if n == raw_len => {}
                Ok(n) => {
                    return Err(self.damaged(Damage::Decompress(format!(
                        "{n} bytes, the header says {raw_len}"
                    ))))
                }
                Err(e) => return Err(self.damaged(Damage::Decompress(e.to_string()))),
            }
        } else {
            std::mem::swap(&mut self.raw, &mut self.stored);
        }

        self.stats.bytes += (BLOCK_HEADER_LEN + stored_len) as u64;
        self.stats.blocks += 1;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.cursor = 0;
        self.block_records = h.records;
        self.seen = 0;
        Ok(true)
    }

    fn cut_short(&self, have: usize, want: usize) -> CaptureError {
        CaptureError::CutShort {
            offset: self.block_offset,
            partial: Some((have as u64, want as u64)),
            events: self.stats.kernel_events,
        }
    }
}

/// Iterator of [`CaptureReader::events`].
pub struct Events<R> {
    reader: CaptureReader<R>,
    /// Also holds the second event of a two-event record (a `Hold`'s release).
    decoder: decode::Decoder,
}

impl<R: Read> Events<R> {
    /// The reader, for its stats and trailer.
    pub fn reader(&self) -> &CaptureReader<R> {
        &self.reader
    }
}

impl<R: Read> Iterator for Events<R> {
    type Item = Result<Event, CaptureError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(ev) = self.decoder.pending() {
            return Some(Ok(ev));
        }
        loop {
            let decoded = match self.reader.next_record()? {
                Ok(Record::Kernel(b)) => self.decoder.decode(b),
                Ok(Record::Proc(p)) => return Some(Ok(Event::Proc(p))),
                Ok(Record::Lost { ts_ns, count }) => return Some(Ok(Event::Lost { ts_ns, count })),
                Ok(Record::Synthetic(ev)) => return Some(Ok(ev)),
                // The reader is done after the end record.
                Ok(Record::End(_)) => return None,
                Err(e) => return Some(Err(e)),
            };
            match decoded {
                Ok(Some(ev)) => return Some(Ok(ev)),
                // A take had already: the next record.
                Ok(None) => {}
                Err(source) => {
                    return Some(Err(CaptureError::Decode {
                        offset: self.reader.block_offset,
                        record: self.reader.seen.saturating_sub(1),
                        error: source,
                    }))
                }
            }
        }
    }
}

/// Reads and checks the file header; returns it and its length in bytes.
fn read_file_header<R: Read>(r: &mut R) -> Result<(CaptureHeader, u64), CaptureError> {
    let io = |source| CaptureError::Io {
        offset: 0,
        error: source,
    };
    let mut prefix = [0u8; FILE_PREFIX_LEN];
    let n = read_full(r, &mut prefix).map_err(io)?;
    let magic_len = n.min(format::MAGIC.len());
    if n == 0 || prefix[..magic_len] != format::MAGIC[..magic_len] {
        return Err(CaptureError::NotACapture);
    }
    let cut = |have: usize, want: usize| CaptureError::HeaderCutShort {
        have: have as u64,
        want: want as u64,
    };
    if n < 10 {
        return Err(cut(n, FILE_PREFIX_LEN));
    }
    // Bytes 0..10 (magic, version) mean the same in every version: check the version before
    // anything whose layout it governs.
    let version = u16::from_le_bytes([prefix[8], prefix[9]]);
    let damaged = |offset: u64, problem| CaptureError::Damaged {
        offset,
        problem,
        events: 0,
    };
    if version == 0 {
        return Err(damaged(8, Damage::VersionZero));
    }
    if version > format::FORMAT_VERSION {
        return Err(CaptureError::UnsupportedVersion {
            found: version,
            supported: format::FORMAT_VERSION,
        });
    }
    if n < FILE_PREFIX_LEN {
        return Err(cut(n, FILE_PREFIX_LEN));
    }
    let json_len = u32::from_le_bytes([prefix[10], prefix[11], prefix[12], prefix[13]]) as usize;
    if json_len > format::MAX_HEADER_JSON {
        return Err(damaged(
            10,
            Damage::HeaderTooLarge {
                len: json_len as u64,
                max: format::MAX_HEADER_JSON as u64,
            },
        ));
    }
    let total = FILE_PREFIX_LEN + json_len + 4;
    let mut rest = vec![0u8; json_len + 4];
    let m = read_full(r, &mut rest).map_err(|source| CaptureError::Io {
        offset: FILE_PREFIX_LEN as u64,
        error: source,
    })?;
    if m < rest.len() {
        return Err(cut(FILE_PREFIX_LEN + m, total));
    }
    let (json, crc) = rest.split_at(json_len);
    let expected = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let mut h = crc32fast::Hasher::new();
    h.update(&prefix);
    h.update(json);
    let found = h.finalize();
    if expected != found {
        return Err(damaged(
            (FILE_PREFIX_LEN + json_len) as u64,
            Damage::HeaderChecksum { expected, found },
        ));
    }
    let header = serde_json::from_slice(json)
        .map_err(|e| damaged(FILE_PREFIX_LEN as u64, Damage::HeaderJson(e.to_string())))?;
    Ok((header, total as u64))
}

/// Fills `buf` as far as the input goes; returns the bytes read (short only at end of input).
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
