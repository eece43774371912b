//! Prometheus metrics at `/metrics` on the admin listener, in the OpenMetrics text format that
//! prometheus-client encodes (Prometheus reads it).
//!
//! Two sources, so that the proxy's hot path gains no work:
//!
//! * What ebb counts anyway is read when scraped ([`Sources`]): each route's requests, requests in
//!   flight and held, answers by status class and answer times (the proxy's per-route atomics,
//!   `RouteTraffic`), each workload's desired and ready replicas (the orchestrator), calls by
//!   state and the log's last seq (the projection), the queue's depth, running instances per
//!   function and the snapshot's age.
//! * What the log decides is counted from its live tail ([`Metrics::follow`]): every event by
//!   type, scale decisions by reason and direction, failed scale operations, cold starts (a wake
//!   from zero) and their duration, from the wake's `ScaleRequested` to its `ScaledUp` (pending
//!   wakes bounded); enqueue-to-start, from `CallQueued` to `CallStarted` (pending calls
//!   bounded); calls ended by state; instances by function; cleaner evaluations, firings and
//!   their lateness (from the upsert's creation time and TTL); events per durable batch.
//!
//! The proxy's hold time is observed where a request found no free replica, off the fast path.
//!
//! Labels are bounded: event types, reasons and call states are enums; the `route` label is a
//! configured route's name (never a request's Host), for at most `max_routes` routes
//! (`--metrics-max-routes`, which bounds the `function` label too), the rest summed under
//! `route="_other"`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::event::{Envelope, Event, ScaleReason};
use crate::log::Log;
use crate::orchestrator::Orchestrator;
use crate::proxy::traffic::{AnswerExemplar, AnswerTimes, TraceExemplar, Traffic};
use crate::state::Tally;
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
    /// From a call's enqueue to its accepted start; a traced call's wait is its bucket's
    /// exemplar.
    queue_wait_seconds: HistogramWithExemplars<TraceExemplar>,
    /// Calls queued and not yet started: id to the enqueue's time and the trace the call is
    /// part of, if any (bounded).
    pending_calls: Mutex<HashMap<String, (u64, Option<String>)>>,
    /// Calls that ended, by how.
    calls_ended: Family<EndLabels, Counter>,
    /// Instances started, by function (the label bounded like routes).
    invocations: Family<FunctionLabels, Counter>,
    /// CEL evaluations made by cleaners, and cleaners fired.
    cleaner_evaluations: Counter,
    cleaner_firings: Counter,
    /// From a cleaner's TTL passing to its firing.
    cleaner_lateness_seconds: Histogram,
    /// Each cleaner's uid, creation time and TTL (by name; removed when it is deleted).
    cleaner_due: Mutex<HashMap<String, (String, u64, u64)>>,
    /// Functions with a label of their own.
    functions_seen: Mutex<std::collections::HashSet<String>>,
    /// Events per durable batch the log's tail delivered.
    batch_events: Histogram,
    /// The label bound of `invocations`.
    max_functions: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FunctionLabels {
    function: String,
}

/// Calls awaiting their start that the enqueue-to-start histogram remembers, at most.
const MAX_PENDING_CALLS: usize = 100_000;

/// ebb's metrics.
pub struct Metrics {
    registry: Registry,
    decided: Arc<Decided>,
    /// The answer-time exemplars of the last scrape, by route label (see [`with_exemplars`]).
    exemplars: Exemplars,
}

