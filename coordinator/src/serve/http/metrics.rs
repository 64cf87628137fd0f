//! The Prometheus `/metrics` endpoint.

use super::{ApiError, Shared};
use crate::serve::Metrics;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::fmt::Write as _;
use std::sync::Arc;

pub(super) async fn metrics(State(s): State<Shared>) -> Response {
    let b = Arc::clone(&s.backend);
    let m = match tokio::task::spawn_blocking(move || b.metrics()).await {
        Ok(m) => m,
        Err(e) => return ApiError::server(format!("metrics failed: {e}")).into_response(),
    };
    let content_type = "text/plain; version=0.0.4; charset=utf-8";
    ([(header::CONTENT_TYPE, content_type)], prometheus_text(&m)).into_response()
}

/// The Prometheus text exposition of `m`.
fn prometheus_text(m: &Metrics) -> String {
    let mut out = String::new();
    let mut one = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(out, "{name} {}", prom_value(value));
    };
    let counters = [
        (
            "ringllm_requests_total",
            "Generation requests accepted.",
            m.requests_total,
        ),
        (
            "ringllm_requests_failed_total",
            "Generation requests that ended in an error.",
            m.requests_failed,
        ),
        (
            "ringllm_prompt_tokens_total",
            "Prompt tokens of accepted requests.",
            m.prompt_tokens_total,
        ),
        (
            "ringllm_completion_tokens_total",
            "Tokens generated.",
            m.completion_tokens_total,
        ),
    ];
    for (name, help, v) in counters {
        one(name, "counter", help, v as f64);
    }
    let grammar = [
        (
            "ringllm_grammar_masks_total",
            "Token masks computed for constrained requests (JSON schemas, tool calls).",
            m.grammar_masks_total as f64,
        ),
        (
            "ringllm_grammar_mask_seconds_total",
            "Seconds spent computing token masks, beside the forward pass.",
            m.grammar_mask_seconds_total,
        ),
        (
            "ringllm_grammar_wait_seconds_total",
            "Seconds sampling waited for a token mask not ready when the logits were.",
            m.grammar_wait_seconds_total,
        ),
    ];
    for (name, help, v) in grammar {
        one(name, "counter", help, v);
    }
    let gauges = [
        (
            "ringllm_queue_depth",
            "Requests waiting for a slot.",
            m.queue_depth as f64,
        ),
        (
            "ringllm_slots_total",
            "Sequences that can run at once.",
            m.slots_total as f64,
        ),
        (
            "ringllm_slots_busy",
            "Slots running a sequence.",
            m.slots_busy as f64,
        ),
        (
            "ringllm_decode_tokens_per_second",
            "Tokens generated per second over the last few seconds, all sequences together.",
            m.decode_tokens_per_s,
        ),
    ];
    for (name, help, v) in gauges {
        one(name, "gauge", help, v);
    }
    let name = "ringllm_node_latency_ms";
    let _ = writeln!(
        out,
        "# HELP {name} Mean milliseconds per hop of the last frames, per node.\n# TYPE {name} gauge"
    );
    for (node, ms) in &m.node_latency_ms {
        let _ = writeln!(
            out,
            "{name}{{node=\"{}\"}} {}",
            prom_label(node),
            prom_value(*ms)
        );
    }
    out
}

fn prom_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        v.to_string()
    }
}

fn prom_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
