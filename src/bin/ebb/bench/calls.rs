//! `ebb bench calls`: durable calls end to end on this machine. Producers enqueue batches through
//! the HTTP runner API; runners (in process, or over HTTP) dequeue, start and finish them with a
//! no-op target. Each phase runs on a fresh log and queue and starts after a warm-up (on Kafka:
//! until every runner's consumer has joined the group and run a call), and the first Kafka row
//! after one throughput phase that is not measured (the broker's JIT warms up on ebb's requests).
//! Reports calls/s from the first enqueue until every call has finished and this process's CPU
//! time per call (ebb's services, runners and producers), with `--broker-pid` the broker's beside
//! it, the median of `--rounds` phases; then the
//! enqueue-to-start latency (from just before the enqueue request to the moment the runner holds
//! the accepted start) at half that rate, the median of `--rounds` phases, with the stages on the
//! way (the enqueue answered, the call handed to a runner), and what bounds the throughput (the
//! producers' enqueue requests' answer times in the median round, and their retries after a full
//! queue). Rows for the embedded
//! queue and Kafka, one and two ebb replicas (starts and finishes of the other's calls
//! forwarded), and the cost of a start forwarded to the call's owner against one sent to the
//! owner.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::json;

use ebb::calls::runner::{self, Executor, HttpApi, NoopExecutor, RunnerApi, RunnerOptions};
use ebb::calls::{CallOptions, Calls, Finish, Job};
use ebb::clock::{Clock, Stopwatch, SystemClock};
use ebb::event::Event;
use ebb::log::Durability;
use ebb::queue::Queue;
use ebb::queue::embedded::{EmbeddedOptions, EmbeddedQueue};
use ebb::queue::kafka::{ClientProperties, KafkaOptions, KafkaQueue};

/// Arguments of `ebb bench calls`.
#[derive(Debug, Clone, clap::Args)]
pub struct CallsBenchArgs {
    /// Seconds each phase enqueues for.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Concurrent producers.
    #[arg(long, default_value_t = 4)]
    pub producers: usize,
    /// Calls per enqueue request in the throughput phase.
    #[arg(long, default_value_t = 250)]
    pub batch: usize,
    /// Runners.
    #[arg(long, default_value_t = 2)]
    pub runners: usize,
    /// Calls each runner runs at once (and asks for per dequeue).
    #[arg(long, default_value_t = 500)]
    pub capacity: usize,
    /// Calls/s of the latency phase (default: half the measured throughput).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Throughput and latency phases per row (each on a fresh log and queue); the row shows
    /// their medians and ranges.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Also measure the Kafka queue, on this broker (`bootstrap.servers`).
    #[arg(long)]
    pub kafka: Option<String>,
    /// Only the Kafka rows (with `--kafka`): for profiling the Kafka path alone.
    #[arg(long, requires = "kafka")]
    pub kafka_only: bool,
    /// The bare broker's produce-and-consume rate (records/s) on the same broker, measured by
    /// Kafka's own perf-test tools (benches/calls.sh): the Kafka rows print their ratio to it.
    #[arg(long, requires = "kafka")]
    pub anchor: Option<f64>,
    /// The broker's process (on this machine): its CPU time over each Kafka throughput phase is
    /// printed per call beside ebb's, with the CPU per call the machine's cores leave ebb and the
    /// broker together at half the anchor's rate.
    #[arg(long, requires = "kafka")]
    pub broker_pid: Option<i32>,
    /// The Kafka queue commits its consumers' offsets at most once in this long (ms).
    #[arg(long, default_value_t = ebb::queue::kafka::COMMIT_EVERY_MS)]
    pub kafka_commit_every_ms: u64,
    /// A librdkafka property for the Kafka clients, `KEY=VALUE`, as `ebb serve --kafka-config`
    /// (repeat it).
    #[arg(long = "kafka-config", value_name = "KEY=VALUE", requires = "kafka",
          value_parser = |s: &str| ClientProperties::parse([s]).map(|_| s.to_owned()))]
    pub kafka_config: Vec<String>,
    /// The most ended calls each replica keeps, as `ebb serve --call-retention-count` (the
    /// retention's forgettings run beside the calls, as in `ebb serve`).
    #[arg(long, default_value_t = CallOptions::default().retention_bounds.count)]
    pub retention_count: u64,
}

const TOKEN: &str = "bench";

/// Records when each call was handed to a runner and when it started (relative to one
/// stopwatch) while a latency phase asks (`timing`), and which runners ran one.
struct Recorder {
    clock: Stopwatch,
    timing: std::sync::atomic::AtomicBool,
    dequeued: Mutex<HashMap<String, f64>>,
    started: Mutex<HashMap<String, f64>>,
    ran: Vec<std::sync::atomic::AtomicBool>,
    /// The runners' requests and the calls in them: dequeues, starts and finishes.
    requests: Requests,
}

/// Counts of a runner API's requests and of the calls they carried, by kind.
#[derive(Default)]
struct Requests {
    /// Requests and calls for dequeues, starts and finishes, in that order.
    counts: [(AtomicU64, AtomicU64); 3],
}

impl Requests {
    fn count(&self, kind: usize, calls: usize) {
        let (requests, n) = &self.counts[kind];
        requests.fetch_add(1, Ordering::Relaxed);
        n.fetch_add(calls as u64, Ordering::Relaxed);
    }

