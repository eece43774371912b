//! `ebb bench`: measurements on this machine, printed as a table. Benchmarks are the only place
//! timings are taken; tests never assert on time.
//!
//! * `ebb bench log` (here): append throughput by durability and concurrency, replay speed, and
//!   open time with and without a snapshot.
//! * `ebb bench cold-start` (here): the first byte through ebb for a workload at zero, minus the
//!   app's own start-to-ready time.
//! * `ebb bench calls` ([`calls`]), `functions` ([`functions`]), `cleaners` ([`cleaners`]),
//!   `discovery` ([`discovery`]) and `autoscale` ([`autoscale`], simulated: ebb against KPA).
//!
//! The scripts in `benches/` run these and add what needs other programs: `benches/proxy.sh`
//! runs wrk against the app, ebb, nginx and HAProxy; `benches/calls.sh` starts Apache Kafka
//! (`scripts/kafka run`) for the Kafka rows.

pub mod autoscale;
pub mod calls;
pub mod cleaners;
pub mod discovery;
pub mod functions;

/// Field `n` of a `/proc/PID/stat` line, numbered as in proc(5) (1 the pid, 4 the parent's,
/// 14 and 15 the user and system CPU time): counted from the command's closing parenthesis, since
/// the command may hold spaces and parentheses.
pub fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(n.checked_sub(3)?)
}

/// `ebb bench`'s measurements.
#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Append throughput, replay speed and open time of the log.
    Log(LogBenchArgs),
    /// Cold-start overhead of the proxy: first byte for a workload at zero vs the app's own start.
    ColdStart(ColdStartArgs),
    /// Durable calls end to end: calls/s and enqueue-to-start latency through the runner API.
    Calls(calls::CallsBenchArgs),
    /// Function instances end to end: instances/s (one step, three-step chain), POST to result.
    Functions(functions::FunctionsBenchArgs),
    /// Cleaners: the schedule of 100,000, CEL evaluations/s of the proposal's condition, and the
    /// loop's lateness against its planned times, each against an anchor.
    Cleaners(cleaners::CleanersBenchArgs),
    /// Load balancing: ns per pick of each balancer over 3 to 10,000 instances, against one
    /// random index; the slow-replica experiment, peak EWMA and round robin against all healthy.
    Discovery(discovery::DiscoveryBenchArgs),
    /// Scaling on load, simulated: ebb's policy against Knative's KPA on the same traces (wait
    /// for a replica, replica-seconds, scale changes).
    Autoscale(autoscale::AutoscaleBenchArgs),
}

/// Runs a benchmark.
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    let rt = crate::runtime()?;
    match cmd {
        BenchCommand::Log(args) => rt.block_on(log(args)),
        BenchCommand::Calls(args) => rt.block_on(calls::run(args)),
        BenchCommand::Discovery(args) => rt.block_on(discovery::run(args)),
        BenchCommand::Cleaners(args) => rt.block_on(cleaners::run(args)),
        BenchCommand::Functions(args) => rt.block_on(functions::run(args)),
        BenchCommand::ColdStart(args) => rt.block_on(cold_start(args)),
        BenchCommand::Autoscale(args) => autoscale::run_bench(args),
    }
}

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_bytes::ByteBuf;

use ebb::clock::{Stopwatch, SystemClock};
use ebb::event::{CallKind, CallSpec, DEFAULT_MAX_CONNECTING, Event, Outcome, Payload, RouteSpec};
use ebb::log::rocks::OpenMode;
use ebb::log::{Durability, Log, Options, RocksStore};

/// Arguments of `ebb bench log`.
#[derive(Debug, Clone, clap::Args)]
pub struct LogBenchArgs {
    /// Where to build the benchmark logs (default: a fresh directory under the system temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Events in the log built to measure replay and open time.
    #[arg(long, default_value_t = 5_000_000)]
    pub replay_events: u64,
    /// Seconds each append measurement runs.
    #[arg(long, default_value_t = 3)]
    pub seconds: u64,
}

/// Routes the generated traffic spreads over.
const ROUTES: u64 = 1_000;

