//! The cleaner loop: evaluates each cleaner when the schedule says (the projection's
//! `Due::CleanerEval`), or at once when one of its targets changes, records every evaluation in
//! the log, and fires through a [`Backend`] (Kubernetes, or ebb's own objects).
//!
//! Overdue evaluations (after a restart, say) run in schedule order at most
//! [`Options::max_per_second`] a second, so a restart never storms the API server; none runs
//! before its planned time. A firing is logged (`CleanerFiring`) before its first deletion and
//! completed (`CleanerFired`) after its last, so one cut short by a crash completes after the
//! restart, and deleting again what is already gone is no error.
//!
//! A [`Backend`] resolves targets from cached reads, begins, deletes and finishes a firing, and
//! reports each recorded evaluation. An evaluation is recorded (`CleanerEvaluated`, with
//! `CleanerFiring` before any deletion) before the firing; `CleanerFired` ends it, and a firing
//! without one is completed at start. Two loops share the log's cleaners by name
//! ([`Cleaners::only`]): `ebb.toml`'s (`config/`) on every replica, the `Cleaner` resources on the
//! lease holder. The CEL bounds (`--cel-max-steps`, `--cel-max-time-ms`) go to every evaluation.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::clock::Clock;
use crate::event::{CleanerSpec, Event};
use crate::log::Log;
use crate::state::{Due, State};

use super::cel::{CompileError, Conditions, Limits};
use super::{Evaluation, Reason, compile, decide};

/// What a cleaner's targets resolve to now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resolved {
    /// The value of each target passed to the conditions, by name.
    pub inputs: Vec<(String, serde_json::Value)>,
    /// Every object the targets resolve to (the status' `resolvedTargets`).
    pub objects: Vec<String>,
    /// What firing deletes, in order: the `CleanerFiring` entries.
    pub deletions: Vec<String>,
}

/// How a deletion ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deleted {
    /// Deleted now.
    Deleted,
    /// Already gone, or replaced by another object of the same name (left alone).
    Gone,
}

/// Where cleaners find their targets and what deletes them.
pub trait Backend: Send + Sync + 'static {
    /// Gets ready to resolve `spec`'s targets (finds and watches their kinds, looking again for
    /// one not found before); called before each evaluation past the TTL.
    fn prepare(&self, _spec: &CleanerSpec) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// The targets of `spec` as they are now (from cached reads: called on every evaluation).
    fn resolve(&self, spec: &CleanerSpec) -> Result<Resolved, String>;
    /// Deletes one entry of a firing (as [`Resolved::deletions`] named it), safely: only the
    /// object that was resolved, never one created since under the same name.
    fn delete(
        &self,
        spec: &CleanerSpec,
        entry: &str,
    ) -> impl Future<Output = Result<Deleted, String>> + Send;
    /// A firing of these entries starts (again, after a restart): hold the cleaner until it
    /// completes.
    fn begin(
        &self,
        spec: &CleanerSpec,
        entries: &[String],
    ) -> impl Future<Output = Result<(), String>> + Send;
    /// The firing is done: remove the cleaner itself.
    fn finish(&self, spec: &CleanerSpec) -> impl Future<Output = Result<(), String>> + Send;
    /// A firing cannot go on for now (`error`, from `step`: starting it, deleting an entry,
    /// removing the cleaner); it is tried again later: show why (a status, a Warning Event).
    fn blocked(
        &self,
        _name: &str,
        _spec: &CleanerSpec,
        _step: &str,
        _error: &str,
    ) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// The cleaner's evaluation or firing was recorded: show it (a status, an event).
    fn report(
        &self,
        name: &str,
        cleaner: &crate::state::Cleaner,
        resolved: &[String],
    ) -> impl Future<Output = ()> + Send;
}

/// The loop's settings.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Evaluations a second at most, overdue ones included.
    pub max_per_second: u32,
    /// The bound of one evaluation.
    pub limits: Limits,
    /// Tries of a deletion before the firing is left for the next pass.
    pub delete_attempts: u32,
    /// Records an evaluation only when it finds something other than the cleaner's last record
    /// (its result, reason or a condition's result); the others are counted into the next
    /// record (`folded`). Off, every evaluation is recorded.
    pub fold_unchanged: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_per_second: 200,
            limits: Limits::default(),
            delete_attempts: 5,
            fold_unchanged: true,
        }
    }
}

