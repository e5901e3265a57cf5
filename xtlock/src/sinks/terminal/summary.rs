//! The summary: tables of holds, waits, contention, drops and IPVS, every 10 s and at exit.

use std::io::{self, Write};

use super::safe::{say, SafeLines};

use super::lines::hold_drops_text;
use super::{human_bytes, human_ns};
use crate::analysis::Summary;
use crate::capture::thousands;
use crate::sinks::FilterNote;

/// The summary, section by section: the calls' order is the output's.
pub(crate) fn write_summary(
    w: &mut SafeLines<impl Write>,
    s: &Summary,
    final_: bool,
    filter: Option<&FilterNote>,
) -> io::Result<()> {
    write_header(w, s, final_, filter)?;
    write_duration_tables(w, s)?;
    write_contention(w, s)?;
    write_agent_counts(w, s)?;
    write_table_replaces(w, s)?;
    write_nft_commits(w, s)?;
    write_rule_writes(w, s)?;
    write_rule_conflicts(w, s)?;
    write_activity_notes(w, s)?;
    write_drops(w, s)?;
    write_rule_drops(w, s)?;
    write_refusals(w, s)?;
    write_services(w, s)?;
    write_syncs(w, s)?;
    write_ipvs(w, s)?;
    write_bounds(w, s)
}

/// The title line, the filter note, and one line per lock.
fn write_header(
    w: &mut SafeLines<impl Write>,
    s: &Summary,
    final_: bool,
    filter: Option<&FilterNote>,
) -> io::Result<()> {
    w.blank()?;
    say!(
        w,
        "== {} ({} traced, {} events) ==",
        if final_ { "summary" } else { "summary so far" },
        human_ns(s.duration_ns),
        s.events
    )?;
    // The tables below stay whole (who waited behind whom needs both sides); the filter
    // chose only the lines above.
    if let Some(f) = filter {
        say!(w, "filtered: {}; the tables cover everything", f.describe())?;
    }
    for l in &s.locks {
        // A lock file has a device and inode; the nf_tables commit lock has neither.
        let file = if l.dev == 0 && l.ino == 0 {
            String::new()
        } else {
            format!(" (dev {}:{} ino {})", l.dev >> 20, l.dev & 0xf_ffff, l.ino)
        };
        say!(
            w,
            "lock {}{file}: {} holds, {} held in all, longest {}; {} waits",
            l.path,
            l.holds,
            human_ns(l.held_ns),
            human_ns(l.max_hold_ns),
            l.waits
        )?;
    }
    Ok(())
}

/// Hold and wait durations per agent: count, p50, p99, max, total.
fn write_duration_tables(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    for (title, table) in [("holds by agent", &s.holds), ("waits by agent", &s.waits)] {
        if table.is_empty() {
            continue;
        }
        w.blank()?;
        say!(w, "{title}:")?;
        let width = table
            .keys()
            .map(|k| k.chars().count())
            .max()
            .unwrap_or(0)
            .max(5);
        say!(
            w,
            "  {:<width$} {:>7} {:>9} {:>9} {:>9} {:>9}",
            "agent",
            "count",
            "p50",
            "p99",
            "max",
            "total"
        )?;
        for (agent, d) in table {
            say!(
                w,
                "  {:<width$} {:>7} {:>9} {:>9} {:>9} {:>9}",
                agent,
                d.count,
                human_ns(d.p50_ns),
                human_ns(d.p99_ns),
                human_ns(d.max_ns),
                human_ns(d.total_ns)
            )?;
        }
    }
    Ok(())
}

/// Who waited behind whom.
fn write_contention(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if !s.contention.is_empty() {
        w.blank()?;
        say!(w, "who waited behind whom:")?;
        let pairs: Vec<String> = s
            .contention
            .iter()
            .map(|c| format!("{} <- {}", c.waiter, c.holder))
            .collect();
        let width = pairs
            .iter()
            .map(|p| p.chars().count())
            .max()
            .unwrap_or(0)
            .max(15);
        say!(
            w,
            "  {:<width$} {:>7} {:>9} {:>9}",
            "waiter <- holder",
            "waits",
            "total",
            "max"
        )?;
        for (c, pair) in s.contention.iter().zip(&pairs) {
            say!(
                w,
                "  {:<width$} {:>7} {:>9} {:>9}",
                pair,
                c.count,
                human_ns(c.total_wait_ns),
                human_ns(c.max_wait_ns)
            )?;
        }
    }
    Ok(())
}

