//! Every PromQL expression xtlock ships (the alert and recording rules of deploy/, the Grafana
//! dashboards of deploy/grafana/) parsed by a PromQL parser, and every series it reads either
//! exposed by the daemon (read from its own `/metrics`, so a renamed metric fails here rather
//! than leaving a panel saying "No data") or made by a recording rule.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use anyhow::{bail, ensure, Context as _, Result};
use promql_parser::parser::{self, Expr};
use serde_json::Value;

use super::manifest;

/// Rule files whose expressions are checked, in deploy/.
pub const RULE_FILES: [&str; 2] = ["alerts.yaml", "recording-rules.yaml"];

/// Series that come from elsewhere than xtlock, and from where.
const EXTERNAL: &[(&str, &str)] = &[(
    "kube_pod_container_status_ready",
    "kube-state-metrics, read by XtlockNotReady",
)];

/// One expression and where it is (file, and rule or panel).
#[derive(Debug)]
pub struct Expression {
    pub whence: String,
    pub expr: String,
}

/// Every expression of the rule files and the dashboards under `deploy`.
pub fn expressions(deploy: &Path) -> Result<Vec<Expression>> {
    let mut out = Vec::new();
    for f in RULE_FILES {
        let text = fs::read_to_string(deploy.join(f)).with_context(|| format!("deploy/{f}"))?;
        for doc in manifest::documents(&text)? {
            for g in doc["groups"].as_array().into_iter().flatten() {
                for r in g["rules"].as_array().into_iter().flatten() {
                    let name = r["record"].as_str().or(r["alert"].as_str()).unwrap_or("?");
                    let expr = r["expr"]
                        .as_str()
                        .with_context(|| format!("deploy/{f}: rule {name} has no expr"))?;
                    out.push(Expression {
                        whence: format!("deploy/{f}: {name}"),
                        expr: expr.to_owned(),
                    });
                }
            }
        }
    }
    for path in dashboards(deploy)? {
        let text = fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let file = path
            .strip_prefix(deploy.parent().unwrap_or(deploy))
            .unwrap_or(&path)
            .display()
            .to_string();
        dashboard_exprs(&file, &v, &mut out);
    }
    Ok(out)
}

/// deploy/grafana/*.json, sorted.
pub fn dashboards(deploy: &Path) -> Result<Vec<std::path::PathBuf>> {
    let dir = deploy.join("grafana");
    let mut v: Vec<_> = fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    v.sort();
    Ok(v)
}

/// The panels' targets (rows' nested panels too) and the query variables of a dashboard.
fn dashboard_exprs(file: &str, v: &Value, out: &mut Vec<Expression>) {
    fn panels(file: &str, list: &Value, out: &mut Vec<Expression>) {
        for p in list.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?");
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push(Expression {
                        whence: format!("{file}: panel \"{title}\" {}", t["refId"]),
                        expr: grafana_to_promql(e),
                    });
                }
            }
            panels(file, &p["panels"], out);
        }
    }
    panels(file, &v["panels"], out);
    for var in v["templating"]["list"].as_array().into_iter().flatten() {
        if var["type"] != "query" {
            continue;
        }
        let q = var["query"]["query"].as_str().or(var["query"].as_str());
        // label_values(SELECTOR, label) and query_result(QUERY) hold PromQL; label_values(label)
        // reads every series and names none.
        let inner = q.and_then(|q| {
            let q = q.trim();
            if let Some(rest) = q.strip_prefix("label_values(") {
                rest.rsplit_once(',').map(|(sel, _)| sel.to_owned())
            } else {
                q.strip_prefix("query_result(")
                    .and_then(|r| r.strip_suffix(')'))
                    .map(str::to_owned)
            }
        });
        if let Some(e) = inner {
            out.push(Expression {
                whence: format!("{file}: variable {}", var["name"]),
                expr: grafana_to_promql(&e),
            });
        }
    }
}

