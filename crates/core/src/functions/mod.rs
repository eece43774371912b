//! Functions: templates (how to run a function, what may run after it), their validation and
//! the decisions that change them. The JSON shape of a template (`TemplateJson`) is the
//! serverless seed's, camelCase: `name`, `preRun`, `function`, `command`, `image`,
//! `serviceAddress`, `left`, `right`, `initInstanceNum`, `minInstanceNum`, `maxInstanceNum`,
//! `timeoutMs`, `concurrency`, `schedule`.
//!
//! * **Templates.** [`TemplateJson::from_body`] takes the seed's `Func` object or its spec alone,
//!   empty strings as absent; [`TemplateJson`] also derives the custom resource
//!   `functions.ebb.dev`, kind `Func`, with [`FuncStatus`] ([`crds`] hands it to `ebb crds`;
//!   [`status_of`] fills the status from the state). The template decisions ([`decide_create`],
//!   [`decide_put`], [`decide_delete`]) carry the template's route `fn-NAME` for the templates ebb
//!   runs, and seed the counter with the initial instances.
//! * **Chains.** [`decide_next`]: the last step's answer picks `left` or `right` by
//!   `X-Ebb-Branch`; no next function, or `RETURN`, ends the instance; a failed step, an unknown
//!   function or [`MAX_STEPS`] steps end it in error. [`check_chain`]: every function an
//!   invocation may reach exists. A step is a call ([`step_call`]) whose id is derived from the
//!   instance's id and the step's number ([`step_call_id`]), so a step decided again after a
//!   crash is the same call.
//! * **Autoscaling.** [`decide_autoscale`]: each period, the calls counted and the decay as at
//!   most two aggregated counter events (`CounterAdded`, `CounterDecayed`) per function, and the
//!   replicas each function needs from its counter and its steps in flight.
//! * **Cron.** [`next_firing`] and [`last_firing`] (croner, whole seconds, UTC) and
//!   [`decide_fire`]: the latest occurrence at or before now, newer than the last one fired. A
//!   template's next firing is a `Due::TemplateFire` entry of the schedule heap, set by the
//!   projection from `TemplateUpserted` and `TemplateFired`, so a restart rebuilds it from the
//!   log; a firing's instance id is derived from the template and the occurrence
//!   ([`firing_instance_id`]). ebb uses tokio-cron-scheduler's parser (croner) but not its job
//!   runner, which reads the system clock and keeps no memory across restarts: the schedule heap
//!   is clock-injected, replayable, and exactly-once per occurrence.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::{
    CallKind, CallSpec, Event, Outcome, Payload, ProcessSpec, RouteSpec, TemplateSpec,
};
use crate::state::{CallStatus, InstanceStatus, State};

/// Names no template may have: `template` is the collection's path, `RETURN` ends a chain.
pub const RESERVED: [&str; 2] = ["template", "RETURN"];

/// A step's timeout when the template names none.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;

/// The most steps one instance runs by default (`--max-instance-steps`); a chain that would run
/// more ends in an error.
pub const MAX_STEPS: usize = 64;

/// The response header a function answers with to pick the next function.
pub const BRANCH_HEADER: &str = "x-ebb-branch";

/// The proxy's idle scale-down of a function's workload: a day. The function autoscaler scales
/// functions (to zero too, when their counter has decayed).
pub const IDLE_AFTER_MS: u64 = 86_400_000;

/// The function autoscaler's settings (`ebb serve --fn-*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Autoscale {
    /// How often counters decay and instances are decided.
    pub period_ms: u64,
    /// How much every counter decays each period.
    pub decay: u64,
    /// The most a counter holds.
    pub cap: u64,
    /// Counter units one instance is for.
    pub target_per_instance: u64,
    /// A function goes to zero instances only this long after its last call (and once its
    /// counter is empty): no cold start for every call of a function called now and then.
    pub zero_after_ms: u64,
}

impl Default for Autoscale {
    fn default() -> Self {
        Self {
            period_ms: 1_000,
            decay: 2,
            cap: 1_000,
            target_per_instance: 10,
            zero_after_ms: 30_000,
        }
    }
}

/// One period of the function autoscaler, given the steps queued per template since the last
/// one: each counter grows by them (capped), the function's instances follow
/// `clamp(ceil(counter / target), min, max)`, never below what its in-flight steps need at its
/// concurrency, nor below one within `zero_after_ms` of its last call; then the counter decays by
/// `decay`. At most two aggregated counter events per function and period. Returns the events
/// and the deployments to scale.
pub fn decide_autoscale(
    state: &State,
    added: &std::collections::BTreeMap<String, u64>,
    a: &Autoscale,
    now_ms: u64,
    raise_only: bool,
) -> (Vec<Event>, Vec<(String, u32)>) {
    // Steps queued or running, by function.
    let mut in_flight: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    for i in state
        .functions
        .running
        .iter()
        .filter_map(|id| state.functions.instances.get(id))
    {
        if i.status != InstanceStatus::Running {
            continue;
        }
        if let Some(st) = i.steps.last()
            && state
                .calls
                .get(&st.call_id)
                .is_some_and(|c| !c.status.is_final())
        {
            *in_flight.entry(st.function.as_str()).or_default() += 1;
        }
    }
    let mut events = Vec::new();
    let mut scales = Vec::new();
    for (name, t) in &state.functions.templates {
        let Some(route) = route_of(&t.spec) else {
            continue;
        };
        let mut value = state.counters.value(name);
        let mut last_added = state
            .counters
            .by_function
            .get(name)
            .map_or(0, |c| c.last_added_at_ms);
        let by = added.get(name).copied().unwrap_or(0);
        if by > 0 {
            events.push(Event::CounterAdded {
                function: name.clone(),
                by,
                cap: a.cap,
            });
            value = value.saturating_add(by).min(a.cap);
            last_added = now_ms;
        }
        let (min, max) = (t.spec.min_instances, t.spec.max_instances);
        let wanted = value.div_ceil(a.target_per_instance.max(1));
        let need = in_flight
            .get(name.as_str())
            .copied()
            .unwrap_or(0)
            .div_ceil(u64::from(t.spec.concurrency.max(1)));
        let keep = u64::from(
            value > 0 || (last_added > 0 && now_ms.saturating_sub(last_added) < a.zero_after_ms),
        );
        let desired = (wanted.max(need).max(keep).min(u64::from(u32::MAX)) as u32).clamp(min, max);
        if value > 0 && a.decay > 0 {
            events.push(Event::CounterDecayed {
                function: name.clone(),
                by: a.decay.min(value),
            });
        }
        let current = state
            .routes
            .deployments
            .get(&route.deployment)
            .map_or(0, |d| d.desired);
        // Shared by several replicas (Kubernetes), each counting only its own calls: one only
        // raises; lowering is the shared downscaler's (the lease holder, for an idle workload,
        // conditioned on its last use anywhere), as for any route.
        if desired != current && !(raise_only && desired < current) {
            events.push(Event::ScaleRequested {
                deployment: route.deployment.clone(),
                from: current,
                to: desired,
                reason: crate::event::ScaleReason::Autoscale,
            });
            scales.push((route.deployment, desired));
        }
    }
    (events, scales)
}

