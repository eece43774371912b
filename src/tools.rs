//! Operator tooling over a log: statistics, finding a seq by time, and explaining an object by the
//! events that shaped it. Read-only; the command line (`ebb log stats | dump | tail | snapshot |
//! compact`, `ebb replay --until | --at`, `ebb explain KIND ID`, in the binary's `logs.rs`)
//! parses arguments and formats what these return.
//!
//! [`seq_at`] finds a seq by time with a binary search, which works because the writer never lets
//! time go backwards along the log. [`explain`] replays the whole log once (from the snapshot
//! under the first record still stored, after compaction), telling the events that concern the
//! object ([`ebb_core::story`]).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::event::{Envelope, Event, Kind};
use crate::log::{Error, LogStore, Result, decode_at, index, open_state, read_envelopes};
use crate::state::State;

/// What `ebb log stats` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    /// First stored seq (after compaction), if any.
    pub first_seq: Option<u64>,
    /// Last seq, 0 when empty.
    pub last_seq: u64,
    /// Stored events.
    pub events: u64,
    /// Time of the first and last stored event.
    pub first_at_ms: Option<u64>,
    pub last_at_ms: Option<u64>,
    /// Seqs covered by stored snapshots.
    pub snapshots: Vec<u64>,
    /// Events per type.
    pub by_type: BTreeMap<&'static str, u64>,
    /// Bytes of encoded events.
    pub event_bytes: u64,
}

/// Scans the whole log once; `progress(seq)` is called along the way.
pub fn stats(store: &dyn LogStore, progress: &mut dyn FnMut(u64)) -> Result<Stats> {
    let mut st = Stats {
        first_seq: store.first_seq()?,
        last_seq: store.last_seq()?,
        events: 0,
        first_at_ms: None,
        last_at_ms: None,
        snapshots: store.snapshot_seqs()?,
        by_type: BTreeMap::new(),
        event_bytes: 0,
    };
    for_each(store, 1, u64::MAX, &mut |env, len| {
        st.events += 1;
        st.event_bytes += len as u64;
        st.first_at_ms.get_or_insert(env.at_ms);
        st.last_at_ms = Some(env.at_ms);
        *st.by_type.entry(env.event.name()).or_default() += 1;
        if env.seq % crate::log::replay::PROGRESS_EVERY == 0 {
            progress(env.seq);
        }
        true
    })?;
    Ok(st)
}

/// Reads every stored record from `from` (or the first stored one, after compaction) to `to`.
pub fn for_each(
    store: &dyn LogStore,
    from: u64,
    to: u64,
    visit: &mut dyn FnMut(Envelope, usize) -> bool,
) -> Result<u64> {
    let from = from.max(store.first_seq()?.unwrap_or(from));
    read_envelopes(store, from, to, visit)
}

/// The last seq whose event happened at or before `at_ms` (0 if none did).
pub fn seq_at(store: &dyn LogStore, at_ms: u64) -> Result<u64> {
    let Some(first) = store.first_seq()? else {
        return Ok(0);
    };
    let last = store.last_seq()?;
    let at = |seq: u64| -> Result<u64> {
        let bytes = store.get(seq)?.ok_or(Error::MissingRecord { seq })?;
        Ok(decode_at(seq, &bytes)?.at_ms)
    };
    if at(first)? > at_ms {
        if first > 1 {
            return Err(Error::Compacted {
                first,
                first_state: first,
            });
        }
        return Ok(0);
    }
    // Envelope times never decrease along the log: binary search for the last one <= at_ms.
    let (mut lo, mut hi) = (first, last);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if at(mid)? <= at_ms {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(lo)
}

/// The objects `ebb explain` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExplainKind {
    Route,
    Deployment,
    Call,
    Cleaner,
    Function,
    Instance,
}

