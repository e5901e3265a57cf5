//! Reads a capture back, block by block, checking every checksum before trusting a byte.
//!
//! Damage in a block (or a malformed record in one) is skipped: the reader says where and what
//! was lost ([`CaptureError::Skipped`], [`CaptureReader::damage`]) and reads on from the next
//! intact block, found by its magic and header checksum.
//!
//! Nothing here panics or allocates more than `MAX_BLOCK_LEN` (three times: the stored and
//! decompressed block, and a damaged block's bytes put back to be searched; plus
//! `MAX_SPARSE_KERNEL_LEN` for sparse kernel events) whatever the input: every length is
//! checked against its bound and against the bytes actually there.

use std::{
    fs::File,
    io::{self, Read},
    path::Path,
};

use super::{
    format::{self, BlockHeader, CaptureHeader, Trailer, BLOCK_HEADER_LEN, FILE_PREFIX_LEN},
    CaptureError, Damage, DamageSummary, DamagedRegion, Shortfall,
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
    /// Bytes of the file consumed (header, whole blocks and skipped damage).
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
    input: Input<R>,
    /// File offset of the current block.
    block_offset: u64,
    /// Sequence number of the current block.
    block_seq: u32,
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
    /// Set after the trailer or a fatal error: the reader yields nothing more (but `after`).
    done: bool,
    /// The fatal error to yield once the damage skipped before it has been said.
    after: Option<CaptureError>,
    /// Damage being skipped: no intact block read since it.
    open: Option<OpenRegion>,
    /// The bytes at the input position need searching for the next block (the damaged block's
    /// own lengths are not trusted).
    scanning: bool,
    /// A region just closed, to yield before anything else.
    closed: Option<DamagedRegion>,
    /// Every region skipped so far.
    regions: Vec<DamagedRegion>,
    shortfall: Option<Shortfall>,
    /// The chain names of the rule-table reads so far, shared with the next reads.
    chain_names: format::ChainNames,
}

