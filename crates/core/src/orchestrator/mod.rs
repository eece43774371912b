//! Orchestrators run the workloads behind routes: scale a workload to N replicas, report how many
//! are ready and where they listen, and tell waiters when that changes.
//!
//! The trait is small on purpose: `scale` records what is wanted and returns at once; the backend
//! converges in the background; `observe` and `changes` report what is. The `ebb` crate's
//! `process` backend runs local processes (one machine, nothing else installed), its Kubernetes
//! backend Deployments; the simulator has its own. Decisions about *when* to scale are not made
//! here: they are pure functions of the core ([`crate::scaler`]); the backends only carry them
//! out.

pub mod annotations;

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// How a replica shows that it is ready to serve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Readiness {
    /// An HTTP GET of `path` answers 2xx.
    Http { path: String },
    /// A TCP connection is accepted.
    Tcp,
}

/// What to run for a workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadSpec {
    /// Unique name (the deployment name of routes).
    pub name: String,
    /// Program and arguments. The replica must listen on 127.0.0.1:`$PORT`.
    pub command: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Working directory.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// Readiness check.
    pub readiness: Readiness,
    /// A replica not ready after this long is stopped and counts as a failed start.
    pub startup_timeout_ms: u64,
    /// Time between SIGTERM and SIGKILL when stopping a replica.
    pub stop_grace_ms: u64,
    /// A shell command (`sh -c`) run once before the first replica starts; a replica does not
    /// start until it succeeded.
    #[serde(default)]
    pub pre_run: Option<String>,
}

impl WorkloadSpec {
    /// The workload for a deployment described by a route's process spec; `ebb` as the program
    /// means `ebb_exe`, the running ebb binary.
    pub fn from_process(
        name: &str,
        p: &crate::event::ProcessSpec,
        ebb_exe: &std::path::Path,
    ) -> Self {
        let mut command = p.command.clone();
        if command.first().is_some_and(|c| c == "ebb") {
            command[0] = ebb_exe.to_string_lossy().into_owned();
        }
        WorkloadSpec {
            name: name.to_owned(),
            command,
            env: p.env.clone(),
            cwd: p.cwd.as_ref().map(PathBuf::from),
            readiness: match &p.readiness_path {
                Some(path) => Readiness::Http { path: path.clone() },
                None => Readiness::Tcp,
            },
            startup_timeout_ms: p.startup_timeout_ms,
            stop_grace_ms: p.stop_grace_ms,
            pre_run: p.pre_run.clone(),
        }
    }
}

/// A workload as the orchestrator sees it now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Replicas asked for.
    pub desired: u32,
    /// Replicas started and not yet ready.
    pub starting: u32,
    /// Ready replicas' addresses.
    pub ready: Vec<SocketAddr>,
    /// Replicas stopping.
    pub stopping: u32,
    /// Replica processes started over the workload's life.
    pub spawns: u64,
    /// Replicas that exited while wanted (crashes and failed starts).
    pub failures: u64,
    /// The last failure, for people.
    pub last_failure: Option<String>,
}

/// Errors of orchestrators.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No workload has that name.
    #[error("no workload named {0:?}")]
    UnknownWorkload(String),
    /// The spec cannot be run.
    #[error("workload {name:?}: {why}")]
    InvalidSpec { name: String, why: String },
    /// The orchestrator is shutting down.
    #[error("the orchestrator is shutting down")]
    Closed,
}

/// Result with the orchestrator's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Runs workloads.
pub trait Orchestrator: Send + Sync + 'static {
    /// Defines or replaces a workload (replacing keeps its desired count; running replicas keep
    /// running until they are replaced by a later scale).
    fn register(&self, spec: WorkloadSpec) -> Result<()>;
    /// Asks for `replicas` replicas; returns at once.
    fn scale(&self, name: &str, replicas: u32) -> Result<()>;
    /// The workload now.
    fn observe(&self, name: &str) -> Option<Observed>;
    /// A counter that moves whenever any workload's observed state changes.
    fn changes(&self) -> watch::Receiver<u64>;
}
