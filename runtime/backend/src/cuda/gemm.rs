//! The GEMM path: the four layer products of a chunk as GEMMs with fused epilogues (RoPE + KV-cache
//! write, residual add, SiLU * up), and the scratch they need. Two implementations:
//! - on Hopper (`Gpu::hopper_gemm`: sm_90a cubins; bf16 weights, or q4_1 weights where the target
//!   asks for f16 GEMM activations), 16-bit activations (bf16; f16 against quantized weights,
//!   which each thread dequantises into its MMA fragments in registers: W4A16): the QKV and
//!   gate/up products' from the O and down products' epilogues (below) or `gemm_hopper.cu.hbs`'s
//!   `wg_act_norm`, the head's from `wg_act_head`, the O and down products' the attention's and
//!   the gate/up epilogue's output, written in that type ([`ActType`]); then warpgroup MMAs
//!   (wgmma): for bf16 weights from
//!   [`TMA_MIN_TOKENS`] tokens the warp-specialised kernels of `gemm_tma.cu.hbs` (a producer
//!   thread's bulk tensor copies into a ring of stages, two consumer warpgroups, persistent tiles
//!   of 64-128 tokens by 128-256 weight rows, K split where the tiles are few: `plan::tma_plan`),
//!   below it `gemm_hopper.cu.hbs`'s (one warpgroup, cp.async, weight rows on the instruction's M
//!   side so that a 16-token tile wastes nothing: `plan::wg_plan`); for q4_1 weights its
//!   warp-specialised `wq_*` (`plan::wq_plan`), and for chunks of at most `abi::WN_TOKENS` tokens
//!   its narrow `wn_*` on mma.sync, each warp's weight rows streamed into registers
//!   (`plan::wn_plan`: a verification step's products cost about what one token's do);
//! - elsewhere, `gemm.cu.hbs` on mma.sync, each product's activations split once into f16 hi/lo
//!   pairs and block sums (RMSNorm folded into the split), exact to the f32 reference's ~1e-6.
//!
//! The backend uses this path for chunks where it pays ([`gemm_pays`]: from [`MIN_TOKENS`] tokens,
//! earlier where the matrix-vector tiles are short), decode steps of that many sequences included
//! (inside their CUDA graphs; `Tuning::decode_gemm` turns that off): the matrix-vector kernels
//! re-read every weight once per token tile, which at 8B and 256 sequences is ~160 passes over
//! 16 GB per step. Attention, embedding and the LM head are the same kernels on
//! both paths.
//!
//! On the Hopper path the QKV and gate/up products read their RMSNorm unscaled (`act_t(x * w)`) with
//! the squares of x per `abi::SS_COLS` columns in `ss`, and scale each token's outputs by its norm
//! factor; the O and down products can write that input for the product after them (their `next`:
//! [`GemmPath::out_proj`], [`GemmPath::down`]), which then runs with no conversion
//! ([`GemmPath::gate_up`], [`GemmPath::qkv`]; `Tuning::fused_norm`).
//!
//! Invariants: the activation scratch (`hi`, `lo`: 16-bit `[max_tokens][max K]`, `sx`: f32
//! `[max_tokens][max K / 32]`; the Hopper path uses `hi` alone, as bf16 or f16, with `ss`) is
//! written by a conversion kernel or by the product before it, right before the GEMM that reads
//! it, in stream order; the split-K tickets are zero between launches (the last split of a tile
//! resets its own); nothing here allocates after [`GemmPath::new`].

use std::collections::HashMap;
use std::sync::Mutex;

use metrale_abi as abi;
use metrale_core::BackendError;

use super::device::DevBuf;
use super::launch::Gpu;
use super::plan::{self, TmaPlan};
use super::weights::DevMat;

/// Chunks of this many tokens always take the GEMM path (measured on SmolLM2, where the
/// matrix-vector kernels' tiles are 8 tokens: bench/cuda/NOTES.md, pf4).
pub const MIN_TOKENS: usize = 48;

/// Below [`MIN_TOKENS`], the GEMM path is taken once the matrix-vector kernels would stream the
/// layer weights this many times (on average over the four products, by bytes). SmolLM2 never
/// reaches it below 48 tokens (7.0 passes at 41-47), so its measured choice stands; the 8B shape,
/// whose tiles are 2 tokens (K = 4096) and 1 (K = 14336), reaches it at 13 tokens, where the
/// matrix-vector kernels measured ~43 ms a step at 16 sequences (10 passes over 16 GB) against
/// ~10-14 ms for one 32-token GEMM tile (its 512-token prefill and 256-sequence steps).
pub const GEMM_MIN_PASSES: f64 = 8.0;

