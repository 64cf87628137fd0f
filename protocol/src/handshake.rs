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
//! Node identities (minor 2, `CAP_IDENT`): when both hellos announce `CAP_IDENT`, each side
//! also sends one `Ident` message before its proof: its node certificate and its node key's
//! signature of both hellos (`ident`), or nothing; a coordinator's also carries the
//! cluster's revocation list, which the node adopts. Both proofs then cover the `Ident`
//! messages too. A peer whose name is revoked, whose certificate does not verify, or whose
//! hello name differs from its certificate's is refused with a `Reject` naming it. A process
//! that uses node keys (`ClusterKey::uses_node_keys`) refuses a peer without `CAP_IDENT`
//! (an older release) with a `Reject` it can print, rather than let it in unchecked.
//!
//! ```text
//!   Hello_c ─▶   ◀─ Hello_s, Ident_s, Proof_s   Ident_c, Proof_c ─▶   ◀─ Accept | Reject
//! ```
//!
//! This module only encodes, decodes and checks; `io` runs it over a stream.

use crate::error::ProtocolError;
use crate::ident::{NodeCert, Revocations, MAX_CERT, MAX_NODE_NAME, MAX_REVOKED, SIG_LEN};
use crate::key::{ct_eq, ClusterKey};
use crate::untrusted::escape;

pub const HS_MAGIC: [u8; 4] = *b"RLHS";
/// 1: the ring. 2: model slices sent to nodes (`Slice*` control messages, `Slice` frames).
pub const PROTOCOL_MAJOR: u16 = 3;
/// Minor 1: `Role::Monitor` connections and the `GetStatus`/`Status` control messages.
/// Minor 2: node identities (`CAP_IDENT`, the `Ident` message).
pub const PROTOCOL_MINOR: u16 = 2;
/// Capability bits a peer may announce.
pub const CAP_TCP: u64 = 1;
/// The peer speaks node identities: an `Ident` message precedes each proof.
pub const CAP_IDENT: u64 = 2;
pub const MAX_BODY: usize = 1024;
/// Largest `Ident` body: flags, a certificate with its length and signature, a full
/// revocation list.
pub const MAX_IDENT_BODY: usize =
    1 + 1 + MAX_CERT + SIG_LEN + 2 + MAX_REVOKED * (1 + MAX_NODE_NAME);
pub const MAX_NAME: usize = 64;
pub const MSG_HEADER_LEN: usize = 7;

/// Message types; numbers are on the wire.
const T_HELLO: u8 = 1;
const T_PROOF: u8 = 2;
const T_ACCEPT: u8 = 3;
const T_REJECT: u8 = 4;
const T_IDENT: u8 = 5;
/// `Ident` flags.
const IDENT_CERT: u8 = 1;
const IDENT_REVOKED: u8 = 2;

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

/// A side's node identity, sent when both speak `CAP_IDENT`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ident {
    /// Its certificate, and its node key's signature of both hellos.
    pub cert: Option<(NodeCert, [u8; SIG_LEN])>,
    /// From a coordinator: the names the cluster refuses.
    pub revoked: Option<Revocations>,
}

impl Ident {
    fn encode_body(&self) -> Vec<u8> {
        let flags = if self.cert.is_some() { IDENT_CERT } else { 0 }
            | if self.revoked.is_some() {
                IDENT_REVOKED
            } else {
                0
            };
        let mut b = vec![flags];
        if let Some((cert, sig)) = &self.cert {
            let c = cert.encode();
            b.push(c.len() as u8);
            b.extend_from_slice(&c);
            b.extend_from_slice(sig);
        }
        if let Some(r) = &self.revoked {
            r.encode(&mut b);
        }
        b
    }

