//! The CPU backend: the Llama-family forward pass on the host, the numerical reference of every other
//! backend.
//!
//! Owns: a copy of the model's weights in their stored (quantized) form, the paged KV pool (f32 or
//! bf16, blocks of `KV_BLOCK` tokens addressed through each sequence's block table), a
//! rayon pool of `threads` workers, and the forward pass of one [`Backend::step`]: every token of
//! every sequence of the batch (prefill chunks and decode tokens alike) goes through each layer
//! together, as one `[tokens, hidden]` activation matrix; matrix products run through fused
//! dequantize-and-dot kernels in parallel over output rows (Q/K/V in one parallel region, gate/up in
//! another); attention runs in parallel over (token, head). Only the last position of each sequence
//! goes through the LM head, and the host [`crate::sampler`] picks the token.
//!
//! Two numerics for the matrix products: by default the activations are quantized to 16-bit integer
//! blocks and multiplied in exact integer arithmetic ([`qact`], AVX2; measured 1e-2 max logit
//! difference to HF transformers on SmolLM2); `set_exact_activations(true)` runs the f32 reference
//! ops of [`ops`] instead (5e-5). Everything else (norms, RoPE, attention, SwiGLU, residuals) is f32
//! on both; a bf16 KV cache rounds K and V to nearest even when they are written, and attention reads
//! them back widened to f32 (each sequence's positions gathered from its blocks once per layer).
//!
//! Invariants: weights are never dequantized as a whole; accumulation is f32 (integer within a
//! block); a sequence's cache rows `0..start_pos` are whatever earlier steps wrote into its blocks
//! (the engine keeps `start_pos` and the tables honest); every input is validated and refused with
//! `BackendError::Invalid` instead of panicking.

pub mod mat;
pub mod ops;
pub mod qact;
pub mod synthetic;

use crate::sampler;
use crate::stage::Stage;
use crate::{
    Backend, BackendInfo, HiddenSums, KvConfig, KvDtype, SeqOutput, SeqStep, SlotId, KV_BLOCK,
};
use metrale_core::dtype::{dequantize_row, DType};
use metrale_core::BackendError;
use metrale_model::Model;
use ops::MatRef;
use rayon::prelude::*;

/// One weight matrix, owned, in its stored dtype: `rows` rows of `cols` elements.
#[derive(Debug)]
pub struct QTensor {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
    /// Q4_1 rows packed for the AVX2 kernels (`qact::pack_q4_1`).
    pub packed: bool,
    /// An FP8 matrix's scales.
    pub fp8: Option<mat::Fp8Scales>,
}

impl QTensor {
    pub fn mat(&self) -> MatRef<'_> {
        MatRef {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
            packed: self.packed,
            fp8: self.fp8.as_ref().map(mat::Fp8Scales::as_ref),
        }
    }

    /// Pack a Q4_1 matrix's rows for the AVX2 kernels when this CPU runs them (layer matrices
    /// only: the embedding is read by rows in GGUF order).
    fn packed_for_this_cpu(mut self) -> QTensor {
        if self.dtype == DType::Q4_1 && !self.packed && qact::packs_q4_1() {
            qact::pack_q4_1(&mut self.data, self.cols);
            self.packed = true;
        }
        self
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: QTensor,
    wk: QTensor,
    wv: QTensor,
    /// The weights of the RMSNorm of each Q and K head before RoPE (`head_dim` each), in families
    /// with `Family::qk_norm`.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// The Q, K and V projections' biases (`qd`, `kd`, `kd`), in families with
    /// `Family::qkv_bias`.
    qkv_bias: Option<[Vec<f32>; 3]>,
    wo: QTensor,
    /// The O projection's bias (`hidden`), in families with `out_bias`.
    o_bias: Option<Vec<f32>>,
    /// Each query head's sink logit, in families with `attn_sinks`.
    sinks: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
    /// The norms after the attention and after the MLP (families with `post_norms`).
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// The positions a query attends to: its last `window` (`usize::MAX`: all); sliding-window
    /// layers rotate with the local RoPE frequencies (`Block::local_inv_freq`).
    window: usize,
}

/// A layer's MLP: one gated MLP, or routed experts.
#[derive(Debug)]
enum Ffn {
    Dense {
        gate: QTensor,
        up: QTensor,
        down: QTensor,
    },
    /// The router (`[experts][hidden]`) and each expert's (gate, up, down).
    Moe {
        router: QTensor,
        experts: Vec<[QTensor; 3]>,
        moe: metrale_model::config::Moe,
        /// gpt-oss's experts (`oai_moe`): biases and the clamped SwiGLU.
        oai: Option<OaiExperts>,
    },
}

/// The biases of gpt-oss's router (`[experts]`) and of each expert's gate, up and down products
/// (`ffn`, `ffn`, `hidden`); with them the experts' gate is [`ops::swiglu_oai_inplace`].
#[derive(Debug)]
struct OaiExperts {
    router: Vec<f32>,
    experts: Vec<[Vec<f32>; 3]>,
}

impl Ffn {
    fn tensors(&self) -> Vec<&QTensor> {
        match self {
            Ffn::Dense { gate, up, down } => vec![gate, up, down],
            Ffn::Moe {
                router, experts, ..
            } => std::iter::once(router)
                .chain(experts.iter().flatten())
                .collect(),
        }
    }
}

/// The experts a token's router logits choose and their weights: the softmax over all experts,
/// the `used` largest (ties to the lower index), renormalised to sum 1 where `norm_topk`.
pub fn route(logits: &[f32], used: usize, norm_topk: bool) -> Vec<(usize, f32)> {
    let mut p = logits.to_vec();
    ops::softmax_inplace(&mut p);
    let mut order: Vec<usize> = (0..p.len()).collect();
    // stable: equal weights keep the lower index first
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    let top: Vec<(usize, f32)> = order.iter().take(used).map(|&e| (e, p[e])).collect();
    let sum: f32 = top.iter().map(|&(_, w)| w).sum();
    top.into_iter()
        .map(|(e, w)| (e, if norm_topk { w / sum } else { w }))
        .collect()
}

use crate::Dims;

/// K or V of the whole pool: `[block][layer][KV_BLOCK][kv_dim]`, in the cache's element type.
/// Fp8: e4m3 bytes in that layout and one f32 scale per head vector (`head_dim` elements of
/// one token's K or V head: `scales[at / head_dim]`), its largest magnitude to 448.
enum KvStore {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Fp8 {
        q: Vec<u8>,
        scales: Vec<f32>,
        head_dim: usize,
    },
}