/// How soon a firing left unfinished is first tried again (then twice as late each time).
const FIRING_RETRY: Duration = Duration::from_secs(10);

/// The longest wait between tries of an unfinished firing.
const FIRING_RETRY_MAX: Duration = Duration::from_secs(300);

type Compiled = Arc<Result<Conditions, CompileError>>;

/// A compilation, with the conditions and variable names it was compiled from.
type Cached = (Vec<String>, Vec<String>, Compiled);

/// The cleaners of one log.
pub struct Cleaners<B: Backend> {
    log: Arc<Log<State>>,
    clock: Arc<dyn Clock>,
    backend: Arc<B>,
    options: Options,
    /// Compiled conditions by cleaner, with the conditions and variables they were compiled from.
    compiled: Mutex<HashMap<String, Cached>>,
    /// The cleaners this loop runs, by name (another loop runs the others).
    owns: fn(&str) -> bool,
    /// Unfinished firings: failed tries and when to try next.
    retries: Mutex<HashMap<String, (u32, u64)>>,
    /// Evaluations not recorded (they found what the last record says), by cleaner: how many,
    /// and when the next is due. It holds while the log's schedule still has the cleaner due
    /// at the time it had then (a change of the cleaner moves that, and the fold ends); memory
    /// only: after a restart the cleaner is evaluated at the log's time once more.
    folded: Mutex<HashMap<String, Folded>>,
}

/// Unrecorded evaluations of one cleaner.
#[derive(Debug, Clone, Copy)]
struct Folded {
    /// How many since the last record.
    count: u32,
    /// When the log's schedule has the cleaner due (the last record's `next_at_ms`).
    logged_at_ms: u64,
    /// When the next evaluation is due instead.
    next_at_ms: u64,
}

impl<B: Backend> Cleaners<B> {
    pub fn new(
        log: Arc<Log<State>>,
        clock: Arc<dyn Clock>,
        backend: Arc<B>,
        options: Options,
    ) -> Self {
        Cleaners {
            log,
            clock,
            backend,
            options,
            compiled: Mutex::new(HashMap::new()),
            owns: |_| true,
            retries: Mutex::new(HashMap::new()),
            folded: Mutex::new(HashMap::new()),
        }
    }

