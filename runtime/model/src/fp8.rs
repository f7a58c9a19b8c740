//! FP8 checkpoints as the loaders read them (the format's numerics are `metrale_core::fp8`'s).
//!
//! Owns: reading an HF checkpoint's `quantization_config` ([`quantization_config`]: vLLM's
//! `compressed-tensors` with float 8-bit weights per tensor or per channel, and `fbgemm_fp8`; the
//! others refused by name), turning its scale tensors into one f32 per row ([`normalize_scales`]),
//! and quantizing a bf16 / f16 / f32 checkpoint's layer matrices at load ([`quantize_at_load`],
//! the server's `--quantization fp8`).
//!
//! Invariants after loading: every `F8_E4M3` matrix `blk.N.<m>.weight` has
//! `blk.N.<m>.weight_scale`, f32, one value per row, permuted with the rows where the reader
//! permutes them (Q and K); with static activation scales, `blk.N.<m>.input_scale`, f32, one value;
//! only layer matrices are FP8 (the token embedding and LM head stay as the file has them). A
//! scale of another shape, a scale without its matrix, or an FP8 matrix without a scale is refused
//! before any backend sees the weights.

use crate::error::{ModelError, Result};
use crate::weights::{Source, Weights};
use crate::{Model, ModelConfig};
use metrale_core::dtype::{dequantize_row, DType};
use metrale_core::fp8::{quantize_matrix, Activations};
use serde_json::Value as Json;
use std::path::Path;

/// The name of a matrix's per-row scales (`blk.0.attn_q.weight` -> `blk.0.attn_q.weight_scale`).
pub fn scale_name(matrix: &str) -> String {
    format!("{}_scale", matrix)
}

/// The name of a matrix's static input scale (`blk.0.attn_q.weight` -> `blk.0.attn_q.input_scale`).
pub fn input_scale_name(matrix: &str) -> String {
    match matrix.strip_suffix(".weight") {
        Some(base) => format!("{base}.input_scale"),
        None => format!("{matrix}.input_scale"),
    }
}

/// The methods this reader takes, for messages.
const SUPPORTED: &str = "compressed-tensors with 8-bit float weights per tensor or per channel \
     (vLLM's FP8 checkpoints, e.g. RedHatAI's *-FP8-dynamic), fbgemm_fp8, mxfp4 (gpt-oss's \
     experts); or a bf16 checkpoint quantized at load with --quantization fp8";

