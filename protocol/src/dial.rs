//! Opening data links of every transport, both sides.
//!
//! A data link always starts with an authenticated handshake (`handshake`) and an `Attach`
//! message naming the ring session and what the link carries:
//!
//! - **tcp** / **uring**: a TCP connection to the node's `--listen` port; the frames follow on
//!   it (sealed, see `seal`). io_uring only changes how each end drives its socket, so the
//!   wire is the same.
//! - **udp**: the same TCP connection carries the handshake and an `Attach` with the client's
//!   UDP port; the node binds a UDP socket to the same port number, connects it to the
//!   client's, and answers; then frames travel as sealed datagrams (keys derived for UDP
//!   only). The TCP connection stays open as the link's anchor: its end is the link's end.
//! - **quic**: a QUIC connection to the node's UDP port of that number (TLS 1.3, mutual, from
//!   the cluster key), the handshake and `Attach` on its first stream.

use crate::blocking::DataLink;
use crate::control::Control;
use crate::control_conn::control_of;
use crate::error::{ProtocolError, TransportError};
use crate::handshake::{Role, Session};
use crate::key::ClusterKey;
use crate::tcp::TcpDataLink;
use crate::transport::TransportKind;
use std::net::SocketAddr;
use std::time::Duration;

pub type BoxLink = Box<dyn DataLink>;

/// What a data link carries, seen from the node that accepts it. On the wire (`Attach`) it
/// is two flags, `input` and `output`; a link with neither is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkRole {
    /// Frames flow into the accepting node, its input: the coordinator's link to the first
    /// node of a segment of several nodes, or a node's link to the next node of the ring.
    Input,
    /// The accepting node sends its output on it: the coordinator's link to the last node of
    /// a segment of several nodes.
    Output,
    /// Both ways on one link: the coordinator's link to a segment of one node (or a
    /// benchmark's echo server).
    InputOutput,
}

impl LinkRole {
    /// The role the `Attach` flags name; `None` for a link that carries neither.
    pub fn from_flags(input: bool, output: bool) -> Option<LinkRole> {
        match (input, output) {
            (true, false) => Some(LinkRole::Input),
            (false, true) => Some(LinkRole::Output),
            (true, true) => Some(LinkRole::InputOutput),
            (false, false) => None,
        }
    }

    /// The link carries the accepting node's input.
    pub fn input(self) -> bool {
        matches!(self, LinkRole::Input | LinkRole::InputOutput)
    }

    /// The link carries the accepting node's output.
    pub fn output(self) -> bool {
        matches!(self, LinkRole::Output | LinkRole::InputOutput)
    }
}

/// Which data link to open, and what it will carry (`connect_data_link`).
#[derive(Clone, Debug)]
pub struct DialSpec<'a> {
    pub kind: TransportKind,
    /// The node's `--listen` address (host:port).
    pub addr: &'a str,
    /// Our name, for the handshake and the node's logs.
    pub name: &'a str,
    /// Connecting, authenticating and (for UDP) the node's answer must fit in this.
    pub timeout: Duration,
    /// Payload cap of frames we receive on the link.
    pub max_payload: u32,
    /// The ring session the link belongs to (the node refuses links of another session).
    pub ring_session: u64,
    pub role: LinkRole,
}

/// What the opening side of a data link declared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachInfo {
    pub session: u64,
    pub from: String,
    pub role: LinkRole,
    pub transport: TransportKind,
}

/// Label of the keys a reliable UDP link derives from its anchor's handshake.
const UDP_KEYS: &[u8] = b"udp";

/// The `Attach` that opens a data link (`udp_port`: the client's, for reliable UDP).
pub(crate) fn attach_msg(
    ring_session: u64,
    name: &str,
    role: LinkRole,
    transport: TransportKind,
    udp_port: u16,
) -> Control {
    Control::Attach {
        session: ring_session,
        from: name.to_string(),
        input: role.input(),
        output: role.output(),
        transport,
        udp_port,
    }
}

fn send_control(link: &mut dyn DataLink, msg: &Control) -> Result<(), TransportError> {
    let (h, p) = msg.to_frame()?;
    link.send(&h, &p)
}

