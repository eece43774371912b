//! Durable calls end to end: `ebb serve` with the embedded queue, the runner API over real HTTP,
//! `ebb runner` processes (some told to SIGKILL themselves at a point of a call's life), and the
//! example app as the calls' target.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use ebb::clock::{Clock, SystemClock};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::common;

use common::Ebb;
use common::controlplane::wait_until;

const TOKEN: &str = "runner-secret";
const DEADLINE: Duration = Duration::from_secs(60);
/// No built-in runner; calls not started come back after 0.5 s, silent runners are gone after 1 s.
const FAST_REDELIVERY: &[&str] = &[
    "--runner-capacity",
    "0",
    "--visibility-timeout-ms",
    "500",
    "--runner-lease-ms",
    "1000",
];

fn config(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("ebb.toml");
    std::fs::write(
        &path,
        "[[app]]\nname = \"work\"\ndomains = [\"work.localhost\"]\ncommand = [\"ebb\", \"example-app\"]\nstartup_timeout_ms = 20000\n",
    )
    .unwrap();
    path
}

/// [`start`] with the Kafka queue at `brokers` (4 partitions), no built-in runner, runners gone
/// after `runner_lease_ms`.
fn start_on_kafka(dir: &Path, brokers: &str, runner_lease_ms: &str) -> Ebb {
    start(
        dir,
        &[
            "--runner-capacity",
            "0",
            "--runner-lease-ms",
            runner_lease_ms,
            "--kafka-brokers",
            brokers,
            "--kafka-partitions",
            "4",
        ],
    )
}

/// `ebb serve` with the runner API on; `extra` are more serve arguments.
fn start(dir: &Path, extra: &[&str]) -> Ebb {
    let mut args = vec!["--runner-token", TOKEN];
    args.extend_from_slice(extra);
    common::serve_with(&dir.join("data"), Some(&config(dir)), None, &args)
}

struct Answer {
    status: u16,
    headers: hyper::HeaderMap,
    json: Value,
}

async fn call_api(
    ebb: &Ebb,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<String>,
    extra: &[(&str, &str)],
) -> Answer {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", ebb.admin))
        .header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .unwrap();
    let resp = client.request(req).await.expect("ebb answers");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let json = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    Answer {
        status,
        headers,
        json,
    }
}

async fn post(ebb: &Ebb, path: &str, body: Value) -> Answer {
    call_api(ebb, "POST", path, Some(TOKEN), Some(body.to_string()), &[]).await
}

async fn get(ebb: &Ebb, path: &str) -> Answer {
    call_api(ebb, "GET", path, Some(TOKEN), None, &[]).await
}

/// `POST /runner/dequeue` for `runner`, long-polling up to `wait_ms`.
async fn dequeue(ebb: &Ebb, runner: &str, wait_ms: u64) -> Answer {
    post(
        ebb,
        "/runner/dequeue",
        json!({ "runner": runner, "wait_ms": wait_ms }),
    )
    .await
}

/// `POST /runner/dequeue` of up to `max` calls for `runner`, long-polling up to `wait_ms`.
async fn dequeue_up_to(ebb: &Ebb, runner: &str, max: usize, wait_ms: u64) -> Answer {
    let body = json!({ "runner": runner, "max": max, "wait_ms": wait_ms });
    post(ebb, "/runner/dequeue", body).await
}

/// A dequeue that finds nothing, carrying the runner's `X-Runner-Load`.
async fn report_load(ebb: &Ebb, runner: &str, load: &str) -> Answer {
    let body = json!({ "runner": runner, "wait_ms": 0 }).to_string();
    let extra = [("x-runner-load", load)];
    call_api(
        ebb,
        "POST",
        "/runner/dequeue",
        Some(TOKEN),
        Some(body),
        &extra,
    )
    .await
}

/// `POST /runner/start` of one call for `runner`.
async fn start_one(ebb: &Ebb, runner: &str, id: &str) -> Answer {
    post(ebb, "/runner/start", json!({ "runner": runner, "id": id })).await
}

async fn enqueue(ebb: &Ebb, body: Value) -> String {
    let a = post(ebb, "/runner/enqueue", body).await;
    assert_eq!(a.status, 200, "{}", a.json);
    a.json["id"].as_str().unwrap().to_owned()
}

/// Enqueues `n` calls to the app with bodies `n0`, `n1`, ...; returns their ids.
async fn enqueue_bodies(ebb: &Ebb, n: usize) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let body = json!({ "target": "work", "payload": { "body": format!("n{i}") } });
        ids.push(enqueue(ebb, body).await);
    }
    ids
}

/// Every call in `ids` succeeds, each started exactly once.
async fn all_run_once(ebb: &Ebb, ids: &[String]) {
    for id in ids {
        wait_state(ebb, id, "success").await;
    }
    for id in ids {
        assert_eq!(events_of(&ebb.data, id, "CallStarted"), 1);
    }
}

async fn state(ebb: &Ebb, id: &str) -> String {
    let a = get(ebb, &format!("/v1/calls/{id}")).await;
    assert_eq!(a.status, 200, "{}", a.json);
    a.json["state"].as_str().unwrap().to_owned()
}

/// Polls until every call of `ids` is forgotten (its `GET` answers 404).
async fn wait_forgotten(ebb: &Ebb, ids: &[String]) {
    let forgotten = async {
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        for id in ids {
            while get(ebb, &format!("/v1/calls/{id}")).await.status != 404 {
                tick.tick().await;
            }
        }
    };
    tokio::time::timeout(DEADLINE, forgotten)
        .await
        .unwrap_or_else(|_| panic!("{ids:?} are not forgotten"));
}

/// Polls until the call is in `want` (or the deadline passes).
async fn wait_state(ebb: &Ebb, id: &str, want: &str) {
    let wait = async {
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        while state(ebb, id).await != want {
            tick.tick().await;
        }
    };
    if tokio::time::timeout(DEADLINE, wait).await.is_err() {
        let c = get(ebb, &format!("/v1/calls/{id}")).await;
        panic!("call {id} never became {want}: {}", c.json);
    }
}

/// Polls until every call in `ids` has ended, whichever way (or the deadline passes).
async fn all_end(ebb: &Ebb, ids: &[String]) {
    let ended = async {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        for id in ids {
            while !["success", "error", "timeout"].contains(&state(ebb, id).await.as_str()) {
                tick.tick().await;
            }
        }
    };
    tokio::time::timeout(DEADLINE, ended)
        .await
        .expect("every acknowledged call ends");
}

async fn count_calls(ebb: &Ebb) -> usize {
    let a = get(ebb, "/v1/calls?limit=1000").await;
    assert_eq!(a.status, 200, "{}", a.json);
    a.json["calls"].as_array().unwrap().len()
}

/// The events of one kind for one call, from `ebb log dump`.
fn events_of(data: &Path, id: &str, kind: &str) -> usize {
    common::events(data)
        .iter()
        .filter(|e| {
            e["event"]
                .get(kind)
                .is_some_and(|x| x["id"] == id || x["call"]["id"] == id)
        })
        .count()
}

/// Waits for a runner that kills itself and asserts it died of SIGKILL.
async fn killed(runner: Runner) {
    use std::os::unix::process::ExitStatusExt;
    let mut runner = runner;
    let exited = async {
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            if let Some(status) = runner.0.try_wait().unwrap() {
                return status;
            }
            tick.tick().await;
        }
    };
    let status = tokio::time::timeout(DEADLINE, exited)
        .await
        .expect("the runner killed itself");
    assert_eq!(status.signal(), Some(9), "the runner SIGKILLed itself");
}

