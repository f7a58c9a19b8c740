//! The CPU reference ops of the Llama forward pass: small, public, f32 activations and accumulation.
//! Other backends (CUDA) test their kernels against these functions on random inputs.
//!
//! Weight matrices are ggml-ordered: a `[rows, cols]` matrix is `rows` rows of `cols` contiguous
//! elements (ggml `shape = [cols, rows]`), each row stored in the weight's [`DType`] (blocks of 32 for
//! the quantized types). Dot products dequantize on the fly inside the loop and accumulate in f32;
//! they are written as fixed-size block loops so rustc vectorizes them, and on x86-64 the same code is
//! compiled a second time with AVX2/FMA enabled and chosen at run time ([`simd_level`]).
//!
//! Conventions: RoPE rotates *adjacent* pairs `(x[2i], x[2i+1])` of each head by `pos * inv_freq[i]`
//! (the GGUF / llama.cpp "normal" rope; GGUF Q/K weights are permuted for it). Attention is causal
//! grouped-query attention: query head `h` reads KV head `h / (n_heads / n_kv_heads)`.

use metrale_core::dtype::{dequantize_row, f16_to_f32, DType, QK};

pub use super::mat::{simd_level, MatRef};

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

use crate::numerics::hsum16;
pub use crate::numerics::{dot_f32, rmsnorm};

/// `out += y`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// SwiGLU: `out = silu(gate) * up`, `silu(g) = g / (1 + exp(-g))`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// SwiGLU in place: `up = silu(gate) * up`.
pub fn swiglu_inplace(gate: &[f32], up: &mut [f32]) {
    for (u, &g) in up.iter_mut().zip(gate) {
        *u *= g / (1.0 + (-g).exp());
    }
}

/// gpt-oss's clamped SwiGLU in place: with `g = min(gate, 7)`,
/// `up = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` (transformers' `GptOssExperts`,
/// llama.cpp's `swiglu_oai`).
pub fn swiglu_oai_inplace(gate: &[f32], up: &mut [f32]) {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    for (u, &g) in up.iter_mut().zip(gate) {
        let g = g.min(LIMIT);
        *u = (u.clamp(-LIMIT, LIMIT) + 1.0) * g / (1.0 + (-ALPHA * g).exp());
    }
}

/// GeGLU with the tanh GELU in place: `up = gelu_tanh(gate) * up`, `gelu_tanh(g) = 0.5 g (1 +
/// tanh(sqrt(2 / pi) (g + 0.044715 g^3)))` (PyTorch's `gelu(approximate="tanh")`, Gemma's MLP).
pub fn geglu_tanh_inplace(gate: &[f32], up: &mut [f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (u, &g) in up.iter_mut().zip(gate) {
        *u *= 0.5 * g * (1.0 + (C * (g + 0.044715 * g * g * g)).tanh());
    }
}

/// In-place softmax over the whole slice (max-subtracted; an empty slice is left alone).
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(x: &[f32]) -> usize {
    crate::sampler::argmax(x)
}

/// Grouped-query attention of one query position over `n_ctx` cached positions.
/// `q`: `[n_heads * head_dim]`; `k`, `v`: `[n_ctx][n_kv_heads * head_dim]` (positions 0..n_ctx of one
/// layer of one sequence's cache); `out`: `[n_heads * head_dim]`; `scores`: scratch of `n_ctx`.
/// Scores are `q·k * scale` (scale = 1/sqrt(head_dim) for Llama), softmaxed over all `n_ctx`
/// positions (causality is the caller's choice of `n_ctx`).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    for h in 0..n_heads {
        attention_head(
            q,
            k,
            v,
            n_ctx,
            h,
            n_heads,
            n_kv_heads,
            head_dim,
            scale,
            scores,
            &mut out[h * head_dim..(h + 1) * head_dim],
        );
    }
}

/// One query head of [`attention`]: writes `out` = `[head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    h: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd_level() == "avx2" {
            // SAFETY: the CPU supports avx2, fma and f16c (checked just above).
            unsafe {
                attention_head_avx2(
                    q, k, v, n_ctx, h, n_heads, n_kv_heads, head_dim, scale, scores, out,
                )
            };
            return;
        }
    }
    attention_head_body(
        q, k, v, n_ctx, h, n_heads, n_kv_heads, head_dim, scale, scores, out,
    )
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attention_head_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    h: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attention_head_body(
        q, k, v, n_ctx, h, n_heads, n_kv_heads, head_dim, scale, scores, out,
    )
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attention_head_body(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    h: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let kv_dim = n_kv_heads * head_dim;
    let g = h / (n_heads / n_kv_heads);
    let qh = &q[h * head_dim..(h + 1) * head_dim];
    // A plain loop (not an iterator adapter) so that it is inlined into the AVX2 instance.
    scores.clear();
    scores.resize(n_ctx, 0.0);
    for (p, sc) in scores.iter_mut().enumerate() {
        *sc = dot_f32(qh, &k[p * kv_dim + g * head_dim..][..head_dim]) * scale;
    }
    softmax_inplace(scores);
    out.fill(0.0);
    for (p, &w) in scores.iter().enumerate() {
        let vp = &v[p * kv_dim + g * head_dim..][..head_dim];
        for (o, &x) in out.iter_mut().zip(vp) {
            *o += w * x;
        }
    }
}

/// Positions per attention chunk. Every query token's attention is computed chunk by chunk over its
/// positions (0..128, 128..256, ...) and the chunks are combined in order, whichever task computed
/// them: the result of a token is the same bits in a prefill block, alone, or with its chunks spread
/// over threads (how one decode token's attention uses every core at long contexts).
pub const ATT_CHUNK: usize = 128;

/// Replace the scores `s` by `exp(s - max)` and return (max, their sum in 8 fixed lanes).
#[inline(always)]
fn exp_shifted(s: &mut [f32]) -> (f32, f32) {
    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [0f32; 8];
    let mut it = s.chunks_exact_mut(8);
    for c in &mut it {
        for (l, e) in lanes.iter_mut().zip(c.iter_mut()) {
            *e = crate::numerics::exp_approx(*e - m);
            *l += *e;
        }
    }
    for (l, e) in lanes.iter_mut().zip(it.into_remainder()) {
        *e = crate::numerics::exp_approx(*e - m);
        *l += *e;
    }
    (m, lanes.iter().sum())
}

/// One KV head's rows of one layer of one sequence: `k`, `v` are `[n_pos][kv_dim]`, the head's
/// columns start at `g * head_dim`. A query at position p attends to the last `window` positions
/// up to and including p (`usize::MAX`: all of them; sliding-window layers: their window).
#[derive(Debug, Clone, Copy)]
pub struct KvHead<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub kv_dim: usize,
    pub g: usize,
    pub head_dim: usize,
    pub window: usize,
}

