//! From a request body to a [`Job`]: parse and validate it, render the chat template, tokenize. This
//! is the blocking, CPU-heavy part of a request; the routes run it on the [`crate::pool::Pool`].
//!
//! Every step is bounded before it is paid for:
//! - memory: the caller's [`Reservation`] grows by the step's worst case first (parsing:
//!   [`parse_worst_case`] of the body; rendering: [`RENDER_BYTES_PER_CAP_BYTE`]; tokenizing:
//!   [`TOKENIZE_BYTES_PER_BYTE`] of the text), and a step that does not fit is refused;
//! - prompt size: a text longer than `ctx_size` x the longest token's bytes cannot fit the context,
//!   so it is refused from its length, before tokenizing (`context_length_exceeded`); so are
//!   messages whose text together is longer, before rendering;
//! - templates: rendering runs under the template's fuel and an output cap equal to that byte cap;
//!   a conversation with more messages than the context has tokens is refused before rendering.

use metrale_model::{ChatMessage, ChatTemplate, RenderError, Tokenizer};

use crate::api::{
    self, ChatRequest, CompletionRequest, DetokenizeRequest, PromptSpec, SamplingPreset,
    TokenizeRequest,
};
use crate::budget::{parse_worst_case, Reservation, TOKENIZE_BYTES_PER_BYTE};
use crate::error::ApiError;
use crate::sse::Kind;

/// Heap of rendering a conversation whose text fits the prompt byte cap, per byte of that cap: the
/// template's copy of the messages, the concatenations templates do on a message (`'<|im_start|>'
/// + role + '\n' + content`, one new string each) and the output's growth by doubling.
pub const RENDER_BYTES_PER_CAP_BYTE: u64 = 8;

/// A validated request ready to run: prompts (each run `params.n` times) and settings; what the
/// generation endpoints' preparation hands to `generate`.
pub struct Job {
    pub kind: Kind,
    pub prompts: Vec<Vec<u32>>,
    pub params: api::GenParams,
    /// A Responses request's fields its response repeats (`Kind::Responses`).
    pub responses: Option<std::sync::Arc<crate::responses::Echo>>,
}

/// What preparing a request needs from the served model.
/// A prepared /v1/embeddings request (`crate::embeddings` submits and answers it).
#[derive(Debug)]
pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub pooling: metrale_backend::Pooling,
    /// `encoding_format: "base64"`: each vector as its little-endian f32 bytes in base64.
    pub base64: bool,
}

pub struct Prep<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a ChatTemplate>,
    pub chat_preset: &'a SamplingPreset,
    pub completion_preset: &'a SamplingPreset,
    /// Logits row length (token ids from clients must be below it).
    pub vocab: usize,
    /// Tokens one sequence holds.
    pub ctx_size: usize,
    /// The structured-output grammars' factory.
    pub grammars: Option<&'a crate::grammar::Grammars>,
    /// The syntax this target's model writes tool calls in.
    pub tool_format: crate::tools::ToolFormat,
    /// `--embeddings`: how /v1/embeddings pools (`None`: the endpoint is off).
    pub embeddings: Option<metrale_backend::Pooling>,
    /// Length of the model's hidden state (an embedding's dimensions).
    pub hidden: usize,
    /// `--reasoning-format`, resolved against the template.
    pub reasoning: crate::reasoning::Format,
}

/// Compile the request's structured-output constraint, if it asks for one (a 400 names the field
/// when it cannot be compiled, or when this server has no grammar support).
fn compile_grammar(
    p: &Prep,
    fields: &crate::grammar::GrammarFields,
) -> Result<Option<crate::grammar::Compiled>, ApiError> {
    let Some((g, param)) = fields.grammar()? else {
        return Ok(None);
    };
    let grammars = p.grammars.ok_or_else(|| {
        ApiError::invalid(
            "structured output is unavailable: this server could not build its grammar tables at start-up (see its log)",
            Some(param),
        )
    })?;
    grammars.compile(g, param).map(Some)
}

impl Prep<'_> {
    /// The longest prompt text that can fit the context: `ctx_size` tokens of the longest token.
    pub fn prompt_byte_cap(&self) -> usize {
        prompt_byte_cap(self.tokenizer, self.ctx_size)
    }
}

/// One of the preparing functions, by endpoint (for callers that pick one at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Chat,
    Responses,
    Completion,
    Embeddings,
    Tokenize,
    Detokenize,
}

