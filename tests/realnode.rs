//! ebb on a real node: the kubelet with containerd and runc ([`crate::common::kubelet`]), running
//! ebb's own image (`EBB_IMAGE`, which `scripts/image` builds) under the name `deploy/` gives
//! it, and the example app from the same image under an app's name. The example app runs and
//! answers through its Service; `kubectl apply -k deploy/` brings up two ebb pods Ready through
//! their probes, which wake an app from zero through ebb's Service and reopen their logs from
//! their claims; `helm install` of the chart does the same and `helm uninstall` leaves only the
//! claims; a rolling update from one image tag to another under requests and calls fails no
//! request and ends every acknowledged call once.

use std::time::Duration;

use crate::common::controlplane::{ControlPlane, wait_for};
use crate::common::ebbkube::{Exchange, apply, exchange_within, json, ready_pods};
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
    let cluster_ip = cp.kubectl(&[
        "get",
        "service",
        "hello",
        "-o",
        "jsonpath={.spec.clusterIP}",
    ]);
    wait_for(
        "the Service's cluster address answering",
        Duration::from_secs(30),
        || {
            node.assert_running();
            crate::common::controlplane::http_get(&format!("{cluster_ip}:80"), "/health")
                .is_some_and(|a| a.starts_with("HTTP/1.1 200"))
        },
    )
    .await;
}

/// The example app's image: ebb's, imported under a name of its own, as a platform team's app.
const APP_IMAGE: &str = "apps.ebb.test/example-app:1";

