//! The whole model on the real GGUF: the CUDA backend against the CPU backend (the numerical
//! reference). Greedy decoding must give identical tokens for 64 steps; the logits of the prompt's last
//! position must agree to a relative L2 error below 1e-3 with the same top-1 token; a chunked prefill,
//! two sequences decoded together (one graph of two tokens) and the graph path must all give the same
//! tokens as the straightforward path; 64 sequences decoded together (the GEMM decode path) give
//! the CPU's logits at every step. The persistent decode kernel (`decode_1`, every one-sequence
//! decode step) is checked step by step: its logits against the CPU's at every step (rel L2 < 1e-3),
//! at short and long (multi-tile, 8-split attention) contexts, and its tokens against the graph path.
//! The embeddings path (`Backend::hidden`) gives the CPU's final-normed hidden states (rel L2 < 1e-3).
//!
//! Needs `METRALE_MODEL` (the SmolLM2-135M-Instruct Q4_1 GGUF), `METRALE_CUDA_KERNELS` (the
//! target's kernel folder), a CUDA device; `METRALE_CUDA_TARGET` defaults to "h200/smollm2-135m/q4_1".
//! Without any of them the test prints why and passes.
#![cfg(feature = "cuda")]

mod common;

use metrale_backend::cpu::CpuBackend;
use metrale_backend::cuda::{device_count, CudaBackend, CudaOptions, KernelSet, Tuning};
use metrale_backend::sampler::SamplingParams;
use metrale_backend::{Backend, SeqStep};
use metrale_model::Model;

const STEPS: usize = 64;

struct Setup {
    model: Model,
    set: KernelSet,
}

fn setup(test: &str) -> Option<Setup> {
    let (Ok(mpath), Ok(kdir)) = (
        std::env::var("METRALE_MODEL"),
        std::env::var("METRALE_CUDA_KERNELS"),
    ) else {
        eprintln!("{test}: skipped: METRALE_MODEL and METRALE_CUDA_KERNELS must both be set");
        return None;
    };
    if device_count() == 0 {
        eprintln!("{test}: skipped: no CUDA device");
        return None;
    }
    let (_, _, set) = common::target_kernels(&kdir);
    let model = Model::load(std::path::Path::new(&mpath)).expect("model");
    Some(Setup { model, set })
}

fn cuda(s: &Setup, opts: CudaOptions) -> CudaBackend {
    CudaBackend::new(&s.set, &s.model.config, &s.model.weights, opts).expect("cuda backend")
}

fn prompt(s: &Setup, text: &str) -> Vec<u32> {
    let chat = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
    s.model
        .tokenizer
        .encode(&chat, false, true)
        .expect("tokenize")
}

/// Greedy generation of `steps` tokens for each prompt (all decoded together, one slot each).
/// Returns the tokens per prompt and the logits of the first step.
fn generate(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    generate_with(b, prompts, steps, &SamplingParams::default())
}

fn generate_with(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    steps: usize,
    greedy: &SamplingParams,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let (out, logits) = generate_logits(b, prompts, steps, greedy, false);
    (
        out,
        logits.into_iter().map(|mut l| l.swap_remove(0)).collect(),
    )
}

/// As `generate_with`, returning each prompt's logits of the first step only, or (`every_step`) of
/// every step.
fn generate_logits(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    steps: usize,
    greedy: &SamplingParams,
    every_step: bool,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let mut hist: Vec<Vec<u32>> = prompts.to_vec();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    // each slot its own run of blocks (the pools below hold every slot at full context)
    let cap = b.info().slot_capacity;
    let tables: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| metrale_backend::slot_blocks(i, cap))
        .collect();
    for step in 0..steps {
        let batch: Vec<SeqStep> = (0..prompts.len())
            .map(|i| {
                let (start, toks): (usize, &[u32]) = if step == 0 {
                    (0, &hist[i][..])
                } else {
                    (hist[i].len() - 1, &hist[i][hist[i].len() - 1..])
                };
                SeqStep {
                    slot: i,
                    blocks: &tables[i],
                    start_pos: start,
                    tokens: toks,
                    history: &hist[i],
                    sampling: greedy,
                    draw: step as u64,
                    want_logits: step == 0 || every_step,
                    allowed: None,
                    drafted: 0,
                }
            })
            .collect();
        let r = b.step(&batch).expect("step");
        drop(batch);
        for (i, o) in r.into_iter().enumerate() {
            if let Some(l) = o.logits {
                logits[i].push(l);
            }
            out[i].push(o.token);
            hist[i].push(o.token);
        }
    }
    (out, logits)
}

