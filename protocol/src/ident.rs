//! Per-node identity: a node key (an Ed25519 keypair of the node's own) and a certificate
//! binding a node name to its public key, signed by the cluster; and the revocation list,
//! names the cluster refuses.
//!
//! # Who can sign a certificate
//!
//! The cluster key is a symmetric secret, so it cannot sign by itself. Certificates are
//! signed with an Ed25519 *cluster signing key* derived from it (seed = HMAC(cluster key,
//! label)): today every holder of the cluster key can mint certificates, exactly as every
//! holder can open any link, because links are still keyed by the cluster key. A MAC would
//! have given the same protection today; a signature was chosen because verifying it needs
//! only the cluster's public key, so a later release can take the cluster key off the nodes
//! (nodes keep their node key and the cluster public key; links keyed by an ephemeral key
//! exchange) without reissuing a single certificate. Until then revocation guards against a
//! node key that leaked without the cluster key, and names a machine to refuse; it does not
//! stop a holder of the cluster key.
//!
//! # Certificate (version 1), little-endian
//!
//! ```text
//! "RLNC" | version u8 = 1 | cluster id [8] | serial u64 | node public key [32]
//!        | name length u8 | name | cluster signature [64] over everything before it
//! ```
//!
//! Names are 1 to 64 bytes of `A-Z a-z 0-9 . _ : -`, so a name from a certificate can never
//! carry a terminal escape; logs still print them with `{:?}`.
//!
//! The node proves it holds the private half by signing each handshake's transcript (both
//! hellos, so a recorded signature is useless in another handshake).

use crate::error::ProtocolError;
use crate::key::{hex, ClusterKey};
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use std::collections::BTreeSet;
use std::path::Path;

pub const CERT_MAGIC: [u8; 4] = *b"RLNC";
pub const CERT_VERSION: u8 = 1;
/// A hello carries at most `handshake::MAX_NAME` bytes of name, and a certified name must equal
/// its hello's: one limit.
pub const MAX_NODE_NAME: usize = crate::handshake::MAX_NAME;
pub const SIG_LEN: usize = 64;
pub const PUBLIC_KEY_LEN: usize = 32;
/// Bytes before the name: magic, version, cluster id, serial, public key, name length.
const CERT_FIXED: usize = 4 + 1 + 8 + 8 + PUBLIC_KEY_LEN + 1;
pub const MIN_CERT: usize = CERT_FIXED + 1 + SIG_LEN;
pub const MAX_CERT: usize = CERT_FIXED + MAX_NODE_NAME + SIG_LEN;
/// Most names a revocation list may hold (file, and handshake message).
pub const MAX_REVOKED: usize = 256;
/// Largest node key file read (a few hundred bytes are used).
pub const MAX_NODE_KEY_FILE: u64 = 4096;
/// Largest revocation file read (`MAX_REVOKED` names with comments fit easily).
pub const MAX_REVOKED_FILE: u64 = 64 << 10;
const SIGNING_LABEL: &[u8] = b"ringllm cluster signing key v1\0";

