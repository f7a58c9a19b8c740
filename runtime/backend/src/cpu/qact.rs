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
//! Q4_1 weights are repacked once at load when the CPU has AVX2 ([`pack_q4_1`], `MatRef::packed`):
//! per row, groups of 8 blocks store their 8 scales, their 8 minimums and then their nibbles
//! interleaved so that one 16-byte load, widened to 16-bit lanes, holds 2 + 2 elements of each of
//! the 8 blocks. One `vpmaddwd` then works on 8 blocks at once and its 8 lanes are the 8 blocks' sums:
//! no horizontal sum, scale broadcast or scalar offset per block (1.3 instead of 2.3 ns per block on
//! one Zen 3 core). The activations are permuted to match once per product
//! ([`QuantizedActs::qp`]). A row's last group may hold fewer than 8 blocks (576 columns: 8 + 8 + 2);
//! its blocks then spread over several lanes each ([`group_shape`]: 2 blocks take 4 lanes each), so
//! it costs 2 loads instead of 8.
//!
//! Invariants: integer block sums are exact (|w| <= 128, |q| <= 32767: a 32-element block sum stays
//! below 2^27); AVX2 and generic code give the same block sums; only the f32 summation order of the
//! blocks differs. Packed rows have the GGUF row's size and `unpack_q4_1_rows` restores them bit for bit.

use super::mat::{simd_level, MatRef};
use metrale_core::dtype::f16_to_f32;
use metrale_core::dtype::{DType, QK};

/// Blocks per group of a packed Q4_1 row.
pub const GROUP: usize = 8;
const Q41_BYTES: usize = 20;
/// Bytes a packed matrix keeps after its last row: the last group's 16-byte nibble loads may reach
/// past the row when it has fewer than 8 blocks (those lanes are multiplied by zero activations).
pub const PACK_PAD: usize = 16;

/// The lanes of a group of `n` blocks (8, or fewer for a row's last group): each block spreads over
/// `per` = 8 / n (rounded down to a power of two) of the 8 lanes, each lane summing 32 / `per` of its
/// elements, so that short last groups waste few lanes (576 columns: 8 + 8 + 2 blocks, the last
/// group 4 lanes per block). Returns (`per`, loads): every load gives each lane 2 bytes (4 elements).
fn group_shape(n: usize) -> (usize, usize) {
    let per = match n {
        1 => 8,
        2 => 4,
        3 | 4 => 2,
        _ => 1,
    };
    (per, 8 / per)
}

/// For lane `lane` of load `t` of a group of `n` blocks: (block, byte of that block's 16 nibble
/// bytes) of its first byte (the second follows it), or `None` for an unused lane.
fn lane_byte(n: usize, lane: usize, t: usize) -> Option<(usize, usize)> {
    let (per, _) = group_shape(n);
    let (i, r) = (lane / per, lane % per);
    (i < n).then_some((i, r * (16 / per) + 2 * t))
}

/// The packed layout of a row of `nb` Q4_1 blocks as (GGUF byte offset, packed byte offset) of
/// every 2-byte unit: groups of 8 blocks (the last one may be shorter, `n` blocks), each
/// `[n x f16 d][n x f16 m]` then the loads of [`group_shape`], `2 n per` bytes each: bytes
/// `2 lane`, `2 lane + 1` of load `t` are the bytes [`lane_byte`] names.
fn packed_units(nb: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..nb).step_by(GROUP).flat_map(move |g0| {
        let n = GROUP.min(nb - g0);
        let (per, loads) = group_shape(n);
        let (blk, base) = (move |i: usize| (g0 + i) * Q41_BYTES, g0 * Q41_BYTES);
        let scales =
            (0..n).flat_map(move |i| [(blk(i), base + 2 * i), (blk(i) + 2, base + 2 * n + 2 * i)]);
        let nibbles = (0..loads).flat_map(move |t| {
            (0..n * per).map(move |lane| {
                let (i, b) = lane_byte(n, lane, t).expect("a used lane");
                (blk(i) + 4 + b, base + 4 * n + 2 * n * per * t + 2 * lane)
            })
        });
        scales.chain(nibbles)
    })
}

