//! `cargo xtask kernels-doc`: writes the generated part of docs/kernels.md from the VM runs'
//! results (`<results>/<series>/probes.json`, written by `xtlock probes --json` first thing in
//! each VM, with `kernel` and `skips` beside it): per kernel, which hook each feature used
//! (fentry, kprobe, tp_btf, tracepoint), why not a better one, what was unavailable, and the
//! tests skipped there. `vm-test` runs it after a run of every series.
//!
//! Only the text between the two markers is replaced; the rest of the file (the support
//! floor, the introduction) is written by hand.
use std::{fs, path::Path};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{arch::Arch, vm::kernel::SERIES};

const BEGIN: &str = "<!-- BEGIN GENERATED: `cargo xtask kernels-doc` writes this part from the \
                     VM runs' `xtlock probes --json`; do not edit it by hand -->";
const END: &str = "<!-- END GENERATED -->";

/// One kernel's results.
struct Run {
    series: &'static str,
    /// The guest's architecture: amd64 results are in `<results>/<series>`, the others in
    /// `<results>/<arch>/<series>`.
    arch: Arch,
    /// Seconds from starting QEMU to the first command, and per command its label and
    /// seconds (`timing`, `commands`).
    boot: Option<f64>,
    commands: Vec<(String, f64, i32)>,
    release: String,
    package: String,
    probes: Value,
    skips: Vec<String>,
}

/// Regenerates `doc` from the per-series folders of `results`; Ok(false) when no series has
/// results (nothing written).
pub fn write(results: &Path, doc: &Path) -> Result<bool> {
    let runs = read_runs(results)?;
    if runs.is_empty() {
        return Ok(false);
    }
    let old = fs::read_to_string(doc).with_context(|| format!("reading {}", doc.display()))?;
    let new = splice(&old, &render(&runs))
        .with_context(|| format!("{}: the generated part's markers", doc.display()))?;
    if new != old {
        fs::write(doc, new).with_context(|| format!("writing {}", doc.display()))?;
        println!(
            "kernels-doc: {} rewritten from {} ({})",
            doc.display(),
            results.display(),
            runs.iter()
                .map(|r| r.label())
                .collect::<Vec<_>>()
                .join(", ")
        );
    } else {
        println!("kernels-doc: {} is up to date", doc.display());
    }
    Ok(true)
}

impl Run {
    /// `6.12` (amd64) or `6.12 arm64`: a column of the tables.
    fn label(&self) -> String {
        match self.arch {
            Arch::Amd64 => self.series.to_owned(),
            a => format!("{} {a}", self.series),
        }
    }
}

fn read_runs(results: &Path) -> Result<Vec<Run>> {
    let mut runs = Vec::new();
    let dirs = Arch::ALL.into_iter().flat_map(|arch| {
        SERIES.iter().map(move |(series, _)| {
            let dir = match arch {
                Arch::Amd64 => results.join(series),
                a => results.join(a.name()).join(series),
            };
            (arch, *series, dir)
        })
    });
    for (arch, series, dir) in dirs {
        let Ok(text) = fs::read_to_string(dir.join("probes.json")) else {
            continue;
        };
        let probes: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}/probes.json", dir.display()))?;
        let info = fs::read_to_string(dir.join("kernel")).unwrap_or_default();
        let field = |k: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or("?")
                .to_owned()
        };
        // Sorted: tests run in parallel threads, and the file should change only with facts.
        let mut skips: Vec<String> = fs::read_to_string(dir.join("skips"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        skips.sort();
        skips.dedup();
        let boot = fs::read_to_string(dir.join("timing")).ok().and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("boot="))
                .and_then(|v| v.trim().parse().ok())
        });
        let commands = fs::read_to_string(dir.join("commands"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(3, '\t');
                let rc = f.next()?.parse().ok()?;
                let ms: f64 = f.next()?.parse().ok()?;
                Some((f.next()?.to_owned(), ms / 1000.0, rc))
            })
            .collect();
        runs.push(Run {
            series,
            arch,
            boot,
            commands,
            release: field("release"),
            package: field("package"),
            probes,
            skips,
        });
    }
    Ok(runs)
}

/// `old` with the text between the markers replaced by `generated`.
fn splice(old: &str, generated: &str) -> Result<String> {
    let (Some(b), Some(e)) = (old.find(BEGIN), old.find(END)) else {
        bail!("missing `{BEGIN}` or `{END}`");
    };
    if e < b {
        bail!("the end marker comes before the begin marker");
    }
    Ok(format!(
        "{}{BEGIN}\n\n{generated}\n{}",
        &old[..b],
        &old[e..]
    ))
}

