//! Function templates and their instances (chains of steps), as the log describes them.
//!
//! Besides templates (each with its revision, the seq of its last change) and instances, it keeps
//! the last [`CHANGES_KEPT`] template changes by seq: the watch cache that
//! `GET /api/funcs/template?watch=true&since=SEQ` serves from. A watch from an older revision is
//! refused (`410`): list again and watch from the list's revision.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::event::{Outcome, TemplateSpec};

use super::Ended;

/// A template and the log position of its last change (its revision, for watches).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// The template as last upserted.
    pub spec: TemplateSpec,
    /// Seq of the event that last changed it.
    pub revision: u64,
    /// When it was first upserted (since it last did not exist), in ms.
    #[serde(default)]
    pub created_at_ms: u64,
}

/// One step of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The function that ran.
    pub function: String,
    /// The call that carried it.
    pub call_id: String,
    /// When the step was decided.
    pub at_ms: u64,
}

/// Where an instance is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InstanceStatus {
    Running,
    Success,
    Error,
}

/// One invocation of a template: a chain of steps and, once done, a result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// The template invoked.
    pub template: String,
    /// Arguments given at invocation.
    pub args: ByteBuf,
    /// Steps so far.
    pub steps: Vec<Step>,
    /// Current status.
    pub status: InstanceStatus,
    /// Final result.
    pub result: Option<ByteBuf>,
    /// Created and finished times.
    pub created_at_ms: u64,
    pub finished_at_ms: Option<u64>,
}

impl Instance {
    /// Whether it ended before `before_ms`.
    fn ended_before(&self, before_ms: u64) -> bool {
        self.finished_at_ms.is_some_and(|f| f < before_ms)
    }

    /// About how much memory the instance takes in the projection, with the id the map keeps
    /// it under: its fixed size, template name, arguments, steps and result.
    pub fn held_bytes(&self, id: &str) -> u64 {
        let steps: usize = self
            .steps
            .iter()
            .map(|s| std::mem::size_of::<Step>() + s.function.len() + s.call_id.len())
            .sum();
        let fixed = std::mem::size_of::<(String, Instance)>() + 2 * std::mem::size_of::<usize>();
        (fixed
            + id.len()
            + self.template.len()
            + self.args.len()
            + steps
            + self.result.as_ref().map_or(0, |r| r.len())) as u64
    }
}

/// How a template changed (a watch's event type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChangeKind {
    /// Created.
    Added,
    /// Replaced.
    Modified,
    /// Deleted.
    Deleted,
}

/// One change of a template: what it became (or was, when deleted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateChange {
    /// Added, modified or deleted.
    pub kind: ChangeKind,
    /// The template after the change (before it, for a deletion).
    pub template: TemplateSpec,
}

/// Template changes kept for watches (resuming from a revision older than these is refused).
pub const CHANGES_KEPT: usize = 4_096;

/// Templates by name and instances by id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Functions {
    /// Templates by name.
    pub templates: BTreeMap<String, Template>,
    /// Instances by id.
    pub instances: BTreeMap<String, Instance>,
    /// The latest template changes by the seq that made them: the watch cache.
    #[serde(default)]
    pub changes: BTreeMap<u64, TemplateChange>,
    /// The newest seq of a change no longer kept (0: none dropped yet).
    #[serde(default)]
    pub changes_dropped_through: u64,
    /// For templates with a schedule: the occurrence they last fired for (or, before the first
    /// firing, when the schedule was set: nothing earlier fires).
    #[serde(default)]
    pub fired: BTreeMap<String, u64>,
    /// Ids of the instances still running (an index of `instances`).
    #[serde(default)]
    pub running: std::collections::BTreeSet<String>,
    /// The ended instances: how many and about how much memory (an index, for the retention's
    /// bounds; counted again from `instances` when a snapshot is read).
    #[serde(skip)]
    pub ended: Ended,
}

impl Functions {
    fn record(&mut self, seq: u64, kind: ChangeKind, template: TemplateSpec) {
        self.changes.insert(seq, TemplateChange { kind, template });
        while self.changes.len() > CHANGES_KEPT {
            if let Some((old, _)) = self.changes.pop_first() {
                self.changes_dropped_through = old;
            }
        }
    }

    /// The calls of running instances' current steps.
    pub fn current_step_calls(&self) -> std::collections::BTreeSet<&str> {
        self.running
            .iter()
            .filter_map(|id| self.instances.get(id))
            .filter_map(|i| i.steps.last())
            .map(|s| s.call_id.as_str())
            .collect()
    }

    /// Whether any instance ended before `finished_before_ms`.
    pub fn any_finished_before(&self, finished_before_ms: u64) -> bool {
        self.instances
            .values()
            .any(|i| i.ended_before(finished_before_ms))
    }

    /// Drops instances that ended before `finished_before_ms`.
    pub(crate) fn forget(&mut self, finished_before_ms: u64) {
        let ended = &mut self.ended;
        self.instances.retain(|id, i| match i.finished_at_ms {
            Some(at) if at < finished_before_ms => {
                ended.remove(at, i.held_bytes(id), |_| true);
                false
            }
            _ => true,
        });
    }

