//! Certificates derived from the cluster key, and the TLS and QUIC configurations.

use super::{
    ALPN, CA_LABEL, CONNECTION_WINDOW, IDLE_TIMEOUT, INITIAL_RTT, KEEP_ALIVE, SERVER_NAME,
    STREAM_WINDOW,
};
use crate::error::{ProtocolError, TransportError};
use crate::key::ClusterKey;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{IdleTimeout, VarInt};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::sync::Arc;

/// The rustls crypto provider: ring, with its default TLS 1.3 suites and groups.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(super) fn tls_err(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Protocol(ProtocolError::Handshake(format!(
        "QUIC/TLS setup: {what}: {e}"
    )))
}

/// The PKCS#8 (RFC 8410, version 1) document of the Ed25519 key with this seed.
fn ed25519_pkcs8(seed: &[u8; 32]) -> Vec<u8> {
    // SEQUENCE { INTEGER 0, SEQUENCE { OID 1.3.101.112 }, OCTET STRING { OCTET STRING seed } }
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(seed);
    der
}

/// The cluster CA: its certificate parameters and key, the same in every process holding
/// the same key.
fn cluster_ca_parts(
    key: &ClusterKey,
) -> Result<(rcgen::CertificateParams, rcgen::KeyPair), TransportError> {
    let seed = key.mac(&[CA_LABEL]);
    let pkcs8 = PrivatePkcs8KeyDer::from(ed25519_pkcs8(&seed));
    let ca_key = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
        .map_err(|e| tls_err("deriving the cluster CA key", e))?;
    let mut p = rcgen::CertificateParams::default();
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(4000, 1, 1);
    p.serial_number = Some(rcgen::SerialNumber::from_slice(&[1]));
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("ringllm cluster {} CA", key.id_hex()),
    );
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ok((p, ca_key))
}

/// The cluster CA certificate derived from `key` (DER). Deterministic: every holder of the
/// key derives the same bytes.
pub fn cluster_ca(key: &ClusterKey) -> Result<CertificateDer<'static>, TransportError> {
    let (p, k) = cluster_ca_parts(key)?;
    let cert = p
        .self_signed(&k)
        .map_err(|e| tls_err("signing the cluster CA certificate", e))?;
    Ok(cert.der().clone())
}

/// One process's TLS identity: the cluster CA and a fresh leaf key and certificate.
pub struct ClusterTls {
    ca: CertificateDer<'static>,
    leaf: CertificateDer<'static>,
    leaf_key: Vec<u8>,
}

