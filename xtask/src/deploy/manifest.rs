//! `deploy/daemonset.yaml` turned into `podman run` flags, so what the test grants the
//! container is what the manifest grants the pod, and the two cannot drift: every field of
//! the pod spec, the container and their security contexts is either translated, or listed
//! here as having no bearing on what the container may do; any other field is an error.
use std::{collections::BTreeMap, fmt, path::Path, time::Duration};

use anyhow::{bail, ensure, Context as _, Result};
use serde_json::Value;

/// One hostPath volume and where the container mounts it.
#[derive(Clone, Debug, PartialEq)]
pub struct Mount {
    pub name: String,
    pub host_path: String,
    /// hostPath `type` (`Directory`, `DirectoryOrCreate`, `File`, `FileOrCreate`, `""`).
    pub host_type: String,
    pub container_path: String,
    pub read_only: bool,
    /// Kubernetes' mountPropagation (`None`, `HostToContainer`, `Bidirectional`).
    pub propagation: String,
}

/// What the DaemonSet's pod and its one container are given.
#[derive(Clone, Debug)]
pub struct PodRun {
    pub namespace: String,
    pub image: String,
    /// `command:` (replaces the image's ENTRYPOINT), usually empty.
    pub command: Vec<String>,
    /// `args:` with `$(VAR)` still in them.
    pub args: Vec<String>,
    /// (name, value) or (name, fieldRef path) as `$fieldRef:PATH`.
    pub env: Vec<(String, EnvValue)>,
    pub host_pid: bool,
    pub host_network: bool,
    pub privileged: bool,
    pub allow_privilege_escalation: bool,
    pub read_only_root: bool,
    pub run_as_user: Option<u64>,
    pub run_as_group: Option<u64>,
    /// `RuntimeDefault`, `Unconfined`; `None` when unset (the kubelet's default: Unconfined,
    /// unless the node runs with `--seccomp-default`).
    pub seccomp: Option<String>,
    pub caps_add: Vec<String>,
    pub caps_drop: Vec<String>,
    pub mounts: Vec<Mount>,
    pub memory_limit: Option<u64>,
    pub memory_request: Option<u64>,
    pub cpu_limit_milli: Option<u64>,
    pub cpu_request_milli: Option<u64>,
    pub grace: Duration,
    pub port: u16,
    pub liveness_path: String,
    pub readiness_path: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EnvValue {
    Value(String),
    /// `valueFrom.fieldRef.fieldPath`.
    Field(String),
}

/// A privilege of the manifest taken away, for the least-privilege runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Without {
    Cap(String),
    HostPid,
    HostNetwork,
    Mount(String),
    /// Several mounts at once: ones that give the same feature, each enough alone.
    Mounts(Vec<String>),
    /// `runAsUser` set to a non-root uid.
    NonRootUser(u64),
}

/// Mounts that each give the same feature alone (the kubelet's two log directories both name
/// pods): besides one run without each, one run without them all.
pub const SAME_FEATURE: &[&[&str]] = &[&["pod-logs", "container-logs"]];

impl Without {
    pub fn removes_mount(&self, name: &str) -> bool {
        match self {
            Without::Mount(m) => m == name,
            Without::Mounts(ms) => ms.iter().any(|m| m == name),
            _ => false,
        }
    }

    /// The group run that covers this single-mount run, if any.
    pub fn group(&self) -> Option<Without> {
        let Without::Mount(m) = self else {
            return None;
        };
        SAME_FEATURE
            .iter()
            .find(|g| g.contains(&m.as_str()))
            .map(|g| Without::Mounts(g.iter().map(|x| x.to_string()).collect()))
    }
}

impl fmt::Display for Without {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Without::Cap(c) => write!(f, "capability {c}"),
            Without::HostPid => write!(f, "hostPID"),
            Without::HostNetwork => write!(f, "hostNetwork"),
            Without::Mount(m) => write!(f, "mount {m}"),
            Without::Mounts(m) => write!(f, "mounts {}", m.join(" and ")),
            Without::NonRootUser(u) => write!(f, "runAsUser: 0 (run as {u})"),
        }
    }
}

