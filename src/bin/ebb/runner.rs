//! `ebb runner`: a runner of calls against a remote ebb (dequeue, start, run through ebb's proxy,
//! finish) until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result, bail};

use crate::serve::shutdown_signal;
use clap::Args;

/// Arguments of `ebb runner`.
#[derive(Args)]
pub struct RunnerArgs {
    /// The ebb API (its admin listener) as a service id: http://127.0.0.1:8081, a DNS name
    /// of every replica, k8s://ebb.NAMESPACE:8081. The runner keeps to one replica while it
    /// is there (consistent hashing on --id).
    #[arg(long, env = "EBB_API")]
    pub api: String,
    /// The runner token.
    #[arg(long, env = "EBB_RUNNER_TOKEN", hide_env_values = true)]
    pub token: String,
    /// This runner's id (its queue partition).
    #[arg(long, default_value = "runner")]
    pub id: String,
    /// Calls run at once.
    #[arg(long, default_value_t = 64)]
    pub capacity: usize,
    /// The ebb proxy the calls' requests go through.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub proxy: SocketAddr,
    /// Finish every call at once without running it (for measuring the queue).
    #[arg(long, hide = true)]
    pub noop: bool,
    /// Fault injection for tests: SIGKILL this runner at a point of a call's life.
    #[arg(long, hide = true, value_enum)]
    pub fault: Option<ebb::calls::runner::Fault>,
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
pub async fn run(args: RunnerArgs) -> Result<()> {
    let RunnerArgs {
        api,
        token,
        id,
        capacity,
        proxy,
        noop,
        fault,
    } = args;
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
