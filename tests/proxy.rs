//! The scale-to-zero proxy end to end: `ebb serve` with an `ebb.toml`, real app processes
//! (`ebb example-app`), real HTTP over loopback.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const DEADLINE: Duration = Duration::from_secs(60);

use crate::common;

use common::Ebb;

fn write_config(dir: &Path, apps: &str) -> PathBuf {
    let path = dir.join("ebb.toml");
    std::fs::write(&path, apps).unwrap();
    path
}

/// An app running `ebb example-app` with `args`, plus extra TOML lines.
fn app_with(name: &str, args: &[&str], extra: &str) -> String {
    let mut command = vec!["\"ebb\"".to_owned(), "\"example-app\"".to_owned()];
    command.extend(args.iter().map(|a| format!("\"{a}\"")));
    format!(
        "[[app]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\ncommand = [{}]\nstartup_timeout_ms = 20000\n{extra}\n",
        command.join(", ")
    )
}

fn app(name: &str, extra: &str) -> String {
    app_with(name, &[], extra)
}

fn start(dir: &Path, config: &Path) -> Ebb {
    common::serve(&dir.join("data"), Some(config), None)
}

use common::http::{Answer, client};
use common::{alive, children_with};

async fn get(c: &common::http::Http, proxy: SocketAddr, host: &str, path: &str) -> Answer {
    common::http::send(c, proxy, "GET", host, path, &[]).await
}

/// Polls `cond` until it holds or the deadline passes.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let wait = async {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        while !cond() {
            tick.tick().await;
        }
    };
    tokio::time::timeout(DEADLINE, wait)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen in time"));
}

fn spawns(data: &Path, app: &str) -> usize {
    std::fs::read_dir(data.join("workloads").join(app)).map_or(0, |d| d.count())
}

use common::controlplane::wait_until;
use common::events;

