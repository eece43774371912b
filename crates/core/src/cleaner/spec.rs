//! The `Cleaner` custom resource (`cleaner.ebb.dev/v1alpha1`), its durations and references,
//! and its translation into the log's [`CleanerSpec`].
//!
//! The resource's type, `CleanerResource`, is derived here and its definition generated into
//! `deploy/chart/crds/` (`ebb crds`). [`to_spec`] turns one into the log's `CleanerSpec`: durations
//! parsed, references in the log's form (`apiVersion/Kind/name`, or `apiVersion/Kind?k=v` for a
//! label selector, [`Ref`]), and whatever is wrong kept in `invalid` rather than refused, so the
//! cleaner is recorded and its status can say why it does not run.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::{CleanerSpec, CleanerTarget};

/// The retry period of a cleaner that names none.
pub const DEFAULT_RETRY_PERIOD_MS: u64 = 3_600_000;

/// The shortest retry period accepted: a cleaner is not a busy loop.
pub const MIN_RETRY_PERIOD_MS: u64 = 1_000;

/// What a cleaner deletes, and when.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(kube::CustomResource, schemars::JsonSchema))]
#[cfg_attr(
    feature = "crd",
    kube(
        group = "cleaner.ebb.dev",
        version = "v1alpha1",
        kind = "Cleaner",
        root = "CleanerResource",
        plural = "cleaners",
        singular = "cleaner",
        namespaced,
        status = "CleanerStatus",
        printcolumn = r#"{"name":"TTL","type":"string","jsonPath":".spec.ttl"}"#,
        printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
        printcolumn = r#"{"name":"Next","type":"string","jsonPath":".status.nextScheduledEvaluation"}"#
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CleanerResourceSpec {
    /// Earliest age at which the cleaner may fire, counted from its creation: a duration such as
    /// `360h`, `90m`, `1h30m` or `7d`.
    pub ttl: String,
    /// How conditions that do not hold are evaluated again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Retry>,
    /// The Helm release to uninstall when the cleaner fires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub helm: Option<Helm>,
    /// Objects to delete, or to watch and pass to the conditions.
    #[serde(default)]
    pub targets: Vec<Target>,
    /// CEL conditions, all of which must hold for the cleaner to fire. Variables: `time` (the
    /// evaluation's time) and each target with `includeWhenEvaluating`, by its name.
    #[serde(default)]
    pub conditions: Vec<String>,
    /// Evaluate and list what would be deleted (`status.wouldDelete`), but delete nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// How conditions that do not hold are evaluated again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Retry {
    /// How often, besides on every change of a target (default `1h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<String>,
    /// The conditions, once true, stay true as time passes: ebb then searches for the earliest
    /// time they hold and evaluates again then.
    #[serde(default)]
    pub monotonic: bool,
}

/// A Helm release the cleaner uninstalls.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Helm {
    /// The release's name, in the cleaner's namespace.
    pub release: String,
    /// Uninstall it when the cleaner fires.
    #[serde(default)]
    pub delete: bool,
}

/// One object, or the objects matching labels, in the cleaner's namespace.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Target {
    /// The name conditions know the target by (not `time`).
    pub name: String,
    /// What it refers to.
    pub reference: Reference,
    /// Delete it when the cleaner fires.
    #[serde(default)]
    pub delete: bool,
    /// Pass it to the conditions: an object as a map, a label selector's objects as
    /// `{items: [...]}`.
    #[serde(default)]
    pub include_when_evaluating: bool,
}

/// A reference by `apiVersion` (or `apiGroup` and `version`) and `kind`, and either `name` or
/// `matchLabels`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Reference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The kind, as in the object (`Revision`) or in lower case (`revision`).
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<BTreeMap<String, String>>,
}

/// What ebb says of a cleaner.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct CleanerStatus {
    /// Every object the targets resolve to (`name.kind.group/version`), indexed so a change to
    /// one re-evaluates exactly the cleaners that reference it.
    #[serde(default)]
    pub resolved_targets: Vec<String>,
    /// When the conditions are evaluated next (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_scheduled_evaluation: Option<String>,
    /// The last evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_evaluation: Option<LastEvaluation>,
    /// In dry run: what firing would delete.
    #[serde(default)]
    pub would_delete: Vec<String>,
    /// `Ready`, whose reason says where the cleaner stands.
    #[serde(default)]
    pub conditions: Vec<StatusCondition>,
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The last evaluation of a cleaner's conditions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct LastEvaluation {
    /// When (RFC 3339).
    pub time: String,
    /// Each condition's result, in order (absent: not evaluated).
    #[serde(default)]
    pub results: Vec<ConditionResult>,
}

