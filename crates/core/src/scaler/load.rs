//! Scaling on load: how many replicas a route's workload needs for the traffic it has, between
//! waking from zero and going back to zero. Pure: figures sampled by the proxy come in, a desired
//! count comes out with the figures that made it, so the event that records a change can say why.
//!
//! The rule is Knative's KPA (`pkg/autoscaler/scaling/autoscaler.go`), written anew:
//!
//! * Two averages of the load, over a **stable window** (default 60 s) and a **panic window** (10 %
//!   of it, 6 s). Each asks for `ceil(load / (target × utilization))` replicas, kept within what the
//!   scale rates allow from the replicas ready now (up: at most `max_up_rate` times them, down: at
//!   least a `max_down_rate`-th of them).
//! * **Panic** when the panic window asks for at least `panic_threshold` times the replicas ready;
//!   it lasts until a whole stable window has passed without that. While panicking the count is the
//!   larger of the two windows' and never goes down.
//! * A **scale-down delay**: the count is the highest asked for over the delay.
//!
//! Where ebb knows more than Knative's autoscaler, it uses it: requests the proxy holds for a
//! replica (a cold start, or every replica at its concurrency) are demand no replica sees yet.
//! Knative's activator reports them as requests in flight, so a backlog built while replicas
//! start inflates its averages and it provisions for the backlog. ebb keeps them out of the
//! averages and reads the traffic's flow instead ([`Figures::demand`]): the arrival rate times
//! the time a replica takes to answer (measured by the proxy), plus the concurrency that drains
//! the held requests within a third of the panic window. While any request is held the panic
//! figure is at least that demand, so a surge asks for its replicas within a second, and no more
//! than it needs. Outside a panic, the count moves only where both windows agree it should: up
//! no further than the lower of the two asks, down no further than the higher. Knative follows
//! the stable window alone, which lags the load by half a window: on a rising load, when a
//! panic ends, it drops to what the load was half a minute ago and climbs back; past a peak it
//! goes on adding replicas the load no longer needs. And the count never drops below what the
//! requests in flight need at the target. `ebb bench autoscale` runs both rules in the
//! simulator (`ebb_sim::load`).
//!
//! [`Window`] keeps the per-second samples the averages are taken over (bounded by the longest
//! stable window); [`Decider`] keeps the panic and the delay between decisions.

use std::collections::VecDeque;

pub use crate::event::Metric;

/// A route's settings for scaling on load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    pub metric: Metric,
    /// Load per replica aimed at (requests in flight, or requests per second), > 0.
    pub target: f64,
    /// The share of `target` a replica is planned to run at, in (0, 1] (Knative: 0.7).
    pub utilization: f64,
    /// The stable window, ms.
    pub stable_window_ms: u64,
    /// The panic window, ms (at most the stable window).
    pub panic_window_ms: u64,
    /// Panic when the panic window asks for this many times the replicas ready (2.0).
    pub panic_threshold: f64,
    /// At most this many times the replicas ready in one decision (1000).
    pub max_up_rate: f64,
    /// At least the replicas ready divided by this in one decision (2).
    pub max_down_rate: f64,
    /// A lower count is taken only once it has been asked for this long, ms (0: at once).
    pub scale_down_delay_ms: u64,
    /// The route's bounds.
    pub min_replicas: u32,
    pub max_replicas: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            metric: Metric::Concurrency,
            target: 100.0,
            utilization: 0.7,
            stable_window_ms: 60_000,
            panic_window_ms: 6_000,
            panic_threshold: 2.0,
            max_up_rate: 1000.0,
            max_down_rate: 2.0,
            scale_down_delay_ms: 0,
            min_replicas: 0,
            max_replicas: u32::MAX,
        }
    }
}

/// The longest stable window a route may have, ms (an hour, as Knative's).
pub const MAX_STABLE_WINDOW_MS: u64 = 3_600_000;
/// The shortest stable window, ms (Knative's).
pub const MIN_STABLE_WINDOW_MS: u64 = 6_000;
/// How often the load is sampled, ms.
pub const SAMPLE_MS: u64 = 1_000;

