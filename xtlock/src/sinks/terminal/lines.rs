//! One fact, one line: the text each fact is shown as. One function per fact type, flat
//! independent pieces: why this is one long file (docs/architecture.md).

use std::fmt::Write as _;

use super::{human_bytes, human_ns, DEFAULT_LOCK};
use crate::analysis::drops::packet_text;
use crate::analysis::facts::{
    EndpointProgrammedFact, IpvsDrainedFact, RuleDropsFact, StaleEndpointFact,
    StaleEndpointOpenFact, StaleFix, UncountedDropsFact,
};
use crate::analysis::{
    ConntrackFact, ConntrackRefusedFact, DropClass, DropCountFact, DropFact, ExecFact, ExitFact,
    HoldDropsFact, HoldFact, HoldRefusalsFact, HolderRef, IpvsFact, RefusalCountFact, RefusalFact,
    RefusalKind, StallFact, TimeoutFact, WaitFact, WaitMode, WaitOutcome,
};
use crate::capture::thousands;
use crate::event::AddrWhy;

pub(crate) fn on_lock(lock: &str) -> String {
    if lock == DEFAULT_LOCK {
        String::new()
    } else {
        format!(" on {lock}")
    }
}

pub(crate) fn holder_text(h: &HolderRef) -> String {
    let what = if h.cmdline.is_empty() {
        &h.comm
    } else {
        &h.cmdline
    };
    if what.is_empty() || *what == h.agent {
        format!("{} (pid {}{})", h.agent, h.pid, in_pod(&h.pod))
    } else {
        format!("{} ({}{})", h.agent, what, in_pod(&h.pod))
    }
}

/// `, in pod NAMESPACE/POD/CONTAINER` for a process in a pod the kubelet named.
pub(crate) fn in_pod(pod: &Option<std::sync::Arc<crate::kube::PodName>>) -> String {
    pod.as_ref()
        .map_or_else(String::new, |p| format!(", in pod {p}"))
}

pub(crate) fn hold_text(h: &HoldFact) -> String {
    let what = if h.who.cmdline.is_empty() {
        &h.who.comm
    } else {
        &h.who.cmdline
    };
    let mut s = format!(
        "{} held {} {}{} (pid {} {}{})",
        h.who.agent,
        h.lock,
        if h.before_start { "at least " } else { "" },
        human_ns(h.hold_ns),
        h.pid,
        what,
        in_pod(&h.who.pod)
    );
    if h.before_start {
        s.push_str(", held already when tracing began");
    }
    let plural = |n: u32| if n == 1 { "" } else { "s" };
    if h.reads > 0 {
        // Reads and replaces: `kernel 412 ms: 120 ms in 4 table reads, 292 ms in 2 table
        // replaces` (a read: the table's size, then its entries).
        let _ = write!(
            s,
            ", kernel {}: {} in {} table read{}",
            human_ns(h.kernel_ns),
            human_ns(h.read_ns),
            h.reads,
            plural(h.reads)
        );
        if h.replaces > 0 {
            let _ = write!(
                s,
                ", {} in {} table replace{}",
                human_ns(h.kernel_ns.saturating_sub(h.read_ns)),
                h.replaces,
                plural(h.replaces)
            );
        }
    } else if h.replaces > 0 {
        let _ = write!(
            s,
            ", {} in {} table replace{}",
            human_ns(h.kernel_ns),
            h.replaces,
            plural(h.replaces)
        );
    }
    if h.replaces > 0 || h.reads > 0 {
        let tables = tables_text(h);
        if !tables.is_empty() {
            let _ = write!(s, " ({tables})");
        }
        if h.swap_ns > 0 {
            let _ = write!(
                s,
                ", {} of it swapping tables, waiting for every CPU",
                human_ns(h.swap_ns)
            );
        }
        // The rest of the hold: the holder's own work (parsing, computing the new tables,
        // reading its input).
        let _ = write!(
            s,
            "; userspace {}",
            human_ns(h.hold_ns.saturating_sub(h.kernel_ns))
        );
    }
    if let Some(b) = &h.nft {
        s.push_str(&nft_text(b));
    }
    if h.open {
        s.push_str(" [still held when tracing ended]");
    } else if h.incomplete {
        s.push_str(" [release not seen; end inferred]");
    }
    s
}

/// What an nf_tables batch changed: `, 305 changes (chains +5, rules +300 -2)`; `at least`
/// when only its first messages were counted.
pub(crate) fn nft_text(b: &crate::event::NftBatch) -> String {
    if b.status == "unreadable" {
        return ", batch not readable".into();
    }
    let kinds: Vec<String> = b
        .kinds()
        .map(|(k, a, d)| match (a, d) {
            (a, 0) => format!("{k} +{}", thousands(u64::from(a))),
            (0, d) => format!("{k} -{}", thousands(u64::from(d))),
            (a, d) => format!(
                "{k} +{} -{}",
                thousands(u64::from(a)),
                thousands(u64::from(d))
            ),
        })
        .collect();
    let n = b.changes();
    format!(
        ", {}{} change{}{}",
        if b.status == "partial" {
            "at least "
        } else {
            ""
        },
        thousands(n),
        if n == 1 { "" } else { "s" },
        if kinds.is_empty() {
            String::new()
        } else {
            format!(" ({})", kinds.join(", "))
        }
    )
}

