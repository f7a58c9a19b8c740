//! The typed model configuration, normalised from GGUF metadata or an HF `config.json`.
//!
//! Owns: [`ModelConfig`], the [`Family`] a checkpoint belongs to (what differs between the
//! architectures this runtime reads), the two readers that fill them, and the check that a model's
//! tensors have the shapes and types its family's forward pass needs ([`validate_model`]).
//! Invariants: only the families of [`Family`] are accepted (GGUF `general.architecture`; HF
//! `model_type` / `architectures`); every count is > 0; `n_heads` is a multiple of `n_kv_heads`;
//! `head_dim` is even; after [`validate_model`], every tensor the family's forward pass reads exists
//! with the shape these numbers imply.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::weights::Weights;
use metrale_core::dtype::DType;
use serde_json::Value as Json;
use std::path::Path;

/// The architectures this runtime runs.
pub const SUPPORTED_ARCHS: &str =
    "llama (GGUF general.architecture = llama; HF LlamaForCausalLM), \
     qwen2 (GGUF qwen2; HF Qwen2ForCausalLM), qwen3 (GGUF qwen3; HF Qwen3ForCausalLM), \
     gemma3 (GGUF gemma3; HF gemma3_text, Gemma3ForCausalLM), phi3 (GGUF phi3; HF Phi3ForCausalLM: \
     Phi-3, Phi-3.5, Phi-4), qwen3moe (GGUF qwen3moe; HF qwen3_moe, \
     Qwen3MoeForCausalLM), gpt-oss (GGUF gpt-oss; HF gpt_oss, GptOssForCausalLM)";

/// A model family: the block's features that differ between the architectures this runtime reads.
/// Every family is a pre-norm decoder (RMSNorm, attention with grouped KV heads and RoPE, RMSNorm,
/// gated SiLU MLP, residual adds); what a family changes is listed by the methods below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Llama 2/3 (and the models laid out as it, SmolLM2 among them).
    Llama,
    /// Qwen2 and Qwen2.5 dense: biases on the Q, K and V projections.
    Qwen2,
    /// Qwen3 dense: RMSNorm of each head of Q and K (learned, `head_dim` weights) before RoPE.
    Qwen3,
    /// Qwen3 MoE: Qwen3's attention, and in every layer routed experts in place of the MLP.
    Qwen3Moe,
    /// Gemma 3 (text): Qwen3's Q/K norms, norms after the attention and the MLP too, norm
    /// weights stored as w for 1 + w (HF), the embedding scaled by sqrt(hidden), a GELU-gated
    /// MLP, and sliding-window layers with their own RoPE base between full-context ones.
    Gemma3,
    /// Phi-3, Phi-3.5, Phi-4 (HF Phi3ForCausalLM): llama's block with Q/K/V and gate/up each
    /// stored as one matrix, which the readers split.
    Phi3,
    /// gpt-oss (HF GptOssForCausalLM): routed experts with biases and a clamped SwiGLU, biases
    /// on Q, K, V and O, a learned sink logit per head in the attention's softmax, sliding
    /// windows on every other layer, YaRN RoPE.
    GptOss,
}

impl Family {
    /// The family whose GGUF `general.architecture` (= HF `model_type`) is `arch`.
    /// (Or whose HF `model_type` is `arch`.)
    pub fn from_arch(arch: &str) -> Option<Family> {
        match arch {
            // Mistral's block is Llama's (its GGUFs say llama; HF folders say mistral)
            "llama" | "mistral" => Some(Family::Llama),
            "qwen2" => Some(Family::Qwen2),
            "qwen3" => Some(Family::Qwen3),
            "qwen3moe" | "qwen3_moe" => Some(Family::Qwen3Moe),
            "gemma3" | "gemma3_text" => Some(Family::Gemma3),
            "phi3" => Some(Family::Phi3),
            "gpt-oss" | "gpt_oss" => Some(Family::GptOss),
            _ => None,
        }
    }

    /// GGUF `general.architecture` and the `family` of a target's MODEL.toml.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3moe",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
            Family::GptOss => "gpt-oss",
        }
    }

    /// HF `model_type`.
    pub fn hf_model_type(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Gemma3 => "gemma3_text",
            Family::GptOss => "gpt_oss",
            f => f.name(),
        }
    }

    /// Whether HF `architectures` entry `arch` is a causal LM of this family (Mistral's
    /// `MistralForCausalLM` is a llama).
    pub fn is_hf_architecture(self, arch: &str) -> bool {
        arch == self.hf_architecture() || (self == Family::Llama && arch == "MistralForCausalLM")
    }

    /// HF `architectures` entry of a causal LM of this family.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
            Family::Phi3 => "Phi3ForCausalLM",
            Family::GptOss => "GptOssForCausalLM",
        }
    }

    /// What its block does beyond llama's: the one table, `metrale_core::target::features`.
    pub fn features(self) -> metrale_core::target::Features {
        metrale_core::target::features(self.name()).expect("every Family has a features row")
    }

    /// Each head of Q and K is RMS-normalised (weights `blk.N.attn_q_norm` / `attn_k_norm`, one per
    /// head dimension, shared by the heads) after the projections and before RoPE.
    pub fn qk_norm(self) -> bool {
        self.features().qk_norm
    }

    /// The Q, K and V projections have biases (`blk.N.attn_{q,k,v}.bias`, f32 or 16-bit floats),
    /// added to the products before anything else.
    pub fn qkv_bias(self) -> bool {
        self.features().qkv_bias
    }

    /// Its GGUF files keep Q/K rows in HF's order (RoPE rotating the two halves of each head:
    /// llama.cpp's NEOX rope), so the reader permutes them to adjacent pairs as it does HF rows of
    /// every family; llama GGUFs come permuted by the converter.
    pub fn gguf_rope_halves(self) -> bool {
        self.features().gguf_rope_halves
    }

    /// Every layer's MLP is routed experts ([`Moe`]): `blk.N.ffn_gate_inp` (the router) and the
    /// experts' `ffn_{gate,up,down}_exps`, no dense `ffn_{gate,up,down}`.
    pub fn moe(self) -> bool {
        self.features().moe
    }
}

