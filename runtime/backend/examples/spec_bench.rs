//! What speculative verification buys at batch 1 on any backend that verifies proposed tokens
//! (`SeqStep::drafted`): one sequence decoded greedily token by token (the plain rate), then the
//! same continuation regenerated with `k` proposals a step replayed from the plain run, each
//! proposal replaced by another token with probability `rate` (seeded), so that the acceptance a
//! rate gives is the only thing that differs between the runs. Reported per rate: tokens a second,
//! the share of proposals accepted, tokens a verification step, the step's time against a plain
//! step's, and where the tokens part from the plain run's.
//!
//! Greedy verification is exact where the backend's rows do not depend on how tokens are grouped
//! into a step (the CPU backend). On CUDA a verification step's rows come from other kernels than a
//! one-token step's (the tensor-core GEMMs), equal to the last bits only, so where the plain pick
//! was a near-tie the verified run may take the other token. Each such parting is reported with
//! the plain pick's top-2 logit margin there (from untimed plain runs that read their logits), and
//! the replay then re-synchronises: the proposals come from a plain continuation of the verified
//! run's own history, decoded untimed on a second slot, so a parting costs the acceptance curve
//! one rejected proposal, not the rest of the run.
//!
//! Random-weight checkpoints cannot agree with a draft model, so this replay is how the 8B shapes
//! show what each acceptance rate is worth (the issue's `k = 4` curve); real proposers on real
//! text are bench/spec/.
//!
//! Usage: spec_bench MODEL [--cuda KERNEL_DIR TARGET_ID] [--k 4] [--tokens 128]
//!                   [--rates 0,25,50,75] [--reps 3] [--prompt-tokens 64] [--out FILE.json]
//!                   [--flip N]
//! `--flip N` checks the re-synchronisation: the reference's token N is replaced, so every run
//! parts there and must still end with the plain run's tokens on a backend whose verification is
//! exact (the CPU's).
//! Each run starts from an empty cache (the prompt prefilled again); the time counted is the
//! decode steps' alone. Each rate's row is the repetition of median time, every figure from it.

#[path = "shared/tool.rs"]
mod tool;

use metrale_backend::sampler::SamplingParams;
use metrale_backend::{Backend, KvDtype, SeqOutput, SeqStep};
use serde_json::json;
use std::time::Instant;
use tool::{cpu_backend, cuda_backend, opt};

/// The slot the measured runs decode in; the re-synchronising plain runs take the other.
const MEASURED: usize = 0;
const RESYNC: usize = 1;

/// A greedy continuation proposals are drawn from, and each of its tokens' top-2 logit margins.
#[derive(Clone, Default)]
struct Reference {
    tokens: Vec<u32>,
    margins: Vec<f32>,
}

/// Proposals replayed from a greedy continuation: up to `k` a step, each replaced with probability
/// `rate` (uniforms from `seed`) by the next token id of a `vocab`-token vocabulary.
#[derive(Clone, Copy)]
struct Replay<'a> {
    reference: &'a Reference,
    k: usize,
    rate: f64,
    seed: u64,
    vocab: u32,
}

/// What one run did.
#[derive(Default)]
struct Run {
    tokens: Vec<u32>,
    /// Seconds inside the decode steps (the prefill and any re-synchronising run not counted).
    secs: f64,
    steps: usize,
    proposed: usize,
    accepted: usize,
    /// Each token's top-2 logit margin, where the run read its logits.
    margins: Vec<f32>,
    /// Where the verified tokens parted from the reference, and the reference pick's margin there.
    partings: Vec<(usize, f32)>,
}

