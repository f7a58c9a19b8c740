//! The engine over the CPU backend on the real default model (METRALE_MODEL; skips when unset):
//! several concurrent chat requests are all answered, the batched greedy answers equal the ones
//! produced alone, and the reference question (docs/facts.md, "The reference question") is answered
//! with "Paris".
use metrale_backend::cpu::CpuBackend;
use metrale_backend::sampler::SamplingParams;
use metrale_engine::{Engine, EngineConfig, Event, FinishReason, GenerateRequest};
use metrale_model::{ChatMessage, Model};

fn collect(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, Event) {
    let mut ids = Vec::new();
    loop {
        match rx.blocking_recv().expect("stream ended without Done") {
            Event::Token { id, .. } => ids.push(id),
            e => return (ids, e),
        }
    }
}

#[test]
fn concurrent_chats_on_the_real_model() {
    let Some(path) = std::env::var_os("METRALE_MODEL") else {
        eprintln!("skipping: METRALE_MODEL is not set (path to SmolLM2-135M-Instruct.Q4_1.gguf)");
        return;
    };
    let m = Model::load(std::path::Path::new(&path)).unwrap();
    let tpl = m.require_chat_template().unwrap();
    let questions = [
        "What is the capital of France? Answer in one sentence.",
        "Name three colors.",
        "Write a haiku about the sea.",
        "What is 2 + 2?",
    ];
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            let text = tpl.render(&[ChatMessage::new("user", *q)], true).unwrap();
            m.tokenizer
                .encode(&text, m.tokenizer.add_bos(), true)
                .unwrap()
        })
        .collect();
    let req = |prompt: &Vec<u32>| GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: 24,
        sampling: SamplingParams::default(),
        stop_tokens: m.config.eos.clone(),
        ignore_eos: false,
        link: Default::default(),
        constraint: None,
        embed: None,
    };
    let solo = Engine::spawn(
        Box::new(CpuBackend::load(&m, 1, 256, 2).unwrap()),
        EngineConfig::default(),
    );
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| collect(solo.submit(req(p)).unwrap()).0)
        .collect();
    drop(solo);
    let e = Engine::spawn(
        Box::new(CpuBackend::load(&m, 3, 256, 2).unwrap()),
        EngineConfig {
            prefill_chunk: 16,
            max_step_tokens: 32,
            ..EngineConfig::default()
        },
    );
    let rxs: Vec<_> = prompts.iter().map(|p| e.submit(req(p)).unwrap()).collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (ids, done) = collect(rx);
        let text = m.tokenizer.decode(&ids, true);
        eprintln!("{:?} -> {:?} ({done:?})", questions[i], text);
        assert!(
            matches!(
                done,
                Event::Done {
                    reason: FinishReason::Stop | FinishReason::Length,
                    ..
                }
            ),
            "{done:?}"
        );
        // 16-bit activation blocks make batched rows bit-identical to solo rows only up to summation
        // order; greedy picks agree unless two logits tie within ~1e-2, which these prompts avoid.
        assert_eq!(
            ids, want[i],
            "request {i}: batched answer differs from the solo one"
        );
        if i == 0 {
            assert!(text.contains("Paris"), "{text:?}");
        }
    }
    let metrics = e.metrics();
    assert_eq!(
        metrics.request_success_total[0].1 + metrics.request_success_total[1].1,
        4
    );
    assert_eq!(
        metrics.prompt_tokens_total,
        prompts.iter().map(|p| p.len() as u64).sum::<u64>()
    );
}
