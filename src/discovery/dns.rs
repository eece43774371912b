//! DNS discovery and the cache of resolved services.
//!
//! * [`Dns`] resolves `http`, `https`, `ws` and `wss` ids (`http://name:port`) to one instance per
//!   address of the name (A and AAAA records), with the time the answer stays valid (the records'
//!   TTL) — a headless Kubernetes Service resolves to its ready pods this way. The name server
//!   is the system's (`/etc/resolv.conf`) or one given (`--dns-server`).
//! * [`Cache`] shares each resolved service among everyone who asks for it, and refreshes it when
//!   its answer expires (the TTL, at least [`MIN_REFRESH`] and at most [`MAX_REFRESH`] apart); a
//!   failed refresh keeps the last answer and is tried again after a doubling back-off (at most
//!   [`MAX_REFRESH`]). Whoever picks instances reads [`Resolved::generation`] and rebuilds its
//!   picker when it moved: instances no longer listed get no new requests, and the requests
//!   under way on them finish (they hold the old picker): the old instances drain.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig, ResolverOpts};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::{Resolver, TokioResolver};
use tokio::sync::watch;

use super::id::ServiceId;

/// The shortest time between two refreshes of one service.
pub const MIN_REFRESH: Duration = Duration::from_secs(1);
/// The longest time between two refreshes of one service (and the longest back-off).
pub const MAX_REFRESH: Duration = Duration::from_secs(300);
/// Most services the cache keeps.
pub const MAX_SERVICES: usize = 10_000;

/// The schemes DNS discovery resolves, with their default ports.
pub const SCHEMES: [(&str, u16); 4] = [("http", 80), ("ws", 80), ("https", 443), ("wss", 443)];

/// A service's instances as last resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Counts the changes of `addrs` (0: not resolved yet).
    pub generation: u64,
    /// The instances.
    pub addrs: Vec<SocketAddr>,
    /// Why the last resolution failed, if it did.
    pub error: Option<String>,
}

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

    /// The instances of `id` and how long the answer holds.
    pub async fn resolve(&self, id: &ServiceId) -> Result<(Vec<SocketAddr>, Duration), String> {
        let Some(&(_, default_port)) = SCHEMES.iter().find(|(s, _)| *s == id.scheme()) else {
            return Err(format!("{id}: DNS resolves {}", schemes()));
        };
        let host = id.host().ok_or_else(|| format!("{id}: no host"))?;
        let port = id.port().unwrap_or(default_port);
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
            return Ok((vec![SocketAddr::new(ip, port)], MAX_REFRESH));
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

/// One cached service.
#[derive(Debug)]
pub struct Entry {
    id: ServiceId,
    rx: watch::Receiver<Resolved>,
}

impl Entry {
    /// Its instances now.
    pub fn get(&self) -> Resolved {
        self.rx.borrow().clone()
    }

    /// The generation now (cheap: no copy).
    pub fn generation(&self) -> u64 {
        self.rx.borrow().generation
    }

    /// Waits (at most `limit`) until it was resolved once.
    pub async fn first(&self, limit: Duration) -> Resolved {
        let mut rx = self.rx.clone();
        let _ = tokio::time::timeout(
            limit,
            rx.wait_for(|r| r.generation > 0 || r.error.is_some()),
        )
        .await;
        self.get()
    }

    /// Its id.
    pub fn id(&self) -> &ServiceId {
        &self.id
    }
}

/// Resolved services, shared and refreshed.
#[derive(Debug)]
pub struct Cache {
    dns: Dns,
    entries: Mutex<HashMap<ServiceId, Arc<Entry>>>,
}

impl Cache {
    /// A cache resolving through `dns`.
    pub fn new(dns: Dns) -> Cache {
        Cache {
            dns,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The service `id`, resolved and refreshed from now on by a task of the current runtime,
    /// shared with everyone who asked for it before.
    pub fn get(&self, id: &ServiceId) -> Result<Arc<Entry>, String> {
        let mut entries = self.entries.lock().expect("cache lock");
        if let Some(e) = entries.get(id) {
            return Ok(e.clone());
        }
        if entries.len() >= MAX_SERVICES {
            return Err(format!(
                "{id}: the cache holds {MAX_SERVICES} services already"
            ));
        }
        let (tx, rx) = watch::channel(Resolved::default());
        let entry = Arc::new(Entry { id: id.clone(), rx });
        entries.insert(id.clone(), entry.clone());
        let (dns, id) = (self.dns.clone(), id.clone());
        tokio::spawn(refresh(dns, id, tx));
        Ok(entry)
    }
}

/// Resolves `id` again whenever its answer expires, until nobody holds its entry.
async fn refresh(dns: Dns, id: ServiceId, tx: watch::Sender<Resolved>) {
    let mut backoff = MIN_REFRESH;
    loop {
        let wait = match dns.resolve(&id).await {
            Ok((addrs, ttl)) => {
                backoff = MIN_REFRESH;
                tx.send_if_modified(|r| {
                    let changed = r.addrs != addrs || r.generation == 0;
                    if changed {
                        if r.generation > 0 {
                            tracing::info!(service = %id, from = ?r.addrs, to = ?addrs, "instances changed");
                        }
                        r.generation += 1;
                        r.addrs = addrs;
                    }
                    let had_error = r.error.take().is_some();
                    changed || had_error
                });
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