/// Relative L2 error of `got` against `want`.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Greedy steps from `p` on the CPU's f32 path and on the GPU with logits at every step: the same
/// tokens, and every step's logits within rel L2 1e-3 with the same top-1. Returns the worst error.
fn check_every_step(s: &Setup, gpu: &mut CudaBackend, p: &[u32], steps: usize, what: &str) -> f64 {
    let mut cpu = CpuBackend::load(&s.model, 1, 1024, 0).expect("cpu backend");
    cpu.set_exact_activations(true);
    let greedy = SamplingParams::default();
    let (want, want_l) = generate_logits(&mut cpu, &[p.to_vec()], steps, &greedy, true);
    let (got, got_l) = generate_logits(gpu, &[p.to_vec()], steps, &greedy, true);
    let mut worst = 0f64;
    for (k, (g, w)) in got_l[0].iter().zip(&want_l[0]).enumerate() {
        let rel = rel_l2(g, w);
        worst = worst.max(rel);
        assert!(
            rel < 1e-3,
            "{what}: step {k} (position {}): logits rel L2 err {rel:.2e}",
            p.len() + k - 1
        );
        assert_eq!(
            metrale_backend::sampler::argmax(g),
            metrale_backend::sampler::argmax(w),
            "{what}: step {k}: top-1 differs"
        );
    }
    assert_eq!(
        got[0], want[0],
        "{what}: greedy tokens differ from the CPU backend"
    );
    worst
}

#[test]
fn greedy_64_tokens_match_cpu_backend() {
    let Some(s) = setup("cuda_model") else { return };
    let p = prompt(&s, "What is the capital of France? Answer in one sentence.");
    let mut cpu = CpuBackend::load(&s.model, 2, 1024, 0).expect("cpu backend");
    // the f32 reference path (the default CPU path quantizes activations to 16-bit blocks)
    cpu.set_exact_activations(true);
    let (want, want_logits) = generate(&mut cpu, std::slice::from_ref(&p), STEPS);
    let mut gpu = cuda(
        &s,
        CudaOptions {
            slots: 2,
            slot_capacity: 1024,
            kv_blocks: 2 * metrale_backend::blocks_for(1024),
            ..Default::default()
        },
    );
    eprintln!("cuda backend: {:?}", gpu.info());
    let (got, got_logits) = generate(&mut gpu, std::slice::from_ref(&p), STEPS);
    eprintln!(
        "cpu:  {:?}\ncuda: {:?}",
        s.model.tokenizer.decode(&want[0], false),
        s.model.tokenizer.decode(&got[0], false)
    );
    // logits of the prompt's last position
    let (g, w) = (&got_logits[0], &want_logits[0]);
    let maxd = g
        .iter()
        .zip(w)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let rel = rel_l2(g, w);
    eprintln!("prompt logits: rel L2 err {rel:.2e}, max abs diff {maxd:.3e}");
    assert!(rel < 1e-3, "logits differ: rel {rel}");
    assert_eq!(
        metrale_backend::sampler::argmax(g),
        metrale_backend::sampler::argmax(w)
    );
    assert_eq!(got[0], want[0], "greedy tokens differ from the CPU backend");
    eprintln!(
        "stats: {:?}; persistent decode kernel: {:?}",
        gpu.stats,
        gpu.decode1_info()
    );
    assert!(
        gpu.stats.graph_launches + gpu.stats.decode1_launches >= (STEPS - 1) as u64,
        "decode steps ran neither graphs nor the persistent kernel"
    );

    // run-ahead (the default): every greedy decode step after the first was already in the stream
    // when it was asked for (its token read on the device), with the CPU's tokens all the same.
    // Then a spare run-ahead launch (the sequence released) must not disturb the next sequence in
    // that slot; and with run-ahead off the tokens are the same too.
    if gpu.decode1_info().is_some() {
        assert!(
            gpu.stats.run_ahead_hits >= (STEPS - 2) as u64,
            "run-ahead launches were not used: {:?}",
            gpu.stats
        );
        gpu.release(0);
        let (again, _) = generate(&mut gpu, std::slice::from_ref(&p), 16);
        assert_eq!(again[0], want[0][..16], "after a spare run-ahead launch");
        gpu.release(0);
    }
    let mut no_ahead = cuda(
        &s,
        CudaOptions {
            slots: 2,
            slot_capacity: 1024,
            kv_blocks: 2 * metrale_backend::blocks_for(1024),
            tuning: Tuning {
                run_ahead: false,
                ..Tuning::default()
            },
            ..Default::default()
        },
    );
    let (got_na, _) = generate(&mut no_ahead, std::slice::from_ref(&p), STEPS);
    assert_eq!(got_na[0], want[0], "run-ahead off: tokens differ");
    assert_eq!(no_ahead.stats.run_ahead_launches, 0);

    // the per-stage kernels' graphs (the persistent kernel off) give the same tokens
    let mut graphs = cuda(
        &s,
        CudaOptions {
            slots: 2,
            slot_capacity: 1024,
            kv_blocks: 2 * metrale_backend::blocks_for(1024),
            tuning: Tuning {
                persistent_decode: false,
                ..Tuning::default()
            },
            ..Default::default()
        },
    );
    let (got_g, _) = generate(&mut graphs, std::slice::from_ref(&p), STEPS);
    assert_eq!(
        got_g[0], want[0],
        "graph path (persistent kernel off) differs"
    );
    assert!(
        graphs.stats.graph_launches >= (STEPS - 1) as u64 && graphs.stats.decode1_launches == 0
    );

    // the same generation without graphs, with a chunked prefill (5-token chunks)
    let mut plain = cuda(
        &s,
        CudaOptions {
            slots: 2,
            slot_capacity: 1024,
            kv_blocks: 2 * metrale_backend::blocks_for(1024),
            max_step_tokens: 5,
            tuning: Tuning {
                graphs: false,
                ..Tuning::default()
            },
            ..Default::default()
        },
    );
    let (got2, _) = generate(&mut plain, std::slice::from_ref(&p), 16);
    assert_eq!(
        got2[0],
        want[0][..16],
        "chunked prefill / no-graph path differs"
    );

    // two sequences decoded together (one graph of two tokens) vs each alone on the CPU
    let p2 = prompt(&s, "Write a haiku about the sea.");
    cpu.release(0);
    gpu.release(0);
    let (want_b, _) = generate(&mut cpu, std::slice::from_ref(&p2), 24);
    let (got_ab, _) = generate(&mut gpu, &[p.clone(), p2.clone()], 24);
    assert_eq!(got_ab[0], want[0][..24], "sequence 0 in a batch of two");
    assert_eq!(got_ab[1], want_b[0], "sequence 1 in a batch of two");

    // seeded sampling (SmolLM2's chat preset) on the device vs the host sampler on CPU logits
    let chat = SamplingParams {
        temperature: 0.2,
        top_p: 0.9,
        seed: 1234,
        ..Default::default()
    };
    cpu.release(0);
    gpu.release(0);
    let (want_s, _) = generate_with(&mut cpu, std::slice::from_ref(&p2), 32, &chat);
    let (got_s, _) = generate_with(&mut gpu, std::slice::from_ref(&p2), 32, &chat);
    eprintln!("sampled: {:?}", s.model.tokenizer.decode(&got_s[0], false));
    assert_eq!(
        got_s[0], want_s[0],
        "seeded sampling differs from the CPU backend"
    );
}

