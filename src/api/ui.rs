//! The dashboard at `/ui` and what it reads, and `ebb explain` over HTTP.
//!
//! The page (`src/ui/`: HTML, CSS and JS, no dependencies) is compiled into the binary and
//! served to anyone; everything it shows comes from `/ui/api/*`, behind the dashboard's access
//! ([`super::access`]: its token, else the admin token, or RBAC's `get` on `dashboard` with
//! `--kube-auth`): a bearer header, or the `ebb_session` cookie that `POST /ui/login` sets
//! (HttpOnly, SameSite=Strict, `Secure` over TLS, on `/ui` only), since a browser's
//! `EventSource` cannot send headers. The cookie is a random session id for the token signed in
//! with ([`super::access::Sessions`]: in memory, bounded, ending after 8 h or at
//! `POST /ui/logout`), never the token itself. The live updates are
//! server-sent events from the log's tail, each told in words by one narrator task ([`Feed`]),
//! started on the first subscriber and ended with the server, which keeps its own copy of the
//! projection so each line is told from the state before it.
//!
//! `GET /admin/explain/{kind}/{id}` (bearer only) answers what `ebb explain KIND ID --json` prints.

use std::sync::{Arc, OnceLock, Weak};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State as Extract};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use super::access::{Api, COOKIE, guarded};
use super::{ApiError, AppState};
use crate::event::{Envelope, Event, Kind};
use crate::log::Log;
use crate::state::State;
use crate::state::calls::CallStatus;
use crate::tools::ExplainKind;

const INDEX: &str = include_str!("../ui/index.html");
const SCRIPT: &str = include_str!("../ui/app.js");
const STYLE: &str = include_str!("../ui/app.css");

/// Events one timeline answer carries at most (the newest are kept).
const MAX_TIMELINE: usize = 2_000;
/// Calls one page of the call list carries at most.
const MAX_CALLS: usize = 500;
/// Told events waiting for slow dashboards; one that falls further behind is told to re-read.
const FEED_BOUND: usize = 1_024;

pub(super) fn router(app: &AppState) -> Router<AppState> {
    let dashboard = Router::new()
        .route("/ui/api/overview", get(overview))
        .route("/ui/api/timeline", get(timeline))
        .route("/ui/api/calls", get(calls))
        .route("/ui/api/explain/{kind}/{*id}", get(ui_explain))
        .route("/ui/api/events", get(events));
    let admin = Router::new().route("/admin/explain/{kind}/{*id}", get(admin_explain));
    Router::new()
        .route("/ui", get(|| page(INDEX, "text/html; charset=utf-8")))
        .route("/ui/", get(|| page(INDEX, "text/html; charset=utf-8")))
        .route(
            "/ui/app.js",
            get(|| page(SCRIPT, "text/javascript; charset=utf-8")),
        )
        .route(
            "/ui/app.css",
            get(|| page(STYLE, "text/css; charset=utf-8")),
        )
        .route("/ui/login", post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/api/session", get(session))
        .merge(guarded(dashboard, app, &[Api::Dashboard]))
        .merge(guarded(admin, app, &[Api::Admin]))
}

async fn page(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[derive(Deserialize)]
struct Login {
    token: String,
}

async fn login(Extract(app): Extract<AppState>, body: Bytes) -> Result<Response, ApiError> {
    if !app.access.enabled(Api::Dashboard) {
        return Err(Api::Dashboard.disabled());
    }
    let login: Login = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_body",
            format!("expected {{\"token\": \"...\"}}: {e}"),
        )
    })?;
    // A token that could break the cookie header is never right.
    let printable = login
        .token
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b';');
    if !printable {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "wrong dashboard token",
        ));
    }
    app.access
        .check(&[Api::Dashboard], "get", Some(&login.token))
        .await?;
    let id = app.access.sessions.open(&login.token);
    Ok(with_cookie(
        &app,
        &format!(
            "{COOKIE}={id}; Max-Age={}",
            super::access::SESSION_TTL.as_secs()
        ),
    ))
}