/// Floats of one chunk partial: max score, sum of exponentials, unnormalised output.
pub fn partial_len(head_dim: usize) -> usize {
    head_dim + 2
}

/// One query head over positions `p0..p1` (at most [`ATT_CHUNK`]): `part` = [max score m,
/// sum of exp(score - m), sum of exp(score - m) * v]. `scores`: scratch of `ATT_CHUNK`.
#[inline(always)]
fn chunk_partial(
    qh: &[f32],
    kv: KvHead<'_>,
    (p0, p1): (usize, usize),
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
) {
    let (hd, off) = (kv.head_dim, kv.g * kv.head_dim);
    let s = &mut scores[..p1 - p0];
    for (j, sj) in s.iter_mut().enumerate() {
        *sj = dot_f32(qh, &kv.k[(p0 + j) * kv.kv_dim + off..][..hd]) * scale;
    }
    let (m, l) = exp_shifted(s);
    let (ml, o) = part.split_at_mut(2);
    ml[0] = m;
    ml[1] = l;
    o.fill(0.0);
    for (j, &e) in s.iter().enumerate() {
        let vp = &kv.v[(p0 + j) * kv.kv_dim + off..][..hd];
        for (a, &x) in o.iter_mut().zip(vp) {
            *a += e * x;
        }
    }
}

/// The partials of chunks `c0..c1` for a block of query tokens (positions `pos[i]`, attending to
/// `0..=pos[i]`) and the query heads of KV head `kv.g` (`gs` of them, of `n_heads`): `parts` is
/// `[token][chunk - c0][head]` x [`partial_len`]; chunks past a token's last position are left alone.
/// Every K/V chunk is read once for the whole block. `scores`: scratch.
#[allow(clippy::too_many_arguments)]
pub fn attention_partials(
    q: &[&[f32]],
    pos: &[usize],
    kv: KvHead<'_>,
    gs: usize,
    scale: f32,
    (c0, c1): (usize, usize),
    scores: &mut Vec<f32>,
    parts: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == "avx2" {
        // SAFETY: the CPU supports avx2, fma and f16c (checked just above).
        return unsafe { attention_partials_avx2(q, pos, kv, gs, scale, (c0, c1), scores, parts) };
    }
    attention_partials_body(q, pos, kv, gs, scale, (c0, c1), scores, parts)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attention_partials_avx2(
    q: &[&[f32]],
    pos: &[usize],
    kv: KvHead<'_>,
    gs: usize,
    scale: f32,
    c: (usize, usize),
    scores: &mut Vec<f32>,
    parts: &mut [f32],
) {
    attention_partials_body(q, pos, kv, gs, scale, c, scores, parts)
}

/// [`chunk_partial`] for 64-dimensional heads with AVX2: the query in 8 registers, 4 positions'
/// dots at a time reduced together, the output accumulated in 8 registers. The same operations in
/// the same order on every call, so its bits do not depend on how a context is split.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_partial_64(
    qh: &[f32],
    kv: KvHead<'_>,
    (p0, p1): (usize, usize),
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
) {
    use std::arch::x86_64::*;
    let off = kv.g * 64;
    assert!(kv.head_dim == 64 && qh.len() == 64 && part.len() >= 66 && scores.len() >= p1 - p0);
    assert!((p1 - 1) * kv.kv_dim + off + 64 <= kv.k.len().min(kv.v.len()));
    let krow = |p: usize| kv.k.as_ptr().add(p * kv.kv_dim + off);
    let vrow = |p: usize| kv.v.as_ptr().add(p * kv.kv_dim + off);
    let qv: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(qh.as_ptr().add(8 * i)));
    let dot8 = |p: usize| {
        let r = krow(p);
        let mut a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(r));
        for (i, qi) in qv.iter().enumerate().skip(1) {
            a = _mm256_fmadd_ps(*qi, _mm256_loadu_ps(r.add(8 * i)), a);
        }
        a
    };
    let n = p1 - p0;
    let vs = _mm_set1_ps(scale);
    let mut j = 0;
    while j + 4 <= n {
        let (a0, a1, a2, a3) = (
            dot8(p0 + j),
            dot8(p0 + j + 1),
            dot8(p0 + j + 2),
            dot8(p0 + j + 3),
        );
        let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        let sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        _mm_storeu_ps(scores.as_mut_ptr().add(j), _mm_mul_ps(sum, vs));
        j += 4;
    }
    while j < n {
        let a = dot8(p0 + j);
        let h = _mm256_hadd_ps(_mm256_hadd_ps(a, a), _mm256_hadd_ps(a, a));
        let sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        scores[j] = _mm_cvtss_f32(_mm_mul_ps(sum, vs));
        j += 1;
    }
    let s = &mut scores[..n];
    let (m, l) = exp_shifted(s);
    let mut o = [_mm256_setzero_ps(); 8];
    for (j, &e) in s.iter().enumerate() {
        let (r, w) = (vrow(p0 + j), _mm256_set1_ps(e));
        for (i, oi) in o.iter_mut().enumerate() {
            *oi = _mm256_fmadd_ps(w, _mm256_loadu_ps(r.add(8 * i)), *oi);
        }
    }
    part[0] = m;
    part[1] = l;
    for (i, oi) in o.iter().enumerate() {
        _mm256_storeu_ps(part.as_mut_ptr().add(2 + 8 * i), *oi);
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attention_partials_body(
    q: &[&[f32]],
    pos: &[usize],
    kv: KvHead<'_>,
    gs: usize,
    scale: f32,
    (c0, c1): (usize, usize),
    scores: &mut Vec<f32>,
    parts: &mut [f32],
) {
    let (hd, pl) = (kv.head_dim, partial_len(kv.head_dim));
    scores.resize(ATT_CHUNK, 0.0);
    let per_token = (c1 - c0) * gs * pl;
    for c in c0..c1 {
        for (i, qi) in q.iter().enumerate() {
            let p1 = (pos[i] + 1).min((c + 1) * ATT_CHUNK);
            if c * ATT_CHUNK >= p1 {
                continue;
            }
            // a sliding window's first position; a chunk wholly before it adds nothing
            let p0 = (c * ATT_CHUNK).max((pos[i] + 1).saturating_sub(kv.window));
            for hh in 0..gs {
                let h = kv.g * gs + hh;
                let at = i * per_token + ((c - c0) * gs + hh) * pl;
                let (qh, part) = (&qi[h * hd..(h + 1) * hd], &mut parts[at..at + pl]);
                if p0 >= p1 {
                    part[0] = f32::NEG_INFINITY;
                    part[1..].fill(0.0);
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                if hd == 64 && simd_level() == "avx2" {
                    // SAFETY: the CPU has avx2 and fma (checked); the rows are bounds-checked inside.
                    unsafe { chunk_partial_64(qh, kv, (p0, p1), scale, scores, part) };
                    continue;
                }
                chunk_partial(qh, kv, (p0, p1), scale, scores, part);
            }
        }
    }
}

/// Combine the partials of chunks 0.. of one query head (each [`partial_len`] floats, `stride`
/// apart, `n` of them, in chunk order) into its normalised output. A `sink` logit (gpt-oss's
/// attention sinks) joins the softmax's denominator as a position whose value is zero.
pub fn attention_combine(
    parts: &[f32],
    stride: usize,
    n: usize,
    sink: Option<f32>,
    out: &mut [f32],
) {
    let m = (0..n)
        .map(|c| parts[c * stride])
        .chain(sink)
        .fold(f32::NEG_INFINITY, f32::max);
    let mut l = sink.map_or(0.0, |s| crate::numerics::exp_approx(s - m));
    out.fill(0.0);
    for c in 0..n {
        let p = &parts[c * stride..];
        let w = crate::numerics::exp_approx(p[0] - m);
        l += w * p[1];
        let hd = out.len();
        for (a, &x) in out.iter_mut().zip(&p[2..2 + hd]) {
            *a += w * x;
        }
    }
    let inv = 1.0 / l;
    for a in out.iter_mut() {
        *a *= inv;
    }
}

/// Causal grouped-query attention of a block of query tokens of one sequence, for the query heads of
/// KV head `g` (the numbers of [`attention_head`] up to rounding), chunk by chunk ([`ATT_CHUNK`]):
/// the partials of every chunk, then their combination, as one decode token split over threads gets.
/// `q[i]`: query token i's full query vector (`[n_heads * head_dim]`); it attends to positions
/// `0..=pos[i]`, or with a sliding `window` the last `window` of them. `k`, `v`: `[n_pos][n_kv_heads * head_dim]` with `n_pos > max(pos)`.
/// `out[i]`: token i's outputs for the group's heads (`[group_size * head_dim]`, group_size =
/// n_heads / n_kv_heads). `scratch`: reused buffers.
#[allow(clippy::too_many_arguments)]
pub fn attention_block(
    q: &[&[f32]],
    pos: &[usize],
    k: &[f32],
    v: &[f32],
    g: usize,
    n_heads: usize,
    n_kv_heads: usize,
    (head_dim, scale, window): (usize, f32, usize),
    sinks: Option<&[f32]>,
    scratch: &mut (Vec<f32>, Vec<f32>),
    out: &mut [&mut [f32]],
) {
    let Some(&max_pos) = pos.iter().max() else {
        return;
    };
    let gs = n_heads / n_kv_heads;
    let nc = (max_pos + 1).div_ceil(ATT_CHUNK);
    let pl = partial_len(head_dim);
    let kv = KvHead {
        k,
        v,
        kv_dim: n_kv_heads * head_dim,
        g,
        head_dim,
        window,
    };
    let (scores, parts) = scratch;
    parts.resize(q.len() * nc * gs * pl, 0.0);
    attention_partials(q, pos, kv, gs, scale, (0, nc), scores, parts);
    for (i, o) in out.iter_mut().enumerate() {
        let n = (pos[i] + 1).div_ceil(ATT_CHUNK);
        for hh in 0..gs {
            let at = (i * nc * gs + hh) * pl;
            attention_combine(
                &parts[at..],
                gs * pl,
                n,
                sinks.map(|s| s[g * gs + hh]),
                &mut o[hh * head_dim..(hh + 1) * head_dim],
            );
        }
    }
}

/// The per-token activation data a fused dot needs besides `x` itself: for Q4_0/Q4_1 the sum of
/// each 32-element block of `x` (the offset terms `-8*d*Σx` and `m*Σx`).
pub fn block_sums(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(QK).map(|c| c.iter().sum()).collect()
}

// ---- fused dot products: one weight row (bytes) with one f32 activation row ----

#[inline(always)]
fn dot_q4_1_row(row: &[u8], x: &[f32], xs: &[f32]) -> f32 {
    let mut racc = [0f32; 16];
    let mut moff = 0f32;
    for ((b, xb), &s) in row.chunks_exact(20).zip(x.chunks_exact(QK)).zip(xs) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..20];
        let mut acc = [0f32; 16];
        for j in 0..16 {
            acc[j] = (qs[j] & 0x0f) as f32 * xb[j] + (qs[j] >> 4) as f32 * xb[j + 16];
        }
        for j in 0..16 {
            racc[j] += d * acc[j];
        }
        moff += m * s;
    }
    hsum16(&racc) + moff
}