/// How an HF config's `quantization_config` says the checkpoint's FP8 products take their input:
/// `None` when the checkpoint is not quantized. Any other method (GPTQ, AWQ, block-wise FP8, ...)
/// or scheme is refused by name.
pub fn quantization_config(cfg: &Json, path: &Path) -> Result<Option<Activations>> {
    let Some(q) = cfg.get("quantization_config") else {
        return Ok(None);
    };
    let method = q.get("quant_method").and_then(Json::as_str).unwrap_or("");
    let unsupported = |field: &str, value: String| ModelError::Unsupported {
        path: path.to_path_buf(),
        field: format!("quantization_config.{field}"),
        value,
        supported: SUPPORTED.into(),
    };
    match method {
        // gpt-oss's MXFP4 experts: weights only, read as GGUF MXFP4 (`hf::gpt_oss_mxfp4`)
        "mxfp4" => Ok(None),
        "fbgemm_fp8" => {
            let ub = q
                .get("activation_scale_ub")
                .and_then(Json::as_f64)
                .map(|u| u as f32);
            Ok(Some(Activations::Dynamic { ub }))
        }
        "compressed-tensors" => {
            let format = q.get("format").and_then(Json::as_str).unwrap_or("");
            if !matches!(format, "float-quantized" | "naive-quantized") {
                return Err(unsupported("format", format.into()));
            }
            let groups = q
                .get("config_groups")
                .and_then(Json::as_object)
                .filter(|g| !g.is_empty())
                .ok_or_else(|| ModelError::Missing {
                    path: path.to_path_buf(),
                    field: "quantization_config.config_groups".into(),
                    hint: "a compressed-tensors checkpoint names its schemes there".into(),
                })?;
            let mut acts: Option<Activations> = None;
            for (name, g) in groups {
                let w = g.get("weights").unwrap_or(&Json::Null);
                let field = |k: &str| format!("config_groups.{name}.weights.{k}");
                let num_bits = w.get("num_bits").and_then(Json::as_u64);
                let kind = w.get("type").and_then(Json::as_str).unwrap_or("");
                if num_bits != Some(8) || kind != "float" {
                    return Err(unsupported(
                        &field("num_bits/type"),
                        format!("{} bits of {kind:?}", num_bits.unwrap_or(0)),
                    ));
                }
                let strategy = w.get("strategy").and_then(Json::as_str).unwrap_or("");
                if !matches!(strategy, "tensor" | "channel") {
                    return Err(unsupported(&field("strategy"), strategy.into()));
                }
                let a = match g.get("input_activations") {
                    None | Some(Json::Null) => {
                        return Err(unsupported(
                            &format!("config_groups.{name}.input_activations"),
                            "none (weight-only FP8)".into(),
                        ))
                    }
                    Some(a) => a,
                };
                let afield = |k: &str| format!("config_groups.{name}.input_activations.{k}");
                let (abits, akind) = (
                    a.get("num_bits").and_then(Json::as_u64),
                    a.get("type").and_then(Json::as_str).unwrap_or(""),
                );
                if abits != Some(8) || akind != "float" {
                    return Err(unsupported(
                        &afield("num_bits/type"),
                        format!("{} bits of {akind:?}", abits.unwrap_or(0)),
                    ));
                }
                let dynamic = a.get("dynamic").and_then(Json::as_bool).unwrap_or(false);
                let astrategy = a.get("strategy").and_then(Json::as_str).unwrap_or("");
                let this = match (dynamic, astrategy) {
                    (true, "token") => Activations::Dynamic { ub: None },
                    (false, "tensor") => Activations::Static,
                    (d, s) => {
                        return Err(unsupported(
                            &afield("dynamic/strategy"),
                            format!("dynamic {d}, strategy {s:?}"),
                        ))
                    }
                };
                match acts {
                    Some(prev) if prev != this => {
                        return Err(unsupported(
                            "config_groups",
                            format!("groups mixing {prev} and {this}"),
                        ))
                    }
                    _ => acts = Some(this),
                }
            }
            Ok(acts)
        }
        "" => Err(unsupported("quant_method", "(none given)".into())),
        other => Err(unsupported("quant_method", other.into())),
    }
}

/// Whether `name` is one of the layer matrices that may be FP8 (the projections of attention and
/// of the MLP or its experts).
pub fn is_layer_matrix(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("blk.") else {
        return false;
    };
    let Some((_, m)) = rest.split_once('.') else {
        return false;
    };
    let m = m.strip_suffix(".weight").unwrap_or("");
    let base = match m.rsplit_once('.') {
        // an expert's own tensor: ffn_gate_exps.E
        Some((b, e)) if e.parse::<usize>().is_ok() => b,
        _ => m,
    };
    matches!(
        base,
        "attn_q"
            | "attn_k"
            | "attn_v"
            | "attn_output"
            | "ffn_gate"
            | "ffn_up"
            | "ffn_down"
            | "ffn_gate_exps"
            | "ffn_up_exps"
            | "ffn_down_exps"
    )
}

fn scalar_f32(w: &Weights, name: &str) -> Result<Vec<f32>> {
    let t = w.get(name)?;
    if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(ModelError::Mismatch {
            path: w.path.clone(),
            field: format!("tensor '{name}' type"),
            expected: "f32, f16 or bf16 scales".into(),
            got: t.dtype.to_string(),
        });
    }
    let mut v = vec![0f32; t.n_elems()];
    dequantize_row(t.dtype, t.data, &mut v).map_err(|source| ModelError::Numerics {
        tensor: name.into(),
        source,
    })?;
    Ok(v)
}

