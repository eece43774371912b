//! The Gateway API's data plane: the sockets `ebb_core::gateway::compile` gives, served.
//!
//! [`run`] keeps one listener per socket (an address and port of a Gateway's listeners): it
//! binds the new ones, closes those gone, and swaps in what each serves ([`Served`]) whole, so a
//! request sees one version of the routes. A socket that cannot be bound is reported back
//! (`unbindable`), for its listeners' status to say `PortUnavailable`, and tried again every
//! [`RETRY_BIND`] until it is had.
//!
//! Each socket is served on every proxy thread (a listener each, `SO_REUSEPORT`), as the proxy's
//! own port. A request's Host picks the socket's hostname (exact, then the longest `*.suffix`,
//! then `*`), whose routes are a meta service in the Gateway API's order of precedence: the first
//! matching route's redirect, rewrite, header changes and weighted backends; a backend ebb scales
//! is woken from zero and held like any of its requests. On a plain socket an HTTP/1.1 request
//! whose route only forwards takes the fast path (`h1.rs`); the rest, and every request over TLS
//! (HTTP/1.x, and h2 by ALPN), take the general path (`Proxy::handle_service` on hyper). Over TLS
//! the certificate is picked by the client's SNI the same way.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_rustls::rustls;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;

use super::Proxy;
use super::services::ServiceEntry;
use ebb_core::gateway::compile::{Certificate, Socket as SocketSpec};

/// How often a socket that could not be bound is tried again.
pub const RETRY_BIND: Duration = Duration::from_secs(1);

/// The request extension naming the Gateway socket a request came in on, and the server name
/// its TLS client asked for.
#[derive(Debug, Clone)]
pub struct Socket {
    pub addr: SocketAddr,
    pub sni: Option<Arc<str>>,
}

/// What one socket serves.
pub struct SocketEntry {
    /// By hostname (`*` for a listener without one).
    hosts: crate::ids::Domains<Arc<ServiceEntry>>,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Its listeners' hostnames (`*` for none).
    listeners: Vec<String>,
}

impl SocketEntry {
    /// The routes a Host leads to on this socket.
    pub fn lookup(&self, host: &str) -> Option<Arc<ServiceEntry>> {
        self.hosts
            .get(host)
            .or_else(|| self.hosts.get("*"))
            .cloned()
    }

    /// Whether a request for `host` (lower case, no port) over a TLS connection that asked for
    /// `sni` belongs to another listener than the one the connection was made for: the Gateway
    /// API answers it 421.
    pub fn misdirected(&self, sni: &str, host: &str) -> bool {
        use ebb_core::gateway::compile::listener_for;
        self.tls.is_some()
            && listener_for(&self.listeners, &sni.to_ascii_lowercase())
                != listener_for(&self.listeners, host)
    }
}

/// Every socket's routes, as of one compile.
#[derive(Default)]
pub struct Served {
    sockets: HashMap<SocketAddr, Arc<SocketEntry>>,
}

impl Served {
    /// What `addr` serves.
    pub fn socket(&self, addr: SocketAddr) -> Option<Arc<SocketEntry>> {
        self.sockets.get(&addr).cloned()
    }
}

/// A certificate for one listener hostname.
#[derive(Debug)]
struct Cert {
    hostname: Option<String>,
    key: Arc<CertifiedKey>,
}

/// Picks a socket's certificate by SNI: the listener hostname that matches it most closely,
/// else the listener without one, else the first.
#[derive(Debug)]
struct BySni(Vec<Cert>);

impl ResolvesServerCert for BySni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let by_name = hello.server_name().and_then(|sni| {
            crate::ids::match_host(sni, |d| {
                self.0
                    .iter()
                    .find(|c| {
                        c.hostname
                            .as_deref()
                            .is_some_and(|h| h.eq_ignore_ascii_case(d))
                    })
                    .map(|c| c.key.clone())
            })
        });
        by_name
            .or_else(|| {
                self.0
                    .iter()
                    .find(|c| c.hostname.is_none())
                    .map(|c| c.key.clone())
            })
            .or_else(|| self.0.first().map(|c| c.key.clone()))
    }
}

