//! The fast path of the CPU matrix products: activations quantized to 16-bit integers per 32-element
//! block (scale `d = max|x| / 32767`, `q = round(x / d)`), multiplied with the block-quantized
//! weights in exact integer arithmetic (`vpmaddwd`), one f32 scale multiply per block and token.
//!
//! Why 16 and not 8 bits (llama.cpp's CPU scheme): measured on SmolLM2-135M, 8-bit activation blocks
//! moved logits by up to 2.0 against HF transformers and flipped a greedy token of the golden prompt
//! (SmolLM2's activations have large outliers inside blocks); 16-bit blocks add at most half a step
//! of 1/32767 of the block's largest value per element: 1.1e-2 max logit difference against HF
//! (the f32 path: 5e-5), the same top-1 everywhere (see the golden test). The cost is widening the
//! weights to i16 (`vpmaddwd` instead of `vpmaddubsw`), done once per block for up to 4 tokens.
//!
//! Invariants: integer block sums are exact (|w| <= 128, |q| <= 32767: a 32-element block sum stays
//! below 2^27); AVX2 and generic code give the same block sums; only the f32 summation order of the
//! blocks differs.

use super::ops::{f16_to_f32, MatRef};
use metrale_core::dtype::{DType, QK};

/// One or more activation rows quantized per 32-element block.
pub struct QuantizedActs {
    pub cols: usize,
    /// `[n_tok][cols]` 16-bit values.
    pub q: Vec<i16>,
    /// `[n_tok][cols / 32]` block scales.
    pub d: Vec<f32>,
    /// `[n_tok][cols / 32]` exact f32 sums of each block of `x` (for the Q4_0/Q4_1 offsets).
    pub s: Vec<f32>,
}

impl QuantizedActs {
    /// Quantize `x` = `[n][cols]` (`cols` a multiple of 32).
    pub fn new(x: &[f32], cols: usize) -> QuantizedActs {
        let nb = x.len() / QK;
        let mut q = vec![0i16; x.len()];
        let mut d = vec![0f32; nb];
        let mut s = vec![0f32; nb];
        for (((xb, qb), db), sb) in x
            .chunks_exact(QK)
            .zip(q.chunks_exact_mut(QK))
            .zip(&mut d)
            .zip(&mut s)
        {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 32767.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            for (o, &v) in qb.iter_mut().zip(xb) {
                // round half away from zero, like f32::round, without a libm call
                let y = v * inv;
                *o = (y + 0.5f32.copysign(y)).clamp(-32767.0, 32767.0) as i16;
            }
            *db = scale;
            *sb = xb.iter().sum();
        }
        QuantizedActs { cols, q, d, s }
    }
}

