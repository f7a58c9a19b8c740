//! HF reader tests on the tiny checkpoints made by tests/golden/make_hf_fixture.py: config
//! normalisation, GGUF naming and ggml-order shapes, sharded index handling, and the Q/K row
//! permutation, checked twice: against a hand-written row table, and by showing that RoPE attention
//! scores computed the HF way (rotate_half on the original rows) equal those computed the GGUF way
//! (adjacent pairs on the permuted rows).

use metrale_core::dtype::DType;
use metrale_model::{ChatMessage, Format, Model};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// An HF tensor straight from the safetensors file, as f32, row-major [rows][cols].
fn hf_tensor(dir: &Path, file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(dir.join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor(name).unwrap();
    let dtype = match v.dtype() {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        d => panic!("{d:?}"),
    };
    let n: usize = v.shape().iter().product();
    let mut out = vec![0f32; n];
    metrale_core::dtype::dequantize_row(dtype, v.data(), &mut out).unwrap();
    (v.shape().to_vec(), out)
}

#[test]
fn single_file_config_and_names() {
    let dir = fixture("tiny-llama");
    let m = Model::load(&dir).unwrap();
    let c = &m.config;
    assert_eq!(m.format, Format::HfSafetensors);
    assert_eq!((c.arch.as_str(), c.model_type.as_str()), ("llama", "llama"));
    assert_eq!(
        (
            c.n_layers,
            c.hidden,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.ffn
        ),
        (2, 32, 4, 2, 8, 64)
    );
    assert_eq!(
        (c.vocab, c.max_context, c.rope_theta, c.norm_eps),
        (263, 512, 100000.0, 1e-5)
    );
    assert_eq!(
        (c.tied_embeddings, c.bos, c.eos.clone(), c.add_bos),
        (true, Some(1), vec![2], false)
    );
    assert_eq!(c.rope_scaling, None);
    let mut want: Vec<String> = vec!["token_embd.weight".into(), "output_norm.weight".into()];
    for l in 0..2 {
        for s in [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            want.push(format!("blk.{l}.{s}.weight"));
        }
    }
    want.sort();
    assert_eq!(m.weights.names().collect::<Vec<_>>(), want);
    let t = |n: &str| m.weights.get(n).unwrap();
    // ggml order: [in_features, out_features]
    assert_eq!(
        (t("token_embd.weight").shape, t("token_embd.weight").dtype),
        (vec![32, 263], DType::BF16)
    );
    assert_eq!(t("blk.0.attn_k.weight").shape, vec![32, 16]);
    assert_eq!(t("blk.0.ffn_down.weight").shape, vec![64, 32]);
    assert_eq!(t("blk.0.attn_norm.weight").dtype, DType::F32);
    assert_eq!(t("blk.1.attn_v.weight").dtype, DType::F16);
    // only q and k are owned copies: 2 layers x (32 + 16 rows) x 32 bf16
    assert_eq!(m.weights.owned_bytes(), 2 * (32 + 16) * 32 * 2);
    // a zero-copy tensor has the file's bytes
    let (_, emb) = hf_tensor(&dir, "model.safetensors", "model.embed_tokens.weight");
    assert_eq!(t("token_embd.weight").to_f32(), emb);
    let e = m.weights.get("output.weight").unwrap_err().to_string();
    assert!(
        e.contains("output.weight") && e.contains("not found"),
        "{e}"
    );
}

#[test]
fn qk_permutation_hand_table() {
    let dir = fixture("tiny-llama");
    let m = Model::load(&dir).unwrap();
    // head_dim 8: GGUF row 2j+t of a head is HF row t*4+j: [0,4,1,5,2,6,3,7]
    let table = [0usize, 4, 1, 5, 2, 6, 3, 7];
    for (name, hf, heads) in [
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight",
            4,
        ),
        (
            "blk.1.attn_k.weight",
            "model.layers.1.self_attn.k_proj.weight",
            2,
        ),
    ] {
        let (shape, hfw) = hf_tensor(&dir, "model.safetensors", hf);
        assert_eq!(shape, vec![heads * 8, 32]);
        let g = m.weights.get(name).unwrap().to_f32();
        for h in 0..heads {
            for (r, &src) in table.iter().enumerate() {
                let gr = &g[(h * 8 + r) * 32..(h * 8 + r + 1) * 32];
                let hr = &hfw[(h * 8 + src) * 32..(h * 8 + src + 1) * 32];
                assert_eq!(gr, hr, "{name} head {h} row {r}");
            }
        }
    }
}

