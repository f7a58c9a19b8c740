//! OpenAI request types and their validation into generation parameters.
//!
//! Only this module knows the wire names of request fields. Invariants: unknown fields are ignored
//! (clients send vendor extras), but a known field with the wrong type or an out-of-range value is a
//! 400 naming the field; sampling fields the request leaves unset take the served target's preset for
//! the endpoint's category (`[sampling.chat]` / `[sampling.completion]` of MODEL.toml), then the
//! OpenAI defaults.

use metrale_backend::sampler::SamplingParams;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::ApiError;

/// Most top logprobs a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most choices per request.
pub const MAX_N: usize = 16;
/// Most stop strings per request.
pub const MAX_STOPS: usize = 16;
/// Longest stop string, in bytes (the text held back while a stop string may be forming is at most
/// this long).
pub const MAX_STOP_BYTES: usize = 256;
/// Most `logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// `logit_bias` values lie in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range).
pub const LOGIT_BIAS_LIMIT: f64 = 100.0;

/// Parse a JSON body; a syntax error, a wrongly typed field or anything but whitespace after the
/// JSON value is a 400 naming what was wrong.
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let v = serde_path_to_error::deserialize(&mut *de).map_err(path_error)?;
    de.end().map_err(|e| {
        ApiError::invalid(
            format!("the request body has more after its JSON value: {e}"),
            None,
        )
    })?;
    Ok(v)
}

fn path_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let param = (path != "." && path != "?" && !path.is_empty()).then_some(path);
    let msg = match &param {
        Some(p) => format!("invalid value for '{p}': {inner}"),
        None => format!("the request body is not valid JSON for this endpoint: {inner}"),
    };
    ApiError::invalid(msg, param.as_deref())
}

/// A request made of the endpoint's own fields plus the shared `CommonParams`.
pub trait WithCommon: DeserializeOwned {
    fn set_common(&mut self, c: CommonParams);
}

/// Parse an endpoint request: its own fields and the shared ones from the same JSON object (two
/// passes over the bytes instead of `#[serde(flatten)]`, which would lose the field name in type
/// errors; each pass skips the other's fields without building them).
pub fn parse_request<T: WithCommon>(body: &[u8]) -> Result<T, ApiError> {
    require_object(body)?;
    let mut common: CommonParams = parse_body(body)?;
    common.grammar = parse_body(body)?;
    let mut r: T = parse_body(body)?;
    r.set_common(common);
    Ok(r)
}

/// A 400 unless `body` holds a JSON object (checked from its first byte, before parsing).
pub fn require_object(body: &[u8]) -> Result<(), ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    }
    Ok(())
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields shared by /v1/chat/completions and /v1/completions.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub n: Option<i64>,
    pub stop: Option<StopSpec>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// Token id (a decimal string) -> bias in [-100, 100]; checked by `parse_logit_bias`.
    pub logit_bias: Option<serde_json::Value>,
    /// The structured-output fields (`crate::grammar`), parsed in a pass of their own.
    #[serde(skip)]
    pub grammar: crate::grammar::GrammarFields,
}

/// Message content: a string or a list of parts (only text parts are supported).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// An assistant message's tool calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

/// A tool call in an assistant message (`{id, type, function: {name, arguments}}`; `arguments` a
/// JSON text, or an object as some clients send it).
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallIn {
    #[serde(default)]
    pub id: Option<String>,
    pub function: ToolCallFunctionIn,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallFunctionIn {
    pub name: String,
    #[serde(default)]
    pub arguments: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(skip)]
    pub common: CommonParams,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<crate::tools::ToolIn>>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Further variables for the chat template (vLLM's and llama-server's field), e.g.
    /// `{"enable_thinking": false}`; an object.
    pub chat_template_kwargs: Option<serde_json::Value>,
}