/// The tables a hold replaced: `nat 84,112 entries 21.0 MiB, filter 12,410 entries 3.1 MiB`
/// (counter updates left out: they come with the replaces).
fn tables_text(h: &HoldFact) -> String {
    let parts: Vec<String> = h
        .tables
        .iter()
        .filter(|t| t.op == "replace")
        .map(|t| {
            let name = match (t.table.is_empty(), t.family) {
                (true, _) => "table".to_string(),
                (false, "ip") => t.table.clone(),
                (false, fam) => format!("{fam} {}", t.table),
            };
            match (t.entries, t.bytes) {
                (Some(e), Some(b)) => {
                    format!(
                        "{name} {} entries {}",
                        thousands(u64::from(e)),
                        human_bytes(u64::from(b))
                    )
                }
                _ => format!("{name} of unknown size"),
            }
        })
        .collect();
    parts.join(", ")
}

/// ` (itself waiting 1.19 s for LOCK behind X (...))`: a holder that was itself queued for
/// another lock while this wait was behind it (an nf_tables batch holding nfnetlink's mutex
/// while it waits for its netns's commit mutex); empty otherwise.
fn waiting_text(h: &HolderRef) -> String {
    let Some(w) = &h.waiting else {
        return String::new();
    };
    let behind: Vec<String> = match &w.holders[..] {
        [] => vec!["behind an unknown holder".to_string()],
        [one] => vec![format!("behind {}", holder_text(one))],
        many => many
            .iter()
            .map(|x| {
                format!(
                    "{} behind {}",
                    human_ns(x.behind_ns.unwrap_or(0)),
                    holder_text(x)
                )
            })
            .collect(),
    };
    format!(
        " (itself waiting {} for {} {})",
        human_ns(w.wait_ns),
        w.lock,
        behind.join(", ")
    )
}

/// Whom a wait was behind, and for how long: ` behind X (...)` when one holder accounts
/// for all of it, else `: 1.00 s behind X (...), 70 ms behind Y (...)`, holders grouped by
/// agent in the order they held the lock.
pub(crate) fn behind_text(w: &WaitFact) -> String {
    // (agent, time behind it, its first holder, processes)
    let mut groups: Vec<(&str, u64, &HolderRef, usize)> = Vec::new();
    for h in &w.holders {
        let ns = h.behind_ns.unwrap_or(0);
        match groups.iter_mut().find(|g| g.0 == h.agent.as_str()) {
            Some(g) => {
                g.1 += ns;
                g.3 += 1;
            }
            None => groups.push((&h.agent, ns, h, 1)),
        }
    }
    let mut parts: Vec<String> = Vec::new();
    if w.unknown_ns > 0 || groups.is_empty() {
        parts.push(format!(
            "{} behind an unknown holder",
            human_ns(w.unknown_ns)
        ));
    }
    for (agent, ns, first, n) in &groups {
        let who = if *n == 1 {
            format!("{}{}", holder_text(first), waiting_text(first))
        } else {
            format!("{agent} ({n} processes)")
        };
        parts.push(format!("{} behind {who}", human_ns(*ns)));
    }
    if w.other_holders > 0 {
        parts.push(format!(
            "{} behind {} more",
            human_ns(w.other_holders_ns),
            w.other_holders
        ));
    }
    // A poller's interval after a release; a woken waiter's few µs are not worth a word.
    if w.free_ns >= 1_000_000 || w.free_ns * 20 > w.wait_ns {
        parts.push(format!("{} with the lock free", human_ns(w.free_ns)));
    }
    match (parts.len(), groups.first()) {
        // One holder for the whole wait: its time is the wait's.
        (1, Some((_, _, first, 1))) => {
            format!(" behind {}{}", holder_text(first), waiting_text(first))
        }
        (1, Some((agent, _, _, n))) => format!(" behind {agent} ({n} processes)"),
        (1, None) => " behind an unknown holder".to_string(),
        _ => format!(": {}", parts.join(", ")),
    }
}

pub(crate) fn wait_text(w: &WaitFact) -> String {
    let behind = behind_text(w);
    let d = human_ns(w.wait_ns);
    let mut s = match w.outcome {
        WaitOutcome::Acquired => format!("{} waited {d}{behind}", w.who.agent),
        WaitOutcome::TimedOut => format!("{} gave up after {d} waiting{behind}", w.who.agent),
        WaitOutcome::Abandoned => format!("{} exited after waiting {d}{behind}", w.who.agent),
        WaitOutcome::Open => format!("{} still waiting after {d}{behind}", w.who.agent),
    };
    s.push_str(&on_lock(&w.lock));
    let _ = write!(s, " [pid {} {}{}", w.pid, w.who.comm, in_pod(&w.who.pod));
    if w.mode == WaitMode::Poll {
        let _ = write!(s, ", polled: {} failed tries", w.tries);
    }
    s.push(']');
    s
}

