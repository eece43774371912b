//! Scenario files (`simulations/*.toml`): what runs, for how long, and which faults strike.

use std::collections::BTreeSet;

use serde::Deserialize;

/// An inclusive range `[lo, hi]` a value is drawn from.
pub type Range = [u64; 2];

/// One scenario.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Its name (the file's stem when absent).
    #[serde(default)]
    pub name: String,
    /// What it exercises, for people.
    #[serde(default)]
    pub description: String,
    /// The file it was read from.
    #[serde(skip)]
    pub path: std::path::PathBuf,
    /// Simulated time with traffic and faults.
    pub duration_ms: u64,
    /// Simulated time after that with neither: everything under way must end within it.
    pub settle_ms: u64,
    /// The coordination API (Kubernetes) and the runner API's network.
    #[serde(default)]
    pub api: Api,
    /// Proxy replicas sharing one workload.
    pub proxy: Option<ProxyScenario>,
    /// A calls node with runners.
    pub calls: Option<CallsScenario>,
    /// A route with keep-warm windows on one replica (run alone: [`super::warm`]).
    pub warm: Option<WarmScenario>,
    /// One route scaled on load under a generated trace (run alone: [`super::load`]).
    pub load: Option<LoadScenario>,
    /// Fault rates (all off when absent).
    #[serde(default)]
    pub faults: Faults,
}

/// Latency and errors of API requests (each way).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Api {
    /// One-way latency.
    pub latency_ms: Range,
}

impl Default for Api {
    fn default() -> Self {
        Self { latency_ms: [1, 5] }
    }
}

/// Proxy replicas in front of one workload.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyScenario {
    /// ebb replicas behind the load balancer.
    pub replicas: usize,
    /// The route's `idle_after_ms`.
    pub idle_after_ms: u64,
    /// Last-used sync interval.
    pub sync_ms: u64,
    /// What the leader adds to the shared last use.
    pub sync_lag_ms: u64,
    /// Lease duration.
    pub lease_ms: u64,
    /// Clock skew: each replica's clock is off by up to this much, either way.
    #[serde(default)]
    pub max_skew_ms: u64,
    /// `RequestsSeen` flush interval.
    #[serde(default = "default_flush")]
    pub flush_ms: u64,
    /// How stale a replica's view of ready replicas may get (watch lag).
    pub observe_ms: Range,
    /// How often the leader looks for idle deployments.
    pub downscale_every_ms: u64,
    /// A workload replica's start-to-ready time.
    pub start_ms: Range,
    /// A stopping replica's time to exit (after its requests end).
    pub stop_ms: Range,
    /// A stopping replica still serving this long after it was asked to stop is killed.
    #[serde(default = "default_grace")]
    pub stop_grace_ms: u64,
    /// How long a request may be held for a wake.
    pub hold_timeout_ms: u64,
    /// The request pattern.
    pub traffic: Traffic,
}

fn default_flush() -> u64 {
    1_000
}

fn default_grace() -> u64 {
    30_000
}

fn default_lease() -> u64 {
    3_000
}

/// Bursts of requests separated by idle gaps.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    /// Idle gap between bursts.
    pub gap_ms: Range,
    /// Requests per burst.
    pub burst: Range,
    /// Time between requests within a burst.
    pub spacing_ms: Range,
    /// How long the workload takes to answer.
    pub serve_ms: Range,
    /// Chance that a request is a long one.
    #[serde(default)]
    pub long_chance: f64,
    /// How long a long request takes.
    #[serde(default)]
    pub long_ms: Range,
}

/// A calls node (one ebb with its log and queue) and runners.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallsScenario {
    /// Runners.
    pub runners: usize,
    /// Calls each runner runs at once.
    pub capacity: usize,
    /// Time between enqueues.
    pub gap_ms: Range,
    /// How long a call runs.
    pub run_ms: Range,
    /// A call's timeout.
    pub timeout_ms: u64,
    /// Reserved and not started: redelivered after this.
    pub visibility_timeout_ms: u64,
    /// Held past a started call's deadline by this much.
    pub hold_grace_ms: u64,
    /// A crashed runner is back after this.
    pub restart_ms: Range,
    /// A runner not heard from for this long is gone: its reserved calls and those meant for it
    /// go to others.
    #[serde(default = "default_lease")]
    pub runner_lease_ms: u64,
    /// ebb replicas serving calls, each with its own log, sharing one queue (as Kafka): each
    /// owns the calls it accepts and decides only for those. 1: one node, the embedded queue.
    #[serde(default = "one")]
    pub nodes: usize,
}

fn one() -> usize {
    1
}

