//! The proxy's routing table: a snapshot of the route store shaped for the hot path (domain ->
//! route, with the route's traffic counters and its ready replicas cached). It is rebuilt when the
//! route store has changed (compared by the seq of its last change, so a route created through the
//! admin API is routable as soon as its creation is acknowledged), and a route's ready list is
//! refreshed when the orchestrator reports a change. Each proxy thread keeps the table it last
//! used while the log's applied seq stands still, so finding a route takes no lock and no
//! allocation (the ready list is one read lock).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use super::backends::{Backends, Group, Ready};
use super::traffic::{RouteTraffic, Traffic};
use crate::event::RouteSpec;
use crate::state::State;
use crate::state::routes::match_host;

/// One route as the proxy sees it.
#[derive(Debug)]
pub struct Entry {
    /// The route.
    pub spec: RouteSpec,
    /// Its traffic counters.
    pub traffic: Arc<RouteTraffic>,
    /// Its deployment's replicas as a whole (slots freed on any of them).
    pub group: Arc<Group>,
    /// Ready replicas under the route's traffic policy, with the orchestrator version they were
    /// read at.
    ready: RwLock<(u64, Arc<Ready>)>,
}

impl Entry {
    /// The cached ready list if it was read at `version`.
    pub fn ready_at(&self, version: u64) -> Option<Arc<Ready>> {
        let g = self.ready.read().expect("ready lock");
        (g.0 == version).then(|| g.1.clone())
    }

    /// Caches the ready list read at `version` (the same replicas as before keep their picker,
    /// and with it a schedule's place).
    pub fn set_ready(&self, version: u64, ready: &[SocketAddr], backends: &Backends) -> Arc<Ready> {
        {
            let mut g = self.ready.write().expect("ready lock");
            if g.1.items().iter().map(|r| r.addr).eq(ready.iter().copied()) {
                g.0 = version;
                return g.1.clone();
            }
        }
        let max = self.spec.max_connecting();
        let rtt = self.spec.policy.default_rtt_ms;
        let replicas = ready
            .iter()
            .map(|a| backends.replica(*a, max, rtt))
            .collect();
        let ready = Arc::new(crate::discovery::with_rng(|rng| {
            Ready::new(&self.spec.policy, replicas, rng)
        }));
        *self.ready.write().expect("ready lock") = (version, ready.clone());
        ready
    }
}

/// Domains to routes, as of the route store's last change at `seq`.
#[derive(Debug, Default)]
pub struct Table {
    /// `routes.changed_at_seq` of the state it was built from.
    pub seq: u64,
    domains: HashMap<String, Arc<Entry>>,
}

impl Table {
    /// Builds the table from the route store.
    pub fn build(state: &State, traffic: &Traffic, backends: &Backends) -> Table {
        let mut domains = HashMap::new();
        for r in state.routes.by_name.values() {
            let entry = Arc::new(Entry {
                spec: r.spec.clone(),
                traffic: traffic.route(&r.spec.name),
                group: backends.group(&r.spec.deployment),
                // u64::MAX never matches an orchestrator version: read on first use.
                ready: RwLock::new((
                    u64::MAX,
                    Arc::new(crate::discovery::with_rng(|rng| {
                        Ready::new(&r.spec.policy, Vec::new(), rng)
                    })),
                )),
            });
            for d in &r.spec.domains {
                domains.insert(d.to_ascii_lowercase(), entry.clone());
            }
        }
        Table {
            seq: state.routes.changed_at_seq,
            domains,
        }
    }

    /// The route a Host leads to.
    pub fn lookup(&self, host: &str) -> Option<Arc<Entry>> {
        match_host(host, |d| self.domains.get(d).cloned())
    }
}
