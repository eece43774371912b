//! Helpers shared by the integration tests that run `ebb serve` as a real process.
#![allow(dead_code)]

pub mod controlplane;
pub mod ebbkube;
pub mod http;
pub mod kafka;
pub mod kubelet;
pub mod node;
pub mod otelcol;

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

impl Ebb {
    /// SIGTERM: the signal a shutdown starts with.
    pub fn sigterm(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("SIGTERM to ebb");
    }
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
    .env(
        "EBB_LOG",
        std::env::var("EBB_TEST_LOG").unwrap_or("warn".into()),
    )
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
    let (proxy, admin) = addresses(child.stdout.take().unwrap());
    Ebb {
        child,
        proxy,
        admin,
        data: data.to_owned(),
    }
}

/// The proxy's and the admin listener's addresses, from the lines `ebb serve` prints first; the
/// rest of its output is read and dropped.
pub fn addresses(out: impl std::io::Read + Send + 'static) -> (SocketAddr, SocketAddr) {
    let mut lines = BufReader::new(out).lines();
    let mut addr = |what: &str| -> SocketAddr {
        let line = lines.next().expect("serve printed its addresses").unwrap();
        line.strip_prefix(&format!("ebb {what} listening on http://"))
            .or_else(|| line.strip_prefix(&format!("ebb {what} listening on https://")))
            .unwrap_or_else(|| panic!("unexpected line {line:?}"))
            .parse()
            .unwrap()
    };
    let proxy = addr("proxy");
    let admin = addr("admin");
    std::thread::spawn(move || for _ in lines {});
    (proxy, admin)
}

/// A small deterministic generator, so that a failing run can be repeated with its seed.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[allow(unused_imports)]
pub use kafka::broker;

/// A loopback port free now, for a server the test starts on it.
///
/// It comes from below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), where
/// the kernel's own picks land: every server started on port 0 (ebb's listeners, its apps'
/// replicas, other tests' servers) and every client socket. A port from that range could be
/// given to one of them between this call and the bind of the server it is for. Each test
/// process walks its own sequence from a start its pid sets, and hands no port out twice.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOWEST: u32 = 10_000;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral.saturating_sub(LOWEST).max(1_000);
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let port = LOWEST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free loopback port in {LOWEST}..{}", LOWEST + span)
}

/// A functions API watch (`GET /api/funcs/template?watch=true`): its lines as they arrive.
pub struct FuncWatch {
    body: hyper::body::Incoming,
    buf: Vec<u8>,
}

impl FuncWatch {
    /// Opens the watch on the admin API at `admin` with bearer `token`, `query` after
    /// `watch=true` (`""`, `"&since=N"`, ...); asserts a 200 of newline-delimited JSON.
    pub async fn open(admin: SocketAddr, token: &str, query: &str) -> FuncWatch {
        use hyper_util::client::legacy::Client;
        use hyper_util::rt::TokioExecutor;
        let client: Client<_, http_body_util::Empty<bytes::Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let req = hyper::Request::get(format!(
            "http://{admin}/api/funcs/template?watch=true{query}"
        ))
        .header("authorization", format!("Bearer {token}"))
        .body(http_body_util::Empty::new())
        .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
        FuncWatch {
            body: resp.into_body(),
            buf: Vec::new(),
        }
    }

    /// The next line, within 30 s.
    pub async fn next(&mut self) -> serde_json::Value {
        use http_body_util::BodyExt;
        let read = async {
            loop {
                if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = self.buf.drain(..=i).collect();
                    return serde_json::from_slice(&line).unwrap();
                }
                let frame = self.body.frame().await.expect("the watch ended").unwrap();
                if let Ok(data) = frame.into_data() {
                    self.buf.extend_from_slice(&data);
                }
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(30), read)
            .await
            .expect("no watch line within 30 s")
    }
}

/// An `ebb runner` process, killed when dropped.
pub struct EbbRunner(pub Child);

