//! ebb: a serverless platform for HTTP workloads and functions on one append-only event log.
//!
//! The core ([`event`], [`state`]) is pure: it folds events into state and decides new events
//! from `(state, input, now)`. IO lives at the edges: [`log`] (RocksDB), [`api`] (HTTP), the
//! command line in `main.rs`. Time comes only from a [`clock::Clock`]. See `ARCHITECTURE.md`.

pub mod api;
pub mod bench;
pub mod calls;
pub mod cleaner;
pub mod clock;
pub mod config;
pub mod discovery;
pub mod event;
pub mod example_app;
pub mod functions;
#[doc(hidden)]
pub mod fuzzing;
pub mod limits;
pub mod log;
pub mod metrics;
pub mod mutation;
pub mod orchestrator;
pub mod peers;
pub mod proxy;
pub mod queue;
pub mod scaler;
pub mod serve;
pub mod sim;
pub mod state;
pub mod story;
pub mod timing;
pub mod tls;
pub mod tools;
