//! What a reader skipped: the damaged places of a capture and what was lost with them.

use std::fmt;

use super::{thousands, Damage, Trailer};

/// A stretch of a capture the reader skipped because it was damaged, and what was lost with
/// it. Reading went on at the next intact block (`resumed_at`), unless the file ended first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedRegion {
    /// File offset of the damaged block (for a malformed record: of the block holding it).
    pub offset: u64,
    /// Sequence number of that block: the one the reader expected there.
    pub block: u32,
    /// The first thing found wrong.
    pub problem: Damage,
    /// The block at `offset` was read up to a malformed record: the records before it were
    /// kept, the rest of the block dropped.
    pub partial: bool,
    /// Whole blocks lost, from the sequence numbers on either side; `None` when they do not
    /// tell (the file ended first, or the numbers went backwards).
    pub blocks_lost: Option<u64>,
    /// Records lost, when the headers of all the blocks lost could be read; `None`: unknown.
    pub records_lost: Option<u64>,
    /// Bytes skipped, from `offset` to `resumed_at` (or to the end of the file).
    pub bytes: u64,
    /// Offset of the intact block reading went on with; `None`: the file ended first.
    pub resumed_at: Option<u64>,
}

impl fmt::Display for DamagedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "offset {} (block {}): {}; ",
            self.offset, self.block, self.problem
        )?;
        let records = match self.records_lost {
            Some(n) if n > 0 => format!(" ({})", plural(n, "record", "records")),
            _ => String::new(),
        };
        let Some(resumed_at) = self.resumed_at else {
            // Nothing intact follows: the sequence numbers cannot tell what was there.
            let what = if self.partial {
                "the rest of the block and everything after it"
            } else {
                "everything from there"
            };
            return write!(
                f,
                "{what} ({} bytes) skipped: no intact block follows before the end of the file",
                thousands(self.bytes)
            );
        };
        let blocks = |n: u64| plural(n, "block", "blocks");
        let what = match (self.partial, self.blocks_lost) {
            (true, Some(0)) => format!("the rest of the block{records}"),
            (true, Some(n)) => format!("the rest of the block and {} more{records}", blocks(n)),
            (true, None) => {
                format!("the rest of the block and an unknown number of blocks after it{records}")
            }
            // Bytes that were never a block (inserted, or a block header's remains).
            (false, Some(0)) => format!("{} bytes holding no block", thousands(self.bytes)),
            (false, Some(n)) => format!("{}{records}", blocks(n)),
            (false, None) => {
                format!("an unknown number of blocks (the sequence numbers do not tell){records}")
            }
        };
        // A sequence gap between two intact neighbours: blocks are missing, no bytes skipped.
        let verb = if self.bytes == 0 {
            "missing"
        } else {
            "skipped"
        };
        write!(f, "{what} {verb}, reading went on at offset {resumed_at}")
    }
}

/// The damage a reader skipped in a capture: where, and what the end record says was lost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DamageSummary {
    pub regions: Vec<DamagedRegion>,
    /// The end-of-capture record's totals against what was read, when the end record was read
    /// after skipped damage (its totals then count what the damage took).
    pub shortfall: Option<Shortfall>,
}

impl DamageSummary {
    /// One line each: the places (the first line says how many), then the end record's count
    /// of what they took. Log lines cannot hold line breaks, so they are said one by one.
    pub fn lines(&self) -> Vec<String> {
        let n = self.regions.len();
        let head = format!("capture damaged in {}", plural(n as u64, "place", "places"));
        let mut lines = match &self.regions[..] {
            [one] => vec![format!("{head}: {one}")],
            many => std::iter::once(format!("{head}:"))
                .chain(
                    many.iter()
                        .enumerate()
                        .map(|(i, r)| format!("damage {} of {n}: {r}", i + 1)),
                )
                .collect(),
        };
        if let Some(s) = &self.shortfall {
            lines.push(s.to_string());
        }
        lines
    }
}

impl fmt::Display for DamageSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.lines().join("\n"))
    }
}

/// The end-of-capture record's totals (`expected`) and those of the records read (`read`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shortfall {
    pub expected: Trailer,
    pub read: Trailer,
}

impl Shortfall {
    /// (what, end record's count, count read) of each total.
    fn totals(&self) -> [(&'static str, &'static str, u64, u64); 5] {
        let (e, r) = (&self.expected, &self.read);
        [
            ("block", "blocks", e.blocks, r.blocks),
            (
                "kernel event",
                "kernel events",
                e.kernel_events,
                r.kernel_events,
            ),
            (
                "process record",
                "process records",
                e.proc_records,
                r.proc_records,
            ),
            (
                "lost record",
                "lost records",
                e.lost_records,
                r.lost_records,
            ),
            ("lost event", "lost events", e.lost_events, r.lost_events),
        ]
    }
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let totals = self.totals();
        let more: Vec<String> = totals
            .iter()
            .filter(|t| t.2 > t.3)
            .map(|&(one, many, e, r)| plural(e - r, one, many))
            .collect();
        // More read than written: not what skipping damage does; said as found.
        let fewer: Vec<String> = totals
            .iter()
            .filter(|t| t.2 < t.3)
            .map(|&(_, many, e, r)| format!("{many} {} (read {})", thousands(e), thousands(r)))
            .collect();
        if more.is_empty() && fewer.is_empty() {
            return f.write_str(
                "the end-of-capture record's totals match what was read: nothing was lost",
            );
        }
        if !more.is_empty() {
            write!(
                f,
                "the end-of-capture record's totals are short by what the damage took: {} \
                 not read",
                more.join(", ")
            )?;
        }
        if !fewer.is_empty() {
            if !more.is_empty() {
                f.write_str("; ")?;
            }
            write!(f, "the end-of-capture record says {}", fewer.join(", "))?;
        }
        Ok(())
    }
}

/// "1 block" / "2 blocks" / "1,234 blocks".
fn plural(n: u64, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{} {many}", thousands(n))
    }
}
