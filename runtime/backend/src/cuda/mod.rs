//! The CUDA backend (feature `cuda`): runs the Llama forward pass of one target with that target's
//! compiled kernels (kernels/cuda/*.cu.hbs) through cudarc.
//!
//! Owns: the device copies of the weights (repacked once at load into the layouts of
//! kernels/cuda/common.cuh: Q4_1 nibbles and (d, m) pairs split, Q8_0 int8 and scales split, q/k/v
//! stacked, gate/up interleaved), the f32 KV cache `[slot][layer][kv_head][pos][head_dim]`, the
//! activation buffers (allocated once for `max_step_tokens`), the decode CUDA graphs, and the
//! per-step launch sequence: `embed`, then per layer `attn_in` (RMSNorm+QKV+RoPE+KV write),
//! `attention` (split-K GQA; the last split block combines, or rank 0 of a thread-block cluster), `attn_out` (O-proj+residual),
//! `ffn_in` (RMSNorm+gate/up+SiLU), `ffn_out` (down+residual), then `lm_head` (final norm + LM head
//! on each sequence's last token, with the greedy token and its logprob reduced in the same launch):
//! 2 + 5 x layers launches per step, with programmatic dependent launch on sm_90 (see gpu.rs).
//! Chunks that are not pure decode and hold at least `gemm::MIN_TOKENS` tokens run the four layer
//! products as tensor-core GEMMs with fused epilogues instead (`gemm.rs`, kernels/cuda/gemm.cu.hbs);
//! shorter ones reuse the decode kernels over token tiles (causal attention through per-token
//! positions on both paths).
//! Entry points: [`CudaBackend::from_registry`] (a built binary: embedded, attestation-checked
//! kernels) and [`CudaBackend::new`] (any [`KernelSet`], e.g. a dist/ folder, for tests and tools).
//! RoPE scaling (llama3, linear, GGUF `rope_freqs`) is applied through the host cos/sin table, built
//! from the CPU backend's inverse frequencies (`cpu::model_inv_freq`), so both backends rotate alike.
//! Not here: a tensor-core prefill attention, a persistent kernel for batched decode (bench/cuda/NOTES.md).
//!
//! Invariants:
//! - Nothing is allocated on the device after `CudaBackend::new`; a step larger than
//!   `max_step_tokens` runs as several chunks in order.
//! - A pure decode step of one sequence is one launch of the persistent `decode_1` kernel
//!   (`decode.rs`; its inputs are kernel arguments) unless `CudaOptions::persistent_decode` is off.
//! - Run-ahead (`CudaOptions::run_ahead`, off by default until measured): when such a step's token is the device's greedy pick, the
//!   next step (position + 1, its token read on the device from this step's pick) is enqueued
//!   before the host waits for this one, so the host's and the engine's work between tokens overlap
//!   the GPU's. When the engine's next call is exactly that step, it only collects it; otherwise the
//!   run-ahead launch was spare work whose only writes are the scratch outputs and the KV entry at
//!   that position, which every later step writes before it reads it.
//! - A pure decode step (every sequence one token) of `n` sequences otherwise replays a graph captured
//!   for (n, attention splits); inputs reach the graph only through the fixed token/pos/slot/sel buffers.
//! - Requests without penalties, logit bias or logprob lists are sampled on the device: greedy inside
//!   `lm_head` (or `decode_1`),
//!   temperature / top-k / top-p / min-p with the seed by `sample_probs`, which reproduces
//!   `crate::sampler::sample` exactly (same candidate order, same f64 walk, same SplitMix64 draw);
//!   only ids and logprobs cross back. Penalties, logit bias, logprob lists, logits requests and rows with more
//!   than 2048 candidates copy their logits row back and use the host sampler itself.

pub mod decode;
pub mod gemm;
pub mod gpu;
pub mod plan;

use std::collections::HashMap;

use cudarc::driver::CudaGraph;
use metrale_core::BackendError;
use metrale_model::{ModelConfig, Weights};

use crate::{sampler, Backend, BackendInfo, SeqOutput, SeqStep, SlotId};
pub use gpu::{device_count, Dims, Gpu, KernelBlob, KernelSet, SampleParams, KERNELS};
use gpu::{DevBuf, DevMat};
use plan::{DevFormat, HostMat};

/// How to size the backend.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// KV-cache slots (concurrent sequences).
    pub slots: usize,
    /// Tokens per slot.
    pub slot_capacity: usize,
    /// Most tokens one launch sequence processes (prefill chunks are split to this).
    pub max_step_tokens: usize,
    /// Capture and replay CUDA graphs for decode steps.
    pub graphs: bool,
    /// Run one sequence's decode steps with the persistent `decode_1` kernel (`decode.rs`); default
    /// on unless `METRALE_CUDA_DECODE1=0`.
    pub persistent_decode: bool,
    /// Enqueue the next greedy `decode_1` step before waiting for this one (module docs). Off by
    /// default until it has been measured on a GPU (bench/cuda/NOTES.md, session 3);
    /// `METRALE_CUDA_RUN_AHEAD=1` turns it on.
    pub run_ahead: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            slots: 8,
            slot_capacity: 4096,
            max_step_tokens: 512,
            graphs: true,
            persistent_decode: decode::enabled(),
            run_ahead: std::env::var("METRALE_CUDA_RUN_AHEAD").is_ok_and(|v| v == "1"),
        }
    }
}