/// Every decode step's logits against the CPU backend: 40 steps after the 21-token chat prompt
/// (1-2 attention splits) through the persistent kernel when the device runs it, else the graphs.
#[test]
fn decode_step_logits_match_cpu_backend() {
    let Some(s) = setup("cuda_model decode logits") else {
        return;
    };
    let p = prompt(&s, "What is the capital of France? Answer in one sentence.");
    let mut gpu = cuda(
        &s,
        CudaOptions {
            slots: 1,
            slot_capacity: 1024,
            ..Default::default()
        },
    );
    let worst = check_every_step(&s, &mut gpu, &p, 40, "short context");
    eprintln!(
        "decode logits, 40 steps from {} positions: worst rel L2 err {worst:.2e}; stats {:?}",
        p.len(),
        gpu.stats
    );
    if gpu.decode1_info().is_some() {
        assert!(
            gpu.stats.decode1_launches >= 39,
            "the persistent kernel did not run the decode steps"
        );
    }
}

/// A long prompt through the tensor-core prefill path (chunks of >= gemm::MIN_TOKENS tokens), in
/// chunks of 128 so later chunks attend to KV written by earlier GEMM chunks: the prompt's last
/// logits against the CPU backend's f32 path (rel L2 < 1e-3, same top-1) and 16 identical greedy
/// tokens after it.
#[test]
fn long_prompt_gemm_prefill_matches_cpu_backend() {
    let Some(s) = setup("cuda_model long prompt") else {
        return;
    };
    let text = "Summarise the following notes in two sentences. ".to_string()
        + &"The harbour was quiet that morning; fishing boats rocked against the pier while gulls argued over scraps, and the old lighthouse keeper counted the ships leaving for the open sea. ".repeat(10);
    let p = prompt(&s, &text);
    assert!(
        p.len() > 256,
        "prompt of {} tokens: too short to span three chunks",
        p.len()
    );
    let mut cpu = CpuBackend::load(&s.model, 2, 1024, 0).expect("cpu backend");
    cpu.set_exact_activations(true);
    let (want, want_logits) = generate(&mut cpu, std::slice::from_ref(&p), 16);
    let mut gpu = cuda(
        &s,
        CudaOptions {
            slots: 2,
            slot_capacity: 1024,
            kv_blocks: 2 * metrale_backend::blocks_for(1024),
            max_step_tokens: 128,
            ..Default::default()
        },
    );
    let (got, got_logits) = generate(&mut gpu, std::slice::from_ref(&p), 16);
    let (g, w) = (&got_logits[0], &want_logits[0]);
    let rel = rel_l2(g, w);
    eprintln!(
        "long prompt ({} tokens, chunks of 128): prompt logits rel L2 err {rel:.2e}",
        p.len()
    );
    eprintln!(
        "cpu:  {:?}\ncuda: {:?}",
        s.model.tokenizer.decode(&want[0], false),
        s.model.tokenizer.decode(&got[0], false)
    );
    assert!(rel < 1e-3, "logits differ: rel {rel}");
    assert_eq!(
        metrale_backend::sampler::argmax(g),
        metrale_backend::sampler::argmax(w)
    );
    assert_eq!(
        got[0], want[0],
        "greedy tokens after a long GEMM-prefilled prompt differ from the CPU backend"
    );

    // decode steps at ~370 positions: 8 attention splits of > TILE positions each (two K/V tiles)
    let mut gpu2 = cuda(
        &s,
        CudaOptions {
            slots: 1,
            slot_capacity: 1024,
            max_step_tokens: 128,
            ..Default::default()
        },
    );
    let worst = check_every_step(&s, &mut gpu2, &p, 12, "long context");
    eprintln!(
        "decode logits, 12 steps from {} positions: worst rel L2 err {worst:.2e}; stats {:?}",
        p.len(),
        gpu2.stats
    );
}

