//! `cargo xtask quantize MODEL.gguf --to TYPE --out OUT.gguf`: a GGUF re-encoded in another weight
//! type with this project's quantizers, as llama.cpp's `llama-quantize` does with its own: the
//! accuracy benchmarks (bench/perplexity/) compare the two on the same source file.
//!
//! Every matrix (a tensor of two or more dimensions, norms, `rope_freqs` and a mixture's router
//! `ffn_gate_inp` excepted) is dequantised
//! by the reference (`metrale_core::dtype::dequantize_row`) and quantized to the type `--to` names;
//! the other tensors and every metadata key are copied (`general.file_type` set to llama.cpp's number
//! for the result). `--to` takes an element type (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0,
//! q4_k, q5_k, q6_k) or one of llama.cpp's K-quant mixes, `q4_k_m` and `q5_k_m` ([`mix_type`]).
//! A tied embedding takes the LM head's type in the mixes, as llama.cpp gives it. Rows that are not
//! whole 256-element super-blocks take llama.cpp's fallbacks: Q4_K -> Q5_0,
//! Q5_K -> Q5_1, Q6_K -> Q8_0 (SmolLM2's 576-column matrices). `f32` is exact: the dequantised
//! values themselves (the reference the quantized files are measured against).

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use metrale_core::dtype::{dequantize_row, quantize_row, DType};
use metrale_model::gguf::{GgufFile, Value};
use metrale_model::gguf_writer::{self, TensorSpec};

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF to re-encode.
    pub model: PathBuf,
    /// The weight type: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, or the mixes
    /// q4_k_m and q5_k_m.
    #[arg(long)]
    pub to: String,
    /// Where to write the new GGUF.
    #[arg(long)]
    pub out: PathBuf,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// llama.cpp's K-quant mixes (`llama-quantize`'s choices for the Q4_K_M and Q5_K_M file types): the
/// base type for every matrix, Q6_K for the LM head and, on the layers where `use_more_bits` holds
/// (the first and last eighth of the layers, and every third between), for `attn_v` and `ffn_down`
/// (experts too). `base` is Q4_K or Q5_K; any other base is returned unchanged.
pub fn mix_type(name: &str, layers: usize, base: DType) -> DType {
    if !matches!(base, DType::Q4_K | DType::Q5_K) {
        return base;
    }
    let more_bits = |i: usize| i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2;
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse::<usize>().ok());
    let six = name == "output.weight"
        || (layer.is_some_and(more_bits)
            && [".attn_v.", ".ffn_down.", ".ffn_down_exps."]
                .iter()
                .any(|p| name.contains(p)));
    if six {
        DType::Q6_K
    } else {
        base
    }
}

/// llama.cpp's fallback for a K-quant whose rows (`cols` elements) are not whole super-blocks.
pub fn fallback(t: DType, cols: usize) -> DType {
    if cols.is_multiple_of(t.block_elems()) {
        return t;
    }
    match t {
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        t => t,
    }
}

/// The single types `--to` takes (with the q4_k_m and q5_k_m mixes).
const WRITES: [DType; 11] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

/// llama.cpp's `general.file_type` number (`enum llama_ftype`) of a `--to` value.
fn file_type(to: &str) -> u32 {
    match to {
        "f32" => 0,
        "f16" => 1,
        "q4_0" => 2,
        "q4_1" => 3,
        "q8_0" => 7,
        "q5_0" => 8,
        "q5_1" => 9,
        "q4_k" | "q4_k_m" => 15,
        "q5_k" | "q5_k_m" => 17,
        "q6_k" => 18,
        _ => 32, // bf16
    }
}