/// How a hook is attached, in one word: `tp_btf`, `fentry`, `kprobe`, `tracepoint`, or `-`.
fn kind(h: &Value) -> &str {
    if !h["error"].is_null() {
        return "-";
    }
    // Another hook does its job there (`sendmsg()` beside `nft_commit`).
    if h["needless"] == true {
        return "not needed";
    }
    let a = h["attach"].as_str().unwrap_or("");
    let first = a.split(' ').next().unwrap_or("");
    match first.split('/').next().unwrap_or("") {
        "fentry" | "fexit" => "fentry",
        "kprobe" | "kretprobe" => "kprobe",
        "tp_btf" => "tp_btf",
        "tracepoint" => "tracepoint",
        _ => "?",
    }
}

/// A reason for a table cell: verifier logs cut to their first line, pipes escaped.
fn cell(s: &str) -> String {
    let mut lines = s.lines();
    let mut out = lines.next().unwrap_or("").to_owned();
    let mut cut = false;
    for l in lines {
        // What follows a verifier log: `)` closing it, then the next reasons.
        match l.strip_prefix(')') {
            Some(rest) => {
                if cut {
                    out.push_str(" [verifier log cut]");
                    cut = false;
                }
                out.push(')');
                out.push_str(rest);
            }
            None => cut = true,
        }
    }
    if cut {
        out.push_str(" [verifier log cut]");
    }
    out.replace('|', "\\|")
}

/// The target of an attach text and its notes, each parenthesised group one:
/// `kprobe f (fallback; ...) (prototype not checked: ...)` -> (`kprobe f`, [`fallback; ...`,
/// `prototype not checked: ...`]). Unbalanced text is kept whole.
fn split_attach(a: &str) -> (&str, Vec<&str>) {
    let Some(i) = a.find(" (") else {
        return (a, Vec::new());
    };
    let rest = &a[i + 1..];
    let mut groups = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (j, c) in rest.char_indices() {
        match c {
            '(' => {
                if depth == 0 {
                    start = j + 1;
                }
                depth += 1;
            }
            ')' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    groups.push(&rest[start..j]);
                }
            }
            _ => {}
        }
    }
    if depth != 0 || groups.is_empty() {
        let whole = rest.trim();
        let whole = whole.strip_prefix('(').unwrap_or(whole);
        return (&a[..i], vec![whole.strip_suffix(')').unwrap_or(whole)]);
    }
    (&a[..i], groups)
}

