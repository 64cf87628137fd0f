//! The control plane's connection: a TCP stream on tokio between the coordinator and a node
//! (assignments, heartbeats, errors, as `Control` messages), split into a `FrameSender` and
//! a `FrameReceiver` so one task waits for input while another writes. Sockets are tuned by
//! `sock::tune_tcp`; the frame header and payload go out in one vectored write, and reads
//! go through a small buffer so a small frame costs one `read` call.
//!
//! The handshake over any async stream (`client_handshake`, `server_handshake`) lives here
//! too: every connection starts with it, data links included (`dial`, `quic`). The data plane
//! itself is on blocking links (`blocking::DataLink`), not here.

use crate::control::Control;
use crate::error::{ProtocolError, TransportError};
use crate::frame::{FrameHeader, FrameKind, HEADER_LEN};
use crate::handshake::{ClientHandshake, HsMsg, Role, ServerHandshake, ServerStep, MSG_HEADER_LEN};
use crate::key::ClusterKey;
use crate::seal::{Opener, Sealer, SEAL_LEN};
use crate::sock::tune_tcp;
use crate::transport::{BoxFut, FrameReceiver, FrameSender, Link, LinkCounters};
use std::io::IoSlice;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

const READ_BUFFER: usize = 64 << 10;

async fn read_hs<R: AsyncRead + Unpin>(r: &mut R) -> Result<Vec<u8>, TransportError> {
    let mut head = [0u8; MSG_HEADER_LEN];
    read_exact_or_closed(r, &mut head).await?;
    let (_, len) = HsMsg::decode_header(&head)?;
    let mut msg = head.to_vec();
    msg.resize(MSG_HEADER_LEN + len, 0);
    r.read_exact(&mut msg[MSG_HEADER_LEN..]).await?;
    Ok(msg)
}

async fn read_exact_or_closed<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
) -> Result<(), TransportError> {
    let mut got = 0;
    while got < buf.len() {
        let n = r.read(&mut buf[got..]).await?;
        if n == 0 {
            return Err(if got == 0 {
                TransportError::Closed
            } else {
                TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("connection closed after {got} of {} bytes", buf.len()),
                ))
            });
        }
        got += n;
    }
    Ok(())
}

/// Runs the client side of the handshake over any stream.
pub async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &ClusterKey,
    role: Role,
    name: &str,
) -> Result<crate::handshake::Session, TransportError> {
    let (mut hs, hello) = ClientHandshake::start(key, role, name)?;
    s.write_all(&hello).await?;
    let server_hello = read_hs(s).await?;
    if let Err(e) = hs.on_hello(&server_hello) {
        return Err(refuse(s, e).await);
    }
    if hs.expects_ident() {
        let ident = read_hs(s).await?;
        if let Err(e) = hs.on_ident(&ident) {
            return Err(refuse(s, e).await);
        }
    }
    let proof = read_hs(s).await?;
    let mine = match hs.on_proof(&proof) {
        Ok(p) => p,
        Err(e) => return Err(refuse(s, e).await),
    };
    s.write_all(&mine).await?;
    let verdict = read_hs(s).await?;
    Ok(hs.on_verdict(&verdict)?)
}

/// Tells the peer why we give up (unless it refused us first), and returns the error.
async fn refuse<S: AsyncWrite + Unpin>(s: &mut S, e: ProtocolError) -> TransportError {
    if !matches!(e, ProtocolError::Rejected(_)) {
        let _ = s.write_all(&HsMsg::Reject(e.to_string()).encode()).await;
    }
    e.into()
}

/// Runs the server side of the handshake over any stream.
pub async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &ClusterKey,
    name: &str,
) -> Result<crate::handshake::Session, TransportError> {
    let hello = read_hs(s).await?;
    let mut hs = match ServerHandshake::on_hello(key, name, &hello)? {
        ServerStep::Continue(hs, out) => {
            s.write_all(&out).await?;
            hs
        }
        ServerStep::Refuse(out, e) => {
            let _ = s.write_all(&out).await;
            return Err(e.into());
        }
    };
    let step = async {
        if hs.expects_ident() {
            hs.on_ident(&read_hs(s).await?)?;
        }
        let proof = read_hs(s).await?;
        Ok::<_, StepError>(hs.on_proof(&proof)?)
    };
    match step.await {
        Ok((session, accept)) => {
            s.write_all(&accept).await?;
            Ok(session)
        }
        Err(StepError::Io(e)) => Err(e),
        Err(StepError::Refused((reject, e))) => {
            if !reject.is_empty() {
                let _ = s.write_all(&reject).await;
            }
            Err(e.into())
        }
    }
}

/// A server step that failed: on the stream, or refused (with the `Reject` to send).
enum StepError {
    Io(TransportError),
    Refused((Vec<u8>, ProtocolError)),
}

impl From<TransportError> for StepError {
    fn from(e: TransportError) -> StepError {
        StepError::Io(e)
    }
}

impl From<(Vec<u8>, ProtocolError)> for StepError {
    fn from(r: (Vec<u8>, ProtocolError)) -> StepError {
        StepError::Refused(r)
    }
}

pub struct TcpSender {
    w: OwnedWriteHalf,
    sealer: Sealer,
    counters: Arc<LinkCounters>,
}

