//! The proxy's routing table: a snapshot of the route store shaped for the hot path (domain ->
//! route, with the route's traffic counters and its ready replicas cached). It is rebuilt when the
//! route store has changed (compared by the seq of its last change, so a route created through the
//! admin API is routable as soon as its creation is acknowledged), and a route's ready list is
//! refreshed when the orchestrator reports a change. Each proxy thread keeps the table it last
//! used while the log's applied seq stands still, so finding a route takes no lock and no
//! allocation (the ready list is one read lock).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use super::backends::{Backends, Group, Ready, ReadyCache};
use super::traffic::{RouteTraffic, Traffic};
use crate::event::RouteSpec;
use crate::ids::Domains;
use crate::state::State;

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
    ready: ReadyCache,
}

impl Entry {
    /// Route `spec`'s entry, with its traffic counters and replica group.
    pub fn new(spec: RouteSpec, traffic: &Traffic, backends: &Backends) -> Arc<Entry> {
        Arc::new(Entry {
            traffic: traffic.route(&spec.name),
            group: backends.group(&spec.deployment),
            // u64::MAX never matches an orchestrator version: read on first use.
            ready: ReadyCache::new(u64::MAX, backends.ready(&spec.policy, &[], 0)),
            spec,
        })
    }

    /// The cached ready list if it was read at `version`.
    pub fn ready_at(&self, version: u64) -> Option<Arc<Ready>> {
        self.ready.at(version)
    }

    /// Caches the ready list read at `version`.
    pub fn set_ready(&self, version: u64, ready: &[SocketAddr], backends: &Backends) -> Arc<Ready> {
        let max = self.spec.max_connecting();
        self.ready
            .set(version, ready, &self.spec.policy, max, backends)
    }
}

/// Domains to routes, as of the route store's last change at `seq`.
#[derive(Debug, Default)]
pub struct Table {
    /// `routes.changed_at_seq` of the state it was built from.
    pub seq: u64,
    domains: Domains<Arc<Entry>>,
    by_name: HashMap<String, Arc<Entry>>,
}

impl Table {
    /// Builds the table from the route store.
    pub fn build(state: &State, traffic: &Traffic, backends: &Backends) -> Table {
        let mut domains = Domains::default();
        let mut by_name = HashMap::new();
        for r in state.routes.by_name.values() {
            let entry = Entry::new(r.spec.clone(), traffic, backends);
            for d in &r.spec.domains {
                domains.insert(d, entry.clone());
            }
            by_name.insert(r.spec.name.clone(), entry);
        }
        Table {
            seq: state.routes.changed_at_seq,
            domains,
            by_name,
        }
    }

    /// The route of that name.
    pub fn named(&self, name: &str) -> Option<Arc<Entry>> {
        self.by_name.get(name).cloned()
    }

    /// The route a Host leads to.
    pub fn lookup(&self, host: &str) -> Option<Arc<Entry>> {
        self.domains.get(host).cloned()
    }
}
