//! The Kubernetes backend: routes from annotated Services (or Services whose Deployment is
//! labelled `ebb.dev/service`), replicas through the `/scale`
//! subresource of Deployments and StatefulSets, ready addresses from EndpointSlices.
//!
//! Three loops and one orchestrator, all driven by [`run`]:
//!
//! * **Routes.** A watcher on Services (one namespace or all) keeps every Service's annotations;
//!   once the first list is complete and after every change, the annotated ones
//!   ([`ebb_core::orchestrator::annotations`]; a labelled Deployment's annotations under its
//!   Service's, [`annotations::with_labelled`], from a reflector on Deployments with the label)
//!   become the routes named `NAMESPACE/SERVICE`, decided on the log
//!   against its routes ([`decide_routes`]): `RouteUpserted` for a new or changed one,
//!   `RouteRemoved` for a Service gone or no longer annotated. A name with `/` is a Service's,
//!   never one of `ebb.toml` or the admin API, and a Service never takes a domain of those. A
//!   Service whose annotations make no route gets one Warning Event per distinct problem, and no
//!   route.
//! * **Endpoints.** A watcher on EndpointSlices keeps the slices of the Services behind routes; a
//!   route's ready replicas are the addresses of the endpoints that are ready (KEP-1669: `ready`,
//!   absent meaning ready, and not `terminating`) on the Service's first port, each address once
//!   across slices, the moment a slice lists them. The watchers resume from their
//!   resourceVersion, relist after a 410 and back off on errors (kube-runtime's watcher).
//! * **Scale writes.** [`KubeOrchestrator::scale`] records the replicas wanted and returns; one
//!   writer patches `/scale` with the newest value per workload (so a burst of asks is one
//!   write), rate limited (a permit per request, refilled at `--kube-qps`), retried with a
//!   doubling backoff a bounded number of times. A success is a Normal Event named by the reason
//!   of the log's last `ScaleRequested` (the projection keeps it), a failure a `ScaleFailed`
//!   Warning Event.
//! * **Sync.** Every `sync_interval_ms` each workload's `/scale` is read: replicas changed by
//!   someone else (an operator, another ebb) are recorded as `ScaleRequested { reason: peer }`,
//!   and the workload is labelled `ebb.dev/managed=true` once. A read that overlaps one of ebb's
//!   own writes is discarded, so it never undoes a wake.
//!
//! [`KubeOrchestrator::synced`] (the Services listed and their routes decided, the EndpointSlices
//! listed) is what `/readyz` answers. A failure that repeats is one log line until it changes
//! (`Complaints`).
//!
//! ebb does not own annotated workloads: it never scales one at its own shutdown or restart (the
//! cluster's replicas are the truth, read back by the sync loop), and a route removed leaves its
//! workload as it is.
//!
//! **Shared scaling.** [`run_shared`] replaces the single-machine downscaler here: it drives
//! `ebb_core::scaler::member` against [`crate::coordinator`], the `Coordinator` on the API
//! server. The leader reads a workload only when its own view already says idle (the last-used
//! annotation only grows). A hidden `--downscale-gate` directory holds each scale-down before its
//! write, for the test that races a bump against it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::{Notify, watch};

use crate::clock::Clock;
use crate::coordinator::{KubeCoordinator, patch_replicas, workload_api, workload_reference};
use crate::event::{Event, RouteSpec};
use crate::log::Log;
use crate::scaler::Live;
use crate::scaler::member::{self, Member, Next, Request};
use crate::scaler::shared::SharedOptions;
use crate::state::State;
use ebb_core::orchestrator::annotations::{self, Claim, RouteDefaults, Workload};
use ebb_core::orchestrator::{Error, Observed, Orchestrator, Result, WorkloadSpec};
use ebb_proxy::Traffic;

/// The label ebb puts on the workloads it scales.
pub const MANAGED_LABEL: &str = "ebb.dev/managed";
/// proxless' label, understood as the same.
pub const PROXLESS_LABEL: &str = "proxless";
/// The controller name on ebb's Kubernetes Events.
pub const CONTROLLER: &str = "ebb.dev/ebb";

/// How the Kubernetes backend runs.
#[derive(Debug, Clone)]
pub struct KubeOptions {
    /// Watch this namespace only (`None`: all namespaces).
    pub namespace: Option<String>,
    /// Where image functions' Deployments and Services are made.
    pub functions_namespace: String,
    /// Settings of routes whose Service does not say.
    pub defaults: RouteDefaults,
    /// How often each workload's replicas are read back.
    pub sync_interval_ms: u64,
    /// Who reports ebb's Kubernetes Events (the pod's name).
    pub instance: String,
    /// API requests ebb makes per second at most (reads and writes; watches excepted), and the
    /// burst it may make at once.
    pub api_qps: u32,
    pub api_burst: u32,
    /// Attempts at one scale write before it counts as a failure.
    pub scale_attempts: u32,
    /// How ebb's replicas share scaling.
    pub shared: SharedScaling,
}

impl Default for KubeOptions {
    fn default() -> Self {
        Self {
            namespace: None,
            functions_namespace: "default".to_owned(),
            defaults: RouteDefaults::default(),
            sync_interval_ms: 10_000,
            instance: "ebb".to_owned(),
            api_qps: 20,
            api_burst: 40,
            scale_attempts: 8,
            shared: SharedScaling::default(),
        }
    }
}

/// The Service behind a route: where its ready addresses come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ServiceKey {
    namespace: String,
    name: String,
}

/// A workload ebb scales for a route.
#[derive(Debug)]
struct Tracked {
    workload: Workload,
    service: ServiceKey,
    /// The Service port whose target the proxy forwards to (`None`: the slice's first port).
    port: Option<String>,
    /// Replicas asked for: ebb's last ask, or what the cluster said at the last sync.
    desired: Option<u32>,
    /// An ask not yet written.
    pending: Option<u32>,
    /// Writes begun and finished; a read is current only if none began or ran meanwhile.
    writes_begun: u64,
    writes_done: u64,
    labelled: bool,
    /// The workload of an image function (made by ebb), not of an annotated Service.
    function: bool,
    failures: u64,
    last_failure: Option<String>,
}

/// Requests per second with a burst: a request takes a permit; [`Limiter::refill`] puts one back
/// every `interval`, up to `burst`.
pub(crate) struct Limiter {
    interval: Duration,
    burst: usize,
    permits: tokio::sync::Semaphore,
}

impl Limiter {
    fn new(qps: u32, burst: u32) -> Self {
        let burst = burst.max(1) as usize;
        Self {
            interval: Duration::from_secs(1) / qps.max(1),
            burst,
            permits: tokio::sync::Semaphore::new(burst),
        }
    }

    pub(crate) async fn acquire(&self) {
        if let Ok(p) = self.permits.acquire().await {
            p.forget();
        }
    }

    async fn refill(&self, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            if self.permits.available_permits() < self.burst {
                self.permits.add_permits(1);
            }
        }
    }
}

#[derive(Default)]
struct Inner {
    workloads: HashMap<String, Tracked>,
    /// Slices by Service, then by slice name.
    slices: HashMap<ServiceKey, BTreeMap<String, EndpointSlice>>,
}

