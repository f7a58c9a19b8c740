//! `cargo xtask lock [--check]`: `targets/kernels.lock`, the sha256 of every kernel blob of every
//! target in `targets/`.
//!
//! The lock makes every change to what the GPU runs visible in review: a kernel source, header,
//! target parameter, ABI constant or compiler change that alters a blob changes lines of the lock,
//! and a refactor that alters no blob leaves it as it is. `--check` (run by the tests) rebuilds
//! every blob (the content-addressed cache makes that cheap) and fails, naming the blobs that
//! differ and the command to run, when the committed lock is stale.
//!
//! Blobs are what `build-target` writes into `kernels/`: a CUDA target's `<kernel>.cubin` and
//! `<kernel>.ptx`; a Metal target's rendered `<kernel>.metal` source (its metallib needs `xcrun
//! metal` and is not locked, so the lock is the same on every machine); cpu targets have none.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use metrale_core::target::{list_targets, BackendKind, TargetSpec};

use crate::build_target::{compile_kernels, default_cache, repo_or_root};

#[derive(clap::Args)]
pub struct Args {
    /// Compare the blobs with the committed lock instead of writing it; exit 1 when they differ.
    #[arg(long)]
    pub check: bool,
    /// Source tree holding kernels/ and targets/ (default: this repository).
    #[arg(long)]
    pub repo: Option<PathBuf>,
    /// Cache folder (default <target dir>/metrale-cache).
    #[arg(long)]
    pub cache: Option<PathBuf>,
}

/// The lock file of a source tree.
pub fn lock_path(repo: &Path) -> PathBuf {
    repo.join("targets").join("kernels.lock")
}

const HEADER: &str = "\
# targets/kernels.lock: the sha256 of every kernel blob of every target in targets/ (a CUDA
# target's cubin and PTX, a Metal target's rendered source). Written by `cargo xtask lock`;
# `cargo xtask lock --check` (run by the tests) fails when a blob no longer matches.
# <target> <blob> <sha256>
";

/// (target, blob file name) -> sha256 hex.
pub type Entries = BTreeMap<(String, String), String>;

/// Every blob of every target of `repo`, built or taken from `cache`.
pub fn current(repo: &Path, cache: &Path) -> Result<Entries> {
    let root = repo.join("targets");
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let mut out = Entries::new();
    for id in list_targets(&root)? {
        let spec = TargetSpec::load(&root, &id).with_context(|| format!("loading target {id}"))?;
        match spec.hardware.backend {
            BackendKind::Cpu => continue,
            BackendKind::Cuda => {
                let kernels = compile_kernels(repo, &spec, cache, jobs, false, &id.to_string())
                    .with_context(|| format!("building the kernels of {id}"))?;
                for k in &kernels {
                    for (kind, bytes) in &k.blobs {
                        out.insert(
                            (id.to_string(), format!("{}.{kind}", k.name)),
                            metrale_attestation::sha256_hex(bytes),
                        );
                    }
                }
            }
            BackendKind::Metal => {
                for k in &spec.kernels {
                    let (r, _) = metrale_codegen::manifest(repo, &spec, k)?;
                    out.insert(
                        (id.to_string(), format!("{k}.metal")),
                        metrale_attestation::sha256_hex(r.source.as_bytes()),
                    );
                }
            }
        }
    }
    Ok(out)
}

/// The lock file's text for `entries`.
pub fn render(entries: &Entries) -> String {
    let mut s = HEADER.to_string();
    for ((target, blob), digest) in entries {
        s.push_str(&format!("{target} {blob} {digest}\n"));
    }
    s
}

/// Parse a lock file's text (comments and blank lines skipped).
pub fn parse(text: &str) -> Result<Entries> {
    let mut out = Entries::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let [target, blob, digest] = f[..] else {
            bail!(
                "kernels.lock line {}: expected `<target> <blob> <sha256>`, got {line:?}",
                i + 1
            );
        };
        out.insert((target.into(), blob.into()), digest.into());
    }
    Ok(out)
}

/// What differs between the committed lock and the blobs: one line per blob.
pub fn diff(locked: &Entries, now: &Entries) -> Vec<String> {
    let mut d = Vec::new();
    for (k, v) in now {
        match locked.get(k) {
            None => d.push(format!("  new      {} {}", k.0, k.1)),
            Some(old) if old != v => d.push(format!("  changed  {} {}", k.0, k.1)),
            _ => {}
        }
    }
    for k in locked.keys().filter(|k| !now.contains_key(*k)) {
        d.push(format!("  removed  {} {}", k.0, k.1));
    }
    d
}

pub fn run(args: Args) -> Result<()> {
    let repo = repo_or_root(&args.repo)?;
    let cache = match args.cache.clone() {
        Some(c) => c,
        None => default_cache()?,
    };
    let now = current(&repo, &cache)?;
    let path = lock_path(&repo);
    if args.check {
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading {}; write it with `cargo xtask lock`",
                path.display()
            )
        })?;
        let d = diff(&parse(&text)?, &now);
        if d.is_empty() {
            eprintln!("{}: {} blobs, all current", path.display(), now.len());
            return Ok(());
        }
        eprintln!(
            "{} is stale: {} blob(s) differ from what the sources build:\n{}\n\
             If the change is intended, run `cargo xtask lock` and commit targets/kernels.lock.",
            path.display(),
            d.len(),
            d.join("\n")
        );
        return Err(crate::xtask_exit::Exit(1).into());
    }
    let text = render(&now);
    std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
    eprintln!(
        "{}: {} blobs of {} targets, sha256 {}",
        path.display(),
        now.len(),
        now.keys()
            .map(|k| &k.0)
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        metrale_attestation::sha256_hex(text.as_bytes())
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_parse_round_trip_and_diff_names_each_blob() {
        let mut e = Entries::new();
        e.insert(("h200/m/q".into(), "a.cubin".into()), "11".into());
        e.insert(("h200/m/q".into(), "a.ptx".into()), "22".into());
        assert_eq!(parse(&render(&e)).unwrap(), e);
        let mut f = e.clone();
        f.insert(("h200/m/q".into(), "a.ptx".into()), "33".into());
        f.insert(("h100/m/q".into(), "b.cubin".into()), "44".into());
        f.remove(&("h200/m/q".to_string(), "a.cubin".to_string()));
        let d = diff(&e, &f);
        assert_eq!(
            d,
            vec![
                "  new      h100/m/q b.cubin",
                "  changed  h200/m/q a.ptx",
                "  removed  h200/m/q a.cubin"
            ]
        );
        assert!(parse("x y\n").is_err());
    }
}
