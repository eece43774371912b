//! Cleaners at run time: the evaluation loop ([`runtime`]), the local targets ([`local`]) and the
//! Kubernetes watches and deletions ([`kube`]). What a cleaner is and when it fires are the core's
//! (`ebb_core::cleaner`).

pub mod kube;
pub mod local;
pub mod runtime;

pub use ebb_core::cleaner::*;
