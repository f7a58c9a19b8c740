//! `cargo xtask synth-model MODEL --quant Q [--format gguf|hf] [--seed N] [--layers N] --out PATH`:
//! a checkpoint with the exact shapes of a model in `targets/models/`, deterministic random weights
//! and a real tokenizer, for models whose weights cannot be downloaded. Timing does not depend on
//! the values; correctness is checked against an independent implementation loading the same file.
//!
//! What it writes:
//! - the weights: every value is a bf16 number drawn from a counter-based generator keyed by (seed,
//!   tensor name, row), so a value does not depend on the thread that made it, on the format, or on
//!   the other tensors. GGUF bf16 and the HF folder hold the same bf16 values (GGUF keeps norms in
//!   f32, exactly); GGUF q4_1 quantizes those values with the project's own quantizer
//!   (`metrale_core::dtype::quantize_row`): layer matrices Q4_1, embedding and LM head Q8_0, as the
//!   q4_1 targets expect; GGUF q4_k_m writes llama.cpp's Q4_K_M mix ([`q4_k_m_mix`]) with the
//!   project's K-quant quantizer (`metrale_core::kquant::quantize`). In GGUF, q/k rows are permuted
//!   to its rope convention, as llama.cpp's converter does, so both formats describe one model.
//! - the scale: uniform values with standard deviation 1/sqrt(fan-in) in every projection, 1 in the
//!   embedding, 2/sqrt(hidden) in the LM head (logits of standard deviation ~2) and norm weights in
//!   [0.75, 1.25]: each layer adds O(1) to the residual stream, so activations stay finite through
//!   every layer.
//! - the tokenizer: the default model's byte-level BPE (and its chat template) from a GGUF, padded
//!   with `<|unused_N|>` tokens (GGUF token type 5, unused) to the model's vocabulary.
//! - llama3 RoPE scaling: GGUF gets `rope_freqs.weight` (per-dimension divisors, as llama.cpp's
//!   converter writes it), the HF config its `rope_scaling`.
//!
//! Speed: rows are generated and written (`pwrite` at their offsets) by one thread per core.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use metrale_core::dtype::{f32_to_bf16, quantize_row, DType};
use metrale_core::target::{load_model_shape, read_model_shape, ModelShape};
use metrale_model::gguf::{Array, GgufFile, StrArray, Value};
use metrale_model::gguf_writer::{self, TensorSpec};
use metrale_model::Family;
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One GGUF file (bf16 or q4_1).
    Gguf,
    /// An HF folder: config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json.
    Hf,
    /// A vocab-only GGUF (as llama.cpp's `ggml-vocab-*.gguf`): the padded tokenizer and chat
    /// template, no tensors; what `--tokenizer` reads, small enough to carry.
    Vocab,
}

#[derive(clap::Args)]
pub struct Args {
    /// A shared model file in targets/models/ (e.g. llama-3.1-8b, smollm2-135m), or the path of a
    /// `.toml` file with a `[model]` table laid out the same way.
    pub model: String,
    /// Weight types: bf16 (every matrix), q4_1 (layer matrices Q4_1, embedding and LM head Q8_0),
    /// q4_k_m (llama.cpp's Q4_K_M mix of Q4_K and Q6_K; GGUF only) or fp8 (layer matrices FP8
    /// e4m3 with a scale per output channel and dynamic per-token activations, as a
    /// compressed-tensors checkpoint; HF only).
    #[arg(long, default_value = "bf16")]
    pub quant: String,
    #[arg(long, value_enum, default_value = "gguf")]
    pub format: Format,
    /// Seed of the weights: the same seed gives the same values in every format.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep only the first N layers: a smaller variant with the same layer shapes.
    #[arg(long)]
    pub layers: Option<u32>,
    /// The GGUF file (or, for --format hf, the folder) to write.
    #[arg(long)]
    pub out: PathBuf,
    /// A GGUF whose tokenizer and chat template the checkpoint takes (default: the default model,
    /// fetched if absent).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Worker threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The checkout whose targets/models/ holds the shape (default: the nearest folder at or above
    /// the working directory that holds targets/ and kernels/).
    #[arg(long)]
    pub repo: Option<PathBuf>,
}

/// How a tensor's values are drawn.
#[derive(Clone, Debug)]
enum Init {
    /// Uniform in [-a, a], rounded to bf16.
    Uniform(f32),
    /// Uniform in [0.75, 1.25], rounded to bf16 (norm weights).
    Norm,
    /// These exact values (one row).
    Values(Vec<f32>),
}

/// One tensor of the checkpoint: its values are defined in HF orientation (row `r` of an
/// `[rows, cols]` matrix); `qk_heads` marks q/k projections, whose rows GGUF permutes.
#[derive(Clone, Debug)]
struct Tensor {
    gguf: String,
    hf: Option<String>,
    rows: usize,
    cols: usize,
    dtype: DType,
    init: Init,
    qk_heads: Option<usize>,
    /// The value stream's row of this tensor's first row: an HF expert's tensor is rows
    /// `row0..row0 + rows` of the experts' one GGUF tensor, whose name keys the values.
    row0: usize,
    /// GGUF stores it 3-D: `[cols, rows / experts, experts]` (the experts of one layer).
    experts: Option<usize>,
    /// Added to every value in the HF folder only: -1 for the norms of families whose HF
    /// checkpoints store w for 1 + w (GGUF stores the 1 + w, as llama.cpp's converter writes it).
    hf_offset: f32,
}

