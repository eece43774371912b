//! The schedule heap: every future deadline ebb has to act on, earliest first.
//!
//! Call timeouts, route idle deadlines, the next edges of routes' keep-warm windows, cleaner
//! evaluations and the next cron firings of function templates live here ([`Due`]). It is a
//! projection like any other: rebuilt from the log, never written to directly, so a restart
//! rebuilds every deadline. Each key has at most one deadline; setting it again moves it.

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

/// What falls due.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Due {
    /// A running call's deadline (its id kept in place: a call's start sets one and its end
    /// clears it, at the rate calls run).
    CallTimeout(crate::ids::IdKey),
    /// The moment a route becomes idle if no request arrives before it.
    RouteIdle(String),
    /// A cleaner's next evaluation.
    CleanerEval(String),
    /// A function template's next cron firing.
    TemplateFire(String),
    /// A route's next keep-warm window start or end.
    RouteWarm(String),
}

impl Due {
    /// Which queue of the schedule it is in.
    fn kind(&self) -> usize {
        match self {
            Due::CallTimeout(_) => 0,
            Due::RouteIdle(_) => 1,
            Due::CleanerEval(_) => 2,
            Due::TemplateFire(_) => 3,
            Due::RouteWarm(_) => 4,
        }
    }
}

/// The kinds of deadline, each with a queue of its own so a loop that serves one kind finds
/// its next deadline without walking the others'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DueKind {
    CallTimeout = 0,
    RouteIdle = 1,
    CleanerEval = 2,
    TemplateFire = 3,
    RouteWarm = 4,
}

/// Deadlines ordered by time (then key, so ties are deterministic).
///
/// A call's deadline is kept in its queue alone, without the map from key to deadline the other
/// kinds have: a call's start sets it once and its end clears it, at the rate calls run, and the
/// call itself remembers its deadline (`Call::deadline_at_ms`), so its end finds the entry from
/// that ([`Schedule::clear_call`]) instead of hashing its id into a map and out again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<(Due, u64)>", into = "Vec<(Due, u64)>")]
pub struct Schedule {
    /// The deadline of every key but calls'.
    by_key: HashMap<Due, u64, foldhash::fast::RandomState>,
    queues: [BTreeSet<(u64, Due)>; 5],
}

impl Schedule {
    /// Sets (or moves) the deadline of `key`. A call's is set with [`Schedule::set_call`] where
    /// it has none yet; here, any it has is looked for among all calls' deadlines first.
    pub fn set(&mut self, key: Due, at_ms: u64) {
        if let Due::CallTimeout(_) = &key {
            self.clear(&key);
            self.queues[key.kind()].insert((at_ms, key));
            return;
        }
        let q = &mut self.queues[key.kind()];
        let mut entry = (at_ms, key);
        if let Some(old) = self.by_key.insert(entry.1.clone(), at_ms) {
            // The old entry, found with the new one's key (no copy of it).
            entry.0 = old;
            q.remove(&entry);
            entry.0 = at_ms;
        }
        q.insert(entry);
    }

    /// Sets the deadline of call `id`, which has none (a call's start sets it once).
    pub fn set_call(&mut self, id: &str, at_ms: u64) {
        self.queues[DueKind::CallTimeout as usize].insert((at_ms, Due::CallTimeout(id.into())));
    }

    /// Removes the deadline `at_ms` of call `id`, if it is there.
    pub fn clear_call(&mut self, id: &str, at_ms: u64) {
        self.queues[DueKind::CallTimeout as usize].remove(&(at_ms, Due::CallTimeout(id.into())));
    }

    /// Removes the deadline of `key`, if any (a call's among all calls' deadlines: its end
    /// clears it with [`Schedule::clear_call`]).
    pub fn clear(&mut self, key: &Due) {
        if let Due::CallTimeout(id) = key {
            if let Some(old) = self.get(key) {
                self.clear_call(id.as_str(), old);
            }
            return;
        }
        if let Some((key, old)) = self.by_key.remove_entry(key) {
            let kind = key.kind();
            self.queues[kind].remove(&(old, key));
        }
    }

    /// The deadline of `key` (a call's looked for among all calls' deadlines).
    pub fn get(&self, key: &Due) -> Option<u64> {
        match key {
            Due::CallTimeout(_) => self.queues[key.kind()]
                .iter()
                .find(|(_, k)| k == key)
                .map(|(at, _)| *at),
            _ => self.by_key.get(key).copied(),
        }
    }

    /// The earliest deadline.
    pub fn next(&self) -> Option<(u64, &Due)> {
        self.queues
            .iter()
            .filter_map(|q| q.first())
            .min()
            .map(|(at, k)| (*at, k))
    }

    /// The earliest deadline of one kind.
    pub fn next_of(&self, kind: DueKind) -> Option<(u64, &Due)> {
        self.queues[kind as usize].first().map(|(at, k)| (*at, k))
    }

