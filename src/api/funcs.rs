//! `/api/funcs/template`: function templates (bearer token, `ebb serve --api-token` /
//! `EBB_API_TOKEN`; disabled without one).
//!
//! A template is the serverless seed's `Func` object: `{"apiVersion": "ebb.dev/v1alpha1",
//! "kind": "Func", "metadata": {"name", "resourceVersion"}, "spec": {...}, "status": {"counter",
//! "timeStamp", "replicas"}}`; its `resourceVersion` is its revision, the seq of the event that
//! last changed it. A body may be that object (its `status` is ebb's and ignored, and so is
//! metadata other than the name) or the spec alone; empty strings count as absent.
//!
//! * `GET /api/funcs/template`: a `FuncList`, `{"items": [...], "metadata": {"resourceVersion"}}`
//!   (and `"revision"`, the same as a number).
//! * `GET /api/funcs/template?watch=true[&since=SEQ]` (or `resourceVersion=SEQ`): newline-delimited
//!   JSON, as a Kubernetes watch: `{"type": "ADDED" | "MODIFIED" | "DELETED", "object": {...},
//!   "revision": SEQ}`. Without `since` it starts with every template as `ADDED`; with it, with
//!   exactly the changes after `SEQ`. Then a `BOOKMARK` line with the revision it has reached,
//!   then changes as they become durable. A `since` older than the changes kept is `410`
//!   (`revision_compacted`): list again and watch from the list's revision.
//! * `POST /api/funcs/template` creates (`201`; `409` if it exists); `PUT
//!   /api/funcs/template/{name}` creates (`201`) or replaces (`200`); `GET` and `DELETE` one.
//!
//! On Kubernetes the `Func` resources are the store ([`crate::orchestrator::kube_templates`]):
//! reads list, get and watch them, so `resourceVersion` is the resource's own, the same through
//! every replica (a list through one and a watch from its revision through another miss
//! nothing); the status is the one the scale-down lease holder wrote. A watch maps onto the
//! resources' watch: without `since`, a list as `ADDED` lines, a `BOOKMARK` with the list's
//! revision, then the watch from it; with `since`, a `BOOKMARK` at that revision, then the
//! changes after it. When the API server ends the resources' watch, it is resumed from the last
//! revision seen. A revision the API server no longer keeps is `410` (`revision_compacted`)
//! when the API server says so at once, else the `ERROR` line. A resource ebb cannot take is
//! left out (a change that makes it so is a `DELETED` line).

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State as Extract};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{ApiError, AppState};
use crate::calls::CallError;
use crate::event::{Event, TemplateSpec};
use crate::functions::runtime::{FnError, FunctionService};
use crate::functions::{self, Refused, TemplateJson};
use crate::log::Log;
use crate::orchestrator::kube_templates::{self, KubeTemplates, StoreError};
use crate::state::State;
use crate::state::functions::ChangeKind;

pub(super) fn router(app: &AppState) -> Router<AppState> {
    let routes = Router::new()
        .route("/api/funcs/template", get(list_or_watch).post(create))
        .route(
            "/api/funcs/template/{name}",
            get(show).put(put).delete(delete),
        )
        .layer(DefaultBodyLimit::max(MAX_TEMPLATE_BYTES))
        .merge(
            Router::new()
                .route("/api/funcs/{name}", get(instance).post(invoke))
                .route("/api/funcs/{name}/{id}", axum::routing::put(step))
                .layer(DefaultBodyLimit::max(MAX_ARGS_BYTES)),
        );
    super::access::guarded(routes, app, &[super::access::Api::Functions])
}

/// The most bytes of arguments (or a step's input) an invocation takes.
pub const MAX_ARGS_BYTES: usize = 4 << 20;

/// The longest an invocation waits for its result.
pub const MAX_WAIT_S: u64 = 300;

fn service(app: &AppState) -> Result<&Arc<FunctionService>, ApiError> {
    app.functions.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "functions_unavailable",
            "this ebb runs no calls, so no functions",
        )
    })
}

