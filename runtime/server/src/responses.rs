//! The OpenAI Responses API (`POST /v1/responses`) on the chat pipeline.
//!
//! A request becomes a chat request ([`to_chat`]): `instructions` and the `input` items become
//! messages (function calls and their outputs as assistant `tool_calls` and `tool` messages),
//! `max_output_tokens` becomes `max_tokens`, `text.format` becomes `response_format`, function tools
//! become chat tools. So it is validated, bounded, rendered, constrained and generated exactly as a
//! chat request is. The answer is written as a response object ([`Echo::response`]) or as the
//! typed stream events ([`Events`]): `response.created`, `response.in_progress`, then per output
//! item `response.output_item.added`, its content part or arguments deltas, their `done` events
//! and `response.output_item.done`, then `response.completed` (or `response.incomplete` when
//! `max_output_tokens` cut the answer). Where the chat text is split into thought and content
//! (`crate::reasoning`), the thought is a `reasoning` item (one `reasoning_text` part, no summary)
//! before the message, streamed as `response.reasoning_text.delta` events.
//!
//! Invariants: nothing is stored, so `store: true` and `previous_response_id` are refused with a
//! 400 saying to send the whole conversation; every item a stream adds is done before the
//! stream's last event; a response's items take ids derived from the response id, so the stream's
//! items and the final response's agree.

use axum::body::Bytes;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::sse::{Header, Usage};
use crate::tools::{Call, ToolEvent};

/// The request fields a response object repeats (OpenAI echoes them; clients read them back).
#[derive(Debug, Clone)]
pub struct Echo {
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: Value,
    text: Value,
    metadata: Value,
    user: Value,
}

/// The chat-request fields a Responses request may carry under the same name (sampling and the
/// vendor extensions the chat endpoint takes).
const SAME_NAME: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "logit_bias",
    "user",
    "stream",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
];

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// The text of a message's `content`: a string, or a list of text parts (`input_text`,
/// `output_text`, `text`), joined.
fn content_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, part) in parts.iter().enumerate() {
                let p = format!("{param}[{j}]");
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match kind {
                    "input_text" | "output_text" | "text" => match part.get("text") {
                        Some(Value::String(t)) => out.push_str(t),
                        _ => return Err(bad(format!("'{p}.text' must be a string"), &p)),
                    },
                    other => {
                        return Err(bad(
                            format!(
                                "content part type {other:?} is not served: only text parts (input_text, output_text) are"
                            ),
                            &format!("{p}.type"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(
            format!("'{param}' must be a string or a list of text parts"),
            param,
        )),
    }
}

fn str_field<'a>(item: &'a Value, key: &str, param: &str) -> Result<&'a str, ApiError> {
    item.get(key).and_then(Value::as_str).ok_or_else(|| {
        bad(
            format!("'{param}.{key}' must be a string"),
            &format!("{param}.{key}"),
        )
    })
}

/// `instructions` and `input` as chat messages.
fn messages(r: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    match r.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(bad("'instructions' must be a string", "instructions")),
    }
    match r.get("input") {
        Some(Value::String(s)) => out.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let param = format!("input[{i}]");
                if !item.is_object() {
                    return Err(bad(format!("'{param}' must be an object"), &param));
                }
                let kind = match item.get("type") {
                    None | Some(Value::Null) => "message",
                    Some(Value::String(s)) => s.as_str(),
                    Some(_) => {
                        return Err(bad(
                            format!("'{param}.type' must be a string"),
                            &format!("{param}.type"),
                        ))
                    }
                };
                match kind {
                    "message" => {
                        let role = str_field(item, "role", &param)?;
                        let role = match role {
                            "user" | "assistant" | "system" | "developer" => role,
                            other => {
                                return Err(bad(
                                    format!("unknown role {other:?} (expected user, assistant, system or developer)"),
                                    &format!("{param}.role"),
                                ))
                            }
                        };
                        let content = item.get("content").ok_or_else(|| {
                            bad(
                                format!("'{param}.content' is missing"),
                                &format!("{param}.content"),
                            )
                        })?;
                        let text = content_text(content, &format!("{param}.content"))?;
                        out.push(json!({"role": role, "content": text}));
                    }
                    "function_call" => {
                        let call = json!({
                            "id": str_field(item, "call_id", &param)?,
                            "type": "function",
                            "function": {
                                "name": str_field(item, "name", &param)?,
                                "arguments": str_field(item, "arguments", &param)?,
                            },
                        });
                        // consecutive calls are one assistant turn
                        match out.last_mut() {
                            Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                                m["tool_calls"].as_array_mut().expect("checked").push(call);
                            }
                            _ => out.push(
                                json!({"role": "assistant", "content": null, "tool_calls": [call]}),
                            ),
                        }
                    }
                    "function_call_output" => {
                        let call_id = str_field(item, "call_id", &param)?;
                        let output = item.get("output").ok_or_else(|| {
                            bad(
                                format!("'{param}.output' is missing"),
                                &format!("{param}.output"),
                            )
                        })?;
                        let text = content_text(output, &format!("{param}.output"))?;
                        out.push(json!({"role": "tool", "tool_call_id": call_id, "content": text}));
                    }
                    // a reasoning item from an earlier response: a model never reads its earlier
                    // reasoning back (thinking models' chat templates drop it)
                    "reasoning" => {}
                    "item_reference" => {
                        return Err(bad(
                            "item references need stored responses, and this server stores none: send the item itself",
                            &format!("{param}.type"),
                        ))
                    }
                    other => {
                        return Err(bad(
                            format!(
                                "input item type {other:?} is not served (message, function_call, function_call_output and reasoning are)"
                            ),
                            &format!("{param}.type"),
                        ))
                    }
                }
            }
        }
        None | Some(Value::Null) => {
            return Err(bad(
                "'input' is required: a string, or a list of input items",
                "input",
            ))
        }
        Some(_) => {
            return Err(bad(
                "'input' must be a string or a list of input items",
                "input",
            ))
        }
    }
    if out.is_empty() {
        return Err(bad("'input' has no message to answer", "input"));
    }
    Ok(out)
}

