//! The guest kernel: a stock Debian `linux-image-<V>-amd64` package, fetched with
//! `apt-get download`, unpacked with `dpkg -x` (never installed) and kept in a cache between
//! runs, with `modules.dep` made by `busybox depmod` (the host has no kmod) and, when the
//! kernel can boot that way, an uncompressed `vmlinux` for QEMU's PVH entry (decompressing the
//! xz bzImage under TCG takes seconds at every boot).
//!
//! apt runs with a configuration of its own in the cache (`apt/`: a sources list with the
//! suites of every series in [`SERIES`], its own lists and archives), never the machine's: a
//! Debian 12 host fetches Debian 11's and 13's kernels without touching its own apt state.
use std::{
    collections::{HashMap, HashSet},
    env, fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::{arch::Arch, sh};

/// The pinned guest kernel: Debian 12's `linux-image-6.1.0-56-amd64` (6.1.192-2, what
/// `linux-image-amd64` of bookworm-security depended on when this was written). Override
/// with `--kernel-version` or `XTLOCK_VM_KERNEL`. When Debian no longer has the pinned
/// package (it keeps only the newest ABI), the default falls back to whatever
/// `linux-image-amd64` depends on now, with a warning to update this pin.
pub const PINNED: &str = "6.1.0-56";

/// The kernel series `--kernel` takes, and the Debian suite that ships each (its
/// `-security` suite has the newest builds).
pub const SERIES: &[(&str, &str)] = &[
    ("5.10", "bullseye"),
    ("6.1", "bookworm"),
    ("6.12", "trixie"),
];

/// Which kernel to boot.
#[derive(Clone, Debug)]
pub enum Choice {
    /// `linux-image-<V>-amd64` from apt; `pinned` when V is [`PINNED`] by default.
    Apt { version: String, pinned: bool },
    /// The newest `linux-image-<series>.*-amd64` Debian has (one of [`SERIES`]).
    Series(String),
    /// A local `linux-image-*.deb`.
    Deb(PathBuf),
}

/// An unpacked kernel, ready to boot.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// `uname -r` of the guest, e.g. `6.1.0-56-amd64`.
    pub release: String,
    /// Package and Debian version, e.g. `linux-image-6.1.0-56-amd64 6.1.192-2`.
    pub package: String,
    /// What QEMU's `-kernel` gets: the PVH `vmlinux` or the bzImage.
    pub image: PathBuf,
    pub pvh: bool,
    /// `lib/modules/<release>` of the unpacked package, with `modules.dep`.
    pub modules: PathBuf,
    /// Whether the cache already had it.
    pub cached: bool,
}

/// The cache folder: `XTLOCK_VM_CACHE`, else `$XDG_CACHE_HOME/xtlock/vm`, else
/// `~/.cache/xtlock/vm`. Outside the work tree, so fresh clones (CI) on the same machine reuse it.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = env::var_os("XTLOCK_VM_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("xtlock/vm");
    }
    let home = env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/xtlock/vm")
}

