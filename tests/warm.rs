//! Keep-warm windows and idle replicas with real processes: a window runs the app with no
//! request and lets it go idle after; a window open across a SIGKILL runs it again at the
//! restart; `idle_replicas` wakes to `min_replicas` and scales down to itself; bad windows are
//! refused in `ebb.toml` and the admin API.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common;

use common::controlplane::wait_until;
use common::{Ebb, children_with, events};

const LIMIT: Duration = Duration::from_secs(60);
const TOKEN: &str = "warm-admin-token";

fn config(dir: &Path, apps: &str) -> PathBuf {
    let path = dir.join("ebb.toml");
    std::fs::write(&path, apps).unwrap();
    path
}

fn app(name: &str, extra: &str) -> String {
    format!(
        "[[app]]\nname = \"{name}\"\ndomains = [\"{name}.localhost\"]\ncommand = [\"ebb\", \"example-app\"]\nstop_grace_ms = 2000\n{extra}\n"
    )
}

/// The app processes ebb runs (each test's ebb runs one app at a time).
fn replicas(ebb: &Ebb) -> Vec<u32> {
    children_with(ebb.child.id(), "example-app")
}

/// The events named `name` (each the event's body), in log order, with their seq.
fn named(data: &Path, name: &str) -> Vec<(u64, serde_json::Value)> {
    events(data)
        .into_iter()
        .filter_map(|e| {
            let seq = e["seq"].as_u64()?;
            e["event"].get(name).cloned().map(|b| (seq, b))
        })
        .collect()
}