/// Runs workloads on Kubernetes: the [`Orchestrator`] for routes of annotated Services.
pub struct KubeOrchestrator {
    pub(crate) client: kube::Client,
    pub(crate) options: KubeOptions,
    inner: Mutex<Inner>,
    changes: watch::Sender<u64>,
    /// Wakes the scale writer.
    scale_asked: Notify,
    /// Wakes the sync loop (a workload newly tracked).
    sync_asked: Notify,
    pub(crate) limiter: Limiter,
    recorder: Recorder,
    /// Whether the Services (routes decided) and the EndpointSlices have been listed.
    services_listed: std::sync::atomic::AtomicBool,
    slices_listed: std::sync::atomic::AtomicBool,
    /// Whether this replica holds ebb's Lease: unknown until the lease loop first says.
    leadership: std::sync::atomic::AtomicU8,
    /// Events about shared objects decided before leadership was known (at most
    /// [`MAX_DEFERRED`]): published if this replica turns out to lead, dropped if not.
    deferred: Mutex<Vec<(ObjectReference, EventType, String, String)>>,
    /// The watches RBAC refuses (`/readyz` tells them; [`crate::health::tell_refusals`] too).
    pub access: crate::health::Access,
    /// Requests under way at a pod's address through every ebb replica (set once, by whoever
    /// owns the proxy): a Deployment's scale-down keeps the busiest pods.
    busy: std::sync::OnceLock<BusyProbe>,
    /// The deletion cost last written per workload and pod.
    costs: Mutex<HashMap<String, HashMap<String, u32>>>,
}

/// Tells how many requests are under way at a replica's address.
pub type BusyProbe = Arc<dyn Fn(SocketAddr) -> u32 + Send + Sync>;

/// The annotation a ReplicaSet orders its pods by when it removes some: lower goes first.
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// Leadership not known yet.
const UNKNOWN: u8 = 0;
/// This replica holds the Lease.
const LEADING: u8 = 1;
/// Another replica holds it.
const FOLLOWING: u8 = 2;

/// Events about shared objects kept while leadership is not known yet, at most.
const MAX_DEFERRED: usize = 256;

impl KubeOrchestrator {
    /// The API client.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// Whether this replica holds ebb's Lease now (false while that is not known yet).
    pub fn leads(&self) -> bool {
        self.leadership.load(std::sync::atomic::Ordering::Acquire) == LEADING
    }

    /// An orchestrator on `client`; [`run`] drives it.
    pub fn new(client: kube::Client, options: KubeOptions) -> Arc<Self> {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: CONTROLLER.to_owned(),
                instance: Some(options.instance.clone()),
            },
        );
        Arc::new(Self {
            limiter: Limiter::new(options.api_qps, options.api_burst),
            client,
            options,
            inner: Mutex::default(),
            changes: watch::channel(0).0,
            scale_asked: Notify::new(),
            sync_asked: Notify::new(),
            recorder,
            services_listed: Default::default(),
            slices_listed: Default::default(),
            leadership: std::sync::atomic::AtomicU8::new(UNKNOWN),
            deferred: Mutex::default(),
            access: crate::health::Access::default(),
            busy: std::sync::OnceLock::new(),
            costs: Mutex::default(),
        })
    }

    /// Sets how a scale-down learns the requests under way at each pod (once).
    pub fn busy_with(&self, probe: BusyProbe) {
        let _ = self.busy.set(probe);
    }

    /// Before a Deployment goes down to `replicas` (fewer than its ready pods): each ready pod's
    /// deletion cost becomes the requests under way on it, so its ReplicaSet removes idle pods
    /// first and no pod with requests under way while an idle one is left. The first time this
    /// replica weighs a workload it writes every pod's cost (another replica may have written
    /// some); after that, only the costs that changed (a pod it never weighed has none: 0). A
    /// StatefulSet always removes its highest ordinals: nothing to weigh.
    async fn weigh_pods(&self, key: &str, w: &Workload, replicas: u32) {
        let Some(busy) = self.busy.get() else {
            return;
        };
        // To zero every pod goes: nothing to choose.
        if w.kind != annotations::WorkloadKind::Deployment || replicas == 0 {
            return;
        }
        let pods = {
            let inner = self.lock();
            let Some(t) = inner.workloads.get(key) else {
                return;
            };
            inner
                .slices
                .get(&t.service)
                .map(|s| ready_pods(s.values(), t.port.as_deref()).0)
                .unwrap_or_default()
        };
        if pods.len() <= replicas as usize {
            return;
        }
        let costs: HashMap<String, u32> = pods
            .into_iter()
            .filter_map(|(addr, pod)| Some((pod?, busy(addr))))
            .collect();
        let changed: Vec<(String, u32)> = {
            let mut all = self.costs.lock().unwrap_or_else(|e| e.into_inner());
            let keep: HashSet<String> = self.lock().workloads.keys().cloned().collect();
            all.retain(|k, _| keep.contains(k));
            let before = all.insert(key.to_owned(), costs.clone());
            costs
                .into_iter()
                .filter(|(pod, n)| {
                    before
                        .as_ref()
                        .is_none_or(|b| b.get(pod).copied().unwrap_or(0) != *n)
                })
                .collect()
        };
        let api: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(self.client.clone(), &w.namespace);
        for (pod, n) in changed {
            let patch = Patch::Merge(serde_json::json!({
                "metadata": { "annotations": { DELETION_COST: n.to_string() } }
            }));
            self.limiter.acquire().await;
            match api.patch(&pod, &PatchParams::default(), &patch).await {
                Ok(_) => {
                    tracing::debug!(deployment = %key, %pod, requests = n, "pod deletion cost")
                }
                Err(e) => {
                    tracing::warn!(deployment = %key, %pod, error = %e, "cannot set the pod's deletion cost: the scale-down may pick a busy pod");
                    // Not known now: the next scale-down writes it again.
                    if let Some(c) = self
                        .costs
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_mut(key)
                    {
                        c.insert(pod, u32::MAX);
                    }
                }
            }
        }
    }

    /// Says whether this replica holds the Lease now (the lease loop calls it on each check):
    /// the first answer publishes the events about shared objects kept until then, or drops
    /// them.
    pub async fn set_leading(&self, leading: bool) {
        let now = if leading { LEADING } else { FOLLOWING };
        let was = self
            .leadership
            .swap(now, std::sync::atomic::Ordering::AcqRel);
        if was != UNKNOWN {
            return;
        }
        let kept = std::mem::take(&mut *self.deferred.lock().expect("deferred lock"));
        if leading {
            for (reference, kind, reason, note) in kept {
                self.publish(&reference, kind, &reason, note).await;
            }
        }
    }

    /// Publishes an Event about an object every replica sees alike (a Service's route, a
    /// `Func` resource): only the Lease holder does, so one Event is published, not one per
    /// replica. Before leadership is known the Event is kept (bounded).
    pub async fn publish_shared(
        &self,
        reference: &ObjectReference,
        kind: EventType,
        reason: &str,
        note: String,
    ) {
        match self.leadership.load(std::sync::atomic::Ordering::Acquire) {
            LEADING => self.publish(reference, kind, reason, note).await,
            FOLLOWING => {
                tracing::debug!(object = ?reference.name, reason, "the Lease holder publishes this Event");
            }
            _ => {
                let mut deferred = self.deferred.lock().expect("deferred lock");
                if deferred.len() < MAX_DEFERRED {
                    deferred.push((reference.clone(), kind, reason.to_owned(), note));
                }
            }
        }
    }

    /// Whether ebb knows the cluster: its routes decided from a complete list of Services, and
    /// the EndpointSlices listed (`/readyz`). A watch failing later keeps what was listed.
    pub fn synced(&self) -> bool {
        use std::sync::atomic::Ordering::Acquire;
        self.services_listed.load(Acquire) && self.slices_listed.load(Acquire)
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("kube orchestrator lock")
    }

    /// Tracks the workload of a route: `key` is the route's `deployment`.
    fn track(&self, key: &str, workload: &Workload, service: ServiceKey, port: Option<String>) {
        self.track_as(key, workload, service, port, false);
    }

    /// Tracks the workload of an image function: its route's deployment key is the Deployment's
    /// name, and its Service has that name too.
    pub(crate) fn track_function(&self, workload: &Workload) {
        let service = ServiceKey {
            namespace: workload.namespace.clone(),
            name: workload.name.clone(),
        };
        let port = Some(PORT_NAME.to_owned());
        self.track_as(&workload.name, workload, service, port, true);
    }

    fn track_as(
        &self,
        key: &str,
        workload: &Workload,
        service: ServiceKey,
        port: Option<String>,
        function: bool,
    ) {
        let mut inner = self.lock();
        match inner.workloads.get_mut(key) {
            Some(t) => {
                t.service = service;
                t.port = port;
            }
            None => {
                inner.workloads.insert(
                    key.to_owned(),
                    Tracked {
                        workload: workload.clone(),
                        service,
                        port,
                        desired: None,
                        pending: None,
                        writes_begun: 0,
                        writes_done: 0,
                        labelled: false,
                        function,
                        failures: 0,
                        last_failure: None,
                    },
                );
                drop(inner);
                self.sync_asked.notify_one();
            }
        }
        self.changed();
    }

    /// Stops tracking the workloads of Services (`function`: of image functions) not in `keep`.
    pub(crate) fn retain(&self, keep: &HashSet<String>, function: bool) {
        let mut inner = self.lock();
        let before = inner.workloads.len();
        inner
            .workloads
            .retain(|k, t| t.function != function || keep.contains(k));
        if inner.workloads.len() != before {
            drop(inner);
            self.changed();
        }
    }

    /// Records replicas written by the shared protocol's scale-down (not by [`Orchestrator::scale`]).
    fn scaled(&self, key: &str, replicas: u32) {
        if let Some(t) = self.lock().workloads.get_mut(key) {
            t.desired = Some(replicas);
            // A write happened: a sync read begun before it is stale.
            t.writes_begun += 1;
            t.writes_done += 1;
        }
        self.changed();
    }

    fn fail(&self, key: &str, why: String) {
        if let Some(t) = self.lock().workloads.get_mut(key) {
            t.failures += 1;
            t.last_failure = Some(why);
        }
        self.changed();
    }

    pub(crate) async fn publish(
        &self,
        reference: &ObjectReference,
        kind: EventType,
        reason: &str,
        note: String,
    ) {
        let event = KubeEvent {
            type_: kind,
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: "Route".to_owned(),
            secondary: None,
        };
        self.limiter.acquire().await;
        if let Err(e) = self.recorder.publish(&event, reference).await {
            tracing::warn!(error = %e, object = ?reference.name, reason, "cannot publish a Kubernetes Event");
        }
    }

    /// Writes `/scale` for one workload.
    async fn write_scale(&self, w: &Workload, replicas: u32) -> kube::Result<()> {
        self.limiter.acquire().await;
        patch_replicas(&self.client, w, replicas, None).await?;
        Ok(())
    }

    /// Reads a workload's replicas from `/scale`.
    async fn read_scale(&self, w: &Workload) -> kube::Result<u32> {
        self.limiter.acquire().await;
        let scale = workload_api(&self.client, w).get_scale(&w.name).await?;
        Ok(scale.spec.and_then(|s| s.replicas).unwrap_or(0).max(0) as u32)
    }

    /// Labels a workload as ebb's.
    async fn label(&self, w: &Workload) -> kube::Result<()> {
        let patch = Patch::Merge(
            serde_json::json!({ "metadata": { "labels": { MANAGED_LABEL: "true" } } }),
        );
        self.limiter.acquire().await;
        workload_api(&self.client, w)
            .patch(&w.name, &PatchParams::default(), &patch)
            .await?;
        Ok(())
    }
}

