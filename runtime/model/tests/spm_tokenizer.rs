//! SentencePiece vocabularies from GGUF (`tokenizer.ggml.model = "llama"`, what Llama 2, Mistral
//! and Gemma GGUFs carry) against Google's `sentencepiece` on the same vocabularies:
//! tests/golden/spm/ (the two vocabularies, trained and written there by make_spm_golden.py with
//! the space prefix, as Llama's, and without, as Gemma's) holds the reference's ids for 15
//! strings: spaces leading, trailing and doubled, newlines and tabs (byte fallback), accents,
//! emoji and CJK outside the vocabulary, the empty string. Ids must be equal, and decoding them
//! must give the string back.

use metrale_model::gguf::GgufFile;
use metrale_model::Tokenizer;
use std::path::Path;

fn golden() -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/spm/spm_golden.json");
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

fn check(name: &str) {
    let g = golden();
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/golden/spm/{name}.gguf"));
    let f = GgufFile::open(&path).unwrap();
    let tk = Tokenizer::from_gguf(&f, Some(1), vec![2], true).unwrap();
    let strings = g["strings"].as_array().unwrap();
    let want = g[name].as_array().unwrap();
    for (s, w) in strings.iter().zip(want) {
        let s = s.as_str().unwrap();
        let w: Vec<u32> = w
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tk.encode(s, false, false).unwrap();
        assert_eq!(got, w, "{name}: {s:?}");
        assert_eq!(tk.decode(&got, false), s, "{name}: {s:?} decoded");
    }
    // BOS where asked
    assert_eq!(tk.encode("a", true, false).unwrap()[0], 1);
}

#[test]
fn llama_style_vocabulary_tokenizes_as_sentencepiece() {
    check("spm_llama");
}

#[test]
fn gemma_style_vocabulary_without_space_prefix_tokenizes_as_sentencepiece() {
    check("spm_gemma");
}
