//! A small Kubernetes node in network namespaces, against the real kernel: a bridge like the
//! bridge CNI plugin makes, two pods (namespaces with a veth on it), a client in a namespace
//! of its own routed through the node, and kube-proxy's nat table for one Service
//! (`default/web:http`, 10.96.0.10:80) as kube-proxy writes it. tests/tests/stale_endpoints.rs
//! and deploy-test's DaemonSet run (xtask/src/deploy/continuous.rs) drive it.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::{sh, xtlock_bin, Agent, Scratch, Tracer};

pub const T: Duration = Duration::from_secs(60);
pub const SVC: &str = "default/web:http";
pub const DNS: &str = "kube-system/dns:dns";
pub const DEAD: &str = "10.244.1.5";
pub const LIVE: &str = "10.244.1.6";

/// The namespaces of the scenario, deleted on drop (also when the test fails).
pub struct Node {
    pub node: String,
    pub pods: [String; 2],
    pub client: String,
    /// The node's namespace was there before (deploy-test's node): kept on drop.
    borrowed: bool,
}

impl Node {
    /// `fast_neighbours`: the node's neighbour entries fail within ~200 ms (each connection
    /// to a gone pod refused with one ICMP); else Linux's defaults (they stay reachable for
    /// 15-45 s: connections to a gone pod go unanswered, as on a real node).
    pub fn new(prefix: &str, fast_neighbours: bool) -> Self {
        Self::build(format!("{prefix}-node"), prefix, fast_neighbours, false)
    }

    /// The same on a node namespace that is there already (deploy-test's node, where the
    /// DaemonSet's container runs with hostNetwork): its bridge, pods and client are added,
    /// and removed on drop; the node itself is kept.
    pub fn on(node: &str, prefix: &str, fast_neighbours: bool) -> Self {
        Self::build(node.to_owned(), prefix, fast_neighbours, true)
    }