/// `text.format` as the chat endpoint's `response_format` (`None`: plain text).
fn response_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(text) = text.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    if !text.is_object() {
        return Err(bad("'text' must be an object", "text"));
    }
    let Some(f) = text.get("format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let schema = f.get("schema").filter(|s| s.is_object()).ok_or_else(|| {
                bad(
                    "text.format json_schema needs a 'schema' object",
                    "text.format.schema",
                )
            })?;
            let mut js = json!({
                "name": f.get("name").and_then(Value::as_str).unwrap_or("response"),
                "schema": schema,
            });
            if let Some(strict) = f.get("strict").filter(|v| !v.is_null()) {
                js["strict"] = strict.clone();
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        other => Err(bad(
            format!("text.format type {other:?} is not one of text, json_object, json_schema"),
            "text.format.type",
        )),
    }
}

/// Function tools as chat tools.
fn tools(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| bad("'tools' must be a list", "tools"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            other => {
                return Err(bad(
                    format!("tool type {other:?} is not served: only function tools are"),
                    &format!("{param}.type"),
                ))
            }
        }
        let mut f = json!({"name": str_field(t, "name", &param)?});
        for key in ["description", "parameters", "strict"] {
            if let Some(x) = t.get(key).filter(|x| !x.is_null()) {
                f[key] = x.clone();
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Some(Value::Array(out)))
}

/// `tool_choice`: `auto`, `none`, `required`, or `{"type": "function", "name": ...}`.
fn tool_choice(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(_)) => Ok(v.cloned()),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                bad(
                    "tool_choice {\"type\": \"function\"} needs a 'name'",
                    "tool_choice.name",
                )
            })?;
            Ok(Some(
                json!({"type": "function", "function": {"name": name}}),
            ))
        }
        Some(_) => Err(bad(
            "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
            "tool_choice",
        )),
    }
}

