//! Scaling decisions for routes: wake a workload at zero, record what the orchestrator reports,
//! and scale idle workloads down. Pure functions of `(state, inputs, now)` returning events; the
//! runtime in `proxy` runs them on the log's writer (so they are serialized) and performs the
//! scaling only after the events are durable.

pub mod member;
pub mod shared;

use crate::event::{Event, ScaleReason};
use crate::state::State;

/// Replicas a route's deployment runs when awake.
pub fn awake_replicas(min_replicas: u32) -> u32 {
    min_replicas.max(1)
}

/// A request found no ready replica. The first such request for a deployment not yet asked to
/// run decides the scale-up; every later one finds it decided (single flight).
pub fn decide_wake(state: &State, route: &str) -> Option<Event> {
    let r = state.routes.by_name.get(route)?;
    let d = state.routes.deployments.get(&r.spec.deployment);
    if d.is_some_and(|d| d.desired > 0) {
        return None;
    }
    Some(Event::ScaleRequested {
        deployment: r.spec.deployment.clone(),
        from: d.map_or(0, |d| d.replicas),
        to: awake_replicas(r.spec.min_replicas),
        reason: ScaleReason::Wake,
    })
}

/// What the orchestrator reported about a deployment since the last observation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Ready replicas now.
    pub ready: u32,
    /// Replicas that failed (crashed, or did not start) since the last report.
    pub new_failures: u64,
    /// The last failure's description.
    pub last_failure: Option<String>,
}

/// Records what the orchestrator reports: each new failure as `ScaleFailed`, then a change in the
/// number of ready replicas as `ScaledUp` / `ScaledDown`.
pub fn decide_observed(state: &State, deployment: &str, report: &Report) -> Vec<Event> {
    let d = state.routes.deployments.get(deployment);
    let known = d.map_or(0, |d| d.replicas);
    let mut events: Vec<Event> = (0..report.new_failures)
        .map(|_| Event::ScaleFailed {
            deployment: deployment.to_owned(),
            to: d.map_or(0, |d| d.desired),
            error: report
                .last_failure
                .clone()
                .unwrap_or_else(|| "replica failed".into()),
        })
        .collect();
    match report.ready.cmp(&known) {
        std::cmp::Ordering::Greater => events.push(Event::ScaledUp {
            deployment: deployment.to_owned(),
            replicas: report.ready,
        }),
        std::cmp::Ordering::Less => events.push(Event::ScaledDown {
            deployment: deployment.to_owned(),
            replicas: report.ready,
        }),
        std::cmp::Ordering::Equal => {}
    }
    events
}

/// After a restart no replica ebb ran before is running: say so, and ask for each deployment's
/// minimum (over its routes) again.
pub fn decide_restart(state: &State) -> Vec<Event> {
    let mut out = Vec::new();
    for (name, d) in &state.routes.deployments {
        let min = state
            .routes
            .routes_of(name)
            .map(|r| r.spec.min_replicas)
            .max()
            .unwrap_or(0);
        if d.replicas > 0 {
            out.push(Event::ScaledDown {
                deployment: name.clone(),
                replicas: 0,
            });
        }
        if d.desired != min {
            out.push(Event::ScaleRequested {
                deployment: name.clone(),
                from: d.desired,
                to: min,
                reason: ScaleReason::Restart,
            });
        }
    }
    out
}

/// At shutdown every deployment asked to run is asked to stop.
pub fn decide_shutdown(state: &State) -> Vec<Event> {
    state
        .routes
        .deployments
        .iter()
        .filter(|(_, d)| d.desired > 0)
        .map(|(name, d)| Event::ScaleRequested {
            deployment: name.clone(),
            from: d.desired,
            to: 0,
            reason: ScaleReason::Shutdown,
        })
        .collect()
}

/// What the proxy knows about a deployment's traffic that the log may not have yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Live {
    /// Requests in flight (including held ones) over all of the deployment's routes.
    pub in_flight: u64,
    /// The newest request time not yet flushed to the log.
    pub last_at_ms: u64,
}

