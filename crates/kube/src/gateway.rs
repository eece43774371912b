//! The Gateway API controller: ebb as the Gateway of every `GatewayClass` whose
//! `controllerName` is `ebb.dev/gateway`.
//!
//! [`run`] watches GatewayClasses, Gateways, HTTPRoutes, GRPCRoutes and ReferenceGrants
//! (`gateway.networking.k8s.io/v1`), Namespaces (their labels, for `allowedRoutes`), Services
//! (their ports) and `kubernetes.io/tls` Secrets (the listeners' certificates), each through a
//! reflector. After every change (at most one compile per [`SETTLE`]), and whenever the
//! routes in the log or the sockets the proxy could not bind change, it compiles them
//! (`ebb_core::gateway::compile`, pure) and:
//!
//! * hands the sockets to the proxy (`ebb_proxy::gateway::run` binds and serves them), on every
//!   replica: every replica serves;
//! * writes each object's status where it differs from what the object says, on the Lease
//!   holder only: conditions with the object's generation as `observedGeneration`, a
//!   condition's `lastTransitionTime` kept while its status stands; a route's parents of other
//!   controllers are left as they are;
//! * records each route's attachment (which listeners took it, or why none did) in the log once
//!   per change (`GatewayRouteAttached`), so `ebb explain route HTTPRoute/NAMESPACE/NAME` (or
//!   `GRPCRoute/...`) tells it.
//!
//! A backend Service that is one of ebb's routes (an annotated Service, `NAMESPACE/SERVICE`) is
//! served as that route: its requests wake it from zero and count as its traffic.
//!
//! Without the Gateway API's CRDs the watches fail and are retried with a backoff; the failure
//! is said once. A watch RBAC refuses is told as ebb's other watches' are
//! (`crate::health::Access`). Each TLS Secret's certificate is parsed once per resourceVersion.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use kube::api::{Api, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::{Notify, watch};

use crate::log::Log;
use crate::orchestrator::KubeOrchestrator;
use ebb_core::gateway::compile::{self, Condition, Output, Socket};
use ebb_core::gateway::{self as gw, Addressing, CONTROLLER_NAME, GROUP, Meta, World};

/// How long a burst of changes settles before one compile.
pub const SETTLE: Duration = Duration::from_millis(50);
/// How long the first compile waits for every kind's first list (a kind whose CRD is missing
/// never lists).
const STORES_WAIT: Duration = Duration::from_secs(10);
/// How often the log's routes (a Service becoming ebb's), the Lease (statuses are the holder's
/// to write) and failed status writes are looked at.
const ROUTES_EVERY: Duration = Duration::from_secs(1);

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", kind), plural)
}

struct Stores {
    classes: Store<DynamicObject>,
    gateways: Store<DynamicObject>,
    routes: Store<DynamicObject>,
    grpc_routes: Store<DynamicObject>,
    grants: Store<DynamicObject>,
    namespaces: Store<Namespace>,
    services: Store<Service>,
    secrets: Store<Secret>,
}

fn meta_of(o: &DynamicObject) -> Meta {
    Meta {
        namespace: o.metadata.namespace.clone().unwrap_or_default(),
        name: o.metadata.name.clone().unwrap_or_default(),
        generation: o.metadata.generation.unwrap_or(0),
        created: o
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
    }
}

fn spec_of<T: serde::de::DeserializeOwned + Default>(o: &DynamicObject) -> Option<T> {
    match o.data.get("spec") {
        None => Some(T::default()),
        Some(v) => serde_json::from_value(v.clone()).ok(),
    }
}

/// A store's objects whose spec reads as `T`, with their metadata (one that does not read, which
/// the API server's validation makes rare, is passed over).
fn objects<T: serde::de::DeserializeOwned + Default>(
    store: &Store<DynamicObject>,
) -> impl Iterator<Item = (Arc<DynamicObject>, Meta, T)> {
    store
        .state()
        .into_iter()
        .filter_map(|o| spec_of(&o).map(|spec| (o.clone(), meta_of(&o), spec)))
}

