//! The chat page at `/` (`--no-webui` turns it off): one static page, its script and its style,
//! embedded in the binary (`runtime/server/webui/`), that talks to the server's own API. Served
//! with a Content-Security-Policy that allows only same-origin scripts, styles and requests (no
//! inline code, no other origin, no framing), so nothing but these files runs in the page.
//!
//! Invariants: the files need no API key (the page asks for one and sends it with its API calls);
//! nothing here reads a request body or touches the engine.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("../webui/index.html");
const SCRIPT: &str = include_str!("../webui/app.js");
const STYLE: &str = include_str!("../webui/app.css");

/// The page's policy: this origin's script, style and API alone.
pub const CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                       img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// The page's routes, for a router whose state is `S`.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { file("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/webui/app.js",
            get(|| async { file("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/webui/app.css",
            get(|| async { file("text/css; charset=utf-8", STYLE) }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_its_own_files_and_nothing_inline() {
        assert!(INDEX.contains(r#"<script src="/webui/app.js"></script>"#));
        assert!(INDEX.contains(r#"href="/webui/app.css""#));
        // the policy allows no inline script or style: the page has none
        assert!(
            !INDEX.contains("<script>") && !INDEX.contains("<style") && !INDEX.contains(" style=")
        );
        assert!(!INDEX.contains("onclick") && !INDEX.contains("onload"));
        assert!(CSP.contains("script-src 'self'") && !CSP.contains("unsafe"));
        // the script talks to this server's API only
        assert!(SCRIPT.contains(r#"fetch("/v1/chat/completions""#));
        assert!(!SCRIPT.contains("http://") && !SCRIPT.contains("https://"));
    }
}