/// Per-agent counts on one line each: failed tries, timeouts, exit 4s, execs.
fn write_agent_counts(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    for (title, m) in [
        ("failed tries", &s.failed_tries),
        ("lock timeouts (exit 4)", &s.timeouts),
        ("exit 4 without lock trouble", &s.exit4_without_lock),
        ("iptables execs", &s.execs),
    ] {
        if m.is_empty() {
            continue;
        }
        let list: Vec<String> = m.iter().map(|(a, n)| format!("{a} {n}")).collect();
        say!(w, "{title}: {}", list.join(", "))?;
    }
    Ok(())
}

/// Table replaces per agent: the largest table and where the hold time went.
fn write_table_replaces(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if !s.tables.is_empty() {
        // Why holds took long: big tables, or the kernel, or the holder's own work.
        w.blank()?;
        say!(
            w,
            "table replaces by agent (largest table; where the hold time went):"
        )?;
        for (agent, t) in &s.tables {
            let largest = t
                .largest
                .as_ref()
                .map(|l| {
                    let fam = if l.family == "ip" {
                        String::new()
                    } else {
                        format!("{} ", l.family)
                    };
                    format!(
                        "{fam}{} {} entries {}",
                        l.table,
                        thousands(u64::from(l.entries)),
                        human_bytes(u64::from(l.bytes))
                    )
                })
                .unwrap_or_else(|| "no table size read".into());
            let slowest = if t.kernel_ns > t.userspace_ns {
                "kernel"
            } else {
                "userspace"
            };
            say!(
                w,
                "  {agent}: {largest}; {} holds: kernel {}, userspace {} (mostly {slowest})",
                t.holds,
                human_ns(t.kernel_ns),
                human_ns(t.userspace_ns)
            )?;
        }
    }
    Ok(())
}

/// nf_tables commits per agent: how many changes, the largest batch.
fn write_nft_commits(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if !s.nft.is_empty() {
        // The second lock: how big each agent's batches were.
        w.blank()?;
        say!(w, "nf_tables commits by agent (changes; largest batch):")?;
        for (agent, n) in &s.nft {
            say!(
                w,
                "  {agent}: {} commit{} in {}, {} changes; largest {}{} changes",
                n.commits,
                if n.commits == 1 { "" } else { "s" },
                human_ns(n.held_ns),
                thousands(n.changes),
                if n.largest_partial { "at least " } else { "" },
                thousands(n.largest)
            )?;
        }
    }
    Ok(())
}

/// Rule writes per agent and backend.
fn write_rule_writes(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if !s.rule_writes.is_empty() {
        // Which backend each agent's rules go through.
        w.blank()?;
        say!(w, "rule writes by agent and backend:")?;
        for r in &s.rule_writes {
            let tables: Vec<&str> = r.writes.tables.iter().map(String::as_str).collect();
            let programs: Vec<&str> = r.writes.programs.iter().map(String::as_str).collect();
            let binaries: Vec<&str> = r.writes.binaries.iter().map(String::as_str).collect();
            say!(
                w,
                "  {} {}: {} write{} by {}{}{}",
                r.agent,
                r.backend.as_str(),
                thousands(r.writes.writes),
                if r.writes.writes == 1 { "" } else { "s" },
                programs.join(", "),
                if binaries.is_empty() {
                    String::new()
                } else {
                    format!(" [{}]", binaries.join(", "))
                },
                if tables.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", tables.join(", "))
                }
            )?;
        }
    }
    Ok(())
}

/// Writers getting in each other's way: rules changed by another agent, namespaces
/// written through both backends, writers without a shared lock.
fn write_rule_conflicts(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if !s.foreign_changes.is_empty() {
        w.blank()?;
        say!(
            w,
            "rules changed by another agent (writer -> owner: chains and rules):"
        )?;
        for (writer, owner, n) in &s.foreign_changes {
            say!(w, "  {writer} -> {owner}: {}", thousands(*n))?;
        }
    }
    for m in &s.mixed_backends {
        say!(w, "{}", super::lines::mixed_backends_text(m, s.host_netns))?;
    }
    let u = &s.unserialized;
    if u.pairs + u.lost_writes + u.refused_replaces > 0 {
        say!(
            w,
            "!! writers without a shared lock: {} pair(s); {} write(s) undone by a replace \
             read before them, {} replace(s) refused for it",
            u.pairs,
            u.lost_writes,
            u.refused_replaces
        )?;
    }
    Ok(())
}

/// No lock activity at all, and events lost.
fn write_activity_notes(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if s.holds.is_empty() && s.waits.is_empty() {
        say!(w, "no lock activity seen")?;
    }
    if s.lost_events > 0 {
        say!(
            w,
            "!! {} events lost: the ring buffer was full; counts are lower bounds",
            s.lost_events
        )?;
    }
    Ok(())
}