impl Step {
    /// Run the step; `Ok(())` when it prepared the request.
    pub fn run(self, p: &Prep, body: &[u8], res: &mut Reservation) -> Result<(), ApiError> {
        match self {
            Step::Chat => chat(p, body, res).map(drop),
            Step::Responses => responses(p, body, res).map(drop),
            Step::Completion => completion(p, body, res).map(drop),
            Step::Embeddings => embeddings(p, body, res).map(drop),
            Step::Tokenize => tokenize(p, body, res).map(drop),
            Step::Detokenize => detokenize(p, body, res).map(drop),
        }
    }
}

/// `ctx_size` x the most bytes one token stands for.
pub fn prompt_byte_cap(tk: &Tokenizer, ctx_size: usize) -> usize {
    ctx_size.saturating_mul(tk.max_token_bytes())
}

/// The 400 for a text that is too long to fit the context whatever it tokenizes to.
fn too_many_bytes(p: &Prep, bytes: usize, param: &str) -> ApiError {
    ApiError::invalid_code(
        format!(
            "the prompt is {bytes} bytes: more than this model's context of {} tokens can hold (no token \
             stands for more than {} bytes, so at most {} bytes fit); shorten the prompt",
            p.ctx_size,
            p.tokenizer.max_token_bytes(),
            p.prompt_byte_cap()
        ),
        Some(param),
        "context_length_exceeded",
    )
}

fn reserve_parse(res: &mut Reservation, body: &[u8]) -> Result<(), ApiError> {
    res.grow(
        parse_worst_case(body),
        &format!("to parse its {} byte body", body.len()),
    )
}

/// Tokenize a prompt text after checking it can fit and reserving its worst case.
fn encode_prompt(
    p: &Prep,
    res: &mut Reservation,
    text: &str,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    if text.len() > p.prompt_byte_cap() {
        return Err(too_many_bytes(p, text.len(), param));
    }
    let held = res.bytes();
    res.grow(
        text.len() as u64 * TOKENIZE_BYTES_PER_BYTE,
        &format!("to tokenize a {} byte prompt", text.len()),
    )?;
    let tk = p.tokenizer;
    // A template that already wrote the BOS text gets no second BOS.
    let bos_written = tk
        .bos()
        .and_then(|b| tk.token_text(b))
        .is_some_and(|t| !t.is_empty() && text.starts_with(&t));
    let ids = tk
        .encode(text, tk.add_bos() && !bos_written, true)
        .map_err(|e| ApiError::invalid(format!("cannot tokenize '{param}': {e}"), Some(param)));
    res.shrink_to(held);
    ids
}

