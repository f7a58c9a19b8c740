//! `cargo xtask build-target --hw H --model M --quant Q [--out DIR] [--kernels-only]`: renders,
//! closure-hashes and compiles (or takes from the cache) the target's kernels, writes the blobs and the
//! attestation, and builds the per-target `metrale-server` embedding them.
//!
//! Output folder (default `dist/<hw>-<model>-<quant>/`): `kernels/<name>.{cubin,ptx|metal,metallib}`,
//! `attestation.json`, `metrale-server`. The binary embeds a kernel pack (the deterministic statement
//! without the binary's own digest, which cannot be known before the binary exists); the
//! `attestation.json` beside it is that statement plus the binary as one more subject and the build's
//! start and finish times.
//!
//! Cache: `<target dir>/metrale-cache/<closure hash>/` (content-addressed, see metrale-codegen); the
//! pack is written to `<target dir>/metrale-cache/packs/<hw>-<model>-<quant>.pack` only when its bytes
//! change, so an unchanged target relinks nothing.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use metrale_attestation::pack::{keys, PackWriter};
use metrale_attestation::statement::{KernelRecord, Statement, StatementInputs};
use metrale_codegen::{BuildRequest, BuiltKernel, Event};
use metrale_core::target::{BackendKind, TargetId, TargetSpec};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    pub hw: String,
    #[arg(long)]
    pub model: String,
    #[arg(long)]
    pub quant: String,
    /// Output folder (default dist/<hw>-<model>-<quant>/).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Only the kernels and their attestation; do not build the server binary.
    #[arg(long)]
    pub kernels_only: bool,
    /// Source tree holding kernels/ and targets/ (default: this repository).
    #[arg(long)]
    pub repo: Option<PathBuf>,
    /// Parallel compiles (default: number of CPUs).
    #[arg(long, short)]
    pub jobs: Option<usize>,
    /// Cache folder (default <target dir>/metrale-cache).
    #[arg(long)]
    pub cache: Option<PathBuf>,
}

/// The metrale checkout xtask works in: the nearest folder at or above the working directory that
/// holds `targets/` and `kernels/` ([`find_repo`]). Never the path xtask was built at, so a binary
/// carried to another machine works in whatever checkout it is run from.
pub fn repo_root() -> Result<PathBuf> {
    let cwd = std::env::current_dir().context("reading the working directory")?;
    find_repo(&cwd).with_context(|| {
        format!(
            "no metrale checkout (a folder holding targets/ and kernels/) at or above {}: run xtask from inside a checkout, or pass --repo DIR",
            cwd.display()
        )
    })
}

/// The nearest folder at or above `start` that holds `targets/` and `kernels/`.
pub fn find_repo(start: &Path) -> Option<PathBuf> {
    start
        .ancestors()
        .find(|d| d.join("targets").is_dir() && d.join("kernels").is_dir())
        .map(Path::to_path_buf)
}

/// `repo`, or where [`repo_root`] finds one.
pub fn repo_or_root(repo: &Option<PathBuf>) -> Result<PathBuf> {
    match repo {
        Some(r) => Ok(r.clone()),
        None => repo_root(),
    }
}

/// Cargo's target folder (env CARGO_TARGET_DIR or <repo>/target).
pub fn target_dir() -> Result<PathBuf> {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
        _ => Ok(repo_root()?.join("target")),
    }
}

pub fn default_cache() -> Result<PathBuf> {
    Ok(target_dir()?.join("metrale-cache"))
}

/// The repo-relative TOML files a target was read from, with their texts.
pub fn target_files(repo: &Path, id: &TargetId) -> Result<Vec<(String, String)>> {
    let root = repo.join("targets");
    let (_, files) = TargetSpec::resolve_model_toml(&root, id)?;
    let mut out = Vec::new();
    for p in std::iter::once(TargetSpec::hardware_path(&root, id)).chain(files) {
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        let rel = p
            .strip_prefix(repo)
            .unwrap_or(&p)
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join("/");
        out.push((rel, text));
    }
    Ok(out)
}

