//! `GET /v1/cluster`: every node of a serving ring, asked over its status connection as
//! `ringllm status` asks it (the same JSON, `cluster::status::ClusterReport`), with the
//! coordinator's own line. A node answers while this coordinator holds it.
//!
//! Asking means a connection and a handshake to every node, on the nodes' CPUs too, so the
//! nodes' answers are kept for `FRESH` and one refresh runs at a time: a busy dashboard (or a
//! flood of requests) costs the ring at most one round of questions a second, whatever the
//! request rate. While a refresh runs, other requests get the last answers (or, before the
//! first one, wait for it). The coordinator's own line is always current.

use super::{ApiError, Shared};
use crate::cluster::status::{self, ClusterReport, ClusterView, CoordinatorReport, NodeReport};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the nodes' answers are served again before they are asked anew.
pub(super) const FRESH: Duration = Duration::from_secs(1);

/// The nodes' last answers and the one refresh that may run.
#[derive(Default)]
pub(super) struct StatusCache {
    last: Mutex<Option<Snapshot>>,
    /// Held (by a task of its own, so a client leaving does not abandon it) while the nodes
    /// are asked.
    refresh: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Clone)]
struct Snapshot {
    at: Instant,
    /// The addresses asked: a different node list makes the snapshot stale.
    addresses: Vec<String>,
    nodes: Arc<Vec<NodeReport>>,
}

impl StatusCache {
    /// The last answers if they are of these nodes and, when `fresh_only`, younger than
    /// `FRESH`.
    fn get(&self, addresses: &[String], fresh_only: bool) -> Option<Arc<Vec<NodeReport>>> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.as_ref()
            .filter(|s| s.addresses == addresses && (!fresh_only || s.at.elapsed() < FRESH))
            .map(|s| Arc::clone(&s.nodes))
    }

    fn put(&self, addresses: Vec<String>, nodes: Arc<Vec<NodeReport>>) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Snapshot {
            at: Instant::now(),
            addresses,
            nodes,
        });
    }

    /// The nodes' answers: fresh ones from the cache; else this request asks the nodes, or,
    /// when another request is asking already, gets the last answers (or waits for the
    /// running question when there are none yet).
    async fn nodes(self: &Arc<Self>, view: &ClusterView) -> Arc<Vec<NodeReport>> {
        let addresses: Vec<String> = view.nodes.iter().map(|(_, a)| a.clone()).collect();
        if let Some(n) = self.get(&addresses, true) {
            return n;
        }
        let guard = match Arc::clone(&self.refresh).try_lock_owned() {
            Ok(g) => g,
            Err(_) => {
                if let Some(n) = self.get(&addresses, false) {
                    return n;
                }
                Arc::clone(&self.refresh).lock_owned().await
            }
        };
        // A refresh that finished while this request waited for the lock is fresh enough.
        if let Some(n) = self.get(&addresses, true) {
            return n;
        }
        let (cache, view2, asked) = (Arc::clone(self), view.clone(), addresses.clone());
        let task = tokio::spawn(async move {
            let _held = guard;
            let nodes = Arc::new(ask(&view2, &asked).await);
            cache.put(asked, Arc::clone(&nodes));
            nodes
        });
        task.await.unwrap_or_else(|e| {
            let failed = |a: &String| NodeReport {
                address: a.clone(),
                name: a.clone(),
                health: "error".into(),
                error: Some(format!("the status query failed: {e}")),
                ..NodeReport::default()
            };
            Arc::new(addresses.iter().map(failed).collect())
        })
    }
}

/// Every node's status; a node that did not answer keeps the name the cluster gave it.
async fn ask(view: &ClusterView, addresses: &[String]) -> Vec<NodeReport> {
    let me = status::asker_name("coordinator");
    let mut nodes = status::query_all(addresses, &view.key, &me).await;
    for (n, (label, _)) in nodes.iter_mut().zip(&view.nodes) {
        if n.error.is_some() && n.name == n.address {
            n.name = label.clone();
        }
    }
    nodes
}

pub(super) async fn cluster(State(s): State<Shared>) -> Response {
    let Some(view) = s.backend.cluster() else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "this server runs the model on one machine: there is no cluster",
        )
        .into_response();
    };
    let nodes = s.cluster_status.nodes(&view).await;
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
    Json(ClusterReport {
        coordinator: Some(CoordinatorReport {
            model: s.backend.model_id(),
            status: state.into(),
            ring: h.nodes,
            missing: h.missing,
        }),
        nodes: nodes.as_ref().clone(),
    })
    .into_response()
}