/// A layer's mixture of experts: the router's softmax over `experts`, the `used` largest taken
/// (ties to the lower index), their weights renormalised to sum 1 where `norm_topk`, and the
/// token's MLP output the weighted sum of those experts' gated MLPs (each `ffn` wide).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moe {
    pub experts: usize,
    pub used: usize,
    pub ffn: usize,
    pub norm_topk: bool,
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Sliding-window attention (Gemma 3): the layers with `sliding[l]` attend to their last `window`
/// positions only (the token's own included: positions p - window + 1 ..= p) and rotate with
/// `rope_theta`; the others attend to the whole context with the model's `rope_theta`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sliding {
    pub window: usize,
    pub sliding: Vec<bool>,
    pub rope_theta: f32,
}

impl Sliding {
    /// Gemma 3's layout: every `pattern`-th layer (layers pattern - 1, 2 pattern - 1, ...) full,
    /// the rest sliding.
    pub fn pattern(window: usize, pattern: usize, layers: usize, rope_theta: f32) -> Sliding {
        Sliding {
            window,
            sliding: (0..layers)
                .map(|l| !(l + 1).is_multiple_of(pattern.max(1)))
                .collect(),
            rope_theta,
        }
    }
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1-style: wavelength-dependent scaling of the inverse frequencies.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Per-dimension frequency divisors stored in the GGUF tensor `rope_freqs.weight` (head_dim / 2
    /// floats), as llama.cpp's converter writes llama3 scaling.
    FreqFactors,
    /// LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini; HF `rope_type: longrope`): per-dimension
    /// divisors of the inverse frequencies (rotary_dim / 2 each), `short` for a context within
    /// the pretraining length `original_max_position` and `long` past it (chosen once by the
    /// served context, as llama.cpp chooses by its context size), and `attention_factor` on the
    /// rotation's cos and sin (HF's `attention_scaling`: sqrt(1 + ln(s) / ln(original)) with s
    /// the extension max_position_embeddings / original, unless the config gives it).
    LongRope {
        short: Vec<f32>,
        long: Vec<f32>,
        original_max_position: usize,
        attention_factor: f32,
    },
    /// YaRN (gpt-oss; HF `rope_type: yarn`): each pair's inverse frequency blends the original
    /// and the one divided by `factor` over a ramp between the pairs that turn `beta_fast` and
    /// `beta_slow` times in `original_max_position` positions (the ramp's ends rounded out where
    /// `truncate`: HF's default, and always in GGUF as llama.cpp computes it), and
    /// `attention_factor` scales cos and sin (HF's `yarn_get_mscale`: 0.1 ln(factor) + 1 unless
    /// the config gives it).
    Yarn {
        factor: f32,
        original_max_position: usize,
        beta_fast: f32,
        beta_slow: f32,
        truncate: bool,
        attention_factor: f32,
    },
}

/// YaRN's default attention factor: 0.1 ln(factor) + 1 (1 for factor <= 1), HF's and llama.cpp's.
pub fn yarn_mscale(factor: f32) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * factor.ln() + 1.0
    }
}

/// Everything a backend needs to size and run a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Human name (GGUF general.name, HF `_name_or_path`, else the file/dir name).
    pub name: String,
    pub family: Family,
    /// The family's name (GGUF `general.architecture`).
    pub arch: String,
    /// The family's name for GGUF and HF files alike (HF `model_type`).
    pub model_type: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    /// Rows of token_embd (the logits' width).
    pub vocab: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
    pub max_context: usize,
    /// The LM head is token_embd (no output.weight).
    pub tied_embeddings: bool,
    /// Routed experts in every layer (families with [`Family::moe`]); `ffn` is then one expert's.
    pub moe: Option<Moe>,
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE rotates the first `rotary_dim` dimensions of each Q and K head (even, at most
    /// `head_dim`): the whole head, or less with HF's `partial_rotary_factor` (Phi-4-mini: 96 of
    /// 128); the rest pass through.
    pub rotary_dim: usize,
    /// Sliding-window layers, where the family has them.
    pub sliding: Option<Sliding>,
    /// The attention scores' scale: 1/sqrt(head_dim), or Gemma's 1/sqrt(query_pre_attn_scalar).
    pub attn_scale: f32,
    pub bos: Option<u32>,
    /// End-of-generation ids (eos, then eot/eom when the file names them), deduplicated.
    pub eos: Vec<u32>,
    /// Whether prompts start with `bos` by default.
    pub add_bos: bool,
    /// How the file says its hidden states pool into an embedding (GGUF `<arch>.pooling_type`:
    /// "none", "mean", "cls", "last" or "rank"); `None`: it does not say.
    pub pooling: Option<String>,
    /// How the FP8 matrices' products quantize their input (`crate::fp8`): from an HF config's
    /// `quantization_config`, or dynamic per token once a checkpoint is quantized at load;
    /// `None` for a checkpoint without FP8 matrices.
    pub fp8: Option<metrale_core::fp8::Activations>,
}

/// The rotated dimensions of a head: even, in 2..=head_dim.
fn rotary_dim(path: &Path, field: &str, rot: usize, head_dim: usize) -> Result<usize> {
    if rot < 2 || rot > head_dim || !rot.is_multiple_of(2) {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: field.into(),
            expected: format!("an even number of rotated dimensions in 2..={head_dim}"),
            got: rot.to_string(),
        });
    }
    Ok(rot)
}

/// An HF config's LongRoPE scaling (`rope_scaling` of `rope_type: longrope`): its two factor
/// lists of `half` values each, the pretraining context (`original_max_position_embeddings`, top
/// level as Phi-3 writes it, or inside `rope_scaling`) and the attention factor, as transformers
/// computes it (`_compute_longrope_parameters`).
fn long_rope(
    path: &Path,
    cfg: &Json,
    rs: &Json,
    max_context: usize,
    half: usize,
) -> Result<RopeScaling> {
    let field = |k: &str| format!("config.json rope_scaling.{k}");
    let list = |k: &str| -> Result<Vec<f32>> {
        let v: Option<Vec<f32>> = rs.get(k).and_then(Json::as_array).and_then(|a| {
            a.iter()
                .map(|x| x.as_f64().map(|f| f as f32))
                .collect::<Option<Vec<f32>>>()
        });
        match v {
            Some(v) if v.len() == half && v.iter().all(|f| f.is_finite() && *f > 0.0) => Ok(v),
            _ => Err(ModelError::Mismatch {
                path: path.to_path_buf(),
                field: field(k),
                expected: format!("{half} positive factors (one per rotated pair)"),
                got: rs.get(k).map_or("nothing".into(), |v| {
                    let t = v.to_string();
                    t.chars().take(80).collect()
                }),
            }),
        }
    };
    let (short, long) = (list("short_factor")?, list("long_factor")?);
    let original = cfg
        .get("original_max_position_embeddings")
        .or_else(|| rs.get("original_max_position_embeddings"))
        .and_then(Json::as_u64)
        .filter(|&o| o > 1)
        .ok_or_else(|| ModelError::Missing {
            path: path.to_path_buf(),
            field: "config.json original_max_position_embeddings".into(),
            hint: "LongRoPE scales by the pretraining context length".into(),
        })? as usize;
    let attention_factor = match rs.get("attention_factor").and_then(Json::as_f64) {
        Some(a) => a as f32,
        None => metrale_core::shape::longrope_attention_factor(max_context as f64, original as f64)
            as f32,
    };
    Ok(RopeScaling::LongRope {
        short,
        long,
        original_max_position: original,
        attention_factor,
    })
}