/// `prompt` of /v1/completions: text, token ids, or a batch of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    Text(String),
    Tokens(Vec<i64>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptSpec,
    #[serde(skip)]
    pub common: CommonParams,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

impl WithCommon for ChatRequest {
    fn set_common(&mut self, c: CommonParams) {
        self.common = c;
    }
}

impl WithCommon for CompletionRequest {
    fn set_common(&mut self, c: CommonParams) {
        self.common = c;
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    #[serde(default)]
    pub add_special: bool,
}

/// POST /v1/embeddings (`input`: a string, strings, token ids or lists of token ids, as
/// /v1/completions' `prompt`).
#[derive(Debug, Clone, Deserialize)]
pub struct EmbeddingsRequest {
    pub input: PromptSpec,
    #[serde(default)]
    pub encoding_format: Option<String>,
    #[serde(default)]
    pub dimensions: Option<i64>,
    /// Accepted and unused (the server serves one model).
    #[serde(default)]
    pub model: Option<String>,
    /// Accepted and unused.
    #[serde(default)]
    pub user: Option<String>,
}

/// Most inputs of one /v1/embeddings request (OpenAI's limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<i64>,
}

/// Sampling defaults of a served target for one endpoint category (`None` = not set there).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingPreset {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// How a request wants logprobs back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobsSpec {
    pub top: usize,
}

/// A validated request's generation settings (prompt handled separately).
#[derive(Debug, Clone)]
pub struct GenParams {
    /// `None`: as many as fit in the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub n: usize,
    pub stops: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: Option<LogprobsSpec>,
    /// The structured-output grammar, compiled (`crate::grammar`); set by `prepare`.
    pub grammar: Option<crate::grammar::Compiled>,
    /// The offered tools (`crate::tools`); set by `prepare`.
    pub tools: Option<std::sync::Arc<crate::tools::Tools>>,
    /// The text is split into thought and content (`crate::reasoning`): `Some(in_thought)`, true
    /// when the prompt opened the thought; set by `prepare` for chat requests.
    pub reasoning: Option<bool>,
    /// The output is gpt-oss's harmony messages (`crate::harmony`): set by `prepare` for chat
    /// requests under `--reasoning-format harmony`.
    pub harmony: bool,
}

fn check_range(v: Option<f32>, name: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(ApiError::invalid(
            format!("'{name}' must be between {lo} and {hi}, got {x}"),
            Some(name),
        )),
        _ => Ok(v),
    }
}

/// `logit_bias` (null or an object of token id strings to numbers) as (id, bias) sorted by id; `vocab`
/// is the logits row length. A 400 naming `logit_bias` and the bad key or value otherwise.
pub fn parse_logit_bias(
    v: Option<&serde_json::Value>,
    vocab: usize,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |msg: String| ApiError::invalid(msg, Some("logit_bias"));
    let map = match v {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::Object(m)) => m,
        Some(other) => {
            return Err(bad(format!(
                "'logit_bias' must be an object mapping token ids (strings such as \"1234\") to \
                 biases between -100 and 100, got {other}"
            )))
        }
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!(
            "'logit_bias' may have at most {MAX_LOGIT_BIAS} entries, got {}",
            map.len()
        )));
    }
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(format!(
                "'logit_bias' key '{key}' is not a token id (a non-negative integer such as \"1234\")"
            )));
        }
        let id = match key.parse::<u64>() {
            Ok(id) if id < vocab as u64 => id as u32,
            _ => {
                return Err(bad(format!(
                    "'logit_bias' key '{key}' is outside the vocabulary (token ids 0..{vocab})"
                )))
            }
        };
        let bias = match value.as_f64() {
            Some(b) if b.is_finite() && (-LOGIT_BIAS_LIMIT..=LOGIT_BIAS_LIMIT).contains(&b) => b,
            _ => {
                return Err(bad(format!(
                    "'logit_bias' value for token id '{key}' must be a number between -100 and \
                     100, got {value}"
                )))
            }
        };
        out.push((id, bias as f32));
    }
    out.sort_unstable_by_key(|e| e.0);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad(format!(
            "'logit_bias' names token id {} more than once",
            w[0].0
        )));
    }
    Ok(out)
}