impl From<FnError> for ApiError {
    fn from(e: FnError) -> Self {
        match e {
            FnError::UnknownFunction(_) => {
                ApiError::new(StatusCode::NOT_FOUND, "unknown_function", e.to_string())
            }
            FnError::UnknownInstance(_) => {
                ApiError::new(StatusCode::NOT_FOUND, "unknown_instance", e.to_string())
            }
            FnError::Ended(_) => {
                ApiError::new(StatusCode::CONFLICT, "instance_ended", e.to_string())
            }
            FnError::Moved(_) => {
                ApiError::new(StatusCode::CONFLICT, "instance_moved", e.to_string())
            }
            FnError::UnknownNext(_) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "unknown_next_function",
                e.to_string(),
            ),
            FnError::Bound(..) => ApiError::new(StatusCode::CONFLICT, "step_bound", e.to_string()),
            FnError::Calls(CallError::Queue(crate::queue::QueueError::Duplicate(_))) => {
                ApiError::new(
                    StatusCode::CONFLICT,
                    "instance_moved",
                    "another step with this number was added at the same moment; try again",
                )
            }
            FnError::NotRunnable(_) => {
                ApiError::new(StatusCode::NOT_IMPLEMENTED, "not_runnable", e.to_string())
            }
            FnError::Calls(c) => c.into(),
        }
    }
}

fn args(body: Result<Bytes, BytesRejection>) -> Result<Vec<u8>, ApiError> {
    body.map(|b| b.to_vec()).map_err(super::runner::rejection)
}

/// An instance as the API shows it.
fn instance_view(s: &State, id: &str) -> Option<Value> {
    let i = s.functions.instances.get(id)?;
    let steps: Vec<Value> = i
        .steps
        .iter()
        .map(|st| {
            let call = s.calls.get(&st.call_id);
            json!({
                "function": st.function,
                "callId": st.call_id,
                "status": call.map(|c| serde_json::to_value(c.status).unwrap_or(Value::Null)),
                "queuedAtMs": st.at_ms,
                "startedAtMs": call.and_then(|c| c.started_at_ms),
                "finishedAtMs": call.and_then(|c| c.finished_at_ms),
            })
        })
        .collect();
    let mut v = json!({
        "instanceId": id,
        "template": i.template,
        "state": i.status,
        "createdAtMs": i.created_at_ms,
        "finishedAtMs": i.finished_at_ms,
        "steps": steps,
    });
    if let Some(r) = &i.result {
        match std::str::from_utf8(r) {
            Ok(text) => v["result"] = json!(text),
            Err(_) => {
                use base64::Engine;
                v["resultBase64"] = json!(base64::engine::general_purpose::STANDARD.encode(r));
            }
        }
    }
    Some(v)
}

#[derive(Debug, Deserialize)]
struct InvokeQuery {
    #[serde(default)]
    wait: Option<String>,
}

/// How long to wait for the result: `?wait=true` (30 s), `?wait=N`, or `Prefer: wait=N`.
fn wait_of(q: &InvokeQuery, headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", m);
    let from_query = match q.wait.as_deref() {
        None | Some("false") | Some("0") => None,
        Some("true") | Some("") => Some(30),
        Some(n) => Some(
            n.parse::<u64>()
                .map_err(|_| bad(format!("wait={n:?}: use true, false or seconds")))?,
        ),
    };
    let from_header = headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split([',', ';']))
        .find_map(|p| p.trim().strip_prefix("wait=").map(str::to_owned));
    let from_header = match from_header {
        None => None,
        Some(n) => Some(
            n.trim()
                .parse::<u64>()
                .map_err(|_| bad(format!("Prefer: wait={n:?} is not a number of seconds")))?,
        ),
    };
    Ok(from_query.or(from_header).map(|s| s.min(MAX_WAIT_S)))
}

/// Waits until instance `id` has ended or `secs` have passed.
async fn wait_until_done(log: &Log, id: &str, secs: u64) {
    log.wait_until(std::time::Duration::from_secs(secs), |s| {
        s.functions
            .instances
            .get(id)
            .is_none_or(|i| i.status != crate::state::InstanceStatus::Running)
    })
    .await;
}

async fn invoke(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    q: Result<Query<InvokeQuery>, QueryRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(bad_query)?;
    let wait = wait_of(&q, &headers)?;
    let args = args(body)?;
    let svc = service(&app)?;
    let id = svc
        .invoke(&name, args, ebb_proxy::trace::carried(&headers))
        .await?;
    if let Some(secs) = wait {
        wait_until_done(&app.log, &id, secs).await;
        let v = app
            .log
            .read(|s| instance_view(s, &id))
            .unwrap_or(Value::Null);
        if v["state"] != "running" {
            return Ok((StatusCode::OK, Json(v)).into_response());
        }
    }
    Ok((StatusCode::ACCEPTED, Json(json!({ "instanceId": id }))).into_response())
}

