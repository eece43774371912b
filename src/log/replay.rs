//! Folding the log into projections: from scratch, or from the newest usable snapshot plus the
//! records after it. The writer, `ebb replay` and `ebb explain` all rebuild state through here.

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
            Ok(env) => state.apply(&env),
            Err(e) => {
                failure = Some(e);
                return false;
            }
        }
        if seq % PROGRESS_EVERY == 0 {
            progress(seq);
        }
        expected += 1;
        true
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    if expected <= to {
        return Err(Error::Gap {
            expected,
            found: store.last_seq()?,
        });
    }
    Ok(to - from + 1)
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
            if let Some(first) = store.first_seq()? {
                if first > 1 {
                    return Err(Error::Compacted {
                        first,
                        first_state: snaps.first().copied().unwrap_or(first),
                    });
                }
            }
            (P::default(), 0)
        }
    };
    replay_range(store, &mut state, target, progress)?;
    Ok((state, snap_seq))
}