#[inline(always)]
fn dot_q4_0_row(row: &[u8], x: &[f32], xs: &[f32]) -> f32 {
    let mut racc = [0f32; 16];
    let mut off = 0f32;
    for ((b, xb), &s) in row.chunks_exact(18).zip(x.chunks_exact(QK)).zip(xs) {
        let d = f16_at(b, 0);
        let qs = &b[2..18];
        let mut acc = [0f32; 16];
        for j in 0..16 {
            acc[j] = (qs[j] & 0x0f) as f32 * xb[j] + (qs[j] >> 4) as f32 * xb[j + 16];
        }
        for j in 0..16 {
            racc[j] += d * acc[j];
        }
        off += d * s;
    }
    hsum16(&racc) - 8.0 * off
}

#[inline(always)]
fn dot_q8_0_row(row: &[u8], x: &[f32]) -> f32 {
    let mut racc = [0f32; 16];
    for (b, xb) in row.chunks_exact(34).zip(x.chunks_exact(QK)) {
        let d = f16_at(b, 0);
        let qs = &b[2..34];
        let mut acc = [0f32; 16];
        for j in 0..16 {
            acc[j] = (qs[j] as i8) as f32 * xb[j] + (qs[j + 16] as i8) as f32 * xb[j + 16];
        }
        for j in 0..16 {
            racc[j] += d * acc[j];
        }
    }
    hsum16(&racc)
}

#[inline(always)]
fn dot_f32_row(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (b, xb) in row.chunks_exact(64).zip(x.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] +=
                f32::from_le_bytes([b[4 * l], b[4 * l + 1], b[4 * l + 2], b[4 * l + 3]]) * xb[l];
        }
    }
    let rem = x.len() / 16 * 16;
    let mut s = 0.0;
    for (i, xi) in x.iter().enumerate().skip(rem) {
        s += f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]) * xi;
    }
    hsum16(&acc) + s
}

#[inline(always)]
fn dot_16bit_row(row: &[u8], x: &[f32], bf: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if bf && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above; the check is a cached load).
        return unsafe { dot_bf16_row_avx2(row, x) };
    }
    dot_16bit_row_scalar(row, x, bf)
}

