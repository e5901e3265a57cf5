//! Writers that do not share the lock. Two processes writing one namespace's legacy tables
//! under different lock files (or without one) are not serialized: each reads the table
//! (`*_SO_GET_ENTRIES`), changes its copy and replaces the whole table, so a replace computed
//! from a read that came before another's write silently undoes that write. The kernel
//! refuses such a replace only when the table's entry count changed since the read (EAGAIN).
//!
//! From the events alone: every table read and replace, with the process, its network
//! namespace and the lock it held then (the lock machine knows). Said:
//! - once per pair of writers (agent and lock each) that wrote one namespace's tables under
//!   different locks: `writers`;
//! - each replace by one of them whose own read came before the other's write to that table,
//!   and that the kernel took: `lost_write`; or refused: `refused_replace`;
//! - when the read after a lost write comes, what that replace removed, as `iptables-save`
//!   prints it: `lost_rules`.
//!
//! Bounded: [`MAX_TABLES`] tables followed, [`RECENT`] writes remembered per table,
//! [`MAX_READS`] reads, [`MAX_PAIRS`] pairs said.

use std::collections::{HashSet, VecDeque};

use serde::Serialize;

use super::facts::Output;
pub use super::facts::{UnserializedFact, Writer};
use super::procs::FastMap;
use crate::decode::TableReplaceEvent;
use crate::shared::SharedStr;

const MAX_TABLES: usize = 1024;
const RECENT: usize = 32;
const MAX_READS: usize = 4096;
const MAX_PAIRS: usize = 1024;