pub(crate) fn timeout_text(t: &TimeoutFact) -> String {
    let held = if t.holders.is_empty() {
        "holder unknown".to_string()
    } else {
        format!(
            "held by {}",
            t.holders
                .iter()
                .map(|h| h.agent.as_str())
                .collect::<Vec<_>>()
                .join(", then ")
        )
    };
    let how = if t.tries <= 1 && t.waited_ns < 1_000_000 {
        // One LOCK_NB try: iptables without -w.
        "found the lock taken and gave up".to_string()
    } else {
        format!(
            "gave up waiting for the lock after {}",
            human_ns(t.waited_ns)
        )
    };
    format!(
        "{}: {} (pid {}{}) {how} (exit {}){}, {held}",
        t.who.agent,
        t.who.comm,
        t.pid,
        in_pod(&t.who.pod),
        t.exit_code,
        on_lock(&t.lock)
    )
}

pub(crate) fn exec_text(e: &ExecFact) -> String {
    let what = if e.cmdline.is_empty() {
        &e.filename
    } else {
        &e.cmdline
    };
    format!(
        "exec {what} (pid {}) by {} (pid {})",
        e.pid, e.agent, e.agent_pid
    )
}

pub(crate) fn exit_text(e: &ExitFact) -> String {
    let status = match e.code {
        Some(c) => format!("status {c}"),
        None => "killed by a signal".to_string(),
    };
    let after = match e.runtime_ns {
        Some(r) => format!(" after {}", human_ns(r)),
        None => String::new(),
    };
    format!(
        "exit {} (pid {}) {status}{after}, run by {}",
        e.comm, e.pid, e.agent
    )
}

pub(crate) fn class_text(class: DropClass, reason: &str) -> String {
    match class {
        DropClass::Other => reason.to_string(),
        c => c.describe().to_string(),
    }
}

pub(crate) fn during(holds: &[crate::analysis::HoldRef]) -> String {
    match holds.first() {
        None => String::new(),
        Some(h) => {
            let more = if holds.len() > 1 {
                format!(" (and {} more)", holds.len() - 1)
            } else {
                String::new()
            };
            format!(", while {} held {}{more}", h.agent, h.lock)
        }
    }
}

pub(crate) fn drop_count_text(d: &DropCountFact) -> String {
    let what = match d.class {
        DropClass::Other => format!("{} at {}", d.reason, d.location),
        c => format!("{} ({} at {})", c.describe(), d.reason, d.location),
    };
    let mut s = format!(
        "{} packet{} dropped in {}: {what}, netns {}",
        thousands(d.count),
        if d.count == 1 { "" } else { "s" },
        human_ns(d.interval_ns),
        d.netns
    );
    if let Some(p) = &d.example {
        let _ = write!(s, ", e.g. {}", packet_text(p));
    }
    s.push_str(&during(&d.holds));
    s
}

pub(crate) fn drop_text(d: &DropFact) -> String {
    let mut s = format!(
        "drop {} at {} ({}), netns {}",
        d.reason,
        d.location,
        class_text(d.class, &d.reason),
        d.netns
    );
    if let Some(p) = &d.packet {
        let _ = write!(s, ": {}", packet_text(p));
    }
    if let Some(h) = &d.hold {
        let _ = write!(s, ", while {} held {}", h.agent, h.lock);
    }
    s
}

pub(crate) fn conntrack_refused_text(c: &ConntrackRefusedFact) -> String {
    let mut s = format!(
        "{} in {}, netns {}",
        c.class.describe(),
        c.function,
        c.netns
    );
    if let Some(p) = &c.packet {
        let _ = write!(s, ": {}", packet_text(p));
    }
    if !c.comm.is_empty() {
        let _ = write!(s, " (running: {}[{}])", c.comm, c.pid);
    }
    if let Some(h) = &c.hold {
        let _ = write!(s, ", while {} held {}", h.agent, h.lock);
    }
    s
}

pub(crate) fn conntrack_text(c: &ConntrackFact) -> String {
    let d = &c.deltas;
    let mut parts = Vec::new();
    for (n, what) in [
        (d.drop, "dropped (table full)"),
        (d.insert_failed, "insert failed (race)"),
        (d.early_drop, "early drops"),
        (d.invalid, "invalid"),
        (d.search_restart, "search restarts"),
        (d.clash_resolve, "clashes resolved"),
        (d.chaintoolong, "chains too long"),
    ] {
        if n > 0 {
            parts.push(format!("{} {what}", thousands(n)));
        }
    }
    let mut s = match &c.warning {
        Some(w) => format!("!! {w} in netns {}", c.netns),
        None => format!("conntrack in netns {}", c.netns),
    };
    if !parts.is_empty() {
        let _ = write!(s, ": {} in {}", parts.join(", "), human_ns(c.interval_ns));
    }
    if c.max > 0 && c.warning.is_none() {
        let _ = write!(
            s,
            "; table {}% full ({} of {})",
            c.fill_pct, c.entries, c.max
        );
    }
    s.push_str(&during(&c.holds));
    s
}

/// "37 connections to 10.96.0.15:80 refused (ICMP port unreachable) by rule "default/web:http
/// has no endpoints"": the rule when the rule reads know it.
pub(crate) fn refusal_group_text(
    kind: RefusalKind,
    detail: &str,
    dest: &str,
    n: u64,
    rule: Option<&str>,
) -> String {
    let mut s = refusal_what(kind, detail, dest, n);
    if let Some(r) = rule {
        s.push_str(&format!(" by rule \"{r}\""));
    }
    s
}