/// Renders + compiles with a progress display. Returns the kernels in MODEL.toml order.
pub fn compile_kernels(
    repo: &Path,
    spec: &TargetSpec,
    cache: &Path,
    jobs: usize,
    force: bool,
    label: &str,
) -> Result<Vec<BuiltKernel>> {
    let n = spec.kernels.len() as u64;
    let tty = std::io::stderr().is_terminal();
    let bar = if tty && n > 0 {
        let b = indicatif::ProgressBar::new(n);
        b.set_style(
            indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        b.set_prefix(label.to_string());
        Some(b)
    } else {
        None
    };
    let running: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let metal_source_only =
        spec.hardware.backend == BackendKind::Metal && !metrale_codegen::metal::available();
    let progress = |e: Event| match e {
        Event::Started { name } => {
            let mut r = running.lock().unwrap();
            r.push(name);
            if let Some(b) = &bar {
                b.set_message(format!("compiling {}", r.join(", ")));
            }
        }
        Event::Finished {
            name,
            cached,
            seconds,
        } => {
            let mut r = running.lock().unwrap();
            r.retain(|x| x != &name);
            let how = if cached {
                "cached".to_string()
            } else if metal_source_only {
                "rendered and hashed (no metallib: xcrun metal not found)".to_string()
            } else {
                format!("compiled in {seconds:.1} s")
            };
            match &bar {
                Some(b) => {
                    b.println(format!("  {name}: {how}"));
                    b.inc(1);
                    b.set_message(if r.is_empty() {
                        String::new()
                    } else {
                        format!("compiling {}", r.join(", "))
                    });
                }
                None => eprintln!("{label}: {name}: {how}"),
            }
        }
    };
    let nvrtc_worker =
        std::env::current_exe().context("locating the xtask executable (the NVRTC worker)")?;
    let req = BuildRequest {
        repo,
        spec,
        toolchain_dir: metrale_codegen::toolchain::default_dir(&repo_root()?),
        cache_dir: cache,
        jobs,
        force_compile: force,
        nvrtc_worker,
    };
    let r = metrale_codegen::build_kernels(&req, &progress);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(r?)
}

/// The statement for a built kernel set (deterministic; no binary subject).
pub fn statement(repo: &Path, spec: &TargetSpec, kernels: &[BuiltKernel]) -> Result<Statement> {
    let records: Vec<KernelRecord> = kernels
        .iter()
        .map(|k| KernelRecord {
            name: k.name.clone(),
            manifest: k.manifest.clone(),
            functions: k.functions.clone(),
            blobs: k
                .blobs
                .iter()
                .map(|(kind, b)| (format!("kernels/{}.{kind}", k.name), b.clone()))
                .collect(),
        })
        .collect();
    let toolchain_deps = if spec.hardware.backend == BackendKind::Cuda {
        metrale_codegen::toolchain::Lock::get().dependencies()
    } else {
        Vec::new()
    };
    Ok(Statement::build(StatementInputs {
        target: &spec.id.to_string(),
        target_files: target_files(repo, &spec.id)?,
        kernels: &records,
        toolchain_deps,
        builder_version: env!("CARGO_PKG_VERSION"),
    }))
}

/// `hw/model/quant\tmodel_type\thidden_size` lines for every loadable target under `repo/targets`.
pub fn matrix(repo: &Path) -> String {
    let root = repo.join("targets");
    let mut out = String::new();
    for id in metrale_core::target::list_targets(&root).unwrap_or_default() {
        if let Ok(s) = TargetSpec::load(&root, &id) {
            for t in &s.model_types {
                out.push_str(&format!("{id}\t{}\t{}\n", t.model_type, t.hidden_size));
            }
        }
    }
    out
}

/// The kernel pack embedded in the binary.
pub fn pack(spec: &TargetSpec, st: &Statement, kernels: &[BuiltKernel], matrix: &str) -> Vec<u8> {
    let mut w = PackWriter::new();
    w.add(keys::MATRIX, matrix.to_string());
    w.add(keys::TARGET_ID, spec.id.to_string());
    w.add(keys::HARDWARE_TOML, spec.hardware_toml.clone());
    w.add(keys::MODEL_TOML, spec.model_toml.clone());
    w.add(keys::ATTESTATION, st.to_json_pretty());
    w.add(
        keys::TARGET_CLOSURES,
        serde_json::to_string_pretty(
            &st.predicate
                .build_definition
                .internal_parameters
                .target_closures,
        )
        .expect("serializes"),
    );
    w.add(keys::KERNEL_SET_HASH, st.kernel_set_hash().to_string());
    w.add(
        keys::KERNELS,
        kernels
            .iter()
            .map(|k| format!("{}\n", k.name))
            .collect::<String>(),
    );
    for k in kernels {
        w.add(keys::kernel(&k.name, "functions"), k.functions.join("\n"));
        for (kind, b) in &k.blobs {
            w.add(keys::kernel(&k.name, kind), b.clone());
        }
    }
    w.to_bytes()
}

/// Reads the `.metrale` section (the kernel pack) of a binary file's bytes.
pub fn section_of(binary: &[u8]) -> Result<Option<(usize, &[u8])>> {
    use object::{Object, ObjectSection};
    let f = object::File::parse(binary)
        .context("not an object file this tool can read (ELF expected)")?;
    match f.section_by_name(metrale_attestation::pack::SECTION) {
        None => Ok(None),
        Some(s) => {
            let (off, size) = s
                .file_range()
                .context("the .metrale section has no bytes in the file")?;
            let (off, size) = (off as usize, size as usize);
            let bytes = binary
                .get(off..off.checked_add(size).context("section range overflows")?)
                .context("the .metrale section lies past the end of the file")?;
            Ok(Some((off, bytes)))
        }
    }
}

fn now() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

pub fn run(args: Args) -> Result<()> {
    let t0 = Instant::now();
    let started = now();
    let repo = repo_or_root(&args.repo)?;
    let id = TargetId::new(&args.hw, &args.model, &args.quant);
    let spec = TargetSpec::load(&repo.join("targets"), &id)
        .with_context(|| format!("loading target {id}"))?;
    let out = args.out.clone().unwrap_or_else(|| {
        repo.join("dist")
            .join(format!("{}-{}-{}", id.hw, id.model, id.quant))
    });
    let cache = match args.cache.clone() {
        Some(c) => c,
        None => default_cache()?,
    };
    let jobs = args.jobs.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
    });

    let kernels = compile_kernels(&repo, &spec, &cache, jobs, false, &id.to_string())
        .with_context(|| format!("building the kernels of {id}"))?;
    let st = statement(&repo, &spec, &kernels)?;

    // Output folder: kernels/ rewritten from scratch.
    let kdir = out.join("kernels");
    if kdir.exists() {
        std::fs::remove_dir_all(&kdir).with_context(|| format!("clearing {}", kdir.display()))?;
    }
    std::fs::create_dir_all(&kdir).with_context(|| format!("creating {}", kdir.display()))?;
    for k in &kernels {
        for (kind, b) in &k.blobs {
            let p = kdir.join(format!("{}.{kind}", k.name));
            std::fs::write(&p, b).with_context(|| format!("writing {}", p.display()))?;
        }
    }
    let compiled = kernels.iter().filter(|k| !k.cached).count();
    let summary = |binary: &str| {
        eprintln!(
            "{id}: {} kernels ({compiled} compiled, {} cached) in {:.1} s{binary} -> {}\nKERNEL_SET_HASH {}",
            kernels.len(),
            kernels.len() - compiled,
            t0.elapsed().as_secs_f64(),
            out.display(),
            st.kernel_set_hash()
        )
    };
    let att_path = out.join("attestation.json");

    if spec.hardware.backend == BackendKind::Metal
        && kernels.iter().any(|k| k.blob("metallib").is_none())
    {
        std::fs::write(&att_path, st.to_json_pretty())
            .with_context(|| format!("writing {}", att_path.display()))?;
        summary("");
        bail!(
            "{id}: Metal sources rendered and closure-hashed into {}, but the metallib step needs `xcrun metal` (macOS with Xcode), which this machine lacks. Run the same command on a Mac to compile the metallibs and build the binary.",
            kdir.display()
        );
    }
    if args.kernels_only {
        std::fs::write(&att_path, st.to_json_pretty())
            .with_context(|| format!("writing {}", att_path.display()))?;
        summary(" (kernels only)");
        return Ok(());
    }

    // Pack -> server binary.
    let pack_bytes = pack(&spec, &st, &kernels, &matrix(&repo));
    let packs = cache.join("packs");
    std::fs::create_dir_all(&packs)?;
    let pack_path = packs.join(format!("{}-{}-{}.pack", id.hw, id.model, id.quant));
    if std::fs::read(&pack_path).ok().as_deref() != Some(&pack_bytes[..]) {
        std::fs::write(&pack_path, &pack_bytes)
            .with_context(|| format!("writing {}", pack_path.display()))?;
    }
    let binary = build_server(&spec, &pack_path, &pack_bytes, &out)?;
    let digest = metrale_attestation::sha256_hex(&std::fs::read(&binary)?);
    let outer = st.with_binary("metrale-server", &digest, Some(started), Some(now()));
    std::fs::write(&att_path, outer.to_json_pretty())
        .with_context(|| format!("writing {}", att_path.display()))?;
    summary(", server binary built");
    Ok(())
}

