//! Scaling on load, the loop around the core's rule (`ebb_core::scaler::load`): the proxy's
//! counters are read every [`POLL_MS`] and made into one [`Sample`] a second per deployment
//! (requests at its replicas and held, averaged over the second; requests arrived and ended in
//! it), kept in a bounded [`Window`]; each second the route's [`Decider`] takes the figures, and
//! a count other than the one asked for is decided on the log's writer
//! ([`ebb_core::scaler::decide_load`], `ScaleRequested { reason: load }` with its figures) and
//! then asked of the orchestrator.
//!
//! Only deployments that are awake are decided: a deployment at zero is woken by its first
//! request, and one idle for its `idle_after_ms` goes back to its floor by idleness, as before.
//! On several ebb replicas (Kubernetes) each sees its share of the traffic: [`LoadScaler::sample`]
//! makes this replica's, [`LoadScaler::decide`] takes the samples other replicas reported, and
//! only the lease holder decides.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use ebb_core::orchestrator::Orchestrator;
use ebb_core::scaler::load::{
    Decider, Decision, Figures, Rule, SAMPLE_MS, Sample, Settings, Window,
};
use tokio::sync::watch;

use crate::clock::Clock;
use crate::event::Event;
use crate::log::Log;
use crate::state::State;
use crate::traffic::Traffic;

/// How often the counters are read within a second.
pub const POLL_MS: u64 = 100;

/// What the dashboard and `/metrics` show of one deployment's scaling on load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct View {
    /// The route whose settings decide.
    pub route: String,
    /// `concurrency` or `rps`.
    pub metric: &'static str,
    /// The target per replica and the share of it aimed at.
    pub target: f64,
    pub utilization: f64,
    /// The stable and panic windows' averages of the load (all replicas of the deployment).
    pub stable: f64,
    pub panic: f64,
    /// Requests held now.
    pub held: f64,
    /// Replicas the rule wants now, and replicas ready.
    pub desired: u32,
    pub ready: u32,
    pub panicking: bool,
}

/// The counters read so far in the current second.
#[derive(Debug, Default, Clone)]
struct Partial {
    in_flight: f64,
    held: f64,
    polls: u32,
    /// Arrivals and ends at the last sample (monotonic counters).
    arrived_at: u64,
    answered_at: u64,
    answer_us_at: u64,
    started_ms: u64,
}

/// One deployment's state between decisions.
#[derive(Debug, Default)]
struct Tracked {
    route: String,
    /// Every route of the deployment.
    routes: Vec<String>,
    /// Since when this replica has decided the deployment without a pause (`None`: it has not).
    deciding_since: Option<u64>,
    settings: Option<Settings>,
    window: Window,
    decider: Decider,
    partial: Partial,
    /// The newest sample this replica made.
    mine: Option<Sample>,
    /// What the last decision found.
    view: View,
}

/// One replica's share of a deployment's load in its last second, as it reports it to the
/// replica that decides.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Share {
    /// The second's sample (its `at_ms` in the reporter's clock: not compared).
    pub sample: Sample,
    /// Requests at the replicas and held through the reporter at its end.
    pub in_flight: f64,
    pub held: f64,
}

/// What another ebb replica reported last.
#[derive(Debug, Clone)]
struct Report {
    /// When it arrived, in this replica's clock.
    at_ms: u64,
    shares: BTreeMap<String, Share>,
    /// The replicas (of every deployment) with requests under way through it, and how many.
    busy: BTreeMap<SocketAddr, u32>,
}

/// A report older than this (in the receiver's clock) is not counted: its replica stopped
/// reporting (gone, cut off, or no longer serving). Three sample periods.
pub const STALE_MS: u64 = 3 * SAMPLE_MS;

/// Replicas whose reports are kept at most (the newest report of each).
pub const MAX_REPORTERS: usize = 256;

/// Deployments one report may name at most.
pub const MAX_REPORTED: usize = 4096;

/// Busy replicas one report may name at most.
pub const MAX_BUSY: usize = 16_384;

impl Tracked {
    /// Forgets what decisions remembered: the windows, the panic, the view.
    fn forget(&mut self) {
        self.window = Window::default();
        self.decider = Decider::default();
        self.deciding_since = None;
        self.view = View::default();
    }
}

