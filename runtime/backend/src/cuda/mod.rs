//! The CUDA backend (feature `cuda`): runs the Llama forward pass of one target with that target's
//! compiled kernels (kernels/cuda/*.cu.hbs) through cudarc.
//!
//! Layers, each using only the ones above it in this list:
//! - [`device`]: context, stream, memory, copies, graph capture, the one `cuLaunchKernelEx` call;
//! - [`kernels`]: the target's blobs and their loaded entry points;
//! - [`plan`]: grids, attention splits and the arch check, pure;
//! - [`launch`]: [`Gpu`], one typed launcher per entry point, taking its `metrale_abi` argument struct;
//! - [`weights`]: checkpoint tensors repacked into the device layouts and uploaded;
//! - [`decode1`] (the persistent batch-1 decode kernel) and [`gemm`] (the tensor-core GEMM path);
//! - this module: [`CudaBackend`], the scheduling of a step (chunks, graphs, run-ahead, sampling),
//!   with the per-stage forward pass in `forward.rs` and bench-only timing in `profile.rs`.
//!
//! Owns: the weights on the device, the paged KV cache ([`kv`]: one pool of blocks in the target's
//! KV type, the block tables the engine's `SeqStep::blocks` are mirrored into), the activation
//! buffers (allocated once for `max_step_tokens`), the decode CUDA graphs.
//! Entry points: [`CudaBackend::from_registry`] (a built binary: embedded, attestation-checked
//! kernels) and [`CudaBackend::new`] (any [`KernelSet`], e.g. a dist/ folder, for tests and tools).
//! Not here: a persistent kernel for batched decode (bench/cuda/NOTES.md), W4A16 tensor-core
//! products for q4_1 weights (q4_1 chunks run the mma.sync GEMMs of `gemm.cu.hbs`).
//!
//! Invariants:
//! - Nothing is allocated on the device after `CudaBackend::new`; a step larger than
//!   `max_step_tokens` runs as several chunks in order.
//! - A pure decode step of one sequence is one launch of the persistent `decode_1` kernel (its
//!   inputs are kernel arguments) unless `Tuning::persistent_decode` is off or the device cannot run it.
//! - Run-ahead (`Tuning::run_ahead`, on by default): when such a step's token is the device's greedy
//!   pick (for a constrained sequence: the arg-max under its grammar mask, computed on the host
//!   while the step runs, by `argmax_masked_1` over the kernel's pick), the next step (position + 1, its token read on the device from this step's pick) is
//!   enqueued before the host waits for this one, so the host's and the engine's work between
//!   tokens overlap the GPU's. When the engine's next call is exactly that step, it only collects
//!   it; otherwise the run-ahead launch was spare work whose only writes are the scratch outputs and
//!   the KV entry at that position, which every later step writes before it reads it. It runs ahead
//!   only when the sequence's block table already covers that position (the engine allocates one
//!   position ahead), and that block is the sequence's own: no other sequence reads it.
//! - A pure decode step (every sequence one token) of `n` sequences otherwise replays a graph
//!   captured for (n, attention splits).
//! - Requests without penalties, logit bias or logprob lists are sampled on the device: greedy inside
//!   `lm_head` (or `decode_1`), temperature / top-k / top-p / min-p with the seed by `sample_probs`,
//!   which reproduces `crate::sampler::sample` exactly (same candidate order, same f64 walk, same
//!   SplitMix64 draw); only ids and logprobs cross back. Penalties, logit bias, logprob lists,
//!   logits requests and rows with more than 2048 candidates copy their logits row back and use the
//!   host sampler itself.

pub mod decode1;
pub mod device;
mod forward;
pub mod gemm;
pub mod kernels;
pub mod kv;
pub mod launch;
pub mod plan;
pub mod profile;
pub mod weights;

use std::collections::HashMap;

use cudarc::driver::CudaGraph;
/// The host↔kernel ABI the kernels were compiled against (argument structs, constants).
pub use metrale_abi as abi;
use metrale_core::BackendError;
use metrale_model::{ModelConfig, Weights};

use crate::{sampler, Backend, BackendInfo, HiddenSums, SeqOutput, SeqStep, SlotId, KV_BLOCK};
use decode1::{Decode1, Step};
pub use device::{device_count, DevBuf, Device, HostStage, HostWrite};
use forward::{Attn, Bufs};
use gemm::GemmPath;
pub use kernels::{KernelBlob, KernelSet};
use kv::KvCache;
pub use launch::Gpu;
use weights::{DevFormat, ModelWeights};

