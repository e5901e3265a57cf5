//! The kernel's drop reasons (`enum skb_drop_reason`): their numbers change between kernels,
//! so they are read from the running kernel, from the `__print_symbolic` table of the
//! `skb:kfree_skb` format file (or, failing that, from BTF), and the user's choice of
//! reasons (`--drop-reasons`) is checked against them.

use std::collections::BTreeMap;

use xtlock_common::DROP_REASON_SLOTS;

/// Reason names the default selection leaves out: normal socket teardown, not loss.
pub const NORMAL_CLOSE: &[&str] = &["SOCKET_CLOSE", "UNIX_DISCONNECT"];

/// Number to name, as this kernel spells them (without the `SKB_DROP_REASON_` prefix).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReasonTable {
    pub names: BTreeMap<u32, String>,
}

/// Which reasons to watch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ReasonSelection {
    /// Everything but a normal socket close ([`NORMAL_CLOSE`]).
    #[default]
    Default,
    All,
    /// Names as the kernel spells them (case-insensitive, `SKB_DROP_REASON_` optional).
    Names(Vec<String>),
}

impl ReasonSelection {
    /// Parses `--drop-reasons`: `all`, `default`, or a comma-separated list of names.
    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        if t.eq_ignore_ascii_case("default") {
            return Ok(Self::Default);
        }
        let names: Vec<String> = t
            .split(',')
            .map(|n| normalize(n.trim()))
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return Err(format!(
                "`{s}` names no drop reason; use e.g. NETFILTER_DROP,NO_SOCKET, `all` or `default`"
            ));
        }
        Ok(Self::Names(names))
    }
}

fn normalize(n: &str) -> String {
    let up = n.to_ascii_uppercase();
    up.strip_prefix("SKB_DROP_REASON_")
        .map(str::to_string)
        .unwrap_or(up)
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReasonError {
    #[error(
        "drop reason {name} does not exist on this kernel; it knows: {known}. Use names as \
         `xtlock probes` lists them, `all`, or `default`"
    )]
    Unknown { name: String, known: String },
    #[error(
        "this kernel does not report drop reasons (skb:kfree_skb has no `reason` field before \
         Linux 5.17), so --drop-reasons cannot choose among them; leave it out or use `all`"
    )]
    NoReasons,
}

impl ReasonTable {
    /// The `{ N, "NAME" }` pairs of `__print_symbolic(REC->reason, ...)` in a format file.
    pub fn from_format(text: &str) -> Option<Self> {
        let start = text.find("__print_symbolic(REC->reason")?;
        let mut rest = &text[start..];
        let mut names = BTreeMap::new();
        while let Some(open) = rest.find('{') {
            rest = &rest[open + 1..];
            let Some(close) = rest.find('}') else { break };
            let item = &rest[..close];
            rest = &rest[close + 1..];
            let Some((num, name)) = item.split_once(',') else {
                continue;
            };
            let Ok(n) = num.trim().parse::<u32>() else {
                continue;
            };
            let name = name.trim().trim_matches('"');
            if !name.is_empty() {
                names.insert(n, normalize(name));
            }
        }
        (!names.is_empty()).then_some(Self { names })
    }

    /// From BTF's `enum skb_drop_reason` (`SKB_DROP_REASON_` stripped).
    pub fn from_enum(values: &[(String, i64)]) -> Option<Self> {
        let names: BTreeMap<u32, String> = values
            .iter()
            .filter_map(|(n, v)| {
                let short = n.strip_prefix("SKB_DROP_REASON_")?;
                Some((u32::try_from(*v).ok()?, short.to_string()))
            })
            .collect();
        (!names.is_empty()).then_some(Self { names })
    }

    pub fn name(&self, reason: u32) -> Option<&str> {
        self.names.get(&reason).map(String::as_str)
    }

