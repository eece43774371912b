//! The runner API (`/runner/*`) and the calls API (`/v1/calls`), over the call service.
//!
//! Every `/runner/*` request needs the runner token (`ebb serve --runner-token` /
//! `EBB_RUNNER_TOKEN`; without one the API is disabled); `/v1/calls` takes the runner or the admin
//! token. Runner requests may carry `X-Runner-Load: in_flight/capacity`; answers carry the load
//! ebb has recorded for that runner. Single calls and batches share each endpoint: a body with
//! `calls` / `ids` is a batch and gets `results`. Bodies are JSON, or MessagePack when the
//! request's `Content-Type` is `application/msgpack`; answers are MessagePack when its `Accept`
//! names it (ebb's runners and replicas ask for both), errors always JSON.

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State as Extract};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::access::Api;
use super::{ApiError, AppState};
use crate::calls::wire::{
    DequeueBody, EnqueueBody, FinishBody, FinishJson, Format, JobJsonRef, MessageJsonRef,
    StartBody, StatesBody,
};
use crate::calls::{CallError, Calls, Load, NewCall};
use crate::state::calls::{Call, CallStatus};

pub(super) fn router(app: &AppState) -> Router<AppState> {
    use super::access::guarded;
    let runner = Router::new()
        .route("/runner/enqueue", post(enqueue))
        .route("/runner/dequeue", post(dequeue))
        .route("/runner/start", post(start))
        .route("/runner/finish", post(finish))
        .route("/runner/states", post(states))
        .route("/runner/load", post(load));
    // The calls' own endpoints take the runner's or the admin's access.
    let calls = Router::new()
        .route("/v1/calls", get(list))
        .route("/v1/calls/{id}", get(show))
        .route("/v1/calls/{id}/log", get(show_log))
        .route("/v1/calls/{id}/cancel", post(cancel));
    guarded(runner, app, &[Api::Runner]).merge(guarded(calls, app, &[Api::Runner, Api::Admin]))
}

impl From<CallError> for ApiError {
    fn from(e: CallError) -> Self {
        use crate::queue::QueueError;
        match e {
            CallError::Bad(m) => ApiError::new(StatusCode::BAD_REQUEST, "bad_request", m),
            CallError::TooLarge(m) => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", m)
            }
            e @ CallError::UnknownTarget(_) => {
                ApiError::new(StatusCode::NOT_FOUND, "unknown_target", e.to_string())
            }
            CallError::TargetFull(m) => ApiError {
                retry_after_s: Some(1),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "target_queue_full", m)
            },
            CallError::Queue(q @ QueueError::Full(_)) => {
                crate::limits::Limit::Queued.hit();
                ApiError {
                    retry_after_s: Some(1),
                    ..ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "queue_full",
                        format!("{q} (--max-queued)"),
                    )
                }
            }
            // The broker cannot be reached (or failed): nothing was recorded; try again.
            CallError::Queue(q) => ApiError {
                retry_after_s: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "queue_unavailable",
                    q.to_string(),
                )
            },
            CallError::Log(l) => l.into(),
            CallError::Peer(p) => p.into(),
        }
    }
}

/// The call service, if this ebb runs one.
fn calls_of(app: &AppState) -> Result<&std::sync::Arc<Calls>, ApiError> {
    app.calls.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "calls_disabled",
            "this ebb runs no call queue",
        )
    })
}

/// A body that could not be read, as a JSON error (413 when too large).
pub(super) fn rejection(e: BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        crate::limits::Limit::ApiBodyBytes.hit();
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            e.body_text(),
        )
    } else {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text())
    }
}

/// A runner API request's formats: its body's (`Content-Type`) and its answer's (`Accept`).
fn formats(headers: &HeaderMap) -> (Format, Format) {
    let of = |h| headers.get(h).map(HeaderValue::as_bytes);
    (
        Format::of_content_type(of(axum::http::header::CONTENT_TYPE)),
        Format::of_accept(of(axum::http::header::ACCEPT)),
    )
}

