//! Helpers shared by the integration tests that run `ebb serve` as a real process.
#![allow(dead_code)]

pub mod controlplane;
pub mod ebbkube;
pub mod kafka;
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

#[allow(unused_imports)]
pub use kafka::broker;

/// A loopback port free now (the kernel's pick; bound by someone else only by a rare race).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `ebb serve` arguments of replica `name` (admin API on `admin_port`) of two sharing the Kafka
/// at `brokers`, the other (`peer`) at `peer_port`.
pub fn replica_args(
    name: &str,
    admin_port: u16,
    peer: &str,
    peer_port: u16,
    brokers: &str,
) -> Vec<String> {
    [
        "--admin-listen".to_owned(),
        format!("127.0.0.1:{admin_port}"),
        "--replica".to_owned(),
        name.to_owned(),
        "--peer".to_owned(),
        format!("{peer}=http://127.0.0.1:{peer_port}"),
        "--kafka-brokers".to_owned(),
        brokers.to_owned(),
    ]
    .into()
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
