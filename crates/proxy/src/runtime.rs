//! The proxy's background loops: flush traffic into `RequestsSeen` aggregates ([`run_flusher`],
//! one per active route per flush interval), record what the orchestrator reports as `ScaledUp` /
//! `ScaledDown` ([`run_observer`]), scale idle workloads down ([`run_downscaler`]), and open and
//! close keep-warm windows when their `RouteWarm` deadline falls due, scaling a deployment up to
//! its floor ([`run_warmer`]). Each loop decides on the log's writer (serialized with every other
//! decision) and acts only after its events are durable.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::Traffic;
use crate::clock::Clock;
use crate::event::Event;
use crate::log::Log;
use crate::scaler::{Live, Report, decide_idle, decide_observed};
use crate::state::State;
use ebb_core::orchestrator::Orchestrator;

/// Intervals of the loops.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// How often traffic is flushed to the log.
    pub flush_interval_ms: u64,
    /// How often idle workloads are looked for.
    pub idle_check_interval_ms: u64,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            flush_interval_ms: 1_000,
            idle_check_interval_ms: 100,
        }
    }
}

/// Appends one `RequestsSeen` per route that saw requests since the last flush.
pub async fn flush(log: &Log, traffic: &Traffic) {
    let mut events = Vec::new();
    let mut taken = Vec::new();
    for (route, t) in traffic.all() {
        let (count, last_at_ms) = t.take_requests();
        if count > 0 {
            events.push(Event::RequestsSeen {
                route,
                count,
                last_at_ms,
            });
            taken.push((t, count));
        }
    }
    if events.is_empty() {
        return;
    }
    if let Err(e) = log.append_all(events).await {
        tracing::warn!(error = %e, "flushing traffic failed; keeping the counts");
        for (t, count) in taken {
            t.restore_requests(count);
        }
    }
}

/// Flushes traffic every interval until `stop` turns true, and once more then.
pub async fn run_flusher(
    log: Arc<Log>,
    traffic: Arc<Traffic>,
    options: RuntimeOptions,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(options.flush_interval_ms.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => flush(&log, &traffic).await,
            _ = stop.changed() => {
                flush(&log, &traffic).await;
                return;
            }
        }
    }
}

/// Records what the orchestrator reports as `ScaleFailed`, `ScaledUp` and `ScaledDown` events.
pub async fn run_observer(
    log: Arc<Log>,
    orch: Arc<dyn Orchestrator>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = orch.changes();
    // Failures already logged, per deployment (the orchestrator counts since it started).
    let mut logged_failures: std::collections::HashMap<String, u64> = Default::default();
    loop {
        observe_once(&log, orch.as_ref(), &mut logged_failures).await;
        if log.failure().is_some() {
            // Nothing can be recorded any more: ebb is stopping.
            return;
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = stop.changed() => {
                // What changed just before the stop is recorded too.
                observe_once(&log, orch.as_ref(), &mut logged_failures).await;
                return;
            }
        }
    }
}

async fn observe_once(
    log: &Log,
    orch: &dyn Orchestrator,
    logged_failures: &mut std::collections::HashMap<String, u64>,
) {
    let deployments: Vec<String> = log.read(|s| s.routes.by_deployment.keys().cloned().collect());
    for d in deployments {
        let seen = orch.observe(&d).unwrap_or_default();
        let logged = logged_failures.entry(d.clone()).or_default();
        let report = Report {
            ready: seen.ready.len() as u32,
            new_failures: seen.failures.saturating_sub(*logged),
            last_failure: seen.last_failure,
        };
        match log
            .decide(move |s: &State, _| (decide_observed(s, &d, &report), ()))
            .await
        {
            Ok(_) => *logged = seen.failures,
            Err(e) => {
                tracing::warn!(error = %e, "recording replicas failed");
                if log.failure().is_some() {
                    return;
                }
            }
        }
    }
}

/// What the proxy knows of `routes`' traffic that the log may not have yet: requests in flight
/// and the newest request time.
pub fn live_of<'a>(traffic: &Traffic, routes: impl IntoIterator<Item = &'a String>) -> Live {
    let mut live = Live::default();
    for r in routes {
        let t = traffic.route(r);
        live.in_flight += t.in_flight();
        live.last_at_ms = live.last_at_ms.max(t.last_at_ms());
    }
    live
}

