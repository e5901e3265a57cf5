use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::event::{digest_rules, ChainState};

fn rule(parts: &[&str]) -> Rule {
    Rule(parts.iter().map(|s| s.to_string()).collect())
}

/// A chain as the kernel has it: (policy, rules).
type Chain = (Option<String>, Vec<Rule>);
/// A table as the kernel has it, by chain name.
type Table = BTreeMap<String, Chain>;

fn table(chains: &[(&str, Option<&str>, Vec<Rule>)]) -> Table {
    chains
        .iter()
        .map(|(n, p, r)| (n.to_string(), (p.map(str::to_string), r.clone())))
        .collect()
}

/// The read of `now` as the source sends it after `before`: a chain whose rules did not
/// change as its digest only.
fn read(before: Option<&Table>, now: &Table) -> RuleTable {
    RuleTable {
        ts_ns: 1,
        netns: 7,
        family: "ip".into(),
        table: "nat".into(),
        after_pid: 1,
        skipped: String::new(),
        chains: now
            .iter()
            .map(|(name, (policy, rules))| {
                let digest = digest_rules(rules);
                let same = before
                    .and_then(|b| b.get(name))
                    .is_some_and(|(_, r)| digest_rules(r) == digest);
                ChainState {
                    name: name.as_str().into(),
                    policy: policy.as_deref().map(SharedStr::from),
                    digest,
                    rules: (!same).then(|| rules.clone()),
                }
            })
            .collect(),
        more: false,
    }
}

/// The diff of two whole tables, chain by chain, as it was computed before reads updated
/// the model in place: the reference the incremental diff must equal.
fn whole_diff(old: &Table, new: &Table) -> TableDiff {
    let mut d = TableDiff::default();
    for (name, (np, nr)) in new {
        let Some((op, or)) = old.get(name) else {
            d.created.push(name.clone());
            d.added.extend(nr.iter().map(|r| (name.clone(), r.text())));
            continue;
        };
        if let (Some(op), Some(np)) = (op, np) {
            if op != np {
                d.policies.push((name.clone(), op.clone(), np.clone()));
            }
        }
        if or == nr {
            continue;
        }
        if !or.is_empty() && nr.is_empty() {
            d.flushed.push(name.clone());
        }
        diff_rules(name, or, nr, &mut d);
    }
    for (name, (_, or)) in old {
        if !new.contains_key(name) {
            d.deleted.push(name.clone());
            d.removed
                .extend(or.iter().map(|r| (name.clone(), r.text())));
        }
    }
    d
}

/// The model holds `t` exactly, its REJECT rules included.
fn assert_models(m: &TableModel, t: &Table) {
    let chains: Table = m
        .chains
        .iter()
        .map(|(n, c)| {
            let policy = c.policy.as_deref().map(str::to_string);
            (n.to_string(), (policy, c.rules.clone()))
        })
        .collect();
    assert_eq!(&chains, t);
    for (n, c) in &m.chains {
        assert_eq!(c.digest, digest_rules(&c.rules), "{n}");
    }
    let rejects: Vec<(String, Rule)> = t
        .iter()
        .flat_map(|(n, (_, rs))| rs.iter().map(move |r| (n, r)))
        .filter(|(_, r)| r.target().starts_with("-j REJECT"))
        .map(|(n, r)| (n.clone(), r.clone()))
        .collect();
    assert_eq!(m.rejects, rejects);
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
    let old = table(&[
        ("INPUT", Some("ACCEPT"), vec![rule(&["-j KUBE-FIREWALL"])]),
        ("KUBE-FIREWALL", None, vec![fw.clone()]),
        ("KUBE-SERVICES", None, vec![svc.clone()]),
        ("KUBE-SVC-X", None, vec![]),
    ]);
    let new = table(&[
        ("INPUT", Some("DROP"), vec![rule(&["-j KUBE-FIREWALL"])]),
        ("KUBE-FIREWALL", None, vec![bare.clone()]),
        ("KUBE-SERVICES", None, vec![]),
        ("cali-INPUT", None, vec![rule(&["-j ACCEPT"])]),
    ]);
    let mut m = TableModel::from_read(&read(None, &old)).expect("a whole read");
    let d = m.apply(&read(Some(&old), &new)).expect("a whole read");
    assert_eq!(d, whole_diff(&old, &new));
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
    assert_models(&m, &new);
    assert!(m.reachable().contains("KUBE-FIREWALL"));
    assert!(!m.reachable().contains("cali-INPUT"));
    // Moved rules are not changes.
    let a = table(&[("X", None, vec![rule(&["-j A"]), rule(&["-j B"])])]);
    let b = table(&[("X", None, vec![rule(&["-j B"]), rule(&["-j A"])])]);
    let mut m = TableModel::from_read(&read(None, &a)).expect("a whole read");
    let d = m.apply(&read(Some(&a), &b)).expect("a whole read");
    assert!(d.is_empty(), "{d:?}");
}