/// Problems reported once each: a failure logs one line (a warning) the first time it happens
/// and whenever its text changes, and one line when it stops; the same failure repeating (a
/// missing permission, an API server away) does not flood the log.
#[derive(Default)]
pub(crate) struct Complaints(HashMap<String, String>);

impl Complaints {
    pub(crate) fn failed(&mut self, what: &str, error: &dyn std::fmt::Display) {
        let text = error.to_string();
        if self.0.get(what) != Some(&text) {
            tracing::warn!(error = %text, "{what} failed (reported again only if it changes)");
            self.0.insert(what.to_owned(), text);
        }
    }

    pub(crate) fn worked(&mut self, what: &str) {
        if self.0.remove(what).is_some() {
            tracing::info!("{what} works again");
        }
    }
}

/// Whether an API error is worth another attempt (the server or the network, not the request).
fn retryable(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 429 || s.code == 409 || s.code >= 500,
        _ => true,
    }
}

/// The ready addresses of a Service's slices on `port` (by name; `None`: each slice's first
/// port), each once, and how many endpoints are terminating.
fn ready_addresses<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    port: Option<&str>,
) -> (Vec<SocketAddr>, u32) {
    let (pods, terminating) = ready_pods(slices, port);
    (pods.into_iter().map(|(a, _)| a).collect(), terminating)
}

/// [`ready_addresses`] with the pod behind each address (an endpoint's `targetRef`, when it
/// names a Pod), each address once, sorted.
fn ready_pods<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    port: Option<&str>,
) -> (Vec<(SocketAddr, Option<String>)>, u32) {
    let mut ready: Vec<(SocketAddr, Option<String>)> = Vec::new();
    let mut terminating = 0;
    for slice in slices {
        if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
            continue;
        }
        let ports = slice.ports.as_deref().unwrap_or_default();
        let number = match port {
            Some(name) => ports
                .iter()
                .find(|p| p.name.as_deref().unwrap_or("") == name)
                .and_then(|p| p.port),
            None => ports.first().and_then(|p| p.port),
        };
        let Some(number) = number.and_then(|n| u16::try_from(n).ok()) else {
            continue;
        };
        for e in slice.endpoints.as_deref().unwrap_or_default() {
            let c = e.conditions.clone().unwrap_or_default();
            if c.terminating == Some(true) {
                terminating += 1;
                continue;
            }
            if c.ready == Some(false) {
                continue;
            }
            let pod = e
                .target_ref
                .as_ref()
                .filter(|t| t.kind.as_deref() == Some("Pod"))
                .and_then(|t| t.name.clone());
            for a in &e.addresses {
                if let Ok(ip) = a.parse::<IpAddr>() {
                    let addr = SocketAddr::new(ip, number);
                    if !ready.iter().any(|(r, _)| *r == addr) {
                        ready.push((addr, pod.clone()));
                    }
                }
            }
        }
    }
    ready.sort();
    (ready, terminating)
}

impl Orchestrator for KubeOrchestrator {
    fn register(&self, spec: WorkloadSpec) -> Result<()> {
        Err(Error::InvalidSpec {
            name: spec.name,
            why: "this ebb runs workloads on Kubernetes, not as local processes: annotate a \
                  Service with ebb.dev/domains and ebb.dev/deployment instead"
                .to_owned(),
        })
    }

    fn scale(&self, name: &str, replicas: u32) -> Result<()> {
        {
            let mut inner = self.lock();
            let t = inner
                .workloads
                .get_mut(name)
                .ok_or_else(|| Error::UnknownWorkload(name.to_owned()))?;
            t.desired = Some(replicas);
            t.pending = Some(replicas);
        }
        self.scale_asked.notify_one();
        self.changed();
        Ok(())
    }

