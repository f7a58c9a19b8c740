//! Server-sent-event framing and the OpenAI response/chunk shapes.
//!
//! A stream is `data: {json}\n\n` chunks, all with one id, then `data: [DONE]\n\n`. For chat, the
//! first chunk of each choice carries `delta.role`, the last carries `finish_reason`; a usage chunk
//! (empty `choices`) comes only when `stream_options.include_usage` was set, right before `[DONE]`,
//! and every other chunk then has `"usage": null`.

use axum::body::Bytes;
use serde_json::{json, Value};

/// The terminator of every stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";
/// An SSE comment: keeps an idle stream's connection alive; clients ignore it.
pub const KEEPALIVE: &[u8] = b": keep-alive\n\n";

/// Frame one JSON value as an SSE data event.
pub fn data(v: &Value) -> Bytes {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut out, v).expect("json value serializes");
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// Which endpoint a response belongs to (the shapes differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
    /// `/v1/responses`: the chat pipeline, answered in the Responses shapes (`crate::responses`).
    Responses,
}

/// Identity shared by every chunk of one response.
#[derive(Debug, Clone)]
pub struct Header {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
}

/// One choice of a whole response.
pub struct ChoiceBody {
    pub text: String,
    pub logprobs: Option<Value>,
    pub finish: String,
    /// The choice's tool calls (`tool_calls_json`): the message's content is then null.
    pub tool_calls: Option<Value>,
    /// The model's thought (`crate::reasoning`; `None`: the text was not split).
    pub reasoning: Option<String>,
}

/// The API's `tool_calls` list: `[{index, id, type, function: {name, arguments}}]`, ids derived from
/// the response id.
pub fn tool_calls_json(response_id: &str, calls: &[crate::tools::Call]) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                json!({"index": k, "id": tool_call_id(response_id, k), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect(),
    )
}

/// The id of call `k` of a response.
fn tool_call_id(response_id: &str, k: usize) -> String {
    let tail = response_id.rsplit('-').next().unwrap_or(response_id);
    format!("call_{}_{k}", &tail[..tail.len().min(12)])
}

/// A streamed `delta.tool_calls` for one piece of a call: its start (id, type, name, empty
/// arguments), then its arguments piece by piece, as OpenAI streams them.
pub fn tool_call_delta(response_id: &str, e: &crate::tools::ToolEvent) -> Value {
    use crate::tools::ToolEvent;
    match e {
        ToolEvent::Start { index, name } => {
            json!([{"index": index, "id": tool_call_id(response_id, *index),
            "type": "function", "function": {"name": name, "arguments": ""}}])
        }
        ToolEvent::Args { index, text } => {
            json!([{"index": index, "function": {"arguments": text}}])
        }
        ToolEvent::Text(_) => json!([]),
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens the prefix cache served (for n > 1, the first choice of each prompt's):
    /// `prompt_tokens_details.cached_tokens`, as OpenAI reports it.
    pub cached_tokens: usize,
    /// Completion tokens of the thought (`--reasoning-format`: from the token that opens it to
    /// the one that closes it): `completion_tokens_details.reasoning_tokens`.
    pub reasoning_tokens: usize,
}

impl Usage {
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        })
    }
}

impl Header {
    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
            (Kind::Responses, _) => "response",
        }
    }

    /// One streamed chunk for one choice. `role` only on a chat choice's first chunk; `text` is the
    /// delta; `finish` only on its last chunk.
    pub fn chunk(
        &self,
        index: usize,
        role: bool,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat | Kind::Responses => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if role || !text.is_empty() {
                    delta.insert("content".into(), json!(text));
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        let mut v = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The usage chunk sent after the last choice chunk when `include_usage` is set.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage.to_json(),
        })
    }

    /// A whole (non-streamed) response. `choices`: (text, logprobs, finish_reason) per choice.
    /// A chunk whose delta carries a choice's tool calls (chat).
    /// A chunk whose delta is a piece of the model's thought (`reasoning_content`).
    pub fn reasoning_chunk(&self, index: usize, text: &str) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "delta": {"reasoning_content": text}, "logprobs": null,
                         "finish_reason": null}],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    pub fn tool_calls_chunk(&self, index: usize, calls: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "delta": {"tool_calls": calls}, "logprobs": null,
                         "finish_reason": null}],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    pub fn full(&self, choices: Vec<ChoiceBody>, usage: Usage) -> Value {
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| match self.kind {
                Kind::Chat | Kind::Responses => {
                    let mut message = match c.tool_calls {
                        Some(calls) => {
                            let content = (!c.text.is_empty()).then_some(c.text);
                            json!({"role": "assistant", "content": content, "tool_calls": calls})
                        }
                        None => json!({"role": "assistant", "content": c.text}),
                    };
                    if let Some(r) = c.reasoning {
                        message["reasoning_content"] = (!r.is_empty()).then_some(r).into();
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": c.logprobs,
                        "finish_reason": c.finish,
                    })
                }
                Kind::Completion => json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish,
                }),
            })
            .collect();
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage.to_json(),
        })
    }
}

