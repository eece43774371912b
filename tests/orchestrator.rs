//! The process orchestrator with real child processes (`ebb example-app`): scale up and down,
//! readiness, crash and restart, failed starts, logs, and no orphans when ebb is killed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use ebb::orchestrator::{
    Observed, Orchestrator, ProcessOptions, ProcessOrchestrator, Readiness, WorkloadSpec,
};

const DEADLINE: Duration = Duration::from_secs(60);

fn app(name: &str, extra: &[&str]) -> WorkloadSpec {
    let mut command = vec![
        env!("CARGO_BIN_EXE_ebb").to_owned(),
        "example-app".to_owned(),
    ];
    command.extend(extra.iter().map(|s| s.to_string()));
    WorkloadSpec {
        name: name.into(),
        command,
        env: vec![("EBB_LOG".into(), "warn".into())],
        cwd: None,
        readiness: Readiness::Http {
            path: "/health".into(),
        },
        startup_timeout_ms: 20_000,
        stop_grace_ms: 2_000,
        pre_run: None,
    }
}

fn orchestrator(dir: &Path) -> ProcessOrchestrator {
    ProcessOrchestrator::new(ProcessOptions {
        log_dir: dir.join("logs"),
        restart_backoff_min_ms: 10,
        ..ProcessOptions::default()
    })
    .unwrap()
}

/// Waits until `pred` holds for the workload, or fails after the deadline.
async fn until(
    o: &ProcessOrchestrator,
    name: &str,
    what: &str,
    pred: impl Fn(&Observed) -> bool,
) -> Observed {
    let mut changes = o.changes();
    let wait = async {
        loop {
            let seen = o.observe(name).unwrap();
            if pred(&seen) {
                return seen;
            }
            changes.changed().await.unwrap();
        }
    };
    match tokio::time::timeout(DEADLINE, wait).await {
        Ok(seen) => seen,
        Err(_) => panic!("{name}: {what} did not happen: {:?}", o.observe(name)),
    }
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

fn alive(pid: u32) -> bool {
    // A zombie is dead for our purposes: /proc/PID/stat says Z.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.split(' ').nth(2).is_none_or(|s| s != "Z"),
        Err(_) => false,
    }
}

async fn wait_dead(pid: u32) {
    // The process is not our child, so there is nothing to wait on: poll /proc until the deadline.
    let wait = async {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        while alive(pid) {
            tick.tick().await;
        }
    };
    tokio::time::timeout(DEADLINE, wait)
        .await
        .unwrap_or_else(|_| panic!("process {pid} still alive"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scales_up_and_down_with_real_processes() {
    let dir = tempfile::tempdir().unwrap();
    let o = orchestrator(dir.path());
    o.register(app("echo", &[])).unwrap();
    assert_eq!(o.observe("echo").unwrap().desired, 0);
    o.scale("echo", 2).unwrap();
    let seen = until(&o, "echo", "two ready", |s| s.ready.len() == 2).await;
    assert_eq!(seen.spawns, 2);
    let pids: Vec<u32> = seen
        .ready
        .iter()
        .map(|a| get(*a, "/pid").1.trim().parse().unwrap())
        .collect();
    assert_ne!(pids[0], pids[1]);
    let (status, _) = get(seen.ready[0], "/health");
    assert_eq!(status, 200);

    o.scale("echo", 1).unwrap();
    let seen = until(&o, "echo", "one left", |s| {
        s.ready.len() == 1 && s.stopping == 0
    })
    .await;
    assert_eq!(seen.failures, 0, "a stop is not a failure");
    o.scale("echo", 0).unwrap();
    until(&o, "echo", "none left", |s| {
        s.ready.is_empty() && s.stopping == 0
    })
    .await;
    for pid in pids {
        wait_dead(pid).await;
    }
    assert!(dir.path().join("logs/echo/replica-1.log").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_replica_is_counted_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let o = orchestrator(dir.path());
    o.register(app("crashy", &[])).unwrap();
    o.scale("crashy", 1).unwrap();
    let seen = until(&o, "crashy", "ready", |s| s.ready.len() == 1).await;
    let old_pid: u32 = get(seen.ready[0], "/pid").1.trim().parse().unwrap();
    // The app exits while answering.
    let _ = TcpStream::connect(seen.ready[0]).and_then(|mut s| {
        s.write_all(b"GET /crash HTTP/1.1\r\nHost: x\r\n\r\n")?;
        let mut sink = Vec::new();
        s.read_to_end(&mut sink)
    });
    let seen = until(&o, "crashy", "replaced", |s| {
        s.failures == 1 && s.ready.len() == 1
    })
    .await;
    assert_eq!(seen.spawns, 2);
    assert!(
        seen.last_failure.as_deref().unwrap().contains("exited"),
        "{seen:?}"
    );
    let new_pid: u32 = get(seen.ready[0], "/pid").1.trim().parse().unwrap();
    assert_ne!(new_pid, old_pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_starts_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let o = orchestrator(dir.path());
    let mut never = app("never", &["--never-ready"]);
    never.startup_timeout_ms = 200;
    o.register(never).unwrap();
    o.scale("never", 1).unwrap();
    let seen = until(&o, "never", "a failed start", |s| s.failures >= 1).await;
    assert!(
        seen.last_failure
            .unwrap()
            .contains("not ready after 200 ms")
    );
    assert!(seen.ready.is_empty());
    o.scale("never", 0).unwrap();

    let mut missing = app("missing", &[]);
    missing.command = vec!["/nonexistent/ebb-no-such-program".into()];
    o.register(missing).unwrap();
    o.scale("missing", 1).unwrap();
    let seen = until(&o, "missing", "a spawn failure", |s| s.failures >= 1).await;
    assert!(
        seen.last_failure.unwrap().contains("spawning"),
        "spawn error is named"
    );

    assert!(o.register(app("bad name/..", &[])).is_err());
    assert!(o.scale("nope", 1).is_err());
}

#[test]
fn no_replica_outlives_a_sigkilled_ebb() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebb = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args(["debug", "run-workload", "--replicas", "3", "--log-dir"])
        .arg(dir.path())
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_ebb"))
        .arg("example-app")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(ebb.stdout.take().unwrap()).lines();
    let mut pids = Vec::new();
    for _ in 0..3 {
        let line = lines
            .next()
            .expect("run-workload printed its replicas")
            .unwrap();
        let addr: SocketAddr = line.strip_prefix("ready ").unwrap().parse().unwrap();
        pids.push(get(addr, "/pid").1.trim().parse::<u32>().unwrap());
    }
    assert!(pids.iter().all(|&p| alive(p)));
    ebb.kill().unwrap();
    ebb.wait().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for pid in pids {
        rt.block_on(wait_dead(pid));
    }
}