#[inline(always)]
fn dot_16bit_row_scalar(row: &[u8], x: &[f32], bf: bool) -> f32 {
    let conv = |lo: u8, hi: u8| {
        let h = u16::from_le_bytes([lo, hi]);
        if bf {
            f32::from_bits((h as u32) << 16)
        } else {
            f16_to_f32(h)
        }
    };
    let mut acc = [0f32; 16];
    for (b, xb) in row.chunks_exact(32).zip(x.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += conv(b[2 * l], b[2 * l + 1]) * xb[l];
        }
    }
    let rem = x.len() / 16 * 16;
    let mut s = 0.0;
    for (i, xi) in x.iter().enumerate().skip(rem) {
        s += conv(row[2 * i], row[2 * i + 1]) * xi;
    }
    hsum16(&acc) + s
}

/// [`dot_16bit_row`] of a bf16 row with AVX2: the same 16 lanes, each a multiply then an add per
/// 16 elements in order, and the same tail and final sum, so the bits are the scalar loop's;
/// written out because the compiler widened the bf16 values through byte shuffles on 128-bit
/// registers (3.5 GB/s of weights on two cores, gpt-oss-20b's 1.16 GB LM head in 330 ms).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_bf16_row_avx2(row: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len() / 16;
    assert!(row.len() >= 2 * x.len());
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let widen = |p: *const u8| {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    };
    for c in 0..n {
        let (w, xc) = (row.as_ptr().add(32 * c), x.as_ptr().add(16 * c));
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(widen(w), _mm256_loadu_ps(xc)));
        a1 = _mm256_add_ps(
            a1,
            _mm256_mul_ps(widen(w.add(16)), _mm256_loadu_ps(xc.add(8))),
        );
    }
    let mut acc = [0f32; 16];
    _mm256_storeu_ps(acc.as_mut_ptr(), a0);
    _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
    let mut s = 0.0;
    for (i, xi) in x.iter().enumerate().skip(16 * n) {
        s += f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16) * xi;
    }
    hsum16(&acc) + s
}

/// Dot product of one weight row (`cols` elements of `dtype`, `row.len() == dtype.row_bytes(cols)`)
/// with `x` (`cols` f32), dequantizing on the fly, f32 accumulation. `xs` = [`block_sums`]`(x)`
/// (only read for Q4_0/Q4_1). Panics if the lengths disagree (callers validate shapes at load).
#[inline(always)]
pub fn dot_row(dtype: DType, row: &[u8], x: &[f32], xs: &[f32]) -> f32 {
    match dtype {
        DType::Q4_1 => dot_q4_1_row(row, x, xs),
        DType::Q4_0 => dot_q4_0_row(row, x, xs),
        DType::Q8_0 => dot_q8_0_row(row, x),
        DType::F32 => dot_f32_row(row, x),
        DType::F16 => dot_16bit_row(row, x, false),
        DType::BF16 => dot_16bit_row(row, x, true),
        #[cfg(target_arch = "x86_64")]
        DType::MXFP4 if std::is_x86_feature_detected!("avx2") => {
            // SAFETY: the CPU has AVX2 (checked in the guard; a cached load).
            unsafe { dot_mxfp4_row_avx2(row, x) }
        }
        DType::Q5_0
        | DType::Q5_1
        | DType::MXFP4
        | DType::IQ4_NL
        | DType::IQ4_XS
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K => dot_dequant_row(dtype, row, x),
        DType::F8_E4M3 => dot_fp8_row(row, x),
    }
}

/// Dot product of a row of e4m3 bytes with `x` (the row's scale is applied by the caller,
/// [`matmul_rows`]): each byte's value from the table, accumulated as [`dot16`] does, so a row
/// dequantised once and dotted with many tokens gives the same bits.
#[inline(always)]
fn dot_fp8_row(row: &[u8], x: &[f32]) -> f32 {
    let t = &metrale_core::fp8::E4M3_TABLE;
    let mut acc = [0f32; 16];
    for (b, xs) in row.chunks_exact(16).zip(x.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += t[b[l] as usize] * xs[l];
        }
    }
    let done = x.len() / 16 * 16;
    let tail: f32 = row[done..]
        .iter()
        .zip(&x[done..])
        .map(|(&b, v)| t[b as usize] * v)
        .sum();
    hsum16(&acc) + tail
}

/// The types whose rows [`matmul_rows`] dequantises once for every token of a chunk (one token:
/// [`dot_dequant_row`] a block at a time, or FP8's table lookups). MXFP4 with AVX2 is dotted
/// token by token ([`dot_mxfp4_row_avx2`], the same bits): its rows are experts' and a chunk
/// gives an expert a few tokens, for which dequantising every row of it first cost 3x more.
fn dequantising(dtype: DType) -> bool {
    #[cfg(target_arch = "x86_64")]
    if dtype == DType::MXFP4 && std::is_x86_feature_detected!("avx2") {
        return false;
    }
    matches!(
        dtype,
        DType::Q5_0
            | DType::Q5_1
            | DType::MXFP4
            | DType::IQ4_NL
            | DType::IQ4_XS
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::F8_E4M3
    )
}

/// Dot product of a row of a [`dequantising`] type with `x`: each block dequantised by the reference
/// (`metrale_core::dtype` / `kquant`) into a buffer on the stack, then multiplied ([`dot16_acc`]).
#[inline(always)]
fn dot_dequant_row(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    use metrale_core::kquant::QK_K;
    let (be, k) = (dtype.block_elems(), dtype.kquant());
    let mut w = [0f32; QK_K];
    let mut acc = [0f32; 16];
    for (b, xb) in row
        .chunks_exact(dtype.block_bytes())
        .zip(x.chunks_exact(be))
    {
        match k {
            Some(k) => k.dequantize_block(b, &mut w),
            None => dequantize_row(dtype, b, &mut w[..be]).expect("whole blocks"),
        }
        dot16_acc(&mut acc, &w[..be], xb);
    }
    hsum16(&acc)
}

