//! gpt-oss's output format ("harmony"): the model writes one or more messages, each a header and a
//! body between special tokens, and the chat endpoint returns them as vLLM's and llama-server's
//! gpt-oss parsers do:
//!
//! ```text
//! <|channel|>analysis<|message|>THOUGHT<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>
//! <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
//! ```
//!
//! The prompt ends with `<|start|>assistant` (the template's generation prompt), so the text starts
//! in a header. A header runs to `<|message|>`: its channel is the word after `<|channel|>`, its
//! recipient the `to=...` in it (after the role or after the channel). The body of an `analysis`
//! message is the thought (`reasoning_content`); of a message to `functions.NAME`, call NAME's
//! JSON arguments; of any other (`final`, a `commentary` preamble with no recipient) the content.
//! `<|end|>` closes a message and another may follow; `<|return|>` and `<|call|>` end the
//! generation (the server stops on them: `crate::serve`).
//!
//! Invariants: every byte of a body goes to exactly one of thought, content and a call's
//! arguments, in order; header text never reaches the client; a message cut by the length limit
//! keeps what it had (a call's arguments as far as they came).

use crate::tools::{Call, ToolEvent};

/// The harmony special tokens, by their text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    Start,
    Channel,
    Message,
    Constrain,
    End,
    Return,
    Call,
}

impl Marker {
    /// The marker a special token's text is, if any.
    pub fn of(text: &str) -> Option<Marker> {
        Some(match text {
            "<|start|>" => Marker::Start,
            "<|channel|>" => Marker::Channel,
            "<|message|>" => Marker::Message,
            "<|constrain|>" => Marker::Constrain,
            "<|end|>" => Marker::End,
            "<|return|>" => Marker::Return,
            "<|call|>" => Marker::Call,
            _ => return None,
        })
    }
}

/// The special tokens that end a harmony generation (with the model's own end-of-generation ids).
pub const STOP_TEXTS: [&str; 2] = ["<|return|>", "<|call|>"];

/// What a piece of the output is.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// Text of the thought (`reasoning_content`).
    Thought(String),
    /// Content, or a call's start or arguments (`crate::tools`'s events).
    Tool(ToolEvent),
}

#[derive(Debug, Clone, PartialEq)]
enum Body {
    Thought,
    Content,
    /// Call `index`'s arguments.
    Call(usize),
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// In a header: its text so far, and whether `<|channel|>` came (the channel name follows it).
    Header {
        text: String,
        channel_at: Option<usize>,
    },
    Body(Body),
    /// After `<|return|>` or `<|call|>`.
    Done,
}

/// Splits one choice's output, token by token, into thought, content and calls.
#[derive(Debug)]
pub struct Stream {
    state: State,
    calls: Vec<Call>,
}

impl Default for Stream {
    fn default() -> Self {
        Self::new()
    }
}

impl Stream {
    /// A stream at the start of the assistant's turn (in its first header).
    pub fn new() -> Stream {
        Stream {
            state: State::Header {
                text: String::new(),
                channel_at: None,
            },
            calls: Vec::new(),
        }
    }

    /// Whether the text now goes to the thought (a token counts as reasoning then).
    pub fn thinking(&self) -> bool {
        self.state == State::Body(Body::Thought)
    }

    /// Text of ordinary tokens.
    pub fn text(&mut self, text: &str) -> Vec<Out> {
        if text.is_empty() {
            return Vec::new();
        }
        match &mut self.state {
            State::Header { text: h, .. } => {
                h.push_str(text);
                Vec::new()
            }
            State::Body(Body::Thought) => vec![Out::Thought(text.to_string())],
            State::Body(Body::Content) => vec![Out::Tool(ToolEvent::Text(text.to_string()))],
            State::Body(Body::Call(index)) => {
                let index = *index;
                self.calls[index].arguments.push_str(text);
                vec![Out::Tool(ToolEvent::Args {
                    index,
                    text: text.to_string(),
                })]
            }
            State::Done => Vec::new(),
        }
    }

    /// A harmony special token.
    pub fn marker(&mut self, m: Marker) -> Vec<Out> {
        let new_header = || State::Header {
            text: String::new(),
            channel_at: None,
        };
        match (m, &mut self.state) {
            (_, State::Done) => Vec::new(),
            (Marker::Channel, State::Header { text, channel_at }) => {
                // markers separate the header's words (`assistant to=functions.f<|channel|>...`)
                text.push(' ');
                *channel_at = Some(text.len());
                Vec::new()
            }
            (Marker::Message, State::Header { text, channel_at }) => {
                let (header, channel_at) = (std::mem::take(text), *channel_at);
                let (body, out) = self.open(&header, channel_at);
                self.state = State::Body(body);
                out
            }
            (Marker::End, _) => {
                self.state = new_header();
                Vec::new()
            }
            (Marker::Start, State::Body(_)) => {
                // a message the model did not close: the next one begins
                self.state = new_header();
                Vec::new()
            }
            (Marker::Return | Marker::Call, _) => {
                self.state = State::Done;
                Vec::new()
            }
            // `<|constrain|>` (the arguments' format) and `<|start|>` stay in the header
            (Marker::Constrain | Marker::Start, State::Header { text, .. }) => {
                text.push(' ');
                Vec::new()
            }
            (Marker::Channel | Marker::Message | Marker::Constrain, State::Body(_)) => Vec::new(),
        }
    }

