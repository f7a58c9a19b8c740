//! Perplexity of a checkpoint on a text, as llama.cpp's `llama-perplexity` defines it, so that the
//! two can be compared on the same files (numbers, not a test).
//!
//! The text is tokenized whole (with the model's BOS where its tokenizer adds one) and cut into
//! chunks of `--ctx` tokens (default 512); in each chunk the first token becomes BOS (where the
//! model uses one), the first half is context and every later position predicts the next token:
//! -log softmax(logits)[next] summed over positions ctx/2 .. ctx-2 of every chunk, perplexity =
//! exp(mean). The uncertainty is llama-perplexity's: the standard error of the mean negative log
//! likelihood carried through exp. Each chunk is one step where the backend verifies proposed
//! tokens (the CPU backend: rows the same bits as the decode path's), else its context half is
//! prefilled and each scored token fed alone (`teacher_forced_logits`: the decode path).
//!
//! With `--reference MODEL2` the same positions also run on a second checkpoint (same tokenizer,
//! e.g. a less quantized file): its perplexity, the share of positions where both pick the same
//! top-1 token, and the mean KL divergence KL(reference || model) of the next-token distributions.
//!
//! Usage: perplexity MODEL TEXT [--ctx N] [--chunks N] [--reference MODEL2] [--exact]
//!                   [--one-token] [--kv f32|bf16|fp8] [--quantization fp8]
//!                   [--cuda KERNEL_DIR TARGET_ID] [--out FILE.json]
//! - `--kv f32|bf16|fp8`: MODEL's KV cache type (default f32; the reference's stays f32);
//! - `--quantization fp8`: MODEL's layer matrices quantized to FP8 at load, as the server's flag
//!   does (`metrale_model::fp8::quantize_at_load`); the reference stays as its file is;
//! - default backend: cpu (f32 KV cache; `--exact`: f32 activations); `--cuda` as golden_check's
//!   (the reference then runs on the CPU backend);
//! - `--chunks N`: the first N chunks only (default all);
//! - `--one-token`: feed each scored token alone even where the backend gives a chunk's rows
//!   from one step (the CPU backend: the same bits, ~20x slower; a check of that claim).

#[path = "shared/tool.rs"]
mod tool;

use metrale_backend::{Backend, KvDtype};
use serde_json::json;
use std::time::Instant;
use tool::{cpu_backend, cuda_backend, opt};

/// log softmax(row)[i] in f64.
fn log_prob(row: &[f32], i: usize) -> f64 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
    row[i] as f64 - m - s.ln()
}

/// KL(p || q) of the distributions softmax(p), softmax(q), in f64.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let lse = |r: &[f32]| {
        let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + r.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p), lse(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum()
}

/// Negative log likelihoods (and the logits rows) of one chunk's scored positions. A backend
/// that verifies proposed tokens gives every scored row from one step (the chunk's tokens after
/// the context half fed as proposals: `SeqStep::drafted` with `want_logits`); the CPU backend's
/// rows are the same bits as feeding the tokens one at a time. Otherwise (or with `--one-token`)
/// the context half is prefilled and each scored token fed alone.
fn score(
    b: &mut dyn Backend,
    chunk: &[u32],
    vocab: usize,
    one_token: bool,
) -> (Vec<f64>, Vec<Vec<f32>>) {
    let first = chunk.len() / 2;
    let rows = if b.info().verifies_drafts && !one_token {
        let table = metrale_backend::slot_blocks(0, b.info().slot_capacity);
        let p = metrale_backend::sampler::SamplingParams::default();
        let toks = &chunk[..chunk.len() - 1];
        let s = metrale_backend::SeqStep {
            slot: 0,
            start_pos: 0,
            tokens: toks,
            blocks: &table,
            history: toks,
            sampling: &p,
            draw: 0,
            want_logits: true,
            allowed: None,
            drafted: toks.len() - 1 - first,
        };
        let out = b.step(&[s]).expect("step").pop().expect("one output");
        let flat = out.logits.expect("the rows asked for");
        flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
    } else {
        metrale_backend::teacher_forced_logits(
            b,
            &chunk[..=first],
            &chunk[first + 1..chunk.len() - 1],
            None,
        )
        .expect("step")
    };
    let nll = rows
        .iter()
        .enumerate()
        .map(|(k, r)| -log_prob(r, chunk[first + 1 + k] as usize))
        .collect();
    (nll, rows)
}

