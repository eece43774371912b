//! Cleaners on Kubernetes: `Cleaner` resources are watched and recorded in the log; each
//! target kind is watched once (kube-runtime's watcher on the dynamic API, paged lists, a
//! reflector's cached reads); a change to a target re-evaluates exactly the cleaners whose
//! targets match it (an index by object and by label selector); firing deletes each target with
//! a fresh read and a delete conditioned on its uid and resourceVersion, with foreground
//! propagation (the TTL-after-finished controller's way), then the Cleaner.
//!
//! A Cleaner is recorded (`CleanerUpserted`) only when its spec changed, so a restart moves no
//! schedule. Each target kind is discovered and watched once. Status and Events are written as
//! evaluations are recorded, and a Cleaner holds a finalizer only while firing.
//!
//! Only the holder of ebb's lease runs it, so one replica decides.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, Preconditions};
use kube::core::{ApiResource, GroupVersion};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::{mpsc, watch};

use crate::clock::Clock;
use crate::event::CleanerSpec;
use crate::log::Log;
use crate::state::State;

use ebb_cleaner::rfc3339;
use ebb_cleaner::runtime::{Backend, Cleaners, Deleted, Options, Resolved};
use ebb_cleaner::spec::{
    CleanerResource, CleanerStatus, ConditionResult, LastEvaluation, Ref, StatusCondition, to_spec,
};

/// The finalizer a Cleaner carries while it fires: a Cleaner deleted by hand before it fires
/// has none, so nothing holds it and its targets stay.
pub const FINALIZER: &str = "cleaner.ebb.dev/firing";

/// The field manager of ebb's writes.
const MANAGER: &str = "ebb-cleaner";

/// One kind of target: how to reach it and its cache.
struct Kind {
    resource: ApiResource,
    store: Store<DynamicObject>,
    /// The watch feeding `store`, stopped when no Cleaner names the kind any more.
    task: tokio::task::AbortHandle,
}

impl Drop for Kind {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The watched kinds (`kind_key`s) that none of `specs` names any more.
fn unused<'a>(
    watched: impl Iterator<Item = &'a (String, String)>,
    specs: &[CleanerSpec],
) -> Vec<(String, String)> {
    let named: HashSet<(String, String)> = specs
        .iter()
        .flat_map(|s| s.targets.iter())
        .filter_map(|t| Ref::parse(&t.reference).ok())
        .map(|r| kind_key(&r.api_version, &r.kind))
        .collect();
    watched.filter(|k| !named.contains(*k)).cloned().collect()
}

/// A label selector.
type Labels = BTreeMap<String, String>;

/// A kind found and watched, or why not.
type Found = Result<Arc<Kind>, String>;

/// The cleaners that reference objects: by object, and by label selector per kind and namespace.
#[derive(Default)]
struct Index {
    by_object: HashMap<(String, String, String), BTreeSet<String>>,
    by_selector: HashMap<(String, String), BTreeMap<String, Vec<Labels>>>,
    /// What each cleaner put in the index, to take it out again.
    entries: HashMap<String, Vec<Ref>>,
}

/// The Kubernetes backend of the cleaner loop.
pub struct KubeTargets {
    client: Client,
    kinds: Mutex<HashMap<(String, String), Found>>,
    index: Arc<Mutex<Index>>,
    changed: mpsc::Sender<String>,
    recorder: Recorder,
    /// The last reason shown per cleaner, so an Event is published when it changes.
    shown: Mutex<HashMap<String, String>>,
    /// Watches stop with this.
    stop: watch::Receiver<bool>,
    /// A `helm` program to uninstall releases with (none: releases cannot be uninstalled yet).
    helm: Option<std::path::PathBuf>,
    /// Watch targets in this namespace only (`None`: all).
    namespace: Option<String>,
    /// The time a blocked firing's condition changed.
    clock: Arc<dyn Clock>,
}

fn kind_key(api_version: &str, kind: &str) -> (String, String) {
    (api_version.to_owned(), kind.to_ascii_lowercase())
}

fn split_key(name: &str) -> (&str, &str) {
    name.split_once('/').unwrap_or(("", name))
}