/// Validate the shared fields into `GenParams`. `max_tokens` is the effective max (already picked
/// from max_tokens / max_completion_tokens); `logprobs` is what the endpoint-specific fields asked;
/// `vocab` bounds the token ids of `logit_bias`.
pub fn validate_common(
    c: &CommonParams,
    max_tokens: Option<i64>,
    max_tokens_name: &str,
    logprobs: Option<LogprobsSpec>,
    preset: &SamplingPreset,
    vocab: usize,
) -> Result<GenParams, ApiError> {
    let max_tokens = match max_tokens {
        None => None,
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(
                format!("'{max_tokens_name}' must be at least 1, got {m}"),
                Some(max_tokens_name),
            ))
        }
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
    };
    let temperature = check_range(c.temperature, "temperature", 0.0, 2.0)?;
    let top_p = match c.top_p {
        Some(p) if !(p.is_finite() && p > 0.0 && p <= 1.0) => {
            return Err(ApiError::invalid(
                format!("'top_p' must be in (0, 1], got {p}"),
                Some("top_p"),
            ))
        }
        v => v,
    };
    let top_k = match c.top_k {
        Some(k) if k < -1 => {
            return Err(ApiError::invalid(
                format!("'top_k' must be -1 or 0 (off) or a positive count, got {k}"),
                Some("top_k"),
            ))
        }
        v => v,
    };
    let min_p = check_range(c.min_p, "min_p", 0.0, 1.0)?;
    let presence = check_range(c.presence_penalty, "presence_penalty", -2.0, 2.0)?;
    let frequency = check_range(c.frequency_penalty, "frequency_penalty", -2.0, 2.0)?;
    let repetition = match c.repetition_penalty {
        Some(r) if !(r.is_finite() && r > 0.0 && r <= 10.0) => {
            return Err(ApiError::invalid(
                format!("'repetition_penalty' must be in (0, 10], got {r}"),
                Some("repetition_penalty"),
            ))
        }
        v => v,
    };
    let n = match c.n {
        None => 1,
        Some(n) if n < 1 || n as usize > MAX_N => {
            return Err(ApiError::invalid(
                format!("'n' must be between 1 and {MAX_N}, got {n}"),
                Some("n"),
            ))
        }
        Some(n) => n as usize,
    };
    let stops = match &c.stop {
        None => Vec::new(),
        Some(StopSpec::One(s)) => vec![s.clone()],
        Some(StopSpec::Many(v)) => v.clone(),
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            format!(
                "at most {MAX_STOPS} stop strings are allowed, got {}",
                stops.len()
            ),
            Some("stop"),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop strings must not be empty",
            Some("stop"),
        ));
    }
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            format!(
                "a stop string may be at most {MAX_STOP_BYTES} bytes, got one of {}",
                long.len()
            ),
            Some("stop"),
        ));
    }
    let logit_bias = parse_logit_bias(c.logit_bias.as_ref(), vocab)?;
    let include_usage = c
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let stream = c.stream.unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "'stream_options' is only allowed when 'stream' is true",
            Some("stream_options"),
        ));
    }

    let seed = match c.seed {
        Some(s) => s as u64,
        None => rand::random::<u64>(),
    };
    let top_k = top_k.or(preset.top_k).unwrap_or(0);
    let sampling = SamplingParams {
        temperature: temperature.or(preset.temperature).unwrap_or(1.0),
        top_k: if top_k <= 0 { 0 } else { top_k as usize },
        top_p: top_p.or(preset.top_p).unwrap_or(1.0),
        min_p: min_p.or(preset.min_p).unwrap_or(0.0),
        repetition_penalty: repetition.or(preset.repetition_penalty).unwrap_or(1.0),
        presence_penalty: presence.unwrap_or(0.0),
        frequency_penalty: frequency.unwrap_or(0.0),
        seed,
        top_logprobs: logprobs.map_or(0, |l| l.top),
        logit_bias,
    };
    Ok(GenParams {
        max_tokens,
        sampling,
        n,
        stops,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stream,
        include_usage,
        logprobs,
        grammar: None,
        tools: None,
        reasoning: None,
        harmony: false,
    })
}

