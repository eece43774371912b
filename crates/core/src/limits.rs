//! The bounds a client can reach, each a named setting (`ebb serve --NAME`, `EBB_NAME`; the
//! README's configuration reference lists them), and how often each refused something
//! (`ebb_limit_refusals_total{limit}` in `/metrics`). Reaching one gives a clear 4xx or 503 with
//! a JSON body, never a crash or unbounded memory.
//!
//! [`Limits`] is one `clap::Args` struct flattened into `ebb serve`, so each bound is a flag and an
//! environment variable, checked at start ([`Limits::check`]); each refusal is counted with
//! [`Limit::hit`]. Where each is enforced: the proxy (its `ProxyOptions::limits`) bounds a head's
//! bytes and header lines and the time to read it on both forwarding paths (hyper's
//! `max_buf_size` and `header_read_timeout` on the general one), counts connections at accept
//! (over the bound, a 503 is written and the connection closed) and held requests across routes,
//! beside each route's `hold_queue_max`; the call service bounds the calls queued per target from
//! the projection's index ([`crate::state::Calls::queued_by_target`]); the function service bounds
//! an instance's steps; the cleaner loop passes the CEL bounds to every evaluation.

use std::sync::atomic::{AtomicU64, Ordering};

/// Every limit by name. The names are the settings' names and the metric's label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// A request head's bytes (the proxy): 431.
    HeadBytes,
    /// A request head's header lines (the proxy): 431.
    Headers,
    /// A request head not read whole in time (the proxy): 408, and the connection closed.
    HeaderReadTimeout,
    /// Client connections open at once (the proxy): 503, and the connection closed.
    Connections,
    /// Requests held for a waking workload, on all routes together: 503.
    Held,
    /// Requests held on one route (`hold_queue_max`): 503.
    HeldPerRoute,
    /// An API request's body: 413.
    ApiBodyBytes,
    /// Calls queued for one target: 503.
    QueuedPerTarget,
    /// Calls queued in all: 503.
    Queued,
    /// Steps of one function instance: the instance fails.
    InstanceSteps,
    /// A Cleaner's CEL evaluation (steps or time): the evaluation stops.
    CelCost,
}

impl Limit {
    /// Every limit, in the order of the metric's lines.
    pub const ALL: [Limit; 11] = [
        Limit::HeadBytes,
        Limit::Headers,
        Limit::HeaderReadTimeout,
        Limit::Connections,
        Limit::Held,
        Limit::HeldPerRoute,
        Limit::ApiBodyBytes,
        Limit::QueuedPerTarget,
        Limit::Queued,
        Limit::InstanceSteps,
        Limit::CelCost,
    ];

