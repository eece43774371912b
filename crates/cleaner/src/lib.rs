//! Cleaners at run time: the evaluation loop ([`runtime`]: when each cleaner is evaluated, its
//! evaluations and firings logged, the [`runtime::Backend`] contract a kind of target implements)
//! and the targets that are ebb's own objects ([`local`]: apps, functions, ended calls and
//! instances, on every replica). What a cleaner is, its CEL conditions and when it fires are the
//! core's (`ebb_core::cleaner`, re-exported here); the Kubernetes targets are ebb-kube's.

pub use ebb_core::cleaner::*;

// The core's modules and the log under the paths the files name them by.
use ebb_core::{clock, event, functions, state};
use ebb_storage::log;

pub mod local;
pub mod runtime;