/// Bring every FP8 matrix's scales to one f32 a row (a per-tensor scale repeated; Q and K rows
/// permuted with their matrix's rows, `rope_pairs` per head: `permute` gives the row order), and
/// check every FP8 matrix has them and every scale its matrix; where the config's activation
/// scheme is static, every FP8 matrix's `input_scale` too (one positive value, made f32).
pub(crate) fn normalize_scales(
    w: &mut Weights,
    c: &ModelConfig,
    permute: impl Fn(&str, &[u8], usize) -> Result<Option<Vec<u8>>>,
) -> Result<()> {
    let names: Vec<String> = w.names().map(str::to_string).collect();
    let fp8: Vec<&String> = names
        .iter()
        .filter(|n| w.get(n).is_ok_and(|t| t.dtype == DType::F8_E4M3))
        .collect();
    if fp8.is_empty() && !names.iter().any(|n| n.ends_with(".weight_scale")) {
        return Ok(());
    }
    if c.family.features().fused_projections {
        return Err(ModelError::Unsupported {
            path: w.path.clone(),
            field: "FP8 checkpoint".into(),
            value: c.family.to_string(),
            supported: "FP8 checkpoints of families with separate Q/K/V and gate/up matrices; \
                        quantize a bf16 checkpoint at load with --quantization fp8"
                .into(),
        });
    }
    if c.fp8.is_none() {
        return Err(ModelError::Missing {
            path: w.path.clone(),
            field: "config.json quantization_config".into(),
            hint: "the checkpoint holds FP8 matrices but does not say how their products \
                   quantize activations"
                .into(),
        });
    }
    for n in &names {
        // `blk.N.<m>.weight_scale`; input scales are checked with their matrix below
        let Some(base) = n.strip_suffix("_scale").filter(|m| m.ends_with(".weight")) else {
            continue;
        };
        let m = w.get(base).map_err(|_| ModelError::Mismatch {
            path: w.path.clone(),
            field: format!("tensor '{n}'"),
            expected: format!("the scales of an FP8 matrix '{base}'"),
            got: "no such matrix".into(),
        })?;
        if m.dtype != DType::F8_E4M3 {
            return Err(ModelError::Mismatch {
                path: w.path.clone(),
                field: format!("tensor '{n}'"),
                expected: format!("the scales of an FP8 matrix; '{base}' is {}", m.dtype),
                got: "a scale for a matrix that is not FP8".into(),
            });
        }
        let rows = m.n_rows();
        let v = scalar_f32(w, n)?;
        let per_row: Vec<f32> = match v.len() {
            1 => vec![v[0]; rows],
            k if k == rows => v,
            k => {
                return Err(ModelError::Mismatch {
                    path: w.path.clone(),
                    field: format!("tensor '{n}' shape"),
                    expected: format!(
                        "1 scale (per tensor) or {rows} (per output channel) for the {rows} rows \
                         of '{base}'; block-wise FP8 scales are not read"
                    ),
                    got: format!("{k} values, shape {:?}", w.get(n)?.shape),
                })
            }
        };
        if let Some(bad) = per_row.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(ModelError::Mismatch {
                path: w.path.clone(),
                field: format!("tensor '{n}'"),
                expected: "positive finite scales".into(),
                got: bad.to_string(),
            });
        }
        let bytes: Vec<u8> = per_row.iter().flat_map(|s| s.to_le_bytes()).collect();
        let bytes = permute(base, &bytes, rows)?.unwrap_or(bytes);
        w.replace(n.clone(), DType::F32, vec![rows], Source::Owned(bytes))?;
    }
    for m in fp8 {
        if !is_layer_matrix(m) {
            return Err(ModelError::Unsupported {
                path: w.path.clone(),
                field: format!("tensor '{m}' type"),
                value: "f8_e4m3".into(),
                supported: "FP8 in the layers' projection matrices only (keep the embedding and \
                            LM head in bf16, as compressed-tensors' `ignore: [lm_head]` does)"
                    .into(),
            });
        }
        if !w.contains(&scale_name(m)) {
            return Err(ModelError::MissingTensor {
                path: w.path.clone(),
                name: scale_name(m),
                available: w.len(),
                hint: format!("the FP8 matrix '{m}' needs its weight_scale"),
            });
        }
        let input = input_scale_name(m);
        if c.fp8 == Some(Activations::Static) {
            let v = scalar_f32(w, &input).map_err(|_| ModelError::MissingTensor {
                path: w.path.clone(),
                name: input.clone(),
                available: w.len(),
                hint: "the checkpoint says its activation scales are static (per tensor)".into(),
            })?;
            if v.len() != 1 || !(v[0].is_finite() && v[0] > 0.0) {
                return Err(ModelError::Mismatch {
                    path: w.path.clone(),
                    field: format!("tensor '{input}'"),
                    expected: "one positive scale".into(),
                    got: format!("{v:?}"),
                });
            }
            w.replace(
                input,
                DType::F32,
                vec![1],
                Source::Owned(v[0].to_le_bytes().to_vec()),
            )?;
        }
    }
    Ok(())
}

