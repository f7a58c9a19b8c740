//! Tensor-core prefill: launch wrappers for the kernels of `kernels/cuda/gemm.cu.hbs` (RMSNorm
//! scale, then the QKV / output / gate-up / down projections of a chunk as GEMMs on mma.sync with
//! fused epilogues: RoPE + KV-cache write, residual add, SiLU * up), and the scratch they need.
//!
//! The backend uses this path for chunks that are not pure decode and hold at least
//! [`MIN_TOKENS`] tokens (`METRALE_CUDA_GEMM=0` turns it off, for A/B timing); decode steps keep the
//! matrix-vector kernels and their CUDA graphs. Attention, embedding and the LM head are the same
//! kernels on both paths.
//!
//! Invariants: the grids are the ones the template's header states ([`grid`]); the `scale` scratch
//! holds one f32 per token of the largest chunk and is written by `rms_scale` right before the GEMM
//! that reads it, in stream order; nothing here allocates after [`Prefill::new`].

use std::ffi::c_void;

use cudarc::driver::CudaFunction;
use metrale_core::BackendError;

use super::gpu::{DevBuf, DevMat, Gpu};

/// Fewest tokens of a (non-decode) chunk that go through the GEMM path.
pub const MIN_TOKENS: usize = 16;
/// Threads per GEMM block (`gm::THREADS`).
pub const THREADS: u32 = 128;
/// Tokens per GEMM block (`gm::BM`).
pub const BM: usize = 64;
/// Output columns per GEMM block (`gm::BN`).
pub const BN: usize = 32;
/// Threads of `rms_scale` (a warp per token).
pub const NORM_THREADS: u32 = 256;

/// Grid of a GEMM with `n` output columns over `ntok` tokens.
pub fn grid(n: usize, ntok: usize) -> (u32, u32, u32) {
    ((n / BN) as u32, ntok.div_ceil(BM).max(1) as u32, 1)
}

/// Whether the GEMM path is enabled (`METRALE_CUDA_GEMM` unset or not "0").
pub fn enabled() -> bool {
    std::env::var("METRALE_CUDA_GEMM").map(|v| v != "0").unwrap_or(true)
}

macro_rules! kargs {
    ($($a:expr),* $(,)?) => { [$( &$a as *const _ as *mut c_void ),*] };
}

/// The prefill kernels of one target and their scratch.
pub struct Prefill {
    rms: CudaFunction,
    qkv: CudaFunction,
    o: CudaFunction,
    gu: CudaFunction,
    down: CudaFunction,
    scale: DevBuf,
    max_tokens: usize,
}

impl Prefill {
    /// Look up the `gemm` module's entry points and allocate the scale scratch for `max_tokens`.
    pub fn new(gpu: &Gpu, max_tokens: usize) -> Result<Prefill, BackendError> {
        let f = |e: &str| gpu.function("gemm", e);
        Ok(Prefill {
            rms: f("rms_scale")?,
            qkv: f("gemm_qkv")?,
            o: f("gemm_o")?,
            gu: f("gemm_gu")?,
            down: f("gemm_down")?,
            scale: gpu.alloc(max_tokens * 4)?,
            max_tokens,
        })
    }

    fn check(&self, ntok: usize) -> Result<(), BackendError> {
        if ntok == 0 || ntok > self.max_tokens {
            return Err(BackendError::Invalid(format!("prefill chunk of {ntok} tokens: must be 1..={}", self.max_tokens)));
        }
        Ok(())
    }

    fn rms_scale(&self, g: &Gpu, x: u64, ntok: usize) -> Result<(), BackendError> {
        let (s, n) = (self.scale.ptr, ntok as i32);
        g.launch(&self.rms, "rms_scale", (ntok.div_ceil(8) as u32, 1, 1), NORM_THREADS, &mut kargs!(x, s, n))
    }

    /// RMSNorm(x) -> QKV projection -> RoPE -> q, and K/V into the cache (what `attn_in` does).
    #[allow(clippy::too_many_arguments)]
    pub fn norm_qkv(&self, g: &Gpu, x: u64, norm: u64, w: &DevMat, rope: u64, q: u64, kc: u64, vc: u64, pos: u64, slot: u64, layer: usize, ctx: usize, ntok: usize) -> Result<(), BackendError> {
        self.check(ntok)?;
        self.rms_scale(g, x, ntok)?;
        let d = g.dims;
        let (s, qs, sc, l, c, n) = (self.scale.ptr, w.qs.ptr, w.sc_ptr(), layer as i32, ctx as i32, ntok as i32);
        g.launch(&self.qkv, "gemm_qkv", grid(d.qd() + 2 * d.kd(), ntok), THREADS, &mut kargs!(x, s, norm, qs, sc, rope, q, kc, vc, pos, slot, l, c, n))
    }

    /// x += att * Wo^T (what `attn_out` does).
    pub fn out_proj(&self, g: &Gpu, att: u64, w: &DevMat, x: u64, ntok: usize) -> Result<(), BackendError> {
        self.check(ntok)?;
        let (qs, sc, n) = (w.qs.ptr, w.sc_ptr(), ntok as i32);
        g.launch(&self.o, "gemm_o", grid(g.dims.hidden, ntok), THREADS, &mut kargs!(att, qs, sc, x, n))
    }

    /// h = SiLU(gate) * up of RMSNorm(x) (what `ffn_in` does).
    pub fn norm_gate_up(&self, g: &Gpu, x: u64, norm: u64, w: &DevMat, h: u64, ntok: usize) -> Result<(), BackendError> {
        self.check(ntok)?;
        self.rms_scale(g, x, ntok)?;
        let (s, qs, sc, n) = (self.scale.ptr, w.qs.ptr, w.sc_ptr(), ntok as i32);
        g.launch(&self.gu, "gemm_gu", grid(2 * g.dims.ffn, ntok), THREADS, &mut kargs!(x, s, norm, qs, sc, h, n))
    }

    /// x += h * Wdown^T (what `ffn_out` does).
    pub fn down(&self, g: &Gpu, h: u64, w: &DevMat, x: u64, ntok: usize) -> Result<(), BackendError> {
        self.check(ntok)?;
        let (qs, sc, n) = (w.qs.ptr, w.sc_ptr(), ntok as i32);
        g.launch(&self.down, "gemm_down", grid(g.dims.hidden, ntok), THREADS, &mut kargs!(h, qs, sc, x, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_every_token_and_column() {
        assert_eq!(grid(576, 512), (18, 8, 1));
        assert_eq!(grid(960, 77), (30, 2, 1));
        assert_eq!(grid(3072, 16), (96, 1, 1));
        assert_eq!(grid(3072, 1), (96, 1, 1));
    }
}