/// Ends the dashboard session its cookie names (if any) and clears the cookie.
async fn logout(Extract(app): Extract<AppState>, headers: HeaderMap) -> Response {
    if let Some(id) = super::access::cookie(&headers, COOKIE) {
        app.access.sessions.close(id);
    }
    with_cookie(&app, &format!("{COOKIE}=; Max-Age=0"))
}

/// 204 setting the session cookie to `value` (with its attributes).
fn with_cookie(app: &AppState, value: &str) -> Response {
    let secure = if app.access.secure_cookies {
        "; Secure"
    } else {
        ""
    };
    let set = format!("{value}; Path=/ui; HttpOnly; SameSite=Strict{secure}");
    let mut r = StatusCode::NO_CONTENT.into_response();
    if let Ok(v) = HeaderValue::from_str(&set) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

async fn session(Extract(app): Extract<AppState>, headers: HeaderMap) -> Json<Value> {
    let given = app.access.dashboard_token(&headers);
    let signed_in = app
        .access
        .check(&[Api::Dashboard], "get", given.as_deref())
        .await
        .is_ok();
    Json(json!({ "signed_in": signed_in }))
}

fn no_store(body: Value) -> Response {
    let mut r = Json(body).into_response();
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

async fn overview(Extract(app): Extract<AppState>) -> Result<Response, ApiError> {
    let ready = |deployment: &str| {
        app.orchestrator
            .as_ref()
            .and_then(|o| o.observe(deployment))
            .map_or(0, |o| o.ready.len())
    };
    let (mut body, deployments) = app.log.read(|s| {
        let by_state: serde_json::Map<String, Value> = CallStatus::ALL
            .iter()
            .zip(s.calls.count_by_status())
            .map(|(st, n)| (st.name().to_owned(), json!(n)))
            .collect();
        let workloads: Vec<Value> = s
            .routes
            .by_name
            .values()
            .map(|r| {
                let d = s.routes.deployments.get(&r.spec.deployment);
                json!({
                    "route": r.spec.name,
                    "domains": r.spec.domains,
                    "deployment": r.spec.deployment,
                    "desired": d.map_or(0, |d| d.desired),
                    "replicas": d.map_or(0, |d| d.replicas),
                    "min_replicas": r.spec.min_replicas,
                    "max_replicas": r.spec.max_replicas,
                    "idle_after_ms": r.spec.idle_after_ms,
                    "last_used_ms": r.last_used_ms,
                    "requests_total": r.requests_total,
                })
            })
            .collect();
        let deployments: Vec<String> = s
            .routes
            .by_name
            .values()
            .map(|r| r.spec.deployment.clone())
            .collect();
        let functions: Vec<Value> = s
            .functions
            .templates
            .values()
            .map(|t| {
                let name = &t.spec.name;
                let of = s
                    .functions
                    .instances
                    .values()
                    .filter(|i| &i.template == name);
                let running = s
                    .functions
                    .running
                    .iter()
                    .filter(|id| {
                        s.functions
                            .instances
                            .get(*id)
                            .is_some_and(|i| &i.template == name)
                    })
                    .count();
                json!({
                    "name": name,
                    "counter": s.counters.value(name),
                    "instances_running": running,
                    "instances_total": of.count(),
                    "min_instances": t.spec.min_instances,
                    "max_instances": t.spec.max_instances,
                })
            })
            .collect();
        let cleaners: Vec<Value> = s
            .cleaners
            .by_name
            .values()
            .map(|c| {
                json!({
                    "name": c.spec.name,
                    "next_at_ms": c.next_at_ms,
                    "last_result": c.last_result,
                    "reason": c.reason,
                    "message": c.message,
                    "fired_at_ms": c.fired_at_ms,
                })
            })
            .collect();
        (
            json!({
                "seq": s.seq,
                "at_ms": crate::clock::Clock::now_ms(&crate::clock::SystemClock),
                "workloads": workloads,
                "functions": functions,
                "calls_by_state": by_state,
                "cleaners": cleaners,
            }),
            deployments,
        )
    });
    // Ready replicas are the orchestrator's, read outside the projection's lock.
    if let Some(list) = body["workloads"].as_array_mut() {
        for (w, d) in list.iter_mut().zip(deployments) {
            w["ready"] = json!(ready(&d));
        }
    }
    Ok(no_store(body))
}

#[derive(Deserialize)]
struct TimelineQuery {
    route: String,
    since_ms: Option<u64>,
}

async fn timeline(
    Extract(app): Extract<AppState>,
    query: Result<Query<TimelineQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) =
        query.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_query", e.body_text()))?;
    let Some(deployment) = app.log.read(|s| {
        s.routes
            .by_name
            .get(&q.route)
            .map(|r| r.spec.deployment.clone())
    }) else {
        return Err(ApiError::not_found(format!("no route {:?}", q.route)));
    };
    let since = q.since_ms.unwrap_or(0);
    let store = app.log.store().clone();
    let route = q.route.clone();
    let (events, truncated) = tokio::task::spawn_blocking(move || {
        crate::tools::timeline(
            &*store,
            since,
            &route,
            &deployment,
            MAX_TIMELINE,
            timeline_item,
        )
    })
    .await
    .map_err(|e| internal(format!("reading the timeline: {e}")))?
    .map_err(|e| internal(format!("reading the timeline: {e}")))?;
    Ok(no_store(json!({
        "route": q.route,
        "since_ms": since,
        "events": events,
        "truncated": truncated,
    })))
}

/// A requests or scale event of `route` (whose workload is `deployment`), for the timeline.
fn timeline_item(env: &Envelope, route: &str, deployment: &str) -> Option<Value> {
    let mut desired = None;
    let mut load = None;
    let (kind, count, replicas, text) = match &env.event {
        Event::RequestsSeen {
            route: r,
            count,
            last_at_ms,
        } if r == route => (
            "requests",
            Some(*count),
            None,
            format!(
                "{count} requests, the last at {}",
                crate::story::clock(*last_at_ms)
            ),
        ),
        Event::ScaleRequested {
            deployment: d,
            from,
            to,
            reason,
        } if d == deployment => {
            desired = Some(*to);
            let why = match reason {
                crate::event::ScaleReason::Load(why) => {
                    load = Some(json!({
                        "metric": why.metric.name(),
                        "per_replica": why.per_replica_milli as f64 / 1000.0,
                        "target": why.target_milli as f64 / 1000.0,
                        "utilization_pct": why.utilization_pct,
                        "window_ms": why.window_ms,
                        "panic": why.panic,
                        "held": why.held,
                    }));
                    format!("load: {}", crate::story::load_reason(why))
                }
                other => other.name().to_owned(),
            };
            (
                "scale",
                None,
                None,
                format!("asked to scale from {from} to {to} ({why})"),
            )
        }
        Event::ScaledUp {
            deployment: d,
            replicas,
        } if d == deployment => ("scale", None, Some(*replicas), format!("{replicas} ready")),
        Event::ScaledDown {
            deployment: d,
            replicas,
        } if d == deployment => (
            "scale",
            None,
            Some(*replicas),
            format!("scaled down to {replicas}"),
        ),
        Event::ScaleFailed {
            deployment: d,
            to,
            error,
        } if d == deployment => (
            "scale",
            None,
            None,
            format!("scaling to {to} failed: {error}"),
        ),
        _ => return None,
    };
    Some(json!({
        "seq": env.seq,
        "at_ms": env.at_ms,
        "kind": kind,
        "name": env.event.name(),
        "text": text,
        "count": count,
        "replicas": replicas,
        "desired": desired,
        "load": load,
    }))
}

#[derive(Deserialize)]
struct CallsQuery {
    state: Option<String>,
    limit: Option<usize>,
}

async fn calls(
    Extract(app): Extract<AppState>,
    query: Result<Query<CallsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) =
        query.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_query", e.body_text()))?;
    let wanted = match q.state.as_deref() {
        None | Some("") | Some("all") => None,
        Some(s) => Some(CallStatus::parse(s).ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_query",
                format!(
                    "unknown call state {s:?}: queued, running, success, error, timeout or cancelled"
                ),
            )
        })?),
    };
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_CALLS);
    let list: Vec<Value> = app.log.read(|s| {
        // Call ids are UUID v7: the highest are the newest.
        s.calls
            .newest(limit, |c| wanted.is_none_or(|w| w == c.status))
            .into_iter()
            .map(|(_, c)| {
                json!({
                    "id": c.spec.id,
                    "target": c.spec.target,
                    "kind": c.spec.kind,
                    "status": c.status.name(),
                    "queued_at_ms": c.created_at_ms,
                    "started_at_ms": c.started_at_ms,
                    "finished_at_ms": c.finished_at_ms,
                    "runner": c.runner,
                })
            })
            .collect()
    });
    Ok(no_store(json!({ "calls": list })))
}