impl KubeTargets {
    pub fn new(
        client: Client,
        instance: &str,
        changed: mpsc::Sender<String>,
        stop: watch::Receiver<bool>,
        helm: Option<std::path::PathBuf>,
        namespace: Option<String>,
        clock: Arc<dyn Clock>,
    ) -> Arc<Self> {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "ebb-cleaner".to_owned(),
                instance: Some(instance.to_owned()),
            },
        );
        Arc::new(KubeTargets {
            client,
            kinds: Mutex::new(HashMap::new()),
            index: Arc::new(Mutex::new(Index::default())),
            changed,
            recorder,
            shown: Mutex::new(HashMap::new()),
            stop,
            helm,
            namespace,
            clock,
        })
    }

    fn kind(&self, api_version: &str, kind: &str) -> Option<Result<Arc<Kind>, String>> {
        self.kinds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&kind_key(api_version, kind))
            .cloned()
    }

    /// Finds and starts watching every kind `spec`'s targets name (once per kind; a kind that
    /// could not be found is looked up again on the next call), waiting for each new cache's
    /// first list.
    pub async fn ensure_kinds(&self, spec: &CleanerSpec) {
        for t in &spec.targets {
            let Ok(r) = Ref::parse(&t.reference) else {
                continue;
            };
            if matches!(self.kind(&r.api_version, &r.kind), Some(Ok(_))) {
                continue;
            }
            let found = self.watch_kind(&r.api_version, &r.kind).await;
            self.kinds
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(kind_key(&r.api_version, &r.kind), found);
        }
    }

    async fn watch_kind(&self, api_version: &str, kind: &str) -> Result<Arc<Kind>, String> {
        let gv: GroupVersion = api_version
            .parse()
            .map_err(|e| format!("apiVersion {api_version:?}: {e}"))?;
        let group = kube::discovery::pinned_group(&self.client, &gv)
            .await
            .map_err(|e| format!("apiVersion {api_version:?} is not served: {e}"))?;
        let lower = kind.to_ascii_lowercase();
        let (resource, _) = group
            .versioned_resources(&gv.version)
            .into_iter()
            .find(|(r, _)| {
                r.kind.to_ascii_lowercase() == lower
                    || r.plural == lower
                    || r.plural.trim_end_matches('s') == lower
            })
            .ok_or_else(|| format!("kind {kind:?} is not served in {api_version}"))?;
        let api: Api<DynamicObject> = match &self.namespace {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
            None => Api::all_with(self.client.clone(), &resource),
        };
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        let stream = reflector::reflector(
            writer,
            // Backed off when failing (a missing permission, the API server away), never a
            // tight loop of requests.
            watcher(api, watcher::Config::default().page_size(500)).default_backoff(),
        );
        let index = self.index.clone();
        let changed = self.changed.clone();
        let key = format!("{api_version}/{lower}");
        let mut stop = self.stop.clone();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                let event = tokio::select! {
                    _ = stop.changed() => return,
                    e = stream.next() => match e { Some(e) => e, None => return },
                };
                let objects: Vec<DynamicObject> = match event {
                    Ok(watcher::Event::Apply(o) | watcher::Event::Delete(o)) => vec![o],
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::debug!(kind = %key, error = %e, "target watch failed; it retries");
                        continue;
                    }
                };
                for o in objects {
                    let names = matching(&index, &key, &o);
                    for n in names {
                        if changed.send(n).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        let ready = tokio::time::timeout(Duration::from_secs(30), store.wait_until_ready()).await;
        if !matches!(ready, Ok(Ok(()))) {
            task.abort();
            return Err(format!("listing {kind} in {api_version} did not complete"));
        }
        Ok(Arc::new(Kind {
            resource,
            store,
            task: task.abort_handle(),
        }))
    }

    /// Stops watching the kinds no Cleaner in `specs` (those the log still has) names.
    pub fn release_unused(&self, specs: &[CleanerSpec]) {
        let mut kinds = self.kinds.lock().unwrap_or_else(|e| e.into_inner());
        for key in unused(kinds.keys(), specs) {
            // Dropping the last handle of the kind aborts its watch (a firing under way holds
            // its own until it is done).
            kinds.remove(&key);
            tracing::info!(kind = %format!("{}/{}", key.0, key.1), "no Cleaner names this kind any more: its watch stops");
        }
    }

    /// Puts `spec`'s targets in the index (replacing what it had there).
    pub fn index(&self, spec: &CleanerSpec) {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        unindex(&mut index, &spec.name);
        let refs: Vec<Ref> = spec
            .targets
            .iter()
            .filter_map(|t| Ref::parse(&t.reference).ok())
            .collect();
        for r in &refs {
            let key = format!("{}/{}", r.api_version, r.kind.to_ascii_lowercase());
            match &r.name {
                Some(n) => {
                    index
                        .by_object
                        .entry((key, spec.namespace.clone(), n.clone()))
                        .or_default()
                        .insert(spec.name.clone());
                }
                None => index
                    .by_selector
                    .entry((key, spec.namespace.clone()))
                    .or_default()
                    .entry(spec.name.clone())
                    .or_default()
                    .push(r.labels.clone()),
            }
        }
        index.entries.insert(spec.name.clone(), refs);
    }

    /// Takes a cleaner out of the index.
    pub fn unindex(&self, name: &str) {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        unindex(&mut index, name);
    }

    /// Adds (`on`) or removes ebb's finalizer on the Cleaner named by `spec`, on a fresh read and
    /// conditioned on its `resourceVersion`. A write that lost to another (409: ebb's own status
    /// patch, a user's edit) is read and tried again, at most five times. True when it wrote;
    /// false when there was nothing to do (no such Cleaner, the finalizer already as asked).
    async fn set_finalizer(&self, spec: &CleanerSpec, on: bool) -> Result<bool, String> {
        let api = self.cleaner_api(spec);
        let (_, name) = split_key(&spec.name);
        let mut last = String::new();
        for _ in 0..5 {
            let Some(c) = api.get_opt(name).await.map_err(|e| e.to_string())? else {
                return Ok(false);
            };
            if c.uid().as_deref() != Some(spec.uid.as_str()) {
                return if on {
                    Err("the Cleaner was replaced".into())
                } else {
                    Ok(false)
                };
            }
            if c.finalizers().iter().any(|f| f == FINALIZER) == on {
                return Ok(false);
            }
            let mut finalizers: Vec<String> = c
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .cloned()
                .collect();
            if on {
                finalizers.push(FINALIZER.to_owned());
            }
            let patch = serde_json::json!({
                "metadata": {"finalizers": finalizers, "resourceVersion": c.resource_version()}
            });
            match api
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(true),
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(false),
                Err(kube::Error::Api(s)) if s.code == 409 => last = s.message,
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!("five writes lost to others; the last: {last}"))
    }

    fn cleaner_api(&self, spec: &CleanerSpec) -> Api<CleanerResource> {
        Api::namespaced(self.client.clone(), &spec.namespace)
    }

    async fn publish(&self, spec: &CleanerSpec, type_: EventType, reason: &str, note: String) {
        let (ns, name) = split_key(&spec.name);
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(CleanerResource::api_version(&()).into_owned()),
            kind: Some(CleanerResource::kind(&()).into_owned()),
            namespace: Some(ns.to_owned()),
            name: Some(name.to_owned()),
            uid: (!spec.uid.is_empty()).then(|| spec.uid.clone()),
            ..Default::default()
        };
        let event = KubeEvent {
            type_,
            reason: reason.to_owned(),
            note: Some(note.chars().take(1_000).collect()),
            action: "Clean".to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &reference).await {
            tracing::warn!(cleaner = %spec.name, error = %e, "cannot publish a Kubernetes Event");
        }
    }

    async fn uninstall(&self, namespace: &str, release: &str) -> Result<Deleted, String> {
        let Some(helm) = &self.helm else {
            return Err(format!(
                "Helm release {release}: no helm program configured (--cleaner-helm)"
            ));
        };
        let out = tokio::process::Command::new(helm)
            .args(["uninstall", release, "--namespace", namespace, "--wait"])
            .output()
            .await
            .map_err(|e| format!("running {}: {e}", helm.display()))?;
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            Ok(Deleted::Deleted)
        } else if err.contains("not found") {
            Ok(Deleted::Gone)
        } else {
            Err(format!("helm uninstall {release}: {}", err.trim()))
        }
    }
}

