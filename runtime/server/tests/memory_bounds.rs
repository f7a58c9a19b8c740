//! The memory budget's worst cases against the heap's real peak: each request below, built to be
//! as costly as possible per byte, is prepared (parsed, rendered, tokenized) exactly as the server
//! does, under a counting allocator, and the peak of live heap bytes during the call must not pass
//! the most the request had reserved (`budget::parse_worst_case`, `TOKENIZE_BYTES_PER_BYTE`, ...).
//! A reservation below the real peak is what lets concurrent requests pass the memory limit, so
//! this test is what keeps the constants honest. Model: METRALE_MODEL (skips when unset).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use metrale_model::{Model, RenderLimits};
use metrale_server::api::SamplingPreset;
use metrale_server::budget::{MemoryBudget, Source};
use metrale_server::prepare::{self, Prep};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn add(n: usize) {
    let now = LIVE.fetch_add(n, SeqCst) + n;
    PEAK.fetch_max(now, SeqCst);
}

// SAFETY: every method forwards to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        add(l.size());
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), SeqCst);
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        // Old and new blocks both live during the copy.
        add(n);
        let q = System.realloc(p, l, n);
        LIVE.fetch_sub(l.size(), SeqCst);
        q
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Context of the served model in these cases: SmolLM2's own 8192, so the prompt byte cap is the
/// largest the default model allows.
const CTX: usize = 8192;

