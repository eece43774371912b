//! Projections: all of ebb's state, folded from the log.
//!
//! [`State::apply`] is pure: no IO, no clock, no randomness. The time of an event is its envelope's
//! `at_ms`. Replaying the same envelopes always gives an equal (`==`) state, which is how snapshots,
//! replay tooling and the simulator are checked. Projections never refuse an event: decisions
//! refuse bad commands before anything is logged, and `apply` is total so that any log replays.
//!
//! [`State::apply`] folds each event into one of:
//!
//! * [`routes`]: the route store (domain and deployment indexes, last-used times, the replica
//!   facts the log knows, keep-warm windows recorded);
//! * [`counters`]: the functions' call counters;
//! * [`calls`]: every call and its state machine, and the pure call decisions that step it;
//! * [`schedule`]: every future deadline, earliest first (call timeouts, route idle deadlines and
//!   keep-warm edges, cleaner evaluations, cron firings of templates);
//! * [`functions`]: templates with their revision, instances with their steps;
//! * [`cleaners`]: cleaners, their evaluations and firings.

pub mod calls;
pub mod cleaners;
pub mod counters;
pub mod functions;
mod idmap;
pub mod routes;
pub mod schedule;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::event::{Envelope, Event};

pub use calls::{Call, CallStatus, Calls, StartVerdict};
pub use cleaners::{Cleaner, Cleaners};
pub use counters::{Counter, Counters};
pub use functions::{Functions, Instance, InstanceStatus, Template};
pub use routes::{Deployment, Route, Routes};
pub use schedule::{Due, Schedule};

/// How many ended calls (or instances) the projection holds and about how much memory they take:
/// what the retention's bounds (`--call-retention-count`, `--call-retention-bytes`) are held to.
/// An index, kept as they end and are forgotten, and counted again when a snapshot is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// How many.
    pub count: u64,
    /// About how many bytes of memory (their fixed size and every string and body they hold).
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, bytes: u64) {
        self.count += 1;
        self.bytes += bytes;
    }

    fn remove(&mut self, bytes: u64) {
        self.count = self.count.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(bytes);
    }

    /// Whether it holds more than `count` items or more than `bytes` bytes.
    pub fn over(&self, count: u64, bytes: u64) -> bool {
        self.count > count || self.bytes > bytes
    }
}

/// Ended calls (or instances, or what is left of forgotten calls) counted whole and by the
/// millisecond they ended in: where a bound cuts is found without a look at each of them, and
/// with the items of each millisecond (`T`: a call's spec, a forgotten call's id; nothing for
/// instances), the oldest are found without a look at those that stay.
#[derive(Debug, Clone)]
pub struct Ended<T = ()> {
    /// How many.
    pub count: u64,
    /// About how many bytes of memory.
    pub bytes: u64,
    by_ms: std::collections::BTreeMap<u64, Bucket<T>>,
}

/// What ended in one millisecond.
#[derive(Debug, Clone)]
struct Bucket<T> {
    tally: Tally,
    items: Vec<T>,
}

/// What an [`Ended`] holds of each item: something naming it.
pub trait EndedItem {
    /// The item's id (for the order-blind comparison of two indexes).
    fn id(&self) -> &str;
}

impl EndedItem for () {
    fn id(&self) -> &str {
        ""
    }
}

impl EndedItem for crate::ids::IdKey {
    fn id(&self) -> &str {
        self.as_str()
    }
}

impl EndedItem for Arc<crate::event::CallSpec> {
    fn id(&self) -> &str {
        &self.id
    }
}

impl<T> Default for Ended<T> {
    fn default() -> Self {
        Self {
            count: 0,
            bytes: 0,
            by_ms: Default::default(),
        }
    }
}

/// Equal when they count the same in each millisecond and hold the same items there, in any
/// order (an index counted again from a snapshot meets its items in another order than they
/// ended in).
impl<T: EndedItem> PartialEq for Ended<T> {
    fn eq(&self, other: &Self) -> bool {
        fn ids<T: EndedItem>(b: &Bucket<T>) -> Vec<&str> {
            let mut ids: Vec<&str> = b.items.iter().map(T::id).collect();
            ids.sort_unstable();
            ids
        }
        self.count == other.count
            && self.bytes == other.bytes
            && self.by_ms.len() == other.by_ms.len()
            && self.by_ms.iter().zip(&other.by_ms).all(|((a, x), (b, y))| {
                a == b && x.tally == y.tally && x.items.len() == y.items.len() && ids(x) == ids(y)
            })
    }
}

impl<T: EndedItem> Eq for Ended<T> {}