    /// Runs only the cleaners whose names `owns` says (the log's other cleaners are another
    /// loop's: ebb.toml's on every replica, the Kubernetes ones on the lease holder).
    pub fn only(mut self, owns: fn(&str) -> bool) -> Self {
        self.owns = owns;
        self
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The log.
    pub fn log(&self) -> &Arc<Log<State>> {
        &self.log
    }

    /// Upserts a cleaner, unless the log already has it as it is (so listing cleaners again
    /// after a restart moves no schedule).
    pub async fn upsert(&self, spec: CleanerSpec) -> crate::log::Result<bool> {
        let (changed, _) = self
            .log
            .decide(move |s: &State, _| {
                let same = s
                    .cleaners
                    .by_name
                    .get(&spec.name)
                    .is_some_and(|c| c.spec == spec);
                if same {
                    (Vec::new(), false)
                } else {
                    (
                        vec![Event::CleanerUpserted {
                            cleaner: Box::new(spec),
                        }],
                        true,
                    )
                }
            })
            .await?;
        Ok(changed)
    }

    /// Forgets a deleted cleaner (its targets stay).
    pub async fn delete(&self, name: &str) -> crate::log::Result<bool> {
        let n = name.to_owned();
        let (known, _) = self
            .log
            .decide(move |s: &State, _| {
                if s.cleaners.by_name.contains_key(&n) {
                    (vec![Event::CleanerDeleted { name: n }], true)
                } else {
                    (Vec::new(), false)
                }
            })
            .await?;
        self.compiled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        Ok(known)
    }

    fn compiled(&self, spec: &CleanerSpec) -> Compiled {
        let vars: Vec<String> = super::variables(spec)
            .into_iter()
            .map(str::to_owned)
            .collect();
        let mut cache = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((c, v, compiled)) = cache.get(&spec.name)
            && *c == spec.conditions
            && *v == vars
        {
            return compiled.clone();
        }
        let compiled = Arc::new(compile(spec));
        cache.insert(
            spec.name.clone(),
            (spec.conditions.clone(), vars, compiled.clone()),
        );
        compiled
    }

    /// Evaluates cleaner `name` now, records the evaluation and fires if its conditions hold.
    /// Returns the evaluation, or `None` when there was nothing to evaluate (unknown, fired,
    /// firing, or its TTL not passed).
    pub async fn evaluate(&self, name: &str) -> crate::log::Result<Option<Evaluation>> {
        use tracing::Instrument as _;
        // A span of its own (a trace's root), exported when traces are on.
        let span = tracing::info_span!(
            "cleaner.evaluate",
            ebb.cleaner = %name,
            ebb.cleaner.fire = tracing::field::Empty,
            ebb.cleaner.reason = tracing::field::Empty,
            ebb.cleaner.cel_evaluations = tracing::field::Empty,
        );
        let evaluated = self.evaluate_now(name).instrument(span.clone()).await;
        if let Ok(Some(e)) = &evaluated {
            span.record("ebb.cleaner.fire", e.fire);
            span.record("ebb.cleaner.reason", tracing::field::debug(&e.reason));
            span.record("ebb.cleaner.cel_evaluations", e.evaluations);
        }
        evaluated
    }

    async fn evaluate_now(&self, name: &str) -> crate::log::Result<Option<Evaluation>> {
        let Some(cleaner) = self.log.read(|s| s.cleaners.by_name.get(name).cloned()) else {
            return Ok(None);
        };
        if cleaner.fired_at_ms.is_some() || cleaner.firing.is_some() {
            return Ok(None);
        }
        let now = self.clock.now_ms();
        let spec = cleaner.spec.clone();
        let expires = cleaner.expires_at_ms();
        let resolved = if spec.invalid.is_empty() && now >= expires {
            self.backend.prepare(&spec).await;
            Some(self.backend.resolve(&spec))
        } else {
            None
        };
        let compiled = self.compiled(&spec);
        let limits = self.options.limits;
        let (evaluation, resolved) = {
            let spec = spec.clone();
            tokio::task::spawn_blocking(move || {
                let inputs: Result<Vec<(&str, &serde_json::Value)>, String> = match &resolved {
                    Some(Ok(r)) => Ok(r.inputs.iter().map(|(n, v)| (n.as_str(), v)).collect()),
                    Some(Err(e)) => Err(e.clone()),
                    None => Ok(Vec::new()),
                };
                let e = decide(
                    &spec,
                    expires,
                    now,
                    &compiled,
                    inputs.as_deref().map_err(Clone::clone),
                    limits,
                );
                (e, resolved.and_then(Result::ok).unwrap_or_default())
            })
            .await
            .expect("an evaluation does not panic")
        };
        if evaluation.reason == Reason::NotExpired {
            // Nothing was evaluated: the schedule already says when.
            return Ok(None);
        }
        let firing = evaluation.fire && !spec.dry_run;
        let would_delete = if evaluation.fire && spec.dry_run {
            resolved.deletions.clone()
        } else {
            Vec::new()
        };
        // Found what the last record says, and not firing: counted, not recorded; due again at
        // its own next time.
        if self.options.fold_unchanged
            && !firing
            && let Some(next) = evaluation.next_at_ms
            && let Some(logged) = cleaner.next_at_ms
            && cleaner.evaluated_at_ms.is_some()
            && cleaner.last_result == Some(evaluation.fire)
            && cleaner.reason == evaluation.reason.as_str()
            && cleaner.results == evaluation.results
            && cleaner.would_delete == would_delete
        {
            let count = {
                let mut folded = self.folded.lock().expect("folded lock");
                let f = folded.entry(name.to_owned()).or_insert(Folded {
                    count: 0,
                    logged_at_ms: logged,
                    next_at_ms: next,
                });
                if f.logged_at_ms != logged {
                    // The log moved the cleaner since: a fold of its own.
                    *f = Folded {
                        count: 0,
                        logged_at_ms: logged,
                        next_at_ms: next,
                    };
                }
                f.count = f.count.saturating_add(1);
                f.next_at_ms = next;
                f.count
            };
            // The status says what the log would have said.
            let mut now_is = cleaner;
            now_is.evaluated_at_ms = Some(now);
            now_is.next_at_ms = Some(next);
            now_is.message = evaluation.message.clone();
            now_is.evaluations += u64::from(count);
            self.backend.report(name, &now_is, &resolved.objects).await;
            return Ok(Some(evaluation));
        }
        let folded = self
            .folded
            .lock()
            .expect("folded lock")
            .remove(name)
            .filter(|f| Some(f.logged_at_ms) == cleaner.next_at_ms)
            .map_or(0, |f| f.count);
        let mut events = vec![evaluation.event(name, would_delete, folded)];
        if firing {
            events.push(Event::CleanerFiring {
                name: name.to_owned(),
                targets: resolved.deletions.clone(),
            });
        }
        let n = name.to_owned();
        let uid = spec.uid.clone();
        let conditions = spec.conditions.clone();
        let (recorded, _) = self
            .log
            .decide(move |s: &State, _| {
                // Recorded only if the cleaner is still the one evaluated.
                let same = s.cleaners.by_name.get(&n).is_some_and(|c| {
                    c.spec.uid == uid
                        && c.spec.conditions == conditions
                        && c.fired_at_ms.is_none()
                        && c.firing.is_none()
                });
                if same {
                    (events, true)
                } else {
                    (Vec::new(), false)
                }
            })
            .await?;
        if !recorded {
            return Ok(None);
        }
        self.report(name, &resolved.objects).await;
        if firing {
            self.fire(name).await?;
        }
        Ok(Some(evaluation))
    }

    /// Shows cleaner `name` as the log has it now (its status, before any evaluation: when it
    /// will be evaluated), with what its targets resolve to.
    pub async fn show(&self, name: &str) {
        let Some(c) = self.log.read(|s| s.cleaners.by_name.get(name).cloned()) else {
            return;
        };
        let objects = if c.spec.invalid.is_empty() {
            self.backend
                .resolve(&c.spec)
                .map(|r| r.objects)
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        self.backend.report(name, &c, &objects).await;
    }

    async fn report(&self, name: &str, objects: &[String]) {
        if let Some(c) = self.log.read(|s| s.cleaners.by_name.get(name).cloned()) {
            self.backend.report(name, &c, objects).await;
        }
    }

    /// Carries out (or completes) cleaner `name`'s firing: deletes each entry, then the cleaner,
    /// then records `CleanerFired`. Returns whether it completed; one that did not stays in the
    /// log as firing and is tried again by the loop.
    pub async fn fire(&self, name: &str) -> crate::log::Result<bool> {
        use tracing::Instrument as _;
        let span = tracing::info_span!(
            "cleaner.fire",
            ebb.cleaner = %name,
            ebb.cleaner.completed = tracing::field::Empty,
        );
        let fired = self.fire_now(name).instrument(span.clone()).await;
        if let Ok(done) = &fired {
            span.record("ebb.cleaner.completed", *done);
        }
        fired
    }

    async fn fire_now(&self, name: &str) -> crate::log::Result<bool> {
        let Some(c) = self.log.read(|s| s.cleaners.by_name.get(name).cloned()) else {
            return Ok(false);
        };
        let Some(entries) = c.firing.clone() else {
            return Ok(false);
        };
        if let Err(e) = self.backend.begin(&c.spec, &entries).await {
            tracing::warn!(cleaner = %name, error = %e, "starting a firing failed; it is left for later");
            self.backend
                .blocked(name, &c.spec, "starting the firing", &e)
                .await;
            return Ok(false);
        }
        for entry in &entries {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match self.backend.delete(&c.spec, entry).await {
                    Ok(outcome) => {
                        tracing::info!(cleaner = %name, %entry, ?outcome, "cleaner deleted a target");
                        break;
                    }
                    Err(e) if attempt < self.options.delete_attempts => {
                        tracing::warn!(cleaner = %name, %entry, error = %e, "deleting a target failed; trying again");
                        tokio::time::sleep(Duration::from_millis(100 << attempt.min(6))).await;
                    }
                    Err(e) => {
                        tracing::warn!(cleaner = %name, %entry, error = %e, "deleting a target failed; the firing is left for later");
                        self.backend
                            .blocked(name, &c.spec, &format!("deleting {entry}"), &e)
                            .await;
                        return Ok(false);
                    }
                }
            }
        }
        if let Err(e) = self.backend.finish(&c.spec).await {
            tracing::warn!(cleaner = %name, error = %e, "removing the cleaner failed; the firing is left for later");
            self.backend
                .blocked(name, &c.spec, "removing the cleaner", &e)
                .await;
            return Ok(false);
        }
        self.log
            .append(Event::CleanerFired {
                name: name.to_owned(),
            })
            .await?;
        self.report(name, &[]).await;
        Ok(true)
    }

    /// Completes every firing the log has as started and not done (cut short by a crash, or
    /// left for later after a failed deletion).
    pub async fn complete_firings(&self) {
        let unfinished: Vec<String> = self.log.read(|s| {
            s.cleaners
                .unfinished_firings()
                .filter(|(n, _)| (self.owns)(n))
                .map(|(n, _)| n.to_owned())
                .collect()
        });
        let now = self.clock.now_ms();
        for name in unfinished {
            let waiting = self
                .retries
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&name)
                .is_some_and(|(_, next)| *next > now);
            if waiting {
                continue;
            }
            tracing::info!(cleaner = %name, "completing a firing");
            let done = match self.fire(&name).await {
                Ok(done) => done,
                Err(e) => {
                    tracing::warn!(cleaner = %name, error = %e, "completing a firing failed");
                    false
                }
            };
            let mut retries = self.retries.lock().unwrap_or_else(|e| e.into_inner());
            if done {
                retries.remove(&name);
            } else {
                // Tried again later, each time twice as late, up to FIRING_RETRY_MAX.
                let failures = retries.get(&name).map_or(0, |(f, _)| *f) + 1;
                let wait = FIRING_RETRY
                    .saturating_mul(1 << (failures - 1).min(8))
                    .min(FIRING_RETRY_MAX);
                retries.insert(name, (failures, now + wait.as_millis() as u64));
            }
        }
    }

