//! Routes from annotated Kubernetes Services: what the Kubernetes backend turns a Service into.
//!
//! A Service with `ebb.dev/domains` (a comma-separated list of host names, `*.suffix` allowed)
//! and `ebb.dev/deployment` (the workload: `NAME` or `deployment/NAME` for a Deployment,
//! `statefulset/NAME` for a StatefulSet, in the Service's namespace) is a route. proxless'
//! `proxless/domains` and `proxless/deployment` are understood too; ebb's own win when both are
//! present. Per-route settings: `ebb.dev/idle-after` and `ebb.dev/hold-timeout` (durations such
//! as `90s`, `5m`, `1h30m`, `500ms`), `ebb.dev/min-replicas`, `ebb.dev/max-replicas`,
//! `ebb.dev/concurrency`, and `ebb.dev/traffic-policy` (how a replica is picked: a JSON object
//! of [`crate::discovery::Policy`], such as `{"balancer": "least_request"}`),
//! `ebb.dev/idle-replicas` (replicas kept when idle) and `ebb.dev/warm` (keep-warm windows: a JSON
//! list such as `[{"schedule": "0 8 * * 1-5", "for": "10h", "min": 1, "timezone": "Europe/Paris"}]`),
//! the timeouts `ebb.dev/response-timeout`, `ebb.dev/stream-idle-timeout` and
//! `ebb.dev/connection-idle-timeout` (durations), and `ebb.dev/waiting-page` (`true` for ebb's
//! page while the workload wakes, or the page's own HTML). With `ebb.dev/listen` (`IP:port`) the
//! Service is a TCP route on that address of every ebb replica, and `ebb.dev/domains` may be left
//! out. Without `ebb.dev/domains` nor `ebb.dev/listen` the route has no host of its own: it is
//! the backend of the Gateway API's routes that name the Service (`ebb_core::gateway`), woken by
//! their requests and scaled by its annotations.
//!
//! A Service with none of the route annotations is not ebb's ([`Ok(None)`]); one with some but
//! not all, or with a malformed value, is an [`AnnotationError`] that names the annotation, for
//! a Warning Event on the Service. A domain claimed by two Services ([`resolve`]) stays with the
//! older one; the newer gets no route and an error naming the domain and the older Service.

use std::collections::BTreeMap;

use crate::event::RouteSpec;

pub const DOMAINS: &str = "ebb.dev/domains";
pub const DEPLOYMENT: &str = "ebb.dev/deployment";
pub const PROXLESS_DOMAINS: &str = "proxless/domains";
pub const PROXLESS_DEPLOYMENT: &str = "proxless/deployment";
pub const IDLE_AFTER: &str = "ebb.dev/idle-after";
pub const HOLD_TIMEOUT: &str = "ebb.dev/hold-timeout";
pub const MIN_REPLICAS: &str = "ebb.dev/min-replicas";
pub const MAX_REPLICAS: &str = "ebb.dev/max-replicas";
pub const CONCURRENCY: &str = "ebb.dev/concurrency";
pub const TRAFFIC_POLICY: &str = "ebb.dev/traffic-policy";
pub const IDLE_REPLICAS: &str = "ebb.dev/idle-replicas";
pub const WARM: &str = "ebb.dev/warm";
pub const RESPONSE_TIMEOUT: &str = "ebb.dev/response-timeout";
pub const STREAM_IDLE_TIMEOUT: &str = "ebb.dev/stream-idle-timeout";
pub const CONNECTION_IDLE_TIMEOUT: &str = "ebb.dev/connection-idle-timeout";
pub const WAITING_PAGE: &str = "ebb.dev/waiting-page";
pub const LISTEN: &str = "ebb.dev/listen";
pub const TARGET_CONCURRENCY: &str = "ebb.dev/target-concurrency";
pub const TARGET_RPS: &str = "ebb.dev/target-rps";
pub const TARGET_UTILIZATION: &str = "ebb.dev/target-utilization-percentage";
pub const SCALE_WINDOW: &str = "ebb.dev/window";
pub const PANIC_WINDOW: &str = "ebb.dev/panic-window-percentage";
pub const PANIC_THRESHOLD: &str = "ebb.dev/panic-threshold-percentage";
pub const SCALE_DOWN_DELAY: &str = "ebb.dev/scale-down-delay";
pub const MAX_SCALE_UP_RATE: &str = "ebb.dev/max-scale-up-rate";
pub const MAX_SCALE_DOWN_RATE: &str = "ebb.dev/max-scale-down-rate";
/// Knative's annotations, understood where they mean what ebb's do.
pub const KN_METRIC: &str = "autoscaling.knative.dev/metric";
pub const KN_TARGET: &str = "autoscaling.knative.dev/target";
pub const KN_UTILIZATION: &str = "autoscaling.knative.dev/target-utilization-percentage";
pub const KN_WINDOW: &str = "autoscaling.knative.dev/window";
pub const KN_PANIC_WINDOW: &str = "autoscaling.knative.dev/panic-window-percentage";
pub const KN_PANIC_THRESHOLD: &str = "autoscaling.knative.dev/panic-threshold-percentage";
pub const KN_SCALE_DOWN_DELAY: &str = "autoscaling.knative.dev/scale-down-delay";
pub const KN_MIN_SCALE: &str = "autoscaling.knative.dev/min-scale";
pub const KN_MAX_SCALE: &str = "autoscaling.knative.dev/max-scale";

