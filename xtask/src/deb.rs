//! `cargo xtask deb [--test]`: the Debian package `target/deb/xtlock_VERSION_ARCH.deb`, made
//! with dpkg-deb from the static binary of `cargo xtask image` (no libc dependency, so the
//! package has no Depends), the xtlock(8) page and the bash, zsh and fish completions the
//! binary generates from its clap definitions (`xtlock man`, `xtlock completions SHELL`),
//! and the systemd unit, its defaults, tmpfiles.d entry and maintainer scripts from
//! `deploy/debian/`.
//!
//! `--test` installs it into a clean Debian 12 root made by debootstrap (minbase, plus
//! systemd and man-db, as on a host; cached as `target/deb-test/bookworm-minbase.tar.gz`)
//! with apt and nothing else, runs the binary there, finds the page and completions where the
//! tools look, checks the conffile, verifies the unit with `systemd-analyze verify`, purges
//! the package, and runs the daemon on this host with exactly the unit's capabilities, in a
//! read-only file system as the unit's sandbox makes it.
use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, ensure, Context as _, Result};
use clap::Args;

use crate::{image, setup, sh};

#[derive(Args, Debug, Default)]
pub struct DebArgs {
    /// Also install the package into a clean Debian root (debootstrap) and check it there
    /// (as root).
    #[arg(long)]
    pub test: bool,
    /// Skip `xtask setup` (`cargo xtask test` has run it already).
    #[arg(long)]
    pub no_setup: bool,
}

/// The suite of the clean root: the Debian the package is built on and for.
const SUITE: &str = "bookworm";

/// Where a file of the package comes from.
enum Source {
    /// The static binary.
    Binary,
    /// What the binary prints with these arguments, gzipped when the path ends in `.gz`.
    Generated(&'static [&'static str]),
    /// A file of `deploy/debian/`.
    Repo(&'static str),
    /// The changelog Debian's tools expect of a native package: this version, this commit.
    Changelog,
}

/// The package's files: path in it, mode, source.
const FILES: &[(&str, u32, Source)] = &[
    ("usr/bin/xtlock", 0o755, Source::Binary),
    (
        "usr/share/man/man8/xtlock.8.gz",
        0o644,
        Source::Generated(&["man"]),
    ),
    (
        "usr/share/bash-completion/completions/xtlock",
        0o644,
        Source::Generated(&["completions", "bash"]),
    ),
    (
        "usr/share/zsh/vendor-completions/_xtlock",
        0o644,
        Source::Generated(&["completions", "zsh"]),
    ),
    (
        "usr/share/fish/vendor_completions.d/xtlock.fish",
        0o644,
        Source::Generated(&["completions", "fish"]),
    ),
    // /lib, not /usr/lib: Debian 12's systemd packages ship their units there (dpkg does
    // not know /lib and /usr/lib are one directory on merged-/usr systems).
    (
        "lib/systemd/system/xtlock.service",
        0o644,
        Source::Repo("xtlock.service"),
    ),
    (
        "usr/lib/tmpfiles.d/xtlock.conf",
        0o644,
        Source::Repo("tmpfiles.conf"),
    ),
    ("etc/default/xtlock", 0o644, Source::Repo("default")),
    (
        "usr/share/doc/xtlock/copyright",
        0o644,
        Source::Repo("copyright"),
    ),
    (
        "usr/share/doc/xtlock/changelog.gz",
        0o644,
        Source::Changelog,
    ),
];

/// The package's maintainer: the project, as its commits name it.
const MAINTAINER: &str = "xtlock developers <dev@xtlock.invalid>";

/// The highest `systemd-analyze security` exposure the unit may have, in tenths.
const EXPOSURE_MAX_TENTHS: u32 = 40;

/// Maintainer scripts (from `deploy/debian/`).
const SCRIPTS: &[&str] = &["postinst", "prerm", "postrm"];

pub fn run(args: &DebArgs) -> Result<()> {
    if !args.no_setup {
        setup::run_build()?;
        if args.test {
            setup::deb_packages()?;
        }
    }
    let root = sh::workspace_root();
    let bin = image::static_binary(&root)?;
    let deb = build(&root, &bin)?;
    println!(
        "deb: {} ({:.1} MiB)",
        deb.display(),
        fs::metadata(&deb)?.len() as f64 / 1024.0 / 1024.0
    );
    if args.test {
        let start = Instant::now();
        test(&root, &deb, &bin)?;
        println!(
            "ok: the package checks took {:.1}s",
            start.elapsed().as_secs_f64()
        );
    } else {
        // apt takes a path with a slash for a file, not a package name.
        println!("install it with `apt install {}`", deb.display());
    }
    Ok(())
}