pub fn run(args: Args) -> Result<()> {
    let t0 = Instant::now();
    let root = crate::build_target::repo_or_root(&args.repo)?.join("targets");
    let mut shape = if args.model.ends_with(".toml") {
        read_model_shape(Path::new(&args.model))?
    } else {
        load_model_shape(&root, &args.model)?
    };
    if let Some(n) = args.layers {
        if n == 0 {
            bail!("--layers must be at least 1");
        }
        shape.layers = n;
    }
    let (wt, et) = match (args.quant.as_str(), args.format) {
        ("bf16", _) => (DType::BF16, DType::BF16),
        ("q4_1", Format::Gguf | Format::Vocab) => (DType::Q4_1, DType::Q8_0),
        ("q4_k_m", Format::Gguf | Format::Vocab) => (DType::Q4_K, DType::Q4_K),
        ("fp8", Format::Hf) => (DType::F8_E4M3, DType::BF16),
        // gpt-oss's checkpoints: the experts MXFP4, everything else bf16 (`tensors`)
        ("mxfp4", Format::Gguf | Format::Hf) => (DType::MXFP4, DType::BF16),
        (q @ ("q4_1" | "q4_k_m"), Format::Hf) => {
            bail!("--format hf writes bf16 or fp8 safetensors; {q} is a GGUF type (use --format gguf)")
        }
        ("fp8", _) => bail!("GGUF has no FP8 type: write --quant fp8 with --format hf"),
        (q, _) => bail!("unknown --quant '{q}': bf16, q4_1, q4_k_m (GGUF), fp8 (HF) or mxfp4"),
    };
    let tok_path = match &args.tokenizer {
        Some(p) => p.clone(),
        None => crate::fetch_model::fetch("smollm2-135m", false)?,
    };
    let tok = GgufFile::open(&tok_path)
        .with_context(|| format!("reading the tokenizer from {}", tok_path.display()))?;
    let family = Family::from_arch(&shape.family).with_context(|| {
        format!(
            "model family '{}': synth-model writes {}",
            shape.family,
            metrale_model::config::SUPPORTED_ARCHS
        )
    })?;
    // gpt-oss's checkpoints carry harmony's special tokens
    let named = match family {
        Family::GptOss => {
            let tokens = tok.opt_str_array("tokenizer.ggml.tokens")?;
            let have = |t: &str| tokens.as_ref().is_some_and(|v| v.contains(&t));
            let n = tokens.as_ref().map_or(0, |t| t.len());
            let mut named = harmony_tokens(n, shape.vocab as usize);
            // a text the source vocabulary has (SmolLM2's <|endoftext|>) stays its one token
            named.retain(|&(_, t)| !have(t));
            named
        }
        _ => Vec::new(),
    };
    let mut tok_meta = tokenizer_metadata(&tok, shape.vocab as usize, &named)?;
    if let Some(name) = chat_format(family) {
        // the family's chat format in place of the tokenizer file's, as its real checkpoints carry
        let p = root.join("chat").join(format!("{name}.jinja"));
        let text = std::fs::read_to_string(&p)
            .with_context(|| format!("reading the {family} chat template {}", p.display()))?;
        tok_meta.retain(|(k, _)| k != "tokenizer.chat_template");
        tok_meta.push(("tokenizer.chat_template".into(), Value::String(text)));
    }
    let mut tensors = tensors(&shape, family, wt, et, args.format)?;
    if args.quant == "q4_k_m" && args.format == Format::Gguf {
        q4_k_m_mix(&mut tensors, shape.layers as usize);
    }
    check_blocks(&tensors)?;
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let bytes = match args.format {
        Format::Vocab => {
            let mut meta = vec![(
                "general.architecture".to_string(),
                Value::String("llama".into()),
            )];
            meta.extend(tok_meta);
            let l = gguf_writer::layout(&meta, &[]).map_err(anyhow::Error::msg)?;
            std::fs::write(&args.out, &l.header)
                .with_context(|| format!("writing {}", args.out.display()))?;
            println!("{}", args.out.display());
            return Ok(());
        }
        Format::Gguf => write_gguf(&args, &shape, family, &tensors, tok_meta, threads)?,
        Format::Hf => write_hf(
            &args, &shape, family, &tensors, tok_meta, &tok_path, threads,
        )?,
    };
    let params: usize = tensors.iter().map(|t| t.rows * t.cols).sum();
    let s = t0.elapsed().as_secs_f64();
    eprintln!(
        "synth-model: {} ({} layers, {:.2} B parameters, {}) seed {}: {:.2} GB in {s:.1} s ({:.2} GB/s, {threads} threads)",
        shape.name,
        shape.layers,
        params as f64 / 1e9,
        args.quant,
        args.seed,
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / s,
    );
    println!("{}", args.out.display());
    Ok(())
}

/// llama.cpp's Q4_K_M mix ([`crate::quantize::mix_type`]) over the Q4_K tensors, with its
/// fallbacks where rows are not whole 256-element super-blocks ([`crate::quantize::fallback`]:
/// Q4_K -> Q5_0, Q6_K -> Q8_0), as `llama-quantize` writes them. Norms stay f32.
fn q4_k_m_mix(tensors: &mut [Tensor], layers: usize) {
    for t in tensors.iter_mut().filter(|t| t.dtype == DType::Q4_K) {
        let mixed = crate::quantize::mix_type(&t.gguf, layers, DType::Q4_K);
        t.dtype = crate::quantize::fallback(mixed, t.cols);
    }
}

