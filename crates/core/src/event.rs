//! Events: the one vocabulary of decisions in ebb, and the envelope codec that puts them in the log.
//!
//! Every decision ebb makes is an [`Event`]. The log stores each one in an [`Envelope`]
//! `{seq, at_ms, version, event}`, encoded with MessagePack (rmp-serde). The encoding is a
//! four-element array `[version, seq, at_ms, event]` so that the schema version can be read before
//! the event body is decoded: a decoder refuses a version newer than [`SCHEMA_VERSION`] with a clear
//! error, and keeps a decoder for every older version (`schema/events.md` documents each one and
//! `schema/fixtures/` holds encoded samples that must decode forever). Event bodies are encoded with
//! named fields, so a field added later with `#[serde(default)]` still reads old records.
//! Changing an event's shape in any other way means a new [`SCHEMA_VERSION`], a decoder for the
//! old one, and new fixtures beside the old ones; [`examples`] gives one event of each kind, whose
//! encodings are the fixtures, and `tests/schema.rs` decodes the fixtures of every version.
//!
//! [`Event::subject`] names the object an event is about (its [`Kind`] and id), which is how
//! `ebb explain` finds an object's events.
//!
//! This module is pure: no IO, no clock.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

/// The schema version this build writes. Decoders exist for every version from 1 up to this one.
pub const SCHEMA_VERSION: u16 = 1;

/// A logged event with its position and time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// Position in the log, starting at 1, contiguous.
    pub seq: u64,
    /// When the event was appended, Unix milliseconds. Never decreases along the log.
    pub at_ms: u64,
    /// Schema version the event was written with.
    pub version: u16,
    /// The decision.
    pub event: Event,
}

/// Why a deployment's replica count was asked to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleReason {
    /// A request arrived for a workload with no ready replica.
    Wake,
    /// No request for `idle_after_ms` and none in flight.
    Idle,
    /// The function autoscaler's counter asked for it.
    Autoscale,
    /// An operator asked for it.
    Manual,
    /// ebb restarted: no replica it ran before is running any more.
    Restart,
    /// ebb is shutting down and stops every replica.
    Shutdown,
    /// Another ebb replica changed the shared deployment's replica count; this replica saw it.
    Peer,
    /// A keep-warm window opened and asks for more replicas than run.
    Warm,
    /// The route's load asks for another count: the figures the decision was taken on.
    Load(LoadWhy),
}

/// What scaling on load measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Requests in flight (and held), averaged over time.
    #[default]
    Concurrency,
    /// Requests started per second.
    Rps,
}

impl Metric {
    /// Its name, as settings and events spell it.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Concurrency => "concurrency",
            Metric::Rps => "rps",
        }
    }
}

/// What a decision to scale on load was taken on, as the log keeps it (integers: events compare
/// exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LoadWhy {
    /// What the load is measured in.
    #[serde(default)]
    pub metric: Metric,
    /// The load per ready replica over the window, in thousandths (requests in flight, or
    /// requests per second).
    pub per_replica_milli: u64,
    /// The target per replica, in thousandths.
    pub target_milli: u64,
    /// The share of the target a replica is planned to run at, percent.
    pub utilization_pct: u32,
    /// The window the load was averaged over, ms.
    pub window_ms: u64,
    /// Whether the route was in panic (the panic window decided, and nothing scales down).
    #[serde(default)]
    pub panic: bool,
    /// Replicas ready when it was decided.
    pub ready: u32,
    /// Requests held for a replica when it was decided.
    #[serde(default)]
    pub held: u32,
}

impl ScaleReason {
    /// The reason's name, as in the log (`wake`, `idle`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ScaleReason::Wake => "wake",
            ScaleReason::Idle => "idle",
            ScaleReason::Autoscale => "autoscale",
            ScaleReason::Manual => "manual",
            ScaleReason::Restart => "restart",
            ScaleReason::Shutdown => "shutdown",
            ScaleReason::Peer => "peer",
            ScaleReason::Warm => "warm",
            ScaleReason::Load(_) => "load",
        }
    }
}

/// Whether a call's caller waits for its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    /// The caller waits; runners execute it directly and only report it.
    Sync,
    /// Queued, executed later by a runner.
    Async,
}

/// How a finished call or instance ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The target answered and the call counts as done.
    Success,
    /// The target failed or could not be reached.
    Error,
}

/// Why a runner's start was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    /// The call was already running: it has been started once and must not run twice; it becomes `error`.
    AlreadyRunning,
    /// The call had already reached a final state.
    AlreadyFinal,
    /// No call with that id was ever queued.
    UnknownCall,
}

/// An HTTP request carried by a call.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Payload {
    /// HTTP method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Header names and values, in order.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// The body, bounded by the API that accepted it.
    #[serde(default)]
    pub body: ByteBuf,
}

/// Serde for a shared value: written and read as the value itself, as serde's `rc` feature
/// would (turning that on would build every crate that uses serde a second time).
pub mod shared {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<T: Serialize, S: Serializer>(v: &Arc<T>, s: S) -> Result<S::Ok, S::Error> {
        T::serialize(v, s)
    }

    pub fn deserialize<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Arc<T>, D::Error> {
        T::deserialize(d).map(Arc::new)
    }
}

/// A call as it was queued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallSpec {
    /// Call id (a UUID v7 in text form).
    pub id: String,
    /// The function or route the call is for.
    pub target: String,
    /// Sync or async.
    pub kind: CallKind,
    /// How long a started call may run before it becomes `timeout`.
    pub timeout_ms: u64,
    /// The queue partition (runner) the call was put on, if any.
    #[serde(default)]
    pub partition: Option<String>,
    /// The request to send to the target.
    #[serde(default)]
    pub payload: Payload,
    /// The W3C `traceparent` of the request that enqueued it, while traces are on: its queue
    /// and run spans, and the request sent to its target, join that trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// The W3C `tracestate` that came with `trace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
    /// The W3C `baggage` of the request that enqueued it, while traces are on: sent on with the
    /// request to its target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baggage: Option<String>,
}

