//! `xtlock completions SHELL` and `xtlock man` (both hidden): shell completions and the
//! xtlock(8) page, generated from the clap definitions, so they cannot drift from the
//! parser. They need no root, kernel or cluster: `cargo xtask deb` runs them to fill the
//! package, and users of the bare binary can run them too.

use std::io::Write;

use anyhow::Context as _;
use clap::CommandFactory as _;
use clap_mangen::{roff, Man};

use crate::cli::{Cli, CompletionsArgs};

/// The page's section: system administration (tracing needs root), as bpftrace and tcpdump.
const SECTION: &str = "8";

pub fn completions(args: &CompletionsArgs) -> anyhow::Result<()> {
    let mut out = Vec::new();
    write_completions(args.shell, &mut out);
    std::io::stdout()
        .lock()
        .write_all(&out)
        .context("writing the completions to stdout")
}

pub fn man() -> anyhow::Result<()> {
    let page = man_page().context("rendering the manual page")?;
    std::io::stdout()
        .lock()
        .write_all(&page)
        .context("writing the manual page to stdout")
}

pub fn write_completions(shell: clap_complete::Shell, out: &mut Vec<u8>) {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "xtlock", out);
}

/// One page for the whole tool: clap_mangen's top-level sections, then a COMMANDS section
/// with each visible subcommand's synopsis, description and options (clap_mangen alone
/// would point to one page per subcommand, which a single binary's package does not ship).
pub fn man_page() -> std::io::Result<Vec<u8>> {
    let mut root = Cli::command();
    // Propagates the global options and names every subcommand `xtlock <name>`.
    root.build();
    let man = Man::new(root.clone()).section(SECTION);
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    man.render_options_section(&mut out)?;

    out.extend_from_slice(b".SH COMMANDS\n");
    for sub in root.get_subcommands().filter(|s| !s.is_hide_set()) {
        // The global options and --help are listed once, above, not under each command.
        let mut sub = sub.clone();
        let globals: Vec<String> = sub
            .get_arguments()
            .filter(|a| a.is_global_set() || a.get_id() == "help")
            .map(|a| a.get_id().to_string())
            .collect();
        for id in globals {
            sub = sub.mut_arg(id, |a| a.hide(true));
        }
        let sub_man = Man::new(sub.clone());
        let mut synopsis = Vec::new();
        sub_man.render_synopsis_section(&mut synopsis)?;
        out.extend_from_slice(b".SS ");
        out.extend(quoted(&format!("xtlock {}", sub.get_name())));
        out.push(b'\n');
        out.extend(demote(&synopsis));
        let mut about = Vec::new();
        sub_man.render_description_section(&mut about)?;
        out.extend(demote(&about));
        let mut options = Vec::new();
        sub_man.render_options_section(&mut options)?;
        out.extend(demote(&options));
    }
    man.render_version_section(&mut out)?;
    let mut see_also = roff::Roff::new();
    see_also.control("SH", ["SEE ALSO"]);
    see_also.text([roff::roman(
        "iptables(8), flock(2), bpftrace(8); /usr/share/doc/xtlock",
    )]);
    see_also.to_writer(&mut out)?;
    Ok(out)
}

/// A subcommand's sections, rendered as a page of its own, made part of its `.SS`: the
/// SYNOPSIS and DESCRIPTION headings go, the options' headings (OPTIONS, and clap's help
/// headings such as PACKET DROPS AND CONNTRACK) become bold paragraph leads.
fn demote(section: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(section);
    let mut out = String::new();
    for line in text.lines() {
        let Some(name) = line.strip_prefix(".SH ") else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        out.push_str(".PP\n");
        let name = name.trim_matches('"');
        if name != "SYNOPSIS" && name != "DESCRIPTION" {
            let mut lead = name.to_lowercase();
            if let Some(first) = lead.get_mut(..1) {
                first.make_ascii_uppercase();
            }
            lead.push(':');
            out.push_str(".B ");
            out.push_str(&String::from_utf8_lossy(&quoted(&lead)));
            out.push('\n');
        }
    }
    out.into_bytes()
}

/// A roff macro argument with spaces, in double quotes.
fn quoted(s: &str) -> Vec<u8> {
    format!("\"{}\"", s.replace('"', "\"\"")).into_bytes()
}