/// The kernel of `choice`, from the cache or fetched and unpacked into it now.
///
/// `arch`: the kernel's architecture (`linux-image-*-arm64` for arm64, fetched through a
/// second apt configuration of its own that lists arm64 packages).
pub fn prepare(choice: &Choice, cache: &Path, arch: Arch) -> Result<Kernel> {
    let kernels = cache.join("kernels");
    fs::create_dir_all(&kernels).with_context(|| format!("creating {}", kernels.display()))?;
    let (key, package) = match choice {
        Choice::Apt { version, .. } => {
            let p = format!("linux-image-{version}-{arch}");
            (p.clone(), Some(p))
        }
        Choice::Series(series) => {
            let p = match newest_of_series(cache, series, arch) {
                Ok(p) => p,
                Err(e) => match newest_cached(&kernels, series, arch) {
                    // Offline, or Debian unreachable: the newest this cache has.
                    Some(p) => {
                        println!("warning: vm: {e:#}; using {p} from the cache");
                        p
                    }
                    None => return Err(e),
                },
            };
            (p.clone(), Some(p))
        }
        Choice::Deb(deb) => {
            let stem = deb
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .context("--kernel-deb needs a file name")?;
            (stem, None)
        }
    };
    let dir = kernels.join(&key);
    if let Some(k) = load(&dir)? {
        return Ok(k);
    }
    let package = match (choice, package) {
        (Choice::Apt { pinned, .. }, Some(p)) => Some(resolve(cache, &p, *pinned, arch)?),
        (Choice::Series(_), Some(p)) => Some(p),
        _ => None,
    };
    // A fallback package may be cached under its own name.
    if let Some(p) = &package {
        let other = kernels.join(p);
        if other != dir {
            if let Some(k) = load(&other)? {
                return Ok(k);
            }
        }
    }
    let dir = package.as_ref().map_or(dir, |p| kernels.join(p));
    let tmp = kernels.join(format!(".new-{key}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    let result = unpack(cache, choice, package.as_deref(), &tmp, arch);
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if fs::rename(&tmp, &dir).is_err() {
        // Another run finished first: use its copy.
        let _ = fs::remove_dir_all(&tmp);
    }
    load(&dir)?
        .map(|k| Kernel { cached: false, ..k })
        .with_context(|| format!("{} is incomplete after unpacking", dir.display()))
}

/// The package to download for `wanted`: itself when apt knows it (after one `apt-get update`
/// if needed); for the default pin, else the newest of its series.
fn resolve(cache: &Path, wanted: &str, pinned: bool, arch: Arch) -> Result<String> {
    let apt = Apt::new(cache, arch)?;
    if !apt.fresh() {
        apt.update()?;
    }
    if apt.knows(wanted) {
        return Ok(wanted.to_owned());
    }
    if apt.fresh() {
        // Lists from today may still predate a package published since.
        apt.update()?;
        if apt.knows(wanted) {
            return Ok(wanted.to_owned());
        }
    }
    if !pinned {
        bail!(
            "Debian has no package {wanted}: pick a series (--kernel 5.10, 6.1 or 6.12), an \
             exact version `apt-cache search linux-image-6` lists (--kernel-version 6.1.0-N), \
             or give a .deb with --kernel-deb"
        );
    }
    let series = series_of(PINNED).context("the pin is of no known series")?;
    let current = apt.newest(series)?;
    println!(
        "warning: vm: Debian no longer has the pinned {wanted}; using {current}, the newest of \
         the {series} series (update PINNED in xtask/src/vm/kernel.rs)"
    );
    Ok(current)
}

/// The series of a version (`6.1.0-56` -> `6.1`), if it is one of [`SERIES`].
pub fn series_of(version: &str) -> Option<&'static str> {
    SERIES
        .iter()
        .map(|(s, _)| *s)
        .find(|s| version.strip_prefix(s).is_some_and(|r| r.starts_with('.')))
}

/// The newest package of `series` apt knows, after refreshing lists older than a day.
fn newest_of_series(cache: &Path, series: &str, arch: Arch) -> Result<String> {
    let apt = Apt::new(cache, arch)?;
    if !apt.fresh() {
        apt.update()?;
    }
    apt.newest(series)
}

/// The newest kernel of `series` already unpacked in the cache.
fn newest_cached(kernels: &Path, series: &str, arch: Arch) -> Option<String> {
    let names = fs::read_dir(kernels)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("info").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned());
    newest_package(names, series, arch)
}