/// The events that shaped one object, told in words, and the object as it stands at the end of
/// the log.
#[derive(Debug, Serialize)]
pub struct Explanation {
    /// What was explained (`route`, `call`, ...).
    pub kind: &'static str,
    /// Its id.
    pub id: String,
    /// Each event in plain words, in log order.
    pub story: Vec<crate::story::Line>,
    /// The events, in log order.
    pub events: Vec<Envelope>,
    /// The object now, as JSON (null when it no longer exists).
    pub current: serde_json::Value,
    /// After a compaction: events up to this seq are only in the snapshot, not told (0: none).
    pub compacted_through: u64,
}

impl ExplainKind {
    /// The kind's name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ExplainKind::Route => "route",
            ExplainKind::Deployment => "deployment",
            ExplainKind::Call => "call",
            ExplainKind::Cleaner => "cleaner",
            ExplainKind::Function => "function",
            ExplainKind::Instance => "instance",
        }
    }

    /// The kind named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::from_str(name, false).ok()
    }
}

fn concerns(kind: ExplainKind, id: &str, deployments: &[String], event: &Event) -> bool {
    let (k, subject) = event.subject();
    match kind {
        ExplainKind::Route => {
            (k == Kind::Route && subject == id)
                || (k == Kind::Deployment && deployments.iter().any(|d| d == subject))
        }
        ExplainKind::Deployment => k == Kind::Deployment && subject == id,
        ExplainKind::Call => {
            (k == Kind::Call && subject == id)
                || matches!(event, Event::InstanceStepped { call_id, .. } if call_id == id)
        }
        ExplainKind::Cleaner => k == Kind::Cleaner && subject == id,
        ExplainKind::Function => {
            // Its counter, its instances, and its workload's route and scaling (`fn-NAME`).
            let workload = || subject.strip_prefix("fn-") == Some(id);
            (k == Kind::Template && subject == id)
                || matches!(event, Event::InstanceCreated { template, .. } if template == id)
                || (matches!(k, Kind::Deployment | Kind::Route) && workload())
        }
        ExplainKind::Instance => k == Kind::Instance && subject == id,
    }
}

/// Tells the events that shaped `kind id`, each from the state just before it. With the subject
/// index ([`LogStore::indexed`]) it reads the object's own events and those its story needs as
/// context ([`explain_indexed`]); a log opened read-only from before the index is scanned whole
/// ([`explain_scan`]). `None` when the log never mentions the object.
pub fn explain(
    store: &dyn LogStore,
    kind: ExplainKind,
    id: &str,
    progress: &mut dyn FnMut(u64),
) -> Result<Option<Explanation>> {
    if store.indexed()? {
        explain_indexed(store, kind, id)
    } else {
        explain_scan(store, kind, id, progress)
    }
}

/// The state the story starts from: empty, or after a compaction the snapshot at the first
/// stored record (the events before it are gone).
fn story_start(store: &dyn LogStore) -> Result<(State, u64)> {
    let first = store.first_seq()?.unwrap_or(1);
    let state = if first > 1 {
        open_state::<State>(store, Some(first), &mut |_| {})?.0
    } else {
        State::default()
    };
    Ok((state, first))
}

/// Feeds a story's events, in log order, to the function it is given.
type Feeder<'a> = dyn FnMut(&mut dyn FnMut(Envelope)) -> Result<()> + 'a;

/// Tells the story from `events`, a superset of the object's events in log order: each is
/// applied, and those that concern the object are told from the state just before them.
fn tell(
    mut state: State,
    first: u64,
    kind: ExplainKind,
    id: &str,
    events: &mut Feeder<'_>,
) -> Result<Option<Explanation>> {
    let mut told = Vec::new();
    let mut story = Vec::new();
    // A route's scaling events are its deployment's; remember every deployment it ever named.
    let mut deployments: Vec<String> = Vec::new();
    events(&mut |env| {
        if env.seq <= state.seq {
            return;
        }
        if let (ExplainKind::Route, Event::RouteUpserted { route }) = (kind, &env.event)
            && route.name == id
            && !deployments.contains(&route.deployment)
        {
            deployments.push(route.deployment.clone());
        }
        if concerns(kind, id, &deployments, &env.event) {
            story.push(crate::story::line(&state, &env));
            state.apply(&env);
            told.push(env);
        } else {
            state.apply(&env);
        }
    })?;
    let current = current(&state, kind, id);
    // Unknown, unless its events were compacted away and it still stands.
    if told.is_empty() && current.is_null() {
        return Ok(None);
    }
    Ok(Some(Explanation {
        kind: kind.name(),
        id: id.to_owned(),
        story,
        events: told,
        current,
        compacted_through: if first > 1 { first } else { 0 },
    }))
}

