//! QUIC transport (quinn on tokio): confidentiality and integrity on untrusted networks from
//! nothing but the cluster key file.
//!
//! # Certificates
//! Every process derives the same cluster CA from the key: an Ed25519 key whose seed is
//! `key.mac("ringllm quic ca v1")`, in a self-signed certificate with fixed parameters. It then
//! makes a fresh random Ed25519 leaf key and a certificate for it signed by that CA, with the
//! fixed name `SERVER_NAME`. TLS 1.3 (rustls, ring provider) runs with mutual authentication:
//! each side accepts only a chain to the cluster CA, so a machine without the key can neither
//! accept nor open a connection, nor read or alter one in flight. Session resumption and 0-RTT
//! are off: every connection does the full certificate exchange.
//!
//! # Handshake
//! On the first bidirectional stream (opened by the client), our RLHS handshake runs as on TCP
//! (`control_conn::client_handshake` / `control_conn::server_handshake`: peer name, role, cluster id, session
//! key). It is then bound to the TLS session: each side sends
//! `HMAC(session_key, BIND_LABEL ‖ "client"|"server" ‖ exporter)`, where `exporter` is the TLS
//! exporter value of this connection, and checks the peer's; a mismatch closes the connection.
//!
//! # Frames
//! The same stream then carries frames exactly as TCP does — 40-byte header and payload —
//! without the per-frame seal, since TLS already authenticates and encrypts every packet.
//! `QuicDataLink` is the blocking `DataLink` over it for the data plane's plain threads.
//!
//! # Transport parameters (`transport_config`)
//! One connection per link and one stream per connection; no datagrams. Windows of
//! `STREAM_WINDOW` (stream) and `CONNECTION_WINDOW` (connection, and the send buffer) so a
//! 64 MiB frame streams without flow-control stalls, while a receiver that stops reading holds
//! its sender back after that much. Keep-alives every `KEEP_ALIVE`, idle timeout
//! `IDLE_TIMEOUT` (a dead peer is noticed within seconds), initial RTT `INITIAL_RTT`. Cubic
//! congestion control, path MTU discovery from 1200 up to 1452 bytes (quinn's defaults), GSO
//! where the kernel has it.

use crate::blocking::{DataLink, LinkCloser};
use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, HEADER_LEN};
use crate::handshake::{Role, Session};
use crate::key::{ct_eq, ClusterKey, HmacSha256};
use crate::transport::{LinkCounters, TransportKind};
use hmac::{KeyInit, Mac};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{ConnectionError, IdleTimeout, ReadError, ReadExactError, VarInt, WriteError};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The DNS name in every leaf certificate, and the name clients ask for.
pub const SERVER_NAME: &str = "ringllm.cluster";
/// The one ALPN protocol both sides offer.
pub const ALPN: &[u8] = b"ringllm/1";
/// Label of the TLS exporter value the RLHS session is bound to.
const EXPORTER_LABEL: &[u8] = b"EXPORTER-ringllm-quic-binding-v1";
/// Label of the binding MACs.
const BIND_LABEL: &[u8] = b"ringllm quic binding v1\0";
/// Label of the cluster CA's key derivation.
const CA_LABEL: &[u8] = b"ringllm quic ca v1";

/// No packet from the peer for this long ends the connection (a crashed machine, a pulled
/// cable). Both sides send keep-alives every `KEEP_ALIVE`.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// Flow-control window of the frame stream: what may be in flight (or buffered at a receiver
/// that is not reading) per link. Far above a LAN's bandwidth-delay product (10 Gbit/s × 1 ms
/// is 1.25 MB), so a large frame streams at line rate.
pub const STREAM_WINDOW: u32 = 16 << 20;
/// Connection-level receive window and send buffer.
pub const CONNECTION_WINDOW: u32 = 32 << 20;
/// Starting RTT estimate before the first sample (quinn's default, 333 ms, is for the
/// Internet; a LAN answers in well under a millisecond).
pub const INITIAL_RTT: Duration = Duration::from_millis(10);
/// Connections still in their handshakes that a server works on at once; more are refused.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// How long a dropped link keeps delivering what it had sent before it closes.
const LINGER: Duration = Duration::from_secs(5);
/// Payloads up to this size go out in one write with their header.
const COALESCE: usize = 64 << 10;