/// Each route label's answer-time exemplars, bucket by bucket, as the last scrape read them.
type Exemplars = Arc<Mutex<Vec<(String, Vec<Option<AnswerExemplar>>)>>>;

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
    /// Routes with a `route` label of their own, at most (functions too).
    pub max_routes: usize,
    /// The call queue, for its depth.
    pub queue: Option<Arc<dyn crate::queue::Queue>>,
    /// Scaling on load: what its last decisions found (on the replica that decides).
    pub load: Option<Arc<crate::proxy::load::LoadScaler>>,
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
        let decided = Arc::new(Decided::new(sources.max_routes));
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
        registry.register_with_unit(
            "ebb_proxy_hold_duration",
            "How long requests that found no free replica were held (woken or refused after)",
            Unit::Seconds,
            sources.traffic.hold.clone(),
        );
        registry.register_with_unit(
            "ebb_call_queue_wait",
            "From a call's enqueue to its accepted start",
            Unit::Seconds,
            decided.queue_wait_seconds.clone(),
        );
        registry.register(
            "ebb_calls_ended",
            "Calls that reached a final state, by state",
            decided.calls_ended.clone(),
        );
        registry.register(
            "ebb_function_invocations",
            "Function instances started, by function (the label bounded by --metrics-max-routes)",
            decided.invocations.clone(),
        );
        registry.register(
            "ebb_cleaner_evaluations",
            "CEL evaluations cleaners made",
            decided.cleaner_evaluations.clone(),
        );
        registry.register(
            "ebb_cleaner_firings",
            "Cleaners that fired",
            decided.cleaner_firings.clone(),
        );
        registry.register_with_unit(
            "ebb_cleaner_firing_lateness",
            "From a cleaner's TTL passing to its firing",
            Unit::Seconds,
            decided.cleaner_lateness_seconds.clone(),
        );
        registry.register_with_unit(
            "ebb_log_sync_duration",
            "How long each sync of the log to disk took",
            Unit::Seconds,
            sources.log.sync_durations().clone(),
        );
        registry.register(
            "ebb_log_batch_events",
            "Events per durable batch of the log",
            decided.batch_events.clone(),
        );
        let exemplars = Exemplars::default();
        registry.register_collector(Box::new(Scraped(sources, exemplars.clone())));
        Metrics {
            registry,
            decided,
            exemplars,
        }
    }

    /// Counts what the log decides from now on (a task of the current runtime, until the log's
    /// tail ends).
    pub fn follow(self: &Arc<Self>, log: &Log) {
        let mut tail = log.subscribe();
        let decided = self.decided.clone();
        // What is already under way when the following starts: calls waiting for their start
        // and cleaners waiting for their firing (the tail repeats whatever lands meanwhile).
        log.read(|s| {
            let mut calls = decided.pending_calls.lock().expect("calls lock");
            for id in s
                .calls
                .queued_in_order()
                .into_iter()
                .take(MAX_PENDING_CALLS)
            {
                if let Some(c) = s.calls.get(id) {
                    calls.insert(id.to_owned(), (c.created_at_ms, trace_id(&c.spec)));
                }
            }
            let mut due = decided.cleaner_due.lock().expect("cleaners lock");
            for c in s.cleaners.by_name.values() {
                due.insert(
                    c.spec.name.clone(),
                    (c.spec.uid.clone(), c.created_at_ms, c.spec.ttl_ms),
                );
            }
        });
        tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                match tail.recv().await {
                    Ok(batch) => {
                        decided.batch_events.observe(batch.len() as f64);
                        batch.iter().for_each(|e| decided.count(e));
                    }
                    // Missed batches are not counted; the counters go on.
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(batches = n, "metrics fell behind the log's tail");
                        // Their starts may be among the missed events: never observed now.
                        decided.pending_calls.lock().expect("calls lock").clear();
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
        let exemplars = self.exemplars.lock().expect("exemplars lock").clone();
        if exemplars.is_empty() {
            return out;
        }
        with_exemplars(&out, &exemplars)
    }
}

