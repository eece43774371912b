//! The simulated cluster: one Deployment (replicas, `last-used` annotation, version), its pods
//! (start delay, readiness, termination) and the leadership lease. It is the simulator's
//! [`Coordinator`] (the Kubernetes API, atomic per request; latency and errors are added by the
//! simulator around each request) and its [`Orchestrator`] (what a replica's watch shows).
//!
//! A stopping pod refuses new connections, and exits once its requests are done or is killed
//! after the grace period, when a request it still held meets a connection closed without an
//! answer: the two misses the proxy's retry rule must cover.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::watch;

use crate::scenario::Range;
use ebb_core::clock::{Clock, SimClock};
use ebb_core::orchestrator::{self, Observed, Orchestrator, WorkloadSpec};
use ebb_core::scaler::shared::{CoordError, Coordinator, Lease, SharedDeployment};

/// A pod's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodState {
    /// Started; ready at the time given.
    Starting { ready_at: u64 },
    /// Serving.
    Ready,
    /// Asked to stop: refuses new connections, ends the requests it has, then exits (not
    /// before the time given).
    Stopping { exit_at: u64 },
    /// Exited.
    Gone,
}

/// One pod.
#[derive(Debug, Clone)]
pub struct Pod {
    /// Its address (unique over the run).
    pub addr: SocketAddr,
    /// Where it is in its life.
    pub state: PodState,
    /// Requests it is serving.
    pub in_flight: u32,
}

/// Something the simulator must do at a time: a pod becomes ready or may exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodTimer {
    /// Check readiness of pod `i`.
    Ready(usize),
    /// Check exit of pod `i`.
    Exit(usize),
    /// The grace period of stopping pod `i` is over: it is killed with whatever it still serves.
    Kill(usize),
}

/// What a timer did.
#[derive(Debug, Clone, Default)]
pub struct Fired {
    /// For the trace.
    pub what: Option<String>,
    /// A pod killed with requests in flight: they end without an answer.
    pub killed: Option<SocketAddr>,
}

struct Inner {
    now_ms: u64,
    rng: ChaCha8Rng,
    deployment: SharedDeployment,
    lease: Lease,
    pods: Vec<Pod>,
    timers: Vec<(u64, PodTimer)>,
    start_ms: Range,
    stop_ms: Range,
    grace_ms: u64,
    changes: u64,
}

/// The cluster.
pub struct SimCluster {
    name: String,
    clock: SimClock,
    inner: Mutex<Inner>,
    changes: watch::Sender<u64>,
}

impl SimCluster {
    /// One deployment named `name` at zero replicas. A stopping pod exits `stop_ms` after its
    /// requests end, and is killed `grace_ms` after it was asked to stop.
    pub fn new(
        name: &str,
        clock: SimClock,
        seed: u64,
        start_ms: Range,
        stop_ms: Range,
        grace_ms: u64,
    ) -> Self {
        Self {
            name: name.to_owned(),
            clock,
            inner: Mutex::new(Inner {
                now_ms: 0,
                rng: ChaCha8Rng::seed_from_u64(seed),
                deployment: SharedDeployment {
                    replicas: 0,
                    last_used_ms: 0,
                    version: 1,
                },
                lease: Lease {
                    holder: None,
                    until_ms: 0,
                    version: 1,
                },
                pods: Vec::new(),
                timers: Vec::new(),
                start_ms,
                stop_ms,
                grace_ms,
                changes: 0,
            }),
            changes: watch::channel(0).0,
        }
    }

