//! What an iptables-family process is: a restore, a save or a single command; of which family;
//! through which backend when its name says. Read from the program as exec'd (argv[0], then
//! the file's name), never from the comm, which the kernel cuts at 15 bytes:
//! `iptables-legacy-restore` has the comm `iptables-legacy`, `iptables-nft-restore`
//! `iptables-nft-re`. The multi-call binaries (`xtables-legacy-multi`, `xtables-nft-multi`)
//! pick their applet from argv[0]'s base name, or from argv[1] when called by their own name;
//! this reads them the same way.

use serde::Serialize;

/// One iptables-family run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct IptablesRun {
    pub kind: RunKind,
    pub family: Family,
    /// `None`: the name does not say (`iptables-restore` is either, by Debian's alternatives).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<Backend>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunKind {
    /// `*-restore`: a whole ruleset (or table) written at once; an agent's sync.
    Restore,
    /// `*-save`: a read of the rules.
    Save,
    /// A single command (`iptables -A ...`, `-L`, `-C`).
    Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Ip,
    Ip6,
    Arp,
    Eb,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Legacy,
    Nft,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Legacy => "legacy",
            Backend::Nft => "nft",
        }
    }
}

impl IptablesRun {
    /// The run `argv` and `filename` (the path given to execve) describe; `None` for anything
    /// else (and for `*-translate`, which writes nothing).
    pub fn classify<'a>(
        mut argv: impl Iterator<Item = &'a str>,
        filename: &str,
    ) -> Option<IptablesRun> {
        let arg0 = argv.next().map(basename);
        let arg1 = argv.next().map(basename);
        if let Some(r) = arg0.and_then(|a| Self::from_name(a, arg1)) {
            return Some(r);
        }
        // argv[0] can be anything the caller chose (`exec -a`); the file is what runs.
        let file = basename(filename);
        (!file.is_empty())
            .then(|| Self::from_name(file, arg1))
            .flatten()
    }

    /// `name` is a program's base name; `next` the base name of the argument after it (a
    /// multi-call binary's applet).
    fn from_name(name: &str, next: Option<&str>) -> Option<IptablesRun> {
        if let Some(backend) = multi_backend(name) {
            let mut r = next.and_then(parse)?;
            r.backend = Some(backend);
            return Some(r);
        }
        parse(name)
    }

    pub fn is_restore(&self) -> bool {
        self.kind == RunKind::Restore
    }
}

/// `xtables-legacy-multi` / `xtables-nft-multi`: their backend.
fn multi_backend(name: &str) -> Option<Backend> {
    match name {
        "xtables-legacy-multi" => Some(Backend::Legacy),
        "xtables-nft-multi" => Some(Backend::Nft),
        _ => None,
    }
}

/// `{ip,ip6,arp,eb}tables[-legacy|-nft][-restore|-save]`.
fn parse(name: &str) -> Option<IptablesRun> {
    // Longest first: `ip6tables` would otherwise not be told from `ip`.
    let (family, rest) = [
        ("ip6tables", Family::Ip6),
        ("iptables", Family::Ip),
        ("arptables", Family::Arp),
        ("ebtables", Family::Eb),
    ]
    .into_iter()
    .find_map(|(p, f)| name.strip_prefix(p).map(|rest| (f, rest)))?;
    let (backend, rest) = if let Some(r) = rest.strip_prefix("-legacy") {
        (Some(Backend::Legacy), r)
    } else if let Some(r) = rest.strip_prefix("-nft") {
        (Some(Backend::Nft), r)
    } else {
        (None, rest)
    };
    let kind = match rest {
        "" => RunKind::Command,
        "-restore" => RunKind::Restore,
        "-save" => RunKind::Save,
        _ => return None,
    };
    Some(IptablesRun {
        kind,
        family,
        backend,
    })
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(argv: &[&str], file: &str) -> Option<IptablesRun> {
        IptablesRun::classify(argv.iter().copied(), file)
    }

    fn r(kind: RunKind, family: Family, backend: Option<Backend>) -> Option<IptablesRun> {
        Some(IptablesRun {
            kind,
            family,
            backend,
        })
    }

    #[test]
    fn every_name_a_restore_runs_by() {
        use Backend::*;
        use Family::*;
        use RunKind::*;
        for (name, want) in [
            ("iptables-restore", r(Restore, Ip, None)),
            ("ip6tables-restore", r(Restore, Ip6, None)),
            ("iptables-legacy-restore", r(Restore, Ip, Some(Legacy))),
            ("ip6tables-legacy-restore", r(Restore, Ip6, Some(Legacy))),
            ("iptables-nft-restore", r(Restore, Ip, Some(Nft))),
            ("ip6tables-nft-restore", r(Restore, Ip6, Some(Nft))),
            ("ebtables-legacy-restore", r(Restore, Eb, Some(Legacy))),
            ("arptables-nft-save", r(Save, Arp, Some(Nft))),
            ("iptables-save", r(Save, Ip, None)),
            ("iptables", r(Command, Ip, None)),
            ("iptables-legacy", r(Command, Ip, Some(Legacy))),
            ("ip6tables-nft", r(Command, Ip6, Some(Nft))),
            ("iptables-restore-translate", None),
            ("iptables-apply", None),
            ("nft", None),
        ] {
            assert_eq!(
                run(&[name, "-w"], &format!("/usr/sbin/{name}")),
                want,
                "{name}"
            );
            // argv[0] as a full path, the way Go's exec.Command passes it.
            assert_eq!(run(&[&format!("/sbin/{name}")], "/sbin/x"), want, "{name}");
        }
    }

    #[test]
    fn multi_call_binaries_by_link_or_by_applet() {
        // Through a link: argv[0] is the link's name, the file is the link's path.
        assert_eq!(
            run(
                &["iptables-legacy-restore"],
                "/usr/sbin/iptables-legacy-restore"
            ),
            r(RunKind::Restore, Family::Ip, Some(Backend::Legacy))
        );
        // By its own name with the applet after it.
        assert_eq!(
            run(
                &["xtables-nft-multi", "ip6tables-restore", "-w"],
                "/usr/sbin/xtables-nft-multi"
            ),
            r(RunKind::Restore, Family::Ip6, Some(Backend::Nft))
        );
        assert_eq!(
            run(
                &["xtables-legacy-multi", "-V"],
                "/usr/sbin/xtables-legacy-multi"
            ),
            None
        );
    }

    #[test]
    fn argv0_chosen_by_the_caller_falls_back_to_the_file() {
        assert_eq!(
            run(&["kube-proxy-sync"], "/usr/sbin/iptables-nft-restore"),
            r(RunKind::Restore, Family::Ip, Some(Backend::Nft))
        );
        assert_eq!(
            run(&[], "/usr/sbin/iptables-save"),
            r(RunKind::Save, Family::Ip, None)
        );
        assert_eq!(run(&["sh"], "/bin/sh"), None);
    }
}
