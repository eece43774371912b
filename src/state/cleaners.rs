//! Cleaners as the log describes them: spec, evaluation history and when they fired.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::CleanerSpec;

/// One cleaner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cleaner {
    /// The cleaner as last upserted.
    pub spec: CleanerSpec,
    /// When it was first created: its TTL counts from here.
    pub created_at_ms: u64,
    /// The result of the last evaluation.
    pub last_result: Option<bool>,
    /// Evaluations so far.
    pub evaluations: u64,
    /// When it is evaluated next.
    pub next_at_ms: Option<u64>,
    /// When it fired.
    pub fired_at_ms: Option<u64>,
}

impl Cleaner {
    /// When the TTL has passed.
    pub fn expires_at_ms(&self) -> u64 {
        self.created_at_ms.saturating_add(self.spec.ttl_ms)
    }
}

/// All cleaners by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cleaners {
    /// Cleaners by name.
    pub by_name: BTreeMap<String, Cleaner>,
}

impl Cleaners {
    /// Returns the next evaluation time to schedule, if any.
    pub(crate) fn upsert(&mut self, spec: &CleanerSpec, at_ms: u64) -> Option<u64> {
        let c = self
            .by_name
            .entry(spec.name.clone())
            .and_modify(|c| c.spec = spec.clone())
            .or_insert_with(|| Cleaner {
                spec: spec.clone(),
                created_at_ms: at_ms,
                last_result: None,
                evaluations: 0,
                next_at_ms: None,
                fired_at_ms: None,
            });
        if c.fired_at_ms.is_some() {
            c.next_at_ms = None;
        } else {
            c.next_at_ms = Some(c.expires_at_ms());
        }
        c.next_at_ms
    }

    /// Returns the next evaluation time to schedule, if any.
    pub(crate) fn evaluated(&mut self, name: &str, result: bool, next: Option<u64>) -> Option<u64> {
        let c = self.by_name.get_mut(name)?;
        c.last_result = Some(result);
        c.evaluations += 1;
        if c.fired_at_ms.is_none() {
            c.next_at_ms = next;
        }
        c.next_at_ms
    }

    pub(crate) fn fired(&mut self, name: &str, at_ms: u64) {
        if let Some(c) = self.by_name.get_mut(name) {
            c.fired_at_ms.get_or_insert(at_ms);
            c.next_at_ms = None;
        }
    }
}
