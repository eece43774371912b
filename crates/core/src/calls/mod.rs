//! Calls' pure half: what a runner sends and gets (the runner API's bodies, [`wire`]), how a
//! payload is checked, the job a call becomes, its queue message, and the rules the call service
//! applies to calls the log does not know yet. The call service itself (enqueue, dequeue, start,
//! finish over the queue and the log) is the `ebb` crate's (`src/calls/`).

pub mod wire;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::event::{CallResult, CallSpec, Event, Kept, Outcome, Payload, RejectReason};
use crate::ids::PeerError;
use crate::queue::{Message, QueueError};
use crate::state::State;
use crate::state::calls::CallStatus;

/// Bounds and timings of the call service. Every bound is a named value.
#[derive(Debug, Clone)]
pub struct CallOptions {
    /// Largest request body a call may carry.
    pub max_payload_bytes: usize,
    /// Largest result body kept.
    pub max_result_bytes: usize,
    /// Largest call log kept.
    pub max_log_bytes: usize,
    /// Timeout of a call that names none.
    pub default_timeout_ms: u64,
    /// Longest timeout a call may ask for.
    pub max_timeout_ms: u64,
    /// Most calls in one batch (enqueue, dequeue, start, finish).
    pub max_batch: usize,
    /// Longest dequeue long-poll.
    pub max_wait_ms: u64,
    /// How long past its deadline a started call's message is kept from redelivery (the timeout
    /// decision deletes it well before).
    pub hold_grace_ms: u64,
    /// A runner not heard from for this long is gone.
    pub runner_lease_ms: u64,
    /// Most runners tracked at once.
    pub max_runners: usize,
    /// How long an ended call (and function instance) stays readable (`GET /v1/calls/{id}`);
    /// its events stay in the log. The retention is a standing cleaner of `ebb serve`
    /// (`cleaner::local::retention`), evaluated every `forget_every_ms`.
    pub retention_ms: u64,
    /// How often the retention is applied.
    pub forget_every_ms: u64,
    /// The most ended calls (and instances) kept, and the most memory they take, whatever their
    /// age (`cleaner::local::hold_within`).
    pub retention_bounds: RetentionBounds,
    /// Calls queued for one target at once (`--max-queued-per-target`).
    pub max_queued_per_target: usize,
    /// A message of a call the log does not know is deleted, not run, once it was put longer
    /// ago than this ([`FORGOTTEN_AFTER_MS`]).
    pub forgotten_after_ms: u64,
}

/// How long after its put a message of a call the log does not know is taken for one whose call
/// ended and was forgotten (a Kafka partition read again from an older commit): deleted, never
/// run again. An enqueue puts, then records, so a message read in between is of a call about to
/// be recorded; that takes far less than this, with the put's own timeout (5 s), the hold-back
/// of another replica's unknown call (20 s in all) and clock skew between replicas. A call the
/// retention's age forgets sooner after its end (a retention shorter than this) stays known as
/// ended by its id until then (`KeepGone`).
pub const FORGOTTEN_AFTER_MS: u64 = 600_000;

impl Default for CallOptions {
    fn default() -> Self {
        Self {
            max_payload_bytes: 1 << 20,
            max_result_bytes: 1 << 20,
            max_log_bytes: 64 << 10,
            default_timeout_ms: 30_000,
            max_timeout_ms: 3_600_000,
            max_batch: 1_000,
            max_wait_ms: 30_000,
            hold_grace_ms: 60_000,
            runner_lease_ms: 15_000,
            max_runners: 10_000,
            retention_ms: 3_600_000,
            forget_every_ms: 60_000,
            retention_bounds: RetentionBounds {
                count: 100_000,
                bytes: 256 << 20,
            },
            max_queued_per_target: 100_000,
            forgotten_after_ms: FORGOTTEN_AFTER_MS,
        }
    }
}

/// A runner's load: calls in flight and how many it can run at once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load {
    pub in_flight: u32,
    pub capacity: u32,
}

impl Load {
    /// Parses `in_flight/capacity`.
    pub fn parse(s: &str) -> Option<Load> {
        let (a, b) = s.trim().split_once('/')?;
        Some(Load {
            in_flight: a.trim().parse().ok()?,
            capacity: b.trim().parse().ok()?,
        })
    }

    pub fn spare(self) -> u32 {
        self.capacity.saturating_sub(self.in_flight)
    }
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.in_flight, self.capacity)
    }
}

