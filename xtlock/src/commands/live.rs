//! The live loop that `trace`, `record` and `daemon` share: ring buffer batches through the
//! pipeline, the once-a-second chores (lost events, drop and conntrack counters, recorder
//! flush, replaced lock files), Ctrl-C, SIGTERM and `--duration`, and the final drain. Each
//! command adds only what is its own, through [`LiveHooks`].

use std::time::Duration;

use anyhow::Context as _;
use tokio::{
    signal::unix::{signal, SignalKind},
    time::{interval, MissedTickBehavior},
};

use crate::{
    analysis::{Summary, WatchedLock},
    cli::{DropArgs, LockArgs},
    commands::watch_replaced_locks,
    decode::Event,
    lockfiles::LockFile,
    pipeline::Pipeline,
    probes::{LoadOptions, Probes},
    source::{
        self,
        access::{Cause, FeatureState},
        live::{self, LiveSource},
    },
};

/// The analysis' view of the lock files.
pub fn watched(locks: &[LockFile]) -> Vec<WatchedLock> {
    locks
        .iter()
        .map(|l| WatchedLock::new(l.path.display().to_string(), l.dev, l.ino))
        .collect()
}

/// What a command adds to the shared loop.
pub trait LiveHooks {
    /// After each batch of events went through the pipeline.
    fn after_batch(&mut self, _pipe: &mut Pipeline) -> anyhow::Result<()> {
        Ok(())
    }

    /// Once a second, after the source's own chores.
    fn each_second(
        &mut self,
        _src: &mut LiveSource,
        _pipe: &mut Pipeline,
        _locks: &[LockFile],
    ) -> anyhow::Result<()> {
        Ok(())
    }

    /// Checked once a second: end the run now (as a signal would).
    fn should_stop(&self, _src: &LiveSource) -> bool {
        false
    }

    /// The loop is stopping (signal or deadline); the final drain follows.
    fn stopping(&mut self) {}
}

/// A command with nothing of its own to add.
pub struct NoHooks;

impl LiveHooks for NoHooks {}

/// Loads and attaches the probes for these lock files, with the drop and attach options.
pub fn load(
    locks: &[LockFile],
    ring_mib: u32,
    drops: &DropArgs,
    lock_args: &LockArgs,
) -> anyhow::Result<Probes> {
    let opts = LoadOptions {
        locks: locks.to_vec(),
        ring_bytes: ring_mib << 20,
        no_attach: lock_args.attach_filter()?,
        floor: if lock_args.bench_floor_record {
            Some(crate::probes::Floor::Record)
        } else if lock_args.bench_floor_drops {
            Some(crate::probes::Floor::Drops)
        } else if lock_args.bench_floor_syscalls {
            Some(crate::probes::Floor::Syscalls)
        } else {
            lock_args.bench_floor.then_some(crate::probes::Floor::Empty)
        },
        memory_barriers: lock_args.memory_barriers,
    };
    Ok(Probes::load_with_drops(
        &opts,
        drops.probe_options().as_ref(),
    )?)
}

/// The events to begin with, in the order they are recorded: the process snapshot and the
/// holds already in place on `locks`, then the drop setup (reason names, symbols). Returns
/// them all, and the drop setup alone.
pub fn begin(
    src: &mut LiveSource,
    locks: &[LockFile],
    drops: &DropArgs,
    lock_args: &LockArgs,
) -> anyhow::Result<(Vec<Event>, Vec<Event>)> {
    let keys: Vec<(u32, u64)> = locks.iter().map(|l| (l.dev, l.ino)).collect();
    src.name_pods(&super::host_root(lock_args));
    if !lock_args.no_rule_reads {
        src.read_rules();
    }
    // On by default (no flag: it costs one socket and a thread, and reads no packets).
    src.watch_addrs();
    let mut start = src.seed(&keys);
    let mut drop_setup = Vec::new();
    if !drops.no_drops {
        drop_setup = src.start_drops(drops.netns_options())?;
        start.extend(drop_setup.iter().cloned());
    }
    Ok((start, drop_setup))
}

/// Says what is being traced and how many hooks attached.
/// Says what is traced and which features this process's privileges allow; returns those.
pub fn announce(locks: &[LockFile], src: &LiveSource, what: &str) -> Vec<FeatureState> {
    let names: Vec<String> = locks.iter().map(|l| l.path.display().to_string()).collect();
    let status = &src.probes.status;
    let attached = status.iter().filter(|s| s.attached()).count();
    // Hooks another one stands in for count neither way.
    let needless = status.iter().filter(|s| s.needless).count();
    // Tried before the line tools wait for ("hooks attached)"): a Ctrl-C sent right after
    // it must find the signal handlers installed, not this check running.
    let features = crate::source::access::check();
    // Said first: tools wait for the line's "hooks attached)".
    let also = if needless > 0 {
        format!("{needless} not needed, ")
    } else {
        String::new()
    };
    tracing::info!(
        "tracing {} ({also}{attached}/{} hooks attached){what}",
        names.join(", "),
        status.len() - needless,
    );
    say_features(&features);
    features
}

/// One line for the features on, one per feature off: a missing privilege as a warning (the
/// deployment took it away), a kernel without it as information.
pub fn say_features(features: &[FeatureState]) {
    let on: Vec<&str> = features
        .iter()
        .filter(|f| f.on())
        .map(|f| f.feature)
        .collect();
    tracing::info!("features on: {}", on.join(", "));
    for f in features {
        match &f.off {
            Some((Cause::Privilege, why)) => tracing::warn!(
                feature = f.feature,
                "feature {} off: {why}; lost: {}",
                f.feature,
                f.gives
            ),
            Some((Cause::Kernel, why)) => {
                tracing::info!(feature = f.feature, "feature {} off: {why}", f.feature)
            }
            None => {}
        }
    }
}

