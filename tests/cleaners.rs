//! Cleaners of `ebb.toml` on one machine: ebb's own objects (apps, function templates, ended
//! calls and instances) cleaned by the same core as the Kubernetes `Cleaner`, through a real
//! `ebb serve` (RocksDB log, the example app as a child process, HTTP over loopback).

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::controlplane::wait_for;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One HTTP/1.1 GET through the proxy; the status.
async fn get(proxy: std::net::SocketAddr, host: &str) -> u16 {
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    let head = String::from_utf8_lossy(&answer);
    head.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Waits (within 30 s) until the log in `data` holds an event `name` for which `is`.
async fn logged(data: &Path, name: &str, is: impl Fn(&serde_json::Value) -> bool) {
    wait_for(
        &format!("{name} in the log"),
        Duration::from_secs(30),
        || {
            common::events(data)
                .iter()
                .any(|e| e["event"].get(name).is_some_and(&is))
        },
    )
    .await;
}

const CONFIG: &str = r#"
[[app]]
name = "preview"
domains = ["preview.localhost"]
command = ["ebb", "example-app"]
startup_timeout_ms = 20000

[[function]]
name = "tmp"
function = "upper"
serviceAddress = "127.0.0.1:9"

[[function]]
name = "kept"
function = "upper"
serviceAddress = "127.0.0.1:9"

# The preview app goes once it has served a request.
[[cleaner]]
name = "used-preview"
ttl = "0s"
retry = { period = "1s" }
conditions = ["app != null && app.status.requests >= 1"]
targets = [{ name = "app", reference = { apiVersion = "ebb.dev/v1", kind = "App", name = "preview" }, delete = true, includeWhenEvaluating = true }]

# The template tmp goes at once; kept is not selected.
[[cleaner]]
name = "tmp-function"
ttl = "0s"
retry = { period = "1s" }
targets = [{ name = "f", reference = { apiVersion = "ebb.dev/v1", kind = "Function", matchLabels = { name = "tmp" } }, delete = true, includeWhenEvaluating = true }]
conditions = ["size(f.items) == 1"]
"#;

#[tokio::test]
async fn ebb_toml_cleaners_remove_apps_and_templates_once_their_conditions_hold() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ebb.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let data = dir.path().join("data");
    let ebb = common::serve(&data, Some(&config), None);

    logged(&data, "TemplateDeleted", |e| e["name"] == "tmp").await;
    let state = common::ebb_ok(&data, &["explain", "function", "kept"]);
    assert!(state.contains("kept"), "{state}");
    // Waiting for its condition: the app has served nothing.
    logged(&data, "CleanerEvaluated", |e| {
        e["name"] == "config/used-preview" && e["reason"] == "WaitingForConditions"
    })
    .await;
    assert_eq!(get(ebb.proxy, "preview.localhost").await, 200);
    logged(&data, "RouteRemoved", |e| e["name"] == "preview").await;
    assert_eq!(get(ebb.proxy, "preview.localhost").await, 404);
    let story = common::ebb_ok(&data, &["explain", "cleaner", "config/used-preview"]);
    for step in [
        "CleanerUpserted",
        "CleanerEvaluated",
        "CleanerFiring",
        "CleanerFired",
    ] {
        assert!(story.contains(step), "{step} not in:\n{story}");
    }
    // Told in words: the firing says how late it came.
    assert!(
        story.contains("fired: its targets are released, "),
        "{story}"
    );
    // And counted from the log's tail: the preview's firing (the template's may come before
    // the metrics follow the tail), its lateness, the CEL evaluations.
    let c = common::http::client();
    common::controlplane::wait_until(
        "the preview's firing counted",
        std::time::Duration::from_secs(30),
        || async {
            let m = common::http::send(&c, ebb.admin, "GET", "localhost", "/metrics", &[]).await;
            let n = |name: &str| -> u64 {
                m.body
                    .lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                    .unwrap_or(0)
            };
            (n("ebb_cleaner_firings_total") >= 1
                && n("ebb_cleaner_firing_lateness_seconds_count") >= 1
                && n("ebb_cleaner_evaluations_total") >= 1)
                .then_some(())
        },
    )
    .await;
    // The retention is a cleaner too.
    let retention = common::ebb_ok(&data, &["explain", "cleaner", "config/retention"]);
    assert!(retention.contains("CleanerUpserted"), "{retention}");
}

#[test]
fn a_bad_cleaner_in_ebb_toml_is_a_clear_error() {
    let cases = [
        ("ttl = \"soon\"", "[]", "[]", "spec.ttl"),
        (
            "ttl = \"0s\"",
            "[{ name = \"time\", reference = { apiVersion = \"ebb.dev/v1\", kind = \"App\", name = \"a\" } }]",
            "[]",
            "named `time`",
        ),
        (
            "ttl = \"0s\"",
            "[{ name = \"x\", reference = { apiVersion = \"v1\", kind = \"ConfigMap\", name = \"a\" } }]",
            "[]",
            "is not ebb.dev/v1",
        ),
        ("ttl = \"0s\"", "[]", "[\"true &&\"]", "Syntax error"),
        (
            "ttl = \"0s\"",
            "[]",
            "[\"nosuch == 1\"]",
            "unknown variable `nosuch`",
        ),
    ];
    for (ttl, targets, conditions, needle) in cases {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("ebb.toml");
        std::fs::write(
            &config,
            format!("[[cleaner]]\nname = \"bad\"\n{ttl}\ntargets = {targets}\nconditions = {conditions}\n"),
        )
        .unwrap();
        let config = ["--config".as_ref(), config.as_os_str()];
        let err = common::serve_refused(&dir.path().join("data"), config);
        assert!(
            err.contains("cleaner \"bad\"") && err.contains(needle),
            "{needle}: {err}"
        );
    }
}