/// The W3C trace context (`traceparent`, `tracestate`) and `baggage` a call keeps from the
/// request that enqueued it (a function's steps, from the invocation), while traces are on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CallTrace {
    pub traceparent: String,
    pub tracestate: Option<String>,
    pub baggage: Option<String>,
}

impl CallTrace {
    /// The longest `tracestate` kept: the W3C limit of 32 members of 16 characters or so.
    pub const MAX_TRACESTATE: usize = 512;
    /// The longest `baggage` kept: the W3C limit.
    pub const MAX_BAGGAGE: usize = 8192;

    /// What `call` keeps, if it is traced.
    pub fn of(call: &CallSpec) -> Option<CallTrace> {
        Some(CallTrace {
            traceparent: call.trace.clone()?,
            tracestate: call.tracestate.clone(),
            baggage: call.baggage.clone(),
        })
    }

    /// Makes `call` keep it.
    pub fn keep(self, call: &mut CallSpec) {
        call.trace = Some(self.traceparent);
        call.tracestate = self.tracestate;
        call.baggage = self.baggage;
    }
}

impl CallSpec {
    /// An async call of target `t` with an empty payload, for unit tests.
    #[doc(hidden)]
    pub fn for_test(id: &str) -> Self {
        Self {
            id: id.into(),
            target: "t".into(),
            kind: CallKind::Async,
            timeout_ms: 1_000,
            partition: None,
            payload: Payload::default(),
            trace: None,
            tracestate: None,
            baggage: None,
        }
    }
}

/// The bounds on ended calls (or instances) a retention's forgetting brought them within: at most
/// `count` of them, taking at most about `bytes` of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kept {
    pub count: u64,
    pub bytes: u64,
}

/// Which calls a forgetting by age keeps known as ended by their id (`Calls::gone`): those that
/// ended at or after `ended_since_ms`, at most `most` of them (the newest). A message of such a
/// call read again (a Kafka partition read from an older commit) is deleted, not run, though it
/// was put too recently to be taken for a forgotten call's by its age alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepGone {
    pub ended_since_ms: u64,
    pub most: u64,
}

/// The answer a call's target gave.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CallResult {
    /// HTTP status.
    pub status: u16,
    /// Header names and values.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// The body, bounded.
    #[serde(default)]
    pub body: ByteBuf,
}

/// A route: the domains that lead to a workload, and how that workload scales.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RouteSpec {
    /// Unique route name.
    pub name: String,
    /// Host names (exact, or `*.suffix`), lower case, without port.
    pub domains: Vec<String>,
    /// The deployment (workload) that serves the route.
    pub deployment: String,
    /// Scale to zero after this long with no request and none in flight.
    pub idle_after_ms: u64,
    /// Replicas kept even when idle.
    #[serde(default)]
    pub min_replicas: u32,
    /// Upper bound on replicas.
    #[serde(default = "one")]
    pub max_replicas: u32,
    /// How long a request may wait for a replica to become ready.
    #[serde(default)]
    pub hold_timeout_ms: u64,
    /// How many requests may wait at once.
    #[serde(default)]
    pub hold_queue_max: u32,
    /// How to run the deployment as local processes (absent: something else runs it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessSpec>,
    /// Requests one replica serves at once (0: no bound); more wait for a slot.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub concurrency: u32,
    /// Connections being opened to one replica at once (0: [`DEFAULT_MAX_CONNECTING`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_connecting: u32,
    /// How a replica is picked for each request (absent: the default, peak EWMA). Boxed: most
    /// routes keep the default, and events stay small.
    #[serde(default, skip_serializing_if = "crate::policy::Policy::is_default")]
    pub policy: Box<crate::policy::Policy>,
    /// Replicas an idle deployment is scaled down to, and runs from ebb's start (absent:
    /// `min_replicas`). Below `min_replicas`, a wake raises it to `min_replicas` and idleness
    /// takes it back down to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_replicas: Option<u32>,
    /// Keep-warm windows: while one is open the deployment runs at least its `min` replicas.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warm: Vec<WarmWindow>,
    /// How long a replica may take to begin its answer once the request is sent (0: no bound):
    /// past it, 504 `response_timeout`.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub response_timeout_ms: u64,
    /// How long a request under way may move no byte either way (0: the proxy's
    /// `--request-stall-timeout-ms`): past it, 504 `stream_idle_timeout` before the answer began,
    /// else both connections are closed.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub stream_idle_timeout_ms: u64,
    /// How long a client connection may sit idle after a request of this route, and an upgraded
    /// connection (WebSocket) may move no byte (0: the proxy's `--client-idle-timeout-ms`; an
    /// upgraded connection has no bound then).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub connection_idle_timeout_ms: u64,
    /// A browser's cold request (a GET that accepts `text/html`) gets this page, which
    /// reloads itself, instead of being held; other clients are held as ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_page: Option<WaitingPage>,
    /// A TCP route: the address ebb listens on for it (`IP:port`); its connections are spliced
    /// to the replicas as they are, and its domains may be empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// Scaling on load between its replica bounds (absent: the route runs its minimum, or one
    /// replica once woken, and no more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadSpec>,
}