/// Grafana's variables replaced by values PromQL parses: durations for the interval macros,
/// a plain word for the rest (they stand in label values).
pub fn grafana_to_promql(s: &str) -> String {
    let mut s = s.to_owned();
    for (var, dur) in [
        ("${__rate_interval}", "5m"),
        ("$__rate_interval", "5m"),
        ("${__interval}", "1m"),
        ("$__interval", "1m"),
        ("${__range}", "1h"),
        ("$__range", "1h"),
    ] {
        s = s.replace(var, dur);
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s.as_str();
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 1..];
        let skip = if let Some(braced) = tail.strip_prefix('{') {
            braced.find('}').map_or(0, |e| e + 2)
        } else {
            tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len())
        };
        out.push('x');
        rest = &tail[skip..];
    }
    out.push_str(rest);
    out
}

/// The series names an expression reads; an error when it does not parse or a selector names
/// no metric.
pub fn selectors(expr: &str) -> Result<BTreeSet<String>> {
    let ast = parser::parse(expr).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut names = BTreeSet::new();
    let mut stack = vec![&ast];
    while let Some(e) = stack.pop() {
        match e {
            Expr::Aggregate(a) => {
                stack.push(&a.expr);
                stack.extend(a.param.as_deref());
            }
            Expr::Unary(u) => stack.push(&u.expr),
            Expr::Binary(b) => {
                stack.push(&b.lhs);
                stack.push(&b.rhs);
            }
            Expr::Paren(p) => stack.push(&p.expr),
            Expr::Subquery(s) => stack.push(&s.expr),
            Expr::Call(c) => stack.extend(c.args.args.iter().map(|a| &**a)),
            Expr::VectorSelector(vs) => {
                names.insert(selector_name(vs)?);
            }
            Expr::MatrixSelector(m) => {
                names.insert(selector_name(&m.vs)?);
            }
            Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
        }
    }
    Ok(names)
}

fn selector_name(vs: &parser::VectorSelector) -> Result<String> {
    if let Some(n) = &vs.name {
        return Ok(n.clone());
    }
    // {__name__="x"} is a name too; a regex over names is not checked, so it is refused.
    match vs.matchers.matchers.iter().find(|m| m.name == "__name__") {
        Some(m) if matches!(m.op, promql_parser::label::MatchOp::Equal) => Ok(m.value.clone()),
        _ => bail!("a selector without a metric name: {vs}"),
    }
}

