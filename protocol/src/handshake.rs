//! The handshake that opens every link, before anything else is read: versions and cluster id
//! are compared, then each side proves it holds the cluster key with HMAC-SHA256 over both
//! sides' fresh nonces (mutual challenge–response; a recorded handshake cannot be replayed
//! because the other side's nonce changes every time).
//!
//! Messages: `b"RLHS"`, a type byte, a u16 LE body length, the body (at most `MAX_BODY`).
//!
//! ```text
//! client                                   server
//!   Hello(role, cluster id, nonce_c) ───────▶  version / cluster id checked (else Reject)
//!   ◀─────── Hello(nonce_s), Proof_s = HMAC(K, "server" ‖ hello_c ‖ hello_s)
//!   Proof_s checked (else Reject, error)
//!   Proof_c = HMAC(K, "client" ‖ hello_c ‖ hello_s) ─▶  checked
//!   ◀─────────────────────────── Accept | Reject(reason)
//! ```
//!
//! This module only encodes, decodes and checks; `io` runs it over a stream.

use crate::error::ProtocolError;
use crate::key::{ct_eq, ClusterKey};
use crate::untrusted::escape;

pub const HS_MAGIC: [u8; 4] = *b"RLHS";
/// 1: the ring. 2: model slices sent to nodes (`Slice*` control messages, `Slice` frames).
pub const PROTOCOL_MAJOR: u16 = 3;
/// Minor 1: `Role::Monitor` connections and the `GetStatus`/`Status` control messages.
pub const PROTOCOL_MINOR: u16 = 1;
/// Capability bits a peer may announce.
pub const CAP_TCP: u64 = 1;
pub const MAX_BODY: usize = 1024;
pub const MAX_NAME: usize = 64;
pub const MSG_HEADER_LEN: usize = 7;

/// Message types; numbers are on the wire.
const T_HELLO: u8 = 1;
const T_PROOF: u8 = 2;
const T_ACCEPT: u8 = 3;
const T_REJECT: u8 = 4;

/// Who opens a connection. Numbers are on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// The coordinator, connecting to a node it will assign work to.
    Coordinator = 1,
    /// A data link of a ring: the coordinator's, or a node's to its next hop.
    Upstream = 2,
    /// A node answering a connection.
    Node = 3,
    /// A key holder asking for a node's status (`ringllm status`, a coordinator's
    /// `/v1/cluster`): answered beside the coordinator, never claims the node.
    Monitor = 4,
}

