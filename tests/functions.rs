//! The functions API over real HTTP against `ebb serve`: templates (create, read, replace,
//! delete, every validation rule, tokens, limits, a restart) and their watch, resumed from a
//! revision with exactly the changes missed.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::common;

use common::Ebb;

const TOKEN: &str = "fn-token";

fn start(data: &Path, token: Option<&str>) -> Ebb {
    start_with(data, token, &[])
}

const RUNNER_TOKEN: &str = "runner-token";

fn start_with(data: &Path, token: Option<&str>, extra: &[&str]) -> Ebb {
    let mut args = vec!["--runner-token", RUNNER_TOKEN];
    if let Some(t) = token {
        args.extend(["--api-token", t]);
    }
    args.extend_from_slice(extra);
    common::serve_with(data, None, None, &args)
}

/// Checks `check` every `every` until it gives a value, for at most `within`.
async fn poll<T, F, Fut>(what: &str, every: Duration, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let mut tick = tokio::time::interval(every);
    let run = async {
        loop {
            tick.tick().await;
            if let Some(v) = check().await {
                return v;
            }
        }
    };
    tokio::time::timeout(within, run)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {within:?}"))
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn request(
    ebb: &Ebb,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: impl Into<Bytes>,
) -> hyper::Request<Full<Bytes>> {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", ebb.admin));
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    req.body(Full::new(body.into())).unwrap()
}

async fn call(
    ebb: &Ebb,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: impl Into<Bytes>,
) -> (u16, Value) {
    let resp = client()
        .request(request(ebb, method, path, token, body))
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, v)
}

async fn api(ebb: &Ebb, method: &str, path: &str, body: Value) -> (u16, Value) {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    call(ebb, method, path, Some(TOKEN), body).await
}

fn template(name: &str) -> Value {
    json!({ "name": name, "function": "handler", "command": ["ebb", "example-app"] })
}

