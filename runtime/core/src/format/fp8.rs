//! FP8 (e4m3) weights with a scale per output channel: the one host-side place of the format.
//!
//! Owns: the e4m3 codec ([`e4m3_to_f32`], [`f32_to_e4m3`]), the quantizer of a matrix to e4m3
//! with one f32 scale per row ([`quantize_matrix`], what `--quantization fp8` does to a bf16
//! checkpoint at load), and the activation quantization the products apply to their input
//! ([`Activations`], [`quantize_activations`]).
//!
//! The format, as vLLM and TensorRT-LLM run FP8 checkpoints on Hopper:
//! - e4m3 is OCP's `float8_e4m3fn` (torch's name): sign, 4 exponent bits of bias 7, 3 mantissa
//!   bits; no infinities; `0x7f` / `0xff` are NaN; the largest finite value is 448; below 2^-6
//!   the values are subnormal steps of 2^-9.
//! - A matrix `W` of `rows` x `cols` is `cols` e4m3 bytes a row (element type
//!   [`crate::dtype::DType::F8_E4M3`], which carries no scale) beside a tensor of `rows` f32
//!   scales, `w[r][c] = e4m3(q[r][c]) * s[r]`; a checkpoint's per-tensor scale is one value
//!   repeated. Model tensors: `blk.N.<name>.weight` and `blk.N.<name>.weight_scale`, and, for
//!   checkpoints quantized with static activation scales, `blk.N.<name>.input_scale`.
//! - The product's input is quantized too (W8A8): each token's row `x` takes the scale
//!   `a = max|x| / 448` (dynamic, per token; fbgemm's `activation_scale_ub` caps `max|x|`) or the
//!   checkpoint's `input_scale` (static, per tensor), and becomes `e4m3(x / a) * a`, the
//!   quotient clamped to +-448 first. The product is then `sum_c e4m3(q) e4m3(x') * s * a`:
//!   products of two e4m3 values are exact in f32, so the f32 reference and the tensor cores'
//!   fp8 MMA with f32 accumulation differ only in summation order.
//!
//! Invariants: the codec is torch's (checked value for value against `torch.float8_e4m3fn` in
//! `tests/fp8_golden.rs`, golden and script in `tests/golden/`); rounding is to nearest, ties to
//! even; out-of-range inputs saturate to +-448 (vLLM clamps before casting; torch's cast alone
//! would give NaN); a zero row's scale is 1 (its bytes are all zero).

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Every e4m3 byte's value (NaN for `0x7f` and `0xff`).
pub static E4M3_TABLE: [f32; 256] = table();

const fn table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        let exp = (b >> 3) & 0xf;
        let man = b & 7;
        let mag = if exp == 0xf && man == 7 {
            f32::NAN
        } else if exp == 0 {
            // subnormal: man * 2^-9
            man as f32 / 512.0
        } else {
            // (8 + man) / 8 * 2^(exp - 7), built from the f32's exponent field
            f32::from_bits(((exp as u32 + 120) << 23) | ((man as u32) << 20))
        };
        t[b] = if b & 0x80 != 0 { -mag } else { mag };
        b += 1;
    }
    t
}

/// The value of an e4m3 byte.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// The e4m3 byte nearest `x` (ties to even), saturating at +-448; NaN gives `0x7f`.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    let bits = if a < 2f32.powi(-6) {
        // subnormal steps of 2^-9 (exact division by a power of two); 8 steps is the smallest
        // normal, whose code is 8 as well
        (a * 512.0).round_ties_even() as u8
    } else {
        let e = ((a.to_bits() >> 23) as i32) - 127; // -6..=8
        let step = f32::from_bits(((e - 3 + 127) as u32) << 23);
        let q = (a / step).round_ties_even() as u32; // 8..=16
        let (e, q) = if q == 16 { (e + 1, 8) } else { (e, q) };
        (((e + 7) as u32) << 3 | (q - 8)) as u8
    };
    sign | bits
}

/// `x` rounded to the nearest e4m3 value after dividing by `scale`, times `scale` again: what a
/// product sees of a value quantized with that scale. A division, not a multiplication by the
/// reciprocal, as torch-based quantizers (llm-compressor, vLLM) compute it: the two differ in the
/// last bit, which decides ties.
#[inline(always)]
pub fn round_scaled(x: f32, scale: f32) -> f32 {
    e4m3_to_f32(f32_to_e4m3(x / scale)) * scale
}

/// A matrix in e4m3 with one scale per row: `bytes` is `rows * cols` (row-major), `scales` is
/// `rows` long.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Matrix {
    pub bytes: Vec<u8>,
    pub scales: Vec<f32>,
}