/// The tensors of a model of this shape and family (GGUF names, HF names, HF orientation).
fn tensors(
    s: &ModelShape,
    family: Family,
    wt: DType,
    et: DType,
    format: Format,
) -> Result<Vec<Tensor>> {
    let (h, ffn, vocab) = (s.hidden as usize, s.ffn as usize, s.vocab as usize);
    let (hd, heads, kv) = (s.head_dim as usize, s.heads as usize, s.kv_heads as usize);
    let (qd, kd) = (heads * hd, kv * hd);
    let norm_t = if format == Format::Gguf {
        DType::F32
    } else {
        DType::BF16
    };
    // MXFP4 is gpt-oss's expert format: its other matrices stay bf16, as in its checkpoints
    let (wt, xt) = match wt {
        DType::MXFP4 if s.experts.is_none() || !family.features().oai_moe => {
            bail!("--quant mxfp4 is gpt-oss's format for its experts; {family} has none")
        }
        DType::MXFP4 => (DType::BF16, DType::MXFP4),
        t => (t, t),
    };
    let u = |fan_in: usize, k: f32| Init::Uniform(k * (3.0 / fan_in as f32).sqrt());
    // GGUF llama rows of q/k are permuted to adjacent-pair RoPE; qwen3 GGUFs keep HF's order
    let permuted = !family.gguf_rope_halves();
    let feat = family.features();
    let t = |gguf: &str, hf: &str, rows, cols, dtype, init: Init, qk_heads: Option<usize>| Tensor {
        gguf: gguf.into(),
        hf: Some(hf.into()),
        rows,
        cols,
        dtype,
        hf_offset: match (&init, feat.norm_plus_one) {
            (Init::Norm, true) => -1.0,
            _ => 0.0,
        },
        init,
        qk_heads: qk_heads.filter(|_| permuted),
        row0: 0,
        experts: None,
    };
    let mut v = vec![t(
        "token_embd.weight",
        "model.embed_tokens.weight",
        vocab,
        h,
        et,
        Init::Uniform(3f32.sqrt()),
        None,
    )];
    for l in 0..s.layers as usize {
        let g = |n: &str| format!("blk.{l}.{n}.weight");
        let f = |n: &str| format!("model.layers.{l}.{n}.weight");
        v.push(t(
            &g("attn_norm"),
            &f("input_layernorm"),
            1,
            h,
            norm_t,
            Init::Norm,
            None,
        ));
        if feat.fused_projections {
            // Phi-3: Q, K and V rows in one matrix, in HF's order in both formats
            v.push(t(
                &g("attn_qkv"),
                &f("self_attn.qkv_proj"),
                qd + 2 * kd,
                h,
                wt,
                u(h, 1.0),
                None,
            ));
        } else {
            v.extend([
                t(
                    &g("attn_q"),
                    &f("self_attn.q_proj"),
                    qd,
                    h,
                    wt,
                    u(h, 1.0),
                    Some(heads),
                ),
                t(
                    &g("attn_k"),
                    &f("self_attn.k_proj"),
                    kd,
                    h,
                    wt,
                    u(h, 1.0),
                    Some(kv),
                ),
                t(
                    &g("attn_v"),
                    &f("self_attn.v_proj"),
                    kd,
                    h,
                    wt,
                    u(h, 1.0),
                    None,
                ),
            ]);
        }
        if family.qkv_bias() {
            // one value a row (GGUF f32, HF bf16): the converters keep Q/K biases in HF's row
            // order for the families that have them, as their matrices
            assert!(
                !permuted,
                "a family with Q/K/V biases keeps HF's row order in GGUF"
            );
            let bias = |n: &str, hf: &str, len| Tensor {
                gguf: format!("blk.{l}.{n}.bias"),
                hf: Some(format!("model.layers.{l}.{hf}.bias")),
                ..t("", "", 1, len, norm_t, Init::Uniform(0.5), None)
            };
            v.extend([
                bias("attn_q", "self_attn.q_proj", qd),
                bias("attn_k", "self_attn.k_proj", kd),
                bias("attn_v", "self_attn.v_proj", kd),
            ]);
        }
        if family.qk_norm() {
            v.extend([
                t(
                    &g("attn_q_norm"),
                    &f("self_attn.q_norm"),
                    1,
                    hd,
                    norm_t,
                    Init::Norm,
                    None,
                ),
                t(
                    &g("attn_k_norm"),
                    &f("self_attn.k_norm"),
                    1,
                    hd,
                    norm_t,
                    Init::Norm,
                    None,
                ),
            ]);
        }
        v.extend([t(
            &g("attn_output"),
            &f("self_attn.o_proj"),
            h,
            qd,
            wt,
            u(qd, 1.0),
            None,
        )]);
        if feat.out_bias {
            v.push(Tensor {
                gguf: format!("blk.{l}.attn_output.bias"),
                hf: Some(format!("model.layers.{l}.self_attn.o_proj.bias")),
                ..t("", "", 1, h, norm_t, Init::Uniform(0.5), None)
            });
        }
        if feat.attn_sinks {
            // one logit a head (gpt-oss's are O(1))
            v.push(t(
                &g("attn_sinks"),
                &format!("model.layers.{l}.self_attn.sinks"),
                1,
                heads,
                norm_t,
                Init::Uniform(2.0),
                None,
            ));
        }
        // the norm before the MLP: HF's post_attention_layernorm, or Gemma's
        // pre_feedforward_layernorm beside its norms after the attention and the MLP
        if feat.post_norms {
            v.extend([
                t(
                    &g("post_attention_norm"),
                    &f("post_attention_layernorm"),
                    1,
                    h,
                    norm_t,
                    Init::Norm,
                    None,
                ),
                t(
                    &g("ffn_norm"),
                    &f("pre_feedforward_layernorm"),
                    1,
                    h,
                    norm_t,
                    Init::Norm,
                    None,
                ),
                t(
                    &g("post_ffw_norm"),
                    &f("post_feedforward_layernorm"),
                    1,
                    h,
                    norm_t,
                    Init::Norm,
                    None,
                ),
            ]);
        } else {
            // (gpt-oss's GGUFs name it post_attention_norm)
            let norm = match feat.oai_moe {
                true => "post_attention_norm",
                false => "ffn_norm",
            };
            v.push(t(
                &g(norm),
                &f("post_attention_layernorm"),
                1,
                h,
                norm_t,
                Init::Norm,
                None,
            ));
        }
        let Some(x) = &s.experts else {
            if feat.fused_projections {
                // Phi-3: gate and up rows in one matrix, gate first
                v.push(t(
                    &g("ffn_up"),
                    &f("mlp.gate_up_proj"),
                    2 * ffn,
                    h,
                    wt,
                    u(h, 1.0),
                    None,
                ));
            } else {
                v.extend([
                    t(
                        &g("ffn_gate"),
                        &f("mlp.gate_proj"),
                        ffn,
                        h,
                        wt,
                        u(h, 1.0),
                        None,
                    ),
                    t(&g("ffn_up"), &f("mlp.up_proj"), ffn, h, wt, u(h, 1.0), None),
                ]);
            }
            v.extend([t(
                &g("ffn_down"),
                &f("mlp.down_proj"),
                h,
                ffn,
                wt,
                u(ffn, 1.0),
                None,
            )]);
            continue;
        };
        // routed experts: the router in f32 (GGUF; bf16 values) as llama.cpp keeps it, each
        // expert's gated MLP as one 3-D GGUF tensor per projection or one HF tensor per expert
        let (n, xf) = (x.count as usize, x.ffn as usize);
        let router = match feat.oai_moe {
            true => "mlp.router",
            false => "mlp.gate",
        };
        v.push(t(
            &g("ffn_gate_inp"),
            &f(router),
            n,
            h,
            norm_t,
            u(h, 1.0),
            None,
        ));
        // gpt-oss: biases on the router and every expert product, gate and up drawn wider so
        // that its clamp at 7 is met; HF keeps its experts as one tensor per projection
        // ([`write_gpt_oss_experts`])
        let gu = if feat.oai_moe { 3.0 } else { 1.0 };
        if feat.oai_moe {
            let bias = |n: &str, hf: Option<String>, rows, cols| Tensor {
                gguf: format!("blk.{l}.{n}.bias"),
                hf,
                ..t("", "", rows, cols, norm_t, Init::Uniform(0.5), None)
            };
            v.extend([
                bias(
                    "ffn_gate_inp",
                    Some(format!("model.layers.{l}.mlp.router.bias")),
                    1,
                    n,
                ),
                bias("ffn_gate_exps", None, n, xf),
                bias("ffn_up_exps", None, n, xf),
                bias(
                    "ffn_down_exps",
                    Some(format!("model.layers.{l}.mlp.experts.down_proj_bias")),
                    n,
                    h,
                ),
            ]);
        }
        for (kind, rows, cols, scale) in [
            ("gate", xf, h, u(h, gu)),
            ("up", xf, h, u(h, gu)),
            ("down", h, xf, u(xf, 1.0)),
        ] {
            let name = g(&format!("ffn_{kind}_exps"));
            if feat.oai_moe {
                v.push(Tensor {
                    experts: Some(n),
                    hf: None,
                    ..t(&name, &name, n * rows, cols, xt, scale, None)
                });
            } else if format == Format::Hf {
                for e in 0..n {
                    v.push(Tensor {
                        row0: e * rows,
                        ..t(
                            &name,
                            &f(&format!("mlp.experts.{e}.{kind}_proj")),
                            rows,
                            cols,
                            wt,
                            scale.clone(),
                            None,
                        )
                    });
                }
            } else {
                v.push(Tensor {
                    experts: Some(n),
                    ..t(&name, &name, n * rows, cols, wt, scale, None)
                });
            }
        }
    }
    v.push(t(
        "output_norm.weight",
        "model.norm.weight",
        1,
        h,
        norm_t,
        Init::Norm,
        None,
    ));
    if !s.tied_embeddings {
        v.push(t(
            "output.weight",
            "lm_head.weight",
            vocab,
            h,
            et,
            u(h, 2.0),
            None,
        ));
    }
    if let (Some(lr), Format::Gguf) = (&s.longrope, format) {
        // LongRoPE's two factor lists as llama.cpp's converter writes them (f32, one per pair)
        for (name, f) in [
            ("rope_factors_long.weight", &lr.long_factor),
            ("rope_factors_short.weight", &lr.short_factor),
        ] {
            v.push(Tensor {
                gguf: name.into(),
                hf: None,
                rows: 1,
                cols: f.len(),
                dtype: DType::F32,
                init: Init::Values(f.iter().map(|&x| x as f32).collect()),
                qk_heads: None,
                row0: 0,
                experts: None,
                hf_offset: 0.0,
            });
        }
    }
    if let (Some(r), Format::Gguf) = (&s.rope_scaling, format) {
        if r.rope_type != "llama3" {
            bail!("rope_scaling '{}': only llama3 is supported", r.rope_type);
        }
        v.push(Tensor {
            gguf: "rope_freqs.weight".into(),
            hf: None,
            rows: 1,
            cols: hd / 2,
            dtype: DType::F32,
            init: Init::Values(llama3_freq_factors(s, r)),
            qk_heads: None,
            row0: 0,
            experts: None,
            hf_offset: 0.0,
        });
    }
    Ok(v)
}