    /// The counts so far, as (requests, calls) by kind.
    fn now(&self) -> [(u64, u64); 3] {
        self.counts
            .each_ref()
            .map(|(r, n)| (r.load(Ordering::Relaxed), n.load(Ordering::Relaxed)))
    }
}

/// A runner's API that notes when each dequeue answered, for the latency phase's stages.
struct Timed {
    api: Arc<dyn RunnerApi>,
    recorder: Arc<Recorder>,
}

impl RunnerApi for Timed {
    fn dequeue(
        &self,
        runner: &str,
        max: usize,
        wait_ms: u64,
        load: ebb::calls::Load,
    ) -> runner::RunnerFuture<'_, Vec<Job>> {
        let runner = runner.to_owned();
        Box::pin(async move {
            let jobs = self.api.dequeue(&runner, max, wait_ms, load).await?;
            let r = &self.recorder;
            r.requests.count(0, jobs.len());
            if r.timing.load(std::sync::atomic::Ordering::Relaxed) {
                let at = r.clock.elapsed().as_secs_f64();
                let mut dequeued = r.dequeued.lock().expect("recorder lock");
                for j in &jobs {
                    dequeued.insert(j.call.id.clone(), at);
                }
            }
            Ok(jobs)
        })
    }

    fn start(
        &self,
        runner: &str,
        ids: Vec<String>,
        load: ebb::calls::Load,
    ) -> runner::RunnerFuture<'_, Vec<ebb::calls::Started>> {
        self.recorder.requests.count(1, ids.len());
        self.api.start(runner, ids, load)
    }

    fn finish<'a>(
        &'a self,
        runner: &str,
        finishes: &'a mut Vec<Finish>,
        load: ebb::calls::Load,
    ) -> runner::RunnerFuture<'a, ()> {
        self.recorder.requests.count(2, finishes.len());
        self.api.finish(runner, finishes, load)
    }
}

/// Runner `runner`'s executor: records the start, then finishes the call at once.
struct Runs {
    recorder: Arc<Recorder>,
    runner: usize,
}

impl Executor for Runs {
    fn execute(&self, job: Job, t: Duration) -> Pin<Box<dyn Future<Output = Finish> + Send>> {
        let r = &self.recorder;
        if r.timing.load(std::sync::atomic::Ordering::Relaxed) {
            r.started
                .lock()
                .expect("recorder lock")
                .insert(job.call.id.clone(), r.clock.elapsed().as_secs_f64());
        }
        r.ran[self.runner].store(true, std::sync::atomic::Ordering::Relaxed);
        NoopExecutor.execute(job, t)
    }
}

/// One ebb replica of a setup: its call service and its runner API.
struct Replica {
    calls: Arc<Calls>,
    api: std::net::SocketAddr,
}

