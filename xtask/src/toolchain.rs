//! `cargo xtask toolchain`: installs the pinned NVRTC + CUDA headers (codegen/toolchain.lock.toml)
//! from PyPI wheels into `<repo>/.toolchain/cuda-13.0/` (or `--dir` / env METRALE_TOOLCHAIN).
//!
//! Steps: `pip download --no-deps --only-binary=:all: --platform ...` of each locked wheel into
//! `.toolchain/wheels/` (skipped when a file with the locked sha256 is already there), sha256 check,
//! unpack only `lib/<locked libs>` and `include/` (python's zipfile: pip is needed anyway) into a
//! staging folder, check every library digest and the headers digest against the lock, write
//! `INSTALLED.toml`, then rename the staging folder into place. A half-done install is never used.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use metrale_codegen::toolchain::{self, Lock, Toolchain};

#[derive(clap::Args)]
pub struct Args {
    /// Install into this folder instead of <repo>/.toolchain/cuda-13.0 (env METRALE_TOOLCHAIN).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Where downloaded wheels are kept (default <repo>/.toolchain/wheels).
    #[arg(long)]
    wheels: Option<PathBuf>,
    /// Re-check the installed files' digests against the lock file (reads ~110 MB).
    #[arg(long)]
    verify: bool,
    /// Reinstall even when an installed toolchain is found.
    #[arg(long)]
    force: bool,
}

pub fn run(args: Args) -> Result<()> {
    let repo = crate::build_target::repo_root()?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| toolchain::default_dir(&repo));
    let lock = Lock::get();
    if !args.force {
        if let Ok(tc) = Toolchain::locate(&dir) {
            if args.verify {
                tc.verify().context("verifying the installed toolchain")?;
                eprintln!("toolchain: digests verified");
            }
            println!(
                "toolchain: NVRTC {} installed at {}",
                lock.version,
                dir.display()
            );
            return Ok(());
        }
    }
    let wheels = args
        .wheels
        .clone()
        .unwrap_or_else(|| repo.join(".toolchain").join("wheels"));
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let mut files = Vec::new();
    for w in &lock.wheel {
        let path = wheels.join(&w.file);
        if path.is_file() && sha256_file(&path)? == w.sha256 {
            eprintln!("toolchain: {} (cached, sha256 ok)", w.file);
        } else {
            download(&lock, w, &wheels)?;
            let got = sha256_file(&path)
                .with_context(|| format!("pip did not produce {}", path.display()))?;
            if got != w.sha256 {
                bail!("{}: sha256 {got}, but codegen/toolchain.lock.toml pins {}. The registry served different bytes; refusing to install.", path.display(), w.sha256);
            }
            eprintln!("toolchain: {} downloaded, sha256 ok", w.file);
        }
        files.push(path);
    }
    let parent = dir.parent().context("the toolchain folder has no parent")?;
    std::fs::create_dir_all(parent)?;
    let staging = parent.join(format!(".staging-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging)?;
    extract(&files, &lock, &staging)?;
    for (lib, want) in &lock.libs {
        let p = staging.join("lib").join(lib);
        let got = sha256_file(&p).with_context(|| format!("{lib} was not in the wheels"))?;
        if &got != want {
            bail!("{}: sha256 {got}, the lock file pins {want}", p.display());
        }
    }
    let hd = toolchain::headers_digest(&staging.join("include"))?;
    if hd != lock.headers.sha256 {
        bail!(
            "CUDA headers digest {hd}, the lock file pins {}",
            lock.headers.sha256
        );
    }
    let installed = format!(
        "# written by `cargo xtask toolchain` after every digest matched codegen/toolchain.lock.toml\nversion = \"{}\"\nheaders_sha256 = \"{}\"\n{}",
        lock.version,
        hd,
        lock.libs.iter().map(|(k, v)| format!("\"{k}\" = \"{v}\"\n")).collect::<String>()
    );
    std::fs::write(staging.join(toolchain::INSTALLED), installed)?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("removing the old {}", dir.display()))?;
    }
    std::fs::rename(&staging, &dir)
        .with_context(|| format!("moving {} to {}", staging.display(), dir.display()))?;
    let tc = Toolchain::locate(&dir)?;
    let nv = metrale_codegen::nvrtc::Nvrtc::load(&tc.lib_dir())?;
    let (a, b) = nv.version()?;
    println!(
        "toolchain: NVRTC {} (reports {a}.{b}) installed at {}",
        lock.version,
        dir.display()
    );
    Ok(())
}

fn sha256_file(p: &Path) -> Result<String> {
    let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    Ok(metrale_attestation::sha256_hex(&bytes))
}

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

fn download(lock: &Lock, w: &toolchain::LockedWheel, wheels: &Path) -> Result<()> {
    let mut cmd = Command::new(python());
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
    ]);
    for p in &lock.platforms {
        cmd.args(["--platform", p]);
    }
    cmd.arg(format!("{}=={}", w.package, w.version))
        .arg("-d")
        .arg(wheels);
    eprintln!("toolchain: pip download {}=={}", w.package, w.version);
    let st = cmd.status().with_context(|| {
        format!(
            "running {} -m pip (is Python 3 with pip installed?)",
            python()
        )
    })?;
    if !st.success() {
        bail!(
            "pip download {}=={} failed ({st}); check network access to PyPI",
            w.package,
            w.version
        );
    }
    Ok(())
}

/// Unpacks `nvidia/cu13/lib/<locked lib>` and `nvidia/cu13/include/**` of the wheels into `dest`.
fn extract(wheels: &[PathBuf], lock: &Lock, dest: &Path) -> Result<()> {
    const SCRIPT: &str = r#"
import sys, zipfile, os
dest = sys.argv[1]; libs = set(sys.argv[2].split(',')); wheels = sys.argv[3:]
prefix = 'nvidia/cu13/'
for w in wheels:
    with zipfile.ZipFile(w) as z:
        for i in z.infolist():
            n = i.filename
            if not n.startswith(prefix) or n.endswith('/'):
                continue
            rel = n[len(prefix):]
            if rel.startswith('include/') or (rel.startswith('lib/') and rel[4:] in libs):
                if '..' in rel.split('/'):
                    sys.exit('unsafe member ' + n)
                out = os.path.join(dest, rel)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(i) as src, open(out, 'wb') as dst:
                    dst.write(src.read())
"#;
    let libs: Vec<&str> = lock.libs.keys().map(|s| s.as_str()).collect();
    let st = Command::new(python())
        .arg("-c")
        .arg(SCRIPT)
        .arg(dest)
        .arg(libs.join(","))
        .args(wheels)
        .status()
        .context("running python3 to unpack the wheels")?;
    if !st.success() {
        bail!("unpacking the wheels failed ({st})");
    }
    Ok(())
}
