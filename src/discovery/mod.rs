//! Service discovery and load balancing: `ebb_proxy::discovery` (service ids, policies,
//! balancers, DNS) with the Kubernetes sources ([`k8s`], `ebb_kube::endpoints`) beside it.

pub use ebb_kube::endpoints as k8s;
pub use ebb_proxy::discovery::*;
