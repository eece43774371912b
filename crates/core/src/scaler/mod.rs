//! Scaling decisions for routes: wake a workload at zero, record what the orchestrator reports,
//! and scale idle workloads down. Pure functions of `(state, inputs, now)` returning events; the
//! runtime in `proxy` runs them on the log's writer (so they are serialized) and performs the
//! scaling only after the events are durable.
//!
//! * [`decide_wake`]: the first request for a deployment not asked to run decides the scale-up;
//!   every later one finds it decided (single flight).
//! * [`decide_idle`]: a deployment is idle when none of its routes had a request for its
//!   `idle_after_ms`, counting from the newest of the logged last use, the proxy's unflushed last
//!   use ([`Live`]) and the last scaling, and none is in flight; it is scaled down to its floor.
//! * [`decide_observed`]: the orchestrator's ready count becomes `ScaledUp` / `ScaledDown`, its
//!   failures `ScaleFailed`.
//! * [`decide_warm`]: the log made to agree with the keep-warm windows open now, and the floor
//!   asked for (`ScaleReason::Warm`). The floor ([`floor`]: idle replicas, or more while a window
//!   is open) is read from the windows and the time itself, never from what the log has recorded,
//!   so no replica scales below an open window because it has not logged the window's start yet.
//! * [`decide_restart`] and [`decide_shutdown`]: after a restart nothing ebb ran is running and
//!   each deployment's floor is asked for again; at shutdown every deployment is asked to stop.
//! * [`retry_after_miss`]: the retry rule of both proxy paths and of the simulator's proxy, for a
//!   request that met a stopping or gone replica.
//!
//! [`shared`] is the protocol for several ebb replicas in front of one deployment, and
//! [`member`] one replica's side of it as a sans-IO state machine.

pub mod load;
pub mod member;
pub mod shared;

use crate::event::{Event, RouteSpec, ScaleReason};
use crate::state::State;
pub use crate::state::routes::warm_wanted;

/// Replicas an idle deployment keeps for a route: its `idle_replicas`, else its `min_replicas`.
pub fn idle_floor(spec: &RouteSpec) -> u32 {
    spec.idle_floor()
}

/// Replicas a route's deployment runs when awake: at least one, its minimum and its idle floor.
pub fn awake_replicas(spec: &RouteSpec) -> u32 {
    spec.min_replicas.max(idle_floor(spec)).max(1)
}

/// Replicas the route's keep-warm windows open at `now_ms` ask for (0: none is open). Read from
/// the route's windows and the time alone, so a scale-down decided by any replica, whether or
/// not it has recorded the window's start yet, never goes below it.
pub fn warm_min(spec: &RouteSpec, now_ms: u64) -> u32 {
    spec.warm
        .iter()
        .filter(|w| warm_wanted(w, now_ms).is_some())
        .map(|w| w.min)
        .max()
        .unwrap_or(0)
}

/// The fewest replicas a route's deployment may run at `now_ms`, however idle.
pub fn floor(spec: &RouteSpec, now_ms: u64) -> u32 {
    idle_floor(spec).max(warm_min(spec, now_ms))
}

/// The fewest replicas a deployment may run at `now_ms`: the highest floor of its routes.
pub fn deployment_floor(state: &State, deployment: &str, now_ms: u64) -> u32 {
    state
        .routes
        .routes_of(deployment)
        .map(|r| floor(&r.spec, now_ms))
        .max()
        .unwrap_or(0)
}

/// A request found no ready replica. The first such request for a deployment not yet asked to
/// run decides the scale-up; every later one finds it decided (single flight).
pub fn decide_wake(state: &State, route: &str, now_ms: u64) -> Option<Event> {
    let r = state.routes.by_name.get(route)?;
    let d = state.routes.deployments.get(&r.spec.deployment);
    if d.is_some_and(|d| d.desired > 0) {
        return None;
    }
    Some(Event::ScaleRequested {
        deployment: r.spec.deployment.clone(),
        from: d.map_or(0, |d| d.replicas),
        to: awake_replicas(&r.spec).max(warm_min(&r.spec, now_ms)),
        reason: ScaleReason::Wake,
    })
}

/// The route whose load settings scale `deployment`: of its routes with a [`RouteSpec::load`],
/// the first by name (a deployment behind several routes is scaled on their summed load with
/// that one's settings).
pub fn load_route<'a>(state: &'a State, deployment: &str) -> Option<&'a RouteSpec> {
    state
        .routes
        .routes_of(deployment)
        .map(|r| &r.spec)
        .filter(|r| r.load.is_some())
        .min_by(|a, b| a.name.cmp(&b.name))
}

