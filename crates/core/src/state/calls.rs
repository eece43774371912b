//! Call states and the call state machine.
//!
//! The machine is the runner API's conditional start made exact:
//!
//! | state     | start                                   | finish                    | deadline passes |
//! |-----------|-----------------------------------------|---------------------------|-----------------|
//! | queued    | -> running, accepted                    | -> success / error        | -               |
//! | running   | -> error, refused (must not run twice)  | -> success / error        | -> timeout      |
//! | final     | refused, unchanged                      | unchanged (first wins)    | -               |
//!
//! A call enters `running` at most once: `running` is reachable only from `queued`, and nothing
//! leads back to `queued`. The machine is an explicit enum, [`CallStatus`], stepped by
//! [`CallStatus::on_start`], [`CallStatus::on_finish`] and [`CallStatus::on_deadline`]. The
//! decisions ([`decide_start`], [`decide_finish`], [`decide_timeouts`], run on the log's writer)
//! and the projection (`apply`) step the same machine, so replaying the log reproduces exactly
//! what was decided, and a call in a final state never changes, whatever events arrive.
//!
//! The projection also keeps indexes of the queued calls ([`Calls::queued`], whose messages the
//! call service puts back when the queue lost them) and of their count by target
//! ([`Calls::queued_by_target`], the bound `--max-queued-per-target`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, hash_map};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::event::{
    CallKind, CallResult, CallSpec, Event, KeepGone, Outcome, Payload, RejectReason,
};
use crate::ids::IdKey;

use super::Ended;
pub use super::idmap::IdMap;

/// Where a call is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallStatus {
    Queued,
    Running,
    Success,
    Error,
    Timeout,
    Cancelled,
}

/// What a start does to a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartVerdict {
    /// The runner may run the call.
    Accepted,
    /// The runner must not run the call.
    Refused(RejectReason),
}

impl CallStatus {
    /// Every state, in order.
    pub const ALL: [CallStatus; 6] = [
        CallStatus::Queued,
        CallStatus::Running,
        CallStatus::Success,
        CallStatus::Error,
        CallStatus::Timeout,
        CallStatus::Cancelled,
    ];

    /// The state's name, as in JSON (`queued`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CallStatus::Queued => "queued",
            CallStatus::Running => "running",
            CallStatus::Success => "success",
            CallStatus::Error => "error",
            CallStatus::Timeout => "timeout",
            CallStatus::Cancelled => "cancelled",
        }
    }

    /// The state named `name`.
    pub fn parse(name: &str) -> Option<CallStatus> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Final states never change again.
    pub fn is_final(self) -> bool {
        !matches!(self, CallStatus::Queued | CallStatus::Running)
    }

    /// A runner asks to start the call.
    pub fn on_start(self) -> (CallStatus, StartVerdict) {
        match self {
            CallStatus::Queued => (CallStatus::Running, StartVerdict::Accepted),
            CallStatus::Running => (
                CallStatus::Error,
                StartVerdict::Refused(RejectReason::AlreadyRunning),
            ),
            s => (s, StartVerdict::Refused(RejectReason::AlreadyFinal)),
        }
    }

    /// A runner reports the call finished; the first finish wins.
    pub fn on_finish(self, outcome: Outcome) -> CallStatus {
        match (self, outcome) {
            (s, _) if s.is_final() => s,
            (_, Outcome::Success) => CallStatus::Success,
            (_, Outcome::Error) => CallStatus::Error,
        }
    }

    /// The call's deadline passed.
    pub fn on_deadline(self) -> CallStatus {
        match self {
            CallStatus::Running => CallStatus::Timeout,
            s => s,
        }
    }

    /// Someone cancelled the call: a queued or running call ends `cancelled` (a running one's
    /// later finish changes nothing); an ended one stays as it is.
    pub fn on_cancel(self) -> CallStatus {
        match self {
            CallStatus::Queued | CallStatus::Running => CallStatus::Cancelled,
            s => s,
        }
    }
}

/// A call as the log describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    /// What was queued (for a call first seen at its finish, a placeholder with only the id).
    #[serde(with = "crate::event::shared")]
    pub spec: Arc<CallSpec>,
    /// Current state.
    pub status: CallStatus,
    /// When it was queued (or first recorded).
    pub created_at_ms: u64,
    /// When its start was accepted.
    pub started_at_ms: Option<u64>,
    /// When it reached a final state.
    pub finished_at_ms: Option<u64>,
    /// Deadline of the running call.
    pub deadline_at_ms: Option<u64>,
    /// The runner whose start was accepted.
    pub runner: Option<String>,
    /// Accepted starts; the state machine keeps this at most 1.
    pub starts: u32,
    /// Refused starts.
    pub refused_starts: u32,
    /// The target's answer, from the first finish.
    pub result: Option<CallResult>,
    /// The call's log, from the first finish.
    pub log: String,
}

