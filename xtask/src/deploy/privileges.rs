//! Least privilege, shown: one run with everything the manifest grants (the baseline), then
//! one without each capability, host namespace, hostPath mount and root. Each run is the same
//! small scenario, with what a node has that needs the privileges:
//!
//! - a kube-proxy restore already holding the lock when the daemon starts (its holder is
//!   found through /proc/locks and the host's /proc), and calico-node's `iptables -w` waiting
//!   behind it once the daemon is ready;
//! - UDP datagrams dropped by calico-node's rule (counted, and located through
//!   /proc/kallsyms);
//! - a network namespace whose only process belongs to another user (uid 65534), as a pod's;
//! - the rolling capture file.
//!
//! A run without a privilege must either fail with a message, or lose something the baseline
//! had (a hook, the holder's name, counted or located drops, the capture, or a new warning);
//! a privilege whose removal loses nothing fails the test: remove it from the manifest.
use std::{
    collections::BTreeSet,
    fmt::Write as _,
    fs,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use super::{
    calico_adds_drop_rule, lock_inode, manifest::PodRun, manifest::Without, node_drop_rule,
    record_dir, rule_packets, send_udp, until_lock, CaptureGuard, Node, Restore, DROP_PORT,
};

/// Datagrams dropped per run.
const SENT: u64 = 50;

/// What one run showed.
#[derive(Debug, Default)]
struct Observed {
    /// The container exited, or never became ready: why, in its own words.
    failure: Option<String>,
    hooks: BTreeSet<String>,
    /// holder_agent of calico-node's wait.
    holder: Option<String>,
    /// namespace/pod of calico-node's wait (from the kubelet's log directories).
    pod: Option<String>,
    /// Processes whose network namespace the daemon could not open (its warning).
    netns_denied: u64,
    /// The daemon had to mount tracefs itself (its log says so).
    mounted_tracefs: bool,
    drops: f64,
    location: Option<String>,
    capture: bool,
    /// WARN and ERROR messages of the run.
    warnings: BTreeSet<String>,
    /// Features off for want of a privilege (`xtlock_feature_enabled{cause="privilege"}`).
    features_off: BTreeSet<String>,
}

impl Observed {
    /// What the baseline had and this run did not.
    fn lost(&self, base: &Observed) -> Vec<String> {
        let mut v = Vec::new();
        let hooks: Vec<&String> = base.hooks.difference(&self.hooks).collect();
        if !hooks.is_empty() {
            v.push(format!(
                "hooks not attached: {}",
                hooks
                    .iter()
                    .map(|h| h.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if self.holder != base.holder {
            v.push(format!(
                "the wait's holder is {} instead of {} (a hold in place at start is not \
                 attributed)",
                self.holder.as_deref().unwrap_or("missing"),
                base.holder.as_deref().unwrap_or("missing")
            ));
        }
        if self.pod != base.pod {
            v.push(format!(
                "pod names: the wait's pod is {} instead of {}",
                self.pod.as_deref().unwrap_or("missing"),
                base.pod.as_deref().unwrap_or("missing")
            ));
        }
        if self.netns_denied > base.netns_denied {
            v.push(format!(
                "conntrack counters of other users' network namespaces: {} more processes' \
                 namespaces could not be opened",
                self.netns_denied - base.netns_denied
            ));
        }
        if self.mounted_tracefs && !base.mounted_tracefs {
            v.push(
                "tracefs: the daemon had to mount it itself, with mount(), which needs \
                 CAP_SYS_ADMIN and an LSM profile that allows it (AppArmor's runtime/default, \
                 on Ubuntu and COS nodes, does not)"
                    .into(),
            );
        }
        if self.drops != base.drops {
            v.push(format!(
                "{} drops counted instead of {}",
                self.drops, base.drops
            ));
        }
        if self.location != base.location {
            v.push(format!(
                "drop location {} instead of {}",
                self.location.as_deref().unwrap_or("missing"),
                base.location.as_deref().unwrap_or("missing")
            ));
        }
        let off: Vec<&str> = self
            .features_off
            .difference(&base.features_off)
            .map(String::as_str)
            .collect();
        if !off.is_empty() {
            v.push(format!("features off: {}", off.join(", ")));
        }
        if base.capture && !self.capture {
            v.push("no complete capture file".into());
        }
        for w in self.warnings.difference(&base.warnings) {
            v.push(format!("warns: {w}"));
        }
        v
    }
}

/// A network namespace held only by a process of uid 65534, as a pod's; killed on drop.
struct OtherUsersNetns(Child);

impl OtherUsersNetns {
    fn start() -> Result<Self> {
        let child = Command::new("unshare")
            .args([
                "--net",
                "--",
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "sleep",
                "600",
            ])
            .stdin(Stdio::null())
            .spawn()
            .context("unshare/setpriv (util-linux)")?;
        Ok(OtherUsersNetns(child))
    }
}

impl Drop for OtherUsersNetns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The message of a log line: JSON (`fields.message` and `fields.error`) or plain text.
fn message(line: &str) -> Option<(String, String)> {
    match serde_json::from_str::<Value>(line) {
        Ok(v) => {
            let level = v["level"].as_str().unwrap_or("").to_owned();
            let f = &v["fields"];
            let mut m = f["message"].as_str().unwrap_or("").to_owned();
            if let Some(e) = f["error"].as_str() {
                let _ = write!(m, " ({e})");
            }
            Some((level, m))
        }
        Err(_) => {
            let t = line.trim();
            (!t.is_empty()).then(|| ("ERROR".to_owned(), t.to_owned()))
        }
    }
}

/// Digits out, so the same warning compares equal across runs (pids, counts, times).
fn shape(s: &str) -> String {
    let mut out = String::new();
    let mut digits = false;
    for c in s.chars() {
        if c.is_ascii_digit() {
            if !digits {
                out.push('N');
            }
            digits = true;
        } else {
            digits = false;
            out.push(c);
        }
    }
    out
}

fn one(node: &Node, pod: &PodRun, without: Option<&Without>) -> Result<Observed> {
    let name = "xtlock-privileges";
    let record = record_dir(pod)?;
    let guard = CaptureGuard::new(&record);
    let ino = lock_inode()?;
    let restore = Restore::start(node)?;
    until_lock(ino, false, "kube-proxy's restore to hold the lock")?;
    let mut obs = Observed::default();
    node.run_container(name, pod, without)?;
    let ready = node.wait_ready(name, pod, Duration::from_secs(20));
    let failure = match ready {
        Ok(true) => None,
        Ok(false) => Some("exited".to_owned()),
        Err(e) => Some(format!("never ready ({})", short(&format!("{e:#}")))),
    };
    if let Some(f) = failure {
        // The restore may have given up already; its result does not matter here.
        let _ = restore.commit();
        let logs = node.logs(name);
        let last = logs
            .lines()
            .filter_map(message)
            .rfind(|(level, _)| level == "ERROR" || level == "WARN")
            .map(|(_, m)| m)
            .unwrap_or_else(|| "no log".into());
        obs.failure = Some(format!("{f}: {last}"));
        let _ = node.engine.output(&["rm", "-f", "-t", "0", name]);
        return Ok(obs);
    }
    let mut calico = calico_adds_drop_rule(node)?;
    until_lock(ino, true, "calico-node to wait")?;
    // A wait of a second or so, as in the main run: the daemon names a process's pod from its
    // /proc entry when it handles its events, which a waiter gone within milliseconds may
    // not have any more.
    std::thread::sleep(Duration::from_millis(1200));
    restore.commit()?;
    calico.wait()?;
    send_udp(node, SENT)?;
    let counted = rule_packets(&format!("dpt:{DROP_PORT}"))?;
    let deadline = Instant::now() + Duration::from_secs(4);
    let m = loop {
        let m = node.scrape(pod)?;
        let waited = !m.series("xtlock_lock_wait_seconds_count").is_empty();
        let dropped = m.sum("xtlock_drops_total", &[]) >= counted as f64;
        if (waited && dropped) || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    obs.hooks =
        m.0.iter()
            .filter(|(n, _, v)| n == "xtlock_probe_attached" && *v == 1.0)
            .filter_map(|(_, l, _)| l.get("program").cloned())
            .collect();
    obs.holder =
        m.0.iter()
            .find(|(n, l, _)| {
                n == "xtlock_lock_wait_seconds_count"
                    && l.get("agent").map(String::as_str) == Some("calico-node")
            })
            .and_then(|(_, l, _)| l.get("holder_agent").cloned());
    // Any of calico-node's wait series that names the pod (a wait counted behind `(none)`
    // first may have none).
    obs.pod =
        m.0.iter()
            .filter(|(n, l, _)| {
                n == "xtlock_lock_wait_seconds_count"
                    && l.get("agent").map(String::as_str) == Some("calico-node")
            })
            .find_map(|(_, l, _)| Some(format!("{}/{}", l.get("namespace")?, l.get("pod")?)));
    obs.features_off =
        m.0.iter()
            .filter(|(n, l, v)| {
                n == "xtlock_feature_enabled"
                    && *v == 0.0
                    && l.get("cause").map(String::as_str) == Some("privilege")
            })
            .filter_map(|(_, l, _)| l.get("feature").cloned())
            .collect();
    obs.drops = m.sum("xtlock_drops_total", &[("class", "netfilter_rule_drop")]);
    obs.location = m
        .series("xtlock_drops_total")
        .iter()
        .find(|l| l.get("class").map(String::as_str) == Some("netfilter_rule_drop"))
        .and_then(|l| l.get("location").cloned())
        .map(|l| {
            if l.starts_with("0x") {
                "an address".into()
            } else {
                l
            }
        });
    let (_, code) = node.stop(name, pod)?;
    let logs = node.logs(name);
    // Kept for a look at what each run saw.
    let tag = without.map_or("baseline".to_owned(), |w| {
        w.to_string()
            .replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    });
    let dir = node.work.join("privileges");
    let _ = fs::create_dir_all(&dir);
    let _ = fs::copy(
        node.work.join("metrics.txt"),
        dir.join(format!("{tag}.metrics.txt")),
    );
    let _ = fs::write(dir.join(format!("{tag}.log")), &logs);
    obs.warnings = logs
        .lines()
        .filter_map(message)
        .filter(|(level, _)| level == "WARN" || level == "ERROR")
        .map(|(_, m)| shape(&m))
        .collect();
    obs.netns_denied = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("cannot open the network namespaces"))
        })
        .filter_map(|v| v["fields"]["processes"].as_u64())
        .max()
        .unwrap_or(0);
    obs.mounted_tracefs = logs
        .lines()
        .filter_map(message)
        .any(|(_, m)| m == "mounted tracefs");
    obs.capture = code == 0
        && guard.new_files().iter().next_back().is_some_and(|(f, _)| {
            Command::new(&node.xtlock)
                .args(["report", "--json"])
                .arg(f)
                .output()
                .is_ok_and(|o| {
                    o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("WARN")
                })
        });
    let _ = node.engine.output(&["rm", "-f", "-t", "0", name]);
    node_drop_rule("-D")?;
    Ok(obs)
}

fn short(s: &str) -> String {
    let first = s.lines().next().unwrap_or_default();
    if first.len() > 300 {
        format!("{}...", &first[..300])
    } else {
        first.to_owned()
    }
}

pub fn run(node: &Node, pod: &PodRun) -> Result<String> {
    let t = Instant::now();
    let _pod_of_another_user = OtherUsersNetns::start()?;
    // Give it a moment to become uid 65534 in its own namespace.
    std::thread::sleep(Duration::from_millis(200));
    let base = one(node, pod, None)?;
    if let Some(f) = &base.failure {
        bail!("the run with every privilege of the manifest failed: {f}");
    }
    if !base.features_off.is_empty() {
        bail!(
            "with every privilege of the manifest, features are off for want of a privilege: \
             {:?} (grant what xtlock's log says)",
            base.features_off
        );
    }
    println!(
        "baseline: {} hooks, holder {:?}, pod {:?}, {} netns denied, {} drops at {:?}, capture {}, \
         warnings {:?}",
        base.hooks.len(),
        base.holder,
        base.pod,
        base.netns_denied,
        base.drops,
        base.location,
        base.capture,
        base.warnings
    );
    let mut table = String::from("| without | what the run showed |\n| --- | --- |\n");
    let mut superfluous = Vec::new();
    // Single mounts that lost nothing, forgiven when the run without their whole group loses
    // something (each gives the feature alone).
    let mut alone_ok: Vec<Without> = Vec::new();
    let mut groups_lost: Vec<Without> = Vec::new();
    for w in pod.privileges() {
        let obs = one(node, pod, Some(&w))?;
        let outcome = match &obs.failure {
            Some(f) => {
                groups_lost.push(w.clone());
                format!("fails: {f}")
            }
            None => {
                let lost = obs.lost(&base);
                if !lost.is_empty() {
                    groups_lost.push(w.clone());
                    format!("loses: {}", lost.join("; "))
                } else if let Some(g) = w.group() {
                    alone_ok.push(w.clone());
                    format!("nothing lost alone (see the run without {g})")
                } else {
                    superfluous.push(w.to_string());
                    "nothing lost".to_owned()
                }
            }
        };
        println!("  without {w}: {outcome}");
        let _ = writeln!(table, "| {w} | {} |", outcome.replace('|', "\\|"));
    }
    for w in alone_ok {
        if !w.group().is_some_and(|g| groups_lost.contains(&g)) {
            superfluous.push(w.to_string());
        }
    }
    let out = node.work.join("privileges.md");
    fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
    println!(
        "{table}(also in {}; {:.1} s)",
        out.display(),
        t.elapsed().as_secs_f64()
    );
    if !superfluous.is_empty() {
        bail!(
            "deploy/daemonset.yaml grants {} but a run without it lost nothing: remove it",
            superfluous.join(", ")
        );
    }
    Ok(format!(
        "{} least-privilege runs, each failed or lost a named feature",
        pod.privileges().len()
    ))
}
