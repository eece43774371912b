//! The orchestrators that run the workloads behind routes: [`process`] (local processes, one
//! machine, nothing else installed) and [`kube`] (Deployments, with the Lease and the shared
//! scaling protocol in [`kube_coordinator`]; functions' objects in [`kube_functions`] and
//! [`kube_templates`]). The [`Orchestrator`] contract is the core's (`ebb_core::orchestrator`).

pub mod kube;
pub mod kube_coordinator;
pub mod kube_functions;
pub mod kube_templates;
pub mod process;

pub use ebb_core::orchestrator::*;
pub use process::{ProcessOptions, ProcessOrchestrator};
