//! The contract every `Backend` keeps, as one test body run on each backend (`tests/contract.rs`):
//! bad batches are refused with the shared messages (block tables included) and leave the backend
//! working; a released slot
//! serves a new sequence as a fresh one would, and resumes a shared prefix; the same seed gives the
//! same tokens, and a device sampler picks what the host sampler picks on the same logits; a
//! sequence's tokens do not depend on its batch-mates.

use metrale_backend::sampler::{self, SamplingParams};
use metrale_backend::{Backend, SeqStep};

/// The slots and positions a backend under contract must have (at least).
pub const SLOTS: usize = 4;
pub const CAPACITY: usize = 96;

/// The block table of `slot` in a pool laid out `KvConfig::per_slot(SLOTS, CAPACITY)` (slots past
/// SLOTS too, for the refusal checks).
fn blocks(slot: usize) -> &'static [u32] {
    static TABLES: std::sync::OnceLock<Vec<Vec<u32>>> = std::sync::OnceLock::new();
    &TABLES.get_or_init(|| {
        (0..2 * SLOTS)
            .map(|s| metrale_backend::slot_blocks(s, CAPACITY))
            .collect()
    })[slot.min(2 * SLOTS - 1)]
}

fn step<'a>(
    slot: usize,
    start_pos: usize,
    tokens: &'a [u32],
    history: &'a [u32],
    sampling: &'a SamplingParams,
) -> SeqStep<'a> {
    SeqStep {
        slot,
        blocks: blocks(slot),
        start_pos,
        tokens,
        history,
        sampling,
        draw: 0,
        want_logits: false,
        allowed: None,
        drafted: 0,
    }
}

/// Generate `n` tokens for each (slot, prompt) together, from position 0, with `params` (draw = the
/// step); `logits_at` asks for the logits at that step (host sampling on every backend).
fn generate(
    b: &mut dyn Backend,
    seqs: &[(usize, &[u32])],
    n: usize,
    params: &SamplingParams,
    logits_at: Option<usize>,
) -> Vec<Vec<u32>> {
    let mut hist: Vec<Vec<u32>> = seqs.iter().map(|(_, p)| p.to_vec()).collect();
    let mut out = vec![Vec::new(); seqs.len()];
    for s in 0..n {
        let batch: Vec<SeqStep> = seqs
            .iter()
            .enumerate()
            .map(|(i, &(slot, _))| {
                let h = &hist[i];
                let (start, toks) = if s == 0 {
                    (0, &h[..])
                } else {
                    (h.len() - 1, &h[h.len() - 1..])
                };
                SeqStep {
                    slot,
                    blocks: blocks(slot),
                    start_pos: start,
                    tokens: toks,
                    history: h,
                    sampling: params,
                    draw: s as u64,
                    want_logits: logits_at == Some(s),
                    allowed: None,
                    drafted: 0,
                }
            })
            .collect();
        let r = b.step(&batch).expect("a valid step");
        drop(batch);
        for (i, o) in r.into_iter().enumerate() {
            if let Some(l) = &o.logits {
                // the token a backend returns with its logits is the host sampler's pick on them
                let want = sampler::sample(l, params, &hist[i], s as u64).token;
                assert_eq!(
                    o.token, want,
                    "the returned token is not the host sampler's pick"
                );
            }
            hist[i].push(o.token);
            out[i].push(o.token);
        }
    }
    out
}