/// Write one element of every 4 KiB page of `v`: the pages are committed now (a volatile write,
/// so the compiler cannot drop it as a store of zero into zeroed memory).
fn commit_pages<T: Copy + Default>(v: &mut [T]) {
    let step = (4096 / std::mem::size_of::<T>()).max(1);
    for i in (0..v.len()).step_by(step) {
        // SAFETY: `i` is in bounds of `v`.
        unsafe { std::ptr::write_volatile(v.as_mut_ptr().add(i), T::default()) };
    }
}

impl KvStore {
    /// A zeroed store of `n` elements, its memory committed at once: the pool is the KV cache's
    /// whole budget, taken at start (a pool that does not fit fails here, not mid-request, and the
    /// process's memory stays flat as blocks come into use).
    fn new(dtype: KvDtype, n: usize, head_dim: usize) -> KvStore {
        match dtype {
            KvDtype::F32 => {
                let mut v = vec![0.0f32; n];
                commit_pages(&mut v);
                KvStore::F32(v)
            }
            KvDtype::Bf16 => {
                let mut v = vec![0u16; n];
                commit_pages(&mut v);
                KvStore::Bf16(v)
            }
            KvDtype::Fp8 => {
                let (mut q, mut scales) = (vec![0u8; n], vec![1f32; n / head_dim]);
                commit_pages(&mut q);
                commit_pages(&mut scales);
                KvStore::Fp8 {
                    q,
                    scales,
                    head_dim,
                }
            }
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            KvStore::F32(v) => v.len() as u64 * 4,
            KvStore::Bf16(v) => v.len() as u64 * 2,
            KvStore::Fp8 { q, scales, .. } => q.len() as u64 + scales.len() as u64 * 4,
        }
    }

    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            KvStore::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            KvStore::Bf16(v) => {
                for (d, &x) in v[at..at + src.len()].iter_mut().zip(src) {
                    *d = metrale_core::dtype::f32_to_bf16(x);
                }
            }
            KvStore::Fp8 {
                q,
                scales,
                head_dim,
            } => {
                // whole head vectors: `at` and the length are multiples of head_dim
                for (h, x) in src.chunks_exact(*head_dim).enumerate() {
                    let s =
                        metrale_core::fp8::row_scale(x.iter().fold(0f32, |m, v| m.max(v.abs())));
                    let i = at / *head_dim + h;
                    scales[i] = s;
                    for (d, &v) in q[i * *head_dim..(i + 1) * *head_dim].iter_mut().zip(x) {
                        *d = metrale_core::fp8::f32_to_e4m3(v / s);
                    }
                }
            }
        }
    }

    fn read(&self, at: usize, dst: &mut [f32]) {
        match self {
            KvStore::F32(v) => dst.copy_from_slice(&v[at..at + dst.len()]),
            KvStore::Bf16(v) => {
                let n = dst.len();
                for (d, &x) in dst.iter_mut().zip(&v[at..at + n]) {
                    *d = metrale_core::dtype::bf16_to_f32(x);
                }
            }
            KvStore::Fp8 {
                q,
                scales,
                head_dim,
            } => {
                for (h, d) in dst.chunks_exact_mut(*head_dim).enumerate() {
                    let i = at / *head_dim + h;
                    let s = scales[i];
                    for (o, &b) in d.iter_mut().zip(&q[i * *head_dim..(i + 1) * *head_dim]) {
                        *o = metrale_core::fp8::e4m3_to_f32(b) * s;
                    }
                }
            }
        }
    }
}

/// The paged KV cache (see the module docs).
struct KvPool {
    k: KvStore,
    v: KvStore,
    blocks: usize,
    dtype: KvDtype,
    /// Elements of one (block, layer): `KV_BLOCK x kv_dim`.
    layer_elems: usize,
    layers: usize,
    kv_dim: usize,
}

impl KvPool {
    /// Element offset of `pos` (of a sequence with block table `table`) in `layer`.
    fn at(&self, table: &[u32], layer: usize, pos: usize) -> usize {
        let b = table[pos / KV_BLOCK] as usize;
        (b * self.layers + layer) * self.layer_elems + (pos % KV_BLOCK) * self.kv_dim
    }

    /// K and V of positions `0..n_pos` of `layer`, widened to f32 into `k`, `v` (`[n_pos][kv_dim]`).
    fn gather(
        &self,
        table: &[u32],
        layer: usize,
        n_pos: usize,
        k: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) {
        let kvd = self.kv_dim;
        k.resize(n_pos * kvd, 0.0);
        v.resize(n_pos * kvd, 0.0);
        let mut p = 0;
        while p < n_pos {
            let run = (KV_BLOCK - p % KV_BLOCK).min(n_pos - p);
            let at = self.at(table, layer, p);
            self.k.read(at, &mut k[p * kvd..(p + run) * kvd]);
            self.v.read(at, &mut v[p * kvd..(p + run) * kvd]);
            p += run;
        }
    }
}

