//! The forward pass as one list of stages, walked by both backends: [`Stage::Embed`], each layer's
//! [`Stage::LAYER`], [`Stage::LmHead`]. What a family changes is a feature
//! (`metrale_core::target::Features`) that one stage consumes, in one match arm per backend
//! (`cpu::Pass::run`, `cuda::forward`'s `launch_stage`); a new kind of work in the block (a norm
//! after attention, say) is a new stage here and an arm in each.
//!
//! Invariants: every stage reads the residual stream `x` and writes back to it or to the buffers
//! the next stage reads, so a stage's inputs are exactly what the stages before it in this order
//! left; both backends run a layer's stages in [`Stage::LAYER`]'s order and no others.

/// One stage of the forward pass over a chunk of tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The tokens' embedding rows into the residual stream.
    Embed,
    /// The attention RMSNorm, the Q, K and V products, the Q/K/V biases (`features.qkv_bias`), the
    /// per-head Q/K RMSNorm (`features.qk_norm`), RoPE on q and k, and K and V into the paged
    /// KV cache.
    Qkv,
    /// Grouped-query attention of every token over its sequence's cached positions (causal).
    Attention,
    /// The O product, added to the residual stream.
    Out,
    /// The FFN RMSNorm, then the gate and up products and SiLU(gate) x up; with routed experts
    /// (`features.moe`) the router, each token's top-k experts and their weights, and each chosen
    /// expert's gate/up.
    GateUp,
    /// The down product, added to the residual stream; with routed experts each chosen expert's
    /// down product, weighted, summed in ascending expert order.
    Down,
    /// The final RMSNorm and the LM head on the positions that sample (the greedy pick fused on
    /// CUDA).
    LmHead,
}

impl Stage {
    /// A layer's stages, in order (every family's block today).
    pub const LAYER: [Stage; 5] = [
        Stage::Qkv,
        Stage::Attention,
        Stage::Out,
        Stage::GateUp,
        Stage::Down,
    ];
}
