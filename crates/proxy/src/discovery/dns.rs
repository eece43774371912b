//! DNS discovery and the cache of resolved services.
//!
//! Resolution goes through hickory-resolver with its own cache off (this module's refreshes on
//! the records' TTL, where the resolver's would hide changes), one refresh task per watched
//! service.
//!
//! * [`Dns`] resolves `http`, `https`, `ws` and `wss` ids (`http://name:port`) to one instance per
//!   address of the name (A and AAAA records), with the time the answer stays valid (the records'
//!   TTL) — a headless Kubernetes Service resolves to its ready pods this way. The name server
//!   is the system's (`/etc/resolv.conf`) or one given (`--dns-server`).
//! * Watched ([`Discovery::watch`]), a service is resolved again when its answer expires (the
//!   TTL, at least [`MIN_REFRESH`] and at most [`MAX_REFRESH`] apart); a failed refresh keeps
//!   the last answer and is tried again after a doubling back-off (at most [`MAX_REFRESH`]).

use std::net::SocketAddr;
use std::time::Duration;

use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig, ResolverOpts};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::{Resolver, TokioResolver};
use tokio::sync::watch;

use super::id::ServiceId;
use super::{Discovery, Resolved};

/// The shortest time between two refreshes of one service.
pub const MIN_REFRESH: Duration = Duration::from_secs(1);
/// The longest time between two refreshes of one service (and the longest back-off).
pub const MAX_REFRESH: Duration = Duration::from_secs(300);

pub use ebb_core::discovery::id::{SCHEMES, literal};

/// Resolves names through a DNS server.
#[derive(Clone)]
pub struct Dns {
    resolver: TokioResolver,
}

impl std::fmt::Debug for Dns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dns")
    }
}

impl Dns {
    /// A resolver asking `server` (UDP, then TCP), or the system's name servers.
    pub fn new(server: Option<SocketAddr>) -> Result<Dns, String> {
        let mut opts = ResolverOpts::default();
        // The cache here refreshes on TTL; the resolver's own cache would hide changes.
        opts.cache_size = 0;
        opts.attempts = 2;
        opts.timeout = Duration::from_secs(2);
        let builder = match server {
            Some(s) => {
                let group = NameServerConfigGroup::from_ips_clear(&[s.ip()], s.port(), true);
                Resolver::builder_with_config(
                    ResolverConfig::from_parts(None, vec![], group),
                    TokioConnectionProvider::default(),
                )
            }
            None => Resolver::builder(TokioConnectionProvider::default())
                .map_err(|e| format!("reading the system's DNS configuration: {e}"))?,
        };
        let resolver = builder.with_options(opts).build();
        Ok(Dns { resolver })
    }

    /// The system's resolver, or when its configuration cannot be read, one that resolves only
    /// literal addresses (`http://10.0.0.2:8081`), saying why.
    pub fn system_or_literal() -> Dns {
        Dns::new(None).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "DNS discovery resolves literal addresses only");
            let builder = Resolver::builder_with_config(
                ResolverConfig::from_parts(None, vec![], NameServerConfigGroup::new()),
                TokioConnectionProvider::default(),
            );
            Dns {
                resolver: builder.build(),
            }
        })
    }

    /// The instances of `id` and how long the answer holds.
    pub async fn resolve(&self, id: &ServiceId) -> Result<(Vec<SocketAddr>, Duration), String> {
        let Some(&(_, default_port)) = SCHEMES.iter().find(|(s, _)| *s == id.scheme()) else {
            return Err(format!("{id}: DNS resolves {}", schemes()));
        };
        let host = id.host().ok_or_else(|| format!("{id}: no host"))?;
        let port = id.port().unwrap_or(default_port);
        if let Some(addr) = literal(id) {
            return Ok((vec![addr], MAX_REFRESH));
        }
        // Fully qualified: no search domains appended.
        let name = if host.ends_with('.') {
            host.to_owned()
        } else {
            format!("{host}.")
        };
        let lookup = self
            .resolver
            .lookup_ip(name.as_str())
            .await
            .map_err(|e| format!("{id}: {e}"))?;
        // The answer holds as long as its shortest-lived record.
        let ttl = lookup
            .as_lookup()
            .records()
            .iter()
            .map(|r| r.ttl())
            .min()
            .map_or(MIN_REFRESH, |s| Duration::from_secs(s as u64));
        let mut addrs: Vec<SocketAddr> =
            lookup.iter().map(|ip| SocketAddr::new(ip, port)).collect();
        addrs.sort();
        addrs.dedup();
        Ok((addrs, ttl))
    }
}

fn schemes() -> String {
    SCHEMES.map(|(s, _)| s).join(", ")
}

impl Discovery for Dns {
    fn schemes(&self) -> Vec<&'static str> {
        SCHEMES.iter().map(|(s, _)| *s).collect()
    }

    fn watch(&self, id: &ServiceId) -> Result<watch::Receiver<Resolved>, String> {
        let (tx, rx) = watch::channel(Resolved::default());
        tokio::spawn(refresh(self.clone(), id.clone(), tx));
        Ok(rx)
    }
}

/// Resolves `id` again whenever its answer expires, until nobody holds its entry.
async fn refresh(dns: Dns, id: ServiceId, tx: watch::Sender<Resolved>) {
    let mut backoff = MIN_REFRESH;
    loop {
        let wait = match dns.resolve(&id).await {
            Ok((addrs, ttl)) => {
                backoff = MIN_REFRESH;
                super::publish(&tx, &id, addrs);
                ttl.clamp(MIN_REFRESH, MAX_REFRESH)
            }
            Err(e) => {
                tracing::warn!(service = %id, error = %e, retry_ms = backoff.as_millis() as u64, "resolving failed; the last instances stay");
                tx.send_modify(|r| r.error = Some(e));
                let wait = backoff;
                backoff = (backoff * 2).min(MAX_REFRESH);
                wait
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = tx.closed() => return,
        }
    }
}