fn explain(data: &Path, route: &str) -> String {
    common::ebb_ok(data, &["explain", "route", route])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_warm_window_runs_the_app_without_a_request_and_lets_it_go_idle_after() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Open every 10 s for 4 s; idle after half a second once it closes.
    let cfg = config(
        dir.path(),
        &app(
            "office",
            "idle_after_ms = 500\nwarm = [{ schedule = \"*/10 * * * * *\", for = \"4s\", min = 1 }]",
        ),
    );
    let ebb = common::serve(&data, Some(&cfg), None);
    let pid = wait_until("a window starts the app", LIMIT, || async {
        replicas(&ebb).first().copied()
    })
    .await;
    wait_until("the app stops once the window closed", LIMIT, || async {
        (!common::alive(pid)).then_some(())
    })
    .await;
    // No request was made: the window alone ran it, and idleness stopped it after the window.
    assert!(named(&data, "RequestsSeen").is_empty());
    let started = named(&data, "WarmStarted");
    let ended = named(&data, "WarmEnded");
    assert!(
        !started.is_empty() && !ended.is_empty(),
        "{started:?} {ended:?}"
    );
    let (first_start, s) = &started[0];
    assert_eq!(
        (s["route"].as_str(), s["min"].as_u64()),
        (Some("office"), Some(1))
    );
    assert!(
        ended.iter().any(|(seq, _)| seq > first_start),
        "the window closed after it opened"
    );
    let idle = named(&data, "ScaleRequested")
        .into_iter()
        .find(|(seq, e)| seq > first_start && e["reason"] == "idle")
        .expect("idleness scaled the app down once the window closed");
    assert_eq!(idle.1["to"], 0);
    let warm_scale = named(&data, "ScaleRequested")
        .into_iter()
        .any(|(_, e)| e["reason"] == "warm" || e["reason"] == "restart");
    assert!(warm_scale, "the window asked for the replica");
    let story = explain(&data, "office");
    assert!(
        story.contains("keep-warm window 1 (\"*/10 * * * * *\", for 4 s)"),
        "{story}"
    );
    assert!(story.contains("idleness decides from now on"), "{story}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_open_across_a_sigkill_runs_the_app_again_at_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Opens at every full hour for two hours: open at any time.
    let cfg = config(
        dir.path(),
        &app(
            "always",
            "idle_after_ms = 200\nwarm = [{ schedule = \"0 0 * * * *\", for = \"2h\", min = 1, timezone = \"Asia/Kathmandu\" }]",
        ),
    );
    let mut ebb = common::serve(&data, Some(&cfg), None);
    let first = wait_until("the open window runs the app at start", LIMIT, || async {
        replicas(&ebb).first().copied()
    })
    .await;
    wait_until("the window is recorded", LIMIT, || async {
        (!named(&data, "WarmStarted").is_empty()).then_some(())
    })
    .await;
    ebb.child.kill().unwrap();
    ebb.child.wait().unwrap();
    wait_until("the app dies with ebb", LIMIT, || async {
        (!common::alive(first)).then_some(())
    })
    .await;
    let ebb = common::serve(&data, Some(&cfg), None);
    let second = wait_until("the restart runs the app again", LIMIT, || async {
        replicas(&ebb).first().copied()
    })
    .await;
    assert_ne!(first, second);
    // The restart ran it for the window, not for a request: no wake was decided.
    assert!(
        named(&data, "ScaleRequested")
            .iter()
            .all(|(_, e)| e["reason"] != "wake"),
        "{:?}",
        named(&data, "ScaleRequested")
    );
    // A request is served by it, and the idle check leaves it running under the window.
    let c = common::http::client();
    let a = common::http::send(&c, ebb.proxy, "GET", "always.localhost", "/pid", &[]).await;
    assert_eq!(a.body.trim().parse::<u32>().unwrap(), second);
    assert!(
        named(&data, "ScaleRequested")
            .iter()
            .all(|(_, e)| e["reason"] != "idle"),
        "no idle scale-down while the window is open"
    );
    let story = explain(&data, "always");
    assert!(story.contains("Asia/Kathmandu"), "{story}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_replicas_decouple_the_awake_and_the_idle_count() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = config(
        dir.path(),
        &format!(
            "{}{}",
            app(
                "pool",
                "idle_after_ms = 500\nmin_replicas = 2\nmax_replicas = 2\nidle_replicas = 0"
            ),
            app("kept", "idle_after_ms = 200\nidle_replicas = 1")
        ),
    );
    let ebb = common::serve(&data, Some(&cfg), None);
    // `kept` runs from the start, with no request.
    wait_until("kept runs from the start", LIMIT, || async {
        named(&data, "ScaledUp")
            .iter()
            .any(|(_, e)| e["deployment"] == "kept")
            .then_some(())
    })
    .await;
    // `pool` does not: its idle count is 0. A request wakes it to its minimum of 2.
    assert!(
        named(&data, "ScaleRequested")
            .iter()
            .all(|(_, e)| e["deployment"] != "pool"),
        "pool is not started before a request"
    );
    let c = common::http::client();
    let a = common::http::send(&c, ebb.proxy, "GET", "pool.localhost", "/pid", &[]).await;
    assert_eq!(a.status, 200);
    wait_until("pool runs two replicas", LIMIT, || async {
        named(&data, "ScaledUp")
            .iter()
            .any(|(_, e)| e["deployment"] == "pool" && e["replicas"] == 2)
            .then_some(())
    })
    .await;
    let wake = named(&data, "ScaleRequested")
        .into_iter()
        .find(|(_, e)| e["deployment"] == "pool")
        .unwrap();
    assert_eq!(
        (wake.1["reason"].as_str(), wake.1["to"].as_u64()),
        (Some("wake"), Some(2))
    );
    wait_until("pool goes back to zero when idle", LIMIT, || async {
        named(&data, "ScaleRequested")
            .iter()
            .any(|(_, e)| e["deployment"] == "pool" && e["reason"] == "idle" && e["to"] == 0)
            .then_some(())
    })
    .await;
    // `kept` was woken by no request and is never scaled below 1.
    let b = common::http::send(&c, ebb.proxy, "GET", "kept.localhost", "/pid", &[]).await;
    assert_eq!(b.status, 200);
    assert!(
        named(&data, "ScaleRequested")
            .iter()
            .all(|(_, e)| e["deployment"] != "kept" || e["to"] == 1),
        "kept is only ever asked for 1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_windows_are_refused_in_the_config_and_the_admin_api() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, want) in [
        (
            "warm = [{ schedule = \"at eight\", for = \"1h\" }]",
            "is not a cron expression",
        ),
        (
            "warm = [{ schedule = \"0 8 * * *\", for = \"1h\", timezone = \"Mars/Olympus\" }]",
            "not an IANA time zone",
        ),
        (
            "warm = [{ schedule = \"0 8 * * *\", for = \"1h\", min = 3 }]",
            "min 3 must be between 1 and max_replicas (1)",
        ),
        (
            "warm = [{ schedule = \"0 8 * * *\", for = \"soon\" }]",
            "for: duration",
        ),
        ("idle_replicas = 4", "idle_replicas <= max_replicas"),
    ] {
        let cfg = config(dir.path(), &app("bad", extra));
        let err = common::serve_refused(
            &dir.path().join("data"),
            ["--config".as_ref(), cfg.as_os_str()],
        );
        assert!(err.contains(want), "{extra}: {err}");
    }

    let data = dir.path().join("api");
    let ebb = common::serve(&data, None, Some(TOKEN));
    let c = common::http::client();
    let auth = format!("Bearer {TOKEN}");
    let put = |body: serde_json::Value| {
        let c = c.clone();
        let auth = auth.clone();
        let admin = ebb.admin;
        async move {
            common::http::send_json(
                &c,
                admin,
                "PUT",
                "/admin/routes/shop",
                &[("authorization", auth.as_str())],
                &body,
            )
            .await
        }
    };
    let mut body = serde_json::json!({
        "domains": ["shop.localhost"],
        "command": ["ebb", "example-app"],
        "max_replicas": 2,
        "warm": [{"schedule": "0 9 * * 1-5", "for": "8h", "min": 2, "timezone": "Europe/Paris"}],
    });
    let ok = put(body.clone()).await;
    assert!(ok.status == 200 || ok.status == 201, "{}", ok.body);
    let shown = common::http::send(
        &c,
        ebb.admin,
        "GET",
        "localhost",
        "/admin/routes/shop",
        &[("authorization", auth.as_str())],
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&shown.body).unwrap();
    let warm = &v["route"]["warm"][0];
    assert_eq!(
        (
            warm["schedule"].as_str(),
            warm["for_ms"].as_u64(),
            warm["timezone"].as_str()
        ),
        (
            Some("0 9 * * 1-5"),
            Some(8 * 3_600_000),
            Some("Europe/Paris")
        ),
        "{v}"
    );
    body["warm"][0]["timezone"] = "Europe/Atlantis".into();
    let bad = put(body).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let v: serde_json::Value = serde_json::from_str(&bad.body).unwrap();
    assert_eq!(v["code"], "bad_request");
    assert!(
        v["error"].as_str().unwrap().contains("Europe/Atlantis"),
        "{v}"
    );
}
