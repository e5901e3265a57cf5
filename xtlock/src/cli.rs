//! Command-line interface (clap types only; the commands live in `commands/`).

use std::{path::PathBuf, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "xtlock",
    version,
    about = "Why Services time out on a Ready node: who holds the netfilter locks and who waits, \
             who changed whose rules, which rule dropped which packets, which connections were \
             refused, which Services route to pods that are gone",
    long_about = "xtlock traces a Kubernetes node's netfilter with eBPF and says, per agent \
                  (kube-proxy, a CNI agent, firewalld, dockerd) and pod: who holds the xtables \
                  lock and the nf_tables commit mutex, for how long, and who waits behind them; \
                  every rule write, what it changed and whose rules it broke; each packet \
                  netfilter dropped, with the rule that dropped it, that rule's owner and the \
                  write that added it; the connections the node refused; and the Services that \
                  still route to pods that are gone, for how long, and why the fix was late. \
                  `trace` live, `record` + `report` (or `report --html`) later, `daemon` for \
                  Prometheus. See README.md and docs/."
)]
pub struct Cli {
    /// More logging on stderr (-v: debug, -vv: trace). RUST_LOG overrides it.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Trace live: a line per hold, wait, rule change, dropping rule, refusal and dead
    /// endpoint; a summary every 10 s and at exit.
    Trace(TraceArgs),
    /// Record everything `trace` sees into a capture file, for `report` and `export` later.
    Record(RecordArgs),
    /// Analyse a capture file: the same summary and events `trace` prints, or one HTML page
    /// (--html). No root needed.
    Report(ReportArgs),
    /// Turn a capture file into a timeline (Perfetto / Chrome JSON trace).
    Export(ExportArgs),
    /// Show which kernel hooks attach on this machine, which do not, and why.
    Probes(ProbesArgs),
    /// Run continuously: Prometheus metrics on /metrics, /healthz and /readyz, and optionally
    /// a rolling set of capture files. Logs only (see --log-format json); no other output.
    Daemon(DaemonArgs),
    /// Print a shell completion script on stdout (the Debian package installs them).
    #[command(hide = true)]
    Completions(CompletionsArgs),
    /// Print the xtlock(8) manual page (roff) on stdout: `xtlock man | man -l -`.
    #[command(hide = true)]
    Man,
    /// Print this network namespace's legacy iptables tables (--nft: iptables-nft's) as
    /// xtlock reads them, in iptables-save's form (tests compare the two).
    #[command(hide = true)]
    Rules(RulesArgs),
}

#[derive(Debug, clap::Args)]
pub struct RulesArgs {
    /// ip6tables' tables instead of iptables'.
    #[arg(long)]
    pub ip6: bool,
    /// The nf_tables tables iptables-nft writes, as iptables-nft-save prints them, instead of
    /// the legacy ones.
    #[arg(long)]
    pub nft: bool,
    /// A table to print (repeatable); default: every table loaded in this namespace.
    #[arg(short, long, value_name = "TABLE")]
    pub table: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `--listen`: an IP address and a port; a host name would need a resolver and could
/// bind somewhere unexpected, so it is refused with what to write instead.
fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    s.parse().map_err(|_| {
        format!(
            "`{s}` is not an IP:PORT; write an IP address and a port, e.g. 0.0.0.0:9655, \
             127.0.0.1:9655 or [::]:9655 (host names are not accepted)"
        )
    })
}

#[derive(Debug, clap::Args)]
pub struct DaemonArgs {
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:9655", value_parser = parse_listen)]
    pub listen: std::net::SocketAddr,
    /// Keep rolling capture files here (`xtlock report` replays any of them).
    #[arg(long, value_name = "DIR")]
    pub record_dir: Option<PathBuf>,
    /// With --record-dir: how many capture files to keep.
    #[arg(long, value_name = "N", default_value_t = 8, requires = "record_dir", value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub record_keep: u64,
    /// With --record-dir: at most this many bytes for all of them (e.g. 256MiB); a file is
    /// rotated when it passes its share (this / --record-keep).
    #[arg(long, value_name = "BYTES", default_value = "256MiB", requires = "record_dir", value_parser = parse_bytes)]
    pub record_max_bytes: u64,
    /// With --record-dir: also rotate after this long (e.g. 1h).
    #[arg(long, value_name = "DURATION", requires = "record_dir", value_parser = parse_duration)]
    pub record_period: Option<Duration>,
    /// Stop after this long (for tests). Default: until SIGTERM.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Size of the kernel-to-userspace ring buffer, in MiB (a power of two).
    #[arg(long, default_value_t = 4, value_parser = parse_ring_mib)]
    pub ring_buffer_mib: u32,
    #[command(flatten)]
    pub locks: LockArgs,
    #[command(flatten)]
    pub drops: DropArgs,
}

