//! Cleaners as the log describes them: spec, evaluation history, firing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::CleanerSpec;

/// One cleaner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cleaner {
    /// The cleaner as last upserted.
    pub spec: CleanerSpec,
    /// When it was created: its TTL counts from here.
    pub created_at_ms: u64,
    /// The result of the last evaluation (all conditions held).
    pub last_result: Option<bool>,
    /// Each condition's result at the last evaluation.
    #[serde(default)]
    pub results: Vec<bool>,
    /// Where it stands, as the last evaluation said (empty: not evaluated yet).
    #[serde(default)]
    pub reason: String,
    /// The reason in words.
    #[serde(default)]
    pub message: String,
    /// When it was last evaluated.
    #[serde(default)]
    pub evaluated_at_ms: Option<u64>,
    /// Evaluations so far (one per evaluation, however many CEL evaluations it made; the
    /// unrecorded ones counted when the next is recorded).
    pub evaluations: u64,
    /// In dry run: what firing would delete, as the last evaluation found.
    #[serde(default)]
    pub would_delete: Vec<String>,
    /// When it is evaluated next.
    pub next_at_ms: Option<u64>,
    /// What it started deleting, while a firing is under way.
    #[serde(default)]
    pub firing: Option<Vec<String>>,
    /// When it fired.
    pub fired_at_ms: Option<u64>,
}

impl Cleaner {
    /// When the TTL has passed.
    pub fn expires_at_ms(&self) -> u64 {
        self.created_at_ms.saturating_add(self.spec.ttl_ms)
    }

    /// Neither fired nor firing nor invalid: the schedule and target changes evaluate it.
    pub fn is_pending(&self) -> bool {
        self.fired_at_ms.is_none() && self.firing.is_none() && self.spec.invalid.is_empty()
    }
}

/// What one evaluation found, as `CleanerEvaluated` records it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Evaluated<'a> {
    pub result: bool,
    pub next_at_ms: Option<u64>,
    pub reason: &'a str,
    pub message: &'a str,
    pub results: &'a [bool],
    pub would_delete: &'a [String],
    pub folded: u32,
}

/// All cleaners by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cleaners {
    /// Cleaners by name.
    pub by_name: BTreeMap<String, Cleaner>,
}

impl Cleaners {
    /// Returns the next evaluation time to schedule, if any. A new cleaner (or one created again,
    /// with another uid) starts afresh; a changed one keeps its history and is evaluated again
    /// at its expiry (at once when that has passed), unless it fired or is firing.
    pub(crate) fn upsert(&mut self, spec: &CleanerSpec, at_ms: u64) -> Option<u64> {
        let created = if spec.created_at_ms > 0 {
            spec.created_at_ms
        } else {
            at_ms
        };
        let fresh = || Cleaner {
            spec: spec.clone(),
            created_at_ms: created,
            last_result: None,
            results: Vec::new(),
            reason: String::new(),
            message: String::new(),
            evaluated_at_ms: None,
            evaluations: 0,
            would_delete: Vec::new(),
            next_at_ms: None,
            firing: None,
            fired_at_ms: None,
        };
        let c = self.by_name.entry(spec.name.clone()).or_insert_with(fresh);
        if c.spec.uid != spec.uid {
            *c = fresh();
        } else {
            c.spec = spec.clone();
            if spec.created_at_ms > 0 {
                c.created_at_ms = spec.created_at_ms;
            }
        }
        c.next_at_ms = c.is_pending().then(|| c.expires_at_ms());
        c.next_at_ms
    }

    /// Returns the next evaluation time to schedule, if any.
    pub(crate) fn evaluated(&mut self, name: &str, e: &Evaluated<'_>, at_ms: u64) -> Option<u64> {
        let c = self.by_name.get_mut(name)?;
        c.last_result = Some(e.result);
        c.results = e.results.to_vec();
        c.reason = e.reason.to_owned();
        c.message = e.message.to_owned();
        c.would_delete = e.would_delete.to_vec();
        c.evaluated_at_ms = Some(at_ms);
        c.evaluations += 1 + u64::from(e.folded);
        c.next_at_ms = if c.is_pending() { e.next_at_ms } else { None };
        c.next_at_ms
    }

    pub(crate) fn firing(&mut self, name: &str, targets: &[String]) {
        if let Some(c) = self.by_name.get_mut(name)
            && c.fired_at_ms.is_none()
        {
            c.firing.get_or_insert_with(|| targets.to_vec());
            c.next_at_ms = None;
        }
    }

    /// Returns the next evaluation time to schedule: none, but for a standing cleaner, which
    /// is evaluated again after its retry period.
    pub(crate) fn fired(&mut self, name: &str, at_ms: u64) -> Option<u64> {
        let c = self.by_name.get_mut(name)?;
        c.firing = None;
        if c.spec.repeat {
            c.next_at_ms = Some(at_ms.saturating_add(c.spec.retry_period_ms.max(1)));
        } else {
            c.fired_at_ms.get_or_insert(at_ms);
            c.next_at_ms = None;
        }
        c.next_at_ms
    }

    /// Cleaners whose firing started and has not completed: a restart completes them.
    pub fn unfinished_firings(&self) -> impl Iterator<Item = (&str, &Cleaner)> {
        self.by_name
            .iter()
            .filter(|(_, c)| c.firing.is_some() && c.fired_at_ms.is_none())
            .map(|(n, c)| (n.as_str(), c))
    }
}
