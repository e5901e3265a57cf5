//! `cargo xtask image`: the statically linked `xtlock` and a `scratch` image of it, built
//! without pulling anything from a registry.
//!
//! What goes in the image is defined once, by the final stage of `Containerfile`: its `COPY
//! --from=build`, `ENTRYPOINT`, `CMD`, `EXPOSE`, `LABEL`, `ENV` and `USER` lines. Where a
//! registry is reachable, `podman build -f Containerfile .` runs them after a build stage that
//! calls `./xtask/run image --binary-only`; here the same binary is built on the host, and
//! this module applies the same lines itself, writing a `docker-archive` tarball (what
//! `docker load`, `podman load` and `kind load image-archive` read). Reproducible: every
//! timestamp in it is 0.
use std::{
    collections::BTreeMap,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, ensure, Context as _, Result};
use clap::Args;
use serde_json::json;
use sha2::{Digest as _, Sha256};

use crate::{arch::Arch, setup, sh};

#[derive(Args, Debug, Default)]
pub struct ImageArgs {
    /// Only build the static binary (`target/image/xtlock`); the Containerfile's build stage
    /// runs this.
    #[arg(long)]
    pub binary_only: bool,
    /// Skip `xtask setup` (the Containerfile has run it already).
    #[arg(long)]
    pub no_setup: bool,
    /// Architectures to build for: amd64, arm64 (comma-separated or repeated; `all` for
    /// both). Default: this machine's. Another one than the host's is cross-built with
    /// Debian's cross gcc; with more than one, a multi-arch OCI archive of them all is
    /// written too.
    #[arg(long = "arch", value_name = "ARCH", value_delimiter = ',')]
    pub arches: Vec<String>,
}

/// What `cargo xtask image` made for one architecture.
pub struct Built {
    /// `target/image/xtlock-VERSION.tar` (docker-archive; the host's architecture), or
    /// `target/image/xtlock-VERSION-ARCH.tar`.
    pub archive: PathBuf,
    /// `xtlock:VERSION`.
    pub tag: String,
    /// Bytes of the image's one layer (the unpacked image).
    pub layer_bytes: u64,
    pub arch: Arch,
    /// The image's parts, for the multi-arch index.
    oci: OciImage,
}

impl Built {
    /// An archive built before (`deploy-test --no-build`), of the host's architecture.
    pub fn existing(archive: PathBuf, tag: String) -> Built {
        Built {
            archive,
            tag,
            layer_bytes: 0,
            arch: Arch::host(),
            oci: OciImage::default(),
        }
    }
}

/// One architecture's image as OCI blobs.
#[derive(Default)]
struct OciImage {
    config: Vec<u8>,
    layer: Vec<u8>,
}

/// `--arch` values: `all`, names, or the host's when none.
pub fn parse_arches(given: &[String]) -> Result<Vec<Arch>> {
    let mut v: Vec<Arch> = Vec::new();
    for a in given {
        let these = if a.trim() == "all" {
            Arch::ALL.to_vec()
        } else {
            vec![a.parse::<Arch>().with_context(|| format!("--arch {a}"))?]
        };
        for a in these {
            if !v.contains(&a) {
                v.push(a);
            }
        }
    }
    if v.is_empty() {
        v.push(Arch::host());
    }
    Ok(v)
}

