//! `ebb serve`'s options: each flag declared once, in the group it belongs to, and flattened into
//! the command (`ServeOptions`). What several flags make together (the call service's bounds, the
//! queues', the Kubernetes backend's) is built here from the group, where it is used.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::calls::{CallOptions, RetentionBounds};
use crate::log::Durability;
use crate::orchestrator::kube::{KubeOptions, SharedScaling};
use crate::proxy::runtime::RuntimeOptions;
use crate::queue::embedded::EmbeddedOptions;
use crate::queue::kafka::{ClientProperties, KafkaOptions};

/// What `ebb serve` was asked to do.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeOptions {
    /// The data directory (the log; workload logs in `workloads/` under it): the command line's
    /// global `--data-dir`.
    #[arg(skip)]
    pub data_dir: PathBuf,
    /// The apps to serve (`ebb.toml`).
    #[arg(long, env = "EBB_CONFIG")]
    pub config: Option<PathBuf>,
    /// The `helm` program Cleaners uninstall releases with (Kubernetes; without it a Cleaner
    /// that asks for a release's uninstall cannot complete its firing).
    #[arg(long, env = "EBB_CLEANER_HELM")]
    pub cleaner_helm: Option<PathBuf>,
    /// The DNS server (IP:port) that resolves meta services' destinations named by host name
    /// (default: the system's, from /etc/resolv.conf).
    #[arg(long, env = "EBB_DNS_SERVER")]
    pub dns_server: Option<std::net::SocketAddr>,
    /// Seeds the load balancers' random choices (each proxy thread's generator comes from it
    /// and the thread's number): the same seed, the same picks (default: a random seed).
    #[arg(long, env = "EBB_BALANCE_SEED")]
    pub balance_seed: Option<u64>,
    /// Routes with a `route` label of their own in /metrics, at most; the rest are summed
    /// under route="_other".
    #[arg(long, default_value_t = crate::metrics::DEFAULT_MAX_ROUTES)]
    pub metrics_max_routes: usize,
    /// At shutdown (SIGTERM, Ctrl-C): how long requests under way and held requests may
    /// take to be answered after ebb stops accepting connections; the rest are then cut.
    #[arg(long, default_value_t = 30_000)]
    pub drain_timeout_ms: u64,
    /// At shutdown (SIGTERM, Ctrl-C): how long ebb goes on serving as before, `/readyz`
    /// answering 503 `shutting_down`, before it stops accepting connections: long enough for
    /// what routes by readiness (a Kubernetes Service's endpoints, kube-proxy's rules, a load
    /// balancer's health checks) to stop sending new ones. `deploy/` sets 5 s.
    #[arg(long, default_value_t = 0)]
    pub shutdown_delay_ms: u64,
    #[command(flatten)]
    pub net: NetOptions,
    #[command(flatten)]
    pub access: AccessOptions,
    #[command(flatten)]
    pub log: LogOptions,
    #[command(flatten)]
    pub calls: CallFlags,
    #[command(flatten)]
    pub functions: FunctionFlags,
    #[command(flatten)]
    pub kube: KubeFlags,
    #[command(flatten)]
    pub replicas: ReplicaFlags,
    /// The bounds clients can reach.
    #[command(flatten)]
    pub limits: crate::limits::Limits,
}

/// Where ebb listens, with how many proxy threads, over TLS or not.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Listening")]
pub struct NetOptions {
    /// Address of the proxy.
    #[arg(long, default_value = "127.0.0.1:8080", env = "EBB_LISTEN")]
    pub listen: SocketAddr,
    /// Address of ebb's own endpoints (`/healthz`).
    #[arg(long, default_value = "127.0.0.1:8081", env = "EBB_ADMIN_LISTEN")]
    pub admin_listen: SocketAddr,
    /// Proxy threads (default: one per core).
    #[arg(long, env = "EBB_PROXY_THREADS")]
    pub proxy_threads: Option<usize>,
    /// Threads that move TCP routes' bytes through io_uring (default: one per core);
    /// 0, or a kernel that refuses io_uring: the proxy threads copy them.
    #[arg(long, env = "EBB_TCP_RELAY_THREADS")]
    pub tcp_relay_threads: Option<usize>,
    /// Serve the proxy over TLS with this certificate chain (PEM), read again when it
    /// changes; with --tls-key.
    #[arg(long, env = "EBB_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The proxy's TLS private key (PEM: PKCS#8, PKCS#1 or SEC1); with --tls-cert.
    #[arg(long, env = "EBB_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Serve ebb's own endpoints (the admin, runner and functions APIs, the dashboard,
    /// /metrics) over TLS with this certificate chain (PEM); with --admin-tls-key.
    #[arg(long, env = "EBB_ADMIN_TLS_CERT", requires = "admin_tls_key")]
    pub admin_tls_cert: Option<PathBuf>,
    /// Their TLS private key (PEM); with --admin-tls-cert.
    #[arg(long, env = "EBB_ADMIN_TLS_KEY", requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,
}

