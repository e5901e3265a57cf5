//! The one start-up sequence of the live commands (`trace`, `record`, `daemon`): preflight,
//! the lock files, the probes loaded and attached, the source, its recording, and the events
//! to start the analysis from. In this order so that a wrong path fails before anything is
//! loaded, and an existing capture is replaced only once tracing has started.

use std::{path::Path, sync::Arc};

use crate::{
    cli::{DropArgs, LockArgs},
    commands::{live, resolve_locks},
    decode::Event,
    lockfiles::LockFile,
    probes::preflight,
    source::{
        live::LiveSource,
        recorder::{self, PendingCapture, Progress},
        rolling::Rolling,
    },
};

/// What a live command records into.
pub enum Recording<'a> {
    None,
    /// One capture file (`record -o`, `trace --record`), with the status line's counters.
    File(&'a Path, Arc<Progress>),
    /// The daemon's rolling files.
    Rolling(&'a mut Rolling),
}

/// A live source, started.
pub struct Session {
    pub locks: Vec<LockFile>,
    pub src: LiveSource,
    /// The processes alive and the locks already held when tracing began: feed them first.
    pub start: Vec<Event>,
    /// The drop-reason names of this kernel (the daemon writes them into each new file).
    pub drop_setup: Vec<Event>,
}

pub fn open(
    lock_args: &LockArgs,
    ring_mib: u32,
    drops: &DropArgs,
    recording: Recording<'_>,
) -> anyhow::Result<Session> {
    preflight::check()?;
    let locks = resolve_locks(lock_args)?;
    let pending = match &recording {
        Recording::File(path, _) => Some(PendingCapture::create(path)?),
        _ => None,
    };
    let probes = live::load(&locks, ring_mib, drops, lock_args)?;
    let mut src = LiveSource::new(probes)?;
    src.find_locks(&locks);
    let mut pending = match (pending, recording) {
        (Some((file, pending)), Recording::File(path, progress)) => {
            let r = recorder::start_capture(file, path, &locks, &src.probes.status, progress)?;
            src.set_recorder(r);
            Some(pending)
        }
        (_, Recording::Rolling(rolling)) => {
            rolling.start(&mut src, &locks);
            None
        }
        _ => None,
    };
    let (start, drop_setup) = live::begin(&mut src, &locks, drops, lock_args)?;
    if let Some(p) = pending.take() {
        p.commit()?;
    }
    Ok(Session {
        locks,
        src,
        start,
        drop_setup,
    })
}
