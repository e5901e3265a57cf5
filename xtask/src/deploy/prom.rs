//! A real Prometheus (Debian's package) in the node's network namespace, scraping the daemon's
//! container as a cluster's scrape config does: the target labels of a Kubernetes pod
//! (`node` from the pod's node name, and the xtlock pod's own `namespace`/`pod`, which clash
//! with the daemon's as under prometheus-operator), evaluating deploy/'s alert and recording
//! rules every second. The test reads the rules' results from its HTTP API.
use std::{
    fs,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use super::{engine, promql, NODE_IP, NODE_NS};

/// The node name the scrape config gives the daemon's series.
pub const NODE_NAME: &str = "xtlock-node";
/// The xtlock pod's name on that node, as the kubelet would have named it.
pub const POD_NAME: &str = "xtlock-7xk2p";

pub struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Prometheus {
    /// Starts it scraping `NODE_IP:port` every second; ready when this returns.
    pub fn start(work: &Path, deploy: &Path, port: u16) -> Result<Self> {
        let dir = work.join("prometheus");
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;
        let rules: Vec<String> = promql::RULE_FILES
            .iter()
            .map(|f| format!("  - {}\n", deploy.join(f).display()))
            .collect();
        // A kubernetes_sd_configs (role: pod) target has these meta labels; the relabelling is
        // what the README tells a cluster's scrape config (or PodMonitor) to do.
        let cfg = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n{}\
             scrape_configs:\n  - job_name: xtlock\n    static_configs:\n      \
             - targets: ['{NODE_IP}:{port}']\n        labels:\n          \
             __meta_kubernetes_pod_node_name: {NODE_NAME}\n          \
             __meta_kubernetes_namespace: xtlock\n          \
             __meta_kubernetes_pod_name: {POD_NAME}\n    relabel_configs:\n      \
             - source_labels: [__meta_kubernetes_pod_node_name]\n        target_label: node\n      \
             - source_labels: [__meta_kubernetes_namespace]\n        target_label: namespace\n      \
             - source_labels: [__meta_kubernetes_pod_name]\n        target_label: pod\n",
            rules.concat()
        );
        let path = dir.join("prometheus.yml");
        fs::write(&path, cfg)?;
        // A free port on loopback; the node's namespace has nothing listening on it either.
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let log = fs::File::create(dir.join("prometheus.log"))?;
        let child = engine::in_netns(NODE_NS, "/usr/bin/prometheus")
            .arg(format!("--config.file={}", path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("/usr/bin/prometheus (apt-get install prometheus; ./xtask/run setup does)")?;
        let p = Prometheus { child, addr, dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(engine::http_get(NODE_NS, addr, "/-/ready"), Ok((200, _))) {
            if Instant::now() > deadline {
                bail!("Prometheus was not ready in 60 s: {}", p.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(p)
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// The instant vector of `q`: (labels, value) per series.
    pub fn query(&self, q: &str) -> Result<Vec<(Value, f64)>> {
        let (status, body) = engine::http_get(
            NODE_NS,
            self.addr,
            &format!("/api/v1/query?query={}", urlencode(q)),
        )?;
        anyhow::ensure!(status == 200, "query {q}: {status} {body}");
        let v: Value = serde_json::from_str(&body).context("Prometheus answers JSON")?;
        Ok(v["data"]["result"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|r| {
                        let val = r["value"][1]
                            .as_str()
                            .and_then(|s| s.parse().ok())
                            .unwrap_or(f64::NAN);
                        (r["metric"].clone(), val)
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Polls `q` until `ok` holds for its result (Some(result)), or None after `timeout`.
    pub fn until(
        &self,
        q: &str,
        timeout: Duration,
        ok: impl Fn(&[(Value, f64)]) -> bool,
    ) -> Result<(bool, Vec<(Value, f64)>)> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.query(q)?;
            if ok(&r) {
                return Ok((true, r));
            }
            if Instant::now() > deadline {
                return Ok((false, r));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The histogram buckets of docs/metrics.md: the (lower, upper] bucket holding both ends of
/// [lo, hi], if one does.
pub fn bucket_of(lo: f64, hi: f64) -> Option<(f64, f64)> {
    const LE: [f64; 18] = [
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0, 10.0, 30.0, 60.0,
    ];
    let mut lower = 0.0;
    for upper in LE {
        if lo > lower && hi <= upper {
            return Some((lower, upper));
        }
        lower = upper;
    }
    None
}