    /// The filter slots to enable for `sel` (see `DROP_REASON_SLOTS`). `has_reason` false:
    /// the kernel reports no reason (all drops come as 0).
    pub fn slots(&self, sel: &ReasonSelection, has_reason: bool) -> Result<Vec<u32>, ReasonError> {
        let last = DROP_REASON_SLOTS - 1;
        if !has_reason {
            return match sel {
                ReasonSelection::Names(_) => Err(ReasonError::NoReasons),
                _ => Ok(vec![0]),
            };
        }
        let slot = |r: u32| r.min(last);
        let mut out: Vec<u32> = match sel {
            ReasonSelection::All => (0..DROP_REASON_SLOTS).collect(),
            ReasonSelection::Default => {
                let mut v: Vec<u32> = (0..DROP_REASON_SLOTS)
                    .filter(|r| {
                        !self
                            .names
                            .get(r)
                            .is_some_and(|n| NORMAL_CLOSE.contains(&n.as_str()))
                    })
                    .collect();
                // Neither dropped nor reported: 0 is SKB_NOT_DROPPED_YET, 1 SKB_CONSUMED.
                v.retain(|&r| r > 1 || self.names.contains_key(&r));
                v
            }
            ReasonSelection::Names(want) => {
                let mut v = Vec::new();
                for w in want {
                    match self.names.iter().find(|(_, n)| *n == w) {
                        Some((r, _)) => v.push(slot(*r)),
                        None => {
                            return Err(ReasonError::Unknown {
                                name: w.clone(),
                                known: self.names.values().cloned().collect::<Vec<_>>().join(","),
                            })
                        }
                    }
                }
                v
            }
        };
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    pub fn to_pairs(&self) -> Vec<(u32, String)> {
        self.names.iter().map(|(k, v)| (*k, v.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FMT: &str = r#"print fmt: "skbaddr=%p rx_sk=%p protocol=%u location=%pS reason: %s", REC->skbaddr, REC->rx_sk, REC->protocol, REC->location, __print_symbolic(REC->reason, { 2, "NOT_SPECIFIED" }, { 3, "NO_SOCKET" }, { 4, "SOCKET_CLOSE" }, { 7, "UNIX_DISCONNECT" }, { 12, "NETFILTER_DROP" }, { 128, "MAX" })"#;

    #[test]
    fn parses_the_print_fmt_table() {
        let t = ReasonTable::from_format(FMT).unwrap();
        assert_eq!(t.name(12), Some("NETFILTER_DROP"));
        assert_eq!(t.name(3), Some("NO_SOCKET"));
        assert_eq!(t.names.len(), 6);
        assert!(ReasonTable::from_format("print fmt: \"x\"").is_none());
    }

    /// The numbers change between kernels: an older kernel's table gives other slots.
    #[test]
    fn numbers_come_from_the_table() {
        let old = ReasonTable::from_format(
            r#"__print_symbolic(REC->reason, { 1, "NOT_SPECIFIED" }, { 2, "NO_SOCKET" }, { 9, "NETFILTER_DROP" })"#,
        )
        .unwrap();
        let sel = ReasonSelection::parse("netfilter_drop, SKB_DROP_REASON_NO_SOCKET").unwrap();
        assert_eq!(old.slots(&sel, true).unwrap(), vec![2, 9]);
        let new = ReasonTable::from_format(FMT).unwrap();
        assert_eq!(new.slots(&sel, true).unwrap(), vec![3, 12]);
    }

    #[test]
    fn default_leaves_out_normal_closes() {
        let t = ReasonTable::from_format(FMT).unwrap();
        let d = t.slots(&ReasonSelection::Default, true).unwrap();
        assert!(d.contains(&12) && d.contains(&2) && d.contains(&3));
        assert!(!d.contains(&4) && !d.contains(&7));
        assert!(!d.contains(&0) && !d.contains(&1));
        assert!(d.contains(&(DROP_REASON_SLOTS - 1)));
        let a = t.slots(&ReasonSelection::All, true).unwrap();
        assert_eq!(a.len(), DROP_REASON_SLOTS as usize);
    }

    #[test]
    fn bad_names_say_what_to_do() {
        let t = ReasonTable::from_format(FMT).unwrap();
        let e = t
            .slots(
                &ReasonSelection::parse("NETFILTER_DROP,BOGUS").unwrap(),
                true,
            )
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("BOGUS") && msg.contains("NETFILTER_DROP,"),
            "{msg}"
        );
        assert!(ReasonSelection::parse(" , ").is_err());
        assert_eq!(
            t.slots(&ReasonSelection::parse("NO_SOCKET").unwrap(), false),
            Err(ReasonError::NoReasons)
        );
        assert_eq!(t.slots(&ReasonSelection::All, false).unwrap(), vec![0]);
    }

    #[test]
    fn from_btf_enum() {
        let t = ReasonTable::from_enum(&[
            ("SKB_NOT_DROPPED_YET".into(), 0),
            ("SKB_DROP_REASON_NO_SOCKET".into(), 3),
        ])
        .unwrap();
        assert_eq!(t.to_pairs(), vec![(3, "NO_SOCKET".to_string())]);
    }
}
