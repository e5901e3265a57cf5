//! The capture-file source: the events `xtlock record` wrote, decoded exactly as the live
//! source decodes them, so `report` and `trace` run the same analysis on the same events.

use std::{fs::File, io::BufReader, path::Path};

use crate::{
    capture::{CaptureError, CaptureHeader, CaptureReader, DamageSummary},
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
    /// Damaged places that were skipped: reading went on after each (what they took, as far
    /// as the sequence numbers and the end record tell).
    pub damage: Option<DamageSummary>,
    /// The file is damaged beyond repair (its header, or an end record that contradicts an
    /// intact file) or from a newer xtlock from this point on; what came before was read.
    pub damaged: Option<CaptureError>,
    /// Timestamp of the last event read.
    pub last_ts_ns: u64,
}

impl Ending {
    /// Logs the damaged places skipped, if any, and that `what` (the report, the timeline)
    /// covers the rest of the capture.
    pub fn warn_damage(&self, what: &str) {
        let Some(d) = &self.damage else { return };
        for line in d.lines() {
            tracing::warn!("{line}");
        }
        tracing::warn!("the {what} covers everything else in the capture");
    }
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

    /// Feeds every event to `f`, in file order; damaged blocks are skipped (see
    /// [`Ending::damage`]), reading stops at the first fatal error.
    pub fn for_each(
        &mut self,
        mut f: impl FnMut(&Event) -> std::io::Result<()>,
    ) -> std::io::Result<Ending> {
        let mut end = Ending::default();
        let Some(reader) = self.reader.take() else {
            return Ok(end);
        };
        let mut events = reader.events();
        for item in events.by_ref() {
            match item {
                Ok(ev) => {
                    end.last_ts_ns = end.last_ts_ns.max(ev.ts_ns());
                    f(&ev)?;
                }
                // Said all together at the end, with what the end record tells of them.
                Err(CaptureError::Skipped(_)) => {}
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
        end.damage = events.reader().damage();
        Ok(end)
    }
}