/// Every awake deployment's samples and decisions.
#[derive(Debug, Default)]
pub struct LoadScaler {
    tracked: Mutex<HashMap<String, Tracked>>,
    reports: Mutex<HashMap<String, Report>>,
}

impl LoadScaler {
    /// What the last decisions found, per deployment.
    pub fn views(&self) -> BTreeMap<String, View> {
        self.lock()
            .iter()
            .filter(|(_, t)| t.settings.is_some() && !t.view.route.is_empty())
            .map(|(d, t)| (d.clone(), t.view.clone()))
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tracked>> {
        self.tracked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the proxy's counters for the deployments `scaled` names (deployment → its routes and
    /// its settings), forgetting the others; at each second's end makes this replica's sample of
    /// each. Returns the deployments whose second ended.
    pub fn poll(
        &self,
        traffic: &Traffic,
        scaled: &BTreeMap<String, (String, Vec<String>, Settings)>,
        now_ms: u64,
    ) -> Vec<String> {
        let mut all = self.lock();
        all.retain(|d, _| scaled.contains_key(d));
        let mut ended = Vec::new();
        for (deployment, (route, routes, settings)) in scaled {
            let t = all.entry(deployment.clone()).or_default();
            if t.settings.as_ref() != Some(settings) || &t.route != route {
                // New or changed settings: the windows start again.
                *t = Tracked {
                    route: route.clone(),
                    settings: Some(*settings),
                    ..Tracked::default()
                };
            }
            t.routes.clone_from(routes);
            let (mut in_flight, mut held, mut arrived) = (0u64, 0u64, 0u64);
            let (mut answered, mut answer_us) = (0u64, 0u64);
            for r in routes {
                let rt = traffic.route(r);
                let h = u64::from(rt.held());
                held += h;
                in_flight += rt.in_flight().saturating_sub(h);
                arrived += rt.served();
                let (n, us) = rt.answer_total();
                answered += n;
                answer_us += us;
            }
            let p = &mut t.partial;
            if p.polls == 0 && p.started_ms == 0 {
                // The first look: the counters so far are not this second's.
                p.arrived_at = arrived;
                p.answered_at = answered;
                p.answer_us_at = answer_us;
                p.started_ms = now_ms;
            }
            p.in_flight += in_flight as f64;
            p.held += held as f64;
            p.polls += 1;
            if now_ms.saturating_sub(p.started_ms) >= SAMPLE_MS {
                let polls = f64::from(p.polls.max(1));
                let came = arrived.saturating_sub(p.arrived_at);
                let sample = Sample {
                    at_ms: now_ms,
                    in_flight: p.in_flight / polls,
                    held: p.held / polls,
                    started: came,
                    arrived: came,
                    answered: answered.saturating_sub(p.answered_at),
                    answer_ms: answer_us.saturating_sub(p.answer_us_at) as f64 / 1_000.0,
                };
                t.mine = Some(sample);
                *p = Partial {
                    arrived_at: arrived,
                    answered_at: answered,
                    answer_us_at: answer_us,
                    started_ms: now_ms,
                    ..Partial::default()
                };
                ended.push(deployment.clone());
            }
        }
        ended
    }

    /// Keeps `replica`'s report received at `now_ms`, replacing its last: its `shares` of each
    /// deployment's load, and the replicas `busy` with requests through it. Refused (with why)
    /// when it names too many deployments or busy replicas, or too many replicas report.
    pub fn report(
        &self,
        replica: &str,
        shares: BTreeMap<String, Share>,
        busy: BTreeMap<SocketAddr, u32>,
        now_ms: u64,
    ) -> Result<(), String> {
        if shares.len() > MAX_REPORTED {
            return Err(format!(
                "a report names at most {MAX_REPORTED} deployments, not {}",
                shares.len()
            ));
        }
        if busy.len() > MAX_BUSY {
            return Err(format!(
                "a report names at most {MAX_BUSY} busy replicas, not {}",
                busy.len()
            ));
        }
        let bad = shares.iter().find(|(_, s)| {
            let n = [s.sample.in_flight, s.sample.held, s.in_flight, s.held];
            n.iter().any(|v| !v.is_finite() || *v < 0.0)
        });
        if let Some((d, _)) = bad {
            return Err(format!("the share of {d:?} is not a load"));
        }
        let mut reports = self.reports.lock().unwrap_or_else(|e| e.into_inner());
        reports.retain(|_, r| now_ms.saturating_sub(r.at_ms) < STALE_MS);
        if !reports.contains_key(replica) && reports.len() >= MAX_REPORTERS {
            return Err(format!("{MAX_REPORTERS} replicas report already"));
        }
        reports.insert(
            replica.to_owned(),
            Report {
                at_ms: now_ms,
                shares,
                busy,
            },
        );
        Ok(())
    }

    /// The shares of `deployment` other replicas reported within [`STALE_MS`] of `now_ms`.
    pub fn others(&self, deployment: &str, now_ms: u64) -> Vec<Share> {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|r| now_ms.saturating_sub(r.at_ms) < STALE_MS)
            .filter_map(|r| r.shares.get(deployment).copied())
            .collect()
    }

    /// Requests under way at the replica `addr` through the other ebb replicas, as they reported
    /// within [`STALE_MS`] of `now_ms`.
    pub fn busy_elsewhere(&self, addr: SocketAddr, now_ms: u64) -> u32 {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|r| now_ms.saturating_sub(r.at_ms) < STALE_MS)
            .filter_map(|r| r.busy.get(&addr))
            .fold(0u32, |a, n| a.saturating_add(*n))
    }

