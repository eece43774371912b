//! Function templates shared by every ebb replica on Kubernetes: each template is a `Func`
//! resource (`functions.ebb.dev`, generated from [`ebb_core::functions::TemplateJson`]) in the
//! functions' namespace, and the resource is the store.
//!
//! * **Writes** through the functions API are checked against the replica's log as they would be
//!   on one machine (a name taken, a host another route has), then written to the API server
//!   (create, server-side apply with field manager `ebb`, delete with a UID precondition); the
//!   answer waits until the replica's own log has the change, so a read after a write sees it.
//! * **The mirror** ([`run_mirror`]) watches the resources and records each change in the
//!   replica's log as the template decisions do on one machine (`TemplateUpserted`,
//!   `TemplateDeleted`, and the route of the template's workload): the rest of ebb (the
//!   autoscaler, the runners, the image functions' objects, the watch API, explain) reads
//!   templates from the log as before, and every replica's log follows the same resources. After
//!   a relist, templates the resources no longer have are deleted. A resource ebb cannot take (its
//!   `spec.name` not its name, a host another route has, a bad spec) gets a `FuncRefused` Warning
//!   Event saying why and is left out.
//! * **Configuration**: templates from `ebb.toml` are applied as resources (field manager
//!   `ebb-config`).
//! * **Status**: each replica counts only the calls it handles, and publishes its share of each
//!   function's counter in the resource's status (`status.byReplica.NAME`); the template's
//!   `FuncStatus` (the counter summed over the replicas' live shares, the last call counted,
//!   replicas asked for) is written by the replica holding the scale-down lease
//!   (`SharedScaling::leading`), when it changes ([`run_status`]).
//! * **Reads**: the functions API lists, gets and watches the resources themselves
//!   ([`KubeTemplates::list`], [`KubeTemplates::get`], [`KubeTemplates::watch`]), so a template's
//!   `resourceVersion` is the resource's and means the same on every replica: a list through one
//!   replica and a watch from its revision through another miss nothing, and a revision the API
//!   server no longer keeps is its `410`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions, WatchEvent,
    WatchParams,
};
use kube::runtime::watcher;

use crate::log::Log;
use crate::state::State;
use ebb_core::clock::Clock;
use ebb_core::functions::{Autoscale, Func, FuncStatus, Refused, ReplicaCount, TemplateJson};

/// The field manager of ebb's writes.
const MANAGER: &str = "ebb";

/// How long a write through the API waits for the replica's log to have it.
const MIRRORED_WITHIN: Duration = Duration::from_secs(10);

/// Where templates live on Kubernetes.
#[derive(Clone)]
pub struct KubeTemplates {
    api: Api<Func>,
    namespace: String,
    /// The replicas' shares of each function's counter, as the watched resources say.
    shares: Shares,
}

/// Function name -> replica -> its published share of the function's counter.
type Shares = Arc<std::sync::Mutex<HashMap<String, BTreeMap<String, ReplicaCount>>>>;

impl std::fmt::Debug for KubeTemplates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeTemplates")
            .field("namespace", &self.namespace)
            .finish()
    }
}

/// A write to the resources that failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Refused as on one machine.
    #[error("{}", refused_why(.0))]
    Refused(Refused),
    /// The API server refused or failed it.
    #[error("the Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    /// Written, but the replica's log did not follow in time.
    #[error("the template was written, but this replica has not seen it yet; read it again")]
    NotMirrored,
}

