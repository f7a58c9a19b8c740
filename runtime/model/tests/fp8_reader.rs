//! FP8 checkpoints in the HF reader (`metrale_model::fp8`): the tiny-llama fixture's layer matrices
//! quantized to e4m3 with per-channel (or per-tensor) scales and written as compressed-tensors
//! lays them out, then read back: types, scales one f32 a row and permuted with Q and K's rows, the
//! config's activation scheme; the same matrices quantized at load instead give the same bytes;
//! and every malformed variant (a scale of the wrong shape, a matrix without its scale, a scale
//! without its matrix, no quantization_config) is refused by name before a backend sees it.

use metrale_core::dtype::{dequantize_row, DType};
use metrale_core::fp8::{e4m3_to_f32, quantize_matrix, Activations};
use metrale_model::Model;
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama")
}

type Tensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

fn is_projection(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with("_proj.weight")
}

/// The fixture's tensors with every projection quantized to FP8 (per row, or with one scale for
/// the tensor where `per_tensor`), `edit` applied last.
fn fp8_tensors(per_tensor: bool) -> Tensors {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out = Tensors::new();
    for (name, v) in st.tensors() {
        if !is_projection(&name) {
            out.push((name, v.dtype(), v.shape().to_vec(), v.data().to_vec()));
            continue;
        }
        let dt = match v.dtype() {
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F16 => DType::F16,
            d => panic!("{name}: {d:?}"),
        };
        let (rows, cols) = (v.shape()[0], v.shape()[1]);
        let mut f = vec![0f32; rows * cols];
        dequantize_row(dt, v.data(), &mut f).unwrap();
        let q = if per_tensor {
            let amax = f.iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = amax / 448.0;
            let bytes = f
                .iter()
                .map(|x| metrale_core::fp8::f32_to_e4m3(x / s))
                .collect();
            metrale_core::fp8::Fp8Matrix {
                bytes,
                scales: vec![s],
            }
        } else {
            quantize_matrix(&f, rows, cols)
        };
        let scale_shape = if per_tensor { vec![1] } else { vec![rows, 1] };
        out.push((
            name.clone(),
            safetensors::Dtype::F8_E4M3,
            vec![rows, cols],
            q.bytes,
        ));
        out.push((
            format!("{name}_scale"),
            safetensors::Dtype::F32,
            scale_shape,
            q.scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        ));
    }
    out
}

fn quantization_config() -> serde_json::Value {
    serde_json::json!({
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": true}}},
        "ignore": ["lm_head"]})
}

/// A folder with the fixture's tokenizer and config (with `qc` as its quantization_config, if
/// any) and `tensors`.
fn folder(tensors: &Tensors, qc: Option<serde_json::Value>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    if let Some(qc) = qc {
        cfg["quantization_config"] = qc;
    }
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::tensor::serialize(views, None).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    dir
}

#[test]
fn per_channel_and_per_tensor_checkpoints_load_with_scales_by_row() {
    let bf16 = Model::load(&fixture()).unwrap();
    for per_tensor in [false, true] {
        let d = folder(&fp8_tensors(per_tensor), Some(quantization_config()));
        let m = Model::load(d.path()).unwrap();
        assert_eq!(m.config.fp8, Some(Activations::Dynamic { ub: None }));
        for l in 0..2 {
            for p in [
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            ] {
                let name = format!("blk.{l}.{p}.weight");
                let w = m.weights.get(&name).unwrap();
                assert_eq!(w.dtype, DType::F8_E4M3, "{name}");
                let (s, input) = metrale_model::fp8::scales(&m.weights, &m.config, &name).unwrap();
                assert_eq!((s.len(), input), (w.n_rows(), None), "{name}");
                // each row, its scale applied, is the bf16 row (as the reader orders it: Q and
                // K permuted to adjacent pairs) within e4m3's rounding: a scale left in HF's row
                // order would put another row's scale on it
                let r = bf16.weights.get(&name).unwrap();
                let cols = w.row_len();
                let mut want = vec![0f32; cols];
                for (row, &scale) in s.iter().enumerate() {
                    r.dequantize_row(row, &mut want).unwrap();
                    let amax = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                    for (c, &b) in w.row(row).iter().enumerate() {
                        let got = e4m3_to_f32(b) * scale;
                        // half a step: 2^-4 of the value, or half a subnormal step of the scale
                        let tol = want[c].abs() / 16.0 + scale / 1024.0 + 1e-12;
                        assert!(
                            (got - want[c]).abs() <= tol,
                            "{name} row {row} col {c}: {got} vs {} (row max {amax})",
                            want[c]
                        );
                    }
                }
            }
        }
        // the embedding and norms stay as the file has them
        assert_eq!(
            m.weights.get("token_embd.weight").unwrap().dtype,
            bf16.weights.get("token_embd.weight").unwrap().dtype
        );
    }
}