    /// The setting's name, as the metric's `limit` label.
    pub fn name(self) -> &'static str {
        match self {
            Limit::HeadBytes => "max_head_bytes",
            Limit::Headers => "max_headers",
            Limit::HeaderReadTimeout => "header_read_timeout",
            Limit::Connections => "max_connections",
            Limit::Held => "max_held",
            Limit::HeldPerRoute => "hold_queue_max",
            Limit::ApiBodyBytes => "max_api_body_bytes",
            Limit::QueuedPerTarget => "max_queued_per_target",
            Limit::Queued => "max_queued",
            Limit::InstanceSteps => "max_instance_steps",
            Limit::CelCost => "cel_max_steps",
        }
    }

    /// Counts one refusal.
    pub fn hit(self) {
        HITS[self as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Refusals counted since this process started.
    pub fn hits(self) -> u64 {
        HITS[self as usize].load(Ordering::Relaxed)
    }
}

static HITS: [AtomicU64; Limit::ALL.len()] = [const { AtomicU64::new(0) }; Limit::ALL.len()];

/// Every limit's setting: `ebb serve --NAME` or `EBB_NAME`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "Limits")]
pub struct Limits {
    /// The most bytes of a request head the proxy reads (request line and header lines): 431
    /// past it.
    #[arg(long, env = "EBB_MAX_HEAD_BYTES", default_value_t = 64 * 1024)]
    pub max_head_bytes: usize,
    /// The most header lines of a request head (at most 100): 431 past it.
    #[arg(long, env = "EBB_MAX_HEADERS", default_value_t = MAX_HEADERS_CEILING)]
    pub max_headers: usize,
    /// How long a request head may take to arrive whole from its first byte, in ms: 408 and
    /// the connection closed past it (slow clients cannot hold connections open).
    #[arg(long, env = "EBB_HEADER_READ_TIMEOUT_MS", default_value_t = 30_000)]
    pub header_read_timeout_ms: u64,
    /// How long a client connection may sit between requests, in ms.
    #[arg(long, env = "EBB_CLIENT_IDLE_TIMEOUT_MS", default_value_t = 75_000)]
    pub client_idle_timeout_ms: u64,
    /// Client connections open at once, across the proxy's threads: past it a new one gets a
    /// 503 and is closed.
    #[arg(long, env = "EBB_MAX_CONNECTIONS", default_value_t = 16_384)]
    pub max_connections: usize,
    /// Requests held for waking workloads at once, across all routes (each route has its own
    /// `hold_queue_max` too): 503 past it.
    #[arg(long, env = "EBB_MAX_HELD", default_value_t = 10_000)]
    pub max_held: u64,
    /// The most bytes of an admin, runner or functions API request's body: 413 past it.
    #[arg(long, env = "EBB_MAX_API_BODY_BYTES", default_value_t = 16 << 20)]
    pub max_api_body_bytes: usize,
    /// Calls queued (not yet started) for one target at once: 503 past it.
    #[arg(long, env = "EBB_MAX_QUEUED_PER_TARGET", default_value_t = 100_000)]
    pub max_queued_per_target: usize,
    /// Steps one function instance may run: the instance fails past it.
    #[arg(long, env = "EBB_MAX_INSTANCE_STEPS", default_value_t = 64)]
    pub max_instance_steps: usize,
    /// Comprehension steps one evaluation of a Cleaner's conditions may take: the evaluation
    /// stops with EvaluationLimitExceeded past it.
    #[arg(long, env = "EBB_CEL_MAX_STEPS", default_value_t = 1_000_000)]
    pub cel_max_steps: u64,
    /// Time one evaluation of a Cleaner's conditions may take, in ms: likewise.
    #[arg(long, env = "EBB_CEL_MAX_TIME_MS", default_value_t = 1_000)]
    pub cel_max_time_ms: u64,
}

/// The most header lines `--max-headers` may allow.
pub const MAX_HEADERS_CEILING: usize = 100;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_head_bytes: 64 * 1024,
            max_headers: MAX_HEADERS_CEILING,
            header_read_timeout_ms: 30_000,
            client_idle_timeout_ms: 75_000,
            max_connections: 16_384,
            max_held: 10_000,
            max_api_body_bytes: 16 << 20,
            max_queued_per_target: 100_000,
            max_instance_steps: 64,
            cel_max_steps: 1_000_000,
            cel_max_time_ms: 1_000,
        }
    }
}

impl Limits {
    /// Checks the settings' values.
    pub fn check(&self) -> Result<(), String> {
        let at_least_one = [
            ("--header-read-timeout-ms", self.header_read_timeout_ms),
            ("--client-idle-timeout-ms", self.client_idle_timeout_ms),
            ("--max-connections", self.max_connections as u64),
            ("--max-api-body-bytes", self.max_api_body_bytes as u64),
            ("--max-queued-per-target", self.max_queued_per_target as u64),
            ("--max-instance-steps", self.max_instance_steps as u64),
            ("--cel-max-steps", self.cel_max_steps),
            ("--cel-max-time-ms", self.cel_max_time_ms),
        ];
        if let Some((name, _)) = at_least_one.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be at least 1"));
        }
        if !(1_024..=1 << 20).contains(&self.max_head_bytes) {
            return Err("--max-head-bytes must be between 1024 and 1048576".into());
        }
        if !(1..=MAX_HEADERS_CEILING).contains(&self.max_headers) {
            return Err(format!(
                "--max-headers must be between 1 and {MAX_HEADERS_CEILING}"
            ));
        }
        Ok(())
    }
}