/// The bounds load scaling keeps an awake deployment within: at least one replica and the
/// deployment's floor now (its routes' idle replicas and open keep-warm windows), at most the
/// deciding route's `max_replicas`.
pub fn load_bounds(state: &State, route: &RouteSpec, now_ms: u64) -> (u32, u32) {
    let max = route.max_replicas.max(1);
    let min = deployment_floor(state, &route.deployment, now_ms)
        .max(route.min_replicas)
        .max(1)
        .min(max);
    (min, max)
}

/// A deployment's load asks for `desired` replicas (`why`: the figures it was decided on). It is
/// recorded as `ScaleRequested { reason: load }` only when the deployment is awake (going to zero
/// and coming back are idleness's and a wake's) and the count, kept within [`load_bounds`],
/// differs from the one asked for.
pub fn decide_load(
    state: &State,
    deployment: &str,
    desired: u32,
    why: crate::event::LoadWhy,
    now_ms: u64,
) -> Option<Event> {
    let d = state.routes.deployments.get(deployment)?;
    if d.desired == 0 {
        return None;
    }
    let route = load_route(state, deployment)?;
    let (min, max) = load_bounds(state, route, now_ms);
    let to = desired.clamp(min, max);
    (to != d.desired).then(|| Event::ScaleRequested {
        deployment: deployment.to_owned(),
        from: d.desired,
        to,
        reason: ScaleReason::Load(why),
    })
}

/// A route's keep-warm windows at `now_ms` (run when its `RouteWarm` deadline falls due): each
/// window open now and not recorded so (or recorded for an earlier occurrence, or with another
/// minimum) starts, each recorded window no longer open ends, and when the deployment is asked
/// for fewer replicas than its floor now, it is asked for the floor (`ScaleRequested` with reason
/// `warm`). A window's end scales nothing down: idleness does that, as ever (`decide_idle`: no
/// request for `idle_after_ms` and none in flight).
pub fn decide_warm(state: &State, route: &str, now_ms: u64) -> Vec<Event> {
    let Some(r) = state.routes.by_name.get(route) else {
        return Vec::new();
    };
    let mut events = Vec::new();
    for (i, w) in r.spec.warm.iter().enumerate() {
        let window = u32::try_from(i).unwrap_or(u32::MAX);
        let want = warm_wanted(w, now_ms);
        let have = r.warm.get(&window);
        match (want, have) {
            (Some(want), have) if have != Some(&want) => events.push(Event::WarmStarted {
                route: route.to_owned(),
                window,
                min: want.min,
                scheduled_at_ms: want.scheduled_at_ms,
                until_ms: want.until_ms,
            }),
            (None, Some(_)) => events.push(Event::WarmEnded {
                route: route.to_owned(),
                window,
            }),
            _ => {}
        }
    }
    for &window in r.warm.keys() {
        if usize::try_from(window).map_or(true, |i| i >= r.spec.warm.len()) {
            events.push(Event::WarmEnded {
                route: route.to_owned(),
                window,
            });
        }
    }
    if events
        .iter()
        .any(|e| matches!(e, Event::WarmStarted { .. }))
    {
        let deployment = &r.spec.deployment;
        let d = state.routes.deployments.get(deployment);
        let desired = d.map_or(0, |d| d.desired);
        let want = deployment_floor(state, deployment, now_ms);
        if desired < want {
            events.push(Event::ScaleRequested {
                deployment: deployment.clone(),
                from: desired,
                to: want,
                reason: ScaleReason::Warm,
            });
        }
    }
    events
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
/// floor (over its routes: idle replicas, and the keep-warm windows open now) again.
pub fn decide_restart(state: &State, now_ms: u64) -> Vec<Event> {
    let mut out = Vec::new();
    // Every deployment the log knows of, and those of routes never scaled yet (a new route with
    // a floor runs it from the start).
    let names: std::collections::BTreeSet<&String> = state
        .routes
        .deployments
        .keys()
        .chain(state.routes.by_deployment.keys())
        .collect();
    let none = crate::state::Deployment::default();
    for name in names {
        let d = state.routes.deployments.get(name).unwrap_or(&none);
        let min = deployment_floor(state, name, now_ms);
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

/// A deployment asked to run more than its floor is idle when none of its routes had a request
/// for its `idle_after_ms` (counting from the newest of the logged last use, the unflushed last
/// use, and the last scaling; while no replica is ready yet, at least its `hold_timeout_ms`) and
/// none is in flight. Then it is scaled down to its floor: the
/// routes' idle replicas, or more while a keep-warm window is open.
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
        // A deployment still starting (asked for, none ready yet) gets the route's hold timeout
        // to become ready before idleness may stop it: a request that woke it may have been
        // answered with a waiting page, whose reloads come later than `idle_after_ms` may allow.
        let bound = if d.replicas == 0 {
            r.spec.idle_after_ms.max(r.spec.hold_timeout_ms)
        } else {
            r.spec.idle_after_ms
        };
        if now_ms < last.saturating_add(bound) {
            return None;
        }
        let floor = if crate::mutation::active(crate::mutation::Mutation::IdleIgnoresWarm) {
            idle_floor(&r.spec)
        } else {
            floor(&r.spec, now_ms)
        };
        min_replicas = min_replicas.max(floor);
    }
    (d.desired > min_replicas).then(|| Event::ScaleRequested {
        deployment: deployment.to_owned(),
        from: d.desired,
        to: min_replicas,
        reason: ScaleReason::Idle,
    })
}

/// How a forwarded request met a replica that did not serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendMiss {
    /// The connection was refused: nothing of the request left ebb.
    Refused,
    /// The replica closed or reset the connection before a byte of answer; `replayable` when the
    /// request can be sent again safely (idempotent, and no body was sent).
    WentAway { replayable: bool },
}