/// Generic integer dot of one weight row with one quantized activation row.
#[inline(always)]
fn dot_generic(dtype: DType, row: &[u8], q: &[i16], d: &[f32], s: &[f32]) -> f32 {
    let bb = dtype.block_bytes();
    let mut acc = 0f32;
    for (((b, qb), &db), &sb) in row.chunks_exact(bb).zip(q.chunks_exact(QK)).zip(d).zip(s) {
        let wd = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        match dtype {
            DType::Q4_1 | DType::Q4_0 => {
                let qs = if dtype == DType::Q4_1 {
                    &b[4..20]
                } else {
                    &b[2..18]
                };
                let mut isum = 0i32;
                for j in 0..16 {
                    isum += (qs[j] & 0x0f) as i32 * qb[j] as i32
                        + (qs[j] >> 4) as i32 * qb[j + 16] as i32;
                }
                acc += wd * db * isum as f32;
                if dtype == DType::Q4_1 {
                    acc += f16_to_f32(u16::from_le_bytes([b[2], b[3]])) * sb;
                } else {
                    acc -= 8.0 * wd * sb;
                }
            }
            DType::Q8_0 => {
                let mut isum = 0i32;
                for j in 0..QK {
                    isum += (b[2 + j] as i8) as i32 * qb[j] as i32;
                }
                acc += wd * db * isum as f32;
            }
            _ => unreachable!("the quantized-activation path is for block-quantized weights only"),
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Weight-type codes of the const-generic kernels.
    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q8_0: u8 = 2;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// Dots of `R` weight rows (`row_bytes` apart) with `N` quantized activation rows: each weight
    /// block is loaded and widened to 2 x 16 i16 once and used for all `N` tokens, each activation
    /// block once for all `R` rows. Used with (R, N) = (1, 4) for prefill tiles and (1, 1) otherwise
    /// ((2, 1) for decode measured no faster: decode is bound by the weight stream).
    #[inline(always)]
    unsafe fn dot_rn<const K: u8, const R: usize, const N: usize>(
        blk0: *const u8,
        row_bytes: usize,
        nb: usize,
        q: [*const i16; N],
        d: [*const f32; N],
        s: [*const f32; N],
    ) -> [[f32; N]; R] {
        let bb = match K {
            Q4_0 => 18,
            Q4_1 => 20,
            _ => 34,
        };
        let mask = _mm_set1_epi8(0x0f);
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut off = [[0f32; N]; R];
        for b in 0..nb {
            let mut w = [(_mm256_setzero_si256(), _mm256_setzero_si256()); R];
            let mut wd = [0f32; R];
            let mut wm = [0f32; R];
            for r in 0..R {
                let blk = blk0.add(r * row_bytes + b * bb);
                // f16 scale (and min) -> f32 with F16C
                let h = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
                    blk as *const i32,
                )));
                wd[r] = _mm_cvtss_f32(h);
                if K == Q4_1 {
                    wm[r] = _mm_cvtss_f32(_mm_movehdup_ps(h));
                }
                w[r] = match K {
                    Q8_0 => (
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(2) as *const __m128i)),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(18) as *const __m128i)),
                    ),
                    _ => {
                        let qs = _mm_loadu_si128(
                            blk.add(if K == Q4_1 { 4 } else { 2 }) as *const __m128i
                        );
                        let lo = _mm_and_si128(qs, mask);
                        let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                        (_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi))
                    }
                };
            }
            for t in 0..N {
                let xp = q[t].add(b * QK);
                let x0 = _mm256_loadu_si256(xp as *const __m256i);
                let x1 = _mm256_loadu_si256(xp.add(16) as *const __m256i);
                let dt = *d[t].add(b);
                let st = *s[t].add(b);
                for r in 0..R {
                    let p = _mm256_add_epi32(
                        _mm256_madd_epi16(w[r].0, x0),
                        _mm256_madd_epi16(w[r].1, x1),
                    );
                    let scale = _mm256_set1_ps(wd[r] * dt);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][t]);
                    match K {
                        Q4_1 => off[r][t] += wm[r] * st,
                        Q4_0 => off[r][t] -= 8.0 * wd[r] * st,
                        _ => {}
                    }
                }
            }
        }
        let mut out = [[0f32; N]; R];
        for r in 0..R {
            for t in 0..N {
                out[r][t] = hsum(acc[r][t]) + off[r][t];
            }
        }
        out
    }

    #[inline(always)]
    unsafe fn rows_k<const K: u8>(
        w: MatRef<'_>,
        r0: usize,
        a: &QuantizedActs,
        n_tok: usize,
        out_t: &mut [f32],
    ) {
        let rb = w.row_bytes();
        let nb = w.cols / QK;
        let nrows = out_t.len() / n_tok;
        let ptrs = |t: usize| {
            (
                a.q.as_ptr().add(t * w.cols),
                a.d.as_ptr().add(t * nb),
                a.s.as_ptr().add(t * nb),
            )
        };
        for rr in 0..nrows {
            let row = w.data.as_ptr().add((r0 + rr) * rb);
            let mut t = 0;
            while t + 4 <= n_tok {
                let p = [ptrs(t), ptrs(t + 1), ptrs(t + 2), ptrs(t + 3)];
                let r =
                    dot_rn::<K, 1, 4>(row, rb, nb, p.map(|x| x.0), p.map(|x| x.1), p.map(|x| x.2));
                out_t[rr * n_tok + t..rr * n_tok + t + 4].copy_from_slice(&r[0]);
                t += 4;
            }
            while t < n_tok {
                let p = ptrs(t);
                out_t[rr * n_tok + t] = dot_rn::<K, 1, 1>(row, rb, nb, [p.0], [p.1], [p.2])[0][0];
                t += 1;
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot(dtype: DType, row: &[u8], q: &[i16], d: &[f32], s: &[f32]) -> f32 {
        let (r, nb) = (row.as_ptr(), d.len());
        let (q, d, s) = ([q.as_ptr()], [d.as_ptr()], [s.as_ptr()]);
        match dtype {
            DType::Q4_0 => dot_rn::<Q4_0, 1, 1>(r, 0, nb, q, d, s)[0][0],
            DType::Q4_1 => dot_rn::<Q4_1, 1, 1>(r, 0, nb, q, d, s)[0][0],
            _ => dot_rn::<Q8_0, 1, 1>(r, 0, nb, q, d, s)[0][0],
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows(
        w: MatRef<'_>,
        r0: usize,
        a: &QuantizedActs,
        n_tok: usize,
        out_t: &mut [f32],
    ) {
        match w.dtype {
            DType::Q4_0 => rows_k::<Q4_0>(w, r0, a, n_tok, out_t),
            DType::Q4_1 => rows_k::<Q4_1>(w, r0, a, n_tok, out_t),
            _ => rows_k::<Q8_0>(w, r0, a, n_tok, out_t),
        }
    }
}

/// Integer dot of one block-quantized weight row with one quantized activation row (`q`, `d`, `s`
/// of that row). Uses AVX2 when the CPU has it.
pub fn dot_row_qact(dtype: DType, row: &[u8], q: &[i16], d: &[f32], s: &[f32]) -> f32 {
    assert!(
        dtype.is_quantized(),
        "dot_row_qact: {dtype} is not block-quantized"
    );
    assert_eq!(row.len(), d.len() * dtype.block_bytes());
    assert!(q.len() == d.len() * QK && s.len() == d.len());
    #[cfg(target_arch = "x86_64")]
    if super::ops::simd_level() == "avx2" {
        // SAFETY: avx2+fma+f16c present; lengths checked above.
        return unsafe { avx2::dot(dtype, row, q, d, s) };
    }
    dot_generic(dtype, row, q, d, s)
}

/// The quantized-activation analogue of [`super::ops::matmul_rows`]: rows `r0..` of the weight for
/// every token, into `out_t` = `[rows][n_tok]`.
pub fn matmul_rows_qact(
    w: MatRef<'_>,
    r0: usize,
    a: &QuantizedActs,
    n_tok: usize,
    out_t: &mut [f32],
) {
    assert!(w.dtype.is_quantized());
    let rb = w.row_bytes();
    let nb = w.cols / QK;
    let nrows = out_t.len() / n_tok;
    assert!(
        (r0 + nrows) * rb <= w.data.len() && a.q.len() >= n_tok * w.cols && a.d.len() >= n_tok * nb
    );
    #[cfg(target_arch = "x86_64")]
    if super::ops::simd_level() == "avx2" {
        // SAFETY: avx2+fma+f16c present; bounds checked above.
        unsafe { avx2::rows(w, r0, a, n_tok, out_t) };
        return;
    }
    for rr in 0..nrows {
        for t in 0..n_tok {
            let row = &w.data[(r0 + rr) * rb..(r0 + rr + 1) * rb];
            out_t[rr * n_tok + t] = dot_generic(
                w.dtype,
                row,
                &a.q[t * w.cols..(t + 1) * w.cols],
                &a.d[t * nb..(t + 1) * nb],
                &a.s[t * nb..(t + 1) * nb],
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::synthetic::{rand_vec, rand_weights};

    #[test]
    fn qact_dots_match_generic_and_f32_reference() {
        let (rows, cols) = (19, 128);
        for dt in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let w = rand_weights(dt, rows, cols, 3);
            // 5 tokens: one 4-token tile and one single token; an outlier in one block.
            let mut x = rand_vec(cols * 5, 9);
            x[7] = 40.0;
            let m = MatRef {
                dtype: dt,
                rows,
                cols,
                data: &w,
            };
            let mut exact = vec![0f32; rows * 5];
            let mut fast = vec![0f32; rows * 5];
            crate::cpu::ops::matmul(m, &x, 5, &mut exact);
            crate::cpu::ops::matmul_qact(m, &x, 5, &mut fast);
            let a = QuantizedActs::new(&x, cols);
            let rb = dt.row_bytes(cols).unwrap();
            for t in 0..5 {
                for r in 0..rows {
                    let (q, d, s) = (
                        &a.q[t * cols..(t + 1) * cols],
                        &a.d[t * 4..t * 4 + 4],
                        &a.s[t * 4..t * 4 + 4],
                    );
                    let g = dot_generic(dt, &w[r * rb..(r + 1) * rb], q, d, s);
                    let f = fast[t * rows + r];
                    assert!(
                        (g - f).abs() <= 1e-5 * (1.0 + g.abs()),
                        "{dt}: generic {g} vs simd {f}"
                    );
                    assert_eq!(
                        dot_row_qact(dt, &w[r * rb..(r + 1) * rb], q, d, s).to_bits(),
                        f.to_bits()
                    );
                    // 16-bit activations: each element is off by at most half its block's scale.
                    let mut deq = vec![0f32; cols];
                    metrale_core::dtype::dequantize_row(dt, &w[r * rb..(r + 1) * rb], &mut deq)
                        .unwrap();
                    let bound: f32 = deq
                        .iter()
                        .enumerate()
                        .map(|(j, wj)| wj.abs() * d[j / 32] * 0.5)
                        .sum();
                    let e = exact[t * rows + r];
                    assert!(
                        (e - f).abs() <= bound + 1e-5 * (1.0 + e.abs()),
                        "{dt}: qact {f} vs f32 {e}, bound {bound}"
                    );
                }
            }
        }
    }
}
