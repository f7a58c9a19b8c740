//! Constrained decoding: the request fields that ask for structured output, compiled by llguidance
//! (the engine behind llama.cpp's and vLLM's guidance backends) into a grammar whose matcher
//! decides every generated token (`metrale_engine::TokenConstraint`).
//!
//! Fields (at most one per request; naming two is a 400):
//! - `response_format`: `{"type": "json_object"}` (any JSON object), `{"type": "json_schema",
//!   "json_schema": {"schema": {...}}}` (OpenAI), `{"type": "text"}` (none);
//! - llama-server's `json_schema` (a schema) and `grammar` (here: llguidance's Lark syntax);
//! - vLLM's `guided_json`, `guided_regex`, `guided_grammar` (Lark), `guided_choice` (a list of
//!   strings), and `structured_outputs` `{json | regex | grammar | choice}`; `regex` as well.
//!
//! JSON schemas compile to compact JSON (no free whitespace; `json_grammar` says why). The token
//! trie is built once from the model's tokenizer: every token's bytes, special tokens
//! marked (a grammar matches them only by name) and ids past the tokenizer's vocabulary
//! (padding) never allowed. A schema or grammar that does not compile is a 400 naming the field
//! and llguidance's message.
//!
//! Reasoning models (`crate::reasoning`): where the chat text is split into thought and content
//! and the vocabulary has `</think>` as one token, a chat request's grammar applies after the
//! thought ([`Compiled::constraint_for`]): inside it every token is allowed; before it (the prompt
//! did not open one) the grammar's first tokens and `<think>` are. Elsewhere (a tag the tokenizer
//! splits) the grammar applies from the first token, as without reasoning.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use metrale_model::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;

/// The parser factory of the served model (its token trie) and the grammars compiled lately.
pub struct Grammars {
    factory: ParserFactory,
    /// The thought's tags as tokens, where `</think>` is one.
    think: Option<ThinkTokens>,
    /// u32 words of a mask (the logits row's length in bits).
    words: usize,
    /// Compiled grammars by their JSON form, the most recent first (at most [`CACHED`]): an
    /// application that sends the same schema with every request compiles it once, and its
    /// requests share one lexer cache, warm after the first.
    cache: Mutex<Vec<(String, Compiled)>>,
    hits: AtomicU64,
}

/// Compiled grammars kept for reuse.
const CACHED: usize = 32;

impl Grammars {
    /// Build the token trie of `tk` for a logits row of `vocab` and the factory over it (`eos`:
    /// the token a complete grammar allows).
    pub fn new(tk: &Tokenizer, vocab: usize, eos: u32) -> anyhow::Result<Grammars> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let special = |name: &str| {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(name.as_bytes());
                    w
                };
                if (id as usize) >= tk.vocab_size() {
                    special(&format!("<[padding {id}]>"))
                } else if tk.is_special(id) {
                    special(&String::from_utf8_lossy(tk.token_bytes_ref(id)))
                } else {
                    tk.token_bytes(id)
                }
            })
            .collect();
        let think = tk.token_to_id(THINK_CLOSE).map(|close| ThinkTokens {
            open: tk.token_to_id(THINK_OPEN),
            close,
        });
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars {
            factory,
            think,
            words: vocab.div_ceil(32),
            cache: Mutex::new(Vec::new()),
            hits: AtomicU64::new(0),
        })
    }

    /// Compile `g`, or take it from the cache: a 400 naming `param` when llguidance refuses it
    /// (refusals are not cached: they cost a compile each time).
    pub fn compile(&self, g: TopLevelGrammar, param: &str) -> Result<Compiled, ApiError> {
        let key = serde_json::to_string(&g).ok();
        let lock = || self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = &key {
            let mut cache = lock();
            if let Some(i) = cache.iter().position(|(ck, _)| ck == k) {
                let hit = cache.remove(i);
                let c = hit.1.clone();
                cache.insert(0, hit);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(c);
            }
        }
        let c = self.compile_new(g, param)?;
        if let Some(k) = key {
            let mut cache = lock();
            cache.insert(0, (k, c.clone()));
            cache.truncate(CACHED);
        }
        Ok(c)
    }

    /// How many compiles the cache answered.
    pub fn cache_hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    fn compile_new(&self, g: TopLevelGrammar, param: &str) -> Result<Compiled, ApiError> {
        let parser = self.factory.create_parser(g).map_err(|e| {
            ApiError::invalid(
                format!("'{param}' cannot be compiled into a grammar: {e}"),
                Some(param),
            )
        })?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(ApiError::invalid(
                format!("'{param}' cannot be compiled into a grammar: {e}"),
                Some(param),
            ));
        }
        Ok(Compiled {
            matcher: m,
            think: self.think,
            words: self.words,
        })
    }
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// The ids of a reasoning model's thought tags (`<think>` may be missing: a template that always
/// opens the thought in the prompt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkTokens {
    pub open: Option<u32>,
    pub close: u32,
}