/// An HF config's YaRN scaling (`rope_type: yarn`), as transformers computes it
/// (`_compute_yarn_parameters`): `factor` (or max_position_embeddings over the original), the
/// pretraining context (`original_max_position_embeddings`, in the scaling table or top level),
/// `beta_fast` / `beta_slow` (32 / 1), `truncate` (true), and the attention factor: the config's,
/// else from `mscale` / `mscale_all_dim` where both are given, else 0.1 ln(factor) + 1.
fn yarn(path: &Path, cfg: &Json, rs: &Json, max_context: usize) -> Result<RopeScaling> {
    let num = |k: &str| rs.get(k).and_then(Json::as_f64);
    let original = rs
        .get("original_max_position_embeddings")
        .or_else(|| cfg.get("original_max_position_embeddings"))
        .and_then(Json::as_u64)
        .filter(|&o| o > 1)
        .ok_or_else(|| ModelError::Missing {
            path: path.to_path_buf(),
            field: "config.json rope_scaling.original_max_position_embeddings".into(),
            hint: "YaRN scales by the pretraining context length".into(),
        })? as usize;
    let factor = num("factor").unwrap_or(max_context as f64 / original as f64);
    let (fast, slow) = (
        num("beta_fast").unwrap_or(32.0),
        num("beta_slow").unwrap_or(1.0),
    );
    if !(factor.is_finite() && factor > 0.0 && fast > slow && slow > 0.0) {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: "config.json rope_scaling".into(),
            expected: "YaRN with factor > 0 and beta_fast > beta_slow > 0".into(),
            got: rs.to_string().chars().take(120).collect(),
        });
    }
    let mscale = |m: f64| match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * m * factor.ln() + 1.0,
    };
    let attention_factor = match (
        num("attention_factor"),
        num("mscale"),
        num("mscale_all_dim"),
    ) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(a)) if m != 0.0 && a != 0.0 => mscale(m) / mscale(a),
        _ => yarn_mscale(factor as f32) as f64,
    };
    Ok(RopeScaling::Yarn {
        factor: factor as f32,
        original_max_position: original,
        beta_fast: fast as f32,
        beta_slow: slow as f32,
        truncate: rs.get("truncate").and_then(Json::as_bool).unwrap_or(true),
        attention_factor: attention_factor as f32,
    })
}

fn positive(path: &Path, field: &str, v: usize) -> Result<usize> {
    if v == 0 {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: field.into(),
            expected: "a positive integer".into(),
            got: "0".into(),
        });
    }
    Ok(v)
}

/// The most layers a checkpoint may declare: the deepest published models have ~126; a count past
/// this is a malformed file, refused before any per-layer list (sliding-window flags) is sized
/// from it.
pub const MAX_LAYERS: usize = 4096;

/// A layer count: positive and at most [`MAX_LAYERS`].
fn layer_count(path: &Path, field: &str, v: usize) -> Result<usize> {
    let v = positive(path, field, v)?;
    if v > MAX_LAYERS {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: field.into(),
            expected: format!("at most {MAX_LAYERS} layers (a malformed file declares more)"),
            got: v.to_string(),
        });
    }
    Ok(v)
}

/// hidden / n_heads, when the file does not give the head dimension: n_heads must divide hidden.
fn derived_head_dim(path: &Path, field: &str, hidden: usize, n_heads: usize) -> Result<usize> {
    if n_heads > hidden || !hidden.is_multiple_of(n_heads) {
        return Err(ModelError::Mismatch {
            path: path.to_path_buf(),
            field: field.into(),
            expected: format!(
                "a divisor of the hidden size ({hidden}), since no head dimension is given"
            ),
            got: n_heads.to_string(),
        });
    }
    Ok(hidden / n_heads)
}

fn push_unique(v: &mut Vec<u32>, id: u32) {
    if !v.contains(&id) {
        v.push(id);
    }
}