/// Settings of a route whose Service does not say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteDefaults {
    pub idle_after_ms: u64,
    pub hold_timeout_ms: u64,
    pub hold_queue_max: u32,
    pub max_replicas: u32,
}

impl Default for RouteDefaults {
    /// The defaults of an app in `ebb.toml`.
    fn default() -> Self {
        Self {
            idle_after_ms: crate::config::default_idle(),
            hold_timeout_ms: crate::config::default_hold_timeout(),
            hold_queue_max: crate::config::default_hold_queue(),
            max_replicas: crate::config::default_max(),
        }
    }
}

/// The kind of workload a route scales (both have the `/scale` subresource).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
}

/// The workload a route scales.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub namespace: String,
    pub name: String,
}

impl Workload {
    /// The workload of a route's `deployment` key ([`Workload::key`]).
    pub fn from_key(key: &str) -> Option<Self> {
        let mut parts = key.split('/');
        let (kind, namespace, name) = match (parts.next(), parts.next(), parts.next(), parts.next())
        {
            (Some(ns), Some(name), None, None) => (WorkloadKind::Deployment, ns, name),
            (Some(ns), Some("statefulset"), Some(name), None) => {
                (WorkloadKind::StatefulSet, ns, name)
            }
            _ => return None,
        };
        Some(Self {
            kind,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }

    /// The workload's key, the `deployment` of its route: `NAMESPACE/NAME` for a Deployment,
    /// `NAMESPACE/statefulset/NAME` for a StatefulSet.
    pub fn key(&self) -> String {
        match self.kind {
            WorkloadKind::Deployment => format!("{}/{}", self.namespace, self.name),
            WorkloadKind::StatefulSet => format!("{}/statefulset/{}", self.namespace, self.name),
        }
    }
}

/// A Service's annotations that do not make a route.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation}: {message}")]
pub struct AnnotationError {
    /// The annotation at fault.
    pub annotation: &'static str,
    pub message: String,
}

fn bad(annotation: &'static str, message: impl Into<String>) -> AnnotationError {
    AnnotationError {
        annotation,
        message: message.into(),
    }
}

/// The route of Service `namespace/service` with `annotations`, and the workload it scales.
pub fn route(
    namespace: &str,
    service: &str,
    annotations: &BTreeMap<String, String>,
    defaults: &RouteDefaults,
) -> Result<Option<(RouteSpec, Workload)>, AnnotationError> {
    let pick = |ours: &'static str, proxless: &'static str| {
        annotations
            .get(ours)
            .map(|v| (ours, v))
            .or_else(|| annotations.get(proxless).map(|v| (proxless, v)))
    };
    let domains = pick(DOMAINS, PROXLESS_DOMAINS);
    let target = pick(DEPLOYMENT, PROXLESS_DEPLOYMENT);
    let listen = match annotations.get(LISTEN) {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<std::net::SocketAddr>()
                .map_err(|_| bad(LISTEN, format!("{v:?} is not an IP:port address")))?
                .to_string(),
        ),
    };
    let no_hosts = (DOMAINS, String::new());
    let named_hosts = domains.is_some();
    let (domains, target) = match (domains, target) {
        (None, None) => return Ok(None),
        // No host names: a TCP route, or the backend of Gateway API routes (an HTTPRoute
        // reaches it; its requests wake it).
        (None, Some(t)) => ((no_hosts.0, &no_hosts.1), t),
        (Some(_), None) => {
            return Err(bad(
                DEPLOYMENT,
                "missing: which workload serves the domains",
            ));
        }
        (Some(d), Some(t)) => (d, t),
    };
    let workload = workload(namespace, target)?;
    let mut hosts = Vec::new();
    for d in domains
        .1
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        let d = d.to_ascii_lowercase();
        if !crate::ids::valid_domain(&d) {
            return Err(bad(domains.0, format!("{d:?} is not a host name")));
        }
        if !hosts.contains(&d) {
            hosts.push(d);
        }
    }
    if hosts.is_empty() && named_hosts {
        return Err(bad(domains.0, "no host names"));
    }
    let duration = |key: &'static str, default: u64| {
        annotations.get(key).map_or(Ok(default), |v| {
            parse_duration_ms(v).map_err(|e| bad(key, e))
        })
    };
    let count = |key: &'static str, default: u32| {
        annotations.get(key).map_or(Ok(default), |v| {
            v.trim()
                .parse::<u32>()
                .map_err(|_| bad(key, format!("{v:?} is not a whole number")))
        })
    };
    // ebb's names win over Knative's.
    let min_replicas = match annotations.contains_key(MIN_REPLICAS) {
        true => count(MIN_REPLICAS, 0)?,
        false => count(KN_MIN_SCALE, 0)?,
    };
    let max_default = defaults.max_replicas.max(min_replicas);
    let max_replicas = match annotations.contains_key(MAX_REPLICAS) {
        true => count(MAX_REPLICAS, max_default)?,
        false => match count(KN_MAX_SCALE, max_default)? {
            0 => {
                return Err(bad(
                    KN_MAX_SCALE,
                    "0 (no bound) is not taken: ebb scales within a bound, name it",
                ));
            }
            n => n,
        },
    };
    if max_replicas == 0 || min_replicas > max_replicas {
        return Err(bad(
            MAX_REPLICAS,
            format!(
                "need 1 <= max-replicas and min-replicas <= max-replicas (min {min_replicas}, max {max_replicas})"
            ),
        ));
    }
    let policy = match annotations.get(TRAFFIC_POLICY) {
        None => Default::default(),
        Some(v) => {
            let p: crate::discovery::Policy = serde_json::from_str(v)
                .map_err(|e| bad(TRAFFIC_POLICY, format!("not a traffic policy: {e}")))?;
            p.validate().map_err(|e| bad(TRAFFIC_POLICY, e))?;
            p
        }
    };
    let idle_replicas = annotations
        .get(IDLE_REPLICAS)
        .map(|_| count(IDLE_REPLICAS, 0))
        .transpose()?;
    if let Some(n) = idle_replicas.filter(|n| *n > max_replicas) {
        return Err(bad(
            IDLE_REPLICAS,
            format!("{n} is above max-replicas ({max_replicas})"),
        ));
    }
    let warm = match annotations.get(WARM) {
        None => Vec::new(),
        Some(v) => {
            let written: Vec<crate::warm::WarmConfig> = serde_json::from_str(v)
                .map_err(|e| bad(WARM, format!("not a list of keep-warm windows: {e}")))?;
            crate::warm::warm_windows(&written, max_replicas).map_err(|e| bad(WARM, e))?
        }
    };
    let waiting_page = match annotations.get(WAITING_PAGE).map(|v| v.trim()) {
        None | Some("false") => None,
        Some("true" | "builtin") => Some(crate::event::WaitingPage::default()),
        Some(html) if html.starts_with('<') => {
            let page = crate::event::WaitingPage {
                template: Some(html.to_owned()),
                refresh_s: 0,
            };
            crate::waiting::check(&page).map_err(|e| bad(WAITING_PAGE, e))?;
            Some(page)
        }
        Some(other) => {
            return Err(bad(
                WAITING_PAGE,
                format!("{other:?} is neither true, false, builtin nor an HTML page"),
            ));
        }
    };
    let spec = RouteSpec {
        name: format!("{namespace}/{service}"),
        domains: hosts,
        deployment: workload.key(),
        idle_after_ms: duration(IDLE_AFTER, defaults.idle_after_ms)?,
        min_replicas,
        max_replicas,
        hold_timeout_ms: duration(HOLD_TIMEOUT, defaults.hold_timeout_ms)?,
        hold_queue_max: defaults.hold_queue_max,
        process: None,
        concurrency: count(CONCURRENCY, 0)?,
        max_connecting: 0,
        policy: Box::new(policy),
        idle_replicas,
        warm,
        response_timeout_ms: duration(RESPONSE_TIMEOUT, 0)?,
        stream_idle_timeout_ms: duration(STREAM_IDLE_TIMEOUT, 0)?,
        connection_idle_timeout_ms: duration(CONNECTION_IDLE_TIMEOUT, 0)?,
        waiting_page,
        listen,
        load: load(annotations, min_replicas, max_replicas)?,
    };
    Ok(Some((spec, workload)))
}

