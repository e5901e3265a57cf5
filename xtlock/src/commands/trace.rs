//! `xtlock trace` (temporary raw form).
use crate::{cli::TraceArgs, lockfiles, probes, source::live::LiveSource};

pub async fn run(args: &TraceArgs) -> anyhow::Result<()> {
    let paths = lockfiles::requested_paths(
        &args.locks.lock_files,
        std::env::var("XTABLES_LOCKFILE").ok().as_deref(),
    );
    let locks = lockfiles::resolve_all(&paths)?;
    let p = probes::Probes::load(&probes::LoadOptions {
        locks,
        ring_bytes: args.ring_buffer_mib << 20,
    })?;
    let mut src = LiveSource::new(p)?;
    let mut buf = Vec::new();
    let deadline = tokio::time::sleep(
        args.duration
            .unwrap_or(std::time::Duration::from_secs(3600)),
    );
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            r = src.next_batch(&mut buf) => { r?; }
            _ = &mut deadline => break,
            _ = tokio::signal::ctrl_c() => break,
        }
        for e in buf.drain(..) {
            println!("{e:?}");
        }
    }
    Ok(())
}
