//! Tensor-core prefill: the four layer products of a chunk as GEMMs (kernels/cuda/gemm.cu.hbs, on
//! mma.sync with fused epilogues: RoPE + KV-cache write, residual add, SiLU * up), each product's
//! activations split once into f16 hi/lo pairs and block sums (RMSNorm folded into the split), and
//! the scratch they need.
//!
//! The backend uses this path for chunks of at least [`MIN_TOKENS`] tokens, decode steps of that
//! many sequences included (inside their CUDA graphs; `Tuning::decode_gemm` turns that off): the
//! matrix-vector kernels re-read every weight once per 8-token tile, which at 8B and 256 sequences
//! is 32 passes over 16 GB per step. Attention, embedding and the LM head are the same kernels on
//! both paths.
//!
//! Invariants: the split scratch (`hi`, `lo`: f16 `[max_tokens][max K]`, `sx`: f32
//! `[max_tokens][max K / 32]`) is written by a split kernel right before the GEMM that reads it, in
//! stream order; nothing here allocates after [`Prefill::new`].

use metrale_abi as abi;
use metrale_core::BackendError;

use super::device::DevBuf;
use super::launch::Gpu;
use super::weights::DevMat;

/// Fewest tokens of a chunk that go through the GEMM path (below it the matvec kernels
/// over 8-token tiles are faster: bench/cuda/NOTES.md).
pub const MIN_TOKENS: usize = 48;

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

/// The split scratch of the prefill GEMMs.
pub struct Prefill {
    hi: DevBuf,
    lo: DevBuf,
    sx: DevBuf,
    max_tokens: usize,
}

impl Prefill {
    /// Allocate the split scratch for chunks of up to `max_tokens` tokens.
    pub fn new(gpu: &Gpu, max_tokens: usize) -> Result<Prefill, BackendError> {
        let d = gpu.dims;
        let kmax = d.hidden.max(d.qd()).max(d.ffn);
        Ok(Prefill {
            hi: gpu.alloc(max_tokens * kmax * 2)?,
            lo: gpu.alloc(max_tokens * kmax * 2)?,
            sx: gpu.alloc(max_tokens * (kmax / 32) * 4)?,
            max_tokens,
        })
    }

    fn check(&self, ntok: usize) -> Result<i32, BackendError> {
        if ntok == 0 || ntok > self.max_tokens {
            return Err(BackendError::Invalid(format!(
                "prefill chunk of {ntok} tokens: must be 1..={}",
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