struct LayerW {
    attn_norm: DevBuf,
    wqkv: DevMat,
    wo: DevMat,
    ffn_norm: DevBuf,
    wgu: DevMat,
    wdown: DevMat,
}

/// Activation and I/O buffers, sized once.
struct Bufs {
    x: DevBuf,
    q: DevBuf,
    h: DevBuf,
    part_ml: DevBuf,
    part_acc: DevBuf,
    /// attention output `[maxt][qd]` and the split-combine tickets `[maxt][kv_heads]` (zero between launches)
    att: DevBuf,
    att_counter: DevBuf,
    logits: DevBuf,
    /// i32 inputs, one copy per chunk: tokens[maxt] | pos[maxt] | slot[maxt] | sel[slots]
    io_in: DevBuf,
    tokens: u64,
    pos: u64,
    slot: u64,
    sel: u64,
    /// outputs, one copy back: out_tok[slots] (i32) | out_lp[slots] (f32)
    io_out: DevBuf,
    out_tok: u64,
    out_lp: u64,
    /// lm_head's per-block greedy partials and its per-tile tickets (zero between launches)
    lm_part: DevBuf,
    lm_counter: DevBuf,
    /// sample_probs: parameters in, (token | logprob | status) out, one row per output
    samp_params: DevBuf,
    samp_out: DevBuf,
    kc: DevBuf,
    vc: DevBuf,
}

/// The CUDA backend of one target.
pub struct CudaBackend {
    gpu: Gpu,
    opts: CudaOptions,
    emb: DevMat,
    /// `None` when the LM head is tied to the embedding.
    out: Option<DevMat>,
    out_norm: DevBuf,
    /// (cos, sin) per position and pair: `plan::rope_table`
    rope: DevBuf,
    layers: Vec<LayerW>,
    b: Bufs,
    graphs: HashMap<(usize, usize), CudaGraph>,
    /// Tensor-core prefill kernels (`None` when `METRALE_CUDA_GEMM=0`).
    prefill: Option<gemm::Prefill>,
    /// The persistent batch-1 decode kernel (`None` when `METRALE_CUDA_DECODE1=0` or the device
    /// cannot run it).
    decode1: Option<decode::Decode1>,
    /// Inputs of the last `decode_1` launch (benchmarks replay it).
    last_decode1: Option<decode::Step>,
    /// The run-ahead `decode_1` launch in the stream, if any: its (slot, position) and the token it
    /// reads on the device (the pick of the step before it).
    ahead: Option<(i32, i32, u32)>,
    /// Page-locked copy of `io_out` for run-ahead steps, which do not wait for the whole stream
    /// (`Some` when `opts.run_ahead`).
    out_stage: Option<gpu::HostStage>,
    /// (tokens, splits) of the last chunk run
    last_key: Option<(usize, usize)>,
    weight_bytes: u64,
    kv_bytes: u64,
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
}

// SAFETY: the backend is used by one thread at a time (`&mut self`); cudarc binds the context to the
// calling thread before every driver call, and the graphs are only touched through `&mut self`.
unsafe impl Send for CudaBackend {}

const DECODE1_REFUSED: &str = "decode_1 refused to run: its dynamic shared memory is smaller than the kernel's layout (runtime/backend/src/cuda/decode.rs disagrees with kernels/cuda/decode.cu.hbs)";

fn model_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Model(e.to_string())
}

/// The launches of a chunk's forward pass: the embedding, five per layer, the LM head.
#[derive(Debug, Clone, Copy)]
enum Stage {
    Embed,
    /// RMSNorm + QKV + RoPE + KV write
    Qkv,
    Attention,
    /// O projection + residual
    Out,
    /// RMSNorm + gate/up + SiLU
    GateUp,
    /// down projection + residual
    Down,
    LmHead,
}

impl Stage {
    /// A layer's stages in order.
    const LAYER: [Stage; 5] = [
        Stage::Qkv,
        Stage::Attention,
        Stage::Out,
        Stage::GateUp,
        Stage::Down,
    ];
}

/// Refuse a checkpoint whose shape is not the one the kernels were compiled for.
fn check_config(c: &ModelConfig, d: &Dims, target: &str) -> Result<(), BackendError> {
    let pairs = [
        ("layers", c.n_layers, d.layers),
        ("hidden", c.hidden, d.hidden),
        ("heads", c.n_heads, d.heads),
        ("kv_heads", c.n_kv_heads, d.kv_heads),
        ("head_dim", c.head_dim, d.head_dim),
        ("ffn", c.ffn, d.ffn),
        ("vocab", c.vocab, d.vocab),
    ];
    for (field, got, want) in pairs {
        if got != want {
            return Err(BackendError::Model(format!(
                "model {}: {field} is {got}, but this binary's kernels ({target}) are compiled for {want}; build the target for this model",
                c.name
            )));
        }
    }
    Ok(())
}

/// A weight matrix from `weights`, checked to be `rows` x `k`, repacked to `fmt`.
fn host_mat(
    w: &Weights,
    name: &str,
    fmt: DevFormat,
    rows: usize,
    k: usize,
) -> Result<HostMat, BackendError> {
    let t = w.get(name).map_err(model_err)?;
    if t.row_len() != k || t.n_rows() != rows {
        return Err(BackendError::Model(format!(
            "tensor {name}: expected {rows} rows of {k}, got {} rows of {}",
            t.n_rows(),
            t.row_len()
        )));
    }
    HostMat::repack(name, fmt, t.dtype, rows, k, t.data).map_err(model_err)
}