/// [`dot_dequant_row`] of an MXFP4 row with AVX2: each block's 32 values (a level times the
/// block's power of two: exact in f32) looked up with a byte shuffle, then accumulated in the 16
/// lanes and the order of [`dot16_acc`], so the bits are the dequantising dot's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_mxfp4_row_avx2(row: &[u8], x: &[f32]) -> f32 {
    use metrale_core::format::mxfp4::{half_scale, BLOCK_BYTES, LEVELS};
    use std::arch::x86_64::*;
    let nb = x.len() / QK;
    assert!(row.len() >= nb * BLOCK_BYTES && x.len() == nb * QK);
    let table = _mm_loadu_si128(LEVELS.as_ptr() as *const __m128i);
    let low = _mm_set1_epi8(0x0f);
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..nb {
        let p = row.as_ptr().add(b * BLOCK_BYTES);
        let d = _mm256_set1_ps(half_scale(*p));
        let q = _mm_loadu_si128(p.add(1) as *const __m128i);
        // elements 0..15 from the low nibbles, 16..31 from the high ones
        for (h, codes) in [
            _mm_and_si128(q, low),
            _mm_and_si128(_mm_srli_epi16::<4>(q), low),
        ]
        .into_iter()
        .enumerate()
        {
            let lv = _mm_shuffle_epi8(table, codes);
            let w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lv)), d);
            let w1 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lv))),
                d,
            );
            let xp = x.as_ptr().add(b * QK + 16 * h);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(w0, _mm256_loadu_ps(xp)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(w1, _mm256_loadu_ps(xp.add(8))));
        }
    }
    let mut acc = [0f32; 16];
    _mm256_storeu_ps(acc.as_mut_ptr(), a0);
    _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
    hsum16(&acc)
}

/// [`dot16_acc`] over `w` and `x`, summed, plus the products past the last whole 16 elements.
#[inline(always)]
fn dot16(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    dot16_acc(&mut acc, w, x);
    let done = x.len() / 16 * 16;
    let tail: f32 = w[done..].iter().zip(&x[done..]).map(|(a, b)| a * b).sum();
    hsum16(&acc) + tail
}

/// `acc[l] += w[16 i + l] * x[16 i + l]` over whole 16-element chunks, in order: every dequantising
/// dot accumulates this way, so a row dequantised once and dotted with many tokens gives the bits
/// of [`dot_dequant_row`].
#[inline(always)]
fn dot16_acc(acc: &mut [f32; 16], w: &[f32], x: &[f32]) {
    for (ws, xs) in w.chunks_exact(16).zip(x.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += ws[l] * xs[l];
        }
    }
}

/// Rows per cache block of [`matmul_rows`]: a block of weight rows stays in L1 while every token of
/// the chunk passes over it.
pub const ROW_BLOCK: usize = 8;

