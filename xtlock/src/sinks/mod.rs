//! Where facts go: a terminal for people, JSON Lines for programs.

use std::io;

use crate::analysis::{Output, Summary};

pub mod filter;
pub mod html;
pub mod json;
pub mod metrics;
pub mod perfetto;
pub mod terminal;

pub use filter::{FactFilter, FilterNote, FilteredSink};
pub use json::JsonSink;
pub use perfetto::PerfettoSink;
pub use terminal::{TerminalOptions, TerminalSink, TimeFormat};

/// A consumer of facts and summaries.
pub trait Sink {
    /// One fact, as the analysis emits it.
    fn output(&mut self, o: &Output) -> io::Result<()>;
    /// The summary; `final_` is false for periodic ones while tracing goes on.
    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()>;
    /// The summary, with what a [`FilteredSink`] in front of this sink left out; sinks
    /// that show facts say it, the others need not.
    fn summary_filtered(
        &mut self,
        s: &Summary,
        final_: bool,
        _note: &FilterNote,
    ) -> io::Result<()> {
        self.summary(s, final_)
    }
    /// Pushes buffered output to the writer.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<S: Sink + ?Sized> Sink for Box<S> {
    fn output(&mut self, o: &Output) -> io::Result<()> {
        (**self).output(o)
    }
    fn summary(&mut self, s: &Summary, final_: bool) -> io::Result<()> {
        (**self).summary(s, final_)
    }
    fn summary_filtered(&mut self, s: &Summary, final_: bool, note: &FilterNote) -> io::Result<()> {
        (**self).summary_filtered(s, final_, note)
    }
    fn flush(&mut self) -> io::Result<()> {
        (**self).flush()
    }
}

/// A size for people: `0 B`, `2.0 KiB`, `3.0 MiB`, `1.2 GiB`.
pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// A duration for people: three significant digits in ns, µs, ms or s
/// (`812 ns`, `12.3 µs`, `312 ms`, `1.42 s`, `5.00 s`, `1234 s`).
pub fn human_ns(ns: u64) -> String {
    if ns < 1_000 {
        return format!("{ns} ns");
    }
    let v = ns as f64;
    for (scale, unit) in [(1e3, "µs"), (1e6, "ms")] {
        let s = three_digits(v / scale);
        // Rounding can carry into the next unit: 999.96 µs is "1.00 ms".
        if !s.parse::<f64>().is_ok_and(|r| r >= 1000.0) {
            return format!("{s} {unit}");
        }
    }
    format!("{} s", three_digits(v / 1e9))
}

fn three_digits(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations() {
        assert_eq!(human_ns(0), "0 ns");
        assert_eq!(human_ns(812), "812 ns");
        assert_eq!(human_ns(1_000), "1.00 µs");
        assert_eq!(human_ns(12_345), "12.3 µs");
        assert_eq!(human_ns(999_960), "1.00 ms");
        assert_eq!(human_ns(312_400_000), "312 ms");
        assert_eq!(human_ns(1_420_000_000), "1.42 s");
        assert_eq!(human_ns(5_000_000_000), "5.00 s");
        assert_eq!(human_ns(1_234_000_000_000), "1234 s");
        assert_eq!(human_ns(u64::MAX), "18446744074 s");
    }
}
