//! Meta services behind the proxy: the Hosts of `[[service]]` entries in `ebb.toml` lead to
//! [`MetaService`]s instead of workload routes: the service's first matching route rewrites the
//! request, a destination is drawn by weight, and the destination's policy picks one of its
//! instances (fixed addresses, or the ready replicas of an ebb workload, `ebb://app`). An
//! HTTP/1.1 request whose rule only forwards ([`fast_path`]) takes the fast path (`h1.rs`, the
//! rule applied by its head writers); the rest (redirects, rule timeouts, h2c and gRPC backends,
//! HTTP/2 clients, upgrades) take the general path (`Proxy::handle_service`). Instances share the proxy's replicas ([`Backends`]): their
//! connection pacing and what load balancing learns of them.
//!
//! `Proxy::handle_service` matches the route, rewrites, draws the destination by weight and takes
//! a slot on the instance the destination's policy picks: fixed addresses (`http://IP:port`), or
//! an `ebb://app`'s ready replicas, read again when the orchestrator's change counter moves. A
//! request to an `ebb://app` destination is the app's: counted in its traffic (its idle timer,
//! the downscale's in-flight check) and, through `Proxy::endpoint_on` (the route's
//! hold-and-wake over the destination's replicas), held and woken from zero under the app's
//! concurrency and hold bounds.

use std::net::SocketAddr;
use std::sync::Arc;

use super::backends::{Backends, Group, Ready, ReadyCache};
use crate::discovery::meta::{MetaService, Source};
use crate::discovery::{Cache, Watched};
use crate::event::DEFAULT_MAX_CONNECTING;

/// One destination's instances, with the version of what they were read from.
#[derive(Debug)]
pub struct Destination {
    ready: ReadyCache,
    /// A destination resolved by discovery (DNS, Kubernetes): its shared, watched service.
    watched: Option<Arc<Watched>>,
}

impl Destination {
    /// Its watched service, if discovery resolves it.
    pub fn watched(&self) -> Option<&Arc<Watched>> {
        self.watched.as_ref()
    }
}

/// A meta service as the proxy serves it.
#[derive(Debug)]
pub struct ServiceEntry {
    /// The checked descriptor.
    pub meta: MetaService,
    /// `[route][destination]`.
    dests: Vec<Vec<Destination>>,
    /// Slots freed on its instances (nobody waits: its routes bound no requests per instance).
    pub group: Arc<Group>,
    /// Per route: whether the HTTP/1.1 fast path serves it ([`fast_path`]).
    fast: Vec<bool>,
    /// `[route][destination]`: what the fast path reads of a route spec for a request that goes
    /// there: the destination's policy; no bounds of its own (the proxy's apply, as on the
    /// general path).
    specs: Vec<Vec<crate::event::RouteSpec>>,
    /// The traffic of requests to fixed instances, which no workload counts (read by nobody).
    pub traffic: Arc<super::RouteTraffic>,
}

/// A destination of `route` drawn by weight (the rule has some).
pub fn draw(route: &crate::discovery::meta::MetaRoute) -> usize {
    crate::discovery::with_rng(|rng| route.destination(crate::discovery::balance::unit(rng)))
}

/// Headers the fast path's head writers write themselves, so a rule that changes one is served
/// on the general path.
const WRITTEN: [&str; 7] = [
    "host",
    "content-length",
    "x-request-id",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "forwarded",
];

/// Whether the HTTP/1.1 fast path can serve a route: it forwards (no redirect, no failure), has
/// no timeouts of its own, sends to HTTP/1.1 instances (not h2c, no invalid backend) without
/// per-destination header changes, and changes only headers the head writers do not write
/// themselves (nor hop-by-hop ones), well formed.
pub fn fast_path(r: &crate::discovery::meta::MetaRoute) -> bool {
    let plain = |c: &crate::discovery::meta::Changes| {
        c.well_formed()
            && c.names().all(|n| {
                !WRITTEN.iter().any(|w| w.eq_ignore_ascii_case(n)) && !ebb_http::h1::hop_by_hop(n)
            })
    };
    r.redirect.is_none()
        && r.fail.is_none()
        && r.request_timeout_ms == 0
        && r.backend_timeout_ms == 0
        && plain(&r.request_headers)
        && plain(&r.response_headers)
        && r.destinations.iter().all(|d| {
            !d.h2c
                && d.request_headers == crate::discovery::meta::Changes::default()
                && !matches!(d.source, Source::Invalid(_))
        })
}

/// Every meta service by domain.
#[derive(Debug, Default)]
pub struct Services {
    by_domain: crate::ids::Domains<Arc<ServiceEntry>>,
}