/// How many times the matrix-vector kernels read a layer's weights for a chunk of `ntok` tokens:
/// each product once per token tile of its row length (`metrale_abi::layout::tok_tile`), averaged
/// over the four products by their sizes.
pub fn matvec_passes(d: &metrale_core::shape::Dims, ntok: usize) -> f64 {
    use metrale_abi::layout::tok_tile;
    let products = [
        ((d.qd() + 2 * d.kd()) * d.hidden, d.hidden), // qkv
        (d.hidden * d.qd(), d.qd()),                  // o
        (2 * d.ffn * d.hidden, d.hidden),             // gate/up
        (d.hidden * d.ffn, d.ffn),                    // down
    ];
    let total: usize = products.iter().map(|p| p.0).sum();
    let reads: usize = products
        .iter()
        .map(|&(size, k)| size * ntok.max(1).div_ceil(tok_tile(k)))
        .sum();
    reads as f64 / total.max(1) as f64
}

/// Whether a chunk of `ntok` tokens runs its layer products as GEMMs: from [`MIN_TOKENS`], or
/// earlier where the matrix-vector kernels would read the weights [`GEMM_MIN_PASSES`] times.
pub fn gemm_pays(d: &metrale_core::shape::Dims, ntok: usize) -> bool {
    ntok >= MIN_TOKENS || matvec_passes(d, ntok) >= GEMM_MIN_PASSES
}

/// Whether a chunk of `ntok` tokens runs its layer products as GEMMs on the path the backend
/// runs: the Hopper GEMMs read the weights once for up to 128 tokens, at about the rate the
/// matrix-vector kernels read them for one (H200, 8B bf16, 2026-12-02: 122.8 against 117.3 us per
/// layer at one token), so they pay as soon as the matrix-vector kernels would read the weights
/// more than once (2 tokens at the 8B shape, whose down projection stages one token at a time);
/// the mma.sync GEMMs from [`gemm_pays`].
pub fn gemm_pays_on(d: &metrale_core::shape::Dims, ntok: usize, hopper: bool) -> bool {
    if hopper {
        matvec_passes(d, ntok) > 1.0
    } else {
        gemm_pays(d, ntok)
    }
}

/// The fewest tokens for which [`gemm_pays_on`] (for the start-up log).
pub fn gemm_from(d: &metrale_core::shape::Dims, hopper: bool) -> usize {
    (1..MIN_TOKENS)
        .find(|&n| gemm_pays_on(d, n, hopper))
        .unwrap_or(MIN_TOKENS)
}

/// Chunks of this many tokens and more run the Hopper products on the warp-specialised kernels
/// (`gemm_tma.cu.hbs`) where `Gpu::tma_gemm` and a tile divides the product's rows; fewer on
/// `gemm_hopper.cu.hbs`'s, whose weight rows sit on the instruction's M side so a 16-token tile
/// wastes no MMA work. Measured on the 8B shape (H200, 2026-12-03, bench/gemm/README.md): at 16
/// tokens `gemm_hopper`'s QKV took 17.7 us against the best warp-specialised launch's 23.5; at 32
/// the warp-specialised 64 x 128 tiles took 19.7 against 23.9 (O 12.4 against 16.5, down 36.2
/// against 42.3).
pub const TMA_MIN_TOKENS: usize = 32;

/// The inputs of the QKV product besides the activations and weights (what `attn_in` also takes).
#[derive(Debug, Clone, Copy)]
pub struct QkvOut {
    pub rope: u64,
    pub q: u64,
    pub kc: u64,
    pub vc: u64,
    pub pos: u64,
    pub slot: u64,
    pub tables: u64,
    pub layer: i32,
    pub max_blocks: i32,
}

impl QkvOut {
    /// The matrix-vector QKV product of `ntok` tokens of `x` (normed by `norm_w`) into these
    /// outputs.
    pub fn attn_in(self, x: u64, norm_w: u64, w: &DevMat, ntok: usize) -> abi::AttnIn {
        abi::AttnIn {
            x,
            norm_w,
            wqs: w.qs.ptr,
            wsc: w.sc_ptr(),
            rope: self.rope,
            q: self.q,
            kc: self.kc,
            vc: self.vc,
            pos: self.pos,
            slot: self.slot,
            tables: self.tables,
            layer: self.layer,
            max_blocks: self.max_blocks,
            ntok: ntok as i32,
        }
    }

