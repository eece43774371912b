//! The call service: the runner API's semantics, shared by its HTTP face (`api/runner.rs`) and
//! the built-in runner, which calls it in process.
//!
//! * **enqueue** puts calls on the [`Queue`] first and records `CallQueued` after; a failed put
//!   records nothing. A call the queue has but the log does not (ebb stopped in between) is
//!   recorded when it is delivered, so a runner never meets a call the log does not know.
//! * **dequeue** hands out up to `max` calls, waiting up to `wait_ms` for one. A delivered
//!   message of a call the log knows is handed out with the log's copy of the call. An aborted
//!   put's message is dropped only if the call was never recorded.
//! * **start** is the conditional transition of [`crate::state::calls`], decided on the log's
//!   writer: `queued -> running` is accepted (and the message is held until the deadline plus
//!   `hold_grace_ms`, so it is not redelivered while the call may still run); `running` -> the
//!   call becomes `error`, the message is deleted, refused; final -> the message is deleted,
//!   refused.
//! * **finish** records the first result and deletes the message; repeating it changes nothing
//!   and answers the same.
//! * Runners report their load (`in_flight/capacity`) on every request; work without a partition
//!   goes to the least-loaded live runner (on a queue that steers by runner name, the embedded
//!   one; on Kafka the consumer group spreads the calls over the runners). A runner not heard
//!   from for `runner_lease_ms` is gone (a runner inside a long poll counts as heard from): its
//!   reserved calls go back to the queue for others.
//! * **expire** ([`Calls::expire`], every 100 ms): running calls past their deadline (from the
//!   schedule) become `timeout`; every 5 s, queued calls whose message is gone (the projection's
//!   index of queued calls, [`Calls::recover`]) are put back; runners not heard from for the
//!   lease are released.
//! * [`Calls::put_and_decide`] puts calls built elsewhere (function steps) and records them in a
//!   decision of the caller's; what the decision does not record is deleted from the queue.
//!
//! Ended calls leave the projection with the retention, a standing cleaner
//! (`ebb_core::cleaner::config`), once their age passes it, or sooner when they are more than its
//! bounds (`RetentionBounds`, held by `cleaner::local::hold_within`). A call the bounds forgot
//! stays known as ended by its id (`Calls::gone`): its message delivered again is deleted, not
//! run, and a copy or an enqueue of it again is not recorded. So does one the age forgot within
//! `forgotten_after_ms` of its end (a retention shorter than that: `KeepGone`).
//!
//! **Several replicas** ([`Calls::with_peers`]): a call belongs to the replica that accepted it
//! ([`crate::peers`]: its id is `OWNER.UUID`). `start` and `finish` of another's calls go to the
//! owner's runner API, one request per owner and batch: the message is held here first, then
//! held to the deadline, deleted or, while the owner cannot be asked, held back for
//! `RETRY_AFTER_S` and answered `owner_unavailable`. `dequeue` asks the owner
//! (`/runner/states`) what became of another's calls before handing them out, as it asks its own
//! log for its own; one the owner does not know yet (an enqueue puts, then records) is held back
//! (`hold_back_unknown`: 20 ms, doubling, ten times) rather than handed out, since the owner would
//! refuse its start as unknown and delete the message of a call it is about to record. Past
//! that bound the message is handed out with its copy remembered, and the forwarded start sends
//! the owner the copy: an owner that still does not know the call (its record stalled between
//! the put and the record) records it from the copy, as it would a delivered message of its own,
//! so an acknowledged call never loses its message. A message of a call the log does not know
//! that was put more than `forgotten_after_ms` ago (10 minutes; Kafka says when a record was
//! put) is of a call that ended and was forgotten (a partition read again from an older commit),
//! or whose enqueue never finished: it is deleted, on the replica that read it and for calls
//! another replica owns, never run again. A failed
//! put is recorded (`CallsAborted`), so its message never runs should it land after all, across
//! restarts too. On Kafka a message's key is the partition the enqueue named, else shared by runs
//! of `KEY_RUN` calls of a put: calls spread over every partition, so every replica's runners
//! share them (`Queue::steers_to_runners` is false there: steering to the least-loaded runner is
//! the embedded queue's).

pub mod runner;

pub use ebb_core::calls::*;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;

use crate::clock::Clock;
use crate::event::{CallKind, CallSpec, Event};
use crate::log::Log;
use crate::peers::{PeerError, Peers};
use crate::queue::{Message, Queue, QueueError};
use crate::state::calls::{
    CallStatus, StartVerdict, decide_cancel, decide_finish, decide_start, decide_timeouts,
};
use crate::state::{Due, State};

/// A set of call ids hashed with foldhash, as the log's call map is: each enqueue, start and
/// finish hashes its ids a few times, and the standard library's SipHash was 1 % of ebb's CPU on
/// the Kafka calls path.
type IdHashSet<T> = HashSet<T, foldhash::fast::RandomState>;

/// A batch answer (`{"results": [...]}`), as the runner API gives it.
#[derive(Debug, Deserialize)]
struct Results<T> {
    results: Vec<T>,
}

/// A call's id and state, as a finish answers.
#[derive(Debug, Deserialize)]
struct IdState {
    id: String,
    state: CallStatus,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    load: Load,
    at_ms: u64,
    /// Dequeues of this runner under way: a runner waiting in a long-poll is alive.
    polls: u32,
}

/// The call service.
pub struct Calls {
    log: Arc<Log>,
    queue: Arc<dyn Queue>,
    clock: Arc<dyn Clock>,
    options: CallOptions,
    runners: Mutex<HashMap<String, Seen>>,
    /// When this service started: runners the queue names but that are not back one lease later
    /// are released.
    started_at_ms: u64,
    owners_checked: std::sync::atomic::AtomicBool,
    recovered_at_ms: AtomicU64,
    /// Ids whose put failed (the caller got 500): never run if a queue delivers them anyway (a
    /// Kafka produce that timed out may still land).
    aborted: Mutex<IdSet>,
    /// Calls handed out with their message's copy before the log recorded them, whose record
    /// turned out to be another copy (the same id enqueued again with other contents): their
    /// start is refused and the message comes back with the log's copy. Shared with the writer.
    stale: Arc<Mutex<IdSet>>,
    /// This replica and the others: starts and finishes of calls another replica owns go to it.
    peers: Arc<Peers>,
    /// The token sent with what is forwarded to an owner (the runner token, or this replica's
    /// ServiceAccount token).
    peer_token: Arc<crate::peers::PeerToken>,
    /// The enqueues under way (put or being put, not yet recorded), by a number of their own:
    /// their calls count against `max_queued_per_target` with the log's queued calls. One entry
    /// an enqueue, not one a call: an enqueue of a batch adds and removes one entry, its ids
    /// shared with its answer.
    reserved: Mutex<Reservations>,
    /// Told each time enqueues under way end (recorded, or never queued): a states request
    /// about one of them waits for it (see [`Calls::states`]).
    settled: tokio::sync::Notify,
    /// Other replicas' calls handed out while their owner did not know them (past the hold-back
    /// bound), by id: a forwarded start sends the owner the copy, which it records if it still
    /// does not know the call (its record stalled), so the call is not lost.
    handed_unknown: Mutex<Bounded<CallSpec>>,
    /// This replica's calls whose start it refused as unknown (the message deleted): should
    /// the enqueue's record come after all (it stalled), the message is put again.
    refused_unknown: Mutex<IdSet>,
}

/// Most handed-out copies of unknown calls remembered (each is forgotten at its start).
const MAX_COPIES: usize = 10_000;

/// Decodes the copies a forwarded start carries (`wire::StartBody::copies`).
pub fn decode_copies(
    copies: std::collections::BTreeMap<String, String>,
) -> Result<Vec<CallSpec>, String> {
    use base64::Engine as _;
    copies
        .into_iter()
        .map(|(id, b64)| {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|e| format!("the copy of call {id} is not base64: {e}"))?;
            let spec: CallSpec = rmp_serde::from_slice(&bytes)
                .map_err(|e| format!("the copy of call {id} is not a call: {e}"))?;
            if spec.id != id {
                return Err(format!("the copy given for call {id} is call {}", spec.id));
            }
            Ok(spec)
        })
        .collect()
}

/// The enqueues under way, each by its number.
#[derive(Default)]
struct Reservations {
    next: u64,
    under_way: HashMap<u64, UnderWay>,
}

impl Reservations {
    /// Calls of the enqueues under way for `target`.
    fn calls_for(&self, target: &str) -> usize {
        self.under_way
            .values()
            .flat_map(|u| &u.targets)
            .filter(|(t, _)| t == target)
            .map(|(_, n)| n)
            .sum()
    }

    /// The ids of the enqueues under way for `target`.
    fn ids_for<'a>(&'a self, target: &'a str) -> impl Iterator<Item = &'a String> + 'a {
        self.under_way
            .values()
            .filter(move |u| u.targets.iter().any(|(t, _)| t == target))
            .flat_map(move |u| {
                u.ids
                    .iter()
                    .zip(&u.of_target)
                    .filter(move |(_, t)| u.targets[**t].0 == target)
                    .map(|(id, _)| id)
            })
    }

    /// Whether any of `ids` is a call of an enqueue under way: one look at the ids under way
    /// for one id, a set of them for several.
    fn holds(&self, ids: &[&str]) -> bool {
        let mut under_way = self.under_way.values().flat_map(|u| u.ids.iter());
        match ids {
            [] => false,
            [id] => under_way.any(|i| i == id),
            _ => {
                let held: IdHashSet<&str> = under_way.map(String::as_str).collect();
                ids.iter().any(|id| held.contains(id))
            }
        }
    }
}

/// An enqueue under way: its calls' ids, each one's target (an index of `targets`), and how
/// many calls each target has.
struct UnderWay {
    ids: Arc<Vec<String>>,
    of_target: Vec<usize>,
    targets: Vec<(String, usize)>,
}

