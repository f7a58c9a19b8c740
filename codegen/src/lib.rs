//! metrale-codegen: target -> rendered kernel sources -> compiler -> blobs, with a content-addressed
//! cache keyed by each kernel's closure hash. Never needs a GPU.
//!
//! Pipeline per kernel of a [`TargetSpec`]: [`render::render`] (handlebars, strict) -> include
//! closure -> [`ClosureManifest`] and its hash -> cache lookup in `<cache>/<closure hash>/` -> on a
//! miss, compile (CUDA: NVRTC from the pinned [`toolchain`], a cubin for `hw.cubin_arch` and PTX for
//! `hw.ptx_arch`; Metal: `xcrun metal` + `metallib` where present) -> the ABI check of every CUDA
//! entry point's PTX signature against its declaration (`metrale_abi::check_ptx`) -> store in the
//! cache.
//!
//! Invariants: the closure hash covers everything that can change the blobs and nothing that cannot
//! (no absolute path: flags carry [`TOOLCHAIN_PLACEHOLDER`]; no timestamps; no `-lineinfo`/`-G`);
//! a cache entry is written to a temporary folder and renamed into place, so it is complete or absent;
//! an unchanged kernel is never recompiled; every NVRTC compile runs in a fresh worker process
//! without address randomisation ([`worker`]), so the same closure gives the same bytes every time.

pub mod metal;
pub mod nvrtc;
pub mod render;
pub mod toolchain;
pub mod worker;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

pub use metrale_attestation::closure::{
    ClosureManifest, CompileStep, CompilerId, FileDigest, TOOLCHAIN_PLACEHOLDER,
};
use metrale_attestation::sha256_hex;
use metrale_core::target::{BackendKind, TargetSpec};

/// Error of code generation; each names what to fix.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("the pinned CUDA toolchain is not usable at {dir}: {detail}. Run `cargo xtask toolchain` to install it (or set METRALE_TOOLCHAIN to its folder).")]
    Toolchain { dir: PathBuf, detail: String },
    #[error("target {target}: template {template}{}: {message}", parameter.as_ref().map(|p| format!(", parameter `{p}`")).unwrap_or_default())]
    Template {
        target: String,
        template: String,
        parameter: Option<String>,
        message: String,
    },
    #[error("target {target}: kernel `{kernel}` is listed in MODEL.toml but its template {path} cannot be read: {detail}")]
    TemplateMissing {
        target: String,
        kernel: String,
        path: PathBuf,
        detail: String,
    },
    #[error("{file}: #include \"{include}\": {detail}")]
    Include {
        file: String,
        include: String,
        detail: String,
    },
    #[error(
        "target {target}: kernel `{kernel}` failed to compile for {arch}; compiler log:\n{log}"
    )]
    Compile {
        target: String,
        kernel: String,
        arch: String,
        log: String,
    },
    #[error("target {target}: kernel `{kernel}` does not match the host's ABI (abi/src/entries.rs): {detail}")]
    Abi {
        target: String,
        kernel: String,
        detail: String,
    },
    #[error("NVRTC {call} failed: {message} (code {code})")]
    Nvrtc {
        call: &'static str,
        code: i32,
        message: String,
    },
    #[error("kernel `{kernel}`: {message}")]
    Metal { kernel: String, message: String },
    #[error("kernel `{kernel}`: the NVRTC worker process {worker} failed: {message}")]
    Worker {
        kernel: String,
        worker: PathBuf,
        message: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Progress of [`build_kernels`].
#[derive(Debug, Clone)]
pub enum Event {
    Started {
        name: String,
    },
    Finished {
        name: String,
        cached: bool,
        seconds: f64,
    },
}

/// (kind, bytes) of each blob a kernel compiles to: kind is cubin, ptx, metal or metallib.
pub type Blobs = Vec<(String, Vec<u8>)>;

/// A kernel's blobs and provenance.
#[derive(Debug, Clone)]
pub struct BuiltKernel {
    pub name: String,
    pub manifest: ClosureManifest,
    pub closure_hash: String,
    pub blobs: Blobs,
    pub functions: Vec<String>,
    pub cached: bool,
    pub seconds: f64,
}

impl BuiltKernel {
    pub fn blob(&self, kind: &str) -> Option<&[u8]> {
        self.blobs
            .iter()
            .find(|(k, _)| k == kind)
            .map(|(_, b)| b.as_slice())
    }
}

/// Inputs of [`build_kernels`].
pub struct BuildRequest<'a> {
    /// Root of the source tree (holding `kernels/`).
    pub repo: &'a Path,
    pub spec: &'a TargetSpec,
    /// The CUDA toolchain folder (see [`toolchain::default_dir`]); unused for other backends.
    pub toolchain_dir: PathBuf,
    /// The content-addressed cache folder.
    pub cache_dir: &'a Path,
    /// Parallel compiles (at least 1).
    pub jobs: usize,
    /// Skip the cache lookup (audit --rebuild): always compile, never store.
    pub force_compile: bool,
    /// The executable that serves one NVRTC compile when started with [`worker::ENV`] set (xtask:
    /// itself). Every compile runs in a fresh one: see [`worker`] for why.
    pub nvrtc_worker: PathBuf,
}