impl Decided {
    fn new(max_functions: usize) -> Decided {
        Decided {
            queue_wait_seconds: HistogramWithExemplars::new(exponential_buckets(0.001, 4.0, 12)),
            pending_calls: Mutex::new(HashMap::new()),
            calls_ended: Family::default(),
            invocations: Family::default(),
            cleaner_evaluations: Counter::default(),
            cleaner_firings: Counter::default(),
            cleaner_lateness_seconds: Histogram::new(exponential_buckets(0.1, 4.0, 10)),
            cleaner_due: Mutex::new(HashMap::new()),
            functions_seen: Mutex::new(std::collections::HashSet::new()),
            batch_events: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            max_functions,
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
                        reason: reason.name(),
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
            Event::CallQueued { call } => {
                let mut pending = self.pending_calls.lock().expect("calls lock");
                if pending.len() < MAX_PENDING_CALLS {
                    pending.insert(call.id.clone(), (env.at_ms, trace_id(call)));
                }
            }
            Event::CallStarted { id, .. } => {
                let queued = self.pending_calls.lock().expect("calls lock").remove(id);
                if let Some((at, trace)) = queued {
                    let ms = env.at_ms.saturating_sub(at);
                    let exemplar = trace.map(|trace_id| TraceExemplar { trace_id });
                    self.queue_wait_seconds
                        .observe(ms as f64 / 1_000.0, exemplar, None);
                }
            }
            Event::CallFinished { id, outcome, .. } => {
                self.pending_calls.lock().expect("calls lock").remove(id);
                let state = match outcome {
                    crate::event::Outcome::Success => "success",
                    crate::event::Outcome::Error => "error",
                };
                self.calls_ended.get_or_create(&EndLabels { state }).inc();
            }
            Event::CallRejected {
                id,
                reason: crate::event::RejectReason::AlreadyRunning,
                ..
            } => {
                // A second start of a running call ends it as an error.
                self.pending_calls.lock().expect("calls lock").remove(id);
                let state = "error";
                self.calls_ended.get_or_create(&EndLabels { state }).inc();
            }
            Event::CallTimedOut { id } | Event::CallCancelled { id } => {
                self.pending_calls.lock().expect("calls lock").remove(id);
                let state = if matches!(env.event, Event::CallTimedOut { .. }) {
                    "timeout"
                } else {
                    "cancelled"
                };
                self.calls_ended.get_or_create(&EndLabels { state }).inc();
            }
            Event::InstanceCreated { template, .. } => {
                let function = {
                    let mut seen = self.functions_seen.lock().expect("functions lock");
                    if seen.contains(template) || seen.len() < self.max_functions {
                        seen.insert(template.clone());
                        template.clone()
                    } else {
                        OTHER.to_owned()
                    }
                };
                self.invocations
                    .get_or_create(&FunctionLabels { function })
                    .inc();
            }
            Event::CleanerUpserted { cleaner } => {
                let created = if cleaner.created_at_ms == 0 {
                    env.at_ms
                } else {
                    cleaner.created_at_ms
                };
                // A changed cleaner keeps the time it was first created; one created again
                // (another uid) starts anew.
                let mut due = self.cleaner_due.lock().expect("cleaners lock");
                let d =
                    due.entry(cleaner.name.clone())
                        .or_insert((cleaner.uid.clone(), created, 0));
                if d.0 != cleaner.uid {
                    *d = (cleaner.uid.clone(), created, 0);
                }
                d.2 = cleaner.ttl_ms;
            }
            Event::CleanerEvaluated { evaluations, .. } => {
                self.cleaner_evaluations.inc_by(u64::from(*evaluations));
            }
            Event::CleanerFired { name } => {
                self.cleaner_firings.inc();
                if let Some((_, created, ttl)) =
                    self.cleaner_due.lock().expect("cleaners lock").get(name)
                {
                    let ms = env.at_ms.saturating_sub(created.saturating_add(*ttl));
                    self.cleaner_lateness_seconds.observe(ms as f64 / 1_000.0);
                }
            }
            Event::CleanerDeleted { name } => {
                self.cleaner_due.lock().expect("cleaners lock").remove(name);
            }
            _ => {}
        }
    }
}

/// The metrics read when scraped, and where the answer-time exemplars they read go.
struct Scraped(Sources, Exemplars);

impl std::fmt::Debug for Scraped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// One route's figures.
#[derive(Debug, Clone)]
struct RouteFigures {
    requests: u64,
    in_flight: u64,
    held: u64,
    desired: u64,
    ready: u64,
    /// Answers by status class, 1xx to 5xx.
    classes: [u64; 5],
    times: AnswerTimes,
    /// Timeouts by kind ([`crate::proxy::traffic::Timeout`]).
    timeouts: [u64; 4],
}

impl RouteFigures {
    fn add(&mut self, o: &RouteFigures) {
        self.requests += o.requests;
        self.in_flight += o.in_flight;
        self.held += o.held;
        self.desired += o.desired;
        self.ready += o.ready;
        for (a, b) in self.classes.iter_mut().zip(o.classes) {
            *a += b;
        }
        for (a, b) in self.timeouts.iter_mut().zip(o.timeouts) {
            *a += b;
        }
        self.times.add(&o.times);
    }
}

/// A gauge of how many there are (saturating at `i64::MAX`, a gauge's range).
fn count_gauge(n: impl TryInto<i64>) -> ConstGauge {
    ConstGauge::new(n.try_into().unwrap_or(i64::MAX))
}

/// The trace a call is part of, when it was enqueued with a sampled trace context (traces on).
fn trace_id(call: &crate::event::CallSpec) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    let cx = crate::proxy::trace::parent_of(call.trace.as_deref()?);
    let span = cx.span();
    let sc = span.span_context();
    (sc.is_valid() && sc.is_sampled()).then(|| sc.trace_id().to_string())
}