/// Connects over TCP and authenticates as a data link; returns the blocking stream.
async fn connect_upstream(
    addr: &str,
    key: &ClusterKey,
    name: &str,
    timeout: Duration,
) -> Result<(std::net::TcpStream, Session), TransportError> {
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        crate::sock::tune_tcp(&stream)?;
        let session =
            crate::control_conn::client_handshake(&mut stream, key, Role::Upstream, name).await?;
        Ok::<_, TransportError>((stream, session))
    };
    let (stream, session) = tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| TransportError::Timeout(timeout, "connecting and authenticating"))??;
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    Ok((stream, session))
}

/// Client side: opens the data link `spec` describes, authenticated with `key`.
pub async fn connect_data_link(
    spec: &DialSpec<'_>,
    key: &ClusterKey,
) -> Result<BoxLink, TransportError> {
    let DialSpec {
        kind,
        addr,
        name,
        timeout,
        max_payload,
        ring_session,
        role,
    } = *spec;
    let attach = |kind, port| attach_msg(ring_session, name, role, kind, port);
    match kind {
        TransportKind::Tcp => {
            let (stream, session) = connect_upstream(addr, key, name, timeout).await?;
            let mut link: BoxLink =
                Box::new(TcpDataLink::new(stream, max_payload, &session.link_keys())?);
            send_control(link.as_mut(), &attach(kind, 0))?;
            Ok(link)
        }
        TransportKind::Uring => {
            let (stream, session) = connect_upstream(addr, key, name, timeout).await?;
            let mut link = uring_link(stream, max_payload, &session.link_keys())?;
            send_control(link.as_mut(), &attach(kind, 0))?;
            Ok(link)
        }
        TransportKind::Udp | TransportKind::Kmod => {
            let (stream, session) = connect_upstream(addr, key, name, timeout).await?;
            // The attach names our UDP port, known once the socket is bound.
            let (ring, from) = (ring_session, name.to_string());
            let msg = move |port| attach_msg(ring, &from, role, kind, port);
            let link = tokio::task::spawn_blocking(move || {
                connect_udp(stream, &session, msg, max_payload, timeout, kind, role)
            })
            .await
            .map_err(|e| TransportError::Io(std::io::Error::other(e.to_string())))??;
            Ok(link)
        }
        TransportKind::Quic => Ok(Box::new(
            crate::quic::connect_data(addr, key, name, timeout, max_payload, &attach(kind, 0))
                .await?,
        )),
    }
}

/// `stream` as a data link driven by io_uring (`--transport uring`).
#[cfg(target_os = "linux")]
fn uring_link(
    stream: std::net::TcpStream,
    max_payload: u32,
    keys: &crate::seal::LinkKeys,
) -> Result<BoxLink, TransportError> {
    Ok(Box::new(crate::uring::UringDataLink::new(
        stream,
        max_payload,
        keys,
        crate::uring::UringConfig::default(),
    )?))
}

/// io_uring is a Linux system call interface: elsewhere `--transport uring` is refused.
#[cfg(not(target_os = "linux"))]
fn uring_link(
    _stream: std::net::TcpStream,
    _max_payload: u32,
    _keys: &crate::seal::LinkKeys,
) -> Result<BoxLink, TransportError> {
    Err(uring_unavailable())
}

/// Checks that io_uring can drive data links here (`uring::probe` on Linux; elsewhere
/// `uring_unavailable`).
pub fn uring_probe() -> Result<(), TransportError> {
    #[cfg(target_os = "linux")]
    {
        crate::uring::probe().map(|_| ())
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(uring_unavailable())
    }
}

/// The error `--transport uring` gets on a system other than Linux.
pub fn uring_unavailable() -> TransportError {
    TransportError::Io(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        format!(
            "io_uring needs Linux (this is {}): use --transport tcp, udp or quic",
            std::env::consts::OS
        ),
    ))
}

