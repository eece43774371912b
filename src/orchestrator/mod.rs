//! The orchestrators that run the workloads behind routes: [`process`] (local processes, one
//! machine, nothing else installed) and [`kube`] (Deployments, with the Lease and the shared
//! scaling protocol in [`kube_coordinator`]; functions' objects in [`kube_functions`] and
//! [`kube_templates`]): the Kubernetes ones are `ebb_kube`'s, re-exported under these names. The
//! [`Orchestrator`] contract is the core's (`ebb_core::orchestrator`).

mod listener;
pub mod process;

pub use ebb_core::orchestrator::*;
pub use ebb_kube::{
    coordinator as kube_coordinator, functions as kube_functions, health as kube_health,
    orchestrator as kube, templates as kube_templates,
};
pub use process::{ProcessOptions, ProcessOrchestrator};
