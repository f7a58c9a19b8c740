//! Tests against the real default model (SmolLM2-135M-Instruct Q4_1 GGUF). They read its path from
//! METRALE_MODEL and skip (pass, printing why) when it is unset. The expected numbers are the ones
//! listed in docs/facts.md, "The default model".

use metrale_core::dtype::DType;
use metrale_model::{ChatMessage, Format, Model};
use std::path::PathBuf;

fn model_path() -> Option<PathBuf> {
    match std::env::var_os("METRALE_MODEL") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            eprintln!(
                "skipped: METRALE_MODEL is not set (path of SmolLM2-135M-Instruct.Q4_1.gguf)"
            );
            None
        }
    }
}

#[test]
fn config_and_weights_match_reference() {
    let Some(p) = model_path() else { return };
    let t0 = std::time::Instant::now();
    let m = Model::load(&p).unwrap();
    eprintln!("load took {:?}", t0.elapsed());
    let c = &m.config;
    assert_eq!(m.format, Format::Gguf);
    assert_eq!((c.arch.as_str(), c.model_type.as_str()), ("llama", "llama"));
    assert_eq!(
        (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((c.ffn, c.vocab, c.max_context), (1536, 49152, 8192));
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.norm_eps, 1e-5);
    assert!(c.tied_embeddings);
    assert_eq!(c.rope_scaling, None);
    assert_eq!(
        (c.bos, c.eos.as_slice(), c.add_bos),
        (Some(1), &[2u32][..], false)
    );
    let count = |d: DType| {
        m.weights
            .names()
            .filter(|n| m.weights.get(n).unwrap().dtype == d)
            .count()
    };
    assert_eq!(count(DType::Q4_1), 210);
    assert_eq!(count(DType::F32), 61);
    assert_eq!(
        m.weights.get("token_embd.weight").unwrap().dtype,
        DType::Q8_0
    );
    assert_eq!(
        m.weights.get("token_embd.weight").unwrap().shape,
        vec![576, 49152]
    );
    assert_eq!(m.weights.len(), 272);
    assert!(m.weights.get("output.weight").is_err());
    assert_eq!(m.weights.owned_bytes(), 0);
    let q = m.weights.get("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.row_len(), q.n_rows()), (576, 576));
    let err = m
        .weights
        .get("blk.30.attn_q.weight")
        .unwrap_err()
        .to_string();
    assert!(err.contains("blk.30.attn_q.weight"), "{err}");
    eprintln!("weights: {} bytes", m.weights.total_bytes());
    assert!(m.weights.total_bytes() > 90_000_000 && m.weights.total_bytes() < 98_362_432);
    // every row of a norm and of a quantized matrix dequantizes to finite numbers
    let norm = m.weights.get("blk.0.attn_norm.weight").unwrap().to_f32();
    assert!(norm.iter().all(|x| x.is_finite()) && norm.iter().any(|&x| x != 0.0));
    let mut row = vec![0f32; 576];
    q.dequantize_row(575, &mut row).unwrap();
    assert!(row.iter().all(|x| x.is_finite()));
}

#[test]
fn tokenizer_specials() {
    let Some(p) = model_path() else { return };
    let m = Model::load(&p).unwrap();
    let t = &m.tokenizer;
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_to_id("<|im_end|>"), Some(2));
    assert!(t.is_special(1) && t.is_special(2) && !t.is_special(100));
    let ids = t.encode("<|im_start|>user", false, true).unwrap();
    assert_eq!(ids[0], 1);
    let plain = t.encode("<|im_start|>user", false, false).unwrap();
    assert!(
        !plain.contains(&1),
        "parse_special=false must tokenize the markup as text: {plain:?}"
    );
    assert_eq!(t.decode(&plain, false), "<|im_start|>user");
    assert_eq!(t.decode(&ids, false), "<|im_start|>user");
    assert_eq!(t.decode(&ids, true), "user");
    assert_eq!(t.encode("hi", true, false).unwrap()[0], 1);
    // a multi-byte character split across byte tokens: token_bytes concatenate to the UTF-8
    let e = t.encode("🦀", false, false).unwrap();
    let bytes: Vec<u8> = e.iter().flat_map(|&i| t.token_bytes(i)).collect();
    assert_eq!(bytes, "🦀".as_bytes());
}

#[test]
fn chat_template_renders() {
    let Some(p) = model_path() else { return };
    let m = Model::load(&p).unwrap();
    let tpl = m.require_chat_template().unwrap();
    let s = tpl
        .render(
            &[ChatMessage::new(
                "user",
                "What is the capital of France? Answer in one sentence.",
            )],
            true,
        )
        .unwrap();
    eprintln!("{s:?}");
    assert!(s.ends_with("<|im_start|>assistant\n"));
}

#[test]
fn truncated_real_file_is_always_an_error() {
    let Some(p) = model_path() else { return };
    let bytes = std::fs::read(&p).unwrap();
    let path = std::path::Path::new("truncated.gguf");
    let full = metrale_model::gguf::parse_header(&bytes, path).unwrap();
    let header_end = full.data_offset;
    // every byte of the fixed header and the first metadata, then ~600 cuts spread over the rest of the
    // header (tokens, merges, tensor infos) and the data section
    let mut cuts: Vec<usize> = (0..512).collect();
    cuts.extend((0..400).map(|i| 512 + i * (header_end - 512) / 400));
    cuts.extend((0..200).map(|i| header_end + i * (bytes.len() - header_end) / 200));
    cuts.push(bytes.len() - 1);
    for n in cuts {
        let r = std::panic::catch_unwind(|| {
            metrale_model::gguf::parse_header(&bytes[..n], path).map(|_| ())
        })
        .unwrap_or_else(|_| panic!("panic on a cut at {n}"));
        let e = r
            .expect_err(&format!("a cut at {n} of {} parsed", bytes.len()))
            .to_string();
        assert!(e.contains("truncated.gguf"), "{e}");
    }
    // and two real truncated files through Model::load
    let dir = tempfile::tempdir().unwrap();
    for n in [header_end / 2, bytes.len() - 4096] {
        let q = dir.path().join("cut.gguf");
        std::fs::write(&q, &bytes[..n]).unwrap();
        let e = Model::load(&q).unwrap_err().to_string();
        eprintln!("cut at {n}: {e}");
        assert!(e.contains("cut.gguf"), "{e}");
    }
}

/// Our reference dequantisation against gguf-py's (tests/golden/dequant_gguf_py.json, made by
/// tests/golden/make_dequant_golden.py): first 64 values within 1e-6 (relative), row sums within 1e-5.
#[test]
fn dequantize_equals_gguf_py() {
    let Some(p) = model_path() else { return };
    let m = Model::load(&p).unwrap();
    let g: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/golden/dequant_gguf_py.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let rows = g["rows"].as_array().unwrap();
    assert!(rows.len() >= 10);
    for r in rows {
        let name = r["tensor"].as_str().unwrap();
        let row = r["row"].as_u64().unwrap() as usize;
        let t = m.weights.get(name).unwrap();
        assert_eq!(
            t.dtype.name().to_uppercase(),
            r["type"].as_str().unwrap(),
            "{name}"
        );
        let mut out = vec![0f32; t.row_len()];
        assert_eq!(out.len() as u64, r["row_len"].as_u64().unwrap());
        t.dequantize_row(row, &mut out).unwrap();
        for (i, want) in r["first64"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap() as f32;
            assert!(
                (out[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{name} row {row} [{i}]: {} vs {want}",
                out[i]
            );
        }
        let sum: f64 = out.iter().map(|&x| x as f64).sum();
        let sumsq: f64 = out.iter().map(|&x| (x as f64) * (x as f64)).sum();
        let (ws, wq) = (r["sum"].as_f64().unwrap(), r["sumsq"].as_f64().unwrap());
        assert!(
            (sum - ws).abs() <= 1e-5 * ws.abs().max(1.0),
            "{name} row {row} sum {sum} vs {ws}"
        );
        assert!(
            (sumsq - wq).abs() <= 1e-5 * wq.abs().max(1.0),
            "{name} row {row} sumsq {sumsq} vs {wq}"
        );
    }
}