    /// The body a header opens: a call where its recipient is `functions.NAME`, the thought on
    /// the analysis channel, content otherwise.
    fn open(&mut self, header: &str, channel_at: Option<usize>) -> (Body, Vec<Out>) {
        let channel = channel_at
            .map(|at| header[at..].split_whitespace().next().unwrap_or(""))
            .unwrap_or("");
        let recipient = header
            .split_whitespace()
            .find_map(|w| w.strip_prefix("to="))
            .unwrap_or("");
        if let Some(name) = recipient.strip_prefix("functions.") {
            let index = self.calls.len();
            self.calls.push(Call {
                name: name.to_string(),
                arguments: String::new(),
            });
            let start = ToolEvent::Start {
                index,
                name: name.to_string(),
            };
            return (Body::Call(index), vec![Out::Tool(start)]);
        }
        match channel {
            "analysis" => (Body::Thought, Vec::new()),
            _ => (Body::Content, Vec::new()),
        }
    }

    /// The calls made (`None`: none).
    pub fn finish(self) -> Option<Vec<Call>> {
        (!self.calls.is_empty()).then_some(self.calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `parts` (a marker's text or ordinary text), one token each, and returns (thought,
    /// content, calls).
    fn run(parts: &[&str]) -> (String, String, Option<Vec<Call>>) {
        let mut s = Stream::new();
        let (mut thought, mut content) = (String::new(), String::new());
        let mut started = Vec::new();
        for p in parts {
            let outs = match Marker::of(p) {
                Some(m) => s.marker(m),
                None => s.text(p),
            };
            for o in outs {
                match o {
                    Out::Thought(t) => thought += &t,
                    Out::Tool(ToolEvent::Text(t)) => content += &t,
                    Out::Tool(ToolEvent::Start { index, name }) => started.push((index, name)),
                    Out::Tool(ToolEvent::Args { .. }) => {}
                }
            }
        }
        let calls = s.finish();
        if let Some(c) = &calls {
            let names: Vec<(usize, String)> = c
                .iter()
                .enumerate()
                .map(|(i, c)| (i, c.name.clone()))
                .collect();
            assert_eq!(names, started);
        }
        (thought, content, calls)
    }

    #[test]
    fn a_thought_then_the_answer() {
        let (t, c, calls) = run(&[
            "<|channel|>",
            "analysis",
            "<|message|>",
            "User says hi.",
            " Reply.",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|channel|>",
            "final",
            "<|message|>",
            "Hello",
            "!",
            "<|return|>",
            "ignored",
        ]);
        assert_eq!(
            (t.as_str(), c.as_str(), calls),
            ("User says hi. Reply.", "Hello!", None)
        );
    }

    #[test]
    fn a_call_with_its_recipient_after_the_channel_or_the_role() {
        for parts in [
            &[
                "<|channel|>",
                "analysis",
                "<|message|>",
                "Need weather.",
                "<|end|>",
                "<|start|>",
                "assistant",
                "<|channel|>",
                "commentary to=functions.get_weather",
                " ",
                "<|constrain|>",
                "json",
                "<|message|>",
                "{\"city\":",
                "\"Paris\"}",
                "<|call|>",
            ][..],
            &[
                "<|channel|>",
                "analysis",
                "<|message|>",
                "Need weather.",
                "<|end|>",
                "<|start|>",
                "assistant to=functions.get_weather",
                "<|channel|>",
                "commentary json",
                "<|message|>",
                "{\"city\":",
                "\"Paris\"}",
                "<|call|>",
            ][..],
        ] {
            let (t, c, calls) = run(parts);
            assert_eq!((t.as_str(), c.as_str()), ("Need weather.", ""));
            let calls = calls.expect("a call");
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0].name, "get_weather");
            assert_eq!(calls[0].arguments, "{\"city\":\"Paris\"}");
        }
    }

    #[test]
    fn a_preamble_is_content_and_a_cut_message_keeps_its_text() {
        let (t, c, calls) = run(&[
            "<|channel|>",
            "commentary",
            "<|message|>",
            "Checking.",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|channel|>",
            "analysis",
            "<|message|>",
            "cut he",
        ]);
        assert_eq!(
            (t.as_str(), c.as_str(), calls),
            ("cut he", "Checking.", None)
        );
        // no channel at all: content (a model that skips the analysis)
        let (t, c, _) = run(&["<|message|>", "plain"]);
        assert_eq!((t.as_str(), c.as_str()), ("", "plain"));
    }
}
