//! Scaling on load, simulated against its anchor: one route's traffic from a generated trace, its
//! replicas (each serving at most `capacity` requests at once, started after a delay drawn from a
//! range), the proxy's hold queue in front of them, and a policy deciding the count every tick:
//! ebb's ([`ebb_core::scaler::load`], held requests counted, every second) or Knative's KPA (the
//! same rule without them, every two seconds, as KPA's defaults). One seed, one run; the same
//! seed gives both policies the same arrivals and service times.
//!
//! What a run reports ([`Report`]): the time each request waited for a replica (p50, p99), the
//! replica-seconds used (starting, ready and draining replicas all cost), the scale changes per
//! minute and how often the direction reversed. The invariants checked at every decision of
//! ebb's: `load_floor_held`, the count is never below what the requests in flight need at the
//! target (within `max_replicas`); `cold_surge_met`, while no request has ended in the panic
//! window and some are held, the count covers every request in flight and held at the target;
//! `no_scale_down_in_panic`. A scale-down never stops a replica with requests in
//! flight: it drains first.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use ebb_core::scaler::load::{Decider, Figures, Rule, Sample, Settings, Window};

/// The shapes of traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trace {
    /// Base rate, then 50 times it from a tenth of the run on.
    Step,
    /// From nothing to 50 times the base rate, linearly over the run.
    Ramp,
    /// Base rate with a 10-second spike of 50 times it at a third of the run.
    Spike,
    /// A day squeezed into the run: a slow rise and fall between the base rate and 20 times it.
    Diurnal,
    /// Base rate, with bursts of 30 times it lasting 2-5 s, starting at random (seeded).
    Bursts,
    /// A sine between the base rate and 20 times it, `periods` periods in the run.
    Sine,
}

impl Trace {
    /// Every trace.
    pub const ALL: [Trace; 6] = [
        Trace::Step,
        Trace::Ramp,
        Trace::Spike,
        Trace::Diurnal,
        Trace::Bursts,
        Trace::Sine,
    ];

    /// The trace a scenario names (`step`, `ramp`, `spike`, `diurnal`, `bursts`, `sine`).
    pub fn parse(name: &str) -> Result<Trace, String> {
        Ok(match name {
            "step" => Trace::Step,
            "ramp" => Trace::Ramp,
            "spike" => Trace::Spike,
            "diurnal" => Trace::Diurnal,
            "bursts" => Trace::Bursts,
            "sine" => Trace::Sine,
            other => {
                return Err(format!(
                    "unknown trace {other:?}: step, ramp, spike, diurnal, bursts or sine"
                ));
            }
        })
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Trace::Step => "step 1->50x",
            Trace::Ramp => "linear ramp",
            Trace::Spike => "10 s spike",
            Trace::Diurnal => "diurnal",
            Trace::Bursts => "Poisson bursts",
            Trace::Sine => "sine",
        }
    }
}

/// The policies compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// ebb's: held requests are demand; decided every second.
    Ebb,
    /// Knative's KPA with its defaults: decided every 2 s on the averages alone.
    Kpa,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Ebb => "ebb",
            Policy::Kpa => "KPA",
        }
    }

    fn rule(self) -> Rule {
        match self {
            Policy::Ebb => Rule::Ebb,
            Policy::Kpa => Rule::Knative,
        }
    }

    fn tick_ms(self) -> u64 {
        match self {
            Policy::Ebb => 1_000,
            Policy::Kpa => 2_000,
        }
    }
}

