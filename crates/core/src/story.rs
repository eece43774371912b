//! Events told in plain words: one line per decision, with the reason and the facts behind it
//! ("scale demo from 1 to 0: no request for 300 s since 11:55:03"). Each line is written from the
//! state just before its event, so it can say what the decision was based on: the idle time from
//! the route's last use, how long a call waited in the queue, how late a cleaner fired.
//! `ebb explain`, `/admin/explain` and the dashboard show these lines.
//!
//! What a line says by event: an idle scale-down, the route's last use and idle bound; a
//! `ScaledUp`, how long after its request; a call's start, its time in the queue; a finish, its
//! runner, run time and log; a repeated finish, that the first one stands; a cleaner's firing,
//! its lateness. `ebb explain` replays the whole log once (from the snapshot under the first
//! record still stored, after compaction), telling the events that concern the object; the
//! dashboard tells the log's tail the same way from a copy of the projection of its own.

use serde::Serialize;

use crate::event::{Envelope, Event, Outcome, RejectReason, ScaleReason};
use crate::state::State;

/// One event of a story.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Line {
    /// The event's seq.
    pub seq: u64,
    /// When it was logged, Unix milliseconds.
    pub at_ms: u64,
    /// The event's name (`ScaleRequested`).
    pub event: &'static str,
    /// What happened and why, in words.
    pub text: String,
}

/// Tells `env`; `before` is the state just before it was applied.
pub fn line(before: &State, env: &Envelope) -> Line {
    Line {
        seq: env.seq,
        at_ms: env.at_ms,
        event: env.event.name(),
        text: tell(before, env),
    }
}

pub use crate::timing::human_duration as duration;

/// A time of day (UTC) for people: `11:55:03`.
pub fn clock(at_ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(at_ms as i64)
        .map(|t| t.format("%H:%M:%S").to_string())
        .unwrap_or_else(|| format!("{at_ms} ms"))
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Why a forgetting came before its age: the bounds it kept the newest within.
fn kept_within(within: &Option<crate::event::Kept>, what: &str) -> String {
    within.map_or(String::new(), |k| {
        let mib = k.bytes as f64 / f64::from(1u32 << 20);
        format!(
            ": more {what} than the retention's bounds, so the newest {} taking at most \
             {mib:.1} MiB stay",
            k.count
        )
    })
}

/// At most `max` characters of `s` on one line.
fn excerpt(s: &str, max: usize) -> String {
    let flat: String = s
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        flat
    } else {
        let cut: String = flat.chars().take(max).collect();
        format!("{cut}…")
    }
}

fn outcome(o: Outcome) -> &'static str {
    match o {
        Outcome::Success => "succeeded",
        Outcome::Error => "failed",
    }
}

/// Why a scale was asked for, from what ebb knew then.
/// "9.8 requests in flight per replica over the last 6 s against a target of 4 at 70 %
/// (panic)".
pub fn load_reason(why: &crate::event::LoadWhy) -> String {
    use crate::event::Metric;
    let milli = |m: u64| {
        let v = m as f64 / 1000.0;
        if (v - v.round()).abs() < 0.05 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    };
    let what = match why.metric {
        Metric::Concurrency => "requests in flight",
        Metric::Rps => "requests per second",
    };
    let mut s = format!(
        "{} {what} per replica over the last {} against a target of {} at {} %",
        milli(why.per_replica_milli),
        duration(why.window_ms),
        milli(why.target_milli),
        why.utilization_pct
    );
    if why.held > 0 {
        s.push_str(&format!(
            ", {} waiting for a replica",
            plural(u64::from(why.held), "request", "requests")
        ));
    }
    if why.panic {
        s.push_str(" (panic)");
    }
    s
}