/// What a caller asks to enqueue.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewCall {
    /// A UUID; ebb makes a v7 one when absent.
    #[serde(default)]
    pub id: Option<String>,
    /// The route (or function) to call.
    pub target: String,
    /// How long the call may run once started.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// The runner whose partition the call goes to.
    #[serde(default)]
    pub partition: Option<String>,
    /// The HTTP request to send.
    #[serde(default)]
    pub payload: Option<PayloadIn>,
    /// The trace context and baggage of the enqueue request (its headers, not its JSON).
    #[serde(skip)]
    pub trace: Option<crate::event::CallTrace>,
}

/// An HTTP request as JSON: the body as text, or as base64 for bytes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadIn {
    #[serde(default)]
    pub method: Option<String>,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default)]
    pub body_base64: Option<String>,
}

/// Validates a call's HTTP request as given to the API: a method, an absolute path, valid
/// headers and a body given once (as text or base64) within `max_payload_bytes`.
pub fn payload(p: PayloadIn, max_payload_bytes: usize) -> Result<Payload, CallError> {
    let body = match (p.body, p.body_base64) {
        (Some(_), Some(_)) => {
            return Err(CallError::Bad(
                "give the payload body as body or body_base64, not both".into(),
            ));
        }
        (Some(text), None) => text.into_bytes(),
        (None, Some(b64)) => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|e| CallError::Bad(format!("body_base64: {e}")))?
        }
        (None, None) => Vec::new(),
    };
    if body.len() > max_payload_bytes {
        return Err(CallError::TooLarge(format!(
            "the payload body has {} bytes; the bound is {}",
            body.len(),
            max_payload_bytes
        )));
    }
    let method = p.method.unwrap_or_else(|| "POST".into());
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(CallError::Bad(format!("bad method {method:?}")));
    }
    let path = p.path.unwrap_or_else(|| "/".into());
    // What a runner sends must be a request target: a path (and query) a URI takes as it is.
    if !path.starts_with('/')
        || !(plain_target(&path) || path.parse::<http::uri::PathAndQuery>().is_ok())
    {
        return Err(CallError::Bad(format!("bad path {path:?}")));
    }
    for (k, v) in &p.headers {
        if http::header::HeaderName::from_bytes(k.as_bytes()).is_err()
            || http::header::HeaderValue::from_str(v).is_err()
        {
            return Err(CallError::Bad(format!("bad header {k:?}")));
        }
    }
    Ok(Payload {
        method,
        path,
        headers: p.headers,
        body: body.into(),
    })
}

/// Whether `path` has only characters RFC 3986 allows in a path and query as they are: then a
/// URI takes it without the parse (which copies it) to tell.
fn plain_target(path: &str) -> bool {
    path.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/-._~!$&'()*+,;=:@?%".contains(&b))
}

/// A call handed to a runner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    /// The call (the log's spec, shared).
    #[serde(with = "crate::event::shared")]
    pub call: Arc<CallSpec>,
    /// The Host to send it with through the proxy (a domain of the target route).
    pub host: String,
    /// The service to send it to directly instead of through the proxy (a function served
    /// elsewhere: its template's `serviceAddress`, as a service id).
    pub address: Option<String>,
    /// How the runner picks one of that service's instances (its template's traffic policy;
    /// `None`: the default).
    pub policy: Option<crate::discovery::Policy>,
    /// How many times it was handed to a runner.
    pub deliveries: u32,
}

/// The answer to one start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    pub id: String,
    /// Whether the runner may run the call.
    pub started: bool,
    /// Why not (`already_running`, `already_final`, `unknown_call`, or `stale_copy`: the
    /// runner was handed another copy than the log's, which comes back to be handed out again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// The call's state after the start.
    pub state: CallStatus,
    /// When a started call times out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at_ms: Option<u64>,
}

/// Why a start was not decided: another replica owns the call and could not be asked. The
/// message comes back later; nothing changed.
pub const OWNER_UNAVAILABLE: &str = "owner_unavailable";

/// How many times another replica's call its owner does not know yet is held back.
pub const UNKNOWN_DELIVERIES: u32 = 10;

/// How long such a call is held back the first time, in ms; it doubles each time after (20 ms
/// to 10.24 s, 20 s in all): the owner records a call moments after its put, but a stalled
/// owner must not have its call's message handed out and deleted (its start refused as
/// unknown) before it records it.
pub const UNKNOWN_BACK_MS: u64 = 20;

