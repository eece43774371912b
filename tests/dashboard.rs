//! The dashboard in a real browser, and the stories behind it over HTTP: a real `ebb serve`, Debian's
//! headless Chromium driven by playwright-core (`tests/browser/dashboard.mjs`, which also runs
//! axe-core), and the admin API's `/admin/explain`.
//!
//! The browser test signs in, wakes a workload through the proxy and sees it turn ready and its
//! scale event reach the timeline without a reload, filters calls by state and opens a failed
//! call's story, and finds no serious accessibility violation and no console error. Its
//! screenshots are kept in `$EBB_ARTIFACTS` (default: `dashboard/` under Cargo's target tmp dir).

use std::time::Duration;

use serde_json::{Value, json};

use crate::common;

use common::http::{Http, client, send, send_json};

const ADMIN: &str = "admin-secret";
const RUNNER: &str = "runner-secret";
const DEADLINE: Duration = Duration::from_secs(60);

fn start(dir: &std::path::Path) -> common::Ebb {
    let config = dir.join("ebb.toml");
    std::fs::write(
        &config,
        r#"
[[app]]
name = "demo"
domains = ["demo.localhost"]
command = ["ebb", "example-app"]
startup_timeout_ms = 20000
"#,
    )
    .unwrap();
    common::serve_with(
        &dir.join("data"),
        Some(&config),
        Some(ADMIN),
        &["--runner-token", RUNNER, "--runner-capacity", "0"],
    )
}

async fn runner(c: &Http, ebb: &common::Ebb, path: &str, body: Value) -> Value {
    let auth = format!("Bearer {RUNNER}");
    let a = send_json(
        c,
        ebb.admin,
        "POST",
        path,
        &[("authorization", &auth)],
        &body,
    )
    .await;
    assert!(a.status < 300, "{path}: {} {}", a.status, a.body);
    serde_json::from_str(&a.body).unwrap_or(Value::Null)
}

/// Three calls to the app: one succeeded, one failed (with a log), one still queued. Returns the
/// failed one's id.
async fn calls(c: &Http, ebb: &common::Ebb) -> String {
    let mut ids = Vec::new();
    for i in 0..3 {
        let body = json!({ "target": "demo", "payload": { "path": format!("/n{i}") } });
        let a = runner(c, ebb, "/runner/enqueue", body).await;
        ids.push(a["id"].as_str().unwrap().to_owned());
    }
    for (id, outcome) in [(&ids[0], "success"), (&ids[1], "error")] {
        runner(c, ebb, "/runner/start", json!({ "runner": "r1", "id": id })).await;
        let finish = json!({ "runner": "r1", "id": id, "outcome": outcome,
                             "log": format!("exit status of {outcome}") });
        runner(c, ebb, "/runner/finish", finish).await;
    }
    ids[1].clone()
}

async fn admin_get(c: &Http, ebb: &common::Ebb, path: &str) -> (u16, Value) {
    let auth = format!("Bearer {ADMIN}");
    let a = send(
        c,
        ebb.admin,
        "GET",
        "localhost",
        path,
        &[("authorization", &auth)],
    )
    .await;
    (
        a.status,
        serde_json::from_str(&a.body).unwrap_or(Value::Null),
    )
}

