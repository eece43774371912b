//! [`Coordinator`] against the Kubernetes API server: what several ebb replicas share.
//!
//! * A deployment's `replicas` is its `/scale` subresource; a scale-down is a merge patch of
//!   `/scale` carrying the `resourceVersion` its decision read, so the API server refuses it
//!   with 409 Conflict when the object moved meanwhile (a bump, another scale).
//! * Its last use is the annotation `ebb.dev/last-used` (Unix ms) on the Deployment or
//!   StatefulSet, raised with a patch conditioned on the `resourceVersion` read, re-read and
//!   retried on a conflict, never lowered.
//! * The leadership lease is a `coordination.k8s.io/v1` Lease in ebb's namespace, written with
//!   `resourceVersion` preconditions (created when absent). `holderIdentity`, `renewTime` and
//!   `leaseDurationSeconds` are kept for people and tools; the exact end of the lease, in the
//!   holder's clock, is the annotation `ebb.dev/until-ms`.
//!
//! `resourceVersion` is opaque to clients in general; the API server's is etcd's revision, a
//! number, which is what the protocol's version needs. A non-numeric one is an error.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v1::Scale;
use k8s_openapi::api::coordination::v1::{Lease as KubeLease, LeaseSpec};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};

use crate::scaler::shared::{CoordError, Coordinator, Lease, SharedDeployment};
use ebb_core::orchestrator::annotations::{Workload, WorkloadKind};

/// The annotation holding a workload's last use (Unix ms).
pub const LAST_USED: &str = "ebb.dev/last-used";
/// The annotation holding the end of the lease (Unix ms, the holder's clock).
pub const LEASE_UNTIL: &str = "ebb.dev/until-ms";
/// Attempts at raising the annotation against concurrent writers.
const TOUCH_ATTEMPTS: u32 = 5;

/// The API server as the shared store of ebb's replicas.
#[derive(Clone)]
pub struct KubeCoordinator {
    client: kube::Client,
    /// Where the lease lives.
    lease_namespace: String,
    lease_name: String,
    lease_ms: u64,
    /// This replica's pod, whose controller (ebb's StatefulSet) owns the lease it writes, so the
    /// lease goes with ebb (`kubectl delete -k`, `helm uninstall`); read once.
    pod: String,
    owner: tokio::sync::OnceCell<Option<OwnerReference>>,
}

/// The controller of pod `name` (ebb's own pod: its StatefulSet), as an owner for the objects
/// ebb makes, which the garbage collector then removes with ebb. `None` when the pod is not
/// there (ebb outside a cluster) or has no controller.
pub async fn pod_controller(pods: &Api<Pod>, name: &str) -> kube::Result<Option<OwnerReference>> {
    let Some(pod) = pods.get_opt(name).await? else {
        return Ok(None);
    };
    Ok(pod
        .metadata
        .owner_references
        .into_iter()
        .flatten()
        .find(|r| r.controller == Some(true))
        .map(|controller| OwnerReference {
            controller: None,
            block_owner_deletion: None,
            ..controller
        }))
}

impl KubeCoordinator {
    /// A store on `client` with the lease `lease_namespace/lease_name`, held `lease_ms` at a time,
    /// written by the replica whose pod is `pod` (in `lease_namespace`).
    pub fn new(
        client: kube::Client,
        lease_namespace: &str,
        lease_name: &str,
        lease_ms: u64,
        pod: &str,
    ) -> Self {
        Self {
            client,
            lease_namespace: lease_namespace.to_owned(),
            lease_name: lease_name.to_owned(),
            lease_ms,
            pod: pod.to_owned(),
            owner: tokio::sync::OnceCell::new(),
        }
    }

    /// The lease's owner: this replica's pod's controller, read on the first write (a failed
    /// read is tried again on the next).
    async fn owner(&self) -> Option<OwnerReference> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.lease_namespace);
        self.owner
            .get_or_try_init(|| pod_controller(&pods, &self.pod))
            .await
            .ok()
            .cloned()
            .flatten()
    }

    fn leases(&self) -> Api<KubeLease> {
        Api::namespaced(self.client.clone(), &self.lease_namespace)
    }
}

fn unavailable(e: kube::Error) -> CoordError {
    match e {
        kube::Error::Api(s) if s.code == 409 => CoordError::Conflict,
        e => CoordError::Unavailable(e.to_string()),
    }
}

fn workload(key: &str) -> Result<Workload, CoordError> {
    Workload::from_key(key).ok_or_else(|| CoordError::NotFound(key.to_owned()))
}

fn version(meta: &ObjectMeta) -> Result<u64, CoordError> {
    let rv = meta.resource_version.as_deref().unwrap_or("0");
    rv.parse()
        .map_err(|_| CoordError::Unavailable(format!("resourceVersion {rv:?} is not a number")))
}

fn not_found(key: &str, e: kube::Error) -> CoordError {
    match e {
        kube::Error::Api(s) if s.code == 404 => CoordError::NotFound(key.to_owned()),
        e => unavailable(e),
    }
}

/// The API of a workload's kind: Deployments and StatefulSets alike (both have `/scale`).
pub fn workload_api(client: &kube::Client, w: &Workload) -> Api<DynamicObject> {
    let resource = match w.kind {
        WorkloadKind::Deployment => ApiResource::erase::<Deployment>(&()),
        WorkloadKind::StatefulSet => ApiResource::erase::<StatefulSet>(&()),
    };
    Api::namespaced_with(client.clone(), &w.namespace, &resource)
}