/// Room reserved by an enqueue under way for its calls; dropping it gives the room back (by
/// then the log counts the calls, or they were never queued).
struct Reserved<'a> {
    calls: &'a Calls,
    number: u64,
    /// The enqueue's ids, in its order (its answer, once the guard is gone).
    ids: Arc<Vec<String>>,
}

impl Reserved<'_> {
    /// Gives the room back and returns the enqueue's ids.
    fn settle(self) -> Vec<String> {
        let ids = self.ids.clone();
        drop(self);
        Arc::try_unwrap(ids).unwrap_or_else(|ids| (*ids).clone())
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.calls
            .reserved
            .lock()
            .expect("reserved lock")
            .under_way
            .remove(&self.number);
        self.calls.settled.notify_waiters();
    }
}

/// Start requests this process served (a runner's, or one forwarded by another replica), and
/// the calls they asked to start: their ratio is how many calls runners start at once
/// (`ebb_call_start_requests_total`, `ebb_call_start_request_calls_total`).
static START_REQUESTS: AtomicU64 = AtomicU64::new(0);
static START_REQUEST_CALLS: AtomicU64 = AtomicU64::new(0);

/// The start requests this process served and the calls they asked to start, so far.
pub fn start_requests() -> (u64, u64) {
    (
        START_REQUESTS.load(Ordering::Relaxed),
        START_REQUEST_CALLS.load(Ordering::Relaxed),
    )
}

/// How long a states request waits for this replica's enqueues under way to be recorded.
const STATES_WAIT: Duration = Duration::from_secs(1);

/// Most failed-put ids remembered.
const MAX_ABORTED: usize = 100_000;

/// Most stale handed-out copies remembered (each is forgotten at its start).
const MAX_STALE: usize = 10_000;

/// Values by id, bounded to `max`: beyond it, the oldest are forgotten first.
#[derive(Debug)]
struct Bounded<V> {
    by_id: HashMap<String, V>,
    order: std::collections::VecDeque<String>,
    max: usize,
}

/// A set of ids bounded to `max`.
type IdSet = Bounded<()>;

impl<V> Bounded<V> {
    fn new(max: usize) -> Self {
        Self {
            by_id: HashMap::new(),
            order: std::collections::VecDeque::new(),
            max,
        }
    }

