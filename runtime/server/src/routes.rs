//! The HTTP routes: OpenAI endpoints, health, metrics, tokenize/detokenize, the API-key check, the
//! admission check and a 404 in the OpenAI envelope. Handlers read the body ([`RequestBody`]), run
//! [`prepare`] on the preprocessing pool, then hand the [`Job`] to [`generate`].
//!
//! Invariants: while the model loads, `/health` is 503 `{"status":"loading"}` and every other route
//! is 503 in the envelope; `/health` and `/metrics` never need the API key and never wait on other
//! requests' work; a request past the queue limit is refused before its body is read.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::json;

use crate::budget::{Reservation, BODY_BYTES_PER_BYTE};
use crate::error::{ApiError, Refused};
use crate::generate;
use crate::prepare::{self, Job, Prep};
use crate::state::{AppState, Served, Ticket};

type St = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>) -> Router {
    let work = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), admit));
    let page = if state.webui {
        crate::webui::routes()
    } else {
        Router::new()
    };
    Router::new()
        .merge(work)
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(page)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_refusals,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), cors))
        .with_state(state)
}

/// CORS (`--cors-origins`): a request from an allowed origin gets `Access-Control-Allow-Origin`;
/// its preflight (OPTIONS with `Access-Control-Request-Method`) is answered here, before the API
/// key is asked for (browsers send preflights without credentials). Other origins get no CORS
/// headers, so browsers refuse them.
async fn cors(State(s): St, req: Request, next: Next) -> Response {
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let allowed = match &origin {
        Some(o) if s.cors_origins.iter().any(|a| a == "*" || a == o) => o.clone(),
        _ => return next.run(req).await,
    };
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut resp = if preflight {
        let asked = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("authorization, content-type")
            .to_string();
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            header::HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        if let Ok(v) = header::HeaderValue::from_str(&asked) {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, v);
        }
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            header::HeaderValue::from_static("600"),
        );
        r
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    if let Ok(v) = header::HeaderValue::from_str(&allowed) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    h.append(header::VARY, header::HeaderValue::from_static("Origin"));
    resp
}

fn served(s: &AppState) -> Result<Arc<Served>, ApiError> {
    s.ready.get().cloned().ok_or_else(|| {
        ApiError::unavailable("the model is still loading; retry when GET /health returns 200")
    })
}

async fn auth(State(s): St, req: Request, next: Next) -> Response {
    if !s.api_keys.is_empty() {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        // every key compared, each in constant time: the answer's timing says nothing of which
        let ok = given.is_some_and(|g| {
            s.api_keys.iter().fold(false, |ok, k| {
                ok | constant_time_eq(g.as_bytes(), k.as_bytes())
            })
        });
        if !ok {
            return closing(ApiError::unauthorized());
        }
    }
    next.run(req).await
}

/// Refuse work past `--max-queue` before reading the body: 429 with `Retry-After`. An admitted
/// request carries its [`Ticket`] in its extensions; [`RequestBody`] takes it over.
async fn admit(State(s): St, mut req: Request, next: Next) -> Response {
    if s.ready.get().is_some() {
        match s.queue.enter(s.limits.max_queue) {
            Ok(ticket) => {
                req.extensions_mut().insert(ticket);
            }
            Err(depth) => {
                return closing(ApiError::overloaded(
                    "queue_full",
                    format!(
                        "the server has {depth} requests waiting, its limit (--max-queue {}); retry shortly",
                        s.limits.max_queue
                    ),
                    1,
                ))
            }
        }
    }
    next.run(req).await
}

/// Count refusals (408, 413, 429 answers) by code for `/metrics`.
async fn count_refusals(State(s): St, req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    if let Some(Refused(code)) = r.extensions().get::<Refused>() {
        *s.rejected.lock().unwrap().entry(code).or_insert(0) += 1;
    }
    r
}