    fn observe(&self, name: &str) -> Option<Observed> {
        let inner = self.lock();
        let t = inner.workloads.get(name)?;
        let (ready, stopping) = inner
            .slices
            .get(&t.service)
            .map(|s| ready_addresses(s.values(), t.port.as_deref()))
            .unwrap_or_default();
        let desired = t.desired.unwrap_or(ready.len() as u32);
        Some(Observed {
            desired,
            starting: desired.saturating_sub(ready.len() as u32),
            ready,
            stopping,
            spawns: 0,
            failures: t.failures,
            last_failure: t.last_failure.clone(),
        })
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// A Service as the route loop keeps it.
#[derive(Debug, Clone)]
struct ServiceInfo {
    created_ms: u64,
    annotations: BTreeMap<String, String>,
    port: Option<String>,
    reference: ObjectReference,
}

fn service_info(s: &Service) -> Option<(ServiceKey, ServiceInfo)> {
    let namespace = s.metadata.namespace.clone()?;
    let name = s.metadata.name.clone()?;
    let port = s
        .spec
        .as_ref()
        .and_then(|spec| spec.ports.as_ref())
        .and_then(|p| p.first())
        .and_then(|p| p.name.clone())
        .filter(|n| !n.is_empty());
    let reference = ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Service".to_owned()),
        name: Some(name.clone()),
        namespace: Some(namespace.clone()),
        uid: s.metadata.uid.clone(),
        ..ObjectReference::default()
    };
    let created_ms = s
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_millisecond().max(0) as u64);
    Some((
        ServiceKey { namespace, name },
        ServiceInfo {
            created_ms,
            annotations: s.metadata.annotations.clone().unwrap_or_default(),
            port,
            reference,
        },
    ))
}

/// Whether a route in the log is one of a Service (named `NAMESPACE/SERVICE`; routes of
/// `ebb.toml` and the admin API have no `/`).
pub fn is_service_route(name: &str) -> bool {
    name.contains('/')
}

/// The events that make the log's Service routes `routes`, and the routes refused because a
/// route that is not a Service's has one of their domains (with why).
pub fn decide_routes(state: &State, routes: &[RouteSpec]) -> (Vec<Event>, Vec<(String, String)>) {
    let mut events = Vec::new();
    let mut refused = Vec::new();
    let wanted: HashSet<&str> = routes.iter().map(|r| r.name.as_str()).collect();
    for name in state.routes.by_name.keys() {
        if is_service_route(name) && !wanted.contains(name.as_str()) {
            events.push(Event::RouteRemoved { name: name.clone() });
        }
    }
    for r in routes {
        let taken = r.domains.iter().find_map(|d| {
            state
                .routes
                .by_domain
                .get(d)
                .filter(|owner| !is_service_route(owner))
                .map(|owner| (d, owner))
        });
        if let Some((d, owner)) = taken {
            refused.push((
                r.name.clone(),
                format!("{d:?} is served by route {owner:?} of ebb's own configuration"),
            ));
            if state.routes.by_name.contains_key(&r.name) {
                events.push(Event::RouteRemoved {
                    name: r.name.clone(),
                });
            }
            continue;
        }
        if state.routes.by_name.get(&r.name).map(|x| &x.spec) != Some(r) {
            events.push(Event::RouteUpserted {
                route: Box::new(r.clone()),
            });
        }
    }
    (events, refused)
}

/// What the route loop decided last, to publish each problem once.
#[derive(Default)]
struct RouteLoop {
    services: BTreeMap<ServiceKey, ServiceInfo>,
    /// Services being listed after an (re)initialisation.
    listing: Option<BTreeMap<ServiceKey, ServiceInfo>>,
    listed: bool,
    /// The problem last published per Service.
    warned: HashMap<ServiceKey, String>,
    /// The Deployments labelled as a Service's workload (`ebb.dev/service`), with their
    /// annotations, by the Service.
    labelled: Labelled,
}

/// Deployments (name, annotations) by the Service their `ebb.dev/service` label names.
type Labelled = BTreeMap<ServiceKey, Vec<(String, BTreeMap<String, String>)>>;

fn labelled(store: &Store<k8s_openapi::api::apps::v1::Deployment>) -> Labelled {
    let mut out = Labelled::new();
    for d in store.state() {
        let (Some(namespace), Some(name)) = (d.metadata.namespace.clone(), d.metadata.name.clone())
        else {
            continue;
        };
        let Some(service) = d
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(annotations::SERVICE_LABEL))
            .filter(|s| !s.is_empty())
        else {
            continue;
        };
        out.entry(ServiceKey {
            namespace,
            name: service.clone(),
        })
        .or_default()
        .push((name, annotations::settings(d.metadata.annotations.as_ref())));
    }
    for ds in out.values_mut() {
        ds.sort();
    }
    out
}

impl RouteLoop {
    async fn reconcile(&mut self, log: &Log, orch: &KubeOrchestrator) {
        let mut claims = Vec::new();
        let mut problems: BTreeMap<String, String> = BTreeMap::new();
        let mut targets: HashMap<String, (Workload, ServiceKey, Option<String>)> = HashMap::new();
        for (key, info) in &self.services {
            let merged;
            let annotations = match self.labelled.get(key).map(Vec::as_slice) {
                // A Service that names its workload itself is routed by its own annotations.
                _ if annotations::names_workload(&info.annotations) => &info.annotations,
                None | Some([]) => &info.annotations,
                Some([(deployment, theirs)]) => {
                    merged = annotations::with_labelled(&info.annotations, deployment, theirs);
                    &merged
                }
                Some(many) => {
                    let names: Vec<&str> = many.iter().map(|(n, _)| n.as_str()).collect();
                    problems.insert(
                        format!("{}/{}", key.namespace, key.name),
                        format!(
                            "the Deployments {} all carry {}={}: label one",
                            names.join(", "),
                            annotations::SERVICE_LABEL,
                            key.name
                        ),
                    );
                    continue;
                }
            };
            match annotations::route(
                &key.namespace,
                &key.name,
                annotations,
                &orch.options.defaults,
            ) {
                Ok(None) => {}
                Ok(Some((route, workload))) => {
                    targets.insert(
                        route.name.clone(),
                        (workload, key.clone(), info.port.clone()),
                    );
                    claims.push(Claim {
                        route,
                        created_ms: info.created_ms,
                    });
                }
                Err(e) => {
                    problems.insert(format!("{}/{}", key.namespace, key.name), e.to_string());
                }
            }
        }
        let (routes, refused) = annotations::resolve(claims);
        for (name, e) in refused {
            problems.insert(name, e.to_string());
        }
        let decided = routes.clone();
        let outcome = log
            .decide(move |s: &State, _| {
                let (events, refused) = decide_routes(s, &decided);
                (events, refused)
            })
            .await;
        let refused = match outcome {
            Ok((refused, _)) => refused,
            Err(e) => {
                tracing::warn!(error = %e, "recording routes failed");
                return;
            }
        };
        for (name, why) in refused {
            problems.insert(name, why);
        }
        let mut keep = HashSet::new();
        for r in &routes {
            if problems.contains_key(&r.name) {
                continue;
            }
            if let Some((workload, service, port)) = targets.get(&r.name) {
                orch.track(&r.deployment, workload, service.clone(), port.clone());
                keep.insert(r.deployment.clone());
            }
        }
        orch.retain(&keep, false);

        // One Warning Event per distinct problem of a Service.
        self.warned
            .retain(|k, _| problems.contains_key(&format!("{}/{}", k.namespace, k.name)));
        for (key, info) in &self.services {
            let name = format!("{}/{}", key.namespace, key.name);
            let Some(problem) = problems.get(&name) else {
                continue;
            };
            if self.warned.get(key) == Some(problem) {
                continue;
            }
            tracing::warn!(service = %name, %problem, "the Service's annotations make no route");
            orch.publish_shared(
                &info.reference,
                EventType::Warning,
                "InvalidRoute",
                format!("no route: {problem}"),
            )
            .await;
            self.warned.insert(key.clone(), problem.clone());
        }
    }

