//! Meta services behind the proxy: the Hosts of `[[service]]` entries in `ebb.toml` lead to
//! [`MetaService`]s instead of workload routes. Their requests take the general path: the
//! service's first matching route rewrites the request, a destination is drawn by weight, and the
//! destination's policy picks one of its instances (fixed addresses, or the ready replicas of an
//! ebb workload, `ebb://app`). Instances share the proxy's replicas ([`Backends`]): their
//! connection pacing and what load balancing learns of them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use super::backends::{Backends, Group, Ready};
use crate::discovery::meta::{MetaService, Source, fixed_addr};
use crate::discovery::{self};
use crate::discovery::{Cache, Watched};

/// One destination's instances, with the version of what they were read from.
#[derive(Debug)]
pub struct Destination {
    ready: RwLock<(u64, Arc<Ready>)>,
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
}

/// Every meta service by domain.
#[derive(Debug, Default)]
pub struct Services {
    by_domain: HashMap<String, Arc<ServiceEntry>>,
}

impl Services {
    /// The services, each under its domains (checked at load not to overlap); destinations that
    /// discovery resolves are watched through `cache` from now on.
    pub fn build(metas: &[MetaService], backends: &Backends, cache: Option<&Cache>) -> Services {
        let mut by_domain = HashMap::new();
        for m in metas {
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
            let entry = Arc::new(ServiceEntry {
                meta: m.clone(),
                dests,
                group: backends.group(&m.id.to_string()),
            });
            for d in &m.domains {
                by_domain.insert(d.clone(), entry.clone());
            }
        }
        Services { by_domain }
    }

    /// The service a Host leads to.
    pub fn lookup(&self, host: &str) -> Option<Arc<ServiceEntry>> {
        if self.by_domain.is_empty() {
            return None;
        }
        crate::state::routes::match_host(host, |d| self.by_domain.get(d).cloned())
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
    let fixed: Option<Vec<SocketAddr>> = match &d.source {
        Source::Addresses(a) => Some(a.clone()),
        Source::Service(id) => fixed_addr(id).map(|a| vec![a]),
    };
    let watched = match (&d.source, &fixed, cache) {
        (Source::Service(id), None, Some(c)) if id.scheme() != "ebb" => match c.get(id) {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!(error = %e, "destination not resolved");
                None
            }
        },
        _ => None,
    };
    let replicas = fixed
        .iter()
        .flatten()
        .map(|a| backends.replica(*a, 4, d.policy.default_rtt_ms))
        .collect();
    let ready = discovery::with_rng(|rng| Ready::new(&d.policy, replicas, rng));
    // Fixed addresses never change: version 0 is always current.
    let version = if fixed.is_some() { 0 } else { u64::MAX };
    Destination {
        ready: RwLock::new((version, Arc::new(ready))),
        watched,
    }
}

impl ServiceEntry {
    /// Destination `d` of route `r`.
    pub fn destination(&self, r: usize, d: usize) -> &Destination {
        &self.dests[r][d]
    }

    /// The instances of destination `d` of route `r`: fixed; as DNS last resolved them; or, for
    /// `ebb://app`, what `resolve` reads given the orchestrator's `version` (called only when
    /// that version moved).
    pub fn ready(
        &self,
        r: usize,
        d: usize,
        version: u64,
        backends: &Backends,
        resolve: impl FnOnce(&discovery::ServiceId) -> Vec<SocketAddr>,
    ) -> Arc<Ready> {
        let dest = &self.dests[r][d];
        let spec = &self.meta.routes[r].destinations[d];
        let Source::Service(id) = &spec.source else {
            return dest.ready.read().expect("ready lock").1.clone();
        };
        let version = match (&dest.watched, id.scheme()) {
            (Some(e), _) => e.generation(),
            (None, "ebb") => version,
            // A fixed `http://IP:port`.
            (None, _) => 0,
        };
        {
            let g = dest.ready.read().expect("ready lock");
            if g.0 == version {
                return g.1.clone();
            }
        }
        let addrs = match &dest.watched {
            Some(e) => e.get().addrs,
            None => resolve(id),
        };
        let mut g = dest.ready.write().expect("ready lock");
        if g.1.items().iter().map(|r| r.addr).eq(addrs.iter().copied()) {
            g.0 = version;
            return g.1.clone();
        }
        let replicas = addrs
            .iter()
            .map(|a| backends.replica(*a, 4, spec.policy.default_rtt_ms))
            .collect();
        let ready = Arc::new(discovery::with_rng(|rng| {
            Ready::new(&spec.policy, replicas, rng)
        }));
        *g = (version, ready.clone());
        ready
    }
}
