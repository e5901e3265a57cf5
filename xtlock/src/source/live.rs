//! The live source: decoded events from the kernel ring buffer, with the kernel's count of
//! lost events and /proc details for new programs.

use std::path::Path;

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;

use crate::{
    decode::{self, Event},
    probes::{ProbeError, Probes},
};

/// Most records read per wake-up, so timers and signals are served during a storm.
const BATCH: usize = 4096;

pub struct LiveSource {
    pub probes: Probes,
    ring: AsyncFd<RingBuf<MapData>>,
    lost_reported: u64,
    decode_errors: u64,
    /// Drop counters and conntrack statistics, once [`LiveSource::start_drops`] ran.
    drops: Option<super::drops::DropPoller>,
}

impl LiveSource {
    pub fn new(mut probes: Probes) -> Result<Self, ProbeError> {
        let ring = probes.take_ring()?;
        // SAFETY: the RingBuf owns its map fd and keeps it open, unchanged, until dropped,
        // and it is only dropped with this AsyncFd.
        let ring = unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) }
            .map_err(|e| ProbeError::Io {
                what: "registering the ring buffer with the event loop".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
        Ok(Self {
            probes,
            ring,
            lost_reported: 0,
            decode_errors: 0,
            drops: None,
        })
    }

    /// Starts reading the kernel's drop counters (when the drop hook is attached) and the
    /// conntrack statistics of the host and of `netns`; returns the events to begin with.
    pub fn start_drops(
        &mut self,
        netns: super::drops::NetnsOptions,
    ) -> Result<Vec<Event>, super::drops::DropSourceError> {
        let now = super::monotonic_ns();
        let poller = super::drops::DropPoller::new(netns, self.probes.drops_attached(), now)?;
        let events = poller.start_events(&self.probes, now);
        self.drops = Some(poller);
        Ok(events)
    }

    /// Once a second: conntrack deltas, names of new drop locations, drop counts.
    pub fn poll_drops(&mut self) -> Vec<Event> {
        let Some(poller) = self.drops.as_mut() else {
            return Vec::new();
        };
        poller.poll(&self.probes, super::monotonic_ns())
    }

    /// The processes that exist now, as events: the analysis starts from them.
    pub fn seed(&self) -> Vec<Event> {
        let now = super::monotonic_ns();
        super::procfs::snapshot(Path::new("/proc"), now)
            .into_iter()
            .map(Event::Proc)
            .collect()
    }

    /// Waits for events and appends up to one batch of them to `out`.
    pub async fn next_batch(&mut self, out: &mut Vec<Event>) -> std::io::Result<()> {
        let mut guard = self.ring.readable_mut().await?;
        let ring = guard.get_inner_mut();
        let mut n = 0;
        while n < BATCH {
            let Some(item) = ring.next() else { break };
            n += 1;
            match decode::decode(&item) {
                Ok(ev) => {
                    let exec = match &ev {
                        Event::Exec(x) => Some((x.tgid, x.ts_ns)),
                        _ => None,
                    };
                    out.push(ev);
                    // Right behind its exec, before any exit of the same process: the
                    // cgroup of a new program. A container's process is moved to its cgroup
                    // by the runtime after fork, so the parent's would name the runtime.
                    if let Some((pid, ts)) = exec {
                        if let Some(info) = exec_cgroup(pid, ts) {
                            out.push(Event::Proc(info));
                        }
                    }
                }
                Err(e) => {
                    self.decode_errors += 1;
                    if self.decode_errors == 1 {
                        tracing::warn!(error = %e, "undecodable event from the kernel (further ones counted silently)");
                    }
                }
            }
        }
        if n < BATCH {
            guard.clear_ready();
        }
        Ok(())
    }

    /// Drains whatever is queued now without waiting (used at exit).
    pub fn drain(&mut self, out: &mut Vec<Event>) {
        let ring = self.ring.get_mut();
        while let Some(item) = ring.next() {
            if let Ok(ev) = decode::decode(&item) {
                out.push(ev);
            }
        }
    }

    /// A `Lost` event when the kernel dropped events since the last call.
    pub fn poll_lost(&mut self) -> Option<Event> {
        let total = match self.probes.lost_events() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the lost-event counter");
                return None;
            }
        };
        let delta = total.saturating_sub(self.lost_reported);
        self.lost_reported = total;
        (delta > 0).then(|| Event::Lost {
            ts_ns: super::monotonic_ns(),
            count: delta,
        })
    }

    pub fn decode_errors(&self) -> u64 {
        self.decode_errors
    }
}

/// The cgroup of a process that just exec'd, as a partial `ProcInfo` (only `cgroup` set).
fn exec_cgroup(pid: u32, ts_ns: u64) -> Option<decode::ProcInfo> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    Some(decode::ProcInfo {
        ts_ns,
        pid,
        cgroup: Some(super::procfs::parse_cgroup(&text)?),
        ..Default::default()
    })
}
