//! What the kube tests and the kube benchmark share: the example app as a serverless Deployment
//! behind annotated Services, `ebb serve` on Kubernetes as `deploy/`'s ServiceAccount, and
//! reading what ebb did.

use std::time::Duration;

use super::controlplane::ControlPlane;

pub fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// A kube-rs client for the administrator, trusting the control plane's CA.
pub async fn client(cp: &ControlPlane) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(&cp.kubeconfig).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("client config");
    kube::Client::try_from(config).expect("client")
}

/// The example app as the Deployment `hello` at `replicas` (listening on its pod's address,
/// probed on `/health`).
pub fn hello_deployment(replicas: u32) -> String {
    format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata:
  name: hello
  namespace: default
spec:
  replicas: {replicas}
  selector:
    matchLabels: {{app: hello}}
  template:
    metadata:
      labels: {{app: hello}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: app
        image: {image}
        command: [ebb, example-app]
        args: [--host, $(POD_IP), --port, "8080"]
        env:
        - name: POD_IP
          valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}
        readinessProbe:
          httpGet: {{path: /health, port: 8080}}
"#,
        image = test_image(),
    )
}

/// The Service `name` in front of `hello`, with `annotations` (YAML values as written).
pub fn hello_service(name: &str, annotations: &[(&str, &str)]) -> String {
    let mut meta = String::new();
    if !annotations.is_empty() {
        meta.push_str("  annotations:\n");
        for (k, v) in annotations {
            meta.push_str(&format!("    {k}: {v}\n"));
        }
    }
    format!(
        r#"
---
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
{meta}spec:
  selector: {{app: hello}}
  ports:
  - {{port: 80, targetPort: 8080}}
"#
    )
}

/// The example app as a Deployment at zero replicas, to be woken by ebb, and the Services in
/// front of it: `hello` with ebb's annotations, `legacy` with proxless', `bad` with a host name
/// that is not one.
pub fn serverless_hello(idle_after: &str) -> String {
    hello_deployment(0)
        + &hello_service(
            "hello",
            &[
                ("ebb.dev/domains", "hello.test"),
                ("ebb.dev/deployment", "hello"),
                ("ebb.dev/idle-after", idle_after),
                ("ebb.dev/hold-timeout", "60s"),
            ],
        )
        + &hello_service(
            "legacy",
            &[
                ("proxless/domains", "legacy.test"),
                ("proxless/deployment", "hello"),
            ],
        )
        + &hello_service(
            "bad",
            &[
                ("ebb.dev/domains", "\"not a host!\""),
                ("ebb.dev/deployment", "hello"),
            ],
        )
}

/// `GET path` through ebb's proxy for `host`: the status and the body (`Connection: close`).
pub async fn get(proxy: std::net::SocketAddr, host: &str, path: &str) -> (u16, String) {
    send(proxy, "GET", host, path, None, "").await
}

/// `METHOD path` to `addr` for `host` with an optional bearer token and a body: the status and
/// the body (`Connection: close`, within 90 s).
pub async fn send(
    addr: std::net::SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    let limit = Duration::from_secs(90);
    exchange(addr, method, host, path, token, body, limit)
        .await
        .unwrap_or_else(|| panic!("no HTTP answer to {method} {host}{path} within 90 s"))
}