    fn decode_body(body: &[u8]) -> Result<Ident, ProtocolError> {
        let short = || ProtocolError::Handshake("ident message truncated".into());
        let flags = *body.first().ok_or_else(short)?;
        if flags & !(IDENT_CERT | IDENT_REVOKED) != 0 {
            return Err(ProtocolError::BadField {
                field: "ident flags",
                value: flags as u64,
            });
        }
        let mut at = 1;
        let mut ident = Ident::default();
        if flags & IDENT_CERT != 0 {
            let len = *body.get(at).ok_or_else(short)? as usize;
            let cert = NodeCert::decode(body.get(at + 1..at + 1 + len).ok_or_else(short)?)?;
            at += 1 + len;
            let sig: [u8; SIG_LEN] = body
                .get(at..at + SIG_LEN)
                .ok_or_else(short)?
                .try_into()
                .map_err(|_| short())?;
            at += SIG_LEN;
            ident.cert = Some((cert, sig));
        }
        if flags & IDENT_REVOKED != 0 {
            let (r, used) = Revocations::decode(&body[at..])?;
            at += used;
            ident.revoked = Some(r);
        }
        if at != body.len() {
            return Err(ProtocolError::Handshake(
                "ident message has trailing bytes".into(),
            ));
        }
        Ok(ident)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HsMsg {
    Hello(Hello),
    Proof([u8; 32]),
    Accept,
    Reject(String),
    Ident(Box<Ident>),
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
            HsMsg::Ident(i) => (T_IDENT, i.encode_body()),
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
        if !(T_HELLO..=T_IDENT).contains(&t) {
            return Err(ProtocolError::BadField {
                field: "handshake message type",
                value: t as u64,
            });
        }
        let len = u16::from_le_bytes([b[5], b[6]]) as usize;
        let max = if t == T_IDENT {
            MAX_IDENT_BODY
        } else {
            MAX_BODY
        };
        if len > max {
            return Err(ProtocolError::TooLarge {
                what: "handshake message",
                len: len as u64,
                max: max as u64,
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
            T_IDENT => Ok(HsMsg::Ident(Box::new(Ident::decode_body(body)?))),
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
    /// The peer's node certificate, checked against the cluster (`None`: it presented none).
    pub peer_cert: Option<NodeCert>,
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
    if key.uses_node_keys() && h.caps & CAP_IDENT == 0 {
        return Err(ProtocolError::Handshake(format!(
            "{who} {:?} speaks protocol {}.{}, without node identities, and this cluster uses \
             node keys: run the same ringllm release ({PROTOCOL_MAJOR}.{PROTOCOL_MINOR} or \
             newer) on every machine",
            h.name, h.major, h.minor
        )));
    }
    Ok(())
}

/// Both hellos announce node identities: each side sends an `Ident` before its proof.
fn speaks_ident(a: &Hello, b: &Hello) -> bool {
    a.caps & b.caps & CAP_IDENT != 0
}

/// What a node key signs: the side it speaks for and both hellos.
fn transcript(side: &[u8], hello_c: &[u8], hello_s: &[u8]) -> Vec<u8> {
    [b"ringllm node ident v1\0", side, hello_c, hello_s].concat()
}

/// Our `Ident` message: our certificate and signature, and, from a coordinator, the list of
/// revoked names.
fn our_ident(key: &ClusterKey, role: Role, side: &[u8], hello_c: &[u8], hello_s: &[u8]) -> Vec<u8> {
    let cert = key.identity().map(|id| {
        let sig = id.sign(&transcript(side, hello_c, hello_s));
        (id.cert.clone(), sig)
    });
    let revoked = (role == Role::Coordinator).then(|| key.revoked());
    HsMsg::Ident(Box::new(Ident { cert, revoked })).encode()
}

/// Checks the peer's name against the revocation list and its certificate, if it sent one,
/// against the cluster, its hello name and its signature of this handshake.
fn check_peer_ident(
    key: &ClusterKey,
    peer: &Hello,
    ident: Option<&Ident>,
    side: &[u8],
    hellos: (&[u8], &[u8]),
) -> Result<Option<NodeCert>, ProtocolError> {
    if key.is_revoked(&peer.name) {
        return Err(ProtocolError::Revoked {
            name: peer.name.clone(),
        });
    }
    let Some((cert, sig)) = ident.and_then(|i| i.cert.as_ref()) else {
        return Ok(None);
    };
    cert.verify(key)?;
    if cert.name != peer.name {
        return Err(ProtocolError::Auth(format!(
            "the peer calls itself {:?} but its node certificate names {:?}",
            peer.name, cert.name
        )));
    }
    cert.verify_by_node(&transcript(side, hellos.0, hellos.1), sig)?;
    Ok(Some(cert.clone()))
}

fn our_hello(key: &ClusterKey, role: Role, name: &str) -> Result<Hello, ProtocolError> {
    Ok(Hello {
        major: PROTOCOL_MAJOR,
        minor: PROTOCOL_MINOR,
        caps: CAP_TCP | CAP_IDENT,
        role,
        cluster_id: key.id(),
        nonce: fresh_nonce()?,
        // A node with a node key goes by its certificate's name.
        name: key.identity().map_or(name, |id| id.name()).to_string(),
    })
}

/// The raw `Ident` message received, or none.
fn ident_of(i: &Option<(Ident, Vec<u8>)>) -> (Option<&Ident>, &[u8]) {
    match i {
        Some((i, raw)) => (Some(i), raw),
        None => (None, &[]),
    }
}

/// The connecting side.
pub struct ClientHandshake {
    key: ClusterKey,
    hello: Hello,
    hello_bytes: Vec<u8>,
    server: Option<(Hello, Vec<u8>)>,
    server_ident: Option<(Ident, Vec<u8>)>,
    peer_cert: Option<NodeCert>,
    /// Set once the server's proof has been checked; `on_verdict` refuses to finish before.
    proof_checked: bool,
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
                server_ident: None,
                peer_cert: None,
                proof_checked: false,
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

    /// True when the server sends an `Ident` message (`on_ident`) before its proof.
    pub fn expects_ident(&self) -> bool {
        self.server
            .as_ref()
            .is_some_and(|(s, _)| speaks_ident(&self.hello, s))
    }

    /// The server's `Ident` (raw message bytes), checked with its proof.
    pub fn on_ident(&mut self, raw: &[u8]) -> Result<(), ProtocolError> {
        match HsMsg::decode(raw)? {
            HsMsg::Ident(i) => {
                self.server_ident = Some((*i, raw.to_vec()));
                Ok(())
            }
            HsMsg::Reject(r) => Err(ProtocolError::Rejected(r)),
            other => Err(unexpected("ident", &other)),
        }
    }

    /// The server's proof; on success returns what we send: our `Ident` (when both speak
    /// node identities) and our proof.
    pub fn on_proof(&mut self, raw: &[u8]) -> Result<Vec<u8>, ProtocolError> {
        let (server, server_bytes) = self
            .server
            .as_ref()
            .ok_or_else(|| ProtocolError::Handshake("proof before hello".into()))?;
        let idents = speaks_ident(&self.hello, server);
        if idents && self.server_ident.is_none() {
            return Err(ProtocolError::Handshake("proof before ident".into()));
        }
        let (ident_s, ident_s_bytes) = ident_of(&self.server_ident);
        let p = match HsMsg::decode(raw)? {
            HsMsg::Proof(p) => p,
            HsMsg::Reject(r) => return Err(ProtocolError::Rejected(r)),
            other => return Err(unexpected("proof", &other)),
        };
        let want = self.key.mac(&[
            b"ringllm server proof v1\0",
            &self.hello_bytes,
            server_bytes,
            ident_s_bytes,
        ]);
        if !ct_eq(&p, &want) {
            return Err(ProtocolError::Auth(format!(
                "'{}' could not prove it holds the cluster key",
                escape(&server.name)
            )));
        }
        self.proof_checked = true;
        let hellos = (self.hello_bytes.as_slice(), server_bytes.as_slice());
        self.peer_cert = check_peer_ident(&self.key, server, ident_s, b"server", hellos)?;
        let mut out = if idents {
            our_ident(&self.key, self.hello.role, b"client", hellos.0, hellos.1)
        } else {
            Vec::new()
        };
        let mine = self.key.mac(&[
            b"ringllm client proof v1\0",
            &self.hello_bytes,
            server_bytes,
            ident_s_bytes,
            &out,
        ]);
        out.extend_from_slice(&HsMsg::Proof(mine).encode());
        Ok(out)
    }

    /// The server's verdict.
    pub fn on_verdict(self, raw: &[u8]) -> Result<Session, ProtocolError> {
        if !self.proof_checked {
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
                peer_cert: self.peer_cert,
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
    /// Our `Ident` message as sent (empty when the client does not speak node identities).
    ident_bytes: Vec<u8>,
    client: Hello,
    client_bytes: Vec<u8>,
    client_ident: Option<(Ident, Vec<u8>)>,
}

/// What to do after the client's first message.
pub enum ServerStep {
    /// Send these bytes (our hello, `Ident` and proof), then wait for the client's.
    Continue(Box<ServerHandshake>, Vec<u8>),
    /// Send these bytes (a rejection) and close; the error says why.
    Refuse(Vec<u8>, ProtocolError),
}

/// A server's answer to a bad client message: the `Reject` to send, and the error.
type Refusal = (Vec<u8>, ProtocolError);

fn refusal(e: ProtocolError) -> Refusal {
    (HsMsg::Reject(e.to_string()).encode(), e)
}

impl ServerHandshake {
    /// The client's hello (raw message bytes).
    pub fn on_hello(key: &ClusterKey, name: &str, raw: &[u8]) -> Result<ServerStep, ProtocolError> {
        let client = match HsMsg::decode(raw)? {
            HsMsg::Hello(h) => h,
            other => return Err(unexpected("hello", &other)),
        };
        let hello = our_hello(key, Role::Node, name)?;
        if let Err(e) = check_peer_hello(key, &client, "peer") {
            return Ok(ServerStep::Refuse(
                HsMsg::Reject(format!("node {:?} refuses: {e}", hello.name)).encode(),
                e,
            ));
        }
        let hello_bytes = HsMsg::Hello(hello.clone()).encode();
        let ident_bytes = if speaks_ident(&client, &hello) {
            our_ident(key, Role::Node, b"server", raw, &hello_bytes)
        } else {
            Vec::new()
        };
        let proof = key.mac(&[
            b"ringllm server proof v1\0",
            raw,
            &hello_bytes,
            &ident_bytes,
        ]);
        let mut out = hello_bytes.clone();
        out.extend_from_slice(&ident_bytes);
        out.extend_from_slice(&HsMsg::Proof(proof).encode());
        Ok(ServerStep::Continue(
            Box::new(ServerHandshake {
                key: key.clone(),
                hello,
                hello_bytes,
                ident_bytes,
                client,
                client_bytes: raw.to_vec(),
                client_ident: None,
            }),
            out,
        ))
    }

    /// True when the client sends an `Ident` message (`on_ident`) before its proof.
    pub fn expects_ident(&self) -> bool {
        speaks_ident(&self.client, &self.hello)
    }

    /// The client's `Ident` (raw message bytes), checked with its proof.
    #[allow(clippy::result_large_err)]
    pub fn on_ident(&mut self, raw: &[u8]) -> Result<(), Refusal> {
        match HsMsg::decode(raw) {
            Ok(HsMsg::Ident(i)) => {
                self.client_ident = Some((*i, raw.to_vec()));
                Ok(())
            }
            Ok(HsMsg::Reject(r)) => Err((Vec::new(), ProtocolError::Rejected(r))),
            Ok(other) => Err(refusal(unexpected("ident", &other))),
            Err(e) => Err(refusal(e)),
        }
    }

    /// The client's proof. `Ok((session, accept bytes))`, or `Err((reject bytes, error))`.
    /// A coordinator's revocation list is adopted once its proof holds.
    #[allow(clippy::result_large_err)]
    pub fn on_proof(self, raw: &[u8]) -> Result<(Session, Vec<u8>), Refusal> {
        let p = match HsMsg::decode(raw) {
            Ok(HsMsg::Proof(p)) => p,
            Ok(HsMsg::Reject(r)) => return Err((Vec::new(), ProtocolError::Rejected(r))),
            Ok(other) => return Err(refusal(unexpected("proof", &other))),
            Err(e) => return Err(refusal(e)),
        };
        if self.expects_ident() && self.client_ident.is_none() {
            return Err(refusal(ProtocolError::Handshake(
                "proof before ident".into(),
            )));
        }
        let (ident_c, ident_c_bytes) = ident_of(&self.client_ident);
        let want = self.key.mac(&[
            b"ringllm client proof v1\0",
            &self.client_bytes,
            &self.hello_bytes,
            &self.ident_bytes,
            ident_c_bytes,
        ]);
        if !ct_eq(&p, &want) {
            return Err(refusal(ProtocolError::Auth(format!(
                "'{}' could not prove it holds the cluster key (wrong key file?)",
                escape(&self.client.name)
            ))));
        }
        let hellos = (self.client_bytes.as_slice(), self.hello_bytes.as_slice());
        let peer_cert = check_peer_ident(&self.key, &self.client, ident_c, b"client", hellos)
            .map_err(refusal)?;
        if self.client.role == Role::Coordinator {
            if let Some(list) = ident_c.and_then(|i| i.revoked.as_ref()) {
                self.key.add_revoked(list).map_err(refusal)?;
            }
        }
        let session = Session {
            session_key: session_key(&self.key, &self.client.nonce, &self.hello.nonce),
            initiator: false,
            peer: self.client,
            peer_cert,
        };
        Ok((session, HsMsg::Accept.encode()))
    }
}

fn unexpected(wanted: &str, got: &HsMsg) -> ProtocolError {
    let name = match got {
        HsMsg::Hello(_) => "hello",
        HsMsg::Proof(_) => "proof",
        HsMsg::Accept => "accept",
        HsMsg::Reject(_) => "reject",
        HsMsg::Ident(_) => "ident",
    };
    ProtocolError::Handshake(format!("expected {wanted}, got {name}"))
}
