//! Placeholder until the QUIC transport lands.
use crate::blocking::{DataLink, LinkCloser};
use crate::error::TransportError;
use crate::frame::FrameHeader;
use crate::handshake::{Role, Session};
use crate::key::ClusterKey;
use crate::transport::LinkCounters;
use std::sync::Arc;
use std::time::Duration;

pub struct QuicServer;
pub struct QuicDataLink;

fn no() -> TransportError {
    TransportError::Io(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "quic: not built",
    ))
}

impl QuicServer {
    pub fn bind(
        _addr: std::net::SocketAddr,
        _key: &ClusterKey,
        _name: &str,
    ) -> Result<QuicServer, TransportError> {
        Err(no())
    }
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        Err(std::io::Error::other("quic: not built"))
    }
    pub async fn accept(
        &self,
        _timeout: Duration,
        _max_payload: u32,
    ) -> Option<Result<(QuicDataLink, Session, std::net::SocketAddr), TransportError>> {
        None
    }
    pub fn close(&self) {}
}

pub async fn connect(
    _addr: &str,
    _key: &ClusterKey,
    _role: Role,
    _name: &str,
    _timeout: Duration,
    _max_payload: u32,
) -> Result<(QuicDataLink, Session), TransportError> {
    Err(no())
}

impl DataLink for QuicDataLink {
    fn send(&mut self, _h: &FrameHeader, _p: &[u8]) -> Result<(), TransportError> {
        Err(no())
    }
    fn recv(&mut self, _b: &mut Vec<u8>) -> Result<FrameHeader, TransportError> {
        Err(no())
    }
    fn recv_timeout(
        &mut self,
        _b: &mut Vec<u8>,
        _t: Duration,
    ) -> Result<Option<FrameHeader>, TransportError> {
        Err(no())
    }
    fn closer(&self) -> Result<LinkCloser, TransportError> {
        Err(no())
    }
    fn counters(&self) -> Arc<LinkCounters> {
        Arc::new(LinkCounters::default())
    }
    fn transport(&self) -> &'static str {
        "quic"
    }
}
