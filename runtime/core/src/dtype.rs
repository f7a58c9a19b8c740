//! Element types of model tensors and their host (reference) numerics.
//!
//! Owns: the closed set of weight element types the runtime accepts ([`DType`]), their GGUF/ggml type
//! ids and names, their block geometry (how many elements a block holds and how many bytes it
//! takes), checked row sizes, and one row's reference dequantisation to f32 ([`dequantize_row`])
//! and quantization ([`quantize_row`]), dispatched to the format's own file in [`crate::format`]
//! (its layout, dequantisation and quantizer). Every backend's dequantisation is tested against
//! these.
//!
//! Invariants:
//! - A row of `n` elements of a block type is `n / block_elems()` whole blocks; a row length that is not
//!   a multiple of the block length has no byte size ([`DType::row_bytes`] returns `None`).
//! - Size arithmetic is checked: `row_bytes` never overflows, it returns `None`.
//! - Block layouts are ggml's (ggml-common.h), little-endian: 32-element blocks for Q4_0, Q4_1,
//!   Q5_0, Q5_1 and Q8_0, 256-element super-blocks for the K-quants; FP8 is one byte an element
//!   with its scales in a tensor of their own.

pub use crate::format::float::{bf16_to_f32, f16_to_f32, f32_to_bf16};
pub use crate::format::QK;
use crate::kquant::{KQuant, QK_K};

/// Element type of a tensor, as stored in a GGUF or safetensors file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    /// IQ4_NL / IQ4_XS: 4-bit codes of 16 non-linear levels ([`crate::format::iq4`]).
    IQ4_NL,
    IQ4_XS,
    /// MXFP4 (ggml type 39): 32-element blocks of FP4 (E2M1) codes with a power-of-two scale
    /// ([`crate::format::mxfp4`]).
    MXFP4,
    /// FP8 e4m3 (`float8_e4m3fn`), one byte an element, no scale of its own: a matrix of it comes
    /// with a tensor of per-row scales ([`crate::fp8`]). HF safetensors only (GGUF has no FP8 type).
    F8_E4M3,
}

/// Error of the host numerics: a buffer whose size does not match the row it should hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DTypeError {
    #[error("{dtype}: a row of {elems} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        dtype: DType,
        elems: usize,
        block: usize,
    },
    #[error("{dtype}: a row of {elems} elements takes {expected} bytes, got {got}")]
    Size {
        dtype: DType,
        elems: usize,
        expected: usize,
        got: usize,
    },
    #[error("{dtype}: a row of {elems} elements overflows usize")]
    Overflow { dtype: DType, elems: usize },
    #[error("{dtype}: metrale reads this type but does not write it; make the file with llama.cpp's llama-quantize")]
    NoQuantizer { dtype: DType },
}