/// The newest plain `linux-image-<series>.*-amd64` among `names` (no -rt, -cloud, -dbg or
/// -unsigned flavour), by the numbers of its version: `5.10.0-46` -> 5, 10, 0, 46;
/// `6.12.118+deb13` -> 6, 12, 118, 13.
pub fn newest_package(
    names: impl IntoIterator<Item = String>,
    series: &str,
    arch: Arch,
) -> Option<String> {
    let suffix = format!("-{arch}");
    names
        .into_iter()
        .filter_map(|n| {
            let v = n
                .strip_prefix("linux-image-")?
                .strip_suffix(suffix.as_str())?;
            let plain = v
                .chars()
                .all(|c| c.is_ascii_digit() || ".-+deb".contains(c));
            (plain && series_of(v) == Some(series)).then(|| (version_numbers(v), n.clone()))
        })
        .max()
        .map(|(_, n)| n)
}

fn version_numbers(v: &str) -> Vec<u64> {
    v.split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// apt with a configuration of its own under `<cache>/apt` (`<cache>/apt-arm64` for arm64
/// kernels: apt lists one architecture there, whatever the host's is).
struct Apt {
    dir: PathBuf,
    arch: Arch,
}

impl Apt {
    fn new(cache: &Path, arch: Arch) -> Result<Self> {
        let dir = if arch == Arch::Amd64 {
            cache.join("apt")
        } else {
            cache.join(format!("apt-{arch}"))
        };
        for d in ["lists/partial", "archives/partial"] {
            fs::create_dir_all(dir.join(d))
                .with_context(|| format!("creating {}", dir.join(d).display()))?;
        }
        let mut list = String::from("# Written by cargo xtask vm-test (xtask/src/vm/kernel.rs).\n");
        for (_, suite) in SERIES {
            for (uri, s) in [
                ("http://deb.debian.org/debian", suite.to_string()),
                (
                    "http://deb.debian.org/debian-security",
                    format!("{suite}-security"),
                ),
            ] {
                list.push_str(&format!(
                    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {uri} {s} main\n"
                ));
            }
        }
        let path = dir.join("sources.list");
        if fs::read_to_string(&path).ok().as_deref() != Some(list.as_str()) {
            fs::write(&path, list).with_context(|| format!("writing {}", path.display()))?;
            // Lists of another sources list: fetch anew.
            let _ = fs::remove_file(dir.join("updated"));
        }
        Ok(Self { dir, arch })
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        let d = self.dir.display();
        c.args(["-q", "-o", "Dir::Etc::SourceParts=/dev/null"])
            .arg("-o")
            .arg(format!("Dir::Etc::SourceList={d}/sources.list"))
            .arg("-o")
            .arg(format!("Dir::State::Lists={d}/lists"))
            .arg("-o")
            .arg(format!("Dir::Cache={d}"))
            .arg("-o")
            .arg(format!("Dir::Cache::Archives={d}/archives"))
            // Files in a root-owned folder: no `_apt` sandbox warning.
            .args(["-o", "APT::Sandbox::User=root"])
            .args(["-o", "Acquire::Languages=none"])
            .arg("-o")
            .arg(format!("APT::Architecture={}", self.arch))
            .arg("-o")
            .arg(format!("APT::Architectures={}", self.arch))
            .env("DEBIAN_FRONTEND", "noninteractive");
        c
    }

    /// Lists fetched less than a day ago.
    fn fresh(&self) -> bool {
        fs::metadata(self.dir.join("updated"))
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|e| e.as_secs() < 86_400))
    }

    fn update(&self) -> Result<()> {
        println!("vm: apt-get update (own lists in {})", self.dir.display());
        sh::run(self.cmd("apt-get").arg("update"))?;
        fs::write(self.dir.join("updated"), "")?;
        Ok(())
    }

    fn knows(&self, package: &str) -> bool {
        // `apt-cache show` fails for unknown packages; for a purely virtual one it prints nothing.
        sh::capture(
            self.cmd("apt-cache")
                .args(["show", "--no-all-versions", package]),
        )
        .is_some_and(|s| s.contains("Package:"))
    }

    fn newest(&self, series: &str) -> Result<String> {
        let names = sh::capture(self.cmd("apt-cache").args(["pkgnames", "linux-image-"]))
            .unwrap_or_default();
        newest_package(names.lines().map(str::to_owned), series, self.arch).with_context(|| {
            format!(
                "apt knows no linux-image-{series}.*-{} (sources: {}/sources.list)",
                self.arch,
                self.dir.display()
            )
        })
    }

    fn download(&self, package: &str, into: &Path) -> Result<()> {
        println!("vm: apt-get download {package}");
        sh::run(
            self.cmd("apt-get")
                .current_dir(into)
                .args(["download", package]),
        )
    }
}

