//! Scaling on load with real processes: 40 clients without pause against an app that answers in
//! 200 ms, target concurrency 4. The route scales out to what the load needs, every request is
//! answered, then it scales back after the window and to zero after its idle time; the log
//! tells each step, and a replica taken away is drained first.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::common;

use common::controlplane::wait_until;
use common::{children_with, events};

const LIMIT: Duration = Duration::from_secs(60);
const CLIENTS: u64 = 40;
const TARGET: f64 = 4.0;
const TOKEN: &str = "scaling-admin-token";
const AUTH: (&str, &str) = ("authorization", "Bearer scaling-admin-token");

fn config(dir: &Path) -> PathBuf {
    let path = dir.join("ebb.toml");
    std::fs::write(
        &path,
        r#"[[app]]
name = "web"
domains = ["web.localhost"]
command = ["ebb", "example-app", "--answer-delay-ms", "200"]
stop_grace_ms = 5000
max_replicas = 30
idle_after_ms = 12000
load = { target_concurrency = 4, window_ms = 6000, panic_window_pct = 20 }
"#,
    )
    .unwrap();
    path
}

/// The `ScaleRequested` events, as (from, to, reason name).
fn scalings(data: &Path) -> Vec<(u64, u64, String)> {
    events(data)
        .into_iter()
        .filter_map(|e| {
            let b = e["event"].get("ScaleRequested")?.clone();
            let reason = match &b["reason"] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o.keys().next().cloned().unwrap_or_default(),
                _ => String::new(),
            };
            Some((b["from"].as_u64()?, b["to"].as_u64()?, reason))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_route_scales_out_with_its_load_answers_everything_and_comes_back_to_zero() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cfg = config(dir.path());
    let ebb = common::serve(&data, Some(&cfg), Some(TOKEN));
    let proxy = ebb.proxy;
    let stop = Arc::new(AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (stop, answered, failed) = (stop.clone(), answered.clone(), failed.clone());
        clients.push(tokio::spawn(async move {
            let c = common::http::client();
            while !stop.load(Ordering::Relaxed) {
                let a = common::http::send(&c, proxy, "GET", "web.localhost", "/", &[]).await;
                if a.status == 200 {
                    answered.fetch_add(1, Ordering::Relaxed);
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    eprintln!("answer {}: {}", a.status, a.body);
                }
            }
        }));
    }
    // The load runs 20 s (counted by the answers, not a sleep: 40 clients at 200 ms each make
    // 200 answers a second once scaled out). Meanwhile the processes follow it.
    let most = Arc::new(AtomicU64::new(0));
    let pid = ebb.child.id();
    {
        let most = most.clone();
        wait_until("20 s of load", Duration::from_secs(120), || {
            let n = children_with(pid, "example-app").len() as u64;
            most.fetch_max(n, Ordering::Relaxed);
            let done = answered.load(Ordering::Relaxed) >= 20 * 5 * CLIENTS * 7 / 10;
            async move { done.then_some(()) }
        })
        .await;
    }
    // While the load lasts, /metrics shows what the rule sees and wants.
    let admin = ebb.admin;
    let c = common::http::client();
    let shown = wait_until("the load on /metrics", LIMIT, || {
        let c = c.clone();
        async move {
            let m = common::http::send(&c, admin, "GET", "localhost", "/metrics", &[AUTH]).await;
            let wanted = m
                .body
                .lines()
                .find_map(|l| l.strip_prefix("ebb_load_replicas_wanted{route=\"web\"} "))
                .and_then(|v| v.trim().parse::<u64>().ok())?;
            (wanted >= (CLIENTS as f64 / TARGET) as u64).then_some(m.body)
        }
    })
    .await;
    assert!(
        shown.contains("ebb_load_observed{route=\"web\",metric=\"concurrency\",window=\"stable\"}")
            && shown.contains("ebb_load_target{route=\"web\",metric=\"concurrency\"} 2.8"),
        "{shown}"
    );
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0, "every request answered");
    let scaled = scalings(&data);
    let peak = scaled
        .iter()
        .filter(|(_, _, r)| r == "load")
        .map(|(_, to, _)| *to)
        .max()
        .unwrap_or(0);
    // 40 requests in flight at 4 per replica planned at 70 %: 10 replicas at the target itself,
    // 15 at the utilization.
    let at_target = (CLIENTS as f64 / TARGET).ceil() as u64;
    let planned = (CLIENTS as f64 / (TARGET * 0.7)).ceil() as u64;
    assert!(
        (at_target..=planned + 1).contains(&peak),
        "load asked for {peak} replicas, not {at_target}..={planned}: {scaled:?}"
    );
    assert!(
        most.load(Ordering::Relaxed) >= at_target,
        "{} processes ran at most",
        most.load(Ordering::Relaxed)
    );
    // With the load gone: down on load after the window, then to zero on idleness.
    wait_until("the route back at zero", LIMIT, || async {
        let s = scalings(&data);
        let down = s
            .iter()
            .any(|(from, to, r)| r == "load" && to < from && *to < peak);
        let zero = s.last().is_some_and(|(_, to, r)| *to == 0 && r == "idle");
        (down && zero && children_with(pid, "example-app").is_empty()).then_some(())
    })
    .await;
    let story = common::ebb_ok(&data, &["explain", "route", "web"]);
    eprintln!("{story}");
    assert!(
        story.contains("requests in flight per replica over the last")
            && story.contains("against a target of 4 at 70 %"),
        "{story}"
    );
    assert!(story.contains("no request for"), "{story}");
    // The dashboard's timeline has the counts asked for and ready, and the load's figures.
    let t = common::http::send(
        &c,
        admin,
        "GET",
        "localhost",
        "/ui/api/timeline?route=web",
        &[AUTH],
    )
    .await;
    assert_eq!(t.status, 200, "{}", t.body);
    let t: serde_json::Value = serde_json::from_str(&t.body).unwrap();
    let items = t["events"].as_array().cloned().unwrap_or_default();
    let on_load = items
        .iter()
        .find(|e| e["load"]["per_replica"].as_f64().is_some())
        .unwrap_or_else(|| panic!("no load figures in the timeline: {t}"));
    assert!(on_load["desired"].as_u64().is_some(), "{on_load}");
    assert!(
        on_load["text"]
            .as_str()
            .unwrap()
            .contains("requests in flight per replica"),
        "{on_load}"
    );
    assert!(
        items.iter().any(|e| e["replicas"].as_u64().is_some()),
        "{t}"
    );
}