/// Reads a body in `format`, turning every failure into a JSON error.
fn body<T: serde::de::DeserializeOwned>(
    format: Format,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = bytes.map_err(rejection)?;
    format.decode(&bytes).map_err(|e| bad_body(format, e))
}

/// A body that is not what was asked for: 400 `bad_json` (or `bad_msgpack`), saying why.
fn bad_body(format: Format, e: String) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, format.bad_code(), e)
}

/// An answer written in `format`.
fn reply<T: Serialize + ?Sized>(format: Format, value: &T) -> Response {
    match format {
        Format::Json => Json(value).into_response(),
        Format::Msgpack => match format.encode(value) {
            Ok(bytes) => (
                [(
                    axum::http::header::CONTENT_TYPE,
                    HeaderValue::from_static(crate::calls::wire::MSGPACK),
                )],
                bytes,
            )
                .into_response(),
            Err(e) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "encode_failed", e).into_response()
            }
        },
    }
}

/// A runner id: 1 to 128 of `A-Za-z0-9._-`.
fn runner_id(id: &str) -> Result<&str, ApiError> {
    crate::calls::wire::check_runner(id)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_runner", e))
}

/// Notes the runner's load and answers with the load recorded for it.
/// A request forwarded by another replica is that replica's runner's: not noted here.
fn with_load(calls: &Calls, runner: &str, headers: &HeaderMap, resp: Response) -> Response {
    if headers.contains_key(crate::peers::FORWARDED_BY) {
        return resp;
    }
    let load = headers
        .get("x-runner-load")
        .and_then(|v| v.to_str().ok())
        .and_then(Load::parse);
    calls.seen(runner, load);
    let mut resp = resp;
    if let Some(l) = calls.load_of(runner)
        && let Ok(v) = HeaderValue::from_str(&l.to_string())
    {
        resp.headers_mut().insert("x-runner-load", v);
    }
    resp
}

async fn enqueue(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let calls = calls_of(&app)?;
    let (fin, fout) = formats(&headers);
    let bytes = bytes.map_err(rejection)?;
    let parsed = EnqueueBody::read(&bytes, fin).map_err(|e| bad_body(fin, e))?;
    // A call given alone with an id another replica owns is enqueued there (an enqueue retried
    // with the id its first answer gave is the same call, whichever replica it reaches).
    if let EnqueueBody::One(NewCall { id: Some(id), .. }) = &parsed
        && let Some(r) = super::through_owner(
            &app,
            id,
            axum::http::Method::POST,
            &"/runner/enqueue".parse().expect("a path"),
            &headers,
            bytes.clone(),
        )
        .await?
    {
        return Ok(r);
    }
    let (batch, mut items) = match parsed {
        EnqueueBody::Batch { calls } => (true, calls),
        EnqueueBody::One(c) => (false, vec![c]),
    };
    // Traced: the calls keep the enqueue's trace context.
    if let Some(tp) = ebb_proxy::trace::carried(&headers) {
        for c in &mut items {
            c.trace = Some(tp.clone());
        }
    }
    let ids = calls.enqueue(items).await?;
    let state = CallStatus::Queued;
    Ok(if batch {
        reply(fout, &IdsAnswer { ids: &ids, state })
    } else {
        reply(fout, &IdAnswer { id: &ids[0], state })
    })
}

// The answers of the hot paths, serialized straight from borrowed values.

#[derive(Serialize)]
struct IdsAnswer<'a> {
    ids: &'a [String],
    state: CallStatus,
}

#[derive(Serialize)]
struct IdAnswer<'a> {
    id: &'a str,
    state: CallStatus,
}

#[derive(Serialize)]
struct JobsAnswer<'a> {
    calls: &'a [JobJsonRef<'a>],
}

#[derive(Serialize)]
struct ResultsAnswer<'a, T> {
    results: &'a [T],
}