/// `1048576`, `512KiB`, `64MiB`, `1GiB` (also KB/MB/GB as powers of 1000, and k/M/G as 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size; use e.g. 64MiB, 1GiB, 500000"))?;
    let mul: u64 = match unit.trim() {
        "" | "B" => 1,
        "k" | "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        u => return Err(format!("`{u}` is not a size unit; use B, KiB, MiB or GiB")),
    };
    n.checked_mul(mul)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("`{s}` is not a usable size"))
}

#[derive(Debug, clap::Args)]
pub struct RecordArgs {
    /// Capture file to write (overwritten if it exists).
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// Stop after this long (e.g. 30s, 5m). Default: until Ctrl-C.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Size of the kernel-to-userspace ring buffer, in MiB (a power of two).
    #[arg(long, default_value_t = 4, value_parser = parse_ring_mib)]
    pub ring_buffer_mib: u32,
    #[command(flatten)]
    pub locks: LockArgs,
    #[command(flatten)]
    pub drops: DropArgs,
}

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// Capture file written by `xtlock record`.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// JSON Lines, the same objects as `trace --json`.
    #[arg(long)]
    pub json: bool,
    /// Every event as `trace` would have printed it, then the summary.
    #[arg(long)]
    pub events: bool,
    /// Write the incident as one self-contained HTML page to FILE instead: a timeline per
    /// lock and agent (holds, waits and whom they waited behind), rule writes and what they
    /// changed, drops and refusals, Services routed to gone endpoints; hover or click a mark
    /// for its fact. No network needed to open it. Filters choose the marks.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json", "events"])]
    pub html: Option<PathBuf>,
    /// With --events: print holds at least this long.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub min_hold: Duration,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Show only facts on this lock file, as the capture names it (repeatable); facts
    /// about no lock (execs, drops outside holds) stay.
    #[arg(long = "lock-file", value_name = "PATH", help_heading = FILTERS)]
    pub lock_files: Vec<PathBuf>,
    /// Show only facts from this time on: a time of day as the report shows it (10:02:30,
    /// the capture's day, local time), a date and time (2024-05-01 10:02:30 local, or
    /// RFC 3339: 2024-05-01T08:02:30Z), or a duration after the capture's start (90s, +5m).
    /// Holds and waits that overlap it are shown whole.
    #[arg(long, value_name = "WHEN", value_parser = crate::sinks::filter::When::parse, help_heading = FILTERS)]
    pub since: Option<crate::sinks::filter::When>,
    /// Show only facts before this time (same forms as --since).
    #[arg(long, value_name = "WHEN", value_parser = crate::sinks::filter::When::parse, help_heading = FILTERS)]
    pub until: Option<crate::sinks::filter::When>,
}

const FILTERS: &str =
    "Filters (what is shown; the summary's tables, metrics and captures keep everything)";

/// Who to show, as ig and kubectl users select it: shared by `trace` and `report`.
#[derive(Clone, Debug, Default, clap::Args)]
#[command(next_help_heading = FILTERS)]
pub struct FilterArgs {
    /// Show only facts about this agent (repeatable): its holds, execs and stalls, waits by
    /// it or behind it, drops during its holds.
    #[arg(long = "agent", value_name = "NAME")]
    pub agents: Vec<String>,
    /// Show only facts about processes of this pod (repeatable): its name, or its
    /// workload's (kube-proxy matches kube-proxy-x7k2p).
    #[arg(long = "pod", value_name = "NAME")]
    pub pods: Vec<String>,
    /// Show only facts about processes in pods of this namespace (repeatable).
    #[arg(short = 'n', long = "namespace", value_name = "NS")]
    pub namespaces: Vec<String>,
    /// Show only facts that name this Service (repeatable), as kube-proxy names it:
    /// `ns/name` (every port) or `ns/name:port` (the port's name, or its number where it has
    /// none): its dead-endpoint windows and first routings, refusals by its REJECT rule, drops
    /// by rules and rule changes whose comments name it.
    #[arg(long = "service", value_name = "NS/NAME[:PORT]", value_parser = parse_service)]
    pub services: Vec<String>,
}