/// The compile steps of a backend for a target. Flags name the toolchain by placeholder.
pub fn compile_steps(spec: &TargetSpec) -> Vec<CompileStep> {
    let h = &spec.hardware;
    match h.backend {
        BackendKind::Cuda => {
            let common = |arch: &str| {
                vec![
                    format!("--gpu-architecture={arch}"),
                    "--std=c++17".to_string(),
                    format!("--include-path={TOOLCHAIN_PLACEHOLDER}/include"),
                ]
            };
            let cubin = h.cubin_arch.clone().unwrap_or_default();
            let ptx = h.ptx_arch.clone().unwrap_or_default();
            vec![
                CompileStep {
                    output: "cubin".into(),
                    flags: common(&cubin),
                    arch: cubin,
                },
                CompileStep {
                    output: "ptx".into(),
                    flags: common(&ptx),
                    arch: ptx,
                },
            ]
        }
        BackendKind::Metal => metal::steps(spec),
        BackendKind::Cpu => Vec::new(),
    }
}

/// The compiler identity for a target's backend.
pub fn compiler_id(spec: &TargetSpec) -> CompilerId {
    match spec.hardware.backend {
        BackendKind::Cuda => toolchain::Lock::get().compiler_id(),
        BackendKind::Metal => metal::compiler_id(),
        BackendKind::Cpu => CompilerId {
            name: "none".into(),
            version: "-".into(),
            libs: Default::default(),
            headers_sha256: String::new(),
        },
    }
}

/// Renders `kernel` and computes its closure manifest from the source tree at `repo` (no compiling).
pub fn manifest(
    repo: &Path,
    spec: &TargetSpec,
    kernel: &str,
) -> Result<(render::Rendered, ClosureManifest), CodegenError> {
    let r = render::render(repo, spec, kernel)?;
    let m = ClosureManifest {
        schema: metrale_attestation::closure::SCHEMA.into(),
        kernel: kernel.into(),
        backend: spec.hardware.backend.to_string(),
        target: spec.id.to_string(),
        template: FileDigest {
            path: r.template_path.clone(),
            sha256: sha256_hex(&r.template),
        },
        rendered_sha256: sha256_hex(r.source.as_bytes()),
        headers: r
            .headers
            .iter()
            .map(|(p, (_, b))| FileDigest {
                path: p.clone(),
                sha256: sha256_hex(b),
            })
            .collect(),
        params: r.params.clone(),
        compiler: compiler_id(spec),
        steps: compile_steps(spec),
    };
    Ok((r, m))
}