/// What [`quantize_at_load`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantized {
    /// Matrices quantized (an expert's matrix counts once).
    pub matrices: usize,
    /// Their bytes before and after.
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// Whether kernels whose layer matrices are `weights` (a target's `[quant] weights`) need this
/// checkpoint's quantized at load ([`quantize_at_load`]): they read fp8, and it has no FP8
/// matrices.
pub fn needs_quantizing(config: &ModelConfig, weights: &str) -> bool {
    weights == "fp8" && config.fp8.is_none()
}

/// Quantize every layer matrix of a bf16, f16 or f32 checkpoint to FP8 e4m3 with one scale per
/// output channel (the row's largest magnitude to 448), activations dynamic per token: what
/// vLLM's `--quantization fp8` does to an unquantized checkpoint, with per-channel instead of
/// per-tensor weight scales. A GGUF's 3-D expert tensors become one tensor per expert (the HF
/// reader's names). `threads` quantize matrices in parallel. Already-FP8 checkpoints are left as
/// they are (0 matrices); block-quantized ones (Q4_1, K-quants, ...) are refused by name.
pub fn quantize_at_load(model: &mut Model, threads: usize) -> Result<Quantized> {
    let w = &model.weights;
    let mut jobs: Vec<(String, String)> = Vec::new(); // (source tensor, expert index or "")
    for n in w.names() {
        if !is_layer_matrix(n) {
            continue;
        }
        let t = w.get(n)?;
        match t.dtype {
            DType::F32 | DType::F16 | DType::BF16 => {}
            DType::F8_E4M3 => continue,
            other => {
                return Err(ModelError::Unsupported {
                    path: model.path.clone(),
                    field: format!("tensor '{n}' type (for --quantization fp8)"),
                    value: other.to_string(),
                    supported: "bf16, f16 or f32 matrices (quantize the unquantized checkpoint, \
                                not one already in another format)"
                        .into(),
                })
            }
        }
        if t.shape.len() == 3 {
            for e in 0..t.shape[2] {
                jobs.push((n.to_string(), e.to_string()));
            }
        } else {
            jobs.push((n.to_string(), String::new()));
        }
    }
    if jobs.is_empty() {
        return Ok(Quantized {
            matrices: 0,
            bytes_before: 0,
            bytes_after: 0,
        });
    }
    let threads = threads.clamp(1, jobs.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    type Done = (usize, Vec<usize>, Vec<u8>, Vec<u8>, u64);
    let results: Vec<Result<Vec<Done>>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<Vec<Done>> {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((n, e)) = jobs.get(i) else {
                            return Ok(out);
                        };
                        let t = match e.parse::<usize>() {
                            Ok(e) => w.expert(n, e)?,
                            Err(_) => w.get(n)?,
                        };
                        let (cols, rows) = (t.row_len(), t.n_rows());
                        let f = t.to_f32();
                        let q = quantize_matrix(&f, rows, cols);
                        let scales = q.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                        out.push((i, vec![cols, rows], q.bytes, scales, t.data.len() as u64));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|h| h.join().expect("a quantizing thread panicked"))
            .collect()
    });
    let mut done: Vec<Done> = Vec::with_capacity(jobs.len());
    for r in results {
        done.extend(r?);
    }
    done.sort_by_key(|d| d.0);
    let mut q = Quantized {
        matrices: done.len(),
        bytes_before: 0,
        bytes_after: 0,
    };
    let w = &mut model.weights;
    for (i, shape, bytes, scales, before) in done {
        let (n, e) = &jobs[i];
        let name = match e.as_str() {
            "" => n.clone(),
            e => format!("{}.{e}.weight", n.strip_suffix(".weight").unwrap_or(n)),
        };
        q.bytes_before += before;
        q.bytes_after += (bytes.len() + scales.len()) as u64;
        let rows = shape[1];
        w.replace(
            scale_name(&name),
            DType::F32,
            vec![rows],
            Source::Owned(scales),
        )?;
        w.replace(name, DType::F8_E4M3, shape, Source::Owned(bytes))?;
    }
    // the 3-D expert tensors now live as one tensor per expert
    for (n, e) in &jobs {
        if !e.is_empty() {
            w.remove(n);
        }
    }
    model.config.fp8 = Some(Activations::Dynamic { ub: None });
    Ok(q)
}