/// `ebb runner` against `ebb`, killed when dropped.
type Runner = common::EbbRunner;

fn runner(ebb: &Ebb, id: &str, fault: Option<&str>) -> Runner {
    runner_of(ebb, id, 4, fault)
}

/// `ebb runner` running `capacity` calls at once.
fn runner_of(ebb: &Ebb, id: &str, capacity: usize, fault: Option<&str>) -> Runner {
    let fault: Vec<&str> = fault.map(|f| vec!["--fault", f]).unwrap_or_default();
    common::ebb_runner(ebb.admin, ebb.proxy, TOKEN, id, capacity, &fault)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_and_finish_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--runner-capacity", "0"]);

    let id = enqueue(
        &ebb,
        json!({ "target": "work", "payload": { "path": "/x", "body": "hi" } }),
    )
    .await;
    assert_eq!(state(&ebb, &id).await, "queued");
    let d = dequeue_up_to(&ebb, "r1", 5, 5000).await;
    assert_eq!(d.status, 200, "{}", d.json);
    assert_eq!(d.json["calls"][0]["id"], id.as_str());
    assert_eq!(d.json["calls"][0]["host"], "work.localhost");
    assert_eq!(d.json["calls"][0]["payload"]["body"], "hi");

    // The first start runs the call; a second start means it may run twice: 409, and error.
    let s = start_one(&ebb, "r1", &id).await;
    assert_eq!(s.status, 200, "{}", s.json);
    assert_eq!(s.json["state"], "running");
    let again = start_one(&ebb, "r2", &id).await;
    assert_eq!(again.status, 409, "{}", again.json);
    assert_eq!(again.json["code"], "already_running");
    assert_eq!(state(&ebb, &id).await, "error");
    // A start on a finished call: 409.
    let late = start_one(&ebb, "r1", &id).await;
    assert_eq!(
        (late.status, late.json["code"].as_str()),
        (409, Some("already_final"))
    );
    // Its message is gone: nothing is handed out again.
    let none = dequeue(&ebb, "r1", 300).await;
    assert_eq!(none.status, 204);

    // Finish twice: one result, the same answer both times.
    let id2 = enqueue(&ebb, json!({ "target": "work" })).await;
    let d = dequeue(&ebb, "r1", 5000).await;
    assert_eq!(d.json["calls"][0]["id"], id2.as_str());
    let s = post(
        &ebb,
        "/runner/start",
        json!({ "runner": "r1", "ids": [id2] }),
    )
    .await;
    assert_eq!(s.json["results"][0]["started"], true, "{}", s.json);
    let first = json!({ "runner": "r1", "id": id2, "outcome": "success",
        "result": { "status": 201, "headers": [["x-a", "1"]], "body": "first" }, "log": "ran\n" });
    let second = json!({ "runner": "r1", "id": id2, "outcome": "error",
        "result": { "status": 500, "body": "second" } });
    let a = post(&ebb, "/runner/finish", first).await;
    let b = post(&ebb, "/runner/finish", second).await;
    assert_eq!((a.status, b.status), (200, 200));
    assert_eq!(a.json, b.json);
    assert_eq!(a.json["state"], "success");
    let c = get(&ebb, &format!("/v1/calls/{id2}")).await;
    assert_eq!(c.json["result"]["status"], 201);
    assert_eq!(c.json["result"]["body"], "first");
    assert_eq!(c.json["attempt"], 1);
    let log = call_api(
        &ebb,
        "GET",
        &format!("/v1/calls/{id2}/log"),
        Some(TOKEN),
        None,
        &[],
    )
    .await;
    assert_eq!(log.json, "ran\n");
    assert_eq!(events_of(&ebb.data, &id2, "CallFinished"), 1);

    // A finish for a call never queued (a sync call) is recorded.
    let sync_id = "01890a5d-ac96-774b-bcce-b302099a8057";
    let f = post(
        &ebb,
        "/runner/finish",
        json!({ "runner": "r1", "id": sync_id, "outcome": "success" }),
    )
    .await;
    assert_eq!((f.status, f.json["state"].as_str()), (200, Some("success")));
    assert_eq!(state(&ebb, sync_id).await, "success");

    // Listing by state, paged.
    let page = get(&ebb, "/v1/calls?state=success&limit=1").await;
    assert_eq!(page.json["calls"].as_array().unwrap().len(), 1);
    let next = page.json["next"].as_str().unwrap().to_owned();
    let page2 = get(
        &ebb,
        &format!("/v1/calls?state=success&limit=1&after={next}"),
    )
    .await;
    assert_eq!(page2.json["calls"].as_array().unwrap().len(), 1);
    assert_ne!(page.json["calls"][0]["id"], page2.json["calls"][0]["id"]);
}

/// A call id is the enqueue's idempotency key: an enqueue retried with the same id (its answer
/// was lost) answers the same id, and the call is queued and run once.
/// A runner API request with a MessagePack body (or any bytes, as `content_type`), asking for
/// `accept`: the answer's status, `Content-Type` and body.
async fn call_packed(
    ebb: &Ebb,
    path: &str,
    content_type: &str,
    accept: &str,
    body: Vec<u8>,
) -> (u16, String, Bytes) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::post(format!("http://{}{path}", ebb.admin))
        .header("content-type", content_type)
        .header("accept", accept)
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = client.request(req).await.expect("ebb answers");
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (
        status,
        ct,
        resp.into_body().collect().await.unwrap().to_bytes(),
    )
}

/// `value` as MessagePack, with its field names.
fn packed(value: Value) -> Vec<u8> {
    rmp_serde::to_vec_named(&value).unwrap()
}

