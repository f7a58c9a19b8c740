//! Targets as data: the committed matrix parses, list-targets lists it, unknown keys are errors.

mod toolchain_support;

use metrale_core::target::{list_targets, BackendKind, TargetError, TargetId, TargetSpec};
use toolchain_support::*;

#[test]
fn the_matrix_is_listed_and_every_target_loads() {
    let root = repo().join("targets");
    let ids = list_targets(&root).unwrap();
    let names: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    for hw in ["h200", "h100", "a100", "l40s", "cpu"] {
        for model in ["smollm2-135m", "llama-3.2-1b"] {
            for q in ["q4_1", "bf16"] {
                assert!(
                    names.contains(&format!("{hw}/{model}/{q}")),
                    "{hw}/{model}/{q} missing from {names:?}"
                );
            }
        }
    }
    assert!(names.contains(&"m3-max/smollm2-135m/q4_1".to_string()));
    for id in &ids {
        let s = TargetSpec::load(&root, id).unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(s.id, *id);
        // the embedded texts parse back to the same spec (what the runtime does)
        let again = TargetSpec::from_toml(&s.hardware_toml, &s.model_toml, id).unwrap();
        assert_eq!(again, s);
    }
    // every CUDA target compiles exactly the templates the ABI declares entry points for, the
    // feature templates where its family's features ask (the target validator's rule, seen from
    // the ABI; a tensor-parallel target without the fused batch-1 kernel, which computes whole
    // layers on one GPU, an fp8 one, whose products quantize the normalised row first, and one
    // with an fp8 KV cache, which that kernel does not read), and every feature template is one
    // of the ABI's
    use metrale_core::target::FEATURE_TEMPLATES;
    for t in FEATURE_TEMPLATES {
        assert!(
            metrale_abi::templates().contains(&t),
            "{t}: not an ABI template"
        );
    }
    for id in &ids {
        let s = TargetSpec::load(&root, id).unwrap();
        if s.hardware.backend == BackendKind::Cuda {
            let f = s.features();
            let mut want: Vec<&str> = metrale_abi::templates()
                .into_iter()
                .filter(|t| !FEATURE_TEMPLATES.contains(t) || f.wants(t))
                .filter(|t| {
                    !(*t == "decode"
                        && (s.parallel.tensor > 1
                            || s.quant.weights == "fp8"
                            || s.quant.kv == "fp8"))
                })
                .collect();
            want.sort();
            let mut k: Vec<&str> = s.kernels.iter().map(String::as_str).collect();
            k.sort();
            assert_eq!(k, want, "{id}: kernels list vs the ABI's templates");
        }
    }
    let h200 = TargetSpec::load(&root, &TargetId::new("h200", "smollm2-135m", "q4_1")).unwrap();
    assert_eq!(h200.hardware.backend, BackendKind::Cuda);
    assert_eq!(h200.hardware.cubin_arch.as_deref(), Some("sm_90a"));
    assert_eq!(h200.hardware.sm_count, Some(132));
    assert_eq!(
        (
            h200.model.layers,
            h200.model.hidden,
            h200.model.heads,
            h200.model.kv_heads,
            h200.model.ffn,
            h200.model.vocab
        ),
        (30, 576, 9, 3, 1536, 49152)
    );
    assert_eq!(h200.quant.embedding, "q8_0");
    assert!(h200.serves("llama", 576));
    assert!(!h200.serves("llama", 2048));
    let l = TargetSpec::load(&root, &TargetId::new("a100", "llama-3.2-1b", "bf16")).unwrap();
    assert_eq!(l.model.rope_scaling.as_ref().unwrap().factor, 32.0);
    assert_eq!(l.hardware.sm_count, Some(108));
    let l8 = TargetSpec::load(&root, &TargetId::new("h200", "llama-3.1-8b", "bf16")).unwrap();
    assert_eq!(
        (l8.model.head_dim, l8.model.kv_heads, l8.model.ffn),
        (128, 8, 14336)
    );
    assert!(!l8.model.tied_embeddings);
    assert_eq!(l8.model.rope_scaling.as_ref().unwrap().factor, 8.0);
    assert!(l8.serves("llama", 4096));
    // a MODEL.toml override of the shared model file
    let cpu = TargetSpec::load(&root, &TargetId::new("cpu", "smollm2-135m", "q4_1")).unwrap();
    assert_eq!(cpu.behavior.parallel, Some(4));
    assert_eq!(cpu.behavior.ctx_size, Some(8192));
}

