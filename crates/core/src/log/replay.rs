//! Folding the log into projections: from scratch, or from the newest snapshot that decodes at
//! or before the target seq plus the records after it. The writer, `ebb replay` and `ebb explain`
//! all rebuild state through here.
//!
//! [`read_envelopes`] is the one reader of records (replay, `ebb log`, `ebb explain`): it checks
//! that seqs are contiguous and that every record decodes, and names the seq when one does not.
//! Long replays run on two threads, one reading and decoding, the other applying, since the two
//! cost about the same.

use super::store::LogStore;
use super::{Error, Result, decode_at};
use crate::event::Envelope;
use crate::state::State;

/// A state the log can be folded into and snapshotted.
pub trait Projection: Default + Send + Sync + 'static {
    /// Folds one envelope (pure: no IO, no clock).
    fn apply(&mut self, env: &Envelope);
    /// The last seq folded in.
    fn seq(&self) -> u64;
    /// Encodes the projection for a snapshot.
    fn encode_snapshot(&self) -> Vec<u8>;
    /// Decodes a snapshot.
    fn decode_snapshot(bytes: &[u8]) -> std::result::Result<Self, String>;
}

impl Projection for State {
    fn apply(&mut self, env: &Envelope) {
        State::apply(self, env);
    }
    fn seq(&self) -> u64 {
        self.seq
    }
    fn encode_snapshot(&self) -> Vec<u8> {
        State::encode_snapshot(self)
    }
    fn decode_snapshot(bytes: &[u8]) -> std::result::Result<Self, String> {
        State::decode_snapshot(bytes)
    }
}

/// How often (in records) progress is reported.
pub const PROGRESS_EVERY: u64 = 65_536;

/// Ranges at least this long are replayed on two threads: one reads and decodes, the other applies.
const PIPELINE_MIN_RECORDS: u64 = 16_384;
/// Envelopes handed from the decoding thread to the applying one at a time.
const PIPELINE_BATCH: usize = 1_024;
/// Batches in flight between the two threads at most.
const PIPELINE_DEPTH: usize = 8;

/// Reads and decodes the records `from..=to` in order, checking that their seqs are contiguous
/// from `from`; hands each envelope and its encoded size to `visit` until it returns false.
/// Returns the seq after the last one visited. A missing, undecodable or misplaced record is an
/// error naming its seq. Every reader of the log goes through here.
pub fn read_envelopes(
    store: &dyn LogStore,
    from: u64,
    to: u64,
    visit: &mut dyn FnMut(Envelope, usize) -> bool,
) -> Result<u64> {
    let mut expected = from;
    let mut failure = None;
    store.scan(from, to, &mut |seq, bytes| {
        if seq != expected {
            failure = Some(Error::Gap {
                expected,
                found: seq,
            });
            return false;
        }
        match decode_at(seq, bytes) {
            Ok(env) => {
                expected += 1;
                visit(env, bytes.len())
            }
            Err(e) => {
                failure = Some(e);
                false
            }
        }
    })?;
    failure.map_or(Ok(expected), Err)
}

/// [`read_envelopes`], requiring every record up to `to` to be there.
fn decode_range(
    store: &dyn LogStore,
    from: u64,
    to: u64,
    visit: &mut dyn FnMut(Envelope) -> bool,
) -> Result<()> {
    let mut stopped = false;
    let next = read_envelopes(store, from, to, &mut |env, _| {
        stopped = !visit(env);
        !stopped
    })?;
    if !stopped && next <= to {
        return Err(Error::Gap {
            expected: next,
            found: store.last_seq()?,
        });
    }
    Ok(())
}

/// Folds the records after `state.seq()` up to and including `to` into `state`. Records must be
/// contiguous; a missing, undecodable or misplaced record is an error naming its seq. Calls
/// `progress(seq)` every [`PROGRESS_EVERY`] records. Returns how many records were applied.
pub fn replay_range<P: Projection>(
    store: &dyn LogStore,
    state: &mut P,
    to: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<u64> {
    let from = state.seq() + 1;
    if to < from {
        return Ok(0);
    }
    let mut apply = |env: &Envelope| {
        state.apply(env);
        if env.seq.is_multiple_of(PROGRESS_EVERY) {
            progress(env.seq);
        }
    };
    if to - from < PIPELINE_MIN_RECORDS {
        decode_range(store, from, to, &mut |env| {
            apply(&env);
            true
        })?;
        return Ok(to - from + 1);
    }
    // Reading and decoding cost about as much as applying: overlap them on two threads.
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Vec<Envelope>>>(PIPELINE_DEPTH);
        s.spawn(move || {
            let mut batch = Vec::with_capacity(PIPELINE_BATCH);
            let mut receiver_gone = false;
            let res = decode_range(store, from, to, &mut |env| {
                batch.push(env);
                if batch.len() == PIPELINE_BATCH {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(PIPELINE_BATCH));
                    receiver_gone = tx.send(Ok(full)).is_err();
                }
                !receiver_gone
            });
            let last = match res {
                Ok(()) => Ok(batch),
                Err(e) => Err(e),
            };
            let _ = tx.send(last);
        });
        for msg in rx {
            for env in msg? {
                apply(&env);
            }
        }
        Ok(to - from + 1)
    })
}