/// Refuse a tensor whose rows are not whole blocks of its type.
fn check_blocks(v: &[Tensor]) -> Result<()> {
    for t in v {
        if t.dtype.row_bytes(t.cols).is_none() {
            bail!(
                "{}: rows of {} elements are not whole {} blocks",
                t.gguf,
                t.cols,
                t.dtype
            );
        }
    }
    Ok(())
}

/// GGUF `rope_freqs.weight` for llama3 scaling: the divisor of each inverse frequency (1 for high
/// frequencies, the factor for low ones, interpolated between), as llama.cpp's converter writes it.
fn llama3_freq_factors(s: &ModelShape, r: &metrale_core::target::RopeScaling) -> Vec<f32> {
    let hd = s.head_dim as f64;
    (0..s.head_dim as usize / 2)
        .map(|i| {
            let f = s.rope_theta.powf(-2.0 * i as f64 / hd);
            let scaled = metrale_core::shape::llama3_scaled_freq(
                f,
                r.factor,
                r.low_freq_factor,
                r.high_freq_factor,
                r.original_max_position_embeddings as f64,
            );
            (f / scaled) as f32
        })
        .collect()
}

/// The chat format (`targets/chat/<name>.jinja`) synth-model gives a family's checkpoints, where
/// the project writes one: Qwen2.5's, Qwen3's for both Qwen3 families; llama's checkpoints keep
/// the tokenizer file's (the default model's ChatML).
fn chat_format(family: Family) -> Option<&'static str> {
    match family {
        Family::Qwen2 => Some("qwen2"),
        Family::Qwen3 | Family::Qwen3Moe => Some("qwen3"),
        Family::Gemma3 => Some("gemma3"),
        Family::Llama | Family::Phi3 | Family::GptOss => None,
    }
}

/// gpt-oss's harmony special tokens (`<|start|>`, `<|channel|>`, `<|message|>`, ...) for a
/// vocabulary padded from `n` to `vocab` tokens: at their ids in o200k_harmony where the
/// vocabulary reaches them (gpt-oss-20b's 201,088), else the first padding ids. The server's
/// harmony reader (`--reasoning-format harmony`) finds them by their text.
fn harmony_tokens(n: usize, vocab: usize) -> Vec<(usize, &'static str)> {
    const O200K: [(usize, &str); 9] = [
        (199_998, "<|startoftext|>"),
        (199_999, "<|endoftext|>"),
        (200_002, "<|return|>"),
        (200_003, "<|constrain|>"),
        (200_005, "<|channel|>"),
        (200_006, "<|start|>"),
        (200_007, "<|end|>"),
        (200_008, "<|message|>"),
        (200_012, "<|call|>"),
    ];
    if vocab > 200_012 && n <= 199_998 {
        return O200K.to_vec();
    }
    O200K
        .iter()
        .enumerate()
        .map(|(i, &(_, t))| (n + i, t))
        .filter(|&(id, _)| id < vocab)
        .collect()
}

