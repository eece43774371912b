//! Cleaners: delete ephemeral objects once their TTL has passed and CEL conditions over them
//! hold (the cleaner proposal, built in full).
//!
//! * [`spec`]: the `Cleaner` custom resource and its translation into the log's `CleanerSpec`
//!   ([`crds`] gives its definition to `ebb crds`).
//! * [`config`]: the cleaners of `ebb.toml`, over ebb's own objects, and the standing retention.
//! * [`cel`]: conditions compiled once, evaluated within a bound.
//! * [`decide`]: the pure evaluation of one cleaner at one time. Nothing is evaluated before the
//!   TTL; when every condition holds it fires; else, when the conditions are monotonic, it looks
//!   again at the earliest time they all hold (a binary search, [`crate::timing::earliest_true`],
//!   over [`crate::timing::SEARCH_HORIZON_MS`] to [`crate::timing::SEARCH_PRECISION_MS`]), else
//!   after the retry period. Each failure is a [`Reason`], retried after the retry period (an
//!   evaluation error, a target not resolved) or not (an invalid spec, a compile error, a result
//!   that is not a boolean, an evaluation past its limits: the cleaner or a target must change).
//!
//! The schedule is the projection's (`state::Schedule`, `Due::CleanerEval`), rebuilt from
//! `CleanerUpserted`, `CleanerEvaluated {next_at_ms}`, `CleanerFiring` and `CleanerFired`.

pub mod cel;
pub mod config;
pub mod spec;

use crate::event::{CleanerSpec, Event};
use crate::timing::{SEARCH_HORIZON_MS, SEARCH_PRECISION_MS, earliest_true};

use self::cel::{Conditions, EvalError, Limits};

/// The cleaner proposal's own example condition, as written there: a preview is cleaned once no
/// Revision serves a route other than a preview's and none has been active for 15 days.
pub const PROPOSAL_EXAMPLE: &str = r#"!revisions.items.exists(r,
  r.metadata.annotations["serving.knative.dev/routes"]
    .split(",")
    .exists(route, !route.startsWith("sfj-") && !route.startsWith("preview-"))
  ||
  r.status.conditions
    .filter(c, c.type == "Active")
    .exists(c, c.status == "True" || time - timestamp(c.lastTransitionTime) < duration("360h"))
)"#;

/// The `Cleaner` custom resource's definition (`ebb crds`).
#[cfg(feature = "crd")]
pub fn crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    use ::kube::CustomResourceExt;
    vec![spec::CleanerResource::crd()]
}

/// Where a cleaner stands: its `Ready` condition's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Its TTL has not passed.
    NotExpired,
    /// Evaluated; not all conditions hold yet.
    WaitingForConditions,
    /// A target could not be resolved (unknown kind, API error).
    TargetResolveError,
    /// A condition does not compile.
    ConditionCompileError,
    /// A condition failed to evaluate.
    EvaluationError,
    /// Evaluation went past its bound (steps or time).
    EvaluationLimitExceeded,
    /// A condition's value is not a boolean.
    NotBoolean,
    /// The cleaner as written is wrong (a bad duration, a target named `time`...).
    InvalidSpec,
    /// All conditions hold: deleting its targets.
    Deleting,
    /// All conditions hold, but it is a dry run.
    DryRun,
}

impl Reason {
    /// As the status and the log write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NotExpired => "NotExpired",
            Reason::WaitingForConditions => "WaitingForConditions",
            Reason::TargetResolveError => "TargetResolveError",
            Reason::ConditionCompileError => "ConditionCompileError",
            Reason::EvaluationError => "EvaluationError",
            Reason::EvaluationLimitExceeded => "EvaluationLimitExceeded",
            Reason::NotBoolean => "NotBoolean",
            Reason::InvalidSpec => "InvalidSpec",
            Reason::Deleting => "Deleting",
            Reason::DryRun => "DryRun",
        }
    }
}