/// The admin API takes a route's load settings, shows them, and refuses bad ones with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_takes_load_settings_and_refuses_bad_ones_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ebb = common::serve(&data, None, Some(TOKEN));
    let c = common::http::client();
    let put = |body: serde_json::Value| {
        let c = c.clone();
        let admin = ebb.admin;
        async move {
            common::http::send_json(&c, admin, "PUT", "/admin/routes/shop", &[AUTH], &body).await
        }
    };
    let route = |load: serde_json::Value| {
        serde_json::json!({
            "domains": ["shop.localhost"],
            "command": ["ebb", "example-app"],
            "max_replicas": 8,
            "load": load,
        })
    };
    for (load, words) in [
        (
            serde_json::json!({}),
            "needs target_concurrency or target_rps",
        ),
        (
            serde_json::json!({"target_rps": 0}),
            "the target must be above 0",
        ),
        (
            serde_json::json!({"target_rps": 10, "panic_threshold_pct": 90}),
            "the panic threshold must be above 100 %",
        ),
        (
            serde_json::json!({"target_rps": 10, "cooldown": 3}),
            "unknown field",
        ),
    ] {
        let a = put(route(load.clone())).await;
        assert_eq!(a.status, 400, "{load}: {}", a.body);
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(v["code"], "bad_request", "{}", a.body);
        assert!(
            v["error"].as_str().unwrap().contains(words),
            "{load}: {}",
            a.body
        );
    }
    let a = put(route(
        serde_json::json!({"target_rps": 25, "window_ms": 30000}),
    ))
    .await;
    assert!(a.status == 200 || a.status == 201, "{}", a.body);
    let shown = common::http::send(
        &c,
        ebb.admin,
        "GET",
        "localhost",
        "/admin/routes/shop",
        &[AUTH],
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&shown.body).unwrap();
    let load = &v["route"]["load"];
    assert_eq!(
        (
            load["target_rps"].as_f64(),
            load["window_ms"].as_u64(),
            load["utilization_pct"].as_f64()
        ),
        (Some(25.0), Some(30_000), Some(70.0)),
        "{v}"
    );
}

