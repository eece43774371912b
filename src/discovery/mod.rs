//! Service discovery and load balancing: whenever ebb sends a request (the proxy to a workload's
//! replicas, a runner to a function, one ebb replica to another) it resolves a service to its
//! instances and picks one.
//!
//! * [`ServiceId`]: a URI naming a service (`http://host:port`, `conf://name`,
//!   `k8s://service.namespace:port`, `k8s-env://name`, `ebb://app`).
//! * [`Policy`]: which load balancer picks, with slow start, outlier ejection and a panic
//!   threshold; [`Picker`]: a policy applied to one list of [`Instance`]s.
//!
//! The module is a library: it records no events. What it decides per request (which instance)
//! is not a decision of the log; what it learns (latency, load, failures) lives in memory with
//! the instance.

pub mod balance;
pub mod id;
pub mod policy;

pub use balance::{HasInstance, Instance, Outcome, PickAt, Picker, hash_key, parse_load};
pub use id::{IdError, ServiceId};
pub use policy::{Balancer, HashOn, Policy};
