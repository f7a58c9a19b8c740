//! Sampling: the parameters of one request and the host reference sampler every backend must match.
//!
//! The pipeline, in order, on a copy of one logits row (`sample`):
//! 0. **logit bias** (OpenAI `logit_bias`): `l += bias` for each (id, bias) of the request, before
//!    everything else (vLLM applies it as the first logits processor).
//! 1. **logprobs** of the sampled token and `top_logprobs` are taken from the biased logits before
//!    any penalty (log-softmax of the raw row when there is no bias), as OpenAI and vLLM report them.
//! 2. **repetition penalty** (llama.cpp / HF semantics): every distinct token of `history` (prompt and
//!    generated) gets `l / p` when `l > 0`, else `l * p`.
//! 3. **presence / frequency penalties** (OpenAI semantics), over the *generated* tokens only:
//!    `l -= presence * [count > 0] + frequency * count`.
//! 4. `temperature == 0` -> greedy: the arg-max of the penalised row (lowest id wins ties).
//! 5. otherwise `l / temperature`, softmax, then the filters: top-k (keep the k most likely), top-p
//!    (keep the smallest prefix of the sorted candidates whose mass reaches `top_p`), min-p (keep
//!    tokens with `p >= min_p * p_max`). Tokens less likely than `exp(-30)` times the most likely one
//!    are never candidates (this only bounds the sort; their total mass is below 1e-8).
//! 6. one uniform number `u = uniform(seed, draw)` picks the token by walking the cumulative mass of
//!    the kept candidates in order (probability descending, id ascending) until it exceeds
//!    `u * kept_mass` (accumulated in f64).
//!
//! 7. **speculative verification** ([`verify`]) of a proposed token `d` at one position runs steps
//!    0-5 on that position's row; greedy: `d` is accepted when it is the arg-max. Otherwise with
//!    the kept candidates' probabilities `p`, `d` is accepted when `uniform(seed ^ ACCEPT_KEY,
//!    draw) < p(d)` (rejection sampling with a deterministic proposer, Leviathan et al. 2023 and
//!    Chen et al. 2023: the proposal's probability is 1); on rejection the token is drawn by step 6
//!    from the candidates without `d`. Either way the token is distributed as `p`: `d` comes out
//!    with probability `p(d)`, any other `x` with `(1 - p(d)) p(x) / (1 - p(d))`. Any proposer
//!    (prompt lookup, a draft model's greedy choice) fits, since none needs its own distribution.
//!
//! Randomness is counter-based so any backend (a GPU included) reproduces it without state:
//! `uniform(seed, draw)` is the `(draw+1)`-th output of SplitMix64 seeded with `seed`, i.e.
//! `z = seed + (draw + 1) * 0x9E3779B97F4A7C15` (wrapping), `z = (z ^ z>>30) * 0xBF58476D1CE4E5B9`,
//! `z = (z ^ z>>27) * 0x94D049BB133111EB`, `z ^= z>>31`, `u = (z >> 11) * 2^-53` in [0, 1).
//!
//! Invariants: `sample` never panics on any finite or non-finite row of length >= 1; the same
//! (logits, params, history, draw) always gives the same token.

/// How to choose the next token. Defaults are "no effect" values; `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,            // 0 = off
    pub top_p: f32,              // 1.0 = off
    pub min_p: f32,              // 0.0 = off
    pub repetition_penalty: f32, // 1.0 = off (llama.cpp / HF semantics)
    pub presence_penalty: f32,   // 0.0 = off (OpenAI semantics)
    pub frequency_penalty: f32,  // 0.0 = off (OpenAI semantics)
    pub seed: u64,
    /// How many top logprobs to return per token (0 = none).
    pub top_logprobs: usize,
    /// (token id, bias) added to the logits before anything else; sorted by id, ids unique, empty =
    /// off. Ids outside the row are ignored.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            top_logprobs: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// True when the choice is the arg-max of the (penalised) logits (temperature 0, negative or NaN).
    pub fn is_greedy(&self) -> bool {
        self.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
    }
}