/// Runtime choices of the CUDA backend whose alternative is kept for comparison. `Default` is what
/// was measured best (bench/cuda/NOTES.md) and reads nothing; the server's start-up and the bench
/// tools apply `METRALE_CUDA_TUNING` ([`Tuning::parse`]) on top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// One sequence's decode steps run as one launch of the persistent `decode_1` kernel (else the
    /// per-stage kernels and their graphs).
    pub persistent_decode: bool,
    /// Enqueue the next greedy `decode_1` step before waiting for this one (module docs).
    pub run_ahead: bool,
    /// Capture and replay CUDA graphs for decode steps of several sequences (else direct launches).
    pub graphs: bool,
    /// Decode steps of as many sequences as [`gemm::gemm_pays_on`] asks run their layer products as
    /// tensor-core GEMMs, as prefill chunks do (else the matrix-vector kernels, which re-read the
    /// weights once per token tile).
    pub decode_gemm: bool,
    /// Programmatic dependent launch between the per-stage kernels on sm_90+ (else plain stream
    /// order).
    pub pdl: bool,
    /// Attention splits combined through a thread-block cluster where the target allows it (else
    /// through global partials and a ticket).
    pub attention_cluster: bool,
    /// One output's LM head by `lm_head_1` (whole rows streamed per warp; else `lm_head`).
    pub lm_head_1: bool,
    /// `attention` sums its scores by a transpose-reduce (`abi::ATT_FLAG_TRANSPOSE`): on the 8B
    /// bf16-KV target the attention alone took 25.0 instead of 31.6 us per layer at depth 8192 and
    /// 78.6 instead of 104.2 at 32768 (H200, 2026-12-02).
    pub attention_transpose: bool,
    /// On Hopper (sm_90a cubins; bf16 weights, or q4_1 with `gemm_activations = "f16"`) the GEMM
    /// path runs on warpgroup MMAs (`gemm_hopper.cu.hbs`: bf16 activations, or f16 with the weights
    /// dequantised in registers), else on the mma.sync GEMMs (`gemm.cu.hbs`, exact).
    pub hopper_gemm: bool,
    /// The Hopper GEMM path runs on the warp-specialised kernels: bf16 weights in chunks of
    /// [`gemm::TMA_MIN_TOKENS`] tokens and more (`gemm_tma.cu.hbs`: TMA producer, two wgmma
    /// consumer warpgroups, persistent tiles), quantized weights always (`gemm_hopper.cu.hbs`'s
    /// `wq_*`: a cp.async producer warpgroup, two consumer warpgroups dequantising into
    /// registers); else on `gemm_hopper.cu.hbs`'s one-warpgroup kernels.
    pub tma_gemm: bool,
    /// q4_1 layers' products of chunks of at most `abi::WN_TOKENS` tokens (a verification step, a
    /// few sequences) run on the narrow GEMMs (`wn_*`, narrow_gemm.cuh: mma.sync, each warp's
    /// weight rows streamed into registers), else on the warp-specialised ones.
    pub narrow_gemm: bool,
    /// One-token chunks' layer products on the narrow GEMMs too, where they run (off by default:
    /// a measurement against the matrix-vector kernels, which take them otherwise).
    pub narrow_one: bool,
    /// Prompt chunks run their attention on the tensor cores (`attention_flash`, targets with a bf16
    /// KV cache), else on the split-K `attention` kernel as decode steps do.
    pub flash_attention: bool,
    /// Grammar masks are read by the kernels from mapped page-locked host memory where the host
    /// wrote them (else copied to the device first, one more operation in the stream per step:
    /// SmolLM2's constrained decode_1 step took 344.7 instead of 357.6 us, H200, 2026-12-02).
    pub mask_zero_copy: bool,
    /// `attention` launches of one split serve several (token, KV head) pairs a block, as many
    /// warps a pair as one wave holds (`plan::attention_pack`; batched decode steps), else every
    /// pair takes a whole block.
    pub attention_pack: bool,
    /// On the Hopper GEMM path the O and down products' epilogues also write the next product's
    /// input (the new residual times the next RMSNorm's weight, and its squares: `abi::SS_COLS`),
    /// so no conversion kernel runs before the gate/up and (after layer 0) QKV products; else
    /// `wg_act_norm` converts before each of them.
    pub fused_norm: bool,
    /// Decode steps of several sequences run their attention on `attention_flash` too (a query
    /// tile of one token a sequence: its GROUP heads against each K/V tile on the tensor cores),
    /// else on the split-K `attention`. Off until measured against the packed split-K kernel.
    pub flash_decode: bool,
    /// `argmax_logprob` spreads each logits row over several blocks (`plan::argmax_splits`), else
    /// one block a row.
    pub argmax_split: bool,
    /// The warp-specialised products may take the 96-row tiles (`layout::TMA_CONFIGS`; made for
    /// QKV, planned wherever 96 divides the rows and the estimate prefers them), else only the
    /// 128-256-row ones.
    pub tma_96: bool,
    /// Steps whose routed experts run grouped by expert (`MoeShape::grouped`) take the
    /// tensor-core products (`moe_gu_mma`, `moe_down_mma`: mma.sync over each expert's gathered
    /// rows), else the CUDA-core ones (`moe_gu_grouped`, `moe_down_grouped`).
    pub moe_mma: bool,
    /// Where the GEMM path runs on Hopper's wgmma, so do the routed experts' grouped products
    /// (`moe_gu_wg` / `moe_down_wg`, warp-specialised `moe_*_wq` with quantized weights: the
    /// dense products' kernels over each expert's gathered pairs, activations rounded once to
    /// 16 bits as theirs), else `moe_mma` chooses.
    pub moe_wgmma: bool,
    /// A one-token step over at most `plan::ONE_SPLIT_LEN` (128) positions runs its attention
    /// in one split (no combine), where the rule splits from 33: Qwen3-30B-A3B's step
    /// -69 us (q4_1) and -63 us (bf16) on an H100 (`bench/families/README.md`).
    pub attention_one_split: bool,
    /// Split-K attention launches too small to fill half the SMs (a one-token step of a model
    /// with few KV heads) run on `attention_hs`: each (token, KV head, split) over several
    /// blocks, each a part of the group's query heads, so each warp's chain of dependent
    /// instructions is a fraction as long (`Gpu::attention_heads_pay`): 9.3 -> 6.6 us a layer
    /// for Qwen3-30B-A3B's one-token step on an H100 (`bench/families/README.md`).
    pub attention_heads: bool,
    /// A one-token step's routing needs no launch of its own (`moe_route`): its O product
    /// (`moe_out_route`) sums the router's logits from the residual's rows as it writes them,
    /// into fixed-point sums, and every block of `moe_gu` routes from them and normalises the
    /// residual itself: a launch and a pass over the residual fewer a layer
    /// (`bench/families/README.md`).
    pub moe_route_fused: bool,
    /// A one-token QKV product of a family with `features.qkv_rope` (Qwen2's biases, Qwen3's
    /// Q/K norms) runs with that work and the KV write in one launch (`attn_in_head`, a head's
    /// blocks one thread-block cluster) instead of `attn_in` then `qkv_rope`
    /// (`bench/families/README.md`).
    pub attn_in_head: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            persistent_decode: true,
            run_ahead: true,
            graphs: true,
            decode_gemm: true,
            pdl: true,
            attention_cluster: true,
            lm_head_1: true,
            attention_transpose: true,
            hopper_gemm: true,
            tma_gemm: true,
            narrow_gemm: true,
            narrow_one: false,
            flash_attention: true,
            mask_zero_copy: true,
            attention_pack: true,
            fused_norm: true,
            flash_decode: false,
            argmax_split: true,
            tma_96: true,
            moe_mma: true,
            moe_wgmma: true,
            attention_one_split: true,
            attention_heads: true,
            moe_route_fused: true,
            attn_in_head: true,
        }
    }
}

impl Tuning {
    /// The environment variable the server and the bench tools read it from.
    pub const ENV: &'static str = "METRALE_CUDA_TUNING";
    /// Its keys, each `on` or `off`.
    pub const KEYS: [&'static str; 25] = [
        "persistent_decode",
        "run_ahead",
        "graphs",
        "decode_gemm",
        "pdl",
        "attention_cluster",
        "lm_head_1",
        "attention_transpose",
        "hopper_gemm",
        "tma_gemm",
        "narrow_gemm",
        "narrow_one",
        "flash_attention",
        "mask_zero_copy",
        "attention_pack",
        "fused_norm",
        "flash_decode",
        "argmax_split",
        "tma_96",
        "moe_mma",
        "moe_wgmma",
        "attention_one_split",
        "attention_heads",
        "moe_route_fused",
        "attn_in_head",
    ];