fn unindex(index: &mut Index, name: &str) {
    index.by_object.retain(|_, set| {
        set.remove(name);
        !set.is_empty()
    });
    index.by_selector.retain(|_, m| {
        m.remove(name);
        !m.is_empty()
    });
    index.entries.remove(name);
}

/// The cleaners whose targets match object `o` of kind `key` (`apiVersion/kind`).
fn matching(index: &Mutex<Index>, key: &str, o: &DynamicObject) -> Vec<String> {
    let index = index.lock().unwrap_or_else(|e| e.into_inner());
    let ns = o.namespace().unwrap_or_default();
    let mut names: BTreeSet<String> = index
        .by_object
        .get(&(key.to_owned(), ns.clone(), o.name_any()))
        .cloned()
        .unwrap_or_default();
    if let Some(selectors) = index.by_selector.get(&(key.to_owned(), ns)) {
        let labels = o.labels();
        for (cleaner, sels) in selectors {
            if sels
                .iter()
                .any(|s| s.iter().all(|(k, v)| labels.get(k) == Some(v)))
            {
                names.insert(cleaner.clone());
            }
        }
    }
    names.into_iter().collect()
}

/// An object as `resolvedTargets` names it: `name.plural.group/version`.
fn resolved_name(r: &ApiResource, name: &str) -> String {
    format!("{name}.{}.{}", r.plural, r.api_version)
}

