//! One ebb replica's side of the shared-scaling protocol ([`super::shared`]) as a sans-IO state
//! machine: it is told what happens (a tick, its traffic, the answer to a request) and says which
//! request to make to the coordination store next. It does no IO and reads no clock; its driver
//! does both. Two drivers run it: the simulator (`crates/sim/src/world.rs`), which delivers requests
//! with latency, errors, pauses and crashes, and the Kubernetes backend
//! (`orchestrator::kube`), which sends them to the API server. So the simulator proves the code
//! that runs in the cluster.
//!
//! Three loops, each with at most one request in flight per deployment (the lease: one in all):
//!
//! * **Lease** ([`Member::lease_tick`], every third of the lease): read the lease, then take or
//!   renew it when [`super::shared::decide_lease`] says so, conditioned on the version read.
//! * **Bump** ([`Member::touch_check`], on traffic and every half sync interval): publish the
//!   replica's last use when the annotation it knows is a sync interval behind
//!   ([`super::shared::decide_touch`]); retried up to [`TOUCH_ATTEMPTS`] times.
//! * **Downscale** ([`Member::downscale_tick`], only while leading): read the deployment, decide
//!   with [`super::shared::decide_downscale`], write the scale-down conditioned on the version
//!   read; once the write took effect the decision is the driver's to record
//!   ([`Next::Record`]); a conflict ([`Next::Refused`]) means someone used it meanwhile.

use std::collections::BTreeMap;

use super::Live;
use super::shared::{self, CoordError, Coordinator, Lease, SharedDeployment, SharedOptions};
use crate::event::Event;
use crate::state::State;

/// Attempts at a bump before it is given up (the next use decides another).
pub const TOUCH_ATTEMPTS: u32 = 8;

/// A request to the coordination store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Read the lease.
    ReadLease,
    /// Take or renew the lease until `until_ms`, if it is still at `if_version`.
    TakeLease { until_ms: u64, if_version: u64 },
    /// Raise a deployment's last-used annotation to `last_used_ms`.
    Touch {
        deployment: String,
        last_used_ms: u64,
    },
    /// Read a deployment (replicas, annotation, version).
    Read { deployment: String },
    /// Scale a deployment down as `decision` says, if it is still at `if_version`.
    ScaleDown {
        deployment: String,
        to: u32,
        if_version: Option<u64>,
        decision: Box<Event>,
    },
}

/// What the store answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Lease(Lease),
    Version(u64),
    Deployment(SharedDeployment),
}

/// What the driver does after an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Nothing more.
    Done,
    /// Send this request (a follow-up, or the same one again: `attempt` is its attempt number).
    Send { request: Request, attempt: u32 },
    /// The scale-down took effect: record its decision in the log.
    Record(Box<Event>),
    /// The scale-down was refused: the deployment changed since it was read.
    Refused,
}

#[derive(Debug, Clone, Default)]
struct Deployment {
    /// The newest last use this replica knows is published.
    known_used: u64,
    touching: bool,
    downscaling: bool,
}

/// One ebb replica in the protocol.
#[derive(Debug, Clone)]
pub struct Member {
    name: String,
    opts: SharedOptions,
    lease: Lease,
    leasing: bool,
    deployments: BTreeMap<String, Deployment>,
}

impl Member {
    /// Replica `name` with the protocol's timing.
    pub fn new(name: &str, opts: SharedOptions) -> Self {
        Self {
            name: name.to_owned(),
            opts,
            lease: Lease::default(),
            leasing: false,
            deployments: BTreeMap::new(),
        }
    }

    /// This replica's name (the lease holder it writes).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The protocol's timing.
    pub fn options(&self) -> &SharedOptions {
        &self.opts
    }

    /// Whether this replica leads at `now_ms` (its own clock).
    pub fn leads(&self, now_ms: u64) -> bool {
        shared::leads(&self.lease, &self.name, now_ms, &self.opts)
    }

    /// The lease as this replica last saw it.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The newest last use of `deployment` this replica knows is published.
    pub fn known_used(&self, deployment: &str) -> u64 {
        self.deployments.get(deployment).map_or(0, |d| d.known_used)
    }

    /// Takes the last use of `deployment` published by anyone, as read from the store.
    pub fn saw(&mut self, deployment: &str, last_used_ms: u64) {
        let d = self.deployments.entry(deployment.to_owned()).or_default();
        d.known_used = d.known_used.max(last_used_ms);
    }