async fn dequeue(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let calls = calls_of(&app)?;
    let (fin, fout) = formats(&headers);
    let b: DequeueBody = body(fin, bytes)?;
    let runner = runner_id(&b.runner)?;
    calls.seen(runner, None);
    let jobs = calls
        .dequeue(runner, b.max.unwrap_or(1), b.wait_ms.unwrap_or(0))
        .await?;
    let resp = if jobs.is_empty() {
        StatusCode::NO_CONTENT.into_response()
    } else {
        let jobs: Vec<JobJsonRef> = jobs.iter().map(JobJsonRef::of).collect();
        reply(fout, &JobsAnswer { calls: &jobs })
    };
    Ok(with_load(calls, runner, &headers, resp))
}

async fn start(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let calls = calls_of(&app)?;
    let (fin, fout) = formats(&headers);
    let b: StartBody = body(fin, bytes)?;
    let runner = runner_id(&b.runner)?;
    let (batch, ids) = match (b.id, b.ids) {
        (Some(id), None) => (false, vec![id]),
        (None, Some(ids)) => (true, ids),
        _ => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "give id or ids",
            ));
        }
    };
    let copies = match b.copies {
        None => Vec::new(),
        Some(copies) => crate::calls::decode_copies(copies)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", &e))?,
    };
    let results = calls.start_with_copies(runner, ids, copies).await?;
    let resp = if batch {
        reply(fout, &ResultsAnswer { results: &results })
    } else {
        let r = &results[0];
        if r.started {
            reply(fout, r)
        } else if r.code.as_deref() == Some(crate::calls::OWNER_UNAVAILABLE) {
            let owner = crate::peers::owner_of(&r.id).unwrap_or_default().to_owned();
            return Err(crate::peers::PeerError::Unavailable(
                owner,
                "the start was not decided; ask again later".into(),
            )
            .into());
        } else {
            let code = r.code.clone().unwrap_or_default();
            let message = match code.as_str() {
                "already_running" => {
                    "the call was already running: it must not run twice and is now error"
                }
                "already_final" => "the call has already ended",
                crate::calls::STALE_COPY => {
                    "the call was handed out as another copy than the one recorded; it comes back to be handed out again"
                }
                _ => "no such call was queued",
            };
            (
                StatusCode::CONFLICT,
                Json(json!({ "error": message, "code": code, "id": r.id, "state": r.state })),
            )
                .into_response()
        }
    };
    Ok(with_load(calls, runner, &headers, resp))
}

async fn finish(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let calls = calls_of(&app)?;
    let (fin, fout) = formats(&headers);
    let bytes = bytes.map_err(rejection)?;
    let (batch, runner, items) =
        match FinishBody::read(&bytes, fin).map_err(|e| bad_body(fin, e))? {
            FinishBody::Batch { runner, calls } => (true, runner, calls),
            FinishBody::One { runner, call } => (false, runner, vec![call]),
        };
    let runner = runner_id(&runner)?.to_owned();
    let finishes = items
        .into_iter()
        .map(FinishJson::finish)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e))?;
    let states = calls.finish(&runner, finishes).await?;
    let results: Vec<IdAnswer> = states
        .iter()
        .map(|(id, state)| IdAnswer { id, state: *state })
        .collect();
    let resp = if batch {
        reply(fout, &ResultsAnswer { results: &results })
    } else {
        reply(fout, &results[0])
    };
    Ok(with_load(calls, &runner, &headers, resp))
}

/// What became of calls this replica owns, for another replica about to hand out their
/// messages: `{"results": [{"state", "deadline_at_ms"} or null, ...]}` in the order asked.
async fn states(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let calls = calls_of(&app)?;
    let (fin, fout) = formats(&headers);
    let b: StatesBody = body(fin, bytes)?;
    if b.ids.len() > calls.options().max_batch {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "{} ids in one batch; the bound is {}",
                b.ids.len(),
                calls.options().max_batch
            ),
        ));
    }
    let results = calls.states(&b.ids).await;
    Ok(reply(fout, &ResultsAnswer { results: &results }))
}

/// Another ebb replica's shares of the load, for the replica that decides (`crate::load`).
/// Fields it does not know are passed over, not refused: during a rolling update replicas of
/// neighbouring versions report to each other.
#[derive(Deserialize)]
struct LoadBody {
    replica: String,
    shares: std::collections::BTreeMap<String, crate::proxy::load::Share>,
    /// The replicas with requests under way through the reporter (a scale-down keeps them).
    #[serde(default)]
    busy: std::collections::BTreeMap<std::net::SocketAddr, u32>,
}

