//! The route store: which route a Host leads to, which routes a deployment serves, when each route
//! was last used, and how many replicas each deployment has as far as the log knows.
//!
//! It also keeps the keep-warm windows the log has opened (`WarmStarted`, until `WarmEnded`) and
//! computes each route's next keep-warm edge for the schedule ([`next_warm_edge`]). Whether a
//! window is open is [`warm_wanted`]: a pure function of the window and the time, which the
//! scaler reads too, so no decision depends on whether the log has recorded a window's start yet.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::event::{RouteSpec, WarmWindow};

/// A route and its traffic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    /// The route as last upserted.
    pub spec: RouteSpec,
    /// The newest request time seen for the route (from `RequestsSeen`).
    pub last_used_ms: u64,
    /// Requests counted over the route's life.
    pub requests_total: u64,
    /// The keep-warm windows open as the log recorded them, by their index in `spec.warm`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub warm: BTreeMap<u32, ActiveWarm>,
}

/// The occurrence of window `w` open at `now_ms` (none: the window is closed then), as the
/// route's projection records it when it opens.
pub fn warm_wanted(w: &WarmWindow, now_ms: u64) -> Option<ActiveWarm> {
    let start =
        crate::timing::window_covering(&w.schedule, w.timezone.as_deref(), w.for_ms, now_ms)?;
    Some(ActiveWarm {
        min: w.min,
        scheduled_at_ms: start,
        until_ms: start.saturating_add(w.for_ms),
    })
}

/// When route `r`'s keep-warm windows next need a decision, looked at from `at_ms`: `at_ms`
/// itself when what is recorded differs from what is open then, else the earliest end of an
/// open window or start of a closed one. `None`: the route has no window and none recorded.
pub fn next_warm_edge(r: &Route, at_ms: u64) -> Option<u64> {
    if r.warm
        .keys()
        .any(|&i| usize::try_from(i).map_or(true, |i| i >= r.spec.warm.len()))
    {
        return Some(at_ms);
    }
    let mut next: Option<u64> = None;
    for (i, w) in r.spec.warm.iter().enumerate() {
        let have = u32::try_from(i).ok().and_then(|i| r.warm.get(&i));
        let want = warm_wanted(w, at_ms);
        if want.as_ref() != have {
            return Some(at_ms);
        }
        // The next occurrence opens the window, or renews it when it is still open; an open
        // window's end closes it.
        let start = crate::timing::next_firing_in(&w.schedule, w.timezone.as_deref(), at_ms);
        let edge = match (have, start) {
            (Some(open), Some(s)) => Some(open.until_ms.min(s)),
            (Some(open), None) => Some(open.until_ms),
            (None, s) => s,
        };
        next = match (next, edge) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    next
}

/// An open keep-warm window (`WarmStarted`, until its `WarmEnded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveWarm {
    /// Replicas it keeps.
    pub min: u32,
    /// The schedule's occurrence it opened for.
    pub scheduled_at_ms: u64,
    /// When it closes, unless the next occurrence renews it.
    pub until_ms: u64,
}

/// What the log says about a deployment's replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deployment {
    /// Replicas asked for by the last `ScaleRequested`.
    pub desired: u32,
    /// When the last `ScaleRequested` was decided.
    #[serde(default)]
    pub desired_at_ms: u64,
    /// Why the last `ScaleRequested` asked for it.
    #[serde(default)]
    pub reason: Option<crate::event::ScaleReason>,
    /// Replicas reported by the last `ScaledUp` / `ScaledDown`.
    pub replicas: u32,
    /// When the replica count last changed.
    pub scaled_at_ms: u64,
    /// Failed scale requests over the deployment's life.
    pub failures: u64,
    /// How long its last start from zero took, from the scale request to the first ready replica
    /// (0: none seen yet): the wait a waiting page tells.
    #[serde(default)]
    pub cold_start_ms: u64,
}

/// Routes by name, with indexes by domain and by deployment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routes {
    /// Routes by name.
    pub by_name: BTreeMap<String, Route>,
    /// Domain (exact or `*.suffix`) to route name.
    pub by_domain: BTreeMap<String, String>,
    /// Deployment to the routes it serves.
    pub by_deployment: BTreeMap<String, BTreeSet<String>>,
    /// Replica facts by deployment.
    pub deployments: BTreeMap<String, Deployment>,
    /// Seq of the last event that created, replaced or removed a route (caches compare it).
    #[serde(default)]
    pub changed_at_seq: u64,
    /// What each Gateway API route attaches to, as last told (`GatewayRouteAttached`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gateway: BTreeMap<String, String>,
}

