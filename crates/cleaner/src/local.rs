//! Cleaners of `ebb.toml`: the same core over ebb's own objects, on every replica.
//!
//! ```toml
//! [[cleaner]]
//! name = "previews"
//! ttl = "72h"
//! retry = { period = "1h" }
//! conditions = ["time - timestamp(app.status.lastUsed) > duration('24h')"]
//! targets = [{ name = "app", reference = { apiVersion = "ebb.dev/v1", kind = "App", name = "preview" }, delete = true, includeWhenEvaluating = true }]
//! ```
//!
//! Kinds (`apiVersion: ebb.dev/v1`): `App` (a route and its workload) and `Function` (a
//! template), by `name` or by `matchLabels` over `name` (and an app's `deployment`); `Call` and
//! `Instance` with `matchLabels: {state: ended}`: the ended ones whose end is at least the TTL
//! ago. Such a cleaner is a standing policy: after each firing it is evaluated again after its
//! retry period. The retention of ended calls and instances is one of them, `retention`
//! (`ebb serve --call-retention-ms`), unless `ebb.toml` names its own.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::clock::Clock;
use crate::event::{CleanerSpec, Event, KeepGone};
use crate::log::Log;
use crate::state::State;

use super::runtime::{Backend, Deleted, Resolved};
use super::spec::Ref;

use ebb_core::calls::FORGET_STEP;
pub use ebb_core::cleaner::config::{
    API_VERSION, CleanerConfig, PREFIX, RetentionBounds, config_spec, is_local, retention,
};

/// How often [`hold_within`] looks at the tallies of ended calls and instances: the bounds can be
/// passed by what ends in this long.
pub const BOUNDS_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Holds the ended calls and instances the projection keeps within `bounds`, beside the
/// retention's age, until `stop`: every [`BOUNDS_EVERY`] it reads their tallies, and when one is
/// over a bound it forgets the oldest until they are back within ([`RetentionBounds::kept`]), on
/// every replica, like the retention: [`FORGET_STEP`] a decision, one after the other, so a
/// decision made meanwhile waits behind one step, not the whole forgetting
/// ([`RetentionBounds::step`]).
pub async fn hold_within(
    log: Arc<Log<State>>,
    bounds: RetentionBounds,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(BOUNDS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Tallies over a bound with nothing the decision may forget (the calls of running
    // instances' current steps stay): looked at again only once they change.
    let mut stuck = None;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        let over = log.read(|s| {
            bounds
                .exceeded(s)
                .then_some((s.calls.ended.tally(), s.functions.ended.tally()))
        });
        let Some(tallies) = over else { continue };
        if stuck == Some(tallies) {
            continue;
        }
        // Bounded by the steps what was there when it began takes; what ends meanwhile waits
        // for a tick.
        let steps = tallies.0.count.max(tallies.1.count) / FORGET_STEP + 2;
        match forget_in_steps(&log, bounds, steps).await {
            // Nothing at all to forget while over a bound: stuck until it changes.
            Ok(forgot) => stuck = (!forgot).then_some(tallies),
            Err(e) => {
                tracing::warn!(error = %e, "forgetting ended calls over the retention's bounds failed");
                // A failing log: look again in a while, not every tick.
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                }
            }
        }
    }
}

/// Decides steps of [`FORGET_STEP`] until one forgets nothing (back within what is kept, or
/// nothing it may forget), at most `steps`; whether any forgot something.
async fn forget_in_steps(
    log: &Log<State>,
    bounds: RetentionBounds,
    steps: u64,
) -> crate::log::Result<bool> {
    for step in 0..steps {
        let (none, _) = log
            .decide(move |s: &State, _| {
                let events = bounds.step(s, FORGET_STEP);
                let none = events.is_empty();
                (events, none)
            })
            .await?;
        if none {
            return Ok(step > 0);
        }
    }
    Ok(true)
}

/// ebb's own objects as targets.
pub struct LocalTargets {
    log: Arc<Log<State>>,
    clock: Arc<dyn Clock>,
    gone: KeepGoneFor,
}