async fn load(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Some(scaler) = &app.load else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "no_load_scaling",
            "this ebb takes no load reports",
        ));
    };
    let (fin, fout) = formats(&headers);
    let b: LoadBody = body(fin, bytes)?;
    if !crate::peers::valid_replica(&b.replica) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_replica",
            format!("{:?} is not a replica name", b.replica),
        ));
    }
    let shares = b.shares.len();
    scaler
        .report(&b.replica, b.shares, b.busy, app.clock.now_ms())
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_report", e))?;
    Ok(reply(fout, &json!({ "shares": shares })))
}

fn view(c: &Call) -> Value {
    json!({
        "id": c.spec.id,
        "target": c.spec.target,
        "kind": c.spec.kind,
        "state": c.status,
        "timeout_ms": c.spec.timeout_ms,
        "partition": c.spec.partition,
        "created_at_ms": c.created_at_ms,
        "started_at_ms": c.started_at_ms,
        "finished_at_ms": c.finished_at_ms,
        "deadline_at_ms": c.deadline_at_ms,
        "runner": c.runner,
        "attempt": c.starts + c.refused_starts,
        "payload": MessageJsonRef::of_payload(&c.spec.payload),
        "result": c.result.as_ref().map(MessageJsonRef::of_result),
    })
}

async fn show(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    uri: Uri,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    calls_of(&app)?;
    if let Some(r) =
        super::through_owner(&app, &id, Method::GET, &uri, &headers, Bytes::new()).await?
    {
        return Ok(r);
    }
    app.log
        .read(|s| s.calls.get(&id).map(view))
        .map(|v| Json(v).into_response())
        .ok_or_else(|| ApiError::not_found(format!("no call {id}")))
}

async fn show_log(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    uri: Uri,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    calls_of(&app)?;
    if let Some(r) =
        super::through_owner(&app, &id, Method::GET, &uri, &headers, Bytes::new()).await?
    {
        return Ok(r);
    }
    let log = app
        .log
        .read(|s| s.calls.get(&id).map(|c| c.log.clone()))
        .ok_or_else(|| ApiError::not_found(format!("no call {id}")))?;
    Ok(([("content-type", "text/plain; charset=utf-8")], log).into_response())
}

async fn cancel(
    Extract(app): Extract<AppState>,
    headers: HeaderMap,
    uri: Uri,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let calls = calls_of(&app)?;
    if let Some(r) =
        super::through_owner(&app, &id, Method::POST, &uri, &headers, Bytes::new()).await?
    {
        return Ok(r);
    }
    match calls.cancel(&id).await? {
        Ok(()) => Ok(Json(json!({ "id": id, "state": CallStatus::Cancelled })).into_response()),
        Err(Some(state)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "already_final",
            format!("call {id} has already ended ({state:?})"),
        )),
        Err(None) => Err(ApiError::not_found(format!("no call {id}"))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    #[serde(default)]
    state: Option<CallStatus>,
    #[serde(default)]
    target: Option<String>,
    /// Ids after this one (the `next` of the previous page).
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
}

/// Most calls on one page.
const MAX_PAGE: usize = 1_000;

async fn list(
    Extract(app): Extract<AppState>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    calls_of(&app)?;
    let Query(q) =
        query.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_query", e.body_text()))?;
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    Ok(Json(app.log.read(|s| {
        let found = s.calls.page(q.after.as_deref(), limit, |c| {
            q.state.is_none_or(|st| st == c.status)
                && q.target.as_ref().is_none_or(|t| *t == c.spec.target)
        });
        let next = match found.last() {
            Some((id, _)) if found.len() == limit => Some(id.to_string()),
            _ => None,
        };
        let page: Vec<Value> = found.into_iter().map(|(_, c)| view(c)).collect();
        json!({ "calls": page, "next": next })
    })))
}