#[cfg(test)]
mod tests {
    use std::{
        io::Write as _,
        process::{Command, Stdio},
    };

    use super::*;

    /// Runs `program args` with `input` on stdin; `None` when the program is not installed
    /// (a failure under CI=true, where every tool setup installs must be there).
    fn run_with_input(program: &str, args: &[&str], input: &[u8]) -> Option<(bool, String)> {
        let child = Command::new(program)
            .args(args)
            // ASCII output: no Unicode minus signs in place of the flags' hyphens.
            .env("LC_ALL", "C")
            .env("MANWIDTH", "250")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                assert!(
                    std::env::var("CI").as_deref() != Ok("true"),
                    "{program} is not installed (`cargo xtask setup` installs it)"
                );
                eprintln!("skipped: {program} is not installed");
                return None;
            }
            Err(e) => panic!("cannot run {program}: {e}"),
        };
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(input)
            .expect("writing stdin");
        let out = child.wait_with_output().expect("waiting");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Some((out.status.success(), text))
    }

    /// Every visible subcommand and its visible options, from the clap Command itself.
    fn visible_tree() -> Vec<(String, Vec<String>)> {
        let mut root = Cli::command();
        root.build();
        let flags = |c: &clap::Command| -> Vec<String> {
            c.get_arguments()
                .filter(|a| !a.is_hide_set())
                .flat_map(|a| {
                    let mut v: Vec<String> =
                        a.get_long().map(|l| format!("--{l}")).into_iter().collect();
                    v.extend(a.get_short().map(|s| format!("-{s}")));
                    if a.is_positional() {
                        v.extend(
                            a.get_value_names()
                                .into_iter()
                                .flatten()
                                .map(|n| n.to_string()),
                        );
                    }
                    v
                })
                .collect()
        };
        let mut out = vec![(String::new(), flags(&root))];
        for sub in root.get_subcommands().filter(|s| !s.is_hide_set()) {
            out.push((sub.get_name().to_owned(), flags(sub)));
        }
        out
    }

    #[test]
    fn man_page_renders_with_every_command_and_option() {
        let page = man_page().expect("renders");
        let Some((ok, text)) = run_with_input("man", &["-l", "--no-hyphenation", "-"], &page)
        else {
            return;
        };
        assert!(ok, "man -l failed:\n{text}");
        // groff's complaints (unknown macros, bad escapes) go to stderr, which is in `text`.
        assert!(!text.contains("warning"), "{text}");
        let tree = visible_tree();
        assert!(tree.len() >= 7, "{tree:?}");
        let words: std::collections::HashSet<&str> = text
            .split(|c: char| c.is_whitespace() || "[]|,=<>()".contains(c))
            .collect();
        for (name, flags) in &tree {
            if !name.is_empty() {
                assert!(
                    text.contains(&format!("xtlock {name}")),
                    "no section for `xtlock {name}` in:\n{text}"
                );
            }
            for f in flags {
                assert!(
                    words.contains(f.as_str()),
                    "`{f}` of `xtlock {name}` is not on the page:\n{text}"
                );
            }
        }
        // Under its own command: --record-dir is the daemon's, not trace's.
        let daemon = text.find("xtlock daemon").expect("daemon section");
        assert!(text[daemon..].contains("--record-dir"), "{text}");
        // The hidden helpers stay out of the page.
        assert!(!text.contains("xtlock completions"), "{text}");
    }

    #[test]
    fn completions_parse_and_name_every_command() {
        let tree = visible_tree();
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let mut script = Vec::new();
            write_completions(shell, &mut script);
            let text = String::from_utf8_lossy(&script);
            for (name, flags) in &tree {
                assert!(text.contains(name.as_str()), "{shell}: no `{name}`");
                for f in flags.iter().filter(|f| f.starts_with("--")) {
                    // fish writes `-l record-dir` rather than `--record-dir`.
                    let bare = f.trim_start_matches('-');
                    assert!(text.contains(bare), "{shell}: no `{f}` of `{name}`");
                }
            }
        }
        let mut bash = Vec::new();
        write_completions(clap_complete::Shell::Bash, &mut bash);
        if let Some((ok, text)) = run_with_input("bash", &["-n"], &bash) {
            assert!(ok, "bash -n rejects the completion script:\n{text}");
        }
    }
}