/// A route's scaling on load, as `ebb.toml`, the admin API and a Service's annotations write it:
/// one target (requests in flight per replica, or requests per second per replica), and
/// Knative's knobs with Knative's defaults. [`LoadSpec::settings`] turns it into the core's
/// `scaler::load::Settings` (`Settings::of`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadSpec {
    /// Requests in flight one replica is meant for (Knative's `target` on `concurrency`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_concurrency: Option<f64>,
    /// Requests per second one replica is meant for (Knative's `target` on `rps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_rps: Option<f64>,
    /// The share of the target a replica is planned to run at, percent (default 70).
    #[serde(default = "default_utilization")]
    pub utilization_pct: f64,
    /// The stable window the load is averaged over, ms (default 60 s; 6 s to 1 h).
    #[serde(default = "default_window")]
    pub window_ms: u64,
    /// The panic window, percent of the stable window (default 10; at least 1 s).
    #[serde(default = "default_panic_window")]
    pub panic_window_pct: f64,
    /// Panic when the panic window asks for this percent of the replicas ready (default 200).
    #[serde(default = "default_panic_threshold")]
    pub panic_threshold_pct: f64,
    /// At most this many times the replicas ready in one step (default 1000).
    #[serde(default = "default_up_rate")]
    pub max_scale_up_rate: f64,
    /// At least the replicas ready divided by this in one step (default 2).
    #[serde(default = "default_down_rate")]
    pub max_scale_down_rate: f64,
    /// A lower count is taken only once asked for this long, ms (default 0).
    #[serde(default)]
    pub scale_down_delay_ms: u64,
}

// Checked finite by `LoadSpec::check` before a spec is written.
impl Eq for LoadSpec {}

fn default_utilization() -> f64 {
    70.0
}
fn default_window() -> u64 {
    60_000
}
fn default_panic_window() -> f64 {
    10.0
}
fn default_panic_threshold() -> f64 {
    200.0
}
fn default_up_rate() -> f64 {
    1000.0
}
fn default_down_rate() -> f64 {
    2.0
}

impl Default for LoadSpec {
    fn default() -> Self {
        LoadSpec {
            target_concurrency: None,
            target_rps: None,
            utilization_pct: default_utilization(),
            window_ms: default_window(),
            panic_window_pct: default_panic_window(),
            panic_threshold_pct: default_panic_threshold(),
            max_scale_up_rate: default_up_rate(),
            max_scale_down_rate: default_down_rate(),
            scale_down_delay_ms: 0,
        }
    }
}

/// The page a browser gets while a route's workload wakes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WaitingPage {
    /// HTML with `{{route}}`, `{{expected_wait}}`, `{{expected_wait_s}}` and `{{refresh_s}}`
    /// filled in (absent: ebb's built-in page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Seconds between the page's reloads (0: 1).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub refresh_s: u32,
}

/// A keep-warm window: from each occurrence of `schedule` (cron, 5 fields or 6 with seconds
/// first, read in `timezone`), for `for_ms`, the route's deployment runs at least `min` replicas
/// whatever its traffic. Its starts and ends are `WarmStarted` / `WarmEnded` events.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WarmWindow {
    /// When the window opens.
    pub schedule: String,
    /// How long it stays open.
    pub for_ms: u64,
    /// Replicas kept while it is open.
    pub min: u32,
    /// The IANA time zone the schedule is read in (absent: UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
}

impl RouteSpec {
    /// Route `name` on `domains` to deployment `NAME-dep`, idle after 1 s, 0..1 replicas, for
    /// unit tests and the fuzz targets.
    #[doc(hidden)]
    pub fn for_test(name: &str, domains: &[&str]) -> Self {
        Self {
            name: name.into(),
            domains: domains.iter().map(|d| d.to_string()).collect(),
            deployment: format!("{name}-dep"),
            idle_after_ms: 1000,
            min_replicas: 0,
            max_replicas: 1,
            hold_timeout_ms: 0,
            hold_queue_max: 0,
            process: None,
            concurrency: 0,
            max_connecting: 0,
            policy: Default::default(),
            ..Default::default()
        }
    }
}

/// Connections being opened to one replica at once when a route does not say.
pub const DEFAULT_MAX_CONNECTING: u32 = 4;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl RouteSpec {
    /// Replicas an idle deployment keeps for this route: `idle_replicas`, else `min_replicas`.
    pub fn idle_floor(&self) -> u32 {
        self.idle_replicas.unwrap_or(self.min_replicas)
    }

    /// Connections being opened to one replica at once.
    pub fn max_connecting(&self) -> u32 {
        if self.max_connecting == 0 {
            DEFAULT_MAX_CONNECTING
        } else {
            self.max_connecting
        }
    }
}

/// How to run a deployment as local processes, one per replica, each listening on
/// 127.0.0.1:`$PORT`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ProcessSpec {
    /// Program and arguments; the program `ebb` means the running ebb binary.
    pub command: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Working directory.
    #[serde(default)]
    pub cwd: Option<String>,
    /// HTTP path that answers 2xx when ready; a TCP connect when absent.
    #[serde(default)]
    pub readiness_path: Option<String>,
    /// A replica not ready after this long has failed to start.
    #[serde(default)]
    pub startup_timeout_ms: u64,
    /// Time between SIGTERM and SIGKILL.
    #[serde(default)]
    pub stop_grace_ms: u64,
    /// A shell command run once (per ebb process) before the first replica starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_run: Option<String>,
}

fn one() -> u32 {
    1
}