/// Calls by id. A hash map: a call is looked up about a dozen times in its life (enqueue,
/// dequeue, start, finish, their events and answers), and an ordered map's search compares ids
/// that share their owner's name and their time's prefix, reading far into both each time. Its
/// order is not an order: what needs one sorts ([`Calls::sorted`], [`Calls::page`],
/// [`Calls::newest`]), and it is serialized in id order, so snapshots stay deterministic.
///
/// Each call is boxed: a call is 432 bytes, and the table moves every entry when it grows (the
/// log's writer, which every decision waits for, stalls meanwhile) and keeps up to half its
/// slots empty after. Inline, the growth past 229,376 calls moved 105 MB into a fresh 240 MB
/// table; boxed, that table is 17 MB and the growth takes less than half as long. The key is
/// kept in the slot ([`IdKey`]), so a probe compares it without reading another cache line.
pub type CallMap = HashMap<IdKey, Box<Call>, foldhash::fast::RandomState>;

/// The ids of the queued calls, hashed for the reason [`CallMap`] is: every enqueue inserts one
/// and every start removes one, and an ordered set of 100,000 queued ids (the default bound per
/// target) compares ids sharing their prefix a few dozen times per step, each behind a pointer.
/// Serialized in id order; what needs an order sorts ([`Calls::queued_in_order`]).
pub type IdSet = HashSet<IdKey, foldhash::fast::RandomState>;

/// All calls by id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Calls {
    /// Calls by id.
    #[serde(serialize_with = "in_id_order")]
    pub by_id: CallMap,
    /// Ids of the calls still queued (an index of `by_id`).
    #[serde(default, serialize_with = "set_in_id_order")]
    pub queued: IdSet,
    /// How many of them each target has (an index of `queued`, for `--max-queued-per-target`).
    /// A snapshot from before it was kept starts it empty: counts then err low, never high.
    #[serde(default)]
    pub queued_by_target: BTreeMap<String, usize>,
    /// Calls whose enqueue failed and that were never recorded, with when: their messages
    /// must not run. Kept as long as ended calls are (the retention).
    #[serde(default)]
    pub aborted: BTreeMap<String, u64>,
    /// The ended calls of `by_id`: how many, about how much memory, and which by when they
    /// ended (an index, for the retention; counted again from `by_id` when a snapshot is read).
    #[serde(skip)]
    pub ended: Ended<Arc<CallSpec>>,
    /// Calls the retention's bounds forgot before their age, by id: how each ended and when;
    /// also those its age forgot sooner after they ended than their messages are taken for a
    /// forgotten call's by age alone (`KeepGone`). The queue may still hand out a message of
    /// theirs (a Kafka partition read again from an older commit, an enqueue retried with the
    /// same id), which must meet an ended call, never run it again. A few dozen bytes each
    /// instead of the whole call; they go when the retention's age passes them, as the calls
    /// would have (or, those the age forgot, once their messages would be taken for a forgotten
    /// call's anyway).
    #[serde(default)]
    pub gone: GoneMap,
    /// `gone` by the millisecond they ended in: which go first past [`GONE_PER_KEPT`], and which
    /// go with the age.
    #[serde(skip)]
    gone_by_ms: Ended<IdKey>,
    /// How many calls of `by_id` are in each state, in the order of [`CallStatus::ALL`] (an index
    /// for `/metrics`, which would otherwise look at every call under the log's read lock at each
    /// scrape, holding the writer back; counted again when a snapshot is read).
    #[serde(skip)]
    by_status: [u64; 6],
}

/// What is left of forgotten calls is bounded too, at this many times the ended calls a
/// forgetting by the bounds keeps (a few dozen bytes each against a whole call): past it the
/// oldest go, and a message of such a call delivered again would find it unknown, as one the
/// age forgot.
pub const GONE_PER_KEPT: u64 = 8;

/// What is left of a call the retention forgot while a message of its might still be read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gone {
    /// Its final state.
    pub status: CallStatus,
    /// When it reached it.
    pub finished_at_ms: u64,
}

