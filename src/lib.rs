//! ebb: a serverless platform for HTTP workloads and functions on one append-only event log.
//!
//! The pure core is its own crate, `ebb_core` (events, projections, decisions, timing,
//! configuration), re-exported here under the same paths ([`event`], [`state`], ...); so are the
//! effect crates beneath this one: `ebb_storage` (the RocksDB and Kafka backends of the [`log`]
//! and the [`queue`]), `ebb_proxy` ([`proxy`], and [`discovery`]'s resolvers and clients),
//! `ebb_cleaner` ([`cleaner`]'s loop) and `ebb_kube` (the Kubernetes [`orchestrator`], cleaner
//! targets and discovery sources). The simulator is `ebb_sim` ([`sim`]). This crate holds what
//! only the binary wires: [`api`], the runtimes of [`calls`] and [`functions`], the process
//! orchestrator, [`peers`], [`metrics`] and [`serve`], which wires `ebb serve`; the command line
//! is the binary's (`src/bin/ebb/`). See `ARCHITECTURE.md`.

pub use ebb_core::{
    clock, config, event, gateway, ids, limits, mutation, scaler, state, story, timing, waiting,
    warm,
};
/// The proxy, its own crate (`ebb_proxy`).
pub use ebb_proxy as proxy;
/// The deterministic simulator (`ebb simulate`), its own crate on the core alone.
pub use ebb_sim as sim;

pub mod api;
pub mod calls;
pub mod cleaner;
pub mod discovery;
pub mod example_app;
pub mod functions;
pub mod load;
pub mod log;
pub mod metrics;
pub mod orchestrator;
pub mod peers;
pub mod queue;
pub mod serve;
pub mod strict;
pub mod telemetry;
pub mod tls;
pub mod tools;