/// POST /v1/chat/completions.
pub fn chat(p: &Prep, body: &[u8], res: &mut Reservation) -> Result<Job, ApiError> {
    reserve_parse(res, body)?;
    let mut r: ChatRequest = api::parse_request(body)?;
    let mut params = api::validate_chat(&r, p.chat_preset, p.vocab)?;
    params.grammar = compile_grammar(p, &r.common.grammar)?;
    let tools = crate::tools::Tools::from_request(
        r.tools.as_ref(),
        r.tool_choice.as_ref(),
        r.parallel_tool_calls,
        p.tool_format,
    )?;
    // a forced choice writes its call in the output's syntax: harmony's message, or the target's
    let forcing = match p.reasoning {
        crate::reasoning::Format::Harmony => tools.as_ref().and_then(|t| t.harmony_grammar()),
        _ => tools.as_ref().and_then(|t| t.grammar()),
    };
    if let Some(g) = forcing {
        if params.grammar.is_some() {
            return Err(ApiError::invalid(
                "a required or named tool_choice cannot be combined with a structured-output constraint",
                Some("tool_choice"),
            ));
        }
        let grammars = p.grammars.ok_or_else(|| {
            ApiError::invalid(
                "tool_choice required or named is unavailable: this server could not build its grammar tables",
                Some("tool_choice"),
            )
        })?;
        params.grammar = Some(grammars.compile(g, "tool_choice")?);
    }
    params.tools = tools.map(std::sync::Arc::new);
    let template = p.template.ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template; use /v1/completions, or restart the server with \
             --chat-template FILE",
            Some("messages"),
        )
    })?;
    if r.messages.len() > p.ctx_size {
        return Err(ApiError::invalid_code(
            format!(
                "{} messages cannot fit this model's context of {} tokens; send fewer messages",
                r.messages.len(),
                p.ctx_size
            ),
            Some("messages"),
            "context_length_exceeded",
        ));
    }
    let mut msgs = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "developer" => "system",
            "system" | "user" | "assistant" | "tool" => m.role.as_str(),
            other => {
                return Err(ApiError::invalid(
                    format!(
                    "unknown role '{other}' (expected system, developer, user, assistant or tool)"
                ),
                    Some(&format!("messages[{i}].role")),
                ))
            }
        };
        let mut msg = ChatMessage::new(role, api::message_text(m, i)?);
        if let Some(calls) = &m.tool_calls {
            let pairs: Vec<(String, String)> = calls
                .iter()
                .map(|c| {
                    let args = match &c.function.arguments {
                        Some(serde_json::Value::String(s)) => s.clone(),
                        Some(v) => v.to_string(),
                        None => "{}".into(),
                    };
                    (c.function.name.clone(), args)
                })
                .collect();
            msg.tool_calls = Some(serde_json::Value::Array(
                calls
                    .iter()
                    .zip(&pairs)
                    .enumerate()
                    .map(|(k, (c, (n, a)))| {
                        serde_json::json!({"id": c.id.clone().unwrap_or_else(|| format!("call_{i}_{k}")),
                                           "type": "function", "function": {"name": n, "arguments": a}})
                    })
                    .collect(),
            ));
            // for templates that read only `content`: the calls as the model writes them
            if msg.content.is_empty() {
                msg.content = p.tool_format.render(&pairs);
            }
        }
        msg.tool_call_id = m.tool_call_id.clone();
        msg.name = m.name.clone();
        msgs.push(msg);
    }
    let tools_value = params.tools.as_ref().map(|t| t.template_value());
    let kwargs = match r.chat_template_kwargs.take() {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Object(m)) => Some(m),
        Some(other) => {
            return Err(ApiError::invalid(
                format!(
                    "'chat_template_kwargs' must be an object of template variables (e.g. {{\"enable_thinking\": false}}), got {other}"
                ),
                Some("chat_template_kwargs"),
            ))
        }
    };
    drop(r);
    // Every message's text is part of the prompt, so together they must fit before rendering
    // (rendering copies and concatenates them, whatever the output cap).
    let cap = p.prompt_byte_cap();
    let text_bytes: usize = msgs.iter().map(|m| m.content.len() + m.role.len()).sum();
    if text_bytes > cap {
        return Err(too_many_bytes(p, text_bytes, "messages"));
    }
    res.grow(
        cap as u64 * RENDER_BYTES_PER_CAP_BYTE,
        "to render the chat template",
    )?;
    let text = template
        .render_with_kwargs(&msgs, tools_value.as_ref(), kwargs.as_ref(), true)
        .map_err(|e| match e {
        RenderError::TooLong { .. } => ApiError::invalid_code(
            format!(
                "the rendered conversation is more than {cap} bytes: more than this model's context of {} \
                 tokens can hold; shorten the messages",
                p.ctx_size
            ),
            Some("messages"),
            "context_length_exceeded",
        ),
        RenderError::OutOfFuel { fuel } => ApiError::invalid(
            format!(
                "the chat template ran past its limit of {fuel} instructions on these {} messages; send \
                 fewer messages",
                msgs.len()
            ),
            Some("messages"),
        ),
        RenderError::Template(m) => ApiError::invalid(
            format!("the chat template failed on these messages: {m}"),
            Some("messages"),
        ),
    })?;
    drop(msgs);
    // a template that opened the thought (DeepSeek-R1's `<think>\n` after the assistant header)
    params.reasoning = (p.reasoning == crate::reasoning::Format::Deepseek)
        .then(|| text.trim_end().ends_with("<think>"));
    params.harmony = p.reasoning == crate::reasoning::Format::Harmony;
    let prompt = encode_prompt(p, res, &text, "messages")?;
    Ok(Job {
        kind: Kind::Chat,
        prompts: vec![prompt],
        params,
        responses: None,
    })
}

/// POST /v1/responses: the request as the chat request it asks for (`crate::responses::to_chat`),
/// prepared as one; errors of the chat steps name the Responses fields they came from.
pub fn responses(p: &Prep, body: &[u8], res: &mut Reservation) -> Result<Job, ApiError> {
    reserve_parse(res, body)?;
    api::require_object(body)?;
    let r: serde_json::Map<String, serde_json::Value> = api::parse_body(body)?;
    // the chat request is a second tree of about the body's values, then its text
    reserve_parse(res, body)?;
    res.grow(body.len() as u64, "to write its chat request")?;
    let (chat_req, echo) = crate::responses::to_chat(&r)?;
    drop(r);
    let chat_body = serde_json::to_vec(&chat_req)
        .map_err(|e| ApiError::internal(format!("cannot serialize the chat request: {e}")))?;
    drop(chat_req);
    let mut job = chat(p, &chat_body, res).map_err(crate::responses::rename_param)?;
    job.kind = Kind::Responses;
    job.responses = Some(std::sync::Arc::new(echo));
    Ok(job)
}