/// The series names the exposition (Prometheus text format) describes: every family's
/// `# TYPE`, with `_bucket`, `_sum` and `_count` for histograms. Families without a series
/// yet (no nf_tables commit so far) are described too.
pub fn exposed(exposition: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in exposition.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut w = rest.split_whitespace();
        let (Some(name), Some(kind)) = (w.next(), w.next()) else {
            continue;
        };
        match kind {
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{s}"));
                }
            }
            "summary" => {
                for s in ["", "_sum", "_count"] {
                    out.insert(format!("{name}{s}"));
                }
            }
            _ => {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

/// The names the recording rules define.
pub fn recorded(deploy: &Path) -> Result<BTreeSet<String>> {
    let text = fs::read_to_string(deploy.join("recording-rules.yaml"))
        .context("deploy/recording-rules.yaml")?;
    let mut out = BTreeSet::new();
    for doc in manifest::documents(&text)? {
        for g in doc["groups"].as_array().into_iter().flatten() {
            for r in g["rules"].as_array().into_iter().flatten() {
                if let Some(n) = r["record"].as_str() {
                    out.insert(n.to_owned());
                }
            }
        }
    }
    Ok(out)
}

/// Families the deploy test's daemon cannot be made to describe (prometheus-client leaves a
/// family without series out of /metrics), and why. Those alone may be read without being in
/// the exposition, and then only when docs/metrics.md and metrics.rs have them.
pub const NOT_MADE_HERE: &[(&str, &str)] = &[
    (
        "xtlock_sync_stalled",
        "needs an agent's syncs to stall for twice its usual period",
    ),
    (
        "xtlock_lock_failed_attempts_total",
        "iptables-legacy -w blocks in flock() here rather than polling with LOCK_NB",
    ),
    (
        "xtlock_nft_changes_total",
        "needs the nft_commit hook, which not every kernel offers",
    ),
    (
        "xtlock_conntrack_drop_total",
        "moves only when the conntrack table is full",
    ),
    (
        "xtlock_conntrack_insert_failed_total",
        "moves only when conntrack inserts race",
    ),
    (
        "xtlock_refusals_during_holds_total",
        "moves only when the node refuses connections during a hold (tests/tests/refusals.rs)",
    ),
    (
        "xtlock_rule_drop_packets_total",
        "moves only when a DROP or REJECT rule drops packets (tests/tests/rule_drops.rs)",
    ),
    (
        "xtlock_rule_drop_bytes_total",
        "moves only when a DROP or REJECT rule drops packets (tests/tests/rule_drops.rs)",
    ),
    (
        "xtlock_unserialized_writes_total",
        "needs two agents writing one netns's legacy tables under different lock files \
         (tests/tests/lock_trace.rs)",
    ),
    (
        "xtlock_ipvs_drained_seconds_bucket",
        "needs IPVS (kube-proxy's ipvs mode) and a real server set to weight 0, then removed \
         (tests/tests/ipvs.rs, in the VM)",
    ),
];

/// Every expression parses and reads only series that `expositions` (the daemon's /metrics,
/// scraped at several moments of the run) describe, the recording rules define, or
/// [`EXTERNAL`] and [`NOT_MADE_HERE`] name; every recording rule is read by a dashboard or a
/// rule. A one-line summary.
pub fn check(root: &Path, expositions: &[String]) -> Result<String> {
    let deploy = root.join("deploy");
    let exposed: BTreeSet<String> = expositions.iter().flat_map(|e| exposed(e)).collect();
    ensure!(
        exposed.iter().any(|n| n.starts_with("xtlock_")),
        "the exposition describes no xtlock_ metric"
    );
    let recorded = recorded(&deploy)?;
    let exprs = expressions(&deploy)?;
    let mut bad = Vec::new();
    let mut read: BTreeMap<String, usize> = BTreeMap::new();
    let mut fallback = BTreeSet::new();
    for e in &exprs {
        match selectors(&e.expr) {
            Err(err) => bad.push(format!("{}: does not parse: {err:#}: {}", e.whence, e.expr)),
            Ok(names) => {
                for n in names {
                    *read.entry(n.clone()).or_default() += 1;
                    if exposed.contains(&n)
                        || recorded.contains(&n)
                        || EXTERNAL.iter().any(|(x, _)| *x == n)
                    {
                        continue;
                    }
                    if NOT_MADE_HERE.iter().any(|(x, _)| *x == n) {
                        fallback.insert(n);
                        continue;
                    }
                    bad.push(format!(
                        "{}: reads {n}, which the daemon does not expose and no recording \
                         rule defines",
                        e.whence
                    ));
                }
            }
        }
    }
    bad.extend(super::lint::unknown_metrics(root, &fallback)?);
    for r in &recorded {
        if !read.contains_key(r) {
            bad.push(format!(
                "recording rule {r} is read by no dashboard and no rule"
            ));
        }
    }
    ensure!(
        bad.is_empty(),
        "PromQL of deploy/ ({} problem(s)):\n  {}",
        bad.len(),
        bad.join("\n  ")
    );
    let daemon = read.keys().filter(|n| exposed.contains(*n)).count();
    Ok(format!(
        "{} PromQL expressions parsed, reading {daemon} series the daemon's /metrics described, \
         {} recording rules, and {} families this run did not make (documented and \
         registered: {})",
        exprs.len(),
        recorded.len(),
        fallback.len(),
        fallback.into_iter().collect::<Vec<_>>().join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_expression_of_deploy_parses() {
        let deploy = crate::sh::workspace_root().join("deploy");
        let exprs = expressions(&deploy).expect("expressions");
        assert!(exprs.len() > 40, "{}", exprs.len());
        for e in &exprs {
            selectors(&e.expr).unwrap_or_else(|err| panic!("{}: {err:#}: {}", e.whence, e.expr));
        }
        let whence: Vec<&str> = exprs.iter().map(|e| e.whence.as_str()).collect();
        for d in ["grafana/xtlock-fleet.json", "grafana/xtlock-node.json"] {
            assert!(whence.iter().any(|w| w.contains(d)), "{d}: {whence:?}");
        }
    }

    /// The dashboards link to each other by uid (`/d/UID/...`): every link names a dashboard
    /// of deploy/grafana, and every panel queries the `datasource` variable.
    #[test]
    fn dashboard_links_and_datasources_resolve() {
        let deploy = crate::sh::workspace_root().join("deploy");
        let dashboards: Vec<Value> = dashboards(&deploy)
            .expect("deploy/grafana")
            .iter()
            .map(|p| serde_json::from_str(&fs::read_to_string(p).expect("read")).expect("JSON"))
            .collect();
        let uids: BTreeSet<&str> = dashboards
            .iter()
            .filter_map(|d| d["uid"].as_str())
            .collect();
        assert_eq!(
            uids.len(),
            dashboards.len(),
            "each dashboard has its own uid"
        );
        for d in &dashboards {
            let text = d.to_string();
            for part in text.split("/d/").skip(1) {
                let uid = part.split('/').next().unwrap_or_default();
                assert!(
                    uids.contains(uid),
                    "{}: link to unknown uid {uid}",
                    d["uid"]
                );
            }
            for p in d["panels"].as_array().expect("panels") {
                if p["type"] != "row" {
                    assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
                }
            }
        }
    }

    #[test]
    fn names_come_from_the_exposition_and_the_rules() {
        let e =
            "sum by (node) (rate(xtlock_lock_hold_seconds_sum{node=\"$node\"}[$__rate_interval])) \
                 / on (node) node_agent:xtlock_syncs:rate5m or {__name__=\"up\"}";
        let n: Vec<String> = selectors(&grafana_to_promql(e))
            .expect("parses")
            .into_iter()
            .collect();
        assert_eq!(
            n,
            [
                "node_agent:xtlock_syncs:rate5m",
                "up",
                "xtlock_lock_hold_seconds_sum"
            ]
        );
        assert_eq!(
            grafana_to_promql("x{node=~\"${node:regex}\",a=\"$agent\"}[$__range]"),
            "x{node=~\"x\",a=\"x\"}[1h]"
        );
        assert!(selectors("rate(x[5m]").is_err());
        assert!(selectors("{job=\"a\"}").is_err());
        let text = "# HELP xtlock_lock_hold_seconds h\n# TYPE xtlock_lock_hold_seconds histogram\n\
                    # TYPE xtlock_syncs_total counter\n# TYPE xtlock_lock_held gauge\n\
                    xtlock_lock_held{lock=\"/run/xtables.lock\"} 0\n";
        let x = exposed(text);
        for s in [
            "xtlock_lock_hold_seconds_bucket",
            "xtlock_lock_hold_seconds_count",
            "xtlock_syncs_total",
            "xtlock_lock_held",
        ] {
            assert!(x.contains(s), "{s}: {x:?}");
        }
        // The shipped files against a daemon whose metrics were renamed: the check fails and
        // names what is missing.
        let root = crate::sh::workspace_root();
        let err = check(&root, &[text.to_owned()]).expect_err("most series are missing");
        let msg = format!("{err:#}");
        assert!(msg.contains("xtlock_drops_total"), "{msg}");
        assert!(msg.contains("grafana/xtlock-node.json"), "{msg}");
    }
}