    /// Takes one watcher event; whether the routes need deciding again.
    fn take(&mut self, event: watcher::Event<Service>) -> bool {
        match event {
            watcher::Event::Init => {
                self.listing = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(s) => {
                if let (Some(listing), Some((k, v))) = (self.listing.as_mut(), service_info(&s)) {
                    listing.insert(k, v);
                }
                false
            }
            watcher::Event::InitDone => {
                self.services = self.listing.take().unwrap_or_default();
                self.listed = true;
                true
            }
            watcher::Event::Apply(s) => {
                let Some((k, v)) = service_info(&s) else {
                    return false;
                };
                let same = self.services.get(&k).is_some_and(|o| {
                    o.annotations == v.annotations
                        && o.port == v.port
                        && o.created_ms == v.created_ms
                });
                self.services.insert(k, v);
                self.listed && !same
            }
            watcher::Event::Delete(s) => {
                let Some((k, _)) = service_info(&s) else {
                    return false;
                };
                self.services.remove(&k).is_some() && self.listed
            }
        }
    }
}

pub(crate) fn api<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    <K as kube::Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// How a watch of `what` over the served namespaces is named for people.
pub(crate) fn watched(what: &str, namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) => format!("{what} in namespace {ns}"),
        None => format!("{what} in all namespaces"),
    }
}

/// Runs a reflector into `writer` until `stop`, poking `changed` after each event. A watch RBAC
/// refuses is told as every other watch of ebb's is (`guard`: a WARN, `/readyz`, asked again
/// less and less often); other failures are said once until they change.
pub(crate) async fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
    mut guard: crate::health::Guard,
    changed: Arc<Notify>,
    mut stop: watch::Receiver<bool>,
) where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let stream = reflector::reflector(writer, watcher(api, config).default_backoff());
    tokio::pin!(stream);
    let mut complaints = Complaints::default();
    let what = format!("watching {}", guard.what());
    loop {
        let event = tokio::select! {
            e = stream.next() => e,
            _ = stop.changed() => return,
        };
        if let Some(item) = &event
            && let Some(delay) = guard.saw(item)
        {
            if !crate::health::pause(delay, &mut stop).await {
                return;
            }
            continue;
        }
        match event {
            None => return,
            Some(Err(e)) => complaints.failed(&what, &e),
            Some(Ok(_)) => {
                complaints.worked(&what);
                changed.notify_one();
            }
        }
    }
}

/// How long the first route decision waits for the labelled Deployments' list.
const LABELS_WAIT: Duration = Duration::from_secs(5);

async fn run_routes(log: Arc<Log>, orch: Arc<KubeOrchestrator>, mut stop: watch::Receiver<bool>) {
    let ns = orch.options.namespace.as_deref();
    let services = api::<Service>(&orch.client, ns);
    let stream = watcher(services, watcher::Config::default()).default_backoff();
    tokio::pin!(stream);
    // Deployments labelled as a Service's workload: the Service is routed as if annotated.
    let (deployments, writer) = reflector::store();
    let relabelled = Arc::new(Notify::new());
    tokio::spawn(reflect(
        api::<k8s_openapi::api::apps::v1::Deployment>(&orch.client, ns),
        watcher::Config::default().labels(annotations::SERVICE_LABEL),
        writer,
        orch.access.watch(watched(
            &format!("Deployments labelled {}", annotations::SERVICE_LABEL),
            ns,
        )),
        relabelled.clone(),
        stop.clone(),
    ));
    let mut labels_waited = false;
    let mut routes = RouteLoop::default();
    let mut complaints = Complaints::default();
    let mut guard = orch.access.watch(watched("Services", ns));
    loop {
        let event = tokio::select! {
            e = stream.next() => e,
            _ = relabelled.notified() => {
                let now = labelled(&deployments);
                if now != routes.labelled {
                    routes.labelled = now;
                    if routes.listed {
                        routes.reconcile(&log, &orch).await;
                    }
                }
                continue;
            }
            _ = stop.changed() => return,
        };
        if let Some(item) = &event
            && let Some(delay) = guard.saw(item)
        {
            if !crate::health::pause(delay, &mut stop).await {
                return;
            }
            continue;
        }
        match event {
            None => return,
            Some(Err(e)) => complaints.failed("watching Services", &e),
            Some(Ok(event)) => {
                complaints.worked("watching Services");
                if routes.take(event) {
                    if !labels_waited {
                        // The first decision waits a moment (once) for the labelled
                        // Deployments, so that a restart does not drop their Services' routes
                        // for an instant.
                        labels_waited = true;
                        let listed = deployments.wait_until_ready();
                        tokio::select! {
                            _ = tokio::time::timeout(LABELS_WAIT, listed) => {}
                            _ = stop.changed() => return,
                        }
                    }
                    routes.labelled = labelled(&deployments);
                    routes.reconcile(&log, &orch).await;
                    orch.services_listed
                        .store(true, std::sync::atomic::Ordering::Release);
                }
            }
        }
    }
}

async fn run_endpoints(orch: Arc<KubeOrchestrator>, mut stop: watch::Receiver<bool>) {
    let slices = api::<EndpointSlice>(&orch.client, orch.options.namespace.as_deref());
    let stream = watcher(slices, watcher::Config::default()).default_backoff();
    tokio::pin!(stream);
    let mut listing: Option<HashMap<ServiceKey, BTreeMap<String, EndpointSlice>>> = None;
    let key = |s: &EndpointSlice| -> Option<(ServiceKey, String)> {
        let namespace = s.metadata.namespace.clone()?;
        let service = s
            .metadata
            .labels
            .as_ref()?
            .get("kubernetes.io/service-name")?
            .clone();
        Some((
            ServiceKey {
                namespace,
                name: service,
            },
            s.metadata.name.clone()?,
        ))
    };
    let mut complaints = Complaints::default();
    let mut guard = orch
        .access
        .watch(watched("EndpointSlices", orch.options.namespace.as_deref()));
    loop {
        let event = tokio::select! {
            e = stream.next() => e,
            _ = stop.changed() => return,
        };
        if let Some(item) = &event
            && let Some(delay) = guard.saw(item)
        {
            if !crate::health::pause(delay, &mut stop).await {
                return;
            }
            continue;
        }
        let event = match event {
            None => return,
            Some(Err(e)) => {
                complaints.failed("watching EndpointSlices", &e);
                continue;
            }
            Some(Ok(e)) => {
                complaints.worked("watching EndpointSlices");
                e
            }
        };
        match event {
            watcher::Event::Init => listing = Some(HashMap::new()),
            watcher::Event::InitApply(s) => {
                if let (Some(l), Some((k, n))) = (listing.as_mut(), key(&s)) {
                    l.entry(k).or_default().insert(n, s);
                }
            }
            watcher::Event::InitDone => {
                orch.lock().slices = listing.take().unwrap_or_default();
                orch.slices_listed
                    .store(true, std::sync::atomic::Ordering::Release);
                orch.changed();
            }
            watcher::Event::Apply(s) => {
                if let Some((k, n)) = key(&s) {
                    orch.lock().slices.entry(k).or_default().insert(n, s);
                    orch.changed();
                }
            }
            watcher::Event::Delete(s) => {
                if let Some((k, n)) = key(&s) {
                    let mut inner = orch.lock();
                    if let Some(m) = inner.slices.get_mut(&k) {
                        m.remove(&n);
                        if m.is_empty() {
                            inner.slices.remove(&k);
                        }
                    }
                    drop(inner);
                    orch.changed();
                }
            }
        }
    }
}

