//! `cargo xtask quantize` on the default model (the real SmolLM2-135M-Instruct, Q4_1):
//! - `--to f32` writes the reference's dequantised values exactly, every other key and tensor
//!   copied, and the CPU backend gives the Q4_1 file's logits on it (f32 activations on both: the
//!   same products summed in another grouping);
//! - `--to q4_k_m` gives each tensor llama.cpp's choice for that mix: Q4_K / Q6_K where rows are
//!   whole super-blocks (`ffn_down`, 1,536 columns), the fallbacks Q5_0 / Q8_0 for the 576-column
//!   rows, the tied embedding the LM head's Q6_K (so Q8_0), norms untouched; its logits stay near
//!   the f32 file's (quantization noise, bounded);
//! - a type it does not know is refused by name with the valid ones, and the model itself as the
//!   output before anything is written.
//!
//! Needs METRALE_MODEL (the default model); skips, saying so, without it.

mod toolchain_support;

use metrale_backend::cpu::CpuBackend;
use metrale_core::dtype::DType;
use metrale_model::Model;
use toolchain_support::*;

fn logits(m: &Model, prompt: &[u32]) -> Vec<f32> {
    let mut b = CpuBackend::load(m, 1, 64, 2).unwrap();
    b.set_exact_activations(true);
    metrale_backend::teacher_forced_logits(&mut b, prompt, &[], None)
        .unwrap()
        .pop()
        .unwrap()
}

