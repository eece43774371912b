//! Scaling shared by several ebb replicas (Kubernetes: a StatefulSet of ebb in front of one
//! Deployment per workload). The protocol, as pure decisions over what a [`Coordinator`] shows:
//!
//! * **One downscaler.** Only the holder of the leadership lease scales down
//!   ([`decide_lease`], [`leads`]).
//! * **Shared last use.** Each replica keeps the Deployment's `last-used` annotation within
//!   `sync_ms` of its own traffic: a replica serving a route (a request arriving or in flight)
//!   whose annotation is older than that bumps it ([`decide_touch`]).
//! * **Compare-and-swap.** The leader reads the Deployment (replicas, annotation,
//!   `resourceVersion`), decides idleness with the single-machine rule [`super::decide_idle`],
//!   counting the annotation plus `sync_lag_ms` as a use, and scales down only if the object is
//!   still at the version it read ([`decide_downscale`]). A bump that lands between the read and
//!   the write changes the version, so the write fails and the leader decides again.
//! * **Retry.** A request that still meets a stopping replica is retried after a wake
//!   ([`super::retry_after_miss`], the proxy's rule), never dropped.
//! * **Others' changes.** Each replica records a change of replicas made by someone else (another
//!   ebb, an operator) as `ScaleRequested { reason: peer }` ([`decide_peer`]).
//!
//! What makes it exact: with `sync_lag_ms` at least `sync_ms` plus twice the clock skew between
//! replicas plus the time a bump takes to land (with its retries), a request seen more than
//! `sync_lag_ms` before a scale-down always counted. The simulator (`crates/sim/`) checks this
//! under API latency, errors, pauses and skew, and each half of the pair (the conditioned write,
//! the retry) has a mutation ([`crate::mutation`]) it must catch.
//!
//! [`Coordinator`] is async: the simulator's cluster answers at once; the Kubernetes backend
//! (`crates/kube/src/coordinator.rs`) implements it against the API server and inherits the
//! proof.

use crate::event::Event;
use crate::scaler::{Live, decide_idle};
use crate::state::State;

/// A deployment as the coordination store holds it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SharedDeployment {
    /// Replicas asked for (`spec.replicas`).
    pub replicas: u32,
    /// The `last-used` annotation: the newest use any replica published (in that replica's
    /// clock, ms).
    pub last_used_ms: u64,
    /// Moves on every change (`metadata.resourceVersion`).
    pub version: u64,
}

/// The leadership lease.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lease {
    /// The replica holding it.
    pub holder: Option<String>,
    /// Held until (the holder's clock, ms).
    pub until_ms: u64,
    /// Moves on every change.
    pub version: u64,
}

/// Errors of a coordination store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoordError {
    /// The object moved past the version the write was conditioned on.
    #[error("the object changed since it was read")]
    Conflict,
    /// No such object.
    #[error("no deployment named {0:?}")]
    NotFound(String),
    /// The store did not answer (try again).
    #[error("coordination store unavailable: {0}")]
    Unavailable(String),
}

/// What the replicas share: Kubernetes (a Deployment's replicas and annotation, a Lease), or the
/// simulator's model of it. Every method is one atomic request to the store (the simulator's
/// answers at once; its driver adds latency and errors around them).
pub trait Coordinator {
    /// Reads a deployment.
    fn deployment(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<SharedDeployment, CoordError>> + Send;
    /// Sets a deployment's replicas; with `if_version`, only if it is still at that version.
    /// Returns the new version.
    fn scale(
        &self,
        name: &str,
        replicas: u32,
        if_version: Option<u64>,
    ) -> impl Future<Output = Result<u64, CoordError>> + Send;
    /// Raises the `last-used` annotation to `last_used_ms`; never lowers it (against the API
    /// server: read, then write conditioned on the version read, until it holds). Returns the
    /// version.
    fn touch(
        &self,
        name: &str,
        last_used_ms: u64,
    ) -> impl Future<Output = Result<u64, CoordError>> + Send;
    /// Reads the lease.
    fn lease(&self) -> impl Future<Output = Result<Lease, CoordError>> + Send;
    /// Takes or renews the lease if it is still at `if_version`. Returns the new version.
    fn take_lease(
        &self,
        holder: &str,
        until_ms: u64,
        if_version: u64,
    ) -> impl Future<Output = Result<u64, CoordError>> + Send;
}

/// The protocol's timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedOptions {
    /// A replica keeps the annotation within this much of its own last use.
    pub sync_ms: u64,
    /// What the leader adds to the annotation: `sync_ms`, twice the clock skew, and the time a
    /// bump takes to land.
    pub sync_lag_ms: u64,
    /// How long a lease lasts.
    pub lease_ms: u64,
    /// The most two replicas' clocks differ by.
    pub max_skew_ms: u64,
}