/// Checks a node name for a certificate or a revocation list.
pub fn check_node_name(name: &str) -> Result<(), ProtocolError> {
    if name.is_empty() || name.len() > MAX_NODE_NAME {
        return Err(ProtocolError::Key(format!(
            "node name {name:?} must have 1 to {MAX_NODE_NAME} bytes"
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(ProtocolError::Key(format!(
            "node name {name:?} has {c:?}: use letters, digits and . _ : - only"
        )));
    }
    Ok(())
}

/// A node certificate: who, which key, issued by which cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCert {
    pub cluster_id: [u8; 8],
    /// Random at issue: tells two certificates of one name apart (in logs, for now).
    pub serial: u64,
    pub public_key: [u8; PUBLIC_KEY_LEN],
    pub name: String,
    /// The cluster signing key's signature over the encoded fields.
    pub signature: [u8; SIG_LEN],
}

fn cluster_signing_key(key: &ClusterKey) -> Result<Ed25519KeyPair, ProtocolError> {
    Ed25519KeyPair::from_seed_unchecked(&key.mac(&[SIGNING_LABEL]))
        .map_err(|e| ProtocolError::Key(format!("cannot derive the cluster signing key: {e}")))
}

/// The cluster's public signing key (what a certificate is checked against).
/// Derived once per key: every handshake that checks a certificate asks for it.
pub fn cluster_public_key(key: &ClusterKey) -> Result<[u8; PUBLIC_KEY_LEN], ProtocolError> {
    key.signing_public(|| {
        let kp = cluster_signing_key(key)?;
        let mut pk = [0u8; PUBLIC_KEY_LEN];
        pk.copy_from_slice(kp.public_key().as_ref());
        Ok(pk)
    })
}

impl NodeCert {
    fn signed_part(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(CERT_FIXED + self.name.len());
        b.extend_from_slice(&CERT_MAGIC);
        b.push(CERT_VERSION);
        b.extend_from_slice(&self.cluster_id);
        b.extend_from_slice(&self.serial.to_le_bytes());
        b.extend_from_slice(&self.public_key);
        b.push(self.name.len() as u8);
        b.extend_from_slice(self.name.as_bytes());
        b
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = self.signed_part();
        b.extend_from_slice(&self.signature);
        b
    }

    /// Decodes (form only: `verify` checks the signature). Sizes are checked first.
    pub fn decode(b: &[u8]) -> Result<NodeCert, ProtocolError> {
        let bad = |why: String| ProtocolError::Handshake(format!("node certificate: {why}"));
        if b.len() < MIN_CERT || b.len() > MAX_CERT {
            return Err(bad(format!(
                "{} bytes, a certificate has {MIN_CERT} to {MAX_CERT}",
                b.len()
            )));
        }
        if b[..4] != CERT_MAGIC {
            return Err(bad(format!("magic bytes {:02x?}", &b[..4])));
        }
        if b[4] != CERT_VERSION {
            return Err(ProtocolError::Version {
                what: "node certificate",
                ours: CERT_VERSION as u32,
                theirs: b[4] as u32,
            });
        }
        let name_len = b[CERT_FIXED - 1] as usize;
        if b.len() != CERT_FIXED + name_len + SIG_LEN {
            return Err(bad(format!(
                "{} bytes, but a name of {name_len} bytes makes {}",
                b.len(),
                CERT_FIXED + name_len + SIG_LEN
            )));
        }
        let name = std::str::from_utf8(&b[CERT_FIXED..CERT_FIXED + name_len])
            .map_err(|_| bad("the name is not UTF-8".into()))?;
        check_node_name(name).map_err(|e| bad(e.to_string()))?;
        // The length is checked above: every field is there.
        fn take<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
            let mut a = [0u8; N];
            a.copy_from_slice(&b[at..at + N]);
            a
        }
        Ok(NodeCert {
            cluster_id: take(b, 5),
            serial: u64::from_le_bytes(take(b, 13)),
            public_key: take(b, 21),
            name: name.to_string(),
            signature: take(b, b.len() - SIG_LEN),
        })
    }

    /// Issues a certificate for `name` and `public_key`, signed by `key`'s signing key.
    pub fn issue(
        key: &ClusterKey,
        name: &str,
        public_key: [u8; PUBLIC_KEY_LEN],
    ) -> Result<NodeCert, ProtocolError> {
        check_node_name(name)?;
        let mut serial = [0u8; 8];
        getrandom::fill(&mut serial)
            .map_err(|e| ProtocolError::Key(format!("no randomness from the OS: {e}")))?;
        let mut cert = NodeCert {
            cluster_id: key.id(),
            serial: u64::from_le_bytes(serial),
            public_key,
            name: name.to_string(),
            signature: [0; SIG_LEN],
        };
        let sig = cluster_signing_key(key)?.sign(&cert.signed_part());
        cert.signature.copy_from_slice(sig.as_ref());
        Ok(cert)
    }

    /// Checks the certificate was issued by `key`'s cluster and not altered.
    pub fn verify(&self, key: &ClusterKey) -> Result<(), ProtocolError> {
        if self.cluster_id != key.id() {
            return Err(ProtocolError::Auth(format!(
                "the node certificate of {:?} was issued for cluster {}, ours is {}",
                self.name,
                hex(&self.cluster_id),
                key.id_hex()
            )));
        }
        let pk = cluster_public_key(key)?;
        UnparsedPublicKey::new(&ED25519, pk)
            .verify(&self.signed_part(), &self.signature)
            .map_err(|_| {
                ProtocolError::Auth(format!(
                    "the node certificate of {:?} is not signed by this cluster's key (forged \
                     or altered)",
                    self.name
                ))
            })
    }

    /// Checks `sig` is this certificate's node key's signature of `msg`.
    pub fn verify_by_node(&self, msg: &[u8], sig: &[u8]) -> Result<(), ProtocolError> {
        UnparsedPublicKey::new(&ED25519, self.public_key)
            .verify(msg, sig)
            .map_err(|_| {
                ProtocolError::Auth(format!(
                    "{:?} presented a node certificate but not a signature by its node key \
                     (a copied certificate?)",
                    self.name
                ))
            })
    }
}

/// A node's identity: its private node key and its certificate.
pub struct NodeIdentity {
    keypair: Ed25519KeyPair,
    seed: [u8; 32],
    pub cert: NodeCert,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NodeIdentity({:?}, serial {:016x})",
            self.cert.name, self.cert.serial
        )
    }
}

