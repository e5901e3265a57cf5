//! The manifest and the alert rules checked by the tools people run on them: kubernetes-validate
//! (the Kubernetes OpenAPI schema, strict, for the oldest and newest Kubernetes version it
//! ships), checkov (policy: no failed check; every skip must be explained in
//! deploy/README.md), promtool (rule syntax and `promtool test rules`).
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, ensure, Context as _, Result};
use serde_json::Value;

use super::manifest;
use crate::{setup, sh};

pub fn run(root: &Path) -> Result<String> {
    let deploy = root.join("deploy");
    let daemonset = deploy.join("daemonset.yaml");
    let tools = setup::deploy_tools_dir().join("bin");

    let versions = schema_versions(&setup::deploy_tools_dir())?;
    let (oldest, newest) = (
        versions.first().context("no schema versions")?,
        versions.last().context("no schema versions")?,
    );
    for v in [oldest, newest] {
        sh::run(
            Command::new(tools.join("kubernetes-validate"))
                .args(["--strict", "--kubernetes-version", v])
                .arg(&daemonset),
        )
        .with_context(|| format!("deploy/daemonset.yaml against Kubernetes {v}'s schema"))?;
    }

    let (failed, skipped) = checkov(&tools.join("checkov"), &daemonset)?;
    ensure!(
        failed.is_empty(),
        "checkov: {} failed check(s) in deploy/daemonset.yaml:\n  {}\nfix them, or skip \
         them with a `checkov.io/skipN` annotation and explain why in deploy/README.md",
        failed.len(),
        failed.join("\n  ")
    );
    let readme = fs::read_to_string(deploy.join("README.md")).context("deploy/README.md")?;
    let unexplained: Vec<&String> = skipped
        .iter()
        .filter(|id| !readme.contains(id.as_str()))
        .collect();
    ensure!(
        unexplained.is_empty(),
        "checkov checks skipped in deploy/daemonset.yaml but not explained in deploy/README.md: {unexplained:?}"
    );

    let alerts = deploy.join("alerts.yaml");
    let recording = deploy.join("recording-rules.yaml");
    sh::run(
        Command::new("promtool")
            .args(["check", "rules"])
            .arg(&alerts)
            .arg(&recording),
    )?;
    sh::run(Command::new("promtool").current_dir(&deploy).args([
        "test",
        "rules",
        "alerts.test.yaml",
        "recording-rules.test.yaml",
    ]))?;
    every_rule_tested(&recording, &deploy.join("recording-rules.test.yaml"))?;
    same_groups(&[&alerts, &recording], &deploy.join("prometheusrule.yaml"))?;
    let names = alert_metrics(root, &alerts)?;
    Ok(format!(
        "manifest valid for Kubernetes {oldest} and {newest}, checkov: 0 failed, {} skipped \
         (explained), alert rules tested ({names} xtlock metrics, all documented and registered)",
        skipped.len()
    ))
}

/// The Kubernetes versions whose schemas kubernetes-validate ships, oldest first.
fn schema_versions(venv: &Path) -> Result<Vec<String>> {
    let lib = venv.join("lib");
    let py = fs::read_dir(&lib)
        .with_context(|| format!("{} (./xtask/run setup installs the tools)", lib.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("python"))
        })
        .context("no python dir in the venv")?;
    let dir: PathBuf = py.join("site-packages/kubernetes_validate/kubernetes-json-schema");
    let mut v: Vec<(Vec<u32>, String)> = fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let ver = n.strip_prefix('v')?.strip_suffix("-local")?.to_owned();
            let key = ver.split('.').map(|x| x.parse().unwrap_or(0)).collect();
            Some((key, ver))
        })
        .collect();
    v.sort();
    Ok(v.into_iter().map(|x| x.1).collect())
}

