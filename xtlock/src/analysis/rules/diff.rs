//! What a write changed in a legacy table, chain by chain: chains created, deleted and
//! flushed; rules added and removed; and for a rule that kept its place, target and comment,
//! the matches it lost or gained (a save → modify → restore by an iptables that does not know
//! a match writes the rule back without it: kubernetes#112477).

use std::collections::{BTreeSet, HashMap};

use super::super::facts::{StrippedRule, TableDiff};
use super::super::procs::FastMap;
use crate::event::{ChainState, Rule, RuleTable};
use crate::shared::SharedStr;

/// A table as last read: its chains' policies and rules. A read updates it in place
/// ([`TableModel::apply`]): a chain the read sends as its digest only keeps its model, so a
/// read costs what changed, not the table's size.
#[derive(Clone, Debug, Default)]
pub struct TableModel {
    /// By name, hashed: a read looks up each of its chains once.
    pub chains: FastMap<SharedStr, ChainModel>,
    /// Its `REJECT` rules with their chains, found again only when a chain with one changes:
    /// refusals are matched against these every second, not against every rule of the table.
    pub rejects: Vec<(String, Rule)>,
    /// The number of the last read applied; a chain it named carries it in `seen`.
    read: u64,
    /// Chain models built from a read's rules (created or changed chains), all reads
    /// together: unchanged chains are never rebuilt.
    built: u64,
    /// The last read applied, chain by chain in its order: name, digest, policy. A read
    /// naming the same chains in the same order (the capture reader hands it the same
    /// names: a pointer compare each) needs no look-up for a chain sent as an unchanged
    /// digest. Empty when that read named a chain twice (then its model is not this list).
    order: Vec<(SharedStr, u64, Option<SharedStr>)>,
    /// Reads whose chain list was the previous one's.
    #[cfg(test)]
    same_order: u64,
}

#[derive(Clone, Debug)]
pub struct ChainModel {
    pub policy: Option<SharedStr>,
    pub digest: u64,
    pub rules: Vec<Rule>,
    /// The last read that named this chain (`TableModel::read`).
    seen: u64,
}

/// A chain a read created or changed: its rules before (`None`: created).
type Touched<'a> = (&'a str, Option<Vec<Rule>>);

impl TableModel {
    /// The model of a table's first read (what is there already is the baseline). `None`
    /// when a chain is sent without its rules (a capture cut in the middle).
    pub fn from_read(t: &RuleTable) -> Option<TableModel> {
        let mut m = TableModel::default();
        m.update(t, false)?;
        Some(m)
    }

    /// Applies a later read of the table: what changed since the previous one. `None`, and
    /// the model as it was, when a chain is sent as its digest only and the model does not
    /// have it (a capture cut in the middle).
    pub fn apply(&mut self, t: &RuleTable) -> Option<TableDiff> {
        self.update(t, true)
    }

    /// Chain models built from reads' rules so far.
    #[cfg(test)]
    pub fn built(&self) -> u64 {
        self.built
    }

    /// Reads whose chain list was the previous one's (see `order`).
    #[cfg(test)]
    pub fn same_order(&self) -> u64 {
        self.same_order
    }

    fn update(&mut self, t: &RuleTable, say: bool) -> Option<TableDiff> {
        self.read += 1;
        let read = self.read;
        let same_order = !self.order.is_empty()
            && self.order.len() == t.chains.len()
            && self.order.iter().zip(&t.chains).all(|(o, c)| o.0 == c.name);
        // First pass, one look-up a chain: the chains this read names are marked (a mark
        // only, undone by nothing: the next read has another number), and those that need
        // more than that are noted. Backwards: a chain named twice is as its last mention
        // says, the first one met here.
        let mut named = 0;
        // (chain, known to the model before this read)
        let mut todo: Vec<(&ChainState, bool)> = Vec::new();
        if same_order {
            #[cfg(test)]
            {
                self.same_order += 1;
            }
            // The chains the model has, each once: none is deleted, and one sent as the
            // digest and policy it had is unchanged (no look-up, no mark needed).
            named = self.chains.len();
            for (c, o) in t.chains.iter().zip(&self.order).rev() {
                if more_than_a_mark(c, o.1, &o.2) {
                    todo.push((c, true));
                }
            }
        }
        for c in t.chains.iter().rev().filter(|_| !same_order) {
            match self.chains.get_mut(&c.name) {
                Some(m) if m.seen == read => {}
                Some(m) => {
                    m.seen = read;
                    named += 1;
                    if more_than_a_mark(c, m.digest, &m.policy) {
                        todo.push((c, true));
                    }
                }
                // Sent as a digest, but not known: nothing changes (a capture cut short).
                None if c.rules.is_none() => return None,
                None => todo.push((c, false)),
            }
        }
        let before = self.chains.len();
        let (touched, policies) = self.apply_changed(todo, read, say);
        // The chains this read did not name are gone.
        let mut deleted: Vec<(SharedStr, ChainModel)> = Vec::new();
        if named < before {
            let mut gone: Vec<SharedStr> = self
                .chains
                .iter()
                .filter(|(_, c)| c.seen != read)
                .map(|(n, _)| n.clone())
                .collect();
            gone.sort_unstable();
            deleted.extend(gone.iter().filter_map(|n| self.chains.remove_entry(n)));
        }
        self.refresh_rejects(&touched, &deleted);
        self.remember_order(t, same_order);
        if !say {
            return Some(TableDiff::default());
        }
        Some(self.table_diff(touched, policies, deleted))
    }