async fn instance(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if let Some(r) = super::through_owner(
        &app,
        &id,
        axum::http::Method::GET,
        &uri,
        &headers,
        Bytes::new(),
    )
    .await?
    {
        return Ok(r);
    }
    app.log
        .read(|s| instance_view(s, &id))
        .map(|v| Json(v).into_response())
        .ok_or_else(|| FnError::UnknownInstance(id).into())
}

async fn step(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    Path((name, id)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(super::runner::rejection)?;
    if let Some(r) = super::through_owner(
        &app,
        &id,
        axum::http::Method::PUT,
        &uri,
        &headers,
        body.clone(),
    )
    .await?
    {
        return Ok(r);
    }
    let input = args(Ok(body))?;
    let number = service(&app)?.step(&name, &id, input).await?;
    if number == 0 {
        let v = app
            .log
            .read(|s| instance_view(s, &id))
            .unwrap_or(Value::Null);
        return Ok((StatusCode::OK, Json(v)).into_response());
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "instanceId": id, "step": number, "function": name })),
    )
        .into_response())
}

/// A template as the API shows it: the serverless seed's `Func` object, its revision as
/// `metadata.resourceVersion`, when it was made as `metadata.creationTimestamp`, its status from
/// the log now (`state`; neither for a deleted one).
fn object(spec: &TemplateSpec, revision: u64, state: Option<&State>) -> Value {
    let created_at_ms = state
        .and_then(|s| s.functions.templates.get(&spec.name))
        .and_then(|t| i64::try_from(t.created_at_ms).ok());
    let status = state.map(|s| functions::status_of(s, &spec.name));
    func_object(spec, &revision.to_string(), created_at_ms, status.as_ref())
}

/// The serverless seed's `Func` object: `revision` as `metadata.resourceVersion`, when it was
/// made (ms) as `metadata.creationTimestamp`, and its status (neither, if `None`).
fn func_object(
    spec: &TemplateSpec,
    revision: &str,
    created_at_ms: Option<i64>,
    status: Option<&functions::FuncStatus>,
) -> Value {
    let mut o = identity(&spec.name, revision);
    o["spec"] = json!(TemplateJson::from_spec(spec));
    if let Some(t) = created_at_ms.and_then(functions::kube_time) {
        o["metadata"]["creationTimestamp"] = json!(t);
    }
    if let Some(s) = status {
        o["status"] = serde_json::to_value(s).unwrap_or(Value::Null);
    }
    o
}

/// A `Func` object's identity alone: its name and revision.
fn identity(name: &str, revision: &str) -> Value {
    json!({
        "apiVersion": functions::API_VERSION,
        "kind": functions::KIND,
        "metadata": { "name": name, "resourceVersion": revision },
    })
}

/// A `Func` resource as the API shows it: its `resourceVersion`, `creationTimestamp` and `uid`,
/// the spec as ebb reads it, and the status the lease holder wrote (zeros before the first
/// write). `None` for a resource ebb cannot take.
fn resource_object(f: &functions::Func) -> Option<Value> {
    let spec = kube_templates::spec_of(f).ok()?;
    let mut o = func_object(
        &spec,
        f.metadata.resource_version.as_deref().unwrap_or_default(),
        f.metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_millisecond()),
        Some(&f.status.clone().unwrap_or_default()),
    );
    if let Some(uid) = &f.metadata.uid {
        o["metadata"]["uid"] = json!(uid);
    }
    Some(o)
}

/// A resource's identity alone (for the deletion of one ebb could not take).
fn resource_identity(f: &functions::Func) -> Value {
    identity(
        f.metadata.name.as_deref().unwrap_or_default(),
        f.metadata.resource_version.as_deref().unwrap_or_default(),
    )
}

/// The name of a template object.
fn name_of(object: &Value) -> Option<&str> {
    object["metadata"]["name"].as_str()
}

fn refused(r: Refused) -> ApiError {
    match r {
        Refused::Exists(n) => ApiError::new(
            StatusCode::CONFLICT,
            "exists",
            format!("a template named {n:?} exists; PUT /api/funcs/template/{n} replaces it"),
        ),
        Refused::Unknown(n) => ApiError::not_found(format!("no template named {n:?}")),
        Refused::Taken(why) => ApiError::new(StatusCode::CONFLICT, "domain_conflict", why),
    }
}

