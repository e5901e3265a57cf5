//! JSON Lines: one object per fact, the summary last, nothing else on the writer.

use std::io::{self, Write};

use super::{FilterNote, Sink};
use crate::analysis::{Output, Summary};

/// Writes each fact as one JSON object per line (`{"type":"hold",...}`), and the final
/// summary (`{"type":"summary",...}`) last.
pub struct JsonSink<W: Write> {
    w: W,
    periodic_summaries: bool,
}

impl<W: Write> JsonSink<W> {
    pub fn new(w: W) -> Self {
        JsonSink {
            w,
            periodic_summaries: false,
        }
    }

    /// Also write the non-final summaries (then the summary is no longer only the last
    /// line; consumers must take the last one).
    pub fn with_periodic_summaries(mut self, yes: bool) -> Self {
        self.periodic_summaries = yes;
        self
    }

    pub fn into_inner(self) -> W {
        self.w
    }

    fn write<T: serde::Serialize>(&mut self, v: &T) -> io::Result<()> {
        serde_json::to_writer(&mut self.w, v)?;
        self.w.write_all(b"\n")
    }
}

impl<W: Write> Sink for JsonSink<W> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        self.write(o)
    }

    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()> {
        if final_ || self.periodic_summaries {
            self.write(s)?;
            self.w.flush()?;
        }
        Ok(())
    }

    fn summary_filtered(&mut self, s: &Summary, final_: bool, note: &FilterNote) -> io::Result<()> {
        /// The summary object with one more field, `"filter"`.
        #[derive(serde::Serialize)]
        struct Filtered<'a> {
            #[serde(flatten)]
            summary: &'a Summary,
            filter: &'a FilterNote,
        }
        if final_ || self.periodic_summaries {
            self.write(&Filtered {
                summary: s,
                filter: note,
            })?;
            self.w.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }
}