/// The name of the route and workload (on Kubernetes, the Deployment and Service) that serve
/// template `template`.
pub fn workload_of(template: &str) -> String {
    format!("fn-{template}")
}

/// The route (and workload) that serves a template run by ebb: `fn-NAME`, reached as
/// `NAME.fn.ebb.internal`. A template with a `command` runs it as a local process; one with an
/// `image` runs on Kubernetes as the Deployment `fn-NAME` behind the Service `fn-NAME`
/// ([`crate::orchestrator::kube_functions`]). Templates served elsewhere (`serviceAddress` only)
/// have none.
pub fn route_of(t: &TemplateSpec) -> Option<RouteSpec> {
    if t.command.is_empty() && t.image.is_none() {
        return None;
    }
    let name = workload_of(&t.name);
    Some(RouteSpec {
        name: name.clone(),
        domains: vec![host_of(&t.name)],
        deployment: name,
        idle_after_ms: IDLE_AFTER_MS,
        min_replicas: t.min_instances,
        max_replicas: t.max_instances,
        hold_timeout_ms: t.timeout_ms,
        hold_queue_max: 10_000,
        process: (!t.command.is_empty()).then(|| ProcessSpec {
            command: t.command.clone(),
            env: vec![
                ("EBB_FUNCTION".into(), t.function.clone()),
                ("EBB_TEMPLATE".into(), t.name.clone()),
            ],
            cwd: None,
            readiness_path: None,
            startup_timeout_ms: 30_000,
            stop_grace_ms: 5_000,
            pre_run: t.pre_run.clone(),
        }),
        concurrency: 0,
        max_connecting: 0,
        policy: t.policy.clone(),
        warm: t.warm.clone(),
        ..Default::default()
    })
}

/// Every function an invocation of `name` may reach through `left` / `right` exists: checked
/// when it is invoked (a template deleted later still ends its chains in a clear error).
pub fn check_chain(state: &State, name: &str) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    let mut todo = vec![name.to_owned()];
    while let Some(f) = todo.pop() {
        if !seen.insert(f.clone()) {
            continue;
        }
        let Some(t) = state.functions.templates.get(&f) else {
            return Err(format!(
                "{f:?} is reachable from {name:?} (left/right) and there is no such function"
            ));
        };
        for next in [&t.spec.left, &t.spec.right].into_iter().flatten() {
            if next != "RETURN" {
                todo.push(next.clone());
            }
        }
    }
    Ok(())
}

/// The schemes a `serviceAddress` may have: the runners send plain HTTP to what they resolve.
pub const SERVICE_SCHEMES: [&str; 3] = ["http", "k8s", "k8s-env"];

/// A `serviceAddress` as a service id: `host:port`, `http://host[:port]` (DNS, every address
/// of the name), `k8s://SERVICE.NAMESPACE[:PORT]` (the Service's ready endpoints) or
/// `k8s-env://NAME`. The runner that sends a call picks one instance by the template's traffic
/// policy.
pub fn service_of(address: &str) -> Result<crate::discovery::ServiceId, String> {
    let id = crate::discovery::ServiceId::parse_address(address)
        .map_err(|e| format!("serviceAddress: {e}"))?;
    if !SERVICE_SCHEMES.contains(&id.scheme()) {
        return Err(format!(
            "serviceAddress {address:?}: the scheme {:?} is not one of {}",
            id.scheme(),
            SERVICE_SCHEMES.join(", ")
        ));
    }
    crate::discovery::k8s::check(&id).map_err(|e| format!("serviceAddress: {e}"))?;
    Ok(id)
}

