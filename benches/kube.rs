//! The Kubernetes benchmark (`benches/kube.sh`), against the real control plane the kube tests
//! start, in a network namespace of its own, with ebb running as `deploy/`'s ServiceAccount:
//!
//! 1. **Wake to scale write**: from a request reaching ebb for a Deployment at zero to the API
//!    server receiving the `/scale` write (its audit log's `requestReceivedTimestamp`); anchor: a
//!    `/scale` patch round trip from a bare kube-rs client.
//! 2. **ebb's share of a cold start**: the first byte back through ebb minus the moment an
//!    EndpointSlice watch (the benchmark's own, beside ebb's) saw the pod ready; anchor: the
//!    app's own first byte, asked directly on the pod's address.
//! 3. **API requests per minute** that ebb makes (watches excepted) for an idle route and for a
//!    busy one, at ebb's default intervals, from the audit log; anchor: the bound the intervals
//!    set.
//! 4. **A template across replicas**: from a `POST /api/funcs/template` on one ebb to the `ADDED`
//!    line on another ebb's functions watch; anchor: a bare kube-rs create of a `Func` to the
//!    benchmark's own watch of the resources seeing it.
//!
//! 6. **A step in load to the scale write**: a Service scaled on load (target concurrency 4) at
//!    one warm replica, then 40 clients at once through ebb: from the step to the API server
//!    receiving the `/scale` write for more replicas; anchor: the bare `/scale` patch round trip
//!    of part 1.
//!
//! Not a test (`test = false`): `benches/kube.sh` runs it on the `ci` profile.

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::controlplane::{ControlPlane, wait_for, wait_until};
use common::ebbkube::{
    TEST_TIMING, apply, cluster, get, grant, json, send, serve_deployed, serve_kube, serve_on,
    serverless_hello,
};
use ebb::clock::{Clock, Stopwatch, SystemClock};
use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};

const ROUNDS: usize = 5;
const WINDOW_S: u64 = 30;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Unix ms (with fractions) of an RFC 3339 timestamp of the audit log.
fn audit_ms(t: &serde_json::Value) -> f64 {
    let ts: k8s_openapi::jiff::Timestamp = t.as_str().unwrap_or_default().parse().expect("a time");
    ts.as_microsecond() as f64 / 1_000.0
}

/// Sends `GET /pid` with `Host: host` and returns when the first byte of the answer is back.
async fn first_byte(addr: SocketAddr, host: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).unwrap();
    s.write_all(
        format!("GET /pid HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.expect("an answer");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest).await;
}

fn replicas(cp: &ControlPlane) -> serde_json::Value {
    json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["spec"]["replicas"].clone()
}

fn no_pods(cp: &ControlPlane) -> bool {
    json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]))["items"]
        .as_array()
        .is_some_and(Vec::is_empty)
}

/// ebb's API requests (watches excepted) in the audit log between two Unix ms, by kind.
fn ebb_requests(cp: &ControlPlane, from: f64, to: f64) -> std::collections::BTreeMap<String, u64> {
    let mut by = std::collections::BTreeMap::new();
    for e in cp.audit_events() {
        if e["user"]["username"] != "system:serviceaccount:ebb:ebb" || e["verb"] == "watch" {
            continue;
        }
        let at = audit_ms(&e["requestReceivedTimestamp"]);
        if at < from || at >= to {
            continue;
        }
        let r = &e["objectRef"];
        let kind = format!(
            "{} {}{}",
            e["verb"].as_str().unwrap_or_default(),
            r["resource"].as_str().unwrap_or_default(),
            r["subresource"]
                .as_str()
                .map(|s| format!("/{s}"))
                .unwrap_or_default()
        );
        *by.entry(kind).or_default() += 1;
    }
    by
}