/// A realistic mix: mostly traffic aggregates, some counters, some call lifecycles.
pub fn sample_event(i: u64) -> Event {
    let route = |i: u64| format!("route-{}", i % ROUTES);
    match i % 50 {
        0 => Event::CallQueued {
            call: std::sync::Arc::new(CallSpec {
                id: format!("call-{}", i / 50),
                target: route(i),
                kind: CallKind::Async,
                timeout_ms: 30_000,
                partition: Some("runner-1".into()),
                trace: None,
                tracestate: None,
                baggage: None,
                payload: Payload {
                    method: "POST".into(),
                    path: "/invoke".into(),
                    headers: vec![("content-type".into(), "application/json".into())],
                    body: ByteBuf::from(&b"{\"n\":1}"[..]),
                },
            }),
        },
        1 => Event::CallStarted {
            id: format!("call-{}", i / 50),
            runner: "runner-1".into(),
            deadline_at_ms: i + 30_000,
        },
        2 => Event::CallFinished {
            id: format!("call-{}", i / 50),
            runner: "runner-1".into(),
            outcome: Outcome::Success,
            result: None,
            log: String::new(),
        },
        3 | 4 => Event::CounterAdded {
            function: route(i),
            by: 3,
            cap: 1_000,
        },
        5 => Event::CounterDecayed {
            function: route(i),
            by: 1,
        },
        _ => Event::RequestsSeen {
            route: route(i),
            count: i % 97 + 1,
            last_at_ms: 1_700_000_000_000 + i,
        },
    }
}

fn route_events() -> Vec<Event> {
    (0..ROUTES)
        .map(|i| Event::RouteUpserted {
            route: Box::new(RouteSpec {
                name: format!("route-{i}"),
                domains: vec![format!("r{i}.example.com")],
                deployment: format!("deploy-{i}"),
                idle_after_ms: 300_000,
                min_replicas: 0,
                max_replicas: 4,
                hold_timeout_ms: 30_000,
                hold_queue_max: 1_000,
                process: None,
                concurrency: 0,
                max_connecting: 0,
                policy: Default::default(),
                ..Default::default()
            }),
        })
        .collect()
}

/// A route for benchmarks: `NAME.localhost`, never idle within a run, at most one replica.
pub(crate) fn bench_route(name: &str, process: Option<ebb::event::ProcessSpec>) -> RouteSpec {
    RouteSpec {
        name: name.into(),
        domains: vec![format!("{name}.localhost")],
        deployment: name.into(),
        idle_after_ms: 3_600_000,
        min_replicas: 0,
        max_replicas: 1,
        hold_timeout_ms: 30_000,
        hold_queue_max: 100,
        process,
        concurrency: 0,
        max_connecting: 0,
        policy: Default::default(),
        ..Default::default()
    }
}

pub(crate) fn open(dir: &std::path::Path, durability: Durability) -> Result<Log> {
    let store = Arc::new(RocksStore::open(dir, OpenMode::Create)?);
    Ok(Log::open(
        store,
        Options {
            durability,
            snapshot_every_events: 0,
            ..Options::default()
        },
        Arc::new(SystemClock),
        &mut |_| {},
    )?)
}