fn render(runs: &[Run]) -> String {
    let mut o = String::new();
    let hooks_of = |r: &Run| r.probes["hooks"].as_array().cloned().unwrap_or_default();
    let first = hooks_of(&runs[0]);

    o.push_str("## Which hook each feature used\n\n");
    o.push_str(
        "`-`: not attached (the kernel's table below says why). Columns are x86-64 (amd64) \
         guests unless they name arm64.\n\n",
    );
    o.push_str("| Hook | What it gives |");
    for r in runs {
        o.push_str(&format!(" {} |", r.label()));
    }
    o.push_str("\n|---|---|");
    o.push_str(&"---|".repeat(runs.len()));
    o.push('\n');
    for h in &first {
        let name = h["program"].as_str().unwrap_or("?");
        o.push_str(&format!(
            "| `{name}` | {} |",
            cell(h["purpose"].as_str().unwrap_or(""))
        ));
        for r in runs {
            let k = hooks_of(r)
                .iter()
                .find(|x| x["program"] == name)
                .map_or("?".to_owned(), |x| kind(x).to_owned());
            o.push_str(&format!(" {k} |"));
        }
        o.push('\n');
    }

    o.push_str("\n## Features that depend on the kernel\n\n| Feature |");
    for r in runs {
        o.push_str(&format!(" {} |", r.label()));
    }
    o.push_str("\n|---|");
    o.push_str(&"---|".repeat(runs.len()));
    o.push('\n');
    let features = |r: &Run| r.probes["features"].as_array().cloned().unwrap_or_default();
    for f in features(&runs[0]) {
        let name = f["name"].as_str().unwrap_or("?");
        o.push_str(&format!("| {name} |"));
        for r in runs {
            let v = features(r)
                .iter()
                .find(|x| x["name"] == name)
                .map_or("?", |x| {
                    if x["available"] == true {
                        "yes"
                    } else {
                        "**no**"
                    }
                });
            o.push_str(&format!(" {v} |"));
        }
        o.push('\n');
    }

    for r in runs {
        o.push_str(&format!(
            "\n## Linux {} on {}: `{}` (Debian's {})\n\n",
            r.series,
            match r.arch {
                Arch::Amd64 => "x86-64",
                Arch::Arm64 => "arm64",
            },
            r.release,
            r.package
        ));
        // The times of the emulated arm64 guests, for CI's budget (amd64's are in
        // docs/performance.md's CI figures; here they would change the file every run).
        if r.arch != Arch::Amd64 && !r.commands.is_empty() {
            let times: Vec<String> = r
                .commands
                .iter()
                .map(|(label, secs, rc)| {
                    format!(
                        "{label} {secs:.1} s{}",
                        if *rc == 0 { "" } else { " (failed)" }
                    )
                })
                .collect();
            o.push_str(&format!(
                "Under QEMU/TCG on the CI machine: boot {}; {}.\n\n",
                r.boot.map_or("?".to_owned(), |b| format!("{b:.1} s")),
                times.join(", ")
            ));
        }
        o.push_str("| Hook | Attached as | Not used there, and why |\n|---|---|---|\n");
        for h in hooks_of(r) {
            let name = h["program"].as_str().unwrap_or("?");
            let attach = h["attach"].as_str().unwrap_or("");
            let (target, notes) = split_attach(attach);
            let (shown, why) = match h["error"].as_str() {
                Some(e) => (format!("not attached (would be {target})"), cell(e)),
                None => (
                    format!("`{target}`"),
                    notes.iter().map(|n| cell(n)).collect::<Vec<_>>().join("; "),
                ),
            };
            o.push_str(&format!("| `{name}` | {shown} | {why} |\n"));
        }
        o.push_str("\n| Feature | Available | Detail |\n|---|---|---|\n");
        for f in features(r) {
            o.push_str(&format!(
                "| {} | {} | {} |\n",
                f["name"].as_str().unwrap_or("?"),
                if f["available"] == true {
                    "yes"
                } else {
                    "**no**"
                },
                cell(f["detail"].as_str().unwrap_or(""))
            ));
        }
        if r.skips.is_empty() {
            o.push_str("\nNo test skipped on this kernel.\n");
        } else {
            o.push_str("\nTests skipped on this kernel, for the feature named:\n\n");
            for s in &r.skips {
                o.push_str(&format!("- {}\n", s.replace('|', "\\|")));
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splices_between_the_markers_only() {
        let old = format!("intro\n{BEGIN}\nold table\n{END}\nfloor\n");
        let new = splice(&old, "new table\n").unwrap();
        assert_eq!(
            new,
            format!("intro\n{BEGIN}\n\nnew table\n\n{END}\nfloor\n")
        );
        assert!(splice("no markers", "x").is_err());
    }

    #[test]
    fn attach_texts_become_kinds_and_reasons() {
        let h: Value = serde_json::json!({
            "attach": "kprobe/kretprobe f (fallback; fentry: refused. Verifier output: a\nb\n)",
            "error": null
        });
        assert_eq!(kind(&h), "kprobe");
        let (t, n) = split_attach(h["attach"].as_str().unwrap());
        assert_eq!(t, "kprobe/kretprobe f");
        assert_eq!(n.len(), 1);
        assert_eq!(
            cell(n[0]),
            "fallback; fentry: refused. Verifier output: a [verifier log cut]"
        );
        let (t, n) = split_attach("kprobe f (fallback; fentry: x (no BTF)) (unchecked: y (z))");
        assert_eq!(t, "kprobe f");
        assert_eq!(n, ["fallback; fentry: x (no BTF)", "unchecked: y (z)"]);
        assert_eq!(split_attach("tracepoint a:b").1, Vec::<&str>::new());
        let off: Value = serde_json::json!({"attach": "kprobe", "error": "x | y"});
        assert_eq!(kind(&off), "-");
        let needless: Value = serde_json::json!({
            "attach": "not needed: nft_commit times and counts the batches",
            "error": null,
            "needless": true
        });
        assert_eq!(kind(&needless), "not needed");
        assert_eq!(cell("x | y"), "x \\| y");
        let tp: Value =
            serde_json::json!({"attach": "tp_btf filelock:flock_lock_inode", "error": null});
        assert_eq!(kind(&tp), "tp_btf");
    }
}