impl Backend for KubeTargets {
    async fn prepare(&self, spec: &CleanerSpec) {
        self.ensure_kinds(spec).await;
    }

    fn resolve(&self, spec: &CleanerSpec) -> Result<Resolved, String> {
        let mut out = Resolved::default();
        for t in &spec.targets {
            let r = Ref::parse(&t.reference)?;
            let kind = match self.kind(&r.api_version, &r.kind) {
                Some(Ok(k)) => k,
                Some(Err(e)) => return Err(format!("target {}: {e}", t.name)),
                None => {
                    return Err(format!(
                        "target {}: {} {} is not watched yet",
                        t.name, r.api_version, r.kind
                    ));
                }
            };
            let res = &kind.resource;
            let objects: Vec<Arc<DynamicObject>> = match &r.name {
                Some(n) => kind
                    .store
                    .get(&ObjectRef::new_with(n, res.clone()).within(&spec.namespace))
                    .into_iter()
                    .collect(),
                None => {
                    let mut v = kind.store.state_filter(|o| {
                        o.namespace().as_deref() == Some(spec.namespace.as_str())
                            && r.labels
                                .iter()
                                .all(|(k, val)| o.labels().get(k) == Some(val))
                    });
                    v.sort_by_key(|o| o.name_any());
                    v
                }
            };
            for o in &objects {
                out.objects.push(resolved_name(res, &o.name_any()));
                if t.delete && o.metadata.deletion_timestamp.is_none() {
                    out.deletions.push(format!(
                        "{}/{}/{}/{}@{}",
                        res.api_version,
                        res.kind,
                        spec.namespace,
                        o.name_any(),
                        o.uid().unwrap_or_default()
                    ));
                }
            }
            if t.include_when_evaluating {
                let value = match &r.name {
                    Some(_) => objects
                        .first()
                        .map(|o| serde_json::to_value(o.as_ref()).unwrap_or_default())
                        .unwrap_or(serde_json::Value::Null),
                    None => serde_json::json!({
                        "items": objects
                            .iter()
                            .map(|o| serde_json::to_value(o.as_ref()).unwrap_or_default())
                            .collect::<Vec<_>>()
                    }),
                };
                out.inputs.push((t.name.clone(), value));
            }
        }
        if !spec.helm_release.is_empty() {
            out.deletions
                .push(format!("helm/{}/{}", spec.namespace, spec.helm_release));
        }
        Ok(out)
    }

    async fn begin(&self, spec: &CleanerSpec, entries: &[String]) -> Result<(), String> {
        let added = self
            .set_finalizer(spec, true)
            .await
            .map_err(|e| format!("adding the finalizer: {e}"))?;
        if added {
            self.publish(
                spec,
                EventType::Warning,
                "Deleting",
                format!(
                    "conditions hold past the TTL: deleting {}",
                    entries.join(", ")
                ),
            )
            .await;
        }
        Ok(())
    }