/// One run's settings.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub trace: Trace,
    /// Length of the run, s.
    pub seconds: u64,
    /// The trace's base rate, requests per second.
    pub base_rps: f64,
    /// A request's service time, ms (uniform in the range).
    pub service_ms: (u64, u64),
    /// A replica's start time, ms (uniform in the range).
    pub start_ms: (u64, u64),
    /// Requests a replica serves at once at most (the rest wait in the hold queue).
    pub capacity: u32,
    /// The sine's periods.
    pub periods: u32,
    /// The policy's settings (both policies get the same).
    pub settings: Settings,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            trace: Trace::Step,
            seconds: 600,
            base_rps: 4.0,
            service_ms: (200, 600),
            start_ms: (1_000, 4_000),
            capacity: 10,
            periods: 5,
            settings: Settings {
                target: 10.0,
                ..Settings::default()
            },
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub requests: u64,
    /// Wait for a replica, ms: median and 99th percentile.
    pub wait_p50_ms: u64,
    pub wait_p99_ms: u64,
    pub replica_seconds: f64,
    /// Changes of the replicas asked for.
    pub changes: u32,
    /// Changes whose direction differs from the change before.
    pub reversals: u32,
    /// The most replicas asked for.
    pub peak: u32,
    /// Invariant violations (`load_floor_held`), with the time.
    pub violations: Vec<String>,
    /// Requests still waiting or in flight at the end (served past the run).
    pub unfinished: u64,
}

impl Report {
    /// Scale changes per minute.
    pub fn changes_per_minute(&self, seconds: u64) -> f64 {
        f64::from(self.changes) * 60.0 / seconds.max(1) as f64
    }
}

/// The simulation step, ms.
const STEP_MS: u64 = 100;

#[derive(Debug)]
struct Replica {
    /// When it is ready (starting until then).
    ready_at_ms: u64,
    /// When each request it serves ends, and when it began.
    serving: Vec<(u64, u64)>,
    /// Asked to stop: takes nothing new, goes once empty.
    draining: bool,
}

/// The rate of `trace` at `t_ms` of a run of `seconds`.
fn rate(c: &Config, t_ms: u64, bursts: &[(u64, u64)]) -> f64 {
    let run = (c.seconds * 1_000) as f64;
    let x = t_ms as f64 / run;
    let b = c.base_rps;
    match c.trace {
        Trace::Step => {
            if x < 0.1 {
                b
            } else {
                50.0 * b
            }
        }
        Trace::Ramp => 50.0 * b * x,
        Trace::Spike => {
            let start = run / 3.0;
            if (t_ms as f64) >= start && (t_ms as f64) < start + 10_000.0 {
                50.0 * b
            } else {
                b
            }
        }
        Trace::Diurnal => {
            let day = (std::f64::consts::PI * x).sin();
            b + 19.0 * b * day * day
        }
        Trace::Bursts => {
            if bursts.iter().any(|&(s, e)| t_ms >= s && t_ms < e) {
                30.0 * b
            } else {
                b
            }
        }
        Trace::Sine => {
            let phase = 2.0 * std::f64::consts::PI * f64::from(c.periods) * x;
            b + 19.0 * b * (0.5 - 0.5 * phase.cos())
        }
    }
}

/// A Poisson draw with mean `mean` (Knuth's, in pieces for large means).
fn poisson(rng: &mut ChaCha8Rng, mean: f64) -> u64 {
    let mut left = mean;
    let mut n = 0;
    while left > 0.0 {
        let m = left.min(30.0);
        left -= m;
        let limit = (-m).exp();
        let mut p = 1.0;
        loop {
            p *= rng.random::<f64>();
            if p <= limit {
                break;
            }
            n += 1;
        }
    }
    n
}