/// The most a template body may weigh.
pub const MAX_TEMPLATE_BYTES: usize = 1 << 20;

fn parse(body: Result<Bytes, BytesRejection>) -> Result<TemplateJson, ApiError> {
    let bytes = body.map_err(super::runner::rejection)?;
    TemplateJson::from_body(&bytes).map_err(|e| match e {
        functions::BodyError::Json(why) => ApiError::new(StatusCode::BAD_REQUEST, "bad_json", why),
        functions::BodyError::Invalid(why) => invalid(why),
    })
}

fn bad_query(e: QueryRejection) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text())
}

fn invalid(why: String) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid_template", why)
}

#[derive(Debug, Deserialize)]
struct WatchQuery {
    #[serde(default)]
    watch: Option<String>,
    #[serde(default, alias = "resourceVersion")]
    since: Option<String>,
}

async fn list_or_watch(
    Extract(app): Extract<AppState>,
    q: Result<Query<WatchQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(bad_query)?;
    let since = match q.since.as_deref() {
        None => None,
        Some(s) => Some(s.parse::<u64>().map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("since={s:?} is not a revision (a non-negative integer)"),
            )
        })?),
    };
    let watch = match q.watch.as_deref() {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") | Some("") => true,
        Some(w) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("watch={w:?}: use true or false"),
            ));
        }
    };
    if !watch {
        if since.is_some() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "since is for watches (watch=true)",
            ));
        }
        if let Some(store) = &app.templates {
            let (items, revision) = store.list().await.map_err(kube_read_error)?;
            return Ok(Json(json!({
                "apiVersion": functions::API_VERSION,
                "kind": "FuncList",
                "metadata": { "resourceVersion": revision },
                "items": items.iter().filter_map(resource_object).collect::<Vec<_>>(),
                "revision": revision_number(&revision),
            }))
            .into_response());
        }
        let body = app.log.read(|s| {
            json!({
                "apiVersion": functions::API_VERSION,
                "kind": "FuncList",
                "metadata": { "resourceVersion": s.seq.to_string() },
                "items": s.functions.templates.values().map(|t| object(&t.spec, t.revision, Some(s))).collect::<Vec<_>>(),
                "revision": s.seq,
            })
        });
        // The revision handed out must be durable, or a watch from it could miss changes.
        durable(&app.log).await;
        return Ok(Json(body).into_response());
    }
    if let Some(store) = &app.templates {
        return watch_resources(store.clone(), since).await;
    }
    if let Some(since) = since {
        let (dropped, now) = app
            .log
            .read(|s| (s.functions.changes_dropped_through, s.seq));
        if since < dropped {
            return Err(ApiError::new(
                StatusCode::GONE,
                "revision_compacted",
                format!(
                    "changes before revision {dropped} are no longer kept; list the templates and watch from the list's revision"
                ),
            ));
        }
        if since > now {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("since={since} is ahead of the log (at {now})"),
            ));
        }
    }
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(feed(app.log.clone(), since, tx));
    Ok(ndjson(rx))
}