/// What evaluating a cleaner at one time decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    /// All conditions held: fire (or, in dry run, report what would be deleted).
    pub fire: bool,
    /// Each condition's result at the evaluation's time (empty when none was evaluated).
    pub results: Vec<bool>,
    pub reason: Reason,
    pub message: String,
    /// When to evaluate again (none: only when the cleaner or a target changes).
    pub next_at_ms: Option<u64>,
    /// CEL evaluations of a condition made.
    pub evaluations: u32,
}

impl Evaluation {
    fn stop(reason: Reason, message: String, next_at_ms: Option<u64>) -> Evaluation {
        Evaluation {
            fire: false,
            results: Vec::new(),
            reason,
            message,
            next_at_ms,
            evaluations: 0,
        }
    }

    /// The event that records it (`would_delete` only in dry run; `folded`: the unchanged
    /// evaluations before it that were not recorded).
    pub fn event(&self, name: &str, would_delete: Vec<String>, folded: u32) -> Event {
        Event::CleanerEvaluated {
            name: name.to_owned(),
            result: self.fire,
            next_at_ms: self.next_at_ms,
            reason: self.reason.as_str().to_owned(),
            message: self.message.clone(),
            results: self.results.clone(),
            evaluations: self.evaluations,
            would_delete,
            folded,
        }
    }
}

/// The variable names a cleaner's conditions may use besides `time`.
pub fn variables(spec: &CleanerSpec) -> Vec<&str> {
    spec.targets
        .iter()
        .filter(|t| t.include_when_evaluating)
        .map(|t| t.name.as_str())
        .collect()
}

/// Compiles a cleaner's conditions (once per change of the cleaner: cache the answer).
pub fn compile(spec: &CleanerSpec) -> Result<Conditions, cel::CompileError> {
    Conditions::compile(&spec.conditions, &variables(spec))
}

