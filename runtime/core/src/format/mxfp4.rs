//! `MXFP4` (ggml's `block_mxfp4`, the OCP Microscaling FP4 format; gpt-oss's expert weights):
//! blocks of 32 elements, one E8M0 scale byte `e` then 16 bytes of FP4 (E2M1) codes; the low
//! nibble of byte j is element j, the high nibble element j + 16. An element is its code's E2M1
//! value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; code 8 is -0) times 2^(e - 127). ggml
//! stores the values doubled ([`LEVELS`]) and the scale halved, 2^(e - 128), which is exact.
//! The quantizer is gguf-py's and ggml's reference (`quantize_row_mxfp4_ref`): e =
//! floor(log2(max |x|)) - 2 + 127 (so the largest magnitude lands in the top levels, 4 to 6 of
//! the E2M1 values), each element the nearest level, ties to the lower code.

use super::QK;

/// Bytes of one block of [`QK`] elements.
pub const BLOCK_BYTES: usize = 1 + QK / 2;

/// The E2M1 values doubled, by code (ggml's `kvalues_mxfp4`).
pub const LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// 2^(e - 128), the scale of the doubled levels (ggml's `GGML_E8M0_TO_FP32_HALF`): a subnormal
/// f32 for e < 2.
#[inline]
pub fn half_scale(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// Whole blocks of `bytes` into `out` (`out.len() / QK` blocks; sizes checked by the caller).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK)
        .zip(bytes.chunks_exact(BLOCK_BYTES))
    {
        let d = half_scale(b[0]);
        for (j, &q) in b[1..].iter().enumerate() {
            o[j] = LEVELS[(q & 0x0f) as usize] as f32 * d;
            o[j + QK / 2] = LEVELS[(q >> 4) as usize] as f32 * d;
        }
    }
}

/// `src` (whole blocks) into `out`, the reference quantizer (module docs).
pub fn quantize(src: &[f32], out: &mut [u8]) {
    for (b, x) in out.chunks_exact_mut(BLOCK_BYTES).zip(src.chunks_exact(QK)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
        } else {
            0
        };
        let d = half_scale(e);
        let code = |v: f32| {
            let mut best = (0u8, f32::INFINITY);
            for (c, &l) in LEVELS.iter().enumerate() {
                let err = (d * l as f32 - v).abs();
                if err < best.1 {
                    best = (c as u8, err);
                }
            }
            best.0
        };
        b[0] = e;
        for j in 0..QK / 2 {
            b[1 + j] = code(x[j]) | (code(x[j + QK / 2]) << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_powers_of_two_and_levels_are_e2m1() {
        assert_eq!(half_scale(128), 1.0);
        assert_eq!(half_scale(127), 0.5);
        assert_eq!(half_scale(1), 2f32.powi(-127));
        assert_eq!(half_scale(0), 2f32.powi(-128));
        // a block of every level at scale 2^0: the E2M1 values, round-tripped exactly
        let mut src = [0f32; QK];
        for (j, s) in src.iter_mut().enumerate() {
            *s = LEVELS[j % 16] as f32 / 2.0;
        }
        let mut q = [0u8; BLOCK_BYTES];
        quantize(&src, &mut q);
        // max 6 = 1.5 x 2^2: e = 2 - 2 + 127, the doubled levels' scale 2^-1 (E2M1's 2^0)
        assert_eq!(q[0], 127);
        let mut back = [0f32; QK];
        dequantize(&q, &mut back);
        assert_eq!(back, src);
    }
}