fn keypair(seed: &[u8; 32]) -> Result<Ed25519KeyPair, ProtocolError> {
    Ed25519KeyPair::from_seed_unchecked(seed)
        .map_err(|e| ProtocolError::Key(format!("bad node key: {e}")))
}

impl NodeIdentity {
    /// A fresh node key for `name`, certified by `key`.
    pub fn generate(key: &ClusterKey, name: &str) -> Result<NodeIdentity, ProtocolError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed)
            .map_err(|e| ProtocolError::Key(format!("no randomness from the OS: {e}")))?;
        let keypair = keypair(&seed)?;
        let mut pk = [0u8; PUBLIC_KEY_LEN];
        pk.copy_from_slice(keypair.public_key().as_ref());
        let cert = NodeCert::issue(key, name, pk)?;
        Ok(NodeIdentity {
            keypair,
            seed,
            cert,
        })
    }

    pub fn name(&self) -> &str {
        &self.cert.name
    }

    /// Signs `msg` with the node key.
    pub fn sign(&self, msg: &[u8]) -> [u8; SIG_LEN] {
        let mut s = [0u8; SIG_LEN];
        s.copy_from_slice(self.keypair.sign(msg).as_ref());
        s
    }

    /// The node key file: the private seed and the certificate, in hex.
    pub fn to_text(&self) -> String {
        format!(
            "# ringllm node key ({}): secret, for one machine only\nnode-seed {}\nnode-cert {}\n",
            self.cert.name,
            hex(&self.seed),
            hex(&self.cert.encode())
        )
    }

    /// Parses a node key file's text and checks the seed matches the certificate.
    pub fn from_text(text: &str) -> Result<NodeIdentity, ProtocolError> {
        let (mut seed, mut cert) = (None, None);
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |what: &str| ProtocolError::Key(format!("line {}: {what}", i + 1));
            match line.split_once(' ') {
                Some(("node-seed", h)) => {
                    let b = unhex(h.trim(), 32).ok_or_else(|| bad("node-seed is not 64 hex"))?;
                    seed = Some(<[u8; 32]>::try_from(b).map_err(|_| bad("node-seed length"))?);
                }
                Some(("node-cert", h)) => {
                    let b = unhex(h.trim(), MAX_CERT)
                        .ok_or_else(|| bad("node-cert is not hex of a certificate's size"))?;
                    cert = Some(NodeCert::decode(&b)?);
                }
                _ => return Err(bad("expected `node-seed HEX` or `node-cert HEX`")),
            }
        }
        let seed = seed.ok_or_else(|| ProtocolError::Key("no node-seed line".into()))?;
        let cert = cert.ok_or_else(|| ProtocolError::Key("no node-cert line".into()))?;
        let keypair = keypair(&seed)?;
        if keypair.public_key().as_ref() != cert.public_key {
            return Err(ProtocolError::Key(
                "the node-seed is not the key the node-cert certifies".into(),
            ));
        }
        Ok(NodeIdentity {
            keypair,
            seed,
            cert,
        })
    }

    /// Loads a node key file (size checked before reading) and checks it against `key`.
    pub fn load(path: &Path, key: &ClusterKey) -> Result<NodeIdentity, ProtocolError> {
        let text = read_capped(path, MAX_NODE_KEY_FILE)?;
        let id = NodeIdentity::from_text(&text)
            .map_err(|e| ProtocolError::Key(format!("node key {}: {e}", path.display())))?;
        id.cert
            .verify(key)
            .map_err(|e| ProtocolError::Key(format!("node key {}: {e}", path.display())))?;
        Ok(id)
    }
}

/// Reads a text file of at most `max` bytes, refusing a larger one before reading it.
pub(crate) fn read_capped(path: &Path, max: u64) -> Result<String, ProtocolError> {
    use std::io::Read;
    let cant =
        |e: std::io::Error| ProtocolError::Key(format!("cannot read {}: {e}", path.display()));
    let f = std::fs::File::open(path).map_err(cant)?;
    let mut text = String::new();
    f.take(max + 1).read_to_string(&mut text).map_err(cant)?;
    if text.len() as u64 > max {
        return Err(ProtocolError::Key(format!(
            "{} is larger than {max} bytes: not a ringllm file",
            path.display()
        )));
    }
    Ok(text)
}

