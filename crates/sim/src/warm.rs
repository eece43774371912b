//! The keep-warm simulation: one ebb replica's log on the in-memory store, a route with
//! keep-warm windows (cron, time zones, windows that overlap and renew), bursts of requests that
//! stay in flight for a while, and crashes that tear the last write and keep ebb down for a
//! while. Each tick runs what `ebb serve` runs at that moment, in its order: the wake of a request
//! that found no replica (`decide_wake`), the traffic flush (`RequestsSeen`), the keep-warm
//! decisions that fell due (`decide_warm`, as `proxy::runtime::warm_due` takes them from the
//! schedule), the idle check (`decide_idle`) and, after a restart, `decide_restart`.
//!
//! The invariants, by name:
//! * `warm_on_time`: after every tick, each window's record in the log is exactly the occurrence
//!   open at that tick (none when closed): a window opens, renews and closes at the first tick
//!   at or after its time, and after a restart at the restart's first tick.
//! * `warm_floor_held`: the replicas asked for are never fewer than the open windows' minimum.
//! * `in_flight_served`: while a request is in flight no decision scales the deployment down,
//!   and it is never asked to run zero replicas.
//! * `replay_equals_live`, `schedule_rebuilt_equals_live`: the log replays to the live state.

use std::hash::Hasher;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::log::SimLog;
use super::scenario::{Range, Scenario, WarmScenario};
use super::world::{Outcome, Stats, Violation};
use ebb_core::event::{Event, RouteSpec, ScaleReason};
use ebb_core::scaler::{Live, decide_idle, decide_restart, decide_wake, decide_warm, warm_min};

/// The simulated epoch: Thursday 2026-01-01T07:59:00Z, a minute before business hours start
/// in London (and in UTC), so that windows written for working days open within a run.
const T0: u64 = 1_767_254_340_000;

const ROUTE: &str = "app";
const DEPLOYMENT: &str = "app-dep";

/// Runs one seed of a keep-warm scenario.
pub fn run(sc: &Scenario, warm: &WarmScenario, seed: u64) -> Outcome {
    Sim::new(sc, warm, seed).run()
}

struct Sim {
    sc: Scenario,
    route: RouteSpec,
    warm: WarmScenario,
    rng: ChaCha8Rng,
    log: SimLog,
    now: u64,
    up: bool,
    /// When a crashed ebb starts again.
    restart_at: u64,
    /// End times of requests in flight.
    in_flight: Vec<u64>,
    next_burst: u64,
    unflushed: u64,
    last_at: u64,
    last_flush: u64,
    hasher: fnv::FnvHasher,
    trace: std::collections::VecDeque<String>,
    violation: Option<Violation>,
    stats: Stats,
}

