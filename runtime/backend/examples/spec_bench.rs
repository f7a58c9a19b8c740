//! What speculative verification buys at batch 1 on any backend that verifies proposed tokens
//! (`SeqStep::drafted`): one sequence decoded greedily token by token (the plain rate), then the
//! same continuation regenerated with `k` proposals a step replayed from the plain run, each
//! proposal replaced by another token with probability `rate` (seeded), so that the acceptance a
//! rate gives is the only thing that differs between the runs. Reported per rate: tokens a second,
//! the share of proposals accepted, tokens a verification step, the step's time against a plain
//! step's, and whether the tokens equal the plain run's (greedy verification is exact; a run that
//! parts from it names the position, where the two paths' logits near-tie).
//!
//! Random-weight checkpoints cannot agree with a draft model, so this replay is how the 8B shapes
//! show what each acceptance rate is worth (the issue's `k = 4` curve); real proposers on real
//! text are bench/spec/.
//!
//! Usage: spec_bench MODEL [--cuda KERNEL_DIR TARGET_ID] [--k 4] [--tokens 128]
//!                   [--rates 0,25,50,75] [--reps 3] [--prompt-tokens 64] [--out FILE.json]
//! Medians over `--reps` runs; each run starts from an empty cache (the prompt prefilled again).

#[path = "shared/tool.rs"]
mod tool;

use metrale_backend::sampler::SamplingParams;
use metrale_backend::{Backend, KvDtype, SeqStep};
use serde_json::json;
use std::time::Instant;
use tool::{cpu_backend, cuda_backend, opt};

/// Proposals replayed from a plain run's `tokens`: up to `k` a step, each replaced with probability
/// `rate` (uniforms from `seed`) by the next token id of a `vocab`-token vocabulary.
#[derive(Clone, Copy)]
struct Replay<'a> {
    tokens: &'a [u32],
    k: usize,
    rate: f64,
    seed: u64,
    vocab: u32,
}

