//! `Q4_0` (ggml's, ggml-common.h): blocks of 32 elements, f16 `d` then 16 bytes of nibbles;
//! w = (q - 8) * d. The low nibble of byte j is element j, the high nibble element j + 16. The
//! quantizer is ggml's reference (`quantize_row_q4_0_ref`): d = max / -8 of the element of largest
//! magnitude, each element the nearest level.

use super::{f16_at, f16_bytes, QK};

/// Bytes of one block of [`QK`] elements.
pub const BLOCK_BYTES: usize = 2 + QK / 2;

/// Whole blocks of `bytes` into `out` (`out.len() / QK` blocks; sizes checked by the caller).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK)
        .zip(bytes.chunks_exact(BLOCK_BYTES))
    {
        let d = f16_at(b, 0);
        let qs = &b[2..];
        for j in 0..QK / 2 {
            o[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
            o[j + QK / 2] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// `src` (whole blocks) into `out`, ggml's reference quantizer.
pub fn quantize(src: &[f32], out: &mut [u8]) {
    for (b, x) in out.chunks_exact_mut(BLOCK_BYTES).zip(src.chunks_exact(QK)) {
        // the element of largest magnitude, with its sign, maps to level 0 (-8)
        let max = x
            .iter()
            .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&f16_bytes(d));
        let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
        for j in 0..QK / 2 {
            b[2 + j] = q(x[j]) | (q(x[j + QK / 2]) << 4);
        }
    }
}
