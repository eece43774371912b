//! ebb on a real node: the kubelet with containerd and runc ([`crate::common::kubelet`]), running
//! ebb's own image (`EBB_IMAGE`, which `scripts/image` builds) under the name `deploy/` gives
//! it, and the example app from the same image.

use std::time::Duration;

use crate::common::controlplane::{ControlPlane, wait_for};
use crate::common::ebbkube::{apply, json};
use crate::common::kubelet::RealNode;

/// The image `deploy/` names (its tag is the version).
fn deploy_image() -> String {
    format!("ghcr.io/ebb-dev/ebb:{}", env!("CARGO_PKG_VERSION"))
}

/// The control plane and a real node with ebb's image imported under `deploy/`'s name.
async fn real_cluster() -> (ControlPlane, RealNode) {
    let cp = ControlPlane::start_for_kubelet().await;
    let node = RealNode::start(&cp).await;
    let archive = std::env::var("EBB_IMAGE").expect(
        "EBB_IMAGE names ebb's image archive: `scripts/image` builds it (scripts/test does)",
    );
    node.import(std::path::Path::new(&archive), &[&deploy_image()]);
    (cp, node)
}

/// The ready pods with `label`: their names and addresses.
fn ready_pods(cp: &ControlPlane, namespace: &str, label: &str) -> Vec<(String, String)> {
    let pods = json(&cp.kubectl(&["get", "pods", "-n", namespace, "-l", label, "-o", "json"]));
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| {
            p["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        })
        .filter_map(|p| {
            Some((
                p["metadata"]["name"].as_str()?.to_owned(),
                p["status"]["podIP"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// The example app from ebb's image runs as a container on the real node: the kubelet starts
/// it through containerd and runc, its readiness probe passes, and it answers on its pod's
/// address on the node's bridge.
#[tokio::test]
async fn the_real_node_runs_the_example_app_from_ebbs_image() {
    let (cp, mut node) = real_cluster().await;
    apply(
        &cp,
        &format!(
            r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: hello, namespace: default}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: hello}}}}
  template:
    metadata: {{labels: {{app: hello}}}}
    spec:
      containers:
      - name: app
        image: {image}
        imagePullPolicy: Never
        command: [ebb, example-app]
        args: [--host, 0.0.0.0, --port, "8080"]
        readinessProbe:
          httpGet: {{path: /health, port: 8080}}
          periodSeconds: 1
"#,
            image = deploy_image()
        ),
    );
    let mut pods = Vec::new();
    wait_for("the app's pod ready", Duration::from_secs(60), || {
        node.assert_running();
        pods = ready_pods(&cp, "default", "app=hello");
        pods.len() == 1
    })
    .await;
    let ip = &pods[0].1;
    assert!(ip.starts_with("10.88."), "{ip}");
    let answer = crate::common::controlplane::http_get(&format!("{ip}:8080"), "/health")
        .expect("the pod answers");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Through a Service's cluster address, which kube-proxy serves.
    apply(&cp, &crate::common::ebbkube::hello_service("hello", &[]));
    let cluster_ip = cp.kubectl(&["get", "service", "hello", "-o", "jsonpath={.spec.clusterIP}"]);
    wait_for("the Service's cluster address answering", Duration::from_secs(30), || {
        node.assert_running();
        crate::common::controlplane::http_get(&format!("{cluster_ip}:80"), "/health")
            .is_some_and(|a| a.starts_with("HTTP/1.1 200"))
    })
    .await;
}
