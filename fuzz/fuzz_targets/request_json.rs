//! Fuzz target `request_json`: the server's request parsing and validation on arbitrary bodies.
//!
//! Owns: feeding each body to what the routes call (metrale_server::api): `parse_request` for a chat
//! and a completion request, then `validate_chat` / `validate_completion` (vocabulary 1000, empty
//! preset), `message_text` for every message, `check_token_ids` for token prompts, and `parse_body`
//! for the tokenize and detokenize bodies. A client's body may produce a 400, never a panic; memory
//! stays under the process-wide heap cap.

#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_server::api::{
    check_token_ids, message_text, parse_body, parse_request, validate_chat, validate_completion,
    ChatRequest, CompletionRequest, DetokenizeRequest, PromptSpec, SamplingPreset, TokenizeRequest,
};

const VOCAB: usize = 1000;

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
});