/// Renders, hashes and compiles (or fetches from the cache) every kernel of the target, in the
/// MODEL.toml order. `progress` is called from worker threads.
pub fn build_kernels(
    req: &BuildRequest<'_>,
    progress: &(dyn Fn(Event) + Sync),
) -> Result<Vec<BuiltKernel>, CodegenError> {
    let spec = req.spec;
    let names = &spec.kernels;
    // Render everything first: template errors surface before any compile starts.
    let mut prepared = Vec::new();
    let kinds = expected_kinds(spec);
    for k in names {
        let (r, m) = manifest(req.repo, spec, k)?;
        let hit = if req.force_compile {
            None
        } else {
            load_cached(
                &cache_dir_of(req.cache_dir, &m.hash()),
                &r,
                &m,
                &m.hash(),
                &kinds,
            )
        };
        prepared.push((r, m, hit));
    }
    let nvrtc = if spec.hardware.backend == BackendKind::Cuda && !names.is_empty() {
        if prepared.iter().any(|(_, _, hit)| hit.is_none()) {
            let tc = toolchain::Toolchain::locate(&req.toolchain_dir)?;
            Some((nvrtc::Nvrtc::load(&tc.lib_dir())?, tc))
        } else {
            None
        }
    } else {
        None
    };
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<BuiltKernel, CodegenError>>>> =
        Mutex::new((0..prepared.len()).map(|_| None).collect());
    let jobs = req.jobs.max(1).min(prepared.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= prepared.len() {
                    break;
                }
                let (r, m, hit) = &prepared[i];
                progress(Event::Started {
                    name: r.name.clone(),
                });
                let t = Instant::now();
                let out = match hit {
                    // a cached entry passed the check when it was stored; checked again because the
                    // check is cheap and the cache is only a folder
                    Some(b) => {
                        check_abi(&spec.id.to_string(), &b.name, &b.blobs).map(|_| b.clone())
                    }
                    None => build_one(req, r, m, nvrtc.as_ref().map(|(n, tc)| (*n, tc))),
                };
                if let Ok(b) = &out {
                    progress(Event::Finished {
                        name: r.name.clone(),
                        cached: b.cached,
                        seconds: t.elapsed().as_secs_f64(),
                    });
                }
                let failed = out.is_err();
                results.lock().expect("no panics while holding the lock")[i] = Some(out);
                if failed {
                    next.store(usize::MAX / 2, Ordering::SeqCst);
                }
            });
        }
    });
    let mut out = Vec::new();
    for r in results
        .into_inner()
        .expect("no poisoned lock")
        .into_iter()
        .flatten()
    {
        out.push(r?);
    }
    Ok(out)
}

/// Compare a CUDA kernel's PTX entry points with their ABI declarations (`metrale_abi::check_ptx`).
fn check_abi(target: &str, kernel: &str, blobs: &[(String, Vec<u8>)]) -> Result<(), CodegenError> {
    let Some((_, ptx)) = blobs.iter().find(|(k, _)| k == "ptx") else {
        return Ok(());
    };
    metrale_abi::check_ptx(kernel, &String::from_utf8_lossy(ptx)).map_err(|e| CodegenError::Abi {
        target: target.into(),
        kernel: kernel.into(),
        detail: e.to_string(),
    })
}

fn cache_dir_of(cache: &Path, hash: &str) -> PathBuf {
    cache.join(hash)
}

fn expected_kinds(spec: &TargetSpec) -> Vec<String> {
    compile_steps(spec).into_iter().map(|s| s.output).collect()
}

fn build_one(
    req: &BuildRequest<'_>,
    r: &render::Rendered,
    m: &ClosureManifest,
    nvrtc: Option<(&nvrtc::Nvrtc, &toolchain::Toolchain)>,
) -> Result<BuiltKernel, CodegenError> {
    let t0 = Instant::now();
    let hash = m.hash();
    let dir = cache_dir_of(req.cache_dir, &hash);
    let spec = req.spec;
    let target = spec.id.to_string();
    let (blobs, functions) = match spec.hardware.backend {
        BackendKind::Cuda => {
            // NVRTC is loaded here only to fail early on a broken toolchain; compiles run in workers.
            let (_nv, tc) = nvrtc.ok_or_else(|| CodegenError::Toolchain {
                dir: req.toolchain_dir.clone(),
                detail: "not loaded".into(),
            })?;
            let headers: Vec<(String, Vec<u8>)> = r.headers.values().cloned().collect();
            let mut blobs = Vec::new();
            let mut functions = Vec::new();
            for step in &m.steps {
                // the worker replaces the toolchain placeholder (see `worker`)
                let flags = &step.flags;
                let output = if step.output == "cubin" {
                    nvrtc::Output::Cubin
                } else {
                    nvrtc::Output::Ptx
                };
                let (bytes, log) = worker::compile(
                    &req.nvrtc_worker,
                    &tc.dir,
                    &nvrtc::Job {
                        program: &format!("{}.cu", r.name),
                        source: &r.source,
                        headers: &headers,
                        options: flags,
                        output,
                        kernel: &r.name,
                        target: &target,
                        arch: &step.arch,
                    },
                )?;
                // a compile that succeeds may still warn: the front end's warnings, ptxas's
                // performance notes (spills, wgmma serialized: C7515)
                let notes: Vec<&str> = log
                    .lines()
                    .filter(|l| l.contains("warning") || l.contains("Performance Loss"))
                    .collect();
                if !notes.is_empty() {
                    eprintln!(
                        "warning: {target}: kernel `{}` for {}:\n  {}",
                        r.name,
                        step.arch,
                        notes.join("\n  ")
                    );
                }
                if output == nvrtc::Output::Ptx {
                    functions = metrale_abi::ptx_entries(&String::from_utf8_lossy(&bytes))
                        .into_iter()
                        .map(|e| e.name)
                        .collect();
                }
                blobs.push((step.output.clone(), bytes));
            }
            check_abi(&target, &r.name, &blobs)?;
            if functions.is_empty() {
                return Err(CodegenError::Compile {
                    target,
                    kernel: r.name.clone(),
                    arch: "ptx".into(),
                    log:
                        "the PTX declares no kernel (.entry); mark kernels extern \"C\" __global__"
                            .into(),
                });
            }
            (blobs, functions)
        }
        BackendKind::Metal => metal::compile(r, m)?,
        BackendKind::Cpu => (Vec::new(), Vec::new()),
    };
    let b = BuiltKernel {
        name: r.name.clone(),
        manifest: m.clone(),
        closure_hash: hash,
        blobs,
        functions,
        cached: false,
        seconds: t0.elapsed().as_secs_f64(),
    };
    if !req.force_compile
        && b.blobs.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>() == expected_kinds(spec)
    {
        store(&dir, &b)?;
    }
    Ok(b)
}