impl DType {
    /// The types a GGUF file may hold, in ggml id order.
    pub const GGUF: [DType; 16] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::BF16,
        DType::MXFP4,
    ];

    /// Every type: those of GGUF ([`DType::GGUF`]), then FP8.
    pub const ALL: [DType; 17] = {
        let mut all = [DType::F8_E4M3; 17];
        let mut i = 0;
        while i < DType::GGUF.len() {
            all[i] = DType::GGUF[i];
            i += 1;
        }
        all
    };

    /// The ggml / GGUF type id (`enum ggml_type`); `None` for FP8, which GGUF has not.
    pub const fn ggml_id(self) -> Option<u32> {
        Some(match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::IQ4_NL => 20,
            DType::IQ4_XS => 23,
            DType::BF16 => 30,
            DType::MXFP4 => 39,
            DType::F8_E4M3 => return None,
        })
    }

    /// The type with this ggml id, or `None` for ids this runtime does not support.
    pub const fn from_ggml(id: u32) -> Option<DType> {
        match id {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::Q4_0),
            3 => Some(DType::Q4_1),
            6 => Some(DType::Q5_0),
            7 => Some(DType::Q5_1),
            8 => Some(DType::Q8_0),
            10 => Some(DType::Q2_K),
            11 => Some(DType::Q3_K),
            12 => Some(DType::Q4_K),
            13 => Some(DType::Q5_K),
            14 => Some(DType::Q6_K),
            20 => Some(DType::IQ4_NL),
            23 => Some(DType::IQ4_XS),
            30 => Some(DType::BF16),
            39 => Some(DType::MXFP4),
            _ => None,
        }
    }

    /// Lower-case name as ggml and the target files spell it: f32, f16, bf16, q4_0, q4_1, q5_0,
    /// q5_1, q8_0, q4_k, q5_k, q6_k, f8_e4m3.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q8_0 => "q8_0",
            DType::Q2_K => "q2_k",
            DType::Q3_K => "q3_k",
            DType::Q4_K => "q4_k",
            DType::Q5_K => "q5_k",
            DType::Q6_K => "q6_k",
            DType::IQ4_NL => "iq4_nl",
            DType::IQ4_XS => "iq4_xs",
            DType::MXFP4 => "mxfp4",
            DType::F8_E4M3 => "f8_e4m3",
        }
    }

    /// The K-quant format of a K-quant type (`crate::kquant`: its layout and dequantisation).
    pub const fn kquant(self) -> Option<KQuant> {
        match self {
            DType::Q2_K => Some(KQuant::Q2_K),
            DType::Q3_K => Some(KQuant::Q3_K),
            DType::Q4_K => Some(KQuant::Q4_K),
            DType::Q5_K => Some(KQuant::Q5_K),
            DType::Q6_K => Some(KQuant::Q6_K),
            _ => None,
        }
    }

    /// Parse a name as [`DType::name`] spells it (case-insensitive).
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
    }

    /// Elements per block: 1 for the float types (FP8 among them), 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, 256 for
    /// the K-quants.
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::F8_E4M3 => 1,
            DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::IQ4_NL
            | DType::MXFP4 => QK,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS => {
                QK_K
            }
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8_E4M3 => 1,
            DType::Q4_0 => crate::format::q4_0::BLOCK_BYTES,
            DType::Q4_1 => crate::format::q4_1::BLOCK_BYTES,
            DType::Q5_0 => crate::format::q5::block_bytes(false),
            DType::Q5_1 => crate::format::q5::block_bytes(true),
            DType::Q8_0 => crate::format::q8_0::BLOCK_BYTES,
            DType::MXFP4 => crate::format::mxfp4::BLOCK_BYTES,
            DType::IQ4_NL => crate::format::iq4::NL_BLOCK_BYTES,
            DType::IQ4_XS => crate::format::iq4::XS_BLOCK_BYTES,
            DType::Q2_K => KQuant::Q2_K.block_bytes(),
            DType::Q3_K => KQuant::Q3_K.block_bytes(),
            DType::Q4_K => KQuant::Q4_K.block_bytes(),
            DType::Q5_K => KQuant::Q5_K.block_bytes(),
            DType::Q6_K => KQuant::Q6_K.block_bytes(),
        }
    }

    /// Whether this is a block-quantized type.
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes taken by a row of `n` elements; `None` when `n` is not a multiple of the block length or
    /// the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Bytes taken by `n_rows` rows of `row_len` elements (checked).
    pub fn tensor_bytes(self, row_len: usize, n_rows: usize) -> Option<usize> {
        self.row_bytes(row_len)?.checked_mul(n_rows)
    }

    fn check_row(self, elems: usize, got: usize) -> Result<(), DTypeError> {
        if !elems.is_multiple_of(self.block_elems()) {
            return Err(DTypeError::PartialBlock {
                dtype: self,
                elems,
                block: self.block_elems(),
            });
        }
        let expected = self
            .row_bytes(elems)
            .ok_or(DTypeError::Overflow { dtype: self, elems })?;
        if expected != got {
            return Err(DTypeError::Size {
                dtype: self,
                elems,
                expected,
                got,
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Dequantize (or widen) one row: `bytes` must hold exactly `out.len()` elements of `dtype`
/// (`dtype.row_bytes(out.len())` bytes). This is the reference every backend is checked against.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), DTypeError> {
    use crate::format::{float, mxfp4, q4_0, q4_1, q5, q8_0};
    dtype.check_row(out.len(), bytes.len())?;
    match dtype {
        DType::F32 => float::dequantize(float::Bits::F32, bytes, out),
        DType::F16 => float::dequantize(float::Bits::F16, bytes, out),
        DType::BF16 => float::dequantize(float::Bits::BF16, bytes, out),
        DType::Q4_0 => q4_0::dequantize(bytes, out),
        DType::Q4_1 => q4_1::dequantize(bytes, out),
        DType::Q5_0 => q5::dequantize(false, bytes, out),
        DType::Q5_1 => q5::dequantize(true, bytes, out),
        DType::Q8_0 => q8_0::dequantize(bytes, out),
        DType::MXFP4 => mxfp4::dequantize(bytes, out),
        DType::IQ4_NL => crate::format::iq4::dequantize_nl(bytes, out),
        DType::IQ4_XS => crate::format::iq4::dequantize_xs(bytes, out),
        DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            let k = dtype.kquant().expect("a K-quant type");
            k.dequantize(bytes, out).expect("row size checked above");
        }
        DType::F8_E4M3 => {
            // the e4m3 values; the row's scale is a tensor of its own (crate::fp8)
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = crate::fp8::e4m3_to_f32(b);
            }
        }
    }
    Ok(())
}

/// Quantize (or narrow) one row of f32 into `dtype`: `out` must be `dtype.row_bytes(src.len())`
/// bytes. The block types follow ggml's reference quantizers (`quantize_row_*_ref`): Q4_0 scales by
/// the largest-magnitude element (d = max / -8), Q4_1 spans [min, max] in 15 steps (d = (max - min)
/// / 15, m = min), Q8_0 scales by the largest magnitude (d = amax / 127); d and m are stored as f16 and
/// each element takes the nearest level; the K-quants take `kquant::quantize` (the project's own,
/// simpler than ggml's). [`dequantize_row`] is its inverse up to that rounding.
pub fn quantize_row(dtype: DType, src: &[f32], out: &mut [u8]) -> Result<(), DTypeError> {
    use crate::format::{float, mxfp4, q4_0, q4_1, q5, q8_0};
    dtype.check_row(src.len(), out.len())?;
    match dtype {
        DType::F32 => float::quantize(float::Bits::F32, src, out),
        DType::F16 => float::quantize(float::Bits::F16, src, out),
        DType::BF16 => float::quantize(float::Bits::BF16, src, out),
        DType::Q4_0 => q4_0::quantize(src, out),
        DType::Q4_1 => q4_1::quantize(src, out),
        DType::Q5_0 => q5::quantize(false, src, out),
        DType::Q5_1 => q5::quantize(true, src, out),
        DType::Q8_0 => q8_0::quantize(src, out),
        DType::MXFP4 => mxfp4::quantize(src, out),
        DType::Q2_K | DType::Q3_K | DType::IQ4_NL | DType::IQ4_XS => {
            return Err(DTypeError::NoQuantizer { dtype })
        }
        DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            let k = dtype.kquant().expect("a K-quant type");
            crate::kquant::quantize(k, src, out).expect("row size checked above");
        }
        DType::F8_E4M3 => {
            // unit scale: the values themselves, rounded and saturated (crate::fp8 scales rows)
            for (o, &v) in out.iter_mut().zip(src) {
                *o = crate::fp8::f32_to_e4m3(v);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[allow(unused_imports)]
    use half::{bf16, f16};

    #[test]
    fn f16_conversion_matches_half_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            assert!(
                want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                "{h:#x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn bf16_conversion_matches_half() {
        for h in (0..=u16::MAX).step_by(7) {
            let want = half::bf16::from_bits(h).to_f32();
            let got = bf16_to_f32(h);
            assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()));
        }
    }

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn ids_round_trip_and_geometry() {
        for d in DType::GGUF {
            assert_eq!(DType::from_ggml(d.ggml_id().unwrap()), Some(d));
        }
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::F8_E4M3.ggml_id(), None);
        assert_eq!(DType::from_ggml(9), None); // Q8_1: not supported
        assert_eq!(
            (DType::Q5_0.block_bytes(), DType::Q5_1.block_bytes()),
            (22, 24)
        );
        for (d, id, bytes) in [
            (DType::Q4_K, 12, 144),
            (DType::Q5_K, 13, 176),
            (DType::Q6_K, 14, 210),
        ] {
            assert_eq!(
                (d.ggml_id(), d.block_elems(), d.block_bytes()),
                (Some(id), 256, bytes)
            );
            assert_eq!(d.row_bytes(4096), Some(16 * bytes));
            assert_eq!(d.row_bytes(4000), None, "{d}: rows are whole super-blocks");
        }
        assert_eq!(DType::from_ggml(u32::MAX), None);
        assert_eq!(
            (DType::Q4_0.block_elems(), DType::Q4_0.block_bytes()),
            (32, 18)
        );
        assert_eq!(
            (DType::Q4_1.block_elems(), DType::Q4_1.block_bytes()),
            (32, 20)
        );
        assert_eq!(
            (DType::Q8_0.block_elems(), DType::Q8_0.block_bytes()),
            (32, 34)
        );
        assert_eq!(DType::Q4_1.row_bytes(576), Some(18 * 20));
        assert_eq!(DType::Q4_1.row_bytes(33), None);
        assert_eq!(DType::F32.row_bytes(usize::MAX), None);
        assert_eq!(DType::BF16.row_bytes(3), Some(6));
        assert_eq!(DType::Q8_0.tensor_bytes(64, usize::MAX), None);
    }

    #[test]
    fn q4_0_hand_block() {
        // d = 0.5; byte j = (low = j % 16, high = 15 - j % 16)
        let mut b = Vec::from(h(0.5));
        for j in 0..16u8 {
            b.push((j & 0x0f) | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        dequantize_row(DType::Q4_0, &b, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5, "element {j}");
            assert_eq!(
                out[j + 16],
                ((15 - j) as f32 - 8.0) * 0.5,
                "element {}",
                j + 16
            );
        }
        // by hand: element 0 = (0-8)*0.5 = -4, element 16 = (15-8)*0.5 = 3.5, element 31 = (0-8)*.5
        assert_eq!((out[0], out[16], out[31]), (-4.0, 3.5, -4.0));
    }

    #[test]
    fn q4_1_hand_block() {
        // d = 0.25, m = -1.0; byte 0 = 0x3A: element 0 = 10*0.25-1 = 1.5, element 16 = 3*0.25-1 = -0.25
        let mut b = Vec::from(h(0.25));
        b.extend_from_slice(&h(-1.0));
        b.push(0x3A);
        b.extend(std::iter::repeat_n(0xF0u8, 15)); // low 0 -> -1.0, high 15 -> 2.75
        let mut out = [0f32; 32];
        dequantize_row(DType::Q4_1, &b, &mut out).unwrap();
        assert_eq!(out[0], 1.5);
        assert_eq!(out[16], -0.25);
        for j in 1..16 {
            assert_eq!(out[j], -1.0);
            assert_eq!(out[j + 16], 2.75);
        }
    }

    #[test]
    fn q8_0_hand_block_two_blocks() {
        let mut b = Vec::new();
        for (d, base) in [(0.125f32, 0i32), (2.0, -16)] {
            b.extend_from_slice(&h(d));
            for j in 0..32 {
                b.push(((base + j) as i8) as u8);
            }
        }
        let mut out = [0f32; 64];
        dequantize_row(DType::Q8_0, &b, &mut out).unwrap();
        assert_eq!(out[0], 0.0);
        assert_eq!(out[31], 31.0 * 0.125);
        assert_eq!(out[32], -32.0); // -16 * 2
        assert_eq!(out[63], 30.0); // 15 * 2
    }

    #[test]
    fn float_types() {
        let vals = [1.0f32, -2.5, 0.0, 65504.0];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect();
        // bf16 of 1.0 is 0x3F80, of -2.5 is 0xC020
        let bf16b = [0x80, 0x3F, 0x20, 0xC0, 0, 0, 0x80, 0x47];
        let mut out = [0f32; 4];
        dequantize_row(DType::F32, &f32b, &mut out).unwrap();
        assert_eq!(out, vals);
        dequantize_row(DType::F16, &f16b, &mut out).unwrap();
        assert_eq!(out, vals);
        dequantize_row(DType::BF16, &bf16b, &mut out).unwrap();
        assert_eq!(out, [1.0, -2.5, 0.0, 65536.0]);
    }

    /// The quantizers against the reference dequantiser: every element comes back within half a
    /// quantisation step (plus the f16 rounding of d and m), and a row made of exact levels comes
    /// back bit for bit.
    #[test]
    fn quantize_round_trips_through_dequantize() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let src: Vec<f32> = (0..256)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * if i % 64 < 32 { 3.0 } else { 0.01 }
            })
            .collect();
        for dtype in DType::ALL {
            let mut q = vec![0u8; dtype.row_bytes(src.len()).unwrap()];
            if matches!(
                dtype,
                DType::Q2_K | DType::Q3_K | DType::IQ4_NL | DType::IQ4_XS
            ) {
                // read only: refused by name (gguf_quants_golden.rs checks their reading)
                let e = quantize_row(dtype, &src, &mut q).unwrap_err();
                assert!(e.to_string().contains("llama-quantize"), "{e}");
                continue;
            }
            if dtype.kquant().is_some() {
                // super-blocks with shared scales: kquant's own round-trip test bounds them
                quantize_row(dtype, &src, &mut q).unwrap();
                continue;
            }
            quantize_row(dtype, &src, &mut q).unwrap();
            let mut back = vec![0f32; src.len()];
            dequantize_row(dtype, &q, &mut back).unwrap();
            for (blk, (s, b)) in src.chunks(QK).zip(back.chunks(QK)).enumerate() {
                let lo = s.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let amax = lo.abs().max(hi.abs());
                let tol = match dtype {
                    DType::F32 => 0.0,
                    DType::F16 => amax * 2f32.powi(-11),
                    DType::BF16 => amax * 2f32.powi(-8),
                    // half a level, plus the f16 rounding of d (x15 or x127) and of m; Q4_0's
                    // levels reach -8d on the side of the largest magnitude but only 7d on the
                    // other, so an element there may clamp a whole level away
                    DType::Q4_0 => amax / 8.0 * (1.0 + 16.0 * 2f32.powi(-11)),
                    DType::Q4_1 => {
                        (hi - lo) / 15.0 * (0.5 + 16.0 * 2f32.powi(-11)) + amax * 2f32.powi(-11)
                    }
                    DType::Q8_0 => amax / 127.0 * (0.5 + 128.0 * 2f32.powi(-11)),
                    // as Q4_0 / Q4_1 with twice the levels
                    DType::Q5_0 => amax / 16.0 * (1.0 + 32.0 * 2f32.powi(-11)),
                    DType::Q5_1 => {
                        (hi - lo) / 31.0 * (0.5 + 32.0 * 2f32.powi(-11)) + amax * 2f32.powi(-11)
                    }
                    // the largest magnitude in [2^k, 2^(k+1)) and the scale 2^(k-2): levels up
                    // to 6 x 2^(k-2), so an element past it clamps by up to 2^(k-1) <= amax / 2,
                    // and below it half the widest step (2 x 2^(k-2)) is 2^(k-2) <= amax / 4
                    DType::MXFP4 => amax / 2.0,
                    DType::Q2_K
                    | DType::Q3_K
                    | DType::Q4_K
                    | DType::Q5_K
                    | DType::Q6_K
                    | DType::IQ4_NL
                    | DType::IQ4_XS => unreachable!("skipped above"),
                    // 3 mantissa bits: half a step is at most 2^-4 of the value, or half a
                    // subnormal step (2^-10) below 2^-6
                    DType::F8_E4M3 => (amax / 16.0).max(2f32.powi(-10)),
                };
                for (j, (a, b)) in s.iter().zip(b).enumerate() {
                    assert!(
                        (a - b).abs() <= tol,
                        "{dtype} block {blk} element {j}: {a} -> {b} (tol {tol})"
                    );
                }
            }
            // re-quantizing the dequantized row is exact: its elements sit on the levels
            let mut q2 = vec![0u8; q.len()];
            quantize_row(dtype, &back, &mut q2).unwrap();
            let mut back2 = vec![0f32; src.len()];
            dequantize_row(dtype, &q2, &mut back2).unwrap();
            if dtype != DType::Q4_0 {
                assert_eq!(back, back2, "{dtype}: levels are a fixed point");
            }
        }
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        for h in (0..=u16::MAX).step_by(3) {
            let v = bf16_to_f32(h);
            if !v.is_nan() {
                assert_eq!(f32_to_bf16(v), h);
            }
        }
        // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0)
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        assert_eq!(half::bf16::from_f32(0.1).to_bits(), f32_to_bf16(0.1));
    }

    #[test]
    fn size_errors() {
        let mut out = [0f32; 32];
        assert_eq!(
            dequantize_row(DType::Q4_1, &[0u8; 19], &mut out),
            Err(DTypeError::Size {
                dtype: DType::Q4_1,
                elems: 32,
                expected: 20,
                got: 19
            })
        );
        let mut out = [0f32; 31];
        assert!(matches!(
            dequantize_row(DType::Q8_0, &[0u8; 34], &mut out),
            Err(DTypeError::PartialBlock { .. })
        ));
    }
}