/// Forgotten calls by id (see [`IdMap`]).
pub type GoneMap = IdMap<Gone>;

/// What applying a call event did to the schedule.
pub(crate) enum Timer {
    /// The call started: its deadline (a call starts once).
    Set(u64),
    /// The call ended: the deadline it had, if it started.
    Clear(Option<u64>),
    Keep,
}

/// Serializes the calls in id order (a map's own order would change every snapshot's bytes).
fn in_id_order<S: serde::Serializer>(by_id: &CallMap, s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(sorted(by_id))
}

/// Serializes a set of ids in id order, as the ordered set it replaced did.
fn set_in_id_order<S: serde::Serializer>(ids: &IdSet, s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(ids_in_order(ids))
}

fn ids_in_order(ids: &IdSet) -> Vec<&str> {
    let mut all: Vec<&str> = ids.iter().map(IdKey::as_str).collect();
    all.sort_unstable();
    all
}

fn sorted(by_id: &CallMap) -> Vec<(&str, &Call)> {
    let mut all: Vec<_> = by_id.iter().map(|(id, c)| (id.as_str(), &**c)).collect();
    all.sort_unstable_by(|a, b| a.0.cmp(b.0));
    all
}

/// A call ordered by its id alone (ids are the map's keys: unique).
struct ById<'a>(&'a str, &'a Call);

impl PartialEq for ById<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for ById<'_> {}

impl PartialOrd for ById<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ById<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.cmp(other.0)
    }
}

/// The `limit` lowest of `items`, lowest first, keeping no more than `limit` at a time (a
/// max-heap whose top is the one to drop).
fn lowest<T: Ord>(limit: usize, items: impl Iterator<Item = T>) -> Vec<T> {
    let mut best = BinaryHeap::with_capacity(limit + 1);
    for item in items {
        if best.len() < limit {
            best.push(item);
        } else if let Some(mut worst) = best.peek_mut()
            && item < *worst
        {
            *worst = item;
        }
    }
    best.into_sorted_vec()
}

impl Calls {
    /// Every call, in id order (ids are UUID v7 under their owner's name: by owner, then oldest
    /// first).
    pub fn sorted(&self) -> Vec<(&str, &Call)> {
        sorted(&self.by_id)
    }

    /// Up to `limit` calls that `keep` accepts, with the lowest ids after `after`, in id order:
    /// one pass over the calls.
    pub fn page(
        &self,
        after: Option<&str>,
        limit: usize,
        keep: impl Fn(&Call) -> bool,
    ) -> Vec<(&str, &Call)> {
        let calls = self
            .by_id
            .iter()
            .filter(|(id, c)| after.is_none_or(|a| id.as_str() > a) && keep(c))
            .map(|(id, c)| ById(id.as_str(), c));
        lowest(limit, calls)
            .into_iter()
            .map(|c| (c.0, c.1))
            .collect()
    }

    /// Up to `limit` calls that `keep` accepts with the highest ids, highest first (for one
    /// owner, newest first): one pass over the calls.
    pub fn newest(&self, limit: usize, keep: impl Fn(&Call) -> bool) -> Vec<(&str, &Call)> {
        let calls = self
            .by_id
            .iter()
            .filter(|(_, c)| keep(c))
            .map(|(id, c)| Reverse(ById(id.as_str(), c)));
        // Lowest in `Reverse` is highest first.
        lowest(limit, calls)
            .into_iter()
            .map(|Reverse(c)| (c.0, c.1))
            .collect()
    }

    /// How many calls are in each state, in the order of [`CallStatus::ALL`].
    pub fn count_by_status(&self) -> [u64; 6] {
        self.by_status
    }

    /// A call by id.
    pub fn get(&self, id: &str) -> Option<&Call> {
        self.by_id.get(id).map(|c| &**c)
    }