    /// `self` with the settings of `text` applied: comma-separated `key=on|off` pairs, e.g.
    /// `run_ahead=off,graphs=on` (empty: no change). An unknown key or value is an error naming it
    /// and the valid ones.
    pub fn parse(mut self, text: &str) -> Result<Tuning, String> {
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("{}: `{item}` is not key=on|off", Self::ENV))?;
            let on = match value.trim() {
                "on" | "1" | "true" => true,
                "off" | "0" | "false" => false,
                v => {
                    return Err(format!(
                        "{}: `{key}={v}`: the value must be on or off",
                        Self::ENV
                    ))
                }
            };
            match key.trim() {
                "persistent_decode" => self.persistent_decode = on,
                "run_ahead" => self.run_ahead = on,
                "graphs" => self.graphs = on,
                "decode_gemm" => self.decode_gemm = on,
                "pdl" => self.pdl = on,
                "attention_cluster" => self.attention_cluster = on,
                "lm_head_1" => self.lm_head_1 = on,
                "attention_transpose" => self.attention_transpose = on,
                "hopper_gemm" => self.hopper_gemm = on,
                "tma_gemm" => self.tma_gemm = on,
                "narrow_gemm" => self.narrow_gemm = on,
                "narrow_one" => self.narrow_one = on,
                "flash_attention" => self.flash_attention = on,
                "mask_zero_copy" => self.mask_zero_copy = on,
                "attention_pack" => self.attention_pack = on,
                "fused_norm" => self.fused_norm = on,
                "flash_decode" => self.flash_decode = on,
                "argmax_split" => self.argmax_split = on,
                "tma_96" => self.tma_96 = on,
                "moe_mma" => self.moe_mma = on,
                "moe_wgmma" => self.moe_wgmma = on,
                "attention_one_split" => self.attention_one_split = on,
                "attention_heads" => self.attention_heads = on,
                "moe_route_fused" => self.moe_route_fused = on,
                "attn_in_head" => self.attn_in_head = on,
                k => {
                    return Err(format!(
                        "{}: unknown key `{k}`; the keys are {}",
                        Self::ENV,
                        Self::KEYS.join(", ")
                    ))
                }
            }
        }
        Ok(self)
    }
}

/// How to size the backend, and its runtime choices.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// KV-cache slots (concurrent sequences).
    pub slots: usize,
    /// Most positions of one sequence.
    pub slot_capacity: usize,
    /// Blocks of the KV pool; 0: every slot at full context, or what fits in `memory_fraction`
    /// ([`kv::pool_blocks`]).
    pub kv_blocks: usize,
    /// Fraction of the device's memory the backend may use in all when it sizes the KV pool.
    pub memory_fraction: f64,
    /// Most tokens one launch sequence processes (prefill chunks are split to this).
    pub max_step_tokens: usize,
    /// Most proposed tokens one sequence's step verifies (`SeqStep::drafted`; the server's
    /// `--num-speculative-tokens` under `--speculative`); 0: no verification. A chunk's output
    /// rows are sized for every slot's `1 + max_drafts` ([`CudaOptions::outputs`]).
    pub max_drafts: usize,
    pub tuning: Tuning,
}

impl CudaOptions {
    /// Most output rows (LM head rows, sampled tokens) of one chunk: one a slot, or with
    /// verification one a proposal and one after them.
    pub fn outputs(&self) -> usize {
        self.slots * (1 + self.max_drafts)
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            slots: 8,
            slot_capacity: 4096,
            kv_blocks: 0,
            memory_fraction: 0.9,
            max_step_tokens: 512,
            max_drafts: 0,
            tuning: Tuning::default(),
        }
    }
}

/// The CUDA backend of one target.
pub struct CudaBackend {
    gpu: Gpu,
    opts: CudaOptions,
    target: String,
    w: ModelWeights,
    b: Bufs,
    kv: KvCache,
    /// Decode chunks' graphs by (tokens, output rows, attention plan).
    graphs: HashMap<(usize, usize, Attn), CudaGraph>,
    /// The final RMSNorm's epsilon and weights, on the host (the embeddings path norms there).
    norm_eps: f32,
    out_norm: Vec<f32>,
    gemm: GemmPath,
    /// The persistent batch-1 decode kernel (`None` when `Tuning::persistent_decode` is off or
    /// the device cannot run it).
    decode1: Option<Decode1>,
    /// Inputs of the last `decode_1` launch (benchmarks replay it).
    last_decode1: Option<Step>,
    /// The run-ahead `decode_1` launch in the stream, if any: its (slot, position) and the token it
    /// reads on the device (the pick of the step before it).
    ahead: Option<(i32, i32, u32)>,
    /// Page-locked copy of `io_out` for run-ahead steps, which do not wait for the whole stream
    /// (`Some` when `Tuning::run_ahead`).
    out_stage: Option<HostStage>,
    /// The grammar masks' staging area (`forward::mask_words` for every slot).
    mask_stage: HostWrite,
    /// (tokens, output rows, attention plan) of the last chunk run
    last_key: Option<(usize, usize, Attn)>,
    /// Counters for tests and benchmarks.
    pub stats: Stats,
}

/// What the backend did (tests and benchmarks read it).
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub graph_captures: u64,
    pub graph_launches: u64,
    pub direct_steps: u64,
    /// Decode steps run by the persistent `decode_1` kernel.
    pub decode1_launches: u64,
    /// `decode_1` steps enqueued ahead of the engine's call, and how many of them the engine then
    /// asked for (the rest were spare work).
    pub run_ahead_launches: u64,
    pub run_ahead_hits: u64,
    /// Kernels in the decode graph captured last (its nodes; 0 before the first capture).
    pub last_graph_kernels: u64,
}

// SAFETY: the backend is used by one thread at a time (`&mut self`); cudarc binds the context to the
// calling thread before every driver call, and the graphs are only touched through `&mut self`.
unsafe impl Send for CudaBackend {}

const DECODE1_REFUSED: &str = "decode_1 refused to run: its dynamic shared memory is smaller than the kernel's layout (metrale-abi's layout.rs disagrees with kernels/cuda/decode.cu.hbs)";

