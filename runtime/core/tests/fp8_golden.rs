//! The e4m3 codec (`metrale_core::fp8`) against torch's `float8_e4m3fn` (golden
//! tests/golden/fp8_e4m3_golden.json, made by tests/golden/make_fp8_golden.py): every byte's value,
//! and the byte of 9,012 inputs (every tie between neighbouring values and the floats beside it,
//! the subnormals, values past 448, seeded normal draws from 1e-3 to 1e3, both signs). Both are
//! exact operations (a value is a sign, exponent and mantissa; rounding is to nearest even), so
//! they must agree bit for bit.

use metrale_core::fp8::{e4m3_to_f32, f32_to_e4m3};

#[test]
fn e4m3_matches_torch_float8_e4m3fn() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/fp8_e4m3_golden.json");
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let decode = g["decode"].as_array().unwrap();
    assert_eq!(decode.len(), 256);
    for (b, v) in decode.iter().enumerate() {
        let ours = e4m3_to_f32(b as u8);
        match v.as_f64() {
            Some(v) => assert_eq!(ours.to_bits(), (v as f32).to_bits(), "byte {b:#04x}"),
            None => assert!(ours.is_nan(), "byte {b:#04x}: torch reads NaN, ours {ours}"),
        }
    }
    let encode = g["encode"].as_array().unwrap();
    assert!(encode.len() > 9000);
    for e in encode {
        let (bits, byte) = (e[0].as_u64().unwrap() as u32, e[1].as_u64().unwrap() as u8);
        let x = f32::from_bits(bits);
        assert_eq!(f32_to_e4m3(x), byte, "{x:e} ({bits:#010x})");
    }
}