fn scale_reason(before: &State, deployment: &str, at_ms: u64, reason: ScaleReason) -> String {
    match reason {
        ScaleReason::Wake => "a request came while no replica was ready".into(),
        ScaleReason::Idle => {
            let routes: Vec<_> = before
                .routes
                .by_deployment
                .get(deployment)
                .into_iter()
                .flatten()
                .filter_map(|r| before.routes.by_name.get(r))
                .collect();
            let last = routes.iter().map(|r| r.last_used_ms).max().unwrap_or(0);
            let idle = routes.iter().map(|r| r.spec.idle_after_ms).max();
            let limit = idle.map_or(String::new(), |i| {
                format!(" (it scales to zero after {} idle)", duration(i))
            });
            if last == 0 {
                format!("no request since it started{limit}")
            } else {
                format!(
                    "no request for {} since {}{limit}",
                    duration(at_ms.saturating_sub(last)),
                    clock(last)
                )
            }
        }
        ScaleReason::Autoscale => {
            let function = deployment.strip_prefix("fn-").unwrap_or(deployment);
            format!(
                "the autoscaler follows {function}'s call counter, now {}",
                before.counters.value(function)
            )
        }
        ScaleReason::Manual => "an operator asked for it".into(),
        ScaleReason::Restart => {
            "ebb restarted and none of the replicas it ran before is running".into()
        }
        ScaleReason::Shutdown => "ebb is shutting down".into(),
        ScaleReason::Peer => "another ebb replica changed the shared replica count".into(),
        ScaleReason::Warm => {
            let open: Vec<String> = before
                .routes
                .routes_of(deployment)
                .flat_map(|r| {
                    r.warm.iter().map(move |(i, w)| {
                        format!(
                            "{} of {} keeps {} until {}",
                            window_name(r, *i),
                            r.spec.name,
                            w.min,
                            clock(w.until_ms)
                        )
                    })
                })
                .collect();
            if open.is_empty() {
                "a keep-warm window is open".into()
            } else {
                format!("keep-warm window {}", open.join("; "))
            }
        }
        ScaleReason::Load(why) => load_reason(&why),
    }
}

/// A keep-warm window as the route has it: its number and schedule.
fn window_name(r: &crate::state::Route, i: u32) -> String {
    match usize::try_from(i).ok().and_then(|i| r.spec.warm.get(i)) {
        Some(w) => format!(
            "{} ({:?}{}, for {})",
            i + 1,
            w.schedule,
            w.timezone
                .as_deref()
                .map_or(String::new(), |tz| format!(" {tz}")),
            duration(w.for_ms)
        ),
        None => format!("{}", i + 1),
    }
}

