//! OpenAI-style errors (`ApiError`), and the JSON request body whose every failure is one.

use super::{anthropic, ollama};
use super::{Shared, BODY_LIMIT};
use crate::serve::SubmitError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An OpenAI-style error response.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) kind: &'static str,
    pub(super) message: String,
    pub(super) param: Option<&'static str>,
    pub(super) code: Option<&'static str>,
    pub(super) retry_after_s: Option<u64>,
}

impl ApiError {
    pub(super) fn new(
        status: StatusCode,
        kind: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// 400: the request itself is wrong.
    pub(super) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 500: the engine failed.
    pub(super) fn server(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The backend's error event: a 503 with `Retry-After` when the engine says retrying
    /// may work (the ring is down or being rebuilt), else a 500.
    pub(super) fn engine(message: String, retry_after_s: Option<u64>) -> ApiError {
        match retry_after_s {
            Some(s) => ApiError {
                retry_after_s: Some(s),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                    .code("engine_unavailable")
            },
            None => ApiError::server(message),
        }
    }

    pub(super) fn param(mut self, param: &'static str) -> ApiError {
        self.param = Some(param);
        self
    }

    pub(super) fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The `{"error": …}` object (also sent as an SSE chunk when a stream fails).
    pub(super) fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::QueueFull { retry_after_s } => ApiError {
                retry_after_s: Some(retry_after_s),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "every slot is busy and the queue is full; retry later",
                )
                .code("queue_full")
            },
            SubmitError::ShuttingDown => shutting_down(),
            SubmitError::Invalid(m) => ApiError::invalid(m),
        }
    }
}

pub(super) fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the server is shutting down",
    )
    .code("shutting_down")
}

/// A JSON request body whose every failure (not JSON, wrong types, too large) is an
/// OpenAI-style error instead of axum's plain-text rejection. The Content-Type is not
/// checked: curl users often leave it out.
/// A body that does not arrive within `body_timeout` is a 408.
pub(super) struct JsonBody<T>(pub(super) T);

impl<T: serde::de::DeserializeOwned> FromRequest<Shared> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Shared) -> Result<Self, ApiError> {
        let limit = state.body_timeout;
        let read = tokio::time::timeout(limit, Bytes::from_request(req, state));
        let bytes = read.await.map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    limit.as_secs_f64()
                ),
            )
            .code("body_timeout")
        })?;
        let bytes = bytes.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                too_large()
            } else {
                ApiError::new(r.status(), "invalid_request_error", r.body_text())
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::invalid(format!("the request body is not valid: {e}")))
    }
}

/// A JSON 413 at once when Content-Length is over the limit (a body without a length is
/// cut off by `DefaultBodyLimit` while it is read).
pub(super) async fn reject_large(req: Request, next: Next) -> Response {
    let length = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if length.is_some_and(|n| n > BODY_LIMIT as u64) {
        return error_for(req.uri().path(), too_large());
    }
    next.run(req).await
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body is larger than {} MiB", BODY_LIMIT >> 20),
    )
    .code("request_too_large")
}

/// An error in the shape its API uses: Ollama's `{"error": "…"}` under `/api/`,
/// Anthropic's under `/v1/messages`, else OpenAI's.
pub(super) fn error_for(path: &str, e: ApiError) -> Response {
    if path.starts_with("/api/") {
        ollama::OllamaError(e).into_response()
    } else if anthropic::owns(path) {
        anthropic::AnthropicError(e).into_response()
    } else {
        e.into_response()
    }
}
