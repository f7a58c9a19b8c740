//! HF checkpoint reader: `config.json` + `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`) + `tokenizer.json` + `tokenizer_config.json`.
//!
//! Owns: mapping HF llama tensor names to GGUF names, safetensors row-major shapes to ggml order
//! (reversed), and the Q/K row permutation.
//!
//! Rope convention: HF llama rotates the two halves of each head (`rotate_half`: element j pairs with
//! j + head_dim/2); GGUF/llama.cpp rotates adjacent pairs (2j, 2j+1). llama.cpp's converter permutes
//! the rows of q_proj (with n_heads) and k_proj (with n_kv_heads) so the adjacent-pair rotation computes
//! the same thing: within each head, new row 2j + t = old row t * head_dim/2 + j (t in {0, 1}). This
//! reader does the same, so every backend implements one rope convention. Those two tensors per layer
//! are therefore owned buffers (a copy of their bytes); every other tensor is a zero-copy view of the
//! memory-mapped safetensors files.

use crate::config::{validate_model, ModelConfig};
use crate::error::{ModelError, Result};
use crate::weights::{Source, Weights};
use crate::{ChatTemplate, Format, Model, Tokenizer};
use metrale_core::dtype::DType;
use serde_json::Value as Json;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path};

fn read_json(path: &Path) -> Result<Option<Json>> {
    match crate::files::read_if_exists(path)? {
        Some(b) => parse_json(&b, path).map(Some),
        None => Ok(None),
    }
}

/// Parse a JSON file's bytes (config.json, the shard index...); `path` is used in errors only.
pub fn parse_json(bytes: &[u8], path: &Path) -> Result<Json> {
    serde_json::from_slice(bytes).map_err(|e| ModelError::Malformed {
        path: path.to_path_buf(),
        field: "json".into(),
        msg: e.to_string(),
    })
}

fn required_json(path: &Path, what: &str) -> Result<Json> {
    read_json(path)?.ok_or_else(|| ModelError::Missing {
        path: path.to_path_buf(),
        field: "file".into(),
        hint: format!("an HF llama checkpoint directory needs {what}"),
    })
}

