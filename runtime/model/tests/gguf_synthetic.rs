//! GGUF reader tests on small synthetic files written by the test itself: a valid tiny llama, then
//! every kind of malformed file the reader must refuse with an error naming the file and the field
//! (never a panic, never a huge allocation), then a truncate-everywhere and a byte-flip sweep.

mod common;
use common::*;
use metrale_core::dtype::DType;
use metrale_model::{gguf, ChatMessage, Model, ModelError};
use std::path::Path;

fn load_err(g: &Gguf, name: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = g.write(dir.path(), name);
    let e = Model::load(&p).expect_err("a malformed file must be refused");
    let s = e.to_string();
    assert!(s.contains(name), "error does not name the file: {s}");
    s
}

#[test]
fn valid_tiny_model_loads() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny_llama().write(dir.path(), "tiny.gguf");
    let m = Model::load(&p).unwrap();
    let c = &m.config;
    assert_eq!(
        (
            c.n_layers,
            c.hidden,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.ffn
        ),
        (2, 64, 2, 1, 32, 128)
    );
    assert_eq!(
        (c.vocab, c.max_context, c.rope_theta, c.norm_eps),
        (3 + 256 + 7, 256, 100000.0, 1e-5)
    );
    assert_eq!(
        (
            c.name.as_str(),
            c.tied_embeddings,
            c.bos,
            c.eos.clone(),
            c.add_bos
        ),
        ("tiny", true, Some(1), vec![2], false)
    );
    assert_eq!(m.weights.len(), 2 + 9 * 2);
    let q = m.weights.get("blk.1.attn_q.weight").unwrap();
    assert_eq!(
        (q.dtype, q.shape.clone(), q.data.len()),
        (DType::Q4_1, vec![64, 64], 64 * 2 * 20)
    );
    // tokenizer: merges apply; smollm splits digits one by one (no "123" token from "1 2", "12 3")
    let t = &m.tokenizer;
    let hello = t.token_to_id("hello").unwrap();
    assert_eq!(t.encode("hello", false, false).unwrap(), vec![hello]);
    let one = t.token_to_id("1").unwrap();
    assert_eq!(
        t.encode("123", false, false).unwrap(),
        vec![one, one + 1, one + 2]
    );
    assert_eq!(t.encode("<|im_end|>", false, true).unwrap(), vec![2]);
    assert_eq!(
        t.encode("<|im_end|>", false, false).unwrap().len(),
        "<|im_end|>".len()
    );
    // chat template with a Python string method (pycompat)
    let s = m
        .chat_template
        .as_ref()
        .unwrap()
        .render(&[ChatMessage::new("user", "  hi  ")], true)
        .unwrap();
    assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    // the same bytes from memory (what the fuzz targets use) give the same model
    let g = gguf::GgufFile::from_bytes(&tiny_llama().bytes(), Path::new("mem.gguf")).unwrap();
    let m2 = Model::from_gguf(g).unwrap();
    assert_eq!(m2.config, m.config);
    assert_eq!(m2.weights.len(), m.weights.len());
    let (a, b) = (
        m.weights.get("blk.1.attn_q.weight").unwrap(),
        m2.weights.get("blk.1.attn_q.weight").unwrap(),
    );
    assert_eq!(a.data, b.data);
}

