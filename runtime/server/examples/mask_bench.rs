//! What structured output costs the host per generated token: llguidance's allowed-token mask for
//! a nested JSON schema (`tests/python/water-schema.json`, which `test_structured.py` holds the
//! server to), over a model's real vocabulary, on the CPU that feeds the GPU. The engine asks for
//! one mask per constrained sequence per step, in turn (`TokenConstraint::allowed`); this measures
//! a mask alone and a whole step's masks, as the engine computes them and on `--threads` threads
//! (to see whether spreading them pays on this machine).
//!
//! Each stream walks the grammar: ask the mask, take a seeded random allowed token, commit it, until
//! the grammar completes (then a fresh copy starts) or `--tokens` masks were asked.
//!
//! Usage: mask_bench MODEL [--streams 1,64] [--tokens 128] [--seed 1] [--threads N] [--out FILE.json]
//! (MODEL: any checkpoint `metrale_model::Model::load` reads; only its tokenizer and vocabulary
//! size are used, so a 2-layer `cargo xtask synth-model` file stands in for its full-size model.)

use std::time::Instant;

use metrale_engine::Constraint;
use metrale_server::grammar::{Compiled, GrammarFields, Grammars};
use serde_json::{json, Value};

/// The schema `tests/python/test_structured.py` holds the server to.
fn schema() -> Value {
    serde_json::from_str(include_str!("../../../tests/python/water-schema.json"))
        .expect("schema JSON")
}

fn opt<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// xorshift64*: the walk's choices, reproducible from the seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// A seeded random token among the mask's set bits.
fn pick(mask: &[u32], rng: &mut Rng) -> u32 {
    let n: u32 = mask.iter().map(|w| w.count_ones()).sum();
    assert!(n > 0, "the grammar allows no token");
    let mut k = (rng.next() % n as u64) as u32;
    for (i, &w) in mask.iter().enumerate() {
        let c = w.count_ones();
        if k < c {
            let mut w = w;
            for _ in 0..k {
                w &= w - 1;
            }
            return i as u32 * 32 + w.trailing_zeros();
        }
        k -= c;
    }
    unreachable!()
}

fn quantiles(mut v: Vec<f64>) -> Value {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    json!({"median": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": v.iter().sum::<f64>() / v.len() as f64, "n": v.len()})
}

/// A step's masks on `threads` scoped threads (contiguous shares).
fn on_threads(cs: &mut [Constraint], threads: usize) -> Vec<(usize, Result<Vec<u32>, String>)> {
    let per = cs.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = cs
            .chunks_mut(per)
            .enumerate()
            .map(|(j, part)| {
                s.spawn(move || {
                    part.iter_mut()
                        .enumerate()
                        .map(|(k, c)| (j * per + k, c.0.allowed()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

/// `streams` walks advanced in lockstep for `tokens` steps; each step's masks computed as the
/// engine does (`threads` 0, each mask timed) or on `threads` threads. Returns per-step
/// milliseconds and the microseconds of each mask (engine mode).
fn run(
    g: &Compiled,
    streams: usize,
    tokens: usize,
    seed: u64,
    threads: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut cs: Vec<Constraint> = (0..streams).map(|_| g.constraint()).collect();
    let mut rngs: Vec<Rng> = (0..streams)
        .map(|i| Rng(seed * 1000 + i as u64 + 1))
        .collect();
    let (mut steps, mut masks) = (Vec::new(), Vec::new());
    for _ in 0..tokens {
        let t = Instant::now();
        let out: Vec<(usize, Result<Vec<u32>, String>)> = if threads > 0 {
            on_threads(&mut cs, threads)
        } else {
            cs.iter_mut()
                .enumerate()
                .map(|(k, c)| {
                    let t1 = Instant::now();
                    let m = c.0.allowed();
                    masks.push(t1.elapsed().as_secs_f64() * 1e6);
                    (k, m)
                })
                .collect()
        };
        steps.push(t.elapsed().as_secs_f64() * 1e3);
        for (k, m) in out {
            let m = m.expect("mask");
            let tok = pick(&m, &mut rngs[k]);
            cs[k].0.commit(tok).expect("commit");
            if cs[k].0.finished() {
                cs[k] = g.constraint();
            }
        }
    }
    (steps, masks)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1).filter(|a| !a.starts_with("--")) else {
        eprintln!(
            "usage: mask_bench MODEL [--streams 1,64] [--tokens 128] [--seed 1] [--out FILE.json]"
        );
        std::process::exit(2);
    };
    let streams: Vec<usize> = opt(&args, "--streams")
        .unwrap_or("1,64")
        .split(',')
        .map(|s| s.trim().parse().expect("--streams: numbers"))
        .collect();
    let tokens: usize = opt(&args, "--tokens").map_or(128, |t| t.parse().expect("--tokens N"));
    let seed: u64 = opt(&args, "--seed").map_or(1, |t| t.parse().expect("--seed N"));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: usize =
        opt(&args, "--threads").map_or(cpus.min(8), |t| t.parse().expect("--threads N"));
    let model = metrale_model::Model::load(std::path::Path::new(path)).expect("model");
    let vocab = model.config.vocab;
    let eos = model.tokenizer.eos().first().copied().unwrap_or(0);
    let t = Instant::now();
    let grammars = Grammars::new(&model.tokenizer, vocab, eos).expect("token trie");
    let trie_s = t.elapsed().as_secs_f64();
    let fields = GrammarFields {
        response_format: Some(
            json!({"type": "json_schema", "json_schema": {"name": "water", "schema": schema()}}),
        ),
        ..Default::default()
    };
    let (tlg, param) = fields.grammar().expect("fields").expect("a grammar");
    let t = Instant::now();
    let compiled = grammars.compile(tlg, param).expect("compiles");
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut rows = Vec::new();
    for &n in &streams {
        let (steps, masks) = run(&compiled, n, tokens, seed, 0);
        let (par_steps, _) = run(&compiled, n, tokens, seed, threads);
        let row = json!({
            "streams": n,
            "steps": tokens,
            "mask_us": quantiles(masks),
            "step_ms_engine": quantiles(steps),
            "step_ms_threads": quantiles(par_steps),
        });
        eprintln!(
            "{n} streams: mask {:.1} us median ({:.1} p99); a step's masks {:.3} ms as the engine computes them, {:.3} ms on {threads} threads",
            row["mask_us"]["median"].as_f64().unwrap(),
            row["mask_us"]["p99"].as_f64().unwrap(),
            row["step_ms_engine"]["median"].as_f64().unwrap(),
            row["step_ms_threads"]["median"].as_f64().unwrap()
        );
        rows.push(row);
    }
    let out = json!({
        "model": std::path::Path::new(path).file_name().map(|f| f.to_string_lossy().into_owned()),
        "vocab": vocab,
        "schema": "tests/python/test_structured.py SCHEMA (nested object, enums, bounded array, required keys)",
        "token_trie_s": trie_s,
        "compile_ms": compile_ms,
        "cpus": cpus,
        "threads": threads,
        "rows": rows,
    });
    let text = serde_json::to_string_pretty(&out).unwrap();
    match opt(&args, "--out") {
        Some(f) => std::fs::write(f, text + "\n").expect("write --out"),
        None => println!("{text}"),
    }
}