/// Refuse what a response of this server cannot honour, naming the field and what to do instead.
fn refuse_unserved(r: &Map<String, Value>) -> Result<(), ApiError> {
    let set = |k: &str| r.get(k).filter(|v| !v.is_null());
    if set("previous_response_id").is_some() {
        return Err(bad(
            "previous_response_id needs stored responses, and this server stores none: send the whole conversation in 'input'",
            "previous_response_id",
        ));
    }
    if set("conversation").is_some() {
        return Err(bad(
            "conversations need stored state, and this server stores none: send the whole conversation in 'input'",
            "conversation",
        ));
    }
    if set("store") == Some(&Value::Bool(true)) {
        return Err(bad(
            "this server stores no responses: send store: false (or leave it out)",
            "store",
        ));
    }
    if set("background") == Some(&Value::Bool(true)) {
        return Err(bad(
            "background responses are not served: send background: false and read the answer (or stream it)",
            "background",
        ));
    }
    if let Some(reasoning) = set("reasoning") {
        let effort = reasoning.get("effort").filter(|v| !v.is_null());
        if effort.is_some() || reasoning.get("summary").is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "this server's model does not reason: leave 'reasoning' out",
                "reasoning",
            ));
        }
    }
    if let Some(include) = set("include") {
        if include.as_array().is_none_or(|a| !a.is_empty()) {
            return Err(bad(
                "'include' is not served: leave it out (the output text and function calls always come)",
                "include",
            ));
        }
    }
    if let Some(t) = set("truncation") {
        if t != "disabled" {
            return Err(bad(
                "only truncation \"disabled\" is served: a conversation longer than the context is a 400",
                "truncation",
            ));
        }
    }
    if set("top_logprobs").is_some_and(|v| v.as_i64() != Some(0)) {
        return Err(bad(
            "logprobs are not served on /v1/responses: use /v1/chat/completions with logprobs",
            "top_logprobs",
        ));
    }
    Ok(())
}

/// A Responses request as the chat request it asks for, and what its response repeats. The body
/// was checked to be a JSON object by the caller's parse.
pub fn to_chat(r: &Map<String, Value>) -> Result<(Value, Echo), ApiError> {
    refuse_unserved(r)?;
    let mut chat = Map::new();
    for k in SAME_NAME {
        if let Some(v) = r.get(*k) {
            chat.insert((*k).into(), v.clone());
        }
    }
    chat.insert("messages".into(), Value::Array(messages(r)?));
    if let Some(m) = r.get("max_output_tokens").filter(|v| !v.is_null()) {
        if m.as_i64().is_none_or(|n| n < 1) {
            return Err(bad(
                format!("'max_output_tokens' must be a positive integer, got {m}"),
                "max_output_tokens",
            ));
        }
        chat.insert("max_tokens".into(), m.clone());
    }
    if let Some(f) = response_format(r.get("text"))? {
        chat.insert("response_format".into(), f);
    }
    let tools_in = tools(r.get("tools"))?;
    if let Some(t) = &tools_in {
        chat.insert("tools".into(), t.clone());
    }
    if let Some(c) = tool_choice(r.get("tool_choice"))? {
        chat.insert("tool_choice".into(), c);
    }
    let get = |k: &str, dflt: Value| r.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(dflt);
    let echo = Echo {
        instructions: get("instructions", Value::Null),
        max_output_tokens: get("max_output_tokens", Value::Null),
        temperature: get("temperature", json!(1.0)),
        top_p: get("top_p", json!(1.0)),
        tools: get("tools", json!([])),
        tool_choice: get("tool_choice", json!("auto")),
        parallel_tool_calls: get("parallel_tool_calls", json!(true)),
        text: get("text", json!({"format": {"type": "text"}})),
        metadata: get("metadata", json!({})),
        user: get("user", Value::Null),
    };
    Ok((Value::Object(chat), echo))
}