/// Validate a chat request's own fields and the shared ones (`vocab`: the logits row length).
pub fn validate_chat(
    r: &ChatRequest,
    preset: &SamplingPreset,
    vocab: usize,
) -> Result<GenParams, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::invalid(
            "'messages' must not be empty",
            Some("messages"),
        ));
    }
    let logprobs = match (r.logprobs.unwrap_or(false), r.top_logprobs) {
        (_, Some(k)) if k < 0 || k as usize > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                format!("'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                Some("top_logprobs"),
            ))
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::invalid(
                "'top_logprobs' requires 'logprobs': true",
                Some("top_logprobs"),
            ))
        }
        (true, k) => Some(LogprobsSpec {
            top: k.unwrap_or(0) as usize,
        }),
        (false, _) => None,
    };
    let (max, name) = match (r.max_completion_tokens, r.common.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    validate_common(&r.common, max, name, logprobs, preset, vocab)
}

/// Validate a completion request's own fields and the shared ones (`vocab`: the logits row length).
pub fn validate_completion(
    r: &CompletionRequest,
    preset: &SamplingPreset,
    vocab: usize,
) -> Result<GenParams, ApiError> {
    if r.echo.unwrap_or(false) {
        return Err(ApiError::invalid(
            "'echo' is not supported by this server",
            Some("echo"),
        ));
    }
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "'suffix' is not supported by this server",
            Some("suffix"),
        ));
    }
    if let Some(b) = r.best_of {
        if b != 1 && Some(b) != r.common.n {
            return Err(ApiError::invalid(
                "'best_of' other than n is not supported",
                Some("best_of"),
            ));
        }
    }
    let logprobs = match r.logprobs {
        None => None,
        Some(k) if k < 0 || k as usize > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                format!("'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                Some("logprobs"),
            ))
        }
        Some(k) => Some(LogprobsSpec { top: k as usize }),
    };
    validate_common(
        &r.common,
        r.common.max_tokens,
        "max_tokens",
        logprobs,
        preset,
        vocab,
    )
}

/// Check token ids from a client against the vocabulary size.
pub fn check_token_ids(ids: &[i64], vocab: usize, param: &str) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&t| {
            if t < 0 || t as u64 >= vocab as u64 {
                Err(ApiError::invalid(
                    format!("token id {t} in '{param}' is outside the vocabulary (0..{vocab})"),
                    Some(param),
                ))
            } else {
                Ok(t as u32)
            }
        })
        .collect()
}

