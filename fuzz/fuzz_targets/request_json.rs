//! Fuzz target `request_json`: the server's request parsing and validation on arbitrary bodies.
//!
//! Owns: feeding each body to what the routes call (metrale_server::api): `parse_request` for a chat
//! and a completion request, then `validate_chat` / `validate_completion` (vocabulary 1000, empty
//! preset), `message_text` for every message, `check_token_ids` for token prompts, and `parse_body`
//! for the tokenize and detokenize bodies; then the whole preparation the server runs on the pool
//! (`prepare::Step::run`: reservations, byte caps, the chat template under its limits, tokenizing)
//! for every endpoint (the Responses API's translation into a chat request included), on the tiny
//! seed model (corpus/gguf/seed-tiny-llama.gguf, a ChatML template) with a 64-token context. A client's body may produce a 4xx, never a panic; memory stays under the
//! process-wide heap cap.

#![no_main]

use std::path::Path;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use metrale_model::gguf::GgufFile;
use metrale_model::{ChatTemplate, Model, RenderLimits};
use metrale_server::budget::{MemoryBudget, Source};
use metrale_server::prepare::{self, Prep, Step};
use metrale_server::api::{
    check_token_ids, message_text, parse_body, parse_request, validate_chat, validate_completion,
    ChatRequest, CompletionRequest, DetokenizeRequest, PromptSpec, SamplingPreset, TokenizeRequest,
};

const VOCAB: usize = 1000;
const CTX: usize = 64;

const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

struct Served {
    model: Model,
    template: ChatTemplate,
    preset: SamplingPreset,
}

fn served() -> &'static Served {
    static S: OnceLock<Served> = OnceLock::new();
    S.get_or_init(|| {
        let bytes = include_bytes!("../corpus/gguf/seed-tiny-llama.gguf");
        let g = GgufFile::from_bytes(bytes, Path::new("seed-tiny-llama.gguf")).expect("the seed parses");
        let model = Model::from_gguf(g).expect("the seed loads");
        let cap = prepare::prompt_byte_cap(&model.tokenizer, CTX);
        let template = ChatTemplate::new(CHATML).expect("ChatML compiles").with_limits(RenderLimits {
            fuel: 100_000 + 2_000 * CTX as u64,
            max_bytes: cap,
        });
        Served {
            model,
            template,
            preset: SamplingPreset::default(),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let preset = SamplingPreset::default();
    if let Ok(r) = parse_request::<ChatRequest>(data) {
        let _ = validate_chat(&r, &preset, VOCAB);
        for (i, m) in r.messages.iter().enumerate() {
            let _ = message_text(m, i);
        }
    }
    if let Ok(r) = parse_request::<CompletionRequest>(data) {
        let _ = validate_completion(&r, &preset, VOCAB);
        match &r.prompt {
            PromptSpec::Tokens(t) => {
                let _ = check_token_ids(t, VOCAB, "prompt");
            }
            PromptSpec::TokenLists(l) => {
                for t in l {
                    let _ = check_token_ids(t, VOCAB, "prompt");
                }
            }
            PromptSpec::Text(_) | PromptSpec::Texts(_) => {}
        }
    }
    let _ = parse_body::<TokenizeRequest>(data);
    if let Ok(d) = parse_body::<DetokenizeRequest>(data) {
        let _ = check_token_ids(&d.tokens, VOCAB, "tokens");
    }
    let sv = served();
    let prep = Prep {
        tokenizer: &sv.model.tokenizer,
        template: Some(&sv.template),
        chat_preset: &sv.preset,
        completion_preset: &sv.preset,
        vocab: sv.model.config.vocab,
        ctx_size: CTX,
        // structured output off: the grammar fields are still parsed and checked (ours), not compiled
        grammars: None,
        tool_format: metrale_server::tools::ToolFormat::Hermes,
        embeddings: Some(metrale_server::embeddings::Pooling::Mean),
        hidden: sv.model.config.hidden,
        reasoning: metrale_server::reasoning::Format::Deepseek,
    };
    // A budget of 256 MiB: the harness's heap cap is 512 MiB, so a reservation that let a request
    // past its worst case would show as an abort here.
    let budget = Arc::new(MemoryBudget::new(Source::Flag, 256 << 20, 256 << 20));
    for step in [
        Step::Chat,
        Step::Responses,
        Step::Completion,
        Step::Embeddings,
        Step::Tokenize,
        Step::Detokenize,
    ] {
        let mut res = budget.reserve(0, "to fuzz").expect("an empty reservation fits");
        if let Err(e) = step.run(&prep, data, &mut res) {
            assert!(e.status.is_client_error(), "{step:?}: a client's body gave {e}");
        }
    }
});
