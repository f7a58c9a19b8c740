//! Decode and prefill timing of the CUDA backend on the real model (numbers, not a test).
//!
//! Batch-1 decode: a chat prompt is prefilled, then `--steps` greedy decode steps are timed one by one
//! with the host clock around `Backend::step` (what a caller sees per token: input copies, graph
//! replay, output copies); the median and p10/p90 are reported. Prefill: one step of `--pp` tokens
//! (pp512 by default) into a fresh slot, median of 15 after 3 warm-ups. Batched decode: `--batch`
//! sequences stepped together, the step's graph replayed alone, and its stages timed two ways: each
//! kernel repeated on layer 0 (its weights partly in L2) and launched once a layer in a row (its
//! bytes from memory, as in the step: `profile_kernels_across_layers`); the graph's time beyond the
//! second sum is what the hand-overs between different kernels cost. Writes one JSON object to
//! `--out` (and prints it).
//!
//! Floors: the device-to-device copy rate is measured first (bytes read + written per second, 2 GiB
//! copies); each decode figure is reported beside the time the bytes it must read take at that
//! rate: the weights (`decode_weight_bytes`), plus at depth the KV rows of every cached position.
//! `--depth 8192,32768` times batch-1 decode after that many cached positions (the slot's earlier
//! positions hold zeros: the attention reads each of them whatever it holds, so the time is the
//! same as after a real prefill, which at 32k positions would take most of a minute).
//!
//! `--trace FILE` also writes the persistent decode kernel's per-stage globaltimer stamps at the last
//! step (raw u64, layout `metrale_abi::layout::decode_trace_words`; FILE.json says the shape).
//!
//! Reads `METRALE_TARGETS` (the targets/ folder, default `targets`) and `METRALE_CUDA_TUNING`
//! (`Tuning::parse`: the runtime choices to compare, e.g. `run_ahead=off`).
//!
//! Long prompts (`--long N,...`): one prompt of N tokens prefilled from position 0 in chunks of
//! `max_step_tokens` (the `--pp` size, at least 512), as a server does, each chunk reading the
//! earlier ones' K and V through the pages; the median of 3 after one warm-up, with the FLOPs of
//! the matrix products and of the causal attention (4 x head_dim x heads x layers x N^2 / 2).
//!
//! Usage: cuda_bench MODEL.gguf KERNEL_DIR TARGET_ID [--steps N] [--pp N] [--batch N,N,...] [--depth N,N,...] [--long N,N,...] [--out FILE] [--trace FILE]

#[cfg(feature = "cuda")]
mod args;

