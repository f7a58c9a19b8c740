//! `Q5_0` and `Q5_1` (ggml's): `Q4_0` / `Q4_1` with a fifth bit per element, a u32 `qh` after the
//! scales whose bit i is element i's. `Q5_0`: f16 `d`, u32 `qh`, 16 bytes of nibbles,
//! w = (q - 16) * d. `Q5_1`: f16 `d`, f16 `m`, u32 `qh`, 16 bytes of nibbles, w = q * d + m. The
//! quantizers take Q4_0 / Q4_1's rules with 32 levels.

use super::{f16_at, f16_bytes, QK};

/// Bytes of one block of [`QK`] elements: `Q5_1` (`one`) or `Q5_0`.
pub const fn block_bytes(one: bool) -> usize {
    if one {
        2 + 2 + 4 + QK / 2
    } else {
        2 + 4 + QK / 2
    }
}

/// Whole blocks of `bytes` into `out` (`out.len() / QK` blocks; sizes checked by the caller).
pub fn dequantize(one: bool, bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK)
        .zip(bytes.chunks_exact(block_bytes(one)))
    {
        // Q5_0: w = (q - 16) * d; Q5_1: w = q * d + m (ggml's order of operations)
        let d = f16_at(b, 0);
        let at = if one { 4 } else { 2 };
        let m = if one { f16_at(b, 2) } else { 0.0 };
        let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let qs = &b[at + 4..];
        let w = |q: u32| {
            if one {
                q as f32 * d + m
            } else {
                (q as i32 - 16) as f32 * d
            }
        };
        for j in 0..QK / 2 {
            o[j] = w((qs[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4);
            o[j + QK / 2] = w((qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4);
        }
    }
}

/// `src` (whole blocks) into `out`.
pub fn quantize(one: bool, src: &[f32], out: &mut [u8]) {
    for (b, x) in out
        .chunks_exact_mut(block_bytes(one))
        .zip(src.chunks_exact(QK))
    {
        // Q5_0 as Q4_0 with 32 levels (d = max / -16), Q5_1 as Q4_1 (d = (max - min) / 31)
        let (d, min, at) = if one {
            let min = x.iter().copied().fold(f32::INFINITY, f32::min);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            ((max - min) / 31.0, min, 4)
        } else {
            let max = x
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            (max / -16.0, 0.0, 2)
        };
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&f16_bytes(d));
        if one {
            b[2..4].copy_from_slice(&f16_bytes(min));
        }
        let q = |v: f32| -> u32 {
            if one {
                (((v - min) * id + 0.5) as i32).clamp(0, 31) as u32
            } else {
                ((v * id + 16.5) as i32).clamp(0, 31) as u32
            }
        };
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let (lo, hi) = (q(x[j]), q(x[j + QK / 2]));
            b[at + 4 + j] = (lo & 0xf) as u8 | (((hi & 0xf) as u8) << 4);
            qh |= ((lo >> 4) << j) | ((hi >> 4) << (j + 16));
        }
        b[at..at + 4].copy_from_slice(&qh.to_le_bytes());
    }
}
