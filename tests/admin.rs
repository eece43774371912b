//! The admin API over real HTTP: token checks, creating a route that then serves traffic through
//! the proxy, conflicts, deletion, bad input, and routes surviving a restart.

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

const TOKEN: &str = "s3cret-token";

use crate::common;

use common::Ebb;

fn start(data: &Path, token: Option<&str>) -> Ebb {
    common::serve(data, None, token)
}

async fn call(
    method: &str,
    url: String,
    host: Option<&str>,
    token: Option<&str>,
    body: &str,
) -> (u16, Value) {
    let c: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = hyper::Request::builder().method(method).uri(url);
    if let Some(h) = host {
        req = req.header("host", h);
    }
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = c
        .request(req.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, value)
}

fn app_body(domain: &str) -> String {
    json!({
        "domains": [domain],
        "command": ["ebb", "example-app"],
        "idle_after_ms": 60000,
        "startup_timeout_ms": 20000,
        "stop_grace_ms": 2000
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_made_through_the_admin_api_serve_traffic_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ebb = start(&data, Some(TOKEN));
    let routes = |name: &str| format!("http://{}/admin/routes/{name}", ebb.admin);

    // Tokens.
    let (s, v) = call(
        "GET",
        format!("http://{}/admin/routes", ebb.admin),
        None,
        None,
        "",
    )
    .await;
    assert_eq!((s, v["code"].as_str()), (401, Some("unauthorized")));
    let (s, _) = call("GET", routes("x"), None, Some("wrong-token!"), "").await;
    assert_eq!(s, 401);

    // Create, then use through the proxy.
    let (s, v) = call(
        "PUT",
        routes("api"),
        None,
        Some(TOKEN),
        &app_body("API.localhost"),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["route"]["domains"][0], "api.localhost");
    let (s, v) = call(
        "GET",
        format!("http://{}/hello", ebb.proxy),
        Some("api.localhost"),
        None,
        "",
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, _) = call(
        "PUT",
        routes("api"),
        None,
        Some(TOKEN),
        &app_body("api.localhost"),
    )
    .await;
    assert_eq!(s, 200, "replacing answers 200");

    // Conflicts and bad input.
    let (s, v) = call(
        "PUT",
        routes("other"),
        None,
        Some(TOKEN),
        &app_body("api.localhost"),
    )
    .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (409, Some("domain_conflict")),
        "{v}"
    );
    for (body, needle) in [
        ("{not json", "not JSON"),
        ("[]", "JSON object"),
        (r#"{"domains": ["a.test"]}"#, "missing field `command`"),
        (
            r#"{"domains": ["a.test"], "command": ["x"], "colour": 1}"#,
            "unknown field",
        ),
        (
            r#"{"domains": ["a b"], "command": ["x"]}"#,
            "not a host name",
        ),
        (
            r#"{"name": "else", "domains": ["a.test"], "command": ["x"]}"#,
            "another route",
        ),
    ] {
        let (s, v) = call("PUT", routes("bad"), None, Some(TOKEN), body).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["code"], "bad_request");
        assert!(
            v["error"].as_str().unwrap().contains(needle),
            "{needle}: {v}"
        );
    }
    let (s, v) = call("GET", routes("nope"), None, Some(TOKEN), "").await;
    assert_eq!((s, v["code"].as_str()), (404, Some("not_found")));

    let (s, v) = call(
        "GET",
        format!("http://{}/admin/routes", ebb.admin),
        None,
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v.as_array().unwrap().len(), 1);

    // A restart rebuilds the route and its workload from the log.
    drop(ebb);
    let ebb = start(&data, Some(TOKEN));
    let (s, v) = call(
        "GET",
        format!("http://{}/again", ebb.proxy),
        Some("api.localhost"),
        None,
        "",
    )
    .await;
    assert_eq!(s, 200, "{v}");

    // Delete: the host is unknown again.
    let url = format!("http://{}/admin/routes/api", ebb.admin);
    let (s, _) = call("DELETE", url.clone(), None, Some(TOKEN), "").await;
    assert_eq!(s, 204);
    let (s, _) = call("DELETE", url, None, Some(TOKEN), "").await;
    assert_eq!(s, 404);
    let (s, v) = call(
        "GET",
        format!("http://{}/", ebb.proxy),
        Some("api.localhost"),
        None,
        "",
    )
    .await;
    assert_eq!((s, v["code"].as_str()), (404, Some("unknown_host")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_admin_api_is_disabled() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(&dir.path().join("data"), None);
    let (s, v) = call(
        "GET",
        format!("http://{}/admin/routes", ebb.admin),
        None,
        Some("x"),
        "",
    )
    .await;
    assert_eq!((s, v["code"].as_str()), (403, Some("admin_disabled")));
}
