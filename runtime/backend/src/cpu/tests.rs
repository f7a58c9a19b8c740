//! Self-consistency of the CPU forward pass on a small random model: a prompt run as one prefill
//! chunk, as several chunks, token by token, and batched beside another sequence must give the same
//! logits (to f32 rounding: the sums are the same, only their grouping over tokens differs).
use super::*;
use crate::sampler::SamplingParams;

fn tiny(dtype: DType) -> CpuBackend {
    super::synthetic::tiny_backend(dtype, 0, 3, 32, 2)
}

fn run(b: &mut CpuBackend, slot: usize, start: usize, toks: &[u32], hist: &[u32]) -> Vec<f32> {
    let p = SamplingParams::default();
    let s = SeqStep {
        slot,
        start_pos: start,
        tokens: toks,
        blocks: &crate::slot_blocks(slot, 32),
        history: hist,
        sampling: &p,
        draw: 0,
        want_logits: true,
        allowed: None,
        drafted: 0,
    };
    b.step(&[s]).unwrap().pop().unwrap().logits.unwrap()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    let m = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(m <= tol, "max diff {m} > {tol}");
}

#[test]
fn prefill_chunks_decode_and_batching_agree() {
    for dt in [
        DType::Q4_1,
        DType::Q4_0,
        DType::Q8_0,
        DType::F16,
        DType::BF16,
        DType::F32,
    ] {
        let mut b = tiny(dt);
        let prompt: Vec<u32> = vec![1, 7, 3, 49, 20, 11, 5, 8, 30];
        let whole = run(&mut b, 0, 0, &prompt, &prompt);
        // three chunks in slot 1
        run(&mut b, 1, 0, &prompt[..4], &prompt[..4]);
        run(&mut b, 1, 4, &prompt[4..7], &prompt[..7]);
        let chunked = run(&mut b, 1, 7, &prompt[7..], &prompt);
        close(&whole, &chunked, 1e-4);
        // token by token in slot 2
        let mut last = Vec::new();
        for i in 0..prompt.len() {
            last = run(&mut b, 2, i, &prompt[i..i + 1], &prompt[..=i]);
        }
        close(&whole, &last, 1e-4);
        // batched: slot 0 decodes one more token while slot 1 prefills a fresh prompt
        let p = SamplingParams::default();
        let next = [4u32];
        let mut h0 = prompt.clone();
        h0.push(4);
        let other: Vec<u32> = vec![2, 2, 9];
        let out = b
            .step(&[
                SeqStep {
                    slot: 0,
                    start_pos: prompt.len(),
                    tokens: &next,
                    blocks: &crate::slot_blocks(0, 32),
                    history: &h0,
                    sampling: &p,
                    draw: 0,
                    want_logits: true,
                    allowed: None,
                    drafted: 0,
                },
                SeqStep {
                    slot: 1,
                    start_pos: 0,
                    tokens: &other,
                    blocks: &crate::slot_blocks(1, 32),
                    history: &other,
                    sampling: &p,
                    draw: 0,
                    want_logits: true,
                    allowed: None,
                    drafted: 0,
                },
            ])
            .unwrap();
        let alone0 = run(&mut b, 2, prompt.len(), &next, &h0);
        let alone1 = run(&mut b, 2, 0, &other, &other);
        close(out[0].logits.as_ref().unwrap(), &alone0, 1e-4);
        close(out[1].logits.as_ref().unwrap(), &alone1, 1e-4);
        assert_eq!(out[0].token as usize, ops::argmax(&alone0));
    }
}

#[test]
fn invalid_steps_are_refused() {
    let mut b = tiny(DType::Q4_1);
    let p = SamplingParams::default();
    let tables: Vec<Vec<u32>> = (0..4).map(|s| crate::slot_blocks(s, 32)).collect();
    let bad = |slot: usize, start, toks: &'static [u32]| SeqStep {
        slot,
        start_pos: start,
        tokens: toks,
        blocks: &tables[slot],
        history: toks,
        sampling: &p,
        draw: 0,
        want_logits: false,
        allowed: None,
        drafted: 0,
    };
    assert!(b.step(&[bad(3, 0, &[1])]).is_err());
    assert!(b.step(&[bad(0, 31, &[1, 2])]).is_err());
    assert!(b.step(&[bad(0, 0, &[50])]).is_err());
    assert!(b.step(&[bad(0, 0, &[])]).is_err());
    assert!(b.step(&[bad(0, 0, &[1]), bad(0, 1, &[1])]).is_err());
    assert!(b.step(&[bad(0, 31, &[1])]).is_ok());
}

