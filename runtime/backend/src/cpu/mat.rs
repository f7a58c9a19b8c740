//! Views of weight matrices as the CPU kernels read them, and the instruction set they run with:
//! what the f32 reference ops (`ops`) and the integer-activation kernels (`qact`) both need.

use metrale_core::dtype::DType;

/// A weight matrix view: `rows` rows of `cols` elements of `dtype`, row-major in `data`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// Q4_1 rows in the packed order of [`super::qact::pack_q4_1_rows`] (the CPU backend's layer
    /// matrices on AVX2 CPUs), not GGUF's.
    pub packed: bool,
    /// The scales of an FP8 (`F8_E4M3`) matrix; `None` for every other type.
    pub fp8: Option<Fp8Ref<'a>>,
}

/// An FP8 matrix's scales (`metrale_core::fp8`): row `r` is `e4m3(q) * scales[r]`, and the
/// product's input rows are quantized to e4m3 with `input_scale` (static) or their own
/// largest magnitude capped at `ub` (dynamic).
#[derive(Debug, Clone, Copy)]
pub struct Fp8Ref<'a> {
    pub scales: &'a [f32],
    pub input_scale: Option<f32>,
    pub ub: Option<f32>,
}

/// [`Fp8Ref`], owned (the CPU backend's copy of a matrix's scales).
#[derive(Debug, Clone)]
pub struct Fp8Scales {
    pub scales: Vec<f32>,
    pub input_scale: Option<f32>,
    pub ub: Option<f32>,
}

impl Fp8Scales {
    pub fn as_ref(&self) -> Fp8Ref<'_> {
        Fp8Ref {
            scales: &self.scales,
            input_scale: self.input_scale,
            ub: self.ub,
        }
    }
}

impl MatRef<'_> {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("validated at load")
    }
}

/// Which instruction set the fused dots run with on this machine: "avx2" or "generic".
pub fn simd_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            return "avx2";
        }
    }
    "generic"
}