// Fields with no bearing on what the container may do on the node (scheduling, probes,
// metadata, API access), or translated below.
const POD_SPEC_KEYS: &[&str] = &[
    "serviceAccountName",
    "automountServiceAccountToken",
    "hostPID",
    "hostNetwork",
    "dnsPolicy",
    "priorityClassName",
    "terminationGracePeriodSeconds",
    "tolerations",
    "containers",
    "volumes",
    "securityContext",
];
const POD_SECURITY_KEYS: &[&str] = &["seccompProfile", "runAsUser", "runAsGroup"];
const CONTAINER_KEYS: &[&str] = &[
    "name",
    "image",
    "imagePullPolicy",
    "command",
    "args",
    "env",
    "ports",
    "livenessProbe",
    "readinessProbe",
    "resources",
    "securityContext",
    "volumeMounts",
];
const CONTAINER_SECURITY_KEYS: &[&str] = &[
    "runAsUser",
    "runAsGroup",
    "privileged",
    "allowPrivilegeEscalation",
    "readOnlyRootFilesystem",
    "capabilities",
    "seccompProfile",
];

fn check_keys(v: &Value, known: &[&str], what: &str) -> Result<()> {
    if let Some(map) = v.as_object() {
        for k in map.keys() {
            ensure!(
                known.contains(&k.as_str()),
                "{what}.{k} in deploy/daemonset.yaml: deploy-test does not know how to give it \
                 to the container engine; translate it in xtask/src/deploy/manifest.rs"
            );
        }
    }
    Ok(())
}

/// Every YAML document of a file (comment-only documents skipped).
pub fn documents(text: &str) -> Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).context("parsing YAML")?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

pub fn read(path: &Path) -> Result<PodRun> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