    /// The state, with the time read from the simulated clock.
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        let mut g = self.inner.lock().expect("sim cluster lock");
        g.now_ms = self.clock.now_ms();
        g
    }

    /// Timers the simulator must schedule (taken once).
    pub fn take_timers(&self) -> Vec<(u64, PodTimer)> {
        std::mem::take(&mut self.lock().timers)
    }

    /// Runs a timer.
    pub fn fire(&self, timer: PodTimer) -> Fired {
        let mut g = self.lock();
        let now = g.now_ms;
        match timer {
            PodTimer::Ready(i) => {
                if let PodState::Starting { ready_at } = g.pods[i].state
                    && ready_at <= now
                {
                    g.pods[i].state = PodState::Ready;
                    g.changes += 1;
                    return Fired {
                        what: Some(format!("pod {} ready", g.pods[i].addr)),
                        killed: None,
                    };
                }
            }
            PodTimer::Exit(i) => {
                return Fired {
                    what: exit_if_done(&mut g, i),
                    killed: None,
                };
            }
            PodTimer::Kill(i) => {
                if matches!(g.pods[i].state, PodState::Stopping { .. }) {
                    let pod = &mut g.pods[i];
                    pod.state = PodState::Gone;
                    let killed = (pod.in_flight > 0).then_some(pod.addr);
                    let what = format!(
                        "pod {} killed after its grace period ({} in flight)",
                        pod.addr, pod.in_flight
                    );
                    pod.in_flight = 0;
                    g.changes += 1;
                    return Fired {
                        what: Some(what),
                        killed,
                    };
                }
            }
        }
        Fired::default()
    }

    /// A connection to `addr`: `Ok` if a ready pod accepts it (the request is now in flight
    /// there), `Err` with the pod's state if refused.
    pub fn connect(&self, addr: SocketAddr) -> Result<(), String> {
        let mut g = self.lock();
        match g.pods.iter_mut().find(|p| p.addr == addr) {
            Some(p) if p.state == PodState::Ready => {
                p.in_flight += 1;
                Ok(())
            }
            Some(p) => Err(format!("{:?}", p.state)),
            None => Err("no such pod".into()),
        }
    }

    /// A request on `addr` ended.
    pub fn done(&self, addr: SocketAddr) {
        let mut g = self.lock();
        if let Some(i) = g.pods.iter().position(|p| p.addr == addr) {
            g.pods[i].in_flight = g.pods[i].in_flight.saturating_sub(1);
            let _ = exit_if_done(&mut g, i);
        }
    }

    /// Pods in each state: (starting, ready, stopping).
    pub fn counts(&self) -> (u32, u32, u32) {
        let g = self.lock();
        let mut c = (0, 0, 0);
        for p in &g.pods {
            match p.state {
                PodState::Starting { .. } => c.0 += 1,
                PodState::Ready => c.1 += 1,
                PodState::Stopping { .. } => c.2 += 1,
                PodState::Gone => {}
            }
        }
        c
    }
}

fn exit_if_done(g: &mut Inner, i: usize) -> Option<String> {
    let now = g.now_ms;
    if let PodState::Stopping { exit_at } = g.pods[i].state
        && exit_at <= now
        && g.pods[i].in_flight == 0
    {
        g.pods[i].state = PodState::Gone;
        g.changes += 1;
        return Some(format!("pod {} exited", g.pods[i].addr));
    }
    None
}

fn draw(rng: &mut ChaCha8Rng, [lo, hi]: Range) -> u64 {
    rng.random_range(lo..=hi)
}

/// Starts or stops pods until the live ones (starting or ready) match the replicas asked for;
/// the newest stop first.
fn reconcile(g: &mut Inner) {
    let now = g.now_ms;
    let live = g
        .pods
        .iter()
        .filter(|p| matches!(p.state, PodState::Starting { .. } | PodState::Ready))
        .count() as u32;
    let want = g.deployment.replicas;
    if want > live {
        for _ in live..want {
            let i = g.pods.len();
            let at = now + draw(&mut g.rng, g.start_ms);
            g.pods.push(Pod {
                addr: SocketAddr::from((
                    Ipv4Addr::new(10, 0, (i / 250) as u8, (i % 250) as u8 + 1),
                    8080,
                )),
                state: PodState::Starting { ready_at: at },
                in_flight: 0,
            });
            g.timers.push((at, PodTimer::Ready(i)));
        }
    } else {
        let mut extra = live - want;
        for i in (0..g.pods.len()).rev() {
            if extra == 0 {
                break;
            }
            if matches!(g.pods[i].state, PodState::Starting { .. } | PodState::Ready) {
                let at = now + draw(&mut g.rng, g.stop_ms);
                g.pods[i].state = PodState::Stopping { exit_at: at };
                g.timers.push((at, PodTimer::Exit(i)));
                let kill = now + g.grace_ms;
                g.timers.push((kill, PodTimer::Kill(i)));
                extra -= 1;
            }
        }
    }
    g.changes += 1;
}