/// The source GGUF's `tokenizer.*` metadata with the vocabulary padded to `vocab` tokens; the
/// padding ids of `named` take those texts as control tokens (GGUF token type 3).
fn tokenizer_metadata(
    g: &GgufFile,
    vocab: usize,
    named: &[(usize, &str)],
) -> Result<Vec<(String, Value)>> {
    let path = g.path.display();
    let tokens = g
        .opt_str_array("tokenizer.ggml.tokens")?
        .with_context(|| format!("{path} has no tokenizer.ggml.tokens"))?;
    if tokens.len() > vocab {
        bail!(
            "{path}: its tokenizer has {} tokens, more than the model's vocabulary of {vocab}",
            tokens.len()
        );
    }
    let n = tokens.len();
    let mut out = Vec::new();
    for (k, v) in &g.header.metadata {
        if !k.starts_with("tokenizer.") {
            continue;
        }
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.tokens", _) => Value::Array(Array::String(
                tokens
                    .iter()
                    .map(|s| s.to_string())
                    .chain(
                        (n..vocab).map(|i| match named.iter().find(|&&(id, _)| id == i) {
                            Some(&(_, t)) => t.to_string(),
                            None => format!("<|unused_{i}|>"),
                        }),
                    )
                    .collect::<StrArray>(),
            )),
            ("tokenizer.ggml.token_type", Value::Array(Array::I32(t))) => {
                let mut t = t.clone();
                t.resize(vocab, 5);
                for &(id, _) in named {
                    t[id] = 3;
                }
                Value::Array(Array::I32(t))
            }
            ("tokenizer.ggml.scores", Value::Array(Array::F32(t))) => {
                let mut t = t.clone();
                t.resize(vocab, 0.0);
                Value::Array(Array::F32(t))
            }
            (k, Value::Array(a)) if a.len() == n && k != "tokenizer.ggml.merges" => {
                bail!("{path}: per-token metadata '{k}' of a type this command does not pad")
            }
            _ => v.clone(),
        };
        out.push((k.clone(), v));
    }
    Ok(out)
}

fn gguf_metadata(
    args: &Args,
    s: &ModelShape,
    family: Family,
    tok: Vec<(String, Value)>,
) -> Vec<(String, Value)> {
    // LLAMA_FTYPE_MOSTLY_Q4_1 / _Q4_K_M / _BF16
    let file_type = match args.quant.as_str() {
        "q4_1" => 3,
        "q4_k_m" => 15,
        "mxfp4" => 38,
        _ => 32,
    };
    let arch = family.name();
    let u = |k: &str, v: u32| (format!("{arch}.{k}"), Value::U32(v));
    let mut m = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (
            "general.name".into(),
            Value::String(format!("synthetic {} (seed {})", s.name, args.seed)),
        ),
        ("general.file_type".into(), Value::U32(file_type)),
        u("block_count", s.layers),
        u("context_length", s.max_context),
        u("embedding_length", s.hidden),
        u("feed_forward_length", s.ffn),
        u("attention.head_count", s.heads),
        u("attention.head_count_kv", s.kv_heads),
        u("attention.key_length", s.head_dim),
        u("attention.value_length", s.head_dim),
        u("rope.dimension_count", s.rotary_dim.unwrap_or(s.head_dim)),
        u("vocab_size", s.vocab),
        (
            format!("{arch}.rope.freq_base"),
            Value::F32(s.rope_theta as f32),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(s.norm_eps as f32),
        ),
    ];
    if let Some(w) = &s.sliding {
        m.extend([
            u("attention.sliding_window", w.window),
            u("attention.sliding_window_pattern", w.pattern),
            (
                format!("{arch}.rope.freq_base_swa"),
                Value::F32(w.rope_theta as f32),
            ),
        ]);
    }
    if let Some(lr) = &s.longrope {
        m.extend([
            u(
                "rope.scaling.original_context_length",
                lr.original_max_position_embeddings,
            ),
            (
                format!("{arch}.rope.scaling.attn_factor"),
                Value::F32(metrale_core::shape::longrope_attention_factor(
                    s.max_context as f64,
                    lr.original_max_position_embeddings as f64,
                ) as f32),
            ),
        ]);
    }
    if let Some(y) = &s.yarn {
        let f = |k: &str, v: f64| (format!("{arch}.{k}"), Value::F32(v as f32));
        m.extend([
            (
                format!("{arch}.rope.scaling.type"),
                Value::String("yarn".into()),
            ),
            f("rope.scaling.factor", y.factor),
            u(
                "rope.scaling.original_context_length",
                y.original_max_position_embeddings,
            ),
            f("rope.scaling.yarn_beta_fast", y.beta_fast),
            f("rope.scaling.yarn_beta_slow", y.beta_slow),
        ]);
    }
    if let Some(x) = &s.experts {
        m.extend([
            u("expert_count", x.count),
            u("expert_used_count", x.used),
            u("expert_feed_forward_length", x.ffn),
        ]);
    }
    m.extend(tok);
    m
}

fn write_gguf(
    args: &Args,
    s: &ModelShape,
    family: Family,
    tensors: &[Tensor],
    tok: Vec<(String, Value)>,
    threads: usize,
) -> Result<u64> {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.gguf.clone(),
            dtype: t.dtype,
            shape: match (t.rows, t.experts) {
                (1, _) => vec![t.cols],
                (_, Some(n)) => vec![t.cols, t.rows / n, n],
                _ => vec![t.cols, t.rows],
            },
        })
        .collect();
    let layout = gguf_writer::layout(&gguf_metadata(args, s, family, tok), &specs)
        .map_err(anyhow::Error::msg)?;
    let file = create(&args.out, layout.len)?;
    file.write_all_at(&layout.header, 0)?;
    fill(
        &file,
        &args.out,
        tensors,
        &layout.offsets,
        &vec![None; tensors.len()],
        args.seed,
        true,
        threads,
    )?;
    Ok(layout.len)
}

