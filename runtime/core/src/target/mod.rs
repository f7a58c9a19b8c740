//! Target specifications: one target is a (hardware, model, quant) triple, declared as data under
//! `targets/` and parsed here into typed structs. Every struct denies unknown keys, so a typo in a
//! TOML file is an error naming the file and the key, never a silently ignored setting.
//!
//! ## Files
//! - `targets/<hw>/HARDWARE.toml`: the hardware (`name`, `backend` = cuda | metal | cpu, and for cuda:
//!   `cubin_arch`, `ptx_arch`, `sm_count`, `memory_gib`, `l2_mib`, `smem_per_block_kib`, ...).
//! - `targets/<hw>/<model>/<quant>/MODEL.toml`: what this target bakes in: `[quant]`, the kernel
//!   template list `kernels`, and optional overrides of the model's `[sampling.*]` / `[behavior]`.
//! - `targets/models/<model>.toml`: the model's shape (`[model]`, incl. `[model.rope_scaling]`),
//!   `[[model_types]]`, default `[sampling.chat]`, `[sampling.completion]` and `[behavior]`.
//!
//! ## Why `extends`
//! The shape block of a model is the same on every hardware, so it is written once, in
//! `targets/models/<model>.toml`; each MODEL.toml starts with `extends = "<model>"`. Resolution is a
//! deep merge of tables: the shared file first, then the MODEL.toml on top (a MODEL.toml may override
//! any key, e.g. `[behavior] parallel` on a small machine). The result, [`TargetSpec::model_toml`],
//! is a self-contained TOML text without `extends`: it is what `build-target` embeds in the binary
//! and what [`TargetSpec::from_toml`] parses at run time (it refuses an unresolved `extends`). The
//! file path contract `targets/<hw>/<model>/<quant>/MODEL.toml` therefore holds, and no shape constant
//! exists twice. `targets/models/` is not a hardware directory: hardware directories are exactly the
//! ones holding a HARDWARE.toml.
//!
//! ## Invariants (checked by `check`, the validator, when a spec is parsed)
//! - `hardware.name == id.hw`, `model.name == id.model`, `quant.name == id.quant`.
//! - cuda hardware has `cubin_arch`, `ptx_arch`, `sm_count`, `smem_per_block_kib`,
//!   `compute_capability` and its launch choices (`attention_cluster`, `decode_split`); metal
//!   hardware has `metal_std`. Shapes are consistent (`heads % kv_heads == 0`; on kernel backends
//!   routed experts on the CPU and CUDA only, and `heads * head_dim == hidden` where
//!   the family has the fused batch-1 kernel); a CUDA target lists no `decode`, `moe` or
//!   `qkv_rope` its family's [`Features`] do not ask for (those it asks for and lacks are refused
//!   when the kernels load).

mod check;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Error while reading or checking a target.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: field `{field}`: expected {expected}, got {got}")]
    Invalid {
        path: String,
        field: String,
        expected: String,
        got: String,
    },
    #[error("target {id} not found ({path} does not exist); available targets: {available}")]
    NotFound {
        id: String,
        path: PathBuf,
        available: String,
    },
    #[error("bad target id `{got}`: expected hw/model/quant, e.g. h200/smollm2-135m/q4_1")]
    BadId { got: String },
}

/// A target's identity. Displayed as `hw/model/quant`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TargetId {
    pub hw: String,
    pub model: String,
    pub quant: String,
}

impl TargetId {
    pub fn new(hw: &str, model: &str, quant: &str) -> Self {
        TargetId {
            hw: hw.to_string(),
            model: model.to_string(),
            quant: quant.to_string(),
        }
    }
}

impl fmt::Display for TargetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.hw, self.model, self.quant)
    }
}

impl std::str::FromStr for TargetId {
    type Err = TargetError;
    fn from_str(s: &str) -> Result<Self, TargetError> {
        let parts: Vec<&str> = s.split('/').collect();
        let ok = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                && p != "."
                && p != ".."
        };
        if parts.len() == 3 && parts.iter().all(|p| ok(p)) {
            Ok(TargetId::new(parts[0], parts[1], parts[2]))
        } else {
            Err(TargetError::BadId { got: s.to_string() })
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Cuda,
    Metal,
    Cpu,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Metal => "metal",
            BackendKind::Cpu => "cpu",
        })
    }
}

/// `targets/<hw>/HARDWARE.toml`. Optional fields are required per backend (see module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    pub backend: BackendKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// e.g. "sm_90a": the exact arch cubins are compiled for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cubin_arch: Option<String>,
    /// e.g. "compute_90": the virtual arch of the PTX fallback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ptx_arch: Option<String>,
    /// Compute capability as major*10+minor, e.g. 90 (what the device must report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_gib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bandwidth_gbs: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l2_mib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smem_per_block_kib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smem_per_sm_kib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_threads_per_block: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_threads_per_sm: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warp_size: Option<u32>,
    /// CUDA launch choice measured on this GPU: the most attention splits of one (KV head, token)
    /// launched as one thread-block cluster and combined through distributed shared memory (sm_90+;
    /// 0: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_cluster: Option<u32>,
    /// CUDA launch choice measured on this GPU: the persistent batch-1 decode kernel's attention
    /// split, [positions per split before another is added, most splits per KV head].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_split: Option<[u32; 2]>,
    /// Metal: the language standard passed to `xcrun metal -std=...`, e.g. "metal3.1".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metal_std: Option<String>,
    /// Metal: GPU cores (the analogue of SMs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_cores: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threadgroup_mem_kib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simd_width: Option<u32>,
    /// CPU: cores the defaults are sized for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<u32>,
}

