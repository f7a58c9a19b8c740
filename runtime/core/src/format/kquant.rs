//! The GGUF "K-quant" block formats (`Q2_K`, `Q3_K`, `Q4_K`, `Q5_K`, `Q6_K`: what `llama-quantize`
//! writes for the Q2_K, Q3_K_S/M/L, Q4_K_M, Q5_K_M and Q6_K mixes) and their reference
//! dequantisation to f32, which
//! [`crate::dtype::dequantize_row`] uses for the matching [`crate::dtype::DType`]s; every backend's
//! dequantisation is tested against these.
//!
//! Layouts (ggml's, little-endian), super-blocks of [`QK_K`] = 256 elements in 8 sub-blocks of 32
//! (Q2_K, Q3_K, Q6_K: 16 sub-blocks of 16):
//! - `Q2_K` (84 bytes): 16 bytes of 4-bit sub-block scales (low nibble) and mins (high), 64 bytes
//!   of 2-bit quants, f16 `d`, f16 `dmin`. w = d * scale_j * q - dmin * min_j. Each 128 elements
//!   take 32 bytes: element 32 s + l (s = 0..3, l = 0..31) is bits 2s of byte l.
//! - `Q3_K` (110 bytes): 32 bytes of high bits, 64 bytes of 2-bit quants (as Q2_K's), 12 bytes of
//!   6-bit scales, f16 `d`. w = d * (scale_j - 32) * (q - 4 * !h), h the element's high bit: bit
//!   4 c + s of byte l for element 128 c + 32 s + l. The scales: the low nibbles of bytes 0-7 then
//!   their high nibbles make the low 4 bits of scales 0-15; bits 2k of bytes 8-11 the top 2 bits of
//!   scales 4k..4k+3.
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

use super::float::f16_to_f32;

/// Elements of a K-quant super-block.
pub const QK_K: usize = 256;