    /// This replica's shares of every deployment it sampled, for the replica that decides.
    pub fn shares(&self, traffic: &Traffic) -> BTreeMap<String, Share> {
        let all = self.lock();
        all.iter()
            .filter_map(|(d, t)| {
                let sample = t.mine?;
                let (in_flight, held) = now_of(traffic, &t.routes);
                Some((
                    d.clone(),
                    Share {
                        sample,
                        in_flight,
                        held,
                    },
                ))
            })
            .collect()
    }

    /// Adds the second's sample of `deployment` (this replica's summed with `others`, the newest
    /// shares other replicas reported) to its window and decides: the replicas wanted, with
    /// `ready` ready now and `asked` asked for, and the figures taken. `in_flight` and `held` are
    /// the requests at replicas and held through this replica now.
    ///
    /// A replica that has just begun deciding (it took the lease over, or the deployment woke)
    /// has less than a stable window of the load: until it has a whole one, it never asks for
    /// fewer than `asked` (what the replica before it decided stands until it knows better).
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        &self,
        deployment: &str,
        others: &[Share],
        ready: u32,
        asked: u32,
        in_flight: f64,
        held: f64,
        now_ms: u64,
    ) -> Option<(Decision, Settings, f64)> {
        let mut all = self.lock();
        let t = all.get_mut(deployment)?;
        let settings = t.settings?;
        let mut sample = t.mine.unwrap_or(Sample {
            at_ms: now_ms,
            ..Sample::default()
        });
        let (mut in_flight, mut held) = (in_flight, held);
        for o in others {
            sample.in_flight += o.sample.in_flight;
            sample.held += o.sample.held;
            sample.started += o.sample.started;
            sample.arrived += o.sample.arrived;
            sample.answered += o.sample.answered;
            sample.answer_ms += o.sample.answer_ms;
            in_flight += o.in_flight;
            held += o.held;
        }
        let since = *t.deciding_since.get_or_insert(now_ms);
        sample.at_ms = now_ms;
        t.window.push(sample);
        t.window.trim(now_ms, settings.stable_window_ms);
        let figures = Figures::of(&t.window, &settings, now_ms, in_flight, held, false)?;
        let mut decision = t
            .decider
            .decide(&settings, &figures, ready, asked, now_ms, Rule::Ebb);
        if now_ms.saturating_sub(since) < settings.stable_window_ms && decision.desired < asked {
            decision.desired = asked;
        }
        t.view = View {
            route: t.route.clone(),
            metric: settings.metric.name(),
            target: settings.target,
            utilization: settings.utilization,
            stable: figures.stable,
            panic: figures.panic,
            held,
            desired: decision.desired,
            ready,
            panicking: decision.panicking,
        };
        Some((decision, settings, held))
    }

    /// Forgets what `deployment`'s decisions remembered (it went to zero, or this replica stops
    /// deciding: the next decision starts calm, with empty windows).
    pub fn reset(&self, deployment: &str) {
        if let Some(t) = self.lock().get_mut(deployment) {
            t.forget();
        }
    }

    /// [`LoadScaler::reset`] of every deployment.
    pub fn reset_all(&self) {
        self.lock().values_mut().for_each(Tracked::forget);
    }
}