impl Settings {
    /// Why these settings cannot be used, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        if !(self.target.is_finite() && self.target > 0.0) {
            return Err(format!("the target must be above 0, not {}", self.target));
        }
        if !(self.utilization > 0.0 && self.utilization <= 1.0) {
            return Err(format!(
                "the target utilization must be within 1..100 %, not {} %",
                self.utilization * 100.0
            ));
        }
        if !(MIN_STABLE_WINDOW_MS..=MAX_STABLE_WINDOW_MS).contains(&self.stable_window_ms) {
            return Err(format!(
                "the window must be within 6 s and 1 h, not {} ms",
                self.stable_window_ms
            ));
        }
        if self.panic_window_ms < SAMPLE_MS || self.panic_window_ms > self.stable_window_ms {
            return Err(format!(
                "the panic window must be within 1 s and the window ({} ms), not {} ms",
                self.stable_window_ms, self.panic_window_ms
            ));
        }
        if !(self.panic_threshold.is_finite() && self.panic_threshold > 1.0) {
            return Err(format!(
                "the panic threshold must be above 100 %, not {} %",
                self.panic_threshold * 100.0
            ));
        }
        if !(self.max_up_rate.is_finite() && self.max_up_rate > 1.0) {
            return Err(format!(
                "the scale-up rate must be above 1, not {}",
                self.max_up_rate
            ));
        }
        if !(self.max_down_rate.is_finite() && self.max_down_rate > 1.0) {
            return Err(format!(
                "the scale-down rate must be above 1, not {}",
                self.max_down_rate
            ));
        }
        if self.min_replicas > self.max_replicas {
            return Err(format!(
                "min replicas {} is above max replicas {}",
                self.min_replicas, self.max_replicas
            ));
        }
        Ok(())
    }

    /// The load one replica is planned for.
    pub fn per_replica(&self) -> f64 {
        self.target * self.utilization
    }
}

impl Settings {
    /// The settings `spec` writes for a route with bounds `min_replicas..=max_replicas`, or why
    /// they cannot be used.
    pub fn of(
        spec: &crate::event::LoadSpec,
        min_replicas: u32,
        max_replicas: u32,
    ) -> Result<Settings, String> {
        let this = spec;
        let (metric, target) = match (this.target_concurrency, this.target_rps) {
            (Some(c), None) => (Metric::Concurrency, c),
            (None, Some(r)) => (Metric::Rps, r),
            (None, None) => {
                return Err("load scaling needs target_concurrency or target_rps".into());
            }
            (Some(_), Some(_)) => {
                return Err("load scaling takes target_concurrency or target_rps, not both".into());
            }
        };
        for (name, v) in [
            ("utilization_pct", this.utilization_pct),
            ("panic_window_pct", this.panic_window_pct),
            ("panic_threshold_pct", this.panic_threshold_pct),
            ("max_scale_up_rate", this.max_scale_up_rate),
            ("max_scale_down_rate", this.max_scale_down_rate),
        ] {
            if !v.is_finite() {
                return Err(format!("{name} must be a number, not {v}"));
            }
        }
        if !(1.0..=100.0).contains(&this.panic_window_pct) {
            return Err(format!(
                "panic_window_pct must be within 1 and 100, not {}",
                this.panic_window_pct
            ));
        }
        let panic_window_ms =
            ((this.window_ms as f64 * this.panic_window_pct / 100.0).round() as u64).max(SAMPLE_MS);
        let settings = Settings {
            metric,
            target,
            utilization: this.utilization_pct / 100.0,
            stable_window_ms: this.window_ms,
            panic_window_ms: panic_window_ms.min(this.window_ms),
            panic_threshold: this.panic_threshold_pct / 100.0,
            max_up_rate: this.max_scale_up_rate,
            max_down_rate: this.max_scale_down_rate,
            scale_down_delay_ms: this.scale_down_delay_ms,
            min_replicas,
            max_replicas,
        };
        settings.check()?;
        if max_replicas <= 1 {
            return Err(format!(
                "load scaling moves between min and max replicas: max replicas is {max_replicas}, set it above 1"
            ));
        }
        Ok(settings)
    }
}