/// A watch answer: the lines a feeder sends, as newline-delimited JSON.
fn ndjson(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// One line of a watch: `v` as JSON, then a newline.
fn to_line(v: Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn line(kind: &str, spec: &TemplateSpec, revision: u64, state: &State) -> Bytes {
    let state = (kind != "DELETED").then_some(state);
    watch_line(kind, object(spec, revision, state))
}

fn kind_name(k: ChangeKind) -> &'static str {
    match k {
        ChangeKind::Added => "ADDED",
        ChangeKind::Modified => "MODIFIED",
        ChangeKind::Deleted => "DELETED",
    }
}

/// The changes with `from < seq <= to`, as lines.
fn changes(s: &State, from: u64, to: u64) -> Vec<Bytes> {
    if from >= to {
        return Vec::new();
    }
    s.functions
        .changes
        .range(from + 1..=to)
        .map(|(seq, c)| line(kind_name(c.kind), &c.template, *seq, s))
        .collect()
}

/// The seq up to which the log is durable now (a decision with no events is acknowledged once
/// everything before it is).
async fn durable(log: &Log) -> Option<u64> {
    log.decide(|s: &State, _| (Vec::new(), s.seq))
        .await
        .ok()
        .map(|(seq, _)| seq)
}

/// The line that ends a watch that fell behind the changes kept.
fn compacted() -> Bytes {
    failed(
        "revision_compacted",
        "this watch fell behind the template changes kept; list the templates and watch from the list's revision".into(),
    )
}

async fn send_all(tx: &mpsc::Sender<Bytes>, lines: Vec<Bytes>) -> bool {
    for l in lines {
        if tx.send(l).await.is_err() {
            return false;
        }
    }
    true
}

/// Feeds one watch until its client goes away.
async fn feed(log: Arc<Log>, since: Option<u64>, tx: mpsc::Sender<Bytes>) {
    // Subscribed first, so nothing falls between the backlog and the live changes.
    let mut tail = log.subscribe();
    // The backlog and its revision from one look at the projection; sent only once that
    // revision is durable.
    let (backlog, mut last, dropped) = log.read(|s| {
        let lines = match since {
            None => s
                .functions
                .templates
                .values()
                .map(|t| line("ADDED", &t.spec, t.revision, s))
                .collect(),
            Some(since) => changes(s, since, s.seq),
        };
        (lines, s.seq, s.functions.changes_dropped_through)
    });
    if since.is_some_and(|x| x < dropped) {
        let _ = tx.send(compacted()).await;
        return;
    }
    if durable(&log).await.is_none() {
        return;
    }
    if !send_all(&tx, backlog).await || tx.send(bookmark(&last.to_string())).await.is_err() {
        return;
    }
    loop {
        let batch = tokio::select! {
            b = tail.recv() => b,
            _ = tx.closed() => return,
        };
        let lines = match batch {
            Ok(batch) => {
                let seqs: Vec<u64> = batch
                    .iter()
                    .filter(|e| e.seq > last)
                    .filter(|e| {
                        matches!(
                            e.event,
                            Event::TemplateUpserted { .. } | Event::TemplateDeleted { .. }
                        )
                    })
                    .map(|e| e.seq)
                    .collect();
                let top = batch.last().map_or(last, |e| e.seq.max(last));
                let lines = log.read(|s| {
                    seqs.iter()
                        .map(|q| {
                            s.functions
                                .changes
                                .get(q)
                                .map(|c| line(kind_name(c.kind), &c.template, *q, s))
                        })
                        .collect::<Option<Vec<_>>>()
                });
                let Some(lines) = lines else {
                    // A change already dropped from the kept ones: the client must list again.
                    let _ = tx.send(compacted()).await;
                    return;
                };
                last = top;
                lines
            }
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                // Fell behind the live tail: catch up from the projection's changes.
                let Some(now) = durable(&log).await else {
                    return;
                };
                if log.read(|s| last < s.functions.changes_dropped_through) {
                    let _ = tx.send(compacted()).await;
                    return;
                }
                let lines = log.read(|s| changes(s, last, now));
                last = now;
                lines
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        };
        if !send_all(&tx, lines).await {
            return;
        }
    }
}

/// A `BOOKMARK` line: the watch has reached `revision`.
fn bookmark(revision: &str) -> Bytes {
    to_line(json!({
        "type": "BOOKMARK",
        "object": {
            "apiVersion": functions::API_VERSION,
            "kind": functions::KIND,
            "metadata": { "resourceVersion": revision },
        },
        "revision": revision_number(revision),
    }))
}

/// A revision as a number, when it is one (Kubernetes' are opaque strings; etcd's are numbers).
fn revision_number(revision: &str) -> Value {
    revision.parse::<u64>().map_or(Value::Null, |n| json!(n))
}

/// A read of the `Func` resources that failed: a revision the API server no longer keeps is
/// `410`; a refusal (ebb's account may not read them: a setting to fix, not to retry) `502`;
/// anything else `503` with `Retry-After`.
fn kube_read_error(e: kube::Error) -> ApiError {
    match e {
        kube::Error::Api(s) if s.code == 410 => ApiError::new(
            StatusCode::GONE,
            "revision_compacted",
            format!(
                "the API server no longer keeps that revision ({}); list the templates and watch from the list's revision",
                s.message
            ),
        ),
        kube::Error::Api(s) if (400..500).contains(&s.code) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "kubernetes_refused",
            format!(
                "the Kubernetes API refused to let ebb read the Func resources ({}): {}",
                s.code, s.message
            ),
        ),
        e => ApiError {
            retry_after_s: Some(crate::peers::RETRY_AFTER_S),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "kubernetes_unavailable",
                format!("reading the Func resources failed: {e}"),
            )
        },
    }
}

