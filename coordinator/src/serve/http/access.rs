//! Who may call the API: the API key (`auth`), the `Host` a server without a key answers to
//! (`allowed_host`) and the web origins (`allowed_origin`).

use super::{error_for, ApiError, Shared};
use anyhow::{bail, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use std::net::IpAddr;

/// The API key, kept only as a digest: a request's key is hashed and the two fixed-size
/// digests compared in constant time, so how long the comparison takes says nothing about
/// the key, not even its length.
#[derive(Clone)]
pub(super) struct ApiKey(blake3::Hash);

impl ApiKey {
    pub(super) fn new(key: &str) -> ApiKey {
        ApiKey(blake3::hash(key.as_bytes()))
    }

    /// Whether `given` is the key (`blake3::Hash`'s equality is constant-time).
    pub(super) fn matches(&self, given: &[u8]) -> bool {
        blake3::hash(given) == self.0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

/// `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on everything but `/health`
/// when a key is set.
pub(super) async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let h = req.headers();
        let bearer = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, k)| k.trim().as_bytes());
        let x_api_key = h.get("x-api-key").map(|v| v.as_bytes());
        let given: Vec<&[u8]> = bearer.into_iter().chain(x_api_key).collect();
        if !given.iter().any(|g| key.matches(g)) {
            let message = if given.is_empty() {
                "an API key is needed: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)"
            } else {
                "incorrect API key"
            };
            let e = ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
                .code("invalid_api_key");
            return error_for(req.uri().path(), e);
        }
    }
    next.run(req).await
}

/// The host names a server answers to: the address it is bound to (any address of this
/// machine when bound to `0.0.0.0` or `::`), `localhost` and `*.localhost` when it listens on
/// loopback, and the names given with `--allow-host`.
///
/// Why: a page of another site can make its own name point at this server once the page has
/// loaded (DNS rebinding); the browser then treats the server as that site and lets the page
/// read what it answers. The browser still sends the page's name as `Host`, so a server
/// without an API key refuses names it was not told about. An IP address cannot be rebound,
/// and browsers resolve `localhost` themselves, never through DNS.
#[derive(Clone, Debug)]
pub(super) struct Hosts {
    bound: IpAddr,
    /// `--allow-host` names, lowercased, without port or trailing dot.
    named: Vec<String>,
    /// `--allow-host '*'`: every name.
    any: bool,
}

impl Hosts {
    pub(super) fn new(bound: IpAddr, allow: &[String]) -> Result<Hosts> {
        let mut named = Vec::new();
        let mut any = false;
        for a in allow {
            if a == "*" {
                any = true;
                continue;
            }
            match host_name(a) {
                Some(n) if !n.is_empty() && n.bytes().all(host_byte) => named.push(n),
                _ => bail!(
                    "--allow-host {a:?} is not a host name: give a name or an address as \
                     clients write it in their URLs (gpu-box.local, llm.example.com, 10.0.0.5), \
                     or `*` for any"
                ),
            }
        }
        Ok(Hosts { bound, named, any })
    }

    /// Whether a request with this `Host` header may be answered (none: not a browser).
    pub(super) fn allows(&self, host: Option<&HeaderValue>) -> bool {
        let Some(host) = host else {
            return true;
        };
        let Some(name) = host.to_str().ok().and_then(host_name) else {
            return false;
        };
        if self.any || self.named.contains(&name) {
            return true;
        }
        let listens_on_loopback = self.bound.is_loopback() || self.bound.is_unspecified();
        match name.parse::<IpAddr>() {
            Ok(ip) => {
                ip == self.bound
                    || self.bound.is_unspecified()
                    || (self.bound.is_loopback() && ip.is_loopback())
            }
            Err(_) => listens_on_loopback && (name == "localhost" || name.ends_with(".localhost")),
        }
    }
}

/// Bytes of a host name or address (IPv6 ones without brackets).
fn host_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':')
}

/// The name or address of a `Host` header: lowercased, without its port, an IPv6 address
/// without brackets, a fully qualified name without its trailing dot. `None`: not a host.
fn host_name(host: &str) -> Option<String> {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        if !(after.is_empty() || port(after.strip_prefix(':')?)) {
            return None;
        }
        inside
    } else {
        match host.rsplit_once(':') {
            Some((name, p)) if port(p) && !name.contains(':') => name,
            Some(_) => return None,
            None => host,
        }
    };
    Some(name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase())
}

fn port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