/// llama3-style RoPE frequency scaling (Llama 3.1/3.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// "llama3" (the only kind supported).
    pub rope_type: String,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: u32,
}

/// The model families a target may name (`[model] family`): GGUF `general.architecture` / HF
/// `model_type` of the checkpoints it serves (`metrale_model::config::Family`, which reads them).
pub const FAMILIES: [&str; 7] = [
    "llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt-oss",
];

/// What a family's block does beyond the llama block (RMSNorm, attention with grouped KV heads and
/// adjacent-pair RoPE, RMSNorm, gated SiLU MLP, residual adds), as data: the runtime's
/// `metrale_model::Family` answers from it, and the CUDA kernel templates render it
/// (`{{features.qk_norm}}`, ...). One row per family in [`features`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Features {
    /// An RMSNorm of each Q and K head (learned, `head_dim` weights shared by the heads) after
    /// the projections and before RoPE.
    pub qk_norm: bool,
    /// Biases on the Q, K and V projections (`blk.N.attn_{q,k,v}.bias`), added before RoPE.
    pub qkv_bias: bool,
    /// Derived: `qk_norm || qkv_bias`. The QKV products leave raw rows and the CUDA kernel
    /// `qkv_rope` (template `qkv_rope`) adds the biases, norms the heads, rotates and writes the
    /// KV cache; other families rotate and write in the products' own epilogues.
    pub qkv_rope: bool,
    /// GGUF files keep Q/K rows in HF's order (RoPE over the two halves of each head); the reader
    /// permutes them to adjacent pairs.
    pub gguf_rope_halves: bool,
    /// Every layer's MLP is routed experts (`[model.experts]`).
    pub moe: bool,
    /// The fused persistent batch-1 kernel (`decode_1`, template `decode`) computes this block;
    /// a family without it decodes one sequence on the per-stage kernels.
    pub fused_decode: bool,
    /// HF checkpoints store each RMSNorm weight as w where the norm multiplies by 1 + w (Gemma's
    /// `Gemma3RMSNorm`); the HF reader adds the 1, as llama.cpp's converter does for its GGUFs.
    pub norm_plus_one: bool,
    /// The token embedding is multiplied by sqrt(hidden) before the first layer.
    pub embed_scale: bool,
    /// RMSNorms after the attention's O product and after the MLP's down product, before each
    /// residual add (`blk.N.post_attention_norm`, `post_ffw_norm`; `ffn_norm` is then the norm
    /// before the MLP).
    pub post_norms: bool,
    /// The gated MLP's activation is GELU (tanh approximation) instead of SiLU.
    pub gelu: bool,
    /// The files store Q, K and V as one matrix (`attn_qkv`, HF `qkv_proj`) and gate and up as
    /// one (`ffn_up` of 2 x ffn rows, gate first; HF `gate_up_proj`); the readers split them
    /// (Phi-3), so the block is llama's.
    pub fused_projections: bool,
    /// The attention's O projection has a bias (`blk.N.attn_output.bias`), added with the
    /// product. (gpt-oss; like the two below, read by no kernel template, so not rendered.)
    #[serde(skip)]
    pub out_bias: bool,
    /// Each query head has a learned sink logit (`blk.N.attn_sinks.weight`, one per head) that
    /// joins the softmax's denominator and adds nothing to the output.
    #[serde(skip)]
    pub attn_sinks: bool,
    /// gpt-oss's experts: the router and every expert projection have biases
    /// (`blk.N.ffn_gate_inp.bias`, `ffn_{gate,up,down}_exps.bias`), the weights are the softmax
    /// over the top-k logits (the renormalised top k), and the gate is the clamped SwiGLU
    /// `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with `g = min(gate, 7)`.
    #[serde(skip)]
    pub oai_moe: bool,
}

/// The features of `family` (one of [`FAMILIES`]).
pub fn features(family: &str) -> Option<Features> {
    let (qk_norm, qkv_bias, moe, fused_decode) = match family {
        "llama" => (false, false, false, true),
        "qwen2" => (false, true, false, false),
        "qwen3" => (true, false, false, false),
        "qwen3moe" => (true, false, true, false),
        "gemma3" => (true, false, false, false),
        "phi3" => (false, false, false, false),
        "gpt-oss" => (false, true, true, false),
        _ => return None,
    };
    let gemma = family == "gemma3";
    let oai = family == "gpt-oss";
    Some(Features {
        qk_norm,
        qkv_bias,
        qkv_rope: qk_norm || qkv_bias,
        // llama.cpp's converter permutes llama's Q/K rows to adjacent pairs and no other family's
        gguf_rope_halves: family != "llama",
        moe,
        fused_decode,
        norm_plus_one: gemma,
        embed_scale: gemma,
        post_norms: gemma,
        gelu: gemma,
        fused_projections: family == "phi3",
        out_bias: oai,
        attn_sinks: oai,
        oai_moe: oai,
    })
}