/// Rebuilds the projection as of `until` (default: the end of the log): the newest snapshot at or
/// before it that decodes, then the records after it. Returns the state and the seq of the
/// snapshot used (0 for none).
pub fn open_state<P: Projection>(
    store: &dyn LogStore,
    until: Option<u64>,
    progress: &mut dyn FnMut(u64),
) -> Result<(P, u64)> {
    let last = store.last_seq()?;
    let target = match until {
        Some(seq) if seq > last => return Err(Error::PastEnd { seq, last }),
        Some(seq) => seq,
        None => last,
    };
    let snaps = store.snapshot_seqs()?;
    let mut state = None;
    for &seq in snaps.iter().rev().filter(|&&s| s <= target) {
        let Some(bytes) = store.get_snapshot(seq)? else {
            continue;
        };
        match P::decode_snapshot(&bytes) {
            Ok(p) if p.seq() == seq => {
                state = Some((p, seq));
                break;
            }
            Ok(p) => tracing::warn!(
                seq,
                covers = p.seq(),
                "snapshot covers another seq than its key; skipping it"
            ),
            Err(why) => tracing::warn!(seq, %why, "snapshot does not decode; skipping it"),
        }
    }
    let (mut state, snap_seq) = match state {
        Some(s) => s,
        None => {
            if let Some(first) = store.first_seq()?
                && first > 1
            {
                return Err(Error::Compacted {
                    first,
                    first_state: snaps.first().copied().unwrap_or(first),
                });
            }
            (P::default(), 0)
        }
    };
    replay_range(store, &mut state, target, progress)?;
    Ok((state, snap_seq))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, SCHEMA_VERSION, encode};
    use crate::log::{MemStore, RecordBatch};

    const N: u64 = PROGRESS_EVERY + 7;

    fn env(seq: u64) -> Envelope {
        Envelope {
            seq,
            at_ms: seq,
            version: SCHEMA_VERSION,
            event: Event::CounterAdded {
                function: format!("f{}", seq % 7),
                by: seq % 5,
                cap: 1_000,
            },
        }
    }

    fn store_with(n: u64) -> MemStore {
        let store = MemStore::new();
        let mut b = RecordBatch::default();
        for seq in 1..=n {
            b.push(seq, &encode(&env(seq)));
        }
        store.write(&b, true).unwrap();
        store
    }

    #[test]
    fn the_two_thread_replay_equals_applying_one_by_one() {
        let store = store_with(N);
        let mut expected = State::default();
        for seq in 1..=N {
            expected.apply(&env(seq));
        }
        let mut seen = Vec::new();
        let mut state = State::default();
        let n = replay_range(&store, &mut state, N, &mut |s| seen.push(s)).unwrap();
        assert_eq!(n, N);
        assert_eq!(state, expected);
        assert_eq!(seen, vec![PROGRESS_EVERY]);
        // From the middle, and only up to a point.
        let mut half = State::default();
        replay_range(&store, &mut half, 10, &mut |_| {}).unwrap();
        replay_range(&store, &mut half, N - 5, &mut |_| {}).unwrap();
        let mut expected_half = State::default();
        for seq in 1..=N - 5 {
            expected_half.apply(&env(seq));
        }
        assert_eq!(half, expected_half);
    }

    #[test]
    fn the_two_thread_replay_names_a_bad_record_and_a_gap() {
        let store = store_with(N);
        let mut b = RecordBatch::default();
        b.push(N - 100, b"\x94\x01garbage");
        store.write(&b, true).unwrap();
        let err = replay_range(&store, &mut State::default(), N, &mut |_| {}).unwrap_err();
        assert!(
            matches!(err, Error::Record { seq, .. } if seq == N - 100),
            "{err}"
        );
        let err = replay_range(&store, &mut State::default(), N + 10, &mut |_| {}).unwrap_err();
        assert!(matches!(err, Error::Record { .. }), "{err}");
        let store = store_with(N);
        store.delete_before(0).unwrap();
        let err = replay_range(&store, &mut State::default(), N + 10, &mut |_| {}).unwrap_err();
        assert!(
            matches!(err, Error::Gap { expected, found } if expected == N + 1 && found == N),
            "{err}"
        );
    }

    #[test]
    fn a_missing_record_in_the_middle_is_a_gap() {
        let store = MemStore::new();
        let mut b = RecordBatch::default();
        for seq in (1..=100).filter(|&s| s != 50) {
            b.push(seq, &encode(&env(seq)));
        }
        store.write(&b, true).unwrap();
        let is_gap_at_50 = |e: &Error| {
            matches!(
                e,
                Error::Gap {
                    expected: 50,
                    found: 51
                }
            )
        };
        let mut n = 0;
        let err = read_envelopes(&store, 1, u64::MAX, &mut |_, _| {
            n += 1;
            true
        })
        .unwrap_err();
        assert!(is_gap_at_50(&err), "{err}");
        assert_eq!(n, 49);
        let err = replay_range(&store, &mut State::default(), 100, &mut |_| {}).unwrap_err();
        assert!(is_gap_at_50(&err), "{err}");
    }
}