    /// Drops calls that ended before `finished_before_ms`, except those in `keep` (the current
    /// step of a running instance, which the instance still has to read). A forgetting by the
    /// retention's bounds (`kept`: the ended calls it keeps) keeps what is left of them
    /// ([`Calls::gone`]), at most [`GONE_PER_KEPT`] x `kept` (the oldest go), until their age
    /// drops it. A forgetting by age keeps what is left of those that ended since
    /// `keep_gone.ended_since_ms`, at most `keep_gone.most` (the oldest go), and drops what is
    /// left of older ones, as it drops the aborted puts; without `keep_gone` it keeps none.
    /// Looks only at what goes (and the current steps), by the index of when calls ended.
    pub(crate) fn forget(
        &mut self,
        finished_before_ms: u64,
        keep: &BTreeSet<&str>,
        kept: Option<u64>,
        keep_gone: Option<KeepGone>,
    ) {
        let Calls {
            by_id,
            ended,
            gone,
            gone_by_ms,
            aborted,
            by_status,
            ..
        } = self;
        // Those forgotten that stay known by id: that ended since `since`, at most `most` (the
        // newest). The bounds' keep all they forget (within their multiple of `kept`); the age's
        // keep those its `keep_gone` names, none without. What is left of calls forgotten
        // before, and the aborted puts, go once they ended before `since`.
        let (since, most) = match (kept, keep_gone) {
            (Some(kept), _) => (0, Some(kept.saturating_mul(GONE_PER_KEPT))),
            (None, Some(k)) => (k.ended_since_ms.min(finished_before_ms), Some(k.most)),
            (None, None) => (finished_before_ms, None),
        };
        let mut stay = Vec::new();
        for (at, spec) in ended.take_before(finished_before_ms) {
            let id = spec.id.as_str();
            if keep.contains(id) {
                stay.push((at, spec));
                continue;
            }
            // (The index holds only calls of `by_id` that ended, once each.)
            let Some((id, c)) = by_id.remove_entry(id) else {
                continue;
            };
            by_status[c.status as usize] = by_status[c.status as usize].saturating_sub(1);
            if at >= since {
                let g = Gone {
                    status: c.status,
                    finished_at_ms: at,
                };
                // (A call forgotten before may have been recorded again by an event no
                // decision makes: a replayed log takes any.)
                if let Some(was) = gone.insert(&id, g) {
                    gone_by_ms.remove(was.finished_at_ms, 0, |g| *g == id);
                }
                gone_by_ms.add(at, 0, id);
            }
        }
        for (at, spec) in stay {
            let bytes = by_id.get(spec.id.as_str()).map_or(0, |c| c.held_bytes());
            ended.add(at, bytes, spec);
        }
        aborted.retain(|_, at| *at >= since);
        // The newest stay (with the rest of their millisecond's).
        let cut = most.and_then(|most| gone_by_ms.cut_within(most, u64::MAX));
        for (_, id) in gone_by_ms.take_before(cut.map_or(since, |cut| cut.max(since))) {
            gone.remove(&id);
        }
    }

    /// What is left of `id` if the retention forgot it and keeps it known (`gone`).
    pub fn gone(&self, id: &str) -> Option<&Gone> {
        if self.gone.is_empty() {
            return None;
        }
        self.gone.get(id)
    }

    /// The state of `id`, known, or forgotten and kept known by its id (then final).
    pub fn status(&self, id: &str) -> Option<CallStatus> {
        self.get(id)
            .map(|c| c.status)
            .or_else(|| self.gone(id).map(|g| g.status))
    }

    /// Counts the calls by state and the ended ones again (after a snapshot is read), in one
    /// look at every call.
    pub(crate) fn count_ended(&mut self) {
        self.gone_by_ms = Ended::default();
        for (id, g) in self.gone.iter() {
            self.gone_by_ms.add(g.finished_at_ms, 0, IdKey::from(id));
        }
        self.by_status = [0; 6];
        self.ended = Ended::default();
        for c in self.by_id.values() {
            self.by_status[c.status as usize] += 1;
            if c.status.is_final() {
                self.ended.add(
                    c.finished_at_ms.unwrap_or_default(),
                    c.held_bytes(),
                    c.spec.clone(),
                );
            }
        }
    }

    /// Whether any call but those in `keep` ended (or was aborted) before `finished_before_ms`.
    pub fn any_finished_before(&self, finished_before_ms: u64, keep: &BTreeSet<&str>) -> bool {
        self.any_ended_before(finished_before_ms, keep)
            || self.aborted.values().any(|at| *at < finished_before_ms)
            || self.gone_by_ms.any_before(finished_before_ms)
    }

    /// Whether any call the projection holds but those in `keep` ended before
    /// `finished_before_ms`: a look at those that did, by the index of when calls ended.
    pub fn any_ended_before(&self, finished_before_ms: u64, keep: &BTreeSet<&str>) -> bool {
        self.ended
            .items_before(finished_before_ms)
            .any(|(_, spec)| !keep.contains(spec.id.as_str()))
    }