impl CudaBackend {
    /// Load `config`'s `weights` (checked against the kernels' shape) onto device `opts.device`
    /// with the kernels of `set`.
    pub fn new(
        set: &KernelSet,
        config: &ModelConfig,
        weights: &Weights,
        opts: CudaOptions,
    ) -> Result<CudaBackend, BackendError> {
        let spec = &set.spec;
        if spec.parallel.tensor > 1 {
            return Err(BackendError::Model(format!(
                "target {}: its kernels are one rank of {} (tensor parallelism); serving over \
                 several GPUs is not written yet: build the model's one-GPU target",
                set.target, spec.parallel.tensor
            )));
        }
        let d = metrale_core::shape::Dims::from_shape(&spec.model);
        let moe = launch::MoeShape::of(&spec.model);
        let fmt = |s: &str, what: &str| {
            DevFormat::from_quant_name(s)
                .ok_or_else(|| BackendError::Model(format!("unknown {what} format {s:?}")))
        };
        let formats = (
            fmt(&spec.quant.weights, "weights")?,
            fmt(&spec.quant.embedding, "embedding")?,
        );
        weights::check_config(
            config,
            &d,
            (&spec.model.family, moe),
            (&set.target, formats.0),
        )?;
        if opts.slots == 0 || opts.slot_capacity == 0 || opts.max_step_tokens == 0 {
            return Err(BackendError::Invalid(
                "slots, slot capacity and max step tokens must be positive".into(),
            ));
        }
        if opts.max_drafts >= opts.max_step_tokens {
            return Err(BackendError::Invalid(format!(
                "{} proposed tokens a step do not fit a chunk of {} tokens with the token \
                 before them; propose fewer",
                opts.max_drafts, opts.max_step_tokens
            )));
        }
        let mut gpu = Gpu::open(opts.device, set)?;
        // the family's features, and qkv_rope for an fp8 KV cache (TargetSpec::features)
        let f = spec.features();
        for (name, needed, there) in [
            ("qkv_rope", f.qkv_rope, gpu.raw_qkv()),
            ("moe", f.moe, gpu.moe.is_some()),
        ] {
            if needed && !there {
                return Err(BackendError::Model(format!(
                    "target {}: the {} family (with a {} KV cache) needs the kernel template \
                     {name}, which the target's kernels list lacks; add it to its MODEL.toml and \
                     rebuild",
                    set.target, config.family, spec.quant.kv
                )));
            }
        }
        gpu.pdl &= opts.tuning.pdl;
        if !opts.tuning.attention_cluster {
            gpu.cluster_max = 0;
        }
        gpu.lm_head_1 = opts.tuning.lm_head_1;
        gpu.argmax_split = opts.tuning.argmax_split;
        gpu.tma_96 = opts.tuning.tma_96;
        if opts.tuning.attention_transpose {
            gpu.att_flags |= abi::ATT_FLAG_TRANSPOSE as i32;
        }
        gpu.att_pack = opts.tuning.attention_pack;
        gpu.attention_heads = opts.tuning.attention_heads;
        gpu.moe_route_fused &= opts.tuning.moe_route_fused;
        gpu.attn_in_head &= opts.tuning.attn_in_head;
        gpu.moe_mma = opts.tuning.moe_mma;
        gpu.hopper_gemm &= opts.tuning.hopper_gemm;
        gpu.tma_gemm &= gpu.hopper_gemm && opts.tuning.tma_gemm;
        gpu.wq_gemm &= gpu.hopper_gemm && opts.tuning.tma_gemm;
        gpu.wn_gemm &= gpu.wq_gemm && opts.tuning.narrow_gemm;
        gpu.moe_wg &= gpu.hopper_gemm && opts.tuning.moe_wgmma;
        let w = ModelWeights::load(&gpu, &d, formats, config, weights, opts.slot_capacity)?;
        // at most one output per sequence (= slot) of a chunk, or 1 + max_drafts verifying
        let b = Bufs::new(&gpu, opts.max_step_tokens, opts.outputs())?;
        let gemm = GemmPath::new(&gpu, opts.max_step_tokens)?;
        let mask_stage = gpu.host_write(
            forward::mask_words(opts.outputs(), d.vocab),
            opts.tuning.mask_zero_copy,
        )?;
        let out_stage = if opts.tuning.run_ahead {
            Some(gpu.host_stage(2 * opts.outputs())?)
        } else {
            None
        };
        // the KV pool last: it takes what the weights and buffers left
        let shape = (opts.slots, crate::blocks_for(opts.slot_capacity));
        let dtype = spec.quant.kv_dtype();
        let blocks = kv::pool_blocks(&gpu, &d, dtype, shape, opts.kv_blocks, opts.memory_fraction)?;
        let kv = KvCache::new(&gpu, dtype, blocks, shape)?;
        let decode1 = if opts.tuning.persistent_decode {
            let ptrs: Vec<_> = w.layers.iter().map(|l| l.ptrs()).collect();
            let [len, max] = spec.hardware.decode_split.ok_or_else(|| {
                BackendError::Model(format!(
                    "target {}: HARDWARE.toml has no decode_split",
                    set.target
                ))
            })?;
            let head = w.head();
            let base = abi::DecodeOne {
                emb_qs: w.emb.qs.ptr,
                emb_sc: w.emb.sc_ptr(),
                head_qs: head.qs.ptr,
                head_sc: head.sc_ptr(),
                out_norm: w.out_norm.ptr,
                rope: w.rope.ptr,
                kc: kv.kc.ptr,
                vc: kv.vc.ptr,
                tables: kv.tables.ptr,
                max_blocks: kv.max_blocks as i32,
                logits: b.logits.ptr,
                part: b.lm_part.ptr,
                counter: b.lm_counter.ptr,
                out_tok: b.out_tok,
                out_logprob: b.out_lp,
                ..abi::DecodeOne::default()
            };
            Decode1::new(&gpu, &ptrs, (len as usize, max as usize), base)?
        } else {
            None
        };
        let out_norm = weights::host_vec(weights, "output_norm.weight", d.hidden)?;
        Ok(CudaBackend {
            gpu,
            opts,
            norm_eps: config.norm_eps,
            out_norm,
            target: set.target.clone(),
            w,
            b,
            kv,
            graphs: HashMap::new(),
            gemm,
            decode1,
            last_decode1: None,
            ahead: None,
            out_stage,
            mask_stage,
            last_key: None,
            stats: Stats::default(),
        })
    }

    /// The backend of this binary: the embedded, attestation-checked kernels
    /// (`metrale_kernels::registry()`), the target's shape and quant, and `model`'s weights.
    pub fn from_registry(
        model: &metrale_model::Model,
        opts: CudaOptions,
    ) -> Result<CudaBackend, BackendError> {
        let set = KernelSet::from_registry(metrale_kernels::registry())?;
        CudaBackend::new(&set, &model.config, &model.weights, opts)
    }

    /// The device layer (tests and benchmarks).
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// One line for the server's start-up log: which decode paths run, with their choices.
    pub fn decode_summary(&self) -> String {
        let one = match &self.decode1 {
            Some(k) => format!(
                "one sequence: persistent decode_1 ({} blocks, splits {:?}), run-ahead {}",
                k.blocks,
                k.split,
                if self.opts.tuning.run_ahead {
                    "on"
                } else {
                    "off"
                }
            ),
            None => "one sequence: per-stage kernels".into(),
        };
        let many = if self.opts.tuning.graphs {
            "CUDA graphs"
        } else {
            "direct launches"
        };
        let gemm = if self.opts.tuning.decode_gemm {
            format!(
                ", tensor-core GEMMs ({}) from {} sequences",
                if self.gemm.hopper() && self.gpu.weights_bf16() {
                    "wgmma, bf16 activations"
                } else if self.gemm.hopper() {
                    "wgmma, f16 activations, weights dequantised in registers"
                } else {
                    "mma.sync"
                },
                gemm::gemm_from(&self.gpu.dims, self.gemm.hopper())
            )
        } else {
            String::new()
        };
        format!(
            "decode: {one}; several sequences: per-stage kernels{gemm}, {many} (kernels loaded from {}, {})",
            self.gpu.loaded_from(),
            self.target
        )
    }

    /// The persistent decode kernel's launch for one sequence's decode step.
    fn launch_decode1(&mut self, s: Step) -> Result<(), BackendError> {
        let k = self.decode1.as_mut().expect("checked by the caller");
        k.launch(&self.gpu, s, false)?;
        self.last_decode1 = Some(s);
        self.stats.decode1_launches += 1;
        Ok(())
    }