/// One sequence's K and V of the current layer, gathered from its blocks (`[n_pos][kv_dim]`).
#[derive(Default)]
struct SeqKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// A multi-matrix product of [`ops`]: `ops::matmul_many` or `ops::matmul_qact_many`.
type MatmulMany = fn(&[MatRef<'_>], &[f32], usize, &mut [&mut [f32]]);

/// `MemAvailable` of /proc/meminfo in bytes (None where it cannot be read).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The CPU backend (see the module docs).
pub struct CpuBackend {
    dims: Dims,
    /// RMSNorm epsilon of the checkpoint.
    norm_eps: f32,
    embd: QTensor,
    lm_head: Option<QTensor>,
    out_norm: Vec<f32>,
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    kv: KvPool,
    slots: usize,
    slot_capacity: usize,
    threads: usize,
    pool: rayon::ThreadPool,
    /// f32 activations in every matrix product (the reference) instead of 16-bit integer blocks
    /// (the default, see [`qact`]).
    exact: bool,
    block: Block,
}

/// What a family's block does beyond the llama block's arithmetic, as the CPU forward pass reads
/// it (`metrale_core::target::Features`, `ModelConfig`).
#[derive(Debug, Clone)]
struct Block {
    /// The embedding rows times sqrt(hidden) (`embed_scale`).
    embed_scale: Option<f32>,
    /// The gated MLP's activation is GELU (tanh) instead of SiLU.
    gelu: bool,
    /// The attention scores' scale.
    attn_scale: f32,
    /// The rotation's cos and sin times this (LongRoPE's attention factor; 1 otherwise).
    rope_scale: f32,
    /// The RoPE frequencies of sliding-window layers, where they differ.
    local_inv_freq: Option<Vec<f32>>,
}

fn model_err(e: impl std::fmt::Display) -> BackendError {
    BackendError::Model(e.to_string())
}

fn load_matrix(
    model: &Model,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<QTensor, BackendError> {
    let t = model.weights.get(name).map_err(model_err)?;
    to_qtensor(model, &t, &format!("tensor '{name}'"), rows, cols)
}

/// Expert `e`'s `rows` x `cols` matrix of the expert tensor `name` (`Weights::expert`).
fn load_expert(
    model: &Model,
    name: &str,
    e: usize,
    rows: usize,
    cols: usize,
) -> Result<QTensor, BackendError> {
    let t = model.weights.expert(name, e).map_err(model_err)?;
    to_qtensor(model, &t, &format!("expert {e} of '{name}'"), rows, cols)
}

/// A copy of `t`, checked to be a `rows` x `cols` matrix (`what` names it in the error), with its
/// scales where it is FP8.
fn to_qtensor(
    model: &Model,
    t: &metrale_model::TensorRef<'_>,
    what: &str,
    rows: usize,
    cols: usize,
) -> Result<QTensor, BackendError> {
    if t.shape.len() != 2 || t.shape[0] != cols || t.shape[1] != rows {
        return Err(BackendError::Model(format!(
            "{what}: expected ggml shape [{cols}, {rows}], got {:?}",
            t.shape
        )));
    }
    if t.dtype.row_bytes(cols).map(|b| b * rows) != Some(t.data.len()) {
        return Err(BackendError::Model(format!(
            "{what}: {} bytes do not fit {} {:?}",
            t.data.len(),
            t.dtype,
            t.shape
        )));
    }
    let fp8 = match t.dtype {
        DType::F8_E4M3 => {
            let (scales, input_scale) =
                metrale_model::fp8::scales(&model.weights, &model.config, t.name)
                    .map_err(model_err)?;
            let ub = match model.config.fp8 {
                Some(metrale_core::fp8::Activations::Dynamic { ub }) => ub,
                _ => None,
            };
            if scales.len() != rows {
                return Err(BackendError::Model(format!(
                    "{what}: {} scales for {rows} rows",
                    scales.len()
                )));
            }
            Some(mat::Fp8Scales {
                scales,
                input_scale,
                ub,
            })
        }
        _ => None,
    };
    Ok(QTensor {
        dtype: t.dtype,
        rows,
        cols,
        data: t.data.to_vec(),
        packed: false,
        fp8,
    })
}

fn load_vector(model: &Model, name: &str, n: usize) -> Result<Vec<f32>, BackendError> {
    let t = model.weights.get(name).map_err(model_err)?;
    if t.n_elems() != n || t.shape[0] != n {
        return Err(BackendError::Model(format!(
            "tensor '{name}': expected {n} elements, got shape {:?}",
            t.shape
        )));
    }
    let mut out = vec![0f32; n];
    dequantize_row(t.dtype, t.data, &mut out)
        .map_err(|e| BackendError::Model(format!("tensor '{name}': {e}")))?;
    Ok(out)
}

/// gpt-oss's router and expert biases of layer `l` (`metrale_model::config::validate_model`
/// checked their shapes: the experts' as `[ffn or hidden][experts]`, expert e's in row e).
fn load_oai_experts(
    model: &Model,
    l: usize,
    moe: metrale_model::config::Moe,
    h: usize,
) -> Result<OaiExperts, BackendError> {
    let all = |s: &str, len: usize| -> Result<Vec<Vec<f32>>, BackendError> {
        let name = format!("blk.{l}.{s}.bias");
        let t = model.weights.get(&name).map_err(model_err)?;
        if t.shape[..] != [len, moe.experts] {
            return Err(BackendError::Model(format!(
                "tensor '{name}': expected shape [{len}, {}], got {:?}",
                moe.experts, t.shape
            )));
        }
        let mut v = vec![0f32; len * moe.experts];
        dequantize_row(t.dtype, t.data, &mut v)
            .map_err(|e| BackendError::Model(format!("tensor '{name}': {e}")))?;
        Ok(v.chunks_exact(len).map(<[f32]>::to_vec).collect())
    };
    let (g, u, d) = (
        all("ffn_gate_exps", moe.ffn)?,
        all("ffn_up_exps", moe.ffn)?,
        all("ffn_down_exps", h)?,
    );
    Ok(OaiExperts {
        router: load_vector(model, &format!("blk.{l}.ffn_gate_inp.bias"), moe.experts)?,
        experts: g
            .into_iter()
            .zip(u)
            .zip(d)
            .map(|((g, u), d)| [g, u, d])
            .collect(),
    })
}

impl CpuBackend {
    /// [`CpuBackend::load_kv`] with an f32 pool that holds every slot at full capacity, each slot's
    /// blocks its own run ([`crate::slot_blocks`]).
    pub fn load(
        model: &Model,
        slots: usize,
        slot_capacity: usize,
        threads: usize,
    ) -> Result<CpuBackend, BackendError> {
        Self::load_kv(model, KvConfig::per_slot(slots, slot_capacity), threads)
    }

    /// Copy the model's weights (in their stored form) and allocate the KV pool `kv` describes
    /// (pages are touched only when used). `threads` workers run the matrix products (0 = one per
    /// available core).
    pub fn load_kv(
        model: &Model,
        kvc: KvConfig,
        threads: usize,
    ) -> Result<CpuBackend, BackendError> {
        let c = &model.config;
        if c.head_dim > 512 || c.n_kv_heads == 0 || !c.n_heads.is_multiple_of(c.n_kv_heads) {
            return Err(BackendError::Model(format!(
                "unsupported head layout: {} heads of {} with {} KV heads",
                c.n_heads, c.head_dim, c.n_kv_heads
            )));
        }
        let dims = c.dims();
        let (h, q, kv, f) = (dims.hidden, dims.qd(), dims.kd(), dims.ffn);
        let embd = load_matrix(model, "token_embd.weight", dims.vocab, h)?;
        let lm_head = if model.weights.contains("output.weight") {
            Some(load_matrix(model, "output.weight", dims.vocab, h)?)
        } else if c.tied_embeddings {
            None
        } else {
            return Err(BackendError::Model(
                "no output.weight and the config does not tie embeddings".into(),
            ));
        };
        let out_norm = load_vector(model, "output_norm.weight", h)?;
        let mut layers = Vec::with_capacity(dims.layers);
        for i in 0..dims.layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: load_vector(model, &n("attn_norm"), h)?,
                wq: load_matrix(model, &n("attn_q"), q, h)?.packed_for_this_cpu(),
                wk: load_matrix(model, &n("attn_k"), kv, h)?.packed_for_this_cpu(),
                wv: load_matrix(model, &n("attn_v"), kv, h)?.packed_for_this_cpu(),
                qk_norm: match c.family.qk_norm() {
                    true => Some((
                        load_vector(model, &n("attn_q_norm"), dims.head_dim)?,
                        load_vector(model, &n("attn_k_norm"), dims.head_dim)?,
                    )),
                    false => None,
                },
                qkv_bias: match c.family.qkv_bias() {
                    true => {
                        let b =
                            |s: &str, len| load_vector(model, &format!("blk.{i}.{s}.bias"), len);
                        Some([b("attn_q", q)?, b("attn_k", kv)?, b("attn_v", kv)?])
                    }
                    false => None,
                },
                wo: load_matrix(model, &n("attn_output"), h, q)?.packed_for_this_cpu(),
                o_bias: match c.family.features().out_bias {
                    true => Some(load_vector(model, &format!("blk.{i}.attn_output.bias"), h)?),
                    false => None,
                },
                sinks: match c.family.features().attn_sinks {
                    true => Some(load_vector(model, &n("attn_sinks"), dims.heads)?),
                    false => None,
                },
                ffn_norm: load_vector(model, &n("ffn_norm"), h)?,
                post_norms: match c.family.features().post_norms {
                    true => Some((
                        load_vector(model, &n("post_attention_norm"), h)?,
                        load_vector(model, &n("post_ffw_norm"), h)?,
                    )),
                    false => None,
                },
                window: match &c.sliding {
                    Some(sw) if sw.sliding[i] => sw.window,
                    _ => usize::MAX,
                },
                ffn: match c.moe {
                    None => Ffn::Dense {
                        gate: load_matrix(model, &n("ffn_gate"), f, h)?.packed_for_this_cpu(),
                        up: load_matrix(model, &n("ffn_up"), f, h)?.packed_for_this_cpu(),
                        down: load_matrix(model, &n("ffn_down"), h, f)?.packed_for_this_cpu(),
                    },
                    Some(moe) => Ffn::Moe {
                        router: load_matrix(model, &n("ffn_gate_inp"), moe.experts, h)?,
                        experts: (0..moe.experts)
                            .map(|e| -> Result<[QTensor; 3], BackendError> {
                                let x = |s: &str, rows, cols| {
                                    load_expert(model, &n(s), e, rows, cols)
                                        .map(QTensor::packed_for_this_cpu)
                                };
                                Ok([
                                    x("ffn_gate_exps", moe.ffn, h)?,
                                    x("ffn_up_exps", moe.ffn, h)?,
                                    x("ffn_down_exps", h, moe.ffn)?,
                                ])
                            })
                            .collect::<Result<_, _>>()?,
                        moe,
                        oai: match c.family.features().oai_moe {
                            true => Some(load_oai_experts(model, i, moe, h)?),
                            false => None,
                        },
                    },
                },
            });
        }
        let inv_freq = crate::rope::model_inv_freq(c, kvc.slot_capacity, || {
            load_vector(model, "rope_freqs.weight", dims.head_dim / 2)
        })?;
        let f = c.family.features();
        let mut b = Self::from_parts(
            dims, c.norm_eps, embd, lm_head, out_norm, layers, inv_freq, kvc, threads,
        )?;
        b.block = Block {
            embed_scale: f.embed_scale.then(|| (dims.hidden as f64).sqrt() as f32),
            gelu: f.gelu,
            attn_scale: c.attn_scale,
            rope_scale: crate::rope::model_rope_scale(c),
            // a sliding layer with the model's own base rotates as the others (gpt-oss: YaRN
            // included); Gemma's local base has no scaling
            local_inv_freq: c
                .sliding
                .as_ref()
                .filter(|sw| sw.rope_theta != c.rope_theta)
                .map(|sw| crate::rope::rope_inv_freq(c.rotary_dim, sw.rope_theta, None, None)),
        };
        Ok(b)
    }

    #[allow(clippy::too_many_arguments)]
    fn from_parts(
        dims: Dims,
        norm_eps: f32,
        embd: QTensor,
        lm_head: Option<QTensor>,
        out_norm: Vec<f32>,
        layers: Vec<Layer>,
        inv_freq: Vec<f32>,
        kvc: KvConfig,
        threads: usize,
    ) -> Result<CpuBackend, BackendError> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let (slots, slot_capacity) = (kvc.slots, kvc.slot_capacity);
        if slots == 0 || slot_capacity == 0 {
            return Err(BackendError::Invalid(format!(
                "slots ({slots}) and slot capacity ({slot_capacity}) must both be at least 1"
            )));
        }
        let blocks = kvc.pool_blocks();
        if blocks < crate::blocks_for(slot_capacity) {
            return Err(BackendError::Invalid(format!(
                "a KV pool of {blocks} blocks ({} tokens) cannot hold one sequence of the context size \
                 ({slot_capacity} tokens); give it more blocks or lower the context size",
                blocks * KV_BLOCK
            )));
        }
        let layer_elems = KV_BLOCK * dims.kd();
        let elems = blocks
            .checked_mul(dims.layers)
            .and_then(|x| x.checked_mul(layer_elems))
            .ok_or_else(|| {
                BackendError::Invalid(format!("a KV pool of {blocks} blocks overflows"))
            })?;
        // The whole pool must fit in available memory (it is committed at once: `KvStore::new`).
        let needed = ((elems / dims.head_dim) as u64)
            .saturating_mul(2 * kvc.dtype.vector_bytes(dims.head_dim) as u64);
        if let Some(free) = mem_available() {
            if needed > free {
                return Err(BackendError::OutOfMemory {
                    device: "cpu".into(),
                    needed,
                    free,
                    hint: format!(
                        "the KV cache of {blocks} blocks ({} tokens, {}) does not fit; lower the context size, the number of parallel slots or the KV cache size",
                        blocks * KV_BLOCK,
                        kvc.dtype
                    ),
                });
            }
        }
        let kv = KvPool {
            k: KvStore::new(kvc.dtype, elems, dims.head_dim),
            v: KvStore::new(kvc.dtype, elems, dims.head_dim),
            blocks,
            dtype: kvc.dtype,
            layer_elems,
            layers: dims.layers,
            kv_dim: dims.kd(),
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("metrale-cpu-{i}"))
            .build()
            .map_err(|e| {
                BackendError::Device(format!("cannot start {threads} CPU worker threads: {e}"))
            })?;
        Ok(CpuBackend {
            dims,
            norm_eps,
            embd,
            lm_head,
            out_norm,
            layers,
            inv_freq,
            kv,
            slots,
            slot_capacity,
            threads,
            pool,
            exact: false,
            block: Block {
                embed_scale: None,
                gelu: false,
                attn_scale: 1.0 / (dims.head_dim as f32).sqrt(),
                rope_scale: 1.0,
                local_inv_freq: None,
            },
        })
    }

    /// Choose f32 activations in the matrix products (`true`: the reference, slower) or 16-bit
    /// integer activation blocks with exact integer dots (`false`, the default; see [`qact`]).
    pub fn set_exact_activations(&mut self, exact: bool) {
        self.exact = exact;
    }

    fn mm(&self) -> MatmulMany {
        if self.exact {
            ops::matmul_many
        } else {
            ops::matmul_qact_many
        }
    }

    /// Shape constants of the loaded model.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    fn weight_bytes(&self) -> u64 {
        let mut n = self.embd.data.len()
            + self.lm_head.as_ref().map_or(0, |t| t.data.len())
            + self.out_norm.len() * 4;
        for l in &self.layers {
            n += (l.attn_norm.len() + l.ffn_norm.len()) * 4;
            n += l
                .qk_norm
                .as_ref()
                .map_or(0, |(q, k)| (q.len() + k.len()) * 4);
            n += l
                .qkv_bias
                .as_ref()
                .map_or(0, |b| b.iter().map(|v| v.len() * 4).sum());
            n += l
                .post_norms
                .as_ref()
                .map_or(0, |(a, b)| (a.len() + b.len()) * 4);
            for t in [&l.wq, &l.wk, &l.wv, &l.wo]
                .into_iter()
                .chain(l.ffn.tensors())
            {
                n += t.data.len();
            }
        }
        n as u64
    }

    /// Run the layers over the batch and return the final-normed hidden states of the positions
    /// each entry samples at, its last `drafted + 1`, entries in order (`[rows][hidden]`). Writes
    /// the entries' K/V into their slots.
    fn forward_hidden(&mut self, batch: &[SeqStep<'_>]) -> Vec<f32> {
        let h = self.dims.hidden;
        let (x, last_rows) = self.forward_layers(batch);
        let rows: Vec<usize> = batch
            .iter()
            .zip(&last_rows)
            .flat_map(|(s, &r)| r - s.drafted..=r)
            .collect();
        let mut out = vec![0f32; rows.len() * h];
        for (dst, &r) in out.chunks_exact_mut(h).zip(&rows) {
            ops::rmsnorm(&x[r * h..(r + 1) * h], &self.out_norm, self.norm_eps, dst);
        }
        out
    }

    /// Run the layers over the batch: the residual stream after the last layer for every token
    /// (`[tokens][hidden]`, batch order) and the row of each entry's last token. Writes the
    /// entries' K/V into their slots. Walks [`Stage::Embed`] and each layer's [`Stage::LAYER`];
    /// the final norm and the LM head run on the rows that sample (`forward_hidden`, `lm_head`).
    fn forward_layers(&mut self, batch: &[SeqStep<'_>]) -> (Vec<f32>, Vec<usize>) {
        let mut pass = Pass::new(
            batch,
            &self.dims,
            (
                &self.inv_freq,
                self.block.local_inv_freq.as_deref(),
                self.block.rope_scale,
            ),
        );
        let net = Net {
            d: self.dims,
            eps: self.norm_eps,
            mm: self.mm(),
            embd: &self.embd,
            block: &self.block,
        };
        let (layers, kv) = (&self.layers, &mut self.kv);
        self.pool.install(|| {
            pass.embed(&net);
            for (li, l) in layers.iter().enumerate() {
                for stage in Stage::LAYER {
                    pass.layer_stage(stage, &net, (li, l), kv);
                }
            }
        });
        (pass.x, pass.last_rows)
    }

    /// Refuse a batch this backend cannot run (`crate::validate_batch`), before any work.
    fn validate(&self, batch: &[SeqStep<'_>]) -> Result<(), BackendError> {
        crate::validate_batch(
            batch,
            self.slots,
            self.slot_capacity,
            self.kv.blocks,
            self.dims.vocab,
        )
    }

    /// Logits (`[rows][vocab]`) of final-normed hidden states (`[rows][hidden]`).
    fn lm_head(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        let w = self.lm_head.as_ref().unwrap_or(&self.embd);
        let mut logits = vec![0f32; rows * self.dims.vocab];
        let mm = self.mm();
        self.pool
            .install(|| mm(&[w.mat()], hidden, rows, &mut [&mut logits]));
        logits
    }
}

/// What a forward pass reads besides its layers: the shape, the norms' epsilon, the matrix
/// product (the numerics chosen), the embedding.
struct Net<'a> {
    d: Dims,
    eps: f32,
    mm: MatmulMany,
    embd: &'a QTensor,
    block: &'a Block,
}

/// A layer's routed experts between [`Stage::GateUp`] and [`Stage::Down`]: each chosen expert, its
/// tokens (row, routing weight) and their SiLU(gate) x up rows `[tokens][expert ffn]`.
type Routed = Vec<(usize, Vec<(usize, f32)>, Vec<f32>)>;

/// One step's forward pass: its tokens' activations (`[tokens][...]`, batch order) and what the
/// stages of a layer hand each other.
struct Pass<'s, 'b> {
    batch: &'s [SeqStep<'b>],
    /// (batch entry, position) of every token
    tok_meta: Vec<(usize, usize)>,
    ids: Vec<u32>,
    /// the row of each entry's last token
    last_rows: Vec<usize>,
    /// attention blocks: runs of at most `ATT_BLOCK` consecutive tokens of one sequence
    blocks: Vec<(usize, usize)>,
    /// each token's RoPE factors (every layer's; sliding-window layers': `rope_local`)
    rope: Vec<Vec<(f32, f32)>>,
    rope_local: Option<Vec<Vec<(f32, f32)>>>,
    /// each sequence's K and V of the current layer, widened
    seq_kv: Vec<SeqKv>,
    /// the residual stream
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    /// routed experts in ascending expert order
    routed: Routed,
    split_parts: Vec<f32>,
}