/// `ns/name` or `ns/name:port`, each part non-empty.
fn parse_service(s: &str) -> Result<String, String> {
    let (ns, rest) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not NAMESPACE/NAME[:PORT] (e.g. default/web:http)"))?;
    let (name, port) = match rest.split_once(':') {
        Some((n, p)) => (n, Some(p)),
        None => (rest, None),
    };
    let bad = |c: char| c.is_whitespace() || c == '"' || c == '/';
    if ns.is_empty()
        || name.is_empty()
        || port == Some("")
        || s[ns.len() + 1..].chars().any(bad)
        || ns.chars().any(bad)
    {
        return Err(format!(
            "`{s}` is not NAMESPACE/NAME[:PORT] (e.g. default/web or default/web:http)"
        ));
    }
    Ok(s.to_string())
}

impl FilterArgs {
    /// The filter of these flags (the report adds locks and times).
    pub fn filter(&self) -> crate::sinks::FactFilter {
        crate::sinks::FactFilter {
            agents: self.agents.clone(),
            pods: self.pods.clone(),
            namespaces: self.namespaces.clone(),
            services: self.services.clone(),
            ..Default::default()
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// Chrome JSON trace format, opened by ui.perfetto.dev and chrome://tracing.
    Perfetto,
}

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// Capture file written by `xtlock record`.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    #[arg(long, value_enum, default_value_t = ExportFormat::Perfetto)]
    pub format: ExportFormat,
    /// Where to write the timeline.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    #[command(flatten)]
    pub filter: FilterArgs,
}

#[derive(Debug, clap::Args)]
pub struct LockArgs {
    /// Lock file to watch (repeatable). Default: $XTABLES_LOCKFILE, else /run/xtables.lock.
    #[arg(long = "lock-file", value_name = "PATH")]
    pub lock_files: Vec<PathBuf>,
    /// Attach types not to use, everywhere (`fentry`) or for one hook
    /// (`sys_enter_execve:tracepoint`), comma-separated or repeated: hooks then take their
    /// next candidate (tp_btf, tracepoint, fentry/fexit, kprobe/kretprobe; syscall hooks try
    /// their function before their tracepoint). Also $XTLOCK_NO_ATTACH.
    #[arg(long = "no-attach", value_name = "[HOOK:]KIND")]
    pub no_attach: Vec<crate::probes::kfunc::AttachFilter>,
    /// Where the node's root filesystem is: processes in pods are named by namespace, pod
    /// and container from the kubelet's log directories under it (var/log/containers,
    /// var/log/pods). Default: `/`, or the host's root seen through `/proc/1/root` (or
    /// `/host`) from a container that shares the host's PID namespace.
    #[arg(long = "host-root", value_name = "DIR")]
    pub host_root: Option<PathBuf>,
    /// Do not read iptables tables back after writes: rule writes and backends are still
    /// counted, but what each write changed (chain diffs, foreign changes, stripped
    /// matches) is not said. Each read costs about what an `iptables-save` of the table
    /// does (docs/performance.md).
    #[arg(long = "no-rule-reads")]
    pub no_rule_reads: bool,
    /// Benchmarks only (`cargo xtask bench`): the lock hook runs an empty program at the same
    /// attach point and type, so its cost is the floor xtlock's lock path is measured
    /// against. Nothing about the locks is reported.
    #[arg(long = "bench-floor", hide = true)]
    pub bench_floor: bool,
    /// Benchmarks only: like `--bench-floor`, plus the pre-filter and one hold-sized ring
    /// record a release on the watched lock (dropped by userspace): the floor of streaming
    /// a record per hold.
    #[arg(
        long = "bench-floor-record",
        hide = true,
        conflicts_with = "bench_floor"
    )]
    pub bench_floor_record: bool,
    /// Benchmarks only: the drop hook runs an empty program at its attach point and type
    /// (tp_btf `kfree_skb`), the lock hook as shipped: the floor the drop hook is measured
    /// against. No drop is counted.
    #[arg(
        long = "bench-floor-drops",
        hide = true,
        conflicts_with_all = ["bench_floor", "bench_floor_record"]
    )]
    pub bench_floor_drops: bool,
    /// Benchmarks only: one empty program on the `sendmsg()` and `getsockopt()` tracepoints
    /// where their tracepoint programs attach (no function hooks): the floor of an
    /// nf_tables transaction's hooks. No batch is timed.
    #[arg(
        long = "bench-floor-syscalls",
        hide = true,
        conflicts_with_all = ["bench_floor", "bench_floor_record", "bench_floor_drops"]
    )]
    pub bench_floor_syscalls: bool,
    /// Tests only: full memory barriers around the kernel's kept lock takes as on a weakly
    /// ordered CPU (arm64), on this one too, so that an x86 test runs that path.
    #[arg(long = "memory-barriers", hide = true)]
    pub memory_barriers: bool,
}