/// An error of the chat pipeline named in the Responses request's terms (the chat request's
/// `messages` came from `input` and `instructions`, `max_tokens` from `max_output_tokens`,
/// `response_format` from `text.format`).
pub fn rename_param(mut e: ApiError) -> ApiError {
    if let Some(p) = &e.param {
        let renamed = if p.starts_with("messages") {
            Some("input")
        } else if p == "max_tokens" || p == "max_completion_tokens" {
            Some("max_output_tokens")
        } else if p.starts_with("response_format") {
            Some("text.format")
        } else {
            None
        };
        if let Some(r) = renamed {
            e.param = Some(r.into());
        }
    }
    e
}

/// Response ids: `resp_` and 32 hex digits; its items' ids end with the same digits.
pub fn new_id() -> String {
    format!("resp_{:032x}", rand::random::<u128>())
}

fn tail(id: &str) -> &str {
    id.rsplit(['_', '-']).next().unwrap_or(id)
}

fn message_id(response_id: &str) -> String {
    format!("msg_{}", tail(response_id))
}

fn reasoning_id(response_id: &str) -> String {
    format!("rs_{}", tail(response_id))
}

fn function_call_id(response_id: &str, k: usize) -> String {
    format!("fc_{}_{k}", tail(response_id))
}

/// The `call_id` of a response's function call `k` (what a `function_call_output` names).
pub fn call_id(response_id: &str, k: usize) -> String {
    let t = tail(response_id);
    format!("call_{}_{k}", &t[..t.len().min(24)])
}

fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn message_item(response_id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": message_id(response_id),
        "status": status,
        "role": "assistant",
        "content": if status == "in_progress" { json!([]) } else { json!([text_part(text)]) },
    })
}

/// The model's thought (`--reasoning-format`): its text as one `reasoning_text` part, no summary.
fn reasoning_item(response_id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "reasoning",
        "id": reasoning_id(response_id),
        "status": status,
        "summary": [],
        "content": if status == "in_progress" { json!([]) } else { json!([reasoning_part(text)]) },
    })
}

fn reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn call_item(response_id: &str, k: usize, name: &str, arguments: &str, status: &str) -> Value {
    json!({
        "type": "function_call",
        "id": function_call_id(response_id, k),
        "call_id": call_id(response_id, k),
        "name": name,
        "arguments": arguments,
        "status": status,
    })
}

/// `(status, incomplete_details)` of a finished response from its finish reason.
fn status_of(finish: &str) -> (&'static str, Value) {
    if finish == "length" {
        ("incomplete", json!({"reason": "max_output_tokens"}))
    } else {
        ("completed", Value::Null)
    }
}

impl Echo {
    /// The response object: `status` in_progress (no usage yet), completed or incomplete.
    fn object(
        &self,
        h: &Header,
        status: &str,
        incomplete: Value,
        output: Vec<Value>,
        usage: Option<Usage>,
    ) -> Value {
        json!({
            "id": h.id,
            "object": "response",
            "created_at": h.created,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": h.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null},
            "store": false,
            "temperature": self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage.map(usage_json),
            "user": self.user,
            "metadata": self.metadata,
        })
    }

    /// A whole response: the thought (a reasoning item, where the text was split and the model
    /// thought), the message (when there is text, or nothing else), then the function calls.
    pub fn response(
        &self,
        h: &Header,
        reasoning: Option<&str>,
        text: &str,
        finish: &str,
        calls: Option<&[Call]>,
        usage: Usage,
    ) -> Value {
        let calls = calls.unwrap_or(&[]);
        let mut output = Vec::new();
        if let Some(r) = reasoning.filter(|r| !r.is_empty()) {
            output.push(reasoning_item(&h.id, r, "completed"));
        }
        if !text.is_empty() || calls.is_empty() {
            output.push(message_item(&h.id, text, "completed"));
        }
        for (k, c) in calls.iter().enumerate() {
            output.push(call_item(&h.id, k, &c.name, &c.arguments, "completed"));
        }
        let (status, incomplete) = status_of(finish);
        self.object(h, status, incomplete, output, Some(usage))
    }
}