#[inline(always)]
fn matmul_rows_body(
    w: MatRef<'_>,
    r0: usize,
    x: &[f32],
    xs: &[f32],
    n_tok: usize,
    out_t: &mut [f32],
) {
    let rb = w.row_bytes();
    let nb = w.cols / QK.min(w.cols.max(1));
    let nrows = out_t.len() / n_tok;
    if n_tok > 1 && dequantising(w.dtype) {
        // a block of rows dequantised once, then every token's dots on the f32 rows
        let mut deq = vec![0f32; ROW_BLOCK * w.cols];
        let mut r = 0;
        while r < nrows {
            let re = (r + ROW_BLOCK).min(nrows);
            for rr in r..re {
                let row = &w.data[(r0 + rr) * rb..(r0 + rr + 1) * rb];
                let d = &mut deq[(rr - r) * w.cols..(rr - r + 1) * w.cols];
                dequantize_row(w.dtype, row, d).expect("shapes validated at load");
            }
            for t in 0..n_tok {
                let xt = &x[t * w.cols..(t + 1) * w.cols];
                for rr in r..re {
                    out_t[rr * n_tok + t] =
                        dot16(&deq[(rr - r) * w.cols..(rr - r + 1) * w.cols], xt);
                }
            }
            r = re;
        }
        return;
    }
    let mut r = 0;
    while r < nrows {
        let re = (r + ROW_BLOCK).min(nrows);
        for t in 0..n_tok {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            let xst = if xs.is_empty() {
                xs
            } else {
                &xs[t * nb..(t + 1) * nb]
            };
            for rr in r..re {
                let row = &w.data[(r0 + rr) * rb..(r0 + rr + 1) * rb];
                out_t[rr * n_tok + t] = dot_row(w.dtype, row, xt, xst);
            }
        }
        r = re;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn matmul_rows_avx2(
    w: MatRef<'_>,
    r0: usize,
    x: &[f32],
    xs: &[f32],
    n_tok: usize,
    out_t: &mut [f32],
) {
    matmul_rows_body(w, r0, x, xs, n_tok, out_t)
}

/// `out_t[rr * n_tok + t] = dot(W[r0 + rr], x[t])` for `rr < out_t.len() / n_tok` and `t < n_tok`:
/// a block of output rows for every token (rows-major output). `x` is `[n_tok][cols]`, `xs` the
/// concatenated [`block_sums`] of each token (may be empty unless the weight is Q4_0/Q4_1).
pub fn matmul_rows(
    w: MatRef<'_>,
    r0: usize,
    x: &[f32],
    xs: &[f32],
    n_tok: usize,
    out_t: &mut [f32],
) {
    assert!(
        !w.packed,
        "matmul_rows reads GGUF order (unpack packed rows first)"
    );
    #[cfg(target_arch = "x86_64")]
    let done = if simd_level() == "avx2" {
        // SAFETY: the CPU supports avx2 and fma (checked just above).
        unsafe { matmul_rows_avx2(w, r0, x, xs, n_tok, out_t) };
        true
    } else {
        false
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = false;
    if !done {
        matmul_rows_body(w, r0, x, xs, n_tok, out_t)
    }
    if let Some(f) = w.fp8 {
        // an FP8 row's scale, once per output (the input's scale is in `x`: fp8_input)
        for (o, s) in out_t.chunks_exact_mut(n_tok).zip(&f.scales[r0..]) {
            for v in o {
                *v *= s;
            }
        }
    }
}

/// The input an FP8 matrix's product reads (`metrale_core::fp8`): each token's row quantized to
/// e4m3 with the matrix's static scale or the row's own; `None` for other types.
pub fn fp8_input(w: &MatRef<'_>, x: &[f32]) -> Option<Vec<f32>> {
    let f = w.fp8?;
    let mut q = x.to_vec();
    metrale_core::fp8::quantize_activations(&mut q, w.cols, f.input_scale, f.ub);
    Some(q)
}

/// Matrix-vector product `out[r] = dot(W[r], x)` for every row (single-threaded reference).
pub fn matvec(w: MatRef<'_>, x: &[f32], out: &mut [f32]) {
    let xq = fp8_input(&w, x);
    let x = xq.as_deref().unwrap_or(x);
    let xs = if matches!(w.dtype, DType::Q4_0 | DType::Q4_1) {
        block_sums(x)
    } else {
        Vec::new()
    };
    matmul_rows(w, 0, x, &xs, 1, out)
}

/// Run several matrix products in one parallel region on the current rayon pool: the output rows of
/// every matrix are split into chunks (multiples of [`ROW_BLOCK`]) and `f(matrix, first_row,
/// out_t_chunk)` runs on each, `out_t` being `[rows][n_tok]`; the results are then transposed into
/// `outs[i]` = `[n_tok][rows_i]`. One region instead of one per matrix halves the thread
/// synchronisations of a decode step.
fn par_rows_many(
    rows: &[usize],
    n_tok: usize,
    outs: &mut [&mut [f32]],
    f: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads().max(1);
    let total: usize = rows.iter().sum();
    let chunk_rows = (total.div_ceil(threads * 4)).div_ceil(ROW_BLOCK).max(1) * ROW_BLOCK;
    if threads == 1 || total * n_tok <= 64 {
        for (i, o) in outs.iter_mut().enumerate() {
            if n_tok == 1 {
                f(i, 0, o);
            } else {
                let mut out_t = vec![0f32; rows[i] * n_tok];
                f(i, 0, &mut out_t);
                transpose_into(&out_t, rows[i], n_tok, o);
            }
        }
        return;
    }
    if n_tok == 1 {
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        for (i, o) in outs.iter_mut().enumerate() {
            for (c, chunk) in o.chunks_mut(chunk_rows).enumerate() {
                tasks.push((i, c * chunk_rows, chunk));
            }
        }
        tasks.into_par_iter().for_each(|(i, r0, o)| f(i, r0, o));
        return;
    }
    let mut outs_t: Vec<Vec<f32>> = rows.iter().map(|&r| vec![0f32; r * n_tok]).collect();
    {
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        for (i, o) in outs_t.iter_mut().enumerate() {
            for (c, chunk) in o.chunks_mut(chunk_rows * n_tok).enumerate() {
                tasks.push((i, c * chunk_rows, chunk));
            }
        }
        tasks.into_par_iter().for_each(|(i, r0, o)| f(i, r0, o));
    }
    for (i, o) in outs.iter_mut().enumerate() {
        transpose_into(&outs_t[i], rows[i], n_tok, o);
    }
}

fn transpose_into(out_t: &[f32], rows: usize, n_tok: usize, out: &mut [f32]) {
    for r in 0..rows {
        for t in 0..n_tok {
            out[t * rows + r] = out_t[r * n_tok + t];
        }
    }
}

fn check_shapes(what: &str, ws: &[MatRef<'_>], x: &[f32], n_tok: usize, outs: &[&mut [f32]]) {
    assert_eq!(
        ws.len(),
        outs.len(),
        "{what}: {} matrices but {} outputs",
        ws.len(),
        outs.len()
    );
    for (w, o) in ws.iter().zip(outs) {
        assert_eq!(
            x.len(),
            n_tok * w.cols,
            "{what}: x has {} values, expected {} x {}",
            x.len(),
            n_tok,
            w.cols
        );
        assert_eq!(
            o.len(),
            n_tok * w.rows,
            "{what}: out has {} values, expected {} x {}",
            o.len(),
            n_tok,
            w.rows
        );
    }
}

/// Several matrix products of one input, f32 activations (the reference), parallel over output
/// rows on the current rayon pool: `outs[i][t * rows_i + r] = dot(ws[i][r], x[t])`,
/// `x` = `[n_tok][cols]`.
pub fn matmul_many(ws: &[MatRef<'_>], x: &[f32], n_tok: usize, outs: &mut [&mut [f32]]) {
    check_shapes("matmul", ws, x, n_tok, outs);
    let Some(cols) = ws.first().map(|w| w.cols) else {
        return;
    };
    let xs: Vec<f32> = if ws
        .iter()
        .any(|w| matches!(w.dtype, DType::Q4_0 | DType::Q4_1))
    {
        x.chunks_exact(cols).flat_map(block_sums).collect()
    } else {
        Vec::new()
    };
    let rows: Vec<usize> = ws.iter().map(|w| w.rows).collect();
    // FP8 matrices read their input quantized (one copy per matrix: static scales differ)
    let fp8_x: Vec<Option<Vec<f32>>> = ws.iter().map(|w| fp8_input(w, x)).collect();
    par_rows_many(&rows, n_tok, outs, |i, r0, o| {
        let w = ws[i];
        if let Some(xq) = &fp8_x[i] {
            return matmul_rows(w, r0, xq, &xs, n_tok, o);
        }
        if !w.packed {
            return matmul_rows(w, r0, x, &xs, n_tok, o);
        }
        // the f32 reference reads GGUF order: unpack this chunk's rows first
        let rb = w.row_bytes();
        let n = o.len() / n_tok;
        let mut rows = vec![0u8; n * rb];
        super::qact::unpack_q4_1_rows(&w.data[r0 * rb..(r0 + n) * rb], &mut rows, w.cols);
        let plain = MatRef {
            rows: n,
            data: &rows,
            packed: false,
            ..w
        };
        matmul_rows(plain, 0, x, &xs, n_tok, o)
    });
}

/// One matrix product: [`matmul_many`] with one matrix.
pub fn matmul(w: MatRef<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
    matmul_many(&[w], x, n_tok, &mut [out])
}

/// Like [`matmul_many`], but for block-quantized weights the activations are first quantized to
/// 16-bit integers per 32-element block ([`super::qact::QuantizedActs`], once for all matrices) and
/// the dots run in exact integer arithmetic (see [`super::qact`] for the error this adds). When any
/// matrix has a type those dots do not take (the float types, the K-quants), all use
/// [`matmul_many`].
pub fn matmul_qact_many(ws: &[MatRef<'_>], x: &[f32], n_tok: usize, outs: &mut [&mut [f32]]) {
    if ws.iter().any(|w| !super::qact::takes(w.dtype)) {
        return matmul_many(ws, x, n_tok, outs);
    }
    check_shapes("matmul_qact", ws, x, n_tok, outs);
    let Some(cols) = ws.first().map(|w| w.cols) else {
        return;
    };
    let acts = super::qact::QuantizedActs::new(x, cols, ws.iter().any(|w| w.packed));
    let rows: Vec<usize> = ws.iter().map(|w| w.rows).collect();
    par_rows_many(&rows, n_tok, outs, |i, r0, o| {
        super::qact::matmul_rows_qact(ws[i], r0, &acts, n_tok, o)
    });
}

/// One matrix product: [`matmul_qact_many`] with one matrix.
pub fn matmul_qact(w: MatRef<'_>, x: &[f32], n_tok: usize, out: &mut [f32]) {
    matmul_qact_many(&[w], x, n_tok, &mut [out])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::synthetic::{rand_vec, rand_weights};
    use metrale_core::dtype::dequantize_row;

    /// The AVX2 MXFP4 dot gives the dequantising dot's bits (rows of random blocks, every code
    /// and scales 2^-7 to 2^-4).
    #[test]
    fn mxfp4_dot_with_avx2_is_the_dequantising_dot_bit_for_bit() {
        for cols in [32, 2880] {
            let w = rand_weights(DType::MXFP4, 3, cols, 13);
            let x = rand_vec(cols, 6);
            let rb = DType::MXFP4.row_bytes(cols).unwrap();
            for r in w.chunks_exact(rb) {
                let want = dot_dequant_row(DType::MXFP4, r, &x);
                assert_eq!(dot_row(DType::MXFP4, r, &x, &[]).to_bits(), want.to_bits());
            }
        }
    }

    /// The AVX2 bf16 dot gives the scalar loop's bits (the same lanes, operations and order), at
    /// lengths with and without a tail past whole 16-element chunks.
    #[test]
    fn bf16_dot_with_avx2_is_the_scalar_dot_bit_for_bit() {
        for cols in [16, 64, 2880, 2893, 7] {
            let w = rand_weights(DType::BF16, 3, cols, 11);
            let x = rand_vec(cols, 5);
            for r in w.chunks_exact(2 * cols) {
                let scalar = dot_16bit_row_scalar(r, &x, true);
                assert_eq!(
                    dot_16bit_row(r, &x, true).to_bits(),
                    scalar.to_bits(),
                    "{cols}"
                );
            }
        }
    }

    /// FP8: every token's input quantized per token to e4m3, the row's scale applied after the
    /// dot; one token alone (the table dot) and three at once (rows dequantised once) give the
    /// same bits, and both the products of the stated formula (summed in f64: within f32 rounding).
    /// Column counts past whole 16-element chunks (the tail) and a static input scale included.
    #[test]
    fn fp8_products_quantize_inputs_and_scale_rows() {
        use crate::cpu::mat::Fp8Ref;
        use metrale_core::fp8::{e4m3_to_f32, quantize_activations};
        let rows = 21;
        for (cols, input_scale) in [(96, None), (75, None), (96, Some(0.004f32))] {
            let w = rand_weights(DType::F8_E4M3, rows, cols, 3);
            let scales: Vec<f32> = (0..rows).map(|r| 0.01 + r as f32 * 1e-3).collect();
            let x: Vec<f32> = rand_vec(cols * 3, 9).iter().map(|v| v * 1.7).collect();
            let m = MatRef {
                dtype: DType::F8_E4M3,
                rows,
                cols,
                data: &w,
                packed: false,
                fp8: Some(Fp8Ref {
                    scales: &scales,
                    input_scale,
                    ub: None,
                }),
            };
            let mut many = vec![0f32; rows * 3];
            matmul(m, &x, 3, &mut many);
            let mut xq = x.clone();
            quantize_activations(&mut xq, cols, input_scale, None);
            assert_ne!(xq, x, "the inputs are quantized");
            for t in 0..3 {
                let mut one = vec![0f32; rows];
                matvec(m, &x[t * cols..(t + 1) * cols], &mut one);
                for r in 0..rows {
                    assert_eq!(
                        one[r].to_bits(),
                        many[t * rows + r].to_bits(),
                        "{cols} {t} {r}"
                    );
                    let want: f64 = (0..cols)
                        .map(|c| e4m3_to_f32(w[r * cols + c]) as f64 * xq[t * cols + c] as f64)
                        .sum::<f64>()
                        * scales[r] as f64;
                    let mag: f64 = (0..cols)
                        .map(|c| (e4m3_to_f32(w[r * cols + c]) * xq[t * cols + c]).abs() as f64)
                        .sum::<f64>()
                        * scales[r] as f64;
                    assert!(
                        (one[r] as f64 - want).abs() <= 1e-6 * mag + 1e-30,
                        "{cols} {t} {r}: {} vs {want}",
                        one[r]
                    );
                }
            }
        }
    }

    #[test]
    fn fused_dots_match_dequantize_then_dot() {
        let rows = 37;
        for (k, dt) in DType::ALL.into_iter().enumerate() {
            // whole blocks: two K-quant super-blocks, three 32-element blocks
            let cols = if dt.block_elems() == 256 { 512 } else { 96 };
            let w = rand_weights(dt, rows, cols, 11 + k as u64);
            let x = rand_vec(cols * 3, 5);
            let m = MatRef {
                dtype: dt,
                rows,
                cols,
                data: &w,
                packed: false,
                fp8: None,
            };
            let mut got = vec![0f32; rows * 3];
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .unwrap();
            pool.install(|| matmul(m, &x, 3, &mut got));
            let rb = dt.row_bytes(cols).unwrap();
            for t in 0..3 {
                let mut single = vec![0f32; rows];
                matvec(m, &x[t * cols..(t + 1) * cols], &mut single);
                for r in 0..rows {
                    let mut deq = vec![0f32; cols];
                    dequantize_row(dt, &w[r * rb..(r + 1) * rb], &mut deq).unwrap();
                    let want: f64 = deq
                        .iter()
                        .zip(&x[t * cols..])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    let g = got[t * rows + r];
                    assert!(
                        (g as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{dt} r{r} t{t}: {g} vs {want}"
                    );
                    assert_eq!(g.to_bits(), single[r].to_bits(), "matmul and matvec differ");
                }
            }
        }
    }

    #[test]
    fn rmsnorm_swiglu_softmax_by_hand() {
        let mut o = [0f32; 2];
        rmsnorm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut o);
        let s = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / s).abs() < 1e-6 && (o[1] - 8.0 / s).abs() < 1e-6);
        swiglu(&[0.0, 1.0], &[5.0, 2.0], &mut o);
        assert_eq!(o[0], 0.0);
        assert!((o[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        let mut p = [1.0f32, 1.0, 1.0f32 + 2f32.ln()];
        softmax_inplace(&mut p);
        assert!((p[0] - 0.25).abs() < 1e-6 && (p[2] - 0.5).abs() < 1e-6);
    }

    /// The chunked block attention against the plain per-head one, for contexts of one chunk and
    /// of several (the last one partial), tokens of one block at different positions.
    #[test]
    fn attention_block_matches_attention_head() {
        // 16-dimensional heads take the portable kernel, 64-dimensional ones the AVX2 one
        for hd in [16, 64] {
            attention_block_matches_attention_head_at(hd);
        }
    }

    fn attention_block_matches_attention_head_at(hd: usize) {
        let (n_heads, n_kv) = (6, 2);
        for (n_pos, pos) in [
            (9usize, vec![8usize, 2, 5]),
            (300, vec![299, 130, 5, 127, 128]),
        ] {
            let k = rand_vec(n_pos * n_kv * hd, 12);
            let v = rand_vec(n_pos * n_kv * hd, 13);
            let qv: Vec<Vec<f32>> = (0..pos.len())
                .map(|i| rand_vec(n_heads * hd, 20 + i as u64))
                .collect();
            let qs: Vec<&[f32]> = qv.iter().map(|x| x.as_slice()).collect();
            let mut scratch = (Vec::new(), Vec::new());
            for g in 0..n_kv {
                let mut bufs = vec![vec![0f32; 3 * hd]; pos.len()];
                let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
                attention_block(
                    &qs,
                    &pos,
                    &k,
                    &v,
                    g,
                    n_heads,
                    n_kv,
                    (hd, 0.25, usize::MAX),
                    None,
                    &mut scratch,
                    &mut outs,
                );
                for (i, &p) in pos.iter().enumerate() {
                    for hh in 0..3 {
                        let mut want = vec![0f32; hd];
                        let mut sc = Vec::new();
                        attention_head(
                            &qv[i],
                            &k,
                            &v,
                            p + 1,
                            g * 3 + hh,
                            n_heads,
                            n_kv,
                            hd,
                            0.25,
                            &mut sc,
                            &mut want,
                        );
                        for j in 0..hd {
                            let got = bufs[i][hh * hd + j];
                            assert!(
                                (got - want[j]).abs() < 2e-6 * (1.0 + want[j].abs()),
                                "{n_pos} positions, g{g} token{i} head{hh}: {got} vs {}",
                                want[j]
                            );
                        }
                    }
                }
            }
        }
    }

    /// A token's attention is the same bits whether its chunks are computed in one call, split
    /// into ranges (as a decode is over threads), or as part of a block with other tokens.
    #[test]
    fn attention_chunks_split_or_not_give_the_same_bits() {
        for hd in [16, 64] {
            attention_chunks_split_or_not_at(hd);
        }
    }

    fn attention_chunks_split_or_not_at(hd: usize) {
        let (n_heads, n_kv, n_pos) = (6, 2, 700);
        let k = rand_vec(n_pos * n_kv * hd, 31);
        let v = rand_vec(n_pos * n_kv * hd, 32);
        let qv = rand_vec(n_heads * hd, 33);
        let other = rand_vec(n_heads * hd, 34);
        let pos = 650usize;
        let nc = (pos + 1).div_ceil(ATT_CHUNK);
        let pl = partial_len(hd);
        let kv = KvHead {
            k: &k,
            v: &v,
            kv_dim: n_kv * hd,
            g: 1,
            head_dim: hd,
            window: usize::MAX,
        };
        let mut whole = vec![0f32; nc * 3 * pl];
        let mut sc = Vec::new();
        attention_partials(&[&qv], &[pos], kv, 3, 0.25, (0, nc), &mut sc, &mut whole);
        let mut pieces = vec![0f32; nc * 3 * pl];
        let (a, b) = pieces.split_at_mut(2 * 3 * pl);
        attention_partials(&[&qv], &[pos], kv, 3, 0.25, (0, 2), &mut sc, a);
        attention_partials(&[&qv], &[pos], kv, 3, 0.25, (2, nc), &mut sc, b);
        assert_eq!(whole, pieces);
        // in a block after another token, through attention_block's own combination
        let mut scratch = (Vec::new(), Vec::new());
        let mut bufs = vec![vec![0f32; 3 * hd]; 2];
        let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        attention_block(
            &[&other, &qv],
            &[100, pos],
            &k,
            &v,
            1,
            n_heads,
            n_kv,
            (hd, 0.25, usize::MAX),
            None,
            &mut scratch,
            &mut outs,
        );
        for hh in 0..3 {
            let mut alone = vec![0f32; hd];
            attention_combine(&pieces[hh * pl..], 3 * pl, nc, None, &mut alone);
            assert_eq!(alone, bufs[1][hh * hd..(hh + 1) * hd]);
        }
    }

    /// A sliding window: each query attends to its last `w` positions only, the same numbers as
    /// whole-context attention over those positions alone (windows inside one chunk, across
    /// chunks, and wider than the context).
    #[test]
    fn sliding_window_attends_to_the_last_positions_only() {
        let (n_heads, n_kv, hd, n_pos) = (6, 2, 64, 400);
        let k = rand_vec(n_pos * n_kv * hd, 41);
        let v = rand_vec(n_pos * n_kv * hd, 42);
        let kvd = n_kv * hd;
        for (w, pos) in [
            (16usize, vec![399usize, 200, 10]),
            (300, vec![399, 250]),
            (1000, vec![399]),
        ] {
            let qv: Vec<Vec<f32>> = (0..pos.len())
                .map(|i| rand_vec(n_heads * hd, 50 + i as u64))
                .collect();
            let qs: Vec<&[f32]> = qv.iter().map(|x| x.as_slice()).collect();
            let mut scratch = (Vec::new(), Vec::new());
            let mut bufs = vec![vec![0f32; 3 * hd]; pos.len()];
            let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            attention_block(
                &qs,
                &pos,
                &k,
                &v,
                1,
                n_heads,
                n_kv,
                (hd, 0.25, w),
                None,
                &mut scratch,
                &mut outs,
            );
            for (i, &p) in pos.iter().enumerate() {
                let lo = (p + 1).saturating_sub(w);
                for hh in 0..3 {
                    let mut want = vec![0f32; hd];
                    attention_head(
                        &qv[i],
                        &k[lo * kvd..(p + 1) * kvd],
                        &v[lo * kvd..(p + 1) * kvd],
                        p + 1 - lo,
                        3 + hh,
                        n_heads,
                        n_kv,
                        hd,
                        0.25,
                        &mut Vec::new(),
                        &mut want,
                    );
                    let got = &bufs[i][hh * hd..(hh + 1) * hd];
                    let err = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(err < 1e-5, "window {w}, position {p}, head {hh}: {err}");
                }
            }
        }
    }

    #[test]
    fn attention_matches_naive_gqa() {
        let (n_heads, n_kv, hd, n_ctx) = (4, 2, 8, 5);
        let q = rand_vec(n_heads * hd, 1);
        let k = rand_vec(n_ctx * n_kv * hd, 2);
        let v = rand_vec(n_ctx * n_kv * hd, 3);
        let mut out = vec![0f32; n_heads * hd];
        let mut sc = Vec::new();
        attention(&q, &k, &v, n_ctx, n_heads, n_kv, hd, 0.5, &mut sc, &mut out);
        for h in 0..n_heads {
            let g = h / 2;
            let s: Vec<f64> = (0..n_ctx)
                .map(|p| {
                    (0..hd)
                        .map(|i| q[h * hd + i] as f64 * k[p * n_kv * hd + g * hd + i] as f64)
                        .sum::<f64>()
                        * 0.5
                })
                .collect();
            let m = s.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for i in 0..hd {
                let want: f64 = (0..n_ctx)
                    .map(|p| (s[p] - m).exp() / z * v[p * n_kv * hd + g * hd + i] as f64)
                    .sum();
                assert!((out[h * hd + i] as f64 - want).abs() < 1e-5);
            }
        }
    }
}