/// A function template.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TemplateSpec {
    /// Template name.
    pub name: String,
    /// A setup command run once before the first instance starts.
    #[serde(default)]
    pub pre_run: Option<String>,
    /// The entry point or code handed to the runtime.
    #[serde(default)]
    pub function: String,
    /// How to run the function server.
    #[serde(default)]
    pub command: Vec<String>,
    /// The container image of the function server (Kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// An external address instead of a managed workload.
    #[serde(default)]
    pub service_address: Option<String>,
    /// Function to run next on the `left` branch.
    #[serde(default)]
    pub left: Option<String>,
    /// Function to run next on the `right` branch.
    #[serde(default)]
    pub right: Option<String>,
    /// Instances started when the template is created.
    #[serde(default)]
    pub init_instances: u32,
    /// Lower bound on instances.
    #[serde(default)]
    pub min_instances: u32,
    /// Upper bound on instances.
    #[serde(default)]
    pub max_instances: u32,
    /// Per-step timeout.
    #[serde(default)]
    pub timeout_ms: u64,
    /// Calls one instance serves at once.
    #[serde(default)]
    pub concurrency: u32,
    /// Cron schedule that invokes the template.
    #[serde(default)]
    pub schedule: Option<String>,
    /// How an instance of its function server is picked for each call (absent: the default).
    #[serde(default, skip_serializing_if = "crate::policy::Policy::is_default")]
    pub policy: Box<crate::policy::Policy>,
    /// Keep-warm windows of the function's workload (its route's `warm`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warm: Vec<WarmWindow>,
}

/// An object a cleaner watches or deletes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CleanerTarget {
    /// Name the target is known by in CEL conditions.
    pub name: String,
    /// What the target refers to (`group/version/kind/name` or a label selector).
    pub reference: String,
    /// Delete the target when the cleaner fires.
    #[serde(default)]
    pub delete: bool,
    /// Pass the target to the conditions.
    #[serde(default)]
    pub include_when_evaluating: bool,
}

/// A cleaner: what to delete once its TTL has passed and its conditions hold.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CleanerSpec {
    /// Cleaner name.
    pub name: String,
    /// Earliest age at which the cleaner may fire.
    pub ttl_ms: u64,
    /// How often conditions are evaluated again when they do not hold.
    pub retry_period_ms: u64,
    /// The user asserts the conditions are monotonic in time (enables binary search).
    #[serde(default)]
    pub monotonic: bool,
    /// CEL conditions; all must hold.
    #[serde(default)]
    pub conditions: Vec<String>,
    /// Objects watched and deleted.
    #[serde(default)]
    pub targets: Vec<CleanerTarget>,
    /// The Kubernetes namespace of the cleaner and its targets (empty: ebb's own objects).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// The resource's uid: a cleaner created again under the same name is a new one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// When the cleaner was created, if known (its TTL counts from here; 0: its first upsert).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub created_at_ms: u64,
    /// Evaluate and report what would be deleted, but delete nothing.
    #[serde(default, skip_serializing_if = "is_false")]
    pub dry_run: bool,
    /// The Helm release to uninstall when the cleaner fires (empty: none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub helm_release: String,
    /// What is wrong with the cleaner as written (empty: nothing); such a cleaner never fires.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub invalid: String,
    /// A standing cleaner (one of `ebb.toml`): after each firing it is evaluated again after its
    /// retry period, instead of being done.
    #[serde(default, skip_serializing_if = "is_false")]
    pub repeat: bool,
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// Every decision ebb makes. Fields may grow (with `#[serde(default)]`); a changed shape is a new
/// schema version with a decoder for the old one.
///
/// The large specs (a route's, a call's, a template's, a cleaner's) are boxed, which changes
/// nothing on the wire. Unboxed, every event took the size of the largest (456 bytes against
/// 152 now), and the events of one decision over a batch of hundreds of starts or finishes,
/// built on the log's writer, were hundreds of KiB allocated and moved for each batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    // Routes.
    /// A route was created or replaced.
    RouteUpserted { route: Box<RouteSpec> },
    /// A route was removed.
    RouteRemoved { name: String },
    /// What a Gateway API route (`KIND/NAMESPACE/NAME`, e.g. `HTTPRoute/shop/web`) attaches to
    /// changed: the listeners that take it, or why none does, per parent (told once per change).
    GatewayRouteAttached { route: String, attached: String },
    // Traffic.
    /// Requests a route served in one flush interval: an aggregate, never one event per request.
    RequestsSeen {
        route: String,
        count: u64,
        last_at_ms: u64,
    },
    // Scaling.
    /// ebb decided to change a deployment's replica count.
    ScaleRequested {
        deployment: String,
        from: u32,
        to: u32,
        reason: ScaleReason,
    },
    /// A deployment has `replicas` ready replicas after a scale-up.
    ScaledUp { deployment: String, replicas: u32 },
    /// A deployment was scaled down to `replicas`.
    ScaledDown { deployment: String, replicas: u32 },
    /// A scale request failed.
    ScaleFailed {
        deployment: String,
        to: u32,
        error: String,
    },
    // Calls.
    /// A call was put on the queue. Shared: the projection's call and the jobs handed out
    /// hold the same spec, never a copy.
    CallQueued {
        #[serde(with = "shared")]
        call: Arc<CallSpec>,
    },
    /// A runner's start was accepted: the call is running until `deadline_at_ms`.
    CallStarted {
        id: String,
        runner: String,
        deadline_at_ms: u64,
    },
    /// A runner's start was refused.
    CallRejected {
        id: String,
        runner: String,
        reason: RejectReason,
    },
    /// A call finished. The first finish wins; repeats change nothing.
    CallFinished {
        id: String,
        runner: String,
        outcome: Outcome,
        #[serde(default)]
        result: Option<CallResult>,
        #[serde(default)]
        log: String,
    },
    /// A running call passed its deadline.
    CallTimedOut { id: String },
    /// A queued or running call was cancelled.
    CallCancelled { id: String },
    /// Calls that ended before this time leave the projection (their events stay in the log):
    /// the call retention, decided like everything else.
    CallsForgotten {
        finished_before_ms: u64,
        /// Set when their number or size decided it, not their age: the bounds the ended calls
        /// kept were brought within.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        within: Option<Kept>,
        /// Set by a forgetting by age that comes sooner after calls ended than their messages
        /// are taken for a forgotten call's when read again (`CallOptions::forgotten_after_ms`):
        /// those that ended since then stay known as ended by their id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        keep_gone: Option<KeepGone>,
    },
    /// Calls whose enqueue failed (the queue did not confirm the put; the caller got an
    /// error): a message of theirs that lands anyway is never run, even after a restart.
    CallsAborted { ids: Vec<String> },
    // Functions.
    /// A function template was created or replaced.
    TemplateUpserted { template: Box<TemplateSpec> },
    /// A function template was deleted.
    TemplateDeleted { name: String },
    /// An invocation created an instance of a template.
    InstanceCreated {
        id: String,
        template: String,
        args: ByteBuf,
    },
    /// An instance ran `function` as its next step, through call `call_id`.
    InstanceStepped {
        id: String,
        function: String,
        call_id: String,
    },
    /// An instance ended.
    InstanceFinished {
        id: String,
        outcome: Outcome,
        result: ByteBuf,
    },
    /// A template's cron schedule fired for the occurrence at `scheduled_at_ms` (once per
    /// occurrence: a restart never fires it again).
    TemplateFired { name: String, scheduled_at_ms: u64 },
    /// Instances that ended before this time leave the projection (their events stay in the
    /// log): the instance retention, decided with the call retention.
    InstancesForgotten {
        finished_before_ms: u64,
        /// As for [`Event::CallsForgotten`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        within: Option<Kept>,
    },
    /// A function's call counter grew by `by`, capped at `cap` (aggregated, not one per call).
    CounterAdded { function: String, by: u64, cap: u64 },
    /// A function's call counter decayed by `by` (saturating at zero).
    CounterDecayed { function: String, by: u64 },
    // Cleaners.
    /// A cleaner was created or replaced.
    CleanerUpserted { cleaner: Box<CleanerSpec> },
    /// A cleaner's conditions were evaluated; `next_at_ms` is when to evaluate again.
    CleanerEvaluated {
        name: String,
        result: bool,
        next_at_ms: Option<u64>,
        /// Where the cleaner stands (`WaitingForConditions`, `EvaluationError`, ...; empty in
        /// records written before reasons were logged).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
        /// The reason in words.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        message: String,
        /// Each condition's result, in order (empty when none was evaluated).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        results: Vec<bool>,
        /// CEL evaluations made (one per condition at the evaluation's time, more while searching
        /// for a monotonic condition's first true time).
        #[serde(default, skip_serializing_if = "is_zero_u32")]
        evaluations: u32,
        /// In dry run: what firing would delete.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        would_delete: Vec<String>,
        /// Evaluations since the cleaner's last record that found what it said (the same result,
        /// reason and condition results) and so were not recorded.
        #[serde(default, skip_serializing_if = "is_zero_u32")]
        folded: u32,
    },
    /// A cleaner's conditions held past its TTL and its targets were released.
    CleanerFired { name: String },
    /// A cleaner was deleted.
    CleanerDeleted { name: String },
    /// A cleaner's conditions held past its TTL and it started deleting `targets` (each
    /// `apiVersion/Kind/namespace/name@uid`, the Helm release as `helm/namespace/release`): a
    /// firing cut short completes from here after a restart.
    CleanerFiring { name: String, targets: Vec<String> },
    // Keep-warm windows.
    /// A keep-warm window of a route opened (or its next occurrence renewed it): the route's
    /// deployment runs at least `min` replicas until `until_ms`. `scheduled_at_ms` is the
    /// occurrence it opened for (earlier than the event's time when ebb was down then).
    WarmStarted {
        route: String,
        window: u32,
        min: u32,
        scheduled_at_ms: u64,
        until_ms: u64,
    },
    /// A keep-warm window of a route closed: its time passed, or the route no longer has it.
    WarmEnded { route: String, window: u32 },
}