fn json(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

#[test]
fn reservations_cover_the_heap_peak_of_adversarial_requests() {
    let Some(path) = std::env::var_os("METRALE_MODEL") else {
        eprintln!("skipping: METRALE_MODEL is not set (path to SmolLM2-135M-Instruct.Q4_1.gguf)");
        return;
    };
    let model = Model::load(std::path::Path::new(&path)).unwrap();
    let tk = &model.tokenizer;
    let cap = prepare::prompt_byte_cap(tk, CTX);
    let template = model
        .chat_template
        .as_ref()
        .map(|t| {
            metrale_model::ChatTemplate::new(t.source())
                .unwrap()
                .with_limits(RenderLimits {
                    fuel: 100_000 + 2_000 * CTX as u64,
                    max_bytes: cap,
                })
        })
        .expect("the default model has a chat template");
    let preset = SamplingPreset::default();
    let prep = Prep {
        tokenizer: tk,
        template: Some(&template),
        chat_preset: &preset,
        completion_preset: &preset,
        vocab: tk.vocab_size(),
        ctx_size: CTX,
        grammars: None,
        tool_format: metrale_server::tools::ToolFormat::Hermes,
        embeddings: Some(metrale_backend::Pooling::Mean),
        hidden: 576,
        reasoning: metrale_server::reasoning::Format::Deepseek,
    };
    let digits = "7".repeat(cap - 64);
    let spaces = " ".repeat(cap - 64);
    let many_messages = format!(
        "{{\"messages\":[{}]}}",
        vec![r#"{"role":"user","content":""}"#; 8000].join(",")
    );
    let many_parts = format!(
        "{{\"messages\":[{{\"role\":\"user\",\"content\":[{}]}}]}}",
        vec![r#"{"type":"text","text":""}"#; 100_000].join(",")
    );
    let cases: Vec<(&str, String, prepare::Step)> = vec![
        (
            "chat, one message of digits at the byte cap",
            format!(
                "{{\"messages\":[{{\"role\":\"user\",\"content\":{}}}],\"max_tokens\":1}}",
                json(&digits[1000..])
            ),
            prepare::Step::Chat,
        ),
        (
            "chat, 8000 empty messages",
            many_messages,
            prepare::Step::Chat,
        ),
        (
            "chat, 100000 empty content parts",
            many_parts,
            prepare::Step::Chat,
        ),
        (
            "chat, 16 MiB message (refused at the render cap)",
            format!(
                "{{\"messages\":[{{\"role\":\"user\",\"content\":{}}}]}}",
                json(&"x".repeat(16 << 20))
            ),
            prepare::Step::Chat,
        ),
        (
            "responses, 8000 empty input items",
            format!(
                "{{\"input\":[{}]}}",
                vec![r#"{"role":"user","content":""}"#; 8000].join(",")
            ),
            prepare::Step::Responses,
        ),
        (
            "responses, 100000 empty content parts",
            format!(
                "{{\"input\":[{{\"role\":\"user\",\"content\":[{}]}}]}}",
                vec![r#"{"type":"input_text","text":""}"#; 100_000].join(",")
            ),
            prepare::Step::Responses,
        ),
        (
            "responses, 8000 function calls",
            format!(
                "{{\"input\":[{}]}}",
                vec![r#"{"type":"function_call","call_id":"c","name":"f","arguments":"{}"}"#; 8000]
                    .join(",")
            ),
            prepare::Step::Responses,
        ),
        (
            "embeddings, 2048 texts of digits",
            format!(
                "{{\"input\":[{}]}}",
                vec![json(&digits[..4000]); 2048].join(",")
            ),
            prepare::Step::Embeddings,
        ),
        (
            "embeddings, digits at the byte cap",
            format!("{{\"input\":{}}}", json(&digits[1000..])),
            prepare::Step::Embeddings,
        ),
        (
            "responses, digits at the byte cap",
            format!(
                "{{\"input\":{},\"max_output_tokens\":1}}",
                json(&digits[1000..])
            ),
            prepare::Step::Responses,
        ),
        (
            "completion, spaces at the byte cap",
            format!("{{\"prompt\":{}}}", json(&spaces)),
            prepare::Step::Completion,
        ),
        (
            "completion, 4M token ids",
            format!("{{\"prompt\":[{}]}}", vec!["1"; 4 << 20].join(",")),
            prepare::Step::Completion,
        ),
        (
            "completion, 1M one-id prompts (refused: too many)",
            format!("{{\"prompt\":[{}]}}", vec!["[1]"; 1 << 20].join(",")),
            prepare::Step::Completion,
        ),
        (
            "completion, 500k empty prompts (refused: too many)",
            format!("{{\"prompt\":[{}]}}", vec!["\"\""; 500_000].join(",")),
            prepare::Step::Completion,
        ),
        (
            "completion, logit_bias with 300k entries (refused)",
            format!(
                "{{\"prompt\":\"a\",\"logit_bias\":{{{}}}}}",
                (0..300_000)
                    .map(|i| format!("\"{i}\":1"))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            prepare::Step::Completion,
        ),
        (
            "tokenize, digits at the byte cap",
            format!("{{\"content\":{}}}", json(&digits)),
            prepare::Step::Tokenize,
        ),
        (
            "detokenize, 2M ids",
            format!("{{\"tokens\":[{}]}}", vec!["49151"; 2 << 20].join(",")),
            prepare::Step::Detokenize,
        ),
    ];
    let mut failures = Vec::new();
    for (name, body, step) in cases {
        let budget = Arc::new(MemoryBudget::new(Source::Flag, u64::MAX, u64::MAX / 2));
        let mut res = budget.reserve(0, "to test").unwrap();
        let base = LIVE.load(SeqCst);
        PEAK.store(base, SeqCst);
        let t = std::time::Instant::now();
        let ok = step.run(&prep, body.as_bytes(), &mut res).is_ok();
        let peak = (PEAK.load(SeqCst) - base) as u64;
        let reserved = budget.peak();
        eprintln!(
            "{name:52} body {:>9} B  ok {ok:5}  heap peak {:>11} B  reserved {:>11} B  ({:.0}%)  {:.2} s",
            body.len(),
            peak,
            reserved,
            100.0 * peak as f64 / reserved.max(1) as f64,
            t.elapsed().as_secs_f64()
        );
        if peak > reserved {
            failures.push(format!("{name}: peak {peak} > reserved {reserved}"));
        }
    }
    assert!(
        failures.is_empty(),
        "reservations below the real peak:\n{}",
        failures.join("\n")
    );
}
