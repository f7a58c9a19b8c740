//! Metal (Apple) kernels: rendered and closure-hashed like the CUDA ones everywhere; compiled to a
//! `.metallib` only where `xcrun metal` exists (macOS with Xcode). Elsewhere the kernel carries only its
//! rendered `.metal` source and `build-target` stops with a message saying where the metallib step runs.
//!
//! Compiler identity: `xcrun metal --version`'s first line when xcrun is present, else "unavailable",
//! so a closure hash computed without the compiler never claims to match one made with it.

use std::process::Command;
use std::sync::OnceLock;

use metrale_attestation::closure::{ClosureManifest, CompileStep, CompilerId};
use metrale_core::target::TargetSpec;

use crate::render::Rendered;
use crate::CodegenError;

fn xcrun_version() -> Option<String> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    V.get_or_init(|| {
        let out = Command::new("xcrun")
            .args(["-sdk", "macosx", "metal", "--version"])
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .map(|l| l.trim().to_string())
    })
    .clone()
}

/// Whether the metallib step can run on this machine.
pub fn available() -> bool {
    xcrun_version().is_some()
}

pub fn compiler_id() -> CompilerId {
    CompilerId {
        name: "xcrun-metal".into(),
        version: xcrun_version().unwrap_or_else(|| "unavailable".into()),
        libs: Default::default(),
        headers_sha256: String::new(),
    }
}

pub fn steps(spec: &TargetSpec) -> Vec<CompileStep> {
    let std = spec.hardware.metal_std.clone().unwrap_or_default();
    vec![
        CompileStep {
            output: "metal".into(),
            arch: std.clone(),
            flags: vec!["render".into()],
        },
        CompileStep {
            output: "metallib".into(),
            arch: std.clone(),
            flags: vec![format!("-std={std}"), "-O2".into()],
        },
    ]
}

/// `kernel void <name>(` declarations of a Metal source.
pub fn entries(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in src.lines() {
        let code = line.split("//").next().unwrap_or("");
        let toks: Vec<&str> = code.split_whitespace().collect();
        for w in toks.windows(3) {
            if w[0] == "kernel" && w[1] == "void" {
                let n = w[2].split('(').next().unwrap_or("");
                if !n.is_empty() {
                    out.push(n.to_string());
                }
            }
        }
    }
    out
}

/// The rendered source as the `metal` blob, plus the `metallib` where xcrun exists.
pub fn compile(
    r: &Rendered,
    m: &ClosureManifest,
) -> Result<(crate::Blobs, Vec<String>), CodegenError> {
    let functions = entries(&r.source);
    if functions.is_empty() {
        return Err(CodegenError::Metal {
            kernel: r.name.clone(),
            message: "the source declares no `kernel void <name>(`".into(),
        });
    }
    let mut blobs = vec![("metal".to_string(), r.source.clone().into_bytes())];
    if !available() {
        return Ok((blobs, functions));
    }
    let step = m
        .steps
        .iter()
        .find(|s| s.output == "metallib")
        .expect("metal steps include metallib");
    let dir = std::env::temp_dir().join(format!("metrale-metal-{}-{}", r.name, std::process::id()));
    let io = |source| CodegenError::Io {
        path: dir.clone(),
        source,
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    for (inc, bytes) in r.headers.values() {
        let p = dir.join(inc);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        std::fs::write(&p, bytes).map_err(io)?;
    }
    let src = dir.join(format!("{}.metal", r.name));
    std::fs::write(&src, &r.source).map_err(io)?;
    let air = dir.join(format!("{}.air", r.name));
    let lib = dir.join(format!("{}.metallib", r.name));
    let run = |args: Vec<String>| -> Result<(), CodegenError> {
        let out = Command::new("xcrun")
            .args(&args)
            .current_dir(&dir)
            .output()
            .map_err(|e| CodegenError::Metal {
                kernel: r.name.clone(),
                message: format!("xcrun: {e}"),
            })?;
        if !out.status.success() {
            return Err(CodegenError::Metal {
                kernel: r.name.clone(),
                message: format!(
                    "xcrun {} failed:\n{}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        Ok(())
    };
    let mut a = vec!["-sdk".into(), "macosx".into(), "metal".into()];
    a.extend(step.flags.iter().cloned());
    a.extend([
        "-c".into(),
        format!("{}.metal", r.name),
        "-o".into(),
        format!("{}.air", r.name),
    ]);
    run(a)?;
    run(vec![
        "-sdk".into(),
        "macosx".into(),
        "metallib".into(),
        format!("{}.air", r.name),
        "-o".into(),
        format!("{}.metallib", r.name),
    ])?;
    let bytes = std::fs::read(&lib).map_err(io)?;
    let _ = std::fs::remove_file(&air);
    let _ = std::fs::remove_dir_all(&dir);
    blobs.push(("metallib".into(), bytes));
    Ok((blobs, functions))
}