    /// Every deadline at or before `now_ms`, earliest first.
    pub fn due(&self, now_ms: u64) -> impl Iterator<Item = (u64, &Due)> {
        let mut all: Vec<(u64, &Due)> = self
            .queues
            .iter()
            .flat_map(|q| q.iter().take_while(move |(at, _)| *at <= now_ms))
            .map(|(at, k)| (*at, k))
            .collect();
        all.sort();
        all.into_iter()
    }

    /// The deadlines of one kind at or before `now_ms`, earliest first.
    pub fn due_of(&self, kind: DueKind, now_ms: u64) -> impl Iterator<Item = (u64, &Due)> {
        self.queues[kind as usize]
            .iter()
            .take_while(move |(at, _)| *at <= now_ms)
            .map(|(at, k)| (*at, k))
    }

    /// Number of pending deadlines.
    pub fn len(&self) -> usize {
        self.by_key.len() + self.queues[DueKind::CallTimeout as usize].len()
    }

    /// No pending deadline.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Vec<(Due, u64)>> for Schedule {
    fn from(items: Vec<(Due, u64)>) -> Self {
        let mut s = Schedule::default();
        for (k, at) in items {
            match k {
                // A schedule's keys are unique: a call's needs no look for an earlier one.
                Due::CallTimeout(id) => s.set_call(id.as_str(), at),
                k => s.set(k, at),
            }
        }
        s
    }
}

impl From<Schedule> for Vec<(Due, u64)> {
    /// In key order, whatever the map's: a snapshot's bytes depend on its state alone.
    fn from(s: Schedule) -> Self {
        let [calls, ..] = s.queues;
        let mut all: Vec<(Due, u64)> = s
            .by_key
            .into_iter()
            .chain(calls.into_iter().map(|(at, k)| (k, at)))
            .collect();
        all.sort_unstable();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_first_and_moves() {
        let mut s = Schedule::default();
        s.set(Due::CleanerEval("a".into()), 30);
        s.set(Due::RouteIdle("r".into()), 10);
        s.set(Due::CallTimeout("c".into()), 20);
        assert_eq!(s.next(), Some((10, &Due::RouteIdle("r".into()))));
        s.set(Due::RouteIdle("r".into()), 40);
        assert_eq!(s.next(), Some((20, &Due::CallTimeout("c".into()))));
        let due: Vec<_> = s.due(30).map(|(at, _)| at).collect();
        assert_eq!(due, vec![20, 30]);
        assert_eq!(
            s.next_of(DueKind::CleanerEval),
            Some((30, &Due::CleanerEval("a".into())))
        );
        assert_eq!(s.due_of(DueKind::RouteIdle, 30).count(), 0);
        s.clear(&Due::CallTimeout("c".into()));
        assert_eq!(s.len(), 2);
        let round: Schedule = Vec::from(s.clone()).into();
        assert_eq!(round, s);
    }

    #[test]
    fn a_calls_deadline_is_kept_by_its_time_and_found_by_key_too() {
        let mut s = Schedule::default();
        s.set(Due::RouteIdle("r".into()), 15);
        s.set_call("c-1", 20);
        s.set_call("c-2", 10);
        assert_eq!(s.len(), 3);
        assert_eq!(s.get(&Due::CallTimeout("c-1".into())), Some(20));
        assert_eq!(s.next(), Some((10, &Due::CallTimeout("c-2".into()))));
        // A deadline that is not the call's removes nothing.
        s.clear_call("c-2", 11);
        assert_eq!(s.len(), 3);
        s.clear_call("c-2", 10);
        assert_eq!(s.next(), Some((15, &Due::RouteIdle("r".into()))));
        // Set again by key, a call's deadline moves.
        s.set(Due::CallTimeout("c-1".into()), 5);
        assert_eq!(s.len(), 2);
        let due: Vec<_> = s.due_of(DueKind::CallTimeout, 30).collect();
        assert_eq!(due, vec![(5, &Due::CallTimeout("c-1".into()))]);
        let round: Schedule = Vec::from(s.clone()).into();
        assert_eq!(round, s);
        assert_eq!(round.get(&Due::CallTimeout("c-1".into())), Some(5));
        s.clear(&Due::CallTimeout("c-1".into()));
        s.clear(&Due::RouteIdle("r".into()));
        assert!(s.is_empty());
        assert_eq!(s.next(), None);
    }

    #[test]
    fn a_schedule_is_written_in_key_order_whatever_order_it_was_set_in() {
        let keys = [
            (Due::RouteIdle("r".into()), 10),
            (Due::CallTimeout("c-2".into()), 20),
            (Due::CallTimeout("c-1".into()), 20),
            (Due::CleanerEval("a".into()), 5),
        ];
        let mut forward = Schedule::default();
        let mut backward = Schedule::default();
        for (k, at) in &keys {
            forward.set(k.clone(), *at);
        }
        for (k, at) in keys.iter().rev() {
            backward.set(k.clone(), *at);
        }
        let mut sorted = keys.to_vec();
        sorted.sort();
        assert_eq!(Vec::from(forward.clone()), sorted);
        assert_eq!(
            rmp_serde::to_vec(&forward).unwrap(),
            rmp_serde::to_vec(&backward).unwrap()
        );
    }
}
