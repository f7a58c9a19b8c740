//! The K-quant reference dequantisation (`metrale_core::kquant`) against gguf-py's on the same
//! blocks (tests/golden/kquant_golden.bin, made by tests/golden/make_kquant_golden.py: random bytes,
//! every packed field's bit patterns). Both compute w = (d * scale) * q - dmin * min in f32 (Q6_K:
//! (d * scale) * q), so the values must agree exactly; a 1-ulp difference would mean the order of
//! operations differs, and is reported with the element.

use metrale_core::kquant::{KQuant, QK_K};

#[test]
fn kquants_dequantize_as_gguf_py_does() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/kquant_golden.bin");
    let data = std::fs::read(&path).unwrap();
    let u32_at = |at: usize| u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
    let mut at = 0;
    let mut seen = Vec::new();
    while at < data.len() {
        let (ty, blocks) = (u32_at(at), u32_at(at + 4) as usize);
        at += 8;
        let q = [KQuant::Q4_K, KQuant::Q5_K, KQuant::Q6_K]
            .into_iter()
            .find(|q| q.ggml_type() == ty)
            .unwrap_or_else(|| panic!("ggml type {ty} in the golden"));
        let nb = blocks * q.block_bytes();
        let bytes = &data[at..at + nb];
        at += nb;
        let want: Vec<f32> = data[at..at + blocks * QK_K * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        at += blocks * QK_K * 4;
        let mut got = vec![0f32; blocks * QK_K];
        q.dequantize(bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits(),
                "{q:?} block {} element {}: {g} against gguf-py's {w}",
                i / QK_K,
                i % QK_K
            );
        }
        seen.push(q);
    }
    assert_eq!(seen, [KQuant::Q4_K, KQuant::Q5_K, KQuant::Q6_K]);
}
