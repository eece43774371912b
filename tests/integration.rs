//! The integration tests, one module per file of `tests/`, in one binary that Cargo builds and
//! links once (28 binaries, each with its own copy of `common`, took most of the test build).
//! `tests/kube.rs` (the Kubernetes control plane) and `tests/soak.rs` (a timed run) are binaries
//! of their own, so that the test command runs them beside this one. One file's tests:
//! `cargo test --test integration proxy::`.

mod common;

mod access;
mod admin;
mod calls;
mod cleaners;
mod cli;
mod crash;
mod crash_serve;
mod dashboard;
mod discovery;
mod diskfull;
mod functions;
mod fuzz_regressions;
mod grpc;
mod hostile;
mod image;
mod layers;
mod limits;
mod metrics;
mod orchestrator;
mod properties;
mod proxy;
mod queue;
mod scaling;
mod schema;
mod simulation;
mod tcp;
mod timeouts;
mod tls;
mod traces;
mod waiting;
mod warm;