/// The CUDA kernel templates a target compiles only where its family's features ask for them
/// ([`Features::wants`]); every other template of the ABI is compiled for every CUDA target.
pub const FEATURE_TEMPLATES: [&str; 3] = ["decode", "moe", "qkv_rope"];

impl Features {
    /// Whether the family asks for feature template `t` (one of [`FEATURE_TEMPLATES`]): `decode`
    /// where `fused_decode`, `moe` where `moe`, `qkv_rope` where `qkv_rope`.
    pub fn wants(&self, t: &str) -> bool {
        match t {
            "decode" => self.fused_decode,
            "moe" => self.moe,
            "qkv_rope" => self.qkv_rope,
            _ => false,
        }
    }
}

/// `[model.experts]`: a mixture of experts in place of every layer's dense MLP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertShape {
    /// Experts per layer.
    pub count: u32,
    /// Experts routed per token.
    pub used: u32,
    /// Each expert's FFN width.
    pub ffn: u32,
}

/// `[model]`: the shape constants kernels are specialised on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    pub family: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub layers: u32,
    pub hidden: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub ffn: u32,
    pub vocab: u32,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub max_context: u32,
    pub tied_embeddings: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertShape>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding: Option<SlidingWindow>,
    /// The attention scores are scaled by query_pre_attn_scalar^-1/2 (Gemma's
    /// `query_pre_attn_scalar`) instead of head_dim^-1/2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// RoPE rotates the first `rotary_dim` dimensions of each head (Phi-4-mini: 96 of 128; HF
    /// `partial_rotary_factor`, GGUF `rope.dimension_count`); default the whole head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_dim: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub longrope: Option<LongRope>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub yarn: Option<Yarn>,
}

/// `[model.yarn]`: YaRN RoPE scaling (gpt-oss; Qwen3's long-context setting): each pair's
/// frequency blends the original (fast pairs) and the one divided by `factor` (slow pairs) over
/// a ramp between the pairs that turn `beta_fast` and `beta_slow` times in
/// `original_max_position_embeddings` positions (the ramp's ends rounded out where `truncate`),
/// and cos and sin are scaled by 0.1 ln(factor) + 1 (HF `_compute_yarn_parameters`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: u32,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub truncate: bool,
}

/// `[model.longrope]`: LongRoPE (Phi-3.5, Phi-4-mini, the 128k Phi-3s): per rotated pair, a
/// divisor of the frequency for contexts within `original_max_position_embeddings` (`short`) and
/// past it (`long`); the attention factor follows from `max_context` over the original length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongRope {
    pub short_factor: Vec<f64>,
    pub long_factor: Vec<f64>,
    pub original_max_position_embeddings: u32,
}

/// `[model.sliding]`: layers that attend to the last `window` positions only (the token's own
/// included), with their own RoPE base; every `pattern`-th layer (1-based: layers pattern - 1,
/// 2 pattern - 1, ...) attends to the whole context with `rope_theta` (Gemma 3: 512 or 1024, 6,
/// 10000).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlidingWindow {
    pub window: u32,
    pub pattern: u32,
    pub rope_theta: f64,
}

impl ModelShape {
    /// FLOPs of one token's matrix products: 2 per weight a token multiplies, the layers' (of routed
    /// experts the router and the `used` experts a token goes to) and the LM head's.
    pub fn matmul_flops_per_token(&self) -> f64 {
        let (h, qd, kd) = (
            self.hidden as f64,
            (self.heads * self.head_dim) as f64,
            (self.kv_heads * self.head_dim) as f64,
        );
        let mlp = match &self.experts {
            Some(x) => x.count as f64 * h + 3.0 * x.used as f64 * x.ffn as f64 * h,
            None => 3.0 * self.ffn as f64 * h,
        };
        let layer = h * (qd + 2.0 * kd) + qd * h + mlp;
        2.0 * (self.layers as f64 * layer + self.vocab as f64 * h)
    }

    /// The features of its family (validated to be one of [`FAMILIES`]; an unknown one reads as
    /// llama's until validation refuses it).
    pub fn features(&self) -> Features {
        features(&self.family).unwrap_or_else(|| features("llama").expect("llama"))
    }

    /// One rank's shape of the model split over `tp` ranks Megatron-style (checked to divide when
    /// the target loads): its query heads, KV heads (one where the model has fewer than `tp`)
    /// and FFN rows (each expert's, for a mixture); the rest, hidden size and vocabulary
    /// included, whole.
    pub fn per_rank(&self, tp: u32) -> ModelShape {
        let tp = tp.max(1);
        let mut r = self.clone();
        r.heads /= tp;
        r.kv_heads = (self.kv_heads / tp).max(1);
        r.ffn /= tp;
        if let Some(x) = &mut r.experts {
            x.ffn /= tp;
        }
        r
    }
}

impl crate::shape::Dims {
    /// The kernel constants of a target's model shape.
    pub fn from_shape(s: &ModelShape) -> crate::shape::Dims {
        crate::shape::Dims {
            layers: s.layers as usize,
            hidden: s.hidden as usize,
            heads: s.heads as usize,
            kv_heads: s.kv_heads as usize,
            head_dim: s.head_dim as usize,
            ffn: s.ffn as usize,
            vocab: s.vocab as usize,
        }
    }
}