/// The client half of a reliable UDP link, over an authenticated TCP anchor.
fn connect_udp(
    stream: std::net::TcpStream,
    session: &Session,
    attach: impl FnOnce(u16) -> Control,
    max_payload: u32,
    timeout: Duration,
    kind: TransportKind,
    role: LinkRole,
) -> Result<BoxLink, TransportError> {
    let peer = stream.peer_addr()?;
    let local = stream.local_addr()?;
    let sock = crate::sock::bind_udp_reuse(SocketAddr::new(local.ip(), 0))?;
    sock.connect(peer)?;
    let keys = session.link_keys().sub(UDP_KEYS);
    // The module claims our port before the node learns it.
    // The node sends on the link when it carries the node's output.
    let dev = kmod_device(kind, &sock, &keys, role.output(), role.input())?;
    let anchor = stream.try_clone()?;
    let mut tcp = TcpDataLink::new(stream, max_payload, &session.link_keys())?;
    send_control(&mut tcp, &attach(sock.local_addr()?.port()))?;
    // The node answers with an attach of its own once its socket is bound and connected to
    // ours, from its listening port.
    let (_, udp_port) = read_attach(&mut tcp, timeout)?;
    if udp_port != peer.port() {
        return Err(ProtocolError::Inconsistent(format!(
            "the node answered from UDP port {udp_port}, not {}",
            peer.port()
        ))
        .into());
    }
    udp_link(sock, anchor, &keys, max_payload, dev)
}

/// For `TransportKind::Kmod`, the kernel module's context for this link's socket.
/// Sized for the direction data flows: `receives` (banks for frames) and `sends` (a TX
/// area for them); the other direction carries only acks, on the link's socket.
fn kmod_device(
    kind: TransportKind,
    sock: &std::net::UdpSocket,
    keys: &crate::seal::LinkKeys,
    receives: bool,
    sends: bool,
) -> Result<Option<crate::kmod::Device>, TransportError> {
    if kind != TransportKind::Kmod {
        return Ok(None);
    }
    let cfg = crate::kmod::KmodConfig::for_link(receives, sends);
    Ok(Some(crate::kmod::Device::for_link(sock, keys, cfg)?))
}

/// A reliable UDP link, its data through the kernel module's context `dev` if given.
fn udp_link(
    sock: std::net::UdpSocket,
    anchor: std::net::TcpStream,
    keys: &crate::seal::LinkKeys,
    max_payload: u32,
    dev: Option<crate::kmod::Device>,
) -> Result<BoxLink, TransportError> {
    let cfg = crate::udp::UdpConfig::default();
    Ok(Box::new(match dev {
        Some(dev) => crate::udp::UdpDataLink::with_kmod(sock, anchor, keys, max_payload, cfg, dev)?,
        None => crate::udp::UdpDataLink::new(sock, anchor, keys, max_payload, cfg)?,
    }))
}

/// Server side of a TCP connection that authenticated as a data link: reads its `Attach`
/// (within `timeout`) and finishes the link the client asked for. `uring`: drive TCP links
/// with io_uring (the node's `--transport uring`). Blocking.
pub fn accept_tcp_data(
    stream: std::net::TcpStream,
    hs: &Session,
    max_payload: u32,
    timeout: Duration,
    uring: bool,
) -> Result<(BoxLink, AttachInfo), TransportError> {
    stream.set_nonblocking(false)?;
    let anchor = stream.try_clone()?;
    let local = stream.local_addr()?;
    let peer = stream.peer_addr()?;
    let mut link: BoxLink = if uring {
        uring_link(stream, max_payload, &hs.link_keys())?
    } else {
        Box::new(TcpDataLink::new(stream, max_payload, &hs.link_keys())?)
    };
    let (info, udp_port) = read_attach(link.as_mut(), timeout)?;
    match info.transport {
        TransportKind::Tcp | TransportKind::Uring => Ok((link, info)),
        TransportKind::Udp | TransportKind::Kmod => {
            if udp_port == 0 {
                return Err(ProtocolError::BadField {
                    field: "attach udp_port",
                    value: 0,
                }
                .into());
            }
            let sock = crate::sock::bind_udp_reuse(local)?;
            sock.connect(SocketAddr::new(peer.ip(), udp_port))?;
            let keys = hs.link_keys().sub(UDP_KEYS);
            // The module claims our port before the client may send (our answer).
            let dev = kmod_device(
                info.transport,
                &sock,
                &keys,
                info.role.input(),
                info.role.output(),
            )?;
            let answer = attach_msg(info.session, "", info.role, info.transport, local.port());
            send_control(link.as_mut(), &answer)?;
            drop(link);
            Ok((udp_link(sock, anchor, &keys, max_payload, dev)?, info))
        }
        TransportKind::Quic => Err(ProtocolError::Inconsistent(
            "a QUIC link was announced on a TCP connection".into(),
        )
        .into()),
    }
}

