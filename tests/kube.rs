//! ebb against the real Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager
//! and kube-scheduler built from their Go modules (`scripts/controlplane build`), started by the
//! harness in `tests/common/controlplane.rs`, with pods run as local processes by the test node
//! agent (`tests/common/node.rs`) and published by the real EndpointSlice controller.
//!
//! The tests prove the control plane (Deployment to ReplicaSet to Pod, the scheduler, `/scale`
//! through kube-rs, RBAC, the audit log), the agent (a pod's process answering on the address its
//! EndpointSlice lists, stopped at zero), and ebb on it, run as `deploy/`'s ServiceAccount with a
//! TokenRequest token: annotated Services as routes, one scale write for 100 cold requests, idle
//! scale-down, two ebbs sharing the Lease with a 409 race held open at the gate, `kubectl apply
//! -k` of `deploy/` through the StatefulSet controller (with an image function owned by the
//! StatefulSet; and with Apache Kafka beside the pods, calls on both replicas decided by their
//! owners, an owner's process SIGKILLed and its pod made again), image functions made, woken,
//! rolled, refused a foreign name and deleted, the API server stopped and restarted, a missing
//! permission; and `k8s://` discovery following the EndpointSlice controller as pods become ready
//! and terminate. Against a cluster of one's own (`EBB_TEST_KUBECONFIG`), tests that need the
//! harness itself say so and end (`needs_harness`); one test runs two others in a second process
//! of the test binary against the harness's own cluster in that mode.

mod common;
mod gateway;
mod manifests;
mod realnode;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::controlplane::{ControlPlane, NOBODY_TOKEN, http_get, wait_for, wait_until};
use common::ebbkube::{
    TEST_TIMING, apply, client, cluster, deployed_service_account, get, grant, hello_deployment,
    hello_service, json, load, pid_of, routes, scale_writes, send, serve_deployed, serve_on,
    serverless_hello, test_image, try_send,
};

/// A Deployment of the example app at one replica and a plain Service in front of it.
fn hello() -> String {
    hello_deployment(1) + &hello_service("hello", &[])
}

/// Sets the Deployment's replicas through the scale subresource with kube-rs, as ebb scales.
async fn scale(client: kube::Client, deployment: &str, replicas: i32) {
    let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(client, "default");
    deployments
        .patch_scale(
            deployment,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"replicas": replicas}})),
        )
        .await
        .expect("patch scale");
}

/// The harness brings up the real control plane: the API server at the pinned release with RBAC
/// and an audit log, the deployment and replicaset controllers turning a Deployment into a Pod,
/// the scheduler trying to place it (no node yet: it says so on the pod), and the `/scale`
/// subresource, written through kube-rs as ebb scales, taking it back to zero.
#[tokio::test]
async fn the_real_control_plane_turns_a_deployment_into_pods_and_audits_every_write() {
    let cp = ControlPlane::start().await;
    if cp
        .needs_harness(
            "checks the harness's own control plane: its release, a cluster without nodes",
        )
        .is_some()
    {
        return;
    }
    let version = json(&cp.kubectl(&["version", "-o", "json"]));
    assert_eq!(
        version["serverVersion"]["gitVersion"], "v1.36.3",
        "{version}"
    );
    assert_eq!(
        version["clientVersion"]["gitVersion"], "v1.36.3",
        "{version}"
    );

    // RBAC is on: a user with no roles may not even list pods.
    let denied = cp
        .try_kubectl(&["--token", NOBODY_TOKEN, "get", "pods"])
        .expect_err("a user without roles lists pods");
    assert!(
        denied.contains("Forbidden") || denied.contains("forbidden"),
        "{denied}"
    );

    apply(&cp, &hello());
    wait_for("the deployment's pod", Duration::from_secs(60), || {
        let pods = json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]));
        pods["items"]
            .as_array()
            .is_some_and(|items| items.len() == 1)
    })
    .await;
    // The scheduler ran and found no node for it.
    wait_for("the scheduler's verdict", Duration::from_secs(60), || {
        let pods = json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]));
        pods["items"][0]["status"]["conditions"]
            .as_array()
            .is_some_and(|c| {
                c.iter().any(|c| {
                    c["type"] == "PodScheduled"
                        && c["status"] == "False"
                        && c["reason"] == "Unschedulable"
                })
            })
    })
    .await;

    // Through the scale subresource with kube-rs, as ebb scales.
    let kube = client(&cp).await;
    let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(kube.clone(), "default");
    let current = deployments.get_scale("hello").await.expect("get scale");
    assert_eq!(current.spec.and_then(|s| s.replicas), Some(1));
    scale(kube, "hello", 0).await;
    wait_for("no pods left", Duration::from_secs(60), || {
        let pods = json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]));
        pods["items"].as_array().is_some_and(Vec::is_empty)
    })
    .await;

    // The audit log saw the write to the scale subresource, by the administrator.
    wait_for(
        "the scale write in the audit log",
        Duration::from_secs(30),
        || {
            cp.audit_events().iter().any(|e| {
                e["verb"] == "patch"
                    && e["objectRef"]["subresource"] == "scale"
                    && e["objectRef"]["name"] == "hello"
                    && e["user"]["username"] == "ebb-test-admin"
            })
        },
    )
    .await;
}

/// The ready endpoint addresses of the Service's EndpointSlices.
fn ready_endpoints(cp: &ControlPlane, service: &str) -> Vec<String> {
    let slices = json(&cp.kubectl(&[
        "get",
        "endpointslices",
        "-l",
        &format!("kubernetes.io/service-name={service}"),
        "-o",
        "json",
    ]));
    let mut out = Vec::new();
    for slice in slices["items"].as_array().into_iter().flatten() {
        for e in slice["endpoints"].as_array().into_iter().flatten() {
            if e["conditions"]["ready"] == true {
                for a in e["addresses"].as_array().into_iter().flatten() {
                    out.push(a.as_str().unwrap_or_default().to_owned());
                }
            }
        }
    }
    out
}

/// Pods run for real: the node agent runs the Deployment's pod as a process on its own address,
/// reports it ready once its probe passes, the real EndpointSlice controller publishes that
/// address, the pod's process answers on it; scaled to zero, the process is stopped and the
/// endpoint goes away.
#[tokio::test]
async fn pods_run_as_processes_and_their_endpoints_are_published() {
    let (cp, kube, _agent) = cluster().await;
    if cp.needs_harness("checks the test node agent").is_some() {
        return;
    }
    apply(&cp, &hello());

    let mut endpoints = Vec::new();
    wait_for("a ready endpoint", Duration::from_secs(60), || {
        endpoints = ready_endpoints(&cp, "hello");
        !endpoints.is_empty()
    })
    .await;
    assert_eq!(endpoints.len(), 1, "{endpoints:?}");
    let addr = &endpoints[0];
    assert!(addr.starts_with("10.244.0."), "{addr}");
    let answer = http_get(&format!("{addr}:8080"), "/pid").expect("the pod answers");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let pid: i32 = answer
        .rsplit("\r\n\r\n")
        .next()
        .and_then(|b| b.trim().parse().ok())
        .unwrap_or_else(|| panic!("a pid: {answer}"));
    assert!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok());

    scale(kube, "hello", 0).await;
    wait_for("the pod gone", Duration::from_secs(60), || {
        let pods = json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]));
        pods["items"].as_array().is_some_and(Vec::is_empty)
    })
    .await;
    assert!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err(),
        "the pod's process {pid} still runs"
    );
    wait_for("no ready endpoint", Duration::from_secs(60), || {
        ready_endpoints(&cp, "hello").is_empty()
    })
    .await;
}