/// Pack GGUF Q4_1 rows of `cols` columns (`src`) into `dst` (the same size; module docs and
/// [`packed_units`], computed once for all rows).
pub fn pack_q4_1_rows(src: &[u8], dst: &mut [u8], cols: usize) {
    move_units(src, dst, cols, |(g, p)| (g, p));
}

/// The inverse of [`pack_q4_1_rows`].
pub fn unpack_q4_1_rows(src: &[u8], dst: &mut [u8], cols: usize) {
    move_units(src, dst, cols, |(g, p)| (p, g));
}

/// Copy every 2-byte unit of every row from `src` to `dst`, at the (from, to) offsets `dir` makes of
/// its (GGUF, packed) offsets.
fn move_units(
    src: &[u8],
    dst: &mut [u8],
    cols: usize,
    dir: impl Fn((usize, usize)) -> (usize, usize),
) {
    let rb = cols / QK * Q41_BYTES;
    assert!(
        src.len() == dst.len() && src.len().is_multiple_of(rb),
        "whole Q4_1 rows of {cols} columns"
    );
    let units: Vec<(usize, usize)> = packed_units(cols / QK).map(dir).collect();
    for (s, d) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(rb)) {
        for &(from, to) in &units {
            d[to..to + 2].copy_from_slice(&s[from..from + 2]);
        }
    }
}

/// Pack every row of a Q4_1 matrix of `cols` columns in place (see [`pack_q4_1_rows`]) and append
/// [`PACK_PAD`] zero bytes.
pub fn pack_q4_1(data: &mut Vec<u8>, cols: usize) {
    let gguf = data.clone();
    pack_q4_1_rows(&gguf, data, cols);
    data.extend_from_slice(&[0; PACK_PAD]);
}

/// Rows of at most this many blocks are computed two at a time for one token. Measured on one Zen 3
/// core (ns per block, weights from memory / from cache): 576 columns 2.15 / 1.93 -> 1.90 / 1.65;
/// 1536 columns 1.87 / 1.44 -> 3.5 / 1.41 (two interleaved row streams defeat the prefetcher).
const PAIR_MAX_BLOCKS: usize = 24;

/// Whether this CPU runs packed Q4_1 rows faster (AVX2); the CPU backend packs its Q4_1 matrices
/// only then.
pub fn packs_q4_1() -> bool {
    simd_level() == "avx2"
}

/// One or more activation rows quantized per 32-element block.
pub struct QuantizedActs {
    pub cols: usize,
    /// `[n_tok][cols]` 16-bit values.
    pub q: Vec<i16>,
    /// `q` in the order packed Q4_1 rows need (empty unless asked for), `qp_stride` values per
    /// token: per group of 8 blocks (256 values; the last group zero-padded to 256), for load `t`,
    /// 16 values for the low nibbles (slots `2 lane + e`: element `b + e` of the block and byte `b`
    /// that [`lane_byte`] names) then 16 for the high ones (element `16 + b + e`).
    pub qp: Vec<i16>,
    pub qp_stride: usize,
    /// `[n_tok][cols / 32]` block scales.
    pub d: Vec<f32>,
    /// `[n_tok][cols / 32]` exact f32 sums of each block of `x` (for the Q4_0/Q4_1 offsets).
    pub s: Vec<f32>,
}

