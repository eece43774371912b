//! `ebb serve` killed with SIGKILL at random moments, several rounds on one data directory, while
//! proxy traffic wakes and scales a workload, calls are enqueued and run, function chains are
//! invoked and one-shot Cleaners come due. After every kill no workload process outlives ebb;
//! after the last round ebb runs until everything acknowledged has ended, and its log shows every
//! acknowledged call and instance, no call started twice, no Cleaner fired twice.

use crate::common;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::http::{client, send};
use serde_json::{Value, json};

const ROUNDS: usize = 5;
const DEADLINE: Duration = Duration::from_secs(120);

/// The config of round `round`: a workload, a function chain, and a one-shot Cleaner for each
/// round so far, each deleting a throwaway app once its TTL passes.
fn config(dir: &Path, round: usize) -> std::path::PathBuf {
    let mut text = String::from(
        "[[app]]\nname = \"w\"\ndomains = [\"w.localhost\"]\n\
         command = [\"ebb\", \"example-app\"]\nidle_after_ms = 400\nmax_replicas = 2\n\n\
         [[function]]\nname = \"classify\"\nfunction = \"classify\"\n\
         command = [\"ebb\", \"example-app\"]\nleft = \"shout\"\nright = \"RETURN\"\n\n\
         [[function]]\nname = \"shout\"\nfunction = \"upper\"\ncommand = [\"ebb\", \"example-app\"]\n",
    );
    for r in 0..=round {
        text.push_str(&format!(
            "\n[[app]]\nname = \"tmp{r}\"\ndomains = [\"tmp{r}.localhost\"]\n\
             command = [\"ebb\", \"example-app\"]\n\n\
             [[cleaner]]\nname = \"tmp{r}\"\nttl = \"1s\"\n\
             targets = [{{ name = \"app\", reference = {{ apiVersion = \"ebb.dev/v1\", kind = \"App\", name = \"tmp{r}\" }}, delete = true }}]\n"
        ));
    }
    let path = dir.join("ebb.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Whether a process is gone (or a zombie nobody reaped yet: it runs no more).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

#[derive(Default)]
struct Acked {
    calls: BTreeSet<String>,
    instances: BTreeSet<String>,
}

/// One request that may find ebb gone: its status and body, or `None`.
async fn try_send(
    c: &common::http::Http,
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: String,
) -> Option<(u16, String)> {
    use http_body_util::{BodyExt, Full};
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(bytes::Bytes::from(body))).ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(5), c.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
        .await
        .ok()?
        .ok()?
        .to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

async fn load(
    proxy: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    acked: Arc<Mutex<Acked>>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let c = client();
    let traffic = {
        let c = c.clone();
        let stop = stop.clone();
        async move {
            while !*stop.borrow() {
                // Failures here are the kill's: the proxy's promise is checked elsewhere.
                let _ = try_send(
                    &c,
                    "GET",
                    format!("http://{proxy}/pid"),
                    &[("host", "w.localhost")],
                    String::new(),
                )
                .await;
            }
        }
    };
    let calls = {
        let c = c.clone();
        let acked = acked.clone();
        let stop = stop.clone();
        async move {
            let mut pace = tokio::time::interval(Duration::from_millis(5));
            while !*stop.borrow() {
                pace.tick().await;
                let body = json!({
                    "target": "w",
                    "timeout_ms": 5000,
                    "payload": { "method": "GET", "path": "/pid" }
                });
                let r = try_send(
                    &c,
                    "POST",
                    format!("http://{admin}/runner/enqueue"),
                    &[
                        ("authorization", "Bearer rt"),
                        ("content-type", "application/json"),
                    ],
                    body.to_string(),
                )
                .await;
                if let Some((200, body)) = r {
                    let v: Value = serde_json::from_str(&body).unwrap();
                    acked
                        .lock()
                        .unwrap()
                        .calls
                        .insert(v["id"].as_str().unwrap().to_owned());
                }
            }
        }
    };
    let functions = {
        let c = c.clone();
        let acked = acked.clone();
        let stop = stop.clone();
        async move {
            let mut i = 0u64;
            let mut pace = tokio::time::interval(Duration::from_millis(20));
            while !*stop.borrow() {
                pace.tick().await;
                i += 1;
                let input = if i.is_multiple_of(2) {
                    "hi"
                } else {
                    "a longer input"
                };
                let r = try_send(
                    &c,
                    "POST",
                    format!("http://{admin}/api/funcs/classify"),
                    &[("authorization", "Bearer fn")],
                    input.to_owned(),
                )
                .await;
                if let Some((202, body)) = r {
                    let v: Value = serde_json::from_str(&body).unwrap();
                    acked
                        .lock()
                        .unwrap()
                        .instances
                        .insert(v["instanceId"].as_str().unwrap().to_owned());
                }
            }
        }
    };
    tokio::join!(traffic, calls, functions);
}

fn serve(data: &Path, config: &Path) -> common::Ebb {
    common::serve_with(
        data,
        Some(config),
        None,
        &[
            "--runner-token",
            "rt",
            "--api-token",
            "fn",
            "--snapshot-every-events",
            "0",
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_loses_nothing_acknowledged_across_sigkills() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let acked = Arc::new(Mutex::new(Acked::default()));
    let mut rng = common::XorShift(0x5eed_c0ff_ee00_0001);
    for round in 0..ROUNDS {
        let mut ebb = serve(&data, &config(dir.path(), round));
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let kill_after = Duration::from_millis(500 + rng.next() % 2_500);
        let run = load(ebb.proxy, ebb.admin, acked.clone(), stop_rx);
        tokio::pin!(run);
        // The load runs until the kill; the kill comes at a random moment.
        let _ = tokio::time::timeout(kill_after, &mut run).await;
        let pid = ebb.child.id();
        let workloads = children(pid);
        ebb.child.kill().unwrap();
        ebb.child.wait().unwrap();
        stop_tx.send(true).unwrap();
        run.await;
        common::controlplane::wait_until(
            &format!("round {round}: the workloads {workloads:?} end with ebb"),
            DEADLINE,
            || {
                let workloads = workloads.clone();
                async move { workloads.iter().all(|p| gone(*p)).then_some(()) }
            },
        )
        .await;
    }

    // A last run, to the end of everything acknowledged.
    let ebb = serve(&data, &config(dir.path(), ROUNDS - 1));
    let c = client();
    let (calls, instances) = {
        let a = acked.lock().unwrap();
        (a.calls.clone(), a.instances.clone())
    };
    assert!(!calls.is_empty() && !instances.is_empty());
    let objects = calls
        .iter()
        .map(|id| (format!("/v1/calls/{id}"), "Bearer rt"))
        .chain(
            instances
                .iter()
                .map(|id| (format!("/api/funcs/{id}"), "Bearer fn")),
        );
    for (path, auth) in objects {
        common::controlplane::wait_until(&format!("{path} ends"), DEADLINE, || {
            let c = c.clone();
            let path = path.clone();
            async move {
                let r = send(
                    &c,
                    ebb.admin,
                    "GET",
                    "localhost",
                    &path,
                    &[("authorization", auth)],
                )
                .await;
                assert_eq!(r.status, 200, "acknowledged {path}: {}", r.body);
                let v: Value = serde_json::from_str(&r.body).unwrap();
                (!matches!(v["state"].as_str(), Some("queued" | "running"))).then_some(())
            }
        })
        .await;
    }
    common::controlplane::wait_until("every Cleaner fired", DEADLINE, || async {
        let fired = common::events(&ebb.data)
            .iter()
            .filter(|e| e["event"].get("CleanerFired").is_some())
            .count();
        (fired >= ROUNDS).then_some(())
    })
    .await;
    drop(ebb);

    let events = common::events(&data);
    let common::Tally {
        queued,
        created,
        started,
        fired,
    } = common::tally(&events);
    let lost: Vec<&String> = calls.difference(&queued).collect();
    assert!(
        lost.is_empty(),
        "acknowledged calls not in the log: {lost:?}"
    );
    let lost: Vec<&String> = instances.difference(&created).collect();
    assert!(
        lost.is_empty(),
        "acknowledged instances not in the log: {lost:?}"
    );
    let twice: Vec<_> = started.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "calls started twice: {twice:?}");
    let twice: Vec<_> = fired.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "Cleaners fired twice: {twice:?}");
    assert_eq!(fired.len(), ROUNDS, "every Cleaner fired: {fired:?}");
    println!(
        "crash: {ROUNDS} kills; {} calls and {} instances acknowledged, {} events",
        calls.len(),
        instances.len(),
        events.len()
    );
}
