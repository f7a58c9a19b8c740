//! Engine tests on the real CPU backend with a small random-weight model (no model file needed).
use super::*;
use metrale_backend::cpu::synthetic::tiny_backend_kv;
use metrale_backend::Backend;
use metrale_core::dtype::DType;

fn engine(slots: usize, capacity: usize) -> EngineHandle {
    engine_with(slots, capacity, true)
}

fn engine_with(slots: usize, capacity: usize, prefix_caching: bool) -> EngineHandle {
    engine_kv(slots, capacity, 0, prefix_caching)
}

/// An engine over a KV pool of `blocks` blocks (0: every slot at full capacity).
fn engine_kv(slots: usize, capacity: usize, blocks: usize, prefix_caching: bool) -> EngineHandle {
    engine_model(
        DType::Q4_1,
        3,
        slots,
        capacity,
        blocks,
        prefix_caching,
        None,
    )
}

/// An engine over the tiny model with `dtype` weights from `seed`.
fn engine_model(
    dtype: DType,
    seed: u64,
    slots: usize,
    capacity: usize,
    blocks: usize,
    prefix_caching: bool,
    speculation: Option<Speculation>,
) -> EngineHandle {
    let kv = metrale_backend::KvConfig {
        slots,
        slot_capacity: capacity,
        blocks,
        dtype: metrale_backend::KvDtype::F32,
    };
    Engine::spawn(
        Box::new(tiny_backend_kv(dtype, seed, kv, 2)),
        EngineConfig {
            prefill_chunk: 4,
            max_step_tokens: 6,
            prefix_caching,
            speculation,
        },
    )
}

fn req(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        ignore_eos: false,
        link: Default::default(),
        constraint: None,
        embed: None,
    }
}

/// Collect a request's events: generated ids and the final event.
fn collect(mut rx: tmpsc::UnboundedReceiver<Event>) -> (Vec<u32>, Event) {
    let mut ids = Vec::new();
    loop {
        match rx
            .blocking_recv()
            .expect("the engine ended the stream without Done")
        {
            Event::Token { id, logprob, .. } => {
                assert!(logprob <= 0.0);
                ids.push(id)
            }
            e => return (ids, e),
        }
    }
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|i| (0..(3 + 2 * i)).map(|j| (i * 7 + j * 3) % 50).collect())
        .collect()
}

#[test]
fn concurrent_requests_all_answered_and_equal_to_running_alone() {
    // Alone: one slot, one request at a time.
    let solo = engine(1, 64);
    let want: Vec<Vec<u32>> = prompts()
        .into_iter()
        .map(|p| collect(solo.submit(req(p, 7)).unwrap()).0)
        .collect();
    // Together: 6 requests on 3 slots, prefill chunks of 4 mixed with decodes.
    let e = engine(3, 64);
    let rxs: Vec<_> = prompts()
        .into_iter()
        .map(|p| e.submit(req(p, 7)).unwrap())
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (ids, done) = collect(rx);
        assert_eq!(ids, want[i], "request {i} differs when batched");
        match done {
            Event::Done {
                reason: FinishReason::Length,
                prompt_tokens,
                completion_tokens: 7,
                ..
            } => {
                assert_eq!(prompt_tokens, prompts()[i].len())
            }
            other => panic!("request {i}: {other:?}"),
        }
    }
    let m = e.metrics();
    assert_eq!(m.generation_tokens_total, 42);
    assert_eq!(
        m.prompt_tokens_total,
        prompts().iter().map(|p| p.len() as u64).sum::<u64>()
    );
    assert_eq!(m.time_to_first_token_seconds.count, 6);
    assert_eq!(m.inter_token_latency_seconds.count, 36);
    assert_eq!(m.e2e_request_latency_seconds.count, 6);
    assert_eq!(m.request_success_total[1], ("length", 6));
    assert_eq!((m.num_requests_running, m.num_requests_waiting), (0, 0));
    // 42 tokens from 3 slots take at least 14 steps (more while prompts are still prefilling);
    // the backend's share is part of the steps' time, and both were counted
    assert!(
        (14..=42 + 6 * 4).contains(&m.engine_steps_total),
        "{} steps",
        m.engine_steps_total
    );
    assert!(
        0.0 < m.engine_backend_seconds_total
            && m.engine_backend_seconds_total <= m.engine_step_seconds_total,
        "backend {} s of {} s",
        m.engine_backend_seconds_total,
        m.engine_step_seconds_total
    );
    let text = m.prometheus_text("tiny");
    assert!(
        text.contains("vllm:generation_tokens_total{model_name=\"tiny\"} 42\n"),
        "{text}"
    );
    let steps = format!(
        "metrale:engine_steps_total{{model_name=\"tiny\"}} {}\n",
        m.engine_steps_total
    );
    assert!(text.contains(&steps), "{text}");
}

