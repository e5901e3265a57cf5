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
    sh::run(
        Command::new("promtool")
            .args(["check", "rules"])
            .arg(&alerts),
    )?;
    sh::run(Command::new("promtool").current_dir(&deploy).args([
        "test",
        "rules",
        "alerts.test.yaml",
    ]))?;
    same_groups(&alerts, &deploy.join("prometheusrule.yaml"))?;
    Ok(format!(
        "manifest valid for Kubernetes {oldest} and {newest}, checkov: 0 failed, {} skipped \
         (explained), alert rules tested",
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
            "--quiet",
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

/// The PrometheusRule's `spec.groups` are exactly alerts.yaml's `groups`.
fn same_groups(alerts: &Path, rule: &Path) -> Result<()> {
    let a = manifest::documents(&fs::read_to_string(alerts)?)?;
    let r = manifest::documents(&fs::read_to_string(rule)?)?;
    let groups = &a.first().context("alerts.yaml is empty")?["groups"];
    let pr = r
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .context("no PrometheusRule in prometheusrule.yaml")?;
    ensure!(
        groups.is_array() && &pr["spec"]["groups"] == groups,
        "deploy/prometheusrule.yaml's spec.groups differ from deploy/alerts.yaml's groups: \
         copy them over"
    );
    Ok(())
}