/// Asserts a JSON error with this status and code.
fn refused(got: (u16, Value), status: u16, code: &str) {
    assert_eq!(got.0, status, "{:?}", got.1);
    assert_eq!(got.1["code"], code, "{:?}", got.1);
    assert!(
        got.1["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{:?}",
        got.1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn templates_are_created_read_replaced_and_deleted_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut ebb = start(&data, Some(TOKEN));
    let (status, created) = api(&ebb, "POST", "/api/funcs/template", template("resize")).await;
    assert_eq!(status, 201, "{created:?}");
    // The serverless seed's object: kind, metadata, spec and status.
    assert_eq!(created["apiVersion"], "ebb.dev/v1alpha1");
    assert_eq!(created["kind"], "Func");
    assert_eq!(created["metadata"]["name"], "resize");
    assert_eq!(created["spec"]["name"], "resize");
    assert_eq!(created["spec"]["maxInstanceNum"], 1);
    assert_eq!(created["spec"]["concurrency"], 1);
    assert_eq!(created["status"]["counter"], 0);
    assert_eq!(created["status"]["replicas"], 0);
    let r1 = rev(&created);
    assert!(r1 > 0);
    refused(
        api(&ebb, "POST", "/api/funcs/template", template("resize")).await,
        409,
        "exists",
    );
    let (status, got) = api(&ebb, "GET", "/api/funcs/template/resize", Value::Null).await;
    assert_eq!((status, &got), (200, &created));

    // Replace (the name may be left out of the body), then create by PUT.
    let mut changed = template("resize");
    changed.as_object_mut().unwrap().remove("name");
    changed["right"] = json!("RETURN");
    changed["maxInstanceNum"] = json!(4);
    changed["initInstanceNum"] = json!(2);
    let (status, replaced) = api(&ebb, "PUT", "/api/funcs/template/resize", changed.clone()).await;
    assert_eq!(status, 200, "{replaced:?}");
    assert_eq!(replaced["spec"]["right"], "RETURN");
    assert!(rev(&replaced) > r1);
    // Made once: a replacement keeps its creation time (RFC 3339, UTC).
    let made = created["metadata"]["creationTimestamp"].as_str().unwrap();
    assert!(made.ends_with('Z') && chrono_like(made), "{created:?}");
    assert_eq!(replaced["metadata"]["creationTimestamp"], made);
    // The same spec again changes nothing.
    let (status, same) = api(&ebb, "PUT", "/api/funcs/template/resize", changed).await;
    assert_eq!((status, rev(&same)), (200, rev(&replaced)));
    let (status, _) = api(&ebb, "PUT", "/api/funcs/template/thumb", template("thumb")).await;
    assert_eq!(status, 201);
    let (status, list) = api(&ebb, "GET", "/api/funcs/template", Value::Null).await;
    assert_eq!(status, 200);
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["resize", "thumb"]);
    assert_eq!(list["kind"], "FuncList");
    assert!(list["revision"].as_u64().unwrap() >= rev(&replaced));
    assert_eq!(
        list["metadata"]["resourceVersion"],
        list["revision"].as_u64().unwrap().to_string()
    );

    let (status, gone) = api(&ebb, "DELETE", "/api/funcs/template/thumb", Value::Null).await;
    assert_eq!(
        (status, gone["metadata"]["name"].as_str()),
        (200, Some("thumb"))
    );
    refused(
        api(&ebb, "DELETE", "/api/funcs/template/thumb", Value::Null).await,
        404,
        "not_found",
    );
    refused(
        api(&ebb, "GET", "/api/funcs/template/thumb", Value::Null).await,
        404,
        "not_found",
    );

    // The log has them: a restart serves the same templates.
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    drop(ebb);
    let ebb = start(&data, Some(TOKEN));
    let (status, after) = api(&ebb, "GET", "/api/funcs/template/resize", Value::Null).await;
    assert_eq!(status, 200);
    assert_eq!(
        (&after["metadata"], &after["spec"]),
        (&replaced["metadata"], &replaced["spec"])
    );
    refused(
        api(&ebb, "GET", "/api/funcs/template/thumb", Value::Null).await,
        404,
        "not_found",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_template_rule_and_bad_input_gets_a_clear_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ebb = start(&data, Some(TOKEN));
    let post = "/api/funcs/template";
    let with = |patch: Value| {
        let mut t = template("ok-name");
        for (k, v) in patch.as_object().unwrap() {
            t[k] = v.clone();
        }
        t
    };
    let invalid = [
        with(json!({ "name": "Bad_Name" })),
        with(json!({ "name": "-dash" })),
        with(json!({ "name": "x".repeat(64) })),
        with(json!({ "name": "template" })),
        with(json!({ "name": "RETURN" })),
        with(json!({ "minInstanceNum": 2, "initInstanceNum": 1, "maxInstanceNum": 3 })),
        with(json!({ "initInstanceNum": 5, "maxInstanceNum": 3 })),
        with(json!({ "maxInstanceNum": 0 })),
        with(json!({ "command": [] })),
        with(json!({ "left": "Not A Name" })),
        with(json!({ "serviceAddress": "ftp://files.example" })),
        with(json!({ "serviceAddress": "k8s://no-namespace" })),
        with(json!({ "serviceAddress": "fn.example:99999" })),
        with(json!({ "concurrency": 0 })),
        with(json!({ "timeoutMs": 0 })),
    ];
    for body in invalid {
        refused(
            api(&ebb, "POST", post, body.clone()).await,
            400,
            "invalid_template",
        );
    }
    refused(
        call(&ebb, "POST", post, Some(TOKEN), "{not json").await,
        400,
        "bad_json",
    );
    refused(
        api(&ebb, "POST", post, with(json!({ "colour": "blue" }))).await,
        400,
        "bad_json",
    );
    refused(
        api(&ebb, "PUT", "/api/funcs/template/one", template("another")).await,
        400,
        "invalid_template",
    );
    let huge = json!({ "name": "big", "command": ["x"], "function": "y".repeat(2 << 20) });
    refused(
        api(&ebb, "POST", post, huge).await,
        413,
        "payload_too_large",
    );
    refused(call(&ebb, "GET", post, None, "").await, 401, "unauthorized");
    refused(
        call(&ebb, "GET", post, Some("wrong"), "").await,
        401,
        "unauthorized",
    );
    refused(
        api(&ebb, "GET", "/api/funcs/template?watch=maybe", Value::Null).await,
        400,
        "bad_request",
    );
    refused(
        api(
            &ebb,
            "GET",
            "/api/funcs/template?watch=true&since=x",
            Value::Null,
        )
        .await,
        400,
        "bad_request",
    );
    refused(
        api(
            &ebb,
            "GET",
            "/api/funcs/template?watch=true&since=999999",
            Value::Null,
        )
        .await,
        400,
        "bad_request",
    );
    // Nothing of that reached the log.
    let (_, list) = api(&ebb, "GET", post, Value::Null).await;
    assert_eq!(list["items"], json!([]));
    assert!(
        common::events(&data)
            .iter()
            .all(|e| !e.to_string().contains("Template")),
        "a refused template was logged"
    );

    // Without a token the functions API is off.
    let other = tempfile::tempdir().unwrap();
    let off = start(&other.path().join("data"), None);
    refused(
        call(&off, "GET", post, Some(TOKEN), "").await,
        403,
        "functions_disabled",
    );
}

/// A watch's lines as they arrive.
struct Watch(common::FuncWatch);

impl Watch {
    async fn open(ebb: &Ebb, since: Option<u64>) -> Watch {
        let query = since.map(|s| format!("&since={s}")).unwrap_or_default();
        Watch(common::FuncWatch::open(ebb.admin, TOKEN, &query).await)
    }

    /// The next line, within a deadline.
    async fn next(&mut self) -> Value {
        self.0.next().await
    }

    /// The next line's type, name and revision.
    async fn event(&mut self) -> (String, String, u64) {
        let v = self.next().await;
        (
            v["type"].as_str().unwrap().to_owned(),
            v["object"]["metadata"]["name"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
            v["revision"].as_u64().unwrap(),
        )
    }
}

fn ev(kind: &str, name: &str, rev: u64) -> (String, String, u64) {
    (kind.to_owned(), name.to_owned(), rev)
}

/// A template object's revision (its `metadata.resourceVersion`), or a watch line's object's.
fn rev(v: &Value) -> u64 {
    let meta = if v.get("object").is_some() {
        &v["object"]["metadata"]
    } else {
        &v["metadata"]
    };
    meta["resourceVersion"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no resourceVersion: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumed_from_a_revision_gets_exactly_the_changes_it_missed() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(&dir.path().join("data"), Some(TOKEN));
    let post = "/api/funcs/template";
    let a = api(&ebb, "POST", post, template("a")).await.1;
    let b = api(&ebb, "POST", post, template("b")).await.1;

    let mut w = Watch::open(&ebb, None).await;
    assert_eq!(w.event().await, ev("ADDED", "a", rev(&a)));
    assert_eq!(w.event().await, ev("ADDED", "b", rev(&b)));
    let bookmark = w.next().await;
    assert_eq!(bookmark["type"], "BOOKMARK");
    assert!(rev(&bookmark) >= rev(&b));
    let mut a2 = template("a");
    a2["left"] = json!("b");
    let a2 = api(&ebb, "PUT", "/api/funcs/template/a", a2).await.1;
    let seen = w.event().await;
    assert_eq!(seen, ev("MODIFIED", "a", rev(&a2)));
    drop(w);

    // While nobody watches.
    let b_gone = api(&ebb, "DELETE", "/api/funcs/template/b", Value::Null)
        .await
        .1;
    let c = api(&ebb, "POST", post, template("c")).await.1;
    let mut c2 = template("c");
    c2["maxInstanceNum"] = json!(3);
    let c2 = api(&ebb, "PUT", "/api/funcs/template/c", c2).await.1;

    let mut w = Watch::open(&ebb, Some(seen.2)).await;
    assert_eq!(w.event().await, ev("DELETED", "b", rev(&b_gone)));
    assert_eq!(w.event().await, ev("ADDED", "c", rev(&c)));
    assert_eq!(w.event().await, ev("MODIFIED", "c", rev(&c2)));
    let bookmark = w.next().await;
    assert_eq!(bookmark["type"], "BOOKMARK");
    // Then live, with nothing repeated.
    let d = api(&ebb, "POST", post, template("d")).await.1;
    assert_eq!(w.event().await, ev("ADDED", "d", rev(&d)));

    // Resuming from the very latest revision gets nothing old.
    let mut w2 = Watch::open(&ebb, Some(rev(&d))).await;
    assert_eq!(w2.next().await["type"], "BOOKMARK");
    let e = api(&ebb, "POST", post, template("e")).await.1;
    assert_eq!(w2.event().await, ev("ADDED", "e", rev(&e)));
    assert_eq!(w.event().await, ev("ADDED", "e", rev(&e)));
}

/// A template run by `ebb example-app` as demo function `function`, with its next functions.
fn demo(name: &str, function: &str, left: Option<&str>, right: Option<&str>) -> Value {
    let mut t = json!({ "name": name, "function": function, "command": ["ebb", "example-app"] });
    if let Some(l) = left {
        t["left"] = json!(l);
    }
    if let Some(r) = right {
        t["right"] = json!(r);
    }
    t
}

/// classify -> (short) upper -> exclaim, or (long) reverse -> exclaim.
async fn chain(ebb: &Ebb) {
    for t in [
        demo("classify", "classify", Some("upper"), Some("reverse")),
        demo("upper", "upper", Some("exclaim"), None),
        demo("reverse", "reverse", Some("exclaim"), None),
        demo("exclaim", "exclaim", None, None),
    ] {
        let (status, v) = api(ebb, "POST", "/api/funcs/template", t).await;
        assert_eq!(status, 201, "{v:?}");
    }
}

async fn invoke(ebb: &Ebb, name: &str, args: &str) -> String {
    let (status, v) = call(
        ebb,
        "POST",
        &format!("/api/funcs/{name}"),
        Some(TOKEN),
        args.to_owned(),
    )
    .await;
    assert_eq!(status, 202, "{v:?}");
    v["instanceId"].as_str().unwrap().to_owned()
}

/// Polls an instance until it ended (bounded).
async fn ended(ebb: &Ebb, id: &str) -> Value {
    let path = format!("/api/funcs/{id}");
    poll(
        "the instance ending",
        Duration::from_millis(20),
        Duration::from_secs(60),
        || async {
            let (status, v) = api(ebb, "GET", &path, Value::Null).await;
            assert_eq!(status, 200, "{v:?}");
            (v["state"] != "running").then_some(v)
        },
    )
    .await
}

/// `PUT /api/funcs/{function}/{id}` with `body`.
async fn put_step(ebb: &Ebb, function: &str, id: &str, body: &'static str) -> (u16, Value) {
    let path = format!("/api/funcs/{function}/{id}");
    call(ebb, "PUT", &path, Some(TOKEN), body).await
}

fn functions_of(v: &Value) -> Vec<String> {
    v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["function"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_instances_leave_the_api_after_the_retention_but_stay_in_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start_with(
        &dir.path().join("data"),
        Some(TOKEN),
        &["--call-retention-ms", "300"],
    );
    chain(&ebb).await;
    let id = invoke(&ebb, "classify", "hi").await;
    assert_eq!(ended(&ebb, &id).await["result"], "HI!");
    let path = format!("/api/funcs/{id}");
    poll(
        "the instance being forgotten",
        Duration::from_millis(20),
        Duration::from_secs(60),
        || async { (api(&ebb, "GET", &path, Value::Null).await.0 == 404).then_some(()) },
    )
    .await;
    let events = common::events(&ebb.data);
    let of = |kind: &str| {
        events
            .iter()
            .filter(|e| e["event"].get(kind).is_some())
            .count()
    };
    assert_eq!(
        of("InstanceFinished"),
        1,
        "the instance's events stay in the log"
    );
    assert!(of("InstancesForgotten") >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_of_three_functions_takes_the_branch_its_answer_names() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(&dir.path().join("data"), Some(TOKEN));
    chain(&ebb).await;
    let short = invoke(&ebb, "classify", "hi").await;
    let long = invoke(&ebb, "classify", "hello world").await;
    let s = ended(&ebb, &short).await;
    assert_eq!(s["state"], "success", "{s:?}");
    assert_eq!(s["result"], "HI!");
    assert_eq!(functions_of(&s), ["classify", "upper", "exclaim"]);
    for step in s["steps"].as_array().unwrap() {
        assert_eq!(step["status"], "success", "{s:?}");
        assert!(step["finishedAtMs"].as_u64().is_some());
    }
    let l = ended(&ebb, &long).await;
    assert_eq!(l["result"], "dlrow olleh!");
    assert_eq!(functions_of(&l), ["classify", "reverse", "exclaim"]);

    // Waiting for the result in the same request.
    let (status, v) = call(
        &ebb,
        "POST",
        "/api/funcs/classify?wait=true",
        Some(TOKEN),
        "abc",
    )
    .await;
    assert_eq!((status, &v["result"]), (200, &json!("ABC!")), "{v:?}");
    let resp = client()
        .request({
            let mut r = request(&ebb, "POST", "/api/funcs/exclaim", Some(TOKEN), "x");
            r.headers_mut().insert("prefer", "wait=20".parse().unwrap());
            r
        })
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["result"], "x!");
}

async fn runner(ebb: &Ebb, path: &str, body: Value) -> (u16, Value) {
    call(ebb, "POST", path, Some(RUNNER_TOKEN), body.to_string()).await
}

fn started_count(data: &Path, call_id: &str) -> usize {
    common::events(data)
        .iter()
        .filter(|e| {
            e["event"]
                .get("CallStarted")
                .is_some_and(|x| x["id"] == call_id)
        })
        .count()
}

/// ebb killed mid-chain: the instance resumes after the restart, and no step runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_resumes_after_ebb_is_killed_mid_chain_and_runs_no_step_twice() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // No built-in runner: the first step is run by hand, then ebb is killed.
    let mut ebb = start_with(&data, Some(TOKEN), &["--runner-capacity", "0"]);
    chain(&ebb).await;
    let id = invoke(&ebb, "classify", "hey").await;
    let (status, got) = runner(
        &ebb,
        "/runner/dequeue",
        json!({ "runner": "r1", "wait_ms": 5000 }),
    )
    .await;
    assert_eq!(status, 200, "{got:?}");
    let first = got["calls"][0]["id"].as_str().unwrap().to_owned();
    assert_eq!(got["calls"][0]["payload"]["body"], "hey");
    let (status, _) = runner(
        &ebb,
        "/runner/start",
        json!({ "runner": "r1", "id": first }),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = runner(
        &ebb,
        "/runner/finish",
        json!({ "runner": "r1", "id": first, "outcome": "success",
                "result": { "status": 200, "headers": [["x-ebb-branch", "left"]], "body": "hey" } }),
    )
    .await;
    assert_eq!(status, 200);
    // The driver queues the second step; wait until it is recorded.
    let path = format!("/api/funcs/{id}");
    let v = poll(
        "the second step",
        Duration::from_millis(20),
        Duration::from_secs(30),
        || async {
            let (_, v) = api(&ebb, "GET", &path, Value::Null).await;
            (v["steps"].as_array().map(Vec::len) == Some(2)).then_some(v)
        },
    )
    .await;
    assert_eq!(functions_of(&v), ["classify", "upper"]);
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    drop(ebb);

    let ebb = start_with(&data, Some(TOKEN), &[]);
    let done = ended(&ebb, &id).await;
    assert_eq!(done["state"], "success", "{done:?}");
    assert_eq!(done["result"], "HEY!");
    assert_eq!(functions_of(&done), ["classify", "upper", "exclaim"]);
    for step in done["steps"].as_array().unwrap() {
        let call = step["callId"].as_str().unwrap();
        assert_eq!(
            started_count(&data, call),
            1,
            "step {step:?} started more than once"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_steps_return_and_every_instance_error_is_clear() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start_with(
        &dir.path().join("data"),
        Some(TOKEN),
        &["--runner-capacity", "0"],
    );
    chain(&ebb).await;
    refused(
        call(&ebb, "POST", "/api/funcs/nope", Some(TOKEN), "x").await,
        404,
        "unknown_function",
    );
    refused(
        api(
            &ebb,
            "GET",
            "/api/funcs/0190f5a2-7c1e-7000-8000-0000000000aa",
            Value::Null,
        )
        .await,
        404,
        "unknown_instance",
    );
    refused(
        call(
            &ebb,
            "PUT",
            "/api/funcs/upper/0190f5a2-7c1e-7000-8000-0000000000aa",
            Some(TOKEN),
            "x",
        )
        .await,
        404,
        "unknown_instance",
    );
    refused(
        call(
            &ebb,
            "POST",
            "/api/funcs/upper",
            Some(TOKEN),
            vec![b'a'; 5 << 20],
        )
        .await,
        413,
        "payload_too_large",
    );
    refused(
        call(&ebb, "POST", "/api/funcs/upper?wait=soon", Some(TOKEN), "x").await,
        400,
        "bad_request",
    );
    let image = json!({ "name": "boxed", "function": "f", "image": "registry/boxed:1" });
    assert_eq!(api(&ebb, "POST", "/api/funcs/template", image).await.0, 201);
    refused(
        call(&ebb, "POST", "/api/funcs/boxed", Some(TOKEN), "x").await,
        501,
        "not_runnable",
    );
    refused(
        call(&ebb, "POST", "/api/funcs/upper", None, "x").await,
        401,
        "unauthorized",
    );

    // A step added by hand, then RETURN ends the instance with its body.
    let id = invoke(&ebb, "exclaim", "a").await;
    let (status, v) = put_step(&ebb, "upper", &id, "b").await;
    assert_eq!((status, &v["step"]), (202, &json!(2)), "{v:?}");
    refused(
        call(
            &ebb,
            "PUT",
            &format!("/api/funcs/nope/{id}"),
            Some(TOKEN),
            "b",
        )
        .await,
        404,
        "unknown_function",
    );
    let (status, v) = call(
        &ebb,
        "PUT",
        &format!("/api/funcs/RETURN/{id}"),
        Some(TOKEN),
        "the end",
    )
    .await;
    assert_eq!(status, 200, "{v:?}");
    assert_eq!(
        (v["state"].as_str(), v["result"].as_str()),
        (Some("success"), Some("the end"))
    );
    assert_eq!(functions_of(&v), ["exclaim", "upper"]);
    refused(
        call(
            &ebb,
            "PUT",
            &format!("/api/funcs/RETURN/{id}"),
            Some(TOKEN),
            "again",
        )
        .await,
        409,
        "instance_ended",
    );
    refused(
        call(&ebb, "DELETE", &format!("/api/funcs/{id}"), Some(TOKEN), "").await,
        405,
        "method_not_allowed",
    );
    refused(
        call(
            &ebb,
            "POST",
            "/api/funcs/upper?wait=1&wait=2",
            Some(TOKEN),
            "x",
        )
        .await,
        400,
        "bad_request",
    );

    // Explicit steps count against the bound too.
    let id = invoke(&ebb, "exclaim", "a").await;
    for n in 2..=64 {
        let (status, v) = put_step(&ebb, "upper", &id, "b").await;
        assert_eq!((status, &v["step"]), (202, &json!(n)), "{v:?}");
    }
    refused(put_step(&ebb, "upper", &id, "b").await, 409, "step_bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_to_a_missing_function_is_refused_and_one_past_the_step_bound_ends_in_error() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(&dir.path().join("data"), Some(TOKEN));
    for t in [
        demo("dangling", "upper", Some("missing"), None),
        demo("forever", "exclaim", Some("forever"), None),
        demo("broken", "fail", Some("forever"), None),
    ] {
        assert_eq!(api(&ebb, "POST", "/api/funcs/template", t).await.0, 201);
    }
    // A chain that reaches a function that does not exist is refused when invoked.
    let (status, a) = call(&ebb, "POST", "/api/funcs/dangling", Some(TOKEN), "x").await;
    refused((status, a.clone()), 400, "unknown_next_function");
    assert!(
        a["error"].as_str().unwrap().contains("\"missing\""),
        "{a:?}"
    );
    let b = ended(&ebb, &invoke(&ebb, "forever", "").await).await;
    assert_eq!(b["state"], "error");
    assert!(b["result"].as_str().unwrap().contains("64 steps"), "{b:?}");
    assert_eq!(b["steps"].as_array().unwrap().len(), 64);
    let c = ended(&ebb, &invoke(&ebb, "broken", "x").await).await;
    assert_eq!(
        (c["state"].as_str(), c["result"].as_str()),
        (Some("error"), Some("failed"))
    );
    assert_eq!(functions_of(&c), ["broken"]);
}

const ADMIN: &str = "admin-token";

/// (desired, ready) of a function's workload, through the admin API.
async fn replicas(ebb: &Ebb, function: &str) -> (u64, u64) {
    let (status, v) = call(
        ebb,
        "GET",
        &format!("/admin/routes/fn-{function}"),
        Some(ADMIN),
        "",
    )
    .await;
    assert_eq!(status, 200, "{v:?}");
    (
        v["desired"].as_u64().unwrap(),
        v["replicas"].as_u64().unwrap(),
    )
}

async fn until_replicas(ebb: &Ebb, function: &str, want: (u64, u64)) {
    let what = format!("{function} at (desired, ready) {want:?}");
    poll(
        &what,
        Duration::from_millis(20),
        Duration::from_secs(60),
        || async { (replicas(ebb, function).await == want).then_some(()) },
    )
    .await
}

/// Load, a steady trickle, then silence: the function goes 0 -> max -> 0, never past its
/// bounds, and `ebb explain function` lists the counter and scaling events behind each change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_autoscaler_follows_the_call_counter_from_zero_to_max_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ebb = start_with(
        &data,
        Some(TOKEN),
        &[
            "--admin-token",
            ADMIN,
            "--fn-period-ms",
            "100",
            "--fn-counter-decay",
            "4",
            "--fn-counter-cap",
            "40",
            "--fn-target-per-instance",
            "5",
            "--fn-zero-after-ms",
            "300",
        ],
    );
    let mut t = demo("busy", "upper", None, None);
    t["maxInstanceNum"] = json!(3);
    assert_eq!(api(&ebb, "POST", "/api/funcs/template", t).await.0, 201);
    assert_eq!(replicas(&ebb, "busy").await, (0, 0));
    // Load: the counter reaches its cap, which asks for 8 instances; the bound is 3. Invocations
    // go on (8 each 100 ms, more than the counter decays) until 3 stand ready, so the counter
    // stays up however long the replicas take to start on a loaded machine.
    let mut ids = Vec::new();
    let watch = ebb::clock::Stopwatch::start();
    let mut pace = tokio::time::interval(Duration::from_millis(100));
    loop {
        pace.tick().await;
        for _ in 0..8 {
            let n = ids.len();
            ids.push(invoke(&ebb, "busy", &format!("b{n}")).await);
        }
        let now = replicas(&ebb, "busy").await;
        if now == (3, 3) {
            break;
        }
        assert!(
            watch.elapsed() < Duration::from_secs(60),
            "busy at (desired, ready) {now:?} under load, never (3, 3)"
        );
    }
    // Steady: a trickle keeps it up.
    for i in 0..5 {
        ids.push(invoke(&ebb, "busy", &format!("s{i}")).await);
    }
    for id in &ids {
        assert_eq!(ended(&ebb, id).await["state"], "success");
    }
    // Silence: the counter decays, and the function goes back to zero.
    until_replicas(&ebb, "busy", (0, 0)).await;

    let explained: Value = serde_json::from_str(&common::ebb_ok(
        &data,
        &["explain", "function", "busy", "--json"],
    ))
    .unwrap();
    let events: Vec<&Value> = explained["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.get("event"))
        .collect();
    let has = |name: &str| events.iter().any(|e| e.get(name).is_some());
    assert!(
        has("TemplateUpserted") && has("CounterAdded") && has("CounterDecayed"),
        "{explained:?}"
    );
    assert_eq!(explained["current"]["counter"]["value"], 0);
    let scales: Vec<(u64, String)> = events
        .iter()
        .filter_map(|e| e.get("ScaleRequested"))
        .map(|s| {
            (
                s["to"].as_u64().unwrap(),
                s["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(scales.iter().all(|(to, _)| *to <= 3), "{scales:?}");
    assert!(
        scales.iter().any(|(to, r)| *to == 3 && r == "autoscale"),
        "{scales:?}"
    );
    assert_eq!(
        scales.last(),
        Some(&(0, "autoscale".to_owned())),
        "{scales:?}"
    );
    let most_ready = events
        .iter()
        .filter_map(|e| e.get("ScaledUp"))
        .filter_map(|s| s["replicas"].as_u64())
        .max();
    assert_eq!(most_ready, Some(3));
}

/// The demo config's two functions, as the README shows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_functions_chain_as_the_readme_says() {
    let dir = tempfile::tempdir().unwrap();
    let config = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/demo.toml");
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&config),
        None,
        &["--api-token", TOKEN],
    );
    let (status, short) = call(
        &ebb,
        "POST",
        "/api/funcs/classify?wait=true",
        Some(TOKEN),
        "hi",
    )
    .await;
    assert_eq!((status, &short["result"]), (200, &json!("HI")), "{short:?}");
    assert_eq!(functions_of(&short), ["classify", "shout"]);
    let id = invoke(&ebb, "classify", "a long sentence").await;
    let long = ended(&ebb, &id).await;
    assert_eq!(long["result"], "a long sentence");
    assert_eq!(functions_of(&long), ["classify"]);
}

/// The occurrences a template fired for, in log order.
fn firings(data: &Path, name: &str) -> Vec<u64> {
    common::events(data)
        .iter()
        .filter_map(|e| e["event"].get("TemplateFired"))
        .filter(|f| f["name"] == name)
        .map(|f| f["scheduled_at_ms"].as_u64().unwrap())
        .collect()
}

async fn until_firings(data: &Path, name: &str, at_least: usize) -> Vec<u64> {
    poll(
        "the template firing",
        Duration::from_millis(100),
        Duration::from_secs(60),
        || async {
            let f = firings(data, name);
            (f.len() >= at_least).then_some(f)
        },
    )
    .await
}

/// A template with a schedule fires on it (every second here), each firing an instance like any
/// other; after ebb is killed and restarted, no occurrence fires twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_template_fires_on_schedule_and_never_twice_for_an_occurrence_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut ebb = start(&data, Some(TOKEN));
    let mut t = demo("tick", "exclaim", None, None);
    t["schedule"] = json!("* * * * * *");
    assert_eq!(api(&ebb, "POST", "/api/funcs/template", t).await.0, 201);
    refused(
        api(
            &ebb,
            "POST",
            "/api/funcs/template",
            json!({ "name": "bad-cron", "command": ["x"], "schedule": "sometimes" }),
        )
        .await,
        400,
        "invalid_template",
    );
    let before = until_firings(&data, "tick", 2).await;
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    drop(ebb);
    let ebb = start(&data, Some(TOKEN));
    let all = until_firings(&data, "tick", before.len() + 2).await;
    let mut unique = all.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        all.len(),
        "an occurrence fired twice: {all:?}"
    );
    assert!(all.windows(2).all(|w| w[0] < w[1]), "{all:?}");
    assert!(all.iter().all(|t| t % 1_000 == 0), "{all:?}");
    // Each firing is its own instance with its own first call.
    let events = common::events(&data);
    let calls: Vec<&str> = events
        .iter()
        .filter_map(|e| e["event"].get("InstanceStepped"))
        .filter(|s| s["function"] == "tick")
        .map(|s| s["call_id"].as_str().unwrap())
        .collect();
    let mut distinct = calls.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        calls.len(),
        "firings shared a call: {calls:?}"
    );
    // Each firing is an instance that ran the function with an empty body.
    let id = {
        let events = common::events(&data);
        events
            .iter()
            .filter_map(|e| e["event"].get("InstanceCreated"))
            .find(|i| i["template"] == "tick")
            .map(|i| i["id"].as_str().unwrap().to_owned())
            .unwrap()
    };
    let done = ended(&ebb, &id).await;
    assert_eq!(
        (done["state"].as_str(), done["result"].as_str()),
        (Some("success"), Some("!"))
    );
}

/// `preRun` runs once before the first instance of a function starts (not again for a warm
/// one), and a failing one keeps the function from starting: its instance ends in error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_run_runs_once_before_the_first_instance_and_a_failing_one_fails_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("prerun.log");
    let ebb = start(&dir.path().join("data"), Some(TOKEN));
    let mut t = demo("prepared", "upper", None, None);
    t["preRun"] = json!(format!("echo \"$EBB_TEMPLATE\" >> '{}'", marker.display()));
    assert_eq!(api(&ebb, "POST", "/api/funcs/template", t).await.0, 201);
    for arg in ["one", "two"] {
        let (status, v) = call(
            &ebb,
            "POST",
            "/api/funcs/prepared?wait=30",
            Some(TOKEN),
            arg,
        )
        .await;
        assert_eq!(
            (status, &v["result"]),
            (200, &json!(arg.to_uppercase())),
            "{v:?}"
        );
    }
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "prepared\n");

    let mut broken = demo("unprepared", "upper", None, None);
    broken["preRun"] = json!("exit 3");
    broken["timeoutMs"] = json!(2000);
    assert_eq!(
        api(&ebb, "POST", "/api/funcs/template", broken).await.0,
        201
    );
    let done = ended(&ebb, &invoke(&ebb, "unprepared", "x").await).await;
    assert_eq!(done["state"], "error", "{done:?}");
}

/// A template with a `serviceAddress` and no command is served there, not by ebb.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_with_a_service_address_is_called_there() {
    let port = common::free_port();
    let mut app = std::process::Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args([
            "example-app",
            "--port",
            &port.to_string(),
            "--function",
            "reverse",
        ])
        .env_remove("EBB_FUNCTION")
        .spawn()
        .unwrap();
    poll(
        "the app listening",
        Duration::from_millis(20),
        Duration::from_secs(30),
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(&dir.path().join("data"), Some(TOKEN));
    let t = json!({ "name": "elsewhere", "function": "x", "serviceAddress": format!("127.0.0.1:{port}") });
    assert_eq!(api(&ebb, "POST", "/api/funcs/template", t).await.0, 201);
    let (status, v) = call(
        &ebb,
        "POST",
        "/api/funcs/elsewhere?wait=30",
        Some(TOKEN),
        "abc",
    )
    .await;
    app.kill().unwrap();
    app.wait().unwrap();
    assert_eq!((status, &v["result"]), (200, &json!("cba")), "{v:?}");
}

/// A template posted as a client written from the serverless seed posts it (the `Func` object:
/// type and object metadata, every spec field, empty strings for those unset, a status of its
/// own) is taken; it is shown as that object with the status ebb keeps: the call counter, the
/// time of the last call counted and the replicas asked for. An object of another kind or
/// version, or whose names disagree, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seeds_func_object_is_taken_and_shown_with_the_status_ebb_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start_with(
        &dir.path().join("data"),
        Some(TOKEN),
        &["--fn-period-ms", "200", "--fn-counter-decay", "0"],
    );
    let seed = |patch: Value| {
        let mut o = json!({
            "apiVersion": "v1",
            "kind": "Func",
            "metadata": { "name": "shout", "labels": { "team": "a" }, "resourceVersion": "" },
            "spec": {
                "name": "shout", "serviceAddress": "", "preRun": "", "function": "upper",
                "left": "", "right": "", "maxInstanceNum": 2,
                "command": ["ebb", "example-app"],
            },
            "status": { "counter": 99, "timeStamp": "2020-01-01T00:00:00Z" },
        });
        for (k, v) in patch.as_object().unwrap() {
            o[k] = v.clone();
        }
        o
    };
    let post = "/api/funcs/template";
    for (body, code) in [
        (seed(json!({ "kind": "Pod" })), "invalid_template"),
        (seed(json!({ "apiVersion": "apps/v1" })), "invalid_template"),
        (
            seed(json!({ "metadata": { "name": "other" } })),
            "invalid_template",
        ),
        (
            json!({ "kind": "Func", "metadata": { "name": "x" } }),
            "bad_json",
        ),
    ] {
        refused(api(&ebb, "POST", post, body).await, 400, code);
    }
    let (status, _) = api(&ebb, "GET", "/api/funcs/template/shout", Value::Null).await;
    assert_eq!(status, 404, "nothing refused was written");

    let (status, created) = api(&ebb, "POST", post, seed(json!({}))).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["kind"], "Func");
    assert_eq!(created["spec"]["function"], "upper");
    for unset in ["left", "right", "preRun", "serviceAddress"] {
        assert!(created["spec"].get(unset).is_none(), "{unset}: {created}");
    }
    assert_eq!(
        created["status"]["counter"], 0,
        "the client's status is not taken"
    );
    assert!(created["status"].get("timeStamp").is_none(), "{created}");

    let (status, v) = call(
        &ebb,
        "POST",
        "/api/funcs/shout?wait=true",
        Some(TOKEN),
        "abc",
    )
    .await;
    assert_eq!((status, &v["result"]), (200, &json!("ABC")), "{v:?}");
    let shown = poll(
        "the call counted in the status",
        Duration::from_millis(50),
        Duration::from_secs(30),
        || async {
            let (_, t) = api(&ebb, "GET", "/api/funcs/template/shout", Value::Null).await;
            (t["status"]["counter"].as_u64().unwrap_or(0) > 0).then_some(t)
        },
    )
    .await;
    assert_eq!(shown["status"]["counter"], 1, "one call, one step: {shown}");
    let stamp = shown["status"]["timeStamp"].as_str().expect("a timeStamp");
    assert!(
        chrono::DateTime::parse_from_rfc3339(stamp).is_ok_and(|t| t.timestamp() > 1_700_000_000),
        "{stamp}"
    );
    assert!(
        shown["status"]["replicas"].as_u64().unwrap() >= 1,
        "{shown}"
    );
}