impl<T> Ended<T> {
    /// The whole count.
    pub fn tally(&self) -> Tally {
        Tally {
            count: self.count,
            bytes: self.bytes,
        }
    }

    /// Whether they are more than `count` or take more than `bytes`.
    pub fn over(&self, count: u64, bytes: u64) -> bool {
        self.tally().over(count, bytes)
    }

    fn add(&mut self, at_ms: u64, bytes: u64, item: T) {
        self.count += 1;
        self.bytes += bytes;
        let bucket = self.by_ms.entry(at_ms).or_insert_with(|| Bucket {
            tally: Tally::default(),
            items: Vec::new(),
        });
        bucket.tally.add(bytes);
        bucket.items.push(item);
    }

    /// Takes out one item of `at_ms` that `is` picks (the first, for items that name nothing).
    fn remove(&mut self, at_ms: u64, bytes: u64, is: impl Fn(&T) -> bool) {
        let Some(b) = self.by_ms.get_mut(&at_ms) else {
            return;
        };
        let Some(i) = b.items.iter().position(is) else {
            return;
        };
        b.items.swap_remove(i);
        b.tally.remove(bytes);
        self.count = self.count.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(bytes);
        if b.items.is_empty() {
            self.by_ms.remove(&at_ms);
        }
    }

    /// The time before which the oldest go so that those left are at most `count` taking at
    /// most `bytes`: the newest are kept, and one that goes takes those that ended in its
    /// millisecond with it. `None` when they already are within both.
    pub fn cut_within(&self, count: u64, bytes: u64) -> Option<u64> {
        let mut kept = Tally::default();
        self.by_ms.iter().rev().find_map(|(at, b)| {
            kept.count += b.tally.count;
            kept.bytes += b.tally.bytes;
            kept.over(count, bytes).then_some(at + 1)
        })
    }

    /// Whether any ended before `before_ms`.
    fn any_before(&self, before_ms: u64) -> bool {
        self.by_ms
            .first_key_value()
            .is_some_and(|(at, _)| *at < before_ms)
    }

    /// The items that ended before `before_ms`, oldest first, with when they ended.
    fn items_before(&self, before_ms: u64) -> impl Iterator<Item = (u64, &T)> {
        self.by_ms
            .range(..before_ms)
            .flat_map(|(at, b)| b.items.iter().map(|item| (*at, item)))
    }

    /// Takes out those that ended before `before_ms`: what they were, oldest first, with when
    /// they ended. Their count and bytes go with them.
    fn take_before(&mut self, before_ms: u64) -> impl Iterator<Item = (u64, T)> + use<T> {
        let kept = self.by_ms.split_off(&before_ms);
        let taken = std::mem::replace(&mut self.by_ms, kept);
        for b in taken.values() {
            self.count = self.count.saturating_sub(b.tally.count);
            self.bytes = self.bytes.saturating_sub(b.tally.bytes);
        }
        taken
            .into_iter()
            .flat_map(|(at, b)| b.items.into_iter().map(move |item| (at, item)))
    }
}

/// Applies `event` as the next seq at `at_ms` (for tests that build a state event by event).
#[cfg(test)]
pub(crate) fn apply_at(s: &mut State, at_ms: u64, event: Event) {
    let seq = s.seq + 1;
    s.apply(&Envelope {
        seq,
        at_ms,
        version: crate::event::SCHEMA_VERSION,
        event,
    });
}

/// Everything ebb knows, as of log position `seq`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// The last applied seq (0 before any event).
    pub seq: u64,
    /// The time of the last applied event.
    pub at_ms: u64,
    /// Routes, domains, deployments and last-used times.
    pub routes: Routes,
    /// Function call counters.
    pub counters: Counters,
    /// Calls and their states.
    pub calls: Calls,
    /// Earliest-first deadlines.
    pub schedule: Schedule,
    /// Templates and instances.
    pub functions: Functions,
    /// Cleaners.
    pub cleaners: Cleaners,
}