    /// Evaluates the cleaners due now, earliest first, at most `max`; returns their names.
    pub async fn evaluate_due(&self, max: usize) -> crate::log::Result<Vec<String>> {
        let due = self.due(self.clock.now_ms(), max);
        for name in &due {
            self.evaluate(name).await?;
        }
        Ok(due)
    }

    /// The cleaners due now, earliest first, at most `max`.
    fn due(&self, now_ms: u64, max: usize) -> Vec<String> {
        let folded = self.folded.lock().expect("folded lock");
        self.log.read(|s| {
            s.schedule
                .due_of(crate::state::schedule::DueKind::CleanerEval, now_ms)
                .filter_map(|(at, d)| match d {
                    Due::CleanerEval(n)
                        if (self.owns)(n) && folded_due(&folded, n, at) <= now_ms =>
                    {
                        Some(n.clone())
                    }
                    _ => None,
                })
                .take(max)
                .collect()
        })
    }

    /// When the next of this loop's cleaners is due.
    pub fn next_due(&self) -> Option<u64> {
        let folded = self.folded.lock().expect("folded lock");
        self.log.read(|s| {
            s.schedule
                .due_of(crate::state::schedule::DueKind::CleanerEval, u64::MAX)
                .filter_map(|(at, d)| match d {
                    Due::CleanerEval(n) if (self.owns)(n) => Some(folded_due(&folded, n, at)),
                    _ => None,
                })
                .min()
        })
    }
}

