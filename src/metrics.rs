//! Prometheus metrics at `/metrics` on the admin listener, in the OpenMetrics text format that
//! prometheus-client encodes (Prometheus reads it).
//!
//! Two sources, so that the proxy's hot path gains no work:
//!
//! * What ebb counts anyway is read when scraped ([`Sources`]): each route's requests, requests in
//!   flight and held (the proxy's per-route atomics), each workload's desired and ready replicas
//!   (the orchestrator), calls by state and the log's last seq (the projection).
//! * What the log decides is counted from its live tail ([`Metrics::follow`]): every event by
//!   type, scale decisions by reason and direction, failed scale operations, cold starts (a wake
//!   from zero) and their duration, from the wake's `ScaleRequested` to its `ScaledUp`.
//!
//! Labels are bounded: event types, reasons and call states are enums; the `route` label is a
//! configured route's name (never a request's Host), for at most `max_routes` routes, the rest
//! summed under `route="_other"`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::event::{Envelope, Event, ScaleReason};
use crate::log::Log;
use crate::orchestrator::Orchestrator;
use crate::proxy::traffic::Traffic;
use crate::state::calls::CallStatus;

/// Default bound of the `route` label's values.
pub const DEFAULT_MAX_ROUTES: usize = 1_000;

/// The label value of the routes past the bound.
pub const OTHER: &str = "_other";

/// Wakes whose `ScaledUp` is awaited at most (older ones are forgotten past it).
const MAX_PENDING_WAKES: usize = 10_000;

/// An event type.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    event: &'static str,
}

/// A scale decision's reason and direction.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScaleLabels {
    reason: &'static str,
    direction: &'static str,
}

/// What is counted from the log's tail.
#[derive(Debug)]
struct Decided {
    events: Family<EventLabels, Counter>,
    scale_decisions: Family<ScaleLabels, Counter>,
    scale_failures: Counter,
    cold_starts: Counter,
    cold_start_seconds: Histogram,
    /// Wakes from zero awaiting their `ScaledUp`: deployment to the wake's time.
    pending_wakes: Mutex<HashMap<String, u64>>,
}

/// ebb's metrics.
pub struct Metrics {
    registry: Registry,
    decided: Arc<Decided>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// What is read when scraped.
#[derive(Clone)]
pub struct Sources {
    /// The log and its projection.
    pub log: Arc<Log>,
    /// The proxy's per-route counters.
    pub traffic: Arc<Traffic>,
    /// The workloads' replicas.
    pub orchestrator: Arc<dyn Orchestrator>,
    /// Routes with a `route` label of their own, at most.
    pub max_routes: usize,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("max_routes", &self.max_routes)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// The metrics over `sources`.
    pub fn new(sources: Sources) -> Metrics {
        let decided = Arc::new(Decided::new());
        let mut registry = Registry::default();
        registry.register(
            "ebb_events",
            "Events appended to the log, by type",
            decided.events.clone(),
        );
        registry.register(
            "ebb_scale_decisions",
            "Decisions to change a workload's replicas, by reason and direction",
            decided.scale_decisions.clone(),
        );
        registry.register(
            "ebb_scale_failures",
            "Scale operations the orchestrator failed",
            decided.scale_failures.clone(),
        );
        registry.register(
            "ebb_cold_starts",
            "Workloads woken from zero replicas by a request",
            decided.cold_starts.clone(),
        );
        registry.register_with_unit(
            "ebb_cold_start_duration",
            "From a wake's decision to its workload's first ready replica",
            Unit::Seconds,
            decided.cold_start_seconds.clone(),
        );
        registry.register_collector(Box::new(Scraped(sources)));
        Metrics { registry, decided }
    }

    /// Counts what the log decides from now on (a task of the current runtime, until the log's
    /// tail ends).
    pub fn follow(self: &Arc<Self>, log: &Log) {
        let mut tail = log.subscribe();
        let decided = self.decided.clone();
        tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                match tail.recv().await {
                    Ok(batch) => batch.iter().for_each(|e| decided.count(e)),
                    // Missed batches are not counted; the counters go on.
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(batches = n, "metrics fell behind the log's tail");
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String does not fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The name of a scale reason, as in the log.
fn reason_name(r: ScaleReason) -> &'static str {
    match r {
        ScaleReason::Wake => "wake",
        ScaleReason::Idle => "idle",
        ScaleReason::Autoscale => "autoscale",
        ScaleReason::Manual => "manual",
        ScaleReason::Restart => "restart",
        ScaleReason::Shutdown => "shutdown",
        ScaleReason::Peer => "peer",
    }
}

impl Decided {
    fn new() -> Decided {
        Decided {
            events: Family::default(),
            scale_decisions: Family::default(),
            scale_failures: Counter::default(),
            cold_starts: Counter::default(),
            // 10 ms to about 164 s.
            cold_start_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 15)),
            pending_wakes: Mutex::new(HashMap::new()),
        }
    }