/// Runs `policy` on `config`'s trace with `seed`.
pub fn run(config: &Config, policy: Policy, seed: u64) -> Report {
    let c = config;
    // Arrivals and service times come from their own generator, so both policies see the same.
    let mut traffic = ChaCha8Rng::seed_from_u64(seed);
    let mut starts = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_0f57_a7e5);
    let end_ms = c.seconds * 1_000;
    let mut bursts = Vec::new();
    if c.trace == Trace::Bursts {
        let mut t = 0;
        while t < end_ms {
            t += traffic.random_range(10_000..60_000);
            let len = traffic.random_range(2_000..5_000);
            bursts.push((t, t + len));
            t += len;
        }
    }
    let mut replicas: Vec<Replica> = Vec::new();
    // Arrival times of the requests waiting for a replica, oldest first.
    let mut held: VecDeque<(u64, u64)> = VecDeque::new();
    let mut waits: Vec<u64> = Vec::new();
    let mut window = Window::default();
    let mut decider = Decider::default();
    let mut report = Report::default();
    let mut desired = 0u32;
    let mut last_direction = 0i8;
    let (mut sum_in_flight, mut sum_held, mut started_in_second, mut steps_in_second) =
        (0.0, 0.0, 0u64, 0u64);
    let (mut arrived_in_second, mut answered_in_second, mut answer_ms_in_second) =
        (0u64, 0u64, 0.0);
    let mut t = 0;
    while t < end_ms {
        t += STEP_MS;
        // Requests end; drained replicas go.
        for r in &mut replicas {
            r.serving.retain(|&(e, began)| {
                if e <= t {
                    answered_in_second += 1;
                    answer_ms_in_second += (t - began) as f64;
                }
                e > t
            });
        }
        replicas.retain(|r| !(r.draining && r.serving.is_empty()));
        // Arrivals.
        let arriving = poisson(&mut traffic, rate(c, t, &bursts) * STEP_MS as f64 / 1_000.0);
        for _ in 0..arriving {
            let service = traffic.random_range(c.service_ms.0..=c.service_ms.1);
            held.push_back((t, service));
            report.requests += 1;
            arrived_in_second += 1;
        }
        // A request meeting no replica wakes the workload at once (both: the activator pokes the
        // autoscaler too).
        if !held.is_empty() && replicas.iter().all(|r| r.draining) && desired == 0 {
            desired = 1;
            report.changes += 1;
            last_direction = 1;
        }
        // Replicas to match `desired`: start more, or drain the idlest (starting ones first).
        let active = replicas.iter().filter(|r| !r.draining).count() as u32;
        if active < desired {
            for _ in active..desired {
                let d = starts.random_range(c.start_ms.0..=c.start_ms.1);
                replicas.push(Replica {
                    ready_at_ms: t + d,
                    serving: Vec::new(),
                    draining: false,
                });
            }
        } else if active > desired {
            let mut extra = active - desired;
            // Starting ones, then ready ones serving the fewest.
            let mut order: Vec<usize> = (0..replicas.len())
                .filter(|&i| !replicas[i].draining)
                .collect();
            order.sort_by_key(|&i| {
                let r = &replicas[i];
                (r.ready_at_ms <= t, r.serving.len())
            });
            for i in order {
                if extra == 0 {
                    break;
                }
                replicas[i].draining = true;
                extra -= 1;
            }
            replicas.retain(|r| !(r.draining && r.serving.is_empty()));
        }
        // Held requests to ready replicas with room, least loaded first.
        while let Some(&(arrived, service)) = held.front() {
            let Some(r) = replicas
                .iter_mut()
                .filter(|r| {
                    !r.draining && r.ready_at_ms <= t && (r.serving.len() as u32) < c.capacity
                })
                .min_by_key(|r| r.serving.len())
            else {
                break;
            };
            held.pop_front();
            r.serving.push((t + service, t));
            waits.push(t - arrived);
            started_in_second += 1;
        }
        let in_flight: usize = replicas.iter().map(|r| r.serving.len()).sum();
        sum_in_flight += in_flight as f64;
        sum_held += held.len() as f64;
        steps_in_second += 1;
        report.replica_seconds += replicas.len() as f64 * STEP_MS as f64 / 1_000.0;
        if t % 1_000 == 0 {
            window.push(Sample {
                at_ms: t,
                in_flight: sum_in_flight / steps_in_second as f64,
                held: sum_held / steps_in_second as f64,
                started: started_in_second,
                arrived: arrived_in_second,
                answered: answered_in_second,
                answer_ms: answer_ms_in_second,
            });
            (sum_in_flight, sum_held, started_in_second, steps_in_second) = (0.0, 0.0, 0, 0);
            (arrived_in_second, answered_in_second, answer_ms_in_second) = (0, 0, 0.0);
            window.trim(t, c.settings.stable_window_ms);
        }
        if t % policy.tick_ms() == 0 {
            let ready = replicas
                .iter()
                .filter(|r| !r.draining && r.ready_at_ms <= t)
                .count() as u32;
            if let Some(f) = Figures::of(
                &window,
                &c.settings,
                t,
                in_flight as f64,
                held.len() as f64,
                policy == Policy::Kpa,
            ) {
                let d = decider.decide(&c.settings, &f, ready, desired, t, policy.rule());
                if policy == Policy::Ebb {
                    let need = (in_flight as f64 / c.settings.target).ceil() as u32;
                    let floor = need.min(c.settings.max_replicas);
                    if d.desired < floor {
                        report.violations.push(format!(
                            "load_floor_held: at {t} ms ebb asked for {} replicas while {in_flight} requests in flight need {floor} at the target",
                            d.desired,
                        ));
                    }
                }
                // A surge no replica has answered yet (no request ended in the panic window):
                // what is in flight and held is the demand, asked for at once.
                if policy == Policy::Ebb && f.demand.is_none() && f.held > 0.0 {
                    let need = ((f.in_flight + f.held) / c.settings.target).ceil() as u32;
                    let need = need.min(c.settings.max_replicas);
                    if d.desired < need {
                        report.violations.push(format!(
                            "cold_surge_met: at {t} ms ebb asked for {} replicas while {} requests in flight and held, none answered yet, need {need} at the target",
                            d.desired,
                            f.in_flight + f.held,
                        ));
                    }
                }
                if policy == Policy::Ebb && d.panicking && d.desired < desired {
                    report.violations.push(format!(
                        "no_scale_down_in_panic: at {t} ms ebb went from {desired} to {} replicas in panic",
                        d.desired,
                    ));
                }
                if d.desired != desired {
                    let direction = if d.desired > desired { 1 } else { -1 };
                    if last_direction != 0 && direction != last_direction {
                        report.reversals += 1;
                    }
                    last_direction = direction;
                    desired = d.desired;
                    report.changes += 1;
                    report.peak = report.peak.max(desired);
                }
            }
        }
    }
    report.unfinished =
        held.len() as u64 + replicas.iter().map(|r| r.serving.len() as u64).sum::<u64>();
    // Requests still held at the end have waited at least until now.
    waits.extend(held.iter().map(|(a, _)| end_ms - a));
    waits.sort_unstable();
    let pct = |p: f64| -> u64 {
        if waits.is_empty() {
            0
        } else {
            waits[((waits.len() - 1) as f64 * p).round() as usize]
        }
    };
    report.wait_p50_ms = pct(0.5);
    report.wait_p99_ms = pct(0.99);
    report
}

