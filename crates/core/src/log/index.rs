//! The subject index: for every object, the seqs of the events about it, so the story of one
//! object (`ebb explain`, the dashboard's timeline) reads its own events instead of the whole log.
//!
//! A key is `kind (1 byte) | id length (4 bytes, big-endian) | id | seq (8 bytes, big-endian)`,
//! with an empty value; the length before the id keeps `call-1` apart from `call-10`, and the seq
//! last sorts an object's entries in log order. The writer adds an event's keys to the batch that
//! writes the event, so the index is exactly as durable as the events ([`add`]). A log written
//! before the index existed gets it from one pass over its records ([`rebuild`]); until then
//! [`LogStore::indexed`] is false and readers scan the log as before.
//!
//! An event is indexed under its own subject ([`Event::subject`]) and under the objects whose
//! story needs it as context: a `RouteUpserted` under its deployment too (a deployment's idle
//! reason reads its routes), an `InstanceCreated` under its template, an `InstanceStepped` under
//! its call, a `CallsAborted` under each call it names. The two sweeps that touch every ended
//! object (`CallsForgotten`, `InstancesForgotten`) are indexed under [`EVERY`], which each reader
//! applies too.

use super::store::{LogStore, RecordBatch};
use super::{Result, decode_at};
use crate::event::{Envelope, Event, Kind};

/// The code of the subject that sweeps over every object of their kind.
pub const EVERY: u8 = 0xff;

/// The byte a kind is keyed by.
pub fn kind_code(kind: Kind) -> u8 {
    match kind {
        Kind::Route => 1,
        Kind::Deployment => 2,
        Kind::Call => 3,
        Kind::Template => 4,
        Kind::Instance => 5,
        Kind::Cleaner => 6,
    }
}

/// The prefix of every key of one object: its kind's code and its id.
pub fn prefix(code: u8, id: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(5 + id.len() + 8);
    p.push(code);
    p.extend_from_slice(&(id.len() as u32).to_be_bytes());
    p.extend_from_slice(id.as_bytes());
    p
}

/// The prefix of `kind id`.
pub fn of(kind: Kind, id: &str) -> Vec<u8> {
    prefix(kind_code(kind), id)
}

/// The seq a key ends with; `None` for a key too short to hold one.
pub fn key_seq(key: &[u8]) -> Option<u64> {
    let tail: [u8; 8] = key.get(key.len().checked_sub(8)?..)?.try_into().ok()?;
    Some(u64::from_be_bytes(tail))
}

/// The subjects an event is indexed under (its own first), each as `(code, id)` to `each`: a
/// call's events are indexed as they are written, three per call, so no list is built for them.
pub fn subjects<'a>(event: &'a Event, mut each: impl FnMut(u8, &'a str)) {
    match event {
        Event::CallsForgotten { .. } | Event::InstancesForgotten { .. } => {
            return each(EVERY, "");
        }
        Event::CallsAborted { ids } => {
            return ids
                .iter()
                .for_each(|id| each(kind_code(Kind::Call), id.as_str()));
        }
        _ => {}
    }
    let (kind, id) = event.subject();
    each(kind_code(kind), id);
    match event {
        Event::RouteUpserted { route } => {
            each(kind_code(Kind::Deployment), route.deployment.as_str())
        }
        Event::InstanceCreated { template, .. } => {
            each(kind_code(Kind::Template), template.as_str())
        }
        Event::InstanceStepped { call_id, .. } => each(kind_code(Kind::Call), call_id.as_str()),
        _ => {}
    }
}

/// Adds the index keys of `env` to `batch`.
pub fn add(batch: &mut RecordBatch, env: &Envelope) {
    subjects(&env.event, |code, id| {
        batch.push_index_with(|key| {
            key.push(code);
            key.extend_from_slice(&(id.len() as u32).to_be_bytes());
            key.extend_from_slice(id.as_bytes());
            key.extend_from_slice(&env.seq.to_be_bytes());
        });
    });
}

/// Index entries written per batch by [`rebuild`].
const REBUILD_BATCH: usize = 100_000;

/// Indexes every stored record of a log written before the index existed, then marks the index
/// complete. Runs before the writer starts, so nothing is appended meanwhile; a crash part way
/// leaves the index unmarked and the next open starts it again (its writes are idempotent).
pub fn rebuild(store: &dyn LogStore, progress: &mut dyn FnMut(u64)) -> Result<u64> {
    let first = store.first_seq()?.unwrap_or(1);
    let last = store.last_seq()?;
    let mut batch = RecordBatch::default();
    let mut failed = None;
    let mut records = 0u64;
    store.scan(first, last, &mut |seq, bytes| {
        match decode_at(seq, bytes) {
            Ok(env) => add(&mut batch, &env),
            Err(e) => {
                failed = Some(e);
                return false;
            }
        }
        records += 1;
        if batch.index_len() >= REBUILD_BATCH {
            if let Err(e) = store.write(&batch, false) {
                failed = Some(e);
                return false;
            }
            batch.clear();
            progress(seq);
        }
        true
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    store.write(&batch, true)?;
    store.mark_indexed()?;
    Ok(records)
}

/// The seqs of the events about the subjects `prefixes`, from `from` on, merged in log order
/// without repeats.
pub fn seqs(store: &dyn LogStore, prefixes: &[Vec<u8>], from: u64) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for p in prefixes {
        store.subject_seqs(p, from, &mut |seq| {
            out.push(seq);
            true
        })?;
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_holds_its_subject_and_seq_and_ids_that_share_a_start_stay_apart() {
        let env = |seq, id: &str| Envelope {
            seq,
            at_ms: 1,
            version: crate::event::SCHEMA_VERSION,
            event: Event::CallTimedOut { id: id.into() },
        };
        let mut batch = RecordBatch::default();
        add(&mut batch, &env(7, "call-1"));
        add(&mut batch, &env(8, "call-10"));
        let keys: Vec<Vec<u8>> = batch.index_keys().map(<[u8]>::to_vec).collect();
        assert_eq!(keys.len(), 2);
        let p = of(Kind::Call, "call-1");
        assert!(keys[0].starts_with(&p));
        assert!(!keys[1].starts_with(&p));
        assert_eq!(key_seq(&keys[0]), Some(7));
        assert_eq!(key_seq(&keys[1]), Some(8));
        assert_eq!(key_seq(b"short"), None);
    }
}