/// [`explain`] by replaying the whole log once (after a compaction, from the snapshot at the
/// first stored record). The anchor of `ebb bench log`'s explain figure.
pub fn explain_scan(
    store: &dyn LogStore,
    kind: ExplainKind,
    id: &str,
    progress: &mut dyn FnMut(u64),
) -> Result<Option<Explanation>> {
    let (state, first) = story_start(store)?;
    let from = state.seq + 1;
    tell(state, first, kind, id, &mut |apply| {
        for_each(store, from, u64::MAX, &mut |env, _| {
            if env.seq % crate::log::replay::PROGRESS_EVERY == 0 {
                progress(env.seq);
            }
            apply(env);
            true
        })
        .map(|_| ())
    })
}

/// The newest `max` items that `item` makes of the events of `route` and its workload
/// `deployment` since `since_ms`, oldest first, and whether older ones were left out. Reads the
/// two objects' events through the subject index, newest first; a log without the index is
/// scanned from `since_ms`.
pub fn timeline<T>(
    store: &dyn LogStore,
    since_ms: u64,
    route: &str,
    deployment: &str,
    max: usize,
    item: impl Fn(&Envelope, &str, &str) -> Option<T>,
) -> Result<(std::collections::VecDeque<T>, bool)> {
    let from = seq_at(store, since_ms.saturating_sub(1)).unwrap_or(0) + 1;
    let mut out = std::collections::VecDeque::new();
    let mut truncated = false;
    if store.indexed()? {
        let subjects = [
            index::of(Kind::Route, route),
            index::of(Kind::Deployment, deployment),
        ];
        let first = store.first_seq()?.unwrap_or(1);
        for seq in index::seqs(store, &subjects, from.max(first))?
            .into_iter()
            .rev()
        {
            let bytes = store.get(seq)?.ok_or(Error::MissingRecord { seq })?;
            let env = decode_at(seq, &bytes)?;
            if env.at_ms < since_ms {
                break;
            }
            if let Some(t) = item(&env, route, deployment) {
                if out.len() == max {
                    truncated = true;
                    break;
                }
                out.push_front(t);
            }
        }
        return Ok((out, truncated));
    }
    for_each(store, from, u64::MAX, &mut |env, _| {
        if env.at_ms < since_ms {
            return true;
        }
        if let Some(t) = item(&env, route, deployment) {
            if out.len() == max {
                out.pop_front();
                truncated = true;
            }
            out.push_back(t);
        }
        true
    })?;
    Ok((out, truncated))
}

/// The subjects whose events the story of `kind id` reads first.
fn own_subjects(kind: ExplainKind, id: &str) -> Vec<Vec<u8>> {
    let mut out = vec![index::prefix(index::EVERY, "")];
    match kind {
        ExplainKind::Route => out.push(index::of(Kind::Route, id)),
        ExplainKind::Deployment => out.push(index::of(Kind::Deployment, id)),
        ExplainKind::Call => out.push(index::of(Kind::Call, id)),
        ExplainKind::Cleaner => out.push(index::of(Kind::Cleaner, id)),
        ExplainKind::Instance => out.push(index::of(Kind::Instance, id)),
        ExplainKind::Function => {
            let workload = format!("fn-{id}");
            out.push(index::of(Kind::Template, id));
            out.push(index::of(Kind::Route, &workload));
            out.push(index::of(Kind::Deployment, &workload));
        }
    }
    out
}