    /// `qkv_rope` of `ntok` tokens' raw QKV rows `raw` into these outputs; `bias`: the Q, K and V
    /// biases (`[qd + 2 kd]` f32) or 0; `qk_norm`: the Q heads' norm weights then the K heads'
    /// (`head_dim` f32 each) or 0.
    pub fn qkv_rope(
        self,
        raw: u64,
        (bias, qk_norm): (u64, u64),
        head_dim: usize,
        ntok: usize,
    ) -> abi::QkvRope {
        let (q_norm, k_norm) = qk_norms(qk_norm, head_dim);
        abi::QkvRope {
            qkv: raw,
            bias,
            q_norm,
            k_norm,
            rope: self.rope,
            q: self.q,
            kc: self.kc,
            vc: self.vc,
            pos: self.pos,
            slot: self.slot,
            tables: self.tables,
            layer: self.layer,
            max_blocks: self.max_blocks,
            ntok: ntok as i32,
        }
    }

    /// One token's `attn_in` and `qkv_rope` as one launch (`attn_in_head`) of `x` (normed by
    /// `norm_w`) into these outputs; `bias` and `qk_norm` as [`QkvOut::qkv_rope`]'s.
    pub fn attn_in_head(
        self,
        x: u64,
        norm_w: u64,
        w: &DevMat,
        (bias, qk_norm): (u64, u64),
        head_dim: usize,
    ) -> abi::AttnInHead {
        let (q_norm, k_norm) = qk_norms(qk_norm, head_dim);
        abi::AttnInHead {
            x,
            norm_w,
            wqs: w.qs.ptr,
            wsc: w.sc_ptr(),
            bias,
            q_norm,
            k_norm,
            rope: self.rope,
            q: self.q,
            kc: self.kc,
            vc: self.vc,
            pos: self.pos,
            slot: self.slot,
            tables: self.tables,
            layer: self.layer,
            max_blocks: self.max_blocks,
        }
    }
}

/// The Q heads' and the K heads' norm weights in `qk_norm` (`head_dim` f32 each, q's first), or
/// 0 and 0 where the family has none.
fn qk_norms(qk_norm: u64, head_dim: usize) -> (u64, u64) {
    match qk_norm {
        0 => (0, 0),
        p => (p, p + (head_dim * 4) as u64),
    }
}

/// One product of the Hopper GEMM path, with where its epilogue writes.
#[derive(Debug, Clone, Copy)]
pub enum Product {
    /// QKV projection, RoPE, q out and K/V into the cache.
    Qkv(QkvOut),
    /// x += att * Wo^T, att as the attention wrote it ([`GemmPath::act_type`]); with `next` (the
    /// RMSNorm weight of the product after it), also that product's input (module docs)
    Out { att: u64, x: u64, next: Option<u64> },
    /// h = SiLU(gate) * up (gate and up rows interleaved), in the activations' 16-bit type
    /// ([`GemmPath::act_type`])
    GateUp { h: u64 },
    /// x += h * Wdown^T, h as the gate/up product wrote it; `next` as `Out`'s
    Down { h: u64, x: u64, next: Option<u64> },
    /// logits = a * Whead^T (a bf16 head)
    Head { logits: u64 },
}

impl Product {
    /// Where its activations are when not in the conversion scratch: the attention output for the
    /// O product, `h` for the down product.
    fn input(&self) -> Option<u64> {
        match self {
            Product::Down { h, .. } => Some(*h),
            Product::Out { att, .. } => Some(*att),
            _ => None,
        }
    }

    /// Whether its epilogue adds to the residual stream (O, down), and may write the next
    /// product's input with it (`plan::tma_norm_out`).
    pub fn residual(&self) -> bool {
        matches!(self, Product::Out { .. } | Product::Down { .. })
    }

    /// Its short name (the benchmarks' tables).
    pub fn name(&self) -> &'static str {
        match self {
            Product::Qkv(_) => "qkv",
            Product::Out { .. } => "o",
            Product::GateUp { .. } => "gate_up",
            Product::Down { .. } => "down",
            Product::Head { .. } => "lm_head",
        }
    }

    /// (output rows, row length) of its weight matrix at shape `d`: what its kernels are compiled for.
    pub fn shape(&self, d: &metrale_core::shape::Dims) -> (usize, usize) {
        match self {
            Product::Qkv(_) => (d.qd() + 2 * d.kd(), d.hidden),
            Product::Out { .. } => (d.hidden, d.qd()),
            Product::GateUp { .. } => (2 * d.ffn, d.hidden),
            Product::Down { .. } => (d.hidden, d.ffn),
            Product::Head { .. } => (d.vocab, d.hidden),
        }
    }
}

/// A tensor map's inputs: (address, rows, row length, box rows).
type MapKey = (u64, usize, usize, u32);

/// The most tensor maps [`GemmPath`] keeps encoded (each layer's four matrices and the head, the
/// scratch's maps, and att's and h's, one per chunk length seen).
const MAX_MAPS: usize = 1024;