    fn build(node: String, prefix: &str, fast_neighbours: bool, borrowed: bool) -> Self {
        let n = Node {
            node,
            pods: [format!("{prefix}-p1"), format!("{prefix}-p2")],
            client: format!("{prefix}-cl"),
            borrowed,
        };
        n.delete();
        for ns in n.owned() {
            sh("ip", &["netns", "add", ns]);
            sh("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        let node = n.node.as_str();
        sh("ip", &["-n", node, "link", "add", "br0", "type", "bridge"]);
        sh(
            "ip",
            &["-n", node, "addr", "add", "10.244.1.1/24", "dev", "br0"],
        );
        sh("ip", &["-n", node, "link", "set", "br0", "up"]);
        for (i, (pod, ip)) in n.pods.iter().zip([DEAD, LIVE]).enumerate() {
            let veth = format!("vethp{i}");
            sh(
                "ip",
                &[
                    "-n", node, "link", "add", &veth, "type", "veth", "peer", "name", "eth0",
                    "netns", pod,
                ],
            );
            sh(
                "ip",
                &["-n", node, "link", "set", &veth, "master", "br0", "up"],
            );
            sh(
                "ip",
                &["-n", pod, "addr", "add", &format!("{ip}/24"), "dev", "eth0"],
            );
            sh("ip", &["-n", pod, "link", "set", "eth0", "up"]);
            sh(
                "ip",
                &["-n", pod, "route", "add", "default", "via", "10.244.1.1"],
            );
        }
        let cl = n.client.as_str();
        sh(
            "ip",
            &[
                "-n", node, "link", "add", "vcl", "type", "veth", "peer", "name", "eth0", "netns",
                cl,
            ],
        );
        sh(
            "ip",
            &["-n", node, "addr", "add", "10.199.0.1/24", "dev", "vcl"],
        );
        sh("ip", &["-n", node, "link", "set", "vcl", "up"]);
        sh(
            "ip",
            &["-n", cl, "addr", "add", "10.199.0.2/24", "dev", "eth0"],
        );
        sh("ip", &["-n", cl, "link", "set", "eth0", "up"]);
        sh(
            "ip",
            &["-n", cl, "route", "add", "default", "via", "10.199.0.1"],
        );
        // The node routes; its neighbour entries for the pods expire and fail fast (a real
        // node takes up to ~45 s and 3 s: the same states, sooner), and every failure is
        // answered with its ICMP host unreachable (no per-peer or global ICMP limit), so each
        // refused connection is one ICMP, as the client counts it.
        sh(
            "ip",
            &[
                "netns",
                "exec",
                node,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ],
        );
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.neigh.br0.base_reachable_time_ms", "100"),
            ("net.ipv4.neigh.br0.delay_first_probe_time", "0"),
            ("net.ipv4.neigh.br0.ucast_solicit", "1"),
            ("net.ipv4.neigh.br0.mcast_solicit", "1"),
            ("net.ipv4.neigh.br0.retrans_time_ms", "100"),
            ("net.ipv4.icmp_ratelimit", "0"),
            ("net.ipv4.icmp_msgs_per_sec", "1000000"),
            ("net.ipv4.icmp_msgs_burst", "1000000"),
        ] {
            if !fast_neighbours {
                break;
            }
            let path = format!("/proc/sys/{}", k.replace('.', "/"));
            // icmp_msgs_* are global on kernels before 6.0: left as they are there.
            if k.starts_with("net.ipv4.icmp_msgs") && !in_ns(node, "test", &["-e", &path]) {
                continue;
            }
            sh(
                "ip",
                &["netns", "exec", node, "sysctl", "-qw", &format!("{k}={v}")],
            );
        }
        n
    }

    pub fn all(&self) -> impl Iterator<Item = &String> {
        std::iter::once(&self.node)
            .chain(self.pods.iter())
            .chain(std::iter::once(&self.client))
    }

    /// The namespaces this made (all but a borrowed node).
    fn owned(&self) -> impl Iterator<Item = &String> {
        self.all()
            .filter(|ns| !(self.borrowed && **ns == self.node))
    }

    pub fn delete(&self) {
        if self.borrowed {
            // The pods' and the client's veths go with their namespaces; the bridge stays.
            let _ = Command::new("ip")
                .args(["-n", &self.node, "link", "del", "br0"])
                .stderr(std::process::Stdio::null())
                .status();
        }
        for ns in self.owned() {
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }

    pub fn path(ns: &str) -> String {
        format!("/run/netns/{ns}")
    }

    pub fn inode(ns: &str) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(Self::path(ns)).expect("netns").ino()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.delete();
    }
}

/// `helper` (the test helper named so) run with `args` in namespace `ns`.
pub fn helper_in(s: &Scratch, ns: &str, helper: &str, args: &[&str]) -> Agent {
    let bin = s.agent(helper);
    let mut all = vec!["netns", "exec", ns, bin.to_str().unwrap()];
    all.extend_from_slice(args);
    Agent::spawn(Path::new("ip"), &all, &[], None)
}

impl Node {
    /// xtlock in the node's network namespace, as a DaemonSet pod with hostNetwork runs.
    pub fn tracer(&self, lock: &Path, capture: Option<&Path>) -> Tracer {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", Node::path(&self.node)))
            .arg(xtlock_bin())
            .args(["trace", "--json", "--duration", "300s", "--lock-file"])
            .arg(lock);
        if let Some(capture) = capture {
            c.arg("--record").arg(capture);
        }
        c.args(crate::tracer_extra_args());
        Tracer::spawn(c)
    }

    /// Every pod serves each of `modes` (`tcplisten 8080`, `udpecho 5353`), listening.
    pub fn serve(&self, s: &Scratch, modes: &[&[&str]]) -> Vec<Agent> {
        let mut pods = Vec::new();
        for p in &self.pods {
            for mode in modes {
                let mut a = helper_in(s, p, "web", mode);
                a.expect("listening", T);
                pods.push(a);
            }
        }
        pods
    }

    /// The node talks to both pods: its neighbour entries exist.
    pub fn probe_pods(&self, s: &Scratch) {
        for ip in [DEAD, LIVE] {
            let args = ["connects", ip, "8080", "1", "0", "2000"];
            let mut a = helper_in(s, &self.node, "probe", &args);
            let words = a.expect("conn", T);
            assert_eq!(words.last().map(String::as_str), Some("ok"), "{words:?}");
            a.wait();
        }
    }