/// The APIs' bearer tokens, and Kubernetes' own (`--kube-auth`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Access")]
pub struct AccessOptions {
    /// Bearer token for the admin API (`/admin/routes`); without one it is disabled.
    #[arg(long, env = "EBB_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Bearer token for the runner API (`/runner/*`, `/v1/calls`); without one it is disabled.
    #[arg(long, env = "EBB_RUNNER_TOKEN", hide_env_values = true)]
    pub runner_token: Option<String>,
    /// Bearer token for the functions API (`/api/funcs`); without one it is disabled.
    #[arg(long, env = "EBB_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Token that signs in to the dashboard (`/ui`, read-only); without one the admin token
    /// does.
    #[arg(long, env = "EBB_DASHBOARD_TOKEN", hide_env_values = true)]
    pub dashboard_token: Option<String>,
    /// On Kubernetes: a bearer token that is none of the above is checked with a TokenReview,
    /// and the request allowed if RBAC (a SubjectAccessReview) lets its user do the verb on
    /// the API's resource (`admin`, `dashboard`, `functions`, `runner`) of group
    /// `api.ebb.dev` in ebb's namespace. An API without a token of its own is then open to
    /// those users only.
    #[arg(long, env = "EBB_KUBE_AUTH")]
    pub kube_auth: bool,
    /// With --kube-auth: the audiences a token must be for, comma-separated (default: the
    /// API server's own).
    #[arg(long, env = "EBB_KUBE_AUTH_AUDIENCES", value_delimiter = ',')]
    pub kube_auth_audiences: Vec<String>,
    /// With --kube-auth: how long Kubernetes' answer about a token is kept, in seconds (a
    /// grant or a revocation counts within that).
    #[arg(long, env = "EBB_KUBE_AUTH_CACHE_SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub kube_auth_cache_seconds: u64,
    /// The token this replica presents to the others when it forwards a call's start, finish
    /// or state to its owner, read from this file (again whenever it changes: a projected
    /// ServiceAccount token rotates). Default: the runner token if there is one; else, with
    /// --kube-auth, the pod's ServiceAccount token
    /// (`/var/run/secrets/kubernetes.io/serviceaccount/token`), which the others check with
    /// the same TokenReview (deploy/ lets ebb's ServiceAccount use the runner API).
    #[arg(long, env = "EBB_PEER_TOKEN_FILE")]
    pub peer_token_file: Option<PathBuf>,
}

/// Where a pod's projected ServiceAccount token is.
pub const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// The log's durability and snapshots, and how often traffic is written to it.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Log")]
pub struct LogOptions {
    /// Sync every acknowledged append to disk, or leave flushing to the OS.
    #[arg(long, value_enum, default_value_t = Durability::Sync)]
    pub durability: Durability,
    /// A snapshot of the projections every this many events, and the events before the
    /// snapshot before the newest deleted, so the log stays bounded (0: neither).
    #[arg(long, env = "EBB_SNAPSHOT_EVERY_EVENTS", default_value_t = 1_000_000)]
    pub snapshot_every_events: u64,
    /// How often request counts are flushed to the log, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    pub flush_interval_ms: u64,
}