fn unhex(s: &str, max_bytes: usize) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() / 2 > max_bytes {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Node names the cluster refuses (`ringllm revoke NAME`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Revocations {
    names: BTreeSet<String>,
}

impl Revocations {
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// Adds `name` (checked); false if it was there already.
    pub fn insert(&mut self, name: &str) -> Result<bool, ProtocolError> {
        check_node_name(name)?;
        if !self.names.contains(name) && self.names.len() >= MAX_REVOKED {
            return Err(ProtocolError::TooLarge {
                what: "revocation list",
                len: self.names.len() as u64 + 1,
                max: MAX_REVOKED as u64,
            });
        }
        Ok(self.names.insert(name.to_string()))
    }

    /// Adds every name of `other` (revocations only grow while a process runs).
    pub fn merge(&mut self, other: &Revocations) -> Result<(), ProtocolError> {
        for n in other.names() {
            self.insert(n)?;
        }
        Ok(())
    }

    /// Parses a revocation file: one name a line, `#` comments, blank lines.
    pub fn from_text(text: &str) -> Result<Revocations, ProtocolError> {
        let mut r = Revocations::default();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            r.insert(line)
                .map_err(|e| ProtocolError::Key(format!("line {}: {e}", i + 1)))?;
        }
        Ok(r)
    }

    pub fn to_text(&self) -> String {
        let mut s =
            String::from("# ringllm revoked node names, one a line (ringllm revoke NAME)\n");
        for n in &self.names {
            s.push_str(n);
            s.push('\n');
        }
        s
    }

    /// Loads `path`; a missing file is an empty list.
    pub fn load(path: &Path) -> Result<Revocations, ProtocolError> {
        if !path.exists() {
            return Ok(Revocations::default());
        }
        let text = read_capped(path, MAX_REVOKED_FILE)?;
        Revocations::from_text(&text)
            .map_err(|e| ProtocolError::Key(format!("revocation list {}: {e}", path.display())))
    }

    /// On the wire: a u16 count, then each name as a length byte and its bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.names.len() as u16).to_le_bytes());
        for n in &self.names {
            out.push(n.len() as u8);
            out.extend_from_slice(n.as_bytes());
        }
    }

    /// Decodes from the front of `b`; returns the list and the bytes used.
    pub fn decode(b: &[u8]) -> Result<(Revocations, usize), ProtocolError> {
        let short = || ProtocolError::Handshake("revocation list truncated".into());
        let count = u16::from_le_bytes(
            b.get(..2)
                .ok_or_else(short)?
                .try_into()
                .map_err(|_| short())?,
        ) as usize;
        if count > MAX_REVOKED {
            return Err(ProtocolError::TooLarge {
                what: "revocation list",
                len: count as u64,
                max: MAX_REVOKED as u64,
            });
        }
        let mut r = Revocations::default();
        let mut at = 2;
        for _ in 0..count {
            let len = *b.get(at).ok_or_else(short)? as usize;
            let name = b.get(at + 1..at + 1 + len).ok_or_else(short)?;
            let name = std::str::from_utf8(name)
                .map_err(|_| ProtocolError::Handshake("revoked name is not UTF-8".into()))?;
            r.insert(name)
                .map_err(|e| ProtocolError::Handshake(format!("revocation list: {e}")))?;
            at += 1 + len;
        }
        Ok((r, at))
    }
}