impl SimCluster {
    pub(crate) fn deployment_now(&self, name: &str) -> Result<SharedDeployment, CoordError> {
        if name != self.name {
            return Err(CoordError::NotFound(name.to_owned()));
        }
        Ok(self.lock().deployment.clone())
    }

    pub(crate) fn scale_now(
        &self,
        name: &str,
        replicas: u32,
        if_version: Option<u64>,
    ) -> Result<u64, CoordError> {
        if name != self.name {
            return Err(CoordError::NotFound(name.to_owned()));
        }
        let mut g = self.lock();
        if if_version.is_some_and(|v| v != g.deployment.version) {
            return Err(CoordError::Conflict);
        }
        g.deployment.replicas = replicas;
        g.deployment.version += 1;
        reconcile(&mut g);
        Ok(g.deployment.version)
    }

    pub(crate) fn touch_now(&self, name: &str, last_used_ms: u64) -> Result<u64, CoordError> {
        if name != self.name {
            return Err(CoordError::NotFound(name.to_owned()));
        }
        let mut g = self.lock();
        if last_used_ms > g.deployment.last_used_ms {
            g.deployment.last_used_ms = last_used_ms;
            g.deployment.version += 1;
        }
        Ok(g.deployment.version)
    }

    pub(crate) fn lease_now(&self) -> Result<Lease, CoordError> {
        Ok(self.lock().lease.clone())
    }

    pub(crate) fn take_lease_now(
        &self,
        holder: &str,
        until_ms: u64,
        if_version: u64,
    ) -> Result<u64, CoordError> {
        let mut g = self.lock();
        if g.lease.version != if_version {
            return Err(CoordError::Conflict);
        }
        g.lease = Lease {
            holder: Some(holder.to_owned()),
            until_ms,
            version: if_version + 1,
        };
        Ok(g.lease.version)
    }
}

/// The simulated cluster answers every request at once.
impl Coordinator for SimCluster {
    fn deployment(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<SharedDeployment, CoordError>> + Send {
        std::future::ready(self.deployment_now(name))
    }

    fn scale(
        &self,
        name: &str,
        replicas: u32,
        if_version: Option<u64>,
    ) -> impl Future<Output = Result<u64, CoordError>> + Send {
        std::future::ready(self.scale_now(name, replicas, if_version))
    }

    fn touch(
        &self,
        name: &str,
        last_used_ms: u64,
    ) -> impl Future<Output = Result<u64, CoordError>> + Send {
        std::future::ready(self.touch_now(name, last_used_ms))
    }

    fn lease(&self) -> impl Future<Output = Result<Lease, CoordError>> + Send {
        std::future::ready(self.lease_now())
    }

    fn take_lease(
        &self,
        holder: &str,
        until_ms: u64,
        if_version: u64,
    ) -> impl Future<Output = Result<u64, CoordError>> + Send {
        std::future::ready(self.take_lease_now(holder, until_ms, if_version))
    }
}

impl Orchestrator for SimCluster {
    fn register(&self, spec: WorkloadSpec) -> orchestrator::Result<()> {
        if spec.name != self.name {
            return Err(orchestrator::Error::InvalidSpec {
                name: spec.name,
                why: "the simulated cluster runs one deployment".into(),
            });
        }
        Ok(())
    }

    fn scale(&self, name: &str, replicas: u32) -> orchestrator::Result<()> {
        self.scale_now(name, replicas, None)
            .map(|_| ())
            .map_err(|_| orchestrator::Error::UnknownWorkload(name.to_owned()))
    }

    fn observe(&self, name: &str) -> Option<Observed> {
        if name != self.name {
            return None;
        }
        let g = self.lock();
        let mut o = Observed {
            desired: g.deployment.replicas,
            spawns: g.pods.len() as u64,
            ..Observed::default()
        };
        for p in &g.pods {
            match p.state {
                PodState::Starting { .. } => o.starting += 1,
                PodState::Ready => o.ready.push(p.addr),
                PodState::Stopping { .. } => o.stopping += 1,
                PodState::Gone => {}
            }
        }
        Some(o)
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.changes.send_replace(self.lock().changes);
        self.changes.subscribe()
    }
}