/// The GGUF name of an HF tensor, or `None` for tensors the runtime ignores (`rotary_emb.inv_freq`,
/// recomputed from the config; a multimodal checkpoint's vision tower and projector).
pub fn gguf_name(hf: &str) -> Option<Option<String>> {
    match hf {
        "model.embed_tokens.weight" => return Some(Some("token_embd.weight".into())),
        "model.norm.weight" => return Some(Some("output_norm.weight".into())),
        "lm_head.weight" => return Some(Some("output.weight".into())),
        _ => {}
    }
    // a multimodal checkpoint's language model (Gemma 3: `language_model.model.*` as saved by
    // transformers 4, `model.language_model.*` by transformers 5); its vision tower and
    // projector are not read
    if hf.starts_with("vision_tower.")
        || hf.starts_with("multi_modal_projector.")
        || hf.starts_with("model.vision_tower.")
        || hf.starts_with("model.multi_modal_projector.")
    {
        return Some(None);
    }
    let inner = match hf.strip_prefix("language_model.") {
        Some(r) => Some(r.to_string()),
        None => hf
            .strip_prefix("model.language_model.")
            .map(|r| format!("model.{r}")),
    };
    if let Some(inner) = inner {
        return gguf_name(&inner);
    }
    // FP8 checkpoints (`crate::fp8`): a projection's scales keep its name with their suffix; the
    // KV cache scales some carry are not read (the cache's scales are the runtime's own)
    for suffix in ["weight_scale", "input_scale"] {
        if let Some(base) = hf.strip_suffix(suffix) {
            let m = gguf_name(&format!("{base}weight"))??;
            let m = m.strip_suffix("weight")?;
            return Some(Some(format!("{m}{suffix}")));
        }
    }
    if [".k_scale", ".v_scale", ".kv_scale", ".q_scale"]
        .iter()
        .any(|s| hf.ends_with(s) && hf.contains(".self_attn."))
    {
        return Some(None);
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // the Q/K/V projections' biases (qwen2; gpt-oss's O too) keep their matrix's name with `.bias`
    if let Some(proj) = rest.strip_suffix("_proj.bias") {
        let short = match proj {
            "self_attn.q" => "attn_q",
            "self_attn.k" => "attn_k",
            "self_attn.v" => "attn_v",
            "self_attn.o" => "attn_output",
            _ => return None,
        };
        return Some(Some(format!("blk.{layer}.{short}.bias")));
    }
    // gpt-oss: the sinks, the router with its bias, and the experts stored as one tensor per
    // projection ([`gpt_oss_experts`] turns them into GGUF's)
    match rest {
        "self_attn.sinks" => return Some(Some(format!("blk.{layer}.attn_sinks.weight"))),
        "mlp.router.weight" => return Some(Some(format!("blk.{layer}.ffn_gate_inp.weight"))),
        "mlp.router.bias" => return Some(Some(format!("blk.{layer}.ffn_gate_inp.bias"))),
        "mlp.experts.down_proj_bias" => {
            return Some(Some(format!("blk.{layer}.ffn_down_exps.bias")))
        }
        "mlp.experts.gate_up_proj"
        | "mlp.experts.gate_up_proj_bias"
        | "mlp.experts.down_proj"
        | "mlp.experts.gate_up_proj_blocks"
        | "mlp.experts.gate_up_proj_scales"
        | "mlp.experts.down_proj_blocks"
        | "mlp.experts.down_proj_scales" => {
            let what = rest.strip_prefix("mlp.experts.").unwrap_or(rest);
            return Some(Some(format!("blk.{layer}.{GPT_OSS_EXPERTS}{what}")));
        }
        _ => {}
    }
    let short = match rest {
        "input_layernorm.weight" => "attn_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        // Phi-3's fused projections (`fused_parts` splits them)
        "self_attn.qkv_proj.weight" => "attn_qkv",
        "mlp.gate_up_proj.weight" => "ffn_up",
        "self_attn.q_norm.weight" => "attn_q_norm",
        "self_attn.k_norm.weight" => "attn_k_norm",
        "post_attention_layernorm.weight" => "ffn_norm",
        // Gemma's norms before and after the MLP (its post_attention_layernorm: `family_name`)
        "pre_feedforward_layernorm.weight" => "ffn_norm",
        "post_feedforward_layernorm.weight" => "post_ffw_norm",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        "self_attn.rotary_emb.inv_freq" => return Some(None),
        "mlp.gate.weight" => "ffn_gate_inp",
        _ => {
            // a mixture-of-experts layer's expert E: blk.N.ffn_{gate,up,down}_exps.E.weight
            // (`Weights::expert` finds it)
            let (e, proj) = rest.strip_prefix("mlp.experts.")?.split_once('.')?;
            let e: usize = e.parse().ok()?;
            let kind = match proj {
                "gate_proj.weight" => "gate",
                "up_proj.weight" => "up",
                "down_proj.weight" => "down",
                _ => return None,
            };
            return Some(Some(format!("blk.{layer}.ffn_{kind}_exps.{e}.weight")));
        }
    };
    Some(Some(format!("blk.{layer}.{short}.weight")))
}

/// The infix of the names [`gguf_name`] gives gpt-oss's HF expert tensors, which
/// [`gpt_oss_experts`] reorders into GGUF's.
const GPT_OSS_EXPERTS: &str = "hf_experts.";

/// gpt-oss's HF expert tensors (transformers' layout: `gate_up_proj` `[experts][hidden][2 ffn]`
/// with gate and up columns interleaved, its bias `[experts][2 ffn]`, `down_proj`
/// `[experts][ffn][hidden]`) as GGUF's (`ffn_{gate,up}_exps` `[experts][ffn][hidden]`,
/// `ffn_down_exps` `[experts][hidden][ffn]`, the biases `[experts][ffn]`), as llama.cpp's
/// converter writes them: (GGUF name, ggml shape, bytes). `Ok(None)` for any other tensor.
#[allow(clippy::type_complexity)]
fn gpt_oss_experts(
    name: &str,
    dtype: DType,
    shape: &[usize],
    data: &[u8],
    path: &Path,
    shown: &str,
) -> Result<Option<Vec<(String, Vec<usize>, Vec<u8>)>>> {
    let Some((block, what)) = name.split_once(GPT_OSS_EXPERTS) else {
        return Ok(None);
    };
    if what.ends_with("_blocks") || what.ends_with("_scales") {
        return Ok(None);
    }
    let es = match dtype {
        DType::F32 | DType::F16 | DType::BF16 => dtype.row_bytes(1).unwrap_or(0),
        other => {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                field: format!("tensor '{shown}' dtype"),
                value: other.to_string(),
                supported: "F32, F16 or BF16".into(),
            })
        }
    };
    let bad = |expected: &str| ModelError::Mismatch {
        path: path.to_path_buf(),
        field: format!("tensor '{shown}' shape"),
        expected: expected.into(),
        got: format!("{:?}", hf_shape(shape)),
    };
    // out[e][c][r] = in[e][r][step c + off]: a matrix's columns (every `step`-th) as rows
    let columns = |e_n: usize, r_n: usize, c_n: usize, step: usize, off: usize| {
        let mut out = Vec::with_capacity(data.len() / step);
        for e in 0..e_n {
            for c in 0..c_n / step {
                for r in 0..r_n {
                    let at = ((e * r_n + r) * c_n + step * c + off) * es;
                    out.extend_from_slice(&data[at..at + es]);
                }
            }
        }
        out
    };
    let n = |s: &str| format!("{block}{s}");
    Ok(Some(match (what, shape) {
        ("gate_up_proj", &[c2, h, e]) if c2 % 2 == 0 => vec![
            (
                n("ffn_gate_exps.weight"),
                vec![h, c2 / 2, e],
                columns(e, h, c2, 2, 0),
            ),
            (
                n("ffn_up_exps.weight"),
                vec![h, c2 / 2, e],
                columns(e, h, c2, 2, 1),
            ),
        ],
        ("gate_up_proj_bias", &[c2, e]) if c2 % 2 == 0 => vec![
            (
                n("ffn_gate_exps.bias"),
                vec![c2 / 2, e],
                columns(e, 1, c2, 2, 0),
            ),
            (
                n("ffn_up_exps.bias"),
                vec![c2 / 2, e],
                columns(e, 1, c2, 2, 1),
            ),
        ],
        ("down_proj", &[h, f, e]) => {
            vec![(
                n("ffn_down_exps.weight"),
                vec![f, h, e],
                columns(e, f, h, 1, 0),
            )]
        }
        ("gate_up_proj", _) => return Err(bad("[experts, hidden, 2 x ffn]")),
        ("gate_up_proj_bias", _) => return Err(bad("[experts, 2 x ffn]")),
        _ => return Err(bad("[experts, ffn, hidden]")),
    }))
}

