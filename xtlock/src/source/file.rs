//! The capture-file source: the events `xtlock record` wrote, decoded exactly as the live
//! source decodes them, so `report` and `trace` run the same analysis on the same events.

use std::{fs::File, io::BufReader, path::Path};

use crate::{
    capture::{CaptureError, CaptureHeader, CaptureReader},
    decode::Event,
    lockfiles::WatchedLock,
};

/// How reading a capture ended.
#[derive(Debug, Default)]
pub struct Ending {
    /// Kernel events that could not be decoded (skipped).
    pub undecoded: u64,
    /// The capture stops without its end record (the recorder was killed): what was read is
    /// good, but later events are missing.
    pub cut_short: Option<CaptureError>,
    /// The file is damaged or from a newer xtlock from this point on; what came before was
    /// read.
    pub damaged: Option<CaptureError>,
    /// Timestamp of the last event read.
    pub last_ts_ns: u64,
}

pub struct FileSource {
    pub header: CaptureHeader,
    reader: Option<CaptureReader<BufReader<File>>>,
}

impl FileSource {
    pub fn open(path: &Path) -> Result<Self, CaptureError> {
        let file = File::open(path).map_err(|source| CaptureError::Io {
            offset: 0,
            error: source,
        })?;
        let (header, reader) = CaptureReader::new(BufReader::with_capacity(1 << 16, file))?;
        Ok(Self {
            header,
            reader: Some(reader),
        })
    }

    /// The lock files the capture watched.
    pub fn locks(&self) -> Vec<WatchedLock> {
        self.header
            .locks
            .iter()
            .map(|l| WatchedLock::new(l.path.clone(), l.dev, l.ino))
            .collect()
    }

    /// Feeds every event to `f`, in file order; reading stops at the first damage.
    pub fn for_each(
        &mut self,
        mut f: impl FnMut(&Event) -> std::io::Result<()>,
    ) -> std::io::Result<Ending> {
        let mut end = Ending::default();
        let Some(reader) = self.reader.take() else {
            return Ok(end);
        };
        for item in reader.events() {
            match item {
                Ok(ev) => {
                    end.last_ts_ns = end.last_ts_ns.max(ev.ts_ns());
                    f(&ev)?;
                }
                Err(e) if e.is_recoverable() => {
                    end.undecoded += 1;
                    if end.undecoded == 1 {
                        tracing::warn!(error = %e, "skipping an undecodable event (further ones counted)");
                    }
                }
                Err(e) if e.is_cut_short() => {
                    end.cut_short = Some(e);
                    break;
                }
                Err(e) => {
                    end.damaged = Some(e);
                    break;
                }
            }
        }
        Ok(end)
    }
}