/// The element type in which the attention output and the FFN activation `h` reach the O and down
/// products (the attention kernels write it with `abi::ATT_FLAG_OUT16`, the gate/up product's
/// epilogue always).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActType {
    /// the mma.sync path: f32 (split into f16 pairs by each product's conversion)
    F32,
    /// the Hopper path with bf16 weights: the down product's bf16 activations
    Bf16,
    /// the Hopper path with quantized weights (W4A16): f16, saturated at +-65504
    F16,
}

impl ActType {
    /// The Hopper path's type for bf16 weights or quantized ones (`Gpu::weights_bf16`).
    pub fn hopper(weights_bf16: bool) -> ActType {
        if weights_bf16 {
            ActType::Bf16
        } else {
            ActType::F16
        }
    }
}

/// The GEMM path of one backend: which kernels it runs, and their scratch.
pub struct GemmPath {
    hi: DevBuf,
    /// The Hopper path's squares of the residual per `abi::SS_COLS` columns (`[max_tokens][hidden
    /// / SS_COLS]`, f32), beside the unscaled RMSNorm in `hi` (module docs).
    ss: DevBuf,
    lo: DevBuf,
    sx: DevBuf,
    max_tokens: usize,
    /// The longest row of the products (the activation scratch is `[max_tokens][kmax]`).
    kmax: usize,
    /// The Hopper path's split-K partials and tickets (the larger of `plan::wg_scratch_bytes` and
    /// `plan::tma_scratch_bytes`), where it runs.
    hopper: Option<(DevBuf, DevBuf)>,
    /// Chunks of [`TMA_MIN_TOKENS`] and more run on the warp-specialised kernels (`Gpu::tma_gemm`).
    tma: bool,
    /// The 96-row tiles may be planned (`Gpu::tma_96`).
    tma_96: bool,
    /// The tensor maps encoded so far (encoding is pure, so a map is reused wherever its inputs
    /// recur: every layer's weights after the first chunk).
    maps: Mutex<HashMap<MapKey, abi::TmaMap>>,
    /// The LM head of several outputs runs on the Hopper GEMM too (a bf16 head whose rows are a
    /// multiple of `WG_BM`).
    hopper_head: bool,
    /// How the O and down products' activations arrive.
    act_type: ActType,
}

impl GemmPath {
    /// Allocate the scratch for chunks of up to `max_tokens` tokens on the path `gpu` runs.
    pub fn new(gpu: &Gpu, max_tokens: usize) -> Result<GemmPath, BackendError> {
        let d = gpu.dims;
        let kmax = d.hidden.max(d.qd()).max(d.ffn);
        let hopper = if gpu.hopper_gemm {
            if !d.hidden.is_multiple_of(abi::SS_COLS as usize) {
                return Err(BackendError::Invalid(format!(
                    "the Hopper GEMM path needs a hidden size that is a multiple of {} (the RMSNorm \
                     partials), got {}; build the target without it (METRALE_CUDA_TUNING=hopper_gemm=off)",
                    abi::SS_COLS,
                    d.hidden
                )));
            }
            let (ws, tickets) = plan::wg_scratch_bytes(gpu.sm_count);
            let (tws, ttickets) = plan::tma_scratch_bytes(gpu.sm_count);
            Some((gpu.alloc(ws.max(tws))?, gpu.alloc(tickets.max(ttickets))?))
        } else {
            None
        };
        // the Hopper path needs no lo half and no block sums
        let split = if hopper.is_some() { 0 } else { max_tokens };
        let hopper_head =
            hopper.is_some() && gpu.head_gemm() && d.vocab.is_multiple_of(abi::WG_BM as usize);
        let act_type = match hopper {
            Some(_) => ActType::hopper(gpu.weights_bf16()),
            None => ActType::F32,
        };
        let ss_len = if hopper.is_some() {
            max_tokens * (d.hidden / abi::SS_COLS as usize)
        } else {
            0
        };
        Ok(GemmPath {
            hi: gpu.alloc(max_tokens * kmax * 2)?,
            ss: gpu.alloc(ss_len * 4)?,
            lo: gpu.alloc(split * kmax * 2)?,
            sx: gpu.alloc(split * (kmax / 32) * 4)?,
            max_tokens,
            kmax,
            hopper,
            tma: gpu.tma_gemm,
            tma_96: gpu.tma_96,
            act_type,
            maps: Mutex::new(HashMap::new()),
            hopper_head,
        })
    }

    /// Whether the products run on the Hopper kernels.
    pub fn hopper(&self) -> bool {
        self.hopper.is_some()
    }