    fn put(&mut self, id: &str, value: V) {
        if self.by_id.insert(id.to_owned(), value).is_none() {
            self.order.push_back(id.to_owned());
        }
        while self.order.len() > self.max {
            if let Some(old) = self.order.pop_front() {
                self.by_id.remove(&old);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    fn get(&self, id: &str) -> Option<&V> {
        self.by_id.get(id)
    }

    fn contains(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    fn take(&mut self, id: &str) -> Option<V> {
        let v = self.by_id.remove(id)?;
        self.order.retain(|o| o != id);
        Some(v)
    }

    fn remove(&mut self, id: &str) -> bool {
        self.take(id).is_some()
    }
}

impl IdSet {
    fn insert(&mut self, id: &str) {
        self.put(id, ());
    }
}

impl std::fmt::Debug for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calls")
            .field("options", &self.options)
            .finish()
    }
}

impl Calls {
    /// A call service over the log and a queue.
    pub fn new(
        log: Arc<Log>,
        queue: Arc<dyn Queue>,
        clock: Arc<dyn Clock>,
        options: CallOptions,
    ) -> Self {
        let started_at_ms = clock.now_ms();
        Self {
            log,
            queue,
            clock,
            options,
            runners: Mutex::new(HashMap::new()),
            started_at_ms,
            owners_checked: std::sync::atomic::AtomicBool::new(false),
            recovered_at_ms: AtomicU64::new(started_at_ms),
            aborted: Mutex::new(IdSet::new(MAX_ABORTED)),
            stale: Arc::new(Mutex::new(IdSet::new(MAX_STALE))),
            peers: Arc::new(Peers::alone()),
            peer_token: Arc::new(crate::peers::PeerToken::None),
            reserved: Mutex::new(Reservations::default()),
            settled: tokio::sync::Notify::new(),
            handed_unknown: Mutex::new(Bounded::new(MAX_COPIES)),
            refused_unknown: Mutex::new(IdSet::new(MAX_STALE)),
        }
    }

    /// One of several replicas: `peers` names this one (its name goes into the ids of the calls
    /// it accepts) and finds the others; `token` is what this replica presents to them.
    pub fn with_peers(mut self, peers: Arc<Peers>, token: crate::peers::PeerToken) -> Self {
        self.peers = peers;
        self.peer_token = Arc::new(token);
        self
    }

    /// This replica and the others.
    pub fn peers(&self) -> &Arc<Peers> {
        &self.peers
    }

    /// The bounds in force.
    pub fn options(&self) -> &CallOptions {
        &self.options
    }

    /// The log.
    pub fn log(&self) -> &Arc<Log> {
        &self.log
    }

    /// The queue.
    pub fn queue(&self) -> &Arc<dyn Queue> {
        &self.queue
    }

    /// Notes a runner's load.
    pub fn seen(&self, runner: &str, load: Option<Load>) {
        let now = self.clock.now_ms();
        let mut runners = self.runners.lock().expect("runners lock");
        if runners.len() >= self.options.max_runners && !runners.contains_key(runner) {
            return;
        }
        let e = runners.entry(runner.to_owned()).or_insert(Seen {
            load: Load::default(),
            at_ms: now,
            polls: 0,
        });
        e.at_ms = now;
        if let Some(l) = load {
            e.load = l;
        }
    }

    /// The load recorded for a runner.
    pub fn load_of(&self, runner: &str) -> Option<Load> {
        self.runners
            .lock()
            .expect("runners lock")
            .get(runner)
            .map(|s| s.load)
    }

    /// The live runner with the most spare capacity, if any has some.
    fn least_loaded(&self) -> Option<String> {
        let now = self.clock.now_ms();
        let runners = self.runners.lock().expect("runners lock");
        runners
            .iter()
            .filter(|(_, s)| now.saturating_sub(s.at_ms) < self.options.runner_lease_ms)
            .filter(|(_, s)| s.load.spare() > 0)
            .max_by_key(|(name, s)| {
                (
                    s.load.spare(),
                    std::cmp::Reverse((*name).clone()), // ties: the first name
                )
            })
            .map(|(name, _)| name.clone())
    }

    fn is_live(&self, runner: &str) -> bool {
        let now = self.clock.now_ms();
        self.runners
            .lock()
            .expect("runners lock")
            .get(runner)
            .is_some_and(|s| now.saturating_sub(s.at_ms) < self.options.runner_lease_ms)
    }

    /// Validates a new call into a spec; `known`: whether the log knows its target.
    fn spec(&self, new: NewCall, known: bool) -> Result<CallSpec, CallError> {
        let id = match new.id {
            Some(id) => {
                let (owner, u) = crate::peers::parse_id(&id).map_err(CallError::Bad)?;
                if let Some(o) = owner
                    && Some(o) != self.peers.me()
                {
                    return Err(CallError::Bad(format!(
                        "call id {id:?} belongs to replica {o}: enqueue it there (alone, it is forwarded)"
                    )));
                }
                // A bare UUID becomes this replica's.
                crate::peers::id_of(self.peers.me(), u)
            }
            None => self.peers.new_id(),
        };
        if new.target.is_empty() {
            return Err(CallError::Bad("a call needs a target".into()));
        }
        if !known {
            return Err(CallError::UnknownTarget(new.target));
        }
        let timeout_ms = new.timeout_ms.unwrap_or(self.options.default_timeout_ms);
        if timeout_ms == 0 || timeout_ms > self.options.max_timeout_ms {
            return Err(CallError::Bad(format!(
                "timeout_ms must be between 1 and {}",
                self.options.max_timeout_ms
            )));
        }
        let payload = payload(
            new.payload.unwrap_or_default(),
            self.options.max_payload_bytes,
        )?;
        let partition = match new.partition {
            Some(p) if !p.is_empty() => Some(p),
            _ => None,
        };
        let mut call = CallSpec {
            id,
            target: new.target,
            kind: CallKind::Async,
            timeout_ms,
            partition,
            trace: None,
            tracestate: None,
            baggage: None,
            payload,
        };
        if let Some(t) = new.trace {
            t.keep(&mut call);
        }
        Ok(call)
    }

    /// Refuses calls whose target would have more than `max_queued_per_target` queued, counting
    /// the calls of enqueues under way (put, not yet recorded) with those the log has queued.
    /// What passes is reserved until the returned guard is dropped (after the record), so
    /// concurrent enqueues never pass the bound together.
    fn check_room(&self, specs: &[CallSpec]) -> Result<Reserved<'_>, CallError> {
        let max = self.options.max_queued_per_target;
        // Each call's target, as an index of `targets`, with each target's count.
        let mut targets: Vec<(String, usize)> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut of_target = Vec::with_capacity(specs.len());
        for s in specs {
            let i = match targets.last() {
                // An enqueue's calls are mostly of one target.
                Some((t, _)) if *t == s.target => targets.len() - 1,
                _ => *index.entry(s.target.as_str()).or_insert_with(|| {
                    targets.push((s.target.clone(), 0));
                    targets.len() - 1
                }),
            };
            targets[i].1 += 1;
            of_target.push(i);
        }
        let mut reserved = self.reserved.lock().expect("reserved lock");
        let full = self.log.read(|s| {
            targets.iter().find_map(|(t, asked)| {
                let queued = s.calls.queued_for(t);
                // Room even if no reserved id were recorded yet: no need to look them up (the
                // look-up costs one search of the log's calls per call of the enqueues under way).
                let at_most = queued
                    .saturating_add(reserved.calls_for(t))
                    .saturating_add(*asked);
                if at_most <= max {
                    return None;
                }
                // Reserved ids the log knows by now are in `queued_for` already.
                let pending = reserved
                    .ids_for(t)
                    .filter(|id| s.calls.get(id).is_none())
                    .count();
                let have = queued.saturating_add(pending);
                (have.saturating_add(*asked) > max).then(|| (t.clone(), have))
            })
        });
        if let Some((target, queued)) = full {
            crate::limits::Limit::QueuedPerTarget.hit();
            return Err(CallError::TargetFull(format!(
                "{target:?} has {queued} calls queued; the bound is {max} (--max-queued-per-target)"
            )));
        }
        let ids = Arc::new(specs.iter().map(|s| s.id.clone()).collect::<Vec<_>>());
        let number = reserved.next;
        reserved.next += 1;
        reserved.under_way.insert(
            number,
            UnderWay {
                ids: ids.clone(),
                of_target,
                targets,
            },
        );
        Ok(Reserved {
            calls: self,
            number,
            ids,
        })
    }

    /// Enqueues calls: on the queue first, then in the log. Returns their ids.
    pub async fn enqueue(&self, calls: Vec<NewCall>) -> Result<Vec<String>, CallError> {
        if calls.len() > self.options.max_batch {
            return Err(CallError::Bad(format!(
                "{} calls in one batch; the bound is {}",
                calls.len(),
                self.options.max_batch
            )));
        }
        let mut specs = Vec::with_capacity(calls.len());
        let steers = self.queue.steers_to_runners();
        // Every target looked up in one read of the log.
        let known: Vec<bool> = self.log.read(|s| {
            calls
                .iter()
                .map(|c| s.routes.by_name.contains_key(&c.target))
                .collect()
        });
        for (c, known) in calls.into_iter().zip(known) {
            let mut spec = self.spec(c, known)?;
            let partition = match spec.partition.take() {
                // A live runner's, or (on a queue that does not steer by runner, Kafka) any key.
                Some(p) if !steers || self.is_live(&p) => Some(p),
                _ if steers => self.least_loaded(),
                _ => None,
            };
            spec.partition = partition;
            specs.push(spec);
        }
        let reserved = self.check_room(&specs)?;
        self.put_calls(&specs).await?;
        self.record_queued(specs).await?;
        let ids = reserved.settle();
        for id in &ids {
            tracing::debug!(call = %id, "queued");
        }
        Ok(ids)
    }

    /// Puts calls on the queue (the first half of an enqueue): a failed put marks them aborted,
    /// so a message that lands anyway is never handed out.
    async fn put_calls(&self, specs: &[CallSpec]) -> Result<(), CallError> {
        let messages = specs.iter().map(message_of).collect();
        if let Err(e) = self.put_new(messages).await {
            if matches!(e, QueueError::Duplicate(_)) {
                // The same ids enqueued at the same moment: those messages are the other
                // enqueue's, not aborted ones.
                return Err(e.into());
            }
            {
                let mut aborted = self.aborted.lock().expect("aborted lock");
                for s in specs {
                    aborted.insert(&s.id);
                }
            }
            // Durably too, so a restart does not forget them (a Kafka produce that timed out
            // may still land). Should the log fail as well, the memory above still holds.
            let ids: Vec<String> = specs.iter().map(|s| s.id.clone()).collect();
            if let Err(le) = self
                .log
                .decide(move |_: &State, _| (vec![Event::CallsAborted { ids }], ()))
                .await
            {
                tracing::warn!(error = %le, "recording aborted calls failed");
            }
            return Err(e.into());
        }
        Ok(())
    }

    /// Puts calls built elsewhere (function steps) on the queue, then runs `decide` on the log's
    /// writer; `decide` returns the events to record, `CallQueued` for these calls among them
    /// (or not: a call the log never records is recorded when delivered, or dropped if aborted).
    /// The put comes first, as for every enqueue.
    pub async fn put_and_decide<R, F>(
        &self,
        specs: Vec<CallSpec>,
        decide: F,
    ) -> Result<R, CallError>
    where
        R: Send + 'static,
        F: FnOnce(&State, u64) -> (Vec<Event>, R) + Send + 'static,
    {
        let ids: Vec<String> = specs.iter().map(|s| s.id.clone()).collect();
        self.put_calls(&specs).await?;
        let (r, _) = self.log.decide(decide).await?;
        // Messages of calls the decision did not record (it refused) must not run.
        let unrecorded: Vec<String> = self.log.read(|s| {
            ids.into_iter()
                .filter(|id| s.calls.get(id).is_none())
                .collect()
        });
        if !unrecorded.is_empty() {
            self.queue.delete(unrecorded).await?;
        }
        Ok(r)
    }

    /// Puts messages, skipping those whose id is on the queue already: an enqueue retried with
    /// the same call id (its answer was lost, or the log write failed after the put) is the same
    /// call, not a new one, and must not abort the first.
    async fn put_new(&self, mut messages: Vec<Message>) -> Result<(), QueueError> {
        let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
        if let Some(missing) = self.queue.missing(&ids)
            && missing.len() < messages.len()
        {
            let missing: HashSet<String> = missing.into_iter().collect();
            messages.retain(|m| missing.contains(&m.id));
        }
        if messages.is_empty() {
            return Ok(());
        }
        self.queue.put(messages).await
    }

    /// Puts back on the queue the queued calls it lost (a machine crash can take unsynced puts
    /// away; the log, synced before any enqueue was answered, still has them). Run at start-up,
    /// before runners are served; returns how many were put back.
    pub async fn recover(&self) -> Result<usize, CallError> {
        // A queue that cannot tell what it lost (Kafka's puts are durable on their own) needs
        // no look at the log, which would sort every queued id under its read lock.
        if self.queue.missing(&[]).is_none() {
            return Ok(0);
        }
        let queued: Vec<Arc<CallSpec>> = self.log.read(|s| {
            s.calls
                .queued_in_order()
                .into_iter()
                .filter_map(|id| s.calls.get(id))
                .map(|c| c.spec.clone())
                .collect()
        });
        let mut restored = 0;
        for chunk in queued.chunks(self.options.max_batch.max(1)) {
            let ids: Vec<&str> = chunk.iter().map(|c| c.id.as_str()).collect();
            let Some(missing) = self.queue.missing(&ids) else {
                return Ok(0);
            };
            if missing.is_empty() {
                continue;
            }
            let missing: HashSet<String> = missing.into_iter().collect();
            let messages: Vec<Message> = chunk
                .iter()
                .filter(|c| missing.contains(&c.id))
                .map(|c| message_of(c))
                .collect();
            restored += messages.len();
            self.queue.put(messages).await?;
        }
        if restored > 0 {
            tracing::warn!(
                calls = restored,
                "queued calls the queue had lost were put back"
            );
        }
        Ok(restored)
    }

    /// Records `CallQueued` for calls the log does not know yet. A call whose start this
    /// replica refused as unknown meanwhile (its record stalled; the message was deleted) gets
    /// its message put again.
    async fn record_queued(&self, specs: Vec<CallSpec>) -> Result<(), CallError> {
        let again: Vec<Message> = {
            let mut refused = self.refused_unknown.lock().expect("refused lock");
            if refused.is_empty() {
                Vec::new()
            } else {
                specs
                    .iter()
                    .filter(|s| refused.remove(&s.id))
                    .map(message_of)
                    .collect()
            }
        };
        self.log
            .decide(move |s: &State, _| (record_handed_out(s, specs).0, ()))
            .await?;
        if !again.is_empty() {
            tracing::warn!(
                calls = again.len(),
                "calls recorded after their start was refused as unknown: their messages are put again"
            );
            self.queue.put(again).await?;
        }
        Ok(())
    }

    /// Hands up to `max` calls to `runner`, waiting up to `wait_ms` for one.
    pub async fn dequeue(
        &self,
        runner: &str,
        max: usize,
        wait_ms: u64,
    ) -> Result<Vec<Job>, CallError> {
        let max = max.clamp(1, self.options.max_batch);
        let wait = Duration::from_millis(wait_ms.min(self.options.max_wait_ms));
        let messages = {
            let _polling = Polling::new(self, runner);
            self.queue.reserve(runner, max, wait).await?
        };
        // Failed puts this replica remembers (one look at the set for the whole batch).
        let in_memory: Vec<bool> = {
            let aborted = self.aborted.lock().expect("aborted lock");
            messages
                .iter()
                .map(|m| !aborted.is_empty() && aborted.contains(&m.id))
                .collect()
        };
        // Calls other replicas own: their owners say what became of them.
        let (foreign, local): (Vec<_>, Vec<_>) = messages
            .into_iter()
            .zip(in_memory)
            .partition(|(m, _)| self.peers.other_owner(&m.id).is_some());
        let mut broken = Vec::new();
        let mut foreign_jobs = if foreign.is_empty() {
            Vec::new()
        } else {
            // Aborted puts' messages are dropped, as this replica's are below.
            let (aborted, foreign): (Vec<_>, Vec<_>) = self.log.read(|s| {
                foreign.into_iter().partition(|(m, in_memory)| {
                    s.calls.get(&m.id).is_none() && (*in_memory || s.calls.is_aborted(&m.id))
                })
            });
            broken.extend(aborted.into_iter().map(|(m, _)| m.id));
            let mut specs = Vec::with_capacity(foreign.len());
            for (m, _) in foreign {
                match decode_message(&m) {
                    Some(spec) => specs.push((spec, m.deliveries, m.put_at_ms)),
                    None => broken.push(m.id),
                }
            }
            self.hand_out_foreign(specs).await?
        };
        // This replica's calls, in one look at the log. A known call is handed out as the log
        // records it (a message put by a decision that lost a race to another with the same id
        // carries the loser's copy), so its message is not decoded; one that already ended (a
        // redelivery) is deleted instead, and a running one is held again. A call the log does
        // not know yet (its enqueue is still under way, or ebb stopped between put and record)
        // is handed out as its message says; an aborted put's message is dropped, unless the
        // call was recorded after all (the same id enqueued again, or a step decided again):
        // then it is that call's.
        let grace = self.options.hold_grace_ms;
        let now = self.clock.now_ms();
        let after = self.options.forgotten_after_ms;
        let (jobs, unknown, recorded, done, running, bad) = self.log.read(|s| {
            let mut jobs = Vec::with_capacity(local.len());
            let mut unknown = Vec::new();
            let mut recorded = Vec::with_capacity(local.len());
            let mut done = Vec::new();
            let mut running = Vec::new();
            let mut bad = Vec::new();
            for (m, in_memory) in local {
                let spec = match s.calls.get(&m.id) {
                    Some(c) if c.status.is_final() => {
                        done.push(m.id);
                        continue;
                    }
                    // Started already (a queue that lost the hold, e.g. Kafka after a restart):
                    // held again, never handed out twice.
                    Some(c) if c.status == CallStatus::Running => {
                        let until = c
                            .deadline_at_ms
                            .unwrap_or(0)
                            .saturating_add(grace)
                            .max(now.saturating_add(grace));
                        running.push((m.id, until));
                        continue;
                    }
                    Some(c) => {
                        recorded.push((m.id, in_memory));
                        c.spec.clone()
                    }
                    // Ended, and forgotten but kept known by its id, or forgotten long ago (a
                    // message put longer ago than any enqueue takes to record): never run again.
                    None if s.calls.gone(&m.id).is_some()
                        || put_long_ago(m.put_at_ms, now, after) =>
                    {
                        done.push(m.id);
                        continue;
                    }
                    None if in_memory || s.calls.is_aborted(&m.id) => {
                        bad.push(m.id);
                        continue;
                    }
                    None => match decode_message(&m) {
                        Some(spec) => {
                            let spec = Arc::new(spec);
                            unknown.push(spec.clone());
                            spec
                        }
                        None => {
                            bad.push(m.id);
                            continue;
                        }
                    },
                };
                jobs.push(job_of(s, spec, m.deliveries));
            }
            (jobs, unknown, recorded, done, running, bad)
        });
        broken.extend(bad);
        if recorded.iter().any(|(_, in_memory)| *in_memory) {
            let mut aborted = self.aborted.lock().expect("aborted lock");
            for (id, _) in recorded.iter().filter(|(_, in_memory)| *in_memory) {
                aborted.remove(id);
            }
        }
        {
            // Handed out as the log's copy now: an earlier delivery's stale mark is void.
            let mut stale = self.stale.lock().expect("stale lock");
            if !stale.is_empty() {
                for (id, _) in &recorded {
                    stale.remove(id);
                }
            }
        }
        if !unknown.is_empty() {
            // Recorded before the answer leaves, without waiting for the writer: the start that
            // must come before any run is decided after this and acknowledged only once durable,
            // which covers this too. A crash in between can only refuse that start, for a call
            // never acknowledged. Should the log have recorded another copy meanwhile, the start
            // is refused as stale and the message comes back with the log's copy.
            let stale = self.stale.clone();
            self.log
                .submit(move |s: &State, _| {
                    let (events, stale_ids) = record_handed_out(s, unknown);
                    if !stale_ids.is_empty() {
                        let mut stale = stale.lock().expect("stale lock");
                        for id in stale_ids {
                            stale.insert(&id);
                        }
                    }
                    events
                })
                .await?;
        }
        if !running.is_empty() {
            self.queue.hold(running).await?;
        }
        broken.extend(done);
        if !broken.is_empty()
            && let Err(e) = self.queue.delete(broken).await
        {
            tracing::warn!(error = %e, "deleting finished calls' messages failed");
        }
        let mut jobs = jobs;
        jobs.append(&mut foreign_jobs);
        Ok(jobs)
    }

    /// The delivered messages of calls other replicas own, checked with their owners (one
    /// request per owner) as a local call is checked with the log: an ended call's message is
    /// deleted, a running one's held again, and a queued or unknown one handed out as its
    /// message says (its owner decides the start). While an owner cannot be asked its messages
    /// are held back for [`crate::peers::RETRY_AFTER_S`] and not handed out.
    async fn hand_out_foreign(
        &self,
        specs: Vec<(CallSpec, u32, Option<u64>)>,
    ) -> Result<Vec<Job>, CallError> {
        let (_, by_owner) = self.by_owner(specs, |(spec, _, _)| &spec.id);
        let grace = self.options.hold_grace_ms;
        let mut out = Vec::new();
        for (owner, specs) in by_owner {
            let ids: Vec<String> = specs.iter().map(|(c, _, _)| c.id.clone()).collect();
            let asked = self
                .peers
                .post::<Results<Option<PeerState>>>(
                    &owner,
                    "/runner/states",
                    self.peer_token.get().as_deref(),
                    &serde_json::json!({ "ids": ids }),
                )
                .await;
            let now = self.clock.now_ms();
            let states = match asked {
                Ok(Ok(r)) if r.results.len() == ids.len() => r.results,
                other => {
                    if let Ok(Err((status, body))) = &other {
                        tracing::warn!(%owner, status, body = %body, "an owner refused a states request");
                    }
                    let back = now.saturating_add(crate::peers::RETRY_AFTER_S * 1000);
                    self.queue
                        .hold(ids.into_iter().map(|id| (id, back)).collect())
                        .await?;
                    continue;
                }
            };
            let (mut done, mut running, mut give) = (Vec::new(), Vec::new(), Vec::new());
            for ((spec, deliveries, put_at_ms), state) in specs.into_iter().zip(states) {
                match state {
                    // Its owner forgot it (the retention's age): never run again.
                    None if put_long_ago(put_at_ms, now, self.options.forgotten_after_ms) => {
                        done.push(spec.id)
                    }
                    // Put but not recorded yet by its owner: back in a moment, as a start now
                    // would be refused as unknown and delete the message.
                    None if let Some(until) = hold_back_unknown(deliveries, now) => {
                        running.push((spec.id, until))
                    }
                    Some(p) if p.state.is_final() => done.push(spec.id),
                    Some(p) if p.state == CallStatus::Running => {
                        let until = p
                            .deadline_at_ms
                            .unwrap_or(0)
                            .saturating_add(grace)
                            .max(now.saturating_add(grace));
                        running.push((spec.id, until));
                    }
                    None => {
                        // Handed out although its owner does not know it: should the owner's
                        // record be stalled still, the start sends it this copy.
                        self.handed_unknown
                            .lock()
                            .expect("copies lock")
                            .put(&spec.id, spec.clone());
                        give.push((spec, deliveries))
                    }
                    _ => give.push((spec, deliveries)),
                }
            }
            if !running.is_empty() {
                self.queue.hold(running).await?;
            }
            if !done.is_empty()
                && let Err(e) = self.queue.delete(done).await
            {
                tracing::warn!(error = %e, "deleting finished calls' messages failed");
            }
            out.extend(self.log.read(|s| {
                give.into_iter()
                    .map(|(spec, d)| job_of(s, spec, d))
                    .collect::<Vec<_>>()
            }));
        }
        Ok(out)
    }

    /// Starts calls for `runner`: the conditional transition, one answer per id.
    pub async fn start(&self, runner: &str, ids: Vec<String>) -> Result<Vec<Started>, CallError> {
        self.start_with_copies(runner, ids, Vec::new()).await
    }

    /// [`Calls::start`], with the copies another replica forwarding the start sends of calls of
    /// this replica's it handed out unknown: those this replica still does not know (its
    /// record stalled between the put and the record) and did not abort are recorded from the
    /// copy first, as a delivered message of its own would be.
    pub async fn start_with_copies(
        &self,
        runner: &str,
        ids: Vec<String>,
        copies: Vec<CallSpec>,
    ) -> Result<Vec<Started>, CallError> {
        START_REQUESTS.fetch_add(1, Ordering::Relaxed);
        START_REQUEST_CALLS.fetch_add(ids.len() as u64, Ordering::Relaxed);
        if !copies.is_empty()
            && !crate::mutation::active(crate::mutation::Mutation::RefuseUnknownCopy)
        {
            let unknown: Vec<CallSpec> = {
                let aborted = self.aborted.lock().expect("aborted lock");
                self.log.read(|s| {
                    copies
                        .into_iter()
                        .filter(|c| ids.contains(&c.id))
                        .filter(|c| self.peers.other_owner(&c.id).is_none())
                        .filter(|c| s.calls.status(&c.id).is_none() && !s.calls.is_aborted(&c.id))
                        .filter(|c| !aborted.contains(&c.id))
                        .filter(|c| s.routes.by_name.contains_key(&c.target))
                        .collect()
                })
            };
            if !unknown.is_empty() {
                tracing::info!(
                    calls = unknown.len(),
                    "recording calls from the copies another replica handed out (their record here was late)"
                );
                self.record_queued(unknown).await?;
            }
        }
        if ids.len() > self.options.max_batch {
            return Err(CallError::Bad(format!(
                "{} ids in one batch; the bound is {}",
                ids.len(),
                self.options.max_batch
            )));
        }
        let mut unique = IdHashSet::default();
        if let Some(dup) = ids.iter().find(|id| !unique.insert(id.as_str())) {
            return Err(CallError::Bad(format!("call {dup} is twice in one batch")));
        }
        if let Some(Err(e)) = ids
            .iter()
            .map(|id| crate::peers::parse_id(id))
            .find(Result::is_err)
        {
            return Err(CallError::Bad(format!("call {e}")));
        }
        if ids.iter().any(|id| self.peers.other_owner(id).is_some()) {
            return self.start_through_owners(runner, ids).await;
        }
        // Hold first: once the start is accepted the message must not come back while the call
        // may run.
        let now = self.clock.now_ms();
        // (`held[i]`: whether `ids[i]` was held here; the verdicts come back in `ids`' order.)
        let (holds, held): (Vec<(String, u64)>, Vec<bool>) = self.log.read(|s| {
            let mut holds = Vec::with_capacity(ids.len());
            let held = ids
                .iter()
                .map(|id| match s.calls.get(id) {
                    Some(c) if c.status == CallStatus::Queued => {
                        let until = now
                            .saturating_add(c.spec.timeout_ms)
                            .saturating_add(self.options.hold_grace_ms);
                        holds.push((id.clone(), until));
                        true
                    }
                    _ => false,
                })
                .collect();
            (holds, held)
        });
        if !holds.is_empty() {
            self.queue.hold(holds).await?;
        }
        let runner_owned = runner.to_owned();
        let stale = self.stale.clone();
        let (verdicts, _) = self
            .log
            .decide(move |s: &State, now| {
                let mut events = Vec::with_capacity(ids.len());
                let mut verdicts = Vec::with_capacity(ids.len());
                let mut stale = stale.lock().expect("stale lock");
                for id in ids {
                    if stale.remove(&id) {
                        // The runner holds another copy than the log's: it must not run it.
                        verdicts.push((id, None, None));
                        continue;
                    }
                    let (event, verdict) = decide_start(&s.calls, &id, &runner_owned, now);
                    let deadline = match &event {
                        Event::CallStarted { deadline_at_ms, .. } => Some(*deadline_at_ms),
                        _ => None,
                    };
                    events.push(event);
                    verdicts.push((id, Some(verdict), deadline));
                }
                (events, verdicts)
            })
            .await?;
        let grace = self.options.hold_grace_ms;
        let (mut late_holds, mut refused) = (Vec::new(), Vec::new());
        for ((id, verdict, deadline), held) in verdicts.iter().zip(held) {
            match verdict {
                // Accepted while the log did not know the call yet at the hold above.
                Some(StartVerdict::Accepted) if !held => {
                    let until = deadline.unwrap_or(now).saturating_add(grace);
                    late_holds.push((id.clone(), until));
                }
                Some(StartVerdict::Accepted) => {}
                Some(StartVerdict::Refused(r)) => {
                    if matches!(r, crate::event::RejectReason::UnknownCall)
                        && !crate::mutation::active(crate::mutation::Mutation::RefuseUnknownCopy)
                    {
                        self.refused_unknown
                            .lock()
                            .expect("refused lock")
                            .insert(id);
                    }
                    refused.push(id.clone())
                }
                // Back on the queue now, to be handed out with the log's copy.
                None => late_holds.push((id.clone(), now)),
            }
        }
        if !late_holds.is_empty() {
            self.queue.hold(late_holds).await?;
        }
        if !refused.is_empty()
            && let Err(e) = self.queue.delete(refused).await
        {
            // A message left behind comes back and meets the same refusal.
            tracing::warn!(error = %e, "deleting refused calls' messages failed");
        }
        Ok(self.log.read(|s| {
            verdicts
                .into_iter()
                .map(|(id, verdict, deadline)| {
                    let call = s.calls.get(&id);
                    let state = s.calls.status(&id).unwrap_or(CallStatus::Error);
                    let code = match verdict {
                        Some(StartVerdict::Accepted) => {
                            tracing::debug!(call = %id, runner, "started");
                            if let Some(c) = call
                                && c.spec.trace.is_some()
                            {
                                let started = c.started_at_ms.unwrap_or(now);
                                crate::telemetry::call_span(
                                    "call.queue",
                                    &c.spec,
                                    c.created_at_ms,
                                    started,
                                    vec![opentelemetry::KeyValue::new(
                                        "ebb.runner",
                                        runner.to_owned(),
                                    )],
                                );
                            }
                            return Started {
                                id,
                                started: true,
                                code: None,
                                state,
                                deadline_at_ms: deadline,
                            };
                        }
                        Some(StartVerdict::Refused(r)) => reject_code(r),
                        None => STALE_COPY,
                    };
                    Started {
                        id,
                        started: false,
                        code: Some(code.to_owned()),
                        state,
                        deadline_at_ms: None,
                    }
                })
                .collect()
        }))
    }

    /// Splits `items` into this replica's own and the others', by owner.
    #[allow(clippy::type_complexity)]
    fn by_owner<T>(
        &self,
        items: Vec<T>,
        id: impl Fn(&T) -> &str,
    ) -> (Vec<T>, std::collections::BTreeMap<String, Vec<T>>) {
        let mut local = Vec::new();
        let mut others: std::collections::BTreeMap<String, Vec<T>> = Default::default();
        for item in items {
            match self.peers.other_owner(id(&item)).map(str::to_owned) {
                None => local.push(item),
                Some(o) => others.entry(o).or_default().push(item),
            }
        }
        (local, others)
    }

    /// Starts calls some of which other replicas own: this replica's own are decided here, the
    /// others by their owners (one request per owner). Each message is held first, as for a
    /// start decided here; a start an owner accepted keeps it held until the call's deadline, a
    /// refused one deletes it, and one whose owner could not be asked (`owner_unavailable`,
    /// nothing decided) comes back after [`crate::peers::RETRY_AFTER_S`].
    async fn start_through_owners(
        &self,
        runner: &str,
        ids: Vec<String>,
    ) -> Result<Vec<Started>, CallError> {
        let (local, by_owner) = self.by_owner(ids.clone(), |id| id);
        let mut answers: HashMap<String, Started> = HashMap::new();
        if !local.is_empty() {
            for a in Box::pin(self.start(runner, local)).await? {
                answers.insert(a.id.clone(), a);
            }
        }
        let grace = self.options.hold_grace_ms;
        for (owner, ids) in by_owner {
            let now = self.clock.now_ms();
            let until = now
                .saturating_add(self.options.max_timeout_ms)
                .saturating_add(grace);
            self.queue
                .hold(ids.iter().map(|id| (id.clone(), until)).collect())
                .await?;
            let copies: std::collections::BTreeMap<String, String> = {
                use base64::Engine as _;
                let handed = self.handed_unknown.lock().expect("copies lock");
                ids.iter()
                    .filter_map(|id| handed.get(id))
                    .map(|spec| {
                        let body = message_of(spec).body;
                        let b64 = base64::engine::general_purpose::STANDARD.encode(&body);
                        (spec.id.clone(), b64)
                    })
                    .collect()
            };
            let mut body = serde_json::json!({ "runner": runner, "ids": ids });
            if !copies.is_empty() {
                body["copies"] = serde_json::json!(copies);
            }
            let asked = self
                .peers
                .post::<Results<Started>>(
                    &owner,
                    "/runner/start",
                    self.peer_token.get().as_deref(),
                    &body,
                )
                .await;
            let results = match asked {
                Ok(Ok(r)) if r.results.len() == ids.len() => r.results,
                Ok(Ok(_)) | Ok(Err(_)) | Err(PeerError::Unavailable(..)) => {
                    if let Ok(Err((status, body))) = &asked {
                        tracing::warn!(%owner, status, body = %body, "an owner refused a forwarded start");
                    }
                    ids.iter()
                        .map(|id| Started {
                            id: id.clone(),
                            started: false,
                            code: Some(OWNER_UNAVAILABLE.to_owned()),
                            state: CallStatus::Queued,
                            deadline_at_ms: None,
                        })
                        .collect()
                }
                Err(e) => return Err(e.into()),
            };
            let (mut holds, mut refused) = (Vec::new(), Vec::new());
            let back = now.saturating_add(crate::peers::RETRY_AFTER_S * 1000);
            if !copies.is_empty() {
                // Decided: the owner knows these calls now (or refused them for good).
                let mut handed = self.handed_unknown.lock().expect("copies lock");
                for r in &results {
                    if r.code.as_deref() != Some(OWNER_UNAVAILABLE) {
                        handed.take(&r.id);
                    }
                }
            }
            for r in &results {
                match r.code.as_deref() {
                    None if r.started => holds.push((
                        r.id.clone(),
                        r.deadline_at_ms.unwrap_or(until).saturating_add(grace),
                    )),
                    Some(OWNER_UNAVAILABLE) => holds.push((r.id.clone(), back)),
                    Some(STALE_COPY) => holds.push((r.id.clone(), now)),
                    _ => refused.push(r.id.clone()),
                }
            }
            if !holds.is_empty() {
                self.queue.hold(holds).await?;
            }
            if !refused.is_empty()
                && let Err(e) = self.queue.delete(refused).await
            {
                tracing::warn!(error = %e, "deleting refused calls' messages failed");
            }
            for r in results {
                answers.insert(r.id.clone(), r);
            }
        }
        Ok(ids
            .into_iter()
            .filter_map(|id| answers.remove(&id))
            .collect())
    }

    /// Finishes calls some of which other replicas own: each owner records its own (one
    /// request per owner), then their messages here are deleted. An owner that cannot be asked
    /// fails the whole batch; finishing again is harmless (the first finish wins).
    async fn finish_through_owners(
        &self,
        runner: &str,
        finishes: Vec<Finish>,
    ) -> Result<Vec<(String, CallStatus)>, CallError> {
        let order: Vec<String> = finishes.iter().map(|f| f.id.clone()).collect();
        let (local, by_owner) = self.by_owner(finishes, |f| &f.id);
        let mut answers: HashMap<String, CallStatus> = HashMap::new();
        if !local.is_empty() {
            answers.extend(Box::pin(self.finish(runner, local)).await?);
        }
        for (owner, finishes) in by_owner {
            let asked = self
                .peers
                .post::<Results<IdState>>(
                    &owner,
                    "/runner/finish",
                    self.peer_token.get().as_deref(),
                    &wire::FinishBatchRef::of(runner, &finishes),
                )
                .await?;
            let results = match asked {
                Ok(r) => r.results,
                Err((status, body)) => {
                    return Err(PeerError::Unavailable(
                        owner,
                        format!("it answered a forwarded finish with {status}: {body}"),
                    )
                    .into());
                }
            };
            let ids: Vec<String> = finishes.into_iter().map(|f| f.id).collect();
            if let Err(e) = self.queue.delete(ids).await {
                tracing::warn!(error = %e, "deleting finished calls' messages failed");
            }
            answers.extend(results.into_iter().map(|r| (r.id, r.state)));
        }
        Ok(order
            .into_iter()
            .filter_map(|id| answers.remove(&id).map(|s| (id, s)))
            .collect())
    }

    /// The states of calls this replica owns (`None`: unknown), for another replica about to
    /// hand out their messages. A call whose enqueue is under way here (put on the queue, its
    /// record not yet written, so the other replica can read its message first) is waited for,
    /// at most [`STATES_WAIT`]: the answer then says it is queued, and the other replica hands
    /// it out now instead of holding it back and asking again.
    pub async fn states(&self, ids: &[String]) -> Vec<Option<PeerState>> {
        let look = || {
            self.log.read(|s| {
                ids.iter()
                    .map(|id| match s.calls.get(id) {
                        Some(c) => Some(PeerState {
                            state: c.status,
                            deadline_at_ms: c.deadline_at_ms,
                        }),
                        // Ended, and forgotten, kept known by its id.
                        None => s.calls.gone(id).map(|g| PeerState {
                            state: g.status,
                            deadline_at_ms: None,
                        }),
                    })
                    .collect::<Vec<_>>()
            })
        };
        let mut states = look();
        let _ = tokio::time::timeout(STATES_WAIT, async {
            loop {
                // Registered before the look, so an enqueue that ends in between is not missed.
                let settled = self.settled.notified();
                tokio::pin!(settled);
                settled.as_mut().enable();
                states = look();
                let unknown: Vec<&str> = ids
                    .iter()
                    .zip(&states)
                    .filter(|(_, state)| state.is_none())
                    .map(|(id, _)| id.as_str())
                    .collect();
                if !self.reserved.lock().expect("reserved lock").holds(&unknown) {
                    return;
                }
                settled.await;
            }
        })
        .await;
        states
    }

    /// Records finished calls (the first finish of each wins) and deletes their messages.
    /// Returns each call's state afterwards.
    pub async fn finish(
        &self,
        runner: &str,
        mut finishes: Vec<Finish>,
    ) -> Result<Vec<(String, CallStatus)>, CallError> {
        self.check_finishes(&finishes)?;
        self.finish_checked(runner, &mut finishes, true).await
    }

    /// Checks a batch of finishes as [`Calls::finish`] does before it records any: the batch's
    /// bound, each id, and each result's and log's size.
    pub(crate) fn check_finishes(&self, finishes: &[Finish]) -> Result<(), CallError> {
        if finishes.len() > self.options.max_batch {
            return Err(CallError::Bad(format!(
                "{} finishes in one batch; the bound is {}",
                finishes.len(),
                self.options.max_batch
            )));
        }
        for f in finishes {
            crate::peers::parse_id(&f.id).map_err(|e| CallError::Bad(format!("call {e}")))?;
            if f.result
                .as_ref()
                .is_some_and(|r| r.body.len() > self.options.max_result_bytes)
            {
                return Err(CallError::TooLarge(format!(
                    "the result of {} is over {} bytes",
                    f.id, self.options.max_result_bytes
                )));
            }
            if f.log.len() > self.options.max_log_bytes {
                return Err(CallError::TooLarge(format!(
                    "the log of {} is over {} bytes",
                    f.id, self.options.max_log_bytes
                )));
            }
        }
        Ok(())
    }

    /// [`Calls::finish`] of finishes [`Calls::check_finishes`] passed; the states afterwards only
    /// when `answer` (an in-process runner asks for none). Takes `finishes` when it records them
    /// all here (their results and logs move into the events); lends them when some go to
    /// their owners, which may be unreachable for a while: the caller keeps them to send again.
    pub(crate) async fn finish_checked(
        &self,
        runner: &str,
        finishes: &mut Vec<Finish>,
        answer: bool,
    ) -> Result<Vec<(String, CallStatus)>, CallError> {
        if finishes
            .iter()
            .any(|f| self.peers.other_owner(&f.id).is_some())
        {
            return self.finish_through_owners(runner, finishes.clone()).await;
        }
        let mut finishes = std::mem::take(finishes);
        let mut ids: Vec<String> = finishes.iter().map(|f| f.id.clone()).collect();
        // A call finished twice in one batch: its first finish counts. Dropped here, so the
        // log's writer, which every decision waits for, does not hash and copy the ids.
        {
            let mut seen = IdHashSet::with_capacity_and_hasher(
                ids.len(),
                foldhash::fast::RandomState::default(),
            );
            let mut first = ids.iter().map(|id| seen.insert(id.as_str()));
            finishes.retain(|_| first.next().unwrap_or(false));
        }
        let traced = ebb_proxy::trace::enabled();
        let who = runner.to_owned();
        let (accepted, _) = self
            .log
            .decide(move |s: &State, _| {
                let mut events = Vec::with_capacity(finishes.len());
                let mut accepted = Vec::new();
                for f in finishes {
                    let Finish {
                        id,
                        outcome,
                        result,
                        log,
                    } = f;
                    let was = traced.then(|| id.clone());
                    if let Some(e) = decide_finish(&s.calls, id, &who, outcome, result, log) {
                        events.push(e);
                        accepted.extend(was);
                    }
                }
                (events, accepted)
            })
            .await?;
        if traced {
            self.log.read(|s| {
                for c in accepted.iter().filter_map(|id| s.calls.get(id)) {
                    run_span(c);
                }
            });
        }
        let deleted = if answer {
            ids.clone()
        } else {
            std::mem::take(&mut ids)
        };
        if let Err(e) = self.queue.delete(deleted).await {
            // A message left behind comes back; its start is refused as final and deletes it.
            tracing::warn!(error = %e, "deleting finished calls' messages failed");
        }
        if !answer {
            return Ok(Vec::new());
        }
        Ok(self.log.read(|s| {
            ids.into_iter()
                .map(|id| {
                    let state = s.calls.status(&id).unwrap_or(CallStatus::Error);
                    tracing::debug!(call = %id, runner, ?state, "finished");
                    (id, state)
                })
                .collect()
        }))
    }

    /// Cancels a queued or running call and deletes its message. `Err(Some(state))`: it had
    /// ended already; `Err(None)`: no such call.
    pub async fn cancel(&self, id: &str) -> Result<Result<(), Option<CallStatus>>, CallError> {
        let owned = id.to_owned();
        let (answer, _) = self
            .log
            .decide(move |s: &State, _| match decide_cancel(&s.calls, &owned) {
                Ok(event) => (vec![event], Ok(())),
                Err(state) => (Vec::new(), Err(state)),
            })
            .await?;
        if answer.is_ok()
            && let Err(e) = self.queue.delete(vec![id.to_owned()]).await
        {
            tracing::warn!(error = %e, "deleting a cancelled call's message failed");
        }
        Ok(answer)
    }

    /// Times out running calls past their deadline and deletes their messages; forgets runners
    /// not heard from for the lease, handing their reserved calls to others. Returns the number
    /// of calls timed out.
    pub async fn expire(&self) -> Result<usize, CallError> {
        let now = self.clock.now_ms();
        let due: Vec<String> = self.log.read(|s| {
            s.schedule
                .due_of(crate::state::schedule::DueKind::CallTimeout, now)
                .filter_map(|(_, d)| match d {
                    Due::CallTimeout(id) => Some(id.to_string()),
                    _ => None,
                })
                .take(self.options.max_batch)
                .collect()
        });
        let mut timed_out = 0;
        if !due.is_empty() {
            let (ids, _) = self
                .log
                .decide(move |s: &State, now| {
                    let refs: Vec<&str> = due.iter().map(String::as_str).collect();
                    let events = decide_timeouts(&s.calls, &refs, now);
                    let ids = crate::state::calls::timed_out(&events);
                    (events, ids)
                })
                .await?;
            timed_out = ids.len();
            if !ids.is_empty() {
                self.queue.delete(ids).await?;
            }
        }
        let gone: Vec<String> = {
            let mut runners = self.runners.lock().expect("runners lock");
            let gone: Vec<String> = runners
                .iter()
                .filter(|(_, s)| {
                    s.polls == 0 && now.saturating_sub(s.at_ms) >= self.options.runner_lease_ms
                })
                .map(|(n, _)| n.clone())
                .collect();
            for n in &gone {
                runners.remove(n);
            }
            gone
        };
        let mut gone = gone;
        // After a restart: runners the queue still names that are not back within a lease.
        if now.saturating_sub(self.started_at_ms) >= self.options.runner_lease_ms
            && !self
                .owners_checked
                .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            let seen = self.runners.lock().expect("runners lock");
            gone.extend(
                self.queue
                    .owners()
                    .into_iter()
                    .filter(|o| !seen.contains_key(o)),
            );
        }
        for runner in gone {
            tracing::info!(%runner, "runner not heard from; its reserved calls go to others");
            self.queue.release(&runner).await?;
        }
        // Every few seconds: queued calls whose message is gone (a put that lost a race to a
        // refusal's clean-up, or a machine crash) go back on the queue.
        let last = self
            .recovered_at_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        if now.saturating_sub(last) >= RECOVER_EVERY_MS {
            self.recovered_at_ms
                .store(now, std::sync::atomic::Ordering::Relaxed);
            self.recover().await?;
        }
        Ok(timed_out)
    }
}

