//! POST /v1/embeddings (OpenAI's embeddings API; served with `--embeddings`, as llama-server):
//! each input's final-normed hidden states pooled (`--pooling mean|last`) and scaled to unit
//! length. The inputs go through the engine like prompts (`GenerateRequest::embed`: chunked,
//! batched with the other sequences' steps, never served from the prefix cache), all submitted
//! at once; the answer keeps the inputs' order.
//!
//! Invariants: `data[i].index == i`; `usage.prompt_tokens` counts every input's tokens; a client
//! that disconnects drops the receivers, which cancels the inputs still running.

use std::sync::Arc;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
pub use metrale_backend::Pooling;
use metrale_engine::{Event, GenerateRequest};
use serde::Serialize;

use crate::error::ApiError;
use crate::generate::submit_error;
use crate::prepare::EmbedJob;
use crate::state::{Served, Ticket};

/// Bytes of the answer per dimension per input, at most: a float in JSON (`-0.012345678,` is 13; 16
/// kept), or 4 bytes as base64 (5.4); with the vectors themselves (4).
const ANSWER_BYTES_PER_DIM: u64 = 20;

/// One vector of the answer: floats, or their little-endian f32 bytes in base64.
#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Floats(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Item {
    object: &'static str,
    index: usize,
    embedding: Vector,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
}

#[derive(Serialize)]
struct Answer<'a> {
    object: &'static str,
    data: Vec<Item>,
    model: &'a str,
    usage: Usage,
}

/// Submit every input, wait for their embeddings, answer in OpenAI's shape. The answer's memory is
/// reserved first (a 429 when the budget is short): 2,048 inputs of an 8B model's 4,096 dimensions
/// are ~170 MB of JSON.
pub async fn respond(
    sv: Arc<Served>,
    job: EmbedJob,
    _ticket: Option<Ticket>,
) -> Result<Response, ApiError> {
    let n = job.inputs.len();
    let _answer = sv.budget.reserve(
        n as u64 * sv.hidden as u64 * ANSWER_BYTES_PER_DIM,
        &format!("for {n} embeddings of {} dimensions", sv.hidden),
    )?;
    let prompt_tokens: usize = job.inputs.iter().map(Vec::len).sum();
    let mut rxs = Vec::with_capacity(n);
    for prompt in job.inputs {
        let req = GenerateRequest {
            prompt,
            max_tokens: 0,
            sampling: Default::default(),
            stop_tokens: Vec::new(),
            ignore_eos: true,
            link: Arc::new(metrale_engine::RequestLink::default()),
            constraint: None,
            embed: Some(job.pooling),
        };
        rxs.push(sv.engine.submit(req).map_err(submit_error)?);
    }
    let mut data = Vec::with_capacity(n);
    for (index, mut rx) in rxs.into_iter().enumerate() {
        let mut vec = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Embedding(v) => vec = Some(v),
                Event::Done { .. } => break,
                Event::Error(m) => {
                    return Err(ApiError::internal(format!(
                        "computing embedding {index} failed: {m}"
                    )))
                }
                Event::Token { .. } => {}
            }
        }
        let v = vec.ok_or_else(|| {
            ApiError::internal(format!(
                "the engine ended embedding {index} without a vector (a bug; the server log may say more)"
            ))
        })?;
        let embedding = if job.base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            Vector::Floats(v)
        };
        data.push(Item {
            object: "embedding",
            index,
            embedding,
        });
    }
    let answer = Answer {
        object: "list",
        data,
        model: &sv.name,
        usage: Usage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    };
    let bytes = serde_json::to_vec(&answer)
        .map_err(|e| ApiError::internal(format!("cannot serialize the response: {e}")))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], bytes).into_response())
}