/// How long after its put a message of a call the log does not know is taken for a forgotten
/// call's (`CallOptions::forgotten_after_ms`), and how many forgotten calls may be kept known by
/// their id until then: a forgetting by age sooner than that keeps them ([`KeepGone`]).
#[derive(Debug, Clone, Copy)]
pub struct KeepGoneFor {
    pub after_ms: u64,
    pub most: u64,
}

impl KeepGoneFor {
    /// What a forgetting by age before `before` at `now` keeps known of the calls it forgets:
    /// those that ended within `after_ms` of `now`, when it forgets any of them.
    fn at(self, before: u64, now: u64) -> Option<KeepGone> {
        let since = now.saturating_sub(self.after_ms);
        (since < before).then_some(KeepGone {
            ended_since_ms: since,
            most: self.most,
        })
    }
}

impl LocalTargets {
    pub fn new(log: Arc<Log<State>>, clock: Arc<dyn Clock>, gone: KeepGoneFor) -> Arc<Self> {
        Arc::new(LocalTargets { log, clock, gone })
    }
}

fn labels_match(labels: &BTreeMap<String, String>, have: &[(&str, &str)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| have.iter().any(|(hk, hv)| hk == k && hv == v))
}

fn time(ms: u64) -> String {
    super::rfc3339(ms)
}

/// Ended calls or instances: the targets of the retention.
#[derive(Debug, Clone, Copy)]
enum Ended {
    Calls,
    Instances,
}

impl Ended {
    fn kind(self) -> &'static str {
        match self {
            Ended::Calls => "Call",
            Ended::Instances => "Instance",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Ended::Calls => "calls",
            Ended::Instances => "instances",
        }
    }

    /// The decision that forgets those ended before `before` (a running instance's current
    /// step call stays), or none when there are none. At `now`, calls that ended too recently
    /// for a message of theirs read again to be taken for a forgotten call's by its age stay
    /// known as ended by their id (`gone`).
    fn forget(self, s: &State, before: u64, now: u64, gone: KeepGoneFor) -> Option<Event> {
        match self {
            Ended::Calls => s
                .calls
                .any_finished_before(before, &s.functions.current_step_calls())
                .then(|| Event::CallsForgotten {
                    finished_before_ms: before,
                    within: None,
                    keep_gone: gone.at(before, now),
                }),
            Ended::Instances => {
                s.functions
                    .any_finished_before(before)
                    .then_some(Event::InstancesForgotten {
                        finished_before_ms: before,
                        within: None,
                    })
            }
        }
    }

    /// Those ended before `before`, as the conditions see them.
    fn items(self, s: &State, before: u64) -> Vec<serde_json::Value> {
        let ended = |f: Option<u64>| f.filter(|f| *f < before);
        match self {
            Ended::Calls => s
                .calls
                .sorted()
                .into_iter()
                .filter(|(_, c)| c.status.is_final())
                .filter_map(|(id, c)| {
                    let at = ended(c.finished_at_ms)?;
                    Some(serde_json::json!({"id": id, "target": c.spec.target, "finishedAt": time(at)}))
                })
                .collect(),
            Ended::Instances => s
                .functions
                .instances
                .iter()
                .filter_map(|(id, i)| {
                    let at = ended(i.finished_at_ms)?;
                    Some(serde_json::json!({"id": id, "template": i.template, "finishedAt": time(at)}))
                })
                .collect(),
        }
    }
}