/// Flatten a message's content into text (text parts joined by newlines).
pub fn message_text(m: &ChatMessageIn, index: usize) -> Result<String, ApiError> {
    match &m.content {
        None => Ok(String::new()),
        Some(MessageContent::Text(s)) => Ok(s.clone()),
        Some(MessageContent::Parts(parts)) => {
            let mut out = Vec::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => out.push(t.as_str()),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            format!("content part of type '{kind}' is not supported (text only)"),
                            Some(&format!("messages[{index}].content")),
                        ))
                    }
                }
            }
            Ok(out.join("\n"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vocabulary size the tests validate against.
    const VOCAB: usize = 1000;

    fn chat(json: &str) -> Result<GenParams, ApiError> {
        let r: ChatRequest = parse_request(json.as_bytes())?;
        validate_chat(&r, &SamplingPreset::default(), VOCAB)
    }

    #[test]
    fn bytes_after_the_json_value_are_a_400() {
        let ok = br#"{"messages":[{"role":"user","content":"x"}]}"#;
        assert!(parse_request::<ChatRequest>(ok).is_ok());
        let mut spaced = ok.to_vec();
        spaced.extend_from_slice(b" \n\t");
        assert!(parse_request::<ChatRequest>(&spaced).is_ok());
        for tail in [&b"x"[..], b"{}", b"\0", br#"{"messages":[]}"#] {
            let mut body = ok.to_vec();
            body.extend_from_slice(tail);
            let e = parse_request::<ChatRequest>(&body).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(
                e.message.contains("more after its JSON value"),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn bad_json_is_400_without_param() {
        let e = parse_request::<ChatRequest>(b"{not json").unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param, None);
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = chat(r#"{"messages":[{"role":"user","content":"hi"}],"temperature":"hot"}"#)
            .unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("temperature"), "{}", e.message);
        let e =
            chat(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":"5"}"#).unwrap_err();
        assert!(e.message.contains("max_tokens"), "{}", e.message);
        let e = parse_request::<ChatRequest>(br#"{"messages":"hi"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn out_of_range_values_are_400() {
        for (field, val) in [
            ("temperature", "3"),
            ("temperature", "-0.1"),
            ("top_p", "0"),
            ("top_p", "1.5"),
            ("min_p", "2"),
            ("presence_penalty", "5"),
            ("frequency_penalty", "-3"),
            ("repetition_penalty", "0"),
            ("n", "0"),
            ("n", "100"),
            ("max_tokens", "0"),
            ("top_k", "-5"),
            ("top_logprobs", "50"),
        ] {
            let body = format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],"logprobs":true,"{field}":{val}}}"#
            );
            let e = chat(&body).unwrap_err();
            assert_eq!(e.status, 400, "{field}={val}");
            assert_eq!(e.param.as_deref(), Some(field), "{field}={val}");
        }
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let p = chat(r#"{"messages":[{"role":"user","content":"hi"}],"frobnicate":1}"#).unwrap();
        assert_eq!(p.n, 1);
    }

    #[test]
    fn presets_fill_unset_fields_only() {
        let preset = SamplingPreset {
            temperature: Some(0.2),
            top_p: Some(0.9),
            top_k: Some(40),
            min_p: None,
            repetition_penalty: Some(1.1),
        };
        let r: ChatRequest = parse_request(
            br#"{"messages":[{"role":"user","content":"x"}],"temperature":0.7,"seed":5}"#,
        )
        .unwrap();
        let p = validate_chat(&r, &preset, VOCAB).unwrap();
        assert_eq!(p.sampling.temperature, 0.7);
        assert_eq!(p.sampling.top_p, 0.9);
        assert_eq!(p.sampling.top_k, 40);
        assert_eq!(p.sampling.min_p, 0.0);
        assert_eq!(p.sampling.repetition_penalty, 1.1);
        assert_eq!(p.sampling.seed, 5);
        let r: ChatRequest =
            parse_request(br#"{"messages":[{"role":"user","content":"x"}]}"#).unwrap();
        let p = validate_chat(&r, &SamplingPreset::default(), VOCAB).unwrap();
        assert_eq!(
            p.sampling.temperature, 1.0,
            "OpenAI default without a preset"
        );
    }

    #[test]
    fn stop_string_or_list_and_max_completion_tokens() {
        let p = chat(r#"{"messages":[{"role":"user","content":"x"}],"stop":"\n","max_completion_tokens":7,"max_tokens":3}"#)
            .unwrap();
        assert_eq!(p.stops, vec!["\n"]);
        assert_eq!(p.max_tokens, Some(7));
        let p = chat(r#"{"messages":[{"role":"user","content":"x"}],"stop":["a","b"]}"#).unwrap();
        assert_eq!(p.stops, vec!["a", "b"]);
        assert!(chat(r#"{"messages":[{"role":"user","content":"x"}],"stop":[""]}"#).is_err());
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"x"}}],"stop":["{}"]}}"#,
            "s".repeat(MAX_STOP_BYTES + 1)
        );
        assert!(chat(&long)
            .unwrap_err()
            .message
            .contains("at most 256 bytes"));
    }

    #[test]
    fn logprobs_forms() {
        let p = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":3}"#,
        )
        .unwrap();
        assert_eq!(p.logprobs, Some(LogprobsSpec { top: 3 }));
        assert_eq!(p.sampling.top_logprobs, 3);
        assert!(chat(r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":3}"#).is_err());
        let r: CompletionRequest = parse_request(br#"{"prompt":"x","logprobs":2}"#).unwrap();
        assert_eq!(
            validate_completion(&r, &SamplingPreset::default(), VOCAB)
                .unwrap()
                .logprobs,
            Some(LogprobsSpec { top: 2 })
        );
    }

    #[test]
    fn prompt_forms() {
        let r: CompletionRequest = parse_request(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(r.prompt, PromptSpec::Tokens(ref v) if v == &[1, 2, 3]));
        let r: CompletionRequest = parse_request(br#"{"prompt":"hi"}"#).unwrap();
        assert!(matches!(r.prompt, PromptSpec::Text(_)));
        let r: CompletionRequest = parse_request(br#"{"prompt":[[1],[2]]}"#).unwrap();
        assert!(matches!(r.prompt, PromptSpec::TokenLists(_)));
        assert!(parse_request::<CompletionRequest>(br#"{"prompt":{"a":1}}"#).is_err());
        assert_eq!(check_token_ids(&[1, 5], 10, "prompt").unwrap(), vec![1, 5]);
        assert_eq!(
            check_token_ids(&[10], 10, "prompt").unwrap_err().status,
            400
        );
        assert_eq!(
            check_token_ids(&[-1], 10, "prompt").unwrap_err().status,
            400
        );
    }

    #[test]
    fn logit_bias_is_parsed_sorted_and_checked() {
        let p = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"17":-100,"3":2.5,"999":100}}"#,
        )
        .unwrap();
        assert_eq!(
            p.sampling.logit_bias,
            vec![(3, 2.5), (17, -100.0), (999, 100.0)]
        );
        for none in [r#""#, r#","logit_bias":null"#, r#","logit_bias":{}"#] {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}]{none}}}"#);
            assert!(
                chat(&body).unwrap().sampling.logit_bias.is_empty(),
                "{body}"
            );
        }
        let r: CompletionRequest =
            parse_request(br#"{"prompt":"x","logit_bias":{"5":-1}}"#).unwrap();
        let p = validate_completion(&r, &SamplingPreset::default(), VOCAB).unwrap();
        assert_eq!(p.sampling.logit_bias, vec![(5, -1.0)]);

        let many: Vec<String> = (0..=MAX_LOGIT_BIAS)
            .map(|i| format!(r#""{i}":1"#))
            .collect();
        let many = format!("{{{}}}", many.join(","));
        for (bias, says) in [
            (r#"{"abc":1}"#, "'abc'"),
            (r#"{"-1":1}"#, "'-1'"),
            (r#"{"1.5":1}"#, "'1.5'"),
            (r#"{"":1}"#, "''"),
            (r#"{"1000":1}"#, "'1000'"),
            (r#"{"99999999999999999999999":1}"#, "vocabulary"),
            (r#"{"1":1000}"#, "1000"),
            (r#"{"1":-100.5}"#, "-100.5"),
            (r#"{"1":"5"}"#, "\"5\""),
            (r#"{"1":null}"#, "null"),
            (r#"{"1":2,"01":3}"#, "token id 1 more than once"),
            (r#"[1,2]"#, "object"),
            (r#""5""#, "object"),
            (many.as_str(), "at most 1024"),
        ] {
            let body =
                format!(r#"{{"messages":[{{"role":"user","content":"x"}}],"logit_bias":{bias}}}"#);
            let e = chat(&body).unwrap_err();
            assert_eq!(e.status, 400, "{bias}");
            assert_eq!(e.param.as_deref(), Some("logit_bias"), "{bias}");
            assert!(e.message.contains("logit_bias"), "{}", e.message);
            assert!(e.message.contains(says), "{bias}: {}", e.message);
        }
    }

    #[test]
    fn stream_options_need_stream() {
        assert!(chat(r#"{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#).is_err());
        let p = chat(r#"{"messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true}}"#)
            .unwrap();
        assert!(p.stream && p.include_usage);
    }

    #[test]
    fn content_parts() {
        let r: ChatRequest = parse_request(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(message_text(&r.messages[0], 0).unwrap(), "a\nb");
        let r: ChatRequest = parse_body(
            br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#,
        )
        .unwrap();
        assert_eq!(message_text(&r.messages[0], 0).unwrap_err().status, 400);
    }
}