    async fn delete(&self, spec: &CleanerSpec, entry: &str) -> Result<Deleted, String> {
        if let Some(rest) = entry.strip_prefix("helm/") {
            let (ns, release) = rest.split_once('/').ok_or("malformed Helm entry")?;
            return self.uninstall(ns, release).await;
        }
        let (path, uid) = entry.rsplit_once('@').ok_or("an entry without a uid")?;
        let mut parts = path.rsplitn(4, '/');
        let (Some(name), Some(ns), Some(kind), Some(api_version)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(format!("malformed entry {entry}"));
        };
        let kind = match self.kind(api_version, kind) {
            Some(Ok(k)) => k,
            _ => {
                self.ensure_kinds(&CleanerSpec {
                    targets: vec![crate::event::CleanerTarget {
                        reference: format!("{api_version}/{kind}/{name}"),
                        ..Default::default()
                    }],
                    ..spec.clone()
                })
                .await;
                match self.kind(api_version, kind) {
                    Some(Ok(k)) => k,
                    Some(Err(e)) => return Err(e),
                    None => return Err(format!("{api_version} {kind} is not served")),
                }
            }
        };
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), ns, &kind.resource);
        for _ in 0..5 {
            // A fresh read, never the cache: the object to delete is the one resolved, and no
            // other created since under its name.
            let Some(o) = api.get_opt(name).await.map_err(|e| e.to_string())? else {
                return Ok(Deleted::Gone);
            };
            if o.uid().as_deref() != Some(uid) || o.metadata.deletion_timestamp.is_some() {
                return Ok(Deleted::Gone);
            }
            let dp = DeleteParams::foreground().preconditions(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: o.resource_version(),
            });
            match api.delete(name, &dp).await {
                Ok(_) => return Ok(Deleted::Deleted),
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Deleted::Gone),
                // Changed since read: read again.
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!("{entry} kept changing"))
    }

    async fn finish(&self, spec: &CleanerSpec) -> Result<(), String> {
        let api = self.cleaner_api(spec);
        let (_, name) = split_key(&spec.name);
        let dp = DeleteParams::default().preconditions(Preconditions {
            uid: Some(spec.uid.clone()),
            resource_version: None,
        });
        match api.delete(name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
        self.set_finalizer(spec, false)
            .await
            .map(|_| ())
            .map_err(|e| format!("removing the finalizer: {e}"))
    }

    async fn blocked(&self, name: &str, spec: &CleanerSpec, step: &str, error: &str) {
        let message = format!("{step} failed: {error}; the firing is tried again later");
        let status = serde_json::json!({
            "status": {
                "conditions": [StatusCondition {
                    type_: "Ready".into(),
                    status: "False".into(),
                    reason: "DeleteFailed".into(),
                    message: message.clone(),
                    last_transition_time: rfc3339(self.clock.now_ms()),
                    observed_generation: None,
                }],
            }
        });
        let (_, short) = split_key(name);
        if let Err(e) = self
            .cleaner_api(spec)
            .patch_status(short, &PatchParams::apply(MANAGER), &Patch::Merge(&status))
            .await
        {
            tracing::debug!(cleaner = %name, error = %e, "writing a cleaner's status failed");
        }
        self.shown
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), "DeleteFailed".into());
        self.publish(spec, EventType::Warning, "DeleteFailed", message)
            .await;
    }

    async fn report(&self, name: &str, c: &crate::state::Cleaner, resolved: &[String]) {
        if c.fired_at_ms.is_some() {
            self.publish(
                &c.spec,
                EventType::Normal,
                "Fired",
                "targets deleted; the cleaner is done".into(),
            )
            .await;
            return;
        }
        let reason = if c.reason.is_empty() {
            "NotExpired".to_owned()
        } else {
            c.reason.clone()
        };
        let message = if c.reason.is_empty() {
            format!("the TTL passes at {}", rfc3339(c.expires_at_ms()))
        } else {
            c.message.clone()
        };
        let ready = if reason == "Deleting" {
            "True"
        } else {
            "False"
        };
        let now = c
            .evaluated_at_ms
            .map(rfc3339)
            .unwrap_or_else(|| rfc3339(c.created_at_ms));
        let status = CleanerStatus {
            resolved_targets: resolved.to_vec(),
            next_scheduled_evaluation: c.next_at_ms.map(rfc3339),
            last_evaluation: c.evaluated_at_ms.map(|at| LastEvaluation {
                time: rfc3339_ms(at),
                results: c
                    .results
                    .iter()
                    .enumerate()
                    .map(|(i, r)| ConditionResult {
                        index: i as u32,
                        result: Some(*r),
                    })
                    .collect(),
            }),
            would_delete: c.would_delete.clone(),
            conditions: vec![StatusCondition {
                type_: "Ready".into(),
                status: ready.into(),
                reason: reason.clone(),
                message: message.clone(),
                last_transition_time: now,
                observed_generation: None,
            }],
            observed_generation: None,
        };
        let (_, short) = split_key(name);
        let patch = serde_json::json!({ "status": status });
        if let Err(e) = self
            .cleaner_api(&c.spec)
            .patch_status(short, &PatchParams::apply(MANAGER), &Patch::Merge(&patch))
            .await
        {
            tracing::debug!(cleaner = %name, error = %e, "writing a cleaner's status failed");
        }
        // Every evaluation is an Event (the recorder folds repeats into a series); a change of
        // where the cleaner stands is logged too.
        let changed = {
            let mut shown = self.shown.lock().unwrap_or_else(|e| e.into_inner());
            shown.insert(name.to_owned(), reason.clone()).as_deref() != Some(reason.as_str())
        };
        if changed {
            tracing::info!(cleaner = %name, %reason, %message, "cleaner");
        }
        let type_ = match reason.as_str() {
            "NotExpired" | "WaitingForConditions" | "Deleting" | "DryRun" => EventType::Normal,
            _ => EventType::Warning,
        };
        // A firing's Event is the Warning naming what it deletes (`begin`).
        if reason != "Deleting" {
            self.publish(&c.spec, type_, &reason, message).await;
        }
    }
}

