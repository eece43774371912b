//! Cleaners: what a cleaner is and when it fires are the core's (`ebb_core::cleaner`); the
//! evaluation loop ([`runtime`]) and the local targets ([`local`]) are `ebb_cleaner`'s, the
//! Kubernetes watches and deletions ([`kube`]) `ebb_kube`'s; all under this one path.

pub use ebb_cleaner::*;
pub use ebb_kube::cleaner as kube;