/// Whether this ebb can run a template's steps: it calls its `serviceAddress`, or runs its
/// server: from its `command` as a local process, or from its `image` on Kubernetes
/// (`kubernetes`: the backend this ebb runs workloads on).
pub fn runnable(t: &TemplateSpec, kubernetes: bool) -> Result<(), String> {
    if let Some(a) = &t.service_address {
        return match service_of(a) {
            Ok(id) if id.scheme() == "k8s" && !kubernetes => Err(format!(
                "function {:?} is served at {id}, and this ebb runs no Kubernetes backend to resolve it",
                t.name
            )),
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
    }
    match (kubernetes, t.image.is_some(), t.command.is_empty()) {
        (true, true, _) | (false, _, false) => Ok(()),
        (true, false, _) => Err(format!(
            "function {:?} has no image, and this ebb runs workloads on Kubernetes; give it an image or a serviceAddress",
            t.name
        )),
        (false, _, true) => Err(format!(
            "function {:?} runs from an image, and this ebb runs no Kubernetes backend; give it a command or a serviceAddress",
            t.name
        )),
    }
}

/// The host name a template's workload is reached by through ebb's proxy.
pub fn host_of(template: &str) -> String {
    format!("{template}.fn.ebb.internal")
}

/// The call id of an instance's `step`-th step (1-based): derived from the instance id, so a
/// step decided again after a crash is the same call, never a second one.
/// The call has the instance's owner (`crate::peers`).
pub fn step_call_id(instance: &str, step: usize) -> String {
    let mut b = uuid::Uuid::parse_str(crate::ids::uuid_part(instance))
        .map(|u| *u.as_bytes())
        .unwrap_or_default();
    b[14..16].copy_from_slice(&(step as u16).to_be_bytes());
    // A version 8 (custom) UUID, RFC 4122 variant.
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    crate::ids::id_of(crate::ids::owner_of(instance), uuid::Uuid::from_bytes(b))
}

/// The call that runs `function` (template `t`) as step `step` of `instance` with `input`.
pub fn step_call(instance: &str, step: usize, t: &TemplateSpec, input: Vec<u8>) -> CallSpec {
    CallSpec {
        id: step_call_id(instance, step),
        target: workload_of(&t.name),
        kind: CallKind::Async,
        timeout_ms: t.timeout_ms,
        partition: None,
        trace: None,
        tracestate: None,
        baggage: None,
        payload: Payload {
            method: "POST".into(),
            path: "/".into(),
            headers: vec![
                ("x-ebb-instance".into(), instance.to_owned()),
                ("x-ebb-function".into(), t.name.clone()),
                ("x-ebb-step".into(), step.to_string()),
            ],
            body: serde_bytes::ByteBuf::from(input),
        },
    }
}

/// The events of queuing `call` as the next step of `instance`, running `function`.
pub fn step_events(instance: String, function: String, call: CallSpec) -> [Event; 2] {
    [
        Event::InstanceStepped {
            id: instance,
            function,
            call_id: call.id.clone(),
        },
        Event::CallQueued {
            call: std::sync::Arc::new(call),
        },
    ]
}

/// What an instance does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Nothing now (its step runs, or it ended).
    Wait,
    /// Run `function` as the next step, with `input`.
    Step { function: String, input: Vec<u8> },
    /// End with this outcome and result.
    Finish { outcome: Outcome, result: Vec<u8> },
}

/// The chain rule: once an instance's last step ended, it continues with the function on the
/// branch its answer named (`X-Ebb-Branch: left | right`, default `left`) with the answer's
/// body as input, or ends with that body when the branch names none (or `RETURN`). A failed
/// step, an unknown next function, one this ebb cannot run (`kubernetes`: its backend) or the
/// step bound ends it in error.
pub fn decide_next(state: &State, instance: &str, kubernetes: bool, max_steps: usize) -> Next {
    let Some(i) = state.functions.instances.get(instance) else {
        return Next::Wait;
    };
    if i.status != InstanceStatus::Running {
        return Next::Wait;
    }
    let Some(last) = i.steps.last() else {
        return Next::Wait;
    };
    let Some(call) = state.calls.get(&last.call_id) else {
        return Next::Wait;
    };
    if !call.status.is_final() {
        return Next::Wait;
    }
    let body = call
        .result
        .as_ref()
        .map(|r| r.body.to_vec())
        .unwrap_or_default();
    if call.status != CallStatus::Success {
        let why = if body.is_empty() {
            format!(
                "step {} ({}) ended {:?}",
                i.steps.len(),
                last.function,
                call.status
            )
            .into_bytes()
        } else {
            body
        };
        return Next::Finish {
            outcome: Outcome::Error,
            result: why,
        };
    }
    let branch = call
        .result
        .as_ref()
        .and_then(|r| {
            r.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(BRANCH_HEADER))
                .map(|(_, v)| v.trim().to_ascii_lowercase())
        })
        .unwrap_or_else(|| "left".into());
    let Some(t) = state.functions.templates.get(&last.function) else {
        return Next::Finish {
            outcome: Outcome::Error,
            result: format!(
                "template {:?} was deleted during the instance",
                last.function
            )
            .into_bytes(),
        };
    };
    let next = match branch.as_str() {
        "right" => t.spec.right.clone(),
        "left" => t.spec.left.clone(),
        other => {
            return Next::Finish {
                outcome: Outcome::Error,
                result: format!(
                    "{} answered {BRANCH_HEADER}: {other:?}; use left or right",
                    last.function
                )
                .into_bytes(),
            };
        }
    };
    match next {
        None => Next::Finish {
            outcome: Outcome::Success,
            result: body,
        },
        Some(n) if n == "RETURN" => Next::Finish {
            outcome: Outcome::Success,
            result: body,
        },
        Some(_) if i.steps.len() >= max_steps => Next::Finish {
            outcome: Outcome::Error,
            result: format!(
                "the instance reached the bound of {max_steps} steps (--max-instance-steps)"
            )
            .into_bytes(),
        },
        Some(n) if !state.functions.templates.contains_key(&n) => Next::Finish {
            outcome: Outcome::Error,
            result: format!(
                "{} names {n:?} next, and there is no such function",
                last.function
            )
            .into_bytes(),
        },
        Some(n) if runnable(&state.functions.templates[&n].spec, kubernetes).is_err() => {
            Next::Finish {
                outcome: Outcome::Error,
                result: runnable(&state.functions.templates[&n].spec, kubernetes)
                    .err()
                    .unwrap_or_default()
                    .into_bytes(),
            }
        }
        Some(n) => Next::Step {
            function: n,
            input: body,
        },
    }
}