/// How long a watch from a revision waits for the API server's first word before it answers:
/// the API server refuses a revision it no longer keeps at once, which is then a `410` as on one
/// machine; later, the `ERROR` line says it.
const REFUSAL_WITHIN: std::time::Duration = std::time::Duration::from_millis(300);

/// How many times in a row a resumed resource watch may end with nothing before the watch
/// gives up (with an `ERROR` line).
const EMPTY_RESUMES: u32 = 5;

type ResourceEvent = Result<kube::api::WatchEvent<functions::Func>, kube::Error>;

/// The watch API on Kubernetes: the `Func` resources' watch, as lines.
async fn watch_resources(store: KubeTemplates, since: Option<u64>) -> Result<Response, ApiError> {
    // Revision 0 is every change there ever was: the current templates, as without one (to the
    // API server it would mean "from anywhere", old revisions first).
    let since = since.filter(|s| *s > 0);
    let (backlog, from, stream, first) = match since {
        None => {
            let (items, revision) = store.list().await.map_err(kube_read_error)?;
            let lines = items
                .iter()
                .filter_map(|f| resource_line("ADDED", f))
                .collect();
            let stream = store.watch(&revision).await.map_err(kube_read_error)?;
            (lines, revision, stream, None)
        }
        Some(since) => {
            let revision = since.to_string();
            let mut stream = store.watch(&revision).await.map_err(kube_read_error)?;
            let first = match tokio::time::timeout(REFUSAL_WITHIN, stream.next()).await {
                Ok(Some(Ok(kube::api::WatchEvent::Error(e)) | Err(kube::Error::Api(e))))
                    if e.code == 410 =>
                {
                    return Err(kube_read_error(kube::Error::Api(e)));
                }
                Ok(first) => first,
                Err(_) => None,
            };
            (Vec::new(), revision, stream, first)
        }
    };
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(feed_resources(store, backlog, from, stream, first, tx));
    Ok(ndjson(rx))
}

/// A watch line for resource `f` (`None`: one ebb cannot take).
fn resource_line(kind: &str, f: &functions::Func) -> Option<Bytes> {
    let mut object = resource_object(f)?;
    if kind == "DELETED"
        && let Some(o) = object.as_object_mut()
    {
        o.remove("status");
    }
    Some(watch_line(kind, object))
}

/// A change line: `kind` of `object`, with its revision as a number too.
fn watch_line(kind: &str, object: Value) -> Bytes {
    let revision = revision_number(object["metadata"]["resourceVersion"].as_str().unwrap_or(""));
    to_line(json!({ "type": kind, "object": object, "revision": revision }))
}

/// The line that ends a watch.
fn failed(code: &str, why: String) -> Bytes {
    to_line(json!({ "type": "ERROR", "code": code, "error": why }))
}

/// Feeds one watch of the resources until its client goes away: the backlog, a bookmark at
/// `last`, then the resources' changes, until the watch fails (its `ERROR` line last).
async fn feed_resources(
    store: KubeTemplates,
    backlog: Vec<Bytes>,
    last: String,
    stream: futures_util::stream::BoxStream<'static, ResourceEvent>,
    first: Option<ResourceEvent>,
    tx: mpsc::Sender<Bytes>,
) {
    if !send_all(&tx, backlog).await || tx.send(bookmark(&last)).await.is_err() {
        return;
    }
    if let Some(end) = follow_resources(&store, last, stream, first, &tx).await {
        let _ = tx.send(end).await;
    }
}

/// The line that ends a resource watch on `e`: `revision_compacted` for a 410, else `code`.
fn watch_failed(e: &kube::Error, code: &str, doing: &str) -> Bytes {
    match e {
        kube::Error::Api(s) if s.code == 410 => compacted(),
        e => failed(code, format!("{doing} failed: {e}")),
    }
}