fn host_vec(w: &Weights, name: &str, n: usize) -> Result<Vec<f32>, BackendError> {
    let t = w.get(name).map_err(model_err)?;
    if t.n_elems() != n {
        return Err(BackendError::Model(format!(
            "tensor {name}: expected {n} elements, got {}",
            t.n_elems()
        )));
    }
    Ok(t.to_f32())
}

impl CudaBackend {
    /// Load `weights` (checked against `config` and the kernels' shape) onto device `opts.device`.
    pub fn new(
        set: &KernelSet,
        dims: Dims,
        weights_fmt: &str,
        embedding_fmt: &str,
        config: &ModelConfig,
        weights: &Weights,
        opts: CudaOptions,
    ) -> Result<CudaBackend, BackendError> {
        check_config(config, &dims, &set.target)?;
        let wf = DevFormat::from_quant_name(weights_fmt).ok_or_else(|| {
            BackendError::Model(format!("unknown weights format {weights_fmt:?}"))
        })?;
        let ef = DevFormat::from_quant_name(embedding_fmt).ok_or_else(|| {
            BackendError::Model(format!("unknown embedding format {embedding_fmt:?}"))
        })?;
        if opts.slots == 0 || opts.slot_capacity == 0 || opts.max_step_tokens == 0 {
            return Err(BackendError::Invalid(
                "slots, slot capacity and max step tokens must be positive".into(),
            ));
        }
        let gpu = Gpu::open(opts.device, set, dims)?;
        let d = dims;
        let (hd, qd, kd) = (d.hidden, d.qd(), d.kd());

        let emb = DevMat::upload(
            &gpu,
            &host_mat(weights, "token_embd.weight", ef, d.vocab, hd)?,
        )?;
        let out = if weights.contains("output.weight") {
            Some(DevMat::upload(
                &gpu,
                &host_mat(weights, "output.weight", ef, d.vocab, hd)?,
            )?)
        } else {
            None
        };
        let out_norm = gpu.upload(&host_vec(weights, "output_norm.weight", hd)?)?;
        // RoPE scaling (llama3, linear, GGUF rope_freqs) lives in the host table, from the CPU backend's frequencies
        let inv_freq = crate::cpu::model_inv_freq(config, d.head_dim, || {
            host_vec(weights, "rope_freqs.weight", d.head_dim / 2)
        })?;
        let rope = gpu.upload(&plan::rope_table(&inv_freq, opts.slot_capacity))?;
        let mut layers = Vec::with_capacity(d.layers);
        for l in 0..d.layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let wq = host_mat(weights, &n("attn_q"), wf, qd, hd)?;
            let wk = host_mat(weights, &n("attn_k"), wf, kd, hd)?;
            let wv = host_mat(weights, &n("attn_v"), wf, kd, hd)?;
            let wqkv = HostMat::concat_rows(&n("attn_qkv"), &[wq, wk, wv]).map_err(model_err)?;
            let wo = host_mat(weights, &n("attn_output"), wf, hd, qd)?;
            let wg = host_mat(weights, &n("ffn_gate"), wf, d.ffn, hd)?;
            let wu = host_mat(weights, &n("ffn_up"), wf, d.ffn, hd)?;
            let wgu = HostMat::interleave_rows(&n("ffn_gate_up"), &wg, &wu).map_err(model_err)?;
            let wdown = host_mat(weights, &n("ffn_down"), wf, hd, d.ffn)?;
            layers.push(LayerW {
                attn_norm: gpu.upload(&host_vec(weights, &n("attn_norm"), hd)?)?,
                wqkv: DevMat::upload(&gpu, &wqkv)?,
                wo: DevMat::upload(&gpu, &wo)?,
                ffn_norm: gpu.upload(&host_vec(weights, &n("ffn_norm"), hd)?)?,
                wgu: DevMat::upload(&gpu, &wgu)?,
                wdown: DevMat::upload(&gpu, &wdown)?,
            });
        }
        let mut weight_bytes =
            (emb.bytes() + out.as_ref().map(|m| m.bytes()).unwrap_or(0) + out_norm.bytes) as u64;
        for l in &layers {
            weight_bytes += (l.attn_norm.bytes
                + l.wqkv.bytes()
                + l.wo.bytes()
                + l.ffn_norm.bytes
                + l.wgu.bytes()
                + l.wdown.bytes()) as u64;
        }