#[test]
fn a_kv_cache_larger_than_memory_is_refused() {
    let b = CpuBackend::from_parts(
        Dims {
            layers: 1,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 96,
            vocab: 50,
        },
        1e-5,
        QTensor {
            dtype: DType::F32,
            rows: 50,
            cols: 64,
            data: vec![0; 50 * 64 * 4],
            packed: false,
            fp8: None,
        },
        None,
        vec![1.0; 64],
        Vec::new(),
        vec![1.0; 8],
        crate::KvConfig::per_slot(1 << 20, 1 << 20),
        1,
    );
    match b {
        Err(BackendError::OutOfMemory { needed, .. }) => assert!(needed > 1 << 40),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a 32 TiB cache was accepted"),
    }
}

/// Logits of `toks` at `start` for a sequence whose block table is `table`.
fn run_table(
    b: &mut CpuBackend,
    table: &[u32],
    start: usize,
    toks: &[u32],
    hist: &[u32],
) -> Vec<f32> {
    let p = SamplingParams::default();
    let s = SeqStep {
        slot: 0,
        start_pos: start,
        tokens: toks,
        blocks: table,
        history: hist,
        sampling: &p,
        draw: 0,
        want_logits: true,
        allowed: None,
        drafted: 0,
    };
    b.step(&[s]).unwrap().pop().unwrap().logits.unwrap()
}

/// A 40-token prompt (3 blocks) with blocks scattered over the pool gives the bits a contiguous
/// table gives; a second sequence whose table starts with the first one's two full blocks (a shared
/// prefix) and is prefilled only from position 32 gives the bits of computing it from scratch.
#[test]
fn paged_tables_scattered_and_shared_give_the_same_bits() {
    let kv = crate::KvConfig {
        slots: 2,
        slot_capacity: 64,
        blocks: 12,
        dtype: KvDtype::F32,
    };
    let mut b = super::synthetic::tiny_backend_kv(DType::Q4_1, 0, kv, 2);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 50).collect();
    let contiguous = run_table(&mut b, &[0, 1, 2], 0, &prompt, &prompt);
    let scattered = run_table(&mut b, &[9, 4, 11], 0, &prompt, &prompt);
    assert_eq!(contiguous, scattered);
    // shares blocks 9 and 4 (positions 0..32), its own block 6 for 32..40
    let mut other = prompt[..32].to_vec();
    other.extend([5u32, 6, 7, 8, 9, 10, 11, 12]);
    let shared = run_table(&mut b, &[9, 4, 6], 32, &other[32..], &other);
    let fresh = run_table(&mut b, &[7, 8, 10], 0, &other, &other);
    assert_eq!(shared, fresh);
}

/// A bf16 KV cache: the same logits as f32 up to the rounding of K and V (2^-9 relative), and
/// prefilled at once or token by token within the f32 cache's bound (1e-4: each K/V row is rounded
/// once, when written, so only the grouping of the sums differs).
#[test]
fn bf16_kv_cache_is_f32_up_to_rounding() {
    let r = against_f32_cache(KvDtype::Bf16);
    assert_eq!(r.bytes * 2, r.f32_bytes);
    assert_ne!(r.f32, r.whole, "bf16 rounding changes something");
    close(&r.f32, &r.whole, 2e-2);
    close(&r.whole, &r.token_by_token, 1e-4);
}

/// What the KV cache tests compare: the tiny model with an f32 cache and with one of `dtype`, a
/// 30-token prompt's logits with the f32 cache, with `dtype`'s prefilled at once, and with
/// `dtype`'s fed a token at a time (the last token's), and both caches' bytes.
struct KvRun {
    f32: Vec<f32>,
    whole: Vec<f32>,
    token_by_token: Vec<f32>,
    bytes: u64,
    f32_bytes: u64,
}

fn against_f32_cache(dtype: KvDtype) -> KvRun {
    let kv = |dtype| crate::KvConfig {
        slots: 2,
        slot_capacity: 64,
        blocks: 0,
        dtype,
    };
    let mut f = super::synthetic::tiny_backend_kv(DType::Q4_1, 0, kv(KvDtype::F32), 2);
    let mut h = super::synthetic::tiny_backend_kv(DType::Q4_1, 0, kv(dtype), 2);
    let prompt: Vec<u32> = (0..30).map(|i| (i * 11 + 1) % 50).collect();
    let f32 = run_table(&mut f, &[0, 1], 0, &prompt, &prompt);
    let whole = run_table(&mut h, &[0, 1], 0, &prompt, &prompt);
    let mut token_by_token = Vec::new();
    for i in 0..prompt.len() {
        token_by_token = run_table(&mut h, &[2, 3], i, &prompt[i..=i], &prompt[..=i]);
    }
    KvRun {
        f32,
        whole,
        token_by_token,
        bytes: h.info().kv_bytes,
        f32_bytes: f.info().kv_bytes,
    }
}

