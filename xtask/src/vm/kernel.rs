//! The guest kernel: a stock Debian `linux-image-<V>-amd64` package, fetched with
//! `apt-get download`, unpacked with `dpkg -x` (never installed) and kept in a cache between
//! runs, with `modules.dep` made by `busybox depmod` (the host has no kmod) and, when the
//! kernel can boot that way, an uncompressed `vmlinux` for QEMU's PVH entry (decompressing the
//! xz bzImage under TCG takes seconds at every boot).
use std::{
    collections::{HashMap, HashSet},
    env, fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::sh;

/// The pinned guest kernel: Debian 12's `linux-image-6.1.0-56-amd64` (6.1.192-2, what
/// `linux-image-amd64` of bookworm-security depended on when this was written). Override
/// with `--kernel-version` or `XTLOCK_VM_KERNEL`. When Debian no longer has the pinned
/// package (it keeps only the newest ABI), the default falls back to whatever
/// `linux-image-amd64` depends on now, with a warning to update this pin.
pub const PINNED: &str = "6.1.0-56";

/// Which kernel to boot.
#[derive(Clone, Debug)]
pub enum Choice {
    /// `linux-image-<V>-amd64` from apt; `pinned` when V is [`PINNED`] by default.
    Apt { version: String, pinned: bool },
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
pub fn prepare(choice: &Choice, cache: &Path) -> Result<Kernel> {
    let kernels = cache.join("kernels");
    fs::create_dir_all(&kernels).with_context(|| format!("creating {}", kernels.display()))?;
    let (key, package) = match choice {
        Choice::Apt { version, .. } => {
            let p = format!("linux-image-{version}-amd64");
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
        (Choice::Apt { pinned, .. }, Some(p)) => Some(resolve(&p, *pinned)?),
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
    let result = unpack(choice, package.as_deref(), &tmp);
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
/// if needed); for the default pin, else what `linux-image-amd64` depends on now.
fn resolve(wanted: &str, pinned: bool) -> Result<String> {
    if apt_knows(wanted) {
        return Ok(wanted.to_owned());
    }
    println!("vm: apt does not know {wanted}; apt-get update");
    sh::run(
        Command::new("apt-get")
            .args(["-q", "-o", "DPkg::Lock::Timeout=600", "update"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    if apt_knows(wanted) {
        return Ok(wanted.to_owned());
    }
    if !pinned {
        bail!(
            "apt has no package {wanted}: pick a version `apt-cache search linux-image-6` lists \
             (--kernel-version 6.1.0-N), or give a .deb with --kernel-deb"
        );
    }
    let deps = sh::capture(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))
        .unwrap_or_default();
    let current = deps
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .map(str::to_owned)
        .with_context(|| {
            format!("apt has neither {wanted} nor a linux-image-amd64 to fall back to")
        })?;
    println!(
        "warning: vm: Debian no longer has the pinned {wanted}; using {current}, which \
         linux-image-amd64 depends on now (update PINNED in xtask/src/vm/kernel.rs)"
    );
    Ok(current)
}

fn apt_knows(package: &str) -> bool {
    // `apt-cache show` fails for unknown packages; for a purely virtual one it prints nothing.
    sh::capture(Command::new("apt-cache").args(["show", "--no-all-versions", package]))
        .is_some_and(|s| s.contains("Package:"))
}

/// Fills `dir` with `root/` (the unpacked package), `modules.dep`, the boot image and `info`.
fn unpack(choice: &Choice, package: Option<&str>, dir: &Path) -> Result<()> {
    let deb = match (choice, package) {
        (Choice::Deb(deb), _) => deb.clone(),
        (_, Some(p)) => {
            println!("vm: apt-get download {p}");
            sh::run(
                Command::new("apt-get")
                    .current_dir(dir)
                    // Downloading into a root-owned folder: no `_apt` sandbox warning.
                    .args(["-q", "-o", "APT::Sandbox::User=root", "download", p]),
            )?;
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
    if matches!(choice, Choice::Apt { .. }) {
        fs::remove_file(&deb)?;
    }
    let mods = root.join("lib/modules");
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
    let image = if pvh {
        "vmlinux".to_owned()
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
}