pub fn parse(text: &str) -> Result<PodRun> {
    let docs = documents(text)?;
    let ds = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .context("no DaemonSet")?;
    let spec = &ds["spec"]["template"]["spec"];
    check_keys(spec, POD_SPEC_KEYS, "spec.template.spec")?;
    let pod_sc = &spec["securityContext"];
    check_keys(
        pod_sc,
        POD_SECURITY_KEYS,
        "spec.template.spec.securityContext",
    )?;
    let containers = spec["containers"].as_array().context("no containers")?;
    ensure!(
        containers.len() == 1 && spec.get("initContainers").is_none(),
        "deploy-test runs one container; the DaemonSet has {}",
        containers.len()
    );
    let c = &containers[0];
    check_keys(c, CONTAINER_KEYS, "containers[0]")?;
    let sc = &c["securityContext"];
    check_keys(sc, CONTAINER_SECURITY_KEYS, "containers[0].securityContext")?;
    check_keys(
        &sc["capabilities"],
        &["add", "drop"],
        "containers[0].securityContext.capabilities",
    )?;

    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|x| match x {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let flag = |v: &Value, default: bool| v.as_bool().unwrap_or(default);
    // The container's own setting wins over the pod's, as in Kubernetes.
    let either = |k: &str| -> Value {
        match sc.get(k) {
            Some(v) => v.clone(),
            None => pod_sc.get(k).cloned().unwrap_or(Value::Null),
        }
    };

    let mut env = Vec::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().context("env without a name")?.to_owned();
        let value = if let Some(v) = e.get("value") {
            EnvValue::Value(v.as_str().unwrap_or_default().to_owned())
        } else if let Some(p) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            EnvValue::Field(p.to_owned())
        } else {
            bail!("env {name}: only value and valueFrom.fieldRef are translated");
        };
        env.push((name, value));
    }

    let volumes: BTreeMap<&str, &Value> = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["name"].as_str()?, v)))
        .collect();
    let mut mounts = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        check_keys(
            m,
            &["name", "mountPath", "readOnly", "mountPropagation"],
            "containers[0].volumeMounts[]",
        )?;
        let name = m["name"].as_str().context("volumeMount without a name")?;
        let vol = volumes
            .get(name)
            .with_context(|| format!("volumeMount {name} has no volume"))?;
        let hp = vol
            .get("hostPath")
            .with_context(|| format!("volume {name}: only hostPath volumes are translated"))?;
        mounts.push(Mount {
            name: name.to_owned(),
            host_path: hp["path"].as_str().context("hostPath.path")?.to_owned(),
            host_type: hp["type"].as_str().unwrap_or_default().to_owned(),
            container_path: m["mountPath"].as_str().context("mountPath")?.to_owned(),
            read_only: flag(&m["readOnly"], false),
            propagation: m["mountPropagation"].as_str().unwrap_or("None").to_owned(),
        });
    }

    let res = &c["resources"];
    check_keys(res, &["requests", "limits"], "containers[0].resources")?;
    for part in ["requests", "limits"] {
        check_keys(
            &res[part],
            &["cpu", "memory"],
            &format!("containers[0].resources.{part}"),
        )?;
    }
    let port = c["ports"][0]["containerPort"]
        .as_u64()
        .context("containers[0].ports[0].containerPort")?;
    Ok(PodRun {
        namespace: ds["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned(),
        image: c["image"].as_str().context("image")?.to_owned(),
        command: strings(&c["command"]),
        args: strings(&c["args"]),
        env,
        host_pid: flag(&spec["hostPID"], false),
        host_network: flag(&spec["hostNetwork"], false),
        privileged: flag(&sc["privileged"], false),
        allow_privilege_escalation: flag(&sc["allowPrivilegeEscalation"], true),
        read_only_root: flag(&sc["readOnlyRootFilesystem"], false),
        run_as_user: either("runAsUser").as_u64(),
        run_as_group: either("runAsGroup").as_u64(),
        seccomp: either("seccompProfile")["type"].as_str().map(str::to_owned),
        caps_add: strings(&sc["capabilities"]["add"]),
        caps_drop: strings(&sc["capabilities"]["drop"]),
        mounts,
        memory_limit: res["limits"]["memory"].as_str().map(bytes_of).transpose()?,
        memory_request: res["requests"]["memory"]
            .as_str()
            .map(bytes_of)
            .transpose()?,
        cpu_limit_milli: res["limits"].get("cpu").map(milli_of).transpose()?,
        cpu_request_milli: res["requests"].get("cpu").map(milli_of).transpose()?,
        grace: Duration::from_secs(spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30)),
        port: u16::try_from(port).context("containerPort")?,
        liveness_path: c["livenessProbe"]["httpGet"]["path"]
            .as_str()
            .unwrap_or("/healthz")
            .to_owned(),
        readiness_path: c["readinessProbe"]["httpGet"]["path"]
            .as_str()
            .unwrap_or("/readyz")
            .to_owned(),
    })
}

/// Kubernetes quantities of memory: `128Mi`, `1G`, `1000`.
pub fn bytes_of(q: &str) -> Result<u64> {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            let n: u64 = n.parse().with_context(|| format!("quantity {q}"))?;
            return Ok(n * mult);
        }
    }
    q.parse().with_context(|| format!("quantity {q}"))
}

/// CPU quantities: `20m`, `1`, `0.5`, in millicores.
pub fn milli_of(v: &Value) -> Result<u64> {
    let s = match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if let Some(m) = s.strip_suffix('m') {
        return m.parse().with_context(|| format!("cpu {s}"));
    }
    let cores: f64 = s.parse().with_context(|| format!("cpu {s}"))?;
    Ok((cores * 1000.0).round() as u64)
}

