//! Tensor-core prefill: launch wrappers for the kernels of `kernels/cuda/gemm.cu.hbs` (each
//! product's activations split once into f16 hi/lo pairs and block sums, RMSNorm folded into the
//! split, then the QKV / output / gate-up / down projections of a chunk as GEMMs on mma.sync with
//! fused epilogues: RoPE + KV-cache write, residual add, SiLU * up), and the scratch they need.
//!
//! The backend uses this path for chunks that are not pure decode and hold at least
//! [`MIN_TOKENS`] tokens (`METRALE_CUDA_GEMM=0` turns it off, for A/B timing); decode steps keep the
//! matrix-vector kernels and their CUDA graphs. Attention, embedding and the LM head are the same
//! kernels on both paths.
//!
//! Invariants: the grids are the ones the template's header states ([`grid`]); the split scratch
//! (`hi`, `lo`: f16 `[max_tokens][max K]`, `sx`: f32 `[max_tokens][max K / 32]`) is written by a
//! split kernel right before the GEMM that reads it, in stream order; nothing here allocates after
//! [`Prefill::new`].

use std::ffi::c_void;

use cudarc::driver::CudaFunction;
use metrale_core::BackendError;

use super::gpu::{DevBuf, DevMat, Gpu};

/// Fewest tokens of a (non-decode) chunk that go through the GEMM path (below it the matvec kernels
/// over 8-token tiles are faster: bench/cuda/NOTES.md, pf1-pf4).
pub const MIN_TOKENS: usize = 48;
/// Threads per GEMM block (`gm::THREADS`).
pub const THREADS: u32 = 128;
/// Tokens per GEMM block (`gm::BM`).
pub const BM: usize = 32;
/// Output columns per GEMM block (`gm::BN`).
pub const BN: usize = 64;
/// Threads of the split kernels (a warp per token).
pub const SPLIT_THREADS: u32 = 256;

/// Grid of a GEMM with `n` output columns over `ntok` tokens.
pub fn grid(n: usize, ntok: usize) -> (u32, u32, u32) {
    ((n / BN) as u32, ntok.div_ceil(BM).max(1) as u32, 1)
}

/// Whether the GEMM path is enabled (`METRALE_CUDA_GEMM` unset or not "0").
pub fn enabled() -> bool {
    std::env::var("METRALE_CUDA_GEMM")
        .map(|v| v != "0")
        .unwrap_or(true)
}

macro_rules! kargs {
    ($($a:expr),* $(,)?) => { [$( &$a as *const _ as *mut c_void ),*] };
}

/// The prefill kernels of one target and their scratch.
pub struct Prefill {
    norm_split: CudaFunction,
    split_qd: CudaFunction,
    split_ffn: CudaFunction,
    qkv: CudaFunction,
    o: CudaFunction,
    gu: CudaFunction,
    down: CudaFunction,
    hi: DevBuf,
    lo: DevBuf,
    sx: DevBuf,
    max_tokens: usize,
}

impl Prefill {
    /// Look up the `gemm` module's entry points and allocate the split scratch for `max_tokens`.
    pub fn new(gpu: &Gpu, max_tokens: usize) -> Result<Prefill, BackendError> {
        let f = |e: &str| gpu.function("gemm", e);
        let d = gpu.dims;
        let kmax = d.hidden.max(d.qd()).max(d.ffn);
        Ok(Prefill {
            norm_split: f("norm_split")?,
            split_qd: f("split_qd")?,
            split_ffn: f("split_ffn")?,
            qkv: f("gemm_qkv")?,
            o: f("gemm_o")?,
            gu: f("gemm_gu")?,
            down: f("gemm_down")?,
            hi: gpu.alloc(max_tokens * kmax * 2)?,
            lo: gpu.alloc(max_tokens * kmax * 2)?,
            sx: gpu.alloc(max_tokens * (kmax / 32) * 4)?,
            max_tokens,
        })
    }

    fn check(&self, ntok: usize) -> Result<(), BackendError> {
        if ntok == 0 || ntok > self.max_tokens {
            return Err(BackendError::Invalid(format!(
                "prefill chunk of {ntok} tokens: must be 1..={}",
                self.max_tokens
            )));
        }
        Ok(())
    }