fn write_hf(
    args: &Args,
    s: &ModelShape,
    family: Family,
    tensors: &[Tensor],
    tok: Vec<(String, Value)>,
    tok_path: &Path,
    threads: usize,
) -> Result<u64> {
    let dir = &args.out;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // tensors without an HF name of their own: gpt-oss's experts, written as its HF tensors
    let (tensors, fused): (Vec<Tensor>, Vec<Tensor>) =
        tensors.iter().cloned().partition(|t| t.hf.is_some());
    let tensors = &tensors[..];
    // the tokenizer: the padded GGUF metadata read back by the runtime, written as tokenizer.json
    let meta_only = gguf_writer::layout(&tok, &[])
        .map_err(anyhow::Error::msg)?
        .header;
    let g = GgufFile::from_bytes(&meta_only, tok_path)?;
    let cfg = metrale_model::ModelConfig::special_tokens_from_gguf(&g)?;
    let tk = metrale_model::Tokenizer::from_gguf(&g, cfg.0, cfg.1.clone(), cfg.2)?;
    let text =
        |id: Option<u32>| id.map(|i| String::from_utf8_lossy(tk.token_bytes_ref(i)).into_owned());
    std::fs::write(dir.join("tokenizer.json"), tk.to_hf_json()?)?;
    let mut tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": cfg.2,
        "bos_token": text(cfg.0),
        "eos_token": text(cfg.1.first().copied()),
        "model_max_length": s.max_context,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(t) = g.opt_str("tokenizer.chat_template")? {
        tc["chat_template"] = json!(t);
    }
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc)?,
    )?;
    let mut config = json!({
        "architectures": [family.hf_architecture()],
        "model_type": family.hf_model_type(),
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_context,
        "vocab_size": s.vocab,
        "tie_word_embeddings": s.tied_embeddings,
        "mlp_bias": false,
        "torch_dtype": "bfloat16",
        "bos_token_id": cfg.0,
        "eos_token_id": cfg.1.first(),
    });
    if family.features().gelu {
        config["hidden_activation"] = json!("gelu_pytorch_tanh");
    } else {
        config["hidden_act"] = json!("silu");
    }
    if family.features().post_norms {
        // Gemma 3's config has no MLP bias key
        config
            .as_object_mut()
            .expect("an object")
            .remove("mlp_bias");
    }
    if let Some(w) = &s.sliding {
        let types: Vec<&str> = (0..s.layers)
            .map(|l| match (l + 1) % w.pattern {
                0 => "full_attention",
                _ => "sliding_attention",
            })
            .collect();
        config["sliding_window"] = json!(w.window);
        config["layer_types"] = json!(types);
        config["rope_local_base_freq"] = json!(w.rope_theta);
    }
    if let Some(q) = s.query_pre_attn_scalar {
        // an integer in Gemma 3's config (transformers checks the type)
        config["query_pre_attn_scalar"] = match q.fract() == 0.0 {
            true => json!(q as u64),
            false => json!(q),
        };
    }
    if family.qkv_bias() && !family.features().oai_moe {
        // Qwen2's modelling code always has its Q/K/V biases; its configs carry the (unused)
        // sliding window instead
        config["use_sliding_window"] = json!(false);
        config["sliding_window"] = json!(s.max_context);
        config["max_window_layers"] = json!(s.layers);
    } else {
        config["attention_bias"] = json!(false);
    }
    if let Some(x) = &s.experts {
        config["num_experts"] = json!(x.count);
        config["num_experts_per_tok"] = json!(x.used);
        config["moe_intermediate_size"] = json!(x.ffn);
        config["norm_topk_prob"] = json!(true);
        config["decoder_sparse_step"] = json!(1);
        config["mlp_only_layers"] = json!([]);
    }
    if family.features().oai_moe {
        // transformers' GptOssConfig: the experts' width is intermediate_size, biases on the
        // attention's projections, one RoPE (YaRN) for every layer
        let c = config.as_object_mut().expect("an object");
        for k in [
            "mlp_bias",
            "num_experts",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "rope_local_base_freq",
            "use_sliding_window",
            "max_window_layers",
        ] {
            c.remove(k);
        }
        if let Some(x) = &s.experts {
            c.insert("num_local_experts".into(), json!(x.count));
            c.insert("intermediate_size".into(), json!(x.ffn));
        }
        c.insert("attention_bias".into(), json!(true));
        c.insert("swiglu_limit".into(), json!(7.0));
    }
    if let Some(y) = &s.yarn {
        config["rope_scaling"] = json!({
            "rope_type": "yarn",
            "factor": y.factor,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "truncate": y.truncate,
            "original_max_position_embeddings": y.original_max_position_embeddings,
        });
    }
    if let Some(r) = s.rotary_dim {
        config["partial_rotary_factor"] = json!(r as f64 / s.head_dim as f64);
    }
    if let Some(lr) = &s.longrope {
        config["original_max_position_embeddings"] = json!(lr.original_max_position_embeddings);
        config["rope_scaling"] = json!({
            "type": "longrope",
            "short_factor": lr.short_factor,
            "long_factor": lr.long_factor,
        });
    }
    if let Some(r) = &s.rope_scaling {
        config["rope_scaling"] = json!({
            "rope_type": r.rope_type,
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        });
    }
    if fused.iter().any(|t| t.dtype == DType::MXFP4) {
        // what OpenAI's gpt-oss checkpoints carry
        config["quantization_config"] = json!({
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        });
    }
    if tensors.iter().any(|t| t.dtype == DType::F8_E4M3) {
        // what llm-compressor writes for its FP8_DYNAMIC scheme (vLLM's FP8 checkpoints)
        config["quantization_config"] = json!({
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": true,
                            "strategy": "channel", "dynamic": false},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": true,
                                      "strategy": "token", "dynamic": true},
            }},
            "ignore": ["lm_head"],
        });
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&json!({"bos_token_id": cfg.0, "eos_token_id": cfg.1}))?,
    )?;
    // model.safetensors: u64 header length, JSON header (padded with spaces to 8 bytes), data
    // each entry's keys in sorted order, so the bytes are the same whether or not serde_json
    // keeps insertion order (a feature another crate of the build may turn on)
    let mut header = BTreeMap::new();
    let mut rel = Vec::new();
    let mut scale_rel = Vec::new();
    let mut off = 0usize;
    let mut fused_at = Vec::new();
    for (name, dtype, shape, bytes) in gpt_oss_expert_layout(s, &fused)? {
        header.insert(
            name.clone(),
            json!({"data_offsets": [off, off + bytes], "dtype": dtype, "shape": shape}),
        );
        fused_at.push((name, off));
        off += bytes;
    }
    for t in tensors {
        let n = t
            .dtype
            .tensor_bytes(t.cols, t.rows)
            .context("tensor size")?;
        let shape = if t.rows == 1 {
            vec![t.cols]
        } else {
            vec![t.rows, t.cols]
        };
        let hf = t.hf.clone().context("tensor without an HF name")?;
        let dtype = match t.dtype {
            DType::F8_E4M3 => "F8_E4M3",
            _ => "BF16",
        };
        header.insert(
            hf.clone(),
            json!({"data_offsets": [off, off + n], "dtype": dtype, "shape": shape}),
        );
        rel.push(off);
        off += n;
        if t.dtype == DType::F8_E4M3 {
            // one f32 scale per output channel, [rows, 1] as compressed-tensors stores it
            let n = 4 * t.rows;
            header.insert(
                format!("{hf}_scale"),
                json!({"data_offsets": [off, off + n], "dtype": "F32", "shape": [t.rows, 1]}),
            );
            scale_rel.push(Some(off));
            off += n;
        } else {
            scale_rel.push(None);
        }
    }
    let mut h = serde_json::to_vec(&json!({"__metadata__": {"format": "pt"}}))?;
    let mut all = serde_json::Map::new();
    all.insert("__metadata__".into(), json!({"format": "pt"}));
    all.extend(header);
    h.clear();
    serde_json::to_writer(&mut h, &all)?;
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let base = 8 + h.len();
    let path = dir.join("model.safetensors");
    let len = (base + off) as u64;
    let file = create(&path, len)?;
    file.write_all_at(&(h.len() as u64).to_le_bytes(), 0)?;
    file.write_all_at(&h, 8)?;
    let offsets: Vec<u64> = rel.iter().map(|r| (base + r) as u64).collect();
    let scales: Vec<Option<u64>> = scale_rel
        .iter()
        .map(|r| r.map(|r| (base + r) as u64))
        .collect();
    fill(
        &file, &path, tensors, &offsets, &scales, args.seed, false, threads,
    )?;
    for (name, at) in fused_at {
        let bytes = gpt_oss_expert_bytes(&name, &fused, args.seed)?;
        file.write_all_at(&bytes, (base + at) as u64)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(len)
}

