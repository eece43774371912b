//! `ebb serve`: the runtime shell that wires the log, the orchestrator, the proxy, its background
//! loops and the admin endpoints together, and takes them down in order. Like `main.rs` it is an
//! edge of the program: it reports errors with `anyhow`.

mod options;

pub use options::*;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::calls::Calls;
use crate::calls::runner::{self as call_runner, ProxyExecutor, RunnerApi, RunnerOptions};
use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::event::{Event, ProcessSpec, RouteSpec};
use crate::log::Log;
use crate::orchestrator::kube::KubeOrchestrator;
use crate::orchestrator::{Orchestrator, ProcessOptions, ProcessOrchestrator, WorkloadSpec};
use crate::proxy::runtime;
use crate::proxy::{Proxy, ProxyOptions, Traffic};
use crate::queue::Queue;
use crate::queue::embedded::EmbeddedQueue;
use crate::queue::kafka::KafkaQueue;
use crate::scaler::{decide_restart, decide_shutdown};
use crate::state::State;

/// The headless Service of the replicas as a service id: `k8s://SERVICE.NAMESPACE[:PORT]` as
/// given, or a bare name in `namespace` on `port` (the replicas of a StatefulSet listen alike).
fn peer_service(
    text: &str,
    namespace: &str,
    port: u16,
) -> anyhow::Result<crate::discovery::ServiceId> {
    let id = if text.contains("://") {
        text.to_owned()
    } else {
        format!("k8s://{text}.{namespace}:{port}")
    };
    let id = crate::discovery::ServiceId::parse(&id)
        .map_err(|e| anyhow::anyhow!("--peer-service: {e}"))?;
    if id.scheme() != "k8s" || id.host().is_some_and(|h| h.split('.').count() != 2) {
        anyhow::bail!(
            "--peer-service {text:?}: give a Service name or k8s://SERVICE.NAMESPACE[:PORT]"
        );
    }
    crate::discovery::k8s::check(&id).map_err(|e| anyhow::anyhow!("--peer-service: {e}"))?;
    Ok(id)
}

/// How often `ebb serve` looks for a failure of its log.
const LOG_FAILURE_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// How often the compactor looks at the log's length.
const COMPACTION_CHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// Keeps the log bounded: the writer takes a snapshot every `--snapshot-every-events` events;
/// once there are two, the events (and snapshots) before the older one are deleted. One interval
/// of events stays readable for `ebb explain` and the dashboard's timeline; what is older is told
/// from the snapshot.
async fn run_compaction(log: Arc<Log>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(COMPACTION_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut compacted_to = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let store = log.store().clone();
        let snapshots = match tokio::task::spawn_blocking(move || store.snapshot_seqs()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "reading the log's snapshots failed");
                continue;
            }
            Err(_) => continue,
        };
        let Some(&before) = snapshots
            .len()
            .checked_sub(2)
            .and_then(|i| snapshots.get(i))
        else {
            continue;
        };
        if before <= compacted_to {
            continue;
        }
        let store = log.store().clone();
        match tokio::task::spawn_blocking(move || store.delete_before(before)).await {
            Ok(Ok(deleted)) => {
                compacted_to = before;
                tracing::info!(deleted, before, "log compacted");
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "compacting the log failed"),
            Err(_) => {}
        }
    }
}

/// Routes from the config file that differ from the log's, as events.
fn config_routes(state: &State, routes: &[RouteSpec]) -> Vec<Event> {
    routes
        .iter()
        .filter(|r| state.routes.by_name.get(&r.name).map(|x| &x.spec) != Some(*r))
        .map(|r| Event::RouteUpserted {
            route: Box::new(r.clone()),
        })
        .collect()
}

/// `n` listeners on one address with `SO_REUSEPORT` ([`crate::proxy::reuseport_listeners`]).
pub use crate::proxy::reuseport_listeners;