#[test]
fn quantized_at_load_is_the_per_channel_checkpoint() {
    let d = folder(&fp8_tensors(false), Some(quantization_config()));
    let file = Model::load(d.path()).unwrap();
    let mut at_load = Model::load(&fixture()).unwrap();
    let q = metrale_model::fp8::quantize_at_load(&mut at_load, 3).unwrap();
    assert_eq!(q.matrices, 14);
    assert!(q.bytes_after < q.bytes_before);
    assert_eq!(at_load.config.fp8, file.config.fp8);
    for n in file.weights.names() {
        let (a, b) = (
            file.weights.get(n).unwrap(),
            at_load.weights.get(n).unwrap(),
        );
        assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{n}");
        assert!(a.data == b.data, "{n}: the same bytes");
    }
    assert_eq!(file.weights.len(), at_load.weights.len());
    // a second pass leaves it as it is
    assert_eq!(
        metrale_model::fp8::quantize_at_load(&mut at_load, 1)
            .unwrap()
            .matrices,
        0
    );
}

/// Static activation scales (compressed-tensors' `input_activations` of strategy tensor, not
/// dynamic): every FP8 matrix needs its `input_scale`, which loads as one f32.
#[test]
fn static_input_scales_load_and_are_required() {
    let mut qc = quantization_config();
    qc["config_groups"]["group_0"]["input_activations"] =
        serde_json::json!({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false});
    let mut t = fp8_tensors(false);
    let names: Vec<String> = t
        .iter()
        .filter(|x| x.1 == safetensors::Dtype::F8_E4M3)
        .map(|x| x.0.clone())
        .collect();
    for (i, n) in names.iter().enumerate() {
        let scale = 0.01 + i as f32 * 1e-3;
        t.push((
            n.replace(".weight", ".input_scale"),
            safetensors::Dtype::BF16,
            vec![1],
            half::bf16::from_f32(scale).to_le_bytes().to_vec(),
        ));
    }
    let d = folder(&t, Some(qc.clone()));
    let m = Model::load(d.path()).unwrap();
    assert_eq!(m.config.fp8, Some(Activations::Static));
    let (_, input) =
        metrale_model::fp8::scales(&m.weights, &m.config, "blk.0.attn_q.weight").unwrap();
    let want = half::bf16::from_f32(
        0.01 + names
            .iter()
            .position(|n| n.contains("layers.0.self_attn.q_proj"))
            .unwrap() as f32
            * 1e-3,
    )
    .to_f32();
    assert_eq!(input, Some(want));
    // one input scale missing
    let short: Tensors = t
        .into_iter()
        .filter(|x| x.0 != "model.layers.1.mlp.up_proj.input_scale")
        .collect();
    let d = folder(&short, Some(qc));
    let e = Model::load(d.path()).unwrap_err().to_string();
    assert!(
        e.contains("blk.1.ffn_up.input_scale") && e.contains("static"),
        "{e}"
    );
}

#[test]
fn malformed_fp8_checkpoints_are_refused_by_name() {
    let q = "model.layers.1.mlp.down_proj.weight";
    let cases: Vec<(Tensors, Option<serde_json::Value>, &[&str])> = vec![
        // a scale per column instead of per row
        (
            fp8_tensors(false)
                .into_iter()
                .map(|mut t| {
                    if t.0 == format!("{q}_scale") {
                        t.2 = vec![t.2[0] + 1, 1];
                        t.3.extend([0, 0, 128, 63]);
                    }
                    t
                })
                .collect(),
            Some(quantization_config()),
            &[
                "blk.1.ffn_down.weight_scale",
                "per output channel",
                "33 values",
            ],
        ),
        // a matrix without its scale
        (
            fp8_tensors(false)
                .into_iter()
                .filter(|t| t.0 != format!("{q}_scale"))
                .collect(),
            Some(quantization_config()),
            &["blk.1.ffn_down.weight_scale", "needs its weight_scale"],
        ),
        // FP8 matrices without a quantization_config
        (
            fp8_tensors(false),
            None,
            &["quantization_config", "FP8 matrices"],
        ),
        // a scale whose matrix is bf16
        (
            {
                let mut t = Tensors::new();
                let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
                let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
                for (n, v) in st.tensors() {
                    t.push((n, v.dtype(), v.shape().to_vec(), v.data().to_vec()));
                }
                t.push((
                    format!("{q}_scale"),
                    safetensors::Dtype::F32,
                    vec![1],
                    1f32.to_le_bytes().to_vec(),
                ));
                t
            },
            Some(quantization_config()),
            &["blk.1.ffn_down.weight_scale", "not FP8"],
        ),
        // a negative scale
        (
            fp8_tensors(true)
                .into_iter()
                .map(|mut t| {
                    if t.0 == format!("{q}_scale") {
                        t.3 = (-1f32).to_le_bytes().to_vec();
                    }
                    t
                })
                .collect(),
            Some(quantization_config()),
            &["blk.1.ffn_down.weight_scale", "positive finite"],
        ),
    ];
    for (i, (tensors, qc, says)) in cases.iter().enumerate() {
        let d = folder(tensors, qc.clone());
        let e = Model::load(d.path()).unwrap_err().to_string();
        for s in *says {
            assert!(e.contains(s), "case {i}: {e:?} should say {s:?}");
        }
    }
}