#[test]
fn pre_tokenizers_gpt2_llama3_and_qwen2() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = tiny_llama();
    g.kv("tokenizer.ggml.pre", V::Str("gpt2".into()));
    let m = Model::load(&g.write(dir.path(), "gpt2.gguf")).unwrap();
    let t = &m.tokenizer;
    let id123 = t.token_to_id("123").unwrap();
    // GPT-2 keeps digit runs together: merges "1 2" and "12 3" give one token
    assert_eq!(t.encode("123", false, false).unwrap(), vec![id123]);
    g.kv("tokenizer.ggml.pre", V::Str("llama-bpe".into()));
    let m = Model::load(&g.write(dir.path(), "llama3.gguf")).unwrap();
    let t = &m.tokenizer;
    let four = t.token_to_id("4").unwrap();
    // llama3 splits digits in groups of three: "12345" -> "123" "45"
    assert_eq!(
        t.encode("12345", false, false).unwrap(),
        vec![id123, four, four + 1]
    );
    // llama3's default add_bos is true, but the file's explicit flag (false) wins
    assert!(!m.config.add_bos);
    g.remove_kv("tokenizer.ggml.add_bos_token");
    let m = Model::load(&g.write(dir.path(), "llama3b.gguf")).unwrap();
    assert!(m.config.add_bos);
    assert_eq!(
        m.tokenizer
            .encode("hello", m.config.add_bos, false)
            .unwrap()[0],
        1
    );
    // qwen2 (Qwen2/2.5/3 GGUFs): every digit alone, no BOS by default
    g.kv("tokenizer.ggml.pre", V::Str("qwen2".into()));
    let m = Model::load(&g.write(dir.path(), "qwen2.gguf")).unwrap();
    let t = &m.tokenizer;
    let one = t.token_to_id("1").unwrap();
    assert_eq!(
        t.encode("12345", false, false).unwrap(),
        vec![one, one + 1, one + 2, four, four + 1]
    );
    assert!(!m.config.add_bos);
    // words as llama3 splits them
    assert_eq!(
        t.encode("hello", false, false).unwrap(),
        vec![t.token_to_id("hello").unwrap()]
    );
    // other names llama.cpp gives these pre-tokenizers: the same splits (and llama3's BOS)
    for (alias, canonical) in [
        ("deepseek-r1-qwen", "qwen2"),
        ("falcon3", "llama-bpe"),
        ("phi-2", "gpt2"),
    ] {
        let mut enc = |pre: &str| {
            g.kv("tokenizer.ggml.pre", V::Str(pre.into()));
            let m = Model::load(&g.write(dir.path(), &format!("{pre}.gguf"))).unwrap();
            let ids = m.tokenizer.encode("x 12345 hello", false, false).unwrap();
            (ids, m.config.add_bos)
        };
        let (a, c) = (enc(alias), enc(canonical));
        assert_eq!(a, c, "{alias} as {canonical}");
    }
}

#[test]
fn unknown_pre_tokenizer_is_refused_by_name() {
    let mut g = tiny_llama();
    g.kv("tokenizer.ggml.pre", V::Str("deepseek-v3".into()));
    let e = load_err(&g, "pre.gguf");
    assert!(
        e.contains("deepseek-v3")
            && e.contains("smollm")
            && e.contains("qwen2")
            && e.contains("tokenizer.ggml.pre"),
        "{e}"
    );
    g.remove_kv("tokenizer.ggml.pre");
    let e = load_err(&g, "nopre.gguf");
    assert!(e.contains("default") && e.contains("smollm"), "{e}");
}

#[test]
fn other_architectures_are_refused() {
    let mut g = tiny_llama();
    g.kv("general.architecture", V::Str("gemma4".into()));
    let e = load_err(&g, "arch.gguf");
    assert!(
        e.contains("gemma4") && e.contains("llama") && e.contains("phi3"),
        "{e}"
    );
}

/// LongRoPE (Phi-3's 128k variants, Phi-3.5, Phi-4-mini): both factor lists or neither; the
/// lists one positive factor per rotated pair; the pretraining context given. Each malformed file
/// is refused by name rather than run with the wrong rotation (the well-formed case is
/// tests/tests/synth_model.rs's, against HF transformers).
#[test]
fn malformed_longrope_is_refused_by_name() {
    let half = common::HEAD_DIM / 2;
    let factors = |name: &str, n: usize, v: f32| common::T {
        name: name.into(),
        dims: vec![n as u64],
        ggml_type: 0,
        data: (0..n).flat_map(|_| v.to_le_bytes()).collect(),
        offset: None,
    };
    let mut g = tiny_llama();
    g.tensors
        .push(factors("rope_factors_long.weight", half, 1.0));
    let e = load_err(&g, "longrope.gguf");
    assert!(
        e.contains("rope_factors_short") && e.contains("LongRoPE"),
        "{e}"
    );
    g.tensors
        .push(factors("rope_factors_short.weight", half, 1.0));
    let e = load_err(&g, "longrope.gguf");
    assert!(e.contains("original_context_length"), "{e}");
    g.kv(
        "llama.rope.scaling.original_context_length",
        common::V::U32(64),
    );
    g.tensors.pop();
    g.tensors
        .push(factors("rope_factors_short.weight", half - 1, 1.0));
    let e = load_err(&g, "longrope.gguf");
    assert!(
        e.contains("rope_factors_short") && e.contains("positive float factors"),
        "{e}"
    );
    g.tensors.pop();
    g.tensors
        .push(factors("rope_factors_short.weight", half, -1.0));
    let e = load_err(&g, "longrope.gguf");
    assert!(
        e.contains("rope_factors_short") && e.contains("positive float factors"),
        "{e}"
    );
}

