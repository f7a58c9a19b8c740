//! The OpenAI error envelope: every failure the server answers with is an [`ApiError`], rendered as
//! `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.
//!
//! Invariant: client mistakes are 4xx (`invalid_request_error`, 400; `authentication_error`, 401;
//! `not_found_error`, 404; 408 a body that did not arrive in time; 413 a request whose worst case
//! passes the server's memory budget); 429 (`rate_limit_error`, with `Retry-After`) means "full now,
//! retry"; 503 means "not ready / shutting down / too many connections"; 500 is reserved for our
//! own bugs and backend failures, never for anything the client sent.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 and 503 answers that a retry can fix).
    pub retry_after: Option<u32>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    /// 400: the request is malformed or a parameter is out of range.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
            retry_after: None,
        }
    }

    /// Any status with the given type and code (no param).
    pub fn with_status(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code,
            retry_after: None,
        }
    }

    /// 429: the server is full right now (its queue or its memory budget); retry after `secs`.
    pub fn overloaded(code: &'static str, message: impl Into<String>, secs: u32) -> Self {
        Self {
            retry_after: Some(secs),
            ..Self::with_status(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some(code),
                message,
            )
        }
    }

    /// 400 with an explicit code (e.g. `context_length_exceeded`).
    pub fn invalid_code(
        message: impl Into<String>,
        param: Option<&str>,
        code: &'static str,
    ) -> Self {
        Self {
            code: Some(code),
            ..Self::invalid(message, param)
        }
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or incorrect API key: send the key given to --api-key as \
                      'Authorization: Bearer <key>'"
                .into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 404: unknown route.
    pub fn not_found(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "no route {path}; this server has POST /v1/chat/completions, POST /v1/completions, \
                 GET /v1/models, GET /v1/models/{{id}}, GET /health, GET /metrics, POST /tokenize, \
                 POST /detokenize"
            ),
            kind: "not_found_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 404: a model id this server does not serve.
    pub fn model_not_found(id: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("the model '{id}' does not exist here; this server serves '{served}' (GET /v1/models)"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// 503: the model is still loading or the engine has stopped.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 500: our failure (backend error), never the client's.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The envelope as JSON (also used inside SSE streams for errors after the headers went out).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(Envelope {
            error: Body {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .expect("envelope serializes")
    }
}

/// Marks a response that refused a request before any work (408, 413, 429), with its code, so the
/// server can count refusals in `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused(pub &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.to_json())).into_response();
        if matches!(self.status.as_u16(), 408 | 413 | 429) {
            r.extensions_mut()
                .insert(Refused(self.code.unwrap_or("refused")));
        }
        if let Some(secs) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        r
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_has_the_four_fields() {
        let e = ApiError::invalid("bad temperature", Some("temperature"));
        let v = e.to_json();
        assert_eq!(v["error"]["message"], "bad temperature");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "temperature");
        assert!(v["error"]["code"].is_null());
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn unauthorized_is_401() {
        let e = ApiError::unauthorized();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        assert_eq!(e.to_json()["error"]["code"], "invalid_api_key");
    }
}