/// The load scaling the annotations ask for (`None`: none names a target), ebb's names first,
/// then Knative's.
fn load(
    annotations: &BTreeMap<String, String>,
    min_replicas: u32,
    max_replicas: u32,
) -> Result<Option<crate::event::LoadSpec>, AnnotationError> {
    let get = |ours: &'static str, theirs: Option<&'static str>| {
        annotations
            .get(ours)
            .map(|v| (ours, v.trim()))
            .or_else(|| theirs.and_then(|t| annotations.get(t).map(|v| (t, v.trim()))))
    };
    let number = |(key, v): (&'static str, &str)| {
        v.trim_end_matches('%')
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite())
            .ok_or_else(|| bad(key, format!("{v:?} is not a number")))
    };
    let ms = |(key, v): (&'static str, &str)| parse_duration_ms(v).map_err(|e| bad(key, e));
    let concurrency = get(TARGET_CONCURRENCY, None).map(number).transpose()?;
    let rps = get(TARGET_RPS, None).map(number).transpose()?;
    let (concurrency, rps, key) = match (concurrency, rps) {
        (Some(_), Some(_)) => {
            return Err(bad(
                TARGET_RPS,
                format!("a route scales on {TARGET_CONCURRENCY} or {TARGET_RPS}, not both"),
            ));
        }
        (Some(c), None) => (Some(c), None, TARGET_CONCURRENCY),
        (None, Some(r)) => (None, Some(r), TARGET_RPS),
        (None, None) => {
            let metric = annotations.get(KN_METRIC).map(|m| m.trim());
            let Some(target) = annotations.get(KN_TARGET) else {
                if metric.is_some() {
                    return Err(bad(
                        KN_TARGET,
                        format!("missing: {KN_METRIC} needs a target"),
                    ));
                }
                return Ok(None);
            };
            let t = number((KN_TARGET, target.trim()))?;
            match metric {
                None | Some("concurrency") => (Some(t), None, KN_TARGET),
                Some("rps") => (None, Some(t), KN_TARGET),
                Some(other) => {
                    return Err(bad(
                        KN_METRIC,
                        format!("{other:?}: ebb scales on concurrency or rps"),
                    ));
                }
            }
        }
    };
    let mut spec = crate::event::LoadSpec {
        target_concurrency: concurrency,
        target_rps: rps,
        ..Default::default()
    };
    // Which annotation gave each knob, to name it when its value is refused.
    let mut given: Vec<(&str, &'static str)> = Vec::new();
    if let Some(v) = get(TARGET_UTILIZATION, Some(KN_UTILIZATION)) {
        spec.utilization_pct = number(v)?;
        given.push(("utilization", v.0));
    }
    if let Some(v) = get(SCALE_WINDOW, Some(KN_WINDOW)) {
        spec.window_ms = ms(v)?;
        given.push(("the window", v.0));
    }
    if let Some(v) = get(PANIC_WINDOW, Some(KN_PANIC_WINDOW)) {
        spec.panic_window_pct = number(v)?;
        given.push(("panic window", v.0));
        given.push(("panic_window", v.0));
    }
    if let Some(v) = get(PANIC_THRESHOLD, Some(KN_PANIC_THRESHOLD)) {
        spec.panic_threshold_pct = number(v)?;
        given.push(("panic threshold", v.0));
    }
    if let Some(v) = get(SCALE_DOWN_DELAY, Some(KN_SCALE_DOWN_DELAY)) {
        spec.scale_down_delay_ms = ms(v)?;
    }
    if let Some(v) = get(MAX_SCALE_UP_RATE, None) {
        spec.max_scale_up_rate = number(v)?;
        given.push(("scale-up rate", v.0));
    }
    if let Some(v) = get(MAX_SCALE_DOWN_RATE, None) {
        spec.max_scale_down_rate = number(v)?;
        given.push(("scale-down rate", v.0));
    }
    given.push(("target", key));
    given.push(("replicas", MAX_REPLICAS));
    // The most particular words first ("the panic window ... the window").
    given.sort_by_key(|(words, _)| match *words {
        "the window" | "target" | "replicas" => 1,
        _ => 0,
    });
    crate::scaler::load::Settings::of(&spec, min_replicas, max_replicas).map_err(|e| {
        let at = given
            .iter()
            .find(|(words, _)| e.contains(words))
            .map_or(key, |(_, k)| *k);
        bad(at, e)
    })?;
    Ok(Some(spec))
}

fn workload(
    namespace: &str,
    (key, value): (&'static str, &String),
) -> Result<Workload, AnnotationError> {
    let value = value.trim();
    let (kind, name) = match value.split_once('/') {
        None => (WorkloadKind::Deployment, value),
        Some((kind, name)) => match kind.to_ascii_lowercase().as_str() {
            "deployment" | "deployments" | "deploy" => (WorkloadKind::Deployment, name),
            "statefulset" | "statefulsets" | "sts" => (WorkloadKind::StatefulSet, name),
            _ => {
                return Err(bad(
                    key,
                    format!("{value:?}: the workload is NAME, deployment/NAME or statefulset/NAME"),
                ));
            }
        },
    };
    // A Kubernetes object name (RFC 1123 subdomain).
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if !ok {
        return Err(bad(
            key,
            format!("{name:?} is not a Kubernetes object name"),
        ));
    }
    Ok(Workload {
        kind,
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    })
}

/// A Service's route with the Service's creation time, for [`resolve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub route: RouteSpec,
    /// When the Service was created (Unix ms); the older claim keeps a contested domain.
    pub created_ms: u64,
}

/// The label that makes a Deployment the workload of a Service of its namespace:
/// `ebb.dev/service: NAME`. The Service needs no annotation of ebb's; the Deployment's own
/// annotations (`ebb.dev/...`, `autoscaling.knative.dev/...`) are the route's settings.
pub const SERVICE_LABEL: &str = "ebb.dev/service";

/// A Service's annotations as the route reads them when the Deployment `deployment` is
/// labelled as its workload ([`SERVICE_LABEL`]): `ebb.dev/deployment` naming it, and the
/// Deployment's annotations of ebb's and Knative's autoscaling, under the Service's own (which
/// win where both say something).
pub fn with_labelled(
    service: &BTreeMap<String, String>,
    deployment: &str,
    annotations: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    if names_workload(service) {
        return service.clone();
    }
    let mut merged = settings(Some(annotations));
    if service.contains_key(PROXLESS_DOMAINS) {
        merged.remove(DOMAINS);
    }
    merged.insert(DEPLOYMENT.to_owned(), deployment.to_owned());
    merged.extend(service.iter().map(|(k, v)| (k.clone(), v.clone())));
    merged
}

/// Whether a Service's annotations name its workload themselves (ebb's or proxless' key).
pub fn names_workload(service: &BTreeMap<String, String>) -> bool {
    service.contains_key(DEPLOYMENT) || service.contains_key(PROXLESS_DEPLOYMENT)
}

/// The annotations of a workload that are route settings: ebb's and Knative's autoscaling.
pub fn settings(annotations: Option<&BTreeMap<String, String>>) -> BTreeMap<String, String> {
    annotations
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.starts_with("ebb.dev/") || k.starts_with("autoscaling.knative.dev/"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The routes of all annotated Services, with a domain or a TCP `listen` address claimed twice
/// left to the older Service (ties: the smaller name): a newer Service that claims a taken one
/// gets no route at all (none of its domains, no listener, so that it never half-serves), and
/// an error for its Warning Event. An address on every interface (`0.0.0.0:P`, `[::]:P`) takes
/// port P on all of them.
pub fn resolve(mut claims: Vec<Claim>) -> (Vec<RouteSpec>, Vec<(String, AnnotationError)>) {
    claims.sort_by(|a, b| (a.created_ms, &a.route.name).cmp(&(b.created_ms, &b.route.name)));
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    let mut listening: Vec<(String, std::net::SocketAddr)> = Vec::new();
    let mut routes = Vec::new();
    let mut refused = Vec::new();
    for claim in claims {
        let taken = claim
            .route
            .domains
            .iter()
            .find_map(|d| owner.get(d).map(|o| (d.clone(), o.clone())));
        if let Some((domain, other)) = taken {
            let message = format!("{domain:?} is served by Service {other} already");
            refused.push((claim.route.name.clone(), bad(DOMAINS, message)));
            continue;
        }
        let listen: Option<std::net::SocketAddr> =
            claim.route.listen.as_deref().and_then(|l| l.parse().ok());
        if let Some(addr) = listen
            && let Some((other, theirs)) = listening
                .iter()
                .find(|(_, theirs): &&(String, std::net::SocketAddr)| overlaps(addr, *theirs))
        {
            let message =
                format!("{addr} is the listen address of Service {other} already ({theirs})");
            refused.push((claim.route.name.clone(), bad(LISTEN, message)));
            continue;
        }
        if let Some(addr) = listen {
            listening.push((claim.route.name.clone(), addr));
        }
        for d in &claim.route.domains {
            owner.insert(d.clone(), claim.route.name.clone());
        }
        routes.push(claim.route);
    }
    (routes, refused)
}

/// Whether two listen addresses cannot both be bound: the same port, and the same IP or either
/// on every interface.
fn overlaps(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// Milliseconds in a duration written as whole numbers with units, Go's way: `500ms`, `90s`,
/// `5m`, `1h30m`. At most a week.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    const WEEK_MS: u64 = 7 * 24 * 3_600_000;
    let s = text.trim();
    let bad = || format!("{text:?} is not a duration (such as 500ms, 90s, 5m or 1h30m)");
    if s.is_empty() {
        return Err(bad());
    }
    let mut total: u64 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 12 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let (unit_ms, len) = if rest.starts_with("ms") {
            (1, 2)
        } else if rest.starts_with('s') {
            (1_000, 1)
        } else if rest.starts_with('m') {
            (60_000, 1)
        } else if rest.starts_with('h') {
            (3_600_000, 1)
        } else {
            return Err(bad());
        };
        rest = &rest[len..];
        total = n
            .checked_mul(unit_ms)
            .and_then(|ms| total.checked_add(ms))
            .filter(|t| *t <= WEEK_MS)
            .ok_or_else(|| format!("{text:?} is longer than a week"))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_labelled_deployment_names_itself_and_brings_its_settings_under_the_services() {
        let service: BTreeMap<String, String> = [(IDLE_AFTER.to_owned(), "5m".to_owned())].into();
        let deployment: BTreeMap<String, String> = [
            (IDLE_AFTER, "1m"),
            (HOLD_TIMEOUT, "20s"),
            (KN_TARGET, "10"),
            (MAX_REPLICAS, "3"),
            ("deployment.kubernetes.io/revision", "3"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let merged = with_labelled(&service, "hello", &deployment);
        assert_eq!(merged[DEPLOYMENT], "hello");
        assert_eq!(
            merged[IDLE_AFTER], "5m",
            "the Service's own annotation wins"
        );
        assert_eq!(merged[HOLD_TIMEOUT], "20s");
        assert_eq!(merged[KN_TARGET], "10");
        assert!(!merged.contains_key("deployment.kubernetes.io/revision"));
        let (route, _) = route("shop", "web", &merged, &RouteDefaults::default())
            .expect("a route")
            .expect("not none");
        assert_eq!(route.name, "shop/web");
        assert_eq!(route.deployment, "shop/hello");
        assert!(route.domains.is_empty(), "a Gateway API backend: {route:?}");
        // A Service that names its workload itself keeps its own annotations, whatever is
        // labelled.
        let own: BTreeMap<String, String> =
            [(PROXLESS_DEPLOYMENT.to_owned(), "other".to_owned())].into();
        assert_eq!(with_labelled(&own, "hello", &deployment), own);
    }

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn of(pairs: &[(&str, &str)]) -> Result<Option<(RouteSpec, Workload)>, AnnotationError> {
        route(
            "shop",
            "web",
            &annotations(pairs),
            &RouteDefaults::default(),
        )
    }

    #[test]
    fn a_service_without_route_annotations_is_not_ebbs() {
        assert_eq!(of(&[("app", "web")]), Ok(None));
    }

    #[test]
    fn ebb_and_proxless_annotations_make_a_route_with_its_settings() {
        let (r, w) = of(&[
            (
                DOMAINS,
                "Web.Example.com, *.web.example.com,web.example.com",
            ),
            (DEPLOYMENT, "web-v2"),
            (IDLE_AFTER, "1m30s"),
            (HOLD_TIMEOUT, "500ms"),
            (MIN_REPLICAS, "1"),
            (MAX_REPLICAS, "3"),
            (CONCURRENCY, "8"),
            (
                TRAFFIC_POLICY,
                r#"{"balancer": "least_request", "choices": 3}"#,
            ),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(r.name, "shop/web");
        assert_eq!(
            (r.policy.balancer, r.policy.choices),
            (crate::discovery::Balancer::LeastRequest, 3)
        );
        assert_eq!(r.domains, ["web.example.com", "*.web.example.com"]);
        assert_eq!(r.deployment, "shop/web-v2");
        assert_eq!((r.idle_after_ms, r.hold_timeout_ms), (90_000, 500));
        assert_eq!((r.min_replicas, r.max_replicas, r.concurrency), (1, 3, 8));
        assert_eq!(w.kind, WorkloadKind::Deployment);

        let (r, w) = of(&[
            (PROXLESS_DOMAINS, "legacy.example.com"),
            (PROXLESS_DEPLOYMENT, "statefulset/db-api"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(r.domains, ["legacy.example.com"]);
        assert_eq!(r.deployment, "shop/statefulset/db-api");
        assert_eq!(w.kind, WorkloadKind::StatefulSet);
        assert_eq!(r.idle_after_ms, RouteDefaults::default().idle_after_ms);

        // ebb's own annotations win over proxless'.
        let (r, _) = of(&[
            (DOMAINS, "new.example.com"),
            (PROXLESS_DOMAINS, "old.example.com"),
            (DEPLOYMENT, "new"),
            (PROXLESS_DEPLOYMENT, "old"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (r.domains[0].as_str(), r.deployment.as_str()),
            ("new.example.com", "shop/new")
        );
    }

    #[test]
    fn bad_annotations_name_the_annotation_at_fault() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[(DOMAINS, "a.example.com")], DEPLOYMENT),
            (
                &[(DOMAINS, "a b.example.com"), (DEPLOYMENT, "web")],
                DOMAINS,
            ),
            (&[(DOMAINS, " , "), (DEPLOYMENT, "web")], DOMAINS),
            (
                &[(PROXLESS_DOMAINS, "x_y.com"), (DEPLOYMENT, "web")],
                PROXLESS_DOMAINS,
            ),
            (&[(DOMAINS, "a.com"), (DEPLOYMENT, "Web")], DEPLOYMENT),
            (
                &[
                    (DOMAINS, "a.com"),
                    (DEPLOYMENT, "web"),
                    (TRAFFIC_POLICY, r#"{"balancer": "fastest"}"#),
                ],
                TRAFFIC_POLICY,
            ),
            (
                &[
                    (DOMAINS, "a.com"),
                    (DEPLOYMENT, "web"),
                    (TRAFFIC_POLICY, r#"{"balancer": "consistent_hash"}"#),
                ],
                TRAFFIC_POLICY,
            ),
            (
                &[(DOMAINS, "a.com"), (DEPLOYMENT, "daemonset/web")],
                DEPLOYMENT,
            ),
            (
                &[(DOMAINS, "a.com"), (DEPLOYMENT, "deployment/")],
                DEPLOYMENT,
            ),
            (
                &[
                    (DOMAINS, "a.com"),
                    (DEPLOYMENT, "web"),
                    (IDLE_AFTER, "5 minutes"),
                ],
                IDLE_AFTER,
            ),
            (
                &[
                    (DOMAINS, "a.com"),
                    (DEPLOYMENT, "web"),
                    (HOLD_TIMEOUT, "9999h"),
                ],
                HOLD_TIMEOUT,
            ),
            (
                &[
                    (DOMAINS, "a.com"),
                    (DEPLOYMENT, "web"),
                    (MIN_REPLICAS, "-1"),
                ],
                MIN_REPLICAS,
            ),
            (
                &[
                    (DOMAINS, "a.com"),
                    (DEPLOYMENT, "web"),
                    (MIN_REPLICAS, "3"),
                    (MAX_REPLICAS, "2"),
                ],
                MAX_REPLICAS,
            ),
            (
                &[(DOMAINS, "a.com"), (DEPLOYMENT, "web"), (MAX_REPLICAS, "0")],
                MAX_REPLICAS,
            ),
            (
                &[
                    (DOMAINS, "a.com"),
                    (DEPLOYMENT, "web"),
                    (CONCURRENCY, "lots"),
                ],
                CONCURRENCY,
            ),
        ];
        for (pairs, at_fault) in cases {
            let err = of(pairs).expect_err(&format!("{pairs:?} makes a route"));
            assert_eq!(err.annotation, *at_fault, "{pairs:?}: {err}");
            assert!(!err.message.is_empty());
        }
        // A workload and no host names: the backend of Gateway API routes, a route without
        // domains of its own.
        let backend = of(&[(DEPLOYMENT, "web")])
            .expect("a backend")
            .expect("a route");
        assert!(backend.0.domains.is_empty());
    }

    #[test]
    fn durations_are_read_the_way_go_writes_them() {
        for (text, ms) in [
            ("500ms", 500),
            ("90s", 90_000),
            ("5m", 300_000),
            ("1h30m", 5_400_000),
            ("1m1s1ms", 61_001),
            (" 2s ", 2_000),
        ] {
            assert_eq!(parse_duration_ms(text), Ok(ms), "{text}");
        }
        for text in [
            "",
            "5",
            "m",
            "1.5s",
            "-1s",
            "1d",
            "5 m",
            "169h",
            "9999999999999s",
        ] {
            assert!(
                parse_duration_ms(text).is_err(),
                "{text:?} read as a duration"
            );
        }
    }

    #[test]
    fn a_domain_claimed_twice_stays_with_the_older_service() {
        let claim = |service: &str, domains: &str, created_ms: u64| {
            let a = annotations(&[(DOMAINS, domains), (DEPLOYMENT, service)]);
            let (route, _) = route("shop", service, &a, &RouteDefaults::default())
                .unwrap()
                .unwrap();
            Claim { route, created_ms }
        };
        let (routes, refused) = resolve(vec![
            claim("newer", "b.example.com,a.example.com", 20),
            claim("older", "a.example.com", 10),
            claim("other", "c.example.com", 30),
            claim("tie-b", "d.example.com", 40),
            claim("tie-a", "d.example.com", 40),
        ]);
        let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["shop/older", "shop/other", "shop/tie-a"]);
        let refused: Vec<(&str, &str)> = refused
            .iter()
            .map(|(n, e)| (n.as_str(), e.message.as_str()))
            .collect();
        assert_eq!(
            refused,
            [
                (
                    "shop/newer",
                    "\"a.example.com\" is served by Service shop/older already"
                ),
                (
                    "shop/tie-b",
                    "\"d.example.com\" is served by Service shop/tie-a already"
                ),
            ]
        );
    }

    #[test]
    fn a_listen_address_claimed_twice_stays_with_the_older_service() {
        let claim = |service: &str, listen: &str, created_ms: u64| {
            let a = annotations(&[(LISTEN, listen), (DEPLOYMENT, service)]);
            let (route, _) = route("db", service, &a, &RouteDefaults::default())
                .unwrap()
                .unwrap();
            Claim { route, created_ms }
        };
        let (routes, refused) = resolve(vec![
            claim("newer", "127.0.0.1:5432", 20),
            claim("older", "0.0.0.0:5432", 10),
            claim("other-port", "127.0.0.1:5433", 30),
            claim("other-ip", "127.0.0.2:5433", 40),
        ]);
        let names: Vec<&str> = routes.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["db/older", "db/other-port", "db/other-ip"]);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, "db/newer");
        assert_eq!(
            refused[0].1.message,
            "127.0.0.1:5432 is the listen address of Service db/older already (0.0.0.0:5432)"
        );
    }

    #[test]
    fn min_replicas_above_the_default_maximum_raises_it() {
        let (r, _) = of(&[(DOMAINS, "a.com"), (DEPLOYMENT, "web"), (MIN_REPLICAS, "2")])
            .unwrap()
            .unwrap();
        assert_eq!((r.min_replicas, r.max_replicas), (2, 2));
    }

    #[test]
    fn load_annotations_in_ebbs_words_or_knatives_make_the_routes_load_settings() {
        let base = [
            (DOMAINS, "web.shop"),
            (DEPLOYMENT, "web"),
            (MAX_REPLICAS, "30"),
        ];
        let load = |extra: &[(&str, &str)]| {
            let mut pairs = base.to_vec();
            pairs.extend_from_slice(extra);
            of(&pairs).map(|r| r.unwrap().0.load)
        };
        assert_eq!(load(&[]).unwrap(), None, "no target: no load scaling");
        let ebb = load(&[
            (TARGET_CONCURRENCY, "4"),
            (SCALE_WINDOW, "6s"),
            (PANIC_WINDOW, "20"),
            (TARGET_UTILIZATION, "80"),
            (SCALE_DOWN_DELAY, "30s"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(ebb.target_concurrency, Some(4.0));
        assert_eq!(ebb.window_ms, 6_000);
        assert_eq!(ebb.panic_window_pct, 20.0);
        assert_eq!(ebb.utilization_pct, 80.0);
        assert_eq!(ebb.scale_down_delay_ms, 30_000);
        // Knative's names, with its metric; ebb's win where both are given.
        let kn = load(&[
            (KN_METRIC, "rps"),
            (KN_TARGET, "150"),
            (KN_WINDOW, "2m"),
            (KN_UTILIZATION, "90"),
            (TARGET_UTILIZATION, "60"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((kn.target_rps, kn.target_concurrency), (Some(150.0), None));
        assert_eq!((kn.window_ms, kn.utilization_pct), (120_000, 60.0));
        let kn = load(&[(KN_TARGET, "4")]).unwrap().unwrap();
        assert_eq!(kn.target_concurrency, Some(4.0), "concurrency by default");
        // min-scale and max-scale are the route's bounds unless ebb's are given.
        let (spec, _) = of(&[
            (DOMAINS, "web.shop"),
            (DEPLOYMENT, "web"),
            (KN_MIN_SCALE, "2"),
            (KN_MAX_SCALE, "9"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((spec.min_replicas, spec.max_replicas), (2, 9));
    }

    #[test]
    fn bad_load_annotations_name_the_annotation_at_fault() {
        for (pairs, at_fault) in [
            (vec![(TARGET_CONCURRENCY, "four")], TARGET_CONCURRENCY),
            (vec![(TARGET_CONCURRENCY, "0")], TARGET_CONCURRENCY),
            (
                vec![(TARGET_CONCURRENCY, "4"), (TARGET_RPS, "9")],
                TARGET_RPS,
            ),
            (vec![(KN_METRIC, "cpu"), (KN_TARGET, "80")], KN_METRIC),
            (vec![(KN_METRIC, "rps")], KN_TARGET),
            (vec![(KN_TARGET, "4"), (KN_WINDOW, "2s")], KN_WINDOW),
            (vec![(KN_TARGET, "4"), (KN_WINDOW, "soon")], KN_WINDOW),
            (
                vec![(TARGET_RPS, "4"), (KN_PANIC_WINDOW, "0")],
                KN_PANIC_WINDOW,
            ),
            (
                vec![(TARGET_RPS, "4"), (PANIC_THRESHOLD, "50")],
                PANIC_THRESHOLD,
            ),
            (
                vec![(TARGET_RPS, "4"), (TARGET_UTILIZATION, "120")],
                TARGET_UTILIZATION,
            ),
            (
                vec![(TARGET_RPS, "4"), (MAX_SCALE_DOWN_RATE, "1")],
                MAX_SCALE_DOWN_RATE,
            ),
            (
                vec![(TARGET_RPS, "4"), (MAX_SCALE_UP_RATE, "nan")],
                MAX_SCALE_UP_RATE,
            ),
            (vec![(KN_MAX_SCALE, "0")], KN_MAX_SCALE),
        ] {
            let mut all = vec![
                (DOMAINS, "web.shop"),
                (DEPLOYMENT, "web"),
                (MAX_REPLICAS, "30"),
            ];
            if at_fault == KN_MAX_SCALE {
                all.pop();
            }
            all.extend(pairs.iter().copied());
            let err = of(&all).expect_err(&format!("{pairs:?}"));
            assert_eq!(err.annotation, at_fault, "{pairs:?}: {err}");
        }
        // Scaling on load needs room to move.
        let err = of(&[
            (DOMAINS, "web.shop"),
            (DEPLOYMENT, "web"),
            (TARGET_CONCURRENCY, "4"),
        ])
        .unwrap_err();
        assert_eq!(err.annotation, MAX_REPLICAS, "{err}");
    }
}