/// gpt-oss's MXFP4 experts as OpenAI's checkpoints hold them (`{gate_up,down}_proj_blocks`
/// `[experts, rows, cols / 32, 16]`, two FP4 codes a byte with element 2j in the low nibble,
/// and `_scales` `[experts, rows, cols / 32]` of E8M0 bytes; gate_up's rows gate and up
/// interleaved) as GGUF MXFP4 tensors (ggml's blocks: the scale byte, then element j in the low
/// and j + 16 in the high nibble of byte j), as llama.cpp's converter repacks them: (GGUF name,
/// ggml shape, bytes). `blocks` and `scales` are (ggml shape, bytes) of one projection's pair.
#[allow(clippy::type_complexity)]
fn gpt_oss_mxfp4(
    name: &str,
    (bshape, blocks): (&[usize], &[u8]),
    (sshape, scales): (&[usize], &[u8]),
    path: &Path,
) -> Result<Vec<(String, Vec<usize>, Vec<u8>)>> {
    let (block, what) = name.split_once(GPT_OSS_EXPERTS).unwrap_or((name, ""));
    let proj = what.trim_end_matches("_blocks").trim_end_matches("_scales");
    let &[16, nb, rows, e] = bshape else {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: format!("tensor '{block}mlp.experts.{proj}_blocks' shape"),
            expected: "[experts, rows, blocks, 16] bytes".into(),
            got: format!("{:?}", hf_shape(bshape)),
        });
    };
    if sshape != [nb, rows, e] || (proj == "gate_up_proj" && rows % 2 != 0) {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: format!("tensor '{block}mlp.experts.{proj}_scales' shape"),
            expected: format!("[{e}, {rows}, {nb}] (one E8M0 byte a block of the _blocks tensor)"),
            got: format!("{:?}", hf_shape(sshape)),
        });
    }
    // HF row r of expert x as GGUF MXFP4 blocks
    let row = |x: usize, r: usize, out: &mut Vec<u8>| {
        for b in 0..nb {
            let at = (x * rows + r) * nb + b;
            let q = &blocks[16 * at..16 * at + 16];
            let code = |i: usize| (q[i / 2] >> (4 * (i % 2))) & 0x0f;
            out.push(scales[at]);
            out.extend((0..16).map(|j| code(j) | (code(j + 16) << 4)));
        }
    };
    let take = |first: usize, step: usize| {
        let mut out = Vec::with_capacity(e * rows / step * nb * 17);
        for x in 0..e {
            for r in (first..rows).step_by(step) {
                row(x, r, &mut out);
            }
        }
        out
    };
    let n = |s: &str| format!("{block}{s}");
    Ok(match proj {
        "gate_up_proj" => vec![
            (
                n("ffn_gate_exps.weight"),
                vec![32 * nb, rows / 2, e],
                take(0, 2),
            ),
            (
                n("ffn_up_exps.weight"),
                vec![32 * nb, rows / 2, e],
                take(1, 2),
            ),
        ],
        _ => vec![(
            n("ffn_down_exps.weight"),
            vec![32 * nb, rows, e],
            take(0, 1),
        )],
    })
}

