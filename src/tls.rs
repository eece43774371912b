//! TLS for the proxy and for ebb's own endpoints (rustls, the ring provider): a certificate
//! chain and a private key from PEM files, read again whenever either file changes, so a renewed
//! certificate (cert-manager's, say) takes effect on the next handshake without a restart. A pair
//! that does not load (a key that does not match, a file half-written) leaves the last good one
//! in place, and says so.
//!
//! [`Reloading`] is the certificate resolver: it holds the current `CertifiedKey` and, every
//! [`RELOAD_CHECK`], reads the PEM pair again when either file's modification time or length
//! changed. The proxy hands TLS connections straight to its general path (hyper; h2 or HTTP/1.1
//! by ALPN) and marks their requests as HTTPS for `X-Forwarded-Proto`; the admin address uses
//! [`TlsListener`], whose handshakes run as tasks of their own, bounded in number and time.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;

/// How often the files are looked at.
pub const RELOAD_CHECK: Duration = Duration::from_secs(2);

/// Handshakes under way at once on ebb's own endpoints' listener, at most.
const MAX_HANDSHAKES: usize = 256;

/// When each file last changed, and its length: a change to either means reading both again.
type Stamp = [(Option<SystemTime>, u64); 2];

fn stamp(cert: &Path, key: &Path) -> Stamp {
    let of = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| (m.modified().ok(), m.len()))
            .unwrap_or((None, 0))
    };
    [of(cert), of(key)]
}

/// Reads a certificate chain and its private key (PKCS#8, PKCS#1 or SEC1) from PEM files.
pub fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    ebb_proxy::certs::certified_key(&read(cert)?, &read(key)?)
        .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display()))
}

/// The certificate in use, read again when its files change.
#[derive(Debug)]
pub struct Reloading {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<(Stamp, Arc<CertifiedKey>)>,
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("certificate lock").1.clone())
    }
}

impl Reloading {
    /// Loads the pair now: an error here stops ebb from starting.
    pub fn new(cert: &Path, key: &Path) -> Result<Arc<Reloading>, String> {
        let at = stamp(cert, key);
        let loaded = load(cert, key)?;
        Ok(Arc::new(Reloading {
            cert: cert.to_owned(),
            key: key.to_owned(),
            current: RwLock::new((at, Arc::new(loaded))),
        }))
    }

    /// Reads the pair again if either file changed: `Ok(true)` when a new pair is in use.
    pub fn reload_if_changed(&self) -> Result<bool, String> {
        let at = stamp(&self.cert, &self.key);
        if self.current.read().expect("certificate lock").0 == at {
            return Ok(false);
        }
        let loaded = load(&self.cert, &self.key);
        let mut current = self.current.write().expect("certificate lock");
        // Tried once per change: a broken pair is not read again until a file changes again.
        current.0 = at;
        current.1 = Arc::new(loaded?);
        Ok(true)
    }

    /// A server configuration that offers `alpn` (e.g. h2 and http/1.1) and this certificate.
    pub fn acceptor(self: &Arc<Self>, alpn: &[&[u8]]) -> Result<TlsAcceptor, String> {
        let mut config = ServerConfig::builder_with_provider(ebb_proxy::certs::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// Looks at the files every [`RELOAD_CHECK`] until `stop` changes.
    pub async fn watch(
        self: Arc<Self>,
        what: &'static str,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(RELOAD_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let this = self.clone();
            match tokio::task::spawn_blocking(move || this.reload_if_changed()).await {
                Ok(Ok(true)) => {
                    tracing::info!(listener = what, cert = %self.cert.display(), "TLS certificate reloaded")
                }
                Ok(Ok(false)) | Err(_) => {}
                Ok(Err(e)) => {
                    tracing::warn!(listener = what, error = %e, "TLS certificate not reloaded; the last one stays in use")
                }
            }
        }
    }
}

/// A connection of ebb's own endpoints: TLS, checked head by head.
pub type TlsStream = crate::strict::Strict<tokio_rustls::server::TlsStream<TcpStream>>;

/// A listener of ebb's own endpoints that hands out connections once their TLS handshake is done
/// (each handshake a task of its own, bounded in time and in number, so that a slow client does
/// not hold the others up).
pub struct TlsListener {
    rx: tokio::sync::mpsc::Receiver<(TlsStream, std::net::SocketAddr)>,
    addr: std::net::SocketAddr,
}

impl TlsListener {
    /// Accepts on `listener`, handshaking with `acceptor` within `handshake_timeout`.
    pub fn new(
        listener: TcpListener,
        acceptor: TlsAcceptor,
        handshake_timeout: Duration,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::mpsc::channel(MAX_HANDSHAKES);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (stream, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let _ = stream.set_nodelay(true);
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let strict =
                                crate::strict::Strict::new(tls).first_within(handshake_timeout);
                            let _ = tx.send((strict, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { rx, addr })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accepting task ends only with the runtime.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