impl ClusterTls {
    /// Derives the CA from `key` and makes a random leaf certificate signed by it (`name`
    /// goes into the leaf's common name, for humans reading a capture).
    pub fn new(key: &ClusterKey, name: &str) -> Result<ClusterTls, TransportError> {
        let (ca_params, ca_key) = cluster_ca_parts(key)?;
        let ca = ca_params
            .self_signed(&ca_key)
            .map_err(|e| tls_err("signing the cluster CA certificate", e))?;
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let leaf_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
            .map_err(|e| tls_err("generating a certificate key", e))?;
        let mut p = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()])
            .map_err(|e| tls_err("certificate parameters", e))?;
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(4000, 1, 1);
        p.distinguished_name = rcgen::DistinguishedName::new();
        let cn: String = format!("ringllm node {name}").chars().take(64).collect();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.is_ca = rcgen::IsCa::ExplicitNoCa;
        p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        let leaf = p
            .signed_by(&leaf_key, &issuer)
            .map_err(|e| tls_err("signing our certificate", e))?;
        Ok(ClusterTls {
            ca: ca.der().clone(),
            leaf: leaf.der().clone(),
            leaf_key: leaf_key.serialize_der(),
        })
    }

    /// The cluster CA certificate.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.ca
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, TransportError> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(|e| tls_err("trusting the cluster CA", e))?;
        Ok(Arc::new(roots))
    }

    fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.clone()))
    }

    /// rustls client configuration: TLS 1.3 only, the server must chain to the cluster CA, we
    /// present our leaf certificate, no resumption or early data.
    pub fn rustls_client(&self) -> Result<rustls::ClientConfig, TransportError> {
        let provider = crypto_provider();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(|e| tls_err("server certificate verifier", e))?;
        let mut c = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("TLS 1.3", e))?
            .with_webpki_verifier(verifier)
            .with_client_auth_cert(vec![self.leaf.clone()], self.key_der())
            .map_err(|e| tls_err("our client certificate", e))?;
        c.alpn_protocols = vec![ALPN.to_vec()];
        c.resumption = rustls::client::Resumption::disabled();
        c.enable_early_data = false;
        Ok(c)
    }

    /// rustls server configuration: TLS 1.3 only, clients must present a certificate chaining
    /// to the cluster CA, no session tickets or early data.
    pub fn rustls_server(&self) -> Result<rustls::ServerConfig, TransportError> {
        let provider = crypto_provider();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(|e| tls_err("client certificate verifier", e))?;
        let mut s = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_err("TLS 1.3", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.leaf.clone()], self.key_der())
            .map_err(|e| tls_err("our server certificate", e))?;
        s.alpn_protocols = vec![ALPN.to_vec()];
        s.max_early_data_size = 0;
        s.send_tls13_tickets = 0;
        s.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        Ok(s)
    }

    pub fn client_config(&self) -> Result<quinn::ClientConfig, TransportError> {
        let crypto = QuicClientConfig::try_from(self.rustls_client()?)
            .map_err(|e| tls_err("QUIC client crypto", e))?;
        let mut c = quinn::ClientConfig::new(Arc::new(crypto));
        c.transport_config(Arc::new(transport_config(false)));
        Ok(c)
    }

    pub fn server_config(&self) -> Result<quinn::ServerConfig, TransportError> {
        let crypto = QuicServerConfig::try_from(self.rustls_server()?)
            .map_err(|e| tls_err("QUIC server crypto", e))?;
        let mut s = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        s.transport_config(Arc::new(transport_config(true)));
        Ok(s)
    }
}

/// Transport parameters for a LAN link: one bidirectional stream (opened by the client), no
/// unidirectional streams or datagrams, large windows, 1 s keep-alives, 5 s idle timeout.
pub fn transport_config(server: bool) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(VarInt::from_u32(u32::from(server)))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .datagram_receive_buffer_size(None)
        .stream_receive_window(VarInt::from_u32(STREAM_WINDOW))
        .receive_window(VarInt::from_u32(CONNECTION_WINDOW))
        .send_window(u64::from(CONNECTION_WINDOW))
        .keep_alive_interval(Some(KEEP_ALIVE))
        .initial_rtt(INITIAL_RTT)
        .allow_spin(false);
    // 5 s fits the idle timeout's range (2^62 ms), so the conversion cannot fail.
    if let Ok(idle) = IdleTimeout::try_from(IDLE_TIMEOUT) {
        t.max_idle_timeout(Some(idle));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_deterministic_and_depends_on_the_key() {
        let a = ClusterKey::from_bytes(b"key one").unwrap();
        let b = ClusterKey::from_bytes(b"key two").unwrap();
        assert_eq!(cluster_ca(&a).unwrap(), cluster_ca(&a).unwrap());
        assert_ne!(cluster_ca(&a).unwrap(), cluster_ca(&b).unwrap());
        // Leaves are fresh every time, the CA inside is the same.
        let t1 = ClusterTls::new(&a, "n").unwrap();
        let t2 = ClusterTls::new(&a, "n").unwrap();
        assert_ne!(t1.leaf, t2.leaf);
        assert_eq!(t1.ca, t2.ca);
        assert_eq!(t1.ca, cluster_ca(&a).unwrap());
        assert!(t1.client_config().is_ok());
        assert!(t1.server_config().is_ok());
    }
}