/// Until when to hold back the message of another replica's call its owner does not know (its
/// enqueue is put first and recorded after, so the message can be read in between), on its
/// `deliveries`th delivery at `now_ms`; `None` to hand it out (one its owner never records: the
/// enqueue failed or the owner stopped in between, never acknowledged; its start is refused).
pub fn hold_back_unknown(deliveries: u32, now_ms: u64) -> Option<u64> {
    let mutated = crate::mutation::active(crate::mutation::Mutation::HandOutUnknown);
    (deliveries <= UNKNOWN_DELIVERIES && !mutated)
        .then(|| now_ms.saturating_add(UNKNOWN_BACK_MS << deliveries.saturating_sub(1).min(16)))
}

/// A call's state as its owner tells another replica (`/runner/states`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerState {
    pub state: CallStatus,
    #[serde(default)]
    pub deadline_at_ms: Option<u64>,
}

/// A runner's report of a finished call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finish {
    pub id: String,
    pub outcome: Outcome,
    #[serde(default)]
    pub result: Option<CallResult>,
    #[serde(default)]
    pub log: String,
}

/// A call-service failure, mapped to HTTP by the API.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The request is malformed.
    #[error("{0}")]
    Bad(String),
    /// The target has `--max-queued-per-target` calls queued already.
    #[error("{0}")]
    TargetFull(String),
    /// A body is over its bound.
    #[error("{0}")]
    TooLarge(String),
    /// The target names no route or function.
    #[error("no route or function named {0:?}")]
    UnknownTarget(String),
    /// The queue refused or failed the put: nothing was recorded.
    #[error("the queue failed: {0}")]
    Queue(#[from] QueueError),
    /// The log failed.
    #[error(transparent)]
    Log(#[from] crate::log::Error),
    /// Another replica owns the call and could not be asked.
    #[error(transparent)]
    Peer(#[from] PeerError),
}

/// The start code of a call handed out with another copy than the one the log recorded.
pub const STALE_COPY: &str = "stale_copy";

pub fn reject_code(r: RejectReason) -> &'static str {
    match r {
        RejectReason::AlreadyRunning => "already_running",
        RejectReason::AlreadyFinal => "already_final",
        RejectReason::UnknownCall => "unknown_call",
    }
}

/// The job a runner gets for a call: the Host of its target route, or its function's address.
pub fn job_of(s: &State, spec: impl Into<Arc<CallSpec>>, deliveries: u32) -> Job {
    let spec = spec.into();
    let host = s
        .routes
        .by_name
        .get(&spec.target)
        .and_then(|r| r.spec.domains.first().cloned())
        .unwrap_or_default();
    let served = spec
        .target
        .strip_prefix("fn-")
        .and_then(|f| s.functions.templates.get(f))
        .and_then(|t| {
            let id = crate::functions::service_of(t.spec.service_address.as_deref()?).ok()?;
            Some((id.to_string(), t.spec.policy.as_ref()))
        });
    Job {
        call: spec,
        host,
        address: served.as_ref().map(|(id, _)| id.clone()),
        policy: served.and_then(|(_, p)| (!p.is_default()).then(|| p.clone())),
        deliveries,
    }
}

/// The queue message of a call: its spec, MessagePack with named fields, on its partition.
pub fn message_of(spec: &CallSpec) -> Message {
    // Sized up front for the field names and a few headers: the encoder would otherwise grow it
    // from nothing, copying it several times.
    let mut body = Vec::with_capacity(192 + spec.payload.body.len() + spec.id.len());
    rmp_serde::encode::write_named(&mut body, spec).expect("a call spec always encodes");
    Message::new(
        spec.id.clone(),
        spec.partition.clone().unwrap_or_default(),
        body,
    )
}

/// The call a queue message carries (what [`message_of`] wrote); `None` for a message that is
/// not a call, or not the call its id names.
pub fn spec_of(m: &Message) -> Option<CallSpec> {
    rmp_serde::from_slice::<CallSpec>(&m.body)
        .ok()
        .filter(|spec| spec.id == m.id)
}

/// `CallQueued` for the calls the log does not know yet; also the ids it knows as another copy
/// (for calls handed out as their messages say: stale handed-out copies).
pub fn record_handed_out(
    s: &State,
    specs: Vec<impl Into<Arc<CallSpec>>>,
) -> (Vec<Event>, Vec<String>) {
    let mut events = Vec::with_capacity(specs.len());
    let mut stale = Vec::new();
    for spec in specs {
        let spec = spec.into();
        match s.calls.get(&spec.id) {
            // Ended, and forgotten but kept known by its id: never recorded (and run) again.
            None if s.calls.gone(&spec.id).is_some() => {}
            None => events.push(Event::CallQueued { call: spec }),
            Some(c) if c.spec != spec => stale.push(spec.id.clone()),
            Some(_) => {}
        }
    }
    (events, stale)
}

/// The bounds on the ended calls and on the ended instances the projection keeps, besides their
/// age (`--call-retention-count`, `--call-retention-bytes`): the retention's age alone lets a
/// busy replica hold an hour of calls, each with its payload, result and log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionBounds {
    /// At most this many ended calls, and as many ended instances.
    pub count: u64,
    /// Taking at most about this many bytes of memory (each of the two).
    pub bytes: u64,
}

