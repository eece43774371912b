//! `/admin/routes`: create, replace, list and delete routes at run time. Changes are decisions on
//! the log's writer, so a domain can never end up claimed by two routes, and they are events, so
//! they survive restarts and show in `ebb explain route NAME`.

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State as Extract};
use axum::http::StatusCode;
use axum::routing::get;
use serde_json::{Value, json};

use super::{ApiError, AppState};
use crate::config::AppConfig;
use crate::event::{Event, RouteSpec};
use crate::orchestrator::WorkloadSpec;
use crate::state::State;

pub(super) fn router(app: &AppState) -> Router<AppState> {
    let routes = Router::new()
        .route("/admin/routes", get(list))
        .route("/admin/routes/{name}", get(show).put(put).delete(delete));
    super::access::guarded(routes, app, &[super::access::Api::Admin])
}

fn view(state: &State, spec: &RouteSpec) -> Value {
    let route = state.routes.by_name.get(&spec.name);
    let d = state.routes.deployments.get(&spec.deployment);
    json!({
        "route": spec,
        "last_used_ms": route.map_or(0, |r| r.last_used_ms),
        "requests_total": route.map_or(0, |r| r.requests_total),
        "replicas": d.map_or(0, |d| d.replicas),
        "desired": d.map_or(0, |d| d.desired),
        "warm_open": route.map_or(Vec::new(), |r| {
            r.warm
                .iter()
                .map(|(i, w)| json!({
                    "window": i,
                    "min": w.min,
                    "scheduled_at_ms": w.scheduled_at_ms,
                    "until_ms": w.until_ms,
                }))
                .collect()
        }),
    })
}

async fn list(Extract(app): Extract<AppState>) -> Result<Json<Value>, ApiError> {
    Ok(Json(app.log.read(|s| {
        Value::Array(
            s.routes
                .by_name
                .values()
                .map(|r| view(s, &r.spec))
                .collect(),
        )
    })))
}

async fn show(
    Extract(app): Extract<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    app.log
        .read(|s| s.routes.by_name.get(&name).map(|r| view(s, &r.spec)))
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no route named {name:?}")))
}

async fn put(
    Extract(app): Extract<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", m);
    let mut value: Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    let Some(obj) = value.as_object_mut() else {
        return Err(bad("the body must be a JSON object".into()));
    };
    match obj.get("name") {
        Some(n) if n.as_str() != Some(name.as_str()) => {
            return Err(bad(format!("the body names another route than {name:?}")));
        }
        _ => {
            obj.insert("name".into(), Value::String(name.clone()));
        }
    }
    let mut cfg: AppConfig =
        serde_json::from_value(value).map_err(|e| bad(format!("invalid route: {e}")))?;
    cfg.validate().map_err(bad)?;
    let spec = cfg.route();
    let orchestrator = app.orchestrator.clone().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_orchestrator",
            "this ebb runs no workloads",
        )
    })?;
    let workload = WorkloadSpec::from_process(
        &spec.deployment,
        spec.process
            .as_ref()
            .expect("routes from the API run processes"),
        &app.ebb_exe,
    );
    orchestrator
        .register(workload)
        .map_err(|e| bad(e.to_string()))?;
    let decided = spec.clone();
    let (outcome, _) =
        app.log
            .decide(move |s: &State, _| {
                if let Some(l) = &decided.listen
                    && let Some(owner) =
                        s.routes.by_name.values().find(|r| {
                            r.spec.name != decided.name && r.spec.listen.as_ref() == Some(l)
                        })
                {
                    let why = format!("listen {l:?} belongs to route {:?}", owner.spec.name);
                    return (vec![], Err(why));
                }
                for d in &decided.domains {
                    if let Some(owner) = s.routes.by_domain.get(d)
                        && owner != &decided.name
                    {
                        let why = format!("domain {d:?} belongs to route {owner:?}");
                        return (vec![], Err(why));
                    }
                }
                let created = !s.routes.by_name.contains_key(&decided.name);
                (
                    vec![Event::RouteUpserted {
                        route: Box::new(decided),
                    }],
                    Ok(created),
                )
            })
            .await?;
    match outcome {
        Ok(created) => {
            let status = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok((status, Json(app.log.read(|s| view(s, &spec)))))
        }
        Err(why) => Err(ApiError::new(StatusCode::CONFLICT, "domain_conflict", why)),
    }
}

async fn delete(
    Extract(app): Extract<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    let n = name.clone();
    let (outcome, _) = app
        .log
        .decide(move |s: &State, _| match s.routes.by_name.get(&n) {
            None => (vec![], None),
            Some(r) => {
                let deployment = r.spec.deployment.clone();
                let shared = s.routes.routes_of(&deployment).count() > 1;
                (
                    vec![Event::RouteRemoved { name: n.clone() }],
                    Some((!shared).then_some(deployment)),
                )
            }
        })
        .await?;
    match outcome {
        Some(stop) => {
            // The last route of a deployment takes its replicas with it.
            if let (Some(deployment), Some(o)) = (stop, &app.orchestrator) {
                let _ = o.scale(&deployment, 0);
            }
            Ok(StatusCode::NO_CONTENT)
        }
        None => Err(ApiError::not_found(format!("no route named {name:?}"))),
    }
}
