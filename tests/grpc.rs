//! gRPC through ebb with a real gRPC server and client (Python's grpcio, no generated code): a
//! unary call and a bidirectional stream from zero, trailers passed through, the app kept awake
//! while a stream is open, and a deadline shorter than the wake answered `DEADLINE_EXCEEDED` at
//! the deadline. The test command installs grpcio into `~/.cache/ebb/pyvenv`; `EBB_PYTHON` names
//! the Python that has it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common;

use common::controlplane::wait_until;

const LIMIT: Duration = Duration::from_secs(60);

fn python() -> String {
    std::env::var("EBB_PYTHON").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("{home}/.cache/ebb/pyvenv/bin/python")
    })
}

fn script(name: &str) -> String {
    format!("{}/tests/grpc/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn config(dir: &Path) -> PathBuf {
    let app = |name: &str, delay_ms: u32| {
        format!(
            "[[app]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\ncommand = [\"{py}\", \"{server}\", \"--startup-delay-ms\", \"{delay_ms}\"]\nreadiness_path = \"\"\nidle_after_ms = 300\nstop_grace_ms = 1000\n",
            py = python(),
            server = script("echo_server.py"),
        )
    };
    let path = dir.join("ebb.toml");
    let quiet = app("quiet", 0) + "stream_idle_timeout_ms = 500\n";
    std::fs::write(&path, [app("echo", 0), app("slow", 4000), quiet].concat()).unwrap();
    path
}

/// Runs the gRPC client against ebb's proxy; its JSON line.
async fn call(proxy: std::net::SocketAddr, authority: &str, args: &[&str]) -> serde_json::Value {
    let mut cmd = Command::new(python());
    cmd.arg(script("echo_client.py"))
        .arg(proxy.to_string())
        .arg(authority)
        .args(args);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .expect("python runs (./scripts/test installs grpcio into ~/.cache/ebb/pyvenv)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the gRPC client failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_and_streaming_calls_wake_the_server_and_pass_through() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ebb = common::serve(&data, Some(&config(dir.path())), None);

    // Unary, from zero: the answer and the server's trailers.
    let v = call(ebb.proxy, "echo.localhost", &["unary", "hello"]).await;
    assert_eq!(v["code"], "OK", "{v}");
    assert_eq!(v["answer"], "HELLO", "{v}");
    assert_eq!(v["trailers"]["x-echo"], "said", "{v}");
    assert_eq!(common::scale_events(&data, "echo", "wake"), 1);
    // The call went over an h2c connection to the replica (/metrics), which ends with it (the
    // replica may be stopping already: its idle bound is short).
    let http = common::http::client();
    let (open, opened) = (
        "ebb_h2c_replica_connections",
        "ebb_h2c_replica_connections_opened_total",
    );
    assert_eq!(common::http::sample(&http, ebb.admin, opened).await, 1);
    assert!(common::http::sample(&http, ebb.admin, open).await <= 1);
    wait_until("echo goes idle", LIMIT, || async {
        (common::scale_events(&data, "echo", "idle") >= 1).then_some(())
    })
    .await;
    wait_until("the stopped replica's connection ended", LIMIT, || async {
        (common::http::sample(&http, ebb.admin, open).await == 0).then_some(())
    })
    .await;
    let idle_before = common::scale_events(&data, "echo", "idle");

    // A bidirectional stream from zero that stays open for several idle periods (a message every
    // 500 ms, idle after 300 ms): every message comes back, and the open stream keeps the server
    // awake.
    let v = call(
        ebb.proxy,
        "echo.localhost",
        &["chat", "6", "--pause-ms", "500"],
    )
    .await;
    assert_eq!(v["code"], "OK", "{v}");
    let answers: Vec<String> = (0..6).map(|i| format!("MESSAGE {i}")).collect();
    assert_eq!(v["answers"], serde_json::json!(answers), "{v}");
    assert_eq!(common::scale_events(&data, "echo", "wake"), 2);
    // No idle scale-down from the stream's wake until its last answer came.
    let last_answer_ms = v["last_answer_ms"].as_u64().unwrap();
    let events = common::events(&data);
    let woke = events
        .iter()
        .filter(|e| {
            let s = &e["event"]["ScaleRequested"];
            s["deployment"] == "echo" && s["reason"] == "wake"
        })
        .nth(1)
        .unwrap()["seq"]
        .as_u64()
        .unwrap();
    let early: Vec<_> = events
        .iter()
        .filter(|e| e["seq"].as_u64().unwrap() > woke)
        .filter(|e| e["event"]["ScaleRequested"]["reason"] == "idle")
        .filter(|e| e["at_ms"].as_u64().unwrap() < last_answer_ms)
        .collect();
    assert!(
        early.is_empty(),
        "scaled down under an open stream: {early:?}"
    );
    assert!(common::scale_events(&data, "echo", "idle") >= idle_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_shorter_than_the_wake_is_deadline_exceeded_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ebb = common::serve(&data, Some(&config(dir.path())), None);
    // The server takes 4 s to start; the call gives it half a second.
    let v = call(
        ebb.proxy,
        "slow.localhost",
        &["unary", "hi", "--deadline-s", "0.5"],
    )
    .await;
    assert_eq!(v["code"], "DEADLINE_EXCEEDED", "{v}");
    // The wake it started goes on: a patient call is answered.
    let v = call(ebb.proxy, "slow.localhost", &["unary", "again"]).await;
    assert_eq!(
        (v["code"].as_str(), v["answer"].as_str()),
        (Some("OK"), Some("AGAIN")),
        "{v}"
    );
    assert_eq!(common::scale_events(&data, "slow", "wake"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_idle_past_its_bound_is_cut_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let ebb = common::serve(&dir.path().join("data"), Some(&config(dir.path())), None);
    // Messages every 200 ms keep the stream under its 500 ms bound; 1.5 s apart, it is cut.
    let v = call(
        ebb.proxy,
        "quiet.localhost",
        &["chat", "4", "--pause-ms", "200"],
    )
    .await;
    assert_eq!(v["code"], "OK", "{v}");
    let v = call(
        ebb.proxy,
        "quiet.localhost",
        &["chat", "3", "--pause-ms", "1500"],
    )
    .await;
    assert_ne!(v["code"], "OK", "{v}");
    let c = common::http::client();
    let m = common::http::send(&c, ebb.admin, "GET", "localhost", "/metrics", &[]).await;
    assert!(
        m.body
            .contains("ebb_proxy_timeouts_total{route=\"quiet\",kind=\"stream_idle\"} 1"),
        "{}",
        m.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_tls_h2_passes_through_from_zero() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "key.pem",
            "-out",
            "cert.pem",
            "-days",
            "2",
            "-subj",
            "/CN=echo.localhost",
            "-addext",
            "subjectAltName=DNS:echo.localhost",
        ])
        .current_dir(dir.path())
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&config(dir.path())),
        None,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let ca = cert.to_str().unwrap();
    let v = call(
        ebb.proxy,
        "echo.localhost",
        &["unary", "secret", "--tls-ca", ca],
    )
    .await;
    assert_eq!(
        (v["code"].as_str(), v["answer"].as_str()),
        (Some("OK"), Some("SECRET")),
        "{v}"
    );
    let v = call(ebb.proxy, "echo.localhost", &["chat", "3", "--tls-ca", ca]).await;
    assert_eq!(v["code"], "OK", "{v}");
    assert_eq!(v["answers"][2], "MESSAGE 2", "{v}");
}