/// A template as the API reads and writes it: the spec of the seed's `Func` object, which is
/// also the custom resource `functions.ebb.dev` (`Func`, generated from these types by
/// `ebb crds`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(kube::CustomResource, schemars::JsonSchema))]
#[cfg_attr(
    feature = "crd",
    kube(
        group = "ebb.dev",
        version = "v1alpha1",
        kind = "Func",
        plural = "functions",
        singular = "function",
        shortname = "fn",
        namespaced,
        status = "FuncStatus",
        printcolumn = r#"{"name":"Function","type":"string","jsonPath":".spec.function"}"#,
        printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".status.replicas"}"#,
        printcolumn = r#"{"name":"Counter","type":"integer","jsonPath":".status.counter"}"#
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateJson {
    /// Template name (absent in a PUT: the path's).
    #[serde(default)]
    pub name: String,
    /// A setup command run once before the first instance starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_run: Option<String>,
    /// The entry point or code handed to the runtime.
    #[serde(default)]
    pub function: String,
    /// How to run the function server on one machine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// The function server's image (Kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Where the function is served instead of a managed workload: `host:port` or a service id
    /// (`http://name:port`, `k8s://service.namespace:port`, `k8s-env://name`), see [`service_of`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_address: Option<String>,
    /// The function that runs next on the `left` branch (the default branch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub left: Option<String>,
    /// The function that runs next on the `right` branch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub right: Option<String>,
    /// Instances started when the template is created.
    #[serde(default)]
    pub init_instance_num: u32,
    /// Instances kept even when idle.
    #[serde(default)]
    pub min_instance_num: u32,
    /// The most instances (default: the larger of 1, min and init).
    #[serde(default)]
    pub max_instance_num: Option<u32>,
    /// A step's timeout.
    #[serde(default, alias = "timeout")]
    pub timeout_ms: Option<u64>,
    /// Calls one instance serves at once (default 1).
    #[serde(default)]
    pub concurrency: Option<u32>,
    /// A cron schedule that invokes the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// How an instance of the function server is picked for each call (ebb's traffic policy:
    /// `{"balancer": "least_request"}`; absent: peak EWMA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_policy: Option<crate::discovery::Policy>,
    /// Keep-warm windows of the function server: `[{"schedule": "0 8 * * 1-5", "for": "10h",
    /// "min": 1, "timezone": "Europe/Paris"}]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warm: Vec<crate::warm::WarmConfig>,
}

impl TemplateJson {
    /// The spec this describes, defaults filled in and every rule checked; `Err` says what is
    /// wrong.
    pub fn into_spec(self) -> Result<TemplateSpec, String> {
        let max = match self.max_instance_num {
            Some(0) => return Err("maxInstanceNum must be at least 1".into()),
            Some(m) => m,
            None => 1.max(self.min_instance_num).max(self.init_instance_num),
        };
        let spec = TemplateSpec {
            name: self.name,
            pre_run: self.pre_run,
            function: self.function,
            command: self.command,
            image: self.image,
            service_address: self.service_address,
            left: self.left,
            right: self.right,
            init_instances: self.init_instance_num,
            min_instances: self.min_instance_num,
            max_instances: max,
            timeout_ms: self.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS),
            concurrency: self.concurrency.unwrap_or(1),
            schedule: self.schedule,
            policy: Box::new(self.traffic_policy.unwrap_or_default()),
            warm: crate::warm::warm_windows(&self.warm, max).map_err(|e| format!("warm: {e}"))?,
        };
        spec.policy.validate()?;
        validate(&spec)?;
        Ok(spec)
    }

    /// The API's view of a spec.
    pub fn from_spec(s: &TemplateSpec) -> Self {
        Self {
            name: s.name.clone(),
            pre_run: s.pre_run.clone(),
            function: s.function.clone(),
            command: s.command.clone(),
            image: s.image.clone(),
            service_address: s.service_address.clone(),
            left: s.left.clone(),
            right: s.right.clone(),
            init_instance_num: s.init_instances,
            min_instance_num: s.min_instances,
            max_instance_num: Some(s.max_instances),
            timeout_ms: Some(s.timeout_ms),
            concurrency: Some(s.concurrency),
            schedule: s.schedule.clone(),
            traffic_policy: (!s.policy.is_default()).then(|| (*s.policy).clone()),
            warm: s
                .warm
                .iter()
                .map(crate::warm::WarmConfig::from_window)
                .collect(),
        }
    }
}

/// A template's status, as the seed's `FuncStatus` has it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct FuncStatus {
    /// The autoscaler's call counter.
    #[serde(default)]
    pub counter: u64,
    /// When a call was last counted (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_stamp: Option<String>,
    /// The replicas the function server is asked to run.
    #[serde(default)]
    pub replicas: u32,
    /// On Kubernetes, each ebb replica's own counter, which it publishes here (`counter` is
    /// their sum, written by the replica holding the lease).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub by_replica: BTreeMap<String, ReplicaCount>,
}

/// One ebb replica's share of a function's counter, as the replica published it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReplicaCount {
    /// The replica's counter.
    #[serde(default)]
    pub counter: u64,
    /// When the replica last counted a call, Unix ms (0: never).
    #[serde(default)]
    pub last_added_ms: u64,
    /// When the replica wrote this, Unix ms: a share with calls left in it that its replica
    /// stopped refreshing is of a replica gone, and no longer counts.
    #[serde(default)]
    pub at_ms: u64,
}

/// Template `name`'s status now: its call counter, when a call was last counted, and the
/// replicas its function server is asked to run.
pub fn status_of(s: &State, name: &str) -> FuncStatus {
    let last = s
        .counters
        .by_function
        .get(name)
        .map_or(0, |c| c.last_added_at_ms);
    FuncStatus {
        counter: s.counters.value(name),
        time_stamp: i64::try_from(last)
            .ok()
            .filter(|t| *t > 0)
            .and_then(kube_time),
        replicas: s
            .routes
            .deployments
            .get(&workload_of(name))
            .map_or(0, |d| d.desired),
        by_replica: BTreeMap::new(),
    }
}

/// This replica's share of template `name`'s counter, written at `now_ms`.
pub fn share_of(s: &State, name: &str, now_ms: u64) -> ReplicaCount {
    ReplicaCount {
        counter: s.counters.value(name),
        last_added_ms: s
            .counters
            .by_function
            .get(name)
            .map_or(0, |c| c.last_added_at_ms),
        at_ms: now_ms,
    }
}