#[test]
fn dropping_the_receiver_cancels_and_frees_the_slot() {
    let e = engine(1, 512);
    let mut rx = e
        .submit(GenerateRequest {
            ignore_eos: true,
            ..req(vec![1, 2, 3], 500)
        })
        .unwrap();
    assert!(matches!(rx.blocking_recv(), Some(Event::Token { .. })));
    drop(rx);
    // The only slot must come free for the next request.
    let (ids, done) = collect(e.submit(req(vec![4, 5], 3)).unwrap());
    assert_eq!(ids.len(), 3);
    // a caller that ended its request on a stop string: counted as stop, not abort
    let r = GenerateRequest {
        ignore_eos: true,
        ..req(vec![6, 7, 8], 500)
    };
    let link = r.link.clone();
    let mut rx = e.submit(r).unwrap();
    assert!(matches!(rx.blocking_recv(), Some(Event::Token { .. })));
    link.end_on_stop_string();
    drop(rx);
    let _ = collect(e.submit(req(vec![4], 1)).unwrap());
    let m = e.metrics();
    assert_eq!(m.request_success_total[0].1, 1, "{m:?}");
    assert!(matches!(
        done,
        Event::Done {
            reason: FinishReason::Length,
            completion_tokens: 3,
            ..
        }
    ));
    let m = e.metrics();
    assert_eq!(m.request_success_total[2], ("abort", 1));
    assert!(m.generation_tokens_total < 500);
}

#[test]
fn stop_tokens_end_with_stop_unless_ignored() {
    let e = engine(2, 64);
    let (free_run, _) = collect(e.submit(req(vec![9, 8, 7], 10)).unwrap());
    let stop = free_run[3];
    let first = free_run.iter().position(|&t| t == stop).unwrap();
    let (ids, done) = collect(
        e.submit(GenerateRequest {
            stop_tokens: vec![stop],
            ..req(vec![9, 8, 7], 10)
        })
        .unwrap(),
    );
    assert_eq!(ids, free_run[..first].to_vec());
    assert!(
        matches!(done, Event::Done { reason: FinishReason::Stop, completion_tokens, .. } if completion_tokens == first + 1)
    );
    let (ids, _) = collect(
        e.submit(GenerateRequest {
            stop_tokens: vec![stop],
            ignore_eos: true,
            ..req(vec![9, 8, 7], 10)
        })
        .unwrap(),
    );
    assert_eq!(ids, free_run);
}

#[test]
fn too_long_and_empty_prompts_are_refused_and_max_tokens_clipped() {
    let e = engine(1, 16);
    match e.submit(req(vec![1; 17], 4)) {
        Err(SubmitError::PromptTooLong {
            prompt: 17,
            capacity: 16,
        }) => {}
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert!(matches!(
        e.submit(req(vec![], 4)),
        Err(SubmitError::EmptyPrompt)
    ));
    // 14 prompt tokens in 16 positions: at most 3 tokens can be generated.
    let (ids, done) = collect(
        e.submit(GenerateRequest {
            ignore_eos: true,
            ..req(vec![2; 14], 100)
        })
        .unwrap(),
    );
    assert_eq!(ids.len(), 3);
    assert!(matches!(
        done,
        Event::Done {
            reason: FinishReason::Length,
            completion_tokens: 3,
            ..
        }
    ));
    let (ids, _) = collect(
        e.submit(GenerateRequest {
            ignore_eos: true,
            ..req(vec![2; 16], 100)
        })
        .unwrap(),
    );
    assert_eq!(ids.len(), 1);
    assert_eq!(e.info().slots, 1);
}

#[test]
fn seeded_sampling_is_reproducible_through_the_engine() {
    let e = engine(2, 64);
    let p = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        seed: 77,
        ..Default::default()
    };
    let (a, b) = twice(&e, &p, vec![5, 6, 7], 12);
    assert_eq!(a, b);
}