async fn append_rate(
    dir: &std::path::Path,
    durability: Durability,
    appenders: u64,
    seconds: u64,
) -> Result<f64> {
    let _ = std::fs::remove_dir_all(dir);
    let log = Arc::new(open(dir, durability)?);
    let done = Arc::new(AtomicU64::new(0));
    let limit = Duration::from_secs(seconds);
    let sw = Stopwatch::start();
    let mut tasks = Vec::new();
    for a in 0..appenders {
        let log = log.clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = a;
            while sw.elapsed() < limit {
                log.append(sample_event(i)).await?;
                done.fetch_add(1, Ordering::Relaxed);
                i += appenders;
            }
            Ok::<_, ebb::log::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / sw.elapsed().as_secs_f64();
    if let Ok(log) = Arc::try_unwrap(log) {
        log.close();
    }
    Ok(rate)
}

/// The storage floor: one synced single-record write after another, straight to the store.
fn raw_synced_writes(dir: &std::path::Path, seconds: u64) -> Result<f64> {
    let _ = std::fs::remove_dir_all(dir);
    let store = RocksStore::open(dir, OpenMode::Create)?;
    let limit = Duration::from_secs(seconds);
    let sw = Stopwatch::start();
    let mut n = 0u64;
    let mut batch = ebb::log::RecordBatch::default();
    while sw.elapsed() < limit {
        n += 1;
        batch.clear();
        batch.push_with(n, |buf| {
            ebb::event::encode_into(buf, n, n, &sample_event(n))
        });
        ebb::log::LogStore::write(&store, &batch, true)?;
    }
    Ok(n as f64 / sw.elapsed().as_secs_f64())
}

/// Runs the log benchmark and prints its table.
pub async fn log(args: LogBenchArgs) -> Result<()> {
    // A directory of our own is removed when `_scratch` drops; one the user named is kept.
    let _scratch;
    let base = match &args.dir {
        Some(d) => d.clone(),
        None => {
            let t = tempfile::Builder::new().prefix("ebb-bench-").tempdir()?;
            let p = t.path().to_path_buf();
            _scratch = t;
            p
        }
    };
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    println!("ebb bench log: data in {}", base.display());
    println!("| measure | value |");
    println!("|---|---|");
    let raw = raw_synced_writes(&base.join("raw"), args.seconds)?;
    println!("| storage floor: synced single-record RocksDB writes, no ebb | {raw:.0} writes/s |");
    for (durability, appenders) in [
        (Durability::Sync, 1),
        (Durability::Sync, 64),
        (Durability::Sync, 1024),
        (Durability::Buffered, 1),
        (Durability::Buffered, 1024),
    ] {
        let rate = append_rate(&base.join("append"), durability, appenders, args.seconds).await?;
        println!(
            "| append, {durability:?}, {appenders} appenders | {:.0} events/s |",
            rate
        );
    }

    // A big log for replay and open time.
    let dir = base.join("replay");
    let _ = std::fs::remove_dir_all(&dir);
    let log = Arc::new(open(&dir, Durability::Buffered)?);
    log.append_all(route_events()).await?;
    let sw = Stopwatch::start();
    let writers = 2u64;
    let per_writer = args.replay_events / writers;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = w * per_writer;
            let end = i + per_writer;
            while i < end {
                let n = 1_000.min(end - i);
                log.append_all((i..i + n).map(sample_event).collect())
                    .await?;
                i += n;
            }
            Ok::<_, ebb::log::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let built = sw.elapsed();
    let total = log.read(|s| s.seq);
    println!(
        "| build {total}-event log (buffered, batches of 1000) | {:.2} s ({:.0} events/s) |",
        built.as_secs_f64(),
        total as f64 / built.as_secs_f64()
    );
    if let Ok(log) = Arc::try_unwrap(log) {
        log.close();
    }

    let sw = Stopwatch::start();
    let log = open(&dir, Durability::Sync)?;
    let full = sw.elapsed();
    println!(
        "| open without snapshot (full replay of {total} events) | {:.2} s |",
        full.as_secs_f64()
    );
    println!(
        "| replay (read + decode + apply) | {:.0} events/s |",
        total as f64 / full.as_secs_f64()
    );
    let sw = Stopwatch::start();
    let snap_seq = log.snapshot().await?;
    let snap_time = sw.elapsed();
    let tail: Vec<Event> = (0..10_000).map(|i| sample_event(total + i)).collect();
    log.append_all(tail).await?;
    let snap_bytes = log.store().get_snapshot(snap_seq)?.map_or(0, |b| b.len());
    log.close();
    println!(
        "| take snapshot at seq {snap_seq} | {:.3} s ({} bytes) |",
        snap_time.as_secs_f64(),
        snap_bytes
    );
    let sw = Stopwatch::start();
    let log = open(&dir, Durability::Sync)?;
    let with_snap = sw.elapsed();
    println!(
        "| open with snapshot (+10000-event tail) | {:.3} s |",
        with_snap.as_secs_f64()
    );
    log.close();
    explain_figures(&dir, total)
}

/// `ebb explain` of one call and one route in the big log: through the subject index against the
/// whole-log scan it replaced (the anchor), and the index's one-time rebuild for an older log.
fn explain_figures(dir: &std::path::Path, total: u64) -> Result<()> {
    use ebb::tools::{ExplainKind, explain_indexed, explain_scan};
    let store = RocksStore::open(dir, OpenMode::Existing)?;
    let call = format!("call-{}", total / 100);
    let route = "route-7";
    for (kind, id) in [
        (ExplainKind::Call, call.as_str()),
        (ExplainKind::Route, route),
    ] {
        let sw = Stopwatch::start();
        let indexed = explain_indexed(&store, kind, id)?.context("the object is in the log")?;
        let fast = sw.elapsed();
        let sw = Stopwatch::start();
        let scanned = explain_scan(&store, kind, id, &mut |_| {})?.context("in the log")?;
        let slow = sw.elapsed();
        anyhow::ensure!(
            serde_json::to_value(&indexed)? == serde_json::to_value(&scanned)?,
            "the index told {} {id} otherwise than the scan",
            kind.name()
        );
        println!(
            "| explain {} {id} ({} events) in a {total}-event log: index / whole-log scan (anchor) | {:.2} ms / {:.0} ms ({:.0}x) |",
            kind.name(),
            indexed.events.len(),
            fast.as_secs_f64() * 1e3,
            slow.as_secs_f64() * 1e3,
            slow.as_secs_f64() / fast.as_secs_f64().max(1e-9)
        );
    }
    let sw = Stopwatch::start();
    let records = ebb::log::index::rebuild(&store, &mut |_| {})?;
    println!(
        "| index rebuild at open, for a log from before the index ({records} records) | {:.2} s |",
        sw.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Arguments of `ebb bench cold-start`.
#[derive(Debug, Clone, clap::Args)]
pub struct ColdStartArgs {
    /// Cold starts to measure.
    #[arg(long, default_value_t = 20)]
    pub rounds: u32,
    /// Requests in each cold burst (0: no burst measurement).
    #[arg(long, default_value_t = 200)]
    pub burst: usize,
    /// Cold bursts to measure (each against the app direct and through ebb, alternating).
    #[arg(long, default_value_t = 3)]
    pub burst_rounds: u32,
    /// The fragile app of the burst: `ebb example-app` with these arguments (a small accept
    /// backlog, a slow accept loop).
    #[arg(
        long,
        default_value = "--backlog 2 --accept-delay-ms 5",
        allow_hyphen_values = true
    )]
    pub burst_app: String,
    /// The burst route's `concurrency` (requests per replica at once; 0: no bound).
    #[arg(long, default_value_t = 0)]
    pub burst_concurrency: u32,
}

/// Sends `n` requests for `/pid` at once to `addr`, each on a connection of its own; returns the
/// time until the last answer was complete and how many were 200. A request gets no answer after
/// `limit` at most.
async fn burst_once(
    addr: std::net::SocketAddr,
    host: &str,
    n: usize,
    limit: Duration,
) -> (Duration, usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let head = format!("GET /pid HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let sw = Stopwatch::start();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let head = head.clone();
        set.spawn(async move {
            let one = async {
                let mut s = tokio::net::TcpStream::connect(addr).await?;
                s.write_all(head.as_bytes()).await?;
                let mut answer = Vec::new();
                s.read_to_end(&mut answer).await?;
                Ok::<bool, std::io::Error>(answer.starts_with(b"HTTP/1.1 200"))
            };
            matches!(tokio::time::timeout(limit, one).await, Ok(Ok(true)))
        });
    }
    let mut ok = 0;
    while let Some(r) = set.join_next().await {
        ok += usize::from(matches!(r, Ok(true)));
    }
    (sw.elapsed(), ok)
}

/// Sends `n` requests for `/pid` to `addr` over `conns` keep-alive connections, each opened once
/// the one before has been answered (the app's own pace: what a client with a small connection
/// pool gets); returns the time until the last answer and how many were 200.
async fn paced_once(
    addr: std::net::SocketAddr,
    n: usize,
    conns: usize,
) -> Result<(Duration, usize)> {
    use http_body_util::{BodyExt, Empty};
    type Sender = hyper::client::conn::http1::SendRequest<Empty<bytes::Bytes>>;
    async fn get(sender: &mut Sender) -> Result<bool> {
        let req = hyper::Request::get("/pid")
            .header("host", "x")
            .body(Empty::new())?;
        // The connection takes the next request once it has finished the one before.
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let ok = resp.status() == 200;
        resp.into_body().collect().await?;
        Ok(ok)
    }
    let sw = Stopwatch::start();
    let mut set = tokio::task::JoinSet::new();
    let mut ok = 0;
    for i in 0..conns {
        let share = n / conns + usize::from(i < n % conns);
        if share == 0 {
            continue;
        }
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
        // The connection's task ends once its sender is dropped.
        tokio::spawn(conn);
        ok += usize::from(get(&mut sender).await?);
        set.spawn(async move {
            let mut ok = 0;
            for _ in 1..share {
                ok += usize::from(get(&mut sender).await?);
            }
            Ok::<usize, anyhow::Error>(ok)
        });
    }
    while let Some(r) = set.join_next().await {
        ok += r??;
    }
    Ok((sw.elapsed(), ok))
}

/// `ebb serve` run by a benchmark as a child process on loopback ports of its choosing, its data
/// in a directory of its own; stopped with SIGTERM when dropped.
pub(crate) struct ServeChild {
    child: std::process::Child,
    /// Where its proxy listens.
    pub proxy: std::net::SocketAddr,
    /// Where its admin API listens.
    pub admin: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

impl ServeChild {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

/// Starts `ebb serve` with `args` and, when given, an `ebb.toml` of `config`; returns once it has
/// printed its addresses.
pub(crate) fn serve_child(args: &[&str], config: Option<&str>) -> Result<ServeChild> {
    use std::io::BufRead;
    let dir = tempfile::Builder::new().prefix("ebb-bench-").tempdir()?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .args(args)
    .arg("--data-dir")
    .arg(dir.path().join("data"))
    .env("EBB_LOG", "warn")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::inherit());
    if let Some(text) = config {
        let path = dir.path().join("ebb.toml");
        std::fs::write(&path, text)?;
        cmd.arg("--config").arg(path);
    }
    let mut child = cmd.spawn().context("starting ebb serve")?;
    let mut lines = std::io::BufReader::new(child.stdout.take().context("stdout")?).lines();
    let mut addr = |what: &str| -> Result<std::net::SocketAddr> {
        let line = lines.next().context("ebb serve ended")??;
        Ok(line
            .strip_prefix(&format!("ebb {what} listening on http://"))
            .with_context(|| format!("ebb serve printed {line:?}, not its {what} address"))?
            .parse()?)
    };
    let proxy = addr("proxy")?;
    let admin = addr("admin")?;
    std::thread::spawn(move || for _ in lines {});
    Ok(ServeChild {
        child,
        proxy,
        admin,
        _dir: dir,
    })
}

/// Starts `ebb example-app` with `args` directly on a free port and polls `/health` every `poll`
/// until it answers 200 (for at most 30 s); returns the child, its address and the time from
/// spawn to ready.
pub(crate) async fn spawn_app(
    exe: &std::path::Path,
    args: &[&str],
    poll: Duration,
) -> Result<(tokio::process::Child, std::net::SocketAddr, Duration)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let sw = Stopwatch::start();
    let child = tokio::process::Command::new(exe)
        .args(["example-app", "--port", &port.to_string()])
        .args(args)
        .kill_on_drop(true)
        .spawn()?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    loop {
        if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await?;
            let mut head = [0u8; 12];
            if s.read_exact(&mut head).await.is_ok() && head.starts_with(b"HTTP/1.1 200") {
                return Ok((child, addr, sw.elapsed()));
            }
        }
        anyhow::ensure!(
            sw.elapsed() < Duration::from_secs(30),
            "the example app did not start"
        );
        tokio::time::sleep(poll).await;
    }
}