/// One condition's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ConditionResult {
    /// The condition's index in `spec.conditions`.
    pub index: u32,
    /// Its value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<bool>,
}

/// A status condition, as Kubernetes' own (`metav1.Condition`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct StatusCondition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

pub use crate::timing::parse_duration;

/// A reference in the log's form: `apiVersion/Kind/name` or `apiVersion/Kind?k=v,...`.
pub fn reference_string(api_version: &str, kind: &str, r: &Reference) -> String {
    match (&r.name, &r.match_labels) {
        (Some(name), _) => format!("{api_version}/{kind}/{name}"),
        (None, labels) => {
            let sel: Vec<String> = labels
                .iter()
                .flatten()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            format!("{api_version}/{kind}?{}", sel.join(","))
        }
    }
}

/// A reference of the log, read back.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ref {
    /// `group/version`, or `version` for the core group.
    pub api_version: String,
    /// As written (case is resolved against the API server's discovery).
    pub kind: String,
    /// One object by name, or...
    pub name: Option<String>,
    /// ...the objects matching these labels.
    pub labels: BTreeMap<String, String>,
}

impl Ref {
    /// Reads a reference in the log's form.
    pub fn parse(s: &str) -> Result<Ref, String> {
        let bad =
            || format!("reference {s:?} is not apiVersion/Kind/name or apiVersion/Kind?labels");
        let (path, selector) = match s.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (s, None),
        };
        let parts: Vec<&str> = path.split('/').collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(bad());
        }
        let (api_version, kind, name) = match (selector.is_some(), parts.as_slice()) {
            (true, [v, k]) => ((*v).to_owned(), *k, None),
            (true, [g, v, k]) => (format!("{g}/{v}"), *k, None),
            (false, [v, k, n]) => ((*v).to_owned(), *k, Some((*n).to_owned())),
            (false, [g, v, k, n]) => (format!("{g}/{v}"), *k, Some((*n).to_owned())),
            _ => return Err(bad()),
        };
        let mut labels = BTreeMap::new();
        for pair in selector.unwrap_or("").split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(bad)?;
            labels.insert(k.to_owned(), v.to_owned());
        }
        Ok(Ref {
            api_version,
            kind: kind.to_owned(),
            name,
            labels,
        })
    }

    /// The selector in Kubernetes' form (`k=v,k2=v2`).
    pub fn selector(&self) -> String {
        let sel: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        sel.join(",")
    }
}

