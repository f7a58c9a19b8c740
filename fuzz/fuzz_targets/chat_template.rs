//! Fuzz target `chat_template`: compiling and rendering `ChatTemplate` with arbitrary template text
//! and messages.
//!
//! Owns: splitting an input into a template and messages (fields separated by NUL bytes: template,
//! then role, content, role, content...), compiling with `ChatTemplate::new`, and rendering with and
//! without the generation prompt. Must not panic.
//!
//! Every render runs under a fuel and output limit (as the server sets them, smaller), so loops,
//! `range` and nested loops must end in `OutOfFuel` instead of running on: the harness asserts that a
//! render either succeeds within the output cap or fails with one of `RenderError`'s kinds. Fuel
//! bounds instructions, not the memory one instruction allocates, so templates that can double a
//! string per instruction (`*`, recursive macros, `namespace` accumulators, padding filters) are
//! still skipped; such a template is the operator's (`--chat-template`, the model file), not a
//! client's. Input caps: template at most 512 bytes (room for SmolLM2's), at most 4 messages of at
//! most 64 bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model::{ChatMessage, ChatTemplate, RenderError, RenderLimits};

const MAX_TEMPLATE: usize = 512;
const MAX_MESSAGES: usize = 4;
const MAX_FIELD: usize = 64;

/// Constructs that can double a string per instruction (memory that fuel does not bound).
const MULTIPLIERS: &[&str] = &[
    "*",
    "macro",
    "call",
    "namespace",
    "recursive",
    "indent",
    "center",
    "just",
    "format",
    "zfill",
    "expandtabs",
    "repeat",
];

/// The limits renders run under here: fuel as for a 16-token context, a 64 KiB output.
const LIMITS: RenderLimits = RenderLimits {
    fuel: 100_000 + 2_000 * 16,
    max_bytes: 64 << 10,
};

fn bounded(template: &str) -> bool {
    template.len() <= MAX_TEMPLATE
        && !MULTIPLIERS.iter().any(|m| template.contains(m))
        && template.matches("replace").count() <= 1
        && template.matches("join").count() <= 1
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut fields = text.split('\0');
    let template = fields.next().unwrap_or_default();
    if !bounded(template) {
        return;
    }
    let rest: Vec<&str> = fields.take(2 * MAX_MESSAGES).collect();
    if rest.iter().any(|f| f.len() > MAX_FIELD) {
        return;
    }
    let messages: Vec<ChatMessage> = rest
        .chunks(2)
        .map(|c| ChatMessage::new(c[0], c.get(1).copied().unwrap_or_default()))
        .collect();
    let Ok(t) = ChatTemplate::new(template) else {
        return;
    };
    let t = t.with_tokens("<s>", "</s>").with_limits(LIMITS);
    for generation_prompt in [true, false] {
        match t.render_bounded(&messages, generation_prompt) {
            Ok(text) => assert!(text.len() <= LIMITS.max_bytes, "output past the cap"),
            Err(RenderError::OutOfFuel { fuel }) => assert_eq!(fuel, LIMITS.fuel),
            Err(RenderError::TooLong { max_bytes }) => assert_eq!(max_bytes, LIMITS.max_bytes),
            Err(RenderError::Template(_)) => {}
        }
    }
});