pub fn run(args: &ImageArgs) -> Result<()> {
    let arches = parse_arches(&args.arches)?;
    if !args.no_setup {
        setup::run_build()?;
        if arches.iter().any(|a| !a.is_host()) {
            setup::cross()?;
        }
    }
    let root = sh::workspace_root();
    let mut built = Vec::new();
    for &arch in &arches {
        let start = Instant::now();
        let bin = static_binary_for(&root, arch)?;
        println!(
            "{arch}: static binary in {:.1}s",
            start.elapsed().as_secs_f64()
        );
        if args.binary_only {
            continue;
        }
        let b = build_archive(&root, &bin, arch)?;
        println!(
            "image {} for {arch}: {} (one layer of {:.1} MiB; the archive is {:.1} MiB)",
            b.tag,
            b.archive.display(),
            mib(b.layer_bytes),
            mib(fs::metadata(&b.archive)?.len()),
        );
        built.push(b);
    }
    if args.binary_only {
        return Ok(());
    }
    if built.len() > 1 {
        let index = write_oci_index(&root, &built)?;
        println!(
            "multi-arch image {} ({}): {} (an OCI archive with one image index; `podman load` \
             takes the image of this machine's architecture from it, `skopeo copy --all \
             oci-archive:{} docker://REGISTRY/xtlock:{}` pushes them all)",
            built[0].tag,
            built
                .iter()
                .map(|b| b.arch.name())
                .collect::<Vec<_>>()
                .join(", "),
            index.display(),
            index.display(),
            env!("CARGO_PKG_VERSION"),
        );
    }
    if let Some(b) = built.first() {
        println!(
            "load it with `docker load -i {}` (or podman load), then push it where your nodes pull from",
            b.archive.display()
        );
    }
    Ok(())
}

/// Setup, static binary and archive, for `deploy-test`.
pub fn build(root: &Path) -> Result<Built> {
    let bin = static_binary(root)?;
    build_archive(root, &bin, Arch::host())
}

fn mib(b: u64) -> f64 {
    b as f64 / 1024.0 / 1024.0
}

pub fn image_dir(root: &Path) -> PathBuf {
    sh::target_dir(root).join("image")
}

/// The host's static binary, `target/image/xtlock`.
pub fn static_binary(root: &Path) -> Result<PathBuf> {
    static_binary_for(root, Arch::host())
}

/// `cargo build --release` of xtlock for `arch` with glibc linked statically (`+crt-static`,
/// set for the target only so build scripts and proc macros stay dynamic), the real BPF
/// programs embedded (built by `xtlock/build.rs` for that architecture: the kprobes read
/// `pt_regs` the way its kernel lays them out), then stripped into `target/image/xtlock`
/// (the host's) or `target/image/ARCH/xtlock`. Fails when the result is not static or not
/// for `arch`.
pub fn static_binary_for(root: &Path, arch: Arch) -> Result<PathBuf> {
    arch.check_cross()?;
    let mut cmd = sh::cargo();
    cmd.current_dir(root)
        .args(["build", "--release", "--locked", "-p", "xtlock"])
        .env("XTLOCK_REQUIRE_EBPF", "1");
    arch.cargo_args(&mut cmd, true);
    sh::run(&mut cmd)?;
    let built = sh::target_dir(root)
        .join(arch.triple())
        .join("release")
        .join("xtlock");
    let dir = if arch.is_host() {
        image_dir(root)
    } else {
        image_dir(root).join(arch.name())
    };
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let out = dir.join("xtlock");
    // The symbols are for debugging on the build machine; the image carries none.
    let strip = if arch.is_host() {
        "strip".to_owned()
    } else {
        format!("{}-strip", arch.gnu_prefix())
    };
    sh::run(Command::new(&strip).arg("-o").arg(&out).arg(&built))
        .with_context(|| format!("{strip} (binutils) the binary"))?;
    ensure_static(&out, arch)?;
    println!(
        "ok: {} is statically linked for {arch} ({:.1} MiB stripped)",
        out.display(),
        mib(fs::metadata(&out)?.len())
    );
    Ok(out)
}

/// An ELF executable without `PT_INTERP` needs no dynamic loader, hence no libc in the image.
fn ensure_static(path: &Path, arch: Arch) -> Result<()> {
    use object::{
        read::elf::{ElfFile64, FileHeader as _, ProgramHeader as _},
        Endianness,
    };
    let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let elf = ElfFile64::<Endianness>::parse(&*data)
        .with_context(|| format!("{} is not a 64-bit ELF file", path.display()))?;
    let endian = elf.endian();
    let machine = elf.elf_header().e_machine(endian);
    let want = match arch {
        Arch::Amd64 => object::elf::EM_X86_64,
        Arch::Arm64 => object::elf::EM_AARCH64,
    };
    ensure!(
        machine == want,
        "{} is for ELF machine {machine}, not {arch}",
        path.display()
    );
    let headers = elf
        .elf_header()
        .program_headers(endian, &*data)
        .context("reading the program headers")?;
    let interp = headers
        .iter()
        .any(|h| h.p_type(endian) == object::elf::PT_INTERP);
    ensure!(
        !interp,
        "{} has a dynamic loader (PT_INTERP): not statically linked; is RUSTFLAGS set in \
         the environment? (it overrides the per-target flags that add +crt-static)",
        path.display()
    );
    Ok(())
}