fn refused(b: &mut dyn Backend, batch: &[SeqStep<'_>], want: &str) {
    match b.step(batch) {
        Err(metrale_core::BackendError::Invalid(m)) => {
            assert!(m.contains(want), "message {m:?} does not contain {want:?}")
        }
        other => panic!("expected a refusal containing {want:?}, got {other:?}"),
    }
}

/// Run the contract on `b` (at least [`SLOTS`] slots of [`CAPACITY`] tokens) with two prompts of
/// in-vocabulary tokens, each shorter than `CAPACITY / 2`.
pub fn check(b: &mut dyn Backend, vocab: usize, a: &[u32], c: &[u32]) {
    let info = b.info();
    assert!(
        info.slots >= SLOTS && info.slot_capacity >= CAPACITY,
        "{info:?}"
    );
    let greedy = SamplingParams::default();
    let n = 8;

    // the reference: each prompt alone, in a slot nothing else uses
    let want_a = generate(b, &[(0, a)], n, &greedy, None).remove(0);
    let want_c = generate(b, &[(1, c)], n, &greedy, None).remove(0);

    // bad batches: refused with the shared messages, nothing run
    let (slots, cap) = (info.slots, info.slot_capacity);
    let g = &greedy;
    refused(
        b,
        &[step(slots, 0, &a[..1], &a[..1], g)],
        &format!("entry 0: slot {slots} does not exist"),
    );
    refused(
        b,
        &[step(2, 0, a, a, g), step(2, 0, c, c, g)],
        "entry 1: slot 2 appears twice in one step",
    );
    refused(b, &[step(2, 0, &[], &[], g)], "entry 0: no tokens");
    refused(
        b,
        &[step(2, cap - 1, &a[..2], &a[..2], g)],
        &format!("exceed the slot capacity of {cap} tokens"),
    );
    let mut short = step(2, 0, &a[..2], &a[..2], g);
    short.blocks = &[];
    refused(
        b,
        &[short],
        "entry 0: a block table of 0 blocks does not cover positions 0..2",
    );
    let far = [u32::MAX];
    let mut outside = step(2, 0, &a[..2], &a[..2], g);
    outside.blocks = &far;
    refused(
        b,
        &[outside],
        &format!("entry 0: block {} is outside the KV pool", u32::MAX),
    );
    let bad = [a[0], vocab as u32];
    refused(
        b,
        &[step(2, 0, &bad, &bad, g)],
        &format!("token id {vocab} is outside the vocabulary ({vocab} tokens)"),
    );
    assert!(b.step(&[]).expect("an empty step").is_empty());

    // batch-mates change nothing (after the refusals, which must have left the backend working)
    let both = generate(b, &[(2, a), (3, c)], n, &greedy, None);
    assert_eq!(
        both[0], want_a,
        "a sequence's tokens depend on its batch-mate"
    );
    assert_eq!(
        both[1], want_c,
        "a sequence's tokens depend on its batch-mate"
    );

    // release and reuse: slot 2 held `a`; `c` from position 0 there is `c` fresh
    b.release(2);
    b.release(3);
    assert_eq!(generate(b, &[(2, c)], n, &greedy, None)[0], want_c);
    // a shared prefix resumed: slot 2 holds c's prompt; feed only its last token again
    b.release(2);
    let mut hist = c.to_vec();
    let mut resumed = Vec::new();
    for s in 0..n {
        let start = hist.len() - 1;
        let tok = [hist[start]];
        let r = b
            .step(&[SeqStep {
                slot: 2,
                blocks: blocks(2),
                start_pos: start,
                tokens: &tok,
                history: &hist,
                sampling: &greedy,
                draw: s as u64,
                want_logits: false,
                allowed: None,
                drafted: 0,
            }])
            .expect("a resumed step");
        hist.push(r[0].token);
        resumed.push(r[0].token);
    }
    assert_eq!(resumed, want_c, "a resumed prefix gives other tokens");

    // seeded sampling: the same seed, the same tokens, in any slot; and the device's pick (no
    // logits asked) equals the host sampler's pick on the logits (asked at step 3)
    let seeded = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: 7,
        ..Default::default()
    };
    for s in 0..SLOTS {
        b.release(s);
    }
    let s1 = generate(b, &[(0, a)], n, &seeded, None).remove(0);
    let s2 = generate(b, &[(3, a)], n, &seeded, Some(3)).remove(0);
    assert_eq!(
        s1, s2,
        "the same seed gave other tokens (or device and host samplers differ)"
    );
    let other = SamplingParams {
        seed: 8,
        ..seeded.clone()
    };
    let s3 = generate(b, &[(1, a)], n, &other, None).remove(0);
    eprintln!("contract: greedy {want_a:?}; seed 7 {s1:?}; seed 8 {s3:?}");
}