/// `deploy/` under a test overlay for namespace `ns` on the real node: ebb's image as `deploy/`
/// names it, the tests' intervals added to its arguments and `env` to its environment, a
/// hostPath PersistentVolume per replica bound ahead to its claim (`overlay/pvs.yaml`; owned by
/// the image's user: hostPath volumes take no fsGroup). Returns the work directory.
fn overlay(ns: &str, env: &[(&str, &str)]) -> tempfile::TempDir {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    crate::copy_tree(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy")),
        &w.join("deploy"),
    );
    let mut pvs = String::new();
    for i in 0..2 {
        let dir = w.join(format!("pv-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(65532), Some(65532)).unwrap();
        pvs.push_str(&format!(
            "---\napiVersion: v1\nkind: PersistentVolume\nmetadata:\n  name: {ns}-pv-{i}\n\
             spec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadWriteOnce]\n  \
             claimRef: {{namespace: {ns}, name: data-ebb-{i}}}\n  \
             hostPath: {{path: {}}}\n",
            dir.display()
        ));
    }
    std::fs::create_dir_all(w.join("overlay")).unwrap();
    std::fs::write(w.join("overlay/pvs.yaml"), &pvs).unwrap();
    let add = |path: &str, value: String| {
        format!(
            "    - op: add\n      path: /spec/template/spec/containers/0/{path}/-\n      value: {value}\n"
        )
    };
    let timing: String = crate::common::ebbkube::TEST_TIMING
        .iter()
        .map(|a| add("args", format!("\"{a}\"")))
        .chain(
            env.iter()
                .map(|(k, v)| add("env", format!("{{name: {k}, value: \"{v}\"}}"))),
        )
        .collect();
    std::fs::write(
        w.join("overlay/kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
             resources:\n- ../deploy\n- pvs.yaml\n\
             patches:\n- target: {{kind: StatefulSet, name: ebb}}\n  patch: |\n{timing}"
        ),
    )
    .unwrap();
    work
}

/// `kubectl apply -k` of the overlay in `work`; returns once both ebb pods of `ns` are Ready.
async fn apply_deploy(cp: &ControlPlane, node: &mut RealNode, work: &tempfile::TempDir, ns: &str) {
    cp.kubectl(&[
        "apply",
        "--server-side",
        "-k",
        work.path().join("overlay").to_str().unwrap(),
    ]);
    two_ebbs_ready(cp, node, ns).await;
}

async fn two_ebbs_ready(cp: &ControlPlane, node: &mut RealNode, ns: &str) {
    wait_for("two ebb pods ready", Duration::from_secs(180), || {
        node.assert_running();
        ready_pods(cp, ns, "app.kubernetes.io/name=ebb").len() == 2
    })
    .await;
}

/// `helm ARGS` against the test's cluster, which must succeed.
fn helm(cp: &ControlPlane, args: &[&str]) {
    let out = std::process::Command::new(crate::helm())
        .args(args)
        .arg("--kubeconfig")
        .arg(&cp.kubeconfig)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Deployment `hello` of the example app's image at zero, and the Service that makes it a
/// route of ebb's (`hello.test`, idle after `idle_after`).
fn serverless_app(idle_after: &str) -> String {
    format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: hello, namespace: default}}
spec:
  replicas: 0
  selector: {{matchLabels: {{app: hello}}}}
  template:
    metadata: {{labels: {{app: hello}}}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: app
        image: {APP_IMAGE}
        command: [ebb, example-app]
        args: [--host, 0.0.0.0, --port, "8080"]
        readinessProbe:
          httpGet: {{path: /health, port: 8080}}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata:
  name: hello
  namespace: default
  annotations:
    ebb.dev/domains: hello.test
    ebb.dev/deployment: hello
    ebb.dev/idle-after: {idle_after}
    ebb.dev/hold-timeout: 60s
spec:
  selector: {{app: hello}}
  ports:
  - {{port: 80, targetPort: 8080}}
"#
    )
}

/// The cluster address of Service `name` in `ns`, port `port`.
fn service_addr(cp: &ControlPlane, ns: &str, name: &str, port: u16) -> std::net::SocketAddr {
    let ip = cp.kubectl(&[
        "get",
        "service",
        name,
        "-n",
        ns,
        "-o",
        "jsonpath={.spec.clusterIP}",
    ]);
    format!("{ip}:{port}").parse().unwrap()
}

/// The hostPath directory of the volume a claim is bound to.
fn claim_dir(cp: &ControlPlane, ns: &str, claim: &str) -> std::path::PathBuf {
    let pv = cp.kubectl(&[
        "get",
        "pvc",
        claim,
        "-n",
        ns,
        "-o",
        "jsonpath={.spec.volumeName}",
    ]);
    cp.kubectl(&["get", "pv", &pv, "-o", "jsonpath={.spec.hostPath.path}"])
        .into()
}

/// `kubectl apply -k deploy/` (under the test overlay) on the real node: two ebb pods from
/// ebb's image, as its user on a read-only root filesystem, become Ready through their probes.
/// A request through ebb's Service wakes an annotated Service's Deployment (the app's image)
/// from zero, and it goes back to zero when idle. A deleted ebb pod keeps its claim; the pod
/// made again reopens the same log.
#[tokio::test]
async fn deploy_on_a_real_node_wakes_from_zero_through_ebbs_service_and_keeps_each_log() {
    let (cp, mut node) = real_cluster().await;
    let archive = std::env::var("EBB_IMAGE").unwrap();
    node.import(std::path::Path::new(&archive), &[APP_IMAGE]);
    let work = overlay("ebb", &[]);
    apply_deploy(&cp, &mut node, &work, "ebb").await;
    // As the image's user, on a read-only root.
    let pod = json(&cp.kubectl(&["get", "pod", "ebb-0", "-n", "ebb", "-o", "json"]));
    assert_eq!(pod["spec"]["securityContext"]["runAsUser"], 65532);
    assert_eq!(
        pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"],
        true
    );
    assert_eq!(
        pod["status"]["containerStatuses"][0]["restartCount"], 0,
        "{pod}"
    );

    wakes_idles_and_reopens(&cp, &mut node, "ebb").await;
}

/// Through the ebb Service of namespace `ns`: a request wakes an annotated Service's Deployment
/// (the app's image) from zero, which goes back to zero when idle; `ebb-0` deleted keeps its
/// claim, and the pod made again reopens the same log and serves.
async fn wakes_idles_and_reopens(cp: &ControlPlane, node: &mut RealNode, ns: &str) {
    apply(cp, &serverless_app("5s"));
    let ebb = service_addr(cp, ns, "ebb", 80);
    let (status, body) = crate::common::controlplane::wait_until(
        "a route for hello.test",
        Duration::from_secs(60),
        || async {
            let answer = crate::common::ebbkube::get(ebb, "hello.test", "/pid").await;
            (answer.0 != 404).then_some(answer)
        },
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let replicas = || {
        cp.kubectl(&[
            "get",
            "deployment",
            "hello",
            "-o",
            "jsonpath={.spec.replicas}",
        ])
    };
    assert_eq!(replicas(), "1", "woken from zero");
    wait_for("hello back at zero", Duration::from_secs(90), || {
        replicas() == "0" && ready_pods(cp, "default", "app=hello").is_empty()
    })
    .await;

    // ebb-0 deleted: its claim stays, and the pod made again opens the same log.
    let dir = claim_dir(cp, ns, "data-ebb-0");
    let identity = std::fs::read_to_string(dir.join("IDENTITY")).expect("ebb-0's log");
    let before = crate::common::events(&dir).len();
    assert!(before > 0);
    let uid = |cp: &ControlPlane| {
        cp.try_kubectl(&[
            "get",
            "pod",
            "ebb-0",
            "-n",
            ns,
            "-o",
            "jsonpath={.metadata.uid}",
        ])
        .unwrap_or_default()
    };
    let old = uid(cp);
    cp.kubectl(&["delete", "pod", "ebb-0", "-n", ns, "--wait=false"]);
    wait_for(
        "ebb-0 made again and ready",
        Duration::from_secs(120),
        || {
            node.assert_running();
            let now = uid(cp);
            !now.is_empty()
                && now != old
                && ready_pods(cp, ns, "app.kubernetes.io/name=ebb")
                    .iter()
                    .any(|(n, _)| n == "ebb-0")
        },
    )
    .await;
    assert_eq!(
        claim_dir(cp, ns, "data-ebb-0"),
        dir,
        "the same claim and volume"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("IDENTITY")).unwrap(),
        identity
    );
    assert!(crate::common::events(&dir).len() >= before);
    // And it serves: a request through the Service wakes hello again.
    let (status, body) = crate::common::ebbkube::get(ebb, "hello.test", "/pid").await;
    assert_eq!(status, 200, "{body}");
}

/// Objects of every namespaced kind in `ns` (events aside), as `kind/name`.
fn objects_in(cp: &ControlPlane, ns: &str) -> Vec<String> {
    let kinds = cp.kubectl(&[
        "api-resources",
        "--verbs=list",
        "--namespaced",
        "-o",
        "name",
    ]);
    let kinds: Vec<&str> = kinds.lines().filter(|k| !k.starts_with("events")).collect();
    let mut objects: Vec<String> = cp
        .kubectl(&["get", &kinds.join(","), "-n", ns, "-o", "name"])
        .lines()
        .map(str::to_owned)
        .collect();
    objects.sort();
    objects
}

/// `helm install` of the chart into another namespace on the real node does what `deploy/`
/// does: two ebb pods Ready, a wake from zero through ebb's Service and back, a deleted pod's
/// log reopened. `helm uninstall` then leaves no object of the release behind but the replicas'
/// claims (as a StatefulSet does): not the Lease ebb wrote (its StatefulSet owns it), not the
/// cluster-wide role and bindings.
#[tokio::test]
async fn helm_install_on_a_real_node_serves_and_uninstall_leaves_only_the_claims() {
    let (cp, mut node) = real_cluster().await;
    let archive = std::env::var("EBB_IMAGE").unwrap();
    node.import(std::path::Path::new(&archive), &[APP_IMAGE]);
    let ns = "preview";
    let work = overlay(ns, &[]);
    cp.kubectl(&["create", "namespace", ns]);
    let before = objects_in(&cp, ns);
    cp.kubectl(&[
        "apply",
        "-f",
        work.path().join("overlay/pvs.yaml").to_str().unwrap(),
    ]);
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/chart");
    let mut install = vec!["install", "ebb", chart, "--namespace", ns];
    let timing: Vec<String> = crate::common::ebbkube::TEST_TIMING
        .iter()
        .enumerate()
        .map(|(i, arg)| format!("extraArgs[{i}]={arg}"))
        .collect();
    for set in &timing {
        install.extend(["--set", set]);
    }
    helm(&cp, &install);
    two_ebbs_ready(&cp, &mut node, ns).await;
    wakes_idles_and_reopens(&cp, &mut node, ns).await;
    let lease = json(&cp.kubectl(&["get", "lease", "ebb-scaler", "-n", ns, "-o", "json"]));
    assert_eq!(
        lease["metadata"]["ownerReferences"][0]["kind"], "StatefulSet",
        "{lease}"
    );

    helm(&cp, &["uninstall", "ebb", "--wait", "--namespace", ns]);
    let mut left = before.clone();
    left.extend([
        "persistentvolumeclaim/data-ebb-0".to_owned(),
        "persistentvolumeclaim/data-ebb-1".to_owned(),
    ]);
    left.sort();
    let mut now = Vec::new();
    wait_for(
        "nothing but the claims left",
        Duration::from_secs(60),
        || {
            now = objects_in(&cp, ns);
            now == left
        },
    )
    .await;
    for kind in ["clusterrole", "clusterrolebinding"] {
        let names = cp.kubectl(&["get", kind, "-o", "name"]);
        assert!(!names.contains("ebb-preview"), "{names}");
    }
}

/// One exchange with `addr`, within 30 s (see [`Exchange`]).
async fn exchange(
    addr: std::net::SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Exchange {
    exchange_within(
        addr,
        method,
        host,
        path,
        token,
        body,
        Duration::from_secs(30),
    )
    .await
}

const RUNNER_TOKEN: &str = "ebb-test-runner";

/// The digest of the image in an OCI archive.
fn image_digest(archive: &str) -> String {
    let out = std::process::Command::new("tar")
        .args(["-xOf", archive, "index.json"])
        .output()
        .unwrap();
    json(&String::from_utf8_lossy(&out.stdout))["manifests"][0]["digest"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A rolling update of ebb's StatefulSet from one image to another (two builds, two tags) on the
/// real node, while requests go through ebb's Service and calls through `ebb-api`, without
/// pause. Every acknowledged call ends once (one `CallFinished` in its owner's log, `success`);
/// every request is answered 200, except two kinds the client is told to send again: a
/// connection that could not be made (nothing was sent: a replica's address just leaving the
/// Service), and a 503 with `Retry-After`; with `deploy/`'s shutdown delay there are none. Each
/// replica reopens its own log from its claim.
#[tokio::test]
async fn a_rolling_update_under_load_loses_no_call_and_fails_no_request() {
    let (cp, mut node) = real_cluster().await;
    let archive = std::env::var("EBB_IMAGE").unwrap();
    node.import(std::path::Path::new(&archive), &[APP_IMAGE]);
    // The other image: the same binary, made at another time (`scripts/test` builds it).
    let next_archive = std::env::var("EBB_IMAGE_NEXT")
        .expect("EBB_IMAGE_NEXT names a second image archive of ebb (scripts/test builds it)");
    assert_ne!(
        image_digest(&archive),
        image_digest(&next_archive),
        "two different images"
    );
    let next = format!("{}-next", deploy_image());
    node.import(std::path::Path::new(&next_archive), &[&next]);
    let work = overlay("ebb", &[("EBB_RUNNER_TOKEN", RUNNER_TOKEN)]);
    apply_deploy(&cp, &mut node, &work, "ebb").await;
    apply(&cp, &serverless_app("1h"));
    let proxy = service_addr(&cp, "ebb", "ebb", 80);
    let api = service_addr(&cp, "ebb", "ebb-api", 8081);
    let (status, body) = crate::common::controlplane::wait_until(
        "a route for hello.test",
        Duration::from_secs(60),
        || async {
            let answer = crate::common::ebbkube::get(proxy, "hello.test", "/pid").await;
            (answer.0 != 404).then_some(answer)
        },
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let identities: Vec<String> = (0..2)
        .map(|i| {
            std::fs::read_to_string(
                claim_dir(&cp, "ebb", &format!("data-ebb-{i}")).join("IDENTITY"),
            )
            .unwrap()
        })
        .collect();

    // Load: requests and calls, one after another each, until the rollout is done.
    let done = std::rc::Rc::new(std::cell::Cell::new(false));
    let answered = std::rc::Rc::new(std::cell::Cell::new(0u32));
    let local = tokio::task::LocalSet::new();
    let requests = local.spawn_local({
        let answered = answered.clone();
        let done = done.clone();
        async move {
            let (mut ok, mut retried, mut failed) = (0u32, (0u32, 0u32), Vec::new());
            while !done.get() {
                match exchange(proxy, "GET", "hello.test", "/pid", None, "").await {
                    Exchange::Answer(200, _, _) => {
                        ok += 1;
                        answered.set(answered.get() + 1);
                    }
                    Exchange::NotConnected => retried.0 += 1,
                    Exchange::Answer(503, true, _) => retried.1 += 1,
                    other => failed.push(format!("{other:?}")),
                }
            }
            (ok, retried, failed)
        }
    });
    let calls = local.spawn_local({
        let done = done.clone();
        async move {
            let (mut ids, mut retried, mut failed) = (Vec::new(), (0u32, 0u32), Vec::new());
            let body =
                r#"{"target": "default/hello", "payload": {"method": "GET", "path": "/pid"}}"#;
            while !done.get() {
                match exchange(
                    api,
                    "POST",
                    "ebb",
                    "/runner/enqueue",
                    Some(RUNNER_TOKEN),
                    body,
                )
                .await
                {
                    Exchange::Answer(200, _, b) => {
                        ids.push(json(&b)["id"].as_str().unwrap().to_owned())
                    }
                    Exchange::NotConnected => retried.0 += 1,
                    Exchange::Answer(503, true, _) => retried.1 += 1,
                    other => failed.push(format!("{other:?}")),
                }
            }
            (ids, retried, failed)
        }
    });
    let (requests, calls) = local
        .run_until(async {
            wait_for("load flowing", Duration::from_secs(30), || {
                answered.get() >= 20
            })
            .await;
            cp.kubectl(&[
                "set",
                "image",
                "-n",
                "ebb",
                "statefulset/ebb",
                &format!("ebb={next}"),
            ]);
            wait_for("the rollout done", Duration::from_secs(240), || {
                node.assert_running();
                let sts =
                    json(&cp.kubectl(&["get", "statefulset", "ebb", "-n", "ebb", "-o", "json"]));
                let st = &sts["status"];
                st["updateRevision"] == st["currentRevision"]
                    && st["updatedReplicas"] == 2
                    && st["readyReplicas"] == 2
            })
            .await;
            done.set(true);
            (requests.await.unwrap(), calls.await.unwrap())
        })
        .await;
    let (ok, retried, failed) = requests;
    println!(
        "requests: {ok} answered 200; to send again: {} not connected, {} 503 with Retry-After; \
         {} failed",
        retried.0,
        retried.1,
        failed.len()
    );
    assert!(failed.is_empty(), "requests failed: {failed:?}");
    assert!(ok > 0);
    let (ids, call_retries, failed) = calls;
    println!(
        "calls: {} acknowledged; to send again: {} not connected, {} 503 with Retry-After; {} \
         failed",
        ids.len(),
        call_retries.0,
        call_retries.1,
        failed.len()
    );
    assert!(failed.is_empty(), "enqueues failed: {failed:?}");
    assert!(!ids.is_empty());
    // Both replicas run the new image, from their own claims and logs.
    for (i, identity) in identities.iter().enumerate() {
        let pod =
            json(&cp.kubectl(&["get", "pod", &format!("ebb-{i}"), "-n", "ebb", "-o", "json"]));
        assert_eq!(pod["spec"]["containers"][0]["image"], next.as_str());
        let dir = claim_dir(&cp, "ebb", &format!("data-ebb-{i}"));
        assert_eq!(
            &std::fs::read_to_string(dir.join("IDENTITY")).unwrap(),
            identity
        );
    }
    // Every acknowledged call ends, successfully, once.
    for id in &ids {
        let c = crate::common::controlplane::wait_until(
            "the call's end",
            Duration::from_secs(120),
            || async {
                match exchange(
                    api,
                    "GET",
                    "ebb",
                    &format!("/v1/calls/{id}"),
                    Some(RUNNER_TOKEN),
                    "",
                )
                .await
                {
                    Exchange::Answer(200, _, b) => {
                        let c = json(&b);
                        ["success", "error", "timeout", "cancelled"]
                            .contains(&c["state"].as_str().unwrap_or(""))
                            .then_some(c)
                    }
                    _ => None,
                }
            },
        )
        .await;
        assert_eq!(c["state"], "success", "{c}");
    }
    let mut finished = std::collections::BTreeMap::<String, usize>::new();
    for i in 0..2 {
        for e in crate::common::events(&claim_dir(&cp, "ebb", &format!("data-ebb-{i}"))) {
            if let Some(f) = e["event"].get("CallFinished") {
                *finished
                    .entry(f["id"].as_str().unwrap_or("").to_owned())
                    .or_default() += 1;
            }
        }
    }
    for id in &ids {
        assert_eq!(
            finished.get(id),
            Some(&1),
            "{id} finished {:?} times",
            finished.get(id)
        );
    }
}
