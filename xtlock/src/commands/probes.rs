//! `xtlock probes`: which hooks attach on this kernel, which do not, and why.

use std::io::Write;

use anyhow::Context as _;

use crate::{cli::ProbesArgs, probes};

pub fn run(args: &ProbesArgs) -> anyhow::Result<()> {
    probes::preflight::check()?;
    let locks = super::resolve_locks(&args.locks)?;
    let p = probes::Probes::load_with_drops(
        &probes::LoadOptions {
            locks: locks.clone(),
            ring_bytes: 1 << 20,
            no_attach: args.locks.attach_filter()?,
            floor: None,
            memory_barriers: args.locks.memory_barriers,
        },
        Some(&probes::DropOptions::default()),
    )?;
    let conntrack = std::path::Path::new("/proc/net/stat/nf_conntrack").exists();
    let mut features = p.features.clone();
    features.push(probes::Feature {
        name: "conntrack statistics",
        available: conntrack,
        detail: if conntrack {
            "/proc/net/stat/nf_conntrack: table-full and insert-race drops are told apart from \
             rule drops"
                .into()
        } else {
            "/proc/net/stat/nf_conntrack is missing (nf_conntrack not loaded): netfilter drops \
             are all reported as rule drops until it loads"
                .into()
        },
    });
    // What the userspace readers may do with this process's privileges.
    for f in crate::source::access::check() {
        features.push(probes::Feature {
            name: f.feature,
            available: f.on(),
            detail: match &f.off {
                None => format!("{} (needs {})", f.gives, f.needs),
                Some((_, why)) => format!("{why}; lost: {}", f.gives),
            },
        });
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let v = serde_json::json!({
            "tracefs": p.tracefs,
            "locks": locks,
            "hooks": p.status,
            "features": features,
            // Kernel numbering, which changes between kernels.
            "drop_reasons": p.reasons.names,
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
            None if s.needless => writeln!(
                out,
                "  not needed    {:<22} {}: {}",
                s.program, s.attach, s.purpose
            )?,
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
    for f in &features {
        writeln!(
            out,
            "  {:<13} {:<22} {}",
            if f.available {
                "available"
            } else {
                "UNAVAILABLE"
            },
            f.name,
            f.detail
        )?;
    }
    let missing = p.status.iter().filter(|s| s.missing()).count();
    let needless = p.status.iter().filter(|s| s.needless).count();
    if missing == 0 && needless == 0 {
        writeln!(out, "all {} hooks attached", p.status.len())?;
    } else if missing == 0 {
        writeln!(
            out,
            "all {} hooks attached, {needless} more not needed on this kernel",
            p.status.len() - needless
        )?;
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