/// A matrix's FP8 scales as the backends take them: one f32 per row, and the static input scale
/// where the checkpoint's activation scheme is static (`c.fp8`; a dynamic checkpoint's stray
/// `input_scale` is not used, as vLLM does not).
pub fn scales(w: &Weights, c: &ModelConfig, matrix: &str) -> Result<(Vec<f32>, Option<f32>)> {
    let s = scalar_f32(w, &scale_name(matrix))?;
    let input = match c.fp8 {
        Some(Activations::Static) => scalar_f32(w, &input_scale_name(matrix))?.first().copied(),
        _ => None,
    };
    Ok((s, input))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ct(weights: Json, acts: Json) -> Json {
        json!({"quantization_config": {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"weights": weights, "input_activations": acts,
                "targets": ["Linear"]}},
            "ignore": ["lm_head"]}})
    }

    #[test]
    fn reads_the_schemes_vllm_serves_and_refuses_the_rest() {
        let p = Path::new("config.json");
        let w = |s: &str| json!({"num_bits": 8, "type": "float", "strategy": s});
        let dynamic = json!({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true});
        let stat = json!({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false});
        assert_eq!(quantization_config(&json!({}), p).unwrap(), None);
        assert_eq!(
            quantization_config(&ct(w("channel"), dynamic.clone()), p).unwrap(),
            Some(Activations::Dynamic { ub: None })
        );
        assert_eq!(
            quantization_config(&ct(w("tensor"), stat), p).unwrap(),
            Some(Activations::Static)
        );
        assert_eq!(
            quantization_config(
                &json!({"quantization_config": {"quant_method": "fbgemm_fp8",
                    "activation_scale_ub": 1200.0}}),
                p
            )
            .unwrap(),
            Some(Activations::Dynamic { ub: Some(1200.0) })
        );
        for (cfg, says) in [
            (ct(w("block"), dynamic.clone()), "block"),
            (ct(w("channel"), Json::Null), "weight-only"),
            (
                ct(
                    json!({"num_bits": 4, "type": "int", "strategy": "group"}),
                    dynamic,
                ),
                "4 bits",
            ),
            (
                json!({"quantization_config": {"quant_method": "fp8",
                    "weight_block_size": [128, 128]}}),
                "'fp8'",
            ),
            (
                json!({"quantization_config": {"quant_method": "gptq", "bits": 4}}),
                "gptq",
            ),
        ] {
            let e = quantization_config(&cfg, p).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("compressed-tensors"), "{e}");
        }
    }

    #[test]
    fn layer_matrices_by_name() {
        for n in [
            "blk.0.attn_q.weight",
            "blk.12.ffn_down.weight",
            "blk.3.ffn_gate_exps.weight",
            "blk.3.ffn_up_exps.17.weight",
        ] {
            assert!(is_layer_matrix(n), "{n}");
        }
        for n in [
            "token_embd.weight",
            "output.weight",
            "blk.0.attn_norm.weight",
            "blk.0.ffn_gate_inp.weight",
            "blk.0.attn_q.bias",
            "blk.0.attn_q.weight_scale",
        ] {
            assert!(!is_layer_matrix(n), "{n}");
        }
        assert_eq!(
            scale_name("blk.0.attn_q.weight"),
            "blk.0.attn_q.weight_scale"
        );
        assert_eq!(
            input_scale_name("blk.0.ffn_up_exps.3.weight"),
            "blk.0.ffn_up_exps.3.input_scale"
        );
    }
}
