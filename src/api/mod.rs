//! ebb's own HTTP endpoints (axum), apart from the proxy: `/healthz` and the admin API, and the one
//! place where errors become HTTP answers with a JSON body `{"error": "...", "code": "..."}`.
//! Handlers read the live projection and ask the log for decisions; they never touch storage
//! directly.
//!
//! Admin API (bearer token, `ebb serve --admin-token` / `EBB_ADMIN_TOKEN`; disabled without one):
//! `GET /admin/routes`, `GET|PUT|DELETE /admin/routes/{name}`. A PUT body has the fields of an app
//! in `ebb.toml` (JSON); the route and how to run it go into the log, so they survive restarts.

pub mod admin;
pub mod funcs;
pub mod runner;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State as Extract;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::log::Log;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// The open log and its live projection.
    pub log: Arc<Log>,
    /// Runs the workloads of routes created through the admin API.
    pub orchestrator: Option<Arc<dyn crate::orchestrator::Orchestrator>>,
    /// The admin API's bearer token; `None` disables the admin API.
    pub admin_token: Option<String>,
    /// The ebb binary, for workloads whose program is `ebb`.
    pub ebb_exe: std::path::PathBuf,
    /// The call service behind the runner API, if this ebb runs one.
    pub calls: Option<Arc<crate::calls::Calls>>,
    /// The runner API's bearer token; `None` disables the runner API.
    pub runner_token: Option<String>,
    /// The functions API's bearer token; `None` disables the functions API.
    pub api_token: Option<String>,
    /// The functions runtime (instances), if this ebb runs calls.
    pub functions: Option<Arc<crate::functions::runtime::FunctionService>>,
    /// Whether ebb is ready for traffic (`/readyz`): on Kubernetes, once it has listed the
    /// cluster's Services and EndpointSlices. `None`: ready once it answers.
    pub ready: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

/// Largest request body ebb's own endpoints read.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// Checks a bearer token in constant time. `what` names the API, `how` how to give it a token.
pub fn authorize_token(
    token: Option<&str>,
    headers: &axum::http::HeaderMap,
    what: &str,
    how: &str,
) -> Result<(), ApiError> {
    let Some(token) = token else {
        let code = match what {
            "admin" => "admin_disabled",
            "functions" => "functions_disabled",
            _ => "runner_disabled",
        };
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            code,
            format!("the {what} API is disabled: start ebb with {how}"),
        ));
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let same = given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        ))
    }
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
}

impl ApiError {
    /// An error with a status and code.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// A 404 with code `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            code: "not_found",
            message: message.into(),
        }
    }
}

impl From<crate::log::Error> for ApiError {
    fn from(e: crate::log::Error) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "log_unavailable",
            message: e.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({ "error": self.message, "code": self.code })),
        )
            .into_response()
    }
}

/// The router of ebb's own endpoints.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(admin::router())
        .merge(runner::router())
        .merge(funcs::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Ready for traffic: the readiness probe of ebb's pods.
async fn readyz(Extract(app): Extract<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    match &app.ready {
        Some(ready) if !ready() => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "ebb has not yet listed the cluster's Services and EndpointSlices",
        )),
        _ => Ok(Json(json!({ "status": "ready" }))),
    }
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