/// A time in RFC 3339 to the millisecond (an evaluation's, so two a second apart differ).
fn rfc3339_ms(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(i64::try_from(ms).unwrap_or(i64::MAX))
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

/// The controller's settings.
#[derive(Debug, Clone, Default)]
pub struct KubeCleanerOptions {
    /// Watch Cleaners of this namespace only (`None`: all).
    pub namespace: Option<String>,
    /// Who reports the Events (the pod's name).
    pub instance: String,
    /// A `helm` program to uninstall releases with.
    pub helm: Option<std::path::PathBuf>,
    /// The loop's settings.
    pub options: Options,
    /// Where refused watches are told (the orchestrator's).
    pub access: crate::health::Access,
}

/// Runs the cleaners while `leading` (this replica holds ebb's lease), until `stop`.
pub async fn run(
    client: Client,
    log: Arc<Log<State>>,
    clock: Arc<dyn Clock>,
    options: KubeCleanerOptions,
    leading: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        while !leading.load(Ordering::Acquire) {
            tokio::select! {
                _ = stop.changed() => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
        tracing::info!("cleaners: this replica leads; watching Cleaners");
        let (term_tx, term_rx) = watch::channel(false);
        let (changed_tx, changed_rx) = mpsc::channel(4_096);
        let targets = KubeTargets::new(
            client.clone(),
            &options.instance,
            changed_tx.clone(),
            term_rx.clone(),
            options.helm.clone(),
            options.namespace.clone(),
            clock.clone(),
        );
        let cleaners = Arc::new(
            Cleaners::new(log.clone(), clock.clone(), targets.clone(), options.options)
                .only(|n| !ebb_cleaner::config::is_local(n)),
        );
        let looping = tokio::spawn(ebb_cleaner::runtime::run(
            cleaners.clone(),
            changed_rx,
            term_rx.clone(),
        ));
        let watching = tokio::spawn(watch_cleaners(
            client.clone(),
            options.access.clone(),
            options.namespace.clone(),
            cleaners,
            changed_tx,
            term_rx,
        ));
        loop {
            tokio::select! {
                _ = stop.changed() => { let _ = term_tx.send(true); let _ = looping.await; let _ = watching.await; return; }
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            if !leading.load(Ordering::Acquire) {
                break;
            }
        }
        tracing::info!("cleaners: this replica no longer leads");
        let _ = term_tx.send(true);
        let _ = looping.await;
        let _ = watching.await;
    }
}

/// Records every Cleaner in the log as it changes, and forgets those deleted.
async fn watch_cleaners(
    client: Client,
    access: crate::health::Access,
    namespace: Option<String>,
    cleaners: Arc<Cleaners<KubeTargets>>,
    changed: mpsc::Sender<String>,
    mut stop: watch::Receiver<bool>,
) {
    let api: Api<CleanerResource> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let stream = watcher(api, watcher::Config::default().page_size(500)).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut listing: BTreeSet<String> = BTreeSet::new();
    let mut last_failure = String::new();
    let mut guard = access.watch(match &namespace {
        Some(ns) => format!("Cleaners in namespace {ns}"),
        None => "Cleaners in all namespaces".to_owned(),
    });
    loop {
        let event = tokio::select! {
            _ = stop.changed() => return,
            e = stream.next() => match e { Some(e) => e, None => return },
        };
        if let Some(delay) = guard.saw(&event) {
            if !crate::health::pause(delay, &mut stop).await {
                return;
            }
            continue;
        }
        match event {
            Ok(watcher::Event::Init) => listing.clear(),
            Ok(watcher::Event::InitApply(c)) => {
                listing.insert(key_of(&c));
                take(&cleaners, &changed, &c).await;
            }
            Ok(watcher::Event::InitDone) => {
                // Cleaners deleted while nobody watched.
                let gone: Vec<String> = cleaners.log().read(|s| {
                    s.cleaners
                        .by_name
                        .iter()
                        .filter(|(n, c)| {
                            !ebb_cleaner::config::is_local(n)
                                && !c.spec.namespace.is_empty()
                                && !listing.contains(*n)
                        })
                        .filter(|(_, c)| {
                            namespace.as_ref().is_none_or(|ns| *ns == c.spec.namespace)
                        })
                        .map(|(n, _)| n.clone())
                        .collect()
                });
                for n in gone {
                    forget(&cleaners, &n).await;
                }
                listing.clear();
            }
            Ok(watcher::Event::Apply(c)) => take(&cleaners, &changed, &c).await,
            Ok(watcher::Event::Delete(c)) => forget(&cleaners, &key_of(&c)).await,
            Err(e) => {
                // Said once per kind of failure (a missing permission is one line, not one a
                // retry).
                let e = e.to_string();
                if e != last_failure {
                    tracing::warn!(error = %e, "watching Cleaners failed; retrying");
                    last_failure = e;
                }
                continue;
            }
        }
        last_failure.clear();
    }
}

fn key_of(c: &CleanerResource) -> String {
    format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any())
}

/// Records one Cleaner as it is now.
async fn take(
    cleaners: &Cleaners<KubeTargets>,
    changed: &mpsc::Sender<String>,
    c: &CleanerResource,
) {
    let key = key_of(c);
    let created = c
        .metadata
        .creation_timestamp
        .as_ref()
        .and_then(|t| u64::try_from(t.0.as_millisecond()).ok())
        .unwrap_or(0);
    let spec = to_spec(
        &key,
        &c.namespace().unwrap_or_default(),
        &c.uid().unwrap_or_default(),
        created,
        &c.spec,
    );
    let targets = cleaners.backend();
    targets.ensure_kinds(&spec).await;
    targets.index(&spec);
    match cleaners.upsert(spec).await {
        Ok(true) => {
            cleaners.show(&key).await;
            let _ = changed.send(key).await;
        }
        Ok(false) => {}
        Err(e) => tracing::warn!(cleaner = %key, error = %e, "recording a Cleaner failed"),
    }
}

/// A Cleaner deleted: forgotten (its targets stay), unless it is firing (its finalizer holds
/// it until the firing completes).
async fn forget(cleaners: &Cleaners<KubeTargets>, key: &str) {
    let firing = cleaners.log().read(|s| {
        s.cleaners
            .by_name
            .get(key)
            .is_some_and(|c| c.firing.is_some())
    });
    if !firing {
        cleaners.backend().unindex(key);
        if let Err(e) = cleaners.delete(key).await {
            tracing::warn!(cleaner = %key, error = %e, "forgetting a Cleaner failed");
        }
    }
    let left: Vec<CleanerSpec> = cleaners.log().read(|s| {
        s.cleaners
            .by_name
            .values()
            .filter(|c| c.fired_at_ms.is_none())
            .map(|c| c.spec.clone())
            .collect()
    });
    cleaners.backend().release_unused(&left);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_no_cleaner_names_any_more_is_released() {
        let spec = |name: &str, refs: &[&str]| CleanerSpec {
            name: name.into(),
            targets: refs
                .iter()
                .map(|r| ebb_core::event::CleanerTarget {
                    name: "t".into(),
                    reference: (*r).into(),
                    delete: true,
                    include_when_evaluating: false,
                })
                .collect(),
            ..CleanerSpec::default()
        };
        let watched = [
            kind_key("v1", "ConfigMap"),
            kind_key("apps/v1", "Deployment"),
            kind_key("v1", "Secret"),
        ];
        let left = [
            spec("a", &["v1/ConfigMap/x"]),
            spec("b", &["apps/v1/Deployment?app=web"]),
        ];
        assert_eq!(
            unused(watched.iter(), &left),
            vec![kind_key("v1", "Secret")]
        );
        assert_eq!(
            unused(watched.iter(), &[]).len(),
            3,
            "the last Cleaner gone"
        );
    }
}