/// The final stage of a Containerfile: what the image holds and how it starts.
#[derive(Debug, Default, PartialEq)]
pub struct FinalStage {
    /// (stage, source in that stage, destination in the image)
    pub copies: Vec<(String, String, String)>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub expose: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub env: Vec<String>,
    pub user: Option<String>,
}

/// Reads the stage after the last `FROM`, which must be `FROM scratch`. Instructions this
/// does not know are an error, so a line added to the Containerfile cannot be silently
/// missing from the image built here.
pub fn final_stage(containerfile: &str) -> Result<FinalStage> {
    // Join continuation lines, drop comments and blank lines.
    let mut lines = Vec::new();
    let mut cur = String::new();
    for raw in containerfile.lines() {
        let t = raw.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(head) => {
                cur.push_str(head);
                cur.push(' ');
            }
            None => {
                cur.push_str(t);
                lines.push(std::mem::take(&mut cur));
            }
        }
    }
    let last_from = lines
        .iter()
        .rposition(|l| keyword(l).0.eq_ignore_ascii_case("FROM"))
        .context("no FROM line")?;
    let (_, from) = keyword(&lines[last_from]);
    let base = from.split_whitespace().next().unwrap_or_default();
    ensure!(
        base == "scratch",
        "the final stage is `FROM {from}`; xtask image builds only `FROM scratch` images"
    );
    let mut st = FinalStage::default();
    for line in &lines[last_from + 1..] {
        let (kw, rest) = keyword(line);
        match kw.to_ascii_uppercase().as_str() {
            "COPY" => {
                let mut words: Vec<&str> = rest.split_whitespace().collect();
                let from = words
                    .iter()
                    .position(|w| w.starts_with("--from="))
                    .map(|i| words.remove(i)["--from=".len()..].to_owned())
                    .context("COPY without --from: the final stage copies only build outputs")?;
                ensure!(
                    words.len() == 2 && !words.iter().any(|w| w.starts_with("--")),
                    "COPY {rest}: expected `COPY --from=STAGE SRC DST`"
                );
                st.copies
                    .push((from, words[0].to_owned(), words[1].to_owned()));
            }
            "ENTRYPOINT" => st.entrypoint = exec_form(rest)?,
            "CMD" => st.cmd = exec_form(rest)?,
            "EXPOSE" => st
                .expose
                .extend(rest.split_whitespace().map(|p| match p.contains('/') {
                    true => p.to_owned(),
                    false => format!("{p}/tcp"),
                })),
            "USER" => st.user = Some(rest.to_owned()),
            "ENV" => {
                let (k, v) = rest
                    .split_once('=')
                    .with_context(|| format!("ENV {rest}: expected ENV KEY=VALUE"))?;
                st.env.push(format!("{}={}", k.trim(), unquote(v.trim())));
            }
            "LABEL" => {
                let (k, v) = rest
                    .split_once('=')
                    .with_context(|| format!("LABEL {rest}: expected LABEL KEY=VALUE"))?;
                st.labels
                    .insert(unquote(k.trim()).to_owned(), unquote(v.trim()).to_owned());
            }
            other => bail!(
                "Containerfile's final stage has `{other}`, which xtask/src/image.rs does not \
                 apply: teach it there, or the image built here would differ"
            ),
        }
    }
    ensure!(!st.copies.is_empty(), "the final stage copies nothing");
    Ok(st)
}

fn keyword(line: &str) -> (&str, &str) {
    let line = line.trim();
    match line.split_once(char::is_whitespace) {
        Some((k, r)) => (k, r.trim()),
        None => (line, ""),
    }
}

fn unquote(s: &str) -> &str {
    s.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(s)
}

/// `["a", "b"]` (exec form only: a scratch image has no shell for the other form).
fn exec_form(s: &str) -> Result<Vec<String>> {
    serde_json::from_str(s)
        .with_context(|| format!("`{s}`: use the JSON exec form (a scratch image has no shell)"))
}