/// The same sampled request submitted twice at once (ignoring EOS): both outputs.
fn twice(e: &EngineHandle, p: &SamplingParams, prompt: Vec<u32>, n: usize) -> (Vec<u32>, Vec<u32>) {
    let r = || GenerateRequest {
        sampling: p.clone(),
        ignore_eos: true,
        ..req(prompt.clone(), n)
    };
    let (a, b) = (e.submit(r()).unwrap(), e.submit(r()).unwrap());
    (collect(a).0, collect(b).0)
}

#[test]
fn a_bad_request_fails_alone_and_its_batch_mates_finish() {
    let e = engine(2, 64);
    // Token 99 is outside the tiny model's 50-token vocabulary: the backend refuses it.
    let bad = e.submit(req(vec![1, 99, 3], 4)).unwrap();
    let good = e.submit(req(vec![4, 5, 6], 4)).unwrap();
    let (_, done_bad) = collect(bad);
    assert!(
        matches!(&done_bad, Event::Error(m) if m.contains("outside the vocabulary")),
        "{done_bad:?}"
    );
    let (ids, done_good) = collect(good);
    assert_eq!(ids.len(), 4);
    assert!(matches!(
        done_good,
        Event::Done {
            reason: FinishReason::Length,
            ..
        }
    ));
    assert_eq!(e.metrics().request_success_total[3], ("error", 1));
    // The engine keeps serving.
    assert_eq!(collect(e.submit(req(vec![7], 2)).unwrap()).0.len(), 2);
}

/// Prefix caching by block: the same prompt again, and a follow-up turn that extends prompt +
/// answer, reuse the registered full blocks (counted in `cached_tokens` and the metrics) and answer
/// exactly as an engine without the cache; a different prompt in between changes nothing.
#[test]
fn prefix_cache_reuses_full_blocks_with_identical_answers() {
    let p: Vec<u32> = (0..40u32).map(|j| (j * 11 + 3) % 50).collect();
    let other: Vec<u32> = (0..6u32).map(|j| (j * 5 + 1) % 50).collect();
    let run = |e: &EngineHandle, prompt: &[u32]| match collect(
        e.submit(req(prompt.to_vec(), 12)).unwrap(),
    ) {
        (ids, Event::Done { cached_tokens, .. }) => (ids, cached_tokens),
        (_, other) => panic!("{other:?}"),
    };
    let cold = engine_with(2, 64, false);
    let warm = engine(2, 64);
    let (a, c0) = run(&warm, &p);
    assert_eq!((a.clone(), 0), (run(&cold, &p).0, c0));
    assert_eq!(run(&warm, &other).1, 0);
    // the same prompt: its two full blocks (positions 0..32) come from the cache
    let (again, c1) = run(&warm, &p);
    assert_eq!((again, c1), (a.clone(), 32));
    // a follow-up: prompt + answer + 2 new tokens (54); the first run wrote 40 + 11 fed answer
    // tokens, so three full blocks (0..48, answer tokens in the third) are registered
    let mut follow = p.clone();
    follow.extend(&a);
    follow.extend([7, 9]);
    let (f, c2) = run(&warm, &follow);
    assert_eq!(c2, 48);
    assert_eq!(f, run(&cold, &follow).0, "answer with the cache differs");
    let m = warm.metrics();
    assert_eq!(m.prefix_cache_hits_total, (c1 + c2) as u64);
    assert_eq!(
        m.prefix_cache_queries_total,
        (2 * p.len() + other.len() + follow.len()) as u64
    );
    assert_eq!(
        m.prompt_tokens_total,
        (2 * p.len() + other.len() + follow.len()) as u64,
        "prompt tokens count cached ones too, as vLLM does"
    );
    assert_eq!(m.kv_cache_usage_perc, 0.0, "nothing held once all ended");
}