/// Evaluates one cleaner at `now_ms`, pure: the same inputs give the same answer.
///
/// `compiled` is the cached compilation of its conditions; `inputs` the value of each target
/// passed to them (or why they could not be resolved). Before the TTL nothing is evaluated and
/// the next evaluation is the expiry. After it: if all conditions hold, fire; else, when the
/// cleaner says its conditions are monotonic, search for the earliest time within
/// [`SEARCH_HORIZON_MS`] at which they all hold (to [`SEARCH_PRECISION_MS`]) and evaluate again
/// then; else after the retry period. A compile error, a non-boolean result or an evaluation
/// past its limits is not retried (the cleaner or a target must change); an evaluation error
/// or an unresolved target is, after the retry period.
pub fn decide(
    spec: &CleanerSpec,
    expires_at_ms: u64,
    now_ms: u64,
    compiled: &Result<Conditions, cel::CompileError>,
    inputs: Result<&[(&str, &serde_json::Value)], String>,
    limits: Limits,
) -> Evaluation {
    let retry = now_ms.saturating_add(spec.retry_period_ms.max(spec::MIN_RETRY_PERIOD_MS));
    if !spec.invalid.is_empty() {
        return Evaluation::stop(Reason::InvalidSpec, spec.invalid.clone(), None);
    }
    let conditions = match compiled {
        Ok(c) => c,
        Err(e) => return Evaluation::stop(Reason::ConditionCompileError, e.to_string(), None),
    };
    if now_ms < expires_at_ms {
        return Evaluation::stop(
            Reason::NotExpired,
            format!("the TTL passes at {}", rfc3339(expires_at_ms)),
            Some(expires_at_ms),
        );
    }
    let inputs = match inputs {
        Ok(i) => i,
        Err(e) => return Evaluation::stop(Reason::TargetResolveError, e, Some(retry)),
    };
    let per_round = u32::try_from(conditions.len()).unwrap_or(u32::MAX);
    let mut bound = conditions.bind(inputs);
    let failed = |e: EvalError, evaluations: u32| {
        let (reason, next) = match &e {
            EvalError::NotBoolean { .. } => (Reason::NotBoolean, None),
            EvalError::Limit { .. } => {
                crate::limits::Limit::CelCost.hit();
                (Reason::EvaluationLimitExceeded, None)
            }
            EvalError::Failed { .. } => (Reason::EvaluationError, Some(retry)),
        };
        Evaluation {
            evaluations,
            ..Evaluation::stop(reason, e.to_string(), next)
        }
    };
    let results = match bound.evaluate(now_ms, limits) {
        Ok(r) => r,
        Err(e) => return failed(e, per_round),
    };
    let mut evaluations = per_round;
    if results.iter().all(|r| *r) {
        let (reason, message, next) = if spec.dry_run {
            (
                Reason::DryRun,
                "all conditions hold; dry run: nothing is deleted".to_owned(),
                Some(retry),
            )
        } else {
            (
                Reason::Deleting,
                "all conditions hold: deleting the targets".to_owned(),
                None,
            )
        };
        return Evaluation {
            fire: true,
            results,
            reason,
            message,
            next_at_ms: next,
            evaluations,
        };
    }
    let waiting = |results: Vec<bool>, next: u64, message: String, evaluations: u32| Evaluation {
        fire: false,
        results,
        reason: Reason::WaitingForConditions,
        message,
        next_at_ms: Some(next),
        evaluations,
    };
    if !spec.monotonic {
        let message = format!("{} of {} conditions hold", count(&results), results.len());
        return waiting(results, retry, message, evaluations);
    }
    let search = earliest_true(now_ms, SEARCH_HORIZON_MS, SEARCH_PRECISION_MS, |t| {
        bound.evaluate(t, limits).map(|r| r.iter().all(|x| *x))
    });
    match search {
        Ok(found) => {
            evaluations += found.evaluations * per_round;
            let held = format!("{} of {} conditions hold", count(&results), results.len());
            match found.at_ms {
                Some(at) => waiting(
                    results,
                    at,
                    format!("{held}; monotonic: they all hold from {}", rfc3339(at)),
                    evaluations,
                ),
                None => waiting(
                    results,
                    retry,
                    format!("{held}; monotonic: not within the search horizon"),
                    evaluations,
                ),
            }
        }
        // A failure at a future time says nothing about now: look again after the period.
        Err(e) => waiting(
            results,
            retry,
            format!("monotonic search stopped: {e}"),
            evaluations,
        ),
    }
}

fn count(results: &[bool]) -> usize {
    results.iter().filter(|r| **r).count()
}

