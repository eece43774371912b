//! Function call counters: grow with calls (capped), decay on a period. The function autoscaler
//! reads them; this projection only folds `CounterAdded` and `CounterDecayed`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One function's counter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    /// Current value, never above the cap given with the last addition.
    pub value: u64,
    /// When the counter last grew (envelope time).
    pub last_added_at_ms: u64,
}

/// All counters by function name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Counters by function.
    pub by_function: BTreeMap<String, Counter>,
}

impl Counters {
    pub(crate) fn add(&mut self, function: &str, by: u64, cap: u64, at_ms: u64) {
        let c = self.by_function.entry(function.to_owned()).or_default();
        c.value = c.value.saturating_add(by).min(cap);
        c.last_added_at_ms = at_ms;
    }

    pub(crate) fn decay(&mut self, function: &str, by: u64) {
        if let Some(c) = self.by_function.get_mut(function) {
            c.value = c.value.saturating_sub(by);
        }
    }

    /// A function's counter value (0 when it never counted).
    pub fn value(&self, function: &str) -> u64 {
        self.by_function.get(function).map_or(0, |c| c.value)
    }
}