/// Writes `target/image/xtlock-VERSION.tar` (`xtlock-VERSION-ARCH.tar` for another
/// architecture than the host's) from the Containerfile's final stage, with the build
/// stage's `/xtlock` being the static binary built here.
fn build_archive(root: &Path, bin: &Path, arch: Arch) -> Result<Built> {
    let cf_path = root.join("Containerfile");
    let cf =
        fs::read_to_string(&cf_path).with_context(|| format!("reading {}", cf_path.display()))?;
    let stage = final_stage(&cf).with_context(|| format!("in {}", cf_path.display()))?;
    let version = env!("CARGO_PKG_VERSION");
    let tag = format!("xtlock:{version}");

    // The layer: each COPY's file, owned by root, mtime 0.
    let mut layer = tar::Builder::new(Vec::new());
    layer.mode(tar::HeaderMode::Deterministic);
    for (from, src, dst) in &stage.copies {
        ensure!(
            from == "build" && src == "/xtlock",
            "COPY --from={from} {src}: the build stage's only output known here is /xtlock"
        );
        let data = fs::read(bin).with_context(|| format!("reading {}", bin.display()))?;
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o755);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        layer
            .append_data(&mut h, dst.trim_start_matches('/'), &data[..])
            .context("writing the layer")?;
    }
    let layer = layer.into_inner().context("finishing the layer")?;
    let layer_sha = hex(&Sha256::digest(&layer));

    let mut config = json!({
        "architecture": arch.name(),
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {
            "Entrypoint": stage.entrypoint,
            "Cmd": stage.cmd,
            "Env": stage.env,
            "Labels": stage.labels,
            "ExposedPorts": stage.expose.iter().map(|p| (p.clone(), json!({}))).collect::<BTreeMap<_, _>>(),
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{layer_sha}")] },
        "history": [{
            "created": "1970-01-01T00:00:00Z",
            "created_by": "cargo xtask image: the final stage of Containerfile",
        }],
    });
    if let Some(u) = &stage.user {
        config["config"]["User"] = json!(u);
    }
    let config = serde_json::to_vec(&config).context("image config")?;
    let config_sha = hex(&Sha256::digest(&config));
    let manifest = serde_json::to_vec(&json!([{
        "Config": format!("{config_sha}.json"),
        "RepoTags": [tag],
        "Layers": [format!("{layer_sha}/layer.tar")],
    }]))
    .context("manifest")?;

    let dir = image_dir(root);
    let name = if arch.is_host() {
        format!("xtlock-{version}.tar")
    } else {
        format!("xtlock-{version}-{arch}.tar")
    };
    let archive = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut out = Archive::create(&tmp)?;
    let mut put = |name: &str, data: &[u8]| out.put(name, data);
    put(&format!("{config_sha}.json"), &config)?;
    put(&format!("{layer_sha}/layer.tar"), &layer)?;
    put("manifest.json", &manifest)?;
    out.finish(&tmp, &archive)?;
    Ok(Built {
        archive,
        tag,
        layer_bytes: layer.len() as u64,
        arch,
        oci: OciImage { config, layer },
    })
}

