//! The docs against the code, so neither drifts from the other: every metric documented is
//! registered and every one registered documented (docs/metrics.md); every capture record
//! kind is in the spec's table (docs/capture-format.md) and every kind there is one; every
//! fact type has its section in docs/json.md and every section is a fact type; every
//! `xtlock` command line in the README and docs parses with the real command line.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser as _;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every Markdown file a person reads: the README, docs/ and deploy/README.md.
fn doc_files() -> Vec<PathBuf> {
    let mut v = vec![root().join("README.md"), root().join("deploy/README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    docs.retain(|p| p.extension().is_some_and(|e| e == "md"));
    docs.sort();
    v.extend(docs);
    v
}

/// The metric names `Metrics::new` registers, read from its calls (an exposition lists only
/// families with a series): `r.register("name", ...)`, `register_with_unit` (seconds), and the
/// conntrack counters' `conntrack_{name}`.
fn registered_metrics() -> BTreeSet<String> {
    let src = read("xtlock/src/sinks/metrics.rs");
    let mut out = BTreeSet::new();
    for (call, suffix) in [("r.register(", ""), ("r.register_with_unit(", "_seconds")] {
        for (at, _) in src.match_indices(call) {
            let rest = src[at + call.len()..].trim_start();
            if let Some(name) = rest.strip_prefix('"').and_then(|r| r.split('"').next()) {
                out.insert(format!("xtlock_{name}{suffix}"));
            }
        }
    }
    for (name, _) in crate::sinks::metrics::CONNTRACK_COUNTERS {
        out.insert(format!("xtlock_conntrack_{name}"));
    }
    out
}

#[test]
fn every_metric_is_documented_and_every_documented_one_registered() {
    let registered = registered_metrics();
    assert!(registered.len() >= 40, "{registered:?}");
    let docs = read("docs/metrics.md");
    // The table's first column: | `xtlock_name` | type | ...
    let documented: BTreeSet<String> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("| `xtlock_"))
        .filter_map(|l| l.split('`').next())
        .map(|n| format!("xtlock_{n}"))
        .collect();
    // The table names counters with `_total` and the build info with `_info`, as scraped.
    let base = |n: &str| {
        let n = n.strip_suffix("_total").unwrap_or(n);
        n.strip_suffix("_info").unwrap_or(n).to_string()
    };
    let documented_base: BTreeSet<String> = documented.iter().map(|n| base(n)).collect();
    let registered_base: BTreeSet<String> = registered.iter().map(|n| base(n)).collect();
    let undocumented: Vec<&String> = registered_base.difference(&documented_base).collect();
    let unregistered: Vec<&String> = documented_base.difference(&registered_base).collect();
    assert!(
        undocumented.is_empty(),
        "registered but not in docs/metrics.md's table: {undocumented:?}"
    );
    assert!(
        unregistered.is_empty(),
        "in docs/metrics.md's table but never registered: {unregistered:?}"
    );
    // And no other doc names a metric that does not exist.
    for f in doc_files() {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for (at, _) in text.match_indices("xtlock_") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let known = |n: &str| {
                registered_base.contains(&base(n))
                    || ["_bucket", "_sum", "_count"].iter().any(|s| {
                        n.strip_suffix(s)
                            .is_some_and(|b| registered_base.contains(b))
                    })
            };
            // Only metric-shaped names (`xtlock_common`, `xtlock_tests` are crates).
            let crate_name = ["xtlock_common", "xtlock_tests", "xtlock_ebpf"]
                .iter()
                .any(|c| name.starts_with(c));
            // A recording rule's middle (`node_agent:xtlock_lock_holds:rate5m`) names a series
            // of its own, and a few names are fields, not metrics.
            let recorded = at > 0 && text[..at].ends_with(':');
            let field = ["xtlock_version", "xtlock_commit"].contains(&name.as_str());
            if recorded || field {
                continue;
            }
            // Not a file name (`xtlock_0.1.0_amd64.deb`).
            let versioned = name["xtlock_".len()..].starts_with(|c: char| c.is_ascii_digit());
            if name.len() > "xtlock_".len() && !crate_name && !versioned && !name.ends_with('_') {
                assert!(known(&name), "{}: `{name}` is no metric", f.display());
            }
        }
    }
}