fn refusal_what(kind: RefusalKind, detail: &str, dest: &str, n: u64) -> String {
    let conns = format!(
        "{} connection{}",
        thousands(n),
        if n == 1 { "" } else { "s" }
    );
    let to = if dest.is_empty() {
        String::new()
    } else {
        format!(" to {dest}")
    };
    match kind {
        RefusalKind::IcmpUnreachable if detail.is_empty() => {
            format!("{conns}{to} refused (ICMP unreachable)")
        }
        RefusalKind::IcmpUnreachable => format!("{conns}{to} refused (ICMP {detail})"),
        RefusalKind::ResetSent if detail.is_empty() => format!("{conns}{to} refused (TCP reset)"),
        RefusalKind::ResetSent => format!("{conns}{to} refused (TCP reset, {detail})"),
        RefusalKind::ResetReceived => format!(
            "{} TCP reset{} received from {}",
            thousands(n),
            if n == 1 { "" } else { "s" },
            if dest.is_empty() {
                "an unknown peer"
            } else {
                dest
            }
        ),
    }
}

pub(crate) fn refusal_count_text(f: &RefusalCountFact) -> String {
    let mut s = format!(
        "{} in {}, netns {}",
        refusal_group_text(f.kind, &f.detail, &f.dest, f.count, f.rule.as_deref()),
        human_ns(f.interval_ns),
        f.netns
    );
    if let Some(h) = &f.hold {
        s.push_str(&during(std::slice::from_ref(h)));
    }
    s
}

/// One sampled refusal: "refused: tcp 10.0.0.9:40312 -> 10.96.0.15:80 (ICMP port
/// unreachable), netns N during ...".
pub(crate) fn refusal_text(f: &RefusalFact) -> String {
    let what = refusal_group_text(f.kind, &f.detail, &f.dest, 1, None);
    let mut s = match &f.packet {
        Some(p) => format!("sample: {what}: {}", packet_text(p)),
        None => format!("sample: {what}"),
    };
    s.push_str(&format!(", netns {}", f.netns));
    if let Some(h) = &f.hold {
        s.push_str(&during(std::slice::from_ref(h)));
    }
    s
}

/// "!! 37 connections to 10.96.0.15:80 refused (ICMP port unreachable) during kube-proxy's
/// 2.10 s hold of /run/xtables.lock (pid 42)": the three largest groups (each with a sampled
/// packet, when there is one), and how many more.
pub(crate) fn hold_refusals_text(h: &HoldRefusalsFact) -> String {
    let mut groups: Vec<String> = h
        .groups
        .iter()
        .take(3)
        .map(|g| {
            let text = refusal_group_text(g.kind, &g.detail, &g.dest, g.count, g.rule.as_deref());
            match &g.example {
                Some(p) => format!("{text} (e.g. {})", packet_text(p)),
                None => text,
            }
        })
        .collect();
    if h.groups.len() > 3 {
        let rest: u64 = h.groups.iter().skip(3).map(|g| g.count).sum();
        groups.push(format!("and {} more", thousands(rest)));
    }
    format!(
        "!! {} during {}'s {} hold of {} (pid {})",
        groups.join(", "),
        h.agent,
        human_ns(h.hold_ns),
        h.lock,
        h.pid
    )
}

pub(crate) fn hold_drops_text(h: &HoldDropsFact) -> String {
    // What the drops were (the kernel's exact counts, or the samples inside the hold of an
    // older capture): one kind is named, several are counted.
    let classes: Vec<String> = h
        .by_class
        .iter()
        .map(|(c, n)| {
            let what = if *c == DropClass::Other {
                let reasons: Vec<&str> = h
                    .by_reason
                    .keys()
                    .filter(|r| *r != "NETFILTER_DROP")
                    .map(String::as_str)
                    .collect();
                format!("other: {}", reasons.join(", "))
            } else {
                c.describe().to_string()
            };
            if h.by_class.len() == 1 {
                what
            } else {
                format!("{} {what}", thousands(*n))
            }
        })
        .collect();
    let kinds = match classes.len() {
        0 => String::new(),
        1 => format!(" ({})", classes[0]),
        _ if h.exact_reasons => format!(" ({})", classes.join(", ")),
        _ => format!(" (sampled: {})", classes.join(", ")),
    };
    format!(
        "!! {} packet{} dropped{kinds} during {}'s {} hold of {} (pid {})",
        thousands(h.dropped),
        if h.dropped == 1 { "" } else { "s" },
        h.agent,
        human_ns(h.hold_ns),
        h.lock,
        h.pid
    )
}

