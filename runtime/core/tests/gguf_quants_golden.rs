//! The reference dequantisation of the GGUF block formats beyond Q4_0 / Q4_1 / Q8_0
//! (`metrale_core::dtype::dequantize_row`: Q5_0, Q5_1, MXFP4, IQ4_NL, IQ4_XS, and
//! `metrale_core::kquant`'s Q2_K to Q6_K) against gguf-py's on the same blocks (tests/golden/gguf_quants_golden.bin, made by
//! tests/golden/make_gguf_quants_golden.py: random bytes, every packed field's bit patterns). Both
//! compute each value with the same operations in f32 (Q5_0: (q - 16) * d; Q5_1: q * d + m; the
//! K-quants: (d * scale) * q - dmin * min, Q3_K and Q6_K (d * scale) * q; IQ4: (d [* scale]) * level;
//! MXFP4: level * 2^(e - 128)), so the values must agree
//! exactly; a 1-ulp difference would mean the order of operations differs, and is reported with the
//! element.

use metrale_core::dtype::{dequantize_row, DType};

#[test]
fn gguf_block_formats_dequantize_as_gguf_py_does() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/gguf_quants_golden.bin");
    let data = std::fs::read(&path).unwrap();
    let u32_at = |at: usize| u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
    let mut at = 0;
    let mut seen = Vec::new();
    while at < data.len() {
        let (ty, blocks) = (u32_at(at), u32_at(at + 4) as usize);
        at += 8;
        let dt = DType::from_ggml(ty).unwrap_or_else(|| panic!("ggml type {ty} in the golden"));
        let (nb, n) = (blocks * dt.block_bytes(), blocks * dt.block_elems());
        let bytes = &data[at..at + nb];
        at += nb;
        let want: Vec<f32> = data[at..at + n * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        at += n * 4;
        let mut got = vec![0f32; n];
        dequantize_row(dt, bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits(),
                "{dt} block {} element {}: {g} against gguf-py's {w}",
                i / dt.block_elems(),
                i % dt.block_elems()
            );
        }
        seen.push(dt);
    }
    assert_eq!(
        seen,
        [
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::Q5_0,
            DType::Q5_1,
            DType::MXFP4,
            DType::Q2_K,
            DType::Q3_K,
            DType::IQ4_NL,
            DType::IQ4_XS
        ]
    );
}

/// MXFP4's quantizer (`metrale_core::format::mxfp4`, what synth-model writes gpt-oss's experts
/// with) against gguf-py's on the same values (tests/golden/gguf_mxfp4_quantize_golden.bin: 64
/// blocks of normal values at scales 1e-3 to 1e3 and a block of zeros): the same bytes, scale
/// and every code (ties to the lower code on both sides).
#[test]
fn mxfp4_quantizes_as_gguf_py_does() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/gguf_mxfp4_quantize_golden.bin");
    let data = std::fs::read(&path).unwrap();
    let n = 65 * 32;
    let x: Vec<f32> = data[..4 * n]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want = &data[4 * n..];
    let mut got = vec![0u8; DType::MXFP4.row_bytes(n).unwrap()];
    metrale_core::dtype::quantize_row(DType::MXFP4, &x, &mut got).unwrap();
    assert_eq!(got.len(), want.len());
    for (b, (g, w)) in got.chunks(17).zip(want.chunks(17)).enumerate() {
        assert_eq!(g, w, "block {b}");
    }
}