/// A MessagePack answer read back as JSON values.
fn unpacked(ct: &str, body: &[u8]) -> Value {
    assert_eq!(
        ct,
        "application/msgpack",
        "{}",
        String::from_utf8_lossy(body)
    );
    rmp_serde::from_slice(body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_api_reads_and_answers_msgpack_when_asked_and_its_errors_stay_json() {
    const MSGPACK: &str = "application/msgpack";
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--runner-capacity", "0"]);

    // A batch enqueued as MessagePack, with a binary body, answered in MessagePack.
    let body = json!({ "calls": [
        { "target": "work", "payload": { "path": "/m", "body": "hi" } },
        { "target": "work", "payload": { "body_base64": "AP8=" } },
    ] });
    let (status, ct, answer) =
        call_packed(&ebb, "/runner/enqueue", MSGPACK, MSGPACK, packed(body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let ids = unpacked(&ct, &answer)["ids"].clone();
    assert_eq!(ids.as_array().map(Vec::len), Some(2), "{ids}");
    // Read by a JSON client as any call is.
    for id in ids.as_array().unwrap() {
        assert_eq!(state(&ebb, id.as_str().unwrap()).await, "queued");
    }

    // Dequeued, started and finished in MessagePack; the calls are the ones enqueued.
    let body = json!({ "runner": "r1", "max": 2, "wait_ms": 5000 });
    let (status, ct, answer) =
        call_packed(&ebb, "/runner/dequeue", MSGPACK, MSGPACK, packed(body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let jobs = unpacked(&ct, &answer)["calls"].clone();
    assert_eq!(jobs[0]["id"], ids[0]);
    assert_eq!(jobs[0]["host"], "work.localhost");
    assert_eq!(jobs[0]["payload"]["path"], "/m");
    assert_eq!(jobs[0]["payload"]["body"], "hi");
    assert_eq!(jobs[1]["payload"]["body_base64"], "AP8=");
    let body = json!({ "runner": "r1", "ids": ids });
    let (status, ct, answer) =
        call_packed(&ebb, "/runner/start", MSGPACK, MSGPACK, packed(body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let started = unpacked(&ct, &answer)["results"].clone();
    assert_eq!(started[0]["started"], true, "{started}");
    assert_eq!(started[1]["state"], "running", "{started}");
    let body = json!({ "runner": "r1", "calls": [
        { "id": ids[0], "outcome": "success", "result": { "status": 200, "body": "done" } },
        { "id": ids[1], "outcome": "error", "log": "no" },
    ] });
    let (status, ct, answer) =
        call_packed(&ebb, "/runner/finish", MSGPACK, MSGPACK, packed(body)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let finished = unpacked(&ct, &answer)["results"].clone();
    assert_eq!(
        (&finished[0]["state"], &finished[1]["state"]),
        (&json!("success"), &json!("error"))
    );
    let first = get(&ebb, &format!("/v1/calls/{}", ids[0].as_str().unwrap())).await;
    assert_eq!(first.json["result"]["body"], "done", "{}", first.json);

    // A MessagePack body answered in JSON when the client does not ask for MessagePack.
    let body = json!({ "target": "work" });
    let (status, ct, answer) =
        call_packed(&ebb, "/runner/enqueue", MSGPACK, "*/*", packed(body)).await;
    assert_eq!((status, ct.as_str()), (200, "application/json"));
    let one: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(one["state"], "queued", "{one}");

    // Bad MessagePack: 400 with a JSON error saying what is wrong, whatever was accepted.
    let body = json!({ "target": "work", "nope": 1 });
    let (status, ct, answer) =
        call_packed(&ebb, "/runner/enqueue", MSGPACK, MSGPACK, packed(body)).await;
    assert_eq!((status, ct.as_str()), (400, "application/json"));
    let error: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(error["code"], "bad_msgpack", "{error}");
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .contains("unknown field `nope`"),
        "{error}"
    );
    let (status, _, answer) =
        call_packed(&ebb, "/runner/finish", MSGPACK, MSGPACK, vec![0xc1]).await;
    let error: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!((status, &error["code"]), (400, &json!("bad_msgpack")));

    // A server that reads every body as JSON (as ebb did before MessagePack) answers a
    // MessagePack one with 400 `bad_json`: what a runner takes as the sign to send JSON.
    let body = packed(json!({ "runner": "r1", "wait_ms": 0 }));
    let (status, _, answer) =
        call_packed(&ebb, "/runner/dequeue", "application/json", MSGPACK, body).await;
    let negotiated = ebb::calls::wire::Negotiated::default();
    assert!(
        negotiated.refused(ebb::calls::wire::Format::Msgpack, status, &answer),
        "{status} {}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(negotiated.format(), ebb::calls::wire::Format::Json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_retried_with_the_same_id_is_the_same_call() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--runner-capacity", "0"]);
    let id = uuid::Uuid::now_v7().hyphenated().to_string();
    let body = json!({ "target": "work", "id": id, "payload": { "body": "once" } });
    let first = post(&ebb, "/runner/enqueue", body.clone()).await;
    let again = post(&ebb, "/runner/enqueue", body.clone()).await;
    assert_eq!((first.status, again.status), (200, 200), "{:?}", again.json);
    assert_eq!(first.json["id"], id.as_str());
    assert_eq!(again.json["id"], id.as_str());
    let got = dequeue(&ebb, "r1", 2_000).await;
    assert_eq!(
        got.json["calls"].as_array().map(Vec::len),
        Some(1),
        "{:?}",
        got.json
    );
    assert_eq!(start_one(&ebb, "r1", &id).await.status, 200);
    let done = json!({ "runner": "r1", "id": id, "outcome": "success" });
    assert_eq!(post(&ebb, "/runner/finish", done).await.status, 200);
    // Retried after the call ended: still the same call, not run again.
    let late = post(&ebb, "/runner/enqueue", body).await;
    assert_eq!(late.status, 200);
    assert_eq!(events_of(&ebb.data, &id, "CallQueued"), 1);
    assert_eq!(events_of(&ebb.data, &id, "CallStarted"), 1);
    assert_eq!(state(&ebb, &id).await, "success");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--runner-capacity", "0", "--max-queued", "2"]);
    let before = count_calls(&ebb).await;

    let no_token = call_api(
        &ebb,
        "POST",
        "/runner/enqueue",
        None,
        Some("{}".into()),
        &[],
    )
    .await;
    assert_eq!(
        (no_token.status, no_token.json["code"].as_str()),
        (401, Some("unauthorized"))
    );
    let wrong = call_api(&ebb, "GET", "/v1/calls", Some("nope"), None, &[]).await;
    assert_eq!(wrong.status, 401);
    let bad = call_api(
        &ebb,
        "POST",
        "/runner/enqueue",
        Some(TOKEN),
        Some("{not json".into()),
        &[],
    )
    .await;
    assert_eq!(
        (bad.status, bad.json["code"].as_str()),
        (400, Some("bad_json"))
    );
    let unknown_field = post(&ebb, "/runner/dequeue", json!({ "runner": "r", "nope": 1 })).await;
    assert_eq!(unknown_field.status, 400);
    let bad_runner = post(&ebb, "/runner/dequeue", json!({ "runner": "a b" })).await;
    assert_eq!(
        (bad_runner.status, bad_runner.json["code"].as_str()),
        (400, Some("bad_runner"))
    );
    let unknown_target = post(&ebb, "/runner/enqueue", json!({ "target": "nobody" })).await;
    assert_eq!(
        (unknown_target.status, unknown_target.json["code"].as_str()),
        (404, Some("unknown_target"))
    );
    let big = "x".repeat((1 << 20) + 1);
    let too_big = post(
        &ebb,
        "/runner/enqueue",
        json!({ "target": "work", "payload": { "body": big } }),
    )
    .await;
    assert_eq!(
        (too_big.status, too_big.json["code"].as_str()),
        (413, Some("payload_too_large"))
    );
    let huge = "y".repeat(17 << 20);
    let too_huge = call_api(
        &ebb,
        "POST",
        "/runner/enqueue",
        Some(TOKEN),
        Some(huge),
        &[],
    )
    .await;
    assert_eq!(
        (too_huge.status, too_huge.json["code"].as_str()),
        (413, Some("payload_too_large"))
    );
    let not_uuid = post(
        &ebb,
        "/runner/enqueue",
        json!({ "target": "work", "id": "abc" }),
    )
    .await;
    assert_eq!(not_uuid.status, 400);
    let unknown_call = get(&ebb, "/v1/calls/01890a5d-ac96-774b-bcce-b302099a8057").await;
    assert_eq!(
        (unknown_call.status, unknown_call.json["code"].as_str()),
        (404, Some("not_found"))
    );
    let start_unknown = post(
        &ebb,
        "/runner/start",
        json!({ "runner": "r", "id": "01890a5d-ac96-774b-bcce-b302099a8057" }),
    )
    .await;
    assert_eq!(
        (start_unknown.status, start_unknown.json["code"].as_str()),
        (409, Some("unknown_call"))
    );
    assert_eq!(count_calls(&ebb).await, before, "no error wrote a call");

    // The queue's put fails (it is full): 503, and no call recorded.
    enqueue(&ebb, json!({ "target": "work" })).await;
    enqueue(&ebb, json!({ "target": "work" })).await;
    let full = post(&ebb, "/runner/enqueue", json!({ "target": "work" })).await;
    assert_eq!(
        (full.status, full.json["code"].as_str()),
        (503, Some("queue_full"))
    );
    let batch = post(
        &ebb,
        "/runner/enqueue",
        json!({ "calls": [{ "target": "work" }] }),
    )
    .await;
    assert_eq!(batch.status, 503);
    assert_eq!(count_calls(&ebb).await, before + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_load_steers_work_to_the_least_loaded_runner() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--runner-capacity", "0"]);
    for (runner, load) in [("busy", "9/10"), ("idle", "1/10")] {
        let a = report_load(&ebb, runner, load).await;
        assert_eq!(a.status, 204);
        assert_eq!(a.headers["x-runner-load"], load);
    }
    let id = enqueue(&ebb, json!({ "target": "work" })).await;
    let c = get(&ebb, &format!("/v1/calls/{id}")).await;
    assert_eq!(c.json["partition"], "idle");
    // The busy runner does not get the idle one's call.
    let none = dequeue(&ebb, "busy", 200).await;
    assert_eq!(none.status, 204);
    let got = dequeue(&ebb, "idle", 5000).await;
    assert_eq!(got.json["calls"][0]["id"], id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_runner_runs_calls_against_the_app_from_zero() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &[]);
    let id = enqueue(&ebb, json!({ "target": "work", "payload": { "method": "PUT", "path": "/echo", "body": "ping" } })).await;
    wait_state(&ebb, &id, "success").await;
    let c = get(&ebb, &format!("/v1/calls/{id}")).await;
    assert_eq!(c.json["result"]["status"], 200);
    assert_eq!(c.json["result"]["body"], "ping");
    assert_eq!(c.json["runner"], "builtin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_after_dequeue_loses_nothing_and_runs_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), FAST_REDELIVERY);
    let id = enqueue(
        &ebb,
        json!({ "target": "work", "payload": { "method": "GET", "path": "/pid" } }),
    )
    .await;
    killed(runner(&ebb, "victim", Some("kill-after-dequeue"))).await;
    assert_eq!(state(&ebb, &id).await, "queued");
    let _healthy = runner(&ebb, "healthy", None);
    wait_state(&ebb, &id, "success").await;
    assert_eq!(events_of(&ebb.data, &id, "CallStarted"), 1);
    assert_eq!(events_of(&ebb.data, &id, "CallRejected"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_after_start_ends_in_timeout_not_a_second_run() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), FAST_REDELIVERY);
    let id = enqueue(&ebb, json!({ "target": "work", "timeout_ms": 1500 })).await;
    killed(runner(&ebb, "victim", Some("kill-after-start"))).await;
    // A healthy runner is around the whole time: it must not get the call.
    let _healthy = runner(&ebb, "healthy", None);
    wait_state(&ebb, &id, "timeout").await;
    // The lease (1 s) ran out before the deadline (1.5 s): had the message been handed out
    // again, its start would have made the call `error` before it could time out.
    assert_eq!(events_of(&ebb.data, &id, "CallStarted"), 1);
    assert_eq!(events_of(&ebb.data, &id, "CallRejected"), 0);
    assert_eq!(events_of(&ebb.data, &id, "CallTimedOut"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_enqueues_survive_a_sigkill_of_ebb_and_complete() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebb = start(dir.path(), &["--runner-capacity", "0"]);
    let mut ids = enqueue_bodies(&ebb, 20).await;
    let batch = post(
        &ebb,
        "/runner/enqueue",
        json!({ "calls": [{ "target": "work" }, { "target": "work" }] }),
    )
    .await;
    assert_eq!(batch.status, 200);
    ids.extend(
        batch.json["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned()),
    );
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    drop(ebb);
    let ebb = start(dir.path(), &[]);
    all_run_once(&ebb, &ids).await;
}

/// The embedded queue does not sync its puts (the log, synced before an enqueue is answered, is
/// the durable record). The worst a machine crash can do to it is take every message away: the
/// queued calls are put back from the log at start-up and each runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_a_machine_crash_took_from_the_queue_are_put_back_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebb = start(dir.path(), &["--runner-capacity", "0"]);
    let ids = enqueue_bodies(&ebb, 10).await;
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    let queue = ebb.data.join("queue");
    drop(ebb);
    std::fs::remove_dir_all(&queue).unwrap();
    let ebb = start(dir.path(), &[]);
    all_run_once(&ebb, &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_kafka_a_killed_runners_partitions_move_to_the_other_runner() {
    let broker = common::broker().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = broker.addr.to_string();
    let ebb = start_on_kafka(dir.path(), &brokers, "1500");
    // The victim alone first, so its consumer has every partition: it dies holding calls.
    let victim = runner(&ebb, "victim", Some("kill-after-dequeue"));
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(enqueue(&ebb, json!({ "target": "work", "payload": { "method": "GET", "path": format!("/pid?n={i}") } })).await);
    }
    killed(victim).await;
    let _healthy = runner(&ebb, "healthy", None);
    for id in &ids {
        wait_state(&ebb, id, "success").await;
    }
    for id in &ids {
        assert_eq!(
            events_of(&ebb.data, id, "CallStarted"),
            1,
            "{id} started once"
        );
    }
    // The healthy runner ran everything.
    for id in &ids {
        let c = get(&ebb, &format!("/v1/calls/{id}")).await;
        assert_eq!(c.json["runner"], "healthy");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_kafka_down_an_enqueue_fails_with_503_and_records_nothing() {
    let broker = common::broker().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = broker.addr.to_string();
    let ebb = start(
        dir.path(),
        &["--runner-capacity", "0", "--kafka-brokers", &brokers],
    );
    enqueue(&ebb, json!({ "target": "work" })).await;
    drop(broker);
    let failed = post(&ebb, "/runner/enqueue", json!({ "target": "work" })).await;
    assert_eq!(
        (failed.status, failed.json["code"].as_str()),
        (503, Some("queue_unavailable")),
        "{}",
        failed.json
    );
    assert_eq!(
        count_calls(&ebb).await,
        1,
        "the failed enqueue recorded nothing"
    );
}

/// `ebb bench calls --kafka` leaves nothing on the broker it measured: every setup's topic (each
/// puts hundreds of megabytes there) and consumer group are deleted when the setup ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_calls_on_kafka_deletes_the_topics_and_groups_it_made() {
    let broker = common::broker().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = broker.addr.to_string();
    let data = dir.path().join("data");
    let out = tokio::task::spawn_blocking(move || {
        common::ebb_ok(
            &data,
            &[
                "bench",
                "calls",
                "--seconds",
                "1",
                "--rounds",
                "1",
                "--kafka",
                &brokers,
                "--kafka-only",
            ],
        )
    })
    .await
    .unwrap();
    // It measured on the broker: one replica and two.
    assert!(out.contains("| kafka | 1 | in process |"), "{out}");
    assert!(out.contains("| kafka | 2 | over HTTP |"), "{out}");
    // Each latency round's p99 beside the partitions its rebalances moved.
    assert!(out.contains("partitions moved during it"), "{out}");
    // The broker's metadata follows its controller's deletions within moments.
    let broker = &broker;
    wait_until(
        "no ebb-bench topic or group left",
        Duration::from_secs(30),
        || async move {
            let names = broker.names().await?;
            let ours = |name: &String| name.starts_with("ebb-bench-");
            let left = names.topics.iter().any(ours) || names.groups.iter().any(ours);
            (!left).then_some(())
        },
    )
    .await;
}

/// `--kafka-config` and `--kafka-config-file` reach ebb's Kafka clients: a producer told a
/// smaller `message.max.bytes` refuses a call over it (and records nothing) while smaller ones go
/// through; a property ebb keeps, or one librdkafka does not know, stops `ebb serve` at its
/// start with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_client_properties_reach_the_clients_and_bad_ones_stop_ebb_at_its_start() {
    let broker = common::broker().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = broker.addr.to_string();
    let refused = |extra: &[&str]| {
        let mut args = vec!["--kafka-brokers", brokers.as_str()];
        args.extend_from_slice(extra);
        common::serve_refused(&dir.path().join("refused"), args)
    };
    let err = refused(&["--kafka-config", "acks=1"]);
    assert!(err.contains("acks is set by ebb itself"), "{err}");
    let err = refused(&["--kafka-config", "consumer.no.such.property=1"]);
    assert!(err.contains("no.such.property"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let err = refused(&["--kafka-config-file", "/nonexistent/kafka.properties"]);
    assert!(
        err.contains("--kafka-config-file /nonexistent/kafka.properties"),
        "{err}"
    );
    // A bad line is named by its number, never repeated (it may hold a password).
    let bad = dir.path().join("bad.properties");
    std::fs::write(&bad, "# ok\nsasl.username=ebb\nsasl.password: secret\n").unwrap();
    let err = refused(&["--kafka-config-file", bad.to_str().unwrap()]);
    assert!(err.contains("line 3: a property is not KEY=VALUE"), "{err}");
    assert!(!err.contains("secret"), "{err}");
    // Without brokers there is no Kafka client to give them to.
    let out = common::serve_refused(
        &dir.path().join("refused"),
        ["--kafka-config", "linger.ms=5"],
    );
    assert!(out.contains("--kafka-brokers"), "{out}");

    let file = dir.path().join("kafka.properties");
    std::fs::write(
        &file,
        "# the producer's limit on one record\n\nproducer.message.max.bytes = 2000\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let ebb = start(
        dir.path(),
        &[
            "--runner-capacity",
            "0",
            "--kafka-brokers",
            &brokers,
            "--kafka-config-file",
            file,
            "--kafka-config",
            "client.id=ebb-test",
        ],
    );
    enqueue(
        &ebb,
        json!({ "target": "work", "payload": { "body": "small" } }),
    )
    .await;
    let big = "x".repeat(4_000);
    let failed = post(
        &ebb,
        "/runner/enqueue",
        json!({ "target": "work", "payload": { "body": big } }),
    )
    .await;
    assert!(failed.status >= 400, "{} {}", failed.status, failed.json);
    assert!(
        failed.json["error"]
            .as_str()
            .unwrap_or("")
            .contains("too large"),
        "{}",
        failed.json
    );
    assert_eq!(
        count_calls(&ebb).await,
        1,
        "the refused call recorded nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_calls_meant_for_a_runner_that_never_returns_run_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebb = start(
        dir.path(),
        &["--runner-capacity", "0", "--runner-lease-ms", "1000"],
    );
    let a = report_load(&ebb, "gone", "0/10").await;
    assert_eq!(a.status, 204);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = enqueue(&ebb, json!({ "target": "work" })).await;
        let c = get(&ebb, &format!("/v1/calls/{id}")).await;
        assert_eq!(c.json["partition"], "gone");
        ids.push(id);
    }
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    drop(ebb);
    let ebb = start(dir.path(), &["--runner-lease-ms", "1000"]);
    for id in &ids {
        wait_state(&ebb, id, "success").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_calls_leave_the_api_after_the_retention_but_stay_in_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--call-retention-ms", "300"]);
    let id = enqueue(&ebb, json!({ "target": "work" })).await;
    wait_state(&ebb, &id, "success").await;
    wait_forgotten(&ebb, std::slice::from_ref(&id)).await;
    assert_eq!(events_of(&ebb.data, &id, "CallFinished"), 1);
    assert!(
        common::events(&ebb.data)
            .iter()
            .any(|e| e["event"].get("CallsForgotten").is_some())
    );
}

/// On Kafka, calls that ended and that the retention's age forgot are not run again when their
/// messages are read again: after a restart the consumer reads its partition from its last
/// commit (an hour's interval here). Each message it meets is of a call the log does not know:
/// put longer ago than any enqueue takes to record its call (`--forgotten-after-ms`, 3 s here, 10
/// minutes by default), deleted for that. A call enqueued after the restart runs (it comes after
/// them on the one partition, so they were read by then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kafka_calls_the_age_forgot_do_not_run_again_when_their_messages_are_read_again() {
    forgotten_calls_read_again_on_kafka(Some(3_000)).await;
}

/// The same with a retention (300 ms) far shorter than the time a message takes to be taken for
/// a forgotten call's by its age (10 minutes): read again a moment later, the messages are
/// recent, and what keeps the calls from running again is that the forgetting kept them known
/// as ended by their id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kafka_calls_forgotten_sooner_than_their_messages_age_do_not_run_again() {
    forgotten_calls_read_again_on_kafka(None).await;
}

/// Calls run once, are forgotten by the retention's age (300 ms), ebb restarts and reads their
/// messages again; with `forgotten_after_ms`, only once the messages are older than that.
async fn forgotten_calls_read_again_on_kafka(forgotten_after_ms: Option<u64>) {
    let broker = common::broker().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = broker.addr.to_string();
    let mut args: Vec<String> = [
        "--kafka-brokers",
        &brokers,
        "--kafka-partitions",
        "1",
        "--kafka-commit-every-ms",
        "3600000",
        "--call-retention-ms",
        "300",
    ]
    .map(String::from)
    .to_vec();
    if let Some(ms) = forgotten_after_ms {
        args.extend(["--forgotten-after-ms".to_owned(), ms.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ebb = start(dir.path(), &args);
    // The first delete commits; those after it wait for the hour.
    let first = enqueue(&ebb, json!({ "target": "work" })).await;
    wait_state(&ebb, &first, "success").await;
    let ids = enqueue_bodies(&ebb, 3).await;
    let put_by = SystemClock.now_ms();
    all_run_once(&ebb, &ids).await;
    wait_forgotten(&ebb, &ids).await;
    match forgotten_after_ms {
        // Their messages older than `--forgotten-after-ms` when they are read again.
        Some(after) => {
            let aged = async {
                let mut tick = tokio::time::interval(Duration::from_millis(50));
                while SystemClock.now_ms() <= put_by + after {
                    tick.tick().await;
                }
            };
            tokio::time::timeout(DEADLINE, aged).await.unwrap();
        }
        // The forgetting said which stay known by their id, and since when.
        None => {
            let events = common::events(&ebb.data);
            let since: Vec<u64> = events
                .iter()
                .filter_map(|e| {
                    e["event"]["CallsForgotten"]["keep_gone"]["ended_since_ms"].as_u64()
                })
                .collect();
            assert!(
                !since.is_empty() && since.iter().all(|s| *s + 600_000 >= put_by),
                "{since:?}"
            );
        }
    }
    let mut ebb = ebb;
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    drop(ebb);

    let ebb = start(dir.path(), &args);
    let next = enqueue(&ebb, json!({ "target": "work" })).await;
    wait_state(&ebb, &next, "success").await;
    for id in &ids {
        assert_eq!(events_of(&ebb.data, id, "CallStarted"), 1, "{id} ran once");
        assert_eq!(
            events_of(&ebb.data, id, "CallQueued"),
            1,
            "{id} was not recorded again"
        );
        assert_eq!(get(&ebb, &format!("/v1/calls/{id}")).await.status, 404);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_retention_count_the_oldest_ended_calls_leave_the_api_well_before_their_age() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing runs (no runner capacity): each call is ended by its cancel, in order.
    let ebb = start(
        dir.path(),
        &["--runner-capacity", "0", "--call-retention-count", "8"],
    );
    let mut ids = Vec::new();
    for _ in 0..20 {
        let id = enqueue(&ebb, json!({ "target": "work" })).await;
        let c = post(&ebb, &format!("/v1/calls/{id}/cancel"), json!({})).await;
        assert_eq!(c.status, 200);
        ids.push(id);
        // Each ends in a millisecond of its own: calls that ended in one millisecond are
        // forgotten together, so two of them at the cut would leave fewer than 7.
        let ended_by = SystemClock.now_ms();
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        while SystemClock.now_ms() <= ended_by {
            tick.tick().await;
        }
    }
    let queued = enqueue(&ebb, json!({ "target": "work" })).await;
    // The bound holds at most 8 ended calls, the newest; a forgetting keeps 7.
    let settled = async {
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            let page = get(&ebb, "/v1/calls?state=cancelled&limit=100").await;
            let listed: Vec<String> = page.json["calls"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["id"].as_str().unwrap().to_owned())
                .collect();
            if listed.len() <= 8 {
                return listed;
            }
            tick.tick().await;
        }
    };
    let listed = tokio::time::timeout(DEADLINE, settled)
        .await
        .expect("the ended calls come within the bound");
    assert!(listed.len() >= 7, "{listed:?}");
    assert_eq!(listed, ids[ids.len() - listed.len()..], "the newest stay");
    assert_eq!(
        get(&ebb, &format!("/v1/calls/{}", ids[0])).await.status,
        404
    );
    let q = get(&ebb, &format!("/v1/calls/{queued}")).await;
    assert_eq!(
        q.json["state"], "queued",
        "a queued call is not an ended one"
    );
    // The forgetting is a decision in the log, with the bounds it kept, and the forgotten
    // calls' events stay.
    let events = common::events(&ebb.data);
    let within: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["event"]["CallsForgotten"]["within"].as_object())
        .map(|w| &w["count"])
        .collect();
    assert!(
        !within.is_empty() && within.iter().all(|c| *c == 7),
        "{within:?}"
    );
    assert_eq!(events_of(&ebb.data, &ids[0], "CallCancelled"), 1);
    // /metrics says what is kept, and how many forgotten calls are still known by their id.
    let c = common::http::client();
    let metric = |name: &'static str| common::http::sample(&c, ebb.admin, name);
    let kept = metric("ebb_retention_ended{kind=\"call\"}").await;
    assert_eq!(kept, listed.len() as u64);
    assert!(metric("ebb_retention_ended_bytes{kind=\"call\"}").await > 0);
    assert_eq!(metric("ebb_retention_gone_calls").await, 20 - kept);

    // A forgotten call is still known to have ended: enqueued again with its id (a client's
    // retry), its message is never handed out, and a start, a finish or a cancel meets a final
    // call.
    let gone = &ids[0];
    let again = post(
        &ebb,
        "/runner/enqueue",
        json!({ "target": "work", "id": gone }),
    )
    .await;
    assert_eq!(
        (again.status, again.json["id"].as_str()),
        (200, Some(gone.as_str()))
    );
    let got = dequeue(&ebb, "r1", 2_000).await;
    let handed: Vec<&str> = got.json["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        handed,
        [queued.as_str()],
        "only the queued call is handed out"
    );
    let s = start_one(&ebb, "r1", gone).await;
    assert_eq!(
        (s.status, s.json["code"].as_str()),
        (409, Some("already_final"))
    );
    let f = post(
        &ebb,
        "/runner/finish",
        json!({ "runner": "r1", "id": gone, "outcome": "success" }),
    )
    .await;
    assert_eq!(
        (f.status, f.json["state"].as_str()),
        (200, Some("cancelled"))
    );
    let c = post(&ebb, &format!("/v1/calls/{gone}/cancel"), json!({})).await;
    assert_eq!(
        (c.status, c.json["code"].as_str()),
        (409, Some("already_final"))
    );
    for kind in ["CallQueued", "CallStarted", "CallFinished"] {
        let want = usize::from(kind == "CallQueued");
        assert_eq!(events_of(&ebb.data, gone, kind), want, "{kind}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_and_running_calls_can_be_cancelled_once() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--runner-capacity", "0"]);
    let queued = enqueue(&ebb, json!({ "target": "work" })).await;
    let c = post(&ebb, &format!("/v1/calls/{queued}/cancel"), json!({})).await;
    assert_eq!(
        (c.status, c.json["state"].as_str()),
        (200, Some("cancelled"))
    );
    let none = dequeue(&ebb, "r", 300).await;
    assert_eq!(none.status, 204, "a cancelled call is never handed out");
    let again = post(&ebb, &format!("/v1/calls/{queued}/cancel"), json!({})).await;
    assert_eq!(
        (again.status, again.json["code"].as_str()),
        (409, Some("already_final"))
    );
    let unknown = post(
        &ebb,
        "/v1/calls/01890a5d-ac96-774b-bcce-b302099a8057/cancel",
        json!({}),
    )
    .await;
    assert_eq!(unknown.status, 404);

    // A running call: cancelled, and its runner's finish changes nothing.
    let running = enqueue(&ebb, json!({ "target": "work" })).await;
    let d = dequeue(&ebb, "r", 5000).await;
    assert_eq!(d.json["calls"][0]["id"], running.as_str());
    let s = start_one(&ebb, "r", &running).await;
    assert_eq!(s.status, 200);
    let c = post(&ebb, &format!("/v1/calls/{running}/cancel"), json!({})).await;
    assert_eq!(c.status, 200);
    let f = post(
        &ebb,
        "/runner/finish",
        json!({ "runner": "r", "id": running, "outcome": "success" }),
    )
    .await;
    assert_eq!(
        (f.status, f.json["state"].as_str()),
        (200, Some("cancelled"))
    );
}

/// Replica `me` of `pair`; no built-in runner.
fn replica(pair: &common::KafkaPair, me: usize) -> Ebb {
    replica_running(pair, me, 0)
}

/// [`replica`] with a built-in runner of `capacity` (none for 0).
fn replica_running(pair: &common::KafkaPair, me: usize, capacity: u32) -> Ebb {
    replica_with(pair, me, capacity, &[])
}

/// [`replica_running`] with `extra` arguments.
fn replica_with(pair: &common::KafkaPair, me: usize, capacity: u32, extra: &[&str]) -> Ebb {
    let data = pair.data(me);
    let mut args = pair.args(me);
    args.extend(
        [
            "--runner-token",
            TOKEN,
            "--kafka-partitions",
            "4",
            "--runner-capacity",
            &capacity.to_string(),
            "--visibility-timeout-ms",
            "2000",
            "--runner-lease-ms",
            "3000",
        ]
        .map(str::to_owned),
    );
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    common::serve_with(&data.join("data"), Some(&config(&data)), None, &args)
}

/// A call `id` to `work` (POST / with `body`), as its owner would put it.
fn owners_call(id: &str, body: &str) -> ebb::event::CallSpec {
    let mut spec = ebb::event::CallSpec::for_test(id);
    spec.target = "work".into();
    spec.timeout_ms = 20_000;
    spec.payload.method = "POST".into();
    spec.payload.path = "/".into();
    spec.payload.body = body.as_bytes().to_vec().into();
    spec
}

/// Puts `spec`'s message on the pair's topic as a replica would, without recording the call.
async fn put_message(pair: &common::KafkaPair, spec: &ebb::event::CallSpec) {
    use ebb::queue::Queue as _;
    let q = ebb::queue::kafka::KafkaQueue::open(
        std::sync::Arc::new(ebb::clock::SystemClock),
        ebb::queue::kafka::KafkaOptions {
            brokers: pair.broker.addr.to_string(),
            partitions: 4,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    q.put(vec![ebb::calls::message_of(spec)]).await.unwrap();
}

/// A call its owner's retention forgot (1 s, far sooner than a message is taken for a
/// forgotten call's by its age) and whose message the other replica reads again (a partition
/// read from an older commit; here the owner's message put again) is not run again: the other
/// replica asks the owner what became of it, and the owner kept it known as ended by its id.
/// (Before, the owner did not know it, the other replica held the message back, then handed it
/// out with its copy, and the owner recorded and ran the call a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kafka_a_forgotten_calls_message_read_again_by_another_replica_is_not_run() {
    let pair = common::KafkaPair::start().await;
    let e0 = replica_with(&pair, 0, 0, &["--call-retention-ms", "1000"]);
    let e1 = replica(&pair, 1);
    // The only runner is ebb-1's: every message of ebb-0's calls is read there.
    let _r1 = runner(&e1, "r1", None);
    let key = uuid::Uuid::new_v4().simple().to_string();
    let call =
        |body: &str| json!({ "target": "work", "partition": key, "payload": { "body": body } });
    let id = enqueue(&e0, call("once")).await;
    wait_state(&e0, &id, "success").await;
    wait_forgotten(&e0, std::slice::from_ref(&id)).await;
    // Its message again, as ebb-0 put it, on the call's partition.
    let mut spec = owners_call(&id, "once");
    spec.partition = Some(key.clone());
    put_message(&pair, &spec).await;
    // A call after it on the same partition runs; by then the message was read, and once
    // ebb-1 holds no message it was dealt with.
    let next = enqueue(&e0, call("next")).await;
    wait_state(&e0, &next, "success").await;
    let c = common::http::client();
    wait_until(
        "ebb-1 holds no message",
        Duration::from_secs(60),
        || async {
            let held =
                common::http::sample(&c, e1.admin, "ebb_queue_messages{state=\"reserved\"}").await;
            let ready =
                common::http::sample(&c, e1.admin, "ebb_queue_messages{state=\"ready\"}").await;
            (held + ready == 0).then_some(())
        },
    )
    .await;
    // ebb-1's runner's consumer was given the topic's 4 partitions; ebb-0 has no consumer.
    let assigned = "ebb_queue_partitions_moved_total{way=\"assigned\"}";
    assert!(common::http::sample(&c, e1.admin, assigned).await >= 4);
    assert_eq!(common::http::sample(&c, e0.admin, assigned).await, 0);
    assert_eq!(events_of(&e0.data, &id, "CallStarted"), 1, "{id} ran once");
    assert_eq!(
        events_of(&e0.data, &id, "CallQueued"),
        1,
        "not recorded again"
    );
    assert_eq!(events_of(&e1.data, &id, "CallQueued"), 0);
}

/// An owner that put a call's message but records the call only after every other replica
/// has stopped holding the message back (its record stalled): the replica that hands the
/// message out sends the owner its copy with the start, the owner records the call from it,
/// and the call runs. (Before, the owner refused the start as unknown, the message was
/// deleted, and the owner's late record left an acknowledged call no runner could get.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_owner_records_it_late_still_runs_on_kafka() {
    let pair = common::KafkaPair::start().await;
    let e0 = replica(&pair, 0);
    let e1 = replica(&pair, 1);
    // ebb-0's put, without its record: the message as ebb-0 puts it, on the shared topic.
    let id = format!("ebb-0.{}", uuid::Uuid::now_v7().hyphenated());
    put_message(&pair, &owners_call(&id, "late")).await;
    // The only runner is ebb-1's: ebb-0 never hands the message out itself.
    let _r1 = runner(&e1, "r1", None);
    let ran = wait_until(
        "the late-recorded call ran",
        Duration::from_secs(90),
        || async {
            let a = get(&e0, &format!("/v1/calls/{id}")).await;
            (a.status == 200 && a.json["state"] == "success").then_some(a.json)
        },
    )
    .await;
    assert_eq!(ran["runner"], "r1", "{ran}");
    assert_eq!(events_of(&e0.data, &id, "CallQueued"), 1);
    assert_eq!(events_of(&e0.data, &id, "CallStarted"), 1);
    assert_eq!(
        events_of(&e1.data, &id, "CallQueued"),
        0,
        "only the owner records it"
    );
}

/// Each replica's built-in runner takes calls from the shared topic, its own replica's and the
/// other's (whose starts and finishes go to their owner). The calls name partition keys: one
/// that names none goes to its own replica's runner whenever that one waits for work, so which
/// runner takes it would be the timing's choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_runners_of_two_replicas_both_take_calls_on_kafka() {
    let pair = common::KafkaPair::start().await;
    let e = [replica_running(&pair, 0, 4), replica_running(&pair, 1, 4)];
    let clock = ebb::clock::Stopwatch::start();
    let mut ran_on = std::collections::BTreeMap::<String, usize>::new();
    let mut owners = std::collections::BTreeSet::new();
    while ran_on.len() < 2 || owners.len() < 2 {
        assert!(
            clock.elapsed() < Duration::from_secs(90),
            "calls ran only on {ran_on:?}, owned by {owners:?}"
        );
        for i in 0..2 {
            let mut ids = Vec::new();
            for _ in 0..4 {
                let key = uuid::Uuid::new_v4().simple().to_string();
                let body = json!({ "target": "work", "partition": key });
                ids.push(enqueue(&e[i], body).await);
            }
            for id in ids {
                wait_state(&e[0], &id, "success").await;
                let c = get(&e[1], &format!("/v1/calls/{id}")).await;
                let runner = c.json["runner"].as_str().unwrap_or_default().to_owned();
                assert!(runner.starts_with("builtin-ebb-"), "{}", c.json);
                if runner != format!("builtin-ebb-{i}") {
                    owners.insert(i);
                }
                *ran_on.entry(runner).or_default() += 1;
            }
        }
    }
    eprintln!("calls by runner: {ran_on:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_calls_on_kafka_and_only_the_owner_decides() {
    let pair = common::KafkaPair::start().await;
    let mut e0 = replica(&pair, 0);
    let e1 = replica(&pair, 1);
    // One runner, on ebb-1: every call ebb-0 accepts runs there, its start and finish decided by
    // ebb-0 through forwarding.
    let _r1 = runner(&e1, "r1", None);
    let mut ids = enqueue_bodies(&e0, 10).await;
    ids.extend(enqueue_bodies(&e1, 10).await);
    for (i, id) in ids.iter().enumerate() {
        let owner = if i < 10 { "ebb-0." } else { "ebb-1." };
        assert!(id.starts_with(owner), "{id} names its owner");
    }
    for id in &ids {
        wait_state(&e0, id, "success").await;
    }
    for id in &ids {
        // Both replicas answer the same for every call (the other one through the owner).
        let (a, b) = (
            get(&e0, &format!("/v1/calls/{id}")).await,
            get(&e1, &format!("/v1/calls/{id}")).await,
        );
        assert_eq!((a.status, &a.json), (b.status, &b.json), "{id}");
        assert_eq!(a.json["runner"], "r1");
        // Only the owner's log has the call.
        let (owner, other) = if id.starts_with("ebb-0.") {
            (&e0, &e1)
        } else {
            (&e1, &e0)
        };
        assert_eq!(events_of(&owner.data, id, "CallStarted"), 1, "{id}");
        assert_eq!(events_of(&other.data, id, "CallQueued"), 0, "{id}");
    }

    // The owner SIGKILLed while its calls are being run elsewhere, then restarted: nobody
    // decides for it meanwhile, and every call it acknowledged ends, started once.
    let more = enqueue_bodies(&e0, 20).await;
    e0.child.kill().unwrap();
    e0.child.wait().unwrap();
    let down = get(&e1, &format!("/v1/calls/{}", more[0])).await;
    assert_eq!(
        (down.status, down.json["code"].as_str()),
        (503, Some("owner_unavailable")),
        "{}",
        down.json
    );
    assert!(down.headers.contains_key("retry-after"));
    drop(e0);
    let e0 = replica(&pair, 0);
    // Every call ends (a start whose answer died with the owner ends `timeout`, never runs
    // twice).
    all_end(&e1, &more).await;
    for id in more.iter().chain(&ids[..10]) {
        assert_eq!(
            events_of(&e0.data, id, "CallStarted"),
            1,
            "{id} started once"
        );
    }
    // A request that names another owner and comes forwarded is refused, never forwarded on.
    let misdirected = call_api(
        &e1,
        "GET",
        &format!("/v1/calls/{}", more[0]),
        Some(TOKEN),
        None,
        &[("x-ebb-forwarded-by", "ebb-0")],
    )
    .await;
    assert_eq!(misdirected.status, 421, "{}", misdirected.json);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_kafka_a_busy_runners_partitions_go_to_a_runner_that_asks() {
    let broker = common::broker().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = broker.addr.to_string();
    // Runners stay live long after they last asked (the lease would free a silent runner's
    // partitions too, later).
    let ebb = start_on_kafka(dir.path(), &brokers, "300000");
    // One runner, full with one long call: its consumer has every partition and stops asking.
    let _busy = runner_of(&ebb, "busy", 1, None);
    let long = enqueue(
        &ebb,
        json!({ "target": "work", "timeout_ms": 120_000, "payload": { "method": "GET", "path": "/sleep?ms=60000" } }),
    )
    .await;
    wait_state(&ebb, &long, "running").await;
    // Calls keyed by their ids spread over the partitions; a second runner joins. The busy
    // runner's partitions go to it rather than wait for the long call.
    let ids = enqueue_bodies(&ebb, 12).await;
    let _free = runner_of(&ebb, "free", 4, None);
    for id in &ids {
        wait_state(&ebb, id, "success").await;
        let c = get(&ebb, &format!("/v1/calls/{id}")).await;
        let l = get(&ebb, &format!("/v1/calls/{long}")).await;
        assert_eq!(
            c.json["runner"], "free",
            "{} / the long call: {}",
            c.json, l.json
        );
    }
    assert_eq!(
        state(&ebb, &long).await,
        "running",
        "the short calls did not wait for the long one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_kafka_broker_and_ebb_restarts_lose_no_call_and_run_none_twice() {
    let mut broker = common::broker().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = broker.addr.to_string();
    let (proxy, admin) = (
        format!("127.0.0.1:{}", common::free_port()),
        format!("127.0.0.1:{}", common::free_port()),
    );
    let args = [
        "--runner-capacity",
        "0",
        "--kafka-brokers",
        &brokers,
        "--kafka-partitions",
        "4",
        "--listen",
        &proxy,
        "--admin-listen",
        &admin,
    ];
    let mut ebb = start(dir.path(), &args);
    let long = enqueue(
        &ebb,
        json!({ "target": "work", "payload": { "method": "GET", "path": "/sleep?ms=3000" } }),
    )
    .await;
    let mut ids = enqueue_bodies(&ebb, 10).await;
    // The broker killed and back on its data: every acknowledged call is still there.
    broker.kill();
    // Meanwhile the calls API is not ready, and says the queue is why; an enqueue is refused
    // 503 `queue_unavailable`.
    let down = wait_until(
        "the calls API unready without its broker",
        DEADLINE,
        || async {
            let r = get(&ebb, "/readyz/calls").await;
            (r.status == 503).then_some(r.json)
        },
    )
    .await;
    assert_eq!(down["checks"]["queue"]["ok"], false, "{down}");
    assert_eq!(down["checks"]["log"]["ok"], true, "{down}");
    let refused = post(&ebb, "/runner/enqueue", json!({ "target": "work" })).await;
    assert_eq!(
        (refused.status, refused.json["code"].as_str()),
        (503, Some("queue_unavailable")),
        "{}",
        refused.json
    );
    assert!(refused.headers.contains_key("retry-after"));
    // The proxy stays ready (the pod's readiness, so it stays in its Service) and serves.
    let ready = get(&ebb, "/readyz").await;
    assert_eq!(ready.status, 200, "{}", ready.json);
    assert!(
        ready.json["checks"].get("queue").is_none(),
        "{}",
        ready.json
    );
    let served = {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&proxy).await.unwrap();
        s.write_all(b"GET /pid HTTP/1.1\r\nHost: work.localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(DEADLINE, s.read_to_end(&mut out))
            .await
            .expect("the proxy answers")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    };
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    broker.start().await;
    wait_until("ebb ready with its broker back", DEADLINE, || async {
        (get(&ebb, "/readyz/calls").await.status == 200).then_some(())
    })
    .await;
    let _runner = runner(&ebb, "r", None);
    wait_state(&ebb, &long, "running").await;
    // ebb killed while the long call runs, and back: the call's message is read again from
    // Kafka (holds live in memory), held again from the log, never run twice. (Calls under way
    // went through ebb's proxy, which died: they end `error`, or `timeout` if their runner could
    // not report that in time; once either way.)
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    drop(ebb);
    let ebb = start(dir.path(), &args);
    let after = enqueue_bodies(&ebb, 5).await;
    for id in &after {
        wait_state(&ebb, id, "success").await;
    }
    ids.extend(after);
    ids.push(long);
    all_end(&ebb, &ids).await;
    for id in &ids {
        assert_eq!(events_of(&ebb.data, id, "CallStarted"), 1, "{id}");
    }
}

/// `/metrics` counts the start requests served and the calls they asked to start: their ratio
/// is how many calls runners start at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_start_requests_and_the_calls_they_ask_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &["--runner-capacity", "0"]);
    let sample = |name: &'static str| async move {
        common::http::sample(&common::http::client(), ebb.admin, name).await
    };
    assert_eq!(sample("ebb_call_start_requests_total").await, 0);
    let ids = enqueue_bodies(&ebb, 3).await;
    let mut handed = Vec::new();
    while handed.len() < ids.len() {
        let d = dequeue_up_to(&ebb, "r1", 3, 5000).await;
        assert_eq!(d.status, 200, "{}", d.json);
        for c in d.json["calls"].as_array().unwrap() {
            handed.push(c["id"].as_str().unwrap().to_owned());
        }
    }
    let s = post(&ebb, "/runner/start", json!({ "runner": "r1", "ids": ids })).await;
    assert_eq!(s.status, 200, "{}", s.json);
    let started = s.json["results"].as_array().unwrap();
    assert!(started.iter().all(|r| r["started"] == true), "{}", s.json);
    assert_eq!(started.len(), 3);
    let again = start_one(&ebb, "r1", &ids[0]).await;
    assert_eq!(again.status, 409, "{}", again.json);
    assert_eq!(sample("ebb_call_start_requests_total").await, 2);
    assert_eq!(sample("ebb_call_start_request_calls_total").await, 4);
}