/// A compiled grammar, ready to constrain choices. Its clones, and the constraints made from it,
/// share one lexer cache (llguidance's `Clone`; the engine thread is the only one asking for
/// masks, so the cache's lock is never contended).
#[derive(Clone)]
pub struct Compiled {
    matcher: Matcher,
    think: Option<ThinkTokens>,
    words: usize,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled grammar")
    }
}

impl Compiled {
    /// One choice's constraint, sharing the lexer cache (`bench/structured/`, 64 streams: the
    /// p90 mask 5.7 us against 40 with a copy each, a step's masks 0.9 against 1.5 ms at the
    /// median).
    pub fn constraint(&self) -> metrale_engine::Constraint {
        metrale_engine::Constraint(Box::new(Constraint(self.matcher.clone())))
    }

    /// One choice's constraint for a request whose text is split into thought and content
    /// (`reasoning`: `Some(in_thought)`, true when the prompt opened the thought; the request's
    /// `reasoning` parameter): the grammar after the thought where the vocabulary has the tags as
    /// tokens, else [`Self::constraint`].
    pub fn constraint_for(&self, reasoning: Option<bool>) -> metrale_engine::Constraint {
        match (reasoning, self.think) {
            (Some(in_thought), Some(think)) => metrale_engine::Constraint(Box::new(AfterThought {
                inner: Constraint(self.matcher.clone()),
                think,
                words: self.words,
                phase: if in_thought {
                    Phase::Thinking
                } else {
                    Phase::Start
                },
            })),
            _ => self.constraint(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing generated yet, outside a thought: the grammar's first tokens, or `<think>`.
    Start,
    /// Inside the thought: any token, until `</think>`.
    Thinking,
    /// The answer: the grammar.
    Answer,
}

/// A grammar that applies after the model's thought (see the module docs).
struct AfterThought {
    inner: Constraint,
    think: ThinkTokens,
    words: usize,
    phase: Phase,
}

impl metrale_engine::TokenConstraint for AfterThought {
    fn allowed(&mut self) -> Result<Vec<u32>, String> {
        match self.phase {
            Phase::Thinking => Ok(vec![u32::MAX; self.words]),
            Phase::Start => {
                let mut m = self.inner.allowed()?;
                if let Some(o) = self.think.open {
                    let w = o as usize / 32;
                    if w < m.len() {
                        m[w] |= 1 << (o % 32);
                    }
                }
                Ok(m)
            }
            Phase::Answer => self.inner.allowed(),
        }
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        match self.phase {
            Phase::Start if Some(token) == self.think.open => {
                self.phase = Phase::Thinking;
                Ok(())
            }
            Phase::Thinking => {
                if token == self.think.close {
                    self.phase = Phase::Answer;
                }
                Ok(())
            }
            Phase::Start | Phase::Answer => {
                self.phase = Phase::Answer;
                self.inner.commit(token)
            }
        }
    }

    fn finished(&self) -> bool {
        self.phase == Phase::Answer && self.inner.finished()
    }
}

struct Constraint(Matcher);

impl metrale_engine::TokenConstraint for Constraint {
    fn allowed(&mut self) -> Result<Vec<u32>, String> {
        self.0
            .compute_mask_or_eos()
            .map(|v| v.as_slice().to_vec())
            .map_err(|e| e.to_string())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.0.consume_token(token).map_err(|e| e.to_string())
    }

    fn finished(&self) -> bool {
        self.0.is_stopped()
    }
}

/// The structured-output fields of a request (see the module docs), as parsed.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct GrammarFields {
    pub response_format: Option<Value>,
    pub json_schema: Option<Value>,
    pub grammar: Option<String>,
    pub regex: Option<String>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub structured_outputs: Option<Value>,
}

fn escape_regex(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn schema_of(v: &Value, param: &str) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        // vLLM accepts the schema as a JSON string too
        Value::String(s) => serde_json::from_str(s).map_err(|e| {
            ApiError::invalid(format!("'{param}' is not a JSON schema: {e}"), Some(param))
        }),
        _ => Err(ApiError::invalid(
            format!("'{param}' must be a JSON schema (an object)"),
            Some(param),
        )),
    }
}

/// The grammar of a JSON schema, in compact form: no free whitespace between tokens (llguidance's
/// default allows any amount, which a model that does not know JSON fills until `max_tokens`),
/// `", "` and `": "` as separators. A schema's own `x-guidance` options win.
fn json_grammar(mut schema: Value) -> TopLevelGrammar {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    TopLevelGrammar::from_json_schema(schema)
}

fn choice_grammar(items: &[String], param: &str) -> Result<TopLevelGrammar, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid(
            format!("'{param}' must list at least one choice"),
            Some(param),
        ));
    }
    let alt: Vec<String> = items.iter().map(|s| escape_regex(s)).collect();
    Ok(TopLevelGrammar::from_regex(&format!("({})", alt.join("|"))))
}