/// The call service, its queue (embedded or Kafka) and the built-in runner.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Calls")]
pub struct CallFlags {
    /// Calls the built-in runner runs at once (0: none; external runners only).
    #[arg(long, default_value_t = 64)]
    pub runner_capacity: usize,
    /// How long a runner may keep a call it did not start before it is redelivered, in ms.
    #[arg(long, default_value_t = 30_000)]
    pub visibility_timeout_ms: u64,
    /// A runner not heard from for this long is gone and its calls go to others, in ms.
    #[arg(long, default_value_t = 15_000)]
    pub runner_lease_ms: u64,
    /// The most calls the queue holds.
    #[arg(long, default_value_t = 1_000_000)]
    pub max_queued: usize,
    /// How long an ended call or function instance stays readable through the API, in ms (its
    /// events stay in the log).
    #[arg(long, default_value_t = 3_600_000)]
    pub call_retention_ms: u64,
    /// The most ended calls kept readable through the API, and the most ended function
    /// instances: past it the oldest go before their retention time (their events stay in the
    /// log).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub call_retention_count: u64,
    /// The most memory the ended calls kept readable take, and the ended instances, in bytes
    /// (about: payloads, results, logs and their fixed size): past it the oldest go before their
    /// retention time.
    #[arg(long, default_value_t = 256 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub call_retention_bytes: u64,
    /// Put calls on Kafka (`bootstrap.servers`) instead of the embedded queue.
    #[arg(long, env = "EBB_KAFKA_BROKERS")]
    pub kafka_brokers: Option<String>,
    /// The Kafka topic of calls.
    #[arg(long, default_value = "ebb-calls")]
    pub kafka_topic: String,
    /// Partitions of the Kafka topic when ebb creates it.
    #[arg(long, default_value_t = 8)]
    pub kafka_partitions: i32,
    /// The runners' consumers commit their offsets at most once in this long, in ms (a commit
    /// only saves rereading calls already ended, after a restart or a rebalance).
    #[arg(long, default_value_t = crate::queue::kafka::COMMIT_EVERY_MS)]
    pub kafka_commit_every_ms: u64,
    /// Test hook: a message of a call the log does not know is deleted once it was put this
    /// long ago, in ms (it is of a call the log forgot).
    #[arg(long, hide = true, default_value_t = crate::calls::FORGOTTEN_AFTER_MS)]
    pub forgotten_after_ms: u64,
    /// A librdkafka property for ebb's Kafka clients, `KEY=VALUE` (repeat it): TLS and SASL for
    /// a real cluster, or batching and fetching. `producer.KEY` goes to the producer only,
    /// `consumer.KEY` to the runners' consumers only. After those of `--kafka-config-file`.
    #[arg(
        long = "kafka-config",
        value_name = "KEY=VALUE",
        requires = "kafka_brokers"
    )]
    pub kafka_config: Vec<String>,
    /// A file of librdkafka properties, one `KEY=VALUE` a line (`#` starts a comment): a
    /// Kubernetes Secret mounted as a file keeps a SASL password out of the pod's arguments.
    #[arg(
        long,
        env = "EBB_KAFKA_CONFIG_FILE",
        value_name = "PATH",
        requires = "kafka_brokers"
    )]
    pub kafka_config_file: Option<PathBuf>,
}

/// The function autoscaler.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Functions")]
pub struct FunctionFlags {
    /// The function autoscaler's period, in ms.
    #[arg(long, default_value_t = 1_000)]
    pub fn_period_ms: u64,
    /// How much a function's call counter decays each period.
    #[arg(long, default_value_t = 2)]
    pub fn_counter_decay: u64,
    /// The most a function's call counter holds.
    #[arg(long, default_value_t = 1_000)]
    pub fn_counter_cap: u64,
    /// Counter units one function instance is for.
    #[arg(long, default_value_t = 10)]
    pub fn_target_per_instance: u64,
    /// A function goes to zero instances only this long after its last call, in ms.
    #[arg(long, default_value_t = 30_000)]
    pub fn_zero_after_ms: u64,
}

