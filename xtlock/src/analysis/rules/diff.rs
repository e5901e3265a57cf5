//! What a write changed in a legacy table, chain by chain: chains created, deleted and
//! flushed; rules added and removed; and for a rule that kept its place, target and comment,
//! the matches it lost or gained (a save → modify → restore by an iptables that does not know
//! a match writes the rule back without it: kubernetes#112477).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::super::facts::{StrippedRule, TableDiff};
use crate::event::{Rule, RuleTable};

/// A table as last read: its chains' policies and rules.
#[derive(Clone, Debug, Default)]
pub struct TableModel {
    pub chains: BTreeMap<String, ChainModel>,
    /// Its `REJECT` rules with their chains, found once per read: refusals are matched
    /// against these every second, not against every rule of the table.
    pub rejects: Vec<(String, Rule)>,
}

#[derive(Clone, Debug)]
pub struct ChainModel {
    pub policy: Option<String>,
    pub digest: u64,
    pub rules: Vec<Rule>,
}

impl TableModel {
    /// The table a read describes, given the previous model (chains sent as digests only
    /// are unchanged from it). `None` when a chain is sent without its rules and the
    /// previous model does not have it (a capture cut in the middle).
    pub fn from_read(t: &RuleTable, prev: Option<&TableModel>) -> Option<TableModel> {
        let mut chains = BTreeMap::new();
        for c in &t.chains {
            let rules = match &c.rules {
                Some(r) => r.clone(),
                None => prev?.chains.get(&c.name)?.rules.clone(),
            };
            chains.insert(
                c.name.clone(),
                ChainModel {
                    policy: c.policy.clone(),
                    digest: c.digest,
                    rules,
                },
            );
        }
        let rejects = chains
            .iter()
            .flat_map(|(name, c)| c.rules.iter().map(move |r| (name, r)))
            .filter(|(_, r)| r.target().starts_with("-j REJECT"))
            .map(|(name, r)| (name.clone(), r.clone()))
            .collect();
        Some(TableModel { chains, rejects })
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

/// What changed from `old` to `new`.
pub fn diff(old: &TableModel, new: &TableModel) -> TableDiff {
    let mut d = TableDiff::default();
    for (name, c) in &new.chains {
        let Some(o) = old.chains.get(name) else {
            d.created.push(name.clone());
            d.added
                .extend(c.rules.iter().map(|r| (name.clone(), r.text())));
            continue;
        };
        if let (Some(op), Some(np)) = (&o.policy, &c.policy) {
            if op != np {
                d.policies.push((name.clone(), op.clone(), np.clone()));
            }
        }
        if o.digest == c.digest && o.rules == c.rules {
            continue;
        }
        if !o.rules.is_empty() && c.rules.is_empty() {
            d.flushed.push(name.clone());
        }
        diff_rules(name, &o.rules, &c.rules, &mut d);
    }
    for (name, o) in &old.chains {
        if !new.chains.contains_key(name) {
            d.deleted.push(name.clone());
            d.removed
                .extend(o.rules.iter().map(|r| (name.clone(), r.text())));
        }
    }
    d
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
mod tests {
    use super::*;

    fn rule(parts: &[&str]) -> Rule {
        Rule(parts.iter().map(|s| s.to_string()).collect())
    }

    fn model(chains: &[(&str, Option<&str>, Vec<Rule>)]) -> TableModel {
        TableModel {
            chains: chains
                .iter()
                .map(|(n, p, r)| {
                    (
                        n.to_string(),
                        ChainModel {
                            policy: p.map(str::to_string),
                            digest: crate::event::digest_rules(r),
                            rules: r.clone(),
                        },
                    )
                })
                .collect(),
            rejects: Vec::new(),
        }
    }

    #[test]
    fn stripped_match_created_deleted_flushed() {
        let fw = rule(&[
            "-m comment --comment \"kube-proxy firewall\"",
            "-m mark --mark 0x8000/0x8000",
            "-j DROP",
        ]);
        let bare = rule(&["-m comment --comment \"kube-proxy firewall\"", "-j DROP"]);
        let svc = rule(&[
            "-d 10.96.0.1/32",
            "-p tcp",
            "-m tcp --dport 443",
            "-j KUBE-SVC-X",
        ]);
        let old = model(&[
            ("INPUT", Some("ACCEPT"), vec![rule(&["-j KUBE-FIREWALL"])]),
            ("KUBE-FIREWALL", None, vec![fw.clone()]),
            ("KUBE-SERVICES", None, vec![svc.clone()]),
            ("KUBE-SVC-X", None, vec![]),
        ]);
        let new = model(&[
            ("INPUT", Some("DROP"), vec![rule(&["-j KUBE-FIREWALL"])]),
            ("KUBE-FIREWALL", None, vec![bare.clone()]),
            ("KUBE-SERVICES", None, vec![]),
            ("cali-INPUT", None, vec![rule(&["-j ACCEPT"])]),
        ]);
        let d = diff(&old, &new);
        assert_eq!(d.created, ["cali-INPUT"]);
        assert_eq!(d.deleted, ["KUBE-SVC-X"]);
        assert_eq!(d.flushed, ["KUBE-SERVICES"]);
        assert_eq!(d.removed, [("KUBE-SERVICES".to_string(), svc.text())]);
        assert_eq!(
            d.added,
            [("cali-INPUT".to_string(), "-j ACCEPT".to_string())]
        );
        assert_eq!(
            d.stripped,
            [StrippedRule {
                chain: "KUBE-FIREWALL".into(),
                lost: vec!["-m mark --mark 0x8000/0x8000".into()],
                gained: vec![],
                now: bare.text(),
            }]
        );
        assert_eq!(
            d.policies,
            [(
                "INPUT".to_string(),
                "ACCEPT".to_string(),
                "DROP".to_string()
            )]
        );
        assert!(new.reachable().contains("KUBE-FIREWALL"));
        assert!(!new.reachable().contains("cali-INPUT"));
        // Moved rules are not changes.
        let a = model(&[("X", None, vec![rule(&["-j A"]), rule(&["-j B"])])]);
        let b = model(&[("X", None, vec![rule(&["-j B"]), rule(&["-j A"])])]);
        assert!(diff(&a, &b).is_empty(), "{:?}", diff(&a, &b));
    }
}
