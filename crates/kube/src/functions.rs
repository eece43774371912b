//! Function templates with an `image`, on Kubernetes: each becomes the Deployment `fn-NAME` and
//! the Service `fn-NAME` in the functions namespace, made, kept and removed by ebb, and scaled by
//! the function autoscaler (and woken by the proxy) like any workload of the backend.
//!
//! * **Made** with server-side apply (field manager `ebb`, forced), from the template as the log
//!   has it ([`objects`]): the image, the template's `command` as the container's command, its
//!   `preRun` as an init container (`sh -c`), `PORT`, `EBB_FUNCTION`, `EBB_TEMPLATE` and
//!   `POD_IP` in the environment, a TCP readiness probe on the port `http` (8080), a grace period
//!   that lets a running step end. Replicas are what the log asks, so applying never undoes a
//!   scale. A template changed in the log is applied again (its pods roll).
//! * **Owned**: labelled `app.kubernetes.io/managed-by=ebb` and `ebb.dev/function=NAME`,
//!   annotated `ebb.dev/owner` with the ebb replica that made them; when that replica is a pod of
//!   a StatefulSet in the same namespace (`deploy/`), the StatefulSet is their owner
//!   (`ownerReferences`), so the garbage collector removes them with ebb.
//! * **Never taken over**: an object of that name that is not a function's (a user's Deployment
//!   `fn-x`) is left alone; a Warning Event on it says why, and the function does not run.
//! * **Removed** when the template is deleted, and, when ebb starts, for every template deleted
//!   while it was away (functions this replica made, by the owner annotation): deleted with the
//!   UID read as a precondition, so a newer object of the same name is never removed.
//!
//! The loop (joined by `kube::run`) is woken by `TemplateUpserted` and `TemplateDeleted` on the
//! log's tail, and every 5 s while something failed. Each function's workload is tracked
//! (`KubeOrchestrator::track_function`; the route loop leaves function workloads alone). On
//! Kubernetes the function autoscaler only raises replicas (each ebb replica counts only its own
//! calls); lowering them is left to idleness.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ObjectReference, Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::events::EventType;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::event::{Event, TemplateSpec};
use crate::log::Log;
use crate::orchestrator::{Complaints, KubeOrchestrator};
use crate::state::State;
use ebb_core::functions::workload_of;
use ebb_core::orchestrator::annotations::{Workload, WorkloadKind};

/// The label naming the function whose Deployment, Service and pods an object is.
pub const FUNCTION_LABEL: &str = "ebb.dev/function";
/// The annotation naming the ebb replica that made a function's objects.
pub const OWNER_ANNOTATION: &str = "ebb.dev/owner";
/// The field manager of ebb's server-side applies.
pub const FIELD_MANAGER: &str = "ebb";
/// The container port a function server listens on (`$PORT`), and its name.
pub const PORT: i32 = 8080;
pub use crate::orchestrator::PORT_NAME;
/// How often failed applies and deletions are tried again.
const RETRY_EVERY: Duration = Duration::from_secs(5);

/// The Deployment and the Service that run template `t` in `namespace` with `replicas` replicas,
/// made by the ebb replica `instance`, owned by `owner` if any, as server-side apply bodies.
pub fn objects(
    t: &TemplateSpec,
    namespace: &str,
    instance: &str,
    replicas: u32,
    owner: Option<&OwnerReference>,
) -> (Value, Value) {
    let name = workload_of(&t.name);
    let mut metadata = json!({
        "name": name,
        "namespace": namespace,
        "labels": {
            "app.kubernetes.io/managed-by": "ebb",
            "app.kubernetes.io/name": name,
            FUNCTION_LABEL: t.name,
        },
        "annotations": { OWNER_ANNOTATION: instance },
    });
    if let Some(o) = owner {
        metadata["ownerReferences"] = json!([o]);
    }
    let image = t.image.clone().unwrap_or_default();
    let mut container = json!({
        "name": "function",
        "image": image,
        "env": [
            { "name": "PORT", "value": PORT.to_string() },
            { "name": "EBB_FUNCTION", "value": t.function },
            { "name": "EBB_TEMPLATE", "value": t.name },
            { "name": "POD_IP", "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } } },
        ],
        "ports": [{ "name": PORT_NAME, "containerPort": PORT, "protocol": "TCP" }],
        "readinessProbe": {
            "tcpSocket": { "port": PORT_NAME },
            "periodSeconds": 1,
        },
    });
    if !t.command.is_empty() {
        container["command"] = json!(t.command);
    }
    // A step running when its pod is asked to stop may end: its timeout, and a little more.
    let grace = (t.timeout_ms.div_ceil(1_000) + 5).min(3_600);
    let mut pod = json!({
        "terminationGracePeriodSeconds": grace,
        "containers": [container],
    });
    if let Some(pre) = &t.pre_run {
        pod["initContainers"] = json!([{
            "name": "pre-run",
            "image": image,
            "command": ["sh", "-c", pre],
        }]);
    }
    let deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { FUNCTION_LABEL: t.name } },
            "template": {
                "metadata": { "labels": { FUNCTION_LABEL: t.name } },
                "spec": pod,
            },
        },
    });
    let service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "selector": { FUNCTION_LABEL: t.name },
            "ports": [{
                "name": PORT_NAME,
                "port": 80,
                "targetPort": PORT_NAME,
                "protocol": "TCP",
            }],
        },
    });
    (deployment, service)
}