    /// Notes calls whose enqueue failed (those the log has recorded meanwhile excepted).
    pub(crate) fn abort(&mut self, at_ms: u64, ids: &[String]) {
        for id in ids {
            if !self.by_id.contains_key(id.as_str()) {
                self.aborted.insert(id.clone(), at_ms);
            }
        }
    }

    /// Whether `id`'s enqueue failed and the call was never recorded.
    pub fn is_aborted(&self, id: &str) -> bool {
        self.aborted.contains_key(id) && !self.by_id.contains_key(id)
    }

    pub(crate) fn apply(&mut self, at_ms: u64, event: &Event) -> Timer {
        let Calls {
            by_id,
            queued,
            queued_by_target,
            ended,
            by_status,
            ..
        } = self;
        let (timer, stepped) = apply_call(by_id, at_ms, event);
        let Some(Stepped { was, c }) = stepped else {
            return timer;
        };
        if was != Some(c.status) {
            if let Some(was) = was {
                by_status[was as usize] = by_status[was as usize].saturating_sub(1);
            }
            by_status[c.status as usize] += 1;
        }
        let was_queued = was == Some(CallStatus::Queued);
        if !was.is_some_and(CallStatus::is_final) && c.status.is_final() {
            ended.add(
                c.finished_at_ms.unwrap_or_default(),
                c.held_bytes(),
                c.spec.clone(),
            );
        }
        // The indexes change only when the call enters or leaves `queued`.
        if (c.status == CallStatus::Queued) != was_queued {
            let target = c.spec.target.as_str();
            if was_queued {
                queued.remove(c.spec.id.as_str());
                if let Some(n) = queued_by_target.get_mut(target) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        queued_by_target.remove(target);
                    }
                }
            } else {
                queued.insert(IdKey::from(&c.spec.id));
                // The target's name is copied only for its first queued call.
                match queued_by_target.get_mut(target) {
                    Some(n) => *n += 1,
                    None => {
                        queued_by_target.insert(target.to_owned(), 1);
                    }
                }
            }
        }
        timer
    }

    /// The ids of the queued calls in id order (for UUID v7 ids, the order they were enqueued
    /// in). Sorts them all: for start-up and for a bounded look, not per request.
    pub fn queued_in_order(&self) -> Vec<&str> {
        ids_in_order(&self.queued)
    }

    /// Calls queued for `target` now.
    pub fn queued_for(&self, target: &str) -> usize {
        self.queued_by_target.get(target).copied().unwrap_or(0)
    }
}

/// A call an event stepped: where it was before the step, and the call after it.
#[derive(Clone, Copy)]
struct Stepped<'a> {
    /// Its state before the step (`None`: the event recorded it).
    was: Option<CallStatus>,
    c: &'a Call,
}