fn tls_config(certs: &[Certificate]) -> Option<Arc<rustls::ServerConfig>> {
    let keys: Vec<Cert> = certs
        .iter()
        .filter_map(
            |c| match crate::certs::certified_key(&c.secret.cert_pem, &c.secret.key_pem) {
                Ok(k) => Some(Cert {
                    hostname: c.hostname.clone(),
                    key: Arc::new(k),
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "a listener's certificate is unusable");
                    None
                }
            },
        )
        .collect();
    let mut cfg = rustls::ServerConfig::builder_with_provider(crate::certs::provider())
        .with_safe_default_protocol_versions()
        .ok()?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(BySni(keys)));
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Some(Arc::new(cfg))
}

impl Proxy {
    /// What the Gateway socket `addr` serves now.
    pub fn gateway_socket(&self, addr: SocketAddr) -> Option<Arc<SocketEntry>> {
        self.gateway
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .socket(addr)
    }

    fn serve_gateway(&self, sockets: &[SocketSpec]) {
        let mut served = Served::default();
        for s in sockets {
            let mut hosts = crate::ids::Domains::default();
            for (h, meta) in &s.hosts {
                let entry =
                    ServiceEntry::new(meta, &self.backends, self.options.discovery.as_deref());
                hosts.insert(h, Arc::new(entry));
            }
            let tls = s.tls.as_deref().and_then(tls_config);
            served.sockets.insert(
                s.addr,
                Arc::new(SocketEntry {
                    hosts,
                    tls,
                    listeners: s.listeners.clone(),
                }),
            );
        }
        *self.gateway.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(served);
    }
}

/// Serves the Gateway sockets `config` gives until `stop`, reporting those it cannot bind on
/// `unbindable`.
pub async fn run(
    proxy: Arc<Proxy>,
    mut config: watch::Receiver<Arc<Vec<SocketSpec>>>,
    unbindable: watch::Sender<BTreeSet<SocketAddr>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut listening: BTreeMap<SocketAddr, Vec<tokio::task::JoinHandle<()>>> = BTreeMap::new();
    loop {
        let sockets = config.borrow_and_update().clone();
        proxy.serve_gateway(&sockets);
        let wanted: BTreeSet<SocketAddr> = sockets.iter().map(|s| s.addr).collect();
        listening.retain(|addr, tasks| {
            let keep = wanted.contains(addr);
            if !keep {
                tasks.iter().for_each(|t| t.abort());
                tracing::info!(%addr, "gateway socket closed");
            }
            keep
        });
        let mut refused = BTreeSet::new();
        for addr in &wanted {
            if listening.contains_key(addr) {
                continue;
            }
            match proxy.listeners_for_workers(*addr) {
                Ok(listeners) => {
                    tracing::info!(%addr, "gateway socket open");
                    let tasks = proxy.accept_on_workers(listeners, "gateway socket", |l| {
                        accept(proxy.clone(), l, *addr)
                    });
                    listening.insert(*addr, tasks);
                }
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "gateway socket cannot be opened");
                    refused.insert(*addr);
                }
            }
        }
        unbindable.send_if_modified(|u| {
            if *u == refused {
                false
            } else {
                *u = refused;
                true
            }
        });
        // A socket the kernel refused is tried again every RETRY_BIND until it is had.
        let retry = !unbindable.borrow().is_empty();
        tokio::select! {
            r = config.changed() => if r.is_err() { break },
            _ = tokio::time::sleep(RETRY_BIND), if retry => {}
            _ = stop.changed() => break,
        }
    }
    for (_, tasks) in listening {
        tasks.iter().for_each(|t| t.abort());
    }
}

async fn accept(proxy: Arc<Proxy>, listener: tokio::net::TcpListener, addr: SocketAddr) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, %addr, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Some(slot) = proxy.connection_slot() else {
            continue;
        };
        let Some(entry) = proxy.gateway_socket(addr) else {
            continue;
        };
        let proxy = proxy.clone();
        let limit = Duration::from_millis(proxy.options.limits.header_read_timeout_ms);
        tokio::spawn(async move {
            match &entry.tls {
                None => super::h1::serve_connection(proxy, stream, peer, Some(addr)).await,
                Some(cfg) => {
                    let acceptor = tokio_rustls::TlsAcceptor::from(cfg.clone());
                    match tokio::time::timeout(limit, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let sni = tls.get_ref().1.server_name().map(Arc::from);
                            let socket = Socket { addr, sni };
                            proxy.serve_hyper(tls, peer, true, Some(socket)).await
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
            drop(slot);
        });
    }
}