/// A workload as the object of a Kubernetes Event.
pub fn workload_reference(w: &Workload) -> ObjectReference {
    let kind = match w.kind {
        WorkloadKind::Deployment => "Deployment",
        WorkloadKind::StatefulSet => "StatefulSet",
    };
    ObjectReference {
        api_version: Some("apps/v1".to_owned()),
        kind: Some(kind.to_owned()),
        name: Some(w.name.clone()),
        namespace: Some(w.namespace.clone()),
        ..ObjectReference::default()
    }
}

/// Sets a workload's replicas through `/scale`; with `if_version`, only if the workload is still
/// at that `resourceVersion` (else 409 Conflict).
pub async fn patch_replicas(
    client: &kube::Client,
    w: &Workload,
    replicas: u32,
    if_version: Option<u64>,
) -> kube::Result<Scale> {
    let mut body = serde_json::json!({ "spec": { "replicas": replicas } });
    if let Some(v) = if_version {
        body["metadata"] = serde_json::json!({ "resourceVersion": v.to_string() });
    }
    workload_api(client, w)
        .patch_scale(&w.name, &PatchParams::default(), &Patch::Merge(body))
        .await
}

/// A workload's metadata and replicas.
async fn read(client: &kube::Client, key: &str) -> Result<(ObjectMeta, u32), CoordError> {
    let w = workload(key)?;
    let object = workload_api(client, &w)
        .get(&w.name)
        .await
        .map_err(|e| not_found(key, e))?;
    let replicas = object.data["spec"]["replicas"].as_u64().unwrap_or(1);
    Ok((object.metadata, replicas.min(u64::from(u32::MAX)) as u32))
}

fn last_used(meta: &ObjectMeta) -> u64 {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(LAST_USED))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

impl Coordinator for KubeCoordinator {
    async fn deployment(&self, name: &str) -> Result<SharedDeployment, CoordError> {
        let (meta, replicas) = read(&self.client, name).await?;
        Ok(SharedDeployment {
            replicas,
            last_used_ms: last_used(&meta),
            version: version(&meta)?,
        })
    }

    async fn scale(
        &self,
        name: &str,
        replicas: u32,
        if_version: Option<u64>,
    ) -> Result<u64, CoordError> {
        let w = workload(name)?;
        let scale = patch_replicas(&self.client, &w, replicas, if_version)
            .await
            .map_err(|e| not_found(name, e))?;
        version(&scale.metadata)
    }

    async fn touch(&self, name: &str, last_used_ms: u64) -> Result<u64, CoordError> {
        let w = workload(name)?;
        for _ in 0..TOUCH_ATTEMPTS {
            let (meta, _) = read(&self.client, name).await?;
            if last_used(&meta) >= last_used_ms {
                return version(&meta);
            }
            let patch = Patch::Merge(serde_json::json!({
                "metadata": {
                    "resourceVersion": meta.resource_version,
                    "annotations": { LAST_USED: last_used_ms.to_string() },
                }
            }));
            let written = workload_api(&self.client, &w)
                .patch(&w.name, &PatchParams::default(), &patch)
                .await
                .map(|d| d.metadata);
            match written {
                Ok(meta) => return version(&meta),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(not_found(name, e)),
            }
        }
        Err(CoordError::Unavailable(format!(
            "{name}: the annotation kept changing under {TOUCH_ATTEMPTS} attempts"
        )))
    }

    async fn lease(&self) -> Result<Lease, CoordError> {
        let lease = match self.leases().get_opt(&self.lease_name).await {
            Ok(Some(l)) => l,
            Ok(None) => return Ok(Lease::default()),
            Err(e) => return Err(unavailable(e)),
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let until_ms = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(LEASE_UNTIL))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                // A lease written by something else: its renewal plus its duration.
                let renewed = spec
                    .renew_time
                    .as_ref()
                    .map_or(0, |t| t.0.as_millisecond().max(0) as u64);
                let duration = spec.lease_duration_seconds.unwrap_or(0).max(0) as u64;
                renewed + duration * 1_000
            });
        Ok(Lease {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            until_ms,
            version: version(&lease.metadata)?,
        })
    }

    async fn take_lease(
        &self,
        holder: &str,
        until_ms: u64,
        if_version: u64,
    ) -> Result<u64, CoordError> {
        let renewed_ms = until_ms.saturating_sub(self.lease_ms);
        let renew_time = k8s_openapi::jiff::Timestamp::from_millisecond(renewed_ms as i64)
            .map_err(|e| CoordError::Unavailable(e.to_string()))?;
        let lease = KubeLease {
            metadata: ObjectMeta {
                name: Some(self.lease_name.clone()),
                namespace: Some(self.lease_namespace.clone()),
                resource_version: (if_version > 0).then(|| if_version.to_string()),
                annotations: Some(BTreeMap::from([(
                    LEASE_UNTIL.to_owned(),
                    until_ms.to_string(),
                )])),
                owner_references: self.owner().await.map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                lease_duration_seconds: Some(self.lease_ms.div_ceil(1_000).max(1) as i32),
                renew_time: Some(MicroTime(renew_time)),
                ..LeaseSpec::default()
            }),
        };
        let pp = PostParams::default();
        let written = if if_version == 0 {
            self.leases().create(&pp, &lease).await
        } else {
            self.leases().replace(&self.lease_name, &pp, &lease).await
        }
        .map_err(unavailable)?;
        version(&written.metadata)
    }
}