/// An fp8 KV cache (each head vector of a token e4m3 with its own scale): a quarter of f32's bytes
/// plus the scales (4 bytes a 16-element head here), logits within e4m3's rounding of K and V
/// (2^-4 relative at most per element; measured 0.061 on logits of this model, the bf16
/// cache 16x finer), and prefilled at once or token by token
/// within the f32 cache's bound (a row is quantized once, when written, from its own values only).
#[test]
fn fp8_kv_cache_is_f32_up_to_rounding() {
    let r = against_f32_cache(KvDtype::Fp8);
    assert_eq!(r.bytes * 16, r.f32_bytes * 5, "1 + 4/16 bytes an element");
    let worst = r
        .f32
        .iter()
        .zip(&r.whole)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("fp8 KV cache: max |logit - f32 cache's| {worst:.3e}");
    assert_ne!(r.f32, r.whole, "e4m3 rounding changes something");
    close(&r.f32, &r.whole, 0.15);
    close(&r.whole, &r.token_by_token, 1e-4);
}

/// `step_masked` (the default, as the CPU backend runs it): the lazy entries' masks are asked once
/// each, the others' never, and each lazy entry samples only what its mask allows.
#[test]
fn masks_asked_on_demand_constrain_only_their_entries() {
    struct Only(Vec<usize>, Vec<u32>);
    impl crate::MaskSource for Only {
        fn mask(&mut self, i: usize) -> Option<Vec<u32>> {
            self.0.push(i);
            let mut m = vec![0u32; 2];
            let t = self.1[i];
            m[t as usize / 32] |= 1 << (t % 32);
            Some(m)
        }
    }
    let mut b = tiny(DType::Q4_1);
    let hot = SamplingParams {
        temperature: 1.5,
        seed: 3,
        ..Default::default()
    };
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[4, 5], &[6]];
    let tables: Vec<Vec<u32>> = (0..3).map(|i| crate::slot_blocks(i, 32)).collect();
    let batch: Vec<SeqStep> = (0..3)
        .map(|i| SeqStep {
            slot: i,
            start_pos: 0,
            tokens: prompts[i],
            blocks: &tables[i],
            history: prompts[i],
            sampling: &hot,
            draw: 0,
            want_logits: false,
            allowed: None,
            drafted: 0,
        })
        .collect();
    let mut src = Only(Vec::new(), vec![0, 41, 7]);
    let out = b
        .step_masked(&batch, &[false, true, true], &mut src)
        .unwrap();
    assert_eq!(src.0, vec![1, 2], "asked for the lazy entries, once each");
    assert_eq!((out[1].token, out[2].token), (41, 7));
}