fn count(
    events: &[serde_json::Value],
    name: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> usize {
    events
        .iter()
        .filter(|e| e["event"].get(name).is_some_and(&pred))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_cold_requests_spawn_once_and_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &write_config(dir.path(), &app("demo", "")));
    let c = client();
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let c = c.clone();
            let proxy = ebb.proxy;
            tokio::spawn(async move { get(&c, proxy, "Demo.Localhost:8080", "/pid").await })
        })
        .collect();
    let mut pids = BTreeSet::new();
    for t in tasks {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        pids.insert(a.body.trim().parse::<u32>().unwrap());
    }
    assert_eq!(pids.len(), 1, "one replica served every request");
    assert_eq!(spawns(&ebb.data, "demo"), 1, "exactly one spawn");
    // The echo path sees the forwarding headers.
    let echo = get(&c, ebb.proxy, "demo.localhost", "/some/path?x=1").await;
    assert_eq!(echo.status, 200);
    assert_eq!(echo.headers["x-echo-path"], "/some/path?x=1");
    let ev = events(&ebb.data);
    assert_eq!(
        count(&ev, "ScaleRequested", |e| e["reason"] == "wake"),
        1,
        "one wake decision"
    );
    assert_eq!(count(&ev, "ScaledUp", |e| e["replicas"] == 1), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_hosts_get_404_and_unready_apps_get_503() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{}{}",
        app_with("slow", &["--never-ready"], "hold_timeout_ms = 300"),
        app_with(
            "narrow",
            &["--never-ready"],
            "hold_timeout_ms = 2000\nhold_queue_max = 1"
        ),
    );
    let ebb = start(dir.path(), &write_config(dir.path(), &config));
    let c = client();
    let a = get(&c, ebb.proxy, "nobody.example", "/").await;
    assert_eq!(a.status, 404);
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(v["code"], "unknown_host");

    let a = get(&c, ebb.proxy, "slow.localhost", "/").await;
    assert_eq!(a.status, 503);
    assert_eq!(a.headers["retry-after"], "1");
    assert!(a.body.contains("wake_timeout"), "{}", a.body);

    // Two requests, room for one: one waits (and times out), the other is refused at once.
    let (x, y) = tokio::join!(
        get(&c, ebb.proxy, "narrow.localhost", "/"),
        get(&c, ebb.proxy, "narrow.localhost", "/")
    );
    let mut codes: Vec<String> = [x, y]
        .iter()
        .map(|a| {
            assert_eq!(a.status, 503);
            serde_json::from_str::<serde_json::Value>(&a.body).unwrap()["code"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    codes.sort();
    assert_eq!(codes, ["hold_queue_full", "wake_timeout"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_apps_stop_and_wake_again_but_not_during_a_long_request() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(
        dir.path(),
        &write_config(dir.path(), &app("idle", "idle_after_ms = 300")),
    );
    let c = client();
    // A request that lasts well past idle_after keeps its replica alive and completes.
    let long = get(&c, ebb.proxy, "idle.localhost", "/sleep?ms=1500").await;
    assert_eq!(long.status, 200, "{}", long.body);
    let a = get(&c, ebb.proxy, "idle.localhost", "/pid").await;
    let pid: u32 = a.body.trim().parse().unwrap();
    assert_eq!(
        spawns(&ebb.data, "idle"),
        1,
        "the long request kept the first replica"
    );
    eventually("the idle replica stops", || !alive(pid)).await;
    let ev = events(&ebb.data);
    assert_eq!(count(&ev, "ScaleRequested", |e| e["reason"] == "idle"), 1);
    // `ebb explain` says why, from the route's last use and its idle bound.
    let story = common::ebb_ok(&ebb.data, &["explain", "route", "idle"]);
    let down = story
        .lines()
        .find(|l| l.contains("ScaleRequested   scale idle from 1 to 0: "))
        .unwrap_or_else(|| panic!("no idle scale-down in:\n{story}"));
    assert!(
        down.contains(": no request for ")
            && down.ends_with(" (it scales to zero after 300 ms idle)"),
        "{down}"
    );
    // The next request wakes it again.
    let b = get(&c, ebb.proxy, "idle.localhost", "/pid").await;
    assert_eq!(b.status, 200);
    assert_ne!(b.body.trim().parse::<u32>().unwrap(), pid);
    assert_eq!(spawns(&ebb.data, "idle"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_app_serves_the_next_request() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &write_config(dir.path(), &app("crashy", "")));
    let c = client();
    let a = get(&c, ebb.proxy, "crashy.localhost", "/pid").await;
    let pid: u32 = a.body.trim().parse().unwrap();
    let crash = get(&c, ebb.proxy, "crashy.localhost", "/crash").await;
    assert_eq!(crash.status, 502, "{}", crash.body);
    eventually("the crashed replica is gone", || !alive(pid)).await;
    let b = get(&c, ebb.proxy, "crashy.localhost", "/pid").await;
    assert_eq!(b.status, 200, "{}", b.body);
    assert_ne!(b.body.trim().parse::<u32>().unwrap(), pid);
    // The crash is in the log, with what happened.
    eventually("the crash is logged", || {
        count(&events(&ebb.data), "ScaleFailed", |e| {
            e["error"].as_str().is_some_and(|m| m.contains("exited"))
        }) >= 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_ebb_leaves_no_app_and_a_restart_rebuilds_the_routes() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &app("keep", ""));
    let mut ebb = start(dir.path(), &config);
    let c = client();
    let a = get(&c, ebb.proxy, "keep.localhost", "/pid").await;
    let pid: u32 = a.body.trim().parse().unwrap();
    // Let the traffic reach the log, then kill ebb without warning.
    eventually("traffic is flushed", || {
        count(&events(&ebb.data), "RequestsSeen", |_| true) > 0
    })
    .await;
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    eventually("the app dies with ebb", || !alive(pid)).await;

    let replay = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args(["replay", "--json", "--data-dir"])
        .arg(&ebb.data)
        .output()
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&replay.stdout).unwrap();
    let route = &state["routes"]["by_name"]["keep"];
    assert_eq!(route["spec"]["domains"][0], "keep.localhost");
    assert!(route["last_used_ms"].as_u64().unwrap() > 0);

    drop(ebb);
    let ebb = start(dir.path(), &config);
    let ev = events(&ebb.data);
    assert_eq!(
        count(&ev, "ScaleRequested", |e| e["reason"] == "restart"),
        1
    );
    assert_eq!(
        count(&ev, "RouteUpserted", |_| true),
        1,
        "an unchanged route is not logged again"
    );
    let b = get(&c, ebb.proxy, "keep.localhost", "/pid").await;
    assert_eq!(b.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websockets_pass_through_and_keep_their_app_awake() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;

    let dir = tempfile::tempdir().unwrap();
    let ebb = start(
        dir.path(),
        &write_config(dir.path(), &app("ws", "idle_after_ms = 300")),
    );
    let mut req = format!("ws://{}/ws", ebb.proxy)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("host", "ws.localhost".parse().unwrap());
    let (mut ws, resp) = tokio_tungstenite::connect_async(req).await.unwrap();
    assert_eq!(resp.status(), 101);
    // Messages over more than three times idle_after: the open socket keeps the app alive.
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    for i in 0..20 {
        tick.tick().await;
        ws.send(Message::text(format!("hello {i}"))).await.unwrap();
        let back = ws.next().await.unwrap().unwrap();
        assert_eq!(back, Message::text(format!("hello {i}")));
    }
    ws.send(Message::binary(vec![1u8, 2, 3])).await.unwrap();
    assert_eq!(
        ws.next().await.unwrap().unwrap(),
        Message::binary(vec![1u8, 2, 3])
    );
    ws.close(None).await.unwrap();
    assert_eq!(spawns(&ebb.data, "ws"), 1);
}

/// The body of a streamed upload: `chunks` chunks of `chunk` bytes, byte `i` of each `i % 253`.
fn upload(
    chunk: usize,
    chunks: usize,
) -> http_body_util::StreamBody<
    impl futures_util::Stream<Item = Result<hyper::body::Frame<Bytes>, std::convert::Infallible>>,
> {
    let data = Bytes::from((0..chunk).map(|i| (i % 253) as u8).collect::<Vec<u8>>());
    http_body_util::StreamBody::new(futures_util::stream::iter(
        (0..chunks).map(move |_| Ok(hyper::body::Frame::data(data.clone()))),
    ))
}

/// Reads an echo of [`upload`]`(chunk, chunks)` to its end, and checks it came back whole.
async fn echoed_whole(mut body: hyper::body::Incoming, chunk: usize, chunks: usize) {
    let (mut got, mut sum) = (0usize, 0u64);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            sum += data.iter().map(|&b| u64::from(b)).sum::<u64>();
            got += data.len();
        }
    }
    assert_eq!(got, chunk * chunks);
    let per_chunk: u64 = (0..chunk).map(|i| (i % 253) as u64).sum();
    assert_eq!(sum, per_chunk * chunks as u64, "the bytes came back intact");
}

fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_megabytes_stream_both_ways_in_bounded_memory() {
    use http_body_util::StreamBody;

    const CHUNK: usize = 64 * 1024;
    const CHUNKS: usize = 1_600; // 100 MiB
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &write_config(dir.path(), &app("big", "")));

    // Wake the app first, so the baseline includes ebb's steady state.
    let c = client();
    assert_eq!(
        get(&c, ebb.proxy, "big.localhost", "/health").await.status,
        200
    );
    let baseline = peak_rss_kib(ebb.child.id());

    // Download.
    let req = hyper::Request::get(format!("http://{}/bytes?n={}", ebb.proxy, CHUNK * CHUNKS))
        .header("host", "big.localhost")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let mut body = c.request(req).await.unwrap().into_body();
    let mut got = 0usize;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            got += data.len();
        }
    }
    assert_eq!(got, CHUNK * CHUNKS);

    // Upload, echoed back while it is still being sent.
    let streaming: Client<HttpConnector, StreamBody<_>> =
        Client::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::post(format!("http://{}/upload", ebb.proxy))
        .header("host", "big.localhost")
        .body(upload(CHUNK, CHUNKS))
        .unwrap();
    let resp = streaming.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    echoed_whole(resp.into_body(), CHUNK, CHUNKS).await;
    // Neither body was held whole in ebb's memory: its peak grew by less than half of one.
    let peak = peak_rss_kib(ebb.child.id());
    eprintln!("ebb peak RSS: {baseline} KiB before, {peak} KiB after 2 x 100 MiB");
    assert!(
        peak - baseline < 48 * 1024,
        "ebb's peak RSS grew from {baseline} to {peak} KiB for 2 x 100 MiB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &write_config(dir.path(), &app("h2", "")));
    // HTTP/2 with prior knowledge, the host in :authority as h2 clients send it.
    let mut sender = common::http::h2c(ebb.proxy).await;
    let mut send = |uri: &str, host: Option<&str>| {
        let mut req = hyper::Request::post(uri);
        if let Some(h) = host {
            req = req.header("host", h);
        }
        sender.send_request(req.body(Full::new(Bytes::from_static(b"ping"))).unwrap())
    };
    let resp = send("http://h2.localhost/over/h2", None).await.unwrap();
    assert_eq!(resp.version(), hyper::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-echo-path"], "/over/h2");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"ping");
    // A Host header that names another host than :authority is refused (RFC 9113 section 8.3.1).
    let resp = send("http://h2.localhost/", Some("other.localhost"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["code"], "bad_host");

    // A body larger than every flow-control window on the way (ebb's 1 MiB a stream, the
    // client's), streamed up and echoed back while still being sent.
    const CHUNK: usize = 64 * 1024;
    const CHUNKS: usize = 128; // 8 MiB
    let mut streaming = common::http::h2c(ebb.proxy).await;
    let req = hyper::Request::post("http://h2.localhost/upload")
        .body(upload(CHUNK, CHUNKS))
        .unwrap();
    let resp = streaming.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    echoed_whole(resp.into_body(), CHUNK, CHUNKS).await;

    // A download the client gives up on (its stream reset) leaves the connection serving.
    let req = hyper::Request::get("http://h2.localhost/bytes?n=1073741824")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    assert!(body.frame().await.unwrap().unwrap().is_data());
    drop(body);
    let req = hyper::Request::get("http://h2.localhost/after/reset")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-echo-path"], "/after/reset");
}

/// An h2c connection is not idle while a request is under way, however long it takes: a
/// request three times the client idle bound is answered whole; once idle past the bound the
/// connection ends (GOAWAY, then closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_connection_ends_once_idle_but_not_under_a_long_request() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&write_config(dir.path(), &app("h2", ""))),
        None,
        &["--client-idle-timeout-ms", "300"],
    );
    let mut sender = common::http::h2c(ebb.proxy).await;
    let req = hyper::Request::get("http://h2.localhost/sleep?ms=900")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();
    eventually("the idle h2c connection is closed", || sender.is_closed()).await;
}

/// A burst of HTTP/2 requests makes ebb open many HTTP/1.1 connections to the app, some left
/// opening in the background once idle ones came back; a gRPC call to the same replica right
/// after goes on over its own HTTP/2 connection at once instead of waiting behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_after_a_burst_of_http2_requests_is_not_held_behind_their_connections() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &write_config(dir.path(), &app("mix", "")));
    let burst = common::http::h2c(ebb.proxy).await;
    let mut answers = Vec::new();
    for i in 0..400 {
        let mut sender = burst.clone();
        answers.push(tokio::spawn(async move {
            let req = hyper::Request::get(format!("http://mix.localhost/burst/{i}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            sender.send_request(req).await.map(|r| r.status())
        }));
    }
    for a in answers {
        assert_eq!(a.await.unwrap().unwrap(), 200);
    }
    // HelloRequest { name: "world" }, which the example app echoes as the reply.
    let mut grpc = common::http::h2c(ebb.proxy).await;
    let req = hyper::Request::post("http://mix.localhost/helloworld.Greeter/SayHello")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\x07\x0a\x05world")))
        .unwrap();
    // A bound on liveness, not a measure: the call waited for seconds before the fix.
    let resp = tokio::time::timeout(Duration::from_secs(5), async {
        let resp = grpc.send_request(req).await.unwrap();
        let status = resp.status();
        let collected = resp.into_body().collect().await.unwrap();
        (status, collected.trailers().cloned(), collected.to_bytes())
    })
    .await
    .expect("the gRPC call is answered, not held behind the burst's connections");
    assert_eq!(resp.0, 200);
    assert_eq!(resp.1.unwrap()["grpc-status"], "0");
    assert_eq!(&resp.2[..], b"\0\0\0\0\x07\x0a\x05world");
}

/// Requests paced just slower than `idle_after`, so the downscaler keeps stopping the app between
/// them while the next request is already on its way: every request still gets the app's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_across_scale_downs_all_get_the_apps_answer() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(
        dir.path(),
        &write_config(
            dir.path(),
            &app("edge", "idle_after_ms = 10\nstop_grace_ms = 100"),
        ),
    );
    let c = client();
    let mut pace = tokio::time::interval(Duration::from_millis(30));
    let mut pids = BTreeSet::new();
    for i in 0..100 {
        pace.tick().await;
        let a = get(&c, ebb.proxy, "edge.localhost", "/pid").await;
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
        pids.insert(a.body.trim().parse::<u32>().unwrap());
    }
    let ev = events(&ebb.data);
    let downs = count(&ev, "ScaleRequested", |e| e["reason"] == "idle");
    assert!(downs >= 1, "the pacing caused no scale-down");
    assert!(
        pids.len() >= 2,
        "the app was woken again after a scale-down"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_stops_the_apps_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebb = start(dir.path(), &write_config(dir.path(), &app("bye", "")));
    let c = client();
    let a = get(&c, ebb.proxy, "bye.localhost", "/pid").await;
    let pid: u32 = a.body.trim().parse().unwrap();
    ebb.sigterm();
    let status = ebb.child.wait().unwrap();
    assert!(status.success(), "ebb exits cleanly on SIGTERM: {status}");
    assert!(!alive(pid), "the app stopped with ebb");
    let ev = events(&ebb.data);
    assert_eq!(
        count(&ev, "ScaleRequested", |e| e["reason"] == "shutdown"),
        1
    );
    assert_eq!(count(&ev, "ScaledDown", |e| e["replicas"] == 0), 1);
    assert_eq!(
        count(&ev, "RequestsSeen", |_| true),
        1,
        "traffic flushed on the way out"
    );
}

/// SIGTERM while a request is under way and another is held for a replica still starting: ebb
/// stops accepting connections, answers both, then stops the apps and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_answers_the_requests_under_way_and_held_first() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{}{}",
        app("busy", ""),
        app_with("late", &["--startup-delay-ms", "1500"], "")
    );
    let mut ebb = start(dir.path(), &write_config(dir.path(), &config));
    let c = client();
    assert_eq!(
        get(&c, ebb.proxy, "busy.localhost", "/pid").await.status,
        200
    );
    let slow = {
        let (c, proxy) = (c.clone(), ebb.proxy);
        tokio::spawn(async move { get(&c, proxy, "busy.localhost", "/sleep?ms=1500").await })
    };
    let held = {
        let (c, proxy) = (c.clone(), ebb.proxy);
        tokio::spawn(async move { get(&c, proxy, "late.localhost", "/pid").await })
    };
    // And one over h2c, answered whole though the drain (a GOAWAY on its connection) began
    // under it.
    let mut h2 = common::http::h2c(ebb.proxy).await;
    let slow_h2 = tokio::spawn(
        h2.send_request(
            hyper::Request::get("http://busy.localhost/sleep?ms=1500")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        ),
    );
    let admin = ebb.admin;
    wait_until(
        "two requests under way and one held",
        Duration::from_secs(30),
        || {
            let c = c.clone();
            async move {
                let m = common::http::send(&c, admin, "GET", "localhost", "/metrics", &[]).await;
                (m.body
                    .contains("ebb_proxy_requests_in_flight{route=\"busy\"} 2")
                    && m.body.contains("ebb_proxy_requests_held{route=\"late\"} 1"))
                .then_some(())
            }
        },
    )
    .await;
    ebb.sigterm();
    let slow = slow.await.unwrap();
    assert_eq!((slow.status, slow.body.as_str()), (200, "slept 1500 ms\n"));
    let slow_h2 = slow_h2.await.unwrap().unwrap();
    assert_eq!(slow_h2.status(), 200);
    let body = slow_h2.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"slept 1500 ms\n");
    let held = held.await.unwrap();
    assert_eq!(held.status, 200, "{}", held.body);
    let status = ebb.child.wait().unwrap();
    assert!(status.success(), "ebb exits cleanly on SIGTERM: {status}");
}