/// The GGUF name of an HF tensor where a family names it apart from [`gguf_name`]'s (`name`):
/// Gemma's `post_attention_layernorm` is the norm after the attention (GGUF
/// `post_attention_norm`), its `pre_feedforward_layernorm` the one before the MLP (`ffn_norm`).
fn family_name(family: crate::Family, hf: &str, name: String) -> String {
    if family.features().post_norms && hf.ends_with(".post_attention_layernorm.weight") {
        return name.replace(".ffn_norm.", ".post_attention_norm.");
    }
    name
}

/// One part of a fused matrix: its name, ggml shape, byte offset into the fused tensor's data and
/// bytes.
pub(crate) type FusedPart = (String, Vec<usize>, usize, usize);

/// Where a family's files store several matrices as one (`Features::fused_projections`: Phi-3's
/// `attn_qkv`, and `ffn_up` of 2 x ffn rows, gate first), the parts as separate tensors: (name,
/// ggml shape, byte offset into the fused tensor's data, bytes), rows being contiguous in both
/// GGUF and safetensors. `Ok(None)` for any other tensor.
pub(crate) fn fused_parts(
    c: &ModelConfig,
    name: &str,
    dtype: DType,
    shape: &[usize],
    path: &Path,
) -> Result<Option<Vec<FusedPart>>> {
    if !c.family.features().fused_projections || shape.len() != 2 {
        return Ok(None);
    }
    let (cols, rows) = (shape[0], shape[1]);
    let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let parts: Vec<(&str, usize)> = if name.ends_with(".attn_qkv.weight") {
        if rows != q + 2 * kv {
            return Err(ModelError::Mismatch {
                path: path.to_path_buf(),
                field: format!("tensor '{name}' shape"),
                expected: format!("{} rows (Q, K and V) of {cols}", q + 2 * kv),
                got: format!("{shape:?}"),
            });
        }
        vec![("attn_q", q), ("attn_k", kv), ("attn_v", kv)]
    } else if name.ends_with(".ffn_up.weight") && rows == 2 * c.ffn {
        vec![("ffn_gate", c.ffn), ("ffn_up", c.ffn)]
    } else {
        return Ok(None);
    };
    let block = name.rsplit_once('.').map_or(name, |(a, _)| a);
    let block = block.rsplit_once('.').map_or(block, |(a, _)| a);
    let rb = dtype.row_bytes(cols).ok_or_else(|| ModelError::Mismatch {
        path: path.to_path_buf(),
        field: format!("tensor '{name}' shape"),
        expected: format!("rows of whole {dtype} blocks"),
        got: format!("{shape:?}"),
    })?;
    let mut out = Vec::new();
    let mut at = 0;
    for (part, n) in parts {
        out.push((
            format!("{block}.{part}.weight"),
            vec![cols, n],
            at * rb,
            n * rb,
        ));
        at += n;
    }
    Ok(Some(out))
}