/// `dpkg --print-architecture`: the package is for the machine that built the binary.
fn architecture() -> Result<String> {
    let out = sh::capture(Command::new("dpkg").arg("--print-architecture"))
        .context("`dpkg --print-architecture` failed")?;
    Ok(out.trim().to_owned())
}

/// Output of `bin args` (stdout), failing with its stderr.
fn output_of(bin: &Path, args: &[&str]) -> Result<Vec<u8>> {
    let out = Command::new(bin)
        .args(args)
        .output()
        .with_context(|| format!("running {} {}", bin.display(), args.join(" ")))?;
    ensure!(
        out.status.success() && !out.stdout.is_empty(),
        "`{} {}` failed ({}): {}",
        bin.display(),
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    fs::write(path, data).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

/// `program args` with `data` on stdin; its stdout.
fn pipe_through(program: &str, args: &[&str], data: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write as _;
    let mut child = Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    let mut stdin = child
        .stdin
        .take()
        .with_context(|| format!("{program}'s stdin"))?;
    // Written by another thread while this one reads: a full output pipe cannot stall it.
    let out = std::thread::scope(|s| {
        let writer = s.spawn(move || stdin.write_all(data));
        let out = child.wait_with_output();
        (writer.join(), out)
    });
    let (written, out) = out;
    match written {
        Ok(r) => r.with_context(|| format!("writing to {program}"))?,
        Err(_) => bail!("writing to {program}: the thread panicked"),
    }
    let out = out.with_context(|| format!("waiting for {program}"))?;
    ensure!(out.status.success(), "{program} failed ({})", out.status);
    Ok(out.stdout)
}

fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    // -n: no name or time stamp in the header, so the same page gives the same bytes.
    pipe_through("gzip", &["-9n", "-c"], data)
}

fn changelog(version: &str, commit: &str, epoch: Option<&str>) -> Result<String> {
    let mut date = Command::new("date");
    date.args(["-u", "-R"]);
    if let Some(t) = epoch {
        date.arg("-d").arg(format!("@{t}"));
    }
    let date = sh::capture(&mut date).context("`date -R` failed")?;
    Ok(format!(
        "xtlock ({version}) {SUITE}; urgency=medium\n\n  \
         * Built by `cargo xtask deb` from commit {commit}.\n\n \
         -- {MAINTAINER}  {}\n",
        date.trim()
    ))
}

fn md5(data: &[u8]) -> Result<String> {
    let out = pipe_through("md5sum", &[], data)?;
    String::from_utf8_lossy(&out)
        .split_whitespace()
        .next()
        .map(str::to_owned)
        .context("md5sum printed nothing")
}

/// Stages the package's tree under `target/deb/` and builds the .deb with dpkg-deb.
pub fn build(root: &Path, bin: &Path) -> Result<PathBuf> {
    let version = env!("CARGO_PKG_VERSION");
    let arch = architecture()?;
    let dir = sh::target_dir(root).join("deb");
    let stage = dir.join("root");
    if stage.exists() {
        fs::remove_dir_all(&stage).with_context(|| format!("removing {}", stage.display()))?;
    }
    let repo = root.join("deploy/debian");
    // The commit's time stamps every file, the archive members and the changelog: the same
    // tree, the same package.
    let git = |args: &[&str]| {
        sh::capture(Command::new("git").current_dir(root).args(args)).map(|s| s.trim().to_owned())
    };
    let epoch = git(&["log", "-1", "--format=%ct"]);
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let mut installed_bytes = 0u64;
    let mut sums = String::new();
    for (path, mode, source) in FILES {
        let data = match source {
            Source::Binary => {
                fs::read(bin).with_context(|| format!("reading {}", bin.display()))?
            }
            Source::Generated(args) => {
                let out = output_of(bin, args)?;
                if path.ends_with(".gz") {
                    gzip(&out)?
                } else {
                    out
                }
            }
            Source::Repo(name) => {
                let p = repo.join(name);
                fs::read(&p).with_context(|| format!("reading {}", p.display()))?
            }
            Source::Changelog => gzip(changelog(version, &commit, epoch.as_deref())?.as_bytes())?,
        };
        installed_bytes += data.len() as u64;
        if !path.starts_with("etc/") {
            sums.push_str(&format!("{}  {path}\n", md5(&data)?));
        }
        write_file(&stage.join(path), &data, *mode)?;
    }
    let debian = stage.join("DEBIAN");
    for name in SCRIPTS {
        let p = repo.join(name);
        let data = fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
        write_file(&debian.join(name), &data, 0o755)?;
    }
    let conffiles: String = FILES
        .iter()
        .filter(|(p, _, _)| p.starts_with("etc/"))
        .map(|(p, _, _)| format!("/{p}\n"))
        .collect();
    write_file(&debian.join("conffiles"), conffiles.as_bytes(), 0o644)?;
    write_file(&debian.join("md5sums"), sums.as_bytes(), 0o644)?;
    let control = control(version, &arch, installed_bytes.div_ceil(1024));
    write_file(&debian.join("control"), control.as_bytes(), 0o644)?;
    // Directories as a package has them, whatever the umask.
    for entry in walk(&stage)? {
        if entry.is_dir() {
            fs::set_permissions(&entry, fs::Permissions::from_mode(0o755))?;
        }
    }

    let deb = dir.join(format!("xtlock_{version}_{arch}.deb"));
    let mut cmd = Command::new("dpkg-deb");
    cmd.args(["--root-owner-group", "-Zxz", "--build"])
        .arg(&stage)
        .arg(&deb);
    if let Some(t) = &epoch {
        cmd.env("SOURCE_DATE_EPOCH", t);
    }
    sh::run(&mut cmd).context("dpkg-deb (dpkg)")?;
    Ok(deb)
}

fn control(version: &str, arch: &str, installed_kib: u64) -> String {
    format!(
        "Package: xtlock\n\
         Version: {version}\n\
         Architecture: {arch}\n\
         Maintainer: {MAINTAINER}\n\
         Installed-Size: {installed_kib}\n\
         Section: admin\n\
         Priority: optional\n\
         Description: who holds the netfilter (xtables) lock, and who waits behind it\n \
         xtlock traces flock() on /run/xtables.lock with eBPF and attributes every hold\n \
         and wait to the agent behind it: kube-proxy, a CNI agent, firewalld, dockerd.\n \
         It also counts packet drops by reason and reads the conntrack counters.\n \
         .\n \
         This package has the statically linked binary, its manual page and shell\n \
         completions, and a hardened systemd unit for `xtlock daemon` (Prometheus\n \
         metrics), configured in /etc/default/xtlock and not enabled on install.\n"
    )
}

/// Every path below `dir` (not `dir` itself).
fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    Ok(out)
}

