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

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use metrale_model::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;

/// The parser factory of the served model (its token trie).
pub struct Grammars {
    factory: ParserFactory,
}

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
        Ok(Grammars { factory })
    }

    /// Compile `g`: a 400 naming `param` when llguidance refuses it.
    pub fn compile(&self, g: TopLevelGrammar, param: &str) -> Result<Compiled, ApiError> {
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

/// A compiled grammar, ready to constrain one choice (clone it per choice).
#[derive(Clone)]
pub struct Compiled(Matcher);

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled grammar")
    }
}

impl Compiled {
    /// One choice's constraint.
    pub fn constraint(&self) -> metrale_engine::Constraint {
        metrale_engine::Constraint(Box::new(Constraint(self.0.deep_clone())))
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