/// An object's `NAMESPACE/NAME`.
fn key_of(meta: &kube::core::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// Which TLS Secrets hold a usable certificate and key, by `NAMESPACE/NAME`, each parsed once
/// per resourceVersion.
type Parsed = BTreeMap<String, (Option<String>, Option<gw::TlsSecret>)>;

fn world(
    stores: &Stores,
    log: &Log,
    unbindable: &BTreeSet<SocketAddr>,
    parsed: &mut Parsed,
) -> World {
    let mut w = World {
        unbindable: unbindable.clone(),
        classes: objects(&stores.classes)
            .map(|(_, meta, spec)| gw::GatewayClass { meta, spec })
            .collect(),
        http_routes: objects(&stores.routes)
            .map(|(_, meta, spec)| gw::HttpRoute { meta, spec })
            .collect(),
        grpc_routes: objects(&stores.grpc_routes)
            .map(|(_, meta, spec)| gw::GrpcRoute { meta, spec })
            .collect(),
        grants: objects(&stores.grants)
            .map(|(_, meta, spec)| gw::ReferenceGrant { meta, spec })
            .collect(),
        ..World::default()
    };
    for (o, meta, spec) in objects(&stores.gateways) {
        let status_addresses = o
            .data
            .pointer("/status/addresses")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.get("value").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        w.gateways.push(gw::Gateway {
            meta,
            spec,
            status_addresses,
        });
    }
    for n in stores.namespaces.state() {
        w.namespaces.insert(
            n.metadata.name.clone().unwrap_or_default(),
            n.metadata.labels.clone().unwrap_or_default(),
        );
    }
    let (routes, hosts): (BTreeSet<String>, BTreeMap<String, String>) = log.read(|s| {
        (
            s.routes.by_name.keys().cloned().collect(),
            s.routes.by_domain.clone(),
        )
    });
    w.service_hosts = hosts;
    for s in stores.services.state() {
        let key = key_of(&s.metadata);
        let all = s
            .spec
            .as_ref()
            .and_then(|p| p.ports.clone())
            .unwrap_or_default();
        let ports = all.iter().map(|p| p.port).collect();
        let h2c_ports = all
            .iter()
            .filter(|p| p.app_protocol.as_deref() == Some("kubernetes.io/h2c"))
            .map(|p| p.port)
            .collect();
        let route = routes.contains(&key).then(|| key.clone());
        w.services.insert(
            key,
            gw::ServiceInfo {
                ports,
                h2c_ports,
                route,
            },
        );
    }
    let mut seen = BTreeSet::new();
    for s in stores.secrets.state() {
        let key = key_of(&s.metadata);
        seen.insert(key.clone());
        let version = s.metadata.resource_version.clone();
        if parsed.get(&key).is_none_or(|(v, _)| *v != version) {
            let data = s.data.clone().unwrap_or_default();
            let tls = match (data.get("tls.crt"), data.get("tls.key")) {
                (Some(c), Some(k)) => {
                    ebb_proxy::certs::certified_key(&c.0, &k.0)
                        .ok()
                        .map(|_| gw::TlsSecret {
                            cert_pem: c.0.clone(),
                            key_pem: k.0.clone(),
                        })
                }
                _ => None,
            };
            parsed.insert(key.clone(), (version, tls));
        }
    }
    parsed.retain(|k, _| seen.contains(k));
    w.secrets = parsed
        .iter()
        .map(|(k, (_, tls))| (k.clone(), tls.clone()))
        .collect();
    w
}

/// How the controller runs.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// Where Gateways' addresses come from.
    pub addressing: Addressing,
}

