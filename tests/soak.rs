//! A bounded soak of a real `ebb serve`: proxy traffic in bursts, each pause lasting until the
//! workload has scaled to zero, so that the next burst wakes it again, and calls flowing through
//! the built-in runner to a second workload all along. It runs `EBB_SOAK_SECONDS` (default 180; longer by setting it) and checks:
//! no request failed, every call succeeded, ebb's resident memory and open file descriptors are
//! flat (the last third of the run's peak against the first third's), and the log stays bounded
//! by snapshots and compaction. It prints the figures.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::http::{Http, client, send, send_json};
use serde_json::{Value, json};

/// Events between snapshots: small, so that the log is compacted many times during the soak.
const SNAPSHOT_EVERY: u64 = 500;

fn seconds() -> u64 {
    std::env::var("EBB_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180)
}

/// Resident memory (KiB) and open file descriptors of a process.
fn usage(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64;
    (rss, fds)
}

fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    failed: AtomicU64,
    calls: AtomicU64,
}

/// Whether route `soak`'s workload has no ready replica, from `/metrics`.
async fn at_zero(c: &Http, admin: SocketAddr) -> Option<()> {
    let m = send(c, admin, "GET", "localhost", "/metrics", &[]).await;
    m.body
        .lines()
        .any(|l| l == "ebb_workload_replicas_ready{route=\"soak\"} 0")
        .then_some(())
}

async fn traffic(
    c: Http,
    proxy: SocketAddr,
    admin: SocketAddr,
    counts: Arc<Counts>,
    running: Arc<AtomicBool>,
) {
    // Bursts of 4 s, then no request until the app (idle after 1 s) is at zero.
    while running.load(Ordering::Relaxed) {
        let burst = ebb::clock::Stopwatch::start();
        while burst.elapsed() < Duration::from_secs(4) && running.load(Ordering::Relaxed) {
            let a = send(&c, proxy, "GET", "soak.localhost", "/pid", &[]).await;
            counts.requests.fetch_add(1, Ordering::Relaxed);
            if a.status != 200 {
                counts.failed.fetch_add(1, Ordering::Relaxed);
                eprintln!("failed request: {} {}", a.status, a.body);
            }
        }
        common::controlplane::wait_until("the app at zero", Duration::from_secs(60), || {
            at_zero(&c, admin)
        })
        .await;
    }
}