/// Two replicas sharing Apache Kafka, only the second with a runner: a chain invoked on the first
/// is the first's (its instance and every step's call), each step run by the second replica's
/// runner and decided by the first through forwarding; the instance reads the same through
/// either replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_owned_by_one_replica_runs_on_the_other_replicas_runner() {
    let pair = common::KafkaPair::start().await;
    let replica = |i: usize, capacity: &str| {
        let mut args = pair.args(i);
        args.extend(["--runner-capacity".to_owned(), capacity.to_owned()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        start_with(&pair.data(i), Some(TOKEN), &args)
    };
    let e0 = replica(0, "0");
    let e1 = replica(1, "8");
    // Templates are each replica's own on one machine (Func resources on Kubernetes).
    chain(&e0).await;
    chain(&e1).await;
    let id = invoke(&e0, "classify", "hey").await;
    assert!(id.starts_with("ebb-0."), "{id}");
    let done = ended(&e1, &id).await;
    assert_eq!(done["state"], "success", "{done}");
    assert_eq!(done["result"], "HEY!", "{done}");
    let (status, again) = api(&e0, "GET", &format!("/api/funcs/{id}"), Value::Null).await;
    assert_eq!((status, &again), (200, &done));
    let steps = done["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 3, "{done}");
    for step in steps {
        let call = step["callId"].as_str().unwrap();
        assert!(call.starts_with("ebb-0."), "{done}");
        let (status, c) = call_get(&e1, call).await;
        assert_eq!(status, 200, "{c}");
        assert_eq!(c["runner"], "builtin-ebb-1", "{c}");
        assert_eq!(started_count(&e0.data, call), 1, "{call}");
        assert_eq!(started_count(&e1.data, call), 0, "{call}");
    }
}

/// The same chain with traces on: invoked on the first replica with a `traceparent`, its steps
/// decided there and run by the second replica's runner, it is one trace across both: each
/// step's `function.step` (recorded by the owner) and the second replica's `proxy.request` of
/// each step's request under the invoker's span. The replicas export over OTLP/HTTP and
/// OTLP/gRPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_invoked_on_one_replica_and_run_on_the_other_is_one_trace() {
    let collector = common::otelcol::Collector::start().await;
    let pair = common::KafkaPair::start().await;
    // The first replica exports over OTLP/HTTP, the second over OTLP/gRPC.
    let endpoints = [
        format!("http://{}", collector.http),
        format!("http://{}", collector.grpc),
    ];
    let replica = |i: usize, capacity: &str| {
        let mut args = pair.args(i);
        args.extend(["--runner-capacity".to_owned(), capacity.to_owned()]);
        args.extend(["--runner-token".to_owned(), RUNNER_TOKEN.to_owned()]);
        args.extend(["--api-token".to_owned(), TOKEN.to_owned()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let service = format!("ebb-{i}");
        let protocol = ["http/protobuf", "grpc"][i];
        let env: Vec<(&str, &std::ffi::OsStr)> = vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoints[i].as_ref()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.as_ref()),
            ("OTEL_SERVICE_NAME", service.as_ref()),
            ("OTEL_BSP_SCHEDULE_DELAY", "50".as_ref()),
        ];
        common::serve_env(&pair.data(i), None, None, &args, &env)
    };
    let e0 = replica(0, "0");
    let e1 = replica(1, "8");
    chain(&e0).await;
    chain(&e1).await;
    let trace = "3e1d5c7b9a0f2e4d6c8b0a1f3e5d7c9b";
    let invoker = "1f2e3d4c5b6a7988";
    let c = common::http::client();
    let r = common::http::send_body(
        &c,
        e0.admin,
        "POST",
        "localhost",
        "/api/funcs/classify",
        &[
            ("authorization", &format!("Bearer {TOKEN}")),
            ("traceparent", &format!("00-{trace}-{invoker}-01")),
        ],
        bytes::Bytes::from_static(b"hey"),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.body);
    let id = serde_json::from_str::<Value>(&r.body).unwrap()["instanceId"]
        .as_str()
        .unwrap()
        .to_owned();
    let done = ended(&e1, &id).await;
    assert_eq!(done["state"], "success", "{done}");
    let (steps, forwarded) = collector
        .spans_until("the chain's spans", |spans| {
            let in_trace = |name: &str, service: &str| -> Vec<common::otelcol::Span> {
                spans
                    .iter()
                    .filter(|s| s.name == name && s.trace_id == trace && s.service == service)
                    .cloned()
                    .collect()
            };
            let steps = in_trace("function.step", "ebb-0");
            let forwarded = in_trace("proxy.request", "ebb-1");
            (steps.len() == 3 && forwarded.len() >= 3).then_some((steps, forwarded))
        })
        .await;
    let mut functions: Vec<String> = steps
        .iter()
        .map(|s| {
            assert_eq!(s.parent, invoker, "{s:?}");
            assert_eq!(
                s.attr("ebb.function.instance").as_deref(),
                Some(id.as_str())
            );
            assert_eq!(
                s.attr("ebb.runner").as_deref(),
                Some("builtin-ebb-1"),
                "{s:?}"
            );
            s.attr("ebb.function.name").unwrap_or_default()
        })
        .collect();
    functions.sort();
    assert_eq!(functions, ["classify", "exclaim", "upper"], "{steps:#?}");
    for f in &forwarded {
        assert_eq!(f.parent, invoker, "{f:?}");
    }
}

/// `GET /v1/calls/{id}` with the runner token.
async fn call_get(ebb: &Ebb, id: &str) -> (u16, Value) {
    let path = format!("/v1/calls/{id}");
    call(ebb, "GET", &path, Some(RUNNER_TOKEN), String::new()).await
}

/// Whether `t` looks like `2026-11-27T01:02:03Z`.
fn chrono_like(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() == 20 && b[4] == b'-' && b[7] == b'-' && b[10] == b'T' && b[13] == b':'
}
