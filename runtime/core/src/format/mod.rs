//! Weight formats, one file each: a format's block layout, its reference dequantisation to f32
//! (what every backend's kernels are tested against) and its quantizer. [`crate::dtype::DType`]
//! names them and dispatches to these; the loaders' conversions of a format live with it where it
//! has one (FP8's scale tensors: `metrale_model::fp8`), and its device form beside its kernels
//! (`kernels/cuda/common.cuh`: one weight view per device format).
//!
//! - [`float`]: f32, f16, bf16 (and the conversions every host path uses);
//! - [`q4_0`], [`q4_1`], [`q5`] (Q5_0 and Q5_1), [`q8_0`]: ggml's 32-element block formats;
//! - [`kquant`]: ggml's K-quants (Q2_K to Q6_K: 256-element super-blocks);
//! - [`iq4`]: ggml's non-linear 4-bit IQ4_NL and IQ4_XS (read only);
//! - [`mxfp4`]: MXFP4 (OCP microscaling FP4 in 32-element blocks: gpt-oss's experts);
//! - [`fp8`]: FP8 e4m3 with a scale per row (vLLM's FP8 checkpoints), and the per-token input
//!   quantization of its products.

pub mod float;
pub mod fp8;
pub mod iq4;
pub mod kquant;
pub mod mxfp4;
pub mod q4_0;
pub mod q4_1;
pub mod q5;
pub mod q8_0;

/// Elements per block of the 32-element formats (ggml's QK4_0 = QK4_1 = QK5_0 = QK8_0 = 32).
pub const QK: usize = 32;

/// The f16 at byte `i` of a block, widened.
#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    float::f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// `x` as f16 bytes (round to nearest even), as the block formats store their scales.
#[inline]
pub(crate) fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}
