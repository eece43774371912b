//! ebb as a Gateway API implementation, checked by the upstream conformance suite.
//!
//! The suite (`sigs.k8s.io/gateway-api/conformance`, `scripts/gateway build`) runs as it ships:
//! its base manifests' echo backends and CoreDNS run as containers on a real node (the kubelet,
//! containerd and runc of [`crate::common::kubelet`]) from images built of the same module, and
//! ebb, a process beside the control plane, is the controller of the GatewayClass `ebb` with
//! each Gateway on an address of its own (`--gateway-address-pool` on loopback), its listeners
//! reaching the pods over the node's bridge. The suite's report (the YAML it writes) must say
//! that the `GATEWAY-HTTP` and `GATEWAY-GRPC` profiles' cores passed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::controlplane::{ControlPlane, wait_for};
use crate::common::ebbkube::{apply, scale_writes};
use crate::common::kubelet::RealNode;

/// The GatewayClass the tests make for ebb.
const CLASS: &str = "ebb";
/// The addresses ebb gives Gateways: loopback, in the test's network namespace.
const POOL: &str = "127.0.1.1-127.0.1.254";

/// The suite's build: `EBB_GATEWAY_SUITE` (scripts/gateway build).
fn suite() -> PathBuf {
    match std::env::var_os("EBB_GATEWAY_SUITE") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "EBB_GATEWAY_SUITE is not set: the Gateway API tests need the conformance suite that \
             `scripts/gateway build` builds (scripts/test sets it)"
        ),
    }
}

/// deploy/'s ServiceAccount and its RBAC (not its StatefulSet: ebb runs beside the control
/// plane here), and a kubeconfig with a token of that account.
fn service_account(cp: &ControlPlane) -> PathBuf {
    let rendered = cp.kubectl(&["kustomize", concat!(env!("CARGO_MANIFEST_DIR"), "/deploy")]);
    let wanted = [
        "kind: Namespace",
        "kind: ServiceAccount",
        "kind: ClusterRole",
        "kind: ClusterRoleBinding",
        "kind: Role",
        "kind: RoleBinding",
        "kind: CustomResourceDefinition",
    ];
    let kept: Vec<&str> = rendered
        .split("\n---\n")
        .filter(|doc| doc.lines().any(|l| wanted.contains(&l)))
        .collect();
    apply(cp, &kept.join("\n---\n"));
    let token = cp.kubectl(&["create", "token", "ebb", "-n", "ebb", "--duration", "2h"]);
    cp.kubeconfig_with_token("ebb", token.trim())
}

/// The control plane, a real node with the suite's images, the Gateway API's CRDs, the class
/// `ebb`, and ebb serving it.
async fn gateway_cluster(data: &Path) -> (ControlPlane, RealNode, crate::common::Ebb) {
    let cp = ControlPlane::start_for_kubelet().await;
    let node = RealNode::start(&cp).await;
    let dir = suite();
    node.import(
        &dir.join("echo-basic.oci.tar"),
        &[
            "registry.k8s.io/gateway-api/echo-basic:v1.5.1",
            "registry.k8s.io/gateway-api/echo-basic:v1.6.0-dev.3",
        ],
    );
    node.import(
        &dir.join("coredns.oci.tar"),
        &["registry.k8s.io/coredns/coredns:v1.12.2"],
    );
    let crds = dir.join("crds");
    cp.kubectl(&["apply", "--server-side", "-f", crds.to_str().expect("path")]);
    wait_for(
        "the Gateway API's CRDs served",
        Duration::from_secs(60),
        || {
            cp.try_kubectl(&[
                "get",
                "gatewayclasses,gateways,httproutes,grpcroutes,referencegrants",
                "-A",
            ])
            .is_ok()
        },
    )
    .await;
    apply(
        &cp,
        &format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {{name: {CLASS}}}\nspec: {{controllerName: {}}}\n",
            ebb::gateway::CONTROLLER_NAME
        ),
    );
    let kubeconfig = service_account(&cp);
    let mut args: Vec<&str> = vec![
        "--orchestrator",
        "kubernetes",
        "--pod-namespace",
        "ebb",
        "--gateway",
        "--gateway-address-pool",
        POOL,
    ];
    args.extend_from_slice(&crate::common::ebbkube::TEST_TIMING);
    let ebb = crate::common::serve_env(
        data,
        None,
        None,
        &args,
        &[("KUBECONFIG", kubeconfig.as_os_str())],
    );
    (cp, node, ebb)
}