impl<'s, 'b> Pass<'s, 'b> {
    fn new(
        batch: &'s [SeqStep<'b>],
        d: &Dims,
        (inv_freq, local, scale): (&[f32], Option<&[f32]>, f32),
    ) -> Self {
        let mut tok_meta: Vec<(usize, usize)> = Vec::new();
        let mut ids: Vec<u32> = Vec::new();
        let mut last_rows = Vec::with_capacity(batch.len());
        for (e, s) in batch.iter().enumerate() {
            for (j, &t) in s.tokens.iter().enumerate() {
                tok_meta.push((e, s.start_pos + j));
                ids.push(t);
            }
            last_rows.push(ids.len() - 1);
        }
        const ATT_BLOCK: usize = 16;
        let mut blocks: Vec<(usize, usize)> = Vec::new();
        let mut first = 0;
        for s in batch {
            let end = first + s.tokens.len();
            let mut b0 = first;
            while b0 < end {
                let b1 = (b0 + ATT_BLOCK).min(end);
                blocks.push((b0, b1));
                b0 = b1;
            }
            first = end;
        }
        let factors = |inv: &[f32]| -> Vec<Vec<(f32, f32)>> {
            tok_meta
                .iter()
                .map(|&(_, pos)| {
                    let mut f = crate::rope::rope_factors(d.head_dim, pos, inv);
                    if scale != 1.0 {
                        f.iter_mut()
                            .for_each(|(c, s)| (*c, *s) = (*c * scale, *s * scale));
                    }
                    f
                })
                .collect()
        };
        let rope = factors(inv_freq);
        let rope_local = local.map(factors);
        let n = ids.len();
        let z = |w: usize| vec![0f32; n * w];
        Pass {
            batch,
            seq_kv: batch.iter().map(|_| SeqKv::default()).collect(),
            tok_meta,
            last_rows,
            blocks,
            rope,
            rope_local,
            x: z(d.hidden),
            xn: z(d.hidden),
            q: z(d.qd()),
            k: z(d.kd()),
            v: z(d.kd()),
            att: z(d.qd()),
            o: z(d.hidden),
            g: z(d.ffn),
            u: z(d.ffn),
            routed: Vec::new(),
            split_parts: Vec::new(),
            ids,
        }
    }

    /// [`Stage::Embed`]: the tokens' embedding rows, dequantised, into `x`.
    fn embed(&mut self, net: &Net<'_>) {
        let (h, e) = (net.d.hidden, net.embd);
        let erb = e.mat().row_bytes();
        for (row, &t) in self.x.chunks_exact_mut(h).zip(&self.ids) {
            let t = t as usize;
            dequantize_row(e.dtype, &e.data[t * erb..(t + 1) * erb], row)
                .expect("validated at load");
            if let Some(s) = net.block.embed_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
    }

    /// One stage of layer `li` (one of [`Stage::LAYER`]).
    fn layer_stage(
        &mut self,
        stage: Stage,
        net: &Net<'_>,
        (li, l): (usize, &Layer),
        kv: &mut KvPool,
    ) {
        let d = net.d;
        let (h, qd, kvd, hd) = (d.hidden, d.qd(), d.kd(), d.head_dim);
        let (n, mm, eps) = (self.ids.len(), net.mm, net.eps);
        match stage {
            Stage::Qkv => {
                for (xr, xnr) in self.x.chunks_exact(h).zip(self.xn.chunks_exact_mut(h)) {
                    ops::rmsnorm(xr, &l.attn_norm, eps, xnr);
                }
                let (q, k, v) = (&mut self.q, &mut self.k, &mut self.v);
                let w = [l.wq.mat(), l.wk.mat(), l.wv.mat()];
                mm(&w, &self.xn, n, &mut [&mut q[..], &mut k[..], &mut v[..]]);
                if let Some(bias) = &l.qkv_bias {
                    for (rows, b) in [
                        (&mut *q, &bias[0]),
                        (&mut *k, &bias[1]),
                        (&mut *v, &bias[2]),
                    ] {
                        for r in rows.chunks_exact_mut(b.len()) {
                            ops::add_inplace(r, b);
                        }
                    }
                }
                if let Some((qn, kn)) = &l.qk_norm {
                    let mut head = vec![0f32; hd];
                    for (rows, w) in [(&mut *q, qn), (&mut *k, kn)] {
                        for r in rows.chunks_exact_mut(hd) {
                            head.copy_from_slice(r);
                            ops::rmsnorm(&head, w, eps, r);
                        }
                    }
                }
                let rope = match (&self.rope_local, l.window) {
                    (Some(local), w) if w != usize::MAX => local,
                    _ => &self.rope,
                };
                for (i, &(e, pos)) in self.tok_meta.iter().enumerate() {
                    crate::rope::rope_apply(&mut q[i * qd..(i + 1) * qd], hd, &rope[i]);
                    crate::rope::rope_apply(&mut k[i * kvd..(i + 1) * kvd], hd, &rope[i]);
                    let at = kv.at(self.batch[e].blocks, li, pos);
                    kv.k.write(at, &k[i * kvd..(i + 1) * kvd]);
                    kv.v.write(at, &v[i * kvd..(i + 1) * kvd]);
                }
            }
            Stage::Attention => {
                // each sequence's positions 0..=its last, read back (widened) from its blocks
                let kv_ro: &KvPool = kv;
                self.seq_kv
                    .par_iter_mut()
                    .zip(self.batch)
                    .for_each(|(sk, s)| {
                        let n_pos = s.start_pos + s.tokens.len();
                        kv_ro.gather(s.blocks, li, n_pos, &mut sk.k, &mut sk.v);
                    });
                attention_layer(
                    &d,
                    &self.q,
                    &self.seq_kv,
                    &self.tok_meta,
                    &self.blocks,
                    (net.block.attn_scale, l.window, l.sinks.as_deref()),
                    &mut self.att,
                    &mut self.split_parts,
                );
            }
            Stage::Out => {
                mm(&[l.wo.mat()], &self.att, n, &mut [&mut self.o]);
                if let Some(b) = &l.o_bias {
                    self.o
                        .chunks_exact_mut(h)
                        .for_each(|r| ops::add_inplace(r, b));
                }
                if let Some((post, _)) = &l.post_norms {
                    norm_rows(&mut self.o, post, eps);
                }
                ops::add_inplace(&mut self.x, &self.o);
            }
            Stage::GateUp => {
                for (xr, xnr) in self.x.chunks_exact(h).zip(self.xn.chunks_exact_mut(h)) {
                    ops::rmsnorm(xr, &l.ffn_norm, eps, xnr);
                }
                match &l.ffn {
                    Ffn::Dense { gate, up, .. } => {
                        let (g, u) = (&mut self.g, &mut self.u);
                        mm(
                            &[gate.mat(), up.mat()],
                            &self.xn,
                            n,
                            &mut [&mut g[..], &mut u[..]],
                        );
                        for (ur, gr) in u.chunks_exact_mut(d.ffn).zip(g.chunks_exact(d.ffn)) {
                            match net.block.gelu {
                                true => ops::geglu_tanh_inplace(gr, ur),
                                false => ops::swiglu_inplace(gr, ur),
                            }
                        }
                    }
                    Ffn::Moe {
                        router,
                        experts,
                        moe,
                        oai,
                    } => {
                        self.routed = routed_gate_up(
                            mm,
                            (router, experts, *moe, oai.as_ref()),
                            &self.xn,
                            n,
                            h,
                        )
                    }
                }
            }
            Stage::Down => {
                match &l.ffn {
                    Ffn::Dense { down, .. } => mm(&[down.mat()], &self.u, n, &mut [&mut self.o]),
                    Ffn::Moe { experts, oai, .. } => {
                        // each chosen expert once over its tokens, weighted, experts in index order
                        self.o.fill(0.0);
                        for (e, toks, u) in &self.routed {
                            let mut y = vec![0f32; toks.len() * h];
                            mm(&[experts[*e][2].mat()], u, toks.len(), &mut [&mut y]);
                            if let Some(oai) = oai {
                                let b = &oai.experts[*e][2];
                                y.chunks_exact_mut(h).for_each(|r| ops::add_inplace(r, b));
                            }
                            for (yr, &(t, w)) in y.chunks_exact(h).zip(toks) {
                                for (o, v) in self.o[t * h..(t + 1) * h].iter_mut().zip(yr) {
                                    *o += w * v;
                                }
                            }
                        }
                    }
                }
                if let Some((_, post)) = &l.post_norms {
                    norm_rows(&mut self.o, post, eps);
                }
                ops::add_inplace(&mut self.x, &self.o);
            }
            Stage::Embed | Stage::LmHead => unreachable!("{stage:?} is not a layer stage"),
        }
    }
}

