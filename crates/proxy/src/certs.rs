//! Certificates from PEM: what ebb's own TLS (its files, read again when they change) and the
//! Gateway API's listeners (their Secrets) both present.

use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::sign::CertifiedKey;

/// The crypto provider of every TLS config ebb makes.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate chain and its private key (PKCS#8, PKCS#1 or SEC1) from PEM, or why not.
pub fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the certificate: {e}"))?;
    if chain.is_empty() {
        return Err("no certificate in the certificate's PEM".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("the key: {e}"))?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|e| e.to_string())
}