/// 64 sequences decoded together: a decode step of >= `gemm::MIN_TOKENS` tokens runs the layer products as
/// tensor-core GEMMs (`Tuning::decode_gemm`). Teacher-forced with the CPU backend's greedy tokens
/// (so a near-tie cannot make the histories differ), every step's logits of every sequence against
/// the CPU's f32 path: rel L2 < 1e-3 (the bound of the one-sequence checks above) and the same top-1.
#[test]
fn batched_gemm_decode_matches_cpu_backend() {
    let Some(s) = setup("cuda_model batched decode") else {
        return;
    };
    const N: usize = 64;
    const DECODE: usize = 6;
    let subjects = [
        "rivers", "bread", "stars", "trains", "music", "bees", "glass", "maps",
    ];
    let prompts: Vec<Vec<u32>> = (0..N)
        .map(|i| {
            let t = format!(
                "Write {} short facts about {}.",
                i / subjects.len() + 1,
                subjects[i % subjects.len()]
            );
            prompt(&s, &t)
        })
        .collect();
    let mut cpu = CpuBackend::load(&s.model, N, 256, 0).expect("cpu backend");
    cpu.set_exact_activations(true);
    let mut gpu = cuda(
        &s,
        CudaOptions {
            slots: N,
            slot_capacity: 256,
            kv_blocks: N * metrale_backend::blocks_for(256),
            ..Default::default()
        },
    );
    let greedy = SamplingParams::default();
    let tables: Vec<Vec<u32>> = (0..N)
        .map(|i| metrale_backend::slot_blocks(i, 256))
        .collect();
    let mut hist = prompts.clone();
    let mut worst = 0f64;
    for step in 0..=DECODE {
        let batch: Vec<SeqStep> = (0..N)
            .map(|i| {
                let start = if step == 0 { 0 } else { hist[i].len() - 1 };
                SeqStep {
                    slot: i,
                    blocks: &tables[i],
                    start_pos: start,
                    tokens: &hist[i][start..],
                    history: &hist[i],
                    sampling: &greedy,
                    draw: step as u64,
                    want_logits: true,
                    allowed: None,
                    drafted: 0,
                }
            })
            .collect();
        let want = cpu.step(&batch).expect("cpu step");
        let got = gpu.step(&batch).expect("cuda step");
        drop(batch);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (gl, wl) = (g.logits.as_ref().unwrap(), w.logits.as_ref().unwrap());
            let rel = rel_l2(gl, wl);
            worst = worst.max(rel);
            assert!(
                rel < 1e-3,
                "sequence {i}, step {step}: logits rel L2 err {rel:.2e}"
            );
            assert_eq!(
                metrale_backend::sampler::argmax(gl),
                metrale_backend::sampler::argmax(wl),
                "sequence {i}, step {step}: top-1 differs"
            );
            hist[i].push(w.token);
        }
    }
    eprintln!(
        "{N} sequences, prefill + {DECODE} batched decode steps: worst rel L2 err {worst:.2e}; stats {:?}",
        gpu.stats
    );
}