/// POST /v1/completions.
pub fn completion(p: &Prep, body: &[u8], res: &mut Reservation) -> Result<Job, ApiError> {
    reserve_parse(res, body)?;
    let r: CompletionRequest = api::parse_request(body)?;
    let mut params = api::validate_completion(&r, p.completion_preset, p.vocab)?;
    params.grammar = compile_grammar(p, &r.common.grammar)?;
    let n_prompts = match &r.prompt {
        PromptSpec::Texts(ts) => ts.len(),
        PromptSpec::TokenLists(l) => l.len(),
        _ => 1,
    };
    if n_prompts == 0 {
        return Err(ApiError::invalid(
            "'prompt' must not be an empty list",
            Some("prompt"),
        ));
    }
    if n_prompts * params.n > api::MAX_N {
        return Err(ApiError::invalid(
            format!(
                "at most {} choices per request (prompts x n), got {}",
                api::MAX_N,
                n_prompts * params.n
            ),
            Some("prompt"),
        ));
    }
    // Check every text's length before tokenizing any (`encode_prompt` checks one at a time).
    let texts: &[String] = match &r.prompt {
        PromptSpec::Text(t) => std::slice::from_ref(t),
        PromptSpec::Texts(ts) => ts,
        PromptSpec::Tokens(_) | PromptSpec::TokenLists(_) => &[],
    };
    if let Some(t) = texts.iter().find(|t| t.len() > p.prompt_byte_cap()) {
        return Err(too_many_bytes(p, t.len(), "prompt"));
    }
    let prompts = match &r.prompt {
        PromptSpec::Text(t) => vec![encode_prompt(p, res, t, "prompt")?],
        PromptSpec::Texts(ts) => ts
            .iter()
            .map(|t| encode_prompt(p, res, t, "prompt"))
            .collect::<Result<_, _>>()?,
        PromptSpec::Tokens(ids) => vec![api::check_token_ids(ids, p.vocab, "prompt")?],
        PromptSpec::TokenLists(l) => l
            .iter()
            .map(|ids| api::check_token_ids(ids, p.vocab, "prompt"))
            .collect::<Result<_, _>>()?,
    };
    Ok(Job {
        kind: Kind::Completion,
        prompts,
        params,
        responses: None,
    })
}

