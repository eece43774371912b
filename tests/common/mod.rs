//! Helpers shared by the integration tests that run `ebb serve` as a real process.
#![allow(dead_code)]

pub mod controlplane;
pub mod ebbkube;
pub mod node;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A running `ebb serve`, killed when dropped.
pub struct Ebb {
    pub child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub data: PathBuf,
}

impl Drop for Ebb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `ebb serve` on loopback ports of its choosing, with its log in `data`, an optional
/// config file and an optional admin token; returns once it has printed its addresses.
pub fn serve(data: &Path, config: Option<&Path>, token: Option<&str>) -> Ebb {
    serve_with(data, config, token, &[])
}

/// [`serve`] with more arguments for `ebb serve`.
pub fn serve_with(data: &Path, config: Option<&Path>, token: Option<&str>, extra: &[&str]) -> Ebb {
    serve_env(data, config, token, extra, &[])
}

/// [`serve_with`] with more environment variables.
pub fn serve_env(
    data: &Path,
    config: Option<&Path>,
    token: Option<&str>,
    extra: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> Ebb {
    serve_logged(data, config, token, extra, env, None)
}

/// [`serve_env`] with ebb's log (its stderr) written to `log` instead of the test's.
pub fn serve_logged(
    data: &Path,
    config: Option<&Path>,
    token: Option<&str>,
    extra: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
    log: Option<&Path>,
) -> Ebb {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ebb"));
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .args(["--flush-interval-ms", "100", "--data-dir"])
    .arg(data)
    .env("EBB_LOG", "warn")
    .args(extra)
    .env_remove("EBB_ADMIN_TOKEN")
    .env_remove("EBB_RUNNER_TOKEN")
    .env_remove("EBB_API_TOKEN")
    .env_remove("EBB_CONFIG")
    .stdout(Stdio::piped())
    .stderr(match log {
        Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
        None => Stdio::inherit(),
    });
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    if let Some(t) = token {
        cmd.env("EBB_ADMIN_TOKEN", t);
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addr = |what: &str| -> SocketAddr {
        let line = lines.next().expect("serve printed its addresses").unwrap();
        line.strip_prefix(&format!("ebb {what} listening on http://"))
            .unwrap_or_else(|| panic!("unexpected line {line:?}"))
            .parse()
            .unwrap()
    };
    let proxy = addr("proxy");
    let admin = addr("admin");
    std::thread::spawn(move || for _ in lines {});
    Ebb {
        child,
        proxy,
        admin,
        data: data.to_owned(),
    }
}

/// A Kafka-protocol broker (tansu, memory storage) on a loopback port, stopped when dropped.
pub struct Broker {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tansu binary: `$EBB_TANSU`, then the one `scripts/test` installs, then `tansu` on PATH.
pub fn tansu() -> PathBuf {
    if let Some(p) = std::env::var_os("EBB_TANSU") {
        return PathBuf::from(p);
    }
    if let Some(home) = std::env::var_os("HOME") {
        let p = PathBuf::from(home).join(".cache/ebb/tools/bin/tansu");
        if p.exists() {
            return p;
        }
    }
    PathBuf::from("tansu")
}

/// Starts a broker and waits until it accepts connections.
pub async fn broker() -> Broker {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("tcp://127.0.0.1:{port}");
    let child = Command::new(tansu())
        .args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
        ])
        .args(["--storage-engine", "memory://tansu/"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start the Kafka-protocol broker {:?}: {e} (./scripts/test installs it)",
                tansu()
            )
        });
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let broker = Broker { child, addr };
    let listening = async {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            tick.tick().await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), listening)
        .await
        .unwrap_or_else(|_| panic!("the broker did not listen on {addr}"));
    broker
}

/// Every event of the log in `data`, as `ebb log dump --json` prints them.
/// Runs `ebb ARGS --data-dir DATA`, which must succeed; returns what it printed.
pub fn ebb_ok(data: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn events(data: &Path) -> Vec<serde_json::Value> {
    ebb_ok(data, &["log", "dump", "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