/// gpt-oss's HF expert tensors of each layer whose GGUF-named expert tensors are in `fused`:
/// (HF name, safetensors dtype, shape, bytes). bf16 experts: `mlp.experts.gate_up_proj`
/// `[experts, hidden, 2 ffn]` (gate and up columns interleaved) and `mlp.experts.down_proj`
/// `[experts, ffn, hidden]` (transformers' `GptOssExperts`); MXFP4 experts as OpenAI's
/// checkpoints hold them: `{gate_up,down}_proj_blocks` `[experts, rows, cols / 32, 16]` (two
/// FP4 codes a byte, element 2j in the low nibble) and `_scales` `[experts, rows, cols / 32]`
/// (E8M0), rows gate and up interleaved and down's rows its outputs; `gate_up_proj_bias`
/// `[experts, 2 ffn]` in bf16 either way.
#[allow(clippy::type_complexity)]
fn gpt_oss_expert_layout(
    s: &ModelShape,
    fused: &[Tensor],
) -> Result<Vec<(String, &'static str, Vec<usize>, usize)>> {
    let mut out = Vec::new();
    let Some(x) = &s.experts else {
        return Ok(out);
    };
    let (n, f, h) = (x.count as usize, x.ffn as usize, s.hidden as usize);
    for l in 0..s.layers as usize {
        let Some(gate) = fused
            .iter()
            .find(|t| t.gguf == format!("blk.{l}.ffn_gate_exps.weight"))
        else {
            continue;
        };
        let p = |w: &str| format!("model.layers.{l}.mlp.experts.{w}");
        out.push((
            p("gate_up_proj_bias"),
            "BF16",
            vec![n, 2 * f],
            2 * n * 2 * f,
        ));
        if gate.dtype == DType::MXFP4 {
            for (w, rows, cols) in [("gate_up_proj", 2 * f, h), ("down_proj", h, f)] {
                let nb = cols / 32;
                out.extend([
                    (
                        p(&format!("{w}_blocks")),
                        "U8",
                        vec![n, rows, nb, 16],
                        n * rows * nb * 16,
                    ),
                    (
                        p(&format!("{w}_scales")),
                        "U8",
                        vec![n, rows, nb],
                        n * rows * nb,
                    ),
                ]);
            }
        } else {
            out.extend([
                (
                    p("gate_up_proj"),
                    "BF16",
                    vec![n, h, 2 * f],
                    2 * n * h * 2 * f,
                ),
                (p("down_proj"), "BF16", vec![n, f, h], 2 * n * f * h),
            ]);
        }
    }
    Ok(out)
}

/// The bf16 bytes of one of [`gpt_oss_expert_layout`]'s tensors, from the values of the GGUF
/// tensors it is made of (the same rows `fill` would write for a GGUF).
fn gpt_oss_expert_bytes(hf: &str, fused: &[Tensor], seed: u64) -> Result<Vec<u8>> {
    let (layer, what) = hf
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once(".mlp.experts."))
        .context("a gpt-oss expert tensor name")?;
    let find = |n: &str| {
        let name = format!("blk.{layer}.{n}");
        fused
            .iter()
            .find(|t| t.gguf == name)
            .with_context(|| format!("no tensor {name}"))
    };
    let rows = |t: &Tensor| -> Vec<Vec<f32>> {
        (0..t.rows)
            .map(|r| {
                let mut v = vec![0f32; t.cols];
                row_values(seed, &t.gguf, t.row0 + r, &t.init, &mut v);
                v
            })
            .collect()
    };
    // out[e][c][i][k] = srcs[k][e * per + i][c]: each expert's `per` rows of the sources as
    // columns, the sources' values interleaved (a bias is one row an expert)
    let columns = |srcs: &[Vec<Vec<f32>>], n: usize| {
        let (per, cols) = (srcs[0].len() / n, srcs[0][0].len());
        let mut out = Vec::with_capacity(2 * srcs.len() * per * n * cols);
        for e in 0..n {
            for c in 0..cols {
                for i in 0..per {
                    for src in srcs {
                        out.extend(f32_to_bf16(src[e * per + i][c]).to_le_bytes());
                    }
                }
            }
        }
        out
    };
    let n = find("ffn_gate_exps.weight")?
        .experts
        .context("an expert tensor")?;
    let out = match what {
        // [e][c][2i + k] = (gate, up)[k][e][i][c]; the bias [e][2i + k] = (gate, up)[k][e][i]
        "gate_up_proj" | "gate_up_proj_bias" => {
            let suffix = if what.ends_with("_bias") {
                "bias"
            } else {
                "weight"
            };
            let gate = rows(find(&format!("ffn_gate_exps.{suffix}"))?);
            let up = rows(find(&format!("ffn_up_exps.{suffix}"))?);
            columns(&[gate, up], n)
        }
        // [e][f][h] = down[e][h][f]
        "down_proj" => columns(&[rows(find("ffn_down_exps.weight")?)], n),
        // MXFP4: each row quantized as the GGUF's, gate and up rows interleaved
        w if w.ends_with("_blocks") || w.ends_with("_scales") => {
            let rows_of = |n: &str| -> Result<Vec<Vec<f32>>> { Ok(rows(find(n)?)) };
            let ordered: Vec<Vec<f32>> = if w.starts_with("gate_up") {
                let (g, u) = (
                    rows_of("ffn_gate_exps.weight")?,
                    rows_of("ffn_up_exps.weight")?,
                );
                g.into_iter().zip(u).flat_map(|(g, u)| [g, u]).collect()
            } else {
                rows_of("ffn_down_exps.weight")?
            };
            let mut out = Vec::new();
            for r in &ordered {
                let mut q = vec![0u8; DType::MXFP4.row_bytes(r.len()).context("whole blocks")?];
                quantize_row(DType::MXFP4, r, &mut q)?;
                for b in q.chunks_exact(17) {
                    if w.ends_with("_scales") {
                        out.push(b[0]);
                        continue;
                    }
                    // ggml: element j low nibble of byte j, j + 16 its high nibble; OpenAI's:
                    // elements 2j and 2j + 1 in byte j
                    let code = |e: usize| match e < 16 {
                        true => b[1 + e] & 0x0f,
                        false => b[1 + e - 16] >> 4,
                    };
                    out.extend((0..16).map(|j| code(2 * j) | (code(2 * j + 1) << 4)));
                }
            }
            out
        }
        other => bail!("no gpt-oss expert tensor '{other}'"),
    };
    Ok(out)
}