    fn count(&self, env: &Envelope) {
        self.events
            .get_or_create(&EventLabels {
                event: env.event.name(),
            })
            .inc();
        match &env.event {
            Event::ScaleRequested {
                deployment,
                from,
                to,
                reason,
            } => {
                let direction = if to > from { "up" } else { "down" };
                self.scale_decisions
                    .get_or_create(&ScaleLabels {
                        reason: reason_name(*reason),
                        direction,
                    })
                    .inc();
                if *reason == ScaleReason::Wake && *from == 0 {
                    self.cold_starts.inc();
                    let mut pending = self.pending_wakes.lock().expect("wakes lock");
                    if pending.len() >= MAX_PENDING_WAKES {
                        pending.clear();
                    }
                    pending.insert(deployment.clone(), env.at_ms);
                }
            }
            Event::ScaledUp { deployment, .. } => {
                let woke = self
                    .pending_wakes
                    .lock()
                    .expect("wakes lock")
                    .remove(deployment);
                if let Some(at) = woke {
                    let ms = env.at_ms.saturating_sub(at);
                    self.cold_start_seconds.observe(ms as f64 / 1_000.0);
                }
            }
            Event::ScaleFailed { .. } => {
                self.scale_failures.inc();
            }
            _ => {}
        }
    }
}

/// The metrics read when scraped.
struct Scraped(Sources);

impl std::fmt::Debug for Scraped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// One route's figures.
#[derive(Debug, Default, Clone, Copy)]
struct RouteFigures {
    requests: u64,
    in_flight: u64,
    held: u64,
    desired: u64,
    ready: u64,
}

impl RouteFigures {
    fn add(&mut self, o: RouteFigures) {
        self.requests += o.requests;
        self.in_flight += o.in_flight;
        self.held += o.held;
        self.desired += o.desired;
        self.ready += o.ready;
    }
}

/// Every call state's name, in order.
const CALL_STATES: [(CallStatus, &str); 6] = [
    (CallStatus::Queued, "queued"),
    (CallStatus::Running, "running"),
    (CallStatus::Success, "success"),
    (CallStatus::Error, "error"),
    (CallStatus::Timeout, "timeout"),
    (CallStatus::Cancelled, "cancelled"),
];

impl Scraped {
    /// Each route's figures by label value: the first `max_routes` routes by name, the rest
    /// summed under [`OTHER`].
    fn routes(&self) -> Vec<(String, RouteFigures)> {
        let s = &self.0;
        let mut routes: Vec<(String, String)> = s.log.read(|st| {
            st.routes
                .by_name
                .values()
                .map(|r| (r.spec.name.clone(), r.spec.deployment.clone()))
                .collect()
        });
        routes.sort();
        let mut out: Vec<(String, RouteFigures)> = Vec::new();
        let mut other: Option<RouteFigures> = None;
        for (i, (name, deployment)) in routes.into_iter().enumerate() {
            let t = s.traffic.route(&name);
            let o = s.orchestrator.observe(&deployment).unwrap_or_default();
            let f = RouteFigures {
                requests: t.served(),
                in_flight: t.in_flight(),
                held: t.held() as u64,
                desired: o.desired as u64,
                ready: o.ready.len() as u64,
            };
            if i < s.max_routes {
                out.push((name, f));
            } else {
                other.get_or_insert_with(RouteFigures::default).add(f);
            }
        }
        if let Some(f) = other {
            out.push((OTHER.to_owned(), f));
        }
        out
    }
}

/// Encodes one family of values by route.
fn by_route<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    values: impl Iterator<Item = (String, M)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (route, v) in values {
        let labels = [("route", route)];
        v.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Scraped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let routes = self.routes();
        let routes = &routes;
        let counter = move |f: fn(&RouteFigures) -> u64| {
            routes
                .iter()
                .map(move |(r, v)| (r.clone(), ConstCounter::new(f(v))))
        };
        let gauge = move |f: fn(&RouteFigures) -> u64| {
            routes
                .iter()
                .map(move |(r, v)| (r.clone(), ConstGauge::new(f(v) as i64)))
        };
        by_route(
            &mut encoder,
            "ebb_proxy_requests",
            "Requests the proxy took for a route.",
            MetricType::Counter,
            counter(|f| f.requests),
        )?;
        by_route(
            &mut encoder,
            "ebb_proxy_requests_in_flight",
            "Requests of a route under way (held ones included).",
            MetricType::Gauge,
            gauge(|f| f.in_flight),
        )?;
        by_route(
            &mut encoder,
            "ebb_proxy_requests_held",
            "Requests of a route waiting for a replica.",
            MetricType::Gauge,
            gauge(|f| f.held),
        )?;
        by_route(
            &mut encoder,
            "ebb_workload_replicas_desired",
            "Replicas asked of a route's workload.",
            MetricType::Gauge,
            gauge(|f| f.desired),
        )?;
        by_route(
            &mut encoder,
            "ebb_workload_replicas_ready",
            "Ready replicas of a route's workload.",
            MetricType::Gauge,
            gauge(|f| f.ready),
        )?;

        let (calls, seq) = self.0.log.read(|st| {
            let mut n = [0u64; CALL_STATES.len()];
            for c in st.calls.by_id.values() {
                if let Some(i) = CALL_STATES.iter().position(|(s, _)| *s == c.status) {
                    n[i] += 1;
                }
            }
            (n, st.seq)
        });
        let mut family = encoder.encode_descriptor(
            "ebb_calls",
            "Calls the log keeps, by state (ended ones until the retention forgets them).",
            None,
            MetricType::Gauge,
        )?;
        for ((_, state), n) in CALL_STATES.iter().zip(calls) {
            let labels = [("state", *state)];
            ConstGauge::new(n as i64).encode(family.encode_family(&labels)?)?;
        }
        let seq_gauge = ConstGauge::new(seq as i64);
        seq_gauge.encode(encoder.encode_descriptor(
            "ebb_log_last_seq",
            "The seq of the log's last event.",
            None,
            seq_gauge.metric_type(),
        )?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Envelope;

    fn env(seq: u64, at_ms: u64, event: Event) -> Envelope {
        Envelope {
            seq,
            at_ms,
            version: crate::event::SCHEMA_VERSION,
            event,
        }
    }

    #[test]
    fn decisions_are_counted_by_type_reason_and_direction_with_cold_start_time() {
        let d = Decided::new();
        let wake = Event::ScaleRequested {
            deployment: "demo".into(),
            from: 0,
            to: 1,
            reason: ScaleReason::Wake,
        };
        d.count(&env(1, 1_000, wake));
        d.count(&env(
            2,
            1_250,
            Event::ScaledUp {
                deployment: "demo".into(),
                replicas: 1,
            },
        ));
        d.count(&env(
            3,
            9_000,
            Event::ScaleRequested {
                deployment: "demo".into(),
                from: 1,
                to: 0,
                reason: ScaleReason::Idle,
            },
        ));
        d.count(&env(
            4,
            9_001,
            Event::ScaleFailed {
                deployment: "demo".into(),
                to: 0,
                error: "x".into(),
            },
        ));
        let label = |reason, direction| ScaleLabels { reason, direction };
        assert_eq!(
            d.scale_decisions.get_or_create(&label("wake", "up")).get(),
            1
        );
        assert_eq!(
            d.scale_decisions
                .get_or_create(&label("idle", "down"))
                .get(),
            1
        );
        assert_eq!(d.cold_starts.get(), 1);
        assert_eq!(d.scale_failures.get(), 1);
        let requested = EventLabels {
            event: "ScaleRequested",
        };
        assert_eq!(d.events.get_or_create(&requested).get(), 2);
        assert!(d.pending_wakes.lock().unwrap().is_empty());
        let mut text = String::new();
        let mut r = Registry::default();
        r.register_with_unit("t", "t", Unit::Seconds, d.cold_start_seconds.clone());
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        assert!(text.contains("t_seconds_sum 0.25"), "{text}");
        assert!(text.contains("t_seconds_count 1"), "{text}");
    }
}
