//! Writes a capture: file header, then blocks of records.
//!
//! Records accumulate in memory until the block is sealed: when it reaches `BLOCK_TARGET`
//! bytes, when the recorder calls [`CaptureWriter::flush_block`] (at least every second), or
//! at [`CaptureWriter::finish`]. A sealed block goes out in a single `write_all` and a
//! `flush`, so a killed recorder leaves whole blocks and at most one partial one at the end,
//! which readers recognise as the point where the capture was cut short.

use std::{
    fs::File,
    io::{self, Write},
    path::Path,
};

use lz4_flex::block::{compress_into_with_table, get_maximum_output_size, CompressTable};

use super::{
    format::{self, BlockHeader, CaptureHeader, Trailer, BLOCK_HEADER_LEN},
    CaptureError,
};
use crate::decode::ProcInfo;

/// What the writer has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Kernel events accepted (written or waiting in the open block).
    pub kernel_events: u64,
    /// Kernel events in blocks already written out.
    pub kernel_events_on_disk: u64,
    pub proc_records: u64,
    pub lost_records: u64,
    /// Sum of the lost records' counts.
    pub lost_events: u64,
    /// Blocks written.
    pub blocks: u64,
    /// Bytes written: file header and blocks.
    pub bytes_on_disk: u64,
    /// Bytes of the file header alone.
    pub header_bytes: u64,
    /// Uncompressed record bytes of the blocks written.
    pub raw_bytes: u64,
}