/// Translates a resource into the log's spec. What cannot be translated (a bad duration, a
/// target named `time`, a reference without a kind...) is kept in `invalid`, readable, so the
/// cleaner shows it and never fires.
pub fn to_spec(
    key: &str,
    namespace: &str,
    uid: &str,
    created_at_ms: u64,
    spec: &CleanerResourceSpec,
) -> CleanerSpec {
    let mut problems = Vec::new();
    let ttl_ms = parse_duration(&spec.ttl)
        .map_err(|e| problems.push(format!("spec.ttl: {e}")))
        .unwrap_or(0);
    let retry = spec.retry.clone().unwrap_or_default();
    let retry_period_ms = match &retry.period {
        None => DEFAULT_RETRY_PERIOD_MS,
        Some(p) => match parse_duration(p) {
            Ok(ms) if ms < MIN_RETRY_PERIOD_MS => {
                problems.push(format!(
                    "spec.retry.period: {p:?} is shorter than the {} ms allowed",
                    MIN_RETRY_PERIOD_MS
                ));
                DEFAULT_RETRY_PERIOD_MS
            }
            Ok(ms) => ms,
            Err(e) => {
                problems.push(format!("spec.retry.period: {e}"));
                DEFAULT_RETRY_PERIOD_MS
            }
        },
    };
    let mut targets = Vec::with_capacity(spec.targets.len());
    let mut names = std::collections::BTreeSet::new();
    for (i, t) in spec.targets.iter().enumerate() {
        let at = format!("spec.targets[{i}]");
        if t.name == crate::cleaner::cel::TIME {
            problems.push(format!(
                "{at}.name: a target may not be named `time` (the evaluation's time is)"
            ));
        } else if !is_identifier(&t.name) {
            problems.push(format!(
                "{at}.name: {:?} is not a CEL identifier (letters, digits and _)",
                t.name
            ));
        } else if !names.insert(t.name.clone()) {
            problems.push(format!("{at}.name: {:?} names two targets", t.name));
        }
        let r = &t.reference;
        let api_version = match (&r.api_version, &r.api_group, &r.version) {
            (Some(v), None, None) => v.clone(),
            (None, Some(g), Some(v)) if g.is_empty() => v.clone(),
            (None, Some(g), Some(v)) => format!("{g}/{v}"),
            (None, None, Some(v)) => v.clone(),
            _ => {
                problems.push(format!(
                    "{at}.reference: give apiVersion, or apiGroup and version"
                ));
                String::new()
            }
        };
        if r.kind.is_empty() {
            problems.push(format!("{at}.reference.kind is empty"));
        }
        match (&r.name, &r.match_labels) {
            (Some(n), None) if !n.is_empty() && !n.contains('/') => {}
            (None, Some(l)) if !l.is_empty() => {}
            _ => problems.push(format!(
                "{at}.reference: give either name or matchLabels (not empty)"
            )),
        }
        targets.push(CleanerTarget {
            name: t.name.clone(),
            reference: reference_string(&api_version, &r.kind, r),
            delete: t.delete,
            include_when_evaluating: t.include_when_evaluating,
        });
    }
    let helm_release = match &spec.helm {
        Some(h) if h.delete && h.release.is_empty() => {
            problems.push("spec.helm.release is empty".into());
            String::new()
        }
        Some(h) if h.delete => h.release.clone(),
        _ => String::new(),
    };
    CleanerSpec {
        name: key.to_owned(),
        ttl_ms,
        retry_period_ms,
        monotonic: retry.monotonic,
        conditions: spec.conditions.clone(),
        targets,
        namespace: namespace.to_owned(),
        uid: uid.to_owned(),
        created_at_ms,
        dry_run: spec.dry_run,
        helm_release,
        invalid: problems.join("; "),
        repeat: false,
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_go_writes_them_plus_days() {
        assert_eq!(parse_duration("360h"), Ok(360 * 3_600_000));
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert_eq!(parse_duration("1.5h"), Ok(5_400_000));
        assert_eq!(parse_duration("7d"), Ok(7 * 86_400_000));
        assert_eq!(parse_duration("250ms"), Ok(250));
        assert_eq!(parse_duration("0"), Ok(0));
        for bad in ["", "h", "5", "5x", "1h-2m", "..5h", "99999999999999d"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains("duration"), "{bad}: {e}");
        }
    }

    #[test]
    fn references_round_trip_through_the_log_form() {
        let by_name = Reference {
            api_group: Some("serving.knative.dev".into()),
            version: Some("v1".into()),
            kind: "service".into(),
            name: Some("sfj".into()),
            ..Reference::default()
        };
        let s = reference_string("serving.knative.dev/v1", "service", &by_name);
        assert_eq!(s, "serving.knative.dev/v1/service/sfj");
        let r = Ref::parse(&s).unwrap();
        assert_eq!(
            (r.api_version.as_str(), r.kind.as_str()),
            ("serving.knative.dev/v1", "service")
        );
        assert_eq!(r.name.as_deref(), Some("sfj"));
        let core = Ref::parse("v1/ConfigMap?app=x,ebb.dev/tier=web").unwrap();
        assert_eq!(core.api_version, "v1");
        assert_eq!(core.selector(), "app=x,ebb.dev/tier=web");
        assert!(Ref::parse("v1/ConfigMap").is_err());
        assert!(Ref::parse("a/b/c/d/e").is_err());
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        let spec = CleanerResourceSpec {
            ttl: "forever".into(),
            retry: Some(Retry {
                period: Some("10ms".into()),
                monotonic: false,
            }),
            targets: vec![Target {
                name: "time".into(),
                reference: Reference {
                    api_version: Some("v1".into()),
                    kind: "ConfigMap".into(),
                    ..Reference::default()
                },
                ..Target::default()
            }],
            ..CleanerResourceSpec::default()
        };
        let s = to_spec("ns/c", "ns", "u", 0, &spec);
        for needle in [
            "spec.ttl",
            "spec.retry.period",
            "named `time`",
            "either name or matchLabels",
        ] {
            assert!(s.invalid.contains(needle), "{needle} not in {}", s.invalid);
        }
    }
}