fn tell(before: &State, env: &Envelope) -> String {
    let at = env.at_ms;
    match &env.event {
        Event::RouteUpserted { route } => {
            let verb = if before.routes.by_name.contains_key(&route.name) {
                "changed"
            } else {
                "created"
            };
            let idle = if route.idle_after_ms == 0 {
                "never scales to zero".to_owned()
            } else {
                format!(
                    "scales to zero after {} idle",
                    duration(route.idle_after_ms)
                )
            };
            let from = match &route.listen {
                Some(addr) if route.domains.is_empty() => format!("TCP {addr}"),
                Some(addr) => format!("{}, TCP {addr}", route.domains.join(", ")),
                None => route.domains.join(", "),
            };
            format!(
                "route {} {verb}: {from} -> workload {}; {}..{} replicas, {idle}",
                route.name, route.deployment, route.min_replicas, route.max_replicas
            )
        }
        Event::RouteRemoved { name } => format!("route {name} removed"),
        Event::GatewayRouteAttached { route, attached } if attached.is_empty() => {
            format!("{route} is no longer a route of ebb's Gateways")
        }
        Event::GatewayRouteAttached { route, attached } => format!("{route}: {attached}"),
        Event::RequestsSeen {
            route,
            count,
            last_at_ms,
        } => format!(
            "{} to {route}, the last at {}",
            plural(*count, "request", "requests"),
            clock(*last_at_ms)
        ),
        Event::ScaleRequested {
            deployment,
            from,
            to,
            reason,
        } => format!(
            "scale {deployment} from {from} to {to}: {}",
            scale_reason(before, deployment, at, *reason)
        ),
        Event::WarmStarted {
            route,
            window,
            min,
            scheduled_at_ms,
            until_ms,
        } => {
            let r = before.routes.by_name.get(route);
            let name = r.map_or(format!("{}", window + 1), |r| window_name(r, *window));
            let renewed = r.is_some_and(|r| r.warm.contains_key(window));
            let late = at.saturating_sub(*scheduled_at_ms);
            let how = if renewed {
                format!("renewed by its occurrence at {}", clock(*scheduled_at_ms))
            } else if late >= 1_000 {
                format!(
                    "opened {} after its time, {} (ebb was not running then)",
                    duration(late),
                    clock(*scheduled_at_ms)
                )
            } else {
                "opened".to_owned()
            };
            format!(
                "keep-warm window {name} of {route} {how}: at least {} until {}",
                plural(u64::from(*min), "replica", "replicas"),
                clock(*until_ms)
            )
        }
        Event::WarmEnded { route, window } => {
            let r = before.routes.by_name.get(route);
            let name = r.map_or(format!("{}", window + 1), |r| window_name(r, *window));
            let why = match r.and_then(|r| r.warm.get(window)) {
                Some(w) if at >= w.until_ms => format!("its time ended at {}", clock(w.until_ms)),
                _ => "the route no longer has it as it was".to_owned(),
            };
            format!(
                "keep-warm window {name} of {route} closed: {why}; idleness decides from now on"
            )
        }
        Event::ScaledUp {
            deployment,
            replicas,
        } => {
            let asked = before
                .routes
                .deployments
                .get(deployment)
                .map_or(0, |d| d.desired_at_ms);
            let after = if asked > 0 && asked <= at {
                format!(", {} after it was asked", duration(at - asked))
            } else {
                String::new()
            };
            format!(
                "{deployment} has {} ready{after}",
                plural(u64::from(*replicas), "replica", "replicas")
            )
        }
        Event::ScaledDown {
            deployment,
            replicas,
        } => format!(
            "{deployment} scaled down to {}",
            plural(u64::from(*replicas), "replica", "replicas")
        ),
        Event::ScaleFailed {
            deployment,
            to,
            error,
        } => format!(
            "scaling {deployment} to {to} failed: {}",
            excerpt(error, 300)
        ),
        Event::CallQueued { call } => {
            let kind = match call.kind {
                crate::event::CallKind::Sync => "sync",
                crate::event::CallKind::Async => "async",
            };
            let partition = call
                .partition
                .as_ref()
                .map_or(String::new(), |p| format!(", for runner {p}"));
            format!(
                "call {} queued for {} ({kind}, timeout {}{partition})",
                call.id,
                call.target,
                duration(call.timeout_ms)
            )
        }
        Event::CallStarted {
            id,
            runner,
            deadline_at_ms,
        } => {
            let waited = before.calls.get(id).map_or(String::new(), |c| {
                format!(
                    " after {} in the queue",
                    duration(at.saturating_sub(c.created_at_ms))
                )
            });
            format!(
                "runner {runner} started it{waited}; it must finish by {}",
                clock(*deadline_at_ms)
            )
        }
        Event::CallRejected { runner, reason, .. } => {
            let why = match reason {
                RejectReason::AlreadyRunning => {
                    "it was already running, and a call never runs twice: it ends as an error"
                }
                RejectReason::AlreadyFinal => "it had already ended",
                RejectReason::UnknownCall => "no call with that id was ever queued",
            };
            format!("runner {runner}'s start was refused: {why}")
        }
        Event::CallFinished {
            id,
            runner,
            outcome: o,
            result,
            log,
        } => {
            let call = before.calls.get(id);
            if call.is_some_and(|c| c.status.is_final()) {
                return format!(
                    "runner {runner} reported it {} again: the first finish stands",
                    outcome(*o)
                );
            }
            let mut s = format!("runner {runner} finished it: it {}", outcome(*o));
            if let Some(r) = result {
                s.push_str(&format!(", HTTP {}", r.status));
            }
            if let Some(started) = call.and_then(|c| c.started_at_ms) {
                s.push_str(&format!(
                    " after {} running",
                    duration(at.saturating_sub(started))
                ));
            }
            if !log.trim().is_empty() {
                s.push_str(&format!("; log: {}", excerpt(log, 200)));
            }
            s
        }
        Event::CallTimedOut { id } => {
            let deadline = before
                .calls
                .get(id)
                .and_then(|c| c.deadline_at_ms)
                .map_or(String::new(), |d| format!(" ({})", clock(d)));
            format!("it passed its deadline{deadline} unfinished and timed out")
        }
        Event::CallCancelled { .. } => "cancelled".into(),
        Event::CallsForgotten {
            finished_before_ms,
            within,
            keep_gone,
        } => format!(
            "calls that ended before {} left the projection (their events stay){}{}",
            clock(*finished_before_ms),
            kept_within(within, "ended calls"),
            keep_gone.map_or(String::new(), |k| format!(
                "; those that ended since {} stay known as ended by their id (at most {}), \
                 so a message of theirs read again is not run",
                clock(k.ended_since_ms),
                k.most
            ))
        ),
        Event::CallsAborted { ids } => format!(
            "the queue did not confirm {}: {} never run",
            plural(ids.len() as u64, "call's enqueue", "calls' enqueues"),
            if ids.len() == 1 { "it is" } else { "they are" }
        ),
        Event::TemplateUpserted { template } => {
            let verb = if before.functions.templates.contains_key(&template.name) {
                "changed"
            } else {
                "created"
            };
            let runs = match (&template.service_address, &template.image) {
                (Some(a), _) => format!("served at {a}"),
                (None, Some(i)) => format!("image {i}"),
                (None, None) => "a local function server".into(),
            };
            format!(
                "function {} {verb}: {runs}; {}..{} instances",
                template.name, template.min_instances, template.max_instances
            )
        }
        Event::TemplateDeleted { name } => format!("function {name} deleted"),
        Event::InstanceCreated { id, template, .. } => {
            format!("instance {id} of {template} created")
        }
        Event::InstanceStepped {
            function, call_id, ..
        } => format!("ran {function} as call {call_id}"),
        Event::InstanceFinished {
            outcome: o, result, ..
        } => {
            let text = String::from_utf8_lossy(result);
            if text.trim().is_empty() {
                format!("the instance {}", outcome(*o))
            } else {
                format!("the instance {}: {}", outcome(*o), excerpt(&text, 200))
            }
        }
        Event::TemplateFired {
            name,
            scheduled_at_ms,
        } => format!(
            "{name}'s schedule fired for {} ({} late)",
            clock(*scheduled_at_ms),
            duration(at.saturating_sub(*scheduled_at_ms))
        ),
        Event::InstancesForgotten {
            finished_before_ms,
            within,
        } => format!(
            "instances that ended before {} left the projection (their events stay){}",
            clock(*finished_before_ms),
            kept_within(within, "ended instances")
        ),
        Event::CounterAdded { function, by, cap } => {
            let was = before.counters.value(function);
            format!(
                "{function}'s call counter grew by {by} to {} (cap {cap})",
                was.saturating_add(*by).min(*cap)
            )
        }
        Event::CounterDecayed { function, by } => {
            let was = before.counters.value(function);
            format!(
                "{function}'s call counter decayed by {by} to {}",
                was.saturating_sub(*by)
            )
        }
        Event::CleanerUpserted { cleaner } => {
            // The same name with another uid is a new cleaner.
            let verb = match before.cleaners.by_name.get(&cleaner.name) {
                Some(c) if c.spec.uid == cleaner.uid => "changed",
                _ => "created",
            };
            let targets: Vec<&str> = cleaner.targets.iter().map(|t| t.name.as_str()).collect();
            let mut s = format!(
                "cleaner {} {verb}: TTL {}, evaluated again every {}, {}",
                cleaner.name,
                duration(cleaner.ttl_ms),
                duration(cleaner.retry_period_ms),
                plural(cleaner.conditions.len() as u64, "condition", "conditions")
            );
            if !targets.is_empty() {
                s.push_str(&format!(", targets {}", targets.join(", ")));
            }
            if cleaner.dry_run {
                s.push_str("; dry run: it deletes nothing");
            }
            if !cleaner.invalid.is_empty() {
                s.push_str(&format!(
                    "; it never fires: {}",
                    excerpt(&cleaner.invalid, 200)
                ));
            }
            s
        }
        Event::CleanerEvaluated {
            result,
            next_at_ms,
            reason,
            message,
            results,
            would_delete,
            folded,
            ..
        } => {
            let mut s = if *result {
                "its conditions held".to_owned()
            } else {
                "its conditions did not hold".to_owned()
            };
            if !results.is_empty() {
                let each: Vec<&str> = results
                    .iter()
                    .map(|r| if *r { "true" } else { "false" })
                    .collect();
                s.push_str(&format!(" ({})", each.join(", ")));
            }
            match (reason.is_empty(), message.is_empty()) {
                (false, false) => s.push_str(&format!(": {reason}: {}", excerpt(message, 200))),
                (false, true) => s.push_str(&format!(": {reason}")),
                (true, false) => s.push_str(&format!(": {}", excerpt(message, 200))),
                (true, true) => {}
            }
            if !would_delete.is_empty() {
                s.push_str(&format!("; would delete {}", would_delete.join(", ")));
            }
            match next_at_ms {
                Some(n) => s.push_str(&format!("; next evaluation at {}", clock(*n))),
                None => s.push_str("; not evaluated again"),
            }
            if *folded > 0 {
                s.push_str(&format!(
                    " ({folded} evaluation{} before it found the same and were not recorded)",
                    if *folded == 1 { "" } else { "s" }
                ));
            }
            s
        }
        Event::CleanerFiring { targets, .. } => {
            if targets.is_empty() {
                "its conditions held past its TTL: it fires, with nothing to delete".into()
            } else {
                format!(
                    "its conditions held past its TTL: deleting {}",
                    targets.join(", ")
                )
            }
        }
        Event::CleanerFired { name } => match before.cleaners.by_name.get(name) {
            Some(c) => {
                let due = c.created_at_ms.saturating_add(c.spec.ttl_ms);
                format!(
                    "fired: its targets are released, {} after its TTL passed at {}",
                    duration(at.saturating_sub(due)),
                    clock(due)
                )
            }
            None => "fired: its targets are released".into(),
        },
        Event::CleanerDeleted { name } => format!("cleaner {name} deleted"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{CallSpec, RouteSpec};

    const T0: u64 = 1_767_268_800_000; // 2026-01-01T12:00:00Z

    fn tell_all(events: Vec<(u64, Event)>) -> Vec<String> {
        let mut state = State::default();
        let mut out = Vec::new();
        for (seq, (at, event)) in events.into_iter().enumerate() {
            let env = Envelope {
                seq: seq as u64 + 1,
                at_ms: at,
                version: crate::event::SCHEMA_VERSION,
                event,
            };
            out.push(line(&state, &env).text);
            state.apply(&env);
        }
        out
    }

    fn route() -> RouteSpec {
        RouteSpec {
            deployment: "demo".into(),
            idle_after_ms: 300_000,
            ..RouteSpec::for_test("demo", &["demo.localhost"])
        }
    }

    #[test]
    fn a_wake_and_an_idle_scale_down_say_why() {
        let lines = tell_all(vec![
            (
                T0,
                Event::RouteUpserted {
                    route: Box::new(route()),
                },
            ),
            (
                T0 + 1_000,
                Event::ScaleRequested {
                    deployment: "demo".into(),
                    from: 0,
                    to: 1,
                    reason: ScaleReason::Wake,
                },
            ),
            (
                T0 + 1_017,
                Event::ScaledUp {
                    deployment: "demo".into(),
                    replicas: 1,
                },
            ),
            (
                T0 + 2_000,
                Event::RequestsSeen {
                    route: "demo".into(),
                    count: 1,
                    last_at_ms: T0 + 3_000,
                },
            ),
            (
                T0 + 303_000,
                Event::ScaleRequested {
                    deployment: "demo".into(),
                    from: 1,
                    to: 0,
                    reason: ScaleReason::Idle,
                },
            ),
        ]);
        assert_eq!(
            lines[0],
            "route demo created: demo.localhost -> workload demo; 0..1 replicas, scales to zero after 300 s idle"
        );
        assert_eq!(
            lines[1],
            "scale demo from 0 to 1: a request came while no replica was ready"
        );
        assert_eq!(
            lines[2],
            "demo has 1 replica ready, 17 ms after it was asked"
        );
        assert_eq!(lines[3], "1 request to demo, the last at 12:00:03");
        assert_eq!(
            lines[4],
            "scale demo from 1 to 0: no request for 300 s since 12:00:03 (it scales to zero after 300 s idle)"
        );
    }

    #[test]
    fn a_failed_call_says_who_ran_it_how_long_and_its_log() {
        let mut call = CallSpec::for_test("c1");
        call.timeout_ms = 30_000;
        let lines = tell_all(vec![
            (
                T0,
                Event::CallQueued {
                    call: std::sync::Arc::new(call),
                },
            ),
            (
                T0 + 250,
                Event::CallStarted {
                    id: "c1".into(),
                    runner: "r1".into(),
                    deadline_at_ms: T0 + 30_250,
                },
            ),
            (
                T0 + 1_750,
                Event::CallFinished {
                    id: "c1".into(),
                    runner: "r1".into(),
                    outcome: Outcome::Error,
                    result: Some(crate::event::CallResult {
                        status: 500,
                        ..Default::default()
                    }),
                    log: "boom\nat line 3".into(),
                },
            ),
            (
                T0 + 1_800,
                Event::CallFinished {
                    id: "c1".into(),
                    runner: "r2".into(),
                    outcome: Outcome::Success,
                    result: None,
                    log: String::new(),
                },
            ),
        ]);
        assert_eq!(lines[0], "call c1 queued for t (async, timeout 30 s)");
        assert_eq!(
            lines[1],
            "runner r1 started it after 250 ms in the queue; it must finish by 12:00:30"
        );
        assert_eq!(
            lines[2],
            "runner r1 finished it: it failed, HTTP 500 after 1.5 s running; log: boom at line 3"
        );
        assert_eq!(
            lines[3],
            "runner r2 reported it succeeded again: the first finish stands"
        );
    }

    #[test]
    fn a_forgetting_by_the_bounds_says_what_it_kept() {
        let lines = tell_all(vec![
            (
                T0,
                Event::CallsForgotten {
                    finished_before_ms: T0 - 60_000,
                    within: None,
                    keep_gone: None,
                },
            ),
            (
                T0,
                Event::InstancesForgotten {
                    finished_before_ms: T0 - 1_000,
                    within: Some(crate::event::Kept {
                        count: 87_500,
                        bytes: 224 << 20,
                    }),
                },
            ),
        ]);
        assert!(
            lines[0].ends_with("left the projection (their events stay)"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].ends_with(
                "left the projection (their events stay): more ended instances than the \
                 retention's bounds, so the newest 87500 taking at most 224.0 MiB stay"
            ),
            "{}",
            lines[1]
        );
    }

    #[test]
    fn a_fired_cleaner_says_how_late_it_fired() {
        let cleaner = crate::event::CleanerSpec {
            name: "tmp".into(),
            ttl_ms: 60_000,
            retry_period_ms: 10_000,
            conditions: vec!["true".into()],
            created_at_ms: T0,
            ..Default::default()
        };
        let lines = tell_all(vec![
            (
                T0,
                Event::CleanerUpserted {
                    cleaner: Box::new(cleaner),
                },
            ),
            (
                T0 + 60_000,
                Event::CleanerEvaluated {
                    name: "tmp".into(),
                    result: false,
                    next_at_ms: Some(T0 + 70_000),
                    reason: "WaitingForConditions".into(),
                    message: "a condition is false".into(),
                    results: vec![false],
                    evaluations: 1,
                    would_delete: vec![],
                    folded: 5,
                },
            ),
            (
                T0 + 70_000,
                Event::CleanerFiring {
                    name: "tmp".into(),
                    targets: vec!["v1/ConfigMap/default/x@u1".into()],
                },
            ),
            (T0 + 70_400, Event::CleanerFired { name: "tmp".into() }),
        ]);
        assert_eq!(
            lines[0],
            "cleaner tmp created: TTL 60 s, evaluated again every 10 s, 1 condition"
        );
        assert_eq!(
            lines[1],
            "its conditions did not hold (false): WaitingForConditions: a condition is false; next evaluation at 12:01:10 (5 evaluations before it found the same and were not recorded)"
        );
        assert_eq!(
            lines[2],
            "its conditions held past its TTL: deleting v1/ConfigMap/default/x@u1"
        );
        assert_eq!(
            lines[3],
            "fired: its targets are released, 10 s after its TTL passed at 12:01:00"
        );
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(17), "17 ms");
        assert_eq!(duration(1_500), "1.5 s");
        assert_eq!(duration(2_000), "2 s");
        assert_eq!(duration(300_000), "300 s");
        assert_eq!(duration(900_000), "15 min");
        assert_eq!(duration(7_200_000 * 2), "4 h");
    }
}