struct Setup {
    replicas: Vec<Replica>,
    stop: tokio::sync::watch::Sender<bool>,
    recorder: Arc<Recorder>,
    /// The Kafka topic and group of this setup (the runners share its partitions through the
    /// group), deleted when it ends: a run against a shared broker leaves none of its messages
    /// there (each setup puts hundreds of megabytes).
    kafka: Option<KafkaOptions>,
    runners: Vec<tokio::task::JoinHandle<()>>,
    servers: Vec<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Setup {
    /// The replica that owns `id`.
    fn owner(&self, id: &str) -> &Replica {
        let i = ebb::peers::owner_of(id)
            .and_then(|o| o.strip_prefix("bench-"))
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        &self.replicas[i.min(self.replicas.len() - 1)]
    }
}

/// `replicas` ebb replicas (each with its own log and API, sharing the Kafka topic when there
/// are several, forwarding to each other) with `args.runners` runners spread over them.
async fn setup(
    args: &CallsBenchArgs,
    over_http: bool,
    kafka: Option<&str>,
    replicas: usize,
) -> Result<Setup> {
    let dir = tempfile::Builder::new()
        .prefix("ebb-bench-calls-")
        .tempdir()?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    // A topic and group of their own per setup: nothing left over from the last (and both
    // deleted by the teardown).
    let kafka_options = match kafka {
        Some(brokers) => Some(KafkaOptions {
            brokers: brokers.to_owned(),
            topic: format!("ebb-bench-{}", uuid::Uuid::now_v7().simple()),
            group: format!("ebb-bench-{}", uuid::Uuid::now_v7().simple()),
            commit_every_ms: args.kafka_commit_every_ms,
            client: ClientProperties::parse(args.kafka_config.iter().map(|s| s.as_str()))
                .map_err(anyhow::Error::msg)?,
            ..KafkaOptions::default()
        }),
        None => None,
    };
    let mut listeners = Vec::new();
    for _ in 0..replicas {
        listeners.push(tokio::net::TcpListener::bind("127.0.0.1:0").await?);
    }
    let addrs: Vec<std::net::SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<std::io::Result<_>>()?;
    let names: Vec<String> = (0..replicas).map(|i| format!("bench-{i}")).collect();
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let mut set = Vec::new();
    let mut servers = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let log = Arc::new(super::open(
            &dir.path().join(format!("log-{i}")),
            Durability::Sync,
        )?);
        let queue: Arc<dyn Queue> = match &kafka_options {
            Some(options) => Arc::new(KafkaQueue::open(clock.clone(), options.clone()).await?),
            None => Arc::new(EmbeddedQueue::open(
                dir.path().join(format!("queue-{i}")),
                clock.clone(),
                EmbeddedOptions::default(),
            )?),
        };
        log.append(Event::RouteUpserted {
            route: Box::new(super::bench_route("noop", None)),
        })
        .await?;
        let peers = if replicas > 1 {
            let others = (0..replicas)
                .filter(|j| *j != i)
                .map(|j| {
                    let id = ebb::discovery::ServiceId::parse(&format!("http://{}", addrs[j]))
                        .expect("a socket address is a service id");
                    (names[j].clone(), id)
                })
                .collect();
            ebb::peers::Peers::with_static(Some(names[i].clone()), others)
        } else {
            ebb::peers::Peers::alone()
        };
        let bounds = ebb::cleaner::local::RetentionBounds {
            count: args.retention_count,
            ..CallOptions::default().retention_bounds
        };
        tokio::spawn(ebb::cleaner::local::hold_within(
            log.clone(),
            bounds,
            stop_rx.clone(),
        ));
        let calls = Arc::new(
            Calls::new(log.clone(), queue, clock.clone(), CallOptions::default())
                .with_peers(Arc::new(peers), ebb::peers::PeerToken::Static(TOKEN.into())),
        );
        let router = ebb::api::router(ebb::api::AppState {
            peers: calls.peers().clone(),
            templates: None,
            log,
            orchestrator: None,
            access: Arc::new(ebb::api::access::Access::tokens(ebb::api::access::Tokens {
                runner: Some(TOKEN.into()),
                ..Default::default()
            })),
            ebb_exe: std::env::current_exe()?,
            calls: Some(calls.clone()),
            functions: None,
            ready: None,
            refused: None,
            metrics: None,
            feed: Arc::new(ebb::api::ui::Feed::new(stop_rx.clone())),
            max_body_bytes: ebb::api::MAX_BODY_BYTES,
            load: None,
            clock: clock.clone(),
            stopping: Default::default(),
        });
        use axum::serve::ListenerExt;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let mut stopped = stop_rx.clone();
        servers.push(tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.changed().await;
                })
                .await;
        }));
        set.push(Replica {
            calls,
            api: addrs[i],
        });
    }
    let recorder = Arc::new(Recorder {
        clock: Stopwatch::start(),
        timing: std::sync::atomic::AtomicBool::new(false),
        dequeued: Mutex::new(HashMap::new()),
        started: Mutex::new(HashMap::new()),
        ran: (0..args.runners).map(|_| Default::default()).collect(),
        requests: Requests::default(),
    });
    let mut runners = Vec::new();
    for i in 0..args.runners {
        let r = &set[i % replicas];
        let client: Arc<dyn RunnerApi> = if over_http {
            Arc::new(HttpApi::new(
                ebb::discovery::ServiceId::parse(&format!("http://{}", r.api))
                    .expect("a socket address is a service id"),
                TOKEN,
                Arc::new(ebb::discovery::Balanced::dns_only()),
            ))
        } else {
            Arc::new(r.calls.clone())
        };
        let client = Arc::new(Timed {
            api: client,
            recorder: recorder.clone(),
        });
        let options = RunnerOptions {
            id: format!("bench-{i}"),
            capacity: args.capacity,
            batch: args.capacity.min(CallOptions::default().max_batch),
            wait_ms: 1_000,
            ..RunnerOptions::default()
        };
        runners.push(tokio::spawn(runner::run(
            client,
            Arc::new(Runs {
                recorder: recorder.clone(),
                runner: i,
            }),
            options,
            stop_rx.clone(),
        )));
    }
    Ok(Setup {
        replicas: set,
        stop,
        recorder,
        kafka: kafka_options,
        runners,
        servers,
        _dir: dir,
    })
}