/// A pool of 4 blocks (one sequence of full context) under 4 slots: requests that together need
/// 3x the pool all finish with the answers they give alone; sequences are preempted (recomputed
/// later) instead of failing, and every block is given back at the end.
#[test]
fn a_short_pool_preempts_and_every_request_finishes_as_alone() {
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..10u32).map(|j| (i * 13 + j * 7 + 1) % 50).collect())
        .collect();
    let solo = engine_with(1, 64, false);
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| collect(solo.submit(req(p.clone(), 30)).unwrap()).0)
        .collect();
    for prefix in [false, true] {
        let e = engine_kv(4, 64, 4, prefix);
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| e.submit(req(p.clone(), 30)).unwrap())
            .collect();
        for (rx, w) in rxs.into_iter().zip(&want) {
            let (ids, done) = collect(rx);
            assert!(matches!(done, Event::Done { .. }), "{done:?}");
            assert_eq!(
                &ids, w,
                "preempted answers differ (prefix caching {prefix})"
            );
        }
        let m = e.metrics();
        assert!(
            m.num_preemptions_total > 0,
            "40-token sequences x 4 in 64 tokens: some preempted"
        );
        assert_eq!(m.kv_cache_usage_perc, 0.0);
        assert_eq!(m.request_success_total[1], ("length", 4));
    }
}

/// A constraint that allows exactly one token at each step (a script) and finishes at its end.
struct Script(Vec<u32>, usize);

impl TokenConstraint for Script {
    fn allowed(&mut self) -> Result<Vec<u32>, String> {
        let t = *self.0.get(self.1).ok_or("past the end")?;
        let mut m = vec![0u32; 2];
        m[t as usize / 32] |= 1 << (t % 32);
        Ok(m)
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.0.get(self.1) != Some(&token) {
            return Err(format!("token {token} was not allowed"));
        }
        self.1 += 1;
        Ok(())
    }
    fn finished(&self) -> bool {
        self.1 == self.0.len()
    }
}

/// The engine asks a request's constraint before every generated token (prefill's last chunk
/// included) and the backend samples only what it allows, under any sampling setting; a complete
/// constraint ends the sequence with Stop; a constraint's failure is that request's error alone.
#[test]
fn a_constraint_decides_every_token_and_ends_the_sequence() {
    let e = engine(2, 64);
    let script = vec![7u32, 41, 3, 3, 19];
    let hot = SamplingParams {
        temperature: 1.5,
        top_k: 40,
        seed: 9,
        ..Default::default()
    };
    let r = GenerateRequest {
        sampling: hot,
        constraint: Some(Constraint(Box::new(Script(script.clone(), 0)))),
        ..req((0..20).collect(), 50)
    };
    let other = e.submit(req(vec![1, 2, 3], 6)).unwrap();
    let (ids, done) = collect(e.submit(r).unwrap());
    assert_eq!(ids, script);
    assert!(
        matches!(
            done,
            Event::Done {
                reason: FinishReason::Stop,
                completion_tokens: 5,
                ..
            }
        ),
        "{done:?}"
    );
    assert_eq!(collect(other).0.len(), 6);
    // one mask per constrained token, timed (the unconstrained request asks none)
    let m = e.metrics();
    assert!(
        (5..=6).contains(&m.grammar_masks_total) && m.grammar_mask_seconds_total >= 0.0,
        "{} masks in {} s",
        m.grammar_masks_total,
        m.grammar_mask_seconds_total
    );
    // a constraint that fails: an error for that request, the engine keeps serving
    let broken = GenerateRequest {
        constraint: Some(Constraint(Box::new(Script(vec![], 0)))),
        ..req(vec![1, 2], 5)
    };
    let (_, done) = collect(e.submit(broken).unwrap());
    assert!(
        matches!(&done, Event::Error(m) if m.contains("past the end")),
        "{done:?}"
    );
    assert_eq!(collect(e.submit(req(vec![4], 2)).unwrap()).0.len(), 2);
}

