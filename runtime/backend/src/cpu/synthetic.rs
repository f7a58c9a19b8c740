//! Small models with deterministic pseudo-random weights, for tests of this crate and the crates above
//! it (engine, server) that must run without a model file. The weights are real quantized blocks and
//! run through the real CPU forward pass; only their values are made up.

use super::{CpuBackend, Dims, Ffn, Layer, QTensor};
use metrale_core::dtype::DType;

/// Deterministic pseudo-random values in [-1, 1).
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| (crate::sampler::uniform(seed, i) * 2.0 - 1.0) as f32)
        .collect()
}

pub fn rand_bytes(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .map(|i| (crate::sampler::uniform(seed, i) * 256.0) as u8)
        .collect()
}

/// Random valid weight bytes of `dtype` (finite f16 scales).
pub fn rand_weights(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let n = dtype.tensor_bytes(cols, rows).unwrap();
    let mut b = rand_bytes(n, seed);
    let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
    match dtype {
        DType::F32 => {
            for (i, c) in b.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(
                    &((crate::sampler::uniform(seed, i as u64) as f32) - 0.5).to_le_bytes(),
                );
            }
        }
        DType::F16 => {
            for (i, c) in b.chunks_exact_mut(2).enumerate() {
                c.copy_from_slice(&h(crate::sampler::uniform(seed, i as u64) as f32 - 0.5));
            }
        }
        DType::BF16 => {
            for (i, c) in b.chunks_exact_mut(2).enumerate() {
                let v = half::bf16::from_f32(crate::sampler::uniform(seed, i as u64) as f32 - 0.5);
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::Q4_0 | DType::Q8_0 | DType::Q5_0 => {
            for (i, c) in b.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                c[..2].copy_from_slice(&h(0.01 + (i % 7) as f32 * 0.003));
            }
        }
        DType::Q4_1 | DType::Q5_1 => {
            for (i, c) in b.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                c[..2].copy_from_slice(&h(0.01 + (i % 7) as f32 * 0.003));
                c[2..4].copy_from_slice(&h(-0.05 + (i % 5) as f32 * 0.01));
            }
        }
        // the f16 scales of the read-only formats: d (and Q2_K's dmin) small and finite
        DType::Q2_K | DType::Q3_K | DType::IQ4_NL | DType::IQ4_XS => {
            let at: &[usize] = match dtype {
                DType::Q2_K => &[80, 82],
                DType::Q3_K => &[108],
                _ => &[0],
            };
            for (i, c) in b.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                for &a in at {
                    c[a..a + 2].copy_from_slice(&h(0.0004 + (i % 7) as f32 * 0.0001));
                }
            }
        }
        // scales 2^-7 .. 2^-4 (the largest level, 6, then 0.05 to 0.4)
        DType::MXFP4 => {
            for (i, c) in b.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                c[0] = 120 + (i % 4) as u8;
            }
        }
        // super-block scales: d times 6-bit sub-block scales up to 63 (Q4_K, Q5_K: dmin likewise),
        // d times i8 scales (Q6_K)
        DType::Q4_K | DType::Q5_K => {
            for (i, c) in b.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                c[..2].copy_from_slice(&h(0.0004 + (i % 7) as f32 * 0.0001));
                c[2..4].copy_from_slice(&h(0.0008 + (i % 5) as f32 * 0.0001));
            }
        }
        DType::Q6_K => {
            for (i, c) in b.chunks_exact_mut(dtype.block_bytes()).enumerate() {
                c[208..210].copy_from_slice(&h(0.0001 + (i % 7) as f32 * 0.00002));
            }
        }
        // finite values only (0x7f and 0xff are NaN), the whole range
        DType::F8_E4M3 => {
            for v in b.iter_mut() {
                if *v & 0x7f == 0x7f {
                    *v &= 0xfe;
                }
            }
        }
    }
    b
}

/// A 2-layer llama (hidden 64, 4 heads of 16, 2 KV heads, FFN 96, vocab 50) with Q4_1 matrices and a
/// tied Q8_0 embedding, random weights from `seed`.
pub fn tiny_backend(
    dtype: DType,
    seed: u64,
    slots: usize,
    slot_capacity: usize,
    threads: usize,
) -> CpuBackend {
    tiny_backend_kv(
        dtype,
        seed,
        crate::KvConfig::per_slot(slots, slot_capacity),
        threads,
    )
}

/// [`tiny_backend`] with the KV pool `kv` describes.
pub fn tiny_backend_kv(dtype: DType, seed: u64, kv: crate::KvConfig, threads: usize) -> CpuBackend {
    let dims = Dims {
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 96,
        vocab: 50,
    };
    let mut s = seed.wrapping_mul(1000);
    let mut m = |rows: usize, cols: usize, dt: DType| {
        s += 1;
        QTensor {
            dtype: dt,
            rows,
            cols,
            data: rand_weights(dt, rows, cols, s),
            packed: false,
            fp8: (dt == DType::F8_E4M3).then(|| super::mat::Fp8Scales {
                scales: rand_vec(rows, s + 7)
                    .iter()
                    .map(|v| 0.002 + 0.001 * v)
                    .collect(),
                input_scale: None,
                ub: None,
            }),
        }
    };
    let embd = m(dims.vocab, dims.hidden, DType::Q8_0);
    let layers = (0..dims.layers as u64)
        .map(|i| Layer {
            attn_norm: rand_vec(64, seed + 900 + i)
                .iter()
                .map(|v| 1.0 + 0.2 * v)
                .collect(),
            wq: m(64, 64, dtype).packed_for_this_cpu(),
            wk: m(32, 64, dtype).packed_for_this_cpu(),
            wv: m(32, 64, dtype).packed_for_this_cpu(),
            qk_norm: None,
            qkv_bias: None,
            wo: m(64, 64, dtype).packed_for_this_cpu(),
            o_bias: None,
            sinks: None,
            ffn_norm: rand_vec(64, seed + 950 + i)
                .iter()
                .map(|v| 1.0 + 0.2 * v)
                .collect(),
            ffn: Ffn::Dense {
                gate: m(96, 64, dtype).packed_for_this_cpu(),
                up: m(96, 64, dtype).packed_for_this_cpu(),
                down: m(64, 96, dtype).packed_for_this_cpu(),
            },
            post_norms: None,
            window: usize::MAX,
        })
        .collect();
    let inv = crate::rope::rope_inv_freq(16, 10000.0, None, None);
    CpuBackend::from_parts(
        dims,
        1e-5,
        embd,
        None,
        vec![1.0; 64],
        layers,
        inv,
        kv,
        threads,
    )
    .expect("tiny model sizes are valid")
}