fn matvec(w: &[f32], rows: usize, x: &[f32]) -> Vec<f32> {
    let cols = x.len();
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

/// HF llama RoPE: element j pairs with j + d/2 (rotate_half), frequency theta^(-2j/d).
fn rope_hf(v: &mut [f32], pos: f32, theta: f32) {
    let d = v.len();
    for j in 0..d / 2 {
        let a = pos * theta.powf(-((2 * j) as f32) / d as f32);
        let (x0, x1) = (v[j], v[j + d / 2]);
        v[j] = x0 * a.cos() - x1 * a.sin();
        v[j + d / 2] = x1 * a.cos() + x0 * a.sin();
    }
}

/// GGUF / llama.cpp "normal" RoPE: adjacent pairs (2j, 2j+1), same frequencies.
fn rope_adjacent(v: &mut [f32], pos: f32, theta: f32) {
    let d = v.len();
    for j in 0..d / 2 {
        let a = pos * theta.powf(-((2 * j) as f32) / d as f32);
        let (x0, x1) = (v[2 * j], v[2 * j + 1]);
        v[2 * j] = x0 * a.cos() - x1 * a.sin();
        v[2 * j + 1] = x1 * a.cos() + x0 * a.sin();
    }
}

#[test]
fn qk_permutation_preserves_rope_attention_scores() {
    let dir = fixture("tiny-llama");
    let m = Model::load(&dir).unwrap();
    let c = &m.config;
    let hd = c.head_dim;
    let x: Vec<f32> = (0..32).map(|i| ((i * 7 % 11) as f32 - 5.0) / 5.0).collect();
    let y: Vec<f32> = (0..32).map(|i| ((i * 5 % 13) as f32 - 6.0) / 6.0).collect();
    for layer in 0..2 {
        let (_, wq) = hf_tensor(
            &dir,
            "model.safetensors",
            &format!("model.layers.{layer}.self_attn.q_proj.weight"),
        );
        let (_, wk) = hf_tensor(
            &dir,
            "model.safetensors",
            &format!("model.layers.{layer}.self_attn.k_proj.weight"),
        );
        let gq = m
            .weights
            .get(&format!("blk.{layer}.attn_q.weight"))
            .unwrap()
            .to_f32();
        let gk = m
            .weights
            .get(&format!("blk.{layer}.attn_k.weight"))
            .unwrap()
            .to_f32();
        let (qh, kh) = (matvec(&wq, 32, &x), matvec(&wk, 16, &y));
        let (qg, kg) = (matvec(&gq, 32, &x), matvec(&gk, 16, &y));
        for (pq, pk) in [(0.0, 0.0), (5.0, 2.0), (37.0, 11.0), (300.0, 299.0)] {
            for h in 0..c.n_heads {
                let kvh = h / (c.n_heads / c.n_kv_heads);
                let (mut a, mut b) = (
                    qh[h * hd..(h + 1) * hd].to_vec(),
                    kh[kvh * hd..(kvh + 1) * hd].to_vec(),
                );
                rope_hf(&mut a, pq, c.rope_theta);
                rope_hf(&mut b, pk, c.rope_theta);
                let s_hf: f32 = a.iter().zip(&b).map(|(p, q)| p * q).sum();
                let (mut a, mut b) = (
                    qg[h * hd..(h + 1) * hd].to_vec(),
                    kg[kvh * hd..(kvh + 1) * hd].to_vec(),
                );
                rope_adjacent(&mut a, pq, c.rope_theta);
                rope_adjacent(&mut b, pk, c.rope_theta);
                let s_gg: f32 = a.iter().zip(&b).map(|(p, q)| p * q).sum();
                assert!(
                    (s_hf - s_gg).abs() <= 1e-3 * (1.0 + s_hf.abs()),
                    "layer {layer} head {h} pos {pq}/{pk}: {s_hf} vs {s_gg}"
                );
            }
        }
    }
}

#[test]
fn sharded_checkpoint() {
    let single = Model::load(&fixture("tiny-llama")).unwrap();
    let m = Model::load(&fixture("tiny-llama-sharded")).unwrap();
    assert!(!m.config.tied_embeddings);
    assert_eq!(m.weights.len(), single.weights.len() + 1);
    let out = m.weights.get("output.weight").unwrap();
    assert_eq!((out.shape.clone(), out.dtype), (vec![32, 263], DType::BF16));
    for n in single.weights.names() {
        assert_eq!(
            single.weights.get(n).unwrap().data,
            m.weights.get(n).unwrap().data,
            "{n}"
        );
    }
}

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn broken_sharded_index() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    copy_dir(&fixture("tiny-llama-sharded"), d);
    let idx = d.join("model.safetensors.index.json");
    // a tensor the index puts in the wrong shard
    edit_json(&idx, |v| {
        v["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors".into()
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("model.norm.weight") && e.contains("model-00002-of-00002.safetensors"),
        "{e}"
    );
    // a shard outside the directory
    copy_dir(&fixture("tiny-llama-sharded"), d);
    edit_json(&idx, |v| {
        v["weight_map"]["model.norm.weight"] = "../model-00001-of-00002.safetensors".into()
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("weight_map['model.norm.weight']") && e.contains("same directory"),
        "{e}"
    );
    // a missing shard file
    copy_dir(&fixture("tiny-llama-sharded"), d);
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("cannot read"),
        "{e}"
    );
}

#[test]
fn config_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let cfg = d.join("config.json");
    let reset = || copy_dir(&fixture("tiny-llama"), d);
    reset();
    edit_json(&cfg, |v| {
        v["model_type"] = "gemma4".into();
        v["architectures"] = serde_json::json!(["Gemma4ForCausalLM"]);
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("gemma4") && e.contains("llama") && e.contains("config.json"),
        "{e}"
    );
    // Mistral's folders are llamas (with model_type mistral)
    reset();
    edit_json(&cfg, |v| {
        v["model_type"] = "mistral".into();
        v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    });
    let m = Model::load(d).unwrap();
    assert_eq!(m.config.family, metrale_model::Family::Llama);
    assert_eq!(m.config.model_type, "mistral");
    reset();
    edit_json(&cfg, |v| {
        v["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 4.0})
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("dynamic") && e.contains("llama3") && e.contains("yarn"),
        "{e}"
    );
    // YaRN needs the pretraining context it scales
    reset();
    edit_json(&cfg, |v| {
        v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("original_max_position_embeddings"), "{e}");
    reset();
    edit_json(&cfg, |v| {
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    });
    let m = Model::load(d).unwrap();
    assert_eq!(
        m.config.rope_scaling,
        Some(metrale_model::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192
        })
    );
    reset();
    edit_json(&cfg, |v| v["tie_word_embeddings"] = false.into());
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("lm_head.weight") && e.contains("tie_word_embeddings"),
        "{e}"
    );
    reset();
    edit_json(&cfg, |v| v["num_hidden_layers"] = 3.into());
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("blk.2."), "{e}");
    reset();
    edit_json(&cfg, |v| {
        v.as_object_mut().unwrap().remove("hidden_size");
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("hidden_size") && e.contains("missing"), "{e}");
    reset();
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    // a qwen3 config over llama tensors: the family's per-head Q/K norms are missing, by name
    reset();
    edit_json(&cfg, |v| {
        v["model_type"] = "qwen3".into();
        v["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("blk.0.attn_q_norm.weight"), "{e}");
    // a qwen2 config over llama tensors: its Q/K/V biases are missing, by name; attention_bias
    // is not one of its keys (its biases are always there), an MLP bias is refused
    reset();
    edit_json(&cfg, |v| {
        v["model_type"] = "qwen2".into();
        v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("blk.0.attn_q.bias"), "{e}");
    edit_json(&cfg, |v| v["mlp_bias"] = true.into());
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("mlp_bias"), "{e}");
    // a partial rotary embedding (Phi-4-mini) of 6 of the 8 dimensions loads; a factor past 1,
    // or one leaving no rotated pair, is refused by name
    reset();
    edit_json(&cfg, |v| v["partial_rotary_factor"] = 0.75.into());
    assert_eq!(Model::load(d).unwrap().config.rotary_dim, 6);
    for (f, says) in [(1.5, "(0, 1]"), (0.1, "even number of rotated dimensions")] {
        edit_json(&cfg, |v| v["partial_rotary_factor"] = f.into());
        let e = Model::load(d).unwrap_err().to_string();
        assert!(
            e.contains("partial_rotary_factor") && e.contains(says),
            "{e}"
        );
    }
    // LongRoPE needs one factor per rotated pair in each list, and the pretraining context
    reset();
    edit_json(&cfg, |v| {
        v["rope_scaling"] = serde_json::json!({"type": "longrope",
            "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": [1.0, 2.0, 3.0]});
        v["original_max_position_embeddings"] = 64.into();
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("long_factor") && e.contains("4 positive factors"),
        "{e}"
    );
    edit_json(&cfg, |v| {
        v["rope_scaling"]["long_factor"] = serde_json::json!([1.0, 2.0, 3.0, 4.0]);
        v.as_object_mut()
            .unwrap()
            .remove("original_max_position_embeddings");
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("original_max_position_embeddings"), "{e}");
    // a model_type and an architecture of different families
    reset();
    edit_json(&cfg, |v| v["model_type"] = "qwen3".into());
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("qwen3") && e.contains("LlamaForCausalLM"), "{e}");
    reset();
    edit_json(&cfg, |v| v["use_sliding_window"] = true.into());
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("use_sliding_window"), "{e}");
    // a qwen3_moe config: dense layers among the sparse ones are refused, then (over llama
    // tensors) the experts are missing, by name
    reset();
    let moe = |v: &mut serde_json::Value| {
        v["model_type"] = "qwen3_moe".into();
        v["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
        v["num_experts"] = 4.into();
        v["num_experts_per_tok"] = 2.into();
        v["moe_intermediate_size"] = 8.into();
    };
    edit_json(&cfg, |v| {
        moe(v);
        v["mlp_only_layers"] = serde_json::json!([0]);
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(e.contains("mlp_only_layers"), "{e}");
    reset();
    edit_json(&cfg, |v| {
        moe(v);
        v["num_experts_per_tok"] = 5.into();
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("experts used") && e.contains("1 to the 4"),
        "{e}"
    );
}

#[test]
fn hf_tokenizer_and_template() {
    let m = Model::load(&fixture("tiny-llama")).unwrap();
    let t = &m.tokenizer;
    assert_eq!(t.vocab_size(), 263);
    let hello = t.token_to_id("hello").unwrap();
    assert_eq!(hello, 262);
    assert_eq!(t.encode("hello", false, false).unwrap(), vec![hello]);
    let ids = t
        .encode("<|im_start|>hello<|im_end|>", false, true)
        .unwrap();
    assert_eq!(ids, vec![1, hello, 2]);
    let plain = t.encode("<|im_start|>hello", false, false).unwrap();
    assert_eq!(plain.len(), "<|im_start|>".len() + 1);
    assert_eq!(t.decode(&ids, true), "hello");
    assert_eq!(t.decode(&ids, false), "<|im_start|>hello<|im_end|>");
    assert!(t.is_special(1) && !t.is_special(hello));
    let s = "héllo wörld 🦀\n\t  x";
    assert_eq!(t.decode(&t.encode(s, false, false).unwrap(), false), s);
    let tpl = m.chat_template.as_ref().unwrap();
    let out = tpl
        .render(&[ChatMessage::new("user", " hi ")], true)
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn model_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Model>();
    send_sync::<metrale_model::Tokenizer>();
    send_sync::<metrale_model::ChatTemplate>();
}

#[test]
fn malformed_safetensors_and_absurd_config() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    copy_dir(&fixture("tiny-llama"), d);
    let st = d.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    for cut in [0usize, 7, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&st, &bytes[..cut]).unwrap();
        let e = Model::load(d).unwrap_err().to_string();
        assert!(e.contains("model.safetensors"), "cut at {cut}: {e}");
    }
    let mut b = bytes.clone();
    b[0..8].copy_from_slice(&u64::MAX.to_le_bytes()); // header length
    std::fs::write(&st, &b).unwrap();
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("header"),
        "{e}"
    );
    std::fs::write(&st, &bytes).unwrap();
    edit_json(&d.join("config.json"), |v| {
        v["num_hidden_layers"] = serde_json::json!(1u64 << 60)
    });
    let e = Model::load(d).unwrap_err().to_string();
    assert!(
        e.contains("num_hidden_layers") && e.contains("at most 4096"),
        "{e}"
    );
    edit_json(&d.join("config.json"), |v| {
        v["num_hidden_layers"] = 2.into();
        v["num_attention_heads"] = serde_json::json!(1u64 << 62);
        v["num_key_value_heads"] = serde_json::json!(1u64 << 62);
    });
    assert!(Model::load(d).is_err());
}

/// The families a target may name are the ones the readers accept, and no others.
#[test]
fn target_families_are_the_readers_families() {
    for name in metrale_core::target::FAMILIES {
        let f = metrale_model::Family::from_arch(name).expect(name);
        assert_eq!(f.name(), name);
    }
    assert!(metrale_model::Family::from_arch("gemma4").is_none());
    // Mistral is read as a llama
    assert_eq!(
        metrale_model::Family::from_arch("mistral"),
        Some(metrale_model::Family::Llama)
    );
}