/// "Services: 12 service ports routed to 30 endpoints; !! 1 window of routing to a gone
/// endpoint, 1.50 s in all, 6 connections refused meanwhile": what the JSON summary's
/// `services` says, in words.
fn write_services(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    let v = &s.services;
    if v.is_empty() {
        return Ok(());
    }
    w.blank()?;
    say!(
        w,
        "Services: {} service port{} routed to {} endpoint{} (from the rule reads)",
        thousands(v.services),
        if v.services == 1 { "" } else { "s" },
        thousands(v.endpoints),
        if v.endpoints == 1 { "" } else { "s" }
    )?;
    if v.stale_windows > 0 {
        say!(
            w,
            "  !! {} window{} of routing to a gone endpoint, {} in all, {} connection{} refused              or unanswered meanwhile{}",
            thousands(v.stale_windows),
            if v.stale_windows == 1 { "" } else { "s" },
            human_ns(v.stale_ns),
            thousands(v.connections),
            if v.connections == 1 { "" } else { "s" },
            if v.still_stale > 0 {
                format!("; {} still routed at the end", thousands(v.still_stale))
            } else {
                String::new()
            }
        )?;
    }
    if v.programmed > 0 {
        say!(
            w,
            "  {} new endpoint{} first routed, the slowest {} after its address came up",
            thousands(v.programmed),
            if v.programmed == 1 { "" } else { "s" },
            human_ns(v.programming_ns_max)
        )?;
    }
    if v.over_bound > 0 {
        say!(
            w,
            "  !! {} windows not tracked (past the analysis' bound)",
            thousands(v.over_bound)
        )?;
    }
    Ok(())
}

/// "syncs: kube-proxy 42 (every 10.0 s), calico-node 7 (stalled)".
fn write_syncs(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if s.syncs.is_empty() {
        return Ok(());
    }
    let each: Vec<String> = s
        .syncs
        .iter()
        .map(|(agent, c)| {
            let mut t = format!("{agent} {}", thousands(c.syncs));
            match (c.stalled, c.usual_period_ns) {
                (true, _) => t.push_str(" (stalled)"),
                (false, Some(p)) => t.push_str(&format!(" (every {})", human_ns(p))),
                (false, None) => {}
            }
            t
        })
        .collect();
    w.blank()?;
    say!(w, "syncs (completed restores): {}", each.join(", "))
}

/// The analysis' bounds that were hit: what went past them was not tracked.
fn write_bounds(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if s.over_bounds.is_empty() {
        return Ok(());
    }
    let each: Vec<String> = s
        .over_bounds
        .iter()
        .map(|(b, n)| format!("{b} {}", thousands(*n)))
        .collect();
    w.blank()?;
    say!(
        w,
        "!! analysis bounds hit (what went past them was not tracked): {}",
        each.join(", ")
    )
}

/// "rules that dropped packets: 620 packets by 2 rules (their own counters)", then the top
/// ones with whose they are.
fn write_rule_drops(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    let r = &s.rule_drops;
    if r.is_empty() {
        return Ok(());
    }
    w.blank()?;
    say!(
        w,
        "rules that dropped packets: {} packets by {} rule{} (their own counters)",
        thousands(r.packets),
        thousands(r.rules),
        if r.rules == 1 { "" } else { "s" }
    )?;
    for row in &r.top {
        let table = super::lines::table_name(&row.family, &row.table);
        let what = if row.rule.is_empty() {
            format!("{table} {}'s DROP policy", row.chain)
        } else {
            format!("{table} {} `{}`", row.chain, row.rule)
        };
        let whose = match (&row.owner, &row.chain_owner) {
            (Some(o), Some(c)) if o != c => format!(" ({o}'s rule in {c}'s chain)"),
            (Some(o), _) => format!(" ({o}'s)"),
            _ => String::new(),
        };
        let added = row
            .added
            .as_ref()
            .map(|a| format!(", added by {} (pid {})", a.program, a.pid))
            .unwrap_or_default();
        say!(
            w,
            "  {} packets ({}) {what}{whose}{added}",
            thousands(row.packets),
            human_bytes(row.bytes)
        )?;
    }
    if r.other_packets > 0 {
        say!(
            w,
            "  {} packets by rules past the summary's bound",
            thousands(r.other_packets)
        )?;
    }
    for u in &r.uncounted {
        say!(w, "  !! drops without a counter (not named): {u}")?;
    }
    Ok(())
}