/// The deployments scaled on load now, each with its deciding route, all its routes and the
/// settings, and whether it is awake.
pub fn scaled(state: &State, now_ms: u64) -> BTreeMap<String, (String, Vec<String>, Settings)> {
    let mut out = BTreeMap::new();
    for d in state.routes.by_deployment.keys() {
        let Some(route) = ebb_core::scaler::load_route(state, d) else {
            continue;
        };
        let (min, max) = ebb_core::scaler::load_bounds(state, route, now_ms);
        let Some(Ok(settings)) = route.load.as_ref().map(|l| Settings::of(l, min, max)) else {
            continue;
        };
        let routes = state
            .routes
            .routes_of(d)
            .map(|r| r.spec.name.clone())
            .collect();
        out.insert(d.clone(), (route.name.clone(), routes, settings));
    }
    out
}

/// Requests at the replicas and held now, over `routes`.
pub fn now_of(traffic: &Traffic, routes: &[String]) -> (f64, f64) {
    let (mut in_flight, mut held) = (0u64, 0u64);
    for r in routes {
        let t = traffic.route(r);
        let h = u64::from(t.held());
        held += h;
        in_flight += t.in_flight().saturating_sub(h);
    }
    (in_flight as f64, held as f64)
}

/// Records and performs one deployment's decision: `ScaleRequested { reason: load }` when the
/// count changes, then the orchestrator's scale. Returns the count asked for, if it changed.
pub async fn apply(
    log: &Log,
    orch: &dyn Orchestrator,
    deployment: &str,
    decision: Decision,
    settings: &Settings,
    ready: u32,
    held: f64,
) -> Option<u32> {
    let why = decision.why(settings, ready, held);
    let d = deployment.to_owned();
    let wanted = decision.desired;
    let decided = log
        .decide(move |s: &State, now| {
            let ev = ebb_core::scaler::decide_load(s, &d, wanted, why, now);
            let to = match &ev {
                Some(Event::ScaleRequested { from, to, .. }) => Some((*from, *to)),
                _ => None,
            };
            (ev.into_iter().collect(), to)
        })
        .await;
    match decided {
        Ok((Some((from, to)), _)) => {
            tracing::info!(
                %deployment,
                from,
                to,
                per_replica = decision.per_replica,
                panic = decision.panicking,
                "load: scaling"
            );
            if let Err(e) = orch.scale(deployment, to) {
                tracing::warn!(%deployment, error = %e, "scaling on load failed");
            }
            Some(to)
        }
        Ok((None, _)) => None,
        Err(e) => {
            tracing::warn!(%deployment, error = %e, "load decision failed");
            None
        }
    }
}

/// What one look at the log finds: each deployment scaled on load ([`scaled`]) and the replicas
/// the log asks of it.
#[allow(clippy::type_complexity)]
pub fn read(
    log: &Log,
    now_ms: u64,
) -> (
    BTreeMap<String, (String, Vec<String>, Settings)>,
    HashMap<String, u32>,
) {
    log.read(|s| {
        let scaled = scaled(s, now_ms);
        let asked = scaled
            .keys()
            .map(|d| {
                (
                    d.clone(),
                    s.routes.deployments.get(d).map_or(0, |d| d.desired),
                )
            })
            .collect();
        (scaled, asked)
    })
}

/// Decides each deployment of `ended` (whose second ended) on this replica's sample and the
/// shares other replicas reported ([`LoadScaler::others`]: none on one machine), and performs
/// what changed. A deployment the log asks to run none of is forgotten: its next wake starts
/// calm.
#[allow(clippy::too_many_arguments)]
pub async fn decide_ended(
    scaler: &LoadScaler,
    log: &Log,
    orch: &dyn Orchestrator,
    traffic: &Traffic,
    scaled: &BTreeMap<String, (String, Vec<String>, Settings)>,
    asked: &HashMap<String, u32>,
    ended: Vec<String>,
    now_ms: u64,
) {
    for deployment in ended {
        let was = asked.get(&deployment).copied().unwrap_or(0);
        if was == 0 {
            scaler.reset(&deployment);
            continue;
        }
        let others = scaler.others(&deployment, now_ms);
        let (in_flight, held) = now_of(traffic, &scaled[&deployment].1);
        let ready = orch
            .observe(&deployment)
            .map_or(0, |o| o.ready.len() as u32);
        let Some((decision, settings, held)) =
            scaler.decide(&deployment, &others, ready, was, in_flight, held, now_ms)
        else {
            continue;
        };
        tracing::debug!(
            %deployment,
            reporters = others.len(),
            ready,
            was,
            desired = decision.desired,
            load = decision.load,
            "load decision"
        );
        if decision.desired != was {
            apply(log, orch, &deployment, decision, &settings, ready, held).await;
        }
    }
}