/// The allowed set after token `prev`: the ids `t` with `(t + prev) % 3 != 0`. Two thirds of the
/// vocabulary, a different two thirds after each token, so the mask overrules the unconstrained
/// choice about one step in three and every step's mask depends on the step before.
fn rule_mask(prev: u32, vocab: usize) -> Vec<u32> {
    let mut m = vec![0u32; vocab.div_ceil(32)];
    for t in 0..vocab as u32 {
        if !(t + prev).is_multiple_of(3) {
            m[t as usize / 32] |= 1 << (t % 32);
        }
    }
    m
}

/// Masks by `rule_mask` of each entry's last token, asked on demand.
struct Rule<'a> {
    last: Vec<u32>,
    vocab: usize,
    asked: &'a mut usize,
}

impl metrale_backend::MaskSource for Rule<'_> {
    fn mask(&mut self, i: usize) -> Option<Vec<u32>> {
        *self.asked += 1;
        Some(rule_mask(self.last[i], self.vocab))
    }
}

/// Greedy generation under `rule_mask`, all prompts decoded together: even steps take the mask on
/// demand (`step_masked`, as the engine does), odd steps as `SeqStep::allowed`. Every token is
/// checked against its mask. Returns the tokens per prompt and how many masks were asked.
fn generate_constrained(
    b: &mut dyn Backend,
    prompts: &[Vec<u32>],
    steps: usize,
    vocab: usize,
) -> (Vec<Vec<u32>>, usize) {
    let greedy = SamplingParams::default();
    let mut hist: Vec<Vec<u32>> = prompts.to_vec();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let cap = b.info().slot_capacity;
    let tables: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| metrale_backend::slot_blocks(i, cap))
        .collect();
    let mut asked = 0;
    for step in 0..steps {
        let last: Vec<u32> = hist.iter().map(|h| *h.last().unwrap()).collect();
        let masks: Vec<Vec<u32>> = last.iter().map(|&t| rule_mask(t, vocab)).collect();
        let lazy = step % 2 == 0;
        let batch: Vec<SeqStep> = (0..prompts.len())
            .map(|i| {
                let start = if step == 0 { 0 } else { hist[i].len() - 1 };
                SeqStep {
                    slot: i,
                    blocks: &tables[i],
                    start_pos: start,
                    tokens: &hist[i][start..],
                    history: &hist[i],
                    sampling: &greedy,
                    draw: step as u64,
                    want_logits: false,
                    allowed: (!lazy).then_some(&masks[i][..]),
                    drafted: 0,
                }
            })
            .collect();
        let mut rule = Rule {
            last: last.clone(),
            vocab,
            asked: &mut asked,
        };
        let r = b
            .step_masked(&batch, &vec![lazy; prompts.len()], &mut rule)
            .expect("step");
        drop(batch);
        for (i, o) in r.into_iter().enumerate() {
            assert!(
                !(o.token + last[i]).is_multiple_of(3),
                "step {step}, sequence {i}: token {} after {} is outside its mask",
                o.token,
                last[i]
            );
            out[i].push(o.token);
            hist[i].push(o.token);
        }
    }
    (out, asked)
}

