//! ebb's HTTP surface (axum). For now: `/healthz`, and the one place where errors become HTTP
//! answers with a JSON body `{"error": "...", "code": "..."}`. Handlers read the live projection
//! and ask the log for decisions; they never touch storage directly.

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
        .fallback(not_found)
        .with_state(state)
}

async fn healthz(Extract(app): Extract<AppState>) -> Json<serde_json::Value> {
    let seq = app.log.read(|s| s.seq);
    Json(json!({ "status": "ok", "seq": seq }))
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no endpoint at {}", uri.path()))
}