/// The clean root's tarball: made once by debootstrap (minbase: the essential packages and
/// apt; systemd, whose units the package's unit is verified among, and man-db to look the
/// page up, as a host has them), reused while it exists.
fn base_tarball(work: &Path) -> Result<PathBuf> {
    let tarball = work.join(format!("{SUITE}-minbase.tar.gz"));
    if tarball.exists() {
        println!("ok: clean {SUITE} root: {} (cached)", tarball.display());
        return Ok(tarball);
    }
    let start = Instant::now();
    let fresh = work.join("debootstrap");
    if fresh.exists() {
        fs::remove_dir_all(&fresh).with_context(|| format!("removing {}", fresh.display()))?;
    }
    println!("making a clean {SUITE} root with debootstrap (downloads ~40 MB, once)");
    sh::run(
        Command::new("debootstrap")
            .args(["--variant=minbase", "--include=systemd,man-db", SUITE])
            .arg(&fresh),
    )
    .context("debootstrap")?;
    // The downloaded .debs (a third of the tarball); the package lists stay, as on any host.
    in_root(&fresh, "apt-get clean")?;
    let tmp = work.join(".base.tar.gz.tmp");
    sh::run(
        Command::new("tar")
            .arg("-C")
            .arg(&fresh)
            .args(["--numeric-owner", "-czf"])
            .arg(&tmp)
            .arg("."),
    )?;
    fs::rename(&tmp, &tarball)?;
    fs::remove_dir_all(&fresh).with_context(|| format!("removing {}", fresh.display()))?;
    println!(
        "ok: clean {SUITE} root in {:.0}s: {}",
        start.elapsed().as_secs_f64(),
        tarball.display()
    );
    Ok(tarball)
}

