//! Rotary position embeddings, the one definition both backends rotate by: the inverse frequencies
//! of a model (RoPE scaling applied: llama3, linear, GGUF `rope_freqs`, LongRoPE, YaRN), the (cos, sin) factors of a
//! position, their application to adjacent pairs, and the position-major table the CUDA kernels read.
//!
//! Conventions: heads rotate *adjacent* pairs `(x[2i], x[2i+1])` by `pos * inv_freq[i]` (the GGUF /
//! llama.cpp "normal" rope; GGUF Q/K weights are permuted for it); angles are computed in f64 and
//! rounded to f32 once, so every backend rotates by the same f32 factors.

use metrale_core::BackendError;
use metrale_model::RopeScaling;

/// Llama 3 rope scaling ("rope_type": "llama3" in HF configs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

/// Inverse frequencies `inv_freq[i] = theta^(-2i/head_dim)` for `i < head_dim/2`, with Llama 3 scaling
/// applied when given, then divided by `freq_factors[i]` when given (GGUF `rope_freqs.weight`).
pub fn rope_inv_freq(
    head_dim: usize,
    theta: f32,
    scaling: Option<&Llama3RopeScaling>,
    freq_factors: Option<&[f32]>,
) -> Vec<f32> {
    let half = head_dim / 2;
    (0..half)
        .map(|i| {
            let mut f = (theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
            if let Some(s) = scaling {
                f = metrale_core::shape::llama3_scaled_freq(
                    f,
                    s.factor as f64,
                    s.low_freq_factor as f64,
                    s.high_freq_factor as f64,
                    s.original_max_position_embeddings as f64,
                );
            }
            if let Some(ff) = freq_factors {
                f /= ff[i] as f64;
            }
            f as f32
        })
        .collect()
}

/// Rotate each of the `x.len() / head_dim` heads of `x` in place for position `pos`: adjacent pairs
/// `(x[2i], x[2i+1])` by the angle `pos * inv_freq[i]` (angles computed in f64).
pub fn rope_inplace(x: &mut [f32], head_dim: usize, pos: usize, inv_freq: &[f32]) {
    rope_apply(x, head_dim, &rope_factors(head_dim, pos, inv_freq));
}

/// The (cos, sin) pairs of position `pos` that [`rope_apply`] rotates by: angle `pos * inv_freq[i]`
/// in f64, rounded to f32, for the first `head_dim / 2` pairs or as many as `inv_freq` has (a
/// partial rotary embedding rotates fewer). A forward pass computes them once per token for all
/// layers.
pub fn rope_factors(head_dim: usize, pos: usize, inv_freq: &[f32]) -> Vec<(f32, f32)> {
    (0..(head_dim / 2).min(inv_freq.len()))
        .map(|i| {
            let a = pos as f64 * inv_freq[i] as f64;
            (a.cos() as f32, a.sin() as f32)
        })
        .collect()
}

/// Rotate every head of `x` (`[heads * head_dim]`, pairs (2i, 2i + 1)) by the factors `cs` (the
/// first `cs.len()` pairs of each head; the dimensions past them pass through).
pub fn rope_apply(x: &mut [f32], head_dim: usize, cs: &[(f32, f32)]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in cs.iter().enumerate() {
            let (x0, x1) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = x0 * c - x1 * s;
            head[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}

/// The RoPE inverse frequencies of a model served with a context of `ctx` positions (the one
/// place every backend takes them from): [`rope_inv_freq`] over the rotated dimensions
/// (`rotary_dim`: `rotary_dim / 2` frequencies, theta^(-2i / rotary_dim)) with the config's scaling
/// applied (linear: divided by the factor; llama3: by wavelength; GGUF `rope_freqs.weight`:
/// divided per dimension, loaded by `rope_freqs` only then; LongRoPE: divided by its short
/// factors, or by its long ones where `ctx` passes the pretraining context, as llama.cpp picks
/// them by its context size).
pub fn model_inv_freq(
    c: &metrale_model::ModelConfig,
    ctx: usize,
    rope_freqs: impl FnOnce() -> Result<Vec<f32>, BackendError>,
) -> Result<Vec<f32>, BackendError> {
    let head_dim = c.rotary_dim;
    Ok(match &c.rope_scaling {
        None => rope_inv_freq(head_dim, c.rope_theta, None, None),
        Some(RopeScaling::Linear { factor }) => rope_inv_freq(head_dim, c.rope_theta, None, None)
            .into_iter()
            .map(|f| f / factor)
            .collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        }) => {
            let s = Llama3RopeScaling {
                factor: *factor,
                low_freq_factor: *low_freq_factor,
                high_freq_factor: *high_freq_factor,
                original_max_position_embeddings: *original_max_position as f32,
            };
            rope_inv_freq(head_dim, c.rope_theta, Some(&s), None)
        }
        Some(RopeScaling::FreqFactors) => {
            let ff = rope_freqs()?;
            rope_inv_freq(head_dim, c.rope_theta, None, Some(&ff))
        }
        Some(RopeScaling::LongRope {
            short,
            long,
            original_max_position,
            ..
        }) => {
            let ff = if ctx > *original_max_position {
                long
            } else {
                short
            };
            rope_inv_freq(head_dim, c.rope_theta, None, Some(ff))
        }
        Some(RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            truncate,
            ..
        }) => yarn_inv_freq(
            head_dim,
            c.rope_theta as f64,
            *factor as f64,
            *original_max_position as f64,
            (*beta_fast as f64, *beta_slow as f64),
            *truncate,
        ),
    })
}