/// Runs one seed of a `[load]` scenario: ebb's rule on the trace the seed picks; the first
/// invariant broken is the outcome's violation.
pub fn run_scenario(l: &crate::scenario::LoadScenario, seed: u64) -> crate::world::Outcome {
    use std::hash::Hasher;
    let traces: Vec<Trace> = l
        .traces
        .iter()
        .map(|t| Trace::parse(t).expect("checked when the scenario was read"))
        .collect();
    let trace = traces[(seed % traces.len() as u64) as usize];
    let config = Config {
        trace,
        seconds: l.seconds,
        base_rps: l.base_rps,
        service_ms: (l.service_ms[0], l.service_ms[1]),
        start_ms: (l.start_ms[0], l.start_ms[1]),
        capacity: l.capacity,
        periods: l.periods,
        settings: Settings {
            target: l.target,
            ..Settings::default()
        },
    };
    let r = run(&config, Policy::Ebb, seed);
    let line = format!(
        "{}: {} requests, wait p50 {} ms p99 {} ms, {:.0} replica-s, {} changes, peak {}",
        trace.name(),
        r.requests,
        r.wait_p50_ms,
        r.wait_p99_ms,
        r.replica_seconds,
        r.changes,
        r.peak
    );
    let mut h = fnv::FnvHasher::default();
    h.write(line.as_bytes());
    let violation = r.violations.first().map(|v| {
        let (invariant, detail) = v.split_once(": ").unwrap_or(("load_floor_held", v));
        let at_ms = detail
            .strip_prefix("at ")
            .and_then(|d| d.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        crate::world::Violation {
            invariant: match invariant {
                "no_scale_down_in_panic" => "no_scale_down_in_panic",
                "cold_surge_met" => "cold_surge_met",
                _ => "load_floor_held",
            },
            detail: detail.to_owned(),
            at_ms,
        }
    });
    crate::world::Outcome {
        hash: h.finish(),
        sim_ms: l.seconds * 1_000,
        violation,
        trace: vec![line],
        stats: crate::world::Stats {
            requests: r.requests,
            steps: l.seconds * 1_000 / STEP_MS,
            ..Default::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let c = Config {
            seconds: 120,
            ..Config::default()
        };
        let a = run(&c, Policy::Ebb, 7);
        let b = run(&c, Policy::Ebb, 7);
        assert_eq!(
            (a.requests, a.wait_p99_ms, a.changes),
            (b.requests, b.wait_p99_ms, b.changes)
        );
        // Both policies see the same traffic.
        assert_eq!(run(&c, Policy::Kpa, 7).requests, a.requests);
    }

    #[test]
    fn ebb_holds_its_floor_and_beats_kpa_on_every_trace() {
        // The goal, on the means over seeds as `ebb bench autoscale` prints them: on
        // every trace ebb's p99 wait is at most KPA's, with no more replica-seconds; the sine
        // gives no more reversals than its ups and downs (two a period); ebb never breaks an
        // invariant.
        const SEEDS: u64 = 5;
        for trace in Trace::ALL {
            let c = Config {
                trace,
                ..Config::default()
            };
            let (mut ebb, mut kpa) = (Vec::new(), Vec::new());
            for seed in 0..SEEDS {
                let e = run(&c, Policy::Ebb, seed);
                assert!(
                    e.violations.is_empty(),
                    "{} seed {seed}: {:?}",
                    trace.name(),
                    e.violations
                );
                assert!(e.requests > 0);
                if trace == Trace::Sine {
                    assert!(e.reversals < 2 * c.periods, "{e:?}");
                }
                ebb.push(e);
                kpa.push(run(&c, Policy::Kpa, seed));
            }
            // Sums over the same seeds compare as the means do.
            let sum = |rs: &[Report], f: fn(&Report) -> f64| rs.iter().map(f).sum::<f64>();
            let p99 = |r: &Report| r.wait_p99_ms as f64;
            let seconds = |r: &Report| r.replica_seconds;
            assert!(
                sum(&ebb, p99) <= sum(&kpa, p99),
                "{}: p99 {ebb:?} {kpa:?}",
                trace.name()
            );
            assert!(
                sum(&ebb, seconds) <= sum(&kpa, seconds),
                "{}: replica-seconds {ebb:?} {kpa:?}",
                trace.name()
            );
        }
        // 50 x 4 rps of 400 ms each is 80 in flight, 12 replicas at 70 % of 10: the backlog
        // built while they start is drained, not provisioned for.
        let c = Config {
            trace: Trace::Step,
            seconds: 300,
            ..Config::default()
        };
        let r = run(&c, Policy::Ebb, 1);
        assert!((12..=40).contains(&r.peak), "{r:?}");
    }
}