/// One second of a route's load, summed over the ebb replicas that saw it.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// When the second ended, ms.
    pub at_ms: u64,
    /// Requests in flight to a replica, averaged over the second.
    pub in_flight: f64,
    /// Requests held for a replica, averaged over the second.
    pub held: f64,
    /// Requests that started in the second.
    pub started: u64,
    /// Requests that arrived in the second (started at once, or held).
    pub arrived: u64,
    /// Requests a replica answered in the second, and the sum of their answer times (from the
    /// replica being picked to its answer), ms: the time a request keeps a replica busy.
    #[serde(default)]
    pub answered: u64,
    #[serde(default)]
    pub answer_ms: f64,
}

/// The samples of one route, newest last, at most a longest stable window of them.
#[derive(Debug, Clone, Default)]
pub struct Window {
    samples: VecDeque<Sample>,
}

/// Samples a window keeps at most.
pub const MAX_SAMPLES: usize = (MAX_STABLE_WINDOW_MS / SAMPLE_MS) as usize;

impl Window {
    /// Adds a sample (one older than the newest is dropped: time only goes on).
    pub fn push(&mut self, s: Sample) {
        if self.samples.back().is_some_and(|b| b.at_ms >= s.at_ms) {
            return;
        }
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(s);
    }

    /// Drops the samples older than `keep_ms` before `now_ms`.
    pub fn trim(&mut self, now_ms: u64, keep_ms: u64) {
        let from = now_ms.saturating_sub(keep_ms);
        while self.samples.front().is_some_and(|s| s.at_ms <= from) {
            self.samples.pop_front();
        }
    }

    /// Samples kept.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// No sample kept.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The newest sample.
    pub fn newest(&self) -> Option<&Sample> {
        self.samples.back()
    }

    /// The average load over the `window_ms` before `now_ms` in `metric`, or `None` when no
    /// sample falls in it. Seconds with no sample count as no load, from the window's oldest
    /// sample on (a window that just began is averaged over what it has).
    pub fn average(&self, metric: Metric, now_ms: u64, window_ms: u64) -> Option<f64> {
        self.average_of(metric, now_ms, window_ms, true)
    }

    /// [`Window::average`], the held requests counted in the concurrency or not.
    pub fn average_of(
        &self,
        metric: Metric,
        now_ms: u64,
        window_ms: u64,
        with_held: bool,
    ) -> Option<f64> {
        let from = now_ms.saturating_sub(window_ms);
        let inside = self
            .samples
            .iter()
            .rev()
            .take_while(|s| s.at_ms > from)
            .filter(|s| s.at_ms <= now_ms);
        let mut sum = 0.0;
        let mut oldest = None;
        for s in inside {
            sum += match metric {
                Metric::Concurrency => s.in_flight + if with_held { s.held } else { 0.0 },
                Metric::Rps => s.started as f64,
            };
            oldest = Some(s.at_ms);
        }
        let oldest = oldest?;
        // The seconds from the oldest sample's start to now.
        let seconds = (now_ms.saturating_sub(oldest) / SAMPLE_MS + 1).max(1);
        Some(sum / seconds as f64)
    }
}

impl Window {
    /// Over the `window_ms` before `now_ms`: requests arrived per second, and the mean time a
    /// replica took to answer one, s (`None` until a replica answered). The time is measured,
    /// not inferred: Little's law over a window (the requests in flight over those finished)
    /// takes a second when a replica just began on a backlog for many, and asks for replicas
    /// nobody needs.
    pub fn flow(&self, now_ms: u64, window_ms: u64) -> (f64, Option<f64>) {
        let from = now_ms.saturating_sub(window_ms);
        let (mut arrived, mut answered, mut answer_ms, mut n) = (0u64, 0u64, 0.0, 0u64);
        for s in self
            .samples
            .iter()
            .rev()
            .take_while(|s| s.at_ms > from)
            .filter(|s| s.at_ms <= now_ms)
        {
            arrived += s.arrived;
            answered += s.answered;
            answer_ms += s.answer_ms;
            n += 1;
        }
        if n == 0 {
            return (0.0, None);
        }
        let seconds = n as f64 * SAMPLE_MS as f64 / 1_000.0;
        let service = (answered > 0).then(|| answer_ms / answered as f64 / 1_000.0);
        (arrived as f64 / seconds, service)
    }
}

