//! `xtlock daemon`: the probes and the pipeline of `trace`, with no terminal output; facts
//! become Prometheus metrics served over HTTP, and optionally a rolling set of capture files.

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    cli::DaemonArgs,
    commands::{
        live, record,
        session::{self, Recording, Session},
    },
    decode::Event,
    lockfiles::LockFile,
    pipeline::Pipeline,
    probes::HookStatus,
    serve::{self, State},
    sinks::metrics::{
        Capped, FeatureLabels, HoldLabels, Metrics, MetricsSink, PodLabels, ProbeLabels, MAX_PODS,
    },
    source::{live::LiveSource, recorder, rolling::Rolling},
};

/// The event loop must tick within this long, or `/readyz` says it is stuck.
const STALL: Duration = Duration::from_secs(5);

pub async fn run(args: &DaemonArgs) -> anyhow::Result<()> {
    let kernel = recorder::kernel_release();
    let metrics = Arc::new(Metrics::new(&kernel));
    let state = Arc::new(State::new(metrics.clone()));
    // Listen before loading the probes: a taken port fails fast, and /healthz answers while
    // the programs load.
    let addr = serve::start(args.listen, state.clone()).await?;
    tracing::info!(%addr, "serving /metrics /healthz /readyz");

    let mut rolling = match &args.record_dir {
        Some(dir) => Some(Rolling::new(
            dir,
            usize::try_from(args.record_keep).unwrap_or(usize::MAX),
            args.record_max_bytes,
            args.record_period,
        )?),
        None => None,
    };
    let recording = match rolling.as_mut() {
        Some(r) => Recording::Rolling(r),
        None => Recording::None,
    };
    let Session {
        mut locks,
        mut src,
        start,
        drop_setup,
    } = session::open(&args.locks, args.ring_buffer_mib, &args.drops, recording)?;
    let links = links::Watch::new(&src.probes.status);

    let host_netns = netns_inode(Path::new("/proc/self/ns/net"));
    let sink = MetricsSink::new(metrics.clone(), host_netns);
    let mut pipe = Pipeline::new(live::watched(&locks), vec![Box::new(sink)]);
    pipe.analyzer_mut()
        .set_conntrack_warn_pct(args.drops.conntrack_warn);
    for ev in &start {
        pipe.feed(ev)?;
    }
    for f in live::announce(&locks, &src, " as a daemon") {
        metrics
            .feature_enabled
            .get_or_create(&FeatureLabels {
                feature: f.feature.to_owned(),
                cause: f.off.as_ref().map_or("", |(c, _)| c.label()).to_owned(),
            })
            .set(i64::from(f.on()));
    }

    let mut hooks = DaemonHooks {
        metrics: metrics.clone(),
        state: state.clone(),
        links,
        rolling,
        drop_setup,
        seeded: pipe.events(),
        counted: pipe.events(),
        last_tick: Instant::now(),
        pods: Capped::new(MAX_PODS),
        recording_errors: 0,
    };
    if let Some(r) = hooks.rolling.as_ref() {
        metrics.recording_up.set(i64::from(r.up()));
    }
    let summary = live::run(
        &mut src,
        &mut pipe,
        &mut locks,
        args.duration,
        None,
        &mut hooks,
    )
    .await?;
    // SIGTERM: detach, complete the capture, exit 0 within the kubelet's grace period.
    match hooks.rolling {
        Some(r) if src.recording() => record::finish_capture(src, &r.current, &summary)?,
        _ => drop(src),
    }
    tracing::info!("stopped");
    Ok(())
}

/// What the daemon adds to the live loop: metrics of open holds and event counts, rotation
/// of the rolling capture, and readiness.
struct DaemonHooks {
    metrics: Arc<Metrics>,
    state: Arc<State>,
    links: links::Watch,
    rolling: Option<Rolling>,
    drop_setup: Vec<Event>,
    /// Events fed before the loop (the process snapshot): not proof that probes work.
    seeded: u64,
    counted: u64,
    last_tick: Instant,
    /// Pod label values of `lock_holder_info`, capped like the sink's.
    pods: Capped,
    /// Recording errors already counted in the metric.
    recording_errors: u64,
}

impl live::LiveHooks for DaemonHooks {
    fn after_batch(&mut self, pipe: &mut Pipeline) -> anyhow::Result<()> {
        publish_open_holds(pipe, &self.metrics, &mut self.pods);
        Ok(())
    }

