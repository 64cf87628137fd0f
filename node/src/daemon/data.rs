//! Data links: over TCP (and io_uring, and the anchors of reliable UDP) from this listener,
//! over QUIC from its endpoint; each reads its `Attach` and is handed to its session's
//! compute thread.

use super::state::Node;
use super::worker::Attached;
use super::{HANDSHAKE_TIMEOUT, MAX_PAYLOAD, TAKEOVER_WAIT};
use ringllm_protocol::dial::{self, AttachInfo, BoxLink};
use ringllm_protocol::untrusted::escape;
use ringllm_protocol::{QuicServer, Role, TransportError, TransportKind};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// A data link: reads its `Attach` and hands it to the session's compute thread.
pub(super) async fn data_conn(
    node: Arc<Node>,
    stream: tokio::net::TcpStream,
    hs: ringllm_protocol::handshake::Session,
    peer: std::net::SocketAddr,
) {
    let who = format!("data link from '{}' ({peer})", escape(&hs.peer.name));
    let uring = node.opts.transport == TransportKind::Uring;
    attach_link(node, who, move || {
        let stream = stream.into_std()?;
        dial::accept_tcp_data(stream, &hs, MAX_PAYLOAD, HANDSHAKE_TIMEOUT, uring)
    })
    .await
}

/// Data links arriving over QUIC, until the daemon shuts down (then the endpoint closes, and
/// every QUIC link with it).
pub(super) async fn quic_accept_loop(node: Arc<Node>, server: QuicServer) {
    loop {
        let accepted = node
            .until_stopped(server.accept(HANDSHAKE_TIMEOUT, MAX_PAYLOAD))
            .await;
        let (link, hs, peer) = match accepted {
            None => {
                server.close_all();
                return;
            }
            Some(None) => return,
            Some(Some(Ok(x))) => x,
            Some(Some(Err(e))) => {
                node.refusals
                    .refused(None, || format!("refused QUIC connection: {e}"));
                continue;
            }
        };
        if hs.peer.role != Role::Upstream {
            warn!(
                "refused QUIC connection from '{}' ({peer}): only data links use QUIC; the \
                 control connection is TCP",
                escape(&hs.peer.name)
            );
            continue;
        }
        let who = format!("data link from '{}' ({peer})", escape(&hs.peer.name));
        let n = Arc::clone(&node);
        tokio::spawn(async move {
            let attach = attach_link(Arc::clone(&n), who, move || {
                dial::accept_quic_data(link, HANDSHAKE_TIMEOUT)
            });
            n.until_stopped(attach).await
        });
    }
}

/// Finishes a data link (blocking, off the runtime) and hands it to its session.
async fn attach_link(
    node: Arc<Node>,
    who: String,
    open: impl FnOnce() -> Result<(BoxLink, AttachInfo), TransportError> + Send + 'static,
) {
    let (link, info) = match tokio::task::spawn_blocking(open).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            warn!("{who}: {e}");
            return;
        }
        Err(e) => {
            warn!("{who}: {e}");
            return;
        }
    };
    let who = format!("{who} over {}", link.transport());
    let AttachInfo {
        session,
        from,
        role,
        ..
    } = info;
    let (input, output) = (role.input(), role.output());
    let mut link = Some(link);
    // The assignment may still be loading here: wait a little for it.
    let deadline = Instant::now() + TAKEOVER_WAIT;
    loop {
        let notified = node.changed.notified();
        let sent = {
            let st = node.lock();
            match (st.session.as_ref().filter(|s| s.id == session), link.take()) {
                (Some(s), Some(link)) => {
                    let _ = s.attach.send(Attached {
                        link,
                        input,
                        output,
                        from: from.clone(),
                    });
                    true
                }
                (_, l) => {
                    link = l;
                    false
                }
            }
        };
        if sent {
            info!("{who} attached to session {session} (input {input}, output {output})");
            return;
        }
        if Instant::now() >= deadline {
            warn!("{who}: no session {session} here");
            return;
        }
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}