/// One IPVS fact, e.g. "ipvs udp 10.96.0.10:53: endpoint 10.0.1.5:53 removed at T by
/// ipvsadm[812]; 37 packets from 10.0.0.9:40000 still sent there (dropped by the kernel)
/// until T+4.20 s; entry expired at T+9.31 s".
pub(crate) fn ipvs_text(f: &IpvsFact) -> String {
    let head = format!("ipvs {} {}", f.protocol, f.service);
    let who = |pid: Option<u32>, comm: &Option<String>| match (pid, comm) {
        (Some(p), Some(c)) => format!("{c}[{p}]"),
        _ => "?".into(),
    };
    let failed = match f.ret {
        Some(r) if r != 0 => format!(" (failed: errno {})", -r),
        _ => String::new(),
    };
    let client = f.client.as_deref().unwrap_or("?");
    match f.event {
        "scheduled" => format!(
            "{head}: {client} scheduled to {} (weight {})",
            f.backend, f.weight
        ),
        "dest_added" => format!(
            "{head}: endpoint {} added (weight {}) by {}{failed}",
            f.backend,
            f.weight,
            who(f.pid, &f.comm)
        ),
        "dest_removed" => format!(
            "{head}: endpoint {} removed by {}{failed}",
            f.backend,
            who(f.pid, &f.comm)
        ),
        "dest_edited" => format!(
            "{head}: endpoint {} weight set to {} by {}{failed}",
            f.backend,
            f.weight,
            who(f.pid, &f.comm)
        ),
        "service_added" | "service_edited" | "service_removed" => format!(
            "{head}: virtual service {} by {}{failed}",
            &f.event[8..],
            who(f.pid, &f.comm)
        ),
        "stale" => {
            let what = match f.backend_state {
                Some("removed") => "removed",
                _ => "set to weight 0",
            };
            let mut s = format!(
                "!! {head}: packets from {client} still go to endpoint {} ({what}{}), {}",
                f.backend,
                f.change
                    .as_ref()
                    .map(|c| format!(
                        " {} ago by {}[{}]",
                        human_ns(f.ts_ns.saturating_sub(c.ts_ns)),
                        c.comm,
                        c.pid
                    ))
                    .unwrap_or_default(),
                action_text(f.action)
            );
            if let Some(left) = f.entry_left_ns {
                let _ = write!(s, "; connection entry expires in {}", human_ns(left));
            }
            s
        }
        _ => {
            // stale_end: told from the change (T) when it was seen.
            let t0 = f.change.as_ref().map_or(f.ts_ns, |c| c.ts_ns);
            let what = match f.backend_state {
                Some("removed") => "removed",
                _ => "set to weight 0",
            };
            let mut s = match &f.change {
                Some(c) => format!(
                    "{head}: endpoint {} {what} at T by {}[{}]; ",
                    f.backend, c.comm, c.pid
                ),
                None => format!("{head}: endpoint {} {what}; ", f.backend),
            };
            let packets = f.packets.unwrap_or(0);
            let _ = write!(
                s,
                "{} packet{} from {client} still sent there ({}) until T+{}",
                thousands(packets),
                if packets == 1 { "" } else { "s" },
                action_text(f.action),
                human_ns(f.last_packet_ns.unwrap_or(t0).saturating_sub(t0))
            );
            match f.expired_ns {
                Some(x) => {
                    let _ = write!(s, "; entry expired at T+{}", human_ns(x.saturating_sub(t0)));
                }
                None => s.push_str("; entry still there when tracing stopped"),
            }
            s
        }
    }
}

pub(crate) fn action_text(a: Option<crate::decode::StaleAction>) -> &'static str {
    use crate::decode::StaleAction;
    match a {
        Some(StaleAction::Forwarded) => "forwarded by the kernel",
        Some(StaleAction::Dropped) => "dropped by the kernel",
        Some(StaleAction::Expired) => "entry expired by the kernel, packet rescheduled",
        _ => "?",
    }
}

/// An agent's syncs stalled, or resumed.
pub(crate) fn stall_text(s: &StallFact) -> String {
    let usual = s
        .usual_period_ns
        .map(|u| format!(" (usually every {})", human_ns(u)))
        .unwrap_or_default();
    let since = s.since_last_sync_ns.map(human_ns);
    let hung = |r: &crate::analysis::HungRestore| {
        let usual = r
            .usual_ns
            .map(|u| format!(" (its restores usually take {})", human_ns(u)))
            .unwrap_or_default();
        (human_ns(r.running_ns), usual, r.pid)
    };
    match (s.stalled, s.reason, &s.restore) {
        (true, "restore_hung", Some(r)) => {
            let (running, usual, pid) = hung(r);
            format!(
                "!! {} stalled: its iptables-restore (pid {pid}) has run for {running}{usual} \
                 and has not finished{}",
                s.agent,
                since
                    .map(|x| format!("; last completed restore {x} ago"))
                    .unwrap_or_default()
            )
        }
        (false, "restore_ended", Some(r)) => {
            let (running, _, pid) = hung(r);
            let how = r
                .exit_code
                .map_or_else(|| "was killed".to_string(), |c| format!("exited {c}"));
            format!(
                "{} no longer hangs: its iptables-restore (pid {pid}) {how} after {running} \
                 without completing; its rules were not written",
                s.agent
            )
        }
        (true, "restores_time_out", _) => format!(
            "!! {} stalled: its last {} iptables-restore runs gave up waiting for the lock (exit \
             4){}",
            s.agent,
            s.timeouts_in_row,
            since
                .map(|x| format!("; last completed restore {x} ago"))
                .unwrap_or_default()
        ),
        (true, _, _) => format!(
            "!! {} stalled: no completed iptables-restore for {}{usual} while it runs (pid {}): \
             its rules are falling behind",
            s.agent,
            since.unwrap_or_default(),
            s.agent_pid
        ),
        (false, _, _) => format!(
            "{} syncs again: an iptables-restore completed{}",
            s.agent,
            since
                .map(|x| format!(" {x} after the last one"))
                .unwrap_or_default()
        ),
    }
}