/// kube-proxy's nat table as the collector bench has it: `services` services, a KUBE-SVC
/// and a KUBE-SEP chain each, behind KUBE-SERVICES.
fn nat(services: usize, port: impl Fn(usize) -> u16) -> Table {
    let mut t = Table::new();
    let mut jumps = Vec::new();
    for i in 0..services {
        let (svc, sep) = (format!("KUBE-SVC-{i:04}"), format!("KUBE-SEP-{i:04}"));
        jumps.push(rule(&[&format!("-d 10.96.0.{i}/32"), &format!("-j {svc}")]));
        t.insert(svc, (None, vec![rule(&[&format!("-j {sep}")])]));
        let to = format!("-j DNAT --to-destination 10.244.0.{i}:{}", port(i));
        t.insert(sep, (None, vec![rule(&["-p tcp", &to])]));
    }
    t.insert("KUBE-SERVICES".into(), (None, jumps));
    t.insert(
        "PREROUTING".into(),
        (Some("ACCEPT".into()), vec![rule(&["-j KUBE-SERVICES"])]),
    );
    t
}

#[test]
fn a_read_with_one_chain_changed_rebuilds_only_it_and_diffs_as_the_whole_tables_did() {
    let before = nat(100, |_| 80);
    let after = nat(100, |i| if i == 42 { 8080 } else { 80 });
    let mut m = TableModel::from_read(&read(None, &before)).expect("a whole read");
    assert_eq!(m.built(), 202, "the first read builds every chain");
    let r = read(Some(&before), &after);
    assert_eq!(
        r.chains.iter().filter(|c| c.rules.is_some()).count(),
        1,
        "one chain sent with its rules"
    );
    let d = m.apply(&r).expect("a whole read");
    assert_eq!(d, whole_diff(&before, &after));
    assert_eq!(
        d.added,
        [(
            "KUBE-SEP-0042".to_string(),
            "-p tcp -j DNAT --to-destination 10.244.0.42:8080".to_string()
        )]
    );
    assert_eq!(d.removed.len(), 1);
    assert_eq!(m.built(), 203, "only the changed chain is built again");
    assert_models(&m, &after);
    // The same rules sent again (a source that forgot its digests): nothing built.
    let all = read(None, &after);
    let d = m.apply(&all).expect("a whole read");
    assert!(d.is_empty(), "{d:?}");
    assert_eq!(m.built(), 203);
}

#[test]
fn a_read_of_an_unknown_chain_as_a_digest_leaves_the_model_whole() {
    let before = nat(3, |_| 80);
    let mut m = TableModel::from_read(&read(None, &before)).expect("a whole read");
    let mut after = nat(3, |_| 81);
    after.insert("KUBE-NEW".into(), (None, vec![rule(&["-j RETURN"])]));
    let mut r = read(Some(&before), &after);
    for c in &mut r.chains {
        if c.name == "KUBE-NEW" {
            c.rules = None;
        }
    }
    assert!(m.apply(&r).is_none());
    assert_models(&m, &before);
    assert!(TableModel::from_read(&r).is_none());
}

