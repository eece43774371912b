//! Functions at run time: the invocations, instances and autoscaler loop ([`runtime`]). Templates,
//! their validation and the decisions that change them are the core's (`ebb_core::functions`).

pub mod runtime;

pub use ebb_core::functions::*;
