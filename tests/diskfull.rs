//! A full disk under a real `ebb serve`: its data directory is a small tmpfs in a mount namespace
//! of its own (`unshare -m`, so nothing is mounted outside the test). Routes are created through
//! the admin API until a filler file takes the rest of the space; ebb then stops by itself with
//! the reason (fail-stop), and started again once the filler is gone it has every route it
//! acknowledged, its log reads whole, and it takes writes again.

use crate::common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::http::{client, send};
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(60);

/// The mount namespace's holder: a shell that mounts the tmpfs, runs ebb in it, and then waits,
/// keeping the namespace (and the tmpfs) alive until it is killed.
struct Namespace {
    holder: Child,
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("pkill")
            .args(["-KILL", "-P", &self.holder.id().to_string()])
            .status();
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// Runs `args` inside the namespace.
fn inside(ns: &Namespace, args: &[&str]) -> std::process::Output {
    Command::new("nsenter")
        .args(["-t", &ns.holder.id().to_string(), "-m", "--"])
        .args(args)
        .output()
        .unwrap()
}

fn serve_args(data: &Path) -> Vec<String> {
    [
        env!("CARGO_BIN_EXE_ebb"),
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Route `ri`, with enough domains to weigh a few KiB in the log.
fn route(i: usize) -> Value {
    let pad = "x".repeat(48);
    let domains: Vec<String> = (0..40)
        .map(|j| format!("r{i}-{j}-{pad}.localhost"))
        .collect();
    json!({
        "domains": domains,
        "command": ["ebb", "example-app"],
        "idle_after_ms": 60000,
    })
}

/// PUTs route `ri`: its status, or `None` when no answer came (ebb stopped).
async fn put(c: &common::http::Http, admin: SocketAddr, i: usize) -> Option<u16> {
    use http_body_util::{BodyExt, Full};
    let req = hyper::Request::put(format!("http://{admin}/admin/routes/r{i}"))
        .header("authorization", "Bearer admin")
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(route(i).to_string())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    Some(status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_stops_ebb_and_it_recovers_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let script = r#"mount -t tmpfs -o size=48m ebb-test "$0" || exit 97; "$@"; echo "ebb exited $?" >&2; exec sleep 3600"#;
    let mut holder = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", script])
        .arg(&data)
        .args(serve_args(&data))
        .env("EBB_ADMIN_TOKEN", "admin")
        .env("EBB_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = holder.stdout.take().unwrap();
    let stderr = holder.stderr.take().unwrap();
    let ns = Namespace { holder };
    let (_, admin) = common::addresses(stdout);
    // ebb's log lines, kept to be read once it stopped.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            let _ = tx.send(line);
        }
    });

    let c = client();
    let auth = [("authorization", "Bearer admin")];
    let mut acked = Vec::new();
    for i in 0..20 {
        assert_eq!(put(&c, admin, i).await, Some(201));
        acked.push(i);
    }
    // Take the rest of the space.
    let filler = data.join("filler");
    let out = inside(
        &ns,
        &[
            "dd",
            "if=/dev/zero",
            &format!("of={}", filler.display()),
            "bs=1M",
        ],
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("No space left"),
        "the filler fills the tmpfs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Writes now fail; ebb stops by itself.
    let mut i = 20;
    let mut pace = tokio::time::interval(Duration::from_millis(20));
    let stopped = 'wait: loop {
        pace.tick().await;
        match put(&c, admin, i).await {
            Some(200 | 201) => acked.push(i),
            Some(status) => assert!(status >= 500, "a failed write is a 5xx: {status}"),
            None => {}
        }
        i += 1;
        while let Ok(line) = rx.try_recv() {
            if line.starts_with("ebb exited") {
                break 'wait line;
            }
        }
        assert!(i < 20_000, "ebb went on writing on a full disk");
    };
    assert!(!stopped.ends_with(" 0"), "ebb exits non-zero: {stopped}");

    // Room again: ebb starts, with every acknowledged route.
    let out = inside(&ns, &["rm", "-f", filler.to_str().unwrap()]);
    assert!(out.status.success());
    let mut again = Command::new("nsenter")
        .args(["-t", &ns.holder.id().to_string(), "-m", "--"])
        .args(serve_args(&data))
        .env("EBB_ADMIN_TOKEN", "admin")
        .env("EBB_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (_, admin) = common::addresses(again.stdout.take().unwrap());
    let r = send(&c, admin, "GET", "localhost", "/admin/routes", &auth).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let routes: Value = serde_json::from_str(&r.body).unwrap();
    let text = routes.to_string();
    for i in &acked {
        assert!(
            text.contains(&format!("\"r{i}-0-")),
            "acknowledged route r{i} is there"
        );
    }
    assert_eq!(
        put(&c, admin, 999).await,
        Some(201),
        "writes are taken again"
    );
    let _ = again.kill();
    let _ = again.wait();
    // The log reads whole.
    common::controlplane::wait_until("the log is readable", DEADLINE, || async {
        let out = inside(
            &ns,
            &[
                env!("CARGO_BIN_EXE_ebb"),
                "log",
                "stats",
                "--data-dir",
                data.to_str().unwrap(),
            ],
        );
        out.status.success().then_some(())
    })
    .await;
    println!(
        "disk full: {} routes acknowledged before ebb stopped ({stopped})",
        acked.len()
    );
}