/// The retry rule of both paths (and of the simulator's proxy): a request that met a stopping or
/// gone replica is tried once more, on another replica (waking the workload again if none is
/// ready), when it can be sent again safely. `retried`: this request was already tried again.
pub fn retry_after_miss(miss: BackendMiss, retried: bool) -> bool {
    if retried || crate::mutation::active(crate::mutation::Mutation::NoRetryOnStopping) {
        return false;
    }
    match miss {
        BackendMiss::Refused => true,
        BackendMiss::WentAway { replayable } => replayable,
    }
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
            route: Box::new(RouteSpec {
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
                ..Default::default()
            }),
        }
    }

    #[test]
    fn wake_is_decided_once() {
        let s = state(vec![(0, route())]);
        let wake = decide_wake(&s, "r", 0).unwrap();
        assert!(matches!(
            wake,
            Event::ScaleRequested {
                to: 1,
                reason: ScaleReason::Wake,
                ..
            }
        ));
        let s = state(vec![(0, route()), (1, wake)]);
        assert_eq!(decide_wake(&s, "r", 0), None);
        assert_eq!(decide_wake(&s, "unknown", 0), None);
    }

    #[test]
    fn idle_counts_from_the_newest_use_and_never_with_requests_in_flight() {
        let woken = vec![
            (0, route()),
            (
                100,
                decide_wake(&state(vec![(0, route())]), "r", 0).unwrap(),
            ),
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
            (1, decide_wake(&state(vec![(0, route())]), "r", 0).unwrap()),
            (
                2,
                Event::ScaledUp {
                    deployment: "d".into(),
                    replicas: 1,
                },
            ),
        ];
        let s = state(running.clone());
        let restart = decide_restart(&s, 0);
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
        assert!(decide_restart(&s, 0).is_empty() && decide_shutdown(&s).is_empty());
    }

    /// 2026-01-05T00:00:00Z, a Monday.
    const MONDAY: u64 = 1_767_571_200_000;
    const H: u64 = 3_600_000;

    fn warm_route(windows: Vec<crate::event::WarmWindow>, idle: Option<u32>) -> Event {
        let Event::RouteUpserted { route } = route() else {
            unreachable!()
        };
        Event::RouteUpserted {
            route: Box::new(RouteSpec {
                max_replicas: 3,
                warm: windows,
                idle_replicas: idle,
                ..*route
            }),
        }
    }

    fn window(schedule: &str, for_ms: u64, min: u32, tz: Option<&str>) -> crate::event::WarmWindow {
        crate::event::WarmWindow {
            schedule: schedule.into(),
            for_ms,
            min,
            timezone: tz.map(Into::into),
        }
    }

    #[test]
    fn a_window_opens_scales_up_holds_the_floor_and_closes_without_scaling_down() {
        // 08:00 to 18:00 Paris time (UTC+1 in January) on working days.
        let w = window("0 8 * * 1-5", 10 * H, 2, Some("Europe/Paris"));
        let mut events = vec![(MONDAY, warm_route(vec![w], None))];
        let s = state(events.clone());
        // Due at 07:00 UTC, the window's start.
        assert_eq!(
            s.schedule.get(&crate::state::Due::RouteWarm("r".into())),
            Some(MONDAY + 7 * H)
        );
        assert!(decide_warm(&s, "r", MONDAY + 7 * H - 1).is_empty());
        let opened = decide_warm(&s, "r", MONDAY + 7 * H);
        assert_eq!(
            opened,
            vec![
                Event::WarmStarted {
                    route: "r".into(),
                    window: 0,
                    min: 2,
                    scheduled_at_ms: MONDAY + 7 * H,
                    until_ms: MONDAY + 17 * H,
                },
                Event::ScaleRequested {
                    deployment: "d".into(),
                    from: 0,
                    to: 2,
                    reason: ScaleReason::Warm,
                },
            ]
        );
        events.extend(opened.into_iter().map(|e| (MONDAY + 7 * H, e)));
        events.push((
            MONDAY + 7 * H + 500,
            Event::ScaledUp {
                deployment: "d".into(),
                replicas: 2,
            },
        ));
        let s = state(events.clone());
        // Idle all day: no scale-down below the window, and no decision until it ends.
        assert_eq!(decide_idle(&s, "d", Live::default(), MONDAY + 12 * H), None);
        assert_eq!(
            s.schedule.get(&crate::state::Due::RouteWarm("r".into())),
            Some(MONDAY + 17 * H)
        );
        assert_eq!(deployment_floor(&s, "d", MONDAY + 17 * H - 1), 2);
        let closed = decide_warm(&s, "r", MONDAY + 17 * H);
        assert_eq!(
            closed,
            vec![Event::WarmEnded {
                route: "r".into(),
                window: 0
            }]
        );
        // Its end scales nothing down by itself; idleness does, unless a request is in flight.
        events.extend(closed.into_iter().map(|e| (MONDAY + 17 * H, e)));
        let s = state(events);
        let busy = Live {
            in_flight: 1,
            last_at_ms: 0,
        };
        assert_eq!(decide_idle(&s, "d", busy, MONDAY + 17 * H), None);
        assert!(matches!(
            decide_idle(&s, "d", Live::default(), MONDAY + 17 * H),
            Some(Event::ScaleRequested {
                to: 0,
                reason: ScaleReason::Idle,
                ..
            })
        ));
        // The next working day's window is next.
        assert_eq!(
            s.schedule.get(&crate::state::Due::RouteWarm("r".into())),
            Some(MONDAY + 24 * H + 7 * H)
        );
    }

    #[test]
    fn windows_open_at_a_restart_apply_at_once_and_a_long_one_is_renewed() {
        // Every 20 minutes for half an hour: always open, renewed by each occurrence.
        let w = window("*/20 * * * *", H / 2, 1, None);
        let at = MONDAY + 5 * 60_000;
        let s = state(vec![(at, warm_route(vec![w], Some(0)))]);
        // ebb starting now runs the window's replica at once.
        assert_eq!(
            decide_restart(&s, at),
            vec![Event::ScaleRequested {
                deployment: "d".into(),
                from: 0,
                to: 1,
                reason: ScaleReason::Restart,
            }]
        );
        assert_eq!(
            s.schedule.get(&crate::state::Due::RouteWarm("r".into())),
            Some(at),
            "open now: due at once"
        );
        let opened = decide_warm(&s, "r", at);
        assert!(matches!(
            opened[0],
            Event::WarmStarted { scheduled_at_ms, until_ms, .. }
                if scheduled_at_ms == MONDAY && until_ms == MONDAY + H / 2
        ));
        let mut events = vec![(
            at,
            warm_route(vec![window("*/20 * * * *", H / 2, 1, None)], Some(0)),
        )];
        events.extend(opened.into_iter().map(|e| (at, e)));
        let s = state(events.clone());
        // Due at the next occurrence, which renews it before it ends.
        let next = MONDAY + 20 * 60_000;
        assert_eq!(
            s.schedule.get(&crate::state::Due::RouteWarm("r".into())),
            Some(next)
        );
        let renewed = decide_warm(&s, "r", next);
        assert_eq!(
            renewed,
            vec![Event::WarmStarted {
                route: "r".into(),
                window: 0,
                min: 1,
                scheduled_at_ms: next,
                until_ms: next + H / 2,
            }]
        );
        // A restart while it is open keeps asking for its replica (asked for already).
        assert!(decide_restart(&s, next).is_empty());
        assert_eq!(deployment_floor(&s, "d", next), 1);
        // The route dropping its window ends it.
        events.push((next, warm_route(Vec::new(), Some(0))));
        let s = state(events);
        assert_eq!(
            decide_warm(&s, "r", next),
            vec![Event::WarmEnded {
                route: "r".into(),
                window: 0
            }]
        );
    }

    #[test]
    fn idle_replicas_part_the_awake_and_the_idle_count() {
        let Event::RouteUpserted { route } = route() else {
            unreachable!()
        };
        let pool = RouteSpec {
            min_replicas: 2,
            max_replicas: 2,
            idle_replicas: Some(0),
            ..(*route).clone()
        };
        assert_eq!((idle_floor(&pool), awake_replicas(&pool)), (0, 2));
        let kept = RouteSpec {
            idle_replicas: Some(1),
            ..(*route).clone()
        };
        assert_eq!((idle_floor(&kept), awake_replicas(&kept)), (1, 1));
        assert_eq!((idle_floor(&route), awake_replicas(&route)), (0, 1));
    }
}
