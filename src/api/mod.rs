//! ebb's own HTTP endpoints (axum), apart from the proxy, on the admin address, and the one place
//! where errors become HTTP answers ([`ApiError`], a JSON body `{"error": "...", "code": "..."}`
//! with a 4xx or 5xx status). Handlers read the live projection and ask the log for decisions;
//! they never touch storage directly.
//!
//! * `/healthz`: alive. `/readyz`: the proxy is ready for traffic, each check with its reason
//!   (the log's writer has not failed, the projection has caught up with the stored log, the
//!   orchestrator has listed what it needs), else 503 `not_ready`: the pod's readiness, so app
//!   traffic never stops because the call queue is down. `/readyz/calls`: the calls API is
//!   ready, the same checks and the queue's (`Queue::reachable`).
//! * `/metrics` ([`crate::metrics`]); the dashboard and `/admin/explain` ([`ui`]).
//! * The admin API ([`admin`]): `GET /admin/routes`, `GET|PUT|DELETE /admin/routes/{name}`. A PUT
//!   body has the fields of an app in `ebb.toml` (JSON); the route and how to run it go into the
//!   log, so they survive restarts.
//! * The functions API ([`funcs`]), the runner and calls API ([`runner`]).
//!
//! Each API is behind [`access::guard`] (its bearer token, or Kubernetes' RBAC with
//! `--kube-auth`). One middleware refuses absolute-form and CONNECT targets (ebb's endpoints are
//! not a proxy) and turns an extractor's plain 413 into JSON. Under hyper, every connection of
//! the admin address passes through [`crate::strict`]'s framing checks. A request about an id
//! another replica owns is answered through the owner ([`through_owner`]).

pub mod access;
pub mod admin;
pub mod funcs;
pub mod runner;
pub mod ui;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State as Extract;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::log::Log;
use crate::peers::{PeerError, Peers};

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// The open log and its live projection.
    pub log: Arc<Log>,
    /// Runs the workloads of routes created through the admin API.
    pub orchestrator: Option<Arc<dyn crate::orchestrator::Orchestrator>>,
    /// Who may use which API: the APIs' bearer tokens, and Kubernetes' answers with
    /// `--kube-auth`.
    pub access: Arc<access::Access>,
    /// The ebb binary, for workloads whose program is `ebb`.
    pub ebb_exe: std::path::PathBuf,
    /// The call service behind the runner API, if this ebb runs one.
    pub calls: Option<Arc<crate::calls::Calls>>,
    /// The functions runtime (instances), if this ebb runs calls.
    pub functions: Option<Arc<crate::functions::runtime::FunctionService>>,
    /// On Kubernetes: function templates are `Func` resources, written there (the log follows
    /// them); `None`: the log is their store.
    pub templates: Option<crate::orchestrator::kube_templates::KubeTemplates>,
    /// This replica's name and the way to the others (calls and instances owned elsewhere are
    /// answered through their owner).
    pub peers: Arc<Peers>,
    /// Whether ebb is ready for traffic (`/readyz`): on Kubernetes, once it has listed the
    /// cluster's Services and EndpointSlices. `None`: ready once it answers.
    pub ready: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
    /// On Kubernetes: the watches RBAC refuses ebb, which `/readyz` names (ebb serves without
    /// them: still ready, `degraded`).
    pub refused: Option<crate::orchestrator::kube_health::Access>,
    /// The metrics `/metrics` shows (`None`: not served).
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
    /// The log's tail told in words, for the dashboard's live updates.
    pub feed: Arc<ui::Feed>,
    /// The most bytes of a request body (`--max-api-body-bytes`; a function's arguments and a
    /// template have smaller bounds of their own).
    pub max_body_bytes: usize,
    /// Scaling on load: the shares other ebb replicas report (`POST /runner/load`) and what
    /// the last decisions found (`/metrics`, the dashboard). `None`: not served.
    pub load: Option<Arc<crate::proxy::load::LoadScaler>>,
    /// The clock reports are received by.
    pub clock: Arc<dyn crate::clock::Clock>,
    /// Set once shutdown has begun (`--shutdown-delay-ms`): `/readyz` answers 503.
    pub stopping: Arc<std::sync::atomic::AtomicBool>,
}

