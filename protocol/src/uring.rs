//! Placeholder until the io_uring transport lands.
use crate::blocking::{DataLink, LinkCloser};
use crate::error::TransportError;
use crate::frame::FrameHeader;
use crate::seal::LinkKeys;
use crate::transport::LinkCounters;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug, Default)]
pub struct UringConfig {
    pub zc_threshold: usize,
}

pub struct UringSupport {
    pub send_zc: bool,
}

pub struct UringDataLink;

fn no() -> TransportError {
    TransportError::Io(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "uring: not built",
    ))
}

pub fn probe() -> Result<UringSupport, TransportError> {
    Err(no())
}

impl UringDataLink {
    pub fn new(
        _stream: std::net::TcpStream,
        _max_payload: u32,
        _keys: &LinkKeys,
        _cfg: UringConfig,
    ) -> Result<UringDataLink, TransportError> {
        Err(no())
    }
}

impl DataLink for UringDataLink {
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
        "uring"
    }
}
