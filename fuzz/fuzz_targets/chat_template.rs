//! Fuzz target `chat_template`: compiling and rendering `ChatTemplate` with arbitrary template text
//! and messages.
//!
//! Owns: splitting an input into a template and messages (fields separated by NUL bytes: template,
//! then role, content, role, content...), compiling with `ChatTemplate::new`, and rendering with and
//! without the generation prompt. Must not panic.
//!
//! Until `ChatTemplate` limits its own work (minijinja fuel and an output cap, being added), a short
//! template can run for ever (`range` loops, nested loops, recursive macros) or grow a string without
//! bound (`*`, chained `replace`). So this harness caps the input (template at most 512 bytes, room for SmolLM2's, at most
//! 4 messages of at most 64 bytes) and skips templates that use the constructs that multiply work;
//! once the limits land, the filter should go and the harness should check the limit errors instead.

#![no_main]

use libfuzzer_sys::fuzz_target;
use metrale_model::{ChatMessage, ChatTemplate};

const MAX_TEMPLATE: usize = 512;
const MAX_MESSAGES: usize = 4;
const MAX_FIELD: usize = 64;

/// Constructs that let a short template do unbounded work without fuel.
const MULTIPLIERS: &[&str] = &[
    "range",
    "*",
    "macro",
    "call",
    "namespace",
    "recursive",
    "loop(",
    "include",
    "extends",
    "import",
    "indent",
    "center",
    "just",
    "format",
    "zfill",
    "expandtabs",
    "repeat",
    "batch",
    "slice",
];

fn bounded(template: &str) -> bool {
    template.len() <= MAX_TEMPLATE
        && !MULTIPLIERS.iter().any(|m| template.contains(m))
        && template.matches("for").count() - template.matches("endfor").count() <= 2
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
    let t = t.with_tokens("<s>", "</s>");
    let _ = t.render(&messages, true);
    let _ = t.render(&messages, false);
});
