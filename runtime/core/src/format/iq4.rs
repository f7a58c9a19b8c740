//! The non-linear 4-bit formats `IQ4_NL` and `IQ4_XS` (ggml's `block_iq4_nl`, `block_iq4_xs`):
//! each 4-bit code picks one of 16 fixed levels ([`LEVELS`], spaced more finely near zero) times
//! a scale. `IQ4_NL` (18 bytes a block of 32): f16 `d`, then 16 bytes of codes, element j in the
//! low nibble of byte j and element j + 16 in its high nibble; w = d * level. `IQ4_XS` (136 bytes
//! a super-block of 256): f16 `d`, a u16 of the 8 sub-blocks' high scale bits (2 each, sub-block
//! i at bits 2i), 4 bytes of their low scale bits (a nibble each, sub-block i in byte i / 2 at bit
//! 4 (i % 2)), 128 bytes of codes (each 32-element sub-block's 16 bytes as IQ4_NL's); w = d *
//! (scale_i - 32) * level. llama-quantize writes them (IQ4_NL also as the fallback of Q2_K, Q3_K
//! and IQ4_XS rows that are not whole 256-element super-blocks); metrale reads them.

use super::{f16_at, QK};
use crate::kquant::QK_K;

/// The 16 levels, by code (ggml's `kvalues_iq4nl`).
pub const LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Bytes of one `IQ4_NL` block of [`QK`] elements.
pub const NL_BLOCK_BYTES: usize = 2 + QK / 2;
/// Bytes of one `IQ4_XS` super-block of [`QK_K`] elements.
pub const XS_BLOCK_BYTES: usize = 2 + 2 + QK_K / 64 + QK_K / 2;

/// 16 bytes of codes (32 elements) times `dl` into `out`.
fn codes(q: &[u8], dl: f32, out: &mut [f32]) {
    for (j, &b) in q.iter().enumerate() {
        out[j] = dl * LEVELS[(b & 0xF) as usize] as f32;
        out[j + 16] = dl * LEVELS[(b >> 4) as usize] as f32;
    }
}

/// Whole `IQ4_NL` blocks of `bytes` into `out` (sizes checked by the caller).
pub fn dequantize_nl(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK)
        .zip(bytes.chunks_exact(NL_BLOCK_BYTES))
    {
        codes(&b[2..], f16_at(b, 0), o);
    }
}

/// Whole `IQ4_XS` super-blocks of `bytes` into `out` (sizes checked by the caller).
pub fn dequantize_xs(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(XS_BLOCK_BYTES))
    {
        let d = f16_at(b, 0);
        let high = u16::from_le_bytes([b[2], b[3]]);
        for (i, o) in o.chunks_exact_mut(32).enumerate() {
            let low = (b[4 + i / 2] >> (4 * (i % 2))) & 0xF;
            let scale = (low as i32 | (((high >> (2 * i)) & 3) as i32) << 4) - 32;
            codes(&b[8 + 16 * i..8 + 16 * (i + 1)], d * scale as f32, o);
        }
    }
}