/// Steps the call `event` is about, if it is a call event: the schedule's change, and the call
/// stepped.
fn apply_call<'a>(
    by_id: &'a mut CallMap,
    at_ms: u64,
    event: &Event,
) -> (Timer, Option<Stepped<'a>>) {
    // One search of the map per event (its keys share their owner's prefix, so each comparison
    // reads far into both ids: a search costs more than copying an id).
    let c = match event {
        Event::CallQueued { call } => {
            return match by_id.entry(IdKey::from(&call.id)) {
                hash_map::Entry::Occupied(o) => {
                    let c = o.into_mut();
                    (
                        Timer::Keep,
                        Some(Stepped {
                            was: Some(c.status),
                            c,
                        }),
                    )
                }
                hash_map::Entry::Vacant(v) => {
                    let c = v.insert(Box::new(Call::new(call.clone(), CallStatus::Queued, at_ms)));
                    (Timer::Keep, Some(Stepped { was: None, c }))
                }
            };
        }
        // A finish for a call that was never queued (a sync call, or a lost enqueue) is
        // recorded, as the runner API asks.
        Event::CallFinished { id, .. } => match by_id.entry(IdKey::from(id)) {
            hash_map::Entry::Occupied(o) => {
                let c = o.into_mut();
                (Some(c.status), c)
            }
            hash_map::Entry::Vacant(v) => (
                None,
                v.insert(Box::new(Call::new(
                    Arc::new(placeholder(id)),
                    CallStatus::Running,
                    at_ms,
                ))),
            ),
        },
        Event::CallStarted { id, .. }
        | Event::CallRejected { id, .. }
        | Event::CallTimedOut { id }
        | Event::CallCancelled { id } => match by_id.get_mut(id.as_str()) {
            Some(c) => (Some(c.status), c),
            None => return (Timer::Keep, None),
        },
        _ => return (Timer::Keep, None),
    };
    let (was, c) = c;
    let timer = match event {
        Event::CallStarted {
            runner,
            deadline_at_ms,
            ..
        } => {
            let (next, verdict) = c.status.on_start();
            c.status = next;
            match verdict {
                StartVerdict::Accepted => {
                    c.starts += 1;
                    c.started_at_ms = Some(at_ms);
                    c.deadline_at_ms = Some(*deadline_at_ms);
                    c.runner = Some(runner.clone());
                    Timer::Set(*deadline_at_ms)
                }
                StartVerdict::Refused(_) => {
                    c.refused_starts += 1;
                    c.mark_final(at_ms)
                }
            }
        }
        Event::CallRejected { .. } => {
            c.refused_starts += 1;
            if c.status == CallStatus::Running {
                c.status = CallStatus::Error;
            }
            c.mark_final(at_ms)
        }
        Event::CallFinished {
            outcome,
            result,
            log,
            ..
        } => {
            if c.status.is_final() {
                Timer::Keep
            } else {
                c.status = c.status.on_finish(*outcome);
                c.result = result.clone();
                c.log = log.clone();
                c.mark_final(at_ms)
            }
        }
        Event::CallTimedOut { .. } => {
            c.status = c.status.on_deadline();
            c.mark_final(at_ms)
        }
        Event::CallCancelled { .. } => {
            c.status = c.status.on_cancel();
            c.mark_final(at_ms)
        }
        _ => Timer::Keep,
    };
    (timer, Some(Stepped { was, c }))
}

/// The spec of a call first seen at its finish: only its id.
fn placeholder(id: &str) -> CallSpec {
    CallSpec {
        id: id.to_owned(),
        target: String::new(),
        kind: CallKind::Sync,
        timeout_ms: 0,
        partition: None,
        trace: None,
        tracestate: None,
        baggage: None,
        payload: Payload::default(),
    }
}

impl Call {
    /// About how much memory the call takes in the projection: its fixed size (boxed, with its
    /// spec) and the id under which the map keeps it, its strings, payload, result and log.
    pub fn held_bytes(&self) -> u64 {
        let pairs = |h: &[(String, String)]| -> usize {
            h.iter()
                .map(|(k, v)| std::mem::size_of::<(String, String)>() + k.len() + v.len())
                .sum()
        };
        let spec = &self.spec;
        let p = &spec.payload;
        let fixed = std::mem::size_of::<Call>()
            + std::mem::size_of::<CallSpec>()
            + std::mem::size_of::<(String, Box<Call>)>();
        let strings = 2 * spec.id.len()
            + spec.target.len()
            + spec.partition.as_ref().map_or(0, String::len)
            + spec.trace.as_ref().map_or(0, String::len)
            + spec.tracestate.as_ref().map_or(0, String::len)
            + spec.baggage.as_ref().map_or(0, String::len)
            + p.method.len()
            + p.path.len()
            + pairs(&p.headers)
            + p.body.len()
            + self.runner.as_ref().map_or(0, String::len)
            + self.log.len()
            + self
                .result
                .as_ref()
                .map_or(0, |r| pairs(&r.headers) + r.body.len());
        (fixed + strings) as u64
    }

    fn new(spec: Arc<CallSpec>, status: CallStatus, created_at_ms: u64) -> Self {
        Call {
            spec,
            status,
            created_at_ms,
            started_at_ms: None,
            finished_at_ms: None,
            deadline_at_ms: None,
            runner: None,
            starts: 0,
            refused_starts: 0,
            result: None,
            log: String::new(),
        }
    }

    fn mark_final(&mut self, at_ms: u64) -> Timer {
        if self.status.is_final() {
            if self.finished_at_ms.is_none() {
                self.finished_at_ms = Some(at_ms);
            }
            Timer::Clear(self.deadline_at_ms)
        } else {
            Timer::Keep
        }
    }
}

