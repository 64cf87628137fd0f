//! Setting a link up: the channel binding, the server and the client.

use super::errors::{conn_error, explain, io_err};
use super::link::QuicDataLink;
use super::tls::{tls_err, ClusterTls};
use super::{
    BIND_LABEL, CODE_REFUSED, CODE_SHUTDOWN, EXPORTER_LABEL, MAX_PENDING_HANDSHAKES, SERVER_NAME,
};
use crate::error::{ProtocolError, TransportError};
use crate::handshake::{Role, Session};
use crate::key::{ct_eq, ClusterKey, HmacSha256};
use hmac::{KeyInit, Mac};
use quinn::VarInt;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The binding MAC one side sends: ties the RLHS session to this TLS session.
fn binding_mac(session_key: &[u8; 32], side: &[u8], exporter: &[u8; 32]) -> [u8; 32] {
    let mut m = match <HmacSha256 as KeyInit>::new_from_slice(session_key) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    m.update(BIND_LABEL);
    m.update(side);
    m.update(exporter);
    m.finalize().into_bytes().into()
}

/// Exchanges and checks the binding MACs on the handshake stream.
async fn bind_session(
    conn: &quinn::Connection,
    session: &Session,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    peer: &str,
) -> Result<(), TransportError> {
    let mut exporter = [0u8; 32];
    conn.export_keying_material(&mut exporter, EXPORTER_LABEL, b"")
        .map_err(|_| tls_err("TLS exporter", "unavailable"))?;
    let (ours, theirs): (&[u8], &[u8]) = if session.initiator {
        (b"client", b"server")
    } else {
        (b"server", b"client")
    };
    let mine = binding_mac(&session.session_key, ours, &exporter);
    send.write_all(&mine).await.map_err(|e| {
        io_err(
            ErrorKind::NotConnected,
            format!("sending the binding to {peer}: {e}"),
        )
    })?;
    let mut got = [0u8; 32];
    recv.read_exact(&mut got).await.map_err(|e| {
        io_err(
            ErrorKind::NotConnected,
            format!("reading the binding from {peer}: {e}"),
        )
    })?;
    if !ct_eq(&got, &binding_mac(&session.session_key, theirs, &exporter)) {
        return Err(TransportError::Protocol(ProtocolError::Auth(format!(
            "{peer}: the ringllm handshake is not bound to this TLS session (channel binding \
             mismatch: a relay or man in the middle holding the cluster key?)"
        ))));
    }
    Ok(())
}