/// Application close codes (on the wire, in CONNECTION_CLOSE).
const CODE_DONE: u32 = 0;
const CODE_CLOSED: u32 = 1;
const CODE_REFUSED: u32 = 2;
const CODE_SHUTDOWN: u32 = 3;

/// The rustls crypto provider: ring, with its default TLS 1.3 suites and groups.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Protocol(ProtocolError::Handshake(format!(
        "QUIC/TLS setup: {what}: {e}"
    )))
}

/// The PKCS#8 (RFC 8410, version 1) document of the Ed25519 key with this seed.
fn ed25519_pkcs8(seed: &[u8; 32]) -> Vec<u8> {
    // SEQUENCE { INTEGER 0, SEQUENCE { OID 1.3.101.112 }, OCTET STRING { OCTET STRING seed } }
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(seed);
    der
}

/// The cluster CA: its certificate parameters and key, the same in every process holding
/// the same key.
fn cluster_ca_parts(
    key: &ClusterKey,
) -> Result<(rcgen::CertificateParams, rcgen::KeyPair), TransportError> {
    let seed = key.mac(&[CA_LABEL]);
    let pkcs8 = PrivatePkcs8KeyDer::from(ed25519_pkcs8(&seed));
    let ca_key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
        .map_err(|e| tls_err("deriving the cluster CA key", e))?;
    let mut p = rcgen::CertificateParams::default();
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(4000, 1, 1);
    p.serial_number = Some(rcgen::SerialNumber::from_slice(&[1]));
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("ringllm cluster {} CA", key.id_hex()),
    );
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ok((p, ca_key))
}

/// The cluster CA certificate derived from `key` (DER). Deterministic: every holder of the
/// key derives the same bytes.
pub fn cluster_ca(key: &ClusterKey) -> Result<CertificateDer<'static>, TransportError> {
    let (p, k) = cluster_ca_parts(key)?;
    let cert = p
        .self_signed(&k)
        .map_err(|e| tls_err("signing the cluster CA certificate", e))?;
    Ok(cert.der().clone())
}

/// One process's TLS identity: the cluster CA and a fresh leaf key and certificate.
pub struct ClusterTls {
    ca: CertificateDer<'static>,
    leaf: CertificateDer<'static>,
    leaf_key: Vec<u8>,
}