fn create(path: &Path, len: u64) -> Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.set_len(len)
        .with_context(|| format!("sizing {} to {len} bytes", path.display()))?;
    Ok(f)
}

/// Generate and write every tensor's rows: work items of whole rows (~4 MiB each) taken by
/// `threads` workers from one counter. `gguf`: permute q/k rows to GGUF's rope order. An FP8
/// tensor's rows are quantized with their own scale (`metrale_core::fp8`), written as f32 at
/// `scales[i]`.
#[allow(clippy::too_many_arguments)]
fn fill(
    file: &std::fs::File,
    path: &Path,
    tensors: &[Tensor],
    offsets: &[u64],
    scales: &[Option<u64>],
    seed: u64,
    gguf: bool,
    threads: usize,
) -> Result<()> {
    let mut work = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let rb = t.dtype.row_bytes(t.cols).context("row size")?;
        let per = (4 << 20) / rb.max(1);
        let per = per.max(1);
        let mut r = 0;
        while r < t.rows {
            work.push((i, r, (r + per).min(t.rows)));
            r += per;
        }
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| -> Result<()> {
                    let mut vals = Vec::new();
                    let mut buf = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(i, r0, r1)) = work.get(k) else {
                            return Ok(());
                        };
                        let t = &tensors[i];
                        let rb = t.dtype.row_bytes(t.cols).unwrap_or(0);
                        buf.resize((r1 - r0) * rb, 0);
                        vals.resize(t.cols, 0f32);
                        for r in r0..r1 {
                            let src = match (gguf, t.qk_heads) {
                                (true, Some(nh)) => gguf_row_source(r, t.rows / nh),
                                _ => r,
                            };
                            row_values(seed, &t.gguf, t.row0 + src, &t.init, &mut vals);
                            if !gguf && t.hf_offset != 0.0 {
                                vals.iter_mut().for_each(|v| *v += t.hf_offset);
                            }
                            if let Some(at) = scales[i] {
                                let q = metrale_core::fp8::quantize_matrix(&vals, 1, t.cols);
                                buf[(r - r0) * rb..(r - r0 + 1) * rb].copy_from_slice(&q.bytes);
                                file.write_all_at(&q.scales[0].to_le_bytes(), at + 4 * r as u64)
                                    .with_context(|| format!("writing {}", path.display()))?;
                                continue;
                            }
                            quantize_row(
                                t.dtype,
                                &vals,
                                &mut buf[(r - r0) * rb..(r - r0 + 1) * rb],
                            )?;
                        }
                        file.write_all_at(&buf, offsets[i] + (r0 * rb) as u64)
                            .with_context(|| format!("writing {}", path.display()))?;
                    }
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| anyhow::anyhow!("a writer thread panicked"))?
        })
    })
}

/// The HF row that GGUF row `r` of a q/k projection holds: within each head of `hd` rows, GGUF row
/// 2j + t is HF row t * hd/2 + j (llama.cpp's converter's permutation, `hf::permute_qk_rows`).
fn gguf_row_source(r: usize, hd: usize) -> usize {
    let (h, w) = (r / hd, r % hd);
    h * hd + (w % 2) * (hd / 2) + w / 2
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Row `row` (HF orientation) of the tensor named `name` (its GGUF name): a SplitMix64 stream
/// seeded by (seed, name, row), mapped to the tensor's distribution and rounded to bf16.
fn row_values(seed: u64, name: &str, row: usize, init: &Init, out: &mut [f32]) {
    let mut state = splitmix(seed ^ name_hash(name) ^ splitmix(row as u64));
    let mut unit = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = splitmix(state);
        // 24 random bits -> [-1, 1)
        (z >> 40) as f32 * (2.0 / (1u64 << 24) as f32) - 1.0
    };
    let bf = |x: f32| metrale_core::dtype::bf16_to_f32(f32_to_bf16(x));
    match init {
        Init::Uniform(a) => out.iter_mut().for_each(|o| *o = bf(unit() * a)),
        Init::Norm => out.iter_mut().for_each(|o| *o = bf(1.0 + 0.25 * unit())),
        Init::Values(v) => out.copy_from_slice(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_row_order_is_the_converters_permutation() {
        // 2 heads of 4 rows: HF rows [0 1 2 3 | 4 5 6 7] -> GGUF [0 2 1 3 | 4 6 5 7]
        let got: Vec<usize> = (0..8).map(|r| gguf_row_source(r, 4)).collect();
        assert_eq!(got, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        // and it is what the HF reader applies
        let rows: Vec<u8> = (0..8).collect();
        let permuted = metrale_model::hf::permute_qk_rows(&rows, 8, 1, 2).unwrap();
        assert_eq!(permuted, got.iter().map(|&r| r as u8).collect::<Vec<_>>());
    }

    #[test]
    fn rows_are_deterministic_and_scaled() {
        let mut a = vec![0f32; 4096];
        let mut b = vec![0f32; 4096];
        row_values(7, "blk.0.attn_q.weight", 3, &Init::Uniform(0.5), &mut a);
        row_values(7, "blk.0.attn_q.weight", 3, &Init::Uniform(0.5), &mut b);
        assert_eq!(a, b);
        row_values(7, "blk.0.attn_q.weight", 4, &Init::Uniform(0.5), &mut b);
        assert_ne!(a, b);
        assert!(a.iter().all(|v| v.abs() <= 0.5));
        let var = a.iter().map(|v| v * v).sum::<f32>() / a.len() as f32;
        // uniform on [-0.5, 0.5]: variance 1/12
        assert!((var - 1.0 / 12.0).abs() < 0.01, "{var}");
    }
}
