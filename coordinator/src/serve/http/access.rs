//! Who may call the API: the API key (`auth`) and the web origins (`allowed_origin`).

use super::{error_for, ApiError, Shared};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

/// `Authorization: Bearer KEY` on everything but `/health` when a key is set.
pub(super) async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, k)| k.trim());
        let ok = given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes()));
        if !ok {
            let message = if given.is_some() {
                "incorrect API key"
            } else {
                "an API key is needed: send `Authorization: Bearer KEY`"
            };
            let e = ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
                .code("invalid_api_key");
            return error_for(req.uri().path(), e);
        }
    }
    next.run(req).await
}

/// Refuses a request from a web page whose origin may not call the API (browsers send
/// `Origin` on cross-origin requests; other clients do not send it).
pub(super) async fn allowed_origin(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        if !s.cors.allows(origin) && !same_origin(origin, req.headers().get(header::HOST)) {
            let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
            let e = ApiError::new(
                StatusCode::FORBIDDEN,
                "invalid_request_error",
                format!(
                    "web pages from {origin} may not call this server: start it with \
                     --cors {origin} (or with an --api-key, which lets any origin in)"
                ),
            )
            .code("origin_not_allowed");
            return error_for(req.uri().path(), e);
        }
    }
    next.run(req).await
}

/// Whether a request comes from this server's own page (the chat page at `/`): its origin is
/// `http(s)://` + the `Host` it was sent to, and that host cannot be rebound by someone
/// else's DNS (an IP address, `localhost`, a name without dots, or a name under the
/// private-use `.local` (mDNS), `.home.arpa` or `.internal`). A
/// public DNS name could point at this server after a page of it loaded (DNS rebinding), so
/// such names need `--cors` or an API key as any other origin does.
fn same_origin(origin: &HeaderValue, host: Option<&HeaderValue>) -> bool {
    let (Ok(origin), Some(Ok(host))) = (origin.to_str(), host.map(HeaderValue::to_str)) else {
        return false;
    };
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    if !rest.is_some_and(|r| r.eq_ignore_ascii_case(host)) {
        return false;
    }
    if host.starts_with('[') {
        return true; // an IPv6 literal
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
    .to_ascii_lowercase();
    name.parse::<std::net::IpAddr>().is_ok()
        || name == "localhost"
        || name.ends_with(".localhost")
        || [".local", ".home.arpa", ".internal"]
            .iter()
            .any(|tld| name.ends_with(tld))
        || (!name.is_empty() && !name.contains('.'))
}

/// Compares without stopping at the first difference.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
