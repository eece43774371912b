//! A replica's log in the simulator: the production codec, projection and replay over the
//! in-memory [`MemStore`], which loses what was not synced when the replica crashes.

use std::sync::Arc;

use ebb_core::event::{Envelope, Event, SCHEMA_VERSION, encode_into};
use ebb_core::log::{LogStore, MemStore, RecordBatch, open_state};
use ebb_core::state::State;

/// One replica's log and live projection.
pub struct SimLog {
    store: Arc<MemStore>,
    /// The live projection.
    pub state: State,
    last_at_ms: u64,
    batch: RecordBatch,
}

impl Default for SimLog {
    fn default() -> Self {
        Self::new()
    }
}

impl SimLog {
    /// An empty log.
    pub fn new() -> Self {
        Self {
            store: Arc::new(MemStore::new()),
            state: State::default(),
            last_at_ms: 0,
            batch: RecordBatch::default(),
        }
    }

    /// Appends `events` at `now_ms` (never before the previous record, as the writer does),
    /// applying each to the live projection. With `torn`, the write is not synced: the caller
    /// crashes the replica before anything acts on it. Returns the envelopes.
    pub fn append(&mut self, events: Vec<Event>, now_ms: u64, torn: bool) -> Vec<Envelope> {
        if events.is_empty() {
            return Vec::new();
        }
        let at = now_ms.max(self.last_at_ms);
        self.last_at_ms = at;
        self.batch.clear();
        let mut out = Vec::with_capacity(events.len());
        for event in events {
            let seq = self.state.seq + 1;
            self.batch
                .push_with(seq, |buf| encode_into(buf, seq, at, &event));
            let env = Envelope {
                seq,
                at_ms: at,
                version: SCHEMA_VERSION,
                event,
            };
            self.state.apply(&env);
            out.push(env);
        }
        self.store
            .write(&self.batch, !torn)
            .expect("the in-memory store does not fail");
        out
    }

    /// A crash: the unsynced tail is gone; the projection is rebuilt from what is left.
    pub fn crash_and_recover(&mut self) -> Result<(), String> {
        self.store.crash();
        let (state, _) = open_state::<State>(self.store.as_ref(), None, &mut |_| {})
            .map_err(|e| e.to_string())?;
        self.state = state;
        Ok(())
    }

    /// Replays the whole log and compares it with the live projection: `Err((invariant, why))`.
    pub fn check_replay(&self) -> Result<(), (&'static str, String)> {
        let (replayed, _) = open_state::<State>(self.store.as_ref(), None, &mut |_| {})
            .map_err(|e| ("replay_equals_live", format!("replay failed: {e}")))?;
        if replayed.schedule != self.state.schedule {
            return Err((
                "schedule_rebuilt_equals_live",
                format!(
                    "the schedule rebuilt from the log ({} entries, next {:?}) differs from the live one ({} entries, next {:?})",
                    replayed.schedule.len(),
                    replayed.schedule.next(),
                    self.state.schedule.len(),
                    self.state.schedule.next()
                ),
            ));
        }
        if replayed != self.state {
            return Err((
                "replay_equals_live",
                format!(
                    "the state replayed from the log (seq {}) differs from the live one (seq {})",
                    replayed.seq, self.state.seq
                ),
            ));
        }
        Ok(())
    }

    /// The records, decoded (for the checks on what the log holds).
    pub fn events(&self) -> Vec<Envelope> {
        let mut out = Vec::new();
        let last = self.store.last_seq().unwrap_or(0);
        let _ = self.store.scan(1, last, &mut |seq, bytes| {
            if let Ok(env) = ebb_core::log::decode_at(seq, bytes) {
                out.push(env);
            }
            true
        });
        out
    }
}