        let t = opts.max_step_tokens;
        let nout = opts.slots; // at most one output per sequence (= slot) of a chunk
        let kv_elems = opts
            .slots
            .checked_mul(opts.slot_capacity)
            .and_then(|n| n.checked_mul(d.kv_per_token()))
            .ok_or_else(|| BackendError::Invalid("KV cache size overflows".into()))?;
        let f = 4usize;
        let io_in = gpu.alloc((3 * t + nout) * 4)?;
        let io_out = gpu.alloc(2 * nout * 4)?;
        let (part_bytes, counter_bytes) = gpu.lm_head_scratch(nout);
        let b = Bufs {
            x: gpu.alloc(t * hd * f)?,
            q: gpu.alloc(t * qd * f)?,
            h: gpu.alloc(t * d.ffn * f)?,
            part_ml: gpu.alloc(t * d.heads * plan::MAX_SPLITS * 8)?,
            part_acc: gpu.alloc(t * d.heads * plan::MAX_SPLITS * d.head_dim * f)?,
            att: gpu.alloc(t * qd * f)?,
            att_counter: gpu.alloc(t * d.kv_heads * 4)?,
            logits: gpu.alloc(nout * d.vocab * f)?,
            tokens: io_in.ptr,
            pos: io_in.ptr + (t * 4) as u64,
            slot: io_in.ptr + (2 * t * 4) as u64,
            sel: io_in.ptr + (3 * t * 4) as u64,
            io_in,
            out_tok: io_out.ptr,
            out_lp: io_out.ptr + (nout * 4) as u64,
            io_out,
            lm_part: gpu.alloc(part_bytes)?,
            samp_params: gpu.alloc(nout * std::mem::size_of::<SampleParams>())?,
            samp_out: gpu.alloc(3 * nout * 4)?,
            lm_counter: gpu.alloc(counter_bytes)?,
            kc: gpu.alloc(kv_elems * f)?,
            vc: gpu.alloc(kv_elems * f)?,
        };
        let kv_bytes = 2 * (kv_elems * f) as u64;
        let prefill = if gemm::enabled() {
            Some(gemm::Prefill::new(&gpu, t)?)
        } else {
            None
        };
        let out_stage = if opts.run_ahead {
            Some(gpu.host_stage(2 * opts.slots)?)
        } else {
            None
        };
        let decode1 = if opts.persistent_decode {
            let ptrs: Vec<decode::LayerPtrs> = layers.iter().map(decode::LayerPtrs::from).collect();
            decode::Decode1::new(&gpu, &ptrs)?
        } else {
            None
        };
        Ok(CudaBackend {
            gpu,
            opts,
            emb,
            out,
            out_norm,
            rope,
            layers,
            b,
            graphs: HashMap::new(),
            prefill,
            decode1,
            last_decode1: None,
            ahead: None,
            out_stage,
            last_key: None,
            weight_bytes,
            kv_bytes,
            stats: Stats::default(),
        })
    }

    /// The backend of this binary: the embedded, attestation-checked kernels
    /// (`metrale_kernels::registry()`), the target's shape and quant, and `model`'s weights.
    pub fn from_registry(
        model: &metrale_model::Model,
        opts: CudaOptions,
    ) -> Result<CudaBackend, BackendError> {
        let (set, spec) = KernelSet::from_registry(metrale_kernels::registry())?;
        CudaBackend::for_target(&set, &spec, model, opts)
    }

    /// The backend of `set`, the kernels of target `spec` (its shape and quant), and `model`'s weights.
    pub fn for_target(
        set: &KernelSet,
        spec: &metrale_core::target::TargetSpec,
        model: &metrale_model::Model,
        opts: CudaOptions,
    ) -> Result<CudaBackend, BackendError> {
        CudaBackend::new(
            set,
            Dims::from_shape(&spec.model),
            &spec.quant.weights,
            &spec.quant.embedding,
            &model.config,
            &model.weights,
            opts,
        )
    }

    /// The device layer (tests and benchmarks).
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// One stage of the forward pass of a chunk over layer `l` (`l` unused by `Embed` and
    /// `LmHead`), on the tensor-core GEMM path when `pf` is given (the four layer products only).
    #[allow(clippy::too_many_arguments)]
    fn launch_stage(
        &self,
        stage: Stage,
        l: usize,
        pf: Option<&gemm::Prefill>,
        ntok: usize,
        nout: usize,
        nsplit: usize,
    ) -> Result<(), BackendError> {
        let g = &self.gpu;
        let b = &self.b;
        let cap = self.opts.slot_capacity;
        let w = || &self.layers[l]; // layer stages only
        match (stage, pf) {
            (Stage::Embed, _) => g.embed(&self.emb, b.tokens, b.x.ptr, ntok),
            (Stage::Qkv, Some(p)) => p.norm_qkv(
                g,
                b.x.ptr,
                w().attn_norm.ptr,
                &w().wqkv,
                self.rope.ptr,
                b.q.ptr,
                b.kc.ptr,
                b.vc.ptr,
                b.pos,
                b.slot,
                l,
                cap,
                ntok,
            ),
            (Stage::Qkv, None) => g.attn_in(
                b.x.ptr,
                w().attn_norm.ptr,
                &w().wqkv,
                self.rope.ptr,
                b.q.ptr,
                b.kc.ptr,
                b.vc.ptr,
                b.pos,
                b.slot,
                l,
                cap,
                ntok,
            ),
            (Stage::Attention, _) => g.attention(
                b.q.ptr,
                b.kc.ptr,
                b.vc.ptr,
                b.pos,
                b.slot,
                l,
                cap,
                nsplit,
                b.part_ml.ptr,
                b.part_acc.ptr,
                b.att_counter.ptr,
                b.att.ptr,
                ntok,
            ),
            (Stage::Out, Some(p)) => p.out_proj(g, b.att.ptr, &w().wo, b.x.ptr, ntok),
            (Stage::Out, None) => g.attn_out(b.att.ptr, &w().wo, b.x.ptr, ntok),
            (Stage::GateUp, Some(p)) => {
                p.norm_gate_up(g, b.x.ptr, w().ffn_norm.ptr, &w().wgu, b.h.ptr, ntok)
            }
            (Stage::GateUp, None) => g.ffn_in(b.x.ptr, w().ffn_norm.ptr, &w().wgu, b.h.ptr, ntok),
            (Stage::Down, Some(p)) => p.down(g, b.h.ptr, &w().wdown, b.x.ptr, ntok),
            (Stage::Down, None) => g.ffn_out(b.h.ptr, &w().wdown, b.x.ptr, ntok),
            (Stage::LmHead, _) => g.lm_head(
                b.x.ptr,
                b.sel,
                self.out_norm.ptr,
                self.out.as_ref().unwrap_or(&self.emb),
                b.logits.ptr,
                nout,
                b.lm_part.ptr,
                b.lm_counter.ptr,
                b.out_tok,
                b.out_lp,
            ),
        }
    }

    /// Enqueue the whole forward pass of one chunk (inputs already in the token/pos/slot/sel buffers).
    /// `gemm`: run the layer products as tensor-core GEMMs (`gemm::Prefill`) instead of matvecs.
    fn enqueue(
        &self,
        ntok: usize,
        nout: usize,
        nsplit: usize,
        gemm: bool,
    ) -> Result<(), BackendError> {
        let pf = if gemm { self.prefill.as_ref() } else { None };
        self.launch_stage(Stage::Embed, 0, None, ntok, nout, nsplit)?;
        for l in 0..self.layers.len() {
            for stage in Stage::LAYER {
                self.launch_stage(stage, l, pf, ntok, nout, nsplit)?;
            }
        }
        if nout > 0 {
            self.launch_stage(Stage::LmHead, 0, None, ntok, nout, nsplit)?;
        }
        Ok(())
    }

    /// The persistent decode kernel's launch for one sequence's decode step.
    fn launch_decode1(&mut self, s: decode::Step) -> Result<(), BackendError> {
        let k = self.decode1.as_mut().expect("checked by the caller");
        let b = &self.b;
        let head = self.out.as_ref().unwrap_or(&self.emb);
        k.launch(
            &self.gpu,
            &self.emb,
            head,
            self.out_norm.ptr,
            self.rope.ptr,
            b.kc.ptr,
            b.vc.ptr,
            self.opts.slot_capacity,
            s,
            b.logits.ptr,
            b.lm_part.ptr,
            b.lm_counter.ptr,
            b.out_tok,
            b.out_lp,
        )?;
        self.last_decode1 = Some(s);
        self.stats.decode1_launches += 1;
        Ok(())
    }

    /// Relaunch the last `decode_1` step with the trace on (flags bit 2) and return (blocks, the trace:
    /// `decode::trace_words` globaltimer stamps). `None` when the last step was not a `decode_1` step.
    pub fn trace_decode1(&mut self) -> Result<Option<(u32, Vec<u64>)>, BackendError> {
        let (Some(s), Some(k)) = (self.last_decode1, self.decode1.as_mut()) else {
            return Ok(None);
        };
        let flags = k.flags;
        k.flags |= 4;
        let r = (0..3).try_for_each(|_| self.launch_decode1(s));
        let k = self.decode1.as_mut().expect("checked above");
        k.flags = flags;
        r?;
        self.gpu.sync()?;
        let k = self.decode1.as_ref().expect("checked above");
        Ok(Some((k.blocks, k.read_trace(&self.gpu)?)))
    }

    /// One line for the server's start-up log: which decode paths run, with their knobs.
    pub fn decode_summary(&self) -> String {
        let one = match &self.decode1 {
            Some(k) => format!(
                "one sequence: persistent decode_1 ({} blocks, splits {:?}, flags {}), run-ahead {}",
                k.blocks,
                k.split,
                k.flags,
                if self.opts.run_ahead { "on" } else { "off" }
            ),
            None => "one sequence: per-stage kernels".into(),
        };
        let many = if self.opts.graphs {
            "CUDA graphs"
        } else {
            "direct launches"
        };
        format!("decode: {one}; several sequences: per-stage kernels, {many}")
    }

    /// The persistent decode kernel, when loaded: (blocks, dynamic shared bytes, registers and local
    /// bytes per thread, flags).
    pub fn decode1_info(&self) -> Option<(u32, u32, (i32, i32), i32)> {
        self.decode1
            .as_ref()
            .map(|k| (k.blocks, k.smem_bytes, k.regs, k.flags))
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
            return self.launch_decode1(decode::Step {
                token: tokens[0],
                pos: pos[0],
                slot: slot[0],
            });
        }
        self.last_decode1 = None;
        let max_len = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
        let nsplit =
            plan::attention_splits(max_len, self.gpu.dims.kv_heads, ntok, self.gpu.sm_count);
        // one stream-ordered copy of all inputs (no wait: the graph/kernels follow in stream order)
        let t = self.opts.max_step_tokens;
        let mut io = vec![0i32; 3 * t + self.opts.slots];
        io[..ntok].copy_from_slice(tokens);
        io[t..t + ntok].copy_from_slice(pos);
        io[2 * t..2 * t + ntok].copy_from_slice(slot);
        io[3 * t..3 * t + nout].copy_from_slice(sel);
        self.gpu.write_async(&self.b.io_in, 0, &io)?;
        self.last_key = Some((ntok, nsplit));
        if decode && self.opts.graphs && nout == ntok {
            let key = (ntok, nsplit);
            if !self.graphs.contains_key(&key) {
                self.gpu.begin_capture()?;
                let r = self.enqueue(ntok, nout, nsplit, false);
                let graph = self.gpu.end_capture();
                r?;
                self.graphs.insert(key, graph?);
                self.stats.graph_captures += 1;
            }
            self.graphs[&key]
                .launch()
                .map_err(|e| BackendError::Device(format!("graph launch: {e}")))?;
            self.stats.graph_launches += 1;
        } else {
            // not a pure decode step: long chunks take the tensor-core GEMM path
            self.enqueue(ntok, nout, nsplit, !decode && ntok >= gemm::MIN_TOKENS)?;
            self.stats.direct_steps += 1;
        }
        Ok(())
    }

    /// Time each kernel alone at the shape of the last chunk (layer 0's weights): a graph of `reps`
    /// launches of one kernel, replayed `rounds` times; microseconds per launch, graph-node overhead
    /// included. Benchmarks only: it rewrites the activations and the KV entries of that chunk.
    pub fn profile_kernels(
        &mut self,
        reps: usize,
        rounds: usize,
    ) -> Result<Vec<(&'static str, f64)>, BackendError> {
        let Some((ntok, nsplit)) = self.last_key else {
            return Ok(Vec::new());
        };
        let nout = ntok.min(self.opts.slots);
        let mut out = Vec::new();
        let mut stages = vec![
            ("embed", Stage::Embed, false),
            ("attn_in", Stage::Qkv, false),
            ("attention", Stage::Attention, false),
            ("attn_out", Stage::Out, false),
            ("ffn_in", Stage::GateUp, false),
            ("ffn_out", Stage::Down, false),
            ("lm_head", Stage::LmHead, false),
        ];
        if self.prefill.is_some() {
            stages.extend([
                ("gemm_norm_qkv", Stage::Qkv, true),
                ("gemm_o", Stage::Out, true),
                ("gemm_norm_gu", Stage::GateUp, true),
                ("gemm_down", Stage::Down, true),
            ]);
        }
        for (name, stage, gemm) in stages {
            let g = &self.gpu;
            let pf = if gemm { self.prefill.as_ref() } else { None };
            g.begin_capture()?;
            let mut r = Ok(());
            for _ in 0..reps {
                r = r.and_then(|_| self.launch_stage(stage, 0, pf, ntok, nout, nsplit));
            }
            let graph = g.end_capture();
            r?;
            let graph = graph?;
            graph
                .launch()
                .map_err(|e| BackendError::Device(format!("graph launch: {e}")))?;
            g.sync()?;
            let t = std::time::Instant::now();
            for _ in 0..rounds {
                graph
                    .launch()
                    .map_err(|e| BackendError::Device(format!("graph launch: {e}")))?;
            }
            g.sync()?;
            out.push((
                name,
                t.elapsed().as_secs_f64() * 1e6 / (reps * rounds) as f64,
            ));
        }
        Ok(out)
    }

    /// Replay the graph of the last decode step `n` times back to back and return the device time
    /// per replay in microseconds (host clock around `n` launches and one wait): the GPU-side cost of
    /// a decode step without the host's input and output copies. Replays rewrite the same KV entries.
    pub fn time_graph_replay(&mut self, n: usize) -> Result<Option<f64>, BackendError> {
        if let Some(s) = self.last_decode1 {
            // the persistent kernel: the same step relaunched n times
            self.gpu.sync()?;
            let t = std::time::Instant::now();
            for _ in 0..n {
                self.launch_decode1(s)?;
            }
            self.gpu.sync()?;
            return Ok(Some(t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64));
        }
        let Some(key) = self.last_key else {
            return Ok(None);
        };
        let Some(g) = self.graphs.get(&key) else {
            return Ok(None);
        };
        self.gpu.sync()?;
        let t = std::time::Instant::now();
        for _ in 0..n {
            g.launch()
                .map_err(|e| BackendError::Device(format!("graph launch: {e}")))?;
        }
        self.gpu.sync()?;
        Ok(Some(t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64))
    }

    fn validate(&self, batch: &[SeqStep<'_>]) -> Result<(), BackendError> {
        let mut seen = vec![false; self.opts.slots];
        for s in batch {
            if s.slot >= self.opts.slots {
                return Err(BackendError::Invalid(format!(
                    "slot {} out of range (backend has {} slots)",
                    s.slot, self.opts.slots
                )));
            }
            if std::mem::replace(&mut seen[s.slot], true) {
                return Err(BackendError::Invalid(format!(
                    "slot {} appears twice in one step",
                    s.slot
                )));
            }
            if s.tokens.is_empty() {
                return Err(BackendError::Invalid(format!(
                    "slot {}: a step needs at least one token",
                    s.slot
                )));
            }
            let end = s
                .start_pos
                .checked_add(s.tokens.len())
                .unwrap_or(usize::MAX);
            if end > self.opts.slot_capacity {
                return Err(BackendError::Invalid(format!(
                    "slot {}: positions up to {end} exceed the slot capacity of {} tokens",
                    s.slot, self.opts.slot_capacity
                )));
            }
            if let Some(&t) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.gpu.dims.vocab)
            {
                return Err(BackendError::Invalid(format!(
                    "token id {t} >= vocab {}",
                    self.gpu.dims.vocab
                )));
            }
        }
        Ok(())
    }
}