/// POST /v1/embeddings: the inputs as token ids, each checked against the context, and the
/// encoding asked for (`crate::embeddings` submits and answers).
pub fn embeddings(p: &Prep, body: &[u8], res: &mut Reservation) -> Result<EmbedJob, ApiError> {
    let Some(pooling) = p.embeddings else {
        return Err(ApiError::invalid(
            "this server does not compute embeddings: start it with --embeddings (and --pooling mean|last)",
            None,
        ));
    };
    reserve_parse(res, body)?;
    let r: api::EmbeddingsRequest = api::parse_body(body)?;
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(o) => {
            return Err(ApiError::invalid(
                format!("'encoding_format' must be \"float\" or \"base64\", not {o:?}"),
                Some("encoding_format"),
            ))
        }
    };
    if let Some(d) = r.dimensions {
        if d != p.hidden as i64 {
            return Err(ApiError::invalid(
                format!(
                    "'dimensions' {d} is not supported: this model's embeddings have {} dimensions (its \
                     hidden size); leave 'dimensions' out",
                    p.hidden
                ),
                Some("dimensions"),
            ));
        }
    }
    let texts: &[String] = match &r.input {
        PromptSpec::Text(t) => std::slice::from_ref(t),
        PromptSpec::Texts(ts) => ts,
        PromptSpec::Tokens(_) | PromptSpec::TokenLists(_) => &[],
    };
    if let Some(t) = texts.iter().find(|t| t.len() > p.prompt_byte_cap()) {
        return Err(too_many_bytes(p, t.len(), "input"));
    }
    // each text's ids are kept while the next is tokenized: reserve them (up to 2,048 inputs)
    let mut encode_kept = |t: &str| -> Result<Vec<u32>, ApiError> {
        let ids = encode_prompt(p, res, t, "input")?;
        res.grow(
            (ids.capacity() * 4 + 24) as u64,
            &format!("to keep an input's {} tokens", ids.len()),
        )?;
        Ok(ids)
    };
    let inputs: Vec<Vec<u32>> = match &r.input {
        PromptSpec::Text(t) => vec![encode_kept(t)?],
        PromptSpec::Texts(ts) => ts
            .iter()
            .map(|t| encode_kept(t))
            .collect::<Result<_, _>>()?,
        PromptSpec::Tokens(ids) => vec![api::check_token_ids(ids, p.vocab, "input")?],
        PromptSpec::TokenLists(l) => l
            .iter()
            .map(|ids| api::check_token_ids(ids, p.vocab, "input"))
            .collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid(
            "'input' must not be an empty list",
            Some("input"),
        ));
    }
    if inputs.len() > api::MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            format!(
                "'input' has {} items; at most {} per request",
                inputs.len(),
                api::MAX_EMBEDDING_INPUTS
            ),
            Some("input"),
        ));
    }
    for (i, ids) in inputs.iter().enumerate() {
        if ids.is_empty() {
            return Err(ApiError::invalid(
                format!("'input' item {i} is empty (0 tokens)"),
                Some("input"),
            ));
        }
        if ids.len() > p.ctx_size {
            return Err(ApiError::invalid_code(
                format!(
                    "'input' item {i} has {} tokens but this model's context holds {}; shorten it, or \
                     restart the server with a larger --ctx-size",
                    ids.len(),
                    p.ctx_size
                ),
                Some("input"),
                "context_length_exceeded",
            ));
        }
    }
    Ok(EmbedJob {
        inputs,
        pooling,
        base64,
    })
}

/// POST /tokenize: the response body `{"tokens": [...]}` with the ids of `content` (at most the
/// prompt byte cap). The body is serialized here, on the pool: at the cap it is megabytes of JSON,
/// tens of milliseconds of CPU that must not run on an async worker.
pub fn tokenize(p: &Prep, body: &[u8], res: &mut Reservation) -> Result<Vec<u8>, ApiError> {
    reserve_parse(res, body)?;
    let r: TokenizeRequest = api::parse_body(body)?;
    let cap = p.prompt_byte_cap();
    if r.content.len() > cap {
        return Err(ApiError::invalid(
            format!(
                "'content' is {} bytes; /tokenize takes at most {cap} bytes (the most this model's context \
                 of {} tokens can hold)",
                r.content.len(),
                p.ctx_size
            ),
            Some("content"),
        ));
    }
    res.grow(
        r.content.len() as u64 * TOKENIZE_BYTES_PER_BYTE,
        &format!("to tokenize {} bytes", r.content.len()),
    )?;
    let tk = p.tokenizer;
    let tokens = tk
        .encode(&r.content, r.add_special && tk.add_bos(), true)
        .map_err(|e| {
            ApiError::invalid(format!("cannot tokenize 'content': {e}"), Some("content"))
        })?;
    drop(r);
    #[derive(serde::Serialize)]
    struct Tokens {
        tokens: Vec<u32>,
    }
    response_json(&Tokens { tokens })
}

fn response_json(v: &impl serde::Serialize) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(v)
        .map_err(|e| ApiError::internal(format!("cannot serialize the response: {e}")))
}

/// POST /detokenize: the response body `{"content": "..."}` with the text of `tokens`, serialized
/// on the pool like [`tokenize`]'s.
pub fn detokenize(p: &Prep, body: &[u8], res: &mut Reservation) -> Result<Vec<u8>, ApiError> {
    reserve_parse(res, body)?;
    let r: DetokenizeRequest = api::parse_body(body)?;
    let ids = api::check_token_ids(&r.tokens, p.vocab, "tokens")?;
    drop(r);
    // The bytes, their growth by doubling, and the lossy UTF-8 copy (up to 3 bytes per byte).
    let bytes: usize = ids
        .iter()
        .map(|&id| p.tokenizer.token_bytes_ref(id).len())
        .sum();
    res.grow(
        bytes as u64 * 8,
        &format!("to detokenize {} ids", ids.len()),
    )?;
    let content = p.tokenizer.decode(&ids, false);
    drop(ids);
    #[derive(serde::Serialize)]
    struct Content {
        content: String,
    }
    response_json(&Content { content })
}