/// Watches the lock files of other mount namespaces the source found (node containers,
/// containers with a `/run` of their own), with the holds already in place on them. The
/// kernel side watches `MAX_WATCHED_LOCKS` in all; past it, said and left out.
fn watch_found_locks(
    src: &mut LiveSource,
    pipe: &mut Pipeline,
    locks: &mut Vec<LockFile>,
) -> anyhow::Result<()> {
    for f in src.found_locks() {
        if locks.len() >= xtlock_common::MAX_WATCHED_LOCKS as usize {
            tracing::warn!(lock = %f.describe(), "not watched: xtlock watches {} lock files at most", xtlock_common::MAX_WATCHED_LOCKS);
            continue;
        }
        let index = locks.len() as u32;
        match src.probes.watch(&f.lock, index) {
            Ok(()) => {
                tracing::info!(
                    pid = f.pid,
                    "watching {}, found through process {}: its holds and waits are on \
                     dev {}:{} ino {}",
                    f.describe(),
                    f.pid,
                    f.lock.dev >> 20,
                    f.lock.dev & 0xf_ffff,
                    f.lock.ino
                );
                locks.push(f.lock.clone());
                for ev in src.seed_lock(&f.lock) {
                    pipe.feed(&ev)?;
                }
            }
            Err(e) => {
                tracing::warn!(lock = %f.describe(), error = %e, "cannot watch a lock file of another mount namespace")
            }
        }
    }
    Ok(())
}

/// Runs until Ctrl-C, SIGTERM or `duration`; then drains what is queued and finishes the
/// pipeline. `summary_every`: periodic summaries (None: only the final one).
pub async fn run(
    src: &mut LiveSource,
    pipe: &mut Pipeline,
    locks: &mut Vec<LockFile>,
    duration: Option<Duration>,
    summary_every: Option<Duration>,
    hooks: &mut impl LiveHooks,
) -> anyhow::Result<Summary> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    // Far enough to never come, near enough not to overflow the timer.
    let never = Duration::from_secs(100 * 365 * 86_400);
    let deadline = tokio::time::sleep(duration.unwrap_or(never));
    tokio::pin!(deadline);
    let mut each_second = interval(Duration::from_secs(1));
    each_second.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut summaries = interval(summary_every.unwrap_or(never));
    summaries.set_missed_tick_behavior(MissedTickBehavior::Delay);
    summaries.tick().await;
    // The probes wake us only when a quarter of the ring is waiting (a wakeup per event
    // costs an interrupt, a VM exit on virtual machines); the rest is read on this tick.
    let mut poll = interval(Duration::from_millis(50));
    poll.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut ticks = 0u64;
    let mut batch = Vec::with_capacity(4096);

    loop {
        tokio::select! {
            r = src.next_batch(&mut batch) => {
                r.context("reading the ring buffer")?;
                for ev in batch.drain(..) {
                    pipe.feed(&ev)?;
                }
                watch_found_locks(src, pipe, locks)?;
                pipe.flush()?;
                hooks.after_batch(pipe)?;
            }
            _ = poll.tick() => {
                src.drain(&mut batch, live::BATCH);
                for ev in batch.drain(..) {
                    pipe.feed(&ev)?;
                }
                watch_found_locks(src, pipe, locks)?;
                pipe.flush()?;
                hooks.after_batch(pipe)?;
            }
            _ = each_second.tick() => {
                if let Some(lost) = src.poll_lost() {
                    pipe.feed(&lost)?;
                }
                for ev in src.poll_drops() {
                    pipe.feed(&ev)?;
                }
                // Crash safety of a recording: a block at least every second.
                src.flush_recorder();
                ticks += 1;
                if ticks.is_multiple_of(5) {
                    watch_replaced_locks(locks, &mut src.probes);
                    for s in src.probes.attach_pending() {
                        match &s.error {
                            None => tracing::info!(hook = s.program, attach = %s.attach, "module loaded: hook attached"),
                            Some(why) => tracing::warn!(hook = s.program, %why, "module loaded, but the hook did not attach"),
                        }
                    }
                }
                hooks.each_second(src, pipe, locks)?;
                if hooks.should_stop(src) {
                    break;
                }
            }
            _ = summaries.tick() => pipe.periodic_summary()?,
            _ = &mut deadline => break,
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
        }
    }

    hooks.stopping();
    // Only what is already queued, and a bounded amount of it: SIGTERM ends within the
    // grace period even during a storm.
    src.drain(&mut batch, 256 * live::BATCH);
    for ev in batch.drain(..) {
        pipe.feed(&ev)?;
    }
    if let Some(lost) = src.poll_lost() {
        pipe.feed(&lost)?;
    }
    // The last drop counts first: the rule counters they ask for are read below.
    for ev in src.poll_drops() {
        pipe.feed(&ev)?;
    }
    // The tables the last writes asked for (a read takes milliseconds).
    src.finish_rules(&mut batch, Duration::from_millis(500));
    for ev in batch.drain(..) {
        pipe.feed(&ev)?;
    }
    let summary = pipe.finish(source::monotonic_ns())?;
    if src.decode_errors() > 0 {
        tracing::warn!(
            count = src.decode_errors(),
            "events from the kernel could not be decoded"
        );
    }
    Ok(summary)
}
