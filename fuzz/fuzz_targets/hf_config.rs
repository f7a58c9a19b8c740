//! Fuzz target `hf_config`: the HF checkpoint readers on arbitrary bytes.
//!
//! Owns: feeding each input to `config.json`'s reader (`hf::parse_json` then `ModelConfig::from_hf`,
//! with and without a generation_config EOS list) and to the safetensors reader
//! (`hf::read_safetensors`: the safetensors crate's header and bounds checks, then ours on names,
//! dtypes and shapes), and the Q/K row permutation on each q/k tensor found. None may panic; memory
//! stays under the process-wide heap cap.

#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model::hf::{parse_json, permute_qk_rows, read_safetensors};
use metrale_model::ModelConfig;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let cfg_path = Path::new("config.json");
    if let Ok(j) = parse_json(data, cfg_path) {
        let _ = ModelConfig::from_hf(cfg_path, &j, false, &[]);
        let _ = ModelConfig::from_hf(cfg_path, &j, true, &[2, 7]);
    }
    if let Ok(tensors) = read_safetensors(data, Path::new("model.safetensors")) {
        for t in tensors {
            if t.name.ends_with(".attn_q.weight") || t.name.ends_with(".attn_k.weight") {
                let rows: usize = t.shape[1..].iter().product();
                let rb = t.dtype.row_bytes(t.shape[0]).unwrap_or(0);
                for n_head in [1, 2, 3, rows.max(1)] {
                    let _ = permute_qk_rows(t.data, rows, rb, n_head);
                }
            }
        }
    }
});
