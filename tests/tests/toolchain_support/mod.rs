//! Shared helpers of the toolchain tests: repo paths, the toolchain gate, running xtask.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => repo().join("target"),
    }
}

/// True when the pinned toolchain is installed. Otherwise prints why the test is skipped, or
/// panics when METRALE_REQUIRE_TOOLCHAIN=1 (CI installs the toolchain first).
pub fn toolchain_present(test: &str) -> bool {
    let dir = metrale_codegen::toolchain::default_dir(&repo());
    match metrale_codegen::toolchain::Toolchain::locate(&dir) {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("METRALE_REQUIRE_TOOLCHAIN").as_deref() == Ok("1") {
                panic!("{test}: METRALE_REQUIRE_TOOLCHAIN=1 but {e}");
            }
            eprintln!("SKIP {test}: {e}");
            false
        }
    }
}

/// target/release/xtask, built once per test process.
pub fn xtask() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let st = Command::new(cargo)
                .current_dir(repo())
                .args(["build", "--release", "--quiet", "-p", "xtask"])
                .status()
                .expect("running cargo");
            assert!(st.success(), "cargo build -p xtask failed");
            target_dir().join("release").join("xtask")
        })
        .clone()
}

/// Runs xtask with `args`, returning its output (stdout+stderr shown on failure by callers).
pub fn run_xtask(args: &[&str]) -> Output {
    let out = Command::new(xtask())
        .current_dir(repo())
        .args(args)
        .output()
        .expect("running xtask");
    eprintln!(
        "$ xtask {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Copies `kernels/` and `targets/` of the repo into `dest` (a source tree for --repo).
pub fn copy_sources(dest: &Path) {
    for d in ["kernels", "targets"] {
        copy_dir(&repo().join(d), &dest.join(d));
    }
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

/// Fixture CUDA headers (not the real kernels, so these tests do not depend on kernels/cuda).
pub const HEADERS: &[(&str, &str)] = &[
    ("x.cuh", "#pragma once\n#include \"z.cuh\"\n__device__ inline float fx(float v) { return fz(v) * 2.0f; }\n"),
    ("y.cuh", "#pragma once\n__device__ inline float fy(float v) { return v + 1.0f; }\n"),
    ("z.cuh", "#pragma once\n__device__ inline float fz(float v) { return v * v * 1.0f; }\n"),
];
// fa: {x, z}; fb: {y}; fc: {y, z}
pub const TEMPLATES: &[(&str, &str)] = &[
    ("fa", "#include \"x.cuh\"\nconstexpr int H = {{model.hidden}};\nextern \"C\" __global__ void fa(float* o) { o[threadIdx.x % H] = fx(o[threadIdx.x]); }\n"),
    ("fb", "#include \"y.cuh\"\n#include <cuda_fp16.h>\nextern \"C\" __global__ void fb(float* o) { o[threadIdx.x] = fy(__half2float(__float2half(o[0]))) * {{hw.sm_count}}; }\n"),
    ("fc", "#include \"y.cuh\"\n#include \"z.cuh\"\nextern \"C\" __global__ void fc_one(float* o) { o[0] = fy(fz(o[0])); }\nextern \"C\" __global__ void fc_two(float* o) { o[1] = {{model.vocab}}; }\n"),
];

/// Writes the fixture templates and headers into `dir/kernels/cuda/`.
pub fn write_fixture_kernels(dir: &Path) {
    let cuda = dir.join("kernels/cuda");
    std::fs::create_dir_all(&cuda).unwrap();
    for (n, t) in HEADERS {
        std::fs::write(cuda.join(n), t).unwrap();
    }
    for (n, t) in TEMPLATES {
        std::fs::write(cuda.join(format!("{n}.cu.hbs")), t).unwrap();
    }
}

/// A source tree at `dir`: the repo's targets/, fixture kernels, and h200/smollm2-135m/q4_1 listing
/// the fixture kernels.
pub fn fixture_tree(dir: &Path) {
    copy_dir(&repo().join("targets"), &dir.join("targets"));
    write_fixture_kernels(dir);
    let m = dir.join("targets/h200/smollm2-135m/q4_1/MODEL.toml");
    let text: String = std::fs::read_to_string(&m)
        .unwrap()
        .lines()
        .map(|l| {
            if l.starts_with("kernels = ") {
                "kernels = [\"fa\", \"fb\", \"fc\"]".to_string()
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&m, text).unwrap();
}

/// Each named tensor of `m` has the given element type (`what`: the file, for the message).
pub fn assert_tensor_types(
    m: &metrale_model::Model,
    want: &[(&str, metrale_core::dtype::DType)],
    what: &str,
) {
    for &(n, t) in want {
        let got = m
            .weights
            .get(n)
            .unwrap_or_else(|e| panic!("{what}: {n}: {e}"))
            .dtype;
        assert_eq!(got, t, "{what}: {n}");
    }
}

/// `cargo xtask synth-model tests/golden/<toml>.toml --seed 0 --out out [extra...]` with the default
/// model (`METRALE_MODEL`) as the tokenizer; `false` where METRALE_MODEL is not set (the caller
/// skips, saying so). Panics when synth-model fails.
#[allow(dead_code)]
pub fn synth_golden_model(toml: &str, out: &std::path::Path, extra: &[&str]) -> bool {
    let Ok(tok) = std::env::var("METRALE_MODEL") else {
        return false;
    };
    let toml = repo().join(format!("tests/golden/{toml}.toml"));
    let mut args = vec![
        "synth-model",
        toml.to_str().unwrap(),
        "--tokenizer",
        &tok,
        "--seed",
        "0",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    assert!(run_xtask(&args).status.success(), "synth-model failed");
    true
}