/// The gap between a logit row's largest and second-largest values.
fn top2_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            (a, b) = (v, a);
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// One run in `slot`: `n` tokens after `prompt`, greedy, with proposals from `replay` (none: plain
/// decoding, reading every step's logits when `margins` is set, for their top-2 margins).
fn run(
    b: &mut dyn Backend,
    slot: usize,
    prompt: &[u32],
    n: usize,
    replay: Option<Replay<'_>>,
    margins: bool,
) -> Run {
    let table = metrale_backend::slot_blocks(slot, b.info().slot_capacity);
    let p = SamplingParams::default();
    let mut r = Run::default();
    let mut hist = prompt.to_vec();
    let step = |b: &mut dyn Backend, hist: &[u32], start: usize, toks: &[u32], drafted: usize| {
        let s = SeqStep {
            slot,
            start_pos: start,
            tokens: toks,
            blocks: &table,
            history: hist,
            sampling: &p,
            draw: 0,
            want_logits: margins,
            allowed: None,
            drafted,
        };
        b.step(std::slice::from_ref(&s)).expect("step").remove(0)
    };
    let note = |r: &mut Run, o: &SeqOutput| {
        if let Some(row) = o.logits.as_deref() {
            r.margins.push(top2_margin(row));
        }
    };
    let first = step(b, prompt, 0, prompt, 0);
    note(&mut r, &first);
    r.tokens.push(first.token);
    hist.push(first.token);
    let mut reference = replay.map(|x| x.reference.clone()).unwrap_or_default();
    let mut rng = replay.map_or(0, |x| x.seed) | 1;
    let mut uniform = || {
        // xorshift64*: a seeded stream of uniforms in [0, 1)
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        (rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    while r.tokens.len() < n {
        let last = *hist.last().expect("the prompt is not empty");
        let mut toks = vec![last];
        if let Some(x) = replay {
            let from = r.tokens.len();
            for &tok in reference.tokens.iter().skip(from).take(x.k.min(n - from)) {
                toks.push(match uniform() < x.rate {
                    true => (tok + 1) % x.vocab,
                    false => tok,
                });
            }
        }
        let drafted = toks.len() - 1;
        let mut full = hist.clone();
        full.extend(&toks[1..]);
        let t = Instant::now();
        let o = step(b, &full, hist.len() - 1, &toks, drafted);
        r.secs += t.elapsed().as_secs_f64();
        note(&mut r, &o);
        r.steps += 1;
        r.proposed += drafted;
        r.accepted += o.accepted.len();
        let mut parted = false;
        for tok in o.accepted.iter().map(|a| a.token).chain([o.token]) {
            let j = r.tokens.len();
            if j >= n {
                break;
            }
            if replay.is_some() && !parted && reference.tokens.get(j) != Some(&tok) {
                r.partings
                    .push((j, reference.margins.get(j).copied().unwrap_or(f32::NAN)));
                parted = true;
            }
            r.tokens.push(tok);
            hist.push(tok);
        }
        if parted && r.tokens.len() < n {
            // re-synchronise: the plain continuation of this run's history, untimed, on the
            // other slot (which `run` releases), with its margins for any later parting
            let more = run(b, RESYNC, &hist, n - r.tokens.len(), None, true);
            reference.tokens.truncate(r.tokens.len());
            reference.tokens.extend(&more.tokens);
            reference.margins.resize(r.tokens.len(), f32::NAN);
            reference.margins.extend(&more.margins);
        }
    }
    b.release(slot);
    r
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The run of median time among `runs`.
fn median_run(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.secs.total_cmp(&b.secs));
    let mid = runs.len() / 2;
    runs.swap_remove(mid)
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
    // a re-synchronising run prefills a whole history: prompt and every token
    let cap = (plen + n + k + 16).next_multiple_of(16);
    let slots = (2, cap);
    let (mut b, backend) = match args.iter().position(|a| a == "--cuda") {
        Some(i) => (
            cuda_backend(&mut m, &args[i + 1], &args[i + 2], slots, k).0,
            args[i + 2].clone(),
        ),
        None => (cpu_backend(&m, KvDtype::F32, false, slots), "cpu".into()),
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
    // the plain rate, then the continuation every replay proposes from, with its margins (one
    // more plain run, untimed, that reads its logits)
    let plains: Vec<Run> = (0..reps)
        .map(|_| run(b.as_mut(), MEASURED, &prompt, n, None, false))
        .collect();
    assert!(plains.iter().all(|r| r.steps == n - 1));
    let timed = plains[0].tokens.clone();
    let plain_secs: Vec<f64> = plains.iter().map(|r| r.secs).collect();
    let with_logits = run(b.as_mut(), MEASURED, &prompt, n, None, true);
    assert_eq!(
        with_logits.tokens, timed,
        "plain greedy decoding repeats itself with its logits read"
    );
    let mut plain = Reference {
        tokens: with_logits.tokens,
        margins: with_logits.margins,
    };
    if let Some(j) = opt(&args, "--flip").map(|v| v.parse::<usize>().expect("--flip")) {
        plain.tokens[j] = (plain.tokens[j] + 1) % m.config.vocab as u32;
    }
    let median_margin = median(plain.margins.iter().map(|&m| m as f64).collect());
    let plain_step = median(plain_secs) / (n - 1) as f64;
    let plain_tps = 1.0 / plain_step;
    println!(
        "{backend}: plain greedy decode {plain_tps:.1} tok/s ({:.3} ms a step), {n} tokens after a \
         {plen}-token prompt; the plain picks' median top-2 logit margin {median_margin:.4}",
        plain_step * 1e3
    );
    let mut rows = Vec::new();
    for (ri, &rate) in rates.iter().enumerate() {
        let runs: Vec<Run> = (0..reps)
            .map(|rep| {
                let replay = Replay {
                    reference: &plain,
                    k,
                    rate,
                    seed: 0x5EED_0000 + (ri * 100 + rep) as u64,
                    vocab: m.config.vocab as u32,
                };
                run(b.as_mut(), MEASURED, &prompt, n, Some(replay), false)
            })
            .collect();
        let partings: Vec<Vec<(usize, f32)>> = runs.iter().map(|r| r.partings.clone()).collect();
        let equal = runs.iter().all(|r| r.tokens == timed);
        let r = median_run(runs);
        let tps = (n - 1) as f64 / r.secs;
        let step_ms = r.secs / r.steps as f64 * 1e3;
        let acc = r.accepted as f64 / r.proposed.max(1) as f64;
        let per_step = (n - 1) as f64 / r.steps as f64;
        let all: Vec<&(usize, f32)> = partings.iter().flatten().collect();
        println!(
            "  corrupted {:>3.0}%: {tps:8.1} tok/s ({:.2}x plain), {:.1}% of {} proposals accepted, \
             {per_step:.2} tokens a step, step {step_ms:.3} ms ({:.2}x a plain step), {}; {}",
            rate * 100.0,
            tps / plain_tps,
            acc * 100.0,
            r.proposed,
            step_ms / (plain_step * 1e3),
            match all.is_empty() {
                true => "tokens equal to plain in every repetition".to_string(),
                false => format!(
                    "{} partings over {reps} repetitions (token: the plain pick's top-2 margin) {}",
                    all.len(),
                    all.iter()
                        .map(|(j, m)| format!("{j}: {m:.4}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
            match equal {
                true => "every run's tokens the plain run's",
                false => "tokens differ from the plain run's",
            }
        );
        rows.push(json!({
            "corrupted": rate,
            "tok_s": tps,
            "speedup": tps / plain_tps,
            "acceptance": acc,
            "proposed": r.proposed,
            "accepted": r.accepted,
            "tokens_per_step": per_step,
            "step_ms": step_ms,
            "step_over_plain": step_ms / (plain_step * 1e3),
            "partings": partings,
            "tokens_equal_to_plain": equal,
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
        "plain_margin_median": median_margin,
        "plain_margins": plain.margins,
        "runs": rows,
    });
    if let Some(p) = opt(&args, "--out") {
        std::fs::write(p, serde_json::to_string_pretty(&report).unwrap()).expect("--out");
    }
}