/// POSTs `body` to the runner API at `api`; returns the answer's body, an error unless 2xx.
async fn post(
    client: &Client<HttpConnector, Full<Bytes>>,
    api: std::net::SocketAddr,
    path: &str,
    body: Bytes,
) -> Result<Bytes> {
    let req = hyper::Request::post(format!("http://{api}{path}"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(Full::new(body))?;
    let resp = client.request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    anyhow::ensure!(
        status.is_success(),
        "{path}: {status} {}",
        String::from_utf8_lossy(&body)
    );
    Ok(body)
}

/// An enqueue request of `batch` calls, written once by each producer and sent again and again
/// (a producer's own encoding is not what the bench measures).
fn enqueue_body(batch: usize) -> Bytes {
    let calls: Vec<_> = (0..batch)
        .map(|_| json!({ "target": "noop", "payload": { "body": "x" } }))
        .collect();
    Bytes::from(json!({ "calls": calls }).to_string())
}

/// Enqueues the calls of `body` (an [`enqueue_body`]); returns their ids.
async fn enqueue(
    client: &Client<HttpConnector, Full<Bytes>>,
    api: std::net::SocketAddr,
    body: &Bytes,
) -> Result<Vec<String>> {
    Ok(enqueue_counting(client, api, body).await?.0)
}

/// [`enqueue`], and how many times the queue was full first.
async fn enqueue_counting(
    client: &Client<HttpConnector, Full<Bytes>>,
    api: std::net::SocketAddr,
    body: &Bytes,
) -> Result<(Vec<String>, u64)> {
    // A full queue (503 target_queue_full) is the producers outrunning the runners: back off
    // and send the same batch again, as a producer honouring the bound would.
    let mut full = 0;
    let body = loop {
        match post(client, api, "/runner/enqueue", body.clone()).await {
            Err(e) if e.to_string().contains("target_queue_full") => {
                full += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            answer => break answer?,
        }
    };
    // Read straight into the ids (a producer's CPU is counted with ebb's: a tree of JSON values
    // first cost it an allocation per id more).
    #[derive(serde::Deserialize)]
    struct Answer {
        ids: Vec<String>,
    }
    let answer: Answer = serde_json::from_slice(&body).context("the enqueue's answer")?;
    Ok((answer.ids, full))
}

/// Waits until every call in `batches` (each an enqueue's ids) has finished (bounded). Calls
/// finish about in the order they were enqueued, so each look starts at the first one not yet
/// seen finished.
async fn drain(s: &Setup, batches: &[Vec<String>]) -> Result<()> {
    let ids = || batches.iter().flatten();
    let wait = async {
        let mut left = ids().peekable();
        // A call the owner no longer has was forgotten by the retention's bounds, which forget
        // only ended calls (its enqueue was answered once it was recorded).
        let ended = |id: &String| {
            s.owner(id)
                .calls
                .log()
                .read(|st| st.calls.get(id).is_none_or(|c| c.status.is_final()))
        };
        loop {
            while left.next_if(|id| ended(id)).is_some() {}
            if left.peek().is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(120), wait)
        .await
        .is_err()
    {
        // Which calls, and what became of them: the first few not ended.
        let stuck: Vec<String> = ids()
            .filter_map(|id| {
                let c = s.owner(id).calls.log().read(|st| {
                    st.calls
                        .get(id)
                        .map(|c| (c.status, c.runner.clone(), c.starts))
                });
                match c {
                    None => None,
                    Some((st, _, _)) if st.is_final() => None,
                    other => Some(format!("{id}: {other:?}")),
                }
            })
            .take(5)
            .collect();
        let queues: Vec<String> = s
            .replicas
            .iter()
            .map(|r| format!("{:?}", r.calls.queue().stats()))
            .collect();
        anyhow::bail!("calls did not finish within 120 s: {stuck:?}; queues: {queues:?}");
    }
    Ok(())
}

/// What a throughput phase measured.
#[derive(Debug, Clone, Copy)]
struct Rate {
    calls_per_s: f64,
    /// This process's CPU time per call, us.
    cpu_us: f64,
    /// The broker's CPU time per call, us (with `--broker-pid` on Kafka).
    broker_us: Option<f64>,
    /// How long the producers' enqueue requests took to be answered, p50 and p99, ms (each
    /// producer sends its next request once one is answered, so these bound the phase's rate).
    request_ms: (f64, f64),
    /// Enqueue requests sent again after a full queue (each after a 20 ms back-off).
    full_retries: u64,
    /// The longest any replica's log writer held its projection for one batch, ms (every
    /// decision and read waited meanwhile): a forgetting by the retention's bounds among them.
    longest_hold_ms: f64,
    /// Calls a runner's dequeue, start and finish request carried, on average (a request's cost
    /// is shared by its calls; over HTTP each is a round trip).
    calls_per_request: [f64; 3],
}

/// One row of the table: its throughput phase (the median of the rounds) and latencies.
struct Row {
    queue: &'static str,
    replicas: usize,
    over_http: bool,
    phase: Rate,
    p50: f64,
    /// The latency round with the median p99.
    stages: Latency,
    /// Each latency round's p99, the partitions moved during it (assigned / revoked) and the
    /// log writer's longest batch in it.
    each_round: String,
}

/// Where a row's runners are.
fn runners_name(over_http: bool) -> &'static str {
    if over_http { "over HTTP" } else { "in process" }
}

impl Row {
    /// The row's first cells in each table: `| queue | replicas | runners |`.
    fn lead(&self) -> String {
        format!(
            "| {} | {} | {} |",
            self.queue,
            self.replicas,
            runners_name(self.over_http)
        )
    }
}

/// Throughput: after a warm-up, producers enqueue as fast as they can for the phase; the clock
/// stops when the last call has finished.
async fn throughput(args: &CallsBenchArgs, s: &Setup) -> Result<Rate> {
    warm_up(s).await?;
    longest_hold_ms(s);
    let clock = Stopwatch::start();
    let cpu = cpu_time()?;
    let requests = s.recorder.requests.now();
    // The broker's pid and its CPU time at the start (on Kafka, with `--broker-pid`).
    let broker = args
        .broker_pid
        .filter(|_| s.kafka.is_some())
        .map(|pid| process_cpu_time(pid).map(|t| (pid, t)))
        .transpose()?;
    let phase = Duration::from_secs(args.seconds);
    let mut producers = Vec::new();
    for p in 0..args.producers {
        let api = s.replicas[p % s.replicas.len()].api;
        let body = enqueue_body(args.batch);
        producers.push(tokio::spawn(async move {
            let client = runner::http_client();
            let clock = Stopwatch::start();
            // Each answer's ids kept as they came: a producer's CPU is counted with ebb's, and
            // one vector of every id grown to hundreds of thousands (moved, its pages faulted in)
            // was about 3 % of a profile of a Kafka row.
            let (mut ids, mut request_ms, mut full) = (Vec::new(), Vec::new(), 0);
            while clock.elapsed() < phase {
                let sent = clock.elapsed();
                let (these, retries) = enqueue_counting(&client, api, &body).await?;
                request_ms.push((clock.elapsed() - sent).as_secs_f64() * 1e3);
                ids.push(these);
                full += retries;
            }
            anyhow::Ok((ids, request_ms, full))
        }));
    }
    let (mut ids, mut request_ms, mut full_retries) = (Vec::new(), Vec::new(), 0);
    for p in producers {
        let (these, ms, full) = p.await??;
        ids.extend(these);
        request_ms.extend(ms);
        full_retries += full;
    }
    request_ms.sort_by(f64::total_cmp);
    drain(s, &ids).await?;
    let longest_hold_ms = longest_hold_ms(s);
    let calls = ids.iter().map(Vec::len).sum::<usize>() as f64;
    let per_call = |d: Duration| d.as_secs_f64() * 1e6 / calls.max(1.0);
    let cpu_us = per_call(cpu_time()? - cpu);
    let broker_us = broker
        .map(|(pid, before)| process_cpu_time(pid).map(|t| per_call(t.saturating_sub(before))))
        .transpose()?;
    Ok(Rate {
        calls_per_s: calls / clock.elapsed().as_secs_f64(),
        cpu_us,
        broker_us,
        request_ms: if request_ms.is_empty() {
            (0.0, 0.0)
        } else {
            (
                super::percentile(&request_ms, 0.50),
                super::percentile(&request_ms, 0.99),
            )
        },
        full_retries,
        longest_hold_ms,
        calls_per_request: {
            let now = s.recorder.requests.now();
            std::array::from_fn(|k| {
                let (r, n) = (now[k].0 - requests[k].0, now[k].1 - requests[k].1);
                n as f64 / r.max(1) as f64
            })
        },
    })
}

/// CPU time process `pid` has spent so far, user and system, every thread's (`/proc/PID/stat`,
/// in clock ticks): the broker's.
fn process_cpu_time(pid: i32) -> Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let field = |n: usize| -> Result<u64> {
        super::stat_field(&stat, n)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{path}: field {n} is not a number"))
    };
    let ticks = field(14)? + field(15)?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .context("sysconf(CLK_TCK)")?
        .filter(|hz| *hz > 0)
        .unwrap_or(100);
    Ok(Duration::from_secs_f64(ticks as f64 / hz as f64))
}

/// CPU time this process has spent so far, user and system, every thread's: ebb's services, its
/// runners and the bench's producers all run in it (the broker does not).
fn cpu_time() -> Result<Duration> {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_SELF).context("getrusage")?;
    let d = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec().max(0) as u64)
            + Duration::from_micros(t.tv_usec().max(0) as u64)
    };
    Ok(d(u.user_time()) + d(u.system_time()))
}