    /// The second pass: the chains of `todo` (with whether the model knew them before this
    /// read) applied to the model; the chains created or changed, with their rules before,
    /// and the policy changes when `say`.
    fn apply_changed<'a>(
        &mut self,
        todo: Vec<(&'a ChainState, bool)>,
        read: u64,
        say: bool,
    ) -> (Vec<Touched<'a>>, Vec<(String, String, String)>) {
        let mut touched: Vec<Touched<'a>> = Vec::new();
        let mut policies: Vec<(String, String, String)> = Vec::new();
        for (c, known) in todo {
            match self.chains.get_mut(&c.name) {
                // Created just now, from this read's later mention of it, which wins.
                Some(_) if !known => {}
                Some(m) => {
                    if let (Some(op), Some(np)) = (&m.policy, &c.policy) {
                        if op != np && say {
                            policies.push((c.name.to_string(), op.to_string(), np.to_string()));
                        }
                    }
                    if m.policy != c.policy {
                        m.policy.clone_from(&c.policy);
                    }
                    let same = m.digest == c.digest;
                    m.digest = c.digest;
                    // Rules sent as the digest only are the model's already.
                    let Some(rules) = &c.rules else { continue };
                    if same && m.rules == *rules {
                        continue;
                    }
                    self.built += 1;
                    let old = std::mem::replace(&mut m.rules, rules.clone());
                    touched.push((&c.name, Some(old)));
                }
                None => {
                    // Every chain the model lacks came with its rules (checked above).
                    let Some(rules) = &c.rules else { continue };
                    self.built += 1;
                    self.chains.insert(
                        c.name.clone(),
                        ChainModel {
                            policy: c.policy.clone(),
                            digest: c.digest,
                            rules: rules.clone(),
                            seen: read,
                        },
                    );
                    touched.push((&c.name, None));
                }
            }
        }
        (touched, policies)
    }

