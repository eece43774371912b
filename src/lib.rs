//! ebb: a serverless platform for HTTP workloads and functions on one append-only event log.
//!
//! The pure core is its own crate, `ebb_core` (events, projections, decisions, timing,
//! configuration), re-exported here under the same paths ([`event`], [`state`], ...). This crate
//! is the effects at its edges: the [`log`] and the [`queue`] (their RocksDB and Kafka backends
//! are `ebb_storage`'s, re-exported there), the [`proxy`] (its HTTP/1.x framing is `ebb_http`'s),
//! [`api`], the [`orchestrator`]s, the runtimes of [`calls`], [`functions`], [`cleaner`] and
//! [`discovery`], and [`serve`], which wires `ebb serve`. The simulator is `ebb_sim` ([`sim`]);
//! the command line is the binary's (`src/bin/ebb/`). See `ARCHITECTURE.md`.

pub use ebb_core::{
    clock, config, event, ids, limits, mutation, scaler, state, story, timing, waiting, warm,
};
/// The deterministic simulator (`ebb simulate`), its own crate on the core alone.
pub use ebb_sim as sim;

pub mod api;
pub mod calls;
pub mod cleaner;
pub mod discovery;
pub mod example_app;
pub mod functions;
pub mod log;
pub mod metrics;
pub mod orchestrator;
pub mod peers;
pub mod proxy;
pub mod queue;
pub mod serve;
pub mod strict;
pub mod tls;
pub mod tools;
