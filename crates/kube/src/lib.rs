//! ebb on Kubernetes: the effects that speak to the API server.
//!
//! * [`orchestrator`]: routes from annotated Services, replicas through the `/scale` subresource
//!   of Deployments and StatefulSets, ready addresses from EndpointSlices; [`coordinator`]: the
//!   Lease and the shared scaling protocol between ebb's replicas.
//! * [`templates`]: function templates as `Func` resources, the store every replica follows;
//!   [`functions`]: the Deployment and Service each template with an image becomes.
//! * [`cleaner`]: `Cleaner` resources and the watches and deletions of their targets (the
//!   evaluation loop is `ebb_cleaner`'s).
//! * [`gateway`]: the Gateway API controller (GatewayClasses, Gateways, HTTPRoutes,
//!   ReferenceGrants): the proxy's Gateway sockets and the objects' statuses.
//! * [`endpoints`]: the `k8s://` and `k8s-env://` discovery sources (the discovery contract is
//!   `ebb_proxy`'s).
//! * [`reviews`]: `TokenReview` and `SubjectAccessReview`, whose a bearer token is and what it
//!   may do (`--kube-auth`).
//!
//! The decisions are the core's (`ebb_core`), the log `ebb_storage`'s; nothing here decides what
//! the log does not record.

// The core's modules and the log under the paths the files name them by.
use ebb_core::{clock, event, scaler, state};
use ebb_storage::log;

pub mod cleaner;
pub mod coordinator;
pub mod endpoints;
pub mod functions;
pub mod gateway;
pub mod health;
pub mod orchestrator;
pub mod reviews;
pub mod templates;