impl LockArgs {
    /// The flag's rules and the environment's.
    pub fn attach_filter(&self) -> anyhow::Result<crate::probes::kfunc::AttachFilter> {
        let f = crate::probes::kfunc::AttachFilter::merge(&self.no_attach)
            .with_env()
            .map_err(anyhow::Error::msg)?;
        let known = crate::probes::hook_names();
        if let Some(bad) = f.unknown_hooks(&known).first() {
            let hint = if bad.ends_with("_flock") || *bad == "flock_syscall" {
                " (xtlock no longer hooks the flock() syscall: the lock tracepoint and \
                 signal_deliver see what it told)"
            } else {
                ""
            };
            anyhow::bail!(
                "--no-attach / ${}: no hook named `{bad}`{hint}; hook names are {}",
                crate::probes::kfunc::NO_ATTACH_ENV,
                known.join(", ")
            );
        }
        Ok(f)
    }
}

#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    /// Stop after this long (e.g. 30s, 5m). Default: until Ctrl-C.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Print holds, and the drops during them, at least this long (waits are always
    /// printed). E.g. 10ms.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub min_hold: Duration,
    /// JSON Lines on stdout: one object per event, the summary last.
    #[arg(long)]
    pub json: bool,
    /// How often to print the summary while tracing (0s: only at exit).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub summary_interval: Duration,
    /// Size of the kernel-to-userspace ring buffer, in MiB (a power of two).
    #[arg(long, default_value_t = 4, value_parser = parse_ring_mib)]
    pub ring_buffer_mib: u32,
    /// Also write everything to this capture file, as `xtlock record` does (whatever the
    /// filters show).
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    #[command(flatten)]
    pub locks: LockArgs,
    #[command(flatten)]
    pub drops: DropArgs,
    // Last: its help heading would carry over to the options after it.
    #[command(flatten)]
    pub filter: FilterArgs,
}

/// Packet drops and conntrack: shared by every command that traces live.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Packet drops and conntrack")]
pub struct DropArgs {
    /// Drop samples (with addresses) sent from the kernel, per second per CPU, e.g. 100/s;
    /// 0 for counts only. Refusal samples get the same budget, apart. Counts stay exact
    /// whatever the rate.
    #[arg(long, value_name = "N/s", default_value = "100/s", value_parser = parse_rate)]
    pub drop_samples: u32,
    /// Drop reasons to watch, as this kernel spells them (e.g. NETFILTER_DROP,NO_SOCKET;
    /// `xtlock probes` lists them), `all`, or `default`: everything but a normal socket close.
    #[arg(long, value_name = "LIST", default_value = "default", value_parser = crate::probes::dropreason::ReasonSelection::parse)]
    pub drop_reasons: crate::probes::dropreason::ReasonSelection,
    /// Do not trace packet drops or conntrack at all.
    #[arg(long, conflicts_with_all = ["drop_reasons", "netns", "all_netns"])]
    pub no_drops: bool,
    /// Also read conntrack counters of this network namespace (repeatable):
    /// /run/netns/NAME or /proc/PID/ns/net. The host's are always read.
    #[arg(long = "netns", value_name = "PATH")]
    pub netns: Vec<PathBuf>,
    /// Read conntrack counters of every network namespace (/run/netns/* and those of
    /// running processes, rescanned every 10 s).
    #[arg(long)]
    pub all_netns: bool,
    /// Warn when a conntrack table is at least this full, in percent (0: never).
    #[arg(long, value_name = "PCT", default_value_t = 75, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub conntrack_warn: u32,
}

