//! `cargo xtask audit DIR/metrale-server [--rebuild]`: does a server binary still match the sources?
//!
//! Reads the kernel pack from the binary's `.metrale` section without running it, then per kernel:
//! 1. blob digests: sha256 of each embedded blob vs the digest its embedded statement attests
//!    (catches a binary modified after the build);
//! 2. sources: recomputes the kernel's closure manifest from the source tree (current targets/ and
//!    kernels/, the pinned compiler identity) and compares its hash with the attested closure hash;
//!    on a difference, names the changed files / parameters;
//! 3. with `--rebuild`: recompiles from the sources (never from the cache) and compares byte for byte.
//!
//! Also checks KERNEL_SET_HASH against the statement. Exit 0 only when everything matches; otherwise
//! the report and exit status 1.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use metrale_attestation::pack::{keys, Pack};
use metrale_attestation::statement::{kernel_set_hash, Statement};
use metrale_core::target::{TargetId, TargetSpec};

use crate::build_target;

#[derive(clap::Args)]
pub struct Args {
    /// The server binary to audit.
    pub binary: PathBuf,
    /// Also recompile every kernel and compare the bytes.
    #[arg(long)]
    pub rebuild: bool,
    /// Source tree to compare against (default: this repository).
    #[arg(long)]
    pub repo: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let repo = build_target::repo_or_root(&args.repo)?;
    let bytes = std::fs::read(&args.binary)
        .with_context(|| format!("reading {}", args.binary.display()))?;
    let (_, section) = build_target::section_of(&bytes)?.with_context(|| {
        format!(
            "{} has no .metrale section: it was not built by `cargo xtask build-target`",
            args.binary.display()
        )
    })?;
    let mut problems: Vec<String> = Vec::new();
    let mut lines: Vec<String> = Vec::new();
    let pack = match Pack::parse(section) {
        Ok(p) => p,
        Err(e) => {
            println!("FAIL: the embedded kernel pack is corrupt: {e}");
            return Err(crate::xtask_exit::Exit(1).into());
        }
    };
    let text = |k: &str| -> Result<&str> {
        pack.get_str(k)?
            .with_context(|| format!("the embedded pack lacks {k}"))
    };
    let id: TargetId = text(keys::TARGET_ID)?.parse()?;
    let st = Statement::from_json(text(keys::ATTESTATION)?).context("the embedded attestation")?;
    let embedded_set = text(keys::KERNEL_SET_HASH)?;
    let internal = &st.predicate.build_definition.internal_parameters;
    println!(
        "audit {} (target {id}, KERNEL_SET_HASH {embedded_set})",
        args.binary.display()
    );

    // Target files: embedded vs current.
    let root = repo.join("targets");
    let current_spec = TargetSpec::load(&root, &id);
    match &current_spec {
        Err(e) => problems.push(format!(
            "target {id} cannot be loaded from {}: {e}",
            root.display()
        )),
        Ok(spec) => {
            if spec.hardware_toml != text(keys::HARDWARE_TOML)? {
                problems.push(format!(
                    "targets/{}/HARDWARE.toml changed since the build",
                    id.hw
                ));
            }
            if spec.model_toml != text(keys::MODEL_TOML)? {
                problems.push(format!(
                    "targets/{id}/MODEL.toml (or its targets/models file) changed since the build"
                ));
            }
        }
    }
    let recomputed = kernel_set_hash(&id.to_string(), &internal.kernels);
    if recomputed != embedded_set || recomputed != st.kernel_set_hash() {
        problems.push(format!("KERNEL_SET_HASH mismatch: embedded {embedded_set}, statement {}, recomputed {recomputed}", st.kernel_set_hash()));
    }