/// `[quant]`: how weights are stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quant {
    pub name: String,
    /// dtype of the linear layers' weights: "q4_1" | "bf16".
    pub weights: String,
    /// dtype of the token embedding (also the tied LM head): "q8_0" | "bf16" | ...
    pub embedding: String,
    /// dtype of the KV cache: "f32" (the default) | "bf16" | "fp8" (cpu backend; `shape::KvDtype`).
    #[serde(default = "default_kv")]
    pub kv: String,
    /// How the CUDA matrix-vector kernels (small decode steps) take their input rows: "f32" (the
    /// default) | "i16": 16-bit integer blocks with exact integer dot products, the CPU backend's
    /// default scheme (q4_1 weights only; a quarter of the instructions per weight, ~1.5e-5
    /// relative per product; kernels/cuda/common.cuh, `XRow`).
    #[serde(default = "default_activations")]
    pub activations: String,
    /// How the tensor-core GEMMs of quantized weights (prefill chunks, decode steps of many
    /// sequences) take their activations: "split" (the default: f16 hi/lo pairs on mma.sync, exact
    /// to the f32 reference's ~1e-6) | "f16" (rounded once to f16, the weights dequantised to f16
    /// in registers feeding Hopper's wgmma: W4A16 for q4_1, W8A16 for a q8_0 LM head; sm_90a
    /// only, ~5e-4 relative per product; kernels/cuda/gemm_hopper.cu.hbs). bf16 weights always run
    /// bf16 activations on Hopper.
    #[serde(default = "default_gemm_activations")]
    pub gemm_activations: String,
}

fn default_kv() -> String {
    "f32".into()
}

fn default_activations() -> String {
    "f32".into()
}

fn default_gemm_activations() -> String {
    "split".into()
}

impl Quant {
    /// The KV cache's element type (checked when the target was parsed).
    pub fn kv_dtype(&self) -> crate::shape::KvDtype {
        crate::shape::KvDtype::parse(&self.kv).unwrap_or_default()
    }
}

/// One `[[model_types]]` entry: a checkpoint with this (model_type, hidden_size) is served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelType {
    pub model_type: String,
    pub hidden_size: u32,
}

/// Sampling defaults a request gets when it sets none of them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingPreset {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
}

/// `[sampling.chat]` (chat completions) and `[sampling.completion]` (plain completions).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    #[serde(default)]
    pub chat: SamplingPreset,
    #[serde(default)]
    pub completion: SamplingPreset,
}

/// `[behavior]`: server defaults baked into the binary.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Behavior {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctx_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<usize>,
    /// The syntax the model writes tool calls in: "hermes" (the default) | "llama3_json".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_format: Option<String>,
}

/// `[parallel]`: how one model spreads over the GPUs of a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parallel {
    /// The tensor-parallel degree: ranks (one GPU each) a model's layers are split over,
    /// Megatron-style (query heads, KV heads, FFN rows: `metrale_model::shard`); the target's
    /// kernels are one rank's ([`ModelShape::per_rank`]). 1: one GPU.
    #[serde(default = "one")]
    pub tensor: u32,
}

fn one() -> u32 {
    1
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel { tensor: 1 }
    }
}

/// The resolved MODEL.toml (after `extends`), as parsed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    model: ModelShape,
    quant: Quant,
    model_types: Vec<ModelType>,
    #[serde(default)]
    sampling: Sampling,
    #[serde(default)]
    behavior: Behavior,
    #[serde(default)]
    kernels: Vec<String>,
    #[serde(default)]
    parallel: Parallel,
}

/// A shared model file, `targets/models/<name>.toml`: the `[model]` shape (what `synth-model` makes a
/// checkpoint of). Other tables are read by the targets that extend it.
pub fn load_model_shape(root: &Path, name: &str) -> Result<ModelShape, TargetError> {
    let path = root.join(MODELS_DIR).join(format!("{name}.toml"));
    if !path.is_file() {
        let mut known: Vec<String> = std::fs::read_dir(root.join(MODELS_DIR))
            .map(|d| {
                d.filter_map(|e| {
                    e.ok()?
                        .file_name()
                        .to_str()?
                        .strip_suffix(".toml")
                        .map(String::from)
                })
                .collect()
            })
            .unwrap_or_default();
        known.sort();
        return Err(TargetError::Invalid {
            path: path.display().to_string(),
            field: "model".into(),
            expected: format!("one of the shared model files: {}", known.join(", ")),
            got: name.into(),
        });
    }
    read_model_shape(&path)
}