impl Role {
    fn from_u8(v: u8) -> Option<Role> {
        match v {
            1 => Some(Role::Coordinator),
            2 => Some(Role::Upstream),
            3 => Some(Role::Node),
            4 => Some(Role::Monitor),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub major: u16,
    pub minor: u16,
    pub caps: u64,
    pub role: Role,
    pub cluster_id: [u8; 8],
    pub nonce: [u8; 32],
    pub name: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HsMsg {
    Hello(Hello),
    Proof([u8; 32]),
    Accept,
    Reject(String),
}

impl HsMsg {
    pub fn encode(&self) -> Vec<u8> {
        let (t, body) = match self {
            HsMsg::Hello(h) => {
                let name = truncate_utf8(&h.name, MAX_NAME);
                let mut b = Vec::with_capacity(56 + name.len());
                b.extend_from_slice(&h.major.to_le_bytes());
                b.extend_from_slice(&h.minor.to_le_bytes());
                b.extend_from_slice(&h.caps.to_le_bytes());
                b.push(h.role as u8);
                b.extend_from_slice(&h.cluster_id);
                b.extend_from_slice(&h.nonce);
                b.push(name.len() as u8);
                b.extend_from_slice(name.as_bytes());
                (T_HELLO, b)
            }
            HsMsg::Proof(p) => (T_PROOF, p.to_vec()),
            HsMsg::Accept => (T_ACCEPT, Vec::new()),
            HsMsg::Reject(r) => (T_REJECT, truncate_utf8(r, MAX_BODY).as_bytes().to_vec()),
        };
        let mut out = Vec::with_capacity(MSG_HEADER_LEN + body.len());
        out.extend_from_slice(&HS_MAGIC);
        out.push(t);
        out.extend_from_slice(&(body.len() as u16).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Parses a message header: (type, body length).
    pub fn decode_header(b: &[u8; MSG_HEADER_LEN]) -> Result<(u8, usize), ProtocolError> {
        if b[0..4] != HS_MAGIC {
            return Err(ProtocolError::BadMagic {
                what: "handshake",
                found: [b[0], b[1], b[2], b[3]],
            });
        }
        let t = b[4];
        if !(T_HELLO..=T_REJECT).contains(&t) {
            return Err(ProtocolError::BadField {
                field: "handshake message type",
                value: t as u64,
            });
        }
        let len = u16::from_le_bytes([b[5], b[6]]) as usize;
        if len > MAX_BODY {
            return Err(ProtocolError::TooLarge {
                what: "handshake message",
                len: len as u64,
                max: MAX_BODY as u64,
            });
        }
        Ok((t, len))
    }

    pub fn decode_body(t: u8, body: &[u8]) -> Result<HsMsg, ProtocolError> {
        let short = || ProtocolError::Handshake(format!("message type {t} truncated"));
        match t {
            T_HELLO => {
                // Fixed part: major, minor, caps, role, cluster id, nonce, name length.
                if body.len() < 2 + 2 + 8 + 1 + 8 + 32 + 1 {
                    return Err(short());
                }
                let u16_at = |o: usize| u16::from_le_bytes([body[o], body[o + 1]]);
                let mut caps = [0u8; 8];
                caps.copy_from_slice(&body[4..12]);
                let role = Role::from_u8(body[12]).ok_or(ProtocolError::BadField {
                    field: "handshake role",
                    value: body[12] as u64,
                })?;
                let mut cluster_id = [0u8; 8];
                cluster_id.copy_from_slice(&body[13..21]);
                let mut nonce = [0u8; 32];
                nonce.copy_from_slice(&body[21..53]);
                let name_len = body[53] as usize;
                let name_bytes = body.get(54..54 + name_len).ok_or_else(short)?;
                if 54 + name_len != body.len() {
                    return Err(ProtocolError::Handshake(
                        "hello has trailing bytes after the name".into(),
                    ));
                }
                let name = std::str::from_utf8(name_bytes)
                    .map_err(|_| ProtocolError::Handshake("peer name is not UTF-8".into()))?
                    .to_string();
                Ok(HsMsg::Hello(Hello {
                    major: u16_at(0),
                    minor: u16_at(2),
                    caps: u64::from_le_bytes(caps),
                    role,
                    cluster_id,
                    nonce,
                    name,
                }))
            }
            T_PROOF => {
                let p: [u8; 32] = body.try_into().map_err(|_| short())?;
                Ok(HsMsg::Proof(p))
            }
            T_ACCEPT if body.is_empty() => Ok(HsMsg::Accept),
            T_ACCEPT => Err(ProtocolError::Handshake("accept with a body".into())),
            T_REJECT => Ok(HsMsg::Reject(String::from_utf8_lossy(body).into_owned())),
            _ => Err(ProtocolError::BadField {
                field: "handshake message type",
                value: t as u64,
            }),
        }
    }

    /// Decodes one whole message (header and body).
    pub fn decode(b: &[u8]) -> Result<HsMsg, ProtocolError> {
        let head: &[u8; MSG_HEADER_LEN] =
            b.get(..MSG_HEADER_LEN)
                .and_then(|h| h.try_into().ok())
                .ok_or_else(|| ProtocolError::Handshake("message truncated".into()))?;
        let (t, len) = HsMsg::decode_header(head)?;
        if b.len() != MSG_HEADER_LEN + len {
            return Err(ProtocolError::Handshake(format!(
                "message of {} bytes, header says {}",
                b.len(),
                MSG_HEADER_LEN + len
            )));
        }
        HsMsg::decode_body(t, &b[MSG_HEADER_LEN..])
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn fresh_nonce() -> Result<[u8; 32], ProtocolError> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n)
        .map_err(|e| ProtocolError::Handshake(format!("no randomness from the OS: {e}")))?;
    Ok(n)
}

/// What both sides know once the handshake succeeded.
#[derive(Clone, Debug)]
pub struct Session {
    pub peer: Hello,
    /// A key for this connection only (MACs on later frames).
    pub session_key: [u8; 32],
    /// True on the side that opened the connection (it sends with the client-to-server key).
    pub initiator: bool,
}

impl Session {
    /// The two per-direction MAC keys of this connection (see `seal`).
    pub fn link_keys(&self) -> crate::seal::LinkKeys {
        crate::seal::LinkKeys::derive(&self.session_key, self.initiator)
    }
}

fn session_key(key: &ClusterKey, client_nonce: &[u8; 32], server_nonce: &[u8; 32]) -> [u8; 32] {
    key.mac(&[b"ringllm session key v1\0", client_nonce, server_nonce])
}

fn check_peer_hello(key: &ClusterKey, h: &Hello, who: &str) -> Result<(), ProtocolError> {
    if h.major != PROTOCOL_MAJOR {
        return Err(ProtocolError::Version {
            what: "protocol",
            ours: PROTOCOL_MAJOR as u32,
            theirs: h.major as u32,
        });
    }
    if h.cluster_id != key.id() {
        return Err(ProtocolError::Auth(format!(
            "{who} '{}' belongs to cluster {} but ours is {} (different cluster key files)",
            escape(&h.name),
            crate::key::hex(&h.cluster_id),
            key.id_hex()
        )));
    }
    Ok(())
}

fn our_hello(key: &ClusterKey, role: Role, name: &str) -> Result<Hello, ProtocolError> {
    Ok(Hello {
        major: PROTOCOL_MAJOR,
        minor: PROTOCOL_MINOR,
        caps: CAP_TCP,
        role,
        cluster_id: key.id(),
        nonce: fresh_nonce()?,
        name: name.to_string(),
    })
}

/// The connecting side.
pub struct ClientHandshake {
    key: ClusterKey,
    hello: Hello,
    hello_bytes: Vec<u8>,
    server: Option<(Hello, Vec<u8>)>,
    /// Set once the server's proof has been checked; `on_verdict` refuses to finish before.
    proof_checked: std::cell::Cell<bool>,
}

impl ClientHandshake {
    /// Starts a handshake; returns the state and the first message to send.
    pub fn start(
        key: &ClusterKey,
        role: Role,
        name: &str,
    ) -> Result<(ClientHandshake, Vec<u8>), ProtocolError> {
        let hello = our_hello(key, role, name)?;
        let hello_bytes = HsMsg::Hello(hello.clone()).encode();
        Ok((
            ClientHandshake {
                key: key.clone(),
                hello,
                hello_bytes: hello_bytes.clone(),
                server: None,
                proof_checked: std::cell::Cell::new(false),
            },
            hello_bytes,
        ))
    }

    /// The server's hello (raw message bytes).
    pub fn on_hello(&mut self, raw: &[u8]) -> Result<(), ProtocolError> {
        match HsMsg::decode(raw)? {
            HsMsg::Hello(h) => {
                check_peer_hello(&self.key, &h, "node")?;
                self.server = Some((h, raw.to_vec()));
                Ok(())
            }
            HsMsg::Reject(r) => Err(ProtocolError::Rejected(r)),
            other => Err(unexpected("hello", &other)),
        }
    }

    /// The server's proof; on success returns our proof to send.
    pub fn on_proof(&self, raw: &[u8]) -> Result<Vec<u8>, ProtocolError> {
        let (server, server_bytes) = self
            .server
            .as_ref()
            .ok_or_else(|| ProtocolError::Handshake("proof before hello".into()))?;
        match HsMsg::decode(raw)? {
            HsMsg::Proof(p) => {
                let want = self.key.mac(&[
                    b"ringllm server proof v1\0",
                    &self.hello_bytes,
                    server_bytes,
                ]);
                if !ct_eq(&p, &want) {
                    return Err(ProtocolError::Auth(format!(
                        "'{}' could not prove it holds the cluster key",
                        escape(&server.name)
                    )));
                }
                self.proof_checked.set(true);
                let mine = self.key.mac(&[
                    b"ringllm client proof v1\0",
                    &self.hello_bytes,
                    server_bytes,
                ]);
                Ok(HsMsg::Proof(mine).encode())
            }
            HsMsg::Reject(r) => Err(ProtocolError::Rejected(r)),
            other => Err(unexpected("proof", &other)),
        }
    }

    /// The server's verdict.
    pub fn on_verdict(self, raw: &[u8]) -> Result<Session, ProtocolError> {
        if !self.proof_checked.get() {
            return Err(ProtocolError::Handshake(
                "verdict before the server's proof was checked".into(),
            ));
        }
        let (server, _) = self
            .server
            .ok_or_else(|| ProtocolError::Handshake("verdict before hello".into()))?;
        match HsMsg::decode(raw)? {
            HsMsg::Accept => Ok(Session {
                session_key: session_key(&self.key, &self.hello.nonce, &server.nonce),
                initiator: true,
                peer: server,
            }),
            HsMsg::Reject(r) => Err(ProtocolError::Rejected(r)),
            other => Err(unexpected("accept", &other)),
        }
    }
}

/// The accepting side.
pub struct ServerHandshake {
    key: ClusterKey,
    hello: Hello,
    hello_bytes: Vec<u8>,
    client: Hello,
    client_bytes: Vec<u8>,
}

/// What to do after the client's first message.
pub enum ServerStep {
    /// Send these bytes (our hello and proof), then wait for the client's proof.
    Continue(ServerHandshake, Vec<u8>),
    /// Send these bytes (a rejection) and close; the error says why.
    Refuse(Vec<u8>, ProtocolError),
}

impl ServerHandshake {
    /// The client's hello (raw message bytes).
    pub fn on_hello(key: &ClusterKey, name: &str, raw: &[u8]) -> Result<ServerStep, ProtocolError> {
        let client = match HsMsg::decode(raw)? {
            HsMsg::Hello(h) => h,
            other => return Err(unexpected("hello", &other)),
        };
        if let Err(e) = check_peer_hello(key, &client, "peer") {
            return Ok(ServerStep::Refuse(
                HsMsg::Reject(format!("node '{name}' refuses: {e}")).encode(),
                e,
            ));
        }
        let hello = our_hello(key, Role::Node, name)?;
        let hello_bytes = HsMsg::Hello(hello.clone()).encode();
        let proof = key.mac(&[b"ringllm server proof v1\0", raw, &hello_bytes]);
        let mut out = hello_bytes.clone();
        out.extend_from_slice(&HsMsg::Proof(proof).encode());
        Ok(ServerStep::Continue(
            ServerHandshake {
                key: key.clone(),
                hello,
                hello_bytes,
                client,
                client_bytes: raw.to_vec(),
            },
            out,
        ))
    }

    /// The client's proof. `Ok((session, accept bytes))`, or `Err((reject bytes, error))`.
    #[allow(clippy::result_large_err)]
    pub fn on_proof(self, raw: &[u8]) -> Result<(Session, Vec<u8>), (Vec<u8>, ProtocolError)> {
        let reject = |e: ProtocolError| (HsMsg::Reject(e.to_string()).encode(), e);
        match HsMsg::decode(raw) {
            Ok(HsMsg::Proof(p)) => {
                let want = self.key.mac(&[
                    b"ringllm client proof v1\0",
                    &self.client_bytes,
                    &self.hello_bytes,
                ]);
                if !ct_eq(&p, &want) {
                    return Err(reject(ProtocolError::Auth(format!(
                        "'{}' could not prove it holds the cluster key (wrong key file?)",
                        escape(&self.client.name)
                    ))));
                }
                let session = Session {
                    session_key: session_key(&self.key, &self.client.nonce, &self.hello.nonce),
                    initiator: false,
                    peer: self.client,
                };
                Ok((session, HsMsg::Accept.encode()))
            }
            Ok(HsMsg::Reject(r)) => Err((Vec::new(), ProtocolError::Rejected(r))),
            Ok(other) => Err(reject(unexpected("proof", &other))),
            Err(e) => Err(reject(e)),
        }
    }
}

fn unexpected(wanted: &str, got: &HsMsg) -> ProtocolError {
    let name = match got {
        HsMsg::Hello(_) => "hello",
        HsMsg::Proof(_) => "proof",
        HsMsg::Accept => "accept",
        HsMsg::Reject(_) => "reject",
    };
    ProtocolError::Handshake(format!("expected {wanted}, got {name}"))
}