/// The phase whose `key` is the median of `phases` (not empty), and the lowest and highest key.
fn spread<T: Copy>(mut phases: Vec<T>, key: impl Fn(&T) -> f64) -> (T, f64, f64) {
    phases.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let (first, last) = (&phases[0], &phases[phases.len() - 1]);
    (phases[phases.len() / 2], key(first), key(last))
}

/// Calls per enqueue request in the latency phase and the warm-up.
const PER_REQUEST: usize = 10;

/// Warms a setup up before a phase measures it: connections open and, on Kafka, every runner
/// has run a call, so every runner's consumer has joined the group and holds its partitions. A
/// consumer joining later would move partitions under the measurement; and the bare broker's
/// anchor (kafka-consumer-perf-test) leaves its group's join out too. Bounded: a runner that
/// never gets a call is an error.
async fn warm_up(s: &Setup) -> Result<()> {
    let mut rounds = 0;
    let ran = |r: &std::sync::atomic::AtomicBool| r.load(std::sync::atomic::Ordering::Relaxed);
    while rounds == 0 || (s.kafka.is_some() && !s.recorder.ran.iter().all(ran)) {
        rounds += 1;
        anyhow::ensure!(rounds <= 200, "a runner ran no call in 200 warm-up rounds");
        let mut warm = Vec::new();
        for r in &s.replicas {
            warm.extend(enqueue(&runner::http_client(), r.api, &enqueue_body(PER_REQUEST)).await?);
        }
        drain(s, std::slice::from_ref(&warm)).await?;
    }
    Ok(())
}

/// One latency phase: enqueue-to-start p50 and p99 in ms, this process's CPU time per call in
/// us, and the stages on the way as (p50, p99) in ms from the same moment (just before the
/// enqueue request): the enqueue answered, the call handed to a runner by a dequeue.
#[derive(Clone, Copy)]
struct Latency {
    p50: f64,
    p99: f64,
    cpu_us: f64,
    answered: (f64, f64),
    dequeued: (f64, f64),
    /// Partitions the Kafka group's rebalances gave and took from the runners' consumers
    /// during the phase (a call on a partition that moves waits for its next consumer).
    moved: (u64, u64),
    /// The longest any replica's log writer held its projection for one batch in the phase, ms.
    longest_hold_ms: f64,
}