impl State {
    /// Folds one envelope into the state. Envelopes must come in seq order; one that is not newer
    /// than the state is ignored (so a tail replayed over a snapshot that already covers it is safe).
    pub fn apply(&mut self, env: &Envelope) {
        if env.seq <= self.seq {
            return;
        }
        self.seq = env.seq;
        self.at_ms = self.at_ms.max(env.at_ms);
        let at = env.at_ms;
        match &env.event {
            Event::RouteUpserted { route } => {
                self.routes.upsert(route);
                self.routes.changed_at_seq = env.seq;
                self.schedule_idle(&route.name);
                self.schedule_warm(&route.name, at);
            }
            Event::RouteRemoved { name } => {
                self.routes.remove(name);
                self.routes.changed_at_seq = env.seq;
                self.schedule.clear(&Due::RouteIdle(name.clone()));
                self.schedule.clear(&Due::RouteWarm(name.clone()));
            }
            Event::GatewayRouteAttached { route, attached } => {
                if attached.is_empty() {
                    self.routes.gateway.remove(route);
                } else {
                    self.routes.gateway.insert(route.clone(), attached.clone());
                }
            }
            Event::WarmStarted {
                route,
                window,
                min,
                scheduled_at_ms,
                until_ms,
            } => {
                if let Some(r) = self.routes.by_name.get_mut(route) {
                    r.warm.insert(
                        *window,
                        routes::ActiveWarm {
                            min: *min,
                            scheduled_at_ms: *scheduled_at_ms,
                            until_ms: *until_ms,
                        },
                    );
                    self.schedule_warm(route, at);
                }
            }
            Event::WarmEnded { route, window } => {
                if let Some(r) = self.routes.by_name.get_mut(route) {
                    r.warm.remove(window);
                    self.schedule_warm(route, at);
                }
            }
            Event::RequestsSeen {
                route,
                count,
                last_at_ms,
            } => {
                if self.routes.seen(route, *count, *last_at_ms).is_some() {
                    self.schedule_idle(route);
                }
            }
            Event::ScaleRequested {
                deployment,
                to,
                reason,
                ..
            } => {
                let d = self
                    .routes
                    .deployments
                    .entry(deployment.clone())
                    .or_default();
                d.desired = *to;
                d.desired_at_ms = at;
                d.reason = Some(*reason);
            }
            Event::ScaledUp {
                deployment,
                replicas,
            }
            | Event::ScaledDown {
                deployment,
                replicas,
            } => {
                let d = self
                    .routes
                    .deployments
                    .entry(deployment.clone())
                    .or_default();
                if d.replicas == 0 && *replicas > 0 && d.desired > 0 && d.desired_at_ms > 0 {
                    d.cold_start_ms = at.saturating_sub(d.desired_at_ms);
                }
                d.replicas = *replicas;
                d.scaled_at_ms = at;
                let names: Vec<String> = self
                    .routes
                    .routes_of(deployment)
                    .map(|r| r.spec.name.clone())
                    .collect();
                for name in names {
                    self.schedule_idle(&name);
                }
            }
            Event::ScaleFailed { deployment, .. } => {
                let d = self
                    .routes
                    .deployments
                    .entry(deployment.clone())
                    .or_default();
                d.failures += 1;
            }
            Event::CallQueued { .. }
            | Event::CallStarted { .. }
            | Event::CallRejected { .. }
            | Event::CallFinished { .. }
            | Event::CallTimedOut { .. }
            | Event::CallCancelled { .. } => {
                let (_, id) = env.event.subject();
                match self.calls.apply(at, &env.event) {
                    calls::Timer::Set(deadline) => self.schedule.set_call(id, deadline),
                    calls::Timer::Clear(Some(deadline)) => self.schedule.clear_call(id, deadline),
                    calls::Timer::Clear(None) | calls::Timer::Keep => {}
                }
            }
            Event::CallsAborted { ids } => self.calls.abort(at, ids),
            Event::CallsForgotten {
                finished_before_ms,
                within,
                keep_gone,
            } => {
                let current = self.functions.current_step_calls();
                self.calls.forget(
                    *finished_before_ms,
                    &current,
                    within.map(|k| k.count),
                    *keep_gone,
                );
            }
            Event::InstancesForgotten {
                finished_before_ms, ..
            } => {
                self.functions.forget(*finished_before_ms);
            }
            Event::TemplateUpserted { template } => {
                let before = self
                    .functions
                    .templates
                    .get(&template.name)
                    .and_then(|t| t.spec.schedule.clone());
                self.functions.upsert_template(template, env.seq, at);
                let key = Due::TemplateFire(template.name.clone());
                match &template.schedule {
                    Some(s) => {
                        // A new or changed schedule fires from now on, never for the past.
                        let fired = self
                            .functions
                            .fired
                            .entry(template.name.clone())
                            .or_default();
                        if before.as_ref() != Some(s) {
                            *fired = (*fired).max(at);
                        }
                        let from = *fired;
                        match crate::timing::next_firing(s, from) {
                            Some(next) => self.schedule.set(key, next),
                            None => self.schedule.clear(&key),
                        }
                    }
                    None => {
                        self.functions.fired.remove(&template.name);
                        self.schedule.clear(&key);
                    }
                }
            }
            Event::TemplateDeleted { name } => {
                self.functions.delete_template(name, env.seq);
                self.functions.fired.remove(name);
                self.schedule.clear(&Due::TemplateFire(name.clone()));
            }
            Event::TemplateFired {
                name,
                scheduled_at_ms,
            } => {
                let key = Due::TemplateFire(name.clone());
                let schedule = self
                    .functions
                    .templates
                    .get(name)
                    .and_then(|t| t.spec.schedule.clone());
                if let Some(s) = schedule {
                    let fired = self.functions.fired.entry(name.clone()).or_default();
                    *fired = (*fired).max(*scheduled_at_ms);
                    let from = *fired;
                    match crate::timing::next_firing(&s, from) {
                        Some(next) => self.schedule.set(key, next),
                        None => self.schedule.clear(&key),
                    }
                }
            }
            Event::InstanceCreated { id, template, args } => {
                self.functions.create_instance(id, template, args, at);
            }
            Event::InstanceStepped {
                id,
                function,
                call_id,
            } => self.functions.step(id, function, call_id, at),
            Event::InstanceFinished {
                id,
                outcome,
                result,
            } => self.functions.finish(id, *outcome, result, at),
            Event::CounterAdded { function, by, cap } => {
                self.counters.add(function, *by, *cap, at);
            }
            Event::CounterDecayed { function, by } => self.counters.decay(function, *by),
            Event::CleanerUpserted { cleaner } => {
                let next = self.cleaners.upsert(cleaner, at);
                self.schedule_cleaner(&cleaner.name, next);
            }
            Event::CleanerEvaluated {
                name,
                result,
                next_at_ms,
                reason,
                message,
                results,
                evaluations: _,
                would_delete,
                folded,
            } => {
                let e = cleaners::Evaluated {
                    result: *result,
                    next_at_ms: *next_at_ms,
                    reason,
                    message,
                    results,
                    would_delete,
                    folded: *folded,
                };
                if self.cleaners.by_name.contains_key(name) {
                    let next = self.cleaners.evaluated(name, &e, at);
                    self.schedule_cleaner(name, next);
                }
            }
            Event::CleanerFiring { name, targets } => {
                self.cleaners.firing(name, targets);
                self.schedule.clear(&Due::CleanerEval(name.clone()));
            }
            Event::CleanerFired { name } => {
                let next = self.cleaners.fired(name, at);
                self.schedule_cleaner(name, next);
            }
            Event::CleanerDeleted { name } => {
                self.cleaners.by_name.remove(name);
                self.schedule.clear(&Due::CleanerEval(name.clone()));
            }
        }
    }