/// What a decision is taken on.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Figures {
    /// The stable window's average load.
    pub stable: f64,
    /// The panic window's average load.
    pub panic: f64,
    /// Requests in flight right now.
    pub in_flight: f64,
    /// Requests held right now.
    pub held: f64,
    /// The concurrency the traffic needs now, from its flow: the arrival rate times the time a
    /// replica takes to answer, plus what drains the held requests within a third of the panic
    /// window (`None` before a replica answered in the panic window: then the requests in
    /// flight and held are the demand).
    pub demand: Option<f64>,
}

impl Figures {
    /// The figures of `window` at `now_ms` for `settings`, with the demand now; `None` before
    /// any sample. `held_in_averages`: whether held requests count in the averages as requests
    /// in flight (Knative's activator reports them so); ebb counts them through the flow instead
    /// (`demand`), so a backlog built while replicas start is drained, not provisioned for.
    pub fn of(
        window: &Window,
        settings: &Settings,
        now_ms: u64,
        in_flight: f64,
        held: f64,
        held_in_averages: bool,
    ) -> Option<Self> {
        let (rate, service) = window.flow(now_ms, settings.panic_window_ms);
        let drain_s = (settings.panic_window_ms as f64 / 3_000.0).max(1.0);
        let demand = service.map(|s| match settings.metric {
            Metric::Concurrency => rate * s + held * s / drain_s,
            Metric::Rps => rate + held / drain_s,
        });
        Some(Figures {
            stable: window.average_of(
                settings.metric,
                now_ms,
                settings.stable_window_ms,
                held_in_averages,
            )?,
            panic: window.average_of(
                settings.metric,
                now_ms,
                settings.panic_window_ms,
                held_in_averages,
            )?,
            in_flight,
            held,
            demand,
        })
    }

    /// The demand now: from the flow, else what is in flight and held.
    pub fn now(&self) -> f64 {
        self.demand.unwrap_or(self.in_flight + self.held)
    }
}

/// What a decision found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Replicas wanted.
    pub desired: u32,
    /// Whether the route is in panic.
    pub panicking: bool,
    /// The load the count was decided on (the panic window's while panicking, else the stable
    /// window's), and per replica ready.
    pub load: f64,
    pub per_replica: f64,
    /// The window `load` was averaged over, ms.
    pub window_ms: u64,
}

impl Decision {
    /// What the log keeps of it, with the settings, the replicas ready and the requests held it
    /// was taken with.
    pub fn why(&self, settings: &Settings, ready: u32, held: f64) -> crate::event::LoadWhy {
        let milli = |v: f64| (v.max(0.0) * 1000.0).round() as u64;
        crate::event::LoadWhy {
            metric: settings.metric,
            per_replica_milli: milli(self.per_replica),
            target_milli: milli(settings.target),
            utilization_pct: (settings.utilization * 100.0).round() as u32,
            window_ms: self.window_ms,
            panic: self.panicking,
            ready,
            held: held.max(0.0).round() as u32,
        }
    }
}

/// Whose rule a decision follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// ebb's: held requests are demand, a change needs both windows' agreement, and never fewer
    /// replicas than the requests in flight need at the target.
    Ebb,
    /// Knative's KPA as it is (the simulator's anchor).
    Knative,
}

/// What a route's decisions remember between them: the panic, and the counts asked for within
/// the scale-down delay.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decider {
    /// When the panic window last asked for the panic threshold's replicas (`None`: calm).
    panic_seen_ms: Option<u64>,
    /// The most replicas asked for during this panic.
    panic_max: u32,
    /// The counts asked for within the scale-down delay, newest last (bounded by the delay's
    /// samples).
    recent: VecDeque<(u64, u32)>,
}

/// Ceil of `load / per_replica`, as a replica count.
fn replicas_for(load: f64, per_replica: f64) -> f64 {
    if load <= 0.0 {
        0.0
    } else {
        (load / per_replica).ceil()
    }
}

impl Decider {
    /// Whether the route is in panic.
    pub fn panicking(&self) -> bool {
        self.panic_seen_ms.is_some()
    }

