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
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars {
            factory,
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
        Ok(Compiled(m))
    }
}

/// A compiled grammar, ready to constrain choices. Its clones, and the constraints made from it,
/// share one lexer cache (llguidance's `Clone`; the engine thread is the only one asking for
/// masks, so the cache's lock is never contended).
#[derive(Clone)]
pub struct Compiled(Matcher);

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
        metrale_engine::Constraint(Box::new(Constraint(self.0.clone())))
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
        let path = std::env::var("METRALE_MODEL").ok()?;
        let m = metrale_model::Model::load(std::path::Path::new(&path)).ok()?;
        let eos = m.tokenizer.eos().first().copied().unwrap_or(0);
        Grammars::new(&m.tokenizer, m.config.vocab, eos).ok()
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