/// The `[model]` table of a TOML file laid out as `targets/models/<name>.toml` is.
pub fn read_model_shape(path: &Path) -> Result<ModelShape, TargetError> {
    #[derive(Deserialize)]
    struct Shared {
        model: ModelShape,
    }
    let text = read(path)?;
    let m: Shared = toml::from_str(&text).map_err(|e| TargetError::Parse {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    Ok(m.model)
}

/// A fully parsed and checked target.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetSpec {
    pub id: TargetId,
    pub hardware: Hardware,
    pub model: ModelShape,
    pub quant: Quant,
    pub model_types: Vec<ModelType>,
    pub sampling: Sampling,
    pub behavior: Behavior,
    /// Kernel template names (`kernels/<backend>/<name>.<ext>.hbs`), in declaration order.
    pub kernels: Vec<String>,
    /// `[parallel]`: the tensor-parallel degree (1 unless the MODEL.toml says).
    pub parallel: Parallel,
    /// HARDWARE.toml text as read.
    pub hardware_toml: String,
    /// The resolved MODEL.toml text (no `extends`): the text embedded in binaries.
    pub model_toml: String,
}

/// Name of the folder of shared model files inside the targets root.
pub const MODELS_DIR: &str = "models";

fn read(path: &Path) -> Result<String, TargetError> {
    std::fs::read_to_string(path).map_err(|source| TargetError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn parse_value(text: &str, path: &str) -> Result<toml::Table, TargetError> {
    text.parse::<toml::Table>().map_err(|e| TargetError::Parse {
        path: path.to_string(),
        message: e.to_string(),
    })
}

/// Deep merge: tables merge key by key, anything else in `top` replaces `base`.
fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

impl TargetSpec {
    pub fn hardware_path(root: &Path, id: &TargetId) -> PathBuf {
        root.join(&id.hw).join("HARDWARE.toml")
    }
    pub fn model_path(root: &Path, id: &TargetId) -> PathBuf {
        root.join(&id.hw)
            .join(&id.model)
            .join(&id.quant)
            .join("MODEL.toml")
    }

    /// Reads `targets_root/<hw>/<model>/<quant>/MODEL.toml`, resolves its `extends`, and returns the
    /// self-contained TOML text plus the repo-relative-to-root paths of the files it came from.
    pub fn resolve_model_toml(
        root: &Path,
        id: &TargetId,
    ) -> Result<(String, Vec<PathBuf>), TargetError> {
        let path = Self::model_path(root, id);
        let text = read(&path)?;
        let mut top = parse_value(&text, &path.display().to_string())?;
        let mut files = vec![path.clone()];
        let resolved = match top.remove("extends") {
            None => top,
            Some(toml::Value::String(name)) => {
                let valid = !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                    && !name.starts_with('.');
                if !valid {
                    return Err(TargetError::Invalid {
                        path: path.display().to_string(),
                        field: "extends".into(),
                        expected: "a model name (a file targets/models/<name>.toml)".into(),
                        got: name,
                    });
                }
                let base_path = root.join(MODELS_DIR).join(format!("{name}.toml"));
                let base_text = read(&base_path)?;
                let mut base = parse_value(&base_text, &base_path.display().to_string())?;
                if base.contains_key("extends") {
                    return Err(TargetError::Invalid {
                        path: base_path.display().to_string(),
                        field: "extends".into(),
                        expected: "no extends in a shared model file".into(),
                        got: "extends".into(),
                    });
                }
                merge(&mut base, top);
                files.insert(0, base_path);
                base
            }
            Some(other) => {
                return Err(TargetError::Invalid {
                    path: path.display().to_string(),
                    field: "extends".into(),
                    expected: "a string".into(),
                    got: other.type_str().into(),
                })
            }
        };
        let text = toml::to_string(&resolved).map_err(|e| TargetError::Parse {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Ok((text, files))
    }

    /// Loads and checks a target from the `targets/` folder.
    pub fn load(targets_root: &Path, id: &TargetId) -> Result<TargetSpec, TargetError> {
        let hw_path = Self::hardware_path(targets_root, id);
        let model_path = Self::model_path(targets_root, id);
        if !hw_path.is_file() || !model_path.is_file() {
            let missing = if hw_path.is_file() {
                model_path
            } else {
                hw_path
            };
            let available = list_targets(targets_root)
                .map(|v| {
                    v.iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_else(|e| format!("(cannot list: {e})"));
            return Err(TargetError::NotFound {
                id: id.to_string(),
                path: missing,
                available,
            });
        }
        let hw_text = read(&hw_path)?;
        let (model_text, _) = Self::resolve_model_toml(targets_root, id)?;
        Self::parse(
            &hw_text,
            &hw_path.display().to_string(),
            &model_text,
            &model_path.display().to_string(),
            id,
        )
    }

    /// Parses the embedded texts (HARDWARE.toml and the resolved MODEL.toml) of a target.
    pub fn from_toml(
        hardware_toml: &str,
        model_toml: &str,
        id: &TargetId,
    ) -> Result<TargetSpec, TargetError> {
        Self::parse(
            hardware_toml,
            &format!("{}/HARDWARE.toml", id.hw),
            model_toml,
            &format!("{id}/MODEL.toml"),
            id,
        )
    }

    fn parse(
        hw_text: &str,
        hw_path: &str,
        model_text: &str,
        model_path: &str,
        id: &TargetId,
    ) -> Result<TargetSpec, TargetError> {
        let hardware: Hardware = toml::from_str(hw_text).map_err(|e| TargetError::Parse {
            path: hw_path.to_string(),
            message: e.to_string(),
        })?;
        if model_text
            .parse::<toml::Table>()
            .map(|t| t.contains_key("extends"))
            .unwrap_or(false)
        {
            return Err(TargetError::Invalid {
                path: model_path.to_string(),
                field: "extends".into(),
                expected: "a resolved MODEL.toml (TargetSpec::resolve_model_toml)".into(),
                got: "extends".into(),
            });
        }
        let m: ModelFile = toml::from_str(model_text).map_err(|e| TargetError::Parse {
            path: model_path.to_string(),
            message: e.to_string(),
        })?;
        let spec = TargetSpec {
            id: id.clone(),
            hardware,
            model: m.model,
            quant: m.quant,
            model_types: m.model_types,
            sampling: m.sampling,
            behavior: m.behavior,
            kernels: m.kernels,
            parallel: m.parallel,
            hardware_toml: hw_text.to_string(),
            model_toml: model_text.to_string(),
        };
        spec.check(hw_path, model_path)?;
        Ok(spec)
    }

    /// The features its kernels are built with: the family's, and `qkv_rope` wherever the KV
    /// cache is fp8 (the cache is written a whole head vector at a time, with its scale, which
    /// only that kernel holds; the QKV products then leave their rows raw, as for the families
    /// that norm or bias their heads).
    pub fn features(&self) -> Features {
        let mut f = self.model.features();
        f.qkv_rope |= self.quant.kv_dtype() == crate::shape::KvDtype::Fp8;
        f
    }

    /// The shape the target's kernels are rendered for: one rank's ([`ModelShape::per_rank`]).
    pub fn rank_shape(&self) -> ModelShape {
        self.model.per_rank(self.parallel.tensor)
    }

    /// Whether a checkpoint with this config is served by this target.
    pub fn serves(&self, model_type: &str, hidden_size: usize) -> bool {
        self.model_types
            .iter()
            .any(|t| t.model_type == model_type && t.hidden_size as usize == hidden_size)
    }

    /// Human-readable multi-line description (used by `metrale-server --target-info`).
    pub fn describe(&self) -> String {
        let mut s = String::new();
        let h = &self.hardware;
        let m = &self.model;
        s.push_str(&format!("target:   {}\n", self.id));
        s.push_str(&format!("hardware: {} (backend {})", h.name, h.backend));
        if let Some(d) = &h.description {
            s.push_str(&format!(" - {d}"));
        }
        s.push('\n');
        if let (Some(c), Some(p)) = (&h.cubin_arch, &h.ptx_arch) {
            s.push_str(&format!("arch:     cubin {c}, ptx {p}\n"));
        }
        if let Some(n) = h.sm_count {
            s.push_str(&format!("SMs:      {n}\n"));
        }
        if let Some(n) = h.gpu_cores {
            s.push_str(&format!("GPU cores: {n}\n"));
        }
        if let Some(n) = h.memory_gib {
            s.push_str(&format!("memory:   {n} GiB\n"));
        }
        s.push_str(&format!(
            "model:    {} ({}): {} layers, hidden {}, {} heads / {} kv heads of {}, ffn {}, vocab {}, rope theta {}, eps {}, context {}{}\n",
            m.name, m.family, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab, m.rope_theta, m.norm_eps, m.max_context,
            if m.tied_embeddings { ", tied embeddings" } else { "" }
        ));
        if self.parallel.tensor > 1 {
            let r = self.rank_shape();
            s.push_str(&format!(
                "tensor parallel: {} ranks; the kernels are one rank's: {} heads / {} kv heads, ffn {}\n",
                self.parallel.tensor, r.heads, r.kv_heads, r.ffn
            ));
        }
        if let Some(r) = &m.rope_scaling {
            s.push_str(&format!(
                "rope scaling: {} factor {}, low {}, high {}, original context {}\n",
                r.rope_type,
                r.factor,
                r.low_freq_factor,
                r.high_freq_factor,
                r.original_max_position_embeddings
            ));
        }
        s.push_str(&format!(
            "quant:    {} (weights {}, embedding {}, KV cache {}, activations {}, GEMM activations {})\n",
            self.quant.name,
            self.quant.weights,
            self.quant.embedding,
            self.quant.kv,
            self.quant.activations,
            self.quant.gemm_activations
        ));
        let pairs: Vec<String> = self
            .model_types
            .iter()
            .map(|t| format!("({}, {})", t.model_type, t.hidden_size))
            .collect();
        s.push_str(&format!(
            "serves (model_type, hidden_size): {}\n",
            pairs.join(", ")
        ));
        let preset = |p: &SamplingPreset| {
            let mut v = Vec::new();
            if let Some(x) = p.temperature {
                v.push(format!("temperature={x}"))
            }
            if let Some(x) = p.top_p {
                v.push(format!("top_p={x}"))
            }
            if let Some(x) = p.top_k {
                v.push(format!("top_k={x}"))
            }
            if let Some(x) = p.min_p {
                v.push(format!("min_p={x}"))
            }
            if let Some(x) = p.repetition_penalty {
                v.push(format!("repetition_penalty={x}"))
            }
            if v.is_empty() {
                "(none)".to_string()
            } else {
                v.join(" ")
            }
        };
        s.push_str(&format!(
            "sampling.chat:       {}\n",
            preset(&self.sampling.chat)
        ));
        s.push_str(&format!(
            "sampling.completion: {}\n",
            preset(&self.sampling.completion)
        ));
        let b = &self.behavior;
        let o = |x: Option<usize>| x.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
        s.push_str(&format!(
            "behavior: max_tokens {}, ctx_size {}, parallel {}\n",
            o(b.max_tokens),
            o(b.ctx_size),
            o(b.parallel)
        ));
        s.push_str(&format!(
            "kernels:  {}\n",
            if self.kernels.is_empty() {
                "(none)".to_string()
            } else {
                self.kernels.join(", ")
            }
        ));
        s
    }
}

/// Every buildable target under `root`, sorted: `<hw>/HARDWARE.toml` x `<hw>/<model>/<quant>/MODEL.toml`.
pub fn list_targets(root: &Path) -> Result<Vec<TargetId>, TargetError> {
    let dirs = |p: &Path| -> Result<Vec<String>, TargetError> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(p).map_err(|source| TargetError::Io {
            path: p.to_path_buf(),
            source,
        })? {
            let e = e.map_err(|source| TargetError::Io {
                path: p.to_path_buf(),
                source,
            })?;
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                if let Some(n) = e.file_name().to_str() {
                    v.push(n.to_string());
                }
            }
        }
        v.sort();
        Ok(v)
    };
    let mut out = Vec::new();
    for hw in dirs(root)? {
        let hw_dir = root.join(&hw);
        if !hw_dir.join("HARDWARE.toml").is_file() {
            continue;
        }
        for model in dirs(&hw_dir)? {
            for quant in dirs(&hw_dir.join(&model))? {
                if hw_dir
                    .join(&model)
                    .join(&quant)
                    .join("MODEL.toml")
                    .is_file()
                {
                    out.push(TargetId::new(&hw, &model, &quant));
                }
            }
        }
    }
    Ok(out)
}

/// Groups targets by hardware, for display.
pub fn matrix(ids: &[TargetId]) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in ids {
        m.entry(id.hw.clone())
            .or_default()
            .push(format!("{}/{}", id.model, id.quant));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy_dir(src: &Path, dst: &Path) {
        std::fs::create_dir_all(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            let to = dst.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                copy_dir(&e.path(), &to);
            } else {
                std::fs::copy(e.path(), &to).unwrap();
            }
        }
    }

    /// h200/llama-3.1-8b/`quant` loaded from a copy of the repository's targets/ whose MODEL.toml
    /// `edit` rewrote.
    fn load_edited(quant: &str, edit: impl Fn(&str) -> String) -> Result<TargetSpec, TargetError> {
        // one folder per call: tests run in parallel threads of one process
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../targets");
        let dir = std::env::temp_dir().join(format!(
            "metrale-targets-{}-{quant}-{n}",
            std::process::id()
        ));
        copy_dir(&src, &dir);
        let p = dir.join(format!("h200/llama-3.1-8b/{quant}/MODEL.toml"));
        std::fs::write(&p, edit(&std::fs::read_to_string(&p).unwrap())).unwrap();
        let r = TargetSpec::load(&dir, &TargetId::new("h200", "llama-3.1-8b", quant));
        let _ = std::fs::remove_dir_all(&dir);
        r
    }

    #[test]
    fn sixteen_bit_activations_need_q4_1_weights_and_a_known_name() {
        let q = load_edited("q4_1", |s| s.to_string()).unwrap();
        assert_eq!(q.quant.activations, "i16");
        let b = load_edited("bf16", |s| s.to_string()).unwrap();
        assert_eq!(b.quant.activations, "f32", "the default");
        let err = load_edited("bf16", |s| {
            s.replace("[quant]\n", "[quant]\nactivations = \"i16\"\n")
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("quant.activations") && err.contains("q4_1"),
            "{err}"
        );
        let err = load_edited("q4_1", |s| {
            s.replace("activations = \"i16\"", "activations = \"i8\"")
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("f32 or i16") && err.contains("i8"), "{err}");
    }

    #[test]
    fn a_tensor_parallel_target_renders_one_ranks_shape() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../targets");
        let t = TargetSpec::load(&src, &TargetId::new("h200", "llama-3.1-70b", "bf16")).unwrap();
        assert_eq!(t.parallel.tensor, 8);
        let r = t.rank_shape();
        assert_eq!((r.heads, r.kv_heads, r.ffn, r.hidden), (8, 1, 3584, 8192));
        assert!(t.describe().contains("tensor parallel: 8 ranks"));
        // a degree that does not split the model, or with the fused batch-1 kernel, is refused
        for (tp, says) in [(3, "multiple of 3"), (64, "query heads (32)")] {
            let err = load_edited("bf16", |s| {
                let s = s.replace(", \"decode\"]", "]");
                format!("{s}\n[parallel]\ntensor = {tp}\n")
            })
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("parallel.tensor") && err.contains(says),
                "{err}"
            );
        }
        let err = load_edited("bf16", |s| format!("{s}\n[parallel]\ntensor = 2\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no \"decode\" kernel"), "{err}");
        let one = load_edited("bf16", |s| s.to_string()).unwrap();
        assert_eq!(
            (one.parallel.tensor, one.rank_shape()),
            (1, one.model.clone())
        );
    }

    #[test]
    fn an_fp8_kv_cache_on_cuda_takes_qkv_rope_and_no_decode() {
        let t = load_edited("bf16-fp8kv", |s| s.to_string()).unwrap();
        assert_eq!(t.quant.kv_dtype(), crate::shape::KvDtype::Fp8);
        // qkv_rope is the target's feature, not the llama family's
        assert!(t.features().qkv_rope && !t.model.features().qkv_rope);
        // the fused batch-1 kernel reads f32 or bf16 caches
        let err = load_edited("bf16", |s| s.replace("kv = \"bf16\"", "kv = \"fp8\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("quant.kv") && err.contains("without \"decode\"") && err.contains("fp8"),
            "{err}"
        );
        let err = load_edited("bf16", |s| s.replace("kv = \"bf16\"", "kv = \"e5m2\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("f32, bf16 or fp8"), "{err}");
    }

    #[test]
    fn fp8_weights_are_a_per_stage_cuda_setting_for_dense_families() {
        let t = load_edited("fp8", |s| s.to_string()).unwrap();
        assert_eq!(
            (t.quant.weights.as_str(), t.quant.embedding.as_str()),
            ("fp8", "bf16")
        );
        assert!(!t.kernels.iter().any(|k| k == "decode"));
        for (edit, says) in [
            (
                &(|s: &str| s.replace("\"gemm_tma\"]", "\"gemm_tma\", \"decode\"]"))
                    as &dyn Fn(&str) -> String,
                "without \"decode\"",
            ),
            (
                &|s: &str| s.replace("embedding = \"bf16\"", "embedding = \"fp8\""),
                "fp8 for the layer weights",
            ),
            (
                &|s: &str| s.replace("[quant]\n", "[quant]\nactivations = \"i16\"\n"),
                "quant.activations",
            ),
        ] {
            let err = load_edited("fp8", edit).unwrap_err().to_string();
            assert!(err.contains(says), "{says}: {err}");
        }
    }

    #[test]
    fn f16_gemm_activations_need_q4_1_weights_and_a_known_name() {
        let q = load_edited("q4_1", |s| s.to_string()).unwrap();
        assert_eq!(q.quant.gemm_activations, "f16");
        let b = load_edited("bf16", |s| s.to_string()).unwrap();
        assert_eq!(b.quant.gemm_activations, "split", "the default");
        let err = load_edited("bf16", |s| {
            s.replace("[quant]\n", "[quant]\ngemm_activations = \"f16\"\n")
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("quant.gemm_activations") && err.contains("q4_1"),
            "{err}"
        );
        let err = load_edited("q4_1", |s| {
            s.replace("gemm_activations = \"f16\"", "gemm_activations = \"bf16\"")
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("split or f16") && err.contains("bf16"),
            "{err}"
        );
    }

    #[test]
    fn families_pick_their_kernels_and_unknown_ones_are_refused() {
        // qwen3 on a CUDA target: no fused decode_1, the Q/K norm kernel instead
        let err = load_edited("bf16", |s| format!("{s}\n[model]\nfamily = \"qwen3\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("kernels") && err.contains("without \"decode\""),
            "{err}"
        );
        let swap = |s: &str| s.replace("\"decode\"", "\"qkv_rope\"");
        let q = load_edited("bf16", |s| {
            format!("{}\n[model]\nfamily = \"qwen3\"\n", swap(s))
        })
        .unwrap();
        assert!(q.model.features().qk_norm && !q.model.features().fused_decode);
        // qwen2: the same kernel for its Q/K/V biases
        let q2 = load_edited("bf16", |s| {
            format!("{}\n[model]\nfamily = \"qwen2\"\n", swap(s))
        })
        .unwrap();
        let f2 = q2.model.features();
        assert!(f2.qkv_bias && f2.qkv_rope && !f2.qk_norm && f2.gguf_rope_halves);
        let err = load_edited("bf16", |s| {
            s.replace("\"decode\"]", "\"decode\", \"qkv_rope\"]")
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("without \"qkv_rope\" for the llama"), "{err}");
        // qwen3moe: the routed experts' kernels too (refused for the other families)
        let moe =
            "\n[model]\nfamily = \"qwen3moe\"\n[model.experts]\ncount = 8\nused = 2\nffn = 64\n";
        let with_moe = |s: &str| swap(s).replace("\"qkv_rope\"]", "\"qkv_rope\", \"moe\"]");
        let m = load_edited("bf16", |s| format!("{}{moe}", with_moe(s))).unwrap();
        assert!(m.model.features().moe);
        let err = load_edited("bf16", |s| {
            format!("{}\n[model]\nfamily = \"qwen3\"\n", with_moe(s))
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("without \"moe\" for the qwen3"), "{err}");
        // gemma3's block has no GPU kernels: refused on a CUDA target by name
        let err = load_edited("bf16", |s| {
            format!("{}\n[model]\nfamily = \"gemma3\"\n", swap(s))
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("gemma3") && err.contains("cpu backend only"),
            "{err}"
        );
        let g = TargetSpec::load(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../targets"),
            &TargetId::new("cpu", "gemma3-1b", "bf16"),
        )
        .unwrap();
        let f = g.model.features();
        assert!(f.post_norms && f.gelu && f.norm_plus_one && f.embed_scale && f.qk_norm);
        assert_eq!(
            g.model.sliding.as_ref().map(|w| (w.window, w.pattern)),
            Some((512, 6))
        );
        let err = load_edited("bf16", |s| format!("{s}\n[model]\nfamily = \"mistral\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("llama, qwen2, qwen3"), "{err}");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../targets");
        let q = TargetSpec::load(&src, &TargetId::new("cpu", "qwen3-8b", "q4_1")).unwrap();
        assert_eq!((q.model.family.as_str(), q.model.layers), ("qwen3", 36));
    }
}