#[test]
fn list_targets_command_prints_the_matrix() {
    let out = run_xtask(&["list-targets"]);
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    // rows compared with their column padding collapsed (the widest name sets the widths)
    let rows: Vec<String> = s
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    for row in [
        "h200 cuda smollm2-135m q4_1 sm_90a 132 13",
        "h200 cuda llama-3.1-8b q4_1 sm_90a 132 13",
        "h200 cuda qwen3-8b bf16 sm_90a 132 13",
        "cpu cpu qwen3-8b bf16 - - 0",
        "cpu cpu qwen3-30b-a3b q4_1 - - 0",
        "cpu cpu gpt-oss-20b bf16 - - 0",
        "h200 cuda llama-3.1-8b fp8 sm_90a 132 12",
    ] {
        assert!(rows.iter().any(|r| r == row), "no row '{row}' in:\n{s}");
    }
    assert!(s.contains("49 targets"), "{s}");
}

fn temp_targets() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    copy_dir(&repo().join("targets"), &d.path().join("targets"));
    d
}

#[test]
fn unknown_keys_are_errors_naming_file_and_key() {
    let id = TargetId::new("h200", "smollm2-135m", "q4_1");
    let cases = [
        ("h200/HARDWARE.toml", "sm_cuont = 132\n", "sm_cuont"),
        (
            "h200/smollm2-135m/q4_1/MODEL.toml",
            "\n[behavior]\nparalel = 3\n",
            "paralel",
        ),
        (
            "models/smollm2-135m.toml",
            "\n[sampling.chat]\ntop_q = 0.9\n",
            "top_q",
        ),
    ];
    for (file, extra, key) in cases {
        let d = temp_targets();
        let root = d.path().join("targets");
        let p = root.join(file);
        let mut text = std::fs::read_to_string(&p).unwrap();
        if extra.starts_with('\n') {
            // replace an existing table so the TOML stays valid
            let table = extra.lines().nth(1).unwrap();
            if let Some(i) = text.find(table) {
                let rest = &text[i + table.len()..];
                text = format!("{}{}{}", &text[..i], extra.trim_start(), rest);
            } else {
                text.push_str(extra);
            }
        } else {
            text = format!("{extra}{text}");
        }
        std::fs::write(&p, text).unwrap();
        let err = TargetSpec::load(&root, &id)
            .expect_err(&format!("{file}: unknown key `{key}` accepted"));
        let msg = err.to_string();
        assert!(matches!(err, TargetError::Parse { .. }), "{msg}");
        assert!(msg.contains(key), "error does not name the key: {msg}");
        assert!(msg.contains("toml"), "error does not name the file: {msg}");
    }
}

#[test]
fn inconsistent_targets_are_refused() {
    let id = TargetId::new("h200", "smollm2-135m", "q4_1");
    let d = temp_targets();
    let root = d.path().join("targets");
    let p = root.join("h200/HARDWARE.toml");
    let t = std::fs::read_to_string(&p)
        .unwrap()
        .replace("cubin_arch = \"sm_90a\"\n", "");
    std::fs::write(&p, t).unwrap();
    let e = TargetSpec::load(&root, &id).unwrap_err().to_string();
    assert!(e.contains("cubin_arch"), "{e}");
    let e = TargetSpec::load(&root, &TargetId::new("h300", "smollm2-135m", "q4_1"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not found") && e.contains("h200/smollm2-135m/q4_1"),
        "{e}"
    );
}

#[test]
fn without_the_toolchain_build_target_names_the_command_to_run() {
    let cache = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(xtask())
        .current_dir(repo())
        .env("METRALE_TOOLCHAIN", cache.path().join("no-toolchain-here"))
        .args([
            "build-target",
            "--hw",
            "a100",
            "--model",
            "llama-3.2-1b",
            "--quant",
            "bf16",
            "--kernels-only",
        ])
        .args([
            "--cache",
            cache.path().to_str().unwrap(),
            "--out",
            cache.path().join("out").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("cargo xtask toolchain") && err.contains("a100/llama-3.2-1b/bf16"),
        "{err}"
    );
}

#[test]
fn metal_target_renders_and_hashes_and_says_where_the_metallib_step_runs() {
    if metrale_codegen::metal::available() {
        eprintln!("SKIP: xcrun metal exists here; this test covers machines without it");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out");
    let o = run_xtask(&[
        "build-target",
        "--hw",
        "m3-max",
        "--model",
        "smollm2-135m",
        "--quant",
        "q4_1",
        "--out",
        out.to_str().unwrap(),
        "--cache",
        d.path().join("c").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("xcrun metal"), "{err}");
    let src = std::fs::read_to_string(out.join("kernels/rmsnorm.metal")).unwrap();
    assert!(
        src.contains("constant constexpr uint HIDDEN = 576;"),
        "{src}"
    );
    let att: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("attestation.json")).unwrap())
            .unwrap();
    let k = &att["predicate"]["buildDefinition"]["internalParameters"]["kernels"]["rmsnorm"];
    assert_eq!(k["closure_hash"].as_str().unwrap().len(), 64);
    let headers: Vec<&str> = k["manifest"]["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["path"].as_str().unwrap())
        .collect();
    assert_eq!(headers, vec!["kernels/metal/common.h"]);
}