/// The sampler's answer for one row.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log-softmax of `token` under the logits plus the logit bias (no penalties).
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens under the logits plus the logit bias, best first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// SplitMix64 finaliser applied to `seed + (draw + 1) * golden`: the counter-based uniform in [0, 1)
/// used for draw number `draw` of a sequence with `seed` (see the module docs for the exact function).
pub fn uniform(seed: u64, draw: u64) -> f64 {
    let mut z = seed.wrapping_add(draw.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Index of the largest value; the lowest index wins ties; NaNs are never chosen unless all are NaN.
pub fn argmax(row: &[f32]) -> usize {
    let max = max_non_nan(row);
    // the first entry equal to the max (none when every entry is NaN: 0)
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the feature was just detected.
        match unsafe { first_equal_avx2(row, max) } {
            Ok(found) => return found,
            Err(scanned) => i = scanned,
        }
    }
    row[i..].iter().position(|&v| v == max).map_or(0, |p| i + p)
}

/// The largest non-NaN entry (-inf when there is none).
fn max_non_nan(row: &[f32]) -> f32 {
    let mut i = 0;
    let mut m = f32::NEG_INFINITY;
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the feature was just detected.
        (m, i) = unsafe { max_avx2(row) };
    }
    row[i..]
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(m, f32::max)
}

/// (max of the non-NaN entries of the first `row.len() / 8 * 8`, that count).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_avx2(row: &[f32]) -> (f32, usize) {
    use std::arch::x86_64::*;
    let n = row.len() / 8 * 8;
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut m = ninf;
    for i in (0..n).step_by(8) {
        let v = _mm256_loadu_ps(row.as_ptr().add(i));
        // NaN lanes become -inf: max_ps returns its second operand when either is NaN
        m = _mm256_max_ps(
            m,
            _mm256_blendv_ps(ninf, v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v)),
        );
    }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), m);
    (out.iter().copied().fold(f32::NEG_INFINITY, f32::max), n)
}

/// The first index among the first `row.len() / 8 * 8` whose entry equals `max` (`Ok`), else
/// `Err(that count)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn first_equal_avx2(row: &[f32], max: f32) -> Result<usize, usize> {
    use std::arch::x86_64::*;
    let n = row.len() / 8 * 8;
    let vm = _mm256_set1_ps(max);
    for i in (0..n).step_by(8) {
        let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(row.as_ptr().add(i)), vm);
        let bits = _mm256_movemask_ps(eq);
        if bits != 0 {
            return Ok(i + bits.trailing_zeros() as usize);
        }
    }
    Err(n)
}

/// `log(sum(exp(row)))`, computed stably; NaNs are skipped.
pub fn log_sum_exp(row: &[f32]) -> f32 {
    let max = max_non_nan(row);
    if !max.is_finite() {
        return max;
    }
    // f32 exponentials, summed in 8 f64 lanes (the sum of up to ~1e5 terms in [0, 1]).
    let mut lanes = [0f64; 8];
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        done = unsafe { exp_sum_avx2(row, max, &mut lanes) };
    }
    for (i, &v) in row.iter().enumerate().skip(done) {
        if !v.is_nan() {
            lanes[i % 8] += (v - max).exp() as f64;
        }
    }
    max + (lanes.iter().sum::<f64>()).ln() as f32
}