/// checkov on the manifest: (failed "ID name", skipped IDs).
fn checkov(checkov: &Path, file: &Path) -> Result<(Vec<String>, Vec<String>)> {
    let mut cmd = Command::new(checkov);
    cmd.arg("-f")
        .arg(file)
        // No network: no calls home for guidelines or newer checks.
        .args([
            "--framework",
            "kubernetes",
            "--skip-download",
            "--output",
            "json",
        ]);
    println!("+ {}", sh::show(&cmd));
    let out = cmd.output().context("running checkov")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("checkov printed no JSON (status {}): {text}", out.status))?;
    let results = &v["results"];
    let ids = |k: &str| -> Vec<String> {
        results[k]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        format!(
                            "{} {}",
                            c["check_id"].as_str().unwrap_or("?"),
                            c["check_name"].as_str().unwrap_or("")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let failed = ids("failed_checks");
    let skipped: Vec<String> = ids("skipped_checks")
        .into_iter()
        .filter_map(|s| s.split_whitespace().next().map(str::to_owned))
        .collect();
    let passed = results["passed_checks"].as_array().map_or(0, Vec::len);
    println!(
        "checkov: {passed} passed, {} failed, {} skipped ({})",
        failed.len(),
        skipped.len(),
        skipped.join(", ")
    );
    if passed == 0 && failed.is_empty() {
        bail!("checkov checked nothing: {text}");
    }
    Ok((failed, skipped))
}

/// The PrometheusRule's `spec.groups` are exactly the rule files' `groups`, in order.
fn same_groups(files: &[&Path], rule: &Path) -> Result<()> {
    let mut groups = Vec::new();
    for f in files {
        let docs = manifest::documents(&fs::read_to_string(f)?)?;
        let g = docs
            .first()
            .and_then(|d| d["groups"].as_array())
            .with_context(|| format!("{}: no groups", f.display()))?;
        groups.extend(g.iter().cloned());
    }
    let r = manifest::documents(&fs::read_to_string(rule)?)?;
    let pr = r
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .context("no PrometheusRule in prometheusrule.yaml")?;
    ensure!(
        pr["spec"]["groups"] == Value::Array(groups),
        "deploy/prometheusrule.yaml's spec.groups differ from the groups of {}: copy them over",
        files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    Ok(())
}

/// Every recording rule is the `expr` of at least one `promql_expr_test` (an untested rule
/// would pass `promtool test rules` unnoticed).
fn every_rule_tested(rules: &Path, tests: &Path) -> Result<()> {
    let r = manifest::documents(&fs::read_to_string(rules)?)?;
    let t = manifest::documents(&fs::read_to_string(tests)?)?;
    let tested: std::collections::BTreeSet<&str> = t
        .first()
        .and_then(|d| d["tests"].as_array())
        .into_iter()
        .flatten()
        .filter_map(|test| test["promql_expr_test"].as_array())
        .flatten()
        .filter_map(|e| e["expr"].as_str())
        .map(str::trim)
        .collect();
    let untested: Vec<&str> = r
        .first()
        .and_then(|d| d["groups"].as_array())
        .into_iter()
        .flatten()
        .filter_map(|g| g["rules"].as_array())
        .flatten()
        .filter_map(|rule| rule["record"].as_str())
        .filter(|name| !tested.contains(name))
        .collect();
    ensure!(
        untested.is_empty(),
        "recording rules without a promql_expr_test in {}: {}",
        tests.display(),
        untested.join(", ")
    );
    Ok(())
}

/// Every `xtlock_*` metric the alerts query is documented in docs/metrics.md and registered in
/// xtlock/src/sinks/metrics.rs (a renamed metric would leave an alert silently empty).
fn alert_metrics(root: &Path, alerts: &Path) -> Result<usize> {
    let text = fs::read_to_string(alerts)?;
    let names = metric_names(&text);
    ensure!(
        !names.is_empty(),
        "no xtlock_ metric in {}",
        alerts.display()
    );
    let bad = unknown_metrics(root, &names)?;
    ensure!(bad.is_empty(), "deploy/alerts.yaml: {}", bad.join("; "));
    Ok(names.len())
}

/// Of `names` (series names: `_bucket`, `_sum`, `_count` of histograms too), those not in
/// docs/metrics.md's table or not registered in xtlock/src/sinks/metrics.rs, each with why.
pub(super) fn unknown_metrics(
    root: &Path,
    names: &std::collections::BTreeSet<String>,
) -> Result<Vec<String>> {
    let docs = fs::read_to_string(root.join("docs/metrics.md")).context("docs/metrics.md")?;
    let src = fs::read_to_string(root.join("xtlock/src/sinks/metrics.rs"))
        .context("xtlock/src/sinks/metrics.rs")?;
    let mut bad = Vec::new();
    for n in names {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| n.strip_suffix(s))
            .unwrap_or(n);
        if !docs.contains(&format!("| `{family}` |")) {
            bad.push(format!("{n}: not in docs/metrics.md's table"));
        }
        // prometheus-client adds the prefix, `_total` to counters and the unit.
        let stem = family.trim_start_matches("xtlock_");
        let stem = stem.strip_suffix("_total").unwrap_or(stem);
        let stem = stem.strip_suffix("_seconds").unwrap_or(stem);
        let registered = src.contains(&format!("\"{stem}\""))
            || stem
                .strip_prefix("conntrack_")
                .is_some_and(|rest| src.contains(&format!("\"{rest}\"")));
        if !registered {
            bad.push(format!(
                "{n}: no metric \"{stem}\" registered in metrics.rs"
            ));
        }
    }
    Ok(bad)
}

/// The distinct `xtlock_...` names in `text`.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("xtlock_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // Not a metric: part of a longer word (xtlock_recording_errors_total in prose is one).
        let before = rest[..i].chars().last();
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alerts_query_documented_registered_metrics() {
        let root = crate::sh::workspace_root();
        let n = alert_metrics(&root, &root.join("deploy/alerts.yaml")).expect("all known");
        assert!(n >= 8, "{n}");
        let names = metric_names("rate(xtlock_a_total[5m]) / xtlock_b_seconds_bucket{le=\"1\"}");
        assert_eq!(
            names.into_iter().collect::<Vec<_>>(),
            ["xtlock_a_total", "xtlock_b_seconds_bucket"]
        );
        let dir = std::env::temp_dir().join(format!("xtlock-alerts-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("tmp");
        let f = dir.join("a.yaml");
        fs::write(&f, "expr: xtlock_no_such_metric_total > 0\n").expect("write");
        let e = alert_metrics(&root, &f).expect_err("unknown metric");
        assert!(
            format!("{e:#}").contains("xtlock_no_such_metric_total"),
            "{e:#}"
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