    fn each_second(
        &mut self,
        src: &mut LiveSource,
        pipe: &mut Pipeline,
        locks: &[LockFile],
    ) -> anyhow::Result<()> {
        publish_open_holds(pipe, &self.metrics, &mut self.pods);
        self.metrics.events.inc_by(pipe.events() - self.counted);
        self.counted = pipe.events();
        if let Some(r) = self.rolling.as_mut() {
            r.tick(src, locks, &self.drop_setup);
            self.metrics.recording_up.set(i64::from(r.up()));
            let errors = r.errors();
            self.metrics
                .recording_errors
                .inc_by(errors.saturating_sub(self.recording_errors));
            self.recording_errors = errors;
        }
        let now = Instant::now();
        let stalled = now.duration_since(self.last_tick) > STALL;
        self.last_tick = now;
        let why = readiness(
            &mut self.links,
            &self.metrics,
            pipe.events() - self.seeded,
            stalled,
        )
        .or_else(|| self.rolling.as_ref().and_then(Rolling::trouble));
        if why != self.state.not_ready() {
            match &why {
                Some(w) => tracing::warn!(why = %w, "not ready"),
                None => tracing::info!("ready"),
            }
        }
        self.state.set_not_ready(why);
        Ok(())
    }

    fn stopping(&mut self) {
        self.state.set_not_ready(Some("shutting down".into()));
    }
}

/// `None` when ready; otherwise why not.
fn readiness(
    links: &mut links::Watch,
    metrics: &Metrics,
    kernel_events: u64,
    stalled: bool,
) -> Option<String> {
    let detached = links.check();
    if let Some(e) = links.fd_shortage() {
        return Some(format!(
            "out of file descriptors ({e}; soft limit {}): the hooks cannot be checked; \
             raise the limit (ulimit -n, LimitNOFILE=)",
            crate::serve::fd_limit().map_or_else(|| "unknown".into(), |n| n.to_string())
        ));
    }
    for (program, up) in links.states() {
        metrics
            .probe_attached
            .get_or_create(&ProbeLabels {
                program: program.to_owned(),
            })
            .set(i64::from(up));
    }
    if !detached.is_empty() {
        return Some(format!(
            "probe(s) detached behind xtlock's back: {}",
            detached.join(", ")
        ));
    }
    if stalled {
        return Some("the event loop stalled (no tick for 5 s)".into());
    }
    if kernel_events == 0 {
        return Some("no event from the kernel yet".into());
    }
    None
}

fn publish_open_holds(pipe: &Pipeline, metrics: &Metrics, pods: &mut Capped) {
    let a = pipe.analyzer();
    let locks = a.locks();
    metrics.set_open_holds(
        locks.iter().map(|l| l.path.as_str()),
        a.open_holders().map(|(lock, _, who)| HoldLabels {
            lock: lock.to_owned(),
            agent: who.agent.to_string(),
            role: who.role.to_owned(),
            pod: PodLabels::of(pods, who.pod.as_deref()),
        }),
    );
}

fn netns_inode(p: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p)
        .ok()
        .and_then(|m| u32::try_from(m.ino()).ok())
}

/// Are the daemon's BPF links still attached? Each attached hook is a perf-event link owned
/// by this process (`/proc/self/fdinfo` shows `link_type: perf` and `tp_name`). Tracepoint
/// links cannot be detached with `BPF_LINK_DETACH` (`bpftool link detach` says "Operation not
/// supported" on 6.x), but one can vanish behind our back, e.g. its fd closed from outside
/// with a debugger: then the link is released and the hook is dead.
mod links {
    use super::HookStatus;

    pub struct Watch {
        /// (program, tracepoint name) of each tracepoint hook attached at start (function hooks
        /// leave no tracepoint name in fdinfo to find them again by).
        hooks: Vec<(&'static str, String)>,
        up: Vec<bool>,
        fd_shortage: Option<String>,
    }

    impl Watch {
        pub fn new(status: &[HookStatus]) -> Self {
            let hooks: Vec<(&'static str, String)> = status
                .iter()
                .filter(|s| s.attached())
                .filter_map(|s| Some((s.program, tracepoint_of(&s.attach)?.to_owned())))
                .collect();
            let up = vec![true; hooks.len()];
            Self {
                hooks,
                up,
                fd_shortage: None,
            }
        }

        /// Re-reads the links; returns the programs no longer attached.
        pub fn check(&mut self) -> Vec<&'static str> {
            self.fd_shortage = None;
            match attached_tracepoints() {
                Ok(live) => {
                    for ((_, tp), up) in self.hooks.iter().zip(self.up.iter_mut()) {
                        *up = live.iter().any(|n| n == tp);
                    }
                }
                // Keep the last answer: /proc being unreadable says nothing about the links.
                Err(e) => {
                    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                        self.fd_shortage = Some(e.to_string());
                    }
                    tracing::debug!(error = %e, "cannot read /proc/self/fdinfo");
                }
            }
            self.states()
                .filter(|(_, up)| !up)
                .map(|(p, _)| p)
                .collect()
        }

