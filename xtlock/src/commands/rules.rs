//! `xtlock rules` (hidden): the legacy iptables (`--ip6`: ip6tables) tables of the current
//! network namespace as xtlock reads them after a write, printed the way `iptables-save`
//! prints them, without counters (`*table`, `:CHAIN POLICY`, `-A CHAIN rule...`, `COMMIT`);
//! with `--nft`, the nf_tables tables iptables-nft (ip6tables-nft) writes, the way
//! `iptables-nft-save` prints them. It asks the same reader the traces use
//! (`source::rules`), as if each table had just been written, so what it prints is what a
//! rule diff compares; `tests/tests/tables.rs` holds it against `iptables-legacy-save` and
//! `iptables-nft-save`. Needs CAP_NET_ADMIN (and CAP_SYS_ADMIN: the reader enters the
//! namespace, here its own).

use std::io::Write as _;
use std::time::Duration;

use anyhow::{bail, Context as _};

use crate::cli::RulesArgs;
use crate::decode::nft_table::{iptables_words, IPTABLES_TABLES};
use crate::decode::xt_table::Family;
use crate::event::{ChainState, Comm, Event, NftCommitEvent, TableHead, TableReplaceEvent};
use crate::source::rules::RuleReader;

/// How long the reader may take for every table asked (a 100k-rule table reads in ~1 s).
const READ_TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(args: &RulesArgs) -> anyhow::Result<()> {
    let family = if args.ip6 { Family::Ipv6 } else { Family::Ipv4 };
    let netns = {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata("/proc/self/ns/net").context("this network namespace")?;
        u32::try_from(m.ino()).context("netns inode")?
    };
    let out = if args.nft {
        nft_tables(family, &args.table, netns)?
    } else {
        legacy_tables(family, &args.table, netns)?
    };
    std::io::stdout()
        .lock()
        .write_all(out.as_bytes())
        .context("writing the rules to stdout")
}

fn legacy_tables(family: Family, asked: &[String], netns: u32) -> anyhow::Result<String> {
    let tables = if asked.is_empty() {
        loaded_tables(family)?
    } else {
        asked.to_vec()
    };
    let mut reader = RuleReader::start().context("starting the rule reader")?;
    for t in &tables {
        reader.on_event(&Event::TableReplace(written(family, t, netns)));
    }
    let mut events = Vec::new();
    reader.finish(&mut events, READ_TIMEOUT);
    let mut out = String::new();
    for t in &tables {
        let Some(chains) = read_back(&events, family.name(), t)? else {
            bail!("table {t} not read within {READ_TIMEOUT:?}");
        };
        out.push_str(&format!("*{t}\n"));
        for c in &chains {
            let policy = c.policy.as_deref().unwrap_or("-");
            out.push_str(&format!(":{} {policy}\n", c.name));
        }
        for c in &chains {
            push_rules(&mut out, c);
        }
        out.push_str("COMMIT\n");
    }
    Ok(out)
}

