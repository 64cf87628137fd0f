//! Placeholder until the reliable UDP transport lands.
use crate::blocking::{DataLink, LinkCloser};
use crate::error::TransportError;
use crate::frame::FrameHeader;
use crate::seal::LinkKeys;
use crate::transport::LinkCounters;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug, Default)]
pub struct UdpConfig {
    pub chunk_payload: usize,
}

pub struct UdpDataLink;

fn no() -> TransportError {
    TransportError::Io(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "udp: not built",
    ))
}

impl UdpDataLink {
    pub fn new(
        _socket: std::net::UdpSocket,
        _anchor: std::net::TcpStream,
        _keys: &LinkKeys,
        _max_payload: u32,
        _cfg: UdpConfig,
    ) -> Result<UdpDataLink, TransportError> {
        Err(no())
    }
}

pub fn bind_reuse(local: std::net::SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    std::net::UdpSocket::bind(local)
}

impl DataLink for UdpDataLink {
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
        "udp"
    }
}