/// Writes asked replicas, the newest per workload, until `stop`.
/// A scaling reason as a Kubernetes Event's reason and note.
fn explain(reason: Option<crate::event::ScaleReason>) -> (&'static str, &'static str) {
    use crate::event::ScaleReason::*;
    match reason {
        Some(Wake) => ("Wake", "a request arrived and no replica was ready"),
        Some(Idle) => ("Idle", "no request for its idle time on any ebb replica"),
        Some(Autoscale) => ("Autoscale", "the function autoscaler's call counter"),
        Some(Manual) => ("Manual", "an operator asked"),
        Some(Restart) => ("Restart", "ebb restarted"),
        Some(Shutdown) => ("Shutdown", "ebb is shutting down"),
        Some(Peer) => ("Peer", "another ebb replica or an operator changed it"),
        Some(Warm) => ("Warm", "a keep-warm window is open"),
        Some(Load(_)) => ("Load", "the route's load asks for it"),
        None => ("Scaled", "asked by ebb"),
    }
}

async fn run_scaler(log: Arc<Log>, orch: Arc<KubeOrchestrator>, mut stop: watch::Receiver<bool>) {
    let mut complaints = Complaints::default();
    loop {
        let next = {
            let mut inner = orch.lock();
            inner.workloads.iter_mut().find_map(|(k, t)| {
                let n = t.pending.take()?;
                t.writes_begun += 1;
                Some((k.clone(), t.workload.clone(), n))
            })
        };
        let Some((key, workload, replicas)) = next else {
            tokio::select! {
                _ = orch.scale_asked.notified() => continue,
                _ = stop.changed() => return,
            }
        };
        orch.weigh_pods(&key, &workload, replicas).await;
        let mut delay = Duration::from_millis(100);
        let mut attempt = 1;
        let outcome = loop {
            match orch.write_scale(&workload, replicas).await {
                Ok(()) => break Ok(()),
                Err(e) if attempt < orch.options.scale_attempts && retryable(&e) => {
                    tracing::warn!(deployment = %key, replicas, attempt, error = %e, "scale write failed; retrying");
                    // A newer ask replaces this one.
                    let newer = orch
                        .lock()
                        .workloads
                        .get(&key)
                        .is_none_or(|t| t.pending.is_some());
                    if newer {
                        break Ok(());
                    }
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = stop.changed() => return,
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                    attempt += 1;
                }
                Err(e) => break Err(e),
            }
        };
        if let Some(t) = orch.lock().workloads.get_mut(&key) {
            t.writes_done += 1;
        }
        match outcome {
            Ok(()) => {
                complaints.worked(&format!("scaling {key}"));
                let reason = log.read(|s| s.routes.deployments.get(&key).and_then(|d| d.reason));
                tracing::info!(deployment = %key, replicas, ?reason, "scaled");
                let (name, why) = explain(reason);
                orch.publish(
                    &workload_reference(&workload),
                    EventType::Normal,
                    name,
                    format!(
                        "ebb set replicas to {replicas}: {why} (`ebb explain deployment {key}`)"
                    ),
                )
                .await;
            }
            Err(e) => {
                let why = format!("scaling {} to {replicas}: {e}", key);
                complaints.failed(&format!("scaling {key}"), &e);
                orch.publish(
                    &workload_reference(&workload),
                    EventType::Warning,
                    "ScaleFailed",
                    why.clone(),
                )
                .await;
                orch.fail(&key, why);
            }
        }
    }
}