/// A scale-down on load takes away replicas with no request under way: two long requests in
/// flight while the route comes down from its peak to exactly two replicas are both answered
/// (round robin spreads them: stopping the newest replicas, as before, cut one of them unless
/// both were on the two oldest).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scale_down_on_load_spares_the_replicas_with_requests_under_way() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let path = dir.path().join("ebb.toml");
    std::fs::write(
        &path,
        r#"[[app]]
name = "drain"
domains = ["drain.localhost"]
command = ["ebb", "example-app"]
stop_grace_ms = 20000
max_replicas = 6
idle_after_ms = 60000
policy = { balancer = "round_robin" }
load = { target_concurrency = 1, utilization_pct = 100, window_ms = 6000, max_scale_down_rate = 10 }
"#,
    )
    .unwrap();
    let ebb = common::serve(&data, Some(&path), None);
    let proxy = ebb.proxy;
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let short: Vec<_> = (0..6)
        .map(|_| {
            let (stop, failed) = (stop.clone(), failed.clone());
            tokio::spawn(async move {
                let c = common::http::client();
                while !stop.load(Ordering::Relaxed) {
                    let a = common::http::send(
                        &c,
                        proxy,
                        "GET",
                        "drain.localhost",
                        "/sleep?ms=200",
                        &[],
                    )
                    .await;
                    if a.status != 200 {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let pid = ebb.child.id();
    wait_until("the route scaled out", LIMIT, || async {
        (children_with(pid, "example-app").len() >= 5).then_some(())
    })
    .await;
    // Two long requests, then the short ones stop: the load falls and the route comes down
    // while the long ones are under way.
    let long: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(async move {
                let c = common::http::client();
                let a =
                    common::http::send(&c, proxy, "GET", "drain.localhost", "/sleep?ms=15000", &[])
                        .await;
                let done = ebb::clock::Clock::now_ms(&ebb::clock::SystemClock);
                (a.status, done)
            })
        })
        .collect();
    wait_until("the long requests under way", LIMIT, || async {
        let m = common::http::send(
            &common::http::client(),
            ebb.admin,
            "GET",
            "localhost",
            "/metrics",
            &[],
        )
        .await;
        m.body
            .lines()
            .find_map(|l| l.strip_prefix("ebb_proxy_requests_in_flight{route=\"drain\"} "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|n| *n >= 2)
            .map(|_| ())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for s in short {
        s.await.unwrap();
    }
    let mut ended = Vec::new();
    for l in long {
        let (status, at) = l.await.unwrap();
        assert_eq!(status, 200, "a long request was cut by a scale-down");
        ended.push(at);
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0);
    let first_end = ended.into_iter().min().unwrap();
    let downs: Vec<u64> = events(&data)
        .into_iter()
        .filter(|e| {
            let s = &e["event"]["ScaleRequested"];
            s["reason"].get("load").is_some() && s["to"].as_u64() < s["from"].as_u64()
        })
        .filter_map(|e| e["at_ms"].as_u64())
        .collect();
    let to_two = events(&data).into_iter().any(|e| {
        let s = &e["event"]["ScaleRequested"];
        s["reason"].get("load").is_some()
            && s["to"].as_u64() == Some(2)
            && e["at_ms"].as_u64().is_some_and(|at| at < first_end)
    });
    assert!(
        to_two && downs.iter().any(|at| *at < first_end),
        "no scale-down on load to two replicas while the long requests were under way: {downs:?}"
    );
}