/// Frame one event: `event: <type>` and its JSON as data.
fn frame(v: &Value) -> Bytes {
    let mut out = Vec::with_capacity(160);
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(v["type"].as_str().unwrap_or("message").as_bytes());
    out.extend_from_slice(b"\ndata: ");
    serde_json::to_writer(&mut out, v).expect("json value serializes");
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The items whose text a stream writes piece by piece: the thought and the answer's message.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Reasoning,
    Message,
}

impl Part {
    fn item_id(self, response_id: &str) -> String {
        match self {
            Part::Reasoning => reasoning_id(response_id),
            Part::Message => message_id(response_id),
        }
    }

    fn item(self, response_id: &str, text: &str, status: &str) -> Value {
        match self {
            Part::Reasoning => reasoning_item(response_id, text, status),
            Part::Message => message_item(response_id, text, status),
        }
    }

    fn part(self, text: &str) -> Value {
        match self {
            Part::Reasoning => reasoning_part(text),
            Part::Message => text_part(text),
        }
    }

    /// The event a piece of text is (`delta`) and the one its whole text is (`done`).
    fn events(self) -> (&'static str, &'static str) {
        match self {
            Part::Reasoning => (
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
            ),
            Part::Message => ("response.output_text.delta", "response.output_text.done"),
        }
    }

    /// `fields` of a text event, with what the kind adds (an answer's text carries its logprobs).
    fn text_event(self, mut fields: Value) -> Value {
        if self == Part::Message {
            fields["logprobs"] = json!([]);
        }
        fields
    }
}

/// The item a stream is writing.
enum Open {
    Text {
        part: Part,
        index: usize,
        text: String,
    },
    Call {
        index: usize,
        k: usize,
        name: String,
        arguments: String,
    },
}

/// The typed events of one streamed response, numbered in order.
pub struct Events {
    header: Header,
    echo: std::sync::Arc<Echo>,
    seq: u64,
    /// Finished items, in output order.
    done: Vec<Value>,
    open: Option<Open>,
    finish: Option<&'static str>,
}

impl Events {
    pub fn new(header: Header, echo: std::sync::Arc<Echo>) -> Events {
        Events {
            header,
            echo,
            seq: 0,
            done: Vec::new(),
            open: None,
            finish: None,
        }
    }