/// The cluster's status of a function: this replica's `local` status (`mine` its share), with
/// the other replicas' shares added: their counters summed, the newest call counted. A share
/// with calls left in it that was not refreshed within `stale_ms` is of a replica gone and is
/// left out.
pub fn cluster_status(
    local: &FuncStatus,
    mine: &ReplicaCount,
    me: &str,
    shares: &BTreeMap<String, ReplicaCount>,
    now_ms: u64,
    stale_ms: u64,
) -> FuncStatus {
    let mut out = local.clone();
    let mut last_ms = mine.last_added_ms;
    for (replica, share) in shares {
        if replica == me || now_ms.saturating_sub(share.at_ms) > stale_ms {
            continue;
        }
        out.counter = out.counter.saturating_add(share.counter);
        last_ms = last_ms.max(share.last_added_ms);
    }
    out.time_stamp = i64::try_from(last_ms)
        .ok()
        .filter(|t| *t > 0)
        .and_then(kube_time);
    out
}

pub use crate::timing::kube_time;

/// The custom resources ebb defines, as Kubernetes takes them (`ebb crds`).
#[cfg(feature = "crd")]
pub fn crds()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    use kube::CustomResourceExt;
    vec![Func::crd()]
}

/// The API version and kind of a template as an object (the serverless seed's `Func`).
pub const API_VERSION: &str = "ebb.dev/v1alpha1";
pub const KIND: &str = "Func";

/// A template as the seed's clients send it: `{apiVersion, kind, metadata, spec, status}`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct FuncObject {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    metadata: Option<ObjectMetadata>,
    spec: TemplateJson,
    /// Written by ebb, never taken from a client.
    #[serde(default, rename = "status")]
    _status: serde::de::IgnoredAny,
}

/// An object's metadata as a client may send it: only the name is read (the rest, such as
/// `resourceVersion` or labels, is ebb's or unused, and ignored).
#[derive(Debug, Deserialize)]
struct ObjectMetadata {
    #[serde(default)]
    name: Option<String>,
}

/// Why a template body could not be read: not JSON of the right types (`bad_json`), or JSON
/// that says something contradictory (`invalid_template`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    Json(String),
    Invalid(String),
}

impl TemplateJson {
    /// A template from a request body: the seed's `Func` object, or its spec alone (flat).
    /// Empty strings count as absent, as a Go client of the seed sends its unset fields.
    pub fn from_body(bytes: &[u8]) -> Result<Self, BodyError> {
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| BodyError::Json(e.to_string()))?;
        // (serde would read a struct from an array too, by position.)
        if !v.is_object() {
            return Err(BodyError::Json("a template is a JSON object".into()));
        }
        let is_object = v.as_object().is_some_and(|m| {
            ["apiVersion", "kind", "metadata", "spec"]
                .iter()
                .any(|k| m.contains_key(*k))
        });
        let mut t = if is_object {
            if v.get("spec").is_some_and(|s| !s.is_object()) {
                return Err(BodyError::Json("spec: a JSON object".into()));
            }
            let o: FuncObject =
                serde_json::from_value(v).map_err(|e| BodyError::Json(e.to_string()))?;
            if let Some(k) = o.kind.as_deref().filter(|k| *k != KIND) {
                return Err(BodyError::Invalid(format!(
                    "kind {k:?}: a template is a {KIND:?}"
                )));
            }
            if let Some(a) = o
                .api_version
                .as_deref()
                .filter(|a| !a.is_empty() && *a != API_VERSION && *a != "v1")
            {
                return Err(BodyError::Invalid(format!(
                    "apiVersion {a:?}: templates are {API_VERSION:?}"
                )));
            }
            let mut spec = o.spec;
            match o.metadata.and_then(|m| m.name).filter(|n| !n.is_empty()) {
                Some(n) if spec.name.is_empty() => spec.name = n,
                Some(n) if n != spec.name => {
                    return Err(BodyError::Invalid(format!(
                        "metadata.name {n:?} and spec.name {:?} differ",
                        spec.name
                    )));
                }
                _ => {}
            }
            spec
        } else {
            serde_json::from_value(v).map_err(|e| BodyError::Json(e.to_string()))?
        };
        for field in [
            &mut t.pre_run,
            &mut t.image,
            &mut t.service_address,
            &mut t.left,
            &mut t.right,
            &mut t.schedule,
        ] {
            if field.as_deref() == Some("") {
                *field = None;
            }
        }
        Ok(t)
    }
}

pub use crate::timing::{last_firing, next_firing, parse_schedule};

/// The occurrence template `name` should fire for at `now_ms`, if any: the latest one at or
/// before now that is newer than what it last fired for (so a restart after missed occurrences
/// fires once, for the latest, and never again for one already fired).
pub fn decide_fire(state: &State, name: &str, now_ms: u64) -> Option<(TemplateSpec, u64)> {
    let t = state.functions.templates.get(name)?;
    let schedule = t.spec.schedule.as_deref()?;
    let fired = state.functions.fired.get(name).copied().unwrap_or(u64::MAX);
    let at = last_firing(schedule, now_ms)?;
    (at > fired).then(|| (t.spec.clone(), at))
}

/// The instance a cron firing starts: its id is derived from the template and the occurrence,
/// so deciding the same firing again is the same instance (and the same first call).
pub fn firing_instance_id(name: &str, scheduled_at_ms: u64) -> String {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(name.as_bytes());
    // The occurrence's time in bytes 0-5 (48 bits of ms, as a v7 id) and the template's hash in
    // 7-13, around the version and variant bits; bytes 14-15 stay free for the step's number
    // (`step_call_id`), so no two firings' steps share a call id.
    let at = scheduled_at_ms.to_be_bytes();
    let hash = h.finish().to_be_bytes();
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&at[2..]);
    b[6] = 0x80 | (hash[0] & 0x0f);
    b[7] = hash[1];
    b[8] = 0x80 | (hash[2] & 0x3f);
    b[9..14].copy_from_slice(&hash[3..8]);
    uuid::Uuid::from_bytes(b).hyphenated().to_string()
}

pub use crate::ids::check_name;