/// A time as Kubernetes writes it (RFC 3339, UTC, whole seconds).
pub fn rfc3339(ms: u64) -> String {
    crate::timing::kube_time(i64::try_from(ms).unwrap_or(i64::MAX)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::CleanerTarget;
    use serde_json::json;

    const HOUR: u64 = 3_600_000;
    /// 2026-11-20T00:00:00Z.
    const NOW: u64 = 1_795_132_800_000;

    fn revision(routes: &str, active: &str, since: &str) -> serde_json::Value {
        json!({
            "apiVersion": "serving.knative.dev/v1",
            "kind": "Revision",
            "metadata": {
                "name": "sfj-commit--account-00001",
                "annotations": {"serving.knative.dev/routes": routes},
            },
            "status": {"conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-10-01T00:00:00Z"},
                {"type": "Active", "status": active, "lastTransitionTime": since},
            ]},
        })
    }

    fn spec(conditions: &[&str], monotonic: bool) -> CleanerSpec {
        CleanerSpec {
            name: "ns/c".into(),
            ttl_ms: 360 * HOUR,
            retry_period_ms: 5 * HOUR,
            monotonic,
            conditions: conditions.iter().map(|c| (*c).to_owned()).collect(),
            targets: vec![CleanerTarget {
                name: "revisions".into(),
                reference: "serving.knative.dev/v1/revision?vtex.io/proxy=p".into(),
                delete: false,
                include_when_evaluating: true,
            }],
            ..CleanerSpec::default()
        }
    }

    fn run(spec: &CleanerSpec, items: Vec<serde_json::Value>, now: u64) -> Evaluation {
        let compiled = compile(spec);
        let value = json!({ "items": items });
        let inputs = [("revisions", &value)];
        decide(spec, 0, now, &compiled, Ok(&inputs), Limits::default())
    }

    #[test]
    fn the_proposals_condition_decides_over_knative_revisions() {
        let s = spec(&[PROPOSAL_EXAMPLE], false);
        // (case, revisions, fires)
        let cases: Vec<(&str, Vec<serde_json::Value>, bool)> = vec![
            ("no revisions", vec![], true),
            (
                "preview routes only, inactive for 20 days",
                vec![revision("sfj-a,preview-b", "False", "2026-10-31T00:00:00Z")],
                true,
            ),
            (
                "preview routes only, inactive for 5 days",
                vec![revision("sfj-a,preview-b", "False", "2026-11-15T00:00:00Z")],
                false,
            ),
            (
                "preview routes only, active",
                vec![revision("sfj-a", "True", "2026-10-01T00:00:00Z")],
                false,
            ),
            (
                "a production route",
                vec![revision("sfj-a,www", "False", "2026-10-01T00:00:00Z")],
                false,
            ),
            (
                "one old and one recent revision",
                vec![
                    revision("sfj-a", "False", "2026-10-01T00:00:00Z"),
                    revision("preview-x", "False", "2026-11-19T00:00:00Z"),
                ],
                false,
            ),
            (
                "two old revisions",
                vec![
                    revision("sfj-a", "False", "2026-10-01T00:00:00Z"),
                    revision("preview-x", "False", "2026-11-01T00:00:00Z"),
                ],
                true,
            ),
        ];
        for (case, items, fires) in cases {
            let e = run(&s, items, NOW);
            assert_eq!(e.fire, fires, "{case}: {e:?}");
            assert_eq!(e.results, vec![fires], "{case}");
            let want = if fires {
                Reason::Deleting
            } else {
                Reason::WaitingForConditions
            };
            assert_eq!(e.reason, want, "{case}");
        }
    }

    #[test]
    fn nothing_is_evaluated_before_the_ttl() {
        let s = spec(&["true"], false);
        let compiled = compile(&s);
        let expires = 1_000 + s.ttl_ms;
        for now in [0, 1_000, expires - 1] {
            let e = decide(&s, expires, now, &compiled, Ok(&[]), Limits::default());
            assert!(!e.fire);
            assert_eq!(
                (e.reason, e.next_at_ms, e.evaluations),
                (Reason::NotExpired, Some(expires), 0)
            );
        }
        let e = decide(&s, expires, expires, &compiled, Ok(&[]), Limits::default());
        assert!(e.fire);
        assert_eq!(e.evaluations, 1);
    }

    #[test]
    fn a_monotonic_condition_is_next_evaluated_when_it_first_holds() {
        // Holds 15 days after the revision went inactive: 2026-11-01 + 360 h = 2026-11-16.
        let s = spec(&[PROPOSAL_EXAMPLE], true);
        let items = vec![revision("preview-x", "False", "2026-11-01T00:00:00Z")];
        let now = NOW - 10 * 24 * HOUR; // 2026-11-10
        let e = run(&s, items.clone(), now);
        assert!(!e.fire);
        let truth = 1_795_132_800_000 - 4 * 24 * HOUR; // 2026-11-16T00:00:00Z
        let at = e.next_at_ms.unwrap();
        assert!(
            at >= truth && at - truth <= crate::timing::SEARCH_PRECISION_MS,
            "{at} vs {truth}"
        );
        let bound = 1 + crate::timing::search_bound(
            crate::timing::SEARCH_HORIZON_MS,
            crate::timing::SEARCH_PRECISION_MS,
        );
        assert!(e.evaluations <= bound, "{} evaluations", e.evaluations);
        // Evaluated then, it fires; a moment before the true time it would not have.
        assert!(run(&s, items.clone(), at).fire);
        assert!(!run(&s, items, truth - 1).fire);
        // Not monotonic: the retry period.
        let plain = spec(&[PROPOSAL_EXAMPLE], false);
        let e = run(
            &plain,
            vec![revision("preview-x", "False", "2026-11-01T00:00:00Z")],
            now,
        );
        assert_eq!(e.next_at_ms, Some(now + 5 * HOUR));
    }

    #[test]
    fn a_monotonic_condition_never_true_within_the_horizon_waits_the_period() {
        let s = spec(&["time < timestamp('2000-01-01T00:00:00Z')"], true);
        let e = run(&s, vec![], NOW);
        assert_eq!(e.next_at_ms, Some(NOW + 5 * HOUR));
        assert_eq!(e.evaluations, 2);
    }

    #[test]
    fn bad_conditions_are_reasons_not_panics() {
        let cases: Vec<(&str, Reason, &str, Option<u64>)> = vec![
            (
                "revisions.items.exists(r,",
                Reason::ConditionCompileError,
                "Syntax error",
                None,
            ),
            (
                "nosuch.items == []",
                Reason::ConditionCompileError,
                "unknown variable `nosuch`",
                None,
            ),
            (
                "size(revisions.items)",
                Reason::NotBoolean,
                "an int (0)",
                None,
            ),
            ("'yes'", Reason::NotBoolean, "a string", None),
            (
                "revisions.missing == 1",
                Reason::EvaluationError,
                "No such key",
                Some(NOW + 5 * HOUR),
            ),
            (
                "[0,1,2,3,4,5,6,7,8,9].all(a, [0,1,2,3,4,5,6,7,8,9].all(b, [0,1,2,3,4,5,6,7,8,9].all(c, \
                 [0,1,2,3,4,5,6,7,8,9].all(d, [0,1,2,3,4,5,6,7,8,9].all(e, [0,1,2,3,4,5,6,7,8,9].all(f, \
                 a + b + c + d + e + f >= 0))))))",
                Reason::EvaluationLimitExceeded,
                // Whichever bound it meets first: a million steps, or a second.
                "more than 1000000 comprehension steps|ran longer than 1000 ms",
                None,
            ),
        ];
        for (cond, reason, needle, next) in cases {
            let s = spec(&[cond], false);
            let e = run(&s, vec![], NOW);
            assert!(!e.fire, "{cond}");
            assert_eq!(e.reason, reason, "{cond}: {}", e.message);
            assert!(
                needle.split('|').any(|n| e.message.contains(n)),
                "{cond}: {}",
                e.message
            );
            assert_eq!(e.next_at_ms, next, "{cond}");
        }
        let mut bad = spec(&["true"], false);
        bad.invalid = "spec.ttl: duration \"x\" does not start with a number".into();
        let e = run(&bad, vec![], NOW);
        assert_eq!((e.reason, e.next_at_ms), (Reason::InvalidSpec, None));
    }

    #[test]
    fn a_dry_run_fires_nothing_and_keeps_looking() {
        let mut s = spec(&["true"], false);
        s.dry_run = true;
        let e = run(&s, vec![], NOW);
        assert!(e.fire);
        assert_eq!(
            (e.reason, e.next_at_ms),
            (Reason::DryRun, Some(NOW + 5 * HOUR))
        );
    }

    #[test]
    fn time_is_the_evaluations_time() {
        let s = spec(&["time == timestamp('2026-11-20T00:00:00Z')"], false);
        assert!(run(&s, vec![], NOW).fire);
        assert!(!run(&s, vec![], NOW + 1_000).fire);
    }
}