/// The answer-time histogram's family, whose bucket lines get exemplars.
const ANSWER_BUCKET: &str = "ebb_proxy_response_duration_seconds_bucket{";

/// `text` with each answer-time bucket's exemplar after its line: `# {trace_id="…"} value
/// timestamp`, as OpenMetrics writes one.
///
/// prometheus-client 0.26 builds an exemplar only inside its `HistogramWithExemplars`, which
/// takes a write lock on every observation; the proxy's answer times are atomics that never
/// lock. So the exemplars, kept apart and written only for traced answers, are added to the
/// encoded text: a bucket line is found by its route label and its place among that route's
/// buckets, which the encoder writes in order (the family and the route's labels are what
/// this reads of the text, checked against the encoder by the unit test).
fn with_exemplars(text: &str, exemplars: &[(String, Vec<Option<AnswerExemplar>>)]) -> String {
    let escaped: Vec<(String, &[Option<AnswerExemplar>])> = exemplars
        .iter()
        .map(|(route, e)| (label_value(route), e.as_slice()))
        .collect();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut out = String::with_capacity(text.len() + exemplars.len() * 512);
    for line in text.split_inclusive('\n') {
        let exemplar = line
            .strip_prefix(ANSWER_BUCKET)
            .and_then(|labels| label(labels, "route"))
            .and_then(|route| {
                let (_, buckets) = escaped.iter().find(|(r, _)| r == route)?;
                let i = seen.entry(route).or_default();
                let e = buckets.get(*i)?.as_ref();
                *i += 1;
                e
            });
        match exemplar {
            Some(e) => {
                let at = e.at_ms as f64 / 1e3;
                out.push_str(line.trim_end_matches('\n'));
                out.push_str(&format!(
                    " # {{trace_id=\"{}\"}} {} {at:.3}\n",
                    label_value(&e.trace_id),
                    e.seconds
                ));
            }
            None => out.push_str(line),
        }
    }
    out
}

/// The value of label `name`, as written (escaped), in `labels`: a line's text after its `{`.
fn label<'a>(mut labels: &'a str, name: &str) -> Option<&'a str> {
    loop {
        let (key, rest) = labels.split_once("=\"")?;
        // The value ends at the first quote that no backslash escapes.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in rest.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        if key == name {
            return Some(&rest[..end]);
        }
        labels = rest[end + 1..].strip_prefix(',')?;
    }
}

/// A label value as OpenMetrics writes it: `\`, `"` and newlines escaped.
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A histogram read from atomics when scraped.
#[derive(Debug)]
struct ReadHistogram<'a>(&'a AnswerTimes);

impl EncodeMetric for ReadHistogram<'_> {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            self.0.sum_s,
            self.0.count,
            &self.0.buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

