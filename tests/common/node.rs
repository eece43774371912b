//! The test node agent: the kubelet's part that ebb's kube tests need, running each pod bound to
//! its node as a local process in the test's network namespace (see [`super::controlplane`]).
//!
//! It registers a Node (pod CIDR, capacity, `Ready`, its `InternalIP`), and every
//! [`POLL_MS`] lists the pods bound to it: a new pod gets the next address of the pod CIDR on
//! `lo` and its first container's command and args run as a process (`$(VAR)` expanded from the
//! container's env, `fieldRef`s to `status.podIP`, `metadata.name` and `metadata.namespace`
//! resolved; a command named in the image map runs that binary); its status is reported through
//! `pods/status`, `Ready` once its readiness probe passes (an HTTP GET answered 2xx, or a TCP
//! connection accepted; at once without a probe). Init containers are not run. A
//! pod being deleted has its process stopped (SIGTERM, its grace period, SIGKILL), its address
//! released, and is then deleted for good with a UID precondition.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client};
use serde_json::json;

use super::controlplane::NODE_IP;

/// The node's name.
pub const NODE: &str = "node-1";
/// How often the agent lists its pods and probes them.
pub const POLL_MS: u64 = 100;
/// The longest grace period honoured.
const MAX_GRACE_S: i64 = 10;

/// A running agent; stopping it (drop) kills every pod process it runs.
pub struct NodeAgent {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        // The processes are `kill_on_drop`: aborting the task drops them.
        self.task.abort();
    }
}

/// One pod the agent runs.
struct Running {
    uid: String,
    ip: String,
    /// Its container's name and image, as its status names them.
    container: String,
    image: String,
    child: tokio::process::Child,
    ready: bool,
    /// The process's exit code, once it has exited.
    exited: Option<i32>,
    /// The readiness probe's HTTP path (`None`: a TCP probe) and port.
    probe: Option<(Option<String>, u16)>,
}

/// Registers the node and starts the agent as a task of the current (test) thread's runtime.
/// `images` maps a command name (as a container's `command[0]`) to the binary to run.
pub async fn start(client: Client, images: HashMap<String, PathBuf>) -> NodeAgent {
    register(&client).await;
    // On the test's current-thread runtime: the task, and the processes it starts, stay in the
    // test thread's network namespace.
    let task = tokio::spawn(run(client, images));
    NodeAgent { task }
}

async fn register(client: &Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]},
    }))
    .expect("node");
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let capacity = json!({"cpu": "8", "memory": "16Gi", "pods": "110"});
    nodes
        .patch_status(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [{"type": "InternalIP", "address": NODE_IP}, {"type": "Hostname", "address": NODE}],
                "conditions": [{
                    "type": "Ready", "status": "True", "reason": "KubeletReady",
                    "message": "the ebb test node agent runs pods as processes",
                    "lastHeartbeatTime": now, "lastTransitionTime": now,
                }],
            }})),
        )
        .await
        .expect("node status");
    // The API server taints a new node not-ready (TaintNodesByCondition); the node lifecycle
    // controller, which would lift the taint once the node reports Ready, is not run here.
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": null}})),
        )
        .await
        .expect("node taints");
}

async fn run(client: Client, images: HashMap<String, PathBuf>) {
    let pods: Api<Pod> = Api::all(client.clone());
    let mut running: HashMap<String, Running> = HashMap::new();
    let mut next_ip = 10u8;
    let by_node = ListParams::default().fields(&format!("spec.nodeName={NODE}"));
    // The kubelet's relist, every POLL_MS: new pods, exits, probes and deletions in one pass.
    let mut relist = tokio::time::interval(Duration::from_millis(POLL_MS));
    loop {
        relist.tick().await;
        if let Ok(list) = pods.list(&by_node).await {
            for pod in list.items {
                let ns = pod.metadata.namespace.clone().unwrap_or_default();
                let name = pod.metadata.name.clone().unwrap_or_default();
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let key = format!("{ns}/{name}");
                let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
                if pod.metadata.deletion_timestamp.is_some() {
                    let grace = pod
                        .spec
                        .as_ref()
                        .and_then(|s| s.termination_grace_period_seconds)
                        .unwrap_or(30)
                        .clamp(0, MAX_GRACE_S);
                    if let Some(r) = running.remove(&key) {
                        stop(r.child, grace).await;
                        let _ = ip(&["addr", "del", &format!("{}/32", r.ip), "dev", "lo"]);
                    }
                    let _ = api
                        .delete(
                            &name,
                            &DeleteParams {
                                grace_period_seconds: Some(0),
                                preconditions: Some(Preconditions {
                                    uid: Some(uid),
                                    resource_version: None,
                                }),
                                ..Default::default()
                            },
                        )
                        .await;
                    continue;
                }
                // A pod of the same name but another UID replaced the one that ran (deleted
                // without the agent seeing it go): stop the old process, start the new pod.
                if running.get(&key).is_some_and(|r| r.uid != uid)
                    && let Some(r) = running.remove(&key)
                {
                    stop(r.child, 0).await;
                    let _ = ip(&["addr", "del", &format!("{}/32", r.ip), "dev", "lo"]);
                }
                if let Some(r) = running.get_mut(&key) {
                    if r.exited.is_some() {
                        continue;
                    }
                    if let Ok(Some(status)) = r.child.try_wait() {
                        r.exited = Some(status.code().unwrap_or(-1));
                        r.ready = false;
                        let _ = report(&api, &name, r).await;
                        continue;
                    }
                    if !r.ready && probe(&r.ip, r.probe.as_ref()).await {
                        r.ready = true;
                        let _ = report(&api, &name, r).await;
                    }
                    continue;
                }
                let Some(spec) = pod.spec.as_ref() else {
                    continue;
                };
                let Some(container) = spec.containers.first() else {
                    continue;
                };
                let addr = format!("10.244.0.{next_ip}");
                next_ip = next_ip.wrapping_add(1).max(10);
                if ip(&["addr", "add", &format!("{addr}/32"), "dev", "lo"]).is_err() {
                    continue;
                }
                let Some(child) = spawn(container, &pod, &addr, &images) else {
                    continue;
                };
                let probe = container.readiness_probe.as_ref().and_then(|p| {
                    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
                    let (path, port) = match (&p.http_get, &p.tcp_socket) {
                        (Some(http), _) => (
                            Some(http.path.clone().unwrap_or_else(|| "/".into())),
                            &http.port,
                        ),
                        (None, Some(tcp)) => (None, &tcp.port),
                        (None, None) => return None,
                    };
                    let port = match port {
                        IntOrString::Int(p) => u16::try_from(*p).ok()?,
                        IntOrString::String(name) => container
                            .ports
                            .iter()
                            .flatten()
                            .find(|p| p.name.as_deref() == Some(name.as_str()))
                            .and_then(|p| u16::try_from(p.container_port).ok())?,
                    };
                    Some((path, port))
                });
                let r = Running {
                    uid,
                    ip: addr,
                    container: container.name.clone(),
                    image: container.image.clone().unwrap_or_default(),
                    child,
                    ready: false,
                    exited: None,
                    probe,
                };
                let _ = report(&api, &name, &r).await;
                running.insert(key, r);
            }
        }
    }
}