/// Fault rates. `--faults` switches kinds off by name.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// `api-errors`: chance that an API request fails.
    pub api_error_chance: f64,
    /// `pauses`: chance that the leader stalls between reading a deployment and writing it.
    pub pause_chance: f64,
    /// How long such a stall lasts.
    pub pause_ms: Range,
    /// `replica-crash`: chance per second that a proxy replica (or the calls node) crashes.
    pub crash_per_s: f64,
    /// A crashed replica is back after this.
    pub restart_ms: Range,
    /// `torn-writes`: chance that a log write is not synced when the replica crashes right after.
    pub torn_write_chance: f64,
    /// `runner-crash`: chance that a runner crashes at each step (after dequeue, after start,
    /// while running).
    pub runner_crash_chance: f64,
    /// `lost-replies`: chance that a runner request's answer is lost (the runner retries).
    pub lost_reply_chance: f64,
    /// `duplicates`: chance that the queue hands out a reserved message again, or that the
    /// network sends a start or finish twice.
    pub duplicate_chance: f64,
    /// `skew`: clocks differ between replicas (by up to the proxy's `max_skew_ms`).
    #[serde(default)]
    pub skew: bool,
    /// `rebalances`: chance per second that a shared queue's partitions move between consumers
    /// (every message handed out may be read again by another replica's runner).
    pub rebalance_per_s: f64,
    /// `owner-stall`: chance that a replica stalls between putting an enqueued call's message
    /// and recording the call (past the bound other replicas hold such a message back for).
    pub owner_stall_chance: f64,
    /// How long such a stall lasts.
    pub owner_stall_ms: Range,
}

/// The fault kinds, by name.
pub const FAULT_KINDS: [&str; 11] = [
    "api-errors",
    "pauses",
    "replica-crash",
    "torn-writes",
    "runner-crash",
    "lost-replies",
    "duplicates",
    "skew",
    "rebalances",
    "owner-stall",
    "none",
];

impl Faults {
    /// Keeps only the kinds in `on` (`none` keeps nothing).
    pub fn restrict(&mut self, on: &BTreeSet<String>) {
        let keep = |k: &str| on.contains(k);
        if !keep("api-errors") {
            self.api_error_chance = 0.0;
        }
        if !keep("pauses") {
            self.pause_chance = 0.0;
        }
        if !keep("replica-crash") {
            self.crash_per_s = 0.0;
        }
        if !keep("torn-writes") {
            self.torn_write_chance = 0.0;
        }
        if !keep("runner-crash") {
            self.runner_crash_chance = 0.0;
        }
        if !keep("lost-replies") {
            self.lost_reply_chance = 0.0;
        }
        if !keep("duplicates") {
            self.duplicate_chance = 0.0;
        }
        if !keep("skew") {
            self.skew = false;
        }
        if !keep("rebalances") {
            self.rebalance_per_s = 0.0;
        }
        if !keep("owner-stall") {
            self.owner_stall_chance = 0.0;
        }
    }
}

impl Scenario {
    /// Parses a scenario; `name` is used when the file names none.
    pub fn parse(text: &str, name: &str) -> Result<Scenario, String> {
        let mut s: Scenario = toml::from_str(text).map_err(|e| e.to_string())?;
        if s.name.is_empty() {
            s.name = name.to_owned();
        }
        let seconds = s.duration_ms / 1_000;
        if let Some(l) = &mut s.load {
            l.seconds = seconds;
        }
        s.validate()?;
        Ok(s)
    }

