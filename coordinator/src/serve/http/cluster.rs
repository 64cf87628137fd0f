//! `GET /v1/cluster`: every node of a serving ring, asked over its status connection as
//! `ringllm status` asks it (the same JSON, `cluster::status::ClusterReport`), with the
//! coordinator's own line. A node answers while this coordinator holds it.

use super::{ApiError, Shared};
use crate::cluster::status::{self, ClusterReport, CoordinatorReport};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::atomic::Ordering;

pub(super) async fn cluster(State(s): State<Shared>) -> Response {
    let Some(view) = s.backend.cluster() else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "this server runs the model on one machine: there is no cluster",
        )
        .into_response();
    };
    let h = s.backend.health();
    let state = if s.draining.load(Ordering::SeqCst) {
        "shutting_down"
    } else {
        match (h.ready, h.missing.is_empty()) {
            (false, _) => "unavailable",
            (true, false) => "degraded",
            (true, true) => "ok",
        }
    };
    let addrs: Vec<String> = view.nodes.iter().map(|(_, a)| a.clone()).collect();
    let mut nodes = status::query_all(&addrs, &view.key, &status::asker_name("coordinator")).await;
    // A node that did not answer keeps the name the cluster gave it.
    for (n, (label, _)) in nodes.iter_mut().zip(&view.nodes) {
        if n.error.is_some() && n.name == n.address {
            n.name = label.clone();
        }
    }
    Json(ClusterReport {
        coordinator: Some(CoordinatorReport {
            model: s.backend.model_id(),
            status: state.into(),
            ring: h.nodes,
            missing: h.missing,
        }),
        nodes,
    })
    .into_response()
}