impl KubeTemplates {
    /// Templates as `Func` resources in `namespace`.
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            shares: Shares::default(),
        }
    }

    /// The namespace of the resources.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn object(spec: &crate::event::TemplateSpec) -> Func {
        Func::new(&spec.name, TemplateJson::from_spec(spec))
    }

    /// Creates the template's resource; refused if one of that name exists. Returns the
    /// resource as written.
    pub async fn create(
        &self,
        log: &Log,
        spec: crate::event::TemplateSpec,
        a: &Autoscale,
    ) -> Result<Func, StoreError> {
        log.read(|s| ebb_core::functions::decide_create(s, spec.clone(), a))
            .map_err(StoreError::Refused)?;
        let written = match self
            .api
            .create(&PostParams::default(), &Self::object(&spec))
            .await
        {
            Ok(f) => f,
            Err(kube::Error::Api(e)) if e.code == 409 => {
                return Err(StoreError::Refused(Refused::Exists(spec.name)));
            }
            Err(e) => return Err(e.into()),
        };
        mirrored(log, &spec.name, Some(&spec)).await?;
        Ok(written)
    }

    /// Creates or replaces the template's resource; whether it was new, and the resource as
    /// written.
    pub async fn put(
        &self,
        log: &Log,
        spec: crate::event::TemplateSpec,
        a: &Autoscale,
    ) -> Result<(bool, Func), StoreError> {
        let (_, created) = log
            .read(|s| ebb_core::functions::decide_put(s, spec.clone(), a))
            .map_err(StoreError::Refused)?;
        let written = self
            .api
            .patch(
                &spec.name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&Self::object(&spec)),
            )
            .await?;
        mirrored(log, &spec.name, Some(&spec)).await?;
        Ok((created, written))
    }

    /// Deletes the template's resource (the one this replica knows, by UID); the resource as
    /// it was, if there was one.
    pub async fn delete(&self, log: &Log, name: &str) -> Result<Option<Func>, StoreError> {
        if !log.read(|s| s.functions.templates.contains_key(name)) {
            return Err(StoreError::Refused(Refused::Unknown(name.to_owned())));
        }
        let before = self.api.get_opt(name).await?;
        if let Some(uid) = before.as_ref().and_then(|f| f.metadata.uid.clone()) {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match self.api.delete(name, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        mirrored(log, name, None).await?;
        Ok(before)
    }

    /// Every resource, and the list's `resourceVersion` (a watch from it misses nothing).
    pub async fn list(&self) -> Result<(Vec<Func>, String), kube::Error> {
        let list = self.api.list(&ListParams::default()).await?;
        let revision = list.metadata.resource_version.unwrap_or_default();
        Ok((list.items, revision))
    }

    /// Resource `name`, if there is one.
    pub async fn get(&self, name: &str) -> Result<Option<Func>, kube::Error> {
        self.api.get_opt(name).await
    }

    /// The resources' changes after `revision` (a `resourceVersion`), with bookmarks, as the
    /// API server sends them; it ends the stream after a while (resume from the last revision
    /// seen) and sends a `410` error for a revision it no longer keeps.
    pub async fn watch(
        &self,
        revision: &str,
    ) -> Result<BoxStream<'static, Result<WatchEvent<Func>, kube::Error>>, kube::Error> {
        Ok(self
            .api
            .watch(&WatchParams::default(), revision)
            .await?
            .boxed())
    }
}

impl KubeTemplates {
    /// Applies templates from ebb's configuration as resources (field manager `ebb-config`),
    /// so every replica has them.
    pub async fn apply_config(
        &self,
        specs: &[crate::event::TemplateSpec],
    ) -> Result<(), kube::Error> {
        for spec in specs {
            self.api
                .patch(
                    &spec.name,
                    &PatchParams::apply("ebb-config").force(),
                    &Patch::Apply(&Self::object(spec)),
                )
                .await?;
        }
        Ok(())
    }
}

/// Waits until the log has `spec` as template `name` (`None`: has no template of that name).
async fn mirrored(
    log: &Log,
    name: &str,
    spec: Option<&crate::event::TemplateSpec>,
) -> Result<(), StoreError> {
    let has = |s: &State| s.functions.templates.get(name).map(|t| &t.spec) == spec;
    if log.wait_until(MIRRORED_WITHIN, has).await {
        Ok(())
    } else {
        Err(StoreError::NotMirrored)
    }
}

/// The template a resource holds, or why ebb cannot take it.
pub fn spec_of(f: &Func) -> Result<crate::event::TemplateSpec, String> {
    let name = f.metadata.name.clone().unwrap_or_default();
    let mut j = f.spec.clone();
    if j.name.is_empty() {
        j.name = name.clone();
    } else if j.name != name {
        return Err(format!(
            "spec.name {:?} is not the resource's name {name:?}",
            j.name
        ));
    }
    j.into_spec()
}