impl Scraped {
    /// Seconds of events since the newest snapshot (its last event's time to the log's last);
    /// `None` before the first snapshot.
    fn snapshot_age_s(&self) -> Option<i64> {
        let store = self.0.log.store();
        let snap = *store.snapshot_seqs().ok()?.last()?;
        let at = |seq: u64| -> Option<u64> {
            let bytes = store.get(seq).ok()??;
            Some(crate::log::decode_at(seq, &bytes).ok()?.at_ms)
        };
        let last = self.0.log.read(|s| s.at_ms);
        // The snapshot's own event may be compacted away: then the log starts just after it.
        let snap_at = at(snap).or_else(|| at(snap + 1))?;
        Some((last.saturating_sub(snap_at) / 1_000) as i64)
    }

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
                classes: t.classes(),
                times: t.answer_times(),
                timeouts: t.timeouts(),
            };
            if i < s.max_routes {
                out.push((name, f));
            } else {
                match &mut other {
                    Some(o) => o.add(&f),
                    None => other = Some(f),
                }
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

impl Scraped {
    /// Scaling on load, per route with a label of its own: the windows' load, the target per
    /// replica, the replicas the rule wants and whether it panics (the replica that decides
    /// has them; the others show none).
    fn encode_load(
        &self,
        encoder: &mut DescriptorEncoder,
        routes: &[(String, RouteFigures)],
    ) -> Result<(), std::fmt::Error> {
        let views: Vec<crate::proxy::load::View> = self
            .0
            .load
            .as_ref()
            .map(|l| l.views().into_values().collect())
            .unwrap_or_default();
        let views: Vec<_> = views
            .into_iter()
            .filter(|v| routes.iter().any(|(r, _)| *r == v.route))
            .collect();
        let mut family = encoder.encode_descriptor(
            "ebb_load_observed",
            "A route's load as scaling on load averaged it, over its stable and panic windows (requests in flight, or per second, for all ebb replicas).",
            None,
            MetricType::Gauge,
        )?;
        for v in &views {
            for (window, value) in [("stable", v.stable), ("panic", v.panic)] {
                let labels = [
                    ("route", v.route.as_str()),
                    ("metric", v.metric),
                    ("window", window),
                ];
                ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "ebb_load_target",
            "The load one replica of a route is planned for: its target times its utilization.",
            None,
            MetricType::Gauge,
        )?;
        for v in &views {
            let labels = [("route", v.route.as_str()), ("metric", v.metric)];
            ConstGauge::new(v.target * v.utilization).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "ebb_load_replicas_wanted",
            "Replicas scaling on load wants for a route's workload now.",
            None,
            MetricType::Gauge,
        )?;
        for v in &views {
            let labels = [("route", v.route.as_str())];
            ConstGauge::new(i64::from(v.desired)).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "ebb_load_panic",
            "1 while a route's scaling on load is in panic (the panic window decides, nothing scales down).",
            None,
            MetricType::Gauge,
        )?;
        for v in &views {
            let labels = [("route", v.route.as_str())];
            ConstGauge::new(i64::from(v.panicking)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
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
        let mut family = encoder.encode_descriptor(
            "ebb_trace_spans",
            "Spans ended while traces are on (OTEL_*), by what became of them: exported, dropped (the export queue was full) or lost (their export failed).",
            None,
            MetricType::Counter,
        )?;
        let spans = crate::telemetry::spans();
        for (outcome, n) in [
            ("exported", spans.exported),
            ("dropped_queue_full", spans.queue_full),
            ("export_failed", spans.export_failed),
        ] {
            ConstCounter::new(n).encode(family.encode_family(&[("outcome", outcome)])?)?;
        }
        let (requests, calls) = crate::calls::start_requests();
        for (name, help, n) in [
            (
                "ebb_call_start_requests",
                "Start requests served (a runner's, or one another replica forwarded).",
                requests,
            ),
            (
                "ebb_call_start_request_calls",
                "Calls the start requests asked to start: over ebb_call_start_requests, how many calls runners start at once.",
                calls,
            ),
        ] {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(n).encode(family)?;
        }
        let mut family = encoder.encode_descriptor(
            "ebb_limit_refusals",
            "What a limit refused (or stopped), by the limit's setting.",
            None,
            MetricType::Counter,
        )?;
        for limit in crate::limits::Limit::ALL {
            let labels = [("limit", limit.name())];
            ConstCounter::new(limit.hits()).encode(family.encode_family(&labels)?)?;
        }
        let relay = crate::proxy::relay::totals();
        let family = encoder.encode_descriptor(
            "ebb_tcp_relay_connections",
            "TCP route connections whose bytes the io_uring relay threads move now (--tcp-relay-threads).",
            None,
            MetricType::Gauge,
        )?;
        count_gauge(relay.open).encode(family)?;
        let mut family = encoder.encode_descriptor(
            "ebb_tcp_relay_dry_receives",
            "Receives of the TCP relay threads that found their buffer ring empty (every buffer held by bytes waiting on slow readers), by what they did: waited for bytes, or took a heap buffer for bytes waiting.",
            None,
            MetricType::Counter,
        )?;
        for (then, n) in [
            ("waited", relay.dry_waits),
            ("heap_buffer", relay.heap_receives),
        ] {
            ConstCounter::new(n).encode(family.encode_family(&[("then", then)])?)?;
        }
        let (open, opened) = crate::proxy::h2c_connections();
        let family = encoder.encode_descriptor(
            "ebb_h2c_replica_connections",
            "HTTP/2 connections to replicas open now (gRPC calls, h2c destinations): one or more per replica and proxy thread, another opened when a replica's stream limit fills those open.",
            None,
            MetricType::Gauge,
        )?;
        count_gauge(open).encode(family)?;
        let family = encoder.encode_descriptor(
            "ebb_h2c_replica_connections_opened",
            "HTTP/2 connections to replicas opened since the start.",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(opened).encode(family)?;
        let mut family = encoder.encode_descriptor(
            "ebb_proxy_responses",
            "Answers to a route's requests by status class (ebb's own refusals included).",
            None,
            MetricType::Counter,
        )?;
        for (route, f) in routes {
            for (i, n) in f.classes.iter().enumerate() {
                let class = ["1xx", "2xx", "3xx", "4xx", "5xx"][i];
                let labels = [("route", route.as_str()), ("code_class", class)];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "ebb_proxy_timeouts",
            "A route's requests and connections cut by a timeout, by kind (hold, response, stream_idle, connection_idle).",
            None,
            MetricType::Counter,
        )?;
        for (route, f) in routes {
            for (kind, n) in crate::proxy::traffic::Timeout::ALL.iter().zip(f.timeouts) {
                let labels = [("route", route.as_str()), ("kind", kind.name())];
                ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "ebb_proxy_response_duration",
            "From a replica being picked for a request to its answer's head.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        let mut exemplars = Vec::new();
        for (route, f) in routes {
            let labels = [("route", route.as_str())];
            ReadHistogram(&f.times).encode(family.encode_family(&labels)?)?;
            if f.times.exemplars.iter().any(Option::is_some) {
                exemplars.push((route.clone(), f.times.exemplars.clone()));
            }
        }
        *self.1.lock().expect("exemplars lock") = exemplars;
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
        self.encode_load(&mut encoder, routes)?;

        // One look under the log's read lock for the calls' states and what the retention holds.
        let (calls, seq, ended_calls, ended_instances, gone) = self.0.log.read(|st| {
            (
                st.calls.count_by_status(),
                st.seq,
                st.calls.ended.tally(),
                st.functions.ended.tally(),
                st.calls.gone.len() as u64,
            )
        });
        let mut family = encoder.encode_descriptor(
            "ebb_calls",
            "Calls the log keeps, by state (ended ones until the retention forgets them).",
            None,
            MetricType::Gauge,
        )?;
        for (state, n) in CallStatus::ALL.iter().zip(calls) {
            let labels = [("state", state.name())];
            ConstGauge::new(n as i64).encode(family.encode_family(&labels)?)?;
        }
        // What the retention's bounds hold to (`--call-retention-count`, `--call-retention-bytes`).
        for (name, help, pick) in [
            (
                "ebb_retention_ended",
                "Ended calls and function instances the log's projection keeps readable.",
                (|t: Tally| t.count) as fn(Tally) -> u64,
            ),
            (
                "ebb_retention_ended_bytes",
                "About how much memory they take (payloads, results, logs, fixed size).",
                |t: Tally| t.bytes,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (kind, t) in [("call", ended_calls), ("instance", ended_instances)] {
                let labels = [("kind", kind)];
                count_gauge(pick(t)).encode(family.encode_family(&labels)?)?;
            }
        }
        let family = encoder.encode_descriptor(
            "ebb_retention_gone_calls",
            "Forgotten calls whose id and final state stay while a message of theirs may be read again.",
            None,
            MetricType::Gauge,
        )?;
        count_gauge(gone).encode(family)?;
        if let Some(q) = &self.0.queue {
            let stats = q.stats();
            let mut family = encoder.encode_descriptor(
                "ebb_queue_messages",
                "Call messages on the queue: waiting for a runner, or handed to one.",
                None,
                MetricType::Gauge,
            )?;
            for (state, n) in [("ready", stats.ready), ("reserved", stats.reserved)] {
                let labels = [("state", state)];
                ConstGauge::new(n as i64).encode(family.encode_family(&labels)?)?;
            }
            let mut family = encoder.encode_descriptor(
                "ebb_queue_partitions_moved",
                "Kafka partitions the consumer group's rebalances gave this replica's runners' consumers (assigned: each consumer's first assignment too) or took from them (revoked); a call on a partition that moves waits for its next consumer.",
                None,
                MetricType::Counter,
            )?;
            for (way, n) in [
                ("assigned", stats.partitions_assigned),
                ("revoked", stats.partitions_revoked),
            ] {
                ConstCounter::new(n).encode(family.encode_family(&[("way", way)])?)?;
            }
        }
        // Per function: instances under way and the autoscaler's call counter.
        let functions = self.0.log.read(|st| {
            let mut by: std::collections::BTreeMap<&str, (i64, i64)> = st
                .functions
                .templates
                .keys()
                .map(|k| (k.as_str(), (0, st.counters.value(k) as i64)))
                .collect();
            for id in &st.functions.running {
                if let Some(i) = st.functions.instances.get(id)
                    && let Some(n) = by.get_mut(i.template.as_str())
                {
                    n.0 += 1;
                }
            }
            let mut out: Vec<(String, (i64, i64))> = Vec::new();
            let mut other: Option<(i64, i64)> = None;
            for (i, (name, n)) in by.into_iter().enumerate() {
                if i < self.0.max_routes {
                    out.push((name.to_owned(), n));
                } else {
                    let o = other.get_or_insert((0, 0));
                    o.0 += n.0;
                    o.1 += n.1;
                }
            }
            out.extend(other.map(|n| (OTHER.to_owned(), n)));
            out
        });
        for (name, help, pick) in [
            (
                "ebb_function_instances_running",
                "Function instances under way, by function.",
                (|n: &(i64, i64)| n.0) as fn(&(i64, i64)) -> i64,
            ),
            (
                "ebb_function_counter",
                "The autoscaler's call counter of a function (it decays while idle).",
                |n: &(i64, i64)| n.1,
            ),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (function, n) in &functions {
                let labels = [("function", function.as_str())];
                ConstGauge::new(pick(n)).encode(family.encode_family(&labels)?)?;
            }
        }
        if let Some(age) = self.snapshot_age_s() {
            let g = ConstGauge::new(age);
            g.encode(encoder.encode_descriptor(
                "ebb_log_snapshot_age_seconds",
                "Time from the newest snapshot's last event to the log's last event.",
                None,
                g.metric_type(),
            )?)?;
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
        let d = Decided::new(1_000);
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

    /// Two routes' answer times as the scrape encodes them, one with a traced answer.
    #[derive(Debug)]
    struct TwoRoutes(AnswerTimes, AnswerTimes);

    impl Collector for TwoRoutes {
        fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            let mut family = encoder.encode_descriptor(
                "ebb_proxy_response_duration",
                "t",
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?;
            for (route, t) in [("a\"b", &self.0), ("c", &self.1)] {
                ReadHistogram(t).encode(family.encode_family(&[("route", route)])?)?;
            }
            Ok(())
        }
    }

    #[test]
    fn a_traced_answer_is_its_buckets_exemplar_and_the_text_stays_the_same_otherwise() {
        let traffic = Traffic::default();
        let (a, c) = (traffic.route("a\"b"), traffic.route("c"));
        a.answered(200, Some(300));
        a.answered(200, Some(400));
        a.exemplar(
            400,
            "4bf92f3577b34da6a3ce929d0e0e4736".into(),
            1_700_000_000_123,
        );
        a.answered(200, Some(7_000_000));
        a.exemplar(
            7_000_000,
            "00f067aa0ba902b700f067aa0ba902b7".into(),
            1_700_000_001_000,
        );
        c.answered(200, Some(100));
        let (ta, tc) = (a.answer_times(), c.answer_times());
        let mut r = Registry::default();
        r.register_collector(Box::new(TwoRoutes(ta.clone(), tc.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();

        let with = with_exemplars(&text, &[("a\"b".into(), ta.exemplars.clone())]);
        let exemplars: Vec<&str> = with.lines().filter(|l| l.contains(" # {")).collect();
        assert_eq!(exemplars.len(), 2, "{with}");
        assert!(
            exemplars[0].starts_with(
                r#"ebb_proxy_response_duration_seconds_bucket{le="0.0005",route="a\"b"} 2 # {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 0.0004 1700000000.123"#
            ),
            "{with}"
        );
        assert!(
            exemplars[1].starts_with(
                r#"ebb_proxy_response_duration_seconds_bucket{le="+Inf",route="a\"b"} 3 # {trace_id="00f067aa0ba902b700f067aa0ba902b7"} 7 1700000001.000"#
            ),
            "{with}"
        );
        // Everything else is the encoder's text, line for line.
        let without: Vec<String> = with
            .lines()
            .map(|l| l.split(" # {").next().unwrap().to_owned())
            .collect();
        assert_eq!(without, text.lines().collect::<Vec<_>>());
        assert!(with.ends_with("# EOF\n"), "{with}");
        assert_eq!(with_exemplars(&text, &[]), text);
    }
}