/// Whether a message put at `put_at_ms` (when its queue says) is older than `after_ms`
/// ([`FORGOTTEN_AFTER_MS`]) at `now`: if the log does not know its call, the call ended and was
/// forgotten (or its enqueue never finished, and was never acknowledged), so it must not run.
fn put_long_ago(put_at_ms: Option<u64>, now: u64, after_ms: u64) -> bool {
    put_at_ms.is_some_and(|at| now.saturating_sub(at) > after_ms)
}

/// [`spec_of`], with a warning for a message that is not a call (it is deleted).
fn decode_message(m: &Message) -> Option<CallSpec> {
    let spec = spec_of(m);
    if spec.is_none() {
        tracing::warn!(id = %m.id, "a queue message is not a call; deleting it");
    }
    spec
}

/// How often the expiry loop puts back queued calls whose message is gone.
const RECOVER_EVERY_MS: u64 = 5_000;

/// Counts a dequeue under way for its runner (and notes the runner when it ends).
struct Polling<'a> {
    calls: &'a Calls,
    runner: &'a str,
}

impl<'a> Polling<'a> {
    fn new(calls: &'a Calls, runner: &'a str) -> Self {
        calls.seen(runner, None);
        if let Some(s) = calls.runners.lock().expect("runners lock").get_mut(runner) {
            s.polls += 1;
        }
        Self { calls, runner }
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        let now = self.calls.clock.now_ms();
        if let Some(s) = self
            .calls
            .runners
            .lock()
            .expect("runners lock")
            .get_mut(self.runner)
        {
            s.polls = s.polls.saturating_sub(1);
            s.at_ms = now;
        }
    }
}