    /// The attention kernels' `flags` bits for a chunk whose O product runs here.
    pub fn att_flags(&self) -> i32 {
        if self.act_type == ActType::F32 {
            0
        } else {
            abi::ATT_FLAG_OUT16 as i32
        }
    }

    /// What the attention writes for [`Self::out_proj`] (with [`Self::att_flags`]) and
    /// [`Self::norm_gate_up`] for [`Self::down`].
    pub fn act_type(&self) -> ActType {
        self.act_type
    }

    /// Where an O or down product with `next` writes the product after it's input: (`an`,
    /// `norm_w`), the conversion scratch and the norm weight; (0, 0) for none.
    fn next_input(&self, p: &Product) -> (u64, u64) {
        match p {
            Product::Out { next: Some(w), .. } | Product::Down { next: Some(w), .. } => {
                (self.hi.ptr, *w)
            }
            _ => (0, 0),
        }
    }

    /// The conversion scratch and the squares' partials (`abi::SS_COLS`): where [`Self::qkv`] and
    /// [`Self::gate_up`] read their input (the kernel tests read them back).
    pub fn norm_scratch(&self) -> (&DevBuf, &DevBuf) {
        (&self.hi, &self.ss)
    }

    /// The QKV or gate/up product's input from the residual `x` (`wg_act_norm`: the unscaled
    /// RMSNorm and its squares, module docs).
    fn act_norm(&self, g: &Gpu, x: u64, norm_w: u64, ntok: i32) -> Result<(), BackendError> {
        let (a, ss) = (self.hi.ptr, self.ss.ptr);
        g.wg_act_norm(abi::WgActNorm {
            x,
            norm_w,
            a,
            ss,
            ntok,
        })
    }

    /// Which kernels run product `p` of `w` over `ntok` tokens: the warp-specialised launch
    /// (`plan::tma_plan`), or `None` for `gemm_hopper.cu.hbs`'s (fewer than [`TMA_MIN_TOKENS`]
    /// tokens, no tile divides `rows`, or `Gpu::tma_gemm` off).
    pub fn tma_plan(
        &self,
        sm_count: usize,
        p: &Product,
        w: &DevMat,
        ntok: usize,
    ) -> Option<TmaPlan> {
        if self.tma && ntok >= TMA_MIN_TOKENS {
            plan::tma_plan(w.rows, w.k, ntok, sm_count, p.residual(), self.tma_96)
        } else {
            None
        }
    }

    /// The tensor map of a bf16 matrix (`Device::tma_map_bf16`), encoded once per inputs.
    fn map(
        &self,
        g: &Gpu,
        ptr: u64,
        rows: usize,
        k: usize,
        box_rows: u32,
    ) -> Result<abi::TmaMap, BackendError> {
        let key = (ptr, rows, k, box_rows);
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = maps.get(&key) {
            return Ok(*m);
        }
        let m = g.tma_map_bf16(ptr, rows, k, box_rows)?;
        // att's and h's maps are one per chunk length: bound the cache (graphs hold their maps by
        // value)
        if maps.len() >= MAX_MAPS {
            maps.clear();
        }
        maps.insert(key, m);
        Ok(m)
    }

    /// Product `p` of the weights `w` over its 16-bit activations (`ntok` rows of `w.k`: what the
    /// conversion kernel last wrote to the scratch, or the O and down products' inputs), on the
    /// Hopper kernels: the warp-specialised launch `force` names, else the one
    /// [`Self::tma_plan`] chooses, else `gemm_hopper.cu.hbs`'s.
    pub fn hopper_product(
        &self,
        g: &Gpu,
        p: Product,
        w: &DevMat,
        ntok: usize,
        force: Option<TmaPlan>,
    ) -> Result<(), BackendError> {
        match force.or_else(|| self.tma_plan(g.sm_count, &p, w, ntok)) {
            Some(tp) => self.tma_product(g, p, w, ntok, tp),
            None => self.wgmma_product(g, p, w, ntok),
        }
    }

    /// The Hopper scratch (split-K partials, tickets), after checking `w` is the matrix `p`'s
    /// kernels are compiled for and `ntok` fits.
    fn hopper_args(
        &self,
        g: &Gpu,
        p: &Product,
        w: &DevMat,
        ntok: usize,
    ) -> Result<(i32, u64, u64), BackendError> {
        let n = self.check(ntok)?;
        let Some((ws, counters)) = &self.hopper else {
            return Err(BackendError::Invalid(
                "the Hopper GEMM kernels are not loaded (no sm_90a cubin, or q4_1 weights without \
                 `[quant] gemm_activations = \"f16\"`)"
                    .into(),
            ));
        };
        if p.shape(&g.dims) != (w.rows, w.k) {
            return Err(BackendError::Invalid(format!(
                "the {} product's kernels are compiled for a {:?} matrix, got {} x {}",
                p.name(),
                p.shape(&g.dims),
                w.rows,
                w.k
            )));
        }
        Ok((n, ws.ptr, counters.ptr))
    }