/// The longest any replica's log writer held its projection for one batch since this was last
/// asked, ms; each writer starts over.
fn longest_hold_ms(s: &Setup) -> f64 {
    s.replicas
        .iter()
        .map(|r| r.calls.log().longest_hold().as_secs_f64() * 1e3)
        .fold(0.0, f64::max)
}

/// Partitions given to and taken from the setup's consumers so far, over every replica.
fn partitions_moved(s: &Setup) -> (u64, u64) {
    s.replicas.iter().fold((0, 0), |(a, r), replica| {
        let stats = replica.calls.queue().stats();
        (a + stats.partitions_assigned, r + stats.partitions_revoked)
    })
}

/// Latency at `rate` calls/s: small batches sent on a fixed schedule. At a fixed `--rate` the
/// CPU time per call compares two builds more steadily than a throughput phase's, whose batches
/// grow and shrink with the rate it reaches.
async fn latency(args: &CallsBenchArgs, s: &Setup, rate: f64) -> Result<Latency> {
    warm_up(s).await?;
    let cpu = cpu_time()?;
    let moved_before = partitions_moved(s);
    longest_hold_ms(s);
    // Sized up front: growing the maps under the runners would be the bench's own pause.
    let expected = (rate * args.seconds as f64 * 1.5) as usize;
    *s.recorder.started.lock().expect("recorder lock") = HashMap::with_capacity(expected);
    *s.recorder.dequeued.lock().expect("recorder lock") = HashMap::with_capacity(expected);
    s.recorder
        .timing
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let requests_per_s = (rate / PER_REQUEST as f64).max(1.0);
    let per_producer = requests_per_s / args.producers as f64;
    let interval = Duration::from_secs_f64(1.0 / per_producer);
    let phase = Duration::from_secs(args.seconds);
    let mut producers = Vec::new();
    for p in 0..args.producers {
        let api = s.replicas[p % s.replicas.len()].api;
        let recorder = s.recorder.clone();
        let body = enqueue_body(PER_REQUEST);
        producers.push(tokio::spawn(async move {
            let client = runner::http_client();
            let clock = Stopwatch::start();
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut sent = Vec::new();
            while clock.elapsed() < phase {
                tick.tick().await;
                let at = recorder.clock.elapsed().as_secs_f64();
                let ids = enqueue(&client, api, &body).await?;
                let answered = recorder.clock.elapsed().as_secs_f64();
                for id in ids {
                    sent.push((id, at, answered));
                }
            }
            anyhow::Ok(sent)
        }));
    }
    let mut sent = Vec::new();
    for p in producers {
        sent.extend(p.await??);
    }
    let ids: Vec<String> = sent.iter().map(|(id, _, _)| id.clone()).collect();
    drain(s, std::slice::from_ref(&ids)).await?;
    let cpu_us = (cpu_time()? - cpu).as_secs_f64() * 1e6 / ids.len().max(1) as f64;
    let moved_after = partitions_moved(s);
    let longest_hold_ms = longest_hold_ms(s);
    let moved = (
        moved_after.0 - moved_before.0,
        moved_after.1 - moved_before.1,
    );
    let started = s.recorder.started.lock().expect("recorder lock");
    let dequeued = s.recorder.dequeued.lock().expect("recorder lock");
    let quantiles = |mut ms: Vec<f64>| {
        ms.sort_by(f64::total_cmp);
        (super::percentile(&ms, 0.50), super::percentile(&ms, 0.99))
    };
    let ms: Vec<f64> = sent
        .iter()
        .filter_map(|(id, at, _)| started.get(id).map(|t| (t - at) * 1e3))
        .collect();
    anyhow::ensure!(!ms.is_empty(), "no call started");
    let (p50, p99) = quantiles(ms);
    let answered = quantiles(sent.iter().map(|(_, at, a)| (a - at) * 1e3).collect());
    let dequeued = quantiles(
        sent.iter()
            .filter_map(|(id, at, _)| dequeued.get(id).map(|t| (t - at) * 1e3))
            .collect(),
    );
    Ok(Latency {
        p50,
        p99,
        cpu_us,
        answered,
        dequeued,
        moved,
        longest_hold_ms,
    })
}

/// Stops the runners and the API, so the phase's log and queue close (their RocksDB background
/// work would otherwise go on under the next phase), removes the phase's files, and syncs the
/// file system, so the next phase does not measure this one's writeback.
async fn teardown(s: Setup) {
    let kafka = s.kafka.clone();
    teardown_services(s).await;
    // After the services, whose consumers leave the group as they close.
    if let Some(options) = kafka
        && let Err(e) = ebb::queue::kafka::delete_topic_and_group(&options).await
    {
        eprintln!(
            "ebb bench calls: the Kafka topic {} and group {} stay on the broker: {e}",
            options.topic, options.group
        );
    }
    let _ = tokio::task::spawn_blocking(nix::unistd::sync).await;
}

/// The stopping half of [`teardown`]; the whole `Setup` (its log, queue and files) is gone when it
/// returns.
async fn teardown_services(s: Setup) {
    let _ = s.stop.send(true);
    for r in s.runners {
        let _ = tokio::time::timeout(Duration::from_secs(10), r).await;
    }
    for mut server in s.servers {
        if tokio::time::timeout(Duration::from_secs(10), &mut server)
            .await
            .is_err()
        {
            server.abort();
        }
    }
}