/// Fills `dir` with `root/` (the unpacked package), `modules.dep`, the boot image and `info`.
fn unpack(
    cache: &Path,
    choice: &Choice,
    package: Option<&str>,
    dir: &Path,
    arch: Arch,
) -> Result<()> {
    let deb = match (choice, package) {
        (Choice::Deb(deb), _) => deb.clone(),
        (_, Some(p)) => {
            Apt::new(cache, arch)?.download(p, dir)?;
            find_deb(dir)?
        }
        _ => unreachable!("an apt choice always has a package"),
    };
    let field = |f: &str| {
        sh::capture(Command::new("dpkg-deb").arg("-f").arg(&deb).arg(f))
            .map(|s| s.trim().to_owned())
            .with_context(|| format!("dpkg-deb -f {} {f}", deb.display()))
    };
    let package = format!("{} {}", field("Package")?, field("Version")?);
    let root = dir.join("root");
    println!("vm: unpacking {package} (dpkg -x)");
    sh::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
    if !matches!(choice, Choice::Deb(_)) {
        fs::remove_file(&deb)?;
    }
    let mods = root.join("lib/modules");
    let usr_mods = root.join("usr/lib/modules");
    if !mods.exists() && usr_mods.exists() {
        // Debian 13 ships modules under /usr (merged /usr), and no /lib: one place for the
        // rest of xtask.
        fs::create_dir_all(root.join("lib"))?;
        fs::rename(&usr_mods, &mods)
            .with_context(|| format!("moving {} to {}", usr_mods.display(), mods.display()))?;
    }
    decompress_modules(&mods)?;
    let mut releases: Vec<String> = fs::read_dir(&mods)
        .with_context(|| format!("{} has no lib/modules: not a kernel package", deb.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    releases.sort();
    let [release] = releases.as_slice() else {
        bail!(
            "expected one kernel in {}, found {releases:?}",
            mods.display()
        );
    };
    println!("vm: busybox depmod {release}");
    sh::run(
        Command::new("busybox")
            .arg("depmod")
            .arg("-b")
            .arg(&root)
            .arg(release),
    )?;
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
    let config =
        fs::read_to_string(root.join("boot").join(format!("config-{release}"))).unwrap_or_default();
    let pvh = config.lines().any(|l| l == "CONFIG_PVH=y")
        && extract_vmlinux(&vmlinuz, &dir.join("vmlinux"))?;
    // arm64's vmlinuz is a gzip-compressed `Image`: unpacked once here rather than by QEMU
    // at every boot.
    let gunzipped = !pvh && arch == Arch::Arm64 && gunzip(&vmlinuz, &dir.join("Image"))?;
    let image = if pvh {
        "vmlinux".to_owned()
    } else if gunzipped {
        "Image".to_owned()
    } else {
        vmlinuz
            .strip_prefix(dir)
            .unwrap_or(&vmlinuz)
            .display()
            .to_string()
    };
    fs::write(
        dir.join("info"),
        format!("release={release}\npackage={package}\nimage={image}\npvh={pvh}\n"),
    )?;
    Ok(())
}

/// Debian 13 compresses modules (`.ko.xz`): busybox insmod in the guest and the tests'
/// insmod take them uncompressed, so they are unpacked once here.
/// `gzip -dc in > out` when `in` is gzip; false when it is not.
fn gunzip(input: &Path, out: &Path) -> Result<bool> {
    let head = fs::read(input)
        .with_context(|| format!("reading {}", input.display()))?
        .get(..2)
        .map(<[u8]>::to_vec);
    if head.as_deref() != Some(&b"\x1f\x8b"[..]) {
        return Ok(false);
    }
    let status = Command::new("gzip")
        .arg("-dc")
        .arg(input)
        .stdout(fs::File::create(out).with_context(|| format!("creating {}", out.display()))?)
        .status()
        .context("running gzip")?;
    if !status.success() {
        bail!("gzip -dc {} failed ({status})", input.display());
    }
    Ok(true)
}

fn decompress_modules(mods: &Path) -> Result<()> {
    let mut found = Vec::new();
    let mut dirs = vec![mods.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let e = e?;
            let p = e.path();
            if e.file_type()?.is_dir() {
                dirs.push(p);
            } else if p.to_string_lossy().ends_with(".ko.xz") {
                found.push(p);
            } else if p.to_string_lossy().ends_with(".ko.zst") {
                bail!("{}: zstd-compressed modules are not supported", p.display());
            }
        }
    }
    if found.is_empty() {
        return Ok(());
    }
    println!("vm: decompressing {} modules (xz -d)", found.len());
    for chunk in found.chunks(500) {
        let status = Command::new("xz")
            .arg("-d")
            .args(chunk)
            .status()
            .context("running xz (apt-get install xz-utils)")?;
        if !status.success() {
            bail!("xz -d of the kernel's modules failed ({status})");
        }
    }
    Ok(())
}

fn find_deb(dir: &Path) -> Result<PathBuf> {
    fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", dir.display()))
}

/// Decompresses the xz payload of a bzImage into an ELF `vmlinux` (what
/// scripts/extract-vmlinux does). False when there is no xz payload.
fn extract_vmlinux(bzimage: &Path, out: &Path) -> Result<bool> {
    let data = fs::read(bzimage).with_context(|| format!("reading {}", bzimage.display()))?;
    const XZ_MAGIC: &[u8] = b"\xfd7zXZ\x00";
    let Some(at) = data.windows(XZ_MAGIC.len()).position(|w| w == XZ_MAGIC) else {
        return Ok(false);
    };
    let mut child = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(fs::File::create(out)?)
        .stderr(Stdio::null())
        .spawn()
        .context("running xz (apt-get install xz-utils)")?;
    let mut stdin = child.stdin.take().context("xz stdin")?;
    let payload = data[at..].to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&payload));
    let status = child.wait()?;
    // xz stops reading after the stream and the rest of the bzImage: a broken pipe is fine.
    let _ = writer.join();
    let elf = fs::read(out)
        .map(|d| d.starts_with(b"\x7fELF"))
        .unwrap_or(false);
    if !status.success() || !elf {
        let _ = fs::remove_file(out);
        return Ok(false);
    }
    Ok(true)
}