/// Grammar masks on the device: greedy decoding under a mask that changes with every token gives
/// the CPU backend's tokens on every path. One sequence runs `decode_1`, its pick replaced by the
/// masked arg-max in place, and still runs ahead (each step's input token read on the device from
/// the masked pick); with run-ahead off the same; two sequences decoded together mask their rows
/// with `mask_logits` before the arg-max.
#[test]
fn constrained_greedy_decode_matches_cpu_backend() {
    let Some(s) = setup("cuda_model constrained decode") else {
        return;
    };
    const STEPS: usize = 48;
    let vocab = s.model.config.vocab;
    let p = prompt(&s, "What is the capital of France? Answer in one sentence.");
    let p2 = prompt(&s, "Write a haiku about the sea.");
    let mut cpu = CpuBackend::load(&s.model, 1, 1024, 0).expect("cpu backend");
    cpu.set_exact_activations(true);
    let (want, _) = generate_constrained(&mut cpu, std::slice::from_ref(&p), STEPS, vocab);
    cpu.release(0);
    let (want2, _) = generate_constrained(&mut cpu, std::slice::from_ref(&p2), STEPS, vocab);
    let (free, _) = generate(&mut cpu, std::slice::from_ref(&p), STEPS);
    let differ = (0..STEPS).find(|&k| want[0][k] != free[0][k]);
    assert!(
        differ.is_some(),
        "the mask never changed the greedy choice: the test would not see it ignored"
    );
    let opts = |run_ahead: bool| CudaOptions {
        slots: 2,
        slot_capacity: 1024,
        kv_blocks: 2 * metrale_backend::blocks_for(1024),
        tuning: Tuning {
            run_ahead,
            ..Tuning::default()
        },
        ..Default::default()
    };
    let mut gpu = cuda(&s, opts(true));
    let (got, asked) = generate_constrained(&mut gpu, std::slice::from_ref(&p), STEPS, vocab);
    eprintln!(
        "constrained: {:?} (first step the mask changed: {differ:?}); {asked} masks asked; stats {:?}",
        s.model.tokenizer.decode(&got[0], false),
        gpu.stats
    );
    assert_eq!(
        got[0], want[0],
        "one sequence: tokens differ from the CPU backend"
    );
    assert_eq!(
        asked,
        STEPS.div_ceil(2),
        "each lazy step asks its mask once"
    );
    if gpu.decode1_info().is_some() {
        assert!(
            gpu.stats.run_ahead_hits >= (STEPS - 2) as u64,
            "constrained steps did not run ahead: {:?}",
            gpu.stats
        );
    }
    let mut no_ahead = cuda(&s, opts(false));
    let (got_na, _) = generate_constrained(&mut no_ahead, std::slice::from_ref(&p), STEPS, vocab);
    assert_eq!(got_na[0], want[0], "run-ahead off: tokens differ");
    gpu.release(0);
    let (got_ab, _) = generate_constrained(&mut gpu, &[p.clone(), p2.clone()], STEPS, vocab);
    assert_eq!(got_ab[0], want[0], "sequence 0 of two: tokens differ");
    assert_eq!(got_ab[1], want2[0], "sequence 1 of two: tokens differ");
}

/// The embeddings path (`Backend::hidden`): a prompt of > 256 tokens in 128-token chunks beside a
/// short one, in one call, against the CPU backend's hidden states: each sequence's summed and
/// last final-normed rows to rel L2 < 1e-3 (the logits' bound above), and their mean-pooled
/// embeddings to a cosine above 0.9999.
#[test]
fn hidden_states_for_embeddings_match_cpu_backend() {
    let Some(s) = setup("cuda_model hidden states") else {
        return;
    };
    let long = prompt(
        &s,
        &"The harbour was quiet that morning; fishing boats rocked against the pier. ".repeat(20),
    );
    let short = prompt(&s, "What is the capital of France?");
    assert!(long.len() > 256, "prompt of {} tokens", long.len());
    let p = SamplingParams::default();
    let tables: Vec<Vec<u32>> = (0..2)
        .map(|i| metrale_backend::slot_blocks(i, 1024))
        .collect();
    let batch = |b: &mut dyn Backend| {
        let steps: Vec<SeqStep> = [&long, &short]
            .iter()
            .enumerate()
            .map(|(i, t)| SeqStep {
                slot: i,
                blocks: &tables[i],
                start_pos: 0,
                tokens: t,
                history: t,
                sampling: &p,
                draw: 0,
                want_logits: false,
                allowed: None,
                drafted: 0,
            })
            .collect();
        b.hidden(&steps).expect("hidden")
    };
    let mut cpu = CpuBackend::load(&s.model, 2, 1024, 0).expect("cpu backend");
    cpu.set_exact_activations(true);
    let want = batch(&mut cpu);
    let mut gpu = cuda(
        &s,
        CudaOptions {
            slots: 2,
            slot_capacity: 1024,
            kv_blocks: 2 * metrale_backend::blocks_for(1024),
            max_step_tokens: 128,
            ..Default::default()
        },
    );
    let got = batch(&mut gpu);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.tokens, w.tokens);
        let (rs, rl) = (rel_l2(&g.sum, &w.sum), rel_l2(&g.last, &w.last));
        let (ge, we) = (
            g.embedding(metrale_backend::Pooling::Mean),
            w.embedding(metrale_backend::Pooling::Mean),
        );
        let cos: f32 = ge.iter().zip(&we).map(|(a, b)| a * b).sum();
        eprintln!(
            "sequence {i} ({} tokens): sum rel L2 {rs:.2e}, last rel L2 {rl:.2e}, embedding cosine {cos:.6}",
            g.tokens
        );
        assert!(rs < 1e-3 && rl < 1e-3, "sequence {i}: hidden states differ");
        assert!(
            cos > 0.9999,
            "sequence {i}: embeddings differ (cosine {cos})"
        );
    }
}

