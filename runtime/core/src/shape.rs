//! The shape of a Llama-family model as kernels and backends see it: layers, widths and heads. One
//! struct for the CPU backend (read from the checkpoint), the CUDA backend and the kernel ABI's
//! layout formulas (the constants the kernels were compiled with, from the target's MODEL.toml);
//! hyper-parameters such as the norm epsilon stay with whoever uses them.

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
    /// The kernel constants of a target's model shape.
    pub fn from_shape(s: &crate::target::ModelShape) -> Dims {
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

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Elements of one sequence's K (or V) cache per token, all layers.
    pub fn kv_per_token(&self) -> usize {
        self.layers * self.kd()
    }
}