    /// The client connects to the web Service `count` times, `interval_ms` apart, each given
    /// `timeout_ms`.
    pub fn connects(&self, s: &Scratch, count: &str, interval_ms: &str, timeout_ms: &str) -> Agent {
        let args = [
            "connects",
            "10.96.0.10",
            "80",
            count,
            interval_ms,
            timeout_ms,
        ];
        helper_in(s, &self.client, "client", &args)
    }
}

/// What each of the client's connects got (`ok`, `EHOSTUNREACH`, `ETIMEDOUT`, ...).
pub fn client_results(client: &Agent) -> Vec<&str> {
    client
        .seen
        .iter()
        .filter(|l| l.starts_with("conn "))
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect()
}

/// The time a helper's child exited, as the helper said it.
pub fn exit_time(a: &mut Agent) -> u64 {
    a.expect("exit", T)
        .last()
        .and_then(|t| t.parse::<u64>().ok())
        .expect("exit time")
}

/// The pods' servers, stopped.
pub fn stop(pods: Vec<Agent>) {
    for mut p in pods {
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
}

pub fn in_ns(ns: &str, prog: &str, args: &[&str]) -> bool {
    Command::new("nsenter")
        .arg(format!("--net={}", Node::path(ns)))
        .arg(prog)
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

/// `Icmp: OutDestUnreachs` of namespace `ns` (the kernel's own count of ICMP destination
/// unreachable messages sent).
pub fn out_dest_unreachs(ns: &str) -> u64 {
    let out = sh(
        "nsenter",
        &[
            &format!("--net={}", Node::path(ns)),
            "cat",
            "/proc/net/snmp",
        ],
    );
    let mut icmp = out.lines().filter(|l| l.starts_with("Icmp:"));
    let (names, values) = (
        icmp.next().expect("Icmp names"),
        icmp.next().expect("values"),
    );
    let i = names
        .split_whitespace()
        .position(|n| n == "OutDestUnreachs")
        .expect("OutDestUnreachs");
    values
        .split_whitespace()
        .nth(i)
        .and_then(|v| v.parse().ok())
        .expect("a number")
}

/// kube-proxy's nat table for `default/web:http` (10.96.0.10:80) with these endpoints, as
/// kube-proxy writes it (comments, statistic, KUBE-MARK-MASQ, DNAT).
pub fn kube_proxy_nat(endpoints: &[&str]) -> String {
    nat_table(&[Svc::web(endpoints)])
}

/// One Service port of a kube-proxy nat table.
pub struct Svc<'a> {
    pub name: &'a str,
    pub chain: &'a str,
    pub vip: &'a str,
    pub proto: &'a str,
    pub port: u16,
    pub target: u16,
    pub endpoints: &'a [&'a str],
}

impl<'a> Svc<'a> {
    pub fn web(endpoints: &'a [&'a str]) -> Self {
        Svc {
            name: SVC,
            chain: "KUBE-SVC-WEB0000000000000",
            vip: "10.96.0.10",
            proto: "tcp",
            port: 80,
            target: 8080,
            endpoints,
        }
    }

    pub fn dns(endpoints: &'a [&'a str]) -> Self {
        Svc {
            name: DNS,
            chain: "KUBE-SVC-DNS0000000000000",
            vip: "10.96.0.53",
            proto: "udp",
            port: 53,
            target: 5353,
            endpoints,
        }
    }
}

pub fn nat_table(svcs: &[Svc]) -> String {
    let sep =
        |svc: &Svc, ip: &str| format!("KUBE-SEP-{}{:0>13}", &svc.chain[9..12], ip.replace('.', ""));
    let mut s = String::from(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
         :POSTROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n",
    );
    for svc in svcs {
        s.push_str(&format!(":{} - [0:0]\n", svc.chain));
        for ip in svc.endpoints {
            s.push_str(&format!(":{} - [0:0]\n", sep(svc, ip)));
        }
    }
    s.push_str(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n",
    );
    for svc in svcs {
        let Svc {
            name,
            chain,
            vip,
            proto,
            port,
            target,
            endpoints,
        } = svc;
        s.push_str(&format!(
            "-A KUBE-SERVICES -d {vip}/32 -p {proto} -m comment --comment \"{name} cluster IP\" -m {proto} --dport {port} -j {chain}\n"
        ));
        for (i, ip) in endpoints.iter().enumerate() {
            let left = endpoints.len() - i;
            let stat = if left > 1 {
                format!(
                    " -m statistic --mode random --probability {:.11}",
                    1.0 / left as f64
                )
            } else {
                String::new()
            };
            s.push_str(&format!(
                "-A {chain} -m comment --comment \"{name} -> {ip}:{target}\"{stat} -j {}\n",
                sep(svc, ip)
            ));
        }
        for ip in endpoints.iter() {
            let c = sep(svc, ip);
            s.push_str(&format!(
                "-A {c} -s {ip}/32 -m comment --comment \"{name}\" -j KUBE-MARK-MASQ\n\
                 -A {c} -p {proto} -m comment --comment \"{name}\" -m {proto} -j DNAT --to-destination {ip}:{target}\n"
            ));
        }
    }
    s.push_str("COMMIT\n");
    s
}