    /// Refuse a batch this backend cannot run (`crate::validate_batch`), then mirror its block
    /// tables, in stream order before any launch of the step.
    fn admit_batch(&mut self, batch: &[SeqStep<'_>]) -> Result<(), BackendError> {
        crate::validate_batch(
            batch,
            self.opts.slots,
            self.opts.slot_capacity,
            self.kv.blocks,
            self.gpu.dims.vocab,
        )?;
        if let Some((i, s)) = batch
            .iter()
            .enumerate()
            .find(|(_, s)| s.drafted > self.opts.max_drafts)
        {
            return Err(BackendError::Invalid(format!(
                "entry {i}: {} proposed tokens, more than the {} this backend was started to \
                 verify (CudaOptions::max_drafts)",
                s.drafted, self.opts.max_drafts
            )));
        }
        for s in batch {
            self.kv.sync(&self.gpu, s.slot, s.blocks)?;
        }
        Ok(())
    }

    /// Run one chunk: write inputs, launch (the persistent kernel for one sequence's decode step, a
    /// graph for other decode chunks), without waiting.
    fn run_chunk(
        &mut self,
        tokens: &[i32],
        pos: &[i32],
        slot: &[i32],
        sel: &[i32],
        decode: bool,
    ) -> Result<(), BackendError> {
        let ntok = tokens.len();
        let nout = sel.len();
        if decode && ntok == 1 && nout == 1 && self.decode1.is_some() {
            self.last_key = None;
            return self.launch_decode1(Step {
                token: tokens[0],
                pos: pos[0],
                slot: slot[0],
            });
        }
        self.last_decode1 = None;
        let max_len = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
        let nsplit = plan::step_splits(
            max_len,
            self.gpu.dims.kv_heads,
            ntok,
            self.gpu.sm_count,
            self.opts.tuning.attention_one_split,
        );
        // one stream-ordered copy of all inputs (no wait: the graph/kernels follow in stream order)
        let t = self.opts.max_step_tokens;
        let slots = self.opts.outputs();
        let mut io = vec![0i32; forward::io_words(t, slots)];
        io[..ntok].copy_from_slice(tokens);
        io[t..t + ntok].copy_from_slice(pos);
        io[2 * t..2 * t + ntok].copy_from_slice(slot);
        io[3 * t..3 * t + nout].copy_from_slice(sel);
        // prompt chunks (and with `flash_decode` decode steps of several sequences): flash
        // attention over query tiles of one sequence each
        let flash = !decode || (self.opts.tuning.flash_decode && ntok > 1);
        let attn = if flash && self.gpu.flash_attention && self.opts.tuning.flash_attention {
            let d = &self.gpu.dims;
            let tok = abi::layout::flash_tokens(d.heads / d.kv_heads);
            let tiles = plan::flash_tiles(pos, slot, tok);
            io[3 * t + slots..][..tiles.len()].copy_from_slice(&tiles);
            Attn::Flash(tiles.len() / 2)
        } else {
            Attn::Split(nsplit)
        };
        self.gpu.write_async(&self.b.io_in, 0, &io)?;
        self.last_key = Some((ntok, nout, attn));
        // long chunks take the tensor-core GEMM path; decode steps too unless tuned off
        let narrow_one = ntok == 1 && self.opts.tuning.narrow_one && self.gpu.wn_gemm;
        let gemm = (gemm::gemm_pays_on(&self.gpu.dims, ntok, self.gemm.hopper()) || narrow_one)
            && (!decode || self.opts.tuning.decode_gemm);
        if decode && self.opts.tuning.graphs {
            let key = (ntok, nout, attn);
            if !self.graphs.contains_key(&key) {
                let before = self.gpu.launches.get();
                self.gpu.begin_capture()?;
                let r = self.enqueue(ntok, nout, attn, gemm);
                let graph = self.gpu.end_capture();
                r?;
                self.graphs.insert(key, graph?);
                self.stats.graph_captures += 1;
                self.stats.last_graph_kernels = self.gpu.launches.get() - before;
            }
            self.gpu.replay(&self.graphs[&key])?;
            self.stats.graph_launches += 1;
        } else {
            self.enqueue(ntok, nout, attn, gemm)?;
            self.stats.direct_steps += 1;
        }
        Ok(())
    }

    /// One sequence's greedy decode step by `decode_1` with run-ahead (module docs): launch it unless
    /// `ahead` already did; for a constrained sequence, take its grammar mask from `mask` (asked
    /// while the device runs the step) and replace the kernel's pick by the arg-max of the masked
    /// row, in place; copy the pick back in stream order, enqueue the next step, then wait for the
    /// copy only.
    fn greedy_decode1(
        &mut self,
        s: &SeqStep<'_>,
        ahead: Option<(i32, i32, u32)>,
        mask: Option<&mut dyn crate::MaskSource>,
    ) -> Result<SeqOutput, BackendError> {
        let (token, pos, slot) = (s.tokens[0], s.start_pos as i32, s.slot as i32);
        if ahead == Some((slot, pos, token)) {
            self.stats.run_ahead_hits += 1;
        } else {
            self.launch_decode1(Step {
                token: token as i32,
                pos,
                slot,
            })?;
        }
        let lazy_mask = mask.and_then(|m| m.mask(0));
        if let Some(m) = lazy_mask.as_deref().or(s.allowed) {
            self.masked_pick(m, (self.b.out_tok, self.b.out_lp))?;
        }
        let stage = self.out_stage.as_mut().expect("checked by the caller");
        self.gpu.read_staged(&self.b.io_out, stage)?;
        self.last_key = None;
        // the next position must be in this sequence's own table (module docs)
        let run_ahead = s.start_pos + 2 <= self.opts.slot_capacity
            && s.blocks.len().min(self.kv.max_blocks) * KV_BLOCK >= s.start_pos + 2;
        if run_ahead {
            self.launch_decode1(Step {
                token: Step::FROM_DEVICE,
                pos: pos + 1,
                slot,
            })?;
            self.stats.run_ahead_launches += 1;
        }
        let out = self
            .out_stage
            .as_ref()
            .expect("checked by the caller")
            .wait()?;
        let (tok, lp) = (out[0] as i32, f32::from_bits(out[self.opts.outputs()]));
        if tok == abi::DECODE_REFUSED {
            return Err(BackendError::Device(DECODE1_REFUSED.into()));
        }
        if run_ahead {
            self.ahead = Some((slot, pos + 1, tok as u32));
        }
        Ok(SeqOutput {
            token: tok as u32,
            logprob: lp,
            top_logprobs: Vec::new(),
            logits: None,
            accepted: Vec::new(),
        })
    }

    /// Run chunk `c` (`run_chunk`), ask the grammar masks of its lazy entries while the device
    /// runs it, collect its outputs, and empty it.
    fn run_and_collect(
        &mut self,
        c: &mut Chunk,
        batch: &[SeqStep<'_>],
        decode: bool,
        outputs: &mut [Option<SeqOutput>],
        (lazy, masks): (&[bool], &mut dyn crate::MaskSource),
    ) -> Result<(), BackendError> {
        self.run_chunk(&c.tokens, &c.pos, &c.slot, &c.sel, decode)?;
        // the device runs the chunk while the host computes its grammar masks
        let chunk_masks: Vec<Option<Vec<u32>>> = c
            .sel_seq
            .iter()
            .map(|&i| match lazy.get(i) == Some(&true) {
                true => masks.mask(i),
                false => None,
            })
            .collect();
        self.collect(batch, &c.sel_seq, outputs, (&chunk_masks, lazy))?;
        c.clear();
        Ok(())
    }

    /// Enqueue the grammar masks of a chunk's `n` outputs (`mask_of(k)`: output k's mask, if any)
    /// and `mask_logits` over their logits rows.
    fn mask_rows<'m>(
        &mut self,
        n: usize,
        mask_of: impl Fn(usize) -> Option<&'m [u32]>,
    ) -> Result<(), BackendError> {
        let (rows, masks) = self.stage_masks(n, mask_of)?;
        self.gpu.mask_logits(abi::MaskLogits {
            logits: self.b.logits.ptr,
            masks,
            rows,
            nout: n as i32,
        })
    }

    /// Write the masks of `n` outputs to the stage (each output's mask row or -1, then the rows)
    /// and return where the device reads them (rows, masks): the stage itself when mapped
    /// (`Tuning::mask_zero_copy`), else `b.masks` after one staged copy (the host does not wait
    /// for the step running on the device). A mask shorter than the row disallows the rest (as
    /// `sampler::apply_mask`). Every caller waits for a later point of the stream before the next
    /// call refills the stage.
    fn stage_masks<'m>(
        &mut self,
        n: usize,
        mask_of: impl Fn(usize) -> Option<&'m [u32]>,
    ) -> Result<(u64, u64), BackendError> {
        let words = self.gpu.dims.vocab.div_ceil(32);
        let st = self.mask_stage.words()?;
        let mut next = n;
        for k in 0..n {
            st[k] = match mask_of(k) {
                None => -1i32 as u32,
                Some(m) => {
                    let row = (next - n) / words;
                    let take = m.len().min(words);
                    st[next..next + take].copy_from_slice(&m[..take]);
                    st[next + take..next + words].fill(0);
                    next += words;
                    row as u32
                }
            };
        }
        let base = match self.mask_stage.device_ptr() {
            Some(p) => {
                // the words are in host memory the device reads: stores before the launch
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                p
            }
            None => {
                self.gpu
                    .write_staged(&self.b.masks, &self.mask_stage, next)?;
                self.b.masks.ptr
            }
        };
        Ok((base, base + (n * 4) as u64))
    }