/// `target/image/xtlock-VERSION-multiarch.tar`: an OCI image layout in a tar (what
/// `podman load`, `skopeo copy` and `docker load` of Docker 25+ read as `oci-archive`) whose
/// `index.json` names one image index, `xtlock:VERSION`, with an image per architecture
/// (the same config and layer as each docker-archive). Reproducible like those.
fn write_oci_index(root: &Path, built: &[Built]) -> Result<PathBuf> {
    const INDEX: &str = "application/vnd.oci.image.index.v1+json";
    const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    let version = env!("CARGO_PKG_VERSION");
    let mut blobs: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |data: Vec<u8>| -> (String, u64) {
        let digest = format!("sha256:{}", hex(&Sha256::digest(&data)));
        let len = data.len() as u64;
        if !blobs.iter().any(|(d, _)| *d == digest) {
            blobs.push((digest.clone(), data));
        }
        (digest, len)
    };
    let mut manifests = Vec::new();
    for b in built {
        let (config_digest, config_len) = add(b.oci.config.clone());
        let (layer_digest, layer_len) = add(b.oci.layer.clone());
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_len,
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_len,
            }],
        }))
        .context("image manifest")?;
        let (digest, size) = add(manifest);
        manifests.push(json!({
            "mediaType": MANIFEST,
            "digest": digest,
            "size": size,
            "platform": { "architecture": b.arch.name(), "os": "linux" },
        }));
    }
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": manifests,
    }))
    .context("image index")?;
    let (index_digest, index_len) = add(index);
    let top = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [{
            "mediaType": INDEX,
            "digest": index_digest,
            "size": index_len,
            "annotations": {
                "org.opencontainers.image.ref.name": version,
                "io.containerd.image.name": format!("xtlock:{version}"),
            },
        }],
    }))
    .context("index.json")?;

    let dir = image_dir(root);
    let archive = dir.join(format!("xtlock-{version}-multiarch.tar"));
    let tmp = dir.join(format!(".xtlock-{version}-multiarch.tar.tmp"));
    let mut out = Archive::create(&tmp)?;
    let mut put = |name: &str, data: &[u8]| out.put(name, data);
    put("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    put("index.json", &top)?;
    for (digest, data) in &blobs {
        put(&format!("blobs/{}", digest.replacen(':', "/", 1)), data)?;
    }
    out.finish(&tmp, &archive)?;
    Ok(archive)
}

/// A reproducible tar (fixed mode, time and order) written to a temporary file, then renamed
/// into place: the docker-archive and the OCI layout alike.
struct Archive(tar::Builder<fs::File>);

impl Archive {
    fn create(tmp: &Path) -> Result<Self> {
        let mut out = tar::Builder::new(
            fs::File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        out.mode(tar::HeaderMode::Deterministic);
        Ok(Self(out))
    }

    fn put(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        self.0
            .append_data(&mut h, name, data)
            .with_context(|| format!("writing {name} into the archive"))
    }

    fn finish(self, tmp: &Path, archive: &Path) -> Result<()> {
        let mut f = self.0.into_inner().context("finishing the archive")?;
        f.flush()?;
        fs::rename(tmp, archive).with_context(|| format!("writing {}", archive.display()))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repositorys_containerfile_final_stage() {
        let cf = include_str!("../../Containerfile");
        let st = final_stage(cf).expect("parses");
        assert_eq!(
            st.copies,
            [("build".into(), "/xtlock".into(), "/xtlock".into())]
        );
        assert_eq!(st.entrypoint, ["/xtlock"]);
        assert_eq!(st.expose, ["9655/tcp"]);
        // The build stage builds the binary the way `cargo xtask image` does.
        assert!(cf.contains("./xtask/run image --binary-only"), "{cf}");
    }

    #[test]
    fn arches() {
        assert_eq!(parse_arches(&[]).unwrap(), [Arch::host()]);
        assert_eq!(
            parse_arches(&["arm64".into(), "aarch64".into()]).unwrap(),
            [Arch::Arm64]
        );
        assert_eq!(parse_arches(&["all".into()]).unwrap(), Arch::ALL);
        assert!(parse_arches(&["s390x".into()]).is_err());
    }

    #[test]
    fn unknown_instructions_are_refused() {
        let cf = "FROM debian AS build\nRUN x\nFROM scratch\nCOPY --from=build /a /a\nRUN true\n";
        let e = final_stage(cf).expect_err("RUN in a scratch stage");
        assert!(format!("{e:#}").contains("RUN"), "{e:#}");
        let e = final_stage("FROM debian\nCOPY --from=b /a /a\n").expect_err("not scratch");
        assert!(format!("{e:#}").contains("scratch"), "{e:#}");
        let st = final_stage(
            "FROM scratch\nCOPY --from=build /x \\\n  /y\nCMD [\"a\", \"b\"]\nEXPOSE 1 2/udp\n",
        )
        .expect("parses");
        assert_eq!(st.copies[0].2, "/y");
        assert_eq!(st.cmd, ["a", "b"]);
        assert_eq!(st.expose, ["1/tcp", "2/udp"]);
    }
}