/// The subjects an event read for the story of `kind id` adds as context: a route's deployments;
/// a deployment's routes and, for a function's workload, its counter; a call's instances.
fn context_of(
    kind: ExplainKind,
    id: &str,
    deployments: &BTreeSet<String>,
    event: &Event,
    add: &mut dyn FnMut(Vec<u8>),
) {
    match event {
        Event::RouteUpserted { route } => {
            if kind == ExplainKind::Route && route.name == id {
                add(index::of(Kind::Deployment, &route.deployment));
            }
            if deployments.contains(&route.deployment) {
                add(index::of(Kind::Route, &route.name));
            }
        }
        Event::InstanceStepped {
            id: instance,
            call_id,
            ..
        } if kind == ExplainKind::Call && call_id == id => {
            add(index::of(Kind::Instance, instance));
        }
        _ => {}
    }
}

/// [`explain`] through the subject index: the object's events, then, until nothing new comes,
/// the events of the objects its story reads ([`context_of`]), each read once by seq.
pub fn explain_indexed(
    store: &dyn LogStore,
    kind: ExplainKind,
    id: &str,
) -> Result<Option<Explanation>> {
    let (state, first) = story_start(store)?;
    let from = state.seq + 1;
    let mut read: BTreeSet<Vec<u8>> = BTreeSet::new();
    let mut pending = own_subjects(kind, id);
    let mut deployments: BTreeSet<String> = BTreeSet::new();
    if kind == ExplainKind::Deployment {
        deployments.insert(id.to_owned());
    }
    if kind == ExplainKind::Function {
        deployments.insert(format!("fn-{id}"));
    }
    // After a compaction the starting snapshot knows links whose events are gone.
    match kind {
        ExplainKind::Route => {
            if let Some(r) = state.routes.by_name.get(id) {
                pending.push(index::of(Kind::Deployment, &r.spec.deployment));
            }
        }
        ExplainKind::Call => {
            for (instance, i) in &state.functions.instances {
                if i.steps.iter().any(|s| s.call_id == id) {
                    pending.push(index::of(Kind::Instance, instance));
                }
            }
        }
        _ => {}
    }
    let mut events: BTreeMap<u64, Envelope> = BTreeMap::new();
    while let Some(subject) = pending.pop() {
        if !read.insert(subject.clone()) {
            continue;
        }
        // A deployment read for its own sake or a route's: its routes and counter are context.
        let deployment = subject.first() == Some(&index::kind_code(Kind::Deployment));
        if let Some((_, d)) = deployment.then(|| index::subject_of(&subject)).flatten() {
            if let Some(function) = d.strip_prefix("fn-") {
                pending.push(index::of(Kind::Template, function));
            }
            for r in state.routes.by_deployment.get(&d).into_iter().flatten() {
                pending.push(index::of(Kind::Route, r));
            }
            deployments.insert(d);
        }
        let mut seqs = Vec::new();
        store.subject_seqs(&subject, from, &mut |seq| {
            seqs.push(seq);
            true
        })?;
        for seq in seqs {
            if events.contains_key(&seq) {
                continue;
            }
            let bytes = store.get(seq)?.ok_or(Error::MissingRecord { seq })?;
            let env = decode_at(seq, &bytes)?;
            context_of(kind, id, &deployments, &env.event, &mut |p| {
                if !read.contains(&p) {
                    pending.push(p);
                }
            });
            events.insert(seq, env);
        }
        // A route read before its deployment was known: look at the events read so far again.
        if deployment {
            for env in events.values() {
                context_of(kind, id, &deployments, &env.event, &mut |p| {
                    if !read.contains(&p) {
                        pending.push(p);
                    }
                });
            }
        }
    }
    tell(state, first, kind, id, &mut |apply| {
        for env in std::mem::take(&mut events).into_values() {
            apply(env);
        }
        Ok(())
    })
}