/// Whether `meta` is the function `template`'s (labelled so by ebb).
fn is_function(meta: &kube::api::ObjectMeta, template: &str) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(FUNCTION_LABEL))
        .is_some_and(|v| v == template)
}

/// The ebb pod's controller (its StatefulSet), when it runs in the functions namespace: the
/// owner of the functions' objects. Outside a cluster, or without one, there is none.
async fn owner(orch: &KubeOrchestrator) -> Option<OwnerReference> {
    let o = &orch.options;
    if o.shared.lease_namespace != o.functions_namespace {
        return None;
    }
    let pods: Api<Pod> = Api::namespaced(orch.client.clone(), &o.shared.lease_namespace);
    orch.limiter.acquire().await;
    match crate::coordinator::pod_controller(&pods, &o.instance).await {
        Ok(owner) => owner,
        Err(e) => {
            tracing::warn!(pod = %o.instance, error = %e, "cannot read ebb's own pod; image functions get no owner");
            None
        }
    }
}

/// An image template as the loop applies it.
#[derive(Debug, Clone)]
struct Wanted {
    spec: TemplateSpec,
    revision: u64,
    replicas: u32,
}

/// The image templates in the log, with the replicas the log asks for them.
fn wanted(s: &State) -> BTreeMap<String, Wanted> {
    s.functions
        .templates
        .values()
        .filter(|t| t.spec.image.is_some())
        .map(|t| {
            let replicas = s
                .routes
                .deployments
                .get(&workload_of(&t.spec.name))
                .map_or(0, |d| d.desired);
            (
                t.spec.name.clone(),
                Wanted {
                    spec: t.spec.clone(),
                    revision: t.revision,
                    replicas,
                },
            )
        })
        .collect()
}

struct Functions {
    orch: Arc<KubeOrchestrator>,
    namespace: String,
    deployments: Api<Deployment>,
    services: Api<Service>,
    owner: Option<OwnerReference>,
    /// The revision of each template applied.
    applied: HashMap<String, u64>,
    /// Names whose objects another owner has, with the problem last reported.
    taken: HashMap<String, String>,
    /// Functions whose objects are still to be deleted.
    gone: HashSet<String>,
    complaints: Complaints,
}

