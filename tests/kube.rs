//! ebb against the real Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager
//! and kube-scheduler built from their Go modules (`scripts/controlplane build`), started by the
//! harness in `tests/common/controlplane.rs`.

mod common;

use std::time::Duration;

use common::controlplane::{ControlPlane, NOBODY_TOKEN, wait_until};

const DEPLOYMENT: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata:
  name: hello
  namespace: default
spec:
  replicas: 1
  selector:
    matchLabels: {app: hello}
  template:
    metadata:
      labels: {app: hello}
    spec:
      containers:
      - name: app
        image: ebb
        command: [ebb, example-app]
"#;

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// A kube-rs client for the administrator, trusting the control plane's CA.
async fn client(cp: &ControlPlane) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(&cp.kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("client config");
    kube::Client::try_from(config).expect("client")
}

/// The harness brings up the real control plane: the API server at the pinned release with RBAC
/// and an audit log, the deployment and replicaset controllers turning a Deployment into a Pod,
/// the scheduler trying to place it (no node yet: it says so on the pod), and the `/scale`
/// subresource, written through kube-rs as ebb scales, taking it back to zero.
#[tokio::test]
async fn the_real_control_plane_turns_a_deployment_into_pods_and_audits_every_write() {
    let cp = ControlPlane::start();
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

    cp.kubectl_stdin(&["apply", "--server-side", "-f", "-"], DEPLOYMENT);
    wait_until("the deployment's pod", Duration::from_secs(60), || {
        let pods = json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]));
        pods["items"]
            .as_array()
            .is_some_and(|items| items.len() == 1)
    });
    // The scheduler ran and found no node for it.
    wait_until("the scheduler's verdict", Duration::from_secs(60), || {
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
    });

    // Through the scale subresource with kube-rs, as ebb scales.
    let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(client(&cp).await, "default");
    let scale = deployments.get_scale("hello").await.expect("get scale");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(1));
    deployments
        .patch_scale(
            "hello",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"replicas": 0}})),
        )
        .await
        .expect("patch scale");
    wait_until("no pods left", Duration::from_secs(60), || {
        let pods = json(&cp.kubectl(&["get", "pods", "-l", "app=hello", "-o", "json"]));
        pods["items"].as_array().is_some_and(Vec::is_empty)
    });

    // The audit log saw the write to the scale subresource, by the administrator.
    wait_until(
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
    );
}