/// Every rule a template must keep.
pub fn validate(t: &TemplateSpec) -> Result<(), String> {
    if RESERVED.contains(&t.name.as_str()) {
        return Err(format!("{:?} is a reserved name", t.name));
    }
    check_name("template name", &t.name)?;
    for (branch, next) in [("left", &t.left), ("right", &t.right)] {
        if let Some(n) = next
            && n != "RETURN"
        {
            check_name(branch, n)?;
        }
    }
    if !(t.min_instances <= t.init_instances && t.init_instances <= t.max_instances) {
        return Err(format!(
            "instance numbers must keep min <= init <= max; got min {}, init {}, max {}",
            t.min_instances, t.init_instances, t.max_instances
        ));
    }
    let how = [
        !t.command.is_empty(),
        t.image.is_some(),
        t.service_address.is_some(),
    ];
    if !how.contains(&true) {
        return Err("a template needs command, image or serviceAddress".into());
    }
    if let Some(a) = &t.service_address {
        service_of(a)?;
    }
    if let Some(i) = &t.image
        && (i.is_empty()
            || i.len() > 1_024
            || i.chars().any(|c| c.is_whitespace() || c.is_control()))
    {
        return Err(format!(
            "image {i:?} is not an image reference (1 to 1024 characters, no spaces)"
        ));
    }
    if t.command.first().is_some_and(|c| c.is_empty()) {
        return Err("command's program is empty".into());
    }
    if t.timeout_ms == 0 {
        return Err("timeoutMs must be above 0".into());
    }
    if t.concurrency == 0 {
        return Err("concurrency must be at least 1".into());
    }
    if let Some(s) = &t.schedule {
        parse_schedule(s)?;
    }
    Ok(())
}

/// Why a template decision was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// Creating one that exists.
    Exists(String),
    /// Deleting or reading one that does not.
    Unknown(String),
    /// Its host belongs to another route.
    Taken(String),
}

/// The events of upserting a template: the template, and its route (added, replaced, or
/// removed when it no longer runs on ebb). Refused if its host belongs to another route.
fn upsert(state: &State, spec: TemplateSpec) -> Result<Vec<Event>, Refused> {
    let mut events = Vec::new();
    let route_name = workload_of(&spec.name);
    match route_of(&spec) {
        Some(route) => {
            for d in &route.domains {
                if let Some(owner) = state.routes.by_domain.get(d)
                    && owner != &route.name
                {
                    return Err(Refused::Taken(format!(
                        "host {d:?} belongs to route {owner:?}"
                    )));
                }
            }
            if state.routes.by_name.get(&route.name).map(|r| &r.spec) != Some(&route) {
                events.push(Event::RouteUpserted {
                    route: Box::new(route),
                });
            }
        }
        None if state.routes.by_name.contains_key(&route_name) => {
            events.push(Event::RouteRemoved { name: route_name });
        }
        None => {}
    }
    events.insert(
        0,
        Event::TemplateUpserted {
            template: Box::new(spec),
        },
    );
    Ok(events)
}

/// A new template's counter starts at what its `initInstanceNum` instances are for, so they
/// start with the autoscaler's next period and stay while the counter decays.
fn seed(spec: &TemplateSpec, a: &Autoscale) -> Option<Event> {
    let by = u64::from(spec.init_instances)
        .saturating_mul(a.target_per_instance)
        .min(a.cap);
    (by > 0).then(|| Event::CounterAdded {
        function: spec.name.clone(),
        by,
        cap: a.cap,
    })
}

/// Creating a template: refused if one has that name.
pub fn decide_create(
    state: &State,
    spec: TemplateSpec,
    a: &Autoscale,
) -> Result<Vec<Event>, Refused> {
    if state.functions.templates.contains_key(&spec.name) {
        return Err(Refused::Exists(spec.name));
    }
    let seed = seed(&spec, a);
    let mut events = upsert(state, spec)?;
    events.extend(seed);
    Ok(events)
}

/// Creating or replacing a template: the events, and whether it is new. Replacing it with the
/// same spec changes nothing and logs nothing.
pub fn decide_put(
    state: &State,
    spec: TemplateSpec,
    a: &Autoscale,
) -> Result<(Vec<Event>, bool), Refused> {
    match state.functions.templates.get(&spec.name) {
        Some(t) if t.spec == spec => Ok((Vec::new(), false)),
        Some(_) => Ok((upsert(state, spec)?, false)),
        None => Ok((decide_create(state, spec, a)?, true)),
    }
}

