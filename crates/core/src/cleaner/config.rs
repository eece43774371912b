//! The cleaners of `ebb.toml` (`[[cleaner]]`): their configuration, their log names, and the
//! standing retention of ended calls and instances. Their targets are ebb's own objects (run by
//! ebb-cleaner's local cleaner backend, `crates/cleaner/src/local.rs`).
//!
//! Their log names start with [`PREFIX`] (`config/`), which is how the two cleaner loops split the
//! log's cleaners ([`is_local`]): these run on every replica, the `Cleaner` resources only on the
//! lease holder. They are standing (`repeat`): `CleanerFired` arms them again after their retry
//! period. The retention ([`retention`], `config/retention`) is one of them: its firing decides
//! `CallsForgotten { finished_before_ms }`, which drops ended calls from the projection (except a
//! running instance's current step, which the instance has yet to read), and `InstancesForgotten`,
//! which drops ended instances; their events stay in the log, and memory is bounded by the
//! retention.

use crate::event::{CleanerSpec, CleanerTarget};
use serde::Deserialize;

use super::spec::{CleanerResourceSpec, Ref, to_spec};

/// The apiVersion of ebb's own objects as cleaner targets.
pub const API_VERSION: &str = "ebb.dev/v1";

/// The prefix of the log names of `ebb.toml`'s cleaners.
pub const PREFIX: &str = "config/";

/// Whether a cleaner of the log is one of `ebb.toml`'s.
pub fn is_local(name: &str) -> bool {
    name.starts_with(PREFIX)
}

/// A `[[cleaner]]` of `ebb.toml`: a name and the `Cleaner` resource's spec.
#[derive(Debug, Clone, Deserialize)]
pub struct CleanerConfig {
    pub name: String,
    #[serde(flatten)]
    pub spec: CleanerResourceSpec,
}

/// The log's spec of an `ebb.toml` cleaner (problems in `invalid`, as for a resource's).
pub fn config_spec(c: &CleanerConfig) -> CleanerSpec {
    let mut spec = to_spec(&format!("{PREFIX}{}", c.name), "", "", 0, &c.spec);
    spec.repeat = true;
    let mut problems: Vec<String> = (!spec.invalid.is_empty())
        .then(|| spec.invalid.clone())
        .into_iter()
        .collect();
    for (i, t) in spec.targets.iter().enumerate() {
        match Ref::parse(&t.reference) {
            Ok(r) if r.api_version != API_VERSION => problems.push(format!(
                "targets[{i}]: apiVersion {} is not {API_VERSION} (ebb's own objects)",
                r.api_version
            )),
            Ok(r) => match r.kind.to_ascii_lowercase().as_str() {
                "app" | "function" => {}
                "call" | "instance" => {
                    if r.name.is_some()
                        || r.labels.get("state").map(String::as_str) != Some("ended")
                        || r.labels.len() != 1
                    {
                        problems.push(format!(
                            "targets[{i}]: {} targets select matchLabels {{state: ended}}",
                            r.kind
                        ));
                    }
                }
                other => problems.push(format!(
                    "targets[{i}]: kind {other:?} is not App, Function, Call or Instance"
                )),
            },
            Err(e) => problems.push(format!("targets[{i}]: {e}")),
        }
    }
    if c.spec.helm.as_ref().is_some_and(|h| h.delete) {
        problems.push("helm: ebb.toml's cleaners have no Helm releases".into());
    }
    spec.invalid = problems.join("; ");
    spec
}

/// The standing cleaner that is the retention of ended calls and instances: every `period_ms`
/// they leave the projection once `retention_ms` old (their events stay in the log).
pub fn retention(retention_ms: u64, period_ms: u64) -> CleanerSpec {
    let target = |name: &str, kind: &str| CleanerTarget {
        name: name.to_owned(),
        reference: format!("{API_VERSION}/{kind}?state=ended"),
        delete: true,
        include_when_evaluating: false,
    };
    CleanerSpec {
        name: format!("{PREFIX}retention"),
        ttl_ms: retention_ms,
        retry_period_ms: period_ms.max(1),
        targets: vec![target("calls", "Call"), target("instances", "Instance")],
        repeat: true,
        ..CleanerSpec::default()
    }
}
