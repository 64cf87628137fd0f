//! The cluster key: any non-empty file; its bytes (trailing whitespace ignored) are the key.
//! Every link proves knowledge of it with HMAC-SHA256; the cluster id shown in logs is derived
//! from it and reveals nothing useful about it.
//!
//! A `ClusterKey` also carries what a process knows of per-node identity (`ident`): its own
//! node key, when it was started with one, and the names the cluster has revoked (loaded from
//! `KEYFILE.revoked` beside the key file, and on a node also taken from each coordinator), so
//! every handshake, whatever transport opens it, presents and checks them.

use crate::error::ProtocolError;
use crate::ident::{NodeIdentity, Revocations};
use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard};

pub type HmacSha256 = hmac::Hmac<Sha256>;

#[derive(Clone)]
pub struct ClusterKey {
    bytes: Vec<u8>,
    /// This process's node key (`node --node-key`).
    identity: Option<Arc<NodeIdentity>>,
    /// Names refused in every handshake; shared by every clone, so a list a node learns from
    /// its coordinator applies to all its links at once.
    revoked: Arc<RwLock<Revocations>>,
    /// The cluster's public signing key, derived from the key once (`ident::cluster_public_key`
    /// runs on every handshake that checks a certificate).
    signing_public: Arc<OnceLock<[u8; 32]>>,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterKey(id {})", self.id_hex())
    }
}

impl ClusterKey {
    pub fn from_bytes(raw: &[u8]) -> Result<ClusterKey, ProtocolError> {
        let end = raw
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        if end == 0 {
            return Err(ProtocolError::Key(
                "the key is empty (write one with `ringllm keygen FILE`)".into(),
            ));
        }
        Ok(ClusterKey {
            bytes: raw[..end].to_vec(),
            identity: None,
            revoked: Arc::default(),
            signing_public: Arc::default(),
        })
    }

    /// The key with this process's node key attached (`node --node-key`).
    pub fn with_identity(mut self, id: NodeIdentity) -> ClusterKey {
        self.identity = Some(Arc::new(id));
        self
    }

    pub fn identity(&self) -> Option<&NodeIdentity> {
        self.identity.as_deref()
    }

    fn list(&self) -> RwLockReadGuard<'_, Revocations> {
        self.revoked.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the names this process refuses.
    pub fn revoked(&self) -> Revocations {
        self.list().clone()
    }

    pub fn is_revoked(&self, name: &str) -> bool {
        self.list().contains(name)
    }

    /// Adds `more` to the names refused (by every clone of this key).
    pub fn add_revoked(&self, more: &Revocations) -> Result<(), ProtocolError> {
        self.revoked
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .merge(more)
    }

    /// True when this process takes part in node identities (it has a node key, or refuses
    /// some names): then a peer that cannot present or check them is refused.
    pub fn uses_node_keys(&self) -> bool {
        self.identity.is_some() || !self.list().is_empty()
    }

    /// `derive()` once per key (and its clones), then the value it gave.
    pub(crate) fn signing_public(
        &self,
        derive: impl FnOnce() -> Result<[u8; 32], ProtocolError>,
    ) -> Result<[u8; 32], ProtocolError> {
        if let Some(pk) = self.signing_public.get() {
            return Ok(*pk);
        }
        let pk = derive()?;
        Ok(*self.signing_public.get_or_init(|| pk))
    }

    pub fn load(path: &Path) -> Result<ClusterKey, ProtocolError> {
        let raw = std::fs::read(path).map_err(|e| {
            ProtocolError::Key(format!(
                "cannot read key file {}: {e} (create one with `ringllm keygen {}`)",
                path.display(),
                path.display()
            ))
        })?;
        let key = ClusterKey::from_bytes(&raw)
            .map_err(|e| ProtocolError::Key(format!("key file {}: {e}", path.display())))?;
        key.add_revoked(&Revocations::load(&crate::ident::revocation_path(path))?)?;
        Ok(key)
    }

    /// A fresh random key as 64 hex characters and a newline.
    pub fn generate_text() -> Result<String, ProtocolError> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b)
            .map_err(|e| ProtocolError::Key(format!("no randomness from the OS: {e}")))?;
        Ok(format!("{}\n", hex(&b)))
    }

    /// The 8-byte cluster id: a hash of the key, safe to show and send in the clear.
    pub fn id(&self) -> [u8; 8] {
        let mut h = Sha256::new();
        h.update(b"ringllm cluster id v1\0");
        h.update(&self.bytes);
        let d = h.finalize();
        let mut id = [0u8; 8];
        id.copy_from_slice(&d[..8]);
        id
    }

    pub fn id_hex(&self) -> String {
        hex(&self.id())
    }

    /// The cluster hash nodes advertise on the LAN (mDNS, `node --advertise`): 16 hex
    /// characters of an HMAC under the key with a label of its own, so it matches only
    /// machines holding the same key, tells an eavesdropper nothing about the key, and differs
    /// from the handshake's cluster id.
    pub fn discovery_hash(&self) -> String {
        hex(&self.mac(&[b"ringllm mdns cluster hash v1\0"])[..8])
    }

    /// HMAC-SHA256 of the concatenated `parts` under the key.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        // HMAC accepts keys of any length; the error branch cannot happen for Hmac<Sha256>.
        let mut m = match <HmacSha256 as KeyInit>::new_from_slice(&self.bytes) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC takes keys of any length"),
        };
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Constant-time equality of two MACs.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_whitespace_is_ignored_and_empty_is_refused() {
        let a = ClusterKey::from_bytes(b"secret\n").unwrap();
        let b = ClusterKey::from_bytes(b"secret  \r\n\t").unwrap();
        assert_eq!(a.id(), b.id());
        assert_eq!(a.mac(&[b"x"]), b.mac(&[b"x"]));
        let c = ClusterKey::from_bytes(b"Secret").unwrap();
        assert_ne!(a.id(), c.id());
        assert!(ClusterKey::from_bytes(b"").is_err());
        assert!(ClusterKey::from_bytes(b" \n\n").is_err());
    }

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let k = ClusterKey::from_bytes(b"Jefe").unwrap();
        let m = k.mac(&[b"what do ya want ", b"for nothing?"]);
        assert_eq!(
            hex(&m),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn discovery_hash_is_keyed_and_not_the_cluster_id() {
        let a = ClusterKey::from_bytes(b"secret\n").unwrap();
        let b = ClusterKey::from_bytes(b"secret").unwrap();
        let c = ClusterKey::from_bytes(b"Secret").unwrap();
        assert_eq!(a.discovery_hash(), b.discovery_hash());
        assert_ne!(a.discovery_hash(), c.discovery_hash());
        assert_eq!(a.discovery_hash().len(), 16);
        assert_ne!(a.discovery_hash(), a.id_hex());
        // HMAC-SHA256(key, label), first 8 bytes: computed independently of `mac`.
        let mut m = <HmacSha256 as KeyInit>::new_from_slice(b"secret").unwrap();
        m.update(b"ringllm mdns cluster hash v1\0");
        let want: [u8; 32] = m.finalize().into_bytes().into();
        assert_eq!(a.discovery_hash(), hex(&want[..8]));
    }

    #[test]
    fn generated_keys_differ_and_load() {
        let a = ClusterKey::generate_text().unwrap();
        let b = ClusterKey::generate_text().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 65);
        assert!(ClusterKey::from_bytes(a.as_bytes()).is_ok());
    }
}