/// `netns 4026531840`, or `the host's netns`.
pub(crate) fn netns_text(netns: u32, host: u32) -> String {
    if netns != 0 && netns == host {
        "the host's netns".into()
    } else {
        format!("netns {netns}")
    }
}

/// Both backends hold rules in one netns: who writes where.
pub(crate) fn mixed_backends_text(m: &crate::analysis::MixedBackendsFact, host: u32) -> String {
    format!(
        "!! both iptables backends hold rules in {}: legacy (xtables) written by {}; \
         nf_tables by {}: each backend's iptables-save shows only its own rules",
        netns_text(m.netns, host),
        m.legacy.join(", "),
        m.nft.join(", ")
    )
}

/// Writers of one netns not serialized by one lock, or a write that cost.
pub(crate) fn unserialized_text(u: &crate::analysis::unserialized::UnserializedFact) -> String {
    let lock = |w: &crate::analysis::unserialized::Writer| match &w.lock {
        Some(l) => format!("under {l}"),
        None => "holding no watched lock".to_owned(),
    };
    let who = |w: &crate::analysis::unserialized::Writer| {
        format!("{} (pid {}) {}", w.agent, w.pid, lock(w))
    };
    match u.kind {
        "lost_write" => format!(
            "!! {}'s replace of {} in {} undid {}'s write made {} after its read: the two do \
             not share a lock (rule_change shows what it removed)",
            who(&u.writer),
            u.table,
            netns_text(u.netns, 0),
            who(&u.other),
            human_ns(
                u.other_write_ns
                    .unwrap_or(0)
                    .saturating_sub(u.read_ns.unwrap_or(0))
            ),
        ),
        "lost_rules" => format!(
            "!! {}'s write to {} in {} lost to {}'s replace: {}",
            u.other.agent,
            u.table,
            netns_text(u.netns, 0),
            u.writer.agent,
            u.lost_rules.join("; "),
        ),
        "refused_replace" => format!(
            "!! {}'s replace of {} in {} was refused (EAGAIN): {} wrote the table after its \
             read; the two do not share a lock",
            who(&u.writer),
            u.table,
            netns_text(u.netns, 0),
            who(&u.other),
        ),
        _ => format!(
            "!! {} and {} write the tables of {} without sharing a lock: one's replace can \
             undo the other's write",
            who(&u.writer),
            who(&u.other),
            netns_text(u.netns, 0),
        ),
    }
}

/// `a, b, c and 3 more`.
fn some_names(names: &[String], max: usize) -> String {
    let mut s = names
        .iter()
        .take(max)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > max {
        let _ = write!(s, " and {} more", names.len() - max);
    }
    s
}

/// The lines a rule change is said in: foreign changes, stripped rules, bare drops,
/// restorations, and a table that could not be read. Nothing for a writer's changes to its
/// own rules (the JSON has them).
pub(crate) fn rule_change_lines(c: &crate::analysis::RuleChangeFact) -> Vec<String> {
    let mut v = Vec::new();
    let table = format!("{} {} (netns {})", c.family, c.table, c.netns);
    if let Some(why) = &c.skipped {
        v.push(format!("rules of {table} not diffed: {why}"));
        return v;
    }
    let who = if c.ambiguous {
        format!(
            "one of {} (writes by several agents between two reads)",
            c.agent
        )
    } else {
        c.agent.clone()
    };
    for f in &c.foreign {
        let gone: Vec<String> = f
            .chains_deleted
            .iter()
            .chain(&f.chains_flushed)
            .cloned()
            .collect();
        let mut what = Vec::new();
        if !f.chains_deleted.is_empty() {
            what.push(format!(
                "removed {} chain{}",
                f.chains_deleted.len(),
                if f.chains_deleted.len() == 1 { "" } else { "s" }
            ));
        }
        if !f.chains_flushed.is_empty() {
            what.push(format!("flushed {}", f.chains_flushed.len()));
        }
        if f.rules_removed > 0 {
            what.push(format!(
                "{} rule{} removed",
                thousands(f.rules_removed),
                if f.rules_removed == 1 { "" } else { "s" }
            ));
        }
        if f.rules_added > 0 {
            what.push(format!("{} added", thousands(f.rules_added)));
        }
        if !what.is_empty() {
            let names = if gone.is_empty() {
                String::new()
            } else {
                format!(" ({})", some_names(&gone, 6))
            };
            v.push(format!(
                "!! {who} changed {}'s rules in {table}: {}{names}",
                f.owner,
                what.join(", ")
            ));
        }
        for s in &f.rules_changed {
            let lost = if s.lost.is_empty() {
                String::new()
            } else {
                format!(" lost `{}`", s.lost.join(" "))
            };
            let gained = if s.gained.is_empty() {
                String::new()
            } else {
                format!(" gained `{}`", s.gained.join(" "))
            };
            v.push(format!(
                "!! {who} changed {}'s rule in {}:{lost}{gained}; now `{}`",
                f.owner, s.chain, s.now
            ));
        }
    }
    for r in &c.restored {
        v.push(format!(
            "{} put back {} in {table} {} after {} removed it",
            c.agent,
            r.chain,
            human_ns(r.gone_ns),
            r.removed_by
        ));
    }
    for b in &c.bare_drops {
        v.push(format!(
            "!! a rule that drops every packet reaching it, in {table} by {who}: {b}"
        ));
    }
    v
}