/// `./xtask/run trace` (and record, daemon, build) installs only what building xtlock
/// needs: apt, asked to install that set into this clean root (a simulation: the host's
/// package lists, the clean root's dpkg status), brings in no daemon, firewall manager,
/// emulator or test tool ([`setup::NEVER_FOR_USE`]), as a dependency or a recommendation.
fn use_setup_installs_only_the_build_set(chroot: &Path) -> Result<()> {
    let plan = setup::apt_plan(setup::Purpose::Use);
    let simulate = || -> Result<(bool, String)> {
        let out = Command::new("apt-get")
            .env("LC_ALL", "C")
            .args(["-s", "-q", "-o"])
            .arg(format!(
                "Dir::State::status={}",
                chroot.join("var/lib/dpkg/status").display()
            ))
            // The host's caches describe the host's installed set, not the root's.
            .args([
                "-o",
                "Dir::Cache::pkgcache=",
                "-o",
                "Dir::Cache::srcpkgcache=",
            ])
            .args(["install", "-y", "--no-install-recommends"])
            .args(&plan)
            .output()
            .context("running apt-get -s")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.success(), text))
    };
    let (mut ok, mut text) = simulate()?;
    if !ok {
        // This host's package lists may be missing or old: fetch them once.
        sh::run(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["-q", "-o", "DPkg::Lock::Timeout=600", "update"]),
        )?;
        (ok, text) = simulate()?;
    }
    ensure!(
        ok,
        "apt-get -s install of the build set into the clean root failed:\n{text}"
    );
    let installs: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("Inst "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let wrong: Vec<&str> = installs
        .iter()
        .copied()
        .filter(|p| setup::never_for_use(p))
        .collect();
    ensure!(
        wrong.is_empty(),
        "the setup of `./xtask/run trace` would install {} on the node it traces \
         (apt-get -s in a clean {SUITE} root; plan: {})",
        wrong.join(" "),
        plan.join(" ")
    );
    let absent: Vec<&&str> = plan.iter().filter(|p| !installs.contains(p)).collect();
    ensure!(
        absent.is_empty(),
        "apt-get -s in the clean root would not install {absent:?} of the build set:\n{text}"
    );
    println!(
        "ok: `./xtask/run trace`'s setup in a clean {SUITE} root: the build set ({} packages) \
         resolves to {} packages, none of them a daemon, firewall manager, emulator or test tool",
        plan.len(),
        installs.len()
    );
    Ok(())
}

/// `sh -euc script sh ARGS...` (add the ARGS) in a mount namespace of its own: whatever
/// it mounts goes with it.
fn in_mount_namespace(script: &str) -> Command {
    let mut c = Command::new("unshare");
    c.args([
        "--mount",
        "--propagation",
        "private",
        "--fork",
        "sh",
        "-euc",
    ])
    .arg(script)
    .arg("sh");
    c
}

