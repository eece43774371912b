//! The subject index: for every object, the seqs of the events about it, so the story of one
//! object (`ebb explain`, the dashboard's timeline) reads its own events instead of the whole log.
//!
//! A key is `kind (1 byte) | subject | seq (8 bytes, big-endian)`, with an empty value; the seq
//! last sorts an object's entries in log order. The subject is written in one of two forms, each
//! delimited so that no object's keys start with another's ([`prefix`]):
//! * an id as ebb writes them, `[OWNER.]UUID` with the UUID hyphenated in lower case (calls,
//!   instances): `0 | owner length (1 byte) | owner | the UUID's 16 bytes`, 19 bytes for an id
//!   without owner where its text takes 41. A call writes three keys, so their length is CPU on
//!   the log's writer (inserts, comparisons) and on RocksDB's flushes;
//! * any other name: `1 | length (4 bytes, big-endian) | name`.
//!
//! The writer adds an event's keys to the batch that writes the event, so the index is exactly as
//! durable as the events ([`add`]). A log written before the index existed, or with another
//! layout of its keys ([`LAYOUT`]), gets it from one pass over its records ([`rebuild`]); until
//! then [`LogStore::indexed`] is false and readers scan the log as before.
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

/// The layout of the index's keys; a store marks its index complete for this layout, and an
/// index of another is rebuilt ([`rebuild`]). 1: every subject as its text; 2: ids compact.
pub const LAYOUT: u32 = 2;

/// The form of a subject written as an id's owner and UUID.
const COMPACT: u8 = 0;
/// The form of a subject written as its text.
const TEXT: u8 = 1;

/// Writes the subject `code id` (the part of a key before its seq).
fn write_subject(key: &mut Vec<u8>, code: u8, id: &str) {
    key.push(code);
    // (The owner's length must fit its byte.)
    match crate::ids::id_parts(id).filter(|(o, _)| o.is_none_or(|o| o.len() <= 255)) {
        Some((owner, uuid)) => {
            let owner = owner.unwrap_or_default();
            key.push(COMPACT);
            key.push(owner.len() as u8);
            key.extend_from_slice(owner.as_bytes());
            key.extend_from_slice(uuid.as_bytes());
        }
        None => {
            key.push(TEXT);
            key.extend_from_slice(&(id.len() as u32).to_be_bytes());
            key.extend_from_slice(id.as_bytes());
        }
    }
}

/// The prefix of every key of one object: its kind's code and its id.
pub fn prefix(code: u8, id: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(6 + id.len() + 8);
    write_subject(&mut p, code, id);
    p
}

/// The prefix of `kind id`.
pub fn of(kind: Kind, id: &str) -> Vec<u8> {
    prefix(kind_code(kind), id)
}

/// The kind's code and the id of a [`prefix`]; `None` for bytes no prefix has.
pub fn subject_of(prefix: &[u8]) -> Option<(u8, String)> {
    let (&code, rest) = prefix.split_first()?;
    let (&form, rest) = rest.split_first()?;
    let id = match form {
        COMPACT => {
            let (&len, rest) = rest.split_first()?;
            let owner = std::str::from_utf8(rest.get(..len as usize)?).ok()?;
            let uuid = uuid::Uuid::from_slice(rest.get(len as usize..)?).ok()?;
            crate::ids::id_of((!owner.is_empty()).then_some(owner), uuid)
        }
        TEXT => {
            let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            let text = rest.get(4..)?;
            (text.len() == len).then_some(())?;
            std::str::from_utf8(text).ok()?.to_owned()
        }
        _ => return None,
    };
    Some((code, id))
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
            write_subject(key, code, id);
            key.extend_from_slice(&env.seq.to_be_bytes());
        });
    });
}

/// Index entries written per batch by [`rebuild`].
const REBUILD_BATCH: usize = 100_000;

/// Indexes every stored record of a log written before the index existed, or whose index has
/// another layout, then marks the index complete: what the index held goes first. Runs before
/// the writer starts, so nothing is appended meanwhile; a crash part way leaves the index
/// unmarked and the next open starts it again.
pub fn rebuild(store: &dyn LogStore, progress: &mut dyn FnMut(u64)) -> Result<u64> {
    store.clear_index()?;
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

    #[test]
    fn ids_ebb_writes_are_compact_and_other_names_are_text() {
        let uuid = uuid::Uuid::parse_str("01938c52-7a1b-7c3d-8e4f-0123456789ab").unwrap();
        let bare = crate::ids::id_of(None, uuid);
        let owned = crate::ids::id_of(Some("ebb-0"), uuid);
        // kind, form, owner length, owner, 16 bytes.
        assert_eq!(prefix(3, &bare).len(), 3 + 16);
        assert_eq!(prefix(3, &owned).len(), 3 + 5 + 16);
        assert_ne!(prefix(3, &bare), prefix(3, &owned));
        for text in [
            "route-a",
            "",
            "01938C52-7A1B-7C3D-8E4F-0123456789AB",
            ".01938c52-7a1b-7c3d-8e4f-0123456789ab",
            "ebb-001938c52-7a1b-7c3d-8e4f-0123456789ab",
            "01938c527a1b7c3d8e4f0123456789ab",
        ] {
            let p = prefix(3, text);
            assert_eq!(p[1], TEXT, "{text:?}");
            assert_eq!(p.len(), 6 + text.len(), "{text:?}");
        }
        let long_owner = format!("{}.{bare}", "o".repeat(256));
        assert_eq!(prefix(3, &long_owner)[1], TEXT);
        for id in [&bare, &owned, &long_owner, &"route-a".to_owned()] {
            assert_eq!(subject_of(&prefix(3, id)), Some((3, id.clone())));
        }
        assert_eq!(subject_of(&[]), None);
        assert_eq!(subject_of(&[3, 9]), None);
        assert_eq!(subject_of(&[3, TEXT, 0, 0, 0, 5, b'a']), None);
        assert_eq!(subject_of(&[3, COMPACT, 1, b'a', 1, 2]), None);
    }

    proptest::proptest! {
        /// Every subject's prefix gives back its kind and id, so two subjects never share one:
        /// a reader's seek finds only its own object's keys (it also checks a key's length).
        #[test]
        fn a_prefix_stands_for_its_subject_alone(
            code in proptest::prelude::any::<u8>(),
            owner in proptest::option::of("[a-z0-9.-]{0,12}"),
            bytes in proptest::prelude::any::<[u8; 16]>(),
            upper in proptest::prelude::any::<bool>(),
            other in ".{0,48}",
        ) {
            let uuid = uuid::Uuid::from_bytes(bytes);
            let mut id = crate::ids::id_of(owner.as_deref(), uuid);
            if upper {
                id = id.to_uppercase();
            }
            for id in [id, other] {
                let p = prefix(code, &id);
                proptest::prop_assert_eq!(subject_of(&p), Some((code, id.clone())));
            }
        }
    }
}