/// Sixteen constrained requests at once: each decides its own tokens, and one failing among them is
/// that request's error alone.
#[test]
fn many_constraints_at_once_each_decide_their_own_tokens() {
    let e = engine(16, 64);
    let scripts: Vec<Vec<u32>> = (0..16u32)
        .map(|i| (0..6).map(|j| (i * 3 + j * 5) % 48 + 1).collect())
        .collect();
    let rxs: Vec<_> = scripts
        .iter()
        .enumerate()
        .map(|(i, s)| {
            // request 5's grammar fails at its first token
            let script = if i == 5 { Vec::new() } else { s.clone() };
            let r = GenerateRequest {
                sampling: SamplingParams {
                    temperature: 1.0,
                    seed: i as u64,
                    ..Default::default()
                },
                constraint: Some(Constraint(Box::new(Script(script, 0)))),
                ..req(vec![1, 2, 3, i as u32 + 4], 6)
            };
            e.submit(r).unwrap()
        })
        .collect();
    for (i, (rx, s)) in rxs.into_iter().zip(&scripts).enumerate() {
        let (ids, done) = collect(rx);
        if i == 5 {
            assert!(
                matches!(&done, Event::Error(m) if m.contains("past the end")),
                "{done:?}"
            );
            assert!(ids.is_empty(), "{ids:?}");
        } else {
            assert_eq!(&ids, s, "request {i}: {done:?}");
            assert!(matches!(done, Event::Done { .. }), "{done:?}");
        }
    }
}

/// An embedding request and its events: the vector, then `Done`.
fn embedding(e: &EngineHandle, prompt: Vec<u32>) -> (Vec<f32>, Event) {
    let mut rx = e
        .submit(GenerateRequest {
            embed: Some(Pooling::Mean),
            ..req(prompt, 0)
        })
        .unwrap();
    let v = match rx.blocking_recv() {
        Some(Event::Embedding(v)) => v,
        other => panic!("expected the embedding first, got {other:?}"),
    };
    (v, rx.blocking_recv().expect("Done after the embedding"))
}

#[test]
fn embeddings_pool_every_chunk_and_leave_generation_alone() {
    let prompt: Vec<u32> = (0..23u32).map(|j| (j * 5 + 1) % 50).collect();
    // the reference: the same backend's hidden states of the whole prompt in one call
    let kv = metrale_backend::KvConfig {
        slots: 1,
        slot_capacity: 64,
        blocks: 0,
        dtype: metrale_backend::KvDtype::F32,
    };
    let mut b = tiny_backend_kv(DType::Q4_1, 3, kv, 2);
    let p = SamplingParams::default();
    let table = metrale_backend::slot_blocks(0, 64);
    let want = b
        .hidden(&[SeqStep {
            slot: 0,
            start_pos: 0,
            tokens: &prompt,
            blocks: &table,
            history: &prompt,
            sampling: &p,
            draw: 0,
            want_logits: false,
            allowed: None,
            drafted: 0,
        }])
        .unwrap()
        .pop()
        .unwrap()
        .embedding(Pooling::Mean);
    let solo = engine(1, 64);
    let gen_want: Vec<Vec<u32>> = prompts()
        .into_iter()
        .map(|p| collect(solo.submit(req(p, 7)).unwrap()).0)
        .collect();
    // 23 tokens in chunks of at most 4, beside six generations on 3 slots; asked twice (the second
    // time its full blocks are registered, and must not be reused: every token is pooled)
    let e = engine(3, 64);
    let gens: Vec<_> = prompts()
        .into_iter()
        .map(|p| e.submit(req(p, 7)).unwrap())
        .collect();
    for _ in 0..2 {
        let (v, done) = embedding(&e, prompt.clone());
        let diff = v
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-5, "the engine's embedding differs by {diff}");
        match done {
            Event::Done {
                prompt_tokens: 23,
                completion_tokens: 0,
                cached_tokens: 0,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
    }
    for (i, rx) in gens.into_iter().enumerate() {
        assert_eq!(
            collect(rx).0,
            gen_want[i],
            "generation {i} changed beside embeddings"
        );
    }
}

/// An engine for the speculation tests, with prompt lookup of up to `k` proposals from suffixes
/// of 1-3 tokens (`None`: off). Its model (f16 weights from seed 5) has greedy output that repeats
/// in places and wanders in others, so proposals are both accepted and rejected; the Q4_1 model
/// of the other tests repeats one token forever.
fn spec_engine(slots: usize, blocks: usize, k: Option<usize>) -> EngineHandle {
    let speculation = k.map(|tokens| Speculation {
        tokens,
        proposer: Proposer::Ngram { min: 1, max: 3 },
    });
    engine_model(DType::F16, 5, slots, 64, blocks, true, speculation)
}

/// Prompts that repeat themselves (prompt lookup has something to propose) and the tiny model's
/// greedy loops (its output repeats too).
fn copy_prompts() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|i| {
            let motif: Vec<u32> = (0..3 + i % 3).map(|j| (i * 13 + j * 7) % 50).collect();
            motif.iter().cycle().take(9 + i as usize).copied().collect()
        })
        .collect()
}