#[test]
fn every_capture_record_kind_is_in_the_spec() {
    use crate::capture::format::*;
    let kinds = [
        KIND_KERNEL,
        KIND_PROC,
        KIND_LOST,
        KIND_END,
        KIND_DROP_SETUP,
        KIND_KERNEL_SYMBOL,
        KIND_DROP_COUNTS,
        KIND_CONNTRACK,
        KIND_LOCK_SEED,
        KIND_IPVS_COUNTS,
        KIND_POD,
        KIND_REFUSAL_COUNTS,
        KIND_RULE_TABLE,
        KIND_ADDR,
        KIND_CT_ENTRIES,
        KIND_ENDPOINT_ANSWERS,
        KIND_IPVS_TABLE,
        KIND_RULE_COUNTERS,
        KIND_KERNEL_SPARSE,
    ];
    let spec = read("docs/capture-format.md");
    // The records table: `| kind | name | body |`, then a row per kind.
    let table: BTreeSet<u8> = spec
        .lines()
        .skip_while(|l| !l.starts_with("| kind | name"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            l.trim_start_matches('|')
                .split('|')
                .next()?
                .trim()
                .parse()
                .ok()
        })
        .collect();
    let code: BTreeSet<u8> = kinds.into_iter().collect();
    assert_eq!(
        table, code,
        "docs/capture-format.md's record table against capture/format.rs's kinds"
    );
    // The kinds from the rule tables on have a section each (the older ones are described
    // together, in the table's rows and the paragraphs after it).
    for k in KIND_RULE_TABLE..=KIND_RULE_COUNTERS {
        assert!(
            spec.contains(&format!("### Kind {k}:")),
            "docs/capture-format.md has no section `### Kind {k}:`"
        );
    }
}

/// The JSON types of `Output`, from its definition: a variant `HoldDrops(...)` is
/// `hold_drops`.
fn fact_types() -> BTreeSet<String> {
    let src = read("xtlock/src/analysis/facts.rs");
    let body = src
        .split("pub enum Output {")
        .nth(1)
        .and_then(|b| b.split("\n}").next())
        .expect("enum Output in facts.rs");
    body.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && !l.starts_with('#'))
        .filter_map(|l| l.split_once('(').map(|(v, _)| v))
        .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
        .map(|v| {
            let mut s = String::new();
            for (i, c) in v.chars().enumerate() {
                if c.is_ascii_uppercase() && i > 0 {
                    s.push('_');
                }
                s.push(c.to_ascii_lowercase());
            }
            s
        })
        .collect()
}

#[test]
fn every_fact_type_is_in_docs_json() {
    let types = fact_types();
    assert!(types.len() >= 25, "{types:?}");
    let doc = read("docs/json.md");
    let documented: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("### `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect();
    let missing: Vec<&String> = types.difference(&documented).collect();
    let extra: Vec<&String> = documented.difference(&types).collect();
    assert!(
        missing.is_empty(),
        "fact types with no section in docs/json.md: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "docs/json.md sections of no fact type: {extra:?}"
    );
    assert!(
        doc.contains("\n## summary"),
        "docs/json.md has no summary section"
    );
}

/// The `xtlock ...` command lines of the docs' code blocks, as a shell would split them (up
/// to a pipe, a redirection or a comment), with the file and line they are on.
fn command_lines() -> Vec<(String, usize, Vec<String>)> {
    let mut out = Vec::new();
    for f in doc_files() {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let mut in_code = false;
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                in_code = !in_code;
                continue;
            }
            if !in_code {
                continue;
            }
            let l = line
                .trim()
                .trim_start_matches("$ ")
                .trim_start_matches("sudo ");
            let Some(rest) = ["xtlock ", "./xtlock ", "/xtlock ", "/usr/bin/xtlock "]
                .iter()
                .find_map(|p| l.strip_prefix(p))
            else {
                continue;
            };
            // The command itself: up to a pipe, redirection, `&&` or comment.
            let cut = rest
                .find(['|', '>', '<', '#', '&', ';'])
                .unwrap_or(rest.len());
            let Some(words) = shlex::split(&rest[..cut]) else {
                continue;
            };
            let mut argv = vec!["xtlock".to_string()];
            argv.extend(words);
            out.push((f.display().to_string(), n + 1, argv));
        }
    }
    out
}

#[test]
fn every_documented_command_line_parses() {
    let lines = command_lines();
    assert!(
        lines.len() >= 10,
        "found only {} command lines",
        lines.len()
    );
    let mut bad = Vec::new();
    for (file, line, argv) in &lines {
        // A line ending in `...` elides its arguments: the part given must parse.
        let argv: Vec<&String> = argv.iter().filter(|a| *a != "..." && *a != "…").collect();
        if let Err(e) = crate::cli::Cli::try_parse_from(argv.iter().map(|s| s.as_str())) {
            use clap::error::ErrorKind;
            if !matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                bad.push(format!(
                    "{file}:{line}: {}: {}",
                    argv.iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(" "),
                    e.kind()
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "command lines that do not parse:\n{}",
        bad.join("\n")
    );
}