    /// Forgets everything (a restart): no lease, nothing known, nothing in flight.
    pub fn reset(&mut self) {
        self.lease = Lease::default();
        self.leasing = false;
        self.deployments.clear();
    }

    /// Forgets the deployments not in `keep` (their routes are gone).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.deployments.retain(|d, _| keep(d));
    }

    /// The lease loop's tick: read the lease, unless a lease request is under way.
    pub fn lease_tick(&mut self) -> Option<Request> {
        if self.leasing {
            return None;
        }
        self.leasing = true;
        Some(Request::ReadLease)
    }

    /// The bump: given the replica's last use of `deployment` (`last_at_ms`) and the requests in
    /// flight there, the bump to send, unless one is under way or none is due.
    pub fn touch_check(
        &mut self,
        deployment: &str,
        last_at_ms: u64,
        in_flight: u64,
        now_ms: u64,
    ) -> Option<Request> {
        let d = self.deployments.entry(deployment.to_owned()).or_default();
        if d.touching {
            return None;
        }
        let v = shared::decide_touch(d.known_used, last_at_ms, in_flight, now_ms, &self.opts)?;
        d.touching = true;
        Some(Request::Touch {
            deployment: deployment.to_owned(),
            last_used_ms: v,
        })
    }

    /// The downscale loop's tick for `deployment`: read it, if this replica leads and no
    /// scale-down of it is under way.
    pub fn downscale_tick(&mut self, deployment: &str, now_ms: u64) -> Option<Request> {
        if !self.leads(now_ms) {
            return None;
        }
        let d = self.deployments.entry(deployment.to_owned()).or_default();
        if d.downscaling {
            return None;
        }
        d.downscaling = true;
        Some(Request::Read {
            deployment: deployment.to_owned(),
        })
    }

    /// Takes the answer to `request` (its `attempt`-th try). `state` and `live` are the
    /// replica's log projection and unflushed traffic of the deployment read, for a downscale
    /// decision; `now_ms` is its clock.
    pub fn answer(
        &mut self,
        request: Request,
        answer: Result<Answer, CoordError>,
        attempt: u32,
        state: &State,
        live: Live,
        now_ms: u64,
    ) -> Next {
        match (request, answer) {
            (Request::ReadLease, Ok(Answer::Lease(l))) => {
                match shared::decide_lease(&l, &self.name, now_ms, &self.opts) {
                    Some(until_ms) => {
                        let if_version = l.version;
                        self.lease = l;
                        Next::Send {
                            request: Request::TakeLease {
                                until_ms,
                                if_version,
                            },
                            attempt: 0,
                        }
                    }
                    None => {
                        self.lease = l;
                        self.leasing = false;
                        Next::Done
                    }
                }
            }
            (Request::TakeLease { until_ms, .. }, Ok(Answer::Version(v))) => {
                self.lease = Lease {
                    holder: Some(self.name.clone()),
                    until_ms,
                    version: v,
                };
                self.leasing = false;
                Next::Done
            }
            (Request::ReadLease | Request::TakeLease { .. }, _) => {
                self.leasing = false;
                Next::Done
            }
            (
                Request::Touch {
                    deployment,
                    last_used_ms,
                },
                Ok(_),
            ) => {
                let d = self.deployments.entry(deployment).or_default();
                d.touching = false;
                d.known_used = d.known_used.max(last_used_ms);
                Next::Done
            }
            (request @ Request::Touch { .. }, Err(_)) => {
                if attempt + 1 < TOUCH_ATTEMPTS {
                    return Next::Send {
                        request,
                        attempt: attempt + 1,
                    };
                }
                if let Request::Touch { deployment, .. } = request {
                    self.deployments.entry(deployment).or_default().touching = false;
                }
                Next::Done
            }
            (Request::Read { deployment }, Ok(Answer::Deployment(shared))) => {
                let d = self.deployments.entry(deployment.clone()).or_default();
                match shared::decide_downscale(
                    state,
                    &deployment,
                    &shared,
                    live,
                    now_ms,
                    &self.opts,
                ) {
                    Some((decision @ Event::ScaleRequested { to, .. }, if_version)) => Next::Send {
                        request: Request::ScaleDown {
                            deployment,
                            to,
                            if_version,
                            decision: Box::new(decision),
                        },
                        attempt: 0,
                    },
                    _ => {
                        d.downscaling = false;
                        Next::Done
                    }
                }
            }
            (Request::Read { deployment }, _) => {
                self.deployments.entry(deployment).or_default().downscaling = false;
                Next::Done
            }
            (
                Request::ScaleDown {
                    deployment,
                    decision,
                    ..
                },
                answer,
            ) => {
                self.deployments.entry(deployment).or_default().downscaling = false;
                match answer {
                    Ok(_) => Next::Record(decision),
                    Err(CoordError::Conflict) => Next::Refused,
                    Err(_) => Next::Done,
                }
            }
        }
    }
}

