//! ebb as a Gateway API implementation, checked by the upstream conformance suite.
//!
//! The suite (`sigs.k8s.io/gateway-api/conformance`, `scripts/gateway build`) runs as it ships:
//! its base manifests' echo backends and CoreDNS run as containers on a real node (the kubelet,
//! containerd and runc of [`crate::common::kubelet`]) from images built of the same module, and
//! ebb, a process beside the control plane, is the controller of the GatewayClass `ebb` with
//! each Gateway on an address of its own (`--gateway-address-pool` on loopback), its listeners
//! reaching the pods over the node's bridge. The suite's report (the YAML it writes) must say
//! that the `GATEWAY-HTTP` profile's core passed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::controlplane::{ControlPlane, wait_for};
use crate::common::ebbkube::apply;
use crate::common::kubelet::RealNode;

/// The GatewayClass the tests make for ebb.
const CLASS: &str = "ebb";
/// The addresses ebb gives Gateways: loopback, in the test's network namespace.
const POOL: &str = "127.0.1.1-127.0.1.254";

/// The suite's build: `EBB_GATEWAY` (scripts/gateway build).
fn suite() -> PathBuf {
    match std::env::var_os("EBB_GATEWAY") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "EBB_GATEWAY is not set: the Gateway API tests need the conformance suite that \
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
                "gatewayclasses,gateways,httproutes,referencegrants",
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

/// The upstream conformance suite's `GATEWAY-HTTP` profile passes its core against ebb: every
/// core test (Gateways and their listeners' conditions, attached routes, path, header and
/// hostname matching with the Gateway API's precedence, weights, redirects, header changes,
/// ReferenceGrants, HTTPS with certificates by SNI, services headless and with manual
/// EndpointSlices), and the report the suite writes says so.
#[tokio::test]
async fn the_gateway_api_conformance_suite_passes_its_http_core_against_ebb() {
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
            "-conformance-profiles=GATEWAY-HTTP",
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
    let profile = report["profiles"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "GATEWAY-HTTP"))
        .unwrap_or_else(|| panic!("the report names the profile: {written}"));
    assert_eq!(profile["core"]["result"], "success", "{written}");
}