/// The scale of a row whose largest magnitude is `amax`: `amax / 448`, 1 for a zero row.
pub fn row_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Quantize `rows` rows of `cols` f32 values (`src`, row-major) to e4m3 with one scale per row
/// (per output channel: the row's largest magnitude maps to 448).
pub fn quantize_matrix(src: &[f32], rows: usize, cols: usize) -> Fp8Matrix {
    assert_eq!(src.len(), rows * cols, "quantize_matrix: {rows} x {cols}");
    let mut bytes = vec![0u8; rows * cols];
    let mut scales = vec![1f32; rows];
    for ((row, out), s) in src
        .chunks_exact(cols.max(1))
        .zip(bytes.chunks_exact_mut(cols.max(1)))
        .zip(&mut scales)
    {
        *s = row_scale(row.iter().fold(0f32, |m, v| m.max(v.abs())));
        for (o, v) in out.iter_mut().zip(row) {
            *o = f32_to_e4m3(v / *s);
        }
    }
    Fp8Matrix { bytes, scales }
}

/// How a checkpoint's FP8 products quantize their input rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activations {
    /// Per token, from the row's largest magnitude, capped at `ub` where the checkpoint gives one
    /// (fbgemm's `activation_scale_ub`).
    Dynamic { ub: Option<f32> },
    /// Per tensor: each matrix's `input_scale`.
    Static,
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Activations::Dynamic { ub: None } => f.write_str("dynamic per-token activation scales"),
            Activations::Dynamic { ub: Some(u) } => {
                write!(f, "dynamic per-token activation scales (capped at {u})")
            }
            Activations::Static => f.write_str("static per-tensor activation scales"),
        }
    }
}

/// Quantize each `cols`-long row of `x` in place as an FP8 product's input: with `input_scale`
/// (static) every row takes that scale, otherwise each row its own (`Dynamic`, `ub` capping the
/// row's largest magnitude).
pub fn quantize_activations(x: &mut [f32], cols: usize, input_scale: Option<f32>, ub: Option<f32>) {
    for row in x.chunks_exact_mut(cols.max(1)) {
        let scale = match input_scale {
            Some(s) if s > 0.0 => s,
            Some(_) => 1.0,
            None => {
                let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                row_scale(ub.map_or(amax, |u| amax.min(u)))
            }
        };
        for v in row.iter_mut() {
            *v = round_scaled(*v, scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_byte_round_trips() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert!(b & 0x7f == 0x7f, "{b:#x}");
                continue;
            }
            // -0 comes back as 0x80, +0 as 0x00
            assert_eq!(f32_to_e4m3(v), b, "{b:#x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
    }

    #[test]
    fn rounding_is_nearest_even_and_saturates() {
        // 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39): ties to even
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        assert_eq!(f32_to_e4m3(1.07), 0x39);
        assert_eq!(f32_to_e4m3(1e6), 0x7e);
        assert_eq!(f32_to_e4m3(-1e6), 0xfe);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        // halfway between the largest subnormal (7/512) and the smallest normal (8/512): even
        assert_eq!(f32_to_e4m3(7.5 / 512.0), 0x08);
        assert_eq!(f32_to_e4m3(0.5 / 512.0), 0x00);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
    }

    #[test]
    fn matrix_scales_per_row() {
        let src = [1.0, -2.0, 0.5, 0.0, 0.0, 0.0, 100.0, 3.0, -448.0];
        let m = quantize_matrix(&src, 3, 3);
        assert_eq!(m.scales, vec![2.0 / 448.0, 1.0, 448.0 / 448.0]);
        // each row's largest magnitude maps to 448 exactly
        assert_eq!(m.bytes[1], 0xfe);
        assert_eq!(&m.bytes[3..6], &[0, 0, 0]);
        for (r, row) in src.chunks(3).enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let back = e4m3_to_f32(m.bytes[r * 3 + c]) * m.scales[r];
                // 3 mantissa bits: within 2^-4 relative of the value, or a subnormal step
                assert!(
                    (back - v).abs() <= v.abs() / 16.0 + m.scales[r] / 1024.0,
                    "{v} -> {back}"
                );
            }
        }
    }

    #[test]
    fn activations_static_and_dynamic() {
        let mut x = [3.0f32, -1.0, 0.1, 896.0];
        quantize_activations(&mut x, 2, None, None);
        // row 0: scale 3/448, 3.0 back up to the scale's rounding; row 1: scale 2, 896 exact and
        // 0.1 -> 0.1 / 2 rounded
        assert!((x[0] - 3.0).abs() < 1e-6, "{}", x[0]);
        assert_eq!(x[3], 896.0);
        assert_eq!(x[2], e4m3_to_f32(f32_to_e4m3(0.05)) * 2.0);
        let mut y = [1000.0f32, 1.0];
        quantize_activations(&mut y, 2, Some(1.0), None);
        assert_eq!(y, [448.0, 1.0]);
        let mut z = [1000.0f32, 1.0];
        quantize_activations(&mut z, 2, None, Some(448.0));
        assert_eq!(z, [448.0, 1.0]);
    }
}