/// `Backend::hidden` on the forward pass `step` runs: the last token's final-normed hidden state is
/// the one whose LM head gives `step`'s logits; the sums over a prompt do not depend on how it is
/// chunked (f32 grouping only); each token's row is the one a prompt ending there gives as `last`;
/// the embedding has unit length and mean pooling differs from last.
#[test]
fn hidden_states_match_the_step_and_do_not_depend_on_chunks() {
    let toks: Vec<u32> = (0..11u32).map(|i| (i * 7 + 3) % 32).collect();
    let p = SamplingParams::default();
    let table = crate::slot_blocks(0, 32);
    let entry = |start: usize, n: usize| SeqStep {
        slot: 0,
        start_pos: start,
        tokens: &toks[start..start + n],
        blocks: &table,
        history: &toks[..start + n],
        sampling: &p,
        draw: 0,
        want_logits: false,
        allowed: None,
        drafted: 0,
    };
    let mut b = tiny(DType::Q4_1);
    let whole = b.hidden(&[entry(0, 11)]).unwrap().pop().unwrap();
    assert_eq!(whole.tokens, 11);
    // the LM head of `last` is what `step` samples from
    let logits = run(&mut b, 0, 0, &toks, &toks);
    close(&b.lm_head(&whole.last, 1), &logits, 1e-5);
    // three chunks pooled
    let mut chunked = HiddenSums::default();
    for (a, n) in [(0, 4), (4, 5), (9, 2)] {
        chunked.extend(b.hidden(&[entry(a, n)]).unwrap().pop().unwrap());
    }
    assert_eq!(chunked.tokens, 11);
    close(&chunked.sum, &whole.sum, 1e-4);
    close(&chunked.last, &whole.last, 1e-5);
    // the sum is of every token's row: prompts ending at each position give those rows as `last`
    let mut rows = vec![0f32; whole.sum.len()];
    for n in 1..=11 {
        let h = b.hidden(&[entry(0, n)]).unwrap().pop().unwrap();
        crate::cpu::ops::add_inplace(&mut rows, &h.last);
    }
    close(&rows, &whole.sum, 1e-4);
    for pool in [crate::Pooling::Mean, crate::Pooling::Last] {
        let e = whole.embedding(pool);
        let norm: f32 = e.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{pool:?}: norm {norm}");
    }
    let (m, l) = (
        whole.embedding(crate::Pooling::Mean),
        whole.embedding(crate::Pooling::Last),
    );
    assert!(m.iter().zip(&l).any(|(a, b)| (a - b).abs() > 1e-3));
    // two sequences in one call give what each gives alone
    let table1 = crate::slot_blocks(1, 32);
    let other = SeqStep {
        slot: 1,
        blocks: &table1,
        ..entry(0, 6)
    };
    let both = b.hidden(&[entry(0, 11), other]).unwrap();
    close(&both[0].sum, &whole.sum, 1e-4);
    let alone = b.hidden(&[other]).unwrap().pop().unwrap();
    close(&both[1].sum, &alone.sum, 1e-4);
}

/// The router's choice by hand: softmax, the top k with ties to the lower index, renormalised.
#[test]
fn route_takes_the_top_k_ties_to_the_lower_index() {
    // experts 1 and 3 tie for first, 0 and 2 for third
    let logits = [1.0f32, 3.0, 1.0, 3.0, -2.0];
    let z: f32 = logits.iter().map(|v| v.exp()).sum();
    let p = |v: f32| v.exp() / z;
    let r = route(&logits, 3, false);
    assert_eq!(r.iter().map(|&(e, _)| e).collect::<Vec<_>>(), [1, 3, 0]);
    for &(e, w) in &r {
        assert!((w - p(logits[e])).abs() < 1e-6, "expert {e}: {w}");
    }
    let rn = route(&logits, 3, true);
    let sum: f32 = rn.iter().map(|&(_, w)| w).sum();
    assert!((sum - 1.0).abs() < 1e-6);
    let want = p(3.0) / (2.0 * p(3.0) + p(1.0));
    assert!((rn[0].1 - want).abs() < 1e-6 && (rn[1].1 - want).abs() < 1e-6);
    // one expert of one: weight 1 renormalised
    assert_eq!(route(&[0.5], 1, true), [(0, 1.0)]);
}