    fn validate(&self) -> Result<(), String> {
        if let Some(l) = &self.load {
            if self.proxy.is_some() || self.calls.is_some() || self.warm.is_some() {
                return Err("[load] runs alone: no [proxy], [calls] or [warm] beside it".into());
            }
            if l.traces.is_empty() {
                return Err("load.traces: name at least one".into());
            }
            if let Some(t) = l.traces.iter().find(|t| !TRACES.contains(&t.as_str())) {
                return Err(format!(
                    "load.traces: unknown trace {t:?}: {}",
                    TRACES.join(", ")
                ));
            }
            for (name, [lo, hi]) in [
                ("load.service_ms", l.service_ms),
                ("load.start_ms", l.start_ms),
            ] {
                if lo > hi || hi == 0 {
                    return Err(format!("{name}: [{lo}, {hi}] is empty"));
                }
            }
            let positive = |v: f64| v.is_finite() && v > 0.0;
            if l.capacity == 0 || !positive(l.base_rps) || !positive(l.target) {
                return Err("load: capacity, base_rps and target must be above 0".into());
            }
            if l.duration_ms() != self.duration_ms {
                return Err("load: duration_ms must be whole seconds".into());
            }
            return Ok(());
        }
        if let Some(w) = &self.warm {
            if self.proxy.is_some() || self.calls.is_some() {
                return Err("[warm] runs alone: no [proxy] or [calls] beside it".into());
            }
            ebb_core::warm::warm_windows(&w.windows, w.max_replicas)
                .map_err(|e| format!("warm.windows: {e}"))?;
            if w.tick_ms == 0 || w.flush_ms == 0 {
                return Err("warm intervals must be above 0".into());
            }
            for (name, [lo, hi]) in [
                ("warm.gap_ms", w.gap_ms),
                ("warm.burst", w.burst),
                ("warm.serve_ms", w.serve_ms),
                ("faults.restart_ms", self.faults.restart_ms),
            ] {
                if lo > hi {
                    return Err(format!("{name}: [{lo}, {hi}] is empty"));
                }
            }
            return Ok(());
        }
        if self.proxy.is_none() && self.calls.is_none() {
            return Err("a scenario needs [proxy], [calls], both, [warm] or [load]".into());
        }
        let mut ranges: Vec<(&str, Range)> = vec![("api.latency_ms", self.api.latency_ms)];
        if self.faults.pause_chance > 0.0 {
            ranges.push(("faults.pause_ms", self.faults.pause_ms));
        }
        if self.faults.crash_per_s > 0.0 || self.faults.torn_write_chance > 0.0 {
            ranges.push(("faults.restart_ms", self.faults.restart_ms));
        }
        if let Some(p) = &self.proxy {
            if p.replicas == 0 {
                return Err("proxy.replicas must be at least 1".into());
            }
            if p.downscale_every_ms == 0 || p.sync_ms == 0 || p.flush_ms == 0 || p.lease_ms == 0 {
                return Err("proxy intervals must be above 0".into());
            }
            // The protocol's promise needs the lag to cover the sync interval, the skew both ways
            // and a bump's round trip.
            let least = p.sync_ms + 2 * p.max_skew_ms + 2 * self.api.latency_ms[1];
            if p.sync_lag_ms < least {
                return Err(format!(
                    "proxy.sync_lag_ms {} is below sync_ms + 2 x max_skew_ms + 2 x the API's highest latency = {least}",
                    p.sync_lag_ms
                ));
            }
            ranges.extend([
                ("proxy.observe_ms", p.observe_ms),
                ("proxy.start_ms", p.start_ms),
                ("proxy.stop_ms", p.stop_ms),
                ("proxy.traffic.gap_ms", p.traffic.gap_ms),
                ("proxy.traffic.burst", p.traffic.burst),
                ("proxy.traffic.spacing_ms", p.traffic.spacing_ms),
                ("proxy.traffic.serve_ms", p.traffic.serve_ms),
                ("proxy.traffic.long_ms", p.traffic.long_ms),
            ]);
        }
        if let Some(c) = &self.calls {
            if c.runners == 0 || c.capacity == 0 {
                return Err("calls.runners and calls.capacity must be at least 1".into());
            }
            ranges.extend([
                ("calls.gap_ms", c.gap_ms),
                ("calls.run_ms", c.run_ms),
                ("calls.restart_ms", c.restart_ms),
            ]);
        }
        for (name, [lo, hi]) in ranges {
            if lo > hi {
                return Err(format!("{name}: [{lo}, {hi}] is not a range (low > high)"));
            }
        }
        for (name, p) in [
            ("api_error_chance", self.faults.api_error_chance),
            ("pause_chance", self.faults.pause_chance),
            ("torn_write_chance", self.faults.torn_write_chance),
            ("runner_crash_chance", self.faults.runner_crash_chance),
            ("lost_reply_chance", self.faults.lost_reply_chance),
            ("duplicate_chance", self.faults.duplicate_chance),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!(
                    "faults.{name}: {p} is not a chance between 0 and 1"
                ));
            }
        }
        Ok(())
    }
}
/// The traces a `[load]` scenario may name (`load::Trace::parse`).
pub const TRACES: [&str; 6] = ["step", "ramp", "spike", "diurnal", "bursts", "sine"];

/// The `[load]` section of a scenario: one route scaled on load by ebb's rule, with the traffic
/// of one of `traces` (picked by the seed), each replica serving `capacity` requests at once and
/// starting within `start_ms`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadScenario {
    /// Trace names: `step`, `ramp`, `spike`, `diurnal`, `bursts`, `sine`.
    pub traces: Vec<String>,
    /// The traces' base rate, requests per second.
    pub base_rps: f64,
    /// A request's service time.
    pub service_ms: Range,
    /// A replica's start time.
    pub start_ms: Range,
    /// Requests one replica serves at once.
    pub capacity: u32,
    /// The target concurrency per replica.
    pub target: f64,
    /// The sine's periods.
    #[serde(default = "five")]
    pub periods: u32,
    /// The run's length in whole seconds, from the scenario's `duration_ms`.
    #[serde(skip)]
    pub seconds: u64,
}

fn five() -> u32 {
    5
}

impl LoadScenario {
    fn duration_ms(&self) -> u64 {
        self.seconds * 1_000
    }
}

/// The `[warm]` section of a scenario.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmScenario {
    /// The route's keep-warm windows, as `ebb.toml` writes them.
    pub windows: Vec<ebb_core::warm::WarmConfig>,
    /// The route's `idle_after_ms`.
    pub idle_after_ms: u64,
    /// The route's `idle_replicas` (absent: 0).
    #[serde(default)]
    pub idle_replicas: Option<u32>,
    /// The route's `max_replicas`.
    pub max_replicas: u32,
    /// How often the loops run (`idle_check_interval_ms`).
    pub tick_ms: u64,
    /// `RequestsSeen` flush interval.
    pub flush_ms: u64,
    /// Idle gap between bursts of requests.
    pub gap_ms: Range,
    /// Requests per burst.
    pub burst: Range,
    /// How long a request stays in flight.
    pub serve_ms: Range,
}