impl Routes {
    pub(crate) fn upsert(&mut self, spec: &RouteSpec) {
        let last_used_ms;
        let requests_total;
        let warm;
        if let Some(old) = self.by_name.get(&spec.name).cloned() {
            self.unindex(&old.spec);
            last_used_ms = old.last_used_ms;
            requests_total = old.requests_total;
            warm = old.warm;
        } else {
            last_used_ms = 0;
            requests_total = 0;
            warm = BTreeMap::new();
        }
        for d in &spec.domains {
            // A domain moves to the route that names it last; the admin API refuses conflicts
            // before they reach the log, so this only matters for hand-made logs.
            if let Some(prev) = self
                .by_domain
                .insert(d.to_ascii_lowercase(), spec.name.clone())
                && prev != spec.name
                && let Some(r) = self.by_name.get_mut(&prev)
            {
                r.spec.domains.retain(|x| !x.eq_ignore_ascii_case(d));
            }
        }
        self.by_deployment
            .entry(spec.deployment.clone())
            .or_default()
            .insert(spec.name.clone());
        self.by_name.insert(
            spec.name.clone(),
            Route {
                spec: spec.clone(),
                last_used_ms,
                requests_total,
                warm,
            },
        );
    }

    pub(crate) fn remove(&mut self, name: &str) -> Option<Route> {
        let old = self.by_name.remove(name)?;
        self.unindex(&old.spec);
        Some(old)
    }

    fn unindex(&mut self, spec: &RouteSpec) {
        for d in &spec.domains {
            let d = d.to_ascii_lowercase();
            if self.by_domain.get(&d) == Some(&spec.name) {
                self.by_domain.remove(&d);
            }
        }
        if let Some(set) = self.by_deployment.get_mut(&spec.deployment) {
            set.remove(&spec.name);
            if set.is_empty() {
                self.by_deployment.remove(&spec.deployment);
            }
        }
    }

    /// Records traffic; returns the route's new last-used time if the route exists.
    pub(crate) fn seen(&mut self, route: &str, count: u64, last_at_ms: u64) -> Option<u64> {
        let r = self.by_name.get_mut(route)?;
        r.requests_total = r.requests_total.saturating_add(count);
        r.last_used_ms = r.last_used_ms.max(last_at_ms);
        Some(r.last_used_ms)
    }

    /// The route a `Host` header leads to (see [`match_host`]).
    pub fn route_for_host(&self, host: &str) -> Option<&Route> {
        match_host(host, |d| self.by_domain.get(d)).and_then(|name| self.by_name.get(name))
    }

    /// Routes served by a deployment.
    pub fn routes_of(&self, deployment: &str) -> impl Iterator<Item = &Route> {
        self.by_deployment
            .get(deployment)
            .into_iter()
            .flatten()
            .filter_map(|n| self.by_name.get(n))
    }
}

pub use crate::ids::{host_without_port, match_host, valid_domain};

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, domains: &[&str]) -> RouteSpec {
        RouteSpec::for_test(name, domains)
    }

    #[test]
    fn host_matching_ignores_port_and_case_and_prefers_exact() {
        let mut r = Routes::default();
        r.upsert(&spec("exact", &["api.example.com"]));
        r.upsert(&spec("wild", &["*.example.com"]));
        r.upsert(&spec("deep", &["*.eu.example.com"]));
        let name = |h: &str| r.route_for_host(h).map(|x| x.spec.name.clone());
        assert_eq!(name("API.Example.com:8080").as_deref(), Some("exact"));
        assert_eq!(name("www.example.com").as_deref(), Some("wild"));
        assert_eq!(name("a.eu.example.com").as_deref(), Some("deep"));
        assert_eq!(name("example.com"), None);
        assert_eq!(name("other.org"), None);
    }

    #[test]
    fn upsert_replaces_domains_and_keeps_traffic() {
        let mut r = Routes::default();
        r.upsert(&spec("a", &["a.test"]));
        r.seen("a", 5, 100);
        r.upsert(&spec("a", &["b.test"]));
        assert!(r.route_for_host("a.test").is_none());
        let a = r.route_for_host("b.test").unwrap();
        assert_eq!((a.last_used_ms, a.requests_total), (100, 5));
        r.remove("a");
        assert!(r.by_domain.is_empty() && r.by_deployment.is_empty());
    }

    #[test]
    fn ports_are_stripped() {
        assert_eq!(host_without_port("a.b:80"), "a.b");
        assert_eq!(host_without_port("a.b"), "a.b");
        assert_eq!(host_without_port("[::1]:8080"), "[::1]");
    }
}