    /// Product `p` on the warp-specialised kernels (`gemm_tma.cu.hbs`) as `tp` plans it.
    pub fn tma_product(
        &self,
        g: &Gpu,
        p: Product,
        w: &DevMat,
        ntok: usize,
        tp: TmaPlan,
    ) -> Result<(), BackendError> {
        let (n, ws, counters) = self.hopper_args(g, &p, w, ntok)?;
        if !g.tma_gemm {
            return Err(BackendError::Invalid(
                "the warp-specialised GEMM kernels are not ready on this device".into(),
            ));
        }
        // the scratch's map covers all of it; att's and h's the chunk's rows (TMA reads zeros past
        // them)
        let (a, a_rows) = match p.input() {
            Some(a) => (a, ntok),
            None => (self.hi.ptr, self.max_tokens * self.kmax / w.k),
        };
        let amap = self.map(g, a, a_rows, w.k, abi::TMA_ABOX)?;
        let wmap = self.map(g, w.qs.ptr, w.rows, w.k, abi::TMA_WBOX)?;
        let (cfg, splits) = (tp.cfg as i32, tp.splits as i32);
        let (ss, (an, norm_w)) = (self.ss.ptr, self.next_input(&p));
        match p {
            Product::Qkv(o) => g.tma_gemm(
                &tp,
                abi::TmaQkv {
                    amap,
                    wmap,
                    rope: o.rope,
                    q: o.q,
                    kc: o.kc,
                    vc: o.vc,
                    pos: o.pos,
                    slot: o.slot,
                    tables: o.tables,
                    layer: o.layer,
                    max_blocks: o.max_blocks,
                    ntok: n,
                    cfg,
                    splits,
                    ws,
                    counters,
                    ss,
                },
            ),
            Product::Out { x, .. } => g.tma_gemm(
                &tp,
                abi::TmaO {
                    amap,
                    wmap,
                    x,
                    ntok: n,
                    cfg,
                    splits,
                    ws,
                    counters,
                    an,
                    norm_w,
                    ss,
                },
            ),
            Product::GateUp { h } => g.tma_gemm(
                &tp,
                abi::TmaGu {
                    amap,
                    wmap,
                    h,
                    ntok: n,
                    cfg,
                    splits,
                    ws,
                    counters,
                    ss,
                },
            ),
            Product::Down { x, .. } => g.tma_gemm(
                &tp,
                abi::TmaDown {
                    amap,
                    wmap,
                    x,
                    ntok: n,
                    cfg,
                    splits,
                    ws,
                    counters,
                    an,
                    norm_w,
                    ss,
                },
            ),
            Product::Head { logits } => g.tma_gemm(
                &tp,
                abi::TmaLogits {
                    amap,
                    wmap,
                    logits,
                    ntok: n,
                    cfg,
                    splits,
                    ws,
                    counters,
                },
            ),
        }
    }

    /// Product `p` on `gemm_hopper.cu.hbs`'s kernels (`plan::wg_plan`).
    pub fn wgmma_product(
        &self,
        g: &Gpu,
        p: Product,
        w: &DevMat,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let (n, ws, counters) = self.hopper_args(g, &p, w, ntok)?;
        let (a, wq) = (p.input().unwrap_or(self.hi.ptr), w.qs.ptr);
        let wsc = w.sc_ptr();
        let (ss, (an, norm_w)) = (self.ss.ptr, self.next_input(&p));
        match p {
            Product::Qkv(o) => g.wg_qkv(abi::WgQkv {
                a,
                w: wq,
                wsc,
                rope: o.rope,
                q: o.q,
                kc: o.kc,
                vc: o.vc,
                pos: o.pos,
                slot: o.slot,
                tables: o.tables,
                layer: o.layer,
                max_blocks: o.max_blocks,
                ntok: n,
                tile_n: 0,
                ws,
                counters,
                ss,
            }),
            Product::Out { x, .. } => g.wg_o(abi::WgO {
                a,
                w: wq,
                wsc,
                x,
                ntok: n,
                tile_n: 0,
                ws,
                counters,
                an,
                norm_w,
                ss,
            }),
            Product::GateUp { h } => g.wg_gu(abi::WgGu {
                a,
                w: wq,
                wsc,
                h,
                ntok: n,
                tile_n: 0,
                ws,
                counters,
                ss,
            }),
            Product::Down { x, .. } => g.wg_down(abi::WgDown {
                a,
                w: wq,
                wsc,
                x,
                ntok: n,
                tile_n: 0,
                ws,
                counters,
                an,
                norm_w,
                ss,
            }),
            Product::Head { logits } => g.wg_logits(abi::WgLogits {
                a,
                w: wq,
                wsc,
                logits,
                ntok: n,
                tile_n: 0,
                ws,
                counters,
            }),
        }
    }

