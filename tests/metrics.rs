//! `/metrics` of a real `ebb serve`: it parses as Prometheus text, its counters move as traffic
//! flows and the log decides, and its labels stay bounded whatever Hosts requests carry.

use std::collections::HashMap;
use std::time::Duration;

use crate::common;

use common::controlplane::wait_until;
use common::http::{Http, client, send};

const DEADLINE: Duration = Duration::from_secs(60);

/// A scrape: every sample by its name and labels (`name{k=v,...}`, labels sorted), and the
/// values of its `route` label.
struct Scrape {
    samples: HashMap<String, f64>,
    /// Every value the `route` label took, and how many series have one.
    routes: std::collections::BTreeSet<String>,
    route_series: usize,
}

impl Scrape {
    /// A sample's value (`labels` as `k=v` pairs), if present.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples.get(&key(name, labels)).copied()
    }
}

fn key(name: &str, labels: &[(&str, &str)]) -> String {
    let mut l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    l.sort();
    format!("{name}{{{}}}", l.join(","))
}

/// Scrapes `/metrics` and parses it with a Prometheus text-format parser; every sample line must
/// parse.
async fn scrape(c: &Http, ebb: &common::Ebb) -> Scrape {
    let r = send(c, ebb.admin, "GET", "localhost", "/metrics", &[]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.header("content-type")
            .starts_with("application/openmetrics-text"),
        "{}",
        r.header("content-type")
    );
    let lines: Vec<std::io::Result<String>> = r.body.lines().map(|l| Ok(l.to_owned())).collect();
    let parsed = prometheus_parse::Scrape::parse(lines.into_iter()).expect("Prometheus text");
    let sample_lines = r
        .body
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    let mut samples = HashMap::new();
    let mut parsed_lines = 0;
    let mut routes = std::collections::BTreeSet::new();
    let mut route_series = 0;
    for s in parsed.samples {
        let mut labels: Vec<(String, String)> = s
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.sort();
        if let Some((_, r)) = labels.iter().find(|(k, _)| k == "route") {
            routes.insert(r.clone());
            route_series += 1;
        }
        use prometheus_parse::Value;
        let mut put = |name: String, extra: Option<(&str, String)>, v: f64| {
            let mut l: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            if let Some((k, ref val)) = extra {
                l.push((k, val.as_str()));
            }
            samples.insert(key(&name, &l), v);
            parsed_lines += 1;
        };
        match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => put(s.metric, None, v),
            Value::Histogram(buckets) => {
                for b in buckets {
                    put(
                        format!("{}_bucket", s.metric),
                        Some(("le", b.less_than.to_string())),
                        b.count,
                    );
                }
            }
            Value::Summary(_) => panic!("no summaries here"),
        }
    }
    assert_eq!(
        parsed_lines, sample_lines,
        "every sample line parsed:\n{}",
        r.body
    );
    Scrape {
        samples,
        routes,
        route_series,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_move_with_traffic_and_decisions_and_keep_their_labels_bounded() {
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ebb.toml");
    std::fs::write(
        &config,
        r#"
[[app]]
name = "demo"
domains = ["demo.localhost", "*.demo.localhost"]
command = ["ebb", "example-app"]
startup_timeout_ms = 20000

[[app]]
name = "other"
domains = ["other.localhost"]
command = ["ebb", "example-app"]
"#,
    )
    .unwrap();
    let ebb = common::serve_with(
        &dir.path().join("data"),
        Some(&config),
        None,
        &["--metrics-max-routes", "1"],
    );
    let demo = [("route", "demo")];
    let m = scrape(&c, &ebb).await;
    assert_eq!(m.get("ebb_proxy_requests_total", &demo), Some(0.0));
    assert_eq!(m.get("ebb_workload_replicas_ready", &demo), Some(0.0));
    assert_eq!(m.get("ebb_cold_starts_total", &[]), Some(0.0));
    // The label bound: the second route by name is summed under `_other`.
    assert_eq!(
        m.get("ebb_workload_replicas_desired", &[("route", "_other")]),
        Some(0.0)
    );
    assert_eq!(
        m.get("ebb_workload_replicas_desired", &[("route", "other")]),
        None
    );

    // A wake from zero, then four more requests.
    for _ in 0..5 {
        let r = send(&c, ebb.proxy, "GET", "demo.localhost", "/pid", &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let m = wait_until("the wake counted", DEADLINE, || async {
        let m = scrape(&c, &ebb).await;
        (m.get("ebb_cold_start_duration_seconds_count", &[]) == Some(1.0)).then_some(m)
    })
    .await;
    assert_eq!(m.get("ebb_proxy_requests_total", &demo), Some(5.0));
    assert_eq!(m.get("ebb_workload_replicas_ready", &demo), Some(1.0));
    assert_eq!(m.get("ebb_workload_replicas_desired", &demo), Some(1.0));
    assert_eq!(m.get("ebb_cold_starts_total", &[]), Some(1.0));
    assert_eq!(
        m.get(
            "ebb_scale_decisions_total",
            &[("reason", "wake"), ("direction", "up")]
        ),
        Some(1.0)
    );
    assert!(
        m.get("ebb_events_total", &[("event", "ScaleRequested")]) >= Some(1.0),
        "decisions counted from the log's tail"
    );
    assert_eq!(m.get("ebb_proxy_requests_held", &demo), Some(0.0));
    assert!(m.get("ebb_log_last_seq", &[]) >= Some(2.0));
    // Five answers from the app, each timed from the pick to its head.
    assert_eq!(
        m.get(
            "ebb_proxy_responses_total",
            &[("route", "demo"), ("code_class", "2xx")]
        ),
        Some(5.0)
    );
    assert_eq!(
        m.get(
            "ebb_proxy_responses_total",
            &[("route", "demo"), ("code_class", "5xx")]
        ),
        Some(0.0)
    );
    assert_eq!(
        m.get("ebb_proxy_response_duration_seconds_count", &demo),
        Some(5.0)
    );
    assert_eq!(
        m.get(
            "ebb_proxy_response_duration_seconds_bucket",
            &[("route", "demo"), ("le", "inf")]
        ),
        Some(5.0)
    );
    // The first request was held for the wake; the rest found the replica free.
    assert_eq!(
        m.get("ebb_proxy_hold_duration_seconds_count", &[]),
        Some(1.0)
    );
    // The log's own figures: the wake's events were synced in batches.
    assert!(m.get("ebb_log_sync_duration_seconds_count", &[]) >= Some(1.0));
    assert!(m.get("ebb_log_batch_events_count", &[]) >= Some(1.0));
    assert_eq!(
        m.get("ebb_queue_messages", &[("state", "ready")]),
        Some(0.0)
    );
    for state in [
        "queued",
        "running",
        "success",
        "error",
        "timeout",
        "cancelled",
    ] {
        assert_eq!(
            m.get("ebb_calls", &[("state", state)]),
            Some(0.0),
            "{state}"
        );
    }

    // 10,000 distinct Hosts: half match the wildcard domain, half no route. No new series.
    let before = (m.routes.clone(), m.route_series);
    assert_eq!(
        m.routes.iter().map(String::as_str).collect::<Vec<_>>(),
        ["_other", "demo"]
    );
    for i in 0..5_000 {
        let host = format!("h{i}.demo.localhost");
        let r = send(&c, ebb.proxy, "GET", &host, "/pid", &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let host = format!("h{i}.nowhere.localhost");
        let r = send(&c, ebb.proxy, "GET", &host, "/pid", &[]).await;
        assert_eq!(r.status, 404, "{}", r.body);
    }
    let m = scrape(&c, &ebb).await;
    assert_eq!(m.get("ebb_proxy_requests_total", &demo), Some(5_005.0));
    assert_eq!(
        (m.routes, m.route_series),
        before,
        "the same route series after 10,000 Hosts"
    );
}