/// Greedy output with speculation is plain greedy output, token for token (the CPU backend's
/// rows do not depend on how a sequence's tokens are grouped into steps), with proposals
/// accepted, rejected, cut by max_tokens, by the slot's end and by a small KV pool; requests
/// batched, alone, and with prefix-cache hits.
#[test]
fn greedy_speculation_gives_plain_greedy_output() {
    let run = |e: &EngineHandle, max: usize| -> Vec<Vec<u32>> {
        let rxs: Vec<_> = copy_prompts()
            .into_iter()
            .map(|p| {
                e.submit(GenerateRequest {
                    ignore_eos: true,
                    ..req(p, max)
                })
                .unwrap()
            })
            .collect();
        rxs.into_iter().map(|rx| collect(rx).0).collect()
    };
    for max in [1, 2, 9, 60] {
        let want = run(&spec_engine(1, 0, None), max);
        for (k, slots, blocks) in [(1, 3, 0), (4, 3, 0), (4, 1, 0), (7, 2, 0), (4, 3, 9)] {
            let e = spec_engine(slots, blocks, Some(k));
            assert_eq!(
                run(&e, max),
                want,
                "k {k}, {slots} slots, {blocks} blocks, max {max}"
            );
            let m = e.metrics();
            assert!(
                m.spec_decode_num_accepted_tokens_total <= m.spec_decode_num_draft_tokens_total
            );
            if max == 60 {
                assert!(
                    m.spec_decode_num_accepted_tokens_total > 20,
                    "proposals must be accepted for the test to mean something: {} of {}",
                    m.spec_decode_num_accepted_tokens_total,
                    m.spec_decode_num_draft_tokens_total
                );
                assert!(
                    m.spec_decode_num_accepted_tokens_total < m.spec_decode_num_draft_tokens_total,
                    "and some rejected"
                );
            }
            assert_eq!(
                m.generation_tokens_total as usize,
                want.iter().map(Vec::len).sum::<usize>()
            );
        }
    }
}

/// A stop token among accepted proposals ends the sequence there, as plain decoding does.
#[test]
fn a_stop_token_inside_accepted_proposals_ends_there() {
    let p = copy_prompts().remove(1);
    let plain = spec_engine(1, 0, None);
    let all = collect(
        plain
            .submit(GenerateRequest {
                ignore_eos: true,
                ..req(p.clone(), 30)
            })
            .unwrap(),
    )
    .0;
    let e = spec_engine(1, 0, Some(5));
    // each token of the plain output in turn as the stop token
    for (at, &stop) in all.iter().enumerate().skip(1) {
        let want = all[..all.iter().position(|&t| t == stop).unwrap()].to_vec();
        let (ids, done) = collect(
            e.submit(GenerateRequest {
                stop_tokens: vec![stop],
                ..req(p.clone(), 30)
            })
            .unwrap(),
        );
        assert_eq!(ids, want, "stop token {stop} (first at {at})");
        assert!(matches!(
            done,
            Event::Done {
                reason: FinishReason::Stop,
                completion_tokens,
                ..
            } if completion_tokens == want.len() + 1
        ));
    }
    assert!(e.metrics().spec_decode_num_accepted_tokens_total > 0);
}

/// Sampled output with speculation is reproducible from its seed.
#[test]
fn seeded_sampling_with_speculation_is_reproducible() {
    let e = spec_engine(2, 0, Some(4));
    let p = SamplingParams {
        temperature: 0.7,
        seed: 77,
        ..Default::default()
    };
    let (a, b) = twice(&e, &p, copy_prompts().remove(2), 30);
    assert_eq!(a.len(), 30);
    assert_eq!(a, b);
    assert!(e.metrics().spec_decode_num_drafts_total > 0);
}

