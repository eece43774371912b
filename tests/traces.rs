//! Traces: a real `ebb serve` exporting OTLP to a real OpenTelemetry Collector (built from its Go
//! modules, on loopback). A request carrying a W3C `traceparent` that wakes an app from zero gives
//! one trace: ebb's `proxy.request` under the client's span, `proxy.hold` under it, the wake's
//! `scale` under the hold (and linked from it), and the app receives a `traceparent` naming ebb's
//! span as its parent; on the HTTP/1.1 fast path and on the general path (HTTP/2 here). A request
//! sampled out passes its context on untouched. With the collector killed, ebb serves on and
//! counts the spans it could not send.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::common;
use common::controlplane::wait_until;
use common::otelcol::Collector;

const DEADLINE: Duration = Duration::from_secs(60);
const TOKEN: &str = "traces";

fn config(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("ebb.toml");
    std::fs::write(
        &path,
        r#"
[[app]]
name = "traced"
domains = ["traced.localhost"]
command = ["ebb", "example-app"]
startup_timeout_ms = 20000

[[function]]
name = "scratch"
function = "upper"
serviceAddress = "127.0.0.1:9"

# Evaluated and fired at once: its spans are traces of their own.
[[cleaner]]
name = "scratch-function"
ttl = "0s"
retry = { period = "1s" }
targets = [{ name = "f", reference = { apiVersion = "ebb.dev/v1", kind = "Function", matchLabels = { name = "scratch" } }, delete = true, includeWhenEvaluating = true }]
conditions = ["size(f.items) == 1"]
"#,
    )
    .unwrap();
    path
}

/// The `traceparent` lines the app received, from its `/headers` answer.
fn received(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("traceparent: "))
        .map(str::to_owned)
        .collect()
}

/// (trace id, parent id, flags) of a `traceparent`.
fn parts(tp: &str) -> (String, String, String) {
    let p: Vec<&str> = tp.split('-').collect();
    assert_eq!(p.len(), 4, "{tp}");
    (p[1].to_owned(), p[2].to_owned(), p[3].to_owned())
}

/// `GET /headers` of the app through ebb's HTTP/1.1 path, with `headers`.
async fn headers(
    c: &common::http::Http,
    proxy: SocketAddr,
    headers: &[(&str, &str)],
) -> common::http::Answer {
    common::http::send(c, proxy, "GET", "traced.localhost", "/headers", headers).await
}

/// Whether a line of `family` in the OpenMetrics `text` has `trace` as its exemplar (on the
/// route `traced`'s line where the family is by route).
fn exemplar(text: &str, family: &str, trace: &str) -> bool {
    let wanted = format!("# {{trace_id=\"{trace}\"}}");
    text.lines().any(|l| {
        l.starts_with(family)
            && (!l.contains("route=") || l.contains("route=\"traced\""))
            && l.contains(&wanted)
    })
}

