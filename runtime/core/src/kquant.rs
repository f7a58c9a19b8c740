//! The GGUF "K-quant" block formats (`Q4_K`, `Q5_K`, `Q6_K`: what `llama-quantize` writes for the
//! Q4_K_M, Q5_K_M and Q6_K mixes) and their reference dequantisation to f32, which
//! [`crate::dtype::dequantize_row`] uses for the matching [`crate::dtype::DType`]s; every backend's
//! dequantisation is tested against these.
//!
//! Layouts (ggml's, little-endian), super-blocks of [`QK_K`] = 256 elements in 8 sub-blocks of 32
//! (Q6_K: 16 sub-blocks of 16):
//! - `Q4_K` (144 bytes): f16 `d`, f16 `dmin`, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
//!   of nibbles. w = d * scale_j * q - dmin * min_j. Each 64 elements take 32 bytes of nibbles: low
//!   nibbles the first 32 (sub-block 2i), high nibbles the next 32 (sub-block 2i + 1).
//! - `Q5_K` (176 bytes): `Q4_K`'s header, then 32 bytes of fifth bits, 128 bytes of nibbles:
//!   q = nibble + 16 * bit, where 64-element chunk i takes bit 2i of byte l for its low nibbles and
//!   bit 2i + 1 for its high nibbles.
//! - `Q6_K` (210 bytes): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 i8 sub-block
//!   scales, f16 `d`. w = d * scale * (q - 32), q = 4 low bits + 2 high bits; each 128 elements take
//!   64 bytes of nibbles, 32 of high bits and 8 scales (layout in [`dequantize_q6_k`]).
//!
//! The 6-bit scales of Q4_K/Q5_K: sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scale) and 4-7
//! (min); sub-blocks 4-7 take the nibbles of bytes 8-11 (scale low, min high) with the top 2 bits of
//! bytes 0-3 (scale) and 4-7 (min) above them.

use crate::dtype::f16_to_f32;

/// Elements of a K-quant super-block.
pub const QK_K: usize = 256;

/// The K-quant formats, with their super-block sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum KQuant {
    Q4_K,
    Q5_K,
    Q6_K,
}

impl KQuant {
    /// The GGUF / ggml type id.
    pub fn ggml_type(self) -> u32 {
        match self {
            KQuant::Q4_K => 12,
            KQuant::Q5_K => 13,
            KQuant::Q6_K => 14,
        }
    }

    /// Bytes of one super-block of [`QK_K`] elements.
    pub const fn block_bytes(self) -> usize {
        match self {
            KQuant::Q4_K => 2 + 2 + 12 + QK_K / 2,
            KQuant::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            KQuant::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Dequantise whole super-blocks: `bytes` of `out.len() / QK_K` blocks into `out`. Errors name
    /// the mismatch (a length that is not whole blocks, or bytes for another count).
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
        if !out.len().is_multiple_of(QK_K) {
            return Err(format!(
                "{self:?}: {} elements are not whole blocks of {QK_K}",
                out.len()
            ));
        }
        let n = out.len() / QK_K;
        if bytes.len() != n * self.block_bytes() {
            return Err(format!(
                "{self:?}: {n} blocks take {} bytes, got {}",
                n * self.block_bytes(),
                bytes.len()
            ));
        }
        for (b, y) in bytes
            .chunks_exact(self.block_bytes())
            .zip(out.chunks_exact_mut(QK_K))
        {
            self.dequantize_block(b, y);
        }
        Ok(())
    }

    /// One super-block: `b` of [`Self::block_bytes`] into `y` of [`QK_K`] values. Panics on
    /// shorter slices (callers hold whole blocks).
    #[inline]
    pub fn dequantize_block(self, b: &[u8], y: &mut [f32]) {
        match self {
            KQuant::Q4_K => dequantize_q4_k(b, y),
            KQuant::Q5_K => dequantize_q5_k(b, y),
            KQuant::Q6_K => dequantize_q6_k(b, y),
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Sub-block j's (scale, min) from the 12 packed bytes of Q4_K / Q5_K.
fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Sub-block j's (d * scale, dmin * min) of Q4_K / Q5_K: w = d' * q - m'.
fn factors(j: usize, d: f32, dmin: f32, scales: &[u8]) -> (f32, f32) {
    let (sc, m) = scale_min(j, scales);
    (d * sc as f32, dmin * m as f32)
}

/// One Q4_K super-block (144 bytes) into 256 values.
pub fn dequantize_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for i in 0..4 {
        let ((d0, n0), (d1, n1)) = (
            factors(2 * i, d, dmin, scales),
            factors(2 * i + 1, d, dmin, scales),
        );
        for l in 0..32 {
            let q = qs[32 * i + l];
            y[64 * i + l] = d0 * (q & 0xF) as f32 - n0;
            y[64 * i + 32 + l] = d1 * (q >> 4) as f32 - n1;
        }
    }
}

/// One Q5_K super-block (176 bytes) into 256 values.
pub fn dequantize_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for i in 0..4 {
        let ((d0, n0), (d1, n1)) = (
            factors(2 * i, d, dmin, scales),
            factors(2 * i + 1, d, dmin, scales),
        );
        for l in 0..32 {
            let q = qs[32 * i + l];
            let lo = (q & 0xF) | (((qh[l] >> (2 * i)) & 1) << 4);
            let hi = (q >> 4) | (((qh[l] >> (2 * i + 1)) & 1) << 4);
            y[64 * i + l] = d0 * lo as f32 - n0;
            y[64 * i + 32 + l] = d1 * hi as f32 - n1;
        }
    }
}

/// One Q6_K super-block (210 bytes) into 256 values. Each half of 128 elements takes 64 bytes of
/// `ql`, 32 of `qh` and 8 scales: element l (0..32) of its four 32-element quarters is, in order,
/// the low nibble of ql[l], of ql[l + 32], the high nibble of ql[l], of ql[l + 32], each with the
/// 2 bits of qh[l] at 0, 2, 4, 6 above it; quarter k's elements l < 16 use scale 2k, the rest 2k + 1.
pub fn dequantize_q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for h in 0..2 {
        let (ql, qh, sc, y) = (
            &ql[64 * h..],
            &qh[32 * h..],
            &sc[8 * h..],
            &mut y[128 * h..],
        );
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &q) in q.iter().enumerate() {
                y[32 * k + l] = d * (sc[is + 2 * k] as i8) as f32 * (q as i32 - 32) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_ggmls() {
        assert_eq!(KQuant::Q4_K.block_bytes(), 144);
        assert_eq!(KQuant::Q5_K.block_bytes(), 176);
        assert_eq!(KQuant::Q6_K.block_bytes(), 210);
    }

    #[test]
    fn wrong_lengths_are_refused_by_name() {
        let mut out = vec![0f32; 256];
        let e = KQuant::Q4_K.dequantize(&[0u8; 100], &mut out).unwrap_err();
        assert!(
            e.contains("Q4_K") && e.contains("144") && e.contains("100"),
            "{e}"
        );
        let e = KQuant::Q6_K.dequantize(&[], &mut out[..10]).unwrap_err();
        assert!(e.contains("whole blocks"), "{e}");
    }
}