/// One token's logprob entry with its alternatives: (text, bytes, logprob, top [(text, bytes, lp)]).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// Render logprobs of a run of tokens in the endpoint's shape. For completions, `text_offset` starts
/// at `offset` (characters of text already sent for this choice).
pub fn logprobs_json(kind: Kind, toks: &[TokenLogprob], mut offset: usize) -> Value {
    match kind {
        Kind::Chat | Kind::Responses => {
            let content: Vec<Value> = toks
                .iter()
                .map(|t| {
                    json!({
                        "token": t.text,
                        "logprob": t.logprob,
                        "bytes": t.bytes,
                        "top_logprobs": t.top.iter().map(|(s, b, lp)| json!({
                            "token": s, "logprob": lp, "bytes": b,
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({"content": content})
        }
        Kind::Completion => {
            let mut offsets = Vec::with_capacity(toks.len());
            for t in toks {
                offsets.push(offset);
                offset += t.text.chars().count();
            }
            json!({
                "tokens": toks.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
                "token_logprobs": toks.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                "top_logprobs": toks.iter().map(|t| {
                    let m: serde_json::Map<String, Value> =
                        t.top.iter().map(|(s, _, lp)| (s.clone(), json!(lp))).collect();
                    Value::Object(m)
                }).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: Kind, include_usage: bool) -> Header {
        Header {
            kind,
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
            include_usage,
        }
    }

    #[test]
    fn framing() {
        let b = data(&json!({"a": 1}));
        assert_eq!(&b[..], b"data: {\"a\":1}\n\n");
        assert_eq!(DONE, b"data: [DONE]\n\n");
    }

    #[test]
    fn chat_chunks_role_first_finish_last() {
        let h = header(Kind::Chat, false);
        let first = h.chunk(0, true, "", None, None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["delta"]["content"], "");
        assert!(first["choices"][0]["finish_reason"].is_null());
        assert!(
            first.get("usage").is_none(),
            "no usage key without include_usage"
        );
        let mid = h.chunk(0, false, "Par", None, None);
        assert!(mid["choices"][0]["delta"].get("role").is_none());
        assert_eq!(mid["choices"][0]["delta"]["content"], "Par");
        let last = h.chunk(0, false, "", None, Some("stop"));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert_eq!(first["id"], last["id"]);
    }

    #[test]
    fn usage_chunk_only_with_include_usage() {
        let h = header(Kind::Chat, true);
        assert!(h.chunk(0, false, "x", None, None)["usage"].is_null());
        let u = h.usage_chunk(Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            cached_tokens: 2,
            reasoning_tokens: 3,
        });
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 7);
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(
            u["usage"]["completion_tokens_details"]["reasoning_tokens"],
            3
        );
    }

    #[test]
    fn completion_shapes() {
        let h = header(Kind::Completion, false);
        let c = h.chunk(1, false, "hi", None, Some("length"));
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["text"], "hi");
        assert_eq!(c["choices"][0]["index"], 1);
        let full = h.full(
            vec![ChoiceBody {
                reasoning: None,
                text: "a".into(),
                logprobs: None,
                finish: "stop".into(),
                tool_calls: None,
            }],
            Usage {
                prompt_tokens: 1,
                completion_tokens: 1,
                ..Usage::default()
            },
        );
        assert_eq!(full["choices"][0]["text"], "a");
        assert_eq!(full["usage"]["total_tokens"], 2);
        let hc = header(Kind::Chat, false);
        let full = hc.full(
            vec![ChoiceBody {
                reasoning: None,
                text: "a".into(),
                logprobs: None,
                finish: "stop".into(),
                tool_calls: None,
            }],
            Usage::default(),
        );
        assert_eq!(full["object"], "chat.completion");
        assert_eq!(full["choices"][0]["message"]["role"], "assistant");
        let calls = tool_calls_json(
            "chatcmpl-abc",
            &[crate::tools::Call {
                name: "f".into(),
                arguments: "{}".into(),
            }],
        );
        let full = hc.full(
            vec![ChoiceBody {
                reasoning: None,
                text: String::new(),
                logprobs: None,
                finish: "tool_calls".into(),
                tool_calls: Some(calls),
            }],
            Usage::default(),
        );
        let m = &full["choices"][0]["message"];
        assert!(m["content"].is_null());
        assert_eq!(m["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(m["tool_calls"][0]["id"], "call_abc_0");
    }

    #[test]
    fn logprob_shapes() {
        let toks = vec![
            TokenLogprob {
                text: "ab".into(),
                bytes: b"ab".to_vec(),
                logprob: -0.5,
                top: vec![("ab".into(), b"ab".to_vec(), -0.5)],
            },
            TokenLogprob {
                text: "é".into(),
                bytes: "é".as_bytes().to_vec(),
                logprob: -1.0,
                top: vec![],
            },
        ];
        let c = logprobs_json(Kind::Chat, &toks, 0);
        assert_eq!(c["content"][0]["token"], "ab");
        assert_eq!(c["content"][1]["bytes"], json!([0xC3, 0xA9]));
        assert_eq!(c["content"][0]["top_logprobs"][0]["logprob"], -0.5);
        let p = logprobs_json(Kind::Completion, &toks, 10);
        assert_eq!(p["text_offset"], json!([10, 12]));
        assert_eq!(p["token_logprobs"], json!([-0.5, -1.0]));
        assert_eq!(p["top_logprobs"][0]["ab"], -0.5);
    }
}
