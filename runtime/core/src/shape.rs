//! The shape of a Llama-family model as kernels and backends see it: layers, widths and heads. One
//! struct for the CPU backend (read from the checkpoint), the CUDA backend and the kernel ABI's
//! layout formulas (the constants the kernels were compiled with, from the target's MODEL.toml);
//! hyper-parameters such as the norm epsilon stay with whoever uses them. This module knows nothing
//! of targets: `target` builds a `Dims` from its model shape (`Dims::from_shape`, defined there).

/// Shape constants of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
}

impl Dims {
    /// Width of the query projection (heads x head_dim).
    pub fn qd(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the key (or value) projection (kv_heads x head_dim).
    pub fn kd(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Elements of one sequence's K (or V) cache per token, all layers.
    pub fn kv_per_token(&self) -> usize {
        self.layers * self.kd()
    }
}

/// Tokens per block of the paged KV cache: a sequence's positions `16b..16b+16` live in its `b`-th
/// block (vLLM's default block size).
pub const KV_BLOCK: usize = 16;

/// Element type of the KV cache, a target setting (`[quant] kv`) or the server's
/// `--kv-cache-dtype`: f32 where exact CPU = GPU comparisons need it, bf16 for real-size targets
/// (half the bytes; K and V are rounded to nearest even when written, the same on every backend),
/// fp8 (CPU backend): each head's K or V vector of a token stored as e4m3 bytes with one f32 scale
/// (its largest magnitude to 448, `crate::fp8`), 1 + 4 / head_dim bytes an element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F32,
    Bf16,
    Fp8,
}

impl KvDtype {
    /// "f32" | "bf16" | "fp8" (or vLLM's "fp8_e4m3"), as MODEL.toml and the server's flag spell it.
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "f32" => Some(KvDtype::F32),
            "bf16" => Some(KvDtype::Bf16),
            "fp8" | "fp8_e4m3" => Some(KvDtype::Fp8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
        }
    }

    /// Bytes per element (fp8: without the scales, [`KvDtype::vector_bytes`]).
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
            KvDtype::Fp8 => 1,
        }
    }

    /// Bytes of one head's K (or V) vector of `head_dim` elements, scales included.
    pub fn vector_bytes(self, head_dim: usize) -> usize {
        head_dim * self.bytes() + if self == KvDtype::Fp8 { 4 } else { 0 }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Llama 3 RoPE scaling of one inverse frequency `f` (HF's `rope_type: "llama3"`): wavelengths
/// shorter than `old / high` keep `f`, longer than `old / low` divide it by `factor`, and those
/// between interpolate. The one formula the backends' rope table and `synth-model`'s GGUF
/// `rope_freqs` use.
pub fn llama3_scaled_freq(f: f64, factor: f64, low: f64, high: f64, old: f64) -> f64 {
    let (low_wl, high_wl) = (old / low, old / high);
    let wl = 2.0 * std::f64::consts::PI / f;
    if wl < high_wl {
        f
    } else if wl > low_wl {
        f / factor
    } else {
        let smooth = (old / wl - low) / (high - low);
        (1.0 - smooth) * f / factor + smooth * f
    }
}

/// LongRoPE's factor on cos and sin (transformers' `_compute_longrope_parameters`, llama.cpp's
/// converter): sqrt(1 + ln(s) / ln(original)) for the extension s = max_context / original > 1,
/// else 1. The one formula both readers and `synth-model` use where a file does not give it.
pub fn longrope_attention_factor(max_context: f64, original: f64) -> f64 {
    let s = max_context / original;
    if s > 1.0 {
        (1.0 + s.ln() / original.ln()).sqrt()
    } else {
        1.0
    }
}