/// Runs until `shutdown` resolves, then stops accepting, flushes traffic, stops every replica.
pub async fn run(
    options: ServeOptions,
    log: Arc<Log>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    // The command line checked the options (`ServeOptions::check`) before the log was opened.
    let kubernetes = options.kube.options();
    let peer_list = options.replicas.peers().map_err(anyhow::Error::msg)?;
    let call_options = options.call_options();
    let autoscale = options.functions.autoscale();
    let tls = options.net.tls();
    let admin_tls_files = options.net.admin_tls();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let config = match &options.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let exe = std::env::current_exe().context("finding the ebb executable")?;
    let (process, kube) = match &kubernetes {
        None => (
            Some(Arc::new(
                ProcessOrchestrator::new(ProcessOptions {
                    log_dir: options.data_dir.join("workloads"),
                    ..ProcessOptions::default()
                })
                .context("starting the process orchestrator")?,
            )),
            None,
        ),
        Some(k) => {
            if let Some(app) = config.apps.first() {
                anyhow::bail!(
                    "app {:?} in the config runs as a local process, but this ebb runs \
                     workloads on Kubernetes: annotate a Service with ebb.dev/domains and \
                     ebb.dev/deployment instead",
                    app.name
                );
            }
            if let Some(ns) = &k.namespace
                && ns != &k.functions_namespace
            {
                anyhow::bail!(
                    "image functions go to namespace {:?}, but this ebb watches {ns:?} only: \
                     it would not see their endpoints (give --functions-namespace {ns})",
                    k.functions_namespace
                );
            }
            let client = ::kube::Client::try_default().await.context(
                "configuring the Kubernetes client (KUBECONFIG or the pod's service account)",
            )?;
            (None, Some(KubeOrchestrator::new(client, k.clone())))
        }
    };
    let dyn_orch: Arc<dyn Orchestrator> = match (&process, &kube) {
        (Some(p), _) => p.clone(),
        (None, Some(k)) => k.clone(),
        (None, None) => unreachable!("one orchestrator"),
    };
    let routes: Vec<RouteSpec> = config.apps.iter().map(|a| a.route()).collect();
    log.decide(move |s: &State, _| (config_routes(s, &routes), ()))
        .await?;
    // On Kubernetes, templates are Func resources every replica follows.
    let templates = match (&kube, &kubernetes) {
        (Some(k), Some(ko)) => Some(crate::orchestrator::kube_templates::KubeTemplates::new(
            k.client(),
            &ko.functions_namespace,
        )),
        _ => None,
    };
    // Function templates from the config: on Kubernetes applied as resources (the mirror brings
    // them to the log), on one machine created or replaced like a PUT of the API.
    if let Some(t) = &templates {
        let specs = config
            .functions
            .iter()
            .map(|f| f.clone().into_spec().map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<Vec<_>>>()?;
        t.apply_config(&specs).await.with_context(|| {
            format!(
                "writing the config's function templates as Func resources in {}",
                t.namespace()
            )
        })?;
    }
    for f in config.functions.iter().filter(|_| templates.is_none()) {
        let spec = f.clone().into_spec().map_err(anyhow::Error::msg)?;
        let a = autoscale;
        let (r, _) = log
            .decide(
                move |s: &State, _| match crate::functions::decide_put(s, spec, &a) {
                    Ok((events, _)) => (events, Ok(())),
                    Err(e) => (Vec::new(), Err(e)),
                },
            )
            .await?;
        r.map_err(|e| anyhow::anyhow!("function {:?} from the config: {e:?}", f.name))?;
    }
    if let Some(orch) = &process {
        // Every route in the log that ebb runs as processes, whether from the config or the
        // admin API.
        let workloads: Vec<(String, ProcessSpec)> = log.read(|s| {
            s.routes
                .by_name
                .values()
                .filter_map(|r| Some((r.spec.deployment.clone(), r.spec.process.clone()?)))
                .collect()
        });
        for (deployment, process) in &workloads {
            orch.register(WorkloadSpec::from_process(deployment, process, &exe))?;
        }
        log.decide(|s: &State, now| (decide_restart(s, now), ()))
            .await?;
        // Deployments with a minimum run it from the start.
        let minimums: Vec<(String, u32)> = log.read(|s| {
            s.routes
                .deployments
                .iter()
                .filter(|(_, d)| d.desired > 0)
                .map(|(n, d)| (n.clone(), d.desired))
                .collect()
        });
        for (deployment, n) in minimums {
            if let Err(e) = orch.scale(&deployment, n) {
                tracing::warn!(%deployment, error = %e, "cannot start minimum replicas");
            }
        }
    }

    // Discovery, for meta services' destinations, functions served elsewhere and the other
    // replicas: DNS and Kubernetes environment variables everywhere, EndpointSlices on
    // Kubernetes. A destination nothing here resolves is refused now, not at its first request.
    let discovery = {
        use crate::discovery::{Composite, dns::Dns, k8s};
        let dns = Dns::new(options.dns_server).map_err(|e| anyhow::anyhow!(e))?;
        let mut composite = Composite::default()
            .with(Arc::new(dns))
            .with(Arc::new(k8s::Env));
        if let Some(k) = &kube {
            composite = composite.with(Arc::new(k8s::Endpoints::new(k.client())));
        }
        let unsupported = |what: String, id: &crate::discovery::ServiceId| {
            anyhow::anyhow!(
                "{what}: nothing resolves {:?} here (k8s:// needs --orchestrator kubernetes)",
                id.scheme()
            )
        };
        for m in &config.meta {
            if let Some(id) = m.discovered().find(|id| !composite.supports(id)) {
                return Err(unsupported(
                    format!("service {}: destination {id}", m.id),
                    id,
                ));
            }
        }
        for (name, id) in &peer_list {
            if !composite.supports(id) {
                return Err(unsupported(format!("--peer {name}={id}"), id));
            }
        }
        Arc::new(crate::discovery::Cache::new(Arc::new(composite)))
    };
    let balanced = Arc::new(crate::discovery::Balanced::new(discovery.clone()));
    let peers = Arc::new(crate::peers::Peers::new(
        options.replicas.replica.clone(),
        match (&kube, &kubernetes) {
            (Some(_), Some(ko)) if peer_list.is_empty() => {
                crate::peers::Resolver::Kubernetes(peer_service(
                    &options.replicas.peer_service,
                    &ko.shared.lease_namespace,
                    options.net.admin_listen.port(),
                )?)
            }
            _ => crate::peers::Resolver::Static(peer_list.iter().cloned().collect()),
        },
        balanced.clone(),
    ));
    let (stop_tx, stop_rx) = watch::channel(false);
    // TLS: the certificates load now (a bad pair stops the start) and are watched for changes.
    let certs = |what: &'static str, pair: &Option<(PathBuf, PathBuf)>, alpn: &[&[u8]]| {
        pair.as_ref()
            .map(|(cert, key)| {
                let reloading = crate::tls::Reloading::new(cert, key)
                    .map_err(|e| anyhow::anyhow!("{what} TLS: {e}"))?;
                let acceptor = reloading
                    .acceptor(alpn)
                    .map_err(|e| anyhow::anyhow!("{what} TLS: {e}"))?;
                tokio::spawn(reloading.watch(what, stop_rx.clone()));
                anyhow::Ok(acceptor)
            })
            .transpose()
    };
    let proxy_tls = certs("proxy", &tls, &[b"h2", b"http/1.1"])?;
    let admin_tls = certs("admin", &admin_tls_files, &[b"http/1.1"])?;
    let traffic = Arc::new(Traffic::default());
    let proxy = Arc::new(Proxy::new(
        log.clone(),
        dyn_orch.clone(),
        clock.clone(),
        traffic.clone(),
        ProxyOptions {
            services: config.meta.clone(),
            discovery: Some(discovery.clone()),
            drain_timeout_ms: options.drain_timeout_ms,
            client_idle_timeout_ms: options.limits.client_idle_timeout_ms,
            limits: options.limits,
            tls: proxy_tls.map(crate::proxy::Tls),
            tcp_relay_threads: options.net.tcp_relay_threads(),
            ..ProxyOptions::default()
        },
    ));
    // Local processes are drained before they stop: the proxy counts their requests.
    if let Some(p) = &process {
        let weak = Arc::downgrade(&proxy);
        p.drain_with(Arc::new(move |addr| {
            weak.upgrade().map_or(0, |p| p.in_flight_at(addr))
        }));
    }
    let load_scaler = Arc::new(crate::proxy::load::LoadScaler::default());
    // On Kubernetes: the Service, EndpointSlice, scale and sync loops, and the functions' objects.
    let kube_task = kube.clone().map(|k| {
        let (log, stop) = (log.clone(), stop_rx.clone());
        tokio::spawn(async move {
            tokio::join!(
                crate::orchestrator::kube::run(log.clone(), k.clone(), stop.clone()),
                crate::orchestrator::kube_functions::run(log, k.clone(), stop.clone()),
                ebb_kube::health::watch(k.client(), ebb_kube::health::EVERY, stop),
            );
        })
    });
    let compactor = (options.log.snapshot_every_events > 0)
        .then(|| tokio::spawn(run_compaction(log.clone(), stop_rx.clone())));
    let flusher = tokio::spawn(runtime::run_flusher(
        log.clone(),
        traffic.clone(),
        options.runtime(),
        stop_rx.clone(),
    ));
    // The observer outlives the others, to record the replicas stopping at shutdown.
    let (observer_stop_tx, observer_stop_rx) = watch::channel(false);
    let observer = tokio::spawn(runtime::run_observer(
        log.clone(),
        dyn_orch.clone(),
        observer_stop_rx,
    ));
    if let (Some(t), Some(k), Some(ko)) = (&templates, &kube, &kubernetes) {
        tokio::spawn(crate::orchestrator::kube_templates::run_mirror(
            t.clone(),
            log.clone(),
            autoscale,
            k.clone(),
            stop_rx.clone(),
        ));
        tokio::spawn(crate::orchestrator::kube_templates::run_status(
            t.clone(),
            log.clone(),
            peers.me().unwrap_or(ko.instance.as_str()).to_owned(),
            clock.clone(),
            ko.shared.leading.clone(),
            Duration::from_millis(autoscale.period_ms.max(1_000)),
            stop_rx.clone(),
        ));
    }
    // The cleaners of ebb.toml and the retention, on every replica: ebb's own objects.
    let local_cleaners = Arc::new(
        crate::cleaner::runtime::Cleaners::new(
            log.clone(),
            clock.clone(),
            crate::cleaner::local::LocalTargets::new(
                log.clone(),
                clock.clone(),
                crate::cleaner::local::KeepGoneFor {
                    after_ms: call_options.forgotten_after_ms,
                    most: call_options.retention_bounds.most_gone(),
                },
            ),
            crate::cleaner::runtime::Options {
                limits: crate::cleaner::cel::Limits::of(&options.limits),
                ..crate::cleaner::runtime::Options::default()
            },
        )
        .only(crate::cleaner::config::is_local),
    );
    {
        let mut specs: Vec<crate::event::CleanerSpec> = config
            .cleaners
            .iter()
            .map(crate::cleaner::local::config_spec)
            .collect();
        if !config.cleaners.iter().any(|c| c.name == "retention") {
            specs.push(crate::cleaner::local::retention(
                call_options.retention_ms,
                call_options.forget_every_ms,
            ));
        }
        let names: std::collections::BTreeSet<String> =
            specs.iter().map(|s| s.name.clone()).collect();
        let gone: Vec<String> = log.read(|s| {
            s.cleaners
                .by_name
                .keys()
                .filter(|n| crate::cleaner::config::is_local(n) && !names.contains(*n))
                .cloned()
                .collect()
        });
        for n in gone {
            local_cleaners.delete(&n).await?;
        }
        for spec in specs {
            local_cleaners.upsert(spec).await?;
        }
    }
    let (_local_nudge, local_nudged) = tokio::sync::mpsc::channel(1);
    // Beside the retention's age, its bounds on how many ended calls and instances stay.
    let bounds_task = tokio::spawn(crate::cleaner::local::hold_within(
        log.clone(),
        call_options.retention_bounds,
        stop_rx.clone(),
    ));
    let local_cleaner_task = tokio::spawn(crate::cleaner::runtime::run(
        local_cleaners,
        local_nudged,
        stop_rx.clone(),
    ));
    // On Kubernetes: the watches RBAC refuses, told as Events on ebb's own pod.
    if let (Some(k), Some(ko)) = (&kube, &kubernetes) {
        tokio::spawn(crate::orchestrator::kube::tell_refusals(
            k.access.clone(),
            k.clone(),
            ko.instance.clone(),
            ko.shared.lease_namespace.clone(),
            stop_rx.clone(),
        ));
    }
    // On Kubernetes: the cleaners, run by the holder of the lease.
    if let (Some(k), Some(ko)) = (&kube, &kubernetes) {
        tokio::spawn(crate::cleaner::kube::run(
            k.client(),
            log.clone(),
            clock.clone(),
            crate::cleaner::kube::KubeCleanerOptions {
                namespace: ko.namespace.clone(),
                instance: ko.instance.clone(),
                helm: options.cleaner_helm.clone(),
                options: crate::cleaner::runtime::Options {
                    limits: crate::cleaner::cel::Limits::of(&options.limits),
                    ..crate::cleaner::runtime::Options::default()
                },
                access: k.access.clone(),
            },
            ko.shared.leading.clone(),
            stop_rx.clone(),
        ));
    }
    // Keep-warm windows, on every replica and backend.
    tokio::spawn(runtime::run_warmer(
        log.clone(),
        dyn_orch.clone(),
        clock.clone(),
        options.runtime(),
        stop_rx.clone(),
    ));
    match (&kube, &kubernetes) {
        // On Kubernetes, several ebb replicas may serve the same workloads: only the holder of
        // the lease scales down, conditioned on what it read.
        (Some(k), Some(ko)) => {
            // A scale-down keeps the pods with requests under way through any ebb replica.
            let (weak, scaler, c) = (Arc::downgrade(&proxy), load_scaler.clone(), clock.clone());
            k.busy_with(Arc::new(move |addr| {
                let here = weak.upgrade().map_or(0, |p| p.in_flight_at(addr));
                here.saturating_add(scaler.busy_elsewhere(addr, c.now_ms()))
            }));
            let weak = Arc::downgrade(&proxy);
            tokio::spawn(crate::load::run_shared(
                load_scaler.clone(),
                log.clone(),
                dyn_orch.clone(),
                traffic.clone(),
                clock.clone(),
                crate::load::Shared {
                    leading: ko.shared.leading.clone(),
                    holder: ko.shared.holder.clone(),
                    peers: peers.clone(),
                    token: options.access.peer_token(),
                    told: Default::default(),
                    busy: Arc::new(move || {
                        weak.upgrade()
                            .map(|p| p.busy_replicas())
                            .unwrap_or_default()
                    }),
                },
                stop_rx.clone(),
            ));
            tokio::spawn(crate::orchestrator::kube::run_shared(
                log.clone(),
                k.clone(),
                traffic.clone(),
                clock.clone(),
                ko.shared.clone(),
                stop_rx.clone(),
            ));
        }
        _ => {
            tokio::spawn(crate::proxy::load::run(
                load_scaler.clone(),
                log.clone(),
                dyn_orch.clone(),
                traffic.clone(),
                clock.clone(),
                stop_rx.clone(),
            ));
            tokio::spawn(runtime::run_downscaler(
                log.clone(),
                dyn_orch.clone(),
                traffic.clone(),
                clock.clone(),
                options.runtime(),
                stop_rx.clone(),
            ));
        }
    }

    let proxy_listeners = reuseport_listeners(options.net.listen, options.net.proxy_threads())
        .with_context(|| format!("listening on {}", options.net.listen))?;
    let admin_listener = tokio::net::TcpListener::bind(options.net.admin_listen)
        .await
        .with_context(|| format!("listening on {}", options.net.admin_listen))?;
    let proxy_addr = proxy_listeners[0].local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    let proxy_threads = proxy.spawn_workers(proxy_listeners, stop_rx.clone())?;
    // TCP routes: their ports now (a taken one stops the start), then as the routes change.
    let tcp_bound = crate::proxy::tcp::bind_all(&proxy).context("opening the TCP routes' ports")?;
    tokio::spawn(crate::proxy::tcp::run(
        proxy.clone(),
        tcp_bound,
        stop_rx.clone(),
    ));
    // The Gateway API: the controller compiles the objects into sockets, the proxy serves them.
    if let (Some(addressing), Some(k)) =
        (options.kube.gateway().map_err(anyhow::Error::msg)?, &kube)
    {
        let (sockets_tx, sockets_rx) = tokio::sync::watch::channel(Arc::new(Vec::new()));
        let (refused_tx, refused_rx) = tokio::sync::watch::channel(Default::default());
        tokio::spawn(crate::proxy::gateway::run(
            proxy.clone(),
            sockets_rx,
            refused_tx,
            stop_rx.clone(),
        ));
        tokio::spawn(ebb_kube::gateway::run(
            log.clone(),
            k.clone(),
            ebb_kube::gateway::GatewayOptions { addressing },
            sockets_tx,
            refused_rx,
            stop_rx.clone(),
        ));
    }

    // Calls: the embedded queue, the service behind the runner API, the expiry loop and the
    // built-in runner.
    let queue: Arc<dyn Queue> = match &options.calls.kafka().map_err(anyhow::Error::msg)? {
        Some(k) => Arc::new(
            KafkaQueue::open(clock.clone(), k.clone())
                .await
                .with_context(|| format!("connecting to Kafka at {}", k.brokers))?,
        ),
        None => Arc::new(
            EmbeddedQueue::open(
                options.data_dir.join("queue"),
                clock.clone(),
                options.calls.embedded(),
            )
            .context("opening the call queue")?,
        ),
    };
    let calls = Arc::new(
        Calls::new(log.clone(), queue, clock.clone(), call_options.clone())
            .with_peers(peers.clone(), options.access.peer_token()),
    );
    calls
        .recover()
        .await
        .context("putting queued calls back on the queue")?;
    let functions = crate::functions::runtime::FunctionService::new(
        log.clone(),
        calls.clone(),
        clock.clone(),
        autoscale,
    )
    .with_max_steps(options.limits.max_instance_steps);
    let functions = Arc::new(match &kube {
        Some(_) => functions.on_kubernetes(),
        None => functions,
    });
    let cron = tokio::spawn(crate::functions::runtime::run_cron(
        functions.clone(),
        stop_rx.clone(),
    ));
    let autoscaler = tokio::spawn(crate::functions::runtime::run_autoscaler(
        functions.clone(),
        dyn_orch.clone(),
        stop_rx.clone(),
    ));
    let driver = tokio::spawn(crate::functions::runtime::run_driver(
        functions.clone(),
        stop_rx.clone(),
    ));
    let expiry = tokio::spawn(crate::calls::run_expiry(
        calls.clone(),
        Duration::from_millis(100),
        stop_rx.clone(),
    ));
    let runner = (options.calls.runner_capacity > 0).then(|| {
        let api: Arc<dyn RunnerApi> = Arc::new(calls.clone());
        let executor = Arc::new(ProxyExecutor::new(
            proxy_addr,
            call_options.max_result_bytes,
            balanced.clone(),
        ));
        tokio::spawn(call_runner::run(
            api,
            executor,
            RunnerOptions {
                // Named after its replica when there are several, so the owner of a call it ran
                // records which one did.
                id: match &options.replicas.replica {
                    Some(r) => format!("builtin-{r}"),
                    None => RunnerOptions::default().id,
                },
                capacity: options.calls.runner_capacity,
                ..RunnerOptions::default()
            },
            stop_rx.clone(),
        ))
    });

    let metrics = Arc::new(crate::metrics::Metrics::new(crate::metrics::Sources {
        log: log.clone(),
        traffic: traffic.clone(),
        orchestrator: dyn_orch.clone(),
        max_routes: options.metrics_max_routes,
        queue: Some(calls.queue().clone()),
        load: Some(load_scaler.clone()),
    }));
    metrics.follow(&log);
    let kube_access = match (&options.access.kube_auth(), &kube, &kubernetes) {
        (None, ..) => None,
        (Some(auth), Some(k), Some(ko)) => Some(crate::api::access::KubeAccess::new(
            k.client(),
            ko.shared.lease_namespace.clone(),
            auth.audiences.clone(),
            auth.cache,
        )),
        (Some(_), ..) => anyhow::bail!(
            "--kube-auth checks tokens with Kubernetes: it needs --orchestrator kubernetes"
        ),
    };
    let access = crate::api::access::Access::new(
        crate::api::access::Tokens {
            admin: options.access.admin_token.clone(),
            dashboard: options.access.dashboard_token.clone(),
            functions: options.access.api_token.clone(),
            runner: options.access.runner_token.clone(),
        },
        kube_access,
    )
    .with_secure_cookies(admin_tls.is_some());
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let admin = crate::api::router(crate::api::AppState {
        log: log.clone(),
        orchestrator: Some(dyn_orch.clone()),
        access: Arc::new(access),
        ebb_exe: exe.clone(),
        calls: Some(calls.clone()),
        functions: Some(functions.clone()),
        peers: peers.clone(),
        templates: templates.clone(),
        ready: kube.clone().map(|k| {
            let ready: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || k.synced());
            ready
        }),
        refused: kube.as_ref().map(|k| k.access.clone()),
        metrics: Some(metrics),
        feed: Arc::new(crate::api::ui::Feed::new(stop_rx.clone())),
        max_body_bytes: options.limits.max_api_body_bytes,
        load: Some(load_scaler.clone()),
        clock: clock.clone(),
        stopping: stopping.clone(),
    });
    let admin_stopped = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.changed().await;
        }
    };
    let handshake = std::time::Duration::from_millis(options.limits.header_read_timeout_ms);
    let admin_task = tokio::spawn(async move {
        match admin_tls {
            None => {
                let admin_listener = crate::strict::StrictListener(admin_listener, handshake);
                axum::serve(admin_listener, admin)
                    .with_graceful_shutdown(admin_stopped)
                    .await
            }
            Some(acceptor) => {
                let listener = crate::tls::TlsListener::new(admin_listener, acceptor, handshake)?;
                axum::serve(listener, admin)
                    .with_graceful_shutdown(admin_stopped)
                    .await
            }
        }
    });

    // Ready: the addresses are the signal tests and scripts wait for.
    tracing::info!(%proxy_addr, %admin_addr, apps = config.apps.len(), seq = log.read(|s| s.seq), "ebb is serving");
    let scheme = |tls: &Option<(PathBuf, PathBuf)>| if tls.is_some() { "https" } else { "http" };
    println!("ebb proxy listening on {}://{proxy_addr}", scheme(&tls));
    println!(
        "ebb admin listening on {}://{admin_addr}",
        scheme(&admin_tls_files)
    );
    // Fail-stop: once the log cannot be written (a full disk, an I/O error), ebb stops as it
    // would on SIGTERM, and `ebb serve` then exits with the reason; started again with room, it
    // recovers from the log, where nothing acknowledged is missing and nothing is half-written.
    let log_failed = {
        let log = log.clone();
        async move {
            let mut tick = tokio::time::interval(LOG_FAILURE_CHECK);
            loop {
                tick.tick().await;
                if let Some(why) = log.failure() {
                    return why;
                }
            }
        }
    };
    tokio::select! {
        () = shutdown => {
            // Not ready any more, but still serving, until what routes by readiness has
            // stopped sending new connections.
            if options.shutdown_delay_ms > 0 {
                stopping.store(true, std::sync::atomic::Ordering::Release);
                tracing::info!(
                    shutdown_delay_ms = options.shutdown_delay_ms,
                    "shutting down: not ready, still serving until the delay ends"
                );
                tokio::time::sleep(Duration::from_millis(options.shutdown_delay_ms)).await;
            }
        }
        why = log_failed => {
            tracing::error!(error = %why, "the log failed: ebb stops (start it again once the disk has room)");
        }
    }
    let _ = stop_tx.send(true);
    // Calls under way get a moment to end and be reported; the rest time out.
    if let Some(runner) = runner
        && tokio::time::timeout(Duration::from_secs(5), runner)
            .await
            .is_err()
    {
        tracing::warn!("calls still running at shutdown will time out");
    }
    let _ = expiry.await;
    let _ = driver.await;
    let _ = autoscaler.await;
    let _ = cron.await;
    let _ = local_cleaner_task.await;
    let _ = bounds_task.await;
    let _ = tokio::task::spawn_blocking(move || {
        for t in proxy_threads {
            let _ = t.join();
        }
    })
    .await;
    let _ = flusher.await;
    if let Some(c) = compactor {
        let _ = c.await;
    }
    if let Some(task) = kube_task {
        let _ = task.await;
    }
    // Stopping every replica is a decision like any other: logged first, then carried out.
    // Workloads on Kubernetes are not ebb's to stop: they keep running for the next ebb.
    if let Some(orch) = &process {
        if let Err(e) = log.decide(|s: &State, _| (decide_shutdown(s), ())).await {
            tracing::warn!(error = %e, "recording the shutdown failed");
        }
        orch.shutdown(Duration::from_secs(1)).await;
    }
    let _ = observer_stop_tx.send(true);
    let _ = observer.await;
    let _ = admin_task.await;
    Ok(())
}