fn load(dir: &Path) -> Result<Option<Kernel>> {
    let Ok(info) = fs::read_to_string(dir.join("info")) else {
        return Ok(None);
    };
    let get = |k: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            .map(str::to_owned)
            .with_context(|| format!("{}/info has no {k}", dir.display()))
    };
    let release = get("release")?;
    let modules = dir.join("root/lib/modules").join(&release);
    let image = dir.join(get("image")?);
    if !image.exists() || !modules.join("modules.dep").exists() {
        return Ok(None);
    }
    Ok(Some(Kernel {
        package: get("package")?,
        image,
        pvh: get("pvh")? == "true",
        modules,
        release,
        cached: true,
    }))
}

/// `modules.dep` and `modules.builtin` of one kernel.
pub struct Modules {
    /// module name -> (path relative to lib/modules/<release>, names it depends on).
    deps: HashMap<String, (String, Vec<String>)>,
    builtin: HashSet<String>,
}

/// `kernel/net/9p/9pnet_virtio.ko` -> `9pnet_virtio` (module names use `_`).
pub fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

impl Modules {
    pub fn load(dir: &Path) -> Result<Self> {
        let dep = fs::read_to_string(dir.join("modules.dep"))
            .with_context(|| format!("reading {}/modules.dep", dir.display()))?;
        Ok(Self::parse(
            &dep,
            &fs::read_to_string(dir.join("modules.builtin")).unwrap_or_default(),
        ))
    }