impl PodRun {
    /// The environment the container gets: values, and `fieldRef`s resolved as the kubelet
    /// does for a hostNetwork pod on a node whose address is `node_ip`.
    pub fn resolved_env(&self, node_ip: &str) -> Result<Vec<(String, String)>> {
        self.env
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    EnvValue::Value(v) => v.clone(),
                    EnvValue::Field(p) => match p.as_str() {
                        "status.hostIP" => node_ip.to_owned(),
                        "status.podIP" if self.host_network => node_ip.to_owned(),
                        "metadata.namespace" => self.namespace.clone(),
                        other => bail!("env {k}: fieldRef {other} is not translated"),
                    },
                };
                Ok((k.clone(), v))
            })
            .collect()
    }

    /// `args` with `$(VAR)` replaced as the kubelet does (`$$` escapes; unknown names stay).
    pub fn expanded_args(&self, env: &[(String, String)]) -> Vec<String> {
        self.args.iter().map(|a| expand(a, env)).collect()
    }

    /// `podman run` flags (everything between `run` and the image) for this pod, without
    /// `without`. `node_ip` resolves `status.hostIP`.
    pub fn engine_flags(&self, node_ip: &str, without: Option<&Without>) -> Result<Vec<String>> {
        let mut f: Vec<String> = Vec::new();
        let gone = |w: &Without| without == Some(w);
        for c in &self.caps_drop {
            f.extend(["--cap-drop".into(), cap_name(c)]);
        }
        for c in &self.caps_add {
            if !gone(&Without::Cap(c.clone())) {
                f.extend(["--cap-add".into(), cap_name(c)]);
            }
        }
        if self.privileged {
            f.push("--privileged".into());
        }
        if !self.allow_privilege_escalation {
            f.extend(["--security-opt".into(), "no-new-privileges".into()]);
        }
        match self.seccomp.as_deref() {
            // The engine's default profile is the runtime default.
            Some("RuntimeDefault") => {}
            Some("Unconfined") | None => {
                f.extend(["--security-opt".into(), "seccomp=unconfined".into()])
            }
            Some(other) => bail!("seccompProfile {other} is not translated"),
        }
        if self.host_pid && !gone(&Without::HostPid) {
            f.extend(["--pid".into(), "host".into()]);
        }
        // A pod without hostNetwork has a namespace of its own; `none` (loopback only)
        // stands for it: the test sets up no pod network.
        let net = if self.host_network && !gone(&Without::HostNetwork) {
            "host"
        } else {
            "none"
        };
        f.extend(["--network".into(), net.into()]);
        if self.read_only_root {
            // Without podman's tmpfs on /tmp, /var/tmp and /run: Kubernetes adds none.
            f.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
        }
        let user = match without {
            Some(Without::NonRootUser(u)) => Some(*u),
            _ => self.run_as_user,
        };
        if let Some(u) = user {
            let g = self.run_as_group.map_or(String::new(), |g| format!(":{g}"));
            f.extend(["--user".into(), format!("{u}{g}")]);
        }
        for m in &self.mounts {
            if without.is_some_and(|w| w.removes_mount(&m.name)) {
                continue;
            }
            let prop = match m.propagation.as_str() {
                "None" => "rprivate",
                "HostToContainer" => "rslave",
                "Bidirectional" => "rshared",
                other => bail!("mountPropagation {other} of {} is not translated", m.name),
            };
            let mut spec = format!(
                "type=bind,source={},destination={},bind-propagation={prop}",
                m.host_path, m.container_path
            );
            if m.read_only {
                spec.push_str(",ro=true");
            }
            f.extend(["--mount".into(), spec]);
        }
        if let Some(b) = self.memory_limit {
            // The kubelet sets no swap for the container: the limit is all it gets.
            f.extend([
                "--memory".into(),
                b.to_string(),
                "--memory-swap".into(),
                b.to_string(),
            ]);
        }
        if let Some(m) = self.cpu_limit_milli {
            f.extend(["--cpus".into(), format!("{:.3}", m as f64 / 1000.0)]);
        }
        if let Some(m) = self.cpu_request_milli {
            // The kubelet's cpu.shares for a request: milli * 1024 / 1000, at least 2.
            f.extend(["--cpu-shares".into(), (m * 1024 / 1000).max(2).to_string()]);
        }
        f.extend(["--stop-timeout".into(), self.grace.as_secs().to_string()]);
        let env = self.resolved_env(node_ip)?;
        for (k, v) in &env {
            f.extend(["--env".into(), format!("{k}={v}")]);
        }
        if let Some(first) = self.command.first() {
            f.extend(["--entrypoint".into(), first.clone()]);
        }
        Ok(f)
    }

    /// What follows the image on the `podman run` line.
    pub fn engine_args(&self, node_ip: &str) -> Result<Vec<String>> {
        let env = self.resolved_env(node_ip)?;
        let mut a: Vec<String> = self.command.iter().skip(1).cloned().collect();
        a.extend(self.expanded_args(&env));
        Ok(a)
    }

    /// Every privilege the manifest grants, one least-privilege run each.
    pub fn privileges(&self) -> Vec<Without> {
        let mut v: Vec<Without> = self.caps_add.iter().cloned().map(Without::Cap).collect();
        if self.host_pid {
            v.push(Without::HostPid);
        }
        if self.host_network {
            v.push(Without::HostNetwork);
        }
        v.extend(self.mounts.iter().map(|m| Without::Mount(m.name.clone())));
        for group in SAME_FEATURE {
            if group
                .iter()
                .all(|g| self.mounts.iter().any(|m| m.name == *g))
            {
                v.push(Without::Mounts(
                    group.iter().map(|g| g.to_string()).collect(),
                ));
            }
        }
        if self.run_as_user == Some(0) {
            v.push(Without::NonRootUser(65534));
        }
        v
    }
}