    /// The replicas `settings` ask for given `figures`, with `ready` replicas ready now and
    /// `asked` asked for, at `now_ms`, by `rule`.
    pub fn decide(
        &mut self,
        settings: &Settings,
        figures: &Figures,
        ready: u32,
        asked: u32,
        now_ms: u64,
        rule: Rule,
    ) -> Decision {
        let ebb = rule == Rule::Ebb;
        let counts_held =
            ebb && !crate::mutation::active(crate::mutation::Mutation::LoadIgnoresHeld);
        let per = settings.per_replica();
        let base = f64::from(ready.max(1));
        let max_up = (settings.max_up_rate * base).ceil();
        let max_down = (base / settings.max_down_rate).floor();
        // Requests held now are demand the averages have not caught up with: while any is held,
        // the panic figure is at least the demand now.
        let panic_load = if counts_held && figures.held > 0.0 {
            figures.panic.max(figures.now())
        } else {
            figures.panic
        };
        let stable_wanted = replicas_for(figures.stable, per);
        let panic_wanted = replicas_for(panic_load, per);
        let bound = |n: f64| n.max(max_down).min(max_up);
        let stable = bound(stable_wanted) as u32;
        let panic = bound(panic_wanted) as u32;
        let over = panic_wanted / base >= settings.panic_threshold;
        if over {
            self.panic_seen_ms = Some(now_ms);
        } else if let Some(seen) = self.panic_seen_ms
            && now_ms.saturating_sub(seen) >= settings.stable_window_ms
        {
            self.panic_seen_ms = None;
            self.panic_max = 0;
        }
        let mut desired = stable;
        let (load, window_ms) = if self.panicking() {
            desired = desired.max(panic);
            if !crate::mutation::active(crate::mutation::Mutation::ScaleDownInPanic) {
                desired = desired.max(self.panic_max);
            }
            self.panic_max = desired;
            (panic_load, settings.panic_window_ms)
        } else if counts_held && figures.held > 0.0 {
            // A request held is demand even below the panic threshold: a cold start with two
            // requests held asks for a replica, however low the averages (more than that, without
            // a panic, is the stable window's to ask: following each brief hold up and back down
            // would flap).
            desired = desired.max(1);
            (figures.stable, settings.stable_window_ms)
        } else {
            (figures.stable, settings.stable_window_ms)
        };
        if ebb && !self.panicking() && asked > 0 {
            // Calm, the count moves only where both windows agree: up to the lower of their
            // asks, down to the higher.
            if desired > asked {
                desired = if panic > asked {
                    desired.min(panic)
                } else {
                    asked
                };
            } else if desired < asked {
                desired = if panic < asked {
                    desired.max(panic)
                } else {
                    asked
                };
            }
        }
        // ebb waits at least a panic window before it takes a lower count: noise in the load
        // does not flap the count.
        let delay = settings.scale_down_delay_ms;
        if delay > 0 {
            while self
                .recent
                .front()
                .is_some_and(|(at, _)| at.saturating_add(delay) <= now_ms)
            {
                self.recent.pop_front();
            }
            if self.recent.len() >= MAX_SAMPLES {
                self.recent.pop_front();
            }
            self.recent.push_back((now_ms, desired));
            desired = self.recent.iter().map(|(_, d)| *d).max().unwrap_or(desired);
        }
        if ebb {
            // Never fewer than the requests in flight need at the target itself.
            desired = desired.max(replicas_for(figures.in_flight, settings.target) as u32);
        }
        let desired = desired.clamp(settings.min_replicas, settings.max_replicas);
        Decision {
            desired,
            panicking: self.panicking(),
            load,
            per_replica: load / base,
            window_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(target: f64) -> Settings {
        Settings {
            target,
            utilization: 1.0,
            ..Settings::default()
        }
    }

    fn figures(stable: f64, panic: f64) -> Figures {
        Figures {
            stable,
            panic,
            in_flight: panic,
            held: 0.0,
            demand: None,
        }
    }

    #[test]
    fn the_stable_window_sets_the_count_within_the_scale_rates() {
        let s = settings(10.0);
        let mut d = Decider::default();
        // 35 in flight on 4 replicas: 4 wanted, calm.
        let x = d.decide(&s, &figures(35.0, 35.0), 4, 4, 1_000, Rule::Ebb);
        assert_eq!((x.desired, x.panicking), (4, false));
        // Load gone: at most halved per decision.
        let x = d.decide(&s, &figures(0.0, 0.0), 4, 4, 2_000, Rule::Ebb);
        assert_eq!(x.desired, 2);
        // Utilization plans for headroom: 35 at 70 % of 10 is 5 replicas.
        let s70 = Settings {
            utilization: 0.7,
            ..s
        };
        let x = Decider::default().decide(&s70, &figures(35.0, 35.0), 5, 5, 1_000, Rule::Ebb);
        assert_eq!(x.desired, 5);
    }

    #[test]
    fn panic_begins_at_the_threshold_never_scales_down_and_ends_a_stable_window_later() {
        let s = settings(10.0);
        let mut d = Decider::default();
        // The panic window asks for 5 on 2 ready: panic, 5.
        let x = d.decide(&s, &figures(12.0, 50.0), 2, 2, 10_000, Rule::Ebb);
        assert_eq!((x.desired, x.panicking), (5, true));
        assert_eq!(x.window_ms, s.panic_window_ms);
        // The burst passes: still panicking, no scale-down.
        let x = d.decide(&s, &figures(12.0, 5.0), 5, 5, 20_000, Rule::Ebb);
        assert_eq!((x.desired, x.panicking), (5, true));
        // A stable window after it was last over the threshold: calm, down to the stable count.
        let x = d.decide(&s, &figures(12.0, 5.0), 5, 5, 70_000, Rule::Ebb);
        assert_eq!((x.desired, x.panicking), (2, false));
    }

    #[test]
    fn held_requests_ask_for_their_replicas_at_once() {
        let s = settings(4.0);
        // A cold surge: 40 requests held, the panic window's average has seen one second of it.
        let f = Figures {
            stable: 40.0 / 60.0,
            panic: 40.0 / 6.0,
            in_flight: 0.0,
            held: 40.0,
            demand: None,
        };
        let ebb = Decider::default().decide(&s, &f, 0, 0, 1_000, Rule::Ebb);
        let kpa = Decider::default().decide(&s, &f, 0, 0, 1_000, Rule::Knative);
        assert_eq!(ebb.desired, 10);
        assert_eq!(kpa.desired, 2);
        assert!(ebb.panicking && kpa.panicking);
    }

    #[test]
    fn the_flow_asks_for_what_the_traffic_needs_not_for_the_backlog_at_once() {
        let s = settings(10.0);
        // 200 requests a second of 0.4 s each need 80 in flight; 500 held drain within the
        // panic window with 33 more: 12 replicas, not the 51 the held count alone would ask.
        let f = Figures {
            stable: 20.0,
            panic: 90.0,
            in_flight: 10.0,
            held: 500.0,
            demand: Some(200.0 * 0.4 + 500.0 * 0.4 / 6.0),
        };
        let x = Decider::default().decide(&s, &f, 1, 1, 1_000, Rule::Ebb);
        assert_eq!(x.desired, 12);
    }

    #[test]
    fn calm_the_count_moves_only_where_both_windows_agree() {
        let s = settings(10.0);
        // Rising: the stable window (half a window behind) asks for 2, the panic window for 4
        // (not twice the 3 ready: calm), 25 in flight now. Knative drops to 2 and must climb
        // back; ebb stays.
        let rising = Figures {
            in_flight: 25.0,
            ..figures(15.0, 35.0)
        };
        let kpa = Decider::default().decide(&s, &rising, 3, 3, 1_000, Rule::Knative);
        let ebb = Decider::default().decide(&s, &rising, 3, 3, 1_000, Rule::Ebb);
        assert_eq!((kpa.desired, ebb.desired), (2, 3));
        // Past a peak: the stable window still asks for more, the panic window for fewer.
        let falling = figures(45.0, 25.0);
        let kpa = Decider::default().decide(&s, &falling, 4, 4, 1_000, Rule::Knative);
        let ebb = Decider::default().decide(&s, &falling, 4, 4, 1_000, Rule::Ebb);
        assert_eq!((kpa.desired, ebb.desired), (5, 4));
        // Both up: to the lower ask; both down: to the higher.
        let up = Figures {
            in_flight: 50.0,
            ..figures(55.0, 65.0)
        };
        assert_eq!(
            Decider::default()
                .decide(&s, &up, 4, 4, 1_000, Rule::Ebb)
                .desired,
            6
        );
        let down = figures(25.0, 15.0);
        assert_eq!(
            Decider::default()
                .decide(&s, &down, 4, 4, 1_000, Rule::Ebb)
                .desired,
            3
        );
    }

    #[test]
    fn a_scale_down_waits_out_its_delay() {
        let s = Settings {
            scale_down_delay_ms: 30_000,
            ..settings(10.0)
        };
        let mut d = Decider::default();
        assert_eq!(
            d.decide(&s, &figures(60.0, 60.0), 6, 6, 0, Rule::Ebb)
                .desired,
            6
        );
        assert_eq!(
            d.decide(&s, &figures(30.0, 30.0), 6, 6, 10_000, Rule::Ebb)
                .desired,
            6
        );
        assert_eq!(
            d.decide(&s, &figures(30.0, 30.0), 6, 6, 29_000, Rule::Ebb)
                .desired,
            6
        );
        assert_eq!(
            d.decide(&s, &figures(30.0, 30.0), 6, 6, 31_000, Rule::Ebb)
                .desired,
            3
        );
    }

    #[test]
    fn the_bounds_hold() {
        let s = Settings {
            min_replicas: 2,
            max_replicas: 3,
            ..settings(1.0)
        };
        let mut d = Decider::default();
        assert_eq!(
            d.decide(&s, &figures(100.0, 100.0), 3, 3, 0, Rule::Ebb)
                .desired,
            3
        );
        let mut d = Decider::default();
        assert_eq!(
            d.decide(&s, &figures(0.0, 0.0), 3, 3, 0, Rule::Ebb).desired,
            2
        );
    }

    #[test]
    fn a_window_averages_over_its_seconds_and_is_bounded() {
        let mut w = Window::default();
        for i in 1..=10u64 {
            w.push(Sample {
                at_ms: i * 1_000,
                in_flight: i as f64,
                held: 1.0,
                started: 2,
                arrived: 3,
                answered: 2,
                answer_ms: 900.0,
            });
        }
        // The last 3 s: 8, 9, 10 in flight, 1 held each.
        assert_eq!(w.average(Metric::Concurrency, 10_000, 3_000), Some(10.0));
        assert_eq!(w.average(Metric::Rps, 10_000, 3_000), Some(2.0));
        // Two quiet seconds since: they count as no load.
        assert_eq!(w.average(Metric::Rps, 12_000, 5_000), Some(6.0 / 5.0));
        assert_eq!(w.average(Metric::Concurrency, 100_000, 3_000), None);
        // The flow of the last 3 s: 3 arrivals a second; 6 answers in 2.7 s, 450 ms each.
        assert_eq!(w.flow(10_000, 3_000), (3.0, Some(0.45)));
        assert_eq!(w.flow(100_000, 3_000), (0.0, None));
        // Time does not go back.
        w.push(Sample {
            at_ms: 5_000,
            ..Sample::default()
        });
        assert_eq!(w.len(), 10);
        for i in 0..(MAX_SAMPLES as u64 + 10) {
            w.push(Sample {
                at_ms: 20_000 + i * 1_000,
                ..Sample::default()
            });
        }
        assert_eq!(w.len(), MAX_SAMPLES);
        w.trim(20_000 + (MAX_SAMPLES as u64 + 9) * 1_000, 60_000);
        assert_eq!(w.len(), 60);
    }

    #[test]
    fn bad_settings_are_refused_with_why() {
        assert!(Settings::default().check().is_ok());
        for (bad, why) in [
            (
                Settings {
                    target: 0.0,
                    ..Settings::default()
                },
                "target",
            ),
            (
                Settings {
                    utilization: 1.5,
                    ..Settings::default()
                },
                "utilization",
            ),
            (
                Settings {
                    stable_window_ms: 1_000,
                    ..Settings::default()
                },
                "window",
            ),
            (
                Settings {
                    panic_window_ms: 90_000,
                    ..Settings::default()
                },
                "panic window",
            ),
            (
                Settings {
                    panic_threshold: 1.0,
                    ..Settings::default()
                },
                "panic threshold",
            ),
            (
                Settings {
                    min_replicas: 3,
                    max_replicas: 2,
                    ..Settings::default()
                },
                "min replicas",
            ),
        ] {
            let e = bad.check().unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }
}