    /// The arg-max and logprob of logits row 0 under `mask` (`argmax_masked_1`, one launch over
    /// the row's blocks, the LM head's partials and ticket) to `out` (token, logprob addresses);
    /// the row itself stays unmasked. One sequence's step writes it over the kernel's pick
    /// (`out_tok[0]`, `out_lp[0]`), where the copy back and a run-ahead launch read it.
    fn masked_pick(&mut self, mask: &[u32], out: (u64, u64)) -> Result<(), BackendError> {
        let (_, masks) = self.stage_masks(1, |_| Some(mask))?;
        let blocks = plan::row_blocks(self.gpu.dims.vocab) as usize;
        if blocks * abi::ACC_BYTES as usize > self.b.lm_part.bytes {
            return Err(BackendError::Device(format!(
                "argmax_masked_1: {blocks} partials do not fit the LM head's {} bytes",
                self.b.lm_part.bytes
            )));
        }
        self.gpu.argmax_masked_1(abi::ArgmaxMaskedOne {
            logits: self.b.logits.ptr,
            masks,
            part: self.b.lm_part.ptr,
            counter: self.b.lm_counter.ptr,
            out_tok: out.0,
            out_logprob: out.1,
        })
    }

    /// Turn the device outputs of a chunk into `SeqOutput`s for the sequences it finished.
    /// `masks[k]`: the grammar mask of output `k` asked on demand (`Backend::step_masked`), which
    /// `lazy` flags by batch entry. Constrained rows (those and entries with `allowed`) are masked
    /// on the device (`mask_logits`), then take the arg-max of the masked row or `sample_probs`
    /// like any other row: only ids and logprobs cross to the host unless a row needs the host.
    fn collect(
        &mut self,
        batch: &[SeqStep<'_>],
        sel_seq: &[usize],
        outputs: &mut [Option<SeqOutput>],
        (masks, lazy): (&[Option<Vec<u32>>], &[bool]),
    ) -> Result<(), BackendError> {
        let n = sel_seq.len();
        if n == 0 {
            return Ok(());
        }
        let nout = self.opts.outputs();
        let vocab = self.gpu.dims.vocab;
        let mask_of = |k: usize, i: usize| -> Option<&[u32]> {
            let lazy_mask = if lazy.get(i) == Some(&true) {
                masks.get(k).and_then(|m| m.as_deref())
            } else {
                None
            };
            lazy_mask.or(batch[i].allowed)
        };
        let masked: Vec<bool> = sel_seq
            .iter()
            .enumerate()
            .map(|(k, &i)| mask_of(k, i).is_some())
            .collect();
        let mo = self.b.mask_out.ptr;
        let greedy_on_device = |i: usize| device_only(&batch[i]) && batch[i].sampling.is_greedy();
        match mask_of(0, sel_seq[0]) {
            // one greedy row: its masked arg-max in one launch (no other kernel reads the row)
            Some(m) if n == 1 && greedy_on_device(sel_seq[0]) => {
                self.masked_pick(m, (mo, mo + (nout * 4) as u64))?
            }
            _ if masked.contains(&true) => {
                self.mask_rows(n, |k| mask_of(k, sel_seq[k]))?;
                self.gpu.argmax(abi::ArgmaxLogprob {
                    logits: self.b.logits.ptr,
                    part: self.b.lm_part.ptr,
                    counter: self.b.lm_counter.ptr,
                    out_tok: mo,
                    out_logprob: mo + (nout * 4) as u64,
                    ntok: n as i32,
                })?;
            }
            _ => {}
        }
        // one copy back (it waits for the chunk's kernels)
        let mut io = vec![0u32; 2 * nout];
        self.gpu.read(&self.b.io_out, 0, &mut io)?;
        let tok: Vec<i32> = io[..n].iter().map(|&v| v as i32).collect();
        if tok[0] == abi::DECODE_REFUSED && self.last_decode1.is_some() {
            return Err(BackendError::Device(DECODE1_REFUSED.into()));
        }
        let lp: Vec<f32> = io[nout..nout + n]
            .iter()
            .map(|&v| f32::from_bits(v))
            .collect();
        let mut masked_pick = vec![0u32; 2 * nout];
        if masked.contains(&true) {
            self.gpu.read(&self.b.mask_out, 0, &mut masked_pick)?;
        }
        // temperature sampling on the device for the rows that need nothing else (one extra launch)
        let sampled = sel_seq.iter().any(|&i| {
            device_only(&batch[i]) && !batch[i].sampling.is_greedy() && batch[i].drafted == 0
        });
        let mut samp = vec![0u32; 3 * nout];
        if sampled {
            let params: Vec<abi::device::SampleParams> =
                sel_seq.iter().map(|&i| sample_params(&batch[i])).collect();
            self.gpu.write_async(&self.b.samp_params, 0, &params)?;
            let so = self.b.samp_out.ptr;
            self.gpu.sample_probs(abi::SampleProbs {
                logits: self.b.logits.ptr,
                params: self.b.samp_params.ptr,
                out_tok: so,
                out_logprob: so + (nout * 4) as u64,
                status: so + (2 * nout * 4) as u64,
                nout: n as i32,
            })?;
            self.gpu.read(&self.b.samp_out, 0, &mut samp)?;
        }
        let mut k = 0;
        while k < n {
            let i = sel_seq[k];
            let s = &batch[i];
            if s.drafted > 0 {
                let proposed = &s.tokens[s.tokens.len() - s.drafted..];
                let greedy_pick = |j: usize| sampler::Sampled {
                    token: tok[k + j] as u32,
                    logprob: lp[k + j],
                    top_logprobs: Vec::new(),
                };
                outputs[i] = Some(if device_only(s) && s.sampling.is_greedy() {
                    // greedy: a proposal is accepted while it is the position's arg-max
                    // (sampler::verify's greedy case), then the pick after the last accepted
                    let accepted: Vec<sampler::Sampled> = (0..s.drafted)
                        .map(greedy_pick)
                        .zip(proposed)
                        .take_while(|(p, &d)| p.token == d)
                        .map(|(p, _)| p)
                        .collect();
                    let next = greedy_pick(accepted.len());
                    SeqOutput {
                        token: next.token,
                        logprob: next.logprob,
                        top_logprobs: Vec::new(),
                        logits: None,
                        accepted,
                    }
                } else {
                    // anything else: the rows on the host, verified as the CPU backend does
                    let mut rows = vec![0f32; (s.drafted + 1) * vocab];
                    self.gpu.read(&self.b.logits, k * vocab * 4, &mut rows)?;
                    let (accepted, r) =
                        sampler::verify_run(&rows, vocab, s.sampling, s.history, s.draw, proposed);
                    SeqOutput {
                        token: r.token,
                        logprob: r.logprob,
                        top_logprobs: r.top_logprobs,
                        logits: s.want_logits.then_some(rows),
                        accepted,
                    }
                });
                k += s.drafted + 1;
                continue;
            }
            let device = device_only(s);
            let greedy = s.sampling.is_greedy();
            let pick = |t: u32, l: u32| SeqOutput {
                token: t,
                logprob: f32::from_bits(l),
                top_logprobs: Vec::new(),
                logits: None,
                accepted: Vec::new(),
            };
            let out = if device && greedy && masked[k] {
                pick(masked_pick[k], masked_pick[nout + k])
            } else if device && greedy {
                pick(tok[k] as u32, lp[k].to_bits())
            } else if device && sampled && samp[2 * nout + k] == 1 {
                pick(samp[k], samp[nout + k])
            } else {
                // the host sampler (the row is masked on the device already; masking again is
                // idempotent and covers a mask shorter than the row)
                let mut row = vec![0f32; vocab];
                self.gpu.read(&self.b.logits, k * vocab * 4, &mut row)?;
                if let Some(m) = mask_of(k, i) {
                    sampler::apply_mask(&mut row, m);
                }
                let r = sampler::sample(&row, s.sampling, s.history, s.draw);
                SeqOutput {
                    token: r.token,
                    logprob: r.logprob,
                    top_logprobs: r.top_logprobs,
                    logits: s.want_logits.then_some(row),
                    accepted: Vec::new(),
                }
            };
            outputs[i] = Some(out);
            k += 1;
        }
        Ok(())
    }
}

/// One chunk's inputs as `step_masked` packs them: each token's id, position and slot, the rows
/// that produce outputs (`sel`) and the batch entry of each (`sel_seq`: once per row, a
/// verification entry's `drafted + 1` rows in a run).
struct Chunk {
    tokens: Vec<i32>,
    pos: Vec<i32>,
    slot: Vec<i32>,
    sel: Vec<i32>,
    sel_seq: Vec<usize>,
}

impl Chunk {
    fn with_capacity(n: usize) -> Chunk {
        Chunk {
            tokens: Vec::with_capacity(n),
            pos: Vec::with_capacity(n),
            slot: Vec::with_capacity(n),
            sel: Vec::new(),
            sel_seq: Vec::new(),
        }
    }