/// The kinds of object an event can shape; `ebb explain` selects events by them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Route,
    Deployment,
    Call,
    Template,
    Instance,
    Cleaner,
}

impl Kind {
    /// The kind's name (a template is a `function`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Route => "route",
            Kind::Deployment => "deployment",
            Kind::Call => "call",
            Kind::Template => "function",
            Kind::Instance => "instance",
            Kind::Cleaner => "cleaner",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Event {
    /// The variant's name, as it appears in the log and in `schema/events.md`.
    pub fn name(&self) -> &'static str {
        match self {
            Event::RouteUpserted { .. } => "RouteUpserted",
            Event::RouteRemoved { .. } => "RouteRemoved",
            Event::GatewayRouteAttached { .. } => "GatewayRouteAttached",
            Event::RequestsSeen { .. } => "RequestsSeen",
            Event::ScaleRequested { .. } => "ScaleRequested",
            Event::ScaledUp { .. } => "ScaledUp",
            Event::ScaledDown { .. } => "ScaledDown",
            Event::ScaleFailed { .. } => "ScaleFailed",
            Event::WarmStarted { .. } => "WarmStarted",
            Event::WarmEnded { .. } => "WarmEnded",
            Event::CallQueued { .. } => "CallQueued",
            Event::CallStarted { .. } => "CallStarted",
            Event::CallRejected { .. } => "CallRejected",
            Event::CallFinished { .. } => "CallFinished",
            Event::CallTimedOut { .. } => "CallTimedOut",
            Event::CallsForgotten { .. } => "CallsForgotten",
            Event::CallsAborted { .. } => "CallsAborted",
            Event::CallCancelled { .. } => "CallCancelled",
            Event::TemplateUpserted { .. } => "TemplateUpserted",
            Event::TemplateDeleted { .. } => "TemplateDeleted",
            Event::TemplateFired { .. } => "TemplateFired",
            Event::InstancesForgotten { .. } => "InstancesForgotten",
            Event::InstanceCreated { .. } => "InstanceCreated",
            Event::InstanceStepped { .. } => "InstanceStepped",
            Event::InstanceFinished { .. } => "InstanceFinished",
            Event::CounterAdded { .. } => "CounterAdded",
            Event::CounterDecayed { .. } => "CounterDecayed",
            Event::CleanerUpserted { .. } => "CleanerUpserted",
            Event::CleanerEvaluated { .. } => "CleanerEvaluated",
            Event::CleanerFired { .. } => "CleanerFired",
            Event::CleanerDeleted { .. } => "CleanerDeleted",
            Event::CleanerFiring { .. } => "CleanerFiring",
        }
    }