impl DropArgs {
    /// What the drop hook is to count and sample; `None` with `--no-drops`.
    pub fn probe_options(&self) -> Option<crate::probes::DropOptions> {
        (!self.no_drops).then(|| crate::probes::DropOptions {
            reasons: self.drop_reasons.clone(),
            samples_per_sec: self.drop_samples,
        })
    }

    pub fn netns_options(&self) -> crate::source::drops::NetnsOptions {
        crate::source::drops::NetnsOptions {
            paths: self.netns.clone(),
            all: self.all_netns,
        }
    }
}

/// `100/s`, `100` (per second), `0`.
fn parse_rate(s: &str) -> Result<u32, String> {
    let n = s.trim().strip_suffix("/s").unwrap_or(s.trim());
    let v: u32 = n
        .parse()
        .map_err(|_| format!("`{s}` is not a rate; use e.g. 100/s, or 0 for counts only"))?;
    if v > 1_000_000 {
        return Err(format!(
            "{v}/s is more samples than anyone can read; use at most 1000000/s"
        ));
    }
    Ok(v)
}

#[derive(Debug, clap::Args)]
pub struct ProbesArgs {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub locks: LockArgs,
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("`{s}` is not a duration ({e}); use e.g. 500ms, 10s, 5m"))
}

fn parse_ring_mib(s: &str) -> Result<u32, String> {
    let v: u32 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of MiB"))?;
    if v == 0 || !v.is_power_of_two() || v > 1024 {
        return Err(format!(
            "ring buffer size must be a power of two from 1 to 1024 MiB, got {v}"
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_trace_flags() {
        let cli = Cli::try_parse_from([
            "xtlock",
            "trace",
            "--duration",
            "2s",
            "--min-hold",
            "10ms",
            "--json",
            "--lock-file",
            "/a",
            "--lock-file",
            "/b",
        ])
        .unwrap();
        let Command::Trace(t) = cli.command else {
            panic!()
        };
        assert_eq!(t.duration, Some(Duration::from_secs(2)));
        assert_eq!(t.min_hold, Duration::from_millis(10));
        assert!(t.json);
        assert_eq!(t.locks.lock_files.len(), 2);
    }

    #[test]
    fn bad_values_explain_themselves() {
        let e = Cli::try_parse_from(["xtlock", "trace", "--duration", "soon"]).unwrap_err();
        assert!(e.to_string().contains("not a duration"), "{e}");
        let e = Cli::try_parse_from(["xtlock", "trace", "--ring-buffer-mib", "3"]).unwrap_err();
        assert!(e.to_string().contains("power of two"), "{e}");
        let e = Cli::try_parse_from(["xtlock", "trace", "--drop-samples", "lots"]).unwrap_err();
        assert!(e.to_string().contains("not a rate"), "{e}");
        let e = Cli::try_parse_from(["xtlock", "trace", "--conntrack-warn", "150"]).unwrap_err();
        assert!(e.to_string().contains("150"), "{e}");
    }

    #[test]
    fn filter_flags() {
        let cli = Cli::try_parse_from([
            "xtlock",
            "report",
            "cap",
            "--agent",
            "kube-proxy",
            "--agent",
            "calico-node",
            "-n",
            "kube-system",
            "--pod",
            "coredns",
            "--lock-file",
            "/run/xtables.lock",
            "--since",
            "10:02:30",
            "--until",
            "+5m",
        ])
        .unwrap();
        let Command::Report(r) = cli.command else {
            panic!()
        };
        let f = r.filter.filter();
        assert_eq!(f.agents, ["kube-proxy", "calico-node"]);
        assert_eq!(f.namespaces, ["kube-system"]);
        assert_eq!(f.pods, ["coredns"]);
        assert_eq!(r.lock_files.len(), 1);
        assert!(r.since.is_some() && r.until.is_some());
        let Command::Trace(t) = Cli::try_parse_from(["xtlock", "trace", "--agent", "kube-proxy"])
            .unwrap()
            .command
        else {
            panic!()
        };
        assert!(!t.filter.filter().is_empty());
        let e = Cli::try_parse_from(["xtlock", "report", "cap", "--since", "soonish"]).unwrap_err();
        assert!(e.to_string().contains("is not a time"), "{e}");
    }

    /// `--service` on trace, report and export: `ns/name[:port]`, anything else refused
    /// with the form to use.
    #[test]
    fn service_flags() {
        for cmd in [
            vec!["xtlock", "trace"],
            vec!["xtlock", "report", "c.xtlock"],
            vec!["xtlock", "export", "c.xtlock", "-o", "t.json"],
        ] {
            let mut argv = cmd.clone();
            argv.extend([
                "--service",
                "default/web:http",
                "--service",
                "kube-system/dns",
            ]);
            let cli = Cli::try_parse_from(&argv).unwrap();
            let f = match cli.command {
                Command::Trace(t) => t.filter.filter(),
                Command::Report(r) => r.filter.filter(),
                Command::Export(e) => e.filter.filter(),
                _ => panic!(),
            };
            assert_eq!(f.services, ["default/web:http", "kube-system/dns"]);
        }
        for bad in ["web", "/web", "default/", "default/web:", "default/a b"] {
            let e = Cli::try_parse_from(["xtlock", "trace", "--service", bad])
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("NAMESPACE/NAME[:PORT]"), "{bad}: {e}");
        }
    }

    #[test]
    fn daemon_flags() {
        let cli = Cli::try_parse_from([
            "xtlock",
            "daemon",
            "--listen",
            "127.0.0.1:0",
            "--record-dir",
            "/tmp/x",
            "--record-keep",
            "3",
            "--record-max-bytes",
            "3MiB",
        ])
        .unwrap();
        let Command::Daemon(d) = cli.command else {
            panic!()
        };
        assert_eq!(d.record_keep, 3);
        assert_eq!(d.record_max_bytes, 3 << 20);
        let Command::Daemon(d) = Cli::try_parse_from(["xtlock", "daemon"]).unwrap().command else {
            panic!()
        };
        assert_eq!(d.listen.to_string(), "127.0.0.1:9655");
        let e = Cli::try_parse_from(["xtlock", "daemon", "--listen", "localhost:9655"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("is not an IP:PORT") && e.contains("0.0.0.0:9655"),
            "{e}"
        );
        assert!(Cli::try_parse_from(["xtlock", "daemon", "--record-keep", "3"]).is_err());
        assert_eq!(parse_bytes("1000000"), Ok(1_000_000));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("5 parsecs").is_err());
    }

    #[test]
    fn drop_flags() {
        use crate::probes::dropreason::ReasonSelection;
        let cli = Cli::try_parse_from([
            "xtlock",
            "trace",
            "--drop-samples",
            "20/s",
            "--drop-reasons",
            "NETFILTER_DROP,no_socket",
            "--netns",
            "/run/netns/a",
            "--netns",
            "/run/netns/b",
            "--conntrack-warn",
            "90",
        ])
        .unwrap();
        let Command::Trace(t) = cli.command else {
            panic!()
        };
        assert_eq!(t.drops.drop_samples, 20);
        assert_eq!(
            t.drops.drop_reasons,
            ReasonSelection::Names(vec!["NETFILTER_DROP".into(), "NO_SOCKET".into()])
        );
        assert_eq!(t.drops.netns.len(), 2);
        assert_eq!(t.drops.conntrack_warn, 90);
        assert!(t.drops.probe_options().is_some());
        let cli = Cli::try_parse_from(["xtlock", "trace", "--no-drops"]).unwrap();
        let Command::Trace(t) = cli.command else {
            panic!()
        };
        assert!(t.drops.probe_options().is_none());
        assert_eq!(t.drops.drop_samples, 100);
        assert_eq!(t.drops.drop_reasons, ReasonSelection::Default);
        assert!(Cli::try_parse_from(["xtlock", "trace", "--no-drops", "--all-netns"]).is_err());
    }
}