/// Runs [`Calls::expire`] every `every` until `stop` changes.
/// A finished traced call's run span: `function.step` for a function's step (its instance, function
/// and number as attributes), `call.run` for any other.
fn run_span(c: &crate::state::calls::Call) {
    if c.spec.trace.is_none() {
        return;
    }
    let (Some(started), Some(finished)) = (c.started_at_ms, c.finished_at_ms) else {
        return;
    };
    use opentelemetry::KeyValue;
    let header = |name: &str| {
        c.spec
            .payload
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let mut attributes = vec![
        KeyValue::new("ebb.call.status", format!("{:?}", c.status).to_lowercase()),
        KeyValue::new("ebb.runner", c.runner.clone().unwrap_or_default()),
    ];
    let name = match (header("x-ebb-instance"), header("x-ebb-function")) {
        (Some(instance), Some(function)) => {
            attributes.push(KeyValue::new("ebb.function.instance", instance));
            attributes.push(KeyValue::new("ebb.function.name", function));
            if let Some(step) = header("x-ebb-step") {
                attributes.push(KeyValue::new("ebb.function.step", step));
            }
            "function.step"
        }
        _ => "call.run",
    };
    crate::telemetry::call_span(name, &c.spec, started, finished, attributes);
}

pub async fn run_expiry(
    calls: Arc<Calls>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = calls.expire().await {
                    tracing::warn!(error = %e, "expiring calls failed");
                }
            }
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SimClock;
    use crate::log::MemStore;
    use crate::queue::embedded::{EmbeddedOptions, EmbeddedQueue};

    /// A log on `store` and an embedded queue in `dir`, on `clock`.
    fn open(
        store: &Arc<MemStore>,
        dir: &std::path::Path,
        clock: &SimClock,
    ) -> (Arc<Log>, Arc<EmbeddedQueue>) {
        let log = Log::open(
            store.clone(),
            crate::log::Options::default(),
            Arc::new(clock.clone()),
            &mut |_| {},
        )
        .unwrap();
        let queue =
            EmbeddedQueue::open(dir, Arc::new(clock.clone()), EmbeddedOptions::default()).unwrap();
        (Arc::new(log), Arc::new(queue))
    }

    fn spec(id: &str, body: &str) -> CallSpec {
        let mut spec = CallSpec::for_test(id);
        spec.payload.body = body.as_bytes().to_vec().into();
        spec
    }

    /// Another replica's call its owner does not know yet is held back a moment (twice as long
    /// each time) on each of its first deliveries, then handed out (its start refused, if the owner never records it).
    #[test]
    fn an_unknown_foreign_call_is_held_back_a_few_times_then_handed_out() {
        let mut back = UNKNOWN_BACK_MS;
        for d in 1..=UNKNOWN_DELIVERIES {
            assert_eq!(hold_back_unknown(d, 5_000), Some(5_000 + back));
            back *= 2;
        }
        assert_eq!(hold_back_unknown(UNKNOWN_DELIVERIES + 1, 5_000), None);
        crate::mutation::with(Some(crate::mutation::Mutation::HandOutUnknown), || {
            assert_eq!(hold_back_unknown(1, 5_000), None);
        });
    }

    #[test]
    fn a_handed_out_copy_is_recorded_if_unknown_and_stale_if_another_was_recorded() {
        let mut state = State::default();
        let id = |n: u128| uuid::Uuid::from_u128(n).to_string();
        let env = crate::event::Envelope {
            seq: 1,
            at_ms: 0,
            version: crate::event::SCHEMA_VERSION,
            event: Event::CallQueued {
                call: std::sync::Arc::new(spec(&id(2), "recorded")),
            },
        };
        crate::log::replay::Projection::apply(&mut state, &env);
        let same = crate::event::Envelope {
            seq: 2,
            event: Event::CallQueued {
                call: std::sync::Arc::new(spec(&id(3), "same")),
            },
            ..env
        };
        crate::log::replay::Projection::apply(&mut state, &same);
        let (events, stale) = record_handed_out(
            &state,
            vec![
                spec(&id(1), "new"),
                spec(&id(2), "other"),
                spec(&id(3), "same"),
            ],
        );
        assert_eq!(
            events,
            vec![Event::CallQueued {
                call: std::sync::Arc::new(spec(&id(1), "new"))
            }]
        );
        assert_eq!(stale, vec![id(2)]);
    }

    /// A call service with default options on a fresh log and an embedded queue in `dir`.
    fn service(dir: &std::path::Path) -> (Calls, Arc<Log>, Arc<EmbeddedQueue>) {
        let clock = SimClock::new(1_000);
        let (log, queue) = open(&Arc::new(MemStore::new()), dir, &clock);
        let calls = Calls::new(
            log.clone(),
            queue.clone(),
            Arc::new(clock),
            CallOptions::default(),
        );
        (calls, log, queue)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_copy_is_not_started_and_comes_back_as_the_logs_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (calls, log, queue) = service(dir.path());
        let id = uuid::Uuid::now_v7().to_string();
        // A message the log does not know: handed out as it is, and recorded so.
        queue.put(vec![message_of(&spec(&id, "a"))]).await.unwrap();
        let jobs = calls.dequeue("r", 10, 0).await.unwrap();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].call.payload.body.as_ref(), b"a");
        // Had the log recorded another copy in between, the writer marks the copy stale (see
        // the test above); its start is refused without an event and the message comes back.
        calls.stale.lock().unwrap().insert(&id);
        // A decision decided after the dequeue: the record it submitted is in by then.
        log.decide(|_: &State, _| (Vec::new(), ())).await.unwrap();
        assert_eq!(
            log.read(|s| s.calls.get(&id).map(|c| c.spec.payload.body.to_vec())),
            Some(b"a".to_vec())
        );
        let seq = log.applied_seq();
        let started = calls.start("r", vec![id.clone()]).await.unwrap();
        assert!(!started[0].started);
        assert_eq!(started[0].code.as_deref(), Some(STALE_COPY));
        assert_eq!(started[0].state, CallStatus::Queued);
        assert_eq!(log.applied_seq(), seq, "a stale start records nothing");
        let again = calls.dequeue("r", 10, 1_000).await.unwrap();
        assert_eq!(again.len(), 1, "the message comes back at once");
        let started = calls.start("r", vec![id.clone()]).await.unwrap();
        assert!(started[0].started, "{started:?}");
    }

    /// The in-process runner API takes a batch of finishes it records itself (their results and
    /// logs move into the events) and lends one with another replica's calls, whose owner may be
    /// unreachable for a while: that batch stays whole for the runner to send again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_in_process_api_takes_its_own_finishes_and_lends_another_replicas() {
        use crate::calls::runner::RunnerApi;
        use crate::event::Outcome;
        let dir = tempfile::tempdir().unwrap();
        let (calls, log, _queue) = service(dir.path());
        let peers = Arc::new(Peers::with_static(Some("ebb-0".into()), HashMap::new()));
        let calls = Arc::new(calls.with_peers(peers, crate::peers::PeerToken::None));
        let finish = |id: String| Finish {
            id,
            outcome: Outcome::Success,
            result: None,
            log: "ran".into(),
        };
        let load = Load {
            in_flight: 0,
            capacity: 1,
        };
        let theirs = format!("ebb-1.{}", uuid::Uuid::now_v7());
        let mut batch = vec![finish(theirs.clone())];
        let sent = RunnerApi::finish(&calls, "r", &mut batch, load).await;
        assert!(sent.is_err(), "ebb-1 is not known here: {sent:?}");
        assert_eq!(batch.len(), 1, "lent, to be sent again");
        assert_eq!(batch[0].id, theirs);
        let ours = format!("ebb-0.{}", uuid::Uuid::now_v7());
        let mut batch = vec![finish(ours.clone())];
        RunnerApi::finish(&calls, "r", &mut batch, load)
            .await
            .unwrap();
        assert!(batch.is_empty(), "taken");
        assert_eq!(
            log.read(|s| s.calls.get(&ours).map(|c| (c.status, c.log.clone()))),
            Some((CallStatus::Success, "ran".to_owned()))
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_finished_twice_in_one_batch_keeps_its_first_finish() {
        let dir = tempfile::tempdir().unwrap();
        let (calls, log, queue) = service(dir.path());
        let id = uuid::Uuid::now_v7().to_string();
        queue.put(vec![message_of(&spec(&id, "a"))]).await.unwrap();
        assert_eq!(calls.dequeue("r", 10, 0).await.unwrap().len(), 1);
        assert!(calls.start("r", vec![id.clone()]).await.unwrap()[0].started);
        let finish = |outcome, log: &str| Finish {
            id: id.clone(),
            outcome,
            result: None,
            log: log.into(),
        };
        let seq = log.applied_seq();
        let answer = calls
            .finish(
                "r",
                vec![
                    finish(crate::event::Outcome::Success, "first"),
                    finish(crate::event::Outcome::Error, "second"),
                ],
            )
            .await
            .unwrap();
        assert_eq!(
            answer,
            vec![
                (id.clone(), CallStatus::Success),
                (id.clone(), CallStatus::Success)
            ]
        );
        assert_eq!(log.applied_seq(), seq + 1, "one finish recorded");
        assert_eq!(
            log.read(|s| s.calls.get(&id).map(|c| c.log.clone())),
            Some("first".to_owned())
        );
    }

    #[test]
    fn the_enqueues_under_way_count_and_name_each_targets_calls() {
        let mut r = Reservations::default();
        let ids = |ids: &[&str]| Arc::new(ids.iter().map(|i| (*i).to_owned()).collect());
        r.under_way.insert(
            0,
            UnderWay {
                ids: ids(&["a", "b", "c"]),
                of_target: vec![0, 1, 0],
                targets: vec![("x".into(), 2), ("y".into(), 1)],
            },
        );
        r.under_way.insert(
            1,
            UnderWay {
                ids: ids(&["d"]),
                of_target: vec![0],
                targets: vec![("y".into(), 1)],
            },
        );
        assert_eq!(
            (r.calls_for("x"), r.calls_for("y"), r.calls_for("z")),
            (2, 2, 0)
        );
        let named = |t: &str| {
            let mut all: Vec<String> = r.ids_for(t).cloned().collect();
            all.sort_unstable();
            all
        };
        assert_eq!(named("x"), ["a", "c"]);
        assert_eq!(named("y"), ["b", "d"]);
        assert!(named("z").is_empty());
        assert!(r.holds(&["d"]) && r.holds(&["b"]) && !r.holds(&["e"]));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

        /// Enqueuers at once never pass the per-target bound together, and none is refused
        /// while there is room: exactly `min(asked, bound)` calls are queued.
        #[test]
        fn concurrent_enqueues_fill_a_target_exactly_to_its_bound(
            max in 1usize..12,
            enqueuers in 2usize..8,
            each in 1usize..6,
        ) {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(4)
                .enable_all()
                .build()
                .unwrap();
            let (accepted, queued) = rt.block_on(async move {
                let dir = tempfile::tempdir().unwrap();
                let clock = SimClock::new(1_000);
                let (log, queue) = open(&Arc::new(MemStore::new()), dir.path(), &clock);
                let route = Box::new(crate::event::RouteSpec::for_test("work", &["work.localhost"]));
                log.decide(move |_: &State, _| (vec![Event::RouteUpserted { route }], ()))
                    .await
                    .unwrap();
                let calls = Arc::new(Calls::new(
                    log.clone(),
                    queue,
                    Arc::new(clock),
                    CallOptions {
                        max_queued_per_target: max,
                        ..CallOptions::default()
                    },
                ));
                let start = Arc::new(tokio::sync::Barrier::new(enqueuers));
                let tasks: Vec<_> = (0..enqueuers)
                    .map(|_| {
                        let (calls, start) = (calls.clone(), start.clone());
                        tokio::spawn(async move {
                            start.wait().await;
                            let mut ok = 0usize;
                            for _ in 0..each {
                                let one = vec![NewCall {
                                    target: "work".into(),
                                    ..NewCall::default()
                                }];
                                match calls.enqueue(one).await {
                                    Ok(_) => ok += 1,
                                    Err(CallError::TargetFull(_)) => {}
                                    Err(e) => panic!("{e}"),
                                }
                            }
                            ok
                        })
                    })
                    .collect();
                let mut accepted = 0;
                for t in tasks {
                    accepted += t.await.unwrap();
                }
                (accepted, log.read(|s| s.calls.queued_for("work")))
            });
            let want = (enqueuers * each).min(max);
            proptest::prop_assert_eq!(accepted, want);
            proptest::prop_assert_eq!(queued, want);
        }
    }

    /// What a test queue's put does once its messages have landed.
    enum AfterPut {
        /// Reports failure, as a Kafka produce that timed out on the client but reached the
        /// broker.
        Fail,
        /// Tells `put` the ids, then waits until `open` has a permit.
        Wait {
            put: tokio::sync::watch::Sender<Vec<String>>,
            open: tokio::sync::Semaphore,
        },
    }

    /// An embedded queue whose puts land and then do `after_put`.
    struct TestQueue {
        queue: Arc<EmbeddedQueue>,
        after_put: AfterPut,
    }

    impl Queue for TestQueue {
        fn put(&self, messages: Vec<Message>) -> crate::queue::QueueFuture<'_, ()> {
            Box::pin(async move {
                let ids = messages.iter().map(|m| m.id.clone()).collect();
                self.queue.put(messages).await?;
                match &self.after_put {
                    AfterPut::Fail => Err(QueueError::Storage("timed out".into())),
                    AfterPut::Wait { put, open } => {
                        put.send_replace(ids);
                        let _open = open.acquire().await;
                        Ok(())
                    }
                }
            })
        }
        fn reserve(
            &self,
            runner: &str,
            max: usize,
            wait: Duration,
        ) -> crate::queue::QueueFuture<'_, Vec<Message>> {
            self.queue.reserve(runner, max, wait)
        }
        fn hold(&self, holds: Vec<(String, u64)>) -> crate::queue::QueueFuture<'_, ()> {
            self.queue.hold(holds)
        }
        fn delete(&self, ids: Vec<String>) -> crate::queue::QueueFuture<'_, ()> {
            self.queue.delete(ids)
        }
        fn release(&self, runner: &str) -> crate::queue::QueueFuture<'_, ()> {
            self.queue.release(runner)
        }
        fn owners(&self) -> Vec<String> {
            self.queue.owners()
        }
        fn stats(&self) -> crate::queue::QueueStats {
            self.queue.stats()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_enqueue_whose_message_lands_anyway_never_runs_even_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let clock = SimClock::new(1_000);
        let store = Arc::new(MemStore::new());
        let (log, queue) = open(&store, dir.path(), &clock);
        let lying = Calls::new(
            log.clone(),
            Arc::new(TestQueue {
                queue: queue.clone(),
                after_put: AfterPut::Fail,
            }),
            Arc::new(clock.clone()),
            CallOptions::default(),
        );
        let route = crate::event::RouteSpec::for_test("work", &["work.localhost"]);
        log.decide(move |_: &State, _| {
            (
                vec![Event::RouteUpserted {
                    route: Box::new(route),
                }],
                (),
            )
        })
        .await
        .unwrap();
        let failed = lying
            .enqueue(vec![NewCall {
                target: "work".into(),
                ..NewCall::default()
            }])
            .await;
        assert!(matches!(failed, Err(CallError::Queue(_))), "{failed:?}");
        assert_eq!(queue.stats().ready, 1, "the message landed");
        // ebb restarts: a new service, the memory of the failed put gone; the log remembers.
        drop(lying);
        drop(log);
        drop(queue);
        let (log, queue) = open(&store, dir.path(), &clock);
        let calls = Calls::new(
            log.clone(),
            queue.clone(),
            Arc::new(clock),
            CallOptions::default(),
        );
        let jobs = calls.dequeue("r", 10, 0).await.unwrap();
        assert!(
            jobs.is_empty(),
            "an aborted call is never handed out: {jobs:?}"
        );
        assert_eq!(
            queue.stats().ready + queue.stats().reserved,
            0,
            "its message is gone"
        );
        assert_eq!(log.read(|s| s.calls.by_id.len()), 0, "nor recorded");
    }

    /// Another replica that read a call's message while its owner's enqueue is still under way
    /// (put, not recorded) is told the call is queued once it is recorded, not that it is
    /// unknown (which would hold the message back and ask again later).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_states_request_waits_for_an_enqueue_under_way() {
        let dir = tempfile::tempdir().unwrap();
        let clock = SimClock::new(1_000);
        let store = Arc::new(MemStore::new());
        let (log, queue) = open(&store, dir.path(), &clock);
        let (put, mut was_put) = tokio::sync::watch::channel(Vec::new());
        let gated = Arc::new(TestQueue {
            queue,
            after_put: AfterPut::Wait {
                put,
                open: tokio::sync::Semaphore::new(0),
            },
        });
        let calls = Arc::new(Calls::new(
            log.clone(),
            gated.clone(),
            Arc::new(clock),
            CallOptions::default(),
        ));
        let route = crate::event::RouteSpec::for_test("work", &["work.localhost"]);
        log.decide(move |_: &State, _| {
            (
                vec![Event::RouteUpserted {
                    route: Box::new(route),
                }],
                (),
            )
        })
        .await
        .unwrap();
        let enqueue = tokio::spawn({
            let calls = calls.clone();
            async move {
                calls
                    .enqueue(vec![NewCall {
                        target: "work".into(),
                        ..NewCall::default()
                    }])
                    .await
            }
        });
        let ids = was_put
            .wait_for(|ids| !ids.is_empty())
            .await
            .unwrap()
            .clone();
        let states = calls.states(&ids);
        tokio::pin!(states);
        // Polled once: the call is neither recorded nor given up, so the answer waits.
        assert!(
            tokio::time::timeout(Duration::ZERO, states.as_mut())
                .await
                .is_err(),
            "a states request answered while the enqueue was under way"
        );
        if let AfterPut::Wait { open, .. } = &gated.after_put {
            open.add_permits(1);
        }
        assert_eq!(enqueue.await.unwrap().unwrap(), ids);
        let answered = states.await;
        assert_eq!(
            answered
                .iter()
                .map(|s| s.map(|s| s.state))
                .collect::<Vec<_>>(),
            vec![Some(CallStatus::Queued)]
        );
    }
}