pub struct TcpReceiver {
    r: BufReader<OwnedReadHalf>,
    max_payload: u32,
    opener: Opener,
    counters: Arc<LinkCounters>,
}

impl FrameSender for TcpSender {
    fn send<'a>(
        &'a mut self,
        header: &'a FrameHeader,
        payload: &'a [u8],
    ) -> BoxFut<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let head = header.encode();
            let seal = self.sealer.seal(&[&head, payload]);
            write_all_vectored(&mut self.w, &head, payload).await?;
            self.w.write_all(&seal).await?;
            self.counters.sent(HEADER_LEN + payload.len() + SEAL_LEN);
            Ok(())
        })
    }
}

/// Writes `a` then `b` with as few `writev` calls as the socket allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    a: &[u8],
    b: &[u8],
) -> std::io::Result<()> {
    let total = a.len() + b.len();
    let mut done = 0;
    while done < total {
        let n = if done < a.len() {
            let bufs = [IoSlice::new(&a[done..]), IoSlice::new(b)];
            w.write_vectored(&bufs).await?
        } else {
            w.write(&b[done - a.len()..]).await?
        };
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                "the socket accepted no bytes",
            ));
        }
        done += n;
    }
    Ok(())
}

impl FrameReceiver for TcpReceiver {
    fn recv<'a>(
        &'a mut self,
        buf: &'a mut Vec<u8>,
    ) -> BoxFut<'a, Result<FrameHeader, TransportError>> {
        Box::pin(async move {
            let mut head = [0u8; HEADER_LEN];
            read_exact_or_closed(&mut self.r, &mut head).await?;
            let h = FrameHeader::decode(&head, self.max_payload)?;
            buf.clear();
            buf.resize(h.len as usize, 0);
            self.r.read_exact(buf).await?;
            let mut seal = [0u8; SEAL_LEN];
            self.r.read_exact(&mut seal).await?;
            h.verify(buf)?;
            crate::blocking::open_stream_frame(
                &mut self.opener,
                &self.counters,
                &head,
                buf,
                &seal,
            )?;
            self.counters.received(HEADER_LEN + buf.len() + SEAL_LEN);
            Ok(h)
        })
    }
}

/// A link over an authenticated stream.
pub fn link_from(
    stream: TcpStream,
    session: crate::handshake::Session,
    peer_addr: String,
    max_payload: u32,
) -> Link {
    let (r, w) = stream.into_split();
    let counters = Arc::new(LinkCounters::default());
    let keys = session.link_keys();
    Link {
        tx: Box::new(TcpSender {
            w,
            sealer: Sealer::new(&keys.send),
            counters: Arc::clone(&counters),
        }),
        rx: Box::new(TcpReceiver {
            r: BufReader::with_capacity(READ_BUFFER, r),
            max_payload,
            opener: Opener::new(&keys.recv),
            counters: Arc::clone(&counters),
        }),
        session,
        peer_addr,
        counters,
    }
}

/// Connects to `addr` and authenticates (both directions) within `timeout`.
pub async fn connect(
    addr: &str,
    key: &ClusterKey,
    role: Role,
    name: &str,
    timeout: Duration,
    max_payload: u32,
) -> Result<Link, TransportError> {
    let fut = async {
        let mut stream = TcpStream::connect(addr).await?;
        tune_tcp(&stream)?;
        let session = client_handshake(&mut stream, key, role, name).await?;
        Ok::<_, TransportError>(link_from(stream, session, addr.to_string(), max_payload))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| TransportError::Timeout(timeout, "connecting and authenticating"))?
}

/// Tunes an accepted stream and runs the server side of the handshake within `timeout`.
pub async fn accept_stream(
    stream: &mut TcpStream,
    key: &ClusterKey,
    name: &str,
    timeout: Duration,
) -> Result<crate::handshake::Session, TransportError> {
    tune_tcp(stream)?;
    tokio::time::timeout(timeout, server_handshake(stream, key, name))
        .await
        .map_err(|_| TransportError::Timeout(timeout, "waiting for the handshake"))?
}

/// Authenticates an accepted connection within `timeout`.
pub async fn accept(
    mut stream: TcpStream,
    key: &ClusterKey,
    name: &str,
    timeout: Duration,
    max_payload: u32,
) -> Result<Link, TransportError> {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    tune_tcp(&stream)?;
    let session = tokio::time::timeout(timeout, server_handshake(&mut stream, key, name))
        .await
        .map_err(|_| TransportError::Timeout(timeout, "waiting for the handshake"))??;
    Ok(link_from(stream, session, peer, max_payload))
}

/// Sends a control message on a link.
pub async fn send_control(tx: &mut dyn FrameSender, msg: &Control) -> Result<(), TransportError> {
    let (h, payload) = msg.to_frame()?;
    tx.send(&h, &payload).await
}

/// Decodes a received control frame.
pub fn control_of(h: &FrameHeader, payload: &[u8]) -> Result<Control, ProtocolError> {
    if h.kind != FrameKind::Control {
        return Err(ProtocolError::Inconsistent(format!(
            "expected a control message, got a {:?} frame",
            h.kind
        )));
    }
    Control::decode(payload)
}