#[test]
fn bad_magic_version_and_counts() {
    let good = tiny_llama().bytes();
    let dir = tempfile::tempdir().unwrap();
    let check = |bytes: Vec<u8>, name: &str, want: &[&str]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = Model::load(&p).unwrap_err().to_string();
        assert!(e.contains(name), "{e}");
        for w in want {
            assert!(e.contains(w), "expected {w:?} in: {e}");
        }
    };
    let mut b = good.clone();
    b[0..4].copy_from_slice(b"GGML");
    check(b, "magic.gguf", &["magic", "GGUF"]);
    let mut b = good.clone();
    b[4..8].copy_from_slice(&4u32.to_le_bytes());
    check(b, "version.gguf", &["version", "2 or 3", "got 4"]);
    let mut b = good.clone();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    check(b, "bigendian.gguf", &["big-endian"]);
    let mut b = good.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    check(b, "tcount.gguf", &["tensor_count", "absurd"]);
    let mut b = good.clone();
    b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    check(b, "kvcount.gguf", &["metadata_kv_count", "absurd"]);
    // first key's string length
    let mut b = good.clone();
    b[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    check(b, "strlen.gguf", &["metadata key #0", "absurd"]);
    check(Vec::new(), "empty.gguf", &["magic", "truncated"]);
    check(b"GGUF".to_vec(), "four.gguf", &["version", "truncated"]);
}

#[test]
fn absurd_array_count_and_bad_value_type() {
    let g = tiny_llama();
    let good = g.bytes();
    // find the tokens array: key "tokenizer.ggml.tokens", then u32 type 9, u32 elem type 8, u64 count
    let key = b"tokenizer.ggml.tokens";
    let at = good.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    let dir = tempfile::tempdir().unwrap();
    let mut b = good.clone();
    b[at + 8..at + 16].copy_from_slice(&(1u64 << 50).to_le_bytes());
    let p = dir.path().join("arr.gguf");
    std::fs::write(&p, &b).unwrap();
    let e = Model::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("absurd"),
        "{e}"
    );
    let mut b = good.clone();
    b[at..at + 4].copy_from_slice(&77u32.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    let e = Model::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("unknown value type 77"),
        "{e}"
    );
}

#[test]
fn tensor_problems() {
    // data offset past the end
    let mut g = tiny_llama();
    g.tensor("blk.1.ffn_down.weight").offset = Some(1 << 30);
    let e = load_err(&g, "offset.gguf");
    assert!(
        e.contains("blk.1.ffn_down.weight") && e.contains("past the end of the file"),
        "{e}"
    );
    // misaligned offset
    let mut g = tiny_llama();
    g.tensor("blk.0.attn_k.weight").offset = Some(33);
    let e = load_err(&g, "align.gguf");
    assert!(
        e.contains("blk.0.attn_k.weight") && e.contains("alignment"),
        "{e}"
    );
    // unsupported ggml type (IQ2_XXS = 16): the supported ones named
    let mut g = tiny_llama();
    g.tensor("blk.0.ffn_up.weight").ggml_type = 16;
    let e = load_err(&g, "qtype.gguf");
    assert!(
        e.contains("blk.0.ffn_up.weight")
            && e.contains("IQ2_XXS")
            && e.contains("q4_1")
            && e.contains("q6_k"),
        "{e}"
    );
    // a K-quant (Q6_K = 14) row must be whole 256-element super-blocks
    let mut g = tiny_llama();
    let t = g.tensor("blk.0.ffn_up.weight");
    t.ggml_type = 14;
    let e = load_err(&g, "kblock.gguf");
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("256"),
        "{e}"
    );
    // a row that is not whole blocks
    let mut g = tiny_llama();
    g.tensor("blk.0.ffn_up.weight").dims[0] = 63;
    let e = load_err(&g, "rowlen.gguf");
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("block"),
        "{e}"
    );
    // absurd dimension
    let mut g = tiny_llama();
    g.tensor("blk.0.ffn_up.weight").dims[1] = u64::MAX / 2;
    let e = load_err(&g, "dim.gguf");
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("absurd"),
        "{e}"
    );
    // too many dims
    let mut g = tiny_llama();
    g.tensor("output_norm.weight").dims = vec![64, 1, 1, 1, 1];
    let e = load_err(&g, "ndims.gguf");
    assert!(
        e.contains("output_norm.weight") && e.contains("n_dims"),
        "{e}"
    );
    // wrong dtype for a llama tensor: a quantized norm
    let mut g = tiny_llama();
    let t = g.tensor("blk.1.ffn_norm.weight");
    t.ggml_type = 8;
    t.data = vec![0; 2 * 34];
    let e = load_err(&g, "normtype.gguf");
    assert!(
        e.contains("blk.1.ffn_norm.weight") && e.contains("f32"),
        "{e}"
    );
    // wrong shape for a llama tensor
    let mut g = tiny_llama();
    let t = g.tensor("blk.0.attn_k.weight");
    t.dims = vec![64, 64];
    t.data = vec![0; 64 * 2 * 20];
    let e = load_err(&g, "shape.gguf");
    assert!(
        e.contains("blk.0.attn_k.weight") && e.contains("[64, 32]"),
        "{e}"
    );
    // missing tensor
    let mut g = tiny_llama();
    g.tensors.retain(|t| t.name != "blk.1.attn_v.weight");
    let e = load_err(&g, "missing.gguf");
    assert!(
        e.contains("blk.1.attn_v.weight") && e.contains("not found"),
        "{e}"
    );
    // duplicate tensor
    let mut g = tiny_llama();
    let dup = T {
        name: "output_norm.weight".into(),
        dims: vec![64],
        ggml_type: 0,
        data: vec![0; 256],
        offset: None,
    };
    g.tensors.push(dup);
    let e = load_err(&g, "dup.gguf");
    assert!(
        e.contains("output_norm.weight") && e.contains("duplicate"),
        "{e}"
    );
}