/// Damage found, reading not yet gone on.
struct OpenRegion {
    offset: u64,
    block: u32,
    problem: Damage,
    partial: bool,
    /// Records dropped whose number is known: the rest of a partly read block, plus those of
    /// the dropped blocks whose header checksum held.
    known_records: u64,
    /// Dropped blocks whose header checksum held.
    known_blocks: u64,
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
            input: Input {
                inner,
                back: Vec::new(),
                back_pos: 0,
                pos: len,
            },
            block_offset: len,
            block_seq: 0,
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
            after: None,
            open: None,
            scanning: false,
            closed: None,
            regions: Vec::new(),
            shortfall: None,
            chain_names: format::ChainNames::default(),
        };
        Ok((header, reader))
    }

    /// The next record; `None` after the end-of-capture record or after a fatal error.
    ///
    /// Damage is skipped: a [`CaptureError::Skipped`] item says where and what was lost, and
    /// the records of the next intact block follow. A capture that stops without its end
    /// record yields [`CaptureError::CutShort`] last: everything before it is good, the
    /// recorder just did not finish.
    pub fn next_record(&mut self) -> Option<Result<Record<'_>, CaptureError>> {
        loop {
            if let Some(region) = self.closed.take() {
                return Some(Err(CaptureError::Skipped(Box::new(region))));
            }
            if self.done {
                return self.after.take().map(Err);
            }
            if self.cursor >= self.raw.len() {
                if self.seen != self.block_records {
                    let expected = self.block_records;
                    self.drop_rest(
                        Damage::RecordCount {
                            expected,
                            found: self.seen,
                        },
                        u64::from(expected.saturating_sub(self.seen)),
                    );
                    continue;
                }
                match self.next_block() {
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
                    let record = self.seen;
                    let left = u64::from(self.block_records.saturating_sub(record));
                    self.drop_rest(Damage::Record { record, reason }, left);
                    continue;
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
                    match format::expand_sparse_kernel(body, &mut self.sparse) {
                        Ok(n) => {
                            self.stats.kernel_events += 1;
                            return Some(Ok(Record::Kernel(&self.sparse[..n])));
                        }
                        Err(reason) => self.record_error(reason),
                    }
                }
                format::KIND_PROC => match format::decode_proc(&self.raw[start..end]) {
                    Ok(p) => {
                        self.stats.proc_records += 1;
                        return Some(Ok(Record::Proc(p)));
                    }
                    Err(reason) => self.record_error(reason),
                },
                format::KIND_LOST => match format::decode_lost(&self.raw[start..end]) {
                    Ok((ts_ns, count)) => {
                        self.stats.lost_records += 1;
                        self.stats.lost_events = self.stats.lost_events.saturating_add(count);
                        return Some(Ok(Record::Lost { ts_ns, count }));
                    }
                    Err(reason) => self.record_error(reason),
                },
                format::KIND_END => match format::decode_trailer(&self.raw[start..end]) {
                    Ok(t) => {
                        return Some(match self.check_trailer(&t) {
                            Ok(()) => {
                                self.trailer = Some(t);
                                // Readers stop at the trailer, whatever follows it.
                                self.done = true;
                                Ok(Record::End(t))
                            }
                            Err(e) => Err(self.fail(e)),
                        });
                    }
                    Err(reason) => self.record_error(reason),
                },
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
                | format::KIND_ENDPOINT_ANSWERS
                | format::KIND_IPVS_TABLE
                | format::KIND_CT_ENTRIES
                | format::KIND_RULE_COUNTERS => {
                    match format::decode_synthetic_with(
                        kind,
                        &self.raw[start..end],
                        &mut self.chain_names,
                    ) {
                        Ok(ev) => {
                            self.stats.synthetic_records += 1;
                            return Some(Ok(Record::Synthetic(ev)));
                        }
                        Err(reason) => self.record_error(reason),
                    }
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
    /// [`CaptureError::Decode`] and [`CaptureError::Skipped`] items are not fatal and
    /// iteration goes on after them.
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

    /// The damage skipped so far (every region yielded as [`CaptureError::Skipped`]), and
    /// what the end record says it took; `None` when nothing was skipped.
    pub fn damage(&self) -> Option<DamageSummary> {
        if self.regions.is_empty() {
            return None;
        }
        Some(DamageSummary {
            regions: self.regions.clone(),
            shortfall: self.shortfall,
        })
    }

    /// Ends reading with `e`; damage being skipped is said first.
    fn fail(&mut self, e: CaptureError) -> CaptureError {
        self.done = true;
        let region = match self.closed.take() {
            Some(r) => Some(r),
            None => self.close_region(None),
        };
        match region {
            Some(region) => {
                self.after = Some(e);
                CaptureError::Skipped(Box::new(region))
            }
            None => e,
        }
    }

    fn damaged(&self, problem: Damage) -> CaptureError {
        CaptureError::Damaged {
            offset: self.block_offset,
            problem,
            events: self.stats.kernel_events,
        }
    }

    /// The body of the record just counted does not decode.
    fn record_error(&mut self, reason: String) {
        let record = self.seen - 1;
        let left = u64::from(self.block_records.saturating_sub(record));
        self.drop_rest(Damage::Record { record, reason }, left);
    }

    /// A malformed record in an intact block: nothing after it in the block can be placed, so
    /// the rest (`left` records) is dropped. The next block starts where this one's lengths
    /// say, so no search is needed.
    fn drop_rest(&mut self, problem: Damage, left: u64) {
        self.cursor = self.raw.len();
        self.seen = self.block_records;
        let (offset, block) = (self.block_offset, self.block_seq);
        let region = self.open.get_or_insert(OpenRegion {
            offset,
            block,
            problem,
            partial: true,
            known_records: 0,
            known_blocks: 0,
        });
        region.known_records += left;
    }

    /// Damage in the block at `offset`: opened as a region, or added to the one open.
    /// `records`: what its header says it holds, when the header's checksum held.
    fn damage_at(&mut self, offset: u64, problem: Damage, records: Option<u32>) {
        let block = self.next_seq;
        let region = self.open.get_or_insert(OpenRegion {
            offset,
            block,
            problem,
            partial: false,
            known_records: 0,
            known_blocks: 0,
        });
        if let Some(n) = records {
            region.known_records += u64::from(n);
            region.known_blocks += 1;
        }
        self.scanning = true;
    }

    /// Closes the open region at the intact block `resumed` (offset, sequence number), or at
    /// the end of the input; returns it, and keeps it for [`damage`](Self::damage).
    fn close_region(&mut self, resumed: Option<(u64, u32)>) -> Option<DamagedRegion> {
        let open = self.open.take()?;
        let (resumed_at, blocks_lost) = match resumed {
            Some((offset, seq)) => (Some(offset), gap(self.next_seq, seq)),
            None => (None, None),
        };
        let end = resumed_at.unwrap_or(self.input.pos);
        let records_lost = match blocks_lost {
            // Every lost block's header was read (or none was lost): the count is exact.
            Some(n) if n == open.known_blocks => Some(open.known_records),
            _ => None,
        };
        let region = DamagedRegion {
            offset: open.offset,
            block: open.block,
            problem: open.problem,
            partial: open.partial,
            blocks_lost,
            records_lost,
            bytes: end.saturating_sub(open.offset),
            resumed_at,
        };
        self.regions.push(region.clone());
        Some(region)
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

    /// The end record's totals must match what was read; after skipped damage they cannot,
    /// and the difference is what the damage took (said with it, not as another error).
    fn check_trailer(&mut self, t: &Trailer) -> Result<(), CaptureError> {
        let s = &self.stats;
        if !self.regions.is_empty() {
            self.shortfall = Some(Shortfall {
                expected: *t,
                read: Trailer {
                    kernel_events: s.kernel_events,
                    proc_records: s.proc_records,
                    lost_records: s.lost_records,
                    lost_events: s.lost_events,
                    blocks: s.blocks,
                },
            });
            return Ok(());
        }
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

    /// Reads the next intact block into `raw`, skipping damage on the way (kept in `open`).
    /// `Ok(false)`: the file ends before another intact block.
    fn next_block(&mut self) -> Result<bool, CaptureError> {
        loop {
            let hb = if self.scanning {
                match self.scan()? {
                    Some(hb) => hb,
                    None => {
                        self.stats.bytes = self.input.pos;
                        return Ok(false);
                    }
                }
            } else {
                let offset = self.input.pos;
                let mut hb = [0u8; BLOCK_HEADER_LEN];
                let n = self.input.read_full(&mut hb)?;
                if n == 0 {
                    self.stats.bytes = self.input.pos;
                    return Ok(false);
                }
                let magic_len = n.min(format::BLOCK_MAGIC.len());
                if hb[..magic_len] != format::BLOCK_MAGIC[..magic_len] {
                    let found = hb[..magic_len].to_vec();
                    self.damage_at(offset, Damage::BlockMagic { found }, None);
                    self.input.unread(&hb[1..n], &[]);
                    continue;
                }
                if n < BLOCK_HEADER_LEN {
                    return Err(self.cut_short(offset, n, BLOCK_HEADER_LEN));
                }
                let (expected, found) = BlockHeader::checksums(&hb);
                if expected != found {
                    let problem = Damage::BlockHeaderChecksum { expected, found };
                    self.damage_at(offset, problem, None);
                    self.input.unread(&hb[1..], &[]);
                    continue;
                }
                hb
            };
            let offset = self.input.pos - BLOCK_HEADER_LEN as u64;
            let h = BlockHeader::decode(&hb);
            if let Some(problem) = self.load_payload(offset, &h)? {
                // Never part of a bad payload: its bytes are searched for the next block.
                self.damage_at(offset, problem, Some(h.records));
                self.input.unread(&hb[1..], &self.stored);
                continue;
            }
            if self.open.is_none() && h.seq != self.next_seq {
                // Intact neighbours with a gap between them: blocks are missing here.
                let (expected, found) = (self.next_seq, h.seq);
                self.damage_at(offset, Damage::Sequence { expected, found }, None);
            }
            self.scanning = false;
            self.closed = self.close_region(Some((offset, h.seq)));
            self.stats.bytes = self.input.pos;
            self.stats.blocks += 1;
            self.block_offset = offset;
            self.block_seq = h.seq;
            self.next_seq = h.seq.wrapping_add(1);
            self.cursor = 0;
            self.block_records = h.records;
            self.seen = 0;
            return Ok(true);
        }
    }

    /// Reads and checks the payload of the block whose (checksummed) header is `h`, into
    /// `raw`. `Ok(Some(problem))`: it is damaged, and `stored` holds the bytes read of it.
    fn load_payload(
        &mut self,
        offset: u64,
        h: &BlockHeader,
    ) -> Result<Option<Damage>, CaptureError> {
        self.stored.clear();
        for len in [h.raw_len, h.stored_len] {
            if len as usize > format::MAX_BLOCK_LEN {
                return Ok(Some(Damage::BlockTooLarge {
                    len: u64::from(len),
                    max: format::MAX_BLOCK_LEN as u64,
                }));
            }
        }
        let (raw_len, stored_len) = (h.raw_len as usize, h.stored_len as usize);
        match h.compression {
            format::COMPRESSION_NONE if stored_len != raw_len => {
                return Ok(Some(Damage::StoredLength {
                    raw: raw_len as u64,
                    stored: stored_len as u64,
                }));
            }
            format::COMPRESSION_NONE | format::COMPRESSION_LZ4 => {}
            c => {
                // A newer writer's block, intact: reading went on to it and stops there.
                self.closed = self.close_region(Some((offset, h.seq)));
                return Err(CaptureError::Unsupported {
                    offset,
                    what: format!("block compression {c}"),
                    events: self.stats.kernel_events,
                });
            }
        }

        self.stored.resize(stored_len, 0);
        let n = self.input.read_full(&mut self.stored)?;
        if n < stored_len {
            return Err(self.cut_short(
                offset,
                BLOCK_HEADER_LEN + n,
                BLOCK_HEADER_LEN + stored_len,
            ));
        }
        let found = crc32fast::hash(&self.stored);
        if found != h.payload_crc {
            return Ok(Some(Damage::BlockChecksum {
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
                    return Ok(Some(Damage::Decompress(format!(
                        "{n} bytes, the header says {raw_len}"
                    ))))
                }
                Err(e) => return Ok(Some(Damage::Decompress(e.to_string()))),
            }
        } else {
            std::mem::swap(&mut self.raw, &mut self.stored);
        }
        Ok(None)
    }

    /// Searches the input byte by byte for the next block header that looks intact: its magic,
    /// a header checksum that holds, and lengths within bounds. Returns it with the input just
    /// past it; `None`: the input ends first (all of it consumed).
    fn scan(&mut self) -> Result<Option<[u8; BLOCK_HEADER_LEN]>, CaptureError> {
        let mut win = [0u8; BLOCK_HEADER_LEN];
        let mut have = 0;
        loop {
            have += self.input.read_full(&mut win[have..])?;
            if have < BLOCK_HEADER_LEN {
                return Ok(None);
            }
            if plausible_block_header(&win) {
                return Ok(Some(win));
            }
            // Only a position holding the magic's first byte can start a header.
            let skip = win[1..]
                .iter()
                .position(|&b| b == format::BLOCK_MAGIC[0])
                .map_or(BLOCK_HEADER_LEN, |i| i + 1);
            win.copy_within(skip.., 0);
            have = BLOCK_HEADER_LEN - skip;
        }
    }

    fn cut_short(&mut self, offset: u64, have: usize, want: usize) -> CaptureError {
        self.block_offset = offset;
        CaptureError::CutShort {
            offset,
            partial: Some((have as u64, want as u64)),
            events: self.stats.kernel_events,
        }
    }
}

/// A block header a search may resume at: magic, header checksum, lengths within bounds.
fn plausible_block_header(hb: &[u8; BLOCK_HEADER_LEN]) -> bool {
    if hb[..format::BLOCK_MAGIC.len()] != format::BLOCK_MAGIC {
        return false;
    }
    let (expected, found) = BlockHeader::checksums(hb);
    let h = BlockHeader::decode(hb);
    expected == found
        && h.raw_len as usize <= format::MAX_BLOCK_LEN
        && h.stored_len as usize <= format::MAX_BLOCK_LEN
}

/// Blocks missing between the one expected (`expected`) and the intact one found (`found`);
/// `None` when the numbers went backwards (a wrapped or stray number tells nothing).
pub(super) fn gap(expected: u32, found: u32) -> Option<u64> {
    let d = found.wrapping_sub(expected);
    (d <= i32::MAX as u32).then_some(u64::from(d))
}

/// The file, with bytes put back to be read again: after damage, the damaged block's bytes
/// are searched for the next block.
struct Input<R> {
    inner: R,
    /// Bytes put back; `back[back_pos..]` come before what `inner` has left.
    back: Vec<u8>,
    back_pos: usize,
    /// File offset of the next byte.
    pos: u64,
}

impl<R: Read> Input<R> {
    /// Fills `buf` as far as the input goes; returns the bytes read (short only at its end).
    fn read_full(&mut self, buf: &mut [u8]) -> Result<usize, CaptureError> {
        let mut n = 0;
        if self.back_pos < self.back.len() {
            n = (self.back.len() - self.back_pos).min(buf.len());
            buf[..n].copy_from_slice(&self.back[self.back_pos..self.back_pos + n]);
            self.back_pos += n;
            self.pos += n as u64;
            if self.back_pos == self.back.len() {
                self.back.clear();
                self.back_pos = 0;
            }
        }
        let offset = self.pos;
        let m = read_full(&mut self.inner, &mut buf[n..])
            .map_err(|error| CaptureError::Io { offset, error })?;
        self.pos += m as u64;
        Ok(n + m)
    }

    /// Puts `head` then `tail`, just read, back in front of the input. What is put back spans
    /// from just after a block's start to at most its end or the end of what was put back
    /// before, so it never exceeds one block.
    fn unread(&mut self, head: &[u8], tail: &[u8]) {
        let rest = &self.back[self.back_pos..];
        let mut back = Vec::with_capacity(head.len() + tail.len() + rest.len());
        back.extend_from_slice(head);
        back.extend_from_slice(tail);
        back.extend_from_slice(rest);
        self.back = back;
        self.back_pos = 0;
        self.pos -= (head.len() + tail.len()) as u64;
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
