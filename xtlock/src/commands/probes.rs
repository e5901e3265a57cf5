//! `xtlock probes`: which hooks attach on this kernel, which do not, and why.

use std::io::Write;

use anyhow::Context as _;

use crate::{cli::ProbesArgs, probes};

pub fn run(args: &ProbesArgs) -> anyhow::Result<()> {
    probes::preflight::check()?;
    let locks = super::resolve_locks(&args.locks)?;
    let p = probes::Probes::load(&probes::LoadOptions {
        locks: locks.clone(),
        ring_bytes: 1 << 20,
    })?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let v = serde_json::json!({
            "tracefs": p.tracefs,
            "locks": locks,
            "hooks": p.status,
        });
        writeln!(out, "{v}")?;
        return Ok(());
    }
    for l in &locks {
        writeln!(
            out,
            "watching {} (dev {}:{}, inode {})",
            l.path.display(),
            l.dev >> 20,
            l.dev & 0xfffff,
            l.ino
        )?;
    }
    writeln!(out, "tracefs at {}", p.tracefs.display())?;
    for s in &p.status {
        match &s.error {
            None => writeln!(
                out,
                "  attached      {:<22} {}: {}",
                s.program, s.attach, s.purpose
            )?,
            Some(why) => writeln!(
                out,
                "  NOT attached  {:<22} {}: {} (you lose: {})",
                s.program, s.attach, why, s.purpose
            )?,
        }
    }
    let missing = p.status.iter().filter(|s| !s.attached()).count();
    if missing == 0 {
        writeln!(out, "all {} hooks attached", p.status.len())?;
    } else {
        writeln!(
            out,
            "{missing} of {} hooks not attached; xtlock runs without them",
            p.status.len()
        )?;
    }
    out.flush().context("writing to stdout")?;
    Ok(())
}