/// Reads the `Attach` that opens a data link: what it declares, and the UDP port it names.
fn read_attach(
    link: &mut dyn DataLink,
    timeout: Duration,
) -> Result<(AttachInfo, u16), TransportError> {
    let mut buf = Vec::new();
    let h = link
        .recv_timeout(&mut buf, timeout)?
        .ok_or(TransportError::Timeout(
            timeout,
            "waiting for the attach message",
        ))?;
    match control_of(&h, &buf)? {
        Control::Attach {
            session,
            from,
            input,
            output,
            transport,
            udp_port,
        } => {
            let role = LinkRole::from_flags(input, output).ok_or(ProtocolError::BadField {
                field: "attach input/output (a data link that carries neither)",
                value: 0,
            })?;
            Ok((
                AttachInfo {
                    session,
                    from,
                    role,
                    transport,
                },
                udp_port,
            ))
        }
        Control::Error(e) => Err(ProtocolError::Rejected(e.message).into()),
        other => Err(ProtocolError::Inconsistent(format!(
            "expected an attach message, got {}",
            other.name()
        ))
        .into()),
    }
}

/// Reads the `Attach` that opens a QUIC data link. Blocking.
pub fn accept_quic_data(
    link: crate::quic::QuicDataLink,
    timeout: Duration,
) -> Result<(BoxLink, AttachInfo), TransportError> {
    let mut link: BoxLink = Box::new(link);
    let (info, _) = read_attach(link.as_mut(), timeout)?;
    Ok((link, info))
}

/// A bare listener for data links of one transport, for tests and benchmarks (the node
/// daemon has its own accept loop, with the control plane on the same port).
pub struct DataListener {
    tcp: tokio::net::TcpListener,
    quic: Option<crate::quic::QuicServer>,
    key: ClusterKey,
    name: String,
    kind: TransportKind,
    max_payload: u32,
}

impl DataListener {
    /// Binds `addr` (TCP, and UDP for QUIC). Needs a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        key: &ClusterKey,
        name: &str,
        kind: TransportKind,
        max_payload: u32,
    ) -> Result<DataListener, TransportError> {
        let tcp = crate::sock::listen_tcp(addr)?;
        let port = tcp.local_addr()?.port();
        let quic = match kind {
            TransportKind::Quic => Some(crate::quic::QuicServer::bind(
                SocketAddr::new(addr.ip(), port),
                key,
                name,
            )?),
            _ => None,
        };
        if kind == TransportKind::Uring {
            uring_probe()?;
        }
        Ok(DataListener {
            tcp,
            quic,
            key: key.clone(),
            name: name.to_string(),
            kind,
            max_payload,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// The next data link, authenticated and attached.
    pub async fn accept(&self, timeout: Duration) -> Result<(BoxLink, AttachInfo), TransportError> {
        if let Some(q) = &self.quic {
            let (link, _session, _peer) = q
                .accept(timeout, self.max_payload)
                .await
                .ok_or(TransportError::Closed)??;
            return tokio::task::spawn_blocking(move || accept_quic_data(link, timeout))
                .await
                .map_err(|e| TransportError::Io(std::io::Error::other(e.to_string())))?;
        }
        let (mut stream, _) = self.tcp.accept().await?;
        let hs =
            crate::control_conn::accept_stream(&mut stream, &self.key, &self.name, timeout).await?;
        if hs.peer.role != Role::Upstream {
            return Err(ProtocolError::Handshake(format!(
                "'{}' connected as {:?}, not as a data link",
                crate::untrusted::escape(&hs.peer.name),
                hs.peer.role
            ))
            .into());
        }
        let stream = stream.into_std()?;
        let (max, uring) = (self.max_payload, self.kind == TransportKind::Uring);
        tokio::task::spawn_blocking(move || accept_tcp_data(stream, &hs, max, timeout, uring))
            .await
            .map_err(|e| TransportError::Io(std::io::Error::other(e.to_string())))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_roles_map_to_the_attach_flags_and_back() {
        for role in [LinkRole::Input, LinkRole::Output, LinkRole::InputOutput] {
            assert_eq!(
                LinkRole::from_flags(role.input(), role.output()),
                Some(role)
            );
        }
        assert_eq!(LinkRole::from_flags(false, false), None);
        let Control::Attach { input, output, .. } =
            attach_msg(7, "n", LinkRole::Output, TransportKind::Tcp, 0)
        else {
            panic!("not an attach");
        };
        assert_eq!((input, output), (false, true));
    }
}