#[test]
fn metadata_problems() {
    let mut g = tiny_llama();
    g.remove_kv("llama.block_count");
    let e = load_err(&g, "nolayers.gguf");
    assert!(
        e.contains("llama.block_count") && e.contains("missing"),
        "{e}"
    );
    let mut g = tiny_llama();
    g.kv("llama.block_count", V::Str("two".into()));
    let e = load_err(&g, "strlayers.gguf");
    assert!(
        e.contains("llama.block_count") && e.contains("integer"),
        "{e}"
    );
    let mut g = tiny_llama();
    g.kv("llama.block_count", V::U32(3));
    let e = load_err(&g, "morelayers.gguf");
    assert!(e.contains("blk.2.attn_norm.weight"), "{e}");
    let mut g = tiny_llama();
    g.kv("llama.attention.head_count_kv", V::U32(3));
    let e = load_err(&g, "kvheads.gguf");
    assert!(e.contains("n_kv_heads") && e.contains("divisor"), "{e}");
    let mut g = tiny_llama();
    g.kv("general.alignment", V::U32(24));
    let e = load_err(&g, "alignment.gguf");
    assert!(
        e.contains("general.alignment") && e.contains("power of two"),
        "{e}"
    );
    let mut g = tiny_llama();
    g.kv("tokenizer.ggml.eos_token_id", V::U32(100000));
    let e = load_err(&g, "eos.gguf");
    assert!(e.contains("eos") && e.contains("100000"), "{e}");
    let mut g = tiny_llama();
    g.kv("tokenizer.ggml.token_type", V::I32Arr(vec![1; 5]));
    let e = load_err(&g, "types.gguf");
    assert!(
        e.contains("tokenizer.ggml.token_type") && e.contains("one per token"),
        "{e}"
    );
    let mut g = tiny_llama();
    g.kv("tokenizer.ggml.merges", V::StrArr(vec!["nospace".into()]));
    let e = load_err(&g, "merges.gguf");
    assert!(
        e.contains("tokenizer.ggml.merges") && e.contains("nospace"),
        "{e}"
    );
    let mut g = tiny_llama();
    g.kv("tokenizer.chat_template", V::Str("{% for %}".into()));
    let e = Model::load(&g.write(tempfile::tempdir().unwrap().path(), "tpl.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("chat template") && e.contains("tpl.gguf"), "{e}");
}

fn must_not_panic(bytes: &[u8], what: &str) -> Result<(), ModelError> {
    let r =
        std::panic::catch_unwind(|| gguf::parse_header(bytes, Path::new("sweep.gguf")).map(|_| ()));
    r.unwrap_or_else(|_| panic!("parser panicked on {what}"))
}

#[test]
fn truncated_everywhere_is_an_error() {
    let bytes = tiny_llama().bytes();
    // every prefix of the file: header cuts are field errors, data cuts are "past the end"
    for n in 0..bytes.len() {
        let e = must_not_panic(&bytes[..n], &format!("a cut at {n}"))
            .expect_err("a truncated file parses");
        let s = e.to_string();
        assert!(
            [
                "truncated",
                "past the end",
                "absurd",
                "larger than the whole file"
            ]
            .iter()
            .any(|w| s.contains(w)),
            "cut at {n}: {s}"
        );
    }
    assert!(must_not_panic(&bytes, "the whole file").is_ok());
    // and through Model::load on files, at a stride
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.gguf");
    for n in (0..bytes.len()).step_by(97) {
        std::fs::write(&p, &bytes[..n]).unwrap();
        assert!(Model::load(&p).is_err(), "cut at {n} loaded");
    }
}

#[test]
fn byte_flips_never_panic() {
    let bytes = tiny_llama().bytes();
    let header_end = bytes
        .windows(17)
        .position(|w| w == b"token_embd.weight")
        .unwrap()
        + 200;
    let mut x = 0x2545F4914F6CDD1Du64;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("flip.gguf");
    for i in 0..3000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut b = bytes.clone();
        let pos = (x as usize) % header_end.min(b.len());
        b[pos] ^= (x >> 32) as u8 | 1;
        let _ = must_not_panic(&b, &format!("flip #{i} at {pos}"));
        if i % 50 == 0 {
            std::fs::write(&p, &b).unwrap();
            let _ = std::panic::catch_unwind(|| Model::load(&p).map(|_| ()))
                .unwrap_or_else(|_| panic!("Model::load panicked on flip #{i} at {pos}"));
        }
    }
}

#[test]
fn absurd_config_counts_are_errors_not_allocations() {
    for (key, v, want) in [
        (
            // refused before a per-layer list (sliding-window flags) is sized from it
            "llama.block_count",
            u32::MAX,
            "llama.block_count: expected at most 4096 layers",
        ),
        (
            "llama.attention.head_count",
            u32::MAX,
            "llama.attention.head_count: expected a divisor",
        ),
        (
            "llama.embedding_length",
            u32::MAX,
            "a divisor of the hidden size (4294967295)",
        ),
        (
            "llama.feed_forward_length",
            u32::MAX,
            "'blk.0.ffn_gate.weight' shape",
        ),
        (
            "llama.context_length",
            0,
            "llama.context_length: expected a positive integer",
        ),
    ] {
        let mut g = tiny_llama();
        g.kv(key, V::U32(v));
        let e = load_err(&g, "absurd.gguf");
        assert!(e.contains(want), "{key}={v}: {e}");
    }
}

#[test]
fn every_supported_tensor_type_loads() {
    // attn_v Q4_0, attn_output F16, ffn_up BF16, ffn_gate F32, ffn_norm F16 (a float norm is fine)
    let mut g = tiny_llama();
    for (name, ty, elem_bytes_per_32) in [
        ("blk.0.attn_v.weight", 2u32, 18usize),
        ("blk.0.attn_output.weight", 1, 64),
        ("blk.0.ffn_up.weight", 30, 64),
        ("blk.0.ffn_gate.weight", 0, 128),
        ("blk.0.ffn_norm.weight", 1, 64),
    ] {
        let t = g.tensor(name);
        let n: u64 = t.dims.iter().product();
        t.ggml_type = ty;
        t.data = (0..(n as usize / 32 * elem_bytes_per_32))
            .map(|i| (i % 7) as u8)
            .collect();
    }
    let dir = tempfile::tempdir().unwrap();
    let m = Model::load(&g.write(dir.path(), "types.gguf")).unwrap();
    let ty = |n: &str| m.weights.get(n).unwrap().dtype;
    assert_eq!(ty("blk.0.attn_v.weight"), DType::Q4_0);
    assert_eq!(ty("blk.0.attn_output.weight"), DType::F16);
    assert_eq!(ty("blk.0.ffn_up.weight"), DType::BF16);
    assert_eq!(ty("blk.0.ffn_gate.weight"), DType::F32);
    assert_eq!(ty("blk.0.ffn_norm.weight"), DType::F16);
    for n in m.weights.names() {
        let t = m.weights.get(n).unwrap();
        assert_eq!(t.to_f32().len(), t.n_elems(), "{n}");
    }
}

#[test]
fn pooling_type_is_read_as_llama_cpp_numbers_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = tiny_llama();
    let m = Model::load(&g.write(dir.path(), "none.gguf")).unwrap();
    assert_eq!(m.config.pooling, None);
    for (v, name) in [
        (0, "none"),
        (1, "mean"),
        (2, "cls"),
        (3, "last"),
        (4, "rank"),
        (9, "unknown"),
    ] {
        g.kv("llama.pooling_type", V::U32(v));
        let m = Model::load(&g.write(dir.path(), &format!("p{v}.gguf"))).unwrap();
        assert_eq!(m.config.pooling.as_deref(), Some(name), "pooling_type {v}");
    }
}