    /// The object this event is about: its kind and id.
    pub fn subject(&self) -> (Kind, &str) {
        match self {
            Event::RouteUpserted { route } => (Kind::Route, &route.name),
            Event::RouteRemoved { name } => (Kind::Route, name),
            Event::GatewayRouteAttached { route, .. } => (Kind::Route, route),
            Event::RequestsSeen { route, .. }
            | Event::WarmStarted { route, .. }
            | Event::WarmEnded { route, .. } => (Kind::Route, route),
            Event::ScaleRequested { deployment, .. }
            | Event::ScaledUp { deployment, .. }
            | Event::ScaledDown { deployment, .. }
            | Event::ScaleFailed { deployment, .. } => (Kind::Deployment, deployment),
            Event::CallQueued { call } => (Kind::Call, &call.id),
            Event::CallStarted { id, .. }
            | Event::CallRejected { id, .. }
            | Event::CallFinished { id, .. }
            | Event::CallTimedOut { id }
            | Event::CallCancelled { id } => (Kind::Call, id),
            Event::CallsForgotten { .. } | Event::CallsAborted { .. } => (Kind::Call, ""),
            Event::InstancesForgotten { .. } => (Kind::Instance, ""),
            Event::TemplateUpserted { template } => (Kind::Template, &template.name),
            Event::TemplateDeleted { name } | Event::TemplateFired { name, .. } => {
                (Kind::Template, name)
            }
            Event::CounterAdded { function, .. } | Event::CounterDecayed { function, .. } => {
                (Kind::Template, function)
            }
            Event::InstanceCreated { id, .. }
            | Event::InstanceStepped { id, .. }
            | Event::InstanceFinished { id, .. } => (Kind::Instance, id),
            Event::CleanerUpserted { cleaner } => (Kind::Cleaner, &cleaner.name),
            Event::CleanerEvaluated { name, .. }
            | Event::CleanerFired { name }
            | Event::CleanerFiring { name, .. }
            | Event::CleanerDeleted { name } => (Kind::Cleaner, name),
        }
    }
}

/// Why a record could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The record was written by a newer ebb.
    #[error(
        "record has event schema version {version}, newer than this ebb understands ({supported}); upgrade ebb to read it"
    )]
    NewerVersion { version: u16, supported: u16 },
    /// The bytes are not an envelope.
    #[error("undecodable record: {0}")]
    Corrupt(String),
}

/// Encodes an envelope as `[version, seq, at_ms, event]` with named event fields.
pub fn encode(env: &Envelope) -> Vec<u8> {
    let mut buf = Vec::with_capacity(96);
    encode_into(&mut buf, env.seq, env.at_ms, &env.event);
    buf
}

/// Encodes an event at the current schema version into `buf`.
pub fn encode_into(buf: &mut Vec<u8>, seq: u64, at_ms: u64, event: &Event) {
    // Writing to a Vec cannot fail, and every event type serializes.
    rmp::encode::write_array_len(buf, 4).expect("write to Vec");
    rmp::encode::write_uint(buf, u64::from(SCHEMA_VERSION)).expect("write to Vec");
    rmp::encode::write_uint(buf, seq).expect("write to Vec");
    rmp::encode::write_uint(buf, at_ms).expect("write to Vec");
    let mut ser = rmp_serde::Serializer::new(buf).with_struct_map();
    event.serialize(&mut ser).expect("events always serialize");
}

/// Decodes a record. Refuses newer schema versions; reads every older one.
pub fn decode(bytes: &[u8]) -> Result<Envelope, CodecError> {
    let corrupt = |what: &str, e: &dyn fmt::Display| CodecError::Corrupt(format!("{what}: {e}"));
    let mut rd = bytes;
    let len = rmp::decode::read_array_len(&mut rd).map_err(|e| corrupt("envelope", &e))?;
    if len != 4 {
        return Err(CodecError::Corrupt(format!(
            "envelope has {len} fields, expected 4"
        )));
    }
    let version: u16 = rmp::decode::read_int(&mut rd).map_err(|e| corrupt("version", &e))?;
    if version > SCHEMA_VERSION {
        return Err(CodecError::NewerVersion {
            version,
            supported: SCHEMA_VERSION,
        });
    }
    let seq: u64 = rmp::decode::read_int(&mut rd).map_err(|e| corrupt("seq", &e))?;
    let at_ms: u64 = rmp::decode::read_int(&mut rd).map_err(|e| corrupt("at_ms", &e))?;
    let len =
        value_len(rd).ok_or_else(|| CodecError::Corrupt("event: truncated or malformed".into()))?;
    if len != rd.len() {
        return Err(CodecError::Corrupt(format!(
            "{} trailing bytes after the event",
            rd.len() - len
        )));
    }
    let event = match version {
        1 => rmp_serde::from_slice::<Event>(rd).map_err(|e| corrupt("event", &e))?,
        v => return Err(CodecError::Corrupt(format!("unknown schema version {v}"))),
    };
    Ok(Envelope {
        seq,
        at_ms,
        version,
        event,
    })
}