async fn ui_explain(
    Extract(app): Extract<AppState>,
    Path((kind, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    explain(&app, &kind, &id).await
}

async fn admin_explain(
    Extract(app): Extract<AppState>,
    Path((kind, id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    explain(&app, &kind, &id).await
}

/// The story of `kind id` from this replica's log: the whole log is read, on the blocking pool.
async fn explain(app: &AppState, kind: &str, id: &str) -> Result<Response, ApiError> {
    let Some(k) = ExplainKind::parse(kind) else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_kind",
            format!(
                "cannot explain a {kind:?}: route, deployment, call, cleaner, function or instance"
            ),
        ));
    };
    let store = app.log.store().clone();
    let name = id.to_owned();
    let found =
        tokio::task::spawn_blocking(move || crate::tools::explain(&*store, k, &name, &mut |_| {}))
            .await
            .map_err(|e| internal(format!("explaining: {e}")))?
            .map_err(|e| internal(format!("explaining: {e}")))?;
    match found {
        Some(ex) => Ok(no_store(serde_json::to_value(ex).unwrap_or(Value::Null))),
        None => Err(ApiError::not_found(format!(
            "no {} {id:?} in the log",
            k.name()
        ))),
    }
}

/// One told event, as the event stream sends it.
#[derive(Debug, Clone, Serialize)]
pub struct Told {
    pub seq: u64,
    pub at_ms: u64,
    /// The event's name.
    pub name: &'static str,
    /// What it shapes: route, deployment, call, function, instance, cleaner.
    pub kind: &'static str,
    /// Its id ("" for events about many).
    pub subject: String,
    /// The routes whose workload it concerns.
    pub routes: Vec<String>,
    /// The event in words.
    pub text: String,
    /// Requests, for `RequestsSeen`.
    pub count: Option<u64>,
    /// Replicas, for `ScaledUp` and `ScaledDown`.
    pub replicas: Option<u32>,
    /// Replicas asked for, for `ScaleRequested`.
    pub desired: Option<u32>,
}

impl Told {
    /// The marker of skipped events (seq 0): dashboards read everything again.
    fn resync() -> Told {
        Told {
            seq: 0,
            at_ms: 0,
            name: "",
            kind: "other",
            subject: String::new(),
            routes: Vec::new(),
            text: String::new(),
            count: None,
            replicas: None,
            desired: None,
        }
    }
}

fn told(before: &State, env: &Envelope) -> Told {
    let (kind, subject) = env.event.subject();
    let routes = match kind {
        Kind::Route => vec![subject.to_owned()],
        Kind::Deployment => before
            .routes
            .by_deployment
            .get(subject)
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let (count, replicas) = match &env.event {
        Event::RequestsSeen { count, .. } => (Some(*count), None),
        Event::ScaledUp { replicas, .. } | Event::ScaledDown { replicas, .. } => {
            (None, Some(*replicas))
        }
        _ => (None, None),
    };
    let desired = match &env.event {
        Event::ScaleRequested { to, .. } => Some(*to),
        _ => None,
    };
    Told {
        seq: env.seq,
        at_ms: env.at_ms,
        name: env.event.name(),
        kind: kind.name(),
        subject: subject.to_owned(),
        routes,
        text: crate::story::line(before, env).text,
        count,
        replicas,
        desired,
    }
}

/// The log's tail told in words, for every dashboard at once: one narrator task, started when the
/// first dashboard connects, with its own copy of the projection. A dashboard that falls more than
/// `FEED_BOUND` events behind is told to re-read (`resync`) and goes on from the newest.
pub struct Feed {
    stop: watch::Receiver<bool>,
    tx: OnceLock<broadcast::Sender<Arc<Told>>>,
}

impl Feed {
    /// A feed whose streams end when `stop` turns true.
    pub fn new(stop: watch::Receiver<bool>) -> Self {
        Self {
            stop,
            tx: OnceLock::new(),
        }
    }

    fn subscribe(&self, log: &Arc<Log>) -> broadcast::Receiver<Arc<Told>> {
        self.tx
            .get_or_init(|| {
                let (tx, _) = broadcast::channel(FEED_BOUND);
                tokio::spawn(narrate(Arc::downgrade(log), log.subscribe(), tx.clone()));
                tx
            })
            .subscribe()
    }
}

async fn narrate(log: Weak<Log>, mut tail: crate::log::Tail, tx: broadcast::Sender<Arc<Told>>) {
    use broadcast::error::RecvError;
    let copy = |log: &Weak<Log>| log.upgrade().map(|l| l.read(|s| s.clone()));
    let Some(mut state) = copy(&log) else { return };
    loop {
        match tail.recv().await {
            Ok(batch) => {
                let seen = state.seq;
                for env in batch.iter().filter(|e| e.seq > seen) {
                    let t = told(&state, env);
                    state.apply(env);
                    let _ = tx.send(Arc::new(t));
                }
            }
            Err(RecvError::Lagged(n)) => {
                tracing::warn!(
                    batches = n,
                    "the dashboards' narrator fell behind the log's tail"
                );
                let Some(s) = copy(&log) else { return };
                state = s;
                // Events were skipped: every dashboard reads it all again.
                let _ = tx.send(Arc::new(Told::resync()));
            }
            Err(RecvError::Closed) => return,
        }
    }
}

async fn events(Extract(app): Extract<AppState>) -> Result<Response, ApiError> {
    use broadcast::error::RecvError;
    let rx = app.feed.subscribe(&app.log);
    let stop = app.feed.stop.clone();
    let stream = futures_util::stream::unfold((rx, stop), |(mut rx, mut stop)| async move {
        if *stop.borrow() {
            return None;
        }
        let event = tokio::select! {
            _ = stop.changed() => return None,
            r = rx.recv() => match r {
                Ok(t) if t.seq == 0 => Sse::default().event("resync").data("{}"),
                Ok(t) => Sse::default()
                    .event("log")
                    .id(t.seq.to_string())
                    .json_data(&*t)
                    .unwrap_or_else(|_| Sse::default().comment("unencodable")),
                Err(RecvError::Lagged(_)) => Sse::default().event("resync").data("{}"),
                Err(RecvError::Closed) => return None,
            },
        };
        Some((Ok::<_, std::convert::Infallible>(event), (rx, stop)))
    });
    let mut r = axum::response::Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response();
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(r)
}

fn internal(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
}