impl ClusterTls {
    /// Derives the CA from `key` and makes a random leaf certificate signed by it (`name`
    /// goes into the leaf's common name, for humans reading a capture).
    pub fn new(key: &ClusterKey, name: &str) -> Result<ClusterTls, TransportError> {
        let (ca_params, ca_key) = cluster_ca_parts(key)?;
        let ca = ca_params
            .self_signed(&ca_key)
            .map_err(|e| tls_err("signing the cluster CA certificate", e))?;
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let leaf_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
            .map_err(|e| tls_err("generating a certificate key", e))?;
        let mut p = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()])
            .map_err(|e| tls_err("certificate parameters", e))?;
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(4000, 1, 1);
        p.distinguished_name = rcgen::DistinguishedName::new();
        let cn: String = format!("ringllm node {name}").chars().take(64).collect();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.is_ca = rcgen::IsCa::ExplicitNoCa;
        p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        let leaf = p
            .signed_by(&leaf_key, &issuer)
            .map_err(|e| tls_err("signing our certificate", e))?;
        Ok(ClusterTls {
            ca: ca.der().clone(),
            leaf: leaf.der().clone(),
            leaf_key: leaf_key.serialize_der(),
        })
    }

    /// The cluster CA certificate.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.ca
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, TransportError> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(|e| tls_err("trusting the cluster CA", e))?;
        Ok(Arc::new(roots))
    }

    fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.clone()))
    }

    /// rustls client configuration: TLS 1.3 only, the server must chain to the cluster CA, we
    /// present our leaf certificate, no resumption or early data.
    pub fn rustls_client(&self) -> Result<rustls::ClientConfig, TransportError> {
        let provider = crypto_provider();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(|e| tls_err("server certificate verifier", e))?;
        let mut c = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("TLS 1.3", e))?
            .with_webpki_verifier(verifier)
            .with_client_auth_cert(vec![self.leaf.clone()], self.key_der())
            .map_err(|e| tls_err("our client certificate", e))?;
        c.alpn_protocols = vec![ALPN.to_vec()];
        c.resumption = rustls::client::Resumption::disabled();
        c.enable_early_data = false;
        Ok(c)
    }

    /// rustls server configuration: TLS 1.3 only, clients must present a certificate chaining
    /// to the cluster CA, no session tickets or early data.
    pub fn rustls_server(&self) -> Result<rustls::ServerConfig, TransportError> {
        let provider = crypto_provider();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(|e| tls_err("client certificate verifier", e))?;
        let mut s = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("TLS 1.3", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.leaf.clone()], self.key_der())
            .map_err(|e| tls_err("our server certificate", e))?;
        s.alpn_protocols = vec![ALPN.to_vec()];
        s.max_early_data_size = 0;
        s.send_tls13_tickets = 0;
        s.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        Ok(s)
    }

    pub fn client_config(&self) -> Result<quinn::ClientConfig, TransportError> {
        let crypto = QuicClientConfig::try_from(self.rustls_client()?)
            .map_err(|e| tls_err("QUIC client crypto", e))?;
        let mut c = quinn::ClientConfig::new(Arc::new(crypto));
        c.transport_config(Arc::new(transport_config(false)));
        Ok(c)
    }

    pub fn server_config(&self) -> Result<quinn::ServerConfig, TransportError> {
        let crypto = QuicServerConfig::try_from(self.rustls_server()?)
            .map_err(|e| tls_err("QUIC server crypto", e))?;
        let mut s = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        s.transport_config(Arc::new(transport_config(true)));
        Ok(s)
    }
}

/// Transport parameters for a LAN link: one bidirectional stream (opened by the client), no
/// unidirectional streams or datagrams, large windows, 1 s keep-alives, 5 s idle timeout.
pub fn transport_config(server: bool) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(VarInt::from_u32(u32::from(server)))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .datagram_receive_buffer_size(None)
        .stream_receive_window(VarInt::from_u32(STREAM_WINDOW))
        .receive_window(VarInt::from_u32(CONNECTION_WINDOW))
        .send_window(u64::from(CONNECTION_WINDOW))
        .keep_alive_interval(Some(KEEP_ALIVE))
        .initial_rtt(INITIAL_RTT)
        .allow_spin(false);
    // 5 s fits the idle timeout's range (2^62 ms), so the conversion cannot fail.
    if let Ok(idle) = IdleTimeout::try_from(IDLE_TIMEOUT) {
        t.max_idle_timeout(Some(idle));
    }
    t
}

fn io_err(kind: ErrorKind, msg: String) -> TransportError {
    TransportError::Io(std::io::Error::new(kind, msg))
}

fn reason_text(r: &[u8]) -> String {
    String::from_utf8_lossy(r).into_owned()
}

