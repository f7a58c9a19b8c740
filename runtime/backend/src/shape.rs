//! The shape of a Llama-family model as every backend sees it: layers, widths and heads. One struct
//! for the CPU backend (read from the checkpoint) and the CUDA backend (the constants its kernels
//! were compiled with, from the target's MODEL.toml); hyper-parameters such as the norm epsilon stay
//! with the backend that uses them.

use metrale_model::ModelConfig;

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
    /// The shape of a checkpoint's config.
    pub fn from_config(c: &ModelConfig) -> Dims {
        Dims {
            layers: c.n_layers,
            hidden: c.hidden,
            heads: c.n_heads,
            kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            ffn: c.ffn,
            vocab: c.vocab,
        }
    }

    /// The kernel constants of a target's model shape.
    pub fn from_shape(s: &metrale_core::target::ModelShape) -> Dims {
        Dims {
            layers: s.layers as usize,
            hidden: s.hidden as usize,
            heads: s.heads as usize,
            kv_heads: s.kv_heads as usize,
            head_dim: s.head_dim as usize,
            ffn: s.ffn as usize,
            vocab: s.vocab as usize,
        }
    }

    /// Width of the query projection (heads x head_dim).
    pub fn qd(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the key (or value) projection (kv_heads x head_dim).
    pub fn kd(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Elements of one sequence's K (or V) cache per token, all layers.
    pub fn kv_per_token(&self) -> usize {
        self.layers * self.kd()
    }
}