/// Each row of `rows` RMS-normalised in place with weights `w` (the post-norms).
fn norm_rows(rows: &mut [f32], w: &[f32], eps: f32) {
    let mut tmp = vec![0f32; w.len()];
    for r in rows.chunks_exact_mut(w.len()) {
        tmp.copy_from_slice(r);
        ops::rmsnorm(&tmp, w, eps, r);
    }
}

/// The routed experts' first half over `n` tokens (`xn`, `[n][h]`, normed): each token routed
/// ([`route`]) by `router` over `experts` (each one's gate, up, down), then every expert that any
/// token chose runs its gate and up products once over its tokens (gathered) and SiLU(gate) x up,
/// experts in index order.
fn routed_gate_up(
    mm: MatmulMany,
    (router, experts, moe, oai): (
        &QTensor,
        &[[QTensor; 3]],
        metrale_model::config::Moe,
        Option<&OaiExperts>,
    ),
    xn: &[f32],
    n: usize,
    h: usize,
) -> Routed {
    let mut logits = vec![0f32; n * moe.experts];
    mm(&[router.mat()], xn, n, &mut [&mut logits]);
    if let Some(oai) = oai {
        logits
            .chunks_exact_mut(moe.experts)
            .for_each(|r| ops::add_inplace(r, &oai.router));
    }
    let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); moe.experts];
    for (t, row) in logits.chunks_exact(moe.experts).enumerate() {
        for (e, w) in route(row, moe.used, moe.norm_topk) {
            by_expert[e].push((t, w));
        }
    }
    let mut out = Vec::new();
    for (e, toks) in by_expert.into_iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let m = toks.len();
        let mut xe = vec![0f32; m * h];
        for (row, &(t, _)) in xe.chunks_exact_mut(h).zip(&toks) {
            row.copy_from_slice(&xn[t * h..(t + 1) * h]);
        }
        let [gate, up, _] = &experts[e];
        let (mut g, mut u) = (vec![0f32; m * moe.ffn], vec![0f32; m * moe.ffn]);
        mm(&[gate.mat(), up.mat()], &xe, m, &mut [&mut g, &mut u]);
        for (ur, gr) in u.chunks_exact_mut(moe.ffn).zip(g.chunks_exact_mut(moe.ffn)) {
            match oai {
                Some(oai) => {
                    let [bg, bu, _] = &oai.experts[e];
                    ops::add_inplace(gr, bg);
                    ops::add_inplace(ur, bu);
                    ops::swiglu_oai_inplace(gr, ur);
                }
                None => ops::swiglu_inplace(gr, ur),
            }
        }
        out.push((e, toks, u));
    }
    out
}