    /// The `REJECT` rules found again, only when a chain with one was created, changed or
    /// deleted.
    fn refresh_rejects(&mut self, touched: &[Touched<'_>], deleted: &[(SharedStr, ChainModel)]) {
        let has_reject = |rules: &[Rule]| rules.iter().any(is_reject);
        let rejects_moved = touched.iter().any(|(name, old)| {
            old.as_deref().is_some_and(has_reject)
                || self.chains.get(*name).is_some_and(|c| has_reject(&c.rules))
        }) || deleted.iter().any(|(_, c)| has_reject(&c.rules));
        if rejects_moved {
            let mut with: Vec<(&SharedStr, &ChainModel)> = self
                .chains
                .iter()
                .filter(|(_, c)| has_reject(&c.rules))
                .collect();
            with.sort_unstable_by(|a, b| a.0.cmp(b.0));
            self.rejects = with
                .into_iter()
                .flat_map(|(name, c)| c.rules.iter().map(move |r| (name, r)))
                .filter(|(_, r)| is_reject(r))
                .map(|(name, r)| (name.to_string(), r.clone()))
                .collect();
        }
    }

    /// What the read changed, from the chains it touched and deleted.
    fn table_diff(
        &self,
        mut touched: Vec<Touched<'_>>,
        mut policies: Vec<(String, String, String)>,
        deleted: Vec<(SharedStr, ChainModel)>,
    ) -> TableDiff {
        // In chain order, as a diff of the whole tables would say it.
        touched.sort_unstable_by(|a, b| a.0.cmp(b.0));
        policies.sort_by(|a, b| a.0.cmp(&b.0));
        let mut d = TableDiff {
            policies,
            ..TableDiff::default()
        };
        for (name, old) in touched {
            let Some(c) = self.chains.get(name) else {
                continue;
            };
            match old {
                None => {
                    d.created.push(name.to_string());
                    d.added
                        .extend(c.rules.iter().map(|r| (name.to_string(), r.text())));
                }
                Some(old) => {
                    if !old.is_empty() && c.rules.is_empty() {
                        d.flushed.push(name.to_string());
                    }
                    diff_rules(name, &old, &c.rules, &mut d);
                }
            }
        }
        for (name, o) in deleted {
            d.removed
                .extend(o.rules.iter().map(|r| (name.to_string(), r.text())));
            d.deleted.push(name.to_string());
        }
        d
    }

    /// Keeps the chain list of the read just applied (see `order`).
    fn remember_order(&mut self, t: &RuleTable, same_order: bool) {
        if same_order {
            for (o, c) in self.order.iter_mut().zip(&t.chains) {
                if o.1 != c.digest || o.2 != c.policy {
                    (o.1, o.2) = (c.digest, c.policy.clone());
                }
            }
            return;
        }
        self.order.clear();
        // As many chains as names: none named twice.
        if self.chains.len() == t.chains.len() {
            self.order.extend(
                t.chains
                    .iter()
                    .map(|c| (c.name.clone(), c.digest, c.policy.clone())),
            );
        }
    }

    /// Chains reachable from a built-in chain by jumps and gotos.
    pub fn reachable(&self) -> BTreeSet<&str> {
        let mut seen: BTreeSet<&str> = self
            .chains
            .iter()
            .filter(|(_, c)| c.policy.is_some())
            .map(|(n, _)| n.as_str())
            .collect();
        let mut todo: Vec<&str> = seen.iter().copied().collect();
        while let Some(n) = todo.pop() {
            for r in self.chains.get(n).map_or(&[][..], |c| &c.rules[..]) {
                if let Some(j) = r.jump() {
                    if self.chains.contains_key(j) && seen.insert(j) {
                        todo.push(j);
                    }
                }
            }
        }
        seen
    }
}

/// Whether a chain a read names needs more than its mark: it came with its rules, or its
/// digest or policy is not the `digest` and `policy` the model has.
fn more_than_a_mark(c: &ChainState, digest: u64, policy: &Option<SharedStr>) -> bool {
    c.rules.is_some() || c.digest != digest || c.policy != *policy
}

fn is_reject(r: &Rule) -> bool {
    r.target().starts_with("-j REJECT")
}

fn diff_rules(chain: &str, old: &[Rule], new: &[Rule], d: &mut TableDiff) {
    // Rules present in both, as many times as in both, are unchanged wherever they moved.
    let mut count: HashMap<&Rule, i64> = HashMap::new();
    for r in old {
        *count.entry(r).or_default() += 1;
    }
    for r in new {
        *count.entry(r).or_default() -= 1;
    }
    let mut gone: Vec<&Rule> = Vec::new();
    let mut left = count.clone();
    for r in old {
        if let Some(n) = left.get_mut(r) {
            if *n > 0 {
                *n -= 1;
                gone.push(r);
            }
        }
    }
    let mut came: Vec<&Rule> = Vec::new();
    let mut left = count;
    for r in new {
        if let Some(n) = left.get_mut(r) {
            if *n < 0 {
                *n += 1;
                came.push(r);
            }
        }
    }
    // A removed and an added rule with the same target and comment are one rule changed:
    // the matches it lost or gained.
    let mut used = vec![false; came.len()];
    for g in gone {
        let pair = came
            .iter()
            .enumerate()
            .position(|(i, c)| !used[i] && c.target() == g.target() && c.comment() == g.comment());
        match pair {
            Some(i) => {
                used[i] = true;
                let c = came[i];
                let had: BTreeSet<&str> = g.matches().collect();
                let has: BTreeSet<&str> = c.matches().collect();
                d.stripped.push(StrippedRule {
                    chain: chain.to_string(),
                    lost: had.difference(&has).map(|s| s.to_string()).collect(),
                    gained: has.difference(&had).map(|s| s.to_string()).collect(),
                    now: c.text(),
                });
            }
            None => d.removed.push((chain.to_string(), g.text())),
        }
    }
    for (i, c) in came.into_iter().enumerate() {
        if !used[i] {
            d.added.push((chain.to_string(), c.text()));
        }
    }
}

#[cfg(test)]
mod tests;