/// Scales idle workloads down to their minimum.
pub async fn run_downscaler(
    log: Arc<Log>,
    orch: Arc<dyn Orchestrator>,
    traffic: Arc<Traffic>,
    clock: Arc<dyn Clock>,
    options: RuntimeOptions,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = ticker(options.idle_check_interval_ms);
    while next_tick(&mut tick, &mut stop).await {
        let now = clock.now_ms();
        // Deployments asked to run, with the routes that lead to them.
        let candidates: Vec<(String, Vec<String>)> = log.read(|s| {
            s.routes
                .deployments
                .iter()
                .filter(|(_, d)| d.desired > 0)
                .map(|(name, _)| {
                    let routes = s
                        .routes
                        .routes_of(name)
                        .map(|r| r.spec.name.clone())
                        .collect();
                    (name.clone(), routes)
                })
                .collect()
        });
        for (deployment, routes) in candidates {
            let live = live_of(&traffic, &routes);
            if live.in_flight > 0 {
                continue;
            }
            let d = deployment.clone();
            let decided = log
                .decide(move |s: &State, _| {
                    let ev = decide_idle(s, &d, live, now);
                    let to = match &ev {
                        Some(Event::ScaleRequested { to, .. }) => Some(*to),
                        _ => None,
                    };
                    (ev.into_iter().collect(), to)
                })
                .await;
            match decided {
                Ok((Some(to), _)) => {
                    tracing::info!(%deployment, to, "idle: scaling down");
                    if let Err(e) = orch.scale(&deployment, to) {
                        tracing::warn!(%deployment, error = %e, "scaling down failed");
                    }
                }
                Ok((None, _)) => {}
                Err(e) => tracing::warn!(error = %e, "idle decision failed"),
            }
        }
    }
}

/// Opens and closes keep-warm windows as they fall due (the schedule's `RouteWarm` deadlines,
/// looked at every `idle_check_interval_ms`), and scales a deployment up to its floor when a
/// window asks for more than it runs. Runs on every replica: each records the windows in its own
/// log, and a scale-up is written only when the orchestrator shows fewer replicas asked for, so
/// replicas doing the same thing agree and a deployment scaled higher is never lowered.
pub async fn run_warmer(
    log: Arc<Log>,
    orch: Arc<dyn Orchestrator>,
    clock: Arc<dyn Clock>,
    options: RuntimeOptions,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = ticker(options.idle_check_interval_ms);
    while next_tick(&mut tick, &mut stop).await {
        warm_due(&log, orch.as_ref(), clock.now_ms()).await;
        if log.failure().is_some() {
            return;
        }
    }
}

/// Decides every route whose keep-warm deadline is at or before `now_ms`; returns how many
/// decisions logged events.
pub async fn warm_due(log: &Log, orch: &dyn Orchestrator, now_ms: u64) -> usize {
    let due: Vec<String> = log.read(|s| {
        s.schedule
            .due_of(crate::state::schedule::DueKind::RouteWarm, now_ms)
            .filter_map(|(_, d)| match d {
                crate::state::Due::RouteWarm(route) => Some(route.clone()),
                _ => None,
            })
            .collect()
    });
    let mut decided = 0;
    for route in due {
        let r = route.clone();
        let events = match log
            .decide(move |s: &State, now| {
                let events = crate::scaler::decide_warm(s, &r, now);
                (events.clone(), events)
            })
            .await
        {
            Ok((events, _)) => events,
            Err(e) => {
                tracing::warn!(%route, error = %e, "keep-warm decision failed");
                continue;
            }
        };
        if !events.is_empty() {
            decided += 1;
        }
        for e in &events {
            match e {
                Event::WarmStarted {
                    window,
                    min,
                    until_ms,
                    ..
                } => tracing::info!(%route, window, min, until_ms, "keep-warm window open"),
                Event::WarmEnded { window, .. } => {
                    tracing::info!(%route, window, "keep-warm window closed")
                }
                Event::ScaleRequested { deployment, to, .. } => {
                    let desired = orch.observe(deployment).map_or(0, |o| o.desired);
                    if desired < *to {
                        tracing::info!(%deployment, to, "keep-warm: scaling up");
                        if let Err(e) = orch.scale(deployment, *to) {
                            tracing::warn!(%deployment, error = %e, "keep-warm scale-up failed");
                        }
                    }
                }
                _ => {}
            }
        }
    }
    decided
}

/// An interval of `ms` (at least 1) whose missed ticks are not made up for.
pub(crate) fn ticker(ms: u64) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(Duration::from_millis(ms.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// Waits for the next tick; false once `stop` changed.
pub(crate) async fn next_tick(
    tick: &mut tokio::time::Interval,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        _ = tick.tick() => true,
        _ = stop.changed() => false,
    }
}