/// Sends the resources' changes as lines, resuming the resources' watch from the last revision
/// seen whenever the API server ends it; the line that ends the watch, or `None` once the
/// client has gone.
async fn follow_resources(
    store: &KubeTemplates,
    mut last: String,
    mut stream: futures_util::stream::BoxStream<'static, ResourceEvent>,
    mut first: Option<ResourceEvent>,
    tx: &mpsc::Sender<Bytes>,
) -> Option<Bytes> {
    use kube::api::WatchEvent;
    let mut empty_resumes = 0;
    let revision_of = |f: &functions::Func| f.metadata.resource_version.clone().unwrap_or_default();
    loop {
        let ev = match first.take() {
            Some(ev) => Some(ev),
            None => tokio::select! {
                ev = stream.next() => ev,
                _ = tx.closed() => return None,
            },
        };
        let line = match ev {
            None => {
                // The API server ended the watch (its timeout): go on from the last revision.
                empty_resumes += 1;
                if empty_resumes > EMPTY_RESUMES {
                    return Some(failed(
                        "kubernetes_unavailable",
                        "the API server keeps ending the Func watch; watch again".into(),
                    ));
                }
                if empty_resumes > 1 {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                match store.watch(&last).await {
                    Ok(s) => stream = s,
                    Err(e) => {
                        return Some(watch_failed(
                            &e,
                            "kubernetes_unavailable",
                            "resuming the Func watch",
                        ));
                    }
                }
                continue;
            }
            Some(Ok(WatchEvent::Added(f))) => {
                last = revision_of(&f);
                resource_line("ADDED", &f)
            }
            // One ebb can no longer take is gone as far as the API shows.
            Some(Ok(WatchEvent::Modified(f))) => {
                last = revision_of(&f);
                resource_line("MODIFIED", &f)
                    .or_else(|| Some(watch_line("DELETED", resource_identity(&f))))
            }
            Some(Ok(WatchEvent::Deleted(f))) => {
                last = revision_of(&f);
                resource_line("DELETED", &f)
                    .or_else(|| Some(watch_line("DELETED", resource_identity(&f))))
            }
            Some(Ok(WatchEvent::Bookmark(b))) => {
                last = b.metadata.resource_version;
                Some(bookmark(&last))
            }
            Some(Ok(WatchEvent::Error(e))) if e.code == 410 => return Some(compacted()),
            Some(Ok(WatchEvent::Error(e))) => {
                return Some(failed(
                    "kubernetes_error",
                    format!("the Func watch failed: {}", e.message),
                ));
            }
            Some(Err(e)) => {
                return Some(watch_failed(&e, "kubernetes_unavailable", "the Func watch"));
            }
        };
        empty_resumes = 0;
        if let Some(l) = line
            && tx.send(l).await.is_err()
        {
            return None;
        }
    }
}

/// The template as the change at `seq` left it (as it was, for a deletion).
fn change_object(app: &AppState, seq: u64) -> Option<Value> {
    app.log.read(|s| {
        s.functions.changes.get(&seq).map(|c| {
            object(
                &c.template,
                seq,
                (c.kind != ChangeKind::Deleted).then_some(s),
            )
        })
    })
}

fn autoscale_of(app: &AppState) -> functions::Autoscale {
    app.functions
        .as_ref()
        .map(|f| *f.autoscale())
        .unwrap_or_default()
}

/// Makes the orchestrator able to run a template's workload (its route is in the log).
fn register(app: &AppState, object: Option<&Value>) {
    let (Some(o), Some(name)) = (&app.orchestrator, object.and_then(name_of)) else {
        return;
    };
    // On Kubernetes the backend makes a function's workload from the log's template itself.
    if app.functions.as_ref().is_some_and(|f| f.kubernetes()) {
        return;
    }
    let spec = app
        .log
        .read(|s| s.functions.templates.get(name).map(|t| t.spec.clone()));
    if let Some(route) = spec.as_ref().and_then(functions::route_of)
        && let Some(process) = &route.process
    {
        let workload = crate::orchestrator::WorkloadSpec::from_process(
            &route.deployment,
            process,
            &app.ebb_exe,
        );
        if let Err(e) = o.register(workload) {
            tracing::warn!(template = name, error = %e, "registering the function's workload failed");
        }
    }
}

/// A write to the `Func` resources that failed, as an API answer.
fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::Refused(r) => refused(r),
        StoreError::Api(kube::Error::Api(e)) if (400..500).contains(&e.code) => ApiError::new(
            StatusCode::BAD_REQUEST,
            "kubernetes_refused",
            format!("the Kubernetes API refused the Func: {}", e.message),
        ),
        e @ (StoreError::Api(_) | StoreError::NotMirrored) => ApiError {
            retry_after_s: Some(crate::peers::RETRY_AFTER_S),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "kubernetes_unavailable",
                e.to_string(),
            )
        },
    }
}

