//! Operator tooling over a log: statistics, finding a seq by time, and explaining an object by the
//! events that shaped it. Read-only; the command line (`ebb log stats | dump | tail | snapshot |
//! compact`, `ebb replay --until | --at`, `ebb explain KIND ID`, in the binary's `logs.rs`)
//! parses arguments and formats what these return.
//!
//! [`seq_at`] finds a seq by time with a binary search, which works because the writer never lets
//! time go backwards along the log. [`explain`] replays the whole log once (from the snapshot
//! under the first record still stored, after compaction), telling the events that concern the
//! object ([`ebb_core::story`]).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::{Envelope, Event, Kind};
use crate::log::{Error, LogStore, Result, decode_at, open_state, read_envelopes};
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

/// Tells the events that shaped `kind id`, each from the state just before it: the whole log is
/// replayed once (after a compaction, from the snapshot at the first stored record: the events
/// before it are gone). `None` when the log never mentions the object.
pub fn explain(
    store: &dyn LogStore,
    kind: ExplainKind,
    id: &str,
    progress: &mut dyn FnMut(u64),
) -> Result<Option<Explanation>> {
    // After a compaction the log starts at a snapshot's seq: tell what follows it, from it.
    let first = store.first_seq()?.unwrap_or(1);
    let mut state = if first > 1 {
        open_state::<State>(store, Some(first), &mut |_| {})?.0
    } else {
        State::default()
    };
    let mut events = Vec::new();
    let mut story = Vec::new();
    // A route's scaling events are its deployment's; remember every deployment it ever named.
    let mut deployments: Vec<String> = Vec::new();
    for_each(store, state.seq + 1, u64::MAX, &mut |env, _| {
        if env.seq % crate::log::replay::PROGRESS_EVERY == 0 {
            progress(env.seq);
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
            events.push(env);
        } else {
            state.apply(&env);
        }
        true
    })?;
    let current = current(&state, kind, id);
    // Unknown, unless its events were compacted away and it still stands.
    if events.is_empty() && current.is_null() {
        return Ok(None);
    }
    Ok(Some(Explanation {
        kind: kind.name(),
        id: id.to_owned(),
        story,
        events,
        current,
        compacted_through: if first > 1 { first } else { 0 },
    }))
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
