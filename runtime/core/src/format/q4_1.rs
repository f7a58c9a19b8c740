//! `Q4_1` (ggml's): blocks of 32 elements, f16 `d`, f16 `m`, then 16 bytes of nibbles;
//! w = q * d + m (the nibble order of [`super::q4_0`]). The quantizer is ggml's reference
//! (`quantize_row_q4_1_ref`): [min, max] in 15 steps, each element the nearest level.

use super::{f16_at, f16_bytes, QK};

/// Bytes of one block of [`QK`] elements.
pub const BLOCK_BYTES: usize = 2 + 2 + QK / 2;

/// Whole blocks of `bytes` into `out` (`out.len() / QK` blocks; sizes checked by the caller).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK)
        .zip(bytes.chunks_exact(BLOCK_BYTES))
    {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..];
        for j in 0..QK / 2 {
            o[j] = (qs[j] & 0x0f) as f32 * d + m;
            o[j + QK / 2] = (qs[j] >> 4) as f32 * d + m;
        }
    }
}

/// `src` (whole blocks) into `out`, ggml's reference quantizer.
pub fn quantize(src: &[f32], out: &mut [u8]) {
    for (b, x) in out.chunks_exact_mut(BLOCK_BYTES).zip(src.chunks_exact(QK)) {
        let min = x.iter().copied().fold(f32::INFINITY, f32::min);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&f16_bytes(d));
        b[2..4].copy_from_slice(&f16_bytes(min));
        let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        for j in 0..QK / 2 {
            b[4 + j] = q(x[j]) | (q(x[j + QK / 2]) << 4);
        }
    }
}