/// Reads every workload's replicas back each `sync_interval_ms` (and a new one at once),
/// labels it once, and records changes made by others.
async fn run_sync(log: Arc<Log>, orch: Arc<KubeOrchestrator>, mut stop: watch::Receiver<bool>) {
    let interval = Duration::from_millis(orch.options.sync_interval_ms.max(100));
    // The first read of a workload also labels it; later ones only read.
    let mut missing: HashSet<String> = HashSet::new();
    loop {
        let due: Vec<(String, Workload, bool, u64)> = {
            let inner = orch.lock();
            inner
                .workloads
                .iter()
                .filter(|(_, t)| t.pending.is_none() && t.writes_begun == t.writes_done)
                .map(|(k, t)| (k.clone(), t.workload.clone(), t.labelled, t.writes_begun))
                .collect()
        };
        for (key, workload, labelled, writes) in due {
            if !labelled {
                match orch.label(&workload).await {
                    Ok(()) => {
                        if let Some(t) = orch.lock().workloads.get_mut(&key) {
                            t.labelled = true;
                        }
                    }
                    Err(e) => {
                        if missing.insert(key.clone()) {
                            tracing::warn!(deployment = %key, error = %e, "cannot label the workload");
                        }
                    }
                }
            }
            let replicas = match orch.read_scale(&workload).await {
                Ok(n) => {
                    missing.remove(&key);
                    n
                }
                Err(e) => {
                    if missing.insert(key.clone()) {
                        tracing::warn!(deployment = %key, error = %e, "cannot read the workload's replicas");
                    }
                    continue;
                }
            };
            let current = {
                let mut inner = orch.lock();
                match inner.workloads.get_mut(&key) {
                    Some(t)
                        if t.pending.is_none()
                            && t.writes_begun == writes
                            && t.writes_done == writes =>
                    {
                        let moved = t.desired != Some(replicas);
                        t.desired = Some(replicas);
                        Some(moved)
                    }
                    _ => None,
                }
            };
            let Some(moved) = current else { continue };
            if moved {
                orch.changed();
            }
            let d = key.clone();
            let decided = log
                .decide(move |s: &State, _| {
                    let shared = crate::scaler::shared::SharedDeployment {
                        replicas,
                        ..Default::default()
                    };
                    let ev = s
                        .routes
                        .deployments
                        .contains_key(&d)
                        .then(|| crate::scaler::shared::decide_peer(s, &d, &shared))
                        .flatten();
                    (ev.into_iter().collect(), ())
                })
                .await;
            if let Err(e) = decided {
                tracing::warn!(error = %e, "recording replicas changed by others failed");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = orch.sync_asked.notified() => {}
            _ = stop.changed() => return,
        }
    }
}

/// How the replicas of ebb share scaling ([`crate::scaler::member`] driven against the API
/// server).
#[derive(Debug, Clone)]
pub struct SharedScaling {
    /// The protocol's timing.
    pub options: SharedOptions,
    /// The namespace and name of the leadership Lease.
    pub lease_namespace: String,
    pub lease_name: String,
    /// How often the leader looks for idle workloads.
    pub downscale_every_ms: u64,
    /// A test hook: before each scale-down write, create `held` in this directory and wait until
    /// `release` appears there (at most a minute), so a test can race a bump against it.
    pub gate: Option<PathBuf>,
    /// Whether this replica holds the lease now (for the work only the holder does).
    pub leading: Arc<std::sync::atomic::AtomicBool>,
    /// The holder of the lease as last read (`None`: none, or it ran out), for the work the
    /// others send it.
    pub holder: Arc<std::sync::RwLock<Option<String>>>,
}

impl SharedScaling {
    /// The protocol's timing from the bump interval, the lease and the clock skew allowed:
    /// the lag the leader adds to the annotation covers a bump interval, twice the skew and a
    /// bump's retries landing (two seconds).
    pub fn timing(sync_ms: u64, lease_ms: u64, max_skew_ms: u64) -> SharedOptions {
        SharedOptions {
            sync_ms,
            sync_lag_ms: sync_ms + 2 * max_skew_ms + 2_000,
            lease_ms,
            max_skew_ms,
        }
    }
}

impl Default for SharedScaling {
    fn default() -> Self {
        Self {
            options: Self::timing(5_000, 15_000, 500),
            lease_namespace: "default".to_owned(),
            lease_name: "ebb-scaler".to_owned(),
            downscale_every_ms: 1_000,
            gate: None,
            leading: Arc::default(),
            holder: Arc::default(),
        }
    }
}

/// What the protocol's request chains share.
struct Driver {
    log: Arc<Log>,
    orch: Arc<KubeOrchestrator>,
    store: KubeCoordinator,
    member: Mutex<Member>,
    traffic: Arc<Traffic>,
    clock: Arc<dyn Clock>,
    gate: Option<PathBuf>,
    complaints: Mutex<Complaints>,
}

impl Driver {
    /// The unflushed traffic of a deployment's routes.
    fn live(&self, deployment: &str) -> Live {
        let routes: Vec<String> = self.log.read(|s| {
            s.routes
                .routes_of(deployment)
                .map(|r| r.spec.name.clone())
                .collect()
        });
        ebb_proxy::runtime::live_of(&self.traffic, &routes)
    }

    /// Sends `request` and whatever the protocol asks next, until it is done.
    async fn chain(self: Arc<Self>, mut request: Request, mut attempt: u32) {
        let name = self.member.lock().expect("member lock").name().to_owned();
        loop {
            if let (Request::ScaleDown { deployment, .. }, Some(gate)) = (&request, &self.gate) {
                hold(gate, deployment).await;
            }
            let answer = member::send(&self.store, &name, &request).await;
            let what = match &request {
                Request::ReadLease | Request::TakeLease { .. } => "the scale-down Lease",
                Request::Touch { .. } => "publishing a workload's last use",
                Request::Read { .. } | Request::ScaleDown { .. } => "a scale-down",
            };
            {
                let mut complaints = self.complaints.lock().expect("complaints lock");
                match &answer {
                    // A conflict is the protocol working, not a failure.
                    Err(crate::scaler::shared::CoordError::Conflict) | Ok(_) => {
                        complaints.worked(what)
                    }
                    Err(e) => complaints.failed(what, e),
                }
            }
            let live = match &request {
                Request::Read { deployment } => self.live(deployment),
                _ => Live::default(),
            };
            let now = self.clock.now_ms();
            let next = self.log.read(|s| {
                let mut member = self.member.lock().expect("member lock");
                // What the others published is known from now on, as the simulator's replicas
                // learn it: the leader reads a workload used elsewhere again only once that use
                // may have gone idle.
                if let (Request::Read { deployment }, Ok(member::Answer::Deployment(d))) =
                    (&request, &answer)
                {
                    member.saw(deployment, d.last_used_ms);
                }
                member.answer(request, answer, attempt, s, live, now)
            });
            match next {
                Next::Done => return,
                Next::Send {
                    request: r,
                    attempt: a,
                } => {
                    if a > 0 {
                        let backoff = Duration::from_millis(100 << a.min(6));
                        tokio::time::sleep(backoff).await;
                    }
                    request = r;
                    attempt = a;
                }
                Next::Record(decision) => {
                    let (deployment, to) = match &*decision {
                        Event::ScaleRequested { deployment, to, .. } => (deployment.clone(), *to),
                        _ => return,
                    };
                    tracing::info!(%deployment, to, "idle: scaled down");
                    if let Err(e) = self.log.append(*decision).await {
                        tracing::warn!(error = %e, "recording a scale-down failed");
                    }
                    self.orch.scaled(&deployment, to);
                    if let Some(w) = Workload::from_key(&deployment) {
                        let (name, why) = explain(Some(crate::event::ScaleReason::Idle));
                        self.orch
                            .publish(
                                &workload_reference(&w),
                                EventType::Normal,
                                name,
                                format!(
                                    "ebb scaled it to {to}: {why} \
                                     (`ebb explain deployment {deployment}`)"
                                ),
                            )
                            .await;
                    }
                    return;
                }
                Next::Refused => {
                    tracing::info!(
                        "scale-down refused with 409 Conflict: the workload changed (used) since \
                         it was read"
                    );
                    return;
                }
            }
        }
    }
}

/// The test gate before a scale-down write ([`SharedScaling::gate`]).
async fn hold(gate: &std::path::Path, deployment: &str) {
    let _ = std::fs::write(gate.join("held"), deployment);
    let released = async {
        while !gate.join("release").exists() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(60), released).await;
}

/// Drives the shared-scaling protocol for this replica of ebb until `stop`: the lease, the bumps
/// of the last-used annotation, and (while leading) the conditioned scale-downs of idle
/// workloads. Replaces the single-machine downscaler when ebb runs on Kubernetes.
pub async fn run_shared(
    log: Arc<Log>,
    orch: Arc<KubeOrchestrator>,
    traffic: Arc<Traffic>,
    clock: Arc<dyn Clock>,
    shared: SharedScaling,
    mut stop: watch::Receiver<bool>,
) {
    let o = shared.options;
    let leading_now = shared.leading.clone();
    let holder_now = shared.holder.clone();
    let events = orch.clone();
    let mut told = false;
    let started_ms = clock.now_ms();
    let driver = Arc::new(Driver {
        store: KubeCoordinator::new(
            orch.client.clone(),
            &shared.lease_namespace,
            &shared.lease_name,
            o.lease_ms,
            &orch.options.instance,
        ),
        member: Mutex::new(Member::new(&orch.options.instance, o)),
        log,
        orch,
        traffic,
        clock,
        gate: shared.gate,
        complaints: Mutex::default(),
    });
    let every = |ms: u64| {
        let mut t = tokio::time::interval(Duration::from_millis(ms.max(1)));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    };
    let mut lease = every(o.lease_ms / 3 + 1);
    let mut sync = every(o.sync_ms / 2 + 1);
    let mut down = every(shared.downscale_every_ms);
    let mut was_leading = false;
    loop {
        let which = tokio::select! {
            _ = lease.tick() => 0,
            _ = sync.tick() => 1,
            _ = down.tick() => 2,
            _ = stop.changed() => return,
        };
        let now = driver.clock.now_ms();
        // The deployments of Service routes this replica tracks, with what the log asks.
        let deployments: Vec<(String, u32)> = driver.log.read(|s| {
            s.routes
                .by_deployment
                .keys()
                .filter(|d| Workload::from_key(d).is_some())
                .map(|d| {
                    let desired = s.routes.deployments.get(d).map_or(0, |x| x.desired);
                    (d.clone(), desired)
                })
                .collect()
        });
        let mut requests = Vec::new();
        {
            let mut m = driver.member.lock().expect("member lock");
            m.retain(|d| deployments.iter().any(|(x, _)| x == d));
            match which {
                0 => requests.extend(m.lease_tick()),
                1 => {
                    for (d, _) in &deployments {
                        let live = driver.live(d);
                        requests.extend(m.touch_check(d, live.last_at_ms, live.in_flight, now));
                    }
                }
                _ => {
                    let leading = m.leads(now);
                    let lease = m.lease();
                    let holder = lease
                        .holder
                        .clone()
                        .filter(|_| now < lease.until_ms.saturating_add(o.max_skew_ms));
                    *holder_now.write().unwrap_or_else(|e| e.into_inner()) = holder;
                    // Not leading is an answer once the Lease had time to be taken (two lease
                    // periods), or when leadership was lost.
                    let settled =
                        leading || was_leading || now.saturating_sub(started_ms) >= 2 * o.lease_ms;
                    if settled && (leading != was_leading || !told) {
                        told = true;
                        let events = events.clone();
                        tokio::spawn(async move { events.set_leading(leading).await });
                    }
                    if leading != was_leading {
                        tracing::info!(replica = m.name(), leading, "scale-down leadership");
                        was_leading = leading;
                        leading_now.store(leading, std::sync::atomic::Ordering::Relaxed);
                    }
                    for (d, desired) in &deployments {
                        if *desired == 0 {
                            continue;
                        }
                        let live = driver.live(d);
                        if live.in_flight > 0 {
                            continue;
                        }
                        // Only read the workload when the replica's own view already says idle:
                        // the annotation only grows, so a read could only make it less idle.
                        let known = crate::scaler::shared::SharedDeployment {
                            replicas: *desired,
                            last_used_ms: m.known_used(d),
                            version: 0,
                        };
                        let idle = driver.log.read(|s| {
                            crate::scaler::shared::decide_downscale(
                                s,
                                d,
                                &known,
                                live,
                                now,
                                m.options(),
                            )
                            .is_some()
                        });
                        if idle {
                            requests.extend(m.downscale_tick(d, now));
                        }
                    }
                }
            }
        }
        for r in requests {
            tokio::spawn(driver.clone().chain(r, 0));
        }
    }
}

/// The name of the container port a function server listens on ([`crate::functions`]).
pub const PORT_NAME: &str = "http";

/// Runs the backend's loops until `stop` turns true (the functions' objects have their own,
/// `crate::functions::run`).
/// Tells each change of what is refused as an Event on ebb's own pod (`pod` in `namespace`): a
/// Warning `Forbidden` when a watch is refused, a Normal `Allowed` when it works again.
pub async fn tell_refusals(
    access: crate::health::Access,
    events: Arc<KubeOrchestrator>,
    pod: String,
    namespace: String,
    mut stop: watch::Receiver<bool>,
) {
    let pod = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod),
        namespace: Some(namespace),
        ..Default::default()
    };
    let mut told: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let now = access.refused();
        for (what, why) in &now {
            if !told.contains_key(what) {
                events
                    .publish(
                        &pod,
                        EventType::Warning,
                        "Forbidden",
                        format!("Kubernetes refuses ebb to watch {what}: {why}. ebb goes on without it and asks again, at most every {} s", crate::health::FORBIDDEN_MAX.as_secs()),
                    )
                    .await;
            }
        }
        for what in told.keys() {
            if !now.contains_key(what) {
                events
                    .publish(
                        &pod,
                        EventType::Normal,
                        "Allowed",
                        format!("Kubernetes allows ebb to watch {what} again"),
                    )
                    .await;
            }
        }
        told = now;
        tokio::select! {
            _ = stop.changed() => return,
            () = access.changed() => {}
        }
    }
}