/// One run: `n` tokens after `prompt`, greedy, with proposals from `replay` (none: plain
/// decoding). Returns the tokens, the seconds the decode steps took (the prefill not counted), the
/// steps, and the proposals made and accepted.
fn run(
    b: &mut dyn Backend,
    prompt: &[u32],
    n: usize,
    replay: Option<Replay<'_>>,
) -> (Vec<u32>, f64, usize, usize, usize) {
    let table = metrale_backend::slot_blocks(0, b.info().slot_capacity);
    let p = SamplingParams::default();
    let mut hist = prompt.to_vec();
    let mut out = Vec::with_capacity(n + 8);
    let step = |b: &mut dyn Backend, hist: &[u32], start: usize, toks: &[u32], drafted: usize| {
        let s = SeqStep {
            slot: 0,
            start_pos: start,
            tokens: toks,
            blocks: &table,
            history: hist,
            sampling: &p,
            draw: 0,
            want_logits: false,
            allowed: None,
            drafted,
        };
        b.step(std::slice::from_ref(&s)).expect("step").remove(0)
    };
    let first = step(b, prompt, 0, prompt, 0);
    out.push(first.token);
    hist.push(first.token);
    let mut rng = replay.map_or(0, |r| r.seed) | 1;
    let mut uniform = || {
        // xorshift64*: a seeded stream of uniforms in [0, 1)
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        (rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let (mut steps, mut proposed, mut accepted) = (0, 0, 0);
    let t = Instant::now();
    while out.len() < n {
        let last = *hist.last().expect("the prompt is not empty");
        let mut toks = vec![last];
        if let Some(r) = replay {
            let from = out.len();
            for &tok in r.tokens.iter().skip(from).take(r.k.min(n - from)) {
                toks.push(match uniform() < r.rate {
                    true => (tok + 1) % r.vocab,
                    false => tok,
                });
            }
        }
        let drafted = toks.len() - 1;
        let mut full = hist.clone();
        full.extend(&toks[1..]);
        let o = step(b, &full, hist.len() - 1, &toks, drafted);
        steps += 1;
        proposed += drafted;
        accepted += o.accepted.len();
        for tok in o.accepted.iter().map(|a| a.token).chain([o.token]) {
            if out.len() < n {
                out.push(tok);
                hist.push(tok);
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    b.release(0);
    (out, secs, steps, proposed, accepted)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 2 || args[1].starts_with("--") {
        eprintln!(
            "usage: spec_bench MODEL [--cuda KERNEL_DIR TARGET_ID] [--k 4] [--tokens 128] \
             [--rates 0,25,50,75] [--reps 3] [--prompt-tokens 64] [--out FILE.json]"
        );
        std::process::exit(2);
    }
    let num = |name: &str, d: usize| opt(&args, name).map_or(d, |v| v.parse().expect(name));
    let (k, n, reps, plen) = (
        num("--k", 4),
        num("--tokens", 128),
        num("--reps", 3).max(1),
        num("--prompt-tokens", 64),
    );
    let rates: Vec<f64> = opt(&args, "--rates")
        .unwrap_or("0,25,50,75")
        .split(',')
        .map(|r| r.parse::<f64>().expect("--rates: percentages") / 100.0)
        .collect();
    let mut m = metrale_model::Model::load(std::path::Path::new(&args[1])).expect("model");
    let cap = (plen + n + k + 16).next_multiple_of(16);
    let (mut b, backend) = match args.iter().position(|a| a == "--cuda") {
        Some(i) => (
            cuda_backend(&mut m, &args[i + 1], &args[i + 2], cap, k).0,
            args[i + 2].clone(),
        ),
        None => (cpu_backend(&m, KvDtype::F32, false, cap), "cpu".into()),
    };
    assert!(
        b.info().verifies_drafts,
        "the backend does not verify proposed tokens"
    );
    let text =
        "The river runs past the old mill, where the miller's daughter counts sacks of grain \
                each morning before the market opens. Travellers from the northern towns stop to \
                water their horses, trade news of the harvest and argue about the price of salt.";
    let mut prompt = m.tokenizer.encode(text, true, false).expect("tokenize");
    while prompt.len() < plen {
        prompt.extend_from_within(..prompt.len().min(plen - prompt.len()));
    }
    prompt.truncate(plen);
    // the plain rate, and the continuation every replay proposes from
    let mut plain_secs = Vec::new();
    let mut plain = Vec::new();
    for _ in 0..reps {
        let (toks, secs, steps, _, _) = run(b.as_mut(), &prompt, n, None);
        assert_eq!(steps, n - 1);
        plain_secs.push(secs);
        plain = toks;
    }
    let plain_step = median(plain_secs.clone()) / (n - 1) as f64;
    let plain_tps = 1.0 / plain_step;
    println!(
        "{backend}: plain greedy decode {plain_tps:.1} tok/s ({:.3} ms a step), {n} tokens after a {plen}-token prompt",
        plain_step * 1e3
    );
    let mut rows = Vec::new();
    for (ri, &rate) in rates.iter().enumerate() {
        let mut secs = Vec::new();
        let (mut steps, mut proposed, mut accepted, mut parted) = (0, 0, 0, None);
        for rep in 0..reps {
            let replay = Replay {
                tokens: &plain,
                k,
                rate,
                seed: 0x5EED_0000 + (ri * 100 + rep) as u64,
                vocab: m.config.vocab as u32,
            };
            let (toks, s, st, pr, ac) = run(b.as_mut(), &prompt, n, Some(replay));
            secs.push(s);
            (steps, proposed, accepted) = (st, pr, ac);
            parted = parted.or(toks.iter().zip(&plain).position(|(a, b)| a != b));
        }
        let s = median(secs);
        let tps = (n - 1) as f64 / s;
        let step_ms = s / steps as f64 * 1e3;
        let acc = accepted as f64 / proposed.max(1) as f64;
        let per_step = (n - 1) as f64 / steps as f64;
        println!(
            "  corrupted {:>3.0}%: {tps:8.1} tok/s ({:.2}x plain), {:.1}% of {proposed} proposals accepted, \
             {per_step:.2} tokens a step, step {step_ms:.3} ms ({:.2}x a plain step){}",
            rate * 100.0,
            tps / plain_tps,
            acc * 100.0,
            step_ms / (plain_step * 1e3),
            match parted {
                None => ", tokens equal to plain".to_string(),
                Some(p) => format!(", PARTS from plain at token {p}"),
            }
        );
        rows.push(json!({
            "corrupted": rate,
            "tok_s": tps,
            "speedup": tps / plain_tps,
            "acceptance": acc,
            "proposed": proposed,
            "accepted": accepted,
            "tokens_per_step": per_step,
            "step_ms": step_ms,
            "step_over_plain": step_ms / (plain_step * 1e3),
            "parts_at": parted,
        }));
    }
    let report = json!({
        "model": args[1],
        "backend": backend,
        "weight_bytes": b.info().weight_bytes,
        "k": k,
        "tokens": n,
        "prompt_tokens": plen,
        "reps": reps,
        "plain_tok_s": plain_tps,
        "plain_step_ms": plain_step * 1e3,
        "runs": rows,
    });
    if let Some(p) = opt(&args, "--out") {
        std::fs::write(p, serde_json::to_string_pretty(&report).unwrap()).expect("--out");
    }
}