impl Functions {
    /// The object of `template`'s name in `api`, if any.
    async fn get<K>(&self, api: &Api<K>, template: &str) -> kube::Result<Option<K>>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        self.orch.limiter.acquire().await;
        api.get_opt(&workload_of(template)).await
    }

    /// The object of `template`'s name in `api` that is someone else's, if any.
    async fn foreign_in<K>(
        &self,
        api: &Api<K>,
        template: &str,
    ) -> kube::Result<Option<ObjectReference>>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        Ok(self
            .get(api, template)
            .await?
            .filter(|o| !is_function(o.meta(), template))
            .map(|o| o.object_ref(&())))
    }

    /// Why the objects of `template` may not be made: one of that name is someone else's.
    async fn foreign(&self, template: &str) -> kube::Result<Option<ObjectReference>> {
        match self.foreign_in(&self.deployments, template).await? {
            Some(other) => Ok(Some(other)),
            None => self.foreign_in(&self.services, template).await,
        }
    }

    /// Makes or updates a function's Deployment and Service; whether they are the function's now.
    async fn apply(&mut self, w: &Wanted) -> kube::Result<bool> {
        let template = &w.spec.name;
        if !self.applied.contains_key(template)
            && let Some(other) = self.foreign(template).await?
        {
            let problem = format!(
                "function {template:?} needs the {} {:?}, and one of that name is not ebb's: the function does not run until it is renamed or removed",
                other.kind.as_deref().unwrap_or("object"),
                workload_of(template),
            );
            if self.taken.get(template) != Some(&problem) {
                tracing::warn!(function = %template, %problem, "an image function cannot be made");
                self.orch
                    .publish(
                        &other,
                        EventType::Warning,
                        "FunctionConflict",
                        problem.clone(),
                    )
                    .await;
                self.taken.insert(template.clone(), problem);
            }
            return Ok(false);
        }
        self.taken.remove(template);
        let (deployment, service) = objects(
            &w.spec,
            &self.namespace,
            &self.orch.options.instance,
            w.replicas,
            self.owner.as_ref(),
        );
        let name = workload_of(template);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        self.orch.limiter.acquire().await;
        self.services
            .patch(&name, &params, &Patch::Apply(&service))
            .await?;
        self.orch.limiter.acquire().await;
        self.deployments
            .patch(&name, &params, &Patch::Apply(&deployment))
            .await?;
        tracing::info!(function = %template, namespace = %self.namespace, revision = w.revision, "image function's Deployment and Service applied");
        Ok(true)
    }

    /// Deletes the object of `template`'s name in `api` if it is still the function's (the UID
    /// read).
    async fn remove_in<K>(&self, api: &Api<K>, template: &str) -> kube::Result<()>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let Some(o) = self.get(api, template).await? else {
            return Ok(());
        };
        if !is_function(o.meta(), template) {
            return Ok(());
        }
        self.orch.limiter.acquire().await;
        let deleted = api
            .delete(&workload_of(template), &guarded(o.meta().uid.clone()))
            .await;
        ignore_gone(deleted.map(|_| ()))
    }

    /// Deletes a function's Deployment and Service.
    async fn remove(&self, template: &str) -> kube::Result<()> {
        self.remove_in(&self.deployments, template).await?;
        self.remove_in(&self.services, template).await?;
        tracing::info!(function = %template, "image function's Deployment and Service deleted");
        Ok(())
    }

    /// The functions this replica made whose templates are gone (deleted while it was away).
    async fn orphans(&self, wanted: &BTreeMap<String, Wanted>) -> kube::Result<Vec<String>> {
        self.orch.limiter.acquire().await;
        let list = self
            .deployments
            .list(&ListParams::default().labels(FUNCTION_LABEL))
            .await?;
        Ok(list
            .items
            .into_iter()
            .filter(|d| {
                d.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(OWNER_ANNOTATION))
                    == Some(&self.orch.options.instance)
            })
            .filter_map(|d| d.metadata.labels?.get(FUNCTION_LABEL).cloned())
            .filter(|f| !wanted.contains_key(f))
            .collect())
    }

    /// One pass: every image template's objects applied at its revision, those of templates
    /// gone deleted, the workloads tracked; whether all of it worked.
    async fn reconcile(&mut self, log: &Log) -> bool {
        let wanted = log.read(wanted);
        let mut ok = true;
        for (name, w) in &wanted {
            self.gone.remove(name);
            if self.applied.get(name) == Some(&w.revision) {
                continue;
            }
            match self.apply(w).await {
                Ok(true) => {
                    self.complaints.worked(&format!("applying function {name}"));
                    self.applied.insert(name.clone(), w.revision);
                    self.orch.track_function(&Workload {
                        kind: WorkloadKind::Deployment,
                        namespace: self.namespace.clone(),
                        name: workload_of(name),
                    });
                }
                Ok(false) => {}
                Err(e) => {
                    ok = false;
                    self.complaints
                        .failed(&format!("applying function {name}"), &e);
                }
            }
        }
        for name in self.applied.keys() {
            if !wanted.contains_key(name) {
                self.gone.insert(name.clone());
            }
        }
        self.applied.retain(|n, _| wanted.contains_key(n));
        self.taken.retain(|n, _| wanted.contains_key(n));
        for name in self.gone.clone() {
            match self.remove(&name).await {
                Ok(()) => {
                    self.gone.remove(&name);
                    self.complaints.worked(&format!("deleting function {name}"));
                }
                Err(e) => {
                    ok = false;
                    self.complaints
                        .failed(&format!("deleting function {name}"), &e);
                }
            }
        }
        let keep = self
            .applied
            .keys()
            .map(|n| workload_of(n))
            .collect::<HashSet<_>>();
        self.orch.retain(&keep, true);
        ok
    }
}

/// A delete of the object with `uid` only.
fn guarded(uid: Option<String>) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::background()
    }
}

/// A delete of an object already gone (404) or replaced (409: the UID precondition) worked.
fn ignore_gone(r: kube::Result<()>) -> kube::Result<()> {
    match r {
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        r => r,
    }
}