impl Drop for EbbRunner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ebb runner` named `id`, running `capacity` calls at once, with the runner API at `api`
/// (bearer `token`) and calls sent through ebb's proxy at `proxy`; `extra` arguments after.
pub fn ebb_runner(
    api: SocketAddr,
    proxy: SocketAddr,
    token: &str,
    id: &str,
    capacity: usize,
    extra: &[&str],
) -> EbbRunner {
    let child = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args(["runner", "--api", &format!("http://{api}")])
        .args([
            "--token",
            token,
            "--id",
            id,
            "--capacity",
            &capacity.to_string(),
        ])
        .args(["--proxy", &proxy.to_string()])
        .args(extra)
        .env(
            "EBB_LOG",
            std::env::var("EBB_TEST_LOG").unwrap_or("warn".into()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    EbbRunner(child)
}

/// What two ebb replicas on one machine share: Apache Kafka, a work directory, and their admin
/// API ports. Replica `i` is `ebb-i`.
pub struct KafkaPair {
    pub broker: kafka::Broker,
    pub dir: tempfile::TempDir,
    pub ports: [u16; 2],
}

impl KafkaPair {
    /// A broker started, a work directory, two free ports.
    pub async fn start() -> Self {
        Self {
            broker: broker().await,
            dir: tempfile::tempdir().unwrap(),
            ports: [free_port(), free_port()],
        }
    }

    /// Replica `me`'s directory (made).
    pub fn data(&self, me: usize) -> PathBuf {
        let d = self.dir.path().join(format!("ebb-{me}"));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// `ebb serve` arguments of replica `me`: its admin API on its port, its name, the other
    /// replica as its peer, the Kafka.
    pub fn args(&self, me: usize) -> Vec<String> {
        let other = 1 - me;
        [
            "--admin-listen".to_owned(),
            format!("127.0.0.1:{}", self.ports[me]),
            "--replica".to_owned(),
            format!("ebb-{me}"),
            "--peer".to_owned(),
            format!("ebb-{other}=http://127.0.0.1:{}", self.ports[other]),
            "--kafka-brokers".to_owned(),
            self.broker.addr.to_string(),
        ]
        .into()
    }
}

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

/// `ebb serve` on loopback ports with its log in `data` and `extra` arguments, which must refuse
/// to start (what it printed to stderr is returned).
pub fn serve_refused<S: AsRef<std::ffi::OsStr>>(
    data: &Path,
    extra: impl IntoIterator<Item = S>,
) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ebb"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(data)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A refused start ends at once; one that serves would run on: it is stopped at a deadline.
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut err);
        err
    });
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (ended, exit) = std::sync::mpsc::channel();
    std::thread::spawn(move || ended.send(child.wait().unwrap()));
    let status = match exit.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(status) => Some(status),
        Err(_) => {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            None
        }
    };
    let err = reader.join().unwrap();
    assert!(
        status.is_some_and(|s| !s.success()),
        "ebb serve started: {err}"
    );
    err
}

/// What a log's events say of calls, instances and Cleaners.
#[derive(Default)]
pub struct Tally {
    /// Ids of the calls queued.
    pub queued: std::collections::BTreeSet<String>,
    /// Ids of the instances created.
    pub created: std::collections::BTreeSet<String>,
    /// Each call's starts.
    pub started: std::collections::BTreeMap<String, usize>,
    /// Each Cleaner's firings completed.
    pub fired: std::collections::BTreeMap<String, usize>,
}

/// Counts `events` (as [`events`] reads them).
pub fn tally(events: &[serde_json::Value]) -> Tally {
    let mut t = Tally::default();
    let id = |v: &serde_json::Value| v.as_str().unwrap().to_owned();
    for e in events {
        let e = &e["event"];
        if let Some(q) = e.get("CallQueued") {
            t.queued.insert(id(&q["call"]["id"]));
        } else if let Some(s) = e.get("CallStarted") {
            *t.started.entry(id(&s["id"])).or_default() += 1;
        } else if let Some(i) = e.get("InstanceCreated") {
            t.created.insert(id(&i["id"]));
        } else if let Some(f) = e.get("CleanerFired") {
            *t.fired.entry(id(&f["name"])).or_default() += 1;
        }
    }
    t
}

/// Every event of the log in `data`, as `ebb log dump --json` prints them.
pub fn events(data: &Path) -> Vec<serde_json::Value> {
    ebb_ok(data, &["log", "dump", "--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Whether process `pid` runs (a zombie does not).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.split(' ').nth(2).is_none_or(|s| s != "Z"),
        Err(_) => false,
    }
}

/// The live children of process `ebb` whose command line contains `needle`.
pub fn children_with(ebb: u32, needle: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The fields after the command name (which may hold spaces): state, ppid, ...
        let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
        let ppid: u32 = after
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if ppid == ebb && cmdline.contains(needle) && alive(pid) {
            pids.push(pid);
        }
    }
    pids
}

/// Runs the browser test `tests/browser/NAME.mjs` with node against headless Chromium, with
/// `env` beside `EBB_CHROMIUM` and `EBB_ARTIFACTS` (its screenshots: `EBB_ARTIFACTS/NAME`, else
/// the target's tmp dir); fails the test with what it printed unless it passed.
pub async fn browser_test(name: &str, env: Vec<(&'static str, String)>) {
    let artifacts = std::env::var_os("EBB_ARTIFACTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")))
        .join(name);
    let _ = std::fs::remove_dir_all(&artifacts);
    let chromium = std::env::var("EBB_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "no Chromium at {chromium}: ./scripts/test installs Debian's chromium"
    );
    let browser = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    assert!(
        browser.join("node_modules/playwright-core").is_dir(),
        "tests/browser has no node_modules/playwright-core: ./scripts/test installs it, or by \
         hand: (cd tests/browser && npm ci --no-audit --no-fund)"
    );
    let script = browser.join(format!("{name}.mjs"));
    let out = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg(script)
            .envs(env)
            .env("EBB_CHROMIUM", &chromium)
            .env("EBB_ARTIFACTS", &artifacts)
            .output()
    })
    .await
    .unwrap()
    .expect("node runs (./scripts/test installs tests/browser's packages)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the browser test {name} failed:\n{stdout}\n{stderr}"
    );
}

/// How many `ScaleRequested` of `deployment` with `reason` the log in `data` holds.
pub fn scale_events(data: &Path, deployment: &str, reason: &str) -> usize {
    events(data)
        .iter()
        .filter(|e| {
            let s = &e["event"]["ScaleRequested"];
            s["deployment"] == deployment && s["reason"] == reason
        })
        .count()
}