        /// Why the last check could not read the links for want of file descriptors.
        pub fn fd_shortage(&self) -> Option<&str> {
            self.fd_shortage.as_deref()
        }

        pub fn states(&self) -> impl Iterator<Item = (&'static str, bool)> + '_ {
            self.hooks.iter().map(|h| h.0).zip(self.up.iter().copied())
        }
    }

    /// The tracepoint's name in a hook's `attach`: `tracepoint category:name` or `tp_btf
    /// category:name`, then maybe a note that may hold colons (which program, why not
    /// tp_btf). `None` for a function hook (fentry, kprobe): its link has no tracepoint
    /// name to find again in fdinfo, and is not watched.
    pub fn tracepoint_of(attach: &str) -> Option<&str> {
        let mut words = attach.split_whitespace();
        if !matches!(words.next(), Some("tracepoint" | "tp_btf")) {
            return None;
        }
        words.next().and_then(|t| t.rsplit(':').next())
    }

    /// Tracepoint names of this process's perf-event BPF links.
    fn attached_tracepoints() -> std::io::Result<Vec<String>> {
        let mut v = Vec::new();
        for e in std::fs::read_dir("/proc/self/fdinfo")? {
            let text = match std::fs::read_to_string(e?.path()) {
                Ok(t) => t,
                // An fd closed since the listing.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                // Anything else (EMFILE at the fd limit) says nothing about that link: the
                // whole answer is unknown, not "detached".
                Err(e) => return Err(e),
            };
            if let Some(tp) = link_tracepoint(&text) {
                v.push(tp.to_owned());
            }
        }
        Ok(v)
    }

    /// `tp_name` of a tracepoint link's fdinfo (a perf link, or a raw tracepoint's).
    pub fn link_tracepoint(fdinfo: &str) -> Option<&str> {
        let mut perf = false;
        let mut tp = None;
        for line in fdinfo.lines() {
            let (k, v) = line.split_once(':')?;
            match k {
                "link_type" => perf = matches!(v.trim(), "perf" | "raw_tracepoint"),
                "tp_name" => tp = Some(v.trim()),
                _ => {}
            }
        }
        tp.filter(|_| perf)
    }
}

#[cfg(test)]
mod tests {
    /// A hook's tracepoint is read from its attach text, whatever note follows it.
    #[test]
    fn the_tracepoint_of_an_attach_text() {
        use super::links::tracepoint_of;
        for (attach, want) in [
            ("tracepoint syscalls:sys_enter_sendmsg", "sys_enter_sendmsg"),
            (
                "tracepoint syscalls:sys_enter_sendmsg (program sys_enter_sendmsg_loop)",
                "sys_enter_sendmsg",
            ),
            (
                "tracepoint lock:contention_begin (fallback; tp_btf: ruled out: x)",
                "contention_begin",
            ),
            ("tp_btf skb:kfree_skb", "kfree_skb"),
        ] {
            assert_eq!(tracepoint_of(attach), Some(want), "{attach}");
        }
        // Function hooks are not tracepoint links: not watched (they would always look
        // detached).
        for attach in [
            "fentry/fexit __x64_sys_sendmsg",
            "kprobe/kretprobe nfnetlink_rcv_batch (fallback; fentry: x)",
        ] {
            assert_eq!(tracepoint_of(attach), None, "{attach}");
        }
    }

    use super::*;

    #[test]
    fn fdinfo_of_a_perf_link() {
        let t = "pos:\t0\nflags:\t02000000\nmnt_id:\t17\nino:\t1038\nlink_type:\tperf\n\
                 link_id:\t2070\nprog_tag:\ta008d8c614118a60\nprog_id:\t2986\n\
                 tp_name:\tflock_lock_inode\nevent_type:\ttracepoint\ncookie:\t0\n";
        assert_eq!(links::link_tracepoint(t), Some("flock_lock_inode"));
        assert_eq!(links::link_tracepoint("pos:\t0\nflags:\t0\n"), None);
        // The lock hook's tp_btf link.
        let t = "pos:\t0\nflags:\t02000000\nlink_type:\traw_tracepoint\nlink_id:\t7\n\
                 prog_tag:\tb1e6d8c614118a61\nprog_id:\t31\ntp_name:\tflock_lock_inode\n";
        assert_eq!(links::link_tracepoint(t), Some("flock_lock_inode"));
        let t = "link_type:\tcgroup\nprog_id:\t31\n";
        assert_eq!(links::link_tracepoint(t), None);
    }
}