/// Runs `ip ARGS` (in the test's network namespace).
fn ip(args: &[&str]) -> std::io::Result<()> {
    let status = std::process::Command::new("ip").args(args).status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "ip {}: {status}",
            args.join(" ")
        )))
    }
}

/// The container's env with the field references the agent knows resolved.
fn env(container: &Container, pod: &Pod, ip: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in container.env.iter().flatten() {
        let value = if let Some(v) = &e.value {
            v.clone()
        } else if let Some(field) = e.value_from.as_ref().and_then(|f| f.field_ref.as_ref()) {
            match field.field_path.as_str() {
                "status.podIP" => ip.to_owned(),
                "status.hostIP" => NODE_IP.to_owned(),
                "metadata.name" => pod.metadata.name.clone().unwrap_or_default(),
                "metadata.namespace" => pod.metadata.namespace.clone().unwrap_or_default(),
                _ => String::new(),
            }
        } else {
            String::new()
        };
        out.push((e.name.clone(), value));
    }
    out
}

/// `$(NAME)` replaced by NAME's value, as the kubelet expands command and args.
fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = s.to_owned();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

fn spawn(
    container: &Container,
    pod: &Pod,
    ip: &str,
    images: &HashMap<String, PathBuf>,
) -> Option<tokio::process::Child> {
    let env = env(container, pod, ip);
    let mut argv: Vec<String> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .map(|a| expand(a, &env))
        .collect();
    if argv.is_empty() {
        return None;
    }
    let program = images
        .get(&argv[0])
        .cloned()
        .unwrap_or_else(|| PathBuf::from(&argv[0]));
    argv.remove(0);
    tokio::process::Command::new(program)
        .args(argv)
        .envs(env)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .ok()
}

/// SIGTERM, up to `grace_s` seconds, then SIGKILL.
async fn stop(mut child: tokio::process::Child, grace_s: i64) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let grace = Duration::from_secs(u64::try_from(grace_s).unwrap_or(0));
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

/// Whether the readiness probe passes (no probe: ready once running).
async fn probe(ip: &str, probe: Option<&(Option<String>, u16)>) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some((path, port)) = probe else {
        return true;
    };
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect((ip, *port)).await.ok()?;
        let Some(path) = path else {
            // A TCP probe: the connection was accepted.
            return Some(true);
        };
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {ip}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.ok()?;
        Some(head.starts_with(b"HTTP/1.1 2"))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Some(true))
    )
}

/// Reports pod `name` as `r` runs it: running, ready or not, or exited.
async fn report(api: &Api<Pod>, name: &str, r: &Running) -> kube::Result<Pod> {
    let (ip, ready, exit) = (r.ip.as_str(), r.ready, r.exited);
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let flag = if ready { "True" } else { "False" };
    let state = match exit {
        None => json!({"running": {"startedAt": now}}),
        Some(code) => {
            json!({"terminated": {"exitCode": code, "finishedAt": now, "reason": "Exited"}})
        }
    };
    let status = json!({"status": {
        "phase": if exit.is_some() { "Failed" } else { "Running" },
        "hostIP": NODE_IP, "hostIPs": [{"ip": NODE_IP}],
        "podIP": ip, "podIPs": [{"ip": ip}],
        "startTime": now,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
            {"type": "Ready", "status": flag, "lastTransitionTime": now},
        ],
        "containerStatuses": [{
            "name": r.container, "image": r.image, "imageID": "", "ready": ready, "restartCount": 0,
            "started": exit.is_none(), "state": state,
        }],
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
}
