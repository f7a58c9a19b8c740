//! `Q8_0` (ggml's): blocks of 32 elements, f16 `d` then 32 i8; w = q * d. The quantizer is ggml's
//! reference (`quantize_row_q8_0_ref`): d = amax / 127, each element rounded.

use super::{f16_at, f16_bytes, QK};

/// Bytes of one block of [`QK`] elements.
pub const BLOCK_BYTES: usize = 2 + QK;

/// Whole blocks of `bytes` into `out` (`out.len() / QK` blocks; sizes checked by the caller).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK)
        .zip(bytes.chunks_exact(BLOCK_BYTES))
    {
        let d = f16_at(b, 0);
        for j in 0..QK {
            o[j] = (b[2 + j] as i8) as f32 * d;
        }
    }
}

/// `src` (whole blocks) into `out`, ggml's reference quantizer.
pub fn quantize(src: &[f32], out: &mut [u8]) {
    for (b, x) in out.chunks_exact_mut(BLOCK_BYTES).zip(src.chunks_exact(QK)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&f16_bytes(d));
        for j in 0..QK {
            b[2 + j] = ((x[j] * id).round() as i32).clamp(-127, 127) as i8 as u8;
        }
    }
}