/// One example of every event, in declaration order. `schema/fixtures/` holds their encodings at
/// each schema version, and a test decodes those fixtures forever.
pub fn examples() -> Vec<Event> {
    let bytes = |s: &str| ByteBuf::from(s.as_bytes().to_vec());
    let call = CallSpec {
        id: "0190f5a2-7c1e-7000-8000-000000000001".into(),
        target: "resize".into(),
        kind: CallKind::Async,
        timeout_ms: 30_000,
        partition: Some("runner-1".into()),
        trace: None,
        tracestate: None,
        baggage: None,
        payload: Payload {
            method: "POST".into(),
            path: "/resize?w=100".into(),
            headers: vec![("content-type".into(), "image/png".into())],
            body: bytes("png"),
        },
    };
    vec![
        Event::RouteUpserted {
            route: Box::new(RouteSpec {
                name: "demo".into(),
                domains: vec!["demo.localhost".into(), "*.demo.test".into()],
                deployment: "demo-app".into(),
                idle_after_ms: 300_000,
                min_replicas: 0,
                max_replicas: 3,
                hold_timeout_ms: 30_000,
                hold_queue_max: 1_000,
                process: None,
                concurrency: 0,
                max_connecting: 0,
                policy: Default::default(),
                ..Default::default()
            }),
        },
        Event::RouteRemoved {
            name: "demo".into(),
        },
        Event::RequestsSeen {
            route: "demo".into(),
            count: 42,
            last_at_ms: 1_767_225_600_123,
        },
        Event::ScaleRequested {
            deployment: "demo-app".into(),
            from: 0,
            to: 1,
            reason: ScaleReason::Wake,
        },
        Event::ScaledUp {
            deployment: "demo-app".into(),
            replicas: 1,
        },
        Event::ScaledDown {
            deployment: "demo-app".into(),
            replicas: 0,
        },
        Event::ScaleFailed {
            deployment: "demo-app".into(),
            to: 1,
            error: "spawn failed: no such file".into(),
        },
        Event::CallQueued { call: Arc::new(call.clone()) },
        Event::CallStarted {
            id: call.id.clone(),
            runner: "runner-1".into(),
            deadline_at_ms: 1_767_225_630_000,
        },
        Event::CallRejected {
            id: call.id.clone(),
            runner: "runner-2".into(),
            reason: RejectReason::AlreadyRunning,
        },
        Event::CallFinished {
            id: call.id.clone(),
            runner: "runner-1".into(),
            outcome: Outcome::Success,
            result: Some(CallResult {
                status: 200,
                headers: vec![("content-type".into(), "text/plain".into())],
                body: bytes("ok"),
            }),
            log: "resized\n".into(),
        },
        Event::CallTimedOut {
            id: call.id.clone(),
        },
        Event::TemplateUpserted {
            template: Box::new(TemplateSpec {
                name: "resize".into(),
                pre_run: Some("echo ready".into()),
                function: "resize.handler".into(),
                command: vec!["ebb".into(), "example-app".into()],
                image: None,
                service_address: None,
                left: Some("thumbnail".into()),
                right: Some("RETURN".into()),
                init_instances: 1,
                min_instances: 0,
                max_instances: 4,
                timeout_ms: 30_000,
                concurrency: 8,
                schedule: Some("0 */5 * * * *".into()),
                policy: Default::default(),
                warm: Vec::new(),
            }),
        },
        Event::TemplateDeleted {
            name: "resize".into(),
        },
        Event::InstanceCreated {
            id: "0190f5a2-7c1e-7000-8000-0000000000aa".into(),
            template: "resize".into(),
            args: bytes("{\"w\":100}"),
        },
        Event::InstanceStepped {
            id: "0190f5a2-7c1e-7000-8000-0000000000aa".into(),
            function: "resize".into(),
            call_id: call.id.clone(),
        },
        Event::InstanceFinished {
            id: "0190f5a2-7c1e-7000-8000-0000000000aa".into(),
            outcome: Outcome::Success,
            result: bytes("{\"url\":\"/t/1.png\"}"),
        },
        Event::CounterAdded {
            function: "resize".into(),
            by: 17,
            cap: 1_000,
        },
        Event::CounterDecayed {
            function: "resize".into(),
            by: 5,
        },
        Event::CleanerUpserted {
            cleaner: Box::new(CleanerSpec {
                name: "preview-42".into(),
                ttl_ms: 360 * 3_600_000,
                retry_period_ms: 5 * 3_600_000,
                monotonic: true,
                conditions: vec!["revisions.all(r, r.status.ready == false)".into()],
                targets: vec![CleanerTarget {
                    name: "revisions".into(),
                    reference: "serving.knative.dev/v1/revision?ebb.dev/preview=42".into(),
                    delete: false,
                    include_when_evaluating: true,
                }],
                ..CleanerSpec::default()
            }),
        },
        Event::CleanerEvaluated {
            name: "preview-42".into(),
            result: false,
            next_at_ms: Some(1_767_243_600_000),
            reason: String::new(),
            message: String::new(),
            results: Vec::new(),
            evaluations: 0,
            would_delete: Vec::new(),
            folded: 0,
        },
        Event::CleanerFired {
            name: "preview-42".into(),
        },
        Event::CleanerDeleted {
            name: "preview-42".into(),
        },
        // Later additions go last, so the fixtures written before keep their seqs.
        Event::CallsForgotten {
            finished_before_ms: 1_767_225_000_000,
            within: None,
            keep_gone: None,
        },
        Event::CallCancelled {
            id: call.id.clone(),
        },
        Event::TemplateFired {
            name: "resize".into(),
            scheduled_at_ms: 1_767_225_300_000,
        },
        Event::InstancesForgotten {
            finished_before_ms: 1_767_225_000_000,
            within: None,
        },
        Event::CallsAborted {
            ids: vec!["ebb-1.0193aa8e-7c1a-7b3e-9d2f-0123456789ab".into()],
        },
        Event::CleanerFiring {
            name: "previews/preview-42".into(),
            targets: vec![
                "serving.knative.dev/v1/Service/previews/preview-42@6f1c2d3e-0000-4000-8000-000000000042"
                    .into(),
                "helm/previews/preview-42".into(),
            ],
        },
        Event::WarmStarted {
            route: "demo".into(),
            window: 0,
            min: 1,
            scheduled_at_ms: 1_767_254_400_000,
            until_ms: 1_767_290_400_000,
        },
        Event::WarmEnded {
            route: "demo".into(),
            window: 0,
        },
        // New kinds go last: each example's seq is its place, which the older fixtures keep.
        Event::GatewayRouteAttached {
            route: "HTTPRoute/shop/web".into(),
            attached: "shop/public listeners http, https".into(),
        },
    ]
}