/// Sends `request` to `store` as replica `holder`.
pub async fn send<C: Coordinator>(
    store: &C,
    holder: &str,
    request: &Request,
) -> Result<Answer, CoordError> {
    match request {
        Request::ReadLease => store.lease().await.map(Answer::Lease),
        Request::TakeLease {
            until_ms,
            if_version,
        } => store
            .take_lease(holder, *until_ms, *if_version)
            .await
            .map(Answer::Version),
        Request::Touch {
            deployment,
            last_used_ms,
        } => store
            .touch(deployment, *last_used_ms)
            .await
            .map(Answer::Version),
        Request::Read { deployment } => store.deployment(deployment).await.map(Answer::Deployment),
        Request::ScaleDown {
            deployment,
            to,
            if_version,
            ..
        } => store
            .scale(deployment, *to, *if_version)
            .await
            .map(Answer::Version),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const O: SharedOptions = SharedOptions {
        sync_ms: 500,
        sync_lag_ms: 1_000,
        lease_ms: 3_000,
        max_skew_ms: 50,
    };

    fn answer(m: &mut Member, r: Request, a: Result<Answer, CoordError>, now: u64) -> Next {
        m.answer(r, a, 0, &State::default(), Live::default(), now)
    }

    #[test]
    fn the_lease_is_read_then_taken_with_the_version_read_and_only_then_leads() {
        let mut m = Member::new("a", O);
        assert_eq!(m.lease_tick(), Some(Request::ReadLease));
        assert_eq!(m.lease_tick(), None, "one lease request at a time");
        let next = answer(
            &mut m,
            Request::ReadLease,
            Ok(Answer::Lease(Lease::default())),
            10,
        );
        let take = Request::TakeLease {
            until_ms: 3_010,
            if_version: 0,
        };
        assert_eq!(
            next,
            Next::Send {
                request: take.clone(),
                attempt: 0
            }
        );
        assert!(!m.leads(10));
        assert_eq!(answer(&mut m, take, Ok(Answer::Version(1)), 20), Next::Done);
        assert!(m.leads(20));
        assert_eq!(
            m.downscale_tick("d", 20),
            Some(Request::Read {
                deployment: "d".into()
            })
        );
        assert_eq!(m.downscale_tick("d", 20), None, "one read at a time");
        // Past its lease (less the skew), it no longer leads.
        assert!(!m.leads(2_960));
    }

    #[test]
    fn a_failed_bump_is_retried_a_bounded_number_of_times() {
        let mut m = Member::new("a", O);
        let t = m.touch_check("d", 1_000, 0, 1_000).expect("a bump");
        assert_eq!(m.touch_check("d", 2_000, 0, 2_000), None, "one at a time");
        let mut attempt = 0;
        let mut request = t;
        loop {
            match m.answer(
                request.clone(),
                Err(CoordError::Unavailable("down".into())),
                attempt,
                &State::default(),
                Live::default(),
                1_000,
            ) {
                Next::Send {
                    request: r,
                    attempt: a,
                } => {
                    request = r;
                    attempt = a;
                }
                Next::Done => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(attempt + 1, TOUCH_ATTEMPTS);
        assert!(m.touch_check("d", 2_000, 0, 2_000).is_some(), "free again");
    }

    #[test]
    fn a_refused_scale_down_is_not_recorded() {
        let mut m = Member::new("a", O);
        let decision = Event::ScaleRequested {
            deployment: "d".into(),
            from: 1,
            to: 0,
            reason: crate::event::ScaleReason::Idle,
        };
        let write = Request::ScaleDown {
            deployment: "d".into(),
            to: 0,
            if_version: Some(4),
            decision: Box::new(decision.clone()),
        };
        assert_eq!(
            answer(&mut m, write.clone(), Err(CoordError::Conflict), 0),
            Next::Refused
        );
        assert_eq!(
            answer(&mut m, write, Ok(Answer::Version(5)), 0),
            Next::Record(Box::new(decision))
        );
    }
}