/// The upstream conformance suite's `GATEWAY-HTTP` and `GATEWAY-GRPC` profiles pass their cores
/// against ebb: every core test (Gateways and their listeners' conditions, attached routes,
/// path, header and hostname matching with the Gateway API's precedence, weights, redirects,
/// header changes, ReferenceGrants, HTTPS with certificates by SNI, services headless and with
/// manual EndpointSlices; gRPC calls over h2c by service, method and headers, weighted), the
/// extended features ebb names, and the report the suite writes says so.
#[tokio::test]
async fn the_gateway_api_conformance_suite_passes_its_http_and_grpc_cores_against_ebb() {
    let data = tempfile::tempdir().expect("tempdir");
    let (cp, mut node, _ebb) = gateway_cluster(data.path()).await;
    let report = data.path().join("conformance-report.yaml");
    let features = ebb::gateway::SUPPORTED_FEATURES.join(",");
    let mut suite_run = Command::new(suite().join("gateway-conformance"));
    suite_run
        .args([
            "-test.run=TestConformance",
            "-test.v",
            "-test.timeout=25m",
            &format!("-gateway-class={CLASS}"),
            "-conformance-profiles=GATEWAY-HTTP,GATEWAY-GRPC",
            &format!("-supported-features={features}"),
            "-organization=ebb",
            "-project=ebb",
            "-url=https://github.com/ebb-dev/ebb",
            &format!("-version={}", env!("CARGO_PKG_VERSION")),
            "-contact=https://github.com/ebb-dev/ebb/issues",
            "-mode=default",
        ])
        .arg(format!("-report-output={}", report.display()))
        .env("KUBECONFIG", &cp.kubeconfig)
        .current_dir(data.path());
    let log = data.path().join("suite.log");
    let mut child = crate::common::controlplane::spawn_logged(data.path(), "suite", &mut suite_run);
    let took = ebb::clock::Stopwatch::start();
    let status = crate::common::controlplane::wait_until(
        "the conformance suite's end",
        Duration::from_secs(30 * 60),
        || {
            node.assert_running();
            let done = child.try_wait().expect("the suite");
            async move { done }
        },
    )
    .await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let failed: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("--- FAIL"))
        .collect();
    println!(
        "gateway conformance: {} s, {} failed: {failed:?}",
        took.elapsed().as_secs(),
        failed.len()
    );
    let written = std::fs::read_to_string(&report).unwrap_or_default();
    println!("{written}");
    // Kept after the test: the report and the suite's log.
    let kept = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let _ = std::fs::write(kept.join("gateway-conformance-report.yaml"), &written);
    let _ = std::fs::write(kept.join("gateway-conformance.log"), &text);
    assert!(
        status.success(),
        "the suite failed ({} tests): {failed:#?}\n{}",
        failed.len(),
        crate::common::controlplane::tail(&log, 80)
    );
    let report: serde_json::Value = yaml_serde::from_str(&written).expect("the report is YAML");
    for name in ["GATEWAY-HTTP", "GATEWAY-GRPC"] {
        let profile = report["profiles"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == name))
            .unwrap_or_else(|| panic!("the report names the profile {name}: {written}"));
        assert_eq!(profile["core"]["result"], "success", "{name}: {written}");
    }
}

/// The Gateway API's CRDs (from the suite's build) and the class `ebb`.
fn gateway_api(cp: &ControlPlane) {
    let crds = suite().join("crds");
    cp.kubectl(&["apply", "--server-side", "-f", crds.to_str().expect("path")]);
    apply(
        cp,
        &format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {{name: {CLASS}}}\nspec: {{controllerName: {}}}\n",
            ebb::gateway::CONTROLLER_NAME
        ),
    );
}