/// One step of a generated history: what happens to the chain of index `chain`.
#[derive(Clone, Debug)]
enum Step {
    Create(u8),
    Delete(u8),
    Flush(u8),
    Add(u8, u8),
    Remove(u8, u8),
    Strip(u8, u8),
    Reject(u8),
    Policy(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        any::<u8>().prop_map(Step::Create),
        any::<u8>().prop_map(Step::Delete),
        any::<u8>().prop_map(Step::Flush),
        (any::<u8>(), any::<u8>()).prop_map(|(c, r)| Step::Add(c, r)),
        (any::<u8>(), any::<u8>()).prop_map(|(c, r)| Step::Remove(c, r)),
        (any::<u8>(), any::<u8>()).prop_map(|(c, r)| Step::Strip(c, r)),
        any::<u8>().prop_map(Step::Reject),
        any::<u8>().prop_map(Step::Policy),
    ]
}

fn apply_step(t: &mut Table, s: &Step) {
    let name = |c: u8| format!("C{}", c % 12);
    fn nth(t: &mut Table, c: u8) -> Option<(String, &mut Chain)> {
        let n = t.len();
        if n == 0 {
            return None;
        }
        t.iter_mut()
            .nth(usize::from(c) % n)
            .map(|(k, v)| (k.clone(), v))
    }
    match *s {
        Step::Create(c) => {
            t.entry(name(c))
                .or_insert_with(|| (None, vec![rule(&["-j RETURN"])]));
        }
        Step::Delete(c) => {
            if let Some((k, _)) = nth(t, c) {
                t.remove(&k);
            }
        }
        Step::Flush(c) => {
            if let Some((_, v)) = nth(t, c) {
                v.1.clear();
            }
        }
        Step::Add(c, r) => {
            if let Some((_, v)) = nth(t, c) {
                let at = usize::from(r) % (v.1.len() + 1);
                let target = format!("-j C{}", r % 12);
                v.1.insert(at, rule(&[&format!("-s 10.0.0.{r}/32"), &target]));
            }
        }
        Step::Remove(c, r) => {
            if let Some((_, v)) = nth(t, c) {
                if !v.1.is_empty() {
                    let at = usize::from(r) % v.1.len();
                    v.1.remove(at);
                }
            }
        }
        Step::Strip(c, r) => {
            if let Some((_, v)) = nth(t, c) {
                let at = usize::from(r) % v.1.len().max(1);
                if let Some(x) = v.1.get_mut(at) {
                    if x.0.len() > 1 {
                        x.0.remove(0);
                    } else {
                        x.0.insert(0, "-m mark --mark 0x1".into());
                    }
                }
            }
        }
        Step::Reject(c) => {
            if let Some((_, v)) = nth(t, c) {
                v.1.push(rule(&[
                    "-p tcp",
                    "-j REJECT --reject-with icmp-port-unreachable",
                ]));
            }
        }
        Step::Policy(c) => {
            let p = if c % 2 == 0 { "ACCEPT" } else { "DROP" };
            t.insert(
                "INPUT".into(),
                (
                    Some(p.into()),
                    t.get("INPUT").map(|v| v.1.clone()).unwrap_or_default(),
                ),
            );
        }
    }
}

proptest! {
    /// Any history of writes, each read back as the source sends it: the model updated in
    /// place says what a diff of the whole tables said, holds the table read, and builds
    /// only the chains whose rules came in the read.
    #[test]
    fn reads_applied_in_place_diff_as_whole_tables(
        reads in proptest::collection::vec(proptest::collection::vec(step(), 1..4), 1..12),
    ) {
        let mut t = table(&[
            ("INPUT", Some("ACCEPT"), vec![rule(&["-j C0"])]),
            ("C0", None, vec![rule(&["-j C1"]), rule(&["-p udp", "-j REJECT"])]),
            ("C1", None, vec![]),
        ]);
        let mut m = TableModel::from_read(&read(None, &t)).expect("a whole read");
        for steps in &reads {
            let before = t.clone();
            for s in steps {
                apply_step(&mut t, s);
            }
            let r = read(Some(&before), &t);
            let sent = r.chains.iter().filter(|c| c.rules.is_some()).count() as u64;
            let built = m.built();
            let d = m.apply(&r).expect("a whole read");
            prop_assert_eq!(d, whole_diff(&before, &t));
            assert_models(&m, &t);
            prop_assert!(m.built() - built <= sent);
        }
    }
}