    /// Whether the LM head of `nout` outputs runs as a GEMM ([`GemmPath::logits`]): on the Hopper
    /// path, where the matrix-vector `lm_head` would read the head more than once (its token tile
    /// is `layout::tok_tile(hidden)` rows: 2 at the 8B shape, so 128 passes over 1 GB at 256).
    pub fn head_pays(&self, d: &metrale_core::shape::Dims, nout: usize) -> bool {
        self.hopper_head && nout > abi::layout::tok_tile(d.hidden) && nout <= self.max_tokens
    }

    /// logits[t] = Whead * RMSNorm(x[sel[t]]) for `nout` rows (the Hopper path; [`Self::head_pays`]).
    #[allow(clippy::too_many_arguments)]
    pub fn logits(
        &self,
        g: &Gpu,
        x: u64,
        sel: u64,
        norm_w: u64,
        head: &DevMat,
        logits: u64,
        nout: usize,
    ) -> Result<(), BackendError> {
        let ntok = self.check(nout)?;
        if !(self.hopper.is_some() && self.hopper_head) {
            return Err(BackendError::Invalid(
                "the GEMM LM head needs the Hopper path and a bf16 head".into(),
            ));
        }
        g.wg_act_head(abi::WgActHead {
            x,
            sel,
            norm_w,
            a: self.hi.ptr,
            ntok,
        })?;
        self.hopper_product(g, Product::Head { logits }, head, nout, None)
    }

    fn check(&self, ntok: usize) -> Result<i32, BackendError> {
        if ntok == 0 || ntok > self.max_tokens {
            return Err(BackendError::Invalid(format!(
                "GEMM chunk of {ntok} tokens: must be 1..={}",
                self.max_tokens
            )));
        }
        Ok(ntok as i32)
    }

    /// RMSNorm(x) -> QKV projection -> RoPE -> q, and K/V into the cache (what `attn_in` does).
    pub fn norm_qkv(
        &self,
        g: &Gpu,
        x: u64,
        norm_w: u64,
        w: &DevMat,
        o: QkvOut,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let ntok = self.check(ntok)?;
        if self.hopper.is_some() {
            self.act_norm(g, x, norm_w, ntok)?;
            return self.hopper_product(g, Product::Qkv(o), w, ntok as usize, None);
        }
        let (hi, lo, asx) = (self.hi.ptr, self.lo.ptr, self.sx.ptr);
        g.norm_split(abi::NormSplit {
            x,
            norm_w,
            hi,
            lo,
            asx,
            ntok,
        })?;
        g.gemm_qkv(abi::GemmQkv {
            ahi: hi,
            alo: lo,
            asx,
            wqs: w.qs.ptr,
            wsc: w.sc_ptr(),
            rope: o.rope,
            q: o.q,
            kc: o.kc,
            vc: o.vc,
            pos: o.pos,
            slot: o.slot,
            tables: o.tables,
            layer: o.layer,
            max_blocks: o.max_blocks,
            ntok,
        })
    }

    /// The QKV product of [`Self::norm_qkv`] over the input the product before it left
    /// (the Hopper path, [`Self::hopper`]: an O or down product with `next`), no conversion first.
    pub fn qkv(&self, g: &Gpu, w: &DevMat, o: QkvOut, ntok: usize) -> Result<(), BackendError> {
        self.check_fused()?;
        self.hopper_product(g, Product::Qkv(o), w, ntok, None)
    }

    /// The gate/up product of [`Self::norm_gate_up`] over the input the product before it left
    /// (as [`Self::qkv`]).
    pub fn gate_up(&self, g: &Gpu, w: &DevMat, h: u64, ntok: usize) -> Result<(), BackendError> {
        self.check_fused()?;
        self.hopper_product(g, Product::GateUp { h }, w, ntok, None)
    }

    fn check_fused(&self) -> Result<(), BackendError> {
        if self.hopper() {
            Ok(())
        } else {
            Err(BackendError::Invalid(
                "a product over the previous product's normed output needs the Hopper GEMM path"
                    .into(),
            ))
        }
    }