    /// A route with running replicas falls idle `idle_after_ms` after its last use (or after its
    /// replicas came up, whichever is later); one with no replicas has nothing to scale down.
    fn schedule_idle(&mut self, route: &str) {
        let key = Due::RouteIdle(route.to_owned());
        let Some(r) = self.routes.by_name.get(route) else {
            self.schedule.clear(&key);
            return;
        };
        match self.routes.deployments.get(&r.spec.deployment) {
            Some(d) if d.replicas > r.spec.idle_floor() => {
                let from = r.last_used_ms.max(d.scaled_at_ms);
                self.schedule
                    .set(key, from.saturating_add(r.spec.idle_after_ms));
            }
            _ => self.schedule.clear(&key),
        }
    }

    /// A route's next keep-warm decision: a window's start or end, or now when what is recorded
    /// is not what is open (the route changed, or ebb was down across an edge).
    fn schedule_warm(&mut self, route: &str, at: u64) {
        let key = Due::RouteWarm(route.to_owned());
        match self
            .routes
            .by_name
            .get(route)
            .and_then(|r| routes::next_warm_edge(r, at))
        {
            Some(next) => self.schedule.set(key, next),
            None => self.schedule.clear(&key),
        }
    }

    fn schedule_cleaner(&mut self, name: &str, next: Option<u64>) {
        let key = Due::CleanerEval(name.to_owned());
        match next {
            Some(at) => self.schedule.set(key, at),
            None => self.schedule.clear(&key),
        }
    }

    /// Encodes the state for a snapshot (MessagePack, named fields).
    pub fn encode_snapshot(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("state always serializes")
    }

    /// Decodes a snapshot written by [`State::encode_snapshot`].
    pub fn decode_snapshot(bytes: &[u8]) -> Result<State, String> {
        let mut s: State = rmp_serde::from_slice(bytes).map_err(|e| e.to_string())?;
        // The tallies of ended calls and instances are indexes a snapshot does not carry.
        s.calls.count_ended();
        s.functions.count_ended();
        Ok(s)
    }
}