/// One start over HTTP through `api`; returns its latency in ms.
async fn start_one(
    client: &Client<HttpConnector, Full<Bytes>>,
    api: std::net::SocketAddr,
    id: &str,
) -> Result<f64> {
    let clock = Stopwatch::start();
    post(
        client,
        api,
        "/runner/start",
        Bytes::from(json!({ "runner": "direct", "id": id }).to_string()),
    )
    .await?;
    Ok(clock.elapsed().as_secs_f64() * 1e3)
}

/// The cost of a forwarded start: calls owned by one of two replicas started one at a time over
/// HTTP, alternately through their owner and through the other replica (which forwards). Returns
/// ((p50, p99) through the owner, (p50, p99) forwarded) in ms.
async fn start_cost(
    args: &CallsBenchArgs,
    kafka: Option<&str>,
) -> Result<((f64, f64), (f64, f64))> {
    const CALLS: usize = 2_000;
    let quiet = CallsBenchArgs {
        runners: 0,
        ..args.clone()
    };
    let s = setup(&quiet, true, kafka, 2).await?;
    let client = runner::http_client();
    let mut ids = Vec::with_capacity(CALLS);
    let body = enqueue_body(250);
    while ids.len() < CALLS {
        ids.extend(enqueue(&client, s.replicas[0].api, &body).await?);
    }
    let (mut local, mut forwarded) = (Vec::new(), Vec::new());
    for (i, id) in ids.iter().enumerate() {
        // Warm-up: the first of each kind opens its connections.
        if i % 2 == 0 {
            local.push(start_one(&client, s.replicas[0].api, id).await?);
        } else {
            forwarded.push(start_one(&client, s.replicas[1].api, id).await?);
        }
    }
    teardown(s).await;
    let pick = |v: &mut Vec<f64>| {
        v.remove(0);
        v.sort_by(f64::total_cmp);
        let q = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
        (q(0.50), q(0.99))
    };
    Ok((pick(&mut local), pick(&mut forwarded)))
}