/// A connection error in words: what happened, with whom, and what it likely means.
fn conn_error(e: &ConnectionError, peer: &str, during: &str) -> TransportError {
    use ConnectionError as C;
    let crypto = |code: u64| (0x100..0x200).contains(&code);
    match e {
        C::TransportError(t) if crypto(u64::from(t.code)) => {
            TransportError::Protocol(ProtocolError::Auth(format!(
                "TLS with {peer} failed {during}: {t} — it has no certificate from our cluster \
                 CA, so it does not hold our cluster key (a different key file, or not a \
                 ringllm node)"
            )))
        }
        C::ConnectionClosed(c) if crypto(u64::from(c.error_code)) => {
            TransportError::Protocol(ProtocolError::Auth(format!(
                "{peer} refused our TLS certificate {during} ({c}) — it holds a different cluster \
                 key file, or it is not a ringllm node"
            )))
        }
        C::ConnectionClosed(c) if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED => {
            io_err(
                ErrorKind::ConnectionRefused,
                format!(
                    "{peer} refused the QUIC connection {during}: its listener is closed or \
                     overloaded"
                ),
            )
        }
        C::ApplicationClosed(c) if c.error_code == VarInt::from_u32(CODE_REFUSED) => {
            TransportError::Protocol(ProtocolError::Rejected(format!(
                "{peer} closed the connection {during}: {}",
                reason_text(&c.reason)
            )))
        }
        C::ApplicationClosed(c) => io_err(
            ErrorKind::ConnectionAborted,
            format!(
                "{peer} closed the connection {during}: {} (code {})",
                reason_text(&c.reason),
                c.error_code
            ),
        ),
        C::TimedOut => io_err(
            ErrorKind::TimedOut,
            format!(
                "no packet from {peer} for {IDLE_TIMEOUT:?} {during}: it crashed or hangs, or the \
                 network between us is down"
            ),
        ),
        C::Reset => io_err(
            ErrorKind::ConnectionReset,
            format!("{peer} reset the connection {during} (it restarted?)"),
        ),
        C::LocallyClosed => io_err(
            ErrorKind::ConnectionAborted,
            format!("the connection to {peer} was closed on this side {during}"),
        ),
        other => io_err(
            ErrorKind::Other,
            format!("QUIC connection with {peer} failed {during}: {other}"),
        ),
    }
}

/// True for the closes that end a link cleanly (the peer dropped or closed its link).
fn is_clean_close(e: &ConnectionError) -> bool {
    matches!(e, ConnectionError::ApplicationClosed(c)
        if c.error_code == VarInt::from_u32(CODE_DONE) || c.error_code == VarInt::from_u32(CODE_CLOSED))
}

/// After a failed handshake step: the connection's own close reason if it has one (it says
/// more than the stream error that surfaced), else `e`.
fn explain(conn: &quinn::Connection, e: TransportError, peer: &str) -> TransportError {
    match (conn.close_reason(), &e) {
        (Some(reason), TransportError::Io(_)) | (Some(reason), TransportError::Closed) => {
            conn_error(&reason, peer, "during the handshake")
        }
        _ => e,
    }
}

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
        format!("'{name}' at {addr}")
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

/// The stream half of a link: everything `QuicDataLink` does except blocking.
struct Io {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    max_payload: u32,
    peer: String,
    /// A header being read (`head_got` bytes so far); kept across a timed-out `recv_timeout`.
    head: [u8; HEADER_LEN],
    head_got: usize,
    scratch: Vec<u8>,
    counters: Arc<LinkCounters>,
}

impl Io {
    fn read_err(&self, e: ReadError, at_boundary: bool) -> TransportError {
        match e {
            ReadError::ConnectionLost(c) if is_clean_close(&c) => {
                if at_boundary {
                    TransportError::Closed
                } else {
                    inside_frame(&self.peer)
                }
            }
            ReadError::ConnectionLost(c) => conn_error(&c, &self.peer, "while receiving"),
            ReadError::Reset(code) => io_err(
                ErrorKind::ConnectionReset,
                format!(
                    "{} abandoned the frame stream (reset, code {code})",
                    self.peer
                ),
            ),
            other => io_err(
                ErrorKind::Other,
                format!("reading the frame stream from {}: {other}", self.peer),
            ),
        }
    }

    fn write_err(&self, e: WriteError) -> TransportError {
        match e {
            WriteError::ConnectionLost(c) if is_clean_close(&c) => TransportError::Closed,
            WriteError::ConnectionLost(c) => conn_error(&c, &self.peer, "while sending"),
            WriteError::Stopped(code) => io_err(
                ErrorKind::BrokenPipe,
                format!(
                    "{} stopped reading the frame stream (code {code})",
                    self.peer
                ),
            ),
            other => io_err(
                ErrorKind::Other,
                format!("writing the frame stream to {}: {other}", self.peer),
            ),
        }
    }