/// Keeps the image functions' objects as the log's templates say until `stop`: at once, on every
/// template change, and every few seconds while something failed.
pub async fn run(log: Arc<Log>, orch: Arc<KubeOrchestrator>, mut stop: watch::Receiver<bool>) {
    let namespace = orch.options.functions_namespace.clone();
    let mut f = Functions {
        deployments: Api::namespaced(orch.client.clone(), &namespace),
        services: Api::namespaced(orch.client.clone(), &namespace),
        owner: owner(&orch).await,
        namespace,
        orch,
        applied: HashMap::new(),
        taken: HashMap::new(),
        gone: HashSet::new(),
        complaints: Complaints::default(),
    };
    let mut tail = log.subscribe();
    let mut retry = tokio::time::interval(RETRY_EVERY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut swept = false;
    let mut ok = false;
    loop {
        if !swept {
            let wanted = log.read(wanted);
            match f.orphans(&wanted).await {
                Ok(orphans) => {
                    f.gone.extend(orphans);
                    swept = true;
                    f.complaints.worked("listing image functions");
                }
                // Not allowed to (deploy/ grants it in ebb's own namespace only): this ebb
                // runs no image functions there, and has none to clean up.
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    tracing::warn!(namespace = %f.namespace, error = %s.message, "image functions cannot be listed: functions deleted while ebb was away are not cleaned up");
                    swept = true;
                }
                Err(e) => f.complaints.failed("listing image functions", &e),
            }
        }
        if !ok || !f.gone.is_empty() {
            ok = f.reconcile(&log).await && swept;
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = retry.tick() => {}
            batch = tail.recv() => match batch {
                Ok(batch) => {
                    if batch.iter().any(|e| matches!(
                        e.event,
                        Event::TemplateUpserted { .. } | Event::TemplateDeleted { .. }
                    )) {
                        ok = false;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => ok = false,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> TemplateSpec {
        ebb_core::functions::TemplateJson {
            name: "resize".into(),
            function: "thumb".into(),
            image: Some("registry.example/resize:1".into()),
            pre_run: Some("echo ready".into()),
            command: vec!["server".into(), "--fast".into()],
            timeout_ms: Some(12_500),
            ..Default::default()
        }
        .into_spec()
        .unwrap()
    }

    #[test]
    fn a_template_becomes_a_deployment_and_a_service_of_its_function() {
        let owner = OwnerReference {
            api_version: "apps/v1".into(),
            kind: "StatefulSet".into(),
            name: "ebb".into(),
            uid: "u-1".into(),
            ..OwnerReference::default()
        };
        let (d, s) = objects(&template(), "fns", "ebb-0", 3, Some(&owner));
        let d: Deployment = serde_json::from_value(d).unwrap();
        let s: Service = serde_json::from_value(s).unwrap();
        for meta in [&d.metadata, &s.metadata] {
            assert_eq!(meta.name.as_deref(), Some("fn-resize"));
            assert_eq!(meta.namespace.as_deref(), Some("fns"));
            assert!(is_function(meta, "resize"));
            assert!(!is_function(meta, "other"));
            assert_eq!(meta.owner_references.as_deref(), Some(&[owner.clone()][..]));
            assert_eq!(
                meta.annotations.as_ref().unwrap()[OWNER_ANNOTATION],
                "ebb-0"
            );
        }
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(3));
        let pod = spec.template.spec.unwrap();
        let c = &pod.containers[0];
        assert_eq!(c.image.as_deref(), Some("registry.example/resize:1"));
        assert_eq!(
            c.command.as_deref(),
            Some(&["server".to_owned(), "--fast".to_owned()][..])
        );
        let env: Vec<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
        assert_eq!(env, ["PORT", "EBB_FUNCTION", "EBB_TEMPLATE", "POD_IP"]);
        assert!(c.readiness_probe.as_ref().unwrap().tcp_socket.is_some());
        assert_eq!(pod.termination_grace_period_seconds, Some(18));
        let init = &pod.init_containers.unwrap()[0];
        assert_eq!(
            init.command.as_deref(),
            Some(&["sh".to_owned(), "-c".to_owned(), "echo ready".to_owned()][..])
        );
        // The Service selects the pods the Deployment makes, on the named port.
        let selector = s.spec.as_ref().unwrap().selector.clone().unwrap();
        assert_eq!(
            Some(&selector),
            spec.template.metadata.unwrap().labels.as_ref()
        );
        let port = &s.spec.unwrap().ports.unwrap()[0];
        assert_eq!(port.name.as_deref(), Some(PORT_NAME));
    }

    #[test]
    fn no_command_keeps_the_images_entrypoint_and_no_owner_none_is_written() {
        let mut t = template();
        t.command.clear();
        t.pre_run = None;
        let (d, _) = objects(&t, "fns", "ebb-0", 0, None);
        assert!(
            d["spec"]["template"]["spec"]["containers"][0]
                .get("command")
                .is_none()
        );
        assert!(
            d["spec"]["template"]["spec"]
                .get("initContainers")
                .is_none()
        );
        assert!(d["metadata"].get("ownerReferences").is_none());
        assert_eq!(d["spec"]["replicas"], 0);
    }
}