/// Runs the benchmark and prints its tables.
pub async fn run(args: CallsBenchArgs) -> Result<()> {
    println!(
        "ebb bench calls: no-op target, {} producers (HTTP, {} calls a request), {} runners x {} capacity, {} s phases",
        args.producers, args.batch, args.runners, args.capacity, args.seconds
    );
    println!(
        "| queue | replicas | runners | calls/s end to end (range) | CPU per call | broker CPU per call | enqueue-to-start p50 | p99 | CPU per call at that rate |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    if !args.kafka_only {
        rows.push(("embedded", None, 1, false));
        rows.push(("embedded", None, 1, true));
    }
    if let Some(k) = &args.kafka {
        rows.push(("kafka", Some(k.as_str()), 1, false));
        rows.push(("kafka", Some(k.as_str()), 1, true));
        rows.push(("kafka", Some(k.as_str()), 2, true));
    }
    if let Some(k) = &args.kafka {
        // One throughput phase on Kafka, not measured, before the rows: the broker's JIT has not
        // compiled the requests ebb sends (consumer groups, offset commits, keyed idempotent
        // produces) until then, and the first Kafka row would pay for it. Measured: the broker's
        // CPU per call 17-34 us in a fresh broker's first phases, 4-6 us after a dozen; one phase
        // takes part of that off (9.2 us in the first row of `benches/calls.sh 5`), not all.
        let s = setup(&args, false, Some(k.as_str()), 1).await?;
        throughput(&args, &s).await?;
        teardown(s).await;
    }
    let mut measured = Vec::new();
    for (queue, kafka, replicas, over_http) in rows {
        // Each phase on a fresh log and queue, so one does not pay for the other's
        // compactions; `--rounds` of each, since one phase moves by a third between runs on a
        // 2-core machine shared with the broker. A throughput phase's CPU per call is reported
        // with its calls/s.
        let mut rates = Vec::new();
        for _ in 0..args.rounds.max(1) {
            let s = setup(&args, over_http, kafka, replicas).await?;
            rates.push(throughput(&args, &s).await?);
            teardown(s).await;
        }
        let (phase, rate_lo, rate_hi) = spread(rates, |r| r.calls_per_s);
        let Rate {
            calls_per_s: rate,
            cpu_us,
            broker_us,
            ..
        } = phase;
        let at = args.rate.unwrap_or(rate / 2.0);
        let mut latencies = Vec::new();
        for _ in 0..args.rounds.max(1) {
            let s = setup(&args, over_http, kafka, replicas).await?;
            latencies.push(latency(&args, &s, at).await?);
            teardown(s).await;
        }
        let rounds = latencies.len();
        let each_round = latencies
            .iter()
            .map(|l| {
                let moved = match kafka {
                    Some(_) => format!("{} / {}", l.moved.0, l.moved.1),
                    None => "-".into(),
                };
                format!("{:.2} ms: {moved}, {:.1} ms", l.p99, l.longest_hold_ms)
            })
            .collect::<Vec<_>>()
            .join("; ");
        let (median, lo, hi) = spread(latencies.clone(), |l| l.p99);
        let p99 = median.p99;
        let (Latency { p50, .. }, _, _) = spread(latencies.clone(), |l| l.p50);
        let (
            Latency {
                cpu_us: fixed_us, ..
            },
            fixed_lo,
            fixed_hi,
        ) = spread(latencies, |l| l.cpu_us);
        let name = runners_name(over_http);
        let broker = broker_us.map_or("-".to_owned(), |b| format!("{b:.1} us"));
        println!(
            "| {queue} | {replicas} | {name} | {rate:.0} ({rate_lo:.0}-{rate_hi:.0}) | {cpu_us:.1} us | {broker} | {p50:.2} ms | {p99:.2} ms (at {at:.0}/s; {rounds} rounds: {lo:.2}-{hi:.2}) | {fixed_us:.1} us ({fixed_lo:.1}-{fixed_hi:.1}) |"
        );
        measured.push(Row {
            queue,
            replicas,
            over_http,
            phase,
            p50,
            stages: median,
            each_round,
        });
    }
    println!();
    println!(
        "where enqueue-to-start goes, in the latency round with the median p99: each stage's time from just before the enqueue request"
    );
    println!(
        "| queue | replicas | runners | enqueue answered p50 / p99 | handed to a runner p50 / p99 | started p50 / p99 | each round's p99: partitions moved during it (assigned / revoked), the log writer's longest batch |"
    );
    println!("|---|---|---|---|---|---|---|");
    for m in &measured {
        let l = m.stages;
        println!(
            "{} {:.2} / {:.2} ms | {:.2} / {:.2} ms | {:.2} / {:.2} ms | {} |",
            m.lead(),
            l.answered.0,
            l.answered.1,
            l.dequeued.0,
            l.dequeued.1,
            l.p50,
            l.p99,
            m.each_round
        );
    }
    println!();
    println!(
        "what bounds the throughput, in the round with the median calls/s: each producer sends its next request once one is answered"
    );
    println!(
        "| queue | replicas | runners | enqueue request ({} calls) answered p50 / p99 | {} producers x {} calls / p50 | requests sent again after a full queue | the log writer's longest batch | calls a runner's dequeue / start / finish |",
        args.batch, args.producers, args.batch
    );
    println!("|---|---|---|---|---|---|---|---|");
    for m in &measured {
        let Rate {
            request_ms: (p50, p99),
            full_retries,
            longest_hold_ms,
            calls_per_request: [dequeue, start, finish],
            ..
        } = m.phase;
        println!(
            "{} {p50:.2} / {p99:.2} ms | {:.0} calls/s | {full_retries} | {longest_hold_ms:.2} ms | {dequeue:.1} / {start:.1} / {finish:.1} |",
            m.lead(),
            (args.producers * args.batch) as f64 / (p50 / 1e3)
        );
    }
    let row = |q: &str, r: usize, over_http: bool| {
        measured
            .iter()
            .find(|m| m.queue == q && m.replicas == r && m.over_http == over_http)
    };
    if let (Some(one), Some(two)) = (row("kafka", 1, true), row("kafka", 2, true)) {
        println!(
            "kafka, 2 replicas / 1 replica (over HTTP): calls/s {:.2}x, enqueue-to-start p50 {:.2}x, p99 {:.2}x",
            two.phase.calls_per_s / one.phase.calls_per_s,
            two.p50 / one.p50,
            two.stages.p99 / one.stages.p99
        );
    }
    if let Some(anchor) = args.anchor {
        for m in measured.iter().filter(|m| m.queue == "kafka") {
            println!(
                "kafka, {} replica(s), {} / the bare broker's produce-and-consume rate ({anchor:.0}/s): {:.2}x",
                m.replicas,
                runners_name(m.over_http),
                m.phase.calls_per_s / anchor
            );
        }
        // What half the anchor's rate leaves per call on this machine, where the broker, ebb and
        // the producers share the cores, against what the in-process row spent.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let budget_us = cores as f64 * 1e6 / (anchor / 2.0);
        if let Some(Rate {
            cpu_us: ebb_us,
            broker_us: Some(broker_us),
            ..
        }) = row("kafka", 1, false).map(|m| m.phase)
        {
            println!(
                "at 0.5x the bare broker ({:.0} calls/s), {cores} cores leave {budget_us:.1} us of CPU per call to ebb, its producers and the broker together; \
                 1 replica, in process, spent {:.1} us ({ebb_us:.1} us in this process, {broker_us:.1} us in the broker's): {:.2}x the budget",
                anchor / 2.0,
                ebb_us + broker_us,
                (ebb_us + broker_us) / budget_us
            );
        }
    }
    let (queue, kafka) = match &args.kafka {
        Some(k) => ("kafka", Some(k.as_str())),
        None => ("embedded", None),
    };
    let ((lp50, lp99), (fp50, fp99)) = start_cost(&args, kafka).await?;
    println!();
    println!("| start of one call over HTTP ({queue}, 2 replicas) | p50 | p99 |");
    println!("|---|---|---|");
    println!("| through its owner | {lp50:.3} ms | {lp99:.3} ms |");
    println!("| through the other replica (forwarded) | {fp50:.3} ms | {fp99:.3} ms |");
    println!(
        "forwarded / through the owner: p50 {:.2}x, p99 {:.2}x",
        fp50 / lp50,
        fp99 / lp99
    );
    Ok(())
}