/// Closes `conn` after a failed handshake so the peer learns why at once.
fn refuse(conn: &quinn::Connection, e: &TransportError) {
    let mut reason = e.to_string();
    if reason.len() > 400 {
        let mut end = 400;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    conn.close(VarInt::from_u32(CODE_REFUSED), reason.as_bytes());
}

fn describe(name: &str, addr: SocketAddr) -> String {
    if name.is_empty() {
        format!("{addr}")
    } else {
        format!("'{}' at {addr}", crate::untrusted::escape(name))
    }
}

/// A node's QUIC listener on UDP `addr` (socket with SO_REUSEADDR: other UDP sockets of the
/// node, connect()ed to single peers, share this port). Needs a tokio runtime.
pub struct QuicServer {
    endpoint: quinn::Endpoint,
    key: ClusterKey,
    name: String,
    results: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<Accepted>>,
    tx: tokio::sync::mpsc::UnboundedSender<Accepted>,
    closed: tokio::sync::watch::Sender<bool>,
    /// Dropped with the server: ends the task that refuses connections after `close`.
    alive: tokio::sync::watch::Sender<()>,
    pending: Arc<AtomicUsize>,
    rt: tokio::runtime::Handle,
}

type Accepted = Result<(QuicDataLink, Session, SocketAddr), TransportError>;

impl QuicServer {
    pub fn bind(
        addr: SocketAddr,
        key: &ClusterKey,
        name: &str,
    ) -> Result<QuicServer, TransportError> {
        let rt = tokio::runtime::Handle::try_current().map_err(|e| {
            io_err(
                ErrorKind::Other,
                format!("QuicServer::bind needs a tokio runtime: {e}"),
            )
        })?;
        let tls = ClusterTls::new(key, name)?;
        let socket = crate::sock::udp_socket(addr, true, true).map_err(|e| {
            io_err(
                e.kind(),
                format!("cannot bind the QUIC socket on UDP {addr}: {e}"),
            )
        })?;
        let endpoint = quinn::Endpoint::new(
            quinn::EndpointConfig::default(),
            Some(tls.server_config()?),
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(|e| {
            io_err(
                e.kind(),
                format!("cannot start the QUIC endpoint on {addr}: {e}"),
            )
        })?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        Ok(QuicServer {
            endpoint,
            key: key.clone(),
            name: name.to_string(),
            results: tokio::sync::Mutex::new(rx),
            tx,
            closed: tokio::sync::watch::Sender::new(false),
            alive: tokio::sync::watch::Sender::new(()),
            pending: Arc::new(AtomicUsize::new(0)),
            rt,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The next connection, authenticated (TLS with the cluster CA, RLHS, binding) within
    /// `timeout` of its first packet; `None` once the server is closed. A failed connection is
    /// returned as `Err` (the caller logs it and calls `accept` again). Handshakes run
    /// concurrently, so a slow or silent client does not hold up the others.
    pub async fn accept(&self, timeout: Duration, max_payload: u32) -> Option<Accepted> {
        let mut closed = self.closed.subscribe();
        let mut results = self.results.lock().await;
        loop {
            if *closed.borrow_and_update() {
                return None;
            }
            tokio::select! {
                biased;
                _ = closed.changed() => {}
                r = results.recv() => return r,
                incoming = self.endpoint.accept() => {
                    let incoming = incoming?;
                    if self.pending.load(Ordering::Relaxed) >= MAX_PENDING_HANDSHAKES {
                        tracing::warn!(
                            peer = %incoming.remote_address(),
                            "refusing a QUIC connection: {MAX_PENDING_HANDSHAKES} handshakes under way"
                        );
                        incoming.refuse();
                        continue;
                    }
                    self.pending.fetch_add(1, Ordering::Relaxed);
                    let pending = Arc::clone(&self.pending);
                    let tx = self.tx.clone();
                    let key = self.key.clone();
                    let name = self.name.clone();
                    tokio::spawn(async move {
                        let r = server_side(incoming, &key, &name, timeout, max_payload).await;
                        pending.fetch_sub(1, Ordering::Relaxed);
                        // The receiver lives as long as the server; after that nobody wants it.
                        let _ = tx.send(r);
                    });
                }
            }
        }
    }

    /// Stops accepting: `accept` returns `None` and new connection attempts are refused at
    /// once (CONNECTION_REFUSED) until the server is dropped. Links already accepted stay up.
    pub fn close(&self) {
        if self.closed.send_replace(true) {
            return;
        }
        let endpoint = self.endpoint.clone();
        let mut alive = self.alive.subscribe();
        self.rt.spawn(async move {
            loop {
                tokio::select! {
                    _ = alive.changed() => break,
                    incoming = endpoint.accept() => match incoming {
                        Some(i) => i.refuse(),
                        None => break,
                    },
                }
            }
        });
    }

    /// Stops accepting and closes every connection accepted here at once (for shutdown).
    pub fn close_all(&self) {
        self.close();
        self.endpoint
            .close(VarInt::from_u32(CODE_SHUTDOWN), b"node shutting down");
    }
}

async fn server_side(
    incoming: quinn::Incoming,
    key: &ClusterKey,
    name: &str,
    timeout: Duration,
    max_payload: u32,
) -> Accepted {
    let addr = incoming.remote_address();
    let peer = describe("", addr);
    let mut conn = None::<quinn::Connection>;
    let slot = &mut conn;
    let fut = async {
        let connecting = incoming
            .accept()
            .map_err(|e| conn_error(&e, &peer, "while accepting"))?;
        let c = connecting
            .await
            .map_err(|e| conn_error(&e, &peer, "during the TLS handshake"))?;
        *slot = Some(c.clone());
        let (send, recv) = c
            .accept_bi()
            .await
            .map_err(|e| conn_error(&e, &peer, "waiting for the handshake stream"))?;
        let mut s = tokio::io::join(recv, send);
        let session = crate::control_conn::server_handshake(&mut s, key, name)
            .await
            .map_err(|e| explain(&c, e, &peer))?;
        let (mut recv, mut send) = s.into_inner();
        let peer = describe(&session.peer.name, addr);
        bind_session(&c, &session, &mut send, &mut recv, &peer)
            .await
            .map_err(|e| explain(&c, e, &peer))?;
        let link = QuicDataLink::new(c, send, recv, None, max_payload, peer);
        Ok((link, session, addr))
    };
    let r = match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(TransportError::Timeout(
            timeout,
            "waiting for a QUIC client's TLS and ringllm handshakes",
        )),
    };
    if let (Err(e), Some(c)) = (&r, conn) {
        refuse(&c, e);
    }
    r
}

/// Connects to `addr` (host:port), authenticates both ways within `timeout`.
pub async fn connect(
    addr: &str,
    key: &ClusterKey,
    role: Role,
    name: &str,
    timeout: Duration,
    max_payload: u32,
) -> Result<(QuicDataLink, Session), TransportError> {
    let mut conn = None::<quinn::Connection>;
    let slot = &mut conn;
    let fut = async {
        let remote = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| io_err(e.kind(), format!("cannot resolve {addr}: {e}")))?
            .next()
            .ok_or_else(|| {
                io_err(
                    ErrorKind::NotFound,
                    format!("{addr} resolves to no address"),
                )
            })?;
        let peer = describe("", remote);
        let tls = ClusterTls::new(key, name)?;
        let local: SocketAddr = if remote.is_ipv6() {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let socket = crate::sock::udp_socket(local, false, true).map_err(|e| {
            io_err(
                e.kind(),
                format!("cannot open a UDP socket to reach {addr}: {e}"),
            )
        })?;
        let endpoint = quinn::Endpoint::new(
            quinn::EndpointConfig::default(),
            None,
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(|e| {
            io_err(
                e.kind(),
                format!("cannot start a QUIC endpoint to reach {addr}: {e}"),
            )
        })?;
        let connecting = endpoint
            .connect_with(tls.client_config()?, remote, SERVER_NAME)
            .map_err(|e| {
                io_err(
                    ErrorKind::InvalidInput,
                    format!("cannot connect to {peer}: {e}"),
                )
            })?;
        let c = connecting
            .await
            .map_err(|e| conn_error(&e, &peer, "during the TLS handshake"))?;
        *slot = Some(c.clone());
        let (send, recv) = c
            .open_bi()
            .await
            .map_err(|e| conn_error(&e, &peer, "opening the handshake stream"))?;
        let mut s = tokio::io::join(recv, send);
        let session = crate::control_conn::client_handshake(&mut s, key, role, name)
            .await
            .map_err(|e| explain(&c, e, &peer))?;
        let (mut recv, mut send) = s.into_inner();
        let peer = describe(&session.peer.name, remote);
        bind_session(&c, &session, &mut send, &mut recv, &peer)
            .await
            .map_err(|e| explain(&c, e, &peer))?;
        Ok((
            QuicDataLink::new(c, send, recv, Some(endpoint), max_payload, peer),
            session,
        ))
    };
    let r = match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(TransportError::Timeout(
            timeout,
            "connecting and authenticating over QUIC",
        )),
    };
    if let (Err(e), Some(c)) = (&r, conn) {
        refuse(&c, e);
    }
    r
}

/// Connects a data link (see `dial`): authenticates as `Role::Upstream` and sends its
/// `attach` message. Call from inside the runtime; use the link from plain threads.
pub async fn connect_data(
    addr: &str,
    key: &ClusterKey,
    name: &str,
    timeout: Duration,
    max_payload: u32,
    attach: &crate::control::Control,
) -> Result<QuicDataLink, TransportError> {
    let (mut link, _) = connect(addr, key, Role::Upstream, name, timeout, max_payload).await?;
    let (h, p) = attach.to_frame()?;
    link.io.write_frame(&h, &p).await?;
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binding_macs_depend_on_side_key_and_exporter() {
        let k = [7u8; 32];
        let x = [1u8; 32];
        let base = binding_mac(&k, b"client", &x);
        assert_eq!(base, binding_mac(&k, b"client", &x));
        assert_ne!(base, binding_mac(&k, b"server", &x));
        assert_ne!(base, binding_mac(&[8u8; 32], b"client", &x));
        assert_ne!(base, binding_mac(&k, b"client", &[2u8; 32]));
    }
}