/// Decides a runner's start: the event to log and the verdict to answer with.
pub fn decide_start(calls: &Calls, id: &str, runner: &str, now_ms: u64) -> (Event, StartVerdict) {
    let Some(call) = calls.get(id) else {
        // Unknown, or ended and forgotten by the retention's bounds.
        let reason = match calls.gone(id) {
            Some(_) => RejectReason::AlreadyFinal,
            None => RejectReason::UnknownCall,
        };
        return (
            Event::CallRejected {
                id: id.to_owned(),
                runner: runner.to_owned(),
                reason,
            },
            StartVerdict::Refused(reason),
        );
    };
    let verdict = match call.status {
        // A broken variant, only ever on inside the simulator: a running call starts again.
        CallStatus::Running
            if crate::mutation::active(crate::mutation::Mutation::StartWithoutCondition) =>
        {
            StartVerdict::Accepted
        }
        s => s.on_start().1,
    };
    match verdict {
        StartVerdict::Accepted => (
            Event::CallStarted {
                id: id.to_owned(),
                runner: runner.to_owned(),
                deadline_at_ms: now_ms.saturating_add(call.spec.timeout_ms),
            },
            StartVerdict::Accepted,
        ),
        StartVerdict::Refused(reason) => (
            Event::CallRejected {
                id: id.to_owned(),
                runner: runner.to_owned(),
                reason,
            },
            StartVerdict::Refused(reason),
        ),
    }
}

/// Decides a runner's finish: an event only the first time; repeats change nothing.
pub fn decide_finish(
    calls: &Calls,
    id: String,
    runner: &str,
    outcome: Outcome,
    result: Option<CallResult>,
    log: String,
) -> Option<Event> {
    if calls.status(&id).is_some_and(CallStatus::is_final)
        && !crate::mutation::active(crate::mutation::Mutation::FinishNotIdempotent)
    {
        return None;
    }
    Some(Event::CallFinished {
        id,
        runner: runner.to_owned(),
        outcome,
        result,
        log,
    })
}

/// Decides a cancel: the event when the call is queued or running; `Err` with the call's state
/// (`None`: no such call) otherwise.
pub fn decide_cancel(calls: &Calls, id: &str) -> Result<Event, Option<CallStatus>> {
    match calls.status(id) {
        Some(s) if !s.is_final() => Ok(Event::CallCancelled { id: id.to_owned() }),
        other => Err(other),
    }
}

/// Decides which running calls have passed their deadline at `now_ms`.
/// The ids of the calls a list of events times out.
pub fn timed_out(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::CallTimedOut { id } => Some(id.clone()),
            _ => None,
        })
        .collect()
}

