//! The `ebb` command line: `serve`, and the tools that read the log (`log`, `replay`, `explain`),
//! plus `bench`. Errors are one line on stderr and a non-zero exit.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use ebb::clock::SystemClock;
use ebb::event::{Envelope, Event};
use ebb::log::rocks::OpenMode;
use ebb::log::{Durability, Log, LogStore, Options, RocksStore, open_state};
use ebb::state::State;
use ebb::tools::{self, ExplainKind};

/// mimalloc instead of the system allocator: replay decodes on one thread and frees on another,
/// and glibc's allocator spends a fifth of the replay there (see `ebb bench log`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "ebb",
    version,
    about = "Serverless HTTP workloads and functions on one event log",
    args_override_self = true
)]
struct Cli {
    #[command(flatten)]
    data: DataDir,
    /// How ebb's own log lines (stderr) are written: `text` for people, `json` (one object per
    /// line, with the spans' fields such as a request's id) for a log collector.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "EBB_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Clone)]
struct DataDir {
    /// The data directory holding ebb's log.
    #[arg(
        long,
        global = true,
        env = "EBB_DATA_DIR",
        default_value = "./ebb-data",
        value_name = "DIR"
    )]
    data_dir: PathBuf,
}

// Parsed once per run: the size of `serve`'s flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run ebb: open (or create) the log, start the apps' workloads on demand, and proxy HTTP to
    /// them by Host.
    Serve {
        /// The apps to serve (`ebb.toml`).
        #[arg(long, env = "EBB_CONFIG")]
        config: Option<PathBuf>,
        /// Address of the proxy.
        #[arg(long, default_value = "127.0.0.1:8080", env = "EBB_LISTEN")]
        listen: SocketAddr,
        /// Address of ebb's own endpoints (`/healthz`).
        #[arg(long, default_value = "127.0.0.1:8081", env = "EBB_ADMIN_LISTEN")]
        admin_listen: SocketAddr,
        /// Sync every acknowledged append to disk, or leave flushing to the OS.
        #[arg(long, value_enum, default_value_t = Durability::Sync)]
        durability: Durability,
        /// Bearer token for the admin API (`/admin/routes`); without one it is disabled.
        #[arg(long, env = "EBB_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: Option<String>,
        /// How often request counts are flushed to the log, in milliseconds.
        #[arg(long, default_value_t = 1_000)]
        flush_interval_ms: u64,
        /// Proxy threads (default: one per core).
        #[arg(long, env = "EBB_PROXY_THREADS")]
        proxy_threads: Option<usize>,
        /// Bearer token for the runner API (`/runner/*`, `/v1/calls`); without one it is disabled.
        #[arg(long, env = "EBB_RUNNER_TOKEN", hide_env_values = true)]
        runner_token: Option<String>,
        /// Bearer token for the functions API (`/api/funcs`); without one it is disabled.
        #[arg(long, env = "EBB_API_TOKEN", hide_env_values = true)]
        api_token: Option<String>,
        /// Token that signs in to the dashboard (`/ui`, read-only); without one the admin token
        /// does.
        #[arg(long, env = "EBB_DASHBOARD_TOKEN", hide_env_values = true)]
        dashboard_token: Option<String>,
        /// On Kubernetes: a bearer token that is none of the above is checked with a TokenReview,
        /// and the request allowed if RBAC (a SubjectAccessReview) lets its user do the verb on
        /// the API's resource (`admin`, `dashboard`, `functions`, `runner`) of group
        /// `api.ebb.dev` in ebb's namespace. An API without a token of its own is then open to
        /// those users only.
        #[arg(long, env = "EBB_KUBE_AUTH")]
        kube_auth: bool,
        /// With --kube-auth: the audiences a token must be for, comma-separated (default: the
        /// API server's own).
        #[arg(long, env = "EBB_KUBE_AUTH_AUDIENCES", value_delimiter = ',')]
        kube_auth_audiences: Vec<String>,
        /// With --kube-auth: how long Kubernetes' answer about a token is kept, in seconds (a
        /// grant or a revocation counts within that).
        #[arg(long, env = "EBB_KUBE_AUTH_CACHE_SECONDS", default_value_t = 10,
              value_parser = clap::value_parser!(u64).range(0..=3600))]
        kube_auth_cache_seconds: u64,
        /// Calls the built-in runner runs at once (0: none; external runners only).
        #[arg(long, default_value_t = 64)]
        runner_capacity: usize,
        /// The `helm` program Cleaners uninstall releases with (Kubernetes; without it a Cleaner
        /// that asks for a release's uninstall cannot complete its firing).
        #[arg(long, env = "EBB_CLEANER_HELM")]
        cleaner_helm: Option<PathBuf>,
        /// The DNS server (IP:port) that resolves meta services' destinations named by host name
        /// (default: the system's, from /etc/resolv.conf).
        #[arg(long, env = "EBB_DNS_SERVER")]
        dns_server: Option<std::net::SocketAddr>,
        /// Seeds the load balancers' random choices (each proxy thread's generator comes from it
        /// and the thread's number): the same seed, the same picks (default: a random seed).
        #[arg(long, env = "EBB_BALANCE_SEED")]
        balance_seed: Option<u64>,
        /// How long a runner may keep a call it did not start before it is redelivered, in ms.
        #[arg(long, default_value_t = 30_000)]
        visibility_timeout_ms: u64,
        /// A runner not heard from for this long is gone and its calls go to others, in ms.
        #[arg(long, default_value_t = 15_000)]
        runner_lease_ms: u64,
        /// The most calls the queue holds.
        #[arg(long, default_value_t = 1_000_000)]
        max_queued: usize,
        /// How long an ended call or function instance stays readable through the API, in ms (its
        /// events stay in the log).
        #[arg(long, default_value_t = 3_600_000)]
        call_retention_ms: u64,
        /// The function autoscaler's period, in ms.
        #[arg(long, default_value_t = 1_000)]
        fn_period_ms: u64,
        /// How much a function's call counter decays each period.
        #[arg(long, default_value_t = 2)]
        fn_counter_decay: u64,
        /// The most a function's call counter holds.
        #[arg(long, default_value_t = 1_000)]
        fn_counter_cap: u64,
        /// Counter units one function instance is for.
        #[arg(long, default_value_t = 10)]
        fn_target_per_instance: u64,
        /// A function goes to zero instances only this long after its last call, in ms.
        #[arg(long, default_value_t = 30_000)]
        fn_zero_after_ms: u64,
        /// Put calls on Kafka (`bootstrap.servers`) instead of the embedded queue.
        #[arg(long, env = "EBB_KAFKA_BROKERS")]
        kafka_brokers: Option<String>,
        /// The Kafka topic of calls.
        #[arg(long, default_value = "ebb-calls")]
        kafka_topic: String,
        /// Partitions of the Kafka topic when ebb creates it.
        #[arg(long, default_value_t = 8)]
        kafka_partitions: i32,
        /// What runs the workloads: local processes, or Kubernetes (routes from annotated
        /// Services, replicas through `/scale`, addresses from EndpointSlices; the client is
        /// configured from `KUBECONFIG` or the pod's service account).
        #[arg(long, value_enum, default_value_t = Backend::Process, env = "EBB_ORCHESTRATOR")]
        orchestrator: Backend,
        /// On Kubernetes: watch this namespace only (default: all namespaces).
        #[arg(long, env = "NAMESPACE")]
        namespace: Option<String>,
        /// On Kubernetes: where function templates with an image get their Deployment and
        /// Service (default: the watched namespace, else ebb's own).
        #[arg(long, env = "EBB_FUNCTIONS_NAMESPACE")]
        functions_namespace: Option<String>,
        /// On Kubernetes: how often each workload's replicas are read back, in ms.
        #[arg(long, default_value_t = 10_000)]
        kube_sync_ms: u64,
        /// On Kubernetes: API requests per second at most (watches excepted).
        #[arg(long, default_value_t = 20)]
        kube_qps: u32,
        /// On Kubernetes: this replica's name, for the lease and ebb's Events (the pod's name).
        #[arg(long, env = "POD_NAME", default_value = "ebb")]
        pod_name: String,
        /// On Kubernetes: the namespace of ebb's own Lease (the pod's namespace).
        #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
        pod_namespace: String,
        /// On Kubernetes: how long the scale-down lease lasts, in ms.
        #[arg(long, default_value_t = 15_000)]
        kube_lease_ms: u64,
        /// On Kubernetes: a replica keeps a workload's last-used annotation this close to its
        /// own traffic, in ms.
        #[arg(long, default_value_t = 5_000)]
        kube_touch_ms: u64,
        /// On Kubernetes: the most two ebb replicas' clocks differ by, in ms.
        #[arg(long, default_value_t = 500)]
        kube_max_skew_ms: u64,
        /// This replica's name, when several ebb share calls (a Kafka queue) and functions: the
        /// ids of the calls and instances it accepts carry it (`NAME.UUID`), and other replicas
        /// forward what concerns them here. On Kubernetes, the StatefulSet pod's name.
        #[arg(long, env = "EBB_REPLICA")]
        replica: Option<String>,
        /// Another replica's admin listener, as NAME=ID (a service id: `http://HOST:PORT`, a DNS
        /// name, `k8s://...`); repeat for each. On Kubernetes without it, replicas are found
        /// through --peer-service.
        #[arg(long = "peer", env = "EBB_PEERS", value_delimiter = ',')]
        peers: Vec<String>,
        /// On Kubernetes: the headless Service whose endpoints are ebb's replicas: a name in ebb's
        /// own namespace, on the port of this replica's admin listener, or
        /// `k8s://SERVICE.NAMESPACE[:PORT]`. Replica NAME is its endpoint of hostname NAME.
        #[arg(long, default_value = "ebb-headless")]
        peer_service: String,
        /// Routes with a `route` label of their own in /metrics, at most; the rest are summed
        /// under route="_other".
        #[arg(long, default_value_t = ebb::metrics::DEFAULT_MAX_ROUTES)]
        metrics_max_routes: usize,
        /// At shutdown (SIGTERM, Ctrl-C): how long requests under way and held requests may
        /// take to be answered after ebb stops accepting connections; the rest are then cut.
        #[arg(long, default_value_t = 30_000)]
        drain_timeout_ms: u64,
        /// Test hook: before each scale-down write, create `held` in this directory and wait
        /// for `release` there.
        #[arg(long, hide = true, env = "EBB_TEST_DOWNSCALE_GATE")]
        downscale_gate: Option<PathBuf>,
        /// Serve the proxy over TLS with this certificate chain (PEM), read again when it
        /// changes; with --tls-key.
        #[arg(long, env = "EBB_TLS_CERT", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The proxy's TLS private key (PEM: PKCS#8, PKCS#1 or SEC1); with --tls-cert.
        #[arg(long, env = "EBB_TLS_KEY", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Serve ebb's own endpoints (the admin, runner and functions APIs, the dashboard,
        /// /metrics) over TLS with this certificate chain (PEM); with --admin-tls-key.
        #[arg(long, env = "EBB_ADMIN_TLS_CERT", requires = "admin_tls_key")]
        admin_tls_cert: Option<PathBuf>,
        /// Their TLS private key (PEM); with --admin-tls-cert.
        #[arg(long, env = "EBB_ADMIN_TLS_KEY", requires = "admin_tls_cert")]
        admin_tls_key: Option<PathBuf>,
        /// A snapshot of the projections every this many events, and the events before the
        /// snapshot before the newest deleted, so the log stays bounded (0: neither).
        #[arg(long, env = "EBB_SNAPSHOT_EVERY_EVENTS", default_value_t = 1_000_000)]
        snapshot_every_events: u64,
        #[command(flatten)]
        limits: ebb::limits::Limits,
    },
    /// Run calls from a remote ebb: dequeue, start, execute through ebb's proxy, finish.
    Runner {
        /// The ebb API (its admin listener) as a service id: http://127.0.0.1:8081, a DNS name
        /// of every replica, k8s://ebb.NAMESPACE:8081. The runner keeps to one replica while it
        /// is there (consistent hashing on --id).
        #[arg(long, env = "EBB_API")]
        api: String,
        /// The runner token.
        #[arg(long, env = "EBB_RUNNER_TOKEN", hide_env_values = true)]
        token: String,
        /// This runner's id (its queue partition).
        #[arg(long, default_value = "runner")]
        id: String,
        /// Calls run at once.
        #[arg(long, default_value_t = 64)]
        capacity: usize,
        /// The ebb proxy the calls' requests go through.
        #[arg(long, default_value = "127.0.0.1:8080")]
        proxy: SocketAddr,
        /// Finish every call at once without running it (for measuring the queue).
        #[arg(long, hide = true)]
        noop: bool,
        /// Fault injection for tests: SIGKILL this runner at a point of a call's life.
        #[arg(long, hide = true, value_enum)]
        fault: Option<ebb::calls::runner::Fault>,
    },
    /// Inspect the log.
    #[command(subcommand)]
    Log(LogCommand),
    /// Print the state the projections had at a point of the log (default: its end).
    Replay {
        /// Replay up to and including this seq.
        #[arg(long, conflicts_with = "at")]
        until: Option<u64>,
        /// Replay every event that happened at or before this time (RFC 3339).
        #[arg(long)]
        at: Option<String>,
        /// Print the whole state as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the events that shaped an object, and the object as it is now.
    Explain {
        /// What kind of object.
        #[arg(value_enum)]
        kind: ExplainKind,
        /// Its name or id.
        id: String,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Measure ebb on this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Run the deterministic simulator: scenarios (files or directories; default `simulations/`)
    /// over many seeds, checking ebb's invariants after every step.
    Simulate {
        /// Scenario files or directories of them.
        scenarios: Vec<PathBuf>,
        /// Seeds per scenario (0, 1, ... unless --first-seed says otherwise).
        #[arg(long, default_value_t = 200, conflicts_with = "seed")]
        seeds: u64,
        /// The first seed of --seeds.
        #[arg(long, default_value_t = 0)]
        first_seed: u64,
        /// Run only this seed and print its trace (to replay a violation).
        #[arg(long)]
        seed: Option<u64>,
        /// Keep only these fault kinds (comma-separated: api-errors, pauses, replica-crash,
        /// torn-writes, runner-crash, lost-replies, duplicates, skew, rebalances; or none).
        #[arg(long)]
        faults: Option<String>,
        /// Threads (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// Switch on a deliberately broken decision (to show the simulator finds it).
        #[arg(long, hide = true)]
        mutation: Option<String>,
    },
    /// A small HTTP app for demos, tests and benchmarks (echo, /sleep, /bytes, /ws, /health).
    ExampleApp(ebb::example_app::ExampleAppArgs),
    /// The custom resource definitions of ebb's Kubernetes API, generated from its types: each
    /// as `NAME.json` in --out (what deploy/ holds), or all on stdout.
    Crds {
        /// Write one file per definition into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Test helpers.
    #[command(subcommand, hide = true)]
    Debug(DebugCommand),
}

/// What runs the workloads of `ebb serve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Backend {
    /// Local processes, started from `ebb.toml` and the admin API.
    Process,
    /// Kubernetes Deployments and StatefulSets behind annotated Services.
    Kubernetes,
}

#[derive(Subcommand)]
enum LogCommand {
    /// Counts, seq range, times, snapshots and event types.
    Stats {
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print events.
    Dump {
        /// First seq to print.
        #[arg(long, default_value_t = 1)]
        from: u64,
        /// Last seq to print.
        #[arg(long)]
        to: Option<u64>,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print events as they are appended (also while `ebb serve` runs).
    Tail {
        /// Start at this seq (default: only events appended from now on).
        #[arg(long)]
        from: Option<u64>,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
        /// How often to look for new events, in milliseconds.
        #[arg(long, default_value_t = 200)]
        poll_ms: u64,
    },
    /// Take a snapshot of the projections now (ebb must not be running).
    Snapshot,
    /// Delete the events older than the newest snapshot (ebb must not be running).
    Compact,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Append throughput, replay speed and open time of the log.
    Log(ebb::bench::LogBenchArgs),
    /// Cold-start overhead of the proxy: first byte for a workload at zero vs the app's own start.
    ColdStart(ebb::bench::ColdStartArgs),
    /// Durable calls end to end: calls/s and enqueue-to-start latency through the runner API.
    Calls(ebb::bench::calls::CallsBenchArgs),
    /// Function instances end to end: instances/s (one step, three-step chain), POST to result.
    Functions(ebb::bench::functions::FunctionsBenchArgs),
    /// Cleaners: the schedule of 100,000, CEL evaluations/s of the proposal's condition, and the
    /// loop's lateness against its planned times, each against an anchor.
    Cleaners(ebb::bench::cleaners::CleanersBenchArgs),
    /// Load balancing: ns per pick of each balancer over 3 to 10,000 instances, against one
    /// random index; the slow-replica experiment, peak EWMA and round robin against all healthy.
    Discovery(ebb::bench::discovery::DiscoveryBenchArgs),
}

#[derive(Subcommand)]
enum DebugCommand {
    /// Run one workload with the process orchestrator, print its ready addresses, and keep it
    /// running until killed.
    RunWorkload {
        /// Replicas to run.
        #[arg(long, default_value_t = 1)]
        replicas: u32,
        /// Where replica logs go.
        #[arg(long)]
        log_dir: PathBuf,
        /// The command (after `--`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Append as fast as possible, printing every acknowledged seq on its own line.
    AppendStress {
        /// Concurrent appenders.
        #[arg(long, default_value_t = 64)]
        appenders: usize,
        /// Stop after this many acknowledged appends (default: never).
        #[arg(long)]
        count: Option<u64>,
    },
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("EBB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let lines = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => lines.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => lines
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
    if let Err(e) = run(cli) {
        if is_broken_pipe(&e) {
            std::process::exit(0);
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = std::env::var("EBB_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        b.worker_threads(n.max(1));
    }
    b.enable_all().build().context("starting the async runtime")
}

/// `--peer NAME=ID`: a replica name and its service id (`http://HOST:PORT`, `HOST:PORT`, a
/// `k8s://` id).
fn parse_peer(p: &str) -> Result<(String, ebb::discovery::ServiceId)> {
    let (name, id) = p
        .split_once('=')
        .with_context(|| format!("--peer {p:?}: give NAME=ID, e.g. ebb-1=http://10.0.0.2:8081"))?;
    ebb::functions::check_name("replica", name).map_err(anyhow::Error::msg)?;
    let id = ebb::discovery::ServiceId::parse_address(id)
        .map_err(|e| anyhow::anyhow!("--peer {p:?}: {e}"))?;
    if matches!(id.scheme(), "https" | "ws" | "wss") {
        anyhow::bail!("--peer {p:?}: replicas speak plain HTTP to each other (http://HOST:PORT)");
    }
    Ok((name.to_owned(), id))
}

fn run(cli: Cli) -> Result<()> {
    let dir = cli.data.data_dir;
    match cli.command {
        Command::Serve {
            config,
            listen,
            admin_listen,
            durability,
            admin_token,
            flush_interval_ms,
            proxy_threads,
            runner_token,
            api_token,
            dashboard_token,
            kube_auth,
            kube_auth_audiences,
            kube_auth_cache_seconds,
            runner_capacity,
            cleaner_helm,
            dns_server,
            balance_seed,
            visibility_timeout_ms,
            runner_lease_ms,
            max_queued,
            call_retention_ms,
            fn_period_ms,
            fn_counter_decay,
            fn_counter_cap,
            fn_target_per_instance,
            fn_zero_after_ms,
            kafka_brokers,
            kafka_topic,
            kafka_partitions,
            orchestrator,
            namespace,
            functions_namespace,
            kube_sync_ms,
            kube_qps,
            pod_name,
            pod_namespace,
            kube_lease_ms,
            kube_touch_ms,
            kube_max_skew_ms,
            replica,
            peers,
            peer_service,
            metrics_max_routes,
            drain_timeout_ms,
            downscale_gate,
            tls_cert,
            tls_key,
            admin_tls_cert,
            admin_tls_key,
            snapshot_every_events,
            limits,
        } => {
            limits.check().map_err(anyhow::Error::msg)?;
            if kube_auth && orchestrator != Backend::Kubernetes {
                anyhow::bail!(
                    "--kube-auth checks tokens with Kubernetes: it needs --orchestrator kubernetes"
                );
            }
            if let Some(seed) = balance_seed {
                ebb::discovery::set_seed(seed);
            }
            serve(
                ebb::serve::ServeOptions {
                    data_dir: dir.clone(),
                    limits,
                    snapshot_every_events,
                    tls: tls_cert.zip(tls_key),
                    admin_tls: admin_tls_cert.zip(admin_tls_key),
                    config,
                    listen,
                    admin_listen,
                    admin_token,
                    runner_token,
                    api_token,
                    dashboard_token,
                    kube_auth: kube_auth.then(|| ebb::api::access::KubeAuthOptions {
                        audiences: kube_auth_audiences,
                        cache: std::time::Duration::from_secs(kube_auth_cache_seconds),
                    }),
                    runner_capacity,
                    cleaner_helm,
                    dns_server,
                    calls: ebb::calls::CallOptions {
                        runner_lease_ms,
                        retention_ms: call_retention_ms,
                        forget_every_ms: call_retention_ms.clamp(1, 60_000),
                        max_queued_per_target: limits.max_queued_per_target,
                        ..ebb::calls::CallOptions::default()
                    },
                    functions: ebb::functions::Autoscale {
                        period_ms: fn_period_ms,
                        decay: fn_counter_decay,
                        cap: fn_counter_cap,
                        target_per_instance: fn_target_per_instance,
                        zero_after_ms: fn_zero_after_ms,
                    },
                    queue: ebb::queue::embedded::EmbeddedOptions {
                        visibility_timeout_ms,
                        max_messages: max_queued,
                        ..ebb::queue::embedded::EmbeddedOptions::default()
                    },
                    kafka: kafka_brokers.map(|brokers| ebb::queue::kafka::KafkaOptions {
                        brokers,
                        topic: kafka_topic,
                        partitions: kafka_partitions,
                        visibility_timeout_ms,
                        max_out: max_queued,
                        ..ebb::queue::kafka::KafkaOptions::default()
                    }),
                    kubernetes: (orchestrator == Backend::Kubernetes).then(|| {
                        ebb::orchestrator::kube::KubeOptions {
                            functions_namespace: functions_namespace
                                .or_else(|| namespace.clone())
                                .unwrap_or_else(|| pod_namespace.clone()),
                            namespace,
                            sync_interval_ms: kube_sync_ms,
                            instance: pod_name,
                            api_qps: kube_qps,
                            api_burst: kube_qps.saturating_mul(2),
                            shared: ebb::orchestrator::kube::SharedScaling {
                                options: ebb::orchestrator::kube::SharedScaling::timing(
                                    kube_touch_ms,
                                    kube_lease_ms,
                                    kube_max_skew_ms,
                                ),
                                lease_namespace: pod_namespace,
                                gate: downscale_gate,
                                ..Default::default()
                            },
                            ..Default::default()
                        }
                    }),
                    replica: replica
                        .map(|r| {
                            ebb::functions::check_name("replica", &r)
                                .map(|()| r)
                                .map_err(anyhow::Error::msg)
                        })
                        .transpose()?,
                    peers: peers.iter().map(|p| parse_peer(p)).collect::<Result<_>>()?,
                    peer_service,
                    metrics_max_routes,
                    drain_timeout_ms,
                    proxy_threads: proxy_threads.unwrap_or_else(|| {
                        std::thread::available_parallelism().map_or(2, |n| n.get())
                    }),
                    runtime: ebb::proxy::runtime::RuntimeOptions {
                        flush_interval_ms,
                        ..Default::default()
                    },
                },
                durability,
            )
        }
        Command::Log(cmd) => log_command(&dir, cmd),
        Command::Replay { until, at, json } => replay(&dir, until, at, json),
        Command::Explain { kind, id, json } => explain(&dir, kind, &id, json),
        Command::Bench(BenchCommand::Log(args)) => runtime()?.block_on(ebb::bench::log(args)),
        Command::Bench(BenchCommand::Calls(args)) => {
            runtime()?.block_on(ebb::bench::calls::run(args))
        }
        Command::Bench(BenchCommand::Discovery(args)) => {
            runtime()?.block_on(ebb::bench::discovery::run(args))
        }
        Command::Bench(BenchCommand::Cleaners(args)) => {
            runtime()?.block_on(ebb::bench::cleaners::run(args))
        }
        Command::Bench(BenchCommand::Functions(args)) => {
            runtime()?.block_on(ebb::bench::functions::run(args))
        }
        Command::Bench(BenchCommand::ColdStart(args)) => {
            runtime()?.block_on(ebb::bench::cold_start(args))
        }
        Command::ExampleApp(args) => runtime()?.block_on(ebb::example_app::run(args)),
        Command::Crds { out } => crds(out.as_deref()),
        Command::Simulate {
            scenarios,
            seeds,
            first_seed,
            seed,
            faults,
            threads,
            mutation,
        } => simulate(
            scenarios, seeds, first_seed, seed, faults, threads, mutation,
        ),
        Command::Runner {
            api,
            token,
            id,
            capacity,
            proxy,
            noop,
            fault,
        } => runtime()?.block_on(run_runner(api, token, id, capacity, proxy, noop, fault)),
        Command::Debug(DebugCommand::AppendStress { appenders, count }) => {
            append_stress(&dir, appenders, count)
        }
        Command::Debug(DebugCommand::RunWorkload {
            replicas,
            log_dir,
            command,
        }) => runtime()?.block_on(run_workload(replicas, log_dir, command)),
    }
}

/// `ebb simulate`.
fn simulate(
    scenarios: Vec<PathBuf>,
    seeds: u64,
    first_seed: u64,
    seed: Option<u64>,
    faults: Option<String>,
    threads: Option<usize>,
    mutation: Option<String>,
) -> Result<()> {
    let mutation = match mutation.as_deref() {
        None => None,
        Some(m) => Some(ebb::mutation::Mutation::parse(m).with_context(|| {
            let names: Vec<&str> = ebb::mutation::Mutation::ALL
                .iter()
                .map(|m| m.name())
                .collect();
            format!(
                "unknown mutation {m:?}; the mutations are {}",
                names.join(", ")
            )
        })?),
    };
    let on = match faults.as_deref() {
        Some(f) => Some(ebb::sim::parse_faults(f).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let paths = if scenarios.is_empty() {
        vec![PathBuf::from("simulations")]
    } else {
        scenarios
    };
    let scenarios = ebb::sim::load(&paths, on.as_ref()).map_err(anyhow::Error::msg)?;
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    if let Some(seed) = seed {
        let mut failed = false;
        for sc in &scenarios {
            let out = ebb::sim::run(sc, seed, mutation);
            for line in &out.trace {
                println!("{line}");
            }
            println!(
                "{}: seed {seed}: {} steps, {:.1} s simulated, trace hash {:016x}",
                sc.name,
                out.stats.steps,
                out.sim_ms as f64 / 1e3,
                out.hash
            );
            if let Some(v) = &out.violation {
                println!("VIOLATION {}: {}", v.invariant, v.detail);
                failed = true;
            }
        }
        anyhow::ensure!(!failed, "an invariant was violated");
        return Ok(());
    }
    anyhow::ensure!(seeds > 0, "--seeds must be at least 1");
    let list: Vec<u64> = (first_seed..first_seed.saturating_add(seeds)).collect();
    let pb = if std::io::stderr().is_terminal() {
        let pb = ProgressBar::new(list.len() as u64 * scenarios.len() as u64);
        pb.set_style(
            ProgressStyle::with_template(
                "simulating [{bar:40}] {pos}/{len} seeds ({per_sec}, {eta})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    let clock = ebb::clock::Stopwatch::start();
    let (totals, found) = ebb::sim::search(&scenarios, &list, mutation, threads, &|| pb.inc(1));
    pb.finish_and_clear();
    let wall = clock.elapsed().as_secs_f64().max(1e-9);
    let names: Vec<&str> = scenarios.iter().map(|s| s.name.as_str()).collect();
    println!(
        "{} seeds over {} ({}) in {wall:.1} s on {threads} threads: {:.0} seeds/s, {:.0} simulated s per wall s, {} steps",
        totals.seeds,
        if names.len() == 1 {
            "1 scenario".to_owned()
        } else {
            format!("{} scenarios", names.len())
        },
        names.join(", "),
        totals.seeds as f64 / wall,
        totals.sim_ms as f64 / 1e3 / wall,
        totals.steps
    );
    let Some(f) = found else {
        println!("no invariant violated");
        return Ok(());
    };
    let v = f.outcome.violation.as_ref().expect("a violation");
    println!(
        "\nVIOLATION of {} in {} seed {} at {} ms:",
        v.invariant, f.scenario, f.seed, v.at_ms
    );
    println!("  {}", v.detail);
    println!("\ntrace (last {} lines):", f.outcome.trace.len());
    for line in &f.outcome.trace {
        println!("  {line}");
    }
    let path = scenarios
        .iter()
        .find(|s| s.name == f.scenario)
        .map(|s| s.path.clone())
        .unwrap_or_default();
    println!(
        "\nreplay: {}",
        ebb::sim::replay_command(&path, f.seed, faults.as_deref(), mutation)
    );
    anyhow::bail!("invariant {} violated", v.invariant)
}

/// A progress bar on a terminal; nothing when stderr is piped.
fn progress(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() || len < ebb::log::replay::PROGRESS_EVERY {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} events ({per_sec}, {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_owned());
    pb
}

fn open_reader(dir: &Path) -> Result<RocksStore> {
    Ok(RocksStore::open(dir, OpenMode::ReadOnly)?)
}

fn open_writer(dir: &Path, mode: OpenMode, durability: Durability) -> Result<Log> {
    open_writer_with(
        dir,
        mode,
        Options {
            durability,
            ..Options::default()
        },
    )
}

fn open_writer_with(dir: &Path, mode: OpenMode, options: Options) -> Result<Log> {
    let store = Arc::new(RocksStore::open(dir, mode)?);
    let last = store.last_seq()?;
    let pb = progress(last, "replaying");
    let log = Log::open(store, options, Arc::new(SystemClock), &mut |seq| {
        pb.set_position(seq)
    })?;
    pb.finish_and_clear();
    Ok(log)
}

fn serve(options: ebb::serve::ServeOptions, durability: Durability) -> Result<()> {
    let log = Arc::new(open_writer_with(
        &options.data_dir,
        OpenMode::Create,
        Options {
            durability,
            snapshot_every_events: options.snapshot_every_events,
            ..Options::default()
        },
    )?);
    let rt = runtime()?;
    rt.block_on(async { ebb::serve::run(options, log.clone(), shutdown_signal()).await })?;
    drop(rt);
    if let Some(why) = log.failure() {
        bail!(
            "the log failed ({why}); ebb stopped. Start it again once the disk has room: it \
             recovers from the log"
        );
    }
    if let Ok(log) = Arc::try_unwrap(log) {
        log.close();
    }
    Ok(())
}

/// What `ebb runner` resolves services with: DNS and Kubernetes environment variables, and in a
/// Kubernetes pod (or with a KUBECONFIG) EndpointSlices too.
async fn runner_discovery() -> Result<ebb::discovery::Balanced> {
    use ebb::discovery::{Balanced, Cache, Composite, dns::Dns, k8s};
    let mut composite = Composite::default()
        .with(Arc::new(Dns::system_or_literal()))
        .with(Arc::new(k8s::Env));
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        || std::env::var_os("KUBECONFIG").is_some();
    if in_cluster {
        let client = kube::Client::try_default().await.context(
            "configuring the Kubernetes client (KUBECONFIG or the pod's service account)",
        )?;
        composite = composite.with(Arc::new(k8s::Endpoints::new(client)));
    }
    Ok(Balanced::new(Arc::new(Cache::new(Arc::new(composite)))))
}

/// `ebb runner`: the runner loop against a remote ebb until SIGTERM or Ctrl-C.
async fn run_runner(
    api: String,
    token: String,
    id: String,
    capacity: usize,
    proxy: SocketAddr,
    noop: bool,
    fault: Option<ebb::calls::runner::Fault>,
) -> Result<()> {
    use ebb::calls::runner::{self, Executor, HttpApi, NoopExecutor, ProxyExecutor, RunnerApi};
    let api_id = ebb::discovery::ServiceId::parse_address(&api)
        .map_err(|e| anyhow::anyhow!("--api: {e}"))?;
    if matches!(api_id.scheme(), "https" | "ws" | "wss") {
        bail!("--api {api:?}: the runner speaks plain HTTP to ebb (http://HOST:PORT, k8s://...)");
    }
    if capacity == 0 {
        bail!("--capacity must be at least 1");
    }
    let balanced = Arc::new(runner_discovery().await?);
    if let Err(e) = balanced.cache().get(&api_id) {
        bail!("--api {api:?}: {e}");
    }
    let client: Arc<dyn RunnerApi> = Arc::new(HttpApi::new(api_id, &token, balanced.clone()));
    let executor: Arc<dyn Executor> = if noop {
        Arc::new(NoopExecutor)
    } else {
        Arc::new(ProxyExecutor::new(
            proxy,
            ebb::calls::CallOptions::default().max_result_bytes,
            balanced,
        ))
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let options = runner::RunnerOptions {
        id,
        capacity,
        batch: capacity.min(256),
        fault,
        ..runner::RunnerOptions::default()
    };
    let stopped = shutdown_signal();
    let run = tokio::spawn(runner::run(client, executor, options, stop_rx));
    stopped.await;
    let _ = stop_tx.send(true);
    let _ = run.await;
    Ok(())
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called (inside a
/// runtime), not when the future is first polled, so a signal sent right after ebb says it is
/// ready is never missed.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).ok();
    let int = signal(SignalKind::interrupt()).ok();
    async move {
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! { _ = wait(term) => {}, _ = wait(int) => {} }
        tracing::info!("shutting down");
    }
}

fn format_time(at_ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(at_ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_else(|| format!("{at_ms}ms"))
}

fn print_envelope(out: &mut impl Write, env: &Envelope, json: bool) -> Result<()> {
    if json {
        serde_json::to_writer(&mut *out, env)?;
        writeln!(out)?;
    } else {
        let body = match serde_json::to_value(&env.event)? {
            serde_json::Value::Object(mut m) => m.remove(env.event.name()).unwrap_or_default(),
            v => v,
        };
        writeln!(
            out,
            "{:>8}  {}  {:<16}  {}",
            env.seq,
            format_time(env.at_ms),
            env.event.name(),
            body
        )?;
    }
    Ok(())
}

/// Prints the records `from..=to`; returns the seq after the last one printed.
fn print_range(
    store: &dyn LogStore,
    from: u64,
    to: u64,
    json: bool,
    out: &mut impl Write,
) -> Result<u64> {
    let mut failure = None;
    let next = tools::for_each(
        store,
        from,
        to,
        &mut |env, _| match print_envelope(out, &env, json) {
            Ok(()) => true,
            Err(e) => {
                failure = Some(e);
                false
            }
        },
    )?;
    failure.map_or(Ok(next), Err)
}

fn log_command(dir: &Path, cmd: LogCommand) -> Result<()> {
    match cmd {
        LogCommand::Stats { json } => {
            let store = open_reader(dir)?;
            let pb = progress(store.last_seq()?, "scanning");
            let st = tools::stats(&store, &mut |seq| pb.set_position(seq))?;
            pb.finish_and_clear();
            let mut out = std::io::stdout().lock();
            if json {
                serde_json::to_writer_pretty(&mut out, &st)?;
                writeln!(out)?;
                return Ok(());
            }
            writeln!(out, "data dir     {}", dir.display())?;
            writeln!(
                out,
                "seqs         {}..={} ({} events, {} bytes encoded)",
                st.first_seq.unwrap_or(0),
                st.last_seq,
                st.events,
                st.event_bytes
            )?;
            if let (Some(a), Some(b)) = (st.first_at_ms, st.last_at_ms) {
                writeln!(out, "time         {} .. {}", format_time(a), format_time(b))?;
            }
            writeln!(out, "snapshots    {:?}", st.snapshots)?;
            for (name, n) in &st.by_type {
                writeln!(out, "  {name:<18} {n}")?;
            }
            Ok(())
        }
        LogCommand::Dump { from, to, json } => {
            let store = open_reader(dir)?;
            let last = store.last_seq()?;
            if let Some(to) = to
                && to < from
            {
                bail!("--to {to} is before --from {from}");
            }
            if from > last.max(1) {
                bail!("--from {from} is past the end of the log (last seq is {last})");
            }
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            print_range(&store, from, to.unwrap_or(u64::MAX), json, &mut out)?;
            out.flush()?;
            Ok(())
        }
        LogCommand::Tail {
            from,
            json,
            poll_ms,
        } => tail(dir, from, json, poll_ms),
        LogCommand::Snapshot => {
            let log = open_writer(dir, OpenMode::Existing, Durability::Sync)?;
            let seq = runtime()?.block_on(log.snapshot())?;
            log.close();
            println!("snapshot taken at seq {seq}");
            Ok(())
        }
        LogCommand::Compact => {
            let store = RocksStore::open(dir, OpenMode::Existing)?;
            let Some(&newest) = store.snapshot_seqs()?.last() else {
                bail!("the log has no snapshot to compact to; run `ebb log snapshot` first");
            };
            let deleted = store.delete_before(newest)?;
            tracing::info!(before = newest, deleted, "log compacted");
            println!("compacted: deleted {deleted} events before seq {newest}");
            Ok(())
        }
    }
}

fn tail(dir: &Path, from: Option<u64>, json: bool, poll_ms: u64) -> Result<()> {
    let scratch = tempfile::Builder::new()
        .prefix("ebb-tail-")
        .tempdir()
        .context("creating the follower's scratch directory")?;
    let store = RocksStore::open_follower(dir, scratch.path())?;
    let mut next = match from {
        Some(s) => s.max(1),
        None => store.last_seq()? + 1,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut out = std::io::stdout().lock();
    // Ends on Ctrl-C or SIGTERM, so the scratch directory is removed.
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        loop {
            next = print_range(&store, next, u64::MAX, json, &mut out)?;
            out.flush()?;
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(poll_ms.max(1))) => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
                _ = term.recv() => return Ok(()),
            }
            store.catch_up()?;
        }
    })
}

fn replay(dir: &Path, until: Option<u64>, at: Option<String>, json: bool) -> Result<()> {
    let store = open_reader(dir)?;
    let until = match at {
        Some(t) => {
            let t = chrono::DateTime::parse_from_rfc3339(&t)
                .with_context(|| format!("--at {t:?} is not an RFC 3339 time"))?;
            Some(tools::seq_at(&store, t.timestamp_millis().max(0) as u64)?)
        }
        None => until,
    };
    let target = until.unwrap_or(store.last_seq()?);
    let pb = progress(target, "replaying");
    let (state, snapshot) = open_state::<State>(&store, until, &mut |seq| pb.set_position(seq))?;
    pb.finish_and_clear();
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &state)?;
        writeln!(out)?;
        return Ok(());
    }
    print_state(&mut out, &state, snapshot)?;
    Ok(())
}

fn print_state(out: &mut impl Write, s: &State, snapshot: u64) -> Result<()> {
    writeln!(
        out,
        "state at seq {} ({}), rebuilt from {}",
        s.seq,
        if s.seq == 0 {
            "empty log".to_owned()
        } else {
            format_time(s.at_ms)
        },
        if snapshot == 0 {
            "the first event".to_owned()
        } else {
            format!("the snapshot at seq {snapshot}")
        }
    )?;
    writeln!(out, "routes ({})", s.routes.by_name.len())?;
    for r in s.routes.by_name.values() {
        let d = s.routes.deployments.get(&r.spec.deployment);
        writeln!(
            out,
            "  {:<20} {} -> {} (replicas {}, last used {}, {} requests)",
            r.spec.name,
            r.spec.domains.join(","),
            r.spec.deployment,
            d.map_or(0, |d| d.replicas),
            if r.last_used_ms == 0 {
                "never".to_owned()
            } else {
                format_time(r.last_used_ms)
            },
            r.requests_total
        )?;
        // The last decision about its replicas, and why.
        if let Some(d) = d.filter(|d| d.desired_at_ms > 0) {
            writeln!(
                out,
                "  {:<20} asked for {} at {}{}",
                "",
                d.desired,
                format_time(d.desired_at_ms),
                d.reason
                    .map(|r| format!(" ({})", r.name()))
                    .unwrap_or_default()
            )?;
        }
    }
    let mut by_status = std::collections::BTreeMap::new();
    for c in s.calls.by_id.values() {
        *by_status
            .entry(format!("{:?}", c.status).to_lowercase())
            .or_insert(0u64) += 1;
    }
    writeln!(out, "calls ({}) {:?}", s.calls.by_id.len(), by_status)?;
    writeln!(
        out,
        "functions: {} templates, {} instances",
        s.functions.templates.len(),
        s.functions.instances.len()
    )?;
    writeln!(out, "cleaners ({})", s.cleaners.by_name.len())?;
    for c in s.cleaners.by_name.values() {
        writeln!(
            out,
            "  {:<20} last result {:?}, next evaluation {}, fired {}",
            c.spec.name,
            c.last_result,
            c.next_at_ms.map_or("-".to_owned(), format_time),
            c.fired_at_ms.map_or("no".to_owned(), format_time)
        )?;
    }
    writeln!(out, "scheduled deadlines: {}", s.schedule.len())?;
    if let Some((at, due)) = s.schedule.next() {
        writeln!(out, "  next: {:?} at {}", due, format_time(at))?;
    }
    Ok(())
}

fn explain(dir: &Path, kind: ExplainKind, id: &str, json: bool) -> Result<()> {
    let store = open_reader(dir)?;
    let pb = progress(store.last_seq()?, "scanning");
    let found = tools::explain(&store, kind, id, &mut |seq| pb.set_position(seq))?;
    pb.finish_and_clear();
    let Some(ex) = found else {
        bail!("no {} {id:?} in the log", kind.name());
    };
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, &ex)?;
        writeln!(out)?;
        return Ok(());
    }
    print_story(&mut out, &ex)?;
    Ok(())
}

/// A story for people: a line per event (time, seq, event, what happened and why), the date
/// whenever it changes, and the object as it stands now.
fn print_story(out: &mut impl Write, ex: &tools::Explanation) -> Result<()> {
    writeln!(
        out,
        "{} {}: {} (times in UTC)",
        ex.kind,
        ex.id,
        match ex.story.len() {
            1 => "1 event".to_owned(),
            n => format!("{n} events"),
        }
    )?;
    if ex.compacted_through > 0 {
        writeln!(
            out,
            "(the log was compacted: events up to seq {} are only in its snapshot)",
            ex.compacted_through
        )?;
    }
    let mut day = String::new();
    for line in &ex.story {
        let at = chrono::DateTime::from_timestamp_millis(line.at_ms as i64).unwrap_or_default();
        let today = at.format("%Y-%m-%d").to_string();
        if today != day {
            writeln!(out, "{today}")?;
            day = today;
        }
        writeln!(
            out,
            "  {}  #{:<6} {:<16} {}",
            at.format("%H:%M:%S%.3f"),
            line.seq,
            line.event,
            line.text
        )?;
    }
    writeln!(out, "now: {}", ex.current)?;
    Ok(())
}

fn append_stress(dir: &Path, appenders: usize, count: Option<u64>) -> Result<()> {
    let log = Arc::new(open_writer(dir, OpenMode::Create, Durability::Sync)?);
    let rt = runtime()?;
    rt.block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u64>(65_536);
        let left = Arc::new(std::sync::atomic::AtomicU64::new(count.unwrap_or(u64::MAX)));
        for i in 0..appenders.max(1) {
            let log = log.clone();
            let tx = tx.clone();
            let left = left.clone();
            tokio::spawn(async move {
                let route = format!("route-{i}");
                let mut n = 0u64;
                loop {
                    let take = left.fetch_update(
                        std::sync::atomic::Ordering::SeqCst,
                        std::sync::atomic::Ordering::SeqCst,
                        |v| v.checked_sub(1),
                    );
                    if take.is_err() {
                        return;
                    }
                    n += 1;
                    let event = Event::RequestsSeen {
                        route: route.clone(),
                        count: n,
                        last_at_ms: n,
                    };
                    match log.append(event).await {
                        Ok(seq) => {
                            if tx.send(seq).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            eprintln!("error: {e}");
                            std::process::exit(1);
                        }
                    }
                }
            });
        }
        drop(tx);
        let mut out = std::io::stdout().lock();
        while let Some(seq) = rx.recv().await {
            writeln!(out, "{seq}")?;
            out.flush()?;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    drop(rt);
    if let Ok(log) = Arc::try_unwrap(log) {
        log.close();
    }
    Ok(())
}

async fn run_workload(replicas: u32, log_dir: PathBuf, command: Vec<String>) -> Result<()> {
    use ebb::orchestrator::{Orchestrator, ProcessOptions, ProcessOrchestrator, Readiness};
    let orch = ProcessOrchestrator::new(ProcessOptions {
        log_dir,
        ..ProcessOptions::default()
    })?;
    orch.register(ebb::orchestrator::WorkloadSpec {
        name: "workload".into(),
        command,
        env: vec![],
        cwd: None,
        readiness: Readiness::Http {
            path: "/health".into(),
        },
        startup_timeout_ms: 30_000,
        stop_grace_ms: 5_000,
        pre_run: None,
    })?;
    orch.scale("workload", replicas)?;
    let mut changes = orch.changes();
    loop {
        let seen = orch.observe("workload").unwrap_or_default();
        if seen.ready.len() as u32 >= replicas {
            for addr in &seen.ready {
                println!("ready {addr}");
            }
            break;
        }
        changes.changed().await?;
    }
    std::future::pending::<()>().await;
    Ok(())
}

/// `ebb crds`: the definitions as pretty JSON (which kubectl and kustomize read as YAML).
fn crds(out: Option<&std::path::Path>) -> anyhow::Result<()> {
    for crd in ebb::functions::crds()
        .into_iter()
        .chain(ebb::cleaner::crds())
    {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let mut text = serde_json::to_string_pretty(&crd)?;
        text.push('\n');
        match out {
            Some(dir) => {
                let path = dir.join(format!("{name}.json"));
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            None => print!("{text}"),
        }
    }
    Ok(())
}