impl Backend for LocalTargets {
    fn resolve(&self, spec: &CleanerSpec) -> Result<Resolved, String> {
        let now = self.clock.now_ms();
        let before = now.saturating_sub(spec.ttl_ms);
        let s = self.log.state();
        let mut out = Resolved::default();
        for t in &spec.targets {
            let r = Ref::parse(&t.reference)?;
            let kind = r.kind.to_ascii_lowercase();
            let mut items: Vec<serde_json::Value> = Vec::new();
            match kind.as_str() {
                "app" => {
                    for (name, route) in &s.routes.by_name {
                        let hit = match &r.name {
                            Some(n) => n == name,
                            None => labels_match(
                                &r.labels,
                                &[("name", name), ("deployment", &route.spec.deployment)],
                            ),
                        };
                        if !hit {
                            continue;
                        }
                        let replicas = s
                            .routes
                            .deployments
                            .get(&route.spec.deployment)
                            .map_or(0, |d| d.replicas);
                        items.push(serde_json::json!({
                            "metadata": {"name": name},
                            "spec": {"domains": route.spec.domains, "deployment": route.spec.deployment},
                            "status": {
                                "lastUsed": time(route.last_used_ms),
                                "requests": route.requests_total,
                                "replicas": replicas,
                            },
                        }));
                        out.objects.push(format!("{name}.apps.{API_VERSION}"));
                        if t.delete {
                            out.deletions.push(format!("{API_VERSION}/App//{name}"));
                        }
                    }
                }
                "function" => {
                    for (name, template) in &s.functions.templates {
                        let hit = match &r.name {
                            Some(n) => n == name,
                            None => labels_match(&r.labels, &[("name", name)]),
                        };
                        if !hit {
                            continue;
                        }
                        items.push(serde_json::json!({
                            "metadata": {"name": name, "creationTimestamp": time(template.created_at_ms)},
                            "spec": {"function": template.spec.function},
                        }));
                        out.objects.push(format!("{name}.functions.{API_VERSION}"));
                        if t.delete {
                            out.deletions
                                .push(format!("{API_VERSION}/Function//{name}"));
                        }
                    }
                }
                "call" | "instance" => {
                    let ended = if kind == "call" {
                        Ended::Calls
                    } else {
                        Ended::Instances
                    };
                    if ended.forget(&s, before, now, self.gone).is_some() {
                        out.objects.push(format!(
                            "{} ended before {}",
                            ended.plural(),
                            time(before)
                        ));
                        if t.delete {
                            out.deletions.push(format!(
                                "{API_VERSION}/{}?endedBefore={before}",
                                ended.kind()
                            ));
                        }
                    }
                    if t.include_when_evaluating {
                        items = ended.items(&s, before);
                    }
                }
                other => return Err(format!("target {}: unknown kind {other:?}", t.name)),
            }
            if t.include_when_evaluating {
                let value = match (&r.name, kind.as_str()) {
                    (Some(_), _) => items.into_iter().next().unwrap_or(serde_json::Value::Null),
                    _ => serde_json::json!({ "items": items }),
                };
                out.inputs.push((t.name.clone(), value));
            }
        }
        Ok(out)
    }

    async fn begin(&self, _: &CleanerSpec, _: &[String]) -> Result<(), String> {
        Ok(())
    }

    async fn delete(&self, _: &CleanerSpec, entry: &str) -> Result<Deleted, String> {
        let rest = entry
            .strip_prefix(&format!("{API_VERSION}/"))
            .ok_or_else(|| format!("{entry} is not one of ebb's objects"))?
            .to_owned();
        let (now, gone) = (self.clock.now_ms(), self.gone);
        let (deleted, _) = self
            .log
            .decide(move |s: &State, _| {
                let events: Vec<Event> = if let Some(name) = rest.strip_prefix("App//") {
                    if s.routes.by_name.contains_key(name) {
                        vec![Event::RouteRemoved {
                            name: name.to_owned(),
                        }]
                    } else {
                        Vec::new()
                    }
                } else if let Some(name) = rest.strip_prefix("Function//") {
                    crate::functions::decide_delete(s, name).unwrap_or_default()
                } else if let Some((kind, ms)) = rest.split_once("?endedBefore=") {
                    let ended = if kind == "Call" {
                        Ended::Calls
                    } else {
                        Ended::Instances
                    };
                    ended
                        .forget(s, ms.parse().unwrap_or(0), now, gone)
                        .into_iter()
                        .collect()
                } else {
                    Vec::new()
                };
                let deleted = !events.is_empty();
                (events, deleted)
            })
            .await
            .map_err(|e| e.to_string())?;
        Ok(if deleted {
            Deleted::Deleted
        } else {
            Deleted::Gone
        })
    }

    async fn finish(&self, _: &CleanerSpec) -> Result<(), String> {
        Ok(())
    }

    async fn report(&self, name: &str, c: &crate::state::Cleaner, _: &[String]) {
        if !c.reason.is_empty() && c.reason != "WaitingForConditions" && c.reason != "Deleting" {
            tracing::info!(cleaner = %name, reason = %c.reason, message = %c.message, "cleaner");
        }
    }
}
