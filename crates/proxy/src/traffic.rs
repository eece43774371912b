//! In-memory traffic per route: requests in flight (held ones included), requests since the last
//! flush, and the newest request time. The hot path only touches atomics; the flusher turns the
//! counts into `RequestsSeen` aggregates.
//!
//! [`RouteTraffic`] also holds what `/metrics` reads when scraped: the request counter the flusher
//! swaps plus what it has flushed (a monotonic total), answers by status class and a histogram of
//! the time from a pick to the answer's head (three relaxed additions per answer, to counters of
//! the thread's own, with the time the picker already measured: no lock, no extra clock read,
//! no cache line shared between the proxy threads; a sampled request's answer also
//! becomes its bucket's exemplar, [`RouteTraffic::exemplar`]), and the timeouts each route's
//! requests met ([`Timeout`]). The hold time is observed where a request found no free replica,
//! off the fast path ([`Traffic::observe_hold`]). A TCP connection's end marks the route's last
//! use ([`RouteTraffic::touch`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Traffic of every route this proxy has served.
#[derive(Debug)]
pub struct Traffic {
    routes: RwLock<HashMap<String, Arc<RouteTraffic>>>,
    /// How long held requests waited for a replica (`ebb_proxy_hold_duration_seconds`); only
    /// requests that found no free replica are observed, off the fast path. A traced request's
    /// wait is its bucket's exemplar, with its trace id.
    pub hold: prometheus_client::metrics::exemplar::HistogramWithExemplars<TraceExemplar>,
}

/// An exemplar's labels: the trace of the request it was observed for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct TraceExemplar {
    pub trace_id: String,
}

/// Buckets of the hold time, in seconds: a wake takes tens of milliseconds for a local process
/// and seconds for a pod.
pub const HOLD_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// One route's traffic.
#[derive(Debug, Default)]
pub struct RouteTraffic {
    in_flight: AtomicU64,
    held: AtomicU32,
    requests: AtomicU64,
    /// Requests taken by the flusher so far (with `requests`: every request since the start).
    flushed: AtomicU64,
    last_at_ms: AtomicU64,
    waking: std::sync::atomic::AtomicBool,
    /// The span of the wake under way (its `scale` span), when it is traced: the requests held
    /// for it link to it.
    wake_span: std::sync::Mutex<Option<opentelemetry::trace::SpanContext>>,
    /// Answers by status class and the replicas' answer times.
    answers: Answers,
    /// Requests and connections cut by a timeout, by [`Timeout`].
    timeouts: [AtomicU64; 4],
}

/// The timeouts a route's requests and connections can meet (`ebb_proxy_timeouts_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timeout {
    /// No ready replica within `hold_timeout_ms` (503 `wake_timeout` / `replicas_busy`).
    Hold = 0,
    /// The replica did not begin its answer within `response_timeout_ms` (504).
    Response = 1,
    /// A request under way moved no byte for `stream_idle_timeout_ms` (504 or a close).
    StreamIdle = 2,
    /// A client or upgraded connection sat idle for `connection_idle_timeout_ms`.
    ConnectionIdle = 3,
}

impl Timeout {
    /// Every kind, in label order.
    pub const ALL: [Timeout; 4] = [
        Timeout::Hold,
        Timeout::Response,
        Timeout::StreamIdle,
        Timeout::ConnectionIdle,
    ];

    /// The `kind` label.
    pub fn name(self) -> &'static str {
        match self {
            Timeout::Hold => "hold",
            Timeout::Response => "response",
            Timeout::StreamIdle => "stream_idle",
            Timeout::ConnectionIdle => "connection_idle",
        }
    }
}

/// Upper bounds of the answer-time buckets, in microseconds (one more bucket above them all).
pub const ANSWER_BOUNDS_US: [u64; 12] = [
    250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000, 5_000_000,
];

/// The answer-time bucket of `us`.
fn answer_bucket(us: u64) -> usize {
    ANSWER_BOUNDS_US
        .iter()
        .position(|b| us <= *b)
        .unwrap_or(ANSWER_BOUNDS_US.len())
}

/// Shards of a route's answer counters: each thread adds to one of its own (a thread's first
/// answer picks it), and a read sums them. One set of counters shared by the proxy threads had
/// every answer move its cache lines from core to core.
const ANSWER_SHARDS: usize = 8;

/// The shard of this thread's answers.
fn answer_shard() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % ANSWER_SHARDS;
    }
    SHARD.with(|s| *s)
}

/// One shard of a route's answer counters, on cache lines of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct AnswerCounts {
    /// 1xx to 5xx.
    classes: [AtomicU64; 5],
    /// Answers from replicas by time bucket; the last counts those above every bound.
    buckets: [AtomicU64; ANSWER_BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
}