/// Takes a workload back to zero (logged as a manual scale-down) and waits until nothing runs.
async fn back_to_zero(
    log: &Log,
    orch: &ebb::orchestrator::ProcessOrchestrator,
    name: &str,
) -> Result<()> {
    use ebb::orchestrator::Orchestrator;
    log.append(Event::ScaleRequested {
        deployment: name.into(),
        from: 1,
        to: 0,
        reason: ebb::event::ScaleReason::Manual,
    })
    .await?;
    orch.scale(name, 0)?;
    let mut changes = orch.changes();
    while orch
        .observe(name)
        .is_some_and(|o| !o.ready.is_empty() || o.stopping > 0 || o.starting > 0)
    {
        changes.changed().await?;
    }
    Ok(())
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Starts `ebb example-app` directly and polls `/health` every `poll` until it answers 200;
/// returns the time from spawn to ready.
async fn direct_start_to_ready(exe: &std::path::Path, poll: Duration) -> Result<Duration> {
    let (mut child, _, took) = spawn_app(exe, &[], poll).await?;
    child.kill().await?;
    Ok(took)
}

/// Cold-start overhead: time to first byte through ebb for a workload at zero, minus the app's
/// own start-to-ready time measured without ebb (same binary, same readiness poll interval).
pub async fn cold_start(args: ColdStartArgs) -> Result<()> {
    use ebb::orchestrator::{Orchestrator, ProcessOptions, ProcessOrchestrator, WorkloadSpec};
    use ebb::proxy::{Proxy, ProxyOptions, Traffic};

    let exe = std::env::current_exe()?;
    let scratch = tempfile::Builder::new()
        .prefix("ebb-bench-cold-")
        .tempdir()?;
    let base = scratch.path();
    let options = ProcessOptions {
        log_dir: base.join("workloads"),
        ..ProcessOptions::default()
    };
    let poll = Duration::from_millis(options.readiness_poll_ms);
    let mut direct = Vec::new();
    for _ in 0..args.rounds {
        direct.push(direct_start_to_ready(&exe, poll).await?.as_secs_f64() * 1e3);
    }

    let log = Arc::new(open(&base.join("log"), Durability::Sync)?);
    let orch = Arc::new(ProcessOrchestrator::new(options)?);
    let process = ebb::event::ProcessSpec {
        command: vec!["ebb".into(), "example-app".into()],
        readiness_path: Some("/health".into()),
        startup_timeout_ms: 30_000,
        stop_grace_ms: 5_000,
        ..Default::default()
    };
    orch.register(WorkloadSpec::from_process("cold", &process, &exe))?;
    log.append(Event::RouteUpserted {
        route: Box::new(bench_route("cold", Some(process.clone()))),
    })
    .await?;
    let dyn_orch: Arc<dyn Orchestrator> = orch.clone();
    let proxy = Arc::new(Proxy::new(
        log.clone(),
        dyn_orch,
        Arc::new(SystemClock),
        Arc::new(Traffic::default()),
        ProxyOptions::default(),
    ));
    // Proxy threads as `ebb serve` runs them: one per core, each with its own runtime.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let listeners = ebb::serve::reuseport_listeners(([127, 0, 0, 1], 0).into(), threads)?;
    let addr = listeners[0].local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let workers = proxy.spawn_workers(listeners, stop_rx)?;
    let mut through = Vec::new();
    for _ in 0..args.rounds {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let sw = Stopwatch::start();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: cold.localhost\r\nConnection: close\r\n\r\n")
            .await?;
        let mut first = [0u8; 1];
        s.read_exact(&mut first).await?;
        through.push(sw.elapsed().as_secs_f64() * 1e3);
        // Back to zero for the next round: the wake decision is undone by a manual one.
        back_to_zero(&log, &orch, "cold").await?;
    }

    // A cold burst against an app with a tiny accept backlog: through ebb from zero, and sent
    // directly to a running copy of the same app, in alternating rounds.
    let fragile_args: Vec<&str> = args.burst_app.split_whitespace().collect();
    let fragile = ebb::event::ProcessSpec {
        command: ["ebb", "example-app"]
            .iter()
            .chain(fragile_args.iter())
            .map(|a| (*a).to_owned())
            .collect(),
        ..process.clone()
    };
    orch.register(WorkloadSpec::from_process("burst", &fragile, &exe))?;
    log.append(Event::RouteUpserted {
        route: Box::new(RouteSpec {
            // The whole burst waits for the wake.
            hold_queue_max: u32::try_from(args.burst).unwrap_or(u32::MAX),
            concurrency: args.burst_concurrency,
            ..bench_route("burst", Some(fragile))
        }),
    })
    .await?;
    let limit = Duration::from_secs(60);
    let mut burst_direct = Vec::new();
    let mut burst_paced = Vec::new();
    let mut burst_through = Vec::new();
    let burst_rounds = if args.burst == 0 {
        0
    } else {
        args.burst_rounds
    };
    for _ in 0..burst_rounds {
        let (child, app, _) = spawn_app(&exe, &fragile_args, Duration::from_millis(10)).await?;
        burst_paced.push(paced_once(app, args.burst, DEFAULT_MAX_CONNECTING as usize).await?);
        burst_direct.push(burst_once(app, "x", args.burst, limit).await);
        drop(child);
        burst_through.push(burst_once(addr, "burst.localhost", args.burst, limit).await);
        back_to_zero(&log, &orch, "burst").await?;
    }
    let _ = stop_tx.send(true);
    for w in workers {
        let _ = w.join();
    }
    orch.shutdown(Duration::from_secs(1)).await;
    direct.sort_by(f64::total_cmp);
    through.sort_by(f64::total_cmp);
    println!("| measure ({} rounds) | p50 | p90 |", args.rounds);
    println!("|---|---|---|");
    println!(
        "| app start-to-ready without ebb (spawn, poll /health every {} ms) | {:.2} ms | {:.2} ms |",
        poll.as_millis(),
        percentile(&direct, 0.5),
        percentile(&direct, 0.9)
    );
    println!(
        "| first byte through ebb, workload at zero | {:.2} ms | {:.2} ms |",
        percentile(&through, 0.5),
        percentile(&through, 0.9)
    );
    println!(
        "| cold-start overhead (difference) | {:.2} ms | {:.2} ms |",
        percentile(&through, 0.5) - percentile(&direct, 0.5),
        percentile(&through, 0.9) - percentile(&direct, 0.9)
    );
    if burst_direct.is_empty() {
        return Ok(());
    }
    let median = |runs: &[(Duration, usize)]| {
        let mut ms: Vec<f64> = runs.iter().map(|(d, _)| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        percentile(&ms, 0.5)
    };
    let answered = |runs: &[(Duration, usize)]| runs.iter().map(|(_, ok)| ok).min().copied();
    let (d, p, t) = (
        median(&burst_direct),
        median(&burst_paced),
        median(&burst_through),
    );
    println!();
    println!(
        "| cold burst: {} requests at once, app with {} ({} rounds) | median time to the last answer | fewest 200s in a round |",
        args.burst,
        args.burst_app,
        burst_direct.len()
    );
    println!("|---|---|---|");
    println!(
        "| sent directly to a running copy | {d:.1} ms | {} |",
        answered(&burst_direct).unwrap_or(0)
    );
    println!(
        "| sent directly over {DEFAULT_MAX_CONNECTING} keep-alive connections, each opened once the one before was answered (the app's own pace) | {p:.1} ms | {} |",
        answered(&burst_paced).unwrap_or(0)
    );
    println!(
        "| through ebb, workload at zero (wake included) | {t:.1} ms | {} |",
        answered(&burst_through).unwrap_or(0)
    );
    println!("| through ebb / direct at once | {:.2} x | |", t / d);
    println!(
        "| through ebb / direct at the app's pace | {:.2} x | |",
        t / p
    );
    Ok(())
}