/// What runs the workloads, and the Kubernetes backend's settings.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Kubernetes")]
pub struct KubeFlags {
    /// What runs the workloads: local processes, or Kubernetes (routes from annotated
    /// Services, replicas through `/scale`, addresses from EndpointSlices; the client is
    /// configured from `KUBECONFIG` or the pod's service account).
    #[arg(long, value_enum, default_value_t = Backend::Process, env = "EBB_ORCHESTRATOR")]
    pub orchestrator: Backend,
    /// On Kubernetes: watch this namespace only (default: all namespaces).
    #[arg(long, env = "NAMESPACE")]
    pub namespace: Option<String>,
    /// On Kubernetes: where function templates with an image get their Deployment and
    /// Service (default: the watched namespace, else ebb's own).
    #[arg(long, env = "EBB_FUNCTIONS_NAMESPACE")]
    pub functions_namespace: Option<String>,
    /// On Kubernetes: how often each workload's replicas are read back, in ms.
    #[arg(long, default_value_t = 10_000)]
    pub kube_sync_ms: u64,
    /// On Kubernetes: API requests per second at most (watches excepted).
    #[arg(long, default_value_t = 20)]
    pub kube_qps: u32,
    /// On Kubernetes: this replica's name, for the lease and ebb's Events (the pod's name).
    #[arg(long, env = "POD_NAME", default_value = "ebb")]
    pub pod_name: String,
    /// On Kubernetes: the namespace of ebb's own Lease (the pod's namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub pod_namespace: String,
    /// On Kubernetes: how long the scale-down lease lasts, in ms.
    #[arg(long, default_value_t = 15_000)]
    pub kube_lease_ms: u64,
    /// On Kubernetes: a replica keeps a workload's last-used annotation this close to its
    /// own traffic, in ms.
    #[arg(long, default_value_t = 5_000)]
    pub kube_touch_ms: u64,
    /// On Kubernetes: the most two ebb replicas' clocks differ by, in ms.
    #[arg(long, default_value_t = 500)]
    pub kube_max_skew_ms: u64,
    /// Test hook: before each scale-down write, create `held` in this directory and wait
    /// for `release` there.
    #[arg(long, hide = true, env = "EBB_TEST_DOWNSCALE_GATE")]
    pub downscale_gate: Option<PathBuf>,
    /// On Kubernetes: be the Gateway API's controller for every GatewayClass whose
    /// controllerName is `ebb.dev/gateway` (Gateways, HTTPRoutes, ReferenceGrants).
    #[arg(long, env = "EBB_GATEWAY")]
    pub gateway: bool,
    /// With --gateway: give each Gateway an address of its own from this range
    /// (`FIRST-LAST`, at most 4096 addresses), where ebb listens for it. Without it, every
    /// Gateway's listeners bind --gateway-bind and their status names --gateway-address.
    #[arg(long, env = "EBB_GATEWAY_ADDRESS_POOL")]
    pub gateway_address_pool: Option<String>,
    /// With --gateway and no pool: the address every Gateway's listeners bind.
    #[arg(long, default_value = "0.0.0.0")]
    pub gateway_bind: std::net::IpAddr,
    /// With --gateway and no pool: the addresses Gateways' status names (ebb's Service's),
    /// comma-separated (default: the pod's, `POD_IP`).
    #[arg(long, env = "EBB_GATEWAY_ADDRESSES", value_delimiter = ',')]
    pub gateway_address: Vec<String>,
}

/// The most addresses `--gateway-address-pool` may hold.
pub const MAX_GATEWAY_POOL: u128 = 4096;

/// `FIRST-LAST`: the addresses from FIRST to LAST, both of one family.
pub fn parse_pool(text: &str) -> Result<Vec<std::net::IpAddr>, String> {
    use std::net::IpAddr;
    let bad = |why: &str| format!("--gateway-address-pool {text:?}: {why}");
    let (a, b) = text.split_once('-').unwrap_or((text, text));
    let (a, b): (IpAddr, IpAddr) = (
        a.trim()
            .parse()
            .map_err(|_| bad("give FIRST-LAST, two IP addresses"))?,
        b.trim()
            .parse()
            .map_err(|_| bad("give FIRST-LAST, two IP addresses"))?,
    );
    let (lo, hi, v4) = match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            (u128::from(u32::from(a)), u128::from(u32::from(b)), true)
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), false),
        _ => return Err(bad("FIRST and LAST are of different families")),
    };
    if hi < lo {
        return Err(bad("LAST comes before FIRST"));
    }
    if hi - lo >= MAX_GATEWAY_POOL {
        return Err(bad(&format!("more than {MAX_GATEWAY_POOL} addresses")));
    }
    Ok((lo..=hi)
        .map(|n| {
            if v4 {
                IpAddr::V4(std::net::Ipv4Addr::from(n as u32))
            } else {
                IpAddr::V6(std::net::Ipv6Addr::from(n))
            }
        })
        .collect())
}

/// This replica's name and how it finds the others.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Replicas")]
pub struct ReplicaFlags {
    /// This replica's name, when several ebb share calls (a Kafka queue) and functions: the
    /// ids of the calls and instances it accepts carry it (`NAME.UUID`), and other replicas
    /// forward what concerns them here. On Kubernetes, the StatefulSet pod's name.
    #[arg(long, env = "EBB_REPLICA")]
    pub replica: Option<String>,
    /// Another replica's admin listener, as NAME=ID (a service id: `http://HOST:PORT`, a DNS
    /// name, `k8s://...`); repeat for each. On Kubernetes without it, replicas are found
    /// through --peer-service.
    #[arg(long = "peer", env = "EBB_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// On Kubernetes: the headless Service whose endpoints are ebb's replicas: a name in ebb's
    /// own namespace, on the port of this replica's admin listener, or
    /// `k8s://SERVICE.NAMESPACE[:PORT]`. Replica NAME is its endpoint of hostname NAME.
    #[arg(long, default_value = "ebb-headless")]
    pub peer_service: String,
}