/// Deleting a template (and its route): refused if there is none.
pub fn decide_delete(state: &State, name: &str) -> Result<Vec<Event>, Refused> {
    if !state.functions.templates.contains_key(name) {
        return Err(Refused::Unknown(name.to_owned()));
    }
    let mut events = vec![Event::TemplateDeleted {
        name: name.to_owned(),
    }];
    let route = workload_of(name);
    if state.routes.by_name.contains_key(&route) {
        events.push(Event::RouteRemoved {
            name: route.clone(),
        });
    }
    // Its workload stops and its counter empties, so a template created again with this name
    // starts afresh.
    let desired = state
        .routes
        .deployments
        .get(&route)
        .map_or(0, |d| d.desired);
    if desired > 0 {
        events.push(Event::ScaleRequested {
            deployment: route,
            from: desired,
            to: 0,
            reason: crate::event::ScaleReason::Manual,
        });
    }
    let value = state.counters.value(name);
    if value > 0 {
        events.push(Event::CounterDecayed {
            function: name.to_owned(),
            by: value,
        });
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cluster_status_sums_the_live_shares_of_every_replica() {
        let share = |counter, last_added_ms, at_ms| ReplicaCount {
            counter,
            last_added_ms,
            at_ms,
        };
        let local = FuncStatus {
            counter: 4,
            time_stamp: kube_time(1_000),
            replicas: 2,
            by_replica: BTreeMap::new(),
        };
        let mine = share(4, 1_000, 100_000);
        let shares: BTreeMap<String, ReplicaCount> = [
            // Its own share as the resource has it: the live one counts instead.
            ("ebb-0".to_owned(), share(9, 500, 99_000)),
            ("ebb-1".to_owned(), share(30, 90_000, 99_500)),
            ("ebb-2".to_owned(), share(0, 2_000, 10_000)),
            // Not refreshed for longer than the bound: a replica gone.
            ("ebb-3".to_owned(), share(500, 95_000, 60_000)),
        ]
        .into();
        let s = cluster_status(&local, &mine, "ebb-0", &shares, 100_000, 30_000);
        assert_eq!(s.counter, 34);
        assert_eq!(s.time_stamp, kube_time(90_000));
        assert_eq!(s.replicas, 2);
        assert!(
            s.by_replica.is_empty(),
            "the lease holder never writes the shares"
        );
        // Alone, the status is its own.
        let alone = cluster_status(&local, &mine, "ebb-0", &BTreeMap::new(), 100_000, 30_000);
        assert_eq!(alone, local);
    }

    #[test]
    fn a_body_is_the_seeds_object_or_its_spec_alone() {
        let flat = TemplateJson::from_body(br#"{"name":"a","function":"f","left":""}"#).unwrap();
        assert_eq!((flat.name.as_str(), flat.left), ("a", None));
        // The name may come from the metadata alone.
        let o = TemplateJson::from_body(
            br#"{"kind":"Func","metadata":{"name":"b","uid":"x"},"spec":{"function":"f","preRun":""}}"#,
        )
        .unwrap();
        assert_eq!((o.name.as_str(), o.pre_run), ("b", None));
        assert!(matches!(
            TemplateJson::from_body(br#"{"kind":"Func","spec":{"name":"c","nope":1}}"#),
            Err(BodyError::Json(e)) if e.contains("nope")
        ));
        assert!(matches!(
            TemplateJson::from_body(br#"["not", "an", "object"]"#),
            Err(BodyError::Json(_))
        ));
    }

    #[test]
    fn a_templates_traffic_policy_reaches_its_route_and_a_bad_one_is_refused() {
        let t = TemplateJson::from_body(
            br#"{"name":"a","command":["ebb","example-app"],"trafficPolicy":{"balancer":"least_request"}}"#,
        )
        .unwrap();
        let spec = t.clone().into_spec().unwrap();
        assert_eq!(
            spec.policy.balancer,
            crate::discovery::Balancer::LeastRequest
        );
        assert_eq!(
            TemplateJson::from_spec(&spec).traffic_policy,
            t.traffic_policy
        );
        assert!(
            TemplateJson::from_spec(&good().into_spec().unwrap())
                .traffic_policy
                .is_none()
        );
        let bad = TemplateJson::from_body(
            br#"{"name":"a","command":["x"],"trafficPolicy":{"balancer":"consistent_hash"}}"#,
        )
        .unwrap();
        assert!(bad.into_spec().unwrap_err().contains("hash_on"));
        assert!(matches!(
            TemplateJson::from_body(br#"{"name":"a","trafficPolicy":{"balancer":"fastest"}}"#),
            Err(BodyError::Json(_))
        ));
    }

    #[test]
    fn a_templates_keep_warm_windows_reach_its_route_and_bad_ones_are_refused() {
        let t = TemplateJson::from_body(
            br#"{"name":"a","command":["ebb","example-app"],"maxInstanceNum":2,
                "warm":[{"schedule":"0 8 * * 1-5","for":"10h","min":2,"timezone":"Europe/Paris"}]}"#,
        )
        .unwrap();
        let spec = t.clone().into_spec().unwrap();
        let route = route_of(&spec).unwrap();
        assert_eq!(route.warm.len(), 1);
        assert_eq!(
            (route.warm[0].for_ms, route.warm[0].min),
            (10 * 3_600_000, 2)
        );
        assert_eq!(TemplateJson::from_spec(&spec).warm, t.warm);
        let over = TemplateJson::from_body(
            br#"{"name":"a","command":["x"],"warm":[{"schedule":"0 8 * * *","for":"1h","min":3}]}"#,
        )
        .unwrap();
        assert!(over.into_spec().unwrap_err().contains("max_replicas (1)"));
        assert!(matches!(
            TemplateJson::from_body(br#"{"name":"a","warm":[{"schedule":"0 8 * * *"}]}"#),
            Err(BodyError::Json(_))
        ));
    }

    fn good() -> TemplateJson {
        TemplateJson {
            name: "resize".into(),
            command: vec!["ebb".into(), "example-app".into()],
            ..TemplateJson::default()
        }
    }

    fn apply(state: &mut State, events: Vec<Event>, at_ms: u64) {
        for event in events {
            let seq = state.seq + 1;
            state.apply(&crate::event::Envelope {
                seq,
                at_ms,
                version: crate::event::SCHEMA_VERSION,
                event,
            });
        }
    }

    #[test]
    fn the_autoscaler_keeps_bounds_aggregates_and_goes_to_zero_after_silence() {
        let a = Autoscale {
            period_ms: 100,
            decay: 3,
            cap: 50,
            target_per_instance: 5,
            zero_after_ms: 1_000,
        };
        let mut state = State::default();
        let spec = TemplateJson {
            init_instance_num: 2,
            max_instance_num: Some(4),
            ..good()
        }
        .into_spec()
        .unwrap();
        let created = decide_create(&state, spec, &a).unwrap();
        // The init instances' worth is seeded into the counter.
        assert!(created.contains(&Event::CounterAdded {
            function: "resize".into(),
            by: 10,
            cap: 50
        }));
        apply(&mut state, created, 0);
        let mut now = 0;
        let mut desired = Vec::new();
        for by in [
            0, 7, 200, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ] {
            now += a.period_ms;
            let added = std::collections::BTreeMap::from([("resize".to_owned(), by)]);
            let (events, scales) = decide_autoscale(&state, &added, &a, now, false);
            let counter_events = events
                .iter()
                .filter(|e| matches!(e, Event::CounterAdded { .. } | Event::CounterDecayed { .. }))
                .count();
            assert!(counter_events <= 2, "{events:?}");
            for (deployment, n) in &scales {
                assert_eq!(deployment, "fn-resize");
                assert!(*n <= 4, "{n} is past the max");
            }
            apply(&mut state, events, now);
            desired.push(
                state
                    .routes
                    .deployments
                    .get("fn-resize")
                    .map_or(0, |d| d.desired),
            );
            assert!(state.counters.value("resize") <= a.cap);
        }
        assert_eq!(desired[0], 2, "{desired:?}");
        assert!(desired.contains(&4), "{desired:?}");
        assert_eq!(*desired.last().unwrap(), 0, "{desired:?}");
    }

    /// Cron firings under a simulated clock: on schedule, once per occurrence, and after a
    /// "restart" (a fresh projection from the same events) with missed occurrences, only the
    /// latest fires, once.
    #[test]
    fn cron_fires_each_occurrence_once_and_only_the_latest_missed_one_after_a_restart() {
        let t0: u64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z
        let spec = TemplateJson {
            schedule: Some("*/10 * * * * *".into()),
            ..good()
        }
        .into_spec()
        .unwrap();
        let mut state = State::default();
        let mut log: Vec<(Vec<Event>, u64)> = Vec::new();
        let mut step = |state: &mut State, events: Vec<Event>, at: u64| {
            log.push((events.clone(), at));
            apply(state, events, at);
        };
        step(
            &mut state,
            vec![Event::TemplateUpserted {
                template: Box::new(spec),
            }],
            t0 + 1,
        );
        assert_eq!(
            state
                .schedule
                .get(&crate::state::Due::TemplateFire("resize".into())),
            Some(t0 + 10_000)
        );
        assert_eq!(decide_fire(&state, "resize", t0 + 5_000), None);
        let (_, at) = decide_fire(&state, "resize", t0 + 10_200).unwrap();
        assert_eq!(at, t0 + 10_000);
        let fired = |at| Event::TemplateFired {
            name: "resize".into(),
            scheduled_at_ms: at,
        };
        step(&mut state, vec![fired(at)], t0 + 10_200);
        assert_eq!(decide_fire(&state, "resize", t0 + 15_000), None);
        assert_eq!(
            state
                .schedule
                .get(&crate::state::Due::TemplateFire("resize".into())),
            Some(t0 + 20_000)
        );
        // ebb is down from 12 s to 65 s: 20, 30, 40, 50 and 60 are missed.
        let mut restarted = State::default();
        for (events, at) in &log {
            apply(&mut restarted, events.clone(), *at);
        }
        assert_eq!(restarted, state);
        let (_, at) = decide_fire(&restarted, "resize", t0 + 65_000).unwrap();
        assert_eq!(at, t0 + 60_000, "only the latest missed occurrence fires");
        apply(&mut restarted, vec![fired(at)], t0 + 65_000);
        assert_eq!(decide_fire(&restarted, "resize", t0 + 65_000), None);
        assert_eq!(decide_fire(&restarted, "resize", t0 + 69_999), None);
        assert_eq!(
            decide_fire(&restarted, "resize", t0 + 70_000).map(|f| f.1),
            Some(t0 + 70_000)
        );
        // The same firing always starts the same instance.
        assert_eq!(
            firing_instance_id("resize", at),
            firing_instance_id("resize", at)
        );
        let mut calls = std::collections::BTreeSet::new();
        for k in 0..200u64 {
            let id = firing_instance_id("resize", t0 + k * 1_000);
            for step in 1..4 {
                assert!(calls.insert(step_call_id(&id, step)), "{id} step {step}");
            }
        }
        assert_ne!(
            firing_instance_id("resize", at),
            firing_instance_id("other", at)
        );
        // A bad schedule is refused.
        let bad = TemplateJson {
            schedule: Some("every tuesday".into()),
            ..good()
        };
        assert!(bad.into_spec().unwrap_err().contains("cron"));
    }

    #[test]
    fn defaults_fill_in_and_round_trip() {
        let spec = good().into_spec().unwrap();
        assert_eq!(
            (spec.max_instances, spec.timeout_ms, spec.concurrency),
            (1, DEFAULT_TIMEOUT_MS, 1)
        );
        let back = TemplateJson::from_spec(&spec).into_spec().unwrap();
        assert_eq!(back, spec);
        let mut j = good();
        j.init_instance_num = 3;
        assert_eq!(j.into_spec().unwrap().max_instances, 3);
    }

    #[test]
    fn every_rule_has_a_clear_refusal() {
        let cases: Vec<(TemplateJson, &str)> = vec![
            (
                TemplateJson {
                    name: "Bad_Name".into(),
                    ..good()
                },
                "not a valid name",
            ),
            (
                TemplateJson {
                    name: "template".into(),
                    ..good()
                },
                "reserved",
            ),
            (
                TemplateJson {
                    name: "RETURN".into(),
                    ..good()
                },
                "reserved",
            ),
            (
                TemplateJson {
                    min_instance_num: 2,
                    init_instance_num: 1,
                    max_instance_num: Some(3),
                    ..good()
                },
                "min <= init <= max",
            ),
            (
                TemplateJson {
                    init_instance_num: 4,
                    max_instance_num: Some(3),
                    ..good()
                },
                "min <= init <= max",
            ),
            (
                TemplateJson {
                    max_instance_num: Some(0),
                    ..good()
                },
                "at least 1",
            ),
            (
                TemplateJson {
                    command: vec![],
                    ..good()
                },
                "command, image or serviceAddress",
            ),
            (
                TemplateJson {
                    left: Some("Not OK".into()),
                    ..good()
                },
                "left",
            ),
            (
                TemplateJson {
                    service_address: Some("ftp://files.example".into()),
                    ..good()
                },
                "is not one of http, k8s, k8s-env",
            ),
            (
                TemplateJson {
                    service_address: Some("k8s://no-namespace".into()),
                    ..good()
                },
                "k8s://[MEMBER.]SERVICE.NAMESPACE",
            ),
            (
                TemplateJson {
                    concurrency: Some(0),
                    ..good()
                },
                "concurrency",
            ),
        ];
        for (j, want) in cases {
            let err = j.clone().into_spec().unwrap_err();
            assert!(err.contains(want), "{j:?}: {err:?} should say {want:?}");
        }
        for address in ["fn.example:8080", "http://fn.example", "k8s://fn.prod:80"] {
            let ok = TemplateJson {
                right: Some("RETURN".into()),
                service_address: Some(address.into()),
                ..good()
            };
            assert!(ok.into_spec().is_ok(), "{address}");
        }
    }
}