fn build_server(
    spec: &TargetSpec,
    pack_path: &Path,
    pack_bytes: &[u8],
    out: &Path,
) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = target_dir()?.join("release").join("metrale-server");
    let dest = out.join("metrale-server");
    for attempt in 0..2 {
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(repo_root()?)
            .args(["build", "--release", "-p", "metrale-server"]);
        if spec.hardware.backend == BackendKind::Cuda {
            cmd.args(["--features", "cuda"]);
        }
        if !std::io::stderr().is_terminal() {
            cmd.arg("--quiet");
        }
        cmd.env("METRALE_KERNEL_PACK", pack_path);
        eprintln!(
            "{}: building metrale-server with the kernel pack ({} bytes)",
            spec.id,
            pack_bytes.len()
        );
        let st = cmd.status().context("running cargo build")?;
        if !st.success() {
            bail!("cargo build --release -p metrale-server failed ({st})");
        }
        let tmp = out.join(".metrale-server.tmp");
        std::fs::copy(&built, &tmp).with_context(|| format!("copying {}", built.display()))?;
        let bytes = std::fs::read(&tmp)?;
        let embedded = section_of(&bytes)?
            .map(|(_, b)| &b[..pack_bytes.len().min(b.len())] == pack_bytes)
            .unwrap_or(false);
        if embedded {
            std::fs::rename(&tmp, &dest)?;
            return Ok(dest);
        }
        let _ = std::fs::remove_file(&tmp);
        if attempt == 0 {
            eprintln!("{}: the built binary does not carry this pack (a concurrent build replaced it?); building again", spec.id);
        }
    }
    bail!(
        "{} does not embed the kernel pack {} after building twice",
        built.display(),
        pack_path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkout is found from any folder inside it, never from where xtask was built.
    #[test]
    fn the_repo_is_found_above_the_working_directory() {
        let t = tempfile::tempdir().unwrap();
        let repo = t.path().join("checkout");
        for d in ["targets/models", "kernels/cuda", "bench/gemm"] {
            std::fs::create_dir_all(repo.join(d)).unwrap();
        }
        assert_eq!(find_repo(&repo), Some(repo.clone()));
        assert_eq!(find_repo(&repo.join("bench/gemm")), Some(repo.clone()));
        // a folder with targets/ alone is not a checkout
        let other = t.path().join("other");
        std::fs::create_dir_all(other.join("targets")).unwrap();
        assert_eq!(find_repo(&other), None);
    }
}