impl CaptureStats {
    /// Block bytes on disk per kernel event written: the cost of one event, with its share of
    /// block headers and process records. `None` before any event reached the disk.
    pub fn bytes_per_kernel_event(&self) -> Option<f64> {
        (self.kernel_events_on_disk > 0).then(|| {
            (self.bytes_on_disk - self.header_bytes) as f64 / self.kernel_events_on_disk as f64
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Open,
    /// A write failed: the file may end in a partial block, so appending more would hide
    /// everything after it from readers.
    Failed,
    Finished,
}

/// Writes one capture to `W`. Not buffered on purpose: each block is one write.
pub struct CaptureWriter<W: Write> {
    out: W,
    /// Records of the open block.
    payload: Vec<u8>,
    /// Header and stored payload of the block being written.
    block: Vec<u8>,
    /// Encoding space for variable-length records.
    scratch: Vec<u8>,
    table: CompressTable,
    block_records: u32,
    block_kernel_events: u64,
    seq: u32,
    stats: CaptureStats,
    /// Makes written data durable (fsync) for writers that can; see [`CaptureWriter::sync`].
    sync: Option<fn(&mut W) -> io::Result<()>>,
    state: State,
}

impl CaptureWriter<File> {
    /// Creates (or truncates) `path` and writes the file header to it.
    pub fn create(path: impl AsRef<Path>, header: &CaptureHeader) -> Result<Self, CaptureError> {
        let file = File::create(path.as_ref()).map_err(|source| CaptureError::Io {
            offset: 0,
            error: source,
        })?;
        let mut w = Self::new(file, header)?;
        w.sync = Some(|f: &mut File| f.sync_data());
        Ok(w)
    }
}

impl<W: Write> CaptureWriter<W> {
    /// Writes the file header to `out` and returns a writer for the records.
    pub fn new(mut out: W, header: &CaptureHeader) -> Result<Self, CaptureError> {
        let bytes = format::encode_file_header(header).map_err(CaptureError::HeaderJson)?;
        let json_len = bytes.len() - format::FILE_PREFIX_LEN - 4;
        if json_len > format::MAX_HEADER_JSON {
            return Err(CaptureError::RecordTooLarge {
                len: json_len,
                max: format::MAX_HEADER_JSON,
            });
        }
        let io = |source| CaptureError::Io {
            offset: 0,
            error: source,
        };
        out.write_all(&bytes).map_err(io)?;
        out.flush().map_err(io)?;
        let header_bytes = bytes.len() as u64;
        Ok(CaptureWriter {
            out,
            // A block is sealed just past the target, so this rarely grows.
            payload: Vec::with_capacity(format::BLOCK_TARGET + 1024),
            block: Vec::with_capacity(
                BLOCK_HEADER_LEN + get_maximum_output_size(format::BLOCK_TARGET + 1024),
            ),
            scratch: Vec::with_capacity(1024),
            table: CompressTable::large(),
            block_records: 0,
            block_kernel_events: 0,
            seq: 0,
            stats: CaptureStats {
                bytes_on_disk: header_bytes,
                header_bytes,
                ..Default::default()
            },
            sync: None,
            state: State::Open,
        })
    }

    /// Appends one kernel event, `raw` being exactly the bytes the ring buffer delivered: with
    /// its zero runs elided when that pays (exec events), as is otherwise.
    #[inline]
    pub fn write_kernel(&mut self, raw: &[u8]) -> Result<(), CaptureError> {
        let mut b = std::mem::take(&mut self.scratch);
        b.clear();
        let pushed = if format::encode_sparse_kernel(raw, &mut b) {
            self.push(format::KIND_KERNEL_SPARSE, &b)
        } else {
            self.push(format::KIND_KERNEL, raw)
        };
        self.scratch = b;
        pushed?;
        self.stats.kernel_events += 1;
        self.block_kernel_events += 1;
        self.seal_if_full()
    }

    /// Appends a process snapshot.
    pub fn write_proc(&mut self, p: &ProcInfo) -> Result<(), CaptureError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        format::encode_proc(p, &mut scratch);
        let pushed = self.push(format::KIND_PROC, &scratch);
        self.scratch = scratch;
        pushed?;
        self.stats.proc_records += 1;
        self.seal_if_full()
    }

    /// Appends a lost-events report: the kernel dropped `count` events (ring buffer full).
    pub fn write_lost(&mut self, ts_ns: u64, count: u64) -> Result<(), CaptureError> {
        let mut b = std::mem::take(&mut self.scratch);
        b.clear();
        format::encode_lost(ts_ns, count, &mut b);
        let pushed = self.push(format::KIND_LOST, &b);
        self.scratch = b;
        pushed?;
        self.stats.lost_records += 1;
        self.stats.lost_events = self.stats.lost_events.saturating_add(count);
        self.seal_if_full()
    }

    /// Appends a synthetic event the source made itself: a process snapshot, a lost-events
    /// report, or a drop record (reason names, a kernel symbol, drop counts, conntrack
    /// counters). Returns `false` for kernel events, which go through
    /// [`write_kernel`](Self::write_kernel) as raw bytes.
    pub fn write_synthetic(&mut self, ev: &crate::decode::Event) -> Result<bool, CaptureError> {
        use crate::decode::Event;
        match ev {
            Event::Proc(p) => self.write_proc(p)?,
            Event::Lost { ts_ns, count } => self.write_lost(*ts_ns, *count)?,
            _ => {
                let mut b = std::mem::take(&mut self.scratch);
                b.clear();
                let Some(kind) = format::encode_synthetic(ev, &mut b) else {
                    self.scratch = b;
                    return Ok(false);
                };
                let pushed = self.push(kind, &b);
                self.scratch = b;
                pushed?;
                self.seal_if_full()?;
            }
        }
        Ok(true)
    }

    /// Seals the open block and hands it to the OS (a no-op when it is empty). After this
    /// returns, the records survive the recorder being killed.
    pub fn flush_block(&mut self) -> Result<(), CaptureError> {
        self.check_open()?;
        self.seal()
    }

    /// [`flush_block`](Self::flush_block), then asks the OS to put the data on stable storage
    /// (`fdatasync` for writers made by [`create`](Self::create); nothing more for others), so
    /// it also survives losing the machine. Costly: for occasional use, not every second.
    pub fn sync(&mut self) -> Result<(), CaptureError> {
        self.flush_block()?;
        if let Some(sync) = self.sync {
            sync(&mut self.out).map_err(|source| CaptureError::Io {
                offset: self.stats.bytes_on_disk,
                error: source,
            })?;
        }
        Ok(())
    }

    /// Writes the end-of-capture record, seals the last block and syncs. A capture without
    /// it reads as cut short.
    pub fn finish(mut self) -> Result<CaptureStats, CaptureError> {
        self.check_open()?;
        let trailer = Trailer {
            kernel_events: self.stats.kernel_events,
            proc_records: self.stats.proc_records,
            lost_records: self.stats.lost_records,
            lost_events: self.stats.lost_events,
            blocks: self.stats.blocks + 1,
        };
        let mut b = std::mem::take(&mut self.scratch);
        b.clear();
        format::encode_trailer(&trailer, &mut b);
        self.push(format::KIND_END, &b)?;
        self.seal()?;
        self.state = State::Finished;
        if let Some(sync) = self.sync {
            sync(&mut self.out).map_err(|source| CaptureError::Io {
                offset: self.stats.bytes_on_disk,
                error: source,
            })?;
        }
        Ok(self.stats)
    }

    pub fn stats(&self) -> CaptureStats {
        self.stats
    }

    fn check_open(&self) -> Result<(), CaptureError> {
        match self.state {
            State::Open => Ok(()),
            // `finish` consumes the writer, so only a failure gets here.
            State::Failed | State::Finished => Err(CaptureError::WriterFailed),
        }
    }

    #[inline]
    fn push(&mut self, kind: u8, body: &[u8]) -> Result<(), CaptureError> {
        self.check_open()?;
        if body.len() > format::MAX_RECORD_LEN {
            return Err(CaptureError::RecordTooLarge {
                len: body.len(),
                max: format::MAX_RECORD_LEN,
            });
        }
        self.payload.push(kind);
        format::put_varint(&mut self.payload, body.len() as u64);
        self.payload.extend_from_slice(body);
        self.block_records += 1;
        Ok(())
    }

    #[inline]
    fn seal_if_full(&mut self) -> Result<(), CaptureError> {
        if self.payload.len() >= format::BLOCK_TARGET {
            self.seal()
        } else {
            Ok(())
        }
    }

    fn seal(&mut self) -> Result<(), CaptureError> {
        if self.block_records == 0 {
            return Ok(());
        }
        let raw_len = self.payload.len();
        self.block.clear();
        self.block
            .resize(BLOCK_HEADER_LEN + get_maximum_output_size(raw_len), 0);
        let compressed = compress_into_with_table(
            &self.payload,
            &mut self.block[BLOCK_HEADER_LEN..],
            &mut self.table,
        );
        let (compression, stored_len) = match compressed {
            Ok(n) if n < raw_len => (format::COMPRESSION_LZ4, n),
            // Incompressible (or, never in practice, an output-size error): store as is.
            _ => {
                self.block.truncate(BLOCK_HEADER_LEN);
                self.block.extend_from_slice(&self.payload);
                (format::COMPRESSION_NONE, raw_len)
            }
        };
        self.block.truncate(BLOCK_HEADER_LEN + stored_len);
        let header = BlockHeader {
            seq: self.seq,
            records: self.block_records,
            // Records are at most MAX_RECORD_LEN and a block is sealed once past BLOCK_TARGET,
            // so both lengths are far below u32::MAX.
            raw_len: raw_len as u32,
            stored_len: stored_len as u32,
            compression,
            payload_crc: crc32fast::hash(&self.block[BLOCK_HEADER_LEN..]),
        };
        self.block[..BLOCK_HEADER_LEN].copy_from_slice(&header.encode());

        // One write per block: a crash leaves this block whole or cut, never interleaved.
        self.state = State::Failed;
        let offset = self.stats.bytes_on_disk;
        let io = |source| CaptureError::Io {
            offset,
            error: source,
        };
        self.out.write_all(&self.block).map_err(io)?;
        self.out.flush().map_err(io)?;
        self.state = State::Open;

        self.stats.blocks += 1;
        self.stats.bytes_on_disk += self.block.len() as u64;
        self.stats.raw_bytes += raw_len as u64;
        self.stats.kernel_events_on_disk += self.block_kernel_events;
        self.seq = self.seq.wrapping_add(1);
        self.payload.clear();
        self.block_records = 0;
        self.block_kernel_events = 0;
        Ok(())
    }
}

impl<W: Write> Drop for CaptureWriter<W> {
    /// A writer dropped without `finish` (an error path, a panic) still writes what it holds;
    /// the capture then reads as cut short, which is what it is.
    fn drop(&mut self) {
        if self.state == State::Open {
            let _ = self.seal();
        }
    }
}