/// The two best logits of `row` apart (the margin of its greedy pick).
fn top2_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// The exactness test's 100 prompts: 16 questions, then 84 copy-heavy ones (repeat, continue or
/// quote a passage) over windows of `bench/perplexity/text.txt` at seeded offsets (xorshift64*,
/// seed 23), so that the same prompts run every time.
fn spec_prompts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "What is the capital of France? Answer in one sentence.",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Explain what a CPU cache is.",
        "Translate 'good morning' into Spanish.",
        "Name the planets of the solar system.",
        "What is 12 times 7?",
        "Give me a synonym for 'happy'.",
        "Describe a cat in two sentences.",
        "Why is the sky blue?",
        "Repeat after me: the quick brown fox jumps over the lazy dog.",
        "Count from one to ten in words.",
        "What does HTTP stand for?",
        "Write a short greeting for a birthday card.",
        "Which is larger, 0.5 or 0.45?",
        "Summarise the plot of Cinderella in one sentence.",
    ]
    .map(String::from)
    .to_vec();
    let passage = include_str!("../../../bench/perplexity/text.txt");
    let words: Vec<&str> = passage.split_whitespace().collect();
    let mut rng = 23u64;
    let asks = [
        "Repeat this passage exactly:",
        "Continue this text:",
        "Quote the first sentence of this passage, then explain it:",
    ];
    while texts.len() < 100 {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        let r = rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        let at = (r as usize) % (words.len() - 48);
        let ask = asks[texts.len() % asks.len()];
        texts.push(format!("{ask}\n\n{}", words[at..at + 48].join(" ")));
    }
    texts
}

