//! On a machine with an NVIDIA GPU: every blob of the CUDA targets built under dist/ (or env
//! METRALE_DIST) whose cubin arch matches device 0 loads with cuModuleLoadData (cubin and PTX), after
//! its sha256 matched the attestation, and every kernel function the attestation names is found.
//! Skips (with the reason) where there is no GPU or no matching built target.
//!
//! On the GPU machine: `cargo xtask build-target --hw h200 ... --kernels-only` here, carry dist/, then
//! `cargo test --release -p metrale-e2e --test toolchain_gpu_load -- --nocapture` there.

mod toolchain_support;

use cudarc::driver::CudaContext;
use cudarc::nvrtc::Ptx;
use toolchain_support::*;

#[test]
fn built_cuda_kernels_load_and_their_functions_are_found_on_this_gpu() {
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("SKIP: no CUDA driver library (libcuda) on this machine");
        return;
    }
    let ctx = match CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("SKIP: no usable CUDA device 0: {e:?}");
            return;
        }
    };
    let (maj, min) = ctx.compute_capability().unwrap();
    let dist = std::env::var_os("METRALE_DIST")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| repo().join("dist"));
    let mut targets = 0;
    let mut functions = 0;
    for e in std::fs::read_dir(&dist).into_iter().flatten() {
        let dir = e.unwrap().path();
        let Ok(text) = std::fs::read_to_string(dir.join("attestation.json")) else {
            continue;
        };
        let att: serde_json::Value = serde_json::from_str(&text).unwrap();
        let target = att["predicate"]["buildDefinition"]["externalParameters"]["target"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        let subjects: std::collections::BTreeMap<String, String> = att["subject"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["name"].as_str().unwrap().to_string(),
                    s["digest"]["sha256"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let kernels = att["predicate"]["buildDefinition"]["internalParameters"]["kernels"]
            .as_object()
            .unwrap()
            .clone();
        let Some(first) = kernels.values().next() else {
            continue;
        };
        let Some(arch) = first["manifest"]["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["output"] == "cubin")
            .and_then(|s| s["arch"].as_str())
        else {
            continue;
        };
        let cc: String = arch
            .trim_start_matches("sm_")
            .chars()
            .filter(|c| c.is_ascii_digit())
            .collect();
        if cc != format!("{maj}{min}") {
            eprintln!("{target}: built for {arch}, device 0 is sm_{maj}{min}: not loaded here");
            continue;
        }
        for (name, k) in &kernels {
            for kind in ["cubin", "ptx"] {
                let file = format!("kernels/{name}.{kind}");
                let bytes = std::fs::read(dir.join(&file))
                    .unwrap_or_else(|e| panic!("{target} {file}: {e}"));
                assert_eq!(
                    Some(&metrale_attestation::sha256_hex(&bytes)),
                    subjects.get(&file),
                    "{target} {file}: digest differs from the attestation"
                );
                let image = if kind == "cubin" {
                    Ptx::from_binary(bytes)
                } else {
                    Ptx::from_src(String::from_utf8(bytes).unwrap())
                };
                let module = ctx
                    .load_module(image)
                    .unwrap_or_else(|e| panic!("{target} {file}: cuModuleLoadData failed: {e:?}"));
                for f in k["functions"].as_array().unwrap() {
                    let f = f.as_str().unwrap();
                    module.load_function(f).unwrap_or_else(|e| {
                        panic!("{target} {file}: function {f} not found: {e:?}")
                    });
                    functions += 1;
                }
                eprintln!(
                    "{target}: {file} loaded, functions {:?} found",
                    k["functions"]
                );
            }
        }
        targets += 1;
    }
    if targets == 0 {
        eprintln!(
            "SKIP: no built target under {} matches device 0 (sm_{maj}{min})",
            dist.display()
        );
        return;
    }
    eprintln!("{targets} target(s), {functions} kernel functions found on sm_{maj}{min}");
}