/// Records in the log what the resources say: each resource's template upserted (one decision
/// each, on the state the ones before made), or (with `all`, after a relist) templates the
/// resources no longer have deleted. Returns the resources ebb cannot take, with why.
async fn record(
    log: &Log,
    funcs: Vec<Func>,
    all: bool,
    a: Autoscale,
) -> Result<Vec<(Func, String)>, crate::log::Error> {
    let mut bad = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for f in funcs {
        let spec = match spec_of(&f) {
            Ok(s) => s,
            Err(why) => {
                bad.push((f, why));
                continue;
            }
        };
        names.insert(spec.name.clone());
        let (refused, _) = log
            .decide(
                move |s: &State, _| match ebb_core::functions::decide_put(s, spec, &a) {
                    Ok((events, _)) => (events, None),
                    Err(r) => (Vec::new(), Some(r)),
                },
            )
            .await?;
        if let Some(r) = refused {
            bad.push((f, refused_why(&r)));
        }
    }
    if all {
        log.decide(move |s: &State, _| {
            let gone: Vec<String> = s
                .functions
                .templates
                .keys()
                .filter(|n| !names.contains(*n))
                .cloned()
                .collect();
            let mut events = Vec::new();
            for name in gone {
                // Each template's events touch only its own name and route.
                events.extend(ebb_core::functions::decide_delete(s, &name).unwrap_or_default());
            }
            (events, ())
        })
        .await?;
    }
    Ok(bad)
}

fn refused_why(r: &Refused) -> String {
    match r {
        Refused::Exists(n) => format!("template {n:?} exists"),
        Refused::Unknown(n) => format!("no template {n:?}"),
        Refused::Taken(why) => why.clone(),
    }
}

/// Watches the `Func` resources and records their changes in the log until `stop` changes.
pub async fn run_mirror(
    templates: KubeTemplates,
    log: Arc<Log>,
    autoscale: Autoscale,
    events: Arc<crate::orchestrator::KubeOrchestrator>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    use kube::runtime::WatchStreamExt;
    let stream = watcher(templates.api.clone(), watcher::Config::default()).default_backoff();
    tokio::pin!(stream);
    let mut listing: Vec<Func> = Vec::new();
    // A failure said once, not at every retry.
    let mut last_failure = String::new();
    let mut guard = events.access.watch(format!(
        "Func resources in namespace {}",
        templates.namespace
    ));
    loop {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            _ = stop.changed() => return,
        };
        let Some(ev) = ev else { return };
        if let Some(delay) = guard.saw(&ev) {
            if !crate::health::pause(delay, &mut stop).await {
                return;
            }
            continue;
        }
        let recorded = match ev {
            Ok(watcher::Event::Init) => {
                listing.clear();
                continue;
            }
            Ok(watcher::Event::InitApply(f)) => {
                listing.push(f);
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                templates.note_shares(&listing, true);
                record(&log, std::mem::take(&mut listing), true, autoscale).await
            }
            Ok(watcher::Event::Apply(f)) => {
                templates.note_shares(std::slice::from_ref(&f), false);
                record(&log, vec![f], false, autoscale).await
            }
            Ok(watcher::Event::Delete(f)) => {
                let name = f.metadata.name.clone().unwrap_or_default();
                templates.forget_shares(&name);
                log.decide(move |s: &State, _| {
                    (
                        ebb_core::functions::decide_delete(s, &name).unwrap_or_default(),
                        (),
                    )
                })
                .await
                .map(|_| Vec::new())
            }
            Err(e) => {
                let e = e.to_string();
                if e != last_failure {
                    tracing::warn!(error = %e, "watching Func resources failed; retrying");
                    last_failure = e;
                }
                continue;
            }
        };
        last_failure.clear();
        match recorded {
            Ok(bad) => {
                for (f, why) in bad {
                    tracing::warn!(name = ?f.metadata.name, %why, "a Func resource ebb cannot take");
                    use kube::Resource;
                    events
                        .publish_shared(
                            &f.object_ref(&()),
                            kube::runtime::events::EventType::Warning,
                            "FuncRefused",
                            format!("ebb cannot take this template: {why}"),
                        )
                        .await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "recording Func resources in the log failed"),
        }
    }
}

/// A share with calls left in it not refreshed for this long (at least) is of a replica gone.
const STALE_SHARE: Duration = Duration::from_secs(30);