/// One layer's attention for every token of the step (queries `q`, `[n][qd]`; outputs `att`,
/// `[n][qd]`), in parallel over tasks of (block of consecutive tokens of one sequence, KV head):
/// each reads that KV head's cache rows once for the block and writes the group's heads. A block of
/// one token (a decode) whose context spans several [`ops::ATT_CHUNK`]s is also split by chunk
/// ranges, so that at long contexts every thread shares its attention; those partials are combined
/// after the parallel region, into the same bits the unsplit computation gives (`ops::attention_block`).
#[allow(clippy::too_many_arguments)]
fn attention_layer(
    d: &Dims,
    q: &[f32],
    kv: &[SeqKv],
    tok_meta: &[(usize, usize)],
    blocks: &[(usize, usize)],
    (scale, window, sinks): (f32, usize, Option<&[f32]>),
    att: &mut [f32],
    parts: &mut Vec<f32>,
) {
    let (hd, qd, kvd) = (d.head_dim, d.qd(), d.kd());
    let gs = d.heads / d.kv_heads;
    let pl = ops::partial_len(hd);
    let chunks = |ti: usize| (tok_meta[ti].1 + 1).div_ceil(ops::ATT_CHUNK);
    // decode tokens split by chunk ranges: (token, chunks, pieces per KV head)
    let split: Vec<(usize, usize)> = blocks
        .iter()
        .filter(|&&(b0, b1)| b1 - b0 == 1 && chunks(b0) > 1)
        .map(|&(b0, _)| (b0, chunks(b0)))
        .collect();
    let want_tasks = 4 * rayon::current_num_threads();
    let pieces = if split.is_empty() {
        1
    } else {
        want_tasks.div_ceil(split.len() * d.kv_heads).max(1)
    };
    parts.resize(
        split.iter().map(|&(_, nc)| nc).sum::<usize>() * d.kv_heads * gs * pl,
        0.0,
    );

    enum Task<'a> {
        Whole(usize, usize, usize, Vec<&'a mut [f32]>),
        Part(usize, usize, (usize, usize), &'a mut [f32]),
    }
    let mut outs: Vec<Option<&mut [f32]>> = att.chunks_mut(gs * hd).map(Some).collect();
    let mut tasks = Vec::new();
    let mut rest: &mut [f32] = parts;
    for &(b0, b1) in blocks {
        if let Some(&(_, nc)) = split.iter().find(|s| s.0 == b0) {
            for g in 0..d.kv_heads {
                let per = nc.div_ceil(pieces.min(nc));
                for c0 in (0..nc).step_by(per) {
                    let c1 = (c0 + per).min(nc);
                    let (mine, more) = std::mem::take(&mut rest).split_at_mut((c1 - c0) * gs * pl);
                    rest = more;
                    tasks.push(Task::Part(b0, g, (c0, c1), mine));
                }
            }
            continue;
        }
        for g in 0..d.kv_heads {
            let o: Vec<&mut [f32]> = (b0..b1)
                .map(|ti| outs[ti * d.kv_heads + g].take().expect("each piece once"))
                .collect();
            tasks.push(Task::Whole(b0, b1, g, o));
        }
    }
    let kv_of = |ti: usize, g: usize, n_pos: usize| {
        let c = &kv[tok_meta[ti].0];
        ops::KvHead {
            k: &c.k[..n_pos * kvd],
            v: &c.v[..n_pos * kvd],
            kv_dim: kvd,
            g,
            head_dim: hd,
            window,
        }
    };
    tasks.into_par_iter().for_each_init(
        || (Vec::new(), Vec::new()),
        |scratch, task| match task {
            Task::Whole(b0, b1, g, mut o) => {
                let qs: Vec<&[f32]> = (b0..b1).map(|ti| &q[ti * qd..(ti + 1) * qd]).collect();
                let pos: Vec<usize> = (b0..b1).map(|ti| tok_meta[ti].1).collect();
                let n_pos = pos.iter().max().map_or(0, |p| p + 1);
                let kvh = kv_of(b0, g, n_pos);
                ops::attention_block(
                    &qs,
                    &pos,
                    kvh.k,
                    kvh.v,
                    g,
                    d.heads,
                    d.kv_heads,
                    (hd, scale, window),
                    sinks,
                    scratch,
                    &mut o,
                );
            }
            Task::Part(ti, g, c, part) => {
                let pos = tok_meta[ti].1;
                let qs = [&q[ti * qd..(ti + 1) * qd]];
                ops::attention_partials(
                    &qs,
                    &[pos],
                    kv_of(ti, g, pos + 1),
                    gs,
                    scale,
                    c,
                    &mut scratch.0,
                    part,
                );
            }
        },
    );
    drop(outs);
    // combine the split tokens' partials (laid out [token][KV head][chunk][head] in `parts`)
    let mut at = 0;
    for &(ti, nc) in &split {
        for g in 0..d.kv_heads {
            for hh in 0..gs {
                let h = g * gs + hh;
                ops::attention_combine(
                    &parts[at + hh * pl..],
                    gs * pl,
                    nc,
                    sinks.map(|s| s[h]),
                    &mut att[ti * qd + h * hd..ti * qd + (h + 1) * hd],
                );
            }
            at += nc * gs * pl;
        }
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> BackendInfo {
        let kv_bytes = self.kv.k.bytes() + self.kv.v.bytes();
        BackendInfo {
            name: "cpu".into(),
            device: format!(
                "cpu ({} threads, {}, {} activations)",
                self.threads,
                ops::simd_level(),
                if self.exact { "f32" } else { "16-bit integer" }
            ),
            slots: self.slots,
            slot_capacity: self.slot_capacity,
            kv_blocks: self.kv.blocks,
            kv_dtype: self.kv.dtype,
            weight_bytes: self.weight_bytes(),
            kv_bytes,
            verifies_drafts: true,
            // a 505-token prompt of the default model on 2 cores: 1,311-1,324 ms to the first
            // token over HTTP in chunks of 256, 1,479-1,512 ms in one step of 505 (the server's
            // --long-prefill-token-threshold, 2026-12-07, bench/cpu/NOTES.md)
            prefill_chunk: Some(256),
        }
    }

    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<SeqOutput>, BackendError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        self.validate(batch)?;
        let hidden = self.forward_hidden(batch);
        let vocab = self.dims.vocab;
        let mut logits = self.lm_head(&hidden, hidden.len() / self.dims.hidden);
        // each entry's rows: one, or one per proposal and one after them
        let mut entries: Vec<&mut [f32]> = Vec::with_capacity(batch.len());
        let mut rest = &mut logits[..];
        for s in batch {
            let (mine, more) = rest.split_at_mut((s.drafted + 1) * vocab);
            if let Some(m) = s.allowed {
                sampler::apply_mask(mine, m); // one row: masks and proposals exclude each other
            }
            entries.push(mine);
            rest = more;
        }
        let outs = self.pool.install(|| {
            batch
                .par_iter()
                .zip(entries.into_par_iter())
                .map(|(s, rows)| {
                    let proposed = &s.tokens[s.tokens.len() - s.drafted..];
                    let (accepted, r) =
                        sampler::verify_run(rows, vocab, s.sampling, s.history, s.draw, proposed);
                    SeqOutput {
                        token: r.token,
                        logprob: r.logprob,
                        top_logprobs: r.top_logprobs,
                        logits: s.want_logits.then(|| rows.to_vec()),
                        accepted,
                    }
                })
                .collect()
        });
        Ok(outs)
    }

    fn hidden(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<HiddenSums>, BackendError> {
        self.validate(batch)?;
        let h = self.dims.hidden;
        let (x, last_rows) = self.forward_layers(batch);
        let mut row = vec![0f32; h];
        let mut first = 0;
        Ok(batch
            .iter()
            .zip(&last_rows)
            .map(|(_, &last)| {
                let mut sums = HiddenSums {
                    sum: vec![0f32; h],
                    last: Vec::new(),
                    tokens: last + 1 - first,
                };
                for r in first..=last {
                    ops::rmsnorm(
                        &x[r * h..(r + 1) * h],
                        &self.out_norm,
                        self.norm_eps,
                        &mut row,
                    );
                    ops::add_inplace(&mut sums.sum, &row);
                }
                sums.last = row.clone();
                first = last + 1;
                sums
            })
            .collect())
    }

    fn release(&mut self, _slot: SlotId) {
        // Nothing to do: no per-slot state; the blocks are the caller's (the engine's prefix
        // caching hands full ones to later prompts; every other row is written before it is read).
    }
}

#[cfg(test)]
mod tests;