impl Services {
    /// The services, each under its domains (checked at load not to overlap); destinations that
    /// discovery resolves are watched through `cache` from now on.
    pub fn build(metas: &[MetaService], backends: &Backends, cache: Option<&Cache>) -> Services {
        let mut by_domain = crate::ids::Domains::default();
        for m in metas {
            let entry = Arc::new(ServiceEntry::new(m, backends, cache));
            for d in &m.domains {
                by_domain.insert(d, entry.clone());
            }
        }
        Services { by_domain }
    }

    /// The service a Host leads to.
    pub fn lookup(&self, host: &str) -> Option<Arc<ServiceEntry>> {
        if self.by_domain.is_empty() {
            return None;
        }
        self.by_domain.get(host).cloned()
    }
}

/// A destination's starting state: fixed addresses (and `http://IP:port`) as they are, ids
/// discovery resolves (DNS names, `k8s://`, `k8s-env://`) watched through `cache`, `ebb://app`
/// read on first use.
fn destination(
    d: &crate::discovery::meta::Destination,
    backends: &Backends,
    cache: Option<&Cache>,
) -> Destination {
    let fixed = d.fixed();
    let watched = d
        .discovered()
        .zip(cache)
        .and_then(|(id, c)| match c.get(id) {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!(error = %e, "destination not resolved");
                None
            }
        });
    let ready = backends.ready(
        &d.policy,
        fixed.as_deref().unwrap_or_default(),
        DEFAULT_MAX_CONNECTING,
    );
    // Fixed addresses never change: version 0 is always current.
    let version = if fixed.is_some() { 0 } else { u64::MAX };
    Destination {
        ready: ReadyCache::new(version, ready),
        watched,
    }
}

impl ServiceEntry {
    /// Service `m` as the proxy serves it; destinations that discovery resolves are watched
    /// through `cache` from now on.
    pub fn new(m: &MetaService, backends: &Backends, cache: Option<&Cache>) -> ServiceEntry {
        let dests = m
            .routes
            .iter()
            .map(|r| {
                r.destinations
                    .iter()
                    .map(|d| destination(d, backends, cache))
                    .collect()
            })
            .collect();
        let specs = m
            .routes
            .iter()
            .map(|r| {
                r.destinations
                    .iter()
                    .map(|d| crate::event::RouteSpec {
                        name: m.id.to_string(),
                        policy: Box::new(d.policy.clone()),
                        ..Default::default()
                    })
                    .collect()
            })
            .collect();
        ServiceEntry {
            meta: m.clone(),
            dests,
            group: backends.group(&m.id.to_string()),
            fast: m.routes.iter().map(fast_path).collect(),
            specs,
            traffic: Arc::default(),
        }
    }

    /// Whether the fast path serves route `r` ([`fast_path`]).
    pub fn fast(&self, r: usize) -> bool {
        self.fast[r]
    }

    /// The route spec the fast path reads for destination `d` of route `r`.
    pub fn spec(&self, r: usize, d: usize) -> &crate::event::RouteSpec {
        &self.specs[r][d]
    }

    /// Destination `d` of route `r`.
    pub fn destination(&self, r: usize, d: usize) -> &Destination {
        &self.dests[r][d]
    }

    /// The instances of destination `d` of route `r`: fixed; as discovery last resolved them;
    /// or, for one of ebb's apps (`ebb://app`, a Gateway backend's route), what `resolve` reads
    /// of the app given the orchestrator's `version` (called only when that version moved).
    pub fn ready(
        &self,
        r: usize,
        d: usize,
        version: u64,
        backends: &Backends,
        resolve: impl FnOnce(&str) -> Vec<SocketAddr>,
    ) -> Arc<Ready> {
        let dest = &self.dests[r][d];
        let spec = &self.meta.routes[r].destinations[d];
        let fixed = || {
            dest.ready
                .at(0)
                .expect("fixed addresses are read at version 0")
        };
        let version = match (&spec.source, &dest.watched) {
            (_, Some(e)) => e.generation(),
            (Source::Service(id), None) if id.scheme() == "ebb" => version,
            (Source::Route(_), None) => version,
            // Fixed addresses, a fixed `http://IP:port`, an invalid backend.
            _ => return fixed(),
        };
        if let Some(ready) = dest.ready.at(version) {
            return ready;
        }
        let addrs = match (&dest.watched, spec.app()) {
            (Some(e), _) => e.get().addrs,
            (None, Some(app)) => resolve(app),
            (None, None) => Vec::new(),
        };
        dest.ready.set(
            version,
            &addrs,
            &spec.policy,
            DEFAULT_MAX_CONNECTING,
            backends,
        )
    }
}