    /// One event: its type, then `fields`, then its number in the stream.
    fn event(&mut self, kind: &str, fields: Value) -> Bytes {
        let mut e = Map::new();
        e.insert("type".into(), json!(kind));
        if let Value::Object(f) = fields {
            e.extend(f);
        }
        e.insert("sequence_number".into(), json!(self.seq));
        self.seq += 1;
        frame(&Value::Object(e))
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<Bytes> {
        let r = self
            .echo
            .object(&self.header, "in_progress", Value::Null, Vec::new(), None);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn next_index(&self) -> usize {
        self.done.len()
    }

    /// Finish the open item: its `done` events.
    fn close(&mut self, out: &mut Vec<Bytes>) {
        let id = self.header.id.clone();
        match self.open.take() {
            None => {}
            Some(Open::Text { part, index, text }) => {
                let item_id = part.item_id(&id);
                out.push(self.event(
                    part.events().1,
                    part.text_event(json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text})),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part.part(&text)}),
                ));
                let item = part.item(&id, &text, "completed");
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.done.push(item);
            }
            Some(Open::Call {
                index,
                k,
                name,
                arguments,
            }) => {
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": function_call_id(&id, k), "output_index": index, "name": name, "arguments": arguments}),
                ));
                let item = call_item(&id, k, &name, &arguments, "completed");
                out.push(self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ));
                self.done.push(item);
            }
        }
    }

    /// More of the model's thought: a reasoning item is opened first where none is (the thought
    /// comes before the answer's text, `crate::reasoning`).
    pub fn reasoning(&mut self, delta: &str) -> Vec<Bytes> {
        self.text_of(Part::Reasoning, delta)
    }

    /// More of the answer's text: a message item is opened first where none is.
    pub fn text(&mut self, delta: &str) -> Vec<Bytes> {
        self.text_of(Part::Message, delta)
    }

    /// More text of a `part` item: one is opened first where another item (or none) is open.
    fn text_of(&mut self, part: Part, delta: &str) -> Vec<Bytes> {
        let mut out = Vec::new();
        if delta.is_empty() {
            return out;
        }
        if !matches!(self.open, Some(Open::Text { part: p, .. }) if p == part) {
            self.close(&mut out);
            self.open_text(part, &mut out);
        }
        let index = match &mut self.open {
            Some(Open::Text { index, text, .. }) => {
                text.push_str(delta);
                *index
            }
            _ => unreachable!("a text item is open"),
        };
        let item_id = part.item_id(&self.header.id);
        out.push(self.event(
            part.events().0,
            part.text_event(json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": delta})),
        ));
        out
    }

    /// A piece of a function call: its start (a new item) or more of its arguments.
    pub fn tool(&mut self, e: &ToolEvent) -> Vec<Bytes> {
        let mut out = Vec::new();
        let id = self.header.id.clone();
        match e {
            ToolEvent::Text(t) => return self.text(t),
            ToolEvent::Start { index: k, name } => {
                self.close(&mut out);
                let index = self.next_index();
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": call_item(&id, *k, name, "", "in_progress")}),
                ));
                self.open = Some(Open::Call {
                    index,
                    k: *k,
                    name: name.clone(),
                    arguments: String::new(),
                });
            }
            ToolEvent::Args { text, .. } => {
                let (index, k) = match &mut self.open {
                    Some(Open::Call {
                        index,
                        k,
                        arguments,
                        ..
                    }) => {
                        arguments.push_str(text);
                        (*index, *k)
                    }
                    // arguments always follow their call's start
                    _ => return out,
                };
                out.push(self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": function_call_id(&id, k), "output_index": index, "delta": text}),
                ));
            }
        }
        out
    }

    /// The choice's finish reason (the last event is written by [`Events::end`]).
    pub fn finish(&mut self, reason: &'static str) {
        self.finish = Some(reason);
    }

    /// The open item's `done` events, then `response.completed` (or `response.incomplete`) with
    /// every item and the usage.
    pub fn end(&mut self, usage: Usage) -> Vec<Bytes> {
        let mut out = Vec::new();
        self.close(&mut out);
        if self.done.is_empty() {
            // an answer with no text and no call still has its (empty) message
            self.open_text(Part::Message, &mut out);
            self.close(&mut out);
        }
        let (status, incomplete) = status_of(self.finish.unwrap_or("stop"));
        let r = self.echo.object(
            &self.header,
            status,
            incomplete,
            self.done.clone(),
            Some(usage),
        );
        let kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        out.push(self.event(kind, json!({"response": r})));
        out
    }

    /// Open a `part` item at the next output index: its `added` events (no item is open).
    fn open_text(&mut self, part: Part, out: &mut Vec<Bytes>) {
        let id = self.header.id.clone();
        let index = self.next_index();
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": part.item(&id, "", "in_progress")}),
        ));
        out.push(self.event(
            "response.content_part.added",
            json!({"item_id": part.item_id(&id), "output_index": index, "content_index": 0, "part": part.part("")}),
        ));
        self.open = Some(Open::Text {
            part,
            index,
            text: String::new(),
        });
    }

    /// An error after the stream began: the `error` event (the stream ends after it).
    pub fn error(&mut self, e: &ApiError) -> Vec<Bytes> {
        vec![self.event(
            "error",
            json!({"code": e.code, "message": e.message, "param": e.param}),
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn input_and_instructions_become_messages() {
        let (chat, echo) = to_chat(&req(json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 16, "temperature": 0,
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is "}, {"type": "output_text", "text": "sunny."}]},
                {"type": "reasoning", "summary": []},
            ],
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": true}},
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "w"},
        })))
        .unwrap();
        let m = chat["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1]["role"], "user");
        // consecutive calls are one assistant turn
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m[2]["tool_calls"][1]["function"]["name"], "t");
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
        );
        assert_eq!(m[4]["content"], "It is sunny.");
        assert_eq!(m.len(), 5, "the reasoning item adds nothing");
        assert_eq!(chat["max_tokens"], 16);
        assert_eq!(chat["temperature"], 0);
        assert_eq!(chat["response_format"]["json_schema"]["name"], "x");
        assert_eq!(chat["response_format"]["json_schema"]["strict"], true);
        assert_eq!(chat["tools"][0]["function"]["name"], "w");
        assert_eq!(chat["tool_choice"]["function"]["name"], "w");
        assert_eq!(echo.instructions, json!("Be brief."));
        assert_eq!(echo.tool_choice["name"], "w");
        // a plain string input
        let (chat, echo) = to_chat(&req(json!({"input": "Hi"}))).unwrap();
        assert_eq!(chat["messages"], json!([{"role": "user", "content": "Hi"}]));
        assert_eq!(echo.temperature, json!(1.0));
        assert!(chat.get("max_tokens").is_none());
    }

    #[test]
    fn what_cannot_be_served_is_a_400_naming_the_field() {
        let refused = |v: Value| to_chat(&req(v)).unwrap_err();
        for (body, param) in [
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"input": "x", "store": true}), "store"),
            (json!({"input": "x", "background": true}), "background"),
            (
                json!({"input": "x", "reasoning": {"effort": "high"}}),
                "reasoning",
            ),
            (
                json!({"input": "x", "include": ["message.output_text.logprobs"]}),
                "include",
            ),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (json!({"input": "x", "top_logprobs": 3}), "top_logprobs"),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"input": [{"type": "item_reference", "id": "x"}]}),
                "input[0].type",
            ),
            (
                json!({"input": [{"role": "robot", "content": "x"}]}),
                "input[0].role",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id",
            ),
            (json!({"input": 3}), "input"),
            (json!({"model": "m"}), "input"),
            (json!({"input": []}), "input"),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
                "text.format.type",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
                "text.format.schema",
            ),
        ] {
            let e = refused(body.clone());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        // store false and empty include are fine
        assert!(to_chat(&req(
            json!({"input": "x", "store": false, "include": [], "truncation": "disabled"})
        ))
        .is_ok());
        assert_eq!(
            rename_param(ApiError::invalid("m", Some("messages[2].role"))).param,
            Some("input".into())
        );
        assert_eq!(
            rename_param(ApiError::invalid("m", Some("max_tokens"))).param,
            Some("max_output_tokens".into())
        );
    }

    fn header() -> Header {
        Header {
            kind: crate::sse::Kind::Responses,
            id: "resp_00ab".into(),
            created: 5,
            model: "m".into(),
            include_usage: false,
        }
    }

    fn echo() -> std::sync::Arc<Echo> {
        std::sync::Arc::new(to_chat(&req(json!({"input": "x"}))).unwrap().1)
    }

    fn parse(frames: &[Bytes]) -> Vec<Value> {
        frames
            .iter()
            .map(|b| {
                let s = std::str::from_utf8(b).unwrap();
                let (ev, data) = s.split_once("\ndata: ").unwrap();
                let v: Value = serde_json::from_str(data.trim_end()).unwrap();
                assert_eq!(ev.strip_prefix("event: ").unwrap(), v["type"]);
                v
            })
            .collect()
    }

    #[test]
    fn a_stream_opens_and_closes_every_item_in_order() {
        let mut ev = Events::new(header(), echo());
        let mut frames = ev.start();
        frames.extend(ev.text("Hel"));
        frames.extend(ev.text("lo"));
        frames.extend(ev.tool(&ToolEvent::Start {
            index: 0,
            name: "f".into(),
        }));
        frames.extend(ev.tool(&ToolEvent::Args {
            index: 0,
            text: "{\"a\":".into(),
        }));
        frames.extend(ev.tool(&ToolEvent::Args {
            index: 0,
            text: "1}".into(),
        }));
        ev.finish("tool_calls");
        frames.extend(ev.end(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            ..Usage::default()
        }));
        let v = parse(&frames);
        let types: Vec<&str> = v.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, e) in v.iter().enumerate() {
            assert_eq!(e["sequence_number"], i as u64);
        }
        assert_eq!(v[6]["text"], "Hello");
        assert_eq!(v[9]["output_index"], 1);
        assert_eq!(v[13]["item"]["arguments"], "{\"a\":1}");
        let r = &v[14]["response"];
        assert_eq!(r["status"], "completed");
        assert_eq!(r["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(r["output"][1]["call_id"], "call_00ab_0");
        assert_eq!(r["usage"]["total_tokens"], 7);
        assert_eq!(r["id"], v[0]["response"]["id"]);
    }

    #[test]
    fn a_cut_answer_is_incomplete_and_an_empty_one_has_its_message() {
        let mut ev = Events::new(header(), echo());
        let mut frames = ev.start();
        ev.finish("length");
        frames.extend(ev.end(Usage::default()));
        let v = parse(&frames);
        let last = v.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(
            last["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        assert_eq!(last["response"]["output"][0]["type"], "message");
        assert_eq!(v[2]["type"], "response.output_item.added");
        // whole responses: text first, calls after; no text and calls: the calls alone
        let h = header();
        let e = echo();
        let calls = [Call {
            name: "f".into(),
            arguments: "{}".into(),
        }];
        let r = e.response(&h, None, "", "tool_calls", Some(&calls), Usage::default());
        assert_eq!(r["output"].as_array().unwrap().len(), 1);
        assert_eq!(r["output"][0]["type"], "function_call");
        let r = e.response(&h, None, "Hi", "stop", None, Usage::default());
        assert_eq!(r["output"][0]["content"][0]["text"], "Hi");
        assert_eq!(r["status"], "completed");
        assert!(r["incomplete_details"].is_null());
        // a thought: its reasoning item first (an empty one is no item)
        let r = e.response(&h, Some("hmm"), "Hi", "stop", None, Usage::default());
        assert_eq!(r["output"][0]["type"], "reasoning");
        assert_eq!(r["output"][0]["content"][0]["text"], "hmm");
        assert_eq!(r["output"][1]["content"][0]["text"], "Hi");
        let r = e.response(&h, Some(""), "Hi", "stop", None, Usage::default());
        assert_eq!(r["output"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn a_streamed_thought_is_a_reasoning_item_done_before_the_message() {
        let mut ev = Events::new(header(), echo());
        let mut frames = ev.start();
        frames.extend(ev.reasoning("let me "));
        frames.extend(ev.reasoning("see"));
        frames.extend(ev.text("Paris"));
        ev.finish("stop");
        frames.extend(ev.end(Usage::default()));
        let v = parse(&frames);
        let types: Vec<&str> = v.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            &types[2..],
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(v[6]["text"], "let me see");
        assert_eq!(v[8]["item"]["content"][0]["text"], "let me see");
        assert_eq!(v[9]["output_index"], 1);
        let done = &v.last().unwrap()["response"]["output"];
        assert_eq!(done[0]["type"], "reasoning");
        assert_eq!(done[1]["content"][0]["text"], "Paris");
        // sequence numbers count every event
        assert!(v.iter().enumerate().all(|(i, e)| e["sequence_number"] == i));
    }
}