    let names = pack.kernel_names()?;
    for k in internal.kernels.keys() {
        if !names.contains(&k.as_str()) {
            problems.push(format!("{k}: attested but missing from the embedded pack"));
        }
    }
    let rebuilt: BTreeMap<String, metrale_codegen::BuiltKernel> =
        match (&current_spec, args.rebuild) {
            (Ok(spec), true) => {
                let jobs = std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(2);
                let cache = build_target::default_cache()?;
                match build_target::compile_kernels(&repo, spec, &cache, jobs, true, "rebuild") {
                    Ok(v) => v.into_iter().map(|k| (k.name.clone(), k)).collect(),
                    Err(e) => {
                        problems.push(format!("--rebuild failed: {e:#}"));
                        BTreeMap::new()
                    }
                }
            }
            _ => BTreeMap::new(),
        };
    for name in &names {
        let mut status: Vec<String> = Vec::new();
        let prov = internal.kernels.get(*name);
        // 1. blobs
        let kinds = ["cubin", "ptx", "metal", "metallib"];
        for kind in kinds {
            let Some(blob) = pack.get(&keys::kernel(name, kind)) else {
                continue;
            };
            let subject = format!("kernels/{name}.{kind}");
            let actual = metrale_attestation::sha256_hex(blob);
            match st.subject_sha256(&subject) {
                None => status.push(format!("blob {subject} is not attested")),
                Some(a) if a != actual => status.push(format!(
                    "blob digest mismatch: {subject} attested sha256 {a}, embedded {actual}"
                )),
                _ => {}
            }
        }
        // 2. sources
        match (prov, &current_spec) {
            (None, _) => status.push("not in the embedded attestation".into()),
            (Some(p), Ok(spec)) => {
                if !spec.kernels.iter().any(|k| k == name) {
                    status.push(format!("no longer listed in targets/{id}/MODEL.toml"));
                } else {
                    match metrale_codegen::manifest(&repo, spec, name) {
                        Ok((_, now)) => {
                            if now.hash() != p.closure_hash || p.manifest.hash() != p.closure_hash {
                                let d = p.manifest.diff(&now);
                                status.push(format!(
                                    "sources changed: {}",
                                    if d.is_empty() {
                                        "closure hash differs".to_string()
                                    } else {
                                        d.join("; ")
                                    }
                                ));
                            }
                        }
                        Err(e) => status.push(format!("cannot recompute its closure: {e}")),
                    }
                }
            }
            (Some(_), Err(_)) => status.push("sources not checked (target not loadable)".into()),
        }
        // 3. rebuild
        if args.rebuild {
            match rebuilt.get(*name) {
                None => status.push("not rebuilt".into()),
                Some(k) => {
                    for (kind, b) in &k.blobs {
                        match pack.get(&keys::kernel(name, kind)) {
                            Some(e) if e == &b[..] => {}
                            Some(_) => status.push(format!("rebuild differs: {name}.{kind} is not byte-identical to the embedded blob")),
                            None => status.push(format!("rebuild produced {name}.{kind}, which the binary lacks")),
                        }
                    }
                }
            }
        }
        if status.is_empty() {
            lines.push(format!(
                "  ok       {name}: sources unchanged, blob digests match{}",
                if args.rebuild {
                    ", rebuild byte-identical"
                } else {
                    ""
                }
            ));
        } else {
            for s in &status {
                lines.push(format!("  MISMATCH {name}: {s}"));
            }
            problems.extend(status.into_iter().map(|s| format!("{name}: {s}")));
        }
    }
    if let Ok(spec) = &current_spec {
        for k in &spec.kernels {
            if !names.contains(&k.as_str()) {
                lines.push(format!(
                    "  MISMATCH {k}: listed in MODEL.toml but not in the binary"
                ));
                problems.push(format!("{k}: not in the binary"));
            }
        }
    }
    for l in &lines {
        println!("{l}");
    }
    if problems.is_empty() {
        println!(
            "PASS: {} kernels match the sources and their attested digests",
            names.len()
        );
        Ok(())
    } else {
        println!("FAIL: {} problem(s):", problems.len());
        for p in &problems {
            println!("  - {p}");
        }
        Err(crate::xtask_exit::Exit(1).into())
    }
}
