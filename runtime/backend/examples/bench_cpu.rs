//! Prefill and decode speed of the CPU backend, measured like llama.cpp's llama-bench:
//! pp: one step over `--prompt` tokens from an empty cache; tg: `--gen` single-token steps from an
//! empty cache. Token ids are a fixed pseudo-random sequence. Prints one JSON object per line:
//! {"test": "pp128"|"tg64", "runs": [tok/s...], "median": tok/s}. With `--membw`, first the machine's
//! read bandwidth: `threads` threads summing disjoint halves of a 512 MiB buffer
//! ({"test": "read_bandwidth", "runs": [GB/s...], "median": GB/s}), the floor for decode, which reads
//! every weight byte once per token.
//!
//! cargo run --release -p metrale-backend --example bench_cpu -- MODEL.gguf [--prompt 128] [--gen 64]
//!     [--runs 5] [--threads 2] [--depth 0] [--kv f32|bf16|fp8] [--membw] [--exact]
//! `--depth D` decodes after D cached positions (llama-bench's `-d D`, reported as `tg64@d1024`);
//! `--kv` the KV cache's element type (default f32).

use metrale_backend::cpu::CpuBackend;
use metrale_backend::sampler::SamplingParams;
use metrale_backend::{Backend, SeqStep};
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut model = None;
    let (mut prompt, mut gen, mut runs, mut threads) = (128usize, 64usize, 5usize, 2usize);
    let mut depth = 0usize;
    let (mut membw, mut exact) = (false, false);
    let mut kv = metrale_backend::KvDtype::F32;
    let mut i = 1;
    while i < args.len() {
        let val = |i: usize| {
            args.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} needs a number", args[i]))
        };
        match args[i].as_str() {
            "--prompt" => {
                prompt = val(i);
                i += 1
            }
            "--gen" => {
                gen = val(i);
                i += 1
            }
            "--runs" => {
                runs = val(i);
                i += 1
            }
            "--threads" => {
                threads = val(i);
                i += 1
            }
            "--depth" => {
                depth = val(i);
                i += 1;
            }
            "--kv" => {
                kv = args
                    .get(i + 1)
                    .and_then(|v| metrale_backend::KvDtype::parse(v))
                    .expect("--kv f32, bf16 or fp8");
                i += 1;
            }
            "--membw" => membw = true,
            "--exact" => exact = true,
            p => model = Some(p.to_string()),
        }
        i += 1;
    }
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if membw {
        let words: usize = 512 << 17; // 512 MiB of u64
        let buf: Vec<u64> = (0..words as u64).collect();
        let mut bw = Vec::new();
        for _ in 0..runs.max(3) {
            let t0 = Instant::now();
            let total: u64 = std::thread::scope(|sc| {
                let hs: Vec<_> = buf
                    .chunks(words.div_ceil(threads))
                    .map(|c| sc.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .fold(0u64, |a, x| a.wrapping_add(x))
            });
            std::hint::black_box(total);
            bw.push((words * 8) as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
        let med = median(&mut bw.clone());
        println!("{{\"test\": \"read_bandwidth\", \"threads\": {threads}, \"unit\": \"GB/s\", \"runs\": [{}], \"median\": {med:.2}}}", fmt(&bw));
    }
    let model =
        model.expect("usage: bench_cpu MODEL.gguf [--prompt N] [--gen N] [--runs N] [--threads N]");
    let m = metrale_model::Model::load(std::path::Path::new(&model)).expect("loading the model");
    let kvc = metrale_backend::KvConfig {
        dtype: kv,
        ..metrale_backend::KvConfig::per_slot(1, prompt.max(depth + gen) + 1)
    };
    let mut b = CpuBackend::load_kv(&m, kvc, threads).expect("loading the CPU backend");
    b.set_exact_activations(exact);
    eprintln!("{:?}", b.info());
    println!(
        "{{\"test\": \"info\", \"weight_bytes\": {}, \"device\": \"{}\"}}",
        b.info().weight_bytes,
        b.info().device
    );
    let vocab = m.config.vocab as u64;
    let toks: Vec<u32> = (0..prompt.max(depth + gen) as u64)
        .map(|i| (metrale_backend::sampler::uniform(1, i) * vocab as f64) as u32)
        .collect();
    let p = SamplingParams::default();
    let step = |b: &mut CpuBackend, start: usize, t: &[u32]| {
        let cap = b.info().slot_capacity;
        let s = SeqStep {
            slot: 0,
            blocks: &metrale_backend::slot_blocks(0, cap),
            start_pos: start,
            tokens: t,
            history: t,
            sampling: &p,
            draw: 0,
            want_logits: false,
            allowed: None,
            drafted: 0,
        };
        b.step(&[s]).expect("step");
    };
    // warm-up (like llama-bench)
    step(&mut b, 0, &toks[..prompt]);
    for j in 0..4 {
        step(&mut b, j, &toks[j..j + 1]);
    }
    let mut pp = Vec::new();
    for _ in 0..runs {
        b.release(0);
        let t0 = Instant::now();
        step(&mut b, 0, &toks[..prompt]);
        pp.push(prompt as f64 / t0.elapsed().as_secs_f64());
    }
    let mut tg = Vec::new();
    if depth > 0 {
        // the context every decode run starts from (its KV entries stay; each run rewrites depth..)
        for c in (0..depth).step_by(512) {
            step(&mut b, c, &toks[c..(c + 512).min(depth)]);
        }
    }
    for _ in 0..runs {
        let t0 = Instant::now();
        for j in depth..depth + gen {
            step(&mut b, j, &toks[j..j + 1]);
        }
        tg.push(gen as f64 / t0.elapsed().as_secs_f64());
    }
    let pm = median(&mut pp.clone());
    let tm = median(&mut tg.clone());
    println!(
        "{{\"test\": \"pp{prompt}\", \"threads\": {threads}, \"runs\": [{}], \"median\": {pm:.2}}}",
        fmt(&pp)
    );
    println!(
        "{{\"test\": \"tg{gen}{}\", \"threads\": {threads}, \"runs\": [{}], \"median\": {tm:.2}}}",
        if depth > 0 {
            format!("@d{depth}")
        } else {
            String::new()
        },
        fmt(&tg)
    );
}