/// `lanes[i % 8] += exp(row[i] - max)` for the first `row.len() / 8 * 8` entries (returned), NaNs
/// skipped, with a vectorised f32 exponential (`crate::numerics`' polynomial after a Cody-Waite
/// reduction: within 1 ulp of libm's `expf` on [-87, 0], checked at 235,000 points; x <= 0 is the only range used). Over the 49,152
/// logits of a decode step this is ~10x faster than the scalar loop, which cost ~0.3 ms per token on
/// the CPU backend.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2(row: &[f32], max: f32, lanes: &mut [f64; 8]) -> usize {
    use std::arch::x86_64::*;
    let n = row.len() / 8 * 8;
    let vmax = _mm256_set1_ps(max);
    let log2e = _mm256_set1_ps(std::f32::consts::LOG2_E);
    use crate::numerics::{EXP_LN2_HI, EXP_LN2_LO, EXP_MIN, EXP_POLY as c};
    let ln2_hi = _mm256_set1_ps(EXP_LN2_HI);
    let ln2_lo = _mm256_set1_ps(EXP_LN2_LO);
    let lo_clamp = _mm256_set1_ps(EXP_MIN);
    let one = _mm256_set1_ps(1.0);
    let (mut acc_lo, mut acc_hi) = (
        _mm256_loadu_pd(lanes.as_ptr()),
        _mm256_loadu_pd(lanes.as_ptr().add(4)),
    );
    for i in (0..n).step_by(8) {
        let v = _mm256_loadu_ps(row.as_ptr().add(i));
        let ok = _mm256_cmp_ps::<_CMP_ORD_Q>(v, v); // not NaN
        let x = _mm256_sub_ps(v, vmax);
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo_clamp); // exp underflows (or -inf): 0
        let x = _mm256_max_ps(x, lo_clamp);
        let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, log2e),
        );
        let r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, x));
        let mut p = _mm256_set1_ps(c[0]);
        for &ci in &c[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ci));
        }
        let r2 = _mm256_mul_ps(r, r);
        let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), one);
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(k),
            _mm256_set1_epi32(127),
        )));
        let e = _mm256_mul_ps(e, scale);
        let e = _mm256_and_ps(_mm256_andnot_ps(tiny, e), ok);
        acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
    }
    _mm256_storeu_pd(lanes.as_mut_ptr(), acc_lo);
    _mm256_storeu_pd(lanes.as_mut_ptr().add(4), acc_hi);
    n
}

/// The `n` largest entries of `row` as (id, value), value descending, id ascending on ties.
pub fn top_n(row: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(row.len());
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..row.len() as u32)
        .filter(|&i| !row[i as usize].is_nan())
        .collect();
    let cmp = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if idx.len() > n {
        idx.select_nth_unstable_by(n - 1, cmp);
        idx.truncate(n);
    }
    idx.sort_unstable_by(cmp);
    idx.into_iter().map(|i| (i, row[i as usize])).collect()
}

/// Add each (id, bias) of `bias` to `logits[id]`, in place. Ids outside the row are ignored.
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += b;
        }
    }
}

/// Apply the repetition penalty over `history` and presence/frequency penalties over its last
/// `n_generated` entries (the generated tokens), in place. Ids outside the row are ignored.
pub fn apply_penalties(
    logits: &mut [f32],
    params: &SamplingParams,
    history: &[u32],
    n_generated: usize,
) {
    let rep = params.repetition_penalty;
    if rep != 1.0 && rep > 0.0 {
        let mut seen = std::collections::HashSet::with_capacity(history.len());
        for &t in history {
            if let Some(l) = logits.get_mut(t as usize) {
                if seen.insert(t) {
                    *l = if *l > 0.0 { *l / rep } else { *l * rep };
                }
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let gen = &history[history.len().saturating_sub(n_generated)..];
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in gen {
            *counts.entry(t).or_insert(0) += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * c as f32;
            }
        }
    }
}

/// The kept candidates after temperature and the top-k / top-p / min-p filters, as (id, weight)
/// in sampling order (weight descending, id ascending); weights are unnormalised probabilities.
pub fn candidates(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    let t = params.temperature as f64;
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        // Degenerate row (all -inf/NaN, or +inf present): fall back to the arg-max.
        return vec![(argmax(logits) as u32, 1.0)];
    }
    let floor = max - 30.0 * t;
    let mut c: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, &l)| !l.is_nan() && (l as f64) >= floor)
        .map(|(i, &l)| (i as u32, ((l as f64 - max) / t).exp()))
        .collect();
    let cmp = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if params.top_k > 0 && c.len() > params.top_k {
        c.select_nth_unstable_by(params.top_k - 1, cmp);
        c.truncate(params.top_k);
    }
    c.sort_unstable_by(cmp);
    if params.top_p < 1.0 {
        let total: f64 = c.iter().map(|x| x.1).sum();
        let target = params.top_p.max(0.0) as f64 * total;
        let mut acc = 0.0;
        let mut keep = c.len();
        for (i, x) in c.iter().enumerate() {
            acc += x.1;
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
        c.truncate(keep.max(1));
    }
    if params.min_p > 0.0 {
        let pmax = c[0].1; // c is sorted and never empty here
        let thr = params.min_p as f64 * pmax;
        let keep = c.iter().take_while(|x| x.1 >= thr).count();
        c.truncate(keep.max(1));
    }
    c
}