async fn create(
    Extract(app): Extract<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let spec = parse(body)?.into_spec().map_err(invalid)?;
    let autoscale = autoscale_of(&app);
    if let Some(store) = &app.templates {
        let written = store
            .create(&app.log, spec, &autoscale)
            .await
            .map_err(store_error)?;
        return Ok((
            StatusCode::CREATED,
            Json(resource_object(&written).unwrap_or(Value::Null)),
        ));
    }
    let (done, committed) = app
        .log
        .decide(
            move |s: &State, _| match functions::decide_create(s, spec, &autoscale) {
                Ok(e) => (e, Ok(())),
                Err(r) => (Vec::new(), Err(r)),
            },
        )
        .await?;
    done.map_err(refused)?;
    let v = change_object(&app, committed.first_seq);
    register(&app, v.as_ref());
    Ok((StatusCode::CREATED, Json(v.unwrap_or(Value::Null))))
}

async fn show(
    Extract(app): Extract<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if let Some(store) = &app.templates {
        // A name no template can have is not asked of the API server (a path in it would be).
        if functions::check_name("template name", &name).is_err() {
            return Err(refused(Refused::Unknown(name)));
        }
        let f = store.get(&name).await.map_err(kube_read_error)?;
        return f
            .as_ref()
            .and_then(resource_object)
            .map(Json)
            .ok_or_else(|| refused(Refused::Unknown(name)));
    }
    app.log
        .read(|s| {
            s.functions
                .templates
                .get(&name)
                .map(|t| object(&t.spec, t.revision, Some(s)))
        })
        .map(Json)
        .ok_or_else(|| refused(Refused::Unknown(name)))
}

async fn put(
    Extract(app): Extract<AppState>,
    Path(name): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let mut j = parse(body)?;
    if j.name.is_empty() {
        j.name = name.clone();
    } else if j.name != name {
        return Err(invalid(format!(
            "the body names {:?} but the path {name:?}",
            j.name
        )));
    }
    let spec = j.into_spec().map_err(invalid)?;
    let autoscale = autoscale_of(&app);
    if let Some(store) = &app.templates {
        let (created, written) = store
            .put(&app.log, spec, &autoscale)
            .await
            .map_err(store_error)?;
        let status = if created {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        };
        return Ok((
            status,
            Json(resource_object(&written).unwrap_or(Value::Null)),
        ));
    }
    let (created, _) = app
        .log
        .decide(
            move |s: &State, _| match functions::decide_put(s, spec, &autoscale) {
                Ok((events, created)) => (events, Ok(created)),
                Err(r) => (Vec::new(), Err(r)),
            },
        )
        .await?;
    let created = created.map_err(refused)?;
    let v = app.log.read(|s| {
        s.functions
            .templates
            .get(&name)
            .map(|t| object(&t.spec, t.revision, Some(s)))
    });
    register(&app, v.as_ref());
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(v.unwrap_or(Value::Null))))
}

async fn delete(
    Extract(app): Extract<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if let Some(store) = &app.templates {
        let before = store.delete(&app.log, &name).await.map_err(store_error)?;
        // Gone already (deleted through another replica, which this one had not seen yet).
        let mut v = before
            .as_ref()
            .and_then(resource_object)
            .ok_or_else(|| refused(Refused::Unknown(name.clone())))?;
        if let Some(o) = v.as_object_mut() {
            o.remove("status");
        }
        return Ok(Json(v));
    }
    let (done, committed) = app
        .log
        .decide(
            move |s: &State, _| match functions::decide_delete(s, &name) {
                Ok(e) => (e, Ok(())),
                Err(r) => (Vec::new(), Err(r)),
            },
        )
        .await?;
    done.map_err(refused)?;
    let v = change_object(&app, committed.first_seq);
    // A deleted function's workload stops.
    if let (Some(o), Some(name)) = (&app.orchestrator, v.as_ref().and_then(name_of)) {
        let _ = o.scale(&functions::workload_of(name), 0);
    }
    Ok(Json(v.unwrap_or(Value::Null)))
}
