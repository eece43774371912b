//! ebb's pure core: everything that decides, and nothing that does.
//!
//! Events and their codec ([`event`]), the projections that fold them ([`state`]), the pure
//! decisions (scaling in [`scaler`], calls in [`state::calls`] and [`calls`], [`functions`],
//! [`cleaner`]), time ([`timing`], [`clock`]), configuration ([`config`], [`warm`],
//! [`waiting`], [`orchestrator::annotations`], [`limits`]), ids and names ([`ids`]), traffic
//! policies and balancers ([`discovery`]), stories ([`story`]), the contracts the effects
//! implement ([`log::LogStore`], [`queue::Queue`], [`orchestrator::Orchestrator`]) with the
//! in-memory log store, and the simulator's mutations ([`mutation`]).
//!
//! It has no IO runtime: no tokio runtime or net, no RocksDB, no librdkafka, no hyper, no
//! Kubernetes client (Cargo enforces it: none is a dependency). Time comes in as an argument or
//! from a [`clock::Clock`]; randomness from a seeded generator.

pub mod calls;
pub mod cleaner;
pub mod clock;
pub mod config;
pub mod discovery;
pub mod event;
pub mod functions;
pub mod gateway;
pub mod ids;
pub mod limits;
pub mod log;
pub mod mutation;
pub mod orchestrator;
pub mod policy;
pub mod queue;
pub mod scaler;
pub mod state;
pub mod story;
pub mod timing;
pub mod waiting;
pub mod warm;