type TableKey = (u32, &'static str, String);
/// A netns and its two writers' (agent, lock), ordered.
type PairKey = (
    u32,
    (SharedStr, Option<SharedStr>),
    (SharedStr, Option<SharedStr>),
);

/// Whether `t` is a read or replace this follows (the rest costs nothing: no attribution).
pub fn concerns(t: &TableReplaceEvent) -> bool {
    use xtlock_common::{XT_SO_GET_ENTRIES, XT_SO_SET_REPLACE};
    t.netns != 0
        && if t.read {
            t.optname == XT_SO_GET_ENTRIES && t.ret == 0
        } else {
            t.optname == XT_SO_SET_REPLACE && (t.ret == 0 || t.ret == -i64::from(libc::EAGAIN))
        }
}

#[derive(Debug, Default)]
pub struct Unserialized {
    /// (pid, table) → the time of its last entries read.
    reads: FastMap<(u32, TableKey), u64>,
    /// Replaces per table, newest last: (time, writer).
    writes: FastMap<TableKey, VecDeque<(u64, Writer)>>,
    /// (netns, the two writers' (agent, lock), ordered) said already.
    pairs: HashSet<PairKey>,
    /// Lost writes waiting for the read of their table (bounded: [`RECENT`]).
    pending: VecDeque<UnserializedFact>,
    pub counts: UnserializedCounts,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UnserializedCounts {
    pub pairs: u64,
    pub lost_writes: u64,
    pub refused_replaces: u64,
}

impl Unserialized {
    /// A legacy table read or write by `writer` (its lock as held at `t`).
    pub fn on_table(&mut self, t: &TableReplaceEvent, writer: Writer, out: &mut dyn FnMut(Output)) {
        use xtlock_common::{SOL_IPV6, XT_SO_GET_ENTRIES, XT_SO_SET_REPLACE};
        if t.netns == 0 {
            return;
        }
        let Some(name) = t.head.as_ref().map(|h| h.name()).filter(|n| !n.is_empty()) else {
            return;
        };
        let family = if t.level == SOL_IPV6 { "ip6" } else { "ip" };
        let key: TableKey = (t.netns, family, name);
        if t.read {
            if t.optname == XT_SO_GET_ENTRIES && t.ret == 0 {
                if self.reads.len() >= MAX_READS {
                    self.reads.clear();
                }
                self.reads.insert((t.tgid, key), t.ts_ns);
            }
            return;
        }
        if t.optname != XT_SO_SET_REPLACE {
            return;
        }
        let refused = t.ret == -i64::from(libc::EAGAIN);
        if t.ret != 0 && !refused {
            return;
        }
        let read = self.reads.remove(&(t.tgid, key.clone()));
        let table = format!("{}:{}", key.1, key.2);
        if !self.writes.contains_key(&key) && self.writes.len() >= MAX_TABLES {
            self.writes.clear();
        }
        let recent = self.writes.entry(key.clone()).or_default();
        // Another's write between this writer's read and its replace, under another lock.
        if let Some(read_ns) = read {
            let undone = recent.iter().rev().find(|(ts, w)| {
                *ts > read_ns && *ts < t.ts_ns && w.pid != writer.pid && !serialized(w, &writer)
            });
            if let Some((ts, other)) = undone {
                let kind = if refused {
                    self.counts.refused_replaces += 1;
                    "refused_replace"
                } else {
                    self.counts.lost_writes += 1;
                    "lost_write"
                };
                let f = UnserializedFact {
                    ts_ns: t.ts_ns,
                    kind,
                    netns: t.netns,
                    table: table.clone(),
                    writer: writer.clone(),
                    other: other.clone(),
                    read_ns: Some(read_ns),
                    other_write_ns: Some(*ts),
                    lost_rules: Vec::new(),
                };
                if !refused {
                    if self.pending.len() >= RECENT {
                        self.pending.pop_front();
                    }
                    self.pending.push_back(f.clone());
                }
                out(Output::Unserialized(f));
            }
        }
        if refused {
            return;
        }
        // A pair said once: the other writers of this namespace's tables under another lock.
        let others: Vec<Writer> = self
            .writes
            .iter()
            .filter(|(k, _)| k.0 == t.netns)
            .flat_map(|(_, v)| v.iter().map(|(_, w)| w))
            .filter(|w| w.agent != writer.agent && !serialized(w, &writer))
            .cloned()
            .collect();
        for other in others {
            let a = (writer.agent.clone(), writer.lock.clone());
            let b = (other.agent.clone(), other.lock.clone());
            let pair = if a <= b {
                (t.netns, a, b)
            } else {
                (t.netns, b, a)
            };
            if self.pairs.contains(&pair) || self.pairs.len() >= MAX_PAIRS {
                continue;
            }
            self.pairs.insert(pair);
            self.counts.pairs += 1;
            out(Output::Unserialized(UnserializedFact {
                ts_ns: t.ts_ns,
                kind: "writers",
                netns: t.netns,
                table: table.clone(),
                writer: writer.clone(),
                other,
                read_ns: None,
                other_write_ns: None,
                lost_rules: Vec::new(),
            }));
        }
        let recent = self.writes.entry(key).or_default();
        if recent.len() >= RECENT {
            recent.pop_front();
        }
        recent.push_back((t.ts_ns, writer));
    }
}

impl Unserialized {
    /// The read after a write: when that write was a lost one, what it removed.
    pub fn on_rule_change(&mut self, c: &super::facts::RuleChangeFact) -> Option<UnserializedFact> {
        let table = format!("{}:{}", c.family, c.table);
        let i = self
            .pending
            .iter()
            .position(|f| f.writer.pid == c.pid && f.netns == c.netns && f.table == table)?;
        let mut f = self.pending.remove(i)?;
        f.kind = "lost_rules";
        f.ts_ns = c.ts_ns;
        f.lost_rules = c
            .diff
            .removed
            .iter()
            .map(|(chain, rule)| format!("-A {chain} {rule}"))
            .chain(c.diff.stripped.iter().map(rule_before))
            .collect();
        (!f.lost_rules.is_empty()).then_some(f)
    }
}

/// A rule changed in place, as it was before: its matches gained swapped back for those it
/// lost where each gained one is there to swap; else the rule now and what it lost.
fn rule_before(r: &super::facts::StrippedRule) -> String {
    let swappable =
        r.gained.len() == r.lost.len() && r.gained.iter().all(|g| r.now.contains(g.as_str()));
    if swappable {
        let mut before = r.now.clone();
        for (g, l) in r.gained.iter().zip(&r.lost) {
            before = before.replacen(g.as_str(), l, 1);
        }
        format!("-A {} {before}", r.chain)
    } else {
        format!(
            "-A {} {} (before: with {})",
            r.chain,
            r.now,
            r.lost.join(" ")
        )
    }
}

/// Two writers serialize each other only when both held the same lock file.
fn serialized(a: &Writer, b: &Writer) -> bool {
    matches!((&a.lock, &b.lock), (Some(x), Some(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::TableHead;
    use xtlock_common::{SOL_IP, XT_SO_GET_ENTRIES, XT_SO_SET_REPLACE};

    fn ev(ts: u64, pid: u32, read: bool, ret: i64) -> TableReplaceEvent {
        let mut name = [0u8; xtlock_common::XT_TABLE_MAXNAMELEN];
        name[..6].copy_from_slice(b"filter");
        TableReplaceEvent {
            ts_ns: ts,
            enter_ns: ts,
            tgid: pid,
            tid: pid,
            level: SOL_IP,
            optname: if read {
                XT_SO_GET_ENTRIES
            } else {
                XT_SO_SET_REPLACE
            },
            optlen: 0,
            ret,
            head: Some(Box::new(TableHead {
                name,
                entries: 0,
                bytes: 0,
            })),
            head_recorded: true,
            read,
            netns: 7,
        }
    }

    fn w(agent: &str, pid: u32, lock: Option<&str>) -> Writer {
        Writer {
            agent: SharedStr::from(agent),
            pid,
            lock: lock.map(SharedStr::from),
        }
    }

    fn run(steps: &[(TableReplaceEvent, Writer)]) -> Vec<UnserializedFact> {
        let mut u = Unserialized::default();
        let mut v = Vec::new();
        for (e, wr) in steps {
            u.on_table(e, wr.clone(), &mut |o| {
                if let Output::Unserialized(f) = o {
                    v.push(f)
                }
            });
        }
        v
    }

    #[test]
    fn a_write_between_anothers_read_and_replace_under_another_lock_is_lost() {
        let kp = w("kube-proxy", 10, Some("/run/a.lock"));
        let cni = w("cni", 20, Some("/run/b.lock"));
        let f = run(&[
            (ev(100, 10, true, 0), kp.clone()),
            (ev(200, 20, true, 0), cni.clone()),
            (ev(210, 20, false, 0), cni.clone()),
            (ev(300, 10, false, 0), kp.clone()),
        ]);
        let kinds: Vec<&str> = f.iter().map(|f| f.kind).collect();
        assert_eq!(kinds, ["lost_write", "writers"]);
        assert_eq!(f[0].writer, kp);
        assert_eq!(f[0].other, cni);
        assert_eq!((f[0].read_ns, f[0].other_write_ns), (Some(100), Some(210)));
        assert_eq!(f[0].table, "ip:filter");
    }

    #[test]
    fn the_same_lock_serializes_and_a_refused_replace_is_said_so() {
        let kp = w("kube-proxy", 10, Some("/run/a.lock"));
        let cni_same = w("cni", 20, Some("/run/a.lock"));
        // Same lock: nothing, even interleaved (as the lock would forbid).
        let f = run(&[
            (ev(100, 10, true, 0), kp.clone()),
            (ev(210, 20, false, 0), cni_same.clone()),
            (ev(300, 10, false, 0), kp.clone()),
        ]);
        assert!(f.is_empty(), "{f:?}");
        let lockless = w("cni", 20, None);
        let f = run(&[
            (ev(100, 10, true, 0), kp.clone()),
            (ev(210, 20, false, 0), lockless.clone()),
            (ev(300, 10, false, -i64::from(libc::EAGAIN)), kp.clone()),
        ]);
        let kinds: Vec<&str> = f.iter().map(|f| f.kind).collect();
        assert_eq!(kinds, ["refused_replace"]);
    }

    #[test]
    fn a_rule_changed_in_place_is_given_as_it_was() {
        let r = crate::analysis::facts::StrippedRule {
            chain: "FORWARD".into(),
            lost: vec!["-s 10.9.0.0/16".into()],
            gained: vec!["-s 10.1.0.0/16".into()],
            now: "-s 10.1.0.0/16 -j ACCEPT".into(),
        };
        assert_eq!(rule_before(&r), "-A FORWARD -s 10.9.0.0/16 -j ACCEPT");
        let stripped = crate::analysis::facts::StrippedRule {
            gained: vec![],
            ..r
        };
        assert_eq!(
            rule_before(&stripped),
            "-A FORWARD -s 10.1.0.0/16 -j ACCEPT (before: with -s 10.9.0.0/16)"
        );
    }

    #[test]
    fn a_pair_is_said_once() {
        let kp = w("kube-proxy", 10, Some("/run/a.lock"));
        let cni = w("cni", 20, None);
        let f = run(&[
            (ev(100, 10, false, 0), kp.clone()),
            (ev(200, 20, false, 0), cni.clone()),
            (ev(300, 10, false, 0), kp.clone()),
            (ev(400, 20, false, 0), cni.clone()),
        ]);
        let kinds: Vec<&str> = f.iter().map(|f| f.kind).collect();
        assert_eq!(kinds, ["writers"]);
    }
}