fn load_cached(
    dir: &Path,
    r: &render::Rendered,
    m: &ClosureManifest,
    hash: &str,
    kinds: &[String],
) -> Option<BuiltKernel> {
    let manifest = std::fs::read_to_string(dir.join("manifest.json")).ok()?;
    let stored: ClosureManifest = serde_json::from_str(&manifest).ok()?;
    if stored.hash() != hash {
        return None;
    }
    let functions = std::fs::read_to_string(dir.join("functions.txt"))
        .ok()?
        .lines()
        .map(str::to_string)
        .collect();
    // Every blob is checked against the digest stored with it: a damaged entry is recompiled.
    let digests: std::collections::BTreeMap<String, String> =
        std::fs::read_to_string(dir.join("blobs.sha256"))
            .ok()?
            .lines()
            .filter_map(|l| {
                l.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect();
    let mut blobs = Vec::new();
    for k in kinds {
        let bytes = std::fs::read(dir.join(k)).ok()?;
        if digests.get(k) != Some(&sha256_hex(&bytes)) {
            return None;
        }
        blobs.push((k.clone(), bytes));
    }
    Some(BuiltKernel {
        name: r.name.clone(),
        manifest: m.clone(),
        closure_hash: hash.to_string(),
        blobs,
        functions,
        cached: true,
        seconds: 0.0,
    })
}

fn store(dir: &Path, b: &BuiltKernel) -> Result<(), CodegenError> {
    let parent = dir.parent().expect("cache entries have a parent");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CodegenError::Io { path, source }
    };
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let tmp = parent.join(
        format!(
            ".tmp-{}-{}-{:?}",
            b.closure_hash,
            std::process::id(),
            std::thread::current().id()
        )
        .replace(['(', ')'], ""),
    );
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let w = |name: &str, bytes: &[u8]| {
        std::fs::write(tmp.join(name), bytes).map_err(io(&tmp.join(name)))
    };
    w(
        "manifest.json",
        serde_json::to_string_pretty(&b.manifest)
            .expect("serializes")
            .as_bytes(),
    )?;
    w("functions.txt", b.functions.join("\n").as_bytes())?;
    for (k, bytes) in &b.blobs {
        w(k, bytes)?;
    }
    let sums: String = b
        .blobs
        .iter()
        .map(|(k, bytes)| format!("{k} {}\n", sha256_hex(bytes)))
        .collect();
    w("blobs.sha256", sums.as_bytes())?;
    if dir.exists() {
        // A damaged entry (load_cached refused it): replace it.
        let _ = std::fs::remove_dir_all(dir);
    }
    if std::fs::rename(&tmp, dir).is_err() {
        // Another build stored the same closure meanwhile: same inputs, same entry.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(())
}