/// The K-quant formats, with their super-block sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum KQuant {
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl KQuant {
    /// The GGUF / ggml type id.
    pub fn ggml_type(self) -> u32 {
        match self {
            KQuant::Q2_K => 10,
            KQuant::Q3_K => 11,
            KQuant::Q4_K => 12,
            KQuant::Q5_K => 13,
            KQuant::Q6_K => 14,
        }
    }

    /// Bytes of one super-block of [`QK_K`] elements.
    pub const fn block_bytes(self) -> usize {
        match self {
            KQuant::Q2_K => QK_K / 16 + QK_K / 4 + 2 + 2,
            KQuant::Q3_K => QK_K / 8 + QK_K / 4 + 12 + 2,
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
            KQuant::Q2_K => dequantize_q2_k(b, y),
            KQuant::Q3_K => dequantize_q3_k(b, y),
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

/// One Q2_K super-block (84 bytes) into 256 values.
pub fn dequantize_q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, y) in y.iter_mut().enumerate() {
        let (c, s, l) = (i / 128, (i / 32) % 4, i % 32);
        let sc = scales[i / 16];
        let q = (qs[32 * c + l] >> (2 * s)) & 3;
        *y = d * (sc & 0xF) as f32 * q as f32 - dmin * (sc >> 4) as f32;
    }
}

/// Q3_K's 16 sub-block scales (6 bits each, before the - 32) from its 12 packed bytes.
fn q3_k_scales(p: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| {
        let low = match j < 8 {
            true => p[j] & 0xF,
            false => p[j - 8] >> 4,
        };
        low | (((p[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)
    })
}

/// One Q3_K super-block (110 bytes) into 256 values.
pub fn dequantize_q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = q3_k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    for (i, y) in y.iter_mut().enumerate() {
        let (c, s, l) = (i / 128, (i / 32) % 4, i % 32);
        let dl = d * (scales[i / 16] as i32 - 32) as f32;
        let low = ((qs[32 * c + l] >> (2 * s)) & 3) as i32;
        let high = (hmask[l] >> (4 * c + s)) & 1;
        *y = dl * (low - if high == 1 { 0 } else { 4 }) as f32;
    }
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

/// Quantise whole super-blocks of `src` into `out` ([`KQuant::block_bytes`] each), the inverse of
/// [`KQuant::dequantize`] up to rounding. The project's own quantizer, simpler than ggml's (which
/// searches each sub-block's scale for the least squared error): every sub-block takes the scale
/// (and, Q4_K / Q5_K, the offset) that spans its values, the super-block's f16 `d` (and `dmin`) the
/// largest of those over the 6-bit (Q6_K: i8) range, and each element the nearest level. Used for
/// synthetic checkpoints in the llama.cpp mixes (`cargo xtask synth-model --quant q4_k_m`).
pub fn quantize(k: KQuant, src: &[f32], out: &mut [u8]) -> Result<(), String> {
    if !src.len().is_multiple_of(QK_K) || out.len() != src.len() / QK_K * k.block_bytes() {
        return Err(format!(
            "{k:?}: {} values and {} bytes are not matching whole blocks of {QK_K}",
            src.len(),
            out.len()
        ));
    }
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(out.chunks_exact_mut(k.block_bytes()))
    {
        match k {
            KQuant::Q2_K | KQuant::Q3_K => {
                return Err(format!(
                    "{k:?}: metrale reads this type and does not write it (llama-quantize does)"
                ))
            }
            KQuant::Q4_K => quantize_q45_k(x, b, false),
            KQuant::Q5_K => quantize_q45_k(x, b, true),
            KQuant::Q6_K => quantize_q6_k(x, b),
        }
    }
    Ok(())
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Q4_K (`five` false: 16 levels) or Q5_K (32 levels): per 32-element sub-block an offset m_j =
/// max(0, -min) and a step s_j = (max + m_j) / (levels - 1); d = max s_j / 63, dmin = max m_j / 63,
/// each stored as a 6-bit multiple; w = d * sc_j * q - dmin * mn_j.
fn quantize_q45_k(x: &[f32], b: &mut [u8], five: bool) {
    let top = if five { 31.0 } else { 15.0 };
    let mut step = [0f32; 8];
    let mut off = [0f32; 8];
    for j in 0..8 {
        let v = &x[32 * j..32 * j + 32];
        let lo = v.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
        let hi = v.iter().copied().fold(f32::NEG_INFINITY, f32::max).max(0.0);
        off[j] = -lo;
        step[j] = (hi - lo) / top;
    }
    let dq = |m: f32| half::f16::from_f32(m / 63.0).to_f32();
    let (d, dmin) = (
        dq(step.iter().copied().fold(0.0, f32::max)),
        dq(off.iter().copied().fold(0.0, f32::max)),
    );
    // the 6-bit multiples: the step rounded up (so the span still fits), the offset to nearest
    let sc: [u8; 8] = std::array::from_fn(|j| {
        if d > 0.0 {
            (step[j] / d).ceil().min(63.0) as u8
        } else {
            0
        }
    });
    let mn: [u8; 8] = std::array::from_fn(|j| {
        if dmin > 0.0 {
            (off[j] / dmin).round().min(63.0) as u8
        } else {
            0
        }
    });
    b[0..2].copy_from_slice(&f16_bytes(d));
    b[2..4].copy_from_slice(&f16_bytes(dmin));
    let s = &mut b[4..16];
    s.fill(0);
    for j in 0..8 {
        if j < 4 {
            s[j] |= sc[j] & 63;
            s[j + 4] |= mn[j] & 63;
        } else {
            s[j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (mn[j] >> 4) << 6;
        }
    }
    let q: [u8; QK_K] = std::array::from_fn(|i| {
        let j = i / 32;
        let (dj, mj) = factors(j, d, dmin, &b[4..16]);
        if dj > 0.0 {
            ((x[i] + mj) / dj).round().clamp(0.0, top) as u8
        } else {
            0
        }
    });
    if five {
        let (qh, qs) = b[16..176].split_at_mut(32);
        qh.fill(0);
        for i in 0..4 {
            for l in 0..32 {
                let (lo, hi) = (q[64 * i + l], q[64 * i + 32 + l]);
                qs[32 * i + l] = (lo & 0xF) | ((hi & 0xF) << 4);
                qh[l] |= ((lo >> 4) << (2 * i)) | ((hi >> 4) << (2 * i + 1));
            }
        }
    } else {
        let qs = &mut b[16..144];
        for i in 0..4 {
            for l in 0..32 {
                qs[32 * i + l] = q[64 * i + l] | (q[64 * i + 32 + l] << 4);
            }
        }
    }
}

/// Q6_K: per 16-element sub-block a step s_j = max|v| / 31 (levels -32..31); d = max s_j / 127,
/// each sub-block's i8 scale its step in units of d rounded up; w = d * scale_j * (q - 32).
fn quantize_q6_k(x: &[f32], b: &mut [u8]) {
    let step: [f32; 16] = std::array::from_fn(|j| {
        x[16 * j..16 * j + 16]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            / 31.0
    });
    let d = half::f16::from_f32(step.iter().copied().fold(0.0, f32::max) / 127.0).to_f32();
    let sc: [i8; 16] = std::array::from_fn(|j| {
        if d > 0.0 {
            (step[j] / d).ceil().min(127.0) as i8
        } else {
            0
        }
    });
    let q: [u8; QK_K] = std::array::from_fn(|i| {
        let f = d * sc[i / 16] as f32;
        if f > 0.0 {
            ((x[i] / f).round() + 32.0).clamp(0.0, 63.0) as u8
        } else {
            32
        }
    });
    let (ql, rest) = b.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (scb, db) = rest.split_at_mut(16);
    qh.fill(0);
    for h in 0..2 {
        for l in 0..32 {
            let y = |k: usize| q[128 * h + 32 * k + l];
            ql[64 * h + l] = (y(0) & 0xF) | ((y(2) & 0xF) << 4);
            ql[64 * h + l + 32] = (y(1) & 0xF) | ((y(3) & 0xF) << 4);
            qh[32 * h + l] =
                (y(0) >> 4) | ((y(1) >> 4) << 2) | ((y(2) >> 4) << 4) | ((y(3) >> 4) << 6);
        }
    }
    for (o, &v) in scb.iter_mut().zip(&sc) {
        *o = v as u8;
    }
    db.copy_from_slice(&f16_bytes(d));
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

    /// The quantizers against the reference dequantisation: each element within a step of its
    /// sub-block plus what the super-block's shared d / dmin add (a scale rounded up to its 6-bit /
    /// i8 multiple, an offset rounded to its 6-bit one), on values whose scale changes 300x between
    /// sub-blocks; the relative L2 error bounded per format; a zero block stays zero.
    #[test]
    fn quantize_round_trips_through_dequantize() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let src: Vec<f32> = (0..4 * QK_K)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * [3.0, 0.01, 0.4, 1.0][(i / 48) % 4] + if i % 512 < 64 { 0.2 } else { 0.0 }
            })
            .collect();
        for k in [KQuant::Q4_K, KQuant::Q5_K, KQuant::Q6_K] {
            let mut q = vec![0u8; src.len() / QK_K * k.block_bytes()];
            quantize(k, &src, &mut q).unwrap();
            let mut back = vec![0f32; src.len()];
            k.dequantize(&q, &mut back).unwrap();
            let (sub, levels) = match k {
                KQuant::Q4_K => (32, 15.0),
                KQuant::Q5_K => (32, 31.0),
                KQuant::Q6_K => (16, 31.0),
                KQuant::Q2_K | KQuant::Q3_K => unreachable!("read-only types"),
            };
            let (mut num, mut den) = (0f64, 0f64);
            for (j, (s, b)) in src.chunks(sub).zip(back.chunks(sub)).enumerate() {
                let lo = s.iter().copied().fold(0f32, f32::min);
                let hi = s.iter().copied().fold(0f32, f32::max);
                let span = if k == KQuant::Q6_K {
                    hi.max(-lo)
                } else {
                    hi - lo
                };
                // the super-block's d (and dmin) bound how far a rounded 6-bit scale (or offset)
                // lands from the sub-block's own: Q4_K / Q5_K d <= 2 big / levels / 63, dmin <=
                // big / 63; Q6_K d <= big / 31 / 127
                let blk = &src[j * sub / QK_K * QK_K..][..QK_K];
                let big = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let tol = match k {
                    KQuant::Q6_K => span / levels + big / levels / 127.0,
                    _ => span / levels + 2.0 * big / levels / 63.0 + big / 63.0 / 2.0,
                } * 1.01
                    + 1e-6;
                for (a, b2) in s.iter().zip(b) {
                    assert!(
                        (a - b2).abs() <= tol,
                        "{k:?} sub-block {j}: {a} -> {b2} (tol {tol})"
                    );
                    num += ((a - b2) as f64).powi(2);
                    den += (*a as f64).powi(2);
                }
            }
            let rel = (num / den).sqrt();
            let bound = match k {
                KQuant::Q4_K => 0.1,
                KQuant::Q5_K => 0.05,
                KQuant::Q6_K => 0.03,
                KQuant::Q2_K | KQuant::Q3_K => unreachable!("read-only types"),
            };
            assert!(rel < bound, "{k:?}: relative L2 error {rel}");
            let zero = vec![0f32; QK_K];
            let mut zq = vec![0u8; k.block_bytes()];
            quantize(k, &zero, &mut zq).unwrap();
            let mut zb = vec![1f32; QK_K];
            k.dequantize(&zq, &mut zb).unwrap();
            assert!(zb.iter().all(|v| *v == 0.0), "{k:?}: zeros");
        }
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
