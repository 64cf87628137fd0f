//! QUIC connection and stream errors, in words an operator can act on.

use super::{CODE_CLOSED, CODE_DONE, CODE_REFUSED, IDLE_TIMEOUT};
use crate::error::{ProtocolError, TransportError};
use quinn::{ConnectionError, VarInt};
use std::io::ErrorKind;

pub(super) fn io_err(kind: ErrorKind, msg: String) -> TransportError {
    TransportError::Io(std::io::Error::new(kind, msg))
}

fn reason_text(r: &[u8]) -> String {
    String::from_utf8_lossy(r).into_owned()
}

/// A connection error in words: what happened, with whom, and what it likely means.
pub(super) fn conn_error(e: &ConnectionError, peer: &str, during: &str) -> TransportError {
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
pub(super) fn is_clean_close(e: &ConnectionError) -> bool {
    matches!(e, ConnectionError::ApplicationClosed(c)
        if c.error_code == VarInt::from_u32(CODE_DONE) || c.error_code == VarInt::from_u32(CODE_CLOSED))
}

/// After a failed handshake step: the connection's own close reason if it has one (it says
/// more than the stream error that surfaced), else `e`.
pub(super) fn explain(conn: &quinn::Connection, e: TransportError, peer: &str) -> TransportError {
    match (conn.close_reason(), &e) {
        (Some(reason), TransportError::Io(_)) | (Some(reason), TransportError::Closed) => {
            conn_error(&reason, peer, "during the handshake")
        }
        _ => e,
    }
}

pub(super) fn inside_frame(peer: &str) -> TransportError {
    TransportError::Protocol(ProtocolError::Inconsistent(format!(
        "{peer} closed the connection inside a frame"
    )))
}
