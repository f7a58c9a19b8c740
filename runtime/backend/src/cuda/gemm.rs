//! The GEMM path: the four layer products of a chunk as GEMMs with fused epilogues (RoPE + KV-cache
//! write, residual add, SiLU * up), and the scratch they need. Two implementations:
//! - on Hopper (`Gpu::hopper_gemm`: sm_90a cubins, bf16 weights), `gemm_hopper.cu.hbs`: warpgroup
//!   MMAs (wgmma) fed by a cp.async pipeline, the activations converted once per product to bf16,
//!   the narrow products split over K when their tiles alone would leave SMs idle
//!   (`plan::wg_plan`);
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
//! Invariants: the activation scratch (`hi`, `lo`: 16-bit `[max_tokens][max K]`, `sx`: f32
//! `[max_tokens][max K / 32]`; the Hopper path uses `hi` alone, as bf16) is written by a conversion
//! kernel right before the GEMM that reads it, in stream order; the split-K tickets are zero
//! between launches (the last split of a tile resets its own); nothing here allocates after
//! [`GemmPath::new`].

use metrale_abi as abi;
use metrale_core::BackendError;

use super::device::DevBuf;
use super::launch::Gpu;
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

/// The GEMM path of one backend: which kernels it runs, and their scratch.
pub struct GemmPath {
    hi: DevBuf,
    lo: DevBuf,
    sx: DevBuf,
    max_tokens: usize,
    /// The Hopper path's split-K partials and tickets (`plan::wg_scratch_bytes`), where it runs.
    hopper: Option<(DevBuf, DevBuf)>,
    /// The LM head of several outputs runs on the Hopper GEMM too (a bf16 head whose rows are a
    /// multiple of `WG_BM`).
    hopper_head: bool,
}

impl GemmPath {
    /// Allocate the scratch for chunks of up to `max_tokens` tokens on the path `gpu` runs.
    pub fn new(gpu: &Gpu, max_tokens: usize) -> Result<GemmPath, BackendError> {
        let d = gpu.dims;
        let kmax = d.hidden.max(d.qd()).max(d.ffn);
        let hopper = if gpu.hopper_gemm {
            let (ws, tickets) = super::plan::wg_scratch_bytes(gpu.sm_count);
            Some((gpu.alloc(ws)?, gpu.alloc(tickets)?))
        } else {
            None
        };
        // the Hopper path needs no lo half and no block sums
        let split = if hopper.is_some() { 0 } else { max_tokens };
        let hopper_head =
            hopper.is_some() && gpu.embedding_bf16 && d.vocab.is_multiple_of(abi::WG_BM as usize);
        Ok(GemmPath {
            hi: gpu.alloc(max_tokens * kmax * 2)?,
            lo: gpu.alloc(split * kmax * 2)?,
            sx: gpu.alloc(split * (kmax / 32) * 4)?,
            max_tokens,
            hopper,
            hopper_head,
        })
    }

    /// Whether the products run on the Hopper kernels.
    pub fn hopper(&self) -> bool {
        self.hopper.is_some()
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
        let Some((ws, counters)) = self.hopper.as_ref().filter(|_| self.hopper_head) else {
            return Err(BackendError::Invalid(
                "the GEMM LM head needs the Hopper path and a bf16 head".into(),
            ));
        };
        let a = self.hi.ptr;
        g.wg_act_head(abi::WgActHead {
            x,
            sel,
            norm_w,
            a,
            ntok,
        })?;
        g.wg_logits(abi::WgLogits {
            a,
            w: head.qs.ptr,
            logits,
            ntok,
            tile_n: 0,
            ws: ws.ptr,
            counters: counters.ptr,
        })
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
        if let Some((ws, counters)) = &self.hopper {
            let a = self.hi.ptr;
            g.wg_act_norm(abi::WgActNorm { x, norm_w, a, ntok })?;
            return g.wg_qkv(abi::WgQkv {
                a,
                w: w.qs.ptr,
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
                tile_n: 0,
                ws: ws.ptr,
                counters: counters.ptr,
            });
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

    /// x += att * Wo^T (what `attn_out` does).
    pub fn out_proj(
        &self,
        g: &Gpu,
        att: u64,
        w: &DevMat,
        x: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let ntok = self.check(ntok)?;
        if let Some((ws, counters)) = &self.hopper {
            let a = self.hi.ptr;
            g.wg_act_qd(abi::WgActQd { x: att, a, ntok })?;
            return g.wg_o(abi::WgO {
                a,
                w: w.qs.ptr,
                x,
                ntok,
                tile_n: 0,
                ws: ws.ptr,
                counters: counters.ptr,
            });
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

    /// h = SiLU(gate) * up of RMSNorm(x) (what `ffn_in` does).
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
        if let Some((ws, counters)) = &self.hopper {
            let a = self.hi.ptr;
            g.wg_act_norm(abi::WgActNorm { x, norm_w, a, ntok })?;
            return g.wg_gu(abi::WgGu {
                a,
                w: w.qs.ptr,
                h,
                ntok,
                tile_n: 0,
                ws: ws.ptr,
                counters: counters.ptr,
            });
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

    /// x += h * Wdown^T (what `ffn_out` does).
    pub fn down(
        &self,
        g: &Gpu,
        h: u64,
        w: &DevMat,
        x: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let ntok = self.check(ntok)?;
        if let Some((ws, counters)) = &self.hopper {
            let a = self.hi.ptr;
            g.wg_act_ffn(abi::WgActFfn { x: h, a, ntok })?;
            return g.wg_down(abi::WgDown {
                a,
                w: w.qs.ptr,
                x,
                ntok,
                tile_n: 0,
                ws: ws.ptr,
                counters: counters.ptr,
            });
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