/// "refused connections: 90 in all; by kind: ...; by destination: ...", then the holds with
/// the most.
fn write_refusals(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    let r = &s.refusals;
    if r.total == 0 {
        return Ok(());
    }
    w.blank()?;
    say!(
        w,
        "refused connections and resets: {} in all, {} during lock holds",
        thousands(r.total),
        thousands(r.during_holds)
    )?;
    let top = |m: &std::collections::BTreeMap<String, u64>| -> String {
        let mut v: Vec<(&String, &u64)> = m.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        v.iter()
            .take(8)
            .map(|(k, n)| format!("{k} {}", thousands(**n)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    say!(w, "  by kind: {}", top(&r.by_kind))?;
    if !r.by_dest.is_empty() {
        say!(w, "  by destination: {}", top(&r.by_dest))?;
    }
    for h in &r.worst_holds {
        say!(
            w,
            "  {}",
            super::lines::hold_refusals_text(h).trim_start_matches("!! ")
        )?;
    }
    if r.overflow > 0 {
        say!(
            w,
            "  !! {} refusals counted without kind or destination (the kernel's key map was full)",
            thousands(r.overflow)
        )?;
    }
    Ok(())
}

fn write_ipvs(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    if s.ipvs.is_empty() {
        return Ok(());
    }
    w.blank()?;
    say!(w, "ipvs backends:")?;
    say!(
        w,
        "  {:<5} {:<22} {:<22} {:>11} {:>11} {:>11}",
        "proto",
        "service",
        "backend",
        "connections",
        "packets",
        "stale"
    )?;
    for r in &s.ipvs {
        say!(
            w,
            "  {:<5} {:<22} {:<22} {:>11} {:>11} {:>11}",
            r.protocol,
            r.service,
            r.backend,
            thousands(r.counts.connections),
            thousands(r.counts.packets),
            thousands(r.counts.stale_packets)
        )?;
    }
    Ok(())
}

fn write_drops(w: &mut SafeLines<impl Write>, s: &Summary) -> io::Result<()> {
    let d = &s.drops;
    let ct = &d.conntrack;
    if d.total == 0 && ct.is_zero() && d.conntrack_max_fill_pct == 0 {
        return Ok(());
    }
    w.blank()?;
    say!(w, "packet drops: {} in all", thousands(d.total))?;
    let netns = |n: u32| {
        if n != 0 && n == s.host_netns {
            "host".to_string()
        } else {
            n.to_string()
        }
    };
    let list = |m: Vec<(String, u64)>| -> String {
        let mut m = m;
        m.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        m.iter()
            .take(8)
            .map(|(k, n)| format!("{k} {}", thousands(*n)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (title, items) in [
        (
            "by cause",
            d.by_class
                .iter()
                .map(|(c, n)| (c.describe().to_string(), *n))
                .collect::<Vec<_>>(),
        ),
        (
            "by reason",
            d.by_reason.iter().map(|(k, n)| (k.clone(), *n)).collect(),
        ),
        (
            "by location",
            d.by_location.iter().map(|(k, n)| (k.clone(), *n)).collect(),
        ),
        (
            "by netns",
            d.by_netns.iter().map(|(k, n)| (netns(*k), *n)).collect(),
        ),
    ] {
        if !items.is_empty() {
            say!(w, "  {title}: {}", list(items))?;
        }
    }
    say!(
        w,
        "  {} during lock holds; {} sampled",
        thousands(d.during_holds),
        thousands(d.samples)
    )?;
    for h in &d.worst_holds {
        say!(w, "  {}", hold_drops_text(h).trim_start_matches("!! "))?;
    }
    if d.overflow > 0 {
        say!(
            w,
            "  !! {} drops counted without reason or place (the kernel's key map was full)",
            thousands(d.overflow)
        )?;
    }
    if !ct.is_zero() || d.conntrack_max_fill_pct > 0 {
        say!(
            w,
            "conntrack: {} dropped (table full), {} insert failed, {} early drops, {} invalid; \
             fullest table {}%{}",
            thousands(ct.drop),
            thousands(ct.insert_failed),
            thousands(ct.early_drop),
            thousands(ct.invalid),
            d.conntrack_max_fill_pct,
            if d.conntrack_warnings > 0 {
                format!(" ({} warnings)", d.conntrack_warnings)
            } else {
                String::new()
            }
        )?;
    }
    if !d.conntrack_refused.is_empty() {
        let parts: Vec<String> = d
            .conntrack_refused
            .iter()
            .map(|(c, n)| format!("{} {}", thousands(*n), c.describe()))
            .collect();
        say!(
            w,
            "conntrack refused (seen in its own functions): {}",
            parts.join(", ")
        )?;
    }
    Ok(())
}