/// Refuses a request to a server without an API key whose `Host` is not one of its names (see
/// `Hosts`), before anything else runs.
pub(super) async fn allowed_host(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let host = req.headers().get(header::HOST);
    if s.api_key.is_some() || s.hosts.allows(host) {
        return next.run(req).await;
    }
    let shown = host.map_or_else(String::new, |h| {
        String::from_utf8_lossy(h.as_bytes())
            .escape_debug()
            .to_string()
    });
    let name = host
        .and_then(|h| h.to_str().ok())
        .and_then(host_name)
        .filter(|n| n.bytes().all(host_byte))
        .unwrap_or_else(|| "NAME".into());
    tracing::debug!("refused a request for the host {shown:?}");
    let e = ApiError::new(
        StatusCode::FORBIDDEN,
        "invalid_request_error",
        format!(
            "this server does not answer to the host name in `Host: {shown}` (it answers to \
             the address it listens on{}): if that name is this machine's, start the server \
             with --allow-host {name} (or with an --api-key)",
            if s.hosts.bound.is_loopback() || s.hosts.bound.is_unspecified() {
                " and localhost"
            } else {
                ""
            }
        ),
    )
    .code("host_not_allowed");
    error_for(req.uri().path(), e)
}

/// Refuses a request from a web page whose origin may not call the API (browsers send
/// `Origin` on cross-origin requests; other clients do not send it).
pub(super) async fn allowed_origin(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let host = req.headers().get(header::HOST);
        if !s.cors.allows(origin) && !same_origin(origin, host, &s.hosts) {
            let origin = String::from_utf8_lossy(origin.as_bytes())
                .escape_debug()
                .to_string();
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
/// `http(s)://` + the `Host` it was sent to, and that host is one of the server's own names
/// (`Hosts`: its address, localhost, `--allow-host`), which no stranger's DNS can make
/// another site's.
fn same_origin(origin: &HeaderValue, host: Option<&HeaderValue>, hosts: &Hosts) -> bool {
    let (Ok(origin), Some(Ok(h))) = (origin.to_str(), host.map(HeaderValue::to_str)) else {
        return false;
    };
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    rest.is_some_and(|r| r.eq_ignore_ascii_case(h)) && hosts.allows(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(bound: &str, allow: &[&str]) -> Hosts {
        let allow: Vec<String> = allow.iter().map(|s| s.to_string()).collect();
        Hosts::new(bound.parse().unwrap(), &allow).unwrap()
    }

    fn allows(h: &Hosts, host: &str) -> bool {
        h.allows(Some(&HeaderValue::from_str(host).unwrap()))
    }

    #[test]
    fn a_server_answers_to_its_address_loopback_names_and_allowed_hosts_only() {
        let lo = hosts("127.0.0.1", &["gpu-box.local"]);
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.2",
            "localhost:8080",
            "LOCALHOST.",
            "app.localhost:1",
            "gpu-box.local:8080",
            "GPU-BOX.LOCAL",
        ] {
            assert!(allows(&lo, ok), "{ok}");
        }
        for no in [
            "evil.example:8080",
            "gpu-box:8080",
            "other.local",
            "localhost.evil.example",
            "10.0.0.5:8080",
            "127.0.0.1:8080:9",
            "[::1",
            "",
        ] {
            assert!(!allows(&lo, no), "{no}");
        }
        let lan = hosts("192.168.1.20", &[]);
        assert!(allows(&lan, "192.168.1.20:8080"));
        assert!(!allows(&lan, "localhost:8080"));
        assert!(!allows(&lan, "gpu-box.local"));
        let all = hosts("::", &["llm.example.com:443"]);
        for ok in [
            "10.1.2.3:80",
            "[fe80::1]:8080",
            "localhost",
            "llm.example.com",
        ] {
            assert!(allows(&all, ok), "{ok}");
        }
        assert!(!allows(&all, "gpu-box"));
        assert!(allows(&hosts("192.168.1.20", &["*"]), "anything.example"));
        assert!(
            lo.allows(None),
            "clients that send no Host are not browsers"
        );
        assert!(Hosts::new("127.0.0.1".parse().unwrap(), &["http://x/".into()]).is_err());
    }

    #[test]
    fn the_key_matches_only_itself() {
        let k = ApiKey::new("sekrit");
        assert!(k.matches(b"sekrit"));
        for no in [&b"sekri"[..], b"sekrit ", b"Sekrit", b""] {
            assert!(!k.matches(no));
        }
    }

    /// The old comparison returned at once when the lengths differed, so a client could find
    /// the key's length by timing its refusals. Now only the key's digest is kept, one size
    /// whatever the key's length, and a given key is hashed whole and compared digest to
    /// digest (`blake3::Hash`'s equality is constant-time): what a refusal costs depends on
    /// the given key alone. (Checked structurally: a test that timed refusals would depend on
    /// the machine's load.)
    #[test]
    fn only_a_fixed_size_digest_of_the_key_is_kept() {
        assert_eq!(std::mem::size_of::<ApiKey>(), 32);
        let (short, long) = (ApiKey::new("y"), ApiKey::new(&"y".repeat(1 << 16)));
        assert!(short.matches(b"y") && !short.matches("y".repeat(1 << 16).as_bytes()));
        assert!(long.matches("y".repeat(1 << 16).as_bytes()) && !long.matches(b"y"));
        assert_eq!(format!("{short:?}"), format!("{long:?}"));
    }
}
