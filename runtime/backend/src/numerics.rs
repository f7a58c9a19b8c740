//! Host numerics both backends' reference paths share: the f32 exponential of attention and
//! sampling (one polynomial, written once: the scalar [`exp_approx`] and the sampler's AVX2 form
//! use the same constants), so a token's probabilities do not depend on which path computed them;
//! and the RMSNorm of one row (the CPU forward pass's, and the final norm of the hidden states both
//! backends hand to embeddings).

/// Cody-Waite reduction: `ln 2` split into a part exact in f32 and the rest.
pub const EXP_LN2_HI: f32 = 0.693_359_4;
pub const EXP_LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' degree-6 polynomial for `exp(r)` on the reduced range, highest degree first:
/// `exp(r) = (((((c0 r + c1) r + c2) r + c3) r + c4) r + c5) r^2 + r + 1`.
pub const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Below this the result is `exp(EXP_MIN)` (f32's exponent range ends near -87.3).
pub const EXP_MIN: f32 = -87.0;

/// `exp(x)` for `x <= 0` without a libm call: Cephes' degree-6 polynomial after a Cody-Waite
/// reduction, inlined (within 2 ulp of `f32::exp` on [-87, 0]; below -87, `exp(-87)`). The same
/// bits on every CPU, so a token's attention does not depend on which kernel ran it. Loops over it
/// stay scalar (the float-to-int cast saturates); the sampler's AVX2 log-sum-exp is the vector form
/// of the same polynomial and constants, 2x faster than letting the compiler widen this one.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    let x = x.max(EXP_MIN);
    let k = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - k * EXP_LN2_HI - k * EXP_LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// `out = x / sqrt(mean(x^2) + eps) * w` (RMSNorm of one row).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot_f32(x, x);
    let scale = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

/// f32 dot product with 16 independent lanes (vectorizes; the summation order is fixed).
#[inline(always)]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    hsum16(&acc) + s
}

/// The sum of 16 lanes in a fixed tree order.
#[inline(always)]
pub(crate) fn hsum16(acc: &[f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for l in 0..8 {
        h[l] = acc[l] + acc[l + 8];
    }
    (h[0] + h[4]) + (h[1] + h[5]) + ((h[2] + h[6]) + (h[3] + h[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_is_within_2_ulp_of_libm() {
        let mut worst = 0i64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let d = (exp_approx(x).to_bits() as i64 - x.exp().to_bits() as i64).abs();
            worst = worst.max(d);
            x += 0.000_37;
        }
        assert!(worst <= 2, "worst {worst} ulp");
        assert_eq!(exp_approx(0.0), 1.0);
        assert_eq!(exp_approx(-1000.0), exp_approx(-87.0));
        assert!(exp_approx(f32::NEG_INFINITY) < 1e-37);
    }
}