/// Kubernetes discovery (`k8s://SERVICE.NAMESPACE:PORT`) follows the real EndpointSlice
/// controller: the Service's port mapped to the pods' port, pods counted once ready, a pod that
/// terminates no longer an instance, none at zero; a port the Service does not have is an error.
#[tokio::test]
async fn kubernetes_discovery_follows_pods_becoming_ready_and_terminating() {
    use ebb::discovery::{Discovery, ServiceId, k8s::Endpoints};
    let (cp, kube, _agent) = cluster().await;
    if cp.needs_harness("runs pods").is_some() {
        return;
    }
    apply(&cp, &hello());
    let id = ServiceId::parse("k8s://hello.default:80").unwrap();
    let rx = Endpoints::new(kube.clone()).watch(&id).unwrap();
    let minute = Duration::from_secs(60);
    wait_for("one instance", minute, || rx.borrow().addrs.len() == 1).await;
    let first = rx.borrow().addrs[0];
    assert_eq!(first.port(), 8080, "the pods' port, not the Service's");
    assert!(first.ip().to_string().starts_with("10.244.0."), "{first}");
    assert_eq!(
        ready_endpoints(&cp, "hello"),
        [first.ip().to_string()],
        "what the controller published"
    );
    scale(kube.clone(), "hello", 3).await;
    wait_for("three instances", minute, || rx.borrow().addrs.len() == 3).await;
    // One endpoint by its pod's name, as ebb finds a peer replica.
    let pods = json(&cp.kubectl(&["get", "pods", "-o", "json"]));
    let (pod, ip) = pods["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap().to_owned(),
                p["status"]["podIP"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .find(|(_, ip)| rx.borrow().addrs.iter().any(|a| a.ip().to_string() == *ip))
        .expect("a pod behind the Service");
    let one = Endpoints::new(kube.clone())
        .watch(&ServiceId::parse(&format!("k8s://{pod}.hello.default:80")).unwrap())
        .unwrap();
    wait_for("the one pod's endpoint", minute, || {
        one.borrow()
            .addrs
            .iter()
            .map(|a| a.ip().to_string())
            .eq([ip.clone()])
    })
    .await;
    // A replica forwards to a peer so: by name, through the Service's endpoints.
    let cache = ebb::discovery::Cache::new(std::sync::Arc::new(Endpoints::new(kube.clone())));
    let peers = ebb::peers::Peers::new(
        Some("me".into()),
        ebb::peers::Resolver::Kubernetes(id.clone()),
        std::sync::Arc::new(ebb::discovery::Balanced::new(std::sync::Arc::new(cache))),
    );
    let get = |name: String| {
        let peers = &peers;
        async move {
            peers
                .send(
                    &name,
                    hyper::Method::GET,
                    "/health",
                    &[],
                    Default::default(),
                )
                .await
        }
    };
    let answer = get(pod.clone()).await.expect("the pod answers");
    assert_eq!(answer.status, 200, "{answer:?}");
    let e = get("nobody".into()).await.unwrap_err();
    assert!(matches!(e, ebb::peers::PeerError::Unavailable(..)), "{e}");
    scale(kube.clone(), "hello", 1).await;
    wait_for("one instance again", minute, || {
        rx.borrow().addrs.len() == 1
    })
    .await;
    scale(kube.clone(), "hello", 0).await;
    wait_for("no instance", minute, || rx.borrow().addrs.is_empty()).await;
    assert!(rx.borrow().generation >= 4, "every change published");
    let bad = Endpoints::new(kube)
        .watch(&ServiceId::parse("k8s://hello.default:81").unwrap())
        .unwrap();
    wait_for("the missing port named", minute, || {
        bad.borrow()
            .error
            .as_ref()
            .is_some_and(|e| e.contains("no port 81"))
    })
    .await;
}

fn alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// Annotated Services become routes (ebb's annotations and proxless'), their Deployment is
/// labelled as ebb's, a malformed one gets a Warning Event and no route; 100 concurrent requests
/// to the Deployment at zero make exactly one scale write and are all answered by the pod's
/// process once its EndpointSlice lists it ready; removing the annotations removes the route.
#[tokio::test]
async fn annotated_services_are_routes_and_a_cold_burst_is_one_scale_write() {
    let (cp, _, _agent) = cluster().await;
    apply(&cp, &serverless_hello("1h"));
    let data = tempfile::tempdir().unwrap();
    let ebb = serve_on(&cp, data.path(), &[]);

    wait_for("both routes in the log", Duration::from_secs(30), || {
        let r = routes(data.path());
        r.contains("default/hello") && r.contains("default/legacy")
    })
    .await;
    assert!(!routes(data.path()).contains("default/bad"));
    // Listed the cluster: ready for traffic.
    let ready = http_get(&ebb.admin.to_string(), "/readyz").expect("ebb answers");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    wait_for("the Deployment labelled", Duration::from_secs(30), || {
        json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["metadata"]["labels"]
            ["ebb.dev/managed"]
            == "true"
    })
    .await;
    wait_for(
        "a Warning Event on the bad Service",
        Duration::from_secs(30),
        || {
            let events = json(&cp.kubectl(&["get", "events", "-o", "json"]));
            events["items"].as_array().is_some_and(|items| {
                items.iter().any(|e| {
                    e["type"] == "Warning"
                        && e["reason"] == "InvalidRoute"
                        && e["involvedObject"]["name"] == "bad"
                        && e["message"]
                            .as_str()
                            .is_some_and(|m| m.contains("ebb.dev/domains"))
                })
            })
        },
    )
    .await;
    assert_eq!(scale_writes(&cp, "hello"), 0, "nothing woke it yet");

    // 100 at once, over both routes, while nothing runs.
    let burst = (0..100).map(|i| {
        let host = if i % 2 == 0 {
            "hello.test"
        } else {
            "legacy.test"
        };
        get(ebb.proxy, host, "/pid")
    });
    let answers = futures_util::future::join_all(burst).await;
    let pids: std::collections::BTreeSet<i32> = answers
        .iter()
        .map(|(status, body)| {
            assert_eq!(*status, 200, "{body}");
            pid_of(body)
        })
        .collect();
    assert_eq!(pids.len(), 1, "one pod answered them all: {pids:?}");
    if !cp.is_external() {
        assert!(alive(*pids.first().unwrap()));
    }
    assert_eq!(
        scale_writes(&cp, "hello"),
        1,
        "exactly one scale write woke the Deployment"
    );
    // Written as deploy/'s ServiceAccount, with its RBAC only.
    let writer: Vec<serde_json::Value> = cp
        .audit_events()
        .into_iter()
        .filter(|e| {
            e["verb"] == "patch"
                && e["objectRef"]["subresource"] == "scale"
                && e["objectRef"]["name"] == "hello"
        })
        .map(|e| e["user"]["username"].clone())
        .collect();
    assert_eq!(writer, vec!["system:serviceaccount:ebb:ebb"]);

    // The proxless annotations removed: the route goes, the other stays.
    cp.kubectl(&[
        "annotate",
        "service",
        "legacy",
        "proxless/domains-",
        "proxless/deployment-",
    ]);
    wait_for("the legacy route removed", Duration::from_secs(30), || {
        !routes(data.path()).contains("default/legacy")
    })
    .await;
    assert_eq!(get(ebb.proxy, "legacy.test", "/pid").await.0, 404);
    assert_eq!(get(ebb.proxy, "hello.test", "/pid").await.0, 200);
}

/// Idle, the Deployment is scaled to zero and its pod's process is gone; requests sent in a loop,
/// each as soon as the previous scale-down is written (while the pod is still stopping), are all
/// answered.
#[tokio::test]
async fn an_idle_deployment_goes_to_zero_and_no_request_across_the_scale_down_is_lost() {
    let (cp, _, _agent) = cluster().await;
    apply(&cp, &serverless_hello("1s"));
    // Only ebb's route leads to the Deployment (proxless' has the default idle time).
    cp.kubectl(&["delete", "service", "legacy"]);
    let data = tempfile::tempdir().unwrap();
    let ebb = serve_on(&cp, data.path(), &[]);
    wait_for("the route in the log", Duration::from_secs(30), || {
        routes(data.path()).contains("default/hello")
    })
    .await;
    let replicas = || {
        json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["spec"]["replicas"].clone()
    };
    let mut pids = Vec::new();
    for round in 0..3 {
        let (status, body) = get(ebb.proxy, "hello.test", "/pid").await;
        assert_eq!(status, 200, "round {round}: {body}");
        pids.push(pid_of(&body));
        wait_for("the idle scale-down", Duration::from_secs(60), || {
            replicas() == 0
        })
        .await;
    }
    wait_for("no pods left", Duration::from_secs(60), || {
        let pods = json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]));
        pods["items"].as_array().is_some_and(Vec::is_empty)
    })
    .await;
    if !cp.is_external() {
        for pid in pids {
            assert!(!alive(pid), "the pod's process {pid} still runs");
        }
    }
    // A request that met the stopping pod while it still served needed no wake, so the number of
    // wakes and scale-downs varies; each was decided with its reason.
    let reasons = || -> Vec<String> {
        common::events(data.path())
            .iter()
            .filter_map(|e| e["event"].get("ScaleRequested"))
            .map(|s| s["reason"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    wait_for(
        "the last scale-down in the log",
        Duration::from_secs(30),
        || reasons().last().is_some_and(|r| r == "idle"),
    )
    .await;
    let reasons = reasons();
    assert!(reasons.iter().any(|r| r == "wake"), "{reasons:?}");
}

/// One raw exchange with `addr` (a request or a TCP route's bytes), read to the close.
async fn raw(addr: std::net::SocketAddr, bytes: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(90), s.read_to_end(&mut got))
        .await
        .expect("an answer and a close in time")
        .unwrap();
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn waiting_pages_timeouts_tcp_routes_and_keep_warm_windows_on_kubernetes() {
    let (cp, _, _agent) = cluster().await;
    // The TCP route's port, in this test's own network namespace.
    let tcp: std::net::SocketAddr = "127.0.0.1:16380".parse().unwrap();
    let listen = format!("\"{tcp}\"");
    apply(
        &cp,
        &(hello_deployment(0)
            + &hello_service(
                "hello",
                &[
                    ("ebb.dev/domains", "hello.test"),
                    ("ebb.dev/deployment", "hello"),
                    ("ebb.dev/idle-after", "1s"),
                    ("ebb.dev/hold-timeout", "60s"),
                    ("ebb.dev/waiting-page", "\"true\""),
                    ("ebb.dev/response-timeout", "500ms"),
                    ("ebb.dev/listen", listen.as_str()),
                ],
            )),
    );
    let data = tempfile::tempdir().unwrap();
    let ebb = serve_on(&cp, data.path(), &[]);
    wait_for("the route in the log", Duration::from_secs(30), || {
        routes(data.path()).contains("default/hello")
    })
    .await;
    let replicas = || {
        json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["spec"]["replicas"].clone()
    };

    // A browser's page load at zero: the waiting page at once, and the wake it started.
    let page = raw(
        ebb.proxy,
        "GET /pid HTTP/1.1\r\nHost: hello.test\r\nAccept: text/html\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(page.starts_with("HTTP/1.1 503"), "{page}");
    assert!(
        page.contains("<h1>default/hello is starting</h1>"),
        "{page}"
    );
    wait_for(
        "the page's wake scales the Deployment",
        Duration::from_secs(30),
        || replicas() == 1,
    )
    .await;
    // An API client is held and served; a slow answer meets the response timeout.
    let (status, body) = get(ebb.proxy, "hello.test", "/pid").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = get(ebb.proxy, "hello.test", "/sleep?ms=5000").await;
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("response_timeout"), "{body}");
    // The TCP route: bytes spliced to the pod as they are.
    let answer = raw(tcp, "GET /pid HTTP/1.0\r\nHost: x\r\n\r\n").await;
    assert!(answer.contains(" 200 "), "{answer}");
    // A second Service naming the same listen address: no route at all (not half-made), a
    // Warning Event saying whose address it is; the first keeps serving.
    apply(
        &cp,
        &hello_service(
            "twin",
            &[
                ("ebb.dev/deployment", "hello"),
                ("ebb.dev/listen", listen.as_str()),
            ],
        ),
    );
    wait_for(
        "an InvalidRoute Warning Event on twin",
        Duration::from_secs(30),
        || {
            let events = json(&cp.kubectl(&["get", "events", "-o", "json"]));
            events["items"].as_array().is_some_and(|items| {
                items.iter().any(|e| {
                    e["type"] == "Warning"
                        && e["reason"] == "InvalidRoute"
                        && e["involvedObject"]["name"] == "twin"
                        && e["message"].as_str().is_some_and(|m| {
                            m.contains("is the listen address of Service default/hello already")
                        })
                })
            })
        },
    )
    .await;
    assert!(!routes(data.path()).contains("default/twin"));
    let answer = raw(tcp, "GET /pid HTTP/1.0\r\nHost: x\r\n\r\n").await;
    assert!(answer.contains(" 200 "), "{answer}");

    // Idle, it goes to zero; a keep-warm window open now brings it back without a request.
    wait_for("the idle scale-down", Duration::from_secs(60), || {
        replicas() == 0
    })
    .await;
    cp.kubectl(&[
        "annotate",
        "service",
        "hello",
        "--overwrite",
        r#"ebb.dev/warm=[{"schedule": "0 0 * * * *", "for": "2h", "min": 1, "timezone": "Asia/Tokyo"}]"#,
    ]);
    wait_for(
        "the window scales the Deployment up",
        Duration::from_secs(60),
        || replicas() == 1,
    )
    .await;
    let events = common::events(data.path());
    assert!(
        events
            .iter()
            .any(|e| e["event"]["WarmStarted"]["route"] == "default/hello"),
        "no WarmStarted in the log"
    );
    assert!(
        events
            .iter()
            .any(|e| e["event"]["ScaleRequested"]["reason"] == "warm"),
        "no scale-up for the window"
    );
}

/// The holder of the scale-down Lease, if any.
fn lease_holder(cp: &ControlPlane) -> Option<String> {
    let lease = cp
        .try_kubectl(&["get", "lease", "ebb-scaler", "-n", "ebb", "-o", "json"])
        .ok()?;
    json(&lease)["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_owned)
}

/// The reasons of the scale requests in an ebb's log.
fn scale_reasons(data: &std::path::Path) -> Vec<String> {
    common::events(data)
        .iter()
        .filter_map(|e| e["event"].get("ScaleRequested"))
        .map(|s| s["reason"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Two ebb processes in front of one Deployment: the first to take the Lease is the only one
/// that scales down; a bump by the other, landing between the leader's read and its write (held
/// open at a gate), makes the write fail with 409 Conflict and the Deployment stays up; SIGKILLed,
/// the leader's Lease runs out and the other takes it and scales the idle Deployment down.
#[tokio::test]
async fn two_ebbs_share_scaling_through_a_lease_and_a_conditioned_scale_down() {
    let (cp, _, _agent) = cluster().await;
    apply(&cp, &serverless_hello("1s"));
    cp.kubectl(&["delete", "service", "legacy"]);
    let gate = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let gate_arg = gate.path().to_str().unwrap();
    let mut a = serve_on(
        &cp,
        data_a.path(),
        &["--pod-name", "ebb-a", "--downscale-gate", gate_arg],
    );
    wait_for("ebb-a holding the Lease", Duration::from_secs(30), || {
        lease_holder(&cp).as_deref() == Some("ebb-a")
    })
    .await;
    let b = serve_on(&cp, data_b.path(), &["--pod-name", "ebb-b"]);
    wait_for("the route in both logs", Duration::from_secs(30), || {
        routes(data_a.path()).contains("default/hello")
            && routes(data_b.path()).contains("default/hello")
    })
    .await;

    // Woken through the replica that does not lead.
    let (status, body) = get(b.proxy, "hello.test", "/pid").await;
    assert_eq!(status, 200, "{body}");
    // Idle: the leader reads the Deployment, decides, and is held before its write.
    wait_for("the leader at the gate", Duration::from_secs(60), || {
        gate.path().join("held").exists()
    })
    .await;
    // A use on the other replica: it bumps the last-used annotation, moving the Deployment's
    // resourceVersion past the one the leader read.
    let used_at = ebb::clock::Clock::now_ms(&ebb::clock::SystemClock);
    let (status, body) = get(b.proxy, "hello.test", "/pid").await;
    assert_eq!(status, 200, "{body}");
    wait_for("the bump landed", Duration::from_secs(30), || {
        json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["metadata"]["annotations"]
            ["ebb.dev/last-used"]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v >= used_at)
    })
    .await;
    std::fs::write(gate.path().join("release"), "").unwrap();
    let conflicted = |cp: &ControlPlane| {
        cp.audit_events().iter().any(|e| {
            e["verb"] == "patch"
                && e["objectRef"]["subresource"] == "scale"
                && e["objectRef"]["name"] == "hello"
                && e["responseStatus"]["code"] == 409
        })
    };
    wait_for(
        "the scale-down refused with 409",
        Duration::from_secs(30),
        || conflicted(&cp),
    )
    .await;
    // The leader goes before its next try; the scale-down did not happen.
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let replicas = || {
        json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["spec"]["replicas"].clone()
    };
    assert_eq!(replicas(), 1);
    assert!(
        !scale_reasons(data_a.path()).iter().any(|r| r == "idle"),
        "the refused scale-down was recorded"
    );
    assert!(
        !scale_reasons(data_b.path()).iter().any(|r| r == "idle"),
        "a replica without the Lease scaled down"
    );

    // The other takes the Lease once it runs out, and scales the idle Deployment down.
    wait_for("ebb-b holding the Lease", Duration::from_secs(30), || {
        lease_holder(&cp).as_deref() == Some("ebb-b")
    })
    .await;
    wait_for(
        "the idle scale-down by ebb-b",
        Duration::from_secs(60),
        || replicas() == 0,
    )
    .await;
    wait_for(
        "the scale-down in ebb-b's log",
        Duration::from_secs(30),
        || scale_reasons(data_b.path()).iter().any(|r| r == "idle"),
    )
    .await;
    // Every scaling decision on Kubernetes is also an Event on the Deployment.
    let events = json(&cp.kubectl(&["get", "events", "-o", "json"]));
    let on_hello: Vec<&str> = events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["involvedObject"]["name"] == "hello" && e["involvedObject"]["kind"] == "Deployment"
        })
        .filter_map(|e| e["reason"].as_str())
        .collect();
    assert!(on_hello.contains(&"Wake"), "{on_hello:?}");
    assert!(on_hello.contains(&"Idle"), "{on_hello:?}");
    // The Service `bad` makes no route on either replica; only the Lease holder said so.
    let on_bad: Vec<&serde_json::Value> = events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["involvedObject"]["name"] == "bad" && e["reason"] == "InvalidRoute")
        .collect();
    assert_eq!(
        on_bad.len(),
        1,
        "one Event, not one per replica: {on_bad:?}"
    );
}

/// With the API server gone, a warm route keeps serving from what ebb already knows; back, ebb's
/// watches resume and a Service annotated right after is a route.
#[tokio::test]
async fn warm_routes_serve_while_the_api_server_is_away_and_watches_resume() {
    let (mut cp, _, _agent) = cluster().await;
    if cp
        .needs_harness("stops and restarts the API server")
        .is_some()
    {
        return;
    }
    apply(&cp, &serverless_hello("1h"));
    let data = tempfile::tempdir().unwrap();
    // ebb's log, to count what it says while the API server is away.
    let log = data.path().join("ebb.log");
    let kubeconfig = deployed_service_account(&cp);
    let mut args = TEST_TIMING.to_vec();
    args.extend_from_slice(&[
        "--orchestrator",
        "kubernetes",
        "--pod-namespace",
        "ebb",
        "--namespace",
        "default",
    ]);
    let ebb = common::serve_logged(
        &data.path().join("data"),
        None,
        None,
        &args,
        &[
            ("KUBECONFIG", kubeconfig.as_os_str()),
            (
                "EBB_LOG",
                std::ffi::OsStr::new("warn,ebb_kube::health=info"),
            ),
        ],
        Some(&log),
    );
    let data_dir = data.path().join("data");
    wait_for("the route in the log", Duration::from_secs(30), || {
        routes(&data_dir).contains("default/hello")
    })
    .await;
    let (status, body) = get(ebb.proxy, "hello.test", "/pid").await;
    assert_eq!(status, 200, "{body}");
    let pid = pid_of(&body);

    cp.stop_apiserver();
    assert!(cp.try_kubectl(&["get", "--raw", "/readyz"]).is_err());
    let answers =
        futures_util::future::join_all((0..20).map(|_| get(ebb.proxy, "hello.test", "/pid"))).await;
    for (status, body) in answers {
        assert_eq!(status, 200, "{body}");
        assert_eq!(pid_of(&body), pid);
    }

    cp.restart_apiserver().await;
    apply(
        &cp,
        &hello_service(
            "late",
            &[
                ("ebb.dev/domains", "late.test"),
                ("ebb.dev/deployment", "hello"),
            ],
        ),
    );
    wait_for("the new route in the log", Duration::from_secs(60), || {
        routes(&data_dir).contains("default/late")
    })
    .await;
    let (status, body) = get(ebb.proxy, "late.test", "/pid").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(pid_of(&body), pid);
    // Said once each way, and no ERROR line from the client's every failed request.
    wait_for(
        "ebb says the API server is back",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("reachable again")
        },
    )
    .await;
    let said = std::fs::read_to_string(&log).unwrap();
    let count = |what: &str| said.lines().filter(|l| l.contains(what)).count();
    assert_eq!(count("API server cannot be reached"), 1, "{said}");
    assert_eq!(count("API server is reachable again"), 1, "{said}");
    assert_eq!(count("ERROR"), 0, "{said}");
}

/// Copies a directory tree.
fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The test image's name and tag (`latest` if it names none).
fn image_and_tag() -> (String, String) {
    let image = test_image();
    match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name.to_owned(), tag.to_owned()),
        _ => (image, "latest".to_owned()),
    }
}

/// The ready ebb pods of namespace `ebb`: their names and addresses.
fn ready_ebbs(cp: &ControlPlane) -> Vec<(String, String)> {
    common::ebbkube::ready_pods(cp, "ebb", "app.kubernetes.io/name=ebb")
}