pub fn decide_timeouts(calls: &Calls, due_ids: &[&str], now_ms: u64) -> Vec<Event> {
    due_ids
        .iter()
        .filter_map(|id| calls.get(id))
        .filter(|c| {
            c.status == CallStatus::Running && c.deadline_at_ms.is_some_and(|d| d <= now_ms)
        })
        .map(|c| Event::CallTimedOut {
            id: c.spec.id.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count by state follows every step, a call first met at its finish, and a
    /// forgetting, and is what a look at every call gives.
    #[test]
    fn the_count_by_state_is_what_a_look_at_every_call_gives() {
        use crate::state::{State, apply_at};
        let mut s = State::default();
        let walk = |s: &State| {
            let mut n = [0u64; 6];
            for c in s.calls.by_id.values() {
                n[c.status as usize] += 1;
            }
            n
        };
        for i in 0..4 {
            apply_at(
                &mut s,
                1,
                Event::CallQueued {
                    call: Arc::new(CallSpec::for_test(&format!("c{i}"))),
                },
            );
        }
        let finish = |id: &str| Event::CallFinished {
            id: id.into(),
            runner: "r".into(),
            outcome: Outcome::Success,
            result: None,
            log: String::new(),
        };
        let steps = [
            Event::CallStarted {
                id: "c0".into(),
                runner: "r".into(),
                deadline_at_ms: 100,
            },
            Event::CallStarted {
                id: "c1".into(),
                runner: "r".into(),
                deadline_at_ms: 100,
            },
            finish("c1"),
            // A second start of a running call is refused and ends it.
            Event::CallStarted {
                id: "c0".into(),
                runner: "r".into(),
                deadline_at_ms: 100,
            },
            Event::CallCancelled { id: "c2".into() },
            // A finish of a call never queued records it.
            finish("sync"),
            // A queue event of a known call changes nothing.
            Event::CallQueued {
                call: Arc::new(CallSpec::for_test("c3")),
            },
        ];
        for e in steps {
            apply_at(&mut s, 10, e);
            assert_eq!(s.calls.count_by_status(), walk(&s));
        }
        assert_eq!(s.calls.count_by_status(), [1, 0, 2, 1, 0, 1]);
        apply_at(
            &mut s,
            20,
            Event::CallsForgotten {
                finished_before_ms: 11,
                within: None,
                keep_gone: None,
            },
        );
        assert_eq!(s.calls.count_by_status(), [1, 0, 0, 0, 0, 0]);
        let read = State::decode_snapshot(&s.encode_snapshot()).unwrap();
        assert_eq!(read.calls.count_by_status(), walk(&s));
    }

    #[test]
    fn the_machine_table() {
        use CallStatus::*;
        assert_eq!(Queued.on_start(), (Running, StartVerdict::Accepted));
        assert_eq!(
            Running.on_start(),
            (Error, StartVerdict::Refused(RejectReason::AlreadyRunning))
        );
        for s in [Success, Error, Timeout, Cancelled] {
            assert_eq!(
                s.on_start(),
                (s, StartVerdict::Refused(RejectReason::AlreadyFinal))
            );
            assert_eq!(s.on_finish(Outcome::Success), s);
            assert_eq!(s.on_deadline(), s);
        }
        assert_eq!(Running.on_deadline(), Timeout);
        assert_eq!(Queued.on_cancel(), Cancelled);
        assert_eq!(Running.on_cancel(), Cancelled);
        for s in [Success, Error, Timeout, Cancelled] {
            assert_eq!(s.on_cancel(), s);
        }
        assert_eq!(Queued.on_deadline(), Queued);
        assert_eq!(Running.on_finish(Outcome::Error), Error);
    }

    fn calls_of(ids: &[(u16, bool)]) -> Calls {
        let mut calls = Calls::default();
        for (n, done) in ids {
            let id = format!("ebb-0.{n:05}");
            let mut c = Call::new(Arc::new(placeholder(&id)), CallStatus::Queued, 0);
            if *done {
                c.status = CallStatus::Success;
            }
            calls.by_id.insert(id.into(), Box::new(c));
        }
        calls
    }

    proptest::proptest! {
        /// A page and the newest are what the ids in order give, filtered and cut.
        #[test]
        fn pages_and_the_newest_are_the_ids_in_order(
            ids in proptest::collection::vec((0u16..500, proptest::bool::ANY), 0..120),
            after in proptest::option::of(0u16..500),
            limit in 0usize..30,
            only_done in proptest::bool::ANY,
        ) {
            let calls = calls_of(&ids);
            let keep = |c: &Call| !only_done || c.status.is_final();
            let after = after.map(|n| format!("ebb-0.{n:05}"));
            let ordered: Vec<&str> = calls.sorted().into_iter().map(|(id, _)| id).collect();
            let mut want: Vec<&str> = ordered
                .iter()
                .copied()
                .filter(|id| after.as_ref().is_none_or(|a| *id > a.as_str()) && keep(&calls.by_id[*id]))
                .take(limit)
                .collect();
            let page: Vec<&str> =
                calls.page(after.as_deref(), limit, keep).into_iter().map(|(id, _)| id).collect();
            proptest::prop_assert_eq!(&page, &want);
            want = ordered.iter().rev().copied().filter(|id| keep(&calls.by_id[*id])).take(limit).collect();
            let newest: Vec<&str> =
                calls.newest(limit, keep).into_iter().map(|(id, _)| id).collect();
            proptest::prop_assert_eq!(newest, want);
            let mut sorted = ordered.clone();
            sorted.sort();
            proptest::prop_assert_eq!(ordered, sorted);
        }
    }

    #[test]
    fn calls_serialize_in_id_order() {
        let calls = calls_of(&[(3, false), (1, true), (2, false), (10, false)]);
        // As written, not through a JSON map (which orders its keys itself).
        let json = serde_json::to_string(&calls).unwrap();
        let at = |id: &str| json.find(&format!("\"{id}\":")).unwrap();
        let ids = ["ebb-0.00001", "ebb-0.00002", "ebb-0.00003", "ebb-0.00010"];
        assert!(ids.windows(2).all(|w| at(w[0]) < at(w[1])), "{json}");
        let back: Calls = serde_json::from_str(&json).unwrap();
        assert_eq!(back, calls);
        let bytes = rmp_serde::to_vec_named(&calls).unwrap();
        assert_eq!(bytes, rmp_serde::to_vec_named(&back).unwrap());
    }
}