    fn clear(&mut self) {
        self.tokens.clear();
        self.pos.clear();
        self.slot.clear();
        self.sel.clear();
        self.sel_seq.clear();
    }
}

/// Whether a request needs nothing the device does not do (a grammar mask it does): no logit
/// bias, no penalties, no logprob list, no logits. The others copy their logits row back and use
/// the host sampler.
fn device_only(s: &SeqStep<'_>) -> bool {
    let p = s.sampling;
    p.logit_bias.is_empty()
        && p.repetition_penalty == 1.0
        && p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
        && p.top_logprobs == 0
        && !s.want_logits
}

/// The device sampler's parameters for one request (`sample_probs`).
fn sample_params(s: &SeqStep<'_>) -> abi::device::SampleParams {
    let p = s.sampling;
    abi::device::SampleParams {
        temperature: if p.is_greedy() { 0.0 } else { p.temperature },
        top_p: p.top_p,
        min_p: p.min_p,
        top_k: p.top_k.min(i32::MAX as usize) as i32,
        seed: p.seed,
        draw: s.draw,
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> BackendInfo {
        let g = &self.gpu;
        BackendInfo {
            name: "cuda".into(),
            device: format!("{} (sm_{}{}, {} SMs)", g.name, g.cc.0, g.cc.1, g.sm_count),
            slots: self.opts.slots,
            slot_capacity: self.opts.slot_capacity,
            kv_blocks: self.kv.blocks,
            kv_dtype: self.kv.dtype,
            weight_bytes: self.w.bytes(),
            kv_bytes: self.kv.bytes(),
            verifies_drafts: self.opts.max_drafts > 0,
            // every step reads every weight once: a prompt takes as much of a step as it can
            prefill_chunk: None,
        }
    }

    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<SeqOutput>, BackendError> {
        self.step_masked(batch, &[], &mut crate::NoMasks)
    }

    /// The prompt chunks through the per-stage kernels with no output row (no LM head), then each
    /// token's residual stream read back and final-normed on the host (`numerics::rmsnorm`, the
    /// CPU reference's): a copy of `[tokens][hidden]` f32 per chunk, small beside the forward pass.
    fn hidden(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<HiddenSums>, BackendError> {
        self.admit_batch(batch)?;
        self.ahead = None; // a run-ahead decode_1 launch is spare work now (`release`)
        let h = self.gpu.dims.hidden;
        let mut out: Vec<HiddenSums> = batch
            .iter()
            .map(|s| HiddenSums {
                sum: vec![0f32; h],
                last: vec![0f32; h],
                tokens: s.tokens.len(),
            })
            .collect();
        let maxt = self.opts.max_step_tokens;
        let (mut tokens, mut pos, mut slot, mut owner) = (vec![], vec![], vec![], vec![]);
        let mut x = vec![0f32; maxt * h];
        let mut row = vec![0f32; h];
        let pieces = batch
            .iter()
            .enumerate()
            .flat_map(|(e, s)| s.tokens.iter().enumerate().map(move |(j, &t)| (e, j, t)));
        let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
        for (k, (e, j, t)) in pieces.enumerate() {
            tokens.push(t as i32);
            pos.push((batch[e].start_pos + j) as i32);
            slot.push(batch[e].slot as i32);
            owner.push((e, j + 1 == batch[e].tokens.len()));
            if tokens.len() < maxt && k + 1 < total {
                continue;
            }
            self.run_chunk(&tokens, &pos, &slot, &[], false)?;
            let n = tokens.len();
            self.gpu.read(&self.b.x, 0, &mut x[..n * h])?;
            for (r, &(e, last)) in owner.iter().enumerate() {
                crate::numerics::rmsnorm(
                    &x[r * h..(r + 1) * h],
                    &self.out_norm,
                    self.norm_eps,
                    &mut row,
                );
                for (a, b) in out[e].sum.iter_mut().zip(&row) {
                    *a += b;
                }
                if last {
                    out[e].last.copy_from_slice(&row);
                }
            }
            tokens.clear();
            pos.clear();
            slot.clear();
            owner.clear();
        }
        Ok(out)
    }

    fn release(&mut self, slot: SlotId) {
        if self.ahead.is_some_and(|a| a.0 == slot as i32) {
            self.ahead = None; // its launch is spare work now (module docs)
        }
        // The blocks are the engine's (its prefix caching hands full ones to later prompts; every
        // other entry is written before it is read): nothing to clear.
    }

    /// The masks of the entries `lazy` flags are asked after each chunk's forward pass is queued,
    /// so the host computes them while the device runs the chunk.
    fn step_masked(
        &mut self,
        batch: &[SeqStep<'_>],
        lazy: &[bool],
        masks: &mut dyn crate::MaskSource,
    ) -> Result<Vec<SeqOutput>, BackendError> {
        let is_lazy = |i: usize| lazy.get(i) == Some(&true);
        self.admit_batch(batch)?;
        let ahead = self.ahead.take();
        if let [s] = batch {
            if s.tokens.len() == 1
                && s.sampling.is_greedy()
                && device_only(s)
                && self.decode1.is_some()
                && self.out_stage.is_some()
            {
                let mask = is_lazy(0).then_some(masks);
                return Ok(vec![self.greedy_decode1(s, ahead, mask)?]);
            }
        }
        // decode-like: every entry one token, or one and its proposals (a verification step runs
        // its tokens as decode tokens of one sequence each: the split-K attention, a graph)
        let decode = batch.iter().all(|s| s.tokens.len() == 1 + s.drafted);
        let maxt = self.opts.max_step_tokens;
        if let Some((i, s)) = batch
            .iter()
            .enumerate()
            .find(|(_, s)| s.drafted > 0 && s.tokens.len() > maxt)
        {
            return Err(BackendError::Invalid(format!(
                "entry {i}: a verification entry of {} tokens is longer than a chunk ({maxt})",
                s.tokens.len()
            )));
        }
        let mut outputs: Vec<Option<SeqOutput>> = vec![None; batch.len()];
        // Pack (sequence, token range) pieces into chunks of at most max_step_tokens tokens; a
        // verification entry's output rows (its last `drafted + 1` positions) are one chunk's, so
        // it starts a new chunk where it does not fit whole.
        let mut c = Chunk::with_capacity(maxt);
        let mut pending: Vec<(usize, usize)> =
            batch.iter().enumerate().map(|(i, _)| (i, 0)).collect();
        pending.reverse();
        while let Some((i, from)) = pending.pop() {
            let s = &batch[i];
            let room = maxt - c.tokens.len();
            if s.drafted > 0 && s.tokens.len() - from > room {
                pending.push((i, from));
                self.run_and_collect(&mut c, batch, decode, &mut outputs, (lazy, &mut *masks))?;
                continue;
            }
            let take = (s.tokens.len() - from).min(room);
            for j in from..from + take {
                c.tokens.push(s.tokens[j] as i32);
                c.pos.push((s.start_pos + j) as i32);
                c.slot.push(s.slot as i32);
            }
            if from + take == s.tokens.len() {
                let last = c.tokens.len() as i32 - 1;
                for r in (0..=s.drafted as i32).rev() {
                    c.sel.push(last - r);
                    c.sel_seq.push(i);
                }
            } else {
                pending.push((i, from + take));
            }
            if c.tokens.len() == maxt || pending.is_empty() {
                self.run_and_collect(&mut c, batch, decode, &mut outputs, (lazy, &mut *masks))?;
            }
        }
        Ok(outputs
            .into_iter()
            .map(|o| o.expect("every sequence's last token was in a chunk"))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_kernel_set_matches_the_build() {
        let reg = metrale_kernels::registry();
        match KernelSet::from_registry(reg) {
            // a generic build embeds no kernels: refused with the command to run
            Err(e) => {
                assert!(
                    reg.target.is_none()
                        || reg
                            .target
                            .as_ref()
                            .is_some_and(|t| t.hardware.cubin_arch.is_none()),
                    "{e}"
                );
                assert!(e.to_string().contains("build"), "{e}");
            }
            Ok(set) => {
                assert_eq!(set.blobs.len(), metrale_abi::templates().len());
                assert!(set.blobs.values().all(|b| !b.cubin.is_empty()));
                assert_eq!(Some(set.arch.clone()), set.spec.hardware.cubin_arch);
            }
        }
    }

    #[test]
    fn tuning_defaults_are_the_measured_choices_and_parse_names_bad_keys() {
        let t = Tuning::default();
        assert!(t.persistent_decode && t.run_ahead && t.graphs);
        assert_eq!(t.parse("").unwrap(), t);
        let off = t.parse("run_ahead=off, graphs=0").unwrap();
        assert!(!off.run_ahead && !off.graphs && off.persistent_decode);
        assert!(t
            .parse("run_ahaed=off")
            .unwrap_err()
            .contains("unknown key `run_ahaed`; the keys are persistent_decode"));
        assert!(t.parse("graphs=maybe").unwrap_err().contains("on or off"));
        let bisect = t
            .parse("pdl=off,attention_cluster=off,lm_head_1=off")
            .unwrap();
        assert!(!bisect.pdl && !bisect.attention_cluster && !bisect.lm_head_1 && bisect.graphs);
        assert!(t.decode_gemm && t.pdl && t.attention_cluster && t.lm_head_1 && t.mask_zero_copy);
        assert!(t.parse("graphs").unwrap_err().contains("key=on|off"));
    }
}