#[test]
fn a_read_naming_the_last_reads_chains_skips_look_ups_and_still_sees_changes() {
    let before = nat(10, |_| 80);
    let mut m = TableModel::from_read(&read(None, &before)).expect("a whole read");
    let after = nat(10, |i| if i == 3 { 8080 } else { 80 });
    let d = m.apply(&read(Some(&before), &after)).expect("a whole read");
    assert_eq!(m.same_order(), 1);
    assert_eq!(d, whole_diff(&before, &after));
    assert_models(&m, &after);
    // A policy changed with no rule changed: seen with no look-up.
    let mut policy = after.clone();
    if let Some(c) = policy.get_mut("PREROUTING") {
        c.0 = Some("DROP".into());
    }
    let d = m.apply(&read(Some(&after), &policy)).expect("a whole read");
    assert_eq!(m.same_order(), 2);
    assert_eq!(
        d.policies,
        [("PREROUTING".into(), "ACCEPT".into(), "DROP".into())]
    );
    assert_models(&m, &policy);
    // A digest that differs from the model's, sent without rules: kept, as a look-up did.
    let mut r = read(Some(&policy), &policy);
    r.chains[0].digest ^= 1;
    m.apply(&r).expect("a whole read");
    assert_eq!(m.same_order(), 3);
    assert_eq!(m.chains[&r.chains[0].name].digest, r.chains[0].digest);
    // Put back for the model to hold the table again.
    m.apply(&read(None, &policy)).expect("a whole read");
    assert_models(&m, &policy);
    // A chain renamed: another list; created and deleted as the whole tables said.
    let mut renamed = policy.clone();
    if let Some(c) = renamed.remove("KUBE-SEP-0003") {
        renamed.insert("KUBE-SEP-0003B".into(), c);
    }
    let same = m.same_order();
    let d = m
        .apply(&read(Some(&policy), &renamed))
        .expect("a whole read");
    assert_eq!(m.same_order(), same);
    assert_eq!(d, whole_diff(&policy, &renamed));
    assert_eq!(d.created, ["KUBE-SEP-0003B"]);
    assert_eq!(d.deleted, ["KUBE-SEP-0003"]);
    assert_models(&m, &renamed);
    // And the read after it is the same list again.
    let d = m
        .apply(&read(Some(&renamed), &renamed))
        .expect("a whole read");
    assert!(d.is_empty(), "{d:?}");
    assert_eq!(m.same_order(), same + 1);
}

#[test]
fn a_read_naming_a_chain_twice_is_never_taken_for_the_same_list() {
    let base = nat(2, |_| 80);
    let mut r = read(None, &base);
    // KUBE-SEP-0000 named twice: last with other rules, which win.
    let rules = vec![rule(&["-j RETURN"])];
    r.chains.push(ChainState {
        name: "KUBE-SEP-0000".into(),
        policy: None,
        digest: digest_rules(&rules),
        rules: Some(rules.clone()),
    });
    let mut m = TableModel::from_read(&r).expect("a whole read");
    let mut want = base.clone();
    if let Some(c) = want.get_mut("KUBE-SEP-0000") {
        c.1 = rules;
    }
    for _ in 0..2 {
        let d = m.apply(&r).expect("a whole read");
        assert!(d.is_empty(), "{d:?}");
        assert_eq!(m.same_order(), 0);
        assert_models(&m, &want);
    }
}