    async fn write_frame(
        &mut self,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let head = header.encode();
        let r = if payload.len() <= COALESCE {
            // One write, so header and payload leave in the same packet.
            self.scratch.clear();
            self.scratch.extend_from_slice(&head);
            self.scratch.extend_from_slice(payload);
            self.send.write_all(&self.scratch).await
        } else {
            match self.send.write_all(&head).await {
                Ok(()) => self.send.write_all(payload).await,
                Err(e) => Err(e),
            }
        };
        r.map_err(|e| self.write_err(e))?;
        self.counters.sent(HEADER_LEN + payload.len());
        Ok(())
    }

    /// Reads at least one more header byte.
    async fn fill_head(&mut self) -> Result<(), TransportError> {
        let at_boundary = self.head_got == 0;
        match self.recv.read(&mut self.head[self.head_got..]).await {
            Ok(Some(n)) => {
                self.head_got += n;
                Ok(())
            }
            Ok(None) if at_boundary => Err(TransportError::Closed),
            Ok(None) => Err(inside_frame(&self.peer)),
            Err(e) => Err(self.read_err(e, at_boundary)),
        }
    }

    /// The next frame; with `header_within`, `Ok(None)` when its header is not complete in
    /// time. The bytes of a partly received header stay in `head` for the next call
    /// (`RecvStream::read` is cancel-safe, and each read's progress is recorded before the
    /// next await). Once the header is in, the payload is read without a deadline.
    async fn read_frame(
        &mut self,
        buf: &mut Vec<u8>,
        header_within: Option<Duration>,
    ) -> Result<Option<FrameHeader>, TransportError> {
        let header = async {
            while self.head_got < HEADER_LEN {
                self.fill_head().await?;
            }
            Ok::<(), TransportError>(())
        };
        match header_within {
            None => header.await?,
            Some(t) => match tokio::time::timeout(t, header).await {
                Err(_) => return Ok(None),
                Ok(r) => r?,
            },
        }
        self.head_got = 0;
        let h = FrameHeader::decode(&self.head, self.max_payload)?;
        buf.clear();
        buf.resize(h.len as usize, 0);
        match self.recv.read_exact(buf).await {
            Ok(()) => {}
            Err(ReadExactError::FinishedEarly(n)) => {
                return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                    format!(
                        "{} closed the stream after {n} of {} payload bytes",
                        self.peer, h.len
                    ),
                )))
            }
            Err(ReadExactError::ReadError(e)) => return Err(self.read_err(e, false)),
        }
        h.verify(buf)?;
        self.counters.received(HEADER_LEN + buf.len());
        Ok(Some(h))
    }
}

fn inside_frame(peer: &str) -> TransportError {
    TransportError::Protocol(ProtocolError::Inconsistent(format!(
        "{peer} closed the connection inside a frame"
    )))
}

/// Blocking DataLink over one bidirectional QUIC stream: header + payload per frame exactly as
/// on TCP (no per-frame seal: TLS protects it). Captures `tokio::runtime::Handle::current()` at
/// creation and blocks on it, so its methods must be called from plain (non-runtime) threads
/// (calling them on a runtime worker panics, as `Handle::block_on` does).
///
/// `recv_timeout` gives up when no *complete header* arrives in time; the bytes of a partly
/// received header are kept for the next call, and once a header is in, it waits for the
/// payload. A peer that drops or closes its link at a frame boundary reads as
/// `TransportError::Closed`; a peer that goes silent (crash, pulled cable) fails the link
/// after `IDLE_TIMEOUT`. Dropping the link finishes the stream and lets what was sent arrive
/// (for up to `LINGER`) before the connection closes, in the background.
pub struct QuicDataLink {
    rt: tokio::runtime::Handle,
    io: Io,
    /// The client's own endpoint (a server's links share the server's).
    endpoint: Option<quinn::Endpoint>,
}