async fn calls(c: Http, admin: SocketAddr, counts: Arc<Counts>, running: Arc<AtomicBool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while running.load(Ordering::Relaxed) {
        tick.tick().await;
        let r = send_json(
            &c,
            admin,
            "POST",
            "/runner/enqueue",
            &[("authorization", "Bearer rt")],
            &json!({ "target": "worker", "payload": { "method": "GET", "path": "/pid" } }),
        )
        .await;
        assert_eq!(r.status, 200, "enqueue: {}", r.body);
        counts.calls.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_keeps_serving_with_flat_memory_and_a_bounded_log() {
    let total = Duration::from_secs(seconds());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ebb.toml");
    std::fs::write(
        &config,
        "[[app]]\nname = \"soak\"\ndomains = [\"soak.localhost\"]\n\
         command = [\"ebb\", \"example-app\"]\nidle_after_ms = 1000\nmax_replicas = 1\n\n\
         [[app]]\nname = \"worker\"\ndomains = [\"worker.localhost\"]\n\
         command = [\"ebb\", \"example-app\"]\nidle_after_ms = 60000\n",
    )
    .unwrap();
    let data = dir.path().join("data");
    let ebb = common::serve_with(
        &data,
        Some(&config),
        None,
        &[
            "--runner-token",
            "rt",
            "--call-retention-ms",
            "5000",
            "--snapshot-every-events",
            &SNAPSHOT_EVERY.to_string(),
        ],
    );
    let pid = ebb.child.id();
    let counts = Arc::new(Counts::default());
    let running = Arc::new(AtomicBool::new(true));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        tasks.push(tokio::spawn(traffic(
            client(),
            ebb.proxy,
            ebb.admin,
            counts.clone(),
            running.clone(),
        )));
    }
    tasks.push(tokio::spawn(calls(
        client(),
        ebb.admin,
        counts.clone(),
        running.clone(),
    )));

    // One sample a second: (elapsed s, RSS KiB, fds, data dir bytes).
    let mut samples: Vec<(u64, u64, u64, u64)> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let watch = ebb::clock::Stopwatch::start();
    while watch.elapsed() < total {
        tick.tick().await;
        let (rss, fds) = usage(pid);
        samples.push((watch.elapsed().as_secs(), rss, fds, dir_bytes(&data)));
    }
    running.store(false, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }

    // Every call enqueued succeeds.
    let c = client();
    let enqueued = counts.calls.load(Ordering::Relaxed);
    common::controlplane::wait_until("every call succeeded", Duration::from_secs(60), || {
        let c = c.clone();
        async move {
            let a = send(&c, ebb.admin, "GET", "localhost", "/metrics", &[]).await;
            let ended = |state: &str| -> u64 {
                let want = format!("ebb_calls_ended_total{{state=\"{state}\"}} ");
                a.body
                    .lines()
                    .find_map(|l| l.strip_prefix(&want))
                    .map_or(0, |v| v.trim().parse().unwrap())
            };
            let bad: u64 = ["error", "timeout", "cancelled"]
                .iter()
                .map(|s| ended(s))
                .sum();
            assert_eq!(bad, 0, "calls ended other than in success");
            (ended("success") >= enqueued).then_some(())
        }
    })
    .await;
    let metrics = send(&c, ebb.admin, "GET", "localhost", "/metrics", &[])
        .await
        .body;
    let cold_starts: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ebb_cold_starts_total "))
        .map_or(0, |v| v.trim().parse().unwrap());
    let (pid_rss, pid_fds) = usage(pid);
    drop(ebb);

    // The log: snapshots taken and old events deleted, so that what is stored is a few
    // intervals' worth although far more were written.
    let stats = common::ebb_ok(&data, &["log", "stats", "--json"]);
    let stats: Value = serde_json::from_str(&stats).unwrap();
    let last = stats["last_seq"].as_u64().unwrap();
    let stored = stats["events"].as_u64().unwrap();

    let third = samples.len() / 3;
    let peak = |s: &[(u64, u64, u64, u64)], f: fn(&(u64, u64, u64, u64)) -> u64| {
        s.iter().map(f).max().unwrap_or(0)
    };
    let (early, late) = (&samples[..third], &samples[samples.len() - third..]);
    let requests = counts.requests.load(Ordering::Relaxed);
    let failed = counts.failed.load(Ordering::Relaxed);
    println!(
        "soak: {} s, {requests} requests, {failed} failed, {enqueued} calls, {cold_starts} cold starts",
        total.as_secs()
    );
    println!(
        "soak: RSS peak {} KiB (first third {} KiB, last third {} KiB, at the end {pid_rss} KiB)",
        peak(&samples, |s| s.1),
        peak(early, |s| s.1),
        peak(late, |s| s.1)
    );
    println!(
        "soak: fds peak {} (first third {}, last third {}, at the end {pid_fds})",
        peak(&samples, |s| s.2),
        peak(early, |s| s.2),
        peak(late, |s| s.2)
    );
    println!(
        "soak: data dir peak {} bytes (last third {}); log: {stored} events stored of {last} written",
        peak(&samples, |s| s.3),
        peak(late, |s| s.3)
    );

    assert!(requests > 0);
    assert_eq!(failed, 0, "no request may fail");
    assert!(cold_starts >= 2, "the workload went to zero and woke again");
    assert!(
        peak(late, |s| s.1) <= peak(early, |s| s.1) + 48 * 1024,
        "resident memory grew: {samples:?}"
    );
    assert!(
        peak(late, |s| s.2) <= peak(early, |s| s.2) + 32,
        "file descriptors grew: {samples:?}"
    );
    assert!(
        last > 6 * SNAPSHOT_EVERY,
        "the soak wrote enough events to compact ({last})"
    );
    assert!(
        stored <= 4 * SNAPSHOT_EVERY,
        "the log holds {stored} events of {last}: compaction keeps it bounded"
    );
}