impl QuantizedActs {
    /// Quantize `x` = `[n][cols]` (`cols` a multiple of 32); `packed`: also lay the values out for
    /// packed Q4_1 rows (`qp`; empty otherwise).
    pub fn new(x: &[f32], cols: usize, packed: bool) -> QuantizedActs {
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
        let nbr = cols / QK;
        let qp_stride = nbr.div_ceil(GROUP) * GROUP * QK;
        let mut qp = vec![
            0i16;
            if packed {
                qp_stride * (x.len() / cols.max(1))
            } else {
                0
            }
        ];
        for (src, dst) in q.chunks_exact(cols).zip(qp.chunks_exact_mut(qp_stride)) {
            for g0 in (0..nbr).step_by(GROUP) {
                let n = GROUP.min(nbr - g0);
                let (per, loads) = group_shape(n);
                let dg = &mut dst[g0 * QK..];
                for t in 0..loads {
                    for lane in 0..n * per {
                        let (i, b) = lane_byte(n, lane, t).expect("a used lane");
                        let x = &src[(g0 + i) * QK..];
                        for e in 0..2 {
                            dg[32 * t + 2 * lane + e] = x[b + e];
                            dg[32 * t + 16 + 2 * lane + e] = x[16 + b + e];
                        }
                    }
                }
            }
        }
        QuantizedActs {
            cols,
            q,
            qp,
            qp_stride,
            d,
            s,
        }
    }
}