fn texts(story: &Value) -> Vec<String> {
    story["story"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            format!(
                "{} {}",
                l["event"].as_str().unwrap(),
                l["text"].as_str().unwrap()
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_wake_live_and_a_failed_calls_story_in_a_real_browser() {
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path());
    let failed = calls(&c, &ebb).await;

    common::browser_test(
        "dashboard",
        vec![
            ("EBB_UI", format!("http://{}/ui", ebb.admin)),
            ("EBB_ADMIN_TOKEN", ADMIN.to_owned()),
            ("EBB_PROXY", format!("http://{}", ebb.proxy)),
            ("EBB_WAKE_HOST", "demo.localhost".to_owned()),
            ("EBB_WAKE_ROUTE", "demo".to_owned()),
            ("EBB_FAILED_CALL", failed.clone()),
        ],
    )
    .await;

    // The same stories over the admin API: the wake says why, the failed call who ran it and its log.
    let (status, route) = admin_get(&c, &ebb, "/admin/explain/route/demo").await;
    assert_eq!(status, 200, "{route}");
    let lines = texts(&route);
    assert!(
        lines.iter().any(|l| l
            == "ScaleRequested scale demo from 0 to 1: a request came while no replica was ready"),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("ScaledUp demo has 1 replica ready, ")),
        "{lines:#?}"
    );
    let (status, call) = admin_get(&c, &ebb, &format!("/admin/explain/call/{failed}")).await;
    assert_eq!(status, 200, "{call}");
    let lines = texts(&call);
    assert_eq!(lines.len(), 3, "{lines:#?}");
    assert!(lines[0].starts_with(&format!("CallQueued call {failed} queued for demo (async")));
    assert!(lines[1].starts_with("CallStarted runner r1 started it after "));
    assert!(
        lines[2].starts_with("CallFinished runner r1 finished it: it failed after ")
            && lines[2].ends_with("; log: exit status of error"),
        "{}",
        lines[2]
    );
    assert_eq!(call["current"]["status"], "error");

    // Bad input: a kind ebb cannot explain, an id the log never saw, no token.
    let (status, bad) = admin_get(&c, &ebb, "/admin/explain/planet/earth").await;
    assert_eq!((status, bad["code"].as_str()), (400, Some("bad_kind")));
    let (status, none) = admin_get(&c, &ebb, "/admin/explain/call/nope").await;
    assert_eq!((status, none["code"].as_str()), (404, Some("not_found")));
    let anon = send(&c, ebb.admin, "GET", "localhost", "/ui/api/overview", &[]).await;
    assert_eq!(anon.status, 401, "{}", anon.body);
    let wrong = send_json(
        &c,
        ebb.admin,
        "POST",
        "/ui/login",
        &[],
        &json!({ "token": "guess" }),
    )
    .await;
    assert_eq!(wrong.status, 401, "{}", wrong.body);
}

/// Signs in to the dashboard with the admin token; returns the session cookie's value.
async fn sign_in(c: &Http, ebb: &common::Ebb) -> String {
    let r = send_json(
        c,
        ebb.admin,
        "POST",
        "/ui/login",
        &[],
        &json!({ "token": ADMIN }),
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.body);
    let set = r.header("set-cookie");
    set.strip_prefix("ebb_session=")
        .and_then(|v| v.split(';').next())
        .unwrap_or_else(|| panic!("no session cookie: {set:?}"))
        .to_owned()
}

/// Signing in exchanges the token for a random session id (the cookie never carries the
/// token), and signing out ends the session on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signing_in_gives_a_session_not_the_token_and_signing_out_ends_it() {
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path());
    let login = send_json(
        &c,
        ebb.admin,
        "POST",
        "/ui/login",
        &[],
        &json!({ "token": ADMIN }),
    )
    .await;
    let set = login.header("set-cookie").to_owned();
    assert!(!set.contains(ADMIN), "the cookie carries the token: {set}");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/ui", "Max-Age="] {
        assert!(set.contains(attribute), "{attribute}: {set}");
    }
    assert!(!set.contains("Secure"), "plain HTTP: {set}");
    let id = sign_in(&c, &ebb).await;
    assert_eq!(id.len(), 64, "{id}");
    let other = sign_in(&c, &ebb).await;
    assert_ne!(id, other, "each sign-in is a session of its own");
    let c = &c;
    let with = |cookie: String| async move {
        let cookie = format!("ebb_session={cookie}");
        send(
            c,
            ebb.admin,
            "GET",
            "localhost",
            "/ui/api/overview",
            &[("cookie", cookie.as_str())],
        )
        .await
        .status
    };
    assert_eq!(with(id.clone()).await, 200);
    // The token itself is no session.
    assert_eq!(with(ADMIN.to_owned()).await, 401);
    assert_eq!(with("0".repeat(64)).await, 401);
    let cookie = format!("ebb_session={id}");
    let out = send(
        c,
        ebb.admin,
        "POST",
        "localhost",
        "/ui/logout",
        &[("cookie", cookie.as_str())],
    )
    .await;
    assert_eq!(out.status, 204, "{}", out.body);
    assert!(
        out.header("set-cookie").contains("Max-Age=0"),
        "{:?}",
        out.headers
    );
    assert_eq!(with(id).await, 401, "the session ended");
    assert_eq!(with(other).await, 200, "the other session goes on");
}

/// The event stream tells each decision in words as it is logged, and only to the signed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_tells_the_logs_tail() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path());

    let session = sign_in(&c, &ebb).await;
    let mut tcp = tokio::net::TcpStream::connect(ebb.admin).await.unwrap();
    tcp.write_all(
        format!(
            "GET /ui/api/events HTTP/1.1\r\nHost: localhost\r\nCookie: ebb_session={session}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut lines = BufReader::new(tcp).lines();
    let head = lines.next_line().await.unwrap().unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let woken = {
        let c = c.clone();
        let proxy = ebb.proxy;
        tokio::spawn(async move { send(&c, proxy, "GET", "demo.localhost", "/pid", &[]).await })
    };
    let told: Value = tokio::time::timeout(DEADLINE, async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("the stream goes on");
            if let Some(data) = line.strip_prefix("data: ") {
                let v: Value = serde_json::from_str(data).unwrap();
                if v["name"] == "ScaledUp" {
                    return v;
                }
            }
        }
    })
    .await
    .expect("ScaledUp told on the stream within the deadline");
    assert_eq!(told["kind"], "deployment");
    assert_eq!(told["routes"], json!(["demo"]));
    assert_eq!(told["replicas"], 1);
    assert!(
        told["text"]
            .as_str()
            .unwrap()
            .starts_with("demo has 1 replica ready, "),
        "{told}"
    );
    assert_eq!(woken.await.unwrap().status, 200);
}