/// When cleaner `name`, due at `logged_at` by the log's schedule, is due: later, while its
/// unrecorded evaluations stand.
fn folded_due(folded: &HashMap<String, Folded>, name: &str, logged_at: u64) -> u64 {
    match folded.get(name) {
        Some(f) if f.logged_at_ms == logged_at => f.next_at_ms.max(logged_at),
        _ => logged_at,
    }
}

/// Runs the loop until `stop`: completes firings cut short, then evaluates cleaners as they fall
/// due and whenever `changed` names one (a target of it changed), at most
/// [`Options::max_per_second`] a second.
pub async fn run<B: Backend>(
    cleaners: Arc<Cleaners<B>>,
    mut changed: mpsc::Receiver<String>,
    mut stop: watch::Receiver<bool>,
) {
    cleaners.complete_firings().await;
    let mut firings = tokio::time::interval(FIRING_RETRY);
    firings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    firings.tick().await;
    let per_second = cleaners.options.max_per_second.max(1) as usize;
    let mut tail = cleaners.log.subscribe();
    let mut nudged: BTreeSet<String> = BTreeSet::new();
    // A token bucket of one second's evaluations.
    let mut tokens = per_second;
    let mut refill =
        tokio::time::interval(Duration::from_millis(1_000 / per_second.min(1_000) as u64));
    refill.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let now = cleaners.clock.now_ms();
        let mut work: Vec<String> = Vec::new();
        while tokens > 0 {
            let Some(n) = nudged.pop_first() else { break };
            work.push(n);
            tokens -= 1;
        }
        if tokens > 0 {
            for n in cleaners.due(now, tokens) {
                if !work.contains(&n) {
                    work.push(n);
                    tokens -= 1;
                }
            }
        }
        for name in &work {
            if let Err(e) = cleaners.evaluate(name).await {
                tracing::warn!(cleaner = %name, error = %e, "evaluating a cleaner failed");
                // The log refuses all work: nothing more to do here.
                return;
            }
        }
        // Firings left for later: tried again with the schedule's pace.
        let wait = match cleaners.next_due() {
            Some(at) if at <= now => Duration::from_millis(10),
            Some(at) => Duration::from_millis((at - now).min(1_000)),
            None => Duration::from_secs(1),
        };
        let sleep = tokio::time::sleep(if tokens == 0 {
            Duration::from_millis(5)
        } else {
            wait
        });
        tokio::pin!(sleep);
        // Waits for a reason to look again: time, a token, a nudge, or a cleaner recorded (a
        // batch of other events, however many, is not one).
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = &mut sleep => break,
                _ = refill.tick(), if tokens < per_second => { tokens += 1; break; }
                _ = firings.tick() => { cleaners.complete_firings().await; break; }
                name = changed.recv() => match name {
                    Some(n) => { nudged.insert(n); break; }
                    None => return,
                },
                batch = tail.recv() => match batch {
                    Ok(b) if !b.iter().any(|e| matches!(
                        e.event,
                        Event::CleanerUpserted { .. } | Event::CleanerFired { .. }
                    )) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    _ => break,
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SimClock;
    use crate::event::CleanerTarget;
    use crate::log::{MemStore, Options as LogOptions};
    use serde_json::json;

    /// The simulation backend: targets from a map, deletions recorded.
    #[derive(Default)]
    struct SimTargets {
        objects: Mutex<HashMap<String, serde_json::Value>>,
        deleted: Mutex<Vec<String>>,
        finished: Mutex<Vec<String>>,
    }

    impl Backend for SimTargets {
        fn resolve(&self, spec: &CleanerSpec) -> Result<Resolved, String> {
            let objects = self.objects.lock().unwrap();
            let mut r = Resolved::default();
            for t in &spec.targets {
                let v = objects.get(&t.reference).cloned().unwrap_or(json!({}));
                r.objects.push(t.reference.clone());
                if t.delete {
                    r.deletions.push(t.reference.clone());
                }
                if t.include_when_evaluating {
                    r.inputs.push((t.name.clone(), v));
                }
            }
            Ok(r)
        }
        async fn delete(&self, _: &CleanerSpec, entry: &str) -> Result<Deleted, String> {
            self.deleted.lock().unwrap().push(entry.to_owned());
            Ok(Deleted::Deleted)
        }
        async fn begin(&self, _: &CleanerSpec, _: &[String]) -> Result<(), String> {
            Ok(())
        }
        async fn finish(&self, spec: &CleanerSpec) -> Result<(), String> {
            self.finished.lock().unwrap().push(spec.name.clone());
            Ok(())
        }
        async fn report(&self, _: &str, _: &crate::state::Cleaner, _: &[String]) {}
    }

    const T0: u64 = 1_795_132_800_000;
    const MIN: u64 = 60_000;

    fn cleaner(name: &str, ttl_ms: u64, condition: &str, monotonic: bool) -> CleanerSpec {
        CleanerSpec {
            name: name.into(),
            ttl_ms,
            retry_period_ms: 7 * MIN,
            monotonic,
            conditions: vec![condition.into()],
            targets: vec![CleanerTarget {
                name: "obj".into(),
                reference: format!("v1/ConfigMap/{name}"),
                delete: true,
                include_when_evaluating: true,
            }],
            ..CleanerSpec::default()
        }
    }

    fn open(store: &Arc<MemStore>, clock: &SimClock) -> Arc<Log<State>> {
        let store: Arc<dyn crate::log::LogStore> = store.clone();
        Arc::new(
            Log::open(
                store,
                LogOptions::default(),
                Arc::new(clock.clone()),
                &mut |_| {},
            )
            .unwrap(),
        )
    }

    /// Every evaluation in the log: (cleaner, time, result).
    fn evaluations(log: &Log<State>) -> Vec<(String, u64, bool)> {
        let store = log.store().clone();
        let last = log.applied_seq();
        let mut out = Vec::new();
        crate::log::read_envelopes(store.as_ref(), 1, last, &mut |e, _| {
            if let Event::CleanerEvaluated { name, result, .. } = e.event {
                out.push((name, e.at_ms, result));
            }
            true
        })
        .unwrap();
        out
    }

    /// Options recording every evaluation, unchanged or not.
    fn every_evaluation() -> Options {
        Options {
            fold_unchanged: false,
            ..Options::default()
        }
    }

    /// Runs cleaners over two simulated hours, a minute at a time, restarting the log at
    /// `restart_at` (if any): the evaluations and firings must be the same as without it.
    fn run_through(restart_at: Option<u64>) -> (Vec<(String, u64, bool)>, Vec<String>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let clock = SimClock::new(T0);
        let store = Arc::new(MemStore::new());
        let backend = Arc::new(SimTargets::default());
        let mut log = open(&store, &clock);
        let specs = vec![
            // Fires at its TTL.
            cleaner("a", 10 * MIN, "true", false),
            // Holds from T0 + 50 min on: found by the search, fired then.
            cleaner(
                "b",
                5 * MIN,
                &format!(
                    "time >= timestamp('{}')",
                    super::super::rfc3339(T0 + 50 * MIN)
                ),
                true,
            ),
            // Never holds: evaluated every 7 minutes after its TTL.
            cleaner("c", 3 * MIN, "false", false),
        ];
        let mut cleaners = Cleaners::new(
            log.clone(),
            Arc::new(clock.clone()),
            backend.clone(),
            every_evaluation(),
        );
        for s in specs {
            rt.block_on(cleaners.upsert(s)).unwrap();
        }
        // The clock moves a minute at a time, or to the next planned evaluation if sooner, as
        // the loop's timer would.
        let mut now = T0;
        let mut step = 0;
        while now <= T0 + 120 * MIN {
            clock.set(now);
            if restart_at == Some(step) {
                drop(cleaners);
                Arc::try_unwrap(log).ok().unwrap().close();
                log = open(&store, &clock);
                cleaners = Cleaners::new(
                    log.clone(),
                    Arc::new(clock.clone()),
                    backend.clone(),
                    every_evaluation(),
                );
                rt.block_on(cleaners.complete_firings());
            }
            rt.block_on(cleaners.evaluate_due(1_000)).unwrap();
            let minute = (now - T0) / MIN * MIN + T0 + MIN;
            now = cleaners
                .next_due()
                .map_or(minute, |d| d.clamp(now + 1, minute));
            step += 1;
        }
        let evals = evaluations(&log);
        let deleted = backend.deleted.lock().unwrap().clone();
        (evals, deleted)
    }

    #[test]
    fn the_schedule_evaluates_each_cleaner_at_its_planned_times_across_restarts() {
        let (evals, deleted) = run_through(None);
        let at = |name: &str| -> Vec<u64> {
            evals
                .iter()
                .filter(|(n, _, _)| n == name)
                .map(|(_, t, _)| t - T0)
                .collect()
        };
        // Nothing before the TTL; `a` fires at it.
        assert_eq!(at("a"), vec![10 * MIN]);
        // `b`: at its TTL (false: the search finds minute 50, to the second), then then (fires).
        let b = at("b");
        assert_eq!(b.len(), 2, "{b:?}");
        assert_eq!(b[0], 5 * MIN);
        assert!(
            (50 * MIN..=50 * MIN + ebb_core::timing::SEARCH_PRECISION_MS).contains(&b[1]),
            "{b:?}"
        );
        assert_eq!(evals.iter().filter(|(n, _, r)| n == "b" && *r).count(), 1);
        // `c`: at its TTL, then every retry period.
        let c: Vec<u64> = (0..)
            .map(|k| (3 + 7 * k) * MIN)
            .take_while(|m| *m <= 120 * MIN)
            .collect();
        assert_eq!(at("c"), c);
        assert_eq!(
            deleted,
            vec!["v1/ConfigMap/a".to_owned(), "v1/ConfigMap/b".to_owned()]
        );
        // A restart at any step neither skips nor repeats an evaluation or a deletion.
        for restart in 0..140 {
            assert_eq!(
                run_through(Some(restart)),
                (evals.clone(), deleted.clone()),
                "restart at {restart}"
            );
        }
    }

    /// A standing cleaner whose evaluations keep finding the same is recorded once; the
    /// evaluations after it are counted into the record of the first that finds something
    /// else, and a restart in between records nothing more.
    #[test]
    fn unchanged_evaluations_are_folded_into_the_next_record() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for restart_at in [None, Some(20 * MIN)] {
            let clock = SimClock::new(T0);
            let store = Arc::new(MemStore::new());
            let backend = Arc::new(SimTargets::default());
            backend
                .objects
                .lock()
                .unwrap()
                .insert("v1/ConfigMap/c".into(), json!({"v": 0}));
            let mut log = open(&store, &clock);
            let mut cleaners = Cleaners::new(
                log.clone(),
                Arc::new(clock.clone()),
                backend.clone(),
                Options::default(),
            );
            rt.block_on(cleaners.upsert(cleaner("c", 3 * MIN, "obj.v == 1", false)))
                .unwrap();
            let mut now = T0;
            while now <= T0 + 60 * MIN {
                clock.set(now);
                if now == T0 + 42 * MIN {
                    // The condition holds from here: the next evaluation (minute 45) fires.
                    backend
                        .objects
                        .lock()
                        .unwrap()
                        .insert("v1/ConfigMap/c".into(), json!({"v": 1}));
                }
                if restart_at == Some(now - T0) {
                    drop(cleaners);
                    Arc::try_unwrap(log).ok().unwrap().close();
                    log = open(&store, &clock);
                    cleaners = Cleaners::new(
                        log.clone(),
                        Arc::new(clock.clone()),
                        backend.clone(),
                        Options::default(),
                    );
                }
                rt.block_on(cleaners.evaluate_due(1_000)).unwrap();
                let minute = (now - T0) / MIN * MIN + T0 + MIN;
                now = cleaners
                    .next_due()
                    .map_or(minute, |d| d.clamp(now + 1, minute));
            }
            let records: Vec<(u64, bool, u32)> = {
                let store = log.store().clone();
                let mut out = Vec::new();
                crate::log::read_envelopes(store.as_ref(), 1, log.applied_seq(), &mut |e, _| {
                    if let Event::CleanerEvaluated { result, folded, .. } = e.event {
                        out.push(((e.at_ms - T0) / MIN, result, folded));
                    }
                    true
                })
                .unwrap();
                out
            };
            let what = format!("restart at {restart_at:?}");
            assert_eq!(records.len(), 2, "{what}: {records:?}");
            assert_eq!(records[0], (3, false, 0), "{what}");
            let (at, result, folded) = records[1];
            assert!(result, "{what}: {records:?}");
            match restart_at {
                // Minutes 10, 17, 24, 31, 38 found the same; 45 fires.
                None => assert_eq!((at, folded), (45, 5), "{what}"),
                // Minutes 10, 17 folded before the restart and forgotten with it; the restart
                // evaluates at once (20) and every retry period after (27, 34, 41): folded;
                // 48 fires.
                Some(_) => assert_eq!((at, folded), (48, 4), "{what}"),
            }
            assert_eq!(
                backend.deleted.lock().unwrap().clone(),
                vec!["v1/ConfigMap/c".to_owned()]
            );
        }
    }
}
