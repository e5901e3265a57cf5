//! The one pipeline every mode shares: decoded events in, analysis, sinks out. `trace` feeds
//! it from the ring buffer; replaying a capture feeds it from a file, through the same code,
//! so both print the same facts and the same summary for the same events.

use std::io;

use crate::{
    analysis::{Analyzer, Output, Summary, WatchedLock},
    decode::Event,
    sinks::Sink,
};

pub struct Pipeline {
    analyzer: Analyzer,
    sinks: Vec<Box<dyn Sink>>,
    /// Facts of the current event, reused so events without facts cost no allocation.
    pending: Vec<Output>,
    events: u64,
}

impl Pipeline {
    pub fn new(locks: Vec<WatchedLock>, sinks: Vec<Box<dyn Sink>>) -> Self {
        Self {
            analyzer: Analyzer::new(locks),
            sinks,
            pending: Vec::new(),
            events: 0,
        }
    }

    /// Feeds one event through the analysis and hands its facts to every sink.
    pub fn feed(&mut self, ev: &Event) -> io::Result<()> {
        self.events += 1;
        if tracing::enabled!(tracing::Level::TRACE) {
            tracing::trace!(?ev, "event");
        }
        let pending = &mut self.pending;
        self.analyzer.process(ev, &mut |o| pending.push(o));
        self.deliver()
    }

    fn deliver(&mut self) -> io::Result<()> {
        for o in self.pending.drain(..) {
            for s in &mut self.sinks {
                s.output(&o)?;
            }
        }
        Ok(())
    }

    /// A summary while tracing goes on.
    pub fn periodic_summary(&mut self) -> io::Result<()> {
        let s = self.analyzer.summary();
        for sink in &mut self.sinks {
            sink.summary(&s, false)?;
            sink.flush()?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.sinks.iter_mut().try_for_each(|s| s.flush())
    }

    /// End of the stream at `ts_ns`: still-open holds and waits are reported as open, then
    /// the final summary.
    pub fn finish(&mut self, ts_ns: u64) -> io::Result<Summary> {
        let pending = &mut self.pending;
        self.analyzer.finish(ts_ns, &mut |o| pending.push(o));
        self.deliver()?;
        let s = self.analyzer.summary();
        for sink in &mut self.sinks {
            sink.summary(&s, true)?;
            sink.flush()?;
        }
        Ok(s)
    }

    pub fn events(&self) -> u64 {
        self.events
    }

    pub fn analyzer(&self) -> &Analyzer {
        &self.analyzer
    }

    /// For settings (e.g. the conntrack warning threshold) before the first event.
    pub fn analyzer_mut(&mut self) -> &mut Analyzer {
        &mut self.analyzer
    }
}
