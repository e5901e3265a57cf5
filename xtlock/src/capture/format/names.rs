//! The chain names of rule-table reads, shared from one read of a table to the next.
//!
//! A table is read after every write to it, and a read names all its chains (kube-proxy's nat
//! table: hundreds) though one or two changed. Decoding each name into its own string was
//! most of what a read cost to decode; here a name equal to the one the table's previous read
//! had is that read's [`SharedStr`] again (a reference count, no allocation), found by
//! comparing bytes in chain order, or by a look-up when chains were added or removed.
//! What a read decodes to is the same either way: only who owns the bytes differs.

use std::collections::HashMap;

use crate::shared::SharedStr;

/// Tables remembered (netns × family × table); past it the oldest is forgotten, which only
/// costs its next read fresh names.
const MAX_TABLES: usize = 64;
/// Distinct policies remembered (`ACCEPT`, `DROP`, nft's `accept`, ...).
const MAX_POLICIES: usize = 16;

/// The names of each table's last read (see the module's comment). One per capture reader.
#[derive(Debug, Default)]
pub struct ChainNames {
    /// Searched in turn: a capture has a few tables.
    tables: Vec<TableNames>,
    policies: Vec<SharedStr>,
}

#[derive(Debug)]
struct TableNames {
    netns: u32,
    family: String,
    table: String,
    /// The previous read's names, in chain order.
    last: Vec<SharedStr>,
    /// Where in `last` the next name is expected.
    at: usize,
    /// `last` by name: built at a read's first name out of order, until the read ends.
    index: Option<HashMap<SharedStr, usize>>,
    /// The names of the read being decoded (a read may come in several records), once one
    /// was not where `last` had it; until then they are `last[..at]`, kept nowhere else.
    cur: Vec<SharedStr>,
    diverged: bool,
    /// The time of that read (its parts share it).
    cur_ts: u64,
}

/// The names of one read of one table, while its record is decoded.
pub struct ReadNames<'a> {
    t: &'a mut TableNames,
    policies: &'a mut Vec<SharedStr>,
}

impl ChainNames {
    /// Starts (or goes on with, for its next part) a read of a table at `ts_ns`.
    pub fn read(&mut self, netns: u32, family: &str, table: &str, ts_ns: u64) -> ReadNames<'_> {
        let found = self
            .tables
            .iter()
            .position(|t| t.netns == netns && t.family == family && t.table == table);
        let i = match found {
            Some(i) => i,
            None => {
                if self.tables.len() >= MAX_TABLES {
                    self.tables.remove(0);
                }
                self.tables.push(TableNames {
                    netns,
                    family: family.to_owned(),
                    table: table.to_owned(),
                    last: Vec::new(),
                    at: 0,
                    index: None,
                    cur: Vec::new(),
                    diverged: false,
                    cur_ts: ts_ns,
                });
                self.tables.len() - 1
            }
        };
        let t = &mut self.tables[i];
        // A new read, not the next part of the same one: what an unfinished one (a capture
        // cut short) gathered is dropped.
        if t.cur_ts != ts_ns {
            t.cur.clear();
            t.diverged = false;
            t.at = 0;
            t.index = None;
            t.cur_ts = ts_ns;
        }
        ReadNames {
            t,
            policies: &mut self.policies,
        }
    }
}

impl ReadNames<'_> {
    /// The next chain's name, from its bytes.
    pub fn name(&mut self, bytes: &[u8]) -> SharedStr {
        let t = &mut *self.t;
        if let Some(n) = t.last.get(t.at).filter(|n| n.as_bytes() == bytes) {
            // The usual case: the same chain as the previous read had here.
            t.at += 1;
            if t.diverged {
                t.cur.push(n.clone());
            }
            return n.clone();
        }
        if !t.diverged {
            t.diverged = true;
            t.cur.extend(t.last[..t.at].iter().cloned());
        }
        let name = match std::str::from_utf8(bytes) {
            Ok(s) => {
                let last = &t.last;
                let index = t
                    .index
                    .get_or_insert_with(|| last.iter().cloned().zip(0..).collect());
                match index.get(s) {
                    // Chains were added or removed before it: go on from there.
                    Some(&k) => {
                        t.at = k + 1;
                        t.last[k].clone()
                    }
                    None => SharedStr::from(s),
                }
            }
            // Writers store valid UTF-8; lossy keeps a reader total if one did not.
            Err(_) => SharedStr::from(String::from_utf8_lossy(bytes).as_ref()),
        };
        t.cur.push(name.clone());
        name
    }

    /// A chain's policy, from its bytes: the few there are, shared.
    pub fn policy(&mut self, bytes: &[u8]) -> SharedStr {
        if let Some(p) = self.policies.iter().find(|p| p.as_bytes() == bytes) {
            return p.clone();
        }
        let p = SharedStr::from(String::from_utf8_lossy(bytes).as_ref());
        if self.policies.len() < MAX_POLICIES {
            self.policies.push(p.clone());
        }
        p
    }

    /// The read's record is decoded; `more`: another part of the same read follows. The
    /// read's names become those the next read is compared with once it is whole.
    pub fn done(self, more: bool) {
        let t = self.t;
        if more {
            return;
        }
        if t.diverged {
            // Swapped, not moved: both buffers keep their capacity for the next reads.
            std::mem::swap(&mut t.last, &mut t.cur);
            t.cur.clear();
            t.diverged = false;
        } else {
            // Every name was where `last` had it: the read was `last[..at]`.
            t.last.truncate(t.at);
        }
        t.at = 0;
        t.index = None;
    }
}