/// Runs the controller until `stop` (see the module's documentation). `sockets` goes to the
/// proxy's Gateway listeners, which report on `unbindable` what they could not open.
pub async fn run(
    log: Arc<Log>,
    orch: Arc<KubeOrchestrator>,
    options: GatewayOptions,
    sockets: watch::Sender<Arc<Vec<Socket>>>,
    mut unbindable: watch::Receiver<BTreeSet<SocketAddr>>,
    mut stop: watch::Receiver<bool>,
) {
    let client = orch.client();
    let ns = orch.options.namespace.as_deref();
    let changed = Arc::new(Notify::new());
    let guard = |what: &str, namespaced: bool| {
        orch.access.watch(crate::orchestrator::watched(
            what,
            ns.filter(|_| namespaced),
        ))
    };
    let kinds = [
        ("GatewayClass", "gatewayclasses", false),
        ("Gateway", "gateways", true),
        ("HTTPRoute", "httproutes", true),
        ("GRPCRoute", "grpcroutes", true),
        ("ReferenceGrant", "referencegrants", true),
    ];
    let mut dyn_stores = Vec::new();
    for (kind, plural, namespaced) in kinds {
        let ar = resource(kind, plural);
        let api = match ns.filter(|_| namespaced) {
            Some(n) => Api::namespaced_with(client.clone(), n, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        let writer = reflector::store::Writer::new(ar);
        dyn_stores.push(writer.as_reader());
        tokio::spawn(crate::orchestrator::reflect(
            api,
            watcher::Config::default(),
            writer,
            guard(plural, namespaced),
            changed.clone(),
            stop.clone(),
        ));
    }
    let (namespaces, w) = reflector::store::<Namespace>();
    tokio::spawn(crate::orchestrator::reflect(
        Api::all(client.clone()),
        watcher::Config::default(),
        w,
        guard("Namespaces", false),
        changed.clone(),
        stop.clone(),
    ));
    let (services, w) = reflector::store::<Service>();
    tokio::spawn(crate::orchestrator::reflect(
        crate::orchestrator::api(&client, ns),
        watcher::Config::default(),
        w,
        guard("Services behind Gateway routes", true),
        changed.clone(),
        stop.clone(),
    ));
    let (secrets, w) = reflector::store::<Secret>();
    tokio::spawn(crate::orchestrator::reflect(
        crate::orchestrator::api(&client, ns),
        watcher::Config::default().fields("type=kubernetes.io/tls"),
        w,
        guard("TLS Secrets", true),
        changed.clone(),
        stop.clone(),
    ));
    let mut dyn_stores = dyn_stores.into_iter();
    let mut next = || dyn_stores.next().expect("five stores");
    let stores = Stores {
        classes: next(),
        gateways: next(),
        routes: next(),
        grpc_routes: next(),
        grants: next(),
        namespaces,
        services,
        secrets,
    };

    // The first compile waits (at most STORES_WAIT) for every kind's first list: a route must
    // not be served, or refused, on half the objects (an older route of the other kind not yet
    // seen, a ReferenceGrant still to come).
    let listed = async {
        let _ = stores.classes.wait_until_ready().await;
        let _ = stores.gateways.wait_until_ready().await;
        let _ = stores.routes.wait_until_ready().await;
        let _ = stores.grpc_routes.wait_until_ready().await;
        let _ = stores.grants.wait_until_ready().await;
        let _ = stores.namespaces.wait_until_ready().await;
        let _ = stores.services.wait_until_ready().await;
        let _ = stores.secrets.wait_until_ready().await;
    };
    tokio::select! {
        _ = tokio::time::timeout(STORES_WAIT, listed) => {}
        _ = stop.changed() => return,
    }
    let mut last_seq = u64::MAX;
    let mut led = false;
    let mut parsed = Parsed::new();
    let mut writer = StatusWriter::new(client.clone(), orch.clone());
    loop {
        tokio::select! {
            _ = changed.notified() => {}
            r = unbindable.changed() => if r.is_err() { return },
            _ = tokio::time::sleep(ROUTES_EVERY) => {
                let seq = log.read(|s| s.routes.changed_at_seq);
                if seq == last_seq && !writer.pending() && orch.leads() == led {
                    continue;
                }
            }
            _ = stop.changed() => return,
        }
        // Let a burst of changes land first.
        tokio::time::sleep(SETTLE).await;
        last_seq = log.read(|s| s.routes.changed_at_seq);
        let refused = unbindable.borrow_and_update().clone();
        let w = world(&stores, &log, &refused, &mut parsed);
        let out = compile::compile(&w, &options.addressing);
        sockets.send_if_modified(|now| {
            let changed = **now != out.sockets;
            if changed {
                *now = Arc::new(out.sockets.clone());
            }
            changed
        });
        if log.read(|s| s.routes.gateway != out.attachments) {
            let attachments = out.attachments.clone();
            let told = log
                .decide(move |s: &crate::state::State, _| {
                    (attachment_events(&s.routes.gateway, &attachments), ())
                })
                .await;
            if let Err(e) = told {
                tracing::warn!(error = %e, "recording Gateway routes' attachments failed");
            }
        }
        // Only the Lease holder writes statuses; one that takes the Lease over writes them all.
        led = orch.leads();
        if led {
            writer.write(&stores, &out).await;
        }
    }
}

/// `GatewayRouteAttached` for every route whose attachment differs from what the log last told
/// (`told`), an empty one for each route the compile no longer names.
pub fn attachment_events(
    told: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
) -> Vec<crate::event::Event> {
    let changed = now
        .iter()
        .filter(|(k, v)| told.get(*k) != Some(*v))
        .map(|(k, v)| crate::event::Event::GatewayRouteAttached {
            route: k.clone(),
            attached: v.clone(),
        });
    let gone = told.keys().filter(|k| !now.contains_key(*k)).map(|k| {
        crate::event::Event::GatewayRouteAttached {
            route: k.clone(),
            attached: String::new(),
        }
    });
    changed.chain(gone).collect()
}

/// Writes statuses where they differ from what the objects say.
struct StatusWriter {
    client: kube::Client,
    orch: Arc<KubeOrchestrator>,
    /// A write failed: try again at the next tick.
    failed: bool,
}

fn now_rfc3339() -> String {
    chrono::DateTime::<chrono::Utc>::from(
        std::time::UNIX_EPOCH
            + Duration::from_millis(crate::clock::Clock::now_ms(&crate::clock::SystemClock)),
    )
    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// Conditions as the API takes them, each keeping its `lastTransitionTime` from `old` while its
/// status is the same.
fn conditions(new: &[Condition], old: Option<&Value>, now: &str) -> Value {
    let old = old.and_then(Value::as_array);
    Value::Array(
        new.iter()
            .map(|c| {
                let status = if c.status { "True" } else { "False" };
                let since = old
                    .and_then(|o| {
                        o.iter().find(|x| {
                            x.get("type").and_then(Value::as_str) == Some(c.type_)
                                && x.get("status").and_then(Value::as_str) == Some(status)
                        })
                    })
                    .and_then(|x| x.get("lastTransitionTime").cloned())
                    .unwrap_or_else(|| Value::String(now.to_owned()));
                json!({
                    "type": c.type_,
                    "status": status,
                    "reason": c.reason,
                    "message": c.message,
                    "observedGeneration": c.observed_generation,
                    "lastTransitionTime": since,
                })
            })
            .collect(),
    )
}

/// `v` without any `lastTransitionTime`, for comparing what a status says.
fn timeless(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| *k != "lastTransitionTime")
                .map(|(k, v)| (k.clone(), timeless(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(timeless).collect()),
        other => other.clone(),
    }
}

impl StatusWriter {
    fn new(client: kube::Client, orch: Arc<KubeOrchestrator>) -> StatusWriter {
        StatusWriter {
            client,
            orch,
            failed: false,
        }
    }

    fn pending(&self) -> bool {
        self.failed
    }

    async fn patch(
        &mut self,
        ar: &ApiResource,
        namespace: Option<&str>,
        name: &str,
        status: Value,
    ) {
        let api: Api<DynamicObject> = match namespace {
            Some(n) if !n.is_empty() => Api::namespaced_with(self.client.clone(), n, ar),
            _ => Api::all_with(self.client.clone(), ar),
        };
        self.orch.limiter.acquire().await;
        let patch = json!({ "status": status });
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            // Deleted since the compile: its status goes with it.
            Err(kube::Error::Api(e)) if e.code == 404 => {
                tracing::debug!(kind = %ar.kind, name, "gone before its status was written");
            }
            Err(e) => {
                tracing::warn!(kind = %ar.kind, name, error = %e, "writing a Gateway API status failed");
                self.failed = true;
            }
        }
    }

    async fn write(&mut self, stores: &Stores, out: &Output) {
        self.failed = false;
        let now = now_rfc3339();
        let classes = resource("GatewayClass", "gatewayclasses");
        for c in &out.classes {
            let Some(o) = stores
                .classes
                .state()
                .into_iter()
                .find(|o| o.metadata.name.as_deref() == Some(&c.name))
            else {
                continue;
            };
            let old = o.data.get("status");
            let status = json!({
                "conditions": conditions(&c.conditions, old.and_then(|s| s.get("conditions")), &now),
                "supportedFeatures": c.supported_features.iter().map(|f| json!({"name": f})).collect::<Vec<_>>(),
            });
            if old.map(timeless) != Some(timeless(&status)) {
                self.patch(&classes, None, &c.name, status).await;
            }
        }
        let gateways = resource("Gateway", "gateways");
        for g in &out.gateways {
            let Some(o) = find(&stores.gateways, &g.meta) else {
                continue;
            };
            let old = o.data.get("status");
            let old_listeners = old
                .and_then(|s| s.get("listeners"))
                .and_then(Value::as_array);
            let listeners: Vec<Value> = g
                .listeners
                .iter()
                .map(|l| {
                    let before = old_listeners
                        .and_then(|ls| {
                            ls.iter()
                                .find(|x| x.get("name").and_then(Value::as_str) == Some(&l.name))
                        })
                        .and_then(|x| x.get("conditions"));
                    json!({
                        "name": l.name,
                        "supportedKinds": l.supported_kinds.iter().map(|k| json!({"group": k.group.clone().unwrap_or_else(|| GROUP.into()), "kind": k.kind})).collect::<Vec<_>>(),
                        "attachedRoutes": l.attached_routes,
                        "conditions": conditions(&l.conditions, before, &now),
                    })
                })
                .collect();
            let status = json!({
                "addresses": g.addresses.iter().map(|a| json!({"type": "IPAddress", "value": a})).collect::<Vec<_>>(),
                "conditions": conditions(&g.conditions, old.and_then(|s| s.get("conditions")), &now),
                "listeners": listeners,
            });
            if old.map(timeless) != Some(timeless(&status)) {
                self.patch(&gateways, Some(&g.meta.namespace), &g.meta.name, status)
                    .await;
            }
        }
        // Routes: ours are the parents with our controller name; every route whose parents of
        // ours differ from what the compile says is written, those no longer ours included.
        let by_key: BTreeMap<(&str, String), &compile::RouteStatus> = out
            .routes
            .iter()
            .map(|r| ((r.kind, r.meta.key()), r))
            .collect();
        let kinds = [
            ("HTTPRoute", "httproutes", &stores.routes),
            ("GRPCRoute", "grpcroutes", &stores.grpc_routes),
        ];
        for (kind, plural, store) in kinds {
            self.write_routes(&resource(kind, plural), store, &by_key, &now)
                .await;
        }
    }

    /// Writes the routes of one kind whose parents of ebb's differ from the compile's.
    async fn write_routes(
        &mut self,
        routes: &ApiResource,
        store: &Store<DynamicObject>,
        by_key: &BTreeMap<(&str, String), &compile::RouteStatus>,
        now: &str,
    ) {
        for o in store.state() {
            let meta = meta_of(&o);
            let old_parents: Vec<Value> = o
                .data
                .pointer("/status/parents")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let (mine, others): (Vec<Value>, Vec<Value>) =
                old_parents.iter().cloned().partition(|p| {
                    p.get("controllerName").and_then(Value::as_str) == Some(CONTROLLER_NAME)
                });
            let new_mine: Vec<Value> = by_key
                .get(&(routes.kind.as_str(), meta.key()))
                .map(|r| {
                    r.parents
                        .iter()
                        .map(|p| {
                            let pref = serde_json::to_value(&p.parent_ref).unwrap_or_default();
                            let before = mine
                                .iter()
                                .find(|x| x.get("parentRef") == Some(&pref))
                                .and_then(|x| x.get("conditions"));
                            json!({
                                "parentRef": pref,
                                "controllerName": CONTROLLER_NAME,
                                "conditions": conditions(&p.conditions, before, now),
                            })
                        })
                        .collect()
                })
                .unwrap_or_default();
            if timeless(&Value::Array(mine.clone())) == timeless(&Value::Array(new_mine.clone())) {
                continue;
            }
            let mut parents = others;
            parents.extend(new_mine);
            self.patch(
                routes,
                Some(&meta.namespace),
                &meta.name,
                json!({ "parents": parents }),
            )
            .await;
        }
    }
}

fn find(store: &Store<DynamicObject>, meta: &Meta) -> Option<Arc<DynamicObject>> {
    store.state().into_iter().find(|o| {
        o.metadata.name.as_deref() == Some(&meta.name)
            && o.metadata.namespace.as_deref().unwrap_or_default() == meta.namespace
    })
}