/// Set the logits of the tokens `allowed` does not hold to -inf (bit `t % 32` of word `t / 32`;
/// tokens past the mask's end are disallowed): a grammar's constraint on the next token, applied
/// before any sampling setting, so every setting samples among the allowed tokens only.
pub fn apply_mask(logits: &mut [f32], allowed: &[u32]) {
    for (t, l) in logits.iter_mut().enumerate() {
        let ok = allowed.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
        if !ok {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Sample one token from `logits` (see the module docs for the pipeline). `history` is every token of
/// the sequence so far (prompt and generated); its last `draw` entries are the generated ones, and
/// `draw` is the index of this draw in the sequence.
pub fn sample(logits: &[f32], params: &SamplingParams, history: &[u32], draw: u64) -> Sampled {
    choose(logits, params, history, draw, None)
}

/// The key XORed into the seed for the acceptance draws of [`verify`], so they never reuse the
/// uniform numbers that pick tokens.
pub const ACCEPT_KEY: u64 = 0x5EC0_DE5A_A5A5_0001;

/// Sample at a position where `proposed` was proposed (module docs, step 7): the answer's token is
/// `proposed` when it is accepted, another token (distributed as `sample`'s, without `proposed`)
/// when not. Arguments as [`sample`]'s.
pub fn verify(
    logits: &[f32],
    params: &SamplingParams,
    history: &[u32],
    draw: u64,
    proposed: u32,
) -> Sampled {
    choose(logits, params, history, draw, Some(proposed))
}

/// Verify the proposals of one sequence: `rows` holds the logits of the last `proposed.len() + 1`
/// positions (`[proposed.len() + 1][vocab]`), `history` every token up to and including the last
/// proposal, `draw` the draw index of the first position. Proposals are taken in order while
/// accepted; returns the accepted ones' samples and the sample that follows them (the
/// replacement of the first rejected proposal, or after all of them one more token).
pub fn verify_run(
    rows: &[f32],
    vocab: usize,
    params: &SamplingParams,
    history: &[u32],
    draw: u64,
    proposed: &[u32],
) -> (Vec<Sampled>, Sampled) {
    let k = proposed.len();
    let before = history.len() - k; // history length at the first position
    let mut accepted = Vec::with_capacity(k);
    for (i, (&d, row)) in proposed.iter().zip(rows.chunks_exact(vocab)).enumerate() {
        let r = verify(row, params, &history[..before + i], draw + i as u64, d);
        if r.token != d {
            return (accepted, r);
        }
        accepted.push(r);
    }
    let last = &rows[k * vocab..(k + 1) * vocab];
    (accepted, sample(last, params, history, draw + k as u64))
}

/// `sample`, or with `proposed` `verify`: steps 0-6 (7) of the module docs.
fn choose(
    logits: &[f32],
    params: &SamplingParams,
    history: &[u32],
    draw: u64,
    proposed: Option<u32>,
) -> Sampled {
    if logits.is_empty() {
        return Sampled {
            token: 0,
            logprob: 0.0,
            top_logprobs: Vec::new(),
        };
    }
    let mut biased;
    let logits: &[f32] = if params.logit_bias.is_empty() {
        logits
    } else {
        biased = logits.to_vec();
        apply_logit_bias(&mut biased, &params.logit_bias);
        &biased
    };
    let lse = log_sum_exp(logits);
    let top_logprobs = top_n(logits, params.top_logprobs)
        .into_iter()
        .map(|(i, l)| (i, l - lse))
        .collect();

    let needs_penalty = params.repetition_penalty != 1.0
        || params.presence_penalty != 0.0
        || params.frequency_penalty != 0.0;
    let mut owned;
    let row: &[f32] = if needs_penalty {
        owned = logits.to_vec();
        apply_penalties(
            &mut owned,
            params,
            history,
            draw.min(history.len() as u64) as usize,
        );
        &owned
    } else {
        logits
    };

    let token = if params.is_greedy() {
        argmax(row) as u32
    } else {
        let mut c = candidates(row, params);
        let mut total: f64 = c.iter().map(|x| x.1).sum();
        if let Some(d) = proposed {
            let p = c.iter().find(|x| x.0 == d).map_or(0.0, |x| x.1) / total;
            if uniform(params.seed ^ ACCEPT_KEY, draw) < p {
                return Sampled {
                    token: d,
                    logprob: logits[d as usize] - lse,
                    top_logprobs,
                };
            }
            // rejected: p(d) < 1, so another candidate is left
            c.retain(|x| x.0 != d);
            total = c.iter().map(|x| x.1).sum();
        }
        let target = uniform(params.seed, draw) * total;
        let mut acc = 0.0;
        let mut chosen = c[c.len() - 1].0;
        for &(id, w) in &c {
            acc += w;
            if acc > target {
                chosen = id;
                break;
            }
        }
        chosen
    };
    let logprob = logits[token as usize] - lse;
    Sampled {
        token,
        logprob,
        top_logprobs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            ..Default::default()
        }
    }

    /// The vectorised path against an f64 reference: logits spread like an LM head's (a wide range,
    /// values far below the max whose exponentials underflow), NaN and -inf entries skipped, and a
    /// length that leaves a scalar tail.
    #[test]
    fn log_sum_exp_matches_an_f64_reference() {
        let mut state = 7u64;
        let mut row: Vec<f32> = (0..49_155)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 60.0 - 40.0
            })
            .collect();
        row[3] = f32::NAN;
        row[10] = f32::NEG_INFINITY;
        row[20] = -500.0;
        row[49_154] = f32::NAN;
        let max = row
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .fold(f32::MIN, f32::max) as f64;
        let want = max
            + row
                .iter()
                .filter(|v| !v.is_nan())
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let got = log_sum_exp(&row) as f64;
        assert!(
            (got - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs(),
            "{got} vs {want}"
        );
        // every term exactly: one-hot rows (exp(0) = 1 in the vector lanes and the tail alike)
        for n in [1usize, 8, 9, 17] {
            let mut r = vec![-1e4f32; n];
            r[n - 1] = 2.0;
            assert_eq!(log_sum_exp(&r), 2.0);
        }
    }

    /// The vectorised arg-max against the plain definition (first strict maximum, NaNs never chosen):
    /// ties, NaNs, -inf, maxima in the vector part and in the scalar tail.
    #[test]
    fn argmax_matches_the_plain_definition() {
        fn plain(row: &[f32]) -> usize {
            let mut best: Option<(usize, f32)> = None;
            for (i, &v) in row.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                    best = Some((i, v));
                }
            }
            best.map_or(0, |b| b.0)
        }
        let mut state = 11u64;
        for n in [0usize, 1, 7, 8, 9, 33, 1000, 49_155] {
            for case in 0..6 {
                let mut row: Vec<f32> = (0..n)
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                        ((state >> 40) % 64) as f32 // many ties
                    })
                    .collect();
                match case {
                    1 => row.iter_mut().step_by(3).for_each(|v| *v = f32::NAN),
                    2 => row.iter_mut().for_each(|v| *v = f32::NAN),
                    3 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                    4 if n > 0 => row[n - 1] = 1e9, // the maximum in the tail
                    5 if n > 2 => {
                        row[0] = f32::NAN;
                        row[1] = f32::NEG_INFINITY;
                    }
                    _ => {}
                }
                assert_eq!(argmax(&row), plain(&row), "n {n} case {case}");
            }
        }
    }

    #[test]
    fn uniform_is_splitmix64() {
        // Reference values of SplitMix64 seeded with 0 (the published first outputs).
        let first = [
            0xE220A8397B1DCDAFu64,
            0x6E789E6AA1B965F4,
            0x06C45D188009454F,
        ];
        for (d, &want) in first.iter().enumerate() {
            let u = uniform(0, d as u64);
            assert_eq!(u, (want >> 11) as f64 / (1u64 << 53) as f64);
        }
        assert!((0..10_000)
            .map(|d| uniform(42, d))
            .all(|u| (0.0..1.0).contains(&u)));
    }

    #[test]
    fn greedy_is_argmax_with_logprobs_from_raw_logits() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let s = sample(
            &logits,
            &SamplingParams {
                top_logprobs: 2,
                ..Default::default()
            },
            &[],
            0,
        );
        assert_eq!(s.token, 1); // lowest id wins the tie
        let lse = (1f32.exp() + 2.0 * 3f32.exp() + 2f32.exp()).ln();
        assert!((s.logprob - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(s.top_logprobs.len(), 2);
        assert_eq!(s.top_logprobs[0].0, 1);
        assert_eq!(s.top_logprobs[1].0, 3);
    }

    #[test]
    fn deterministic_per_seed_and_draw() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 0.8,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<u32> = (0..50).map(|d| sample(&logits, &p, &[], d).token).collect();
        let b: Vec<u32> = (0..50).map(|d| sample(&logits, &p, &[], d).token).collect();
        assert_eq!(a, b);
        let p2 = SamplingParams { seed: 8, ..p };
        let c: Vec<u32> = (0..50)
            .map(|d| sample(&logits, &p2, &[], d).token)
            .collect();
        assert_ne!(a, c);
    }

    #[test]
    fn temperature_distribution_matches_softmax() {
        let logits = [0.0f32, 1.0, 2.0, -1.0];
        let t = 0.7f32;
        let p = SamplingParams {
            temperature: t,
            seed: 123,
            ..Default::default()
        };
        let n = 200_000;
        let mut counts = [0usize; 4];
        for d in 0..n {
            counts[sample(&logits, &p, &[], d).token as usize] += 1;
        }
        let w: Vec<f64> = logits.iter().map(|&l| ((l / t) as f64).exp()).collect();
        let z: f64 = w.iter().sum();
        for i in 0..4 {
            let want = w[i] / z;
            let got = counts[i] as f64 / n as f64;
            // 5 standard deviations of a binomial proportion.
            let sd = (want * (1.0 - want) / n as f64).sqrt();
            assert!(
                (got - want).abs() < 5.0 * sd + 1e-9,
                "token {i}: got {got}, want {want}"
            );
        }
    }

    #[test]
    fn top_k_keeps_k_most_likely() {
        let logits = [0.0f32, 5.0, 4.0, 3.0, 4.5];
        let p = SamplingParams {
            top_k: 2,
            ..params()
        };
        let c = candidates(&logits, &p);
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 4]);
        for d in 0..2000 {
            let t = sample(&logits, &p, &[], d).token;
            assert!(t == 1 || t == 4);
        }
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_mass() {
        // probabilities 0.5, 0.25, 0.125, 0.125
        let logits = [2f32.ln() * 2.0, 2f32.ln(), 0.0, 0.0];
        let ids = |tp: f32| {
            candidates(
                &logits,
                &SamplingParams {
                    top_p: tp,
                    ..params()
                },
            )
            .iter()
            .map(|x| x.0)
            .collect::<Vec<_>>()
        };
        assert_eq!(ids(0.5), vec![0]);
        assert_eq!(ids(0.6), vec![0, 1]);
        assert_eq!(ids(0.75), vec![0, 1]);
        assert_eq!(ids(0.8), vec![0, 1, 2]);
        assert_eq!(ids(0.0), vec![0]);
    }

    #[test]
    fn min_p_drops_tokens_below_fraction_of_max() {
        let logits = [0.0f32, (0.5f32).ln(), (0.09f32).ln(), (0.2f32).ln()];
        let c = candidates(
            &logits,
            &SamplingParams {
                min_p: 0.1,
                ..params()
            },
        );
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 3]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut l = vec![2.0f32, -2.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        apply_penalties(&mut l, &p, &[0, 1, 0, 99], 0);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
        // Greedy picks another token once the repeated one is penalised.
        let s = sample(&[2.0, -2.0, 1.5], &p, &[0], 0);
        assert_eq!(s.token, 2);
        assert!((s.logprob - (1.5 - log_sum_exp(&[2.0, -2.0, 1.5]))).abs() < 1e-6);
    }

    #[test]
    fn presence_and_frequency_count_generated_tokens_only() {
        let mut l = vec![0.0f32; 4];
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        // history: prompt [3, 3] then generated [1, 1, 2]
        apply_penalties(&mut l, &p, &[3, 3, 1, 1, 2], 3);
        assert_eq!(l, vec![0.0, -1.0, -0.75, 0.0]);
    }

    #[test]
    fn logit_bias_moves_the_argmax_and_the_logprobs() {
        // raw row: token 2 is the arg-max; +3 on token 0 and -2 on token 2 make token 0 the arg-max
        // of the biased row [4, 1, 0.5, -1].
        let logits = [1.0f32, 1.0, 2.5, -1.0];
        let p = SamplingParams {
            top_logprobs: 4,
            logit_bias: vec![(0, 3.0), (2, -2.0), (99, 50.0)], // id 99 is outside the row: ignored
            ..Default::default()
        };
        assert_eq!(sample(&logits, &SamplingParams::default(), &[], 0).token, 2);
        let s = sample(&logits, &p, &[], 0);
        assert_eq!(s.token, 0);
        // hand computation: log(e^4 + e^1 + e^0.5 + e^-1) = 4.0 + log(1 + e^-3 + e^-3.5 + e^-5)
        //                                                 = 4.0 + log(1.0867224...) = 4.083166
        let lse = 4.083_166_f32;
        let tol = 1e-5;
        assert!((s.logprob - (4.0 - lse)).abs() < tol, "{}", s.logprob);
        let want = [(0u32, 4.0f32), (1, 1.0), (2, 0.5), (3, -1.0)];
        assert_eq!(s.top_logprobs.len(), 4);
        for (&(id, lp), &(wid, wl)) in s.top_logprobs.iter().zip(&want) {
            assert_eq!(id, wid);
            assert!((lp - (wl - lse)).abs() < tol, "token {id}: {lp}");
        }
    }

    #[test]
    fn logit_bias_comes_before_penalties() {
        // repetition penalty 2 on token 0 (seen in history): biased 1 + 3 = 4, penalised to 2 < 2.5;
        // penalising first (1 / 2 + 3 = 3.5) would keep token 0 ahead.
        let p = SamplingParams {
            repetition_penalty: 2.0,
            logit_bias: vec![(0, 3.0)],
            ..Default::default()
        };
        let s = sample(&[1.0, 2.5], &p, &[0], 0);
        assert_eq!(s.token, 1);
        // the logprob is from the biased row, before the penalty
        assert!((s.logprob - (2.5 - log_sum_exp(&[4.0, 2.5]))).abs() < 1e-6);
    }

    #[test]
    fn empty_logit_bias_changes_nothing() {
        let logits: Vec<f32> = (0..64).map(|i| ((i * 29) % 13) as f32 * 0.4).collect();
        for temperature in [0.0, 0.9] {
            let p = SamplingParams {
                temperature,
                top_logprobs: 5,
                seed: 3,
                ..Default::default()
            };
            let zero = SamplingParams {
                logit_bias: vec![(5, 0.0)],
                ..p.clone()
            };
            for d in 0..200 {
                let want = sample(&logits, &p, &[], d);
                assert_eq!(sample(&logits, &p, &[], d), want);
                assert_eq!(sample(&logits, &zero, &[], d), want);
            }
        }
    }

    #[test]
    fn seeded_draws_with_a_bias_are_reproducible() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 0.8,
            seed: 7,
            logit_bias: vec![(3, 2.0), (40, -100.0), (41, 1.5)],
            ..Default::default()
        };
        let a: Vec<u32> = (0..100)
            .map(|d| sample(&logits, &p, &[], d).token)
            .collect();
        let b: Vec<u32> = (0..100)
            .map(|d| sample(&logits, &p, &[], d).token)
            .collect();
        assert_eq!(a, b);
        assert!(!a.contains(&40));
        let unbiased: Vec<u32> = (0..100)
            .map(|d| {
                sample(
                    &logits,
                    &SamplingParams {
                        logit_bias: Vec::new(),
                        ..p.clone()
                    },
                    &[],
                    d,
                )
                .token
            })
            .collect();
        assert_ne!(a, unbiased);
    }

    #[test]
    fn degenerate_rows_do_not_panic() {
        let p = params();
        assert_eq!(sample(&[f32::NAN, 1.0], &p, &[], 0).token, 1);
        let _ = sample(&[f32::NEG_INFINITY; 3], &p, &[], 0);
        let _ = sample(&[f32::INFINITY, 0.0], &p, &[], 0);
        let _ = sample(&[], &p, &[], 0);
        let _ = sample(
            &[1.0],
            &SamplingParams {
                top_k: 5,
                top_p: 0.0,
                min_p: 1.0,
                ..p
            },
            &[7, 7],
            3,
        );
    }

    #[test]
    fn verification_accepts_in_order_and_samples_after() {
        // three positions of a 4-token vocabulary
        let rows = [
            0.0, 3.0, 1.0, 0.0, // arg-max 1
            2.0, 0.0, 0.0, 1.0, // arg-max 0
            0.0, 0.0, 0.5, 0.0, // arg-max 2
        ];
        let g = SamplingParams::default();
        // greedy: accepted while equal to the arg-max, then the arg-max where they differ
        let (acc, next) = verify_run(&rows, 4, &g, &[9, 1, 0], 0, &[1, 0]);
        assert_eq!(acc.iter().map(|r| r.token).collect::<Vec<_>>(), [1, 0]);
        assert_eq!(next.token, 2);
        let (acc, next) = verify_run(&rows, 4, &g, &[9, 1, 3], 0, &[1, 3]);
        assert_eq!((acc.len(), next.token), (1, 0));
        let (acc, next) = verify_run(&rows, 4, &g, &[9, 2, 0], 0, &[2, 0]);
        assert_eq!((acc.len(), next.token), (0, 1));
        // the accepted tokens' logprobs are the plain sampler's
        assert_eq!(
            acc_logprob(&rows[..4], 1),
            sample(&rows[..4], &g, &[9], 0).logprob
        );
        // no proposals: the plain sampler, draw for draw
        let t = SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..params()
        };
        for d in 0..20 {
            let (acc, next) = verify_run(&rows[..4], 4, &t, &[9], d, &[]);
            assert!(acc.is_empty());
            assert_eq!(next, sample(&rows[..4], &t, &[9], d));
        }
        // verification is a function of its seed; a certain token is always accepted
        for seed in 0..200 {
            let t = SamplingParams { seed, ..t.clone() };
            let r = verify(&rows[..4], &t, &[9], 0, 0);
            let again = verify(&rows[..4], &t, &[9], 0, 0);
            assert_eq!(r, again);
            let sure = verify(&[0.0, 50.0, 0.0, 0.0], &t, &[9], 0, 1);
            assert_eq!(sure.token, 1);
        }
    }

    fn acc_logprob(row: &[f32], t: u32) -> f32 {
        verify(row, &SamplingParams::default(), &[9], 0, t).logprob
    }
}
