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
};

use anyhow::{bail, ensure, Context as _, Result};
use clap::Args;
use serde_json::json;
use sha2::{Digest as _, Sha256};

use crate::{setup, sh};

#[derive(Args, Debug, Default)]
pub struct ImageArgs {
    /// Only build the static binary (`target/image/xtlock`); the Containerfile's build stage
    /// runs this.
    #[arg(long)]
    pub binary_only: bool,
    /// Skip `xtask setup` (the Containerfile has run it already).
    #[arg(long)]
    pub no_setup: bool,
}

/// What `cargo xtask image` made.
pub struct Built {
    /// `target/image/xtlock-VERSION.tar` (docker-archive).
    pub archive: PathBuf,
    /// `xtlock:VERSION`.
    pub tag: String,
    /// Bytes of the image's one layer (the unpacked image).
    pub layer_bytes: u64,
}

pub fn run(args: &ImageArgs) -> Result<()> {
    if !args.no_setup {
        setup::run_build()?;
    }
    let root = sh::workspace_root();
    let bin = static_binary(&root)?;
    if args.binary_only {
        return Ok(());
    }
    let built = build_archive(&root, &bin)?;
    println!(
        "image {}: {} (one layer of {:.1} MiB; the archive is {:.1} MiB)",
        built.tag,
        built.archive.display(),
        mib(built.layer_bytes),
        mib(fs::metadata(&built.archive)?.len()),
    );
    println!(
        "load it with `docker load -i {}` (or podman load), then push it where your nodes pull from",
        built.archive.display()
    );
    Ok(())
}

/// Setup, static binary and archive, for `deploy-test`.
pub fn build(root: &Path) -> Result<Built> {
    let bin = static_binary(root)?;
    build_archive(root, &bin)
}

fn mib(b: u64) -> f64 {
    b as f64 / 1024.0 / 1024.0
}

pub fn image_dir(root: &Path) -> PathBuf {
    sh::target_dir(root).join("image")
}

/// The host's target triple (`rustc -vV`).
fn host_triple() -> Result<String> {
    let out = sh::capture(Command::new("rustc").arg("-vV")).context("running `rustc -vV`")?;
    out.lines()
        .find_map(|l| l.strip_prefix("host: "))
        .map(str::to_owned)
        .context("`rustc -vV` printed no host line")
}

/// `cargo build --release` of xtlock with glibc linked statically (`+crt-static`, set for
/// the target only so build scripts and proc macros stay dynamic), the real BPF programs
/// embedded, then stripped into `target/image/xtlock`. Fails when the result is not static.
pub fn static_binary(root: &Path) -> Result<PathBuf> {
    let triple = host_triple()?;
    let flags_var = format!(
        "CARGO_TARGET_{}_RUSTFLAGS",
        triple.to_uppercase().replace(['-', '.'], "_")
    );
    sh::run(
        sh::cargo()
            .current_dir(root)
            .args(["build", "--release", "--locked", "-p", "xtlock", "--target"])
            .arg(&triple)
            .env("XTLOCK_REQUIRE_EBPF", "1")
            .env(&flags_var, "-C target-feature=+crt-static"),
    )?;
    let built = sh::target_dir(root)
        .join(&triple)
        .join("release")
        .join("xtlock");
    let dir = image_dir(root);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let out = dir.join("xtlock");
    // The symbols are for debugging on the build machine; the image carries none.
    sh::run(Command::new("strip").arg("-o").arg(&out).arg(&built))
        .context("strip (binutils) the binary")?;
    ensure_static(&out)?;
    println!(
        "ok: {} is statically linked ({:.1} MiB stripped)",
        out.display(),
        mib(fs::metadata(&out)?.len())
    );
    Ok(out)
}

/// An ELF executable without `PT_INTERP` needs no dynamic loader, hence no libc in the image.
fn ensure_static(path: &Path) -> Result<()> {
    use object::{
        read::elf::{ElfFile64, FileHeader as _, ProgramHeader as _},
        Endianness,
    };
    let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let elf = ElfFile64::<Endianness>::parse(&*data)
        .with_context(|| format!("{} is not a 64-bit ELF file", path.display()))?;
    let endian = elf.endian();
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

/// Writes `target/image/xtlock-VERSION.tar` from the Containerfile's final stage, with the
/// build stage's `/xtlock` being the static binary built here.
fn build_archive(root: &Path, bin: &Path) -> Result<Built> {
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
        "architecture": go_arch(),
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
    let archive = dir.join(format!("xtlock-{version}.tar"));
    let tmp = dir.join(format!(".xtlock-{version}.tar.tmp"));
    let mut out = tar::Builder::new(
        fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
    );
    out.mode(tar::HeaderMode::Deterministic);
    let mut put = |name: &str, data: &[u8]| -> Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        out.append_data(&mut h, name, data)
            .with_context(|| format!("writing {name} into the archive"))
    };
    put(&format!("{config_sha}.json"), &config)?;
    put(&format!("{layer_sha}/layer.tar"), &layer)?;
    put("manifest.json", &manifest)?;
    let mut f = out.into_inner().context("finishing the archive")?;
    f.flush()?;
    fs::rename(&tmp, &archive).with_context(|| format!("writing {}", archive.display()))?;
    Ok(Built {
        archive,
        tag,
        layer_bytes: layer.len() as u64,
    })
}

fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
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