/// What runs the workloads of `ebb serve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Local processes, started from `ebb.toml` and the admin API.
    Process,
    /// Kubernetes Deployments and StatefulSets behind annotated Services.
    Kubernetes,
}

impl ServeOptions {
    /// Refuses options that do not go together, before anything starts.
    pub fn check(&self) -> Result<(), String> {
        self.limits.check()?;
        if self.access.kube_auth && self.kube.orchestrator != Backend::Kubernetes {
            return Err(
                "--kube-auth checks tokens with Kubernetes: it needs --orchestrator kubernetes"
                    .into(),
            );
        }
        if let Some(r) = &self.replicas.replica {
            crate::functions::check_name("replica", r)?;
        }
        self.replicas.peers()?;
        Ok(())
    }

    /// The call service's bounds.
    pub fn call_options(&self) -> CallOptions {
        let retention_ms = self.calls.call_retention_ms;
        CallOptions {
            runner_lease_ms: self.calls.runner_lease_ms,
            retention_ms,
            forget_every_ms: retention_ms.clamp(1, 60_000),
            retention_bounds: RetentionBounds {
                count: self.calls.call_retention_count,
                bytes: self.calls.call_retention_bytes,
            },
            max_queued_per_target: self.limits.max_queued_per_target,
            forgotten_after_ms: self.calls.forgotten_after_ms,
            ..CallOptions::default()
        }
    }

    /// The proxy's loop intervals.
    pub fn runtime(&self) -> RuntimeOptions {
        RuntimeOptions {
            flush_interval_ms: self.log.flush_interval_ms,
            ..Default::default()
        }
    }
}

/// This machine's cores as the process may use them (2 when that cannot be read).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

impl NetOptions {
    /// Proxy threads: as asked, else one per core.
    pub fn proxy_threads(&self) -> usize {
        self.proxy_threads.unwrap_or_else(cores)
    }

    /// TCP relay threads: as asked, else one per core.
    pub fn tcp_relay_threads(&self) -> usize {
        self.tcp_relay_threads.unwrap_or_else(cores)
    }

    /// The proxy's certificate chain and key, if it serves TLS.
    pub fn tls(&self) -> Option<(PathBuf, PathBuf)> {
        self.tls_cert.clone().zip(self.tls_key.clone())
    }

    /// Ebb's own endpoints' certificate chain and key, if they serve TLS.
    pub fn admin_tls(&self) -> Option<(PathBuf, PathBuf)> {
        self.admin_tls_cert.clone().zip(self.admin_tls_key.clone())
    }
}

impl AccessOptions {
    /// The token forwarded requests to other replicas carry (see `--peer-token-file`).
    pub fn peer_token(&self) -> crate::peers::PeerToken {
        match (&self.peer_token_file, &self.runner_token) {
            (Some(file), _) => crate::peers::PeerToken::file(file.clone()),
            (None, Some(t)) => crate::peers::PeerToken::Static(t.clone()),
            (None, None) if self.kube_auth => {
                crate::peers::PeerToken::file(PathBuf::from(SERVICE_ACCOUNT_TOKEN))
            }
            (None, None) => crate::peers::PeerToken::None,
        }
    }

    /// Kubernetes' tokens on the APIs, when asked for.
    pub fn kube_auth(&self) -> Option<crate::api::access::KubeAuthOptions> {
        self.kube_auth.then(|| crate::api::access::KubeAuthOptions {
            audiences: self.kube_auth_audiences.clone(),
            cache: std::time::Duration::from_secs(self.kube_auth_cache_seconds),
        })
    }
}

impl CallFlags {
    /// The embedded queue's tuning.
    pub fn embedded(&self) -> EmbeddedOptions {
        EmbeddedOptions {
            visibility_timeout_ms: self.visibility_timeout_ms,
            max_messages: self.max_queued,
            ..EmbeddedOptions::default()
        }
    }