/// The function statuses on the resources, every `every`: each replica `me` publishes its own
/// share of each function's counter (`status.byReplica.ME`) when it moves by a tenth or to or
/// from zero, and while calls are left in it at least every third of the staleness bound, so a
/// share that stops being refreshed is of a replica gone; the replica holding the scale-down lease (`leading`) writes the cluster's
/// status (the shares summed, [`ebb_core::functions::cluster_status`]) when it changes, and
/// drops the shares of replicas gone.
pub async fn run_status(
    templates: KubeTemplates,
    log: Arc<Log>,
    me: String,
    clock: Arc<dyn Clock>,
    leading: Arc<std::sync::atomic::AtomicBool>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let stale_ms = (STALE_SHARE.max(every * 5)).as_millis() as u64;
    let refresh_ms = stale_ms / 3;
    let mut written: HashMap<String, FuncStatus> = Default::default();
    let mut published: HashMap<String, ReplicaCount> = Default::default();
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let now = clock.now_ms();
        let local: Vec<(String, FuncStatus, ReplicaCount)> = log.read(|s| {
            s.functions
                .templates
                .keys()
                .map(|n| {
                    (
                        n.clone(),
                        ebb_core::functions::status_of(s, n),
                        ebb_core::functions::share_of(s, n, now),
                    )
                })
                .collect()
        });
        published.retain(|n, _| local.iter().any(|(name, ..)| name == n));
        for (name, _, share) in &local {
            let due = match published.get(name) {
                None => true,
                Some(p) => {
                    // A change worth a write: to or from zero, or by a tenth; the decay's small
                    // steps wait for the refresh.
                    let moved = (p.counter == 0) != (share.counter == 0)
                        || p.counter.abs_diff(share.counter) * 10 >= p.counter.max(1);
                    moved || (share.counter > 0 && now.saturating_sub(p.at_ms) >= refresh_ms)
                }
            };
            if !due {
                continue;
            }
            let patch = serde_json::json!({ "status": { "byReplica": { me.as_str(): share } } });
            match templates
                .api
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    published.insert(name.clone(), share.clone());
                }
                Err(e) => {
                    tracing::debug!(%name, error = %e, "publishing a Func's counter share failed")
                }
            }
        }
        if !leading.load(std::sync::atomic::Ordering::Relaxed) {
            written.clear();
            continue;
        }
        for (name, status, share) in local {
            let shares = templates.shares_of(&name);
            let status =
                ebb_core::functions::cluster_status(&status, &share, &me, &shares, now, stale_ms);
            if written.get(&name) == Some(&status) {
                continue;
            }
            let mut patch = serde_json::json!({ "status": status });
            // Shares of replicas gone long ago leave the resource.
            let gone: serde_json::Map<String, serde_json::Value> = shares
                .iter()
                .filter(|(r, s)| **r != me && now.saturating_sub(s.at_ms) > stale_ms * 10)
                .map(|(r, _)| (r.clone(), serde_json::Value::Null))
                .collect();
            if !gone.is_empty() {
                patch["status"]["byReplica"] = serde_json::Value::Object(gone);
            }
            match templates
                .api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    written.insert(name, status);
                }
                Err(e) => tracing::debug!(%name, error = %e, "writing a Func's status failed"),
            }
        }
    }
}

impl KubeTemplates {
    /// Keeps the counter shares the resources carry (`all`: the whole list, after a relist).
    fn note_shares(&self, funcs: &[Func], all: bool) {
        let mut shares = self.shares.lock().expect("shares lock");
        if all {
            shares.clear();
        }
        for f in funcs {
            let name = f.metadata.name.clone().unwrap_or_default();
            let by = f
                .status
                .as_ref()
                .map(|s| s.by_replica.clone())
                .unwrap_or_default();
            shares.insert(name, by);
        }
    }

    fn forget_shares(&self, name: &str) {
        self.shares.lock().expect("shares lock").remove(name);
    }

    fn shares_of(&self, name: &str) -> BTreeMap<String, ReplicaCount> {
        self.shares
            .lock()
            .expect("shares lock")
            .get(name)
            .cloned()
            .unwrap_or_default()
    }
}