impl QuicDataLink {
    fn new(
        conn: quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        endpoint: Option<quinn::Endpoint>,
        max_payload: u32,
        peer: String,
    ) -> QuicDataLink {
        QuicDataLink {
            rt: tokio::runtime::Handle::current(),
            io: Io {
                conn,
                send,
                recv,
                max_payload,
                peer,
                head: [0; HEADER_LEN],
                head_got: 0,
                scratch: Vec::new(),
                counters: Arc::new(LinkCounters::default()),
            },
            endpoint,
        }
    }

    /// The peer's UDP address.
    pub fn remote_address(&self) -> SocketAddr {
        self.io.conn.remote_address()
    }

    /// The peer, as errors name it ("'name' at addr").
    pub fn peer(&self) -> &str {
        &self.io.peer
    }

    /// The current RTT estimate.
    pub fn rtt(&self) -> Duration {
        self.io.conn.rtt()
    }

    /// The connection's statistics (packets, losses, congestion window, path MTU).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.io.conn.stats()
    }

    /// Writes raw bytes on the frame stream, outside any frame (tests: torn headers, garbage).
    #[doc(hidden)]
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), TransportError> {
        let io = &mut self.io;
        self.rt
            .block_on(io.send.write_all(bytes))
            .map_err(|e| io.write_err(e))
    }
}

impl DataLink for QuicDataLink {
    fn send(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(), TransportError> {
        self.rt.block_on(self.io.write_frame(header, payload))
    }

    fn recv(&mut self, buf: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        match self.rt.block_on(self.io.read_frame(buf, None))? {
            Some(h) => Ok(h),
            None => unreachable!("read_frame without a timeout always returns a frame"),
        }
    }

    fn recv_timeout(
        &mut self,
        buf: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<FrameHeader>, TransportError> {
        self.rt.block_on(self.io.read_frame(buf, Some(timeout)))
    }

    fn closer(&self) -> Result<LinkCloser, TransportError> {
        let conn = self.io.conn.clone();
        Ok(LinkCloser::new(move || {
            conn.close(VarInt::from_u32(CODE_CLOSED), b"link closed");
        }))
    }

    fn counters(&self) -> Arc<LinkCounters> {
        Arc::clone(&self.io.counters)
    }

    fn transport(&self) -> TransportKind {
        TransportKind::Quic
    }
}

impl Drop for QuicDataLink {
    fn drop(&mut self) {
        let _ = self.io.send.finish();
        let delivered = self.io.send.stopped();
        let conn = self.io.conn.clone();
        let endpoint = self.endpoint.take();
        // Runs in the background; if the runtime is gone, quinn closes the connection when its
        // last handle goes.
        self.rt.spawn(async move {
            let _ = tokio::time::timeout(LINGER, delivered).await;
            conn.close(VarInt::from_u32(CODE_DONE), b"done");
            if let Some(ep) = endpoint {
                let _ = tokio::time::timeout(Duration::from_secs(1), ep.wait_idle()).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_deterministic_and_depends_on_the_key() {
        let a = ClusterKey::from_bytes(b"key one").unwrap();
        let b = ClusterKey::from_bytes(b"key two").unwrap();
        assert_eq!(cluster_ca(&a).unwrap(), cluster_ca(&a).unwrap());
        assert_ne!(cluster_ca(&a).unwrap(), cluster_ca(&b).unwrap());
        // Leaves are fresh every time, the CA inside is the same.
        let t1 = ClusterTls::new(&a, "n").unwrap();
        let t2 = ClusterTls::new(&a, "n").unwrap();
        assert_ne!(t1.leaf, t2.leaf);
        assert_eq!(t1.ca, t2.ca);
        assert_eq!(t1.ca, cluster_ca(&a).unwrap());
        assert!(t1.client_config().is_ok());
        assert!(t1.server_config().is_ok());
    }

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
