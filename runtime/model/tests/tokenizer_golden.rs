//! The tokenizer and chat template against references nobody here wrote:
//! - tests/golden/tokenizer_llamacpp.json: token ids from llama.cpp's llama-tokenize on the real GGUF
//!   (made by tests/golden/make_tokenizer_golden.py, which records llama.cpp's version);
//! - tests/golden/chat_template_jinja2.json: the GGUF's chat template rendered by Python jinja2 with
//!   HF's settings (made by tests/golden/make_chat_golden.py).
//!
//! Needs METRALE_MODEL (the SmolLM2-135M-Instruct Q4_1 GGUF); skips, passing, without it.

use metrale_model::{ChatMessage, Model};
use serde_json::Value;
use std::path::{Path, PathBuf};

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

fn golden(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

#[test]
fn token_ids_equal_llama_cpp() {
    let Some(p) = model_path() else { return };
    let m = Model::load(&p).unwrap();
    let g = golden("tokenizer_llamacpp.json");
    eprintln!("reference: {}", g["llama_cpp_version"]);
    let cases = g["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    let mut failures = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let ps = c["parse_special"].as_bool().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = m.tokenizer.encode(text, false, ps).unwrap();
        if got != want {
            failures.push(format!(
                "{text:?} (parse_special={ps}):\n  llama.cpp {want:?}\n  metrale   {got:?}"
            ));
        }
        // decoding gives the text back (with special tokens kept)
        assert_eq!(
            m.tokenizer.decode(&got, false),
            text,
            "decode(encode(s)) != s"
        );
        let bytes: Vec<u8> = got
            .iter()
            .flat_map(|&i| m.tokenizer.token_bytes(i))
            .collect();
        assert_eq!(
            bytes,
            text.as_bytes(),
            "token_bytes do not concatenate to the text"
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn chat_template_equals_jinja2() {
    let Some(p) = model_path() else { return };
    let m = Model::load(&p).unwrap();
    let g = golden("chat_template_jinja2.json");
    let tpl = m.require_chat_template().unwrap();
    assert_eq!(tpl.source(), g["template"].as_str().unwrap());
    for c in g["cases"].as_array().unwrap() {
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let got = tpl
            .render(&msgs, c["add_generation_prompt"].as_bool().unwrap())
            .unwrap();
        assert_eq!(got, c["prompt"].as_str().unwrap());
    }
    // The reference question (docs/facts.md, "The reference question"), spelled out
    let q = "What is the capital of France? Answer in one sentence.";
    let got = tpl.render(&[ChatMessage::new("user", q)], true).unwrap();
    assert_eq!(
        got,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}