/// A norm weight stored as w (f32, f16 or bf16) as the f32 bytes of 1 + w.
fn norm_plus_one(dtype: DType, data: &[u8], path: &Path, shown: &str) -> Result<Vec<u8>> {
    let n = data.len() / dtype.row_bytes(1).unwrap_or(1).max(1);
    let mut v = vec![0f32; n];
    metrale_core::dtype::dequantize_row(dtype, data, &mut v).map_err(|e| {
        ModelError::Malformed {
            path: path.to_path_buf(),
            field: format!("tensor '{shown}'"),
            msg: e.to_string(),
        }
    })?;
    Ok(v.iter().flat_map(|x| (1.0 + x).to_le_bytes()).collect())
}

/// Permute the rows of an HF q_proj/k_proj (`rows` rows of `row_bytes` bytes, `n_head` heads) from
/// HF's half-split rope layout to GGUF's adjacent-pair layout, as llama.cpp's converter does.
pub fn permute_qk_rows(
    data: &[u8],
    rows: usize,
    row_bytes: usize,
    n_head: usize,
) -> Option<Vec<u8>> {
    permute_rotary_rows(data, rows, row_bytes, n_head, None)
}

/// [`permute_qk_rows`] where RoPE rotates only the first `rotary` rows of each head (HF's
/// `partial_rotary_factor`): those go from half-split to adjacent pairs, the rest stay in place.
pub fn permute_rotary_rows(
    data: &[u8],
    rows: usize,
    row_bytes: usize,
    n_head: usize,
    rotary: Option<usize>,
) -> Option<Vec<u8>> {
    if n_head == 0
        || !rows.is_multiple_of(n_head.checked_mul(2)?)
        || data.len() != rows.checked_mul(row_bytes)?
    {
        return None;
    }
    let hd = rows / n_head;
    let rot = rotary.unwrap_or(hd);
    if rot > hd || !rot.is_multiple_of(2) {
        return None;
    }
    let half = rot / 2;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..n_head {
        for j in 0..half {
            for t in 0..2 {
                let src = h * hd + t * half + j;
                out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
        out.extend_from_slice(&data[(h * hd + rot) * row_bytes..(h + 1) * hd * row_bytes]);
    }
    Some(out)
}

/// Tensor `name` (a GGUF name) with its rows reordered from RoPE over the two halves of each head
/// (HF's layout) to adjacent pairs, where it is a Q or K projection (rows: heads x head_dim) or a
/// Q or K bias (one value per row) or a Q or K norm (one weight per head dimension, permuted as a
/// head's rows); `Ok(None)` for any other
/// tensor. `shown` names it in errors (the file's own name).
pub(crate) fn rope_pairs(
    name: &str,
    dtype: DType,
    shape: &[usize],
    data: &[u8],
    c: &ModelConfig,
    path: &Path,
    shown: &str,
) -> Result<Option<Vec<u8>>> {
    let (n_head, rows, row_bytes) =
        if name.ends_with(".attn_q.weight") || name.ends_with(".attn_k.weight") {
            let n_head = if name.ends_with(".attn_q.weight") {
                c.n_heads
            } else {
                c.n_kv_heads
            };
            let rows: usize = shape[1..].iter().product();
            (n_head, rows, dtype.row_bytes(shape[0]).unwrap_or(0))
        } else if name.ends_with(".attn_q.bias") || name.ends_with(".attn_k.bias") {
            let n_head = if name.ends_with(".attn_q.bias") {
                c.n_heads
            } else {
                c.n_kv_heads
            };
            (
                n_head,
                shape.iter().product(),
                dtype.row_bytes(1).unwrap_or(0),
            )
        } else if name.ends_with(".attn_q_norm.weight") || name.ends_with(".attn_k_norm.weight") {
            (1, shape.iter().product(), dtype.row_bytes(1).unwrap_or(0))
        } else {
            return Ok(None);
        };
    let rotary = (c.rotary_dim < c.head_dim).then_some(c.rotary_dim);
    permute_rotary_rows(data, rows, row_bytes, n_head, rotary)
        .map(Some)
        .ok_or_else(|| ModelError::Mismatch {
            path: path.to_path_buf(),
            field: format!("tensor '{shown}' shape"),
            expected: format!(
                "rows (or, for a norm, float elements) in a multiple of 2 x {n_head} heads"
            ),
            got: format!("{:?} {dtype}", hf_shape(shape)),
        })
}

fn plain_file_name(name: &str) -> bool {
    let mut c = Path::new(name).components();
    matches!((c.next(), c.next()), (Some(Component::Normal(_)), None))
}

/// One tensor of a safetensors file, as the runtime names and shapes it.
#[derive(Debug)]
pub struct SafetensorsTensor<'a> {
    /// The name in the file (HF's).
    pub hf_name: String,
    /// The GGUF name ([`gguf_name`]).
    pub name: String,
    pub dtype: DType,
    /// ggml order (the file's row-major shape reversed); 1 or more dimensions, none zero.
    pub shape: Vec<usize>,
    /// The tensor's bytes in the file.
    pub data: &'a [u8],
}

/// The file's row-major shape of a ggml-order shape (for error messages).
fn hf_shape(ggml: &[usize]) -> Vec<usize> {
    ggml.iter().rev().copied().collect()
}

/// Parse a safetensors file's bytes (header and data bounds, by the safetensors crate) and check
/// each tensor: a llama tensor name, an F32/F16/BF16 dtype, 1 or more non-zero dimensions. Tensors the
/// runtime ignores (`rotary_emb.inv_freq`) are left out. `path` is used in errors only.
pub fn read_safetensors<'a>(bytes: &'a [u8], path: &Path) -> Result<Vec<SafetensorsTensor<'a>>> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| ModelError::Malformed {
        path: path.to_path_buf(),
        field: "safetensors header".into(),
        msg: e.to_string(),
    })?;
    let mut out = Vec::new();
    for (hf_name, view) in st.tensors() {
        let name = match gguf_name(&hf_name) {
            Some(Some(n)) => n,
            Some(None) => continue,
            None => {
                return Err(ModelError::Unsupported {
                    path: path.to_path_buf(),
                    field: "tensor".into(),
                    value: hf_name,
                    supported:
                        "the tensors of a llama checkpoint (model.embed_tokens, model.layers.N.\
                                {input_layernorm,self_attn.{q,k,v,o}_proj,post_attention_layernorm,\
                                mlp.{gate,up,down}_proj}, model.norm, lm_head)"
                            .into(),
                })
            }
        };
        let dtype = match view.dtype() {
            // the packed FP4 codes and E8M0 scales of gpt-oss's experts, paired into MXFP4
            // blocks by `gpt_oss_mxfp4`
            safetensors::Dtype::U8 if name.contains(GPT_OSS_EXPERTS) => DType::MXFP4,
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F8_E4M3 => DType::F8_E4M3,
            other => {
                return Err(ModelError::Unsupported {
                    path: path.to_path_buf(),
                    field: format!("tensor '{hf_name}' dtype"),
                    value: format!("{other:?}"),
                    supported: "F32, F16, BF16, F8_E4M3 (with its weight_scale)".into(),
                })
            }
        };
        let shape: Vec<usize> = view.shape().iter().rev().copied().collect();
        if shape.is_empty() || shape.contains(&0) {
            return Err(ModelError::Mismatch {
                path: path.to_path_buf(),
                field: format!("tensor '{hf_name}' shape"),
                expected: "1 or more non-zero dimensions".into(),
                got: format!("{:?}", view.shape()),
            });
        }
        out.push(SafetensorsTensor {
            hf_name,
            name,
            dtype,
            shape,
            data: view.data(),
        });
    }
    Ok(out)
}