/// A deployment asked to run more than its minimum is idle when none of its routes had a request
/// for its `idle_after_ms` (counting from the newest of the logged last use, the unflushed last
/// use, and the last scaling) and none is in flight. Then it is scaled down to its minimum.
pub fn decide_idle(state: &State, deployment: &str, live: Live, now_ms: u64) -> Option<Event> {
    let d = state.routes.deployments.get(deployment)?;
    let mut routes = state.routes.routes_of(deployment).peekable();
    routes.peek()?;
    if live.in_flight > 0 {
        return None;
    }
    let mut min_replicas = 0;
    for r in routes {
        let last = r
            .last_used_ms
            .max(live.last_at_ms)
            .max(d.scaled_at_ms)
            .max(d.desired_at_ms);
        if now_ms < last.saturating_add(r.spec.idle_after_ms) {
            return None;
        }
        min_replicas = min_replicas.max(r.spec.min_replicas);
    }
    (d.desired > min_replicas).then(|| Event::ScaleRequested {
        deployment: deployment.to_owned(),
        from: d.desired,
        to: min_replicas,
        reason: ScaleReason::Idle,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Envelope, RouteSpec, SCHEMA_VERSION};

    fn state(events: Vec<(u64, Event)>) -> State {
        let mut s = State::default();
        for (i, (at_ms, event)) in events.into_iter().enumerate() {
            s.apply(&Envelope {
                seq: i as u64 + 1,
                at_ms,
                version: SCHEMA_VERSION,
                event,
            });
        }
        s
    }

    fn route() -> Event {
        Event::RouteUpserted {
            route: RouteSpec {
                name: "r".into(),
                domains: vec!["r.test".into()],
                deployment: "d".into(),
                idle_after_ms: 1_000,
                min_replicas: 0,
                max_replicas: 1,
                hold_timeout_ms: 1_000,
                hold_queue_max: 10,
                process: None,
                concurrency: 0,
                max_connecting: 0,
                policy: Default::default(),
            },
        }
    }

    #[test]
    fn wake_is_decided_once() {
        let s = state(vec![(0, route())]);
        let wake = decide_wake(&s, "r").unwrap();
        assert!(matches!(
            wake,
            Event::ScaleRequested {
                to: 1,
                reason: ScaleReason::Wake,
                ..
            }
        ));
        let s = state(vec![(0, route()), (1, wake)]);
        assert_eq!(decide_wake(&s, "r"), None);
        assert_eq!(decide_wake(&s, "unknown"), None);
    }

    #[test]
    fn idle_counts_from_the_newest_use_and_never_with_requests_in_flight() {
        let woken = vec![
            (0, route()),
            (100, decide_wake(&state(vec![(0, route())]), "r").unwrap()),
            (
                200,
                Event::ScaledUp {
                    deployment: "d".into(),
                    replicas: 1,
                },
            ),
            (
                500,
                Event::RequestsSeen {
                    route: "r".into(),
                    count: 3,
                    last_at_ms: 450,
                },
            ),
        ];
        let s = state(woken);
        let quiet = Live::default();
        assert_eq!(decide_idle(&s, "d", quiet, 1_449), None);
        assert!(decide_idle(&s, "d", quiet, 1_450).is_some());
        let unflushed = Live {
            in_flight: 0,
            last_at_ms: 900,
        };
        assert_eq!(decide_idle(&s, "d", unflushed, 1_450), None);
        assert!(decide_idle(&s, "d", unflushed, 1_900).is_some());
        let busy = Live {
            in_flight: 1,
            last_at_ms: 0,
        };
        assert_eq!(decide_idle(&s, "d", busy, 100_000), None);
        let down = decide_idle(&s, "d", quiet, 5_000).unwrap();
        assert!(matches!(
            down,
            Event::ScaleRequested {
                from: 1,
                to: 0,
                reason: ScaleReason::Idle,
                ..
            }
        ));
    }

    #[test]
    fn observed_changes_become_scaled_events() {
        let ready = |n| Report {
            ready: n,
            ..Report::default()
        };
        let s = state(vec![(0, route())]);
        assert!(matches!(
            decide_observed(&s, "d", &ready(1))[..],
            [Event::ScaledUp { replicas: 1, .. }]
        ));
        assert!(decide_observed(&s, "d", &ready(0)).is_empty());
        let s = state(vec![
            (0, route()),
            (
                1,
                Event::ScaledUp {
                    deployment: "d".into(),
                    replicas: 2,
                },
            ),
        ]);
        let crashed = Report {
            ready: 1,
            new_failures: 1,
            last_failure: Some("exited (signal 9)".into()),
        };
        let events = decide_observed(&s, "d", &crashed);
        assert!(matches!(
            &events[..],
            [Event::ScaleFailed { error, .. }, Event::ScaledDown { replicas: 1, .. }]
                if error == "exited (signal 9)"
        ));
    }

    #[test]
    fn restart_and_shutdown_bring_deployments_back_to_their_minimum_and_to_zero() {
        let running = vec![
            (0, route()),
            (1, decide_wake(&state(vec![(0, route())]), "r").unwrap()),
            (
                2,
                Event::ScaledUp {
                    deployment: "d".into(),
                    replicas: 1,
                },
            ),
        ];
        let s = state(running.clone());
        let restart = decide_restart(&s);
        assert!(matches!(
            &restart[..],
            [
                Event::ScaledDown { replicas: 0, .. },
                Event::ScaleRequested {
                    from: 1,
                    to: 0,
                    reason: ScaleReason::Restart,
                    ..
                }
            ]
        ));
        let shutdown = decide_shutdown(&s);
        assert!(matches!(
            &shutdown[..],
            [Event::ScaleRequested {
                from: 1,
                to: 0,
                reason: ScaleReason::Shutdown,
                ..
            }]
        ));
        // A deployment at rest needs neither.
        let s = state(vec![(0, route())]);
        assert!(decide_restart(&s).is_empty() && decide_shutdown(&s).is_empty());
    }
}
