//! Fuzz target `gguf_model`: a whole GGUF load from arbitrary bytes.
//!
//! Owns: running `Model::from_gguf` (config, tokenizer build, chat template compile, weights, the
//! llama shape checks) on every input whose header parses; none may panic, and memory stays under
//! the process-wide heap cap. Slow (building a tokenizer compiles its pre-tokenizer regexes), so it
//! gets fewer executions than `gguf`, which covers the header parser itself.

#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model::gguf::GgufFile;
use metrale_model::Model;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = GgufFile::from_bytes(data, Path::new("fuzz.gguf")) {
        let _ = Model::from_gguf(g);
    }
});