    /// The Kafka queue, when brokers are given; an error names a bad `--kafka-config` or its
    /// file.
    pub fn kafka(&self) -> Result<Option<KafkaOptions>, String> {
        let Some(brokers) = self.kafka_brokers.clone() else {
            return Ok(None);
        };
        let mut client = ClientProperties::default();
        if let Some(path) = &self.kafka_config_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--kafka-config-file {}: {e}", path.display()))?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if !line.is_empty() && !line.starts_with('#') {
                    client.add(line).map_err(|e| {
                        format!("--kafka-config-file {} line {}: {e}", path.display(), n + 1)
                    })?;
                }
            }
        }
        for item in &self.kafka_config {
            client
                .add(item)
                .map_err(|e| format!("--kafka-config: {e}"))?;
        }
        Ok(Some(KafkaOptions {
            brokers,
            topic: self.kafka_topic.clone(),
            partitions: self.kafka_partitions,
            visibility_timeout_ms: self.visibility_timeout_ms,
            max_out: self.max_queued,
            commit_every_ms: self.kafka_commit_every_ms,
            client,
            ..KafkaOptions::default()
        }))
    }
}

impl FunctionFlags {
    /// The function autoscaler's settings.
    pub fn autoscale(&self) -> crate::functions::Autoscale {
        crate::functions::Autoscale {
            period_ms: self.fn_period_ms,
            decay: self.fn_counter_decay,
            cap: self.fn_counter_cap,
            target_per_instance: self.fn_target_per_instance,
            zero_after_ms: self.fn_zero_after_ms,
        }
    }
}

impl KubeFlags {
    /// The Kubernetes backend's options (`None`: local processes).
    pub fn options(&self) -> Option<KubeOptions> {
        (self.orchestrator == Backend::Kubernetes).then(|| KubeOptions {
            functions_namespace: self
                .functions_namespace
                .clone()
                .or_else(|| self.namespace.clone())
                .unwrap_or_else(|| self.pod_namespace.clone()),
            namespace: self.namespace.clone(),
            sync_interval_ms: self.kube_sync_ms,
            instance: self.pod_name.clone(),
            api_qps: self.kube_qps,
            api_burst: self.kube_qps.saturating_mul(2),
            shared: SharedScaling {
                options: SharedScaling::timing(
                    self.kube_touch_ms,
                    self.kube_lease_ms,
                    self.kube_max_skew_ms,
                ),
                lease_namespace: self.pod_namespace.clone(),
                gate: self.downscale_gate.clone(),
                ..Default::default()
            },
            ..Default::default()
        })
    }
}

impl KubeFlags {
    /// With --gateway: where Gateways' addresses come from.
    pub fn gateway(&self) -> Result<Option<ebb_core::gateway::Addressing>, String> {
        use ebb_core::gateway::Addressing;
        if !self.gateway {
            return Ok(None);
        }
        if self.orchestrator != Backend::Kubernetes {
            return Err("--gateway reads the Gateway API from Kubernetes: it needs --orchestrator kubernetes".into());
        }
        if let Some(p) = &self.gateway_address_pool {
            return parse_pool(p).map(|pool| Some(Addressing::Pool(pool)));
        }
        let mut addresses = self.gateway_address.clone();
        if addresses.is_empty()
            && let Ok(ip) = std::env::var("POD_IP")
        {
            addresses.push(ip);
        }
        Ok(Some(Addressing::Shared {
            bind: self.gateway_bind,
            addresses,
        }))
    }
}

impl ReplicaFlags {
    /// The other replicas by name (`--peer NAME=ID`).
    pub fn peers(&self) -> Result<Vec<(String, crate::discovery::ServiceId)>, String> {
        self.peers.iter().map(|p| parse_peer(p)).collect()
    }
}

/// `--peer NAME=ID`: a replica name and its service id (`http://HOST:PORT`, `HOST:PORT`, a
/// `k8s://` id).
fn parse_peer(p: &str) -> Result<(String, crate::discovery::ServiceId), String> {
    let (name, id) = p
        .split_once('=')
        .ok_or_else(|| format!("--peer {p:?}: give NAME=ID, e.g. ebb-1=http://10.0.0.2:8081"))?;
    crate::functions::check_name("replica", name)?;
    let id =
        crate::discovery::ServiceId::parse_address(id).map_err(|e| format!("--peer {p:?}: {e}"))?;
    if matches!(id.scheme(), "https" | "ws" | "wss") {
        return Err(format!(
            "--peer {p:?}: replicas speak plain HTTP to each other (http://HOST:PORT)"
        ));
    }
    Ok((name.to_owned(), id))
}