pub fn run(args: Args) -> Result<()> {
    let t0 = Instant::now();
    let (base, mix) = match args.to.as_str() {
        "q4_k_m" => (DType::Q4_K, true),
        "q5_k_m" => (DType::Q5_K, true),
        // the types this project writes (the others it reads, Q2_K, Q3_K and the IQ types,
        // come from llama-quantize)
        t => match DType::from_name(t).filter(|d| WRITES.contains(d)) {
            Some(d) => (d, false),
            None => bail!(
                "--to {t}: not a type this command writes; one of f32, f16, bf16, q4_0, q4_1, \
                 q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, q4_k_m, q5_k_m"
            ),
        },
    };
    if args.out.exists() && std::fs::canonicalize(&args.out)? == std::fs::canonicalize(&args.model)?
    {
        bail!(
            "--out {} is the model itself: write the new file elsewhere",
            args.out.display()
        );
    }
    let src =
        GgufFile::open(&args.model).with_context(|| format!("reading {}", args.model.display()))?;
    let h = &src.header;
    let arch = match h.metadata.get("general.architecture") {
        Some(Value::String(a)) => a.clone(),
        _ => bail!("{}: no general.architecture", args.model.display()),
    };
    let layers = h
        .metadata
        .get(&format!("{arch}.block_count"))
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    // a tied embedding is the LM head too: the mixes give it the head's type
    let tied = !h.tensors.iter().any(|t| t.name == "output.weight");
    let specs: Vec<TensorSpec> = h
        .tensors
        .iter()
        .map(|t| {
            // (a mixture's router stays as it is, as llama-quantize leaves it: its logits pick
            // the experts, and a near-tie moved by rounding changes a token's whole MLP)
            let matrix = t.shape.len() >= 2
                && !t.name.ends_with("_norm.weight")
                && !t.name.ends_with("ffn_gate_inp.weight")
                && t.name != "rope_freqs.weight";
            let dtype = if !matrix {
                t.dtype
            } else {
                let d = if mix {
                    let head = tied && t.name == "token_embd.weight";
                    mix_type(if head { "output.weight" } else { &t.name }, layers, base)
                } else {
                    base
                };
                fallback(d, t.shape[0])
            };
            TensorSpec {
                name: t.name.clone(),
                dtype,
                shape: t.shape.clone(),
            }
        })
        .collect();
    for (s, t) in specs.iter().zip(&h.tensors) {
        if s.dtype.row_bytes(t.shape[0]).is_none() {
            bail!(
                "{}: rows of {} elements are not whole {}-element blocks of {}",
                t.name,
                t.shape[0],
                s.dtype.block_elems(),
                s.dtype
            );
        }
    }
    let mut meta: Vec<(String, Value)> = h
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    match meta.iter_mut().find(|(k, _)| k == "general.file_type") {
        Some((_, v)) => *v = Value::U32(file_type(&args.to)),
        None => meta.push(("general.file_type".into(), Value::U32(file_type(&args.to)))),
    }
    let layout = gguf_writer::layout(&meta, &specs).map_err(anyhow::Error::msg)?;
    let out = std::fs::File::create(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    out.set_len(layout.len)?;
    out.write_all_at(&layout.header, 0)?;
    let input = std::fs::File::open(&args.model)?;
    // work items: one tensor's rows in ~4 MiB pieces of the source
    let mut work = Vec::new();
    for (i, t) in h.tensors.iter().enumerate() {
        let rows: usize = t.shape[1..].iter().product::<usize>().max(1);
        let rb = t.n_bytes / rows;
        let per = ((4 << 20) / rb.max(1)).max(1);
        let mut r = 0;
        while r < rows {
            work.push((i, r, (r + per).min(rows)));
            r += per;
        }
    }
    let next = AtomicUsize::new(0);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    std::thread::scope(|sc| -> Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| -> Result<()> {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(i, r0, r1)) = work.get(k) else {
                            return Ok(());
                        };
                        let (t, s) = (&h.tensors[i], &specs[i]);
                        let cols = t.shape[0];
                        let rows: usize = t.shape[1..].iter().product::<usize>().max(1);
                        let (rb_in, rb_out) = (t.n_bytes / rows, s.dtype.row_bytes(cols).unwrap());
                        let mut src_bytes = vec![0u8; (r1 - r0) * rb_in];
                        input.read_exact_at(&mut src_bytes, (t.file_offset + r0 * rb_in) as u64)?;
                        let bytes = if s.dtype == t.dtype {
                            src_bytes
                        } else {
                            let mut vals = vec![0f32; cols];
                            let mut o = vec![0u8; (r1 - r0) * rb_out];
                            for r in 0..r1 - r0 {
                                dequantize_row(
                                    t.dtype,
                                    &src_bytes[r * rb_in..(r + 1) * rb_in],
                                    &mut vals,
                                )
                                .with_context(|| t.name.clone())?;
                                quantize_row(s.dtype, &vals, &mut o[r * rb_out..(r + 1) * rb_out])
                                    .with_context(|| t.name.clone())?;
                            }
                            o
                        };
                        out.write_all_at(&bytes, layout.offsets[i] + (r0 * rb_out) as u64)?;
                    }
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow::anyhow!("a worker thread panicked"))??;
        }
        Ok(())
    })?;
    let mut counts = std::collections::BTreeMap::new();
    for s in &specs {
        *counts.entry(s.dtype.name()).or_insert(0) += 1;
    }
    eprintln!(
        "quantize: {} -> {} ({}): {:.2} GB in {:.1} s; tensors by type {counts:?}",
        args.model.display(),
        args.out.display(),
        args.to,
        layout.len as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    println!("{}", args.out.display());
    Ok(())
}