/// A route's answers: a counter per status class and a histogram of the time from a replica
/// being picked to its answer's head, kept in atomics (three relaxed additions per answer, to
/// the thread's shard).
#[derive(Debug, Default)]
struct Answers {
    shards: [AnswerCounts; ANSWER_SHARDS],
    /// Per bucket, the newest traced answer in it: its exemplar. Only a sampled request writes
    /// one (a lock per traced answer); the others never touch these.
    exemplars: [std::sync::Mutex<Option<AnswerExemplar>>; ANSWER_BOUNDS_US.len() + 1],
}

impl Answers {
    /// One counter summed over the shards.
    fn sum(&self, counter: impl Fn(&AnswerCounts) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .map(|a| counter(a).load(Ordering::Relaxed))
            .sum()
    }
}

/// A traced answer kept as its time bucket's exemplar: the trace it belongs to, the answer time
/// and when it was observed.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerExemplar {
    pub trace_id: String,
    pub seconds: f64,
    /// Unix milliseconds.
    pub at_ms: u64,
}

/// A route's answer-time histogram as read: sum in seconds, count, and per bucket (upper bound
/// in seconds, answers in it) with `+Inf` last.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerTimes {
    pub sum_s: f64,
    pub count: u64,
    pub buckets: Vec<(f64, u64)>,
    /// Each bucket's exemplar, when a traced answer fell in it.
    pub exemplars: Vec<Option<AnswerExemplar>>,
}

impl AnswerTimes {
    /// Adds another route's histogram (for the routes summed under one label).
    pub fn add(&mut self, o: &AnswerTimes) {
        self.sum_s += o.sum_s;
        self.count += o.count;
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            a.1 += b.1;
        }
        // The newer of two exemplars stands for the bucket.
        for (a, b) in self.exemplars.iter_mut().zip(&o.exemplars) {
            if let Some(b) = b
                && a.as_ref().is_none_or(|a| a.at_ms < b.at_ms)
            {
                *a = Some(b.clone());
            }
        }
    }
}

/// Marks a wake of the route under way until dropped.
#[derive(Debug)]
pub struct Waking(Arc<RouteTraffic>);

impl Waking {
    /// Names the wake's span, for the requests held for it to link to.
    pub fn traced(&self, span: opentelemetry::trace::SpanContext) {
        *self.0.wake_span.lock().expect("wake span lock") = Some(span);
    }
}

impl Drop for Waking {
    fn drop(&mut self) {
        self.0.wake_span.lock().expect("wake span lock").take();
        self.0.waking.store(false, Ordering::Release);
    }
}