fn current(state: &State, kind: ExplainKind, id: &str) -> serde_json::Value {
    let v = match kind {
        ExplainKind::Route => state.routes.by_name.get(id).map(|r| {
            let deployment = state.routes.deployments.get(&r.spec.deployment);
            serde_json::json!({ "route": r, "deployment": deployment })
        }),
        ExplainKind::Deployment => state
            .routes
            .deployments
            .get(id)
            .map(|d| serde_json::json!(d)),
        ExplainKind::Call => state.calls.get(id).map(|c| serde_json::json!(c)),
        ExplainKind::Cleaner => state.cleaners.by_name.get(id).map(|c| serde_json::json!(c)),
        ExplainKind::Function => state.functions.templates.get(id).map(
            |t| serde_json::json!({ "template": t, "counter": state.counters.by_function.get(id) }),
        ),
        ExplainKind::Instance => state
            .functions
            .instances
            .get(id)
            .map(|i| serde_json::json!(i)),
    };
    v.unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{
        CallSpec, CleanerSpec, Outcome, RouteSpec, SCHEMA_VERSION, ScaleReason, TemplateSpec,
    };
    use crate::log::{MemStore, RecordBatch};

    fn route(name: &str, deployment: &str) -> Event {
        Event::RouteUpserted {
            route: Box::new(RouteSpec {
                name: name.into(),
                domains: vec![format!("{name}.localhost")],
                deployment: deployment.into(),
                idle_after_ms: 60_000,
                max_replicas: 3,
                ..Default::default()
            }),
        }
    }

    fn seen(route: &str, at: u64) -> Event {
        Event::RequestsSeen {
            route: route.into(),
            count: 2,
            last_at_ms: at,
        }
    }

    fn scale(deployment: &str, from: u32, to: u32, reason: ScaleReason) -> Event {
        Event::ScaleRequested {
            deployment: deployment.into(),
            from,
            to,
            reason,
        }
    }

    fn call(id: &str, target: &str) -> Event {
        Event::CallQueued {
            call: std::sync::Arc::new(CallSpec {
                target: target.into(),
                timeout_ms: 30_000,
                ..CallSpec::for_test(id)
            }),
        }
    }

    fn finished(id: &str) -> Event {
        Event::CallFinished {
            id: id.into(),
            runner: "r1".into(),
            outcome: Outcome::Success,
            result: None,
            log: String::new(),
        }
    }

    /// A log touching every kind, with the cross-object stories: two routes sharing a
    /// deployment, a route moving to another deployment, a function's workload scaled by its
    /// counter, calls stepped by instances, the sweeps that forget ended calls and instances.
    /// Ids as ebb writes them (a UUID, with or without its owner), which the index keeps in its
    /// compact form, beside ids it keeps as text (`c2`, `c3`).
    const C1: &str = "01938c52-7a1b-7c3d-8e4f-0123456789ab";
    const C4: &str = "ebb-1.01938c52-7a1b-7c3d-8e4f-0123456789ac";
    const I1: &str = "ebb-0.01938c52-7a1b-7c3d-8e4f-0123456789ab";

    fn scenario() -> Vec<Event> {
        vec![
            route("a", "d1"),
            route("c", "d2"),
            route("b", "d1"),
            seen("a", 1_000),
            scale("d1", 0, 1, ScaleReason::Wake),
            Event::ScaledUp {
                deployment: "d1".into(),
                replicas: 1,
            },
            seen("b", 5_000),
            Event::WarmStarted {
                route: "b".into(),
                window: 0,
                min: 1,
                scheduled_at_ms: 5_000,
                until_ms: 90_000,
            },
            scale("d2", 0, 1, ScaleReason::Wake),
            route("c", "d1"),
            seen("c", 6_000),
            Event::WarmEnded {
                route: "b".into(),
                window: 0,
            },
            scale("d1", 1, 0, ScaleReason::Idle),
            Event::ScaledDown {
                deployment: "d1".into(),
                replicas: 0,
            },
            Event::TemplateUpserted {
                template: Box::new(TemplateSpec {
                    name: "f".into(),
                    max_instances: 4,
                    ..Default::default()
                }),
            },
            route("fn-f", "fn-f"),
            Event::CounterAdded {
                function: "f".into(),
                by: 5,
                cap: 100,
            },
            scale("fn-f", 0, 2, ScaleReason::Autoscale),
            Event::InstanceCreated {
                id: I1.into(),
                template: "f".into(),
                args: Default::default(),
            },
            call(C1, "f"),
            Event::InstanceStepped {
                id: I1.into(),
                function: "f".into(),
                call_id: C1.into(),
            },
            Event::CallStarted {
                id: C1.into(),
                runner: "r1".into(),
                deadline_at_ms: 99_000,
            },
            finished(C1),
            call("c2", "a"),
            Event::CallsAborted {
                ids: vec!["c2".into(), "c3".into()],
            },
            call(C4, "a"),
            Event::CallStarted {
                id: C4.into(),
                runner: "r2".into(),
                deadline_at_ms: 99_000,
            },
            finished(C4),
            finished(C4),
            Event::CallsForgotten {
                finished_before_ms: 1_000_000,
                within: None,
                keep_gone: None,
            },
            Event::CounterDecayed {
                function: "f".into(),
                by: 2,
            },
            Event::InstanceFinished {
                id: I1.into(),
                outcome: Outcome::Success,
                result: Default::default(),
            },
            Event::CallsForgotten {
                finished_before_ms: 1_000_000,
                within: None,
                keep_gone: None,
            },
            Event::InstancesForgotten {
                finished_before_ms: 1_000_000,
                within: None,
            },
            Event::CleanerUpserted {
                cleaner: Box::new(CleanerSpec {
                    name: "tidy".into(),
                    ..Default::default()
                }),
            },
            Event::CleanerEvaluated {
                name: "tidy".into(),
                result: false,
                next_at_ms: Some(80_000),
                reason: "WaitingForConditions".into(),
                message: String::new(),
                results: vec![false],
                evaluations: 1,
                would_delete: Vec::new(),
                folded: 3,
            },
            Event::CleanerFired {
                name: "tidy".into(),
            },
            Event::RouteRemoved { name: "b".into() },
            seen("a", 70_000),
            scale("d1", 0, 1, ScaleReason::Wake),
            Event::TemplateDeleted { name: "f".into() },
        ]
    }

    fn envelopes() -> Vec<Envelope> {
        scenario()
            .into_iter()
            .enumerate()
            .map(|(i, event)| Envelope {
                seq: i as u64 + 1,
                at_ms: (i as u64 + 1) * 1_000,
                version: SCHEMA_VERSION,
                event,
            })
            .collect()
    }

    /// Writes the scenario, with its index keys or (`indexed` false) without, as a log from
    /// before the index.
    fn store(indexed: bool) -> MemStore {
        let store = MemStore::new();
        let mut batch = RecordBatch::default();
        for env in envelopes() {
            batch.push_with(env.seq, |buf| {
                crate::event::encode_into(buf, env.seq, env.at_ms, &env.event)
            });
            if indexed {
                index::add(&mut batch, &env);
            }
        }
        store.write(&batch, true).unwrap();
        if indexed {
            store.mark_indexed().unwrap();
        }
        store
    }

    const OBJECTS: &[(ExplainKind, &str)] = &[
        (ExplainKind::Route, "a"),
        (ExplainKind::Route, "b"),
        (ExplainKind::Route, "c"),
        (ExplainKind::Route, "fn-f"),
        (ExplainKind::Route, "nope"),
        (ExplainKind::Deployment, "d1"),
        (ExplainKind::Deployment, "d2"),
        (ExplainKind::Deployment, "fn-f"),
        (ExplainKind::Call, C1),
        (ExplainKind::Call, "c2"),
        (ExplainKind::Call, "c3"),
        (ExplainKind::Call, C4),
        (ExplainKind::Function, "f"),
        (ExplainKind::Instance, I1),
        (ExplainKind::Cleaner, "tidy"),
    ];

    fn same_story(store: &dyn LogStore, what: &str) {
        for &(kind, id) in OBJECTS {
            let scan = explain_scan(store, kind, id, &mut |_| {}).unwrap();
            let indexed = explain_indexed(store, kind, id).unwrap();
            assert_eq!(
                serde_json::to_value(&indexed).unwrap(),
                serde_json::to_value(&scan).unwrap(),
                "{what}: {} {id}",
                kind.name()
            );
        }
    }

    #[test]
    fn the_index_tells_every_object_as_the_whole_log_does() {
        let store = store(true);
        // The stories are not trivial: context from other objects shows in them.
        let d1 = explain_indexed(&store, ExplainKind::Deployment, "d1")
            .unwrap()
            .unwrap();
        assert!(
            d1.story.iter().any(|l| l.text.contains("no request for")),
            "{:?}",
            d1.story
        );
        let c1 = explain_indexed(&store, ExplainKind::Call, C1).unwrap();
        assert!(c1.unwrap().events.len() >= 4);
        same_story(&store, "indexed");
    }

    #[test]
    fn a_log_from_before_the_index_is_indexed_by_replay_and_tells_the_same() {
        let store = store(false);
        assert!(!store.indexed().unwrap());
        let scanned: Vec<_> = OBJECTS
            .iter()
            .map(|&(k, id)| serde_json::to_value(explain(&store, k, id, &mut |_| {}).unwrap()))
            .collect::<std::result::Result<_, _>>()
            .unwrap();
        let records = index::rebuild(&store, &mut |_| {}).unwrap();
        assert_eq!(records, scenario().len() as u64);
        assert!(store.indexed().unwrap());
        let rebuilt: Vec<_> = OBJECTS
            .iter()
            .map(|&(k, id)| serde_json::to_value(explain(&store, k, id, &mut |_| {}).unwrap()))
            .collect::<std::result::Result<_, _>>()
            .unwrap();
        assert_eq!(rebuilt, scanned);
        same_story(&store, "rebuilt");
    }

    #[test]
    fn after_a_compaction_the_index_tells_from_the_snapshot_as_the_scan_does() {
        let store = store(true);
        for cut in [5u64, 12, 21, 30] {
            let store = store_copy(&store);
            let mut state = State::default();
            for env in envelopes().iter().take(cut as usize) {
                state.apply(env);
            }
            store.put_snapshot(cut, &state.encode_snapshot()).unwrap();
            store.delete_before(cut).unwrap();
            same_story(&store, &format!("compacted at {cut}"));
        }
    }

    fn store_copy(from: &MemStore) -> MemStore {
        let to = MemStore::new();
        let mut batch = RecordBatch::default();
        from.scan(1, u64::MAX, &mut |seq, bytes| {
            batch.push(seq, bytes);
            index::add(&mut batch, &decode_at(seq, bytes).unwrap());
            true
        })
        .unwrap();
        to.write(&batch, true).unwrap();
        to.mark_indexed().unwrap();
        to
    }

    #[test]
    fn the_timeline_reads_the_same_through_the_index() {
        let item = |env: &Envelope, r: &str, d: &str| {
            let (k, s) = env.event.subject();
            ((k == Kind::Route && s == r) || (k == Kind::Deployment && s == d))
                .then(|| (env.seq, env.event.name()))
        };
        for max in [1, 3, 100] {
            for since in [0, 7_500, 40_000] {
                let a = timeline(&store(true), since, "a", "d1", max, item).unwrap();
                let b = timeline(&store(false), since, "a", "d1", max, item).unwrap();
                assert_eq!(a, b, "max {max} since {since}");
            }
        }
    }
}