/// Whether a request needs nothing the device does not do: no logit bias, no penalties, no logprob
/// list, no logits. The others copy their logits row back and use the host sampler.
fn device_only(s: &SeqStep<'_>) -> bool {
    let p = s.sampling;
    p.logit_bias.is_empty()
        && p.repetition_penalty == 1.0
        && p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
        && p.top_logprobs == 0
        && !s.want_logits
}

/// Whether a request's token can be taken from the device's greedy pick (fused in lm_head).
fn device_greedy(s: &SeqStep<'_>) -> bool {
    s.sampling.is_greedy() && device_only(s)
}

/// The device sampler's parameters for one request (`sample_probs`).
fn sample_params(s: &SeqStep<'_>) -> SampleParams {
    let p = s.sampling;
    SampleParams {
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
            device: format!(
                "{} (sm_{}{}, {} SMs)",
                g.device_name, g.cc.0, g.cc.1, g.sm_count
            ),
            slots: self.opts.slots,
            slot_capacity: self.opts.slot_capacity,
            weight_bytes: self.weight_bytes,
            kv_bytes: self.kv_bytes,
        }
    }

    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<SeqOutput>, BackendError> {
        self.validate(batch)?;
        let ahead = self.ahead.take();
        if let [s] = batch {
            if s.tokens.len() == 1
                && device_greedy(s)
                && self.decode1.is_some()
                && self.out_stage.is_some()
            {
                return Ok(vec![self.greedy_decode1(s, ahead)?]);
            }
        }
        let decode = batch.iter().all(|s| s.tokens.len() == 1);
        let maxt = self.opts.max_step_tokens;
        let mut outputs: Vec<Option<SeqOutput>> = vec![None; batch.len()];
        // Pack (sequence, token range) pieces into chunks of at most max_step_tokens tokens.
        let mut tokens = Vec::with_capacity(maxt);
        let mut pos = Vec::with_capacity(maxt);
        let mut slot = Vec::with_capacity(maxt);
        let mut sel = Vec::new();
        let mut sel_seq = Vec::new();
        let mut pending: Vec<(usize, usize)> =
            batch.iter().enumerate().map(|(i, _)| (i, 0)).collect();
        pending.reverse();
        while let Some((i, from)) = pending.pop() {
            let s = &batch[i];
            let room = maxt - tokens.len();
            let take = (s.tokens.len() - from).min(room);
            for j in from..from + take {
                tokens.push(s.tokens[j] as i32);
                pos.push((s.start_pos + j) as i32);
                slot.push(s.slot as i32);
            }
            if from + take == s.tokens.len() {
                sel.push(tokens.len() as i32 - 1);
                sel_seq.push(i);
            } else {
                pending.push((i, from + take));
            }
            if tokens.len() == maxt || pending.is_empty() {
                self.run_chunk(&tokens, &pos, &slot, &sel, decode)?;
                self.collect(batch, &sel_seq, &mut outputs)?;
                tokens.clear();
                pos.clear();
                slot.clear();
                sel.clear();
                sel_seq.clear();
            }
        }
        Ok(outputs
            .into_iter()
            .map(|o| o.expect("every sequence's last token was in a chunk"))
            .collect())
    }

    fn release(&mut self, slot: SlotId) {
        if self.ahead.is_some_and(|a| a.0 == slot as i32) {
            self.ahead = None; // its launch is spare work now (module docs)
        }
        // The slot's KV entries stay (the engine's prefix caching resumes from the ones it shares
        // with the next prompt; every other entry is written before it is read): nothing to clear.
    }
}