#[test]
fn quantize_writes_the_reference_and_llama_cpps_mixes() {
    let Some(model) = std::env::var_os("METRALE_MODEL") else {
        eprintln!("skipping: METRALE_MODEL is not set (the default model)");
        return;
    };
    let model = model.to_str().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = |t: &str| dir.path().join(format!("{t}.gguf"));
    for t in ["f32", "q4_k_m"] {
        let o = out(t);
        let r = run_xtask(&["quantize", &model, "--to", t, "--out", o.to_str().unwrap()]);
        assert!(r.status.success(), "quantize --to {t} failed");
    }
    let bad = run_xtask(&["quantize", &model, "--to", "q3_k", "--out", "/dev/null"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("q3_k") && err.contains("q4_k_m"),
        "{err}"
    );
    // the model itself as --out is refused before anything is written
    let same = run_xtask(&["quantize", &model, "--to", "f32", "--out", &model]);
    let err = String::from_utf8_lossy(&same.stderr);
    assert!(
        !same.status.success() && err.contains("the model itself"),
        "{err}"
    );

    let q = Model::load(std::path::Path::new(&model)).unwrap();
    let f = Model::load(&out("f32")).unwrap();
    let k = Model::load(&out("q4_k_m")).unwrap();
    assert_eq!(f.weights.names().count(), q.weights.names().count());
    for n in q.weights.names() {
        let (a, b) = (q.weights.get(n).unwrap(), f.weights.get(n).unwrap());
        assert_eq!(a.shape, b.shape, "{n}");
        let want = if a.shape.len() >= 2 && !n.ends_with("_norm.weight") {
            DType::F32
        } else {
            a.dtype
        };
        assert_eq!(b.dtype, want, "{n}");
        assert_eq!(
            a.to_f32(),
            b.to_f32(),
            "{n}: the f32 file holds the dequantised values"
        );
    }
    assert_tensor_types(
        &k,
        &[
            ("token_embd.weight", DType::Q8_0),
            ("blk.0.attn_q.weight", DType::Q5_0),
            ("blk.0.attn_v.weight", DType::Q8_0),
            ("blk.4.attn_v.weight", DType::Q5_0),
            ("blk.0.ffn_down.weight", DType::Q6_K),
            ("blk.3.ffn_down.weight", DType::Q4_K),
            ("blk.5.ffn_down.weight", DType::Q6_K),
            ("blk.0.ffn_up.weight", DType::Q5_0),
            ("blk.0.attn_norm.weight", DType::F32),
        ],
        "q4_k_m",
    );
    assert_eq!(
        k.config.vocab, q.config.vocab,
        "metadata copied (the tokenizer too)"
    );

    let prompt = q
        .tokenizer
        .encode(
            "The capital of France is Paris, and the capital of Italy is",
            false,
            false,
        )
        .unwrap();
    let (lq, lf, lk) = (
        logits(&q, &prompt),
        logits(&f, &prompt),
        logits(&k, &prompt),
    );
    let max_diff = lq
        .iter()
        .zip(&lf)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = lf.iter().fold(0f32, |m, v| m.max(v.abs()));
    // the same weights and f32 activations: the Q4_1 dot sums d * (sum q x) + m * (sum x), the f32
    // one sum (q d + m) x; ~1e-6 of the logits' scale, bounded at 1e-4
    assert!(
        max_diff <= 1e-4 * scale,
        "f32 file vs Q4_1 file: {max_diff} (logits up to {scale})"
    );
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in lk.iter().zip(&lf) {
        num += ((a - b) as f64).powi(2);
        den += (*b as f64).powi(2);
    }
    let rel = (num / den).sqrt();
    eprintln!("f32 vs Q4_1: max |diff| {max_diff:.2e}; Q4_K_M vs f32: relative L2 {rel:.3}");
    // 4-6-bit weights from the 4-bit ones through 30 layers: measured below 0.1
    assert!(
        rel <= 0.25,
        "Q4_K_M logits are {rel} (relative L2) from f32"
    );
}

/// A mixture of experts through `--to q4_k_m`: the router stays f32 (llama-quantize never
/// quantizes `ffn_gate_inp`), the experts take the mix, with the fallbacks where their rows (128
/// columns) are not whole super-blocks. synth-model's own q4_k_m writes the same types, and
/// llama-quantize wrote these for the same bf16 file (every tensor's type compared, 2026-12-04).
#[test]
fn quantize_leaves_a_mixtures_router_alone() {
    if std::env::var_os("METRALE_MODEL").is_none() {
        eprintln!("skipping: METRALE_MODEL is not set (synth-model takes its tokenizer)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let toml = repo().join("tests/golden/tiny-qwen3moe.toml");
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let tok = std::env::var("METRALE_MODEL").unwrap();
    for (args, what) in [
        (
            vec![
                "synth-model",
                toml.to_str().unwrap(),
                "--tokenizer",
                &tok,
                "--out",
                &p("bf16.gguf"),
            ],
            "synth-model bf16",
        ),
        (
            vec![
                "quantize",
                &p("bf16.gguf"),
                "--to",
                "q4_k_m",
                "--out",
                &p("q.gguf"),
            ],
            "quantize",
        ),
        (
            vec![
                "synth-model",
                toml.to_str().unwrap(),
                "--tokenizer",
                &tok,
                "--quant",
                "q4_k_m",
                "--out",
                &p("s.gguf"),
            ],
            "synth-model q4_k_m",
        ),
    ] {
        let r = run_xtask(&args);
        assert!(
            r.status.success(),
            "{what} failed: {}",
            String::from_utf8_lossy(&r.stderr)
        );
    }
    for file in ["q.gguf", "s.gguf"] {
        let m = Model::load(std::path::Path::new(&p(file))).unwrap();
        assert_tensor_types(
            &m,
            &[
                ("blk.0.ffn_gate_inp.weight", DType::F32),
                ("blk.1.ffn_gate_inp.weight", DType::F32),
                ("blk.0.ffn_gate_exps.weight", DType::Q4_K),
                // 2 layers: the last (the last eighth) takes more bits (Q6_K; 128 columns: Q8_0),
                // layer 0 the base (Q4_K; 128 columns: Q5_0)
                ("blk.0.ffn_down_exps.weight", DType::Q5_0),
                ("blk.1.ffn_down_exps.weight", DType::Q8_0),
                ("blk.1.attn_v.weight", DType::Q6_K),
                ("output.weight", DType::Q6_K),
            ],
            file,
        );
    }
}