/// Whether `me` leads at `now_ms`: it holds the lease and the lease has not run out, by its own
/// clock less the skew (so two replicas never both believe they lead).
pub fn leads(lease: &Lease, me: &str, now_ms: u64, o: &SharedOptions) -> bool {
    lease.holder.as_deref() == Some(me) && now_ms.saturating_add(o.max_skew_ms) < lease.until_ms
}

/// The lease `me` should write, if any: renew its own when a third of it is gone; take one that
/// ran out (by this clock plus the skew) or that nobody holds. Returns the new `until_ms`.
pub fn decide_lease(lease: &Lease, me: &str, now_ms: u64, o: &SharedOptions) -> Option<u64> {
    let until = now_ms.saturating_add(o.lease_ms);
    match lease.holder.as_deref() {
        Some(h) if h == me => {
            (lease.until_ms.saturating_sub(now_ms) < o.lease_ms * 2 / 3).then_some(until)
        }
        Some(_) if now_ms < lease.until_ms.saturating_add(o.max_skew_ms) => None,
        _ => Some(until),
    }
}

/// The `last-used` value a replica should publish, if any: its own last use (now, while a request
/// is in flight) when the annotation it knows is `sync_ms` or more older.
pub fn decide_touch(
    known_ms: u64,
    last_use_ms: u64,
    in_flight: u64,
    now_ms: u64,
    o: &SharedOptions,
) -> Option<u64> {
    let used = if in_flight > 0 { now_ms } else { last_use_ms };
    (used > known_ms && used.saturating_sub(known_ms) >= o.sync_ms).then_some(used)
}

/// The leader's decision for one deployment it read as `shared`: the scale-down event (the
/// single-machine idle rule, with the annotation plus `sync_lag_ms` counted as a use) and the
/// version the write must be conditioned on (`None` only in the simulator's broken variant).
pub fn decide_downscale(
    state: &State,
    deployment: &str,
    shared: &SharedDeployment,
    live: Live,
    now_ms: u64,
    o: &SharedOptions,
) -> Option<(Event, Option<u64>)> {
    if shared.replicas == 0 {
        return None;
    }
    let live = Live {
        in_flight: live.in_flight,
        last_at_ms: live
            .last_at_ms
            .max(shared.last_used_ms.saturating_add(o.sync_lag_ms)),
    };
    let event = decide_idle(state, deployment, live, now_ms)?;
    let cas = !crate::mutation::active(crate::mutation::Mutation::DownscaleWithoutCas);
    Some((event, cas.then_some(shared.version)))
}

/// What a replica records when the shared deployment's replicas differ from what its log says
/// (another replica woke it or scaled it down).
pub fn decide_peer(state: &State, deployment: &str, shared: &SharedDeployment) -> Option<Event> {
    let desired = state
        .routes
        .deployments
        .get(deployment)
        .map_or(0, |d| d.desired);
    (desired != shared.replicas).then(|| Event::ScaleRequested {
        deployment: deployment.to_owned(),
        from: desired,
        to: shared.replicas,
        reason: crate::event::ScaleReason::Peer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const O: SharedOptions = SharedOptions {
        sync_ms: 500,
        sync_lag_ms: 1_000,
        lease_ms: 3_000,
        max_skew_ms: 50,
    };

    #[test]
    fn the_lease_is_renewed_by_its_holder_and_taken_only_once_it_ran_out() {
        let held = Lease {
            holder: Some("a".into()),
            until_ms: 10_000,
            version: 3,
        };
        assert_eq!(decide_lease(&held, "a", 7_500, &O), None);
        assert_eq!(decide_lease(&held, "a", 8_500, &O), Some(11_500));
        assert_eq!(decide_lease(&held, "b", 10_000, &O), None);
        assert_eq!(decide_lease(&held, "b", 10_050, &O), Some(13_050));
        assert_eq!(decide_lease(&Lease::default(), "b", 5, &O), Some(3_005));
        assert!(leads(&held, "a", 9_900, &O));
        assert!(!leads(&held, "a", 9_950, &O));
        assert!(!leads(&held, "b", 1, &O));
    }

    #[test]
    fn a_replica_bumps_the_annotation_only_when_it_is_a_sync_interval_behind() {
        assert_eq!(decide_touch(1_000, 1_400, 0, 1_400, &O), None);
        assert_eq!(decide_touch(1_000, 1_500, 0, 1_500, &O), Some(1_500));
        // In flight counts as using it now.
        assert_eq!(decide_touch(1_000, 1_100, 1, 2_000, &O), Some(2_000));
        assert_eq!(decide_touch(3_000, 1_100, 0, 9_000, &O), None);
    }
}
