//! The one place figures are quoted from: every `cargo xtask bench` run adds a dated section
//! to docs/figures.md (date, commit, machine, load), newest first, older runs kept below as
//! history. Each part's row lists the medians its JSON results hold (`target/bench/*.json`
//! keep everything): the README and the docs link here instead of copying numbers.

use std::fs;
use std::path::Path;

use anyhow::{Context as _, Result};
use serde_json::Value;

/// Relative to the workspace root.
pub const FILE: &str = "docs/figures.md";

const HEAD: &str = "# Figures\n\n\
Every `cargo xtask bench` run adds its section here, newest first (`xtask/src/bench/figures.rs`):\n\
when, which commit, on what machine and under what load, and per part the medians of its\n\
measurements, named by where they are in that part's JSON results (`target/bench/<part>.json`,\n\
which keep every run's samples, spreads and the bpftrace scripts). What the parts measure and\n\
what the figures mean: docs/performance.md. Quote a figure by linking its section.\n";

/// Medians listed per part, at most.
const MAX_PER_PART: usize = 24;

/// Adds this run's section to `path` (creating the file), above the older ones.
pub fn record(
    path: &Path,
    machine: &Value,
    parts: &[(String, Value, String, String)],
) -> Result<()> {
    let old = fs::read_to_string(path).unwrap_or_default();
    let history = old.split_once("\n## ").map(|(_, h)| format!("## {h}"));
    let mut s = String::from(HEAD);
    s.push('\n');
    s.push_str(&section(machine, parts));
    if let Some(h) = history {
        s.push('\n');
        s.push_str(&h);
    }
    fs::write(path, s).with_context(|| format!("writing {}", path.display()))
}

fn text(v: &Value, key: &str) -> String {
    match &v[key] {
        Value::String(s) => s.clone(),
        Value::Null => "?".into(),
        other => other.to_string(),
    }
}

/// `## 2026-11-29T03:40:00Z, 59c9e78, AMD EPYC 7B13 (2 cores, kernel 6.18)`, then a row per
/// median.
fn section(machine: &Value, parts: &[(String, Value, String, String)]) -> String {
    let mut s = format!(
        "## {}, {}, {} ({} cores, {} MiB, kernel {})\n\n| part | load before → after | measurement | median |\n|---|---|---|---:|\n",
        text(machine, "date_utc"),
        text(machine, "xtlock_commit"),
        text(machine, "cpu"),
        text(machine, "cores"),
        text(machine, "memory_mib"),
        text(machine, "kernel"),
    );
    for (part, results, before, after) in parts {
        let mut medians = Vec::new();
        medians_of(results, String::new(), &mut medians);
        if medians.is_empty() {
            s.push_str(&format!(
                "| {part} | {before} → {after} | (no medians) | |\n"
            ));
        }
        let more = medians.len().saturating_sub(MAX_PER_PART);
        for (path, m) in medians.into_iter().take(MAX_PER_PART) {
            s.push_str(&format!(
                "| {part} | {before} → {after} | `{path}` | {m} |\n"
            ));
        }
        if more > 0 {
            s.push_str(&format!(
                "| {part} | | {more} more in `target/bench/{part}.json` | |\n"
            ));
        }
    }
    s
}

/// Every `median` under `v`, with the path of keys that leads to it.
fn medians_of(v: &Value, path: String, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            if let Some(med) = m.get("median").filter(|x| x.is_number()) {
                out.push((path, number(med)));
                return;
            }
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                medians_of(x, p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                medians_of(x, format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn number(v: &Value) -> String {
    match v.as_f64() {
        Some(f) if f.abs() >= 100.0 => format!("{f:.0}"),
        Some(f) => format!("{f:.3}"),
        None => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_run_goes_on_top_and_older_ones_stay() {
        let dir = std::env::temp_dir().join(format!("xtask-figures-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("figures.md");
        let machine = |date: &str| {
            json!({"date_utc": date, "xtlock_commit": "abc1234", "cpu": "CPU", "cores": 2,
                   "memory_mib": 1024, "kernel": "6.18"})
        };
        let results = json!({"tracers": {"xtlock": {"drops_per_s": {"median": 769122.4, "n": 3}},
                                        "untraced": {"drops_per_s": {"median": 832454.0}}}});
        let part = |r: &Value| vec![("drops".to_string(), r.clone(), "1.5".into(), "1.6".into())];
        record(&path, &machine("2026-11-28T00:00:00Z"), &part(&results)).unwrap();
        record(&path, &machine("2026-11-29T00:00:00Z"), &part(&results)).unwrap();
        let s = fs::read_to_string(&path).unwrap();
        let (new, old) = (
            s.find("## 2026-11-29").unwrap(),
            s.find("## 2026-11-28").unwrap(),
        );
        assert!(new < old, "{s}");
        assert_eq!(s.matches("# Figures").count(), 1, "{s}");
        assert!(
            s.contains("| drops | 1.5 → 1.6 | `tracers.xtlock.drops_per_s` | 769122 |"),
            "{s}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