/// One response read off a raw connection: status, headers (names lowercased), decoded body.
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Reads one response from `stream`, keeping bytes past it in `buf`. Bodies framed by
/// Content-Length or chunked; `no_body` for answers to HEAD and 1xx.
async fn read_raw(stream: &mut tokio::net::TcpStream, buf: &mut Vec<u8>, no_body: bool) -> Raw {
    use tokio::io::AsyncReadExt;
    async fn more(stream: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) {
        let mut chunk = [0u8; 16 * 1024];
        let n = tokio::time::timeout(DEADLINE, stream.read(&mut chunk))
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(
            n > 0,
            "the connection closed early: {:?}",
            String::from_utf8_lossy(buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    let (status, headers, head_len) = loop {
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Response::new(&mut hs);
        if let httparse::Status::Complete(n) = r.parse(buf).unwrap() {
            let headers = r
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_ascii_lowercase(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect::<Vec<_>>();
            break (r.code.unwrap(), headers, n);
        }
        more(stream, buf).await;
    };
    buf.drain(..head_len);
    let mut raw = Raw {
        status,
        headers,
        body: Vec::new(),
    };
    if no_body {
        return raw;
    }
    if raw.header("transfer-encoding") == Some("chunked") {
        loop {
            let line_end = loop {
                if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                more(stream, buf).await;
            };
            let size =
                usize::from_str_radix(std::str::from_utf8(&buf[..line_end]).unwrap(), 16).unwrap();
            while buf.len() < line_end + 2 + size + 2 {
                more(stream, buf).await;
            }
            raw.body
                .extend_from_slice(&buf[line_end + 2..line_end + 2 + size]);
            buf.drain(..line_end + 2 + size + 2);
            if size == 0 {
                return raw;
            }
        }
    }
    let len: usize = raw
        .header("content-length")
        .map_or(0, |v| v.parse().unwrap());
    while buf.len() < len {
        more(stream, buf).await;
    }
    raw.body = buf.drain(..len).collect();
    raw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_framing_pipelining_and_forwarding_headers_hold() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &write_config(dir.path(), &app("h1", "")));
    let mut s = tokio::net::TcpStream::connect(ebb.proxy).await.unwrap();
    let mut buf = Vec::new();

    // Four pipelined requests in one write: headers, a chunked upload, HEAD, a sized upload.
    s.write_all(
        b"GET /headers HTTP/1.1\r\nHost: H1.localhost:80\r\nX-Forwarded-For: 10.0.0.1\r\n\
          Connection: x-secret\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\n\r\n\
          POST /up HTTP/1.1\r\nHost: h1.localhost\r\nTransfer-Encoding: chunked\r\n\r\n\
          5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\n\
          HEAD /head HTTP/1.1\r\nHost: h1.localhost\r\n\r\n\
          POST /sized HTTP/1.1\r\nHost: h1.localhost\r\nContent-Length: 3\r\n\r\nabc",
    )
    .await
    .unwrap();
    let seen = read_raw(&mut s, &mut buf, false).await;
    assert_eq!(seen.status, 200);
    let seen = seen.text();
    for line in [
        "x-forwarded-for: 10.0.0.1, 127.0.0.1",
        "x-forwarded-proto: http",
        "x-forwarded-host: H1.localhost:80",
        "forwarded: for=127.0.0.1;host=\"H1.localhost:80\";proto=http",
        "host: H1.localhost:80",
    ] {
        assert!(seen.lines().any(|l| l == line), "{line:?} not in\n{seen}");
    }
    for gone in ["x-secret", "keep-alive", "connection: x-secret"] {
        assert!(!seen.contains(gone), "{gone:?} was forwarded:\n{seen}");
    }
    let up = read_raw(&mut s, &mut buf, false).await;
    assert_eq!((up.status, up.text().as_str()), (200, "hello world"));
    assert_eq!(up.header("x-echo-method"), Some("POST"));
    let head = read_raw(&mut s, &mut buf, true).await;
    assert_eq!(head.status, 200);
    assert_eq!(head.header("x-echo-method"), Some("HEAD"));
    let sized = read_raw(&mut s, &mut buf, false).await;
    assert_eq!((sized.status, sized.text().as_str()), (200, "abc"));
    assert!(buf.is_empty(), "nothing after the fourth answer");

    // An unknown Host gets a JSON 404 and the connection stays usable.
    s.write_all(b"GET / HTTP/1.1\r\nHost: nobody.example\r\n\r\n")
        .await
        .unwrap();
    let nobody = read_raw(&mut s, &mut buf, false).await;
    assert_eq!(nobody.status, 404);
    let v: serde_json::Value = serde_json::from_slice(&nobody.body).unwrap();
    assert_eq!(v["code"], "unknown_host");

    // Expect: 100-continue: the interim answer comes through before the body is sent.
    s.write_all(
        b"PUT /count HTTP/1.1\r\nHost: h1.localhost\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
    )
    .await
    .unwrap();
    let interim = read_raw(&mut s, &mut buf, true).await;
    assert_eq!(interim.status, 100);
    s.write_all(b"howdy").await.unwrap();
    let done = read_raw(&mut s, &mut buf, false).await;
    assert_eq!((done.status, done.text().as_str()), (200, "5 bytes\n"));

    // `Connection` naming Content-Length does not take the body's framing away from the backend.
    s.write_all(
        b"POST /count HTTP/1.1\r\nHost: h1.localhost\r\nContent-Length: 5\r\nConnection: content-length, host\r\n\r\nhello",
    )
    .await
    .unwrap();
    let framed = read_raw(&mut s, &mut buf, false).await;
    assert_eq!((framed.status, framed.text().as_str()), (200, "5 bytes\n"));

    // A missing Host is a bad request.
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let bad = read_raw(&mut s, &mut buf, false).await;
    assert_eq!(bad.status, 400);

    // Connection: close is honoured.
    s.write_all(b"GET /last HTTP/1.1\r\nHost: h1.localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let last = read_raw(&mut s, &mut buf, false).await;
    assert_eq!(last.status, 200);
    assert_eq!(last.header("connection"), Some("close"));
    let mut rest = Vec::new();
    let n = tokio::time::timeout(DEADLINE, s.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0, "the proxy closed the connection");

    // HTTP/1.0 goes through the general path.
    let mut s = tokio::net::TcpStream::connect(ebb.proxy).await.unwrap();
    s.write_all(b"GET /old HTTP/1.0\r\nHost: h1.localhost\r\n\r\n")
        .await
        .unwrap();
    let mut old = Vec::new();
    tokio::time::timeout(DEADLINE, s.read_to_end(&mut old))
        .await
        .unwrap()
        .unwrap();
    let old = String::from_utf8_lossy(&old);
    assert!(old.starts_with("HTTP/1.0 200"), "{old}");
    assert!(old.contains("x-echo-path: /old"), "{old}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_to_an_unread_upload_reaches_the_client() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let ebb = start(dir.path(), &write_config(dir.path(), &app("early", "")));
    for _ in 0..5 {
        let s = tokio::net::TcpStream::connect(ebb.proxy).await.unwrap();
        let (mut rd, mut wr) = s.into_split();
        // /health takes GET only: the app answers 405 without reading the 50 MB it was promised,
        // while the client keeps sending them.
        let sender = tokio::spawn(async move {
            let head = b"POST /health HTTP/1.1\r\nHost: early.localhost\r\nContent-Length: 50000000\r\n\r\n";
            if wr.write_all(head).await.is_err() {
                return;
            }
            let chunk = vec![b'x'; 64 * 1024];
            for _ in 0..(50_000_000 / chunk.len()) {
                if wr.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        });
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        let read = async {
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match rd.read(&mut chunk).await {
                    Ok(0) => break,
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                    Err(e) => panic!("the answer was lost to {e}; read so far: {got:?}"),
                }
            }
        };
        tokio::time::timeout(DEADLINE, read).await.unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 405"), "{text}");
        sender.abort();
    }
}

/// `X-Request-Id`: a client's usable id reaches the app as it is, a missing or unusable one is
/// replaced by one ebb makes, on both paths; with `--log-format json` the lines about a held
/// request (held, woken, forwarded) are JSON objects carrying its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_reach_the_app_and_ebbs_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ebb.log");
    let config = write_config(dir.path(), &app("ids", ""));
    let ebb = common::serve_logged(
        &dir.path().join("data"),
        Some(&config),
        None,
        &["--log-format", "json"],
        &[("EBB_LOG", std::ffi::OsStr::new("info,ebb::proxy=debug"))],
        Some(&log),
    );
    let id_of = |raw: &Raw| -> Vec<String> {
        raw.text()
            .lines()
            .filter_map(|l| l.strip_prefix("x-request-id: "))
            .map(str::to_owned)
            .collect()
    };
    // The first request wakes the app: held, with the client's id.
    let (_s, _b, woke) = raw_exchange(
        ebb.proxy,
        b"GET /headers HTTP/1.1\r\nHost: ids.localhost\r\nX-Request-Id: trace-me-1\r\n\r\n",
    )
    .await;
    assert_eq!(woke.status, 200);
    assert_eq!(id_of(&woke), ["trace-me-1"]);
    for version in ["HTTP/1.1", "HTTP/1.0"] {
        let head = format!("GET /headers {version}\r\nHost: ids.localhost\r\n\r\n");
        let (_s, _b, made) = raw_exchange(ebb.proxy, head.as_bytes()).await;
        assert_eq!(made.status, 200, "{version}");
        let ids = id_of(&made);
        assert_eq!(ids.len(), 1, "{version}: {ids:?}");
        assert!(
            ids[0].len() == 32 && ids[0].bytes().all(|b| b.is_ascii_hexdigit()),
            "{version}: {ids:?}"
        );
        let head = format!(
            "GET /headers {version}\r\nHost: ids.localhost\r\nX-Request-Id: has space\r\nX-Request-Id: second-ok\r\n\r\n"
        );
        let (_s, _b, kept) = raw_exchange(ebb.proxy, head.as_bytes()).await;
        assert_eq!(id_of(&kept), ["second-ok"], "{version}");
    }
    let lines: Vec<serde_json::Value> = wait_until("the forward logged", DEADLINE, || {
        let log = log.clone();
        async move {
            let text = std::fs::read_to_string(&log).ok()?;
            let lines: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                .collect();
            lines
                .iter()
                .any(|l| l["fields"]["message"] == "forwarding")
                .then_some(lines)
        }
    })
    .await;
    let about: Vec<&str> = lines
        .iter()
        .filter(|l| l["span"]["id"] == "trace-me-1")
        .filter_map(|l| l["fields"]["message"].as_str())
        .collect();
    for said in ["held: no replica is free; waiting", "woken", "forwarding"] {
        assert!(
            about.iter().any(|m| m.starts_with(said)),
            "{said:?} not among the request's lines {about:?}"
        );
    }
}

/// Sends `head` on a fresh connection and reads one answer.
async fn raw_exchange(proxy: SocketAddr, head: &[u8]) -> (tokio::net::TcpStream, Vec<u8>, Raw) {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(head).await.unwrap();
    let mut buf = Vec::new();
    let raw = read_raw(&mut s, &mut buf, false).await;
    (s, buf, raw)
}

/// Whether the proxy closes `s` (after any bytes still in flight) within the deadline.
async fn closed(s: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut rest = Vec::new();
    matches!(
        tokio::time::timeout(DEADLINE, s.read_to_end(&mut rest)).await,
        Ok(Ok(_)) | Ok(Err(_))
    )
}

fn code(raw: &Raw) -> String {
    let v: serde_json::Value = serde_json::from_slice(&raw.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", raw.text()));
    v["code"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_heads_are_refused_and_absolute_targets_win_on_both_paths() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let apps = format!("{}{}", app("edge", ""), app("other", ""));
    let ebb = start(dir.path(), &write_config(dir.path(), &apps));
    // HTTP/1.1 takes the raw-socket path, HTTP/1.0 the general path on hyper.
    for version in ["HTTP/1.1", "HTTP/1.0"] {
        let keep = if version == "HTTP/1.0" {
            "Connection: keep-alive\r\n"
        } else {
            ""
        };
        for (head, status, want) in [
            (
                "GET /headers {v}\r\nHost: edge.localhost\r\nHost: other.localhost\r\n{k}\r\n",
                400,
                "bad_host",
            ),
            (
                "GET /headers {v}\r\nHost: edge.localhost\r\nhost: edge.localhost\r\n{k}\r\n",
                400,
                "bad_host",
            ),
            (
                "GET / {v}\r\nHost: edge.localhost, other.localhost\r\n{k}\r\n",
                400,
                "bad_host",
            ),
            (
                "GET / {v}\r\nHost: edge localhost\r\n{k}\r\n",
                400,
                "bad_host",
            ),
            (
                "GET / {v}\r\nHost: edge.localhost:80:80\r\n{k}\r\n",
                400,
                "bad_host",
            ),
            (
                "GET / {v}\r\nHost: user@edge.localhost\r\n{k}\r\n",
                400,
                "bad_host",
            ),
            ("GET / {v}\r\n{k}\r\n", 400, "bad_host"),
            (
                "GET http://u@edge.localhost/ {v}\r\nHost: edge.localhost\r\n{k}\r\n",
                400,
                "bad_host",
            ),
            (
                "GET ftp://edge.localhost/ {v}\r\nHost: edge.localhost\r\n{k}\r\n",
                400,
                "bad_target",
            ),
            (
                "CONNECT edge.localhost:443 {v}\r\nHost: edge.localhost:443\r\n{k}\r\n",
                405,
                "method_not_allowed",
            ),
            // The target's authority wins over Host: no route has it.
            (
                "GET http://nobody.example/ {v}\r\nHost: edge.localhost\r\n{k}\r\n",
                404,
                "unknown_host",
            ),
        ] {
            let head = head.replace("{v}", version).replace("{k}", keep);
            let (mut s, mut buf, raw) = raw_exchange(ebb.proxy, head.as_bytes()).await;
            assert_eq!(raw.status, status, "{head:?}: {}", raw.text());
            assert_eq!(code(&raw), want, "{head:?}");
            if status == 405 {
                assert!(closed(&mut s).await, "{head:?}: a refused CONNECT closes");
                continue;
            }
            // A refused head without a body leaves the connection usable.
            s.write_all(
                format!("GET /pid {version}\r\nHost: edge.localhost\r\n{keep}\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let next = read_raw(&mut s, &mut buf, false).await;
            assert_eq!(next.status, 200, "{head:?} then /pid: {}", next.text());
        }

        // Absolute form: routed by the target's authority, forwarded in origin form with that
        // authority as Host, whatever Host line came with it.
        let head = format!(
            "GET http://Edge.localhost:8080/headers?x=1 {version}\r\nHost: other.localhost\r\n{keep}\r\n"
        );
        let (_s, _, raw) = raw_exchange(ebb.proxy, head.as_bytes()).await;
        assert_eq!(raw.status, 200, "{}", raw.text());
        let seen = raw.text();
        for line in [
            "host: Edge.localhost:8080",
            "x-forwarded-host: Edge.localhost:8080",
        ] {
            assert!(
                seen.lines().any(|l| l == line),
                "{version}: {line:?} not in\n{seen}"
            );
        }
        assert!(
            !seen.contains("other.localhost"),
            "{version}: the Host line leaked:\n{seen}"
        );
        let head =
            format!("GET http://edge.localhost?q=1 {version}\r\nHost: x.example\r\n{keep}\r\n");
        let (_s, _, raw) = raw_exchange(ebb.proxy, head.as_bytes()).await;
        assert_eq!(raw.status, 200, "{}", raw.text());
        assert_eq!(raw.header("x-echo-path"), Some("/?q=1"), "{version}");
    }

    // Content-Length with Transfer-Encoding (HTTP/1.1): forwarded with the transfer coding alone,
    // and the connection closed after the answer (RFC 9112 section 6.1).
    let (mut s, _, raw) = raw_exchange(
        ebb.proxy,
        b"GET /headers HTTP/1.1\r\nHost: edge.localhost\r\nContent-Length: 3\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(raw.status, 200, "{}", raw.text());
    let seen = raw.text().to_ascii_lowercase();
    assert!(seen.contains("transfer-encoding: chunked"), "{seen}");
    assert!(!seen.contains("content-length"), "{seen}");
    assert!(
        closed(&mut s).await,
        "the connection is closed after the answer"
    );
    // The same body reaches the app whole.
    let (_s, _, raw) = raw_exchange(
        ebb.proxy,
        b"POST /count HTTP/1.1\r\nHost: edge.localhost\r\nContent-Length: 3\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!((raw.status, raw.text().as_str()), (200, "5 bytes\n"));

    // Framing that cannot be trusted is refused, and the connection closed.
    for head in [
        &b"POST / HTTP/1.1\r\nHost: edge.localhost\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd"[..],
        b"POST / HTTP/1.1\r\nHost: edge.localhost\r\nTransfer-Encoding: gzip\r\n\r\nabc",
        b"POST / HTTP/1.1\r\nHost : edge.localhost\r\nContent-Length: 1\r\n\r\na",
        b"POST / HTTP/1.0\r\nHost: edge.localhost\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n",
    ] {
        let (mut s, _, raw) = raw_exchange(ebb.proxy, head).await;
        assert_eq!(raw.status, 400, "{:?}: {}", String::from_utf8_lossy(head), raw.text());
        assert!(closed(&mut s).await, "{:?}", String::from_utf8_lossy(head));
    }
}

/// `n` concurrent GETs of `path`, each on a connection of its own; every answer's status and body.
async fn burst(proxy: SocketAddr, host: &str, path: &str, n: usize) -> Vec<Answer> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let host = host.to_owned();
            let path = path.to_owned();
            tokio::spawn(async move {
                // A client per request: one connection each, as a burst of browsers would.
                let c = client();
                tokio::time::timeout(DEADLINE, get(&c, proxy, &host, &path))
                    .await
                    .expect("an answer within the deadline")
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_burst_reaches_an_app_with_a_tiny_accept_backlog_whole() {
    let dir = tempfile::tempdir().unwrap();
    let fragile = ["--backlog", "2", "--accept-delay-ms", "5"];
    let apps = format!(
        "{}{}",
        app_with("tiny", &fragile, ""),
        app_with(
            "tiny4",
            &fragile,
            "min_replicas = 4\nmax_replicas = 4\nidle_replicas = 0",
        ),
    );
    let ebb = start(dir.path(), &write_config(dir.path(), &apps));
    for (name, replicas) in [("tiny", 1), ("tiny4", 4)] {
        let answers = burst(ebb.proxy, &format!("{name}.localhost"), "/pid", 500).await;
        let mut pids = BTreeSet::new();
        for a in &answers {
            assert_eq!(a.status, 200, "{name}: {}", a.body);
            pids.insert(a.body.trim().parse::<u32>().unwrap());
        }
        assert!(pids.len() <= replicas, "{name}: {pids:?}");
        assert_eq!(spawns(&ebb.data, name), replicas, "{name}: one wake");
    }
    let ev = events(&ebb.data);
    assert_eq!(
        count(&ev, "ScaleRequested", |e| e["reason"] == "wake"),
        2,
        "one wake per app"
    );
}

/// The processes `ebb` runs whose command line contains `needle`.
fn now_ms() -> u64 {
    use ebb::clock::Clock;
    ebb::clock::SystemClock.now_ms()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_abandons_its_request_and_the_app_still_goes_idle() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let idle = "idle_after_ms = 1000\nhold_timeout_ms = 600000";
    // held: the request waits for an app that takes long to start.
    // connecting: the app never accepts and its one-place backlog holds the readiness check's
    // connection, so ebb's connection attempts go unanswered.
    // answering: the app takes ten minutes to answer, on both forwarding paths.
    // Each app's arguments tell its process apart.
    let args: [(&str, &[&str]); 4] = [
        ("held", &["--startup-delay-ms", "1500"]),
        (
            "connecting",
            &["--backlog", "0", "--accept-delay-ms", "600000"],
        ),
        ("answering", &["--startup-delay-ms", "1"]),
        ("answering10", &["--startup-delay-ms", "2"]),
    ];
    let apps: String = args
        .iter()
        .map(|(name, a)| {
            let extra = if *name == "connecting" {
                format!("{idle}\nreadiness_path = \"\"")
            } else {
                idle.to_owned()
            };
            app_with(name, a, &extra)
        })
        .collect();
    let needle = |name: &str| {
        let (_, a) = args.iter().find(|(n, _)| *n == name).unwrap();
        format!("{} ", a.join(" "))
    };
    let ebb = start(dir.path(), &write_config(dir.path(), &apps));
    let c = client();
    let ebb_pid = ebb.child.id();
    let wake_logged = |deployment: &str| {
        count(&events(&ebb.data), "ScaleRequested", |e| {
            e["reason"] == "wake" && e["deployment"] == deployment
        }) == 1
    };
    let ready_logged = |deployment: &str| {
        count(&events(&ebb.data), "ScaledUp", |e| {
            e["deployment"] == deployment
        }) == 1
    };
    let seen = |route: &str| {
        events(&ebb.data)
            .iter()
            .filter_map(|e| e["event"].get("RequestsSeen"))
            .filter(|e| e["route"] == route)
            .map(|e| {
                (
                    e["count"].as_u64().unwrap(),
                    e["last_at_ms"].as_u64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    let send = |path: &str, host: &str, version: &str| {
        let head = format!("GET {path} {version}\r\nHost: {host}\r\n\r\n");
        let proxy = ebb.proxy;
        async move {
            let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
            s.write_all(head.as_bytes()).await.unwrap();
            s
        }
    };

    let s = send("/pid", "held.localhost", "HTTP/1.1").await;
    eventually("the held request wakes its app", || wake_logged("held")).await;
    drop(s);
    let held_left = now_ms();

    let s = send("/pid", "connecting.localhost", "HTTP/1.1").await;
    eventually("the app that never accepts is ready", || {
        ready_logged("connecting")
    })
    .await;
    eventually("the request is counted", || !seen("connecting").is_empty()).await;
    drop(s);
    let connecting_left = now_ms();

    // Warm the answering apps first, so the long request is under way at the app.
    let mut answering_left = Vec::new();
    for (name, version) in [("answering", "HTTP/1.1"), ("answering10", "HTTP/1.0")] {
        let host = format!("{name}.localhost");
        assert_eq!(get(&c, ebb.proxy, &host, "/pid").await.status, 200);
        let s = send("/sleep?ms=600000", &host, version).await;
        eventually("the long request is counted", || {
            seen(name).iter().map(|(n, _)| n).sum::<u64>() == 2
        })
        .await;
        drop(s);
        answering_left.push((name, now_ms()));
    }

    for (name, left) in [("held", held_left), ("connecting", connecting_left)]
        .into_iter()
        .chain(answering_left)
    {
        let what = format!("{name}: the app stops once idle");
        eventually(&what, || {
            count(&events(&ebb.data), "ScaleRequested", |e| {
                e["reason"] == "idle" && e["deployment"] == name
            }) == 1
        })
        .await;
        eventually(&format!("{name}: its process is gone"), || {
            children_with(ebb_pid, &needle(name)).is_empty()
        })
        .await;
        assert_eq!(spawns(&ebb.data, name), 1, "{name}");
        // No traffic was counted for the request after its client left.
        for (_, last_at_ms) in seen(name) {
            assert!(
                last_at_ms <= left,
                "{name}: traffic at {last_at_ms}, after {left}"
            );
        }
    }
    assert!(
        children_with(ebb_pid, "example-app").is_empty(),
        "every app stopped"
    );
}

/// The next response on a keep-alive connection: `None` when the connection closed before any
/// byte of it (the request was never taken: a client sends it again elsewhere); a connection
/// closed inside a response is a request cut, and fails the test.
async fn next_or_closed(stream: &mut tokio::net::TcpStream) -> Option<(u16, bool)> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    loop {
        let mut hs = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut hs);
        if let httparse::Status::Complete(n) = r.parse(&buf).unwrap() {
            let header = |name: &str| {
                r.headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).to_ascii_lowercase())
            };
            let len: usize = header("content-length").unwrap().trim().parse().unwrap();
            let close = header("connection").is_some_and(|v| v.contains("close"));
            let status = r.code.unwrap();
            while buf.len() < n + len {
                let mut chunk = [0u8; 4096];
                let k = stream.read(&mut chunk).await.unwrap_or(0);
                assert!(
                    k > 0,
                    "a response was cut: {:?}",
                    String::from_utf8_lossy(&buf)
                );
                buf.extend_from_slice(&chunk[..k]);
            }
            return Some((status, close));
        }
        let mut chunk = [0u8; 4096];
        let k = stream.read(&mut chunk).await.unwrap_or(0);
        if k == 0 {
            assert!(
                buf.is_empty(),
                "a response was cut: {:?}",
                String::from_utf8_lossy(&buf)
            );
            return None;
        }
        buf.extend_from_slice(&chunk[..k]);
    }
}

/// ebb with `extra` flags serving the app `steady.localhost`, answering already, and a client.
async fn steady(dir: &Path, extra: &[&str]) -> (Ebb, common::http::Http) {
    let config = write_config(dir, &app("steady", ""));
    let ebb = common::serve_with(&dir.join("data"), Some(&config), None, extra);
    let c = client();
    assert_eq!(
        get(&c, ebb.proxy, "steady.localhost", "/pid").await.status,
        200
    );
    (ebb, c)
}

/// SIGTERM under steady keep-alive traffic with a WebSocket open: answers from then on say
/// `Connection: close`, idle connections close at once, the tunnel is cut after its short bound
/// (`TUNNEL_DRAIN`, 1 s), and ebb exits long before its drain bound (60 s here) with no response
/// cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_under_keep_alive_load_closes_connections_instead_of_waiting() {
    use tokio::io::AsyncWriteExt;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let dir = tempfile::tempdir().unwrap();
    let (mut ebb, _) = steady(dir.path(), &["--drain-timeout-ms", "60000"]).await;
    let mut req = format!("ws://{}/ws", ebb.proxy)
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("host", "steady.localhost".parse().unwrap());
    let (ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    // Keep-alive clients, each sending its next request as soon as the last is answered.
    let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel::<()>();
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let proxy = ebb.proxy;
            let answered = answered_tx.clone();
            tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
                let mut told_to_close = false;
                loop {
                    if s.write_all(b"GET /pid HTTP/1.1\r\nHost: steady.localhost\r\n\r\n")
                        .await
                        .is_err()
                    {
                        break;
                    }
                    match next_or_closed(&mut s).await {
                        Some((status, close)) => {
                            assert_eq!(status, 200);
                            let _ = answered.send(());
                            if close {
                                told_to_close = true;
                                break;
                            }
                        }
                        None => break,
                    }
                }
                told_to_close
            })
        })
        .collect();
    drop(answered_tx);
    // The load is on.
    for _ in 0..40 {
        answered.recv().await.expect("answers");
    }
    ebb.sigterm();
    // Far sooner than the drain bound: the connections were closed, not waited for.
    let exited = wait_until(
        "ebb exits, not draining its keep-alive connections and tunnel",
        Duration::from_secs(30),
        || std::future::ready(ebb.child.try_wait().unwrap()),
    )
    .await;
    assert!(exited.success(), "{exited}");
    let mut told = 0;
    for client in clients {
        told += usize::from(client.await.expect("no response was cut"));
    }
    eprintln!("{told} of 4 keep-alive clients were told Connection: close");
    drop(ws);
}

/// `--shutdown-delay-ms`: after SIGTERM ebb goes on accepting and answering new connections
/// within its delay, `/readyz` answering 503 with the shutdown named (what routes by readiness
/// lets go of it meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_delay_keeps_serving_new_connections_while_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let (mut ebb, c) = steady(dir.path(), &["--shutdown-delay-ms", "60000"]).await;
    ebb.sigterm();
    let readyz = wait_until(
        "/readyz saying ebb shuts down",
        Duration::from_secs(30),
        || async {
            let a = get(&c, ebb.admin, "localhost", "/readyz").await;
            (a.status == 503).then_some(a.body)
        },
    )
    .await;
    let readyz: serde_json::Value = serde_json::from_str(&readyz).unwrap();
    assert_eq!(readyz["checks"]["shutdown"]["ok"], false, "{readyz}");
    // New connections are still taken and answered.
    for _ in 0..5 {
        let fresh = client();
        assert_eq!(
            get(&fresh, ebb.proxy, "steady.localhost", "/pid")
                .await
                .status,
            200
        );
    }
    assert!(
        ebb.child.try_wait().unwrap().is_none(),
        "ebb stopped within its delay"
    );
    // The delay is a minute: SIGKILL ends the test's ebb.
    ebb.child.kill().unwrap();
    let _ = ebb.child.wait();
}