impl GrammarFields {
    /// The one grammar the fields ask for (`None`: unconstrained), with the field that named it.
    pub fn grammar(&self) -> Result<Option<(TopLevelGrammar, &'static str)>, ApiError> {
        let mut found: Vec<(TopLevelGrammar, &'static str)> = Vec::new();
        if let Some(rf) = self.response_format.as_ref().filter(|v| !v.is_null()) {
            let p = "response_format";
            match rf.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => found.push((json_grammar(json!({"type": "object"})), p)),
                Some("json_schema") => {
                    let s = rf
                        .get("json_schema")
                        .and_then(|j| j.get("schema"))
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                                Some(p),
                            )
                        })?;
                    found.push((json_grammar(schema_of(s, p)?), p));
                }
                other => {
                    return Err(ApiError::invalid(
                        format!(
                            "response_format type {other:?} is not one of text, json_object, json_schema"
                        ),
                        Some(p),
                    ))
                }
            }
        }
        for (v, p) in [
            (&self.json_schema, "json_schema"),
            (&self.guided_json, "guided_json"),
        ] {
            if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
                found.push((json_grammar(schema_of(v, p)?), p));
            }
        }
        for (v, p) in [(&self.regex, "regex"), (&self.guided_regex, "guided_regex")] {
            if let Some(r) = v {
                found.push((TopLevelGrammar::from_regex(r), p));
            }
        }
        for (v, p) in [
            (&self.grammar, "grammar"),
            (&self.guided_grammar, "guided_grammar"),
        ] {
            if let Some(g) = v {
                found.push((TopLevelGrammar::from_lark(g.clone()), p));
            }
        }
        if let Some(c) = &self.guided_choice {
            found.push((choice_grammar(c, "guided_choice")?, "guided_choice"));
        }
        if let Some(so) = self.structured_outputs.as_ref().filter(|v| !v.is_null()) {
            let p = "structured_outputs";
            let pick = |k: &str| so.get(k).filter(|v| !v.is_null());
            if let Some(j) = pick("json") {
                found.push((json_grammar(schema_of(j, p)?), p));
            }
            if let Some(r) = pick("regex").and_then(Value::as_str) {
                found.push((TopLevelGrammar::from_regex(r), p));
            }
            if let Some(g) = pick("grammar").and_then(Value::as_str) {
                found.push((TopLevelGrammar::from_lark(g.to_string()), p));
            }
            if let Some(c) = pick("choice") {
                let items: Vec<String> = serde_json::from_value(c.clone()).map_err(|_| {
                    ApiError::invalid(
                        "structured_outputs.choice must be a list of strings",
                        Some(p),
                    )
                })?;
                found.push((choice_grammar(&items, p)?, p));
            }
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => Err(ApiError::invalid(
                format!(
                    "give one structured-output constraint, not {} ({})",
                    found.len(),
                    found.iter().map(|f| f.1).collect::<Vec<_>>().join(", ")
                ),
                Some(found[1].1),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default model's token trie (the cache is keyed by the grammar alone).
    fn grammars() -> Option<Grammars> {
        model_grammars().map(|(_, g)| g)
    }

    fn model_grammars() -> Option<(metrale_model::Model, Grammars)> {
        let path = std::env::var("METRALE_MODEL").ok()?;
        let m = metrale_model::Model::load(std::path::Path::new(&path)).ok()?;
        let eos = m.tokenizer.eos().first().copied().unwrap_or(0);
        let g = Grammars::new(&m.tokenizer, m.config.vocab, eos).ok()?;
        Some((m, g))
    }

    fn has(mask: &[u32], t: u32) -> bool {
        mask[t as usize / 32] >> (t % 32) & 1 == 1
    }

    /// A chat request whose text is split into thought and content: its grammar waits for the
    /// thought to end. SmolLM2 has no `</think>` token, so its chat tokens stand in for the tags
    /// (what `Grammars::new` finds in a Qwen3 or DeepSeek-R1 vocabulary).
    #[test]
    fn a_grammar_applies_after_the_thought_where_the_tags_are_tokens() {
        let Some((m, g)) = model_grammars() else {
            eprintln!("skipped: METRALE_MODEL (the default model) is needed for a token trie");
            return;
        };
        assert_eq!(g.think, None, "SmolLM2 has no </think> token");
        let schema =
            json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let mut c = g.compile(json_grammar(schema), "json_schema").unwrap();
        let plain = c.constraint().0.allowed().unwrap();
        // without the tags as tokens the grammar applies from the first token, reasoning or not
        assert_eq!(c.constraint_for(Some(true)).0.allowed().unwrap(), plain);
        let tk = &m.tokenizer;
        let (open, close) = (
            tk.token_to_id("<|im_start|>").unwrap(),
            tk.token_to_id("<|im_end|>").unwrap(),
        );
        assert!(!has(&plain, open) && !has(&plain, close));
        c.think = Some(ThinkTokens {
            open: Some(open),
            close,
        });
        // the prompt opened the thought: any token (the grammar would refuse these) until the
        // close, then the grammar from its start
        let thought = tk
            .encode("Let me think: no braces yet.", false, false)
            .unwrap();
        assert!(thought.iter().any(|&t| !has(&plain, t)));
        let mut t = c.constraint_for(Some(true));
        for &tok in &thought {
            assert!(t.0.allowed().unwrap().iter().all(|&w| w == u32::MAX));
            t.0.commit(tok).unwrap();
            assert!(!t.0.finished());
        }
        t.0.commit(close).unwrap();
        assert_eq!(t.0.allowed().unwrap(), plain);
        // no thought open: the grammar's first tokens and the open tag
        let mut s = c.constraint_for(Some(false));
        let first = s.0.allowed().unwrap();
        assert!(has(&first, open));
        let mut without = first.clone();
        without[open as usize / 32] &= !(1 << (open % 32));
        assert_eq!(without, plain);
        // ... and a grammar token first is the answer, as the plain constraint has it
        let brace = (0..tk.vocab_size() as u32)
            .find(|&t| has(&plain, t))
            .unwrap();
        s.0.commit(brace).unwrap();
        let mut p = c.constraint();
        p.0.commit(brace).unwrap();
        assert_eq!(s.0.allowed().unwrap(), p.0.allowed().unwrap());
        // the open tag first: a thought, then the grammar after its close
        let mut o = c.constraint_for(Some(false));
        o.0.commit(open).unwrap();
        assert!(o.0.allowed().unwrap().iter().all(|&w| w == u32::MAX));
        o.0.commit(close).unwrap();
        assert_eq!(o.0.allowed().unwrap(), plain);
        // no reasoning: the plain constraint
        assert_eq!(c.constraint_for(None).0.allowed().unwrap(), plain);
    }

    #[test]
    fn a_grammar_sent_again_is_taken_from_the_cache_and_refusals_are_not_kept() {
        let Some(g) = grammars() else {
            eprintln!("skipped: METRALE_MODEL (the default model) is needed for a token trie");
            return;
        };
        let schema =
            json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let a = g
            .compile(json_grammar(schema.clone()), "json_schema")
            .unwrap();
        assert_eq!(g.cache_hits(), 0);
        let b = g.compile(json_grammar(schema), "json_schema").unwrap();
        assert_eq!(g.cache_hits(), 1);
        // both constrain alike: the first token may only open the object
        let (mut ca, mut cb) = (a.constraint(), b.constraint());
        assert_eq!(ca.0.allowed().unwrap(), cb.0.allowed().unwrap());
        let other = json!({"type": "array", "items": {"type": "string"}});
        g.compile(json_grammar(other), "json_schema").unwrap();
        assert_eq!(g.cache_hits(), 1);
        for _ in 0..2 {
            let bad = g.compile(json_grammar(json!({"$ref": "#/nowhere"})), "json_schema");
            assert!(bad.is_err());
        }
        assert_eq!(g.cache_hits(), 1);
        for i in 0..(CACHED + 5) {
            g.compile(TopLevelGrammar::from_regex(&format!("x{i}")), "regex")
                .unwrap();
        }
        assert!(g.cache.lock().unwrap().len() <= CACHED);
    }
}