/// Speculative verification (`SeqStep::drafted`, a backend started with `max_drafts = 4`):
/// proposals replayed from a plain greedy run of the same backend, every third one corrupted,
/// verified 4 at a time for two sequences in one step. The accepted proposals and the pick after
/// them must be the plain run's token for token, except where the plain run's own pick sat at a
/// near-tie (its two best logits within `NEAR_TIE`, the run-to-run difference of the decode and the
/// many-token kernels): there the runs may part, the margin is printed and that sequence is
/// compared no further. 100 prompts ([`spec_prompts`]). A sampled request (host verification)
/// reproduces with its seed; more proposals than `max_drafts` are refused by name.
#[test]
fn speculative_verification_matches_plain_greedy() {
    let Some(s) = setup("cuda_model") else { return };
    const K: usize = 4;
    const STEPS: usize = 40;
    // logit units: the decode and chunk paths agree to rel L2 < 1e-3 on logits of ~10-20
    const NEAR_TIE: f32 = 0.05;
    let cap = 1024;
    let mut gpu = cuda(
        &s,
        CudaOptions {
            slots: 2,
            slot_capacity: cap,
            kv_blocks: 2 * metrale_backend::blocks_for(cap),
            max_drafts: K,
            ..Default::default()
        },
    );
    assert!(gpu.info().verifies_drafts);
    let vocab = s.model.config.vocab as u32;
    let texts = spec_prompts();
    let tables: Vec<Vec<u32>> = (0..2)
        .map(|i| metrale_backend::slot_blocks(i, cap))
        .collect();
    let greedy = SamplingParams::default();
    let (mut compared, mut accepted_total, mut proposed_total, mut parted) = (0, 0, 0, 0);
    for pair in texts.chunks(2) {
        let prompts: Vec<Vec<u32>> = pair.iter().map(|t| prompt(&s, t)).collect();
        let (plain, plain_logits) = generate_logits(&mut gpu, &prompts, STEPS, &greedy, true);
        gpu.release(0);
        gpu.release(1);
        let mut hist: Vec<Vec<u32>> = prompts.clone();
        let mut made: Vec<Vec<u32>> = vec![Vec::new(); 2];
        let mut live = [true, true];
        let mut first = true;
        while live.iter().any(|&l| l) {
            let idx: Vec<usize> = (0..2).filter(|&i| live[i]).collect();
            // each live sequence: its last token and up to K proposals from the plain run, every
            // third corrupted
            let feeds: Vec<(usize, Vec<u32>, usize)> = idx
                .iter()
                .map(|&i| {
                    if first {
                        return (0, hist[i].clone(), 0);
                    }
                    let n = made[i].len();
                    let props: Vec<u32> = (n..(n + K).min(STEPS))
                        .map(|j| match j % 3 {
                            2 => (plain[i][j] + 1) % vocab,
                            _ => plain[i][j],
                        })
                        .collect();
                    let mut toks = vec![*hist[i].last().unwrap()];
                    toks.extend(&props);
                    (hist[i].len() - 1, toks, props.len())
                })
                .collect();
            let full: Vec<Vec<u32>> = idx
                .iter()
                .zip(&feeds)
                .map(|(&i, (_, toks, d))| {
                    let mut h = hist[i].clone();
                    if !first {
                        h.extend(&toks[1..]);
                    }
                    debug_assert!(*d <= K);
                    h
                })
                .collect();
            let batch: Vec<SeqStep> = idx
                .iter()
                .zip(&feeds)
                .zip(&full)
                .map(|((&i, (start, toks, d)), h)| SeqStep {
                    slot: i,
                    blocks: &tables[i],
                    start_pos: *start,
                    tokens: toks,
                    history: h,
                    sampling: &greedy,
                    draw: made[i].len() as u64,
                    want_logits: false,
                    allowed: None,
                    drafted: *d,
                })
                .collect();
            let outs = gpu.step(&batch).expect("verification step");
            drop(batch);
            first = false;
            for ((&i, (_, _, d)), o) in idx.iter().zip(&feeds).zip(outs) {
                proposed_total += d;
                accepted_total += o.accepted.len();
                let got: Vec<u32> = o
                    .accepted
                    .iter()
                    .map(|a| a.token)
                    .chain([o.token])
                    .collect();
                for t in got {
                    let j = made[i].len();
                    if j >= STEPS {
                        live[i] = false;
                        break;
                    }
                    if t != plain[i][j] {
                        let m = top2_margin(&plain_logits[i][j]);
                        eprintln!(
                            "  {:?}: position {j} parts from the plain run ({t} vs {}), top-2 margin {m:.4}",
                            pair[i], plain[i][j]
                        );
                        assert!(
                            m < NEAR_TIE,
                            "{:?}: position {j}: verified {t}, plain {} with a margin of {m} (>= {NEAR_TIE})",
                            pair[i],
                            plain[i][j]
                        );
                        parted += 1;
                        live[i] = false;
                        break;
                    }
                    compared += 1;
                    made[i].push(t);
                    hist[i].push(t);
                }
                if made[i].len() >= STEPS {
                    live[i] = false;
                }
            }
        }
        gpu.release(0);
        gpu.release(1);
    }
    eprintln!(
        "verification: {compared} tokens equal to plain greedy over {} prompts ({parted} parted at near-ties); \
         {accepted_total} of {proposed_total} proposals accepted (every third corrupted)",
        texts.len()
    );
    assert!(compared >= texts.len() * STEPS / 2);
    assert!(accepted_total > 0 && accepted_total < proposed_total);

    // a sampled request verifies on the host: the same seed gives the same tokens twice
    let p = prompt(&s, &texts[0]);
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 7,
        ..SamplingParams::default()
    };
    let run = |gpu: &mut CudaBackend| -> Vec<u32> {
        let (first, _) = generate_with(gpu, std::slice::from_ref(&p), 1, &sampled);
        let mut h = p.clone();
        h.push(first[0][0]);
        let props: Vec<u32> = h[h.len() - 5..h.len() - 1].to_vec();
        let mut toks = vec![*h.last().unwrap()];
        toks.extend(&props);
        let mut full = h.clone();
        full.extend(&props);
        let o = gpu
            .step(&[SeqStep {
                slot: 0,
                blocks: &tables[0],
                start_pos: h.len() - 1,
                tokens: &toks,
                history: &full,
                sampling: &sampled,
                draw: 1,
                want_logits: false,
                allowed: None,
                drafted: props.len(),
            }])
            .expect("sampled verification")
            .remove(0);
        gpu.release(0);
        let mut out = vec![first[0][0]];
        out.extend(o.accepted.iter().map(|a| a.token));
        out.push(o.token);
        out
    };
    let (a, b) = (run(&mut gpu), run(&mut gpu));
    assert_eq!(a, b, "a seeded sampled verification reproduces");
    // more proposals than the backend was started for: refused by name
    let toks: Vec<u32> = p[..K + 2].to_vec();
    let e = gpu
        .step(&[SeqStep {
            slot: 0,
            blocks: &tables[0],
            start_pos: 0,
            tokens: &toks,
            history: &toks,
            sampling: &greedy,
            draw: 0,
            want_logits: false,
            allowed: None,
            drafted: K + 1,
        }])
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_drafts"), "{e}");
}