/// `kube-proxy's iptables-legacy-restore (pid 42), which waited 1.41 s behind calico-node,
/// then held the lock 12.0 ms`: who wrote, and why it came when it did.
fn writer_text(fix: &StaleFix) -> String {
    let mut s = fix.agent.to_string();
    if !fix.program.is_empty() {
        let _ = write!(s, "'s {}", fix.program);
    }
    let _ = write!(s, " (pid {})", fix.pid);
    if fix.wait_ns > 0 {
        // One holder: its name says it; several: how long behind each.
        let behind: Vec<String> = match fix.behind.as_slice() {
            [(a, _)] => vec![a.clone()],
            all => all
                .iter()
                .map(|(a, ns)| format!("{a} {}", human_ns(*ns)))
                .collect(),
        };
        let _ = write!(s, ", which waited {}", human_ns(fix.wait_ns));
        if !behind.is_empty() {
            let _ = write!(s, " behind {}", behind.join(", "));
        }
    }
    if let Some(h) = fix.hold_ns {
        let _ = write!(
            s,
            "{} held the lock {}",
            if fix.wait_ns > 0 { ", then" } else { ", which" },
            human_ns(h)
        );
    }
    s
}

/// "default/web:http first routed to new endpoint 10.244.1.9:8080 1.21 s after its address
/// came up (route: cali12ab), by kube-proxy's iptables-legacy-restore (pid 42), which waited
/// 0.80 s behind calico-node, then held the lock 12.0 ms".
pub(crate) fn endpoint_programmed_text(f: &EndpointProgrammedFact) -> String {
    let mut s = format!(
        "{} first routed to new endpoint {} {} after its address came up ({}{}{})",
        f.service,
        f.endpoint,
        human_ns(f.latency_ns),
        f.up,
        if f.link.is_empty() { "" } else { ": " },
        f.link
    );
    if f.write.agent.is_empty() {
        s.push_str(", at a read of the rules (no write seen)");
    } else {
        let _ = write!(s, ", by {}", writer_text(&f.write));
    }
    s
}

/// "udp/10.96.0.10:53 real server 10.0.1.5:53 at weight 0 for 5.20 s until it was removed
/// (2 connections left at the last read; its address gone: link deleted)".
pub(crate) fn ipvs_drained_text(f: &IpvsDrainedFact) -> String {
    let mut s = format!(
        "{} real server {} at weight 0 for {} {}",
        f.service,
        f.endpoint,
        human_ns(f.drained_ns),
        if f.removed {
            "until it was removed"
        } else {
            "and still there when tracing ended"
        }
    );
    let conns = u64::from(f.active) + u64::from(f.inactive);
    let _ = write!(
        s,
        " ({} connection{} left at the last read: {} active, {} inactive",
        conns,
        if conns == 1 { "" } else { "s" },
        f.active,
        f.inactive
    );
    if let Some(gone) = f.gone {
        let _ = write!(s, "; its address gone: {gone}");
    }
    s.push(')');
    s
}

/// Why an endpoint anywhere is said dead: what conntrack showed.
const UNANSWERED_WHY: &str = "its TCP connections got no reply";

/// "!! default/web:http routes to 10.244.1.7:8080, gone from the node (link deleted:
/// veth1a2b): its clients fail until a rule write stops routing there" (with "for 2.10 s
/// already" when a read found the route after the endpoint was gone).
pub(crate) fn stale_endpoint_open_text(f: &StaleEndpointOpenFact) -> String {
    let mut s = if f.gone == AddrWhy::Unanswered.as_str() {
        format!(
            "!! {} routes to {}, which stopped answering ({})",
            f.service, f.endpoint, UNANSWERED_WHY
        )
    } else {
        format!(
            "!! {} routes to {}, gone from the node ({}{}{})",
            f.service,
            f.endpoint,
            f.gone,
            if f.link.is_empty() { "" } else { ": " },
            f.link
        )
    };
    let already = f.ts_ns.saturating_sub(f.gone_ns);
    if already > 0 {
        let _ = write!(s, " for {} already", human_ns(already));
    }
    s.push_str(": its clients fail until a rule write stops routing there");
    s
}