impl RetentionBounds {
    /// Whether the ended calls or the ended instances of `s` are over the bounds.
    pub fn exceeded(&self, s: &State) -> bool {
        s.calls.ended.over(self.count, self.bytes) || s.functions.ended.over(self.count, self.bytes)
    }

    /// What a forgetting keeps: an eighth under each bound, so that the next one comes only
    /// once an eighth of the bound has ended again.
    pub fn kept(&self) -> Kept {
        Kept {
            count: self.count - self.count / 8,
            bytes: self.bytes - self.bytes / 8,
        }
    }

    /// The most forgotten calls a forgetting by age keeps known by their id
    /// ([`KeepGone`](crate::event::KeepGone)): [`GONE_PER_KEPT`](crate::state::calls::GONE_PER_KEPT)
    /// times the count.
    pub fn most_gone(&self) -> u64 {
        self.count
            .saturating_mul(crate::state::calls::GONE_PER_KEPT)
    }

    /// One step of bringing the ended calls and instances back within
    /// [`RetentionBounds::kept`]: about `most` of the oldest of each go (with the rest of the
    /// last millisecond's; a running instance's current step call stays, as with the age), while
    /// they are over what is kept. A forgetting holds the log's
    /// writer, and every decision waits behind it: the bounds forget [`FORGET_STEP`] a
    /// decision, one after the other, not an eighth of the bound at once
    /// ([`RetentionBounds::exceeded`] says when to begin, an empty step when it is done).
    pub fn step(&self, s: &State, most: u64) -> Vec<Event> {
        let within = self.kept();
        let mut events = Vec::new();
        if let Some(cut) = step_target(s.calls.ended.tally(), within, most)
            .and_then(|t| s.calls.ended.cut_within(t.count, t.bytes))
        {
            // Nothing to forget when all that ended before the cut are running instances'
            // current steps (a look that stops at the first call it may forget).
            if s.calls
                .any_ended_before(cut, &s.functions.current_step_calls())
            {
                events.push(Event::CallsForgotten {
                    finished_before_ms: cut,
                    within: Some(within),
                    keep_gone: None,
                });
            }
        }
        if let Some(cut) = step_target(s.functions.ended.tally(), within, most)
            .and_then(|t| s.functions.ended.cut_within(t.count, t.bytes))
        {
            events.push(Event::InstancesForgotten {
                finished_before_ms: cut,
                within: Some(within),
            });
        }
        events
    }
}

/// The most ended calls (and instances) one decision of the retention's bounds forgets, about
/// ([`RetentionBounds::step`]).
pub const FORGET_STEP: u64 = 2_048;

/// What a step of about `most` items leaves of `tally` when it is over `within`: `most` fewer,
/// and about their bytes fewer, never under `within`.
fn step_target(tally: crate::state::Tally, within: Kept, most: u64) -> Option<crate::state::Tally> {
    if !tally.over(within.count, within.bytes) {
        return None;
    }
    let each = tally.bytes / tally.count.max(1);
    Some(crate::state::Tally {
        count: tally.count.saturating_sub(most).max(within.count),
        bytes: tally
            .bytes
            .saturating_sub(each.saturating_mul(most))
            .max(within.bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A path `plain_target` passes is one a URI takes as it is: the parse it skips would
        /// have accepted it unchanged.
        #[test]
        fn a_plain_target_is_a_path_a_uri_takes_as_it_is(path in "/[ -~]{0,40}") {
            if plain_target(&path) {
                let parsed = path.parse::<http::uri::PathAndQuery>();
                proptest::prop_assert!(parsed.is_ok(), "{path:?}");
                let parsed = parsed.expect("parsed");
                proptest::prop_assert_eq!(parsed.as_str(), path.as_str());
            }
        }
    }

    #[test]
    fn a_target_with_a_space_or_a_fragment_is_not_plain() {
        assert!(plain_target("/a/b?c=d&e=%20"));
        assert!(!plain_target("/a b"));
        assert!(!plain_target("/a#b"));
        assert!(!plain_target("/a\"b"));
    }
}