/// `kubectl apply -k` of `deploy/` under a test overlay (ebb from the image map, listening on its
/// pod's address, with a data directory per pod under `WORK/data`, the ServiceAccount's token as its
/// kubeconfig; a hostPath PersistentVolume per replica; `env` added to ebb's container), then
/// waits for the two pods to be ready. Returns the work directory and the ready pods' names and
/// addresses, by name.
async fn deploy_two_ebbs(
    cp: &ControlPlane,
    env: &[(&str, &str)],
) -> (tempfile::TempDir, Vec<(String, String)>) {
    // The ServiceAccount first, for its token from the TokenRequest API, which the pods' kubeconfig
    // carries; `apply` then takes the account over as deploy/ defines it.
    cp.kubectl(&["create", "namespace", "ebb"]);
    cp.kubectl(&["create", "serviceaccount", "ebb", "-n", "ebb"]);
    let token = cp.kubectl(&["create", "token", "ebb", "-n", "ebb", "--duration", "1h"]);
    let kubeconfig = cp.kubeconfig_with_token("ebb", token.trim());
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    copy_tree(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy")),
        &w.join("deploy"),
    );
    // The harness's node agent mounts no volumes and gives pods no service-account token: each
    // pod gets a data directory of its own and the token's kubeconfig, and a hostPath volume per
    // replica stands in for a provisioner. A real cluster's nodes do all of that themselves.
    let harness = !cp.is_external();
    let mut pvs = String::new();
    for i in 0..2 {
        let dir = w.join(format!("pv-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        pvs.push_str(&format!(
            "---\napiVersion: v1\nkind: PersistentVolume\nmetadata:\n  name: ebb-test-{i}\n\
             spec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadWriteOnce]\n  \
             hostPath: {{path: {}}}\n",
            dir.display()
        ));
    }
    std::fs::create_dir_all(w.join("overlay")).unwrap();
    std::fs::write(w.join("overlay/pvs.yaml"), pvs).unwrap();
    let data = w.join("data");
    let (pv_resource, data_dir, kubeconfig_env) = if harness {
        (
            "- pvs.yaml\n".to_owned(),
            format!("\n      - --data-dir={}/$(POD_NAME)", data.display()),
            format!(
                "    - op: add\n      path: /spec/template/spec/containers/0/env/-\n      \
                 value: {{name: KUBECONFIG, value: {}}}\n",
                kubeconfig.display()
            ),
        )
    } else {
        Default::default()
    };
    std::fs::write(
        w.join("overlay/kustomization.yaml"),
        format!(
            r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- ../deploy
{pv_resource}images:
- {{name: ghcr.io/ebb-dev/ebb, newName: {image}, newTag: "{tag}"}}
patches:
- target: {{kind: StatefulSet, name: ebb}}
  patch: |
    - op: replace
      path: /spec/template/spec/containers/0/args
      value:
      - serve
      - --orchestrator=kubernetes
      - --kube-auth
      - --api-token={FN_TOKEN}
      - --listen=$(POD_IP):8080
      - --admin-listen=$(POD_IP):8081{data_dir}
      - {timing}
    - op: add
      path: /spec/template/spec/containers/0/env/-
      value: {{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
{kubeconfig_env}    - op: add
      path: /spec/template/spec/containers/0/env/-
      value: {{name: EBB_LOG, value: warn}}
{extra_env}"#,
            image = image_and_tag().0,
            tag = image_and_tag().1,
            timing = TEST_TIMING.join("\n      - "),
            extra_env = env
                .iter()
                .map(|(k, v)| format!(
                    "    - op: add\n      path: /spec/template/spec/containers/0/env/-\n      \
                     value: {{name: {k}, value: \"{v}\"}}\n"
                ))
                .collect::<String>(),
        ),
    )
    .unwrap();
    cp.kubectl(&[
        "apply",
        "--server-side",
        "-k",
        w.join("overlay").to_str().unwrap(),
    ]);

    let mut ips = Vec::new();
    wait_for("two ready ebb pods", Duration::from_secs(120), || {
        ips = ready_ebbs(cp);
        ips.len() == 2
    })
    .await;
    // Each replica's volume claim was bound to one of the PersistentVolumes.
    let claims = json(&cp.kubectl(&["get", "pvc", "-n", "ebb", "-o", "json"]));
    let bound = claims["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["status"]["phase"] == "Bound")
        .count();
    assert_eq!(bound, 2, "{claims}");
    ips.sort();
    (work, ips)
}

/// `kubectl apply -k` of `deploy/` under a test overlay brings up two ebb pods through the real
/// StatefulSet controller, volume binding and scheduler; each serves an annotated Service, waking
/// its Deployment; an image function made through one of them is owned by ebb's StatefulSet (the
/// garbage collector removes it with ebb) and answers.
#[tokio::test]
async fn kubectl_apply_k_deploy_brings_up_two_ebbs_that_serve_annotated_services() {
    let (cp, _, _agent) = cluster().await;
    let (work, pods) = deploy_two_ebbs(&cp, &[]).await;
    let w = work.path();
    let ips: Vec<String> = pods.into_iter().map(|(_, ip)| ip).collect();
    apply(&cp, &serverless_hello("1h"));
    for ip in &ips {
        let proxy: std::net::SocketAddr = format!("{ip}:8080").parse().unwrap();
        // 404 until the replica's Service watch has delivered the route.
        let answer = wait_until(
            "a route for hello.test",
            Duration::from_secs(60),
            || async {
                let answer = get(proxy, "hello.test", "/pid").await;
                (answer.0 != 404).then_some(answer)
            },
        )
        .await;
        assert_eq!(answer.0, 200, "{ip}: {}", answer.1);
    }
    wait_for("a Lease held by a replica", Duration::from_secs(30), || {
        lease_holder(&cp).is_some_and(|h| h == "ebb-0" || h == "ebb-1")
    })
    .await;

    // An image function made by a replica is owned by ebb's StatefulSet, and runs.
    let admin: std::net::SocketAddr = format!("{}:8081", ips[0]).parse().unwrap();
    let (status, body) = send(
        admin,
        "POST",
        "ebb",
        "/api/funcs/template",
        Some(FN_TOKEN),
        &image_template("owned", "upper"),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let d = wait_until(
        "the function's Deployment",
        Duration::from_secs(30),
        || async { function_deployment(&cp, "fn-owned") },
    )
    .await;
    let owners = &d["metadata"]["ownerReferences"];
    assert_eq!(owners[0]["kind"], "StatefulSet", "{d}");
    assert_eq!(owners[0]["name"], "ebb", "{d}");
    let (status, body) = send(
        admin,
        "POST",
        "ebb",
        "/api/funcs/owned?wait=60",
        Some(FN_TOKEN),
        "abc",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"ABC\""), "{body}");

    // deploy/ defines the Func resource from ebb's types: the API server takes a template in the
    // seed's shape against it, and refuses a field the type does not have.
    wait_for(
        "the Func definition established",
        Duration::from_secs(30),
        || {
            json(&cp.kubectl(&["get", "crd", "functions.ebb.dev", "-o", "json"]))["status"]
            ["conditions"]
            .as_array()
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Established" && c["status"] == "True")
            })
        },
    )
    .await;
    let func = r#"
apiVersion: ebb.dev/v1alpha1
kind: Func
metadata: {name: shout, namespace: ebb}
spec: {name: shout, function: upper, image: ebb, left: classify, maxInstanceNum: 3}
"#;
    apply(&cp, func);
    let got = json(&cp.kubectl(&["get", "fn", "shout", "-n", "ebb", "-o", "json"]));
    assert_eq!(got["spec"]["maxInstanceNum"], 3, "{got}");
    let bad = w.join("bad-func.yaml");
    std::fs::write(&bad, func.replace("maxInstanceNum: 3", "replicas: 3")).unwrap();
    let refused = cp
        .try_kubectl(&["apply", "--server-side", "-f", bad.to_str().unwrap()])
        .expect_err("a Func with a field its type lacks");
    assert!(refused.contains("replicas"), "{refused}");
}

/// ebb with deploy/'s permissions less one (patching `deployments/scale`): a request to the
/// Deployment at zero is refused after its hold time instead of hanging, ebb keeps serving, the
/// forbidden write is one clear line in its log however often it is tried, and a Warning Event on
/// the Deployment says what failed.
#[tokio::test]
async fn a_missing_permission_is_one_log_line_and_a_warning_event_not_a_crash() {
    let cp = ControlPlane::start().await;
    apply(
        &cp,
        &serverless_hello("1h").replace("ebb.dev/hold-timeout: 60s", "ebb.dev/hold-timeout: 2s"),
    );
    deployed_service_account(&cp);
    // The ServiceAccount `weak`: deploy/'s rules without the scale write.
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/base/rbac-cluster.yaml"
    ))
    .unwrap();
    let role = rules
        .split("---")
        .next()
        .unwrap()
        .replace("name: ebb\n", "name: ebb-weak\n")
        .replace(
            "  resources: [deployments/scale, statefulsets/scale]\n  verbs: [get, patch]",
            "  resources: [deployments/scale, statefulsets/scale]\n  verbs: [get]",
        );
    assert!(role.contains("verbs: [get]\n"), "{role}");
    apply(&cp, &role);
    cp.kubectl(&["create", "serviceaccount", "weak", "-n", "ebb"]);
    cp.kubectl(&[
        "create",
        "clusterrolebinding",
        "ebb-weak",
        "--clusterrole=ebb-weak",
        "--serviceaccount=ebb:weak",
    ]);
    cp.kubectl(&[
        "create",
        "rolebinding",
        "ebb-weak-lease",
        "-n",
        "ebb",
        "--role=ebb-own",
        "--serviceaccount=ebb:weak",
    ]);
    let token = cp.kubectl(&["create", "token", "weak", "-n", "ebb", "--duration", "1h"]);
    let kubeconfig = cp.kubeconfig_with_token("weak", token.trim());
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("ebb.log");
    let ebb = common::serve_logged(
        data.path(),
        None,
        None,
        &[
            "--orchestrator",
            "kubernetes",
            "--namespace",
            "default",
            "--pod-namespace",
            "ebb",
            "--pod-name",
            "ebb-weak",
        ],
        &[("KUBECONFIG", kubeconfig.as_os_str())],
        Some(&log),
    );
    wait_for("the route in the log", Duration::from_secs(30), || {
        routes(data.path()).contains("default/hello")
    })
    .await;
    for _ in 0..3 {
        let (status, body) = get(ebb.proxy, "hello.test", "/pid").await;
        assert_eq!(status, 503, "{body}");
    }
    let health = http_get(&ebb.admin.to_string(), "/healthz").expect("ebb answers");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    wait_for(
        "a Warning Event on the Deployment",
        Duration::from_secs(30),
        || {
            let events = json(&cp.kubectl(&["get", "events", "-o", "json"]));
            events["items"].as_array().is_some_and(|items| {
                items.iter().any(|e| {
                    e["type"] == "Warning"
                        && e["reason"] == "ScaleFailed"
                        && e["involvedObject"]["name"] == "hello"
                        && e["message"]
                            .as_str()
                            .is_some_and(|m| m.contains("forbidden"))
                })
            })
        },
    )
    .await;
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("scaling default/hello failed"))
        .collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert!(lines[0].contains("forbidden"), "{}", lines[0]);

    // With no permission to list Services at all, ebb runs but is not ready for traffic.
    cp.kubectl(&["create", "serviceaccount", "blind", "-n", "ebb"]);
    let token = cp.kubectl(&["create", "token", "blind", "-n", "ebb", "--duration", "1h"]);
    let kubeconfig = cp.kubeconfig_with_token("blind", token.trim());
    let data = tempfile::tempdir().unwrap();
    let blind = common::serve_logged(
        data.path(),
        None,
        None,
        &["--orchestrator", "kubernetes", "--pod-namespace", "ebb"],
        &[("KUBECONFIG", kubeconfig.as_os_str())],
        Some(&logs.path().join("blind.log")),
    );
    let ready = http_get(&blind.admin.to_string(), "/readyz").expect("ebb answers");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(ready.contains(r#""code":"not_ready""#), "{ready}");
    let health = http_get(&blind.admin.to_string(), "/healthz").expect("ebb answers");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
}

/// `kubectl create serviceaccount NAME -n ebb` bound to `role` (one of deploy/'s Roles over ebb's
/// APIs, none for no binding), and a token of it from the TokenRequest API.
fn api_user(cp: &ControlPlane, name: &str, role: Option<&str>) -> String {
    cp.kubectl(&["create", "serviceaccount", name, "-n", "ebb"]);
    if let Some(role) = role {
        cp.kubectl(&[
            "create",
            "rolebinding",
            name,
            "-n",
            "ebb",
            &format!("--role={role}"),
            &format!("--serviceaccount=ebb:{name}"),
        ]);
    }
    let token = cp.kubectl(&["create", "token", name, "-n", "ebb", "--duration", "1h"]);
    token.trim().to_owned()
}

#[tokio::test]
async fn service_account_tokens_open_what_rbac_allows_them() {
    let cp = ControlPlane::start().await;
    let kubeconfig = deployed_service_account(&cp);
    let viewer = api_user(&cp, "viewer", Some("ebb-viewer"));
    let runner = api_user(&cp, "runner", Some("ebb-runner"));
    let outsider = api_user(&cp, "outsider", None);
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("ebb.log");
    let ebb = common::serve_logged(
        data.path(),
        None,
        None,
        &[
            "--orchestrator",
            "kubernetes",
            "--pod-namespace",
            "ebb",
            "--kube-auth",
            "--kube-auth-cache-seconds",
            "1",
            "--admin-token",
            "static-admin-token",
        ],
        &[
            ("KUBECONFIG", kubeconfig.as_os_str()),
            ("EBB_LOG", std::ffi::OsStr::new("ebb=debug")),
        ],
        Some(&log),
    );
    let admin = ebb.admin;
    let api =
        move |method: &'static str, path: &'static str, token: Option<&str>, body: &'static str| {
            let token = token.map(str::to_owned);
            async move { send(admin, method, "ebb", path, token.as_deref(), body).await }
        };
    let code = |body: &str| json(body)["code"].as_str().unwrap_or_default().to_owned();

    // ebb-viewer reads the admin API, the functions API (which has no token of its own) and the
    // calls, and changes nothing.
    let (status, body) = api("GET", "/admin/routes", Some(viewer.as_str()), "").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api("GET", "/api/funcs/template", Some(viewer.as_str()), "").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api("GET", "/v1/calls", Some(viewer.as_str()), "").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api("DELETE", "/admin/routes/nothing", Some(viewer.as_str()), "").await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(code(&body), "forbidden", "{body}");
    assert!(body.contains("system:serviceaccount:ebb:viewer"), "{body}");
    assert!(body.contains("delete"), "{body}");
    let (status, body) = api(
        "POST",
        "/runner/states",
        Some(viewer.as_str()),
        r#"{"ids":[]}"#,
    )
    .await;
    assert_eq!((status, code(&body)), (403, "forbidden".into()), "{body}");

    // ebb-runner works the queue and reads calls, but cannot touch routes.
    let (status, body) = api(
        "POST",
        "/runner/states",
        Some(runner.as_str()),
        r#"{"ids":[]}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api("GET", "/v1/calls", Some(runner.as_str()), "").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api("GET", "/admin/routes", Some(runner.as_str()), "").await;
    assert_eq!((status, code(&body)), (403, "forbidden".into()), "{body}");

    // A ServiceAccount bound to nothing is known but allowed nothing; a token Kubernetes does not
    // know, or none, is unauthorized.
    let (status, body) = api("GET", "/admin/routes", Some(outsider.as_str()), "").await;
    assert_eq!((status, code(&body)), (403, "forbidden".into()), "{body}");
    // The viewer's token with one character of its claims changed: its signature no longer holds.
    let at = viewer.find('.').expect("a JWT") + 8;
    let other = if &viewer[at..=at] == "A" { "B" } else { "A" };
    let forged = format!("{}{other}{}", &viewer[..at], &viewer[at + 1..]);
    for token in [Some(forged.as_str()), Some("not-a-token"), None] {
        let (status, body) = api("GET", "/admin/routes", token, "").await;
        assert_eq!(
            (status, code(&body)),
            (401, "unauthorized".into()),
            "{body}"
        );
    }
    // The static token works beside them: allowed, and the route is simply not there.
    let (status, body) = api(
        "DELETE",
        "/admin/routes/nothing",
        Some("static-admin-token"),
        "",
    )
    .await;
    assert_eq!((status, code(&body)), (404, "not_found".into()), "{body}");

    // The dashboard signs in with a token RBAC lets read it.
    let (status, body) = api("POST", "/ui/login", None, "").await;
    assert_eq!(status, 400, "{body}");
    let login = |token: &str| format!(r#"{{"token":"{token}"}}"#);
    let viewer_login = login(&viewer);
    let (status, body) = send(ebb.admin, "POST", "ebb", "/ui/login", None, &viewer_login).await;
    assert_eq!(status, 204, "{body}");
    let runner_login = login(&runner);
    let (status, body) = send(ebb.admin, "POST", "ebb", "/ui/login", None, &runner_login).await;
    assert_eq!((status, code(&body)), (403, "forbidden".into()), "{body}");

    // A revoked binding closes the API once the cached answer is older than its second.
    cp.kubectl(&["delete", "rolebinding", "viewer", "-n", "ebb"]);
    wait_until("the viewer refused", Duration::from_secs(30), || async {
        let (status, _) = api("GET", "/admin/routes", Some(viewer.as_str()), "").await;
        (status == 403).then_some(())
    })
    .await;

    // The log, at debug, tells whose tokens were reviewed, and holds no token.
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("system:serviceaccount:ebb:runner"), "{text}");
    for token in [&viewer, &runner, &outsider, &forged] {
        assert!(
            !text.contains(token.as_str()),
            "a token is in the log:\n{text}"
        );
    }
}

/// Waits for a Warning Event with `reason` on the object `name` in ebb's namespace.
async fn warning_event(cp: &ControlPlane, reason: &str, name: &str) {
    wait_for(
        &format!("a {reason} Warning Event on {name}"),
        Duration::from_secs(30),
        || {
            let events = json(&cp.kubectl(&["get", "events", "-n", "ebb", "-o", "json"]));
            events["items"].as_array().is_some_and(|items| {
                items.iter().any(|e| {
                    e["type"] == "Warning"
                        && e["reason"] == reason
                        && e["involvedObject"]["name"] == name
                })
            })
        },
    )
    .await;
}

/// The functions API's bearer token in the function tests.
const FN_TOKEN: &str = "fn-token";

/// The JSON of a functions API call's answer.
async fn fn_api(
    ebb: &common::Ebb,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, serde_json::Value) {
    let (status, body) = send(ebb.admin, method, "ebb", path, Some(FN_TOKEN), body).await;
    let v = serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
    (status, v)
}

/// Creates a template through the functions API; fails the test unless it is created (201).
async fn create_template(ebb: &common::Ebb, body: &str) {
    let (status, v) = fn_api(ebb, "POST", "/api/funcs/template", body).await;
    assert_eq!(status, 201, "{v}");
}

/// The function's Deployment in ebb's namespace, if there is one.
fn function_deployment(cp: &ControlPlane, name: &str) -> Option<serde_json::Value> {
    cp.try_kubectl(&["get", "deployment", name, "-n", "ebb", "-o", "json"])
        .ok()
        .map(|s| json(&s))
}

/// Whether neither the function's Deployment nor its Service is in ebb's namespace.
fn function_objects_gone(cp: &ControlPlane, name: &str) -> bool {
    function_deployment(cp, name).is_none()
        && cp
            .try_kubectl(&["get", "service", name, "-n", "ebb"])
            .is_err()
}

/// An image template: the example app from the `ebb` image, listening on its pod's address.
fn image_template(name: &str, function: &str) -> String {
    serde_json::json!({
        "name": name,
        "function": function,
        "image": test_image(),
        "command": ["ebb", "example-app", "--host", "$(POD_IP)"],
    })
    .to_string()
}

/// A function template with an image becomes a Deployment and a Service that ebb makes in its
/// namespace (labelled as the function's, applied by ebb's field manager with deploy/'s RBAC), at
/// the replicas the log asks (none); an invocation wakes it through `/scale` and is answered by
/// the pod's process; a changed template rolls the pods; a name someone else's object has is
/// never taken over (a Warning Event says why); deleting the template deletes both objects, and
/// a replica of ebb that no longer has a function deletes what it made for it when it starts.
#[tokio::test]
async fn image_functions_run_as_deployments_and_services_that_ebb_makes() {
    let (cp, _, _agent) = cluster().await;
    let data = tempfile::tempdir().unwrap();
    let mut args = TEST_TIMING.to_vec();
    args.extend(["--api-token", FN_TOKEN]);
    let ebb = serve_deployed(&cp, data.path(), &args);

    create_template(&ebb, &image_template("shout", "upper")).await;
    let d = wait_until(
        "the function's Deployment",
        Duration::from_secs(30),
        || async { function_deployment(&cp, "fn-shout") },
    )
    .await;
    assert_eq!(d["metadata"]["labels"]["ebb.dev/function"], "shout");
    assert_eq!(
        d["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "ebb"
    );
    assert_eq!(d["metadata"]["annotations"]["ebb.dev/owner"], "ebb");
    assert_eq!(d["spec"]["replicas"], 0, "no instance asked for yet");
    let fields = json(&cp.kubectl(&[
        "get",
        "deployment",
        "fn-shout",
        "-n",
        "ebb",
        "--show-managed-fields",
        "-o",
        "json",
    ]));
    let managers: Vec<&str> = fields["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert!(managers.contains(&"ebb"), "{managers:?}");
    let service = json(&cp.kubectl(&["get", "service", "fn-shout", "-n", "ebb", "-o", "json"]));
    assert_eq!(service["spec"]["selector"]["ebb.dev/function"], "shout");

    // Invoked and waited for: woken through /scale, answered by the pod's process.
    let (status, v) = fn_api(&ebb, "POST", "/api/funcs/shout?wait=60", "abc").await;
    assert_eq!(
        (status, &v["result"]),
        (200, &serde_json::json!("ABC")),
        "{v}"
    );
    let pods = json(&cp.kubectl(&[
        "get",
        "pods",
        "-n",
        "ebb",
        "-l",
        "ebb.dev/function=shout",
        "-o",
        "json",
    ]));
    assert!(
        pods["items"].as_array().is_some_and(|p| !p.is_empty()),
        "{pods}"
    );
    assert!(
        cp.audit_events().iter().any(|e| e["verb"] == "patch"
            && e["objectRef"]["subresource"] == "scale"
            && e["objectRef"]["name"] == "fn-shout"
            && e["user"]["username"] == "system:serviceaccount:ebb:ebb"),
        "woken through /scale as deploy/'s ServiceAccount"
    );

    // Changed: the Deployment follows, its pods roll, the new function answers.
    let (status, v) = fn_api(
        &ebb,
        "PUT",
        "/api/funcs/template/shout",
        &image_template("shout", "reverse"),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    wait_for("the Deployment changed", Duration::from_secs(30), || {
        function_deployment(&cp, "fn-shout").is_some_and(|d| {
            d["spec"]["template"]["spec"]["containers"][0]["env"]
                .as_array()
                .is_some_and(|env| {
                    env.iter()
                        .any(|e| e["name"] == "EBB_FUNCTION" && e["value"] == "reverse")
                })
        })
    })
    .await;
    wait_until(
        "the new function answering",
        Duration::from_secs(60),
        || async {
            let (status, v) = fn_api(&ebb, "POST", "/api/funcs/shout?wait=60", "abc").await;
            assert_eq!(status, 200, "{v}");
            (v["result"] == "cba").then_some(())
        },
    )
    .await;

    // On Kubernetes a template needs an image: one with a command only does not run here.
    let command_only = serde_json::json!({
        "name": "local", "function": "upper", "command": ["ebb", "example-app"],
    });
    create_template(&ebb, &command_only.to_string()).await;
    let (status, v) = fn_api(&ebb, "POST", "/api/funcs/local", "x").await;
    assert_eq!(
        (status, &v["code"]),
        (501, &serde_json::json!("not_runnable")),
        "{v}"
    );
    assert!(
        v["error"].as_str().is_some_and(|e| e.contains("image")),
        "{v}"
    );

    // Someone else's Deployment has the name: left alone, a Warning Event on it says why.
    apply(
        &cp,
        &hello_deployment(0).replace(
            "name: hello\n  namespace: default",
            "name: fn-taken\n  namespace: ebb",
        ),
    );
    create_template(&ebb, &image_template("taken", "upper")).await;
    warning_event(&cp, "FunctionConflict", "fn-taken").await;
    let theirs = function_deployment(&cp, "fn-taken").expect("still there");
    assert!(
        theirs["metadata"]["labels"]
            .get("ebb.dev/function")
            .is_none(),
        "{theirs}"
    );
    assert!(
        cp.try_kubectl(&["get", "service", "fn-taken", "-n", "ebb"])
            .is_err()
    );

    // Deleted: both objects go, and the pods with them.
    assert_eq!(
        fn_api(&ebb, "DELETE", "/api/funcs/template/shout", "")
            .await
            .0,
        200
    );
    wait_for(
        "the function's objects deleted",
        Duration::from_secs(60),
        || function_objects_gone(&cp, "fn-shout"),
    )
    .await;

    // A function this replica made, whose template went while it was away (its Func deleted),
    // unknown to it after a restart with an empty log: deleted.
    create_template(&ebb, &image_template("stale", "upper")).await;
    wait_for(
        "the stale function's Deployment",
        Duration::from_secs(30),
        || function_deployment(&cp, "fn-stale").is_some(),
    )
    .await;
    drop(ebb);
    cp.kubectl(&["delete", "fn", "stale", "-n", "ebb"]);
    let fresh = tempfile::tempdir().unwrap();
    let _ebb = serve_deployed(&cp, fresh.path(), &args);
    wait_for(
        "the stale function's objects deleted",
        Duration::from_secs(30),
        || function_objects_gone(&cp, "fn-stale"),
    )
    .await;
    assert!(
        function_deployment(&cp, "fn-taken").is_some(),
        "someone else's stays"
    );
}

/// `EBB_TEST_KUBECONFIG` runs the tests against a cluster they did not start: here the harness's
/// own, as if it were someone else's (the tests in a second process of this test binary start
/// nothing, make no network namespace, run no node agent, read the audit log the variable
/// `EBB_TEST_AUDIT_LOG` names, take the cluster one at a time and clear what the one before left).
#[tokio::test]
async fn the_same_tests_run_against_a_cluster_named_by_ebb_test_kubeconfig() {
    let (cp, _, _agent) = cluster().await;
    if cp
        .needs_harness("is the harness's check of the external mode")
        .is_some()
    {
        return;
    }
    let tests = [
        "annotated_services_are_routes_and_a_cold_burst_is_one_scale_write",
        "image_functions_run_as_deployments_and_services_that_ebb_makes",
    ];
    let out = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(tests)
        .args(["--exact", "--test-threads=2", "--nocapture"])
        .env("EBB_TEST_KUBECONFIG", &cp.kubeconfig)
        .env("EBB_TEST_AUDIT_LOG", &cp.audit_log)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("test result: ok. 2 passed"),
        "{stdout}\n{stderr}"
    );
}

const RUNNER_TOKEN: &str = "runner-token";

/// The pid of the ebb whose data directory is `data` (a pod of the harness's node agent).
fn ebb_pid(data: &std::path::Path) -> Option<i32> {
    let want = format!("--data-dir={}", data.display());
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let e = e.ok()?;
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        cmdline
            .split(|b| *b == 0)
            .any(|a| a == want.as_bytes())
            .then_some(pid)
    })
}

/// `ebb runner` named `id`, talking to the ebb replica at `ip` (its runner API and proxy).
fn ebb_runner(ip: &str, id: &str) -> common::EbbRunner {
    let at = |port: u16| std::net::SocketAddr::new(ip.parse().unwrap(), port);
    common::ebb_runner(at(8081), at(8080), RUNNER_TOKEN, id, 4, &[])
}

/// Two ebb replicas from `deploy/` with Apache Kafka as the call queue: calls enqueued on either
/// run on the runners of both (the built-in ones and an `ebb runner` process talking to each),
/// each decided by its owner only (the replica its id names), and every call and function
/// instance reads the same through either replica. The owner SIGKILLed mid-stream: the other
/// answers 503 for its calls and decides nothing for them; back (the StatefulSet makes the pod
/// again, on its volume), every acknowledged call ends, started once.
#[tokio::test]
async fn two_replicas_on_kafka_decide_each_call_once_through_its_owner() {
    let (cp, _, _agent) = cluster().await;
    if cp
        .needs_harness("starts Apache Kafka beside the pods and SIGKILLs a pod's process")
        .is_some()
    {
        return;
    }
    // The broker in the test's network namespace, on its loopback, which the pods share.
    let broker = common::broker().await;
    let brokers = broker.addr.to_string();
    let (work, pods) = deploy_two_ebbs(
        &cp,
        &[
            ("EBB_KAFKA_BROKERS", &brokers),
            ("EBB_RUNNER_TOKEN", RUNNER_TOKEN),
        ],
    )
    .await;
    let names: Vec<&str> = pods.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["ebb-0", "ebb-1"]);
    let admin =
        |i: usize| -> std::net::SocketAddr { format!("{}:8081", pods[i].1).parse().unwrap() };
    apply(&cp, &serverless_hello("1h"));
    let enqueue = |i: usize| async move {
        let body = r#"{"target": "default/hello", "payload": {"method": "GET", "path": "/pid"}}"#;
        // 404 until the replica's Service watch has delivered the route.
        let (status, body) = wait_until(
            "the route as a call target",
            Duration::from_secs(60),
            || async {
                let a = send(
                    admin(i),
                    "POST",
                    "ebb",
                    "/runner/enqueue",
                    Some(RUNNER_TOKEN),
                    body,
                )
                .await;
                (a.0 != 404).then_some(a)
            },
        )
        .await;
        assert_eq!(status, 200, "{body}");
        json(&body)["id"].as_str().unwrap().to_owned()
    };
    let call = |i: usize, id: String| async move {
        let (status, body) = send(
            admin(i),
            "GET",
            "ebb",
            &format!("/v1/calls/{id}"),
            Some(RUNNER_TOKEN),
            "",
        )
        .await;
        (status, json(&body))
    };
    let final_state = |id: String| async move {
        wait_until("the call's end", Duration::from_secs(90), || {
            let id = id.clone();
            async move {
                let (status, c) = call(0, id.clone()).await;
                (status == 200
                    && ["success", "error", "timeout"].contains(&c["state"].as_str().unwrap_or("")))
                .then_some(c)
            }
        })
        .await
    };
    // An `ebb runner` beside each replica, as well as the built-in ones.
    let ext0 = ebb_runner(&pods[0].1, "ext-0");
    let ext1 = ebb_runner(&pods[1].1, "ext-1");
    // Calls on both replicas, in rounds, until every runner has run some (the consumer group
    // spreads the partitions as the runners join).
    let every_runner = ["builtin-ebb-0", "builtin-ebb-1", "ext-0", "ext-1"];
    let mut ran_on = std::collections::BTreeSet::new();
    let mut ids = Vec::new();
    let clock = ebb::clock::Stopwatch::start();
    while !every_runner.iter().all(|r| ran_on.contains(*r)) {
        assert!(
            clock.elapsed() < Duration::from_secs(180),
            "calls ran only on {ran_on:?}"
        );
        for n in 0..8 {
            let id = enqueue(n % 2).await;
            assert!(
                id.starts_with(&format!("ebb-{}.", n % 2)),
                "{id} names its owner"
            );
            let c = final_state(id.clone()).await;
            assert_eq!(c["state"], "success", "{c}");
            ran_on.insert(c["runner"].as_str().unwrap_or_default().to_owned());
            // Both replicas answer the same.
            assert_eq!(call(1, id.clone()).await, (200, c));
            ids.push(id);
        }
    }

    // A function instance reads the same through either replica.
    let (status, body) = send(
        admin(0),
        "POST",
        "ebb",
        "/api/funcs/template",
        Some(FN_TOKEN),
        &image_template("shout", "upper"),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = send(
        admin(0),
        "POST",
        "ebb",
        "/api/funcs/shout?wait=60",
        Some(FN_TOKEN),
        "abc",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let instance = json(&body)["instanceId"].as_str().unwrap().to_owned();
    assert!(instance.starts_with("ebb-0."), "{body}");
    let path = format!("/api/funcs/{instance}");
    let through_0 = send(admin(0), "GET", "ebb", &path, Some(FN_TOKEN), "").await;
    let through_1 = send(admin(1), "GET", "ebb", &path, Some(FN_TOKEN), "").await;
    assert_eq!(through_0.0, 200, "{}", through_0.1);
    assert_eq!(json(&through_0.1), json(&through_1.1));

    // ebb-1 SIGKILLed while its calls are under way: ebb-0 answers 503 for them and decides
    // nothing for them; the StatefulSet brings the pod back on its volume.
    let mut more = Vec::new();
    for _ in 0..10 {
        more.push(enqueue(1).await);
    }
    let data1 = work.path().join("data/ebb-1");
    let pid = ebb_pid(&data1).expect("ebb-1's process");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // Its runner goes with it (mid-call, perhaps: those calls time out at their owner).
    drop(ext1);
    let down = wait_until("a 503 for ebb-1's call", Duration::from_secs(30), || {
        let id = more[0].clone();
        async move {
            let (status, c) = call(0, id).await;
            (status == 503).then_some(c)
        }
    })
    .await;
    assert_eq!(down["code"], "owner_unavailable", "{down}");
    cp.kubectl(&[
        "delete",
        "pod",
        "ebb-1",
        "-n",
        "ebb",
        "--grace-period=0",
        "--force",
    ]);
    // Back on a new address; a new runner talks to it.
    let mut again = String::new();
    wait_for("ebb-1 ready again", Duration::from_secs(120), || {
        again = ready_ebbs(&cp)
            .into_iter()
            .find(|(name, ip)| name == "ebb-1" && *ip != pods[1].1)
            .map(|(_, ip)| ip)
            .unwrap_or_default();
        !again.is_empty()
    })
    .await;
    let ext1_again = ebb_runner(&again, "ext-1-again");
    for id in more.iter().chain(&ids) {
        final_state(id.clone()).await;
    }
    let data0 = work.path().join("data/ebb-0");
    for id in more.iter().chain(&ids) {
        let (owner, other) = if id.starts_with("ebb-0.") {
            (&data0, &data1)
        } else {
            (&data1, &data0)
        };
        let started = |data: &std::path::Path| {
            common::events(data)
                .iter()
                .filter(|e| e["event"]["CallStarted"]["id"] == id.as_str())
                .count()
        };
        assert_eq!(started(owner), 1, "{id} started once, by its owner");
        assert_eq!(started(other), 0, "{id}");
    }
    // The runners before the broker, which they would otherwise warn of.
    drop((ext0, ext1_again));
    drop(broker);
}

/// Reads a functions API watch from `ebb` (`query` after `watch=true`) until a line has `kind`
/// for template `name`; returns that line's object.
async fn watch_sees(ebb: &common::Ebb, query: &str, kind: &str, name: &str) -> serde_json::Value {
    watch_sees_where(ebb, query, kind, name, |_| true).await
}

/// [`watch_sees`] for an object `wanted` accepts: the events before it (a status written by the
/// lease holder meanwhile, say) are passed over.
async fn watch_sees_where(
    ebb: &common::Ebb,
    query: &str,
    kind: &str,
    name: &str,
    wanted: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let mut watch = common::FuncWatch::open(ebb.admin, FN_TOKEN, query).await;
    let seen = async {
        loop {
            let line = watch.next().await;
            if line["type"] == kind
                && line["object"]["metadata"]["name"] == name
                && wanted(&line["object"])
            {
                return line["object"].clone();
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), seen)
        .await
        .unwrap_or_else(|_| panic!("no {kind} of {name} on the watch"))
}

/// Template names a replica lists now.
async fn listed(ebb: &common::Ebb) -> Vec<String> {
    let (status, v) = fn_api(ebb, "GET", "/api/funcs/template", "").await;
    assert_eq!(status, 200, "{v}");
    v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["metadata"]["name"].as_str().map(str::to_owned))
        .collect()
}

/// On Kubernetes function templates are `Func` resources that every replica follows: one made
/// through a replica is a resource, listed and watched on the other, with the resource's
/// `resourceVersion` through both (a watch through one from a list's revision through the other
/// sees the next change; a revision the API server no longer keeps is 410); one applied with
/// kubectl is listed by both; one deleted through the other replica is gone everywhere; the
/// lease holder writes each one's status; a resource ebb cannot take gets a Warning Event.
#[tokio::test]
async fn templates_are_func_resources_that_every_replica_follows() {
    let (cp, _, _agent) = cluster().await;
    let (d0, d1) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let args = |name: &'static str| {
        let mut a = TEST_TIMING.to_vec();
        a.extend(["--api-token", FN_TOKEN, "--pod-name", name]);
        a
    };
    let e0 = serve_deployed(&cp, d0.path(), &args("ebb-a"));
    let e1 = serve_deployed(&cp, d1.path(), &args("ebb-b"));
    let template = r#"{"name": "shout", "function": "upper", "serviceAddress": "127.0.0.1:9"}"#;
    tokio::join!(watch_sees(&e1, "", "ADDED", "shout"), async {
        // The watch is open before the template is made (a replica answers its watch at once).
        wait_until("the functions API", Duration::from_secs(30), || async {
            (fn_api(&e0, "GET", "/api/funcs/template", "").await.0 == 200).then_some(())
        })
        .await;
        create_template(&e0, template).await;
    });
    let f = json(&cp.kubectl(&["get", "fn", "shout", "-n", "ebb", "-o", "json"]));
    assert_eq!(f["spec"]["function"], "upper", "{f}");
    assert_eq!(f["spec"]["serviceAddress"], "127.0.0.1:9", "{f}");
    assert!(listed(&e1).await.contains(&"shout".to_owned()));

    // One revision everywhere: the resource's. Its status may still be written once after the
    // create, so the API server and both replicas are read again until they agree.
    wait_until(
        "one revision everywhere",
        Duration::from_secs(30),
        || async {
            let f = json(&cp.kubectl(&["get", "fn", "shout", "-n", "ebb", "-o", "json"]));
            let revision = f["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .to_owned();
            for e in [&e0, &e1] {
                let (status, v) = fn_api(e, "GET", "/api/funcs/template/shout", "").await;
                assert_eq!(status, 200, "{v}");
                assert_eq!(v["metadata"]["uid"], f["metadata"]["uid"], "{v}");
                if v["metadata"]["resourceVersion"] != revision.as_str() {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    // A list through one replica, a watch from its revision through the other: the next
    // change, made through the first, arrives.
    let (status, list) = fn_api(&e0, "GET", "/api/funcs/template", "").await;
    assert_eq!(status, 200, "{list}");
    let from = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    let from_list = format!("&resourceVersion={from}");
    let (changed, put) = tokio::join!(
        watch_sees_where(&e1, &from_list, "MODIFIED", "shout", |o| {
            o["spec"]["function"] == "lower"
        }),
        fn_api(
            &e0,
            "PUT",
            "/api/funcs/template/shout",
            r#"{"function": "lower", "serviceAddress": "127.0.0.1:9"}"#,
        )
    );
    assert_eq!(put.0, 200, "{}", put.1);
    assert_eq!(changed["spec"]["function"], "lower", "{changed}");
    assert_eq!(
        changed["metadata"]["resourceVersion"], put.1["metadata"]["resourceVersion"],
        "{changed}"
    );
    // A name no template can have is not passed on to the API server (here: a subresource).
    let (status, v) = fn_api(&e1, "GET", "/api/funcs/template/shout%2Fstatus", "").await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["code"], "not_found", "{v}");
    // A revision long gone from the API server's keeping.
    let (status, v) = fn_api(
        &e1,
        "GET",
        "/api/funcs/template?watch=true&resourceVersion=1",
        "",
    )
    .await;
    assert_eq!(status, 410, "{v}");
    assert_eq!(v["code"], "revision_compacted", "{v}");

    // Applied with kubectl: both replicas have it.
    apply(
        &cp,
        "apiVersion: ebb.dev/v1alpha1\nkind: Func\nmetadata: {name: direct, namespace: ebb}\n\
         spec: {function: lower, serviceAddress: \"127.0.0.1:9\"}\n",
    );
    for e in [&e0, &e1] {
        wait_until(
            "the applied template listed",
            Duration::from_secs(30),
            || async { listed(e).await.contains(&"direct".to_owned()).then_some(()) },
        )
        .await;
    }

    // Its status, written by the replica holding the lease.
    wait_for("a Func status", Duration::from_secs(30), || {
        json(&cp.kubectl(&["get", "fn", "direct", "-n", "ebb", "-o", "json"]))["status"]
            .get("counter")
            .is_some()
    })
    .await;
    // The counter is the cluster's: calls through the replica without the lease count too (a
    // function with a workload, which the autoscaler counts for).
    let holder = lease_holder(&cp).expect("a lease holder");
    let (other, other_name) = if holder == "ebb-a" {
        (&e1, "ebb-b")
    } else {
        (&e0, "ebb-a")
    };
    create_template(other, &image_template("counted", "upper")).await;
    for _ in 0..40 {
        let (status, v) = fn_api(other, "POST", "/api/funcs/counted", "abc").await;
        assert!((200..300).contains(&status), "{status} {v}");
    }
    let f = wait_until(
        "the other replica's calls in the status",
        Duration::from_secs(30),
        || async {
            let f = json(&cp.kubectl(&["get", "fn", "counted", "-n", "ebb", "-o", "json"]));
            (f["status"]["counter"].as_u64().unwrap_or(0) > 0).then_some(f)
        },
    )
    .await;
    let share = &f["status"]["byReplica"][other_name];
    assert!(share["counter"].as_u64().unwrap_or(0) > 0, "{f}");
    assert!(f["status"]["timeStamp"].is_string(), "{f}");

    // Deleted through the other replica: the resource goes, and the first replica drops it.
    let (status, v) = fn_api(&e1, "DELETE", "/api/funcs/template/shout", "").await;
    assert_eq!(status, 200, "{v}");
    assert!(
        cp.try_kubectl(&["get", "fn", "shout", "-n", "ebb"])
            .is_err()
    );
    wait_until(
        "the template gone from the first replica",
        Duration::from_secs(30),
        || async { (!listed(&e0).await.contains(&"shout".to_owned())).then_some(()) },
    )
    .await;

    // A resource whose spec names another template: refused, with a Warning Event on it.
    apply(
        &cp,
        "apiVersion: ebb.dev/v1alpha1\nkind: Func\nmetadata: {name: odd, namespace: ebb}\n\
         spec: {name: other, function: lower}\n",
    );
    warning_event(&cp, "FuncRefused", "odd").await;
    assert!(!listed(&e0).await.contains(&"odd".to_owned()));
    assert!(!listed(&e0).await.contains(&"other".to_owned()));
}

/// A ConfigMap in `default` with `data.done` and labels.
fn config_map(name: &str, done: &str, labels: &[(&str, &str)]) -> String {
    let labels: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("    {k}: {v}"))
        .collect();
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    ebb.dev/test: cleaner\n{}\ndata:\n  done: \"{done}\"\n",
        labels.join("\n")
    )
}

/// A Cleaner in `default` that fires at once (a TTL of 0) when its conditions hold.
fn cleaner(name: &str, extra: &str, targets: &str, conditions: &[&str]) -> String {
    let conditions: Vec<String> = conditions
        .iter()
        .map(|c| format!("  - {}", serde_json::to_string(c).unwrap()))
        .collect();
    format!(
        "apiVersion: cleaner.ebb.dev/v1alpha1\nkind: Cleaner\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  ttl: 0s\n  retry:\n    period: 1h\n{extra}  targets:\n{targets}  conditions:\n{}\n",
        conditions.join("\n")
    )
}

fn exists(cp: &ControlPlane, kind: &str, name: &str) -> bool {
    cp.try_kubectl(&["get", kind, name, "-n", "default", "-o", "name"])
        .is_ok()
}

fn cleaner_status(cp: &ControlPlane, name: &str) -> serde_json::Value {
    cp.try_kubectl(&["get", "cleaner", name, "-n", "default", "-o", "json"])
        .map(|t| json(&t)["status"].clone())
        .unwrap_or_default()
}

/// Waits (within 30 s) until Cleaner `name`'s `Ready` condition has `reason`; its status then.
async fn cleaner_reason(cp: &ControlPlane, name: &str, reason: &str) -> serde_json::Value {
    wait_until(
        &format!("Cleaner {name} {reason}"),
        Duration::from_secs(30),
        || {
            let s = cleaner_status(cp, name);
            std::future::ready((s["conditions"][0]["reason"] == reason).then_some(s))
        },
    )
    .await
}

#[tokio::test]
async fn cleaners_delete_their_targets_only_when_their_conditions_hold() {
    let (cp, admin, _agent) = cluster().await;
    let data = tempfile::tempdir().unwrap();
    // What a platform team grants ebb for the kinds its Cleaners target.
    deployed_service_account(&cp);
    grant(
        &cp,
        "ebb-cleaner-targets",
        "get,list,watch,delete",
        "configmaps",
    );
    let _ebb = serve_on(&cp, data.path(), &[]);

    // Targets by name and by labels; the conditions hold once `flag` says done.
    apply(&cp, &config_map("flag", "no", &[]));
    apply(&cp, &config_map("batch-1", "yes", &[("batch", "b")]));
    apply(&cp, &config_map("batch-2", "yes", &[("batch", "b")]));
    apply(&cp, &config_map("bystander", "yes", &[("batch", "other")]));
    let targets = "  - name: flag\n    reference: {apiVersion: v1, kind: ConfigMap, name: flag}\n    delete: true\n    includeWhenEvaluating: true\n  - name: batch\n    reference: {apiVersion: v1, kind: configmap, matchLabels: {batch: b}}\n    delete: true\n    includeWhenEvaluating: true\n";
    apply(
        &cp,
        &cleaner(
            "c1",
            "",
            targets,
            &[
                "flag.data.done == 'yes'",
                "size(batch.items) == 2 && batch.items.all(i, i.data.done == 'yes')",
            ],
        ),
    );
    let s = cleaner_reason(&cp, "c1", "WaitingForConditions").await;
    let resolved: Vec<&str> = s["resolvedTargets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        resolved,
        [
            "flag.configmaps.v1",
            "batch-1.configmaps.v1",
            "batch-2.configmaps.v1"
        ]
    );
    let results: Vec<bool> = s["lastEvaluation"]["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["result"].as_bool().unwrap())
        .collect();
    assert_eq!(results, [false, true]);
    for cm in ["flag", "batch-1", "batch-2"] {
        assert!(
            exists(&cp, "configmap", cm),
            "{cm} deleted while a condition is false"
        );
    }

    // A change to a target re-evaluates its cleaner (the retry period is an hour): it fires.
    cp.kubectl(&[
        "patch",
        "configmap",
        "flag",
        "-n",
        "default",
        "--type=merge",
        "-p",
        r#"{"data":{"done":"yes"}}"#,
    ]);
    wait_for(
        "c1's targets and c1 deleted",
        Duration::from_secs(30),
        || {
            !exists(&cp, "configmap", "flag")
                && !exists(&cp, "configmap", "batch-1")
                && !exists(&cp, "configmap", "batch-2")
                && !exists(&cp, "cleaner", "c1")
        },
    )
    .await;
    assert!(
        exists(&cp, "configmap", "bystander"),
        "a non-matching object was deleted"
    );
    warning_event_in(&cp, "default", "Deleting", "c1").await;
    let log = common::events(data.path());
    let fired: Vec<&serde_json::Value> = log
        .iter()
        .map(|e| &e["event"])
        .filter(|e| {
            e.get("CleanerFiring")
                .is_some_and(|f| f["name"] == "default/c1")
                || e.get("CleanerFired")
                    .is_some_and(|f| f["name"] == "default/c1")
        })
        .collect();
    assert_eq!(fired.len(), 2, "one firing, one completion: {fired:?}");
    let entries = fired[0]["CleanerFiring"]["targets"].as_array().unwrap();
    assert_eq!(entries.len(), 3);
    assert!(
        entries
            .iter()
            .all(|e| e.as_str().unwrap().starts_with("v1/ConfigMap/default/"))
    );

    // Dry run: nothing is deleted, what would be is listed.
    apply(&cp, &config_map("dry", "yes", &[]));
    let one = |n: &str| {
        format!(
            "  - name: t\n    reference: {{apiVersion: v1, kind: ConfigMap, name: {n}}}\n    delete: true\n    includeWhenEvaluating: true\n"
        )
    };
    apply(
        &cp,
        &cleaner(
            "c2",
            "  dryRun: true\n",
            &one("dry"),
            &["t.data.done == 'yes'"],
        ),
    );
    let s = cleaner_reason(&cp, "c2", "DryRun").await;
    let would = s["wouldDelete"].as_array().unwrap();
    assert_eq!(would.len(), 1);
    assert!(
        would[0]
            .as_str()
            .unwrap()
            .starts_with("v1/ConfigMap/default/dry@")
    );
    assert!(exists(&cp, "configmap", "dry") && exists(&cp, "cleaner", "c2"));

    // Before its TTL: nothing evaluated, the expiry is the next evaluation.
    apply(
        &cp,
        &cleaner("later", "", &one("dry"), &["true"]).replace("ttl: 0s", "ttl: 1h"),
    );
    let s = cleaner_reason(&cp, "later", "NotExpired").await;
    assert!(s["nextScheduledEvaluation"].as_str().is_some(), "{s}");
    assert!(s.get("lastEvaluation").is_none(), "{s}");
    assert_eq!(s["resolvedTargets"][0], "dry.configmaps.v1");

    // A Cleaner deleted by hand before it fires leaves its targets: it holds no finalizer.
    apply(&cp, &config_map("kept", "no", &[]));
    apply(
        &cp,
        &cleaner("c3", "", &one("kept"), &["t.data.done == 'yes'"]),
    );
    cleaner_reason(&cp, "c3", "WaitingForConditions").await;
    cp.kubectl(&["delete", "cleaner", "c3", "-n", "default", "--wait=false"]);
    wait_for("c3 forgotten", Duration::from_secs(30), || {
        !exists(&cp, "cleaner", "c3")
            && common::events(data.path())
                .iter()
                .any(|e| e["event"]["CleanerDeleted"]["name"] == "default/c3")
    })
    .await;
    cp.kubectl(&[
        "patch",
        "configmap",
        "kept",
        "-n",
        "default",
        "--type=merge",
        "-p",
        r#"{"data":{"done":"yes"}}"#,
    ]);
    // Another cleaner of the same object, which does fire, shows the change was seen.
    apply(&cp, &config_map("other", "yes", &[]));
    apply(
        &cp,
        &cleaner("c4", "", &one("other"), &["t.data.done == 'yes'"]),
    );
    wait_for("c4 fired", Duration::from_secs(30), || {
        !exists(&cp, "configmap", "other")
    })
    .await;
    assert!(
        exists(&cp, "configmap", "kept"),
        "a hand-deleted Cleaner's target was deleted"
    );

    // Bad input: each a reason on its own Cleaner, nothing else affected.
    let cm = "  - name: t\n    reference: {apiVersion: v1, kind: ConfigMap, name: dry}\n    includeWhenEvaluating: true\n";
    let bad = [
        (
            "bad-syntax",
            "",
            cm.to_owned(),
            "t.data.(",
            "ConditionCompileError",
        ),
        ("bad-type", "", cm.to_owned(), "size(t.data)", "NotBoolean"),
        (
            "bad-runaway",
            "",
            cm.to_owned(),
            "[0,1,2,3,4,5,6,7,8,9].all(a, [0,1,2,3,4,5,6,7,8,9].all(b, [0,1,2,3,4,5,6,7,8,9].all(c, [0,1,2,3,4,5,6,7,8,9].all(d, [0,1,2,3,4,5,6,7,8,9].all(e, [0,1,2,3,4,5,6,7,8,9].all(f, a + b + c + d + e + f >= 0))))))",
            "EvaluationLimitExceeded",
        ),
        (
            "bad-kind",
            "",
            "  - name: t\n    reference: {apiVersion: v1, kind: NoSuchKind, name: x}\n".to_owned(),
            "true",
            "TargetResolveError",
        ),
        (
            "bad-time",
            "",
            cm.replace("name: t\n", "name: time\n"),
            "true",
            "InvalidSpec",
        ),
    ];
    for (name, extra, targets, condition, _) in &bad {
        apply(&cp, &cleaner(name, extra, targets, &[condition]));
    }
    apply(
        &cp,
        &cleaner("bad-ttl", "", cm, &["true"]).replace("ttl: 0s", "ttl: forever"),
    );
    for (name, _, _, _, reason) in &bad {
        let s = cleaner_reason(&cp, name, reason).await;
        assert!(
            !s["conditions"][0]["message"]
                .as_str()
                .unwrap_or_default()
                .is_empty(),
            "{name}: {s}"
        );
    }
    let s = cleaner_reason(&cp, "bad-ttl", "InvalidSpec").await;
    assert!(
        s["conditions"][0]["message"]
            .as_str()
            .unwrap()
            .contains("spec.ttl"),
        "{s}"
    );
    assert!(
        exists(&cp, "configmap", "dry"),
        "a bad Cleaner deleted something"
    );

    // A target replaced by a new object of the same name between its resolution and its
    // deletion is not deleted: the delete is conditioned on the uid resolved.
    apply(&cp, &config_map("replaced", "yes", &[]));
    let (tx, _rx) = tokio::sync::mpsc::channel(16);
    let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let targets = ebb::cleaner::kube::KubeTargets::new(
        admin.clone(),
        "test",
        tx,
        stop_rx,
        None,
        None,
        std::sync::Arc::new(ebb::clock::SystemClock),
    );
    let spec = ebb::cleaner::spec::to_spec(
        "default/r",
        "default",
        "uid-r",
        0,
        &serde_json::from_value(serde_json::json!({
            "ttl": "0s",
            "targets": [{"name": "t", "delete": true,
                         "reference": {"apiVersion": "v1", "kind": "ConfigMap", "name": "replaced"}}],
        }))
        .unwrap(),
    );
    targets.ensure_kinds(&spec).await;
    use ebb::cleaner::runtime::{Backend, Deleted};
    let resolved = wait_until("the target cached", Duration::from_secs(10), || {
        let r = targets
            .resolve(&spec)
            .ok()
            .filter(|r| r.deletions.len() == 1);
        async move { r }
    })
    .await;
    cp.kubectl(&["delete", "configmap", "replaced", "-n", "default"]);
    apply(&cp, &config_map("replaced", "yes", &[]));
    assert_eq!(
        targets.delete(&spec, &resolved.deletions[0]).await,
        Ok(Deleted::Gone)
    );
    assert!(
        exists(&cp, "configmap", "replaced"),
        "the new object was deleted"
    );
}

async fn warning_event_in(cp: &ControlPlane, namespace: &str, reason: &str, name: &str) {
    wait_for(
        &format!("a {reason} Warning Event on {name}"),
        Duration::from_secs(30),
        || {
            let events = json(&cp.kubectl(&["get", "events", "-n", namespace, "-o", "json"]));
            events["items"].as_array().is_some_and(|items| {
                items.iter().any(|e| {
                    e["type"] == "Warning"
                        && e["reason"] == reason
                        && e["involvedObject"]["name"] == name
                })
            })
        },
    )
    .await;
}

/// The events of Cleaner `name` in ebb's log, by event name.
fn cleaner_events(data: &std::path::Path, name: &str, event: &str) -> usize {
    common::events(data)
        .iter()
        .filter(|e| e["event"].get(event).is_some_and(|f| f["name"] == name))
        .count()
}

#[tokio::test]
async fn a_firing_cut_short_by_sigkill_completes_once_after_the_restart() {
    let (cp, _, _agent) = cluster().await;
    let data = tempfile::tempdir().unwrap();
    deployed_service_account(&cp);
    // ebb may delete ConfigMaps but, for now, only read Secrets.
    grant(
        &cp,
        "ebb-cleaner-targets",
        "get,list,watch,delete",
        "configmaps",
    );
    grant(&cp, "ebb-cleaner-read", "get,list,watch", "secrets");
    let ebb = serve_on(&cp, data.path(), &[]);
    apply(&cp, &config_map("k-cm", "yes", &[]));
    cp.kubectl(&[
        "create",
        "secret",
        "generic",
        "k-secret",
        "-n",
        "default",
        "--from-literal=a=b",
    ]);
    let targets = "  - name: cm\n    reference: {apiVersion: v1, kind: ConfigMap, name: k-cm}\n    delete: true\n    includeWhenEvaluating: true\n  - name: secret\n    reference: {apiVersion: v1, kind: Secret, name: k-secret}\n    delete: true\n";
    apply(&cp, &cleaner("k1", "", targets, &["cm.data.done == 'yes'"]));

    // It fires: the ConfigMap goes, the Secret's delete is forbidden, the firing stays open.
    wait_for(
        "k1 firing, its ConfigMap deleted",
        Duration::from_secs(30),
        || {
            !exists(&cp, "configmap", "k-cm")
                && cleaner_events(data.path(), "default/k1", "CleanerFiring") == 1
        },
    )
    .await;
    let held = json(&cp.kubectl(&["get", "cleaner", "k1", "-n", "default", "-o", "json"]));
    assert_eq!(held["metadata"]["finalizers"][0], "cleaner.ebb.dev/firing");
    assert!(exists(&cp, "secret", "k-secret"));
    assert_eq!(cleaner_events(data.path(), "default/k1", "CleanerFired"), 0);

    // SIGKILL in the middle of it; the permission granted; ebb again on the same log.
    drop(ebb);
    grant(&cp, "ebb-cleaner-secrets", "delete", "secrets");
    let _ebb = serve_on(&cp, data.path(), &[]);
    wait_for("the firing completed", Duration::from_secs(60), || {
        !exists(&cp, "secret", "k-secret") && !exists(&cp, "cleaner", "k1")
    })
    .await;
    wait_for("CleanerFired recorded", Duration::from_secs(30), || {
        cleaner_events(data.path(), "default/k1", "CleanerFired") == 1
    })
    .await;
    // Once: one firing, one completion, one evaluation that fired.
    assert_eq!(
        cleaner_events(data.path(), "default/k1", "CleanerFiring"),
        1
    );
    let fired_evaluations = common::events(data.path())
        .iter()
        .filter(|e| {
            e["event"]
                .get("CleanerEvaluated")
                .is_some_and(|f| f["name"] == "default/k1" && f["result"] == true)
        })
        .count();
    assert_eq!(fired_evaluations, 1);
}

/// The `helm` command: `EBB_HELM`, else built from its Go module (`scripts/helm build`).
fn helm() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("EBB_HELM") {
        return p.into();
    }
    let out = std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/helm"))
        .arg("build")
        .output()
        .expect("scripts/helm runs");
    assert!(
        out.status.success(),
        "scripts/helm build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().into()
}

#[tokio::test]
async fn a_cleaner_uninstalls_a_real_helm_release() {
    let (cp, _, _agent) = cluster().await;
    let data = tempfile::tempdir().unwrap();
    let helm = helm();
    // A chart of one ConfigMap, installed by the administrator.
    let chart = tempfile::tempdir().unwrap();
    std::fs::write(
        chart.path().join("Chart.yaml"),
        "apiVersion: v2\nname: preview\nversion: 0.1.0\n",
    )
    .unwrap();
    std::fs::create_dir(chart.path().join("templates")).unwrap();
    std::fs::write(
        chart.path().join("templates/cm.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\ndata:\n  done: \"yes\"\n",
    )
    .unwrap();
    let run_helm = |args: &[&str]| {
        std::process::Command::new(&helm)
            .args(args)
            .env("KUBECONFIG", &cp.kubeconfig)
            .env("HELM_CACHE_HOME", data.path().join("helm-cache"))
            .env("HELM_CONFIG_HOME", data.path().join("helm-config"))
            .env("HELM_DATA_HOME", data.path().join("helm-data"))
            .output()
            .unwrap()
    };
    let out = run_helm(&[
        "install",
        "rel1",
        chart.path().to_str().unwrap(),
        "-n",
        "default",
    ]);
    assert!(
        out.status.success(),
        "helm install: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(exists(&cp, "configmap", "rel1-cm"));

    // ebb uninstalls with helm as its ServiceAccount: Helm's release Secrets and the chart's kinds.
    deployed_service_account(&cp);
    grant(
        &cp,
        "ebb-cleaner-targets",
        "get,list,watch,delete",
        "configmaps,secrets",
    );
    let helm_flag = format!("--cleaner-helm={}", helm.display());
    let _ebb = serve_on(&cp, data.path(), &[&helm_flag]);
    let targets = "  - name: cm\n    reference: {apiVersion: v1, kind: ConfigMap, name: rel1-cm}\n    includeWhenEvaluating: true\n";
    apply(
        &cp,
        &cleaner(
            "h1",
            "  helm: {release: rel1, delete: true}\n",
            targets,
            &["cm.data.done == 'yes'"],
        ),
    );
    wait_for(
        "the release uninstalled and h1 gone",
        Duration::from_secs(60),
        || !exists(&cp, "configmap", "rel1-cm") && !exists(&cp, "cleaner", "h1"),
    )
    .await;
    let out = run_helm(&["status", "rel1", "-n", "default"]);
    assert!(!out.status.success(), "the release is still there");
    let firing = common::events(data.path())
        .into_iter()
        .find_map(|e| e["event"].get("CleanerFiring").cloned())
        .unwrap();
    assert_eq!(firing["targets"], serde_json::json!(["helm/default/rel1"]));
}

/// What ebb acknowledged: call and instance ids.
#[derive(Default)]
struct Acked {
    calls: std::collections::BTreeSet<String>,
    instances: std::collections::BTreeSet<String>,
}

/// Requests through the proxy to `hello.test` (waking it), calls to it, and invocations of the
/// image function `function`, until `stop`.
async fn kube_load(
    ebb: (std::net::SocketAddr, std::net::SocketAddr),
    function: String,
    acked: std::sync::Arc<std::sync::Mutex<Acked>>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let (proxy, admin) = ebb;
    let traffic = async {
        let mut pace = tokio::time::interval(Duration::from_millis(20));
        while !*stop.borrow() {
            pace.tick().await;
            let _ = try_send(proxy, "GET", "hello.test", "/pid", None, "").await;
        }
    };
    let calls = async {
        let mut pace = tokio::time::interval(Duration::from_millis(25));
        let body = r#"{"target": "default/hello", "timeout_ms": 20000, "payload": {"method": "GET", "path": "/pid"}}"#;
        while !*stop.borrow() {
            pace.tick().await;
            let r = try_send(
                admin,
                "POST",
                "ebb",
                "/runner/enqueue",
                Some(RUNNER_TOKEN),
                body,
            );
            if let Some((200, body)) = r.await {
                let id = json(&body)["id"].as_str().unwrap().to_owned();
                acked.lock().unwrap().calls.insert(id);
            }
        }
    };
    let instances = async {
        let mut pace = tokio::time::interval(Duration::from_millis(100));
        let path = format!("/api/funcs/{function}");
        while !*stop.borrow() {
            pace.tick().await;
            let r = try_send(admin, "POST", "ebb", &path, Some(FN_TOKEN), "abc");
            if let Some((202, body)) = r.await {
                let id = json(&body)["instanceId"].as_str().unwrap().to_owned();
                acked.lock().unwrap().instances.insert(id);
            }
        }
    };
    tokio::join!(traffic, calls, instances);
}

/// The pods of the workloads ebb scales and the functions it runs (not deploy/'s own, which stay
/// Pending without volumes), with their phase.
fn workload_pods(cp: &ControlPlane) -> Vec<String> {
    let default = json(&cp.kubectl(&["get", "pods", "-n", "default", "-o", "json"]));
    let functions = json(&cp.kubectl(&[
        "get",
        "pods",
        "-n",
        "ebb",
        "-l",
        "ebb.dev/function",
        "-o",
        "json",
    ]));
    [default, functions]
        .iter()
        .flat_map(|list| list["items"].as_array().cloned().unwrap_or_default())
        .map(|p| {
            format!(
                "{}/{} {}",
                p["metadata"]["namespace"].as_str().unwrap_or_default(),
                p["metadata"]["name"].as_str().unwrap_or_default(),
                p["status"]["phase"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

/// ebb on Kubernetes killed with SIGKILL at random moments, several rounds on one data directory,
/// while proxy traffic wakes a Deployment from zero, calls run against it, an image function is
/// invoked and a Cleaner comes due each round. Pods outlive a killed ebb (Kubernetes owns them);
/// what must not happen is one left behind: after the last restart ebb finishes everything it
/// acknowledged (each call started once, each Cleaner fired once), scales the idle workload back
/// to zero, and deleting the templates deletes their functions' Deployments: no pod is left.
#[tokio::test]
async fn sigkilled_on_kubernetes_ebb_loses_nothing_and_leaves_no_pod_behind() {
    const ROUNDS: usize = 3;
    let (cp, _, _agent) = cluster().await;
    apply(&cp, &serverless_hello("2s"));
    // Only ebb's route leads to the Deployment (proxless' has the default idle time).
    cp.kubectl(&["delete", "service", "legacy"]);
    deployed_service_account(&cp);
    grant(
        &cp,
        "ebb-cleaner-targets",
        "get,list,watch,delete",
        "configmaps",
    );
    let data = tempfile::tempdir().unwrap();
    let mut args = TEST_TIMING.to_vec();
    args.extend([
        "--api-token",
        FN_TOKEN,
        "--runner-token",
        RUNNER_TOKEN,
        "--snapshot-every-events",
        "0",
    ]);
    let acked = std::sync::Arc::new(std::sync::Mutex::new(Acked::default()));
    let mut rng = common::XorShift(0x6b75_6265_c0ff_ee01);
    for round in 0..ROUNDS {
        let mut ebb = serve_deployed(&cp, data.path(), &args);
        let function = format!("f{round}");
        create_template(&ebb, &image_template(&function, "upper")).await;
        let targets = format!(
            "  - name: cm\n    reference: {{apiVersion: v1, kind: ConfigMap, name: c{round}}}\n    delete: true\n    includeWhenEvaluating: true\n"
        );
        apply(
            &cp,
            &format!(
                "{}---\n{}",
                config_map(&format!("c{round}"), "yes", &[]),
                cleaner(
                    &format!("c{round}"),
                    "",
                    &targets,
                    &["cm.data.done == 'yes'"]
                )
            ),
        );
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let load = kube_load((ebb.proxy, ebb.admin), function, acked.clone(), stop_rx);
        tokio::pin!(load);
        let kill_after = Duration::from_millis(1_500 + rng.next() % 3_000);
        let _ = tokio::time::timeout(kill_after, &mut load).await;
        ebb.child.kill().unwrap();
        ebb.child.wait().unwrap();
        stop_tx.send(true).unwrap();
        load.await;
    }

    // The last run: everything acknowledged ends.
    let logs = tempfile::tempdir().unwrap();
    let text_log = logs.path().join("ebb.log");
    let kubeconfig = deployed_service_account(&cp);
    let mut last_args = vec!["--orchestrator", "kubernetes", "--pod-namespace", "ebb"];
    last_args.extend_from_slice(&args);
    let ebb = common::serve_logged(
        data.path(),
        None,
        None,
        &last_args,
        &[
            ("KUBECONFIG", kubeconfig.as_os_str()),
            ("EBB_LOG", std::ffi::OsStr::new("ebb=info")),
        ],
        Some(&text_log),
    );
    let (calls, instances) = {
        let a = acked.lock().unwrap();
        (a.calls.clone(), a.instances.clone())
    };
    assert!(!calls.is_empty() && !instances.is_empty());
    let objects = calls
        .iter()
        .map(|id| (format!("/v1/calls/{id}"), RUNNER_TOKEN))
        .chain(
            instances
                .iter()
                .map(|id| (format!("/api/funcs/{id}"), FN_TOKEN)),
        );
    for (path, token) in objects {
        wait_until(
            &format!("{path} ends"),
            Duration::from_secs(120),
            || async {
                let (status, body) = send(ebb.admin, "GET", "ebb", &path, Some(token), "").await;
                assert_eq!(status, 200, "acknowledged {path}: {body}");
                let state = json(&body)["state"].as_str().unwrap_or_default().to_owned();
                (!matches!(state.as_str(), "queued" | "running")).then_some(())
            },
        )
        .await;
    }
    wait_for("every Cleaner fired", Duration::from_secs(60), || {
        (0..ROUNDS)
            .all(|r| cleaner_events(data.path(), &format!("default/c{r}"), "CleanerFired") == 1)
    })
    .await;

    // No pod left behind: the idle workload goes back to zero, the functions' objects go with
    // their templates.
    for round in 0..ROUNDS {
        let path = format!("/api/funcs/template/f{round}");
        assert_eq!(fn_api(&ebb, "DELETE", &path, "").await.0, 200);
    }
    let none_left = wait_until("no pod left", Duration::from_secs(120), || async {
        workload_pods(&cp).is_empty().then_some(())
    });
    if tokio::time::timeout(Duration::from_secs(110), none_left)
        .await
        .is_err()
    {
        let hello = cp.kubectl(&["get", "deployment", "hello", "-n", "default", "-o", "yaml"]);
        let all = common::events(data.path());
        let hellos: Vec<String> = all
            .iter()
            .filter(|e| e.to_string().contains("default/hello"))
            .map(|e| e.to_string())
            .collect();
        let last = &hellos[hellos.len().saturating_sub(25)..];
        let text = std::fs::read_to_string(&text_log).unwrap_or_default();
        panic!(
            "pods left: {:?}\n{hello}\nthe log's last events of default/hello: {last:#?}\n\
             ebb's log:\n{text}",
            workload_pods(&cp)
        );
    }
    let hello = json(&cp.kubectl(&["get", "deployment", "hello", "-n", "default", "-o", "json"]));
    assert_eq!(hello["spec"]["replicas"], 0, "{hello}");
    for round in 0..ROUNDS {
        assert!(function_objects_gone(&cp, &format!("fn-f{round}")));
    }
    drop(ebb);

    // The log: every acknowledged call and instance, none started twice, no Cleaner fired twice.
    let common::Tally {
        queued,
        created,
        started,
        ..
    } = common::tally(&common::events(data.path()));
    let lost: Vec<_> = calls.difference(&queued).collect();
    assert!(
        lost.is_empty(),
        "acknowledged calls not in the log: {lost:?}"
    );
    let lost: Vec<_> = instances.difference(&created).collect();
    assert!(
        lost.is_empty(),
        "acknowledged instances not in the log: {lost:?}"
    );
    let twice: Vec<_> = started.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "calls started twice: {twice:?}");
    for r in 0..ROUNDS {
        assert_eq!(
            cleaner_events(data.path(), &format!("default/c{r}"), "CleanerFiring"),
            1
        );
    }
    println!(
        "kube crash: {ROUNDS} kills; {} calls and {} instances acknowledged",
        calls.len(),
        instances.len()
    );
}

/// With `--kube-auth` and no runner token, a replica forwards a call's state, start and finish
/// to the owner presenting its own ServiceAccount token (`--peer-token-file`, as a pod's projected
/// token), which the owner checks with the same TokenReview and RBAC (`deploy/`'s `ebb-peers`).
/// Before, the replicas sent no token and got 401 from each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_kube_auth_alone_replicas_forward_to_their_owner_with_their_own_token() {
    let (cp, _, _agent) = cluster().await;
    apply(&cp, &serverless_hello("1h"));
    let broker = common::broker().await;
    let kubeconfig = deployed_service_account(&cp);
    let work = tempfile::tempdir().unwrap();
    let token_file = work.path().join("token");
    let own = cp.kubectl(&["create", "token", "ebb", "-n", "ebb", "--duration", "1h"]);
    std::fs::write(&token_file, own.trim()).unwrap();
    let ports = [common::free_port(), common::free_port()];
    let brokers = broker.addr.to_string();
    let ebbs: Vec<common::Ebb> = (0..2)
        .map(|me| {
            let data = work.path().join(format!("ebb-{me}"));
            let admin = format!("127.0.0.1:{}", ports[me]);
            let name = format!("ebb-{me}");
            let peer = format!("ebb-{}=http://127.0.0.1:{}", 1 - me, ports[1 - me]);
            let mut args = TEST_TIMING.to_vec();
            args.extend_from_slice(&[
                "--orchestrator",
                "kubernetes",
                "--pod-namespace",
                "ebb",
                "--namespace",
                "default",
                "--kube-auth",
                "--admin-listen",
                &admin,
                "--replica",
                &name,
                "--peer",
                &peer,
                "--kafka-brokers",
                &brokers,
                "--kafka-partitions",
                "4",
                "--runner-capacity",
                "0",
                "--peer-token-file",
                token_file.to_str().unwrap(),
            ]);
            common::serve_env(
                &data,
                None,
                None,
                &args,
                &[("KUBECONFIG", kubeconfig.as_os_str())],
            )
        })
        .collect();
    let worker = api_user(&cp, "worker", Some("ebb-runner"));
    let api = |me: usize, path: &'static str, body: String| {
        let (addr, worker) = (ebbs[me].admin, worker.clone());
        async move { send(addr, "POST", "ebb", path, Some(&worker), &body).await }
    };
    wait_for("the route on ebb-0", Duration::from_secs(30), || {
        routes(&work.path().join("ebb-0")).contains("default/hello")
    })
    .await;
    let (status, body) = api(0, "/runner/enqueue", r#"{"target":"default/hello"}"#.into()).await;
    assert_eq!(status, 200, "{body}");
    let id = json(&body)["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{body}"))
        .to_owned();
    assert!(id.starts_with("ebb-0."), "{id}");
    // A runner of ebb-1 gets ebb-0's call: ebb-1 asked ebb-0 what became of it.
    let job = wait_until(
        "ebb-0's call handed out by ebb-1",
        Duration::from_secs(60),
        || {
            let api = &api;
            async move {
                let (status, body) = api(
                    1,
                    "/runner/dequeue",
                    r#"{"runner":"w1","max":1,"wait_ms":500}"#.into(),
                )
                .await;
                (status == 200).then(|| json(&body))
            }
        },
    )
    .await;
    assert_eq!(job["calls"][0]["id"], id.as_str(), "{job}");
    let (status, body) = api(
        1,
        "/runner/start",
        format!(r#"{{"runner":"w1","id":"{id}"}}"#),
    )
    .await;
    assert_eq!(status, 200, "the owner took the forwarded start: {body}");
    let (status, body) = api(
        1,
        "/runner/finish",
        format!(r#"{{"runner":"w1","id":"{id}","outcome":"success"}}"#),
    )
    .await;
    assert_eq!(status, 200, "the owner took the forwarded finish: {body}");
    let (status, body) = send(
        ebbs[0].admin,
        "GET",
        "ebb",
        &format!("/v1/calls/{id}"),
        Some(&worker),
        "",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["state"], "success", "{body}");
}

/// The API server's refusals (HTTP 403) of a request by ebb's ServiceAccount for `resource` in
/// `namespace`, from its audit log.
fn refused_requests(cp: &ControlPlane, resource: &str, namespace: &str) -> usize {
    cp.audit_events()
        .iter()
        .filter(|e| {
            e["user"]["username"] == "system:serviceaccount:ebb:ebb"
                && e["objectRef"]["resource"] == resource
                && e["objectRef"]["namespace"] == namespace
                && e["responseStatus"]["code"] == 403
        })
        .count()
}

/// Events in ebb's namespace about ebb's own pod with `reason`.
fn pod_events(cp: &ControlPlane, reason: &str) -> Vec<serde_json::Value> {
    let events = json(&cp.kubectl(&["get", "events", "-n", "ebb", "-o", "json"]));
    events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["reason"] == reason
                && e["involvedObject"]["kind"] == "Pod"
                && e["involvedObject"]["name"] == "ebb"
        })
        .cloned()
        .collect()
}

/// Kubernetes refusing ebb something (RBAC) is not transient, and is said where an operator
/// looks: a watch of Func resources in a namespace ebb may not read is asked again less and less
/// often, is one WARN in ebb's log, one Warning Event `Forbidden` on ebb's pod and a reason in
/// `/readyz` (still 200: ebb serves without it), however often it is tried; once a Role allows
/// it, ebb has the resources and says so (a Normal Event `Allowed`). A Cleaner whose firing RBAC
/// blocks (get, list and watch granted on its target kind, not delete) says so in its status's
/// message and a Warning Event `DeleteFailed`, and completes once delete is granted.
#[tokio::test]
async fn refusals_are_told_once_where_operators_look_and_recover_when_allowed() {
    let (cp, _, _agent) = cluster().await;
    let kubeconfig = deployed_service_account(&cp);
    cp.kubectl(&["create", "namespace", "fns"]);
    grant(&cp, "ebb-cleaner-targets", "get,list,watch", "configmaps");
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("ebb.log");
    let mut args = TEST_TIMING.to_vec();
    args.extend([
        "--orchestrator",
        "kubernetes",
        "--pod-namespace",
        "ebb",
        "--pod-name",
        "ebb",
        "--functions-namespace",
        "fns",
        "--api-token",
        FN_TOKEN,
    ]);
    let ebb = common::serve_logged(
        data.path(),
        None,
        None,
        &args,
        &[("KUBECONFIG", kubeconfig.as_os_str())],
        Some(&log),
    );

    // Refused again and again: told once.
    wait_for(
        "three refused lists of Func resources in fns",
        Duration::from_secs(60),
        || refused_requests(&cp, "functions", "fns") >= 3,
    )
    .await;
    let forbidden = wait_until(
        "a Forbidden Warning Event on ebb's pod",
        Duration::from_secs(30),
        || async {
            let e = pod_events(&cp, "Forbidden");
            (!e.is_empty()).then_some(e)
        },
    )
    .await;
    assert_eq!(forbidden.len(), 1, "{forbidden:?}");
    assert_eq!(forbidden[0]["type"], "Warning", "{forbidden:?}");
    assert!(
        forbidden[0]["count"].as_u64().unwrap_or(1) <= 1,
        "{forbidden:?}"
    );
    let note = forbidden[0]["message"].as_str().unwrap_or_default();
    assert!(note.contains("Func resources in namespace fns"), "{note}");
    let text = std::fs::read_to_string(&log).unwrap();
    let warned = text
        .lines()
        .filter(|l| l.contains("refuses ebb this watch") && l.contains("namespace fns"))
        .count();
    assert_eq!(warned, 1, "{text}");
    let ready = http_get(&ebb.admin.to_string(), "/readyz").expect("ebb answers");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    assert!(ready.contains(r#""status":"degraded""#), "{ready}");
    assert!(ready.contains("Func resources in namespace fns"), "{ready}");

    // Allowed: the resources arrive, and it is said.
    apply(
        &cp,
        "apiVersion: ebb.dev/v1alpha1\nkind: Func\nmetadata: {name: late, namespace: fns}\n\
         spec: {function: lower, serviceAddress: \"127.0.0.1:9\"}\n",
    );
    cp.kubectl(&[
        "create",
        "role",
        "ebb-functions",
        "-n",
        "fns",
        "--verb=get,list,watch,create,update,patch,delete",
        "--resource=functions.ebb.dev,functions.ebb.dev/status",
    ]);
    cp.kubectl(&[
        "create",
        "rolebinding",
        "ebb-functions",
        "-n",
        "fns",
        "--role=ebb-functions",
        "--serviceaccount=ebb:ebb",
    ]);
    wait_until(
        "the Func in fns listed",
        Duration::from_secs(120),
        || async {
            listed(&ebb)
                .await
                .contains(&"late".to_owned())
                .then_some(())
        },
    )
    .await;
    wait_for(
        "an Allowed Event on ebb's pod",
        Duration::from_secs(30),
        || !pod_events(&cp, "Allowed").is_empty(),
    )
    .await;
    let ready = http_get(&ebb.admin.to_string(), "/readyz").expect("ebb answers");
    assert!(ready.contains(r#""status":"ready""#), "{ready}");

    // A firing RBAC blocks: the status's message and a Warning Event say so.
    apply(&cp, &config_map("doomed", "yes", &[]));
    let targets = "  - name: doomed\n    reference: {apiVersion: v1, kind: ConfigMap, name: doomed}\n    delete: true\n    includeWhenEvaluating: true\n";
    apply(
        &cp,
        &cleaner("blocked", "", targets, &["doomed.data.done == 'yes'"]),
    );
    let s = cleaner_reason(&cp, "blocked", "DeleteFailed").await;
    let message = s["conditions"][0]["message"].as_str().unwrap_or_default();
    assert!(message.contains("forbidden"), "{s}");
    assert!(message.contains("doomed"), "{s}");
    warning_event_in(&cp, "default", "DeleteFailed", "blocked").await;
    assert!(exists(&cp, "configmap", "doomed"));
    // Granted: the firing completes.
    grant(&cp, "ebb-cleaner-delete", "delete", "configmaps");
    wait_for("the firing completed", Duration::from_secs(120), || {
        !exists(&cp, "configmap", "doomed") && !exists(&cp, "cleaner", "blocked")
    })
    .await;
}

/// The load scaling requests in an ebb's log: (from, to) of each `ScaleRequested { reason: load }`.
fn load_scalings(data: &std::path::Path) -> Vec<(u64, u64)> {
    common::events(data)
        .iter()
        .filter_map(|e| e["event"].get("ScaleRequested"))
        .filter(|s| s["reason"].get("load").is_some())
        .filter_map(|s| Some((s["from"].as_u64()?, s["to"].as_u64()?)))
        .collect()
}

/// ebb `ebb-ME` (0 or 1) of two in front of the same workloads, its data under `dir`, its admin
/// API on `ports[me]`, the other its peer (the load reports' way).
fn pair_member(
    cp: &ControlPlane,
    dir: &std::path::Path,
    ports: [u16; 2],
    me: usize,
) -> common::Ebb {
    let data = dir.join(format!("ebb-{me}"));
    let name = format!("ebb-{me}");
    let admin = format!("127.0.0.1:{}", ports[me]);
    let peer = format!("ebb-{}=http://127.0.0.1:{}", 1 - me, ports[1 - me]);
    serve_on(
        cp,
        &data,
        &[
            "--pod-name",
            &name,
            "--replica",
            &name,
            "--peer",
            &peer,
            "--admin-listen",
            &admin,
            "--runner-token",
            "peers-token",
        ],
    )
}

/// The Deployment `hello` at zero, its app answering in 200 ms, and the Service `hello` routing
/// `hello.test` to it with `annotations` besides.
fn apply_slow_hello(cp: &ControlPlane, annotations: &[(&str, &str)]) {
    let slow = hello_deployment(0).replace(
        r#"args: [--host, $(POD_IP), --port, "8080"]"#,
        r#"args: [--host, $(POD_IP), --port, "8080", --answer-delay-ms, "200"]"#,
    );
    let mut all = vec![
        ("ebb.dev/domains", "hello.test"),
        ("ebb.dev/deployment", "hello"),
    ];
    all.extend_from_slice(annotations);
    apply(cp, &(slow + &hello_service("hello", &all)));
}

/// The replicas of each `/scale` write to the Deployment `hello` the API server took, in order
/// (audit log).
fn hello_scale_writes(cp: &ControlPlane) -> Vec<u64> {
    cp.audit_events()
        .iter()
        .filter(|e| {
            e["verb"] == "patch"
                && e["objectRef"]["subresource"] == "scale"
                && e["objectRef"]["name"] == "hello"
                && e["responseStatus"]["code"] == 200
        })
        .filter_map(|e| e["requestObject"]["spec"]["replicas"].as_u64())
        .collect()
}

/// Scaling on load with two ebb replicas in front of one Deployment (an app answering in 200 ms,
/// target concurrency 4): all 40 clients go through the replica that does not hold the Lease,
/// so the holder sees none of the traffic itself and scales on what the other reports. The
/// `/scale` writes are the holder's (audit log). SIGKILLed under load, the holder's Lease runs
/// out and the other takes over: while the load goes on it asks for no fewer replicas than the
/// traffic needs at the target. With the load gone, it scales down and then to zero.
#[tokio::test]
async fn two_ebbs_scale_on_their_summed_load_and_a_takeover_under_load_scales_nothing_down() {
    let (cp, _, _agent) = cluster().await;
    apply_slow_hello(
        &cp,
        &[
            ("ebb.dev/idle-after", "15s"),
            ("ebb.dev/hold-timeout", "60s"),
            ("ebb.dev/max-replicas", "\"30\""),
            ("autoscaling.knative.dev/target", "\"4\""),
            ("autoscaling.knative.dev/window", "6s"),
            ("ebb.dev/panic-window-percentage", "\"20\""),
        ],
    );
    let work = tempfile::tempdir().unwrap();
    let ports = [common::free_port(), common::free_port()];
    let start = |me: usize| pair_member(&cp, work.path(), ports, me);
    let mut holder = start(0);
    wait_for("ebb-0 holding the Lease", Duration::from_secs(30), || {
        lease_holder(&cp).as_deref() == Some("ebb-0")
    })
    .await;
    let other = start(1);
    let (data0, data1) = (work.path().join("ebb-0"), work.path().join("ebb-1"));
    wait_for("the route in both logs", Duration::from_secs(30), || {
        routes(&data0).contains("default/hello") && routes(&data1).contains("default/hello")
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let clients = load(other.proxy, "hello.test", 40, &stop, &answered, &failed);
    // The holder scales out on the other's traffic alone: 40 in flight at 4 per replica.
    wait_until(
        "the holder scaling out on the other's load",
        Duration::from_secs(90),
        || async {
            load_scalings(&data0)
                .iter()
                .any(|(_, to)| *to >= 10)
                .then_some(())
        },
    )
    .await;
    assert!(
        load_scalings(&data1).is_empty(),
        "the replica without the Lease decided"
    );
    wait_for("the holder's /scale write", Duration::from_secs(30), || {
        hello_scale_writes(&cp).iter().any(|n| *n >= 10)
    })
    .await;
    let peak = load_scalings(&data0)
        .iter()
        .map(|(_, to)| *to)
        .max()
        .unwrap_or(0);
    assert!((10..=16).contains(&peak), "{:?}", load_scalings(&data0));

    // The holder goes under load; the other takes the Lease over.
    holder.child.kill().unwrap();
    holder.child.wait().unwrap();
    wait_for("ebb-1 holding the Lease", Duration::from_secs(30), || {
        lease_holder(&cp).as_deref() == Some("ebb-1")
    })
    .await;
    // A whole window and more of load after the takeover: ebb-1 decides, and never below
    // what 40 requests in flight need at the target itself.
    let took_over = load_scalings(&data1).len();
    // Counted in answers, not time: 40 clients at 200 ms make about 200 a second.
    let from = answered.load(Ordering::Relaxed);
    wait_for(
        "more than a window of load after the takeover",
        Duration::from_secs(120),
        || answered.load(Ordering::Relaxed) >= from + 1_500,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    clients.join().unwrap();
    assert_eq!(failed.load(Ordering::Relaxed), 0, "every request answered");
    let after: Vec<(u64, u64)> = load_scalings(&data1)[took_over..].to_vec();
    assert!(
        after.iter().all(|(_, to)| *to >= 10),
        "a scale-down below the load's need after the takeover: {after:?}"
    );
    // With the load gone: down on load, then to zero when idle.
    let replicas = || {
        json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["spec"]["replicas"]
            .as_u64()
    };
    wait_for(
        "the Deployment back at zero",
        Duration::from_secs(90),
        || replicas() == Some(0),
    )
    .await;
    let s = load_scalings(&data1);
    assert!(s.iter().any(|(from, to)| to < from), "{s:?}");
    drop(other);
}

/// A scale-down on load keeps the pods with requests under way, on the real control plane: two
/// ebb replicas, all traffic through the one without the Lease. Four pods serve a short load;
/// then two 60 s requests start and the short load stops, so the load falls to two requests in
/// flight and the holder scales down to two. Before its `/scale` write it sets each ready pod's
/// `controller.kubernetes.io/pod-deletion-cost` to the requests under way on it (as the other
/// replica reported them), so the ReplicaSet removes the idle pods: both long requests are
/// answered (the app dies at SIGTERM, so a busy pod removed would cut its request).
#[tokio::test]
async fn a_scale_down_on_load_keeps_the_pods_with_requests_under_way() {
    let (cp, _, _agent) = cluster().await;
    apply_slow_hello(
        &cp,
        &[
            ("ebb.dev/idle-after", "10m"),
            ("ebb.dev/hold-timeout", "60s"),
            ("ebb.dev/max-replicas", "\"4\""),
            ("ebb.dev/target-concurrency", "\"1\""),
            ("ebb.dev/target-utilization-percentage", "\"100\""),
            ("ebb.dev/window", "6s"),
            ("ebb.dev/max-scale-down-rate", "\"10\""),
            ("ebb.dev/traffic-policy", r#"'{"balancer": "round_robin"}'"#),
        ],
    );
    let work = tempfile::tempdir().unwrap();
    let ports = [common::free_port(), common::free_port()];
    let start = |me: usize| pair_member(&cp, work.path(), ports, me);
    let _holder = start(0);
    wait_for("ebb-0 holding the Lease", Duration::from_secs(30), || {
        lease_holder(&cp).as_deref() == Some("ebb-0")
    })
    .await;
    let other = start(1);
    let data0 = work.path().join("ebb-0");
    wait_for("the route in both logs", Duration::from_secs(30), || {
        routes(&data0).contains("default/hello")
            && routes(&work.path().join("ebb-1")).contains("default/hello")
    })
    .await;
    let ready = || {
        json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))["status"]["readyReplicas"]
            .as_u64()
            .unwrap_or(0)
    };

    // Four pods for four clients at a target of one.
    let stop = Arc::new(AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let clients = load(other.proxy, "hello.test", 4, &stop, &answered, &failed);
    wait_for("four pods ready", Duration::from_secs(120), || ready() == 4).await;

    // Two long requests, on two of the four pods (round robin); then the short load stops.
    let proxy = other.proxy;
    let long = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let one = || async move { get(proxy, "hello.test", "/sleep?ms=60000").await.0 };
                tokio::join!(one(), one())
            })
    });
    let in_flight = || async {
        get(other.admin, "localhost", "/metrics")
            .await
            .1
            .lines()
            .find_map(|l| l.strip_prefix("ebb_proxy_requests_in_flight{route=\"default/hello\"} "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    wait_until(
        "the long requests under way",
        Duration::from_secs(30),
        || async { (in_flight().await >= 6).then_some(()) },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    clients.join().unwrap();
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "every short request answered"
    );

    // The load falls to the two long requests: the holder weighs the pods and scales to two.
    wait_for(
        "the holder's /scale write of two",
        Duration::from_secs(60),
        || hello_scale_writes(&cp).contains(&2),
    )
    .await;
    wait_for("two pods left", Duration::from_secs(60), || ready() == 2).await;
    assert!(
        !long.is_finished(),
        "the long requests ended before the scale-down"
    );
    let answers = long
        .join()
        .expect("a long request was cut by the scale-down: no answer");
    assert_eq!(
        answers,
        (200, 200),
        "a long request was cut by the scale-down"
    );
    // Weighed through the reports: the holder saw none of the traffic itself.
    let costs: Vec<String> = cp
        .audit_events()
        .iter()
        .filter(|e| {
            e["verb"] == "patch"
                && e["objectRef"]["resource"] == "pods"
                && e["objectRef"]["subresource"].is_null()
                && e["responseStatus"]["code"] == 200
        })
        .filter_map(|e| {
            e["requestObject"]["metadata"]["annotations"]
                ["controller.kubernetes.io/pod-deletion-cost"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert!(
        costs.iter().any(|c| c != "0"),
        "no busy pod was weighed: {costs:?}"
    );
    assert!(
        load_scalings(&data0)
            .iter()
            .any(|(from, to)| *to == 2 && *from > 2),
        "{:?}",
        load_scalings(&data0)
    );
}