/// The upper tail of the chi-square distribution with `df` degrees of freedom at `x`, by the
/// Wilson-Hilferty cube-root normal approximation (error below 1e-3 in p for df >= 10) and the
/// complementary error function of Abramowitz and Stegun 7.1.26 (error below 1.5e-7).
fn chi_square_p(x: f64, df: usize) -> f64 {
    let k = df as f64;
    let z = ((x / k).cbrt() - (1.0 - 2.0 / (9.0 * k))) / (2.0 / (9.0 * k)).sqrt();
    let erfc = |v: f64| {
        let t = 1.0 / (1.0 + 0.327_591_1 * v.abs());
        let poly = t
            * (0.254_829_592
                + t * (-0.284_496_736
                    + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
        let e = poly * (-v * v).exp();
        if v >= 0.0 {
            e
        } else {
            2.0 - e
        }
    };
    0.5 * erfc(z / std::f64::consts::SQRT_2)
}

/// Pearson's statistic of `counts` against probabilities `p` (cells expected below 5 pooled into
/// one) and its degrees of freedom.
fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let (mut x, mut cells, mut small_o, mut small_e) = (0.0, 0usize, 0.0, 0.0);
    for (&o, &q) in counts.iter().zip(p) {
        let e = q * n as f64;
        if e < 5.0 {
            (small_o, small_e) = (small_o + o as f64, small_e + e);
            continue;
        }
        x += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if small_e > 0.0 {
        x += (small_o - small_e).powi(2) / small_e.max(1e-12);
        cells += 1;
    }
    (x, cells - 1)
}

/// Rejection sampling keeps the distribution (the exactness bar for sampled output):
/// 100,000 verification steps of two proposals each on the tiny model, seeds 0..100,000. The
/// first generated token must be distributed as plain sampling's at that position (its kept
/// candidates' probabilities), and the second, where the first was the proposal, as plain
/// sampling's after it; a chi-square test of each with p > 0.01. The proposals are the
/// second most likely first token (accepted about as often as rejected) and the most likely token
/// after it; two settings: temperature alone, and with top-k and top-p.
#[test]
fn verification_samples_as_plain_sampling_does() {
    let mut b = super::synthetic::tiny_backend(DType::F16, 5, 1, 32, 2);
    let prompt: Vec<u32> = vec![4, 17, 29, 3, 11];
    let probs = |b: &mut CpuBackend, hist: &[u32], p: &SamplingParams| {
        let row = run(b, 0, 0, hist, hist);
        let c = crate::sampler::candidates(&row, p);
        let total: f64 = c.iter().map(|x| x.1).sum();
        let mut q = vec![0f64; row.len()];
        for (id, w) in c {
            q[id as usize] = w / total;
        }
        q
    };
    let order = |q: &[f64]| {
        let mut ids: Vec<usize> = (0..q.len()).collect();
        ids.sort_by(|&a, &b| q[b].total_cmp(&q[a]));
        ids
    };
    // temperatures from the spread of the first row's logits (the random model's are wide), so
    // that several tokens are likely
    let row = run(&mut b, 0, 0, &prompt, &prompt);
    let mut sorted = row.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let t = (sorted[0] - sorted[4]).max(1e-3);
    let settings = [
        SamplingParams {
            temperature: 0.5 * t,
            ..Default::default()
        },
        SamplingParams {
            temperature: t,
            top_k: 12,
            top_p: 0.9,
            ..Default::default()
        },
    ];
    let n = 100_000u64;
    for base in settings {
        let p0 = probs(&mut b, &prompt, &base);
        let d1 = order(&p0)[1] as u32;
        let mut h1 = prompt.clone();
        h1.push(d1);
        let p1 = probs(&mut b, &h1, &base);
        let d2 = order(&p1)[0] as u32;
        let mut hist = h1.clone();
        hist.push(d2);
        let table = crate::slot_blocks(0, 32);
        let (mut first, mut second) = (vec![0u64; 50], vec![0u64; 50]);
        for seed in 0..n {
            let params = SamplingParams {
                seed,
                ..base.clone()
            };
            let s = SeqStep {
                slot: 0,
                start_pos: prompt.len() - 1,
                tokens: &hist[prompt.len() - 1..],
                blocks: &table,
                history: &hist,
                sampling: &params,
                draw: 0,
                want_logits: false,
                allowed: None,
                drafted: 2,
            };
            let out = b.step(&[s]).unwrap().pop().unwrap();
            let mut gen = out.accepted.iter().map(|r| r.token).collect::<Vec<_>>();
            gen.push(out.token);
            first[gen[0] as usize] += 1;
            if gen[0] == d1 {
                second[gen[1] as usize] += 1;
            }
        }
        for (what, counts, p) in [("first", &first, &p0), ("second", &second, &p1)] {
            let (x, df) = chi_square(counts, p);
            let pv = chi_square_p(x, df);
            assert!(
                pv > 0.01,
                "{base:?}: the {what} token's counts are not distributed as plain sampling's: \
                 chi-square {x:.1} on {df} degrees of freedom, p = {pv:.2e}"
            );
        }
        // both branches were taken often, at both positions
        assert!(
            first[d1 as usize] > n / 20 && first[d1 as usize] < n * 19 / 20,
            "{first:?}"
        );
        let after = first[d1 as usize];
        assert!(
            second[d2 as usize] > after / 20 && second[d2 as usize] < after * 19 / 20,
            "{second:?}"
        );
    }
}

#[test]
fn chi_square_tail_matches_tabulated_values() {
    // 0.01 and 0.5 critical values of the chi-square distribution (standard tables)
    for (x, df, p) in [
        (23.209, 10, 0.01),
        (9.342, 10, 0.5),
        (37.566, 20, 0.01),
        (76.154, 50, 0.01),
    ] {
        let got = chi_square_p(x, df);
        assert!((got - p).abs() < 2e-3, "df {df} x {x}: {got} against {p}");
    }
}