/// Where a cluster key's revocation list lives: beside it, `KEYFILE.revoked`.
pub fn revocation_path(key_path: &Path) -> std::path::PathBuf {
    let mut p = key_path.as_os_str().to_owned();
    p.push(".revoked");
    p.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> ClusterKey {
        ClusterKey::from_bytes(s.as_bytes()).unwrap()
    }

    #[test]
    fn a_certificate_round_trips_and_verifies_under_its_cluster_only() {
        let k = key("alpha");
        let id = NodeIdentity::generate(&k, "gpu-1").unwrap();
        let bytes = id.cert.encode();
        let back = NodeCert::decode(&bytes).unwrap();
        assert_eq!(back, id.cert);
        back.verify(&k).unwrap();
        let e = back.verify(&key("beta")).unwrap_err().to_string();
        assert!(e.contains("issued for cluster"), "{e}");
    }

    #[test]
    fn an_altered_name_or_a_flipped_bit_fails_the_signature() {
        let k = key("alpha");
        let id = NodeIdentity::generate(&k, "node-a").unwrap();
        let mut renamed = id.cert.clone();
        renamed.name = "node-b".into();
        let e = renamed.verify(&k).unwrap_err().to_string();
        assert!(e.contains("not signed by this cluster's key"), "{e}");
        let good = id.cert.encode();
        for i in [5, 13, 21, 60, good.len() - 1] {
            let mut b = good.clone();
            b[i] ^= 1;
            // Either malformed or unsigned, never accepted.
            if let Ok(c) = NodeCert::decode(&b) {
                assert!(c.verify(&k).is_err(), "bit flip at {i} accepted");
            }
        }
    }

    #[test]
    fn a_certificate_signed_by_another_clusters_key_is_refused_even_with_our_id() {
        let (ours, theirs) = (key("alpha"), key("beta"));
        let mut c = NodeIdentity::generate(&theirs, "n").unwrap().cert;
        c.cluster_id = ours.id();
        assert!(c.verify(&ours).is_err());
    }

    #[test]
    fn truncated_oversized_and_malformed_certificates_are_refused() {
        let k = key("alpha");
        let good = NodeIdentity::generate(&k, "abc").unwrap().cert.encode();
        for n in 0..good.len() {
            assert!(NodeCert::decode(&good[..n]).is_err(), "truncated to {n}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(NodeCert::decode(&long).is_err());
        assert!(NodeCert::decode(&[0u8; MAX_CERT + 1]).is_err());
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(NodeCert::decode(&magic).is_err());
        let mut version = good.clone();
        version[4] = 2;
        assert!(NodeCert::decode(&version)
            .unwrap_err()
            .to_string()
            .contains("version"));
        // A name with an escape character is refused at decode.
        let mut esc = good.clone();
        esc[CERT_FIXED] = 0x1b;
        assert!(NodeCert::decode(&esc).is_err());
        // A name length past the end.
        let mut len = good;
        len[CERT_FIXED - 1] = 60;
        assert!(NodeCert::decode(&len).is_err());
    }

    #[test]
    fn node_names_are_limited_to_a_safe_alphabet() {
        for ok in ["a", "node-1", "host.lan:7701", "x_y", &"n".repeat(64)] {
            check_node_name(ok).unwrap();
        }
        for bad in ["", "a b", "a\x1b[31m", "é", "a\nb", &"n".repeat(65)] {
            assert!(check_node_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_node_key_file_round_trips_and_a_mismatched_seed_is_refused() {
        let k = key("alpha");
        let id = NodeIdentity::generate(&k, "n1").unwrap();
        let back = NodeIdentity::from_text(&id.to_text()).unwrap();
        assert_eq!(back.cert, id.cert);
        assert_eq!(back.sign(b"m"), id.sign(b"m"));
        let other = NodeIdentity::generate(&k, "n1").unwrap();
        let mixed = format!(
            "node-seed {}\nnode-cert {}\n",
            hex(&other.seed),
            hex(&id.cert.encode())
        );
        assert!(NodeIdentity::from_text(&mixed).is_err());
        assert!(NodeIdentity::from_text("node-seed 00\n").is_err());
        assert!(NodeIdentity::from_text("garbage\n").is_err());
        let huge = format!("node-cert {}\n", "00".repeat(MAX_CERT + 1));
        assert!(NodeIdentity::from_text(&huge).is_err());
    }

    #[test]
    fn a_signature_by_another_node_key_is_refused() {
        let k = key("alpha");
        let a = NodeIdentity::generate(&k, "a").unwrap();
        let b = NodeIdentity::generate(&k, "a").unwrap();
        a.cert.verify_by_node(b"t", &a.sign(b"t")).unwrap();
        assert!(a.cert.verify_by_node(b"t", &b.sign(b"t")).is_err());
        assert!(a.cert.verify_by_node(b"u", &a.sign(b"t")).is_err());
    }

    #[test]
    fn revocation_lists_parse_encode_and_refuse_bad_input() {
        let r = Revocations::from_text("# c\n\nnode-a\n  node-b \nnode-a\n").unwrap();
        assert_eq!(r.len(), 2);
        assert!(r.contains("node-b"));
        assert_eq!(Revocations::from_text(&r.to_text()).unwrap(), r);
        let mut wire = Vec::new();
        r.encode(&mut wire);
        let (back, used) = Revocations::decode(&wire).unwrap();
        assert_eq!((back, used), (r.clone(), wire.len()));
        for n in 0..wire.len() {
            assert!(Revocations::decode(&wire[..n]).is_err(), "truncated to {n}");
        }
        assert!(Revocations::decode(&[0xff, 0xff]).is_err());
        assert!(Revocations::from_text("bad name\n").is_err());
        let mut full = Revocations::default();
        for i in 0..MAX_REVOKED {
            full.insert(&format!("n{i}")).unwrap();
        }
        assert!(full.insert("one-more").is_err());
    }
}