/// Per-kernel timings (`CudaBackend::profile_kernels`) as the members of a JSON object.
#[cfg(feature = "cuda")]
fn kernel_us_json(prof: &[(&str, f64)]) -> String {
    prof.iter()
        .map(|(n, us)| format!("\"{n}\": {us:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(feature = "cuda")]
fn main() {
    use metrale_backend::cuda::{abi, CudaBackend, CudaOptions, KernelSet, Tuning};
    use metrale_backend::sampler::SamplingParams;
    use metrale_backend::{Backend, SeqStep};
    use metrale_core::target::{TargetId, TargetSpec};
    use std::time::Instant;

    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: cuda_bench MODEL.gguf KERNEL_DIR TARGET_ID [--steps N] [--pp N] [--batch 1,8,32] [--out FILE]");
        std::process::exit(2);
    }
    let opt = |name: &str, dflt: &str| args::opt(&args, name, dflt);
    // the first 16 decode steps are a warm-up: at least 8 timed ones
    let steps: usize = opt("--steps", "256").parse::<usize>().unwrap().max(25);
    let pp: usize = opt("--pp", "512").parse().unwrap();
    let batches = args::counts(&args, "--batch", "1,8,32,64");
    let depths = args::counts(&args, "--depth", "");
    let longs = args::counts(&args, "--long", "");
    let long_cap = longs.iter().copied().max().unwrap_or(0);
    let depth_steps = 64usize;
    let out = opt("--out", "");
    let target = &args[3];
    let id: TargetId = target.parse().expect("TARGET_ID: hw/model/quant");
    let root = std::env::var("METRALE_TARGETS").unwrap_or_else(|_| "targets".into());
    let spec = TargetSpec::load(std::path::Path::new(&root), &id).expect("target");
    let set = KernelSet::from_dir(std::path::Path::new(&args[2]), &spec).expect("kernels");
    let tuning = Tuning::default()
        .parse(&std::env::var(Tuning::ENV).unwrap_or_default())
        .unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2)
        });
    let t0 = Instant::now();
    let mut model = metrale_model::Model::load(std::path::Path::new(&args[1])).expect("model");
    // an fp8 target reads FP8 layer matrices: a checkpoint without them is quantized at load, as
    // the server does
    if metrale_model::fp8::needs_quantizing(&model.config, &spec.quant.weights) {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let q = metrale_model::fp8::quantize_at_load(&mut model, threads).expect("quantize to fp8");
        eprintln!("quantized at load: {} matrices to fp8 e4m3", q.matrices);
    }
    let maxb = batches.iter().copied().max().unwrap_or(1).max(1);
    let chat = "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n";
    let prompt = model.tokenizer.encode(chat, false, true).unwrap();
    // slots 0..=maxb: `cap` positions each, what the longest of their runs needs (slot 0: the
    // prompt and the batch-1 steps; slot 1: the pp prefill; the batched runs: the prompt and 64
    // steps; slot maxb: tg128), so that the pool of 256 sequences fits beside a big model's
    // weights; slot maxb + 1: the depth runs; maxb + 2: long prompts
    let cap = pp
        .max(prompt.len() + steps + 1)
        .max(prompt.len() + 65)
        .max(129)
        .next_multiple_of(metrale_backend::KV_BLOCK);
    let depth_cap = depths.iter().max().map_or(0, |d| d + depth_steps + 1);
    let mut b = CudaBackend::new(
        &set,
        &model.config,
        &model.weights,
        CudaOptions {
            slots: maxb + 3,
            slot_capacity: depth_cap.max(long_cap).max(cap),
            // each slot its own run of blocks (metrale_backend::slot_blocks)
            kv_blocks: (maxb + 1) * metrale_backend::blocks_for(cap)
                + metrale_backend::blocks_for(depth_cap)
                + metrale_backend::blocks_for(long_cap),
            max_step_tokens: pp.max(512),
            tuning,
            ..Default::default()
        },
    )
    .expect("backend");
    let load_s = t0.elapsed().as_secs_f64();
    let tables: Vec<Vec<u32>> = (0..maxb + 1)
        .map(|s| metrale_backend::slot_blocks(s, cap))
        .collect();
    let info = b.info();
    eprintln!("{info:?} (model load + upload {load_s:.2} s)");
    let copy_gbs = b.copy_rate_gbs(2 << 30).unwrap();
    // FLOPs of a token's matrix products (2 per weight: the layers' four and the LM head), the
    // rate the batched and prefill figures are also given in
    let flops_tok = spec.model.matmul_flops_per_token();
    let wbytes = b.decode_weight_bytes();
    let floor_us = |bytes: u64| bytes as f64 / (copy_gbs * 1e3);
    eprintln!(
        "device-to-device copy: {copy_gbs:.0} GB/s; a decode step reads {wbytes} weight bytes: {:.1} us at that rate",
        floor_us(wbytes)
    );
    let greedy = SamplingParams::default();

    // one sequence's greedy step (device pick, no logits): the token it picks
    let step1 = |b: &mut CudaBackend,
                 (slot, blocks): (usize, &[u32]),
                 start_pos: usize,
                 tokens: &[u32],
                 history: &[u32],
                 draw: u64|
     -> u32 {
        b.step(&[SeqStep {
            slot,
            blocks,
            start_pos,
            tokens,
            history,
            sampling: &greedy,
            draw,
            want_logits: false,
            allowed: None,
            drafted: 0,
        }])
        .unwrap()[0]
            .token
    };

    let median = |v: &mut Vec<f64>| -> (f64, f64, f64) {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let q = |f: f64| v[((v.len() - 1) as f64 * f) as usize];
        (q(0.5), q(0.1), q(0.9))
    };

    // batch-1 decode
    let mut hist = prompt.clone();
    let t_first = Instant::now();
    let first = step1(&mut b, (0, &tables[0]), 0, &prompt, &prompt, 0);
    let ttft_ms = t_first.elapsed().as_secs_f64() * 1e3;
    hist.push(first);
    let mut times = Vec::new();
    for s in 1..steps {
        let n = hist.len();
        let last = [hist[n - 1]];
        let t = Instant::now();
        let tok = step1(&mut b, (0, &tables[0]), n - 1, &last, &hist, s as u64);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        hist.push(tok);
    }
    // the batch-1 step's kernels (its graph's nodes), as captured; none on the persistent kernel
    let step_kernels = b.stats.last_graph_kernels;
    let mut replay = Vec::new();
    for _ in 0..7 {
        if let Some(us) = b.time_graph_replay(200).unwrap() {
            replay.push(us);
        }
    }
    let replay_us = if replay.is_empty() {
        f64::NAN
    } else {
        median(&mut replay).0
    };
    let path = if b.decode1_info().is_some() {
        "decode_1"
    } else {
        "graphs"
    };
    eprintln!("decode b=1 {path} replay alone: {replay_us:.1} us/token (median of 7 x 200 replays, {step_kernels} kernels a step); persistent kernel: {:?}", b.decode1_info());
    let trace_out = opt("--trace", "");
    if !trace_out.is_empty() {
        // the persistent kernel's per-stage stamps at the last step's position (raw u64 little-endian)
        if let Some((blocks, t)) = b.trace_decode1().unwrap() {
            let bytes: Vec<u8> = t.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(&trace_out, bytes).expect("write --trace");
            let meta = format!(
                "{{\"blocks\": {blocks}, \"layers\": {}, \"nstamp\": {}, \"pos\": {}}}\n",
                spec.model.layers,
                abi::DECODE_NSTAMP,
                hist.len() - 2
            );
            std::fs::write(format!("{trace_out}.json"), meta).expect("write --trace meta");
        }
    }
    let prof = b.profile_kernels(50, 20).unwrap();
    let layers = spec.model.layers as f64;
    let mut est = 0.0;
    for (name, us) in &prof {
        if *name == "moe_route" {
            // timed inside ffn_in too: shown, not added
            eprintln!("  kernel {name:15} {us:7.2} us/launch  (part of ffn_in)");
            continue;
        }
        let per_token = if matches!(
            *name,
            "attn_in" | "attention" | "attn_out" | "ffn_in" | "ffn_out"
        ) {
            us * layers
        } else {
            *us
        };
        est += per_token;
        eprintln!("  kernel {name:15} {us:7.2} us/launch  -> {per_token:7.1} us/token");
    }
    eprintln!("  sum of kernels alone: {est:.1} us/token");
    let prof_json = kernel_us_json(&prof);
    let warm: Vec<f64> = times.iter().skip(16).copied().collect();
    let (med, p10, p90) = median(&mut warm.clone());
    let text = model.tokenizer.decode(&hist[prompt.len()..], false);
    eprintln!("decode b=1: median {med:.1} us/token ({:.0} tok/s), p10 {p10:.1}, p90 {p90:.1}; first step (prefill {} tokens) {ttft_ms:.2} ms; weight floor {:.1} us: {:.0}% of the copy rate", 1e6 / med, prompt.len(), floor_us(wbytes), 100.0 * floor_us(wbytes) / med);
    eprintln!("text: {text:?}");

    // tg128 as llama-bench defines it: 128 single-token steps at positions 0..127 from a one-token
    // context, timed as a whole (every step's host work included); median of 5 runs after a warm-up.
    // The slot is one no other measurement here uses.
    let tg_slot = maxb;
    let mut tg = Vec::new();
    for rep in 0..6 {
        let mut h: Vec<u32> = vec![prompt[0]];
        let t = Instant::now();
        for s in 0..128usize {
            let tok = [h[s]];
            let next = step1(&mut b, (tg_slot, &tables[tg_slot]), s, &tok, &h, s as u64);
            h.push(next);
        }
        if rep > 0 {
            tg.push(128.0 / t.elapsed().as_secs_f64());
        }
    }
    let (tg128, _, _) = median(&mut tg);
    eprintln!(
        "tg128 (llama-bench's definition): median {tg128:.1} tok/s ({:.1} us/token)",
        1e6 / tg128
    );

    // tg128 again under a grammar mask asked on demand at every step, as the server's engine asks
    // it (every other token id allowed): what the masked pick (the mask staged, argmax_masked_1 over
    // the row's blocks) costs a step that still runs ahead
    struct EveryOther(Vec<u32>);
    impl metrale_backend::MaskSource for EveryOther {
        fn mask(&mut self, _: usize) -> Option<Vec<u32>> {
            Some(self.0.clone())
        }
    }
    let vocab = metrale_backend::Dims::from_shape(&spec.model).vocab;
    let mut every_other = EveryOther(vec![0x5555_5555; vocab.div_ceil(32)]);
    let hits0 = b.stats.run_ahead_hits;
    let mut tgm = Vec::new();
    for rep in 0..6 {
        let mut h: Vec<u32> = vec![prompt[0]];
        let t = Instant::now();
        for s in 0..128usize {
            let tok = [h[s]];
            let step = SeqStep {
                slot: tg_slot,
                blocks: &tables[tg_slot],
                start_pos: s,
                tokens: &tok,
                history: &h,
                sampling: &greedy,
                draw: s as u64,
                want_logits: false,
                allowed: None,
                drafted: 0,
            };
            let next = b.step_masked(&[step], &[true], &mut every_other).unwrap()[0].token;
            assert!(
                next.is_multiple_of(2),
                "masked pick {next}: an odd id, which the mask forbids"
            );
            h.push(next);
        }
        if rep > 0 {
            tgm.push(128.0 / t.elapsed().as_secs_f64());
        }
    }
    let (tg128_masked, _, _) = median(&mut tgm);
    let masked_hits = b.stats.run_ahead_hits - hits0;
    eprintln!(
        "tg128 under a grammar mask: median {tg128_masked:.1} tok/s ({:.1} us/token, {:.3}x unmasked); run-ahead hits {masked_hits} of {}",
        1e6 / tg128_masked,
        tg128_masked / tg128,
        6 * 127
    );

    // the masked pick's pieces on the device, after the same decode_1 step relaunched
    let pick_us = b.time_masked_pick(200).unwrap();
    if let Some([alone, staged, masked, pick]) = pick_us {
        eprintln!(
            "decode_1 step relaunched: {alone:.1} us; + the mask staged {staged:.1}; + mask_logits {masked:.1}; + the masked pick (staging, argmax_masked_1) {pick:.1} (tuning {tuning:?})"
        );
    }
    let pick_json = pick_us.map_or("null".to_string(), |v| {
        format!(
            "{{\"decode_1\": {:.2}, \"staged\": {:.2}, \"mask_logits\": {:.2}, \"masked_pick\": {:.2}}}",
            v[0], v[1], v[2], v[3]
        )
    });

    // prefill pp tokens
    let ids: Vec<u32> = (0..pp).map(|i| prompt[i % prompt.len()]).collect();
    // median of 15 after 3 warm-ups: with one warm-up and 5 repetitions the median moved by up to
    // 12% between two runs of the same kernels in one call (the clocks still settling after the
    // batch-1 runs)
    let mut pt = Vec::new();
    for rep in 0..18 {
        let t = Instant::now();
        step1(&mut b, (1, &tables[1]), 0, &ids, &ids, 0);
        if rep >= 3 {
            pt.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let (pp_ms, _, _) = median(&mut pt);
    let pp_tflops = pp as f64 / pp_ms * 1e3 * flops_tok / 1e12;
    eprintln!(
        "prefill {pp}: median {pp_ms:.2} ms ({:.0} tok/s, {pp_tflops:.1} TFLOP/s in the matrix products)",
        pp as f64 / pp_ms * 1e3
    );
    // each kernel alone at the prefill shape (both paths' kernels)
    let prof_pp = b.profile_kernels(3, 5).unwrap();
    for (name, us) in &prof_pp {
        eprintln!("  prefill {pp}: kernel {name:15} {us:9.2} us/launch");
    }
    let prof_pp_json = kernel_us_json(&prof_pp);

    // batch-1 decode after `depth` cached positions (zeros, see the module docs)
    let depth_slot = maxb + 1;
    let first = (maxb + 1) * metrale_backend::blocks_for(cap);
    let depth_table: Vec<u32> = (first..first + metrale_backend::blocks_for(depth_cap))
        .map(|x| x as u32)
        .collect();
    let mut depth_res = Vec::new();
    for &d in &depths {
        let mut h: Vec<u32> = vec![prompt[0]];
        let mut ts = Vec::new();
        for s in 0..depth_steps {
            let tok = [h[s]];
            let t = Instant::now();
            let next = step1(
                &mut b,
                (depth_slot, &depth_table),
                d + s,
                &tok,
                &h,
                s as u64,
            );
            if s >= 16 {
                ts.push(t.elapsed().as_secs_f64() * 1e6);
            }
            h.push(next);
        }
        let (m, p10, p90) = median(&mut ts);
        let kv = b.kv_bytes_read(d + depth_steps / 2);
        let fl = floor_us(wbytes + kv);
        // the attention alone at this depth (the last step's shape), against its KV bytes
        let att_us = b
            .profile_kernels(20, 5)
            .unwrap()
            .into_iter()
            .find(|(n, _)| *n == "attention")
            .map_or(f64::NAN, |(_, us)| us);
        let att_floor = floor_us(kv / spec.model.layers as u64);
        eprintln!(
            "  attention alone at depth {d}: {att_us:.1} us per layer (its KV bytes at the copy rate: {att_floor:.1} us)"
        );
        eprintln!(
            "decode b=1 at depth {d}: median {m:.1} us/token ({:.0} tok/s), p10 {p10:.1}, p90 {p90:.1}; floor {fl:.1} us (weights + {kv} KV bytes): {:.0}% of the copy rate",
            1e6 / m,
            100.0 * fl / m
        );
        depth_res.push(format!(
            "{{\"depth\": {d}, \"us_per_token\": {m:.2}, \"p10\": {p10:.2}, \"p90\": {p90:.2}, \"tok_s\": {:.1}, \"kv_bytes\": {kv}, \"floor_us\": {fl:.2}, \"share_of_copy_rate\": {:.4}, \"attention_us_per_layer\": {att_us:.2}, \"attention_floor_us\": {att_floor:.2}}}",
            1e6 / m,
            fl / m
        ));
    }

    // long prompts: one sequence prefilled in max_step_tokens chunks
    let long_first = first + metrale_backend::blocks_for(depth_cap);
    let long_table: Vec<u32> = (long_first..long_first + metrale_backend::blocks_for(long_cap))
        .map(|x| x as u32)
        .collect();
    let mut long_res = Vec::new();
    for &n in &longs {
        let ids: Vec<u32> = (0..n).map(|i| prompt[i % prompt.len()]).collect();
        let mut ts = Vec::new();
        for rep in 0..4 {
            b.release(maxb + 2);
            let t = Instant::now();
            step1(&mut b, (maxb + 2, &long_table), 0, &ids, &ids, 0);
            if rep > 0 {
                ts.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let (ms, _, _) = median(&mut ts);
        let d = metrale_backend::Dims::from_shape(&spec.model);
        let att_flop = 4.0 * (d.head_dim * d.heads * d.layers) as f64 * (n * n) as f64 / 2.0;
        let tflops = (n as f64 * flops_tok + att_flop) / ms / 1e9;
        eprintln!(
            "prefill of one {n}-token prompt: median {ms:.1} ms ({:.0} tok/s), {tflops:.1} TFLOP/s (products + causal attention)",
            n as f64 / ms * 1e3
        );
        long_res.push(format!(
            "{{\"tokens\": {n}, \"ms_median\": {ms:.3}, \"tok_s\": {:.1}, \"attention_flop\": {att_flop:.0}, \"tflops\": {tflops:.2}}}",
            n as f64 / ms * 1e3
        ));
    }

    // batched decode: every sequence starts from the prompt (prefilled together), then decodes
    let mut batch_res = Vec::new();
    for &nb in &batches {
        let mut hs: Vec<Vec<u32>> = vec![prompt.clone(); nb];
        for i in 0..nb {
            b.release(i);
        }
        let mut ts = Vec::new();
        for s in 0..64usize {
            let steps_v: Vec<SeqStep> = (0..nb)
                .map(|i| {
                    let n = hs[i].len();
                    let (start, toks): (usize, &[u32]) = if s == 0 {
                        (0, &hs[i][..])
                    } else {
                        (n - 1, &hs[i][n - 1..])
                    };
                    SeqStep {
                        slot: i,
                        blocks: &tables[i],
                        start_pos: start,
                        tokens: toks,
                        history: &hs[i],
                        sampling: &greedy,
                        draw: s as u64,
                        want_logits: false,
                        allowed: None,
                        drafted: 0,
                    }
                })
                .collect();
            let t = Instant::now();
            let r = b.step(&steps_v).unwrap();
            let dt = t.elapsed().as_secs_f64() * 1e6;
            drop(steps_v);
            if s >= 8 {
                ts.push(dt);
            }
            for (i, o) in r.into_iter().enumerate() {
                hs[i].push(o.token);
            }
        }
        let (m, p10, p90) = median(&mut ts);
        let tok_s = nb as f64 * 1e6 / m;
        // the products' rate, and the weights' bytes per step over its time
        let (tflops, weight_gbs) = (tok_s * flops_tok / 1e12, wbytes as f64 / m / 1e3);
        eprintln!(
            "decode batch {nb}: median {m:.1} us/step (p10 {p10:.1}, p90 {p90:.1}), {tok_s:.0} tok/s, {tflops:.1} TFLOP/s, weights at {weight_gbs:.0} GB/s"
        );
        // the last step's graph replayed back to back (the device's share of a step: the rest is
        // the host's input and output work), then each of its stages alone (a graph of its
        // launches back to back) summed over the layers on the path the step ran: where a step's
        // time goes
        let replay = b.time_graph_replay(50).unwrap().unwrap_or(f64::NAN);
        eprintln!("  decode batch {nb}: the step's graph replayed alone {replay:.1} us");
        let prof_b = b.profile_kernels(20, 5).unwrap();
        let gemm_path = prof_b.iter().any(|(n, _)| n.starts_with("gemm_"))
            && metrale_backend::cuda::gemm::gemm_pays_on(
                &metrale_backend::Dims::from_shape(&spec.model),
                nb,
                true,
            );
        // the stages on the path the step ran, per launch and summed over a step: `prof` as timed
        let on_path = |prof: &[(&'static str, f64)], label: &str| {
            let mut sum = 0.0;
            for (name, us) in prof {
                if *name == "moe_route" {
                    // timed inside ffn_in too: shown, not added
                    eprintln!(
                        "  decode batch {nb}: kernel {name:15} {us:9.2} us/launch {label}(part of ffn_in)"
                    );
                    continue;
                }
                let counted = match *name {
                    "embed" | "lm_head" => Some(1.0),
                    "attention" | "attention_flash" => Some(layers),
                    n if n.starts_with("gemm_") == gemm_path => Some(layers),
                    _ => None,
                };
                if let Some(times) = counted {
                    sum += us * times;
                    eprintln!("  decode batch {nb}: kernel {name:15} {us:9.2} us/launch {label}");
                }
            }
            sum
        };
        let sum = on_path(&prof_b, "");
        eprintln!("  decode batch {nb}: the stages alone sum to {sum:.1} us/step");
        // each launch on the next layer's weights: their bytes from memory, as in the step
        let prof_x = b.profile_kernels_across_layers(5).unwrap();
        let sum_x = on_path(&prof_x, "across layers ");
        eprintln!(
            "  decode batch {nb}: the stages across layers sum to {sum_x:.1} us/step; the step's \
             graph {:.1} us beyond them (hand-overs between different kernels)",
            replay - sum_x
        );
        let prof_b_json = kernel_us_json(&prof_b);
        batch_res.push(format!(
            "{{\"batch\": {nb}, \"us_per_step\": {m:.2}, \"us_p10\": {p10:.2}, \"us_p90\": {p90:.2}, \"tok_s\": {tok_s:.1}, \"tflops\": {tflops:.2}, \"weight_gbs\": {weight_gbs:.1}, \"graph_replay_us\": {replay:.1}, \"stages_alone_us\": {sum:.1}, \"stages_across_layers_us\": {sum_x:.1}, \"kernel_us\": {{{}}}, \"kernel_across_layers_us\": {{{}}}}}",
            prof_b_json,
            kernel_us_json(&prof_x)
        ));
    }
    // the routed experts' histogram over the whole run (every step above), where there are some
    let histogram = match b.expert_counts().unwrap() {
        Some(layers) => {
            let experts = layers.first().map_or(0, Vec::len);
            let (mut lo, mut hi) = (f64::INFINITY, 0f64);
            for l in &layers {
                let mean = l.iter().map(|&c| c as f64).sum::<f64>() / experts.max(1) as f64;
                for &c in l {
                    lo = lo.min(c as f64 / mean);
                    hi = hi.max(c as f64 / mean);
                }
            }
            eprintln!(
                "expert histogram over the run: {} layers x {experts} experts; an expert's count \
                 from {lo:.2} to {hi:.2} times its layer's mean",
                layers.len()
            );
            let rows: Vec<String> = layers
                .iter()
                .map(|l| {
                    format!(
                        "[{}]",
                        l.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                    )
                })
                .collect();
            format!(
                "{{\"min_over_mean\": {lo:.4}, \"max_over_mean\": {hi:.4}, \"counts\": [{}]}}",
                rows.join(",")
            )
        }
        None => "null".into(),
    };
    let json = format!(
        "{{\"target\": \"{target}\", \"device\": \"{}\", \"weight_bytes\": {}, \"copy_gbs\": {copy_gbs:.1}, \"decode_weight_bytes\": {wbytes}, \"floor_bytes_us\": {:.2}, \"share_of_copy_rate\": {:.4}, \"graph_nodes\": {step_kernels}, \"floor_launch_us\": {:.1}, \"decode_b1_us_median\": {med:.2}, \"decode_b1_us_p10\": {p10:.2}, \"decode_b1_us_p90\": {p90:.2}, \"decode_b1_tok_s\": {:.1}, \"tg128_tok_s\": {tg128:.1}, \"tg128_masked_tok_s\": {tg128_masked:.1}, \"tg128_masked_run_ahead_hits\": {masked_hits}, \"masked_pick_us\": {pick_json}, \"graph_replay_us\": {replay_us:.2}, \"decode_path\": \"{path}\", \"decode1\": \"{:?}\", \"kernel_us\": {{{}}}, \"pdl\": {}, \"decode_steps\": {}, \"pp\": {pp}, \"pp_ms_median\": {pp_ms:.3}, \"pp_tok_s\": {:.1}, \"pp_tflops\": {pp_tflops:.2}, \"matmul_flops_per_token\": {flops_tok:.0}, \"prefill_kernel_us\": {{{}}}, \"tuning\": \"{:?}\", \"first_step_ms\": {ttft_ms:.3}, \"load_s\": {load_s:.3}, \"batched\": [{}], \"depth\": [{}], \"long\": [{}], \"expert_histogram\": {histogram}, \"stats\": \"{:?}\"}}",
        info.device,
        info.weight_bytes,
        floor_us(wbytes),
        floor_us(wbytes) / med,
        step_kernels as f64 * 0.9,
        1e6 / med,
        b.decode1_info(),
        prof_json,
        b.gpu().pdl,
        warm.len(),
        pp as f64 / pp_ms * 1e3,
        prof_pp_json,
        tuning,
        batch_res.join(", "),
        depth_res.join(", "),
        long_res.join(", "),
        b.stats
    );
    println!("{json}");
    if !out.is_empty() {
        std::fs::write(&out, json + "\n").expect("write --out");
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("build with --features cuda");
    std::process::exit(2);
}