    pub fn parse(dep: &str, builtin: &str) -> Self {
        let deps = dep
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(path, ds)| {
                let ds = ds.split_whitespace().map(module_name).collect();
                (module_name(path), (path.trim().to_owned(), ds))
            })
            .collect();
        let builtin = builtin
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(module_name)
            .collect();
        Self { deps, builtin }
    }

    /// The files to load, dependencies first, for `names` (each once); built-in ones need
    /// nothing. Fails on a name this kernel knows neither as a module nor as built in.
    pub fn closure(&self, names: &[String]) -> Result<Vec<String>> {
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        for n in names {
            let n = n.replace('-', "_");
            if self.builtin.contains(&n) && !self.deps.contains_key(&n) {
                continue;
            }
            if !self.deps.contains_key(&n) {
                bail!("the guest kernel has no module {n} (neither loadable nor built in)");
            }
            self.visit(&n, &mut seen, &mut order);
        }
        Ok(order)
    }

    fn visit(&self, name: &str, seen: &mut HashSet<String>, order: &mut Vec<String>) {
        if !seen.insert(name.to_owned()) {
            return;
        }
        if let Some((path, deps)) = self.deps.get(name) {
            for d in deps {
                self.visit(d, seen, order);
            }
            order.push(path.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko
kernel/net/9p/9pnet.ko:
kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko
kernel/fs/netfs/netfs.ko:
kernel/net/netfilter/nf_conntrack.ko: kernel/lib/libcrc32c.ko
kernel/lib/libcrc32c.ko:
kernel/drivers/net/veth.ko:
";

    #[test]
    fn closure_puts_dependencies_first() {
        let m = Modules::parse(DEP, "kernel/fs/overlayfs/overlay.ko\n");
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let order = m
            .closure(&names(&["9p", "nf-conntrack", "overlay"]))
            .unwrap();
        assert_eq!(
            order,
            [
                "kernel/net/9p/9pnet.ko",
                "kernel/fs/netfs/netfs.ko",
                "kernel/fs/fscache/fscache.ko",
                "kernel/fs/9p/9p.ko",
                "kernel/lib/libcrc32c.ko",
                "kernel/net/netfilter/nf_conntrack.ko",
            ]
        );
        assert!(m.closure(&names(&["no_such_thing"])).is_err());
        assert_eq!(module_name("kernel/a/ip_vs-rr.ko.xz"), "ip_vs_rr");
    }

    #[test]
    fn newest_of_a_series_by_its_numbers() {
        let names = [
            "linux-image-5.10.0-9-amd64",
            "linux-image-5.10.0-46-amd64",
            "linux-image-5.10.0-46-rt-amd64",
            "linux-image-5.10.0-46-cloud-amd64",
            "linux-image-5.10.0-46-amd64-dbg",
            "linux-image-6.1.0-56-amd64",
            "linux-image-6.12.9+deb13-amd64",
            "linux-image-6.12.118+deb13-amd64",
            "linux-image-6.12.118+deb13-amd64-unsigned",
            "linux-image-6.10.0-1-amd64",
            "linux-image-amd64",
        ]
        .map(String::from);
        let newest = |s| newest_package(names.clone(), s, Arch::Amd64);
        assert_eq!(
            newest("5.10").as_deref(),
            Some("linux-image-5.10.0-46-amd64")
        );
        assert_eq!(newest("6.1").as_deref(), Some("linux-image-6.1.0-56-amd64"));
        assert_eq!(
            newest("6.12").as_deref(),
            Some("linux-image-6.12.118+deb13-amd64")
        );
        assert_eq!(newest("4.19"), None);
        assert_eq!(series_of("6.12.118+deb13"), Some("6.12"));
        assert_eq!(series_of("6.10.0-1"), None);
    }
}