/// An error answered before the request's body was read: the connection closes after it (hyper
/// does not reuse a connection with an unread body), and `Connection: close` says so, so that a
/// client does not send its next request on a connection about to close.
fn closing(e: ApiError) -> Response {
    let mut r = e.into_response();
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::with_status(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        None,
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// Largest request body accepted (a prompt of this size is far past any context anyway).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// A request's body, read within `--client-timeout` and held against the memory budget, with the
/// served model (a body is only read once the model is ready).
pub struct RequestBody {
    pub served: Arc<Served>,
    pub bytes: Bytes,
    pub reservation: Reservation,
    /// The request's place in the queue (from [`admit`]), held until it runs.
    pub ticket: Option<Ticket>,
}

fn too_large(got: u64) -> ApiError {
    ApiError::with_status(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        Some("request_too_large"),
        format!(
            "the request body is over {got} bytes; at most {MAX_BODY_BYTES} bytes are accepted"
        ),
    )
}

impl FromRequest<Arc<AppState>> for RequestBody {
    type Rejection = Response;

    async fn from_request(req: Request, s: &Arc<AppState>) -> Result<Self, Response> {
        Self::read(req, s).await.map_err(closing)
    }
}

impl RequestBody {
    async fn read(mut req: Request, s: &Arc<AppState>) -> Result<Self, ApiError> {
        let ticket = req.extensions_mut().remove::<Ticket>();
        let served = served(s)?;
        let declared: Option<u64> = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        if let Some(n) = declared.filter(|&n| n > MAX_BODY_BYTES as u64) {
            return Err(too_large(n));
        }
        let mut reservation = served.budget.reserve(
            declared.unwrap_or(0) * BODY_BYTES_PER_BYTE,
            "to read its body",
        )?;
        let timeout = s.limits.client_timeout;
        let read = async {
            let mut buf = Vec::with_capacity(declared.unwrap_or(0) as usize);
            let mut frames = req.into_body().into_data_stream();
            while let Some(frame) = frames.next().await {
                let frame = frame.map_err(|e| {
                    ApiError::invalid(
                        format!(
                            "cannot read the request body: it is malformed (e.g. a bad chunked encoding) \
                             or the client stopped sending: {e}"
                        ),
                        None,
                    )
                })?;
                let len = (buf.len() + frame.len()) as u64;
                if len > MAX_BODY_BYTES as u64 {
                    return Err(too_large(len));
                }
                if declared.is_none() {
                    reservation
                        .grow(frame.len() as u64 * BODY_BYTES_PER_BYTE, "to read its body")?;
                }
                buf.extend_from_slice(&frame);
            }
            Ok(buf)
        };
        let bytes = tokio::time::timeout(timeout, read).await.map_err(|_| {
            ApiError::with_status(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                Some("body_timeout"),
                format!(
                    "the request body did not arrive within {} s (--client-timeout)",
                    timeout.as_secs()
                ),
            )
        })??;
        Ok(RequestBody {
            served,
            bytes: Bytes::from(bytes),
            reservation,
            ticket,
        })
    }
}

/// Run one of [`prepare`]'s functions on the preprocessing pool.
async fn prepare_on_pool<T: Send + 'static>(
    body: RequestBody,
    f: fn(&Prep, &[u8], &mut Reservation) -> Result<T, ApiError>,
) -> Result<(Arc<Served>, T, Option<Ticket>), ApiError> {
    let RequestBody {
        served,
        bytes,
        mut reservation,
        ticket,
    } = body;
    let sv = served.clone();
    let out = served
        .pool
        .run(move || f(&sv.prep(), &bytes, &mut reservation))
        .await
        .unwrap_or_else(|| {
            Err(ApiError::internal(
                "preparing this request failed: a preprocessing thread panicked (a bug; the server log \
                 has its message)",
            ))
        })?;
    Ok((served, out, ticket))
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
    let mut text = sv.engine.metrics().prometheus_text(&sv.name);
    server_metrics(&mut text, &s, &sv);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// The server's own gauges and counters, after the engine's (`metrale:` names).
fn server_metrics(out: &mut String, s: &AppState, sv: &Served) {
    use std::fmt::Write;
    let mut rejected = s.rejected.lock().unwrap().clone();
    rejected.insert("max_connections", s.conns.refused());
    for code in [
        "queue_full",
        "memory_busy",
        "request_too_large",
        "body_timeout",
    ] {
        rejected.entry(code).or_insert(0);
    }
    let _ = writeln!(
        out,
        "# HELP metrale:requests_rejected_total Requests refused before any work, by reason.\n\
         # TYPE metrale:requests_rejected_total counter"
    );
    for (reason, n) in rejected {
        let _ = writeln!(
            out,
            "metrale:requests_rejected_total{{reason=\"{reason}\"}} {n}"
        );
    }
    let gauges = [
        (
            "open_connections",
            "Open HTTP connections.",
            s.conns.open() as u64,
        ),
        (
            "requests_queued",
            "Requests admitted and not yet running (reading, preparing, or waiting for a slot).",
            s.queue.len() as u64,
        ),
        (
            "requests_preparing",
            "Requests being parsed, rendered or tokenized, or waiting for that.",
            sv.pool.pending() as u64,
        ),
        (
            "memory_budget_bytes",
            "Bytes requests may reserve for their work.",
            sv.budget.total,
        ),
        (
            "memory_reserved_bytes",
            "Bytes reserved by requests now.",
            sv.budget.reserved(),
        ),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(
            out,
            "# HELP metrale:{name} {help}\n# TYPE metrale:{name} gauge\nmetrale:{name} {v}"
        );
    }
}

/// The one model this server serves, as OpenAI's model object (with vLLM's `max_model_len` and
/// the target this binary was built for, null for a generic build).
fn model_object(sv: &Served) -> serde_json::Value {
    json!({
        "id": sv.name,
        "object": "model",
        "created": sv.created,
        "owned_by": "metrale",
        "max_model_len": sv.ctx_size,
        "target": sv.target,
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

async fn tokenize(body: RequestBody) -> Result<Response, ApiError> {
    let (_, json, _) = prepare_on_pool(body, prepare::tokenize).await?;
    Ok(json_body(json))
}

async fn detokenize(body: RequestBody) -> Result<Response, ApiError> {
    let (_, json, _) = prepare_on_pool(body, prepare::detokenize).await?;
    Ok(json_body(json))
}

/// A 200 with a JSON body serialized elsewhere (on the preprocessing pool).
fn json_body(json: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], json).into_response()
}

async fn chat(State(s): St, body: RequestBody) -> Result<Response, ApiError> {
    let (sv, job, ticket): (_, Job, _) = prepare_on_pool(body, prepare::chat).await?;
    generate::respond(sv, job, ticket, s.abort.clone()).await
}

async fn responses(State(s): St, body: RequestBody) -> Result<Response, ApiError> {
    let (sv, job, ticket): (_, Job, _) = prepare_on_pool(body, prepare::responses).await?;
    generate::respond(sv, job, ticket, s.abort.clone()).await
}

async fn embeddings(body: RequestBody) -> Result<Response, ApiError> {
    let (sv, job, ticket) = prepare_on_pool(body, prepare::embeddings).await?;
    crate::embeddings::respond(sv, job, ticket).await
}

async fn completions(State(s): St, body: RequestBody) -> Result<Response, ApiError> {
    let (sv, job, ticket): (_, Job, _) = prepare_on_pool(body, prepare::completion).await?;
    generate::respond(sv, job, ticket, s.abort.clone()).await
}
