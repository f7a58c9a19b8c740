//! A backend's logits on a checkpoint against a golden made by an independent implementation
//! (tests/golden/make_synth_golden_hf.py: HF transformers in f32 on the same files), and optionally
//! against the CPU backend on the same file. Prints one JSON object; exits 1 when a bound is broken.
//!
//! The golden holds a prompt (>= 100 token ids), 16 teacher-forced decode tokens, the reference's
//! top-20 (id, logit) at the prompt's last position and at each decode position, and the full last
//! row (`last_row_file`, little-endian f32, next to the golden). This tool prefills the prompt in one
//! step, then feeds each decode token alone (the decode path), and compares: the top-1 token at every
//! checked position, max |logit - reference| over the reference's top-20 of each and over the full
//! last row.
//!
//! Usage: golden_check MODEL GOLDEN.json [--tol X] [--kv f32|bf16] [--exact] [--prefill-chunk N] [--repeat N]
//!                     [--cuda KERNEL_DIR TARGET_ID] [--vs-cpu] [--cpu-tol X]
//! - `--prefill-chunk N`: prefill the prompt in steps of at most N tokens (default one step; on
//!   CUDA, short steps take the matrix-vector kernels instead of the GEMMs: `gemm::gemm_pays`);
//! - `--repeat N`: run the same steps N more times on the same backend and report, per position,
//!   the largest difference from the first run (a deterministic backend gives 0; any other value
//!   fails); the CUDA backend takes `METRALE_CUDA_TUNING` (ARCHITECTURE.md, "Configuration");
//! - default backend: cpu (`--kv`: its KV cache type, default f32; `--exact`: f32 activations);
//! - `--cuda`: the CUDA backend with a target's kernels (its KV type is the target's); reads
//!   METRALE_TARGETS (the targets/ folder, default `targets`); needs the `cuda` feature; an fp8
//!   target's checkpoint without FP8 matrices is quantized at load first (so `--vs-cpu` compares
//!   the two backends on the same FP8 weights);
//! - `--vs-cpu`: also run the CPU backend (with the same KV type, f32 activations) and report the
//!   largest difference between the two backends' logit rows and whether their greedy tokens agree
//!   (bounded by `--cpu-tol`, default `--tol`); where they do not, the position, both picks and
//!   the CPU row's margin between them (`vs_cpu.disagree`).

#[path = "shared/tool.rs"]
mod tool;

use metrale_backend::{Backend, KvDtype};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tool::{cpu_backend, cuda_backend, opt};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of token ids")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

/// Logits rows: the prompt's last position, then each teacher-forced decode position.
fn run(b: &mut dyn Backend, prompt: &[u32], decode: &[u32], chunk: Option<usize>) -> Vec<Vec<f32>> {
    metrale_backend::teacher_forced_logits(b, prompt, decode, chunk).expect("step")
}