/// `BPF` -> `CAP_BPF` (what podman and docker expect; Kubernetes drops the prefix).
fn cap_name(c: &str) -> String {
    if c == "ALL" || c.starts_with("CAP_") {
        c.to_owned()
    } else {
        format!("CAP_{c}")
    }
}

fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            out.push('$');
            rest = r;
        } else if let Some(r) = after.strip_prefix('(') {
            match r.find(')') {
                Some(j) => {
                    let name = &r[..j];
                    match env.iter().find(|(k, _)| k == name) {
                        Some((_, v)) => out.push_str(v),
                        None => out.push_str(&format!("$({name})")),
                    }
                    rest = &r[j + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = r;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repositorys_manifest_translates() {
        let p = parse(include_str!("../../../deploy/daemonset.yaml")).expect("parses");
        let flags = p.engine_flags("10.0.0.1", None).expect("flags").join(" ");
        for want in [
            "--cap-drop ALL",
            "--cap-add CAP_SYS_ADMIN",
            "--cap-add CAP_SYSLOG",
            "--pid host",
            "--network host",
            "--read-only",
            "--user 0",
            "--security-opt no-new-privileges",
            "destination=/run,bind-propagation=rslave",
            "source=/var/log/pods,destination=/var/log/pods,bind-propagation=rprivate,ro=true",
        ] {
            assert!(flags.contains(want), "{want} missing: {flags}");
        }
        // RuntimeDefault: the engine's own default profile, no flag.
        assert!(!flags.contains("seccomp"), "{flags}");
        let args = p.engine_args("10.0.0.1").expect("args").join(" ");
        assert!(args.starts_with("daemon --listen 10.0.0.1:9655"), "{args}");
        let without = p
            .engine_flags("10.0.0.1", Some(&Without::Cap("SYSLOG".into())))
            .expect("flags")
            .join(" ");
        assert!(!without.contains("CAP_SYSLOG"), "{without}");
        assert!(p.privileges().contains(&Without::HostPid));
    }

    #[test]
    fn unknown_fields_are_refused() {
        let base = include_str!("../../../deploy/daemonset.yaml");
        let with = base.replace(
            "readOnlyRootFilesystem: true",
            "readOnlyRootFilesystem: true\n            procMount: Unmasked",
        );
        assert_ne!(with, base);
        let e = parse(&with).expect_err("procMount is not translated");
        assert!(format!("{e:#}").contains("procMount"), "{e:#}");
    }

    #[test]
    fn quantities_and_expansion() {
        assert_eq!(bytes_of("128Mi").expect("q"), 128 << 20);
        assert_eq!(bytes_of("1G").expect("q"), 1_000_000_000);
        assert_eq!(milli_of(&Value::from("20m")).expect("q"), 20);
        assert_eq!(milli_of(&Value::from(1)).expect("q"), 1000);
        assert_eq!(milli_of(&Value::from("0.5")).expect("q"), 500);
        let env = vec![("A".to_owned(), "x".to_owned())];
        assert_eq!(expand("$(A):1 $(B) $$(A) $", &env), "x:1 $(B) $(A) $");
    }
}