fn ppl(nll: &[f64]) -> (f64, f64) {
    let n = nll.len() as f64;
    let mean = nll.iter().sum::<f64>() / n;
    let var = nll.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let err = (var / n).sqrt();
    (mean.exp(), mean.exp() * err)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: perplexity MODEL TEXT [--ctx N] [--chunks N] [--reference MODEL2] [--exact] [--one-token] [--kv f32|bf16|fp8] [--quantization fp8] [--cuda KERNEL_DIR TARGET_ID] [--out FILE.json]");
        std::process::exit(2);
    }
    let ctx: usize = opt(&args, "--ctx").map_or(512, |v| v.parse().expect("--ctx N"));
    if ctx < 4 {
        eprintln!("--ctx must be at least 4");
        std::process::exit(2);
    }
    let exact = args.iter().any(|a| a == "--exact");
    let one_token = args.iter().any(|a| a == "--one-token");
    let mut m = metrale_model::Model::load(std::path::Path::new(&args[1])).unwrap_or_else(|e| {
        eprintln!("{}: {e}", args[1]);
        std::process::exit(1)
    });
    let kv = opt(&args, "--kv").map_or(KvDtype::F32, |k| {
        KvDtype::parse(k).unwrap_or_else(|| {
            eprintln!("--kv {k}: f32, bf16 or fp8");
            std::process::exit(2)
        })
    });
    let quantization = opt(&args, "--quantization");
    match quantization {
        None => {}
        Some("fp8") => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let q = metrale_model::fp8::quantize_at_load(&mut m, threads).unwrap_or_else(|e| {
                eprintln!("--quantization fp8: {e}");
                std::process::exit(1)
            });
            eprintln!("quantized {} matrices to fp8 at load", q.matrices);
        }
        Some(q) => {
            eprintln!("--quantization {q}: only fp8");
            std::process::exit(2)
        }
    }
    let text = std::fs::read_to_string(&args[2]).unwrap_or_else(|e| {
        eprintln!("{}: {e}", args[2]);
        std::process::exit(1)
    });
    let bos = m.tokenizer.add_bos().then(|| m.tokenizer.bos()).flatten();
    let tokens = m
        .tokenizer
        .encode(&text, bos.is_some(), false)
        .expect("tokenize the text");
    let all = tokens.len() / ctx;
    let n_chunks =
        opt(&args, "--chunks").map_or(all, |v| v.parse::<usize>().expect("--chunks N").min(all));
    if n_chunks == 0 {
        eprintln!(
            "the text has {} tokens: fewer than one chunk of {ctx}",
            tokens.len()
        );
        std::process::exit(1);
    }
    let mut b = match opt(&args, "--cuda") {
        Some(dir) => {
            let target = args
                .iter()
                .position(|a| a == "--cuda")
                .and_then(|i| args.get(i + 2))
                .expect("--cuda KERNEL_DIR TARGET_ID");
            cuda_backend(&mut m, dir, target, (1, ctx), 0).0
        }
        None => cpu_backend(&m, kv, exact, (1, ctx)),
    };
    let reference = opt(&args, "--reference").map(|p| {
        let r = metrale_model::Model::load(std::path::Path::new(p)).unwrap_or_else(|e| {
            eprintln!("{p}: {e}");
            std::process::exit(1)
        });
        let probe: String = text.chars().take(2000).collect();
        if r.tokenizer.encode(&probe, false, false).ok()
            != m.tokenizer.encode(&probe, false, false).ok()
        {
            eprintln!("--reference {p}: its tokenizer encodes the text differently");
            std::process::exit(1);
        }
        let b = cpu_backend(&r, KvDtype::F32, exact, (1, ctx));
        (p.to_string(), b)
    });
    let mut reference = reference;
    let t0 = Instant::now();
    let (mut nll, mut nll_ref) = (Vec::new(), Vec::new());
    let (mut same, mut kl_sum) = (0usize, 0f64);
    for c in 0..n_chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(bos) = bos {
            chunk[0] = bos;
        }
        let (v, rows) = score(b.as_mut(), &chunk, m.config.vocab, one_token);
        nll.extend_from_slice(&v);
        if let Some((_, rb)) = reference.as_mut() {
            let (vr, rrows) = score(rb.as_mut(), &chunk, m.config.vocab, one_token);
            nll_ref.extend_from_slice(&vr);
            for (x, y) in rows.iter().zip(&rrows) {
                same += (metrale_backend::cpu::ops::argmax(x)
                    == metrale_backend::cpu::ops::argmax(y)) as usize;
                kl_sum += kl(y, x);
            }
        }
        let (p, e) = ppl(&nll);
        eprintln!("[{}/{n_chunks}] perplexity {p:.4} +/- {e:.4}", c + 1);
    }
    let (p, e) = ppl(&nll);
    let mut out = json!({
        "model": args[1],
        "text": args[2],
        "text_tokens": tokens.len(),
        "ctx": ctx,
        "chunks": n_chunks,
        "scored": nll.len(),
        "bos": bos,
        "backend": b.info().name,
        "exact_activations": exact,
        "quantization": quantization,
        "kv": kv.name(),
        "one_step_a_chunk": b.info().verifies_drafts && !one_token,
        "perplexity": p,
        "perplexity_err": e,
        "seconds": t0.elapsed().as_secs_f64(),
    });
    if let Some((path, _)) = &reference {
        let (pr, er) = ppl(&nll_ref);
        out["reference"] = json!({
            "model": path,
            "perplexity": pr,
            "perplexity_err": er,
            "top1_agreement": same as f64 / nll.len() as f64,
            "mean_kl": kl_sum / nll.len() as f64,
            "perplexity_ratio": p / pr,
        });
    }
    let s = serde_json::to_string_pretty(&out).unwrap();
    println!("{s}");
    if let Some(f) = opt(&args, "--out") {
        std::fs::write(f, s + "\n").expect("write --out");
    }
}
