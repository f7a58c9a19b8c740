//! Fuzz target `gguf`: the GGUF header parser on arbitrary bytes.
//!
//! Owns: checking that `gguf::parse_header` never panics and that its heap peak stays within 8x the
//! input plus 64 KiB (the worst honest ratio is about 6x: a minimal metadata entry is 14 bytes in the
//! file and about 85 bytes in the B-tree; a tensor info 33 bytes and about 100 bytes with its name's
//! hash-set entry; arrays are at most 1x), then, for a header that parses, the typed getters the
//! loader uses and `ModelConfig::from_gguf`. The slow rest of a load (building the tokenizer) is the
//! `gguf_model` target's, so this one runs fast enough for tens of millions of inputs.

#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model::gguf::{parse_header, GgufFile};
use metrale_model::ModelConfig;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let (parsed, peak) = metrale_fuzz::measure(|| parse_header(data, path).is_ok());
    let bound = 8 * data.len() + (64 << 10);
    assert!(
        peak <= bound,
        "parse_header of {} bytes peaked at {peak} heap bytes (bound {bound})",
        data.len()
    );
    if !parsed {
        return;
    }
    let Ok(g) = GgufFile::from_bytes(data, path) else {
        return;
    };
    let _ = ModelConfig::from_gguf(&g);
    let _ = g.opt_str_array("tokenizer.ggml.tokens");
    let _ = g.opt_str_array("tokenizer.ggml.merges");
    let _ = g.opt_int_array("tokenizer.ggml.token_type");
    let _ = g.opt_str("tokenizer.chat_template");
    let _ = g.opt_f32("llama.rope.freq_base");
    let _ = g.opt_bool("tokenizer.ggml.add_bos_token");
    let _ = g.req_usize("llama.block_count");
    for (k, v) in &g.header.metadata {
        let _ = (k.len(), v.describe(), v.as_u64(), v.as_i64(), v.as_f64());
        if let Some(a) = v.as_array() {
            let _ = (a.len(), a.elem_type(), a.to_i64s().map(|v| v.len()));
            if let Some(s) = a.as_strs() {
                let _ = s.iter().map(str::len).sum::<usize>();
            }
        }
    }
});
