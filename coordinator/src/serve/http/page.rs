//! The chat page at `/`: three hand-written static files (HTML, CSS, JavaScript) compiled into
//! the binary. The page talks to this server's own `/v1/chat/completions` (streamed) and
//! polls `/v1/models` and `/health` every 5 s and `/v1/cluster` (when the server has it)
//! every 15 s, and nothing while the page is hidden: the nodes' status costs the ring a
//! connection to every node. It is served
//! without the API key (it holds no data); the API calls it makes need the key, which the
//! page asks for on a 401 and keeps in the browser's localStorage.
//!
//! Every file goes out with a Content-Security-Policy that allows only this origin's own
//! scripts, styles and API: no inline script, no other host.

use super::Shared;
use axum::http::{header, HeaderName};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("page/index.html");
const CSS: &str = include_str!("page/chat.css");
const JS: &str = include_str!("page/chat.js");

/// Scripts, styles and requests from this origin only; no frames, forms, plugins or `<base>`.
pub(super) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route(
            "/",
            get(|| async { file("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/chat.css",
            get(|| async { file("text/css; charset=utf-8", CSS) }),
        )
        .route(
            "/chat.js",
            get(|| async { file("text/javascript; charset=utf-8", JS) }),
        )
}

fn file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
            (HeaderName::from_static("x-frame-options"), "DENY"),
        ],
        body,
    )
        .into_response()
}