/// "!! default/web:http still routed to 10.244.1.7:8080 for 1.62 s after it was gone (link
/// deleted: veth1a2b): 9 connections refused (icmp_unreachable: host unreachable 9); fixed by
/// kube-proxy's iptables-legacy-restore (pid 42), which waited 1.41 s behind calico-node,
/// then held the lock 12.0 ms".
pub(crate) fn stale_endpoint_text(f: &StaleEndpointFact) -> String {
    let after = if f.gone == AddrWhy::Unanswered.as_str() {
        format!("after it stopped answering ({UNANSWERED_WHY})")
    } else {
        format!(
            "after it was gone ({}{}{})",
            f.gone,
            if f.link.is_empty() { "" } else { ": " },
            f.link
        )
    };
    let mut s = format!(
        "!! {} {} to {} for {} {after}",
        f.service,
        if f.still_routed {
            "still routed"
        } else {
            "routed"
        },
        f.endpoint,
        human_ns(f.stale_ns),
    );
    if f.connections > 0 {
        let outcomes: Vec<String> = f
            .outcomes
            .iter()
            .map(|(what, n)| format!("{what} {n}"))
            .collect();
        let unanswered = f.outcomes.get("unanswered").copied().unwrap_or(0);
        let _ = write!(
            s,
            ": {} connection{} {} ({})",
            f.connections,
            if f.connections == 1 { "" } else { "s" },
            if unanswered == f.connections {
                "unanswered"
            } else if unanswered == 0 {
                "refused"
            } else {
                "refused or unanswered"
            },
            outcomes.join(", ")
        );
    } else {
        s.push_str(": no connection seen");
    }
    match &f.fix {
        None => s.push_str("; still routed when tracing ended"),
        Some(fix) if fix.agent.is_empty() => {
            let _ = write!(
                s,
                "; no longer routed at a read of the rules (no write seen)"
            );
        }
        Some(fix) => {
            let _ = write!(s, "; fixed by {}", writer_text(fix));
        }
    }
    if let Some(c) = &f.conntrack {
        let _ = write!(
            s,
            "; conntrack still sends {} flow{} there ({} UDP, {} TCP{}; expires in {} s unless packets keep it)",
            c.entries,
            if c.entries == 1 { "" } else { "s" },
            c.udp,
            c.tcp,
            if c.packets > 0 {
                format!(", {} packets", c.packets)
            } else {
                String::new()
            },
            c.expires_in_s
        );
    }
    s
}

/// How a table is named in a line: `filter` (legacy IPv4), `ip6 filter`, `nft inet fw`.
pub(crate) fn table_name(family: &str, table: &str) -> String {
    match family {
        "ip" => table.to_string(),
        f => format!("{f} {table}"),
    }
}

/// "!! 250 packets (13.0 KiB) to udp 10.96.0.15:80 dropped by filter KUBE-FIREWALL `-m mark
/// --mark 0x8000/0x8000 -j DROP` in 1.00 s: kube-proxy's rule, added 41.2 s earlier by
/// iptables-restore (pid 4121), during calico-node's 1.50 s hold of /run/xtables.lock (pid 77)".
pub(crate) fn rule_drops_text(f: &RuleDropsFact) -> String {
    let mut s = format!(
        "!! {} packet{} ({})",
        thousands(f.packets),
        if f.packets == 1 { "" } else { "s" },
        human_bytes(f.bytes)
    );
    if !f.dests.is_empty() {
        let dests: Vec<String> = f
            .dests
            .iter()
            .map(|d| format!("{} {}", d.proto, d.dest))
            .collect();
        let _ = write!(s, " to {}", dests.join(", "));
    }
    let table = table_name(&f.family, &f.table);
    if f.rule.is_empty() {
        let _ = write!(s, " dropped by {table} {}'s DROP policy", f.chain);
    } else {
        let _ = write!(s, " dropped by {table} {} `{}`", f.chain, f.rule);
    }
    let _ = write!(s, " in {}", human_ns(f.ts_ns.saturating_sub(f.since_ns)));
    if f.reset {
        s.push_str(" (since a write replaced it)");
    }
    let whose = match (&f.owner, &f.chain_owner) {
        (Some(o), Some(c)) if o != c => format!("{o}'s rule in {c}'s chain"),
        (Some(o), _) => format!("{o}'s rule"),
        (None, _) if f.rule.is_empty() => "the chain's policy".to_string(),
        (None, _) => "a rule of no known agent".to_string(),
    };
    let _ = write!(s, ": {whose}");
    match &f.added {
        Some(a) => {
            let _ = write!(
                s,
                ", added {} earlier by {} (pid {})",
                human_ns(f.ts_ns.saturating_sub(a.ts_ns)),
                if a.program.is_empty() {
                    &a.agent
                } else {
                    &a.program
                },
                a.pid
            );
        }
        None if !f.rule.is_empty() => s.push_str(", there before the trace"),
        None => {}
    }
    if let Some(h) = &f.hold {
        let _ = write!(s, ", during {}'s ", h.agent);
        if let Some(ns) = h.hold_ns {
            let _ = write!(s, "{} ", human_ns(ns));
        }
        let _ = write!(s, "hold of {} (pid {})", h.lock, h.pid);
    }
    if f.others > 0 {
        let _ = write!(
            s,
            " ({} other rule{} dropped then too)",
            f.others,
            if f.others == 1 { "" } else { "s" }
        );
    }
    s
}

/// "!! 2 rules of nft inet fw drop without a counter (what they drop cannot be named; add
/// `counter`): input: tcp dport 22 drop, ...".
pub(crate) fn uncounted_drops_text(f: &UncountedDropsFact) -> String {
    format!(
        "!! {} rule{} of {} drop{} without a counter (what they drop cannot be named; add `counter` to name it): {}",
        f.rules.len(),
        if f.rules.len() == 1 { "" } else { "s" },
        table_name(&f.family, &f.table),
        if f.rules.len() == 1 { "s" } else { "" },
        some_names(&f.rules, 3)
    )
}