impl Sim {
    fn new(sc: &Scenario, warm: &WarmScenario, seed: u64) -> Self {
        let windows = ebb_core::warm::warm_windows(&warm.windows, warm.max_replicas)
            .expect("checked when the scenario was read");
        let route = RouteSpec {
            name: ROUTE.into(),
            domains: vec!["app.sim".into()],
            deployment: DEPLOYMENT.into(),
            idle_after_ms: warm.idle_after_ms,
            max_replicas: warm.max_replicas,
            hold_timeout_ms: 30_000,
            hold_queue_max: 10_000,
            idle_replicas: warm.idle_replicas,
            warm: windows,
            ..Default::default()
        };
        let mut sim = Sim {
            sc: sc.clone(),
            route: route.clone(),
            warm: warm.clone(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            log: SimLog::new(),
            now: T0,
            up: true,
            restart_at: 0,
            in_flight: Vec::new(),
            next_burst: T0,
            unflushed: 0,
            last_at: 0,
            last_flush: T0,
            hasher: fnv::FnvHasher::default(),
            trace: std::collections::VecDeque::new(),
            violation: None,
            stats: Stats::default(),
        };
        sim.log.append(
            vec![Event::RouteUpserted {
                route: Box::new(route),
            }],
            T0,
            false,
        );
        let gap = sim.draw(warm.gap_ms);
        sim.next_burst = T0 + gap;
        sim
    }

    fn draw(&mut self, [lo, hi]: Range) -> u64 {
        self.rng.random_range(lo..=hi.max(lo))
    }

    fn note(&mut self, what: std::fmt::Arguments<'_>) {
        let line = format!("{:>8} {what}", self.now - T0);
        self.hasher.write(line.as_bytes());
        if self.trace.len() == 40 {
            self.trace.pop_front();
        }
        self.trace.push_back(line);
    }

    fn violate(&mut self, invariant: &'static str, detail: String) {
        if self.violation.is_none() {
            self.note(format_args!("VIOLATION {invariant}: {detail}"));
            self.violation = Some(Violation {
                invariant,
                detail,
                at_ms: self.now - T0,
            });
        }
    }

    /// Appends a decision's events (torn: the write is lost in the crash that follows at once).
    fn append(&mut self, events: Vec<Event>) -> bool {
        if events.is_empty() {
            return true;
        }
        let torn = self
            .rng
            .random_bool(self.sc.faults.torn_write_chance.clamp(0.0, 1.0));
        for e in &events {
            let line = describe(e);
            self.note(format_args!("{line}"));
        }
        self.check_scale(&events);
        self.log.append(events, self.now, torn);
        if torn {
            self.crash();
            return false;
        }
        true
    }

    /// `in_flight_served` for the scale requests of one decision.
    fn check_scale(&mut self, events: &[Event]) {
        let desired = self.desired();
        for e in events {
            if let Event::ScaleRequested { to, reason, .. } = e {
                if !self.in_flight.is_empty() && (*to < desired || *to == 0) {
                    self.violate(
                        "in_flight_served",
                        format!(
                            "scaled from {desired} to {to} ({}) with {} requests in flight",
                            reason.name(),
                            self.in_flight.len()
                        ),
                    );
                }
                if *reason == ScaleReason::Idle {
                    self.stats.scale_downs += 1;
                }
            }
            if let Event::WarmStarted { .. } = e {
                self.stats.warm_started += 1;
            }
        }
    }

    fn desired(&self) -> u32 {
        self.log
            .state
            .routes
            .deployments
            .get(DEPLOYMENT)
            .map_or(0, |d| d.desired)
    }

    fn crash(&mut self) {
        self.stats.crashes += 1;
        self.up = false;
        // Requests on the crashed proxy die with it.
        self.in_flight.clear();
        self.unflushed = 0;
        let down = self.draw(self.sc.faults.restart_ms);
        self.restart_at = self.now + down.max(1);
        self.note(format_args!("ebb crashes; down for {down} ms"));
    }

    fn restart(&mut self) {
        if let Err(why) = self.log.crash_and_recover() {
            self.violate(
                "replay_equals_live",
                format!("cannot replay the log: {why}"),
            );
            return;
        }
        self.up = true;
        self.last_at = 0;
        self.last_flush = self.now;
        let seq = self.log.state.seq;
        self.note(format_args!("ebb restarts (seq {seq})"));
        let now = self.now;
        let events = decide_restart(&self.log.state, now);
        self.append(events);
    }

    fn run(mut self) -> Outcome {
        let end = T0 + self.sc.duration_ms + self.sc.settle_ms;
        let tick = self.warm.tick_ms.max(1);
        let crash_chance = self.sc.faults.crash_per_s * tick as f64 / 1_000.0;
        while self.now < end && self.violation.is_none() {
            self.now += tick;
            self.stats.steps += 1;
            if !self.up {
                if self.now >= self.restart_at {
                    self.restart();
                }
                continue;
            }
            let now = self.now;
            let traffic_on = now < T0 + self.sc.duration_ms;
            self.in_flight.retain(|&until| until > now);
            // Arrivals: a burst of requests, each in flight for a while; one that finds no
            // replica asked for wakes the workload.
            if traffic_on && now >= self.next_burst {
                let n = self.draw(self.warm.burst);
                for _ in 0..n {
                    let serve = self.draw(self.warm.serve_ms);
                    self.in_flight.push(now + serve);
                }
                self.stats.requests += n;
                self.unflushed += n;
                self.last_at = now;
                let gap = self.draw(self.warm.gap_ms);
                self.next_burst = now + gap;
                if n > 0 && self.desired() == 0 {
                    let wake = decide_wake(&self.log.state, ROUTE, now);
                    if wake.is_some() {
                        self.stats.wakes += 1;
                    }
                    if !self.append(wake.into_iter().collect()) {
                        continue;
                    }
                }
            }
            if now >= self.last_flush + self.warm.flush_ms && self.unflushed > 0 {
                let seen = Event::RequestsSeen {
                    route: ROUTE.into(),
                    count: self.unflushed,
                    last_at_ms: self.last_at,
                };
                self.unflushed = 0;
                self.last_flush = now;
                if !self.append(vec![seen]) {
                    continue;
                }
            }
            // The keep-warm decisions due now, as `warm_due` takes them.
            let due = self
                .log
                .state
                .schedule
                .due_of(ebb_core::state::schedule::DueKind::RouteWarm, now)
                .next()
                .is_some();
            if due {
                let events = decide_warm(&self.log.state, ROUTE, now);
                if !self.append(events) {
                    continue;
                }
            }
            let live = Live {
                in_flight: self.in_flight.len() as u64,
                last_at_ms: self.last_at,
            };
            if live.in_flight == 0 {
                let idle = decide_idle(&self.log.state, DEPLOYMENT, live, now);
                if !self.append(idle.into_iter().collect()) {
                    continue;
                }
            }
            self.check(now);
            if self.rng.random_bool(crash_chance.clamp(0.0, 1.0)) {
                self.crash();
            }
        }
        if self.violation.is_none()
            && let Err((invariant, detail)) = self.log.check_replay()
        {
            self.violate(invariant, detail);
        }
        Outcome {
            hash: self.hasher.finish(),
            sim_ms: self.now - T0,
            violation: self.violation,
            trace: self.trace.into_iter().collect(),
            stats: self.stats,
        }
    }

    /// The invariants after a tick.
    fn check(&mut self, now: u64) {
        let Some(r) = self.log.state.routes.by_name.get(ROUTE).cloned() else {
            return;
        };
        for (i, w) in self.route.warm.iter().enumerate() {
            let want = ebb_core::scaler::warm_wanted(w, now);
            let have = r.warm.get(&(i as u32)).copied();
            if want != have {
                self.violate(
                    "warm_on_time",
                    format!(
                        "window {} ({:?}) is recorded as {have:?}, and at this tick it is {want:?}",
                        i + 1,
                        w.schedule
                    ),
                );
                return;
            }
        }
        let floor = warm_min(&self.route, now);
        let desired = self.desired();
        if desired < floor {
            self.violate(
                "warm_floor_held",
                format!("{desired} replicas asked for while the open windows keep {floor}"),
            );
        }
        if !self.in_flight.is_empty() && desired == 0 {
            self.violate(
                "in_flight_served",
                format!(
                    "no replica asked for with {} requests in flight",
                    self.in_flight.len()
                ),
            );
        }
        if self.stats.steps.is_multiple_of(500)
            && let Err((invariant, detail)) = self.log.check_replay()
        {
            self.violate(invariant, detail);
        }
    }
}

fn describe(e: &Event) -> String {
    match e {
        Event::WarmStarted {
            window,
            min,
            scheduled_at_ms,
            until_ms,
            ..
        } => format!(
            "WarmStarted window {window} min {min} at {} until {}",
            scheduled_at_ms.saturating_sub(T0),
            until_ms.saturating_sub(T0)
        ),
        Event::WarmEnded { window, .. } => format!("WarmEnded window {window}"),
        Event::ScaleRequested {
            from, to, reason, ..
        } => {
            format!("ScaleRequested {from} -> {to} ({})", reason.name())
        }
        Event::RequestsSeen { count, .. } => format!("RequestsSeen {count}"),
        other => other.name().to_owned(),
    }
}
