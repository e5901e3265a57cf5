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
    for sub in commands(&root) {
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

/// The commands the page and its tests cover: the visible ones, without clap's `help`
/// (which `--help` and the page itself stand for).
fn commands(root: &clap::Command) -> impl Iterator<Item = &clap::Command> {
    root.get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
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

    /// What a program printed on stdin `input`: exit status, stdout, stderr.
    struct Ran {
        ok: bool,
        stdout: String,
        stderr: String,
    }

    /// Runs `program args` with `input` on stdin; `None` when the program is not installed
    /// (a failure under CI=true, where every tool setup installs must be there).
    fn run_with_input(program: &str, args: &[&str], input: &[u8]) -> Option<Ran> {
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
        Some(Ran {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// The rendered page cut at its command headings (`   xtlock NAME`, as man indents a
    /// `.SS`): "" for what comes before them (name, synopsis, global options).
    fn sections(page: &str) -> std::collections::HashMap<String, String> {
        let mut out = std::collections::HashMap::<String, String>::new();
        let mut current = String::new();
        for line in page.lines() {
            if let Some(name) = line.strip_prefix("   xtlock ") {
                if !name.starts_with(' ') && !name.contains(' ') {
                    current = name.to_owned();
                }
            }
            let s = out.entry(current.clone()).or_default();
            s.push_str(line);
            s.push('\n');
        }
        out
    }

    /// Every visible subcommand and its visible options, from the clap Command itself
    /// ("" for the top level). A command's own options only: the global ones and --help are
    /// listed once, at the top.
    fn visible_tree() -> Vec<(String, Vec<clap::Arg>)> {
        let mut root = Cli::command();
        root.build();
        let args = |c: &clap::Command, own: bool| -> Vec<clap::Arg> {
            c.get_arguments()
                .filter(|a| !a.is_hide_set())
                .filter(|a| !own || !(a.is_global_set() || a.get_id() == "help"))
                .cloned()
                .collect()
        };
        let mut out = vec![(String::new(), args(&root, false))];
        for sub in commands(&root) {
            out.push((sub.get_name().to_owned(), args(sub, true)));
        }
        out
    }

    /// How the page's entry for `a` begins (`-o, --output`, `--json`, `<FILE>`).
    fn entry(a: &clap::Arg) -> String {
        match (a.get_short(), a.get_long()) {
            (Some(s), Some(l)) => format!("-{s}, --{l}"),
            (None, Some(l)) => format!("--{l}"),
            (Some(s), None) => format!("-{s}"),
            (None, None) => {
                let names = a.get_value_names().unwrap_or_default();
                format!("<{}>", names.first().map_or("", |n| n.as_str()))
            }
        }
    }

    #[test]
    fn man_page_renders_with_every_command_and_option() {
        let page = man_page().expect("renders");
        let Some(man) = run_with_input("man", &["-l", "--no-hyphenation", "-"], &page) else {
            return;
        };
        assert!(man.ok, "man -l failed:\n{}", man.stderr);
        // groff's complaints (unknown macros, bad escapes, lines it cannot fit).
        assert!(man.stderr.trim().is_empty(), "{}", man.stderr);
        let tree = visible_tree();
        assert!(tree.len() >= 7, "{tree:?}");
        let sections = sections(&man.stdout);
        for (name, args) in &tree {
            // Each option has its entry (an indented line that starts with it, not just a
            // mention in the synopsis) under its own command's heading.
            let text = sections
                .get(name)
                .unwrap_or_else(|| panic!("no section for `xtlock {name}`:\n{}", man.stdout));
            for a in args {
                let want = entry(a);
                assert!(
                    text.lines().any(|l| l.trim_start().starts_with(&want)),
                    "no entry `{want}` under `xtlock {name}`:\n{text}"
                );
            }
        }
        assert_eq!(sections.len(), tree.len(), "{:?}", sections.keys());
        // The hidden helpers stay out of the page.
        assert!(!man.stdout.contains("xtlock completions"), "{}", man.stdout);
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
            for (name, args) in &tree {
                assert!(text.contains(name.as_str()), "{shell}: no `{name}`");
                // fish writes `-l record-dir` rather than `--record-dir`.
                for long in args.iter().filter_map(|a| a.get_long()) {
                    assert!(text.contains(long), "{shell}: no `--{long}` of `{name}`");
                }
            }
        }
        let mut bash = Vec::new();
        write_completions(clap_complete::Shell::Bash, &mut bash);
        if let Some(ran) = run_with_input("bash", &["-n"], &bash) {
            assert!(
                ran.ok,
                "bash -n rejects the completion script:\n{}",
                ran.stderr
            );
        }
    }
}