async fn metric(c: &common::http::Http, admin: SocketAddr, outcome: &str) -> u64 {
    let sample = format!("ebb_trace_spans_total{{outcome=\"{outcome}\"}}");
    common::http::sample(c, admin, &sample).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_request_that_wakes_an_app_is_one_trace_and_a_dead_collector_blocks_nothing() {
    let collector = Collector::start().await;
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://{}", collector.http);
    let env: Vec<(&str, &std::ffi::OsStr)> = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_ref()),
        ("OTEL_SERVICE_NAME", "ebb-under-test".as_ref()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50".as_ref()),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000".as_ref()),
    ];
    let ebb = common::serve_env(
        &dir.path().join("data"),
        Some(&config(dir.path())),
        None,
        &["--runner-token", TOKEN],
        &env,
    );
    let c = common::http::client();
    let trace = "4bf92f3577b34da6a3ce929e0e4736aa";
    let client_span = "00f067aa0ba902b7";

    // The HTTP/1.1 fast path: the request wakes the app from zero.
    let tp = format!("00-{trace}-{client_span}-01");
    let r = headers(
        &c,
        ebb.proxy,
        &[("traceparent", &tp), ("tracestate", "vendor=opaque")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let got = received(&r.body);
    assert_eq!(got.len(), 1, "{}", r.body);
    let (t, ebb_span, flags) = parts(&got[0]);
    assert_eq!(t, trace, "the app's request is in the client's trace");
    assert_ne!(ebb_span, client_span, "the app's parent is ebb's span");
    assert_eq!(flags, "01");
    assert!(r.body.contains("tracestate: vendor=opaque\n"), "{}", r.body);

    let (request, hold, scale) = collector
        .spans_until("the woken request's spans", |spans| {
            let request = spans
                .iter()
                .find(|s| s.name == "proxy.request" && s.span_id == ebb_span)?;
            let hold = spans
                .iter()
                .find(|s| s.name == "proxy.hold" && s.parent == ebb_span)?;
            let scale = spans
                .iter()
                .find(|s| s.name == "scale" && s.parent == hold.span_id)?;
            Some((request.clone(), hold.clone(), scale.clone()))
        })
        .await;
    assert_eq!(request.trace_id, trace);
    assert_eq!(
        request.parent, client_span,
        "ebb's span is the client's child"
    );
    assert_eq!(request.kind, 2, "a server span");
    assert_eq!(request.service, "ebb-under-test");
    assert_eq!(request.attr("ebb.route").as_deref(), Some("traced"));
    assert_eq!(request.attr("http.request.method").as_deref(), Some("GET"));
    assert_eq!(request.attr("url.path").as_deref(), Some("/headers"));
    assert_eq!(
        request.attr("http.response.status_code").as_deref(),
        Some("200")
    );
    assert!(request.attr("ebb.replica").is_some(), "{request:?}");
    assert_eq!(hold.trace_id, trace);
    assert_eq!(
        hold.attr("ebb.hold.reason").as_deref(),
        Some("no_ready_replica")
    );
    assert_eq!(hold.attr("ebb.outcome").as_deref(), Some("forwarded"));
    assert!(hold.attr("ebb.held_ms").is_some(), "{hold:?}");
    assert_eq!(scale.trace_id, trace);
    assert_eq!(scale.attr("ebb.route").as_deref(), Some("traced"));
    assert_eq!(scale.attr("ebb.scale.to").as_deref(), Some("1"));
    assert!(
        hold.links
            .contains(&(trace.to_owned(), scale.span_id.clone())),
        "the hold links to the wake it waited for: {hold:?}"
    );

    // The hold's histogram bucket names the woken request's trace as its exemplar, and so
    // does the bucket of the route's answer times the request's answer fell in.
    let metrics = common::http::send(&c, ebb.admin, "GET", "localhost", "/metrics", &[]).await;
    for family in [
        "ebb_proxy_hold_duration_seconds_bucket{",
        "ebb_proxy_response_duration_seconds_bucket{",
    ] {
        assert!(
            exemplar(&metrics.body, family, trace),
            "no exemplar of trace {trace} on {family} in:\n{}",
            metrics.body
        );
    }

    // The general path (HTTP/2 over cleartext, `:authority` the app's host): the same
    // propagation.
    let mut h2 = common::http::h2c(ebb.proxy).await;
    let trace2 = "0af7651916cd43dd8448eb211c80319c";
    let req = hyper::Request::get("http://traced.localhost/headers")
        .header("traceparent", format!("00-{trace2}-b7ad6b7169203331-01"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = h2.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let got = received(&String::from_utf8_lossy(&body));
    assert_eq!(got.len(), 1);
    let (t, ebb_span2, _) = parts(&got[0]);
    assert_eq!(t, trace2);
    let request2 = collector
        .spans_until("the HTTP/2 request's span", |spans| {
            spans
                .iter()
                .find(|s| s.name == "proxy.request" && s.span_id == ebb_span2)
                .cloned()
        })
        .await;
    assert_eq!(request2.parent, "b7ad6b7169203331");
    assert_eq!(request2.attr("ebb.route").as_deref(), Some("traced"));
    assert_eq!(
        request2.attr("http.response.status_code").as_deref(),
        Some("200")
    );

    // A gRPC call on the general path: its span names the service and the method.
    let trace4 = "7d2c4b3a59687f8e9d0c1b2a39485766";
    let req = hyper::Request::post("http://traced.localhost/ebb.test.Echo/Say")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("traceparent", format!("00-{trace4}-b7ad6b7169203331-01"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let _ = h2.send_request(req).await.unwrap();
    let call = collector
        .spans_until("the gRPC call's span", |spans| {
            spans
                .iter()
                .find(|s| s.name == "proxy.request" && s.trace_id == trace4)
                .cloned()
        })
        .await;
    assert_eq!(call.attr("rpc.system").as_deref(), Some("grpc"));
    assert_eq!(call.attr("rpc.service").as_deref(), Some("ebb.test.Echo"));
    assert_eq!(call.attr("rpc.method").as_deref(), Some("Say"));

    // A request without a context starts a trace of its own; one its client sampled out goes on
    // with its context as it came, and ebb records no span of it.
    let r = headers(&c, ebb.proxy, &[]).await;
    let got = received(&r.body);
    assert_eq!(got.len(), 1, "{}", r.body);
    let (root_trace, root_span, _) = parts(&got[0]);
    collector
        .spans_until("the root request's span", |spans| {
            spans
                .iter()
                .find(|s| {
                    s.name == "proxy.request"
                        && s.span_id == root_span
                        && s.trace_id == root_trace
                        && s.parent.is_empty()
                })
                .cloned()
        })
        .await;
    let unsampled = "00-11111111111111111111111111111111-2222222222222222-00";
    let r = headers(&c, ebb.proxy, &[("traceparent", unsampled)]).await;
    assert_eq!(received(&r.body), [unsampled]);

    // A call enqueued with a context: its time in the queue, its run and the request the
    // built-in runner sends the app join the enqueuer's trace; its trace state and baggage
    // reach the app.
    let trace3 = "5c1f0e3d2b4a69788796a5b4c3d2e1f0";
    let enqueuer = "a1a2a3a4a5a6a7a8";
    let tp3 = format!("00-{trace3}-{enqueuer}-01");
    let r = common::http::send_body(
        &c,
        ebb.admin,
        "POST",
        "localhost",
        "/runner/enqueue",
        &[
            ("authorization", &format!("Bearer {TOKEN}")),
            ("content-type", "application/json"),
            ("traceparent", &tp3),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("baggage", "tenant=acme,user.id=42"),
        ],
        bytes::Bytes::from_static(
            br#"{"target": "traced", "payload": {"method": "GET", "path": "/headers"}}"#,
        ),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let call: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let call_id = call["id"].as_str().unwrap().to_owned();
    let (queue, run, forwarded) = collector
        .spans_until("the call's spans", |spans| {
            let in_trace = |name: &str| {
                spans
                    .iter()
                    .find(|s| s.name == name && s.trace_id == trace3 && s.parent == enqueuer)
                    .cloned()
            };
            Some((
                in_trace("call.queue")?,
                in_trace("call.run")?,
                in_trace("proxy.request")?,
            ))
        })
        .await;
    for s in [&queue, &run] {
        assert_eq!(
            s.attr("messaging.message.id").as_deref(),
            Some(call_id.as_str())
        );
        assert_eq!(
            s.attr("messaging.destination.name").as_deref(),
            Some("traced")
        );
        assert_eq!(s.attr("ebb.runner").as_deref(), Some("builtin"), "{s:?}");
    }
    assert_eq!(run.kind, 5, "a consumer span");
    assert_eq!(run.attr("ebb.call.status").as_deref(), Some("success"));
    assert_eq!(forwarded.attr("ebb.route").as_deref(), Some("traced"));
    // The call's wait in the queue is its bucket's exemplar (counted from the log's tail, which
    // the metrics follow on a task of their own).
    wait_until(
        "the traced call's exemplar on ebb_call_queue_wait_seconds",
        Duration::from_secs(30),
        || async {
            let m = common::http::send(&c, ebb.admin, "GET", "localhost", "/metrics", &[]).await;
            exemplar(&m.body, "ebb_call_queue_wait_seconds_bucket{", trace3).then_some(())
        },
    )
    .await;
    let answer = common::http::send(
        &c,
        ebb.admin,
        "GET",
        "localhost",
        &format!("/v1/calls/{call_id}"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
    )
    .await;
    let answer: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    let got = received(answer["result"]["body"].as_str().unwrap_or_default());
    assert_eq!(got.len(), 1, "{answer}");
    let (t, parent, _) = parts(&got[0]);
    assert_eq!(t, trace3, "the app's request is in the enqueuer's trace");
    assert_eq!(
        parent, forwarded.span_id,
        "under ebb's span of the runner's request"
    );
    let body = answer["result"]["body"].as_str().unwrap_or_default();
    for line in [
        "tracestate: congo=t61rcWkgMzE",
        "baggage: tenant=acme,user.id=42",
    ] {
        assert!(body.lines().any(|l| l == line), "{line:?} not in:\n{body}");
    }

    // The cleaner's evaluation and its firing.
    let (evaluate, fire) = collector
        .spans_until("the cleaner's spans", |spans| {
            let named = |name: &str| {
                spans
                    .iter()
                    .find(|s| {
                        s.name == name
                            && s.attr("ebb.cleaner").as_deref() == Some("config/scratch-function")
                    })
                    .cloned()
            };
            // The evaluation whose conditions held, and the firing it led to.
            let evaluate = spans.iter().find(|s| {
                s.name == "cleaner.evaluate"
                    && s.attr("ebb.cleaner").as_deref() == Some("config/scratch-function")
                    && s.attr("ebb.cleaner.fire").as_deref() == Some("true")
            })?;
            Some((evaluate.clone(), named("cleaner.fire")?))
        })
        .await;
    assert!(
        evaluate.attr("ebb.cleaner.cel_evaluations").is_some(),
        "{evaluate:?}"
    );
    assert_eq!(fire.attr("ebb.cleaner.completed").as_deref(), Some("true"));

    // The collector killed: ebb serves on, and counts the spans it could not send.
    let lost_before = metric(&c, ebb.admin, "export_failed").await
        + metric(&c, ebb.admin, "dropped_queue_full").await;
    let exported = metric(&c, ebb.admin, "exported").await;
    assert!(exported >= 5, "exported {exported}");
    let mut collector = collector;
    collector.kill();
    for _ in 0..50 {
        let r = headers(&c, ebb.proxy, &[("traceparent", &tp)]).await;
        assert_eq!(r.status, 200);
    }
    let wait = async {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            let lost = metric(&c, ebb.admin, "export_failed").await
                + metric(&c, ebb.admin, "dropped_queue_full").await;
            if lost > lost_before {
                return;
            }
        }
    };
    tokio::time::timeout(DEADLINE, wait)
        .await
        .expect("the spans a dead collector could not take are counted");
}