/// Whether the integer dots take weights of `dtype`: the 32-element block types (Q4_0, Q4_1,
/// Q8_0); the K-quants and the float types take the f32 path.
pub fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
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
    /// block once for all `R` rows. Used with (R, N) = (1, 4) for prefill tiles, (1, 5..=8) for
    /// steps of 5-8 tokens and (1, 1) otherwise ((2, 1) for decode measured no faster: decode is
    /// bound by the weight stream).
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

    /// Dots of one packed Q4_1 row of `nb` blocks (module docs) with `N` activation rows in packed
    /// order (`qp`, with their block scales `d` and sums `s`): per load, the weight bytes are
    /// widened once and split into nibbles for all tokens; each `vpmaddwd` lane is one block's
    /// running sum, so scales and minimums apply to 8 blocks at once. The last group may hold fewer
    /// blocks: its loads reach into the bytes after it (the next row or [`PACK_PAD`]), whose lanes
    /// meet zero activations, and its scales, minimums, `d` and `s` are masked to its blocks.
    #[inline(always)]
    unsafe fn dot_packed<const R: usize, const N: usize>(
        rows: [*const u8; R],
        nb: usize,
        qp: [*const i16; N],
        d: [*const f32; N],
        s: [*const f32; N],
    ) -> [[f32; N]; R] {
        let mask = _mm256_set1_epi16(0x0f);
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut off = [[_mm256_setzero_ps(); N]; R];
        for g0 in (0..nb).step_by(GROUP) {
            let n = GROUP.min(nb - g0);
            let (per, loads) = group_shape(n);
            let base: [*const u8; R] = std::array::from_fn(|r| rows[r].add(g0 * Q41_BYTES));
            let mut isum = [[_mm256_setzero_si256(); N]; R];
            for l in 0..loads {
                let x: [(__m256i, __m256i); N] = std::array::from_fn(|t| {
                    let x = qp[t].add(g0 * QK + 32 * l);
                    (
                        _mm256_loadu_si256(x as *const __m256i),
                        _mm256_loadu_si256(x.add(16) as *const __m256i),
                    )
                });
                for r in 0..R {
                    let w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                        base[r].add(4 * n + 2 * n * per * l) as *const __m128i,
                    ));
                    let (lo, hi) = (_mm256_and_si256(w16, mask), _mm256_srli_epi16(w16, 4));
                    for t in 0..N {
                        let p = _mm256_add_epi32(
                            _mm256_madd_epi16(lo, x[t].0),
                            _mm256_madd_epi16(hi, x[t].1),
                        );
                        isum[r][t] = _mm256_add_epi32(isum[r][t], p);
                    }
                }
            }
            for r in 0..R {
                let wd = _mm256_cvtph_ps(_mm_loadu_si128(base[r] as *const __m128i));
                let wm = _mm256_cvtph_ps(_mm_loadu_si128(base[r].add(2 * n) as *const __m128i));
                let (acc, off, isum) = (&mut acc[r], &mut off[r], &isum[r]);
                if n == GROUP {
                    for t in 0..N {
                        let sc = _mm256_mul_ps(wd, _mm256_loadu_ps(d[t].add(g0)));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), sc, acc[t]);
                        off[t] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(s[t].add(g0)), off[t]);
                    }
                } else {
                    // lane -> block lane / per; lanes past the blocks hold other bytes (possibly NaN as
                    // f16) and meet zero activations: zero their scales; the minimum counts once per
                    // block (its first lane)
                    let idx =
                        _mm256_srlv_epi32(lane, _mm256_set1_epi32(per.trailing_zeros() as i32));
                    let blocks = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane);
                    let used = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_set1_epi32((n * per) as i32),
                        lane,
                    ));
                    let first = _mm256_and_ps(
                        used,
                        _mm256_castsi256_ps(_mm256_cmpeq_epi32(
                            _mm256_and_si256(lane, _mm256_set1_epi32(per as i32 - 1)),
                            _mm256_setzero_si256(),
                        )),
                    );
                    let spread = |v: __m256| _mm256_permutevar8x32_ps(v, idx);
                    let wd = _mm256_and_ps(spread(wd), used);
                    let wm = _mm256_and_ps(spread(wm), first);
                    for t in 0..N {
                        let dt = spread(_mm256_maskload_ps(d[t].add(g0), blocks));
                        let st = spread(_mm256_maskload_ps(s[t].add(g0), blocks));
                        let sc = _mm256_mul_ps(wd, dt);
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), sc, acc[t]);
                        off[t] = _mm256_fmadd_ps(wm, st, off[t]);
                    }
                }
            }
        }
        let mut out = [[0f32; N]; R];
        for r in 0..R {
            for t in 0..N {
                out[r][t] = hsum(_mm256_add_ps(acc[r][t], off[r][t]));
            }
        }
        out
    }

    /// Dots of one row with `N` activation rows (tokens `t0..t0 + N`).
    #[inline(always)]
    unsafe fn dot_row<const K: u8, const N: usize>(
        row: *const u8,
        nb: usize,
        packed: bool,
        a: &QuantizedActs,
        t0: usize,
    ) -> [f32; N] {
        let d: [*const f32; N] = std::array::from_fn(|t| a.d.as_ptr().add((t0 + t) * nb));
        let s: [*const f32; N] = std::array::from_fn(|t| a.s.as_ptr().add((t0 + t) * nb));
        if packed && K == Q4_1 {
            let qp: [*const i16; N] =
                std::array::from_fn(|t| a.qp.as_ptr().add((t0 + t) * a.qp_stride));
            return dot_packed::<1, N>([row], nb, qp, d, s)[0];
        }
        let q: [*const i16; N] = std::array::from_fn(|t| a.q.as_ptr().add((t0 + t) * a.cols));
        dot_rn::<K, 1, N>(row, 0, nb, q, d, s)[0]
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
        let mut rr0 = 0;
        if w.packed && K == Q4_1 && n_tok == 1 && nb <= PAIR_MAX_BLOCKS {
            // one token, short rows: two rows at a time share the activation loads and the per-row
            // work (each row's arithmetic is the same as alone)
            let (qp, d, s) = ([a.qp.as_ptr()], [a.d.as_ptr()], [a.s.as_ptr()]);
            while rr0 + 2 <= nrows {
                let row = w.data.as_ptr().add((r0 + rr0) * rb);
                let r = dot_packed::<2, 1>([row, row.add(rb)], nb, qp, d, s);
                out_t[rr0] = r[0][0];
                out_t[rr0 + 1] = r[1][0];
                rr0 += 2;
            }
        }
        // 5-8 tokens (a verification step of 4-7 proposals, a short chunk): one tile, so each
        // weight block is read once rather than by a 4-token tile and again by the rest
        macro_rules! one_tile {
            ($($n:literal)*) => {
                match n_tok {
                    $($n => {
                        for rr in rr0..nrows {
                            let row = w.data.as_ptr().add((r0 + rr) * rb);
                            out_t[rr * $n..(rr + 1) * $n]
                                .copy_from_slice(&dot_row::<K, $n>(row, nb, w.packed, a, 0));
                        }
                        return;
                    })*
                    _ => {}
                }
            };
        }
        one_tile!(5 6 7 8);
        for rr in rr0..nrows {
            let row = w.data.as_ptr().add((r0 + rr) * rb);
            let out = &mut out_t[rr * n_tok..(rr + 1) * n_tok];
            let mut t = 0;
            while t + 4 <= n_tok {
                out[t..t + 4].copy_from_slice(&dot_row::<K, 4>(row, nb, w.packed, a, t));
                t += 4;
            }
            while t < n_tok {
                out[t] = dot_row::<K, 1>(row, nb, w.packed, a, t)[0];
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
        takes(dtype),
        "dot_row_qact: {dtype} is not a 32-element block type"
    );
    assert_eq!(row.len(), d.len() * dtype.block_bytes());
    assert!(q.len() == d.len() * QK && s.len() == d.len());
    #[cfg(target_arch = "x86_64")]
    if simd_level() == "avx2" {
        // SAFETY: avx2+fma+f16c present; lengths checked above.
        return unsafe { avx2::dot(dtype, row, q, d, s) };
    }
    dot_generic(dtype, row, q, d, s)
}

/// The quantized-activation analogue of `ops::matmul_rows`: rows `r0..` of the weight for
/// every token, into `out_t` = `[rows][n_tok]`.
pub fn matmul_rows_qact(
    w: MatRef<'_>,
    r0: usize,
    a: &QuantizedActs,
    n_tok: usize,
    out_t: &mut [f32],
) {
    assert!(takes(w.dtype));
    let rb = w.row_bytes();
    let nb = w.cols / QK;
    let nrows = out_t.len() / n_tok;
    assert!(
        a.cols == w.cols
            && (r0 + nrows) * rb <= w.data.len()
            && a.q.len() >= n_tok * w.cols
            && (!w.packed || a.qp.len() >= n_tok * a.qp_stride)
            && a.d.len() >= n_tok * nb
    );
    assert!(
        !w.packed || (w.dtype == DType::Q4_1 && w.data.len() >= w.rows * rb + PACK_PAD),
        "only Q4_1 rows are packed, padded by PACK_PAD bytes"
    );
    #[cfg(target_arch = "x86_64")]
    if simd_level() == "avx2" {
        // SAFETY: avx2+fma+f16c present; bounds checked above.
        unsafe { avx2::rows(w, r0, a, n_tok, out_t) };
        return;
    }
    let mut unpacked = Vec::new();
    let rows = if w.packed {
        unpacked.resize(nrows * rb, 0);
        unpack_q4_1_rows(&w.data[r0 * rb..(r0 + nrows) * rb], &mut unpacked, w.cols);
        &unpacked[..]
    } else {
        &w.data[r0 * rb..(r0 + nrows) * rb]
    };
    for rr in 0..nrows {
        let row = &rows[rr * rb..(rr + 1) * rb];
        for t in 0..n_tok {
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
    fn packing_round_trips_and_moves_whole_bytes() {
        for nb in [1usize, 2, 3, 4, 5, 8, 9, 10, 11, 13, 18, 48] {
            let row = rand_weights(DType::Q4_1, 1, nb * QK, nb as u64);
            let mut packed = vec![0u8; row.len()];
            pack_q4_1_rows(&row, &mut packed, nb * QK);
            let mut back = vec![0u8; row.len()];
            unpack_q4_1_rows(&packed, &mut back, nb * QK);
            assert_eq!(back, row, "{nb} blocks");
            if nb >= 8 {
                // group 0: block 3's scale and min, and its nibble bytes 4 and 5 (load 2)
                assert_eq!(packed[6..8], row[3 * 20..3 * 20 + 2]);
                assert_eq!(packed[16 + 6..16 + 8], row[3 * 20 + 2..3 * 20 + 4]);
                assert_eq!(
                    packed[32 + 16 * 2 + 6..32 + 16 * 2 + 8],
                    row[3 * 20 + 8..3 * 20 + 10]
                );
            }
        }
    }

    #[test]
    fn qact_dots_match_generic_and_f32_reference() {
        // the last group's lanes per block: 128 columns (4 blocks): 2; 288 (8 + 1): 8; 320 (8 + 2): 4;
        // 352 (8 + 3): 2; 416 (8 + 5): 1 (masked); 512: no short group
        for cols in [128usize, 288, 320, 352, 416, 512] {
            qact_dots_match(cols);
        }
    }

    fn qact_dots_match(cols: usize) {
        for n in [5, 8, 9] {
            qact_dots_match_n(cols, n);
        }
    }

    /// `n` tokens: 5 and 8 one tile each, 9 two 4-token tiles and one token alone.
    fn qact_dots_match_n(cols: usize, n: usize) {
        let rows = 19;
        let nb = cols / QK;
        for dt in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            let w = rand_weights(dt, rows, cols, 3);
            // the same bits per token as one at a time; an outlier in one block
            let mut x = rand_vec(cols * n, 9);
            x[7] = 40.0;
            let m = MatRef {
                dtype: dt,
                rows,
                cols,
                data: &w,
                packed: false,
                fp8: None,
            };
            let mut exact = vec![0f32; rows * n];
            let mut fast = vec![0f32; rows * n];
            crate::cpu::ops::matmul(m, &x, n, &mut exact);
            crate::cpu::ops::matmul_qact(m, &x, n, &mut fast);
            // the same products from packed Q4_1 rows, on both paths
            let mut wp = w.clone();
            let (mut fast_p, mut exact_p) = (vec![0f32; rows * n], vec![0f32; rows * n]);
            if dt == DType::Q4_1 {
                pack_q4_1(&mut wp, cols);
                let mp = MatRef {
                    data: &wp,
                    packed: true,
                    ..m
                };
                crate::cpu::ops::matmul_qact(mp, &x, n, &mut fast_p);
                crate::cpu::ops::matmul(mp, &x, n, &mut exact_p);
                assert_eq!(exact_p, exact, "{dt} {cols}: the f32 path on packed rows");
                // one token alone (rows in pairs) gives the same bits as inside a tile
                let mut one = vec![0f32; rows];
                crate::cpu::ops::matmul_qact(mp, &x[..cols], 1, &mut one);
                assert_eq!(one, fast_p[..rows], "{dt} {cols}: one token vs a tile");
            }
            let a = QuantizedActs::new(&x, cols, false);
            let rb = dt.row_bytes(cols).unwrap();
            for t in 0..n {
                for r in 0..rows {
                    let (q, d, s) = (
                        &a.q[t * cols..(t + 1) * cols],
                        &a.d[t * nb..(t + 1) * nb],
                        &a.s[t * nb..(t + 1) * nb],
                    );
                    let g = dot_generic(dt, &w[r * rb..(r + 1) * rb], q, d, s);
                    let f = fast[t * rows + r];
                    assert!(
                        (g - f).abs() <= 1e-5 * (1.0 + g.abs()),
                        "{dt}: generic {g} vs simd {f}"
                    );
                    if dt == DType::Q4_1 {
                        let fp = fast_p[t * rows + r];
                        assert!(
                            (g - fp).abs() <= 1e-5 * (1.0 + g.abs()),
                            "{dt} {cols}: generic {g} vs packed simd {fp} (token {t}, row {r})"
                        );
                    }
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
