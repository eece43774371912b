//! Helpers shared by the integration tests that run `ebb serve` as a real process.
#![allow(dead_code)]

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
    .env_remove("EBB_CONFIG")
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    if let Some(t) = token {
        cmd.env("EBB_ADMIN_TOKEN", t);
    }
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