/// The iptables-nft tables of this namespace, in `iptables-nft-save`'s order and layout:
/// the tables as iptables orders them, each built-in chain (one the kernel lacks with policy
/// `ACCEPT`, as the save prints it), then the user chains by name; their rules in that
/// order. A table holding a rule iptables-nft cannot express is said incompatible, as the
/// save says it, and printed anyway, those rules in nft's words; a base chain iptables does
/// not define is said and left out, as the save does.
fn nft_tables(family: Family, asked: &[String], netns: u32) -> anyhow::Result<String> {
    let mut reader = RuleReader::start().context("starting the rule reader")?;
    reader.on_event(&Event::NftCommit(NftCommitEvent {
        ts_ns: 0,
        enter_ns: 0,
        tgid: std::process::id(),
        tid: std::process::id(),
        netns,
        comm: Comm::new("xtlock"),
        batch: None,
    }));
    let mut events = Vec::new();
    reader.finish(&mut events, READ_TIMEOUT);
    // A namespace not read at all (too large, an error) is said as the family `nft`.
    read_back(&events, "nft", "*")?;
    let nft_family = format!("nft {}", family.name());
    let mut out = String::new();
    for (t, builtin) in IPTABLES_TABLES {
        if !asked.is_empty() && !asked.iter().any(|a| a == t) {
            continue;
        }
        let Some(chains) = read_back(&events, &nft_family, t)? else {
            continue;
        };
        let base = |name: &str| chains.iter().find(|c| c.name == name && c.policy.is_some());
        let mut user: Vec<&ChainState> = chains.iter().filter(|c| c.policy.is_none()).collect();
        user.sort_by(|a, b| a.name.cmp(&b.name));
        if !chains
            .iter()
            .flat_map(|c| c.rules.iter().flatten())
            .all(iptables_words)
        {
            out.push_str(&format!("# Table `{t}' is incompatible, use 'nft' tool.\n"));
        } else if chains
            .iter()
            .any(|c| c.policy.is_some() && !builtin.contains(&c.name.as_str()))
        {
            // A base chain iptables does not define: left out, as the save leaves it out.
            out.push_str(&format!(
                "# Table `{t}' contains incompatible base-chains, use 'nft' tool to list them.\n"
            ));
        }
        out.push_str(&format!("*{t}\n"));
        for b in builtin.iter() {
            let policy = base(b)
                .and_then(|c| c.policy.as_deref())
                .unwrap_or("ACCEPT");
            out.push_str(&format!(":{b} {policy}\n"));
        }
        for c in &user {
            out.push_str(&format!(":{} -\n", c.name));
        }
        for c in builtin.iter().filter_map(|b| base(b)).chain(user) {
            push_rules(&mut out, c);
        }
        out.push_str("COMMIT\n");
    }
    Ok(out)
}

/// The chains of `table` of `family` as read, a large table's parts put together (a chain
/// may continue in the next part); `None` when it was not read.
fn read_back(
    events: &[Event],
    family: &str,
    table: &str,
) -> anyhow::Result<Option<Vec<ChainState>>> {
    let mut chains: Vec<ChainState> = Vec::new();
    let mut found = false;
    for ev in events {
        let Event::RuleTable(rt) = ev else { continue };
        if rt.family != family || rt.table != table {
            continue;
        }
        found = true;
        if !rt.skipped.is_empty() {
            bail!("table {family} {table} not read: {}", rt.skipped);
        }
        for c in &rt.chains {
            match chains.last_mut() {
                Some(last) if last.name == c.name => last
                    .rules
                    .get_or_insert_with(Vec::new)
                    .extend(c.rules.iter().flatten().cloned()),
                _ => chains.push(c.clone()),
            }
        }
    }
    Ok(found.then_some(chains))
}

/// A chain's rules as `-A CHAIN rule...` lines.
fn push_rules(out: &mut String, c: &ChainState) {
    for r in c.rules.iter().flatten() {
        // A rule of no parts (no match, no target) is a bare `-A CHAIN`.
        let text = r.text();
        let sep = if text.is_empty() { "" } else { " " };
        out.push_str(&format!("-A {}{sep}{text}\n", c.name));
    }
}

/// The family's tables loaded in this namespace, as iptables-save finds them
/// (`/proc/net/ip_tables_names`, `ip6_tables_names`).
fn loaded_tables(family: Family) -> anyhow::Result<Vec<String>> {
    let path = match family {
        Family::Ipv4 => "/proc/net/ip_tables_names",
        Family::Ipv6 => "/proc/net/ip6_tables_names",
    };
    let names = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    Ok(names.lines().map(str::to_string).collect())
}

/// A successful replace of `table` by this process: what makes the reader read it.
fn written(family: Family, table: &str, netns: u32) -> TableReplaceEvent {
    let mut name = [0u8; xtlock_common::XT_TABLE_MAXNAMELEN];
    let n = table.len().min(name.len() - 1);
    name[..n].copy_from_slice(&table.as_bytes()[..n]);
    TableReplaceEvent {
        ts_ns: 0,
        enter_ns: 0,
        tgid: std::process::id(),
        tid: std::process::id(),
        level: match family {
            Family::Ipv4 => xtlock_common::SOL_IP,
            Family::Ipv6 => xtlock_common::SOL_IPV6,
        },
        optname: xtlock_common::XT_SO_SET_REPLACE,
        optlen: 0,
        ret: 0,
        head: Some(Box::new(TableHead {
            name,
            entries: 0,
            bytes: 0,
        })),
        head_recorded: true,
        read: false,
        netns,
    }
}
