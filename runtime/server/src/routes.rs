//! The HTTP routes: OpenAI endpoints, health, metrics, tokenize/detokenize, the API-key check and a
//! 404 in the OpenAI envelope. Handlers parse and validate, then hand a [`Job`] to [`generate`].
//!
//! Invariant: while the model loads, `/health` is 503 `{"status":"loading"}` and every other route
//! is 503 in the envelope; `/health` and `/metrics` never need the API key.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrale_model::ChatMessage;
use serde_json::json;

use crate::api::{
    self, ChatRequest, CompletionRequest, DetokenizeRequest, PromptSpec, TokenizeRequest,
};
use crate::error::ApiError;
use crate::generate::{self, Job};
use crate::sse::Kind;
use crate::state::{AppState, Served};

type St = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

fn served(s: &AppState) -> Result<Arc<Served>, ApiError> {
    s.ready.get().cloned().ok_or_else(|| {
        ApiError::unavailable("the model is still loading; retry when GET /health returns 200")
    })
}

async fn auth(State(s): St, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{method} is not allowed on {}", uri.path()),
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}

/// Largest request body accepted (a prompt of this size is far past any context anyway).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// The raw request body, refused in the OpenAI envelope when it is too large or unreadable.
pub struct Body(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(req: Request, _: &S) -> Result<Self, ApiError> {
        axum::body::to_bytes(req.into_body(), MAX_BODY_BYTES).await.map(Body).map_err(|e| {
            let mut err = ApiError::invalid(
                format!("cannot read the request body (at most {MAX_BODY_BYTES} bytes are accepted): {e}"),
                None,
            );
            err.status = StatusCode::PAYLOAD_TOO_LARGE;
            err
        })
    }
}

async fn health(State(s): St) -> Response {
    match s.ready.get() {
        Some(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

async fn metrics(State(s): St) -> Result<Response, ApiError> {
    let sv = served(&s)?;
    let text = sv.engine.metrics().prometheus_text(&sv.name);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// The one model this server serves, as OpenAI's model object.
fn model_object(sv: &Served) -> serde_json::Value {
    json!({
        "id": sv.name,
        "object": "model",
        "created": sv.created,
        "owned_by": "metrale",
        "max_model_len": sv.ctx_size,
    })
}

async fn models(State(s): St) -> Result<Json<serde_json::Value>, ApiError> {
    let sv = served(&s)?;
    Ok(Json(json!({"object": "list", "data": [model_object(&sv)]})))
}

/// GET /v1/models/{id}: the model object when `id` is the served name, else a 404 naming it.
async fn model(State(s): St, Path(id): Path<String>) -> Result<Json<serde_json::Value>, ApiError> {
    let sv = served(&s)?;
    if id != sv.name {
        return Err(ApiError::model_not_found(&id, &sv.name));
    }
    Ok(Json(model_object(&sv)))
}

async fn tokenize(State(s): St, Body(body): Body) -> Result<Json<serde_json::Value>, ApiError> {
    let sv = served(&s)?;
    let r: TokenizeRequest = api::parse_body(&body)?;
    let tk = &sv.model.tokenizer;
    let add_bos = r.add_special && tk.add_bos();
    let tokens = tk.encode(&r.content, add_bos, true).map_err(|e| {
        ApiError::invalid(format!("cannot tokenize 'content': {e}"), Some("content"))
    })?;
    Ok(Json(json!({"tokens": tokens})))
}

async fn detokenize(State(s): St, Body(body): Body) -> Result<Json<serde_json::Value>, ApiError> {
    let sv = served(&s)?;
    let r: DetokenizeRequest = api::parse_body(&body)?;
    let ids = api::check_token_ids(&r.tokens, sv.vocab, "tokens")?;
    Ok(Json(
        json!({"content": sv.model.tokenizer.decode(&ids, false)}),
    ))
}

/// Tokenize a prompt text: the model's BOS rule, special-token markup parsed.
fn encode_prompt(sv: &Served, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
    let tk = &sv.model.tokenizer;
    // A template that already wrote the BOS text gets no second BOS.
    let bos_written = tk
        .bos()
        .and_then(|b| tk.token_text(b))
        .is_some_and(|t| !t.is_empty() && text.starts_with(&t));
    tk.encode(text, tk.add_bos() && !bos_written, true)
        .map_err(|e| ApiError::invalid(format!("cannot tokenize '{param}': {e}"), Some(param)))
}

async fn chat(State(s): St, Body(body): Body) -> Result<Response, ApiError> {
    let sv = served(&s)?;
    let r: ChatRequest = api::parse_request(&body)?;
    let params = api::validate_chat(&r, &sv.chat_preset, sv.vocab)?;
    let template = sv.chat_template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template; use /v1/completions, or restart the server with \
             --chat-template FILE",
            Some("messages"),
        )
    })?;
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
        msgs.push(ChatMessage::new(role, api::message_text(m, i)?));
    }
    let text = template.render(&msgs, true).map_err(|e| {
        ApiError::invalid(
            format!("the chat template failed on these messages: {e}"),
            Some("messages"),
        )
    })?;
    let prompt = encode_prompt(&sv, &text, "messages")?;
    generate::respond(
        sv,
        Job {
            kind: Kind::Chat,
            prompts: vec![prompt],
            params,
        },
    )
    .await
}

async fn completions(State(s): St, Body(body): Body) -> Result<Response, ApiError> {
    let sv = served(&s)?;
    let r: CompletionRequest = api::parse_request(&body)?;
    let params = api::validate_completion(&r, &sv.completion_preset, sv.vocab)?;
    let prompts = match &r.prompt {
        PromptSpec::Text(t) => vec![encode_prompt(&sv, t, "prompt")?],
        PromptSpec::Texts(ts) => ts
            .iter()
            .map(|t| encode_prompt(&sv, t, "prompt"))
            .collect::<Result<_, _>>()?,
        PromptSpec::Tokens(ids) => vec![api::check_token_ids(ids, sv.vocab, "prompt")?],
        PromptSpec::TokenLists(l) => l
            .iter()
            .map(|ids| api::check_token_ids(ids, sv.vocab, "prompt"))
            .collect::<Result<_, _>>()?,
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            "'prompt' must not be an empty list",
            Some("prompt"),
        ));
    }
    if prompts.len() * params.n > api::MAX_N {
        return Err(ApiError::invalid(
            format!(
                "at most {} choices per request (prompts x n), got {}",
                api::MAX_N,
                prompts.len() * params.n
            ),
            Some("prompt"),
        ));
    }
    generate::respond(
        sv,
        Job {
            kind: Kind::Completion,
            prompts,
            params,
        },
    )
    .await
}