impl ModelConfig {
    /// Check the relations between the numbers (heads divide, head_dim even...).
    fn check(&self, path: &Path) -> Result<()> {
        let mm = |field: &str, expected: String, got: String| ModelError::Mismatch {
            path: path.to_path_buf(),
            field: field.into(),
            expected,
            got,
        };
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(mm(
                "n_kv_heads",
                format!("a divisor of n_heads ({})", self.n_heads),
                self.n_kv_heads.to_string(),
            ));
        }
        if let Some(m) = self.moe {
            if m.used == 0 || m.used > m.experts {
                return Err(mm(
                    "experts used per token",
                    format!("1 to the {} experts", m.experts),
                    m.used.to_string(),
                ));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(mm(
                "head_dim",
                "an even number (RoPE rotates pairs)".into(),
                self.head_dim.to_string(),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(mm(
                "rope_theta",
                "a positive finite number".into(),
                self.rope_theta.to_string(),
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(mm(
                "norm_eps",
                "a positive finite number".into(),
                self.norm_eps.to_string(),
            ));
        }
        for id in self.bos.iter().chain(&self.eos) {
            if *id as usize >= self.vocab {
                return Err(mm(
                    "bos/eos token id",
                    format!("< vocab ({})", self.vocab),
                    id.to_string(),
                ));
            }
        }
        Ok(())
    }

    /// Read the config from a GGUF file's metadata and its token_embd tensor.
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let path = g.path.as_path();
        let arch = g.req_str("general.architecture")?;
        let family = Family::from_arch(arch).ok_or_else(|| ModelError::UnsupportedArch {
            path: path.to_path_buf(),
            arch: arch.to_string(),
            supported: SUPPORTED_ARCHS.into(),
        })?;
        let k = |s: &str| format!("{arch}.{s}");
        let n_layers = layer_count(path, &k("block_count"), g.req_usize(&k("block_count"))?)?;
        let hidden = positive(
            path,
            &k("embedding_length"),
            g.req_usize(&k("embedding_length"))?,
        )?;
        let n_heads = positive(
            path,
            &k("attention.head_count"),
            g.req_usize(&k("attention.head_count"))?,
        )?;
        let n_kv_heads = match g.opt_u64(&k("attention.head_count_kv"))? {
            Some(v) => positive(path, &k("attention.head_count_kv"), v as usize)?,
            None => n_heads,
        };
        let head_dim = match g.opt_u64(&k("attention.key_length"))? {
            Some(v) => positive(path, &k("attention.key_length"), v as usize)?,
            None => derived_head_dim(path, &k("attention.head_count"), hidden, n_heads)?,
        };
        let rotary_dim = match g.opt_u64(&k("rope.dimension_count"))? {
            None => head_dim,
            Some(rot) => rotary_dim(path, &k("rope.dimension_count"), rot as usize, head_dim)?,
        };
        let ffn = positive(
            path,
            &k("feed_forward_length"),
            g.req_usize(&k("feed_forward_length"))?,
        )?;
        let moe = if family.moe() {
            let req =
                |key: &str| -> Result<usize> { positive(path, &k(key), g.req_usize(&k(key))?) };
            Some(Moe {
                experts: req("expert_count")?,
                used: req("expert_used_count")?,
                ffn: req("expert_feed_forward_length")?,
                // llama.cpp renormalises qwen3moe's top-k weights unless the file says otherwise
                norm_topk: g.opt_bool(&k("expert_weights_norm"))?.unwrap_or(true),
            })
        } else {
            None
        };
        let ffn = moe.map_or(ffn, |m| m.ffn);
        let rope_theta = g.opt_f32(&k("rope.freq_base"))?.unwrap_or(10000.0);
        let norm_eps = g
            .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        let max_context = positive(
            path,
            &k("context_length"),
            g.req_usize(&k("context_length"))?,
        )?;
        let embd = g
            .header
            .tensors
            .iter()
            .find(|t| t.name == "token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor {
                path: path.to_path_buf(),
                name: "token_embd.weight".into(),
                available: g.header.tensors.len(),
                hint: String::new(),
            })?;
        let vocab = embd.shape.get(1).copied().unwrap_or(1);
        let tied_embeddings = !g.header.tensors.iter().any(|t| t.name == "output.weight");
        // Phi-3's 128k variants, Phi-3.5, Phi-4-mini: LongRoPE, its factor lists read with the
        // weights (`Model::from_gguf` fills them in)
        let has = |n: &str| g.header.tensors.iter().any(|t| t.name == n);
        let longrope = match (
            has("rope_factors_long.weight"),
            has("rope_factors_short.weight"),
        ) {
            (false, false) => None,
            (true, true) => {
                let key = k("rope.scaling.original_context_length");
                let original =
                    g.opt_u64(&key)?
                        .filter(|&o| o > 1)
                        .ok_or_else(|| ModelError::Missing {
                            path: path.to_path_buf(),
                            field: format!("metadata '{key}'"),
                            hint: "LongRoPE scales by the pretraining context length".into(),
                        })? as usize;
                let attention_factor = match g.opt_f32(&k("rope.scaling.attn_factor"))? {
                    Some(a) => a,
                    None => metrale_core::shape::longrope_attention_factor(
                        max_context as f64,
                        original as f64,
                    ) as f32,
                };
                Some(RopeScaling::LongRope {
                    short: Vec::new(),
                    long: Vec::new(),
                    original_max_position: original,
                    attention_factor,
                })
            }
            (l, _) => {
                return Err(ModelError::MissingTensor {
                    path: path.to_path_buf(),
                    name: if l {
                        "rope_factors_short.weight"
                    } else {
                        "rope_factors_long.weight"
                    }
                    .into(),
                    available: g.header.tensors.len(),
                    hint: "LongRoPE needs both factor lists".into(),
                })
            }
        };
        let rope_scaling = if longrope.is_some() {
            longrope
        } else if g
            .header
            .tensors
            .iter()
            .any(|t| t.name == "rope_freqs.weight")
        {
            Some(RopeScaling::FreqFactors)
        } else {
            match g.opt_str(&k("rope.scaling.type"))? {
                None | Some("none") => None,
                Some("linear") => {
                    let factor = g.opt_f32(&k("rope.scaling.factor"))?.unwrap_or(1.0);
                    (factor != 1.0).then_some(RopeScaling::Linear { factor })
                }
                // as llama.cpp computes it: the ramp's ends always rounded out
                Some("yarn") => {
                    let factor = g.opt_f32(&k("rope.scaling.factor"))?.unwrap_or(1.0);
                    let key = k("rope.scaling.original_context_length");
                    let original =
                        g.opt_u64(&key)?
                            .filter(|&o| o > 1)
                            .ok_or_else(|| ModelError::Missing {
                                path: path.to_path_buf(),
                                field: format!("metadata '{key}'"),
                                hint: "YaRN scales by the pretraining context length".into(),
                            })? as usize;
                    (factor > 1.0).then_some(RopeScaling::Yarn {
                        factor,
                        original_max_position: original,
                        beta_fast: g
                            .opt_f32(&k("rope.scaling.yarn_beta_fast"))?
                            .unwrap_or(32.0),
                        beta_slow: g.opt_f32(&k("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                        truncate: true,
                        attention_factor: g
                            .opt_f32(&k("rope.scaling.yarn_attn_factor"))?
                            .unwrap_or_else(|| yarn_mscale(factor)),
                    })
                }
                Some(other) => {
                    return Err(ModelError::Unsupported {
                        path: path.to_path_buf(),
                        field: format!("metadata '{}'", k("rope.scaling.type")),
                        value: other.into(),
                        supported: "none, linear, yarn (llama3 via rope_freqs.weight)".into(),
                    })
                }
            }
        };
        // Gemma 3 as llama.cpp reads it: the file's window, every `sliding_window_pattern`-th
        // layer full (default 6) or a flag a layer, RoPE base `freq_base_swa` for the sliding
        // ones (default 10000); scores scaled by 1/sqrt(head_dim) (llama.cpp's choice for every
        // size but 27B, whose query_pre_attn_scalar is hidden / heads)
        let sliding = match (family, g.opt_u64(&k("attention.sliding_window"))?) {
            (Family::Gemma3, Some(w)) if w > 0 => {
                let local = g.opt_f32(&k("rope.freq_base_swa"))?.unwrap_or(10000.0);
                let key = k("attention.sliding_window_pattern");
                match g.get(&key) {
                    // one flag a layer (llama.cpp's array form)
                    Some(crate::gguf::Value::Array(crate::gguf::Array::Bool(v))) => {
                        if v.len() != n_layers {
                            return Err(ModelError::Mismatch {
                                path: path.to_path_buf(),
                                field: format!("metadata '{key}'"),
                                expected: format!("one flag per layer ({n_layers})"),
                                got: v.len().to_string(),
                            });
                        }
                        Some(Sliding {
                            window: w as usize,
                            sliding: v.clone(),
                            rope_theta: local,
                        })
                    }
                    _ => {
                        let pattern = g.opt_u64(&key)?.unwrap_or(6) as usize;
                        Some(Sliding::pattern(w as usize, pattern, n_layers, local))
                    }
                }
            }
            // gpt-oss as llama.cpp reads it: every other layer (0, 2, ...) in the window, with
            // the model's own RoPE (its scaling included) unless the file gives the base
            (Family::GptOss, Some(w)) if w > 0 => {
                let local = g.opt_f32(&k("rope.freq_base_swa"))?.unwrap_or(rope_theta);
                Some(Sliding::pattern(w as usize, 2, n_layers, local))
            }
            _ => None,
        };
        let attn_scale = match (family, n_layers) {
            (Family::Gemma3, 62) => 1.0 / ((hidden / n_heads) as f32).sqrt(),
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let (bos, eos, add_bos) = Self::special_tokens_from_gguf(g)?;
        // llama.cpp's enum llama_pooling_type
        let pooling = g.opt_u64(&k("pooling_type"))?.map(|v| {
            match v {
                0 => "none",
                1 => "mean",
                2 => "cls",
                3 => "last",
                4 => "rank",
                _ => "unknown",
            }
            .to_string()
        });
        let name = match g.opt_str("general.name")? {
            Some(n) => n.to_string(),
            None => file_stem(path),
        };
        let c = ModelConfig {
            name,
            family,
            arch: family.name().into(),
            model_type: family.hf_model_type().into(),
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            vocab,
            rope_theta,
            norm_eps,
            max_context,
            tied_embeddings,
            moe,
            rope_scaling,
            rotary_dim,
            sliding,
            attn_scale,
            bos,
            eos,
            add_bos,
            pooling,
            fp8: None,
        };
        c.check(path)?;
        Ok(c)
    }

    /// BOS, the EOS set (eos, eot, eom) and whether BOS is added, from a GGUF's `tokenizer.ggml.*`
    /// metadata alone.
    pub fn special_tokens_from_gguf(g: &GgufFile) -> Result<(Option<u32>, Vec<u32>, bool)> {
        let tok_id = |key: &str| -> Result<Option<u32>> {
            Ok(g.opt_u64(key)?.and_then(|v| u32::try_from(v).ok()))
        };
        let bos = tok_id("tokenizer.ggml.bos_token_id")?;
        let mut eos = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = tok_id(key)? {
                push_unique(&mut eos, id);
            }
        }
        // llama.cpp's default for BPE vocabularies is false (true for the llama3 and tekken
        // pre-tokenizers); the file's explicit flag wins.
        let pre = g.opt_str("tokenizer.ggml.pre")?;
        let default_add_bos = match g.opt_str("tokenizer.ggml.model")? {
            Some("llama") => true,
            _ => matches!(
                pre,
                Some(
                    "llama3"
                        | "llama-v3"
                        | "llama-bpe"
                        | "falcon3"
                        | "falcon-h1"
                        | "pixtral"
                        | "midm-2.0"
                        | "lfm2"
                        | "tekken"
                )
            ),
        };
        let add_bos = g
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(default_add_bos)
            && bos.is_some();
        Ok((bos, eos, add_bos))
    }

    /// Read the config from an HF `config.json` (already parsed). `add_bos` comes from the tokenizer
    /// files; `generation_eos` from generation_config.json when present.
    pub fn from_hf(
        path: &Path,
        cfg: &Json,
        add_bos: bool,
        generation_eos: &[u32],
    ) -> Result<ModelConfig> {
        // a multimodal Gemma 3 (Gemma3ForConditionalGeneration: gemma-3-4b/12b/27b) is its
        // `text_config`'s language model; its vision tower is not read (`hf::gguf_name`)
        let quantization = cfg;
        let merged;
        let cfg = match (
            cfg.get("model_type").and_then(Json::as_str),
            cfg.get("text_config"),
        ) {
            (Some("gemma3"), Some(Json::Object(text))) => {
                let mut m = text.clone();
                m.insert("model_type".into(), "gemma3_text".into());
                m.insert(
                    "architectures".into(),
                    serde_json::json!(["Gemma3ForCausalLM"]),
                );
                for k in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
                    if let (false, Some(v)) = (m.contains_key(k), cfg.get(k)) {
                        m.insert(k.into(), v.clone());
                    }
                }
                // Gemma 3's language models tie their head unless they say otherwise
                m.entry("tie_word_embeddings").or_insert(true.into());
                merged = Json::Object(m);
                &merged
            }
            _ => cfg,
        };
        let field = |k: &str| format!("config.json {k}");
        let mm = |k: &str, expected: &str, got: &Json| ModelError::Mismatch {
            path: path.to_path_buf(),
            field: field(k),
            expected: expected.into(),
            got: got.to_string(),
        };
        let opt_usize = |k: &str| -> Result<Option<usize>> {
            match cfg.get(k) {
                None | Some(Json::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|u| usize::try_from(u).ok())
                    .map(Some)
                    .ok_or_else(|| mm(k, "a non-negative integer", v)),
            }
        };
        let req_usize = |k: &str| -> Result<usize> {
            let v = opt_usize(k)?.ok_or_else(|| ModelError::Missing {
                path: path.to_path_buf(),
                field: field(k),
                hint: "a llama, qwen2 or qwen3 config.json has it".into(),
            })?;
            positive(path, &field(k), v)
        };
        let opt_f32 = |k: &str| -> Result<Option<f32>> {
            match cfg.get(k) {
                None | Some(Json::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(|f| Some(f as f32))
                    .ok_or_else(|| mm(k, "a number", v)),
            }
        };
        let model_type = cfg.get("model_type").and_then(Json::as_str).unwrap_or("");
        let archs: Vec<&str> = cfg
            .get("architectures")
            .and_then(Json::as_array)
            .map(|a| a.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        let family = Family::from_arch(model_type)
            .filter(|f| archs.is_empty() || archs.iter().any(|a| f.is_hf_architecture(a)))
            .ok_or_else(|| ModelError::UnsupportedArch {
                path: path.to_path_buf(),
                arch: format!("model_type={model_type:?} architectures={archs:?}"),
                supported: SUPPORTED_ARCHS.into(),
            })?;
        if cfg.get("use_sliding_window").and_then(Json::as_bool) == Some(true) {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                field: field("use_sliding_window"),
                value: "true".into(),
                supported: "false (every layer attends to the whole context)".into(),
            });
        }
        let (act_key, act_want) = match family.features().gelu {
            true => ("hidden_activation", "gelu_pytorch_tanh"),
            false => ("hidden_act", "silu"),
        };
        if let Some(act) = cfg.get(act_key).and_then(Json::as_str) {
            if act != act_want {
                return Err(ModelError::Unsupported {
                    path: path.to_path_buf(),
                    field: field(act_key),
                    value: act.into(),
                    supported: act_want.into(),
                });
            }
        }
        // gpt-oss's clamped SwiGLU: the constants every checkpoint has, which the backends use
        if family.features().oai_moe {
            for (k, want) in [("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)] {
                if let Some(v) = cfg.get(k).filter(|v| !v.is_null()) {
                    if v.as_f64().is_none_or(|x| (x - want).abs() > 1e-6) {
                        return Err(ModelError::Unsupported {
                            path: path.to_path_buf(),
                            field: field(k),
                            value: v.to_string(),
                            supported: format!("{want} (gpt-oss's)"),
                        });
                    }
                }
            }
        }
        // Phi-4-mini and Phi-3.5's partial rotary embedding
        let partial = cfg
            .get("partial_rotary_factor")
            .or_else(|| {
                cfg.get("rope_parameters")
                    .and_then(|r| r.get("partial_rotary_factor"))
            })
            .and_then(Json::as_f64);
        for k in [
            "final_logit_softcapping",
            "attn_logit_softcapping",
            "use_bidirectional_attention",
        ] {
            match cfg.get(k) {
                None | Some(Json::Null) | Some(Json::Bool(false)) => {}
                Some(v) => {
                    return Err(ModelError::Unsupported {
                        path: path.to_path_buf(),
                        field: field(k),
                        value: v.to_string(),
                        supported: "null (not used by the families this runtime reads)".into(),
                    })
                }
            }
        }
        // Qwen2's config has no key for its Q/K/V biases (its modelling code always has them)
        let bias_keys: &[&str] = match family.qkv_bias() {
            true => &["mlp_bias"],
            false => &["attention_bias", "mlp_bias"],
        };
        for &k in bias_keys {
            if cfg.get(k).and_then(Json::as_bool) == Some(true) {
                return Err(ModelError::Unsupported {
                    path: path.to_path_buf(),
                    field: field(k),
                    value: "true".into(),
                    supported: "false (projections without biases)".into(),
                });
            }
        }
        let n_layers = layer_count(
            path,
            &field("num_hidden_layers"),
            req_usize("num_hidden_layers")?,
        )?;
        let hidden = req_usize("hidden_size")?;
        let n_heads = req_usize("num_attention_heads")?;
        let n_kv_heads = match opt_usize("num_key_value_heads")? {
            Some(v) => positive(path, &field("num_key_value_heads"), v)?,
            None => n_heads,
        };
        let head_dim = match opt_usize("head_dim")? {
            Some(v) => positive(path, &field("head_dim"), v)?,
            None => derived_head_dim(path, &field("num_attention_heads"), hidden, n_heads)?,
        };
        let rotary_dim = match partial {
            None => head_dim,
            Some(f) if f > 0.0 && f <= 1.0 => rotary_dim(
                path,
                &field("partial_rotary_factor"),
                (head_dim as f64 * f) as usize,
                head_dim,
            )?,
            Some(f) => {
                return Err(ModelError::Mismatch {
                    path: path.to_path_buf(),
                    field: field("partial_rotary_factor"),
                    expected: "a fraction in (0, 1]".into(),
                    got: f.to_string(),
                })
            }
        };
        let moe = if family.moe() {
            if opt_usize("decoder_sparse_step")?.unwrap_or(1) != 1
                || cfg
                    .get("mlp_only_layers")
                    .and_then(Json::as_array)
                    .is_some_and(|a| !a.is_empty())
            {
                return Err(ModelError::Unsupported {
                    path: path.to_path_buf(),
                    field: field("decoder_sparse_step / mlp_only_layers"),
                    value: "dense layers among the sparse ones".into(),
                    supported: "experts in every layer (decoder_sparse_step 1, no mlp_only_layers)"
                        .into(),
                });
            }
            Some(Moe {
                experts: match family {
                    Family::GptOss => req_usize("num_local_experts")?,
                    _ => req_usize("num_experts")?,
                },
                used: req_usize("num_experts_per_tok")?,
                ffn: match family {
                    // each expert's width; gpt-oss has no dense MLP
                    Family::GptOss => req_usize("intermediate_size")?,
                    _ => req_usize("moe_intermediate_size")?,
                },
                // gpt-oss: the softmax over the chosen experts' logits (the renormalised top k)
                norm_topk: match cfg.get("norm_topk_prob") {
                    _ if family == Family::GptOss => true,
                    None | Some(Json::Null) => false,
                    Some(v) => v
                        .as_bool()
                        .ok_or_else(|| mm("norm_topk_prob", "a bool", v))?,
                },
            })
        } else {
            None
        };
        let ffn = match moe {
            Some(m) => m.ffn,
            None => req_usize("intermediate_size")?,
        };
        let vocab = req_usize("vocab_size")?;
        // Defaults are transformers' LlamaConfig defaults; RoPE bases may also come as
        // transformers 5's rope_parameters (per layer type for Gemma 3)
        let rope_param = |kind: &str| {
            cfg.get("rope_parameters")
                .and_then(|r| r.get(kind).or(Some(r)))
                .and_then(|r| r.get("rope_theta"))
                .and_then(Json::as_f64)
                .map(|v| v as f32)
        };
        let rope_theta = match opt_f32("rope_theta")? {
            Some(t) => t,
            None => rope_param("full_attention").unwrap_or(match family {
                Family::Gemma3 => 1_000_000.0,
                Family::GptOss => 150_000.0,
                _ => 10000.0,
            }),
        };
        let norm_eps = opt_f32("rms_norm_eps")?.unwrap_or(1e-6);
        let max_context = opt_usize("max_position_embeddings")?.unwrap_or(2048);
        let max_context = positive(path, &field("max_position_embeddings"), max_context)?;
        let tied_embeddings = match cfg.get("tie_word_embeddings") {
            None | Some(Json::Null) => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| mm("tie_word_embeddings", "a bool", v))?,
        };
        // transformers 5 writes the scaling into `rope_parameters` (one table, or one per layer
        // type for Gemma 3, whose scaled table is the full-attention one)
        let scaling = match cfg.get("rope_scaling") {
            None | Some(Json::Null) => cfg
                .get("rope_parameters")
                .map(|r| r.get("full_attention").unwrap_or(r))
                .filter(|r| r.get("rope_type").is_some()),
            Some(rs) => Some(rs),
        };
        let rope_scaling = match scaling {
            None => None,
            Some(rs) => {
                let kind = rs
                    .get("rope_type")
                    .or_else(|| rs.get("type"))
                    .and_then(Json::as_str)
                    .unwrap_or("");
                let f = |k: &str, d: f64| rs.get(k).and_then(Json::as_f64).unwrap_or(d) as f32;
                match kind {
                    "default" => None,
                    "llama3" => Some(RopeScaling::Llama3 {
                        factor: f("factor", 8.0),
                        low_freq_factor: f("low_freq_factor", 1.0),
                        high_freq_factor: f("high_freq_factor", 4.0),
                        original_max_position: rs
                            .get("original_max_position_embeddings")
                            .and_then(Json::as_u64)
                            .unwrap_or(8192)
                            as usize,
                    }),
                    "linear" => Some(RopeScaling::Linear {
                        factor: f("factor", 1.0),
                    }),
                    "longrope" | "su" => {
                        Some(long_rope(path, cfg, rs, max_context, rotary_dim / 2)?)
                    }
                    "yarn" => Some(yarn(path, cfg, rs, max_context)?),
                    other => {
                        return Err(ModelError::Unsupported {
                            path: path.to_path_buf(),
                            field: field("rope_scaling.rope_type"),
                            value: other.into(),
                            supported: "default, linear, llama3, longrope, yarn".into(),
                        })
                    }
                }
            }
        };
        let id_list = |k: &str| -> Result<Vec<u32>> {
            match cfg.get(k) {
                None | Some(Json::Null) => Ok(vec![]),
                Some(Json::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_u64()
                            .and_then(|u| u32::try_from(u).ok())
                            .ok_or_else(|| mm(k, "token ids", v))
                    })
                    .collect(),
                Some(v) => v
                    .as_u64()
                    .and_then(|u| u32::try_from(u).ok())
                    .map(|u| vec![u])
                    .ok_or_else(|| mm(k, "a token id or a list of them", v)),
            }
        };
        let sliding = match family {
            // Mistral 7B v0.1 and Phi-3: every layer in one window (later Mistrals say null)
            Family::Llama | Family::Phi3 if model_type == "mistral" || family == Family::Phi3 => {
                match opt_usize("sliding_window")? {
                    Some(w) => Some(Sliding {
                        window: positive(path, &field("sliding_window"), w)?,
                        sliding: vec![true; n_layers],
                        rope_theta,
                    }),
                    None => None,
                }
            }
            Family::Gemma3 | Family::GptOss => {
                let window = req_usize("sliding_window")?;
                let local = match opt_f32("rope_local_base_freq")? {
                    Some(t) => t,
                    // gpt-oss's sliding layers rotate as the others (one RoPE, YaRN included)
                    None if family == Family::GptOss => rope_theta,
                    None => rope_param("sliding_attention").unwrap_or(10000.0),
                };
                match cfg.get("layer_types").and_then(Json::as_array) {
                    Some(types) => {
                        let sliding = types
                            .iter()
                            .map(|t| match t.as_str() {
                                Some("sliding_attention") => Ok(true),
                                Some("full_attention") => Ok(false),
                                _ => Err(mm(
                                    "layer_types",
                                    "\"sliding_attention\" or \"full_attention\" per layer",
                                    t,
                                )),
                            })
                            .collect::<Result<Vec<bool>>>()?;
                        if sliding.len() != n_layers {
                            return Err(mm(
                                "layer_types",
                                &format!("one entry per layer ({n_layers})"),
                                &Json::from(sliding.len()),
                            ));
                        }
                        Some(Sliding {
                            window,
                            sliding,
                            rope_theta: local,
                        })
                    }
                    None => {
                        // transformers' defaults: gpt-oss every other layer (0, 2, ...), Gemma 3
                        // five of every six
                        let default = if family == Family::GptOss { 2 } else { 6 };
                        let pattern = opt_usize("sliding_window_pattern")?.unwrap_or(default);
                        Some(Sliding::pattern(window, pattern, n_layers, local))
                    }
                }
            }
            _ => None,
        };
        let attn_scale = match opt_f32("query_pre_attn_scalar")? {
            Some(q) if family == Family::Gemma3 => 1.0 / q.sqrt(),
            _ => 1.0 / (head_dim as f32).sqrt(),
        };
        let bos = id_list("bos_token_id")?.first().copied();
        let mut eos = Vec::new();
        for id in id_list("eos_token_id")?
            .into_iter()
            .chain(generation_eos.iter().copied())
        {
            push_unique(&mut eos, id);
        }
        let name = cfg
            .get("_name_or_path")
            .and_then(Json::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .unwrap_or_else(|| file_stem(path));
        let c = ModelConfig {
            name,
            family,
            arch: family.name().into(),
            model_type: model_type.into(),
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            vocab,
            rope_theta,
            norm_eps,
            max_context,
            tied_embeddings,
            moe,
            rope_scaling,
            rotary_dim,
            sliding,
            attn_scale,
            bos,
            eos,
            add_bos: add_bos && bos.is_some(),
            pooling: None,
            fp8: crate::fp8::quantization_config(quantization, path)?,
        };
        c.check(path)?;
        Ok(c)
    }

    /// The model's shape as backends and kernels see it.
    pub fn dims(&self) -> metrale_core::shape::Dims {
        metrale_core::shape::Dims {
            layers: self.n_layers,
            hidden: self.hidden,
            heads: self.n_heads,
            kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            ffn: self.ffn,
            vocab: self.vocab,
        }
    }

    /// Size of one token's K and V over all layers, in elements (for KV cache sizing).
    pub fn kv_elems_per_token(&self) -> usize {
        2usize
            .saturating_mul(self.n_layers)
            .saturating_mul(self.n_kv_heads)
            .saturating_mul(self.head_dim)
    }
}

fn file_stem(path: &Path) -> String {
    path.file_stem()
        .or(path.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Check that every tensor the family's forward pass reads is present with the right shape and a
/// usable type: norms must be float (f32/f16/bf16), matrices any supported type.
/// A GGUF's LongRoPE factor lists (`rope_factors_short.weight`, `rope_factors_long.weight`: f32,
/// one positive factor per rotated pair), into the config `from_gguf` made.
pub(crate) fn fill_long_rope(c: &mut ModelConfig, w: &Weights) -> Result<()> {
    let half = c.rotary_dim / 2;
    let Some(RopeScaling::LongRope { short, long, .. }) = &mut c.rope_scaling else {
        return Ok(());
    };
    for (name, out) in [
        ("rope_factors_short.weight", short),
        ("rope_factors_long.weight", long),
    ] {
        let t = w.get(name)?;
        let mut v = vec![0f32; t.n_elems()];
        if t.n_elems() == half && matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
            metrale_core::dtype::dequantize_row(t.dtype, t.data, &mut v).map_err(|source| {
                ModelError::Numerics {
                    tensor: name.into(),
                    source,
                }
            })?;
        }
        if v.len() != half || !v.iter().all(|f| f.is_finite() && *f > 0.0) {
            return Err(ModelError::Mismatch {
                path: w.path.clone(),
                field: format!("tensor '{name}'"),
                expected: format!("{half} positive float factors (one per rotated pair)"),
                got: format!("{} {} values {:?}", t.n_elems(), t.dtype, t.shape),
            });
        }
        *out = v;
    }
    Ok(())
}

pub fn validate_model(c: &ModelConfig, w: &Weights) -> Result<()> {
    // Checked one by one (no list sized from the config's counts): an absurd n_layers stops at the
    // first missing tensor. Products saturate, so absurd head counts give a shape mismatch, not a panic.
    let q = c.n_heads.saturating_mul(c.head_dim);
    let kv = c.n_kv_heads.saturating_mul(c.head_dim);
    let check = |name: &str, shape: &[usize], is_norm: bool| -> Result<()> {
        let t = w.get(name)?;
        // GGUF drops trailing 1-dims; compare without them
        let mut got = t.shape.clone();
        while got.len() > shape.len() && got.last() == Some(&1) {
            got.pop();
        }
        if got != shape {
            return Err(ModelError::Mismatch {
                path: w.path.clone(),
                field: format!("tensor '{name}' shape"),
                expected: format!("{shape:?} (ggml order) from the config"),
                got: format!("{:?}", t.shape),
            });
        }
        if is_norm && !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(ModelError::Mismatch {
                path: w.path.clone(),
                field: format!("tensor '{name}' type"),
                expected: "f32, f16 or bf16 (a norm or bias vector)".into(),
                got: t.dtype.to_string(),
            });
        }
        Ok(())
    };
    check("token_embd.weight", &[c.hidden, c.vocab], false)?;
    check("output_norm.weight", &[c.hidden], true)?;
    if !c.tied_embeddings {
        check("output.weight", &[c.hidden, c.vocab], false)?;
    }
    if c.rope_scaling == Some(RopeScaling::FreqFactors) {
        check("rope_freqs.weight", &[c.head_dim / 2], true)?;
    }
    for l in 0..c.n_layers {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        check(&b("attn_norm"), &[c.hidden], true)?;
        check(&b("attn_q"), &[c.hidden, q], false)?;
        check(&b("attn_k"), &[c.hidden, kv], false)?;
        check(&b("attn_v"), &[c.hidden, kv], false)?;
        check(&b("attn_output"), &[q, c.hidden], false)?;
        if c.family.qkv_bias() {
            let bias = |s: &str| format!("blk.{l}.{s}.bias");
            check(&bias("attn_q"), &[q], true)?;
            check(&bias("attn_k"), &[kv], true)?;
            check(&bias("attn_v"), &[kv], true)?;
        }
        if c.family.qk_norm() {
            check(&b("attn_q_norm"), &[c.head_dim], true)?;
            check(&b("attn_k_norm"), &[c.head_dim], true)?;
        }
        let f = c.family.features();
        if f.out_bias {
            check(&format!("blk.{l}.attn_output.bias"), &[c.hidden], true)?;
        }
        if f.attn_sinks {
            check(&b("attn_sinks"), &[c.n_heads], true)?;
        }
        if let (true, Some(m)) = (f.oai_moe, c.moe) {
            let bias = |s: &str| format!("blk.{l}.{s}.bias");
            check(&bias("ffn_gate_inp"), &[m.experts], true)?;
            check(&bias("ffn_gate_exps"), &[m.ffn, m.experts], true)?;
            check(&bias("ffn_up_exps"), &[m.ffn, m.experts], true)?;
            check(&bias("ffn_down_exps"), &[c.hidden, m.experts], true)?;
        }
        if c.family.features().post_norms {
            check(&b("post_attention_norm"), &[c.hidden], true)?;
            check(&b("post_ffw_norm"), &[c.hidden], true)?;
        }
        check(&b("ffn_norm"), &[c.hidden], true)?;
        if let Some(m) = c.moe {
            check(&b("ffn_gate_inp"), &[c.hidden, m.experts], false)?;
            for e in 0..m.experts {
                let x = |s: &str, shape: &[usize]| -> Result<()> {
                    let t = w.expert(&b(s), e)?;
                    if t.shape != shape {
                        return Err(ModelError::Mismatch {
                            path: w.path.clone(),
                            field: format!("expert {e} of '{}' shape", b(s)),
                            expected: format!("{shape:?} (ggml order) from the config"),
                            got: format!("{:?}", t.shape),
                        });
                    }
                    Ok(())
                };
                x("ffn_gate_exps", &[c.hidden, m.ffn])?;
                x("ffn_up_exps", &[c.hidden, m.ffn])?;
                x("ffn_down_exps", &[m.ffn, c.hidden])?;
            }
        } else {
            check(&b("ffn_gate"), &[c.hidden, c.ffn], false)?;
            check(&b("ffn_up"), &[c.hidden, c.ffn], false)?;
            check(&b("ffn_down"), &[c.ffn, c.hidden], false)?;
        }
    }
    Ok(())
}