impl CudaBackend {
    /// One sequence's greedy decode step by `decode_1` with run-ahead (module docs): launch it unless
    /// `ahead` already did, copy its pick back in stream order, enqueue the next step, then wait
    /// for the copy only.
    fn greedy_decode1(
        &mut self,
        s: &SeqStep<'_>,
        ahead: Option<(i32, i32, u32)>,
    ) -> Result<SeqOutput, BackendError> {
        let (token, pos, slot) = (s.tokens[0], s.start_pos as i32, s.slot as i32);
        if ahead == Some((slot, pos, token)) {
            self.stats.run_ahead_hits += 1;
        } else {
            self.launch_decode1(decode::Step {
                token: token as i32,
                pos,
                slot,
            })?;
        }
        let stage = self.out_stage.as_mut().expect("checked by the caller");
        self.gpu.read_staged(&self.b.io_out, stage)?;
        self.last_key = None;
        let run_ahead = s.start_pos + 2 <= self.opts.slot_capacity;
        if run_ahead {
            self.launch_decode1(decode::Step {
                token: decode::TOKEN_FROM_DEVICE,
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
        let (tok, lp) = (out[0] as i32, f32::from_bits(out[self.opts.slots]));
        if tok == -2 {
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
        })
    }

    /// Turn the device outputs of a chunk into `SeqOutput`s for the sequences it finished.
    fn collect(
        &self,
        batch: &[SeqStep<'_>],
        sel_seq: &[usize],
        outputs: &mut [Option<SeqOutput>],
    ) -> Result<(), BackendError> {
        let n = sel_seq.len();
        if n == 0 {
            return Ok(());
        }
        // one copy back (it waits for the chunk's kernels)
        let nout = self.opts.slots;
        let mut io = vec![0u32; 2 * nout];
        self.gpu.read(&self.b.io_out, 0, &mut io)?;
        let tok: Vec<i32> = io[..n].iter().map(|&v| v as i32).collect();
        if tok[0] == -2 && self.last_decode1.is_some() {
            return Err(BackendError::Device(DECODE1_REFUSED.into()));
        }
        let lp: Vec<f32> = io[nout..nout + n]
            .iter()
            .map(|&v| f32::from_bits(v))
            .collect();
        let vocab = self.gpu.dims.vocab;
        // temperature sampling on the device for the rows that need nothing else (one extra launch)
        let sampled = sel_seq
            .iter()
            .any(|&i| device_only(&batch[i]) && !batch[i].sampling.is_greedy());
        let mut samp = vec![0u32; 3 * nout];
        if sampled {
            let params: Vec<SampleParams> =
                sel_seq.iter().map(|&i| sample_params(&batch[i])).collect();
            self.gpu.write_async(&self.b.samp_params, 0, &params)?;
            let so = self.b.samp_out.ptr;
            self.gpu.sample_probs(
                self.b.logits.ptr,
                self.b.samp_params.ptr,
                so,
                so + (nout * 4) as u64,
                so + (2 * nout * 4) as u64,
                n,
            )?;
            self.gpu.read(&self.b.samp_out, 0, &mut samp)?;
        }
        for (k, &i) in sel_seq.iter().enumerate() {
            let s = &batch[i];
            let on_device =
                sampled && device_only(s) && !s.sampling.is_greedy() && samp[2 * nout + k] == 1;
            let out = if device_greedy(s) {
                SeqOutput {
                    token: tok[k] as u32,
                    logprob: lp[k],
                    top_logprobs: Vec::new(),
                    logits: None,
                }
            } else if on_device {
                SeqOutput {
                    token: samp[k],
                    logprob: f32::from_bits(samp[nout + k]),
                    top_logprobs: Vec::new(),
                    logits: None,
                }
            } else {
                let mut row = vec![0f32; vocab];
                self.gpu.read(&self.b.logits, k * vocab * 4, &mut row)?;
                let r = sampler::sample(&row, s.sampling, s.history, s.draw);
                SeqOutput {
                    token: r.token,
                    logprob: r.logprob,
                    top_logprobs: r.top_logprobs,
                    logits: s.want_logits.then_some(row),
                }
            };
            outputs[i] = Some(out);
        }
        Ok(())
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
            Ok((set, spec)) => {
                assert_eq!(set.blobs.len(), gpu::TEMPLATES.len());
                assert!(set.blobs.values().all(|b| !b.cubin.is_empty()));
                assert_eq!(Some(set.arch.clone()), spec.hardware.cubin_arch);
            }
        }
    }

    #[test]
    fn config_mismatch_names_the_field() {
        let d = Dims {
            layers: 30,
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
        };
        let mut c = ModelConfig {
            name: "m".into(),
            arch: "llama".into(),
            model_type: "llama".into(),
            n_layers: 30,
            hidden: 576,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
            rope_theta: 100000.0,
            norm_eps: 1e-5,
            max_context: 8192,
            tied_embeddings: true,
            rope_scaling: None,
            bos: Some(1),
            eos: vec![2],
            add_bos: false,
        };
        assert!(check_config(&c, &d, "h200/smollm2-135m/q4_1").is_ok());
        c.hidden = 2048;
        let e = check_config(&c, &d, "h200/smollm2-135m/q4_1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("hidden is 2048") && e.contains("compiled for 576"),
            "{e}"
        );
        // RoPE scaling is no longer refused (the table carries it)
        c.hidden = 576;
        c.rope_scaling = Some(metrale_model::RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        });
        assert!(check_config(&c, &d, "h200/llama-3.2-1b/q4_1").is_ok());
    }

    /// The llama3-scaled cos/sin table the kernels read rotates exactly as the CPU backend does.
    #[test]
    fn rope_table_with_llama3_scaling_matches_cpu_rotation() {
        let mut c = llama_1b_config();
        let hd = c.head_dim;
        let plain = crate::cpu::model_inv_freq(&c, hd, || {
            unreachable!("no rope_freqs without FreqFactors")
        })
        .unwrap();
        c.rope_scaling = Some(metrale_model::RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        });
        let inv = crate::cpu::model_inv_freq(&c, hd, || {
            unreachable!("no rope_freqs without FreqFactors")
        })
        .unwrap();
        // scaling changed the low frequencies and kept the highest one
        assert_eq!(inv[0], plain[0]);
        assert!(
            (inv[hd / 2 - 1] - plain[hd / 2 - 1] / 32.0).abs() <= 1e-6 * plain[hd / 2 - 1].abs()
        );
        let n_pos = 5000;
        let table = plan::rope_table(&inv, n_pos);
        let x: Vec<f32> = (0..hd)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
            .collect();
        for pos in [0usize, 1, 7, 1000, 4999] {
            let mut want = x.clone();
            crate::cpu::ops::rope_inplace(&mut want, hd, pos, &inv);
            for i in 0..hd / 2 {
                let [co, si] = table[pos * (hd / 2) + i];
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                let got = [a * co - b * si, a * si + b * co];
                for (g, w) in got.iter().zip(&want[2 * i..2 * i + 2]) {
                    assert!(
                        (g - w).abs() <= 1e-5,
                        "pos {pos} pair {i}: table rotation {g} vs cpu {w}"
                    );
                }
            }
        }
    }

    fn llama_1b_config() -> ModelConfig {
        ModelConfig {
            name: "llama-3.2-1b".into(),
            arch: "llama".into(),
            model_type: "llama".into(),
            n_layers: 16,
            hidden: 2048,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 128256,
            rope_theta: 500000.0,
            norm_eps: 1e-5,
            max_context: 131072,
            tied_embeddings: true,
            rope_scaling: None,
            bos: Some(128000),
            eos: vec![128001],
            add_bos: true,
        }
    }
}