    /// Counts the ended instances again (after a snapshot is read).
    pub(crate) fn count_ended(&mut self) {
        self.ended = Ended::default();
        for (id, i) in &self.instances {
            if let Some(at) = i.finished_at_ms {
                self.ended.add(at, i.held_bytes(id), ());
            }
        }
    }

    pub(crate) fn delete_template(&mut self, name: &str, seq: u64) {
        if let Some(t) = self.templates.remove(name) {
            self.record(seq, ChangeKind::Deleted, t.spec);
        }
    }

    pub(crate) fn upsert_template(&mut self, spec: &TemplateSpec, seq: u64, at_ms: u64) {
        let created_at_ms = self.templates.get(&spec.name).map(|t| t.created_at_ms);
        let kind = if created_at_ms.is_some() {
            ChangeKind::Modified
        } else {
            ChangeKind::Added
        };
        self.record(seq, kind, spec.clone());
        self.templates.insert(
            spec.name.clone(),
            Template {
                spec: spec.clone(),
                revision: seq,
                created_at_ms: created_at_ms.unwrap_or(at_ms),
            },
        );
    }

    pub(crate) fn create_instance(&mut self, id: &str, template: &str, args: &ByteBuf, at: u64) {
        if !self.instances.contains_key(id) {
            self.running.insert(id.to_owned());
        }
        self.instances.entry(id.to_owned()).or_insert(Instance {
            template: template.to_owned(),
            args: args.clone(),
            steps: Vec::new(),
            status: InstanceStatus::Running,
            result: None,
            created_at_ms: at,
            finished_at_ms: None,
        });
    }

    pub(crate) fn step(&mut self, id: &str, function: &str, call_id: &str, at_ms: u64) {
        if let Some(i) = self.instances.get_mut(id)
            && i.status == InstanceStatus::Running
        {
            i.steps.push(Step {
                function: function.to_owned(),
                call_id: call_id.to_owned(),
                at_ms,
            });
        }
    }

    pub(crate) fn finish(&mut self, id: &str, outcome: Outcome, result: &ByteBuf, at_ms: u64) {
        if let Some(i) = self.instances.get_mut(id)
            && i.status == InstanceStatus::Running
        {
            i.status = match outcome {
                Outcome::Success => InstanceStatus::Success,
                Outcome::Error => InstanceStatus::Error,
            };
            i.result = Some(result.clone());
            i.finished_at_ms = Some(at_ms);
            self.ended.add(at_ms, i.held_bytes(id), ());
            self.running.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::event::{CallSpec, Event, Outcome};
    use crate::state::State;

    use crate::state::apply_at as apply;

    #[test]
    fn the_retention_keeps_a_running_instances_current_step_and_forgets_ended_instances() {
        let mut s = State::default();
        let call = CallSpec::for_test("c1");
        apply(
            &mut s,
            0,
            Event::InstanceCreated {
                id: "i".into(),
                template: "f".into(),
                args: Default::default(),
            },
        );
        apply(
            &mut s,
            0,
            Event::InstanceStepped {
                id: "i".into(),
                function: "f".into(),
                call_id: "c1".into(),
            },
        );
        apply(
            &mut s,
            0,
            Event::CallQueued {
                call: std::sync::Arc::new(call),
            },
        );
        apply(
            &mut s,
            1,
            Event::CallStarted {
                id: "c1".into(),
                runner: "r".into(),
                deadline_at_ms: 1_000,
            },
        );
        apply(
            &mut s,
            2,
            Event::CallFinished {
                id: "c1".into(),
                runner: "r".into(),
                outcome: Outcome::Success,
                result: None,
                log: String::new(),
            },
        );
        // The instance has not read its step's answer yet: the call stays.
        let current = s.functions.current_step_calls();
        assert!(!s.calls.any_finished_before(100, &current));
        apply(
            &mut s,
            50,
            Event::CallsForgotten {
                finished_before_ms: 100,
                within: None,
                keep_gone: None,
            },
        );
        assert!(s.calls.get("c1").is_some());
        assert!(!s.functions.any_finished_before(100));
        // Once the instance ended, both go.
        apply(
            &mut s,
            60,
            Event::InstanceFinished {
                id: "i".into(),
                outcome: Outcome::Success,
                result: Default::default(),
            },
        );
        assert!(
            s.calls
                .any_finished_before(100, &s.functions.current_step_calls())
        );
        assert!(s.functions.any_finished_before(100));
        apply(
            &mut s,
            200,
            Event::CallsForgotten {
                finished_before_ms: 100,
                within: None,
                keep_gone: None,
            },
        );
        apply(
            &mut s,
            200,
            Event::InstancesForgotten {
                finished_before_ms: 100,
                within: None,
            },
        );
        assert!(s.calls.get("c1").is_none());
        assert!(!s.functions.instances.contains_key("i"));
        assert!(s.functions.running.is_empty());
    }
}