/// YaRN's inverse frequencies over `dim` rotated dimensions (HF `_compute_yarn_parameters`; with
/// `truncate`, llama.cpp's `ggml_rope_yarn_corr_dims` too): pair i's frequency is
/// `theta^(-2i/dim)` blended toward that divided by `factor` by a ramp that is 0 up to the pair
/// turning `beta_fast` times in `original` positions and 1 from the one turning `beta_slow` times.
fn yarn_inv_freq(
    dim: usize,
    theta: f64,
    factor: f64,
    original: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Vec<f32> {
    let corr = |rot: f64| {
        dim as f64 * (original / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    (0..dim / 2)
        .map(|i| {
            let extrapolated = theta.powf(-2.0 * i as f64 / dim as f64);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            (extrapolated / factor * ramp + extrapolated * (1.0 - ramp)) as f32
        })
        .collect()
}

/// The factor on a model's rotation's cos and sin (so on the rotated dimensions of Q and K):
/// LongRoPE's or YaRN's attention factor, 1 otherwise. HF scales cos and sin the same way.
pub fn model_rope_scale(c: &metrale_model::ModelConfig) -> f32 {
    match &c.rope_scaling {
        Some(RopeScaling::LongRope {
            attention_factor, ..
        })
        | Some(RopeScaling::Yarn {
            attention_factor, ..
        }) => *attention_factor,
        _ => 1.0,
    }
}

/// The RoPE table the CUDA kernels read: `(cos, sin)` of `pos * inv_freq[i]` for `pos < n_pos`,
/// `i < inv_freq.len()`, row-major by position: [`rope_factors`] of every position, so both
/// backends rotate by identical factors.
pub fn rope_table(inv_freq: &[f32], n_pos: usize) -> Vec<[f32; 2]> {
    (0..n_pos)
        .flat_map(|p| rope_factors(2 * inv_freq.len(), p, inv_freq))
        .map(|(c, s)| [c, s])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss's RoPE (head dim 64, theta 150,000, YaRN factor 32 over 4,096 positions, beta 32
    /// and 1) against transformers 5.25's `_compute_yarn_parameters` (f32 there, so within 1e-6
    /// relative), with its `truncate: false` and with the rounded ramp (the default, and
    /// llama.cpp's): the two differ only on the ramp (pairs 9 to 17).
    #[test]
    fn yarn_frequencies_are_transformers() {
        let hf: [(bool, [(usize, f64); 9]); 2] = [
            (
                false,
                [
                    (0, 1.0),
                    (7, 0.07374456524848938),
                    (8, 0.05081327259540558),
                    (9, 0.031705696135759354),
                    (12, 0.006794959306716919),
                    (16, 0.0004564839182421565),
                    (17, 0.00012931869423482567),
                    (18, 3.830881178146228e-05),
                    (31, 3.023511396804679e-07),
                ],
            ),
            (
                true,
                [
                    (0, 1.0),
                    (7, 0.07374456524848938),
                    (8, 0.05081327259540558),
                    (9, 0.031620752066373825),
                    (12, 0.007015713956207037),
                    (16, 0.0005809474969282746),
                    (17, 0.0002279478358104825),
                    (18, 3.830881178146228e-05),
                    (31, 3.023511396804679e-07),
                ],
            ),
        ];
        for (truncate, want) in hf {
            let got = yarn_inv_freq(64, 150000.0, 32.0, 4096.0, (32.0, 1.0), truncate);
            for (i, w) in want {
                let rel = ((got[i] as f64 - w) / w).abs();
                assert!(
                    rel < 1e-6,
                    "truncate {truncate}, pair {i}: {} vs {w}",
                    got[i]
                );
            }
        }
        assert!((metrale_model::config::yarn_mscale(32.0) - 1.346_573_6).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_adjacent_pairs() {
        let inv = rope_inv_freq(4, 100.0, None, None);
        assert!((inv[0] - 1.0).abs() < 1e-7 && (inv[1] - 0.1).abs() < 1e-7);
        let mut x = [1.0f32, 0.0, 0.0, 2.0];
        rope_inplace(&mut x, 4, 3, &inv);
        let (c0, s0, c1, s1) = (3f32.cos(), 3f32.sin(), 0.3f32.cos(), 0.3f32.sin());
        let want = [c0, s0, -2.0 * s1, 2.0 * c1];
        for i in 0..4 {
            assert!(
                (x[i] - want[i]).abs() < 1e-6,
                "{i}: {} vs {}",
                x[i],
                want[i]
            );
        }
        // Llama 3 scaling: a low frequency is divided by the factor, a high one is kept.
        let s = Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let plain = rope_inv_freq(128, 500000.0, None, None);
        let scaled = rope_inv_freq(128, 500000.0, Some(&s), None);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
    }

    /// The llama3-scaled cos/sin table the kernels read rotates exactly as the CPU backend does.
    #[test]
    fn rope_table_with_llama3_scaling_matches_the_rotation() {
        let mut c = llama_1b_config();
        let hd = c.head_dim;
        let plain = model_inv_freq(&c, 4096, || {
            unreachable!("no rope_freqs without FreqFactors")
        })
        .unwrap();
        c.rope_scaling = Some(metrale_model::RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        });
        let inv = model_inv_freq(&c, 4096, || {
            unreachable!("no rope_freqs without FreqFactors")
        })
        .unwrap();
        // scaling changed the low frequencies and kept the highest one
        assert_eq!(inv[0], plain[0]);
        assert!(
            (inv[hd / 2 - 1] - plain[hd / 2 - 1] / 32.0).abs() <= 1e-6 * plain[hd / 2 - 1].abs()
        );
        let n_pos = 5000;
        let table = rope_table(&inv, n_pos);
        let x: Vec<f32> = (0..hd)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
            .collect();
        for pos in [0usize, 1, 7, 1000, 4999] {
            let mut want = x.clone();
            rope_inplace(&mut want, hd, pos, &inv);
            for i in 0..hd / 2 {
                let [co, si] = table[pos * (hd / 2) + i];
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                let got = [a * co - b * si, a * si + b * co];
                for (g, w) in got.iter().zip(&want[2 * i..2 * i + 2]) {
                    assert!(
                        (g - w).abs() <= 1e-5,
                        "pos {pos} pair {i}: table rotation {g} vs cpu {w}"
                    );
                }
            }
        }
    }

    fn llama_1b_config() -> metrale_model::ModelConfig {
        metrale_model::ModelConfig {
            family: metrale_model::Family::Llama,
            name: "llama-3.2-1b".into(),
            arch: "llama".into(),
            model_type: "llama".into(),
            n_layers: 16,
            hidden: 2048,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 128256,
            rope_theta: 500000.0,
            norm_eps: 1e-5,
            max_context: 131072,
            tied_embeddings: true,
            moe: None,
            rope_scaling: None,
            sliding: None,
            attn_scale: 1.0,
            bos: Some(128000),
            eos: vec![128001],
            add_bos: true,
            pooling: None,
            fp8: None,
            rotary_dim: 64,
        }
    }
}