async fn run() {
    let (cp, kube, _agent) = cluster().await;
    apply(&cp, &serverless_hello("2s"));
    cp.kubectl(&["delete", "service", "legacy", "bad"]);
    let clock = SystemClock;
    let sw = std::sync::Arc::new(Stopwatch::start());

    // The benchmark's own watch on the Service's slices: when (on `sw`) a ready endpoint was
    // first seen, and its address.
    let (seen_tx, seen_rx) = tokio::sync::watch::channel(None::<(Duration, String)>);
    {
        let slices: Api<EndpointSlice> = Api::namespaced(kube.clone(), "default");
        let cfg = watcher::Config::default().labels("kubernetes.io/service-name=hello");
        let sw = sw.clone();
        tokio::spawn(async move {
            let stream = watcher(slices, cfg).default_backoff().applied_objects();
            tokio::pin!(stream);
            while let Some(Ok(s)) = stream.next().await {
                let ready = s.endpoints.iter().flatten().find(|e| {
                    e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false)
                        && !e
                            .conditions
                            .as_ref()
                            .and_then(|c| c.terminating)
                            .unwrap_or(false)
                });
                match ready {
                    Some(e) => {
                        let addr = e.addresses.first().cloned().unwrap_or_default();
                        seen_tx.send_if_modified(|v| {
                            if v.is_none() {
                                *v = Some((sw.elapsed(), addr));
                                true
                            } else {
                                false
                            }
                        });
                    }
                    None => {
                        seen_tx.send_replace(None);
                    }
                }
            }
        });
    }

    let data = tempfile::tempdir().unwrap();
    let e = serve_kube(&cp, data.path(), &TEST_TIMING);
    wait_for("the route", Duration::from_secs(60), || {
        common::ebbkube::routes(data.path()).contains("default/hello")
    })
    .await;

    // The anchor of 1: a bare /scale patch round trip (to the value it has: no pod moves).
    let deployments: Api<Deployment> = Api::namespaced(kube.clone(), "default");
    let mut bare = Vec::new();
    for _ in 0..ROUNDS {
        let t = Stopwatch::start();
        deployments
            .patch_scale(
                "hello",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"spec": {"replicas": 0}})),
            )
            .await
            .expect("patch scale");
        bare.push(t.elapsed().as_secs_f64() * 1_000.0);
    }

    let scale_patches = |cp: &ControlPlane| -> Vec<serde_json::Value> {
        cp.audit_events()
            .into_iter()
            .filter(|e| {
                e["objectRef"]["subresource"] == "scale"
                    && e["verb"] == "patch"
                    && e["user"]["username"] == "system:serviceaccount:ebb:ebb"
            })
            .collect()
    };
    let (mut to_write, mut share, mut direct) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let before = scale_patches(&cp).len();
        let sent_ms = clock.now_ms() as f64;
        first_byte(e.proxy, "hello.test").await;
        let byte_at = sw.elapsed();
        // ebb's watch and the benchmark's are separate: the benchmark's may be a moment behind.
        wait_for(
            "the ready slice on the benchmark's watch",
            Duration::from_secs(10),
            || seen_rx.borrow().is_some(),
        )
        .await;
        let (ready_at, addr) = seen_rx
            .borrow()
            .clone()
            .unwrap_or_else(|| panic!("round {round}: answered before any slice was ready"));
        share.push((byte_at.saturating_sub(ready_at)).as_secs_f64() * 1_000.0);
        // The anchor of 2: the app's own first byte, asked directly.
        let pod: SocketAddr = format!("{addr}:8080").parse().expect("a pod address");
        let t = Stopwatch::start();
        first_byte(pod, "hello.test").await;
        direct.push(t.elapsed().as_secs_f64() * 1_000.0);
        let mut writes = Vec::new();
        wait_for(
            "the scale write in the audit log",
            Duration::from_secs(30),
            || {
                writes = scale_patches(&cp);
                writes.len() > before
            },
        )
        .await;
        to_write.push(audit_ms(&writes[before]["requestReceivedTimestamp"]) - sent_ms);
        // Back to zero before the next round.
        wait_for("idle at zero", Duration::from_secs(60), || {
            replicas(&cp) == 0
        })
        .await;
        wait_for("no pods", Duration::from_secs(60), || no_pods(&cp)).await;
        wait_for("no ready slice", Duration::from_secs(60), || {
            seen_rx.borrow().is_none()
        })
        .await;
    }
    println!("ebb on the real Kubernetes control plane, {ROUNDS} cold starts (medians):");
    println!(
        "  first request to scale write: {:.1} ms; anchor: bare /scale patch round trip {:.1} ms; ratio {:.2}x",
        median(to_write.clone()),
        median(bare.clone()),
        median(to_write) / median(bare.clone())
    );
    println!(
        "  ebb's share of a cold start (first byte through ebb - slice seen ready): {:.2} ms (target < 5 ms); anchor: the app's first byte asked directly {:.2} ms; ratio {:.2}x",
        median(share.clone()),
        median(direct.clone()),
        median(share) / median(direct)
    );
    drop(e);

    // 3: API requests per minute at ebb's default intervals.
    let data = tempfile::tempdir().unwrap();
    // As deploy/ runs it: every namespace watched, templates in its own.
    let e = serve_deployed(&cp, data.path(), &[]);
    wait_for("the route", Duration::from_secs(60), || {
        common::ebbkube::routes(data.path()).contains("default/hello")
    })
    .await;
    let window = Duration::from_secs(WINDOW_S);
    let per_minute = 60.0 / WINDOW_S as f64;
    // Idle: at zero, no traffic.
    let from = clock.now_ms() as f64;
    tokio::time::sleep(window).await;
    let idle = ebb_requests(&cp, from, clock.now_ms() as f64);
    // Busy: a request every 100 ms.
    let from = clock.now_ms() as f64;
    let busy_until = Stopwatch::start();
    while busy_until.elapsed() < window {
        let (status, body) = get(e.proxy, "hello.test", "/pid").await;
        assert_eq!(status, 200, "{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let busy = ebb_requests(&cp, from, clock.now_ms() as f64);
    let total = |m: &std::collections::BTreeMap<String, u64>| m.values().sum::<u64>() as f64;
    println!(
        "API requests per minute, watches excepted (defaults: replicas read every 10 s, last use published every 5 s, lease 15 s):"
    );
    println!(
        "  idle route: {:.0}/min {:?}",
        total(&idle) * per_minute,
        idle
    );
    println!(
        "  busy route: {:.0}/min {:?}",
        total(&busy) * per_minute,
        busy
    );
    println!(
        "  anchor, the bound the intervals set: idle 6 replica reads + 12 lease reads + 6 renewals = 24/min; busy adds 12 bumps of 2 requests = 48/min"
    );
    drop(e);

    println!("A step in load on Kubernetes ({ROUNDS} steps from 1 to 40 clients, medians):");
    step_to_scale_write(&cp, median(bare.clone())).await;

    println!("Function templates on Kubernetes ({ROUNDS} rounds, medians):");
    template_across_replicas(&cp, &kube).await;

    println!("Cleaners on Kubernetes ({CLEANER_ROUNDS} target changes):");
    cleaner_reevaluation(&cp, &kube).await;
}

/// 6: a step in load to the `/scale` write asking for more replicas (the audit log's time of the
/// write's arrival, its body read at the Request level the harness logs scale writes at).
async fn step_to_scale_write(cp: &ControlPlane, bare_ms: f64) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    cp.kubectl(&[
        "annotate",
        "--overwrite",
        "service",
        "hello",
        "ebb.dev/target-concurrency=4",
        "ebb.dev/max-replicas=20",
        "ebb.dev/window=6s",
        "ebb.dev/idle-after=10m",
    ]);
    let data = tempfile::tempdir().unwrap();
    let e = serve_kube(cp, data.path(), &TEST_TIMING);
    wait_for("the route scaled on load", Duration::from_secs(60), || {
        common::events(data.path()).iter().any(|ev| {
            ev["event"]["RouteUpserted"]["route"]["load"]["target_concurrency"].as_f64()
                == Some(4.0)
        })
    })
    .await;
    let clock = SystemClock;
    let writes_up = |cp: &ControlPlane| -> Vec<f64> {
        cp.audit_events()
            .iter()
            .filter(|e| {
                e["objectRef"]["subresource"] == "scale"
                    && e["verb"] == "patch"
                    && e["user"]["username"] == "system:serviceaccount:ebb:ebb"
                    && e["requestObject"]["spec"]["replicas"].as_u64() > Some(1)
            })
            .map(|e| audit_ms(&e["requestReceivedTimestamp"]))
            .collect()
    };
    let mut step_to_write = Vec::new();
    for _ in 0..ROUNDS {
        // One warm replica.
        let (status, body) = get(e.proxy, "hello.test", "/pid").await;
        assert_eq!(status, 200, "{body}");
        wait_for("one replica", Duration::from_secs(90), || replicas(cp) == 1).await;
        let before = writes_up(cp).len();
        let stop = Arc::new(AtomicBool::new(false));
        let (answered, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let step_ms = clock.now_ms() as f64;
        let clients = common::ebbkube::load(e.proxy, "hello.test", 40, &stop, &answered, &failed);
        let mut writes = Vec::new();
        wait_for("the scale-up write", Duration::from_secs(30), || {
            writes = writes_up(cp);
            writes.len() > before
        })
        .await;
        step_to_write.push(writes[before] - step_ms);
        stop.store(true, Ordering::Relaxed);
        clients.join().unwrap();
        assert_eq!(failed.load(Ordering::Relaxed), 0);
        // Back to one replica (the window, then halving each second) before the next step.
        wait_for("back to one replica", Duration::from_secs(90), || {
            replicas(cp) == 1
        })
        .await;
    }
    let m = median(step_to_write);
    println!(
        "  step in load to scale write: {m:.0} ms (one sample a second, then the decision); anchor: bare /scale patch round trip {bare_ms:.1} ms; ratio {:.1}x",
        m / bare_ms
    );
    drop(e);
}

/// Target changes timed in part 5.
const CLEANER_ROUNDS: usize = 100;

/// 5: a change to a Cleaner's target, to the Cleaner's status showing its re-evaluation (the
/// retry period is an hour: only the change makes it); anchor: the same change to a bare watch
/// of the target seeing it.
async fn cleaner_reevaluation(cp: &ControlPlane, kube: &kube::Client) {
    use ebb::cleaner::spec::CleanerResource;
    use k8s_openapi::api::core::v1::ConfigMap;
    grant(
        cp,
        "ebb-cleaner-targets",
        "get,list,watch,delete",
        "configmaps",
    );
    let d = tempfile::tempdir().unwrap();
    let _ebb = serve_on(cp, d.path(), &[]);
    apply(
        cp,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: bench-target, namespace: default}\ndata: {v: \"0\"}\n",
    );
    // The two watches: the target's, and the Cleaner's last evaluation time.
    let (bare_tx, mut bare_rx) = tokio::sync::mpsc::unbounded_channel();
    let maps: Api<ConfigMap> = Api::namespaced(kube.clone(), "default");
    let patcher = maps.clone();
    tokio::spawn(async move {
        let cfg = watcher::Config::default().fields("metadata.name=bench-target");
        let stream = watcher(maps, cfg).applied_objects();
        tokio::pin!(stream);
        while let Some(Ok(m)) = stream.next().await {
            let v = m.data.and_then(|d| d.get("v").cloned()).unwrap_or_default();
            let _ = bare_tx.send(v);
        }
    });
    let (eval_tx, mut eval_rx) = tokio::sync::mpsc::unbounded_channel();
    let cleaners: Api<CleanerResource> = Api::namespaced(kube.clone(), "default");
    tokio::spawn(async move {
        let stream = watcher(cleaners, watcher::Config::default()).applied_objects();
        tokio::pin!(stream);
        while let Some(Ok(c)) = stream.next().await {
            if let Some(t) = c.status.and_then(|s| s.last_evaluation).map(|l| l.time) {
                let _ = eval_tx.send(t);
            }
        }
    });
    apply(
        cp,
        "apiVersion: cleaner.ebb.dev/v1alpha1\nkind: Cleaner\nmetadata: {name: bench, namespace: default}\nspec:\n  ttl: 0s\n  retry: {period: 1h}\n  targets:\n  - name: t\n    reference: {apiVersion: v1, kind: ConfigMap, name: bench-target}\n    includeWhenEvaluating: true\n  conditions: [\"t.data.v == 'never'\"]\n",
    );
    let first = tokio::time::timeout(Duration::from_secs(60), eval_rx.recv())
        .await
        .expect("the Cleaner's first evaluation")
        .unwrap();
    let mut last = first;
    let (mut ebb_ms, mut bare_ms) = (Vec::new(), Vec::new());
    for round in 1..=CLEANER_ROUNDS {
        let v = round.to_string();
        let t = Stopwatch::start();
        let patch = serde_json::json!({"data": {"v": v}});
        patcher
            .patch(
                "bench-target",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .expect("the target patched");
        let (mut seen_bare, mut seen_eval) = (None, None);
        let wait = async {
            while seen_bare.is_none() || seen_eval.is_none() {
                tokio::select! {
                    Some(b) = bare_rx.recv(), if seen_bare.is_none() => {
                        if b == v { seen_bare = Some(t.elapsed()); }
                    }
                    Some(e) = eval_rx.recv(), if seen_eval.is_none() => {
                        if e > last { last = e; seen_eval = Some(t.elapsed()); }
                    }
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(30), wait)
            .await
            .expect("the change seen by both watches");
        // From the patch's start: the bare watch's time is the anchor.
        ebb_ms.push(seen_eval.unwrap().as_secs_f64() * 1_000.0);
        bare_ms.push(seen_bare.unwrap().as_secs_f64() * 1_000.0);
    }
    let pct = |mut v: Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    println!(
        "  target change (a merge patch) to the Cleaner's re-evaluation on its status: p50 {:.1} ms, p99 {:.1} ms",
        pct(ebb_ms.clone(), 0.5),
        pct(ebb_ms.clone(), 0.99)
    );
    println!(
        "  anchor, the same change on a bare watch of the target: p50 {:.1} ms, p99 {:.1} ms; ratio of p50s {:.2}x",
        pct(bare_ms.clone(), 0.5),
        pct(bare_ms.clone(), 0.99),
        pct(ebb_ms, 0.5) / pct(bare_ms, 0.5)
    );
}

/// Reads `watch` until it has an `ADDED` line for template `name` (each line within 30 s).
async fn added(watch: &mut common::FuncWatch, name: &str) {
    loop {
        let line = watch.next().await;
        if line["type"] == "ADDED" && line["object"]["metadata"]["name"] == name {
            return;
        }
    }
}

/// Waits (within 30 s) until `rx` names `name`.
async fn until(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>, name: String) {
    let fut = async move {
        while let Some(n) = rx.recv().await {
            if n == name {
                return;
            }
        }
        panic!("the watch ended");
    };
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("the name on the watch");
}

/// 4: a template made through one replica, on another replica's watch; anchor: a bare create
/// of the resource, on a bare watch of the resources.
async fn template_across_replicas(cp: &ControlPlane, kube: &kube::Client) {
    use ebb::functions::{Func, TemplateJson};
    const TOKEN: &str = "bench-functions";
    let (d0, d1) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let args = |name: &'static str| {
        let mut a = TEST_TIMING.to_vec();
        a.extend(["--api-token", TOKEN, "--pod-name", name]);
        a
    };
    let e0 = serve_deployed(cp, d0.path(), &args("ebb-a"));
    let e1 = serve_deployed(cp, d1.path(), &args("ebb-b"));
    for e in [&e0, &e1] {
        wait_until("the functions API", Duration::from_secs(60), || async {
            let (status, _) = send(
                e.admin,
                "GET",
                "ebb",
                "/api/funcs/template",
                Some(TOKEN),
                "",
            )
            .await;
            (status == 200).then_some(())
        })
        .await;
    }
    let mut watch = common::FuncWatch::open(e1.admin, TOKEN, "").await;
    // The bare watch of the resources.
    let funcs: Api<Func> = Api::namespaced(kube.clone(), "ebb");
    let (bare_tx, mut bare_seen) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn({
        let funcs = funcs.clone();
        async move {
            let stream = watcher(funcs, watcher::Config::default()).applied_objects();
            tokio::pin!(stream);
            while let Some(Ok(f)) = stream.next().await {
                let _ = bare_tx.send(f.metadata.name.unwrap_or_default());
            }
        }
    });
    let (mut through_ebb, mut bare) = (Vec::new(), Vec::new());
    // Round 0 is a warm-up, once both watches are open.
    for round in 0..=ROUNDS {
        let name = format!("bench-{round}");
        let body = format!(
            r#"{{"name": "{name}", "function": "upper", "serviceAddress": "127.0.0.1:9"}}"#
        );
        let t = Stopwatch::start();
        let (status, answer) = send(
            e0.admin,
            "POST",
            "ebb",
            "/api/funcs/template",
            Some(TOKEN),
            &body,
        )
        .await;
        assert_eq!(status, 201, "{answer}");
        added(&mut watch, &name).await;
        let took = t.elapsed().as_secs_f64() * 1_000.0;

        let name = format!("bare-{round}");
        let t = Stopwatch::start();
        funcs
            .create(
                &kube::api::PostParams::default(),
                &Func::new(
                    &name,
                    TemplateJson {
                        function: "upper".into(),
                        service_address: Some("127.0.0.1:9".into()),
                        ..TemplateJson::default()
                    },
                ),
            )
            .await
            .expect("a bare create");
        until(&mut bare_seen, name).await;
        if round > 0 {
            through_ebb.push(took);
            bare.push(t.elapsed().as_secs_f64() * 1_000.0);
        }
    }
    println!(
        "  a template made through one replica, on the other's watch: {:.1} ms; anchor: a bare Func create to a bare watch seeing it {:.1} ms; ratio {:.2}x",
        median(through_ebb.clone()),
        median(bare.clone()),
        median(through_ebb) / median(bare)
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(run());
}
