//! ebb against the real Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager
//! and kube-scheduler built from their Go modules (`scripts/controlplane build`), started by the
//! harness in `tests/common/controlplane.rs`.

mod common;

use std::time::Duration;

use common::controlplane::{ControlPlane, NOBODY_TOKEN, http_get, wait_for};

/// A Deployment of the example app (listening on its pod's address, probed on `/health`) and a
/// Service in front of it.
const HELLO: &str = r#"
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
      terminationGracePeriodSeconds: 5
      containers:
      - name: app
        image: ebb
        command: [ebb, example-app]
        args: [--host, $(POD_IP), --port, "8080"]
        env:
        - name: POD_IP
          valueFrom: {fieldRef: {fieldPath: status.podIP}}
        readinessProbe:
          httpGet: {path: /health, port: 8080}
---
apiVersion: v1
kind: Service
metadata:
  name: hello
  namespace: default
spec:
  selector: {app: hello}
  ports:
  - {port: 80, targetPort: 8080}
"#;

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
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
    let cp = ControlPlane::start().await;
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

    cp.kubectl_stdin(&["apply", "--server-side", "-f", "-"], HELLO);
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
    let cp = ControlPlane::start().await;
    let kube = client(&cp).await;
    let images = [(
        "ebb".to_owned(),
        std::path::PathBuf::from(env!("CARGO_BIN_EXE_ebb")),
    )]
    .into();
    let _agent = common::node::start(kube.clone(), images).await;
    cp.kubectl_stdin(&["apply", "--server-side", "-f", "-"], HELLO);

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
