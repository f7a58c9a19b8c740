//! Reasoning output (`--reasoning-format`; gpt-oss's harmony channels are `crate::harmony`'s): a
//! model whose chat template thinks (Qwen3, DeepSeek-R1)
//! writes its thought between `<think>` and `</think>` before the answer. With `deepseek` the chat
//! endpoint returns the thought as `reasoning_content` (in the message, and in stream deltas before
//! the content ones), as vLLM's and llama-server's reasoning parsers do, and the rest as `content`;
//! `none` leaves the text as the model wrote it; `auto` (the default) is `deepseek` for a template
//! that writes `<think>` and `none` otherwise. A grammar asked for with the request applies after
//! the thought (`crate::grammar`, `Compiled::constraint_for`). The tokens that came while a thought
//! was open, with the ones that open and close it, are `usage`'s reasoning tokens.
//!
//! Invariants: the thought and the content concatenate to the model's text minus the two tags and
//! the whitespace between `</think>` and the answer; a tag split across tokens is held back until it
//! is whole (at most 7 bytes), so no delta carries part of a tag; a thought never closed is all
//! reasoning (the length limit cut it).

/// What `--reasoning-format` asks for, resolved against the template at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    None,
    Deepseek,
    /// gpt-oss's harmony channels (`crate::harmony`): the analysis channel is the thought, calls
    /// to `functions.*` are tool calls.
    Harmony,
}

impl Format {
    /// `none`, `deepseek`, `harmony`, or `auto` (`harmony` when the template's source writes
    /// harmony's `<|channel|>`, `deepseek` when it has `<think>`, else `none`).
    pub fn resolve(flag: &str, template_source: Option<&str>) -> Result<Format, String> {
        match flag {
            "none" => Ok(Format::None),
            "deepseek" => Ok(Format::Deepseek),
            "harmony" => Ok(Format::Harmony),
            "auto" => Ok(match template_source {
                Some(s) if s.contains("<|channel|>") => Format::Harmony,
                Some(s) if s.contains(OPEN) => Format::Deepseek,
                _ => Format::None,
            }),
            o => Err(format!(
                "--reasoning-format {o:?} is not supported; the choices are none, deepseek, \
                 harmony, auto"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::None => "none",
            Format::Deepseek => "deepseek",
            Format::Harmony => "harmony",
        }
    }
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first non-space text: a thought may open here.
    Start,
    Thinking,
    /// After `</think>`: the whitespace before the answer is dropped.
    AfterThought,
    Answer,
}

/// Splits one choice's text, as it streams, into thought and content.
#[derive(Debug)]
pub struct Splitter {
    state: State,
    held: String,
    /// A thought has opened (it may have closed since).
    opened: bool,
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag` (text that may be the
/// start of the tag, held back until the next piece says).
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl Splitter {
    /// `in_thought`: the rendered prompt ended with `<think>` (the template opened the thought, as
    /// DeepSeek-R1's does), so the text starts inside it.
    pub fn new(in_thought: bool) -> Splitter {
        Splitter {
            state: if in_thought {
                State::Thinking
            } else {
                State::Start
            },
            held: String::new(),
            opened: in_thought,
        }
    }

    /// Whether a thought has opened (it may have closed since).
    pub fn opened(&self) -> bool {
        self.opened
    }

    /// Whether the text so far has opened a thought and not closed it.
    pub fn thinking(&self) -> bool {
        self.state == State::Thinking
    }

    /// Whether no thought has opened yet and none is ruled out: the text so far is whitespace, or
    /// the start of `<think>` still arriving.
    pub fn at_start(&self) -> bool {
        self.state == State::Start
    }

    /// The next piece of text: what it adds to the thought and to the content.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.held.push_str(text);
        let (mut thought, mut content) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                        self.opened = true;
                    } else if OPEN.starts_with(t) {
                        return (thought, content); // empty, or a tag still arriving
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if let Some(i) = self.held.find(CLOSE) {
                        thought.push_str(&self.held[..i]);
                        self.held.drain(..i + CLOSE.len());
                        self.state = State::AfterThought;
                    } else {
                        let keep = partial_tag(&self.held, CLOSE);
                        let cut = self.held.len() - keep;
                        thought.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return (thought, content);
                    }
                }
                State::AfterThought => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        self.held.clear();
                        return (thought, content);
                    }
                    self.held = t.to_string();
                    self.state = State::Answer;
                }
                State::Answer => {
                    content.push_str(&self.held);
                    self.held.clear();
                    return (thought, content);
                }
            }
        }
    }

    /// The text held back at the end: a thought never closed is reasoning, anything else content.
    pub fn finish(mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => (held, String::new()),
            State::AfterThought => (String::new(), String::new()),
            State::Start | State::Answer => (String::new(), held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text pushed in every split into pieces of `n` bytes (at char boundaries).
    fn split(text: &str, in_thought: bool, n: usize) -> (String, String) {
        let mut s = Splitter::new(in_thought);
        let (mut r, mut c) = (String::new(), String::new());
        let mut i = 0;
        while i < text.len() {
            let mut j = (i + n).min(text.len());
            while !text.is_char_boundary(j) {
                j += 1;
            }
            let (a, b) = s.push(&text[i..j]);
            assert!(
                !a.contains('<') || !a.contains("think>"),
                "a tag in a delta: {a:?}"
            );
            r += &a;
            c += &b;
            i = j;
        }
        let (a, b) = s.finish();
        (r + &a, c + &b)
    }

    #[test]
    fn thought_and_answer_split_whatever_the_pieces() {
        let cases: &[(&str, bool, &str, &str)] = &[
            (
                "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.",
                false,
                "\nLet me see: 2 + 2.\n",
                "It is 4.",
            ),
            ("  <think>short</think>Answer", false, "short", "Answer"),
            ("No thought here.", false, "", "No thought here."),
            (
                "<thinking is not a tag",
                false,
                "",
                "<thinking is not a tag",
            ),
            (
                "The thought was opened by the prompt</think>\n\nAnswer é",
                true,
                "The thought was opened by the prompt",
                "Answer é",
            ),
            (
                "<think>cut by the length limit, never closed",
                false,
                "cut by the length limit, never closed",
                "",
            ),
            ("<think></think>\n\n", false, "", ""),
            (
                "<think>a < b and </thin k></think>ok",
                false,
                "a < b and </thin k>",
                "ok",
            ),
            ("", false, "", ""),
        ];
        for &(text, in_thought, thought, content) in cases {
            for n in [1, 2, 3, 7, 100] {
                assert_eq!(
                    split(text, in_thought, n),
                    (thought.to_string(), content.to_string()),
                    "{text:?} in pieces of {n}"
                );
            }
        }
    }

    #[test]
    fn auto_follows_the_template() {
        let qwen = "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}";
        assert_eq!(Format::resolve("auto", Some(qwen)), Ok(Format::Deepseek));
        assert_eq!(
            Format::resolve("auto", Some("{{ messages }}")),
            Ok(Format::None)
        );
        assert_eq!(Format::resolve("auto", None), Ok(Format::None));
        assert_eq!(Format::resolve("none", Some(qwen)), Ok(Format::None));
        assert!(Format::resolve("r1", None)
            .unwrap_err()
            .contains("none, deepseek, harmony, auto"));
        // gpt-oss's template writes harmony's channels (and no <think>)
        let harmony = "{{- '<|start|>assistant<|channel|>final<|message|>' }}";
        assert_eq!(Format::resolve("auto", Some(harmony)), Ok(Format::Harmony));
    }
}