fn argmax(r: &[f32]) -> usize {
    metrale_backend::cpu::ops::argmax(r)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: golden_check MODEL GOLDEN.json [--tol X] [--kv f32|bf16] [--exact] [--prefill-chunk N] [--repeat N] [--cuda KERNEL_DIR TARGET_ID] [--vs-cpu] [--cpu-tol X]");
        std::process::exit(2);
    }
    let model_path = PathBuf::from(&args[1]);
    let golden_path = PathBuf::from(&args[2]);
    let tol: f32 = opt(&args, "--tol").map_or(1e-3, |t| t.parse().expect("--tol number"));
    let exact = args.iter().any(|a| a == "--exact");
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(&golden_path).expect("read golden"))
            .expect("golden JSON");
    let prompt = ids(&g["prompt_tokens"]);
    let decode = ids(&g["decode_tokens"]);
    let last_file = golden_path
        .parent()
        .unwrap_or(Path::new("."))
        .join(g["last_row_file"].as_str().expect("last_row_file"));
    let last_ref: Vec<f32> = std::fs::read(&last_file)
        .expect("read the golden's last row")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let t0 = std::time::Instant::now();
    let mut m = metrale_model::Model::load(&model_path).expect("model");
    let idx = args.iter().position(|a| a == "--cuda");
    let load_s = t0.elapsed().as_secs_f64();
    let cap = (prompt.len() + decode.len() + 16).next_multiple_of(16);
    let (mut b, kv) = match idx {
        Some(i) => cuda_backend(&mut m, &args[i + 1], &args[i + 2], (1, cap), 0),
        None => {
            let kv = match opt(&args, "--kv") {
                Some(k) => KvDtype::parse(k).expect("--kv f32 or bf16"),
                None => KvDtype::F32,
            };
            (cpu_backend(&m, kv, exact, (1, cap)), kv)
        }
    };
    let info = b.info();
    let t1 = std::time::Instant::now();
    let chunk = opt(&args, "--prefill-chunk").map(|c| c.parse().expect("--prefill-chunk N"));
    let rows = run(b.as_mut(), &prompt, &decode, chunk);
    let run_s = t1.elapsed().as_secs_f64();
    // the same run again on the same backend: a deterministic backend gives the same rows
    let repeat: usize = opt(&args, "--repeat").map_or(0, |r| r.parse().expect("--repeat N"));
    let mut rerun_diff = vec![0f32; rows.len()];
    for _ in 0..repeat {
        let again = run(b.as_mut(), &prompt, &decode, chunk);
        for (d, (a, r)) in rerun_diff.iter_mut().zip(again.iter().zip(&rows)) {
            let m = a
                .iter()
                .zip(r)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            *d = d.max(m);
        }
    }
    let tops = g["top20"].as_array().expect("top20");
    let mut worst_top20 = 0f32;
    let mut per_position = Vec::with_capacity(rows.len());
    let mut top1_agree = 0;
    let mut top1_margin_min = f32::INFINITY;
    for (row, top) in rows.iter().zip(tops) {
        let top = top.as_array().unwrap();
        let ref_top1 = top[0][0].as_u64().unwrap() as usize;
        if argmax(row) == ref_top1 {
            top1_agree += 1;
        }
        let l0 = top[0][1].as_f64().unwrap() as f32;
        let l1 = top[1][1].as_f64().unwrap() as f32;
        top1_margin_min = top1_margin_min.min(l0 - l1);
        let mut worst = 0f32;
        for e in top {
            let (id, l) = (
                e[0].as_u64().unwrap() as usize,
                e[1].as_f64().unwrap() as f32,
            );
            worst = worst.max((row[id] - l).abs());
        }
        per_position.push(worst);
        worst_top20 = worst_top20.max(worst);
    }
    let worst_last = rows
        .last()
        .unwrap()
        .iter()
        .zip(&last_ref)
        .map(|(a, r)| (a - r).abs())
        .fold(0f32, f32::max);
    let mut out = json!({
        "model": model_path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "golden": golden_path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "reference": g["reference"],
        "backend": info.name,
        "device": info.device,
        "kv_dtype": kv.name(),
        "exact_activations": exact,
        "prompt_tokens": prompt.len(),
        "decode_steps": decode.len(),
        "positions_checked": rows.len(),
        "top1_agree": top1_agree,
        "reference_min_top1_margin": top1_margin_min,
        "max_abs_diff_top20": worst_top20,
        "max_abs_diff_top20_per_position": per_position,
        "prefill_chunk": chunk,
        "tuning": std::env::var("METRALE_CUDA_TUNING").unwrap_or_default(),
        "max_abs_diff_last_row": worst_last,
        "tolerance": tol,
        "load_s": load_s,
        "run_s": run_s,
    });
    let mut ok = worst_top20 <= tol && worst_last <= tol && top1_agree == rows.len();
    if repeat > 0 {
        let worst = rerun_diff.iter().copied().fold(0f32, f32::max);
        out["repeat"] =
            json!({"runs": repeat, "max_abs_diff_per_position": rerun_diff, "max_abs_diff": worst});
        ok &= worst == 0.0;
    }
    if args.iter().any(|a| a == "--vs-cpu") && idx.is_some() {
        let mut c = cpu_backend(&m, kv, true, (1, cap));
        let crows = run(c.as_mut(), &prompt, &decode, None);
        let per: Vec<f32> = rows
            .iter()
            .zip(&crows)
            .map(|(a, b)| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
            })
            .collect();
        let diff = per.iter().copied().fold(0f32, f32::max);
        let same = rows
            .iter()
            .zip(&crows)
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        // where the greedy picks differ: how far the CUDA pick sits below the CPU's in the CPU's
        // own row (a near-tie shows as a margin within the backends' difference)
        let disagree: Vec<Value> = rows
            .iter()
            .zip(&crows)
            .enumerate()
            .filter(|(_, (a, b))| argmax(a) != argmax(b))
            .map(|(i, (a, b))| {
                let (ga, gb) = (argmax(a), argmax(b));
                json!({"position": i, "cuda_top": ga, "cpu_top": gb, "cpu_margin": b[gb] - b[ga]})
            })
            .collect();
        out["vs_cpu"] = json!({"max_abs_diff": diff, "max_abs_diff_per_position": per, "top1_agree": same, "positions": rows.len(), "disagree": disagree});
        let cpu_tol: f32 =
            opt(&args, "--cpu-tol").map_or(tol, |t| t.parse().expect("--cpu-tol number"));
        out["vs_cpu"]["tolerance"] = json!(cpu_tol);
        ok &= diff <= cpu_tol && same == rows.len();
    }
    out["pass"] = json!(ok);
    println!("{}", serde_json::to_string(&out).unwrap());
    if !ok {
        std::process::exit(1);
    }
}