/// An engine with a draft model: the tiny model with `dtype` weights from `seed`, proposing up to
/// `k` tokens, beside the f16 seed-5 target of `spec_engine`.
fn draft_engine(slots: usize, blocks: usize, k: usize, dtype: DType, seed: u64) -> EngineHandle {
    let kv = metrale_backend::KvConfig {
        slots,
        slot_capacity: 64,
        blocks,
        dtype: metrale_backend::KvDtype::F32,
    };
    let draft = tiny_backend_kv(
        dtype,
        seed,
        metrale_backend::KvConfig::per_slot(slots, 64),
        2,
    );
    Engine::spawn_with_draft(
        Box::new(tiny_backend_kv(DType::F16, 5, kv, 2)),
        Some(Box::new(draft)),
        EngineConfig {
            prefill_chunk: 4,
            max_step_tokens: 12,
            prefix_caching: true,
            speculation: Some(Speculation {
                tokens: k,
                proposer: Proposer::Draft,
            }),
        },
    )
}

/// Greedy output with a draft model is plain greedy output: with the target itself as the draft
/// (every proposal accepted), with a draft in another precision (most accepted) and with an
/// unrelated one (few accepted); batched, alone, and with a pool short enough to preempt.
#[test]
fn greedy_draft_model_speculation_gives_plain_greedy_output() {
    let run = |e: &EngineHandle| -> Vec<Vec<u32>> {
        let rxs: Vec<_> = prompts()
            .into_iter()
            .chain(copy_prompts())
            .map(|p| {
                e.submit(GenerateRequest {
                    ignore_eos: true,
                    ..req(p, 40)
                })
                .unwrap()
            })
            .collect();
        rxs.into_iter().map(|rx| collect(rx).0).collect()
    };
    let want = run(&spec_engine(1, 0, None));
    for (dtype, seed, k, slots, blocks, min_rate, max_rate) in [
        (DType::F16, 5, 4, 3, 0, 1.0, 1.0),
        (DType::F16, 5, 3, 1, 0, 1.0, 1.0),
        (DType::BF16, 5, 4, 3, 0, 0.8, 1.0),
        (DType::Q4_1, 3, 5, 2, 0, 0.0, 0.5),
        (DType::F16, 5, 4, 3, 9, 1.0, 1.0),
    ] {
        let e = draft_engine(slots, blocks, k, dtype, seed);
        let what = format!("draft {dtype:?} seed {seed}, k {k}, {slots} slots, {blocks} blocks");
        assert_eq!(run(&e), want, "{what}");
        let m = e.metrics();
        let rate = m.spec_decode_num_accepted_tokens_total as f64
            / m.spec_decode_num_draft_tokens_total.max(1) as f64;
        assert!(m.spec_decode_num_draft_tokens_total > 100, "{what}: {m:?}");
        assert!(
            (min_rate..=max_rate).contains(&rate),
            "{what}: acceptance {rate:.3} outside {min_rate}..={max_rate}"
        );
    }
}

/// By default a prompt alone is prefilled in one step when it fits the step's budget (vLLM's
/// chunked prefill: a request may take the whole budget): a 512-token prompt takes one step where
/// a 256-token cap per request (`prefill_chunk`, the server's --long-prefill-token-threshold) takes
/// two, each of which reads every weight once.
#[test]
fn a_prompt_alone_takes_the_whole_step_budget_by_default() {
    let steps = |cfg: EngineConfig| {
        let kv = metrale_backend::KvConfig {
            slots: 1,
            slot_capacity: 640,
            blocks: 0,
            dtype: metrale_backend::KvDtype::F32,
        };
        let e = Engine::spawn(Box::new(tiny_backend_kv(DType::Q4_1, 3, kv, 2)), cfg);
        let prompt: Vec<u32> = (0..512u32).map(|i| 1 + i % 40).collect();
        let (ids, done) = collect(e.submit(req(prompt, 1)).unwrap());
        assert_eq!(ids.len(), 1, "{done:?}");
        e.metrics().engine_steps_total
    };
    let d = EngineConfig::default();
    assert_eq!((d.prefill_chunk, d.max_step_tokens), (512, 512));
    assert_eq!(steps(EngineConfig::default()), 1);
    let capped = EngineConfig {
        prefill_chunk: 256,
        ..EngineConfig::default()
    };
    assert_eq!(steps(capped), 2);
}