/// Largest request body ebb's own endpoints read by default (`--max-api-body-bytes`).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// Whether `given` is `token`, compared in constant time: how long it takes depends on the
/// length of `given` alone, never on `token` (not even its length) nor on where they differ.
pub fn token_matches(given: &str, token: &str) -> bool {
    let (g, t) = (given.as_bytes(), token.as_bytes());
    if t.is_empty() {
        return false;
    }
    let mut diff = u8::from(g.len() != t.len());
    for (i, b) in g.iter().enumerate() {
        diff |= b ^ t[i % t.len()];
    }
    diff == 0
}

/// An API error: an HTTP status, a stable machine-readable code and a message for people.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable code, e.g. `not_found`.
    pub code: &'static str,
    /// Human-readable message.
    pub message: String,
    /// Seconds to wait before asking again (`Retry-After`), for an answer that will change.
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// An error with a status and code.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_s: None,
        }
    }

    /// A 404 with code `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
}

impl From<crate::log::Error> for ApiError {
    fn from(e: crate::log::Error) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "log_unavailable",
            e.to_string(),
        )
    }
}

impl From<PeerError> for ApiError {
    fn from(e: PeerError) -> Self {
        let message = e.to_string();
        match e {
            PeerError::Unavailable(..) => Self {
                retry_after_s: Some(crate::peers::RETRY_AFTER_S),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "owner_unavailable",
                    message,
                )
            },
            PeerError::Unknown(_) => Self::new(StatusCode::NOT_FOUND, "unknown_owner", message),
            PeerError::Misdirected(..) => {
                Self::new(StatusCode::MISDIRECTED_REQUEST, "misdirected", message)
            }
            PeerError::Unencodable(_) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "encode_failed", message)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (
            self.status,
            Json(json!({ "error": self.message, "code": self.code })),
        )
            .into_response();
        if let Some(s) = self.retry_after_s {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        resp
    }
}

/// Answers a request about `id` through its owner when another replica owns it: `Ok(None)` when
/// this replica owns it (the caller answers), else the owner's answer as it came (status,
/// content type and body). A request forwarded to this replica that names another owner is
/// refused, never forwarded again.
pub async fn through_owner(
    app: &AppState,
    id: &str,
    method: axum::http::Method,
    uri: &axum::http::Uri,
    headers: &axum::http::HeaderMap,
    body: bytes::Bytes,
) -> Result<Option<Response>, ApiError> {
    let Some(owner) = app.peers.other_owner(id) else {
        return Ok(None);
    };
    if let Some(by) = headers.get(crate::peers::FORWARDED_BY) {
        return Err(PeerError::Misdirected(
            app.peers.me().unwrap_or("").to_owned(),
            by.to_str().unwrap_or("?").to_owned(),
        )
        .into());
    }
    let pass: Vec<_> = [
        axum::http::header::AUTHORIZATION,
        axum::http::header::CONTENT_TYPE,
        axum::http::header::ACCEPT,
    ]
    .into_iter()
    .filter_map(|h| headers.get(&h).map(|v| (h, v.clone())))
    .collect();
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let a = app.peers.send(owner, method, path, &pass, body).await?;
    let mut resp = (
        StatusCode::from_u16(a.status).unwrap_or(StatusCode::BAD_GATEWAY),
        a.body,
    )
        .into_response();
    if let Some(ct) = a
        .content_type
        .and_then(|c| axum::http::HeaderValue::from_str(&c).ok())
    {
        resp.headers_mut()
            .insert(axum::http::header::CONTENT_TYPE, ct);
    }
    Ok(Some(resp))
}

/// The router of ebb's own endpoints.
pub fn router(state: AppState) -> Router {
    let max_body_bytes = state.max_body_bytes;
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/readyz/calls", get(readyz_calls))
        .route("/metrics", get(metrics))
        .merge(admin::router(&state))
        .merge(ui::router(&state))
        .merge(runner::router(&state))
        .merge(funcs::router(&state))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn(origin_form_only))
        .with_state(state)
}

/// ebb's endpoints are not a proxy: a request whose target names a host (absolute or authority
/// form, CONNECT's) is refused rather than served as if it were for this server. A body refused
/// for its size is answered in JSON.
async fn origin_form_only(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if req.uri().authority().is_some() || req.method() == axum::http::Method::CONNECT {
        return ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_target",
            "ebb's API takes a path as the request target, not a URL or a host",
        )
        .into_response();
    }
    let resp = next.run(req).await;
    // A body over the bound refused by an extractor before its handler ran: answered in JSON
    // like every other error.
    let json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE && !json {
        crate::limits::Limit::ApiBodyBytes.hit();
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            "the request body is over the bound (--max-api-body-bytes)",
        )
        .into_response();
    }
    resp
}

