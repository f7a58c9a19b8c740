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