    /// x += att * Wo^T (what `attn_out` does), att of [`Self::act_type`] (the attention kernels
    /// write it so with `abi::ATT_FLAG_OUT16` on the Hopper path). With `next` (the RMSNorm weight
    /// of the product after it) on the Hopper path, also that product's input, for
    /// [`Self::gate_up`]; elsewhere `next` is unused.
    pub fn out_proj(
        &self,
        g: &Gpu,
        att: u64,
        w: &DevMat,
        x: u64,
        ntok: usize,
        next: Option<u64>,
    ) -> Result<(), BackendError> {
        let ntok = self.check(ntok)?;
        if self.hopper.is_some() {
            let p = Product::Out { att, x, next };
            return self.hopper_product(g, p, w, ntok as usize, None);
        }
        let (hi, lo, asx) = (self.hi.ptr, self.lo.ptr, self.sx.ptr);
        g.split_qd(abi::SplitQd {
            x: att,
            hi,
            lo,
            asx,
            ntok,
        })?;
        g.gemm_o(abi::GemmO {
            ahi: hi,
            alo: lo,
            asx,
            wqs: w.qs.ptr,
            wsc: w.sc_ptr(),
            x,
            ntok,
        })
    }

    /// h = SiLU(gate) * up of RMSNorm(x) (what `ffn_in` does), h of [`Self::act_type`]: on the
    /// Hopper path already the down product's activations.
    pub fn norm_gate_up(
        &self,
        g: &Gpu,
        x: u64,
        norm_w: u64,
        w: &DevMat,
        h: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let ntok = self.check(ntok)?;
        if self.hopper.is_some() {
            self.act_norm(g, x, norm_w, ntok)?;
            return self.hopper_product(g, Product::GateUp { h }, w, ntok as usize, None);
        }
        let (hi, lo, asx) = (self.hi.ptr, self.lo.ptr, self.sx.ptr);
        g.norm_split(abi::NormSplit {
            x,
            norm_w,
            hi,
            lo,
            asx,
            ntok,
        })?;
        g.gemm_gu(abi::GemmGu {
            ahi: hi,
            alo: lo,
            asx,
            wqs: w.qs.ptr,
            wsc: w.sc_ptr(),
            h,
            ntok,
        })
    }

    /// x += h * Wdown^T (what `ffn_out` does), h as [`Self::norm_gate_up`] wrote it
    /// ([`Self::act_type`]); `next` as [`Self::out_proj`]'s (the next layer's [`Self::qkv`]).
    pub fn down(
        &self,
        g: &Gpu,
        h: u64,
        w: &DevMat,
        x: u64,
        ntok: usize,
        next: Option<u64>,
    ) -> Result<(), BackendError> {
        let ntok = self.check(ntok)?;
        if self.hopper.is_some() {
            let p = Product::Down { h, x, next };
            return self.hopper_product(g, p, w, ntok as usize, None);
        }
        let (hi, lo, asx) = (self.hi.ptr, self.lo.ptr, self.sx.ptr);
        g.split_ffn(abi::SplitFfn {
            x: h,
            hi,
            lo,
            asx,
            ntok,
        })?;
        g.gemm_down(abi::GemmDown {
            ahi: hi,
            alo: lo,
            asx,
            wqs: w.qs.ptr,
            wsc: w.sc_ptr(),
            x,
            ntok,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_core::shape::Dims;

    fn dims(hidden: usize, heads: usize, kv_heads: usize, ffn: usize) -> Dims {
        Dims {
            layers: 2,
            hidden,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            ffn,
            vocab: 1000,
        }
    }

    #[test]
    fn gemm_thresholds_mma_sync_at_48_and_13_hopper_from_two_passes() {
        let smol = dims(576, 9, 3, 1536);
        assert_eq!(gemm_from(&smol, false), 48);
        assert!((matvec_passes(&smol, 47) - 7.0).abs() < 0.01);
        let l8b = dims(4096, 32, 8, 14336);
        assert_eq!(gemm_from(&l8b, false), 13);
        // 16 sequences: ten passes over the weights on the matrix-vector kernels
        assert!((matvec_passes(&l8b, 16) - 10.15).abs() < 0.01);
        assert!((matvec_passes(&l8b, 1) - 1.0).abs() < 1e-9);
        assert!(gemm_pays(&l8b, 256) && !gemm_pays(&l8b, 12) && gemm_pays(&smol, 48));
        // the Hopper GEMMs from the first step that would read the weights twice
        assert_eq!(gemm_from(&l8b, true), 2);
        assert!(!gemm_pays_on(&l8b, 1, true) && gemm_pays_on(&l8b, 12, true));
        assert_eq!(gemm_from(&smol, true), 6);
    }
}