pub(crate) fn load(dir: &Path) -> Result<Model> {
    let cfg = required_json(&dir.join("config.json"), "config.json")?;
    let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let gen_cfg = read_json(&dir.join("generation_config.json"))?.unwrap_or(Json::Null);
    let tok_path = dir.join("tokenizer.json");
    let tok_json = crate::files::read(&tok_path)?;

    // add_bos: tokenizer_config.json's flag when present, else whether tokenizer.json's post-processor
    // inserts the BOS token (what HF's encode(add_special_tokens=True) would do).
    let add_bos = match tok_cfg.get("add_bos_token").and_then(Json::as_bool) {
        Some(b) => b,
        None => {
            let tj: Json =
                serde_json::from_slice(&tok_json).map_err(|e| ModelError::Malformed {
                    path: tok_path.clone(),
                    field: "json".into(),
                    msg: e.to_string(),
                })?;
            let bos_str = match tok_cfg.get("bos_token") {
                Some(Json::String(s)) => Some(s.clone()),
                Some(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
                None => None,
            };
            match (bos_str, tj.get("post_processor")) {
                (Some(b), Some(pp)) if !b.is_empty() => pp
                    .get("single")
                    .map(|s| s.to_string().contains(&format!("\"{b}\"")))
                    .unwrap_or(false),
                _ => false,
            }
        }
    };
    let generation_eos: Vec<u32> = match gen_cfg.get("eos_token_id") {
        Some(Json::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .filter_map(|v| u32::try_from(v).ok())
            .collect(),
        Some(v) => v
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .into_iter()
            .collect(),
        None => vec![],
    };
    let cfg_path = dir.join("config.json");
    let mut config = ModelConfig::from_hf(&cfg_path, &cfg, add_bos, &generation_eos)?;

    // Which safetensors files.
    let index_path = dir.join("model.safetensors.index.json");
    let (files, weight_map): (Vec<String>, Option<BTreeMap<String, String>>) =
        match read_json(&index_path)? {
            Some(idx) => {
                let wm = idx
                    .get("weight_map")
                    .and_then(Json::as_object)
                    .ok_or_else(|| ModelError::Missing {
                        path: index_path.clone(),
                        field: "weight_map".into(),
                        hint: "a sharded checkpoint's index maps each tensor to its file".into(),
                    })?;
                let mut map = BTreeMap::new();
                for (k, v) in wm {
                    let f = v.as_str().filter(|f| plain_file_name(f)).ok_or_else(|| {
                        ModelError::Mismatch {
                            path: index_path.clone(),
                            field: format!("weight_map['{k}']"),
                            expected: "a file name in the same directory".into(),
                            got: v.to_string(),
                        }
                    })?;
                    map.insert(k.clone(), f.to_string());
                }
                let files: BTreeSet<String> = map.values().cloned().collect();
                (files.into_iter().collect(), Some(map))
            }
            None => (vec!["model.safetensors".into()], None),
        };
    let mut maps = Vec::with_capacity(files.len());
    for f in &files {
        let p = dir.join(f);
        let io = |source| ModelError::Io {
            path: p.clone(),
            source,
        };
        let file = crate::files::open(&p)?;
        // SAFETY: read-only map; model files must not change while loaded.
        maps.push(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?);
    }
    let mut weights = Weights::new(dir.to_path_buf(), Vec::new());
    let mut located: BTreeMap<String, String> = BTreeMap::new();
    let mut owned: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut mapped: Vec<(String, DType, Vec<usize>, usize, usize, usize)> = Vec::new();
    // gpt-oss's MXFP4 experts: each projection's _blocks and _scales, paired once both are read
    #[allow(clippy::type_complexity)]
    let mut mxfp4: BTreeMap<String, [Option<(Vec<usize>, &[u8])>; 2]> = BTreeMap::new();
    for (fi, (f, map)) in files.iter().zip(&maps).enumerate() {
        let p = dir.join(f);
        for t in read_safetensors(map, &p)? {
            let SafetensorsTensor {
                hf_name,
                name,
                dtype,
                shape,
                data,
            } = t;
            if let Some(wm) = &weight_map {
                if wm.get(&hf_name) != Some(f) {
                    // present in a shard the index does not name for it: skip (the index is the truth)
                    continue;
                }
            }
            located.insert(hf_name.clone(), f.clone());
            let name = family_name(config.family, &hf_name, name);
            // fused projections (Phi-3): each part its own tensor, Q and K rows then permuted
            if let Some(parts) = fused_parts(&config, &name, dtype, &shape, &p)? {
                let base = data.as_ptr() as usize - map.as_ptr() as usize;
                for (pname, pshape, off, len) in parts {
                    let pdata = &data[off..off + len];
                    match rope_pairs(&pname, dtype, &pshape, pdata, &config, &p, &hf_name)? {
                        Some(permuted) => owned.push((pname, dtype, pshape, permuted)),
                        None => mapped.push((pname, dtype, pshape, fi, base + off, len)),
                    }
                }
                continue;
            }
            if dtype == DType::MXFP4 {
                let (base, i) = match name.strip_suffix("_scales") {
                    Some(b) => (b, 1),
                    None => (name.trim_end_matches("_blocks"), 0),
                };
                let pair = mxfp4.entry(base.to_string()).or_default();
                pair[i] = Some((shape, data));
                if let [Some(b), Some(s)] = pair {
                    let parts = gpt_oss_mxfp4(&name, (&b.0, b.1), (&s.0, s.1), &p)?;
                    owned.extend(parts.into_iter().map(|(n, s, b)| (n, DType::MXFP4, s, b)));
                }
                continue;
            }
            if let Some(parts) = gpt_oss_experts(&name, dtype, &shape, data, &p, &hf_name)? {
                owned.extend(parts.into_iter().map(|(n, s, b)| (n, dtype, s, b)));
                continue;
            }
            // norms stored as w for 1 + w: the 1 added once, in f32 (as llama.cpp's converter
            // writes them), so every backend multiplies by the weight
            let plus_one = (config.family.features().norm_plus_one
                && name.ends_with("norm.weight"))
            .then(|| norm_plus_one(dtype, data, &p, &hf_name))
            .transpose()?;
            let (dtype, data) = match &plus_one {
                Some(v) => (DType::F32, &v[..]),
                None => (dtype, data),
            };
            if let Some(permuted) = rope_pairs(&name, dtype, &shape, data, &config, &p, &hf_name)? {
                owned.push((name, dtype, shape, permuted));
            } else if let Some(v) = plus_one {
                owned.push((name, dtype, shape, v));
            } else {
                let offset = data.as_ptr() as usize - map.as_ptr() as usize;
                mapped.push((name, dtype, shape, fi, offset, data.len()));
            }
        }
    }
    if let Some((base, pair)) = mxfp4.iter().find(|(_, p)| p.iter().any(Option::is_none)) {
        let missing = if pair[0].is_none() {
            "_blocks"
        } else {
            "_scales"
        };
        return Err(ModelError::MissingTensor {
            path: dir.to_path_buf(),
            name: format!("{base}{missing}"),
            available: located.len(),
            hint: "an MXFP4 expert tensor needs both its _blocks and its _scales".into(),
        });
    }
    if let Some(wm) = &weight_map {
        // every tensor the index names is in its file (those the runtime ignores are skipped
        // when read: a vision tower, rotary tables)
        for (k, f) in wm {
            if !located.contains_key(k) && gguf_name(k) != Some(None) {
                return Err(ModelError::MissingTensor {
                    path: dir.join(f),
                    name: k.clone(),
                    available: located.len(),
                    hint: format!("{} names this file for it", index_path.display()),
                });
            }
        }
    }
    weights.maps = maps;
    for (name, dtype, shape, map, offset, len) in mapped {
        weights.insert(name, dtype, shape, Source::Mapped { map, offset, len })?;
    }
    for (name, dtype, shape, bytes) in owned {
        weights.insert(name, dtype, shape, Source::Owned(bytes))?;
    }
    if weights.contains("output.weight") {
        config.tied_embeddings = false;
    } else if !config.tied_embeddings {
        return Err(ModelError::MissingTensor {
            path: dir.to_path_buf(),
            name: "lm_head.weight".into(),
            available: weights.len(),
            hint:
                "config.json has tie_word_embeddings false, so the checkpoint needs its own LM head"
                    .into(),
        });
    }
    // FP8 scales: one f32 a row, permuted with Q and K rows as a bias is
    crate::fp8::normalize_scales(&mut weights, &config, |matrix, bytes, rows| {
        let as_bias = format!("{}bias", matrix.strip_suffix("weight").unwrap_or(matrix));
        rope_pairs(&as_bias, DType::F32, &[rows], bytes, &config, dir, matrix)
    })?;
    validate_model(&config, &weights)?;

    let tokenizer = Tokenizer::from_hf_json(
        &tok_json,
        &tok_path,
        config.bos,
        config.eos.clone(),
        config.add_bos,
    )?;
    if tokenizer.vocab_size() > config.vocab {
        return Err(ModelError::Mismatch {
            path: tok_path,
            field: "vocabulary size".into(),
            expected: format!("<= config.json vocab_size ({})", config.vocab),
            got: tokenizer.vocab_size().to_string(),
        });
    }
    let chat_template = ChatTemplate::from_hf(dir)?;
    Ok(Model {
        config,
        weights,
        tokenizer,
        chat_template,
        path: dir.to_path_buf(),
        format: Format::HfSafetensors,
    })
}