/// A condition's status and reason in a list of them.
fn condition(conditions: &serde_json::Value, type_: &str) -> Option<(String, String)> {
    conditions
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

/// A backend ebb scales, reached only through HTTPRoutes, both ways: a plain Service whose
/// Deployment is labelled as its workload (`ebb.dev/service`, the settings in the Deployment's
/// annotations), and a Service that names the Deployment (`ebb.dev/deployment`, no host names of
/// its own). 100 requests at once through three routes to it at zero are one scale write and
/// are all answered; requests through one route keep it awake; idle, it goes back to zero. A listener on a port ebb cannot have says
/// `PortUnavailable` while the Gateway's other listener serves, and is served once the port is
/// free; an HTTPRoute for a host name
/// an annotated Service serves is refused with `HostnameConflict`.
#[tokio::test]
async fn a_backend_behind_httproutes_wakes_from_zero_once_and_idles_back() {
    let (cp, _client, _agent) = crate::common::ebbkube::cluster().await;
    gateway_api(&cp);
    // A socket taken before ebb starts: the pool's first address, port 81.
    let taken = std::net::TcpListener::bind("127.0.1.1:81").expect("127.0.1.1:81");
    let labelled = crate::common::ebbkube::hello_deployment(0).replacen(
        "  namespace: default\n",
        "  namespace: default\n  labels: {ebb.dev/service: hello}\n  \
         annotations: {ebb.dev/idle-after: 2s, ebb.dev/hold-timeout: 60s}\n",
        1,
    );
    apply(
        &cp,
        &(labelled
            + &crate::common::ebbkube::hello_service("hello", &[])
            + &crate::common::ebbkube::hello_service(
                "named",
                &[
                    ("ebb.dev/deployment", "hello"),
                    ("ebb.dev/idle-after", "2s"),
                    ("ebb.dev/hold-timeout", "60s"),
                ],
            )
            + &crate::common::ebbkube::hello_service(
                "shop",
                &[
                    ("ebb.dev/domains", "shop.test"),
                    ("ebb.dev/deployment", "hello"),
                    ("ebb.dev/idle-after", "1s"),
                ],
            )),
    );
    apply(
        &cp,
        r#"
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: web, namespace: default}
spec:
  gatewayClassName: ebb
  listeners:
  - {name: http, port: 80, protocol: HTTP}
  - {name: taken, port: 81, protocol: HTTP}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: a, namespace: default}
spec:
  parentRefs: [{name: web, sectionName: http}]
  hostnames: [a.test]
  rules: [{backendRefs: [{name: hello, port: 80}]}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: b, namespace: default}
spec:
  parentRefs: [{name: web, sectionName: http}]
  hostnames: [b.test]
  rules: [{matches: [{path: {type: PathPrefix, value: /pid}}], backendRefs: [{name: hello, port: 80}]}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: c, namespace: default}
spec:
  parentRefs: [{name: web, sectionName: http}]
  hostnames: [c.test]
  rules: [{backendRefs: [{name: named, port: 80}]}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: clash, namespace: default}
spec:
  parentRefs: [{name: web, sectionName: http}]
  hostnames: [shop.test]
  rules: [{backendRefs: [{name: hello, port: 80}]}]
"#,
    );
    let data = tempfile::tempdir().expect("tempdir");
    let ebb = crate::common::ebbkube::serve_on(
        &cp,
        data.path(),
        &["--gateway", "--gateway-address-pool", POOL],
    );
    let gateway = || {
        crate::common::ebbkube::json(&cp.kubectl(&[
            "get", "gateway", "web", "-o", "json",
        ]))["status"]
            .clone()
    };
    let route_status = |name: &str| {
        crate::common::ebbkube::json(&cp.kubectl(&["get", "httproute", name, "-o", "json"]))
            ["status"]["parents"][0]["conditions"]
            .clone()
    };
    let accepted = || (String::from("True"), String::from("Accepted"));
    let unavailable = || {
        gateway()["listeners"].as_array().is_some_and(|ls| {
            ls.iter().any(|l| {
                l["name"] == "taken"
                    && condition(&l["conditions"], "Accepted")
                        == Some(("False".into(), "PortUnavailable".into()))
            })
        })
    };
    wait_for(
        "the Gateway programmed, routes a, b and c accepted, port 81 unavailable",
        Duration::from_secs(60),
        || {
            let g = gateway();
            condition(&g["conditions"], "Programmed").is_some_and(|(s, _)| s == "True")
                && condition(&route_status("a"), "Accepted") == Some(accepted())
                && condition(&route_status("b"), "Accepted") == Some(accepted())
                && condition(&route_status("c"), "Accepted") == Some(accepted())
                && unavailable()
        },
    )
    .await;
    let g = gateway();
    assert_eq!(g["addresses"][0]["value"], "127.0.1.1", "{g}");
    let listener = |name: &str| {
        g["listeners"]
            .as_array()
            .and_then(|ls| ls.iter().find(|l| l["name"] == name).cloned())
            .unwrap_or_else(|| panic!("listener {name}: {g}"))
    };
    assert_eq!(
        condition(&listener("taken")["conditions"], "Accepted"),
        Some(("False".into(), "PortUnavailable".into()))
    );
    assert_eq!(listener("http")["attachedRoutes"], 3, "{g}");
    assert_eq!(
        condition(&route_status("clash"), "Accepted"),
        Some(("False".into(), "HostnameConflict".into()))
    );
    // Freed, the port is had within a moment and the listener serves.
    drop(taken);
    wait_for("port 81 had", Duration::from_secs(30), || {
        gateway()["listeners"].as_array().is_some_and(|ls| {
            ls.iter().any(|l| {
                l["name"] == "taken"
                    && condition(&l["conditions"], "Programmed")
                        == Some(("True".into(), "Programmed".into()))
            })
        })
    })
    .await;
    let http: std::net::SocketAddr = "127.0.1.1:80".parse().unwrap();
    assert_eq!(scale_writes(&cp, "hello"), 0, "nothing woke it yet");

    // Both Services are ebb's routes (the labelled Deployment's, the named one's).
    wait_for(
        "both Services routed by ebb",
        Duration::from_secs(30),
        || {
            let routed: std::collections::BTreeSet<String> = crate::common::events(data.path())
                .iter()
                .filter_map(|e| e["event"]["RouteUpserted"]["route"]["name"].as_str())
                .map(str::to_owned)
                .collect();
            routed.contains("default/hello") && routed.contains("default/named")
        },
    )
    .await;
    // 100 at once, through the three routes, while nothing runs.
    let burst = (0..100).map(|i| {
        let host = ["a.test", "b.test", "c.test"][i % 3];
        crate::common::ebbkube::get(http, host, "/pid")
    });
    let answers = futures_util::future::join_all(burst).await;
    let pids: std::collections::BTreeSet<i32> = answers
        .iter()
        .map(|(status, body)| {
            assert_eq!(*status, 200, "{body}");
            crate::common::ebbkube::pid_of(body)
        })
        .collect();
    assert_eq!(pids.len(), 1, "one pod answered them all: {pids:?}");
    assert_eq!(
        scale_writes(&cp, "hello"),
        1,
        "exactly one scale write woke it"
    );
    // The route a's host is not shop.test's: the annotated Service's route keeps that host.
    assert_eq!(
        crate::common::ebbkube::get(http, "shop.test", "/pid")
            .await
            .0,
        404
    );

    // Requests through b alone, for longer than the idle time: the backend stays awake.
    let replicas = || {
        crate::common::ebbkube::json(&cp.kubectl(&["get", "deployment", "hello", "-o", "json"]))
            ["spec"]["replicas"]
            .clone()
    };
    let busy = ebb::clock::Stopwatch::start();
    while busy.elapsed() < Duration::from_secs(5) {
        let (status, body) = crate::common::ebbkube::get(http, "b.test", "/pid").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(replicas(), 1, "scaled down under traffic");
    }
    assert_eq!(scale_writes(&cp, "hello"), 1);
    // Idle: back to zero.
    wait_for("the idle scale-down", Duration::from_secs(60), || {
        replicas() == 0
    })
    .await;
    drop(ebb);
}