/// The length in bytes of the one MessagePack value at the start of `b`, without decoding it;
/// `None` if `b` holds no complete value. Lets the decoder borrow strings from the record and still
/// refuse trailing bytes.
fn value_len(b: &[u8]) -> Option<usize> {
    let be = |at: usize, n: usize| -> Option<u64> {
        let bytes = b.get(at..at + n)?;
        Some(bytes.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    };
    let mut pos = 0usize;
    // Values still to skip. Each takes at least one byte, so more than the bytes left is malformed.
    let mut pending: u64 = 1;
    while pending > 0 {
        pending -= 1;
        let m = *b.get(pos)?;
        pos += 1;
        let (skip, more): (u64, u64) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(m & 0x0f)),
            0x90..=0x9f => (0, u64::from(m & 0x0f)),
            0xa0..=0xbf => (u64::from(m & 0x1f), 0),
            0xc4 | 0xd9 => (1 + be(pos, 1)?, 0),
            0xc5 | 0xda => (2 + be(pos, 2)?, 0),
            0xc6 | 0xdb => (4 + be(pos, 4)?, 0),
            0xc7 => (2 + be(pos, 1)?, 0),
            0xc8 => (3 + be(pos, 2)?, 0),
            0xc9 => (5 + be(pos, 4)?, 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 => (4, 0),
            0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (2, be(pos, 2)?),
            0xdd => (4, be(pos, 4)?),
            0xde => (2, 2 * be(pos, 2)?),
            0xdf => (4, 2 * be(pos, 4)?),
            0xc1 => return None,
        };
        pos = pos.checked_add(usize::try_from(skip).ok()?)?;
        if pos > b.len() {
            return None;
        }
        pending = pending.checked_add(more)?;
        if pending > (b.len() - pos) as u64 {
            return None;
        }
    }
    Some(pos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_small() {
        // Boxed specs keep an event as small as its largest plain variant (see `Event`).
        assert!(
            std::mem::size_of::<Event>() <= 160,
            "an event takes {} bytes",
            std::mem::size_of::<Event>()
        );
    }

    #[test]
    fn value_len_measures_one_value() {
        for ev in examples() {
            let bytes = rmp_serde::to_vec_named(&ev).unwrap();
            assert_eq!(value_len(&bytes), Some(bytes.len()), "{}", ev.name());
            let mut longer = bytes.clone();
            longer.extend_from_slice(&[1, 2, 3]);
            assert_eq!(value_len(&longer), Some(bytes.len()));
            assert_eq!(value_len(&bytes[..bytes.len() - 1]), None);
        }
        assert_eq!(value_len(&[0xdd, 0xff, 0xff, 0xff, 0xff]), None);
    }

    #[test]
    fn round_trip() {
        let env = Envelope {
            seq: 7,
            at_ms: 1_700_000_000_000,
            version: SCHEMA_VERSION,
            event: Event::RequestsSeen {
                route: "demo".into(),
                count: 3,
                last_at_ms: 1_699_999_999_000,
            },
        };
        assert_eq!(decode(&encode(&env)).unwrap(), env);
    }

    #[test]
    fn newer_version_is_refused_by_name() {
        let mut buf = Vec::new();
        rmp::encode::write_array_len(&mut buf, 4).unwrap();
        rmp::encode::write_uint(&mut buf, u64::from(SCHEMA_VERSION) + 1).unwrap();
        rmp::encode::write_uint(&mut buf, 1).unwrap();
        rmp::encode::write_uint(&mut buf, 1).unwrap();
        buf.extend_from_slice(b"\xc1whatever the future holds");
        let err = decode(&buf).unwrap_err();
        assert_eq!(
            err,
            CodecError::NewerVersion {
                version: SCHEMA_VERSION + 1,
                supported: SCHEMA_VERSION
            }
        );
        assert!(err.to_string().contains("upgrade ebb"));
    }

    #[test]
    fn garbage_and_truncation_are_errors() {
        let env = Envelope {
            seq: 1,
            at_ms: 2,
            version: SCHEMA_VERSION,
            event: Event::RouteRemoved { name: "x".into() },
        };
        let bytes = encode(&env);
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(decode(&trailing), Err(CodecError::Corrupt(_))));
        assert!(decode(b"hello world").is_err());
    }
}
