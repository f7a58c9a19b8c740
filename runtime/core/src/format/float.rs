//! The float element types (f32, f16, bf16): their conversions to and from f32, and a row of each
//! widened or narrowed (the f16 and bf16 conversions every host path uses).

/// f16 bits -> f32 (exact for every value, subnormals, infinities and NaN included): the one
/// conversion every host path uses (the `half` crate's is checked against it in the tests).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            0
        } else {
            // subnormal: man * 2^-24
            let mag = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -mag } else { mag };
        }
    } else if exp == 0x1f {
        0x7f80_0000 | (man << 13)
    } else {
        ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(sign | bits)
}

/// bf16 bits -> f32 (exact: the upper half of an f32).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN), as torch and ggml convert.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// A row of `dtype`'s bytes (f32, f16 or bf16, little-endian) widened to f32 (exact).
pub fn dequantize(bits: Bits, bytes: &[u8], out: &mut [f32]) {
    match bits {
        Bits::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Bits::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        Bits::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
    }
}

/// A row of f32 narrowed to `bits` (f16 and bf16 round to nearest even).
pub fn quantize(bits: Bits, src: &[f32], out: &mut [u8]) {
    match bits {
        Bits::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(src) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        Bits::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        Bits::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(src) {
                o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
            }
        }
    }
}

/// Which float type a row holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    F32,
    F16,
    BF16,
}