/// The loop: polls the counters every [`POLL_MS`] and, each second, asks `decides` whether this
/// replica decides now (given the deployments whose second ended); if so it decides them. One
/// ebb always does ([`run`]); among several replicas, the Lease holder does and the others
/// report their shares instead (`ebb::load`).
#[allow(clippy::too_many_arguments)]
pub async fn run_with(
    scaler: Arc<LoadScaler>,
    log: Arc<Log>,
    orch: Arc<dyn Orchestrator>,
    traffic: Arc<Traffic>,
    clock: Arc<dyn Clock>,
    mut stop: watch::Receiver<bool>,
    mut decides: impl FnMut(&LoadScaler, &Traffic) -> bool,
) {
    let mut tick = crate::runtime::ticker(POLL_MS);
    while crate::runtime::next_tick(&mut tick, &mut stop).await {
        if log.failure().is_some() {
            return;
        }
        let now = clock.now_ms();
        let (scaled, asked) = read(&log, now);
        let ended = scaler.poll(&traffic, &scaled, now);
        if ended.is_empty() || !decides(&scaler, &traffic) {
            continue;
        }
        decide_ended(
            &scaler,
            &log,
            orch.as_ref(),
            &traffic,
            &scaled,
            &asked,
            ended,
            now,
        )
        .await;
    }
}

/// The loop of one ebb (the process orchestrator, or a single replica): it decides every
/// deployment scaled on load once a second.
pub async fn run(
    scaler: Arc<LoadScaler>,
    log: Arc<Log>,
    orch: Arc<dyn Orchestrator>,
    traffic: Arc<Traffic>,
    clock: Arc<dyn Clock>,
    stop: watch::Receiver<bool>,
) {
    run_with(scaler, log, orch, traffic, clock, stop, |_, _| true).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(in_flight: f64) -> Share {
        Share {
            in_flight,
            ..Share::default()
        }
    }

    #[test]
    fn reports_count_until_stale_and_are_bounded() {
        let s = LoadScaler::default();
        let a: SocketAddr = "10.0.0.1:8080".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:8080".parse().unwrap();
        let shares = BTreeMap::from([("web".to_owned(), share(3.0))]);
        s.report("ebb-1", shares.clone(), BTreeMap::from([(a, 2)]), 1_000)
            .unwrap();
        s.report(
            "ebb-2",
            shares.clone(),
            BTreeMap::from([(a, 1), (b, 4)]),
            2_000,
        )
        .unwrap();
        assert_eq!(s.others("web", 2_500).len(), 2);
        assert_eq!(s.busy_elsewhere(a, 2_500), 3);
        assert_eq!(s.busy_elsewhere(b, 2_500), 4);
        // ebb-1 is silent for STALE_MS: neither its share nor its busy replicas count.
        assert_eq!(s.others("web", 1_000 + STALE_MS).len(), 1);
        assert_eq!(s.busy_elsewhere(a, 1_000 + STALE_MS), 1);
        assert_eq!(s.busy_elsewhere(a, 2_000 + STALE_MS), 0);

        let many: BTreeMap<SocketAddr, u32> = (0..=MAX_BUSY as u32)
            .map(|i| {
                (
                    SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 8080 + (i >> 16) as u16)),
                    1,
                )
            })
            .collect();
        let e = s.report("ebb-3", shares.clone(), many, 2_000).unwrap_err();
        assert!(e.contains("busy replicas"), "{e}");
        let bad = BTreeMap::from([("web".to_owned(), share(f64::NAN))]);
        let e = s.report("ebb-3", bad, BTreeMap::new(), 2_000).unwrap_err();
        assert!(e.contains("not a load"), "{e}");
        for i in 0..MAX_REPORTERS {
            let _ = s.report(&format!("r-{i}"), shares.clone(), BTreeMap::new(), 2_000);
        }
        let e = s
            .report("one-too-many", shares, BTreeMap::new(), 2_000)
            .unwrap_err();
        assert!(e.contains("replicas report already"), "{e}");
    }
}