/// Events the projection may trail the stored log by and still count as caught up (the writer
/// applies each batch right after it is synced; a larger gap means it is stuck).
const READY_MAX_LAG: u64 = 10_000;

/// The proxy is ready for traffic, the readiness probe of ebb's pods: each check with its
/// reason, 503 when one fails. The log is open and its writer has not failed; the projection has
/// caught up with the stored log; the orchestrator has listed what it needs (on Kubernetes: the
/// Services and EndpointSlices). The call queue is not among them: a broker away stops calls,
/// not app traffic ([`readyz_calls`]).
async fn readyz(Extract(app): Extract<AppState>) -> Response {
    readiness(&app, false).await
}

/// The calls API is ready: [`readyz`]'s checks and the call queue's (Kafka: the topic's
/// metadata within a second).
async fn readyz_calls(Extract(app): Extract<AppState>) -> Response {
    readiness(&app, true).await
}

async fn readiness(app: &AppState, calls: bool) -> Response {
    let mut checks = serde_json::Map::new();
    let mut ready = true;
    let mut check = |name: &str, ok: bool, reason: String| {
        ready &= ok;
        checks.insert(name.into(), json!({ "ok": ok, "reason": reason }));
    };
    if app.stopping.load(std::sync::atomic::Ordering::Acquire) {
        check(
            "shutdown",
            false,
            "ebb is shutting down: it serves until it stops accepting connections".into(),
        );
    }
    match app.log.failure() {
        None => check("log", true, "open".into()),
        Some(why) => check("log", false, format!("storage failed: {why}")),
    }
    let applied = app.log.applied_seq();
    match app.log.store().last_seq() {
        Ok(last) => check(
            "projection",
            last.saturating_sub(applied) <= READY_MAX_LAG,
            format!("applied seq {applied} of {last}"),
        ),
        Err(e) => check("projection", false, format!("reading the log: {e}")),
    }
    match &app.ready {
        Some(synced) if !synced() => check(
            "orchestrator",
            false,
            "the cluster's Services and EndpointSlices are not listed yet".into(),
        ),
        Some(_) => check(
            "orchestrator",
            true,
            "the cluster's Services and EndpointSlices are listed".into(),
        ),
        None => check("orchestrator", true, "local processes".into()),
    }
    let refused = app
        .refused
        .as_ref()
        .map(|a| a.refused())
        .unwrap_or_default();
    if app.refused.is_some() {
        let reason = if refused.is_empty() {
            "every watch ebb needs is allowed".to_owned()
        } else {
            let each: Vec<String> = refused
                .iter()
                .map(|(what, why)| format!("{what} ({why})"))
                .collect();
            format!(
                "Kubernetes refuses ebb to watch {}; ebb serves without them and asks again",
                each.join("; ")
            )
        };
        // Refused watches degrade ebb (routes or functions missing) but do not stop its traffic.
        check("access", true, reason);
    }
    if let Some(calls) = app.calls.as_ref().filter(|_| calls) {
        let reached =
            tokio::time::timeout(std::time::Duration::from_secs(2), calls.queue().reachable())
                .await;
        match reached {
            Ok(Ok(())) => check("queue", true, "reachable".into()),
            Ok(Err(e)) => check("queue", false, e.to_string()),
            Err(_) => check("queue", false, "no answer within 2 s".into()),
        }
    }
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = if ready {
        let status = if refused.is_empty() {
            "ready"
        } else {
            "degraded"
        };
        json!({ "status": status, "checks": checks })
    } else {
        let failing: Vec<&String> = checks
            .iter()
            .filter(|(_, v)| v["ok"] == false)
            .map(|(k, _)| k)
            .collect();
        json!({
            "status": "not_ready",
            "error": format!("not ready: {}", failing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")),
            "code": "not_ready",
            "checks": checks,
        })
    };
    (status, Json(body)).into_response()
}

/// The metrics in the OpenMetrics text format (Prometheus reads it).
async fn metrics(Extract(app): Extract<AppState>) -> Result<axum::response::Response, ApiError> {
    let Some(m) = &app.metrics else {
        return Err(ApiError::not_found("this ebb serves no metrics"));
    };
    let mut resp = m.encode().into_response();
    resp.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    Ok(resp)
}

async fn healthz(Extract(app): Extract<AppState>) -> Json<serde_json::Value> {
    let seq = app.log.read(|s| s.seq);
    Json(json!({ "status": "ok", "seq": seq }))
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this path does not take that method",
    )
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no endpoint at {}", uri.path()))
}