pub async fn run(log: Arc<Log>, orch: Arc<KubeOrchestrator>, stop: watch::Receiver<bool>) {
    tokio::join!(
        orch.limiter.refill(stop.clone()),
        run_routes(log.clone(), orch.clone(), stop.clone()),
        run_endpoints(orch.clone(), stop.clone()),
        run_scaler(log.clone(), orch.clone(), stop.clone()),
        run_sync(log, orch.clone(), stop),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn endpoint(ip: &str, ready: Option<bool>, terminating: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.to_owned()],
            conditions: Some(EndpointConditions {
                ready,
                serving: ready,
                terminating,
            }),
            ..Endpoint::default()
        }
    }

    fn slice(ports: &[(&str, i32)], endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".to_owned(),
            endpoints: Some(endpoints),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| EndpointPort {
                        name: Some((*n).to_owned()),
                        port: Some(*p),
                        ..EndpointPort::default()
                    })
                    .collect(),
            ),
            ..EndpointSlice::default()
        }
    }

    #[test]
    fn ready_endpoints_are_the_ready_ones_not_terminating_on_the_services_port() {
        let a = slice(
            &[("", 8080)],
            vec![
                endpoint("10.0.0.2", Some(true), Some(false)),
                endpoint("10.0.0.3", Some(false), Some(false)),
                endpoint("10.0.0.4", None, None),
                endpoint("10.0.0.5", Some(false), Some(true)),
            ],
        );
        // The same endpoint in two slices (a slice being replaced) counts once.
        let b = slice(&[("", 8080)], vec![endpoint("10.0.0.2", Some(true), None)]);
        let (ready, terminating) = ready_addresses([&a, &b], None);
        assert_eq!(
            ready,
            vec![
                "10.0.0.2:8080".parse().unwrap(),
                "10.0.0.4:8080".parse().unwrap()
            ]
        );
        assert_eq!(terminating, 1);

        let named = slice(
            &[("metrics", 9090), ("http", 8080)],
            vec![endpoint("10.0.0.7", Some(true), None)],
        );
        let (ready, _) = ready_addresses([&named], Some("http"));
        assert_eq!(ready, vec!["10.0.0.7:8080".parse().unwrap()]);
        let (ready, _) = ready_addresses([&named], Some("grpc"));
        assert!(ready.is_empty());
    }

    fn route(name: &str, domain: &str) -> RouteSpec {
        RouteSpec {
            name: name.to_owned(),
            domains: vec![domain.to_owned()],
            deployment: name.to_owned(),
            idle_after_ms: 1_000,
            min_replicas: 0,
            max_replicas: 1,
            hold_timeout_ms: 1_000,
            hold_queue_max: 10,
            process: None,
            concurrency: 0,
            max_connecting: 0,
            policy: Default::default(),
            ..Default::default()
        }
    }

    #[test]
    fn service_routes_follow_the_services_and_never_take_a_configured_domain() {
        let mut state = State::default();
        let mut seq = 0;
        let mut apply = |state: &mut State, events: Vec<Event>| {
            for event in events {
                seq += 1;
                state.apply(&crate::event::Envelope {
                    seq,
                    at_ms: seq,
                    version: crate::event::SCHEMA_VERSION,
                    event,
                });
            }
        };
        apply(
            &mut state,
            vec![Event::RouteUpserted {
                route: Box::new(route("local", "local.test")),
            }],
        );
        let a = route("default/a", "a.test");
        let (events, refused) = decide_routes(&state, std::slice::from_ref(&a));
        assert_eq!(
            events,
            vec![Event::RouteUpserted {
                route: Box::new(a.clone())
            }]
        );
        assert!(refused.is_empty());
        apply(&mut state, events);
        // Unchanged: nothing to do.
        assert_eq!(decide_routes(&state, std::slice::from_ref(&a)).0, vec![]);
        // A Service that claims a configured route's domain is refused; the Service route gone
        // from the list is removed; the configured route stays.
        let thief = route("default/b", "local.test");
        let (events, refused) = decide_routes(&state, &[thief]);
        assert_eq!(
            events,
            vec![Event::RouteRemoved {
                name: "default/a".to_owned()
            }]
        );
        assert_eq!(refused.len(), 1);
        assert!(refused[0].1.contains("local.test"), "{refused:?}");
    }
}