/// Runs `script` (sh) chrooted into `chroot`, in a mount namespace of its own with /proc
/// mounted, so nothing stays mounted on the host whatever happens. Returns its stdout.
fn in_root(chroot: &Path, script: &str) -> Result<String> {
    let out =
        in_mount_namespace(r#"mount -t proc proc "$1/proc"; exec chroot "$1" /bin/sh -euc "$2""#)
            .arg(chroot)
            .arg(script)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LC_ALL", "C")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .context("running unshare (util-linux)")?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "in the clean root, `{script}` failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

fn test(root: &Path, deb: &Path, bin: &Path) -> Result<()> {
    if !sh::is_root() {
        bail!("the package test makes a Debian root and chroots into it: run it as root");
    }
    let work = sh::target_dir(root).join("deb-test");
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let tarball = base_tarball(&work)?;
    let chroot = work.join("root");
    if chroot.exists() {
        fs::remove_dir_all(&chroot).with_context(|| format!("removing {}", chroot.display()))?;
    }
    fs::create_dir_all(&chroot)?;
    sh::run(
        Command::new("tar")
            .arg("-C")
            .arg(&chroot)
            .args(["--numeric-owner", "-xzf"])
            .arg(&tarball),
    )?;
    let name = deb.file_name().context("the package's file name")?;
    fs::copy(deb, chroot.join("tmp").join(name)).context("copying the package into the root")?;
    let name = name.to_string_lossy();

    // apt with no package lists: it can install only what the root has, so anything the
    // package needed beyond its declared (absent) dependencies fails here.
    let out = in_root(&chroot, &format!("apt-get install -y /tmp/{name}"))?;
    ensure!(
        out.contains("0 upgraded, 1 newly installed"),
        "apt installed more than xtlock:\n{out}"
    );
    let out = in_root(&chroot, "apt-get install -f -s")?;
    ensure!(
        out.contains("0 upgraded, 0 newly installed, 0 to remove"),
        "apt-get install -f has something to do:\n{out}"
    );
    println!("ok: apt installs the package into a clean {SUITE} root, nothing else");
    use_setup_installs_only_the_build_set(&chroot)?;

    let version = in_root(&chroot, "xtlock --version")?;
    let want = format!("xtlock {}", env!("CARGO_PKG_VERSION"));
    ensure!(
        version.trim() == want,
        "`xtlock --version` printed {version:?}, not {want:?}"
    );
    let help = in_root(&chroot, "xtlock probes --help")?;
    ensure!(help.contains("--json"), "`xtlock probes --help`:\n{help}");
    println!("ok: {want} runs there; `xtlock probes --help` too");

    let page = in_root(&chroot, "man -w xtlock")?;
    ensure!(
        page.trim() == "/usr/share/man/man8/xtlock.8.gz",
        "`man -w xtlock` found {page:?}"
    );
    let text = in_root(&chroot, "MANWIDTH=100 man 8 xtlock")?;
    ensure!(text.contains("xtlock daemon"), "`man 8 xtlock`:\n{text}");
    in_root(
        &chroot,
        "bash -n /usr/share/bash-completion/completions/xtlock \
         && test -s /usr/share/zsh/vendor-completions/_xtlock \
         && test -s /usr/share/fish/vendor_completions.d/xtlock.fish",
    )?;
    println!(
        "ok: man -w finds xtlock(8); the completions are where bash-completion, zsh and fish look"
    );

    let conffiles = in_root(&chroot, "dpkg-query -W -f '${Conffiles}' xtlock")?;
    ensure!(
        conffiles.contains("/etc/default/xtlock"),
        "conffiles: {conffiles:?}"
    );
    // The tmpfiles.d entry is valid and makes the lock file as iptables would.
    let lock = in_root(
        &chroot,
        "systemd-tmpfiles --create xtlock.conf && stat -c '%a %U %F' /run/xtables.lock",
    )?;
    ensure!(
        lock.trim() == "600 root regular empty file",
        "/run/xtables.lock from tmpfiles.d: {lock:?}"
    );
    let unit = chroot.join("lib/systemd/system/xtlock.service");
    ensure!(unit.is_file(), "{} is not installed", unit.display());
    // --root: the unit, the binary its ExecStart names and the units it is ordered with are
    // the root's; MANPATH: the host's man, which checks Documentation=, looks at its pages.
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", chroot.display()))
        .arg("/lib/systemd/system/xtlock.service")
        .env("MANPATH", chroot.join("usr/share/man"))
        .output()
        .context("running systemd-analyze (systemd)")?;
    let said = String::from_utf8_lossy(&verify.stderr);
    ensure!(
        verify.status.success() && !said.contains("xtlock.service"),
        "systemd-analyze verify ({}):\n{said}",
        verify.status
    );
    // systemd's own score of the sandboxing (0 to 10, lower is tighter): 3.7 when written,
    // as root with CAP_BPF (which it counts as exposure); loosening the unit fails here.
    let security = Command::new("systemd-analyze")
        .args(["security", "--offline=true"])
        .arg(format!("--threshold={EXPOSURE_MAX_TENTHS}"))
        .arg(format!("--root={}", chroot.display()))
        .arg("/lib/systemd/system/xtlock.service")
        .output()
        .context("running systemd-analyze security")?;
    let report = String::from_utf8_lossy(&security.stdout);
    let score = report
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or("no overall exposure level");
    ensure!(
        security.status.success(),
        "systemd-analyze security: above {}: {score}\n{report}",
        f64::from(EXPOSURE_MAX_TENTHS) / 10.0
    );
    println!(
        "ok: systemd-analyze verify accepts xtlock.service ({}); /etc/default/xtlock is a \
         conffile",
        score.trim_start_matches(['→', ' '])
    );

    in_root(&chroot, "dpkg --purge xtlock")?;
    let left: Vec<&str> = FILES
        .iter()
        .map(|(p, _, _)| *p)
        .filter(|p| chroot.join(p).exists())
        .collect();
    ensure!(left.is_empty(), "left after dpkg --purge: {left:?}");
    println!("ok: dpkg --purge removes every file");
    fs::remove_dir_all(&chroot).with_context(|| format!("removing {}", chroot.display()))?;

    unit_capabilities_suffice(root, &work, bin)
}

/// The unit's CapabilityBoundingSet is enough and loses nothing: on this host, with only
/// those capabilities (setpriv), `xtlock probes --json` attaches the same hooks and finds the
/// same features as with root's full set, and the daemon runs and writes its capture.
fn unit_capabilities_suffice(root: &Path, work: &Path, bin: &Path) -> Result<()> {
    let unit = root.join("deploy/debian/xtlock.service");
    let text = fs::read_to_string(&unit).with_context(|| format!("reading {}", unit.display()))?;
    let caps = capabilities(&text).context("xtlock.service has no CapabilityBoundingSet")?;
    let list: Vec<String> = caps
        .iter()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let set = format!("-all,{}", list.join(","));
    let limited = |args: &[&str]| {
        let mut c = Command::new("setpriv");
        c.args([
            "--bounding-set",
            &set,
            "--inh-caps",
            &set,
            "--ambient-caps",
            &set,
        ])
        .arg("--no-new-privs")
        .arg(bin)
        .args(args);
        c
    };
    let probes = |mut cmd: Command, who: &str| -> Result<serde_json::Value> {
        let out = cmd
            .output()
            .with_context(|| format!("running `xtlock probes` {who}"))?;
        ensure!(
            out.status.success(),
            "`xtlock probes --json` {who} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("`xtlock probes --json` {who}: not JSON"))?;
        // What was attached (and why not) and which features work; not the lock's inode.
        Ok(serde_json::json!({ "hooks": v["hooks"], "features": v["features"] }))
    };
    let mut full = Command::new(bin);
    full.args(["probes", "--json"]);
    let with_root = probes(full, "as root")?;
    let with_caps = probes(
        limited(&["probes", "--json"]),
        "with the unit's capabilities",
    )?;
    let lost = differences(&with_root, &with_caps);
    ensure!(
        lost.is_empty(),
        "with only {}, `xtlock probes` differs from root's (root's, then theirs):\n{}",
        caps.join(" "),
        lost.join("\n")
    );

    // The daemon as the unit runs it: in a mount namespace of its own (as systemd makes for
    // it: xtlock must not take it for a container's) where every file system is read-only
    // (ProtectSystem=strict, ProtectKernelTunables) but /proc, /dev and the state directory,
    // with the lock file made beforehand by the package's tmpfiles.d entry, as at boot.
    let tmpfiles = root.join("deploy/debian/tmpfiles.conf");
    sh::run(
        Command::new("systemd-tmpfiles")
            .arg("--create")
            .arg(&tmpfiles),
    )?;
    let records = work.join("records");
    let _ = fs::remove_dir_all(&records);
    fs::create_dir_all(&records)?;
    // A network namespace pinned as `ip netns add` does (as containerd pins pods'), where
    // kube-proxy writes its chains and firewalld removes them while the daemon runs.
    let ns = NetnsPin::add("xtlock-deb-rules")?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let log_path = work.join("unit-daemon.log");
    let mut daemon = in_mount_namespace(READ_ONLY_SANDBOX);
    daemon
        .arg(&records)
        .arg(limited(&[]).get_program())
        .args(limited(&["daemon", "--listen", &listen, "--duration", "15s"]).get_args())
        .arg("--record-dir")
        .arg(&records)
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(&log_path)?);
    let mut child = daemon
        .spawn()
        .context("running unshare and setpriv (util-linux)")?;
    let seen = unit_sees_a_foreign_change(work, &ns.0, &listen);
    let status = child.wait()?;
    let log = fs::read_to_string(&log_path).unwrap_or_default();
    let (foreign, features) =
        seen.with_context(|| format!("the unit's daemon; its log:\n{log}"))?;
    let captures = fs::read_dir(&records).map_or(0, |d| d.count());
    ensure!(
        status.success() && log.contains("ready") && captures > 0,
        "the daemon with only {} ({status}, {captures} capture files):\n{log}",
        caps.join(" "),
    );
    // Its own mount namespace is not taken for a container's: the lock file is the host's
    // own path, not one under /proc/1/root.
    ensure!(
        log.contains("tracing /run/xtables.lock "),
        "the daemon in a mount namespace of its own watched another path:\n{log}"
    );
    let _ = fs::remove_dir_all(&records);
    println!(
        "ok: with only the unit's {}, the same hooks and features as root; the daemon runs \
         with them in a read-only file system, every feature on ({features}), and counts \
         {foreign} foreign change(s) of kube-proxy's rules by firewalld",
        caps.join(" ")
    );
    Ok(())
}

/// kube-proxy's restore writes its chains in `ns`, firewalld flushes and deletes one (each
/// a shell named so, as their processes are the iptables' parents); the unit's daemon on
/// `listen` must count the change and have every feature on. (count, features on).
fn unit_sees_a_foreign_change(work: &Path, ns: &str, listen: &str) -> Result<(f64, String)> {
    let agents = work.join("agents");
    fs::create_dir_all(&agents)?;
    for a in ["kube-proxy", "firewalld"] {
        // A copy: the kernel's comm is the file's name.
        fs::copy("/bin/bash", agents.join(a)).context("copying /bin/bash")?;
    }
    let rules = work.join("kube-proxy.rules");
    fs::write(
        &rules,
        "*filter\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-XTLOCKDEB - [0:0]\n\
         -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-XTLOCKDEB\n\
         -A KUBE-SVC-XTLOCKDEB -j DROP\nCOMMIT\n",
    )?;
    let metrics = |deadline: Instant| -> Result<String> {
        loop {
            match http_get(listen, "/metrics") {
                Ok(body) => return Ok(body),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(250)),
            }
        }
    };
    let value = |body: &str, name: &str, labels: &[&str]| -> f64 {
        body.lines()
            .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let ready = Instant::now() + std::time::Duration::from_secs(15);
    while http_get(listen, "/readyz").is_err() && Instant::now() < ready {
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    let body = metrics(ready)?;
    let off: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("xtlock_feature_enabled") && l.contains("cause=\"privilege\""))
        .collect();
    ensure!(
        off.is_empty(),
        "features off for want of a privilege in the unit: {off:?}"
    );
    let on: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("xtlock_feature_enabled") && l.ends_with(" 1"))
        .filter_map(|l| l.split("feature=\"").nth(1)?.split('"').next())
        .collect();
    let agent = |name: &str, script: String| -> Result<()> {
        let st = Command::new(agents.join(name))
            .arg("-c")
            // `; exit`: a list, so bash stays the parent rather than exec'ing the last command.
            .arg(format!("{script}; exit $?"))
            .status()
            .with_context(|| format!("running {name}"))?;
        ensure!(st.success(), "{name}: {script}: {st}");
        Ok(())
    };
    let writes = |b: &str| value(b, "xtlock_rule_writes_total", &["agent=\"kube-proxy\""]);
    let writes_before = writes(&body);
    agent(
        "kube-proxy",
        format!(
            "ip netns exec {ns} iptables-legacy-restore -w --noflush < {}",
            rules.display()
        ),
    )?;
    // kube-proxy's rules are read back before firewalld's write: they are then its.
    let t = Instant::now() + std::time::Duration::from_secs(10);
    while writes(&metrics(t)?) <= writes_before && Instant::now() < t {
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    // Counted at the kernel's replace; the read follows the writer's exit by a few ms, and
    // writes of two agents between two reads are ambiguous (not counted).
    std::thread::sleep(std::time::Duration::from_secs(1));
    agent(
        "firewalld",
        format!(
            "ip netns exec {ns} iptables-legacy -w -F KUBE-SERVICES && \
             ip netns exec {ns} iptables-legacy -w -F KUBE-SVC-XTLOCKDEB && \
             ip netns exec {ns} iptables-legacy -w -X KUBE-SVC-XTLOCKDEB"
        ),
    )?;
    let foreign = |b: &str| {
        value(
            b,
            "xtlock_foreign_rule_changes_total",
            &["agent=\"firewalld\"", "owner=\"kube-proxy\""],
        )
    };
    let t = Instant::now() + std::time::Duration::from_secs(10);
    let mut n = foreign(&metrics(t)?);
    while n < 1.0 && Instant::now() < t {
        std::thread::sleep(std::time::Duration::from_millis(250));
        n = foreign(&metrics(t)?);
    }
    ensure!(
        n >= 1.0,
        "the unit's daemon counted no change of kube-proxy's rules by firewalld (xtlock_foreign_rule_changes_total)"
    );
    Ok((n, on.join(", ")))
}

/// `ip netns add NAME`, deleted on drop.
struct NetnsPin(String);

impl NetnsPin {
    fn add(name: &str) -> Result<Self> {
        let _ = Command::new("ip")
            .args(["netns", "del", name])
            .stderr(std::process::Stdio::null())
            .status();
        sh::run(Command::new("ip").args(["netns", "add", name]))?;
        Ok(NetnsPin(name.to_owned()))
    }
}

impl Drop for NetnsPin {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The body of `GET path` when it answers 200.
fn http_get(addr: &str, path: &str) -> Result<String> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    ensure!(head.contains(" 200 "), "{path}: {head}");
    Ok(body.to_owned())
}

/// The hooks and features (as `xtlock probes --json` lists them) that differ between `a`
/// and `b`: each as a's entry, then b's.
fn differences(a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    for list in ["hooks", "features"] {
        let (Some(x), Some(y)) = (a[list].as_array(), b[list].as_array()) else {
            out.push(format!("no `{list}` list"));
            continue;
        };
        for i in 0..x.len().max(y.len()) {
            let (p, q) = (x.get(i), y.get(i));
            if p != q {
                let show = |v: Option<&serde_json::Value>| v.map_or("-".into(), |v| v.to_string());
                out.push(format!("  {}\n  {}", show(p), show(q)));
            }
        }
    }
    out
}

/// `sh -c` script: `$1` stays writable, every other mount but /proc and /dev becomes
/// read-only, then `$2...` runs.
const READ_ONLY_SANDBOX: &str = r#"
dir=$1; shift
mount --bind "$dir" "$dir"
awk '{print $2}' /proc/self/mounts | sort -u | while read -r m; do
    case "$m" in /proc|/proc/*|/dev|/dev/*|"$dir") continue ;; esac
    # A mount point whose name has spaces is listed escaped, and stays as it is.
    mount -o remount,bind,ro "$m" 2>/dev/null || :
done
# /proc/sys, as ProtectKernelTunables makes it.
mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys
# access(2) says EROFS for a read-only mount, whoever asks.
if [ -w /usr ] || [ -w /run ]; then echo "the sandbox left /usr or /run writable" >&2; exit 1; fi
exec "$@"
"#;

/// The capabilities of a unit's `CapabilityBoundingSet=` lines.
fn capabilities(unit: &str) -> Option<Vec<String>> {
    let caps: Vec<String> = unit
        .lines()
        .filter_map(|l| l.trim().strip_prefix("CapabilityBoundingSet="))
        .flat_map(|v| v.split_whitespace().map(str::to_owned))
        .collect();
    (!caps.is_empty()).then_some(caps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_grants_what_its_bounding_set_says() {
        let unit = include_str!("../../deploy/debian/xtlock.service");
        let caps = capabilities(unit).expect("a bounding set");
        // The DaemonSet's set: the same features need the same privileges.
        let pod = crate::deploy::manifest::parse(include_str!("../../deploy/daemonset.yaml"))
            .expect("the DaemonSet parses");
        let mut want: Vec<String> = pod.caps_add.iter().map(|c| format!("CAP_{c}")).collect();
        let mut have = caps.clone();
        want.sort();
        have.sort();
        assert_eq!(have, want);
        let ambient: Vec<&str> = unit
            .lines()
            .filter_map(|l| l.strip_prefix("AmbientCapabilities="))
            .flat_map(str::split_whitespace)
            .collect();
        assert_eq!(ambient, caps);
        // The defaults file is the one EnvironmentFile names, and it sets what ExecStart uses.
        assert!(unit.contains("EnvironmentFile=-/etc/default/xtlock"));
        assert!(unit.contains("ExecStart=/usr/bin/xtlock daemon $XTLOCK_OPTIONS"));
        let default = include_str!("../../deploy/debian/default");
        assert!(default.lines().any(|l| l.starts_with("XTLOCK_OPTIONS=")));
        assert!(FILES.iter().any(|(p, _, _)| *p == "usr/bin/xtlock"));
    }

    #[test]
    fn probes_differences_name_the_entries() {
        let root = serde_json::json!({
            "hooks": [{"program": "a", "error": null}],
            "features": [{"name": "drop locations", "available": true}],
        });
        assert!(differences(&root, &root).is_empty());
        let less = serde_json::json!({
            "hooks": [{"program": "a", "error": null}],
            "features": [{"name": "drop locations", "available": false}],
        });
        let d = differences(&root, &less);
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(d[0].contains("\"available\":false"), "{d:?}");
    }
}