    /// Split `x` (`[ntok][K]` f32) into the hi/lo/sx scratch: `norm` = Some(weights) applies RMSNorm
    /// first (K = hidden); otherwise `f` is `split_qd` or `split_ffn`.
    fn split(
        &self,
        g: &Gpu,
        f: &CudaFunction,
        what: &str,
        x: u64,
        norm: Option<u64>,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let (hi, lo, sx, n) = (self.hi.ptr, self.lo.ptr, self.sx.ptr, ntok as i32);
        let grid = (ntok.div_ceil(8) as u32, 1, 1);
        match norm {
            Some(w) => g.launch(
                f,
                what,
                grid,
                SPLIT_THREADS,
                &mut kargs!(x, w, hi, lo, sx, n),
            ),
            None => g.launch(f, what, grid, SPLIT_THREADS, &mut kargs!(x, hi, lo, sx, n)),
        }
    }

    /// RMSNorm(x) -> QKV projection -> RoPE -> q, and K/V into the cache (what `attn_in` does).
    #[allow(clippy::too_many_arguments)]
    pub fn norm_qkv(
        &self,
        g: &Gpu,
        x: u64,
        norm: u64,
        w: &DevMat,
        rope: u64,
        q: u64,
        kc: u64,
        vc: u64,
        pos: u64,
        slot: u64,
        layer: usize,
        ctx: usize,
        ntok: usize,
    ) -> Result<(), BackendError> {
        self.check(ntok)?;
        self.split(g, &self.norm_split, "norm_split", x, Some(norm), ntok)?;
        let d = g.dims;
        let (hi, lo, sx) = (self.hi.ptr, self.lo.ptr, self.sx.ptr);
        let (qs, sc, l, c, n) = (w.qs.ptr, w.sc_ptr(), layer as i32, ctx as i32, ntok as i32);
        g.launch(
            &self.qkv,
            "gemm_qkv",
            grid(d.qd() + 2 * d.kd(), ntok),
            THREADS,
            &mut kargs!(hi, lo, sx, qs, sc, rope, q, kc, vc, pos, slot, l, c, n),
        )
    }

    /// One of the GEMMs with the signature (hi, lo, sx, w_qs, w_sc, out, ntok) over the activations
    /// `split` last wrote: `cols` output columns of `w` into `out`.
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        g: &Gpu,
        f: &CudaFunction,
        what: &str,
        cols: usize,
        w: &DevMat,
        out: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        let (hi, lo, sx, qs, sc, n) = (
            self.hi.ptr,
            self.lo.ptr,
            self.sx.ptr,
            w.qs.ptr,
            w.sc_ptr(),
            ntok as i32,
        );
        g.launch(
            f,
            what,
            grid(cols, ntok),
            THREADS,
            &mut kargs!(hi, lo, sx, qs, sc, out, n),
        )
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
        self.check(ntok)?;
        self.split(g, &self.split_qd, "split_qd", att, None, ntok)?;
        self.product(g, &self.o, "gemm_o", g.dims.hidden, w, x, ntok)
    }

    /// h = SiLU(gate) * up of RMSNorm(x) (what `ffn_in` does).
    pub fn norm_gate_up(
        &self,
        g: &Gpu,
        x: u64,
        norm: u64,
        w: &DevMat,
        h: u64,
        ntok: usize,
    ) -> Result<(), BackendError> {
        self.check(ntok)?;
        self.split(g, &self.norm_split, "norm_split", x, Some(norm), ntok)?;
        self.product(g, &self.gu, "gemm_gu", 2 * g.dims.ffn, w, h, ntok)
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
        self.check(ntok)?;
        self.split(g, &self.split_ffn, "split_ffn", h, None, ntok)?;
        self.product(g, &self.down, "gemm_down", g.dims.hidden, w, x, ntok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_every_token_and_column() {
        assert_eq!(grid(576, 512), (9, 16, 1));
        assert_eq!(grid(960, 77), (15, 3, 1));
        assert_eq!(grid(3072, 16), (48, 1, 1));
        assert_eq!(grid(3072, 1), (48, 1, 1));
    }
}