/// Counts a request as in flight until dropped.
#[derive(Debug)]
pub struct InFlight(Arc<RouteTraffic>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts a request as held until dropped.
#[derive(Debug)]
pub struct Held(Arc<RouteTraffic>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Default for Traffic {
    fn default() -> Self {
        Self {
            routes: RwLock::default(),
            hold: prometheus_client::metrics::exemplar::HistogramWithExemplars::new(
                HOLD_BUCKETS.into_iter(),
            ),
        }
    }
}

impl Traffic {
    /// Counts one held request's wait; `trace`: the id of its trace, when it is traced.
    pub fn observe_hold(&self, held: std::time::Duration, trace: Option<String>) {
        let exemplar = trace.map(|trace_id| TraceExemplar { trace_id });
        self.hold.observe(held.as_secs_f64(), exemplar, None);
    }

    /// The route's counters, created on first use.
    pub fn route(&self, name: &str) -> Arc<RouteTraffic> {
        if let Some(r) = self.routes.read().expect("traffic lock").get(name) {
            return r.clone();
        }
        self.routes
            .write()
            .expect("traffic lock")
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    /// Every route's counters.
    pub fn all(&self) -> Vec<(String, Arc<RouteTraffic>)> {
        self.routes
            .read()
            .expect("traffic lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

impl RouteTraffic {
    /// Counts an answer with `status`: from a replica `rtt_us` after it was picked, or made by
    /// ebb itself (a refusal: `None`).
    pub fn answered(&self, status: u16, rtt_us: Option<u64>) {
        let class = usize::from((status / 100).clamp(1, 5)) - 1;
        let a = &self.answers.shards[answer_shard()];
        a.classes[class].fetch_add(1, Ordering::Relaxed);
        if let Some(us) = rtt_us {
            a.buckets[answer_bucket(us)].fetch_add(1, Ordering::Relaxed);
            a.sum_us.fetch_add(us, Ordering::Relaxed);
        }
    }

    /// Makes a traced answer, `rtt_us` after its replica was picked and observed at `at_ms`, its
    /// time bucket's exemplar (after [`RouteTraffic::answered`] counted it).
    pub fn exemplar(&self, rtt_us: u64, trace_id: String, at_ms: u64) {
        let slot = &self.answers.exemplars[answer_bucket(rtt_us)];
        *slot.lock().expect("exemplar lock") = Some(AnswerExemplar {
            trace_id,
            seconds: rtt_us as f64 / 1e6,
            at_ms,
        });
    }

    /// Counts a request or connection cut by timeout `t`.
    pub fn timed_out(&self, t: Timeout) {
        self.timeouts[t as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Timeouts so far, by [`Timeout`].
    pub fn timeouts(&self) -> [u64; 4] {
        std::array::from_fn(|i| self.timeouts[i].load(Ordering::Relaxed))
    }

    /// Answers so far by status class (1xx to 5xx).
    pub fn classes(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.answers.sum(|a| &a.classes[i]))
    }

    /// The replicas' answers so far and the sum of their answer times, microseconds (what
    /// scaling on load reads each tenth of a second, without the buckets).
    pub fn answer_total(&self) -> (u64, u64) {
        let a = &self.answers;
        let count = (0..=ANSWER_BOUNDS_US.len())
            .map(|i| a.sum(|s| &s.buckets[i]))
            .sum();
        (count, a.sum(|s| &s.sum_us))
    }

    /// The replicas' answer times so far.
    pub fn answer_times(&self) -> AnswerTimes {
        let a = &self.answers;
        let mut count = 0;
        let buckets = (0..=ANSWER_BOUNDS_US.len())
            .map(|i| {
                let n = a.sum(|s| &s.buckets[i]);
                count += n;
                let le = ANSWER_BOUNDS_US
                    .get(i)
                    .map_or(f64::INFINITY, |b| *b as f64 / 1e6);
                (le, n)
            })
            .collect();
        AnswerTimes {
            sum_s: a.sum(|s| &s.sum_us) as f64 / 1e6,
            count,
            buckets,
            exemplars: a
                .exemplars
                .iter()
                .map(|e| e.lock().expect("exemplar lock").clone())
                .collect(),
        }
    }

    /// A request arrived at `now_ms`.
    pub fn begin(self: &Arc<Self>, now_ms: u64) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.last_at_ms.fetch_max(now_ms, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// Marks `now_ms` as the route's last use (a TCP connection's end) without counting a
    /// request.
    pub fn touch(&self, now_ms: u64) {
        self.last_at_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// Holds a request, unless `max` are held already.
    pub fn hold(self: &Arc<Self>, max: u32) -> Option<Held> {
        let prev = self.held.fetch_add(1, Ordering::AcqRel);
        let held = Held(self.clone());
        (prev < max).then_some(held)
    }

    /// The span of the wake under way, when it is traced.
    pub fn wake_span(&self) -> Option<opentelemetry::trace::SpanContext> {
        self.wake_span.lock().expect("wake span lock").clone()
    }

    /// Starts a wake unless one is under way.
    pub fn begin_wake(self: &Arc<Self>) -> Option<Waking> {
        self.waking
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then(|| Waking(self.clone()))
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The newest request time seen.
    pub fn last_at_ms(&self) -> u64 {
        self.last_at_ms.load(Ordering::Relaxed)
    }

    /// Requests held now.
    pub fn held(&self) -> u32 {
        self.held.load(Ordering::Acquire)
    }

    /// Every request since the start (a counter; read without touching the hot path).
    pub fn served(&self) -> u64 {
        self.flushed.load(Ordering::Acquire) + self.requests.load(Ordering::Acquire)
    }

    /// Takes the count of requests since the last call, with the newest request time.
    pub fn take_requests(&self) -> (u64, u64) {
        let n = self.requests.swap(0, Ordering::AcqRel);
        self.flushed.fetch_add(n, Ordering::AcqRel);
        (n, self.last_at_ms.load(Ordering::Relaxed))
    }

    /// Puts back requests whose flush failed.
    pub fn restore_requests(&self, count: u64) {
        self.requests.fetch_add(count, Ordering::Relaxed);
        self.flushed.fetch_sub(count, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_count_and_bound() {
        let t = Traffic::default();
        let r = t.route("a");
        let a = r.begin(10);
        let b = r.begin(5);
        assert_eq!(r.in_flight(), 2);
        drop(a);
        assert_eq!(r.in_flight(), 1);
        drop(b);
        assert_eq!(r.served(), 2);
        assert_eq!(r.take_requests(), (2, 10));
        assert_eq!(r.take_requests(), (0, 10));
        assert_eq!(r.served(), 2, "flushed requests still count");
        r.restore_requests(2);
        assert_eq!(r.served(), 2, "and restored ones once");
        let h1 = r.hold(1);
        assert!(h1.is_some());
        assert!(r.hold(1).is_none(), "the second hold is over the bound");
        drop(h1);
        assert!(r.hold(1).is_some());
        let w = r.begin_wake();
        assert!(w.is_some());
        assert!(r.begin_wake().is_none(), "one wake at a time");
        drop(w);
        assert!(r.begin_wake().is_some());
        assert!(Arc::ptr_eq(&t.route("a"), &r));
    }
}