/// [`send`], or `None` when ebb is gone or slow (within 5 s): for load that runs across a
/// SIGKILL.
pub async fn try_send(
    addr: std::net::SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Option<(u16, String)> {
    let limit = Duration::from_secs(5);
    exchange(addr, method, host, path, token, body, limit).await
}

/// An HTTP/1.1 request, whole, with an optional bearer token and `Connection: close`.
pub fn request(method: &str, host: &str, path: &str, token: Option<&str>, body: &str) -> String {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The ready pods of `namespace` with `label`: their names and addresses.
pub fn ready_pods(cp: &ControlPlane, namespace: &str, label: &str) -> Vec<(String, String)> {
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

/// How one request through a Service ended.
#[derive(Debug)]
pub enum Exchange {
    /// An answer: status, whether it carried `Retry-After`, body.
    Answer(u16, bool, String),
    /// No connection (refused, reset or timed out before anything was sent): the client may
    /// send the request again, as nothing reached a server.
    NotConnected,
    /// The connection broke after the request was sent: the client cannot know what happened
    /// (the reason, read through `Debug` when the test fails).
    #[allow(dead_code)]
    Broken(String),
}

/// One HTTP/1.1 exchange (`Connection: close`) with `addr`: connected within 5 s, answered
/// within `limit`.
pub async fn exchange_within(
    addr: std::net::SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
    limit: Duration,
) -> Exchange {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connect =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr));
    let Ok(Ok(mut s)) = connect.await else {
        return Exchange::NotConnected;
    };
    let head = request(method, host, path, token, body);
    let talk = async {
        s.write_all(head.as_bytes()).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    };
    match tokio::time::timeout(limit, talk).await {
        Ok(Ok(out)) => {
            let text = String::from_utf8_lossy(&out).into_owned();
            let status = text
                .split(' ')
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            if status == 0 {
                return Exchange::Broken(format!("no answer: {text:?}"));
            }
            let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
            let retry = head.to_ascii_lowercase().contains("\r\nretry-after:");
            Exchange::Answer(status, retry, body.to_owned())
        }
        Ok(Err(e)) => Exchange::Broken(e.to_string()),
        Err(_) => Exchange::Broken(format!("no answer within {limit:?}")),
    }
}

async fn exchange(
    addr: std::net::SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
    limit: Duration,
) -> Option<(u16, String)> {
    match exchange_within(addr, method, host, path, token, body, limit).await {
        Exchange::Answer(status, _, body) => Some((status, body)),
        Exchange::NotConnected | Exchange::Broken(_) => None,
    }
}

/// `deploy/`, applied as it is (its StatefulSet's pods stay Pending: no PersistentVolume is there
/// for their claims), and a kubeconfig with a token of its ServiceAccount `ebb/ebb` from the
/// TokenRequest API: ebb runs with the RBAC of `deploy/` and nothing more.
pub fn deployed_service_account(cp: &ControlPlane) -> std::path::PathBuf {
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");
    cp.kubectl(&["apply", "--server-side", "-k", deploy]);
    let token = cp.kubectl(&["create", "token", "ebb", "-n", "ebb", "--duration", "1h"]);
    cp.kubeconfig_with_token("ebb", token.trim())
}

/// The intervals the tests run ebb on Kubernetes with: replicas read back every second, last use
/// published every half second, a 3-second Lease.
pub const TEST_TIMING: [&str; 4] = [
    "--kube-sync-ms=1000",
    "--kube-touch-ms=500",
    "--kube-lease-ms=3000",
    "--kube-max-skew-ms=50",
];

/// `ebb serve` on Kubernetes as `deploy/`'s ServiceAccount, serving the `default` namespace, its
/// Lease in `ebb`, with `extra` flags.
pub fn serve_kube(cp: &ControlPlane, data: &std::path::Path, extra: &[&str]) -> super::Ebb {
    let mut args = vec!["--namespace", "default"];
    args.extend_from_slice(extra);
    serve_deployed(cp, data, &args)
}

/// `ebb serve` on Kubernetes as `deploy/`'s ServiceAccount, as the pod `ebb` of the namespace
/// `ebb` (its Lease and its image functions there), with `extra` flags.
pub fn serve_deployed(cp: &ControlPlane, data: &std::path::Path, extra: &[&str]) -> super::Ebb {
    let kubeconfig = deployed_service_account(cp);
    let mut args = vec!["--orchestrator", "kubernetes", "--pod-namespace", "ebb"];
    args.extend_from_slice(extra);
    super::serve_env(
        data,
        None,
        None,
        &args,
        &[("KUBECONFIG", kubeconfig.as_os_str())],
    )
}

/// [`serve_kube`] at the tests' intervals ([`TEST_TIMING`]).
pub fn serve_on(cp: &ControlPlane, data: &std::path::Path, extra: &[&str]) -> super::Ebb {
    let mut args = TEST_TIMING.to_vec();
    args.extend_from_slice(extra);
    serve_kube(cp, data, &args)
}

/// The control plane, a client for its administrator, and the test node agent running the
/// command `ebb` as the built binary (none on an external cluster: its nodes run the pods).
pub async fn cluster() -> (ControlPlane, kube::Client, Option<super::node::NodeAgent>) {
    let cp = ControlPlane::start().await;
    let kube = client(&cp).await;
    if cp.is_external() {
        return (cp, kube, None);
    }
    let images = [(
        "ebb".to_owned(),
        std::path::PathBuf::from(env!("CARGO_BIN_EXE_ebb")),
    )]
    .into();
    let agent = super::node::start(kube.clone(), images).await;
    (cp, kube, Some(agent))
}

/// The image of ebb the tests' pods run: `EBB_TEST_IMAGE` on an external cluster (an image of
/// the built binary with `ebb` on its PATH), else `ebb` (the node agent runs the built binary
/// for the command `ebb` whatever the image).
pub fn test_image() -> String {
    std::env::var("EBB_TEST_IMAGE").unwrap_or_else(|_| "ebb".to_owned())
}

/// `kubectl apply --server-side` of a manifest.
pub fn apply(cp: &ControlPlane, manifest: &str) {
    cp.kubectl_stdin(&["apply", "--server-side", "-f", "-"], manifest);
}

/// The names of the routes in ebb's log now (replayed from its events).
pub fn routes(data: &std::path::Path) -> std::collections::BTreeSet<String> {
    let mut routes = std::collections::BTreeSet::new();
    for e in super::events(data) {
        let e = &e["event"];
        if let Some(r) = e.get("RouteUpserted") {
            routes.insert(r["route"]["name"].as_str().unwrap_or_default().to_owned());
        }
        if let Some(r) = e.get("RouteRemoved") {
            routes.remove(r["name"].as_str().unwrap_or_default());
        }
    }
    routes
}

pub fn pid_of(body: &str) -> i32 {
    body.trim()
        .parse()
        .unwrap_or_else(|_| panic!("a pid: {body:?}"))
}

/// Grants `deploy/`'s ServiceAccount `ebb/ebb` `verbs` on `resources` everywhere (a ClusterRole
/// and its binding, both named `name`): what a platform team grants for the kinds its Cleaners
/// target.
pub fn grant(cp: &ControlPlane, name: &str, verbs: &str, resources: &str) {
    cp.kubectl(&[
        "create",
        "clusterrole",
        name,
        &format!("--verb={verbs}"),
        &format!("--resource={resources}"),
    ]);
    cp.kubectl(&[
        "create",
        "clusterrolebinding",
        name,
        &format!("--clusterrole={name}"),
        "--serviceaccount=ebb:ebb",
    ]);
}

/// `clients` clients sending `GET /` for `host` to `proxy` one after the other until `stop`,
/// counting the 200s and the others. They run on a thread of their own, started from the test's
/// thread, so in the control plane's network namespace (the test runtime's workers are not).
pub fn load(
    proxy: std::net::SocketAddr,
    host: &'static str,
    clients: usize,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    answered: &std::sync::Arc<std::sync::atomic::AtomicU64>,
    failed: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> std::thread::JoinHandle<()> {
    let (stop, answered, failed) = (stop.clone(), answered.clone(), failed.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let tasks: Vec<_> = (0..clients)
                .map(|_| {
                    let (stop, answered, failed) = (stop.clone(), answered.clone(), failed.clone());
                    tokio::spawn(async move {
                        let c = super::http::client();
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            let a = super::http::send(&c, proxy, "GET", host, "/", &[]).await;
                            if a.status == 200 {
                                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            } else {
                                failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                eprintln!("answer {}: {}", a.status, a.body);
                            }
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
    })
}

/// Scale writes to the Deployment `name` in the audit log.
pub fn scale_writes(cp: &ControlPlane, name: &str) -> usize {
    cp.audit_events()
        .iter()
        .filter(|e| {
            matches!(e["verb"].as_str(), Some("patch" | "update"))
                && e["objectRef"]["resource"] == "deployments"
                && e["objectRef"]["subresource"] == "scale"
                && e["objectRef"]["name"] == name
        })
        .count()
}
